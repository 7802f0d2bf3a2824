"""ShardTensor under torch.compile: graph breaks counted, results compared with eager.

Before torch 2.13 the dispatch refuses to be traced (``DISPATCH_TRACEABLE``):
there only the refusal is tested.

torch 2.13 notes (docs/design.md, ShardTensor section): a ShardTensor that is
an *input* of a graph compiled with AOTAutograd trips pytorch/pytorch#193932
unless ``torch._functorch.config.check_custom_op_aliasing`` is off, so the
AOTAutograd tests pass plain tensors across the compile boundary and wrap them
inside (``ShardTensor.from_local`` with the context's layout), which is how the
runtime compiles a forward.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from shardtensor_fakes import ToySystem, make_system, shard, toy_energy, toy_params

from nvdd.shardtensor import (
    DDContext,
    SelfImageLayout,
    ShardTensor,
    current_dd_context,
    dd_scope,
    refresh_neighbors,
    system_sum,
)
from nvdd.testing import run_ranks

TRACEABLE = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)
needs_traceable = pytest.mark.skipif(not TRACEABLE, reason="ShardTensor compiles from torch 2.13")

SOURCE = torch.tensor([0, 1, 2, 4, 5])
SEND = torch.tensor([0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 5])
RECV = torch.tensor([1, 2, 3, 4, 5, 5, 0, 3, 1, 2, 0])
SYS = torch.tensor([0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1])


class GraphCounter:
    """A torch.compile backend that records the graphs and runs them eagerly."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs.append(gm)
        return gm.forward


def mp_layer(h: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Gather sender rows, an MLP on the edges, index_add_ into receiver rows."""
    msg = torch.tanh(h[SEND] @ w1) @ w2
    agg = torch.zeros_like(h)
    agg.index_add_(0, RECV, msg)
    return h + agg


def _inputs(dtype: torch.dtype = torch.float64) -> tuple[SelfImageLayout, torch.Tensor, Any]:
    layout = SelfImageLayout(6, SOURCE)
    g = torch.Generator().manual_seed(0)
    owned = torch.randn(6, 4, generator=g, dtype=dtype)
    ws = [torch.randn(4, 4, generator=g, dtype=dtype) * 0.5 for _ in range(2)]
    return layout, _images(owned), ws


def _images(owned: torch.Tensor) -> torch.Tensor:
    """Padded rows ``[owned | images]`` of owned rows."""
    return torch.cat([owned, owned[SOURCE]])


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _aliasing_check_off() -> contextlib.AbstractContextManager[Any]:
    """pytorch#193932: AOTAutograd's aliasing check rejects subclass graph inputs."""
    config = torch._functorch.config
    if hasattr(config, "check_custom_op_aliasing"):
        return config.patch(check_custom_op_aliasing=False)  # type: ignore[no-any-return]
    return contextlib.nullcontext()


@needs_traceable
def test_message_passing_layer_compiles_without_graph_breaks() -> None:
    layout, padded, (w1, w2) = _inputs()
    h = ShardTensor.from_local(padded, layout)
    explained = torch._dynamo.explain(mp_layer)(h, w1, w2)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    torch._dynamo.reset()

    counter = GraphCounter()
    compiled = torch.compile(mp_layer, backend=counter, fullgraph=True)
    got = compiled(h, w1, w2)
    want = mp_layer(h, w1, w2)
    assert type(got) is ShardTensor and got.halo_layout is layout
    torch.testing.assert_close(got.to_local(), want.to_local(), atol=1e-12, rtol=0)
    # the fold is in the graph: the image rows of the result equal their owners
    torch.testing.assert_close(got.to_local()[6:], got.to_local()[SOURCE], atol=0, rtol=0)
    ops = [str(n.target) for gm in counter.graphs for n in gm.graph.nodes]
    assert any("index_add" in op for op in ops), ops
    # new values, same layout: no recompilation
    compiled(ShardTensor.from_local(padded * 2.0, layout), w1, w2)
    assert len(counter.graphs) == 1


@pytest.mark.skipif(TRACEABLE, reason="torch >= 2.13 traces the dispatch")
def test_older_torch_refuses_to_trace_the_dispatch() -> None:
    layout, padded, (w1, w2) = _inputs()
    h = ShardTensor.from_local(padded, layout)
    with pytest.raises(Exception, match=r"needs torch >= 2\.13"):
        torch.compile(mp_layer, backend=GraphCounter(), fullgraph=True)(h, w1, w2)


@needs_traceable
@pytest.mark.parametrize("backend", ["graph", "aot_eager"])
def test_compiled_message_passing_matches_eager(backend: str) -> None:
    layout, padded, (w1, w2) = _inputs()
    want = mp_layer(ShardTensor.from_local(padded.clone(), layout), w1, w2)
    compiler: Any = GraphCounter() if backend == "graph" else backend
    with _aliasing_check_off():
        got = torch.compile(mp_layer, backend=compiler, fullgraph=True)(
            ShardTensor.from_local(padded.clone(), layout), w1, w2
        )
    assert type(got) is ShardTensor
    torch.testing.assert_close(got.to_local(), want.to_local(), atol=1e-12, rtol=0)
    assert float((want.to_local() - padded).abs().max()) > 1e-3  # the layer did something


def _toy_single(
    pos_local: torch.Tensor, feat: torch.Tensor, params: dict[str, torch.Tensor]
) -> torch.Tensor:
    layout = current_dd_context().layout
    assert layout is not None
    pos = ShardTensor.from_local(pos_local, layout)
    return toy_energy(pos, ShardTensor.from_local(feat, layout), SEND, RECV, SYS, 2, params)


def _compiled_energy_and_forces_match(**compile_kwargs: Any) -> torch.Tensor:
    """The toy energy and its position gradient, eager vs ``torch.compile(fullgraph)``;
    returns the eager gradient."""
    layout, padded, _ = _inputs()
    params = toy_params()
    with dd_scope(DDContext(layout=layout, n_systems=2)):
        pos = _images(torch.randn(6, 3, dtype=torch.float64)).requires_grad_()
        energy = _toy_single(pos, padded, params)
        (grad,) = torch.autograd.grad(energy.sum(), pos)
        compiled = torch.compile(_toy_single, fullgraph=True, **compile_kwargs)
        energy_c = compiled(pos, padded, params)
        (grad_c,) = torch.autograd.grad(energy_c.sum(), pos)
    torch.testing.assert_close(energy_c, energy, atol=1e-12, rtol=0)
    torch.testing.assert_close(grad_c, grad, atol=1e-12, rtol=0)
    return grad


@needs_traceable
def test_energy_and_forces_compile_in_one_graph_with_aot_autograd() -> None:
    grad = _compiled_energy_and_forces_match(backend="aot_eager")
    assert float(grad.abs().max()) > 1e-3


@needs_traceable
def test_shard_tensor_graph_inputs_compile_with_the_aliasing_check_off() -> None:
    layout, padded, (w1, w2) = _inputs()
    h = ShardTensor.from_local(padded, layout).requires_grad_()

    def energy(h: torch.Tensor) -> torch.Tensor:
        return system_sum((mp_layer(h, w1, w2) ** 2).sum(-1), SYS, 2)

    want = energy(h)
    (g_want,) = torch.autograd.grad(want.sum(), h)
    with _aliasing_check_off():
        got = torch.compile(energy, backend="aot_eager", fullgraph=True)(h)
    (g_got,) = torch.autograd.grad(got.sum(), h)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(g_got, g_want, atol=1e-12, rtol=0)


def test_compiled_code_follows_the_live_context() -> None:
    counter = GraphCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def refreshed(x: torch.Tensor) -> torch.Tensor:
        return refresh_neighbors(x) * 1.0

    x = torch.arange(11.0)
    assert refreshed(x).tolist() == x.tolist()  # inert: identity
    for source in ([0, 1, 2, 4, 5], [5, 4, 3, 2, 1], [0, 0, 0, 0, 0]):
        with dd_scope(DDContext(layout=SelfImageLayout(6, torch.tensor(source)))):
            assert refreshed(x).tolist() == [0.0, 1, 2, 3, 4, 5, *map(float, source)]
    assert refreshed(x).tolist() == x.tolist()
    assert len(counter.graphs) <= 3  # same-shape layouts share one graph


@pytest.mark.slow
@needs_traceable
def test_energy_and_forces_compile_with_inductor() -> None:
    _compiled_energy_and_forces_match()  # the default backend


def _compiled_on_ranks(system: ToySystem, params: dict[str, torch.Tensor]) -> dict[str, Any]:
    sh = shard(system)
    sys_idx = sh.rows(system.system_index)
    feat = sh.rows(system.features)
    pos = sh.rows(system.positions).clone().requires_grad_()

    def forward(pos_local: torch.Tensor, feat_local: torch.Tensor) -> torch.Tensor:
        layout = current_dd_context().layout
        assert layout is not None
        p = ShardTensor.from_local(pos_local, layout)
        f = ShardTensor.from_local(feat_local, layout)
        return toy_energy(p, f, sh.send, sh.recv, sys_idx, system.n_systems, params)

    with dd_scope(DDContext(layout=sh.layout, n_systems=system.n_systems)):
        energy = forward(pos, feat)
        (grad,) = torch.autograd.grad(energy.sum(), pos)
        # fullgraph=True: any graph break (a collective Dynamo cannot trace, say) fails
        energy_c = torch.compile(forward, backend="aot_eager", fullgraph=True)(pos, feat)
        (grad_c,) = torch.autograd.grad(energy_c.sum(), pos)
    return {
        "rank": dist.get_rank(),
        "energy": (energy.detach(), energy_c.detach()),
        "grad": (grad, grad_c),
    }


@pytest.mark.gloo
@needs_traceable
def test_toy_model_compiles_in_one_graph_on_two_ranks() -> None:
    system = make_system(24, 2, seed=5)
    results = run_ranks(_compiled_on_ranks, 2, system, toy_params(), timeout_s=240)
    for r in results:
        torch.testing.assert_close(r["energy"][1], r["energy"][0], atol=1e-12, rtol=0)
        torch.testing.assert_close(r["grad"][1], r["grad"][0], atol=1e-12, rtol=0)
    torch.testing.assert_close(results[0]["energy"][0], results[1]["energy"][0], atol=1e-12, rtol=0)
