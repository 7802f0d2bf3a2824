"""Checkpoint and restart of a domain-decomposed run, on any number of ranks.

A checkpoint is a directory readable with NumPy and ``json`` alone:

- ``shard-<serial>-<rank>.npz``: one per rank, that rank's owned atoms, one
  array per per-atom field (``positions``, ``velocities``, ``forces``,
  ``atom_ids``, ..., extras as ``extra.<name>``), rows in the rank's order;
- ``systems-<serial>.npz``: the per-system fields (``cell``, ``pbc``,
  ``energy``, ``stress``, extras);
- ``manifest.json``: the format and version, the world size, the shard files
  with their atom counts, the field names, dtypes and shapes, the integrator's
  class and scalar state (step count, time step, seed ...) and state arrays (a
  thermostat's chain, FIRE's adaptive time step and mixing), the
  partitioner's boxes, and free metadata.

Writing is atomic as a whole: every file is written to a temporary name,
fsynced and renamed, and the manifest (the commit point) goes last, so a
failure anywhere (a full disk on one rank, a signal) leaves the previous
checkpoint intact and readable; stale files of older checkpoints are removed
only after the new manifest is in place.

Restart is exact: on the same number of ranks every rank reads back its own
rows and the same boxes (under graph partition: the same index blocks), so the
trajectory continues bit for bit; on another number of ranks, or under the
other strategy, the source rank reads every shard and scatters the system (by
atom id). Both strategies write the same format (``domain.strategy`` names the
one that wrote it; graph partition stores no boxes).
Both the saving run and the restarted one migrate and rebuild the halo at the
step after the checkpoint (see ``DistributedModel.request_rebuild``), so both
sum forces in the same order. The Langevin noise is a stateless function of
``(seed, step, atom id)``, so restoring the step count restores the noise.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from nvdd.core import (
    Batch,
    ConfigurationError,
    NvddError,
    ValidationError,
    all_gather_object,
    atomic_write,
    broadcast_object,
    raise_if_any_rank,
)
from nvdd.partition import IndexShardedBatch, ShardedBatch, SpatialPartitioner
from nvdd.spec import StrategyKind

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from nvdd.dynamics._config import DomainConfig
    from nvdd.dynamics._integrators import BaseDynamics
    from nvdd.dynamics._provider import ProviderBase

__all__ = [
    "CHECKPOINT_FORMAT",
    "CheckpointError",
    "check_adoptable",
    "load_checkpoint",
    "read_checkpoint",
    "save_checkpoint",
]

#: ``format`` and ``version`` of the manifest.
CHECKPOINT_FORMAT = ("nvdd-checkpoint", 1)
MANIFEST = "manifest.json"
_STALE = re.compile(r"^(shard-(\d+)-\d+|systems-(\d+))\.npz$")
_SCALARS = (bool, int, float, str)


class CheckpointError(NvddError, OSError):
    """A checkpoint could not be written or read (the previous one is intact)."""


class DomainParallel(Protocol):
    """What checkpoints read and call of a ``DomainParallel`` (typed here so that
    this module does not import the runtime that calls it)."""

    group: ProcessGroup | None
    rank: int
    src: int
    world_size: int
    config: DomainConfig
    dynamics: BaseDynamics
    model: ProviderBase

    @property
    def sharded(self) -> ShardedBatch | IndexShardedBatch: ...

    def totals(self, names: tuple[str, ...] = ...) -> dict[str, torch.Tensor]: ...

    def partition(
        self,
        batch: Batch | None = None,
        *,
        sharded: ShardedBatch | IndexShardedBatch | None = None,
    ) -> ShardedBatch | IndexShardedBatch: ...


# ----------------------------------------------------------------- helpers
def _bcast(obj: Any, src: int, group: ProcessGroup | None) -> Any:
    """``obj`` of group rank ``src`` on every rank (``nvdd.core.broadcast_object``).

    **Collective** over ``group``.
    """
    return broadcast_object(obj, src, group)


def _all_gather(obj: Any, group: ProcessGroup | None) -> list[Any]:
    """Every rank's ``obj`` in rank order (``nvdd.core.all_gather_object``).

    **Collective** over ``group``.
    """
    return all_gather_object(obj, group)


def _to_numpy(name: str, t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        raise ConfigurationError(f"checkpoint: field {name!r} is bfloat16, which npz cannot hold")
    return t.detach().cpu().numpy()


def _field_meta(fields: dict[str, torch.Tensor], extras: set[str]) -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "key": f"extra.{name}" if name in extras else name,
            "extra": name in extras,
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape[1:]),
        }
        for name, t in fields.items()
    ]


def integrator_state(dyn: BaseDynamics) -> dict[str, Any]:
    """The integrator's public scalar attributes (step count, time step, seed,
    thermostat and FIRE parameters and state): what a restart restores.

    Per-atom integrator state belongs in ``batch.atom_extras`` (it is saved with
    the atoms); tensors and objects held as attributes are not saved.
    """
    return {
        k: v
        for k, v in vars(dyn).items()
        if not k.startswith("_") and (v is None or isinstance(v, _SCALARS))
    }


def _next_serial(path: Path) -> int:
    manifest = path / MANIFEST
    if not manifest.exists():
        return 1
    try:
        return int(json.loads(manifest.read_text())["serial"]) + 1
    except (OSError, ValueError, KeyError, TypeError):
        return 1


# -------------------------------------------------------------------- save
def save_checkpoint(
    dp: DomainParallel, path: str | os.PathLike[str], *, metadata: dict[str, Any] | None = None
) -> Path:
    """Write a restartable checkpoint of ``dp``'s run to the directory ``path``.

    **Collective** over ``dp``'s mesh: every rank calls it at the same step
    (between steps, or from a hook). Every rank writes its own shard (the
    directory must be shared by all ranks, as on one node or a parallel file
    system); rank 0 writes the manifest last. Forces the halo to be rebuilt at
    the next step (so the restart, which rebuilds there too, stays bit-exact).

    Parameters
    ----------
    path:
        The checkpoint directory (created if missing). A previous checkpoint in
        it is replaced only once the new one is complete.
    metadata:
        JSON-able data stored in the manifest under ``"metadata"``.

    Returns
    -------
    Path
        The manifest's path.

    Raises
    ------
    CheckpointError
        On every rank together when any rank failed to write (a full disk, no
        permission); the message names the ranks and the previous checkpoint in
        ``path`` is left as it was.
    """
    path = Path(path)
    group, rank = dp.group, dp.rank
    dp.totals()  # per-system energy / stress of the last forces, in the batch
    batch = dp.dynamics.batch
    prep: tuple[str, Any] | None = None
    if rank == 0:
        try:
            path.mkdir(parents=True, exist_ok=True)
            prep = ("ok", _next_serial(path))
        except OSError as exc:
            prep = ("error", f"rank 0: cannot create {path}: {exc}")
    prep = _bcast(prep, 0, group)
    if prep is None or prep[0] != "ok":
        raise CheckpointError(f"checkpoint not written: {prep[1] if prep else 'no reply'}")
    serial = int(prep[1])
    name = f"shard-{serial:06d}-{rank:05d}.npz"
    fields = batch.atom_fields()
    meta = _field_meta(fields, set(batch.atom_extras))
    error = None
    try:
        arrays = {m["key"]: _to_numpy(m["name"], fields[m["name"]]) for m in meta}
        with atomic_write(path / name, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]
    except (OSError, ValueError, NvddError) as exc:
        error = f"rank {rank}: writing {path / name} failed: {exc}"
    reports = _all_gather((batch.n_atoms, meta, error), group)
    verdict: list[str] | None = None
    if rank == 0:
        verdict = [r[2] for r in reports if r[2] is not None]
        bad = [r for r, rep in enumerate(reports) if rep[1] != meta]
        if bad and not verdict:
            verdict = [f"ranks {bad} hold other per-atom fields than rank 0 ({meta})"]
        if not verdict:
            try:
                _write_rank0(dp, path, serial, [rep[0] for rep in reports], meta, metadata)
            except (OSError, ValueError, TypeError) as exc:
                verdict = [f"rank 0: writing the manifest in {path} failed: {exc}"]
    verdict = _bcast(verdict, 0, group)
    if verdict:
        with contextlib.suppress(OSError):
            os.unlink(path / name)
        if rank == 0:
            with contextlib.suppress(OSError):
                os.unlink(path / f"systems-{serial:06d}.npz")
        raise CheckpointError(
            f"checkpoint {path} not written ({'; '.join(verdict)}); the previous checkpoint "
            "there, if any, is intact"
        )
    if rank == 0:
        _remove_stale(path, serial)
    dp.model.request_rebuild()
    return path / MANIFEST


def _write_rank0(
    dp: DomainParallel,
    path: Path,
    serial: int,
    counts: list[int],
    meta: list[dict[str, Any]],
    metadata: dict[str, Any] | None,
) -> None:
    batch, dyn, cfg = dp.dynamics.batch, dp.dynamics, dp.config
    part = dp.sharded.partitioner
    systems_name = f"systems-{serial:06d}.npz"
    sys_fields = batch.system_fields()
    sys_meta = _field_meta(sys_fields, set(batch.system_extras))
    with atomic_write(path / systems_name, "wb") as f:
        np.savez(f, **{m["key"]: _to_numpy(m["name"], sys_fields[m["name"]]) for m in sys_meta})  # type: ignore[arg-type]
    manifest = {
        "format": CHECKPOINT_FORMAT[0],
        "version": CHECKPOINT_FORMAT[1],
        "serial": serial,
        "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "world_size": dp.world_size,
        "n_atoms": int(sum(counts)),
        "n_systems": batch.n_systems,
        "atom_fields": meta,
        "system_fields": sys_meta,
        "shards": [
            {"file": f"shard-{serial:06d}-{r:05d}.npz", "rank": r, "n_atoms": int(n)}
            for r, n in enumerate(counts)
        ],
        "systems_file": systems_name,
        "integrator": {
            "class": type(dyn).__name__,
            "module": type(dyn).__module__,
            "state": integrator_state(dyn),
            "arrays": {
                k: np.asarray(v, dtype=np.float64).tolist() for k, v in dyn.state_arrays().items()
            },
        },
        "domain": {
            "strategy": cfg.strategy.value,
            "cutoff": cfg.cutoff,
            "skin": cfg.skin,
            "ghost_width": dp.model.ghost_width,
            "grid_dims": list(cfg.grid_dims) if cfg.grid_dims else None,
            "load_balance": cfg.load_balance,
        },
        # spatial boxes (HALO); graph partition: the index blocks follow from the counts
        "partitioner": part.to_dict() if isinstance(part, SpatialPartitioner) else None,
        "metadata": metadata or {},
    }
    text = json.dumps(manifest, indent=1)
    with atomic_write(path / MANIFEST) as f:
        f.write(text)


def _remove_stale(path: Path, serial: int) -> None:
    for entry in os.listdir(path):
        m = _STALE.match(entry)
        if m is not None and int(m.group(2) or m.group(3)) != serial:
            with contextlib.suppress(OSError):
                os.unlink(path / entry)


# -------------------------------------------------------------------- read
def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of the checkpoint in directory ``path`` (local).

    Raises
    ------
    CheckpointError
        When there is none or it is not an nvdd checkpoint of a known version.
    """
    file = Path(path) / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"no checkpoint in {path}: {file} does not exist") from exc
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {file}: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT[0]:
        raise CheckpointError(f"{file} is not an nvdd checkpoint manifest")
    if manifest.get("version") != CHECKPOINT_FORMAT[1]:
        raise CheckpointError(
            f"{file}: checkpoint version {manifest.get('version')!r}, this nvdd reads "
            f"version {CHECKPOINT_FORMAT[1]}"
        )
    return manifest


def _arrays(path: Path, name: str, meta: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    file = path / name
    if file.is_file() and not zipfile.is_zipfile(file):  # (np.load would try pickle)
        raise CheckpointError(
            f"cannot read {file}: not an .npz archive (truncated, or overwritten by "
            "something else); the checkpoint is damaged"
        )
    try:
        with np.load(file, allow_pickle=False) as data:
            return {m["name"]: torch.from_numpy(np.array(data[m["key"]])) for m in meta}
    except KeyError as exc:
        raise CheckpointError(f"cannot read {file}: it lacks the array {exc}") from exc
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise CheckpointError(f"cannot read {file}: {type(exc).__name__}: {exc}") from exc


def _batch(
    atoms: dict[str, torch.Tensor], systems: dict[str, torch.Tensor], manifest: dict[str, Any]
) -> Batch:
    atom_extra = {m["name"] for m in manifest["atom_fields"] if m["extra"]}
    sys_extra = {m["name"] for m in manifest["system_fields"] if m["extra"]}
    return Batch(
        atoms["positions"],
        atoms["atomic_numbers"],
        cell=systems["cell"],
        pbc=systems["pbc"],
        masses=atoms["masses"],
        velocities=atoms["velocities"],
        forces=atoms["forces"],
        system_index=atoms["system_index"],
        atom_ids=atoms["atom_ids"],
        energy=systems["energy"],
        stress=systems["stress"],
        atom_extras={k: v for k, v in atoms.items() if k in atom_extra},
        system_extras={k: v for k, v in systems.items() if k in sys_extra},
    )


def read_shard(path: str | os.PathLike[str], rank: int, manifest: dict[str, Any]) -> Batch:
    """The atoms rank ``rank`` held when the checkpoint was written (local)."""
    path = Path(path)
    shard = manifest["shards"][rank]
    atoms = _arrays(path, shard["file"], manifest["atom_fields"])
    systems = _arrays(path, manifest["systems_file"], manifest["system_fields"])
    n = int(atoms["positions"].shape[0])
    if n != int(shard["n_atoms"]):
        raise CheckpointError(
            f"{path / shard['file']}: {n} atoms, the manifest says {shard['n_atoms']}"
        )
    return _batch(atoms, systems, manifest)


def read_checkpoint(path: str | os.PathLike[str]) -> tuple[Batch, dict[str, Any]]:
    """The whole system of a checkpoint, in atom-id order, and its manifest.

    Local (no process group needed): reads every shard. The batch lives on the
    CPU with the dtypes that were saved.

    Raises
    ------
    CheckpointError
        On a missing or unreadable file, or atom counts that disagree with the
        manifest.
    """
    manifest = read_manifest(path)
    systems = _arrays(Path(path), manifest["systems_file"], manifest["system_fields"])
    parts: dict[str, list[torch.Tensor]] = {m["name"]: [] for m in manifest["atom_fields"]}
    for shard in manifest["shards"]:
        atoms = _arrays(Path(path), shard["file"], manifest["atom_fields"])
        if int(atoms["positions"].shape[0]) != int(shard["n_atoms"]):
            raise CheckpointError(
                f"{Path(path) / shard['file']}: {int(atoms['positions'].shape[0])} atoms, the "
                f"manifest says {shard['n_atoms']}"
            )
        for k, v in atoms.items():
            parts[k].append(v)
    whole = {k: torch.cat(v) for k, v in parts.items()}
    if int(whole["positions"].shape[0]) != int(manifest["n_atoms"]):
        raise CheckpointError(
            f"{path}: the shards hold {whole['positions'].shape[0]} atoms, "
            f"the manifest says {manifest['n_atoms']}"
        )
    return _batch(whole, systems, manifest).sort_by_id(), manifest


# -------------------------------------------------------------------- load
def check_adoptable(
    sharded: ShardedBatch | IndexShardedBatch, ghost_width: float, *, graph: bool = False
) -> None:
    """Raise unless ``sharded`` fits the strategy (``graph``: an
    :class:`~nvdd.partition.IndexShardedBatch`, else a ``ShardedBatch`` whose
    partitioner uses ``ghost_width``). Local check."""
    want = IndexShardedBatch if graph else ShardedBatch
    if not isinstance(sharded, want):
        raise ConfigurationError(
            f"sharded must be a {want.__name__} under "
            f"{'GRAPH_PARTITION' if graph else 'HALO'}, got {type(sharded).__name__}"
        )
    if isinstance(sharded, ShardedBatch) and sharded.partitioner.ghost_width != ghost_width:
        raise ConfigurationError(
            f"the ShardedBatch's partitioner has ghost width {sharded.partitioner.ghost_width}, "
            f"this DomainParallel needs {ghost_width}"
        )


def load_checkpoint(dp: DomainParallel, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Restart ``dp`` from the checkpoint in ``path``, in place of ``partition``.

    **Collective** over ``dp``'s mesh. The integrator must be of the class that
    was saved; its scalar state (step count, time step, seed ...) and state
    arrays (chains, FIRE's adaptive state) are restored, and the saved forces
    are used for the first half step (no force computation at load). On the world size of the checkpoint, with the same
    ghost width, every rank reads its own shard and the saved boxes (an exact
    continuation); otherwise rank ``dp.src`` reads every shard and scatters.

    Returns
    -------
    dict
        The manifest (``manifest["metadata"]`` holds what the saver stored).

    Raises
    ------
    CheckpointError
        On every rank together when the checkpoint is missing or unreadable.
    ConfigurationError
        When the integrator's class differs from the saved one.
    """
    path = Path(path)
    group, rank = dp.group, dp.rank
    reply: tuple[str, Any] | None = None
    if rank == dp.src:
        try:
            reply = ("ok", read_manifest(path))
        except CheckpointError as exc:
            reply = ("error", f"rank {rank}: {exc}")
    reply = _bcast(reply, dp.src, group)
    if reply is None or reply[0] != "ok":
        raise CheckpointError(str(reply[1] if reply else "no manifest"))
    manifest: dict[str, Any] = reply[1]
    dyn = dp.dynamics
    saved = manifest["integrator"]["class"]
    if saved != type(dyn).__name__:
        raise ConfigurationError(
            f"rank {rank}: the checkpoint {path} was written by a {saved} integrator, this "
            f"DomainParallel wraps a {type(dyn).__name__}"
        )
    device = dyn.batch.device if isinstance(dyn.batch, Batch) else torch.device("cpu")
    strategy = dp.config.strategy
    graph = strategy is StrategyKind.GRAPH_PARTITION
    exact = (
        int(manifest["world_size"]) == dp.world_size
        and float(manifest["domain"]["ghost_width"]) == dp.model.ghost_width
        and manifest["domain"].get("strategy", StrategyKind.HALO.value) == strategy.value
        and (graph or manifest.get("partitioner") is not None)
    )
    if exact:
        local, problem = None, None
        try:
            local = read_shard(path, rank, manifest).to(device)
        except (CheckpointError, ValidationError) as exc:
            problem = str(exc)
        raise_if_any_rank(problem, group, exc_type=CheckpointError)
        assert local is not None
        if graph:  # the same index blocks, rows in the saved order
            dp.partition(sharded=IndexShardedBatch(local, group))
        else:
            part = SpatialPartitioner.from_dict(manifest["partitioner"])
            dp.partition(sharded=ShardedBatch(local, part, group))
    else:
        whole, problem = None, None
        if rank == dp.src:
            try:
                whole = read_checkpoint(path)[0].to(device)
            except (CheckpointError, ValidationError) as exc:
                problem = str(exc)
        raise_if_any_rank(problem, group, exc_type=CheckpointError)
        dp.partition(whole)
    for key, value in manifest["integrator"]["state"].items():
        setattr(dyn, key, value)
    arrays = manifest["integrator"].get("arrays", {})  # (absent before 2026-12-02)
    dyn.load_state_arrays({k: np.asarray(v, dtype=np.float64) for k, v in arrays.items()})
    dyn.step_state.forces_ready = True  # the saved forces drive the first half step
    dp.model.request_rebuild()
    return manifest
