"""The meta-package exposes every symbol of the seed API reference."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import ClassVar

import pytest

import nvalchemi.distributed as nd
from nvalchemi.distributed import config, spec

SEED = Path(__file__).with_name("distributed-api.txt")

#: Seed symbols not implemented yet. Each entry is a promise, not a stub: the
#: symbol must NOT exist in nvalchemi.distributed until it really works.
PLANNED: frozenset[str] = frozenset()


def seed_symbols() -> set[str]:
    text = SEED.read_text()
    # Table rows are "`Name`<tab>description"; standalone headings are bare names.
    names = set(re.findall(r"^`([A-Za-z_][A-Za-z0-9_]*)`\t", text, flags=re.M))
    bare = set(re.findall(r"^([A-Za-z_][A-Za-z0-9_]*)\s*$", text, flags=re.M))
    return names | {n for n in bare if n[0].isupper() or "_" in n}


def test_seed_file_is_parsed() -> None:
    names = seed_symbols()
    for expected in (
        "DomainParallel",
        "SPEC_MPNN_HALO",
        "resolve_cap",
        "trace_and_validate",
        "localize",
        "StrategyKind",
        "ParticleHaloConfig",
        "reshard_by_destination",
    ):
        assert expected in names
    assert len(names) == 47, sorted(names)


def test_every_seed_symbol_exists_or_is_planned() -> None:
    presets = {n for n in seed_symbols() if n.startswith("SPEC_")}
    missing = sorted(n for n in seed_symbols() - presets - PLANNED if not hasattr(nd, n))
    assert missing == [], f"seed symbols missing from nvalchemi.distributed: {missing}"
    assert sorted(n for n in presets if not hasattr(spec, n)) == []
    stubbed = sorted(n for n in PLANNED if hasattr(nd, n))
    assert stubbed == [], f"{stubbed} exist now: remove them from PLANNED"


def test_all_resolves_and_nothing_public_comes_from_a_private_path() -> None:
    for module in (nd, spec, config):
        for name in module.__all__:
            obj = getattr(module, name)
            origin = getattr(obj, "__module__", "") or ""
            if origin.startswith(("nvdd.", "nvalchemi.")):
                public = origin.split("._")[0]
                pkg = importlib.import_module(public)
                assert getattr(pkg, name, None) is obj or name == "__version__", (name, origin)


def test_config_module_and_strategy_kind() -> None:
    assert config.DomainConfig is nd.DomainConfig and config.HookScope is nd.HookScope
    assert config.StrategyKind is nd.StrategyKind
    assert {k.name for k in nd.StrategyKind} == {"HALO", "GRAPH_PARTITION"}


def test_version_check_names_both_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    from nvalchemi.distributed import _versions

    class FakeDist:
        version = "0.1.0"
        requires: ClassVar[list[str]] = [
            "nvdd-core==0.1.0",
            "nvdd-halo==0.1.0",
            "torch>=2.4",
            "nvdd-models==0.1.0; extra == 'models'",
        ]

        def read_text(self, name: str) -> str | None:
            return None

    versions = {"nvdd-core": "0.1.0", "nvdd-halo": "0.2.0"}

    def fake_version(name: str) -> str:
        if name not in versions:
            raise metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(_versions.metadata, "distribution", lambda name: FakeDist())
    monkeypatch.setattr(_versions.metadata, "version", fake_version)
    with pytest.raises(
        _versions.VersionMismatchError,
        match=r"nvdd-halo 0\.2\.0 is installed but nvalchemi-distributed 0\.1\.0 pins 0\.1\.0",
    ):
        _versions.check_versions()
    versions["nvdd-halo"] = "0.1.0"
    _versions.check_versions()  # the models extra is absent: not checked

    class Editable(FakeDist):
        def read_text(self, name: str) -> str | None:
            return '{"dir_info": {"editable": true}, "url": "file:///x"}'

    versions["nvdd-halo"] = "9.9"
    monkeypatch.setattr(_versions.metadata, "distribution", lambda name: Editable())
    _versions.check_versions()  # editable installs are development setups
