#!lua flags=allow-oom
-- A turn of a fleet-wide sweep, also at maxmemory (a sweep that frees memory must run there):
-- SET KEYS[1] (the sweep's lock) ARGV[1] (this worker's node) NX EX ARGV[2] (seconds).
return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2])
