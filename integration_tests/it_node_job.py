"""One worker of the two-node test (test_it_multinode.py): ``nvdd run`` as one
rank of an outside torchrun job, then what the worker saw of the job.

Usage (by torchrun): ``it_node_job.py REPORT_DIR run [nvdd run options]``. Writes
``REPORT_DIR/worker-<RANK>.json``: the launcher's rank variables, the intra-op
threads this rank ran with, and ``nvdd run``'s exit status; then ends as the
``nvdd`` command ends a rank.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from nvalchemi.distributed._stop import end_finished_rank
from nvalchemi.distributed.cli import main

_ENV = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")

if __name__ == "__main__":
    report = Path(sys.argv[1])
    rc = main(sys.argv[2:])
    seen = {k: os.environ.get(k) for k in _ENV}
    seen.update(rc=rc, threads=torch.get_num_threads(), cwd=os.getcwd())
    (report / f"worker-{os.environ['RANK']}.json").write_text(json.dumps(seen))
    end_finished_rank(rc)  # as ``nvdd`` ends a rank (record 0091)
