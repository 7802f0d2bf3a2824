"""Nose-Hoover chains: the thermostat (and barostat-thermostat) of NVT and NPT.

The chain equations are those of Martyna, Klein and Tuckerman (J. Chem. Phys. 97,
2635, 1992); the integrator is the time-reversible Trotter factorisation with
Suzuki-Yoshida sub-steps of Tuckerman et al. (J. Phys. A 39, 5629, 2006). Every
system of a batch has its own chain. Chain variables are global (one value per
system, identical on every rank): they are driven only by sums that come out of
the integrator's one reduction per step, so a domain-decomposed run integrates
exactly the chain of the single-process run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from nvdd.core import Batch, ConfigurationError, ModelOutputs, ValidationError
from nvdd.dynamics._base import ASE_TIME_PER_FS, KB_EV_PER_K, BaseDynamics
from nvdd.dynamics._hooks import Hook

if TYPE_CHECKING:
    from nvdd.dynamics._base import Reducer

__all__ = ["NoseHooverChain", "NoseHooverNVT", "StepSums", "step_sums"]

_W = 1.0 / (2.0 - 2.0 ** (1.0 / 3.0))
#: Weights of the fourth-order Suzuki-Yoshida composition (three stages).
SUZUKI_YOSHIDA_4 = (_W, 1.0 - 2.0 * _W, _W)


class NoseHooverChain:
    """One Nose-Hoover chain per system, acting on a set of momenta.

    The first link couples to twice the kinetic energy ``k2`` of the momenta it
    thermostats (``n_dof`` degrees of freedom); link ``j > 1`` couples to the
    kinetic energy of link ``j - 1``. :meth:`propagate` advances the chain and
    returns the factor by which those momenta are scaled.

    Parameters
    ----------
    n_dof:
        float64, shape ``(n_systems,)``: degrees of freedom the chain heats.
    kT:
        Target temperature times Boltzmann's constant (eV).
    masses:
        float64, shape ``(n_systems, length)``: the links' masses (eV * time**2).
    n_loops:
        Sub-steps per call (each a Suzuki-Yoshida composition).

    Attributes
    ----------
    xi, p_xi:
        float64, shape ``(n_systems, length)``: positions and momenta of the links.
    """

    def __init__(self, n_dof: torch.Tensor, kT: float, masses: torch.Tensor, n_loops: int = 1):
        if masses.ndim != 2 or masses.shape[0] != n_dof.shape[0] or masses.shape[1] < 1:
            raise ConfigurationError(
                f"chain masses have shape {tuple(masses.shape)}, expected "
                f"({n_dof.shape[0]}, length >= 1)"
            )
        if not bool((masses > 0).all()) or not kT > 0:
            raise ConfigurationError(
                f"a Nose-Hoover chain needs kT > 0 (got {kT}) and positive masses "
                f"(got {masses.tolist()})"
            )
        if n_loops < 1:
            raise ConfigurationError(f"n_loops must be >= 1, got {n_loops}")
        self.n_dof = n_dof.to(torch.float64)
        self.kT = float(kT)
        self.masses = masses.to(torch.float64)
        self.n_loops = int(n_loops)
        self.xi = torch.zeros_like(self.masses)
        self.p_xi = torch.zeros_like(self.masses)

    @property
    def length(self) -> int:
        """Links per chain."""
        return int(self.masses.shape[1])

    def energy(self) -> torch.Tensor:
        """The chain's share of the conserved energy, float64 shape ``(n_systems,)``:
        ``sum p**2 / 2Q + n_dof kT xi_1 + kT sum_{j>1} xi_j``."""
        kinetic = (0.5 * self.p_xi * self.p_xi / self.masses).sum(dim=1)
        return kinetic + self.n_dof * self.kT * self.xi[:, 0] + self.kT * self.xi[:, 1:].sum(dim=1)

    def propagate(self, k2: torch.Tensor, dt: float) -> torch.Tensor:
        """Advance the chains by ``dt`` (ASE time units) against momenta whose twice
        kinetic energy is ``k2`` (float64, shape ``(n_systems,)``).

        Returns
        -------
        torch.Tensor
            float64, shape ``(n_systems,)``: multiply the momenta by it (their
            ``k2`` becomes ``k2 * factor**2``).
        """
        k2 = k2.to(torch.float64).clone()
        scale = torch.ones_like(k2)
        for _ in range(self.n_loops):
            for w in SUZUKI_YOSHIDA_4:
                factor = self._substep(k2, w * dt / self.n_loops)
                scale = scale * factor
                k2 = k2 * factor * factor
        return scale

    def _force(self, j: int, k2: torch.Tensor) -> torch.Tensor:
        if j == 0:
            return k2 - self.n_dof * self.kT
        prev = self.p_xi[:, j - 1]
        return prev * prev / self.masses[:, j - 1] - self.kT

    def _kick(self, j: int, k2: torch.Tensor, d: float) -> None:
        p = self.p_xi
        damp = None
        if j + 1 < self.length:
            damp = torch.exp(-0.25 * d * p[:, j + 1] / self.masses[:, j + 1])
            p[:, j] = p[:, j] * damp
        p[:, j] = p[:, j] + 0.5 * d * self._force(j, k2)
        if damp is not None:
            p[:, j] = p[:, j] * damp

    def _substep(self, k2: torch.Tensor, d: float) -> torch.Tensor:
        for j in reversed(range(self.length)):
            self._kick(j, k2, d)
        self.xi = self.xi + d * self.p_xi / self.masses
        factor = torch.exp(-d * self.p_xi[:, 0] / self.masses[:, 0])
        k2_new = k2 * factor * factor
        for j in range(self.length):
            self._kick(j, k2_new, d)
        return factor


class StepSums:
    """What an integrator's one reduction per step returns (global, per system).

    Attributes
    ----------
    counts:
        float64 ``(n_systems,)``: atoms per system.
    kinetic:
        float64 ``(n_systems, 3, 3)``: ``sum m v (x) v`` (twice the kinetic tensor).
    totals:
        The model's per-system totals asked for (``energy``, ``stress``) that exist.
    """

    def __init__(
        self, counts: torch.Tensor, kinetic: torch.Tensor, totals: dict[str, torch.Tensor]
    ) -> None:
        self.counts, self.kinetic, self.totals = counts, kinetic, totals

    @property
    def k2(self) -> torch.Tensor:
        """Twice the kinetic energy per system, float64 ``(n_systems,)``."""
        return self.kinetic.diagonal(dim1=1, dim2=2).sum(dim=1)


def step_sums(dyn: BaseDynamics, names: Iterable[str]) -> StepSums:
    """Atom counts, ``sum m v (x) v`` and the model totals ``names``, per system.

    One call of ``dyn.reducer.sum_with_totals``: under DD **Collective** over the
    mesh (one all-reduce that also completes the pending per-system partials).
    """
    b = dyn.batch
    n_sys = b.n_systems
    v = b.velocities.to(torch.float64)
    per_atom = b.masses.to(torch.float64)[:, None, None] * v[:, :, None] * v[:, None, :]
    local = torch.zeros(n_sys, 10, dtype=torch.float64, device=b.device)
    rows = torch.cat(
        [torch.ones(b.n_atoms, 1, dtype=torch.float64, device=b.device), per_atom.reshape(-1, 9)], 1
    )
    local = local.index_add(0, b.system_index, rows)
    reducer: Reducer = dyn.reducer
    summed, totals = reducer.sum_with_totals(local, names, dyn.outputs)
    summed = summed.to(torch.float64)
    return StepSums(summed[:, 0], summed[:, 1:].reshape(n_sys, 3, 3), totals)


def per_atom(values: torch.Tensor, batch: Batch) -> torch.Tensor:
    """A per-system factor ``(n_systems,)`` as a per-atom column ``(n_atoms, 1)``,
    in the batch's dtype."""
    return values.to(batch.dtype).index_select(0, batch.system_index)[:, None]


class NoseHooverNVT(BaseDynamics):
    """Canonical (NVT) dynamics with a Nose-Hoover chain thermostat per system.

    One step: chain (dt/2), half kick, drift | forces | half kick, chain (dt/2).
    Degrees of freedom ``3 N`` per system (as ASE). The only global quantities,
    the atom count and kinetic energy, come from one reduction per step (plus one
    at the first step), which also completes the energy for
    :meth:`conserved_energy`.

    Parameters
    ----------
    temperature_K:
        Target temperature, > 0.
    tau_fs:
        Thermostat time scale (fs); default ``100 * dt_fs``.
    chain_length:
        Links per chain (>= 1; default 3).
    n_loops:
        Thermostat sub-steps per half step (default 1).
    """

    def __init__(
        self,
        model: Callable[[Batch], ModelOutputs],
        batch: Batch,
        *,
        dt_fs: float = 1.0,
        temperature_K: float,
        tau_fs: float | None = None,
        chain_length: int = 3,
        n_loops: int = 1,
        hooks: Iterable[Hook] = (),
    ) -> None:
        super().__init__(model, batch, dt_fs=dt_fs, hooks=hooks)
        tau = 100.0 * dt_fs if tau_fs is None else tau_fs
        if not temperature_K > 0 or not tau > 0:
            raise ConfigurationError(
                f"NoseHooverNVT needs temperature_K > 0 and tau_fs > 0, got {temperature_K!r} "
                f"and {tau_fs!r}"
            )
        if chain_length < 1 or n_loops < 1:
            raise ConfigurationError(
                f"chain_length and n_loops must be >= 1, got {chain_length} and {n_loops}"
            )
        self.temperature_K = float(temperature_K)
        self.tau_fs = float(tau)
        self.chain_length, self.n_loops = int(chain_length), int(n_loops)
        self.chain: NoseHooverChain | None = None
        self._k2: torch.Tensor | None = None
        self._energy: torch.Tensor | None = None

    @property
    def kT(self) -> float:
        """Target ``k_B T`` in eV."""
        return KB_EV_PER_K * self.temperature_K

    def _reduce(self) -> StepSums:
        sums = step_sums(self, ("energy",))
        self._energy = sums.totals.get("energy")
        if self._energy is not None:
            self.batch = self.batch.replace(energy=self._energy.to(self.batch.dtype))
        return sums

    def _start(self) -> torch.Tensor:
        sums = self._reduce()
        if not bool((sums.counts > 0).all()):
            raise ValidationError(f"every system needs atoms; counts are {sums.counts.tolist()}")
        n_dof = 3.0 * sums.counts
        tau = self.tau_fs * ASE_TIME_PER_FS
        q = torch.full(
            (n_dof.shape[0], self.chain_length),
            self.kT * tau * tau,
            dtype=torch.float64,
            device=n_dof.device,
        )
        q[:, 0] = q[:, 0] * n_dof
        self.chain = NoseHooverChain(n_dof, self.kT, q, self.n_loops)
        return sums.k2

    def _thermostat(self, k2: torch.Tensor) -> None:
        assert self.chain is not None
        scale = self.chain.propagate(k2, 0.5 * self.dt)
        self._k2 = k2 * scale * scale
        b = self.batch
        self.batch = b.replace(velocities=b.velocities * per_atom(scale, b))

    def pre_update(self) -> None:
        k2 = self._start() if self._k2 is None else self._k2
        self._thermostat(k2)
        b = self.batch
        v = b.velocities + 0.5 * self.dt * b.forces / b.masses[:, None]
        self.batch = b.replace(velocities=v, positions=b.positions + self.dt * v)

    def post_update(self) -> None:
        b = self.batch
        self.batch = b.replace(
            velocities=b.velocities + 0.5 * self.dt * b.forces / b.masses[:, None]
        )
        self._thermostat(self._reduce().k2)

    def conserved_energy(self) -> torch.Tensor:
        """The extended energy ``E_pot + E_kin + chain`` per system (float64), which
        the dynamics conserves; no communication (uses the last step's sums).

        Raises
        ------
        ValidationError
            Before the first step, or if the model returns no energy.
        """
        if self.chain is None or self._k2 is None:
            raise ValidationError("conserved_energy: take a step first")
        if self._energy is None:
            raise ValidationError(
                f"conserved_energy: {type(self.model).__name__} returns no 'energy'"
            )
        return self._energy.to(torch.float64) + 0.5 * self._k2 + self.chain.energy()
