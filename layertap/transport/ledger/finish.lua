-- Consume: KEYS: stream, consumed hash, status hash. ARGV: group, entry id, job id, "error"|"ok".
-- Acknowledge the entry and record the job as consumed with its status; an error only while it
-- is still the job's status (an enqueue that sent the job again cleared it).
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
if ARGV[4] == 'ok' or redis.call('HGET', KEYS[3], ARGV[3]) == 'error' then
  redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
end
