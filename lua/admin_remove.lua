-- admin_remove.lua: an operator removes one route (payload, schedule entry, side state).
-- KEYS: schedule keys, KEYS[NCORE+1] shard. ARGV[1] clock override, ARGV[2] payload prefix, ARGV[3] logs
-- prefix, ARGV[4] member, ARGV[5] force (1/0), ARGV[6] the caller's original payload text ('' skips the
-- payload fence: the caller read nothing).
-- Refuses a route under a live lease unless forced (its holder's completion then finds it gone), and a
-- route whose payload changed since the caller read it (a concurrent import added a workspace).
-- Returns 1 removed, R_GONE, R_ACTIVE_LEASES (a live lease is out; ARGV[5] = '1' forces), R_PAYLOAD_CHANGED.
local shard, member = KEYS[NCORE + 1], ARGV[4]
local pkey = ARGV[2] .. member
local cur = redis.call('ZSCORE', shard, member)
local stored = redis.call('GET', pkey)
if not cur and not stored then return R_GONE end
if ARGV[6] ~= '' and stored ~= ARGV[6] then return R_PAYLOAD_CHANGED end
if cur and is_lease(tonumber(cur)) and tonumber(cur) > clock(ARGV[1]) and ARGV[5] ~= '1' then
  return R_ACTIVE_LEASES
end
redis.call('ZREM', shard, member)
redis.call('DEL', pkey)
forget(member, ARGV[3])
unlease({ member })
return 1
