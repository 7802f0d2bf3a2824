"""torch.compile sees one shape while padded counts drift within capacity."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from padding_toys import coo_edges, coo_model, dense_model, dense_neighbors, random_positions

from nvdd.padding import COOGraph, COOPadder, DenseGraph, DensePadder

SIZES = (22, 21, 23, 20)  # drifting real atom counts, all within one capacity


class CountingBackend:
    """A torch.compile backend that counts compilations and runs the graph eagerly."""

    def __init__(self) -> None:
        self.compiles = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.compiles += 1
        return gm.forward


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def _coo(n: int) -> COOGraph:
    pos = random_positions(n, seed=n)
    ei = coo_edges(pos)
    return COOGraph(
        ei, n, {"positions": pos}, {"shifts": torch.zeros(ei.shape[1], 3, dtype=pos.dtype)}
    )


def _masked_energies(
    positions: torch.Tensor,
    edge_index: torch.Tensor,
    shifts: torch.Tensor,
    edge_mask: torch.Tensor,
    atom_mask: torch.Tensor,
) -> torch.Tensor:
    return torch.where(atom_mask, coo_model(positions, edge_index, shifts, edge_mask), 0.0)


def _plain_energies(
    positions: torch.Tensor,
    edge_index: torch.Tensor,
    shifts: torch.Tensor,
    edge_mask: torch.Tensor,
    atom_mask: torch.Tensor,
) -> torch.Tensor:
    # The same computation under another code object: dynamo keeps its shape
    # history (automatic dynamic shapes) per code object.
    return torch.where(atom_mask, coo_model(positions, edge_index, shifts, edge_mask), 0.0)


@pytest.mark.parametrize("dynamic", [False, None], ids=["static", "auto-dynamic"])
def test_padded_forward_is_not_recompiled_while_counts_drift(dynamic: bool | None) -> None:
    padder = COOPadder()
    padded_backend, plain_backend = CountingBackend(), CountingBackend()
    padded_fn = torch.compile(_masked_energies, backend=padded_backend, dynamic=dynamic)
    plain_fn = torch.compile(_plain_energies, backend=plain_backend, dynamic=dynamic)
    for n in SIZES:
        graph = _coo(n)
        ref = coo_model(
            graph.atom_fields["positions"], graph.edge_index, graph.edge_fields["shifts"]
        )
        p = padder.pad(graph)
        e = padded_fn(
            p.atom_fields["positions"],
            p.edge_index,
            p.edge_fields["shifts"],
            p.edge_mask,
            p.atom_mask,
        )
        assert torch.equal(p.real_atoms(e), ref)
        ones_e = torch.ones(graph.n_edges, dtype=torch.bool)
        ones_a = torch.ones(n, dtype=torch.bool)
        e_plain = plain_fn(
            graph.atom_fields["positions"],
            graph.edge_index,
            graph.edge_fields["shifts"],
            ones_e,
            ones_a,
        )
        assert torch.equal(e_plain, ref)
    assert padder.registry.n_reshapes == 1  # the drift stayed within capacity
    assert padded_backend.compiles == 1
    # unpadded: a compile per new shape (static), or a second one to go dynamic (auto)
    assert plain_backend.compiles == (len(SIZES) if dynamic is False else 2)


def test_each_capacity_growth_costs_exactly_one_recompile() -> None:
    padder = COOPadder()
    backend = CountingBackend()
    fn = torch.compile(_masked_energies, backend=backend, dynamic=False)
    for n in (20, 21, 60, 58, 61, 150, 20):
        p = padder.pad(_coo(n))
        fn(
            p.atom_fields["positions"],
            p.edge_index,
            p.edge_fields["shifts"],
            p.edge_mask,
            p.atom_mask,
        )
    assert padder.registry.n_reshapes == 3
    assert backend.compiles == padder.registry.n_reshapes


def _dense_energies(
    positions: torch.Tensor,
    neighbors: torch.Tensor,
    shifts: torch.Tensor,
    neighbor_mask: torch.Tensor,
    atom_mask: torch.Tensor,
) -> torch.Tensor:
    return torch.where(atom_mask, dense_model(positions, neighbors, shifts, neighbor_mask), 0.0)


def test_dense_padded_forward_is_not_recompiled_while_counts_drift() -> None:
    padder = DensePadder(neighbor_multiple=16)
    backend = CountingBackend()
    fn = torch.compile(_dense_energies, backend=backend, dynamic=False)
    shapes = set()
    for n in SIZES:
        pos = random_positions(n, seed=n)
        nbr, counts = dense_neighbors(pos)
        shifts = torch.zeros(*nbr.shape, 3, dtype=pos.dtype)
        p = padder.pad(DenseGraph(nbr, counts, {"positions": pos}, {"shifts": shifts}))
        shapes.add((p.atom_cap, p.neighbor_cap, nbr.shape[1]))
        fn(
            p.atom_fields["positions"],
            p.neighbors,
            p.neighbor_fields["shifts"],
            p.neighbor_mask,
            p.atom_mask,
        )
    assert len({s[2] for s in shapes}) > 1  # the unpadded neighbour width did drift
    assert len({s[:2] for s in shapes}) == 1 and padder.registry.n_reshapes == 1
    assert backend.compiles == 1
