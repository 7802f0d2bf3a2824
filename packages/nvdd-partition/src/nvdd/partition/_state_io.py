"""A :class:`SpatialPartitioner` as plain JSON-able data, and back, bit for bit.

Checkpoints store the partitioner this way so that a restart on the same number
of ranks gets exactly the boxes (and therefore the owners) of the interrupted
run. Floats travel as Python floats (``repr`` round-trips every float64 exactly;
NaN and infinities as the JSON extensions ``NaN`` / ``Infinity``).
"""

from __future__ import annotations

from typing import Any

import torch

from nvdd.core import ValidationError
from nvdd.partition._build import BalanceMode
from nvdd.partition._cuts import CutTable
from nvdd.partition._state import _State

__all__ = ["FORMAT_VERSION", "state_from_dict", "state_to_dict"]

#: Version of the dictionary layout.
FORMAT_VERSION = 1


def _f64(t: torch.Tensor) -> list[Any]:
    out: list[Any] = t.detach().cpu().to(torch.float64).tolist()
    return out


def state_to_dict(state: _State) -> dict[str, Any]:
    """Every field of a partitioner's state as lists, numbers and strings."""
    return {
        "version": FORMAT_VERSION,
        "cell": _f64(state.cell),
        "pbc": state.pbc.cpu().tolist(),
        "domain": _f64(state.domain),
        "synthetic": state.synthetic.cpu().tolist(),
        "extent": _f64(state.extent),
        "tables": [
            {"grid": list(t.grid), "c0": _f64(t.c0), "c1": _f64(t.c1), "c2": _f64(t.c2)}
            for t in state.tables
        ],
        "world_size": state.world_size,
        "ghost_width": state.ghost_width,
        "skin": state.skin,
        "balance": state.balance.value,
        "require_nondegenerate": state.require_nondegenerate,
        "build_counts": None if state.build_counts is None else state.build_counts.tolist(),
    }


def state_from_dict(data: dict[str, Any]) -> _State:
    """The state :func:`state_to_dict` wrote.

    Raises
    ------
    ValidationError
        On a missing key, an unknown version or malformed values.
    """
    if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
        got = data.get("version") if isinstance(data, dict) else type(data).__name__
        raise ValidationError(
            f"partitioner state: expected a dict of version {FORMAT_VERSION}, got {got!r}"
        )
    try:
        f64 = torch.float64
        tables = tuple(
            CutTable(
                grid=(int(t["grid"][0]), int(t["grid"][1]), int(t["grid"][2])),
                c0=torch.tensor(t["c0"], dtype=f64),
                c1=torch.tensor(t["c1"], dtype=f64),
                c2=torch.tensor(t["c2"], dtype=f64),
            )
            for t in data["tables"]
        )
        counts = data["build_counts"]
        return _State(
            cell=torch.tensor(data["cell"], dtype=f64),
            pbc=torch.tensor(data["pbc"], dtype=torch.bool),
            domain=torch.tensor(data["domain"], dtype=f64),
            synthetic=torch.tensor(data["synthetic"], dtype=torch.bool),
            extent=torch.tensor(data["extent"], dtype=f64),
            tables=tables,
            world_size=int(data["world_size"]),
            ghost_width=float(data["ghost_width"]),
            skin=None if data["skin"] is None else float(data["skin"]),
            balance=BalanceMode(data["balance"]),
            require_nondegenerate=bool(data["require_nondegenerate"]),
            build_counts=None if counts is None else torch.tensor(counts, dtype=torch.int64),
        )
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:
        raise ValidationError(
            f"partitioner state: malformed ({type(exc).__name__}: {exc})"
        ) from exc
