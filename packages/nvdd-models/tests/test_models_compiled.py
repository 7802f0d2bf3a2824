"""compile_forward: the models' padded, collective-free compiled regions give the
eager model's outputs, compile once per capacity, and switch off again.

Backend ``aot_eager`` (the graphs inductor would compile, traced forward and
backward, without code generation: cheap on 2 CPU cores).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models_ddcases import global_batch, make_model

from nvdd.core import Batch
from nvdd.models import EdgeList
from nvdd.models._compiled import MAX_GROWTH, CompiledCore
from nvdd.spec import CompilePolicy

EAGER_ATOL = 1e-10


def _policy(**kw: object) -> CompilePolicy:
    return CompilePolicy(enabled=True, backend="aot_eager", **kw)  # type: ignore[arg-type]


def _moved(batch: Batch, k: int) -> Batch:
    g = torch.Generator().manual_seed(k)
    return batch.replace(
        positions=batch.positions
        + 0.05 * torch.randn(batch.positions.shape, generator=g, dtype=batch.positions.dtype)
    )


@pytest.mark.parametrize(
    ("kind", "mode", "policy"),
    [
        ("mpnn", "direct", {"fullgraph": True}),
        ("lj", "direct", {"fullgraph": True}),
        ("lj", "autograd", {}),
        ("mpnn", "direct", {"pad_shapes": False}),
    ],
    ids=["mpnn-fullgraph", "lj-direct", "lj-autograd", "mpnn-unpadded-dynamic"],
)
def test_compiled_core_equals_the_eager_model(kind: str, mode: str, policy: dict) -> None:
    torch._dynamo.reset()
    # LJ's compiled core is its torch path (the Warp backend is compiled code already)
    backend = {"backend": "torch"} if kind == "lj" else {}
    eager = make_model(kind, mode=mode, **backend)
    compiled = make_model(kind, mode=mode, **backend)
    assert compiled.compile_forward(_policy(**policy)) is True
    batch = global_batch("two-systems-2", kind)  # a periodic and a triclinic system
    for k in range(3):
        moved = _moved(batch, k)
        want, got = eager(moved), compiled(moved)
        assert set(got) == set(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=EAGER_ATOL, msg=key)
    caps = compiled._core.capacities if compiled._core is not None else {}
    if policy.get("pad_shapes", True):
        assert caps[f"{kind}.atoms"] >= batch.n_atoms + 2 and caps[f"{kind}.edges"] > 0
    else:
        assert caps == {}
    assert not any(p.requires_grad for p in compiled.parameters())  # forces need no weight grads
    assert compiled.compile_forward(None) is False and compiled._core is None
    assert all(p.requires_grad for p in compiled.parameters())  # given back
    out = compiled(batch)  # eager again
    torch.testing.assert_close(out["forces"], eager(batch)["forces"], rtol=0, atol=0)


def test_a_drifting_edge_count_compiles_once_per_capacity() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = make_model("lj", backend="torch")
    model.compile_forward(_policy())
    batch = global_batch("periodic-2", "lj")
    edges = set()
    for k in range(12):  # compress the box: more edges per step
        squeezed = batch.replace(
            positions=batch.positions * (1 - 0.02 * k), cell=batch.cell * (1 - 0.02 * k)
        )
        model(squeezed)
        edges.add(model.neighbors.candidates.n_edges if model.neighbors.candidates else 0)
    caps = model._core.capacities if model._core is not None else {}
    growths = model._core.padder.registry.n_reshapes if model._core and model._core.padder else -1
    assert len(edges) >= 6  # the count drifted at nearly every step
    assert int(counters["stats"]["unique_graphs"]) == growths  # one graph per capacity
    assert 2 <= growths <= 4, (growths, caps)  # grew, geometrically: not at every step


def test_each_regrow_doubles_the_headroom() -> None:
    """A count that keeps drifting up: 25 % -> 40 % (at most) of headroom after a
    regrow, so the capacities settle after a few recompiles."""
    torch._dynamo.reset()
    model = make_model("lj", backend="torch")
    model.compile_forward(_policy())
    batch = global_batch("periodic-2", "lj")
    growths = []
    for k in range(10):
        squeezed = batch.replace(
            positions=batch.positions * (1 - 0.02 * k), cell=batch.cell * (1 - 0.02 * k)
        )
        model(squeezed)
        assert model._core is not None and model._core.padder is not None
        growths.append(model._core.padder.growth)
    core = model._core
    assert core is not None and core.padder is not None
    assert growths[0] == pytest.approx(1.25) and growths[-1] == pytest.approx(MAX_GROWTH)
    assert growths == sorted(growths) and core.regrows >= 1
    assert core.regrows == core.padder.registry.n_reshapes - 1  # (the first call created them)


def test_the_default_hook_declines() -> None:
    from nvdd.spec import BaseModelMixin

    assert BaseModelMixin().compile_forward(_policy()) is False


def test_lj_on_its_warp_backend_compiles_nothing() -> None:
    """Direct forces on the Warp backend: compile_forward claims the core (so the
    runtime does not torch.compile Warp launches) but compiles no region."""
    model = make_model("lj")
    assert model.compile_forward(_policy()) is True
    assert model._core is None
    assert model.compile_forward(None) is False


def _core_inputs(core: Any, n_owned: int) -> None:
    """One padded call of ``core`` on 200 atoms and 10 fixed edges, ``n_owned`` of
    the rows receiving (only the owned-row capacity can regrow)."""
    n = 200
    ring = torch.arange(10)
    edges = EdgeList(ring, (ring + 1) % 10, torch.zeros(10, 3, dtype=torch.int64))
    positions = torch.arange(3 * n, dtype=torch.float64).reshape(n, 3)
    zeros = torch.zeros(n, dtype=torch.int64)
    core.inputs(positions, zeros, zeros, edges, generation=0, n_owned=n_owned)


def test_owned_row_regrows_are_counted_and_escalated_like_the_others() -> None:
    """The owned-row capacity (``mpnn.owned``) grows with the padder's headroom,
    its regrows count in ``regrows`` (each is a recompile) and double the
    headroom, as an atom or edge regrow does: 40 -> 56 (25 %, rounded to 8),
    57 outgrows it -> 72 and the headroom becomes 40 %, 73 -> ceil(1.4 * 73) -> 104."""
    core = CompiledCore(_policy(), "mpnn", make_model("mpnn"))
    caps = []
    for n_owned in (40, 57, 73):
        _core_inputs(core, n_owned)
        caps.append(core.capacities["mpnn.owned"])
    assert core.padder is not None
    assert caps == [56, 72, 104]
    assert core.regrows == 2 and core.padder.growth == pytest.approx(MAX_GROWTH)
    assert core.capacities["mpnn.atoms"] >= 200  # (fixed: the atoms did not regrow)


def test_row_caps_regrows_are_escalated_too() -> None:
    """The capacities of a caller with its own edges (:meth:`CompiledCore.row_caps`,
    the MPNN's device edges under DD) escalate their headroom the same way."""
    core = CompiledCore(_policy(), "mpnn", make_model("mpnn"))
    owned = [core.row_caps(400, n, generation=0)[1] for n in (40, 57, 73)]
    assert owned == [56, 72, 104] and core.regrows == 2
