-- The reconciler's final publish of a lost message's job: publish its result (ARGV[2], under field
-- ARGV[1]) of job ARGV[3] to its run's stream KEYS[1] (indexed in KEYS[2], status ARGV[5] in
-- KEYS[3], in the cancelled set KEYS[5] if ARGV[6] is 1), unless the job has a final result in
-- KEYS[3] or was sent again after ARGV[4] (its time in the submitted hash KEYS[4]); 1 if published.
if redis.call('HEXISTS', KEYS[3], ARGV[3]) == 1 then return 0 end
local sent = redis.call('HGET', KEYS[4], ARGV[3])
if sent and tonumber(sent) > tonumber(ARGV[4]) then return 0 end
local id = redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[3], id)
redis.call('HSET', KEYS[3], ARGV[3], ARGV[5])
if ARGV[6] == '1' then redis.call('SADD', KEYS[5], ARGV[3]) end
redis.call('PUBLISH', KEYS[1], ARGV[2])
return 1
