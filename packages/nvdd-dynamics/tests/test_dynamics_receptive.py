"""The receptive-field safe path: a plain message-passing model, unmodified (no
verbs, no adapters), runs exact under ``receptive_field_spec`` (record 0067)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from test_dynamics_domain_parallel import make_gas
from test_dynamics_verify import PlainMP

from nvdd.core import Batch, ConfigurationError, ModelOutputs
from nvdd.dynamics import DomainConfig, DomainParallel, VelocityVerlet, trace_and_validate
from nvdd.spec import StrategyKind, receptive_field_spec
from nvdd.testing import assert_dd_equivalent, run_ranks

pytestmark = pytest.mark.gloo

HALO, GP = StrategyKind.HALO, StrategyKind.GRAPH_PARTITION


class PeriodicPlainMP(PlainMP):
    """PlainMP with minimum-image distances on periodic axes (boxes wider than
    twice the cutoff), written as on one process; ``atom_energies`` on request."""

    cutoff = 1.6

    def __init__(self, atom_energies: bool = False) -> None:
        super().__init__()
        self.atom_energies = atom_energies

    def forward(self, batch: Batch) -> ModelOutputs:
        pos = batch.positions.detach().requires_grad_(True)
        d = pos[None] - pos[:, None]
        cell, pbc = batch.cell[0], batch.pbc[0]
        if bool(pbc.any()):
            frac = d @ torch.linalg.inv(cell)
            frac = frac - torch.round(frac) * pbc.to(frac.dtype)
            d = frac @ cell
        r = torch.linalg.vector_norm(d, dim=-1)
        w = torch.where(r < self.cutoff, (1 - r / self.cutoff) ** 2, torch.zeros_like(r))
        w = w * (~torch.eye(len(pos), dtype=torch.bool))
        h = torch.ones(len(pos), 1, dtype=pos.dtype)
        for _ in range(2):
            h = h + w @ h
        e_atom = h[:, 0] ** 2
        energy = e_atom.sum().reshape(1)
        (grad,) = torch.autograd.grad(energy.sum(), pos)
        out: dict[str, torch.Tensor] = {"energy": energy, "forces": -grad}
        if self.atom_energies:
            out["atom_energies"] = e_atom.detach()
        return out  # type: ignore[return-value]


class DiffAtomMP(PeriodicPlainMP):
    """The same layers, with atom energies differentiable w.r.t. the positions it
    is given (what the folding variant needs); its own forces only when it made
    the autograd leaf itself (one process)."""

    def forward(self, batch: Batch) -> ModelOutputs:
        given = batch.positions.requires_grad
        pos = batch.positions if given else batch.positions.detach().requires_grad_(True)
        d = pos[None] - pos[:, None]
        cell, pbc = batch.cell[0], batch.pbc[0]
        if bool(pbc.any()):
            frac = d @ torch.linalg.inv(cell)
            d = (frac - torch.round(frac) * pbc.to(frac.dtype)) @ cell
        r = torch.linalg.vector_norm(d + torch.eye(len(pos), dtype=pos.dtype)[..., None], dim=-1)
        w = torch.where(r < self.cutoff, (1 - r / self.cutoff) ** 2, torch.zeros_like(r))
        w = w * (~torch.eye(len(pos), dtype=torch.bool))
        h = torch.ones(len(pos), 1, dtype=pos.dtype)
        for _ in range(2):
            h = h + w @ h
        e_atom = h[:, 0] ** 2
        out = {"energy": e_atom.sum().reshape(1), "atom_energies": e_atom}
        if not given:
            (grad,) = torch.autograd.grad(e_atom.sum(), pos)
            out["forces"] = -grad
            out["atom_energies"] = e_atom.detach()
        return out  # type: ignore[return-value]


def _cases() -> list[tuple[str, Any, Batch, StrategyKind]]:
    return [
        ("open halo", PlainMP(), make_gas(n=40, pbc=(False, False, False)), HALO),
        ("periodic halo", PeriodicPlainMP(), make_gas(n=40, seed=1), HALO),
        (
            "mixed halo",
            PeriodicPlainMP(True),
            make_gas(n=40, pbc=(True, False, True), seed=2),
            HALO,
        ),
        ("open graph", PlainMP(), make_gas(n=40, pbc=(False, False, False), seed=3), GP),
        ("periodic graph", PeriodicPlainMP(True), make_gas(n=40, seed=4), GP),
        ("fold halo", DiffAtomMP(True), make_gas(n=40, pbc=(True, True, False), seed=6), HALO),
        ("fold graph", DiffAtomMP(True), make_gas(n=40, seed=7), GP),
    ]


def _by_id(b: Batch, x: torch.Tensor) -> torch.Tensor:
    return x[torch.argsort(b.atom_ids)]


def _single(model: Any, batch: Batch, steps: int) -> dict[str, torch.Tensor]:
    dyn = VelocityVerlet(model, batch.clone(), dt_fs=0.5)
    dyn.ensure_forces()
    first = {"forces": _by_id(dyn.batch, dyn.batch.forces), "energy": dyn.batch.energy.clone()}
    dyn.run(steps)
    return {**first, "last": _by_id(dyn.batch, dyn.batch.positions)}


def _rank_body(steps: int, picked: list[int], checked: bool) -> list[dict[str, Any]]:
    """The ``picked`` cases under the safe path on this world (rank 0 keeps the
    results); ``checked``: with partition's check and two trace_and_validate runs."""
    out = []
    for i, (name, model, batch, kind) in enumerate(_cases()):
        if i not in picked:
            continue
        validated: list[str] = []
        if checked and i == 3:  # trace_and_validate accepts the safe path (this group)
            spec = receptive_field_spec(layers=2, strategy=kind)
            report = trace_and_validate(model, batch, spec=spec, skin=0.2, strategy=kind)
            validated = sorted(report.errors) if report.passed else [report.summary()]
        if checked and i == 1:  # fix=True ends at the safe path with the model's 2 layers
            report = trace_and_validate(model, batch, skin=0.2, fix=True)
            validated = [report.spec.name, *report.applied_fixes[-2:]]
        dyn = VelocityVerlet(model, batch.clone(), dt_fs=0.5)
        config = DomainConfig(
            cutoff=model.cutoff, skin=0.2, strategy=kind, verify_model=None if checked else False
        )
        spec = receptive_field_spec(layers=2, strategy=kind, fold=name.startswith("fold"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tiny systems: degenerate partitions
            with DomainParallel(dyn, config, spec=spec) as dp:
                dp.partition()
                first = dp.gather(0)
                try:
                    dp.totals(("energy",))
                    asked = "given"
                except ConfigurationError as exc:
                    asked = str(exc)
                width = dp.model.ghost_width
                dp.run(steps)
                last = dp.gather(0)
        if first is not None and last is not None:
            out.append(
                {
                    "name": name,
                    "forces": _by_id(first, first.forces),
                    "energy": first.energy.clone(),
                    "last": _by_id(last, last.positions),
                    "asked": asked,
                    "width": width,
                    "validated": validated,
                }
            )
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_plain_model_runs_exact_unmodified_under_the_receptive_field_spec(world: int) -> None:
    steps = 3
    picked = [0, 1, 2, 3, 4, 5, 6] if world == 2 else [0, 2, 4, 5]  # (3 ranks: fewer)
    got = run_ranks(_rank_body, world, steps, picked, world == 2, timeout_s=240)[0]
    assert [g["name"] for g in got] == [_cases()[i][0] for i in picked]
    for (name, model, batch, _), g in zip([_cases()[i] for i in picked], got, strict=True):
        ref = _single(model, batch, steps)
        assert float((g["forces"] - ref["forces"]).abs().max()) < 1e-10, name
        assert float((g["last"] - ref["last"]).abs().max()) < 1e-10, name
        assert float(ref["forces"].abs().max()) > 1e-3  # forces that could be wrong
        # the halo: 2 x layers x cutoff + skin (+ the migration hysteresis); folding: half
        wide = 2 if name.startswith("fold") else 4
        assert wide * model.cutoff + 0.2 <= g["width"] < wide * model.cutoff + 1.0
        if world == 2 and name == "open graph":  # (PlainMP has no atom energies)
            assert g["validated"] == ["forces"], g["validated"]
        if world == 2 and name == "periodic halo":  # one layer is too few, two pass
            spec_name, one, two = g["validated"]
            assert spec_name == "receptive_field(L=2)", g["validated"]
            assert "receptive_field_spec(layers=1)" in one and "real number of layers" in one
            assert "receptive_field_spec(layers=2)" in two
        if getattr(model, "atom_energies", False):  # energy: the owned atom energies summed
            assert g["asked"] == "given", name
            assert float((g["energy"] - ref["energy"]).abs().max()) < 1e-10, name
        else:  # never a wrong number: NaN when gathered, an error when asked for
            assert bool(torch.isnan(g["energy"]).all()), name
            assert f"{type(model).__name__} runs unmodified under the receptive-field" in g["asked"]
            assert "'atom_energies'" in g["asked"]


def _refused(layers: int) -> str:
    model = PeriodicPlainMP()
    dyn = VelocityVerlet(model, make_gas(n=40), dt_fs=0.5)
    config = DomainConfig(cutoff=model.cutoff, skin=0.2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with DomainParallel(dyn, config, spec=receptive_field_spec(layers)) as dp:
                dp.partition()
                dp.run(1)
    except ConfigurationError as exc:
        return str(exc)
    return "ran"


def _hook_needs_energy() -> str:
    from nvdd.dynamics import HookStage

    model = PlainMP()  # returns no atom energies: no energy under DD
    dyn = VelocityVerlet(model, make_gas(n=40, pbc=(False, False, False)), dt_fs=0.5)
    config = DomainConfig(cutoff=model.cutoff, skin=0.2, verify_model=False)
    seen: list[float] = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with DomainParallel(dyn, config, spec=receptive_field_spec(2)) as dp:
                dp.partition()
                dp.register_hook(
                    HookStage.AFTER_STEP,
                    lambda ctx: seen.append(float(ctx.batch.energy.sum())),
                    needs=("energy",),
                )
                dp.run(2)
    except ConfigurationError as exc:
        return f"{len(seen)} energies seen; {exc}"
    return "ran"


def _refusals() -> list[str]:
    return [_refused(1), _refused(3000), _hook_needs_energy()]


def test_too_few_layers_an_impossible_halo_and_a_missing_energy_are_refused_on_every_rank() -> None:
    for too_few, too_wide, hooked in run_ranks(_refusals, 2, timeout_s=240):
        # a 2-layer model declared with 1 layer: partition's check catches it
        assert "with the receptive-field spec 'receptive_field(L=1)' gives different" in too_few
        assert "Declare its real number of layers" in too_few
        # 2 x 3000 x 1.6 Angstrom of halo in a 7 Angstrom periodic box: refused before building
        assert "PeriodicPlainMP under 'receptive_field(L=3000)'" in too_wide
        assert "periodic images per axis of system 0" in too_wide
        assert "more than the halo can hold" in too_wide
        # a hook that needs the energy of a model without atom energies: an error on
        # every rank before the hook sees a number
        assert hooked.startswith("0 energies seen; the per-system energy is not available")
        assert "PlainMP runs unmodified under the receptive-field spec" in hooked


def test_the_conformance_kit_accepts_the_safe_path() -> None:
    report = assert_dd_equivalent(
        PeriodicPlainMP(),  # no atom energies: the energy is not compared, forces are
        make_gas(n=40, seed=5),
        spec=receptive_field_spec(layers=2),
        ranks=(2,),
        systems=("periodic", "open"),
        steps=2,
    )
    assert report.passed and len(report.cases) == 2
    assert all("energy" not in c.errors and c.errors["forces"] < 1e-10 for c in report.cases)
    assert "energy: compared only where the decomposed run has one" in report.summary()


def _fold_without_gradients() -> list[str]:
    out = []
    for model in (PlainMP(), PeriodicPlainMP(atom_energies=True)):
        dyn = VelocityVerlet(model, make_gas(n=40, pbc=(False, False, False)), dt_fs=0.5)
        config = DomainConfig(cutoff=model.cutoff, skin=0.2)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with DomainParallel(dyn, config, spec=receptive_field_spec(2, fold=True)) as dp:
                    dp.partition()
                    dp.run(1)
            out.append("ran")
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def test_the_folding_variant_needs_differentiable_atom_energies() -> None:
    for no_atoms, detached in run_ranks(_fold_without_gradients, 2, timeout_s=240):
        assert "PlainMP under receptive_field_spec(..., fold=True) must return" in no_atoms
        assert "are not differentiable w.r.t. the positions" in detached
