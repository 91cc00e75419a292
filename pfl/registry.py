"""Named registries (data sources, models, methods, compressors) and their one "unknown name" error.

A :class:`Registry` maps names to entries of one kind. Looking up a name it does not hold raises a
:class:`~pfl.schema.ConfigError` on the config field that named it, with the closest registered
name ("did you mean ...?") and every allowed one. ``load`` (called before the first lookup) lets a
registry fill itself lazily (the methods import their modules); ``missing`` may build an entry on
demand (``base+plugin`` method names).
"""

from __future__ import annotations

from typing import Callable, ClassVar, Generic, Iterator, TypeVar

from .schema import ConfigError, did_you_mean

T = TypeVar("T")


class Registry(Generic[T]):
    #: every registry made, in order (plugins snapshot them all and restore them when one fails)
    instances: ClassVar[list["Registry"]] = []

    def __init__(self, what: str, field: str, *, also: tuple[str, ...] = (), sort: bool = False,
                 load: Callable[[], None] | None = None, missing: Callable[[str], T | None] | None = None):
        self.what = what            # "data source", "model", ...
        self.field = field          # the config field that names an entry, e.g. "data.source"
        self.also = also            # names allowed besides the entries (a compressor named "none")
        self.sort = sort            # list the allowed names sorted (else in registration order)
        self._load = load
        self._missing = missing
        self._entries: dict[str, T] = {}
        Registry.instances.append(self)

    def register(self, name: str, entry: T, replace: bool = False) -> T:
        if not replace and name in self._entries and self._entries[name] is not entry:
            raise ValueError(f"{self.what} {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def snapshot(self) -> dict[str, T]:
        """The entries as they are now (built-ins loaded first), for :meth:`restore`."""
        return dict(self._loaded())

    def restore(self, entries: dict[str, T]) -> None:
        """Back to a :meth:`snapshot`: entries registered since are forgotten."""
        self._entries.clear()
        self._entries.update(entries)

    def remove(self, name: str) -> None:
        """Forget ``name`` (an entry registered for a while, e.g. by a test)."""
        self._entries.pop(name, None)

    def _loaded(self) -> dict[str, T]:
        if self._load is not None:
            load, self._load = self._load, None
            load()
        return self._entries

    def names(self) -> list[str]:
        names = list(self._loaded())
        return sorted(names) if self.sort else names

    def values(self) -> list[T]:
        entries = self._loaded()
        return [entries[n] for n in self.names()]

    def items(self) -> list[tuple[str, T]]:
        entries = self._loaded()
        return [(n, entries[n]) for n in self.names()]

    def __contains__(self, name: object) -> bool:
        return name in self._loaded()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._loaded())

    def get(self, name: str, field: str | None = None) -> T:
        """The entry ``name``; a ConfigError on ``field`` (default: the registry's) when unknown."""
        entries = self._loaded()
        if name not in entries and self._missing is not None and isinstance(name, str):
            built = self._missing(name)
            if built is not None:
                entries[name] = built
        if name not in entries:
            raise self.unknown(name, field)
        return entries[name]

    __getitem__ = get

    def unknown(self, name: object, field: str | None = None) -> ConfigError:
        allowed = [*self.also, *self.names()]
        return ConfigError(field or self.field, f"unknown {self.what} {name!r}{did_you_mean(name, allowed)}; "
                                                f"allowed: {', '.join(allowed)}")


__all__ = ["Registry"]
