"""The scaling validation command on two gloo CPU ranks: the one-GPU prediction
and the real DomainParallel run of the same grid, side by side in a result file
the page renderer reads and in a printed table."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import render  # noqa: E402  (the repository root)


def test_the_validation_command_predicts_and_measures_one_grid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks import validate_scaling as vs

    argv = ["--device", "cpu", "--cells", "3", "--ranks", "2", "--steps", "3", "--warmup", "1"]
    assert vs.main([*argv, "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "scaling-validated-lj.json").read_text())
    assert doc["command"].startswith("python benchmarks/validate_scaling.py --device cpu")
    (row,) = doc["rows"]
    assert (row["model"], row["grid"], row["ranks"], row["layout"]) == ("lj", "2x1x1", 2, "faces")
    assert row["atoms"] == 108
    assert row["predicted_ms"] > 0 and row["measured_ms"] > 0 and row["raw_ms"] > 0
    assert row["ratio"] == pytest.approx(row["measured_ms"] / row["predicted_ms"])
    assert row["measured_speedup"] == pytest.approx(row["raw_ms"] / row["measured_ms"])
    # the measured step is the slowest rank's
    measured = row["measured_per_rank"]
    assert [r["rank"] for r in measured] == [0, 1]
    assert row["measured_ms"] == max(r["ms_per_step"] for r in measured)
    # the halo rebuilds of the measured steps, counted (one decision: the same on every rank)
    assert {r["rebuilds"] for r in measured} == {row["measured_rebuilds"]}
    # at most one per measured step: the warm-up's forced rebuild is not counted
    assert 0 <= row["measured_rebuilds"] <= 3
    # both sides hold every atom once, and the prediction's ghost rows are the runtime's
    predicted = row["predicted_per_rank"]
    assert sum(r["owned"] for r in predicted) == sum(r["owned"] for r in measured) == 108
    assert sorted(r["ghost"] for r in predicted) == sorted(r["ghost"] for r in measured)
    assert all(r["ghost"] > 0 for r in measured)
    # LJ's direct forces: each rank's owned rows are complete, nothing to fold
    # (record 0093): no fold in the prediction, one exchange on its wire
    assert {r["folds"] for r in predicted} == {False} and row["exchanges"] == 1
    for phase in ("model_ms", "exchange_ms", "fold_ms", "check_ms"):
        both = row["phases"][phase]
        assert both["measured"] > 0, phase  # (the runtime's timer after the model)
        assert both["predicted"] == 0 if phase == "fold_ms" else both["predicted"] > 0, phase
    # the prediction's term: the slowest predicted rank's whole step, plus the wire
    step = max(r["step_ms"] for r in predicted)
    assert row["predicted_ms"] == pytest.approx(step + row["comm_ms"])

    printed = capsys.readouterr().out
    assert "predicted ms" in printed and "measured ms" in printed
    assert "owned/ghost per rank, measured: " in printed
    assert f"halo rebuilds in the measured steps: {row['measured_rebuilds']}\n" in printed

    page = render.render(render.load_results(tmp_path))
    assert "## Scaling prediction against the measured P-GPU step" in page
    assert "| lj 108, float32 | 2x1x1 | 54 |" in page
    # without its result file the page has no validation table
    assert "against the measured" not in render.render({})


def test_the_scaling_predictor_runs_mace_ranks_with_their_adapters(tmp_path: Path) -> None:
    pytest.importorskip("mace")
    with warnings.catch_warnings():  # e3nn's constants load warns under this env
        warnings.simplefilter("ignore")
        from mace.modules.blocks import EquivariantProductBasisBlock as Product

    from benchmarks import predict_scaling as ps

    original = Product.forward
    assert ps.main(["--quick", "--model", "mace", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "scaling-predicted-mace.json").read_text())
    assert doc["title"].startswith("MACE (tiny shape, random weights) on silica")
    raw, faces, split = doc["rows"]
    assert raw["ranks"] == 1 and raw["raw_ms"] > 0 and raw["atoms"] == 6**3
    assert (faces["model"], faces["grid"], faces["layout"]) == ("mace", "2x1x1", "faces")
    # the split layout (y and z left to the model: record 0079) holds fewer ghost rows
    assert split["layout"] == "split" and 0 < split["ghost_max"] < faces["ghost_max"]
    assert sum(r["owned"] for r in faces["per_rank"]) == raw["atoms"]
    assert faces["max_force_err"] is None  # ghost features are stand-ins: not checked
    # each run's GPU peak and the capacity it predicts (None on the CPU)
    assert "peak_bytes" in raw and all("peak_bytes" in r for r in faces["per_rank"])
    assert "capacity_ratio" in faces and "capacity_ratio" in split
    # positions, forces, one node_feats refresh (8x0e+8x1o: 32 floats a row) and its fold
    wire = faces["ghost_max"] * (3 + 3 + 32 + 32) * 8 / 300e9 * 1e3
    assert faces["comm_ms"] == pytest.approx(4 * 20e-3 + 15e-3 + wire)
    # the slowest rank's whole step (eager, its decision read once a step) and the wire
    assert faces["slowest"]["model_ms"] > 0
    assert faces["predicted_ms"] == pytest.approx(faces["slowest"]["step_ms"] + faces["comm_ms"])
    assert all(r["decision_reads"] == 3 + 1 + 1 for r in faces["per_rank"])
    # the spec's adapters (owned receivers, the refresh) ran each rank's steps, and
    # were removed after
    assert [r["adapters"] for r in faces["per_rank"]] == [2, 2]
    assert Product.forward is original
    page = render.render(render.load_results(tmp_path))
    assert "## Scaling predicted from one GPU: MACE" in page
    assert "| 2x1x1 | faces | 108 | 592 |" in page and "| 2x1x1 | split | 108 | " in page
    assert "| holds x of one GPU |" in page
