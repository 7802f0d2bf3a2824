import torch, torch._dynamo as dy
from nvdd.shardtensor import *
from nvdd.shardtensor._rules import plain

print(torch.__version__)
SOURCE = torch.tensor([0, 1, 2, 4, 5])
lay = SelfImageLayout(6, SOURCE)
g = torch.Generator().manual_seed(0)
owned = torch.randn(6, 4, generator=g, dtype=torch.float64)
padded = torch.cat([owned, owned[SOURCE]])
SEND = torch.tensor([0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 5])
RECV = torch.tensor([1, 2, 3, 4, 5, 5, 0, 3, 1, 2, 0])


def c_backend(gm, ex):
    return gm.forward


def f_gather(h):
    return torch.tanh(h[SEND])


def f_inplace_plain_view(h):
    agg = torch.zeros_like(h)
    v = plain(agg)
    v.add_(1.0)
    return agg * 1.0


def f_index_add_(h):
    agg = torch.zeros_like(h)
    agg.index_add_(0, RECV, h[SEND])
    return h + agg


def f_index_add(h):
    return torch.index_add(h, 0, RECV, h[SEND])


def f_add_(h):
    y = h * 1.0
    y.add_(h)
    return y


def f_fold(h):
    return scatter_to_owners(h) * 1.0


for f in [f_gather, f_inplace_plain_view, f_index_add_, f_index_add, f_add_, f_fold]:
    for be in [c_backend, "aot_eager"]:
        dy.reset()
        h = ShardTensor.from_local(padded.clone(), lay)
        want = f(h)
        try:
            import contextlib

            cm = (
                torch._functorch.config.patch(check_custom_op_aliasing=False)
                if hasattr(torch._functorch.config, "check_custom_op_aliasing")
                else contextlib.nullcontext()
            )
            with cm:
                got = torch.compile(f, backend=be, fullgraph=True)(
                    ShardTensor.from_local(padded.clone(), lay)
                )
            print(
                f.__name__,
                getattr(be, "__name__", be),
                type(got).__name__,
                float((to_local(got) - to_local(want)).abs().max()),
            )
        except Exception as e:
            print(f.__name__, be, "FAIL", str(e)[:200])
