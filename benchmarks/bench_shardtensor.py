"""Dispatch overhead of ShardTensor against plain tensors (a benchmark, not a test).

Usage::

    python packages/nvdd-shardtensor/tests/bench_shardtensor_dispatch.py [--device cuda] [--quick]

Each row times one operation on plain local tensors and on ShardTensors over a
SelfImageLayout (no communication, so the difference is the Python dispatch plus,
for scatters, the fold's extra arithmetic) and prints the time per call (best of
several repeats) and the ratio, for a small system (dispatch-bound) and a large
one (compute-bound).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch

# The toy model lives with the package's tests.
sys.path.insert(
    0, os.path.join(os.path.dirname(__file__), "..", "packages", "nvdd-shardtensor", "tests")
)

from shardtensor_fakes import toy_energy, toy_params

from nvdd.shardtensor import DDContext, SelfImageLayout, ShardTensor, dd_scope


def _best_us(fn: Callable[[], object], device: torch.device, number: int, repeat: int) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / number)
    return best * 1e6


def _cases(
    n_atoms: int, device: torch.device
) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    g = torch.Generator().manual_seed(0)
    n_owned = int(n_atoms * 0.8)
    source = torch.randint(0, n_owned, (n_atoms - n_owned,), generator=g)
    layout = SelfImageLayout(n_owned, source.to(device))
    width = 16
    plain = layout.refresh(torch.randn(n_atoms, width, generator=g).to(device))
    other = torch.randn(n_atoms, width, generator=g).to(device)
    st, st_other = ShardTensor.from_local(plain, layout), ShardTensor.from_local(other, layout)
    w = torch.randn(width, width, generator=g).to(device)
    n_edges = 8 * n_atoms
    send = torch.randint(0, n_atoms, (n_edges,), generator=g).to(device)
    recv = torch.randint(0, n_owned, (n_edges,), generator=g).to(device)
    msg = torch.randn(n_edges, width, generator=g).to(device)
    sys_idx = (torch.arange(n_atoms) % 2).to(device)
    params = {k: v.to(device) for k, v in toy_params(width).items()}
    pos_plain = torch.randn(n_atoms, 3, generator=g).double().to(device)
    feat = plain.double()
    pos_st = ShardTensor.from_local(pos_plain, layout)
    feat_st = ShardTensor.from_local(feat, layout)
    params64 = {k: v.double() for k, v in params.items()}

    def energy(pos: torch.Tensor, f: torch.Tensor) -> object:
        p = pos.detach().requires_grad_()
        e = toy_energy(p, f, send, recv, sys_idx, 2, params64)
        return torch.autograd.grad(e.sum(), p)

    def fold_by_hand() -> object:
        out = plain.clone()
        out += layout.fold(torch.zeros_like(plain).index_add_(0, recv, msg))
        return out

    return {
        "a * 2 + b": (lambda: plain * 2.0 + other, lambda: st * 2.0 + st_other),
        "x @ W": (lambda: plain @ w, lambda: st @ w),
        "gather x[send]": (lambda: plain[send], lambda: st[send]),
        "in-place add_": (lambda: plain.add_(0.0), lambda: st.add_(0.0)),
        "index_add_ (plain: no fold)": (
            lambda: plain.clone().index_add_(0, recv, msg),
            lambda: st.clone().index_add_(0, recv, msg),
        ),
        "index_add_ (plain: fold by hand)": (
            fold_by_hand,
            lambda: st.clone().index_add_(0, recv, msg),
        ),
        "toy energy + forces": (
            lambda: energy(pos_plain, feat),
            lambda: _in_scope(layout, lambda: energy(pos_st, feat_st)),
        ),
    }


def _in_scope(layout: SelfImageLayout, fn: Callable[[], object]) -> object:
    with dd_scope(DDContext(layout=layout, n_systems=2)):
        return fn()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    repeat = 3 if args.quick else 7
    print(f"torch {torch.__version__}, device {device}, 1 intra-op thread")
    print(f"{'n_atoms':>8} {'operation':<34} {'plain us':>10} {'shard us':>10} {'ratio':>6}")
    for n_atoms in (200, 20000):
        number = 200 if n_atoms <= 1000 else 10
        for name, (plain_fn, shard_fn) in _cases(n_atoms, device).items():
            n = max(1, number // 20) if "energy" in name else number
            t_plain = _best_us(plain_fn, device, n, repeat)
            t_shard = _best_us(shard_fn, device, n, repeat)
            print(
                f"{n_atoms:>8} {name:<34} {t_plain:>10.1f} {t_shard:>10.1f} {t_shard / t_plain:>6.2f}"
            )


if __name__ == "__main__":
    main()
