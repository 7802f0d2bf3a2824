"""Each Warp kernel against its pure-torch reference (cpu; cuda marked gpu)."""

from __future__ import annotations

import pytest
import torch

from nvdd.core import ValidationError
from nvdd.halo import _kernels, _reference

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _inputs(device: str, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random atoms of two systems, four ranks, mixed pbc, wide boxes."""
    g = torch.Generator().manual_seed(seed)
    n, n_sys, world = 57, 2, 4
    frac = (torch.rand(n, 3, generator=g, dtype=torch.float64) * 1.4 - 0.2).to(dtype)
    system = torch.randint(0, n_sys, (n,), generator=g)
    lo = torch.rand(n_sys, world, 3, generator=g, dtype=torch.float64) * 0.8 - 0.3
    width = torch.rand(n_sys, world, 3, generator=g, dtype=torch.float64) * 3.0 + 0.3
    elo, ehi = lo, lo + width
    periodic = torch.tensor([[1, 1, 0], [1, 0, 1]], dtype=torch.int32)
    elo[0, 0, 2] = -torch.inf  # an open outermost box
    ehi[1, 3, 1] = torch.inf
    cand_rank = torch.tensor([0, 1, 3], dtype=torch.int32)
    cand_ok = torch.tensor([[1, 1, 1], [1, 0, 1]], dtype=torch.int32)
    out = {
        "frac": frac,
        "system": system,
        "cand_rank": cand_rank,
        "cand_ok": cand_ok,
        "elo": elo.to(dtype),
        "ehi": ehi.to(dtype),
        "periodic": periodic,
    }
    return {k: v.to(device).contiguous() for k, v in out.items()}


@pytest.mark.parametrize("device", DEVICES)
def test_compute_fractional_matches_torch(device: str, float_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    pos = (torch.randn(33, 3, generator=g, dtype=torch.float64) * 5).to(float_dtype).to(device)
    system = torch.randint(0, 2, (33,), generator=g).to(device)
    cell = torch.tensor(
        [[[5.0, 0, 0], [1, 6, 0], [0.5, -1, 7]], [[4.0, 0, 0], [0, 4, 0], [0, 0, 9]]]
    )
    inv = torch.linalg.inv(cell).to(float_dtype).to(device).contiguous()
    frac, bad = _kernels.compute_fractional(pos, system, inv)
    ref, ref_bad = _reference.compute_fractional_torch(pos, system, inv)
    tol = 1e-12 if float_dtype == torch.float64 else 1e-5
    torch.testing.assert_close(frac, ref, atol=tol, rtol=tol)
    assert int(bad) == int(ref_bad) == 0
    pos[4, 1] = float("inf")
    _, bad = _kernels.compute_fractional(pos, system, inv)
    assert int(bad) == 1
    # a system index out of range reads nothing and outranks a non-finite position
    pos[4, 1] = 1.0
    for wrong in (-1, 2, 1 << 40):
        system_bad = system.clone()
        system_bad[7] = wrong
        frac, bad = _kernels.compute_fractional(pos, system_bad, inv)
        ref, ref_bad = _reference.compute_fractional_torch(pos, system_bad, inv)
        assert int(bad) == int(ref_bad) == 2
        assert bool((frac[7] == 0).all()) and bool((ref[7] == 0).all())
        keep = torch.arange(33, device=device) != 7
        torch.testing.assert_close(frac[keep], ref[keep], atol=tol, rtol=tol)
        pos[3, 0] = float("nan")
        assert int(_kernels.compute_fractional(pos, system_bad, inv)[1]) == 2
        pos[3, 0] = 0.5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("my_rank", [0, 1, 2])
def test_count_and_fill_match_torch(device: str, float_dtype: torch.dtype, my_rank: int) -> None:
    a = _inputs(device, float_dtype, seed=my_rank)
    args = (a["frac"], a["system"], a["cand_rank"], a["cand_ok"], a["elo"], a["ehi"], a["periodic"])
    counts, overflow = _kernels.count_images(*args, my_rank)
    ref, ref_overflow = _reference.count_images_torch(*args, my_rank)
    assert counts.dtype == torch.int32 and counts.shape == (3, 57)
    assert torch.equal(counts, ref) and int(overflow) == int(ref_overflow) == 0
    assert int(counts.sum()) > 60 and int(counts.max()) > 1  # several images per pair
    flat = counts.reshape(-1).long()
    offsets = (torch.cumsum(flat, 0) - flat).reshape(counts.shape)
    ids = (torch.arange(57, device=device) * 5 + 2).contiguous()
    total = int(flat.sum())
    meta, fill_overflow = _kernels.fill_images(
        args[0], args[1], ids, *args[2:], my_rank, offsets, total
    )
    ref_meta, _ = _reference.fill_images_torch(
        args[0], args[1], ids, *args[2:], my_rank, offsets, total
    )
    assert int(fill_overflow) == 0
    assert torch.equal(meta, ref_meta)
    # The self image n = 0 never appears for my_rank's own box.
    own = torch.repeat_interleave(a["cand_rank"].long(), counts.long().sum(1)) == my_rank
    assert not bool((own & (meta[:, 1:4] == 0).all(dim=1)).any())


@pytest.mark.parametrize("device", DEVICES)
def test_overflow_flags_instead_of_truncation(device: str) -> None:
    a = _inputs(device, torch.float64)
    args = (a["frac"], a["system"], a["cand_rank"], a["cand_ok"], a["elo"], a["ehi"], a["periodic"])
    counts, _ = _kernels.count_images(*args, 0)
    flat = counts.reshape(-1).long()
    offsets = (torch.cumsum(flat, 0) - flat).reshape(counts.shape)
    total = int(flat.sum())
    meta, overflow = _kernels.fill_images(
        args[0], args[1], a["system"].clone(), *args[2:], 0, offsets, total - 5
    )
    assert int(overflow) == 1 and meta.shape[0] == total - 5
    huge = a["ehi"].clone()
    huge[0, 1, 0] = 1e9  # more images along an axis than MAX_IMAGE_SPAN
    counts, overflow = _kernels.count_images(*args[:5], huge, args[6], 0)
    ref_counts, ref_overflow = _reference.count_images_torch(*args[:5], huge, args[6], 0)
    assert int(overflow) == int(ref_overflow) == 1
    assert torch.equal(counts, ref_counts)


@pytest.mark.parametrize("device", DEVICES)
def test_fold_rows_matches_index_add(device: str, float_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    index = torch.randint(0, 20, (90,), generator=g).to(device)
    values = torch.randn(90, 6, generator=g, dtype=torch.float64).to(float_dtype).to(device)
    perm = torch.argsort(index, stable=True)
    out = torch.randn(25, 6, generator=g, dtype=torch.float64).to(float_dtype).to(device)
    start = out.clone()
    _kernels.fold_rows(values, index[perm].contiguous(), perm, out)
    ref = start.clone().index_add_(0, index, values)
    tol = 1e-12 if float_dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    # the summation order is fixed: the old value, then the run in order of j
    expect = start.clone()
    for j in perm.tolist():
        expect[int(index[j])] += values[j]
    assert torch.equal(out, expect)
    again = start.clone()
    _kernels.fold_rows(values, index[perm].contiguous(), perm, again)
    assert torch.equal(out, again)
    # runs of one entry, one run over every entry, and nothing at all
    for rows in (torch.arange(25, device=device), torch.full((90,), 3, device=device)):
        src = torch.arange(int(rows.numel()), device=device)
        got = _kernels.fold_rows(values, rows, src, torch.zeros_like(out))
        want = torch.zeros_like(out).index_add_(0, rows, values[: int(rows.numel())])
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    assert torch.equal(_kernels.fold_rows(values, empty, empty, start.clone()), start)


@pytest.mark.parametrize("device", DEVICES)
def test_a_recorded_launch_follows_new_arguments_and_sizes(
    device: str, float_dtype: torch.dtype
) -> None:
    """Later calls replay the first call's recorded launch, resetting only the
    arguments that changed: new tensors, a new size and a new column count each
    give the fresh result."""
    g = torch.Generator().manual_seed(3)
    tol = 1e-12 if float_dtype == torch.float64 else 1e-5
    commands: list[int] = []
    for n_values, n_rows, n_cols in ((90, 25, 6), (40, 7, 3), (90, 25, 6), (200, 60, 1)):
        index = torch.randint(0, n_rows, (n_values,), generator=g).to(device)
        values = torch.randn(n_values, n_cols, generator=g, dtype=torch.float64)
        values = values.to(float_dtype).to(device)
        perm = torch.argsort(index, stable=True)
        out = torch.zeros(n_rows, n_cols, dtype=float_dtype, device=device)
        _kernels.fold_rows(values, index[perm].contiguous(), perm, out)
        ref = torch.zeros_like(out).index_add_(0, index, values)
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
        commands.append(_kernels._KERNELS[_kernels.fold_rows_kernel].recorded)
    # the first call recorded (or found) the launch; the other three replayed it
    assert commands[0] >= 1 and all(c == commands[0] for c in commands[1:]), commands


def test_host_wrappers_check_dtype_device_and_contiguity() -> None:
    pos = torch.zeros(4, 3, dtype=torch.float64)
    sys_idx = torch.zeros(4, dtype=torch.int64)
    inv = torch.eye(3, dtype=torch.float64)[None]
    with pytest.raises(ValidationError, match="must be contiguous"):
        _kernels.compute_fractional(torch.zeros(3, 4, dtype=torch.float64).T, sys_idx, inv)
    with pytest.raises(ValidationError, match=r"inv_cell has dtype torch\.float32"):
        _kernels.compute_fractional(pos, sys_idx, inv.float())
    with pytest.raises(ValidationError, match=r"system has dtype torch\.int32"):
        _kernels.compute_fractional(pos, sys_idx.int(), inv)
    with pytest.raises(ValidationError, match="expected one of"):
        _kernels.compute_fractional(pos.half(), sys_idx, inv)


def test_public_api_resolves_and_private_modules_stay_private() -> None:
    import pkgutil

    import nvdd.halo as halo

    for name in halo.__all__:
        assert getattr(halo, name) is not None, name
    public = {n for n in dir(halo) if not n.startswith("_")}
    modules = {m.name for m in pkgutil.iter_modules(halo.__path__)}
    assert all(m.startswith("_") for m in modules), modules
    assert public - set(halo.__all__) <= modules | {"annotations"}, public - set(halo.__all__)
