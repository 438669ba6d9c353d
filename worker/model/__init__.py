"""Loading a model: the torch dtype table, its batching plan from its structure, packed
attention, the vision side of a vision-language model (``vision``), config-only shapes and tiny
test models. Model changes (attention implementation, compile) happen here, at load, not in the
engine.
"""
