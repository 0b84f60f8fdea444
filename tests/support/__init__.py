"""Helpers shared by the tests and the benchmarks: waiting, configs."""
