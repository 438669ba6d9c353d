"""Consuming files: the reader protocol, per-file statistics and plots, the manifest, the PyTorch
datasets and the export. Imports no Celery.
"""
