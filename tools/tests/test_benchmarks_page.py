"""docs/benchmarks.md is exactly what benchmarks/render.py makes of benchmarks/results/."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _render() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_render", ROOT / "benchmarks" / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_page_is_rendered_from_the_results() -> None:
    render = _render()
    assert render.main(["--check"]) == 0


def test_a_changed_number_makes_the_check_fail(tmp_path: Path) -> None:
    render = _render()
    results = tmp_path / "results"
    shutil.copytree(ROOT / "benchmarks" / "results", results)
    page = tmp_path / "benchmarks.md"
    assert render.main(["--results", str(results), "--page", str(page)]) == 0
    assert render.main(["--check", "--results", str(results), "--page", str(page)]) == 0
    path = results / "lj-1gpu-graphs.json"
    doc = json.loads(path.read_text())
    peer = next(r for r in doc["rows"] if r["run"] == "peer")
    peer["ms_per_step"] *= 2
    path.write_text(json.dumps(doc))
    assert render.main(["--check", "--results", str(results), "--page", str(page)]) == 1


def test_every_result_file_says_how_it_was_measured() -> None:
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        doc = json.loads(path.read_text())
        for key in ("command", "commit", "machine", "versions", "rows"):
            assert doc.get(key), f"{path.name}: no {key}"
        assert doc["name"] == path.stem, path.name


def test_the_torchsim_section_appears_only_with_its_result_file(tmp_path: Path) -> None:
    render = _render()
    results = tmp_path / "results"
    shutil.copytree(ROOT / "benchmarks" / "results", results)
    for measured in results.glob("*-1gpu-torchsim.json"):  # the measured files aside
        measured.unlink()
    without = render.render(render.load_results(results))
    assert "against torch-sim" not in without

    def row(leg: str, phase: str, n: int, ms: float | None, status: str = "ok") -> dict:
        r = {"leg": leg, "phase": phase, "atoms": n, "steps": 50, "warmup": 20, "status": status}
        return r if ms is None else {**r, "ms_per_step": ms, "peak_mb": [2048.0]}

    rows = [row("plain", "timed", 13824, 70.0), row("dd1", "timed", 13824, 63.0)]
    rows += [row("peer", "timed", 13824, 90.0), row("peer-cell", "timed", 13824, 60.0)]
    rows += [row("dd1", "search", 27648, 120.0), row("dd1", "search", 55296, None, "OOM")]
    rows += [row("peer-cell", "search", 27648, None, "OOM")]
    doc = {"schema": 1, "name": "mace-1gpu-torchsim", "command": "python x", "commit": "abc"}
    doc |= {"machine": {"kind": "h100"}, "versions": {"torch": "2"}, "rows": rows}
    (results / "mace-1gpu-torchsim.json").write_text(json.dumps(doc))
    page = render.render(render.load_results(results))
    assert page.startswith(without.split("## Other result files")[0][:200])
    section = page.split("## MACE on one GPU against torch-sim")[1].split("\n## ")[0]
    assert "**1.05x** the step time" in section and "(target <= 1.1: met)" in section
    assert "**2.00x** torch-sim's (target >= 1: met)" in section
    assert "| nvdd DomainParallel, 1 GPU | 27,648 | OOM at 55,296 |" in section
