"""Replays NVML answers recorded on a real GPU host (tests/corpus/gpus/nvml-*.json).

The recording (made by tests/corpus/gpus/record_nvml.py) lists each pynvml
call with its arguments and its answer or NVML error code. `RecordedNvml` has
pynvml's function names and answers each call as recorded; a call that was
not recorded fails the test. It stands in for the pynvml module at the
telemetry gateway's boundary, and nowhere else.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml

CORPUS = Path(__file__).parent / "corpus" / "gpus"


def _value(value: Any) -> Any:
    if isinstance(value, dict):
        return SimpleNamespace(**{name: _value(item) for name, item in value.items()})
    if isinstance(value, list):
        return [_value(item) for item in value]
    return value


class RecordedNvml:
    NVMLError = pynvml.NVMLError

    def __init__(self, name: str, *, fail_init: int | None = None) -> None:
        data = json.loads((CORPUS / f"nvml-{name}.json").read_text())
        self.answers: dict[tuple[str, str], dict[str, Any]] = {}
        for call in data["calls"]:
            self.answers[(call["function"], json.dumps(call["args"]))] = call
        self.fail_init = fail_init
        self.calls: list[str] = []

    def __getattr__(self, function: str) -> Any:
        if not function.startswith("nvml"):
            raise AttributeError(function)

        def replay(*args: Any) -> Any:
            self.calls.append(function)
            if function == "nvmlInit" and self.fail_init is not None:
                raise pynvml.NVMLError(self.fail_init)
            call = self.answers.get((function, json.dumps(list(args))))
            if call is None:
                raise AssertionError(f"no recorded answer for {function}{args}")
            if "error" in call:
                raise pynvml.NVMLError(call["error"])
            return _value(call["result"])

        return replay
