"""A network creation that Podman fails because a host interface vanished under it (another
session's bridge going away) is made again; any other refusal is not. Pure: no engine."""

from __future__ import annotations

import time

import pytest

from gpuresa.backends.engines.engine_errors import EngineRefused, again_if_interface_vanished

VANISHED = "Docker refused to create network gpuresa-x: route ip+net: no such network interface"


class Engine:
    """Answers with the given refusals first, then with a network."""

    def __init__(self, *refusals: str) -> None:
        self.refusals = list(refusals)
        self.calls = 0

    def create(self) -> dict[str, str]:
        self.calls += 1
        if self.refusals:
            raise EngineRefused(self.refusals.pop(0), 500)
        return {"Id": "n1"}


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    waited: list[float] = []
    monkeypatch.setattr(time, "sleep", waited.append)
    return waited


def test_a_vanished_interface_is_tried_again(no_waiting: list[float]) -> None:
    engine = Engine(VANISHED, VANISHED)
    assert again_if_interface_vanished(engine.create) == {"Id": "n1"}
    assert engine.calls == 3 and no_waiting == [0.2, 0.4]


def test_it_gives_up_after_three_tries() -> None:
    engine = Engine(VANISHED, VANISHED, VANISHED)
    with pytest.raises(EngineRefused, match="no such network interface"):
        again_if_interface_vanished(engine.create)
    assert engine.calls == 3


def test_any_other_refusal_is_raised_at_once(no_waiting: list[float]) -> None:
    engine = Engine("Docker refused to create network gpuresa-x: all subnets are in use")
    with pytest.raises(EngineRefused, match="subnets"):
        again_if_interface_vanished(engine.create)
    assert engine.calls == 1 and no_waiting == []
