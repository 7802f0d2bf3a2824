"""Sections of the benchmarks page on multi-GPU scaling: the one-GPU prediction
(``predict_scaling.py``) and its validation on several GPUs (``validate_scaling.py``).
"""

from __future__ import annotations

import math
from typing import Any

from benchmarks.render_table import (
    atoms,
    num,
    short,
    source,
    table,
)


def ghost_rows(doc: dict[str, Any]) -> str:
    """Ghost rows per rank of the halo plan, before and after leaving the whole
    axes to the model (benchmarks/ghost_rows.py, record 0079)."""
    rows = doc["rows"]

    def per_rank(values: list[int]) -> str:
        lo, hi = min(values), max(values)
        return atoms(lo) if lo == hi else f"{atoms(lo)} to {atoms(hi)}"

    body = []
    for grid in dict.fromkeys(r["grid"] for r in rows):
        before = next(r for r in rows if r["grid"] == grid and r["layout"] == "images")
        after = next(r for r in rows if r["grid"] == grid and r["layout"] == "wrapped")
        owned = before["owned"]
        share = [g / o for g, o in zip(after["ghost"], owned, strict=True)]
        body.append(
            [
                grid,
                str(before["ranks"]),
                per_rank(owned),
                per_rank(before["ghost"]),
                num(100 * max(g / o for g, o in zip(before["ghost"], owned, strict=True)), 1)
                + " %",
                per_rank(after["ghost"]),
                num(100 * max(share), 1) + " %",
                num(100 * (1 - sum(after["ghost"]) / sum(before["ghost"])), 0) + " %",
            ]
        )
    header = [
        "grid",
        "ranks",
        "owned / rank",
        "ghost rows / rank, images",
        "ghost / owned",
        "ghost rows / rank, whole axes wrapped",
        "ghost / owned",
        "fewer rows",
    ]
    atoms_total = atoms(rows[0]["atoms"])
    return (
        "## Ghost rows only where a neighbour rank is\n\n"
        f"LJ argon, {atoms_total} atoms, ghost width {num(rows[0]['ghost_width'])} A "
        "(cutoff + skin + migration hysteresis): the ghost rows each rank holds in the "
        "halo plan, computed from the plan alone (the runtime's partitioner and ghost "
        "selection, no model). `images`: image rows across every periodic face (the "
        "default); `whole axes wrapped`: `DomainConfig(wrap_whole_axes=True)`, the "
        "axes the grid leaves whole left to the model's neighbour list (record "
        "[0079](decisions/0079-ghosts-where-a-neighbour-rank-is.md)). The step time this "
        "saves is measured on GPUs by `bench_dp.py --wrap-whole-axes off on` (the "
        "halo-forced one-rank rows) and predicted by `predict_scaling.py --layouts "
        "faces split`.\n\n"
        + table(header, body, [False, True, True, True, True, True, True, True])
        + "\n\n*"
        + source(doc)
        + "*\n"
    )


def whole_axes_one_gpu(doc: dict[str, Any]) -> str:
    """The halo forced on one GPU with image rows and with the whole axes wrapped
    (``bench_dp.py --wrap-whole-axes off on``): ms per steady step against raw."""
    rows = doc["rows"]
    body = []
    for key in dict.fromkeys((r["atoms"], r["dtype"]) for r in rows):
        of = {r["run"]: r for r in rows if (r["atoms"], r["dtype"]) == key}
        raw = of["raw (half list)"]["ms_per_step"]
        images = of["DomainParallel (halo forced)"]
        wrapped = next(r for r in of.values() if r["wrap"])
        body.append(
            [
                atoms(key[0]),
                short(key[1]),
                num(raw),
                num(of["DomainParallel"]["ms_per_step"]),
                f"{num(images['ms_per_step'])} ({atoms(images['ghosts'])} ghosts)",
                f"{num(wrapped['ms_per_step'])} ({atoms(wrapped['ghosts'])} ghosts)",
                num(wrapped["ms_per_step"] / images["ms_per_step"], 3),
                num(wrapped["ms_per_step"] / raw, 2),
            ]
        )
    header = [
        "atoms",
        "dtype",
        "raw ms",
        "DomainParallel ms",
        "halo forced, images",
        "halo forced, whole axes wrapped",
        "wrapped / images",
        "wrapped / raw",
    ]
    return (
        "### The halo forced on one GPU, whole axes wrapped\n\n"
        "On one rank every axis is whole, so with the option the halo holds no ghost "
        "row at all. What is left of the halo-forced overhead is the halo's machinery "
        "(the skin check, the plan, pack and fold kernels on empty sets) and the model's "
        "periodic neighbour list: removing the image rows saves 1-4 % on three rows and "
        "costs 1 % on LJ 4M fp64, and the GPU peak grows (the periodic list's cells). The "
        "option stays off by default (record "
        "[0079](decisions/0079-ghosts-where-a-neighbour-rank-is.md)). CUDA graphs replayed "
        "the same steps with and without it.\n\n"
        + table(header, body, [True, False, True, True, True, True, True, True])
        + "\n\n*"
        + source(doc)
        + "*\n"
    )


#: The capacity column's explanation (rendered when the rows carry ``capacity_ratio``).
CAPACITY_TEXT = (
    "Holds = how many atoms the P GPUs hold relative to one: P x (raw peak / atoms) / "
    "the largest rank's (peak / owned atoms), each peak the GPU memory a run allocates "
    "(`torch.cuda.max_memory_allocated` less what was allocated before it: no CUDA "
    "context, model weights or one-time library workspaces), memory taken to grow "
    "linearly with rows at fixed density with no intercept (safe side: ghost rows "
    "weigh less at the sizes that fill a GPU); '-' where no GPU peak was recorded."
)


def _capacity_shown(rows: list[dict[str, Any]]) -> bool:
    """Whether a result records the capacity (files before it lack the field)."""
    return any("capacity_ratio" in r for r in rows)


def _capacity(r: dict[str, Any]) -> str:
    """The capacity cell: the ratio, or '-' where no GPU peak was recorded."""
    value = r.get("capacity_ratio")
    return "-" if value is None else num(value) + "x"


def _raw_peak(raw: dict[str, Any]) -> str:
    """The raw run's GPU peak for a table's caption ('' when not recorded)."""
    peak = raw.get("peak_bytes")
    return "" if peak is None else f" GPU peak {num(peak / 2**20, 0)} MiB."


def rank_step_ms(slowest: dict[str, float]) -> float:
    """The slowest rank's step: its whole step as the runtime runs it (``step_ms``),
    or, in result files from before that was measured, its phases timed alone."""
    return slowest.get("step_ms", slowest["total_ms"])


#: Issue 36's LJ targets: (atoms, dtype, grid, what, at least / at most).
LJ_TARGETS = (
    (4_000_000, "float32", "2x1x1", "speedup", 1.85),
    (4_000_000, "float32", "2x2x2", "speedup", 6.5),
    (1_000_188, "float32", "2x1x1", "speedup", 1.7),
    (4_000_000, "float32", "2x1x1", "overhead", 1.15),
)


def lj_targets(rows: list[dict[str, Any]]) -> str:
    """Issue 36's LJ targets against the default layout's rows ('' when none ran)."""
    said = []
    for n, dtype, grid, what, bound in LJ_TARGETS:
        r = next(
            (
                r
                for r in rows
                if r["atoms"] == n
                and r["dtype"] == dtype
                and r.get("grid") == grid
                and r.get("layout", "faces") == "faces"
            ),
            None,
        )
        if r is None:
            continue
        got = r[what]
        ok = got >= bound if what == "speedup" else got <= bound
        ranks = math.prod(int(k) for k in grid.split("x"))
        label = f"{ranks} GPUs" if what == "speedup" else f"overhead on {ranks} ranks"
        sign, unit = (">=", "x") if what == "speedup" else ("<=", "")
        text = (
            f"{atoms(n)} atoms {dtype}, {label}: {num(got)}{unit} "
            f"(target {sign} {bound:g}{unit}: {'met' if ok else 'missed'}"
        )
        if what == "speedup" and not ok:  # where the slowest rank's step goes
            s = r["slowest"]
            share = r["raw_ms"] * r["owned_max"] / n
            text += (
                f"; its slowest rank: model {num(s['model_ms'])} ms against the raw run's"
                f" {num(share)} ms for its share, the halo's work"
                f" {num(rank_step_ms(s) - s['model_ms'])} ms, the wire {num(r['comm_ms'])} ms"
            )
            others = [
                o
                for o in rows
                if o["atoms"] == n
                and o["dtype"] == dtype
                and o.get("layout", "faces") == "faces"
                and o.get("grid") not in (None, grid)
                and math.prod(int(k) for k in o["grid"].split("x")) == ranks
            ]
            text += "".join(f"; grid {o['grid']}: {num(o['speedup'])}x" for o in others)
        said.append(text + ")")
    return "" if not said else "Issue 36's targets (layout `faces`): " + "; ".join(said) + "."


def predicted_scaling(doc: dict[str, Any]) -> str:
    """The P-GPU LJ step predicted from one GPU (benchmarks/predict_scaling.py)."""
    rows = doc["rows"]
    mpnn = doc["name"].endswith("mpnn")
    grid_rows = [r for r in rows if r.get("grid") is not None]
    whole = bool(grid_rows) and all("step_ms" in r["slowest"] for r in grid_rows)
    title = ": the reference MPNN" if mpnn else ""
    out = [
        "## Scaling predicted from one GPU" + title,
        "",
        "Each rank's steady step of a P-rank grid runs on one GPU in turn, on its real",
        "owned and ghost rows"
        + ("" if mpnn else " (its forces on owned atoms checked against the periodic system first)")
        + "; the exchanges are device copies of the same bytes. Predicted",
        "step = slowest rank + communication term (its figures in the note below).",
        "Layout `faces` is the runtime's default (image rows on all six faces);"
        " `split` keeps rows only across split axes and lets the model wrap the"
        " whole ones (`DomainConfig(wrap_whole_axes=True)`).",
    ]
    if whole:
        out += [
            "A rank's step (`step ms`) is its whole steady step run as the runtime runs it:",
            "the decision (skin test, non-finite flag) and its host read, the exchange,",
            "the model on the padded rows, the fold by the runtime's kernel where the",
            "model's spec folds forces (LJ's does not: [0093](decisions/0093-lj-owned-forces.md))"
            + (
                ", captured and split at the host read as the runtime splits it."
                if not mpnn
                else ", eager as the runtime's MPNN steps are."
            ),
            "Model, pack+fold and check ms are the phases timed alone, one at a time (the",
            "pack, fold and check launched eagerly): where the step goes. Their sum was the",
            "prediction's term before; `by phases` is the speed-up it gives (it counts each",
            "eager launch and a drained queue per phase, which a captured step does not pay).",
        ]
    out += [
        "Overhead = slowest rank / (raw x its owned share);",
        "model share = the model's part of the slowest rank's step. `calibrated` scales",
        "each rank's step by runtime / emulated of the one-rank halo step of the same run.",
    ]
    shown = _capacity_shown(rows)
    if shown:
        out.append(CAPACITY_TEXT)
    for cells, dtype in dict.fromkeys((r["cells"], r["dtype"]) for r in rows):
        mine = [r for r in rows if r["cells"] == cells and r["dtype"] == dtype]
        raw = next(r for r in mine if r.get("grid") is None)
        body = []
        calibration = [r for r in mine if r.get("runtime_ms") is not None]
        k = (
            calibration[0]["runtime_ms"] / rank_step_ms(calibration[0]["slowest"])
            if calibration
            else None
        )
        for r in (r for r in mine if r.get("grid") not in (None, "1x1x1")):
            s = r["slowest"]
            step = rank_step_ms(s)
            body.append(
                [
                    r["grid"],
                    r["layout"],
                    atoms(r["owned_max"]),
                    atoms(r["ghost_max"]),
                    num(100 * r["ghost_max"] / r["owned_max"], 0) + " %",
                    num(s["model_ms"]),
                    num(s["exchange_ms"] + s["fold_ms"]),
                    num(s["check_ms"]),
                    *([num(step)] if whole else []),
                    num(r["comm_ms"]),
                    num(r["predicted_ms"]),
                    num(r["speedup"]) + "x",
                    *([num(r["speedup_by_phases"]) + "x"] if whole else []),
                    "" if k is None else num(raw["raw_ms"] / (k * step + r["comm_ms"])) + "x",
                    num(r["overhead"]),
                    num(100 * min(1.0, s["model_ms"] / step), 0) + " %",
                    *([_capacity(r)] if shown else []),
                ]
            )
        header = [
            "grid",
            "ghosts",
            "owned / rank",
            "ghost rows",
            "ghost / owned",
            "model ms",
            "pack+fold ms",
            "check ms",
            *(["step ms"] if whole else []),
            "comm ms",
            "predicted ms",
            "speed-up",
            *(["by phases"] if whole else []),
            "calibrated",
            "overhead",
            "model share",
            *(["holds x of one GPU"] if shown else []),
        ]
        right = [False, False, *[True] * (len(header) - 2)]
        out += [
            "",
            f"**{atoms(raw['atoms'])} atoms, {dtype}**: raw one-GPU step {num(raw['raw_ms'])} ms."
            + _raw_peak(raw)
            + "".join(
                f" One rank with the halo forced: emulated {num(rank_step_ms(c['slowest']))} ms, "
                f"the runtime {num(c['runtime_ms'])} ms."
                for c in calibration
            ),
            "",
            table(header, body, right),
        ]
    gaps = ", ".join(
        f"{num(r['runtime_ms'] / rank_step_ms(r['slowest']), 2)}x in {r['dtype']}"
        for r in rows
        if r.get("runtime_ms") is not None
    )
    if mpnn:
        out += [
            "",
            "The MPNN's ranks run inside a DD context whose ghost rows copy owned rows",
            "(stand-in values, real row counts): its per-layer refreshes cost a gather",
            "each, and the communication term adds one exchange of the ghosts' features",
            "per refresh and per fold; its owned forces are not checked here (the LJ",
            "tables check theirs).",
            "",
            "What holds the speed-up back: little of it is the rows. Under a DD context the",
            "MPNN sends messages to owned receivers only, so an emulated rank pays little",
            "for its ghost rows (overhead near 1). The runtime's own one-rank halo step",
            f"costs {gaps} of its emulation (its decision, plan and split step), which the",
            "calibrated column charges to every rank; at 8 ranks the ghost rows (36-46 % of",
            "owned) and the refresh gathers are what remains.",
            "",
            f"*{source(doc)}*",
            "",
        ]
        return "\n".join(out)
    if whole and all(r.get("receivers") == "owned" for r in grid_rows):
        halo = [rank_step_ms(r["slowest"]) - r["slowest"]["model_ms"] for r in grid_rows]
        comm = [r["comm_ms"] for r in grid_rows]
        target = lj_targets(rows)
        # LJ's own spec (record 0093): owned rows complete, nothing folded, one exchange
        owned = all(r.get("exchanges") == 1 for r in grid_rows)
        out += [
            "",
            "What holds the speed-up back: the model is most of every rank's step (model",
            "share). As under the runtime, a rank's neighbour list holds only the pairs with",
            "an owned end (none between two ghosts) and its ghost rows have no list; the",
            "ghost rows still cost their cell search and skin check"
            + ("" if owned else " and fold")
            + ", a pair across a",
            "rank's face is computed on both sides (half its energy each"
            + (
                "; each side's owned end gets the whole pair force, so nothing is folded"
                " and only the ghosts' positions cross the wire:"
                " [0093](decisions/0093-lj-owned-forces.md)"
                if owned
                else ""
            )
            + "), and at 1M atoms",
            "on 8 ranks each rank's rows under-fill the GPU (more ms per row than the raw",
            "run). The halo's own work in a rank's step (step ms - model ms: the decision",
            "and its host read, pack, wire copy, padded rows"
            + ("" if owned else ", fold")
            + f") is {num(min(halo))} to",
            f"{num(max(halo))} ms, the communication term {num(min(comm))} to {num(max(comm))} ms.",
            "What would remove them: forces of interior atoms computed while the ghosts are",
            "in flight (hides the wire), "
            + (
                "the owned rows written in place into the padded rows (no copy a step), "
                if owned
                else "one fused pack/fold/check kernel, a pair across a face computed once"
                " and its force folded (LAMMPS's `newton on`), "
            )
            + "and (for",
            "2x1x1) the `split` layout (`DomainConfig(wrap_whole_axes=True)`).",
            "The runtime also pays its halo's rebuild steps, which these steady-step",
            "predictions leave out and the `calibrated` column charges (the next section).",
            *(["", target] if target else []),
        ]
    elif all(r.get("receivers") == "owned" for r in grid_rows):
        out += [
            "",
            "What holds the speed-up back: the model is most of every rank's step (model",
            "share). As under the runtime, a rank's neighbour list holds only the pairs with",
            "an owned end (none between two ghosts) and its ghost rows have no list; the",
            "ghost rows still cost their cell search, skin check and fold, and at 1M atoms",
            "on 8 ranks each rank's rows under-fill the GPU (more ms per row than the raw",
            "run). Pack, fold and the skin check are a fixed ~0.2 ms per step, and the wire",
            "term is small on NVLink. What would remove it: forces of interior atoms",
            "computed while the ghosts are in flight, one fused pack/fold/check kernel, and",
            "(for 2x1x1) the `split` layout (`DomainConfig(wrap_whole_axes=True)`).",
            "The runtime also pays its halo's rebuild steps, which these steady-step",
            "predictions leave out and the `calibrated` column charges (the next section).",
        ]
    else:  # a result of the emulation before each rank counted owned receivers only
        out += [
            "",
            "What holds the speed-up back: the model is most of every rank's step (model",
            "share). In this run the emulated ranks counted every row as a receiver, so",
            "their lists also paired ghosts with ghosts and gave ghost rows lists of their",
            "own: work the runtime's ranks do not do (under a DD context the model counts",
            "owned receivers only, record [0047](decisions/0047-lj-warp-kernels.md)), so",
            "the model ms above overstate a rank's. `predict_scaling.py` now runs each rank",
            "with the runtime's receivers; these rows await that rerun. At 1M atoms on 8",
            "ranks each rank's rows also under-fill the GPU (more ms per row than the raw",
            "run). Pack, fold and the skin check are a fixed ~0.2 ms per step, and the wire",
            "term is small on NVLink. What would remove it: forces of interior atoms",
            "computed while the ghosts are in flight, one fused pack/fold/check kernel, and",
            "(for 2x1x1) the `split` layout (`DomainConfig(wrap_whole_axes=True)`).",
        ]
    out += ["", f"*{source(doc)}*", ""]
    return "\n".join(out)


def predicted_scaling_mace(doc: dict[str, Any]) -> str:
    """MACE's P-GPU step predicted from one GPU (predict_scaling.py --model mace)."""
    rows = doc["rows"]
    out = [
        "## Scaling predicted from one GPU: MACE",
        "",
        f"{doc['title']}. As for the MPNN: each rank's model runs inside a DD context",
        "whose ghost rows copy owned rows, with the model's spec adapters installed",
        "(edges into owned rows only, the symmetric contraction on owned rows, one",
        "`node_feats` refresh per interaction after the first); the communication term",
        "adds one exchange of the ghosts' features per refresh and per fold. Eager steps.",
    ]
    shown = _capacity_shown(rows)
    layouts = any("layout" in r for r in rows)  # (older result files: one layout, no field)
    if layouts:
        out.append(
            "Ghosts `faces`: image rows on all six faces (the runtime's default); `split`:"
            " rows only across split axes (`DomainConfig(wrap_whole_axes=True)`)."
        )
    if shown:
        out.append(CAPACITY_TEXT)  # (older result files: one layout, no field)
    head = ["grid", *(["ghosts"] if layouts else []), "owned / rank", "ghost rows", "ghost / owned"]
    head += ["model ms", "comm ms", "predicted ms", "speed-up", "overhead", "model share"]
    head += ["holds x of one GPU"] if shown else []
    for cells, dtype in dict.fromkeys((r["cells"], r["dtype"]) for r in rows):
        mine = [r for r in rows if r["cells"] == cells and r["dtype"] == dtype]
        raw = next(r for r in mine if r.get("grid") is None)
        body = [
            [
                r["grid"],
                *([r.get("layout", "faces")] if layouts else []),
                atoms(r["owned_max"]),
                atoms(r["ghost_max"]),
                num(100 * r["ghost_max"] / r["owned_max"], 0) + " %",
                num(r["slowest"]["model_ms"]),
                num(r["comm_ms"]),
                num(r["predicted_ms"]),
                num(r["speedup"]) + "x",
                num(r["overhead"]),
                num(100 * min(1.0, r["slowest"]["model_ms"] / rank_step_ms(r["slowest"])), 0)
                + " %",
                *([_capacity(r)] if shown else []),
            ]
            for r in mine
            if r.get("grid") is not None
        ]
        out += [
            "",
            f"**{atoms(raw['atoms'])} atoms, {dtype}**: raw one-GPU step {num(raw['raw_ms'])} ms."
            + _raw_peak(raw),
            "",
            table(head, body, [False] * (1 + layouts) + [True] * (len(head) - 1 - layouts)),
        ]
    if shown:
        out += [
            "",
            "What limits the atoms P GPUs hold: a rank's ghost rows take memory as owned rows",
            "do (features of every row, edges of the owned rows). The `split` layout drops the",
            "image rows of the axes the grid leaves whole; in a larger system the ghost shell,",
            "a fixed thickness, is a smaller share of a rank's rows.",
        ]
    return "\n".join([*out, "", f"*{source(doc)}*", ""])


VALIDATE_COMMAND = (
    "python benchmarks/validate_scaling.py --device cuda --model lj --cells 63 "
    "--dtype float32 --ranks 2 4 8"
)


def validation_command(doc: dict[str, Any]) -> str:
    """How the prediction is checked on a multi-GPU host (benchmarks/validate_scaling.py)."""
    return (
        "## Validating the prediction on several GPUs\n\n"
        "On a host with P GPUs, one command predicts each grid's step on GPU 0 as above and\n"
        "then measures it: `DomainParallel` on P ranks over NCCL, the same system, model,\n"
        "dtype, grid, steps and warm-up; the measured step is the slowest rank's step after\n"
        "the warm-up (which holds one rebuild), the halo rebuilds that fall due included and\n"
        "counted (the prediction is a steady step). It prints and writes both side by side:\n"
        "predicted and measured ms, their ratio, the phases both time (model, exchange,\n"
        "fold, check; the measured ones from synchronised phase timers) and the owned and\n"
        "ghost rows of every rank (`--model mpnn` for the MPNN). CI runs it on two gloo CPU\n"
        "ranks; its table appears here once a multi-GPU host has run it.\n\n"
        f"```bash\n{VALIDATE_COMMAND}\n```\n"
    )


def validated_scaling(doc: dict[str, Any]) -> str:
    """The prediction next to the measured P-GPU step (benchmarks/validate_scaling.py)."""
    rows = doc["rows"]
    head = [
        "system",
        "grid",
        "owned / rank",
        "ghost rows (pred. / meas.)",
        "predicted ms",
        "measured ms",
        "measured / predicted",
        "rebuilds in the measured steps",
        "speed-up (pred. / meas.)",
        "model ms (pred. / meas.)",
        "exchange + fold ms (pred. / meas.)",
    ]
    body = []
    for r in rows:
        ph = r["phases"]

        def both(*keys: str, side: str = "", ph: dict[str, Any] = ph) -> str:
            vals = [ph[k][side] for k in keys]
            return "-" if any(v is None for v in vals) else num(sum(vals))

        ghost_p = max(x["ghost"] for x in r["predicted_per_rank"])
        ghost_m = max(x["ghost"] for x in r["measured_per_rank"])
        body.append(
            [
                f"{r['model']} {atoms(r['atoms'])}, {r['dtype']}",
                r["grid"],
                atoms(max(x["owned"] for x in r["measured_per_rank"])),
                f"{atoms(ghost_p)} / {atoms(ghost_m)}",
                num(r["predicted_ms"]),
                num(r["measured_ms"]),
                num(r["ratio"]),
                str(r["measured_rebuilds"]) if r.get("measured_rebuilds") is not None else "-",
                f"{num(r['predicted_speedup'])}x / {num(r['measured_speedup'])}x",
                f"{both('model_ms', side='predicted')} / {both('model_ms', side='measured')}",
                f"{both('exchange_ms', 'fold_ms', side='predicted')} / "
                f"{both('exchange_ms', 'fold_ms', side='measured')}",
            ]
        )
    return (
        "## Scaling prediction against the measured P-GPU step\n\n"
        "Predicted on one GPU (as above) and measured on P GPUs in the same run; ghost rows\n"
        "and owned rows per rank are the largest rank's. The measured steps include the\n"
        "halo rebuilds that fell due in them; the prediction is a steady step.\n\n"
        f"{table(head, body, [False, False] + [True] * 9)}\n\n*{source(doc)}*\n"
    )


def halo_rebuilds(doc: dict[str, Any]) -> str:
    """Steady steps and the halo's rebuild steps on one rank with the halo forced
    (benchmarks/halo_rebuilds.py); one table per file, GPU or CPU."""
    rows = doc["rows"]
    gpu = doc["machine"].get("gpus", 0) > 0
    head = ["atoms", "dtype", "halo skin A", "ghost rows", "raw ms", "halo forced ms"]
    head += ["steady step ms", "rebuild step ms", "rebuilds / 100 steps", "rebuilds add"]
    body = [
        [
            atoms(r["atoms"]),
            short(r["dtype"]),
            num(r["halo_skin"], 1),
            atoms(r["ghosts"]),
            num(r["raw_ms"]),
            num(r["ms_per_step"]),
            num(r["steady_ms"]),
            num(r["rebuild_ms"]) if r["rebuild_ms"] is not None else "-",
            num(100 * r["rebuild_steps"] / r["steps"], 1),
            num(100 * r["rebuild_share"], 1) + " %",
        ]
        for r in rows
    ]
    out = [
        "### The halo's rebuild steps"
        + ("" if gpu else " (CPU, a halo skin thicker than the model's)"),
        "",
    ]
    if gpu:
        rebuilt = [r for r in rows if r["rebuild_ms"] is not None and r["steady_ms"]]
        if rebuilt:
            worst = max(rebuilt, key=lambda r: r["rebuild_share"])
            cost = [
                f"a rebuild step costs up to {num(worst['rebuild_ms'] / worst['steady_ms'], 1)}x"
                " a steady one, and the rebuild steps",
                f"add up to {num(100 * worst['rebuild_share'], 0)} % to the steps' time: a cost the",
            ]
        else:  # (no rebuild fell due in the timed steps: nothing to say about its cost)
            cost = ["no halo rebuild fell due in the timed steps; a rebuild is a cost the"]
        out += [
            "The predictions above time each rank's steady step. The runtime also rebuilds",
            "its halo (migration, a new plan, the model's list on the new rows, the step",
            "captured again) whenever some atom moved more than half the halo's skin. On one",
            "rank with the halo forced, each step timed alone (synchronised) and sorted:",
            *cost,
            "emulation leaves out (the `calibrated` column charges the runtime's whole difference",
            "to every rank). Halo forced ms: the steps timed together (the rebuilds that fell due",
            "included); steady and rebuild step ms: the steps timed alone. What would cut it:",
            "fewer rebuilds (a halo skin thicker than the model's) or cheaper ones (the",
            "host-side plan, the capture after each rebuild).",
        ]
        out += _thicker_halo(rows)
    else:
        out += [
            "`DomainConfig.skin` sets the halo's skin; the model keeps its own"
            f" ({num(rows[0]['model_skin'], 1)} A here)",
            "and checks its list every step, as in one process. A thicker halo skin is exact",
            "(the halo holds every atom the list can reach until an atom moves half the halo's",
            "skin) and trades rebuild steps for ghost rows: on these CPU ranks the halo was",
            "rebuilt "
            + " and ".join(
                f"{r['rebuild_steps']} times (skin {num(r['halo_skin'], 1)})" for r in rows
            )
            + f" in {rows[0]['steps']} steps timed alone; the model rebuilt its",
            "list as often either way (`list_builds`). CPU times do not carry over to a GPU, where a rebuild",
            "step is several steady ones (table above, with the GPU's trade).",
        ]
    out += ["", table(head, body, [True, False] + [True] * (len(head) - 2))]
    return "\n".join([*out, "", f"*{source(doc)}*", ""])


def _change(new: float, old: float) -> str:
    """``"3.7 % slower"`` or ``"1.2 % faster"``: a time against its baseline."""
    pct = 100 * (new / old - 1)
    return f"{num(abs(pct), 1)} % " + ("slower" if pct >= 0 else "faster")


def _thicker_halo(rows: list[dict[str, Any]]) -> list[str]:
    """The GPU's trade of a halo skin thicker than the model's, per system size,
    read from the rows (empty when every row has the model's skin)."""
    lines = []
    for r in rows:
        if r["halo_skin"] == r["model_skin"]:
            continue
        base = next(
            (b for b in rows if b["atoms"] == r["atoms"] and b["dtype"] == r["dtype"]
             and b["halo_skin"] == b["model_skin"]),
            None,
        )  # fmt: skip
        if base is None:
            continue
        lines.append(
            f"at {atoms(r['atoms'])} atoms a halo skin of {num(r['halo_skin'], 1)} A"
            f" (the model's {num(r['model_skin'], 1)}) rebuilt the halo {r['rebuild_steps']}"
            f" times instead of {base['rebuild_steps']} and held"
            f" {num(100 * (r['ghosts'] / base['ghosts'] - 1), 0)} % more ghost rows,"
            f" its steady step {_change(r['steady_ms'], base['steady_ms'])},"
            f" all steps together {num(base['ms_per_step'])} ->"
            f" {num(r['ms_per_step'])} ms"
            f" ({num(100 * (r['ms_per_step'] / base['ms_per_step'] - 1), 1)} %)"
        )
    if not lines:
        return []
    return ["", "On this GPU, " + "; ".join(lines) + "."]
