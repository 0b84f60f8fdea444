"""A watched calendar's change makes the loop poll at once, even in the middle of a poll.

The loop of `test_daemon_parts` (a manual clock, an engine with nothing in
it, a calendar server that answers when released): the clock never moves
here but by a second, so only the change can make a poll due.
"""

from __future__ import annotations

from datetime import timedelta

from support.waiting import wait_for
from test_daemon_parts import Stage, stage  # noqa: F401 (the fixture)


def poll_done(stage: Stage) -> bool:  # noqa: F811 (a parameter, not the fixture)
    stage.drain(0.05)
    return not stage.loop.polling.job.running


def test_a_change_polls_at_once_and_one_during_a_poll_polls_again_after_it(
    stage: Stage,  # noqa: F811 (the fixture)
) -> None:
    stage.turn()
    wait_for(lambda: stage.polls, 5, "the first poll")
    # a file changed while the poll was reading: that poll may have missed it
    stage.loop.polling.soon()
    stage.release.set()
    wait_for(lambda: poll_done(stage), 5, "the first poll's answer")
    stage.turn(0)
    wait_for(lambda: len(stage.polls) == 2, 5, "the poll the change asked for")
    wait_for(lambda: poll_done(stage), 5, "the second poll's answer")
    # nothing changed since: no poll before the interval is up
    stage.turn(1)
    assert len(stage.polls) == 2
    stage.loop.polling.soon()
    stage.turn(0)
    wait_for(lambda: len(stage.polls) == 3, 5, "the poll a change outside a poll asked for")
    # the first two at the same instant, the third a second later: well before the interval
    assert [moment - stage.polls[0] for moment in stage.polls] == [
        timedelta(0),
        timedelta(0),
        timedelta(seconds=1),
    ]
    assert stage.loop.context.config.daemon.poll_interval > timedelta(seconds=1)
