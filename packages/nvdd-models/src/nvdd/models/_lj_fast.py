"""The Warp path of `LennardJones`: per-row kernel outputs over a `DeviceVerletList`.

Host work per call is a handful of launches and no device-to-host copy: the
species rows of the atoms and the parameter tables are cached (by tensor
identity and version, and by dtype and device), the neighbour list decides on
the device whether to rebuild, and per-system sums are torch reductions.
"""

from __future__ import annotations

import torch

from nvdd.core import sum_by_system
from nvdd.models._device_buffers import NeighborMatrix, TensorMemo
from nvdd.models._device_neighbors import DeviceVerletList
from nvdd.models._lj_kernels import lj_atom_virial_kernel, lj_kernel
from nvdd.models._warp import Kernel, declare_overloads

__all__ = ["LJKernelOutputs", "WarpLJ", "virial_by_system", "voigt_to_matrices"]


#: Voigt column of each entry of the row-major 3x3 virial (columns xx yy zz yz xz xy).
_VOIGT_TO_FULL = (0, 5, 4, 5, 1, 3, 4, 3, 2)
_VOIGT_INDEX: dict[torch.device, torch.Tensor] = {}

LJKernelOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


class WarpLJ:
    """Species rows, parameter tables and the device neighbour list of one model.

    Parameters
    ----------
    cutoff:
        Interaction cutoff (Angstrom).
    skin:
        Verlet skin of the device list.
    half:
        Half (one direction per pair, atomics) or full (gather) neighbour list.
    """

    def __init__(self, cutoff: float, skin: float, *, half: bool = True) -> None:
        self.cutoff = float(cutoff)
        self.neighbors = DeviceVerletList(cutoff, skin, half=half)
        self._kernel = Kernel(lj_kernel, floats=(8,))
        self._atom_kernel = Kernel(lj_atom_virial_kernel, floats=(8,))
        self._tables: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, ...]] = {}
        self._seen_numbers = TensorMemo()
        self._types: torch.Tensor | None = None

    def __getstate__(self) -> dict[str, object]:
        return {"cutoff": self.cutoff, "neighbors": self.neighbors}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.cutoff = float(state["cutoff"])  # type: ignore[arg-type]
        self.neighbors = state["neighbors"]  # type: ignore[assignment]
        self._kernel = Kernel(lj_kernel, floats=(8,))
        self._atom_kernel = Kernel(lj_atom_virial_kernel, floats=(8,))
        self._tables = {}
        self._seen_numbers = TensorMemo()
        self._types = None

    def reset(self) -> None:
        """Forget the neighbour list and the cached species rows."""
        self.neighbors.reset()
        self._seen_numbers = TensorMemo()
        self._types = None

    def forget_tables(self) -> None:
        """Drop cached parameter tables (after the model's buffers changed)."""
        self._tables = {}

    def knows(self, atomic_numbers: torch.Tensor) -> bool:
        """Whether ``atomic_numbers`` is the tensor (and version) of the cached rows."""
        return self._types is not None and self._seen_numbers.same(atomic_numbers)

    def species_rows(
        self, species_rows: torch.Tensor, atomic_numbers: torch.Tensor
    ) -> torch.Tensor:
        """Int32 species row of every atom (``species_rows[atomic_numbers]``).

        Cached while ``atomic_numbers`` is the same tensor at the same version;
        the caller checks the species of a tensor it has not seen.
        """
        if self._types is not None and self._seen_numbers.same(atomic_numbers):
            return self._types
        types = species_rows.index_select(0, atomic_numbers).to(torch.int32)
        self._types = types
        self._seen_numbers.remember(atomic_numbers)
        return types

    def tables(
        self,
        epsilon: torch.Tensor,
        sigma: torch.Tensor,
        shift: torch.Tensor,
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[torch.Tensor, ...]:
        """Flat ``(epsilon, sigma**2, shift)`` tables in ``dtype`` on ``device``."""
        key = (dtype, device)
        found = self._tables.get(key)
        if found is None:
            found = tuple(
                t.to(device=device, dtype=torch.float64).reshape(-1).to(dtype).contiguous()
                for t in (epsilon, sigma * sigma, shift)
            )
            self._tables[key] = found
        return found

    def __call__(
        self,
        positions: torch.Tensor,
        cell: torch.Tensor,
        system_index: torch.Tensor,
        types: torch.Tensor,
        n_types: int,
        tables: tuple[torch.Tensor, ...],
        matrix: NeighborMatrix,
        *,
        compute_virial: bool,
        ghost_forces: bool = True,
        atom_virials: bool = False,
    ) -> LJKernelOutputs:
        """Forces ``(n_atoms, 3)``, atom energies ``(n_atoms,)`` and the per-row
        virial ``(n_rows, 6)`` (Voigt ``xx yy zz yz xz xy``; None unless asked).

        ``ghost_forces=False``: complete forces on owned rows, zero on the others
        (see ``_lj_kernels``). ``atom_virials``: the virial is per atom instead,
        ``(n_atoms, 6)``, exact on owned rows and zero on the others (the
        variant kernel; ``compute_virial`` is implied)."""
        kernel = self._atom_kernel if atom_virials else self._kernel
        compute_virial = compute_virial or atom_virials
        declare_overloads(kernel)
        pos = positions.detach()
        dev, dtype = pos.device, pos.dtype
        n = int(pos.shape[0])
        rows = matrix.n_rows
        state = matrix.state
        if matrix.half:
            forces = torch.zeros_like(pos)
            energies = pos.new_zeros(n)
        else:
            forces = torch.empty_like(pos)
            energies = pos.new_empty(n)
        if atom_virials:  # every atom's row, added to (half list) or zero on unlisted rows
            virial = pos.new_zeros(n, 6)
        else:
            virial = pos.new_empty(rows if compute_virial else 1, 6)
        eps, sig2, shift = tables
        kernel(
            rows,
            [pos, system_index, cell.detach(), types, n_types, eps, sig2, shift,
             self.cutoff * self.cutoff, matrix.neighbors, matrix.codes, matrix.counts,
             int(matrix.periodic), matrix.n_receivers, int(matrix.half), int(compute_virial),
             int(ghost_forces), state.row_key, state.row_image, state.grid, state.slot_key,
             state.slot_count, state.slot_end, state.sorted_row, state.sorted_image, state.flags,
             forces, energies, virial],
            dev, dtype,
        )  # fmt: skip
        return forces, energies, virial if compute_virial else None


def virial_by_system(
    rows: torch.Tensor, system_index: torch.Tensor, n_systems: int
) -> torch.Tensor:
    """Sum per-row Voigt virials ``(n_rows, 6)`` into ``(n_systems, 3, 3)``.

    ``system_index`` covers at least the ``n_rows`` first rows.
    """
    voigt = sum_by_system(rows, system_index[: rows.shape[0]], n_systems)
    return voigt_to_matrices(voigt)


def voigt_to_matrices(voigt: torch.Tensor) -> torch.Tensor:
    """Symmetric matrices ``(n, 3, 3)`` of Voigt rows ``(n, 6)`` (``xx yy zz yz xz xy``)."""
    index = _VOIGT_INDEX.get(voigt.device)
    if index is None:  # built once per device: a host-to-device copy can stall the host
        index = torch.tensor(_VOIGT_TO_FULL, device=voigt.device)
        _VOIGT_INDEX[voigt.device] = index
    return voigt.index_select(1, index).reshape(-1, 3, 3)
