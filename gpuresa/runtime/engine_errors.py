"""How the Docker engine's answers are read: refusals, ports taken, time-outs; secrets masked.

Used by `engine.Engine`, the one gateway, to map each failure once (see there).
"""

from __future__ import annotations

import json
import re
from typing import Any

import docker.errors
import requests.exceptions
import urllib3.exceptions

from gpuresa.runtime.errors import SessionError


class EngineRefused(SessionError):
    """The engine answered with an error; `status` is its HTTP status."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class NotFound(EngineRefused):
    """What was asked for does not exist (HTTP 404)."""


def explanation(error: docker.errors.APIError) -> str:
    explanation = error.explanation
    if isinstance(explanation, bytes):
        explanation = explanation.decode(errors="replace")
    return str(explanation or error).strip()


def removal_in_progress(error: docker.errors.APIError) -> bool:
    text = explanation(error).lower()
    return error.status_code == 409 and ("in progress" in text or "removing" in text)


# What Docker says when a host port it should publish is taken
_PORT_TAKEN = ("port is already allocated", "address already in use")
# "Bind for 127.0.0.1:40001 failed", "listen tcp4 127.0.0.1:40001: bind", "[::1]:40001"
_PORT_ADDRESS = re.compile(r"(?:Bind for |listen [a-z0-9]+ )(\S+)")


def refused_ports(text: str) -> tuple[int, ...] | None:
    """The host ports an engine error says are taken; None when it is not about ports.

    Given Docker's error text; returns the port numbers it names (empty when it
    names none it can read).
    """
    if not any(phrase in text.lower() for phrase in _PORT_TAKEN):
        return None
    ports = set()
    for address in _PORT_ADDRESS.findall(text):
        number = address.rstrip(":").rpartition(":")[2]
        if number.isdigit() and 0 < int(number) < 65536:
            ports.add(int(number))
    return tuple(sorted(ports))


def timed_out(error: BaseException | None) -> bool:
    """Whether a transport error means "connected, but no answer in time"."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, requests.exceptions.ConnectTimeout):
            return False  # never connected: the engine is away
        if isinstance(
            error,
            requests.exceptions.ReadTimeout | urllib3.exceptions.ReadTimeoutError | TimeoutError,
        ):
            return True
        nested = [item for item in getattr(error, "args", ()) if isinstance(item, BaseException)]
        error = nested[0] if nested else (error.__cause__ or error.__context__)
        seen += 1
    return False


def dumps(value: Any) -> str:
    """JSON of an API payload with secrets masked, for debug logs."""

    def mask(item: Any) -> Any:
        if isinstance(item, dict):
            return {key: mask(value) for key, value in item.items()}
        if isinstance(item, list):
            return [mask(value) for value in item]
        if isinstance(item, str) and item.startswith("FTP_PASSWORD="):
            return "FTP_PASSWORD=***"
        return item

    return json.dumps(mask(value), sort_keys=True)
