"""Reservations: the calendar sources, the booking rules and conflicts, the templates."""
