-- complete.lua: finish leased cycles and schedule each route's next due time. Never writes a payload.
-- KEYS[1] heads index, KEYS[2] lease index, KEYS[3..] shard key of item i (KEYS[2+i])
-- ARGV[1] interval ms, then per item i: ARGV[2i] member, ARGV[2i+1] expected lease score,
-- and ARGV[1+2n+i] the previous due time (score before the claim) of item i.
-- Next due = max(previous due, now) + interval (whole ms).
-- Returns per item: 1 completed, -1 lease lost (score differs: stale holder), -2 gone.
local heads, leased = KEYS[1], KEYS[2]
local interval = tonumber(ARGV[1])
local n = #KEYS - 2
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local res, touched = {}, {}
for i = 1, n do
  local shard = KEYS[2 + i]
  local member, expected = ARGV[2 * i], tonumber(ARGV[2 * i + 1])
  local prev = math.floor(tonumber(ARGV[1 + 2 * n + i]))
  local cur = redis.call('ZSCORE', shard, member)
  if not cur then
    res[i] = -2
  elseif tonumber(cur) ~= expected then
    res[i] = -1
  else
    local base = prev
    if now > base then base = now end
    redis.call('ZADD', shard, string.format('%d', base + interval), member)
    redis.call('ZREM', leased, member)
    touched[shard] = true
    res[i] = 1
  end
end
for shard in pairs(touched) do
  local first = redis.call('ZRANGE', shard, 0, 0, 'WITHSCORES')
  redis.call('ZADD', heads, first[2], shard)
end
return res
