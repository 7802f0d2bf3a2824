"""Test-only halo layouts, toy systems and a toy message-passing model.

``GlooTableLayout`` is a hand-built :class:`~nvdd.shardtensor.HaloLayout` over
torch.distributed (gloo in tests): each rank owns some atoms of a graph and
mirrors the remote atoms its owned atoms' edges touch. Its two exchanges are
``all_to_all_single`` with split sizes fixed at construction (so they never
synchronise with the host), wrapped in two autograd functions that are each
other's adjoint (and therefore differentiable twice).

``ToySystem`` is the unsharded oracle: atoms with global ids, positions,
features, systems, an undirected neighbour graph and a spatial partition.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nvdd.shardtensor import ShardTensor, system_sum

__all__ = [
    "GlooTableLayout",
    "Shard",
    "ToySystem",
    "as_shard_tensor",
    "call_counted",
    "HostSyncCounter",
    "make_system",
    "shard",
    "toy_energy",
    "toy_params",
]


# --------------------------------------------------------------------------- layout


class _Forward(torch.autograd.Function):
    """Owned rows kept, ghost rows fetched from their owners."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layout: GlooTableLayout) -> torch.Tensor:
        ctx.layout = layout
        return layout._forward(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _Reverse.apply(grad, ctx.layout), None


class _Reverse(torch.autograd.Function):
    """Ghost rows summed into their owners (across ranks); ghost rows zeroed."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layout: GlooTableLayout) -> torch.Tensor:
        ctx.layout = layout
        return layout._reverse(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _Forward.apply(grad, ctx.layout), None


class GlooTableLayout:
    """A halo layout built from explicit id tables (test-only).

    Parameters
    ----------
    owned_ids:
        ``shape (n_owned,)``: global ids of this rank's atoms, in row order.
    ghost_ids:
        ``shape (n_ghost,)``: global ids mirrored here, grouped by owner rank
        in increasing rank order.
    owner:
        ``shape (n_atoms,)``: owner rank of every global id.

    Construction is collective (an ``all_gather_object`` of the tables) and
    synchronises with the host; the exchanges afterwards do not.
    """

    def __init__(
        self,
        owned_ids: torch.Tensor,
        ghost_ids: torch.Tensor,
        owner: torch.Tensor,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self._group = group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        ghost_owner = owner[ghost_ids]
        if bool((ghost_owner[1:] < ghost_owner[:-1]).any()):
            raise ValueError("ghost_ids must be grouped by owner rank in increasing order")
        self.recv_counts = [int((ghost_owner == p).sum()) for p in range(world)]
        tables: list[list[int] | None] = [None] * world
        dist.all_gather_object(tables, ghost_ids.tolist(), group=group)
        row_of = {int(g): i for i, g in enumerate(owned_ids.tolist())}
        send_rows: list[int] = []
        self.send_counts = []
        for peer in range(world):
            wanted = [g for g in tables[peer] or [] if int(owner[g]) == rank]
            send_rows += [row_of[g] for g in wanted]
            self.send_counts.append(len(wanted))
        self.send_index = torch.tensor(send_rows, dtype=torch.int64)
        self._n_owned = int(owned_ids.shape[0])
        self._n_ghost = int(ghost_ids.shape[0])

    @property
    def n_owned(self) -> int:
        return self._n_owned

    @property
    def n_padded(self) -> int:
        return self._n_owned + self._n_ghost

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self._group

    def refresh(self, x: torch.Tensor) -> torch.Tensor:
        return _Forward.apply(x, self)

    def fold(self, x: torch.Tensor) -> torch.Tensor:
        return _Forward.apply(_Reverse.apply(x, self), self)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        owned = x[: self._n_owned]
        send = owned.index_select(0, self.send_index.to(x.device)).contiguous()
        recv = x.new_empty((self._n_ghost, *x.shape[1:]))
        dist.all_to_all_single(recv, send, self.recv_counts, self.send_counts, group=self._group)
        return torch.cat([owned, recv], dim=0)

    def _reverse(self, x: torch.Tensor) -> torch.Tensor:
        ghosts = x[self._n_owned :].contiguous()
        back = x.new_empty((int(self.send_index.shape[0]), *x.shape[1:]))
        dist.all_to_all_single(back, ghosts, self.send_counts, self.recv_counts, group=self._group)
        owned = x[: self._n_owned].index_add(0, self.send_index.to(x.device), back)
        return torch.cat([owned, torch.zeros_like(x[self._n_owned :])], dim=0)


# --------------------------------------------------------------------------- systems


@dataclass
class ToySystem:
    """An unsharded system: the oracle every sharded run is compared with."""

    positions: torch.Tensor  # (n, 3) float64
    features: torch.Tensor  # (n, F) float64
    system_index: torch.Tensor  # (n,) int64
    n_systems: int
    send: torch.Tensor  # (E,) directed edges send -> recv, both directions present
    recv: torch.Tensor
    owner: torch.Tensor  # (n,) rank owning each atom

    @property
    def n_atoms(self) -> int:
        return int(self.positions.shape[0])


def make_system(
    n_atoms: int, world: int, *, seed: int = 0, kind: str = "random", n_systems: int = 2
) -> ToySystem:
    """A random geometric graph (``kind="random"``) or a 1-D chain (``"chain"``),
    split over ``world`` ranks in slabs along x (spatial decomposition)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "chain":
        x = torch.arange(n_atoms, dtype=torch.float64)
        pos = torch.stack(
            [
                x,
                0.1 * torch.rand(n_atoms, generator=g, dtype=torch.float64),
                torch.zeros(n_atoms, dtype=torch.float64),
            ],
            dim=1,
        )
        i = torch.arange(n_atoms - 1)
        pairs = torch.stack([i, i + 1])
    else:
        box = float(n_atoms) ** (1 / 3) * 1.2
        pos = torch.rand(n_atoms, 3, generator=g, dtype=torch.float64) * box
        d = torch.cdist(pos, pos)
        iu = torch.triu_indices(n_atoms, n_atoms, offset=1)
        keep = d[iu[0], iu[1]] < 1.5
        pairs = iu[:, keep]
    # shuffle ids so that row order and id order differ
    perm = torch.randperm(n_atoms, generator=g)
    pos = pos[perm]
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(n_atoms)
    pairs = inv[pairs]
    send = torch.cat([pairs[0], pairs[1]])
    recv = torch.cat([pairs[1], pairs[0]])
    lo, hi = pos[:, 0].min(), pos[:, 0].max() + 1e-9
    owner = ((pos[:, 0] - lo) / (hi - lo) * world).floor().to(torch.int64).clamp(0, world - 1)
    return ToySystem(
        positions=pos,
        features=torch.randn(n_atoms, 4, generator=g, dtype=torch.float64),
        system_index=(torch.arange(n_atoms) * n_systems) // n_atoms,
        n_systems=n_systems,
        send=send,
        recv=recv,
        owner=owner,
    )


@dataclass
class Shard:
    """One rank's view of a :class:`ToySystem`: rows ``[owned | ghost]``."""

    ids: torch.Tensor  # (n_padded,) global id of each row
    layout: GlooTableLayout
    send: torch.Tensor  # local rows; edges whose receiver is owned (each global edge once)
    recv: torch.Tensor
    half_i: torch.Tensor  # local rows of the undirected pairs (i < j by id) with owned i
    half_j: torch.Tensor

    def rows(self, values: torch.Tensor) -> torch.Tensor:
        """Global per-atom ``values`` laid out in this rank's padded rows."""
        return values[self.ids]


def shard(system: ToySystem, group: dist.ProcessGroup | None = None) -> Shard:
    """This rank's shard. **Collective** (builds the layout)."""
    rank = dist.get_rank(group)
    owned = torch.nonzero(system.owner == rank).flatten()
    touching = system.owner[system.recv] == rank
    remote = system.send[touching]
    remote = torch.unique(remote[system.owner[remote] != rank])
    order = torch.argsort(system.owner[remote] * system.n_atoms + remote)
    ghosts = remote[order]
    ids = torch.cat([owned, ghosts])
    local = torch.full((system.n_atoms,), -1, dtype=torch.int64)
    local[ids] = torch.arange(ids.shape[0])
    layout = GlooTableLayout(owned, ghosts, system.owner, group)
    i_lt_j = system.send < system.recv
    half = i_lt_j & (system.owner[system.send] == rank)
    return Shard(
        ids=ids,
        layout=layout,
        send=local[system.send[touching]],
        recv=local[system.recv[touching]],
        half_i=local[system.send[half]],
        half_j=local[system.recv[half]],
    )


# --------------------------------------------------------------------------- toy model


def toy_params(width: int = 4, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        k: torch.randn(width, width, generator=g, dtype=torch.float64) * 0.5
        for k in ("W0", "W1", "U1", "W2", "U2")
    }


def toy_energy(
    pos: torch.Tensor,
    features: torch.Tensor,
    send: torch.Tensor,
    recv: torch.Tensor,
    system_index: torch.Tensor,
    n_systems: int,
    params: dict[str, torch.Tensor],
) -> torch.Tensor:
    """Per-system energy of a 2-layer message-passing network.

    Written against plain torch: gathers of sender rows, an MLP on the edges,
    ``index_add_`` into receiver rows, row-local updates, a per-system sum.
    On ShardTensors the dispatch folds the scatters; :func:`system_sum` reduces.
    """
    h = torch.tanh(features @ params["W0"])
    for w, u in (("W1", "U1"), ("W2", "U2")):
        rij = pos[recv] - pos[send]
        weight = torch.exp(-(rij * rij).sum(-1, keepdim=True))
        msg = torch.tanh(h[send] @ params[w]) * weight
        agg = torch.zeros_like(h)
        agg.index_add_(0, recv, msg)
        h = h + torch.tanh(agg @ params[u])
    return system_sum((h * h).sum(-1), system_index, n_systems)


# --------------------------------------------------------------------------- sync guard

_SYNC_METHODS = (
    "item",
    "cpu",
    "tolist",
    "numpy",
    "nonzero",
    "unique",
    "masked_select",
    "__bool__",
    "__int__",
    "__float__",
)


class HostSyncCounter:
    """Count calls of tensor methods that synchronise with the host.

    Patches ``torch.Tensor.<method>`` (and ``torch.nonzero`` / ``torch.unique``
    / ``torch.masked_select``) with counting wrappers inside the ``with``
    block; ``.count`` and ``.calls`` report what was seen.
    """

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._saved: list[tuple[Any, str, Any, bool]] = []

    @property
    def count(self) -> int:
        return len(self.calls)

    def _wrap(self, owner: Any, name: str) -> None:
        original = getattr(owner, name)

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return original(*args, **kwargs)

        self._saved.append((owner, name, original, name in vars(owner)))
        setattr(owner, name, counting)

    def __enter__(self) -> HostSyncCounter:
        for name in _SYNC_METHODS:
            self._wrap(torch.Tensor, name)
        for name in ("nonzero", "unique", "masked_select"):
            self._wrap(torch, name)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original, own in reversed(self._saved):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        self._saved.clear()


def call_counted(fn: Callable[[], Any]) -> tuple[Any, int, list[str]]:
    """``fn()`` under :class:`HostSyncCounter`: (result, count, calls)."""
    with HostSyncCounter() as guard:
        out = fn()
    return out, guard.count, list(guard.calls)


def as_shard_tensor(values: torch.Tensor, sh: Shard) -> ShardTensor:
    """Global per-atom values laid out in ``sh``'s rows, as a ShardTensor."""
    return ShardTensor.from_local(sh.rows(values).clone(), sh.layout)
