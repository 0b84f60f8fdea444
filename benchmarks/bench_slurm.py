"""What each Slurm call costs, and how many bookings per minute become reservations.

Needs the Slurm of `make setup` (one real node and fifty simulated ones,
sim01..sim50, that take reservations but run no job). Prints the median time
of each call the Slurm backend makes, then turns `--bookings` bookings spread
over the simulated nodes (one-hour slots, one after another on each node,
starting tomorrow) into reservations the way `prepare` does (`Reserver.reserve`:
a look at the reservations, then `scontrol create reservation`), and deletes
them again. Run as root: `.venv/bin/python benchmarks/bench_slurm.py`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from gpuresa.backends.slurm.gateway import SlurmGateway
from gpuresa.backends.slurm.records import Record
from gpuresa.backends.slurm.reserver import Reserver


def timed(what: str, call: Callable[[], object], runs: int = 10) -> None:
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    print(f"  {what:<44} {statistics.median(times) * 1000:8.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bookings", type=int, default=1000)
    parser.add_argument("--nodes", type=int, default=50)
    options = parser.parse_args()
    gateway = SlurmGateway(30)
    print(f"Slurm {'.'.join(map(str, gateway.version()))}: median of 10 calls")
    timed("sinfo --version", lambda: gateway.run(["sinfo", "--version"]))
    timed("scontrol show node (51 nodes)", gateway.nodes)
    timed("scontrol show reservation", gateway.reservations)
    timed("squeue --json", lambda: gateway.jobs("gpuresa-"))
    reserver = Reserver(gateway, "no", "gpuresa-")
    tomorrow = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) + timedelta(days=1)
    records = [
        Record(f"bench-{index}", f"gpuresa-bench{index:05d}", "root", "cluster",
               f"sim{index % options.nodes + 1:02d}", "pytorch", None, 2,
               tomorrow + timedelta(hours=index // options.nodes),
               tomorrow + timedelta(hours=index // options.nodes, minutes=59), 20000)
        for index in range(options.bookings)
    ]  # fmt: skip
    began = time.perf_counter()
    made = sum(reserver.reserve(record, waiting_is_fine=True) for record in records)
    took = time.perf_counter() - began
    print(f"\n{made} of {len(records)} bookings on {options.nodes} nodes made reservations "
          f"in {took:.1f} s: {made / took * 60:.0f} per minute")  # fmt: skip
    timed(f"scontrol show reservation ({made} there)", gateway.reservations, runs=5)
    began = time.perf_counter()
    for record in records:
        gateway.scontrol("delete", "", {"ReservationName": record.name})
    print(f"deleted them in {time.perf_counter() - began:.1f} s")


if __name__ == "__main__":
    main()
