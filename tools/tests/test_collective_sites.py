"""Every collective goes through ``nvdd/core/_comm.py`` (issue 13, item 6).

An AST scan of every ``packages/*/src`` module: a reference to a collective of
``torch.distributed`` (an attribute of the module under any alias, or a name
imported from it or one of its submodules) is an error outside the modules
listed in :data:`ALLOWED`. ``_comm.py`` may use every collective; process-group
set-up and teardown may use the calls that create or destroy a group, and
nothing else. Not seen by the scan: ``getattr(dist, name)`` with a computed
name (nvdd-testing's fake device patches collectives that way, it calls none)
and methods of a ``ProcessGroup`` object.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: ``torch.distributed`` functions that communicate (every rank of a group must
#: call them), including the ones that create or destroy a group.
COLLECTIVES = frozenset(
    {
        "all_gather",
        "all_gather_coalesced",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_reduce",
        "all_reduce_coalesced",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "batch_isend_irecv",
        "broadcast",
        "broadcast_object_list",
        "destroy_process_group",
        "gather",
        "gather_object",
        "init_device_mesh",
        "init_process_group",
        "irecv",
        "isend",
        "monitored_barrier",
        "new_group",
        "new_subgroups",
        "new_subgroups_by_enumeration",
        "recv",
        "recv_object_list",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
        "send_object_list",
    }
)
#: Modules that create or destroy process groups, and the calls they need.
#: ``_comm.py``: every collective nvdd makes.
ALLOWED: dict[str, frozenset[str]] = {
    "nvdd-core/src/nvdd/core/_comm.py": COLLECTIVES,
    # init_distributed: the default group, and the named device mesh over it
    "nvdd-core/src/nvdd/core/_distributed.py": frozenset(
        {"init_process_group", "init_device_mesh"}
    ),
    # spawn_ranks: each spawned rank's group, from the file rendezvous to teardown
    "nvdd-core/src/nvdd/core/_spawn.py": frozenset({"init_process_group", "destroy_process_group"}),
    # the runtime's teardown at exit
    "nvdd-core/src/nvdd/core/_lifecycle.py": frozenset({"destroy_process_group"}),
    # run_ranks' pooled worlds: each pooled rank's group, as spawn_ranks makes its own
    "nvdd-testing/src/nvdd/testing/_pool.py": frozenset(
        {"init_process_group", "destroy_process_group"}
    ),
}


def collective_uses(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of every reference to a ``torch.distributed`` collective."""
    tree = ast.parse(source)
    # names bound to torch.distributed or one of its submodules (or anything else
    # imported from them: ``ProcessGroup.barrier`` is a collective too)
    aliases: set[str] = set()
    torch_names: set[str] = set()  # names bound to the torch package
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname is None and (a.name == "torch" or a.name.startswith("torch.")):
                    torch_names.add("torch")
                elif a.name == "torch":
                    torch_names.add(str(a.asname))
                elif _in_distributed(a.name):
                    aliases.add(str(a.asname))
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            if node.module == "torch":
                aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
            elif _in_distributed(node.module):
                found += [(node.lineno, a.name) for a in node.names if a.name in COLLECTIVES]
                aliases |= {a.asname or a.name for a in node.names if a.name not in COLLECTIVES}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or node.attr not in COLLECTIVES:
            continue
        base = _dotted(node.value)
        head, _, rest = base.partition(".")
        if (not rest and head in aliases) or (
            head in torch_names and _in_distributed("torch." + rest)
        ):
            found.append((node.lineno, node.attr))
    return sorted(set(found))


def _in_distributed(module: str) -> bool:
    return module == "torch.distributed" or module.startswith("torch.distributed.")


def _dotted(node: ast.expr) -> str:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    else:
        parts.append("<expr>")
    return ".".join(reversed(parts))


def _sources() -> dict[str, str]:
    files = sorted((ROOT / "packages").glob("*/src/**/*.py"))
    assert len(files) > 100, f"found only {len(files)} source files under {ROOT / 'packages'}"
    return {str(f.relative_to(ROOT / "packages")): f.read_text() for f in files}


def test_no_module_outside_comm_calls_a_collective() -> None:
    offenders = []
    for rel, text in _sources().items():
        allowed = ALLOWED.get(rel, frozenset())
        for line, name in collective_uses(text):
            if name not in allowed:
                offenders.append(f"packages/{rel}:{line}: torch.distributed.{name}")
    assert not offenders, (
        "collectives outside nvdd/core/_comm.py (route them through nvdd.core):\n"
        + "\n".join(offenders)
    )


def test_the_allowed_list_is_tight() -> None:
    """Every allowed module exists and uses each call it is allowed (no stale entries)."""
    sources = _sources()
    for rel, names in ALLOWED.items():
        assert rel in sources, f"ALLOWED names packages/{rel}, which does not exist"
        if names is COLLECTIVES:
            continue
        used = {name for _, name in collective_uses(sources[rel])}
        assert used == names, f"packages/{rel} uses {sorted(used)}, ALLOWED says {sorted(names)}"


def test_the_scan_sees_every_spelling() -> None:
    code = textwrap.dedent(
        """\
        import torch
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d
        from torch import distributed
        from torch.distributed import all_gather as gather_all, get_rank, ProcessGroup
        from torch.distributed.distributed_c10d import broadcast, PrefixStore
        dist.all_reduce(t)
        fn = c10d.barrier
        distributed.send(t, 1)
        torch.distributed.all_to_all_single(a, b)
        torch.distributed.distributed_c10d.reduce(t, 0)
        ProcessGroup.barrier(g)
        dist.get_world_size(); dist.is_initialized(); dist.ReduceOp.SUM; get_rank()
        torch.distributions.Normal(0, 1).sample(); obj.dist.broadcast(x)
        """
    )
    assert collective_uses(code) == [
        (5, "all_gather"),
        (6, "broadcast"),
        (7, "all_reduce"),
        (8, "barrier"),
        (9, "send"),
        (10, "all_to_all_single"),
        (11, "reduce"),
        (12, "barrier"),
    ]
    # an unrelated ``dist`` (importlib.metadata's) is not torch.distributed
    assert collective_uses("from importlib import metadata as dist\ndist.broadcast(x)\n") == []
