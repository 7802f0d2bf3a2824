"""``nvdd run --model sevenn [--model-file CHECKPOINT]`` (issue 37 item 2).

Needs the ``nvdd-models[sevenn]`` extra (the ``sevenn`` nox session); without it
these tests skip, or fail where ``NVDD_REQUIRE_EXTRAS=1``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from nvalchemi.distributed.cli import build_parser
from nvdd.testing import importorskip_extra


def _checkpoint(path: Path) -> None:
    """A tiny random SevenNet (2 layers, cutoff 2.6 A, O and Si) saved by sevenn's
    own trainer as a checkpoint file."""
    importorskip_extra("sevenn", reason="needs the nvdd-models[sevenn] extra")
    from sevenn.model_build import build_E3_equivariant_model
    from sevenn.train.trainer import Trainer

    from nvdd.models import SevenNetModel

    config = {
        "chemical_species": ["O", "Si"],
        "cutoff": 2.6,
        "channel": 4,
        "lmax": 1,
        "num_convolution_layer": 2,
        "weight_nn_hidden_neurons": [8],
    }
    full = SevenNetModel.from_config(config, seed=4).sevennet.sevenn_config
    plain = build_E3_equivariant_model(full)
    Trainer(plain, [], torch.optim.Adam, device="cpu").write_checkpoint(
        str(path), config=full, epoch=1
    )


def test_nvdd_run_builds_sevennet_from_a_checkpoint_or_its_own() -> None:
    """The model table: ``--model sevenn --model-file F`` builds the checkpoint's
    model through sevenn's loader; without a file a built-in random SevenNet on the
    O/Si box; both pass the pre-launch checks."""
    import tempfile

    from nvalchemi.distributed._checks import validate
    from nvalchemi.distributed._models import build_model, builtin_system
    from nvdd.models import SevenNetModel

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint_tiny.pth"
        _checkpoint(path)
        for argv, cutoff in (
            (["--model-file", str(path)], 2.6),
            ([], 4.5),  # the built-in one
        ):
            args = build_parser().parse_args(
                ["run", "--model", "sevenn", "--cells", "4", "--skin", "0.3", *argv]
            )
            assert validate(args) == [], argv
            model = build_model(args, torch.device("cpu"), torch.float64)
            assert isinstance(model, SevenNetModel) and model.layers == 2, argv
            assert model.cutoff == cutoff and model.dtype == torch.float64, argv
            batch = builtin_system(args, torch.float64)
            assert batch is not None and batch.n_atoms == 64
            out = model(batch)
            assert out["forces"].shape == (64, 3) and bool(torch.isfinite(out["forces"]).all())
    args = build_parser().parse_args(["run", "--model", "lj", "--model-file", str(path)])
    assert "use it with --model mace" in " ".join(validate(args))
    assert "--model sevenn (a SevenNet checkpoint" in " ".join(validate(args))


def test_nvdd_run_with_a_sevennet_checkpoint_on_two_ranks(tmp_path: Path) -> None:
    """One launch: 2 CPU ranks, the built-in O/Si box, the model from a checkpoint;
    the run's own comparison with one process agrees to 1e-10 eV/A (float64)."""
    path = tmp_path / "checkpoint_tiny.pth"
    _checkpoint(path)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "nvalchemi.distributed.cli", "run", "--model", "sevenn"]
    cmd += ["--model-file", str(path), "--cells", "4", "--skin", "0.3", "--traj-every", "0"]
    cmd += ["--nproc", "2", "--nvt-steps", "2", "--nve-steps", "2", "--thermo-every", "2"]
    cmd += ["--out", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    m = re.search(r"max \|dF\| = (\S+) eV/A, \|dE\| = (\S+) eV over 64 atoms", res.stdout)
    assert m is not None and float(m.group(1)) < 1e-10, res.stdout
    assert (out / "thermo.csv").is_file()
