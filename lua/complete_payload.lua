-- complete_payload.lua: complete a lease and apply the worker's ownership change to the payload.
-- KEYS: schedule keys, KEYS[9] shard. ARGV[1] clock override, ARGV[2] interval ms, ARGV[3] payload
-- key prefix, ARGV[4] logs key prefix, ARGV[5] member, ARGV[6] lease score, ARGV[7] previous score,
-- ARGV[8] the worker's original payload, ARGV[9] its desired payload.
-- Only the worker's delta (workspace ids added or removed between original and desired) is applied to
-- the payload as stored now, so workspaces an import added meanwhile and current credentials stay.
-- ARGV[8] and ARGV[9] are read as JSON of any encoding (only their "w" lists matter); the stored payload
-- is always in the codec's compact form (every writer goes through Payload.encode or join_w).
-- Returns 1 completed, 2 removed (no workspace left), R_LEASE_LOST, R_GONE, R_BAD_PAYLOAD (a payload
-- shape it cannot merge).
local shard = KEYS[NCORE + 1]
local member = ARGV[5]
local ok = fence(shard, member, ARGV[6])
if ok ~= 1 then return ok end
local pkey = ARGV[3] .. member
local cur = redis.call('GET', pkey)
if not cur then return R_GONE end
-- The worker's two payloads may be any JSON encoding (spacing, key order); only their "w" is read.
local function ws_set(text)
  local ok, doc = pcall(cjson.decode, text)
  if not ok or type(doc) ~= 'table' or type(doc['w']) ~= 'table' then return nil end
  local set = {}
  for _, v in pairs(doc['w']) do
    local id = tonumber(v)
    if not id then return nil end
    set[id] = true
  end
  return set
end
local head, have = split_w(cur)
local orig = ws_set(ARGV[8])
local want = ws_set(ARGV[9])
if not head or not orig or not want then return R_BAD_PAYLOAD end
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
