-- progress.lua: record a leased check's progress, fenced on the lease score.
-- KEYS: schedule keys, KEYS[NCORE+1] shard. ARGV[1] member, ARGV[2] lease score, ARGV[3] progress text.
-- Returns 1, R_LEASE_LOST, R_GONE.
local ok = fence(KEYS[NCORE + 1], ARGV[1], ARGV[2])
if ok ~= 1 then return ok end
redis.call('HSET', K_PROGRESS, ARGV[1], ARGV[3])
return 1
