"""The whole DD path on a device, guarded on the CPU (issue 12).

No GPU in CI: the fake accelerator of ``nvdd.testing`` (real CPU values, CUDA-like
device checks, NCCL-like collectives) runs partition, migration, halo rebuilds,
hooks of every scope, a rebalance, gather and to_global, for LJ and the MPNN, on
periodic, triclinic, open, mixed and two-system batches. Any operator that mixes
the atoms' device with the CPU raises; the results must equal the CPU run (to
rounding: the Warp LJ kernel sums with atomics).
"""

from __future__ import annotations

import pytest
import torch
from it_device import cpu_and_fake, host_syncs_per_step

from nvdd.testing import run_ranks

pytestmark = pytest.mark.gloo

CASES = [
    (2, "periodic", "lj", "halo"),
    (3, "triclinic", "lj", "halo"),
    (2, "slab", "lj", "halo"),
    (2, "cluster", "lj", "halo"),
    (2, "two", "lj", "halo"),
    (2, "triclinic", "lj-virials", "halo"),  # per-atom (n, 3, 3) extras migrate too
    (2, "periodic", "mpnn2", "halo"),
    (2, "periodic", "mpnn3-device", "halo"),  # the device edges, a middle layer
    (1, "two", "mpnn2-device", "halo"),  # ... on the whole batch (one rank)
    (3, "two", "mpnn2", "graph_partition"),
]


@pytest.mark.parametrize(
    ("world", "kind", "model", "strategy"),
    CASES,
    ids=[f"{c[2]}-{c[1]}-{c[0]}-{c[3]}" for c in CASES],
)
def test_dd_run_on_a_device_equals_the_cpu_run(
    world: int, kind: str, model: str, strategy: str
) -> None:
    out = run_ranks(cpu_and_fake, world, kind, model, strategy, timeout_s=600)
    for rank, (cpu, fake) in enumerate(out):
        assert fake["whole_device"] == "meta", f"rank {rank}: to_global left the device"
        # (the Warp LJ kernel sums with atomics: equal to rounding, not bit for bit)
        for key in ("local", "global"):
            torch.testing.assert_close(
                torch.tensor(fake["hooks"][key]),
                torch.tensor(cpu["hooks"][key]),
                rtol=1e-12,
                atol=0,
            )
        assert fake["rebuilds"] == cpu["rebuilds"]
    cpu, fake = out[0]
    assert fake["hooks"]["zero"] == ["meta"] * len(cpu["hooks"]["zero"]) != []
    assert fake["device"] == "meta"
    assert torch.equal(cpu["ids"], fake["ids"])
    for key in ("positions", "forces", "energy", "stress"):
        torch.testing.assert_close(fake[key], cpu[key], rtol=1e-12, atol=1e-12, msg=key)
    assert fake["extras"].keys() == cpu["extras"].keys()
    assert ("atom_virials" in cpu["extras"]) == (model == "lj-virials")
    for key, value in cpu["extras"].items():
        torch.testing.assert_close(fake["extras"][key], value, rtol=1e-12, atol=1e-12, msg=key)


def test_a_steady_dd_step_makes_the_device_wait_once() -> None:
    """Between rebuilds, the DD wrapper reads the device once per step: the
    verdict of the one small all-reduce (skin used up / non-finite). The
    partitioner's domain and pbc stay on the device (they were copied from the
    host twice per step before: four stream synchronisations on a GPU). What the
    model itself reads (here the torch LJ path's Verlet test) is not counted."""
    out = run_ranks(host_syncs_per_step, 2, "periodic", "lj", timeout_s=300)
    for rank, r in enumerate(out):
        assert r["steady_rebuilds"] == 0, f"rank {rank}: the steady window rebuilt"
        # the build's domain cell is derived once per build, the current one only
        # when the cell changed (here it never does)
        assert r["steady_domain_calls"] == 0, r["steady_domain_calls"]
        wrapper = [e for e in r["steady"] if " at models/" not in e]
        # one read of the step's decision per step, plus the finite check at the
        # end of run() (forces of the last step), which reads the same way
        reads = [e for e in wrapper if "(read_decision)" in e]
        assert len(reads) == r["steps"] + 1, wrapper
        others = [e for e in wrapper if "(read_decision)" not in e]
        assert others == [], others
        # the recorder does see host work: a rebuild step migrates and plans
        assert any(" at partition/" in e for e in r["rebuild"]), r["rebuild"]
        # ... but moves no per-atom or per-ghost data through the host: only
        # counts, boxes and flags (O(ranks x systems) values)
        assert r["n_owned"] > 40, r["n_owned"]
        copies = [e for e in r["rebuild"] if " copy of " in e and " at models/" not in e]
        sizes = [int(e.split(" copy of ")[1].split()[0]) for e in copies]
        assert copies and max(sizes) <= 32, copies
        # and batches them: migration reads once (its all-reduced counts); the
        # ghost selection's module four times (its flags, bounds, boxes and cell,
        # with the inputs' value checks: system range and cell; the kernels'
        # packed inputs; their counts and overflow; the fill's overflow), where
        # each small read or write used to drain the stream alone (about 30 in
        # a rebuild before; six until the value checks joined the first read)
        migrate = [e for e in r["rebuild"] if " at partition/" in e]
        assert len(migrate) == 1 and "(_all_reduce)" in migrate[0], migrate
        select = [e for e in r["rebuild"] if " at halo/_select.py" in e]
        assert len(select) <= 4, select
        assert not any("check_plan" in e for e in select), select


@pytest.mark.parametrize("integrator", ["nvt-nh", "npt-iso", "npt-full"])
def test_a_steady_nose_hoover_step_reads_only_its_divergence_flag(integrator: str) -> None:
    """NVT-NH and MTK NPT under DD keep their chains (and NPT its cell momentum
    and cell) on the device: a steady step reads what a velocity-Verlet step
    reads (the decision) plus the integrator's divergence flag, once per step.
    That read goes through ``LazyFiniteCheck``: on CUDA a non-blocking copy
    polled with an event (no stream wait); on this fake device, which has no
    events, it is read at once, so it is visible here. NPT's cell changes every
    step: the skin test derives the current domain cell on the device."""
    out = run_ranks(host_syncs_per_step, 2, "periodic", "lj", 6, integrator, timeout_s=300)
    for rank, r in enumerate(out):
        assert r["steady_rebuilds"] == 0, f"rank {rank}: the steady window rebuilt"
        wrapper = [e for e in r["steady"] if " at models/" not in e]
        reads = [e for e in wrapper if "(read_decision)" in e]
        assert len(reads) == r["steps"] + 1, wrapper
        # the decision is read in _step.py (read_decision); the flag, in _finite.py
        at_finite = [e for e in wrapper if e.startswith("scalar read at dynamics/_finite.py")]
        flags = [e for e in at_finite if e not in reads]
        assert len(flags) == r["steps"], wrapper
        others = [e for e in wrapper if e not in reads and e not in flags]
        assert others == [], others


def test_a_steady_fire_step_reads_only_its_convergence_test() -> None:
    """FIRE keeps its adaptive state (time step, mixing, the downhill count) on the
    device and decides there: a steady step reads the decision, as a
    velocity-Verlet step does, plus the convergence test after the step (the
    largest force, all-reduced), and nothing else (the power and norms it read
    every step before stay on the device)."""
    out = run_ranks(host_syncs_per_step, 2, "periodic", "lj", 6, "fire", timeout_s=300)
    for rank, r in enumerate(out):
        assert r["steady_rebuilds"] == 0, f"rank {rank}: the steady window rebuilt"
        wrapper = [e for e in r["steady"] if " at models/" not in e]
        reads = [e for e in wrapper if "(read_decision)" in e]
        assert len(reads) == r["steps"] + 1, wrapper
        # once before the first step (a converged start takes none), once after each
        tests = [e for e in wrapper if "(max_force)" in e]
        assert len(tests) == r["steps"] + 1, wrapper
        others = [e for e in wrapper if e not in reads and e not in tests]
        assert others == [], others
