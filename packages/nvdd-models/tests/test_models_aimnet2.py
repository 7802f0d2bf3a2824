"""AIMNet2Model: an AIMNet2 potential (``aimnet``) under domain decomposition, its
charge equilibration's sums global (issue 37 item 2, records 0067 and 0080).

Needs the ``nvdd-models[aimnet2]`` extra (installed by the ``checks`` session); without
it these tests skip, or fail where ``NVDD_REQUIRE_EXTRAS=1``.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from models_testutils import saved_bytes

from nvdd.core import Batch, ConfigurationError, ValidationError
from nvdd.spec import StrategyKind
from nvdd.testing import (
    assert_dd_equivalent,
    assert_needs_extra,
    binary_lattice,
    importorskip_extra,
    run_ranks,
)

_MLP = {"activation_fn": "torch.nn.GELU", "last_linear": True, "hidden": [8]}
#: A tiny AIMNet2 (aimnet's own configuration format): 3 passes, cutoff 2.6 A, the
#: short-range Coulomb of aimnet's v2 files ("sr_embedded").
CONFIG: dict[str, Any] = {
    "class": "aimnet.models.AIMNet2",
    "kwargs": {
        "nfeature": 4,
        "d2features": True,
        "ncomb_v": 4,
        "hidden": [[16], [16], [16]],
        "aim_size": 8,
        "aev": {"rc_s": 2.5, "nshifts_s": 4},
        "outputs": {
            "energy_mlp": {
                "class": "aimnet.modules.Output",
                "kwargs": {
                    "n_in": 8,
                    "n_out": 1,
                    "key_in": "aim",
                    "key_out": "energy",
                    "mlp": _MLP,
                },
            },
            "atomic_shift": {
                "class": "aimnet.modules.AtomicShift",
                "kwargs": {"key_in": "energy", "key_out": "energy"},
            },
            "atomic_sum": {
                "class": "aimnet.modules.AtomicSum",
                "kwargs": {"key_in": "energy", "key_out": "energy"},
            },
            "srcoulomb": {
                "class": "aimnet.modules.SRCoulomb",
                "kwargs": {"rc": 2.25, "key_in": "charges", "key_out": "energy"},
            },
        },
    },
}


def _aimnet() -> Any:
    return importorskip_extra("aimnet", reason="needs the nvdd-models[aimnet2] extra")


def _model(seed: int = 1, channels: int = 1) -> Any:
    _aimnet()
    from nvdd.models import AIMNet2Model

    config = copy.deepcopy(CONFIG)
    config["kwargs"]["num_charge_channels"] = channels
    model = AIMNet2Model.from_config(config, seed=seed, dtype=torch.float64, skin=0.3)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):  # (untrained: zero shifts)
        torch.manual_seed(seed)
        model.aimnet.outputs.atomic_shift.shifts.weight[1:].normal_()
    return model


def oxide(
    n: tuple[int, int, int], spacing: float = 1.8, seed: int = 0, charge: float = 1.0
) -> Batch:
    """``binary_lattice`` (O and Si, 2:1, periodic, ids shuffled) of total charge
    ``charge``."""
    batch = binary_lattice(n, spacing, seed=seed)
    return batch.replace(system_extras={"charge": torch.tensor([charge], dtype=torch.float64)})


def _all_pairs(plain: Any, batch: Batch, coulomb: bool = False) -> dict[str, torch.Tensor]:
    """aimnet's own nb_mode-1 input for an open ``batch``: every other atom of the
    same system a neighbour (its cutoff function drops the far ones), the last row
    a padding atom, ``mol_idx`` the system: nothing of nvdd's neighbour list or padder."""
    from aimnet import nbops

    n = batch.n_atoms
    sys_i = batch.system_index
    rows = []
    for i in range(n):
        same = [j for j in range(n) if j != i and int(sys_i[j]) == int(sys_i[i])]
        rows.append(same)
    k = max(len(r) for r in rows)
    nbmat = torch.full((n + 1, k), n, dtype=torch.int32)
    for i, r in enumerate(rows):
        nbmat[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    data = {
        **({"mult": batch.system_extras["mult"].clone()} if "mult" in batch.system_extras else {}),
        "coord": torch.cat([batch.positions, batch.positions.new_full((1, 3), 1e3)]),
        "numbers": torch.cat([batch.atomic_numbers, batch.atomic_numbers.new_zeros(1)]),
        "nbmat": nbmat,
        "mol_idx": torch.cat([sys_i, sys_i[-1:]]),
        "charge": batch.system_extras["charge"].clone(),
    }
    if coulomb:  # (the same matrix: aimnet's DSF applies its own cutoff)
        data["nbmat_coulomb"] = nbmat
    return nbops.calc_masks(nbops.set_nb_mode(data))  # type: ignore[no-any-return]


def _aimnet_own(model: Any, batch: Batch) -> dict[str, torch.Tensor]:
    """aimnet's own forward (``forward_prepared`` of a copy of the wrapped module) on
    :func:`_all_pairs` of an open ``batch``: the systems' energies and the real
    rows' forces (autograd) and charges, detached."""
    plain = copy.deepcopy(model.aimnet)
    data = _all_pairs(plain, batch)
    data["coord"] = data["coord"].detach().requires_grad_(True)
    ref = plain.forward_prepared(data)
    (grad,) = torch.autograd.grad(ref["energy"].sum(), data["coord"])
    n = batch.n_atoms
    return {
        "energy": ref["energy"].detach(),
        "forces": -grad[:n],
        "charges": ref["charges"][:n].detach(),
    }


def test_the_wrapper_is_aimnet_and_a_model_file_round_trips(tmp_path: Path) -> None:
    """On one process the wrapper equals the unwrapped AIMNet2 (aimnet's own
    forward body, charge equilibration and output sums, on an all-pairs neighbour
    matrix built here) on two open systems of different total charge: energies,
    forces by autograd and charges. A v2 file written with the model's config and
    weights loads back through aimnet's own loader to the same model."""
    import yaml

    from nvdd.models import AIMNet2Model

    model = _model(seed=3)
    assert model.layers == 3 and abs(model.cutoff - 2.5) < 1e-6
    spec = model.distribution_spec(StrategyKind.GRAPH_PARTITION)
    assert spec.name == "receptive_field(L=3, fold)"
    a = oxide((3, 2, 2), seed=5, charge=1.0)
    b = oxide((2, 2, 2), seed=6, charge=-2.0)
    b = b.replace(atom_ids=b.atom_ids + 1)  # (ids unique across the two)
    batch = Batch.concatenate([a, b]).replace(pbc=torch.zeros(2, 3, dtype=torch.bool))
    got = model(batch)
    ref = _aimnet_own(model, batch)
    assert torch.allclose(got["energy"], ref["energy"], rtol=0, atol=1e-10)
    assert float((got["forces"] - ref["forces"]).abs().max()) < 1e-10
    assert float(ref["forces"].abs().max()) > 1e-3  # forces that could be wrong
    charges = model.charges(batch)
    assert float((charges - ref["charges"]).abs().max()) < 1e-10
    totals = torch.zeros(2, dtype=torch.float64).index_add(0, batch.system_index, charges)
    assert torch.allclose(totals, torch.tensor([1.0, -2.0], dtype=torch.float64), atol=1e-3)
    assert torch.allclose(got["atom_energies"].sum(), got["energy"].sum(), atol=1e-10)

    path = tmp_path / "aimnet2_tiny.pt"
    artifact = {
        "format_version": 2,
        "model_yaml": yaml.safe_dump(CONFIG, sort_keys=False),
        "cutoff": 2.5,
        "needs_coulomb": False,
        "needs_dispersion": False,
        "coulomb_mode": "none",
        "implemented_species": [8, 14],
        "state_dict": model.aimnet.state_dict(),
    }
    torch.save(artifact, path)
    loaded = AIMNet2Model.from_file(path, dtype=torch.float64)
    again = loaded(batch)
    assert float((again["forces"] - got["forces"]).abs().max()) < 1e-12
    with pytest.raises(ConfigurationError, match="no file"):
        AIMNet2Model.from_file(tmp_path / "missing.pt")


def test_an_open_shell_model_equals_aimnet_and_is_exact_under_dd() -> None:
    """Two charge channels (aimnet's NSE): each system's total charge and spin
    multiplicity (``system_extras["mult"]``) split into the channels as aimnet
    does; equal to aimnet's own forward on two open systems (energies, forces,
    charges) and N ranks equal one under graph partition on 2, 3 and 4 ranks."""
    model = _model(seed=2, channels=2)
    a = oxide((3, 2, 2), seed=7, charge=1.0)
    b = oxide((2, 2, 2), seed=8, charge=0.0)
    b = b.replace(atom_ids=b.atom_ids + 1)
    batch = Batch.concatenate([a, b]).replace(
        pbc=torch.zeros(2, 3, dtype=torch.bool),
        system_extras={
            "charge": torch.tensor([1.0, 0.0], dtype=torch.float64),
            "mult": torch.tensor([1.0, 3.0], dtype=torch.float64),
        },
    )
    got = model(batch)
    ref = _aimnet_own(model, batch)
    assert torch.allclose(got["energy"], ref["energy"], rtol=0, atol=1e-10)
    assert float((got["forces"] - ref["forces"]).abs().max()) < 1e-10
    assert float((model.charges(batch) - ref["charges"]).abs().max()) < 1e-10
    singlets = batch.replace(system_extras={**batch.system_extras, "mult": torch.ones(2).double()})
    assert float((model(singlets)["energy"] - got["energy"]).abs().max()) > 1e-6  # (it reads mult)
    one = oxide((4, 3, 3), charge=-1.0)
    one = one.replace(system_extras={**one.system_extras, "mult": torch.tensor([2.0]).double()})
    report = assert_dd_equivalent(
        model,
        one,
        ranks=(2, 3, 4),
        steps=1,
        systems=("periodic",),
        strategy=StrategyKind.GRAPH_PARTITION,
    )
    assert report.passed and all(c.errors["forces"] < 1e-10 for c in report.cases)


def test_dsf_coulomb_equals_aimnet_and_is_exact_under_dd() -> None:
    """aimnet's LRCoulomb with method 'dsf' (a pair sum within dsf_rc of the final
    charges): energies equal aimnet's own forward (its DSF kernel, on an all-pairs
    matrix) at 1e-10, forces its finite differences; the halo reaches dsf_rc
    beyond the charges' receptive field; N ranks equal one on 2, 3 and 4 ranks
    under graph partition (periodic) and the halo (open)."""
    _aimnet()
    from nvdd.models import AIMNet2Model

    config = copy.deepcopy(CONFIG)
    config["kwargs"]["outputs"]["lrcoulomb"] = {
        "class": "aimnet.modules.LRCoulomb",
        "kwargs": {
            "rc": 2.25,
            "method": "dsf",
            "dsf_rc": 3.5,
            "dsf_alpha": 0.3,
            "key_in": "charges",
            "key_out": "energy",
        },
    }
    model = AIMNet2Model.from_config(config, seed=5, dtype=torch.float64, skin=0.3)
    assert model.coulomb_cutoff == 3.5 and model.extra_reach == pytest.approx(1.0)
    assert model.distribution_spec().options.extra_ghost_width == pytest.approx(1.0)
    batch = oxide((3, 2, 2), seed=9, charge=1.0).replace(pbc=torch.zeros(1, 3, dtype=torch.bool))
    got = model(batch)
    plain = copy.deepcopy(model.aimnet)

    def energy(positions: torch.Tensor) -> torch.Tensor:
        data = _all_pairs(plain, batch.replace(positions=positions), coulomb=True)
        with torch.no_grad():
            return plain.forward_prepared(data)["energy"]  # type: ignore[no-any-return]

    # aimnet's plain forward: its DSF kernel (positions detached; 2e-8 relative apart
    # from its own torch form)
    assert torch.allclose(got["energy"], energy(batch.positions), rtol=1e-7, atol=0)
    lrc = plain.outputs.lrcoulomb  # aimnet's forward on its differentiable DSF path
    lrc.__dict__["forward"] = functools.partial(type(lrc).forward, lrc, training_derivatives=True)
    assert torch.allclose(got["energy"], energy(batch.positions), rtol=0, atol=1e-10)
    h = 1e-5
    for atom, axis in ((0, 0), (5, 2), (11, 1)):
        step = torch.zeros_like(batch.positions)
        step[atom, axis] = h
        fd = (energy(batch.positions + step) - energy(batch.positions - step)) / (2 * h)
        assert abs(float(fd[0]) + float(got["forces"][atom, axis])) < 1e-6, (atom, axis)
    one = oxide((4, 3, 3))
    for strategy, systems in (
        (StrategyKind.GRAPH_PARTITION, "periodic"),
        (StrategyKind.HALO, "open"),
    ):
        report = assert_dd_equivalent(
            model, one, ranks=(2, 3, 4), steps=1, systems=(systems,), strategy=strategy
        )
        assert report.passed and all(c.errors["forces"] < 1e-10 for c in report.cases)


def test_global_terms_it_cannot_split_are_refused() -> None:
    """A configuration with aimnet's LRCoulomb (all pairs) is refused when wrapped,
    naming the module and why."""
    _aimnet()
    from nvdd.models import AIMNet2Model

    config = copy.deepcopy(CONFIG)
    config["kwargs"]["outputs"]["lrcoulomb"] = {
        "class": "aimnet.modules.LRCoulomb",
        "kwargs": {"rc": 2.25, "key_in": "charges", "key_out": "energy"},
    }
    with pytest.raises(ConfigurationError, match=r"'lrcoulomb' \(LRCoulomb\).*all pairs"):
        AIMNet2Model.from_config(config)


def _sync_sites(log: list[str]) -> list[str]:
    """``package/file (function)`` of each host synchronisation in a record_host_syncs
    log (its entries end ``at package/file:line (function)``)."""
    out = []
    for entry in log:
        where = entry.split(" at ")[-1]
        out.append(f"{where.split(':')[0]} {where.split(' ')[-1]}")
    return out


def test_steady_steps_read_the_device_only_where_the_neighbour_matrix_needs_it() -> None:
    """On a (fake) accelerator a steady step reads the device only at the Verlet
    list's skin check and the matrix's width: the edge list's filter (nonzero), the
    padder's index checks (5 reads a step), aimnet's molecule count (calc_masks)
    and the element check are not in it. The elements are checked once per atomic-numbers
    tensor (a new batch or partition; also with skin 0, where the neighbour list is
    rebuilt every step), and an in-place change is checked again, the error naming
    the value and the rank."""
    from nvdd.models import AIMNet2Model
    from nvdd.testing import fake_accelerator, record_host_syncs

    base = _model()
    with fake_accelerator() as dev:
        start = oxide((3, 3, 3)).to(dev)
        # the steps as an integrator calls the model: moved positions (within the
        # skin), the same atomic numbers (nvdd-dynamics is above this package)
        steps = [start.replace(positions=start.positions + 1e-3 * k) for k in range(3)]
        for skin in (0.3, 0.0):
            model = AIMNet2Model(copy.deepcopy(base.aimnet), skin=skin, device=dev)
            model(steps[0])
            model(steps[1])
            with record_host_syncs() as log:
                model(steps[2])
            sites = _sync_sites(log)
            assert not [s for s in sites if "(_check" in s or s.startswith("padding/")], sites
            if skin > 0:  # (no rebuild: only these, and aimnet's own reads in _run)
                want = {
                    "models/_verlet.py (_needs_rebuild)",
                    "models/_aimnet2.py (_filter)",  # the matrix's width
                    "models/_aimnet2.py (_run)",  # aimnet's forward (fake-device constants)
                }
                assert set(sites) <= want and len(sites) <= 4, sites
        batch = oxide((3, 3, 3)).to(dev)
        model(batch)
        batch.atomic_numbers[4] = 99  # in place: a new version of the same tensor
        with pytest.raises(ValidationError, match=r"rank 0\): atomic numbers \[99\]"):
            model(batch)


def test_the_matrix_has_the_rows_and_width_the_batch_needs() -> None:
    """The padded input has the batch's rows plus aimnet's padding row and as many
    neighbour slots as the widest row (as aimnet's calculator builds it), not a
    quarter more of each; pad_growth > 1 leaves that headroom on request. Moved
    within the skin (no rebuild), its pairs and image shifts are a fresh search's at
    the cutoff. The masks and molecule layout the wrapper sets itself (without
    calc_masks' host read) are aimnet's calc_masks' for the same input, with a DSF
    Coulomb matrix too."""
    from aimnet import nbops

    from nvdd.models import AIMNet2Model, NeighborList

    model = _model()
    other = oxide((3, 4, 3), seed=2, spacing=1.9)  # (two periodic systems, two cells)
    batch = Batch.concatenate([oxide((4, 3, 3)), other.replace(atom_ids=other.atom_ids + 1)])
    model.inputs(batch, batch.positions)
    g = torch.Generator().manual_seed(3)
    batch = batch.replace(
        positions=batch.positions
        + 0.1 * torch.rand(batch.n_atoms, 3, generator=g, dtype=torch.float64)
        - 0.05  # (|move| < 0.09 A: within half the skin)
    )
    data = model.inputs(batch, batch.positions)
    assert model.neighbors.n_builds == 1
    real = data["nbmat"][:-1] < batch.n_atoms
    assert tuple(data["nbmat"].shape) == (batch.n_atoms + 1, int(real.sum(1).max()))
    fresh = NeighborList(model.cutoff)(batch.positions, batch.cell, batch.pbc, batch.system_index)
    cells = batch.cell.index_select(0, batch.system_index.index_select(0, fresh.receivers))
    cart = torch.bmm(fresh.shifts.to(torch.float64)[:, None], cells)[:, 0]
    want = sorted(
        (int(i), int(j), *(round(float(c), 9) for c in v))
        for i, j, v in zip(fresh.receivers, fresh.senders, cart, strict=True)
    )
    rows, slots = real.nonzero(as_tuple=True)
    got = sorted(
        (int(i), int(data["nbmat"][i, k]), *(round(float(c), 9) for c in data["shifts"][i, k]))
        for i, k in zip(rows, slots, strict=True)
    )
    assert got == want and batch.n_atoms < len(got) < model.neighbors.candidates.n_edges
    assert any(any(w[2:]) for w in want if w[0] >= 36)  # (images in the second cell)
    config = copy.deepcopy(CONFIG)
    config["kwargs"]["outputs"]["lrcoulomb"] = {
        "class": "aimnet.modules.LRCoulomb",
        "kwargs": {"rc": 2.25, "method": "dsf", "dsf_rc": 3.5, "key_in": "charges"},
    }
    dsf = AIMNet2Model.from_config(config, dtype=torch.float64, skin=0.3)
    for got in (data, dsf.inputs(batch, batch.positions)):
        made = ("mask_i", "_input_padded", "_num_mol", "mol_sizes", "_natom", "_nb_mode")
        plain = {k: v for k, v in got.items() if k not in made and not k.startswith("mask_ij")}
        plain["mol_idx"] = torch.arange(batch.n_atoms + 1)
        ref = nbops.calc_masks(nbops.set_nb_mode(plain))
        assert "nbmat_coulomb" in got or got is data
        assert set(ref) == set(got)
        for key, value in ref.items():
            assert torch.equal(value, got[key]), key
    roomy = AIMNet2Model(copy.deepcopy(model.aimnet), skin=0.3, pad_growth=1.25)
    wide = roomy.inputs(batch, batch.positions)["nbmat"]
    assert wide.shape[0] >= 1.25 * (batch.n_atoms + 1) and wide.shape[1] > real.sum(1).max()
    got, ref = model(batch), roomy(batch)
    assert float((got["forces"] - ref["forces"]).abs().max()) < 1e-10
    with pytest.raises(ConfigurationError, match="pad_growth"):
        AIMNet2Model(copy.deepcopy(model.aimnet), pad_growth=0.5)


def test_frozen_weights_keep_less_for_the_backward_and_change_no_force() -> None:
    """The wrapper freezes aimnet's parameters by default (as aimnet's calculator does
    for inference): the forces differentiate the positions only, so autograd saves
    no activation only a weight gradient needs: about a quarter fewer bytes than
    with trainable weights (record 0088), and the same energies, forces and per-atom
    energies bit for bit (float64). freeze=False leaves the parameters as aimnet
    built them."""
    from nvdd.models import AIMNet2Model

    _aimnet()
    kept = AIMNet2Model.from_config(CONFIG, seed=1, dtype=torch.float64, skin=0.3, freeze=False)
    built = {n: p.requires_grad for n, p in kept.named_parameters()}
    assert sum(built.values()) > len(built) / 2  # (aimnet's own: the weights trainable)
    frozen = AIMNet2Model(copy.deepcopy(kept.aimnet), skin=0.3)
    assert not any(p.requires_grad for p in frozen.parameters())
    assert built == {n: p.requires_grad for n, p in kept.named_parameters()}
    batch = oxide((3, 3, 3))
    frozen(batch), kept(batch)  # (the neighbour lists built)
    small, got = saved_bytes(lambda: frozen(batch))
    large, ref = saved_bytes(lambda: kept(batch))
    assert 0 < small < 0.85 * large, (small, large)  # (0.77 here)
    for key in ("energy", "forces", "atom_energies"):
        assert torch.equal(got[key], ref[key]), key
    assert all(p.grad is None for p in kept.parameters())


def _global_sum_rank() -> None:
    """global_system_sum on 2 ranks against the unsharded sum, forward and backward."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()

    from nvdd.models._aimnet2 import global_system_sum

    g = torch.Generator().manual_seed(0)
    values = torch.randn(10, 2, generator=g, dtype=torch.float64)
    system = torch.tensor([0, 1, 0, 1, 1, 0, 0, 1, 2, 2])  # (2: never counted)
    weights = torch.randn(2, 2, generator=g, dtype=torch.float64)
    # the oracle: one process, every real row
    leaf = values.clone().requires_grad_(True)
    whole = torch.zeros(3, 2, dtype=torch.float64).index_add(0, system, leaf)[:2]
    (whole**2 * weights).sum().backward()
    # sharded: rank r counts rows r, r + 2, ... of the first 8; every rank sees every row
    mine = values.clone().requires_grad_(True)
    counted = (torch.arange(10) % world == rank) & (torch.arange(10) < 8)
    out = global_system_sum(mine, system, counted, 2, dist.group.WORLD, distributed=True)
    assert torch.allclose(out, whole.detach(), rtol=0, atol=1e-14)
    (out**2 * weights).sum().backward()  # each rank's own loss uses the same total
    grads = mine.grad * counted[:, None]
    dist.all_reduce(grads)
    assert torch.allclose(grads, world * leaf.grad, rtol=0, atol=1e-13)


@pytest.mark.gloo
def test_the_global_sum_is_exact_on_ranks() -> None:
    """The collective sum (all-reduce forward and backward) equals the unsharded one."""
    run_ranks(_global_sum_rank, 2)


@pytest.mark.gloo
def test_aimnet2_is_exact_under_domain_decomposition() -> None:
    """assert_dd_equivalent at 1e-10 (float64) on 2, 3 and 4 ranks, periodic and
    open, under the halo (total charge +1) and graph partition (-1): the model's
    own spec (receptive field, L = 3, folded), the charge equilibration's sums over
    owned rows all-reduced."""
    model = _model()
    report = assert_dd_equivalent(
        model, oxide((4, 3, 3)), ranks=(2, 3, 4), steps=1, systems=("periodic", "open")
    )
    assert report.passed and len(report.cases) == 6
    assert "receptive_field(L=3, fold)" in report.spec
    assert all(c.errors["cross_rank_pairs"] > 0 for c in report.cases)
    assert all(c.errors["forces"] < 1e-10 for c in report.cases)
    # and under graph partition (ghosts are atoms, not images), total charge -1
    report = assert_dd_equivalent(
        model,
        oxide((4, 3, 3), charge=-1.0),
        ranks=(2, 3, 4),
        steps=1,
        systems=("periodic", "open"),
        strategy=StrategyKind.GRAPH_PARTITION,
    )
    assert report.passed and len(report.cases) == 6
    assert all(c.errors["forces"] < 1e-10 for c in report.cases)


def test_without_aimnet_the_error_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """No aimnet (its import fails): an OptionalDependencyError naming the extra."""
    from nvdd.models import AIMNet2Model

    calls = (
        lambda: AIMNet2Model(torch.nn.Linear(1, 1)),
        lambda: AIMNet2Model.from_config(CONFIG),
        lambda: AIMNet2Model.from_file("model.pt"),
    )
    assert_needs_extra(monkeypatch, "aimnet", "nvdd-models[aimnet2]", calls)
