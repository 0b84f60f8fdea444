"""Seeing the GPUs: the telemetry gateway, use per booking, idle/unbooked/lost findings."""
