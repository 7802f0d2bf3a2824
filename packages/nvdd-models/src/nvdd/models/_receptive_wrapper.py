"""What every receptive-field wrapper of a foundation model shares.

:class:`~nvdd.models.SevenNetModel`, :class:`~nvdd.models.UMAModel` and
:class:`~nvdd.models.AIMNet2Model` each wrap a third-party model that runs
unmodified on a batch's rows under :func:`nvdd.spec.receptive_field_spec`
(``fold=True``, record 0067): a halo of ``layers x cutoff + skin`` around every
owned atom, the forces the derivative of the owned rows' energies. They share
the optional import of their package (:class:`OptionalPackage`), the checks of
the ``skin`` / ``dtype`` arguments and the conversion of the model (dtype,
device, frozen weights: :meth:`ReceptiveFieldWrapper._convert`), the ``cutoff`` / ``dtype``
properties, the batch's dtype check, the receptive-field spec and the outputs
by autograd of the per-atom energies (:class:`ReceptiveFieldWrapper`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from nvdd.core import Batch, ModelOutputs, ValidationError, import_optional
from nvdd.models._checks import check_positive, config_error
from nvdd.models._forces import freeze_parameters
from nvdd.models._verlet import VerletList
from nvdd.spec import BaseModelMixin, MLIPSpec, StrategyKind, receptive_field_spec

__all__ = ["OptionalPackage", "ReceptiveFieldWrapper"]


@dataclass(frozen=True)
class OptionalPackage:
    """The modules of an optional package, imported with the extra's install hint.

    ``OptionalPackage("sevenn", "nvdd-models[sevenn]", "SevenNetModel")("sevenn.util")``
    is ``import_optional("sevenn.util", package="sevenn", feature="SevenNetModel",
    extra="nvdd-models[sevenn]")``; a call may name another feature (a classmethod).
    """

    package: str
    extra: str
    feature: str

    def __call__(self, name: str, feature: str | None = None) -> Any:
        """The module ``name``; without the package an ``OptionalDependencyError``
        naming ``feature`` (default: the wrapper) and the pip command."""
        return import_optional(
            name, package=self.package, feature=feature or self.feature, extra=self.extra
        )


class ReceptiveFieldWrapper(BaseModelMixin, torch.nn.Module):
    """Base of the wrappers that run a model unmodified on a receptive-field halo.

    A subclass names its wrapped module's attribute (``_wrapped``) and the model
    in messages (``_label``), and sets ``_cutoff``, ``layers`` and ``neighbors``
    in its constructor.
    """

    #: The attribute holding the wrapped module (its parameters give :attr:`dtype`).
    _wrapped: ClassVar[str]
    #: The model's name in the dtype error ("the <label> parameters are ...").
    _label: ClassVar[str]
    _cutoff: float
    layers: int
    neighbors: VerletList

    @staticmethod
    def _check_arguments(skin: float, dtype: torch.dtype | None) -> None:
        """The constructor's ``skin`` (>= 0) and ``dtype`` (float32, float64 or None)."""
        check_positive("skin", skin, allow_zero=True)
        if dtype is not None and dtype not in (torch.float32, torch.float64):
            raise config_error(f"dtype must be torch.float32 or torch.float64, got {dtype}")

    @staticmethod
    def _convert(
        model: torch.nn.Module,
        dtype: torch.dtype | None,
        device: torch.device | str | None,
        *,
        freeze: bool,
    ) -> torch.nn.Module:
        """``model`` in ``dtype`` on ``device`` (each kept where None), in eval mode,
        its parameters frozen if ``freeze`` (:func:`~nvdd.models._forces.freeze_parameters`)."""
        if dtype is not None or device is not None:
            model = model.to(dtype=dtype, device=device)
        if freeze:
            freeze_parameters(model)
        return model.eval()

    # ---------------------------------------------------------- properties
    @property
    def cutoff(self) -> float:
        """The model's cutoff (Angstrom): the radius of :attr:`neighbors`."""
        return self._cutoff

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype."""
        wrapped: torch.nn.Module = getattr(self, self._wrapped)
        return next(wrapped.parameters()).dtype

    # ---------------------------------------------------------------- spec
    def _extra_reach(self) -> float:
        """Angstrom of halo beyond ``layers x cutoff`` (0 unless a subclass needs more)."""
        return 0.0

    def distribution_spec(self, strategy: StrategyKind | str = StrategyKind.HALO) -> MLIPSpec:
        """``receptive_field_spec(layers=self.layers, strategy=strategy, fold=True)``.

        The model runs unmodified on ``[owned | ghost]`` rows of a halo of
        ``layers x cutoff + skin`` (under ``HALO`` explicit images, under
        ``GRAPH_PARTITION`` the atoms themselves); owned atoms' energies are
        exact there, and the forces are the derivative of their sum, ghost
        rows' parts folded to their owners (record 0067).
        """
        return receptive_field_spec(
            layers=self.layers,
            strategy=strategy,
            fold=True,
            extra_ghost_width=self._extra_reach(),
        )

    # ------------------------------------------------------------- physics
    def _outputs(
        self, batch: Batch, atom_energies: Callable[[torch.Tensor], torch.Tensor]
    ) -> ModelOutputs:
        """Energy, forces and per-atom energies of ``batch`` from ``atom_energies``
        (the model's per-atom energies at the given positions, shape ``(n_rows,)``).

        When ``batch.positions`` already requires grad (the runtime's autograd leaf
        under a receptive-field spec) the outputs keep their graph and no forces
        are returned: the caller differentiates ``atom_energies`` (or ``energy``).
        Otherwise the forces are ``-dE/dx`` by autograd and every output is
        detached.
        """
        given = batch.positions.requires_grad
        positions = batch.positions if given else batch.positions.detach().requires_grad_(True)
        with torch.enable_grad():
            atom = atom_energies(positions)
            energy = atom.new_zeros(batch.n_systems).index_add(0, batch.system_index, atom)
            if given:
                return {"energy": energy, "atom_energies": atom}
            (grad,) = torch.autograd.grad(energy.sum(), positions, allow_unused=True)
        forces = -grad if grad is not None else torch.zeros_like(positions)
        return {
            "energy": energy.detach(),
            "forces": forces.detach(),
            "atom_energies": atom.detach(),
        }

    def _check_dtype(self, batch: Batch) -> None:
        """The batch in the parameters' dtype (on the host, every call)."""
        if batch.dtype != self.dtype:
            raise ValidationError(
                f"batch is {batch.dtype} but the {self._label} parameters are {self.dtype}; "
                f"convert one of them ({type(self).__name__}(..., dtype={batch.dtype}) or "
                f"batch.to(dtype={self.dtype}))"
            )
