"""`NoseHooverNVT`: canonical dynamics with a Nose-Hoover chain per system.

The step is velocity Verlet between two chain half steps. Everything a step does
after the first stays on the atoms' device: the one reduction per step
(:func:`~nvdd.dynamics._nose_hoover.reduce_step`: atom counts, ``sum m v . v``
and the energy, one all-reduce under DD) feeds a
:class:`~nvdd.dynamics._chain_device.DeviceNoseHooverChain` (one Warp launch per
half step) whose scale factors multiply the velocities in place. No value is
read on the host, so on a GPU a steady step is captured in a CUDA graph and
replayed like a velocity-Verlet step (``StepGraphs``); a diverged chain is
reported from a flag read without blocking (``DivergenceFlag``), at most a few
steps late on CUDA and at once on the CPU.
"""

from __future__ import annotations

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
from nvdd.dynamics._chain_device import DeviceNoseHooverChain
from nvdd.dynamics._finite import DivergenceFlag
from nvdd.dynamics._hooks import Hook
from nvdd.dynamics._integrators import ASE_TIME_PER_FS, KB_EV_PER_K, BaseDynamics
from nvdd.dynamics._nose_hoover import CHAIN_FIELDS, host, per_system_column, reduce_step

__all__ = ["NoseHooverNVT"]


class NoseHooverNVT(BaseDynamics):
    """Canonical (NVT) dynamics with a Nose-Hoover chain thermostat per system.

    One step: chain (dt/2), half kick, drift | forces | half kick, chain (dt/2).
    Degrees of freedom ``3 N`` per system (as ASE). The only global quantities,
    the atom count and kinetic energy, come from one reduction per step (plus one
    at the first step), which also completes the energy for
    :meth:`conserved_energy`. The chain runs on the atoms' device (module
    notes), so steady steps are captured in CUDA graphs on a GPU.

    Parameters
    ----------
    temperature_K:
        Target temperature, > 0.
    tau_fs:
        Thermostat time scale (fs); default ``100 * dt_fs``.
    chain_length:
        Links per chain (>= 1; default 3).
    n_loops:
        Thermostat sub-steps per half step (default 1; more are taken for a
        chain of many degrees of freedom, :meth:`NoseHooverChain.sub_steps`).

    Notes
    -----
    Setting ``temperature_K`` or ``tau_fs`` (``chain_length``, ``n_loops``)
    between steps, e.g. to anneal, restarts the thermostat at the next step: a
    fresh chain for the new bath, as a new ``NoseHooverNVT`` from the current
    state would be (the conserved energy restarts with it).
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
        self.chain: DeviceNoseHooverChain | None = None
        self._energy: torch.Tensor | None = None  # the last step's energy (device)
        self._diverged = DivergenceFlag(self._raise_diverged)
        self._chain_bath = self._bath()  # (temperature, tau, length, loops) of the chain

    @property
    def kT(self) -> float:
        """Target ``k_B T`` in eV."""
        return KB_EV_PER_K * self.temperature_K

    def graph_key(self) -> Hashable | None:
        """Its steps may be captured once the chain exists (after the first
        step): in-place updates, no host read; the time step, bath and chain are
        baked in."""
        if self.chain is None:
            return None
        params = (self.dt_fs, self.temperature_K, self.tau_fs, self.chain_length, self.n_loops)
        return ("nose-hoover", *params, id(self.chain))

    # ---------------------------------------------------------------- pieces
    def _reduce(self) -> torch.Tensor:
        """The step's one reduction (:func:`reduce_step`, device float64 rows);
        keeps the energy (device) and writes it into the batch."""
        summed, totals = reduce_step(self, ("energy",), kinetic="trace")
        energy = totals.get("energy")
        if energy is not None:
            self._energy = energy.to(torch.float64)
            self.batch = self.batch.replace(energy=energy.to(self.batch.dtype))
        return summed

    @staticmethod
    def _k2(summed: torch.Tensor) -> torch.Tensor:
        """Twice the kinetic energy, ``sum m v . v`` (column 1 of
        :func:`reduce_step`'s ``"trace"`` rows)."""
        return summed[:, 1]

    def _start(self) -> None:
        summed = self._reduce()
        counts = host(summed[:, 0])  # (the first step: one host read)
        if not bool((counts > 0).all()):
            raise ValidationError(f"every system needs atoms; counts are {counts.tolist()}")
        n_dof = 3.0 * counts
        tau = self.tau_fs * ASE_TIME_PER_FS
        q = np.full((n_dof.shape[0], self.chain_length), self.kT * tau * tau)
        q[:, 0] *= n_dof
        chain = DeviceNoseHooverChain(n_dof, self.kT, q, self.n_loops, device=self.batch.device)
        chain.k2.copy_(self._k2(summed))
        self._diverged.reset(self.batch.device)
        self.chain, self._chain_bath = chain, self._bath()

    def _thermostat(self) -> None:
        """A chain half step and the velocities scaled by it (in place); a
        non-finite factor sets the divergence flag (device, read once per step)."""
        assert self.chain is not None
        scale = self.chain.propagate_(0.5 * self.dt)
        b = self.batch
        b.velocities.mul_(per_system_column(scale, b))
        self._diverged.mark(scale)

    def _raise_diverged(self) -> None:
        assert self.chain is not None
        chain = self.chain
        raise ValidationError(
            f"Nose-Hoover chain diverged (scale factors {host(chain.scale).tolist()}, "
            f"{chain.last_loops} sub-steps); twice the kinetic energy is "
            f"{host(chain.k2).tolist()} against a target of {(chain.n_dof * chain.kT).tolist()}. "
            "A system far from the thermostat's temperature: equilibrate first (e.g. "
            "Langevin), or use a longer tau or more n_loops"
        )

    # ------------------------------------------------------------- the step
    def _bath(self) -> tuple[float, float, int, int]:
        """What the chain's constants are made of."""
        return (self.temperature_K, self.tau_fs, self.chain_length, self.n_loops)

    def pre_update(self) -> None:
        """A chain half step scaling the velocities, then a half kick and a drift (the
        chain starts afresh, with one reduction, at the first step or a new bath)."""
        if self.chain is not None and self._bath() != self._chain_bath:
            self.chain = None  # a new target (annealing): a fresh chain at this step
        if self.chain is None:
            self._start()
        self._thermostat()
        b = self.batch
        b.velocities.addcdiv_(b.forces, b.masses.unsqueeze(1), value=0.5 * self.dt)
        b.positions.add_(b.velocities, alpha=self.dt)

    def post_update(self) -> None:
        """The second half kick, the step's one reduction (**Collective** under DD),
        then a chain half step scaling the velocities."""
        b = self.batch
        b.velocities.addcdiv_(b.forces, b.masses.unsqueeze(1), value=0.5 * self.dt)
        assert self.chain is not None
        self.chain.k2.copy_(self._k2(self._reduce()))
        self._thermostat()
        self._diverged.queue()

    # ------------------------------------------------------ what is kept
    def conserved_energy(self) -> torch.Tensor:
        """The extended energy ``E_pot + E_kin + chain`` per system (float64, on the
        host), which the dynamics conserves; no communication (uses the last
        step's sums; reads the device).

        Raises
        ------
        ValidationError
            Before the first step, if the model returns no energy, or if the
            chain diverged.
        """
        if self.chain is None:
            raise ValidationError("conserved_energy: take a step first")
        self._diverged.check()
        if self._energy is None:
            raise ValidationError(
                f"conserved_energy: {type(self.model).__name__} returns no 'energy'"
            )
        k2 = host(self.chain.k2)
        return torch.from_numpy(host(self._energy) + 0.5 * k2 + self.chain.energy())

    def state_arrays(self) -> dict[str, Any]:
        """The chain, twice the kinetic energy it last saw and the last energy
        (none before the first step): what an exact restart needs."""
        if self.chain is None:
            return {}
        out: dict[str, Any] = {**self.chain.state("chain."), "k2": host(self.chain.k2)}
        if self._energy is not None:
            out["energy"] = host(self._energy)
        return out

    def load_state_arrays(self, arrays: Mapping[str, Any]) -> None:
        """Restore :meth:`state_arrays` (an empty mapping: the chain starts at the
        next step, as in a fresh run)."""
        unknown = set(arrays) - {"k2", "energy"} - {f"chain.{k}" for k in CHAIN_FIELDS}
        if unknown:
            raise ConfigurationError(f"NoseHooverNVT: unknown saved state {sorted(unknown)}")
        self.chain, self._energy = None, None
        if not arrays:
            return
        device = self.batch.device
        chain = DeviceNoseHooverChain.from_state(arrays, "chain.", self.kT, self.n_loops, device)
        chain.k2.copy_(torch.as_tensor(host(arrays["k2"])))
        if "energy" in arrays:
            self._energy = torch.as_tensor(host(arrays["energy"]), device=device)
        self._diverged.reset(device)
        self.chain, self._chain_bath = chain, self._bath()
