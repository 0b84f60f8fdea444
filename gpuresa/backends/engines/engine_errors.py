"""How the Docker engine's answers are read: refusals, ports taken, time-outs; secrets masked.

Used by `engine.Engine`, the one gateway, to map each failure once
(`mapped_errors`), each call logged and bounded in time:

- the engine cannot be reached (no socket, connection refused) → `RuntimeUnavailable`;
- the engine took the request but did not answer within the call's timeout
  (`timeout`, 30 s by default; builds get `build_timeout`) → `EngineTimeout`,
  a `SessionError`: that one action failed;
- a port Docker cannot publish because something holds it → `PortRefused`;
- removing what is already gone (404) or already being removed (409) → success;
- anything else the engine refuses → `EngineRefused` (a `SessionError`) with its reason;
  one that says a host interface vanished mid-call is tried again (`again_if_interface_vanished`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import docker.errors
import requests.exceptions
import urllib3.exceptions

from gpuresa.sessions.errors import EngineTimeout, PortRefused, RuntimeUnavailable, SessionError

log = logging.getLogger(__name__)


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


@contextlib.contextmanager
def mapped_errors(what: str, key: str | None = None) -> Iterator[None]:
    """Run one engine call, logging it and mapping Docker's errors (see the module)."""
    started = time.monotonic()
    log.debug("%sdocker: %s", f"{key}: " if key else "", what)
    try:
        yield
    except docker.errors.NotFound as error:
        raise NotFound(f"Docker: cannot {what}: {explanation(error)}", 404) from None
    except docker.errors.APIError as error:
        reason = explanation(error)
        ports = refused_ports(reason)
        if ports is not None:
            raise PortRefused(f"Docker refused to {what}: {reason}", ports) from None
        raise EngineRefused(f"Docker refused to {what}: {reason}", error.status_code) from None
    except (
        requests.exceptions.ConnectionError,
        requests.exceptions.Timeout,
        urllib3.exceptions.HTTPError,
        TimeoutError,
    ) as error:
        if timed_out(error):
            raise EngineTimeout(
                f"the Docker engine did not answer in time ({what}): {error}"
            ) from None
        raise RuntimeUnavailable(f"the Docker engine cannot be reached ({what}): {error}") from None
    except docker.errors.DockerException as error:
        # the SDK refused the request itself (a bad argument): not the engine's absence
        raise EngineRefused(f"Docker: cannot {what}: {error}") from None
    finally:
        elapsed = time.monotonic() - started
        if elapsed > 5:
            log.info("%sdocker: %s took %.1f s", f"{key}: " if key else "", what, elapsed)


Result = TypeVar("Result")

# Podman picks a new network's subnet from the host's interfaces; one removed meanwhile (another
# session's bridge going away) fails the creation with Go's "route ip+net: no such network
# interface". Nothing was made, and a moment later it succeeds.
VANISHED_INTERFACE = "no such network interface"


def again_if_interface_vanished(call: Callable[[], Result], attempts: int = 3) -> Result:
    """`call()`, made again (up to `attempts` in all) while the engine says an interface
    vanished under it; any other refusal is raised at once."""
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except EngineRefused as error:
            if VANISHED_INTERFACE not in str(error) or attempt == attempts:
                raise
            log.info("the engine lost a host interface mid-call (%s); trying again", error)
            time.sleep(0.2 * attempt)
    raise AssertionError("unreachable")
