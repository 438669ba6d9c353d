"""Submitting and following jobs: the ``Client``, the results reader, live workers, runs and dead letters."""
