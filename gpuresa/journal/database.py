"""The journal's one connection, and the guard that every table's reads and writes go through.

`Database` holds the SQLite connection and its lock. A `Table` is one part
of the journal (the reservations, the states, the outbox…), an object given
the `Database`; each public method of a table is declared `@reads(fallback)`
or `@writes(fallback)`, and a table class with any other public member is
refused when it is defined. So every read and write runs inside
`Database.attempt`, and the SQL itself (`transaction`, `query`) refuses to
run anywhere else: no method can slip past the guard, however new.

A strict database (`gpuresa status`, `gpuresa history`, the tests) lets
errors raise. A guarded one (the daemon's, see `gpuresa.journal.guard`)
logs a failed read or write and returns the method's fallback instead, so a
full disk, a locked or a damaged file never keeps a session from ending.
"""

from __future__ import annotations

import functools
import logging
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from copy import copy
from typing import Any, TypeVar, cast

log = logging.getLogger(__name__)

Result = TypeVar("Result")
Method = TypeVar("Method", bound=Callable[..., Any])

# set on each guarded method: ("read" | "write", fallback)
GUARD = "__journal_guard__"


class Database:
    """One SQLite connection shared by the journal's tables, safe to share between threads.

    Given the open connection; `guarded` says whether a failed read or
    write raises (False) or is logged and replaced by its fallback (True).
    """

    def __init__(self, connection: sqlite3.Connection, *, guarded: bool) -> None:
        self.guarded = guarded
        self._connection = connection
        self._lock = threading.RLock()
        # how deep the current thread is in `attempt`: SQL runs only inside it
        self._depth = threading.local()

    def attempt(self, what: str, call: Callable[[], Result], fallback: Result) -> Result:
        """`call()`, under the lock; when guarded, a copy of `fallback` if it fails.

        A failure is an `sqlite3.Error` or a `ValueError` (a stored instant that
        no longer reads, a damaged row, or an argument the table refuses);
        strict, it raises.
        """
        with self._lock:
            depth = getattr(self._depth, "value", 0)
            self._depth.value = depth + 1
            try:
                return call()
            except (sqlite3.Error, ValueError) as error:
                if not self.guarded:
                    raise
                log.error("journal %s failed (%s); going on without it", what, error)
                return copy(fallback)
            finally:
                self._depth.value = depth

    def _inside_attempt(self) -> None:
        if not getattr(self._depth, "value", 0):
            raise RuntimeError(
                "journal SQL outside a table's @reads/@writes method: it would not be guarded"
            )

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """The connection inside BEGIN IMMEDIATE … COMMIT, under the lock; rolled back on error.

        Raises RuntimeError outside a guarded method (see `Table`).
        """
        self._inside_attempt()
        with self._lock:
            self._connection.execute("BEGIN IMMEDIATE")
            try:
                yield self._connection
            except BaseException:
                # SQLite may have rolled back already (a full disk, say)
                if self._connection.in_transaction:
                    self._connection.execute("ROLLBACK")
                raise
            self._connection.execute("COMMIT")

    def query(self, sql: str, parameters: Sequence[Any] = ()) -> list[sqlite3.Row]:
        """The rows `sql` reads; raises RuntimeError outside a guarded method."""
        self._inside_attempt()
        with self._lock:
            cursor = self._connection.cursor()
            cursor.row_factory = sqlite3.Row
            return list(cursor.execute(sql, parameters))

    def close(self) -> None:
        """Close the connection; every later read or write fails (or falls back)."""
        with self._lock:
            self._connection.close()


def _guard(kind: str, fallback: object) -> Callable[[Method], Method]:
    def decorate(method: Method) -> Method:
        @functools.wraps(method)
        def guarded(self: Table, *arguments: Any, **keywords: Any) -> Any:
            return self._database.attempt(
                f"{self._label}{method.__name__}",
                lambda: method(self, *arguments, **keywords),
                fallback,
            )

        setattr(guarded, GUARD, (kind, fallback))
        return cast(Method, guarded)

    return decorate


def reads(fallback: object) -> Callable[[Method], Method]:
    """Declare a table's method a read; guarded, a failure returns a copy of `fallback`."""
    return _guard("read", fallback)


def writes(fallback: object) -> Callable[[Method], Method]:
    """Declare a table's method a write; guarded, a failure returns a copy of `fallback`.

    The fallback is what lets the daemon go on: nothing, False for "did not
    change", or what makes the caller do the safe thing.
    """
    return _guard("write", fallback)


class Table:
    """One part of the journal, given the `Database` it reads and writes.

    Every public member of a subclass must be a method declared with
    `@reads` or `@writes`; any other raises TypeError when the class is
    defined, so nothing reaches the connection unguarded.
    """

    # how the journal names the table in its log: "states." for `journal.states`
    _label = ""

    def __init__(self, database: Database) -> None:
        self._database = database

    def __init_subclass__(cls, **keywords: Any) -> None:
        super().__init_subclass__(**keywords)
        for name, member in vars(cls).items():
            if name.startswith("_"):
                continue
            if not callable(member) or not hasattr(member, GUARD):
                raise TypeError(
                    f"{cls.__name__}.{name}: a journal table's public members must be "
                    "methods declared with @reads or @writes"
                )


def guarded_methods(table: Table) -> dict[str, tuple[str, object]]:
    """Each public method of `table`: its name → ("read" | "write", fallback)."""
    methods: dict[str, tuple[str, object]] = {}
    for cls in type(table).__mro__:
        if cls is Table or not issubclass(cls, Table):
            continue
        for name, member in vars(cls).items():
            if not name.startswith("_") and name not in methods:
                methods[name] = getattr(member, GUARD)
    return methods
