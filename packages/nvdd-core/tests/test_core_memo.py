"""`TensorMemo`: identity and version, held weakly, forgotten by pickling."""

from __future__ import annotations

import pickle

import torch

from nvdd.core import TensorMemo


def test_memo_sees_identity_and_in_place_changes() -> None:
    t = torch.zeros(3)
    memo = TensorMemo()
    assert not memo.same(t) and not memo.same(None)
    memo.remember(t)
    assert memo.same(t) and not memo.same(t.clone()) and not memo.same(None)
    t.add_(0.0)  # same values, new version
    assert not memo.same(t)


def test_memo_survives_pickling_by_forgetting() -> None:
    t = torch.ones(2)
    memo = TensorMemo()
    memo.remember(t)
    copy = pickle.loads(pickle.dumps(memo))
    assert memo.same(t) and not copy.same(t)
