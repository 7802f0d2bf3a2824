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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CHECKERS",
    "FIRST_PHASE_CLASSES",
    "AR_EPSILON",
    "AR_SIGMA",
    "LJParams",
    "lj_species",
    "parse_lj",
    "read_structure",
    "restart_point",
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


def read_structure(path: str) -> Any:
    """``ase.io.read(path)``, or ValueError with one line saying why not."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--structure {path}: no such file")
    try:
        from ase.io import read
    except ImportError:
        raise ValueError(
            "--structure needs ASE: pip install 'nvalchemi-distributed[demo]'"
        ) from None
    try:
        atoms = read(str(file))
    except Exception as exc:  # ASE raises anything from KeyError to StopIteration
        if isinstance(exc, KeyError):
            detail = f"unknown element symbol {exc}"
        else:
            detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise ValueError(f"--structure {path}: ase.io.read cannot read it ({detail})") from None
    if isinstance(atoms, list):
        if len(atoms) != 1:
            raise ValueError(f"--structure {path}: holds {len(atoms)} frames, give one")
        atoms = atoms[0]
    return atoms


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
    if args.nproc > count:
        return [f"--device cuda: --nproc {args.nproc} ranks but only {count} GPU(s) here"]
    return []


def _model(args: argparse.Namespace) -> list[str]:
    """LJ parameters, and the structure's elements against them."""
    try:
        species = lj_species(args)
    except ValueError as exc:
        return [str(exc)]
    if not args.structure or args.run_file or getattr(args, "model", "lj") != "lj":
        return []
    try:
        atoms = read_structure(args.structure)
    except ValueError as exc:
        return [str(exc)]
    out = []
    n = len(atoms)
    if n == 0:
        return [f"--structure {args.structure}: holds no atoms"]
    import numpy as np

    if not np.isfinite(atoms.get_positions()).all():
        out.append(f"--structure {args.structure}: positions are not all finite")
    pbc, cell = atoms.get_pbc(), np.asarray(atoms.get_cell())
    flat = [a for a in range(3) if pbc[a] and not np.linalg.norm(cell[a]) > 0]
    if flat:
        out.append(f"--structure {args.structure}: periodic axes {flat} have no cell vector")
    missing = sorted({int(z) for z in atoms.get_atomic_numbers()} - set(species))
    if missing:
        symbols, _ = _symbol_table()
        names = ", ".join(f"{symbols[z]} (Z={z})" for z in missing)
        first = symbols[missing[0]]
        out.append(
            f"--structure {args.structure}: no Lennard-Jones parameters for {names}; pass "
            f"--lj {first}:EPSILON:SIGMA (eV, A) for each (built in: Ar only)"
        )
    return out


def _model_options(args: argparse.Namespace) -> list[str]:
    """``--model`` / ``--model-file`` (a MACE file must exist; LJ takes none)."""
    from nvalchemi.distributed._model_args import model_args_problem

    problem = model_args_problem(args)
    return [] if problem is None else [problem]


def _ensemble(args: argparse.Namespace) -> list[str]:
    """The first phase's own numbers (``--ensemble``)."""
    out = []
    if args.ensemble in ("nvt-nh", "npt") and not (math.isfinite(args.tau_t) and args.tau_t > 0):
        out.append(f"--tau-t must be > 0 fs, got {args.tau_t}")
    if args.ensemble == "npt":
        if not math.isfinite(args.pressure):
            out.append(f"--pressure must be a finite number of bar, got {args.pressure}")
        if not (math.isfinite(args.tau_p) and args.tau_p > 0):
            out.append(f"--tau-p must be > 0 fs, got {args.tau_p}")
        if args.structure or args.run_file:
            return out  # the cell's periodicity is checked when the system is read
    return out


def _run_file(args: argparse.Namespace) -> list[str]:
    """The run file parses and names a known system and models."""
    if not args.run_file:
        return []
    if args.structure:
        return ["--run-file and --structure both give the system: pass one"]
    from nvalchemi.distributed._runfile import load_run_file

    try:
        load_run_file(args.run_file)
    except (OSError, ValueError, ImportError) as exc:
        return [f"--run-file {args.run_file}: {exc}"]
    return []


def _restart(args: argparse.Namespace) -> list[str]:
    if not args.restart:
        return []
    try:
        manifest = restart_point(args.restart)
    except ValueError as exc:
        return [str(exc)]
    cls = manifest.get("integrator", {}).get("class")
    if cls not in FIRST_PHASE_CLASSES and cls != "VelocityVerlet":
        return [
            f"--restart {args.restart}: written by a {cls} run, nvdd run restarts its own "
            "phases (Langevin, NoseHooverNVT, MTKNPT, VelocityVerlet)"
        ]
    return []


#: Integrator class of the first phase, by ``--ensemble``.
FIRST_PHASE_CLASSES = {"Langevin": "langevin", "NoseHooverNVT": "nvt-nh", "MTKNPT": "npt"}

#: The checkers :func:`validate` runs, in order.
CHECKERS: list[Callable[[argparse.Namespace], list[str]]] = [
    _numbers,
    _device,
    _model_options,
    _model,
    _ensemble,
    _run_file,
    _restart,
]


def validate(args: argparse.Namespace) -> list[str]:
    """Every problem with ``args`` (empty list: good to launch)."""
    problems: list[str] = []
    for check in CHECKERS:
        problems += check(args)
    return problems
