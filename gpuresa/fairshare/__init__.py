"""Fair-share rules: limits on what one user books, decided before over-booking.

`limits` says which limits apply to a user (default, groups, exceptions),
`periods` cuts time into the site's days, weeks and months, `check` refuses
the bookings that break a limit (pure: the journal's facts come in as
values), and `host_groups` reads the host's Unix groups at the edge.
"""
