"""Helpers of the ensemble tests: an ASE calculator around an nvdd model (so ASE's
own NVT / NPT integrators are an independent oracle) and the rank bodies."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from ase.calculators.calculator import Calculator, all_changes

from nvdd.core import Batch


class NvddCalculator(Calculator):  # type: ignore[misc]
    """Energy, forces and stress of an nvdd model for one ASE ``Atoms``."""

    implemented_properties = ["energy", "free_energy", "forces", "stress"]  # noqa: RUF012

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def calculate(
        self, atoms: Any = None, properties: Any = ("energy",), system_changes: Any = all_changes
    ) -> None:
        super().calculate(atoms, properties, system_changes)
        b = Batch(
            positions=torch.tensor(self.atoms.positions),
            atomic_numbers=torch.tensor(self.atoms.numbers),
            cell=torch.tensor(np.array(self.atoms.cell)),
            pbc=list(self.atoms.pbc),
        )
        out = self.model(b)
        s = out["stress"][0].detach().numpy()
        energy = float(out["energy"][0].detach())
        self.results = {
            "energy": energy,
            "free_energy": energy,
            "forces": out["forces"].detach().numpy(),
            "stress": np.array([s[0, 0], s[1, 1], s[2, 2], s[1, 2], s[0, 2], s[0, 1]]),
        }
