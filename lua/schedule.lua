-- schedule.lua: import routes into the schedule.
-- KEYS[1] heads index, KEYS[2] dead-letter set, KEYS[2+i] shard key of item i
-- ARGV[1] payload key prefix, then per item i: ARGV[3i-1] member, ARGV[3i] payload, ARGV[3i+1] offset ms
-- A new route is stored and first due at now + offset. A route already stored keeps its due time and
-- its payload, except that the new payload's workspace ids are merged into it ("w":[...] is last).
-- A stored route missing from its shard (and not dead-lettered) is put back at now + offset.
-- Returns { new, merged, unchanged }.
local heads, dead, pprefix = KEYS[1], KEYS[2], ARGV[1]
local n = #KEYS - 2
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local new, merged, unchanged = 0, 0, 0
local touched = {}

local function ids(text)
  local set, list = {}, {}
  for id in string.gmatch(text, '%d+') do
    local v = tonumber(id)
    if not set[v] then set[v] = true; list[#list + 1] = v end
  end
  return set, list
end

for i = 1, n do
  local shard = KEYS[2 + i]
  local member, payload, offset = ARGV[3 * i - 1], ARGV[3 * i], tonumber(ARGV[3 * i + 1])
  local pkey = pprefix .. member
  local cur = redis.call('GET', pkey)
  if not cur then
    redis.call('SET', pkey, payload)
    redis.call('ZADD', shard, string.format('%d', now + offset), member)
    touched[shard] = true
    new = new + 1
  else
    local head, have = string.match(cur, '^(.*"w":)%[([%d,]*)%]}$')
    local add = string.match(payload, '"w":%[([%d,]*)%]}$')
    local changed = false
    if head and add then
      local set, list = ids(have)
      local _, extra = ids(add)
      for _, v in ipairs(extra) do
        if not set[v] then set[v] = true; list[#list + 1] = v; changed = true end
      end
      if changed then
        table.sort(list)
        redis.call('SET', pkey, head .. '[' .. table.concat(list, ',') .. ']}')
      end
    end
    if not redis.call('ZSCORE', shard, member) and not redis.call('ZSCORE', dead, member) then
      redis.call('ZADD', shard, string.format('%d', now + offset), member)
      touched[shard] = true
      changed = true
    end
    if changed then merged = merged + 1 else unchanged = unchanged + 1 end
  end
end
for shard in pairs(touched) do
  local first = redis.call('ZRANGE', shard, 0, 0, 'WITHSCORES')
  redis.call('ZADD', heads, first[2], shard)
end
return { new, merged, unchanged }
