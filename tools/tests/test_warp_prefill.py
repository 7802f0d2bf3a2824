"""tools/warp_prefill.py covers every Python module of the packages that defines Warp kernels."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from warp_prefill import KERNEL_MODULES

ROOT = Path(__file__).resolve().parents[2]
_KERNEL = re.compile(r"^\s*@wp\.kernel\b", re.MULTILINE)


def _kernel_modules() -> set[str]:
    found: set[str] = set()
    for src in sorted(ROOT.glob("packages/*/src")):
        for path in src.rglob("*.py"):
            if _KERNEL.search(path.read_text()):
                found.add(".".join(path.relative_to(src).with_suffix("").parts))
    return found


def test_every_kernel_module_of_the_packages_is_prefilled() -> None:
    """A module with ``@wp.kernel`` missing from the prefill would be compiled by
    each test process that meets it first in a fresh clone (record 0086); a name
    there that defines no kernel is stale."""
    found = _kernel_modules()
    assert "nvdd.halo._warp_kernels" in found  # (the scan sees the packages)
    assert sorted(found - set(KERNEL_MODULES)) == [], "add them to tools/warp_prefill.py"
    assert sorted(set(KERNEL_MODULES) - found) == [], "no kernels there any more"
