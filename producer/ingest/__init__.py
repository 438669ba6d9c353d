"""Datasets in: row formats, sources (JSONL, parquet, HF datasets) and the resumable enqueue."""
