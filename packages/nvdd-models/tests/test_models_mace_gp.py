"""MACEModel under StrategyKind.GRAPH_PARTITION: its spec, and N gloo ranks vs one process.

The graph-partition layout is built here with nvdd-halo directly, as
``nvdd.dynamics.GraphPartitionModel`` builds it (the runtime sits above this
package): rank ``r`` owns a contiguous block of the atoms sorted along x (a
compact block, as the runtime's Z-order gives), its ghost rows are every other atom within ``cutoff + margin`` of an owned atom in
any periodic image (chosen here by brute force over images), requested from
their owners (``build_request_plan``: zero image shifts, ``explicit_images``
False), and the model runs on ``[owned | ghost]`` rows at their own positions
with the **real** cell and pbc. The end-to-end runs through ``DomainParallel``
are in ``integration_tests/test_it_graph_partition.py``.
"""

from __future__ import annotations

import itertools
import pickle
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from models_ddcases import HALO_MARGIN, MPNN_CUTOFF, global_batch, make_model
from models_testutils import image_ranges

from nvdd.core import Batch, ConfigurationError
from nvdd.halo import HaloPlan, build_request_plan
from nvdd.models import MACEConfig, MACEModel, build_mace
from nvdd.shardtensor import DDContext, dd_scope
from nvdd.spec import AdapterRegistry, StrategyKind
from nvdd.testing import assert_close_by_id, assert_same_ids, importorskip_extra, run_ranks

importorskip_extra("mace")  # a failure, not a skip, where CI installs the extras
pytestmark = pytest.mark.filterwarnings("ignore:The TorchScript type system:UserWarning")

ATOL = 1e-10
GP = StrategyKind.GRAPH_PARTITION


def _small_mace(layers: int = 2) -> MACEModel:
    return MACEModel(
        build_mace(MACEConfig(atomic_numbers=(8, 14), r_max=3.0, num_interactions=layers))
    )


# ------------------------------------------------------------------ the spec
def test_graph_partition_spec_is_the_halo_spec_with_graph_storage() -> None:
    model = _small_mace(3)
    halo, graph = model.distribution_spec(), model.distribution_spec(GP)
    assert graph is model.distribution_spec("graph_partition")  # built once per model
    assert graph.name == "SPEC_MACE_GP" and halo.name == "SPEC_MACE_HALO"
    assert graph.strategy is GP and halo.strategy is StrategyKind.HALO
    assert graph.outputs == halo.outputs
    assert graph.force_strategy is halo.force_strategy
    assert graph.options == halo.options
    # the same two patches: refresh before interactions 1.., products on owned rows
    assert [a.target for a in graph.adapters()] == [a.target for a in halo.adapters()]
    assert len(graph.adapters()) == 2
    assert {a.declared_in for a in graph.adapters()} == {"SPEC_MACE_GP"}
    assert pickle.loads(pickle.dumps(graph)) == graph


def test_a_value_that_is_not_a_strategy_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="strategy must be a StrategyKind, got 'ring'"):
        _small_mace().distribution_spec("ring")


# ------------------------------------------------ gloo: a GP layout, N ranks vs 1
def _ghost_rows(batch: Batch, owned: torch.Tensor, width: float) -> torch.Tensor:
    """Sorted rows not in ``owned`` within ``width`` of an owned row of their system,
    in any periodic image (brute force over every image that can reach)."""
    pos = batch.positions.double().numpy()
    si = batch.system_index.numpy()
    is_owned = np.zeros(batch.n_atoms, dtype=bool)
    is_owned[owned.numpy()] = True
    near = np.zeros(batch.n_atoms, dtype=bool)
    for s in range(batch.n_systems):
        cell = batch.cell[s].double().numpy()
        mine = np.nonzero((si == s) & is_owned)[0]
        others = np.nonzero((si == s) & ~is_owned)[0]
        if len(mine) == 0 or len(others) == 0:
            continue
        for image in itertools.product(*image_ranges(cell, batch.pbc[s].tolist(), width)):
            shifted = pos[others] + np.asarray(image, dtype=np.float64) @ cell
            d = np.linalg.norm(shifted[:, None, :] - pos[mine][None, :, :], axis=-1)
            near[others[(d < width).any(axis=1)]] = True
    return torch.from_numpy(np.nonzero(near)[0])


def _graph_layout(batch: Batch, world: int) -> tuple[torch.Tensor, HaloPlan]:
    """**Collective**: this rank's owned rows (its block of the atoms sorted along
    x) and the request plan of its ghost rows."""
    rank = dist.get_rank()
    # blocks along x (compact, as the runtime's Z-order; every system is cut)
    blocks = torch.tensor_split(torch.argsort(batch.positions[:, 0]), world)
    owner = torch.empty(batch.n_atoms, dtype=torch.int64)
    row = torch.empty(batch.n_atoms, dtype=torch.int64)
    for r, block in enumerate(blocks):
        owner[block], row[block] = r, torch.arange(len(block))
    owned = blocks[rank]
    ghosts = _ghost_rows(batch, owned, MPNN_CUTOFF + HALO_MARGIN)
    ghosts = ghosts[torch.argsort(owner[ghosts], stable=True)]  # requests sorted by owner
    plan = build_request_plan(
        owner[ghosts],
        row[ghosts],
        len(owned),
        atom_ids=batch.atom_ids[ghosts],
        system_index=batch.system_index[ghosts],
        n_systems=batch.n_systems,
    )
    return owned, plan


def _gp_forward(model: MACEModel, batch: Batch, world: int, adapters: bool) -> dict[str, Any]:
    """**Collective**: one forward on this rank's GP rows, consolidated as the runtime
    does (ghost-row forces folded into their owners, partial virial and stress
    summed); ``exchanges``: the ``all_to_all_single`` calls of the forward and its
    backward."""
    owned, plan = _graph_layout(batch, world)
    pos = batch.positions[owned]
    padded = Batch(
        torch.cat([pos, plan.ghost_positions(pos, batch.cell)]),
        torch.cat([batch.atomic_numbers[owned], plan.forward(batch.atomic_numbers[owned])]),
        cell=batch.cell,
        pbc=batch.pbc,  # the real boundaries: ghosts are the atoms, not images
        system_index=torch.cat([batch.system_index[owned], plan.ghost_system_index]),
        atom_ids=torch.cat([batch.atom_ids[owned], plan.ghost_atom_ids]),
    )
    spec = model.distribution_spec(GP)
    leaf = padded.positions.detach().requires_grad_(True)
    calls = [0]
    original = dist.all_to_all_single

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    ctx = DDContext(layout=plan, positions=leaf, n_systems=padded.n_systems)
    dist.all_to_all_single = counting  # type: ignore[assignment]
    try:
        with AdapterRegistry(spec.adapters() if adapters else ()), dd_scope(ctx):
            out = model(padded.replace(positions=leaf))
    finally:
        dist.all_to_all_single = original
    n = plan.n_owned
    forces = out["forces"].detach()
    result = {
        "ids": padded.atom_ids[:n],
        "forces": forces[:n] + plan.reverse(forces[n:]),
        "atom_energies": out["atom_energies"].detach()[:n],
        "exchanges": calls[0],
        "n_ghost": plan.n_ghost,
        "n_others": batch.n_atoms - n,
    }
    for key in ("energy", "virial", "stress"):
        value = out[key].detach().clone()
        if spec.output(key).effective_reduce().value == "all_reduce":
            dist.all_reduce(value)
        result[key] = value
    return result


#: (ddcases batch, interactions): periodic, two systems (one triclinic), open
GP_CASES = [("periodic-2", 3), ("two-systems-2", 2), ("open-lopsided-2", 2)]


def _gp_rank(world: int) -> list[dict[str, Any]]:
    """Rank body: every case of :data:`GP_CASES`, with the spec's adapters and without."""
    out = []
    for case, layers in GP_CASES:
        model = make_model("mace", layers)
        batch = global_batch(case, "mace")
        out.append(
            {
                "with": _gp_forward(model, batch, world, adapters=True),
                "without": _gp_forward(model, batch, world, adapters=False),
            }
        )
    return out


@pytest.mark.gloo
@pytest.mark.parametrize("world", [2, 3])
def test_mace_graph_partition_ranks_equal_one_process_by_id(world: int) -> None:
    """Forces and atom energies by atom id, energy, virial and stress on every rank,
    within 1e-10 in float64, on a periodic, a two-system and an open batch; L - 1
    refreshes (one exchange forward, one in the backward) per forward; without the
    spec's adapters the stale ghost features show in the forces."""
    got = run_ranks(_gp_rank, world, world, timeout_s=300)
    for k, (case, layers) in enumerate(GP_CASES):
        batch = global_batch(case, "mace")
        ref = make_model("mace", layers)(batch)
        ranks = [g[k]["with"] for g in got]
        ids = torch.cat([r["ids"] for r in ranks])
        assert_same_ids(ids, batch.atom_ids, f"{case}: owned atoms")
        for key in ("forces", "atom_energies"):
            values = torch.cat([r[key] for r in ranks])
            assert_close_by_id(
                ids, values, batch.atom_ids, ref[key], atol=ATOL, what=f"{case} {key}"
            )
        for r in ranks:
            for key in ("energy", "virial", "stress"):
                torch.testing.assert_close(r[key], ref[key], rtol=0, atol=ATOL, msg=f"{case} {key}")
            assert r["exchanges"] == 2 * (layers - 1), (case, r["exchanges"])
            assert r["n_ghost"] > 0, case
        stale = [g[k]["without"] for g in got]
        forces = torch.cat([r["forces"] for r in stale])
        with pytest.raises(AssertionError, match="forces differ"):
            assert_close_by_id(ids, forces, batch.atom_ids, ref["forces"], atol=1e-6, what="forces")
        assert all(r["exchanges"] == 0 for r in stale)
    # the open batch reads fewer rows than an all-gather would bring
    assert any(g[-1]["with"]["n_ghost"] < g[-1]["with"]["n_others"] for g in got)
