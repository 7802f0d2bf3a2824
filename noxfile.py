"""nox sessions of the nvdd monorepo.

Every dependency list is read from the packages' ``pyproject.toml`` files; nothing
is written twice. Sessions:

- ``deps``        layer order, DAG and import scan (tools/nvdd_deps.py), with its tests
- ``lint``        ruff check and ruff format --check
- ``tests``       per package: that package's sibling closure + its test group only
- ``typecheck``   per package: mypy --strict in that package's closure
- ``integration`` integration_tests/ over gloo with everything installed
- ``check``       per package: typecheck then tests in one environment
- ``checks``      every package at once in ONE environment: one mypy run over all
                  packages, each package's tests and integration_tests/ (in two parts),
                  each its own process, two at a time (``NVDD_CI_LANES``; used by ``ci``;
                  docs/decisions/0075-one-ci-environment.md says what the per-package
                  sessions still add, 0082 why two at a time)
- ``ci``          the README's test command: deps, lint, checks, and beside them (a
                  second nox process) e3nn06 and docs
- ``e3nn06``      the tests of the models on e3nn 0.6 (SevenNet ``[sevenn]``, UMA ``[uma]``) in
                  one environment of their own (``sevenn`` is an alias)
- ``docs``        the docs site (MkDocs, strict: warnings, broken links, undocumented API fail)
- ``demo``        the main job (a domain-decomposed MD run on CPU ranks)
- ``bench``       benchmarks (ratios measured in one run; not tests)
- ``multigpu``    the integration suite over NCCL on >= 2 GPUs (fails with fewer)
- ``multigpu_system`` the same with the interpreter's own environment: no installs
                  (hosts that reach no package index; ``tools/multigpu`` without nox)

Installs use uv (``noxw`` bootstraps a pinned one; nox falls back to pip without it).
Torch: by default (``NVDD_TORCH=cpu``) the CPU build ``torch==2.13.0`` is fetched by
pip once into ``.nox/_shared/wheels`` (pip finds the machine's own wheel, uv does
not) and every session installs that one file, pinned to its exact version
(``2.13.0+cpu``), so no session downloads a CUDA build. Without uv, pip installs it
once into ``.nox/_shared``, shared by every session through a ``.pth`` file. On a
machine whose Python already has the torch you want (a CUDA build, say), set
``NVDD_TORCH=system``: sessions then see the system site-packages and are
constrained to that torch version instead.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import nox

nox.needs_version = ">=2024.4.15"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["ci"]

ROOT = Path(__file__).resolve().parent
ROOT_CFG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["nvdd"]
CPU_TORCH: str = ROOT_CFG["cpu-torch"]
TORCH_MODE = os.environ.get("NVDD_TORCH", "cpu")
if TORCH_MODE not in ("cpu", "system"):
    raise SystemExit(f"NVDD_TORCH must be 'cpu' or 'system', got {TORCH_MODE!r}")
VENV_PARAMS = ["--system-site-packages"] if TORCH_MODE == "system" else []
# uv installs (resolution, downloads, links) in seconds where pip takes minutes; nox
# falls back to venv + pip where no uv is found (noxw's bootstrap installs a pinned one).
# With NVDD_TORCH=system the sessions see the system torch, which only pip's
# resolver takes into account: pip then.
nox.options.default_venv_backend = "uv|venv" if TORCH_MODE == "cpu" else "venv"
# uv writes no bytecode by default (pip compiles at install); where PYTHONDONTWRITEBYTECODE
# is set (CI's shell here) every process, each test rank among them, then compiled torch and
# the rest from source on import: 3.6 s instead of 1.4 s for `import torch, warp`, and the
# suite ran 1.6-3x slower (record 0081). Compile at install instead.
os.environ.setdefault("UV_COMPILE_BYTECODE", "1")
SHARED = ROOT / ".nox" / "_shared"
PY_TAG = f"py{sys.version_info.major}{sys.version_info.minor}"
WARP_CACHE = SHARED / "warp-cache"
TOOLS = ["pytest>=8", "hatchling>=1.24"]


def _name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    return m.group(1).lower().replace("_", "-") if m else req


def _read_packages() -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for pp in sorted((ROOT / "packages").glob("*/pyproject.toml")):
        data = tomllib.loads(pp.read_text())
        out[_name(data["project"]["name"])] = {
            "path": pp.parent,
            "deps": list(data["project"].get("dependencies", [])),
            "extras": dict(data["project"].get("optional-dependencies", {})),
            "groups": dict(data.get("dependency-groups", {})),
        }
    return out


PACKAGES = _read_packages()
LAYERED = sorted(
    (n for n in PACKAGES if n in ROOT_CFG["layers"]), key=lambda n: (ROOT_CFG["layers"][n], n)
)
TESTED = [n for n in (*LAYERED, *sorted(ROOT_CFG["test-only"])) if n in PACKAGES]
#: Extras installed only by their own session (their pins clash with another extra's).
OWN_SESSION_EXTRAS: dict[str, list[str]] = ROOT_CFG.get("own-session-extras", {})


def _closure(
    names: list[str], extras: bool = False, groups: tuple[str, ...] = ()
) -> tuple[list[str], list[str]]:
    """(sibling distributions, third-party requirements) needed by ``names``.

    Follows runtime dependencies (and all extras when ``extras``) of every sibling
    reached; ``groups`` adds the named dependency groups of the starting packages.
    """
    siblings: list[str] = []
    third: list[str] = []
    todo = [(n, True) for n in names]
    while todo:
        name, start = todo.pop()
        if name in siblings:
            continue
        siblings.append(name)
        info = PACKAGES[name]
        reqs = list(info["deps"])  # type: ignore[call-overload]
        if extras:
            for key, extra in info["extras"].items():  # type: ignore[attr-defined]
                if key not in OWN_SESSION_EXTRAS.get(name, ()):  # (they clash: own sessions)
                    reqs += extra
        if start:
            for g in groups:
                reqs += info["groups"].get(g, [])  # type: ignore[attr-defined]
        for req in reqs:
            if _name(req) in PACKAGES:
                todo.append((_name(req), False))
            elif req not in third:
                third.append(req)
    return siblings, third


def _torch_wheel() -> Path:
    """The CPU torch wheel, fetched once into ``.nox/_shared/wheels`` by pip, which
    finds it where uv does not (a machine's own wheel folder, or the pip config's)."""
    wheels = SHARED / "wheels"
    version = CPU_TORCH.split("==")[1]

    def found() -> list[Path]:  # this version, for this Python (cp311: py311's)
        return [
            w
            for w in wheels.glob("torch-*.whl")
            if w.name.split("-")[1].split("+")[0] == version
            and w.name.split("-")[2] == PY_TAG.replace("py", "cp")
        ]

    if not found():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "-d",
                str(wheels),
                CPU_TORCH,
            ],
            check=True,
        )
    return found()[0]


def _torch(session: nox.Session, mode: str) -> tuple[Path, tuple[str, ...]]:
    """Make torch installable or importable in the session: (constraints file,
    extra installer options)."""
    SHARED.mkdir(parents=True, exist_ok=True)
    # one file per session: ci runs two nox processes at once (record 0082), and a
    # file another one is rewriting would read empty (torch unpinned)
    tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", session.name)
    constraints = SHARED / f"constraints-{mode}-{tag}.txt"
    site = session.run(
        "python",
        "-c",
        "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        silent=True,
    )
    assert isinstance(site, str)
    if mode == "cpu" and session.venv_backend == "uv":
        # uv installs torch from that one wheel file into the session, pinned to its
        # exact version (2.13.0+cpu): never a download, never a CUDA build.
        wheel = _torch_wheel()
        Path(site.strip(), "_nvdd_shared_torch.pth").unlink(missing_ok=True)
        constraints.write_text(f"torch=={wheel.name.split('-')[1]}\n")
        return constraints, ("--find-links", str(wheel.parent))
    if mode == "system":
        version = session.run("python", "-c", "import torch; print(torch.__version__)", silent=True)
        assert isinstance(version, str)
        constraints.write_text(f"torch=={version.strip()}\n")
        return constraints, ()
    target = SHARED / f"torch-{CPU_TORCH.split('==')[1]}-{PY_TAG}"
    if not (target / "torch" / "__init__.py").is_file():
        session.log(f"installing {CPU_TORCH} (CPU) once into {target}")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--target", str(target), CPU_TORCH],
            check=True,
        )
    Path(site.strip(), "_nvdd_shared_torch.pth").write_text(f"{target}\n")
    constraints.write_text(f"{CPU_TORCH}\n")
    return constraints, ()


def _install(
    session: nox.Session,
    names: list[str],
    *,
    extras: bool = False,
    groups: tuple[str, ...] = ("test",),
    more: tuple[str, ...] = (),
    torch_mode: str = TORCH_MODE,
) -> None:
    """Install exactly the sibling closure of ``names`` plus third-party needs."""
    constraints, options = _torch(session, torch_mode)
    siblings, third = _closure(names, extras=extras, groups=groups)
    session.install("-c", str(constraints), *options, *TOOLS, *third, *more)
    paths = [str(PACKAGES[s]["path"]) for s in siblings]
    session.install(
        "-c", str(constraints), "--no-deps", "--no-build-isolation", "--force-reinstall", *paths
    )
    session.env["WARP_CACHE_PATH"] = str(WARP_CACHE)
    if extras or "test" in groups:
        # what the tests import through nvdd.testing.importorskip_extra is installed
        # here: a missing module is a broken install, so it fails instead of skipping
        session.env["NVDD_REQUIRE_EXTRAS"] = "1"


@nox.session
def deps(session: nox.Session) -> None:
    """Layer order, DAG and import scan of every package (with the checker's tests,
    and those of the docs build's docstring check, which need the docs group's griffe)."""
    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["dependency-groups"]
    session.install("pytest>=8", *(r for r in groups["docs"] if r.startswith("griffe")))
    session.env["NVDD_REQUIRE_EXTRAS"] = "1"  # (a missing griffe fails, not skips)
    session.run("pytest", "-q", "-p", "no:cacheprovider", "tools/tests", *session.posargs)
    session.run("python", "tools/nvdd_deps.py", str(ROOT))


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".", *session.posargs)
    session.run("ruff", "format", "--check", ".")


def _run_tests(session: nox.Session, package: str, posargs: list[str]) -> None:
    tests_dir = PACKAGES[package]["path"] / "tests"  # type: ignore[operator]
    session.run("pytest", "-q", str(tests_dir), *posargs)


def _run_mypy(session: nox.Session, package: str, posargs: list[str]) -> None:
    src = PACKAGES[package]["path"] / "src"  # type: ignore[operator]
    leaf = next(src.glob("*/*/__about__.py")).parent.relative_to(src)
    with session.chdir(src):
        session.run(
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "-p",
            ".".join(leaf.parts),
            *posargs,
        )


def _mypy_all(packages: list[str]) -> tuple[list[str], dict[str, str]]:
    """One mypy run over ``packages`` (their sources, one cache): its command and
    environment. Imports between them resolve to the sources through MYPYPATH, as
    in the per-package runs."""
    srcs = [PACKAGES[p]["path"] / "src" for p in packages]  # type: ignore[operator]
    args: list[str] = []
    for src in srcs:
        leaf = next(src.glob("*/*/__about__.py")).parent.relative_to(src)
        args += ["-p", ".".join(leaf.parts)]
    cmd = ["mypy", "--config-file", str(ROOT / "pyproject.toml"), *args]
    return cmd, {"MYPYPATH": os.pathsep.join(str(s) for s in srcs)}


@nox.session(venv_params=VENV_PARAMS)
@nox.parametrize("package", TESTED, ids=TESTED)
def tests(session: nox.Session, package: str) -> None:
    """One package's tests with only its sibling closure and test group installed."""
    _install(session, [package])
    _run_tests(session, package, session.posargs)


@nox.session(venv_params=VENV_PARAMS)
@nox.parametrize("package", TESTED, ids=TESTED)
def typecheck(session: nox.Session, package: str) -> None:
    """mypy --strict of one package inside its own closure."""
    _install(session, [package], more=("mypy==2.4.1",))
    _run_mypy(session, package, session.posargs)


@nox.session(venv_params=VENV_PARAMS)
@nox.parametrize("package", TESTED, ids=TESTED)
def check(session: nox.Session, package: str) -> None:
    """typecheck then tests of one package in ONE environment (its closure, test
    group and mypy): what `ci` runs, one install per package instead of two."""
    _install(session, [package], more=("mypy==2.4.1",))
    _run_mypy(session, package, [])
    _run_tests(session, package, session.posargs)


def _top() -> list[str]:
    return [n for n in LAYERED if n == "nvalchemi-distributed"] or LAYERED


@nox.session(venv_params=VENV_PARAMS)
def integration(session: nox.Session) -> None:
    """integration_tests/ (N ranks vs 1 rank over gloo) with everything installed."""
    _install(session, [*_top(), "nvdd-testing"], extras=True)
    session.run("pytest", "-q", "integration_tests", *session.posargs)


#: Processes ``checks`` runs at once (``NVDD_CI_LANES``; default: the machine's cores,
#: at most 2). Many tests wait (on ranks, on launched jobs, on watchdog timeouts):
#: one pytest at a time kept one of CI's two cores idle half the time (record 0082).
CI_LANES = int(os.environ.get("NVDD_CI_LANES", "0")) or max(1, min(os.cpu_count() or 1, 2))


#: CPU seconds of each ``checks`` job in a run with a warm kernel cache (record
#: 0082): only the order in which the jobs start (longest first); a job not named
#: here starts last.
CI_SECONDS = {
    "integration-1": 280.0,
    "integration-2": 260.0,
    "nvalchemi-distributed": 200.0,
    "nvdd-models": 130.0,
    "nvdd-dynamics": 100.0,
    "nvdd-core": 50.0,
    "nvdd-partition": 40.0,
    "mypy": 30.0,
}
#: The integration suite runs as two pytest processes: these files, then the rest.
INTEGRATION_1 = (
    "test_it_graph_partition.py",
    "test_it_conformance.py",
    "test_it_docs_snippets.py",
    "test_it_faults.py",
    "test_it_bench_harness.py",
    "test_it_multinode.py",
)


def _integration_parts() -> dict[str, list[str]]:
    """``integration_tests/`` in two parts (each a list of test files; none empty)."""
    files = sorted((ROOT / "integration_tests").glob("test_*.py"))
    first = [str(f) for f in files if f.name in INTEGRATION_1]
    rest = [str(f) for f in files if f.name not in INTEGRATION_1]
    return {k: v for k, v in (("integration-1", first), ("integration-2", rest)) if v}


def _run_lanes(
    session: nox.Session, jobs: list[tuple[str, list[str], dict[str, str]]], lanes: int
) -> None:
    """Run ``jobs`` (a label, a command run in the session's environment, more
    environment variables), ``lanes`` at a time in the order given (put the longest
    first); each job's output is shown whole when it ends. Fails after every job
    ended if any failed."""
    env = {k: v for k, v in {**os.environ, **session.env}.items() if v is not None}
    env["PATH"] = os.pathsep.join([*(session.bin_paths or []), env.get("PATH", "")])
    logs = Path(session.create_tmp()) / "lanes"
    logs.mkdir(exist_ok=True)
    todo = list(jobs)
    running: dict[str, tuple[subprocess.Popen[bytes], Path, float]] = {}
    failed: list[str] = []
    try:
        while todo or running:
            while todo and len(running) < lanes:
                label, cmd, more = todo.pop(0)
                log = logs / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', label)}.log"
                with log.open("wb") as out:
                    proc = subprocess.Popen(
                        cmd, stdout=out, stderr=subprocess.STDOUT, env={**env, **more}, cwd=ROOT,
                        start_new_session=True,
                    )  # fmt: skip
                session.log(f"started {label}: {' '.join(cmd)}")
                running[label] = (proc, log, time.monotonic())
            time.sleep(0.2)
            for label, (proc, log, t0) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[label]
                sys.stdout.write(log.read_text(errors="replace"))
                verdict = "passed" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
                session.log(f"{label}: {verdict} in {time.monotonic() - t0:.0f} s")
                if proc.returncode != 0:
                    failed.append(label)
    finally:
        for proc, _, _ in running.values():  # interrupted: end what still runs
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if failed:
        session.error(f"failed: {', '.join(failed)}")


@nox.session(venv_params=VENV_PARAMS)
def checks(session: nox.Session) -> None:
    """mypy --strict of every package (one run), every package's tests and the
    integration suite, all in ONE environment holding every package with its extras
    and test group: what `ci` runs. One install and one mypy cache instead of one
    per package; an import of an undeclared sibling or extra is caught by the
    ``deps`` session's import scan (and by ``check(<package>)``, which installs a
    package's closure alone). The runs are separate processes, ``CI_LANES`` (2) of
    them at a time, longest first; each one's output is shown when it ends.
    Arguments go to every pytest run."""
    _install(session, TESTED, extras=True, more=("mypy==2.4.1",))
    since = _warp_prefill(session)
    # one pytest process per package and per part of the integration suite (one
    # process for all was slower, record 0081), CI_LANES of them (and mypy) at once,
    # the longest first (record 0082)
    mypy, mypy_env = _mypy_all(TESTED)
    jobs: list[tuple[float, str, list[str], dict[str, str]]] = [
        (CI_SECONDS.get("mypy", 0.0), "mypy", mypy, mypy_env)
    ]
    for name in TESTED:
        tests_dir = str(PACKAGES[name]["path"] / "tests")  # type: ignore[operator]
        cmd = ["pytest", "-q", tests_dir, *session.posargs]
        jobs.append((CI_SECONDS.get(name, 0.0), name, cmd, {}))
    for part, files in _integration_parts().items():
        cmd = ["pytest", "-q", *files, *session.posargs]
        jobs.append((CI_SECONDS.get(part, 0.0), part, cmd, {}))
    jobs.sort(key=lambda job: -job[0])
    try:
        _run_lanes(session, [job[1:] for job in jobs], CI_LANES)
    finally:
        _late_compiles(session, since)


def _warp_prefill(session: nox.Session) -> float:
    """Compile the packages' Warp modules into the kernel cache in ONE process,
    before the test processes start (tools/warp_prefill.py, record 0086): in a
    fresh clone each test process and rank otherwise compiled the modules it
    met first, several at once. Returns the time it ended."""
    session.run("python", str(ROOT / "tools" / "warp_prefill.py"))
    return time.time()


def _late_compiles(session: nox.Session, since: float) -> None:
    """Log the kernel cache entries written after ``since`` (by the tests, or by
    a session beside them): the modules the prefill did not cover."""
    root = Path(session.env.get("WARP_CACHE_PATH") or WARP_CACHE)
    late = sorted(
        entry.name
        for entry in root.glob("*/wp_*")
        if entry.is_dir() and entry.stat().st_mtime > since
    )
    session.log(f"warp cache: {len(late)} modules compiled after the prefill: {' '.join(late)}")


@nox.session(venv_params=VENV_PARAMS)
def e3nn06(session: nox.Session) -> None:
    """The models on e3nn 0.6 in one environment of their own: SevenNet
    (``nvdd-models[sevenn]``) and UMA (``nvdd-models[uma]``, fairchem-core). Both
    need e3nn >= 0.5 and mace-torch 0.3.16 pins 0.4.4, so these extras are in no
    other session; one environment for both saves CI an install. Runs the
    tests_sevenn/ and tests_uma/ of nvdd-models and nvalchemi-distributed (`nvdd
    run --model sevenn|uma`); a missing module fails."""
    models = PACKAGES["nvdd-models"]
    extras = models["extras"]  # type: ignore[index]
    _install(
        session,
        ["nvalchemi-distributed", "nvdd-models", "nvdd-testing"],
        groups=(),
        more=(*extras["sevenn"], *extras["uma"], "numpy>=1.24", "ase>=3.23"),
    )
    session.env["NVDD_REQUIRE_EXTRAS"] = "1"
    _warp_prefill(session)  # (waits while ``checks`` fills the same cache, record 0086)
    dirs = [
        str(ROOT / "packages" / p / f"tests_{m}")
        for m in ("sevenn", "uma")
        for p in ("nvdd-models", "nvalchemi-distributed")
        if (ROOT / "packages" / p / f"tests_{m}").is_dir()
    ]
    session.run("pytest", "-q", *dirs, *session.posargs)


@nox.session(python=False, default=False)
def sevenn(session: nox.Session) -> None:
    """Alias of ``e3nn06`` (SevenNet's tests now share UMA's environment)."""
    session.notify("e3nn06", session.posargs)


#: ``ci``'s own sessions that run in a second nox process beside deps, lint and
#: checks (their environments are their own; record 0082), and that process.
CI_BESIDE = ("e3nn06", "docs")
_beside: list[tuple[subprocess.Popen[bytes], Path]] = []


@nox.session(python=False)
def ci(session: nox.Session) -> None:
    """The README's test command: deps, lint, checks (typecheck and tests of every
    package, then the integration suite, in one environment), and beside them, in
    a second nox process, e3nn06 and docs; ``ci_join`` waits for that one and
    shows its output."""
    if TORCH_MODE == "cpu" and nox.options.default_venv_backend.startswith("uv"):
        _torch_wheel()  # (fetched once, before two processes look for it)
    log = SHARED / "ci-beside.log"
    SHARED.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        cmd = [sys.executable, "-m", "nox", "-f", str(ROOT / "noxfile.py"), "-s", *CI_BESIDE]
        _beside.append((subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT), log))
    session.log(f"started {', '.join(CI_BESIDE)} beside the others (output: {log})")
    session.notify("deps")
    session.notify("lint")
    session.notify("checks")
    session.notify("ci_join")


@nox.session(python=False, default=False)
def ci_join(session: nox.Session) -> None:
    """Waits for the sessions ``ci`` started beside the others, shows their output,
    fails if they failed."""
    if not _beside:
        session.error("ci_join runs after ci (it waits for what ci started)")
    proc, log = _beside.pop()
    rc = proc.wait()
    sys.stdout.write(log.read_text(errors="replace"))
    if rc != 0:
        session.error(f"{', '.join(CI_BESIDE)}: failed (exit {rc})")


@nox.session(default=False)
def docs(session: nox.Session) -> None:
    """The docs site into site/: MkDocs + mkdocstrings, read statically (no torch, no
    nvdd install). Strict: a warning, a broken internal link or anchor, or a public
    name (or a public method or property of an exported class) without a docstring
    fails; so does a benchmarks page that differs from
    the result files in benchmarks/results/ (``benchmarks/render.py --check``)."""
    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["dependency-groups"]
    session.install(*groups["docs"])
    session.env["NO_MKDOCS_2_WARNING"] = "1"
    session.run("python", "benchmarks/render.py", "--check")
    session.run("mkdocs", "build", "--strict", "--clean", *session.posargs)


@nox.session(venv_params=VENV_PARAMS)
def demo(session: nox.Session) -> None:
    """The main job: `nvdd run` on CPU ranks over gloo (a built-in argon box, LJ,
    NVT then NVE), output in runs/demo (replaced on each run). Extra arguments go
    to `nvdd run`."""
    _install(session, ["nvalchemi-distributed"], extras=True, groups=())
    args = session.posargs or ["--nproc", "2", "--out", "runs/demo", "--overwrite"]
    session.run("nvdd", "run", *args)


@nox.session(venv_params=VENV_PARAMS, default=False)
def bench(session: nox.Session) -> None:
    """Benchmarks (ratios measured in one run; not tests). `-- --full` for the long sizes."""
    _install(
        session,
        ["nvalchemi-distributed", "nvdd-testing"],
        extras=True,
        groups=(),
        more=("nvalchemi-toolkit-ops>=0.5",),
    )
    quick = [] if "--full" in session.posargs else ["--quick"]
    session.run("python", "benchmarks/bench_dp.py", *quick)
    session.run("python", "benchmarks/bench_halo.py", *quick)
    session.run("python", "benchmarks/bench_partition.py", *quick)
    session.run("python", "benchmarks/bench_models.py", *quick)
    session.run("python", "benchmarks/bench_padding.py", "--steps", "40")
    session.run("python", "benchmarks/bench_shardtensor.py", *quick)


@nox.session(venv_params=["--system-site-packages"], venv_backend="venv", default=False)
def multigpu(session: nox.Session) -> None:
    """The integration suite over NCCL on every visible GPU (>= 2), one process per
    GPU, launched with torchrun. Fails, not skips, with fewer than 2 GPUs.
    Uses the interpreter's own (CUDA) torch: run with NVDD_TORCH=system."""
    n = session.run(
        "python",
        "-c",
        "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)",
        silent=True,
    )
    count = int(str(n).strip().splitlines()[-1]) if n else 0
    if count < 2:
        session.error(f"multigpu needs at least 2 visible CUDA GPUs, found {count}")
    _install(session, [*_top(), "nvdd-testing"], extras=True, torch_mode="system")
    session.run(
        "python",
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={count}",
        "integration_tests/multigpu_suite.py",
        *session.posargs,
    )


@nox.session(python=False, default=False)
def multigpu_system(session: nox.Session) -> None:
    """The NCCL integration suite with the interpreter's own environment: NO installs.

    For GPU hosts that reach no package index. ``$NVDD_PYTHON`` (default
    ``python3``) must have torch with CUDA, warp-lang and vesin; nvdd runs from
    this checkout's sources. Arguments go to the suite (``--dtype both``)."""
    session.run("bash", str(ROOT / "tools" / "multigpu"), *session.posargs, external=True)
