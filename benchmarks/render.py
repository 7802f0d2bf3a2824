"""Render docs/benchmarks.md from the result files in benchmarks/results/.

Every table and plot of the benchmarks page is computed here from the JSON
result files (each holds its command, commit, machine and library versions);
nothing on the page is typed by hand. Standard library only.

    python benchmarks/render.py            # write docs/benchmarks.md
    python benchmarks/render.py --check    # exit 1 when the page differs from the data
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.render_ab import main_ab, main_ab_131k, main_ab_decision, step_refactor_ab
from benchmarks.render_peers import mace_vs_torchsim, model_vs_torchsim
from benchmarks.render_scaling import (
    ghost_rows,
    halo_rebuilds,
    predicted_scaling,
    predicted_scaling_mace,
    validated_scaling,
    validation_command,
    whole_axes_one_gpu,
)
from benchmarks.render_table import (
    GIB,
    PAGE,
    RESULTS,
    Row,
    atoms,
    bar_chart,
    kilo,
    load_results,
    ms,
    num,
    peer_ms,
    pick,
    ratio,
    short,
    sizes,
    source,
    table,
)


# ------------------------------------------------------------------- sections
def lj_one_gpu(doc: dict[str, Any]) -> str:
    rows = doc["rows"]
    body, labels, dd_ratio, raw_ratio = [], [], [], []
    for cells, dtype in sizes(rows):
        k = {"cells": cells, "dtype": dtype}
        peer = peer_ms(rows, **k)
        raw = pick(rows, run="raw (half list)", **k)
        raw_e = pick(rows, run="raw (half list, eager)", **k)
        dd = pick(rows, run="DomainParallel", **k)
        dd_e = pick(rows, run="DomainParallel eager", **k)
        forced = pick(rows, run="DomainParallel (halo forced)", **k)
        n = raw["atoms"] if raw else 0
        body.append(
            [
                atoms(n),
                short(dtype),
                num(peer),
                num(ms(raw)),
                num(ms(raw_e)),
                num(ms(dd)),
                num(ms(dd_e)),
                num(ms(forced)),
                ratio(ms(raw), peer),
                f"**{ratio(ms(dd), peer)}**",
                num(raw["peak_bytes"] / n, 0) if raw else "",
            ]
        )
        labels.append(f"{kilo(n)} {short(dtype)}")
        dd_ratio.append(ms(dd) / peer if dd and peer else 0.0)
        raw_ratio.append(ms(raw) / peer if raw and peer else 0.0)
    head = [
        "atoms",
        "dtype",
        "peer ms",
        "raw graphs",
        "raw eager",
        "DD graphs",
        "DD eager",
        "halo forced",
        "raw / peer",
        "DD / peer",
        "raw B/atom",
    ]
    text = table(head, body, [True, False] + [True] * 9)
    chart = bar_chart(
        "LJ step time relative to the peer loop (lower is faster)",
        labels,
        {"raw / peer": raw_ratio, "DomainParallel / peer": dd_ratio},
        "ratio",
    )
    return (
        "## Lennard-Jones on one GPU against the peer loop\n\n"
        'nvdd\'s single-process integrator ("raw") and `DomainParallel` on one GPU ("DD", the\n'
        "whole batch, as a user gets it) against the peer loop of nvalchemi-toolkit-ops (its\n"
        "Warp cell list rebuilt every 10 steps, its LJ kernel, velocity Verlet in torch), on\n"
        'the same FCC argon atoms in one run. "graphs": steady steps replayed from a CUDA\n'
        'graph (the default); "eager": `cuda_graphs=False`; "halo forced": the multi-rank\n'
        "path on one GPU (`DomainConfig(halo_on_one_rank=True)`). ms per step; the peer\n"
        "time is the faster of its two timings.\n\n"
        f"{text}\n\n{chart}\n\n{source(doc)}\n"
    )


def halo_captured(doc: dict[str, Any]) -> str:
    rows = doc["rows"]
    body = []
    for cells, dtype in sizes(rows):
        k = {"cells": cells, "dtype": dtype}
        dd = pick(rows, run="DomainParallel", **k)
        forced = pick(rows, run="DomainParallel (halo forced)", **k)
        forced_e = pick(rows, run="DomainParallel (halo forced eager)", **k)
        body.append(
            [
                atoms(dd["atoms"]) if dd else "",
                short(dtype),
                num(ms(dd)),
                num(ms(forced)),
                num(ms(forced_e)),
                ratio(ms(forced_e), ms(forced)),
                str(forced.get("rebuilds", "")) if forced else "",
            ]
        )
    head = ["atoms", "dtype", "DD (whole batch)", "halo forced, graphs", "halo forced, eager"]
    head += ["speed-up of the capture", "rebuilds"]
    return (
        "## The halo path on one GPU, captured around its rebuild decision\n\n"
        "What every multi-GPU step runs, forced on one GPU: the steady step replayed from\n"
        "two CUDA graphs around the host's rebuild decision, against the same steps run\n"
        "eagerly. ms per step.\n\n"
        f"{table(head, body, [True, False, True, True, True, True, True])}\n\n{source(doc)}\n"
    )


def _build_table(doc: dict[str, Any], columns: dict[str, str]) -> str:
    """Neighbour-build rows: atoms, dtype, one ms column per ``columns`` entry."""
    body = [
        [atoms(r["atoms"]), short(r["dtype"])]
        + [num(r[key]) for key in columns.values()]
        + ["yes" if r.get("pairs_equal") else "no"]
        for r in doc["rows"]
    ]
    head = ["atoms", "dtype", *columns, "same pairs"]
    return table(head, body, [True, False] + [True] * len(columns) + [False])


def neighbor_builds(cells_doc: dict[str, Any], rows_doc: dict[str, Any]) -> str:
    first = _build_table(
        cells_doc,
        {
            "1 cell / radius": "nvdd_c1_ms",
            "2 cells": "nvdd_c2_ms",
            "3 cells": "nvdd_c3_ms",
            "peer": "peer_ms",
        },
    )
    second = _build_table(
        rows_doc, {"cell order": "nvdd_c1_ms", "row order": "nvdd_c1_rows_ms", "peer": "peer_ms"}
    )
    return (
        "## Neighbour list builds on one GPU\n\n"
        "One build of nvdd's device Verlet list at 9.5 A (ms), against the peer's cell list.\n"
        "Smaller cells per search radius:\n\n"
        f"{first}\n\n{source(cells_doc)}\n\n"
        "Rows built in cell order against row order (one thread per row, coalesced writes):\n\n"
        f"{second}\n\n{source(rows_doc)}\n"
    )


def largest_one_gpu(doc: dict[str, Any]) -> str:
    body = []
    for r in doc["rows"]:
        ok = r.get("status") == "ok"
        body.append(
            [
                atoms(r["atoms"]),
                num(r.get("ms_per_step"), 1) if ok else "out of memory",
                atoms(r["bytes_per_atom"]) if ok else "",
            ]
        )
    return (
        "## The largest Lennard-Jones system on one GPU\n\n"
        "The raw integrator, fp32, doubling the system until it runs out of memory.\n\n"
        f"{table(['atoms', 'ms/step', 'B/atom'], body, [True, True, True])}\n\n{source(doc)}\n"
    )


def _shares(r: Row | None) -> list[str]:
    s = (r or {}).get("shares") or {}
    return [
        f"{100 * s[k]:.1f} %" if k in s else "" for k in ("exchange", "fold", "migrate", "plan")
    ]


def _peaks(r: Row | None) -> str:
    if r is None:
        return ""
    per_rank = r.get("peak_per_rank") or [r.get("peak_bytes", 0)]
    return ", ".join(f"{p / GIB:.2f}" for p in per_rank)


def strong_scaling(lj: dict[str, Any], mpnn: dict[str, Any]) -> str:
    body, labels, one, two = [], [], [], []
    for cells, dtype in sizes(lj["rows"]):
        k = {"cells": cells, "dtype": dtype}
        rows = lj["rows"]
        raw = pick(rows, run="raw (half list)", ranks=1, **k)
        dd1 = pick(rows, run="DomainParallel", ranks=1, **k)
        forced = pick(rows, run="DomainParallel (halo forced)", ranks=1, **k)
        dd2 = pick(rows, run="DomainParallel", ranks=2, **k)
        n = raw["atoms"] if raw else 0
        body.append(
            [
                atoms(n),
                short(dtype),
                num(peer_ms(rows, **k)),
                num(ms(raw)),
                num(ms(dd1)),
                num(ms(forced)),
                num(ms(dd2)),
                f"{ratio(ms(dd1), ms(dd2))}x",
                *_shares(dd2),
                _peaks(dd2),
            ]
        )
        labels.append(f"LJ {kilo(n)} {short(dtype)}")
        one.append(ms(dd1) or 0.0)
        two.append(ms(dd2) or 0.0)
    head = ["atoms", "dtype", "peer ms", "raw ms", "DD 1 GPU", "DD 1 GPU, halo forced"]
    head += ["DD 2 GPUs", "2 GPUs vs 1", "exchange", "fold", "migrate", "plan", "peak GiB/rank"]
    lj_table = table(head, body, [True, False] + [True] * 10 + [False])
    body = []
    for cells, dtype in sizes(mpnn["rows"]):
        rows = mpnn["rows"]
        k = {"cells": cells, "dtype": dtype}
        raw = pick(rows, run="raw", ranks=1, **k)
        dd1 = pick(rows, run="DomainParallel", ranks=1, **k)
        forced = pick(rows, run="DomainParallel (halo forced)", ranks=1, **k)
        dd2 = pick(rows, run="DomainParallel", ranks=2, **k)
        n = raw["atoms"] if raw else 0
        body.append(
            [
                atoms(n),
                num(ms(raw)),
                num(ms(dd1)),
                num(ms(forced)),
                num(ms(dd2)),
                f"{ratio(ms(raw), ms(dd2))}x",
                f"{ratio(ms(dd1), ms(dd2))}x",
                *_shares(dd2),
                _peaks(dd2),
            ]
        )
        labels.append(f"MPNN {kilo(n)}")
        one.append(ms(dd1) or 0.0)
        two.append(ms(dd2) or 0.0)
    head = ["atoms", "raw ms", "DD 1 GPU", "DD 1 GPU, halo forced", "DD 2 GPUs", "2 GPUs vs raw"]
    head += ["2 GPUs vs DD 1", "exchange", "fold", "migrate", "plan", "peak GiB/rank"]
    mpnn_table = table(head, body, [True] * 11 + [False])
    chart = bar_chart(
        "ms per step: DomainParallel on 1 and 2 GPUs",
        labels,
        {"1 GPU": one, "2 GPUs": two},
        "ms/step",
    )
    return (
        "## Strong scaling on two GPUs\n\n"
        "The same system on one GPU and on two. On one GPU `DomainParallel` runs the model\n"
        "on the whole batch and replays a captured step; on two every step goes through the\n"
        "halo path (exchange, fold, and at rebuilds migration and a new plan: their shares of\n"
        "the two-GPU step are given). Peak memory per rank, rank 0 first (rank 0 also built the\n"
        "whole system before scattering it).\n\n"
        f"Lennard-Jones argon:\n\n{lj_table}\n\n{source(lj)}\n\n"
        f"Reference MPNN (2 layers, cutoff 5 A, fp32):\n\n{mpnn_table}\n\n{source(mpnn)}\n\n"
        f"{chart}\n"
    )


def weak_and_largest(weak: dict[str, Any], big: dict[str, Any]) -> str:
    rows = weak["rows"]
    raw = pick(rows, run="raw (half list)", ranks=1)
    dd2 = pick(rows, run="DomainParallel", ranks=2)
    body = [
        ["raw integrator, 1 GPU", atoms(raw["atoms"]), num(ms(raw)), _peaks(raw)],
        ["DomainParallel, 2 GPUs", atoms(dd2["atoms"]), num(ms(dd2)), _peaks(dd2)],
    ]
    first = table(["run", "atoms", "ms/step", "peak GiB/rank"], body, [False, True, True, False])
    body = []
    for r in big["rows"]:
        ok = r.get("ms_per_step") is not None
        body.append(
            [
                atoms(r["atoms"]),
                num(ms(r), 1) if ok else "out of memory",
                _peaks(r) if ok else "",
            ]
        )
    second = table(["atoms", "ms/step", "peak GiB/rank"], body, [True, True, False])
    return (
        "## Two GPUs: about a million atoms per GPU, and the largest system\n\n"
        f"LJ fp32, 2,048,000 atoms:\n\n{first}\n\n{source(weak)}\n\n"
        f"The largest LJ fp32 system under `DomainParallel` on two GPUs:\n\n{second}\n\n"
        f"{source(big)}\n"
    )


def memory_per_atom(graphs: dict[str, Any], lj2: dict[str, Any]) -> str:
    body, labels, raw_b, dd1_b, dd2_b = [], [], [], [], []
    for cells, dtype in sizes(lj2["rows"]):
        k = {"cells": cells, "dtype": dtype}
        rows = lj2["rows"]
        raw = pick(rows, run="raw (half list)", ranks=1, **k)
        dd1 = pick(rows, run="DomainParallel", ranks=1, **k)
        forced = pick(rows, run="DomainParallel (halo forced)", ranks=1, **k)
        dd2 = pick(rows, run="DomainParallel", ranks=2, **k)
        peer = pick(graphs["rows"], run="peer", **k)
        if not (raw and dd1 and dd2):
            continue
        n = raw["atoms"]
        worst2 = max(dd2.get("peak_per_rank") or [dd2["peak_bytes"]])
        vals = [
            raw["peak_bytes"] / n,
            dd1["peak_bytes"] / n,
            forced["peak_bytes"] / n if forced else None,
            worst2 / (n / 2),
        ]
        body.append(
            [
                atoms(n),
                short(dtype),
                *[num(v, 0) for v in vals],
                num(peer["peak_bytes"] / n, 0) if peer else "",
            ]
        )
        labels.append(f"{kilo(n)} {short(dtype)}")
        raw_b.append(vals[0])
        dd1_b.append(vals[1])
        dd2_b.append(vals[3])
    head = ["atoms", "dtype", "raw", "DD 1 GPU", "DD 1 GPU, halo forced"]
    head += ["DD 2 GPUs (per owned atom)", "peer"]
    chart = bar_chart(
        "Peak GPU memory per atom (bytes)",
        labels,
        {"raw": raw_b, "DD 1 GPU": dd1_b, "DD 2 GPUs": dd2_b},
        "bytes/atom",
    )
    return (
        "## Memory per atom\n\n"
        "Peak GPU memory (`torch.cuda.max_memory_allocated`) divided by the atoms a GPU\n"
        "holds, Lennard-Jones argon: under DD on two GPUs the busier rank's peak over half the\n"
        "atoms (ghost rows, halo buffers, and on rank 0 the whole system before the scatter).\n"
        "The peer column is the peer loop of the one-GPU run (its dense neighbour matrix).\n\n"
        f"{table(head, body, [True, False] + [True] * 5)}\n\n{chart}\n\n"
        f"{source(lj2)}\n\n{source(graphs)}\n"
    )


def mace_max_atoms(two: dict[str, Any], cueq: dict[str, Any]) -> str:
    modes = {
        ("plain", False): "plain model, 1 GPU, e3nn",
        ("dd2", False): "DomainParallel, 2 GPUs, e3nn",
        ("dd1", True): "DomainParallel, 1 GPU, cuEquivariance",
    }
    body, labels, largest = [], [], []
    for doc in (two, cueq):
        for (mode, cq), label in modes.items():
            rows = [r for r in doc["rows"] if r["mode"] == mode and bool(r.get("cueq")) == cq]
            if not rows:
                continue
            ran = [r for r in rows if r.get("status") == "ok"]
            failed = [r for r in rows if r.get("status") != "ok"]
            best = max(ran, key=lambda r: r["atoms"])
            peak = max(best.get("peak_mb") or [0]) / 1024
            body.append(
                [
                    label,
                    atoms(best["atoms"]),
                    num(ms(best), 1),
                    num(peak, 1),
                    atoms(min(r["atoms"] for r in failed)) if failed else "not tried",
                    doc["name"],
                ]
            )
            labels.append(label)
            largest.append(float(best["atoms"]))
    head = ["run", "largest that ran", "ms/step there", "peak GiB/rank", "out of memory at"]
    head.append("result file")
    chart = bar_chart(
        "MACE medium fp32: the most atoms that ran", labels, {"atoms": largest}, "atoms"
    )
    return (
        "## MACE: the most atoms that fit\n\n"
        'A "medium"-sized MACE (fp32), the system doubled until it runs out of memory. The\n'
        "two result files come from different machines and calls: compare rows of one file.\n\n"
        f"{table(head, body, [False, True, True, True, True, False])}\n\n{chart}\n\n"
        f"{source(two)}\n\n{source(cueq)}\n"
    )


def _ens_rows(doc: dict[str, Any], leg: str) -> dict[int, Row]:
    return {r["cells"]: r for r in doc["rows"] if r["leg"] == leg}


ENS_ATOMS = {10: 4000, 32: 131072, 63: 1000188}  # 4 * cells**3, FCC argon


def ensembles(device: dict[str, Any], rows_doc: dict[str, Any], trace: dict[str, Any]) -> str:
    new, base = _ens_rows(device, "ens"), _ens_rows(device, "ens_base")
    body = []
    for c in sorted(new):
        n, b = new[c], base.get(c, {})
        body.append(
            [
                atoms(ENS_ATOMS.get(c, 4 * c**3)),
                num(n["nve"], 3),
                num(n["nvt-nh"], 3),
                f"**{num(n['npt-iso'], 3)}**",
                num(n["npt-iso-eager"], 3),
                num(b.get("npt-iso"), 3),
                f"**{num(n['npt-full'], 3)}**",
                num(n["npt-full-eager"], 3),
                num(b.get("npt-full"), 3),
            ]
        )
    head = ["atoms", "NVE", "NVT-NH", "NPT iso", "NPT iso eager", "NPT iso, host (base)"]
    head += ["NPT full", "NPT full eager", "NPT full, host (base)"]
    first = table(head, body, [True] * 9)
    new, base = _ens_rows(rows_doc, "ens"), _ens_rows(rows_doc, "ens_base")
    body = []
    for c in sorted(new):
        n, b = new[c], base.get(c, {})
        body.append(
            [
                atoms(ENS_ATOMS.get(c, 4 * c**3)),
                num(n["nve"], 3),
                num(n["nvt-nh"], 3),
                num(b.get("npt-iso"), 3),
                f"**{num(n['npt-iso'], 3)}**",
                num(b.get("npt-full"), 3),
                f"**{num(n['npt-full'], 3)}**",
            ]
        )
    head = ["atoms", "NVE", "NVT-NH", "NPT iso, torch rows", "NPT iso, one kernel"]
    head += ["NPT full, torch rows", "NPT full, one kernel"]
    second = table(head, body, [True] * 7)
    new, base = _ens_rows(trace, "ens_cur"), _ens_rows(trace, "ens_base")
    body = []
    for c in sorted(new):
        n, b = new[c], base.get(c, {})
        body.append(
            [
                atoms(ENS_ATOMS.get(c, 4 * c**3)),
                num(n["nve"], 3),
                num(b.get("nvt-nh"), 3),
                f"**{num(n['nvt-nh'], 3)}**",
                f"{num(b.get('npt-iso'), 3)} / {num(n['npt-iso'], 3)}",
                f"{num(b.get('npt-full'), 3)} / {num(n['npt-full'], 3)}",
            ]
        )
    head = ["atoms", "NVE", "NVT-NH before", "NVT-NH now", "NPT iso before / now"]
    head.append("NPT full before / now")
    third = table(head, body, [True] * 6)
    return (
        "## Integrators on one GPU\n\n"
        'LJ argon fp64, ms per step, steps replayed from CUDA graphs unless "eager". Each table\n'
        "is one call with two code versions alternated (A/B).\n\n"
        f"NPT with its chains and cell on the device, against NPT on the host:\n\n{first}\n\n"
        f"{source(device)}\n\n"
        f"The NPT kick and drift as one Warp kernel, against torch row operations:\n\n{second}\n\n"
        f"{source(rows_doc)}\n\n"
        f"Nose-Hoover NVT reducing the trace of the kinetic tensor only:\n\n{third}\n\n"
        f"{source(trace)}\n"
    )


def drift(doc: dict[str, Any]) -> str:
    body = []
    for r in doc["rows"]:
        body.append(
            [
                r["ensemble"],
                f"{r['drift_n_eV_per_step']:.5e}",
                f"{r['drift_1_eV_per_step']:.5e}",
                f"{r['ratio']:.8f}",
                f"{r['max_abs_dCE_eV']:.1e}",
                f"{r['max_dx_A']:.1e}",
                f"{r['max_dcell_A']:.1e}",
                str(r["rebuilds"]),
            ]
        )
    head = ["ensemble", "drift, 4 ranks (eV/step)", "drift, 1 process", "ratio"]
    head += ["max abs dE_ext (eV)", "max dx (A)", "max dcell (A)", "rebuilds"]
    return (
        "## Extended-energy drift on CPU ranks\n\n"
        "2,000 steps of each ensemble on 4 gloo ranks and in one process: the drift of the\n"
        "conserved (extended) energy and the largest differences between the two runs.\n\n"
        f"{table(head, body, [False] + [True] * 7)}\n\n{source(doc)}\n"
    )


def receptive_field(doc: dict[str, Any]) -> str:
    """Refresh adapters against the receptive-field safe path (bench_receptive.py)."""
    rows = doc["rows"]
    body = [
        [
            r["path"],
            atoms(r["atoms"]),
            str(r["world"]),
            num(r["ghost_width_A"], 2),
            " / ".join(atoms(n) for n in r["owned_rows"]),
            " / ".join(atoms(n) for n in r["ghost_rows"]),
            num(r["ms_per_step"], 1),
            f"{r['max_abs_dF']:.1e}",
        ]
        for r in rows
    ]
    head = ["path", "atoms", "ranks", "ghost width (A)", "owned rows", "ghost rows"]
    head += ["ms / step", "max abs dF vs 1 process (eV/A)"]
    gains = []
    for n in sorted({r["atoms"] for r in rows}):
        adapted = ms(pick(rows, path="adapters", atoms=n))
        safe, fold = ms(pick(rows, path="safe", atoms=n)), ms(pick(rows, path="fold", atoms=n))
        gains.append(
            f"{atoms(n)} atoms: **{ratio(safe, adapted)}x** over `safe`"
            + ("" if fold is None else f", {ratio(fold, adapted)}x over `fold`")
        )
    first = rows[0]
    return (
        "## Refresh adapters against the receptive-field safe path\n\n"
        f"One message-passing model of {first['layers']} layers (cutoff "
        f"{num(first['cutoff_A'], 1)} A) on the same argon system and CPU ranks: `safe` is\n"
        "the model written as on one process, run unmodified under `receptive_field_spec`\n"
        "(a halo of 2 x layers x cutoff + skin, owned-row forces); `adapters` the same layers\n"
        "with owned receivers and `neighbor_refresh_adapters` under `SPEC_MPNN_HALO` (a halo\n"
        "of one cutoff + skin); `fold` the narrower variant (`fold=True`: a halo of layers x\n"
        f"cutoff + skin). The median of {first['steps']} steady-state steps, the fastest of "
        f"{first.get('rounds', 1)} alternating rounds. The adapters' gain: "
        + "; ".join(gains)
        + ".\n\n"
        f"{table(head, body, [False] + [True] * 7)}\n\n{source(doc)}\n"
    )


HEADER = """# Benchmarks

<!-- Generated by benchmarks/render.py from benchmarks/results/*.json: do not edit.
     Change the data (or the renderer) and run `python benchmarks/render.py`. -->

Every number on this page is computed by `benchmarks/render.py` from a result file
in `benchmarks/results/`; each file holds the command that measured it, the commit,
the machine and the library versions (named under each table). A test fails when
this page differs from the data. Compare rows of one result file only: results
from different calls ran on different machines and loads.

To measure: `python -m benchmarks.suite list` names the suites (`--quick` runs the
small CPU sizes; `--ab COMMIT` alternates this tree with another commit in one
run); results go to `benchmarks/results/` and this page is rendered from them.
"""


SECTIONS: list[tuple[tuple[str, ...], Callable[..., str]]] = [
    (("lj-1gpu-graphs",), lj_one_gpu),
    (("lj-1gpu-halo-captured",), halo_captured),
    (("neighbors-cells-per-cutoff", "neighbors-row-order"), neighbor_builds),
    (("lj-1gpu-largest",), largest_one_gpu),
    (("lj-2gpu-strong", "mpnn-2gpu-strong"), strong_scaling),
    (("lj-2gpu-weak", "lj-2gpu-largest"), weak_and_largest),
    (("lj-1gpu-graphs", "lj-2gpu-strong"), memory_per_atom),
    (("mace-2gpu", "mace-1gpu-cueq"), mace_max_atoms),
    (("mace-1gpu-torchsim",), mace_vs_torchsim),
    (("uma-1gpu-torchsim",), model_vs_torchsim),
    (("aimnet2-1gpu-torchsim",), model_vs_torchsim),
    (("sevennet-1gpu-torchsim",), model_vs_torchsim),
    (("step-refactor-ab",), step_refactor_ab),
    (("one-gpu-ab-031bb92",), main_ab),
    (("one-gpu-ab-031bb92-131k",), main_ab_131k),
    (("one-gpu-ab-031bb92-decision",), main_ab_decision),
    (("ensembles-npt-device", "ensembles-npt-rows", "ensembles-nvt-trace"), ensembles),
    (("ensembles-drift-cpu",), drift),
    (("receptive-field-cpu",), receptive_field),
    (("ghost-rows-lj",), ghost_rows),
    (("lj-1gpu-whole-axes",), whole_axes_one_gpu),
    (("scaling-predicted-lj",), predicted_scaling),
    (("halo-rebuilds-lj",), halo_rebuilds),
    (("halo-rebuilds-lj-cpu",), halo_rebuilds),
    (("scaling-predicted-mpnn",), predicted_scaling),
    (("scaling-predicted-mace",), predicted_scaling_mace),
    (("scaling-predicted-lj",), validation_command),
    (("scaling-validated-lj",), validated_scaling),
    (("scaling-validated-mpnn",), validated_scaling),
]


def render(results: dict[str, dict[str, Any]]) -> str:
    """The whole page. A section whose result files are absent is left out; a
    result file that no section shows is listed at the end."""
    parts = [HEADER]
    used: set[str] = set()
    for names, fn in SECTIONS:
        if all(n in results for n in names):
            parts.append(fn(*(results[n] for n in names)))
            used.update(names)
    rest = sorted(set(results) - used)
    if rest:
        lines = [f"- `{n}`: {results[n].get('title', '')} ({source(results[n])})" for n in rest]
        parts.append("## Other result files\n\n" + "\n".join(lines) + "\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="fail when the page differs")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--page", type=Path, default=PAGE)
    args = p.parse_args(argv)
    text = render(load_results(args.results))
    if args.check:
        current = args.page.read_text() if args.page.exists() else ""
        if current != text:
            diff = difflib.unified_diff(
                current.splitlines(), text.splitlines(), "page", "rendered", lineterm=""
            )
            print("\n".join(list(diff)[:60]))
            print(f"{args.page} differs from {args.results}: run python benchmarks/render.py")
            return 1
        print(f"{args.page} matches {len(load_results(args.results))} result files")
        return 0
    args.page.write_text(text)
    print(f"wrote {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
