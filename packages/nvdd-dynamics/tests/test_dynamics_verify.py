"""Never silently wrong: ``partition`` checks a model it does not ship, decomposed
against one process, and refuses it on every rank when they differ."""

from __future__ import annotations

import pytest
import torch
from dyn_models import SoftPair, ToyMP, soft_pair_mpnn_spec
from test_dynamics_domain_parallel import make_gas

from nvdd.core import Batch, ConfigurationError, ModelOutputs
from nvdd.dynamics import DomainConfig, DomainParallel, VelocityVerlet
from nvdd.dynamics._verify import PROBE_MAX_ATOMS, needs_verification, probe_batch
from nvdd.spec import SPEC_MPNN_GP, SPEC_MPNN_HALO, BaseModelMixin, MLIPSpec, StrategyKind
from nvdd.testing import run_ranks

pytestmark = pytest.mark.gloo


class PlainMP(BaseModelMixin, torch.nn.Module):
    """Two message-passing layers written as on one process: no verbs, no
    adapters, the energy summed over every row it is given."""

    cutoff = 2.5

    def distribution_spec(self, strategy: StrategyKind = StrategyKind.HALO) -> MLIPSpec:
        return SPEC_MPNN_GP if strategy is StrategyKind.GRAPH_PARTITION else SPEC_MPNN_HALO

    def forward(self, batch: Batch) -> ModelOutputs:
        pos = batch.positions.detach().requires_grad_(True)
        d = torch.linalg.vector_norm(pos[None] - pos[:, None], dim=-1)
        w = torch.where(d < self.cutoff, (1 - d / self.cutoff) ** 2, torch.zeros_like(d))
        w = w * (~torch.eye(len(pos), dtype=torch.bool))
        h = torch.ones(len(pos), 1, dtype=pos.dtype)
        for _ in range(2):
            h = h + w @ h
        energy = (h[:, 0] ** 2).sum().reshape(1)
        (grad,) = torch.autograd.grad(energy.sum(), pos)
        return {"energy": energy, "forces": -grad}


def _run(
    model: torch.nn.Module,
    batch: Batch,
    verify: bool | None,
    strategy: StrategyKind = StrategyKind.HALO,
) -> str:
    dyn = VelocityVerlet(model, batch, dt_fs=0.5)
    config = DomainConfig(
        cutoff=float(model.cutoff), skin=0.2, verify_model=verify, strategy=strategy
    )
    try:
        with DomainParallel(dyn, config) as dp:
            dp.partition()
            dp.run(2)
    except ConfigurationError as exc:
        return str(exc)
    return "ran"


def _open_gas() -> Batch:
    return make_gas(n=40, pbc=(False, False, False))


def test_a_plain_message_passing_model_is_refused_on_every_rank() -> None:
    for message in run_ranks(_run, 2, PlainMP(), _open_gas(), None, timeout_s=120):
        assert "PlainMP with spec 'SPEC_MPNN_HALO' gives different results decomposed" in message
        assert "silently wrong" in message and "refresh_neighbors" in message
        assert "spec=nvdd.spec.receptive_field_spec(layers=L)" in message  # the safe path
        assert "forces: max abs error" in message  # the validation report follows
    gp = StrategyKind.GRAPH_PARTITION
    for message in run_ranks(_run, 2, PlainMP(), _open_gas(), None, gp, timeout_s=120):
        assert "PlainMP with spec 'SPEC_MPNN_GP' gives different results decomposed" in message


def test_the_missing_refresh_is_named_and_the_check_can_be_switched_off() -> None:
    for message in run_ranks(_run, 2, ToyMP(), _open_gas(), None, timeout_s=120):
        assert "first module whose per-atom output differs: layers.1" in message
    assert run_ranks(_run, 2, ToyMP(), _open_gas(), False, timeout_s=120) == ["ran", "ran"]


def _twice(model: torch.nn.Module, batch: Batch) -> list[int]:
    """Two scopes over one model: the check runs in the first only."""
    calls = []
    for _ in range(2):
        before = model.calls
        assert _run(model, batch.clone(), None) == "ran"
        calls.append(model.calls - before)
    return calls


class CountingPair(SoftPair):
    def __init__(self) -> None:
        super().__init__(spec=SPEC_MPNN_HALO)
        self.calls = 0

    def forward(self, batch: Batch) -> ModelOutputs:
        self.calls += 1
        return super().forward(batch)


def test_an_exact_model_passes_once_per_process() -> None:
    first, second = run_ranks(_twice, 2, CountingPair(), make_gas(n=40), timeout_s=120)[0]
    assert first > second  # the reference and the decomposed check forwards, once
    assert run_ranks(_run, 2, soft_pair_mpnn_spec(), make_gas(n=40), None) == ["ran", "ran"]


def test_which_models_are_checked() -> None:
    from nvdd.models import MPNNConfig, ReferenceMPNN

    shipped = ReferenceMPNN(MPNNConfig(cutoff=3.0, species=(1,), hidden=4, n_layers=2))
    mpnn = shipped.distribution_spec()
    assert not needs_verification(shipped, mpnn, None)  # nvdd's own, conformance-tested
    assert needs_verification(PlainMP(), mpnn, None)
    direct = SoftPair()  # direct forces, a pair model
    assert not needs_verification(direct, direct.distribution_spec(), None)
    assert needs_verification(direct, direct.distribution_spec(), True)
    assert not needs_verification(PlainMP(), mpnn, False)
    with pytest.raises(ConfigurationError, match="verify_model must be None or a bool"):
        DomainConfig(cutoff=1.0, verify_model="yes")  # type: ignore[arg-type]


def test_the_probe_of_a_large_system_is_an_open_sphere_of_its_atoms() -> None:
    g = torch.Generator().manual_seed(1)
    n = 3 * PROBE_MAX_ATOMS
    cell = torch.eye(3, dtype=torch.float64) * 40.0
    batch = Batch(
        positions=torch.rand(n, 3, generator=g, dtype=torch.float64) * 40.0 - 5.0,  # some outside
        atomic_numbers=torch.full((n,), 18),
        cell=cell,
        pbc=[True, True, True],
    )
    small = make_gas(n=40)
    assert probe_batch(small, 3.0) is small
    probe = probe_batch(batch, 3.0)
    assert probe is not None and 0 < probe.n_atoms <= PROBE_MAX_ATOMS
    assert not bool(probe.pbc.any())
    centre = torch.full((3,), 20.0, dtype=torch.float64)
    assert float((probe.positions - centre).norm(dim=1).max()) < 9.0 + 1e-12
    ids = probe.atom_ids
    wrapped = torch.remainder(batch.positions[ids], 40.0)  # ids are the original rows
    assert torch.allclose(probe.positions, wrapped, rtol=0, atol=1e-12)
    several = Batch.concatenate([batch, batch], validate=False)
    assert probe_batch(several, 3.0) is None


class RefusesInAGroup(SoftPair):
    """Will not run on one process while a process group exists (as a model that
    starts its own graph parallelism might)."""

    def __init__(self) -> None:
        super().__init__(spec=SPEC_MPNN_HALO)

    def forward(self, batch: Batch) -> ModelOutputs:
        import torch.distributed as dist

        from nvdd.shardtensor import current_dd_context

        if dist.is_initialized() and not current_dd_context().is_distributed:
            raise RuntimeError("no single-process runs inside a group")
        return super().forward(batch)


def _unchecked(model: torch.nn.Module, batch: Batch) -> tuple[str, list[str]]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _run(model, batch, None)
    return result, [str(w.message) for w in caught if "was not checked" in str(w.message)]


def test_a_model_that_cannot_run_on_one_process_in_a_group_is_not_checked_and_says_so() -> None:
    for result, notes in run_ranks(_unchecked, 2, RefusesInAGroup(), make_gas(n=40)):
        assert result == "ran"  # every rank learnt of rank 0's failure: nobody hangs
        assert len(notes) == 1 and "the single-process reference run raised on rank 0" in notes[0]
        assert "no single-process runs inside a group" in notes[0]
