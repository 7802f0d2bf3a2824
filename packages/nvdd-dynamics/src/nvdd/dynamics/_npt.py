"""Isothermal-isobaric (NPT) dynamics: the Martyna-Tobias-Klein barostat.

Equations of motion of Martyna, Tobias and Klein (J. Chem. Phys. 101, 4177,
1994), with Nose-Hoover chains on the particles and on the cell, integrated by
the measure-preserving Trotter factorisation of Tuckerman et al. (J. Phys. A 39,
5629, 2006). Two cell freedoms (:class:`CellDOF`): isotropic (one strain rate;
the cell keeps its shape) and full (a symmetric 3x3 strain rate: independent
axes and shear, any triclinic cell). Docs/design.md says why MTK.

Every global quantity a step reads (atom counts, ``sum m v (x) v``, the model's
energy and stress) comes out of one reduction per step
(:func:`~nvdd.dynamics._nose_hoover.reduce_step`), so the same class runs
under :class:`~nvdd.dynamics.DomainParallel` unchanged and the cell is
bit-identical on every rank.

Everything a step does after the first stays on the atoms' device: the chains
are :class:`~nvdd.dynamics._chain_device.DeviceNoseHooverChain`, the cell
momentum, the cell and the step's sums are float64 tensors updated in place,
the cell's arithmetic is two Warp kernels and the particles' kick and drift
one more (``_barostat_device``). No value
is read on the host, so on a GPU a steady step is captured in a CUDA graph and
replayed (``StepGraphs``); a diverged chain or cell momentum is reported from a
flag read without blocking (``DivergenceFlag``), as for
:class:`~nvdd.dynamics.NoseHooverNVT`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from nvdd.core import (
    Batch,
    ConfigurationError,
    ModelOutputs,
    ValidationError,
)
from nvdd.dynamics._barostat_device import (
    RowKernel,
    SystemKernel,
    cell_kick_kernel,
    propagators_kernel,
)
from nvdd.dynamics._chain_device import DeviceNoseHooverChain
from nvdd.dynamics._finite import DivergenceFlag
from nvdd.dynamics._hooks import Hook
from nvdd.dynamics._integrators import ASE_TIME_PER_FS, KB_EV_PER_K, BaseDynamics
from nvdd.dynamics._nose_hoover import CHAIN_FIELDS, Array, host, per_system_column, reduce_step

__all__ = ["EV_PER_A3_PER_BAR", "CellDOF", "MTKNPT"]

#: One bar in eV / Angstrom**3.
EV_PER_A3_PER_BAR = 1e5 / 1.602176634e11


class CellDOF(enum.Enum):
    """Which cell deformations the barostat drives."""

    #: One strain rate: the volume changes, the shape stays.
    ISOTROPIC = "isotropic"
    #: A symmetric 3x3 strain rate: each axis and each shear (triclinic cells).
    FULL = "full"


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
        self.thermostat: DeviceNoseHooverChain | None = None
        self.barostat: DeviceNoseHooverChain | None = None
        #: Cell momentum (float64, the atoms' device), rows of 9 per system
        #: (row-major 3x3, symmetric for the full cell; isotropic: element 0).
        self.p_cell: torch.Tensor | None = None
        self._kin: torch.Tensor | None = None  # sum m v (x) v, (S, 9)
        self._stress: torch.Tensor | None = None  # (S, 9)
        self._energy: torch.Tensor | None = None  # (S,)
        self._counts: Array | None = None  # atoms per system (host; constants)
        self._w: Array | None = None  # barostat mass (host; constants), (S,)
        self._cell: torch.Tensor | None = None  # the cell (S, 3, 3); the batch gets copies
        self._p_ext = torch.zeros(1, dtype=torch.float64)  # on the device from the start
        self._p_ext_bar = math.nan  # the pressure _p_ext holds
        self._diverged = DivergenceFlag(self._raise_diverged)
        self._kernels: tuple[SystemKernel, SystemKernel] | None = None
        self._rows: RowKernel | None = None
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

    @property
    def iso(self) -> bool:
        """Whether the barostat drives the volume only (``CellDOF.ISOTROPIC``)."""
        return self.cell_dof is CellDOF.ISOTROPIC

    def volume(self) -> torch.Tensor:
        """Cell volumes, float64 shape ``(n_systems,)`` on the host (no communication)."""
        return torch.from_numpy(self._volume())

    def _volume(self) -> Array:
        cell = host(self._cell if self._cell is not None else self.batch.cell)
        with np.errstate(invalid="ignore"):  # (a diverged cell: NaN, reported as such)
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
        communication (uses the last step's sums; reads the device).

        Raises
        ------
        ValidationError
            Before the first step, if the model returns no energy, or if a chain
            or the cell momentum diverged.
        """
        kin, _ = self._need("conserved_energy")
        self._diverged.check()
        if self._energy is None:
            raise ValidationError(
                f"conserved_energy: {type(self.model).__name__} returns no 'energy'"
            )
        assert self.thermostat is not None and self.barostat is not None
        total = (
            host(self._energy)
            + 0.5 * np.trace(kin, axis1=1, axis2=2)
            + self.thermostat.energy()
            + self.barostat.energy()
            + 0.5 * self._cell_k2()
            + self.pressure_ext * self._volume()
        )
        return torch.from_numpy(total)

    def _need(self, what: str) -> tuple[Array, Array]:
        """The last step's ``sum m v (x) v`` and stress, ``(S, 3, 3)`` host arrays."""
        if self._kin is None or self._stress is None:
            raise ValidationError(f"{what}: take a step first")
        n_sys = self._kin.shape[0]
        return host(self._kin).reshape(n_sys, 3, 3), host(self._stress).reshape(n_sys, 3, 3)

    def _cell_k2(self) -> Array:
        """Twice the cell's kinetic energy per system (host)."""
        assert self.p_cell is not None and self._w is not None
        p = host(self.p_cell)
        sq = p[:, 0] ** 2 if self.iso else (p * p).sum(axis=1)
        out: Array = sq / self._w
        return out

    # ----------------------------------------------------------- checkpoints
    #: What the step keeps besides the chains, as saved (host float64): the cell
    #: momentum ``(S,)`` isotropic or ``(S, 3, 3)``, the sums ``(S, 3, 3)``, the
    #: energy, counts and barostat masses ``(S,)``, the cell ``(S, 3, 3)``.
    _ARRAYS = ("p_cell", "_kin", "_stress", "_energy", "_counts", "_w", "_cell")

    def state_arrays(self) -> dict[str, Any]:
        """Both chains, the cell momentum, the cell and the last step's sums (none
        before the first step): what an exact restart needs."""
        if self.thermostat is None or self.barostat is None or self.p_cell is None:
            return {}
        out: dict[str, Any] = {
            **self.thermostat.state("thermostat."),
            **self.barostat.state("barostat."),
        }
        n_sys = self.p_cell.shape[0]
        for name in self._ARRAYS:
            value = getattr(self, name)
            if value is None:
                continue
            a = np.array(host(value), dtype=np.float64)
            if name == "p_cell":
                a = a[:, 0].copy() if self.iso else a.reshape(n_sys, 3, 3)
            elif name in ("_kin", "_stress"):
                a = a.reshape(n_sys, 3, 3)
            out[name.lstrip("_")] = a
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
        self.thermostat = self.barostat = None
        self.p_cell = self._kin = self._stress = self._energy = self._cell = None
        self._counts = self._w = None
        self._started_bath = self._bath()
        if not arrays:
            return
        if "p_cell" not in arrays:
            raise ConfigurationError("MTKNPT: the saved state has chains but no cell momentum")
        _, _, t_loops, p_loops = self._chains
        dev = self.batch.device
        self.thermostat = DeviceNoseHooverChain.from_state(
            arrays, "thermostat.", self.kT, t_loops, dev
        )
        self.barostat = DeviceNoseHooverChain.from_state(arrays, "barostat.", self.kT, p_loops, dev)
        n_sys = self.thermostat.masses.shape[0]
        p = host(arrays["p_cell"])
        if p.shape != ((n_sys,) if self.iso else (n_sys, 3, 3)):
            raise ConfigurationError(
                f"MTKNPT: saved p_cell has shape {p.shape} for {n_sys} system(s) and a "
                f"{self.cell_dof.value} cell"
            )
        rows = np.zeros((n_sys, 9))
        if self.iso:
            rows[:, 0] = p
        else:
            rows[:] = p.reshape(n_sys, 9)
        self.p_cell = self._tensor(rows)
        for name in ("_kin", "_stress"):
            if name.lstrip("_") in arrays:
                setattr(self, name, self._tensor(host(arrays[name.lstrip("_")]).reshape(n_sys, 9)))
        if "energy" in arrays:
            self._energy = self._tensor(host(arrays["energy"]))
        for name in ("_counts", "_w"):
            value = arrays.get(name.lstrip("_"))
            setattr(self, name, None if value is None else host(value).copy())
        if "cell" in arrays:
            self._cell = self._tensor(host(arrays["cell"]))
        self._device_state()

    def _tensor(self, a: Array) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(a), dtype=torch.float64).to(self.batch.device)

    # --------------------------------------------------------------- set-up
    def _reduce(self) -> torch.Tensor:
        """The step's one reduction (:func:`reduce_step`, device float64 rows
        ``(S, 10)``); keeps ``sum m v (x) v``, the stress and the energy
        (device, in place) and writes the totals into the batch."""
        summed, totals = reduce_step(self, ("energy", "stress"))
        stress, energy = totals.get("stress"), totals.get("energy")
        if stress is None:
            raise ValidationError(
                f"MTKNPT needs the model's 'stress'; {type(self.model).__name__} returned "
                f"{sorted(self.outputs)}"
            )
        n_sys = summed.shape[0]
        kin, stress64 = summed[:, 1:], stress.to(torch.float64).reshape(n_sys, 9)
        if self._kin is None or self._stress is None:  # (the first step)
            self._kin = kin.clone(memory_format=torch.contiguous_format)
            self._stress = stress64.clone(memory_format=torch.contiguous_format)
        else:
            self._kin.copy_(kin)
            self._stress.copy_(stress64)
        fields: dict[str, Any] = {"stress": stress.to(self.batch.dtype)}
        if energy is not None:
            if self._energy is None:
                self._energy = energy.to(torch.float64).clone()
            else:
                self._energy.copy_(energy)
            fields["energy"] = energy.to(self.batch.dtype)
        self.batch = self.batch.replace(**fields)
        return summed

    def _start(self) -> None:
        if not bool(self.batch.pbc.all()):
            raise ConfigurationError(
                f"MTKNPT needs periodic systems on every axis, got pbc {self.batch.pbc.tolist()}"
            )
        self._kin = self._stress = self._energy = None
        summed = self._reduce()
        n = host(summed[:, 0])  # (the first step: one host read)
        if not bool((n > 0).all()):
            raise ValidationError(f"every system needs atoms; counts are {n.tolist()}")
        t_chain, p_chain, t_loops, p_loops = self._chains
        kT, dev = self.kT, self.batch.device
        tt = (self.tau_t_fs * ASE_TIME_PER_FS) ** 2
        tp = (self.tau_p_fs * ASE_TIME_PER_FS) ** 2
        q = np.full((n.shape[0], t_chain), kT * tt)
        q[:, 0] *= 3.0 * n
        self.thermostat = DeviceNoseHooverChain(3.0 * n, kT, q, t_loops, device=dev)
        r = np.full((n.shape[0], p_chain), kT * tp)
        r[:, 0] *= 9.0
        dof = np.full_like(n, 1.0 if self.iso else 9.0)
        self.barostat = DeviceNoseHooverChain(dof, kT, r, p_loops, device=dev)
        self._w = (3.0 * n + 3.0 if self.iso else n + 1.0) * kT * tp
        self._counts = n
        self._cell = self.batch.cell.detach().to(torch.float64).clone()
        self.p_cell = torch.zeros(n.shape[0], 9, dtype=torch.float64, device=dev)
        self._started_bath = self._bath()
        self._device_state()

    def _device_state(self) -> None:
        """The constants' device copies, the kernels and the step's scratch."""
        assert self._counts is not None and self._w is not None and self.p_cell is not None
        dev, n_sys = self.batch.device, self.p_cell.shape[0]
        self._n_dev, self._w_dev = self._tensor(self._counts), self._tensor(self._w)
        self._p_ext = torch.zeros(1, dtype=torch.float64, device=dev)
        self._p_ext_bar = math.nan
        self._e = torch.zeros(n_sys, 9, dtype=torch.float64, device=dev)
        self._phi = torch.zeros(n_sys, 9, dtype=torch.float64, device=dev)
        self._diverged.reset(dev)
        self._kernels = (
            SystemKernel(cell_kick_kernel, n_sys, dev),
            SystemKernel(propagators_kernel, n_sys, dev),
        )
        self._rows = RowKernel(dev)
        if self._cell is None:
            self._cell = self.batch.cell.detach().to(torch.float64).clone()
        if self._kin is None or self._stress is None:
            self._kin = torch.zeros(n_sys, 9, dtype=torch.float64, device=dev)
            self._stress = torch.zeros(n_sys, 9, dtype=torch.float64, device=dev)

    def graph_key(self) -> Hashable | None:
        """Its steps may be captured once the chains exist (after the first
        step): in-place updates, no host read; the time step, bath, target
        pressure and chains are baked in."""
        if self.thermostat is None or self.barostat is None or self._kernels is None:
            return None
        ids = (id(self.thermostat), id(self.barostat), id(self._kernels))
        return ("mtk-npt", self.dt_fs, *self._bath(), self.pressure_bar, *ids)

    # ---------------------------------------------------------- the pieces
    def _barostat_chain(self, d: float) -> None:
        assert self.barostat is not None and self.p_cell is not None
        p = self.p_cell
        sq = p[:, 0] * p[:, 0] if self.iso else (p * p).sum(dim=1)
        self.barostat.k2.copy_(sq / self._w_dev)
        scale = self.barostat.propagate_(d)
        p.mul_(scale.unsqueeze(1))
        self._diverged.mark(scale)

    def _thermostat_chain(self, d: float) -> None:
        assert self.thermostat is not None and self._kin is not None
        kin = self._kin
        self.thermostat.k2.copy_(kin[:, 0] + kin[:, 4] + kin[:, 8])
        scale = self.thermostat.propagate_(d)
        kin.mul_((scale * scale).unsqueeze(1))
        b = self.batch
        b.velocities.mul_(per_system_column(scale, b))
        self._diverged.mark(scale)

    def _cell_kick(self, d: float) -> None:
        assert self._kernels is not None and self._cell is not None and self.p_cell is not None
        if self._p_ext_bar != self.pressure_bar:  # (a changed pressure changes graph_key)
            self._p_ext.fill_(self.pressure_ext)
            self._p_ext_bar = self.pressure_bar
        kick = self._kernels[0]
        kick(self._kin, self._stress, self._cell.view(-1, 9), self._n_dev, self._p_ext,
             float(d), int(self.iso), self.p_cell)  # fmt: skip

    def _propagators(self, d: float, kick: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``exp(G)`` and ``Phi(G)`` of a kick or a drift over ``d``: rows of 9
        ``(S, 9)``, row-major 3x3."""
        assert self._kernels is not None
        self._kernels[1](self.p_cell, self._w_dev, self._n_dev, float(d), int(kick),
                         int(self.iso), self._e, self._phi)  # fmt: skip
        return self._e, self._phi

    def _kick(self, d: float) -> None:
        """Particle velocities under forces and the cell's friction, over ``d``."""
        assert self._rows is not None
        b = self.batch
        e, phi = self._propagators(d, kick=True)
        v = b.velocities
        self._rows(v, b.forces, b.masses, b.system_index, e, phi, d, True, v)
        # (no mark of the cell momentum here: a non-finite one makes the
        # barostat chain's scale non-finite by the end of the step, marked there)

    def _drift(self, d: float) -> None:
        """Positions and cell over ``d``: affine growth plus the particles' motion."""
        assert self._cell is not None and self._rows is not None
        b = self.batch
        e, phi = self._propagators(d, kick=False)
        x = b.positions
        self._rows(x, b.velocities, b.masses, b.system_index, e, phi, d, False, x)
        self._cell.copy_(torch.bmm(self._cell, e.view(-1, 3, 3)))
        self.batch = b.replace(cell=self._cell.to(b.dtype, copy=True))

    def _raise_diverged(self) -> None:
        raise ValidationError(
            f"MTKNPT diverged: a Nose-Hoover chain or the cell momentum is not finite "
            f"(cell momentum {host(self.p_cell).tolist()}, volume {self._volume().tolist()}, "
            f"target {self.pressure_bar} bar at {self.temperature_K} K). Start closer to "
            "the target (equilibrate first), or use longer tau_t_fs / tau_p_fs"
        )

    # ------------------------------------------------------------- the step
    def _bath(self) -> tuple[Any, ...]:
        """What the chains and the barostat mass are made of (not the pressure,
        which every step reads)."""
        return (self.temperature_K, self.tau_t_fs, self.tau_p_fs, self.cell_dof, self._chains)

    def pre_update(self) -> None:
        """Half steps of the barostat's and the particles' chains, a half kick of the
        cell and of the particles, then a full drift of positions and cell (the
        chains and the barostat start afresh, with one reduction, at the first step
        or a new bath)."""
        if self.p_cell is not None and self._bath() != self._started_bath:
            self.p_cell = None  # a new target (annealing): a fresh start at this step
        if self.p_cell is None or self.thermostat is None:
            self._start()
        half = 0.5 * self.dt
        self._barostat_chain(half)
        self._thermostat_chain(half)
        self._cell_kick(half)
        self._kick(half)
        self._drift(self.dt)

    def post_update(self) -> None:
        """The second half kick of the particles, the step's one reduction
        (**Collective** under DD), then the cell's kick and both chains' half steps."""
        half = 0.5 * self.dt
        self._kick(half)
        self._reduce()
        self._cell_kick(half)
        self._thermostat_chain(half)
        self._barostat_chain(half)
        self._diverged.queue()
