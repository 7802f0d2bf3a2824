"""Imported once by the rank forkserver (``NVDD_SPAWN_PRELOAD``, see conftest.py).

mace-torch and e3nn take seconds to import; imported here the nvdd way (torch.load's
default put back afterwards), every rank forked for a MACE test has them already.
"""

from __future__ import annotations

import contextlib

from nvdd.core import OptionalDependencyError, import_optional
from nvdd.models._mace_deps import mace_module

with contextlib.suppress(OptionalDependencyError):  # without the extra: the tests say so
    mace_module("mace.modules")
with contextlib.suppress(OptionalDependencyError):  # aimnet (and its toolkit kernels)
    import_optional("aimnet.models", package="aimnet", feature="preload")
