"""`nvdd run --strategy`: graph partition end to end on 2 ranks (it equals one
process by atom id and checkpoints), and the combinations refused before launch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nvalchemi.distributed._checks import validate
from nvalchemi.distributed._demo import run_rank
from nvalchemi.distributed._models import build_model
from nvalchemi.distributed.cli import build_parser
from nvdd.dynamics import read_checkpoint
from nvdd.testing import assert_close_by_id, run_ranks

TINY = ["--cells", "3", "--cutoff", "6.0", "--skin", "0.5", "--compare", "none"]


def _nvdd_rank(argv: list[str]) -> int:
    """Rank function: one rank of ``nvdd run`` (the group run_ranks made is reused)."""
    return run_rank(build_parser().parse_args(argv))


@pytest.mark.gloo
def test_graph_partition_runs_checkpoints_and_equals_one_process(tmp_path: Path) -> None:
    out = tmp_path / "gp"
    argv = ["run", "--strategy", "graph-partition", *TINY, "--nvt-steps", "2"]
    argv += ["--nve-steps", "2", "--thermo-every", "2", "--traj-every", "0"]
    argv += ["--checkpoint-every", "2", "--watchdog", "0", "--out", str(out)]
    args = build_parser().parse_args(argv)
    assert validate(args) == []
    assert run_ranks(_nvdd_rank, 2, argv, timeout_s=300) == [0, 0]
    got, manifest = read_checkpoint(out / "checkpoint")
    assert manifest["domain"]["strategy"] == "graph_partition"
    assert manifest["metadata"]["step"] == 4 and manifest["world_size"] == 2
    ref = build_model(args, torch.device("cpu"), torch.float64)(got)["forces"].detach()
    assert float(ref.abs().max()) > 1e-3
    assert_close_by_id(got.atom_ids, got.forces, got.atom_ids, ref, atol=1e-10, what="forces")
    assert (out / "thermo.csv").read_text().count("\n") >= 2


def test_graph_partition_refuses_spatial_options_and_halo_only_models(tmp_path: Path) -> None:
    def problems(*argv: str) -> list[str]:
        return validate(build_parser().parse_args(["run", "--strategy", "graph-partition", *argv]))

    assert problems(*TINY) == []
    assert problems("--grid", "2", "1", "1") == [
        "--grid applies to --strategy halo only (graph-partition splits atoms by index)"
    ]
    assert "--load-balance applies to --strategy halo only" in problems("--load-balance")[0]
    run_file = tmp_path / "lj-ewald.toml"
    run_file.write_text(
        '[system]\nbuiltin = "nacl"\ncells = 2\n'
        '[[model]]\nkind = "lj"\ncutoff = 4.5\nspecies = { 11 = [0.05, 2.35], 17 = [0.05, 4.0] }\n'
        '[[model]]\nkind = "ewald"\ncutoff = 4.5\naccuracy = 1e-5\n'
    )
    assert (
        "--strategy graph-partition: the run file's model kind(s) ewald have no "
        "graph-partition spec (lj and mpnn do): use --strategy halo"
    ) in problems("--run-file", str(run_file))
    halo = validate(build_parser().parse_args(["run", "--run-file", str(run_file)]))
    assert not [p for p in halo if "strategy" in p]
