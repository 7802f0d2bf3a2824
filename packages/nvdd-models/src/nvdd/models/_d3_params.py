"""DFT-D3(BJ) parameters: reference tables and functional damping parameters.

Every number comes from files that install with ``tad-dftd3`` (extra
``nvdd-models[longrange]``): the reference C6 coefficients and coordination
numbers of Grimme's D3 (``tad_dftd3/reference-c6.pt``), the ``<r4>/<r2>``
expectation values, the D3 covalent radii (``tad-mctc``) and the BJ damping
parameters of every functional s-dftd3 knows (``parameters.toml``). Nothing is
downloaded at run time.

Why not the other sources: nvalchemi-toolkit-ops ships D3 kernels but no
parameters (its examples fetch them) and returns float32 energies and forces,
which cannot meet the float64 N-ranks-vs-1 tolerance; torch-dftd ships its
parameters but depends on pymatgen.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from nvdd.core import OptionalDependencyError

__all__ = [
    "ANGSTROM_TO_BOHR",
    "D3Tables",
    "HARTREE_TO_EV",
    "MAX_Z_D3",
    "d3_tables",
    "functional_bj",
]

#: Conversion factors used by tad-dftd3 / tad-mctc (CODATA 2018).
ANGSTROM_TO_BOHR = 1.8897261254578281
HARTREE_TO_EV = 27.211386019495706
#: Largest atomic number with D3 reference data.
MAX_Z_D3 = 103


def _tad(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise OptionalDependencyError(
            "tad-dftd3", "DFT-D3", extra="nvdd-models[longrange]", cause=exc
        ) from exc


@dataclass(frozen=True)
class D3Tables:
    """The D3 reference tables (float64, CPU), indexed by atomic number (row 0 unused).

    Attributes
    ----------
    rcov:
        Covalent radii scaled by 4/3 (Bohr), shape ``(104,)``.
    r4r2:
        ``sqrt(0.5 <r4>/<r2> sqrt(Z))``, shape ``(104,)``.
    ref_cn:
        Reference coordination numbers, ``-1`` where a reference is absent, ``(104, 7)``.
    ref_c6:
        Reference C6 (Hartree Bohr^6), shape ``(104, 104, 7, 7)``.
    """

    rcov: torch.Tensor
    r4r2: torch.Tensor
    ref_cn: torch.Tensor
    ref_c6: torch.Tensor


@cache
def d3_tables() -> D3Tables:
    """Load the tables once per process (about 4 MB)."""
    ref = _tad("tad_dftd3.reference").Reference(dtype=torch.float64)
    r4r2 = _tad("tad_dftd3.data").R4R2(dtype=torch.float64)
    rcov = _tad("tad_mctc.data.radii").COV_D3(dtype=torch.float64)
    return D3Tables(
        rcov=rcov[: MAX_Z_D3 + 1].clone(),
        r4r2=r4r2[: MAX_Z_D3 + 1].clone(),
        ref_cn=ref.cn[: MAX_Z_D3 + 1].clone(),
        ref_c6=ref.c6[: MAX_Z_D3 + 1, : MAX_Z_D3 + 1].clone(),
    )


def functional_bj(name: str) -> dict[str, float]:
    """The D3(BJ) damping parameters ``s6, s8, a1, a2`` (``a2`` in Bohr) of a functional.

    Raises
    ------
    KeyError
        For a functional tad-dftd3 does not know, or one without BJ parameters.
    """
    module = _tad("tad_dftd3.param.functional")
    try:
        params = module.get_functional_params(name, damping="bj", dtype=torch.float64)
    except (KeyError, ValueError) as exc:
        reason = exc.args[0] if exc.args else type(exc).__name__
        raise KeyError(f"no D3(BJ) parameters for functional {name!r} ({reason})") from exc
    return {k: float(params[k]) for k in ("s6", "s8", "a1", "a2")}
