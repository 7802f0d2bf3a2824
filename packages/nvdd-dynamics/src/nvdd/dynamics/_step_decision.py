"""The one shared decision of a halo step: steady, a model grows, rebuild, or fail.

Every rank computes a small integer on its atoms' device and the ranks take the
maximum (one all-reduce), so every rank reads the same verdict and takes the
same branch; the codes are ordered by priority:

- :data:`STEADY` (0): the halo plan holds;
- :data:`MODEL_GROWS` (1): some rank's model buffers overflowed (the MPNN's
  device edges): the step runs eagerly and that rank grows; nothing migrates;
- :data:`REBUILD` (2): some owned atom used up its skin: migrate, new plan;
- :data:`NONFINITE` (3): some rank holds a non-finite value: every rank raises.
"""

from __future__ import annotations

from typing import Any

import torch

from nvdd.core import Batch, all_reduce, comm_device, get_world_size, raise_if_any_rank
from nvdd.dynamics._finite import nonfinite_flag, nonfinite_message

__all__ = ["MODEL_GROWS", "NONFINITE", "REBUILD", "STEADY", "decision_code", "read_decision"]

STEADY, MODEL_GROWS, REBUILD, NONFINITE = 0, 1, 2, 3


def decision_code(
    moved: torch.Tensor, model_flag: torch.Tensor | None, batch: Batch, group: Any
) -> torch.Tensor:
    """The step's code, int32 ``(1,)``, reduced over ``group`` (no host read).

    ``moved``: nonzero when this rank's atoms used up the skin; ``model_flag``:
    nonzero when this rank's model buffers overflowed (None: no such model);
    the non-finite flag of ``batch`` is added here.

    **Collective** over ``group`` when it has more than one rank: ONE
    all-reduce (max) of one integer.
    """
    code = torch.where(moved != 0, REBUILD, STEADY).to(torch.int32)
    if model_flag is not None:
        code = torch.maximum(code, (model_flag.reshape(()) != 0).to(torch.int32))
    code = torch.where(nonfinite_flag(batch) == 0, code, NONFINITE).reshape(1)
    if get_world_size(group) > 1:
        code = code.to(comm_device(group))
        all_reduce(code, "max", group)
    return code


def read_decision(code: torch.Tensor, batch: Batch, group: Any) -> int:
    """The host read of :func:`decision_code`: the code, after raising on every
    rank of ``group`` for :data:`NONFINITE` (**Collective** then: the messages
    are gathered)."""
    verdict = int(code.item())
    if verdict == NONFINITE:
        raise_if_any_rank(nonfinite_message(batch), group)
    return verdict
