"""The configuration of a udocker host: its GPU mode by default, and `config validate` on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuresa.cli import main
from gpuresa.config.reading import parse_config


def write_config(folder: Path, host: str) -> Path:
    """A config of one host, `host` its [[hosts]] table's lines, its folders in `folder`."""
    file = folder / "config.toml"
    file.write_text(
        f"""
[daemon]
host = "gpu1"
state_dir = "{folder / "state"}"
[[hosts]]
name = "gpu1"
{host}
[users]
keys_dir = "{folder}"
[storage]
output_root = "{folder / "output"}"
"""
    )
    return file


@pytest.mark.parametrize(
    ("engine", "mode"), [("udocker", "devices"), ("docker", "nvidia"), ("slurm", "nvidia")]
)
def test_an_unset_gpu_mode_is_the_engines_own(engine: str, mode: str) -> None:
    config = parse_config({"daemon": {"host": "a"}, "hosts": [{"name": "a", "engine": engine}]})
    assert config.host().gpu_mode == mode
    # a mode that is set stays as set
    table = {"name": "a", "engine": engine, "gpu_mode": "none"}
    assert parse_config({"daemon": {"host": "a"}, "hosts": [table]}).host().gpu_mode == "none"


def test_config_validate_on_a_udocker_host_reports_instead_of_crashing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = write_config(tmp_path, 'engine = "udocker"')
    assert main(["config", "validate", "--config", str(file)]) == 0
    out = capsys.readouterr().out
    assert "host gpu1: isolation: udocker sessions as the booking's own login" in out, out
    assert main(["config", "show", "--config", str(file)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["hosts"][0]["gpu_mode"] == "devices"
    # a mode udocker cannot give and a typo: both listed, each with its key path
    file = write_config(tmp_path, 'engine = "udocker"\ngpu_mode = "nvidia"\nbind_adress = "x"')
    assert main(["config", "validate", "--config", str(file)]) == 1
    err = capsys.readouterr().err
    assert "hosts[0].bind_adress: unknown key" in err, err
    assert "hosts[0].gpu_mode: udocker sessions get GPUs as device nodes only" in err, err
