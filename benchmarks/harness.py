"""The shared benchmark harness: systems, timing, result files.

Every benchmark script builds its systems, times its steps and writes its
results through this module, so that a number means the same thing in every
script and every result file says how it was measured.

- :func:`argon_fcc`: the FCC argon crystal every LJ benchmark runs (and the
  peer loop reproduces atom for atom).
- :func:`sync`, :func:`reset_memory`, :func:`peak_bytes`, :func:`time_steps`:
  timing with warm-up and a device synchronisation around the timed steps.
- :func:`environment` and :func:`write_result`: a result file in
  ``benchmarks/results/`` with the command, the commit, the machine and the
  library versions inside (the schema ``benchmarks/render.py`` reads).

torch is imported lazily: the result-file helpers work without it.
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import subprocess
import time
from collections.abc import Callable, Sequence
from datetime import date
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SCHEMA = 1

#: FCC argon: lattice constant (A), LJ epsilon (eV), sigma (A), mass (amu).
AR_LATTICE, AR_EPSILON, AR_SIGMA, AR_MASS = 5.26, 0.0104, 3.40, 39.948
KB_EV_PER_K = 8.617333262e-5
#: Libraries whose versions a result file records (those installed).
VERSIONED = ("torch", "warp-lang", "nvalchemi-toolkit-ops", "mace-torch", "cuequivariance-torch")


def argon_fcc(
    cells: int,
    *,
    device: str = "cpu",
    dtype: Any = None,
    temperature_K: float = 90.0,
    seed: int = 0,
) -> Any:
    """FCC argon, ``cells**3`` cubic cells (``4 cells**3`` atoms), periodic, with
    Maxwell-Boltzmann velocities at ``temperature_K`` (zero total momentum)."""
    import torch

    from nvdd.core import Batch

    dtype = dtype or torch.float64
    basis = torch.tensor(
        [[0, 0, 0], [0.5, 0.5, 0], [0.5, 0, 0.5], [0, 0.5, 0.5]], dtype=dtype, device=device
    )
    g = torch.arange(cells, dtype=dtype, device=device)
    grid = torch.stack(torch.meshgrid(g, g, g, indexing="ij"), -1).reshape(-1, 1, 3)
    positions = ((grid + basis[None]) * AR_LATTICE).reshape(-1, 3)
    n = positions.shape[0]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    scale = math.sqrt(KB_EV_PER_K * temperature_K / AR_MASS)
    v = (torch.randn(n, 3, generator=gen, dtype=dtype) * scale).to(device)
    v -= v.mean(dim=0)
    return Batch(
        positions=positions,
        atomic_numbers=torch.full((n,), 18, device=device),
        masses=torch.full((n,), AR_MASS, dtype=dtype, device=device),
        velocities=v,
        cell=torch.eye(3, dtype=dtype, device=device) * cells * AR_LATTICE,
        pbc=torch.ones(1, 3, dtype=torch.bool, device=device),
    )


def sync(device: str) -> None:
    """Wait for the device (CUDA); nothing on the CPU."""
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def reset_memory(device: str) -> None:
    """Collect garbage and reset the device's peak-memory counter."""
    gc.collect()
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_bytes(device: str) -> int:
    """Peak bytes allocated on the device since :func:`reset_memory` (0 on the CPU)."""
    if str(device).startswith("cuda"):
        import torch

        return int(torch.cuda.max_memory_allocated())
    return 0


def time_steps(run: Callable[[int], Any], steps: int, warmup: int, device: str) -> float:
    """Milliseconds per step of ``run(n)`` (which takes ``n`` steps): ``warmup``
    steps first, then ``steps`` timed between two device synchronisations."""
    if steps <= 0:
        raise ValueError(f"steps must be > 0, got {steps}")
    if warmup > 0:
        run(warmup)
    sync(device)
    t0 = time.perf_counter()
    run(steps)
    sync(device)
    return 1000.0 * (time.perf_counter() - t0) / steps


def _git(*args: str, cwd: Path = ROOT) -> str:
    try:
        out = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, check=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip()


def commit_of(tree: Path = ROOT) -> str:
    """The commit of a source tree, with ``+dirty`` when it has uncommitted changes."""
    head = _git("rev-parse", "--short", "HEAD", cwd=tree)
    dirty = _git("status", "--porcelain", "--untracked-files=no", cwd=tree)
    return head + ("+dirty" if dirty and dirty != "unknown" else "")


def machine() -> dict[str, Any]:
    """What ran the benchmark: host, CPU cores and, where visible, the GPUs."""
    info: dict[str, Any] = {
        "kind": os.environ.get("NVDD_BENCH_MACHINE", platform.node() or "unknown"),
        "platform": platform.platform(),
        "cpu_cores": os.cpu_count(),
    }
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info["gpu"] = props.name
            info["gpus"] = torch.cuda.device_count()
            info["gpu_memory_mib"] = props.total_memory // 2**20
    except ImportError:
        pass
    return info


def versions() -> dict[str, str]:
    """Installed versions of the libraries that shape the numbers."""
    out = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def environment(tree: Path = ROOT) -> dict[str, Any]:
    """The provenance a result file carries: commit, date, machine, versions."""
    return {
        "commit": commit_of(tree),
        "date": date.today().isoformat(),
        "machine": machine(),
        "versions": versions(),
    }


def write_result(
    name: str,
    *,
    title: str,
    command: str,
    rows: Sequence[dict[str, Any]],
    benchmark: str,
    out_dir: Path = RESULTS,
    provenance: dict[str, Any] | None = None,
    note: str | None = None,
) -> Path:
    """Write ``out_dir/<name>.json`` in the schema of ``benchmarks/render.py``."""
    doc: dict[str, Any] = {"schema": SCHEMA, "name": name, "title": title}
    doc["benchmark"] = benchmark
    doc["command"] = command
    doc.update(provenance or environment())
    if note:
        doc["note"] = note
    doc["rows"] = [_finite(r) for r in rows]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def _finite(value: Any) -> Any:
    """NaN and inf become None (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
