"""The calendar reader: RFC 5545 text, time zones, recurrence, events."""
