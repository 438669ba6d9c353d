-- Forget dead workers: KEYS[1] the workers hash, then one heartbeat key per node; ARGV the nodes,
-- then their entries as read. Removes each node whose heartbeat key is gone and whose entry is
-- still the one read (a worker that came back keeps its entry). Returns how many went.
local count = #KEYS - 1
local pruned = 0
for i = 1, count do
  if redis.call('EXISTS', KEYS[i + 1]) == 0 and redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[count + i] then
    pruned = pruned + redis.call('HDEL', KEYS[1], ARGV[i])
  end
end
return pruned
