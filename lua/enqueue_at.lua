-- enqueue_at.lua: move one scheduled route's next check to a given time (the "check now" button is a
-- delay of 0). The route keeps its single schedule entry and its recurring cadence afterwards.
-- KEYS: schedule keys, KEYS[NCORE+1] shard. ARGV[1] clock override, ARGV[2] member, ARGV[3] 'at' or 'in',
-- ARGV[4] Unix ms ('at') or delay ms ('in'), ARGV[5] '1': the route joins the priority lane (check-now).
-- An expired lease (its holder vanished) no longer holds the route: it ends here, as a claim would end it.
-- Returns the new due time (string), or R_GONE, R_LEASED (a live lease: a check is running now), R_DEAD.
local shard, member = KEYS[NCORE + 1], ARGV[2]
local cur = redis.call('ZSCORE', shard, member)
if not cur then
  if redis.call('ZSCORE', K_DEAD, member) then return R_DEAD end
  return R_GONE
end
local now = clock(ARGV[1])
if is_lease(tonumber(cur)) then
  if tonumber(cur) > now then return R_LEASED end
  unlease({ member })
end
local due = tonumber(ARGV[4])
if ARGV[3] == 'in' then due = now + due end
due = math.floor(due)
redis.call('ZADD', shard, due, member)
redis.call('HDEL', K_RETRIES, member)
lower_head(shard, due)
if ARGV[5] == '1' then redis.call('ZADD', K_PRIORITY, due, member) end
return fmt(due)
