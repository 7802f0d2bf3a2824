"""DensePadder and DenseBatchPadder: round trip, the padding rule, toy models, ranks."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from padding_toys import (
    dense_model,
    dense_neighbors,
    raised_message,
    random_positions,
    total_energy,
)

from nvdd.core import Batch, ConfigurationError, ValidationError
from nvdd.padding import (
    DenseBatchGraph,
    DenseBatchPadder,
    DenseGraph,
    DensePadder,
    GraphPadder,
    PaddedDense,
    PaddedGraph,
)
from nvdd.testing import run_ranks

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _graph(
    n: int,
    seed: int,
    dtype: torch.dtype = torch.float64,
    device: str = "cpu",
    fill_value: int | None = None,
) -> DenseGraph:
    pos = random_positions(n, seed, dtype=dtype, device=device)
    nbr, counts = dense_neighbors(pos, fill_value=fill_value)
    g = torch.Generator().manual_seed(seed + 1)
    shifts = (torch.randint(-1, 2, (*nbr.shape, 3), generator=g) * 0.01).to(dtype).to(device)
    real = torch.arange(nbr.shape[1], device=device) < counts[:, None]
    shifts = torch.where(real[..., None], shifts, 0.0)  # nvalchemiops: zero beyond the count
    return DenseGraph(nbr, counts, {"positions": pos}, {"shifts": shifts}, fill_value)


def _reference(graph: DenseGraph, positions: torch.Tensor) -> torch.Tensor:
    """The toy model on the unpadded graph (padding slots redirected to the row itself)."""
    n, k = graph.neighbors.shape
    mask = torch.arange(k, device=positions.device) < graph.num_neighbors[:, None]
    rows = torch.arange(n, device=positions.device)[:, None]
    safe = torch.where(mask, graph.neighbors, rows)
    return dense_model(positions, safe, graph.neighbor_fields["shifts"], mask)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fill_value", [None, -1])
def test_dense_round_trip(device: str, fill_value: int | None) -> None:
    graph = _graph(21, seed=0, device=device, fill_value=fill_value)
    padder = DensePadder()
    padded = padder.pad(graph)
    assert padded.atom_cap == 32 and padded.neighbor_cap % 8 == 0  # ceil(1.25 * 22) -> 32
    assert padded.neighbor_cap >= graph.max_neighbors
    back = padder.unpad(padded)
    assert torch.equal(back.neighbors, graph.neighbors)
    assert torch.equal(back.num_neighbors, graph.num_neighbors)
    assert back.fill_value == fill_value if fill_value is not None else back.fill_value == 21
    assert torch.equal(back.atom_fields["positions"], graph.atom_fields["positions"])
    assert torch.equal(back.neighbor_fields["shifts"], graph.neighbor_fields["shifts"])


def test_dense_padding_points_only_at_a_far_padding_row() -> None:
    graph = _graph(18, seed=1)
    padded = DensePadder(spacing=40.0).pad(graph)
    n, cap, fill = graph.n_atoms, padded.atom_cap, padded.fill_value
    assert fill == cap - 1 >= n
    mask = padded.neighbor_mask
    assert torch.equal(mask.sum(1), padded.num_neighbors)
    assert bool((padded.neighbors[~mask] == fill).all())
    assert bool((padded.neighbors[mask] < n).all())
    assert bool((padded.num_neighbors[n:] == 0).all()) and not bool(mask[n:].any())
    assert bool((padded.neighbor_fields["shifts"][~mask] == 0).all())
    pos = padded.atom_fields["positions"]
    assert float((pos[fill] - pos[:n]).norm(dim=1).min()) >= 40.0 * (1 - 1e-12)
    # kernels that skip slots >= fill_value (nvalchemiops) see exactly the real pairs
    pairs = {(i, int(j)) for i in range(cap) for j in padded.neighbors[i] if int(j) < fill}
    ref = {
        (i, int(graph.neighbors[i, k]))
        for i in range(n)
        for k in range(int(graph.num_neighbors[i]))
    }
    assert pairs == ref


@pytest.mark.parametrize("device", DEVICES)
def test_dense_toy_model_padded_equals_unpadded(device: str, float_dtype: torch.dtype) -> None:
    graph = _graph(30, seed=2, dtype=float_dtype, device=device)
    pos = graph.atom_fields["positions"].clone().requires_grad_(True)
    e_ref = _reference(graph, pos)
    f_ref = -torch.autograd.grad(total_energy(e_ref), pos)[0]

    pos2 = graph.atom_fields["positions"].clone().requires_grad_(True)
    padded = DensePadder().pad(
        DenseGraph(graph.neighbors, graph.num_neighbors, {"positions": pos2}, graph.neighbor_fields)
    )
    e_pad = dense_model(
        padded.atom_fields["positions"],
        padded.neighbors,
        padded.neighbor_fields["shifts"],
        padded.neighbor_mask,
    )
    f_pad = -torch.autograd.grad(total_energy(e_pad, padded.atom_mask), pos2)[0]
    assert bool(torch.isfinite(e_pad).all()) and bool(torch.isfinite(f_pad).all())
    if device == "cpu" and float_dtype == torch.float64:
        # longer rows only add exact zeros: bit for bit on CPU
        assert torch.equal(padded.real_atoms(e_pad), e_ref)
        assert torch.equal(f_pad, f_ref)
    tol = {"rtol": 0.0, "atol": 1e-12 if float_dtype == torch.float64 else 1e-5}
    torch.testing.assert_close(padded.real_atoms(e_pad), e_ref, **tol)
    torch.testing.assert_close(f_pad, f_ref, **tol)
    assert float(e_ref.detach().abs().sum()) > 0  # the comparison is not vacuous


def test_dense_capacities_stay_fixed_while_counts_drift() -> None:
    padder = DensePadder()
    shapes = {
        (p.atom_cap, p.neighbor_cap)
        for p in (padder.pad(_graph(n, seed=3)) for n in (24, 25, 26, 24))
    }
    assert len(shapes) == 1 and padder.registry.n_reshapes == 1


def test_real_neighbors_of_a_per_slot_output() -> None:
    graph = _graph(12, seed=4)
    padded = DensePadder().pad(graph)
    per_slot = torch.zeros(padded.atom_cap, padded.neighbor_cap, 3)
    assert padded.real_neighbors(per_slot).shape == (12, graph.max_neighbors, 3)
    with pytest.raises(ValidationError, match=r"rank 0: a padded per-slot tensor must have shape"):
        padded.real_neighbors(torch.zeros(padded.atom_cap, 2))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda g: DenseGraph(g.neighbors[0], g.num_neighbors), r"neighbors has shape \(\d+,\)"),
        (lambda g: DenseGraph(g.neighbors, g.num_neighbors[:3]), r"num_neighbors has shape \(3,\)"),
        (
            lambda g: DenseGraph(g.neighbors, g.num_neighbors + 50),
            r"num_neighbors must lie in \[0, \d+\], found min \d+ and max \d+",
        ),
        (
            lambda g: DenseGraph(g.neighbors.clamp(max=5), g.num_neighbors, {"p": torch.zeros(4)}),
            r"atom_fields\['p'\] has shape \(4,\)",
        ),
        (
            lambda g: DenseGraph(g.neighbors + 100, g.num_neighbors),
            r"real neighbour indices must lie in \[0, 12\), found min 100",
        ),
        (
            lambda g: DenseGraph(g.neighbors, g.num_neighbors, {}, {"s": torch.zeros(12, 1)}),
            r"neighbor_fields\['s'\] has shape \(12, 1\), expected leading dimensions \(12, \d+\)",
        ),
        (lambda g: DenseGraph(g.neighbors, g.num_neighbors, fill_value=2.0), "fill_value must be"),
        (lambda g: g.neighbors, "DensePadder.pad needs a DenseGraph, got Tensor"),
    ],
)
def test_bad_dense_graphs_raise_validation_error(make: object, match: str) -> None:
    graph = make(_graph(12, seed=5))  # type: ignore[operator]
    padder = DensePadder()
    with pytest.raises(ValidationError, match=f"rank 0: .*{match}"):
        padder.pad(graph)
    assert len(padder.registry) == 0


@pytest.mark.parametrize("cls", [DensePadder, DenseBatchPadder])
def test_dense_padder_errors_name_the_class_and_the_value(cls: type) -> None:
    kind = cls.__name__
    settings: list[tuple[dict[str, object], str]] = [
        ({"name": 3}, f"{kind}: name must be a non-empty str, got 3"),
        ({"growth": True}, f"{kind}: growth must be a finite number >= 1, got True"),
        ({"neighbor_multiple": 0}, f"{kind}: neighbor_multiple must be an int >= 1, got 0"),
        ({"spacing": float("nan")}, f"{kind}: spacing must be a finite number > 0, got nan"),
        (
            {"neighbor_fill": {"w": float("nan")}},
            "neighbor_fill['w'] must be a real number, got nan",
        ),
        (
            {"positions_field": "x", "atom_fill": {"x": 1.0}},
            f"{kind}: atom_fill names the positions field 'x', whose padding rows are always "
            "placed far away",
        ),
        ({"registry": None}, f"{kind}: registry must be a CapacityRegistry, got None"),
    ]
    if cls is DenseBatchPadder:
        settings += [
            ({"system_multiple": 1.5}, f"{kind}: system_multiple must be an int >= 1, got 1.5"),
            ({"system_fill": [1]}, "system_fill must be a mapping of field name to value, got [1]"),
        ]
    for kwargs, message in settings:
        with pytest.raises(ConfigurationError, match=f"^{re.escape(message)}$"):
            cls(**kwargs)
    padded, graph = (
        ("PaddedDense", "DenseGraph")
        if cls is DensePadder
        else ("PaddedDenseBatch", "DenseBatchGraph")
    )
    with pytest.raises(
        ValidationError, match=rf"^rank 0: {kind}\.unpad needs a {padded}, got str$"
    ):
        cls().unpad("x")
    with pytest.raises(ValidationError, match=rf"^rank 0: {kind}\.pad needs a {graph}, got int$"):
        cls().pad(7)


# ------------------------------------------------------------------- batches (AIMNet2)
def _batch(sizes: list[int], seed: int, dtype: torch.dtype = torch.float64) -> Batch:
    pos = torch.cat([random_positions(m, seed + s, dtype=dtype) for s, m in enumerate(sizes)])
    system_index = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    n = pos.shape[0]
    return Batch(
        pos,
        torch.full((n,), 6),
        cell=torch.eye(3, dtype=dtype).expand(len(sizes), 3, 3) * 6.0,
        system_index=system_index,
        atom_ids=torch.arange(100, 100 + n),
        system_extras={"charge": torch.arange(len(sizes), dtype=dtype)},
    )


def _batch_graph(batch: Batch) -> DenseBatchGraph:
    nbr, counts = dense_neighbors(batch.positions, system_index=batch.system_index)
    shifts = torch.zeros(*nbr.shape, 3, dtype=batch.dtype)
    return DenseBatchGraph.from_batch(batch, nbr, counts, neighbor_fields={"shifts": shifts})


def _system_energies(atom_e: torch.Tensor, system_index: torch.Tensor, n_rows: int) -> torch.Tensor:
    return torch.zeros(n_rows, dtype=atom_e.dtype).index_add(0, system_index, atom_e)


def test_batch_padding_keeps_systems_apart() -> None:
    batch = _batch([7, 12, 9], seed=6)
    graph = _batch_graph(batch)
    padder = DenseBatchPadder(atom_fill={"atom_ids": -1})
    padded = padder.pad(graph)
    n, s = batch.n_atoms, batch.n_systems
    assert padded.system_cap >= s + 1 and padded.padding_system == padded.system_cap - 1
    assert torch.equal(padded.system_index[:n], batch.system_index)
    assert bool((padded.system_index[n:] == padded.padding_system).all())
    assert torch.equal(padded.system_mask, torch.arange(padded.system_cap) < s)
    assert bool((padded.atom_fields["atom_ids"][n:] == -1).all())
    assert torch.equal(padded.real_systems(padded.system_fields["cell"]), batch.cell)
    assert not bool(padded.system_fields["pbc"][s:].any())
    # per-system energies by system index: padding lands in the padding system only
    e_ref = _reference(
        DenseGraph(graph.neighbors, graph.num_neighbors, {}, graph.neighbor_fields), batch.positions
    )
    e_pad = dense_model(
        padded.atom_fields["positions"],
        padded.neighbors,
        padded.neighbor_fields["shifts"],
        padded.neighbor_mask,
    )
    sys_pad = _system_energies(e_pad, padded.system_index, padded.system_cap)
    sys_ref = _system_energies(e_ref, batch.system_index, s)
    torch.testing.assert_close(padded.real_systems(sys_pad), sys_ref, rtol=0, atol=1e-12)
    assert float(sys_ref.abs().min()) > 0
    back = padder.unpad(padded)
    assert torch.equal(back.neighbors, graph.neighbors) and back.n_systems == s
    assert torch.equal(back.system_index, batch.system_index)
    assert torch.equal(back.system_fields["charge"], batch.system_extras["charge"])
    assert back.atom_fields.keys() == graph.atom_fields.keys()
    assert all(torch.equal(back.atom_fields[k], graph.atom_fields[k]) for k in graph.atom_fields)


def test_batch_padding_rejects_neighbours_across_systems() -> None:
    batch = _batch([5, 6], seed=7)
    graph = _batch_graph(batch)
    nbr = graph.neighbors.clone()
    nbr[0, 0] = 9  # atom 0 (system 0) "sees" atom 9 (system 1)
    counts = graph.num_neighbors.clone()
    counts[0] = max(int(counts[0]), 1)
    bad = DenseBatchGraph(nbr, counts, graph.system_index, 2, fill_value=11)
    with pytest.raises(ValidationError, match=r"rank 0: .*atom 0 \(system 0\) and atom 9"):
        DenseBatchPadder().pad(bad)
    with pytest.raises(ValidationError, match=r"system_index must lie in \[0, 1\), found"):
        DenseBatchPadder().pad(
            DenseBatchGraph(graph.neighbors, graph.num_neighbors, graph.system_index, 1)
        )
    with pytest.raises(ValidationError, match="n_systems must be an int >= 0, got -2"):
        DenseBatchPadder().pad(
            DenseBatchGraph(graph.neighbors, graph.num_neighbors, graph.system_index, -2)
        )
    with pytest.raises(ValidationError, match=r"system_fields\['cell'\] has shape \(2, 3, 3\)"):
        DenseBatchPadder().pad(
            DenseBatchGraph(
                graph.neighbors,
                graph.num_neighbors,
                graph.system_index,
                3,
                system_fields={"cell": batch.cell},
            )
        )


def test_dense_padders_follow_the_protocol() -> None:
    for padder in (DensePadder(), DenseBatchPadder()):
        assert isinstance(padder, GraphPadder)
    padded = DenseBatchPadder().pad(_batch_graph(_batch([4, 5], seed=8)))
    assert isinstance(padded, PaddedDense) and isinstance(padded, PaddedGraph)


def _batches_on_ranks(sizes_by_rank: list[list[int]]) -> tuple[tuple[int, int, int], list[float]]:
    rank = dist.get_rank()
    batch = _batch(sizes_by_rank[rank], seed=20 + rank)
    padded = DenseBatchPadder().pad(_batch_graph(batch), group=dist.group.WORLD)
    e = dense_model(
        padded.atom_fields["positions"],
        padded.neighbors,
        padded.neighbor_fields["shifts"],
        padded.neighbor_mask,
    )
    sys_e = padded.real_systems(_system_energies(e, padded.system_index, padded.system_cap))
    return (padded.atom_cap, padded.neighbor_cap, padded.system_cap), sys_e.tolist()


@pytest.mark.gloo
def test_batch_capacities_agree_across_two_ranks() -> None:
    sizes = [[6, 8], [10, 4, 12]]
    out = run_ranks(_batches_on_ranks, 2, sizes, timeout_s=60)
    assert out[0][0] == out[1][0]
    for rank, (_, energies) in enumerate(out):
        batch = _batch(sizes[rank], seed=20 + rank)
        graph = _batch_graph(batch)
        e_ref = _reference(
            DenseGraph(graph.neighbors, graph.num_neighbors, {}, graph.neighbor_fields),
            batch.positions,
        )
        ref = _system_energies(e_ref, batch.system_index, batch.n_systems)
        torch.testing.assert_close(
            torch.tensor(energies, dtype=torch.float64), ref, rtol=0, atol=1e-12
        )


def _one_rank_bad_batch() -> str:
    batch = _batch([5, 6], seed=30)
    graph = _batch_graph(batch)
    if dist.get_rank() == 0:
        graph = DenseBatchGraph(graph.neighbors, graph.num_neighbors, graph.system_index, 1)
    return raised_message(
        lambda: DenseBatchPadder().pad(graph, group=dist.group.WORLD), ValidationError
    )


@pytest.mark.gloo
def test_bad_batch_on_one_rank_raises_on_every_rank() -> None:
    out = run_ranks(_one_rank_bad_batch, 2, timeout_s=60)
    assert out == ["rank 0: system_index must lie in [0, 1), found min 0 and max 1"] * 2
