-- cadence.lua: set or clear routes' own cadence and move their due times into their new interval.
-- KEYS: schedule keys, then the shard key of item i at KEYS[NCORE+i].
-- ARGV[1] clock override, ARGV[2] payload key prefix, ARGV[3] mode: 'set' (ARGV[4] override ms),
-- 'clear' (drop the override) or 'recompute' (workspace cadences changed), ARGV[4] override ms,
-- ARGV[5] deployment interval ms, then per item: member.
-- Each route's own interval becomes its override, else the shortest of its workspaces' (lib.lua,
-- recadence); an unleased route due later than now + its interval moves to now + its slot in that
-- interval (the FNV-1a fraction of its hash: an even spread), so a shorter cadence takes effect within one
-- new interval and a longer one at the route's next completion. Returns { moved, own interval of item 1 or 0, due of item 1 or '' }.
local now = clock(ARGV[1])
local pprefix, mode = ARGV[2], ARGV[3]
local default = tonumber(ARGV[5])
local moved, first_iv, first_due = 0, 0, ''
for i = 1, #KEYS - NCORE do
  local shard, member = KEYS[NCORE + i], ARGV[5 + i]
  local cur = tonumber(redis.call('ZSCORE', shard, member))
  local payload = redis.call('GET', pprefix .. member)
  if cur and payload then
    if mode == 'set' then redis.call('HSET', K_CADENCE, member .. '#r', tonumber(ARGV[4])) end
    if mode == 'clear' then redis.call('HDEL', K_CADENCE, member .. '#r') end
    local iv = recadence(member, payload) or default
    local due = cur
    if not is_lease(cur) then
      if cur > now + iv then
        due = now + math.floor(fnv1a(member) / 4294967296 * iv)
        redis.call('ZADD', shard, due, member)
        lower_head(shard, due)
        if redis.call('ZSCORE', K_PRIORITY, member) then redis.call('ZADD', K_PRIORITY, due, member) end
        moved = moved + 1
      end
    end
    if i == 1 then first_iv, first_due = iv, fmt(due) end
  end
end
return { moved, first_iv, first_due }
