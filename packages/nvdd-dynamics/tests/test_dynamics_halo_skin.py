"""A halo skin thicker than the model's: ``DomainConfig(skin=...)`` is the
halo's, the model's own skin its neighbour list's. The decomposed run stays
equal to one process by atom id while the halo is rebuilt less often than the
model's list (benchmarks/halo_rebuilds.py measures what that saves)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nvdd.dynamics import DomainConfig, DomainParallel, VelocityVerlet
from nvdd.models import LennardJones, LJConfig
from nvdd.testing import assert_close_by_id, assert_same_ids, binary_lattice, run_ranks

_STEPS = 40
#: The model's list skin; the halo's is this (as usual) or three times it.
_MODEL_SKIN = 0.15


def _system() -> Any:
    """A jittered argon-like lattice of 576 atoms, long in x (two boxes hold
    different atoms), with random velocities (atoms cross box faces in the run)."""
    b = binary_lattice((16, 6, 6), 1.2, species=(18, 18), jitter=0.05)
    g = torch.Generator().manual_seed(1)
    return b.replace(velocities=0.02 * torch.randn(b.n_atoms, 3, generator=g, dtype=torch.float64))


def _lj() -> LennardJones:
    return LennardJones(LJConfig(cutoff=2.5, epsilon=0.02, sigma=1.05, skin=_MODEL_SKIN))


def _rank(halo_skin: float) -> dict[str, Any]:
    model = _lj()
    dyn = VelocityVerlet(model, _system(), dt_fs=2.0)
    with DomainParallel(dyn, DomainConfig(cutoff=2.5, skin=halo_skin)) as dp:
        dp.partition()
        dp.run(_STEPS)
        out = dp.gather(0)
        counts = {"halo": dp.stats.rebuilds, "list": model.device_neighbors.n_builds}
    if out is None:
        return counts
    return {**counts, "ids": out.atom_ids, "forces": out.forces, "positions": out.positions}


@pytest.mark.gloo
def test_a_halo_skin_thicker_than_the_model_s_is_exact_and_rebuilds_the_halo_less() -> None:
    ref = VelocityVerlet(_lj(), _system(), dt_fs=2.0)
    ref.run(_STEPS)
    runs = {s: run_ranks(_rank, 2, s) for s in (_MODEL_SKIN, 3 * _MODEL_SKIN)}
    for results in runs.values():
        got = results[0]
        assert_same_ids(got["ids"], ref.batch.atom_ids)
        for field in ("positions", "forces"):
            assert_close_by_id(
                got["ids"], got[field], ref.batch.atom_ids, getattr(ref.batch, field), atol=1e-10
            )
    same, thick = runs[_MODEL_SKIN][0], runs[3 * _MODEL_SKIN][0]
    # the model's list is rebuilt by its own criterion, with either halo, more
    # than once; the thick halo is rebuilt fewer times than the thin one
    assert thick["list"] >= 3 and same["list"] >= 3, (same, thick)
    assert thick["halo"] < same["halo"], (same, thick)
    assert thick["halo"] < thick["list"], thick
