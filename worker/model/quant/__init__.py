"""Quantized checkpoints as they are served: their schemes, the Linear that keeps weights
quantized on the device, and a loader that streams them there shard by shard."""
