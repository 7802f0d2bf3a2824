"""Write the checkpoints of ``test_dynamics_checkpoint_compat.py`` with an older nvdd.

Issue 35 asks that checkpoints written before the step was rewritten still
load. This script ran once under the packages of commit 031bb92 (the commit
issue 35 was filed at), from a worktree of it::

    git worktree add /tmp/ab031 031bb92
    cd /tmp/ab031/packages/nvdd-dynamics/tests
    PYTHONPATH=$(ls -d /tmp/ab031/packages/*/src | tr '\\n' ':'):. \\
        python /work/main/packages/nvdd-dynamics/tests/data/make_old_checkpoints.py OUT

For each ensemble it runs the checkpoint test's system on 2 gloo ranks, saves at
step 4 and runs 6 steps more (``ckpt_ranks.run_and_save``), then writes
``OUT/ckpt-031bb92-KIND/`` (the checkpoint, as saved) and
``OUT/ckpt-031bb92-KIND.final.npz`` (the uninterrupted run's state at step 10,
plain arrays: what a restart by today's code must reach).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
from ckpt_ranks import run_and_save

from nvdd.testing import run_ranks

#: The ensembles whose checkpoints are kept (state beyond positions and
#: velocities: Nose-Hoover chains, and the barostat's cell momentum too).
KINDS = ("nve", "nvt-nh", "npt-full")


def main(out: str) -> None:
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    for kind in KINDS:
        path = root / f"ckpt-031bb92-{kind}"
        shutil.rmtree(path, ignore_errors=True)
        _, final = run_ranks(run_and_save, 2, kind, 4, 6, str(path), timeout_s=120)[0]
        arrays = {
            k: final[k].numpy()
            for k in ("atom_ids", "positions", "velocities", "forces", "energy", "cell")
        }
        if "conserved" in final:
            arrays["conserved"] = final["conserved"].numpy()
        arrays["step_count"] = np.array(final["scalars"]["step_count"])
        np.savez(root / f"ckpt-031bb92-{kind}.final.npz", **arrays)


if __name__ == "__main__":
    main(sys.argv[1])
