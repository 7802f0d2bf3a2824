"""Never silently wrong: check a model decomposed against one process before trusting it.

A model whose forces come from autograd through message passing needs its ghost
rows refreshed between layers (``refresh_neighbors``, adapters, a spec preset);
a model written without them runs under domain decomposition with no error and
wrong forces. So at :meth:`DomainParallel.partition` a model that nvdd does not
ship (its class lives outside ``nvdd.models``) and whose spec computes forces by
autograd is run once on a probe of the user's own system, decomposed over the
scope's ranks and on one process, and compared by atom id
(:func:`~nvdd.dynamics.trace_and_validate`). When they differ, ``partition``
raises the same :class:`~nvdd.core.ConfigurationError` on every rank, with the
first module whose output differs and what to declare.

The probe is the whole system up to :data:`PROBE_MAX_ATOMS` atoms; a larger
single system is cut to a sphere of radius ``3 x`` the ghost width around its
centre (open boundaries, the atoms' real positions), enough for a second
message-passing layer to reach past a rank boundary. A model passes once per
process and spec. ``DomainConfig(verify_model=True)`` checks every model (direct
forces and shipped models too), ``False`` none.

A receptive-field spec (:func:`nvdd.spec.receptive_field_spec`, the safe path the
error names) is checked too: it catches a declared layer count that is too small.

A model whose single-process forward raises inside the process group (one that
refuses to run while a group exists, say) is not checked, with a warning.
Halo and graph-partition scopes are both checked, each under its own strategy.
Not covered: composed (pipeline) models, restarts from
a checkpoint (no whole system at hand), scopes whose group is not the whole
world or whose source rank is not 0, and multi-system batches over the probe
size (a warning says so).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch

from nvdd.core import Batch, ConfigurationError
from nvdd.spec import ForceStrategy, MLIPSpec, StrategyKind

__all__ = ["PROBE_MAX_ATOMS", "needs_verification", "probe_batch", "verify_model"]

#: Systems up to this many atoms are checked whole.
PROBE_MAX_ATOMS = 2000
#: The probe sphere's radius, in ghost widths.
PROBE_RADIUS_GHOST_WIDTHS = 3.0

_passed: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def needs_verification(model: Any, spec: MLIPSpec, setting: bool | None) -> bool:
    """Whether ``partition`` checks ``model`` under ``spec`` (``setting``:
    ``DomainConfig.verify_model``; None is the default rule)."""
    if setting is not None:
        return setting
    shipped = type(model).__module__.startswith("nvdd.models.")
    return spec.force_strategy is ForceStrategy.AUTOGRAD and not shipped


def probe_batch(batch: Batch, ghost_width: float) -> Batch | None:
    """The system the check runs on (None: too large and several systems)."""
    if batch.n_atoms <= PROBE_MAX_ATOMS:
        return batch
    if batch.n_systems != 1:
        return None
    pos = batch.positions
    cell = batch.cell[0]
    pbc = batch.pbc[0]
    if bool(pbc.any()):
        frac = torch.linalg.solve(cell.T, pos.T).T
        frac = torch.where(pbc, torch.remainder(frac, 1.0), frac)
        pos = frac @ cell
        centre = 0.5 * cell.sum(dim=0)
    else:
        centre = pos.mean(dim=0)
    dist = (pos - centre).norm(dim=1)
    radius = PROBE_RADIUS_GHOST_WIDTHS * ghost_width
    order = torch.argsort(dist)[:PROBE_MAX_ATOMS]
    keep = order[dist[order] < radius]
    cut = batch.select(keep)
    return cut.replace(positions=pos[keep], pbc=torch.zeros_like(batch.pbc))


def verify_model(
    model: Any,
    spec: MLIPSpec,
    batch: Batch,
    *,
    is_source: bool,
    ghost_width: float,
    skin: float,
    strategy: StrategyKind = StrategyKind.HALO,
) -> None:
    """Check ``model`` decomposed over the world against one process; raise on a mismatch.

    **Collective** over the default group (every rank calls it; the source
    rank's ``batch`` is the system, the others' only give the dtype). Raises
    the same :class:`ConfigurationError` on every rank when the model differs.
    """
    from nvdd.dynamics._launch import broadcast
    from nvdd.dynamics._validate import ReferenceRunError, trace_and_validate

    key = f"{strategy.value}:{spec.name}"
    if key in _passed.get(model, set()):
        return
    probe = probe_batch(batch, ghost_width) if is_source else None
    skip = broadcast(is_source and probe is None)
    if skip:
        warnings.warn(
            f"DomainParallel: {type(model).__name__} was not checked against one process "
            f"(more than {PROBE_MAX_ATOMS} atoms in several systems); run "
            "trace_and_validate on a small batch to check its spec",
            UserWarning,
            stacklevel=3,
        )
        return
    try:
        report = trace_and_validate(
            model, probe if probe is not None else batch, spec=spec, skin=skin, strategy=strategy
        )
    except ReferenceRunError as exc:  # e.g. a model that refuses to run inside a process group
        warnings.warn(
            f"DomainParallel: {type(model).__name__} was not checked against one process "
            f"({exc}); run trace_and_validate on a small batch to check its spec",
            UserWarning,
            stacklevel=3,
        )
        return
    if not report.passed and spec.owned_rows_exact:
        errors = ", ".join(f"{k} {v:.3e}" for k, v in report.errors.items())
        raise ConfigurationError(
            f"DomainParallel.partition: {type(model).__name__} with the receptive-field spec "
            f"{spec.name!r} gives different results decomposed over {report.world_size} ranks "
            f"than on one process (max abs error {errors or 'n/a'}; tolerance "
            f"{report.tolerance:g}): it reaches further than "
            f"{spec.options.receptive_field_layers} message-passing layers of the cutoff. "
            "Declare its real number of layers (receptive_field_spec(layers=L)) or the "
            "cutoff its layers use (DomainConfig.cutoff).\n" + report.summary()
        )
    if not report.passed:
        errors = ", ".join(f"{k} {v:.3e}" for k, v in report.errors.items())
        raise ConfigurationError(
            f"DomainParallel.partition: {type(model).__name__} with spec {spec.name!r} gives "
            f"different results decomposed over {report.world_size} ranks than on one process "
            f"(max abs error {errors or 'n/a'}; tolerance {report.tolerance:g}), so its run "
            "would be silently wrong. To run the model unmodified, declare the safe path: "
            "DomainParallel(dyn, config, spec=nvdd.spec.receptive_field_spec(layers=L)) with "
            "L its message-passing layers (a halo of 2 x L x cutoff; forces exact on owned "
            "rows, the energy from its 'atom_energies'). Faster, where the model has them: "
            "refresh its ghost rows between layers (nvdd.shardtensor.refresh_neighbors on "
            "the features each layer reads) or declare adapters / a preset in "
            "distribution_spec (see 'Bring your own model' in the docs); "
            "trace_and_validate(model, batch, fix=True) suggests a spec. "
            "(DomainConfig(verify_model=False) skips this check.)\n" + report.summary()
        )
    _passed.setdefault(model, set()).add(key)
