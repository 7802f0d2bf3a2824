"""COOPadder: round trip, the padding rule, toy model padded == unpadded, ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from padding_toys import (
    CUTOFF,
    coo_edges,
    coo_model,
    raised_message,
    random_positions,
    total_energy,
)

from nvdd.core import ConfigurationError, ValidationError
from nvdd.padding import CapacityRegistry, COOGraph, COOPadder, PaddedCOO
from nvdd.testing import assert_close_by_id, gather_by_id, run_ranks

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _graph(n: int, seed: int, dtype: torch.dtype = torch.float64, device: str = "cpu") -> COOGraph:
    pos = random_positions(n, seed, dtype=dtype, device=device)
    ei = coo_edges(pos)
    g = torch.Generator().manual_seed(seed + 1)
    shifts = (torch.randint(-1, 2, (ei.shape[1], 3), generator=g) * 0.01).to(dtype).to(device)
    return COOGraph(
        edge_index=ei,
        n_atoms=n,
        atom_fields={"positions": pos, "numbers": torch.arange(1, n + 1, device=device)},
        edge_fields={
            "shifts": shifts,
            "weight": torch.ones(ei.shape[1], dtype=dtype, device=device),
        },
    )


@pytest.mark.parametrize("device", DEVICES)
def test_pad_unpad_round_trip(device: str) -> None:
    graph = _graph(23, seed=0, device=device)
    padder = COOPadder(atom_fill={"numbers": -1})
    padded = padder.pad(graph)
    assert padded.atom_cap == padder.registry.get("coo.atoms") == 32  # ceil(1.25 * 25) -> 32
    assert padded.edge_cap % 32 == 0 and padded.edge_cap >= graph.n_edges
    assert padded.grew and not padder.pad(graph).grew
    back = padder.unpad(padded)
    assert back.n_atoms == graph.n_atoms and back.n_edges == graph.n_edges
    assert torch.equal(back.edge_index, graph.edge_index)
    for src, dst in ((graph.atom_fields, back.atom_fields), (graph.edge_fields, back.edge_fields)):
        assert src.keys() == dst.keys()
        assert all(torch.equal(src[k], dst[k]) for k in src)
    assert torch.equal(padded.atom_fields["numbers"][23:], torch.full((9,), -1, device=device))


def test_padding_touches_only_padding_rows_far_away() -> None:
    graph = _graph(20, seed=1)
    padded = COOPadder(spacing=50.0).pad(graph)
    n, cap = graph.n_atoms, padded.atom_cap
    assert cap >= n + 2
    assert torch.equal(padded.atom_mask, torch.arange(cap) < n)
    assert torch.equal(padded.edge_mask, torch.arange(padded.edge_cap) < graph.n_edges)
    pad_edges = padded.edge_index[:, graph.n_edges :]
    assert pad_edges.shape[1] > 0
    assert bool((pad_edges[0] == cap - 2).all()) and bool((pad_edges[1] == cap - 1).all())
    assert padded.padding_atom == cap - 1
    pos = padded.atom_fields["positions"]
    d = torch.cdist(pos, pos, compute_mode="donot_use_mm_for_euclid_dist")
    d.fill_diagonal_(float("inf"))
    # every pair with a padding atom is spacing apart or more (up to rounding)
    assert float(d[n:].min()) >= 50.0 * (1 - 1e-12)
    assert torch.equal(pos[:n], graph.atom_fields["positions"])
    assert bool((padded.edge_fields["shifts"][graph.n_edges :] == 0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_toy_model_padded_equals_unpadded(device: str, float_dtype: torch.dtype) -> None:
    graph = _graph(30, seed=2, dtype=float_dtype, device=device)
    pos = graph.atom_fields["positions"].clone().requires_grad_(True)
    e_ref = coo_model(pos, graph.edge_index, graph.edge_fields["shifts"])
    f_ref = -torch.autograd.grad(total_energy(e_ref), pos)[0]

    pos2 = graph.atom_fields["positions"].clone().requires_grad_(True)
    graph2 = COOGraph(graph.edge_index, graph.n_atoms, {"positions": pos2}, graph.edge_fields)
    padded = COOPadder().pad(graph2)
    e_pad = coo_model(
        padded.atom_fields["positions"],
        padded.edge_index,
        padded.edge_fields["shifts"],
        padded.edge_mask,
    )
    f_pad = -torch.autograd.grad(total_energy(e_pad, padded.atom_mask), pos2)[0]
    if device == "cpu":
        # per-atom gathers and scatters: the same additions in the same order, bit for bit
        assert torch.equal(padded.real_atoms(e_pad), e_ref)
        assert torch.equal(f_pad, f_ref)
    else:  # CUDA's index_add adds atomically, in no fixed order
        tol = {"rtol": 0.0, "atol": 1e-12 if float_dtype == torch.float64 else 1e-5}
        torch.testing.assert_close(padded.real_atoms(e_pad), e_ref, **tol)
        torch.testing.assert_close(f_pad, f_ref, **tol)
    assert bool(torch.isfinite(e_pad).all())
    # (float32 on CUDA: per-atom energies in another order of atomic additions
    # sum to a total that differs in its last bits; it failed once at 1.1e-7)
    rtol = 1e-6 if device != "cpu" and float_dtype == torch.float32 else 1e-14
    torch.testing.assert_close(
        total_energy(e_pad, padded.atom_mask), total_energy(e_ref), rtol=rtol, atol=0
    )


def test_padding_cannot_leak_into_real_rows_even_without_masks() -> None:
    # A model that ignores every mask: padded edges join two padding atoms, so real
    # rows still get exactly the unpadded values; only padding rows differ.
    graph = _graph(25, seed=3)
    e_ref = coo_model(graph.atom_fields["positions"], graph.edge_index, graph.edge_fields["shifts"])
    padded = COOPadder(spacing=1.0).pad(graph)  # padding pairs inside the cutoff on purpose
    e_pad = coo_model(
        padded.atom_fields["positions"], padded.edge_index, padded.edge_fields["shifts"]
    )
    assert torch.equal(padded.real_atoms(e_pad), e_ref)
    assert float(e_pad[padded.padding_atom]) > 0  # the unmasked padding edges did count there
    assert bool(torch.isfinite(e_pad).all())  # padded edges are never zero-length


def test_capacities_stay_fixed_while_counts_drift() -> None:
    padder = COOPadder()
    shapes = set()
    for n in (20, 21, 22, 21, 20):
        padded = padder.pad(_graph(n, seed=4))
        shapes.add((padded.atom_cap, padded.edge_cap))
    assert len(shapes) == 1 and padder.registry.n_reshapes == 1
    padded = padder.pad(_graph(60, seed=4))
    assert padded.grew and padder.registry.n_reshapes == 2
    assert padded.atom_cap >= 62 and padded.atom_cap > next(iter(shapes))[0]


def test_empty_graph_pads_to_padding_only() -> None:
    graph = COOGraph(torch.zeros(2, 0, dtype=torch.int64), 0, {"positions": torch.zeros(0, 3)})
    padder = COOPadder()
    padded = padder.pad(graph)
    assert padded.atom_cap == 8 and padded.edge_cap == 32
    assert not bool(padded.atom_mask.any()) and not bool(padded.edge_mask.any())
    assert padder.unpad(padded).n_edges == 0


def test_int32_edge_index_keeps_its_dtype() -> None:
    graph = _graph(12, seed=5)
    graph = COOGraph(graph.edge_index.to(torch.int32), graph.n_atoms, graph.atom_fields)
    padded = COOPadder().pad(graph)
    assert padded.edge_index.dtype == torch.int32
    assert torch.equal(COOPadder().unpad(padded).edge_index, graph.edge_index)


def test_real_rows_of_outputs_check_their_shape() -> None:
    padded = COOPadder().pad(_graph(10, seed=6))
    assert padded.real_atoms(torch.zeros(padded.atom_cap, 3)).shape == (10, 3)
    assert padded.real_edges(torch.zeros(padded.edge_cap)).shape == (padded.n_edges,)
    with pytest.raises(ValidationError, match=r"rank 0: .*16 rows .*got shape \(10, 3\)"):
        padded.real_atoms(torch.zeros(10, 3))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda g: COOGraph(g.edge_index[0], g.n_atoms), r"edge_index has shape \(\d+,\)"),
        (lambda g: COOGraph(g.edge_index.double(), g.n_atoms), "integer tensor, got dtype"),
        (lambda g: COOGraph(g.edge_index, -4), "n_atoms must be an int >= 0, got -4"),
        (lambda g: COOGraph(g.edge_index, 5), r"values must lie in \[0, 5\), found min 0"),
        (
            lambda g: COOGraph(g.edge_index, g.n_atoms, {"positions": torch.zeros(3, 3)}),
            r"atom_fields\['positions'\] has shape \(3, 3\), expected leading dimensions \(12,\)",
        ),
        (
            lambda g: COOGraph(g.edge_index, g.n_atoms, {"positions": torch.zeros(12, 2)}),
            r"positions field\) must be floating with shape \(12, 3\)",
        ),
        (
            lambda g: COOGraph(g.edge_index, g.n_atoms, {}, {"shifts": torch.zeros(1, 3)}),
            r"edge_fields\['shifts'\] has shape \(1, 3\)",
        ),
        (lambda g: "not a graph", "needs a COOGraph, got str"),
    ],
)
def test_bad_graphs_raise_validation_error_naming_the_value(make: object, match: str) -> None:
    graph = make(_graph(12, seed=7))  # type: ignore[operator]
    padder = COOPadder()
    with pytest.raises(ValidationError, match=f"rank 0: .*{match}"):
        padder.pad(graph)
    assert len(padder.registry) == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"growth": 0.5}, "growth must be a finite number >= 1, got 0.5"),
        ({"edge_multiple": 0}, "edge_multiple must be an int >= 1, got 0"),
        ({"spacing": -1.0}, "spacing must be a finite number > 0, got -1.0"),
        ({"name": ""}, "name must be a non-empty str"),
        ({"atom_fill": {"positions": 0.0}}, "names the positions field 'positions'"),
        ({"edge_fill": {"w": "x"}}, r"edge_fill\['w'\] must be a real number, got 'x'"),
        ({"registry": {}}, "registry must be a CapacityRegistry"),
    ],
)
def test_bad_padder_settings_raise_configuration_error(
    kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(ConfigurationError, match=match):
        COOPadder(**kwargs)  # type: ignore[arg-type]


def test_unpad_rejects_other_objects() -> None:
    with pytest.raises(ValidationError, match=r"rank 0: COOPadder\.unpad needs a PaddedCOO"):
        COOPadder().unpad("x")  # type: ignore[arg-type]


def test_padders_sharing_a_registry_keep_separate_keys() -> None:
    reg = CapacityRegistry()
    a, b = COOPadder(name="mp", registry=reg), COOPadder(name="lr", registry=reg)
    a.pad(_graph(10, seed=8))
    b.pad(_graph(40, seed=8))
    assert set(reg) == {"mp.atoms", "mp.edges", "lr.atoms", "lr.edges"}
    assert reg.get("mp.atoms") == 16 and reg.get("lr.atoms") == 56


# ------------------------------------------------------------ graph partition on ranks
def _partitioned_energies(n: int, sizes: list[int]) -> tuple[tuple[int, int], list[torch.Tensor]]:
    """Each rank owns an index range of atoms and the edges into them (graph
    partition); it holds the owned atoms plus the sources of those edges."""
    rank = dist.get_rank()
    graph = _graph(n, seed=9)
    pos, ei, shifts = graph.atom_fields["positions"], graph.edge_index, graph.edge_fields["shifts"]
    start = sum(sizes[:rank])
    owned = torch.arange(start, start + sizes[rank])
    mine = (ei[1] >= start) & (ei[1] < start + sizes[rank])
    needed = torch.unique(torch.cat([owned, ei[0, mine]]))  # sorted: owned ids keep order
    local_of = torch.full((n,), -1, dtype=torch.int64)
    local_of[needed] = torch.arange(needed.numel())
    local = COOGraph(
        local_of[ei[:, mine]],
        needed.numel(),
        {"positions": pos[needed]},
        {"shifts": shifts[mine]},
    )
    padded = COOPadder().pad(local, group=dist.group.WORLD)
    e = coo_model(
        padded.atom_fields["positions"],
        padded.edge_index,
        padded.edge_fields["shifts"],
        padded.edge_mask,
    )
    e_local = padded.real_atoms(e)
    is_owned = (needed >= start) & (needed < start + sizes[rank])
    ids, energies = gather_by_id(needed[is_owned], e_local[is_owned])
    return (padded.atom_cap, padded.edge_cap), [ids, energies, torch.tensor(local.n_edges)]


@pytest.mark.gloo
def test_graph_partition_on_three_ranks_matches_one_process_by_id() -> None:
    n, sizes = 60, [10, 20, 30]
    out = run_ranks(_partitioned_energies, 3, n, sizes, timeout_s=90)
    caps = {shape for shape, _ in out}
    assert len(caps) == 1, caps  # one padded shape on every rank
    edge_counts = {int(parts[2]) for _, parts in out}
    assert len(edge_counts) == 3  # while the real edge counts differ
    graph = _graph(n, seed=9)
    ref = coo_model(graph.atom_fields["positions"], graph.edge_index, graph.edge_fields["shifts"])
    ids, energies, _ = out[0][1]
    assert_close_by_id(ids, energies, torch.arange(n), ref, atol=1e-12, what="atom energies")
    assert all(torch.equal(parts[1], energies) for _, parts in out)


def _one_rank_bad_graph() -> str:
    graph = _graph(10, seed=10)
    if dist.get_rank() == 2:
        graph = COOGraph(graph.edge_index, 3, {})
    return raised_message(lambda: COOPadder().pad(graph, group=dist.group.WORLD), ValidationError)


@pytest.mark.gloo
def test_bad_graph_on_one_rank_raises_on_every_rank() -> None:
    out = run_ranks(_one_rank_bad_graph, 3, timeout_s=60)
    assert len(set(out)) == 1
    assert out[0].startswith("rank 2: edge_index values must lie in [0, 3)")


def test_padded_coo_is_a_padded_graph() -> None:
    from nvdd.padding import GraphPadder, PaddedGraph

    padder = COOPadder()
    assert isinstance(padder, GraphPadder)
    assert isinstance(padder.pad(_graph(5, seed=11)), PaddedGraph)
    assert isinstance(padder.pad(_graph(5, seed=11)), PaddedCOO)
    assert padder.spacing > CUTOFF
