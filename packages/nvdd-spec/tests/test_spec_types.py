"""Spec types: validation, composition with |, JSON round trips, the trust rule."""

from __future__ import annotations

import json
import pickle
import sys
import textwrap
from pathlib import Path

import _spec_targets as T  # noqa: N812
import pytest

from nvdd.core import ConfigurationError
from nvdd.spec import (
    SPEC_DFTD3_HALO,
    SPEC_EWALD_HALO,
    SPEC_LJ_HALO,
    SPEC_MPNN_GP,
    SPEC_MPNN_HALO,
    SPEC_PME_HALO,
    SPEC_UMA_HALO,
    AdapterRegistry,
    CompilePolicy,
    DistributionSpec,
    ForceStrategy,
    FunctionAdapter,
    JitAdapter,
    MethodAdapter,
    MLIPSpec,
    OpAdapter,
    OutputKind,
    OutputSpec,
    PythonAdapter,
    Reduce,
    ScatterMode,
    StrategyKind,
    StrategyOptions,
)

PRESETS = [
    SPEC_LJ_HALO,
    SPEC_MPNN_HALO,
    SPEC_UMA_HALO,
    SPEC_EWALD_HALO,
    SPEC_PME_HALO,
    SPEC_DFTD3_HALO,
    SPEC_MPNN_GP,
]


@pytest.mark.parametrize("spec", PRESETS, ids=[s.name for s in PRESETS])
def test_every_preset_round_trips_through_json(spec: MLIPSpec) -> None:
    text = json.dumps(spec.to_dict())
    back = MLIPSpec.from_dict(json.loads(text))
    assert back == spec
    assert back.to_dict() == spec.to_dict()
    assert MLIPSpec.from_json(spec.to_json()) == spec
    assert pickle.loads(pickle.dumps(spec)) == spec  # specs travel to spawned ranks


def test_presets_differ_where_the_pattern_differs() -> None:
    dicts = {
        s.name: json.dumps({k: v for k, v in s.to_dict().items() if k != "name"}, sort_keys=True)
        for s in PRESETS
    }
    assert len(set(dicts.values())) == len(PRESETS), "two presets are identical"
    assert SPEC_LJ_HALO.force_strategy is ForceStrategy.DIRECT
    assert SPEC_MPNN_HALO.options.scatter is ScatterMode.LOCAL  # owned receivers: refresh only
    assert SPEC_UMA_HALO.options.scatter is ScatterMode.LOCAL and SPEC_UMA_HALO.adapters()
    assert SPEC_EWALD_HALO.options.global_coupling != SPEC_PME_HALO.options.global_coupling
    assert SPEC_EWALD_HALO.output("energy").effective_reduce() is Reduce.ALL_REDUCE
    assert SPEC_DFTD3_HALO.options.scatter is ScatterMode.LOCAL
    assert SPEC_DFTD3_HALO.ghost_width(5.0, 1.0) == SPEC_LJ_HALO.ghost_width(5.0, 1.0) == 6.0
    assert SPEC_MPNN_GP.strategy is StrategyKind.GRAPH_PARTITION
    assert SPEC_MPNN_HALO.output("forces").effective_reduce() is Reduce.ALL_REDUCE
    assert SPEC_MPNN_HALO.output("energy").effective_reduce() is Reduce.OWNED_ONLY


def test_only_the_pair_preset_declares_per_atom_virials() -> None:
    """LJ books half of each pair virial on its (owned) receiver: owned rows are
    exact, nothing to fold. The autograd presets declare none (their models return
    none; a wrong declaration would be silently wrong under DD)."""
    spec = SPEC_LJ_HALO.output("atom_virials")
    assert spec.kind is OutputKind.PER_NODE
    assert spec.effective_reduce() is Reduce.OWNED_ONLY
    assert spec == SPEC_LJ_HALO.output("atom_energies")
    for other in (SPEC_MPNN_HALO, SPEC_UMA_HALO, SPEC_MPNN_GP, SPEC_EWALD_HALO, SPEC_DFTD3_HALO):
        assert other.output("atom_virials").kind is OutputKind.UNKNOWN, other.name


def test_output_defaults_and_unknown() -> None:
    assert OutputSpec(OutputKind.PER_NODE).effective_reduce() is Reduce.OWNED_ONLY
    assert OutputSpec(OutputKind.PER_GRAPH).effective_reduce() is Reduce.ALL_REDUCE
    assert OutputSpec(OutputKind.GLOBAL).effective_reduce() is Reduce.OWNED_ONLY
    assert SPEC_LJ_HALO.output("never_declared").kind is OutputKind.UNKNOWN
    with pytest.raises(ConfigurationError, match="unknown shape cannot be summed"):
        OutputSpec(OutputKind.UNKNOWN, Reduce.ALL_REDUCE)
    with pytest.raises(ConfigurationError, match="must be an OutputKind"):
        OutputSpec("per_node")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: CompilePolicy(mode="fastest"), "CompilePolicy.mode must be one of"),
        (
            lambda: StrategyOptions(extra_ghost_width=-1.0),
            "extra_ghost_width must be >= 0, got -1.0",
        ),
        (lambda: StrategyOptions(scatter="fold"), "must be a ScatterMode"),
        (lambda: DistributionSpec(sharded_fields=("charges",)), "must include 'positions'"),
        (lambda: DistributionSpec(helpers=("x",)), "holds non-adapters"),
        (
            lambda: MLIPSpec(outputs={"energy": "per_graph"}),
            r"outputs\['energy'\] must be an OutputSpec",
        ),
        (
            lambda: MLIPSpec(force_strategy=ForceStrategy.DIRECT),
            "DIRECT needs an OutputSpec for 'forces'",
        ),
        (lambda: MLIPSpec(compile=True), "compile must be a CompilePolicy"),
        (lambda: OpAdapter(op="no_namespace"), "must be 'namespace::name'"),
        (
            lambda: OpAdapter(op="a::b", refresh_inputs=(0,), owned_inputs=(0,)),
            "both refreshed and sliced",
        ),
        (lambda: MethodAdapter("not-a-name", T.shout), "form 'module:qualname'"),
    ],
)
def test_construction_errors_name_the_value(build: object, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        build()  # type: ignore[operator]


def test_composition_rules() -> None:
    a1 = MethodAdapter("_spec_targets:Base.greet", T.shout)
    a2 = FunctionAdapter(T.add_one, T.double_result)
    left = MLIPSpec(
        outputs={
            "energy": OutputSpec(OutputKind.PER_GRAPH),
            "forces": OutputSpec(OutputKind.PER_NODE, Reduce.ALL_REDUCE),
        },
        distribution=DistributionSpec(helpers=(a1,), sharded_fields=("positions", "charges")),
        force_strategy=ForceStrategy.DIRECT,
        name="left",
    )
    right = MLIPSpec(
        outputs={
            "energy": OutputSpec(OutputKind.PER_GRAPH, Reduce.OWNED_ONLY),
            "dipole": OutputSpec(OutputKind.GLOBAL),
        },
        distribution=DistributionSpec(helpers=(a1, a2), sharded_fields=("positions", "spins")),
        compile=CompilePolicy(enabled=True),
    )
    both = left | right
    assert both.output("energy").reduce is Reduce.OWNED_ONLY  # right wins per key
    assert both.output("forces").reduce is Reduce.ALL_REDUCE  # left kept
    assert both.output("dipole").kind is OutputKind.GLOBAL  # merged
    assert both.distribution.helpers == (a1, a2)  # concatenated, no duplicates
    assert both.distribution.sharded_fields == ("positions", "charges", "spins")
    assert both.force_strategy is ForceStrategy.DIRECT  # right at default: left kept
    assert both.compile.enabled  # right set: right wins
    assert both.name == "left"
    composed = SPEC_MPNN_HALO | right
    assert MLIPSpec.from_dict(composed.to_dict()) == composed


def test_every_adapter_kind_round_trips() -> None:
    adapters = (
        MethodAdapter("_spec_targets:Base.greet", T.shout, declared_in="test"),
        FunctionAdapter(T.add_one, T.double_result, also_patch=("_spec_targets:add_one",)),
        PythonAdapter("_spec_targets:FLAG", "_spec_targets:REPLACED_FLAG"),
        JitAdapter("_spec_targets:add_one", rewrap_outputs=(0, 1)),
        OpAdapter(
            "nvdd_test::kernel",
            refresh_inputs=(0,),
            owned_inputs=(1,),
            fold_outputs=(0,),
            all_reduce_outputs=(1,),
            optional=True,
        ),
    )
    spec = MLIPSpec(distribution=DistributionSpec(custom_ops=adapters[3:], helpers=adapters[:3]))
    back = MLIPSpec.from_json(spec.to_json())
    assert back == spec
    assert back.adapters() == spec.adapters()
    assert back.distribution.custom_ops[1].optional


def test_unnamed_callable_raises_at_to_dict_not_silently() -> None:
    spec = MLIPSpec(
        distribution=DistributionSpec(
            helpers=(MethodAdapter("_spec_targets:Base.greet", lambda orig, s, n: "x"),)
        )
    )
    # Usable in-process ...
    with AdapterRegistry(spec.adapters()):
        assert T.Base().greet("a") == "x"
    # ... but it cannot be stored.
    with pytest.raises(ConfigurationError, match="lambda or local object"):
        spec.to_dict()

    def local(original: object, *args: object) -> object:
        return original

    with pytest.raises(ConfigurationError, match="lambda or local object"):
        FunctionAdapter(T.add_one, local).to_dict()


def test_from_dict_rejects_unknown_fields_and_types() -> None:
    d = SPEC_LJ_HALO.to_dict()
    with pytest.raises(ConfigurationError, match="unknown field"):
        MLIPSpec.from_dict({**d, "surprise": 1})
    with pytest.raises(ConfigurationError, match="expected format"):
        MLIPSpec.from_dict({**d, "format": "other/9"})
    bad = json.loads(json.dumps(d))
    bad["distribution"]["helpers"] = [{"type": "EvalAdapter", "code": "rm -rf"}]
    with pytest.raises(ConfigurationError, match="unknown adapter type 'EvalAdapter'"):
        MLIPSpec.from_dict(bad)
    bad = json.loads(json.dumps(d))
    bad["outputs"]["energy"]["kind"] = "per_galaxy"
    with pytest.raises(ConfigurationError, match="kind='per_galaxy' is not a OutputKind"):
        MLIPSpec.from_dict(bad)


def test_from_dict_errors_name_the_record_the_field_and_the_value() -> None:
    d = SPEC_LJ_HALO.to_dict()
    dist_d = d["distribution"]
    cases = [
        (
            lambda: MLIPSpec.from_dict({**d, "surprise": 1, "also": 2}),
            r"MLIPSpec\.from_dict: unknown field\(s\) \['also', 'surprise'\]",
        ),
        (
            lambda: DistributionSpec.from_dict({**dist_d, "extra": 0}),
            r"DistributionSpec: unknown field\(s\) \['extra'\]",
        ),
        (
            lambda: MLIPSpec.from_dict({**d, "compile": {**d["compile"], "x": 1}}),
            r"compile: unknown field\(s\) \['x'\] for CompilePolicy",
        ),
        (
            lambda: DistributionSpec.from_dict({**dist_d, "storage": "ring"}),
            r"DistributionSpec: bad storage 'ring'",
        ),
        (
            lambda: MLIPSpec.from_dict({**d, "force_strategy": "telepathy"}),
            r"MLIPSpec: bad force_strategy 'telepathy'",
        ),
    ]
    for call, message in cases:
        with pytest.raises(ConfigurationError, match=f"^{message}$"):
            call()
    # absent fields take their defaults
    bare = DistributionSpec.from_dict({})
    assert bare.storage is StrategyKind.HALO
    assert MLIPSpec.from_dict({"format": d["format"]}).force_strategy is ForceStrategy.AUTOGRAD


def test_trust_rule_imports_only_when_trusted(tmp_path: Path) -> None:
    mod = "nvdd_spec_untrusted_mod"
    (tmp_path / f"{mod}.py").write_text(
        textwrap.dedent(
            """
        IMPORTED = True
        def wrapper(original, self_, *args, **kwargs):
            return "from untrusted module"
        """
        )
    )
    sys.path.insert(0, str(tmp_path))
    try:
        stored = MLIPSpec(
            distribution=DistributionSpec(
                helpers=(MethodAdapter("_spec_targets:Base.greet", f"{mod}:wrapper"),)
            )
        ).to_dict()
        assert mod not in sys.modules
        untrusted = MLIPSpec.from_dict(stored)  # loading alone imports nothing
        assert mod not in sys.modules
        with pytest.raises(Exception, match=f"would import module '{mod}'; pass trust=True"):
            AdapterRegistry(untrusted.adapters()).install()
        assert mod not in sys.modules
        assert T.Base().greet("x") == "hello x"  # nothing left patched
        trusted = MLIPSpec.from_dict(stored, trust=True)
        with AdapterRegistry(trusted.adapters()):
            assert mod in sys.modules
            assert T.Base().greet("x") == "from untrusted module"
        assert T.Base().greet("x") == "hello x"
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(mod, None)


def test_compile_policy_compiles_with_its_fields() -> None:
    import torch

    policy = CompilePolicy(enabled=True, backend="eager", fullgraph=True)
    assert policy.resolved_dynamic(padded=True) is False  # padded: static graphs
    assert policy.resolved_dynamic(padded=False) is True
    assert CompilePolicy(dynamic=False).resolved_dynamic(padded=False) is False
    fn = policy.compile(lambda x: torch.sin(x) * 2.0, padded=True)
    x = torch.linspace(0.0, 1.0, 5, dtype=torch.float64)
    torch.testing.assert_close(fn(x), torch.sin(x) * 2.0, rtol=0, atol=0)


def test_the_receptive_field_spec_declares_a_halo_of_2_layers_cutoffs_and_owned_rows() -> None:
    from nvdd.spec import receptive_field_spec

    spec = receptive_field_spec(layers=2)
    assert spec.name == "receptive_field(L=2)" and spec.owned_rows_exact
    assert spec.ghost_width(cutoff=2.5, skin=0.2) == pytest.approx(2 * 2 * 2.5 + 0.2)
    assert spec.output("forces").effective_reduce() is Reduce.OWNED_ONLY
    assert spec.output("atom_energies").effective_reduce() is Reduce.OWNED_ONLY
    assert spec.output("energy").effective_reduce() is Reduce.ALL_REDUCE
    assert MLIPSpec.from_json(spec.to_json()) == spec  # the option travels in JSON
    gp = receptive_field_spec(3, "graph_partition", extra_ghost_width=0.5)
    assert gp.strategy is StrategyKind.GRAPH_PARTITION
    assert gp.ghost_width(cutoff=1.0, skin=0.0) == pytest.approx(6.5)
    folding = receptive_field_spec(2, fold=True)  # the narrower variant: L cutoffs
    assert folding.name == "receptive_field(L=2, fold)" and folding.owned_rows_exact
    assert folding.ghost_width(cutoff=2.5, skin=0.2) == pytest.approx(2 * 2.5 + 0.2)
    assert folding.output("forces").effective_reduce() is Reduce.ALL_REDUCE
    with pytest.raises(ConfigurationError, match="receptive_field_fold needs"):
        StrategyOptions(receptive_field_fold=True)
    assert not SPEC_MPNN_HALO.owned_rows_exact  # the presets keep one cutoff
    assert SPEC_MPNN_HALO.ghost_width(cutoff=2.5, skin=0.2) == pytest.approx(2.7)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigurationError, match="layers must be an int >= 1"):
            receptive_field_spec(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="receptive_field_layers must be an int >= 0"):
        StrategyOptions(receptive_field_layers=-2)


def test_folds_forces_follows_the_force_strategy_and_the_forces_output() -> None:
    """``MLIPSpec.folds_forces``: autograd forces always fold; direct forces fold
    when declared ``ALL_REDUCE`` and not when ``OWNED_ONLY``; a receptive-field
    spec folds only in its folding variant."""
    from nvdd.spec import receptive_field_spec

    owned = SPEC_LJ_HALO.replace(
        outputs={
            **SPEC_LJ_HALO.outputs,
            "forces": OutputSpec(OutputKind.PER_NODE, Reduce.OWNED_ONLY),
        }
    )
    assert SPEC_LJ_HALO.folds_forces and SPEC_EWALD_HALO.folds_forces
    assert not owned.folds_forces
    assert owned.replace(force_strategy=ForceStrategy.AUTOGRAD).folds_forces
    assert SPEC_MPNN_HALO.folds_forces and SPEC_MPNN_GP.folds_forces
    assert not receptive_field_spec(2).folds_forces
    assert receptive_field_spec(2, fold=True).folds_forces
