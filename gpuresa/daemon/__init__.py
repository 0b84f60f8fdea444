"""The service: a loop that decides and dispatches, workers that act, an outbox that mails.

- `service.Daemon`: life cycle, signals, the watchdog (what `gpuresa run` runs);
- `loop.Loop`: the one thread that decides: polls, rounds, dispatch, deadlines;
- `executor.Executor`: one action in flight per session, each on its own thread;
- `work.Work`: what each action does (Docker, journal, notices), on a worker;
- `memory.Remembered`: what rounds remember, mirrored in the journal;
- `vanish`: a calendar that suddenly loses most of its bookings is held;
- `notices.Notices`: every e-mail, through the outbox (`gpuresa.mail.outbox`);
- `sampling.Sampler`: one GPU sample (telemetry, use per booking, findings), off the loop;
- `observing.Observing`: the loop's side of it, and the state `/metrics` and the page read.
"""

from gpuresa.daemon.records import session_from_record, session_record
from gpuresa.daemon.service import Daemon, journal_path
from gpuresa.daemon.state import utc_now

__all__ = ["Daemon", "journal_path", "session_from_record", "session_record", "utc_now"]
