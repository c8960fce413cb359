-- enqueue_at.lua: move one scheduled route's next check to a given time (the "check now" button is a
-- delay of 0). The route keeps its single schedule entry and its recurring cadence afterwards.
-- KEYS: schedule keys, KEYS[9] shard. ARGV[1] clock override, ARGV[2] member, ARGV[3] 'at' or 'in',
-- ARGV[4] Unix ms ('at') or delay ms ('in').
-- Returns the new due time (string), or R_GONE, R_LEASED (a check is running now), R_DEAD (dead-lettered).
local shard, member = KEYS[NCORE + 1], ARGV[2]
local cur = redis.call('ZSCORE', shard, member)
if not cur then
  if redis.call('ZSCORE', K_DEAD, member) then return R_DEAD end
  return R_GONE
end
if is_lease(tonumber(cur)) then return R_LEASED end
local due = tonumber(ARGV[4])
if ARGV[3] == 'in' then due = clock(ARGV[1]) + due end
due = math.floor(due)
redis.call('ZADD', shard, due, member)
redis.call('HDEL', K_RETRIES, member)
lower_head(shard, due)
return fmt(due)
