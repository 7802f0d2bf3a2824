"""A small DomainParallel job with one injected fault (run under torchrun).

Usage: ``torchrun --nproc-per-node 2 fault_job.py FAULT [cuda]`` with FAULT one of
``kill`` (rank 1 SIGKILLs itself mid-step), ``kill-busy`` (the same while rank 0
is busy in Python, outside any collective, so the launcher's SIGTERM reaches it
before a collective could fail), ``hang`` (rank 1 sleeps in a hook), ``raise``
(the model's forward raises on rank 1), ``none``; ``cuda`` runs one rank per GPU
over NCCL (the same checks on a GPU host).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from it_systems import LJ_CUTOFF, crystal, lj_model

from nvdd.core import init_distributed
from nvdd.dynamics import DomainConfig, DomainParallel, HookStage, VelocityVerlet

FAULT_STEP = 3


class FaultyModel:
    """The LJ model, except that its forward raises on rank 1 at the fault step."""

    def __init__(self, rank: int, device: Any) -> None:
        self.inner, self.rank, self.calls = lj_model().to(device), rank, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, batch: Any) -> Any:
        self.calls += 1
        if self.rank == 1 and self.calls == FAULT_STEP + 1:
            raise RuntimeError("injected fault in the model forward")
        return self.inner(batch)


def main(fault: str, device: str = "cpu") -> None:
    env = init_distributed(backend="nccl" if device == "cuda" else "gloo")
    model: Any = FaultyModel(env.rank, env.device) if fault == "raise" else lj_model()
    if fault != "raise":
        model = model.to(env.device)
    dyn = VelocityVerlet(model, crystal("long").to(env.device), dt_fs=4.0)

    def hook(ctx: Any) -> None:
        if ctx.step == FAULT_STEP and env.rank == 1:
            if fault in ("kill", "kill-busy"):
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "hang":
                time.sleep(300)
        if ctx.step == FAULT_STEP and env.rank == 0 and fault == "kill-busy":
            time.sleep(30)  # busy (a long force computation, say) when rank 1 dies

    with DomainParallel(dyn, DomainConfig(cutoff=LJ_CUTOFF, skin=0.5)) as dp:
        dp.register_hook(HookStage.BEFORE_COMPUTE, hook)
        dp.partition()
        dp.run(8)
        final = dp.gather(0)
    if final is not None:
        print(f"finished {final.n_atoms} atoms", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
