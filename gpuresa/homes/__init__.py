"""Each user's home that lasts from one session to the next (see `homes.store`)."""
