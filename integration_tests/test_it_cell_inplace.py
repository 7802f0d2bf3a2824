"""A cell changed in place (same tensor, new values) between steps is seen.

The skin test skips the cell algebra while a step's batch holds the cell
tensor of the last build unmodified (``skin_exceeded(same_cell=True)``, a GPU
fast path); an in-place change bumps the tensor's version and must take the
full, strain-aware test. Compressing the cell by 10 % without moving the atoms
brings periodic images closer than the halo covered: without the full test the
forces would miss pairs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from it_systems import LJ_CUTOFF, crystal, lj_model

from nvdd.dynamics import DomainConfig, DomainParallel, VelocityVerlet
from nvdd.testing import run_ranks

pytestmark = pytest.mark.gloo


def _compressed(backend: str) -> dict[str, Any]:
    model = lj_model(backend=backend)
    dyn = VelocityVerlet(model, crystal("periodic"), dt_fs=2.0)
    dp = DomainParallel(dyn, DomainConfig(cutoff=LJ_CUTOFF, skin=0.5))
    dp.partition()
    dp.run(3)
    rebuilds = dp.stats.rebuilds
    dp.dynamics.batch.cell.mul_(0.9)  # in place: the tensor of the last build
    whole = dp.single_point(dst=None)  # recomputes at the current cell
    out = {"forces": whole.forces, "ids": whole.atom_ids, "rebuilt": dp.stats.rebuilds > rebuilds}
    reference = lj_model(backend=backend)(whole)
    out["reference"] = reference["forces"]
    dp.close()
    return out


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_an_in_place_cell_change_rebuilds_the_halo(backend: str) -> None:
    for out in run_ranks(_compressed, 2, backend):
        assert out["rebuilt"]
        torch.testing.assert_close(out["forces"], out["reference"], rtol=0, atol=1e-10)
