"""`reshard_by_destination`: move rows (atoms) to the rank that will own them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from nvdd.core import (
    ValidationError,
    all_to_all_single,
    comm_device,
    get_rank,
    get_world_size,
    raise_if_any_rank,
)
from nvdd.halo._packing import RowLayout, pack_rows, row_layout, unpack_rows

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["reshard_by_destination"]

# Columns of the small header every rank sends to every peer.
_COUNT, _FAILED, _DIGEST = 0, 1, 2
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _check(
    names: list[str], tensors: list[torch.Tensor], destination: object, world: int
) -> str | None:
    """What is wrong with this rank's input (None when nothing is)."""
    if not isinstance(destination, torch.Tensor):
        return f"destination must be a torch.Tensor, got {type(destination).__name__}"
    if destination.ndim != 1:
        return f"destination has shape {tuple(destination.shape)}, expected (n,)"
    if destination.dtype not in _INT_DTYPES:
        return f"destination has dtype {destination.dtype}, expected int64"
    n = int(destination.shape[0])
    for name, t in zip(names, tensors, strict=True):
        if not isinstance(t, torch.Tensor):
            return f"field {name!r} must be a torch.Tensor, got {type(t).__name__}"
        if t.ndim < 1 or int(t.shape[0]) != n:
            return (
                f"field {name!r} has shape {tuple(t.shape)}, expected first dimension {n} "
                f"(the length of destination)"
            )
        if t.device != destination.device:
            return f"field {name!r} is on {t.device}, destination on {destination.device}"
    if n:
        bad = (destination < 0) | (destination >= world)
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            return (
                f"destination[{row}] = {int(destination[row])} is outside [0, {world}) "
                f"(the group has {world} ranks; {int(bad.sum())} bad row(s) of {n})"
            )
    return None


def reshard_by_destination(
    fields: Mapping[str, torch.Tensor],
    destination: torch.Tensor,
    group: ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    """Send every row of ``fields`` to the rank ``destination`` names.

    **Collective** over ``group`` (default: the default group): every rank of the
    group must call it, with the same field names, dtypes and trailing shapes
    (row counts may differ). Two collectives: one ``all_to_all_single`` of a
    small header (counts, failure flag, layout fingerprint), then one
    ``all_to_all_single`` of every field's rows packed as bytes in one buffer.

    Parameters
    ----------
    fields:
        Named tensors with a common first dimension ``n`` (rows), any dtypes
        (float32/64, int64, bool, ...) and trailing shapes, on one device.
    destination:
        Integer tensor, shape ``(n,)``, on the fields' device: the new owner
        rank of every row, in ``[0, world_size)`` of ``group``.
    group:
        The process group; ``None`` means the default group.

    Returns
    -------
    dict of str to torch.Tensor
        The rows this rank receives, keyed as ``fields`` with the same dtypes,
        trailing shapes and device, ordered by source rank, then by the row
        order on the source. Without a process group (or in a world of one
        rank) the input tensors themselves are returned. Not differentiable
        (values are moved as bytes).

    Raises
    ------
    ValidationError
        On every rank together, when any rank passed a destination outside
        ``[0, world_size)``, mismatched shapes or devices, or a field layout that
        differs from another rank's; the message names each failing rank and
        the offending value.
    """
    names = list(fields)
    tensors = [fields[k] for k in names]
    world = get_world_size(group)
    message = _check(names, tensors, destination, world)
    if world == 1:
        raise_if_any_rank(message, group)
        return dict(fields)

    layout: RowLayout | None = None
    if message is None:
        layout = row_layout(names, tensors)
    dev = comm_device(group)
    header = torch.zeros(world, 3, dtype=torch.int64)
    if layout is not None:
        header[:, _COUNT] = torch.bincount(destination.long(), minlength=world).cpu()
        header[:, _DIGEST] = layout.digest()
    header[:, _FAILED] = int(message is not None)
    received = torch.empty_like(header, device=dev)
    all_to_all_single(received, header.to(dev), group=group)
    received = received.cpu()

    # Every rank got every rank's flag and fingerprint, so this test has the same
    # outcome everywhere: nobody is left waiting in the data exchange below.
    failed = bool(received[:, _FAILED].any())
    if failed or layout is None or bool((received[:, _DIGEST] != received[0, _DIGEST]).any()):
        if message is None and not failed and layout is not None:
            message = f"field layout {layout.describe()} differs between ranks"
        raise_if_any_rank(message, group)
        raise ValidationError(  # pragma: no cover - raise_if_any_rank raised already
            f"rank {get_rank(group)}: reshard_by_destination failed on another rank"
        )

    send_counts = header[:, _COUNT].tolist()
    recv_counts = received[:, _COUNT].tolist()
    order = torch.argsort(destination, stable=True)
    n_recv = int(sum(recv_counts))
    if layout.row_bytes == 0:
        out = torch.empty(n_recv, 0, dtype=torch.uint8, device=destination.device)
    else:
        send = pack_rows(tensors, layout, index=order, device=dev)
        out = torch.empty(n_recv, layout.row_bytes, dtype=torch.uint8, device=dev)
        all_to_all_single(out, send, recv_counts, send_counts, group=group)
    return dict(zip(names, unpack_rows(out, layout, device=destination.device), strict=True))
