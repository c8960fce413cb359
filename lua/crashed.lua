-- crashed.lua: the holder reports that a quarantined route's check took down the isolated process it
-- ran in (the check alone in a process of its own; the holder itself lived). That is evidence from the
-- route's own check: its counted stalls grow by one beyond its stalls beside neighbours (#q), and once
-- ARGV[4] such crashes came in a row (one could be a stray kill of that process) the route moves to the
-- dead-letter set. Otherwise it is claimable again at once (due now), still in quarantine.
-- KEYS: schedule keys, then the route's shard at KEYS[NCORE + 1].
-- ARGV[1] clock override, ARGV[2] member, ARGV[3] lease score, ARGV[4] isolated crashes that dead-letter.
-- Returns 2 dead-lettered, 1 requeued, R_LEASE_LOST or R_GONE (nothing changed).
local now = clock(ARGV[1])
local shard, member = KEYS[NCORE + 1], ARGV[2]
local ok = fence(shard, member, ARGV[3])
if ok ~= 1 then return ok end
local stalls = redis.call('HINCRBY', K_STALLS, member, 1)
local q = tonumber(redis.call('HGET', K_STALLS, member .. '#q') or '0')
redis.call('HDEL', K_STALLS, member .. '#s')
unlease({ member })
if stalls - q >= tonumber(ARGV[4]) then
  redis.call('ZREM', shard, member)
  refresh_head(shard)
  redis.call('ZADD', K_DEAD, now, member)
  redis.call('HSET', K_DEAD_INFO, member, cjson.encode({ reason = 'crashed', stalls = stalls, claims = stalls,
    isolated_crashes = stalls - q, alone = true, at = now }))
  return 2
end
redis.call('ZADD', shard, now, member)
lower_head(shard, now)
return 1
