"""Objects the spec tests patch (module-level, so adapters can name them)."""

from __future__ import annotations

from typing import Any


class Base:
    def greet(self, name: str) -> str:
        return f"hello {name}"

    @staticmethod
    def static() -> str:
        return "static"


class Child(Base):
    def own(self, x: int) -> int:
        return x + 1


def add_one(x: int) -> int:
    return x + 1


def uses_add_one(x: int) -> int:
    return add_one(x) * 10


FLAG = "original"


def shout(original: Any, self_: Any, *args: Any, **kwargs: Any) -> str:
    return str(original(self_, *args, **kwargs)).upper()


def double_result(original: Any, *args: Any, **kwargs: Any) -> int:
    return 2 * int(original(*args, **kwargs))


def other_double(original: Any, *args: Any, **kwargs: Any) -> int:
    return 3 * int(original(*args, **kwargs))


REPLACED_FLAG = "replaced"


def boom(original: Any, self_: Any, *args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("planted failure inside a patched method")
