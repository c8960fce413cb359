-- reprocess.lua: put a dead-lettered route back in its shard, due now, with its stall count reset.
-- KEYS: schedule keys, KEYS[NCORE+1] shard. ARGV[1] clock override, ARGV[2] member, ARGV[3] payload prefix.
-- Returns the due time (string), R_GONE (no payload), R_NOT_DEAD (not dead-lettered).
local shard, member = KEYS[NCORE + 1], ARGV[2]
if not redis.call('ZSCORE', K_DEAD, member) then return R_NOT_DEAD end
if redis.call('EXISTS', ARGV[3] .. member) == 0 then
  redis.call('ZREM', K_DEAD, member)
  redis.call('HDEL', K_DEAD_INFO, member)
  return R_GONE
end
local now = clock(ARGV[1])
redis.call('ZREM', K_DEAD, member)
redis.call('HDEL', K_DEAD_INFO, member)
clear_stalls({ member })
redis.call('HDEL', K_RETRIES, member)
redis.call('ZADD', shard, now, member)
lower_head(shard, now)
return fmt(now)
