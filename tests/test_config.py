"""The config loader: defaults, every validator rejecting, all problems listed at once."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tomllib
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from gpuresa.cli import main
from gpuresa.config import calendar_sections, reporting_sections, rules_sections, sections
from gpuresa.config.loading import read_secret
from gpuresa.config.reading import load_config, parse_config
from gpuresa.config.schema import Invalid, PortRange, format_duration, parse_duration
from gpuresa.config.sections import Config
from gpuresa.errors import ConfigError, UserError

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "config.example.toml"

MINIMAL_HOST = '[daemon]\nhost = "gpu1"\n[[hosts]]\nname = "gpu1"\n'


def on_this_machine(folder: Path) -> str:
    """[daemon], [users] and [storage] lines whose folders exist under `folder`, so that
    `config validate` has nothing to say about this machine."""
    (folder / "keys").mkdir(exist_ok=True)
    return (
        f'[daemon]\nhost = "gpu1"\nstate_dir = "{folder / "state"}"\n'
        f'[users]\nkeys_dir = "{folder / "keys"}"\n'
        f'[storage]\noutput_root = "{folder / "output"}"\n'
    )


def problems_of(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(tomllib.loads(text), "test.toml")
    return caught.value.problems


def test_empty_file_gives_the_defaults() -> None:
    config = parse_config({}, "empty.toml")
    assert config.daemon.poll_interval == timedelta(seconds=5)
    assert config.daemon.warnings == (timedelta(minutes=15), timedelta(minutes=5))
    assert config.templates.allowed == ("tensorflow", "digits", "pytorch")
    assert config.hosts == ()


def test_example_is_valid_and_sets_what_it_shows() -> None:
    config = load_config(EXAMPLE)
    assert config.daemon.host == "gpu1"
    assert config.hosts[0].gpus == (0, 1, 2, 3)
    assert config.calendars[0].password_credential == "caldav-password"
    assert config.storage.inputs[0].target == Path("/data")


SECTIONS: dict[str, type] = {
    "daemon": calendar_sections.DaemonConfig,
    "reservations": calendar_sections.ReservationsConfig,
    "calendars": calendar_sections.CalendarConfig,
    "hosts": sections.HostConfig,
    "templates": sections.TemplatesConfig,
    "users": sections.UsersConfig,
    "storage": sections.StorageConfig,
    "storage.inputs": sections.InputMount,
    "limits": sections.LimitsConfig,
    "udocker": sections.UdockerConfig,
    "notify": reporting_sections.NotifyConfig,
    "telemetry": reporting_sections.TelemetryConfig,
    "slurm": sections.SlurmConfig,
    "rules": rules_sections.RulesConfig,
}
# a commented key line ending with this shows an example value of a key unset by default
EXAMPLE_MARK = "# example; unset by default"


def documented_keys() -> list[tuple[str, str, str, bool]]:
    """(section, key, value as written, commented) of every key line, section by section."""
    found, section = [], ""
    for line in EXAMPLE.read_text().splitlines():
        header = re.match(r"^\[\[?([a-z_.]+)\]\]?\s*$", line)
        if header:
            section = header.group(1)
            continue
        key_line = re.match(r"^(# ?)?([a-z_]+) = (.+)$", line)
        if key_line and section:
            found.append((section, key_line[2], key_line[3], key_line[1] is not None))
    return found


def field_value(document: dict[str, Any], section: str, key: str) -> Any:
    """The value the schema gives `section.key` when it reads `document`."""
    value: Any = parse_config(document, "example")
    for part in section.split("."):
        value = getattr(value, part)
        value = value[0] if isinstance(value, tuple) else value
    return getattr(value, key)


def test_example_documents_every_key_once_per_section() -> None:
    written: dict[str, list[str]] = {}
    for section, key, _, _ in documented_keys():
        written.setdefault(section, []).append(key)
    for section, cls in SECTIONS.items():
        expected = {field.name for field in dataclasses.fields(cls)}
        if section == "storage":
            expected -= {"inputs"}  # its own [[storage.inputs]] tables
        shown = written.get(section, [])
        assert sorted(set(shown)) == sorted(expected), section
        repeated = {key for key in shown if shown.count(key) > 1}
        assert repeated <= {"gpu_mode"}, (section, repeated)  # gpu_mode: one line per choice
    top_level = {field.name for field in dataclasses.fields(Config)} - {"source"}
    assert top_level == {name.split(".")[0] for name in SECTIONS}


def test_every_documented_default_is_the_schemas() -> None:
    """A commented `# key = value` line states the default: the schema must agree."""
    mismatched = []
    for section, key, written, commented in documented_keys():
        if not commented:
            continue  # a value the example sets, not a default
        document = tomllib.loads(EXAMPLE.read_text())
        table: Any = document
        for part in section.split("."):
            table = table.setdefault(part, {})
            table = table[0] if isinstance(table, list) else table
        table.pop(key, None)
        default = field_value(document, section, key)
        if written.endswith(EXAMPLE_MARK) or EXAMPLE_MARK in written:
            # an example of a key that is unset by default
            if default not in (None, {}, (), ""):
                mismatched.append(f"{section}.{key}: marked unset, default is {default!r}")
            continue
        table[key] = tomllib.loads(f"value = {written}")["value"]
        if key == "gpu_mode" and table[key] != "nvidia":
            continue  # the other choices of gpu_mode, each on a line of its own
        if field_value(document, section, key) != default:
            mismatched.append(f"{section}.{key}: documented {written}, default is {default!r}")
    assert mismatched == []


def test_unknown_key_wrong_type_and_bad_duration_are_all_reported() -> None:
    problems = problems_of(
        MINIMAL_HOST
        + '[notify]\nsmtp_prot = 25\nsmtp_port = "twenty-five"\n'
        + '[reservations]\nmax_duration = "3 days"\n'
    )
    text = "\n".join(problems)
    assert "notify.smtp_prot: unknown key" in text
    assert "notify.smtp_port: expected an integer" in text
    assert "reservations.max_duration: expected a duration" in text
    assert len(problems) == 3


@pytest.mark.parametrize(
    ("snippet", "key", "fragment"),
    [
        ('[daemon]\npoll_interval = "0s"', "daemon.poll_interval", "longer than 0s"),
        ('[daemon]\nwarnings = ["15m", "0s"]', "daemon.warnings", "longer than 0s"),
        ('[daemon]\nstate_dir = "relative/dir"', "daemon.state_dir", "absolute path"),
        ('[daemon]\nhost = "gpu/1"', "daemon.host", "host name"),
        ("[daemon]\nstop_grace = 30", "daemon.stop_grace", "duration"),
        ('[reservations]\ntimezone = "Mars/Olympus"', "reservations.timezone", "time zone"),
        ('[reservations]\nallowed_users = ["Alice"]', "reservations.allowed_users", "logins"),
        ('[[hosts]]\nname = "h"\ngpus = "four"', "hosts[0].gpus", 'GPU indices or "auto"'),
        ('[[hosts]]\nname = "h"\ngpus = [0, 0]', "hosts[0].gpus", "must not repeat"),
        ('[[hosts]]\nname = "h"\ngpus = [-1]', "hosts[0].gpus", "0 or more"),
        ('[[hosts]]\nname = "h"\ngpu_mode = "amd"', "hosts[0].gpu_mode", "'nvidia'"),
        ('[[hosts]]\nname = "h"\nengine = "lxc"', "hosts[0].engine", "'podman'"),
        ('[[hosts]]\nname = "h"\nengine = "podman"', "hosts[0].gpu_mode", 'use "cdi"'),
        ('[[hosts]]\nname = "h"\nengine_socket = "/run/x.sock"', "hosts[0].engine_socket", "URL"),
        ('[[hosts]]\nname = "h"\nssh_ports = "9-2"', "hosts[0].ssh_ports", "first <= last"),
        ('[[hosts]]\nname = "h"\nssh_ports = "a-b"', "hosts[0].ssh_ports", "port range"),
        (
            '[[hosts]]\nname = "h"\nftp_ports = "240-260"',
            "hosts[0].ftp_ports",
            "overlaps ssh_ports",
        ),
        (
            '[[hosts]]\nname = "h"\nftp_passive_ports = "40000-40001"',
            "hosts[0].ftp_passive_ports",
            "fewer ports",
        ),
        (
            '[[hosts]]\nname = "h"\nftp_passive_ports = "900-999"',
            "hosts[0].ftp_passive_ports",
            "at or below 1024",
        ),
        ('[[hosts]]\nname = "h"\nftp_passive_per_session = 0', "hosts[0]", "at least 1"),
        ("[[hosts]]\ngpus = [0]", "hosts[0].name", "missing"),
        ('[[hosts]]\nname = "a"\n[[hosts]]\nname = "a"', "hosts[1].name", "another host"),
        ('[daemon]\nhost = "b"\n[[hosts]]\nname = "a"', "daemon.host", "not one of"),
        ('[[calendars]]\nname = "c"\nurl = "ftp://x"', "calendars[c].url", "http(s) URL"),
        (
            '[[calendars]]\nname = "c"\nkind = "ics"\nurl = "feed.ics"',
            "calendars[c].url",
            "absolute path",
        ),
        ('[[calendars]]\nname = "c"\nurl = "https://x"\nkind = "ical"', "calendars[c].kind", ""),
        (
            '[[calendars]]\nname = "c"\nurl = "https://x"\nsummary_regex = "(unclosed"',
            "calendars[c].summary_regex",
            "regular expression",
        ),
        (
            '[[calendars]]\nname = "c"\nurl = "https://x"\nhost = "nowhere"',
            "calendars[c].host",
            "not one of",
        ),
        (
            '[[calendars]]\nname = "c"\nurl = "https://x"\nemail_logins = {"a@b" = "Bad Login"}',
            "calendars[c].email_logins",
            "logins",
        ),
        ('[[calendars]]\nname = "c"\nurl = "https://x"\ndefault_gpus = 0', "calendars[c]", ""),
        ('[[calendars]]\nname = "bad name"\nurl = "https://x"', "calendars[0].name", ""),
        ("[users]\nuid_base = 10", "users.uid_base", "at least 1000"),
        ('[users]\nuids = {"Alice" = 1000}', "users.uids", "logins"),
        ('[users]\nuids = {"alice" = "x"}', "users.uids.alice", "integer"),
        ('[limits]\nmemory = "lots"', "limits.memory", "size"),
        ("[limits]\npids = 10", "limits.pids", "at least 64"),
        ("[limits]\ncpus = true", "limits.cpus", "number"),
        ('[storage]\noutput_pattern = "/abs/{user}"', "storage.output_pattern", "relative"),
        (
            '[[storage.inputs]]\nsource = "/a"\ntarget = "/output"',
            "storage.inputs[0].target",
            "output folder",
        ),
        ('[[storage.inputs]]\nsource = "a"\ntarget = "/x"', "storage.inputs[0].source", ""),
        ('[notify]\nsecurity = "ssl"', "notify.security", "'starttls'"),
        ('[notify]\nenabled = true\nusername = "u"', "notify.username", "password_file"),
        ('[telemetry]\nlisten = "9464"', "telemetry.listen", "address:port"),
        ('[telemetry]\nlisten = "127.0.0.1:99999"', "telemetry.listen", "address:port"),
        ("[telemetry]\nidle_threshold = 101", "telemetry.idle_threshold", "percentage"),
        ('[telemetry]\nidle_action = "stop"', "telemetry.idle_action", "'notify'"),
        ('[telemetry]\nbackend = "dcgm"', "telemetry.backend", "'nvml'"),
        ('[notify]\nenabled = "yes"', "notify.enabled", "true or false"),
        ("daemon = 3", "daemon", "expected a table"),
        ('source = "x"', "source", "unknown key"),
    ],
)
def test_each_validator_rejects(snippet: str, key: str, fragment: str) -> None:
    problems = problems_of(snippet)
    matching = [problem for problem in problems if problem.startswith(key)]
    assert matching, problems
    assert any(fragment in problem for problem in matching), problems


def test_durations() -> None:
    assert parse_duration("90s") == timedelta(seconds=90)
    assert parse_duration("1h30m") == timedelta(minutes=90)
    assert parse_duration("2d") == timedelta(days=2)
    assert format_duration(timedelta(minutes=90)) == "1h30m"
    for bad in ["", "30", "5 minutes", "1y", "-1m", "m"]:
        with pytest.raises(Invalid):
            parse_duration(bad)


def test_port_range_behaves_as_a_range() -> None:
    ports = PortRange(100, 102)
    assert list(ports) == [100, 101, 102]
    assert len(ports) == 3 and 101 in ports and 103 not in ports
    assert ports.overlaps(PortRange(102, 200)) and not ports.overlaps(PortRange(103, 200))


def test_toml_syntax_error_names_its_line(tmp_path: Path) -> None:
    file = tmp_path / "config.toml"
    file.write_text('[daemon]\nhost = "gpu1"\npoll_interval = \n')
    with pytest.raises(ConfigError) as caught:
        load_config(file)
    assert "line 3" in str(caught.value)


def test_missing_file_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such config file"):
        load_config(tmp_path / "absent.toml")


def test_config_path_from_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "config.toml"
    file.write_text(on_this_machine(tmp_path) + '[[hosts]]\nname = "gpu1"\n')
    monkeypatch.setenv("GPURESA_CONFIG", str(file))
    assert main(["config", "validate"]) == 0
    assert str(file) in capsys.readouterr().out


def test_secrets_from_file_and_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    assert read_secret("notify", secret, None) == "s3cret"
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    assert read_secret("notify", None, "secret") == "s3cret"
    assert read_secret("notify", None, None, required=False) is None
    with pytest.raises(UserError, match="notify: cannot read"):
        read_secret("notify", None, "absent")
    monkeypatch.delenv("CREDENTIALS_DIRECTORY")
    with pytest.raises(UserError, match="CREDENTIALS_DIRECTORY is not set"):
        read_secret("notify", None, "secret")
    with pytest.raises(UserError, match="no password_file"):
        read_secret("notify", None, None)


def test_cli_validate_exit_codes(tmp_path: Path) -> None:
    good_file = tmp_path / "good.toml"
    good_file.write_text(on_this_machine(tmp_path) + '[[hosts]]\nname = "gpu1"\n')
    good = subprocess.run(
        [sys.executable, "-m", "gpuresa.cli", "config", "validate", "--config", str(good_file)],
        capture_output=True,
        text=True,
    )
    assert good.returncode == 0, good.stderr
    # the untouched example reads, but names what this machine does not have
    example = subprocess.run(
        [sys.executable, "-m", "gpuresa.cli", "config", "validate", "--config", str(EXAMPLE)],
        capture_output=True,
        text=True,
        env={key: value for key, value in os.environ.items() if key != "CREDENTIALS_DIRECTORY"},
    )
    assert example.returncode == 1
    assert "Traceback" not in example.stderr
    assert "storage.inputs[0].source: /srv/ssd/datasets does not exist" in example.stderr
    assert "calendars[gpu1].password_credential: " in example.stderr
    bad_file = tmp_path / "bad.toml"
    bad_file.write_text(MINIMAL_HOST + 'typo = 1\n[notify]\nsmtp_port = "x"\n[daemon.extra]\n')
    bad = subprocess.run(
        [sys.executable, "-m", "gpuresa.cli", "--config", str(bad_file), "config", "validate"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1
    assert "Traceback" not in bad.stderr
    assert "hosts[0].typo: unknown key" in bad.stderr
    assert "notify.smtp_port: expected an integer" in bad.stderr
    assert "daemon.extra: unknown key" in bad.stderr


def test_cli_example_prints_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "example"]) == 0
    assert capsys.readouterr().out == EXAMPLE.read_text()


def test_cli_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["--version"])
    assert caught.value.code == 0
    assert capsys.readouterr().out.startswith("gpuresa ")


def test_config_validate_says_which_isolation_each_host_has(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Docker: one shared uid for every session's root; Podman: a range per session."""
    file = tmp_path / "config.toml"
    file.write_text(
        on_this_machine(tmp_path) + '[[hosts]]\nname = "gpu1"\n'
        '[[hosts]]\nname = "gpu2"\nengine = "podman"\ngpu_mode = "devices"\n'
    )
    assert main(["config", "validate", "--config", str(file)]) == 0
    lines = {
        line.split(":", 1)[0]: line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("host ")
    }
    assert set(lines) == {"host gpu1", "host gpu2"}
    assert "docker userns-remap" in lines["host gpu1"]
    assert "one host uid is root in every session" in lines["host gpu1"]
    assert "podman userns=auto" in lines["host gpu2"]
    assert "a host id range per session" in lines["host gpu2"]
    # a host whose engine changes is described by its new engine
    file.write_text(file.read_text().replace('engine = "podman"\n', ""))
    assert main(["config", "validate", "--config", str(file)]) == 0
    output = capsys.readouterr().out
    assert "host gpu2: isolation: docker userns-remap" in output
