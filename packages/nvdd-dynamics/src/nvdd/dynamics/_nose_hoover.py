"""Nose-Hoover chains: the thermostat (and barostat-thermostat) of NVT and NPT.

The chain equations are those of Martyna, Klein and Tuckerman (J. Chem. Phys. 97,
2635, 1992); the integrator is the time-reversible Trotter factorisation with
Suzuki-Yoshida sub-steps of Tuckerman et al. (J. Phys. A 39, 5629, 2006). Every
system of a batch has its own chain. Chain variables are global (one value per
system, identical on every rank): they are driven only by sums that come out of
the integrator's one reduction per step, so a domain-decomposed run integrates
exactly the chain of the single-process run.

This module's chain keeps its state on the host in float64 NumPy arrays (MTK
NPT uses it; its step decides on the host anyway): a chain sweep is a few
hundred operations on arrays of a few numbers, microseconds on the host. The
step's one reduction is copied to the host once per step. NVT-NH runs the same
chain on the device (``_chain_device``), which lets its steps be captured.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from nvdd.core import Batch, ConfigurationError, ValidationError, sum_by_system
from nvdd.dynamics._integrators import BaseDynamics

if TYPE_CHECKING:
    from nvdd.dynamics._integrators import Reducer

__all__ = ["NoseHooverChain", "StepSums", "reduce_step", "step_sums"]

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
#: What :meth:`NoseHooverChain.state` saves of a chain.
CHAIN_FIELDS = ("n_dof", "masses", "xi", "p_xi")


def host(x: Any) -> Array:
    """``x`` (a tensor on any device, an array or numbers) as a float64 host array."""
    if isinstance(x, torch.Tensor):
        return np.asarray(x.detach().to(device="cpu", dtype=torch.float64).numpy())
    return np.asarray(x, dtype=np.float64)


def check_chain_constants(
    n_dof: Any, kT: float, masses: Any, n_loops: int, max_loops: int
) -> tuple[Array, Array]:
    """``n_dof`` and ``masses`` as float64 host arrays, checked (ConfigurationError)."""
    dof, q = host(n_dof), host(masses)
    if q.ndim != 2 or dof.shape != (q.shape[0],) or q.shape[1] < 1:
        raise ConfigurationError(
            f"chain masses have shape {q.shape}, expected ({dof.shape[0]}, length >= 1)"
        )
    if not bool((q > 0).all()) or not kT > 0:
        raise ConfigurationError(
            f"a Nose-Hoover chain needs kT > 0 (got {kT}) and positive masses (got {q.tolist()})"
        )
    if n_loops < 1 or max_loops < n_loops:
        raise ConfigurationError(
            f"need 1 <= n_loops <= max_loops, got n_loops={n_loops}, max_loops={max_loops}"
        )
    return dof, q


def chain_sub_steps(
    n_dof: Array, masses: Array, kT: float, dt: float, n_loops: int, max_loops: int
) -> int:
    """Sub-steps of a chain half step of ``dt`` (:meth:`NoseHooverChain.sub_steps`):
    ``max(n_loops, ceil(|w| |dt| n_dof**(1/3) / tau / CHAIN_STEP_LIMIT))``.

    Raises
    ------
    ValidationError
        When that exceeds ``max_loops``.
    """
    w = max(abs(x) for x in SUZUKI_YOSHIDA_4)
    tau = float(np.sqrt(masses / kT).min())
    rate = float(np.cbrt(n_dof.max())) / tau
    n = max(n_loops, math.ceil(abs(dt) * w * rate / CHAIN_STEP_LIMIT))
    if n > max_loops:
        raise ValidationError(
            f"Nose-Hoover chain needs {n} sub-steps per half step of {abs(dt):.3g} "
            f"(max_loops {max_loops}) for {n_dof.max():.0f} degrees of "
            f"freedom and a link time of {tau:.3g}: use a longer tau"
        )
    return n


class ChainState:
    """What the host and the device chain share: their constants (``n_dof``,
    ``kT``, ``masses``), the conserved-energy share and the checkpoint form.
    ``xi`` and ``p_xi`` are host arrays or device tensors; a subclass stores a
    loaded value with :meth:`_store`."""

    n_dof: Array
    kT: float  # noqa: N815 (the physics name, as in the constructors)
    masses: Array
    xi: Any
    p_xi: Any

    @property
    def length(self) -> int:
        """Links per chain."""
        return int(self.masses.shape[1])

    def energy(self) -> Array:
        """The chain's share of the conserved energy, shape ``(n_systems,)``:
        ``sum p**2 / 2Q + n_dof kT xi_1 + kT sum_{j>1} xi_j`` (host float64;
        a device chain is read)."""
        p, xi = host(self.p_xi), host(self.xi)
        kinetic = (0.5 * p * p / self.masses).sum(axis=1)
        out: Array = kinetic + self.n_dof * self.kT * xi[:, 0]
        out += self.kT * xi[:, 1:].sum(axis=1)
        return out

    def state(self, prefix: str) -> dict[str, Array]:
        """The chain as float64 host arrays named ``prefix + ...`` (checkpoints)."""
        return {
            prefix + k: np.array(host(getattr(self, k)), dtype=np.float64) for k in CHAIN_FIELDS
        }

    def _load(self, arrays: Mapping[str, Any], prefix: str) -> None:
        """Set ``xi`` and ``p_xi`` from a saved :meth:`state` (shapes checked)."""
        for name in ("xi", "p_xi"):
            value = host(arrays[prefix + name])
            if value.shape != self.masses.shape:
                raise ConfigurationError(
                    f"saved chain {name} has shape {value.shape}, expected {self.masses.shape}"
                )
            self._store(name, value)

    def _store(self, name: str, value: Array) -> None:
        setattr(self, name, value.copy())


class NoseHooverChain(ChainState):
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
        dof, q = check_chain_constants(n_dof, kT, masses, n_loops, max_loops)
        self.n_dof, self.kT, self.masses, self.n_loops = dof, float(kT), q, int(n_loops)
        self.max_loops = int(max_loops)
        self.last_loops = self.n_loops
        self._loops_for: tuple[Any, int] = (None, self.n_loops)
        self.xi: Array = np.zeros_like(q)
        self.p_xi: Array = np.zeros_like(q)

    @classmethod
    def from_state(
        cls, arrays: Mapping[str, Any], prefix: str, kT: float, n_loops: int
    ) -> NoseHooverChain:
        """The chain :meth:`state` saved (``kT`` and ``n_loops`` are the
        integrator's parameters)."""
        chain = cls(arrays[prefix + "n_dof"], kT, arrays[prefix + "masses"], n_loops)
        chain._load(arrays, prefix)
        return chain

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
            n = chain_sub_steps(self.n_dof, self.masses, self.kT, dt, self.n_loops, self.max_loops)
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


def reduce_step(
    dyn: BaseDynamics, names: Iterable[str], *, kinetic: str = "tensor"
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Atom counts, the kinetic sums and the model totals ``names``, per system,
    on the atoms' device (no host synchronisation; capturable).

    One call of ``dyn.reducer.sum_with_totals``: under DD **Collective** over the
    mesh (one all-reduce that also completes the pending per-system partials).

    Parameters
    ----------
    kinetic:
        ``"tensor"``: ``sum m v (x) v`` (nine columns; NPT's cell needs them);
        ``"trace"``: ``sum m v . v`` only (one column: twice the kinetic energy,
        all a thermostat reads; a fifth of the work over the atoms).

    Returns
    -------
    (torch.Tensor, dict)
        float64 ``(n_systems, 10)`` (``"tensor"``: column 0 the atom count,
        columns 1 to 9 ``sum m v (x) v`` row-major) or ``(n_systems, 2)``
        (``"trace"``: the count, ``sum m v . v``); and the totals of ``names``
        that exist.
    """
    b = dyn.batch
    v = b.velocities.to(torch.float64)
    m = b.masses.to(torch.float64)
    if kinetic == "trace":
        moments = (m * (v * v).sum(dim=1)).unsqueeze(1)
    elif kinetic == "tensor":
        moments = (m[:, None, None] * v[:, :, None] * v[:, None, :]).reshape(-1, 9)
    else:
        raise ValueError(f"kinetic must be 'tensor' or 'trace', got {kinetic!r}")
    ones = torch.ones(b.n_atoms, 1, dtype=torch.float64, device=b.device)
    rows = torch.cat([ones, moments], 1)
    local = sum_by_system(rows, b.system_index, b.n_systems)  # (no atomics on one row)
    reducer: Reducer = dyn.reducer
    return reducer.sum_with_totals(local, names, dyn.outputs)


def per_system_column(values: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Per-system device factors ``(n_systems,)`` as a column that multiplies the
    batch's ``(n_atoms, 3)`` rows, in its dtype: one system broadcasts (no
    per-atom gather), several are gathered per atom."""
    col = values.to(batch.dtype)
    if batch.n_systems == 1:
        return col.view(1, 1)
    return col.index_select(0, batch.system_index).unsqueeze(1)


def step_sums(dyn: BaseDynamics, names: Iterable[str]) -> StepSums:
    """:func:`reduce_step` with the counts and kinetic tensor copied to the host
    (one synchronisation). **Collective** under DD, as :func:`reduce_step`."""
    summed, totals = reduce_step(dyn, names)
    flat = host(summed)
    n_sys = flat.shape[0]
    return StepSums(flat[:, 0].copy(), flat[:, 1:].reshape(n_sys, 3, 3).copy(), totals)
