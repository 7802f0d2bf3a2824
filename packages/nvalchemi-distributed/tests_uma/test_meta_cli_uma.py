"""``nvdd run --model uma [--model-file CHECKPOINT] [--task T]`` (issue 37 item 2).

Needs the ``nvdd-models[uma]`` extra (the ``e3nn06`` nox session); without it
these tests skip, or fail where ``NVDD_REQUIRE_EXTRAS=1``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from nvalchemi.distributed.cli import build_parser
from nvdd.testing import importorskip_extra

#: Element references of the checkpoint's energy task (eV per atom, by Z).
REFS = -0.5 - 0.1 * torch.arange(20, dtype=torch.float64)


def _checkpoint(path: Path) -> None:
    """A tiny random UMA with a mixture-of-experts backbone (UMA's own class, 3
    experts, one expert head per task) saved as a fairchem inference checkpoint:
    model config, weights, averaged (EMA) weights, and two energy tasks with a
    normaliser (rmsd 1.5) and element references."""
    importorskip_extra("fairchem.core", reason="needs the nvdd-models[uma] extra")
    import hydra
    from fairchem.core.units.mlip_unit.api.inference import MLIPInferenceCheckpoint

    moe = "fairchem.core.models.uma.escn_moe."
    tasks = {"omat": "omat", "omol": "omol"}
    config = {
        "_target_": "fairchem.core.models.base.HydraModel",
        "model_id": "UMA-test",
        "backbone": {
            "model": moe + "eSCNMDMoeBackbone",
            "num_experts": 3,
            "use_composition_embedding": True,
            "max_num_elements": 20,
            "sphere_channels": 8,
            "lmax": 1,
            "mmax": 1,
            "cutoff": 2.6,
            "edge_channels": 8,
            "num_distance_basis": 16,
            "hidden_channels": 8,
            "num_layers": 1,
            "otf_graph": True,
            "regress_forces": True,
            "direct_forces": False,
            "dataset_mapping": tasks,
        },
        "heads": {
            "energyandforcehead": {
                "module": moe + "DatasetSpecificMoEWrapper",
                "head_cls": "fairchem.core.models.uma.escn_md.MLP_EFS_Head",
                "dataset_mapping": tasks,
            }
        },
    }
    torch.manual_seed(4)
    model = hydra.utils.instantiate(config)
    ema = torch.optim.swa_utils.AveragedModel(model).state_dict()
    unit = "fairchem.core.units.mlip_unit.mlip_unit."
    task_configs = [
        {
            "_target_": unit + "Task",
            "name": f"{name}_energy",
            "level": "system",
            "property": "energy",
            "out_spec": {"_target_": unit + "OutputSpec", "dim": [1], "dtype": "float32"},
            "normalizer": {
                "_target_": "fairchem.core.modules.normalization.normalizer.Normalizer",
                "mean": 0.0,
                "rmsd": 1.5,
            },
            "element_references": {
                "_target_": "fairchem.core.modules.normalization.element_references."
                "create_element_references",
                "state_dict": {"element_references": REFS},
            },
            "datasets": [name],
        }
        for name in tasks
    ]
    checkpoint = MLIPInferenceCheckpoint(config, model.state_dict(), ema, task_configs)
    torch.save(checkpoint, path)


def test_nvdd_run_builds_uma_from_a_checkpoint_or_its_own() -> None:
    """The model table: ``--model uma --model-file F --task omol`` builds the
    checkpoint's model through fairchem's loader (its normaliser and element
    references read, its mixture of experts merged for the built-in box); without
    a file a built-in random UMA on the O/Si box; both pass the pre-launch checks.
    ``--task`` with another model, or a task the checkpoint lacks, is refused."""
    from nvalchemi.distributed._checks import validate
    from nvalchemi.distributed._models import build_model, builtin_system
    from nvdd.core import ConfigurationError
    from nvdd.models import UMAModel

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "uma_tiny.pt"
        _checkpoint(path)
        built = []
        for argv, cutoff in (
            (["--model-file", str(path), "--task", "omol"], 2.6),
            ([], 4.5),  # the built-in one
        ):
            args = build_parser().parse_args(
                ["run", "--model", "uma", "--cells", "4", "--skin", "0.3", *argv]
            )
            assert validate(args) == [], argv
            model = build_model(args, torch.device("cpu"), torch.float64)
            assert isinstance(model, UMAModel) and model.layers == 2, argv
            assert model.cutoff == cutoff and model.dtype == torch.float64, argv
            assert model.distribution_spec().name == "receptive_field(L=2, fold)"  # merged
            batch = builtin_system(args, torch.float64)
            assert batch is not None and batch.n_atoms == 64
            out = model(batch)
            assert out["forces"].shape == (64, 3) and bool(torch.isfinite(out["forces"]).all())
            built.append(model)
        assert built[0].energy_scale == 1.5 and built[0].task == "omol"
        assert torch.equal(built[0].element_references, REFS)
        bad = build_parser().parse_args(["run", "--model", "uma", "--model-file", str(path)])
        with pytest.raises(ConfigurationError, match=r"energy tasks \['omat', 'omol'\]"):
            build_model(bad, torch.device("cpu"), torch.float64)
    args = build_parser().parse_args(["run", "--model", "lj", "--task", "omat"])
    assert "--task is the fairchem task of --model uma" in " ".join(validate(args))


def test_nvdd_run_sets_uma_activation_checkpointing() -> None:
    """``--uma-checkpoint off`` builds the UMA without fairchem's activation
    checkpointing, a number sets its chunk of edges, no flag keeps the model's
    default (on); the forces agree (float64)."""
    from nvalchemi.distributed._checks import validate
    from nvalchemi.distributed._models import build_model, builtin_system

    forces = {}
    for flag, chunk in ((None, "default"), ("off", None), ("5000", 5000)):
        extra = [] if flag is None else ["--uma-checkpoint", flag]
        args = build_parser().parse_args(["run", "--model", "uma", "--cells", "4", *extra])
        assert validate(args) == [], flag
        model = build_model(args, torch.device("cpu"), torch.float64)
        if chunk == "default":
            assert model.checkpoint_chunk is not None and model.checkpoint_chunk > 0
        else:
            assert model.checkpoint_chunk == chunk, flag
        batch = builtin_system(args, torch.float64)
        assert batch is not None
        forces[flag] = model(batch)["forces"]
    torch.testing.assert_close(forces["off"], forces[None], rtol=0, atol=1e-10)
    torch.testing.assert_close(forces["5000"], forces[None], rtol=0, atol=1e-10)


def test_nvdd_run_with_a_uma_checkpoint_on_two_ranks(tmp_path: Path) -> None:
    """One launch: 2 CPU ranks, the built-in O/Si box, the mixture-of-experts model
    from a checkpoint (merged on every rank for the box); the run's own
    comparison with one process agrees to 1e-10 eV/A (float64)."""
    path = tmp_path / "uma_tiny.pt"
    _checkpoint(path)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "nvalchemi.distributed.cli", "run", "--model", "uma"]
    cmd += ["--model-file", str(path), "--task", "omat", "--cells", "4", "--skin", "0.3"]
    cmd += ["--traj-every", "0", "--nproc", "2", "--nvt-steps", "2", "--nve-steps", "2"]
    cmd += ["--thermo-every", "2", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    m = re.search(r"max \|dF\| = (\S+) eV/A, \|dE\| = (\S+) eV over 64 atoms", res.stdout)
    assert m is not None and float(m.group(1)) < 1e-10, res.stdout
    assert float(m.group(2)) < 1e-9, res.stdout
    assert (out / "thermo.csv").is_file()
