-- complete.lua: finish leased cycles and schedule each route's next due time. Never writes a payload.
-- KEYS: schedule keys, then the shard key of item i at KEYS[8+i].
-- ARGV[1] clock override, ARGV[2] interval ms, then per item i: ARGV[3i] member, ARGV[3i+1] lease
-- score, ARGV[3i+2] previous score (before the claim).
-- Next due = max(previous due, now) + interval. A completed cycle clears the route's stall count
-- (only set after a stalled claim, .5) and retry count (only set for a retry due time, .25).
-- Returns per item: 1 completed, -1 lease lost (stale holder; nothing changed), -2 gone.
local now = clock(ARGV[1])
local interval = tonumber(ARGV[2])
local n = #KEYS - NCORE
local res, touched = {}, {}
for i = 1, n do
  local shard = KEYS[NCORE + i]
  local member, prev = ARGV[3 * i], tonumber(ARGV[3 * i + 2])
  local ok = fence(shard, member, ARGV[3 * i + 1])
  res[i] = ok
  if ok == 1 then
    local base = math.floor(prev)
    if now > base then base = now end
    redis.call('ZADD', shard, base + interval, member)
    redis.call('ZREM', K_LEASED, member)
    if is_lease(prev) then redis.call('HDEL', K_STALLS, member) end
    if is_retry(prev) then redis.call('HDEL', K_RETRIES, member) end
    touched[shard] = true
  end
end
for shard in pairs(touched) do refresh_head(shard) end
return res
