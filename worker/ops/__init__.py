"""Running workers: Prometheus metrics, JSON logs, the one-process-per-GPU supervisor, the engine watchdog."""
