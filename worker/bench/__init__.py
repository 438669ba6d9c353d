"""``layertap bench`` (naive, plain padded, ceiling, engine, queue) and the GPU checks that go with
it (out-of-memory, float8 error).
"""
