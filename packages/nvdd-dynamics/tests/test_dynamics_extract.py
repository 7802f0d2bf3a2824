"""`extract_forces`: the one place every force provider reads its forces from."""

from __future__ import annotations

import pathlib

import pytest
import torch

import nvdd.dynamics
from nvdd.core import ValidationError
from nvdd.dynamics._provider import extract_forces
from nvdd.spec import BaseModelMixin, ForceStrategy, as_model


class MyModel(BaseModelMixin):
    pass


class Plain:  # not a BaseModelMixin: completed by as_model, still named by its class
    pass


def _leaf(n: int = 4) -> torch.Tensor:
    return torch.arange(3.0 * n, dtype=torch.float64).reshape(n, 3).requires_grad_(True)


@pytest.mark.parametrize("strategy", list(ForceStrategy))
def test_the_models_own_forces_are_popped_and_detached(strategy: ForceStrategy) -> None:
    pos = _leaf()
    own = 2.0 * pos  # (still attached to the graph)
    raw = {"forces": own, "energy": (pos**2).sum().reshape(1)}
    forces = extract_forces(raw, pos, strategy, MyModel())
    assert torch.equal(forces, own.detach()) and not forces.requires_grad
    assert "forces" not in raw and "energy" in raw  # the rest is left to consolidation


def test_autograd_forces_are_minus_the_energy_gradient() -> None:
    pos = _leaf()
    raw = {"energy": (pos**2).sum(dim=1).reshape(2, 2).sum(dim=1)}  # two systems
    forces = extract_forces(raw, pos, ForceStrategy.AUTOGRAD, MyModel())
    assert torch.equal(forces, -2.0 * pos.detach()) and not forces.requires_grad


def test_an_energy_that_ignores_the_positions_gives_zero_forces() -> None:
    pos = _leaf()
    raw = {"energy": torch.ones(1, dtype=torch.float64, requires_grad=True)}
    forces = extract_forces(raw, pos, ForceStrategy.AUTOGRAD, MyModel())
    assert torch.equal(forces, torch.zeros(4, 3, dtype=torch.float64))


@pytest.mark.parametrize(
    ("strategy", "raw"),
    [
        (ForceStrategy.AUTOGRAD, {"stress": torch.zeros(1, 3, 3)}),
        (ForceStrategy.DIRECT, {"energy": torch.zeros(1)}),  # direct: no autograd fallback
    ],
)
def test_missing_forces_raise_naming_the_model_and_what_it_returned(
    strategy: ForceStrategy, raw: dict[str, torch.Tensor]
) -> None:
    with pytest.raises(ValidationError) as err:
        extract_forces(dict(raw), _leaf(), strategy, MyModel())
    msg = str(err.value)
    assert msg.startswith("MyModel returned neither 'forces' nor a differentiable 'energy'")
    assert str(sorted(raw)) in msg and str(strategy) in msg


def test_forces_without_one_row_per_position_raise_with_both_shapes() -> None:
    raw = {"forces": torch.zeros(3, 3)}
    with pytest.raises(ValidationError, match=r"^Plain: forces have shape \(3, 3\), .*\(4, 3\)"):
        extract_forces(raw, _leaf(), ForceStrategy.DIRECT, as_model(Plain()))


def test_no_other_runtime_module_differentiates_an_energy() -> None:
    """One copy: a second ``autograd.grad`` in nvdd-dynamics would be a second
    force extraction with its own rules."""
    src = pathlib.Path(nvdd.dynamics.__file__).parent
    users = sorted(p.name for p in src.glob("*.py") if "autograd.grad(" in p.read_text())
    assert users == ["_provider.py"]
