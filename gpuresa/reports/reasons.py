"""The short class of a refusal's reason, so a report can count refusals by kind.

A rejection's reason is a sentence written for the booking's user (it quotes
the event's fields, times, host names); counted as is, every refusal would be
a class of its own. A fair-share refusal ("rule max_gpu_hours (group
students): …") is classed by its rule ("rule max_gpu_hours"); any other by
the first pattern below that it contains. The order matters where a reason
holds several problems ("; "-joined): the first class in this order counts.
Pure.
"""

from __future__ import annotations

import re

# (class, pattern), in the order they are tried; patterns match the wording of
# gpuresa.reservations (booking fields, conflicts, claims) and fair-share rules
REASON_CLASSES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("unreadable", re.compile(r"cannot be read")),
    ("duplicate", re.compile(r"is already (?:the booking|a booking)|twice; the first counts")),
    ("conflict", re.compile(r"overlaps another booking")),
    ("user not allowed", re.compile(r"may not book|no user|not a login|unknown (?:user|login)")),
    ("unknown host", re.compile(r"unknown host|has no host|no host")),
    ("unknown template", re.compile(r"unknown template|cuda", re.IGNORECASE)),
    ("too many GPUs", re.compile(r"GPUs asked|at least 1 GPU|GPU count|gpus:")),
    (
        "bad times",
        re.compile(r"ends before it starts|ends when it starts|longer than the site's maximum"),
    ),
    ("bad field", re.compile(r"is not (?:yes or no|a \w+ name)|not both|refused")),
)
OTHER = "other"
# how gpuresa.fairshare.check words a refusal: "rule <limit key> (<level>): …"
_RULE = re.compile(r"^rule (\w+) \(")


def reason_class(reason: str) -> str:
    """The class of refusal `reason`: "rule <key>", one of `REASON_CLASSES`' names, or "other"."""
    rule = _RULE.match(reason)
    if rule is not None:
        return f"rule {rule.group(1)}"
    for name, pattern in REASON_CLASSES:
        if pattern.search(reason):
            return name
    return OTHER
