"""The A/B sections of the benchmarks page (``render.py`` assembles the page):
the step refactor against the commit before it (issue 35) and main against
031bb92, the commit issues 35 and 36 were filed at, in three leases. Standard
library only."""

from __future__ import annotations

from typing import Any

from benchmarks.render_table import atoms, num, short, source, table, table_section

__all__ = ["main_ab", "main_ab_131k", "main_ab_decision", "step_refactor_ab"]


_AB_HEAD = ["model", "run", "atoms", "dtype", "A ms (runs)", "B ms (runs)", "B / A"]
_AB_RIGHT = [False, False, True, False, *[True] * 3]


def _ab_rows(doc: dict[str, Any]) -> tuple[list[list[str]], list[float], list[str]]:
    """An A/B file's table rows, its B / A ratios and the rows above 1.03, named."""
    rows = [
        [
            r["bench"].upper() if r["bench"] != "mace" else "MACE",
            r["run"],
            atoms(r["atoms"]),
            short(r["dtype"]),
            " / ".join(num(x) for x in r["a_runs_ms"]),
            " / ".join(num(x) for x in r["b_runs_ms"]),
            num(r["b_over_a"], 3),
        ]
        for r in doc["rows"]
    ]
    ratios = [r["b_over_a"] for r in doc["rows"]]
    over = [
        f"{r['bench'].upper()} {r['run']} {short(r['dtype'])} ({num(r['b_over_a'], 3)}: runs "
        f"{' and '.join(num(x) for x in r['b_runs_ms'])} ms against "
        f"{' and '.join(num(x) for x in r['a_runs_ms'])})"
        for r in doc["rows"]
        if r["b_over_a"] > 1.03
    ]
    return rows, ratios, over


def main_ab(doc: dict[str, Any]) -> str:
    """Main against the commit before issues 35 and 36, one lease: B / A per row,
    the rows above 1.03 named from the data."""
    rows, ratios, over = _ab_rows(doc)
    text = (
        "## Main against the commit before issues 35 and 36\n\n"
        "Issues 35 (the step written once) and 36 (ghosts only where a neighbour rank\n"
        "is) ask that no single-GPU row get slower. A is 031bb92, the commit both issues\n"
        "were filed at, B the main named below; both ran in one lease of one GPU, two\n"
        "runs a side in alternated pairs (each side's runs in the table, B / A of\n"
        f"their means): B / A from {num(min(ratios), 3)} to {num(max(ratios), 3)}"
    )
    if over:
        text += f"; above 1.03: {'; '.join(over)}"
    return table_section(text + ".", _AB_HEAD, rows, _AB_RIGHT, doc)


def main_ab_decision(doc: dict[str, Any]) -> str:
    """The same A/B after the decision kernel (record 0094) and LJ's owned forces
    (record 0093): B / A per row, by kind of run."""
    rows, ratios, over = _ab_rows(doc)

    def span(run: str) -> str:  # (the rows of one kind: the run's name up to its qualifier)
        got = [r["b_over_a"] for r in doc["rows"] if r["run"].split(" (")[0] == run.split(" (")[0]
               and ("(halo" in r["run"]) == ("(halo" in run)]  # fmt: skip
        return f"{num(min(got), 3)} to {num(max(got), 3)}" if got else "-"

    text = (
        "### After the step's decision in one kernel and LJ's owned forces\n\n"
        "The same A/B (A 031bb92, B as named below, one lease, two runs a side alternated)\n"
        "after the step's local decision became one kernel (record\n"
        "[0094](decisions/0094-decision-in-one-kernel.md)) and Lennard-Jones stopped folding\n"
        "(record [0093](decisions/0093-lj-owned-forces.md)): B / A from "
        f"{num(min(ratios), 3)} to {num(max(ratios), 3)}; the halo-forced rows "
        f"{span('DomainParallel (halo forced)')}, one-rank DomainParallel {span('DomainParallel')},"
        f" the raw loop (the same code on both sides) {span('raw')}"
    )
    if over:
        text += f"; above 1.03: {'; '.join(over)}"
    return table_section(text + ".", _AB_HEAD, rows, _AB_RIGHT, doc)


def main_ab_131k(doc: dict[str, Any]) -> str:
    """The issue's 131k-atom LJ rows of the same A/B (another lease): B / A per
    row, and the spread of the rows that rebuild the halo during the timed steps."""
    rows = doc["rows"]
    body = [
        [
            r["run"],
            short(r["dtype"]),
            " / ".join(num(x) for x in r["a_runs_ms"]),
            " / ".join(num(x) for x in r["b_runs_ms"]),
            num(r["b_over_a"], 3),
            " / ".join(num(x) for x in r.get("b_earlier_runs_ms", [])) or "-",
            "-" if r.get("rebuilds") is None else str(r["rebuilds"]),
        ]
        for r in rows
    ]
    calm = [r["b_over_a"] for r in rows if not r.get("rebuilds")]
    busy = [r for r in rows if r.get("rebuilds")]
    text = (
        "### The issue's 131k-atom rows\n\n"
        "The same A/B for the issue's 131,072-atom LJ rows, in another lease (below), two runs a\n"
        "side alternated. The rows that rebuild nothing in their timed steps (raw, and\n"
        f"DomainParallel on one rank): B / A from {num(min(calm), 3)} to {num(max(calm), 3)}."
    )
    for r in busy:
        runs = [*r["b_runs_ms"], *r.get("b_earlier_runs_ms", [])]
        text += (
            f" {r['run']} {short(r['dtype'])}: B / A {num(r['b_over_a'], 3)}, but each run"
            f" rebuilds the halo {r['rebuilds']} times (steps of several ms, mostly host work: record [0028](decisions/0028-rebuild-host-traffic.md)) and"
            f" B's {len(runs)} runs on the same machine spread from {num(min(runs))} to"
            f" {num(max(runs))} ms (A's two: {' and '.join(num(x) for x in r['a_runs_ms'])})."
        )
    if busy:
        text += " Two runs a side do not settle those rows; they were not repeated."
    head = ["run", "dtype", "A ms (runs)", "B ms (runs)", "B / A", "B, earlier runs", "rebuilds"]
    return table_section(text, head, body, [False, False, *[True] * 5], doc)


def step_refactor_ab(doc: dict[str, Any]) -> str:
    """The A/B of the step refactor (issue 35): B / A per row, both rounds."""
    rows = [
        [
            str(r["round"]),
            r["bench"].upper() if r["bench"] != "mace" else "MACE",
            r["run"],
            atoms(r["atoms"]),
            short(r["dtype"]),
            num(r["a_ms"]),
            num(r["b_ms"]),
            num(r["b_over_a"], 3),
        ]
        for r in doc["rows"]
    ]
    head = ["round", "model", "run", "atoms", "dtype", "A ms", "B ms", "B / A"]
    return (
        "## The step refactor against the commit before it\n\n"
        "Issue 35 rewrote the step (one function over one state, providers by mode, no\n"
        "attribute swapping) and asked that no row get slower by more than 3 %. A is the\n"
        "commit before, B the refactor; both ran in one lease of one GPU, alternated.\n"
        "Round 2 repeats two of the rows that round 1 put above 1.03 (LJ 1M and the\n"
        "MPNN in fp64) with more steps; the MPNN fp32 halo-forced row was not repeated.\n"
        "Round 3 measures the step after item 3 (CUDA-graph capture wraps the step's\n"
        "phases from outside the provider, record 0077) against the same A: every row\n"
        "within 1.5 %, and CUDA graphs replayed as many steps on both sides.\n"
        + _round4(doc["rows"])
        + "\n"
        + table(head, rows, [False, False, False, True, False, True, True, True])
        + "\n\n"
        + source(doc)
        + "\n"
    )


def _round4(rows: list[dict[str, Any]]) -> str:
    """Round 4's sentence (item 5's module folds against the main before them),
    its range and any row above 1.03 read from the data."""
    four = [r for r in rows if r["round"] == 4]
    if not four:
        return ""
    ratios = [r["b_over_a"] for r in four]
    over = [
        f"{r['bench'].upper()} {r['run']} {short(r['dtype'])} ({num(r['b_over_a'], 3)})"
        for r in four
        if r["b_over_a"] > 1.03
    ]
    text = (
        "Round 4 measures item 5 (record 0083's module folds: a steady step entering 17\n"
        "project files in the LJ and MPNN rows, 16 in the MACE rows) against the main\n"
        "before them, one run per side: B / A\n"
        f"from {num(min(ratios), 3)} to {num(max(ratios), 3)}"
    )
    if over:
        text += (
            f"; above 1.03: {', '.join(over)}, a single run whose\n"
            "other-precision twin moved the other way"
        )
    return text + ".\n" + _round5(rows)


def _round5(rows: list[dict[str, Any]]) -> str:
    """Round 5's sentence: the MPNN rows again, two runs a side, alternated."""
    five = [r for r in rows if r["round"] == 5]
    if not five:
        return ""
    ratios = [r["b_over_a"] for r in five]
    return (
        "Round 5 repeats the MPNN rows (two runs a side, alternated A B A B, against the\n"
        f"same A): B / A from {num(min(ratios), 3)} to {num(max(ratios), 3)}, so round 4's\n"
        "row above 1.03 was run-to-run spread.\n"
    )
