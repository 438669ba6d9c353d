"""Fast tests: no Redis, no processes; pure functions and in-process torch on tiny tensors."""
