"""Row packing: several per-row tensors of any dtype in one ``uint8`` buffer.

Every field's row is reinterpreted as bytes (no conversion, so integers, bools
and floats travel bit-exactly) and the rows of all fields are laid side by side,
giving a buffer of shape ``(n_rows, row_bytes)`` that one collective can move.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["FieldLayout", "RowLayout", "pack_rows", "row_layout", "unpack_rows"]


@dataclass(frozen=True)
class FieldLayout:
    """Where one field's bytes sit inside a packed row.

    Attributes
    ----------
    name:
        The field's name (used only in messages and in the layout digest).
    dtype:
        The field's dtype.
    trailing:
        The field's shape after the first (row) dimension.
    offset, nbytes:
        Byte range ``[offset, offset + nbytes)`` of the field inside a row.
    """

    name: str
    dtype: torch.dtype
    trailing: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class RowLayout:
    """The byte layout of a packed row: fields in order, and the row width."""

    fields: tuple[FieldLayout, ...]
    row_bytes: int

    def describe(self) -> str:
        """A short human-readable form, e.g. ``{x: float64 (3,), ids: int64 ()}``."""
        parts = [
            f"{f.name}: {str(f.dtype).removeprefix('torch.')} {f.trailing}" for f in self.fields
        ]
        return "{" + ", ".join(parts) + "}"

    def digest(self) -> int:
        """A 62-bit fingerprint of the layout, identical in every process.

        (Python's ``hash`` of a string differs between processes, so it cannot be
        compared across ranks.)
        """
        raw = hashlib.blake2b(self.describe().encode(), digest_size=8).digest()
        return int.from_bytes(raw, "little") & ((1 << 62) - 1)


def row_layout(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> RowLayout:
    """The packed-row layout of ``tensors`` (first dimension = rows)."""
    out: list[FieldLayout] = []
    offset = 0
    for name, t in zip(names, tensors, strict=True):
        trailing = tuple(int(s) for s in t.shape[1:])
        nbytes = math.prod(trailing) * t.element_size()
        out.append(FieldLayout(name, t.dtype, trailing, offset, nbytes))
        offset += nbytes
    return RowLayout(tuple(out), offset)


def _as_bytes(t: torch.Tensor, n_rows: int) -> torch.Tensor:
    flat = t.detach().contiguous().reshape(n_rows, math.prod(t.shape[1:]))
    return flat.view(torch.uint8)


def pack_rows(
    tensors: Sequence[torch.Tensor],
    layout: RowLayout,
    index: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Pack rows of ``tensors`` into one byte buffer.

    Parameters
    ----------
    tensors:
        Tensors with a common first dimension ``n``, laid out as ``layout``.
    layout:
        From :func:`row_layout`.
    index:
        Optional int64 row selection, shape ``(m,)``; rows ``index`` are packed in
        that order (default: every row).
    device:
        Where the buffer is built (default: the tensors' device). Rows are moved
        there before the concatenation, so at most one copy crosses devices.

    Returns
    -------
    torch.Tensor
        ``uint8``, shape ``(m, layout.row_bytes)``. Not differentiable.
    """
    parts = []
    for t in tensors:
        rows = t.detach() if index is None else t.detach().index_select(0, index)
        if device is not None:
            rows = rows.to(device)
        parts.append(_as_bytes(rows, int(rows.shape[0])))
    if len(parts) == 1:
        return parts[0]
    if not parts:
        n = 0 if index is None else int(index.shape[0])
        return torch.empty(n, 0, dtype=torch.uint8, device=device)
    return torch.cat(parts, dim=1)


def unpack_rows(
    buffer: torch.Tensor, layout: RowLayout, device: torch.device | None = None
) -> list[torch.Tensor]:
    """Split a packed buffer back into one tensor per field.

    Parameters
    ----------
    buffer:
        ``uint8``, shape ``(m, layout.row_bytes)``.
    layout:
        The layout the buffer was packed with.
    device:
        Where the fields are returned (default: the buffer's device).

    Returns
    -------
    list of torch.Tensor
        Field ``k`` has shape ``(m, *layout.fields[k].trailing)`` and its dtype.
    """
    m = int(buffer.shape[0])
    if device is not None:
        buffer = buffer.to(device)
    out = []
    for f in layout.fields:
        out.append(_field(buffer[:, f.offset : f.offset + f.nbytes], f, m))
    return out


def _field(cols: torch.Tensor, f: FieldLayout, m: int) -> torch.Tensor:
    """The bytes ``cols`` (``(m, f.nbytes)``) as field ``f``. A dtype view needs
    dense rows at an aligned offset; one row of a wider buffer is neither
    (12-byte rows of a float32 batch: its stride is the buffer's, its offset
    may be 12), so such bytes are copied first."""
    if not f.nbytes:
        return cols.new_empty((m, *f.trailing), dtype=f.dtype)
    flat = cols.reshape(-1)  # (a copy unless the rows are dense)
    if flat.storage_offset() % f.dtype.itemsize:
        flat = flat.clone()
    return flat.view(f.dtype).reshape(m, *f.trailing)
