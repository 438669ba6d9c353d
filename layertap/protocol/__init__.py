"""The wire contract: job and result records, Redis names, file names, the layer convention, the
file format, float8 scaling. Everything both sides must agree on, in one place; imports neither
Celery nor torch.
"""
