"""Each kind of action in one place: its lane, its deadline, its effect and what it leaves.

The rounds (`rounds.Rounds`) look an action up here and never test its type
themselves: a new kind of action is one more row in `KINDS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from gpuresa.daemon.executor import LIFE_CYCLE, NOTICE
from gpuresa.daemon.memory import Remembered
from gpuresa.daemon.state import Context
from gpuresa.daemon.work import Work
from gpuresa.model import Session
from gpuresa.planning.actions import (
    Action,
    Extend,
    Fail,
    NotifyCancel,
    NotifyChange,
    NotifyPreempt,
    NotifyRelease,
    Prepare,
    Recreate,
    Start,
    Stop,
    Warn,
)

A = TypeVar("A", bound=Action)

# What a failure of the action leads to: the stop escalates to a kill; a start
# backs off and tells its user once; a notice is only logged.
OnFailure = Literal["kill", "back-off", "log"]


@dataclass(frozen=True)
class Call:
    """What an action's effect is given, beside the action.

    `session`: the session as last seen (None: none yet). `new_user`: the
    login the booking names now (a reassignment's stop tells the old user).
    """

    work: Work
    session: Session | None
    new_user: str | None
    now: datetime


def _nothing(action: Any, remembered: Remembered, context: Context, now: datetime) -> None:
    """Nothing to note at dispatch."""


def _nothing_settled(key: str, remembered: Remembered, context: Context) -> None:
    """Nothing to note on success."""


@dataclass(frozen=True)
class ActionKind(Generic[A]):
    """How the loop carries out one kind of action.

    `lane`: the executor lane (one action per session and lane). `deadline`:
    seconds it may take before it is reported and escalated. `effect`: the work,
    on a worker thread. `noted`: what the loop remembers when it dispatches it
    (on the loop thread, before the work begins, so a restart repeats nothing).
    `settled`: what the loop remembers when it succeeded. `latency`: the
    metric its duration is counted in. `waits_for_gpus`: it waits while the
    GPUs' previous session stops. `backs_off`: it waits out the back-off of its
    last failure. `on_failure`: see `OnFailure`.
    """

    lane: str
    deadline: Callable[[A], float]
    effect: Callable[[A, Call], object]
    on_failure: OnFailure = "log"
    noted: Callable[[A, Remembered, Context, datetime], None] = _nothing
    settled: Callable[[str, Remembered, Context], None] = _nothing_settled
    latency: str | None = None
    waits_for_gpus: bool = False
    backs_off: bool = False


# A start waits up to 30 s for sshd and FTP after creating what is missing.
START_DEADLINE = 120.0
# A notice or an extension: a message into the session and the outbox.
NOTICE_DEADLINE = 60.0
# A stop waits the grace period for the user's processes, then kills: this on top.
STOP_MARGIN = 60.0


def _start_deadline(action: Action) -> float:
    return START_DEADLINE


def _notice_deadline(action: Action) -> float:
    return NOTICE_DEADLINE


def _failed_noted(action: Fail, remembered: Remembered, context: Context, now: datetime) -> None:
    """A booking that cannot be served is reported once, then after the back-off."""
    remembered.back_off(action.key, now)


def _start(action: Start | Recreate, call: Call) -> object:
    return call.work.start(action, call.session, call.now)


_STARTING: ActionKind[Any] = ActionKind(
    lane=LIFE_CYCLE,
    deadline=_start_deadline,
    effect=_start,
    on_failure="back-off",
    settled=lambda key, remembered, context: remembered.started(key),
    latency="start",
    waits_for_gpus=True,
)

KINDS: dict[type[Action], ActionKind[Any]] = {
    Stop: ActionKind[Stop](
        lane=LIFE_CYCLE,
        deadline=lambda action: action.grace.total_seconds() + STOP_MARGIN,
        effect=lambda action, call: call.work.stop(action, call.session, call.new_user, call.now),
        on_failure="kill",
        settled=lambda key, remembered, context: remembered.stopped(key, context.journal),
        latency="stop",
        backs_off=True,
    ),
    Start: _STARTING,
    Recreate: _STARTING,
    Prepare: ActionKind[Prepare](
        lane=LIFE_CYCLE,
        deadline=_start_deadline,
        effect=lambda action, call: call.work.prepare(action, call.now),
        on_failure="back-off",
    ),
    Extend: ActionKind[Extend](
        lane=NOTICE,
        deadline=_notice_deadline,
        effect=lambda action, call: call.work.extend(action),
        noted=lambda action, remembered, context, now: remembered.extended(
            action.key, action.end, now, context.config, context.journal
        ),
    ),
    Warn: ActionKind[Warn](
        lane=NOTICE,
        deadline=_notice_deadline,
        effect=lambda action, call: call.work.warn(action, call.session, call.now),
        noted=lambda action, remembered, context, now: remembered.warned(
            action.key, action.before, context.config, context.journal, now
        ),
    ),
    NotifyPreempt: ActionKind[NotifyPreempt](
        lane=NOTICE,
        deadline=_notice_deadline,
        effect=lambda action, call: call.work.notify_preempt(action, call.session, call.now),
        noted=lambda action, remembered, context, now: remembered.preempt_noticed(
            action.key, action.stop_at, context.journal
        ),
    ),
    NotifyRelease: ActionKind[NotifyRelease](
        lane=NOTICE,
        deadline=_notice_deadline,
        effect=lambda action, call: call.work.notify_release(action, call.session, call.now),
        noted=lambda action, remembered, context, now: remembered.release_noticed(
            action.key, action.release_at, context.journal
        ),
    ),
    NotifyCancel: ActionKind[NotifyCancel](
        lane=NOTICE,
        deadline=_notice_deadline,
        effect=lambda action, call: call.work.notify_cancel(action, call.session, call.now),
        noted=lambda action, remembered, context, now: remembered.cancel_noticed(
            action.key, context.journal, now
        ),
    ),
    NotifyChange: ActionKind[NotifyChange](
        lane=NOTICE,
        deadline=_notice_deadline,
        effect=lambda action, call: call.work.notify_change(action),
        noted=lambda action, remembered, context, now: remembered.changes_notified.add(
            (action.key, action.change)
        ),
    ),
    Fail: ActionKind[Fail](
        lane=NOTICE,
        deadline=_notice_deadline,
        effect=lambda action, call: call.work.fail(action, call.now),
        noted=_failed_noted,
    ),
}


def kind_of(action: Action) -> ActionKind[Any] | None:
    """The row of `action`'s kind (None: a kind the daemon cannot carry out)."""
    return KINDS.get(type(action))
