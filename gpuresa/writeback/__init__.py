"""Calendar write-back: each booking's state, written where its users look.

`notes.CalendarNotes` queues a state at each change (next to the e-mail
notices), `worker.WriteBackWorker` writes it on a thread of its own,
`wording` has the words, `mirror` the mirror calendar's events; the block
format and the raw-text edit are in `gpuresa.ical.state_block`, the HTTP in
`gpuresa.reservations.sources.caldav_write`. See docs/write-back.md.
"""
