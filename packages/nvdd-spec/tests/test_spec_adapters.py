"""Adapter lifecycle: install / restore leaves every patched object exactly as before."""

from __future__ import annotations

import _spec_targets as T  # noqa: N812
import pytest

from nvdd.spec import (
    AdapterError,
    AdapterRegistry,
    FunctionAdapter,
    MethodAdapter,
    PythonAdapter,
    active_patches,
)


def _snapshot() -> dict[str, object]:
    return {
        "Base": dict(vars(T.Base)),
        "Child": dict(vars(T.Child)),
        "module": {k: v for k, v in vars(T).items() if not k.startswith("__")},
    }


@pytest.fixture(autouse=True)
def _no_leftover_patches() -> object:
    before = _snapshot()
    yield
    assert _snapshot() == before, "an adapter left an object patched"
    assert active_patches() == []


def test_method_adapter_on_inherited_method_restores_by_deleting() -> None:
    reg = AdapterRegistry([MethodAdapter("_spec_targets:Child.greet", T.shout)])
    assert "greet" not in vars(T.Child)
    with reg:
        assert T.Child().greet("bob") == "HELLO BOB"
        assert T.Base().greet("bob") == "hello bob"  # only the named class
        assert all(s.applied for s in reg.statuses)
    assert "greet" not in vars(T.Child)  # inherited again, not shadowed
    assert not any(s.applied for s in reg.statuses)


def test_function_and_python_adapters() -> None:
    fa = FunctionAdapter(T.add_one, T.double_result)
    pa = PythonAdapter("_spec_targets:FLAG", "_spec_targets:REPLACED_FLAG")
    with AdapterRegistry([fa, pa]):
        assert T.uses_add_one(1) == 40  # the module's own call site sees the replacement
        assert T.FLAG == "replaced"
    assert T.uses_add_one(1) == 20 and T.FLAG == "original"


def test_nested_scopes_and_two_model_instances_share_one_patch() -> None:
    adapter = MethodAdapter("_spec_targets:Base.greet", T.shout)
    outer, inner = AdapterRegistry([adapter]), AdapterRegistry([adapter])
    with outer:
        with inner:  # a second model instance with the same spec
            assert T.Base().greet("a") == "HELLO A"
            assert len(active_patches()) == 1 and active_patches()[0].count == 2
        assert T.Base().greet("a") == "HELLO A"  # still patched for the outer scope
    assert T.Base().greet("a") == "hello a"


def test_different_adapters_on_one_target_stack_and_unwind() -> None:
    two = AdapterRegistry([FunctionAdapter(T.add_one, T.double_result)])
    three = AdapterRegistry([FunctionAdapter(T.add_one, T.other_double)])
    with two:
        with three:
            assert T.add_one(1) == 12  # 3 * (2 * 2)
        assert T.add_one(1) == 4
    two.install()
    three.install()
    with pytest.raises(AdapterError, match="out of order"):
        two.restore()
    three.restore()
    two.restore()


def test_exception_mid_forward_restores_everything() -> None:
    reg = AdapterRegistry(
        [
            MethodAdapter("_spec_targets:Child.own", T.boom),
            PythonAdapter("_spec_targets:FLAG", "_spec_targets:REPLACED_FLAG"),
        ]
    )
    with pytest.raises(RuntimeError, match="planted failure"), reg:
        T.Child().own(1)
    assert T.Child().own(1) == 2 and T.FLAG == "original"


def test_failed_install_rolls_back_and_optional_is_recorded() -> None:
    good = PythonAdapter("_spec_targets:FLAG", "_spec_targets:REPLACED_FLAG")
    missing = MethodAdapter("_spec_targets:Base.nope", T.shout, declared_in="test-spec")
    reg = AdapterRegistry([good, missing])
    with pytest.raises(AdapterError, match=r"Base.nope \(declared in test-spec\)"):
        reg.install()
    assert T.FLAG == "original"  # the good one was rolled back
    optional = MethodAdapter("absent_third_party_pkg:Model.forward", T.shout, optional=True)
    reg = AdapterRegistry([good, optional])
    with reg:
        assert T.FLAG == "replaced"
        status = reg.statuses[1]
        assert not status.applied and "absent_third_party_pkg" in (status.error or "")


def test_registry_dedupes_and_rejects_double_install() -> None:
    a = MethodAdapter("_spec_targets:Base.greet", T.shout)
    reg = AdapterRegistry([a, MethodAdapter("_spec_targets:Base.greet", "_spec_targets:shout")])
    assert len(reg.adapters) == 1
    with reg, pytest.raises(AdapterError, match="already installed"):
        reg.install()


def test_staticmethod_descriptor_is_restored_exactly() -> None:
    original = vars(T.Base)["static"]
    with AdapterRegistry(
        [PythonAdapter("_spec_targets:Base.static", "_spec_targets:REPLACED_FLAG")]
    ):
        assert T.Base.static == "replaced"
    assert vars(T.Base)["static"] is original and T.Base.static() == "static"
