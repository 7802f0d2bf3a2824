"""The runtime's side of ``compile=True``: which forward runs, where its caches live,
and how many graphs it compiled.

Two ways a model is compiled (:func:`compiled_forward`):

- **its own core** (``model.compile_forward(policy)`` returns True): the model
  keeps its ``forward`` eager around collective-free compiled regions, padded to
  rank-agreed, grow-only capacities (``policy.pad_shapes``), so the regions
  compile once per capacity (see ``nvdd.models``' models and docs/design.md);
- **whole** (any other model): ``torch.compile(model)`` with the policy's
  backend, mode and fullgraph and dynamic shapes; it recompiles when Dynamo's
  guards fail (new row counts, new plans) and breaks its graph at whatever it
  cannot trace.

Compiled graphs are counted with ``torch._dynamo``'s own counter, per forward
call (:func:`compiled_graphs`), and every rank compiles into its own cache
directory (:func:`use_rank_cache_dir`). A model that declares it cannot be
compiled (``compile_unsupported``, e.g. ``MACEModel``) is refused when the
distributed model is built (:func:`check_compilable`).
"""

from __future__ import annotations

import enum
import getpass
import os
import tempfile
from typing import Any

import torch

from nvdd.core import ConfigurationError
from nvdd.spec import CompilePolicy, MLIPSpec, ModelContract, unwrap_model

__all__ = [
    "CompileMode",
    "check_compilable",
    "compiled_forward",
    "compiled_graphs",
    "use_rank_cache_dir",
]

_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


class CompileMode(enum.Enum):
    """How the forward of a distributed model is compiled."""

    OFF = "off"
    CORE = "core"  # the model compiles its own padded core
    WHOLE = "whole"  # torch.compile of the whole forward, dynamic shapes


def _default_cache_dir() -> str:
    """torch's default inductor cache directory (its own helper where it exists)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # pragma: no cover - older torch
        return os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    return str(default_cache_dir())


def use_rank_cache_dir(rank: int) -> str:
    """Point torch.compile's on-disk caches (inductor, Triton) at a directory of
    this rank's own and return it.

    ``$TORCHINDUCTOR_CACHE_DIR`` (or torch's default) gets a ``rank<r>``
    sub-directory, so ranks on one host never read each other's compiled
    artefacts (guards are per process; the on-disk caches are not). Idempotent.
    The variable is process state: set it yourself to another directory ending
    in ``rank<r>`` to choose the place.
    """
    base = os.environ.get(_CACHE_ENV) or _default_cache_dir()
    leaf = f"rank{rank}"
    path = base if os.path.basename(os.path.normpath(base)) == leaf else os.path.join(base, leaf)
    os.environ[_CACHE_ENV] = path
    return path


def compiled_graphs() -> int:
    """Graphs ``torch._dynamo`` compiled in this process so far (first compiles and
    recompiles: ``torch._dynamo.utils.counters["stats"]["unique_graphs"]``)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def check_compilable(model: ModelContract, spec: MLIPSpec, enabled: bool) -> None:
    """Refuse a compiled forward for a model that declares it cannot be compiled.

    Local (no collective, no compile): every rank builds the same model and
    configuration, so every rank raises.

    Parameters
    ----------
    model:
        The model; its ``compile_unsupported`` (see
        :class:`~nvdd.spec.BaseModelMixin`) says why it cannot be compiled, or
        is None.
    spec:
        Its spec (``spec.compile.enabled`` asks for a compiled forward too).
    enabled:
        ``DomainConfig.compile``.

    Raises
    ------
    ConfigurationError
        A compiled forward is asked for and ``compile_unsupported`` is set: the
        message names the model, the reason and the alternative (run eager).
    """
    if not (enabled or spec.compile.enabled):
        return
    reason = model.compile_unsupported
    if reason is None:
        return
    asked = "DomainConfig(compile=True)" if enabled else "an enabled CompilePolicy in its spec"
    raise ConfigurationError(
        f"{type(unwrap_model(model)).__name__} cannot run with {asked}: {reason}. Run it eager: "
        "DomainConfig(compile=False) and a spec whose CompilePolicy is not enabled"
    )


def compiled_forward(
    model: ModelContract, spec: MLIPSpec, enabled: bool, rank: int
) -> tuple[Any, CompileMode]:
    """The callable a distributed model runs, and how it is compiled.

    Parameters
    ----------
    model:
        The wrapped model.
    spec:
        Its spec (``spec.compile`` is the :class:`~nvdd.spec.CompilePolicy`).
    enabled:
        ``DomainConfig.compile``: compile even when the policy is not enabled.
    rank:
        This process's global rank (its compile cache directory).

    Returns
    -------
    (forward, mode)
        ``model`` itself for :attr:`CompileMode.OFF` and :attr:`CompileMode.CORE`
        (the model compiled its own regions), ``torch.compile(model)`` for
        :attr:`CompileMode.WHOLE`.
    """
    policy: CompilePolicy = spec.compile
    if not (enabled or policy.enabled):
        return model, CompileMode.OFF
    use_rank_cache_dir(rank)
    if model.compile_forward(policy):
        return model, CompileMode.CORE
    whole = torch.compile(
        model,
        backend=policy.backend,
        mode=policy.mode,
        fullgraph=policy.fullgraph,
        dynamic=policy.resolved_dynamic(padded=False),
    )
    return whole, CompileMode.WHOLE
