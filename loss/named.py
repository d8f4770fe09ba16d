"""A small name → item registry, and dotted-path loading, shared by losses and advantages.

Owns: `Registry` (register with an explicit `replace`, lookup that lists the choices on a
miss) and `load_function` (`pkg.module.attr` or `pkg.module:attr`). Must never import
`slime_async`.

Worked example::

    r = Registry[int]("estimator")
    r.register("grpo", 1)
    r.get("grpo")            # 1
    r.get("nope")            # ValueError: unknown estimator 'nope'; choose one of grpo
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Items by name; `kind` names them in error messages ("loss", "advantage estimator")."""

    def __init__(self, kind: str, *, hint: str = "") -> None:
        self.kind = kind
        self.hint = hint
        """Appended to the unknown-name error (e.g. how to add your own)."""
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T, *, replace: bool = False) -> T:
        """Add `item` as `name`; a taken name needs `replace=True`."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} needs a non-empty string name, got {name!r}.")
        if name in self._items and not replace:
            raise ValueError(
                f"{self.kind} {name!r} is already registered; pick another name or pass "
                "replace=True."
            )
        self._items[name] = item
        return item

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def get(self, name: str) -> T:
        """The item registered as `name`; unknown names raise ValueError listing the choices."""
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; choose one of {', '.join(self.names())}{self.hint}."
            ) from None


def load_function(path: str) -> Callable[..., Any]:
    """Import `pkg.module.attr` (or `pkg.module:attr`) and return it; clear errors otherwise."""
    obj = load_object(path)
    if not callable(obj):
        raise ValueError(f"{path!r} is a {type(obj).__name__}, not a function.")
    return obj


def load_object(path: str) -> Any:
    """Import `pkg.module.attr` (or `pkg.module:attr`) and return the attribute."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError("the function path is empty; give it as pkg.module.function.")
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not a dotted path; give it as pkg.module.function.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"cannot import module {module_name!r} for {path!r} ({e}); make sure it is on PYTHONPATH."
        ) from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(
            f"module {module_name!r} has no attribute {attr!r} (from {path!r})."
        ) from None
