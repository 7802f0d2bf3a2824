"""Configuration of the Lennard-Jones model: species parameters and mixing rules."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeVar

import torch

from nvdd.models._checks import check_positive, config_error
from nvdd.models._species import MAX_Z, species_table

__all__ = ["ForceMode", "LJBackend", "LJConfig", "MixingRule"]


class ForceMode(enum.Enum):
    """How a pair model produces forces (and the virial)."""

    #: Analytic pair forces summed over edges (no autograd graph).
    DIRECT = "direct"
    #: ``-dE/dx`` (and ``dE/d strain``) by autograd through the energy.
    AUTOGRAD = "autograd"


class LJBackend(enum.Enum):
    """Which implementation evaluates a Lennard-Jones model with direct forces."""

    #: Warp whenever it is exact for the inputs (direct forces, plain float32 /
    #: float64 tensors on CPU or CUDA, fewer than 4096 systems), torch otherwise.
    AUTO = "auto"
    #: The Warp kernels over the device neighbour list (an error when not applicable).
    WARP = "warp"
    #: The torch reference over the vesin Verlet list (any device, tensor subclasses).
    TORCH = "torch"


class MixingRule(enum.Enum):
    """How unlike-pair parameters follow from per-species ones."""

    #: ``sigma_ab = (sigma_a + sigma_b) / 2``, ``epsilon_ab = sqrt(epsilon_a epsilon_b)``.
    LORENTZ_BERTHELOT = "lorentz_berthelot"
    #: ``sigma_ab = sqrt(sigma_a sigma_b)``, ``epsilon_ab = sqrt(epsilon_a epsilon_b)``.
    GEOMETRIC = "geometric"


_K = TypeVar("_K")
_V = TypeVar("_V")


def _frozen(mapping: Mapping[_K, _V]) -> Mapping[_K, _V]:
    """A read-only copy with keys in a fixed order (hashing and repr are stable)."""
    return MappingProxyType(dict(sorted(mapping.items(), key=lambda kv: repr(kv[0]))))


@dataclass(frozen=True)
class LJConfig:
    """A Lennard-Jones potential ``4 eps ((sigma/r)**12 - (sigma/r)**6)``.

    Parameters
    ----------
    cutoff:
        Pairs with ``r >= cutoff`` do not interact (Angstrom).
    epsilon, sigma:
        Parameters (eV, Angstrom) of every element not listed in ``species``.
        Leave both None to make unlisted elements an error.
    species:
        ``{atomic_number: (epsilon, sigma)}`` per element.
    pairs:
        ``{(Z_a, Z_b): (epsilon, sigma)}``: explicit parameters of a pair of
        listed elements, overriding the mixing rule (order does not matter).
    mixing:
        The rule that combines per-species parameters of unlike pairs.
    shift_energy:
        Subtract each pair's energy at the cutoff, so that ``E(cutoff) = 0``
        (forces are unchanged).
    force_mode:
        Direct pair forces or autograd; both give the same numbers.
    skin:
        Verlet skin of the model's neighbour list (Angstrom): the list holds the
        pairs within ``cutoff + skin`` and is searched again once some atom has
        moved ``skin / 2``. Any value is exact; 0 (the default) searches at
        every step. About 1 A suits argon at ``cutoff=8.5`` (what ``nvdd run``
        and the examples use); more means fewer searches and more pairs per
        step.
    backend:
        :class:`LJBackend`: Warp kernels (``AUTO`` picks them when they apply)
        or the torch reference. Both give the same numbers (float64 to
        rounding); Warp keeps its neighbour list on the device and does not
        synchronise with the host in a step that rebuilds nothing.
    half_list:
        Warp backend: store each pair once (forces on the second atom by
        atomics) or twice (each row gathers its own; no atomics, twice the
        pair terms). Same results; which is faster depends on the GPU.
    atom_virials:
        Also return ``atom_virials``, shape ``(n_atoms, 3, 3)``: each pair's
        virial ``-phi'(r) r (x) r / r`` split half and half between its two
        atoms, so that they sum to ``virial`` (``-dE/d strain``, so
        ``stress = -sum(atom_virials) / V``). Off by default: the Warp backend
        then runs its per-atom kernel variant (six more atomics per pair in a
        half list), the torch backend one more scatter.
    """

    cutoff: float
    epsilon: float | None = None
    sigma: float | None = None
    species: Mapping[int, tuple[float, float]] = field(default_factory=dict)
    pairs: Mapping[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    mixing: MixingRule = MixingRule.LORENTZ_BERTHELOT
    shift_energy: bool = True
    force_mode: ForceMode = ForceMode.DIRECT
    skin: float = 0.0
    backend: LJBackend = LJBackend.AUTO
    half_list: bool = True
    atom_virials: bool = False

    def __post_init__(self) -> None:
        check_positive("cutoff", self.cutoff)
        check_positive("skin", self.skin, allow_zero=True)
        if (self.epsilon is None) != (self.sigma is None):
            raise config_error(
                f"give epsilon and sigma together (got epsilon={self.epsilon!r}, "
                f"sigma={self.sigma!r})"
            )
        if self.epsilon is not None and self.sigma is not None:
            _check_pair("default", self.epsilon, self.sigma)
        if not self.species and self.epsilon is None:
            raise config_error("LJConfig needs species parameters or a default epsilon/sigma")
        for z, params in self.species.items():
            if isinstance(z, bool) or not isinstance(z, int) or not 0 <= z <= MAX_Z:
                raise config_error(f"species key {z!r} is not an atomic number in 0..{MAX_Z}")
            _check_pair(f"species {z}", *params)
        for key, params in self.pairs.items():
            if len(key) != 2 or any(z not in self.species for z in key):
                raise config_error(
                    f"pairs key {key!r} must be two atomic numbers listed in species "
                    f"{sorted(self.species)}"
                )
            _check_pair(f"pair {key}", *params)
        if not isinstance(self.mixing, MixingRule):
            object.__setattr__(self, "mixing", MixingRule(self.mixing))
        if not isinstance(self.force_mode, ForceMode):
            object.__setattr__(self, "force_mode", ForceMode(self.force_mode))
        if not isinstance(self.backend, LJBackend):
            object.__setattr__(self, "backend", LJBackend(self.backend))
        if self.backend is LJBackend.WARP and self.force_mode is not ForceMode.DIRECT:
            raise config_error(
                f"backend={self.backend.value!r} computes direct forces; it cannot be combined "
                f"with force_mode={self.force_mode.value!r} (use backend='auto' or 'torch')"
            )
        if not isinstance(self.half_list, bool):
            raise config_error(f"half_list must be a bool, got {self.half_list!r}")
        if not isinstance(self.atom_virials, bool):
            raise config_error(f"atom_virials must be a bool, got {self.atom_virials!r}")
        object.__setattr__(self, "species", _frozen(self.species))
        object.__setattr__(self, "pairs", _frozen(self.pairs))

    def __hash__(self) -> int:
        return hash(
            (
                self.cutoff,
                self.epsilon,
                self.sigma,
                tuple(self.species.items()),
                tuple(self.pairs.items()),
                self.mixing,
                self.shift_energy,
                self.force_mode,
                self.skin,
                self.backend,
                self.half_list,
                self.atom_virials,
            )
        )

    def __reduce__(self) -> tuple[type[LJConfig], tuple[object, ...]]:
        # The read-only mappings do not pickle; rebuild from plain dicts.
        return (
            LJConfig,
            (
                self.cutoff,
                self.epsilon,
                self.sigma,
                dict(self.species),
                dict(self.pairs),
                self.mixing,
                self.shift_energy,
                self.force_mode,
                self.skin,
                self.backend,
                self.half_list,
                self.atom_virials,
            ),
        )

    def tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(rows, epsilon, sigma)``: the lookup tables the model uses.

        ``rows``: int64 ``(MAX_Z + 1,)``, atomic number -> species row (``-1``
        when unknown). ``epsilon``, ``sigma``: float64 ``(n_rows, n_rows)``
        pair tables after mixing and explicit overrides; symmetric.
        """
        zs = sorted(self.species)
        eps = [self.species[z][0] for z in zs]
        sig = [self.species[z][1] for z in zs]
        default_row = None
        if self.epsilon is not None and self.sigma is not None:
            default_row = len(zs)
            eps.append(self.epsilon)
            sig.append(self.sigma)
        rows = species_table(zs, default_row)
        e = torch.tensor(eps, dtype=torch.float64)
        s = torch.tensor(sig, dtype=torch.float64)
        eps_table = torch.sqrt(e[:, None] * e[None, :])
        if self.mixing is MixingRule.LORENTZ_BERTHELOT:
            sig_table = 0.5 * (s[:, None] + s[None, :])
        else:
            sig_table = torch.sqrt(s[:, None] * s[None, :])
        for (za, zb), (pe, ps) in self.pairs.items():
            a, b = int(rows[za]), int(rows[zb])
            eps_table[a, b] = eps_table[b, a] = pe
            sig_table[a, b] = sig_table[b, a] = ps
        return rows, eps_table, sig_table


def _check_pair(what: str, *params: float) -> None:
    if len(params) != 2 or not all(isinstance(p, int | float) for p in params):
        raise config_error(f"{what}: expected (epsilon, sigma), got {params!r}")
    epsilon, sigma = params
    if not (math.isfinite(epsilon) and epsilon >= 0 and math.isfinite(sigma) and sigma > 0):
        raise config_error(
            f"{what}: need epsilon >= 0 and sigma > 0, got epsilon={epsilon!r}, sigma={sigma!r}"
        )
