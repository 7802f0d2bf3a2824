"""The one-GPU sections against torch-sim (issue 37 item 3) of docs/benchmarks.md:
MACE, and UMA / AIMNet2 / SevenNet through one table builder. Part of
``benchmarks/render.py``; standard library only."""

from __future__ import annotations

from typing import Any

from benchmarks.render_table import (
    atoms,
    ms,
    num,
    ratio,
    source,
    table,
)

TORCHSIM_LEGS = {
    "plain": "nvdd plain (VelocityVerlet + MACEModel)",
    "dd1": "nvdd DomainParallel, 1 GPU",
    "peer": "torch-sim, its default neighbour list",
    "peer-cell": "torch-sim, nvalchemiops cell list",
}


def mace_vs_torchsim(doc: dict[str, Any]) -> str:
    """MACE on one GPU: nvdd plain and DomainParallel against torch-sim (bench_peer_torchsim.py)."""
    intro = (
        "## MACE on one GPU against torch-sim\n\n"
        "The same random-weight MACE, silica-like system, initial velocities and 0.5 fs NVE\n"
        "velocity-Verlet step in every leg, each leg in its own process: nvdd's plain model,\n"
        "nvdd under `DomainParallel` on one GPU, and torch-sim's MD loop (`nve_init`, then\n"
        "`nve_step`) with its MACE wrapper (forces only). "
    )
    return _vs_torchsim(doc, intro, TORCHSIM_LEGS)


PEER_MODELS = {
    "uma": (
        "UMA",
        "UMAModel",
        "fairchem's `FairChemModel` (its batch predictor, its own radius graph)",
        "silica-like O/Si box",
    ),
    "aimnet2": (
        "AIMNet2",
        "AIMNet2Model",
        "aimnet's `AIMNet2TorchSim` around an `AIMNet2Calculator` (float32)",
        "periodic box of water molecules",
    ),
    "sevennet": (
        "SevenNet",
        "SevenNetModel",
        "sevenn's own torch-sim `SevenNetModel` (float32, SevenNet's force module)",
        "silica-like O/Si box",
    ),
}


def model_vs_torchsim(doc: dict[str, Any]) -> str:
    """UMA, AIMNet2 or SevenNet on one GPU against torch-sim (bench_peer_models.py):
    the model of the result file's name."""
    label, cls, peer, system = PEER_MODELS[doc["name"].split("-")[0]]
    intro = (
        f"## {label} on one GPU against torch-sim\n\n"
        f"The same random-weight {label} (one model file, loaded by every leg), {system},\n"
        "initial velocities and 0.5 fs NVE velocity-Verlet step in every leg, each leg in its\n"
        f"own process: nvdd's plain `{cls}`, nvdd under `DomainParallel` on one GPU, and\n"
        f"torch-sim's MD loop (`nve_init`, then `nve_step`) with {peer}. "
    )
    legs = {
        "plain": f"nvdd plain (VelocityVerlet + {cls})",
        "dd1": TORCHSIM_LEGS["dd1"],
        "peer": f"torch-sim, {label}'s own interface",
    }
    return _vs_torchsim(doc, intro, legs)


def _vs_torchsim(doc: dict[str, Any], intro: str, legs: dict[str, str]) -> str:
    """The torch-sim comparison of one result file: timed rows, targets, largest systems."""
    rows = doc["rows"]
    timed = [r for r in rows if r.get("phase") == "timed"]
    ok = {r["leg"]: r for r in timed if r.get("status") == "ok"}
    peers = [ok[leg] for leg in ("peer", "peer-cell") if leg in ok]
    best = min(peers, key=lambda r: r["ms_per_step"]) if peers else None
    body = []
    for r in timed:
        peak = max(r.get("peak_mb") or [0]) / 1024 if r.get("status") == "ok" else None
        body.append(
            [
                legs.get(r["leg"], r["leg"]),
                atoms(r["atoms"]),
                str(r["steps"]),
                num(ms(r), 1) if r.get("status") == "ok" else r.get("status", ""),
                num(peak, 2),
                ratio(ms(r), ms(best)) if r.get("status") == "ok" else "",
            ]
        )
    head = ["leg", "atoms", "timed steps", "ms/step", "peak GiB", "/ faster torch-sim"]
    big = []
    largest: dict[str, int] = {}
    for leg in legs:
        mine = [r for r in rows if r["leg"] == leg and r.get("phase") == "search"]
        if not mine:
            continue
        ran = [r["atoms"] for r in rows if r["leg"] == leg and r.get("status") == "ok"]
        failed = [r for r in mine if r.get("status") != "ok"]
        largest[leg] = max(ran, default=0)
        nxt = f"{failed[0]['status']} at {atoms(failed[0]['atoms'])}" if failed else "not reached"
        big.append([legs[leg], atoms(largest[leg]) if ran else "none", nxt])
    lines = []
    if best and "dd1" in ok:
        r = ok["dd1"]["ms_per_step"] / best["ms_per_step"]
        lines.append(
            f"- DomainParallel on one GPU takes **{r:.2f}x** the step time of the faster "
            f"torch-sim leg (target <= 1.1: {'met' if r <= 1.1 else 'not met'})."
        )
    peer_big = max(largest.get("peer", 0), largest.get("peer-cell", 0))
    if largest.get("dd1") and peer_big:
        r = largest["dd1"] / peer_big
        lines.append(
            f"- Its largest system is **{r:.2f}x** torch-sim's "
            f"(target >= 1: {'met' if r >= 1 else 'not met'})."
        )
    first = timed[0] if timed else rows[0]
    out = (
        intro + f"{first['steps']} steps timed after {first['warmup']}\n"
        "of warm-up, one device synchronisation around them; the ratio column divides by the\n"
        "faster torch-sim leg.\n\n"
        f"{table(head, body, [False, True, True, True, True, True])}\n\n"
    )
    if lines:
        out += "\n".join(lines) + "\n\n"
    if big:
        out += (
            "Largest system: doubled (one axis at a time, a few steps each) until out of\n"
            'memory, or the search\'s time budget ran out ("not reached").\n\n'
            f"{table(['leg', 'largest that ran', 'next size'], big, [False, True, False])}\n\n"
        )
    return out + f"{source(doc)}\n"
