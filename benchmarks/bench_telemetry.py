"""Cost of watching the GPUs: CPU per minute and memory of the sampler and the endpoint.

Each figure comes from a fresh child process, so imports count in its memory:
- "off": what the daemon imports without telemetry (config, model, runtime);
- "on": the same plus the telemetry gateway, the usage tracker with its SQLite
  store, and the observation server listening on 127.0.0.1.
The "on" child takes 300 samples (tracker included) and answers 200 scrapes of
/metrics and 50 of the page; CPU per minute is then figured for the defaults:
one sample a minute, a Prometheus scrape every 15 s, the page once a minute.
Scrapes are made from the same process, so their figure holds the client's
side too (an upper bound of the server's).
This machine has no GPU: NVML answers are replayed from the H100 recording
(tests/corpus/gpus), and the real NVML time per sample measured on the H100
is added from that recording.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLES, SCRAPES, PAGES = 300, 200, 50


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def child(mode: str) -> dict[str, float]:

    if mode == "off":
        start = cpu()
        time.sleep(5)
        return {"idle_cpu_per_minute": (cpu() - start) * 12, "rss": rss_mib()}
    sys.path.insert(0, str(ROOT / "tests"))
    from nvml_replay import RecordedNvml

    from gpuresa.gpus.telemetry import Telemetry
    from gpuresa.gpus.tracker import UsageTracker
    from gpuresa.gpus.usage_store import UsageStore
    from gpuresa.model import Session
    from gpuresa.observe.server import ObservationServer
    from gpuresa.observe.state import Published, build_state

    now = datetime.now(UTC)
    session = Session(
        key="bench-1",
        user="alice",
        host="h",
        template="pytorch",
        cuda=None,
        gpu_count=1,
        gpu_indices=(0,),
        start=now,
        end=now + timedelta(hours=1),
        ssh_port=20000,
        ftp_port=21000,
        ftp_passive_first=22000,
        ftp_passive_last=22009,
        state="running",
        output_dir=Path("/tmp"),
    )
    folder = Path(tempfile.mkdtemp())
    telemetry = Telemetry("nvml", nvml=RecordedNvml("busy"))
    tracker = UsageTracker(UsageStore(folder / "gpu-usage.sqlite"))
    published = Published(build_state(host="h", now=now, sessions=[session]))
    server = ObservationServer("127.0.0.1:0", published.current)
    server.start()
    start = cpu()
    for step in range(SAMPLES):
        at = now + timedelta(minutes=step)
        snapshot = telemetry.sample(at)
        tracker.observe(at, [session], snapshot)
        published.publish(
            build_state(
                host="h",
                now=at,
                sessions=[session],
                snapshot=snapshot,
                uses=tracker.store.uses(),
                view=tracker.view,
            )
        )
    per_sample = (cpu() - start) / SAMPLES
    start = cpu()
    for _ in range(SCRAPES):
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics").read()
    per_scrape = (cpu() - start) / SCRAPES
    start = cpu()
    for _ in range(PAGES):
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/").read()
    per_page = (cpu() - start) / PAGES
    start = cpu()
    time.sleep(5)
    idle = (cpu() - start) * 12
    server.stop()
    return {
        "per_sample": per_sample,
        "per_scrape": per_scrape,
        "per_page": per_page,
        "idle_cpu_per_minute": idle,
        "rss": rss_mib(),
    }


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2])))
        return
    figures = {}
    for mode in ("off", "on"):
        output = subprocess.run(
            [sys.executable, __file__, "--child", mode], capture_output=True, text=True, check=True
        ).stdout
        figures[mode] = json.loads(output.strip().splitlines()[-1])
    recording = json.loads((ROOT / "tests/corpus/gpus/nvml-busy.json").read_text())
    nvml_seconds = float(recording["seconds_per_sample"])
    on = figures["on"]
    per_minute = (
        on["idle_cpu_per_minute"]
        + on["per_sample"]
        + nvml_seconds
        + 4 * on["per_scrape"]
        + on["per_page"]
    )
    print("telemetry cost (1 sample/min, /metrics every 15 s, page once a minute)\n")
    print(f"{'':<34}{'off':>12}{'on':>12}")
    print(
        f"{'CPU s per minute':<34}{figures['off']['idle_cpu_per_minute']:>12.4f}{per_minute:>12.4f}"
    )
    print(f"{'memory (RSS, MiB)':<34}{figures['off']['rss']:>12.1f}{on['rss']:>12.1f}")
    print()
    print(f"{'one sample + tracker + publish':<34}{on['per_sample'] * 1000:>10.2f} ms")
    print(f"{'  NVML calls on the H100':<34}{nvml_seconds * 1000:>10.2f} ms")
    print(f"{'one /metrics scrape (server side)':<34}{on['per_scrape'] * 1000:>10.2f} ms")
    print(f"{'one page (server side)':<34}{on['per_page'] * 1000:>10.2f} ms")


if __name__ == "__main__":
    main()
