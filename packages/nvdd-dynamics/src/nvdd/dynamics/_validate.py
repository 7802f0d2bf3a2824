"""`trace_and_validate`: check a model's distribution spec before trusting it.

The model runs once in this process (the reference) and once decomposed over a
few CPU ranks (gloo, spawned from here); outputs and every module's per-atom
output are compared by global atom id. The first module whose owned rows differ
is where an uncovered operation lives. With ``fix=True`` candidate repairs are
tried (per-module ghost refresh adapters, the other force strategy, the presets)
and the first that validates is reported.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from nvdd.core import Batch, ConfigurationError, NvddError, RankFailedError, spawn_ranks
from nvdd.dynamics._config import DomainConfig
from nvdd.dynamics._distributed_model import DistributedModel
from nvdd.spec import (
    SPEC_LJ_HALO,
    SPEC_MPNN_HALO,
    SPEC_UMA_HALO,
    DistributionSpec,
    ForceStrategy,
    MLIPSpec,
    StrategyKind,
    neighbor_refresh_adapters,
)

__all__ = ["LayerDiagnostic", "ValidationReport", "trace_and_validate"]

_OUTPUTS = ("energy", "forces", "stress")


@dataclass(frozen=True)
class LayerDiagnostic:
    """One module's per-atom output, decomposed vs single process, by atom id."""

    module: str
    max_abs_error: float
    ok: bool


@dataclass
class ValidationReport:
    """Verdict of :func:`trace_and_validate`.

    Attributes
    ----------
    passed:
        Every compared output within ``tolerance``.
    spec:
        The spec validated (the repaired one when a fix was applied).
    errors:
        Max absolute error per output (``energy``, ``forces``, ``stress``).
    tolerance:
        The absolute tolerance used.
    applied_fixes:
        The repairs tried, in order; the last is the one in effect when ``passed``
        came from a fix.
    layers:
        Per-module diagnostics in execution order; the first failing entry is
        where an uncovered per-atom operation is.
    world_size:
        Ranks of the decomposed run.
    failure:
        Text of an exception raised by the decomposed run, if any.
    """

    passed: bool
    spec: MLIPSpec
    errors: dict[str, float]
    tolerance: float
    applied_fixes: list[str] = field(default_factory=list)
    layers: list[LayerDiagnostic] = field(default_factory=list)
    world_size: int = 2
    failure: str | None = None

    @property
    def first_uncovered(self) -> str | None:
        """Name of the first module whose per-atom output differs, if any."""
        return next((d.module for d in self.layers if not d.ok), None)

    def summary(self) -> str:
        """A few lines for humans."""
        verdict = "PASSED" if self.passed else "FAILED"
        lines = [
            f"trace_and_validate: {verdict} with {self.spec.name or 'a custom spec'} on "
            f"{self.world_size} ranks (tolerance {self.tolerance:g})"
        ]
        lines += [f"  {k}: max abs error {v:.3e}" for k, v in self.errors.items()]
        if self.first_uncovered:
            lines.append(f"  first module whose per-atom output differs: {self.first_uncovered}")
        lines += [f"  fix tried: {f}" for f in self.applied_fixes]
        if self.failure:
            lines.append(f"  decomposed run failed: {self.failure.splitlines()[-1]}")
        return "\n".join(lines)


def _record_modules(
    model: Any, rows: int, store: dict[str, torch.Tensor], n_keep: int
) -> list[Any]:
    handles: list[Any] = []
    named = getattr(model, "named_modules", None)
    if named is None:
        return handles
    for name, module in named():
        if not name:
            continue

        def hook(_m: Any, _inp: Any, out: Any, name: str = name) -> None:
            if isinstance(out, torch.Tensor) and out.ndim >= 1 and out.shape[0] == rows:
                store[name] = out.detach()[:n_keep].clone()

        handles.append(module.register_forward_hook(hook))
    return handles


def _single(model: Any, batch: Batch) -> dict[str, Any]:
    store: dict[str, torch.Tensor] = {}
    handles = _record_modules(model, batch.n_atoms, store, batch.n_atoms)
    try:
        out = model(batch)
    finally:
        for h in handles:
            h.remove()
    return {
        "outputs": {k: v.detach() for k, v in out.items() if k in _OUTPUTS},
        "ids": batch.atom_ids,
        "layers": store,
    }


def _validate_rank(
    model: Any, batch: Batch, spec: MLIPSpec, config: DomainConfig
) -> dict[str, Any]:
    """Body run on every spawned rank (module level so it can be named)."""
    import torch.distributed as dist

    from nvdd.partition import ShardedBatch, SpatialPartitioner

    rank, world = dist.get_rank(), dist.get_world_size()
    dm = DistributedModel(model, config, spec=spec, count=False)

    def factory(b: Batch) -> SpatialPartitioner:
        return SpatialPartitioner.from_batch(b, world, dm.ghost_width)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny validation systems are often degenerate
        sharded = ShardedBatch.from_batch(batch if rank == 0 else None, None, factory)
    dm.attach(sharded)
    try:
        store: dict[str, torch.Tensor] = {}
        plan = dm.plan
        handles = _record_modules(model, plan.n_padded, store, plan.n_owned)
        try:
            local, out = dm(sharded.local_batch)
        finally:
            for h in handles:
                h.remove()
        totals = dm.materialize()
        outputs = {k: v for k, v in {**out, **totals}.items() if k in _OUTPUTS}
        ids = local.atom_ids
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (ids, outputs.get("forces"), store))
    finally:
        dm.detach()
    if rank != 0:
        return {}
    all_ids = torch.cat([g[0] for g in gathered])
    forces = torch.cat([g[1] for g in gathered]) if outputs.get("forces") is not None else None
    layers = {}
    for name in gathered[0][2]:
        if all(name in g[2] for g in gathered):
            layers[name] = torch.cat([g[2][name] for g in gathered])
    outputs = dict(outputs)
    if forces is not None:
        outputs["forces"] = forces
    return {"outputs": outputs, "ids": all_ids, "layers": layers}


def _by_id(ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x[torch.argsort(ids)]


def _compare(
    ref: dict[str, Any], got: dict[str, Any]
) -> tuple[dict[str, float], list[LayerDiagnostic]]:
    errors = {}
    for k, v in ref["outputs"].items():
        if k not in got["outputs"]:
            continue
        g = got["outputs"][k]
        if k == "forces":
            v, g = _by_id(ref["ids"], v), _by_id(got["ids"], g)
        errors[k] = float((v.double() - g.double()).abs().max()) if v.numel() else 0.0
    layers = []
    for name, v in ref["layers"].items():
        g = got["layers"].get(name)
        if g is None or g.shape != v.shape:
            continue
        err = float((_by_id(ref["ids"], v).double() - _by_id(got["ids"], g).double()).abs().max())
        layers.append(LayerDiagnostic(module=name, max_abs_error=err, ok=True))
    return errors, layers


def trace_and_validate(
    model: Any,
    batch: Batch,
    *,
    spec: MLIPSpec | None = None,
    world_size: int = 2,
    skin: float = 0.0,
    fix: bool = False,
    tolerance: float | None = None,
    timeout_s: float = 600.0,
) -> ValidationReport:
    """Infer a distribution spec, validate it on a multi-process CPU run, and
    (optionally) auto-fix when validation fails.

    Spawns ``world_size`` CPU ranks over gloo (the model and batch are pickled to
    them, so the model's class must be importable) and compares energy, forces
    and stress, and every submodule's per-atom output, with a single-process run
    by atom id. Use a small, representative batch (tens to hundreds of atoms).

    Parameters
    ----------
    spec:
        The spec to validate; default ``model.distribution_spec(HALO)``, else the
        first preset that validates (MPNN, LJ, UMA).
    fix:
        When the spec fails, try repairs and report the first that passes.
    tolerance:
        Absolute tolerance; default 1e-8 for float64 batches, 1e-4 for float32.
    """
    if world_size < 2:
        raise ConfigurationError(f"trace_and_validate needs world_size >= 2, got {world_size}")
    batch = batch.to("cpu")
    tol = tolerance if tolerance is not None else (1e-8 if batch.dtype == torch.float64 else 1e-4)
    cutoff = float(getattr(model, "cutoff", 0.0))
    if not cutoff > 0:
        raise ConfigurationError(f"{type(model).__name__} has no positive 'cutoff'")
    config = DomainConfig(cutoff=cutoff, skin=skin, migration_hysteresis=0.0)
    ref = _single(model, batch)

    candidates: list[tuple[str | None, MLIPSpec]] = []
    inferred = False
    if spec is not None:
        candidates.append((None, spec))
    else:
        try:
            candidates.append((None, model.distribution_spec(StrategyKind.HALO)))
        except (NvddError, NotImplementedError, AttributeError):
            inferred = True
            presets = (SPEC_MPNN_HALO, SPEC_LJ_HALO, SPEC_UMA_HALO)
            candidates += [(f"inferred {p.name}", p) for p in presets]

    report: ValidationReport | None = None
    fixes: list[str] = []
    repaired = False
    i = 0
    while i < len(candidates):  # repairs are appended while iterating
        label, candidate = candidates[i]
        i += 1
        if label is not None:
            fixes.append(label)
        report = _run_candidate(model, batch, candidate, config, ref, tol, world_size, timeout_s)
        report.applied_fixes = list(fixes)
        if report.passed:
            break
        if fix and not repaired:
            candidates += _repairs(model, candidate, report)
            repaired = True
        elif not (fix or inferred):
            break
    assert report is not None
    return report


def _run_candidate(
    model: Any,
    batch: Batch,
    spec: MLIPSpec,
    config: DomainConfig,
    ref: dict[str, Any],
    tol: float,
    world_size: int,
    timeout_s: float,
) -> ValidationReport:
    failure = None
    try:
        got = spawn_ranks(
            _validate_rank, world_size, model, batch, spec, config, timeout_s=timeout_s
        )[0]
        errors, layers = _compare(ref, got)
    except RankFailedError as exc:
        errors, layers, failure = {}, [], str(exc)
    passed = failure is None and bool(errors) and all(e <= tol for e in errors.values())
    layers = [LayerDiagnostic(d.module, d.max_abs_error, d.max_abs_error <= tol) for d in layers]
    return ValidationReport(
        passed=passed,
        spec=spec,
        errors=errors,
        tolerance=tol,
        layers=layers,
        world_size=world_size,
        failure=failure,
    )


def _repairs(model: Any, spec: MLIPSpec, report: ValidationReport) -> list[tuple[str, MLIPSpec]]:
    out: list[tuple[str, MLIPSpec]] = []
    culprit = report.first_uncovered
    if culprit is not None:
        module = dict(model.named_modules())[culprit]
        cls = type(module)
        adapters = neighbor_refresh_adapters(cls)
        fixed = spec | MLIPSpec(distribution=DistributionSpec(helpers=adapters))
        out.append((f"refresh ghost rows after {cls.__qualname__}.forward ({culprit})", fixed))
    other = (
        ForceStrategy.DIRECT
        if spec.force_strategy is ForceStrategy.AUTOGRAD
        else ForceStrategy.AUTOGRAD
    )
    if other is ForceStrategy.AUTOGRAD or "forces" in spec.outputs:
        out.append((f"force strategy {other.value}", spec.replace(force_strategy=other)))
    for preset in (SPEC_MPNN_HALO, SPEC_LJ_HALO, SPEC_UMA_HALO):
        if preset.name != spec.name:
            out.append((f"preset {preset.name}", preset))
    return out
