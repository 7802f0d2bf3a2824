"""`nvdd run --run-file`: parsing a run file into a system and a (composed) model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nvalchemi.distributed._runfile import build_model, build_system, load_run_file
from nvdd.core import ConfigurationError

RUN = """
[system]
builtin = "nacl"
cells = 1

[[model]]
kind = "lj"
cutoff = 4.0
species = { 11 = [0.05, 2.35], 17 = [0.05, 4.0] }
pairs = { "11-17" = [0.6, 2.45] }

[[model]]
kind = "pme"
cutoff = 4.0
mesh = [8, 8, 8]

[[model]]
kind = "d3"
functional = "pbe"
cutoff = 4.0
cn_cutoff = 3.0
"""


@pytest.mark.requires_extra("tad_dftd3", "nvdd-models[longrange]")  # the run file has D3
def test_a_run_file_builds_a_pipeline_and_a_charged_crystal(tmp_path: Path) -> None:
    from nvdd.models import DFTD3, LennardJones, ParticleMeshEwald, PipelineModel

    path = tmp_path / "run.toml"
    path.write_text(RUN)
    data = load_run_file(path)
    model = build_model(data)
    assert isinstance(model, PipelineModel)
    kinds = [type(m) for m in model.pipeline_components]
    assert kinds == [LennardJones, ParticleMeshEwald, DFTD3]
    assert model.pipeline_components[0].config.pairs[(11, 17)] == (0.6, 2.45)
    batch = build_system(
        data, dtype=torch.float64, device=torch.device("cpu"), temperature_k=10.0, seed=0
    )
    assert batch.n_atoms == 8
    assert float(batch.atom_extras["charges"].sum()) == 0.0
    out = model(batch)
    assert out["forces"].shape == (8, 3) and torch.isfinite(out["energy"]).all()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[system]\n", "has no \\[\\[model\\]\\] entry"),
        ("[[model]]\nkind = 'morse'\n", "unknown \\[\\[model\\]\\] kind 'morse'"),
        ("[[model]]\nkind = 'ewald'\ncutof = 4.0\n", "kind = 'ewald'.*cutof"),
        ("[[model]]\nkind = 'lj'\ncutoff = 4.0\npairs = { '11' = [1, 1] }\n", "kind = 'lj'"),
        ("[[model]\n", "run file"),
    ],
)
def test_bad_run_files_are_configuration_errors(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigurationError, match=match):
        build_model(load_run_file(path))
