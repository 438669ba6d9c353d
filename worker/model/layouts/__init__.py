"""Batching layouts, one file each (see ``base``); registered in ``worker.model.batching.LAYOUTS``."""
