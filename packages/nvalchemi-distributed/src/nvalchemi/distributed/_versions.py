"""Import-time check that the installed nvdd packages are the pinned ones.

The meta-package pins every nvdd distribution exactly. A mismatch (say a newer
nvdd-halo installed on its own afterwards) is an untested combination: refuse it
at import with both versions named. Editable installs and source trees (no
installed metadata) are development setups and are not checked.
"""

from __future__ import annotations

import json
import re
from importlib import metadata

from nvdd.core import NvddError

__all__ = ["VersionMismatchError", "check_versions", "pinned_versions"]

_DIST = "nvalchemi-distributed"


class VersionMismatchError(NvddError, ImportError):
    """An installed nvdd package differs from the version this meta-package pins."""


def _editable(dist: metadata.Distribution) -> bool:
    text = dist.read_text("direct_url.json")
    if not text:
        return False
    try:
        info = json.loads(text)
    except ValueError:
        return False
    return bool(info.get("dir_info", {}).get("editable", False))


def pinned_versions(dist: metadata.Distribution) -> dict[str, str]:
    """``{distribution: version}`` of every ``name==version`` requirement of ``dist``."""
    out: dict[str, str] = {}
    for req in dist.requires or []:
        m = re.match(r"\s*([A-Za-z0-9._-]+)\s*==\s*([^\s;,]+)\s*(;.*)?$", req)
        if m and m.group(1).startswith("nvdd-"):
            out[m.group(1)] = m.group(2)
    return out


def check_versions() -> None:
    """Raise :class:`VersionMismatchError` naming both versions on a mismatch."""
    try:
        dist = metadata.distribution(_DIST)
    except metadata.PackageNotFoundError:
        return  # a source tree on sys.path: nothing installed to check
    if _editable(dist):
        return
    problems = []
    for name, want in sorted(pinned_versions(dist).items()):
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # an extra that is not installed (nvdd-models)
        if have != want:
            problems.append(f"{name} {have} is installed but {_DIST} {dist.version} pins {want}")
    if problems:
        raise VersionMismatchError(
            "; ".join(problems)
            + f". Install matching versions: pip install '{_DIST}=={dist.version}'"
        )
