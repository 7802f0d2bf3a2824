"""Checks of ``nvdd run``'s model options that need no import of torch (run before
any rank starts)."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = [
    "BUILTIN_MACE_ELEMENTS",
    "FILE_MODELS",
    "MODELS",
    "model_args_problem",
    "uma_checkpointing",
]

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


def uma_checkpointing(value: str) -> bool | int:
    """``--uma-checkpoint``'s value as ``UMAModel(activation_checkpointing=)`` takes
    it: ``on`` True, ``off`` False, a positive whole number of edges per chunk.

    Raises
    ------
    ValueError
        On anything else (the message names the value).
    """
    word = value.strip().lower()
    if word == "on":
        return True
    if word == "off":
        return False
    if word.isdecimal() and int(word) > 0:  # (isdigit takes "²", which int refuses)
        return int(word)
    raise ValueError(
        f"--uma-checkpoint is on, off or a positive number of edges per chunk, got {value!r}"
    )


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
    checkpointing = getattr(args, "uma_checkpoint", None)
    if checkpointing is not None:
        if model != "uma":
            return f"--uma-checkpoint is a setting of --model uma, not of --model {model}"
        try:
            uma_checkpointing(checkpointing)
        except ValueError as exc:
            return str(exc)
    if model_file is not None and not Path(model_file).is_file():
        return f"--model-file {model_file!r} does not exist or is not a file"
    return None
