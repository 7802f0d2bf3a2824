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


def test_a_memo_pickled_under_its_former_module_loads() -> None:
    """A pickle made before `TensorMemo` moved beside `Batch` names
    ``nvdd.core._memo.TensorMemo``; it still loads (a checkpoint's model holds
    memos), as the same class."""
    from nvdd.core import _batch

    # (protocol 0 names the class as text, so the module can be renamed in place)
    old = pickle.dumps(TensorMemo(), protocol=0).replace(b"nvdd.core._batch", b"nvdd.core._memo")
    assert b"nvdd.core._memo" in old
    memo = pickle.loads(old)
    assert type(memo) is _batch.TensorMemo is TensorMemo
    t = torch.zeros(1)
    memo.remember(t)
    assert memo.same(t)
