"""`gpuresa bench`: does a session container cost speed? The same workload on host and container.

`workloads` says what runs on each side and reads the measurement, `runner`
interleaves the runs, `report` computes medians, the ratio and the spread,
and `holders` tells which GPUs a bench must leave alone. The workload
scripts themselves are in `scripts/`, shipped with the package.
"""
