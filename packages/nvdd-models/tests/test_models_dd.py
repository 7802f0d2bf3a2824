"""The models under domain decomposition: specs, the DD context, gloo ranks vs one process.

The gloo tests follow the runtime contract of ``nvdd.dynamics.DistributedModel``
(which sits above this package) with nvdd-halo directly (``models_ddcases.py``)
and compare every rank's owned atoms with the single-process model by atom id.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import re
from typing import Any

import numpy as np
import pytest
import torch
from models_ddcases import (
    CASES,
    count_all_reduce,
    global_batch,
    make_model,
    run_bad_rank,
    run_steps,
)
from models_testutils import DEVICES, ghost_layout, jittered_lattice, make_batch

from nvdd.core import Batch, ConfigurationError, ValidationError
from nvdd.models import LennardJones, ReferenceMPNN
from nvdd.models._lj import SPEC_LJ_OWNED
from nvdd.shardtensor import DDContext, SelfImageLayout, dd_scope
from nvdd.spec import (
    SPEC_LJ_HALO,
    SPEC_MPNN_GP,
    SPEC_MPNN_HALO,
    BaseModelMixin,
    ForceStrategy,
    OutputKind,
    Reduce,
    ScatterMode,
    StrategyKind,
)
from nvdd.testing import assert_close_by_id, assert_same_ids, run_ranks

ATOL = 1e-10


# ------------------------------------------------------------------ the spec
@pytest.mark.parametrize(("kind", "preset"), [("lj", SPEC_LJ_OWNED), ("mpnn", SPEC_MPNN_HALO)])
def test_models_declare_their_halo_presets(kind: str, preset: Any) -> None:
    model = make_model(kind)
    assert isinstance(model, BaseModelMixin) and isinstance(model, torch.nn.Module)
    assert model.distribution_spec() is preset
    assert model.distribution_spec(StrategyKind.HALO) is preset
    assert model.distribution_spec("halo") is preset
    expected = ForceStrategy.DIRECT if kind == "lj" else ForceStrategy.AUTOGRAD
    assert model.distribution_spec().force_strategy is expected


def test_lj_direct_forces_are_owned_and_autograd_forces_fold() -> None:
    """Direct forces: SPEC_LJ_HALO with forces exact on owned rows (no fold, no
    reverse exchange); autograd forces: SPEC_LJ_HALO itself (folded)."""
    owned = SPEC_LJ_OWNED.output("forces")
    assert (owned.kind, owned.effective_reduce()) == (OutputKind.PER_NODE, Reduce.OWNED_ONLY)
    assert SPEC_LJ_HALO.output("forces").effective_reduce() is Reduce.ALL_REDUCE
    # everything else is SPEC_LJ_HALO's
    rest = {k: v for k, v in SPEC_LJ_OWNED.outputs.items() if k != "forces"}
    assert rest == {k: v for k, v in SPEC_LJ_HALO.outputs.items() if k != "forces"}
    assert SPEC_LJ_OWNED.options == SPEC_LJ_HALO.options
    assert SPEC_LJ_OWNED.force_strategy is SPEC_LJ_HALO.force_strategy is ForceStrategy.DIRECT
    model = make_model("lj", mode="autograd")
    assert model.distribution_spec() is SPEC_LJ_HALO
    assert model.distribution_spec(StrategyKind.GRAPH_PARTITION).outputs == SPEC_LJ_HALO.outputs


@pytest.mark.parametrize("kind", ["lj", "mpnn"])
def test_graph_partition_specs_and_unknown_strategies(kind: str) -> None:
    model = make_model(kind)
    spec = model.distribution_spec(StrategyKind.GRAPH_PARTITION)
    assert spec is model.distribution_spec("graph_partition")
    assert spec.distribution.storage is StrategyKind.GRAPH_PARTITION
    halo = model.distribution_spec()
    if kind == "mpnn":
        assert spec is SPEC_MPNN_GP
    # the same outputs and forces as the halo preset: only the storage differs
    assert spec.outputs == halo.outputs and spec.force_strategy is halo.force_strategy
    with pytest.raises(ConfigurationError, match="must be a StrategyKind, got 'ring'"):
        model.distribution_spec("ring")  # type: ignore[arg-type]


def test_a_model_that_did_not_opt_in_to_graph_partition_says_so() -> None:
    class HaloOnly(LennardJones):
        _graph_preset = None

    model = HaloOnly(make_model("lj").config)
    with pytest.raises(ConfigurationError, match=r"HALO only.*GRAPH_PARTITION.*not opted in"):
        model.distribution_spec(StrategyKind.GRAPH_PARTITION)


# ------------------------------------------------- the inert context: phase 1
@pytest.mark.parametrize("kind", ["lj", "mpnn"])
def test_inert_context_is_exactly_the_single_process_model(kind: str) -> None:
    batch = global_batch("triclinic-3", kind)
    plain = make_model(kind)(batch)
    with dd_scope(None):
        inert = make_model(kind)(batch)
    with dd_scope(DDContext(positions=batch.positions)):
        inert_with_positions = make_model(kind)(batch)
    for key, value in plain.items():
        assert torch.equal(value, inert[key]), key
        assert torch.equal(value, inert_with_positions[key]), key


# ---------------------------------------------- one process, self-image halo
def _self_image_run(
    model: LennardJones | ReferenceMPNN, full: Batch, cutoff: float, device: str = "cpu"
) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
    """All atoms owned by one rank; ghosts are its own periodic images.

    Returns the outputs on the CPU, each row's source atom and the owned rows.
    """
    layout = ghost_layout(full, torch.arange(full.n_atoms), cutoff)
    halo = SelfImageLayout(layout.n_owned, layout.source[layout.n_owned :].to(device))
    autograd = model.distribution_spec().force_strategy is ForceStrategy.AUTOGRAD
    batch = layout.batch.to(device)
    leaf = batch.positions.clone().requires_grad_(autograd)
    with dd_scope(DDContext(layout=halo, positions=leaf)):
        out = model.to(device)(batch.replace(positions=leaf))
    return {k: v.detach().cpu() for k, v in out.items()}, layout.source, layout.n_owned


def _assert_equals_the_periodic_model(
    out: dict[str, torch.Tensor], source: torch.Tensor, reference: dict[str, torch.Tensor]
) -> None:
    """Energy, stress and the forces of every row summed into its source atom."""
    forces = torch.zeros_like(reference["forces"]).index_add(0, source, out["forces"])
    torch.testing.assert_close(out["energy"], reference["energy"], rtol=0, atol=ATOL)
    torch.testing.assert_close(forces, reference["forces"], rtol=0, atol=ATOL)
    torch.testing.assert_close(out["stress"], reference["stress"], rtol=0, atol=ATOL)


def _mpnn_system() -> Batch:
    cell = [[4.6, 0.0, 0.0], [0.8, 4.4, 0.0], [-0.5, 0.6, 4.5]]
    pos = jittered_lattice((3, 3, 3), np.asarray(cell), 0.15, seed=21)
    z = np.random.default_rng(21).choice([1, 6, 8], size=len(pos)).tolist()
    return make_batch(pos, np.asarray(cell), [True, True, True], z)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layers", [1, 2, 3])
def test_mpnn_on_its_own_periodic_images_equals_the_periodic_model(
    layers: int, device: str
) -> None:
    """Ghost features refreshed after every layer: one cutoff of halo suffices for any depth."""
    full = _mpnn_system()
    model = make_model("mpnn", layers=layers)
    reference = model(full)
    out, source, n = _self_image_run(model, full, model.cutoff, device)
    _assert_equals_the_periodic_model(out, source, reference)
    torch.testing.assert_close(out["virial"], reference["virial"], rtol=0, atol=ATOL)
    torch.testing.assert_close(
        out["atom_energies"][:n], reference["atom_energies"], rtol=0, atol=ATOL
    )


class _FoldingMPNN(ReferenceMPNN):
    """The same network with the fold mode of its spec (``ScatterMode.FOLD``)."""

    _halo_preset = SPEC_MPNN_HALO.replace(
        options=dataclasses.replace(SPEC_MPNN_HALO.options, scatter=ScatterMode.FOLD)
    )


def test_mpnn_refresh_mode_equals_the_fold_mode_with_half_the_exchanges() -> None:
    """Owned receivers: a refresh after the owned-row update replaces fold + refresh
    (issue 13): the same outputs, one exchange per layer but the last instead of two."""
    full = _mpnn_system()
    local = make_model("mpnn", layers=3)
    fold = _FoldingMPNN(local.config)
    fold.load_state_dict(local.state_dict())
    calls = {}
    for name, model in (("local", local), ("fold", fold)):
        layout = ghost_layout(full, torch.arange(full.n_atoms), model.cutoff)
        halo = SelfImageLayout(layout.n_owned, layout.source[layout.n_owned :])
        counted = {"refresh": 0, "fold": 0}
        refresh0, fold0 = halo.refresh, halo.fold

        def refresh(x: torch.Tensor, _r=refresh0, _c=counted) -> torch.Tensor:
            _c["refresh"] += 1
            return _r(x)

        def folded(x: torch.Tensor, _f=fold0, _c=counted) -> torch.Tensor:
            _c["fold"] += 1
            return _f(x)

        halo.refresh, halo.fold = refresh, folded  # type: ignore[method-assign]
        leaf = layout.batch.positions.clone().requires_grad_(True)
        with dd_scope(DDContext(layout=halo, positions=leaf)):
            out = model(layout.batch.replace(positions=leaf))
        calls[name] = (counted, {k: v.detach() for k, v in out.items()}, layout.n_owned)
    (c_local, out_local, n), (c_fold, out_fold, _) = calls["local"], calls["fold"]
    assert c_local == {"refresh": 2, "fold": 0}
    assert c_fold == {"refresh": 0, "fold": 3}
    for key in ("energy", "forces", "stress"):
        torch.testing.assert_close(out_local[key], out_fold[key], rtol=0, atol=ATOL)
    torch.testing.assert_close(
        out_local["atom_energies"][:n], out_fold["atom_energies"][:n], rtol=0, atol=ATOL
    )


def test_mpnn_without_the_per_layer_fold_would_be_wrong() -> None:
    """The same two-layer run with ghost features left stale differs: the refresh matters."""
    from nvdd.models import _mpnn

    full = _mpnn_system()
    model = make_model("mpnn", layers=2)
    reference = model(full)
    original = _mpnn.refresh_neighbors
    _mpnn.refresh_neighbors = lambda x: x  # type: ignore[assignment]
    try:
        out, _, _ = _self_image_run(model, full, model.cutoff)
    finally:
        _mpnn.refresh_neighbors = original
    assert float((out["energy"] - reference["energy"]).abs().max()) > 1e-4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["direct", "autograd"])
def test_lj_on_its_own_periodic_images_equals_the_periodic_model(mode: str, device: str) -> None:
    full = global_batch("triclinic-3", "lj")
    model = make_model("lj", mode=mode)
    reference = model(full)
    out, source, n = _self_image_run(model, full, model.cutoff, device)
    _assert_equals_the_periodic_model(out, source, reference)
    assert float(out["atom_energies"][n:].abs().max()) == 0.0  # no ghost receivers


@pytest.mark.parametrize("kind", ["lj", "mpnn"])
def test_models_pickle_after_a_dd_call(kind: str) -> None:
    """The checked-topology memory is a weak reference; copies start without it."""
    full = global_batch("periodic-2", kind)
    layout = ghost_layout(full, torch.arange(full.n_atoms), 2.6)
    halo = SelfImageLayout(layout.n_owned, layout.source[layout.n_owned :])
    model = make_model(kind)
    with dd_scope(DDContext(layout=halo)):
        before = model(layout.batch)
        for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
            assert clone.config == model.config
            after = clone(layout.batch)
            assert torch.equal(before["forces"], after["forces"])


def test_model_inputs_are_checked_against_the_layout() -> None:
    full = global_batch("periodic-2", "lj")
    layout = ghost_layout(full, torch.arange(full.n_atoms), 2.5)
    halo = SelfImageLayout(layout.n_owned, layout.source[layout.n_owned :])
    model = make_model("lj")
    with dd_scope(DDContext(layout=halo)):
        with pytest.raises(ValidationError, match=r"rank 0: the batch has 36 rows .* n_padded="):
            model(full)
        with pytest.raises(ValidationError, match=r"n_receivers=3 differs .* n_owned=36"):
            model(layout.batch, n_receivers=3)
        with pytest.raises(ValidationError, match=r"pbc .* must have open boundaries"):
            model(layout.batch.replace(pbc=torch.ones_like(layout.batch.pbc)))
        out = model(layout.batch, n_receivers=36)  # the owned rows: accepted
    assert out["forces"].shape == layout.batch.positions.shape


def test_a_steady_call_with_the_checked_inputs_checks_nothing_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under DD the geometry and row checks run at a new topology and again only
    for inputs other than those checked there: a steady step of the runtime (new
    positions, the same pbc and system index) does not check them again; a
    malformed batch at the same topology still raises."""
    from nvdd.models import _dd

    calls: list[int] = []
    real = _dd.check_geometry
    monkeypatch.setattr(_dd, "check_geometry", lambda *a: calls.append(1) or real(*a))
    full = global_batch("periodic-2", "lj")
    layout = ghost_layout(full, torch.arange(full.n_atoms), 2.5)
    halo = SelfImageLayout(layout.n_owned, layout.source[layout.n_owned :])
    model, batch = make_model("lj"), layout.batch
    with dd_scope(DDContext(layout=halo)):
        model(batch)
        assert len(calls) == 1  # (a new topology)
        for k in range(2):  # steady steps: new positions of the same shape
            model(batch.replace(positions=batch.positions + 0.001 * (k + 1)))
        assert len(calls) == 1
        model(batch.replace(system_index=batch.system_index.clone()))  # another tensor
        assert len(calls) == 2
        with pytest.raises(ValidationError, match=r"rank 0: positions has shape"):
            model(batch.replace(positions=batch.positions[:, :2], validate=False))


class _LeavesAxes:
    """A halo layout that leaves y and z to the model (``periodic_axes``)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.periodic_axes = torch.tensor([[False, True, True]])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.mark.parametrize("kind", ["lj", "mpnn"])
def test_a_halo_that_leaves_axes_to_the_model_wants_exactly_those_periodic(kind: str) -> None:
    full = global_batch("periodic-2", kind)
    layout = ghost_layout(full, torch.arange(full.n_atoms), 2.5)
    halo = _LeavesAxes(SelfImageLayout(layout.n_owned, layout.source[layout.n_owned :]))
    model = make_model(kind)
    with dd_scope(DDContext(layout=halo)):
        with pytest.raises(ValidationError, match=r"periodic exactly along .*\[\[False, True"):
            model(layout.batch)  # open boundaries where the layout left y and z
        pbc = torch.tensor([[False, True, True]])
        out = model(layout.batch.replace(pbc=pbc))  # exactly the layout's axes: accepted
    assert out["forces"].shape == layout.batch.positions.shape


# ------------------------------------------------------- gloo: N ranks vs 1
def _oracle(kind: str, case: str, shift: float = 0.0, **kw: Any) -> dict[str, torch.Tensor]:
    """The single-process model (LJ: the torch reference whatever the ranks use)."""
    if kind == "lj":
        kw["backend"] = "torch"
    batch = global_batch(case, kind, shift)
    out = dict(make_model(kind, **kw)(batch))
    out["ids"] = batch.atom_ids
    return out


def _compare(got: list[dict[str, Any]], ref: dict[str, torch.Tensor], atol: float = ATOL) -> None:
    """Every rank's owned rows against the oracle by id; totals on every rank."""
    ids = torch.cat([g["ids"] for g in got])
    assert_same_ids(ids, ref["ids"])
    for key in ("forces", "atom_energies"):
        values = torch.cat([g[key] for g in got])
        assert_close_by_id(ids, values, ref["ids"], ref[key], atol=atol, what=key)
    for g in got:
        for key in ("energy", "virial", "stress"):
            torch.testing.assert_close(g[key], ref[key], rtol=0, atol=atol, msg=key)


# (case, force mode, LJ implementation of the ranks); the oracle is the torch reference
LJ_CASES = [
    ("periodic-2", "direct", "warp-half"),
    ("triclinic-3", "direct", "warp-half"),
    ("mixed-open-cuts-3", "direct", "warp-half"),
    ("two-systems-2", "direct", "warp-half"),
    ("mixed-periodic-cut-2", "autograd", "torch"),
    ("empty-rank-3", "direct", "warp-half"),
    ("triclinic-3", "direct", "warp-full"),
    ("two-systems-2", "direct", "torch"),
    ("mixed-open-cuts-3", "direct", "warp-half-nofold"),
    ("periodic-2", "direct", "torch-nofold"),
]
_LJ_IMPLEMENTATIONS: dict[str, dict[str, Any]] = {
    "warp-half": {"lj_backend": "warp", "half_list": True},
    "warp-full": {"lj_backend": "warp", "half_list": False},
    "torch": {"lj_backend": "torch"},
    # complete owned rows (ghost_forces=False), no fold
    "warp-half-nofold": {"lj_backend": "warp", "ghost_forces": False},
    "torch-nofold": {"lj_backend": "torch", "ghost_forces": False},
}


@pytest.mark.gloo
@pytest.mark.parametrize(
    ("case", "mode", "impl"), LJ_CASES, ids=[f"{c}-{m}-{i}" for c, m, i in LJ_CASES]
)
def test_lj_ranks_equal_the_single_process_model_by_id(case: str, mode: str, impl: str) -> None:
    kw = _LJ_IMPLEMENTATIONS[impl]
    world = CASES[case][0]
    got = [r[0] for r in run_ranks(run_steps, world, "lj", case, mode=mode, timeout_s=120, **kw)]
    _compare(got, _oracle("lj", case, mode=mode))
    # Scope.LOCAL: each rank returns its partial energy; the partials add up.
    partials = torch.stack([g["energy_rank"] for g in got])
    torch.testing.assert_close(partials.sum(0), got[0]["energy"], rtol=0, atol=ATOL)
    busy = max(range(len(got)), key=lambda r: len(got[r]["ids"]))
    assert float((partials[busy] - got[0]["energy"]).abs().max()) > 1e-3


MPNN_CASES = [
    ("periodic-2", 2),
    ("periodic-2", 3),
    ("triclinic-3", 2),
    ("mixed-open-cuts-3", 3),
    ("mixed-periodic-cut-2", 2),
    ("two-systems-2", 3),
    ("empty-rank-3", 2),
    ("open-lopsided-2", 3),
]


#: The device edges (``neighbors="device"``) on the cases that stress them.
MPNN_DEVICE_CASES = [
    ("periodic-2", 3, "device"),
    ("two-systems-2", 2, "device"),
    ("empty-rank-3", 2, "device"),
    ("open-lopsided-2", 3, "device"),
]


@pytest.mark.gloo
@pytest.mark.parametrize(
    ("case", "layers", "neighbors"),
    [(c, n, "auto") for c, n in MPNN_CASES] + MPNN_DEVICE_CASES,
    ids=[f"{c}-L{n}" for c, n in MPNN_CASES] + [f"{c}-L{n}-dev" for c, n, _ in MPNN_DEVICE_CASES],
)
def test_mpnn_ranks_equal_the_single_process_model_by_id(
    case: str, layers: int, neighbors: str
) -> None:
    world = CASES[case][0]
    got = [
        r[0]
        for r in run_ranks(
            run_steps, world, "mpnn", case, layers=layers, neighbors=neighbors, timeout_s=120
        )
    ]
    _compare(got, _oracle("mpnn", case, layers=layers))
    # Scope.OWNED: the energy is already global (and identical) on every rank.
    for g in got:
        assert torch.equal(g["energy_rank"], got[0]["energy_rank"])
        torch.testing.assert_close(g["energy_rank"], g["energy"], rtol=0, atol=0)


@pytest.mark.gloo
@pytest.mark.parametrize("kind", ["lj", "lj-torch", "mpnn"])
def test_verlet_cache_follows_the_halo_topology(kind: str) -> None:
    """Reused plan and small moves: the list is reused; a new plan: the list is rebuilt."""
    schedule = ((True, 0.0), (False, 0.01), (False, 0.02), (True, 0.02), (False, 0.03))
    case = "triclinic-3"
    kw: dict[str, Any] = {"lj_backend": "torch"} if kind == "lj-torch" else {}
    kind = kind.removesuffix("-torch")
    results = run_ranks(run_steps, 3, kind, case, schedule, skin=0.25, timeout_s=120, **kw)
    for step, (_, shift) in enumerate(schedule):
        _compare([r[step] for r in results], _oracle(kind, case, shift, skin=0.25))
    for per_rank in results:
        # built at step 0, reused at steps 1-2, rebuilt at step 3 (new topology,
        # same positions as step 2), reused at step 4
        assert [r["n_builds"] for r in per_rank] == [1, 1, 1, 2, 2]


@pytest.mark.gloo
def test_float32_ranks_agree_with_the_float64_model() -> None:
    case = "periodic-2"
    got = [r[0] for r in run_ranks(run_steps, 2, "mpnn", case, dtype=torch.float32, timeout_s=120)]
    ref = _oracle("mpnn", case)
    ids = torch.cat([g["ids"] for g in got])
    forces = torch.cat([g["forces"] for g in got])
    assert forces.dtype == torch.float32
    scale = float(ref["forces"].abs().max())
    assert_close_by_id(ids, forces, ref["ids"], ref["forces"], atol=1e-5 * scale, what="forces")
    for g in got:
        torch.testing.assert_close(g["energy"].double(), ref["energy"], rtol=1e-5, atol=0)


@pytest.mark.gloo
@pytest.mark.parametrize(
    ("kind", "how", "match"),
    [
        ("lj", "species", "atomic_numbers\\[0\\] = 99 has no parameters"),
        ("mpnn", "species", "atomic_numbers\\[0\\] = 99 has no parameters"),
        ("mpnn", "n_receivers", "differs from the DD layout's n_owned"),
        ("lj", "pbc", "must have open boundaries"),
    ],
)
def test_bad_input_on_one_rank_raises_on_every_rank(kind: str, how: str, match: str) -> None:
    messages = run_ranks(run_bad_rank, 2, kind, "periodic-2", 1, how, timeout_s=60)
    for message in messages:
        assert message.startswith("rank 1: "), message
        assert re.search(match, message), message
        assert "rank 0:" not in message


@pytest.mark.gloo
@pytest.mark.parametrize(("kind", "expected"), [("lj", [1, 0, 1]), ("mpnn", [2, 1, 2])])
def test_inputs_are_shared_once_per_topology_not_every_step(kind: str, expected: list[int]) -> None:
    """LJ: no all-reduce on a steady-state forward; MPNN: only its energy's."""
    for counts in run_ranks(count_all_reduce, 2, kind, "periodic-2", timeout_s=60):
        assert counts == expected
