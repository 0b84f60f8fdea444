"""The shapes of names in the config: host names, logins, and the checks of logins."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}"
LOGIN = r"[a-z_][a-z0-9_-]{0,31}"


def valid_logins(values: tuple[str, ...]) -> str | None:
    bad = [value for value in values if not re.fullmatch(LOGIN, value)]
    return f"not valid logins: {', '.join(map(repr, bad))}" if bad else None


def valid_login_keys(values: Mapping[str, Any]) -> str | None:
    return valid_logins(tuple(values))


def valid_login_values(values: Mapping[str, str]) -> str | None:
    return valid_logins(tuple(values.values()))
