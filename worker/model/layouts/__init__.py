"""Batching layouts, one file each (see ``base``); registered in ``layertap.worker.model.batching.LAYOUTS``."""
