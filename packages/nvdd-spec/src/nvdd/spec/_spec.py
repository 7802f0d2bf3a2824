"""`DistributionSpec` and `MLIPSpec`: composition with ``|`` and JSON round trips.

Composition rule (``left | right``), field by field:

- ``outputs``: merged per key; the right side's declaration wins for a key both have;
- adapters (``custom_ops``, ``helpers``): concatenated, left first, without duplicates;
- ``sharded_fields``: union, left order first;
- every other field (storage, force strategy, compile policy, strategy options,
  name): the right side's value where it differs from the default, else the left's.
  (To set a field back to its default, use :func:`dataclasses.replace`.)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any

from nvdd.core import ConfigurationError
from nvdd.spec._adapters import Adapter, adapter_from_dict
from nvdd.spec._types import (
    CompilePolicy,
    ForceStrategy,
    OutputKind,
    OutputSpec,
    Reduce,
    StrategyKind,
    StrategyOptions,
    enum_field,
    record_from_dict,
    record_to_dict,
    reject_unknown_fields,
)

__all__ = ["FORMAT", "DistributionSpec", "MLIPSpec"]

#: Format tag written by :meth:`MLIPSpec.to_dict`.
FORMAT = "nvdd.spec/1"

_UNKNOWN = OutputSpec(OutputKind.UNKNOWN)


def _dedupe(items: tuple[Adapter, ...]) -> tuple[Adapter, ...]:
    seen: set[object] = set()
    out = []
    for a in items:
        if a.key() not in seen:
            seen.add(a.key())
            out.append(a)
    return tuple(out)


def _pick(left: Any, right: Any, default: Any) -> Any:
    return right if right != default else left


@dataclass(frozen=True)
class DistributionSpec:
    """Framework-generic distributed spec.

    Parameters
    ----------
    storage:
        How per-atom state is distributed (:class:`StrategyKind`).
    custom_ops:
        Adapters for opaque kernels (``OpAdapter``, ``JitAdapter``, ...).
    helpers:
        Adapters for third-party helpers (``MethodAdapter``, ``FunctionAdapter``,
        ``PythonAdapter``), e.g. a graph builder or a library's own parallel mode.
    sharded_fields:
        Per-atom batch fields the model reads at neighbours; they are exchanged to
        ghost rows (``positions`` with image shifts).
    """

    storage: StrategyKind = StrategyKind.HALO
    custom_ops: tuple[Adapter, ...] = ()
    helpers: tuple[Adapter, ...] = ()
    sharded_fields: tuple[str, ...] = ("positions", "atomic_numbers")

    def __post_init__(self) -> None:
        if not isinstance(self.storage, StrategyKind):
            raise ConfigurationError(
                f"DistributionSpec.storage must be a StrategyKind, got {self.storage!r}"
            )
        for name in ("custom_ops", "helpers"):
            value = tuple(getattr(self, name))
            bad = [a for a in value if not isinstance(a, Adapter)]
            if bad:
                raise ConfigurationError(f"DistributionSpec.{name} holds non-adapters: {bad}")
            object.__setattr__(self, name, _dedupe(value))
        sharded = tuple(self.sharded_fields)
        if "positions" not in sharded:
            raise ConfigurationError(
                f"DistributionSpec.sharded_fields must include 'positions', got {sharded}"
            )
        object.__setattr__(self, "sharded_fields", tuple(dict.fromkeys(sharded)))

    def adapters(self) -> tuple[Adapter, ...]:
        """Every adapter (custom ops first, then helpers)."""
        return _dedupe(self.custom_ops + self.helpers)

    def __or__(self, other: DistributionSpec) -> DistributionSpec:
        if not isinstance(other, DistributionSpec):
            return NotImplemented
        return DistributionSpec(
            storage=_pick(self.storage, other.storage, StrategyKind.HALO),
            custom_ops=self.custom_ops + other.custom_ops,
            helpers=self.helpers + other.helpers,
            sharded_fields=self.sharded_fields + other.sharded_fields,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (adapters by name; raises for unnamed callables)."""
        return {
            "storage": self.storage.value,
            "custom_ops": [a.to_dict() for a in self.custom_ops],
            "helpers": [a.to_dict() for a in self.helpers],
            "sharded_fields": list(self.sharded_fields),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, trust: bool = False) -> DistributionSpec:
        """Inverse of :meth:`to_dict`; named callables import modules only with ``trust``."""
        reject_unknown_fields(data, (f.name for f in fields(cls)), "DistributionSpec")
        storage = enum_field(StrategyKind, data, "storage", StrategyKind.HALO, "DistributionSpec")
        return cls(
            storage=storage,
            custom_ops=tuple(adapter_from_dict(a, trust=trust) for a in data.get("custom_ops", [])),
            helpers=tuple(adapter_from_dict(a, trust=trust) for a in data.get("helpers", [])),
            sharded_fields=tuple(data.get("sharded_fields", ("positions", "atomic_numbers"))),
        )


@dataclass(frozen=True)
class MLIPSpec:
    """What an MLIP needs from the distributed framework.

    Parameters
    ----------
    outputs:
        ``{name: OutputSpec}`` for every output consolidation must combine; an
        undeclared output is ``OutputKind.UNKNOWN`` (passed through, reported).
    distribution:
        Storage policy and adapters (:class:`DistributionSpec`).
    compile:
        :class:`CompilePolicy`.
    force_strategy:
        :class:`ForceStrategy`.
    options:
        Communication-pattern options (:class:`StrategyOptions`).
    name:
        A label for reports (presets carry their own name).
    """

    outputs: Mapping[str, OutputSpec] = field(default_factory=dict)
    distribution: DistributionSpec = field(default_factory=DistributionSpec)
    compile: CompilePolicy = field(default_factory=CompilePolicy)
    force_strategy: ForceStrategy = ForceStrategy.AUTOGRAD
    options: StrategyOptions = field(default_factory=StrategyOptions)
    name: str = ""

    def __post_init__(self) -> None:
        outs = dict(self.outputs)
        for key, value in outs.items():
            if not isinstance(key, str) or not key:
                raise ConfigurationError(
                    f"MLIPSpec.outputs keys must be non-empty strings, got {key!r}"
                )
            if not isinstance(value, OutputSpec):
                raise ConfigurationError(
                    f"MLIPSpec.outputs[{key!r}] must be an OutputSpec, got {value!r}"
                )
        object.__setattr__(self, "outputs", MappingProxyType(outs))
        checks = (
            ("distribution", DistributionSpec),
            ("compile", CompilePolicy),
            ("force_strategy", ForceStrategy),
            ("options", StrategyOptions),
        )
        for name, typ in checks:
            if not isinstance(getattr(self, name), typ):
                raise ConfigurationError(
                    f"MLIPSpec.{name} must be a {typ.__name__}, got {getattr(self, name)!r}"
                )
        if self.force_strategy is ForceStrategy.DIRECT and "forces" not in outs:
            raise ConfigurationError(
                "MLIPSpec: force_strategy DIRECT needs an OutputSpec for 'forces' "
                "(e.g. OutputSpec(OutputKind.PER_NODE, Reduce.ALL_REDUCE))"
            )

    def __reduce__(self) -> tuple[Any, ...]:
        # The read-only outputs view cannot be pickled; rebuild from a plain dict.
        return (
            MLIPSpec,
            (
                dict(self.outputs),
                self.distribution,
                self.compile,
                self.force_strategy,
                self.options,
                self.name,
            ),
        )

    # ------------------------------------------------------------- queries
    def output(self, name: str) -> OutputSpec:
        """The declaration of ``name`` (``OutputKind.UNKNOWN`` when undeclared)."""
        return self.outputs.get(name, _UNKNOWN)

    def adapters(self) -> tuple[Adapter, ...]:
        """Every adapter the spec installs in a distributed scope."""
        return self.distribution.adapters()

    @property
    def strategy(self) -> StrategyKind:
        """The storage strategy (``distribution.storage``)."""
        return self.distribution.storage

    def ghost_width(self, cutoff: float, skin: float) -> float:
        """The ghost width this model needs: ``cutoff + skin +`` :meth:`extra_reach`."""
        return cutoff + skin + self.extra_reach(cutoff)

    def extra_reach(self, cutoff: float) -> float:
        """Angstrom the halo reaches beyond ``cutoff + skin``: ``extra_ghost_width``,
        plus ``(2 L - 1) cutoff`` under a receptive-field declaration of ``L``
        layers (:attr:`owned_rows_exact`), so that the halo is ``2 L cutoff + skin``
        (``(L - 1) cutoff``, a halo of ``L cutoff + skin``, for its folding variant,
        ``options.receptive_field_fold``)."""
        layers = self.options.receptive_field_layers
        extra = self.options.extra_ghost_width
        if layers == 0:
            return extra
        reach = layers if self.options.receptive_field_fold else 2 * layers
        return extra + (reach - 1) * cutoff

    @property
    def owned_rows_exact(self) -> bool:
        """Whether this is a receptive-field spec (``options.receptive_field_layers
        > 0``): the model runs unmodified and only its owned rows are kept."""
        return self.options.receptive_field_layers > 0

    @property
    def folds_forces(self) -> bool:
        """Whether the runtime folds ghost-row forces into their owners (one
        reverse exchange a step).

        Autograd forces are derivatives with respect to every padded row, so the
        ghost rows' share always belongs to their owners; direct forces follow
        the ``forces`` output (``ALL_REDUCE``: fold; ``OWNED_ONLY``: owned rows
        are exact, ghost rows are dropped). Under a receptive-field spec
        (:attr:`owned_rows_exact`) the owned rows are exact either way: no fold,
        except in its folding variant (``options.receptive_field_fold``).
        """
        if self.owned_rows_exact:
            return self.options.receptive_field_fold
        if self.force_strategy is ForceStrategy.AUTOGRAD:
            return True
        return self.output("forces").effective_reduce() is Reduce.ALL_REDUCE

    # ---------------------------------------------------------- composition
    def __or__(self, other: MLIPSpec) -> MLIPSpec:
        if not isinstance(other, MLIPSpec):
            return NotImplemented
        return MLIPSpec(
            outputs={**self.outputs, **other.outputs},
            distribution=self.distribution | other.distribution,
            compile=_pick(self.compile, other.compile, CompilePolicy()),
            force_strategy=_pick(self.force_strategy, other.force_strategy, ForceStrategy.AUTOGRAD),
            options=_pick(self.options, other.options, StrategyOptions()),
            name=_pick(self.name, other.name, ""),
        )

    def replace(self, **changes: Any) -> MLIPSpec:
        """A copy with fields replaced (:func:`dataclasses.replace`)."""
        return replace(self, **changes)

    # ------------------------------------------------------------- storage
    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict; raises ConfigurationError for adapters with unnamed callables."""
        return {
            "format": FORMAT,
            "name": self.name,
            "outputs": {k: record_to_dict(v) for k, v in self.outputs.items()},
            "distribution": self.distribution.to_dict(),
            "compile": record_to_dict(self.compile),
            "force_strategy": self.force_strategy.value,
            "options": record_to_dict(self.options),
        }

    def to_json(self, **kwargs: Any) -> str:
        """:meth:`to_dict` as a JSON string."""
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, trust: bool = False) -> MLIPSpec:
        """Inverse of :meth:`to_dict`. Never unpickles; a named callable whose module
        is not imported yet is imported only when ``trust=True``."""
        if data.get("format") != FORMAT:
            raise ConfigurationError(
                f"MLIPSpec.from_dict: expected format {FORMAT!r}, got {data.get('format')!r}"
            )
        known = (
            "format",
            "name",
            "outputs",
            "distribution",
            "compile",
            "force_strategy",
            "options",
        )
        reject_unknown_fields(data, known, "MLIPSpec.from_dict")
        force = enum_field(
            ForceStrategy, data, "force_strategy", ForceStrategy.AUTOGRAD, "MLIPSpec"
        )
        return cls(
            outputs={
                k: record_from_dict(OutputSpec, dict(v), f"outputs[{k!r}]")
                for k, v in data.get("outputs", {}).items()
            },
            distribution=DistributionSpec.from_dict(data.get("distribution", {}), trust=trust),
            compile=record_from_dict(CompilePolicy, dict(data.get("compile", {})), "compile"),
            force_strategy=force,
            options=record_from_dict(StrategyOptions, dict(data.get("options", {})), "options"),
            name=str(data.get("name", "")),
        )

    @classmethod
    def from_json(cls, text: str, *, trust: bool = False) -> MLIPSpec:
        """Inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(text), trust=trust)
