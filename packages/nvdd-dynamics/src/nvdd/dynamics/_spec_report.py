"""`describe_spec`: name the spec actually in use, not only the preset it started from.

A model may return ``SPEC_MPNN_HALO.replace(outputs=...)``: the result still
carries the preset's name, but not its rules. Reports (``trace_and_validate``,
the conformance kit) print what the spec declares and, when its name is a
preset's, every field where it departs from that preset.
"""

from __future__ import annotations

from typing import Any

from nvdd.spec import (
    SPEC_DFTD3_HALO,
    SPEC_EWALD_HALO,
    SPEC_LJ_HALO,
    SPEC_MPNN_GP,
    SPEC_MPNN_HALO,
    SPEC_PME_HALO,
    SPEC_UMA_HALO,
    MLIPSpec,
    OutputSpec,
)

__all__ = ["describe_spec", "spec_differences"]

_PRESETS = {
    s.name: s
    for s in (
        SPEC_LJ_HALO,
        SPEC_MPNN_HALO,
        SPEC_UMA_HALO,
        SPEC_EWALD_HALO,
        SPEC_PME_HALO,
        SPEC_DFTD3_HALO,
        SPEC_MPNN_GP,
    )
}


def _rule(out: OutputSpec) -> str:
    return f"{out.kind.value}/{out.effective_reduce().value}"


def _adapter_names(spec: MLIPSpec) -> list[str]:
    return [f"{a.kind} {a.target}" for a in spec.adapters()]


def _options(spec: MLIPSpec) -> str:
    o = spec.options
    parts = [f"scatter {o.scatter.value}"]
    if o.extra_ghost_width:
        parts.append(f"extra ghost width {o.extra_ghost_width:g} A")
    if o.global_coupling.value != "none":
        parts.append(f"global coupling {o.global_coupling.value}")
    return ", ".join(parts)


def spec_differences(spec: MLIPSpec, reference: MLIPSpec) -> list[str]:
    """Every field where ``spec`` departs from ``reference``, one short phrase each."""
    out: list[str] = []
    for key in sorted(set(spec.outputs) | set(reference.outputs)):
        mine, theirs = spec.output(key), reference.output(key)
        if _rule(mine) != _rule(theirs):
            out.append(f"outputs[{key!r}] is {_rule(mine)} (preset: {_rule(theirs)})")
    simple: list[tuple[str, Any, Any]] = [
        ("force strategy", spec.force_strategy.value, reference.force_strategy.value),
        ("options", _options(spec), _options(reference)),
        ("storage", spec.strategy.value, reference.strategy.value),
        (
            "sharded fields",
            list(spec.distribution.sharded_fields),
            list(reference.distribution.sharded_fields),
        ),
    ]
    for label, mine_v, theirs_v in simple:
        if mine_v != theirs_v:
            out.append(f"{label} {mine_v} (preset: {theirs_v})")
    if spec.compile != reference.compile:
        out.append(f"compile policy {spec.compile} (preset: {reference.compile})")
    added = [a for a in _adapter_names(spec) if a not in _adapter_names(reference)]
    removed = [a for a in _adapter_names(reference) if a not in _adapter_names(spec)]
    out += [f"adds adapter {a}" for a in added] + [f"drops adapter {a}" for a in removed]
    return out


def describe_spec(spec: MLIPSpec) -> str:
    """A few lines describing ``spec``: its name, force strategy, output rules,
    communication options and adapters; for a spec named like a preset, also
    whether (and where) it differs from that preset.

    Examples
    --------
    >>> print(describe_spec(SPEC_LJ_HALO.replace(outputs={})))  # doctest: +SKIP
    spec 'SPEC_LJ_HALO', which DIFFERS from the preset of that name: outputs['energy'] ...
    """
    name = spec.name or "(unnamed)"
    preset = _PRESETS.get(spec.name)
    base = spec.name.split(" | ")[0]  # a variant's name: "PRESET | what differs"
    if preset is None and base != spec.name and base in _PRESETS:
        diffs = spec_differences(spec, _PRESETS[base])
        head = f"spec {name!r}: the preset {base} with " + ("; ".join(diffs) or "nothing changed")
    elif preset is None:
        head = f"spec {name!r} (not a preset)"
    else:
        diffs = spec_differences(spec, preset)
        head = (
            f"spec {name!r}, which DIFFERS from the preset of that name: {'; '.join(diffs)}"
            if diffs
            else f"spec {name!r} (the preset, unchanged)"
        )
    outputs = ", ".join(f"{k} {_rule(v)}" for k, v in sorted(spec.outputs.items())) or "none"
    adapters = ", ".join(_adapter_names(spec)) or "none"
    return "\n".join(
        [
            head,
            f"  forces {spec.force_strategy.value}; {_options(spec)}",
            f"  outputs: {outputs}",
            f"  adapters: {adapters}",
        ]
    )
