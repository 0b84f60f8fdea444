"""The SQLite journal: reservations, actions, notices, the outbox."""
