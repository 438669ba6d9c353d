-- The reconciler's last word on a message it found nowhere: end it only if it is nowhere now.
-- KEYS[1] its queue, KEYS[2] the queue's in-flight list, KEYS[3] kombu's unacked hash, KEYS[4]
-- the pending hash, KEYS[5] the suspects hash, KEYS[6] the queue's sent-time set; then five keys
-- per job (results stream, result-ids hash, status hash, submitted hash, cancelled-jobs set).
-- ARGV[1] the task id, ARGV[2] the delivery-tag separator, ARGV[3] the record's send time,
-- ARGV[4] how many messages from the queue's head to search, then five per job (result field,
-- result JSON, job id, status, 1 if cancelled).
-- A message is somewhere when a delivery tag starting with "<task id><separator>" is in the
-- in-flight list, among the unacked hash's keys, or in the queue's first ARGV[4] messages from
-- its head (where restores put messages back; a pushed message sent before the head has left the
-- queue, as the queue is in push order): then nothing changes and -1 is returned. Otherwise each
-- job's result is published unless the job has a final result or was sent again after ARGV[3],
-- the message's record is ended, and a 0/1 per job says which were published.
local prefix = ARGV[1] .. ARGV[2]
local function tag_of(message)
  local tail = string.sub(message, -2048)  -- kombu's JSON ends with the properties, the tag among them
  return string.match(tail, '"delivery_tag": *"([^"]*)"') or string.match(message, '"delivery_tag": *"([^"]*)"')
end
local function held_in(list, first, last)
  for _, message in ipairs(redis.call('LRANGE', list, first, last)) do
    local tag = tag_of(message)
    if tag and string.sub(tag, 1, #prefix) == prefix then return true end
  end
  return false
end
if held_in(KEYS[2], 0, -1) or held_in(KEYS[1], -tonumber(ARGV[4]), -1) then return -1 end
for _, tag in ipairs(redis.call('HKEYS', KEYS[3])) do
  if string.sub(tag, 1, #prefix) == prefix then return -1 end
end
local published = {}
for job = 0, (#KEYS - 6) / 5 - 1 do
  local k, a = 6 + 5 * job, 4 + 5 * job
  local status, submitted, cancelled = KEYS[k + 3], KEYS[k + 4], KEYS[k + 5]
  local sent = redis.call('HGET', submitted, ARGV[a + 3])
  if redis.call('HEXISTS', status, ARGV[a + 3]) == 1 or (sent and tonumber(sent) > tonumber(ARGV[3])) then
    published[#published + 1] = 0
  else
    local id = redis.call('XADD', KEYS[k + 1], '*', ARGV[a + 1], ARGV[a + 2])
    redis.call('HSET', KEYS[k + 2], ARGV[a + 3], id)
    redis.call('HSET', status, ARGV[a + 3], ARGV[a + 4])
    if ARGV[a + 5] == '1' then redis.call('SADD', cancelled, ARGV[a + 3]) end
    redis.call('PUBLISH', KEYS[k + 1], ARGV[a + 2])
    published[#published + 1] = 1
  end
end
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('HDEL', KEYS[5], ARGV[1])
redis.call('ZREM', KEYS[6], ARGV[1])
return published
