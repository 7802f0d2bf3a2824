"""Integrators: velocity-Verlet NVE, Langevin NVT (BAOAB), FIRE."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

import torch

from nvdd.core import (
    Batch,
    CaptureError,
    ConfigurationError,
    ModelOutputs,
    capturing,
    sum_by_system,
)
from nvdd.dynamics._base import ASE_TIME_PER_FS, KB_EV_PER_K, BaseDynamics
from nvdd.dynamics._hooks import Hook
from nvdd.dynamics._rng import atom_normal

__all__ = ["FIRE", "Langevin", "VelocityVerlet", "kinetic_energy", "temperature"]


def kinetic_energy(batch: Batch, reducer: Any = None) -> torch.Tensor:
    """Per-system kinetic energy (eV), shape ``(n_systems,)``; summed over ranks by
    ``reducer`` when given (a **Collective** under DD)."""
    per_atom = 0.5 * batch.masses * (batch.velocities * batch.velocities).sum(dim=1)
    ke = sum_by_system(per_atom, batch.system_index, batch.n_systems)
    return reducer.sum(ke) if reducer is not None else ke


def temperature(batch: Batch, reducer: Any = None) -> torch.Tensor:
    """Per-system instantaneous temperature (K) with 3N degrees of freedom."""
    n = torch.bincount(batch.system_index, minlength=batch.n_systems).to(batch.dtype)
    if reducer is not None:
        n = reducer.sum(n)
    return 2.0 * kinetic_energy(batch, reducer) / (3.0 * n.clamp(min=1) * KB_EV_PER_K)


def _accel(batch: Batch) -> torch.Tensor:
    return batch.forces / batch.masses[:, None]


class VelocityVerlet(BaseDynamics):
    """Velocity-Verlet NVE: half kick, drift | forces | half kick.

    The updates are in place (three fused element-wise kernels per step, no
    temporaries): the integrator's positions and velocities are its own copies
    (see :class:`BaseDynamics`), so a caller's batch is never modified, but a
    hook that keeps ``ctx.batch.positions`` beyond the call must clone it.
    """

    def graph_key(self) -> Hashable | None:
        """Its steps may be captured (in-place updates, no host decision); the
        time step is baked in."""
        return ("velocity-verlet", self.dt_fs)

    def pre_update(self) -> None:
        """Half kick then drift, in place: ``v += F/m dt/2``, ``x += v dt``."""
        b = self.batch
        b.velocities.addcdiv_(b.forces, b.masses.unsqueeze(1), value=0.5 * self.dt)
        b.positions.add_(b.velocities, alpha=self.dt)

    def post_update(self) -> None:
        """The second half kick with the new forces, in place: ``v += F/m dt/2``."""
        b = self.batch
        b.velocities.addcdiv_(b.forces, b.masses.unsqueeze(1), value=0.5 * self.dt)


class Langevin(BaseDynamics):
    """Langevin NVT with the BAOAB splitting (B A O A | forces | B).

    The noise of every atom is a function of ``(seed, step, atom id)`` only, so a
    domain-decomposed run draws exactly the noise of the single-process run.

    Parameters
    ----------
    temperature_K:
        Bath temperature.
    friction_per_fs:
        Friction coefficient gamma, 1/fs.
    seed:
        Noise seed.
    """

    def __init__(
        self,
        model: Callable[[Batch], ModelOutputs],
        batch: Batch,
        *,
        dt_fs: float = 1.0,
        temperature_K: float,
        friction_per_fs: float = 0.01,
        seed: int = 0,
        hooks: Iterable[Hook] = (),
        cuda_graphs: bool | None = None,
    ) -> None:
        super().__init__(model, batch, dt_fs=dt_fs, hooks=hooks, cuda_graphs=cuda_graphs)
        if not temperature_K >= 0:
            raise ConfigurationError(f"temperature_K must be >= 0, got {temperature_K!r}")
        if not friction_per_fs >= 0:
            raise ConfigurationError(f"friction_per_fs must be >= 0, got {friction_per_fs!r}")
        self.temperature_K = float(temperature_K)
        self.friction_per_fs = float(friction_per_fs)
        self.seed = int(seed)
        self._step_on_device: torch.Tensor | None = None
        self._coefficients: tuple[tuple[float, float], float, float] | None = None

    def graph_key(self) -> Hashable | None:
        """Its steps may be captured: the noise reads the step number from a
        device counter that the captured step advances; the time step, bath and
        seed are baked in."""
        return ("langevin", self.dt_fs, self.temperature_K, self.friction_per_fs, self.seed)

    def _ou_coefficients(self) -> tuple[float, float]:
        """``exp(-gamma dt)`` and ``sqrt(1 - c1**2)``, computed once per
        ``(gamma, dt)`` on the host (so a captured step holds no host tensor op)."""
        key = (self.friction_per_fs, self.dt_fs)
        cached = self._coefficients
        if cached is None or cached[0] != key:
            c1 = torch.exp(torch.tensor(-key[0] * key[1], dtype=torch.float64))
            cached = (key, float(c1), float(torch.sqrt(1.0 - c1 * c1)))
            self._coefficients = cached
        return cached[1], cached[2]

    def _noise_step(self, device: torch.device) -> torch.Tensor:
        """The step number as an int64 device tensor (the noise's counter)."""
        counter = self._step_on_device
        if counter is None or counter.device != device:
            if capturing():
                raise CaptureError("Langevin: the noise counter must exist before a capture")
            counter = torch.zeros((), dtype=torch.int64, device=device)
            self._step_on_device = counter
        if not capturing():  # eager: the host's count (a replay finds it advanced)
            counter.fill_(self.step_count)
        return counter

    def pre_update(self) -> None:
        """B A O A: half kick, half drift, the Ornstein-Uhlenbeck velocity update
        with this step's per-atom noise, half drift."""
        b = self.batch
        half = 0.5 * self.dt
        v = b.velocities + half * _accel(b)
        x = b.positions + half * v
        c1, c2 = self._ou_coefficients()
        sigma = torch.sqrt(KB_EV_PER_K * self.temperature_K / b.masses)[:, None]
        step = self._noise_step(b.device)
        noise = atom_normal(self.seed, step, b.atom_ids, dtype=b.dtype)
        step.add_(1)  # the next step's count: what a capture of the next step reads
        v = c1 * v + c2 * sigma * noise
        x = x + half * v
        self.batch = b.replace(velocities=v, positions=x)

    def post_update(self) -> None:
        """The final B: a half kick with the new forces."""
        b = self.batch
        self.batch = b.replace(velocities=b.velocities + 0.5 * self.dt * _accel(b))


class FIRE(BaseDynamics):
    """FIRE minimiser (Bitzek et al. 2006) with mesh-wide power and norms.

    Converged when the largest force component norm over all atoms is below
    ``fmax`` (eV/Angstrom). Global sums go through ``self.reducer``, so a
    decomposed run takes the same steps as the single-process one.

    The adaptive state (time step, mixing ``alpha``, the count of steps with
    positive power) lives on the atoms' device and is updated there, with the
    velocities and positions in place: a step makes no host decision, so its
    steady steps may be captured in a CUDA graph like an MD integrator's. The
    one host read per step is the convergence test after it. ``dt_fs``,
    ``alpha`` and ``n_positive`` read (and set) that state, so each read waits
    for the device: read them between runs, not per step.
    """

    def __init__(
        self,
        model: Callable[[Batch], ModelOutputs],
        batch: Batch,
        *,
        dt_fs: float = 1.0,
        dt_max_fs: float = 10.0,
        fmax: float = 0.05,
        n_min: int = 5,
        f_inc: float = 1.1,
        f_dec: float = 0.5,
        alpha_start: float = 0.1,
        f_alpha: float = 0.99,
        hooks: Iterable[Hook] = (),
        cuda_graphs: bool | None = None,
    ) -> None:
        super().__init__(model, batch, dt_fs=dt_fs, hooks=hooks, cuda_graphs=cuda_graphs)
        if not (fmax > 0 and dt_max_fs >= dt_fs and 0 < f_dec < 1 < f_inc and 0 < alpha_start < 1):
            raise ConfigurationError(
                f"FIRE: need fmax > 0 (got {fmax}), dt_max_fs >= dt_fs ({dt_max_fs} vs {dt_fs}), "
                f"0 < f_dec < 1 < f_inc ({f_dec}, {f_inc}), 0 < alpha_start < 1 ({alpha_start})"
            )
        self.fmax, self.dt_max_fs, self.n_min = float(fmax), float(dt_max_fs), int(n_min)
        self.f_inc, self.f_dec = float(f_inc), float(f_dec)
        self.alpha_start, self.f_alpha = float(alpha_start), float(f_alpha)
        self.alpha = self.alpha_start
        self.n_positive = 0

    # ------------------------------------------------ the state on the device
    def _adaptive(self) -> torch.Tensor:
        """float64 ``[dt_fs, alpha, n_positive]`` on the atoms' device (made, zero,
        at the first use, which is the base class setting ``dt_fs``; moved when
        the atoms moved, which changes :meth:`graph_key`)."""
        state: torch.Tensor | None = self.__dict__.get("_fire_state")
        device = self.batch.device
        if state is None:
            state = torch.zeros(3, dtype=torch.float64, device=device)
            self.__dict__["_fire_state"] = state
        elif state.device != device:
            state = state.to(device)
            self.__dict__["_fire_state"] = state
        return state

    def _get(self, k: int) -> float:
        return float(self._adaptive()[k])

    def _set(self, k: int, value: float) -> None:
        self._adaptive()[k] = float(value)

    @property
    def dt_fs(self) -> float:
        """The current (adaptive) time step in fs (a host read)."""
        return self._get(0)

    @dt_fs.setter
    def dt_fs(self, value: float) -> None:
        self._set(0, value)

    @property
    def alpha(self) -> float:
        """The current velocity-mixing coefficient (a host read)."""
        return self._get(1)

    @alpha.setter
    def alpha(self, value: float) -> None:
        self._set(1, value)

    @property
    def n_positive(self) -> int:
        """Steps in a row with positive power (a host read)."""
        return round(self._get(2))

    @n_positive.setter
    def n_positive(self, value: int) -> None:
        self._set(2, int(value))

    def state_arrays(self) -> dict[str, Any]:
        """``fire``: ``[dt_fs, alpha, n_positive]`` (what a restart restores)."""
        return {"fire": self._adaptive().cpu().numpy()}

    def load_state_arrays(self, arrays: Mapping[str, Any]) -> None:
        """Restore ``fire`` (``[dt_fs, alpha, n_positive]``) from :meth:`state_arrays`;
        other names go to the base class, which refuses them."""
        rest = {k: v for k, v in arrays.items() if k != "fire"}
        super().load_state_arrays(rest)
        if "fire" in arrays:
            values = torch.as_tensor(arrays["fire"], dtype=torch.float64).reshape(3)
            self._adaptive().copy_(values)

    def graph_key(self) -> Hashable | None:
        """Its steps may be captured: the adaptive state is read and written on
        the device (at a fixed address); the parameters are baked in."""
        params = (self.dt_max_fs, self.n_min, self.f_inc, self.f_dec, self.alpha_start)
        return ("fire", *params, self.f_alpha, self._adaptive().data_ptr())

    # ------------------------------------------------------------ the step
    def pre_update(self) -> None:
        """The FIRE update, on the device and in place: mix velocities towards the
        forces (zero them uphill), adapt ``dt_fs`` and ``alpha``, then a kick and a
        drift. The power and norms are mesh-wide sums (a **Collective** under DD)."""
        b = self.batch
        f, v = b.forces, b.velocities
        state = self._adaptive()
        sums = self.reducer.sum(
            torch.stack([(f * v).sum(), (f * f).sum(), (v * v).sum()]).to(torch.float64)
        )
        power, f2, v2 = sums.unbind()
        dt_fs, alpha, n_positive = state.unbind()
        uphill = ~(power > 0)  # (NaN power stops too)
        mixing = ~uphill & (f2 > 0)
        # v <- (1 - a) v + a |v| F / |F| downhill, v unchanged without a force, 0 uphill
        keep = torch.where(mixing, 1.0 - alpha, torch.where(uphill, 0.0, 1.0))
        push = torch.where(mixing, alpha * v2.sqrt() / torch.where(mixing, f2, 1.0).sqrt(), 0.0)
        v.mul_(keep.to(v.dtype)).add_(f * push.to(v.dtype))
        grow = ~uphill & (n_positive > self.n_min)
        new_dt = torch.where(grow, (dt_fs * self.f_inc).clamp(max=self.dt_max_fs), dt_fs)
        new_alpha = torch.where(grow, alpha * self.f_alpha, alpha)
        state.copy_(
            torch.stack(
                [
                    torch.where(uphill, dt_fs * self.f_dec, new_dt),
                    torch.where(uphill, self.alpha_start, new_alpha),
                    torch.where(uphill, 0.0, n_positive + 1.0),
                ]
            )
        )
        dt = (state[0] * ASE_TIME_PER_FS).to(v.dtype)
        v.add_(_accel(b) * dt)
        b.positions.add_(v * dt)

    def post_update(self) -> None:
        """Nothing: the whole FIRE step happens in :meth:`pre_update`."""

    def max_force(self) -> float:
        """Largest per-atom force norm over all atoms (a **Collective** under DD)."""
        f = self.batch.forces
        local = (
            f.norm(dim=1).max() if f.shape[0] else torch.zeros((), dtype=f.dtype, device=f.device)
        )
        return float(self.reducer.max(local.reshape(1).to(torch.float64))[0])

    def is_converged(self) -> bool:
        """True when :meth:`max_force` is below ``fmax`` (a **Collective** under DD)."""
        return self.max_force() < self.fmax
