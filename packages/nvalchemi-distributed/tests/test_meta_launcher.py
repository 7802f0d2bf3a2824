"""`nvdd run` as a rank of an outside torchrun job (several nodes): the job's size
is the launcher's (``WORLD_SIZE``), so ``--grid`` counts the job's ranks and
``--device cuda`` the node's (``LOCAL_WORLD_SIZE``), whatever ``--nproc`` says."""

from __future__ import annotations

import pytest
import torch

from nvalchemi.distributed.cli import main


def test_a_rank_of_a_multi_node_job_checks_against_the_job_and_its_node(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # rank 9 of 4 nodes x 8 GPUs; --cutoff -1 stops it before any rank starts
    for name, value in (("RANK", "9"), ("WORLD_SIZE", "32"), ("LOCAL_WORLD_SIZE", "8")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert main(["run", "--device", "cuda", "--grid", "4", "4", "2", "--cutoff", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--cutoff must be > 0 A" in err
    assert "--grid" not in err and "GPU(s)" not in err, err  # 32 boxes, 8 ranks per node
    assert main(["run", "--device", "cuda", "--grid", "2", "2", "2", "--cutoff", "-1"]) == 2
    assert "--grid 2 2 2 has 8 boxes but --nproc is 32" in capsys.readouterr().err
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "9")
    assert main(["run", "--device", "cuda", "--cutoff", "-1"]) == 2
    assert "9 ranks on this node but only 8 GPU(s) here" in capsys.readouterr().err
