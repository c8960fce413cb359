-- schedule.lua: import routes into the schedule.
-- KEYS: schedule keys, then the shard key of item i at KEYS[NCORE+i].
-- ARGV[1] clock override, ARGV[2] payload key prefix, ARGV[3] '1': new routes join the priority lane,
-- then per item i: ARGV[3i+1] member, ARGV[3i+2] payload, ARGV[3i+3] offset ms.
-- A new route, or one whose workspaces changed, takes its workspaces' cadence (K_WS_CADENCE) when any is set.
-- A new route is stored and first due at now + offset. A stored route keeps its due time and its
-- payload, except that the new payload's workspace ids are merged in. A stored route missing from its
-- shard (and not dead-lettered) is put back at now + offset.
-- Returns { new, merged, unchanged }.
local now = clock(ARGV[1])
local pprefix = ARGV[2]
local lane = ARGV[3] == '1'
local ws_set = redis.call('EXISTS', K_WS_CADENCE) == 1
local n = #KEYS - NCORE
local new, merged, unchanged = 0, 0, 0
local low = {}
local function touch(shard, due)
  if not low[shard] or due < low[shard] then low[shard] = due end
end
for i = 1, n do
  local shard = KEYS[NCORE + i]
  local member, payload, offset = ARGV[3 * i + 1], ARGV[3 * i + 2], tonumber(ARGV[3 * i + 3])
  local pkey = pprefix .. member
  local cur = redis.call('GET', pkey)
  if not cur then
    redis.call('SET', pkey, payload)
    redis.call('ZADD', shard, now + offset, member)
    touch(shard, now + offset)
    if lane then redis.call('ZADD', K_PRIORITY, now + offset, member) end
    if ws_set then recadence(member, payload) end
    new = new + 1
  else
    local changed = false
    local head, have = split_w(cur)
    local _, add = split_w(payload)
    if head and add then
      local set, list = id_list(have)
      local _, extra = id_list(add)
      for _, v in ipairs(extra) do
        if not set[v] then set[v] = true; list[#list + 1] = v; changed = true end
      end
      if changed then
        redis.call('SET', pkey, join_w(head, list))
        if ws_set then recadence(member, join_w(head, list)) end
      end
    end
    if not redis.call('ZSCORE', shard, member) and not redis.call('ZSCORE', K_DEAD, member) then
      redis.call('ZADD', shard, now + offset, member)
      touch(shard, now + offset)
      changed = true
    end
    if changed then merged = merged + 1 else unchanged = unchanged + 1 end
  end
end
local hargs = {}
for shard, due in pairs(low) do
  hargs[#hargs + 1] = due
  hargs[#hargs + 1] = shard
end
if #hargs > 0 then redis.call('ZADD', K_HEADS, 'LT', unpack(hargs)) end
return { new, merged, unchanged }
