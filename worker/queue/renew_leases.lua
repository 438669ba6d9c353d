#!lua flags=allow-oom
-- Renew the leases of held messages, also at maxmemory: ZADD KEYS[1] (kombu's unacked index) XX
-- the (score, member) pairs in ARGV. Re-stamping an existing entry takes no memory, and a lease
-- that lapsed while Redis was full would have a live worker's running job restored and run twice.
return redis.call('ZADD', KEYS[1], 'XX', unpack(ARGV))
