"""Isothermal-isobaric (NPT) dynamics: the Martyna-Tobias-Klein barostat.

Equations of motion of Martyna, Tobias and Klein (J. Chem. Phys. 101, 4177,
1994), with Nose-Hoover chains on the particles and on the cell, integrated by
the measure-preserving Trotter factorisation of Tuckerman et al. (J. Phys. A 39,
5629, 2006). Two cell freedoms (:class:`CellDOF`): isotropic (one strain rate;
the cell keeps its shape) and full (a symmetric 3x3 strain rate: independent
axes and shear, any triclinic cell). Docs/design.md says why MTK.

Every global quantity a step reads (atom counts, ``sum m v (x) v``, the model's
energy and stress) comes out of one reduction per step (:func:`step_sums`), so
the same class runs under :class:`~nvdd.dynamics.DomainParallel` unchanged and
the cell is bit-identical on every rank.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from nvdd.core import Batch, ConfigurationError, ModelOutputs, ValidationError
from nvdd.dynamics._base import ASE_TIME_PER_FS, KB_EV_PER_K, BaseDynamics
from nvdd.dynamics._hooks import Hook
from nvdd.dynamics._nose_hoover import (
    CHAIN_FIELDS,
    Array,
    NoseHooverChain,
    StepSums,
    host,
    per_atom,
    step_sums,
)

__all__ = ["EV_PER_A3_PER_BAR", "CellDOF", "MTKNPT"]

#: One bar in eV / Angstrom**3.
EV_PER_A3_PER_BAR = 1e5 / 1.602176634e11


class CellDOF(enum.Enum):
    """Which cell deformations the barostat drives."""

    #: One strain rate: the volume changes, the shape stays.
    ISOTROPIC = "isotropic"
    #: A symmetric 3x3 strain rate: each axis and each shear (triclinic cells).
    FULL = "full"


def _exprel(x: Array) -> Array:
    """``(exp(x) - 1) / x``, 1 at 0."""
    safe = np.where(x == 0, 1.0, x)
    out: Array = np.where(x == 0, 1.0, np.expm1(safe) / safe)
    return out


def _in_basis(x: torch.Tensor, basis: torch.Tensor, si: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` (n, 3) times their system's ``basis`` (S, 3, 3)."""
    if basis.shape[0] == 1:
        return x @ basis[0]
    return torch.bmm(x.unsqueeze(1), basis.index_select(0, si)).squeeze(1)


def _device(a: Array, batch: Batch) -> torch.Tensor:
    return torch.as_tensor(a, dtype=batch.dtype).to(batch.device, non_blocking=True)


class MTKNPT(BaseDynamics):
    """NPT dynamics with an MTK barostat and Nose-Hoover chains, per system.

    One step: barostat chain, thermostat chain, cell kick (each dt/2), particle
    kick (dt/2), drift of positions and cell (dt) | forces | particle kick, cell
    kick, thermostat chain, barostat chain (each dt/2). Needs periodic systems
    and a model that returns ``stress`` (ASE sign, eV/A**3).

    Parameters
    ----------
    temperature_K:
        Target temperature, > 0.
    pressure_bar:
        Target (external, hydrostatic) pressure in bar.
    tau_t_fs, tau_p_fs:
        Thermostat and barostat time scales (fs); defaults ``100 * dt_fs`` and
        ``1000 * dt_fs``.
    cell_dof:
        :class:`CellDOF` (default isotropic).
    t_chain, p_chain:
        Links of the particle and cell chains (>= 1; default 3).
    t_loops, p_loops:
        Chain sub-steps per half step (default 1).

    Notes
    -----
    Masses (ASE's choices, so ASE's ``IsotropicMTKNPT`` / ``MTKNPT`` are exact
    oracles): thermostat ``Q = (3N, 1, ...) kT tau_t**2``; barostat
    ``W = (3N + 3) kT tau_p**2`` (isotropic) or ``(N + 1) kT tau_p**2`` (full);
    cell chain ``(9, 1, ...) kT tau_p**2``. Degrees of freedom ``3N``.

    The integrator owns the cell: from the first step on it keeps a float64
    host copy and writes ``batch.cell`` from it (bit-identical on every rank
    under DD).

    ``pressure_bar`` may be changed between steps (the next step reads it).
    Setting ``temperature_K``, ``tau_t_fs``, ``tau_p_fs`` or ``cell_dof``
    restarts the integrator at the next step, as a new ``MTKNPT`` from the
    current state would start: fresh chains, zero cell momentum.
    """

    def __init__(
        self,
        model: Callable[[Batch], ModelOutputs],
        batch: Batch,
        *,
        dt_fs: float = 1.0,
        temperature_K: float,
        pressure_bar: float = 1.0,
        tau_t_fs: float | None = None,
        tau_p_fs: float | None = None,
        cell_dof: CellDOF = CellDOF.ISOTROPIC,
        t_chain: int = 3,
        p_chain: int = 3,
        t_loops: int = 1,
        p_loops: int = 1,
        hooks: Iterable[Hook] = (),
        cuda_graphs: bool | None = None,
    ) -> None:
        super().__init__(model, batch, dt_fs=dt_fs, hooks=hooks, cuda_graphs=cuda_graphs)
        tau_t = 100.0 * dt_fs if tau_t_fs is None else tau_t_fs
        tau_p = 1000.0 * dt_fs if tau_p_fs is None else tau_p_fs
        if not (temperature_K > 0 and tau_t > 0 and tau_p > 0):
            raise ConfigurationError(
                f"MTKNPT needs temperature_K, tau_t_fs and tau_p_fs > 0, got {temperature_K!r}, "
                f"{tau_t_fs!r}, {tau_p_fs!r}"
            )
        if (
            isinstance(pressure_bar, bool)
            or not isinstance(pressure_bar, int | float)
            or not math.isfinite(pressure_bar)
        ):
            raise ConfigurationError(f"pressure_bar must be a number, got {pressure_bar!r}")
        if not isinstance(cell_dof, CellDOF):
            raise ConfigurationError(f"cell_dof must be a CellDOF, got {cell_dof!r}")
        if min(t_chain, p_chain, t_loops, p_loops) < 1:
            raise ConfigurationError(
                f"chain lengths and loops must be >= 1, got t_chain={t_chain}, "
                f"p_chain={p_chain}, t_loops={t_loops}, p_loops={p_loops}"
            )
        self.temperature_K, self.pressure_bar = float(temperature_K), float(pressure_bar)
        self.tau_t_fs, self.tau_p_fs = float(tau_t), float(tau_p)
        self.cell_dof = cell_dof
        self._chains = (int(t_chain), int(p_chain), int(t_loops), int(p_loops))
        self.thermostat: NoseHooverChain | None = None
        self.barostat: NoseHooverChain | None = None
        #: Cell momentum (host, float64): (S,) isotropic, (S, 3, 3) symmetric for
        #: the full cell.
        self.p_cell: Array | None = None
        self._kin: Array | None = None  # sum m v (x) v, (S, 3, 3)
        self._stress: Array | None = None
        self._energy: Array | None = None
        self._counts: Array | None = None
        self._w: Array | None = None  # barostat mass, (S,)
        self._cell: Array | None = None  # the cell (host, float64; the batch gets copies)
        self._started_bath = self._bath()

    # ------------------------------------------------------------ quantities
    @property
    def kT(self) -> float:
        """Target ``k_B T`` in eV."""
        return KB_EV_PER_K * self.temperature_K

    @property
    def pressure_ext(self) -> float:
        """Target pressure in eV / A**3."""
        return self.pressure_bar * EV_PER_A3_PER_BAR

    def volume(self) -> torch.Tensor:
        """Cell volumes, float64 shape ``(n_systems,)`` on the host (no communication)."""
        return torch.from_numpy(self._volume())

    def _volume(self) -> Array:
        cell = self._cell if self._cell is not None else host(self.batch.cell)
        vol: Array = np.abs(np.linalg.det(cell))
        return vol

    def pressure_tensor(self) -> torch.Tensor:
        """Instantaneous pressure tensor (kinetic + virial) after the last step,
        eV/A**3, float64 shape ``(n_systems, 3, 3)`` on the host; no communication."""
        kin, stress = self._need("pressure_tensor")
        return torch.from_numpy(kin / self._volume()[:, None, None] - stress)

    def pressure(self) -> torch.Tensor:
        """Instantaneous pressure (bar) after the last step, shape ``(n_systems,)``."""
        p = self.pressure_tensor().diagonal(dim1=1, dim2=2).sum(dim=1) / 3.0
        out: torch.Tensor = p / EV_PER_A3_PER_BAR
        return out

    def conserved_energy(self) -> torch.Tensor:
        """The extended energy per system (float64, on the host), conserved by the
        dynamics: ``E_pot + E_kin + chains + cell kinetic energy + P_ext V``. No
        communication (uses the last step's sums)."""
        kin, _ = self._need("conserved_energy")
        if self._energy is None:
            raise ValidationError(
                f"conserved_energy: {type(self.model).__name__} returns no 'energy'"
            )
        assert self.thermostat is not None and self.barostat is not None
        total = (
            self._energy
            + 0.5 * np.trace(kin, axis1=1, axis2=2)
            + self.thermostat.energy()
            + self.barostat.energy()
            + 0.5 * self._cell_k2()
            + self.pressure_ext * self._volume()
        )
        return torch.from_numpy(total)

    def _need(self, what: str) -> tuple[Array, Array]:
        if self._kin is None or self._stress is None:
            raise ValidationError(f"{what}: take a step first")
        return self._kin, self._stress

    # ----------------------------------------------------------- checkpoints
    #: The host arrays of the step besides the chains (see ``__init__``).
    _ARRAYS = ("p_cell", "_kin", "_stress", "_energy", "_counts", "_w", "_cell")

    def state_arrays(self) -> dict[str, Any]:
        """Both chains, the cell momentum, the cell and the last step's sums (none
        before the first step): what an exact restart needs."""
        if self.thermostat is None or self.barostat is None:
            return {}
        out: dict[str, Any] = {
            **self.thermostat.state("thermostat."),
            **self.barostat.state("barostat."),
        }
        for name in self._ARRAYS:
            value = getattr(self, name)
            if value is not None:
                out[name.lstrip("_")] = np.array(value, dtype=np.float64)
        return out

    def load_state_arrays(self, arrays: Mapping[str, Any]) -> None:
        """Restore :meth:`state_arrays` (an empty mapping: the barostat and chains
        start at the next step, as in a fresh run)."""
        names = {n.lstrip("_") for n in self._ARRAYS}
        chains = {f"{c}.{k}" for c in ("thermostat", "barostat") for k in CHAIN_FIELDS}
        unknown = set(arrays) - names - chains
        if unknown or (arrays and not chains <= set(arrays)):
            raise ConfigurationError(
                f"MTKNPT: saved state {sorted(arrays)} is not what MTKNPT keeps "
                f"({sorted(names | chains)})"
            )
        _, _, t_loops, p_loops = self._chains
        self.thermostat = self.barostat = None
        if arrays:
            self.thermostat = NoseHooverChain.from_state(arrays, "thermostat.", self.kT, t_loops)
            self.barostat = NoseHooverChain.from_state(arrays, "barostat.", self.kT, p_loops)
        for name in self._ARRAYS:
            value = arrays.get(name.lstrip("_"))
            setattr(self, name, None if value is None else host(value).copy())
        if self.thermostat is not None and self.p_cell is None:
            raise ConfigurationError("MTKNPT: the saved state has chains but no cell momentum")
        self._started_bath = self._bath()

    # --------------------------------------------------------------- set-up
    def _reduce(self) -> StepSums:
        sums = step_sums(self, ("energy", "stress"))
        if "stress" not in sums.totals:
            raise ValidationError(
                f"MTKNPT needs the model's 'stress'; {type(self.model).__name__} returned "
                f"{sorted(self.outputs)}"
            )
        stress, energy = sums.totals["stress"], sums.totals.get("energy")
        self._kin, self._stress = sums.kinetic, host(stress)
        self._energy = None if energy is None else host(energy)
        fields: dict[str, Any] = {"stress": stress.to(self.batch.dtype)}
        if energy is not None:
            fields["energy"] = energy.to(self.batch.dtype)
        self.batch = self.batch.replace(**fields)
        return sums

    def _start(self) -> None:
        if not bool(self.batch.pbc.all()):
            raise ConfigurationError(
                f"MTKNPT needs periodic systems on every axis, got pbc {self.batch.pbc.tolist()}"
            )
        sums = self._reduce()
        n = sums.counts
        if not bool((n > 0).all()):
            raise ValidationError(f"every system needs atoms; counts are {n.tolist()}")
        t_chain, p_chain, t_loops, p_loops = self._chains
        kT = self.kT
        tt = (self.tau_t_fs * ASE_TIME_PER_FS) ** 2
        tp = (self.tau_p_fs * ASE_TIME_PER_FS) ** 2
        q = np.full((n.shape[0], t_chain), kT * tt)
        q[:, 0] *= 3.0 * n
        self.thermostat = NoseHooverChain(3.0 * n, kT, q, t_loops)
        r = np.full((n.shape[0], p_chain), kT * tp)
        r[:, 0] *= 9.0
        iso = self.cell_dof is CellDOF.ISOTROPIC
        self.barostat = NoseHooverChain(np.full_like(n, 1.0 if iso else 9.0), kT, r, p_loops)
        self._w = (3.0 * n + 3.0 if iso else n + 1.0) * kT * tp
        self._counts = n
        self._cell = host(self.batch.cell)
        self.p_cell = np.zeros((n.shape[0],) if iso else (n.shape[0], 3, 3))
        self._started_bath = self._bath()

    # ---------------------------------------------------------- the pieces
    def _cell_k2(self) -> Array:
        assert self.p_cell is not None and self._w is not None
        p = self.p_cell
        sq = p * p if p.ndim == 1 else (p * p).sum(axis=(1, 2))
        out: Array = sq / self._w
        return out

    def _barostat_chain(self, d: float) -> None:
        assert self.barostat is not None and self.p_cell is not None
        scale = self.barostat.propagate(self._cell_k2(), d)
        self.p_cell = self.p_cell * (scale if self.p_cell.ndim == 1 else scale[:, None, None])

    def _thermostat_chain(self, d: float) -> None:
        assert self.thermostat is not None and self._kin is not None
        scale = self.thermostat.propagate(np.trace(self._kin, axis1=1, axis2=2), d)
        self._kin = self._kin * (scale * scale)[:, None, None]
        b = self.batch
        self.batch = b.replace(velocities=b.velocities * per_atom(scale, b))

    def _cell_kick(self, d: float) -> None:
        assert self.p_cell is not None and self._kin is not None and self._stress is not None
        assert self._counts is not None
        vol = self._volume()
        kin, stress, p_ext = self._kin, self._stress, self.pressure_ext
        k2 = np.trace(kin, axis1=1, axis2=2)
        if self.p_cell.ndim == 1:
            trace = np.trace(stress, axis1=1, axis2=2)
            force = k2 - vol * trace - 3.0 * vol * p_ext + k2 / self._counts
        else:
            iso = (k2 / (3.0 * self._counts) - vol * p_ext)[:, None, None] * np.eye(3)
            force = kin - vol[:, None, None] * stress + iso
            force = 0.5 * (force + force.transpose(0, 2, 1))
        self.p_cell = self.p_cell + d * force

    def _rates(self) -> tuple[Array, Array | None]:
        """Strain rates (1/time): (S,) isotropic, else eigenvalues (S, 3) and basis."""
        assert self.p_cell is not None and self._w is not None
        if self.p_cell.ndim == 1:
            out: Array = self.p_cell / self._w
            return out, None
        lam, basis = np.linalg.eigh(self.p_cell)
        return lam / self._w[:, None], basis

    def _kick(self, d: float) -> None:
        """Particle velocities under forces and the cell's friction, over ``d``."""
        assert self._counts is not None
        b = self.batch
        si = b.system_index
        acc = b.forces / b.masses[:, None]
        rate, basis = self._rates()
        if basis is None:
            x = -(1.0 + 1.0 / self._counts) * rate * d
            v = b.velocities * per_atom(np.exp(x), b) + d * acc * per_atom(_exprel(x), b)
        else:
            trace = rate.sum(axis=1, keepdims=True) / (3.0 * self._counts[:, None])
            x = -(rate + trace) * d  # (S, 3)
            u = _device(basis, b)
            y = _in_basis(b.velocities, u, si) * _device(np.exp(x), b)[si]
            y = y + d * _in_basis(acc, u, si) * _device(_exprel(x), b)[si]
            v = _in_basis(y, u.transpose(1, 2), si)
        self.batch = b.replace(velocities=v)

    def _drift(self, d: float) -> None:
        """Positions and cell over ``d``: affine growth plus the particles' motion."""
        assert self._cell is not None
        b = self.batch
        si = b.system_index
        rate, basis = self._rates()
        x = rate * d
        if basis is None:
            pos = b.positions * per_atom(np.exp(x), b) + d * b.velocities * per_atom(_exprel(x), b)
            self._cell = self._cell * np.exp(x)[:, None, None]
        else:
            u = _device(basis, b)
            y = _in_basis(b.positions, u, si) * _device(np.exp(x), b)[si]
            y = y + d * _in_basis(b.velocities, u, si) * _device(_exprel(x), b)[si]
            pos = _in_basis(y, u.transpose(1, 2), si)
            grown = (self._cell @ basis) * np.exp(x)[:, None, :]
            self._cell = grown @ basis.transpose(0, 2, 1)
        self.batch = b.replace(positions=pos, cell=_device(self._cell, b))

    # ------------------------------------------------------------- the step
    def _bath(self) -> tuple[Any, ...]:
        """What the chains and the barostat mass are made of (not the pressure,
        which every step reads)."""
        return (self.temperature_K, self.tau_t_fs, self.tau_p_fs, self.cell_dof, self._chains)

    def pre_update(self) -> None:
        if self.p_cell is not None and self._bath() != self._started_bath:
            self.p_cell = None  # a new target (annealing): a fresh start at this step
        if self.p_cell is None:
            self._start()
        half = 0.5 * self.dt
        self._barostat_chain(half)
        self._thermostat_chain(half)
        self._cell_kick(half)
        self._kick(half)
        self._drift(self.dt)

    def post_update(self) -> None:
        half = 0.5 * self.dt
        self._kick(half)
        self._reduce()
        self._cell_kick(half)
        self._thermostat_chain(half)
        self._barostat_chain(half)
