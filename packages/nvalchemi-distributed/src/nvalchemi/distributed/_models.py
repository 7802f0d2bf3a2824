"""The models of ``nvdd run``: Lennard-Jones argon, MACE (a saved mace-torch model
or a built-in small random one), SevenNet or UMA (a checkpoint or a built-in small
random one), AIMNet2 (an aimnet v2 file or a built-in small random one), and the
built-in system each runs on."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from nvalchemi.distributed._model_args import uma_checkpointing
from nvdd.core import Batch, OptionalDependencyError, maxwell_boltzmann

__all__ = [
    "AR_EPSILON",
    "AR_LATTICE",
    "AR_SIGMA",
    "SILICA_SPACING",
    "build_model",
    "builtin_system",
]

#: Argon: Lennard-Jones epsilon (eV), sigma (Angstrom), FCC lattice constant (Angstrom).
AR_EPSILON, AR_SIGMA, AR_LATTICE = 0.0104, 3.40, 5.26
#: Simple-cubic spacing of the built-in silica-like O/Si box (0.066 atoms/A^3).
SILICA_SPACING = 2.47


def _mace_modules() -> Any:
    try:
        import nvdd.models as models
    except ImportError as exc:
        raise OptionalDependencyError(
            "nvdd-models", "nvdd run --model mace", extra="nvdd-models[mace]", cause=exc
        ) from exc
    return models


def _demo_mace(dtype: torch.dtype) -> torch.nn.Module:
    """The built-in model: a small random MACE for O and Si (weights from seed 0)."""
    from nvalchemi.distributed._model_args import BUILTIN_MACE_ELEMENTS

    models = _mace_modules()
    config = models.MACEConfig(
        atomic_numbers=BUILTIN_MACE_ELEMENTS,
        r_max=5.0,
        hidden_irreps="16x0e+16x1o",
        max_ell=2,
        correlation=2,
        radial_mlp=(16, 16),
        avg_num_neighbors=35.0,
        atomic_energies=(-4.9, -5.4),
        seed=0,
    )
    module: torch.nn.Module = models.build_mace(config, dtype=dtype)
    return module


def _sevenn(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Any:
    """``--model sevenn``: the checkpoint ``args.model_file`` (sevenn's own loader)
    or a small random SevenNet for O and Si (weights from seed 0)."""
    from nvalchemi.distributed._model_args import BUILTIN_MACE_ELEMENTS

    models = _mace_modules()
    kwargs = {"dtype": dtype, "device": device, "skin": args.skin}
    path = getattr(args, "model_file", None)
    if path:
        return models.SevenNetModel.from_checkpoint(path, **kwargs)
    config = {
        "chemical_species": ["O" if z == 8 else "Si" for z in BUILTIN_MACE_ELEMENTS],
        "cutoff": 4.5,
        "channel": 16,
        "lmax": 1,
        "num_convolution_layer": 2,
    }
    return models.SevenNetModel.from_config(config, seed=0, **kwargs)


def _uma(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Any:
    """``--model uma``: the checkpoint ``args.model_file`` (fairchem's own loader) for
    ``args.task``, or a small random UMA (weights from seed 0); activation
    checkpointing as ``--uma-checkpoint`` says (the model's default when not
    given). A mixture-of-experts backbone is merged for the run's system
    (``--structure`` or the built-in box, read here on every rank: the merge needs
    its composition)."""
    models = _mace_modules()
    whole: Batch | None = builtin_system(args, dtype)
    if args.structure:
        from nvalchemi.distributed._structure import read_structure

        whole = Batch.from_ase(read_structure(args.structure), dtype=dtype)
    kwargs = {"dtype": dtype, "device": device, "skin": args.skin, "merge_for": whole}
    checkpointing = getattr(args, "uma_checkpoint", None)
    if checkpointing is not None:
        kwargs["activation_checkpointing"] = uma_checkpointing(checkpointing)
    path = getattr(args, "model_file", None)
    if path:
        return models.UMAModel.from_checkpoint(path, task=getattr(args, "task", None), **kwargs)
    backbone = {
        "max_num_elements": 20,
        "sphere_channels": 16,
        "lmax": 1,
        "mmax": 1,
        "num_layers": 1,
        "cutoff": 4.5,
        "edge_channels": 16,
        "num_distance_basis": 32,
        "hidden_channels": 16,
        "dataset_mapping": {"omat": "omat"},
    }
    return models.UMAModel.from_config(backbone, seed=0, task="omat", **kwargs)


def _aimnet2(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Any:
    """``--model aimnet2``: the aimnet v2 file ``args.model_file`` (aimnet's own
    loader) or a small random AIMNet2 (3 passes, cutoff 4 A; weights from seed 0)."""
    models = _mace_modules()
    kwargs = {"dtype": dtype, "device": device, "skin": args.skin}
    path = getattr(args, "model_file", None)
    if path:
        return models.AIMNet2Model.from_file(path, **kwargs)
    mlp = {"activation_fn": "torch.nn.GELU", "last_linear": True, "hidden": [32]}
    energy = {"key_in": "energy", "key_out": "energy"}
    config = {
        "class": "aimnet.models.AIMNet2",
        "kwargs": {
            "nfeature": 8,
            "d2features": True,
            "ncomb_v": 8,
            "hidden": [[64], [64], [64]],
            "aim_size": 32,
            "aev": {"rc_s": 4.0, "nshifts_s": 8},
            "outputs": {
                "energy_mlp": {
                    "class": "aimnet.modules.Output",
                    "kwargs": {
                        "n_in": 32,
                        "n_out": 1,
                        "key_in": "aim",
                        "key_out": "energy",
                        "mlp": mlp,
                    },
                },
                "atomic_shift": {"class": "aimnet.modules.AtomicShift", "kwargs": energy},
                "atomic_sum": {"class": "aimnet.modules.AtomicSum", "kwargs": energy},
            },
        },
    }
    return models.AIMNet2Model.from_config(config, seed=0, **kwargs)


def build_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Any:
    """The model of ``args.model`` on ``device`` in ``dtype``.

    ``lj``: Lennard-Jones with ``args.cutoff`` and ``args.skin``, argon built in
    and every ``--lj EL:EPS:SIGMA`` of ``args``. ``mace``:
    ``args.model_file`` loaded as mace-torch does (a trusted file: it is
    unpickled) or, without a file, the built-in random MACE; its cutoff is the
    model's ``r_max``. ``sevenn``: ``args.model_file`` read by sevenn's
    checkpoint loader (a trusted file: it is unpickled) or, without a file, a
    built-in random SevenNet (O, Si; the ``nvdd-models[sevenn]`` extra). ``uma``:
    ``args.model_file`` read by fairchem's loader for ``args.task`` (a trusted
    file: it is unpickled) or a built-in random UMA (the ``nvdd-models[uma]``
    extra). ``aimnet2``: ``args.model_file`` read by aimnet's ``load_model`` (an
    aimnet v2 file) or a built-in random AIMNet2 (the ``nvdd-models[aimnet2]``
    extra).
    """
    if getattr(args, "model", "lj") == "sevenn":
        return _sevenn(args, device, dtype)
    if getattr(args, "model", "lj") == "uma":
        return _uma(args, device, dtype)
    if getattr(args, "model", "lj") == "aimnet2":
        return _aimnet2(args, device, dtype)
    if getattr(args, "model", "lj") == "mace":
        models = _mace_modules()
        path = getattr(args, "model_file", None)
        mace = models.load_mace(path, map_location=str(device)) if path else _demo_mace(dtype)
        return models.MACEModel(mace, dtype=dtype, device=device, skin=args.skin)
    try:
        from nvdd.models import LennardJones, LJConfig
    except ImportError as exc:
        raise OptionalDependencyError(
            "nvdd-models", "nvdd run", extra="nvalchemi-distributed[models]", cause=exc
        ) from exc
    from nvalchemi.distributed._checks import lj_species

    species = {z: (p.epsilon, p.sigma) for z, p in lj_species(args).items()}
    config = LJConfig(cutoff=args.cutoff, species=species, skin=args.skin)
    return LennardJones(config).to(device=device, dtype=dtype)


def builtin_system(args: argparse.Namespace, dtype: torch.dtype) -> Batch | None:
    """The built-in system of a model that does not run on argon, else None.

    ``mace``, ``sevenn``, ``uma`` and ``aimnet2``: a silica-like periodic box, O and Si (2:1, random) on a jittered
    simple-cubic lattice of ``args.cells`` sites per edge (``cells**3`` atoms) at
    the density of amorphous SiO2, with velocities at ``args.temperature``.
    """
    if getattr(args, "model", "lj") not in ("mace", "sevenn", "uma", "aimnet2"):
        return None
    g = torch.Generator().manual_seed(args.seed)
    n = int(args.cells)
    axes = [torch.arange(n, dtype=torch.float64)] * 3
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
    m = grid.shape[0]
    positions = (grid + 0.5) * SILICA_SPACING + 0.05 * torch.randn(
        m, 3, generator=g, dtype=torch.float64
    )
    batch = Batch(
        positions=positions,
        atomic_numbers=torch.where(torch.rand(m, generator=g) < 2 / 3, 8, 14),
        cell=torch.eye(3, dtype=torch.float64) * n * SILICA_SPACING,
        pbc=[True, True, True],
    ).to(dtype=dtype)
    v = maxwell_boltzmann(batch.masses, args.temperature, seed=args.seed)
    return batch.replace(velocities=v)
