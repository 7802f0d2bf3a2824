"""Nose-Hoover chains: the thermostat (and barostat-thermostat) of NVT and NPT.

The chain equations are those of Martyna, Klein and Tuckerman (J. Chem. Phys. 97,
2635, 1992); the integrator is the time-reversible Trotter factorisation with
Suzuki-Yoshida sub-steps of Tuckerman et al. (J. Phys. A 39, 5629, 2006). Every
system of a batch has its own chain. Chain variables are global (one value per
system, identical on every rank): they are driven only by sums that come out of
the integrator's one reduction per step, so a domain-decomposed run integrates
exactly the chain of the single-process run.

Global state lives on the host in float64 NumPy arrays: a chain sweep is a few
hundred operations on arrays of a few numbers, which cost microseconds on the
host but a kernel launch each on a GPU. The step's one reduction is copied to
the host once (one synchronisation per step); per-atom work stays on the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from nvdd.core import Batch, ConfigurationError, ModelOutputs, ValidationError
from nvdd.dynamics._base import ASE_TIME_PER_FS, KB_EV_PER_K, BaseDynamics
from nvdd.dynamics._hooks import Hook

if TYPE_CHECKING:
    from nvdd.dynamics._base import Reducer

__all__ = ["NoseHooverChain", "NoseHooverNVT", "StepSums", "step_sums"]

Array = npt.NDArray[np.float64]

_W = 1.0 / (2.0 - 2.0 ** (1.0 / 3.0))
#: Weights of the fourth-order Suzuki-Yoshida composition (three stages).
SUZUKI_YOSHIDA_4 = (_W, 1.0 - 2.0 * _W, _W)
#: The largest ``|weight| * sub-step * rate`` a chain sub-step may take, ``rate``
#: being the scale of the chain's rates, ``n_dof**(1/3) / tau``
#: (:meth:`NoseHooverChain.sub_steps`); above it the half step is split further.
CHAIN_STEP_LIMIT = 1.0
#: Default bound on the sub-steps of one chain half step.
MAX_CHAIN_LOOPS = 4096
#: Up to this many systems a chain sweep runs on Python floats, system by system.
SCALAR_SYSTEMS = 4


def host(x: Any) -> Array:
    """``x`` (a tensor on any device, an array or numbers) as a float64 host array."""
    if isinstance(x, torch.Tensor):
        return np.asarray(x.detach().to(device="cpu", dtype=torch.float64).numpy())
    return np.asarray(x, dtype=np.float64)


class NoseHooverChain:
    """One Nose-Hoover chain per system, acting on a set of momenta.

    The first link couples to twice the kinetic energy ``k2`` of the momenta it
    thermostats (``n_dof`` degrees of freedom); link ``j > 1`` couples to the
    kinetic energy of link ``j - 1``. :meth:`propagate` advances the chain and
    returns the factor by which those momenta are scaled. State and arithmetic
    are float64 on the host.

    Parameters
    ----------
    n_dof:
        Shape ``(n_systems,)``: degrees of freedom the chain heats.
    kT:
        Target temperature times Boltzmann's constant (eV).
    masses:
        Shape ``(n_systems, length)``: the links' masses (eV * time**2).
    n_loops:
        Sub-steps per call (each a Suzuki-Yoshida composition); more for a chain
        of many degrees of freedom (:meth:`sub_steps`).
    max_loops:
        Bound on the sub-steps of one call (ValidationError beyond it).

    Attributes
    ----------
    xi, p_xi:
        float64 arrays, shape ``(n_systems, length)``: positions and momenta of
        the links.
    last_loops:
        Sub-steps the last :meth:`propagate` took.
    """

    def __init__(
        self,
        n_dof: Any,
        kT: float,
        masses: Any,
        n_loops: int = 1,
        max_loops: int = MAX_CHAIN_LOOPS,
    ) -> None:
        dof, q = host(n_dof), host(masses)
        if q.ndim != 2 or dof.shape != (q.shape[0],) or q.shape[1] < 1:
            raise ConfigurationError(
                f"chain masses have shape {q.shape}, expected ({dof.shape[0]}, length >= 1)"
            )
        if not bool((q > 0).all()) or not kT > 0:
            raise ConfigurationError(
                f"a Nose-Hoover chain needs kT > 0 (got {kT}) and positive masses "
                f"(got {q.tolist()})"
            )
        if n_loops < 1 or max_loops < n_loops:
            raise ConfigurationError(
                f"need 1 <= n_loops <= max_loops, got n_loops={n_loops}, max_loops={max_loops}"
            )
        self.n_dof, self.kT, self.masses, self.n_loops = dof, float(kT), q, int(n_loops)
        self.max_loops = int(max_loops)
        self.last_loops = self.n_loops
        self._loops_for: tuple[Any, int] = (None, self.n_loops)
        self.xi: Array = np.zeros_like(q)
        self.p_xi: Array = np.zeros_like(q)

    @property
    def length(self) -> int:
        """Links per chain."""
        return int(self.masses.shape[1])

    def energy(self) -> Array:
        """The chain's share of the conserved energy, shape ``(n_systems,)``:
        ``sum p**2 / 2Q + n_dof kT xi_1 + kT sum_{j>1} xi_j``."""
        kinetic = (0.5 * self.p_xi * self.p_xi / self.masses).sum(axis=1)
        out: Array = kinetic + self.n_dof * self.kT * self.xi[:, 0]
        out += self.kT * self.xi[:, 1:].sum(axis=1)
        return out

    def propagate(self, k2: Any, dt: float) -> Array:
        """Advance the chains by ``dt`` (ASE time units) against momenta whose twice
        kinetic energy is ``k2`` (shape ``(n_systems,)``).

        Returns
        -------
        numpy.ndarray
            float64, shape ``(n_systems,)``: multiply the momenta by it (their
            ``k2`` becomes ``k2 * factor**2``).
        """
        k2 = host(k2).copy()
        n = self.last_loops = self.sub_steps(dt)
        scale: Array = np.ones_like(k2)
        if k2.shape[0] <= SCALAR_SYSTEMS:
            for s in range(k2.shape[0]):
                scale[s], k2[s] = self._sweep_one(s, float(k2[s]), dt, n)
        else:
            with np.errstate(over="ignore", invalid="ignore"):  # (checked below)
                for _ in range(n):
                    for w in SUZUKI_YOSHIDA_4:
                        factor = self._substep(k2, w * dt / n)
                        scale *= factor
                        k2 *= factor * factor
        if not np.isfinite(scale).all():
            raise ValidationError(
                f"Nose-Hoover chain diverged (scale factors {scale.tolist()}, {n} sub-steps); "
                f"twice the kinetic energy was {k2.tolist()} against a target of "
                f"{(self.n_dof * self.kT).tolist()}. A system far from the thermostat's "
                "temperature: equilibrate first (e.g. Langevin), or use a longer tau or "
                "more n_loops"
            )
        return scale

    def sub_steps(self, dt: float) -> int:
        """Sub-steps for a chain half step of ``dt``: ``n_loops``, or more for a
        chain that large systems make stiff. A function of the chain's constants
        and ``dt`` only, so a decomposed run takes the same count as one process
        (a count chosen from the state would switch at a threshold that two runs,
        equal to rounding, can straddle).

        The standard masses make the first link's kinetic energy extensive
        (``Q_1 = n_dof kT tau**2``) and the next links' not (``kT tau**2``): far
        from its temperature, a chain of ``n_dof`` degrees of freedom reaches
        rates of about ``n_dof**(1/3) / tau`` (its link velocities and couplings,
        measured up to 3e8 degrees of freedom), and a fixed Suzuki-Yoshida step,
        whose middle weight is negative so that its exponentials amplify,
        diverges (1M atoms from a lattice, within tens of steps). So ``n`` keeps
        ``|w| h n_dof**(1/3) / tau <= CHAIN_STEP_LIMIT`` for the sub-step
        ``h = dt / n``, ``tau`` being the shortest link time ``sqrt(Q_j / kT)``:
        1 up to about 10,000 atoms at ``dt = tau / 25`` (ASE's trajectory), 5 at
        1M atoms. A chain that diverges anyway raises ValidationError.
        """
        key = (float(dt), self.n_loops)
        if key != self._loops_for[0]:
            w = max(abs(x) for x in SUZUKI_YOSHIDA_4)
            tau = float(np.sqrt(self.masses / self.kT).min())
            rate = float(np.cbrt(self.n_dof.max())) / tau
            n = max(self.n_loops, math.ceil(abs(dt) * w * rate / CHAIN_STEP_LIMIT))
            if n > self.max_loops:
                raise ValidationError(
                    f"Nose-Hoover chain needs {n} sub-steps per half step of {abs(dt):.3g} "
                    f"(max_loops {self.max_loops}) for {self.n_dof.max():.0f} degrees of "
                    f"freedom and a link time of {tau:.3g}: use a longer tau"
                )
            self._loops_for = (key, n)
        return self._loops_for[1]

    def _sweep_one(self, s: int, k2: float, dt: float, n: int) -> tuple[float, float]:
        """:meth:`propagate` of system ``s`` on Python floats (the same operations
        in the same order as :meth:`_substep`, without NumPy's per-call cost on
        arrays of a few numbers: the chain's share of an NVT-NH step on 4,000
        atoms on a CPU fell from 1.33 to 0.48 ms); returns the
        scale factor and the new ``k2`` (NaN when the chain overflowed)."""
        p, q, xi = self.p_xi[s].tolist(), self.masses[s].tolist(), self.xi[s].tolist()
        target, kT, last, exp = float(self.n_dof[s] * self.kT), self.kT, len(p) - 1, math.exp

        def kick(j: int, k2: float, d: float) -> None:
            force = k2 - target if j == 0 else p[j - 1] * p[j - 1] / q[j - 1] - kT
            if j < last:
                damp = exp(-0.25 * d * p[j + 1] / q[j + 1])
                p[j] = (p[j] * damp + 0.5 * d * force) * damp
            else:
                p[j] += 0.5 * d * force

        scale = 1.0
        try:
            for _ in range(n):
                for w in SUZUKI_YOSHIDA_4:
                    d = w * dt / n
                    for j in range(last, -1, -1):
                        kick(j, k2, d)
                    for j in range(last + 1):
                        xi[j] += d * p[j] / q[j]
                    factor = exp(-d * p[0] / q[0])
                    moved = k2 * factor * factor
                    for j in range(last + 1):
                        kick(j, moved, d)
                    scale *= factor
                    k2 *= factor * factor
        except OverflowError:  # (math.exp raises where np.exp returns inf)
            scale = math.nan
        self.p_xi[s], self.xi[s] = p, xi
        return scale, k2

    def _kick(self, j: int, k2: Array, d: float) -> None:
        p, q = self.p_xi, self.masses
        if j == 0:
            force = k2 - self.n_dof * self.kT
        else:
            force = p[:, j - 1] * p[:, j - 1] / q[:, j - 1] - self.kT
        if j + 1 < self.length:
            damp = np.exp(-0.25 * d * p[:, j + 1] / q[:, j + 1])
            p[:, j] = (p[:, j] * damp + 0.5 * d * force) * damp
        else:
            p[:, j] += 0.5 * d * force

    def _substep(self, k2: Array, d: float) -> Array:
        for j in reversed(range(self.length)):
            self._kick(j, k2, d)
        self.xi += d * self.p_xi / self.masses
        factor: Array = np.exp(-d * self.p_xi[:, 0] / self.masses[:, 0])
        k2_new = k2 * factor * factor
        for j in range(self.length):
            self._kick(j, k2_new, d)
        return factor


class StepSums:
    """What an integrator's one reduction per step returns (global, per system).

    Attributes
    ----------
    counts:
        float64 host array ``(n_systems,)``: atoms per system.
    kinetic:
        float64 host array ``(n_systems, 3, 3)``: ``sum m v (x) v`` (twice the
        kinetic tensor).
    totals:
        The model's per-system totals asked for (``energy``, ``stress``) that
        exist, as tensors on the batch's device.
    """

    def __init__(self, counts: Array, kinetic: Array, totals: dict[str, torch.Tensor]) -> None:
        self.counts, self.kinetic, self.totals = counts, kinetic, totals

    @property
    def k2(self) -> Array:
        """Twice the kinetic energy per system, shape ``(n_systems,)``."""
        out: Array = np.trace(self.kinetic, axis1=1, axis2=2)
        return out


def step_sums(dyn: BaseDynamics, names: Iterable[str]) -> StepSums:
    """Atom counts, ``sum m v (x) v`` and the model totals ``names``, per system.

    One call of ``dyn.reducer.sum_with_totals``: under DD **Collective** over the
    mesh (one all-reduce that also completes the pending per-system partials).
    The counts and kinetic tensor are copied to the host (one synchronisation).
    """
    b = dyn.batch
    n_sys = b.n_systems
    v = b.velocities.to(torch.float64)
    outer = b.masses.to(torch.float64)[:, None, None] * v[:, :, None] * v[:, None, :]
    ones = torch.ones(b.n_atoms, 1, dtype=torch.float64, device=b.device)
    local = torch.zeros(n_sys, 10, dtype=torch.float64, device=b.device)
    local = local.index_add(0, b.system_index, torch.cat([ones, outer.reshape(-1, 9)], 1))
    reducer: Reducer = dyn.reducer
    summed, totals = reducer.sum_with_totals(local, names, dyn.outputs)
    flat = host(summed)
    return StepSums(flat[:, 0].copy(), flat[:, 1:].reshape(n_sys, 3, 3).copy(), totals)


def per_atom(values: Array, batch: Batch) -> torch.Tensor:
    """A per-system host factor ``(n_systems,)`` as a per-atom column
    ``(n_atoms, 1)`` on the batch's device and in its dtype."""
    t = torch.as_tensor(values, dtype=batch.dtype).to(batch.device, non_blocking=True)
    return t.index_select(0, batch.system_index)[:, None]


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
        cuda_graphs: bool | None = None,
    ) -> None:
        super().__init__(model, batch, dt_fs=dt_fs, hooks=hooks, cuda_graphs=cuda_graphs)
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
        self._k2: Array | None = None
        self._energy: Array | None = None

    @property
    def kT(self) -> float:
        """Target ``k_B T`` in eV."""
        return KB_EV_PER_K * self.temperature_K

    def _reduce(self) -> StepSums:
        sums = step_sums(self, ("energy",))
        energy = sums.totals.get("energy")
        self._energy = None if energy is None else host(energy)
        if energy is not None:
            self.batch = self.batch.replace(energy=energy.to(self.batch.dtype))
        return sums

    def _start(self) -> Array:
        sums = self._reduce()
        if not bool((sums.counts > 0).all()):
            raise ValidationError(f"every system needs atoms; counts are {sums.counts.tolist()}")
        n_dof = 3.0 * sums.counts
        tau = self.tau_fs * ASE_TIME_PER_FS
        q = np.full((n_dof.shape[0], self.chain_length), self.kT * tau * tau)
        q[:, 0] *= n_dof
        self.chain = NoseHooverChain(n_dof, self.kT, q, self.n_loops)
        return sums.k2

    def _thermostat(self, k2: Array) -> None:
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
        """The extended energy ``E_pot + E_kin + chain`` per system (float64, on the
        host), which the dynamics conserves; no communication (uses the last
        step's sums).

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
        return torch.from_numpy(self._energy + 0.5 * self._k2 + self.chain.energy())
