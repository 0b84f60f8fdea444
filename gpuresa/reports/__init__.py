"""Usage reports: GPU-hours booked, held and busy, no-shows and refusals, over a period.

`usage` decides (pure), `reasons` puts refusals in classes (pure), `reading`
pulls the rows from the journal and the GPU usage store, `groups` says which
group a login counts for, `formats` writes a report as a table, JSON or CSV,
and `live` keeps the daemon's view of the week and its Prometheus counters.
"""
