"""gpuresa: a calendar-driven GPU reservation daemon."""

__version__ = "0.1.0"
