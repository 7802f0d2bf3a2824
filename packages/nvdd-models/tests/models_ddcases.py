"""Domain-decomposed runs of the models against the runtime contract, for the gloo tests.

nvdd-dynamics (the runtime) sits above this package, so these helpers do what
its ``DistributedModel`` does, with nvdd-halo directly: own the atoms of a
box, build the halo plan, lay out ``[owned | ghost]`` rows with open boundaries
and the real cell, run the model inside ``dd_scope(DDContext(...))``, fold the
returned forces into their owners and sum the per-rank partials.

Everything is deterministic in its arguments, so every rank (which rebuilds a
case from its name) and the test process (which runs the single-process
oracle) agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from models_testutils import jittered_lattice

from nvdd.core import Batch, ValidationError
from nvdd.halo import HaloPlan, ParticleHaloConfig, build_halo_plan
from nvdd.models import (
    ForceMode,
    LennardJones,
    LJBackend,
    LJConfig,
    MACEConfig,
    MACEModel,
    MPNNConfig,
    ReferenceMPNN,
    build_mace,
)
from nvdd.shardtensor import DDContext, dd_scope
from nvdd.spec import AdapterRegistry, ForceStrategy

INF = math.inf
#: Halo width beyond the model's cutoff (the runtime's skin).
HALO_MARGIN = 0.3

LJ_SPECIES = {18: (1.0, 1.0), 10: (0.4, 0.8), 36: (1.3, 1.1)}
LJ_PAIRS = {(36, 10): (0.7, 0.95)}
LJ_CUTOFF = 2.5
MPNN_CUTOFF = 2.6
_ZS = {"lj": (18, 10, 36), "mpnn": (1, 6, 8), "mace": (1, 6, 8)}


@dataclass(frozen=True)
class System:
    """One periodic (or mixed) system: cell, pbc, lattice and the cuts of its boxes."""

    cell: tuple[tuple[float, float, float], ...]
    pbc: tuple[bool, bool, bool]
    grid: tuple[int, int, int]
    cuts: tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]
    seed: int


_PERIODIC = System(
    ((6.6, 0.0, 0.0), (0.0, 4.95, 0.0), (0.0, 0.0, 5.1)),
    (True, True, True),
    (4, 3, 3),
    ((0.5,), (), ()),
    seed=1,
)
_TRICLINIC = System(
    ((7.5, 0.0, 0.0), (1.0, 5.0, 0.0), (-0.6, 0.8, 5.2)),
    (True, True, True),
    (5, 3, 3),
    ((0.3, 0.62), (), ()),
    seed=2,
)
_TRICLINIC_2 = System(_TRICLINIC.cell, _TRICLINIC.pbc, (4, 3, 3), ((0.45,), (), ()), seed=5)
# Mixed boundaries, cut along the open axis (boxes reach -inf / +inf there).
_MIXED_OPEN_CUTS = System(
    ((5.0, 0.0, 0.0), (0.7, 6.6, 0.0), (0.4, -0.5, 5.0)),
    (True, False, True),
    (3, 4, 3),
    ((), (0.3, 0.65), ()),
    seed=3,
)
# Mixed boundaries, cut along a periodic axis.
_MIXED_PERIODIC_CUT = System(
    ((6.4, 0.0, 0.0), (0.5, 5.0, 0.0), (-0.4, 0.6, 4.9)),
    (True, False, True),
    (4, 3, 3),
    ((0.5,), (), ()),
    seed=4,
)

# The first box holds no atom (lattice planes start at x = 0.125): a rank with
# ghosts only must still take part in every collective.
_PERIODIC_EMPTY_BOX = System(
    _PERIODIC.cell, _PERIODIC.pbc, _PERIODIC.grid, ((0.02, 0.5), (), ()), 1
)

# Open boundaries, cut at x = 0.93 of the box: rank 1 owns no atom and holds
# rank 0's edge atoms as ghosts, rank 0 holds no ghost row at all (and still
# sends: every rank must call every exchange).
_OPEN_LOPSIDED = System(_PERIODIC.cell, (False, False, False), _PERIODIC.grid, ((0.93,), (), ()), 6)

#: name -> (world size, systems of the batch)
CASES: dict[str, tuple[int, tuple[System, ...]]] = {
    "periodic-2": (2, (_PERIODIC,)),
    "triclinic-3": (3, (_TRICLINIC,)),
    "mixed-open-cuts-3": (3, (_MIXED_OPEN_CUTS,)),
    "mixed-periodic-cut-2": (2, (_MIXED_PERIODIC_CUT,)),
    "two-systems-2": (2, (_PERIODIC, _TRICLINIC_2)),
    "empty-rank-3": (3, (_PERIODIC_EMPTY_BOX,)),
    "open-lopsided-2": (2, (_OPEN_LOPSIDED,)),
}


def make_model(
    kind: str,
    layers: int = 2,
    skin: float = 0.0,
    mode: str = "direct",
    dtype: Any = None,
    backend: str = "auto",
    half_list: bool = True,
    neighbors: str = "auto",
) -> Any:
    """The models under test (identical on every rank and in the oracle).

    ``backend`` and ``half_list`` choose the LJ implementation (the oracle of
    the tests uses the torch reference, the ranks the default Warp path).
    ``"mace"``: a small random mace-torch ScaleShiftMACE (``layers`` interactions,
    ``mode="no-refresh"`` drops its ghost refresh adapters from the spec).
    """
    if kind == "mace":
        config = MACEConfig(atomic_numbers=_ZS["mace"], r_max=MPNN_CUTOFF, num_interactions=layers)
        model = MACEModel(build_mace(config, dtype=dtype or torch.float64), skin=skin)
        model.drop_refresh = mode == "no-refresh"  # type: ignore[assignment]
        return model
    if kind == "lj":
        return LennardJones(
            LJConfig(
                cutoff=LJ_CUTOFF,
                species=LJ_SPECIES,
                pairs=LJ_PAIRS,
                force_mode=ForceMode(mode),
                skin=skin,
                backend=LJBackend(backend),
                half_list=half_list,
            )
        )
    config = MPNNConfig(
        cutoff=MPNN_CUTOFF,
        species=_ZS["mpnn"],
        hidden=8,
        n_basis=6,
        n_layers=layers,
        seed=7,
        skin=skin,
        neighbors=neighbors,
    )
    return ReferenceMPNN(config, dtype=dtype or torch.float64)


def adapters_of(model: Any) -> tuple[Any, ...]:
    """The spec's adapters, as the runtime installs them (none with ``drop_refresh``)."""
    if getattr(model, "drop_refresh", False):
        return ()
    return tuple(model.distribution_spec().adapters())


def is_autograd(model: Any) -> bool:
    return bool(model.distribution_spec().force_strategy is ForceStrategy.AUTOGRAD)


def cutoff_of(kind: str) -> float:
    return LJ_CUTOFF if kind == "lj" else MPNN_CUTOFF


def _system_atoms(sys: System) -> tuple[torch.Tensor, torch.Tensor]:
    """Wrapped positions and species indices (0..2) of one system."""
    cell = np.asarray(sys.cell, dtype=np.float64)
    pos = jittered_lattice(sys.grid, cell, 0.15, sys.seed)
    frac = pos @ np.linalg.inv(cell)
    for a in range(3):
        if sys.pbc[a]:
            frac[:, a] -= np.floor(frac[:, a])
    species = np.random.default_rng(sys.seed).integers(0, 3, size=len(pos))
    return torch.tensor(frac @ cell), torch.tensor(species)


def global_batch(
    case: str, kind: str, shift: float = 0.0, dtype: torch.dtype = torch.float64
) -> Batch:
    """The whole system of ``case`` (every system of its batch), moved by ``shift``.

    ``shift`` scales a fixed random displacement per atom (the same on every rank).
    """
    _, systems = CASES[case]
    pos, species, si = [], [], []
    for s, sys in enumerate(systems):
        p, z = _system_atoms(sys)
        pos.append(p)
        species.append(z)
        si.append(torch.full((len(p),), s, dtype=torch.int64))
    positions = torch.cat(pos)
    n = positions.shape[0]
    g = torch.Generator().manual_seed(11)
    direction = torch.randn(n, 3, generator=g, dtype=torch.float64)
    ids = torch.randperm(n, generator=g) * 3 + 5
    zs = torch.tensor(_ZS[kind])[torch.cat(species)]
    return Batch(
        (positions + shift * direction).to(dtype),
        zs,
        cell=torch.tensor([sys.cell for sys in systems], dtype=dtype),
        pbc=torch.tensor([sys.pbc for sys in systems]),
        system_index=torch.cat(si),
        atom_ids=ids,
    )


def boxes_of(case: str) -> torch.Tensor:
    """Per-system rank boxes ``(n_systems, world, 2, 3)``, rank order x-major."""
    world, systems = CASES[case]
    out = []
    for sys in systems:
        edges = []
        for a in range(3):
            lo, hi = (0.0, 1.0) if sys.pbc[a] else (-INF, INF)
            edges.append([lo, *sys.cuts[a], hi])
        boxes = [
            [
                [edges[0][i], edges[1][j], edges[2][k]],
                [edges[0][i + 1], edges[1][j + 1], edges[2][k + 1]],
            ]
            for i in range(len(edges[0]) - 1)
            for j in range(len(edges[1]) - 1)
            for k in range(len(edges[2]) - 1)
        ]
        if len(boxes) != world:
            raise ValueError(f"case {case}: {len(boxes)} boxes for world {world}")
        out.append(boxes)
    return torch.tensor(out, dtype=torch.float64)


def owned_rows(batch: Batch, boxes: torch.Tensor, rank: int) -> torch.Tensor:
    """Rows of ``batch`` inside ``rank``'s box (fractional, half-open), in a shuffled order."""
    frac = torch.bmm(
        batch.positions.double().unsqueeze(1),
        torch.linalg.inv(batch.cell.double())[batch.system_index],
    ).squeeze(1)
    box = boxes[batch.system_index, rank]
    inside = ((frac >= box[:, 0]) & (frac < box[:, 1])).all(dim=1)
    rows = inside.nonzero().squeeze(1)
    g = torch.Generator().manual_seed(100 + rank)
    return rows[torch.randperm(len(rows), generator=g)]


def padded_batch(batch: Batch, owned: torch.Tensor, plan: HaloPlan) -> Batch:
    """``[owned | ghost]`` rows as the runtime lays them out: open boundaries, real cell."""
    pos = batch.positions[owned]
    z = batch.atomic_numbers[owned]
    return Batch(
        torch.cat([pos, plan.ghost_positions(pos, batch.cell)]),
        torch.cat([z, plan.forward(z)]),
        cell=batch.cell,
        pbc=torch.zeros_like(batch.pbc),
        system_index=torch.cat([batch.system_index[owned], plan.ghost_system_index]),
        atom_ids=torch.cat([batch.atom_ids[owned], plan.ghost_atom_ids]),
        validate=False,
    )


def build_plan(case: str, kind: str, batch: Batch, owned: torch.Tensor) -> HaloPlan:
    """**Collective**: this rank's halo plan for its owned rows."""
    config = ParticleHaloConfig(
        boxes=boxes_of(case),
        pbc=batch.pbc,
        ghost_width=cutoff_of(kind) + HALO_MARGIN,
    )
    return build_halo_plan(
        config,
        batch.positions[owned],
        batch.atom_ids[owned],
        batch.system_index[owned],
        batch.cell,
        backend="torch",
    )


def dd_forward(
    model: Any,
    padded: Batch,
    plan: HaloPlan,
    version: int,
    autograd: bool,
    ghost_forces: bool = True,
) -> dict[str, torch.Tensor]:
    """**Collective**: one model forward inside the DD context, consolidated like the runtime.

    ``ghost_forces=False`` (LJ): the model returns complete owned rows and the
    fold is skipped. Returns the folded forces of the owned rows, the raw per-rank energy
    (``energy_rank``), the energy / virial / stress summed over ranks where the
    spec declares them partial, and the owned rows' atom energies.
    """
    leaf = padded.positions.detach().requires_grad_(autograd)
    ctx = DDContext(
        layout=plan, positions=leaf, n_systems=padded.n_systems, topology_version=version
    )
    kwargs = {} if ghost_forces else {"ghost_forces": False}
    with AdapterRegistry(adapters_of(model)), dd_scope(ctx):
        out = model(padded.replace(positions=leaf), **kwargs)
    n = plan.n_owned
    f = out["forces"].detach()
    assert f.shape == padded.positions.shape
    owned_forces = f[:n] + plan.reverse(f[n:]) if ghost_forces else f[:n]
    spec = model.distribution_spec()
    totals = {}
    for key in ("energy", "virial", "stress"):
        value = out[key].detach().clone()
        if spec.output(key).effective_reduce().value == "all_reduce":
            dist.all_reduce(value)
        totals[key] = value
    return {
        "ids": padded.atom_ids[:n],
        "forces": owned_forces,
        "energy_rank": out["energy"].detach().clone(),
        "atom_energies": out["atom_energies"].detach()[:n],
        **totals,
    }


def run_steps(
    kind: str,
    case: str,
    schedule: tuple[tuple[bool, float], ...] = ((True, 0.0),),
    layers: int = 2,
    skin: float = 0.0,
    mode: str = "direct",
    dtype: torch.dtype = torch.float64,
    lj_backend: str = "auto",
    half_list: bool = True,
    ghost_forces: bool = True,
    neighbors: str = "auto",
) -> list[dict[str, Any]]:
    """Rank function: run the model over ``schedule`` = ``(rebuild_plan, shift)`` steps.

    ``lj_backend`` and ``half_list`` choose the LJ implementation (``make_model``),
    ``neighbors`` the MPNN's edges; ``ghost_forces=False`` skips the fold (see
    :func:`dd_forward`).

    Ownership is fixed at step 0; a step with ``rebuild_plan`` builds a new halo
    plan (and bumps ``topology_version``), the others reuse the last plan with
    ghost positions refreshed from the moved owned atoms, as the runtime does
    between Verlet rebuilds.
    """
    rank = dist.get_rank()
    model = make_model(kind, layers, skin, mode, dtype, lj_backend, half_list, neighbors)
    owned = owned_rows(global_batch(case, kind, dtype=dtype), boxes_of(case), rank)
    plan: HaloPlan | None = None
    version = -1
    results = []
    for rebuild, shift in schedule:
        batch = global_batch(case, kind, shift, dtype)
        if rebuild or plan is None:
            plan = build_plan(case, kind, batch, owned)
            version += 1
        padded = padded_batch(batch, owned, plan)
        res = dd_forward(model, padded, plan, version, is_autograd(model), ghost_forces)
        res["n_builds"] = neighbor_builds(model)
        res["n_ghost"] = plan.n_ghost
        results.append(res)
    return results


def neighbor_builds(model: Any) -> int:
    """Builds of the model's neighbour list (the one its backend uses)."""
    builds = model.neighbors.n_builds
    if isinstance(model, LennardJones):
        builds += model.device_neighbors.n_builds
    return builds


def _model_and_rows(kind: str, case: str) -> tuple[LennardJones | ReferenceMPNN, HaloPlan, Batch]:
    """A fresh model, this rank's halo plan of ``case`` and its padded batch."""
    model = make_model(kind)
    batch = global_batch(case, kind)
    owned = owned_rows(batch, boxes_of(case), dist.get_rank())
    plan = build_plan(case, kind, batch, owned)
    return model, plan, padded_batch(batch, owned, plan)


def run_bad_rank(kind: str, case: str, bad_rank: int, how: str) -> str:
    """Rank function: ``bad_rank`` passes a malformed batch; return the error every rank got."""
    rank = dist.get_rank()
    model, plan, padded = _model_and_rows(kind, case)
    kwargs: dict[str, Any] = {}
    if rank == bad_rank:
        if how == "species":
            z = padded.atomic_numbers.clone()
            z[0] = 99
            padded = padded.replace(atomic_numbers=z)
        elif how == "n_receivers":
            kwargs["n_receivers"] = plan.n_owned - 1
        elif how == "pbc":
            padded = padded.replace(pbc=torch.ones_like(padded.pbc))
    leaf = padded.positions.detach().requires_grad_(kind != "lj")
    try:
        with dd_scope(DDContext(layout=plan, positions=leaf)):
            model(padded.replace(positions=leaf), **kwargs)
    except ValidationError as exc:
        return str(exc)
    return "no error"


def count_all_reduce(kind: str, case: str) -> list[int]:
    """Rank function: ``all_reduce`` calls of three forwards (new plan, same plan, new plan)."""
    model, plan, padded = _model_and_rows(kind, case)
    calls = [0]
    original = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    counts = []
    dist.all_reduce = counting  # type: ignore[assignment]
    try:
        for version in (0, 0, 1):
            calls[0] = 0
            leaf = padded.positions.detach().requires_grad_(kind != "lj")
            ctx = DDContext(layout=plan, positions=leaf, topology_version=version)
            with AdapterRegistry(adapters_of(model)), dd_scope(ctx):
                model(padded.replace(positions=leaf))
            counts.append(calls[0])
    finally:
        dist.all_reduce = original
    return counts


def count_exchanges(kind: str, case: str, layers: int) -> int:
    """Rank function: ``all_to_all_single`` calls of one model forward (forces included)."""
    model = make_model(kind, layers)
    batch = global_batch(case, kind)
    owned = owned_rows(batch, boxes_of(case), dist.get_rank())
    plan = build_plan(case, kind, batch, owned)
    padded = padded_batch(batch, owned, plan)
    calls = [0]
    original = dist.all_to_all_single

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    leaf = padded.positions.detach().requires_grad_(True)
    dist.all_to_all_single = counting  # type: ignore[assignment]
    try:
        with AdapterRegistry(adapters_of(model)), dd_scope(DDContext(layout=plan, positions=leaf)):
            model(padded.replace(positions=leaf))
    finally:
        dist.all_to_all_single = original
    return calls[0]
