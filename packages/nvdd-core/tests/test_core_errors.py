"""Optional dependencies fail with the install hint and their own error; Warp
initialises quietly unless asked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nvdd.core import NvddError, OptionalDependencyError, import_optional


def test_the_error_names_the_feature_the_install_and_the_import_failure() -> None:
    cause = ModuleNotFoundError("No module named 'platformdirs'", name="platformdirs")
    err = OptionalDependencyError(
        "cuequivariance-torch", "MACEModel(cueq=True)", "nvdd-models[mace]", cause=cause
    )
    assert str(err) == (
        "MACEModel(cueq=True) needs cuequivariance-torch: pip install 'nvdd-models[mace]' "
        "(the import failed with ModuleNotFoundError: No module named 'platformdirs')"
    )
    assert err.cause is cause and err.package == "cuequivariance-torch"
    assert isinstance(err, ImportError) and isinstance(err, NvddError)
    # without a cause, or with a whole install command
    assert str(OptionalDependencyError("ase", "ASE conversion")) == (
        "ASE conversion needs ase: pip install ase"
    )
    assert str(OptionalDependencyError("x", "y", install="conda install x")).endswith(
        "needs x: conda install x"
    )


def test_import_optional_reports_a_missing_dependency_of_an_installed_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The package is there, but its own import fails: the message says which
    module is missing, not only that the package is."""
    (tmp_path / "nvdd_fake_extra.py").write_text("import nvdd_no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(OptionalDependencyError) as info:
        import_optional(
            "nvdd_fake_extra", package="fake-extra", feature="the fake feature", extra="p[x]"
        )
    message = str(info.value)
    assert message.startswith("the fake feature needs fake-extra: pip install 'p[x]' (")
    assert "ModuleNotFoundError: No module named 'nvdd_no_such_dependency_xyz'" in message
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    assert import_optional("json", package="json", feature="f").dumps([1]) == "[1]"


def test_warp_initialises_quietly_unless_nvdd_verbose() -> None:
    """No banner, no missing-driver notice by default; the banner with NVDD_VERBOSE=1."""
    pytest.importorskip("warp")
    code = "from nvdd.core import init_warp; init_warp(); init_warp(); print('ok')"
    outs = []
    for flag in ("", "1"):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), NVDD_VERBOSE=flag)
        res = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
        )
        assert res.returncode == 0, res.stderr[-2000:]
        outs.append(res.stdout + res.stderr)
    quiet, loud = outs
    assert quiet.strip() == "ok", quiet
    assert "initialized" in loud and "ok" in loud, loud
