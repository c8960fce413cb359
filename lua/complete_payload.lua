-- complete_payload.lua: complete a lease and apply the worker's ownership change to the payload.
-- KEYS: schedule keys, KEYS[9] shard. ARGV[1] clock override, ARGV[2] interval ms, ARGV[3] payload
-- key prefix, ARGV[4] logs key prefix, ARGV[5] member, ARGV[6] lease score, ARGV[7] previous score,
-- ARGV[8] the worker's original payload, ARGV[9] its desired payload.
-- Only the worker's delta (workspace ids added or removed between original and desired) is applied to
-- the payload as stored now, so workspaces an import added meanwhile and current credentials stay.
-- Returns 1 completed, 2 removed (no workspace left), R_LEASE_LOST, R_GONE, R_BAD_PAYLOAD (a payload
-- shape it cannot merge).
local shard = KEYS[NCORE + 1]
local member = ARGV[5]
local ok = fence(shard, member, ARGV[6])
if ok ~= 1 then return ok end
local pkey = ARGV[3] .. member
local cur = redis.call('GET', pkey)
if not cur then return R_GONE end
local head, have = split_w(cur)
local _, orig_w = split_w(ARGV[8])
local _, want_w = split_w(ARGV[9])
if not head or not orig_w or not want_w then return R_BAD_PAYLOAD end
local orig = id_list(orig_w)
local want = id_list(want_w)
local set, list = id_list(have)
local result = {}
for _, v in ipairs(list) do
  if not (orig[v] and not want[v]) then result[#result + 1] = v end  -- drop what the worker removed
end
local seen = {}
for _, v in ipairs(result) do seen[v] = true end
for v in pairs(want) do
  if not orig[v] and not seen[v] then result[#result + 1] = v; seen[v] = true end  -- add what it added
end
local now = clock(ARGV[1])
if #result == 0 then
  redis.call('ZREM', shard, member)
  redis.call('DEL', pkey)
  forget(member, ARGV[4])
  unlease({ member })
  return 2
end
local updated = join_w(head, result)
if updated ~= cur then redis.call('SET', pkey, updated) end
local prev = tonumber(ARGV[7])
local base = math.floor(prev)
if now > base then base = now end
redis.call('ZADD', shard, base + tonumber(ARGV[2]), member)
unlease({ member })
clear_stalls({ member })
redis.call('HDEL', K_RETRIES, member)
lower_head(shard, base + tonumber(ARGV[2]))
return 1
