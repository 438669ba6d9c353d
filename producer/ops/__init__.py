"""Watching a fleet: queue depths, workers, run progress, throughput windows."""
