"""Waiting for a condition in a test, with one order of arguments everywhere."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

Value = TypeVar("Value")


def wait_for(
    condition: Callable[[], Value | None], timeout: float, what: str, *, every: float = 0.1
) -> Value:
    """Poll `condition` until it returns something true, and return that.

    Fails the test, naming `what`, when `timeout` seconds pass first.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")
