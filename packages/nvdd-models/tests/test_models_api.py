"""The public surface of nvdd.models: every name resolves, nothing else is public."""

from __future__ import annotations

import inspect
import types
from pathlib import Path

import nvdd.models


def test_every_public_name_resolves_and_is_listed() -> None:
    public = set(nvdd.models.__all__)
    assert len(public) == len(nvdd.models.__all__), "duplicates in __all__"
    assert nvdd.models.__all__ == sorted(nvdd.models.__all__, key=lambda n: (n.startswith("_"), n))
    for name in public:
        assert getattr(nvdd.models, name) is not None, name
    exposed = {
        n
        for n, v in vars(nvdd.models).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType)
    }
    assert exposed == public - {"__version__"}


def test_public_objects_are_defined_in_this_package() -> None:
    for name in nvdd.models.__all__:
        obj = getattr(nvdd.models, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            module = obj.__module__
            assert module.startswith("nvdd.models._"), (name, module)


def test_version_and_typing_marker() -> None:
    assert nvdd.models.__version__ == "0.1.0"
    assert (Path(nvdd.models.__file__).parent / "py.typed").is_file()


def test_models_expose_their_cutoff() -> None:
    lj = nvdd.models.LennardJones(nvdd.models.LJConfig(cutoff=3.0, epsilon=1.0, sigma=1.0))
    mpnn = nvdd.models.ReferenceMPNN(nvdd.models.MPNNConfig(cutoff=4.0))
    assert (lj.cutoff, mpnn.cutoff) == (3.0, 4.0)
    assert lj.neighbors.cutoff == 3.0 and mpnn.neighbors.cutoff == 4.0
    assert "cutoff=3.0" in repr(lj) and "cutoff=4.0" in repr(mpnn)
