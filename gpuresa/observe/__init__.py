"""What admins see: the observed state, Prometheus metrics, the status page, dcgm job files."""
