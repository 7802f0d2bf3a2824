"""Nose-Hoover chains on the atoms' device: one Warp launch per half step.

:class:`~nvdd.dynamics.NoseHooverChain` integrates the chains on the host, so an
NVT step must copy the kinetic energy to the host (a synchronisation) and the
scale factors back, and cannot be captured in a CUDA graph. A chain half step is
a few hundred operations on a few numbers per system: as torch operations that is
hundreds of tiny launches, as one Warp kernel (one thread per system, the whole
Suzuki-Yoshida sweep in registers) it is one launch, recorded once and replayed.
:class:`DeviceNoseHooverChain` keeps its state (link positions and momenta, the
kinetic energy it thermostats, the last scale factors) in float64 tensors on the
device, updated in place, so a step that uses it can be captured.

The arithmetic is that of :class:`~nvdd.dynamics.NoseHooverChain` (the same
operations in the same order, float64); the sub-step count is the same function
of the chain's constants (:func:`~nvdd.dynamics._nose_hoover.chain_sub_steps`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import warp as wp

from nvdd.core import RecordedKernel
from nvdd.dynamics._nose_hoover import (
    MAX_CHAIN_LOOPS,
    SUZUKI_YOSHIDA_4,
    Array,
    ChainState,
    chain_sub_steps,
    check_chain_constants,
)

__all__ = ["DeviceNoseHooverChain"]

_F64 = wp.float64


@wp.func
def _kick(
    p: wp.array2d(dtype=_F64),  # type: ignore[valid-type]
    q: wp.array2d(dtype=_F64),  # type: ignore[valid-type]
    s: int,
    j: int,
    k2: _F64,
    target: _F64,
    kT: _F64,
    d: _F64,
) -> None:
    """Link ``j``'s momentum over ``d`` (``NoseHooverChain._kick``)."""
    last = p.shape[1] - 1
    force = k2 - target
    if j > 0:
        force = p[s, j - 1] * p[s, j - 1] / q[s, j - 1] - kT
    if j < last:
        damp = wp.exp(_F64(-0.25) * d * p[s, j + 1] / q[s, j + 1])
        p[s, j] = (p[s, j] * damp + _F64(0.5) * d * force) * damp
    else:
        p[s, j] = p[s, j] + _F64(0.5) * d * force


@wp.kernel
def _half_step(
    k2: wp.array(dtype=_F64),  # type: ignore[valid-type]
    p: wp.array2d(dtype=_F64),  # type: ignore[valid-type]
    xi: wp.array2d(dtype=_F64),  # type: ignore[valid-type]
    q: wp.array2d(dtype=_F64),  # type: ignore[valid-type]
    target: wp.array(dtype=_F64),  # type: ignore[valid-type]
    weights: wp.array(dtype=_F64),  # type: ignore[valid-type]
    kT: _F64,
    dt: _F64,
    n: int,
    scale: wp.array(dtype=_F64),  # type: ignore[valid-type]
) -> None:
    """System ``s``'s chain over ``dt`` in ``n`` Suzuki-Yoshida sub-steps; its
    momenta's ``k2`` becomes ``k2 * scale**2`` (``NoseHooverChain.propagate``)."""
    s = wp.tid()
    links = p.shape[1]
    k = k2[s]
    factor_total = _F64(1.0)
    for _ in range(n):
        for w in range(weights.shape[0]):
            d = weights[w] * dt / _F64(n)
            for jj in range(links):
                _kick(p, q, s, links - 1 - jj, k, target[s], kT, d)  # type: ignore[arg-type]
            for j in range(links):
                xi[s, j] = xi[s, j] + d * p[s, j] / q[s, j]
            factor = wp.exp(-d * p[s, 0] / q[s, 0])
            moved = k * factor * factor
            for j in range(links):
                _kick(p, q, s, j, moved, target[s], kT, d)  # type: ignore[arg-type]
            factor_total = factor_total * factor
            k = k * factor * factor
    scale[s] = factor_total
    k2[s] = k


class DeviceNoseHooverChain(ChainState):
    """One Nose-Hoover chain per system, integrated on ``device`` (module notes).

    Parameters
    ----------
    n_dof, kT, masses, n_loops, max_loops:
        As :class:`~nvdd.dynamics.NoseHooverChain` (host values: constants).
    device:
        Where the state lives and the kernel runs (the atoms' device).

    Attributes
    ----------
    xi, p_xi:
        float64 tensors ``(n_systems, length)`` on ``device``.
    k2:
        float64 tensor ``(n_systems,)``: twice the kinetic energy of the momenta
        the chain acts on. Set it (in place) from the step's reduction;
        :meth:`propagate_` scales it as it scales the momenta.
    scale:
        float64 tensor ``(n_systems,)``: the factors of the last half step.
    """

    def __init__(
        self,
        n_dof: Any,
        kT: float,
        masses: Any,
        n_loops: int = 1,
        max_loops: int = MAX_CHAIN_LOOPS,
        *,
        device: torch.device | str = "cpu",
    ) -> None:
        dof, q = check_chain_constants(n_dof, kT, masses, n_loops, max_loops)
        self.n_dof, self.kT, self.masses = dof, float(kT), q
        self.n_loops, self.max_loops = int(n_loops), int(max_loops)
        self.device = torch.device(device)
        dev, f64 = self.device, torch.float64
        self.xi = torch.zeros(q.shape, dtype=f64, device=dev)
        self.p_xi = torch.zeros(q.shape, dtype=f64, device=dev)
        self.k2 = torch.zeros(q.shape[0], dtype=f64, device=dev)
        self.scale = torch.ones(q.shape[0], dtype=f64, device=dev)
        self._q = torch.as_tensor(q, dtype=f64, device=dev)
        self._target = torch.as_tensor(dof * self.kT, dtype=f64, device=dev)
        self._weights = torch.tensor(SUZUKI_YOSHIDA_4, dtype=f64, device=dev)
        self._kernel = RecordedKernel(_half_step, doubles=(6, 7))
        self._loops: dict[float, int] = {}
        self.last_loops = self.n_loops

    def sub_steps(self, dt: float) -> int:
        """Sub-steps of a half step of ``dt`` (``NoseHooverChain.sub_steps``)."""
        return chain_sub_steps(self.n_dof, self.masses, self.kT, dt, self.n_loops, self.max_loops)

    def propagate_(self, dt: float) -> torch.Tensor:
        """Advance the chains by ``dt`` against :attr:`k2`, in place (one launch,
        no host synchronisation; capturable). Returns :attr:`scale`: multiply
        the momenta of system ``s`` by ``scale[s]`` (non-finite when the chain
        diverged)."""
        dt = float(dt)
        n = self._loops.get(dt)
        if n is None:
            n = self._loops[dt] = self.sub_steps(dt)
        self.last_loops = n
        tensors = (self.k2, self.p_xi, self.xi, self._q, self._target, self._weights)
        args = (*tensors, self.kT, dt, n, self.scale)
        # (one recorded launch per time step: its tensors never move, a call resets nothing)
        self._kernel(int(self.k2.shape[0]), args, self.device, role=dt)
        return self.scale

    @classmethod
    def from_state(
        cls,
        arrays: Mapping[str, Any],
        prefix: str,
        kT: float,
        n_loops: int,
        device: torch.device | str,
    ) -> DeviceNoseHooverChain:
        """The chain :meth:`state` saved, on ``device``."""
        chain = cls(arrays[prefix + "n_dof"], kT, arrays[prefix + "masses"], n_loops, device=device)
        chain._load(arrays, prefix)
        return chain

    def _store(self, name: str, value: Array) -> None:
        getattr(self, name).copy_(torch.from_numpy(value))
