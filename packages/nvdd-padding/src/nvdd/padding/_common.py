"""Helpers shared by the padders: input checks, row padding, far-away positions."""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType

import torch

from nvdd.core import ConfigurationError, ValidationError, get_rank

__all__ = [
    "check_fields",
    "check_index",
    "check_padder_config",
    "frozen_fills",
    "pad_fields",
    "pad_rows",
    "take_rows",
]


def frozen_fills(name: str, fills: object) -> Mapping[str, float]:
    """A read-only copy of a ``{field: fill value}`` mapping, checked."""
    if not isinstance(fills, Mapping):
        raise ConfigurationError(f"{name} must be a mapping of field name to value, got {fills!r}")
    out: dict[str, float] = {}
    for key, value in fills.items():
        if not isinstance(key, str):
            raise ConfigurationError(f"{name} keys must be field names (str), got {key!r}")
        if not isinstance(value, int | float) or (isinstance(value, float) and math.isnan(value)):
            raise ConfigurationError(f"{name}[{key!r}] must be a real number, got {value!r}")
        out[key] = value
    return MappingProxyType(out)


def check_padder_config(
    kind: str, name: object, growth: object, multiples: Mapping[str, object], spacing: object
) -> None:
    """Raise :class:`ConfigurationError` naming the first bad constructor value."""
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"{kind}: name must be a non-empty str, got {name!r}")
    if (
        isinstance(growth, bool)
        or not isinstance(growth, int | float)
        or not math.isfinite(growth)
        or growth < 1.0
    ):
        raise ConfigurationError(f"{kind}: growth must be a finite number >= 1, got {growth!r}")
    for field, value in multiples.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"{kind}: {field} must be an int >= 1, got {value!r}")
    if (
        isinstance(spacing, bool)
        or not isinstance(spacing, int | float)
        or not math.isfinite(spacing)
        or spacing <= 0
    ):
        raise ConfigurationError(f"{kind}: spacing must be a finite number > 0, got {spacing!r}")


def check_index(
    name: str, value: object, shape: tuple[int | None, ...], device: torch.device | None = None
) -> str | None:
    """Describe why ``value`` is not an integer tensor of ``shape`` (None = any size)."""
    if not isinstance(value, torch.Tensor):
        return f"{name} must be a torch.Tensor, got {type(value).__name__}"
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        return f"{name} must be an integer tensor, got dtype {value.dtype}"
    if value.ndim != len(shape) or any(
        want is not None and got != want for got, want in zip(value.shape, shape, strict=True)
    ):
        want_s = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        return f"{name} has shape {tuple(value.shape)}, expected {want_s}"
    if device is not None and value.device != device:
        return f"{name} is on {value.device}, expected {device}"
    return None


def check_fields(
    kind: str,
    fields: object,
    lead: tuple[int, ...],
    device: torch.device,
    positions_field: str | None = None,
) -> str | None:
    """Describe why ``fields`` is not ``{name: tensor}`` with leading dims ``lead``."""
    if not isinstance(fields, Mapping):
        return f"{kind} must be a mapping of name to tensor, got {type(fields).__name__}"
    for key, value in fields.items():
        if not isinstance(value, torch.Tensor):
            return f"{kind}[{key!r}] must be a torch.Tensor, got {type(value).__name__}"
        if tuple(value.shape[: len(lead)]) != lead:
            return (
                f"{kind}[{key!r}] has shape {tuple(value.shape)}, expected leading dimensions "
                f"{lead}"
            )
        if value.device != device:
            return f"{kind}[{key!r}] is on {value.device}, expected {device}"
        if key == positions_field and (
            value.ndim != 2 or value.shape[1] != 3 or not value.is_floating_point()
        ):
            return (
                f"{kind}[{key!r}] (the positions field) must be floating with shape "
                f"({lead[0]}, 3), got {value.dtype} {tuple(value.shape)}"
            )
    return None


def pad_rows(x: torch.Tensor, cap: int, fill: float) -> torch.Tensor:
    """``x`` (shape ``(n, ...)``) followed by ``cap - n`` rows of ``fill``.

    Autograd flows through the real rows; the padding rows are constants.
    """
    n = x.shape[0]
    if n == cap:
        return x
    return torch.cat([x, x.new_full((cap - n, *x.shape[1:]), fill)])


def far_rows(positions: torch.Tensor, n_pad: int, spacing: float) -> torch.Tensor:
    """Positions of ``n_pad`` padding atoms, shape ``(n_pad, 3)``, far from everything.

    Padding atom ``j`` sits at ``anchor + (j + 1) * spacing`` along x, where
    ``anchor`` is the coordinate-wise maximum of the real positions (the origin
    without real atoms): every pair involving a padding atom is at least
    ``spacing`` apart. Constants (no autograd).
    """
    real = positions.detach()
    if real.shape[0] > 0:
        anchor = real.amax(dim=0)
    else:
        anchor = real.new_zeros(3)
    block = anchor.expand(n_pad, 3).clone()
    block[:, 0] += spacing * torch.arange(1, n_pad + 1, dtype=real.dtype, device=real.device)
    return block


def pad_fields(
    fields: Mapping[str, torch.Tensor],
    cap: int,
    fills: Mapping[str, float],
    positions_field: str | None = None,
    spacing: float = 0.0,
) -> dict[str, torch.Tensor]:
    """Pad every field's first dimension to ``cap`` (positions placed far away)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in fields.items():
        n = value.shape[0]
        if key == positions_field and cap > n:
            out[key] = torch.cat([value, far_rows(value, cap - n, spacing)])
        else:
            out[key] = pad_rows(value, cap, fills.get(key, 0))
    return out


def take_rows(x: torch.Tensor, n: int, cap: int, what: str) -> torch.Tensor:
    """The first ``n`` rows of ``x``, whose first dimension must be ``cap``."""
    if not isinstance(x, torch.Tensor) or x.ndim == 0 or x.shape[0] != cap:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValidationError(
            f"rank {get_rank()}: a padded per-{what} tensor must have {cap} rows "
            f"(the {what} capacity), got shape {shape}"
        )
    return x[:n]
