"""`trace_and_validate`: check a model's distribution spec before trusting it.

The model runs once on one process (the reference) and once decomposed over a
few ranks; outputs and every submodule's per-atom inputs and outputs
(``ModuleProbe``) are compared by global atom id. The first module whose owned
rows differ, and the stale neighbour input it read, locate an uncovered
operation (``_diagnose``). With ``fix=True`` candidate repairs are tried (a ghost
refresh after the module that produced the stale input, the other force
strategy, the presets, then the receptive-field safe path with 1 to 4 layers:
the model unmodified) and the first that validates is reported.

Ranks: spawned CPU ranks over gloo when the caller has no process group, else
the caller's own ranks (``torchrun``; ``device="cuda"`` for one GPU per rank).
See ``_launch``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from nvdd.core import (
    Batch,
    ConfigurationError,
    NvddError,
    RankFailedError,
    all_gather_object,
    spawn_ranks,
)
from nvdd.dynamics._config import DomainConfig
from nvdd.dynamics._diagnose import Culprit, LayerDiagnostic, RankProbe, diagnose
from nvdd.dynamics._distributed_model import DistributedModel
from nvdd.dynamics._graph_partition import GraphPartitionModel
from nvdd.dynamics._launch import broadcast, resolve_device, unguarded_caller
from nvdd.dynamics._probe import Call, ModuleProbe
from nvdd.dynamics._spec_report import describe_spec
from nvdd.spec import (
    SPEC_LJ_HALO,
    SPEC_MPNN_GP,
    SPEC_MPNN_HALO,
    SPEC_UMA_HALO,
    AdapterStatus,
    DistributionSpec,
    ForceStrategy,
    MLIPSpec,
    StrategyKind,
    neighbor_refresh_adapters,
    receptive_field_spec,
)

__all__ = ["LayerDiagnostic", "ValidationReport", "trace_and_validate"]

_OUTPUTS = ("energy", "forces", "stress")
#: ``fix=True`` tries the receptive-field safe path with 1 .. this many layers last.
RECEPTIVE_LAYERS_TRIED = 4
_NO_REPORT = "without reporting a result"


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
        Per-module diagnostics in call order.
    world_size:
        Ranks of the decomposed run.
    failure:
        Text of an exception raised by the decomposed run, if any.
    culprit:
        The first module whose per-atom output differs and the stale neighbour
        input it read (:class:`~nvdd.dynamics._diagnose.Culprit`), if any.
    adapters:
        Status of every adapter of the spec on rank 0 (applied or why not).
    not_probed:
        TorchScript submodules that could not be hooked (their Python parents
        were); ``["<root>"]`` when the whole model is TorchScript.
    device:
        Where the decomposed run ran.
    """

    passed: bool
    spec: MLIPSpec
    errors: dict[str, float]
    tolerance: float
    applied_fixes: list[str] = field(default_factory=list)
    layers: list[LayerDiagnostic] = field(default_factory=list)
    world_size: int = 2
    failure: str | None = None
    culprit: Culprit | None = None
    adapters: list[AdapterStatus] = field(default_factory=list)
    not_probed: list[str] = field(default_factory=list)
    device: str = "cpu"

    @property
    def first_uncovered(self) -> str | None:
        """Name of the first module whose per-atom output differs, if any."""
        if self.culprit is not None:
            return self.culprit.module
        return next((d.module for d in self.layers if not d.ok), None)

    def summary(self) -> str:
        """A few lines for humans, naming the spec actually in use."""
        verdict = "PASSED" if self.passed else "FAILED"
        lines = [
            f"trace_and_validate: {verdict} on {self.world_size} ranks ({self.device}, "
            f"tolerance {self.tolerance:g})",
            *("  " + line for line in describe_spec(self.spec).splitlines()),
        ]
        for status in self.adapters:
            state = "applied" if status.applied else f"NOT applied ({status.error})"
            lines.append(f"  adapter {status.adapter}: {state}")
        lines += [f"  {k}: max abs error {v:.3e}" for k, v in self.errors.items()]
        c = self.culprit
        if c is not None:
            lines.append(f"  first module whose per-atom output differs: {c.module}")
            if c.stale_input is not None:
                source = f", produced by {c.producer}" if c.producer else ""
                lines.append(
                    f"  it reads stale ghost rows of its input {c.stale_input!r}{source}: "
                    "refresh them (e.g. neighbor_refresh_adapters on the producing module's "
                    "class, or refresh_neighbors in the model)"
                )
        elif self.first_uncovered:
            lines.append(f"  first module whose per-atom output differs: {self.first_uncovered}")
        if self.not_probed:
            if self.not_probed == ["<root>"]:
                lines.append("  the model is TorchScript: outputs compared, no per-module probe")
            else:
                shown = ", ".join(self.not_probed[:3]) + (
                    ", ..." if len(self.not_probed) > 3 else ""
                )
                lines.append(
                    f"  {len(self.not_probed)} TorchScript submodules not probed (their Python "
                    f"parents were): {shown}"
                )
        lines += [f"  fix tried: {f}" for f in self.applied_fixes]
        if self.failure:
            lines.append(f"  decomposed run failed: {self.failure.strip().splitlines()[-1]}")
            if _NO_REPORT in self.failure:
                lines.append(
                    "  (a rank that exits without reporting was killed, ran out of memory, or "
                    "re-ran the calling script at import: call trace_and_validate under "
                    "if __name__ == '__main__':)"
                )
        return "\n".join(lines)


def _probe_single(model: Any, batch: Batch) -> dict[str, Any]:
    probe = ModuleProbe(model, lambda: batch.n_atoms)
    with probe:
        out = model(batch)
    return {
        "outputs": {k: v.detach().cpu() for k, v in out.items() if k in _OUTPUTS},
        "ids": batch.atom_ids.cpu(),
        "calls": probe.calls,
        "not_probed": probe.not_probed,
    }


def _validate_rank(
    model: Any, batch: Batch, spec: MLIPSpec, config: DomainConfig, device: str
) -> dict[str, Any]:
    """Body run on every rank: one decomposed forward, probed; results on rank 0.

    **Collective** over the default group.
    """
    from nvdd.partition import IndexShardedBatch, ShardedBatch, SpatialPartitioner

    rank, world = dist.get_rank(), dist.get_world_size()
    if isinstance(model, torch.nn.Module):
        model.to(device)
    graph = config.strategy is StrategyKind.GRAPH_PARTITION
    dm = (GraphPartitionModel if graph else DistributedModel)(model, config, spec=spec, count=False)

    def factory(b: Batch) -> SpatialPartitioner:
        return SpatialPartitioner.from_batch(b, world, dm.ghost_width)

    sharded: ShardedBatch | IndexShardedBatch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny validation systems are often degenerate
        source = batch.to(device) if rank == 0 else None
        if graph:  # index blocks along a space-filling curve, as DomainParallel cuts them
            sharded = IndexShardedBatch.from_batch(source, None, order="space")
        else:
            sharded = ShardedBatch.from_batch(source, None, factory)
    dm.attach(sharded)
    try:
        probe = ModuleProbe(model, lambda: dm.plan.n_padded)
        with probe:
            local, out = dm(sharded.local_batch)
        totals = dm.materialize()
        merged: dict[str, Any] = {**out, **totals}
        outputs = {k: v.cpu() for k, v in merged.items() if k in _OUTPUTS}
        ids = local.atom_ids.cpu()
        padded_ids = torch.cat([ids, dm.plan.ghost_atom_ids.cpu()])
        mine = (ids, outputs.get("forces"), RankProbe(padded_ids, dm.plan.n_owned, probe.calls))
        gathered: list[Any] = all_gather_object(mine)
        statuses = [replace(s) for s in dm.adapter_statuses]  # before detach resets them
    finally:
        dm.detach()
    if rank != 0:
        return {}
    outputs = dict(outputs)
    if outputs.get("forces") is not None:
        outputs["forces"] = torch.cat([g[1] for g in gathered])
    return {
        "outputs": outputs,
        "ids": torch.cat([g[0] for g in gathered]),
        "probes": [g[2] for g in gathered],
        "adapters": statuses,
    }


def _by_id(ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x[torch.argsort(ids)]


def _output_errors(ref: dict[str, Any], got: dict[str, Any]) -> dict[str, float]:
    errors = {}
    for k, v in ref["outputs"].items():
        if k not in got["outputs"]:
            continue
        g = got["outputs"][k]
        if k == "forces":
            v, g = _by_id(ref["ids"], v), _by_id(got["ids"], g)
        errors[k] = float((v.double() - g.double()).abs().max()) if v.numel() else 0.0
    return errors


def _report(
    spec: MLIPSpec, ref: dict[str, Any], got: dict[str, Any] | None, failure: str | None, tol: float
) -> ValidationReport:
    errors: dict[str, float] = {}
    layers: list[LayerDiagnostic] = []
    culprit = None
    adapters: list[AdapterStatus] = []
    if got is not None:
        errors = _output_errors(ref, got)
        calls: dict[str, Call] = ref["calls"]
        layers, culprit = diagnose(calls, ref["ids"], got["probes"], tol)
        adapters = got["adapters"]
    passed = failure is None and bool(errors) and all(e <= tol for e in errors.values())
    return ValidationReport(
        passed=passed,
        spec=spec,
        errors=errors,
        tolerance=tol,
        layers=layers,
        failure=failure,
        culprit=culprit if not passed else None,
        adapters=adapters,
        not_probed=list(ref["not_probed"]),
    )


def trace_and_validate(
    model: Any,
    batch: Batch,
    *,
    spec: MLIPSpec | None = None,
    world_size: int | None = None,
    skin: float = 0.0,
    fix: bool = False,
    tolerance: float | None = None,
    timeout_s: float = 600.0,
    device: str | torch.device | None = None,
    strategy: StrategyKind | str = StrategyKind.HALO,
) -> ValidationReport:
    """Infer a distribution spec, validate it on a multi-process run, and
    (optionally) auto-fix when validation fails.

    Compares energy, forces and stress, and every submodule's per-atom inputs
    and outputs, between a single-process run and a decomposed one, by atom id.
    Use a small, representative batch (tens to hundreds of atoms).

    Without a process group, ``world_size`` CPU ranks over gloo are spawned from
    this process (the model and batch are pickled to them, so the model's class
    must be importable, and a calling script must make the call under
    ``if __name__ == "__main__":``). Under an existing process group of two or
    more ranks (``torchrun``, ``run_ranks``), every rank must call it with the
    same arguments (**Collective** over the default group); the decomposed run
    uses those ranks on ``device`` and every rank receives the same report.

    Parameters
    ----------
    spec:
        The spec to validate; default ``model.distribution_spec(strategy)``, else
        the first preset of that strategy that validates (HALO: MPNN, LJ, UMA;
        GRAPH_PARTITION: MPNN, LJ).
    world_size:
        Ranks to spawn (default 2); must match the group's size if given under
        an existing group.
    skin:
        Verlet skin of the decomposition.
    fix:
        When the spec fails, try repairs and report the first that passes (a
        ghost refresh, the other force strategy, the presets, and last the
        receptive-field safe path, ``receptive_field_spec(layers)`` with 1 to
        :data:`RECEPTIVE_LAYERS_TRIED` layers, which runs the model unmodified;
        on a batch whose ranks' halos hold nearly every atom too few layers
        pass too: declare the model's real number).
    tolerance:
        Absolute tolerance; default 1e-8 for float64 batches, 1e-4 for float32.
    timeout_s:
        Spawned ranks are killed after this long.
    device:
        ``"cuda"`` runs the decomposed forward on each rank's GPU (needs an
        existing NCCL group); default CPU for spawned ranks, the group's device
        otherwise.
    strategy:
        The decomposition to validate under: ``StrategyKind.HALO`` (spatial
        boxes) or ``GRAPH_PARTITION`` (index blocks, the model's own neighbour
        list over the real cell); the spec must declare that storage.

    Raises
    ------
    ConfigurationError
        On bad arguments, a model without a positive ``cutoff``, a CUDA device
        without a process group, a top-level call in a script without a
        ``__main__`` guard, or ``GRAPH_PARTITION`` for a model whose
        ``distribution_spec`` refuses it (checked before any rank is spawned).
    """
    try:
        kind = strategy if isinstance(strategy, StrategyKind) else StrategyKind(strategy)
    except ValueError:
        raise ConfigurationError(
            f"trace_and_validate(strategy={strategy!r}): one of {[k.value for k in StrategyKind]}"
        ) from None
    collective = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if collective:
        world = dist.get_world_size()
        if world_size is not None and world_size != world:
            raise ConfigurationError(
                f"trace_and_validate(world_size={world_size}) under a process group of {world} "
                "ranks: leave world_size out (the group's ranks are used)"
            )
    else:
        world = 2 if world_size is None else world_size
        if world < 2:
            raise ConfigurationError(f"trace_and_validate needs world_size >= 2, got {world}")
    dev = resolve_device(device, collective)
    tol = tolerance if tolerance is not None else (1e-8 if batch.dtype == torch.float64 else 1e-4)
    cutoff = float(getattr(model, "cutoff", 0.0))
    if not cutoff > 0:
        raise ConfigurationError(f"{type(model).__name__} has no positive 'cutoff'")
    if not collective:
        where = unguarded_caller()
        if where is not None:
            raise ConfigurationError(
                f"trace_and_validate was called at the top level of the script {where} without "
                'an `if __name__ == "__main__":` guard. It starts CPU ranks that re-import '
                "the script, so the call would run again in every rank; move it under the "
                "guard (or into a function called from there). This is not a problem with "
                "the model's spec."
            )
    graph = kind is StrategyKind.GRAPH_PARTITION
    config = DomainConfig(
        cutoff=cutoff, skin=skin, migration_hysteresis=None if graph else 0.0, strategy=kind
    )
    if graph and spec is None and hasattr(model, "distribution_spec"):
        try:  # a model that declares its specs and has none for graph partition: refuse now
            model.distribution_spec(kind)
        except ConfigurationError as exc:
            raise ConfigurationError(
                f"trace_and_validate(strategy={kind}): {exc}; validate it with "
                "strategy=StrategyKind.HALO, or pass the graph-partition spec to check as spec="
            ) from exc
    if isinstance(model, torch.nn.Module):
        model.to(dev)  # the reference runs where the decomposed run will
    is_root = not collective or dist.get_rank() == 0
    ref = _reference(model, batch.to(dev), is_root, collective)

    candidates: list[tuple[str | None, MLIPSpec]] = []
    inferred = False
    if spec is not None:
        candidates.append((None, spec))
    else:
        try:
            candidates.append((None, model.distribution_spec(kind)))
        except (NvddError, NotImplementedError, AttributeError):
            inferred = True
            candidates += [(f"inferred {p.name}", p) for p in _presets(kind)]

    report: ValidationReport | None = None
    fixes: list[str] = []
    repaired = False
    i = 0
    while i < len(candidates):  # repairs are appended while iterating
        label, candidate = candidates[i]
        i += 1
        if label is not None:
            fixes.append(label)
        if collective:
            report = _run_collective(model, batch, candidate, config, ref, tol, dev)
        else:
            assert ref is not None
            report = _run_spawned(model, batch, candidate, config, ref, tol, world, timeout_s)
        report.applied_fixes = list(fixes)
        report.world_size = world
        report.device = str(dev)
        if report.passed:
            break
        if fix and not repaired:
            candidates += _repairs(model, candidate, report, kind)
            repaired = True
        elif not (fix or inferred):
            break
    assert report is not None
    return report


class ReferenceRunError(ConfigurationError):
    """The single-process reference forward raised (on rank 0, reported on every rank)."""


def _reference(model: Any, batch: Batch, is_root: bool, collective: bool) -> dict[str, Any] | None:
    """The single-process run on the root. Under a process group every rank learns
    whether it raised (**Collective**), so none is left waiting in the decomposed run."""
    if not collective:
        return _probe_single(model, batch) if is_root else None
    ref, failure = None, None
    if is_root:
        try:
            ref = _probe_single(model, batch)
        except Exception as exc:  # reported on every rank below
            failure = f"{type(exc).__name__}: {exc}"
    failure = broadcast(failure)
    if failure is not None:
        raise ReferenceRunError(
            f"trace_and_validate: the single-process reference run raised on rank 0: {failure}"
        )
    return ref


def _run_spawned(
    model: Any,
    batch: Batch,
    spec: MLIPSpec,
    config: DomainConfig,
    ref: dict[str, Any],
    tol: float,
    world_size: int,
    timeout_s: float,
) -> ValidationReport:
    try:
        got = spawn_ranks(
            _validate_rank,
            world_size,
            model,
            batch.to("cpu"),
            spec,
            config,
            "cpu",
            timeout_s=timeout_s,
        )[0]
    except RankFailedError as exc:
        return _report(spec, ref, None, str(exc), tol)
    return _report(spec, ref, got, None, tol)


def _run_collective(
    model: Any,
    batch: Batch,
    spec: MLIPSpec,
    config: DomainConfig,
    ref: dict[str, Any] | None,
    tol: float,
    device: torch.device,
) -> ValidationReport:
    """Every rank runs the decomposed forward; rank 0 judges; all get its report.

    **Collective** over the default group. An exception on one rank propagates
    on that rank (the others stop at the group's timeout), as in any collective code.
    """
    got = _validate_rank(model, batch, spec, config, str(device))
    report = _report(spec, ref, got, None, tol) if ref is not None else None
    result: ValidationReport = broadcast(report)
    return result


def _presets(kind: StrategyKind) -> tuple[MLIPSpec, ...]:
    """The presets tried when the model has no spec for ``kind`` (or as repairs)."""
    if kind is StrategyKind.GRAPH_PARTITION:
        gp = MLIPSpec(distribution=DistributionSpec(storage=StrategyKind.GRAPH_PARTITION))
        return (SPEC_MPNN_GP, (SPEC_LJ_HALO | gp).replace(name="SPEC_LJ_HALO | graph partition"))
    return (SPEC_MPNN_HALO, SPEC_LJ_HALO, SPEC_UMA_HALO)


def _repairs(
    model: Any, spec: MLIPSpec, report: ValidationReport, kind: StrategyKind = StrategyKind.HALO
) -> list[tuple[str, MLIPSpec]]:
    out: list[tuple[str, MLIPSpec]] = []
    culprit = report.culprit
    named = dict(model.named_modules()) if hasattr(model, "named_modules") else {}
    if culprit is not None:
        target = culprit.producer.split("[")[0] if culprit.producer else culprit.module
        module = named.get(target)
        if module is not None and not isinstance(module, torch.jit.ScriptModule):
            cls = type(module)
            adapters = neighbor_refresh_adapters(cls)
            fixed = spec | MLIPSpec(distribution=DistributionSpec(helpers=adapters))
            out.append((f"refresh ghost rows after {cls.__qualname__}.forward ({target})", fixed))
    other = (
        ForceStrategy.DIRECT
        if spec.force_strategy is ForceStrategy.AUTOGRAD
        else ForceStrategy.AUTOGRAD
    )
    if other is ForceStrategy.AUTOGRAD or "forces" in spec.outputs:
        out.append((f"force strategy {other.value}", spec.replace(force_strategy=other)))
    for preset in _presets(kind):
        if preset.name != spec.name:
            out.append((f"preset {preset.name}", preset))
    for layers in range(1, RECEPTIVE_LAYERS_TRIED + 1):  # last: the model unmodified
        safe = receptive_field_spec(layers, kind)
        if safe.name != spec.name:
            label = (
                f"the receptive-field safe path, receptive_field_spec(layers={layers}) (as "
                "strong as the batch: declare the model's real number of layers)"
            )
            out.append((label, safe))
    return out
