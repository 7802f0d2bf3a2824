"""Building a random MACE (tests, the demo, benchmarks) and loading a saved one."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from nvdd.models._checks import check_positive, config_error
from nvdd.models._mace_deps import mace_module
from nvdd.models._species import MAX_Z

__all__ = ["MACEConfig", "build_mace", "load_mace"]


@dataclass(frozen=True)
class MACEConfig:
    """Hyper-parameters of a randomly initialised mace-torch ``ScaleShiftMACE``.

    The defaults are a small model for tests and the CPU demo; the public
    "medium" foundation models correspond to ``hidden_irreps="128x0e+128x1o"``,
    ``num_interactions=2``, ``max_ell=3``, ``correlation=3``, ``r_max=6.0``,
    ``radial_mlp=(64, 64, 64)``.

    Parameters
    ----------
    atomic_numbers:
        Elements the model knows (its one-hot order).
    r_max:
        Cutoff (Angstrom).
    hidden_irreps:
        e3nn irreps of the node features, e.g. ``"16x0e+16x1o"``.
    num_interactions, max_ell, correlation:
        Interaction blocks, spherical-harmonics degree, body order of the product.
    num_bessel, num_polynomial_cutoff:
        Radial basis size and the envelope's order.
    radial_mlp:
        Hidden widths of the radial network.
    mlp_irreps:
        Irreps of the last readout's hidden layer.
    avg_num_neighbors:
        MACE's normalisation of the aggregated messages.
    atomic_energies:
        Isolated-atom energies per element (default: ``-1.0`` each).
    interaction:
        The mace-torch interaction class name (first and later blocks).
    scale, shift:
        ``ScaleShiftMACE``'s per-atom interaction-energy scale and shift.
    seed:
        Seed of the initialisation (the global RNG state is left untouched).
    """

    atomic_numbers: tuple[int, ...] = (1, 8)
    r_max: float = 4.0
    hidden_irreps: str = "8x0e+8x1o"
    num_interactions: int = 2
    max_ell: int = 2
    correlation: int = 2
    num_bessel: int = 6
    num_polynomial_cutoff: int = 5
    radial_mlp: tuple[int, ...] = (16, 16)
    mlp_irreps: str = "8x0e"
    avg_num_neighbors: float = 10.0
    atomic_energies: tuple[float, ...] | None = None
    interaction: str = "RealAgnosticResidualInteractionBlock"
    scale: float = 1.0
    shift: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "atomic_numbers", tuple(self.atomic_numbers))
        object.__setattr__(self, "radial_mlp", tuple(self.radial_mlp))
        zs = self.atomic_numbers
        if not zs or len(set(zs)) != len(zs) or not all(isinstance(z, int) for z in zs):
            raise config_error(f"MACEConfig.atomic_numbers must be distinct ints, got {zs}")
        if not all(1 <= z <= MAX_Z for z in zs):
            raise config_error(f"MACEConfig.atomic_numbers must be in 1..{MAX_Z}, got {zs}")
        check_positive("MACEConfig.r_max", self.r_max)
        check_positive("MACEConfig.avg_num_neighbors", self.avg_num_neighbors)
        for name in ("num_interactions", "max_ell", "correlation", "num_bessel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise config_error(f"MACEConfig.{name} must be an int >= 1, got {value!r}")
        if self.atomic_energies is not None:
            object.__setattr__(self, "atomic_energies", tuple(self.atomic_energies))
            if len(self.atomic_energies) != len(zs):
                raise config_error(
                    f"MACEConfig.atomic_energies has {len(self.atomic_energies)} values for "
                    f"{len(zs)} elements {zs}"
                )


def build_mace(
    config: MACEConfig | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> torch.nn.Module:
    """A ``ScaleShiftMACE`` with random weights drawn from ``config.seed``.

    Weights are drawn in float64 and cast to ``dtype``, so a float32 and a
    float64 model of one config agree to float32 rounding. The global RNG and
    the default dtype are restored afterwards.

    Raises
    ------
    OptionalDependencyError
        Without mace-torch (``pip install 'nvdd-models[mace]'``).
    ConfigurationError
        For an unknown interaction class or a dtype other than float32 / float64.
    """
    c = config if config is not None else MACEConfig()
    if dtype not in (torch.float32, torch.float64):
        raise config_error(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    modules = mace_module("mace.modules")
    o3 = mace_module("e3nn.o3")
    interaction = modules.interaction_classes.get(c.interaction)
    if interaction is None:
        raise config_error(
            f"unknown MACE interaction {c.interaction!r}; known: {sorted(modules.interaction_classes)}"
        )
    energies = c.atomic_energies or tuple(-1.0 for _ in c.atomic_numbers)
    kwargs = {
        "r_max": float(c.r_max),
        "num_bessel": c.num_bessel,
        "num_polynomial_cutoff": c.num_polynomial_cutoff,
        "max_ell": c.max_ell,
        "interaction_cls": interaction,
        "interaction_cls_first": interaction,
        "num_interactions": c.num_interactions,
        "num_elements": len(c.atomic_numbers),
        "hidden_irreps": o3.Irreps(c.hidden_irreps),
        "MLP_irreps": o3.Irreps(c.mlp_irreps),
        "gate": torch.nn.functional.silu,
        "atomic_energies": torch.tensor(energies, dtype=torch.float64).numpy(),
        "avg_num_neighbors": float(c.avg_num_neighbors),
        "atomic_numbers": list(c.atomic_numbers),
        "correlation": c.correlation,
        "radial_MLP": list(c.radial_mlp),
        "radial_type": "bessel",
        "atomic_inter_scale": float(c.scale),
        "atomic_inter_shift": float(c.shift),
    }
    default = torch.get_default_dtype()
    try:  # drawn in float64 then cast: float32 and float64 models agree to rounding
        torch.set_default_dtype(torch.float64)
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            # e3nn's code generation warns about TorchScript annotations.
            warnings.simplefilter("ignore")
            torch.manual_seed(c.seed)
            model: torch.nn.Module = modules.ScaleShiftMACE(**kwargs)
    finally:
        torch.set_default_dtype(default)
    return model.to(dtype=dtype, device=device)


def load_mace(path: str | os.PathLike[str], *, map_location: str = "cpu") -> torch.nn.Module:
    """Load a saved mace-torch model as mace-torch does: ``torch.load`` of the whole
    pickled module (TorchScript archives are dispatched to ``torch.jit.load``).

    The file is unpickled with ``weights_only=False`` (a ``.model`` file is a
    pickled ``torch.nn.Module``, which the safe loader cannot read): unpickling
    runs code named in the file, so load only files you trust. See
    :mod:`nvdd.models._mace_deps` for how the import of mace-torch, which sets
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``, is kept from changing the process-wide
    default.

    Raises
    ------
    ConfigurationError
        If ``path`` is not a file.
    OptionalDependencyError
        Without mace-torch.
    """
    file = Path(path)
    if not file.is_file():
        raise config_error(f"MACE model file {str(file)!r} does not exist or is not a file")
    mace_module("mace.modules")  # the classes the pickle names, imported safely first
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model: torch.nn.Module = torch.load(file, map_location=map_location, weights_only=False)
    return model
