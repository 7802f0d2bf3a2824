"""``nvdd run --model aimnet2 [--model-file MODEL.pt]`` (issue 37 item 2).

Needs the ``nvdd-models[aimnet2]`` extra (installed by the ``checks`` session);
without it these tests skip, or fail where ``NVDD_REQUIRE_EXTRAS=1``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nvalchemi.distributed.cli import build_parser
from nvdd.testing import importorskip_extra

_ENERGY = {"key_in": "energy", "key_out": "energy"}
#: A tiny AIMNet2 in aimnet's configuration format: 3 passes, cutoff 3 A.
CONFIG = {
    "class": "aimnet.models.AIMNet2",
    "kwargs": {
        "nfeature": 4,
        "d2features": True,
        "ncomb_v": 4,
        "hidden": [[16], [16], [16]],
        "aim_size": 8,
        "aev": {"rc_s": 3.0, "nshifts_s": 4},
        "outputs": {
            "energy_mlp": {
                "class": "aimnet.modules.Output",
                "kwargs": {
                    "n_in": 8,
                    "n_out": 1,
                    "key_in": "aim",
                    "key_out": "energy",
                    "mlp": {"activation_fn": "torch.nn.GELU", "last_linear": True, "hidden": [8]},
                },
            },
            "atomic_shift": {"class": "aimnet.modules.AtomicShift", "kwargs": _ENERGY},
            "atomic_sum": {"class": "aimnet.modules.AtomicSum", "kwargs": _ENERGY},
        },
    },
}


def _model_file(path: Path) -> None:
    """A tiny random AIMNet2 saved as an aimnet v2 file (the fields aimnet's own
    ``load_model`` reads and validates)."""
    importorskip_extra("aimnet", reason="needs the nvdd-models[aimnet2] extra")
    import yaml

    from nvdd.models import AIMNet2Model

    model = AIMNet2Model.from_config(CONFIG, seed=4)
    torch.save(
        {
            "format_version": 2,
            "model_yaml": yaml.safe_dump(CONFIG, sort_keys=False),
            "cutoff": 3.0,
            "needs_coulomb": False,
            "needs_dispersion": False,
            "coulomb_mode": "none",
            "implemented_species": [8, 14],
            "state_dict": model.aimnet.state_dict(),
        },
        path,
    )


def test_nvdd_run_builds_aimnet2_from_a_file_or_its_own(tmp_path: Path) -> None:
    """The model table: ``--model aimnet2 --model-file F`` builds the file's model
    through aimnet's loader; without a file a built-in random AIMNet2 on the O/Si
    box; both pass the pre-launch checks; a model file with another model is refused."""
    from nvalchemi.distributed._checks import validate
    from nvalchemi.distributed._models import build_model, builtin_system
    from nvdd.models import AIMNet2Model

    path = tmp_path / "aimnet2_tiny.pt"
    _model_file(path)
    for argv, cutoff in (
        (["--model-file", str(path)], 3.0),
        ([], 4.0),  # the built-in one
    ):
        args = build_parser().parse_args(
            ["run", "--model", "aimnet2", "--cells", "3", "--skin", "0.3", *argv]
        )
        assert validate(args) == [], argv
        model = build_model(args, torch.device("cpu"), torch.float64)
        assert isinstance(model, AIMNet2Model) and model.layers == 3, argv
        assert model.cutoff == pytest.approx(cutoff) and model.dtype == torch.float64, argv
        batch = builtin_system(args, torch.float64)
        assert batch is not None and batch.n_atoms == 27
        out = model(batch)
        assert out["forces"].shape == (27, 3) and bool(torch.isfinite(out["forces"]).all())
    args = build_parser().parse_args(["run", "--model", "lj", "--model-file", str(path)])
    assert "--model aimnet2 (an aimnet v2 AIMNet2 model file" in " ".join(validate(args))


@pytest.mark.gloo
def test_nvdd_run_with_an_aimnet2_model_file_on_two_ranks(tmp_path: Path) -> None:
    """One launch: 2 CPU ranks, the built-in O/Si box, the model from an aimnet v2
    file; the run's own comparison with one process agrees to 1e-10 eV/A (float64)."""
    path = tmp_path / "aimnet2_tiny.pt"
    _model_file(path)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "nvalchemi.distributed.cli", "run", "--model", "aimnet2"]
    cmd += ["--model-file", str(path), "--cells", "3", "--skin", "0.3", "--traj-every", "0"]
    cmd += ["--nproc", "2", "--nvt-steps", "2", "--nve-steps", "2", "--thermo-every", "2"]
    cmd += ["--out", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "27 atoms on 2 cpu rank(s) (gloo)" in res.stdout
    m = re.search(r"max \|dF\| = (\S+) eV/A, \|dE\| = (\S+) eV over 27 atoms", res.stdout)
    assert m is not None and float(m.group(1)) < 1e-10, res.stdout
    assert float(m.group(2)) < 1e-9
    assert (out / "thermo.csv").is_file()
