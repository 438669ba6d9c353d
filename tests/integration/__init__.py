"""Tests against real parts: a real Redis server, real Celery worker processes, real tiny models."""
