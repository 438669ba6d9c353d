-- Queue a message and its pending record in one step: LPUSH ARGV[3] (the message) onto KEYS[1]
-- (the queue), the record ARGV[2] of task ARGV[1] into KEYS[2], its queue's member in KEYS[3]
-- scored by the server's clock now (the push time: a queue is in push order, so a message sent
-- before the queue's head has left it, whatever its sender's clock said), the queue ARGV[4] in
-- KEYS[4]; then, for each job of the message, its send time ARGV[5] under its id ARGV[5 + j] in
-- its run's submitted hash KEYS[4 + j] where that hash has none (the sender wrote it before
-- sending, on a primary a failover may since have dropped): wherever the message is, the job
-- counts in its run's total. The first write is the record: at maxmemory Redis refuses it and
-- nothing is applied.
local now = redis.call('TIME')
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[3], tonumber(now[1]) + tonumber(now[2]) / 1000000, ARGV[1])
redis.call('SADD', KEYS[4], ARGV[4])
for job = 1, #KEYS - 4 do
  redis.call('HSETNX', KEYS[4 + job], ARGV[5 + job], ARGV[5])
end
redis.call('LPUSH', KEYS[1], ARGV[3])
return 1
