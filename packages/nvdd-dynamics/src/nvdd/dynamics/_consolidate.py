"""A forward's outputs -> this rank's share of the truth: the forces, then the rest.

Forces come out of the raw outputs by :func:`extract_forces` (the model's own,
or ``-dE/dx`` by autograd); every force provider (the whole batch on one rank,
the halo, graph partition, each component of a pipeline) reads them through it,
so the rules and the error messages are the same in every mode.

Every other output is combined by its :class:`~nvdd.spec.OutputSpec`:

============  ============  ==================================================
kind          reduce        what happens
============  ============  ==================================================
PER_NODE      ALL_REDUCE    ghost rows folded into their owners (one reverse
                            exchange), owned rows kept
PER_NODE      OWNED_ONLY    owned rows kept
PER_GRAPH     ALL_REDUCE    kept as this rank's partial; summed over ranks on
                            demand (:meth:`PendingTotals.materialize`)
PER_GRAPH     OWNED_ONLY    kept (already the global value on every rank)
GLOBAL        ALL_REDUCE    summed over ranks now
GLOBAL        OWNED_ONLY    passed through
UNKNOWN       (any)         passed through unchanged, with a one-time warning
============  ============  ==================================================
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from nvdd.core import ConfigurationError, ValidationError
from nvdd.dynamics._collectives import MeshReducer
from nvdd.spec import ForceStrategy, MLIPSpec, ModelContract, OutputKind, Reduce, unwrap_model

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from nvdd.halo import HaloPlan

__all__ = [
    "PendingTotals",
    "UndeclaredOutputWarning",
    "consolidate",
    "extract_forces",
    "folds_forces",
]


class UndeclaredOutputWarning(UserWarning):
    """A model output has no OutputSpec; it is passed through unverified."""


_WARNED: set[tuple[str, str]] = set()


@dataclass(frozen=True, slots=True)
class OutputRules:
    """What consolidation reads of a spec, derived once per spec object so that a
    step calls nothing of it (:func:`output_rules`).

    Attributes
    ----------
    folds_forces:
        :func:`folds_forces` of the spec.
    owned_rows_exact:
        ``spec.owned_rows_exact`` (a receptive-field spec).
    rules:
        ``{output name: (kind, effective reduce)}`` of every declared output.
    """

    folds_forces: bool
    owned_rows_exact: bool
    rules: Mapping[str, tuple[OutputKind, Reduce]]


#: ``id(spec) -> (spec, its rules)`` (the spec is kept, so its id is not reused).
_RULES: dict[int, tuple[MLIPSpec, OutputRules]] = {}
_UNDECLARED = (OutputKind.UNKNOWN, Reduce.NONE)


def output_rules(spec: MLIPSpec) -> OutputRules:
    """The :class:`OutputRules` of ``spec`` (computed at its first use)."""
    hit = _RULES.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    rules = OutputRules(
        folds_forces=_folds_forces(spec),
        owned_rows_exact=spec.owned_rows_exact,
        rules={n: (o.kind, o.effective_reduce()) for n, o in spec.outputs.items()},
    )
    _RULES[id(spec)] = (spec, rules)
    return rules


def folds_forces(spec: MLIPSpec) -> bool:
    """Whether ghost-row forces are folded into their owners under ``spec``
    (:func:`output_rules`)."""
    return output_rules(spec).folds_forces


def _folds_forces(spec: MLIPSpec) -> bool:
    """Whether ghost-row forces are folded into their owners under ``spec``.

    Autograd forces are derivatives with respect to every padded row, so the
    ghost rows' share always belongs to their owners; direct forces follow the
    ``forces`` output spec (``ALL_REDUCE``: fold; ``OWNED_ONLY``: owned rows are
    exact, ghost rows are dropped). Under a receptive-field spec
    (``spec.owned_rows_exact``) the owned rows are exact either way: no fold,
    except in its folding variant (``options.receptive_field_fold``).
    """
    if spec.owned_rows_exact:  # (its folding variant: the owned energies' gradient)
        return spec.options.receptive_field_fold
    if spec.force_strategy is ForceStrategy.AUTOGRAD:
        return True
    return spec.output("forces").effective_reduce() is Reduce.ALL_REDUCE


def _fold(x: torch.Tensor, plan: HaloPlan) -> torch.Tensor:
    n = plan.n_owned
    if x.shape[0] != plan.n_padded:
        raise ValueError(
            f"per-node output has {x.shape[0]} rows, expected n_padded={plan.n_padded}"
        )
    return x[:n] + plan.reverse(x[n:])


def consolidate(
    outputs: Mapping[str, Any],
    spec: MLIPSpec,
    plan: HaloPlan,
    group: ProcessGroup | None,
    *,
    skip: Iterable[str] = (),
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Combine one forward's outputs; returns ``(final, partial_per_graph)``.

    **Collective** over ``group`` when an output needs a fold (one reverse
    exchange each) or is a GLOBAL all-reduce. PER_GRAPH partials are returned
    separately, not reduced (see :class:`PendingTotals`).
    """
    final: dict[str, Any] = {}
    partial: dict[str, torch.Tensor] = {}
    skipped = set(skip)
    table = output_rules(spec).rules
    for name, value in outputs.items():
        if name in skipped:
            continue
        kind, rule = table.get(name, _UNDECLARED)
        if not isinstance(value, torch.Tensor):
            final[name] = value
            continue
        if kind is OutputKind.UNKNOWN:
            key = (spec.name, name)
            if key not in _WARNED:
                _WARNED.add(key)
                warnings.warn(
                    f"output {name!r} of {spec.name or 'the model'} has no OutputSpec; it is "
                    "passed through unchanged (declare it to make it exact under DD)",
                    UndeclaredOutputWarning,
                    stacklevel=3,
                )
            final[name] = value
        elif kind is OutputKind.PER_NODE:
            final[name] = _fold(value, plan) if rule is Reduce.ALL_REDUCE else value[: plan.n_owned]
        elif kind is OutputKind.PER_GRAPH:
            if rule is Reduce.ALL_REDUCE:
                partial[name] = value
            else:
                final[name] = value
        elif rule is Reduce.ALL_REDUCE:  # GLOBAL
            final[name] = MeshReducer(group).sum(value)
        else:
            final[name] = value
    return final, partial


class PendingTotals:
    """Per-system partial sums kept until someone needs the totals.

    Reducing a step's energy costs an all-reduce; an NVE step that no hook
    inspects does not need it. :meth:`materialize` sums every pending partial
    over the mesh in ONE all-reduce (**Collective**: every rank calls it at the
    same point, which holds because hooks are registered on every rank alike).
    """

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group
        self._partials: dict[str, torch.Tensor] = {}
        self._base: dict[str, torch.Tensor] = {}
        self._totals: dict[str, torch.Tensor] = {}
        #: ``{name: why}`` of totals the last forward cannot give (a model under
        #: the receptive-field spec); asking for one by name raises
        self.unavailable: dict[str, str] = {}

    def _refuse(self, names: Iterable[str]) -> None:
        for n in names:
            if n in self.unavailable:
                raise ConfigurationError(self.unavailable[n])

    def set(
        self,
        partials: Mapping[str, torch.Tensor],
        base: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Replace the pending partials with one forward's (totals become stale).

        ``base`` holds values already global on every rank that are added to the
        reduced partials of the same name (a pipeline mixing both kinds).
        """
        self._partials = {k: v.detach() for k, v in partials.items()}
        self._base = {k: v.detach() for k, v in (base or {}).items()}
        self._totals = {}

    def partials(self) -> dict[str, torch.Tensor]:
        """The unreduced partials (no communication)."""
        return dict(self._partials)

    @property
    def pending(self) -> frozenset[str]:
        """Names whose partials are not reduced yet."""
        return frozenset(k for k in self._partials if k not in self._totals)

    def materialize(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Totals of ``names`` (default: all), reducing what is still pending.

        **Collective** over :attr:`group` when something is pending.
        """
        if names is not None:
            names = list(names)
            self._refuse(names)
        want = [n for n in (self._partials if names is None else names) if n in self._partials]
        todo = sorted(n for n in want if n not in self._totals)
        if todo:
            flat = [self._partials[n].reshape(-1) for n in todo]
            self._store(todo, MeshReducer(self.group).sum(torch.cat(flat)))
        return {n: self._totals[n] for n in want}

    def materialize_with(
        self, extra: torch.Tensor, names: Iterable[str]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``extra`` summed over ranks, and the totals of ``names``, in ONE all-reduce.

        **Collective** over :attr:`group`: every rank calls it with the same
        names and an ``extra`` of the same shape. The buffer is float64 (each
        total is cast back to its partial's dtype); totals already reduced are
        reused, not sent again.

        Returns
        -------
        (torch.Tensor, dict)
            ``extra`` summed (float64, its shape) and the totals of the
            ``names`` that are pending partials.
        """
        names = list(names)
        self._refuse(names)
        want = [n for n in names if n in self._partials]
        todo = sorted(n for n in want if n not in self._totals)
        head = extra.detach().reshape(-1).to(torch.float64)
        flat = [self._partials[n].reshape(-1).to(head.device, torch.float64) for n in todo]
        buf = MeshReducer(self.group).sum(torch.cat([head, *flat]))
        if todo:
            tail = buf[head.numel() :]
            self._store(todo, tail, cast=True)
        summed = buf[: head.numel()].reshape(extra.shape)
        return summed, {n: self._totals[n] for n in want}

    def _store(self, names: list[str], buf: torch.Tensor, cast: bool = False) -> None:
        offset = 0
        for n in names:
            partial = self._partials[n]
            total = buf[offset : offset + partial.numel()].reshape(partial.shape)
            if cast:
                total = total.to(device=partial.device, dtype=partial.dtype)
            self._totals[n] = total + self._base[n] if n in self._base else total
            offset += partial.numel()


# ------------------------------------------------------------------ forces
def extract_forces(
    raw: dict[str, Any], positions: torch.Tensor, strategy: ForceStrategy, model: ModelContract
) -> torch.Tensor:
    """Take the forces out of ``raw`` (popped), detached, one row per position.

    The model's ``forces`` when it returns them (whatever ``strategy`` says);
    otherwise, under ``ForceStrategy.AUTOGRAD``, ``-d(sum energy)/d positions``
    (zeros when the energy does not depend on ``positions``).

    Parameters
    ----------
    raw:
        The forward's outputs by name (a mutable copy: ``forces`` is removed).
    positions:
        The positions the model ran on, shape ``(n_rows, 3)``: the autograd
        leaf when ``strategy`` is ``AUTOGRAD``.
    strategy:
        The spec's :class:`~nvdd.spec.ForceStrategy`.
    model:
        The model that returned ``raw`` (named in errors).

    Returns
    -------
    torch.Tensor
        Shape ``positions.shape``, detached.

    Raises
    ------
    ValidationError
        When ``raw`` holds neither ``forces`` nor (under ``AUTOGRAD``) an
        ``energy``, or the forces do not have one row per position.
    """
    if "forces" in raw:
        forces = raw.pop("forces")
    elif strategy is ForceStrategy.AUTOGRAD and "energy" in raw:
        (grad,) = torch.autograd.grad(raw["energy"].sum(), positions, allow_unused=True)
        forces = -grad if grad is not None else torch.zeros_like(positions)
    else:
        raise ValidationError(
            f"{_name(model)} returned neither 'forces' nor a differentiable 'energy' "
            f"(got {sorted(raw)}) under {strategy}"
        )
    if forces.shape != positions.shape:
        raise ValidationError(
            f"{_name(model)}: forces have shape {tuple(forces.shape)}, expected one row per "
            f"position {tuple(positions.shape)}"
        )
    out: torch.Tensor = forces.detach()
    return out


def _name(model: ModelContract) -> str:
    return type(unwrap_model(model)).__name__
