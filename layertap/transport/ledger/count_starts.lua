-- Count one start of each job of one delivery, once: KEYS[1] is the delivery's token, KEYS[2] to
-- KEYS[ARGV[1] + 1] the jobs' attempt counters, the other KEYS the runs' cancelled markers;
-- ARGV[2] the counters' lifetime, ARGV[3] the token's (seconds). A call repeated with the same
-- token (its reply was lost, or Redis refused it) counts nothing again and answers the counts as
-- they are. The token is the first write: at maxmemory Redis refuses it and nothing is applied.
-- Returns the counts, then 1 or 0 per run (cancelled or not).
local jobs = tonumber(ARGV[1])
local first = redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[3])
local out = {}
for i = 2, jobs + 1 do
  if first then
    out[#out + 1] = redis.call('INCR', KEYS[i])
    redis.call('EXPIRE', KEYS[i], ARGV[2])
  else
    out[#out + 1] = tonumber(redis.call('GET', KEYS[i]) or '0')
  end
end
for i = jobs + 2, #KEYS do
  out[#out + 1] = redis.call('EXISTS', KEYS[i])
end
return out
