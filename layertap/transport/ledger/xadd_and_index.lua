-- The final publish of one result: XADD KEYS[1] (the run's results stream) field ARGV[1] =
-- ARGV[2] (the result's JSON), and record the new entry's id under job ARGV[3] in KEYS[2] (the
-- run's result-ids hash). Returns the entry id.
local id = redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[3], id)
return id
