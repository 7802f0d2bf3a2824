"""Scatter helpers of `ShardedBatch.from_batch`: what ``src`` checks and broadcasts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from nvdd.core import Batch, ConfigurationError, NvddError, ValidationError
from nvdd.partition._comm import reshard
from nvdd.partition._spatial import SpatialPartitioner
from nvdd.partition._state import _State

__all__ = [
    "ERRORS",
    "Header",
    "PartitionerSource",
    "build_local",
    "checked_header",
    "landing_device",
    "local_rows",
    "src_header",
]

PartitionerSource = SpatialPartitioner | Callable[[Batch], SpatialPartitioner]
_H = TypeVar("_H")
ERRORS: dict[str, type[NvddError]] = {
    "ConfigurationError": ConfigurationError,
    "ValidationError": ValidationError,
}


@dataclass(frozen=True)
class Header:
    """What ``src`` broadcasts before scattering (small: no per-atom data)."""

    error: tuple[str, str] | None
    state: _State | None = None
    counts: tuple[int, ...] = ()
    atom_specs: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...] = ()
    systems: dict[str, torch.Tensor] | None = None
    system_extras: tuple[str, ...] = ()
    device_type: str = "cpu"


def src_header(
    batch: Batch | None, partitioner: PartitionerSource | None, world: int, wrap: bool, src: int
) -> tuple[Header, SpatialPartitioner | None, dict[str, torch.Tensor], torch.Tensor | None]:
    """Validate on ``src``; return the header, the partitioner, the rows and destinations."""
    try:
        if not isinstance(batch, Batch):
            raise ValidationError(f"from_batch needs a Batch on src, got {type(batch).__name__}")
        batch.validate()
        per_system = batch.atoms_per_system().tolist()
        empty = [s for s, c in enumerate(per_system) if c == 0]
        if empty:
            raise ValidationError(
                f"system(s) {empty} have no atoms (atoms per system {per_system})"
            )
        if partitioner is None:
            raise ConfigurationError("from_batch needs a partitioner (or a factory) on src")
        part = partitioner if isinstance(partitioner, SpatialPartitioner) else partitioner(batch)
        if not isinstance(part, SpatialPartitioner):
            raise ConfigurationError(
                f"the partitioner factory returned {type(part).__name__}, not a SpatialPartitioner"
            )
        if part.world_size != world:
            raise ConfigurationError(
                f"the partitioner has {part.world_size} boxes per system but the mesh has "
                f"{world} ranks"
            )
        if part.n_systems != batch.n_systems or not torch.equal(part.pbc, batch.pbc.cpu()):
            raise ConfigurationError(
                f"the partitioner was built for pbc {part.pbc.tolist()}, the batch has "
                f"{batch.pbc.tolist()}"
            )
        positions = batch.positions
        if wrap:
            positions = part.wrap_positions(positions, batch.system_index, cell=batch.cell)
        destination = part.owner_of(positions, batch.system_index, cell=batch.cell)
    except Exception as exc:  # any failure on src must reach every rank, not hang them
        name = type(exc).__name__
        text = f"rank {src}: {exc}" if name in ERRORS else f"rank {src}: {name}: {exc}"
        return Header(error=(name if name in ERRORS else "ValidationError", text)), None, {}, None
    fields = batch.atom_fields()
    fields["positions"] = positions
    header = Header(
        error=None,
        state=part._s,
        counts=tuple(torch.bincount(destination, minlength=world).tolist()),
        atom_specs=tuple((k, v.dtype, tuple(v.shape[1:])) for k, v in fields.items()),
        systems={k: v.detach().cpu() for k, v in batch.system_fields().items()},
        system_extras=tuple(batch.system_extras),
        device_type=batch.device.type,
    )
    return header, part, fields, destination


def build_local(
    rows: dict[str, torch.Tensor], systems: dict[str, torch.Tensor], system_extras: tuple[str, ...]
) -> Batch:
    core = {k: rows[k] for k in ("masses", "velocities", "forces", "system_index", "atom_ids")}
    return Batch(
        rows["positions"],
        rows["atomic_numbers"],
        cell=systems["cell"],
        pbc=systems["pbc"],
        energy=systems["energy"],
        stress=systems["stress"],
        atom_extras={
            k: v
            for k, v in rows.items()
            if k not in core and k not in ("positions", "atomic_numbers")
        },
        system_extras={k: systems[k] for k in system_extras},
        validate=False,
        **core,
    )


def checked_header(header: object, kind: type[_H], rank: int, src: int) -> _H:
    """The header ``src`` broadcast, checked on every rank: ``src``'s error is
    raised here as its own type (every rank raises together); a header that is
    not one, or has no system fields, is refused."""
    if not isinstance(header, kind):  # pragma: no cover - defensive
        raise ValidationError(f"rank {rank}: no header arrived from rank {src}")
    h: Any = header
    if h.error is not None:
        name, message = h.error
        raise ERRORS[name](message)
    if h.systems is None:  # pragma: no cover - defensive
        raise ValidationError(f"rank {rank}: incomplete header from rank {src}")
    return header


def landing_device(
    device: torch.device | str | None, sent_batch: Batch | None, device_type: str
) -> torch.device:
    """Where a rank's scattered rows land: ``device`` when given; on ``src`` (which
    passes the batch it sent) that batch's device; elsewhere a device of ``src``'s
    type ``device_type``, the current one for CUDA (each rank has its own GPU). Local.
    """
    if device is not None:
        return torch.device(device)
    if isinstance(sent_batch, Batch):
        return sent_batch.device
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def local_rows(
    header: Any,
    sent: tuple[dict[str, torch.Tensor], torch.Tensor] | None,
    batch: Batch | None,
    device: torch.device | str | None,
    group: Any,
) -> Batch:
    """This rank's local batch after a scatter from ``src``.

    ``sent``: on ``src``, its rows and their destination ranks; None on every
    other rank (it sends nothing). The batches land on ``device``; default:
    ``src``'s batch's device on ``src``, elsewhere ``src``'s device type (a CUDA
    batch lands on this rank's current CUDA device).

    **Collective** over ``group``: one packed ``reshard_by_destination``.
    """
    target = landing_device(device, batch if sent is not None else None, header.device_type)
    if sent is None:
        sent = (
            {
                name: torch.empty((0, *shape), dtype=dtype, device=target)
                for name, dtype, shape in header.atom_specs
            },
            torch.empty(0, dtype=torch.int64, device=target),
        )
    rows = {k: v.to(target) for k, v in reshard(*sent, group).items()}
    systems = {k: v.to(target) for k, v in header.systems.items()}
    return build_local(rows, systems, header.system_extras)
