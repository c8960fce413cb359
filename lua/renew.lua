-- renew.lua: extend a lease, fenced on the lease score the holder keeps.
-- KEYS: schedule keys, KEYS[NCORE+1] shard. ARGV[1] clock override, ARGV[2] member, ARGV[3] lease score,
-- ARGV[4] lease ms. Returns the new lease score (string), R_LEASE_LOST, R_GONE.
-- A renewal shows the holder is checking the route: a start mark (lib.lua) follows the new score; an
-- unmarked lease (a quarantined check in a process of its own) stays unmarked.
local shard = KEYS[NCORE + 1]
local ok = fence(shard, ARGV[2], ARGV[3])
if ok ~= 1 then return ok end
local lease_s = fmt(clock(ARGV[1]) + tonumber(ARGV[4]) + 0.5)
redis.call('ZADD', shard, lease_s, ARGV[2])
redis.call('ZADD', K_LEASED, lease_s, ARGV[2])
local mark = redis.call('HGET', K_STALLS, ARGV[2] .. '#s')
if mark and tonumber(mark) == tonumber(ARGV[3]) then redis.call('HSET', K_STALLS, ARGV[2] .. '#s', lease_s) end
return lease_s
