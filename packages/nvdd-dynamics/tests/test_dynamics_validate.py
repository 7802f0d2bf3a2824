"""trace_and_validate: verdicts, per-module diagnostics, TorchScript and custom ops,
the spec in use, the launch modes (spawned ranks, the caller's ranks) and an auto-fix."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dyn_models import ScriptedToyMP, SoftPair, ToyMP, WeightedPair
from test_dynamics_domain_parallel import make_gas

from nvdd.core import Batch, ConfigurationError
from nvdd.dynamics import ValidationReport, describe_spec, trace_and_validate
from nvdd.dynamics._diagnose import Culprit
from nvdd.spec import (
    SPEC_LJ_HALO,
    DistributionSpec,
    MLIPSpec,
    OutputKind,
    OutputSpec,
    Reduce,
    StrategyKind,
)
from nvdd.testing import run_ranks

pytestmark = pytest.mark.gloo


def test_a_correct_spec_passes() -> None:
    report = trace_and_validate(SoftPair(), make_gas(n=36, triclinic=True), world_size=2)
    assert report.passed, report.summary()
    assert set(report.errors) == {"energy", "forces", "stress"}
    assert max(report.errors.values()) < 1e-10
    assert report.applied_fixes == [] and "PASSED" in report.summary()
    assert report.culprit is None and report.device == "cpu"


def test_uncovered_ghost_refresh_is_pinpointed_and_fixed() -> None:
    batch = make_gas(n=30, pbc=(False, False, False))
    report = trace_and_validate(ToyMP(), batch, world_size=2)
    assert not report.passed
    assert report.first_uncovered == "layers.1"  # layer 0's owned rows are still right
    assert [d.module for d in report.layers] == ["layers.0", "layers.1"]
    assert report.layers[0].ok and report.errors["forces"] > 1e-6
    # layer 0's ghost rows are stale (owned receivers only) and layer 1 reads them
    assert report.layers[0].ghost_error is not None and report.layers[0].ghost_error > 1e-6
    assert report.culprit == Culprit("layers.1", stale_input="0", producer="layers.0")
    assert "stale ghost rows of its input '0', produced by layers.0" in report.summary()
    fixed = trace_and_validate(ToyMP(), batch, world_size=2, fix=True)
    assert fixed.passed, fixed.summary()
    assert fixed.applied_fixes[-1].startswith("refresh ghost rows after MPLayer.forward (layers.0)")
    assert len(fixed.spec.adapters()) == 1
    assert "adapter MethodAdapter" in fixed.summary() and ": applied" in fixed.summary()


def test_torchscript_submodules_are_not_hooked_and_the_failure_still_shows() -> None:
    """register_forward_hook is not supported on ScriptModules: they are skipped."""
    batch = make_gas(n=30, pbc=(False, False, False))
    report = trace_and_validate(ScriptedToyMP(), batch, world_size=2)
    assert not report.passed and report.errors["forces"] > 1e-6
    assert report.not_probed == ["layers.0", "layers.1"]
    assert "2 TorchScript submodules not probed" in report.summary()


def test_models_calling_custom_ops_are_probed() -> None:
    g = torch.Generator().manual_seed(3)
    batch = make_gas(n=36)
    batch = batch.replace(
        atomic_numbers=torch.tensor([1, 6, 8, 18])[torch.randint(4, (36,), generator=g)]
    )
    report = trace_and_validate(WeightedPair(), batch, world_size=2)
    assert report.passed, report.summary()
    assert [d.module for d in report.layers] == ["weights"]
    assert report.layers[0].ok and report.layers[0].ghost_error == 0.0


def test_the_report_names_the_spec_in_use_not_only_its_preset() -> None:
    forces_owned_only = SPEC_LJ_HALO | type(SPEC_LJ_HALO)(
        outputs={"forces": OutputSpec(OutputKind.PER_NODE, Reduce.OWNED_ONLY)}
    )
    assert forces_owned_only.name == "SPEC_LJ_HALO"
    text = describe_spec(forces_owned_only)
    assert "DIFFERS from the preset" in text
    assert "outputs['forces'] is per_node/owned_only (preset: per_node/all_reduce)" in text
    assert "(the preset, unchanged)" in describe_spec(SPEC_LJ_HALO)
    # a variant named "PRESET | what differs" (LennardJones's own) is described
    # against its preset, not as a stranger
    variant = forces_owned_only.replace(name="SPEC_LJ_HALO | owned forces")
    assert describe_spec(variant).splitlines()[0] == (
        "spec 'SPEC_LJ_HALO | owned forces': the preset SPEC_LJ_HALO with outputs['forces'] "
        "is per_node/owned_only (preset: per_node/all_reduce)"
    )
    assert "(not a preset)" in describe_spec(forces_owned_only.replace(name="mine"))
    report = trace_and_validate(SoftPair(spec=forces_owned_only), make_gas(n=36), world_size=2)
    summary = report.summary()
    assert "outputs['forces'] is per_node/owned_only" in summary
    # The pair model returns forces on ghost rows (SPEC_LJ_HALO's contract): declared
    # owned-only, they are not folded, so the report must FAIL on the forces alone
    # (issue 17: it used to pass, the runtime folding whatever the spec said).
    assert not report.passed and summary.startswith("trace_and_validate: FAILED"), summary
    assert report.errors["forces"] > 1e-3, report.errors
    assert report.errors["energy"] < 1e-10 and report.errors["stress"] < 1e-10, report.errors
    assert f"forces: max abs error {report.errors['forces']:.3e}" in summary
    assert report.failure is None  # a verdict on the spec, not a crash


def test_validation_arguments() -> None:
    with pytest.raises(ConfigurationError, match="world_size >= 2"):
        trace_and_validate(SoftPair(), make_gas(), world_size=1)
    with pytest.raises(ConfigurationError, match="launch the script with torchrun"):
        trace_and_validate(SoftPair(), make_gas(), device="cuda")


# ------------------------------------------------------ the caller's own ranks
def _validate_on_my_ranks(model: torch.nn.Module, batch: Batch) -> ValidationReport:
    return trace_and_validate(model, batch)


def _validate_with_bad_arguments(batch: Batch) -> list[str]:
    messages = []
    for kwargs in ({"world_size": 3}, {"device": "cuda"}):
        try:
            trace_and_validate(SoftPair(), batch, **kwargs)  # type: ignore[arg-type]
        except ConfigurationError as exc:
            messages.append(str(exc))
    return messages


def test_under_an_existing_process_group_every_rank_gets_the_report() -> None:
    batch = make_gas(n=30, pbc=(False, False, False))
    reports = run_ranks(_validate_on_my_ranks, 2, ToyMP(), batch, timeout_s=120)
    for report in reports:
        assert not report.passed and report.world_size == 2
        assert report.culprit == Culprit("layers.1", stale_input="0", producer="layers.0")
    good = run_ranks(_validate_on_my_ranks, 3, SoftPair(), make_gas(n=48), timeout_s=120)
    assert all(r.passed and r.world_size == 3 for r in good), good[0].summary()
    for messages in run_ranks(_validate_with_bad_arguments, 2, make_gas(), timeout_s=60):
        assert "world_size=3) under a process group of 2 ranks" in messages[0]
        assert "device='cuda') under a gloo process group" in messages[1]


# -------------------------------------------------- scripts without a guard
_SCRIPT = """
import sys
sys.path[:0] = {paths!r}
from nvdd.dynamics._launch import unguarded_caller

def helper():
    return unguarded_caller()

print("top", unguarded_caller())
print("top-helper", helper())
if __name__ == "__main__":
    print("guarded", unguarded_caller())
    print("guarded-helper", helper())
"""

_UNGUARDED_CALL = """
import sys
sys.path[:0] = {paths!r}
from dyn_models import SoftPair
from test_dynamics_domain_parallel import make_gas
from nvdd.dynamics import trace_and_validate

trace_and_validate(SoftPair(), make_gas())
"""


def _run_script(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(text.format(paths=list(sys.path))))
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )


def test_the_main_guard_is_read_from_the_calling_script(tmp_path: Path) -> None:
    done = _run_script(tmp_path, _SCRIPT)
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.strip().splitlines())
    source = (tmp_path / "script.py").read_text().splitlines()
    top = source.index('print("top", unguarded_caller())') + 1
    assert lines["top"] == f"{tmp_path / 'script.py'}:{top}"
    assert lines["top-helper"] == f"{tmp_path / 'script.py'}:{top + 1}"
    assert lines["guarded"] == "None" and lines["guarded-helper"] == "None"


def test_an_unguarded_script_is_told_so_before_any_rank_starts(tmp_path: Path) -> None:
    done = _run_script(tmp_path, _UNGUARDED_CALL)
    assert done.returncode != 0
    assert "ConfigurationError" in done.stderr
    assert 'without an `if __name__ == "__main__":` guard' in done.stderr
    assert "not a problem with the model's spec" in done.stderr
    assert "rank 1 exited" not in done.stderr


def test_the_process_group_is_left_alone() -> None:
    assert not dist.is_initialized()  # spawned mode never initialises the caller's group


def test_probe_of_a_model_that_is_torchscript_from_the_root() -> None:
    from dyn_models import MPLayer

    from nvdd.dynamics._probe import ModuleProbe

    scripted = torch.jit.script(MPLayer(2.5))
    probe = ModuleProbe(scripted, lambda: 4)
    with probe:
        scripted(torch.ones(4, 1, dtype=torch.float64), torch.rand(4, 3, dtype=torch.float64), 4)
    assert probe.not_probed == ["<root>"] and probe.calls == {}


# ----------------------------------------------------- graph partition (issue 40)
class _HaloOnly(SoftPair):
    """A model that declares its specs and has none for graph partition."""

    def distribution_spec(self, strategy: StrategyKind | str = StrategyKind.HALO) -> MLIPSpec:
        if StrategyKind(strategy) is not StrategyKind.HALO:
            raise ConfigurationError("_HaloOnly supports StrategyKind.HALO only")
        return super().distribution_spec(strategy)


def test_graph_partition_is_validated_on_index_blocks_or_refused_up_front() -> None:
    gp = StrategyKind.GRAPH_PARTITION
    spec = SPEC_LJ_HALO | MLIPSpec(distribution=DistributionSpec(storage=gp))
    batch = make_gas(n=36, triclinic=True)
    report = trace_and_validate(SoftPair(spec=spec), batch, world_size=2, strategy=gp)
    assert report.passed, report.summary()
    assert report.spec.distribution.storage is gp and max(report.errors.values()) < 1e-10
    with pytest.raises(ConfigurationError, match=r"supports StrategyKind\.HALO only.*HALO"):
        trace_and_validate(_HaloOnly(), batch, strategy="graph_partition")
    with pytest.raises(ConfigurationError, match=r"strategy='spatial'"):
        trace_and_validate(SoftPair(), batch, strategy="spatial")
