"""`build_request_plan`: a plan whose ghost rows are chosen by the receiving rank.

A spatial halo plan (:func:`~nvdd.halo.build_halo_plan`) is decided by the
sender: every rank ships each owned atom to every box its image falls in. A
graph partition turns this around: a rank knows which atoms its edges read (the
senders of the edges into its owned nodes), so it *requests* those rows from
their owners. The result is the same :class:`~nvdd.halo.HaloPlan` (exchanges,
adjoints, the halo-layout protocol), with zero image shifts: ghost rows are the
atoms themselves, at their owners' positions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nvdd.core import (
    ValidationError,
    all_to_all_single,
    comm_device,
    get_rank,
    get_world_size,
    raise_if_any_rank,
)
from nvdd.halo._plan import HaloPlan, Route

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["build_request_plan"]


def _request_problem(
    owner_rank: torch.Tensor,
    owner_row: torch.Tensor,
    extras: dict[str, torch.Tensor | None],
    n_owned: int,
    world: int,
) -> str | None:
    """What is wrong with this rank's requests (local checks), or None."""
    for name, t in (("owner_rank", owner_rank), ("owner_row", owner_row)):
        if not isinstance(t, torch.Tensor) or t.ndim != 1 or t.dtype != torch.int64:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            dtype = t.dtype if isinstance(t, torch.Tensor) else None
            return f"{name} must be an int64 tensor of shape (n_ghost,), got {shape} {dtype}"
    n = int(owner_rank.shape[0])
    if int(owner_row.shape[0]) != n:
        return f"owner_row has {int(owner_row.shape[0])} rows, owner_rank {n}"
    for name, extra in extras.items():
        if extra is not None and (
            not isinstance(extra, torch.Tensor) or tuple(extra.shape) != (n,)
        ):
            got = tuple(extra.shape) if isinstance(extra, torch.Tensor) else type(extra).__name__
            return f"{name} must have shape ({n},), got {got}"
    if isinstance(n_owned, bool) or not isinstance(n_owned, int) or n_owned < 0:
        return f"n_owned must be an int >= 0, got {n_owned!r}"
    if n == 0:
        return None
    if bool(((owner_rank < 0) | (owner_rank >= world)).any()):
        bad = int(owner_rank[(owner_rank < 0) | (owner_rank >= world)][0])
        return f"owner_rank {bad} is outside [0, {world})"
    if bool((owner_rank[1:] < owner_rank[:-1]).any()):
        return "owner_rank must be sorted (requests grouped by owner, in rank order)"
    if bool((owner_row < 0).any()):
        return f"owner_row {int(owner_row[owner_row < 0][0])} is negative"
    return None


def build_request_plan(
    owner_rank: torch.Tensor,
    owner_row: torch.Tensor,
    n_owned: int,
    *,
    group: ProcessGroup | None = None,
    atom_ids: torch.Tensor | None = None,
    system_index: torch.Tensor | None = None,
    n_systems: int = 1,
    sync_checks: bool = False,
) -> HaloPlan:
    """A :class:`~nvdd.halo.HaloPlan` whose ghost rows this rank asked for.

    **Collective** over ``group``: every rank calls it once per rebuild. Two
    ``all_to_all_single`` calls (the request counts per peer, then the requested
    rows) and one all-reduce of a failure flag, so a bad request on any rank
    (an owner rank out of range, a row past the owner's ``n_owned``) raises the
    same :class:`~nvdd.core.ValidationError` on every rank.

    Parameters
    ----------
    owner_rank:
        int64, shape ``(n_ghost,)``, sorted: the rank owning each requested row.
        A rank may request its own rows (a local copy through the same exchange).
    owner_row:
        int64, shape ``(n_ghost,)``: the owned row on that rank.
    n_owned:
        Rows this rank owns (requests from peers are checked against it).
    group:
        The process group (None: the default group).
    atom_ids, system_index:
        int64, shape ``(n_ghost,)``: kept in the plan's ``ghost_atom_ids`` and
        ``ghost_system_index`` (default -1 and 0).
    n_systems:
        Systems of the batch (for ``ghost_positions``).
    sync_checks:
        As for :func:`~nvdd.halo.build_halo_plan`.

    Returns
    -------
    HaloPlan
        Ghost row ``k`` is request ``k``; ``ghost_image`` is zero (ghost positions
        are the owners' positions unchanged) and ``explicit_images`` is False.
    """
    world, rank = get_world_size(group), get_rank(group)
    extras = {"atom_ids": atom_ids, "system_index": system_index}
    problem = _request_problem(owner_rank, owner_row, extras, n_owned, world)
    dev = owner_rank.device if isinstance(owner_rank, torch.Tensor) else torch.device("cpu")
    if problem is None:
        want = torch.bincount(owner_rank.cpu(), minlength=world)
    else:
        want = torch.zeros(world, dtype=torch.int64)
    # Header: [rows I want from you, my failure flag], one int64 pair per peer.
    header = torch.stack([want, torch.full_like(want, int(problem is not None))], dim=1)
    if world == 1:
        asked = header.clone()
    else:
        cdev = comm_device(group)
        asked = torch.empty(world, 2, dtype=torch.int64, device=cdev)
        all_to_all_single(asked, header.to(cdev), group=group)
        asked = asked.cpu()
    if int(asked[:, 1].max()) or problem is not None:
        raise_if_any_rank(problem, group, exc_type=ValidationError)
    recv_counts = [int(c) for c in want.tolist()]  # ghost rows from each owner
    send_counts = [int(c) for c in asked[:, 0].tolist()]  # rows each peer asked of me
    rows = owner_row.to(torch.int64)
    if world == 1:
        send_index = rows.clone()
    else:
        cdev = comm_device(group)
        got = torch.empty(sum(send_counts), dtype=torch.int64, device=cdev)
        all_to_all_single(got, rows.to(cdev), send_counts, recv_counts, group=group)
        send_index = got.to(dev)
    bad = None
    if send_index.numel() and bool(((send_index < 0) | (send_index >= n_owned)).any()):
        row = int(send_index[(send_index < 0) | (send_index >= n_owned)][0])
        bad = f"a peer requested row {row} of rank {rank}, which owns {n_owned} rows"
    raise_if_any_rank(bad, group, exc_type=ValidationError)
    n_ghost = int(rows.shape[0])
    route = Route(
        send_index=send_index.contiguous(),
        send_counts=send_counts,
        recv_counts=recv_counts,
        n_owned=n_owned,
        n_ghost=n_ghost,
        group=group,
        world_size=world,
        comm_device=comm_device(group),
    )
    ids = atom_ids if atom_ids is not None else torch.full((n_ghost,), -1, dtype=torch.int64)
    systems = system_index if system_index is not None else torch.zeros(n_ghost, dtype=torch.int64)
    return HaloPlan(
        route,
        rank=rank,
        ghost_atom_ids=ids.to(dev, torch.int64),
        ghost_owner_rank=owner_rank.to(dev),
        ghost_owner_row=rows.to(dev),
        ghost_image=torch.zeros(n_ghost, 3, dtype=torch.int64, device=dev),
        ghost_system_index=systems.to(dev, torch.int64),
        n_systems=n_systems,
        sync_checks=sync_checks,
        explicit_images=False,
    )
