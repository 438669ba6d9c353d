#!lua flags=allow-oom
-- One page of a trim, atomic: add the storage roots ARGV[3..2+n] (n = ARGV[2]) of the dropped ok
-- results to KEYS[3]; for each (job id, stream id) pair after them, delete the job's field in
-- KEYS[1] if it still names that entry (a later duplicate's entry keeps its field); drop the
-- stream KEYS[2]'s entries before ARGV[1] (XTRIM MINID, exact); and mark the run trimmed (KEYS[4]
-- = the last entry dropped). It runs at maxmemory (allow-oom: a MULTI holding a write is refused
-- there, and trimming is what frees memory); its only growing writes are a root not yet recorded
-- and the marker's fixed-size value, everything else frees.
local roots = tonumber(ARGV[2])
for i = 3, 2 + roots do
  if redis.call('SISMEMBER', KEYS[3], ARGV[i]) == 0 then redis.call('SADD', KEYS[3], ARGV[i]) end
end
for i = 3 + roots, #ARGV - 1, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then redis.call('HDEL', KEYS[1], ARGV[i]) end
end
redis.call('XTRIM', KEYS[2], 'MINID', ARGV[1])
redis.call('SET', KEYS[4], ARGV[#ARGV])
