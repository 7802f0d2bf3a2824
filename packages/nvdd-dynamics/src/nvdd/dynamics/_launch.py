"""How ``trace_and_validate`` gets its ranks: spawned CPU ranks, or the caller's own.

- **Spawned** (no process group yet): CPU ranks over gloo are started from the
  calling process (``nvdd.core.spawn_ranks``). They start by re-importing the
  calling script (Python's ``forkserver`` / ``spawn`` rule), so a script that
  calls ``trace_and_validate`` at its top level without an
  ``if __name__ == "__main__":`` guard would run the call again in every rank,
  which fails with a message that reads like a broken spec. :func:`unguarded_caller`
  detects that case before anything is spawned.
- **Existing ranks** (the caller runs under ``torchrun`` or ``run_ranks``): every
  rank calls ``trace_and_validate`` with the same arguments; the decomposed run
  uses the default group on ``device`` (a GPU per rank with NCCL).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from nvdd.core import ConfigurationError, broadcast_object, comm_device

__all__ = ["broadcast", "resolve_device", "unguarded_caller"]


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either order)."""
    if not isinstance(test, ast.Compare) or len(test.ops) != 1:
        return False
    if not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(consts) == 1


def _main_frame(frame: FrameType | None) -> FrameType | None:
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            return frame
        frame = frame.f_back
    return None


def unguarded_caller(frame: FrameType | None = None) -> str | None:
    """``"path:line"`` when the call stack starts at a top-level line of the
    ``__main__`` script that is not inside ``if __name__ == "__main__":``; else None.

    Returns None when the main module has no source file (an interactive
    session, ``python -c``) or the stack does not start in ``__main__``.
    """
    main = _main_frame(frame if frame is not None else sys._getframe(1))
    if main is None:
        return None
    path = main.f_globals.get("__file__")
    if not isinstance(path, str) or not Path(path).is_file():
        return None
    try:
        tree = ast.parse(Path(path).read_text(), filename=path)
    except (SyntaxError, UnicodeDecodeError, OSError):
        return None
    line = main.f_lineno
    for node in tree.body:
        if isinstance(node, ast.If) and _is_main_test(node.test):
            end = node.end_lineno if node.end_lineno is not None else node.lineno
            if node.lineno <= line <= end:
                return None
    return f"{path}:{line}"


def resolve_device(device: str | torch.device | None, collective: bool) -> torch.device:
    """The device of the decomposed run.

    Spawned ranks are CPU ranks (gloo); under an existing process group the
    default is the group's communication device (``cuda:LOCAL_RANK`` for NCCL).

    Raises
    ------
    ConfigurationError
        A CUDA device without an existing process group (launch with torchrun),
        or a device the group's backend cannot serve.
    """
    if not collective:
        if device is not None and torch.device(device).type != "cpu":
            raise ConfigurationError(
                f"trace_and_validate(device={str(device)!r}) needs ranks that own a GPU each: "
                "launch the script with torchrun --nproc-per-node N (every rank calls "
                "trace_and_validate); without a process group it spawns CPU ranks over gloo"
            )
        return torch.device("cpu")
    group_device = comm_device()
    if device is None:
        return group_device
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = group_device if group_device.type == "cuda" else torch.device("cuda")
    if dev.type == "cuda" and dist.get_backend() == "gloo":
        raise ConfigurationError(
            "trace_and_validate(device='cuda') under a gloo process group: initialise the group "
            "with NCCL (torchrun with nvdd.core.init_distributed(device='cuda'))"
        )
    return dev


def broadcast(value: Any, src: int = 0) -> Any:
    """``value`` of rank ``src`` on every rank (**Collective** over the default group;
    ``nvdd.core.broadcast_object``)."""
    return broadcast_object(value, src)
