"""Loading a model: its batching plan from its structure, the load-time self-check, config-only
shapes and tiny test models.
"""
