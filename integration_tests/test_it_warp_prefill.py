"""tools/warp_prefill.py (record 0086): CI's one-process fill of the Warp kernel cache.

Runs in this process against the session's cache (in CI already filled by the
prefill, so nothing compiles here): every kernel module of the packages is
declared and loaded, its entry is in the cache, and a real launch of the halo's
kernels afterwards loads that same entry (the package declares no overload the
prefill left out, which would give the module another hash).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from warp_prefill import prefill

from nvdd.core import init_warp


def test_the_prefill_caches_every_kernel_module_as_the_tests_load_it() -> None:
    done = prefill()
    assert [how for _, how, _ in done if how.startswith("failed")] == []
    entries = {entry for entry, _, _ in done}
    names = {entry.rsplit("_", 1)[0] for entry in entries}
    assert {
        "wp_nvdd.dynamics._barostat_kernels",
        "wp_nvdd.dynamics._chain_device",
        "wp_nvdd.dynamics._decision_kernels",
        "wp_nvdd.halo._warp_kernels",
        "wp_nvdd.models._cell_kernels",
        "wp_nvdd.models._edge_kernels",
        "wp_nvdd.models._lj_kernels",
        "wp_nvdd.partition._migrate_kernel",
    } < names  # (and the LJ per-atom-virial variant's own module)
    assert len(entries) == 9
    cache = Path(init_warp().config.kernel_cache_dir)
    assert sorted(e for e in entries if not (cache / e).is_dir()) == []

    from nvdd.halo._kernels import compute_fractional
    from nvdd.halo._warp_kernels import compute_fractional_kernel

    for dtype in (torch.float32, torch.float64):  # both overloads, as the tests use them
        positions = torch.tensor([[0.5, 1.0, 1.5]], dtype=dtype)
        frac, _ = compute_fractional(
            positions, torch.zeros(1, dtype=torch.int64), torch.eye(3, dtype=dtype)[None] / 2.0
        )
        assert frac.tolist() == [[0.25, 0.5, 0.75]]
    assert compute_fractional_kernel.module.get_module_identifier(1) in entries
