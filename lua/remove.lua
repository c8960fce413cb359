-- remove.lua: unschedule and delete a leased route, fenced twice: on the lease score and on the payload.
-- KEYS: schedule keys, KEYS[NCORE+1] shard. ARGV[1] payload key prefix, ARGV[2] logs key prefix,
-- ARGV[3] member, ARGV[4] lease score, ARGV[5] the caller's original payload text.
-- Returns 1 removed, R_LEASE_LOST, R_GONE, R_PAYLOAD_CHANGED (changed since the claim: a concurrent import).
local shard = KEYS[NCORE + 1]
local member = ARGV[3]
local ok = fence(shard, member, ARGV[4])
if ok ~= 1 then return ok end
local pkey = ARGV[1] .. member
if redis.call('GET', pkey) ~= ARGV[5] then return R_PAYLOAD_CHANGED end
redis.call('ZREM', shard, member)
redis.call('DEL', pkey)
forget(member, ARGV[2])
unlease({ member })
return 1
