"""The model of one emulated rank, as ``predict_scaling.py`` runs it.

A rank's rows run on one device with the model wrapped the way the runtime calls
it: :class:`Owned` (LJ: owned receivers only), :class:`Scoped` (a model inside a
DD context: the MPNN, MACE), and :class:`RankStep` around either, which adds the
runtime's per-step halo work (the decision and its host read, the exchange, the
fold) for the whole-step timing. :func:`hold_ghosts` keeps a rank's ghost rows
at rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nvdd.halo._plan import Route

__all__ = ["Owned", "RankStep", "Scoped", "hold_ghosts"]


class Scoped:
    """A model called inside a DD context whose ghost rows copy owned rows (a
    :class:`~nvdd.shardtensor.SelfImageLayout`): the per-layer refreshes of a
    message-passing model cost what they cost on a rank (a gather of the ghost
    rows), with stand-in values for ghosts another rank would send."""

    def __init__(
        self,
        model: Any,
        n_owned: int,
        n_ghost: int,
        device: str,
        pbc: Sequence[bool] = (False, False, False),
    ) -> None:
        from nvdd.shardtensor import SelfImageLayout
        from nvdd.spec import AdapterRegistry

        self.inner = model
        source = torch.arange(n_ghost, device=device) % max(1, n_owned)
        self.layout = SelfImageLayout(n_owned, source)
        if any(pbc):  # the split layout: the halo leaves the whole axes to the model
            self.layout.periodic_axes = torch.tensor([list(pbc)])  # type: ignore[attr-defined]
        # the spec's adapters (MACE: owned receivers, a refresh per interaction),
        # installed as the runtime installs them while a distributed model is attached
        self.registry = AdapterRegistry(model.distribution_spec("halo").adapters())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, batch: Any) -> Any:
        from nvdd.shardtensor import DDContext, dd_scope

        leaf = batch.positions.detach().requires_grad_(True)
        with dd_scope(DDContext(layout=self.layout, positions=leaf)):
            return self.inner(batch.replace(positions=leaf))


class Owned:
    """The LJ model as a rank's runtime calls it: inside a DD context the model
    takes ``n_receivers`` = the layout's owned rows (``_dd.prepare_rows``), so its
    neighbour list holds the pairs with an owned end and none between two ghosts,
    and its forces are what its spec says (direct forces: complete on owned rows,
    nothing to fold; autograd: ``-dE_local/dx`` to fold). The bound is passed directly,
    which keeps the steps capturable as in the raw run (the list and kernels are
    the same as under the context)."""

    def __init__(self, model: Any, n_owned: int) -> None:
        self.inner = model
        self.n_owned = n_owned

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, batch: Any) -> Any:
        return self.inner(batch, n_receivers=self.n_owned)


class RankStep:
    """One rank's steady step as the runtime runs it, around ``inner`` (an
    :class:`Owned` or :class:`Scoped` model), for ``predict_scaling.time_rank``'s ``step_ms``.

    Every call makes the runtime's per-step halo work with the runtime's
    kernels: the skin test of the owned rows against their positions at the
    start joined with the non-finite flag into the step's decision code
    (``nvdd.dynamics._step.decision_code``: one kernel over the owned rows, as
    ``DistributedModel._verdict_code`` runs it) and read on the host; the ghost
    rows gathered from their sources, moved over the "wire" (a device copy),
    shifted by their image (``image @ cell`` each step, by the runtime's ``image_shift``) and concatenated after
    the owned rows (the padded positions the model runs on); after the model,
    the ghost forces over the wire and folded into their owners by the runtime's
    own fold (``nvdd.halo``'s ``_fold`` over a ``Route``: the deterministic Warp
    kernel on CUDA, ``index_add_`` elsewhere, as a rank's reverse exchange
    folds), then added to the owned rows, when the model's spec folds its forces
    (``folds``: not LJ's direct forces, whose owned rows are complete). With
    CUDA graphs (``captured``) the step is split as the runtime splits it:
    the decision is queued in the head
    (:meth:`begin_step`), read between the two graphs (:meth:`take_verdict`),
    and the exchange, model and fold replay in the tail. An eager step (no
    capture: the warm-up, a device that cannot capture, the MPNN and MACE)
    makes the decision at the start of the call.

    As on a rank, the integrator holds the owned rows alone (``static`` is the
    rank's ``[owned | ghost]`` system, whose positions each call replaces by
    the padded rows, as the runtime's ``static.replace``), and the call returns
    the owned rows' outputs.

    The emulation times steady steps: the verdict is read and then ignored (a
    rebuild is not emulated; ``benchmarks/halo_rebuilds.py`` measures one).
    The folded forces are discarded: on a rank they would belong to the
    neighbour's atoms, so the integrated dynamics stay those of ``inner`` on
    the owned rows, with the ghosts where ``source`` holds them.
    """

    def __init__(
        self,
        inner: Any,
        n_owned: int,
        source: torch.Tensor,
        src: torch.Tensor,
        shift: torch.Tensor,
        *,
        static: Any,
        skin: float,
        captured: bool,
    ) -> None:
        from nvdd.dynamics._provider import folds_forces

        self.inner = inner
        self.static = static  # the rank's [owned | ghost] rows (positions replaced a call)
        #: Whether the runtime folds this model's ghost forces (its spec says so).
        self.folds = folds_forces(inner.distribution_spec("halo"))
        self.skin = skin
        self.n_owned = n_owned
        self.captured = captured
        self.source = source  # the whole system at rest: the ghosts' owners
        self.src = src
        self.image = shift.to(source.dtype)
        n_g = src.numel()
        self.wire = torch.empty(n_g, 3, dtype=source.dtype, device=source.device)
        self.wire_back = torch.empty_like(self.wire)
        # the route of the fold: each ghost's owner, numbered compactly, summed into
        # as many rows as the receiving rank owns (taken as this rank's count)
        _, owner = torch.unique(src, return_inverse=True)
        self.route = Route(
            send_index=owner,
            send_counts=[n_g],
            recv_counts=[n_g],
            n_owned=max(n_owned, int(owner.max()) + 1 if n_g else 0),
            n_ghost=n_g,
            group=None,
            world_size=1,
            comm_device=source.device,
        )
        self.ref: torch.Tensor | None = None
        self.code: torch.Tensor | None = None
        self.folded: torch.Tensor | None = None
        self.ghost_forces: torch.Tensor | None = None  # (the last call's, where folded)
        self.reads = 0  # host reads of the decision (one per step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["inner"], name)

    @property
    def splits_step(self) -> bool:
        """Captured steps are cut at the decision, as the halo's are."""
        return self.captured

    def _decide(self, batch: Any) -> torch.Tensor:
        from nvdd.dynamics._step import decision_code

        if self.ref is None:  # (kept in the working precision, as the runtime keeps it)
            self.ref = batch.positions.detach().clone()
        limit2 = (0.5 * self.skin) ** 2
        return decision_code(None, None, batch, None, on=None, reference=self.ref, limit2=limit2)

    def begin_step(self, batch: Any) -> None:
        """The head's decision, queued on the device (captured)."""
        self.code = self._decide(batch)

    def take_verdict(self, batch: Any) -> bool:
        """The host read of the decision; steady whatever it says (see the class notes)."""
        assert self.code is not None
        int(self.code.item())
        self.reads += 1
        return True

    def __call__(self, batch: Any) -> Any:
        from nvdd.core import capturing
        from nvdd.halo import _plan

        if not capturing():  # an eager step decides first (a captured one did in its head)
            int(self._decide(batch).item())
            self.reads += 1
        n = self.n_owned
        self.wire.copy_(self.source.index_select(0, self.src))  # pack, the wire
        ghosts = self.wire + _plan.image_shift(self.image, batch.cell[0])  # unpack: the shift
        padded = torch.cat([batch.positions.detach(), ghosts])
        out = dict(self.inner(self.static.replace(positions=padded, cell=batch.cell)))
        n_padded = padded.shape[0]
        owned = {  # the owned rows' outputs, as the runtime hands them to the integrator
            k: v[:n] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n_padded else v
            for k, v in out.items()
        }
        if not self.folds:  # owned rows complete: no reverse exchange, no fold
            return owned
        forces = out["forces"].detach()
        self.wire_back.copy_(forces[n:])  # the ghost forces back over the wire
        folded = _plan._fold(self.route, self.wire_back)  # the runtime's fold, as reverse's
        _ = forces[:n] + folded[:n]  # the owners' sums (discarded: class notes)
        self.folded, self.ghost_forces = folded, forces[n:]  # (the last call's, for tests)
        return owned


def hold_ghosts(local: Any, n_owned: int) -> Any:
    """``local`` with its ghost rows held at rest (zero velocity, a mass of 1e30).

    On a rank the ghosts move with their owners (the exchange sends them every
    step), so the list rebuilds about as often as the raw run's. Integrated here
    with the owned-receiver forces (``-dE_local/dx``: half the pair force of
    their owned neighbours, nothing from beyond) they would drift and rebuild
    the list more often (CPU, 6,912 argon atoms, 240 steps: 9 builds raw, 13
    with drifting ghosts, 8 with ghosts held); held, the owned rows decide.
    """
    masses, velocities = local.masses.clone(), local.velocities.clone()
    masses[n_owned:] = 1e30
    velocities[n_owned:] = 0.0
    return local.replace(masses=masses, velocities=velocities)
