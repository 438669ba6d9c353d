-- Lost (fetched, never held): move the message of task ARGV[1] (delivery tag
-- <task id>ARGV[2]<uuid>) from the in-flight list KEYS[1] back to the head of its queue KEYS[2];
-- 1 if it was there, else 0. Only the answer leaves Redis.
local prefix = ARGV[1] .. ARGV[2]
for _, message in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
  local tag = string.match(message, '"delivery_tag": *"([^"]*)"')
  if tag and string.sub(tag, 1, #prefix) == prefix and not string.find(tag, ARGV[2], #prefix + 1, true) then
    if redis.call('LREM', KEYS[1], 1, message) == 1 then
      redis.call('RPUSH', KEYS[2], message)
      return 1
    end
  end
end
return 0
