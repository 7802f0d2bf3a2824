"""Checks of ``nvdd run``'s model options that need no import of torch (run before
any rank starts)."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["BUILTIN_MACE_ELEMENTS", "MODELS", "model_args_problem"]

#: ``--model`` choices.
MODELS = ("lj", "mace")
#: Atomic numbers of the built-in random MACE (``--model mace`` without a file): O, Si.
BUILTIN_MACE_ELEMENTS = (8, 14)


def model_args_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the model options, or None."""
    model = getattr(args, "model", "lj")
    model_file = getattr(args, "model_file", None)
    if model not in MODELS:
        return f"--model must be one of {MODELS}, got {model!r}"
    if model_file is not None and model != "mace":
        return f"--model-file is a mace-torch model: use it with --model mace (got --model {model})"
    if model_file is not None and not Path(model_file).is_file():
        return f"--model-file {model_file!r} does not exist or is not a file"
    return None
