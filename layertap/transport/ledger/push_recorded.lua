-- Queue a message and its pending record in one step: LPUSH ARGV[3] (the message) onto KEYS[1]
-- (the queue), the record ARGV[2] of task ARGV[1] into KEYS[2], its queue's member in KEYS[3]
-- scored by the server's clock now (the push time: a queue is in push order, so a message sent
-- before the queue's head has left it, whatever its sender's clock said), the queue ARGV[4] in
-- KEYS[4]. Then, for each of the message's ARGV[6] jobs (ids ARGV[7..]), its send time ARGV[5]
-- in its run's submitted hash KEYS[4 + j] where that hash has none (the sender wrote it before
-- sending, on a primary a failover may since have dropped): wherever the message is, the job
-- counts in its run's total. Last, on the message's first push (its record was not there yet),
-- each job sent again (after the n jobs' ids, pairs of its id and a count c of groups) loses its
-- old result's status, its latest-entry index and its consumption by c groups (after the submitted
-- hashes, per such job: its status hash, its result ids hash, then c consumed hashes): the job is
-- not final, nor waited for with its old result, until its new result lands, on whichever primary
-- the message is. A push of a message whose record is there (a worker's retry of it, a send made
-- again whose first push landed) clears nothing: results published since are its own. The first
-- write is the record: at maxmemory Redis refuses it and nothing is applied.
local now = redis.call('TIME')
local first_push = redis.call('HSET', KEYS[2], ARGV[1], ARGV[2]) == 1
redis.call('ZADD', KEYS[3], tonumber(now[1]) + tonumber(now[2]) / 1000000, ARGV[1])
redis.call('SADD', KEYS[4], ARGV[4])
local jobs = tonumber(ARGV[6])
for job = 1, jobs do
  redis.call('HSETNX', KEYS[4 + job], ARGV[6 + job], ARGV[5])
end
local key, arg = 5 + jobs, 7 + jobs
while first_push and arg < #ARGV do
  local groups = tonumber(ARGV[arg + 1])
  for hash = key, key + groups + 1 do
    redis.call('HDEL', KEYS[hash], ARGV[arg])
  end
  key, arg = key + groups + 2, arg + 2
end
redis.call('LPUSH', KEYS[1], ARGV[3])
return 1
