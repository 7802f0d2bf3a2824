"""Nose-Hoover NVT and MTK NPT: ASE as an independent oracle, conservation, one
reduction per step, and N ranks equal to 1 rank by atom id (gloo)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dyn_models import SoftPair
from test_dynamics_domain_parallel import make_gas

from nvdd.core import Batch, ConfigurationError, ModelOutputs, ValidationError
from nvdd.dynamics import (
    EV_PER_A3_PER_BAR,
    KB_EV_PER_K,
    MTKNPT,
    BaseDynamics,
    CellDOF,
    DomainConfig,
    DomainParallel,
    HookScope,
    HookStage,
    MeshReducer,
    NoseHooverChain,
    NoseHooverNVT,
    PendingTotals,
    Reducer,
    StepSums,
    step_sums,
)
from nvdd.dynamics._nose_hoover import reduce_step
from nvdd.testing import assert_close_by_id, assert_same_ids, run_ranks

T_K, P_BAR = 150.0, 5000.0


def _nvt(batch: Batch, **kw: Any) -> NoseHooverNVT:
    return NoseHooverNVT(SoftPair(), batch, dt_fs=2.0, temperature_K=T_K, tau_fs=20.0, **kw)


def _npt(batch: Batch, dof: CellDOF, pressure_bar: float = P_BAR, **kw: Any) -> MTKNPT:
    return MTKNPT(
        SoftPair(),
        batch,
        dt_fs=2.0,
        temperature_K=T_K,
        pressure_bar=pressure_bar,
        tau_t_fs=20.0,
        tau_p_fs=100.0,
        cell_dof=dof,
        **kw,
    )


def _make(kind: str, batch: Batch, pressure_bar: float = P_BAR) -> Any:
    if kind == "nvt":
        return _nvt(batch)
    dof = CellDOF.ISOTROPIC if kind == "npt-iso" else CellDOF.FULL
    return _npt(batch, dof, pressure_bar)


# --------------------------------------------------------------- ASE oracle
@pytest.mark.parametrize("kind", ["nvt", "npt-iso", "npt-full"])
def test_trajectory_equals_ase(kind: str) -> None:
    """ASE's NoseHooverChainNVT / IsotropicMTKNPT / MTKNPT on the same model: the
    same positions, velocities, cell and conserved energy after 40 steps."""
    import ase.md.nose_hoover_chain as ase_md
    import ase.units as ase_units
    from ens_oracle import NvddCalculator

    batch = make_gas(n=32, triclinic=True)
    atoms = batch.to_ase()[0]
    atoms.calc = NvddCalculator(SoftPair())
    t_ase = T_K * KB_EV_PER_K / ase_units.kB  # the same kT in ASE's Boltzmann constant
    dt, fs = 2.0 * ase_units.fs, ase_units.fs
    if kind == "nvt":
        ref: Any = ase_md.NoseHooverChainNVT(atoms, dt, temperature_K=t_ase, tdamp=20 * fs)
    else:
        cls = ase_md.IsotropicMTKNPT if kind == "npt-iso" else ase_md.MTKNPT
        ref = cls(
            atoms,
            dt,
            temperature_K=t_ase,
            pressure_au=P_BAR * EV_PER_A3_PER_BAR,
            tdamp=20 * fs,
            pdamp=100 * fs,
        )
    dyn = _make(kind, batch.clone())
    for _ in range(40):
        ref.run(1)
        dyn.step()
        assert abs(float(dyn.conserved_energy()[0]) - ref.get_conserved_energy()) < 1e-10
    b = dyn.batch
    assert np.abs(b.positions.numpy() - atoms.positions).max() < 1e-10
    assert np.abs(b.velocities.numpy() - atoms.get_velocities()).max() < 1e-10
    assert np.abs(b.cell[0].numpy() - np.array(atoms.cell)).max() < 1e-10
    moved = np.abs(np.array(atoms.cell) - batch.cell[0].numpy()).max()
    assert (moved > 0.5) == (kind != "nvt"), moved  # the barostat did work


def test_nose_hoover_chain_conserves_its_extended_energy_to_fourth_order() -> None:
    """A chain on a free kinetic energy: K + chain energy is conserved, with the
    error of a fourth-order (Suzuki-Yoshida) integrator, and K is driven to
    n_dof kT."""

    def run(dt: float) -> tuple[float, np.ndarray]:
        n_dof = torch.tensor([30.0, 90.0], dtype=torch.float64)  # tensors or arrays
        q = np.array([[3.0, 0.1, 0.1, 0.1], [9.0, 0.1, 0.1, 0.1]])
        chain = NoseHooverChain(n_dof, 0.01, q)
        chain.p_xi = np.array([[0.3, -0.02, 0.01, 0.0], [-0.5, 0.03, 0.0, 0.01]])
        k2 = np.array([0.9, 0.4])  # far from n_dof kT
        start = 0.5 * k2 + chain.energy()
        for _ in range(round(40 / dt)):
            s = chain.propagate(k2, dt)
            k2 = k2 * s * s
        assert chain.length == 4
        return float(np.abs(0.5 * k2 + chain.energy() - start).max()), k2

    coarse, _ = run(0.2)
    fine, k2 = run(0.1)
    assert fine < 1e-5 and 10.0 < coarse / fine < 20.0, (coarse, fine)
    assert float(np.abs(k2 - np.array([0.3, 0.9])).max()) < 0.1


def test_a_chain_far_from_equilibrium_on_a_million_atoms_takes_smaller_steps() -> None:
    """3M degrees of freedom at 0.45 of the target temperature (a crystal started
    at T relaxes to T/2), tau 100 fs, 2 fs half steps: the fixed one-step
    Suzuki-Yoshida sweep diverges within 10 steps (caught: ValidationError, not
    NaN positions); the chain's sub-steps for its size (5, from its constants
    only, so equal in every run) keep it finite and at the target temperature.
    A small chain takes ``n_loops`` (ASE's trajectory)."""
    kt, fs = 8.617e-5 * 100.0, 0.09822694788464063  # eV; ASE time units per fs
    n_dof = np.array([3.0e6])
    q = np.full((1, 3), kt * (100 * fs) ** 2)
    q[:, 0] *= n_dof

    def run(chain: NoseHooverChain, steps: int) -> np.ndarray:
        k2 = 0.45 * n_dof * kt
        for _ in range(2 * steps):
            k2 = k2 * chain.propagate(k2, 2.0 * fs) ** 2
        return k2 / (n_dof * kt)

    fixed = NoseHooverChain(n_dof, kt, q)
    fixed.sub_steps = lambda dt: 1  # type: ignore[method-assign]
    with pytest.raises(ValidationError, match="Nose-Hoover chain diverged"):
        run(fixed, 10)
    with pytest.raises(ValidationError, match="needs 5 sub-steps per half step"):
        run(NoseHooverChain(n_dof, kt, q, max_loops=4), 1)
    chain = NoseHooverChain(n_dof, kt, q)
    ratio = run(chain, 600)
    assert chain.last_loops == 5 and chain.sub_steps(2.0 * fs) == 5
    assert np.isfinite(ratio).all() and abs(float(ratio[0]) - 1.0) < 0.1, ratio
    small = NoseHooverChain(np.array([300.0]), kt, [[300 * kt * (100 * fs) ** 2, 1.0, 1.0]], 2)
    small.propagate(np.array([300.0 * kt]), 2.0 * fs)
    assert small.last_loops == 2


def test_the_scalar_chain_sweep_follows_the_array_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to ``SCALAR_SYSTEMS`` systems the sweep runs on Python floats: the same
    chain as the NumPy sweep of many systems (to the last bits of ``exp``)."""
    import nvdd.dynamics._nose_hoover as nh

    def run() -> tuple[np.ndarray, np.ndarray]:
        chain = NoseHooverChain(np.array([30.0, 90.0]), 0.01, [[3.0, 0.1, 0.1], [9.0, 0.1, 0.1]])
        chain.p_xi = np.array([[0.3, -0.02, 0.01], [-0.5, 0.03, 0.0]])
        k2 = np.array([0.9, 0.4])
        for _ in range(200):
            k2 = k2 * chain.propagate(k2, 0.1) ** 2
        return k2, np.concatenate([chain.p_xi, chain.xi], 1)

    scalar = run()
    monkeypatch.setattr(nh, "SCALAR_SYSTEMS", 0)
    arrays = run()
    for a, b in zip(scalar, arrays, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


def test_the_device_chain_follows_the_host_chain() -> None:
    """``DeviceNoseHooverChain`` (one Warp launch per half step, what NVT-NH runs)
    integrates the chains of ``NoseHooverChain`` (checked against ASE above):
    systems of 30 to 3M degrees of freedom, far from their temperature, several
    sub-steps; the same factors, link momenta, positions and energies to the
    last bits of ``exp``."""
    from nvdd.dynamics._chain_device import DeviceNoseHooverChain

    n_dof = np.array([30.0, 90.0, 3.0e6, 600.0, 12.0])
    q = np.array(
        [[3.0, 0.1, 0.1], [9.0, 0.1, 0.2], [5.0e4, 0.1, 0.3], [60.0, 1.0, 1.0], [1.2, 0.1, 0.1]]
    )
    host_chain, device_chain = (
        NoseHooverChain(n_dof, 0.01, q),
        DeviceNoseHooverChain(n_dof, 0.01, q),
    )
    p0 = np.array(
        [[0.3, -0.02, 0.01], [-0.5, 0.03, 0.0], [0.1, 0.2, -0.1], [0, 0, 0], [2, -1, 0.5]]
    )
    host_chain.p_xi = p0.copy()
    device_chain.p_xi.copy_(torch.from_numpy(p0))
    k2 = np.array([0.9, 0.4, 2.0e4, 6.0, 0.01])
    device_chain.k2.copy_(torch.from_numpy(k2))
    for _ in range(60):
        scale = host_chain.propagate(k2, 0.7)
        k2 = k2 * scale * scale
        np.testing.assert_allclose(device_chain.propagate_(0.7).numpy(), scale, rtol=1e-12)
    assert host_chain.last_loops == device_chain.last_loops > 1
    np.testing.assert_allclose(device_chain.k2.numpy(), k2, rtol=1e-12)
    np.testing.assert_allclose(device_chain.p_xi.numpy(), host_chain.p_xi, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(device_chain.xi.numpy(), host_chain.xi, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(device_chain.energy(), host_chain.energy(), rtol=1e-10, atol=1e-12)
    # both save the same checkpoint form and load each other's, shapes checked
    saved = host_chain.state("c.")
    for loaded in (
        NoseHooverChain.from_state(device_chain.state("c."), "c.", 0.01, 1),
        DeviceNoseHooverChain.from_state(saved, "c.", 0.01, 1, device="cpu"),
    ):
        for name, value in loaded.state("c.").items():
            np.testing.assert_allclose(value, saved[name], rtol=1e-10, atol=1e-12)
    bad = dict(saved, **{"c.p_xi": saved["c.p_xi"][:, :2]})
    for load in (
        lambda: NoseHooverChain.from_state(bad, "c.", 0.01, 1),
        lambda: DeviceNoseHooverChain.from_state(bad, "c.", 0.01, 1, device="cpu"),
    ):
        with pytest.raises(ConfigurationError, match=r"p_xi has shape \(5, 2\), expected \(5, 3\)"):
            load()


@pytest.mark.parametrize("kind", ["nvt", "npt-full"])
def test_a_new_temperature_restarts_the_chains_at_the_next_step(kind: str) -> None:
    """Annealing: ``temperature_K`` set between steps gives the run of a new
    integrator at that temperature from the same state, bit for bit."""
    first = _make(kind, make_gas())
    first.run(4)
    state = first.batch.clone()
    first.temperature_K = 2.0 * T_K
    first.run(6)
    fresh = _make(kind, state)
    fresh.temperature_K = 2.0 * T_K  # (before its first step: the same as constructed so)
    fresh.run(6)
    assert torch.equal(first.batch.positions, fresh.batch.positions)
    assert torch.equal(first.batch.cell, fresh.batch.cell)
    assert torch.equal(first.conserved_energy(), fresh.conserved_energy())
    chain = first.chain if kind == "nvt" else first.thermostat
    assert chain is not None and chain.kT == pytest.approx(KB_EV_PER_K * 2.0 * T_K)


def test_a_diverged_nvt_chain_raises_naming_the_kinetic_energy() -> None:
    dyn = _nvt(make_gas())
    dyn.run(2)
    assert dyn.chain is not None
    dyn.chain.p_xi[:, 0] = -1.0e300  # (exp overflows in the next half step)
    with pytest.raises(ValidationError, match=r"Nose-Hoover chain diverged.*twice the kinetic"):
        dyn.step()


@pytest.mark.parametrize("kind", ["nvt", "npt-full"])
def test_conserved_energy_drift_is_second_order(kind: str) -> None:
    """Halving the time step divides the extended-energy error by about four."""

    def error(dt_fs: float, steps: int) -> float:
        dyn = _make(kind, make_gas(n=24, triclinic=True, seed=4))
        dyn.dt_fs = dt_fs
        values = []
        for _ in range(steps):
            dyn.step()
            values.append(float(dyn.conserved_energy()[0]))
        return max(values) - min(values)

    coarse, fine = error(2.0, 30), error(1.0, 60)
    assert 2.5 < coarse / fine < 6.0, (coarse, fine)


def test_npt_reports_volume_and_pressure() -> None:
    dyn = _npt(make_gas(n=32), CellDOF.ISOTROPIC)
    with pytest.raises(ValidationError, match="take a step first"):
        dyn.pressure()
    dyn.step()
    b = dyn.batch
    vol = float(torch.linalg.det(b.cell[0]))
    assert float(dyn.volume()[0]) == pytest.approx(vol, rel=1e-14)
    assert dyn.pressure_tensor().shape == (1, 3, 3)
    kin = (b.masses[:, None, None] * b.velocities[:, :, None] * b.velocities[:, None, :]).sum(0)
    want = (torch.trace(kin) / vol - torch.trace(b.stress[0])) / 3.0 / EV_PER_A3_PER_BAR
    assert float(dyn.pressure()[0]) == pytest.approx(float(want), rel=1e-10)
    assert torch.equal(b.stress, SoftPair()(b)["stress"].detach())  # the step's stress is kept


@pytest.mark.parametrize("kind", ["nvt", "npt-iso", "npt-full"])
def test_float32_follows_float64(kind: str) -> None:
    """Global state is float64 on the host whatever the batch's dtype; a float32
    run stays within float32 rounding of the float64 one."""
    runs = []
    for dtype in (torch.float32, torch.float64):
        dyn = _make(kind, make_gas(n=24, triclinic=True, seed=5).to(dtype=dtype))
        dyn.run(10)
        assert dyn.batch.positions.dtype == dtype and dyn.batch.cell.dtype == dtype
        runs.append(dyn.batch.to(dtype=torch.float64))
    assert float((runs[0].positions - runs[1].positions).abs().max()) < 1e-4
    assert float((runs[0].cell - runs[1].cell).abs().max()) < 1e-4


# --------------------------------------------------------------------- input
class _NoStress(SoftPair):
    def forward(self, batch: Batch) -> ModelOutputs:
        out = super().forward(batch)
        out.pop("stress")
        return out


def test_bad_input_raises_clear_errors() -> None:
    with pytest.raises(ConfigurationError, match="temperature_K > 0"):
        NoseHooverNVT(SoftPair(), make_gas(), temperature_K=0.0)
    with pytest.raises(ConfigurationError, match="chain_length"):
        NoseHooverNVT(SoftPair(), make_gas(), temperature_K=10.0, chain_length=0)
    with pytest.raises(ConfigurationError, match="tau_p_fs"):
        MTKNPT(SoftPair(), make_gas(), temperature_K=10.0, tau_p_fs=-1.0)
    with pytest.raises(ConfigurationError, match="pressure_bar must be a number"):
        MTKNPT(SoftPair(), make_gas(), temperature_K=10.0, pressure_bar=float("inf"))
    with pytest.raises(ConfigurationError, match="CellDOF"):
        MTKNPT(SoftPair(), make_gas(), temperature_K=10.0, cell_dof="full")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="p_chain=0"):
        MTKNPT(SoftPair(), make_gas(), temperature_K=10.0, p_chain=0)
    slab = _npt(make_gas(pbc=(True, True, False)), CellDOF.FULL)
    with pytest.raises(ConfigurationError, match="periodic systems"):
        slab.step()
    no_stress = MTKNPT(_NoStress(), make_gas(), temperature_K=10.0)
    with pytest.raises(ValidationError, match="needs the model's 'stress'"):
        no_stress.step()
    with pytest.raises(ValidationError, match="take a step first"):
        _nvt(make_gas()).conserved_energy()
    with pytest.raises(ConfigurationError, match="positive masses"):
        NoseHooverChain(torch.ones(1), 0.1, torch.zeros(1, 2))
    with pytest.raises(ConfigurationError, match="chain masses have shape"):
        NoseHooverChain(torch.ones(2), 0.1, np.ones((1, 2)))


def test_compute_keeps_per_atom_energies_and_the_whole_outputs() -> None:
    dyn = _nvt(make_gas(n=30))
    dyn.ensure_forces()
    e_atom = dyn.batch.atom_extras["atom_energies"]
    assert e_atom.shape == (30,)
    assert float(e_atom.sum()) == pytest.approx(float(dyn.batch.energy[0]), abs=1e-12)
    assert set(dyn.outputs) == {"energy", "forces", "atom_energies", "stress"}


def test_single_process_reducer_passes_known_totals_through() -> None:
    t = torch.arange(4.0)
    summed, totals = Reducer().sum_with_totals(t, ["energy", "virial"], {"energy": t[:1]})
    assert summed is t and set(totals) == {"energy"}


def test_step_sums_are_the_batch_sums() -> None:
    b = make_gas(n=20)
    second = make_gas(n=10, seed=2)
    b = Batch.concatenate([b, second.replace(atom_ids=second.atom_ids + 1000)])
    dyn = BaseDynamics(SoftPair(), b)
    dyn.ensure_forces()
    sums = step_sums(dyn, ("energy", "stress", "virial"))
    assert isinstance(sums, StepSums)
    assert sums.counts.tolist() == [20.0, 10.0]
    v, m = b.velocities, b.masses
    assert float(sums.k2[1]) == pytest.approx(float((m[20:] * (v[20:] ** 2).sum(1)).sum()))
    assert sums.kinetic.shape == (2, 3, 3)
    assert set(sums.totals) == {"energy", "stress"}
    # a thermostat's reduction: the count and the trace only (two columns)
    trace, _ = reduce_step(dyn, (), kinetic="trace")
    assert trace.shape == (2, 2) and trace[:, 0].tolist() == [20.0, 10.0]
    np.testing.assert_allclose(trace[:, 1].numpy(), sums.k2, rtol=1e-14)
    with pytest.raises(ValueError, match="kinetic must be 'tensor' or 'trace', got 'diag'"):
        reduce_step(dyn, (), kinetic="diag")


# -------------------------------------------------------------- under DD (gloo)
def _dd_ensemble(kind: str, steps: int, pressure_bar: float) -> dict[str, Any]:
    batch = make_gas(n=36, triclinic=True, seed=1)
    dyn = _make(kind, batch, pressure_bar)
    conserved: list[float] = []
    with DomainParallel(dyn, DomainConfig(cutoff=2.5, skin=0.4)) as dp:
        dp.partition()
        dp.register_hook(
            HookStage.AFTER_STEP,
            lambda ctx: conserved.append(float(ctx.dynamics.conserved_energy()[0])),
        )
        per_step: list[tuple[int, dict[str, int]]] = []  # (halo rebuilds, collectives)
        for _ in range(steps):
            before = dp.stats.rebuilds
            with _counting() as counts:
                dp.step()
            per_step.append((dp.stats.rebuilds - before, dict(counts)))
        cells = [torch.zeros(3, 3, dtype=torch.float64) for _ in range(dp.world_size)]
        dist.all_gather(cells, dyn.batch.cell[0].contiguous())
        out = dp.gather(0)
        rebuilds = dp.stats.rebuilds
    if out is None:
        return {}
    return {
        "ids": out.atom_ids,
        "pos": out.positions,
        "forces": out.forces,
        "atom_energies": out.atom_extras["atom_energies"],
        "energy": out.energy,
        "stress": out.stress,
        "cells": cells,
        "conserved": conserved,
        "per_step": per_step,
        "rebuilds": rebuilds,
    }


def _counting() -> Any:
    from nvdd.dynamics import count_collectives

    return count_collectives()


@pytest.mark.gloo
@pytest.mark.parametrize(
    ("kind", "pressure_bar"),
    [("nvt", 0.0), ("npt-iso", P_BAR), ("npt-full", 3e4)],
    ids=["nvt", "npt-iso-expands", "npt-full-compresses"],
)
def test_two_ranks_equal_one_rank_by_id(kind: str, pressure_bar: float) -> None:
    steps = 30
    got = run_ranks(_dd_ensemble, 2, kind, steps, pressure_bar)[0]
    ref_dyn = _make(kind, make_gas(n=36, triclinic=True, seed=1), pressure_bar)
    conserved = []
    for _ in range(steps):
        ref_dyn.step()
        conserved.append(float(ref_dyn.conserved_energy()[0]))
    ref = ref_dyn.batch
    assert_same_ids(got["ids"], ref.atom_ids)
    assert all(torch.equal(c, got["cells"][0]) for c in got["cells"])  # bit-identical
    assert float((got["cells"][0] - ref.cell[0]).abs().max()) < 1e-10
    order = ref.atom_ids.argsort()
    frac = torch.linalg.solve(ref.cell[0].T, (got["pos"] - ref.positions[order]).T).T
    assert float(((frac - frac.round()) @ ref.cell[0]).abs().max()) < 1e-8
    assert_close_by_id(got["ids"], got["forces"], ref.atom_ids, ref.forces, atol=1e-10)
    assert_close_by_id(
        got["ids"], got["atom_energies"], ref.atom_ids, ref.atom_extras["atom_energies"], atol=1e-12
    )
    assert float((got["energy"] - ref.energy).abs().max()) < 1e-10
    assert float((got["stress"] - ref.stress).abs().max()) < 1e-12
    assert np.abs(np.array(got["conserved"]) - np.array(conserved)).max() < 1e-9
    # steady state: ghosts out + forces back + the rebuild flag + the ONE step reduction
    # + the agreement after the every-step LOCAL hook (every rank registered it), on
    # every step that rebuilt nothing (the first step also computes the forces at t = 0)
    steady = [(k, c) for k, (rebuilt, c) in enumerate(got["per_step"]) if k > 0 and not rebuilt]
    assert len(steady) >= steps // 2, got["per_step"]
    for k, counts in steady:
        assert counts == {"all_to_all_single": 2, "all_reduce": 3}, (k, counts)
    # the compressed cell eats the skin: the halo is rebuilt along the way
    assert got["rebuilds"] >= (3 if pressure_bar > P_BAR else 1), got["rebuilds"]


def _reducer_oracle(names: list[str]) -> dict[str, Any]:
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    partials = {
        "energy": torch.randn(2, generator=g, dtype=torch.float64),
        "stress": torch.randn(2, 3, 3, generator=g, dtype=torch.float32),
    }
    pending = PendingTotals(None)
    pending.set(partials)
    reducer = MeshReducer(None, totals=pending)
    extra = torch.randn(2, 10, generator=g, dtype=torch.float64)
    pending.materialize(["energy"])  # reduced earlier (for a hook): not sent again
    with _counting() as counts:
        summed, totals = reducer.sum_with_totals(
            extra, ["energy", "stress", "atom_energies"], {"atom_energies": extra[:, 0]}
        )
    return {
        "extra": extra,
        "partials": partials,
        "summed": summed,
        "totals": totals,
        "counts": dict(counts),
        "again": pending.materialize(["stress"])["stress"],
    }


@pytest.mark.gloo
def test_mesh_reducer_packs_totals_with_the_integrator_sums() -> None:
    out = run_ranks(_reducer_oracle, 3, ["energy", "stress"])
    extra = sum(o["extra"] for o in out)
    energy = sum(o["partials"]["energy"] for o in out)
    stress = sum(o["partials"]["stress"].double() for o in out)
    for o in out:
        assert o["counts"] == {"all_reduce": 1}
        torch.testing.assert_close(o["summed"], extra, rtol=0, atol=1e-12)
        torch.testing.assert_close(o["totals"]["energy"], energy, rtol=0, atol=1e-12)
        assert o["totals"]["stress"].dtype == torch.float32
        torch.testing.assert_close(o["totals"]["stress"].double(), stress, rtol=0, atol=1e-5)
        assert torch.equal(o["totals"]["atom_energies"], o["extra"][:, 0])  # known: kept
        assert torch.equal(o["again"], o["totals"]["stress"])  # cached for hooks
    assert all(torch.equal(o["summed"], out[0]["summed"]) for o in out)


def _global_hook_sees_per_atom_energies() -> dict[str, Any]:
    dyn = _nvt(make_gas(n=30, seed=3))
    seen: list[torch.Tensor] = []
    with DomainParallel(dyn, DomainConfig(cutoff=2.5, skin=0.4)) as dp:
        dp.partition()
        dp.register_hook(
            HookStage.AFTER_STEP,
            lambda ctx: seen.append(ctx.batch.atom_extras["atom_energies"].sum()),
            scope=HookScope.RANK_ZERO,
            every=3,
        )
        dp.run(3)
        energy = dyn.batch.energy
    return {"seen": seen, "energy": energy}


@pytest.mark.gloo
def test_hooks_see_the_per_atom_energies_of_the_whole_system() -> None:
    out = run_ranks(_global_hook_sees_per_atom_energies, 2)
    assert len(out[0]["seen"]) == 1 and out[1]["seen"] == []
    assert float(out[0]["seen"][0]) == pytest.approx(float(out[0]["energy"][0]), abs=1e-12)


@pytest.mark.parametrize("kind", ["nvt", "npt-iso", "npt-full"])
def test_state_arrays_restore_the_step_exactly_and_reject_foreign_state(kind: str) -> None:
    """What a checkpoint keeps of a chain integrator (``state_arrays``) makes a
    fresh integrator continue bit for bit; nothing before the first step; a
    state of another integrator is refused by name."""
    first = _make(kind, make_gas())
    assert first.state_arrays() == {}
    first.run(5)
    saved = {k: np.array(v) for k, v in first.state_arrays().items()}
    second = _make(kind, first.batch.clone())
    second.load_state_arrays(saved)
    second._forces_ready = True  # (as load_checkpoint: the saved forces drive the next kick)
    second.outputs = first.outputs
    first.run(5)
    second.run(5)
    assert torch.equal(first.batch.positions, second.batch.positions)
    assert torch.equal(first.conserved_energy(), second.conserved_energy())
    other = _make("npt-iso" if kind == "nvt" else "nvt", make_gas())
    with pytest.raises(ConfigurationError, match=r"NoseHooverNVT|MTKNPT"):
        other.load_state_arrays(saved)
    with pytest.raises(ConfigurationError, match="keeps no array state"):
        BaseDynamics(SoftPair(), make_gas()).load_state_arrays(saved)
