"""Per-module diagnostics of ``trace_and_validate``: probed tensors compared by atom id.

For every module the single-process run and the decomposed run both recorded:

- the **owned error**: its per-atom outputs on every rank's owned rows against
  the single-process rows of the same atoms (the verdict: where a wrong value
  first appears);
- the **ghost error**: the same outputs on ghost rows against the values of the
  atoms they copy. Many modules legitimately leave ghost rows stale (an
  aggregation over owned receivers only); it matters when a later module
  *reads* them at neighbours.

The **culprit** is found from the first module (by the end of its call) whose
owned rows differ, walking up its ancestors to the innermost one with an input
whose owned rows are right but whose ghost rows are stale: that module reads
neighbour features nobody refreshed, and the input's producer (tracked by
tensor identity) is the module whose output needed a refresh.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from nvdd.dynamics._probe import Call

__all__ = ["Culprit", "LayerDiagnostic", "RankProbe", "diagnose"]


@dataclass(frozen=True)
class LayerDiagnostic:
    """One module's per-atom outputs, decomposed vs single process, by atom id.

    Attributes
    ----------
    module:
        Name in ``model.named_modules()``.
    max_abs_error:
        Largest difference on owned rows (over all its per-atom outputs).
    ok:
        ``max_abs_error`` within the tolerance.
    ghost_error:
        Largest difference on ghost rows (None when no rank had ghosts).
    """

    module: str
    max_abs_error: float
    ok: bool
    ghost_error: float | None = None


@dataclass(frozen=True)
class Culprit:
    """Where an uncovered neighbour read is.

    Attributes
    ----------
    module:
        The first module whose owned rows differ (see the module docstring).
    stale_input:
        The input of ``module`` whose owned rows are right and ghost rows stale.
    producer:
        ``"module[output key]"`` that produced ``stale_input`` (None if it came
        from an operation outside any module).
    """

    module: str
    stale_input: str | None = None
    producer: str | None = None


@dataclass
class RankProbe:
    """What one rank recorded: its padded rows' atom ids, owned count and calls."""

    ids: torch.Tensor
    n_owned: int
    calls: dict[str, Call]


class _ById:
    """Row lookup in the single-process tensors by atom id."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.order = torch.argsort(ids)
        self.sorted = ids[self.order]

    def rows(self, query: torch.Tensor) -> torch.Tensor | None:
        if query.numel() == 0:
            return query.new_zeros(0)
        pos = torch.searchsorted(self.sorted, query).clamp(max=self.sorted.numel() - 1)
        if not bool((self.sorted[pos] == query).all()):
            return None
        return self.order[pos]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).abs().max())


def _errors(
    key: str,
    ref: torch.Tensor,
    by_id: _ById,
    ranks: Sequence[tuple[RankProbe, Mapping[str, torch.Tensor]]],
) -> tuple[float, float | None] | None:
    """(owned error, ghost error) of one probed tensor; None if not comparable."""
    owned = 0.0
    ghost: float | None = None
    for probe, tensors in ranks:
        t = tensors.get(key)
        if t is None or t.shape[1:] != ref.shape[1:] or t.shape[0] != probe.ids.shape[0]:
            return None
        n = probe.n_owned
        for lo, hi, is_ghost in ((0, n, False), (n, t.shape[0], True)):
            rows = by_id.rows(probe.ids[lo:hi])
            if rows is None:
                return None
            err = _max_diff(t[lo:hi], ref[rows])
            if is_ghost and hi > lo:
                ghost = err if ghost is None else max(ghost, err)
            elif not is_ghost:
                owned = max(owned, err)
    return owned, ghost


def _worst(
    ref: Mapping[str, torch.Tensor],
    by_id: _ById,
    ranks: Sequence[tuple[RankProbe, Mapping[str, torch.Tensor]]],
) -> dict[str, tuple[float, float | None]]:
    out = {}
    for key, t in ref.items():
        e = _errors(key, t, by_id, ranks)
        if e is not None:
            out[key] = e
    return out


def diagnose(
    ref_calls: Mapping[str, Call],
    ref_ids: torch.Tensor,
    ranks: Sequence[RankProbe],
    tol: float,
) -> tuple[list[LayerDiagnostic], Culprit | None]:
    """Per-module diagnostics in call order, and the culprit when some module fails.

    Parameters
    ----------
    ref_calls:
        The single-process probe (every row owned), ``ref_ids`` its atom ids.
    ranks:
        Every rank's probe.
    tol:
        Absolute tolerance of a per-atom value.
    """
    by_id = _ById(ref_ids)
    layers: list[LayerDiagnostic] = []
    ends: dict[str, int] = {}
    for name, call in sorted(ref_calls.items(), key=lambda kv: kv[1].start):
        if not all(name in r.calls for r in ranks):
            continue
        errs = _worst(call.outputs, by_id, [(r, r.calls[name].outputs) for r in ranks])
        if not errs:
            continue
        owned = max(e[0] for e in errs.values())
        ghosts = [e[1] for e in errs.values() if e[1] is not None]
        layers.append(LayerDiagnostic(name, owned, owned <= tol, max(ghosts) if ghosts else None))
        ends[name] = call.end
    failing = [d.module for d in layers if not d.ok]
    if not failing:
        return layers, None
    first = min(failing, key=lambda n: ends[n])
    parts = first.split(".")
    for depth in range(len(parts), 0, -1):
        name = ".".join(parts[:depth])
        found = ref_calls.get(name)
        if found is None or not all(name in r.calls for r in ranks):
            continue
        inputs = _worst(found.inputs, by_id, [(r, r.calls[name].inputs) for r in ranks])
        for key, (owned, ghost) in inputs.items():
            if owned <= tol and ghost is not None and ghost > tol:
                producer = ranks[0].calls[name].producers.get(key)
                return layers, Culprit(name, key, producer)
    return layers, Culprit(first)
