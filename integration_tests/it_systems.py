"""Systems and models of the integration suite (small: CI runs on 2 CPU cores)."""

from __future__ import annotations

from typing import Any

import torch

from nvdd.core import Batch, maxwell_boltzmann
from nvdd.models import LennardJones, LJBackend, LJConfig, MPNNConfig, ReferenceMPNN
from nvdd.testing import binary_lattice

AR_A = 5.26  # FCC lattice constant of argon, Angstrom
LJ_CUTOFF = 6.0
MPNN_CUTOFF = 4.0

FCC = torch.tensor([[0, 0, 0], [0.5, 0.5, 0], [0.5, 0, 0.5], [0, 0.5, 0.5]], dtype=torch.float64)
PRIMITIVE = 0.5 * AR_A * torch.tensor([[0, 1, 1], [1, 0, 1], [1, 1, 0]], dtype=torch.float64)


def crystal(
    kind: str,
    *,
    seed: int = 0,
    temperature_k: float = 60.0,
    jitter: float = 0.05,
    species: tuple[int, ...] = (18,),
) -> Batch:
    """A small argon-like crystal.

    kind: ``periodic`` (cubic FCC 3x3x3, 108 atoms), ``triclinic`` (FCC primitive
    cell 5x5x5, 125 atoms, skewed), ``slab`` (periodic x, y; open z), ``cluster``
    (open on all axes), ``long`` (4x2x2 cubic cells: thin boxes on 4+ ranks).
    """
    g = torch.Generator().manual_seed(seed)
    if kind == "triclinic":
        n = 5
        grid = torch.stack(
            torch.meshgrid(*[torch.arange(n, dtype=torch.float64)] * 3, indexing="ij"), -1
        )
        frac = grid.reshape(-1, 3)
        cell = PRIMITIVE * n
        positions = frac @ PRIMITIVE
        pbc = [True, True, True]
    else:
        reps = {"periodic": (3, 3, 3), "slab": (3, 3, 2), "cluster": (3, 3, 3), "long": (4, 2, 2)}[
            kind
        ]
        grid = torch.stack(
            torch.meshgrid(*[torch.arange(r, dtype=torch.float64) for r in reps], indexing="ij"), -1
        )
        frac = (grid.reshape(-1, 1, 3) + FCC).reshape(-1, 3)
        positions = frac * AR_A
        cell = torch.diag(torch.tensor(reps, dtype=torch.float64) * AR_A)
        pbc = {
            "periodic": [True] * 3,
            "long": [True] * 3,
            "slab": [True, True, False],
            "cluster": [False] * 3,
        }[kind]
        if kind in ("slab", "cluster"):
            positions = positions + 0.25 * AR_A  # off the cell faces, inside a bigger box
    n_atoms = positions.shape[0]
    positions = positions + jitter * torch.randn(n_atoms, 3, generator=g, dtype=torch.float64)
    z = torch.tensor(species)[torch.arange(n_atoms) % len(species)]
    b = Batch(
        positions=positions,
        atomic_numbers=z,
        cell=cell,
        pbc=pbc,
        atom_ids=torch.randperm(n_atoms, generator=g) * 3 + 1,
    )
    return b.replace(velocities=maxwell_boltzmann(b.masses, temperature_k, generator=g))


def lj_model(
    dtype: torch.dtype = torch.float64, backend: str = "auto", atom_virials: bool = False
) -> LennardJones:
    """Argon LJ; ``backend="torch"`` for the torch path (what ``compile=True`` compiles);
    ``atom_virials``: per-atom virials too."""
    config = LJConfig(
        cutoff=LJ_CUTOFF,
        epsilon=0.0104,
        sigma=3.40,
        skin=0.5,
        backend=LJBackend(backend),
        atom_virials=atom_virials,
    )
    return LennardJones(config).to(dtype)


def mpnn_model(
    n_layers: int = 2, dtype: torch.dtype = torch.float64, neighbors: str = "auto"
) -> ReferenceMPNN:
    cfg = MPNNConfig(
        cutoff=MPNN_CUTOFF,
        species=(18, 36),
        hidden=16,
        n_basis=6,
        n_layers=n_layers,
        seed=3,
        skin=0.5,
        neighbors=neighbors,
    )
    return ReferenceMPNN(cfg, dtype=dtype)


def model_for(
    name: str, dtype: torch.dtype = torch.float64, device: Any = "cpu"
) -> tuple[torch.nn.Module, float]:
    """(model, cutoff) by name: ``lj``, ``lj-virials`` (per-atom virials too),
    ``mpnn2``, ``mpnn3``, ``mace``,
    ``mace-cueq`` (cuEquivariance kernels, built on ``device``: CUDA); a
    ``-device`` suffix gives the MPNN its device edges (``neighbors="device"``)."""
    if name == "mace":
        return mace_model(), MACE_R_MAX
    if name == "mace-cueq":
        return mace_model(dtype=dtype, device=device, cueq=True), MACE_R_MAX
    if name in ("lj", "lj-virials"):
        return lj_model(atom_virials=name == "lj-virials"), LJ_CUTOFF
    base, _, edges = name.partition("-")
    return mpnn_model(int(base[-1]), neighbors=edges or "auto"), MPNN_CUTOFF


def wrapped_max_diff(
    a: torch.Tensor, b: torch.Tensor, cell: torch.Tensor, pbc: torch.Tensor
) -> float:
    """Largest |a - b| component after removing lattice vectors on periodic axes."""
    frac = torch.linalg.solve(cell.T, (a - b).T).T
    frac = torch.where(pbc, frac - torch.round(frac), frac)
    return float((frac @ cell).abs().max()) if a.numel() else 0.0


MACE_R_MAX = 3.5


def oxide(n: tuple[int, int, int] = (6, 5, 5), spacing: float = 2.0, seed: int = 0) -> Batch:
    """A silica-like test system: O and Si (2:1) on a jittered simple-cubic lattice."""
    return binary_lattice(n, spacing, seed=seed, jitter=0.05, id_step=2)


def mace_model(
    num_interactions: int = 2,
    dtype: torch.dtype = torch.float64,
    device: Any = "cpu",
    cueq: bool = False,
) -> torch.nn.Module:
    """A small random MACE (8x0e+8x1o, max_ell 2, correlation 2) for O and Si
    (``cueq``: with cuEquivariance's kernels, on a CUDA ``device``)."""
    from nvdd.models import MACEConfig, MACEModel, build_mace

    config = MACEConfig(
        atomic_numbers=(8, 14), r_max=MACE_R_MAX, num_interactions=num_interactions, seed=1
    )
    return MACEModel(build_mace(config, dtype=dtype), skin=0.3, device=device, cueq=cueq)


NACL_A = 5.64  # rock-salt lattice constant of NaCl, Angstrom
LR_CUTOFF = 5.0


def rock_salt(
    cells: int = 2, *, jitter: float = 0.1, seed: int = 0, temperature_k: float = 0.0
) -> Batch:
    """Charge-neutral rock salt (Na +1, Cl -1), ``cells**3`` cubic cells (8 ions each),
    jittered, shuffled atom ids; thermal velocities at ``temperature_k`` (none at 0:
    the kit draws its own)."""
    from nvdd.models import assign_charges

    g = torch.Generator().manual_seed(seed)
    grid = torch.stack(
        torch.meshgrid(*[torch.arange(cells, dtype=torch.float64)] * 3, indexing="ij"), -1
    ).reshape(-1, 1, 3)
    na = (grid + FCC).reshape(-1, 3)
    frac = torch.stack([na, na + torch.tensor([0.5, 0.0, 0.0], dtype=torch.float64)], 1)
    positions = frac.reshape(-1, 3) * NACL_A
    n = positions.shape[0]
    positions = positions + jitter * torch.randn(n, 3, generator=g, dtype=torch.float64)
    batch = Batch(
        positions=positions,
        atomic_numbers=torch.tensor([11, 17]).repeat(n // 2),
        cell=torch.eye(3, dtype=torch.float64) * cells * NACL_A,
        pbc=[True, True, True],
        atom_ids=torch.randperm(n, generator=g) * 2 + 5,
    )
    if temperature_k > 0:
        batch = batch.replace(
            velocities=maxwell_boltzmann(batch.masses, temperature_k, generator=g)
        )
    return assign_charges(batch, {11: 1.0, 17: -1.0})


def lr_model(name: str, spec: Any = None) -> torch.nn.Module:
    """The shipped long-range models with the accuracy parameters of the suite:
    ``ewald``, ``pme`` (a fixed 20^3 mesh) or ``d3`` (PBE, cutoff 5 A, CN cutoff
    5.5 A); ``spec`` replaces the model's preset."""
    from nvdd.models import DFTD3, D3Config, Ewald, EwaldConfig, ParticleMeshEwald, PMEConfig

    if name == "ewald":
        return Ewald(EwaldConfig(cutoff=LR_CUTOFF, accuracy=1e-8), spec=spec)
    if name == "pme":
        config = PMEConfig(cutoff=LR_CUTOFF, accuracy=1e-6, mesh=(20, 20, 20))
        return ParticleMeshEwald(config, spec=spec)
    if name == "d3":
        return DFTD3(D3Config.from_functional("pbe", cutoff=5.0, cn_cutoff=5.5), spec=spec)
    raise ValueError(f"unknown long-range model {name!r}")


#: The fairchem function SPEC_UMA_HALO's (optional) adapter replaces under DD.
GP_UTILS = "fairchem.core.common.gp_utils"


def gp_utils_stub() -> Any:
    """A stand-in for fairchem's ``gp_utils`` (not installed here), in ``sys.modules``.

    Its ``initialized()`` is true whenever a torch process group exists: what a
    fairchem model would see under nvdd's decomposition were its own graph-parallel
    mode not switched off. Idempotent; returns the module.
    """
    import sys
    import types

    import torch.distributed as dist

    if GP_UTILS in sys.modules:
        return sys.modules[GP_UTILS]
    parts = GP_UTILS.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            sys.modules[name] = types.ModuleType(name)
    module = sys.modules[GP_UTILS]

    def initialized() -> bool:
        return bool(dist.is_available() and dist.is_initialized())

    module.initialized = initialized  # type: ignore[attr-defined]
    return module


class GraphParallelAwareMPNN(ReferenceMPNN):
    """The reference MPNN behind a fairchem-style switch: it refuses to run while
    fairchem's ``gp_utils.initialized()`` says its own graph parallel is on (it
    would split the graph a second time). Under nvdd the switch must read false:
    ``SPEC_UMA_HALO`` makes it so; ``SPEC_MPNN_HALO`` does not."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        gp_utils_stub()
        super().__init__(*args, **kwargs)

    def __setstate__(self, state: dict[str, Any]) -> None:
        gp_utils_stub()  # on every rank the model is unpickled on, before the runtime starts
        super().__setstate__(state)

    def forward(self, batch: Batch, **kwargs: Any) -> Any:
        if gp_utils_stub().initialized():
            raise RuntimeError(
                "fairchem graph parallel is initialized: the graph would be split again"
            )
        return super().forward(batch, **kwargs)


def hydrocarbon(n: tuple[int, int, int] = (6, 5, 5), spacing: float = 2.0, seed: int = 0) -> Batch:
    """C and H (3:1) on a jittered simple-cubic lattice: carbon's D3 coordination
    numbers (about 2) fall between its reference values, so its C6 coefficients
    depend on them (in rock salt every Na and Cl weight sits on one reference to
    1e-17, and a stale ghost CN changes nothing)."""
    return binary_lattice(n, spacing, seed=seed, species=(6, 1), fraction=0.75)
