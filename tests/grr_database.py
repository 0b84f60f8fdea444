"""A GRR database on the real MariaDB of `make setup`, written as GRR writes it.

`GRRDatabase.create()` makes a database of its own (unique to the test run)
with GRR's tables (tests/fixtures/grr_tables.sql, copied from GRR's
installation script) and a read-only account, and `drop()` removes both. The
helpers write rows with GRR's own statements: an INSERT for each occurrence
(a series is one row per occurrence, entry_type 1), an UPDATE of the row for
an occurrence edited on its own (entry_type 2), `supprimer = 1` to delete.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pymysql

SOCKET = Path("/run/gpuresa-mariadb/mysqld.sock")
PORT = 3307
TABLES = Path(__file__).parent / "fixtures" / "grr_tables.sql"


@dataclass
class GRRDatabase:
    """One test database and its read-only account."""

    name: str
    reader: str
    password_file: Path
    prefix: str = "grr_"
    _admin: Any = field(default=None, repr=False)

    @classmethod
    def create(cls, directory: Path, prefix: str = "grr_") -> GRRDatabase:
        """A fresh database with GRR's tables; fails loudly without MariaDB."""
        try:
            admin = pymysql.connect(unix_socket=str(SOCKET), user="root", autocommit=True)
        except pymysql.MySQLError as error:
            raise RuntimeError(
                f"MariaDB does not answer on {SOCKET} ({error}); run `make setup`"
            ) from None
        tag = secrets.token_hex(4)
        name, reader = f"gpuresa_grr_{tag}", f"gpuresa_ro_{tag}"
        password = secrets.token_urlsafe(16)
        password_file = directory / f"grr-password-{tag}"
        password_file.write_text(password + "\n")
        cursor = admin.cursor()
        cursor.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
        cursor.execute(f"USE `{name}`")
        for statement in TABLES.read_text().split(";\n"):
            lines = [line for line in statement.splitlines() if not line.startswith("--")]
            if "".join(lines).strip():
                cursor.execute("\n".join(lines).replace("grr_", prefix))
        # what a site grants gpuresa: SELECT on GRR's database, from anywhere it connects
        for where in ("localhost", "127.0.0.1"):
            cursor.execute(f"CREATE USER '{reader}'@'{where}' IDENTIFIED BY %s", (password,))
            cursor.execute(f"GRANT SELECT ON `{name}`.* TO '{reader}'@'{where}'")
        return cls(name, reader, password_file, prefix, admin)

    def drop(self) -> None:
        cursor = self._admin.cursor()
        cursor.execute(f"DROP DATABASE IF EXISTS `{self.name}`")
        for where in ("localhost", "127.0.0.1"):
            cursor.execute(f"DROP USER IF EXISTS '{self.reader}'@'{where}'")
        self._admin.close()

    def execute(self, sql: str, arguments: tuple[object, ...] = ()) -> Any:
        cursor = self._admin.cursor()
        cursor.execute(f"USE `{self.name}`")
        cursor.execute(sql.replace("grr_", self.prefix), arguments or None)
        return cursor

    def calendar(self, rooms: dict[str, str], **more: object) -> dict[str, object]:
        """A [[calendars]] table reading this database over the socket."""
        return {
            "name": "grr",
            "kind": "grr",
            "url": f"mysql://localhost/{self.name}",
            "unix_socket": str(SOCKET),
            "username": self.reader,
            "password_file": str(self.password_file),
            "table_prefix": self.prefix,
            "rooms": rooms,
            **more,
        }

    # --- GRR's rows ------------------------------------------------------------------------

    def add_area(self, name: str, *, periods: bool = False) -> int:
        cursor = self.execute(
            "INSERT INTO grr_area (area_name, enable_periods) VALUES (%s, %s)",
            (name, "y" if periods else "n"),
        )
        return int(cursor.lastrowid)

    def add_room(self, name: str, area: int) -> int:
        cursor = self.execute(
            "INSERT INTO grr_room (area_id, room_name, comment_room) VALUES (%s, %s, '')",
            (area, name),
        )
        return int(cursor.lastrowid)

    def add_user(self, login: str, email: str, *, state: str = "actif") -> None:
        self.execute(
            "INSERT INTO grr_utilisateurs (login, nom, prenom, email, statut, etat) "
            "VALUES (%s, 'Nom', 'Prenom', %s, 'utilisateur', %s)",
            (login.upper(), email, state),
        )

    def book(
        self,
        room: int,
        start: datetime,
        end: datetime,
        beneficiary: str,
        description: str = "",
        *,
        entry_type: int = 0,
        repeat_id: int = 0,
        moderate: int = 0,
        outside: str = "",
    ) -> int:
        """One row as GRR's mrbsCreateSingleEntry inserts it; returns its id."""
        cursor = self.execute(
            "INSERT INTO grr_entry (start_time, end_time, entry_type, repeat_id, room_id, "
            "create_by, beneficiaire, beneficiaire_ext, name, type, description, statut_entry, "
            "option_reservation, overload_desc, moderate, jours, clef, courrier, "
            "nbparticipantmax) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, 'GPU', 'A', %s, '-', "
            "0, '', %s, 0, 0, 0, 0)",
            (
                int(start.timestamp()), int(end.timestamp()), entry_type, repeat_id, room,
                beneficiary.upper(), beneficiary.upper(), outside, description, moderate,
            ),
        )  # fmt: skip
        return int(cursor.lastrowid)

    def book_weekly(
        self, room: int, start: datetime, length: timedelta, weeks: int, beneficiary: str,
        description: str = "",
    ) -> list[int]:  # fmt: skip
        """A weekly series: its grr_repeat row and one entry row per occurrence."""
        end = start + length
        last = start + timedelta(weeks=weeks - 1)
        cursor = self.execute(
            "INSERT INTO grr_repeat (start_time, end_time, rep_type, end_date, rep_opt, "
            "room_id, create_by, beneficiaire, name, description, rep_num_weeks) "
            "VALUES (%s, %s, 2, %s, '0100000', %s, %s, %s, 'GPU', %s, 1)",
            (
                int(start.timestamp()), int(end.timestamp()), int(last.timestamp()), room,
                beneficiary.upper(), beneficiary.upper(), description,
            ),
        )  # fmt: skip
        series = int(cursor.lastrowid)
        return [
            self.book(
                room,
                start + timedelta(weeks=week),
                end + timedelta(weeks=week),
                beneficiary,
                description,
                entry_type=1,
                repeat_id=series,
            )
            for week in range(weeks)
        ]

    def move(self, entry: int, start: datetime, end: datetime) -> None:
        """One occurrence edited on its own: GRR updates its row, entry_type 2."""
        self.execute(
            "UPDATE grr_entry SET start_time = %s, end_time = %s, entry_type = 2 WHERE id = %s",
            (int(start.timestamp()), int(end.timestamp()), entry),
        )

    def set_description(self, entry: int, description: str) -> None:
        self.execute("UPDATE grr_entry SET description = %s WHERE id = %s", (description, entry))

    def delete(self, entry: int) -> None:
        """GRR 4 deletes softly."""
        self.execute("UPDATE grr_entry SET supprimer = 1 WHERE id = %s", (entry,))

    def moderate(self, entry: int, decision: int) -> None:
        """A moderator's decision: 2 accepted, 3 refused."""
        self.execute("UPDATE grr_entry SET moderate = %s WHERE id = %s", (decision, entry))
