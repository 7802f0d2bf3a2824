"""Grow-only, rank-agreed capacities: the padded sizes that keep compiled shapes fixed.

A capacity is a padded size for one named count (``"coo.atoms"``, ``"coo.edges"``,
...). It only ever grows, grows geometrically with headroom when it must, is a
multiple of a chosen granule, and, with a process group, is the same on every
rank. The state (one int per key, the growth history and its listeners) lives in
an explicit :class:`CapacityRegistry`; :func:`resolve_cap` falls back to one
process-wide default registry only when none is passed.
"""

from __future__ import annotations

import math
import operator
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, SupportsIndex, TypeGuard

import torch

from nvdd.core import (
    ConfigurationError,
    NvddError,
    all_reduce,
    comm_device,
    get_rank,
    get_world_size,
    raise_if_any_rank,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "DEFAULT_GROWTH",
    "DEFAULT_MULTIPLE",
    "CapacityRegistry",
    "GrowthEvent",
    "GrowthListener",
    "default_registry",
    "resolve_cap",
]

#: Default geometric growth factor: a new capacity is at least ``growth * need``.
DEFAULT_GROWTH = 1.25
#: Default granule: capacities are multiples of it.
DEFAULT_MULTIPLE = 8


@dataclass(frozen=True)
class GrowthEvent:
    """One capacity change of one key (the first allocation included).

    Attributes
    ----------
    key:
        The capacity's name.
    old:
        The capacity before, 0 when the key was new.
    new:
        The capacity after (the same on every rank of the group that resolved it).
    need:
        What this rank asked for (``real + extra``); another rank may have asked
        for more.
    rank:
        The global rank that recorded the event.
    """

    key: str
    old: int
    new: int
    need: int
    rank: int


#: A callback told of every :class:`GrowthEvent`, right after the registry changed.
GrowthListener = Callable[[GrowthEvent], None]


class CapacityRegistry:
    """Grow-only capacities by key, with their growth history.

    Pass one registry to every :func:`resolve_cap` call (and padder) of one model
    or run; a padder owns a fresh one unless given another. Not thread-safe.

    Two counters serve benchmarks: :meth:`n_growths` counts per-key changes, and
    :attr:`n_reshapes` counts the resolutions (one :func:`resolve_cap` call, or one
    ``pad`` of a padder, which resolves all its keys together) that changed at
    least one capacity: for a registry owned by one padder it is the number of
    distinct padded shapes produced, i.e. the compilations a shape-specialised
    compiled model needs.
    """

    def __init__(self) -> None:
        self._caps: dict[str, int] = {}
        self._events: list[GrowthEvent] = []
        self._listeners: list[GrowthListener] = []
        self._reshapes = 0

    def get(self, key: str) -> int | None:
        """The capacity of ``key``, or None if it was never resolved."""
        return self._caps.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._caps

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._caps))

    def __len__(self) -> int:
        return len(self._caps)

    def snapshot(self) -> dict[str, int]:
        """A copy of every capacity, by key."""
        return dict(self._caps)

    @property
    def events(self) -> tuple[GrowthEvent, ...]:
        """Every growth so far, oldest first."""
        return tuple(self._events)

    @property
    def n_reshapes(self) -> int:
        """Resolutions that changed at least one capacity (see the class docstring)."""
        return self._reshapes

    def n_growths(self, key: str | None = None) -> int:
        """Growth events of ``key`` (default: of every key)."""
        if key is None:
            return len(self._events)
        return sum(1 for e in self._events if e.key == key)

    def add_listener(self, listener: GrowthListener) -> None:
        """Call ``listener(event)`` after every future growth."""
        self._listeners.append(listener)

    def remove_listener(self, listener: GrowthListener) -> None:
        """Stop calling ``listener``; a listener never added is ignored."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    def clear(self) -> None:
        """Forget every capacity and event (listeners stay).

        The next resolution of every key starts afresh, so shapes change: meant for
        a new simulation, never between steps of one. With a process group, every
        rank must clear together.
        """
        self._caps.clear()
        self._events.clear()
        self._reshapes = 0

    def _commit(self, keys: Sequence[str], caps: Sequence[int], needs: Sequence[int]) -> bool:
        """Store agreed capacities; record and announce the growths. True if any."""
        rank = get_rank()
        grown: list[GrowthEvent] = []
        for key, cap, need in zip(keys, caps, needs, strict=True):
            old = self._caps.get(key)
            if old is None or cap > old:
                self._caps[key] = cap
                grown.append(GrowthEvent(key, old or 0, cap, need, rank))
        if grown:
            self._reshapes += 1
            self._events.extend(grown)
            for event in grown:
                for listener in list(self._listeners):
                    listener(event)
        return bool(grown)

    def __repr__(self) -> str:
        return f"CapacityRegistry({self._caps!r}, n_growths={len(self._events)})"


_DEFAULT_REGISTRY = CapacityRegistry()


def default_registry() -> CapacityRegistry:
    """The process-wide registry :func:`resolve_cap` uses when given none.

    Prefer an explicit registry: keys of unrelated callers share this one.
    """
    return _DEFAULT_REGISTRY


@dataclass(frozen=True)
class CapRequest:
    """One capacity to resolve (internal): ``need = real + extra``."""

    key: str
    need: int
    growth: float
    multiple: int


#: What a valid growth factor is (for messages: ``f"{GROWTH_RULE}, got {value!r}"``).
GROWTH_RULE = "growth must be a finite number >= 1"


def is_growth(value: object) -> TypeGuard[float]:
    """True for a finite int or float >= 1 (a bool is not a number)."""
    return (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and value >= 1.0
    )


def check_request(
    key: object, real: object, extra: object, growth: object, multiple: object
) -> tuple[CapRequest | None, str | None]:
    """Validate the arguments of one request; return it, or the error message."""
    if not isinstance(key, str) or not key:
        return None, f"capacity key must be a non-empty str, got {key!r}"
    values: dict[str, int] = {}
    for name, value, low in (("real", real, 0), ("extra", extra, 0), ("multiple", multiple, 1)):
        try:
            if isinstance(value, bool):
                raise TypeError
            values[name] = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            return None, f"{key}: {name} must be an int, got {value!r}"
        if values[name] < low:
            return None, f"{key}: {name} must be >= {low}, got {values[name]}"
    if not is_growth(growth):
        return None, f"{key}: {GROWTH_RULE}, got {growth!r}"
    need = values["real"] + values["extra"]
    return CapRequest(key, need, float(growth), values["multiple"]), None


def propose(current: int | None, request: CapRequest) -> int:
    """This rank's capacity for ``request`` given the ``current`` one (internal)."""
    if current is not None and request.need <= current:
        return current
    # Exact decimal arithmetic: 100 * 1.1 is 110, not 111.
    target = max(request.need, math.ceil(request.need * Fraction(repr(request.growth))))
    target = max(target, request.multiple)
    return -(-target // request.multiple) * request.multiple


def _keys_hash(keys: Sequence[str]) -> int:
    return zlib.crc32("\x1f".join(keys).encode())


def resolve_many(
    registry: CapacityRegistry,
    requests: Sequence[CapRequest],
    keys: Sequence[str],
    group: ProcessGroup | None,
    error: str | None,
    exc_type: type[NvddError] = ConfigurationError,
) -> tuple[list[int], bool]:
    """Resolve several capacities at once; return them and whether any grew.

    **Collective** over ``group`` when one is given (and it has more than one
    rank): one all-reduce (MAX) of a small int64 tensor holding every proposal,
    this rank's error flag and a hash of ``keys``. Every rank must call it with
    the same ``keys`` in the same order. A rank with an ``error`` (then
    ``requests`` may be empty) makes every rank raise ``exc_type`` together.
    """
    if error is None and len(requests) != len(keys):  # pragma: no cover - internal misuse
        raise ValueError("resolve_many: one request per key")
    proposals = [0] * len(keys) if error is not None else []
    if error is None:
        proposals = [propose(registry.get(r.key), r) for r in requests]
    if group is None or get_world_size(group) == 1:
        if error is not None:
            raise exc_type(f"rank {get_rank()}: {error}")
        caps = proposals
    else:
        h = _keys_hash(keys)
        t = torch.tensor(
            [*proposals, int(error is not None), h, -h],
            dtype=torch.int64,
            device=comm_device(group),
        )
        all_reduce(t, "max", group)
        reduced = [int(v) for v in t.tolist()]
        if reduced[-3]:
            raise_if_any_rank(error, group, exc_type=exc_type)
            raise exc_type(f"rank {get_rank()}: a peer failed")  # pragma: no cover
        if reduced[-2] != -reduced[-1]:
            raise ConfigurationError(
                f"rank {get_rank()}: capacity keys differ across ranks (this rank resolved "
                f"{list(keys)!r}); every rank must resolve the same keys in the same order"
            )
        caps = reduced[: len(keys)]
    grew = registry._commit(keys, caps, [r.need for r in requests])
    return caps, grew


def resolve_cap(
    key: str,
    real: SupportsIndex,
    extra: SupportsIndex = 0,
    *,
    growth: float = DEFAULT_GROWTH,
    multiple: SupportsIndex = DEFAULT_MULTIPLE,
    group: ProcessGroup | None = None,
    registry: CapacityRegistry | None = None,
) -> int:
    """Grow-only fixed-shape capacity for ``key``, ``>= real + extra``.

    The capacity of ``key`` is kept in ``registry``. While ``real + extra`` fits,
    the stored capacity is returned unchanged (so compiled shapes stay the same).
    When it does not fit (or the key is new), the capacity becomes
    ``ceil(growth * (real + extra))`` rounded up to a multiple of ``multiple`` (and
    at least ``multiple``): geometric growth with headroom, so a slowly drifting
    count triggers O(log) recompilations instead of one per step. Capacities never
    shrink. With ``group``, the capacity is the maximum of every rank's proposal,
    so every rank compiles the same shapes.

    **Collective** over ``group`` when one is given: one all-reduce of a small
    int64 tensor; every rank of ``group`` must call it with the same keys in the
    same order (a mismatch of keys is detected and raised on every rank). With
    ``group=None`` (default) nothing is communicated; pass
    ``torch.distributed.group.WORLD`` to agree over the whole job.

    Parameters
    ----------
    key:
        The capacity's name, e.g. ``"coo.edges"``.
    real:
        The real count now (>= 0).
    extra:
        Rows to reserve beyond ``real`` (>= 0), e.g. a padding row.
    growth:
        Factor >= 1 applied to the need when the capacity grows.
    multiple:
        Granule >= 1 the capacity is rounded up to (8 or 32 suit GPUs).
    group:
        Process group to agree over, or None for a rank-local capacity.
    registry:
        Where the capacity lives; default :func:`default_registry`.

    Returns
    -------
    int
        The capacity, a positive multiple of ``multiple`` and ``>= real + extra``.

    Raises
    ------
    ConfigurationError
        On every rank of ``group`` when any rank passed a bad value (negative
        count, ``extra < 0``, ``growth < 1``, ``multiple < 1``, a key that is not a
        str) or the ranks resolved different keys; the message names the rank and
        the value.
    """
    reg = default_registry() if registry is None else registry
    request, error = check_request(key, real, extra, growth, multiple)
    caps, _ = resolve_many(reg, [request] if request is not None else [], [str(key)], group, error)
    return caps[0]
