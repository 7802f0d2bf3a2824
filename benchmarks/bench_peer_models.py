"""Benchmark: UMA, AIMNet2, SevenNet on one GPU, nvdd against the peer torch-sim (issue 37).

The sibling of ``bench_peer_torchsim.py`` (MACE) for the other foundation models,
with its leg runner, largest-system search, targets and result schema. One model
file with random weights is written first by the model package's own saving code
and the SAME file is loaded by every leg:

- ``--model uma``: fairchem-core's UMA (an eSCN-MD ``HydraModel``, ``--size small``:
  the UMA-S backbone shape, sphere_channels 128, lmax 2, 4 layers, cutoff 6 A, without
  the mixture of linear experts, which costs as one merged backbone) in a fairchem
  inference checkpoint (``MLIPInferenceCheckpoint``: model config, state and EMA
  state, energy/forces tasks), on the silica-like O/Si box of ``bench_mace.py``.
  nvdd: ``UMAModel.from_checkpoint``; peer: ``fairchem.core.calculate.torchsim_interface.
  FairChemModel`` (fairchem's batch predictor, its own radius graph every step).
  ``--uma-checkpoint on|off|EDGES``: nvdd's ``UMAModel(activation_checkpointing=)``
  (default ``on``: fairchem's chunk of 131,072 edges, what the peer runs; fewer
  edges per chunk, less memory, for the largest-system search).
- ``--model aimnet2``: aimnet's AIMNet2 (its shipped ``aimnet2.yaml`` shape without
  its Coulomb output: an embedded short-range one would make aimnet's calculator add
  its own long-range sum, which nvdd's wrapper does not) in an aimnet v2 ``.pt`` file, on a periodic box of water
  molecules at 1 g/cm^3. nvdd: ``AIMNet2Model.from_file``; peer:
  ``aimnet.calculators.aimnet2torchsim.AIMNet2TorchSim`` around an
  ``AIMNet2Calculator`` of the file (aimnet's float32 inference).
- ``--model sevennet``: a SevenNet (``--size small``: SevenNet-0's shape, sevenn's
  ``presets/sevennet-0.yaml``: 5 interaction layers, 128 channels, lmax 2, cutoff
  5 A; O and Si) in a checkpoint written by sevenn's own trainer
  (``Trainer.write_checkpoint``), on the silica-like box. Every leg builds the model
  with ``sevenn.util.load_checkpoint(path).build_model()`` (e3nn tensor products, no
  cuEquivariance/flashTP). nvdd: ``SevenNetModel.from_checkpoint`` (forces by
  autograd of the per-atom energies); peer: ``torch_sim.models.sevennet.SevenNetModel``
  (sevenn's own torch-sim interface, float32 only, torch-sim's neighbour list and
  SevenNet's force-and-stress module).

Legs: ``plain`` (nvdd ``VelocityVerlet``, one process), ``dd1`` (``DomainParallel``
on one GPU), ``peer`` (torch-sim ``nve_init`` + ``nve_step``, 0.5 fs, the same
start). Phase 1 times ``--steps`` after ``--warmup``; phase 2 doubles ``dd1`` and
``peer`` until out of memory, ``--doublings`` or ``--search-budget-s``. Each leg
runs in its own process; any failure (a missing package included) is the row's
``status`` and ``error``, never the end of the run.

Usage::

    python benchmarks/bench_peer_models.py --model uma --device cuda --out-dir $OUT
    python benchmarks/bench_peer_models.py --model aimnet2 --device cuda --out-dir $OUT
    python benchmarks/bench_peer_models.py --model sevennet --device cuda --out-dir $OUT
    # CPU check of the nvdd legs (tiny model and system)
    python benchmarks/bench_peer_models.py --model aimnet2 --device cpu --quick --out-dir /tmp/pm
    python benchmarks/bench_peer_models.py --model sevennet --device cpu --quick --out-dir /tmp/pm
    # AIMNet2's padder headroom of before record 0085, nvdd legs only (compare in one run)
    python benchmarks/bench_peer_models.py --model aimnet2 --device cuda --legs plain dd1 \
        --search-legs --aimnet-pad-growth 1.25 --name aimnet2-pad125 --out-dir $OUT
    # AIMNet2's trainable weights of before record 0088 (its peak memory per atom)
    python benchmarks/bench_peer_models.py --model aimnet2 --device cuda --legs plain dd1 \
        --search-legs --aimnet-freeze off --name aimnet2-trainable --out-dir $OUT

This is not a test; ratios measured within one run are the result.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.bench_mace import dims_of, jittered_grid, periodic_box, prepare, run_md, silica
from benchmarks.bench_peer_torchsim import (
    NVDD_LEGS,
    add_run_options,
    finish,
    parse_run,
    run_leg,
    run_torchsim,
    search,
)

LEGS = (*NVDD_LEGS, "peer")
#: UMA backbones (fairchem's eSCNMDBackbone arguments).
UMA_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"max_num_elements": 20, "lmax": 1, "mmax": 1, "cutoff": 2.6, "num_layers": 1}
    | {"num_distance_basis": 16}
    | dict.fromkeys(("sphere_channels", "edge_channels", "hidden_channels"), 8),
    "small": {  # UMA-S's backbone shape (one expert)
        "max_num_elements": 100,
        "sphere_channels": 128,
        "lmax": 2,
        "mmax": 2,
        "cutoff": 6.0,
        "edge_channels": 128,
        "num_distance_basis": 64,
        "hidden_channels": 128,
        "num_layers": 4,
        "norm_type": "rms_norm_sh",
        "act_type": "gate",
        "ff_type": "spectral",
    },
}
UMA_TASK = "omat"
WATER_SPACING = 3.104  # A: one molecule per 29.9 A^3 (1 g/cm^3)
#: SevenNet model configurations (the ``model`` section of a SevenNet input.yaml;
#: sevenn's defaults for the rest).
SEVENNET_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"cutoff": 2.6, "channel": 4, "lmax": 1, "num_convolution_layer": 2}
    | {"weight_nn_hidden_neurons": [8]},
    "small": {  # SevenNet-0's shape (sevenn's presets/sevennet-0.yaml)
        "cutoff": 5.0,
        "channel": 128,
        "is_parity": False,
        "lmax": 2,
        "num_convolution_layer": 5,
        "irreps_manual": ["128x0e", *["128x0e+64x1e+32x2e"] * 4, "128x0e"],
        "weight_nn_hidden_neurons": [64, 64],
        "radial_basis": {"radial_basis_name": "bessel", "bessel_basis_num": 8},
        "cutoff_function": {"cutoff_function_name": "XPLOR", "cutoff_on": 4.5},
        "act_gate": {"e": "silu", "o": "tanh"},
        "act_scalar": {"e": "silu", "o": "tanh"},
        "self_connection_type": "linear",
    },
}


# ------------------------------------------------------------------ model files
def write_uma(path: Path, size: str, seed: int = 0) -> None:
    """A fairchem inference checkpoint of a random-weight UMA: fairchem's own
    ``MLIPInferenceCheckpoint`` (the model's hydra config, its state and EMA state,
    the energy and forces tasks of ``UMA_TASK``), saved with ``torch.save`` as
    fairchem's trainer does."""
    import hydra
    from fairchem.core.units.mlip_unit.api.inference import MLIPInferenceCheckpoint

    backbone = {
        "model": "fairchem.core.models.uma.escn_md.eSCNMDBackbone",
        "otf_graph": True,
        "regress_forces": True,
        "direct_forces": False,
        "dataset_mapping": {UMA_TASK: UMA_TASK},
        **UMA_SIZES[size],
    }
    config = {
        "_target_": "fairchem.core.models.base.HydraModel",
        "pass_through_head_outputs": True,  # (outputs named by task, as the predictor reads)
        "backbone": backbone,
        "heads": {
            "energyandforcehead": {"module": "fairchem.core.models.uma.escn_md.MLP_EFS_Head"}
        },
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = hydra.utils.instantiate(config)
    ema = torch.optim.swa_utils.AveragedModel(model).state_dict()
    unit = "fairchem.core.units.mlip_unit.mlip_unit"

    def task(prop: str, level: str, dim: list[int]) -> dict[str, Any]:
        return {
            "_target_": f"{unit}.Task",
            "name": prop,
            "level": level,
            "property": prop,
            "out_spec": {"_target_": f"{unit}.OutputSpec", "dim": dim, "dtype": "float32"},
            "normalizer": {
                "_target_": "fairchem.core.modules.normalization.normalizer.Normalizer",
                "mean": 0.0,
                "rmsd": 1.0,
            },
            "datasets": [UMA_TASK],
        }

    ckpt = MLIPInferenceCheckpoint(
        model_config=config,
        model_state_dict=model.state_dict(),
        ema_state_dict=ema,
        tasks_config=[task("energy", "system", [1]), task("forces", "atom", [3])],
    )
    torch.save(ckpt, path)


def aimnet_config(size: str) -> dict[str, Any]:
    """aimnet's shipped ``aimnet2.yaml`` (``tiny``: its widths cut to a few channels and
    a 2.5 A cutoff) without its Coulomb output: aimnet's calculator would add its own
    long-range Coulomb to an embedded one, which nvdd's wrapper does not; charges are
    still equilibrated in every pass."""
    import importlib.resources

    import yaml

    text = (importlib.resources.files("aimnet.models") / "aimnet2.yaml").read_text()
    config = yaml.safe_load(text)
    kwargs = config["kwargs"]
    kwargs["outputs"].pop("lrcoulomb", None)
    if size == "tiny":
        kwargs.update(nfeature=4, ncomb_v=4, hidden=[[16], [16], [16]], aim_size=8)
        kwargs["aev"] = {"rc_s": 2.5, "nshifts_s": 4}
        head = kwargs["outputs"]["energy_mlp"]["kwargs"]
        head["n_in"], head["mlp"]["hidden"] = 8, [8]
    return dict(config)


def write_aimnet2(path: Path, size: str, seed: int = 0) -> None:
    """An aimnet v2 model file (``format_version`` 2: the model's YAML and state dict,
    the metadata aimnet's ``load_model`` and ``AIMNet2Calculator`` read), random
    weights from aimnet's own ``build_module``, per-element shifts drawn."""
    import yaml
    from aimnet.config import build_module

    config = aimnet_config(size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = build_module(config)
        with torch.no_grad():  # (untrained: zero shifts)
            module.outputs.atomic_shift.shifts.weight[1:].normal_()
    artifact = {
        "format_version": 2,
        "model_yaml": yaml.safe_dump(config, sort_keys=False),
        "cutoff": float(config["kwargs"]["aev"]["rc_s"]),
        "needs_coulomb": False,
        "needs_dispersion": False,
        "coulomb_mode": "none",
        "implemented_species": [1, 8],
        "state_dict": module.state_dict(),
    }
    torch.save(artifact, path)


def write_sevennet(path: Path, size: str, seed: int = 0) -> None:
    """A SevenNet checkpoint of a random-weight model for O and Si, written by
    sevenn's own trainer (``Trainer.write_checkpoint``: the model's full
    configuration, its state, the optimizer's), which sevenn's ``load_checkpoint``
    reads back. The configuration is ``SEVENNET_SIZES[size]`` with sevenn's defaults
    filled in as ``SevenNetModel.from_config`` does it (shift 0, scale 1,
    ``conv_denominator`` 10: what training would compute from data)."""
    from sevenn.model_build import build_E3_equivariant_model
    from sevenn.train.trainer import Trainer

    from nvdd.models import SevenNetModel

    config = {"chemical_species": ["O", "Si"], **SEVENNET_SIZES[size]}
    full = SevenNetModel.from_config(config, seed=seed).sevennet.sevenn_config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = build_E3_equivariant_model(full)  # (with its force module, as trained)
    trainer = Trainer(module, [], torch.optim.Adam, device="cpu")
    trainer.write_checkpoint(str(path), config=full, epoch=1)


# --------------------------------------------------------------------- systems
def water(dims: tuple[int, int, int], dtype: torch.dtype, device: str, seed: int = 0) -> Any:
    """Water molecules (rigid geometry, random orientations) on a jittered cubic
    lattice at 1 g/cm^3, periodic, 300 K velocities."""
    g = torch.Generator().manual_seed(seed)
    centre = jittered_grid(dims, WATER_SPACING, g)
    n = centre.shape[0]
    half = math.radians(104.52) / 2
    arm = [math.sin(half), math.cos(half), 0.0]
    local = 0.9572 * torch.tensor([[0.0, 0.0, 0.0], arm, [-arm[0], arm[1], 0.0]])
    rot, _ = torch.linalg.qr(torch.randn(n, 3, 3, generator=g, dtype=torch.float64))
    positions = (centre[:, None, :] + local.double()[None] @ rot.mT).reshape(-1, 3)
    z = torch.tensor([8, 1, 1]).repeat(n)
    return periodic_box(
        positions, z, torch.tensor(dims, dtype=torch.float64) * WATER_SPACING, g, dtype, device
    )


def system(model: str, dims: tuple[int, int, int], dtype: torch.dtype, device: str) -> Any:
    return water(dims, dtype, device) if model == "aimnet2" else silica(dims, dtype, device)


def atoms_of(model: str, dims: tuple[int, int, int]) -> int:
    return dims[0] * dims[1] * dims[2] * (3 if model == "aimnet2" else 1)


# ------------------------------------------------------------------ measurements
def measure(
    leg: str,
    model_name: str,
    path: str,
    dims: tuple[int, int, int],
    dtype_name: str,
    steps: int,
    warmup: int,
    device: str,
    skin: float,
    uma_checkpoint: bool | int = True,
    pad_growth: float = 1.0,
    freeze: bool = True,
) -> dict[str, Any]:
    """One leg with the model of the file ``path``: nvdd's ``plain`` or ``dd1``
    (``UMAModel.from_checkpoint`` / ``AIMNet2Model.from_file``, its padder's growth
    ``pad_growth``, its weights frozen unless ``freeze`` is false;
    ``SevenNetModel.from_checkpoint``), or the ``peer``: torch-sim's
    NVE loop with the model package's own torch-sim interface."""
    device = prepare(device)
    dtype = getattr(torch, dtype_name)
    batch = system(model_name, dims, dtype, device)
    model: Any
    if leg == "peer" and model_name == "uma":
        from fairchem.core.calculate.torchsim_interface import FairChemModel

        model = FairChemModel(path, device=torch.device(device), dtype=dtype, task_name=UMA_TASK)
    elif leg == "peer" and model_name == "sevennet":
        from torch_sim.models.sevennet import SevenNetModel as TorchSimSevenNet

        model = TorchSimSevenNet(model=path, device=torch.device(device), dtype=dtype)
    elif leg == "peer":
        from aimnet.calculators import AIMNet2Calculator
        from aimnet.calculators.aimnet2torchsim import AIMNet2TorchSim

        calc = AIMNet2Calculator(path, device=device)
        model = AIMNet2TorchSim(calc, compute_forces=True, compute_stress=False)
    elif model_name == "uma":
        from nvdd.models import UMAModel

        model = UMAModel.from_checkpoint(
            path,
            task=UMA_TASK,
            dtype=dtype,
            device=device,
            skin=skin,
            activation_checkpointing=uma_checkpoint,
        )
    elif model_name == "sevennet":
        from nvdd.models import SevenNetModel

        model = SevenNetModel.from_checkpoint(path, dtype=dtype, device=device, skin=skin)
    else:
        from nvdd.models import AIMNet2Model

        model = AIMNet2Model.from_file(
            path, dtype=dtype, device=device, skin=skin, pad_growth=pad_growth, freeze=freeze
        )
        row = run_md(leg, model, batch, steps, warmup, device, skin)
        return {**row, "pad_growth": pad_growth, "freeze": freeze}
    if leg == "peer":
        return run_torchsim(model, batch, steps, warmup)
    return run_md(leg, model, batch, steps, warmup, device, skin)


def one(args: argparse.Namespace, path: str, leg: str, k: int, phase: str) -> dict[str, Any]:
    dims = dims_of(args.cells, k)
    timed = phase == "timed"
    steps, warmup = (args.steps, args.warmup) if timed else (args.search_steps, args.search_warmup)
    fargs = (leg, args.model, path, dims, args.dtype, steps, warmup, args.device, args.skin)
    fargs += (args.uma_checkpoint, args.aimnet_pad_growth, args.aimnet_freeze == "on")
    return run_leg(args, leg, phase, atoms_of(args.model, dims), steps, warmup, measure, fargs)


def uma_checkpoint(value: str) -> bool | int:
    """``--uma-checkpoint``: ``on`` (fairchem's chunk), ``off``, or edges per chunk,
    as ``UMAModel(activation_checkpointing=)`` takes it."""
    if value in ("on", "off"):
        return value == "on"
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"on, off or a positive number of edges, not {value!r}")
    return int(value)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, choices=["uma", "aimnet2", "sevennet"])
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument(
        "--uma-checkpoint",
        default="on",
        type=uma_checkpoint,
        help="nvdd's UMA activation checkpointing: on (fairchem's 131,072-edge chunks, "
        "as torch-sim runs it), off, or edges per chunk (fewer: less memory)",
    )
    add_run_options(p, list(LEGS), ["dd1", "peer"], 0, "")
    p.add_argument(
        "--aimnet-pad-growth",
        type=float,
        default=1.0,
        help="AIMNet2Model(pad_growth=): 1.0 pads the neighbour matrix to what the batch "
        "needs; 1.25 is the padder's default headroom (a quarter more rows and slots), "
        "the wrapper's setting before record 0085",
    )
    p.add_argument(
        "--aimnet-freeze",
        default="on",
        choices=["on", "off"],
        help="AIMNet2Model(freeze=): on freezes the weights as aimnet's calculator does; "
        "off keeps them trainable, the wrapper's setting before record 0088",
    )
    args = parse_run(p, argv, LEGS, 3)
    if not args.cells:  # 8,000 atoms / 12,288 atoms / 4,096 atoms (~4 GB per 1,000 on CPU)
        args.cells = {"uma": 20, "aimnet2": 16, "sevennet": 16}[args.model]
    print(
        f"{args.model} {args.size}, {args.dtype}, {args.device}, NVE 0.5 fs; "
        f"timed: {args.steps} steps after {args.warmup}"
    )
    print(f"{'phase':<7}{'leg':<10}{'atoms':>10}{'steps':>6}{'ms/step':>10}{'peak MB':>12}  status")
    with tempfile.TemporaryDirectory(prefix="nvdd-peer-") as tmp:
        path = os.path.join(tmp, f"{args.model}-{args.size}.pt")
        writers = {"uma": write_uma, "aimnet2": write_aimnet2, "sevennet": write_sevennet}
        writers[args.model](Path(path), args.size)
        label = {"uma": "UMA", "aimnet2": "AIMNet2", "sevennet": "SevenNet"}[args.model]
        args.name = args.name or f"{args.model}-1gpu-torchsim"
        dists = ["torch-sim-atomistic", "fairchem-core", "aimnet", "e3nn"]
        if args.model == "sevennet":
            dists = ["torch-sim-atomistic", "sevenn", "e3nn"]
        what = f"{label} {args.size} {args.dtype}"
        rows = [one(args, path, leg, 0, "timed") for leg in args.legs]
        if args.search_legs:  # (the timed rows written first: a run cut short keeps them)
            print(f"wrote {finish(args, argv, rows, what, dists)} (timed rows)")
        search(args, rows, lambda leg, k: one(args, path, leg, k, "search"))
    print(f"wrote {finish(args, argv, rows, what, dists)}")
    return 1 if args.peer_missing and "peer" in args.legs else 0


if __name__ == "__main__":
    sys.exit(main())
