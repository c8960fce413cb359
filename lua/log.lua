-- log.lua: append a line to a leased route's log, fenced on the lease score, trimmed to a bound.
-- KEYS: schedule keys, KEYS[NCORE+1] shard. ARGV[1] logs key prefix, ARGV[2] member, ARGV[3] lease score,
-- ARGV[4] line, ARGV[5] max lines kept. Returns the log length, R_LEASE_LOST, R_GONE.
local ok = fence(KEYS[NCORE + 1], ARGV[2], ARGV[3])
if ok ~= 1 then return ok end
local key = ARGV[1] .. ARGV[2]
local n = redis.call('RPUSH', key, ARGV[4])
local max = tonumber(ARGV[5])
if n > max then
  redis.call('LTRIM', key, -max, -1)
  n = max
end
return n
