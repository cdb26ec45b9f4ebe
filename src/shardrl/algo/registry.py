"""Name -> function registries, one per algorithm family.

Every family (policy losses, aggregations, advantage estimators, KL estimators) keeps its
members in one `Registry`; callers resolve a configured name with `get` and never branch on
names themselves. An unknown name raises `UnknownNameError`, whose message lists the known
names, so a typo in a config says what it could have been.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable[..., object])


class UnknownNameError(KeyError, ValueError):
    """A name that no registry entry carries; a `KeyError` and a `ValueError` at once."""

    def __str__(self) -> str:
        # KeyError would print the message in quotes; show it as written.
        return str(self.args[0]) if self.args else ""


def unknown_name(family: str, name: str, known: list[str]) -> UnknownNameError:
    """Build the error for `name` missing from `family`, listing the `known` names."""
    return UnknownNameError(f"unknown {family} {name!r}; known: {', '.join(known)}")


class Registry(Generic[F]):
    """Functions of one family registered under unique names."""

    def __init__(self, family: str) -> None:
        self.family = family
        self._items: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator registering a function under `name`; a name can be taken only once."""

        def decorator(fn: F) -> F:
            if name in self._items:
                raise ValueError(f"{self.family} {name!r} is already registered")
            self._items[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        """The function registered as `name`; `UnknownNameError` listing the known names."""
        try:
            return self._items[name]
        except KeyError:
            raise unknown_name(self.family, name, self.names()) from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._items)
