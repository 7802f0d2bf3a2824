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
