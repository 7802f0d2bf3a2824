"""A griffe extension: ``#:`` comments above a module attribute are its docstring.

The packages document their constants with Sphinx-style ``#:`` comment lines
(``#: Default collective timeout, seconds.`` above ``DEFAULT_TIMEOUT_S = 600.0``);
griffe reads only string literals after an assignment, so this extension turns
the comment block right above an attribute without a docstring into one. Used by
the docs build (``mkdocs.yml``) and by the public-API check (``docs_hooks.py``).
"""

from __future__ import annotations

from typing import Any

import griffe


class CommentDocstrings(griffe.Extension):
    """Give attributes their ``#:`` comment block as a docstring."""

    def on_attribute_instance(self, *, attr: griffe.Attribute, **kwargs: Any) -> None:
        if attr.docstring is not None or attr.lineno is None:
            return
        try:
            lines = attr.lines_collection[attr.filepath]  # type: ignore[index]
        except (KeyError, TypeError):
            return
        found: list[str] = []
        index = attr.lineno - 2  # the line above the assignment (0-based)
        while index >= 0 and lines[index].strip().startswith("#:"):
            found.append(lines[index].strip()[2:].strip())
            index -= 1
        if found:
            text = "\n".join(reversed(found))
            attr.docstring = griffe.Docstring(text, lineno=index + 2, parent=attr)
