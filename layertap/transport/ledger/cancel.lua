#!lua flags=allow-oom
-- Cancel a run: SET KEYS[1] (its cancelled key) ARGV[1] (the time) NX, also at maxmemory (a run
-- is cancelled, or deleted, most when Redis is full).
return redis.call('SET', KEYS[1], ARGV[1], 'NX')
