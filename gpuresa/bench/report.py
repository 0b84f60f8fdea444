"""The numbers of a bench: medians, the container/host ratio and whether it is within the spread.

Pure: samples in, a comparison and its text or JSON out.

"Within the spread" is judged from the extremes of the runs: the ratio can
be as low as min(container)/max(host) and as high as max(container)/min(host);
when that interval holds 1.0, the runs cannot tell the container from the host
(a difference smaller than their own run-to-run spread). With the few runs a
bench makes (3 by default), quartiles would say no more than min and max, and
the interval is conservative: it calls a difference real only when every
container run is slower (or faster) than every host run.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

HOST, CONTAINER = "host", "container"


@dataclass(frozen=True)
class Sample:
    """One run: which side, with how many GPUs, what it measured and how long it took."""

    side: str
    gpus: tuple[int, ...]
    value: float
    unit: str
    seconds: float
    index: int = 0


@dataclass(frozen=True)
class Comparison:
    """Host and container runs of one GPU count."""

    gpus: tuple[int, ...]
    unit: str
    host: tuple[float, ...]
    container: tuple[float, ...]
    info: tuple[str, ...] = field(default=())

    @property
    def label(self) -> str:
        if not self.gpus:
            return "CPU"
        count = len(self.gpus)
        return f"{count} GPU{'s' if count > 1 else ''} ({','.join(map(str, self.gpus))})"

    @property
    def host_median(self) -> float:
        return statistics.median(self.host)

    @property
    def container_median(self) -> float:
        return statistics.median(self.container)

    @property
    def ratio(self) -> float:
        """Container median / host median (below 1: the container is slower)."""
        return _divide(self.container_median, self.host_median)

    @property
    def ratio_interval(self) -> tuple[float, float]:
        """The lowest and highest ratio any pair of runs gives (see the module)."""
        return (
            _divide(min(self.container), max(self.host)),
            _divide(max(self.container), min(self.host)),
        )

    @property
    def within_spread(self) -> bool:
        low, high = self.ratio_interval
        return low <= 1.0 <= high

    def as_dict(self) -> dict[str, Any]:
        low, high = self.ratio_interval
        return {
            "gpus": list(self.gpus),
            "unit": self.unit,
            "host": list(self.host),
            "container": list(self.container),
            "host_median": self.host_median,
            "container_median": self.container_median,
            "ratio": self.ratio,
            "ratio_interval": [low, high],
            "within_spread": self.within_spread,
            "info": list(self.info),
        }

    def verdict(self) -> str:
        """One line for people and for the journal."""
        low, high = self.ratio_interval
        difference = (self.ratio - 1.0) * 100
        spread = "within the spread" if self.within_spread else "outside the spread"
        return (
            f"{self.label}: host {_number(self.host_median)}, container "
            f"{_number(self.container_median)} {self.unit}, ratio {self.ratio:.3f} "
            f"({difference:+.1f} %, runs give {low:.3f}-{high:.3f}: {spread})"
        )


def _divide(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("inf")


def _number(value: float) -> str:
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.3g}"


def compare(samples: Sequence[Sample], info: Sequence[str] = ()) -> list[Comparison]:
    """Group samples by GPU set into comparisons (in the order they were run).

    Raises ValueError when a GPU set lacks runs on one side or mixes units.
    """
    groups: dict[tuple[int, ...], list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.gpus, []).append(sample)
    comparisons = []
    for gpus, group in groups.items():
        units = {sample.unit for sample in group}
        if len(units) != 1:
            raise ValueError(f"GPUs {gpus}: the runs measured different units {sorted(units)}")
        host = tuple(sample.value for sample in group if sample.side == HOST)
        container = tuple(sample.value for sample in group if sample.side == CONTAINER)
        if not host or not container:
            raise ValueError(f"GPUs {gpus}: runs are missing on one side")
        comparisons.append(Comparison(gpus, units.pop(), host, container, tuple(info)))
    return comparisons


def run_line(sample: Sample) -> str:
    """One run, for people: GPUs, side, run number, measurement, seconds."""
    label = Comparison(sample.gpus, sample.unit, (1.0,), (1.0,)).label
    return (
        f"  {label:<16} {sample.side:<9} #{sample.index + 1}  "
        f"{_number(sample.value):>10} {sample.unit}  ({sample.seconds:.1f} s)"
    )


def render(comparisons: Sequence[Comparison]) -> str:
    """The medians, ratio and verdict of each GPU set, for people."""
    lines = ["medians, container/host (within the spread: some pair of runs gives 1.0):"]
    lines += [f"  {comparison.verdict()}" for comparison in comparisons]
    return "\n".join(lines)


def summary(comparisons: Sequence[Comparison]) -> str:
    """The journal's one-line detail: each GPU set's medians, ratio and verdict."""
    return "; ".join(comparison.verdict() for comparison in comparisons)
