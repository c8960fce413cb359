-- retry.lua: end a leased cycle early and schedule the route again after a backoff delay.
-- For failures that are not the route's fault (the judge is unreachable): the route keeps its place in
-- the recurring schedule but comes back after delay ms instead of a full interval.
-- KEYS: schedule keys, KEYS[NCORE+1] shard. ARGV[1] clock override, ARGV[2] member, ARGV[3] lease score,
-- ARGV[4] delay ms. The due time carries the .25 retry marker (stored as due - 0.75, so the route is
-- claimable from due on); the route's retry count goes up.
-- Returns the retry count (>= 1), R_LEASE_LOST, R_GONE.
local shard = KEYS[NCORE + 1]
local ok = fence(shard, ARGV[2], ARGV[3])
if ok ~= 1 then return ok end
local due = clock(ARGV[1]) + tonumber(ARGV[4])
redis.call('ZADD', shard, fmt(math.floor(due) - 0.75), ARGV[2])
unlease({ ARGV[2] })
clear_stalls({ ARGV[2] })  -- the holder came back: not a stall
lower_head(shard, fmt(math.floor(due) - 0.75))
return redis.call('HINCRBY', K_RETRIES, ARGV[2], 1)
