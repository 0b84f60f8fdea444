"""The service: a loop that decides and dispatches, workers that act, an outbox that mails.

- `service.Daemon`: life cycle, signals, the watchdog (what `gpuresa run` runs);
- `loop.Loop`: the one thread that decides, composed of parts that own their state:
  `survey.Survey` (what the engine runs), `polling.Polling` (the calendars),
  `rounds.Rounds` (plan, dispatch, outcomes), `observing.GpuWatch` (GPU samples
  and findings), `housekeeping.Housekeeping` (maintenance, the outputs duty) and
  `publishing.Publisher` (the state `/metrics` and the page read);
- `tools.Tools`: what the parts share (the context of the moment, the clock, the executor);
- `clock`: the one clock the loop reads (a `ManualClock` in tests);
- `periodic.Periodic`: a periodic job as a record with a pure `due(now)`;
- `actions.KINDS`: each kind of action's lane, deadline and effects, in one table;
- `executor.Executor`: one action in flight per session, each on its own thread;
- `work.Work`: what each action does (the engine, journal, notices), on a worker;
- `memory.Remembered`: what rounds remember, mirrored in the journal;
- `images.Builds`: images built in the background while sessions wait for them;
- `vanish`: a calendar that suddenly loses most of its bookings is held;
- `notices.Notices`: every e-mail, through the outbox (`gpuresa.mail.outbox`);
- `sampling.Sampler`: one GPU sample (telemetry, use per booking, findings), off the loop.
"""

from gpuresa.daemon.records import session_from_record, session_record
from gpuresa.daemon.service import Daemon, journal_path
from gpuresa.daemon.state import utc_now

__all__ = ["Daemon", "journal_path", "session_from_record", "session_record", "utc_now"]
