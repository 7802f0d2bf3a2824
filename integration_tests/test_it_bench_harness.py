"""The benchmark harness on CPU: a suite at --quick sizes, alone and as an A/B of
two source trees alternated in one run, writes result files the page renderer
reads (command, commit, machine and versions inside)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import harness, render, suite  # noqa: E402  (the repository root)


def test_time_steps_warms_up_then_times_the_steps() -> None:
    calls: list[int] = []
    ms = harness.time_steps(calls.append, steps=4, warmup=2, device="cpu")
    assert calls == [2, 4]
    assert ms >= 0.0
    with pytest.raises(ValueError, match="steps must be > 0"):
        harness.time_steps(calls.append, steps=0, warmup=0, device="cpu")


def test_argon_fcc_is_the_lattice_at_rest_on_average() -> None:
    batch = harness.argon_fcc(2)
    assert batch.n_atoms == 32
    assert float(batch.velocities.mean(dim=0).abs().max()) < 1e-15
    assert float(batch.cell[0, 0, 0]) == pytest.approx(2 * harness.AR_LATTICE)


def test_a_result_file_carries_its_provenance(tmp_path: Path) -> None:
    path = harness.write_result(
        "unit",
        title="t",
        command="python benchmarks/x.py",
        rows=[{"ms_per_step": math.nan, "atoms": 4}],
        benchmark="x.py",
        out_dir=tmp_path,
    )
    doc = json.loads(path.read_text())
    assert doc["rows"] == [{"ms_per_step": None, "atoms": 4}]
    assert doc["commit"] and doc["machine"]["cpu_cores"] and doc["versions"]["torch"]
    assert render.load_results(tmp_path)["unit"]["command"] == "python benchmarks/x.py"


def test_the_uma_aimnet2_and_sevennet_torchsim_sections_appear_only_with_their_files(
    tmp_path: Path,
) -> None:
    """bench_peer_models.py's result files (UMA, AIMNet2, SevenNet against torch-sim) each render
    their own section, with the targets from the rows; without the files, none."""
    assert "against torch-sim" not in render.render({})
    for model in ("uma", "aimnet2", "sevennet"):
        rows = [
            {
                "leg": leg,
                "phase": "timed",
                "atoms": 8000,
                "steps": 50,
                "warmup": 15,
                "status": "ok",
                "ms_per_step": ms,
                "peak_mb": [2048.0],
            }
            for leg, ms in (("plain", 40.0), ("dd1", 42.0), ("peer", 40.0))
        ]
        rows += [
            {
                "leg": "dd1",
                "phase": "search",
                "atoms": 16000,
                "steps": 3,
                "warmup": 1,
                "status": "ok",
                "ms_per_step": 80.0,
                "peak_mb": [4096.0],
            },
            {
                "leg": "peer",
                "phase": "search",
                "atoms": 16000,
                "steps": 3,
                "warmup": 1,
                "status": "OOM",
                "error": "CUDA out of memory",
            },
        ]
        harness.write_result(
            f"{model}-1gpu-torchsim",
            title="t",
            command="python benchmarks/bench_peer_models.py",
            rows=rows,
            benchmark="benchmarks/bench_peer_models.py",
            out_dir=tmp_path,
        )
    page = render.render(render.load_results(tmp_path))
    for label, cls in (
        ("UMA", "UMAModel"),
        ("AIMNet2", "AIMNet2Model"),
        ("SevenNet", "SevenNetModel"),
    ):
        section = page.split(f"## {label} on one GPU against torch-sim")[1].split("\n## ")[0]
        assert f"nvdd plain (VelocityVerlet + {cls})" in section
        assert "**1.05x** the step time" in section and "(target <= 1.1: met)" in section
        assert "**2.00x** torch-sim's (target >= 1: met)" in section
        assert "| OOM at 16,000 |" in section
    assert "Other result files" not in page


def test_a_quick_suite_alternates_two_trees_in_one_run(tmp_path: Path) -> None:
    (path,) = suite.run_suite("neighbors", quick=True, ab="HEAD", rounds=1, out_dir=tmp_path)
    doc = json.loads(path.read_text())
    assert path.name == "neighbors-row-order-ab-quick.json"
    assert doc["base_commit"] == "HEAD"
    assert [(r["leg"], r["round"]) for r in doc["rows"]] == [("base", 0), ("new", 0)]
    for row in doc["rows"]:
        assert row["atoms"] == 108
        assert row["nvdd_c1_ms"] > 0 and row["pairs_equal"] is True
    assert "--cells 3" in doc["command"]


def test_the_scaling_predictor_runs_each_ranks_real_rows(tmp_path: Path) -> None:
    import torch

    from benchmarks import predict_scaling as ps

    assert ps.main(["--quick", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "scaling-predicted-lj.json").read_text())
    raw, faces, split = doc["rows"]
    assert raw["ranks"] == 1 and raw["raw_ms"] > 0
    for row in (faces, split):
        assert row["grid"] == "2x1x1" and row["ranks"] == 2
        assert sum(r["owned"] for r in row["per_rank"]) == raw["atoms"] == 256
        assert row["max_force_err"] < 1e-12  # owned forces = the periodic system's
        assert row["check_force_max"] > 1e-3  # (displaced atoms: forces that can differ)
        assert row["receivers"] == "owned"  # each rank's list as under the runtime
        assert all(r["pairs"] > 0 for r in row["per_rank"])
        assert row["bytes_per_exchange"] == row["ghost_max"] * 3 * 8
        # the prediction's term: the slowest rank's whole step, one decision read a step
        slowest = max(row["per_rank"], key=lambda r: r["step_ms"])
        assert row["slowest"]["step_ms"] == slowest["step_ms"] > 0
        assert row["predicted_ms"] == pytest.approx(slowest["step_ms"] + row["comm_ms"])
        assert row["predicted_by_phases_ms"] == pytest.approx(
            max(r["total_ms"] for r in row["per_rank"]) + row["comm_ms"]
        )
        assert all(r["decision_reads"] == 3 + 1 + 1 for r in row["per_rank"])  # steps, warm-up, t=0
    # rows only across the split axis: fewer ghosts than images on every face
    assert split["ghost_max"] < faces["ghost_max"]
    # GPU peaks per run and the capacity they predict: recorded on CUDA, None on the CPU
    cuda = torch.cuda.is_available()
    assert "peak_bytes" in raw and (raw["peak_bytes"] > 0 if cuda else raw["peak_bytes"] is None)
    for row in (faces, split):
        assert all("peak_bytes" in r for r in row["per_rank"])
        assert "capacity_ratio" in row and "peak_bytes_max" in row
        assert (row["capacity_ratio"] > 0) if cuda else row["capacity_ratio"] is None
    page = render.render(render.load_results(tmp_path))
    assert "## Scaling predicted from one GPU" in page
    assert "holds only the pairs with\nan owned end (none between two ghosts)" in page
    assert "holds x of one GPU |" in page and "Holds = how many atoms" in page
    assert "| step ms | comm ms | predicted ms | speed-up | by phases |" in page
    if not cuda:  # the column says no peak was recorded
        assert "| 2x1x1 | faces |" in page and "| - |" in page

    # the MPNN: its ranks inside a DD context, feature refreshes on the wire
    assert ps.main(["--quick", "--model", "mpnn", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "scaling-predicted-mpnn.json").read_text())
    raw, faces, split = doc["rows"]  # split: y and z periodic under the DD context
    assert faces["model"] == "mpnn" and faces["layout"] == "faces"
    assert split["layout"] == "split" and 0 < split["ghost_max"] < faces["ghost_max"]
    assert sum(r["owned"] for r in faces["per_rank"]) == raw["atoms"]
    assert faces["comm_ms"] > 2 * 20e-3 + 2 * 20e-3  # positions, forces, a refresh and its fold
    assert "the reference MPNN" in render.render(render.load_results(tmp_path))

    # the force check can fail: a ghost layer thinner than the cutoff misses pairs
    batch = harness.argon_fcc(4, dtype=torch.float64)
    model = ps._model("cpu", torch.float64)
    full = model(batch)["forces"]
    frac = torch.remainder(batch.positions @ torch.linalg.inv(batch.cell[0]), 1.0)
    thin = 0.5 * (ps.CUTOFF + ps.SKIN) / batch.cell[0].diagonal()
    owned, src, shift = ps.rank_rows(frac, (2, 1, 1), (0, 0, 0), thin)
    assert ps.check_rank(model, full, owned, ps.local_system(batch, owned, src, shift)) > 1e-6


def test_issue_36s_targets_are_judged_from_the_rows() -> None:
    """``render_scaling.lj_targets``: each target that has a row of the default
    layout is said met or missed from that row, a missed speed-up with where its
    slowest rank's step goes and the other grids of as many ranks; rows of other
    layouts, sizes or precisions do not count; no row, no sentence."""
    from benchmarks.render_scaling import lj_targets

    def row(n: int, grid: str, speedup: float, overhead: float, layout: str = "faces") -> Any:
        ranks = math.prod(int(k) for k in grid.split("x"))
        return {"atoms": n, "dtype": "float32", "grid": grid, "layout": layout,
                "speedup": speedup, "overhead": overhead, "raw_ms": 8.0, "owned_max": n // ranks,
                "comm_ms": 0.04, "slowest": {"model_ms": 1.1, "step_ms": 1.25, "total_ms": 1.3}}  # fmt: skip

    rows = [
        row(4_000_000, "2x1x1", 1.90, 1.20),
        row(4_000_000, "2x2x2", 6.40, 1.30),
        row(4_000_000, "4x2x1", 6.60, 1.20),
        row(4_000_000, "2x2x2", 7.00, 1.10, layout="split"),  # not the default layout
        row(1_000_188, "2x1x1", 1.70, 1.00),
    ]
    said = lj_targets(rows)
    assert "4,000,000 atoms float32, 2 GPUs: 1.90x (target >= 1.85x: met)" in said
    assert (
        "4,000,000 atoms float32, 8 GPUs: 6.40x (target >= 6.5x: missed; its slowest rank: "
        "model 1.10 ms against the raw run's 1.00 ms for its share, the halo's work 0.15 ms, "
        "the wire 0.04 ms; grid 4x2x1: 6.60x)"
    ) in said
    assert "1,000,188 atoms float32, 2 GPUs: 1.70x (target >= 1.7x: met)" in said
    assert "overhead on 2 ranks: 1.20 (target <= 1.15: missed)" in said
    assert lj_targets([row(1_000_188, "2x2x1", 3.0, 1.0)]) == ""


def test_the_capacity_ratio_is_p_times_bytes_per_atom_over_the_worst_ranks() -> None:
    """``predict_scaling.capacity_ratio`` with fake peaks: P x (raw bytes per atom) /
    the largest rank's bytes per owned atom; None where a peak is missing. The
    scaling tables show it as a column only for results that record it."""
    from benchmarks import predict_scaling as ps
    from benchmarks import render_scaling

    ranks = [{"owned": 50, "peak_bytes": 600}, {"owned": 50, "peak_bytes": 550}]
    # 10 bytes an atom on one GPU, 12 per owned atom on the worse rank: 2 x 10 / 12
    assert ps.capacity_ratio(1000, 100, ranks) == pytest.approx(2 * 10 / 12)
    even = [{"owned": 25, "peak_bytes": 250}] * 4  # no ghost tax: P times the atoms
    assert ps.capacity_ratio(1000, 100, even) == pytest.approx(4.0)
    assert ps.capacity_ratio(None, 100, ranks) is None  # the CPU: no peaks
    assert ps.capacity_ratio(1000, 100, [*ranks, {"owned": 50, "peak_bytes": None}]) is None

    def doc(raw_extra: dict[str, object], grid_extra: dict[str, object]) -> dict[str, Any]:
        raw = {"model": "mace", "cells": 48, "dtype": "float32", "atoms": 100, "raw_ms": 2.0}
        grid = {**raw, "grid": "2x1x1", "owned_max": 50, "ghost_max": 10, "comm_ms": 0.1}
        grid.update(predicted_ms=1.1, speedup=1.8, overhead=1.0)
        grid["slowest"] = {"model_ms": 1.0, "total_ms": 1.0}
        return {
            "name": "scaling-predicted-mace",
            "title": "MACE",
            "command": "python benchmarks/predict_scaling.py --model mace",
            "commit": "abc1234",
            "machine": {"kind": "test"},
            "versions": {},
            "rows": [raw | raw_extra, grid | grid_extra],
        }

    page = render_scaling.predicted_scaling_mace(
        doc({"peak_bytes": 3 * 2**20}, {"capacity_ratio": 1.666})
    )
    assert "| holds x of one GPU |" in page and "| 1.67x |" in page
    assert "GPU peak 3 MiB" in page and "Holds = how many atoms" in page
    assert "| - |" in render_scaling.predicted_scaling_mace(doc({}, {"capacity_ratio": None}))
    before = render_scaling.predicted_scaling_mace(doc({}, {}))  # a result file from before
    assert "holds x" not in before and "GPU peak" not in before and "Holds =" not in before


def test_forget_lists_drops_the_models_cached_neighbour_lists() -> None:
    """``predict_scaling.forget_lists`` (before each measured run, so that its GPU
    peak counts its own list): LJ's Warp list and the MPNN's Verlet list are gone
    after it."""
    import torch

    from benchmarks import predict_scaling as ps

    batch = harness.argon_fcc(3, dtype=torch.float64)
    lj, mpnn = ps._model("cpu", torch.float64), ps._model("cpu", torch.float64, "mpnn")
    lj(batch), mpnn(batch)
    assert lj.device_neighbors._state is not None and mpnn.neighbors._candidates is not None
    ps.forget_lists(lj), ps.forget_lists(mpnn)
    assert lj.device_neighbors._state is None and mpnn.neighbors._candidates is None


@pytest.mark.parametrize("grid", [(2, 1, 1), (2, 2, 2)], ids=["2x1x1", "2x2x2"])
def test_an_emulated_lj_rank_lists_no_ghost_pair_and_folds_to_the_whole_system(
    grid: tuple[int, int, int],
) -> None:
    """The LJ model as an emulated rank runs it (``scaling_ranks.Owned``: the
    runtime's owned receivers) lists only pairs with an owned end, never two
    ghosts, and no ghost row; fewer entries than the every-row list the
    emulation ran before. Folded over the ranks (ghost forces into their owners,
    partials summed), the ranks give the whole periodic system's forces, energy,
    virial and atom energies (fp64)."""
    import itertools

    import torch

    from benchmarks import predict_scaling as ps
    from benchmarks import scaling_ranks as sr

    batch = harness.argon_fcc(4, dtype=torch.float64)  # 256 atoms, box 21 A
    kick = torch.randn(batch.positions.shape, generator=torch.Generator().manual_seed(3))
    moved = (batch.positions + 0.2 * kick.double()) @ torch.linalg.inv(batch.cell[0])
    batch = batch.replace(positions=torch.remainder(moved, 1.0) @ batch.cell[0])  # in the box
    ref = ps._model("cpu", torch.float64)(batch)
    assert float(ref["forces"].abs().max()) > 1e-2
    width = (ps.CUTOFF + ps.SKIN) / batch.cell[0].diagonal()
    frac = torch.remainder(batch.positions @ torch.linalg.inv(batch.cell[0]), 1.0)
    forces = torch.zeros_like(ref["forces"])
    atom_energies = torch.zeros_like(ref["atom_energies"])
    energy, virial = torch.zeros_like(ref["energy"]), torch.zeros_like(ref["virial"])
    for coords in itertools.product(*(range(k) for k in grid)):
        owned, src, shift = ps.rank_rows(frac, grid, coords, width)
        local = ps.local_system(batch, owned, src, shift)
        n = owned.numel()
        rank = sr.Owned(ps._model("cpu", torch.float64), n)
        out = rank(local)
        matrix = rank.device_neighbors(
            local.positions, local.cell, local.pbc, local.system_index, n_receivers=n
        )
        i, j, _ = matrix.pairs()
        assert matrix.n_rows == n and bool((i < n).all())  # no ghost row has a list
        assert int(((i >= n) & (j >= n)).sum()) == 0  # no pair of two ghosts
        every_row = ps._model("cpu", torch.float64).device_neighbors(
            local.positions, local.cell, local.pbc, local.system_index
        )
        ei, ej, _ = every_row.pairs()
        assert int(((ei >= n) & (ej >= n)).sum()) > 0  # what the emulation listed before
        assert ps.list_pairs(rank, local, n) == i.numel() == int(((ei < n) | (ej < n)).sum())
        rows = torch.cat([owned, src])
        forces.index_add_(0, rows, out["forces"])
        atom_energies.index_add_(0, owned, out["atom_energies"][:n])
        assert float(out["atom_energies"][n:].abs().max()) == 0
        energy += out["energy"]
        virial += out["virial"]
    scale = float(ref["forces"].abs().max())
    assert float((forces - ref["forces"]).abs().max()) <= 1e-10 * scale
    torch.testing.assert_close(atom_energies, ref["atom_energies"], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(energy, ref["energy"], rtol=1e-12, atol=0)
    torch.testing.assert_close(virial, ref["virial"], rtol=1e-10, atol=1e-10)


def test_an_emulated_lj_rank_holds_its_ghost_rows_at_rest() -> None:
    """``scaling_ranks.hold_ghosts``: steps of an emulated rank move its owned
    rows and leave its ghost rows where they are (on a rank they move only with
    the exchange; drifting under -dE_local/dx they would rebuild the list more
    often than the runtime does)."""
    import torch

    from benchmarks import predict_scaling as ps
    from benchmarks import scaling_ranks as sr
    from nvdd.dynamics import VelocityVerlet

    batch = harness.argon_fcc(4, dtype=torch.float64)
    width = (ps.CUTOFF + ps.SKIN) / batch.cell[0].diagonal()
    frac = torch.remainder(batch.positions @ torch.linalg.inv(batch.cell[0]), 1.0)
    owned, src, shift = ps.rank_rows(frac, (2, 1, 1), (0, 0, 0), width)
    n = owned.numel()
    local = sr.hold_ghosts(ps.local_system(batch, owned, src, shift), n)
    assert float(local.velocities[n:].abs().max()) == 0 and bool((local.masses[:n] < 100).all())
    start = local.positions.clone()
    dyn = VelocityVerlet(sr.Owned(ps._model("cpu", torch.float64), n), local, dt_fs=ps.DT_FS)
    dyn.run(3)
    moved = (dyn.batch.positions - start).abs().amax(dim=1)
    assert float(moved[:n].max()) > 1e-3
    assert float(moved[n:].max()) < 1e-20


@pytest.mark.parametrize(
    ("warp_fold", "forces"),
    [(False, "ghost"), (True, "ghost"), (False, "owned")],
    ids=["index-add", "warp-fold", "owned-rows"],
)
def test_an_emulated_rank_step_makes_the_halo_work_and_keeps_the_dynamics(
    warp_fold: bool, forces: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``scaling_ranks.RankStep`` (a rank's whole step, the prediction's term)
    reads one decision a step, eager and captured (the split of the runtime,
    through the CPU emulation of a capture), folds each ghost's force into its
    owner where the model's spec folds (LJ asked for ``-dE_local/dx`` on ghost
    rows under ``SPEC_LJ_HALO``; ``warp-fold``: the runtime's CUDA fold kernel,
    reached on the CPU) and not where its owned rows are complete (LJ's own
    spec), and leaves the dynamics of the model it wraps unchanged: the padded
    rows it builds are the rows the integrator holds."""
    import torch

    from benchmarks import predict_scaling as ps
    from benchmarks import scaling_ranks as sr
    from nvdd.core import emulated_capture
    from nvdd.dynamics import VelocityVerlet
    from nvdd.halo import _plan
    from nvdd.spec import SPEC_LJ_HALO

    if warp_fold:
        monkeypatch.setattr(_plan, "FOLD_WITH_WARP", ("cuda", "cpu"))

    class GhostForces(sr.Owned):
        """LJ with ``-dE_local/dx`` on its ghost rows, under the folding preset."""

        def __call__(self, batch: Any) -> Any:
            return self.inner(batch, n_receivers=self.n_owned, ghost_forces=True)

        def distribution_spec(self, strategy: Any = "halo") -> Any:
            return SPEC_LJ_HALO

    def wrapped(model: Any, n: int) -> Any:
        return GhostForces(model, n) if forces == "ghost" else sr.Owned(model, n)

    batch = harness.argon_fcc(4, dtype=torch.float64)
    width = (ps.CUTOFF + ps.SKIN) / batch.cell[0].diagonal()
    frac = torch.remainder(batch.positions @ torch.linalg.inv(batch.cell[0]), 1.0)
    owned, src, shift = ps.rank_rows(frac, (2, 1, 1), (0, 0, 0), width)
    n = owned.numel()

    def local() -> Any:
        return sr.hold_ghosts(ps.local_system(batch, owned, src, shift), n)

    def rank(captured: bool) -> Any:
        inner = wrapped(ps._model("cpu", torch.float64), n)
        return sr.RankStep(
            inner, n, batch.positions.clone(), src, shift, static=local(),
            skin=ps.SKIN, captured=captured,
        )  # fmt: skip

    def owned_rows() -> Any:  # the integrator's rows on a rank: the owned ones
        return local().select(torch.arange(n))

    plain = VelocityVerlet(wrapped(ps._model("cpu", torch.float64), n), local(), dt_fs=ps.DT_FS)
    plain.run(4)
    eager = rank(captured=False)
    assert eager.folds is (forces == "ghost")
    dyn = VelocityVerlet(eager, owned_rows(), dt_fs=ps.DT_FS)
    dyn.run(4)
    assert eager.reads == 5  # t = 0 and four steps
    assert dyn.batch.n_atoms == n  # (the integrator holds the owned rows alone)
    want_pos = plain.batch.positions[:n]
    torch.testing.assert_close(dyn.batch.positions, want_pos, rtol=0, atol=1e-12)
    torch.testing.assert_close(dyn.batch.forces, plain.batch.forces[:n], rtol=0, atol=1e-12)
    if forces == "owned":  # owned rows complete: the ghost rows carry nothing to fold
        assert eager.folded is None and eager.ghost_forces is None
        assert float(plain.batch.forces[n:].abs().max()) == 0
    else:  # the fold: each ghost's force (the last call's) summed into its owner
        ghost_f = eager.ghost_forces
        assert ghost_f is not None
        torch.testing.assert_close(ghost_f, plain.batch.forces[n:], rtol=0, atol=1e-12)
        _, owner = torch.unique(src, return_inverse=True)
        want = torch.zeros(int(owner.max()) + 1, 3, dtype=ghost_f.dtype)
        want.index_add_(0, owner, ghost_f)
        assert float(want.abs().max()) > 1e-3
        assert eager.folded is not None
        torch.testing.assert_close(eager.folded[: want.shape[0]], want, rtol=1e-12, atol=1e-12)
        assert bool((eager.folded[want.shape[0] :] == 0).all())
    with emulated_capture():
        split = rank(captured=True)
        assert split.splits_step
        graphs = VelocityVerlet(split, owned_rows(), dt_fs=ps.DT_FS, cuda_graphs=True)
        graphs.run(4)
    assert graphs.graphs.replays > 0  # the steady steps replayed, split at the host read
    assert split.reads == 5
    torch.testing.assert_close(graphs.batch.positions, want_pos, rtol=0, atol=1e-12)


def test_the_rebuild_step_benchmark_sorts_every_step_and_renders(tmp_path: Path) -> None:
    from benchmarks import halo_rebuilds as hr

    argv = ["--cells", "5", "--steps", "30", "--halo-skin", "1.0", "2.0", "--out", str(tmp_path)]
    assert hr.main(argv) == 0
    doc = json.loads((tmp_path / "halo-rebuilds-lj.json").read_text())
    same, thick = doc["rows"]
    assert (same["halo_skin"], thick["halo_skin"], same["model_skin"]) == (1.0, 2.0, 1.0)
    for r in (same, thick):
        assert r["steady_steps"] + r["rebuild_steps"] + r["other_steps"] == r["steps"] == 30
        assert r["other_steps"] == 0  # (nothing is captured on a CPU)
        assert len(r["forced_rebuild_ms"]) == len(r["after_rebuild_ms"]) == hr.FORCED
        assert r["atoms"] == 500
        # a timing: on a loaded CPU a rebuild step can come out faster than the
        # steady mean (a negative share); only the bound from the mean is structural
        assert r["rebuild_share"] == hr.rebuild_share(r, 30) and r["rebuild_share"] < 1
    assert thick["ghosts"] > same["ghosts"]  # a thicker halo holds more rows
    share = hr.rebuild_share(
        {"rebuild_steps": 2, "rebuild_ms": 5.0, "steady_ms": 1.0, "synced_ms": 1.5}, 10
    )
    assert math.isclose(share, 2 * 4.0 / 15.0)
    from benchmarks import render_scaling

    # the GPU's sentence on a thicker halo says which way a steady step moved
    assert render_scaling._change(0.98, 1.0) == "2.0 % faster"
    assert render_scaling._change(1.037, 1.0) == "3.7 % slower"
    # a GPU run in which no halo rebuild fell due: said so, not "up to 1.0x"
    gpu_doc = json.loads((ROOT / "benchmarks/results/halo-rebuilds-lj.json").read_text())
    assert gpu_doc["machine"]["gpus"] > 0
    for r in gpu_doc["rows"]:
        r.update(rebuild_steps=0, rebuild_ms=None, rebuild_share=0.0)
    text = render_scaling.halo_rebuilds(gpu_doc)
    assert "no halo rebuild fell due in the timed steps" in text and "costs up to" not in text
    page = render.render(render.load_results(tmp_path))
    assert "### The halo's rebuild steps (CPU" in page and "| 500 | fp32 | 2.0 |" in page
