"""Helpers of the benchmarks page: result files, numbers, tables, the source line.

Standard library only; used by ``render.py`` and its section modules.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
GIB = 1024**3
Row = dict[str, Any]


def load_results(folder: Path = RESULTS) -> dict[str, dict[str, Any]]:
    """Every result file of ``folder``, by its ``name``."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob("*.json")):
        doc = json.loads(path.read_text())
        for key in ("name", "command", "commit", "machine", "versions", "rows"):
            if key not in doc:
                raise ValueError(f"{path.name}: result file without {key!r}")
        out[doc["name"]] = doc
    return out


# ----------------------------------------------------------------- formatting
def num(x: float | None, digits: int = 2) -> str:
    """A number with ``digits`` decimals and thousands separators; '' for None."""
    return "" if x is None else f"{x:,.{digits}f}"


def atoms(n: int) -> str:
    return f"{n:,}"


def ratio(a: float | None, b: float | None, digits: int = 2) -> str:
    return "" if a is None or b is None or b == 0 else f"{a / b:.{digits}f}"


def table(header: Sequence[str], rows: Iterable[Sequence[str]], right: Sequence[bool]) -> str:
    lines = ["| " + " | ".join(header) + " |"]
    lines.append("|" + "|".join("---:" if r else "---" for r in right) + "|")
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def bar_chart(title: str, labels: Sequence[str], series: dict[str, Sequence[float]], y: str) -> str:
    """A Mermaid xychart (rendered by the site; plain text here, so it diffs)."""
    top = max(max(v) for v in series.values()) * 1.15
    out = ["```mermaid", "xychart-beta", f'    title "{title}"']
    out.append("    x-axis [" + ", ".join(f'"{label}"' for label in labels) + "]")
    out.append(f'    y-axis "{y}" 0 --> {top:.3g}')
    for values in series.values():
        out.append("    bar [" + ", ".join(f"{v:.4g}" for v in values) + "]")
    out.append("```")
    legend = " / ".join(f"bar {i + 1}: {name}" for i, name in enumerate(series))
    return "\n".join(out) + (f"\n\n*{legend}*" if len(series) > 1 else "")


def table_section(
    text: str, head: list[str], body: list[list[str]], right: list[bool], doc: dict[str, Any]
) -> str:
    """A section: its text, its table, the result file's provenance line."""
    return f"{text}\n\n{table(head, body, right)}\n\n{source(doc)}\n"


def source(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    machine = m.get("kind", "?")
    if "gpu" in m:
        machine += f" ({m.get('gpus', 1)} x {m['gpu']})"
    versions = ", ".join(f"{k} {v}" for k, v in doc["versions"].items())
    note = f" {doc['note']}." if doc.get("note") else ""
    return (
        f"<small>Result file `benchmarks/results/{doc['name']}.json`: `{doc['command']}` at "
        f"{doc['commit']} ({doc.get('date', '')}), {machine}; {versions}.{note}</small>"
    )


def pick(rows: list[Row], **want: Any) -> Row | None:
    for r in rows:
        if all(r.get(k) == v for k, v in want.items()):
            return r
    return None


def ms(r: Row | None) -> float | None:
    return None if r is None else r.get("ms_per_step")


def peer_ms(rows: list[Row], **key: Any) -> float | None:
    """The faster of the peer's two timings (one sync per run, one per step)."""
    times = [ms(pick(rows, run=run, **key)) for run in ("peer", "peer (sync/step)")]
    found = [t for t in times if t is not None]
    return min(found) if found else None


def sizes(rows: list[Row]) -> list[tuple[int, str]]:
    """(cells, dtype) pairs in the order of the file (fp32 first)."""
    seen: list[tuple[int, str]] = []
    for r in rows:
        key = (r.get("cells"), r.get("dtype"))
        if None not in key and key not in seen:
            seen.append(key)  # type: ignore[arg-type]
    return sorted(seen, key=lambda k: (k[1] != "float32", k[0]))


def short(dtype: str) -> str:
    return {"float32": "fp32", "float64": "fp64"}.get(dtype, dtype)


def kilo(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"
