"""Helpers shared by the padders: constructor and input checks, capacities, row padding,
far-away positions."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

import torch

from nvdd.core import ConfigurationError, ValidationError, get_rank
from nvdd.padding._cap import GROWTH_RULE, CapacityRegistry, CapRequest, is_growth, resolve_many

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "PaddedAtoms",
    "PadderConfig",
    "check_fields",
    "check_index",
    "count_problem",
    "frozen_fills",
    "init_padder",
    "pad_fields",
    "pad_rows",
    "range_problem",
    "require_padded",
    "resolve_padder_caps",
    "take_rows",
    "wrong_type",
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


class PadderConfig(Protocol):
    """The constructor values every built-in padder has (read as ``object`` to check them)."""

    @property
    def name(self) -> str: ...
    @property
    def growth(self) -> float: ...
    @property
    def spacing(self) -> float: ...
    @property
    def positions_field(self) -> str | None: ...
    @property
    def atom_fill(self) -> Mapping[str, float]: ...
    @property
    def registry(self) -> CapacityRegistry: ...


def init_padder(
    padder: PadderConfig, kind: str, multiples: Sequence[str], fills: Sequence[str]
) -> None:
    """The ``__post_init__`` of a built-in padder (a frozen dataclass named ``kind``).

    Checks ``name``, ``growth``, the ``multiples`` fields (ints >= 1) and
    ``spacing``; replaces each ``fills`` field by a read-only checked copy; checks
    that ``atom_fill`` leaves the positions field alone and that ``registry`` is
    a :class:`CapacityRegistry`.

    Raises
    ------
    ConfigurationError
        Naming ``kind`` and the first bad constructor value.
    """
    name: object = padder.name
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"{kind}: name must be a non-empty str, got {name!r}")
    growth: object = padder.growth
    if not is_growth(growth):
        raise ConfigurationError(f"{kind}: {GROWTH_RULE}, got {growth!r}")
    for field in multiples:
        value = getattr(padder, field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"{kind}: {field} must be an int >= 1, got {value!r}")
    spacing: object = padder.spacing
    if (
        isinstance(spacing, bool)
        or not isinstance(spacing, int | float)
        or not math.isfinite(spacing)
        or spacing <= 0
    ):
        raise ConfigurationError(f"{kind}: spacing must be a finite number > 0, got {spacing!r}")
    for attr in fills:
        object.__setattr__(padder, attr, frozen_fills(attr, getattr(padder, attr)))
    if padder.positions_field is not None and padder.positions_field in padder.atom_fill:
        raise ConfigurationError(
            f"{kind}: atom_fill names the positions field {padder.positions_field!r}, "
            "whose padding rows are always placed far away"
        )
    registry: object = padder.registry
    if not isinstance(registry, CapacityRegistry):
        raise ConfigurationError(f"{kind}: registry must be a CapacityRegistry, got {registry!r}")


def resolve_padder_caps(
    padder: PadderConfig,
    keys: Sequence[str],
    multiples: Sequence[int],
    needs: Callable[[], Sequence[int]],
    group: ProcessGroup | None,
    error: str | None,
) -> tuple[list[int], bool]:
    """The capacities of ``keys`` (and whether one grew) for a checked input.

    ``needs()`` gives the rows each key needs; it is called only when this rank's
    ``error`` is None (the input may be unusable otherwise).

    **Collective** over ``group`` when one is given: one all-reduce (see
    :func:`~nvdd.padding._cap.resolve_many`); every rank of ``group`` calls it
    with the same ``keys`` in the same order. An ``error`` on any rank raises
    :class:`ValidationError` on every rank.
    """
    requests = []
    if error is None:
        requests = [
            CapRequest(key, need, padder.growth, multiple)
            for key, need, multiple in zip(keys, needs(), multiples, strict=True)
        ]
    return resolve_many(padder.registry, requests, keys, group, error, ValidationError)


def wrong_type(where: str, value: object, cls: type) -> str | None:
    """``"<where> needs a <cls>, got <type>"`` unless ``value`` is a ``cls``."""
    if isinstance(value, cls):
        return None
    return f"{where} needs a {cls.__name__}, got {type(value).__name__}"


def require_padded(where: str, padded: object, cls: type) -> None:
    """Raise :class:`ValidationError` (naming this rank) unless ``padded`` is a ``cls``."""
    message = wrong_type(where, padded, cls)
    if message is not None:
        raise ValidationError(f"rank {get_rank()}: {message}")


def count_problem(name: str, value: object) -> str | None:
    """Why ``value`` is not an int >= 0 (a bool is not a count); None if it is."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return f"{name} must be an int >= 0, got {value!r}"
    return None


def range_problem(name: str, index: torch.Tensor, n: int) -> str | None:
    """Why the non-empty ``index`` has values outside ``[0, n)`` (one host sync)."""
    lo, hi = torch.stack([index.min(), index.max()]).tolist()
    if lo < 0 or hi >= n:
        return f"{name} must lie in [0, {n}), found min {lo} and max {hi}"
    return None


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


class PaddedAtoms:
    """The per-atom part of :class:`~nvdd.padding.PaddedGraph` that every built-in
    padded graph shares (a mixin: the frozen dataclasses declare the fields)."""

    atom_mask: torch.Tensor
    n_atoms: int

    @property
    def atom_cap(self) -> int:
        """The padded atom count."""
        return int(self.atom_mask.shape[0])

    def real_atoms(self, x: torch.Tensor) -> torch.Tensor:
        """The real rows of a per-atom tensor: ``(atom_cap, ...)`` to ``(n_atoms, ...)``.

        Raises :class:`~nvdd.core.ValidationError` on a first dimension other than
        ``atom_cap``.
        """
        return take_rows(x, self.n_atoms, self.atom_cap, "atom")


def take_rows(x: torch.Tensor, n: int, cap: int, what: str) -> torch.Tensor:
    """The first ``n`` rows of ``x``, whose first dimension must be ``cap``."""
    if not isinstance(x, torch.Tensor) or x.ndim == 0 or x.shape[0] != cap:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValidationError(
            f"rank {get_rank()}: a padded per-{what} tensor must have {cap} rows "
            f"(the {what} capacity), got shape {shape}"
        )
    return x[:n]
