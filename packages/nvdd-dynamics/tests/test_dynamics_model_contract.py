"""The runtime calls a model only through `nvdd.spec.ModelContract`, never by probing."""

from __future__ import annotations

import ast
import pathlib
import sys
from typing import Any

import pytest
import torch
from dyn_models import PairSum, SoftPair

import nvdd.dynamics
from nvdd.core import Batch
from nvdd.dynamics import DomainConfig, DomainParallel, VelocityVerlet
from nvdd.spec import MODEL_CONTRACT, CompilePolicy
from nvdd.testing import run_ranks

#: What the runtime may read on a model besides the contract: torch.nn.Module's
#: own members, asked only of a model that is one (where its tensors live).
MODULE_MEMBERS = frozenset({"named_parameters", "named_buffers"})

#: Validation tooling (trace_and_validate and its probes) inspects a model's
#: modules on purpose; it is not the step's runtime.
TOOLING = {"_validate.py", "_probe.py", "_diagnose.py", "_verify.py", "_spec_report.py"}

_MODEL_NAMES = {"model", "models", "pipeline", "target"}


def _is_model(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in _MODEL_NAMES
    return isinstance(node, ast.Attribute) and node.attr in _MODEL_NAMES


def test_the_runtime_never_probes_a_model() -> None:
    """No ``getattr`` / ``hasattr`` on a model and no ``type: ignore[attr-defined]``
    in the runtime's modules: what it calls is declared (mypy checks the calls)."""
    src = pathlib.Path(nvdd.dynamics.__file__).parent
    found = []
    for path in sorted(src.glob("*.py")):
        if path.name in TOOLING:
            continue
        text = path.read_text()
        if "type: ignore[attr-defined]" in text:
            found.append(f"{path.name}: type: ignore[attr-defined]")
        for node in ast.walk(ast.parse(text)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and node.args
                and _is_model(node.args[0])
            ):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


class Recording(SoftPair):
    """A SoftPair that records every attribute code in ``nvdd.dynamics`` reads on
    it, and opts in to every hook (its steps split, it compiles its own core), so
    that the runtime calls all of them."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __getattribute__(self, name: str) -> Any:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("nvdd.dynamics"):
            object.__getattribute__(self, "seen").add(name)
        return super().__getattribute__(name)

    def compile_forward(self, policy: CompilePolicy | None) -> bool:
        return policy is not None  # ("compiles its own core": nothing to compile here)

    @property
    def splits_step(self) -> bool:
        return True

    def begin_step(self, batch: Batch) -> None:
        pass

    def take_verdict(self, batch: Batch) -> bool:
        return True


def _gas(n: int = 24) -> Batch:
    g = torch.Generator().manual_seed(1)
    cell = torch.diag(torch.tensor([6.0, 6.0, 6.0], dtype=torch.float64))
    return Batch(
        positions=torch.rand(n, 3, generator=g, dtype=torch.float64) @ cell,
        atomic_numbers=torch.full((n,), 18),
        velocities=torch.randn(n, 3, generator=g, dtype=torch.float64) * 0.02,
        cell=cell,
        pbc=[True, True, True],
    )


def _runtime_reads() -> dict[str, list[str]]:
    """One rank: the whole batch, the halo and a pipeline, every provider hook
    StepGraphs calls on CUDA called here directly."""
    out = {}
    for mode, halo in (("whole", False), ("halo", True)):
        model = Recording()
        dyn = VelocityVerlet(model, _gas(), dt_fs=2.0)
        config = DomainConfig(
            cutoff=2.5, skin=0.3, halo_on_one_rank=halo, compile=True, verify_model=False
        )
        with DomainParallel(dyn, config) as dp:
            dp.partition()
            dp.run(2)
            batch = dp.model.sharded.local_batch
            dp.model.graph_key(batch)
            assert dp.model.splits_step
            dp.model.begin_step(batch)
            assert dp.model.take_verdict(batch)
            dp.run(1)
        out[mode] = sorted(model.seen)
    parts = [Recording(), Recording()]
    dyn = VelocityVerlet(PairSum(parts, cutoff=2.5), _gas(), dt_fs=2.0)
    with DomainParallel(dyn, DomainConfig(cutoff=2.5, skin=0.3, verify_model=False)) as dp:
        dp.partition()
        dp.run(2)
    out["pipeline components"] = sorted(set().union(*(p.seen for p in parts)))
    return out


@pytest.mark.gloo
def test_the_runtime_reads_only_the_contract_and_uses_all_of_it() -> None:
    reads = run_ranks(_runtime_reads, 1, timeout_s=120)[0]
    allowed = MODEL_CONTRACT | MODULE_MEMBERS
    for mode, names in reads.items():
        assert set(names) <= allowed, f"{mode}: undeclared {sorted(set(names) - allowed)}"
    used = set().union(*map(set, reads.values()))
    # (a call goes to type(model).__call__ without an attribute read)
    assert MODEL_CONTRACT - {"__call__"} - used == set()
