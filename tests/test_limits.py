"""The share of a host each session gets, and how `[limits]` is read (pure, no engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuresa.cli import main
from gpuresa.config.reading import parse_config
from gpuresa.config.schema import Share, Size
from gpuresa.config.sections import LimitsConfig
from gpuresa.errors import ConfigError
from gpuresa.sessions.limits import (
    MIN_SESSION_CPUS,
    MIN_SESSION_MEMORY,
    HostTotals,
    SessionLimits,
    session_limits,
)

GIB = 1 << 30
EIGHT = HostTotals(cpus=33.0, memory=257 * GIB, gpus=8)
NO_RESERVE = LimitsConfig(reserve_cpus=0, reserve_memory=Size(0))


def test_a_session_gets_its_gpus_share_of_the_host_less_the_reserve() -> None:
    limits = LimitsConfig(reserve_cpus=1, reserve_memory=Size(GIB))
    assert session_limits(limits, EIGHT, 1) == SessionLimits(4.0, 32 * GIB)
    assert session_limits(limits, EIGHT, 2) == SessionLimits(8.0, 64 * GIB)
    assert session_limits(limits, EIGHT, 8) == SessionLimits(32.0, 256 * GIB)


def test_no_gpu_counts_as_one_and_more_than_the_host_as_all() -> None:
    assert session_limits(NO_RESERVE, EIGHT, 0) == session_limits(NO_RESERVE, EIGHT, 1)
    assert session_limits(NO_RESERVE, EIGHT, 9) == SessionLimits(33.0, 257 * GIB)


def test_a_host_without_gpus_gives_all_but_the_reserve() -> None:
    host = HostTotals(cpus=2.0, memory=8 * GIB, gpus=0)
    limits = LimitsConfig(reserve_cpus=0.5, reserve_memory=Share(0.25))
    assert session_limits(limits, host, 0) == SessionLimits(1.5, 6 * GIB)


def test_shares_round_down_to_a_hundredth_cpu_and_a_mib() -> None:
    host = HostTotals(cpus=1.0, memory=GIB + 3, gpus=3)
    result = session_limits(NO_RESERVE, host, 1)
    assert result.cpus == 0.33
    assert result.memory == (GIB // 3) // (1 << 20) * (1 << 20)
    host = HostTotals(cpus=0.9, memory=3 * GIB, gpus=3)
    assert session_limits(NO_RESERVE, host, 1).cpus == 0.3


def test_a_host_smaller_than_its_reserve_still_gives_the_minimum() -> None:
    tiny = HostTotals(cpus=1.0, memory=GIB, gpus=8)
    limits = LimitsConfig(reserve_cpus=4, reserve_memory=Size(2 * GIB))
    assert session_limits(limits, tiny, 1) == SessionLimits(MIN_SESSION_CPUS, MIN_SESSION_MEMORY)


def test_explicit_limits_apply_as_they_are() -> None:
    limits = LimitsConfig(cpus=6.5, memory=Size(48 * GIB))
    for booked in (0, 1, 8):
        assert session_limits(limits, EIGHT, booked) == SessionLimits(6.5, 48 * GIB)


def test_sizes_and_shares_are_read_once_into_types() -> None:
    config = parse_config(
        {"limits": {"memory": "64g", "reserve_memory": "12.5%", "layer_size": "off"}}
    )
    assert config.limits.memory == Size(64 * GIB)
    assert config.limits.reserve_memory == Share(0.125)
    assert config.limits.layer_size == "off"
    config = parse_config({"limits": {"reserve_memory": "16g", "layer_size": "100g"}})
    assert config.limits.reserve_memory == Size(16 * GIB)
    assert config.limits.layer_size == Size(100 * GIB)


@pytest.mark.parametrize(
    ("limits", "key"),
    [
        ({"memory": "lots"}, "limits.memory"),
        ({"memory": "1m"}, "limits.memory"),
        ({"reserve_memory": "100%"}, "limits.reserve_memory"),
        ({"reserve_memory": "150%"}, "limits.reserve_memory"),
        ({"reserve_cpus": -1}, "limits.reserve_cpus"),
        ({"cpus": 0}, "limits.cpus"),
        ({"layer_size": "1m"}, "limits.layer_size"),
        ({"layer_size": "on"}, "limits.layer_size"),
        ({"shm_size": "8 GB"}, "limits.shm_size"),
    ],
)
def test_bad_limits_are_named_by_key(limits: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config({"limits": limits})
    assert any(problem.startswith(f"{key}:") for problem in raised.value.problems), raised.value


def test_config_validate_and_show_print_each_hosts_limits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "config.toml"
    file.write_text(
        # folders of this machine, so that `config validate` finds none missing
        f'[daemon]\nhost = "gpu1"\nstate_dir = "{tmp_path / "state"}"\n'
        f'[users]\nkeys_dir = "{tmp_path}"\n[storage]\noutput_root = "{tmp_path / "out"}"\n'
        '[[hosts]]\nname = "gpu1"\ngpus = [0, 1, 2, 3]\n'
        '[[hosts]]\nname = "gpu2"\ngpus = [0, 1]\n[limits]\nreserve_memory = "4g"\n'
    )
    assert main(["config", "validate", "--config", str(file)]) == 0
    printed = capsys.readouterr().out
    assert "limits per session on gpu1:" in printed and "all 4 GPUs" in printed
    assert "limits per session on gpu2:" in printed and "writable layer: 30g" in printed
    assert main(["config", "show", "--config", str(file)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["limits"]["reserve_memory"] == "4g"
    assert set(shown["effective_limits"]) == {"gpu1", "gpu2"}
    assert "GiB memory" in shown["effective_limits"]["gpu2"]["1 GPU"]
