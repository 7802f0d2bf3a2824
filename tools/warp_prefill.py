"""Compile the nvdd packages' Warp modules into the kernel cache once, on CPU (record 0086).

In a fresh clone the Warp kernel cache (``WARP_CACHE_PATH``, ``.nox/_shared/warp-cache``
in the nox sessions) is empty, and every new process that loads a module the
cache lacks compiles it: the first compile of a process costs 9 to 15 s of CPU
(Warp's compiler starting), and CI's test processes, gloo ranks and ``nvdd run``
ranks each paid it (record 0082). A module's cache entry is named by a hash of
the kernel overloads it holds when it loads; the packages declare the float32
and float64 overloads of every kernel of a module before its first launch, so
that hash is the same in every process. This tool declares them the same way
(through the packages' own declaring functions), loads each module on CPU in
this one process, and so leaves the cache holding what the tests load.

A second prefill at the same time (CI's ``checks`` and ``e3nn06`` sessions)
waits for the first (a lock file in the cache) and then finds every module
cached. Modules of packages that are not installed are skipped.

Usage: ``python tools/warp_prefill.py``; prints one line per module and a summary.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["KERNEL_MODULES", "main", "prefill"]


def _halo() -> list[Any]:
    from nvdd.halo._kernels import _ready
    from nvdd.halo._warp_kernels import compute_fractional_kernel

    _ready()
    return [compute_fractional_kernel.module]


def _cells() -> list[Any]:
    from nvdd.models._cell_kernels import check_kernel
    from nvdd.models._device_neighbors import _Kernels

    _Kernels().declare()
    return [check_kernel.module]


def _edges() -> list[Any]:
    from nvdd.models._device_edges import _Kernels
    from nvdd.models._edge_kernels import count_edges_kernel

    _Kernels().declare()
    return [count_edges_kernel.module]


def _lj() -> list[Any]:
    from nvdd.models._lj_kernels import lj_atom_virial_kernel, lj_kernel
    from nvdd.models._warp import Kernel, declare_overloads

    kernels = [Kernel(lj_kernel), Kernel(lj_atom_virial_kernel)]  # (each as LennardJones does)
    declare_overloads(*kernels)
    return [lj_kernel.module, lj_atom_virial_kernel.module]  # (the variant: its own module)


def _migrate() -> list[Any]:
    from nvdd.partition._migrate_kernel import _KERNEL

    _KERNEL.declare_overloads()
    return [_KERNEL.kernel.module]


def _barostat() -> list[Any]:
    from nvdd.dynamics._barostat_device import _declare_rows
    from nvdd.dynamics._barostat_kernels import affine_rows_kernel

    _declare_rows()
    return [affine_rows_kernel.module]


def _decision() -> list[Any]:
    from nvdd.dynamics._step import decision_launcher

    return [decision_launcher().kernel.module]


def _chain() -> list[Any]:
    from nvdd.dynamics._chain_device import _half_step  # (no generic kernel)

    return [_half_step.module]


#: Every Python module of the packages that defines Warp kernels, with the
#: function that declares their overloads as the package does before the first
#: launch and returns the Warp modules to load (tools/tests checks that no
#: kernel module is missing here).
KERNEL_MODULES: dict[str, Callable[[], list[Any]]] = {
    "nvdd.dynamics._barostat_kernels": _barostat,
    "nvdd.dynamics._chain_device": _chain,
    "nvdd.dynamics._decision_kernels": _decision,
    "nvdd.halo._warp_kernels": _halo,
    "nvdd.models._cell_kernels": _cells,
    "nvdd.models._edge_kernels": _edges,
    "nvdd.models._lj_kernels": _lj,
    "nvdd.partition._migrate_kernel": _migrate,
}


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    """Hold an exclusive lock on the cache's prefill lock file (a second prefill waits)."""
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".nvdd-prefill.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def prefill() -> list[tuple[str, str, float]]:
    """Load every kernel module on CPU: (cache entry, "compiled" or "cached", seconds).

    A module whose overloads could not be declared is reported as ``"failed: ..."``
    and skipped (the tests then compile it, as without the prefill).
    """
    from nvdd.core import init_warp

    wp = init_warp()  # (quiet unless NVDD_VERBOSE=1)
    cache = Path(wp.config.kernel_cache_dir)
    done: list[tuple[str, str, float]] = []
    with _locked(cache):
        for name, declare in KERNEL_MODULES.items():
            try:
                importlib.import_module(name)
            except ImportError:  # (its package is not installed in this environment)
                continue
            try:
                modules = declare()
            except Exception as exc:  # (a renamed helper: the tests compile it instead)
                done.append((name, f"failed: {exc!r}", 0.0))
                continue
            for module in modules:
                before = set(os.listdir(cache))
                t0 = time.perf_counter()
                wp.load_module(module, device="cpu")  # (as a CPU launch loads it)
                seconds = time.perf_counter() - t0
                new = set(os.listdir(cache)) - before
                entry = module.get_module_identifier(1)  # (a CPU launch's block_dim)
                done.append((entry, "compiled" if new else "cached", seconds))
    return done


def main() -> int:
    """Prefill and report (exit status 0: a failed module only costs time)."""
    t0 = time.perf_counter()
    done = prefill()
    for entry, how, seconds in done:
        print(f"  {entry}: {how} in {seconds:.1f} s")
    compiled = sum(how == "compiled" for _, how, _ in done)
    failed = sum(how.startswith("failed") for _, how, _ in done)
    print(
        f"warp prefill: {len(done)} modules ({compiled} compiled, {failed} failed) in "
        f"{time.perf_counter() - t0:.1f} s, cache {os.environ.get('WARP_CACHE_PATH', '(default)')}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
