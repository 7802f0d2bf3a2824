"""Single-process integrators, hooks and the per-atom-id noise."""

from __future__ import annotations

import math

import pytest
import torch

from nvdd.core import Batch, ConfigurationError, ModelOutputs
from nvdd.dynamics import (
    FIRE,
    BaseDynamics,
    HookScope,
    HookStage,
    Langevin,
    VelocityVerlet,
    atom_normal,
    kinetic_energy,
    temperature,
)


class Harmonic:
    """E = k/2 sum |x - x0|^2 per atom (independent oscillators); counts calls."""

    def __init__(self, x0: torch.Tensor, k: float = 2.0) -> None:
        self.x0, self.k, self.calls = x0, k, 0
        self.seen_positions: list[torch.Tensor] = []

    def __call__(self, batch: Batch) -> ModelOutputs:
        self.calls += 1
        self.seen_positions.append(batch.positions.clone())
        d = batch.positions - self.x0[batch.atom_ids]
        e_atom = 0.5 * self.k * (d * d).sum(dim=1)
        energy = torch.zeros(batch.n_systems, dtype=batch.dtype).index_add(
            0, batch.system_index, e_atom
        )
        return {"energy": energy, "forces": -self.k * d}


def _batch(n: int = 8, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch(
        positions=torch.rand(n, 3, generator=g, dtype=torch.float64) * 5,
        atomic_numbers=torch.full((n,), 18),
        velocities=torch.randn(n, 3, generator=g, dtype=torch.float64) * 0.01,
        cell=torch.eye(3, dtype=torch.float64) * 10,
        pbc=[True, True, True],
    )


def _total_energy(dyn: BaseDynamics) -> float:
    return float(dyn.batch.energy.sum() + kinetic_energy(dyn.batch).sum())


def test_forces_at_t0_are_computed_before_the_first_half_kick() -> None:
    b = _batch()
    model = Harmonic(b.positions.clone() + 0.3)
    dyn = VelocityVerlet(model, b, dt_fs=1.0)
    dyn.step()
    assert model.calls == 2
    torch.testing.assert_close(model.seen_positions[0], b.positions, rtol=0, atol=0)
    # the first half kick used F(x0), so v(dt/2) = v0 + dt/2 F(x0)/m
    f0 = -model.k * (b.positions - model.x0)
    v_half = b.velocities + 0.5 * dyn.dt * f0 / b.masses[:, None]
    torch.testing.assert_close(model.seen_positions[1], b.positions + dyn.dt * v_half)


def test_velocity_verlet_conserves_energy_and_matches_the_analytic_oscillator() -> None:
    b = _batch()
    model = Harmonic(b.positions.clone() + 0.2)
    dyn = VelocityVerlet(model, b, dt_fs=1.0)
    dyn.ensure_forces()
    e0 = _total_energy(dyn)
    dyn.run(500)
    assert abs(_total_energy(dyn) - e0) < 5e-4 * abs(e0)  # O((w dt)^2) fluctuation
    # analytic solution of one oscillator: x(t) = x0 + A cos(w t) + v0/w sin(w t)
    w = torch.sqrt(model.k / b.masses)[:, None]
    t = 500 * dyn.dt
    d0 = b.positions - model.x0
    exact = model.x0 + d0 * torch.cos(w * t) + b.velocities / w * torch.sin(w * t)
    assert float((dyn.batch.positions - exact).abs().max()) < 1e-3


def test_hooks_fire_at_every_stage_with_their_frequency() -> None:
    b = _batch()
    dyn = VelocityVerlet(Harmonic(b.positions.clone()), b)
    seen: list[tuple[str, int]] = []
    for stage in HookStage:
        dyn.register_hook(
            stage,
            lambda ctx: seen.append((ctx.stage.value, ctx.step)),
            every=2 if stage is HookStage.AFTER_STEP else 1,
        )
    dyn.run(3)
    stages = [s for s, _ in seen]
    order = [s.value for s in HookStage if s is not HookStage.ON_CONVERGE]
    assert stages[:7] == order[:7]  # step 0: every stage but AFTER_STEP (1 % 2 != 0)
    assert (
        ("after_step", 2) in seen
        and ("after_step", 1) not in seen
        and ("after_step", 3) not in seen
    )
    assert stages.count("before_step") == 3 and "on_converge" not in stages


def test_hook_validation_and_scope_needs() -> None:
    b = _batch()
    dyn = VelocityVerlet(Harmonic(b.positions.clone()), b)
    with pytest.raises(ConfigurationError, match="needs accepts"):
        dyn.register_hook(HookStage.AFTER_STEP, lambda ctx: None, needs=["dipole"])
    with pytest.raises(ConfigurationError, match="every must be an integer >= 1"):
        dyn.register_hook(HookStage.AFTER_STEP, lambda ctx: None, every=0)
    h = dyn.register_hook(HookStage.BEFORE_STEP, lambda ctx: None, scope=HookScope.GLOBAL)
    assert h.needs == {"energy", "stress"}
    local = dyn.register_hook(HookStage.BEFORE_STEP, lambda ctx: None, needs=["energy"])
    assert local.needs == {"energy"}
    dyn.remove_hook(h)
    assert h not in dyn.hooks and local in dyn.hooks


def test_atom_noise_depends_only_on_seed_step_and_id() -> None:
    ids = torch.tensor([5, 17, 3, 2**40 + 7])
    a = atom_normal(1, 10, ids, dtype=torch.float64)
    b = atom_normal(1, 10, ids.flip(0), dtype=torch.float64).flip(0)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(a, atom_normal(1, 11, ids, dtype=torch.float64))
    assert not torch.equal(a, atom_normal(2, 10, ids, dtype=torch.float64))
    big = atom_normal(3, 0, torch.arange(20000), dtype=torch.float64)
    assert abs(float(big.mean())) < 0.03 and abs(float(big.std()) - 1.0) < 0.03


def test_langevin_thermalises_to_the_bath_temperature() -> None:
    n = 64
    b = _batch(n=n)
    b = b.replace(velocities=torch.zeros(n, 3, dtype=torch.float64))
    dyn = Langevin(
        Harmonic(b.positions.clone(), k=1.0),
        b,
        dt_fs=2.0,
        temperature_K=300.0,
        friction_per_fs=0.05,
        seed=7,
    )
    temps = []
    dyn.register_hook(
        HookStage.AFTER_STEP, lambda ctx: temps.append(float(temperature(ctx.batch)[0]))
    )
    dyn.run(1500)
    mean_t = sum(temps[500:]) / len(temps[500:])
    assert abs(mean_t - 300.0) < 30.0, mean_t
    with pytest.raises(ConfigurationError, match="temperature_K must be >= 0"):
        Langevin(dyn.model, b, temperature_K=-1.0)


def test_fire_converges_to_the_minimum() -> None:
    b = _batch()
    model = Harmonic(b.positions.clone() + 0.5, k=5.0)
    dyn = FIRE(model, b, dt_fs=1.0, fmax=1e-4)
    converged_at: list[int] = []
    dyn.register_hook(HookStage.ON_CONVERGE, lambda ctx: converged_at.append(ctx.step))
    assert dyn.run(2000)
    assert converged_at == [dyn.step_count]
    assert float((dyn.batch.positions - model.x0).abs().max()) < 1e-4
    with pytest.raises(ConfigurationError, match="FIRE: need fmax > 0"):
        FIRE(model, b, fmax=0.0)


def test_fire_takes_no_step_from_a_converged_structure() -> None:
    """Convergence is tested before the first step (as ASE): at the minimum,
    with velocities and forces at the rounding level, FIRE does not move the
    atoms along the noise direction of ``F / |F|``; it fires ``ON_CONVERGE``
    once and returns True. A second ``run`` does the same."""
    b = _batch()
    model = Harmonic(b.positions.clone() + 1e-15)  # forces of 2e-15 eV/A: noise
    dyn = FIRE(model, b, dt_fs=1.0, fmax=1e-4)
    seen: list[int] = []
    dyn.register_hook(HookStage.ON_CONVERGE, lambda ctx: seen.append(ctx.step))
    assert dyn.run(50) and dyn.converged
    assert dyn.step_count == 0 and seen == [0] and model.calls == 1
    assert torch.equal(dyn.batch.positions, b.positions)
    assert dyn.run(50) and dyn.step_count == 0 and seen == [0, 0]
    moving = VelocityVerlet(Harmonic(b.positions.clone()), b)  # MD never converges
    assert not moving.run(3) and moving.step_count == 3


def test_base_dynamics_validation() -> None:
    b = _batch()
    with pytest.raises(ConfigurationError, match="dt_fs must be positive"):
        VelocityVerlet(Harmonic(b.positions), b, dt_fs=0.0)
    with pytest.raises(NotImplementedError, match="must implement pre_update"):
        BaseDynamics(Harmonic(b.positions), b).step()
    assert math.isclose(
        VelocityVerlet(Harmonic(b.positions), b, dt_fs=2.0).dt, 2 * 0.09822694788464063
    )


@pytest.mark.parametrize("cls", [VelocityVerlet, FIRE])
def test_the_callers_batch_is_never_modified(cls: type[BaseDynamics]) -> None:
    """Integrators update their own copies in place (issue 13): the batch a caller
    passed in keeps its values."""
    b = _batch()
    before = (b.positions.clone(), b.velocities.clone())
    dyn = cls(Harmonic(b.positions.clone() + 0.3), b, dt_fs=1.0)
    dyn.run(5)
    assert not torch.equal(dyn.batch.positions, before[0])
    assert torch.equal(b.positions, before[0])
    assert torch.equal(b.velocities, before[1])


def test_velocity_verlet_in_place_equals_the_textbook_update() -> None:
    b = _batch()
    model = Harmonic(b.positions.clone() + 0.3)
    dyn = VelocityVerlet(model, b, dt_fs=2.0)
    dyn.run(3)
    x, v = b.positions.clone(), b.velocities.clone()
    m = b.masses[:, None]
    dt = dyn.dt
    f = model(b.replace(positions=x))["forces"]
    for _ in range(3):
        v = v + 0.5 * dt * f / m
        x = x + dt * v
        f = model(b.replace(positions=x))["forces"]
        v = v + 0.5 * dt * f / m
    torch.testing.assert_close(dyn.batch.positions, x, rtol=0, atol=1e-14)
    torch.testing.assert_close(dyn.batch.velocities, v, rtol=0, atol=1e-14)
