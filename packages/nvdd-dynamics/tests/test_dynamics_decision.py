"""The step's local decision in one kernel (``_step.local_code``) against a torch
oracle written here, its torch fallback, and the reduced code over gloo ranks."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from nvdd.dynamics import _step
from nvdd.dynamics._step import (
    MAX_COORDINATE,
    MODEL_GROWS,
    NONFINITE,
    REBUILD,
    STEADY,
    decision_code,
    local_code,
    nonfinite_flag,
)
from nvdd.testing import run_ranks

N = 37


def _rows(dtype: torch.dtype, seed: int = 0, n: int = N) -> SimpleNamespace:
    gen = torch.Generator().manual_seed(seed)
    return SimpleNamespace(
        positions=10 * torch.randn(n, 3, generator=gen, dtype=dtype),
        velocities=torch.randn(n, 3, generator=gen, dtype=dtype),
        forces=torch.randn(n, 3, generator=gen, dtype=dtype),
    )


def _oracle(
    rows: Any,
    moved: torch.Tensor | None = None,
    reference: torch.Tensor | None = None,
    limit2: float = 0.0,
    bad: int = NONFINITE,
) -> int:
    """The code, row by row on the host in float64 (an independent oracle)."""
    pos, vel, f = (t.double().tolist() for t in (rows.positions, rows.velocities, rows.forces))
    finite = all(abs(x) < MAX_COORDINATE for p in pos for x in p) and all(
        torch.isfinite(torch.tensor(t)).all() for t in (vel, f)
    )
    if not finite:
        return bad
    if moved is not None and int(moved.reshape(())) != 0:
        return REBUILD
    if reference is not None:
        for p, r in zip(pos, reference.double().tolist(), strict=True):
            if sum((a - b) ** 2 for a, b in zip(p, r, strict=True)) > limit2:
                return REBUILD
    return STEADY


def _launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the decision kernel's launches (made at first use)."""
    local_code(_rows(torch.float64))  # (the launcher exists from here on)
    seen: list[int] = []
    kernel = _step._DECISION[0]

    class Counted:
        def __call__(self, *a: Any, **k: Any) -> None:
            seen.append(1)
            kernel(*a, **k)

    monkeypatch.setattr(_step, "_DECISION", [Counted()])
    return seen


def _cases(dtype: torch.dtype) -> list[tuple[str, SimpleNamespace, dict[str, Any]]]:
    base = _rows(dtype)
    ref = base.positions.clone()
    near = base.positions + 0.01  # moved 0.0173 A in every row
    cases: list[tuple[str, SimpleNamespace, dict[str, Any]]] = [
        ("steady", base, {}),
        ("steady, within the skin", SimpleNamespace(**{**vars(base), "positions": near}),
         {"reference": ref, "limit2": 0.02**2}),
        ("one row past the skin", SimpleNamespace(**{**vars(base), "positions": near}),
         {"reference": ref, "limit2": 0.017**2}),
        ("moved flag", base, {"moved": torch.ones((), dtype=torch.int32)}),
        ("moved flag zero", base, {"moved": torch.zeros(1, dtype=torch.int32)}),
        ("flag one instead of NONFINITE", base, {"bad": 1}),
    ]  # fmt: skip
    last = SimpleNamespace(**{**vars(base), "positions": base.positions.clone()})
    last.positions[N - 1, 2] += 1.0  # only the last row moved
    cases.append(("last row moved", last, {"reference": ref, "limit2": 0.5**2}))
    for field, row, value in (
        ("positions", 0, float("nan")),
        ("positions", N - 1, float("-inf")),
        ("positions", 5, 2 * MAX_COORDINATE),
        ("velocities", 7, float("inf")),
        ("forces", N - 1, float("nan")),
    ):
        broken = SimpleNamespace(**{k: v.clone() for k, v in vars(base).items()})
        getattr(broken, field)[row, 1] = value
        # a non-finite value outranks a move (and the flag value is the caller's)
        cases.append((f"{field}[{row}] = {value}", broken, {"reference": ref, "limit2": 0.0}))
        cases.append((f"{field}[{row}] = {value}, bad 1", broken, {"bad": 1}))
    return cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_one_kernel_gives_the_oracle_s_code(dtype: torch.dtype, monkeypatch: Any) -> None:
    launches = _launches(monkeypatch)
    cases = _cases(dtype)
    for name, rows, kw in cases:
        got = local_code(rows, **kw)  # type: ignore[arg-type]
        assert got.dtype == torch.int32 and got.shape == (1,), name
        assert int(got) == _oracle(rows, **kw), name
    assert len(launches) == len(cases)  # every case took the kernel
    codes = {int(local_code(rows, **kw)) for _, rows, kw in cases}  # type: ignore[arg-type]
    assert codes == {STEADY, 1, REBUILD, NONFINITE}  # (the cases reach every outcome)


def test_mixed_float_types_take_torch_and_give_the_same_codes(monkeypatch: Any) -> None:
    launches = _launches(monkeypatch)
    for name, rows, kw in _cases(torch.float32):
        mixed = SimpleNamespace(**{**vars(rows), "velocities": rows.velocities.double()})
        assert int(local_code(mixed, **kw)) == _oracle(rows, **kw), name  # type: ignore[arg-type]
    empty = _rows(torch.float64, n=0)
    assert int(local_code(empty, moved=torch.ones(1, dtype=torch.int32))) == REBUILD  # type: ignore[arg-type]
    assert int(local_code(empty)) == STEADY  # type: ignore[arg-type]
    assert launches == []


def test_every_row_past_the_skin_still_gives_one_rebuild() -> None:
    rows = _rows(torch.float32, n=20_000)
    ref = rows.positions - 1.0
    assert int(local_code(rows, reference=ref, limit2=0.25)) == REBUILD  # type: ignore[arg-type]


def test_the_flag_and_the_code_rank_as_the_step_reads_them() -> None:
    rows = _rows(torch.float64)
    assert nonfinite_flag(rows).shape == () and int(nonfinite_flag(rows)) == 0  # type: ignore[arg-type]
    rows.velocities[3, 0] = float("nan")
    assert int(nonfinite_flag(rows)) == 1  # type: ignore[arg-type]
    grows = torch.ones((), dtype=torch.int32)
    assert int(decision_code(None, grows, rows, None, on=None)) == NONFINITE  # type: ignore[arg-type]
    rows = _rows(torch.float64)
    ref = rows.positions - 1.0
    assert int(decision_code(None, grows, rows, None, on=None)) == MODEL_GROWS  # type: ignore[arg-type]
    code = decision_code(None, grows, rows, None, on=None, reference=ref, limit2=0.25)  # type: ignore[arg-type]
    assert int(code) == REBUILD


def _rank_codes(case: str) -> list[int]:
    import torch.distributed as dist

    rank = dist.get_rank()
    rows = _rows(torch.float64, seed=rank)
    ref = rows.positions.clone()
    if case == "one rank moved" and rank == 1:
        rows.positions[4] += 1.0
    if case == "one rank non-finite" and rank == 0:
        rows.forces[2, 2] = float("inf")
    code = decision_code(None, None, rows, dist.group.WORLD, reference=ref, limit2=0.25)  # type: ignore[arg-type]
    return [int(code)]


@pytest.mark.parametrize(
    ("case", "expected"),
    [("steady", STEADY), ("one rank moved", REBUILD), ("one rank non-finite", NONFINITE)],
)
def test_the_code_is_the_maximum_over_ranks(case: str, expected: int) -> None:
    """**Collective**: every rank reads the largest of the ranks' codes (gloo)."""
    got = run_ranks(_rank_codes, 2, case)
    assert got == [[expected], [expected]]


def test_on_the_fake_accelerator_the_kernel_runs_reads_nothing_and_refuses_mixing(
    monkeypatch: Any,
) -> None:
    """The CUDA path on the CPU: on ``nvdd.testing``'s fake accelerator the code
    is the kernel's (launch counted) and the oracle's, makes no host read, and a
    reference left on the CPU is refused as CUDA would refuse it."""
    from nvdd.testing import DeviceMixingError, fake_accelerator, record_host_syncs, to_fake

    launches = _launches(monkeypatch)
    cases = _cases(torch.float32)
    with fake_accelerator() as dev:
        for name, rows, kw in cases:
            fake = SimpleNamespace(**{k: to_fake(v) for k, v in vars(rows).items()})
            fake_kw = {k: to_fake(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
            with record_host_syncs() as syncs:
                got = local_code(fake, **fake_kw)  # type: ignore[arg-type]
            assert syncs == [], (name, syncs)
            assert got.device == dev
            assert int(got) == _oracle(rows, **kw), name
        rows = _rows(torch.float32)
        fake = SimpleNamespace(**{k: to_fake(v) for k, v in vars(rows).items()})
        with pytest.raises(DeviceMixingError):
            local_code(fake, reference=rows.positions.clone(), limit2=0.25)  # type: ignore[arg-type]
    assert len(launches) == len(cases) + 1
