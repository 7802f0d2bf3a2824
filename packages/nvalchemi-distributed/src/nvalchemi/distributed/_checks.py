"""Validation of ``nvdd run``'s arguments, before any rank starts.

One function per group of options; each returns the problems it found as
one-line messages (empty when all is well). :func:`validate` runs them all, so
the user sees every problem at once, and ``nvdd`` exits with status 2 without
starting torchrun. A new group of options (another model, another ensemble)
adds its own checker to :data:`CHECKERS`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nvalchemi.distributed._structure import MIN_DISTANCE, read_structure, structure_problems

__all__ = [
    "CHECKERS",
    "FIRST_PHASE_CLASSES",
    "AR_EPSILON",
    "AR_SIGMA",
    "LJParams",
    "MIN_DISTANCE",
    "SYSTEM_FLAGS",
    "lj_species",
    "parse_lj",
    "read_structure",
    "restart_notes",
    "restart_point",
    "structure_problems",
    "system_options",
    "validate",
]

#: Argon's Lennard-Jones epsilon (eV) and sigma (Angstrom): the built-in species.
AR_EPSILON, AR_SIGMA = 0.0104, 3.40
_MANIFEST = "manifest.json"


@dataclass(frozen=True)
class LJParams:
    """Lennard-Jones parameters of one element."""

    z: int
    symbol: str
    epsilon: float
    sigma: float


def _symbol_table() -> tuple[list[str], dict[str, int]]:
    try:
        from ase.data import atomic_numbers, chemical_symbols
    except ImportError:  # pragma: no cover - ase is in the demo extra
        return ["X", *["?"] * 17, "Ar"], {"Ar": 18}
    return list(chemical_symbols), dict(atomic_numbers)


def parse_lj(spec: str) -> LJParams:
    """``"SYMBOL:EPSILON:SIGMA"`` (or ``"Z:EPSILON:SIGMA"``) -> :class:`LJParams`.

    Raises
    ------
    ValueError
        With a one-line message naming the bad part.
    """
    parts = spec.split(":")
    if len(parts) != 3:
        raise ValueError(f"--lj {spec!r}: expected SYMBOL:EPSILON:SIGMA, e.g. Ar:0.0104:3.40")
    name, eps_s, sig_s = (p.strip() for p in parts)
    symbols, numbers = _symbol_table()
    if name.isdigit():
        z = int(name)
        if not 0 < z < len(symbols):
            raise ValueError(f"--lj {spec!r}: atomic number {z} is not an element")
        name = symbols[z]
    elif name in numbers and numbers[name] > 0:
        z = numbers[name]
    else:
        raise ValueError(f"--lj {spec!r}: {name!r} is not an element symbol")
    try:
        eps, sig = float(eps_s), float(sig_s)
    except ValueError:
        raise ValueError(f"--lj {spec!r}: epsilon and sigma must be numbers") from None
    if not (math.isfinite(eps) and eps >= 0 and math.isfinite(sig) and sig > 0):
        raise ValueError(f"--lj {spec!r}: need epsilon >= 0 eV and sigma > 0 A")
    return LJParams(z, name, eps, sig)


def lj_species(args: argparse.Namespace) -> dict[int, LJParams]:
    """The per-element LJ parameters of the run: argon built in, then every ``--lj``."""
    species = {18: LJParams(18, "Ar", AR_EPSILON, AR_SIGMA)}
    for spec in args.lj or ():
        p = parse_lj(spec)
        species[p.z] = p
    return species


def restart_point(path: str) -> dict[str, Any]:
    """The manifest of the checkpoint directory ``path`` (light: JSON only).

    Raises
    ------
    ValueError
        When it is not a readable nvdd checkpoint.
    """
    file = Path(path) / _MANIFEST
    if not file.is_file():
        raise ValueError(f"--restart {path}: no checkpoint there ({file} does not exist)")
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--restart {path}: cannot read {file} ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "nvdd-checkpoint":
        raise ValueError(f"--restart {path}: {file} is not an nvdd checkpoint manifest")
    return manifest


# ------------------------------------------------------------------ checkers
def _numbers(args: argparse.Namespace) -> list[str]:
    out = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            out.append(message)

    def finite(x: float) -> bool:
        return math.isfinite(x)

    need(args.nproc >= 1, f"--nproc must be >= 1, got {args.nproc}")
    need(args.cells >= 1, f"--cells must be >= 1, got {args.cells}")
    need(args.nvt_steps >= 0, f"--nvt-steps must be >= 0, got {args.nvt_steps}")
    need(args.nve_steps >= 0, f"--nve-steps must be >= 0, got {args.nve_steps}")
    need(finite(args.dt) and args.dt > 0, f"--dt must be > 0 fs, got {args.dt}")
    need(
        finite(args.temperature) and args.temperature >= 0,
        f"--temperature must be >= 0 K, got {args.temperature}",
    )
    need(
        finite(args.friction) and args.friction >= 0,
        f"--friction must be >= 0 per fs, got {args.friction}",
    )
    need(finite(args.cutoff) and args.cutoff > 0, f"--cutoff must be > 0 A, got {args.cutoff}")
    need(finite(args.skin) and args.skin >= 0, f"--skin must be >= 0 A, got {args.skin}")
    need(args.thermo_every >= 1, f"--thermo-every must be >= 1, got {args.thermo_every}")
    need(args.traj_every >= 0, f"--traj-every must be >= 0, got {args.traj_every}")
    need(
        args.checkpoint_every >= 0, f"--checkpoint-every must be >= 0, got {args.checkpoint_every}"
    )
    need(
        finite(args.watchdog) and args.watchdog >= 0,
        f"--watchdog must be >= 0 s, got {args.watchdog}",
    )
    if args.grid is not None:
        px, py, pz = args.grid
        need(min(args.grid) >= 1, f"--grid needs three integers >= 1, got {args.grid}")
        need(
            px * py * pz == args.nproc,
            f"--grid {px} {py} {pz} has {px * py * pz} boxes but --nproc is {args.nproc}",
        )
    return out


def _device(args: argparse.Namespace) -> list[str]:
    if args.device != "cuda":
        return []
    import torch

    if not torch.cuda.is_available():
        return ["--device cuda: no CUDA device is available here (use --device cpu)"]
    count = torch.cuda.device_count()
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if "RANK" in os.environ and local.isdigit():  # under torchrun: this node's ranks
        if int(local) > count:
            return [f"--device cuda: {local} ranks on this node but only {count} GPU(s) here"]
        return []
    if args.nproc > count:
        return [f"--device cuda: --nproc {args.nproc} ranks but only {count} GPU(s) here"]
    return []


def _names(numbers: list[int]) -> str:
    symbols, _ = _symbol_table()
    return ", ".join(f"{symbols[z] if 0 <= z < len(symbols) else '?'} (Z={z})" for z in numbers)


def _model_elements(args: argparse.Namespace) -> list[int] | None:
    """The elements ``--model mace`` knows, when that is cheap to tell (None: not)."""
    from nvalchemi.distributed._model_args import BUILTIN_MACE_ELEMENTS

    if not args.model_file:
        return list(BUILTIN_MACE_ELEMENTS)
    if getattr(args, "model", "lj") != "mace":  # (SevenNet, UMA checkpoints: read at build)
        return None
    from nvalchemi.distributed._model_peek import mace_file_elements

    return mace_file_elements(args.model_file)


def _structure(args: argparse.Namespace) -> list[str]:
    """LJ parameters, and ``--structure``: read, whole, and made of elements the
    model knows (LJ: built-in or ``--lj``; MACE: the model's ``atomic_numbers``)."""
    try:
        species = lj_species(args)
    except ValueError as exc:
        return [str(exc)]
    if not args.structure or args.run_file:
        return []
    try:
        atoms = read_structure(args.structure)
    except ValueError as exc:
        return [str(exc)]
    label = f"--structure {args.structure}"
    out = structure_problems(label, atoms, periodic=args.ensemble == "npt")
    if len(atoms) == 0:
        return out
    present = {int(z) for z in atoms.get_atomic_numbers()}
    if getattr(args, "model", "lj") == "lj":
        missing = sorted(present - set(species))
        if missing:
            symbols, _ = _symbol_table()
            out.append(
                f"{label}: no Lennard-Jones parameters for {_names(missing)}; pass "
                f"--lj {symbols[missing[0]]}:EPSILON:SIGMA (eV, A) for each (built in: Ar only)"
            )
        return out
    known = _model_elements(args)
    if known is not None and present - set(known):
        kind = {"sevenn": "SevenNet", "uma": "UMA", "aimnet2": "AIMNet2"}.get(
            getattr(args, "model", "lj"), "MACE"
        )
        builtin = f"the built-in {kind}"
        which = f"the model in {args.model_file}" if args.model_file else builtin
        out.append(
            f"{label}: {_names(sorted(present - set(known)))} not among the elements "
            f"{which} knows ({_names(sorted(known))})"
        )
    return out


def _model_options(args: argparse.Namespace) -> list[str]:
    """``--model`` / ``--model-file`` (a MACE file must exist; LJ takes none)."""
    from nvalchemi.distributed._model_args import model_args_problem

    problem = model_args_problem(args)
    if problem is not None:
        return [problem]
    if getattr(args, "model", "lj") == "mace" and args.model_file:
        from nvalchemi.distributed._model_peek import peek_mace_file

        try:
            peek_mace_file(args.model_file)
        except ValueError as exc:
            return [f"--model-file {args.model_file}: {exc}"]
    return []


def _ensemble(args: argparse.Namespace) -> list[str]:
    """The thermostat and barostat numbers (checked whatever ``--ensemble`` is, so a
    bad value is never silently unused), and what the chosen ensemble needs."""
    out = []
    if not (math.isfinite(args.tau_t) and args.tau_t > 0):
        out.append(f"--tau-t must be > 0 fs, got {args.tau_t}")
    if not (math.isfinite(args.tau_p) and args.tau_p > 0):
        out.append(f"--tau-p must be > 0 fs, got {args.tau_p}")
    if not math.isfinite(args.pressure):
        out.append(f"--pressure must be a finite number of bar, got {args.pressure}")
    nose_hoover = args.ensemble in ("nvt-nh", "npt")
    if nose_hoover and math.isfinite(args.temperature) and not args.temperature > 0:
        out.append(
            f"--ensemble {args.ensemble} needs --temperature > 0 K (a Nose-Hoover "
            f"chain's target), got {args.temperature}"
        )
    # (NPT's fully periodic cell is checked where the system is read)
    return out


def _run_file(args: argparse.Namespace) -> list[str]:
    """The run file: its system and every model component are built as the ranks
    will build them (see :func:`~nvalchemi.distributed._runfile.run_file_problems`)."""
    if not args.run_file:
        return []
    if args.structure:
        return ["--run-file and --structure both give the system: pass one"]
    from nvalchemi.distributed._runfile import run_file_problems

    return [
        f"--run-file {args.run_file}: {p}"
        for p in run_file_problems(args.run_file, periodic=args.ensemble == "npt")
    ]


def _inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or lies below it (both resolved)."""
    return path == folder or folder in path.parents


def _output_dir(args: argparse.Namespace) -> list[str]:
    """``--out``: a directory that can be created, and empty unless ``--overwrite``
    or the run directory of the ``--restart`` checkpoint (``OUT/checkpoint``)."""
    out = Path(args.out)
    label = f"--out {args.out}"
    if out.exists() and not out.is_dir():
        return [f"{label}: exists and is not a directory"]
    if not out.exists():
        parent = out.absolute().parent
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            return [f"{label}: cannot be created ({parent} is not a directory)"]
        if not os.access(parent, os.W_OK | os.X_OK):
            return [f"{label}: cannot be created ({parent} is not writable)"]
        return []
    if not os.access(out, os.W_OK | os.X_OK):
        return [f"{label}: not writable"]
    here = out.resolve()
    restart = Path(args.restart).resolve() if args.restart else None
    overwrite = getattr(args, "overwrite", False)
    if overwrite:
        if restart is not None and _inside(restart, here):
            return [f"{label}: --overwrite would delete the --restart checkpoint {args.restart}"]
        if _inside(Path.cwd().resolve(), here) or here == Path.home().resolve():
            return [f"{label}: --overwrite will not delete the working or home directory"]
        return []
    entries = sorted(os.listdir(out))
    if not entries or (restart is not None and restart.parent == here):
        return []
    shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
    return [
        f"{label}: not empty (holds {shown}); choose another --out, or pass --overwrite "
        "to delete it first (a restart into it needs --restart OUT/checkpoint)"
    ]


#: ``nvdd run`` options that define the system, by their key in :func:`system_options`.
SYSTEM_FLAGS = {
    "run_file": "--run-file",
    "structure": "--structure",
    "cells": "--cells",
    "model": "--model",
    "model_file": "--model-file",
    "task": "--task",
    "cutoff": "--cutoff",
    "lj": "--lj",
    "dtype": "--dtype",
    "strategy": "--strategy",
}


def system_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options that define the system and its model (paths resolved; only
    those this run uses), as a checkpoint stores them and a restart compares them.

    Raises
    ------
    ValueError
        On a malformed ``--lj``.
    """
    opts: dict[str, Any] = {"dtype": args.dtype}
    if args.run_file:
        opts["run_file"] = str(Path(args.run_file).resolve())
    else:
        model = getattr(args, "model", "lj")
        opts["model"] = model
        if args.structure:
            opts["structure"] = str(Path(args.structure).resolve())
        else:
            opts["cells"] = args.cells
        if model in ("mace", "sevenn", "uma", "aimnet2"):
            model_file = getattr(args, "model_file", None)
            opts["model_file"] = str(Path(model_file).resolve()) if model_file else None
            if model == "uma":
                opts["task"] = getattr(args, "task", None)
        else:
            opts["cutoff"] = args.cutoff
            opts["lj"] = sorted(
                f"{p.symbol}:{p.epsilon}:{p.sigma}" for p in lj_species(args).values()
            )
    strategy = getattr(args, "strategy", None)
    if strategy is not None:
        opts["strategy"] = str(getattr(strategy, "value", strategy))
    return opts


def _shown(value: Any) -> str:
    if value is None:
        return "not given"
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value)


def _system_mismatches(args: argparse.Namespace, saved: dict[str, Any]) -> list[str]:
    try:
        mine = system_options(args)
    except ValueError:
        return []  # (the bad --lj is reported by its own check)
    out = []
    for key in [k for k in SYSTEM_FLAGS if k in mine or k in saved]:
        if mine.get(key) != saved.get(key):
            out.append(
                f"--restart {args.restart}: {SYSTEM_FLAGS[key]} is {_shown(mine.get(key))} "
                f"here but was {_shown(saved.get(key))} in the run that wrote the checkpoint"
            )
    return out


def _damaged_files(path: str, manifest: dict[str, Any]) -> list[str]:
    """Every shard and the systems file: present, a readable ``.npz`` archive
    holding the arrays the manifest names (its directory only; no array is read)."""
    try:
        files = [(str(s["file"]), manifest["atom_fields"]) for s in manifest["shards"]]
        files.append((str(manifest["systems_file"]), manifest["system_fields"]))
        keys = {name: [str(m["key"]) for m in fields] for name, fields in files}
    except (KeyError, TypeError) as exc:
        return [f"--restart {path}: its {_MANIFEST} is malformed (no {exc})"]
    out = []
    for name, wanted in keys.items():
        file = Path(path) / name
        if not file.is_file():
            out.append(f"--restart {path}: {file} is missing")
            continue
        try:
            with zipfile.ZipFile(file) as zf:
                names = set(zf.namelist())
        except (zipfile.BadZipFile, OSError) as exc:
            out.append(
                f"--restart {path}: {file} is damaged: not a readable .npz archive, "
                f"truncated or overwritten ({exc})"
            )
            continue
        missing = [k for k in wanted if f"{k}.npy" not in names]
        if missing:
            out.append(f"--restart {path}: {file} is damaged: it lacks the array(s) {missing}")
    return out


def _restart(args: argparse.Namespace) -> list[str]:
    """The checkpoint: readable, written by a phase of this run (the same
    ``--ensemble``; an NVE one after as many ``--nvt-steps``), the same system
    options (:func:`system_options`, stored since 2026-12), intact files."""
    if not args.restart:
        return []
    try:
        manifest = restart_point(args.restart)
    except ValueError as exc:
        return [str(exc)]
    label = f"--restart {args.restart}"
    integrator = manifest.get("integrator") or {}
    cls = integrator.get("class")
    if cls not in FIRST_PHASE_CLASSES and cls != "VelocityVerlet":
        return [
            f"{label}: written by a {cls} run, nvdd run restarts its own "
            "phases (Langevin, NoseHooverNVT, MTKNPT, VelocityVerlet)"
        ]
    out = []
    info = manifest.get("metadata") or {}
    state = integrator.get("state") or {}
    if cls in FIRST_PHASE_CLASSES and FIRST_PHASE_CLASSES[cls] != args.ensemble:
        out.append(
            f"{label}: written in an --ensemble {FIRST_PHASE_CLASSES[cls]} phase ({cls}), "
            f"this run has --ensemble {args.ensemble}"
        )
    if cls == "VelocityVerlet" and "step" in info and "step_count" in state:
        before = int(info["step"]) - int(state["step_count"])
        if before != args.nvt_steps:
            out.append(
                f"{label}: written in the NVE phase after {before} steps of the first phase, "
                f"this run has --nvt-steps {args.nvt_steps}"
            )
    saved = info.get("system")
    if isinstance(saved, dict):
        out += _system_mismatches(args, saved)
    return out + _damaged_files(args.restart, manifest)


def restart_notes(args: argparse.Namespace) -> list[str]:
    """What a restart cannot check (a checkpoint written before the system
    options were stored); empty otherwise."""
    if not args.restart:
        return []
    try:
        info = restart_point(args.restart).get("metadata") or {}
    except ValueError:
        return []
    if isinstance(info.get("system"), dict):
        return []
    flags = ", ".join(SYSTEM_FLAGS.values())
    return [
        f"--restart {args.restart}: this checkpoint does not store the options that define "
        f"the system ({flags}), so they cannot be checked against it: give the same ones"
    ]


#: Integrator class of the first phase, by ``--ensemble``.
FIRST_PHASE_CLASSES = {"Langevin": "langevin", "NoseHooverNVT": "nvt-nh", "MTKNPT": "npt"}

#: Run-file model kinds with a graph-partition spec (the others: HALO only).
GRAPH_PARTITION_KINDS = ("lj", "mpnn")


def _strategy(args: argparse.Namespace) -> list[str]:
    """``--strategy graph-partition``: no spatial options, and a model that has a
    graph-partition spec (LJ, MACE; in a run file lj and mpnn components)."""
    if getattr(args, "strategy", "halo") != "graph-partition":
        return []
    out = [
        f"{flag} applies to --strategy halo only (graph-partition splits atoms by index)"
        for flag, given in (
            ("--grid", args.grid is not None),
            ("--load-balance", args.load_balance),
        )
        if given
    ]
    if args.run_file:
        from nvalchemi.distributed._runfile import load_run_file
        from nvdd.core import NvddError

        try:
            entries = load_run_file(args.run_file).get("model", [])
        except (NvddError, OSError, ValueError):  # the run-file checker reports it
            entries = []
        kinds = [str(e.get("kind")) for e in entries if isinstance(e, dict)]
        halo_only = sorted({k for k in kinds if k not in GRAPH_PARTITION_KINDS})
        if halo_only:
            out.append(
                f"--strategy graph-partition: the run file's model kind(s) {', '.join(halo_only)} "
                "have no graph-partition spec (lj and mpnn do): use --strategy halo"
            )
    return out


#: The checkers :func:`validate` runs, in order.
CHECKERS: list[Callable[[argparse.Namespace], list[str]]] = [
    _numbers,
    _device,
    _model_options,
    _structure,
    _ensemble,
    _run_file,
    _restart,
    _output_dir,
    _strategy,
]


def validate(args: argparse.Namespace) -> list[str]:
    """Every problem with ``args`` (empty list: good to launch)."""
    problems: list[str] = []
    for check in CHECKERS:
        problems += check(args)
    return problems
