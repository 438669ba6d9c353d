-- KEYS[1]: a lock. ARGV[1]: its holder's token. Delete the lock only while this holder holds it.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
