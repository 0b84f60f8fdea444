"""The observation endpoint: metrics scraped over HTTP, the page rendered in headless Chromium."""

from __future__ import annotations

import dataclasses
import html
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from nvml_replay import RecordedNvml
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from gpuresa.gpus.readings import GpuSnapshot
from gpuresa.gpus.telemetry import Telemetry
from gpuresa.gpus.tracker import TrackerView
from gpuresa.gpus.usage_store import SessionUse
from gpuresa.model import Rejection, Reservation, Session
from gpuresa.observe.jobmap import write_job_mapping
from gpuresa.observe.page import COLOURS, render_page
from gpuresa.observe.server import ObservationServer
from gpuresa.observe.state import CalendarView, Counters, Published, build_state

NOW = datetime(2026, 11, 23, 10, 0, tzinfo=UTC)
FORGED_KEY = '<script>alert("key")</script>@evil'
FORGED_REASON = "unknown template '<img src=x onerror=alert(1)>'"
RECORDED = Telemetry("nvml", nvml=RecordedNvml("busy")).sample(NOW).gpus[0]


def session(key: str, gpus: tuple[int, ...], start: datetime, end: datetime) -> Session:
    return Session(
        key=key, user="alice" if key == "run-1" else "bob", host="gpu1", template="pytorch",
        cuda=None,
        gpu_count=len(gpus), gpu_indices=gpus, start=start, end=end, ssh_port=20001, ftp_port=21001,
        ftp_passive_first=22000, ftp_passive_last=22009, state="running",
        output_dir=Path("/srv/out"), ftp_user="ftp-secret-user", ftp_password="s3cret-ftp-pass",
        email="alice@example.org",
    )  # fmt: skip


def reservation(key: str, start: datetime, hours: int) -> Reservation:
    return Reservation(
        key=key, uid=key, recurrence_id=None, calendar="lab", host="gpu1", user="carol",
        template="pytorch", cuda=None, gpus=1, start=start, end=start + timedelta(hours=hours),
        email="carol@example.org", summary="carol",
    )  # fmt: skip


def use(key: str, now: float, average: float) -> SessionUse:
    return SessionUse(key, "x", NOW, NOW, 10, average, None, now, None, None)


def observed_state() -> Any:
    gpus = tuple(
        dataclasses.replace(RECORDED, index=index, uuid=f"GPU-{index}", utilization=value)
        for index, value in ((0, 97), (1, 0), (2, 1))
    )
    sessions = [
        session("run-1", (0,), NOW - timedelta(hours=3), NOW + timedelta(hours=20)),
        session("idle-1", (2,), NOW - timedelta(hours=5), NOW + timedelta(hours=30)),
    ]
    counters = Counters()
    for seconds in (0.8, 3.0, 12.0):
        counters.observe_latency("start", seconds)
    counters.observe_latency("stop", 31.0)
    counters.count_error("docker")
    counters.count_error("docker")
    counters.count_error("smtp")
    return build_state(
        host="gpu1",
        now=NOW,
        sessions=sessions,
        reservations=[
            reservation("next-1", NOW + timedelta(hours=4), 24),
            reservation(FORGED_KEY, NOW + timedelta(hours=10), 9),
        ],
        rejections=[Rejection("bad-1", "bad-1", "lab", FORGED_REASON, user=None)],
        calendars=[CalendarView("lab", NOW - timedelta(minutes=2), None)],
        snapshot=GpuSnapshot(NOW, "nvml", gpus),
        uses={"run-1": use("run-1", 97, 80.0), "idle-1": use("idle-1", 1, 2.0)},
        view=TrackerView(idle=frozenset({"idle-1"})),
        host_gpus=(0, 1, 2),
        counters=counters,
        outbox_backlog=4,
    )


@pytest.fixture
def server() -> Iterator[ObservationServer]:
    published = Published(observed_state())
    observation = ObservationServer("127.0.0.1:0", published.current)
    observation.start()
    yield observation
    observation.stop()


def fetch(server: ObservationServer, path: str) -> tuple[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=30) as answer:
        return answer.read().decode(), answer.headers


def test_metrics_are_scraped_and_parsed(server: ObservationServer) -> None:
    text, headers = fetch(server, "/metrics")
    assert headers["Content-Type"].startswith("text/plain")
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert samples[("gpuresa_sessions", (("state", "running"),))] == 2
    assert samples[("gpuresa_sessions", (("state", "stopped"),))] == 0
    assert samples[("gpuresa_gpus", ())] == 3
    assert samples[("gpuresa_gpus_booked", ())] == 2
    assert samples[("gpuresa_gpus_idle", ())] == 1
    busy = (("gpu", "0"), ("key", "run-1"), ("user", "alice"), ("uuid", "GPU-0"))
    assert samples[("gpuresa_gpu_utilization_percent", busy)] == 97
    free = (("gpu", "1"), ("key", ""), ("user", ""), ("uuid", "GPU-1"))
    assert samples[("gpuresa_gpu_utilization_percent", free)] == 0
    assert samples[("gpuresa_reservations_upcoming", ())] == 2
    assert samples[("gpuresa_reservations_rejected", ())] == 1
    assert samples[("gpuresa_calendar_age_seconds", (("calendar", "lab"),))] == 120
    assert samples[("gpuresa_calendar_up", (("calendar", "lab"),))] == 1
    assert samples[("gpuresa_session_start_seconds_count", ())] == 3
    assert samples[("gpuresa_session_start_seconds_bucket", (("le", "1.0"),))] == 1
    assert samples[("gpuresa_session_start_seconds_bucket", (("le", "20.0"),))] == 3
    assert samples[("gpuresa_session_stop_seconds_sum", ())] == 31
    assert samples[("gpuresa_errors_total", (("kind", "docker"),))] == 2
    assert samples[("gpuresa_outbox_backlog", ())] == 4
    assert samples[("gpuresa_telemetry_up", ())] == 1
    for secret in ("s3cret-ftp-pass", "ftp-secret-user", "example.org"):
        assert secret not in text


def test_the_page_escapes_calendar_text_and_forbids_scripts(server: ObservationServer) -> None:
    page, headers = fetch(server, "/")
    assert "script-src" not in headers["Content-Security-Policy"]
    assert headers["Content-Security-Policy"].startswith("default-src 'none'")
    assert "<script" not in page and "<img" not in page
    assert "&lt;script&gt;alert(&quot;key&quot;)&lt;/script&gt;@evil" in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page
    for secret in ("s3cret-ftp-pass", "ftp-secret-user", "example.org"):
        assert secret not in page
    assert "20001" in page  # ssh ports are fine to show
    with pytest.raises(urllib.error.HTTPError) as refused:
        fetch(server, "/../etc/passwd")
    assert refused.value.code == 404


def test_the_page_says_how_long_each_gpu_stays_free_in_site_time() -> None:
    # a booking whose login is markup: shown as text, never as HTML
    forged = dataclasses.replace(
        reservation("walk-1", NOW + timedelta(hours=4), 2), user="<b>mallory</b>"
    )
    state = build_state(
        host="gpu1",
        now=NOW,
        sessions=[session("run-1", (0,), NOW - timedelta(hours=3), NOW + timedelta(hours=2))],
        reservations=[forged],
        host_gpus=(0, 1),
    )
    observation = ObservationServer("127.0.0.1:0", lambda: state, ZoneInfo("Europe/Paris"))
    observation.start()
    try:
        page, _ = fetch(observation, "/")
    finally:
        observation.stop()
    free = page[page.index("<h2>Free from now</h2>") : page.index("<h2>Sessions</h2>")]
    # the booking follows alice's session on GPU 0, the lowest free then
    held = (
        "busy (alice, until 2026-11-23 13:00 CET), then free until 2026-11-23 15:00 CET "
        "(<b>mallory</b>'s booking)"
    )
    assert f"<td>GPU 0</td><td>{html.escape(held, quote=True)}</td>" in free
    assert "<td>GPU 1</td><td>free until further notice</td>" in free
    assert "<b>" not in page


def test_a_host_whose_scheduler_places_gpus_shows_a_count() -> None:
    job = dataclasses.replace(
        session("run-1", (), NOW - timedelta(hours=1), NOW + timedelta(hours=2)), gpu_count=1
    )
    state = build_state(host="gpu1", now=NOW, sessions=[job], host_gpus=(0, 1), places_gpus=True)
    page = render_page(state, UTC)
    free = page[page.index("<h2>Free from now</h2>") : page.index("<h2>Sessions</h2>")]
    assert (
        "<td>GPUs</td><td>1 of 2 GPU(s) free from 2026-11-23 10:00 UTC until 2026-11-23 12:00 UTC"
        in free
    )
    assert (
        "<td>GPUs</td><td>2 of 2 GPU(s) free from 2026-11-23 12:00 UTC until further notice" in free
    )
    assert "GPU 0" not in free  # the scheduler, not gpuresa, picks the devices


def chromium(*arguments: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.fail("chromium is missing; run `make setup`")
    command = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               "--force-device-scale-factor=1", *arguments]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)


def bands(image: Image.Image, colour: str) -> list[tuple[int, int, int, int]]:
    """Boxes (left, top, right, bottom) of the timeline bars of exactly `colour`.

    A bar is a run of scan lines with over 100 pixels of that colour; the legend's
    and the tables' small badges of the same colour stay under that.
    """
    wanted = tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5))
    rgb = image.convert("RGB")
    pixels = rgb.load()
    assert pixels is not None
    lines: list[tuple[int, int, int]] = []
    for y in range(rgb.height):
        xs = [x for x in range(rgb.width) if pixels[x, y] == wanted]
        if len(xs) > 100:
            lines.append((y, min(xs), max(xs)))
    found: list[tuple[int, int, int, int]] = []
    for y, left, right in lines:
        if found and found[-1][3] >= y - 12:  # the label text cuts a bar's lines
            last = found[-1]
            found[-1] = (min(last[0], left), last[1], max(last[2], right), y)
        else:
            found.append((left, y, right, y))
    return found


@pytest.mark.services  # a real browser, not a pure test
def test_the_page_renders_a_row_per_gpu_in_chromium(
    server: ObservationServer, tmp_path: Path
) -> None:
    url = f"http://127.0.0.1:{server.port}/"
    dom = chromium("--dump-dom", url).stdout
    for row in ("gpu-0", "gpu-1", "gpu-2", "gpu-none"):
        assert f'id="{row}"' in dom
    assert "<script" not in dom.replace("&lt;script", "")
    assert "&lt;script&gt;" in dom
    shot = tmp_path / "page.png"
    chromium(f"--screenshot={shot}", "--window-size=1400,1000", url)
    image = Image.open(shot)
    assert image.size == (1400, 1000)
    running, upcoming, idle = (bands(image, COLOURS[name]) for name in COLOURS if name != "lost")
    # rows in GPU order: GPU 0 (running), GPU 1 (upcoming), GPU 2 (idle), then the unplaced one
    assert len(running) == 1 and len(upcoming) == 2 and len(idle) == 1, (running, upcoming, idle)
    assert running[0][3] < upcoming[0][1] < upcoming[0][3] < idle[0][1] < idle[0][3]
    assert idle[0][3] < upcoming[1][1], "the booking no GPU is free for is in the last row"
    # the timeline starts at midnight: the running bar at 07:00, the upcoming one at 14:00
    assert running[0][0] < upcoming[0][0]
    # three days across the track: the upcoming booking (24 h) spans about a third of it
    track = image.width - 24 * 2 - 110
    assert 0.25 * track < upcoming[0][2] - upcoming[0][0] < 0.4 * track
    assert bands(image, COLOURS["lost"]) == []


def test_job_mapping_files_hold_the_key_of_each_gpu(tmp_path: Path) -> None:
    start, end = NOW - timedelta(hours=1), NOW + timedelta(hours=1)
    sessions = [session("run-1", (0, 2), start, end), session("two\nlines", (1,), start, end)]
    written = write_job_mapping(tmp_path / "map", sessions, gpus=(0, 1, 2, 3))
    assert written == {0: "run-1\n", 1: "two lines\n", 2: "run-1\n", 3: ""}
    assert (tmp_path / "map" / "0").read_text() == "run-1\n"
    assert sorted(path.name for path in (tmp_path / "map").iterdir()) == ["0", "1", "2", "3"]
    # the session ends: its GPUs' files are emptied, nothing else left behind
    write_job_mapping(tmp_path / "map", [], gpus=(0, 1, 2, 3))
    assert all((tmp_path / "map" / name).read_text() == "" for name in "0123")
    assert len(list((tmp_path / "map").iterdir())) == 4
