"""Every Python block of README.md and of the docs pages runs, on CPU.

The fenced ```` ```python ```` blocks of one page run in order, in one fresh
Python process (one namespace, like a notebook), in a temporary directory.
A block is skipped only when the line right above its fence says why:

    <!-- docs-test: skip (needs a GPU) -->

A block that is a whole script for several ranks says how many:

    <!-- docs-test: torchrun 2 -->

and runs alone under ``torch.distributed.run --standalone`` on CPU ranks (gloo).
``docs/design.md`` is the old decision log (being folded into docs/decisions/)
and is not read.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARK = re.compile(r"<!--\s*docs-test:\s*(?P<what>skip|torchrun)\s*(?P<arg>.*?)\s*-->")
FENCE = re.compile(r"^(?P<indent> *)(?P<ticks>`{3,})(?P<info>[^`]*)$")
NOT_READ = {"docs/design.md"}
TIMEOUT_S = 600


@dataclass(frozen=True)
class Block:
    """One fenced Python block: where it is, its code and its marker."""

    page: str
    line: int
    code: str
    mode: str  # "run", "skip" or "torchrun"
    arg: str = ""


def pages() -> list[str]:
    """README.md and every docs page, as paths relative to the repository root."""
    docs = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))
    found = ["README.md", *docs]
    return [p for p in found if p not in NOT_READ]


def blocks(text: str, page: str = "<text>") -> list[Block]:
    """The ```python blocks of ``text`` with the marker on the line above each."""
    lines = text.splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks, info = m["indent"], m["ticks"], m["info"].strip()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != ticks:
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        if info.split(" ")[0] == "python":
            above = lines[i - 1] if i > 0 else ""
            mark = MARK.search(above)
            mode, arg = (mark["what"], mark["arg"]) if mark else ("run", "")
            if mode == "skip" and not arg.strip("() "):
                raise ValueError(f"{page}:{i + 1}: a skipped block must say why")
            out.append(Block(page, i + 1, "\n".join(body) + "\n", mode, arg))
        i = j + 1
    return out


def _env() -> dict[str, str]:
    env = dict(os.environ)
    srcs = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
    env["PYTHONPATH"] = os.pathsep.join([*srcs, env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run(cmd: list[str], cwd: Path, what: str) -> None:
    proc = subprocess.run(
        cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    if proc.returncode != 0:
        pytest.fail(
            f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )


def _page_blocks() -> list[tuple[str, list[Block]]]:
    return [(p, blocks((ROOT / p).read_text(), p)) for p in pages()]


def test_markers_are_read() -> None:
    text = (
        "x\n```python\na = 1\n```\n<!-- docs-test: skip (needs a GPU) -->\n```python\nb\n```\n"
        "<!-- docs-test: torchrun 2 -->\n```python\nc\n```\n```bash\nd\n```\n"
        "- item:\n\n    ```python\n    e = 2\n    ```\n"
    )
    got = [(b.mode, b.arg, b.code) for b in blocks(text)]
    assert got == [
        ("run", "", "a = 1\n"),
        ("skip", "(needs a GPU)", "b\n"),
        ("torchrun", "2", "c\n"),
        ("run", "", "e = 2\n"),
    ]
    with pytest.raises(ValueError, match="must say why"):
        blocks("<!-- docs-test: skip -->\n```python\nx\n```\n")


def test_every_page_is_covered() -> None:
    """Each block is run or skipped with a reason; the docs have blocks that run."""
    found = _page_blocks()
    runnable = [b for _, bs in found for b in bs if b.mode != "skip"]
    assert len(runnable) >= 10, f"only {len(runnable)} runnable blocks found"
    for page, bs in found:
        for b in bs:
            if b.mode == "torchrun":
                assert b.arg.isdigit() and int(b.arg) >= 1, f"{page}:{b.line}: torchrun N"


@pytest.mark.parametrize(
    "page", [p for p, bs in _page_blocks() if any(b.mode == "run" for b in bs)]
)
def test_page_runs(page: str, tmp_path: Path) -> None:
    """The page's plain blocks, in order, in one process."""
    code = []
    for b in blocks((ROOT / page).read_text(), page):
        if b.mode == "run":
            code.append(f"# --- {page}:{b.line}\n{b.code}")
    script = tmp_path / "page.py"
    script.write_text("\n".join(code))
    _run([sys.executable, str(script)], tmp_path, page)


@pytest.mark.gloo
@pytest.mark.parametrize(
    "block",
    [b for _, bs in _page_blocks() for b in bs if b.mode == "torchrun"],
    ids=lambda b: f"{b.page}:{b.line}",
)
def test_torchrun_block_runs(block: Block, tmp_path: Path) -> None:
    """A whole script under torchrun on CPU ranks."""
    script = tmp_path / "script.py"
    script.write_text(block.code)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={block.arg}",
        str(script),
    ]
    _run(cmd, tmp_path, f"{block.page}:{block.line}")
