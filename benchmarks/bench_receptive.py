"""The gain of per-layer refresh adapters over the receptive-field safe path (issue 37).

One message-passing model of ``L`` layers, two ways, on the same system and
ranks (CPU, gloo):

- ``safe``: written as on one process (every row a receiver, the energy summed
  over every row it is given, forces by its own autograd), run unmodified under
  ``receptive_field_spec(L)``: a halo of ``2 L cutoff + skin``, owned-row forces;
- ``fold``: the same model returning its atom energies differentiable w.r.t.
  the positions it is given, under ``receptive_field_spec(L, fold=True)``: a
  halo of ``L cutoff + skin``, the owned energies' gradient folded;
- ``adapters``: the same layers with owned receivers, the energy of owned
  rows, and ``neighbor_refresh_adapters`` refreshing ghost rows after each
  layer, under ``SPEC_MPNN_HALO``: a halo of ``cutoff + skin``.

Each runs ``--warmup`` velocity-Verlet steps, then ``--steps`` steps timed one
by one (steady state: the halo is rebuilt only when the skin is used up); a
path's time is the median step of its fastest of ``--rounds`` runs (the paths
alternate). Forces of each are checked against one process. Writes
``benchmarks/results/receptive-field-cpu.json`` (``--out``).

    OMP_NUM_THREADS=1 python -m benchmarks.bench_receptive --cells 5 8 --steps 20
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from nvdd.core import Batch
from nvdd.models import NeighborList
from nvdd.shardtensor import current_dd_context
from nvdd.spec import (
    SPEC_MPNN_HALO,
    BaseModelMixin,
    DistributionSpec,
    MLIPSpec,
    StrategyKind,
    neighbor_refresh_adapters,
    receptive_field_spec,
)


class Layer(torch.nn.Module):
    """``h_i <- h_i + sum_j w_ij h_j`` over the given edges."""

    def forward(
        self, h: torch.Tensor, w: torch.Tensor, recv: torch.Tensor, send: torch.Tensor
    ) -> torch.Tensor:
        return h + torch.zeros_like(h).index_add(0, recv, w[:, None] * h[send])


class BenchMP(BaseModelMixin, torch.nn.Module):
    """``layers`` message-passing layers; ``adapted``: owned receivers and energy
    (the per-layer refresh comes from the spec's adapters)."""

    def __init__(self, cutoff: float, layers: int, adapted: bool, fold: bool = False) -> None:
        super().__init__()
        self.rc, self.adapted, self.fold = cutoff, adapted, fold
        self.layers = torch.nn.ModuleList([Layer() for _ in range(layers)])
        self.neighbors = NeighborList(cutoff)

    @property
    def cutoff(self) -> float:
        return self.rc

    def distribution_spec(self, strategy: StrategyKind = StrategyKind.HALO) -> MLIPSpec:
        if not self.adapted:
            return receptive_field_spec(len(self.layers), strategy, fold=self.fold)
        refresh = DistributionSpec(helpers=neighbor_refresh_adapters(Layer))
        return SPEC_MPNN_HALO | MLIPSpec(distribution=refresh, name="MPNN + refresh adapters")

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        ctx = current_dd_context()
        n = int(batch.positions.shape[0])
        owned = ctx.layout.n_owned if self.adapted and ctx.layout is not None else n
        given = self.fold and batch.positions.requires_grad  # (the runtime's leaf)
        pos = batch.positions if given else batch.positions.detach().requires_grad_(True)
        edges = self.neighbors(
            pos.detach(), batch.cell, batch.pbc, batch.system_index, n_receivers=owned
        )
        r = edges.vectors(pos, batch.cell, batch.system_index).norm(dim=1)
        w = (1 - r / self.rc) ** 2
        h = torch.ones(n, 1, dtype=pos.dtype)
        for layer in self.layers:
            h = layer(h, w, edges.receivers, edges.senders)
        e_atom = h[:, 0] ** 2
        if given:  # the runtime differentiates the owned rows' energies
            return {"energy": e_atom.sum().reshape(1), "atom_energies": e_atom}
        (grad,) = torch.autograd.grad(e_atom[:owned].sum(), pos)
        energy = e_atom.detach()[:owned].sum().reshape(1)  # (not compared here)
        return {"energy": energy, "forces": -grad}


def argon(cells: int) -> Batch:
    from ase.build import bulk

    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat((cells, cells, cells))
    atoms.rattle(0.05, seed=3)
    atoms.set_velocities(
        torch.randn(len(atoms), 3, generator=torch.Generator().manual_seed(1)).numpy() * 0.005
    )
    return Batch.from_ase(atoms, dtype=torch.float64)


def _rank(kind: str, cells: int, cutoff: float, layers: int, warmup: int, steps: int) -> Any:
    from nvdd.dynamics import DomainConfig, DomainParallel, VelocityVerlet

    model = BenchMP(cutoff, layers, adapted=kind == "adapters", fold=kind == "fold")
    batch = argon(cells)
    dyn = VelocityVerlet(model, batch, dt_fs=2.0)
    config = DomainConfig(cutoff=cutoff, skin=0.5, verify_model=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with DomainParallel(dyn, config) as dp:
            dp.partition()
            first = dp.gather(0)
            dp.run(warmup)
            times = []
            for _ in range(steps):  # each step alone: its median resists a shared machine
                torch.distributed.barrier()
                t0 = time.perf_counter()
                dp.run(1)
                torch.distributed.barrier()
                times.append(time.perf_counter() - t0)
            seconds = float(torch.tensor(times).median())
            rows = (dp.stats.n_owned, dp.stats.n_ghost, dp.stats.rebuilds, dp.model.ghost_width)
    forces = None if first is None else first.forces[torch.argsort(first.atom_ids)]
    return {"seconds": seconds, "rows": rows, "forces": forces}


def main(argv: list[str] | None = None) -> int:
    from benchmarks import harness
    from nvdd.dynamics import VelocityVerlet
    from nvdd.testing import run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", type=int, nargs="+", default=[5, 8])
    p.add_argument("--cutoff", type=float, default=4.0)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=harness.RESULTS)
    args = p.parse_args(argv)
    kinds = ("safe", "fold", "adapters")
    rows = []
    for cells in args.cells:
        batch = argon(cells)
        ref = VelocityVerlet(BenchMP(args.cutoff, args.layers, adapted=False), batch.clone())
        ref.ensure_forces()
        f_ref = ref.batch.forces[torch.argsort(ref.batch.atom_ids)]
        runs: dict[str, list[Any]] = {k: [] for k in kinds}
        for _ in range(args.rounds):  # the paths alternate; each keeps its fastest round
            for kind in kinds:
                got = run_ranks(
                    _rank,
                    args.world,
                    kind,
                    cells,
                    args.cutoff,
                    args.layers,
                    args.warmup,
                    args.steps,
                    timeout_s=1800,
                )
                runs[kind].append(got)
        for kind in kinds:
            got = min(runs[kind], key=lambda g: max(r["seconds"] for r in g))
            per_rank = [g["rows"] for g in got]
            rows.append(
                {
                    "path": kind,
                    "atoms": batch.n_atoms,
                    "world": args.world,
                    "layers": args.layers,
                    "cutoff_A": args.cutoff,
                    "ghost_width_A": per_rank[0][3],
                    "owned_rows": [r[0] for r in per_rank],
                    "ghost_rows": [r[1] for r in per_rank],
                    "rebuilds": per_rank[0][2],
                    "steps": args.steps,
                    "rounds": args.rounds,
                    "ms_per_step": 1e3 * max(g["seconds"] for g in got),
                    "ms_per_step_rounds": [1e3 * max(r["seconds"] for r in g) for g in runs[kind]],
                    "max_abs_dF": float((got[0]["forces"] - f_ref).abs().max()),
                }
            )
            print(rows[-1])
        for r in rows[-3:-1]:
            gain = r["ms_per_step"] / rows[-1]["ms_per_step"]
            print(f"{batch.n_atoms} atoms: adapters' gain over {r['path']}: {gain:.2f}x")
    command = (
        "OMP_NUM_THREADS=1 python -m benchmarks.bench_receptive "
        f"--cells {' '.join(map(str, args.cells))} --cutoff {args.cutoff} --layers {args.layers} "
        f"--world {args.world} --warmup {args.warmup} --steps {args.steps} "
        f"--rounds {args.rounds}"
    )
    path = harness.write_result(
        "receptive-field-cpu",
        title="Refresh adapters against the receptive-field safe path (CPU ranks)",
        command=command,
        rows=rows,
        benchmark="python",
        out_dir=args.out,
        note="measured on a 2-core machine shared with other work: read the ratio, not the times",
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
