-- update.lua: an operator replaces a stored route's payload (ownership, credentials, format).
-- Fenced like remove.lua: the stored payload must still equal the one the caller read, so an update
-- built from an older snapshot cannot drop a workspace an import added since; refused under a live
-- lease unless forced. The schedule is untouched.
-- KEYS: schedule keys, KEYS[NCORE+1] shard. ARGV[1] clock override, ARGV[2] payload prefix, ARGV[3] member,
-- ARGV[4] new payload, ARGV[5] the caller's original payload text, ARGV[6] force (1/0).
-- Returns 1 updated, R_GONE, R_PAYLOAD_CHANGED, R_ACTIVE_LEASES.
local shard, member = KEYS[NCORE + 1], ARGV[3]
local pkey = ARGV[2] .. member
local stored = redis.call('GET', pkey)
if not stored then return R_GONE end
if stored ~= ARGV[5] then return R_PAYLOAD_CHANGED end
local cur = redis.call('ZSCORE', shard, member)
if cur and is_lease(tonumber(cur)) and tonumber(cur) > clock(ARGV[1]) and ARGV[6] ~= '1' then
  return R_ACTIVE_LEASES
end
redis.call('SET', pkey, ARGV[4])
return 1
