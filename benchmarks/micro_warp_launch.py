"""Host cost of one Warp launch from torch, three ways (a GPU micro-benchmark).

    python benchmarks/micro_warp_launch.py --device cuda

(a) ``wp.launch`` with a fresh ``wp.stream_from_torch`` per call (nvdd.halo's
fold up to commit dd1d1ed), (b) ``wp.launch`` with the Warp stream cached per
torch stream, (c) a recorded launch (``record_cmd=True``) replayed with changed
arguments reset (nvdd.models' ``Kernel``), (d) ``nvdd.halo``'s launcher now (a
recorded launch per kernel and argument types). Then, as at a halo rebuild
where every buffer is new, all five arguments changed at every call
(alternating two sets): (e) the recorded launch given ``wp.from_torch`` arrays,
(f) ``nvdd.core.RecordedKernel`` (array descriptors built from the tensors).
Microseconds of host time per call, the device synchronised only at the end.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--calls", type=int, default=2000)
    a = p.parse_args()
    from nvdd.halo import _kernels

    _kernels._ready()
    wp_ = _kernels._wp
    dev = (
        torch.device("cuda", torch.cuda.current_device())
        if a.device == "cuda"
        else torch.device("cpu")
    )
    n = 1000
    values = torch.randn(n, 3, device=dev)
    out = torch.zeros(n, 3, device=dev)
    rows = torch.arange(n, device=dev)
    src = torch.arange(n, device=dev)
    kernel = _kernels.fold_rows_kernel
    wdev = wp_.device_from_torch(dev)
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def fresh_stream() -> None:
        wargs = [wp_.from_torch(x) for x in (values, rows, src, out)]
        if cuda:
            stream = wp_.stream_from_torch(torch.cuda.current_stream(dev))
            wp_.launch(kernel, dim=(n, 3), inputs=wargs, device=wdev, stream=stream)
        else:
            wp_.launch(kernel, dim=(n, 3), inputs=wargs, device=wdev)

    def halo_launcher() -> None:
        _kernels._launch(kernel, (n, 3), [values, rows, src, out], dev)

    cached = wp_.stream_from_torch(torch.cuda.current_stream(dev)) if cuda else None

    def cached_stream() -> None:
        wargs = [wp_.from_torch(x) for x in (values, rows, src, out)]
        if cuda:
            wp_.launch(kernel, dim=(n, 3), inputs=wargs, device=wdev, stream=cached)
        else:
            wp_.launch(kernel, dim=(n, 3), inputs=wargs, device=wdev)

    rec = wp_.launch(kernel, dim=(n, 3), inputs=[wp_.from_torch(x) for x in (values, rows, src, out)],
                     device=wdev, record_cmd=True)  # fmt: skip

    def recorded() -> None:
        rec.set_param_at_index(0, wp_.from_torch(values))  # (a fresh tensor each step)
        rec.set_param_at_index(3, wp_.from_torch(out))
        if cuda:
            rec.launch(stream=cached)
        else:
            rec.launch()

    from nvdd.core import RecordedKernel

    sets = [[values, rows, src, out], [x.clone() for x in (values, rows, src, out)]]
    calls = [0]

    def all_new_from_torch() -> None:
        calls[0] += 1
        for k, x in enumerate(sets[calls[0] % 2]):
            rec.set_param_at_index(k, wp_.from_torch(x))
        if cuda:
            rec.launch(stream=cached)
        else:
            rec.launch()

    launcher = RecordedKernel(kernel)

    def all_new_descriptors() -> None:
        calls[0] += 1
        launcher((n, 3), sets[calls[0] % 2], dev)

    for name, fn in (("fresh stream", fresh_stream), ("cached stream", cached_stream),
                     ("recorded launch", recorded), ("nvdd.halo now", halo_launcher),
                     ("new, from_torch", all_new_from_torch),
                     ("new, descriptors", all_new_descriptors)):  # fmt: skip
        for _ in range(50):
            fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(a.calls):
            fn()
        host = time.perf_counter() - t0
        sync()
        print(f"{name:>16}: {1e6 * host / a.calls:7.1f} us of host time per launch")


if __name__ == "__main__":
    main()
