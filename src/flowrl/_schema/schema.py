"""The hub's column registry: declared up front, or fixed by the first write."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

from flowrl._schema.columns import Column
from flowrl._schema.encode import Encoded, encode, infer_column
from flowrl.errors import ConfigError, SchemaError, UnknownColumnError

__all__ = ["Schema"]


class Schema:
    """Columns by name. With ``infer=True`` an unknown column is declared by its first write."""

    def __init__(self, columns: Iterable[Column] = (), *, infer: bool = True) -> None:
        self._columns: dict[str, Column] = {}
        self._lock = threading.Lock()
        self.infer = infer
        for col in columns:
            if not isinstance(col, Column):
                raise ConfigError(f"columns must be flowrl.Column, got {type(col).__name__}")
            if col.name in self._columns:
                raise ConfigError(f"column {col.name!r} is declared twice")
            self._columns[col.name] = col

    def __contains__(self, name: object) -> bool:
        return name in self._columns

    def __getitem__(self, name: str) -> Column:
        try:
            return self._columns[name]
        except KeyError:
            raise UnknownColumnError(self._unknown_message(name)) from None

    def columns(self) -> tuple[Column, ...]:
        return tuple(self._columns.values())

    @property
    def by_name(self) -> Mapping[str, Column]:
        """Every declared column by name (live: it grows as columns are declared)."""
        return self._columns

    def declare(self, *columns: Column) -> None:
        """Declare columns all-or-nothing: a conflict on any leaves the schema unchanged."""
        with self._lock:
            seen: dict[str, Column] = {}
            for column in columns:
                existing = seen.get(column.name) or self._columns.get(column.name)
                if existing is not None and existing != column:
                    raise SchemaError(
                        f"column {column.name!r} is already declared as {existing.describe()}, "
                        f"cannot redeclare it as {column.describe()}"
                    )
                seen[column.name] = column
            self._columns.update(seen)

    def check_names(self, names: Iterable[str], where: str) -> tuple[str, ...]:
        if type(names) not in (tuple, list) and (  # (an ABC check costs more)
            isinstance(names, str | bytes) or not isinstance(names, Iterable)
        ):
            raise ConfigError(f"columns in {where} must be a list of column names, got {names!r}")
        names = tuple(names)
        for name in names:
            if not isinstance(name, str):
                raise SchemaError(f"column names must be str, got {name!r} in {where}")
            if name not in self._columns:
                raise UnknownColumnError(self._unknown_message(name, where))
        if len(set(names)) != len(names):
            raise SchemaError(f"duplicate column names {list(names)} in {where}")
        return names

    def encode_all(
        self, data: Mapping[str, Any], n: int | None, where: str, owned: bool = True
    ) -> tuple[dict[str, Encoded], list[Column], int]:
        """Encode every column of one write; raises before anything is registered
        (``owned``: see ``encode``).

        Returns the encoded arrays, the columns this write would newly declare (the caller
        declares them only once the whole write succeeded) and the sample count.
        """
        if not (type(data) is dict or isinstance(data, Mapping)) or not data:
            raise SchemaError(
                f"{where} expects a non-empty mapping of column name to values, got "
                f"{type(data).__name__ if not isinstance(data, Mapping) else 'an empty mapping'}"
            )
        encoded: dict[str, Encoded] = {}
        new: list[Column] = []
        for name, values in data.items():
            if not isinstance(name, str):
                raise SchemaError(f"column names must be str, got {name!r} in {where}")
            column = self._columns.get(name)
            if column is None:
                if not self.infer:
                    raise UnknownColumnError(self._unknown_message(name, where))
                column = infer_column(name, values)
                new.append(column)
            enc = encode(column, values, n, where, owned)
            if n is None:
                n = enc.length
            encoded[name] = enc
        if n == 0:
            raise SchemaError(f"{where} got zero samples; put at least one")
        assert n is not None
        return encoded, new, n

    def _unknown_message(self, name: str, where: str = "") -> str:
        known = ", ".join(sorted(self._columns)) or "none"
        loc = f" in {where}" if where else ""
        return (
            f"unknown column {name!r}{loc}; declared columns: {known}. "
            "Declare it in Hub(columns=[...]) or hub.declare(Column...)"
        )
