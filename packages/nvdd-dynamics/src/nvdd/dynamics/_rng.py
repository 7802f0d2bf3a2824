"""Counter-based Gaussian noise keyed by (seed, step, atom id).

A distributed Langevin trajectory equals the single-process one only if every
atom draws the same noise wherever it lives. A stateless hash of
``(seed, step, atom_id, component)`` gives each atom its own stream, independent
of its row, its rank and of how many atoms other ranks hold.
"""

from __future__ import annotations

import math

import torch

__all__ = ["atom_normal"]

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # A 32-bit avalanche hash (xorshift-multiply rounds) evaluated in int64 with
    # explicit masking, so it is exact and identical on every device.
    x = x & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return ((x >> 16) ^ x) & _M32


def _uniform(seed: int, step: int | torch.Tensor, ids: torch.Tensor, stream: int) -> torch.Tensor:
    h = _mix32(ids.to(torch.int64) * 0x9E3779B1 + (seed & _M32))
    # an int64 tensor step wraps its product modulo 2**64: the low 32 bits kept
    # by the mask are those of the exact product, so both forms agree
    h = _mix32(h ^ ((step * 0x85EBCA6B + stream * 0xC2B2AE35) & _M32))
    h = _mix32(h + (ids.to(torch.int64) >> 32))
    # (h + 0.5) / 2**32 lies strictly inside (0, 1).
    return (h.to(torch.float64) + 0.5) / 4294967296.0


def atom_normal(
    seed: int,
    step: int | torch.Tensor,
    atom_ids: torch.Tensor,
    *,
    dtype: torch.dtype,
    components: int = 3,
) -> torch.Tensor:
    """Standard normal noise, shape ``(n_atoms, components)``, a function of
    ``(seed, step, atom_id)`` only (Box-Muller over two hashed uniforms).

    ``step`` may be an int64 0-dim tensor on the atoms' device (the same noise):
    a captured step reads it from the device."""
    cols = []
    for c in range(components):
        u1 = _uniform(seed, step, atom_ids, 2 * c)
        u2 = _uniform(seed, step, atom_ids, 2 * c + 1)
        cols.append(torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2))
    return torch.stack(cols, dim=1).to(dtype)
