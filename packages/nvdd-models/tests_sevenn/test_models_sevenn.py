"""SevenNetModel: a SevenNet potential run unmodified under domain decomposition
through the receptive-field spec (issue 37 item 2, record 0067).

Needs the ``nvdd-models[sevenn]`` extra (its own nox session: ``./noxw -s
sevenn``); without it these tests skip, or fail where ``NVDD_REQUIRE_EXTRAS=1``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from nvdd.spec import StrategyKind
from nvdd.testing import (
    assert_dd_equivalent,
    assert_needs_extra,
    binary_lattice,
    importorskip_extra,
)

#: A tiny SevenNet: 2 interaction layers, 4 channels, lmax 1, cutoff 2.6 A.
CONFIG: dict[str, Any] = {
    "chemical_species": ["O", "Si"],
    "cutoff": 2.6,
    "channel": 4,
    "lmax": 1,
    "num_convolution_layer": 2,
    "weight_nn_hidden_neurons": [8],
}


def _sevenn() -> Any:
    return importorskip_extra("sevenn", reason="needs the nvdd-models[sevenn] extra")


def _model(dtype: torch.dtype = torch.float64, seed: int = 1) -> Any:
    _sevenn()
    from nvdd.models import SevenNetModel

    return SevenNetModel.from_config(CONFIG, seed=seed, dtype=dtype, skin=0.3)


def test_the_wrapper_is_sevennet_and_a_checkpoint_round_trips(tmp_path: Path) -> None:
    """On one process the wrapper equals sevenn's own ASE calculator (its graph
    builder, its force module) on a periodic and an open system; a checkpoint that
    sevenn's trainer writes loads back through sevenn's loader to the same model."""
    _sevenn()
    import numpy as np
    from ase import Atoms
    from sevenn.calculator import SevenNetCalculator
    from sevenn.model_build import build_E3_equivariant_model
    from sevenn.train.trainer import Trainer

    from nvdd.models import SevenNetModel

    model = _model(torch.float32, seed=3)
    assert model.layers == 2 and model.cutoff == 2.6 and model.atomic_numbers == [8, 14]
    spec = model.distribution_spec(StrategyKind.GRAPH_PARTITION)
    assert spec.name == "receptive_field(L=2, fold)"
    assert spec.options.receptive_field_layers == 2 and spec.options.receptive_field_fold
    full = model.sevennet.sevenn_config
    plain = build_E3_equivariant_model(full)  # sevenn's model, its force module kept
    plain.load_state_dict(model.sevennet.state_dict(), strict=False)
    batch = binary_lattice((4, 3, 3), spacing=1.9, seed=5).to(dtype=torch.float32)
    for pbc in ([True, True, True], [False, False, False]):
        b = batch.replace(pbc=torch.tensor([pbc]))
        got = model(b)
        atoms = Atoms(
            numbers=b.atomic_numbers.numpy(),
            positions=b.positions.numpy(),
            cell=b.cell[0].numpy(),
            pbc=pbc,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (sevenn: no tensor-product accelerator on CPU)
            atoms.calc = SevenNetCalculator(plain, file_type="model_instance", device="cpu")
            e_ref, f_ref = atoms.get_potential_energy(), atoms.get_forces()
        assert abs(float(got["energy"][0]) - e_ref) < 1e-5 * max(1.0, abs(e_ref)), pbc
        assert float(np.abs(got["forces"].numpy() - f_ref).max()) < 1e-5, pbc
        assert float(np.abs(f_ref).max()) > 1e-3  # forces that could be wrong
        assert torch.allclose(got["atom_energies"].sum(), got["energy"][0], atol=1e-5)

    # frozen weights by default (the forces need no weight gradient); freeze=False
    # keeps sevenn's trainable parameters and gives the same numbers
    assert not any(p.requires_grad for p in model.sevennet.parameters())
    kept = SevenNetModel.from_config(CONFIG, seed=3, dtype=torch.float32, skin=0.3, freeze=False)
    assert any(p.requires_grad for p in kept.sevennet.parameters())
    mine, theirs = model(batch), kept(batch)
    assert torch.equal(mine["forces"], theirs["forces"])
    assert torch.equal(mine["energy"], theirs["energy"])

    path = tmp_path / "checkpoint_tiny.pth"
    trainer = Trainer(plain, [], torch.optim.Adam, device="cpu")
    trainer.write_checkpoint(str(path), config=full, epoch=1)
    loaded = SevenNetModel.from_checkpoint(path)
    assert loaded.layers == 2 and loaded.cutoff == 2.6
    again, before = loaded(batch), model(batch)  # (float32: the same to rounding)
    assert float((again["forces"] - before["forces"]).abs().max()) < 1e-6
    assert float((again["energy"] - before["energy"]).abs().max()) < 1e-5
    assert loaded.sevennet.state_dict().keys() == model.sevennet.state_dict().keys()
    with pytest.raises(Exception, match="no file"):
        SevenNetModel.from_checkpoint(tmp_path / "missing.pth")


@pytest.mark.gloo
def test_sevennet_is_exact_under_domain_decomposition() -> None:
    """assert_dd_equivalent at 1e-10 (float64) on 2, 3 and 4 ranks, periodic and
    open, with nothing declared: the model's own spec (receptive field, L = 2,
    folded). One spawn per world size, both systems in it."""
    model = _model()
    report = assert_dd_equivalent(
        model, binary_lattice((4, 4, 4)), ranks=(2, 3, 4), steps=2, systems=("periodic", "open")
    )
    assert report.passed and len(report.cases) == 6
    assert "receptive_field(L=2, fold)" in report.spec
    assert all(c.errors["cross_rank_pairs"] > 0 for c in report.cases)
    assert all(c.errors["forces"] < 1e-10 for c in report.cases)


def test_without_sevenn_the_error_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """No sevenn (its import fails): an OptionalDependencyError naming the extra."""
    from nvdd.models import SevenNetModel

    calls = (
        lambda: SevenNetModel(torch.nn.Linear(1, 1)),
        lambda: SevenNetModel.from_config(CONFIG),
        lambda: SevenNetModel.from_checkpoint("checkpoint.pth"),
    )
    assert_needs_extra(monkeypatch, "sevenn", "nvdd-models[sevenn]", calls)
