"""The model contract: ModelContract's members, BaseModelMixin's defaults, as_model."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from nvdd.core import Batch, ConfigurationError
from nvdd.spec import (
    MODEL_CONTRACT,
    SPEC_LJ_HALO,
    BaseModelMixin,
    MLIPSpec,
    ModelContract,
    StrategyKind,
    as_model,
    begins_steps,
    unwrap_model,
)


def test_model_contract_names_the_protocols_members_and_the_mixin_has_them() -> None:
    declared = {
        name
        for name in vars(ModelContract)
        if not name.startswith("_") or name == "__call__"
        if callable(getattr(ModelContract, name)) or isinstance(vars(ModelContract)[name], property)
    }
    assert declared == MODEL_CONTRACT
    missing = {n for n in MODEL_CONTRACT - {"__call__"} if not hasattr(BaseModelMixin, n)}
    assert missing == set()


def test_the_mixins_defaults_keep_a_model_out_of_every_optional_path() -> None:
    model = BaseModelMixin()
    batch: Any = object()  # (the defaults do not read it)
    assert model.graph_key(batch) is None
    assert model.splits_step is False
    assert model.begin_step(batch) is None
    assert model.overflow_flag() is None
    assert model.take_verdict(batch) is True
    assert model.compile_forward(None) is False
    assert model.compile_unsupported is None
    assert model.pipeline_components is None
    assert begins_steps(model) is False
    with pytest.raises(ConfigurationError, match="declares no distribution spec"):
        model.distribution_spec()


class _Splits(BaseModelMixin):
    def begin_step(self, batch: Batch) -> None:
        pass


def test_as_model_returns_a_mixin_model_itself() -> None:
    model = _Splits()
    assert as_model(model) is model and unwrap_model(model) is model
    assert begins_steps(model) is True


class _Foreign:
    """A duck-typed model: a few members of the contract, not the mixin."""

    cutoff = 3.0

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def __call__(self, batch: Any) -> dict[str, Any]:
        self.calls.append(("call", batch))
        return {"energy": 1.0}

    def distribution_spec(self, strategy: StrategyKind = StrategyKind.HALO) -> MLIPSpec:
        return SPEC_LJ_HALO

    def graph_key(self, batch: Any) -> str:
        return f"key {batch}"

    def distributed_setup(self, ctx: Any) -> None:
        self.calls.append(("setup", ctx))


def test_as_model_completes_another_object_with_its_own_members_first() -> None:
    obj = _Foreign()
    model = as_model(obj)
    assert unwrap_model(model) is obj and as_model(model) is model
    assert model.cutoff == 3.0 and model.distribution_spec() is SPEC_LJ_HALO
    assert model("b") == {"energy": 1.0} and model.graph_key("b") == "key b"
    model.distributed_setup("ctx")
    model.distributed_teardown()  # (it has none: the default does nothing)
    assert obj.calls == [("call", "b"), ("setup", "ctx")]
    assert model.splits_step is False and begins_steps(model) is False
    assert model.take_verdict("b") is True and model.overflow_flag() is None
    assert model.pipeline_components is None and model.compile_forward(None) is False
    assert model.compile_unsupported is None
    obj.compile_unsupported = "Dynamo fails in its kernels"  # (its own, when it has one)
    assert as_model(obj).compile_unsupported == "Dynamo fails in its kernels"


def test_a_completed_plain_callable_without_cutoff_or_spec_says_what_it_lacks() -> None:
    def plain(batch: Any) -> dict[str, Any]:
        return {}

    model = as_model(plain)
    assert model.graph_key(None) is None  # (a single process needs nothing else)
    with pytest.raises(ConfigurationError, match="function declares no 'cutoff'"):
        _ = model.cutoff
    with pytest.raises(ConfigurationError, match="declares no distribution spec"):
        model.distribution_spec()


def test_the_protocol_signatures_match_the_mixins() -> None:
    for name in MODEL_CONTRACT - {"__call__"}:
        mixin, proto = getattr(BaseModelMixin, name), getattr(ModelContract, name)
        if isinstance(proto, property):
            assert isinstance(mixin, property), name
        else:
            mixin_params = list(inspect.signature(mixin).parameters)
            assert mixin_params == list(inspect.signature(proto).parameters), name
