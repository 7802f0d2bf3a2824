"""The whole DD path on a device, guarded on the CPU (issue 12).

No GPU in CI: the fake accelerator of ``nvdd.testing`` (real CPU values, CUDA-like
device checks, NCCL-like collectives) runs partition, migration, halo rebuilds,
hooks of every scope, a rebalance, gather and to_global, for LJ and the MPNN, on
periodic, triclinic, open, mixed and two-system batches. Any operator that mixes
the atoms' device with the CPU raises; the results must equal the CPU run (to
rounding: the Warp LJ kernel sums with atomics).
"""

from __future__ import annotations

import pytest
import torch
from it_device import cpu_and_fake

from nvdd.testing import run_ranks

pytestmark = pytest.mark.gloo

CASES = [
    (2, "periodic", "lj", "halo"),
    (3, "triclinic", "lj", "halo"),
    (2, "slab", "lj", "halo"),
    (2, "cluster", "lj", "halo"),
    (2, "two", "lj", "halo"),
    (2, "periodic", "mpnn2", "halo"),
    (3, "two", "mpnn2", "graph_partition"),
]


@pytest.mark.parametrize(
    ("world", "kind", "model", "strategy"),
    CASES,
    ids=[f"{c[2]}-{c[1]}-{c[0]}-{c[3]}" for c in CASES],
)
def test_dd_run_on_a_device_equals_the_cpu_run(
    world: int, kind: str, model: str, strategy: str
) -> None:
    out = run_ranks(cpu_and_fake, world, kind, model, strategy, timeout_s=600)
    for rank, (cpu, fake) in enumerate(out):
        assert fake["whole_device"] == "meta", f"rank {rank}: to_global left the device"
        # (the Warp LJ kernel sums with atomics: equal to rounding, not bit for bit)
        for key in ("local", "global"):
            torch.testing.assert_close(
                torch.tensor(fake["hooks"][key]),
                torch.tensor(cpu["hooks"][key]),
                rtol=1e-12,
                atol=0,
            )
        assert fake["rebuilds"] == cpu["rebuilds"]
    cpu, fake = out[0]
    assert fake["hooks"]["zero"] == ["meta"] * len(cpu["hooks"]["zero"]) != []
    assert fake["device"] == "meta"
    assert torch.equal(cpu["ids"], fake["ids"])
    for key in ("positions", "forces", "energy", "stress"):
        torch.testing.assert_close(fake[key], cpu[key], rtol=1e-12, atol=1e-12, msg=key)
