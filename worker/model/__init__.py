"""Loading a model: the torch dtype table, its batching plan from its structure, packed
attention, config-only shapes and tiny test models. Model changes (attention implementation,
compile) happen here, at load, not in the engine.
"""
