"""Checks of ``nvdd run``'s model options that need no import of torch (run before
any rank starts)."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["BUILTIN_MACE_ELEMENTS", "FILE_MODELS", "MODELS", "model_args_problem"]

#: ``--model`` choices.
MODELS = ("lj", "mace", "sevenn", "uma", "aimnet2")
#: The ``--model`` choices that read ``--model-file``, and what the file is.
FILE_MODELS = {
    "mace": "a mace-torch model (.model)",
    "sevenn": "a SevenNet checkpoint (.pth)",
    "uma": "a fairchem UMA inference checkpoint (.pt)",
    "aimnet2": "an aimnet v2 AIMNet2 model file (.pt)",
}
#: Atomic numbers of the built-in random MACE, SevenNet or UMA (``--model mace|sevenn|uma``
#: without a file): O, Si.
BUILTIN_MACE_ELEMENTS = (8, 14)


def model_args_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the model options, or None."""
    model = getattr(args, "model", "lj")
    model_file = getattr(args, "model_file", None)
    if model not in MODELS:
        return f"--model must be one of {MODELS}, got {model!r}"
    if model_file is not None and model not in FILE_MODELS:
        kinds = " or ".join(f"--model {k} ({v})" for k, v in FILE_MODELS.items())
        return f"--model-file is a model file: use it with {kinds}, not --model {model}"
    if getattr(args, "task", None) is not None and model != "uma":
        return f"--task is the fairchem task of --model uma, not of --model {model}"
    if model_file is not None and not Path(model_file).is_file():
        return f"--model-file {model_file!r} does not exist or is not a file"
    return None
