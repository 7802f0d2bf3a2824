"""The Warp path of LennardJones and its device neighbour list.

Oracles: the torch reference of the same model (float64 within 1e-10 of the
largest value, float32 within 1e-5), a brute-force pair search that shares no
code with the package, and a guard that counts host synchronisations.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from models_testutils import (
    DEVICES,
    HostSyncCounter,
    brute_edges_batch,
    ghost_layout,
    jittered_lattice,
    make_batch,
)
from test_models_lj import _GEOMETRIES, _PAIRS, _SPECIES, _geometry_batch

from nvdd.core import Batch, ConfigurationError, ValidationError
from nvdd.models import ForceMode, LennardJones, LJBackend, LJConfig
from nvdd.models._device_neighbors import DeviceVerletList
from nvdd.models._search_state import FlagMirror, host_words
from nvdd.shardtensor import DDContext, SelfImageLayout, dd_scope

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
KEYS = ("energy", "forces", "atom_energies", "virial", "stress")
CUTOFF = 2.5


def _model(
    backend: str, *, half: bool = True, skin: float = 0.0, shift: bool = True
) -> LennardJones:
    return LennardJones(
        LJConfig(
            cutoff=CUTOFF,
            species=_SPECIES,
            pairs=_PAIRS,
            shift_energy=shift,
            skin=skin,
            backend=LJBackend(backend),
            half_list=half,
        )
    )


def _assert_matches(got: Any, ref: Any, dtype: torch.dtype, keys: tuple[str, ...] = KEYS) -> None:
    """Every output within ``TOL[dtype]`` of the reference's largest magnitude."""
    for key in keys:
        a, b = got[key].detach().cpu().double(), ref[key].detach().cpu().double()
        scale = max(float(b.abs().max()), 1e-30)
        err = float((a - b).abs().max())
        assert err <= TOL[dtype] * scale, f"{key}: max error {err:.3e}, scale {scale:.3e}"


def _mixed_batch(dtype: torch.dtype = torch.float64) -> Batch:
    """Three systems (periodic, triclinic smaller than the cutoff, open), rows shuffled."""
    parts = [
        _geometry_batch(g, seed=k)
        for k, g in enumerate(("cubic_periodic", "triclinic_smaller_than_cutoff", "open"))
    ]
    offset = 0
    renumbered = []
    for part in parts:
        renumbered.append(part.replace(atom_ids=part.atom_ids + offset))
        offset += part.n_atoms
    batch = Batch.concatenate(renumbered)
    order = torch.randperm(batch.n_atoms, generator=torch.Generator().manual_seed(3))
    shuffled = Batch(
        batch.positions[order],
        batch.atomic_numbers[order],
        cell=batch.cell,
        pbc=batch.pbc,
        system_index=batch.system_index[order],
        atom_ids=batch.atom_ids[order],
    )
    return shuffled.to(dtype=dtype)


# ----------------------------------------------------------- the kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", [True, False], ids=["half", "full"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("geometry", [*sorted(_GEOMETRIES), "three_systems"])
def test_warp_equals_the_torch_reference(
    geometry: str, dtype: torch.dtype, half: bool, device: str
) -> None:
    if geometry == "three_systems":
        batch = _mixed_batch(dtype)
    else:
        batch = _geometry_batch(geometry, dtype=dtype)
    ref = _model("torch")(batch)
    got = _model("warp", half=half).to(device)(batch.to(device))
    assert got["forces"].dtype == dtype and got["forces"].device.type == device
    assert float(ref["forces"].abs().max()) > 0.1  # the atoms interact
    _assert_matches(got, ref, dtype)


@pytest.mark.parametrize("half", [True, False], ids=["half", "full"])
@pytest.mark.parametrize("geometry", ["open", "triclinic_smaller_than_cutoff"])
@pytest.mark.parametrize("n_receivers", [0, 9, 27])
def test_receiver_filter_gives_the_rows_of_the_reference(
    n_receivers: int, geometry: str, half: bool
) -> None:
    """The DD seam row by row: energies of owned rows, ``-dE_local/dx`` on every
    row with ``ghost_forces=True``; by default complete owned rows, zero others."""
    batch = _geometry_batch(geometry, seed=4)
    n = min(n_receivers, batch.n_atoms)
    ref = _model("torch")(batch, n_receivers=n, ghost_forces=True)
    got = _model("warp", half=half)(batch, n_receivers=n, ghost_forces=True)
    _assert_matches(got, ref, torch.float64)
    if 0 < n < batch.n_atoms:
        assert float(got["forces"][n:].abs().max()) > 0  # ghost rows get their share
        assert float(got["atom_energies"][n:].abs().max()) == 0
    ref = _model("torch")(batch, n_receivers=n)
    got = _model("warp", half=half)(batch, n_receivers=n)
    _assert_matches(got, ref, torch.float64)
    if 0 < n < batch.n_atoms:
        assert float(got["forces"][n:].abs().max()) == 0  # owned rows complete: no fold


@pytest.mark.parametrize("half", [True, False], ids=["half", "full"])
def test_a_rank_on_its_own_periodic_images_equals_the_periodic_model(half: bool) -> None:
    """Owned rows plus image rows, open boundaries: folded forces and totals are exact."""
    full = _geometry_batch("triclinic_smaller_than_cutoff", seed=8)
    ref = _model("torch")(full)
    layout = ghost_layout(full, torch.arange(full.n_atoms), CUTOFF)
    halo = SelfImageLayout(layout.n_owned, layout.source[layout.n_owned :])
    with dd_scope(DDContext(layout=halo)):
        out = _model("warp", half=half)(layout.batch)
    forces = torch.zeros_like(ref["forces"]).index_add(0, layout.source, out["forces"])
    scale = float(ref["forces"].abs().max())
    assert float((forces - ref["forces"]).abs().max()) <= 1e-10 * scale
    for key in ("energy", "virial", "stress"):
        torch.testing.assert_close(out[key], ref[key], rtol=1e-10, atol=1e-12, msg=key)


# ------------------------------------------------------- the neighbour list
def _owned_brute_pairs(batch: Batch, radius: float, n_recv: int) -> set[tuple[int, ...]]:
    return {e for e in brute_edges_batch(batch, radius) if e[0] < n_recv or e[1] < n_recv}


@pytest.mark.parametrize("half", [True, False], ids=["half", "full"])
@pytest.mark.parametrize("geometry", [*sorted(_GEOMETRIES), "three_systems"])
@pytest.mark.parametrize("owned", [None, 5])
def test_device_list_holds_exactly_the_brute_force_pairs(
    geometry: str, half: bool, owned: int | None
) -> None:
    batch = _mixed_batch() if geometry == "three_systems" else _geometry_batch(geometry)
    n_recv = batch.n_atoms if owned is None else owned
    search = DeviceVerletList(CUTOFF, half=half)
    matrix = search(batch.positions, batch.cell, batch.pbc, batch.system_index, n_receivers=owned)
    i, j, s = matrix.pairs()
    got = [(int(a), int(b), *map(int, c)) for a, b, c in zip(i, j, s, strict=True)]
    assert len(set(got)) == len(got), "duplicated entries"
    expected = _owned_brute_pairs(batch, CUTOFF, n_recv)
    assert len(expected) > 0
    if not half:
        assert set(got) == expected
        return
    both = set(got) | {(b, a, -x, -y, -z) for a, b, x, y, z in got}
    assert len(both) == 2 * len(got)  # never both directions of a pair
    assert both == expected
    assert all(a < n_recv for a, *_ in got)  # a half list gives each pair to an owned end
    if owned is None:  # the parity rule gives every row about half its neighbours
        full = torch.bincount(torch.tensor([e[0] for e in expected]), minlength=batch.n_atoms)
        assert bool((matrix.counts <= 0.75 * full + 3).all()), (matrix.counts, full)


@pytest.mark.parametrize("half", [True, False], ids=["half", "full"])
@pytest.mark.parametrize("geometry", [*sorted(_GEOMETRIES), "three_systems"])
def test_a_build_in_row_order_writes_the_same_list(geometry: str, half: bool) -> None:
    """``row_order_build`` (one thread per row in row order) writes the list of
    the cell-order build entry for entry: the same neighbours in the same slots,
    the same shift codes and counts, with ghost rows and after a device rebuild."""
    batch = _mixed_batch() if geometry == "three_systems" else _geometry_batch(geometry)
    moved = batch.positions + 0.3 * torch.randn(
        batch.positions.shape, generator=torch.Generator().manual_seed(5), dtype=batch.dtype
    )
    lists = []
    for row_order in (False, True):
        search = DeviceVerletList(CUTOFF, 0.2, half=half)
        search.row_order_build = row_order
        out = []
        for pos in (batch.positions, moved):  # a host build, then a device rebuild
            m = search(pos, batch.cell, batch.pbc, batch.system_index, n_receivers=5)
            out.append([t.clone() for t in (m.neighbors, m.codes, m.counts)])
        lists.append(out)
    for cells, rows in zip(*lists, strict=True):
        counts = cells[2].clamp(min=0)
        assert int(counts.sum()) > 0
        keep = torch.arange(cells[0].shape[0]).unsqueeze(1) < counts.unsqueeze(0)
        for a, b in zip(cells, rows, strict=True):
            assert a.shape == b.shape
            if a.shape == keep.shape:  # (an open system has no shift codes)
                assert torch.equal(a[keep], b[keep])
            else:
                assert torch.equal(a, b)


def test_the_build_order_follows_the_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """By default (``row_order_build = None``) lists of at least
    ``ROW_ORDER_MIN_ROWS`` rows are built in row order, smaller ones in cell
    order; an explicit choice wins."""
    from nvdd.models import _device_neighbors as dn
    from nvdd.models._warp import Kernel

    batch = _geometry_batch("cubic_periodic")
    seen: list[int] = []
    launch = Kernel.__call__

    def spy(self: Any, dim: Any, inputs: list[Any], *rest: Any) -> Any:
        if self.kernel is dn.ck.build_kernel:
            seen.append(inputs[-1])
        return launch(self, dim, inputs, *rest)

    monkeypatch.setattr(Kernel, "__call__", spy)
    n = batch.n_atoms
    orders = []
    for threshold, choice in ((n, None), (n + 1, None), (1, False), (10**9, True)):
        monkeypatch.setattr(dn, "ROW_ORDER_MIN_ROWS", threshold)
        search = DeviceVerletList(CUTOFF, half=True)
        search.row_order_build = choice
        seen.clear()
        search(batch.positions, batch.cell, batch.pbc, batch.system_index)
        orders.append(set(seen))
    assert orders == [{1}, {0}, {0}, {1}]


def test_overflowing_rows_walk_the_cells_and_stay_exact() -> None:
    batch = _geometry_batch("cubic_periodic", seed=2)
    ref_model, model = _model("torch", skin=0.3), _model("warp", skin=0.3)
    model._warp.neighbors = DeviceVerletList(CUTOFF, 0.3, max_capacity=5)
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        moved = batch.positions + 0.05 * step * torch.randn(
            batch.n_atoms, 3, generator=gen, dtype=batch.dtype
        )
        b = batch.replace(positions=moved)
        _assert_matches(model(b), ref_model(b), torch.float64)
    state = model.device_neighbors._state
    assert state is not None and int(state.flags[4]) == batch.n_atoms  # every row walked
    assert model.device_neighbors.capacity == 5


def test_capacity_grows_after_a_device_side_rebuild_overflowed() -> None:
    """Denser after a device-decided rebuild: exact at once (cell walk), regrown next call."""
    sparse = make_batch(
        jittered_lattice((5, 5, 5), np.eye(3) * 5.5, 0.05, 1), np.eye(3), [False] * 3
    )
    dense = sparse.replace(positions=sparse.positions * 0.7)
    ref_model, model = _model("torch", skin=0.2), _model("warp", skin=0.2)
    search = model.device_neighbors
    _assert_matches(model(sparse), ref_model(sparse), torch.float64)
    capacity, host = search.capacity, search.host_rebuilds
    _assert_matches(model(dense), ref_model(dense), torch.float64)  # rebuilt on the device
    assert search.host_rebuilds == host and search.capacity == capacity
    assert search._state is not None and int(search._state.flags[4]) > 0  # rows walked
    _assert_matches(model(dense), ref_model(dense), torch.float64)
    assert search.host_rebuilds == host + 1 and search.capacity > capacity  # regrown
    assert int(search._state.flags[4]) == 0


@pytest.mark.parametrize("half", [True, False], ids=["half", "full"])
def test_verlet_reuse_rebuilds_exactly_when_the_torch_list_does(half: bool) -> None:
    batch = _geometry_batch("mixed_pbc", seed=3)
    ref_model, model = _model("torch", skin=0.3), _model("warp", half=half, skin=0.3)
    model.device_neighbors.skip_idle_launches = False  # the CUDA order on the CPU
    gen = torch.Generator().manual_seed(5)
    positions = batch.positions
    for _ in range(8):
        positions = positions + 0.03 * torch.randn(
            batch.n_atoms, 3, generator=gen, dtype=batch.dtype
        )
        b = batch.replace(positions=positions)
        _assert_matches(model(b), ref_model(b), torch.float64)
    assert ref_model.neighbors.n_builds > 2  # a real test: some steps rebuilt, some did not
    assert model.device_neighbors.n_builds == ref_model.neighbors.n_builds
    assert model.device_neighbors.host_rebuilds == 1


@pytest.mark.parametrize("name", ["cubic_periodic", "triclinic_smaller_than_cutoff"])
def test_a_cell_that_changes_every_step_reuses_the_list_until_the_skin_is_used(
    name: str,
) -> None:
    """A barostat's step: the cell and the positions scale together (plus a
    little thermal motion). The device list measures displacements in the frame
    that follows the cell and lets the strain eat into the skin
    (``nvdd.core._strain``): it is reused across cell changes, stays exact
    (against the torch model on the same positions), and rebuilds once a
    compression uses the skin up."""
    batch = _geometry_batch(name, seed=4)
    ref_model, model = _model("torch", skin=0.5), _model("warp", skin=0.5)
    model.device_neighbors.skip_idle_launches = False  # the CUDA order on the CPU
    gen = torch.Generator().manual_seed(2)
    positions, cell = batch.positions, batch.cell
    for step in range(12):
        factor = 1.0 + 0.002 * (1 if step % 3 else -1)
        cell, positions = cell * factor, positions * factor
        positions = positions + 0.01 * torch.randn(
            positions.shape, generator=gen, dtype=batch.dtype
        )
        b = batch.replace(positions=positions, cell=cell)
        _assert_matches(model(b), ref_model(b), torch.float64)
    search = model.device_neighbors
    assert search.n_builds < 4, search.n_builds  # 12 cell changes, few rebuilds
    before = search.n_builds
    squeezed = batch.replace(positions=positions * 0.85, cell=cell * 0.85)  # 2.5 * 0.26 > 0.5
    _assert_matches(model(squeezed), ref_model(squeezed), torch.float64)
    assert search.n_builds == before + 1 and search.host_rebuilds == 1


# ------------------------------------------------------------- host syncs
def test_the_sync_guard_sees_host_copies() -> None:
    t = torch.arange(4.0)
    with HostSyncCounter() as counter:
        t.sum().item()
        bool((t > 1).any())
        t[t > 1]
        t.to("cpu")
    assert counter.calls == ["item", "any", "__bool__", "__getitem__[bool mask]", "to(cpu)"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("skip_idle", [False, True])
@pytest.mark.parametrize("half", [True, False], ids=["half", "full"])
def test_no_host_sync_in_a_step_that_rebuilds_nothing(
    half: bool, skip_idle: bool, device: str
) -> None:
    batch = _mixed_batch().to(device)
    model = _model("warp", half=half, skin=0.4).to(device)
    search = model.device_neighbors
    search.skip_idle_launches = skip_idle
    with HostSyncCounter() as first:
        model(batch)  # a host-side build: synchronises (the guard is not blind)
    assert len(first.calls) > 0
    gen = torch.Generator().manual_seed(0)
    step = 0.02 * torch.randn(batch.n_atoms, 3, generator=gen, dtype=batch.dtype).to(device)
    reused = batch.replace(positions=batch.positions + step)
    moved = batch.replace(positions=batch.positions + 20 * step)  # past skin / 2
    with HostSyncCounter() as steady:
        out = model(reused)  # reuses the list
        model(moved)  # rebuilds it on the device
    assert steady.calls == []
    assert search.n_builds == 2 and search.host_rebuilds == 1
    _assert_matches(out, _model("torch").to(device)(reused), torch.float64)


def test_no_host_sync_under_a_dd_context_between_topologies() -> None:
    full = _geometry_batch("triclinic_smaller_than_cutoff", seed=8)
    layout = ghost_layout(full, torch.arange(full.n_atoms), CUTOFF + 0.4)
    halo = SelfImageLayout(layout.n_owned, layout.source[layout.n_owned :])
    model = _model("warp", skin=0.4)
    model.device_neighbors.skip_idle_launches = False
    batch = layout.batch
    with dd_scope(DDContext(layout=halo, topology_version=0)):
        model(batch)
        moved = batch.replace(positions=batch.positions + 0.01)
        with HostSyncCounter() as counter:
            model(moved)
    assert counter.calls == []


# ----------------------------------------------------------------- errors
class DelayedMirror(FlagMirror):
    """A flag copy that arrives one poll late, as a CUDA copy does (the CUDA logic on CPU)."""

    def __init__(self, flags: torch.Tensor) -> None:
        self._flags = flags
        self._copy = flags.clone()
        self.values = host_words(self._copy)
        self._age: int | None = None

    def start(self) -> None:
        self._copy.copy_(self._flags)
        self._age = 0

    def ready(self, wait: bool) -> bool:
        if self._age is None:
            return False
        if wait or self._age >= 1:
            self._age = None
            return True
        self._age += 1
        return False


def test_with_late_flags_an_error_poisons_the_call_and_raises_at_the_next() -> None:
    batch = _geometry_batch("cubic_periodic")
    model = _model("warp", skin=0.3)
    search = model.device_neighbors
    search.mirror_factory = DelayedMirror
    search.skip_idle_launches = False
    model(batch)
    positions = batch.positions.clone()
    positions[2, 0] = float("nan")
    out = model(batch.replace(positions=positions))  # the flags are not back yet
    assert bool(out["energy"].isnan().all()) and bool(out["forces"].isnan().all())
    with HostSyncCounter() as counter, pytest.raises(ValidationError, match="NaN or infinite"):
        model(batch)  # they are now: raised before anything runs
    assert counter.calls == []
    _assert_matches(model(batch), _model("torch")(batch), torch.float64)  # starts afresh


def test_with_late_flags_the_capacity_grows_one_call_later() -> None:
    sparse = make_batch(
        jittered_lattice((5, 5, 5), np.eye(3) * 5.5, 0.05, 1), np.eye(3), [False] * 3
    )
    dense = sparse.replace(positions=sparse.positions * 0.7)
    ref_model, model = _model("torch", skin=0.2), _model("warp", skin=0.2)
    search = model.device_neighbors
    search.mirror_factory = DelayedMirror
    model(sparse)
    capacity, host = search.capacity, search.host_rebuilds
    with HostSyncCounter() as counter:
        walked = model(dense)  # rebuilt on the device, overflowing rows walk the cells
    assert counter.calls == [] and search.host_rebuilds == host
    assert search._state is not None and int(search._state.flags[4]) > 0  # rows walked
    _assert_matches(walked, ref_model(dense), torch.float64)
    _assert_matches(model(dense), ref_model(dense), torch.float64)
    assert search.host_rebuilds == host + 1 and search.capacity > capacity


def test_under_dd_a_new_topology_rebuilds_without_waiting_and_grows_later() -> None:
    """Under a DD context the list's host-side rebuild at a new topology does not
    read its flags (``wait_for_host_builds`` off), once a first build sized it:
    rows past the capacity walk the cells (exact) and the next call regrows.
    Outside DD the same rebuild waits and regrows at once."""
    sparse = make_batch(
        jittered_lattice((5, 5, 5), np.eye(3) * 5.5, 0.05, 1), np.eye(3), [False] * 3
    )
    dense = sparse.replace(positions=sparse.positions * 0.7)
    layouts = [ghost_layout(b, torch.arange(b.n_atoms), CUTOFF + 0.2) for b in (sparse, dense)]
    halos = [SelfImageLayout(lay.n_owned, lay.source[lay.n_owned :]) for lay in layouts]

    def at(model: LennardJones, k: int, version: int) -> Any:
        with dd_scope(DDContext(layout=halos[k], topology_version=version)):
            return model(layouts[k].batch)

    model, fresh = _model("warp", skin=0.2), _model("warp", skin=0.2)
    search = model.device_neighbors
    search.mirror_factory = DelayedMirror
    at(model, 0, 0)  # the first build waits: it sizes the matrix
    assert search.wait_for_host_builds is False
    capacity, host = search.capacity, search.host_rebuilds
    walked = at(model, 1, 1)  # a new topology, denser: rebuilt on the host, not read
    assert search.host_rebuilds == host + 1 and search.capacity == capacity
    assert search._state is not None and int(search._state.flags[4]) > 0  # rows walked
    oracle = at(fresh, 1, 0)  # a fresh list sized for the dense rows
    _assert_matches(walked, oracle, torch.float64)
    assert search.capacity == capacity  # the flags arrive one poll late
    grown = at(model, 1, 1)
    assert search.host_rebuilds == host + 2 and search.capacity > capacity
    _assert_matches(grown, oracle, torch.float64)
    plain = _model("warp", skin=0.2)  # outside DD: the rebuild waits and regrows at once
    plain.device_neighbors.mirror_factory = DelayedMirror
    plain(sparse)
    before = plain.device_neighbors.capacity
    other = make_batch(  # another atom count: a host-side rebuild
        jittered_lattice((5, 5, 6), np.diag([3.85, 3.85, 4.62]), 0.05, 2), np.eye(3), [False] * 3
    )
    plain(other)
    assert plain.device_neighbors.wait_for_host_builds is True
    assert plain.device_neighbors.capacity > before


@pytest.mark.parametrize("backend", ["warp", "torch"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_positions_raise(bad: float, backend: str) -> None:
    """Also with a Verlet skin (a NaN displacement is not "small")."""
    batch = _geometry_batch("cubic_periodic")
    model = _model(backend, skin=0.3)
    model(batch)
    positions = batch.positions.clone()
    positions[4, 1] = bad
    with pytest.raises(ValidationError, match=r"rank 0: .* NaN or infinite"):
        model(batch.replace(positions=positions))
    _assert_matches(model(batch), _model("torch")(batch), torch.float64)  # recovers


def test_non_finite_positions_under_dd_poison_the_outputs_then_raise_at_a_new_topology() -> None:
    full = _geometry_batch("triclinic_smaller_than_cutoff", seed=8)
    layout = ghost_layout(full, torch.arange(full.n_atoms), CUTOFF)
    halo = SelfImageLayout(layout.n_owned, layout.source[layout.n_owned :])
    model = _model("warp")
    batch = layout.batch
    positions = batch.positions.clone()
    positions[0, 0] = float("nan")
    with dd_scope(DDContext(layout=halo, topology_version=0)):
        model(batch)
        out = model(batch.replace(positions=positions))  # no local raise under DD
    n = layout.n_owned
    assert bool(out["energy"].isnan().all()) and bool(out["forces"][:n].isnan().all())
    word = model.device_neighbors.error_word
    assert word is not None and int(word[0]) != 0  # a runtime can reduce it with its flags
    with (
        dd_scope(DDContext(layout=halo, topology_version=1)),
        pytest.raises(ValidationError, match="NaN or infinite"),
    ):
        model(batch)


def test_a_singular_periodic_cell_raises() -> None:
    batch = _geometry_batch("cubic_periodic")
    cell = batch.cell.clone()
    cell[0, 2] = cell[0, 1]
    with pytest.raises(ValidationError, match="singular"):
        _model("warp")(batch.replace(cell=cell))


def test_backend_choice_and_fallbacks() -> None:
    batch = _geometry_batch("open")
    with pytest.raises(ConfigurationError, match="backend='warp' computes direct forces"):
        LJConfig(
            cutoff=CUTOFF, epsilon=1.0, sigma=1.0, backend="warp", force_mode=ForceMode.AUTOGRAD
        )
    assert (
        LJConfig(cutoff=CUTOFF, epsilon=1.0, sigma=1.0, backend="torch").backend is LJBackend.TORCH
    )
    half = batch.to(dtype=torch.float16)
    with pytest.raises(
        ValidationError, match=r"backend='warp' does not apply: positions are torch\.float16"
    ):
        _model("warp")(half)
    auto = _model("auto")
    assert auto.device_neighbors.error_word is None
    auto(batch)
    word = auto.device_neighbors.error_word
    assert word is not None and int(word[0]) == 0
    assert auto.device_neighbors.n_builds == 1 and auto.neighbors.n_builds == 0
    auto_autograd = LennardJones(
        LJConfig(cutoff=CUTOFF, species=_SPECIES, pairs=_PAIRS, force_mode=ForceMode.AUTOGRAD)
    )
    auto_autograd(batch)
    assert auto_autograd.neighbors.n_builds == 1 and auto_autograd.device_neighbors.n_builds == 0


def test_model_pickles_and_copies_after_a_warp_call() -> None:
    batch = _geometry_batch("mixed_pbc")
    model = _model("warp", skin=0.2)
    before = model(batch)
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        after = clone(batch)
        assert torch.equal(before["forces"], after["forces"])


def test_larger_random_system_float32_and_float64() -> None:
    cell = np.diag([7.0, 6.5, 7.5])
    pos = jittered_lattice((6, 6, 6), cell, 0.1, seed=9)
    z = np.random.default_rng(9).choice([18, 10, 36], size=len(pos)).tolist()
    for dtype in (torch.float64, torch.float32):
        batch = make_batch(pos, cell, [True, True, False], z, dtype)
        _assert_matches(_model("warp")(batch), _model("torch")(batch), dtype)


def test_a_rank_without_rows_gets_empty_outputs() -> None:
    empty = Batch(
        torch.zeros(0, 3, dtype=torch.float64),
        torch.zeros(0, dtype=torch.int64),
        cell=torch.eye(3, dtype=torch.float64) * 4.0,
        pbc=torch.tensor([True, False, True]),
    )
    out = _model("warp")(empty)
    assert out["forces"].shape == (0, 3) and out["atom_energies"].shape == (0,)
    assert float(out["energy"].abs().sum()) == 0 and float(out["virial"].abs().sum()) == 0


@pytest.mark.parametrize(
    ("backend", "half"),
    [("warp", True), ("warp", False), ("torch", True)],
    ids=["half", "full", "torch"],
)
def test_without_ghost_forces_owned_rows_are_complete(backend: str, half: bool) -> None:
    """``ghost_forces=False``: two emulated ranks' owned rows alone give every force."""
    full = _geometry_batch("triclinic_smaller_than_cutoff", seed=10)
    ref = _model("torch")(full)
    forces = torch.zeros_like(ref["forces"])
    energy = torch.zeros_like(ref["energy"])
    for owned in (torch.arange(0, 8, 3), torch.tensor([1, 2, 4, 5, 7])):
        layout = ghost_layout(full, owned, CUTOFF)
        n = layout.n_owned
        model = _model(backend, half=half)
        with_ghosts = model(layout.batch, n_receivers=n, ghost_forces=True)
        out = model(layout.batch, n_receivers=n, ghost_forces=False)
        assert float(with_ghosts["forces"][n:].abs().max()) > 0  # (ghost rows get their share)
        assert float(out["forces"][n:].abs().max()) == 0  # nothing to fold
        forces = forces.index_add(0, layout.source[:n], out["forces"][:n])
        energy = energy + out["energy"]
        for key in ("energy", "atom_energies", "virial"):
            torch.testing.assert_close(out[key], with_ghosts[key], rtol=0, atol=1e-12, msg=key)
    scale = float(ref["forces"].abs().max())
    assert float((forces - ref["forces"]).abs().max()) <= 1e-10 * scale
    torch.testing.assert_close(energy, ref["energy"], rtol=1e-12, atol=0)


def test_ghost_forces_false_needs_direct_forces() -> None:
    model = LennardJones(
        LJConfig(cutoff=CUTOFF, species=_SPECIES, pairs=_PAIRS, force_mode=ForceMode.AUTOGRAD)
    )
    with pytest.raises(ValidationError, match="ghost_forces=False needs force_mode"):
        model(_geometry_batch("open"), ghost_forces=False)


def test_a_new_dd_topology_checks_the_system_indices_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under a DD context the model's gate checks a new topology's system
    indices; the device list then skips its own range check (one host read
    fewer per halo rebuild). Outside DD the list still checks a new tensor,
    and under DD a bad index is still refused."""
    from nvdd.models import _device_neighbors as dn

    ranges: list[int] = []
    check = dn._check_system_range

    def spy(system_index: torch.Tensor, n_systems: int) -> None:
        ranges.append(n_systems)
        check(system_index, n_systems)

    monkeypatch.setattr(dn, "_check_system_range", spy)
    full = _geometry_batch("triclinic_smaller_than_cutoff", seed=8)
    layout = ghost_layout(full, torch.arange(full.n_atoms), CUTOFF + 0.4)
    halo = SelfImageLayout(layout.n_owned, layout.source[layout.n_owned :])
    model = _model("warp", skin=0.4)
    batch = layout.batch
    for version in (0, 1):
        fresh = batch.replace(system_index=batch.system_index.clone())
        with dd_scope(DDContext(layout=halo, topology_version=version)):
            model(fresh)
    assert ranges == []
    bad = batch.replace(system_index=torch.ones_like(batch.system_index), validate=False)
    with (
        dd_scope(DDContext(layout=halo, topology_version=2)),
        pytest.raises(ValidationError, match="system_index"),
    ):
        model(bad)
    outside = _model("warp", skin=0.4)
    outside(full)
    assert ranges == [1]
