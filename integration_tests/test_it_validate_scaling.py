"""The scaling validation command on two gloo CPU ranks: the one-GPU prediction
and the real DomainParallel run of the same grid, side by side in a result file
the page renderer reads and in a printed table."""

from __future__ import annotations

import json
import sys
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
    # both sides hold every atom once, and the prediction's ghost rows are the runtime's
    predicted = row["predicted_per_rank"]
    assert sum(r["owned"] for r in predicted) == sum(r["owned"] for r in measured) == 108
    assert sorted(r["ghost"] for r in predicted) == sorted(r["ghost"] for r in measured)
    assert all(r["ghost"] > 0 for r in measured)
    for phase in ("model_ms", "exchange_ms", "fold_ms", "check_ms"):
        both = row["phases"][phase]
        assert both["predicted"] > 0 and both["measured"] > 0, phase
    assert row["phases"]["model_ms"]["predicted"] <= row["predicted_ms"]

    printed = capsys.readouterr().out
    assert "predicted ms" in printed and "measured ms" in printed
    assert "owned/ghost per rank, measured: " in printed

    page = render.render(render.load_results(tmp_path))
    assert "## Scaling prediction against the measured P-GPU step" in page
    assert "| lj 108, float32 | 2x1x1 | 54 |" in page
    # without its result file the page has no validation table
    assert "against the measured" not in render.render({})
