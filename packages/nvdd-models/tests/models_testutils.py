"""Independent oracles and fixtures for the nvdd-models tests.

Nothing here uses the package's neighbour lists: the brute-force references loop
over every pair and every periodic image in a generous range, with numpy.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from nvdd.core import Batch
from nvdd.models import EdgeList

Edge = tuple[int, int, int, int, int]

#: ``device`` parameters of the tests that also run on a GPU host.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def image_ranges(cell: np.ndarray, pbc: Sequence[bool], cutoff: float) -> list[range]:
    """Image index range per axis that surely covers ``cutoff`` (0 on open axes).

    The distance between the lattice planes of a periodic axis is its vector's
    distance to the span of the other periodic vectors.
    """
    periodic = [a for a in range(3) if pbc[a]]
    out: list[range] = []
    for a in range(3):
        if not pbc[a]:
            out.append(range(1))
            continue
        others = [b for b in periodic if b != a]
        vec = cell[a]
        if others:
            basis = cell[others]
            coef, *_ = np.linalg.lstsq(basis.T, vec, rcond=None)
            height = float(np.linalg.norm(vec - basis.T @ coef))
        else:
            height = float(np.linalg.norm(vec))
        n = math.ceil(cutoff / height) + 1
        out.append(range(-n, n + 1))
    return out


def brute_edges(
    positions: np.ndarray, cell: np.ndarray, pbc: Sequence[bool], cutoff: float
) -> set[Edge]:
    """Every directed ``(i, j, S)`` with ``0 < |x_j - x_i + S @ cell| < cutoff``."""
    out: set[Edge] = set()
    pos = np.asarray(positions, dtype=np.float64)
    for s in itertools.product(*image_ranges(cell, pbc, cutoff)):
        d = pos[None, :, :] + np.asarray(s, dtype=np.float64) @ cell - pos[:, None, :]
        r = np.sqrt((d * d).sum(-1))
        for i, j in zip(*np.nonzero(r < cutoff), strict=True):
            if i == j and s == (0, 0, 0):
                continue
            out.add((int(i), int(j), *s))
    return out


def brute_edges_batch(batch: Batch, cutoff: float) -> set[Edge]:
    """:func:`brute_edges` of every system of ``batch``, in the batch's row numbers."""
    out: set[Edge] = set()
    pos = batch.positions.detach().double().cpu().numpy()
    si = batch.system_index.cpu().numpy()
    for s in range(batch.n_systems):
        rows = np.nonzero(si == s)[0]
        cell = batch.cell[s].detach().double().cpu().numpy()
        pbc = batch.pbc[s].cpu().tolist()
        for i, j, *shift in brute_edges(pos[rows], cell, pbc, cutoff):
            out.add((int(rows[i]), int(rows[j]), *shift))
    return out


def edge_set(edges: EdgeList) -> set[Edge]:
    """The edges as a set of ``(i, j, Sx, Sy, Sz)``; fails on duplicates."""
    rows = torch.cat(
        [edges.receivers[:, None], edges.senders[:, None], edges.shifts], dim=1
    ).tolist()
    out = {tuple(r) for r in rows}
    assert len(out) == len(rows), f"{len(rows) - len(out)} duplicated edges"
    return out  # type: ignore[return-value]


PairParams = Callable[[int, int], tuple[float, float]]


def brute_lj(
    batch: Batch, cutoff: float, params: PairParams, shift: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Dense all-pairs, all-images Lennard-Jones of every system.

    Returns ``(energy (S,), forces (N, 3), atom_energies (N,), virial (S, 3, 3))``
    with ``virial = sum_pairs r (x) f`` (``-dE/d strain``).
    """
    pos = batch.positions.detach().double().cpu().numpy()
    z = batch.atomic_numbers.cpu().numpy()
    si = batch.system_index.cpu().numpy()
    n_sys = batch.n_systems
    energy = np.zeros(n_sys)
    forces = np.zeros_like(pos)
    atom_e = np.zeros(len(pos))
    virial = np.zeros((n_sys, 3, 3))
    for s in range(n_sys):
        rows = np.nonzero(si == s)[0]
        if len(rows) == 0:
            continue
        x = pos[rows]
        eps = np.array([[params(int(a), int(b))[0] for b in z[rows]] for a in z[rows]])
        sig = np.array([[params(int(a), int(b))[1] for b in z[rows]] for a in z[rows]])
        cell = batch.cell[s].detach().double().cpu().numpy()
        pbc = batch.pbc[s].cpu().tolist()
        for img in itertools.product(*image_ranges(cell, pbc, cutoff)):
            d = x[None, :, :] + np.asarray(img, dtype=np.float64) @ cell - x[:, None, :]
            r2 = (d * d).sum(-1)
            mask = r2 < cutoff * cutoff
            if img == (0, 0, 0):
                np.fill_diagonal(mask, False)
            r2 = np.where(mask, r2, 1.0)
            sr6 = (sig * sig / r2) ** 3
            phi = 4 * eps * (sr6 * sr6 - sr6)
            if shift:
                src6 = (sig / cutoff) ** 6
                phi = phi - 4 * eps * (src6 * src6 - src6)
            dphi_over_r = -24 * eps * (2 * sr6 * sr6 - sr6) / r2  # phi'(r) / r
            phi = np.where(mask, phi, 0.0)
            dphi_over_r = np.where(mask, dphi_over_r, 0.0)
            atom_e[rows] += 0.5 * phi.sum(1)
            # F_i = sum_j phi'(r) r_hat_ij, r_ij pointing from i to j
            forces[rows] += (dphi_over_r[:, :, None] * d).sum(1)
            virial[s] -= 0.5 * np.einsum("ij,ija,ijb->ab", dphi_over_r, d, d)
        energy[s] = atom_e[rows].sum()
    return energy, forces, atom_e, virial


def jittered_lattice(
    n_per_axis: Sequence[int], cell: np.ndarray, jitter: float, seed: int
) -> np.ndarray:
    """Points on a grid of fractional coordinates, displaced at random (Cartesian)."""
    rng = np.random.default_rng(seed)
    grid = np.array(list(itertools.product(*(range(n) for n in n_per_axis))), dtype=np.float64)
    frac = (grid + 0.5) / np.asarray(n_per_axis, dtype=np.float64)
    return frac @ cell + rng.uniform(-jitter, jitter, size=(len(grid), 3))


def make_batch(
    positions: np.ndarray,
    cell: np.ndarray,
    pbc: Sequence[bool],
    numbers: Sequence[int] | int = 18,
    dtype: torch.dtype = torch.float64,
) -> Batch:
    """A one-system batch."""
    n = len(positions)
    z = [numbers] * n if isinstance(numbers, int) else list(numbers)
    return Batch(
        torch.tensor(positions, dtype=dtype),
        torch.tensor(z),
        cell=torch.tensor(cell, dtype=dtype),
        pbc=torch.tensor(pbc),
    )


def strained(batch: Batch, deform: torch.Tensor) -> Batch:
    """``batch`` with positions and cell of every system multiplied by ``deform`` (3, 3)."""
    return batch.replace(positions=batch.positions @ deform, cell=batch.cell @ deform)


def finite_strain_stress(
    energy: Callable[[Batch], torch.Tensor], batch: Batch, h: float = 1e-6
) -> torch.Tensor:
    """``(1/V) dE/d eps_ab`` by central differences, shape ``(n_systems, 3, 3)``."""
    volume = torch.linalg.det(batch.cell).abs()
    out = torch.zeros(batch.n_systems, 3, 3, dtype=torch.float64)
    for a in range(3):
        for b in range(3):
            step = torch.zeros(3, 3, dtype=batch.dtype)
            step[a, b] = h
            eye = torch.eye(3, dtype=batch.dtype)
            e_plus = energy(strained(batch, eye + step)).double()
            e_minus = energy(strained(batch, eye - step)).double()
            out[:, a, b] = (e_plus - e_minus) / (2 * h) / volume.double()
    return out


def finite_difference_forces(
    energy: Callable[[Batch], torch.Tensor], batch: Batch, h: float = 1e-5
) -> torch.Tensor:
    """``-dE/dx`` of the summed energy by central differences, shape ``(n_atoms, 3)``."""
    out = torch.zeros(batch.n_atoms, 3, dtype=torch.float64)
    for i in range(batch.n_atoms):
        for a in range(3):
            plus, minus = batch.positions.clone(), batch.positions.clone()
            plus[i, a] += h
            minus[i, a] -= h
            e_plus = energy(batch.replace(positions=plus)).sum().double()
            e_minus = energy(batch.replace(positions=minus)).sum().double()
            out[i, a] = -(e_plus - e_minus) / (2 * h)
    return out


@dataclass(frozen=True)
class GhostLayout:
    """One rank's ``[owned | ghost]`` rows of a periodic system, with open boundaries.

    ``batch`` has the owned rows first (``n_owned`` of them) and then one ghost
    row per periodic image ``(atom, S)`` that lies within the cutoff of an owned
    atom; ``source`` gives each row's atom in the original batch.
    """

    batch: Batch
    n_owned: int
    source: torch.Tensor


def ghost_layout(full: Batch, owned: torch.Tensor, cutoff: float) -> GhostLayout:
    """Emulate a domain-decomposed rank: ``owned`` rows plus their halo, open boundaries.

    Uses the brute-force pair search (one system only), so it shares no code
    with the package.
    """
    pos = full.positions.detach().double().cpu().numpy()
    cell = full.cell[0].detach().double().cpu().numpy()
    owned_list = owned.tolist()
    owned_set = set(owned_list)
    halo: list[tuple[int, tuple[int, int, int]]] = []
    seen: set[tuple[int, tuple[int, int, int]]] = set()
    for i, j, *s in sorted(brute_edges(pos, cell, full.pbc[0].tolist(), cutoff)):
        key = (j, (s[0], s[1], s[2]))
        if i not in owned_set or key in seen or (j in owned_set and key[1] == (0, 0, 0)):
            continue
        seen.add(key)
        halo.append(key)
    rows = owned_list + [j for j, _ in halo]
    shift = np.zeros((len(rows), 3))
    shift[len(owned_list) :] = np.array([s for _, s in halo], dtype=np.float64).reshape(-1, 3)
    new_pos = pos[rows] + shift @ cell
    source = torch.tensor(rows, dtype=torch.int64)
    batch = Batch(
        torch.tensor(new_pos, dtype=full.dtype),
        full.atomic_numbers[source],
        cell=full.cell.clone(),
        pbc=torch.zeros(1, 3, dtype=torch.bool),
        atom_ids=torch.arange(len(rows), dtype=torch.int64),
    )
    return GhostLayout(batch=batch, n_owned=len(owned_list), source=source)


def fold(values: torch.Tensor, source: torch.Tensor, n_atoms: int) -> torch.Tensor:
    """Sum per-row values into their source atoms (the reverse halo exchange)."""
    out = torch.zeros((n_atoms, *values.shape[1:]), dtype=values.dtype)
    return out.index_add(0, source, values.detach().cpu())


def saved_bytes(fn: Callable[[], Any]) -> tuple[int, Any]:
    """Bytes of the storages autograd saves for the backward while ``fn()`` runs (each
    storage once), and ``fn()``'s result."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(saved.values()), out


# ------------------------------------------------------------ host syncs
#: Tensor methods and functions that copy device data to the host (on a GPU they
#: wait for the device): reading values, converting to Python or NumPy, data-
#: dependent shapes (nonzero, boolean masks, unique), whole-tensor comparisons.
_SYNC_FUNCS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.__array__,
    torch.Tensor.__repr__,
    torch.Tensor.__format__,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.Tensor.unique,
    torch.unique,
    torch.Tensor.masked_select,
    torch.masked_select,
    torch.Tensor.equal,
    torch.equal,
    torch.Tensor.any,
    torch.Tensor.all,
}


class HostSyncCounter(TorchFunctionMode):
    """Counts torch calls that would synchronise a GPU with the host.

    Inside ``with HostSyncCounter() as counter:`` every listed call (see
    ``_SYNC_FUNCS``), every boolean-mask index, every ``.to(...)`` /
    ``.copy_`` to the CPU from another device, and every call of
    ``torch.cuda.synchronize`` / ``Event.synchronize`` / ``Stream.synchronize``
    is recorded in ``counter.calls`` (names, in order). ``any()`` / ``all()``
    count because their only use on the host path is ``bool(...)``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self._patched: list[tuple[object, str, object]] = []

    def __enter__(self) -> HostSyncCounter:
        for owner, name in (
            (torch.cuda, "synchronize"),
            (torch.cuda.Event, "synchronize"),
            (torch.cuda.Stream, "synchronize"),
        ):
            original = getattr(owner, name)
            self._patched.append((owner, name, original))
            setattr(
                owner, name, self._counting(f"{getattr(owner, '__name__', owner)}.{name}", original)
            )
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for owner, name, original in self._patched:
            setattr(owner, name, original)
        self._patched.clear()

    def _counting(self, label: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(label)
            return fn(*args, **kwargs)

        return wrapper

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", repr(func))
        if func in _SYNC_FUNCS:
            self.calls.append(name)
        elif func is torch.Tensor.__getitem__ or func is torch.Tensor.__setitem__:
            index = args[1] if len(args) > 1 else None
            parts = index if isinstance(index, tuple) else (index,)
            if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                self.calls.append(f"{name}[bool mask]")
        elif (func is torch.Tensor.to or func is torch.Tensor.copy_) and _moves_to_host(
            func, args, kwargs
        ):
            self.calls.append(f"{name}(cpu)")
        return func(*args, **kwargs)


def _moves_to_host(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a ``.to`` / ``.copy_`` call copies a tensor to the host: ``.to`` with a
    CPU target (counted on CPU too: in device code it is a device-to-host copy),
    or a blocking ``copy_`` from another device into a CPU tensor."""
    if func is torch.Tensor.copy_:
        dst, src = args[0], args[1]
        non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
        return (
            dst.device.type == "cpu"
            and src.device.type != "cpu"
            and not (non_blocking and dst.is_pinned())
        )
    targets = [*args[1:], kwargs.get("device")]
    return any(
        (isinstance(t, str) and t.startswith("cpu"))
        or (isinstance(t, torch.device) and t.type == "cpu")
        for t in targets
    )
