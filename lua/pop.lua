-- pop.lua: claim up to N due routes across shards, in due-time order, leasing each one.
-- KEYS: the eight schedule keys (lib.lua).
-- ARGV[1] clock override (0 = server clock), ARGV[2] max routes, ARGV[3] lease ms,
-- ARGV[4] payload key prefix, ARGV[5] max outstanding leases (0 = no cap), ARGV[6] max stalls.
-- Returns { now, allowed, paused(0/1), dead_lettered, item... }, each item
--   { member, payload, previous_score, lease_score, shard, stalled(0/1), retry_attempts }.
-- Re-claiming an expired lease is a stall, counted per route; more than max stalls in a row moves
-- the route to the dead-letter set instead of claiming it.
local now = clock(ARGV[1])
local want = tonumber(ARGV[2])
local lease_ms = tonumber(ARGV[3])
local pprefix = ARGV[4]
local max_inflight = tonumber(ARGV[5])
local max_stalled = tonumber(ARGV[6])

if redis.call('EXISTS', K_PAUSED) == 1 then return { tostring(now), 0, 1, 0 } end
if max_inflight > 0 then
  local room = max_inflight - redis.call('ZCOUNT', K_LEASED, '(' .. now, '+inf')
  if room < want then want = room end
end
if want < 0 then want = 0 end
local out = { tostring(now), want, 0, 0 }
local lease_s = fmt(now + lease_ms + 0.5)
local got, dead = 0, 0
while got < want do
  local h = redis.call('ZRANGE', K_HEADS, 0, 1, 'WITHSCORES')
  if #h == 0 then break end
  local shard, low = h[1], tonumber(h[2])
  if low > now then break end
  -- stay at or below the next shard's head so claims keep global (score, shard, member) order
  local bound = fmt(now)
  if #h >= 4 and tonumber(h[4]) <= now then
    bound = fmt(tonumber(h[4]))
    if h[3] < shard then bound = '(' .. bound end  -- equal scores: the lower shard key goes first
  end
  local rows = redis.call('ZRANGE', shard, '-inf', bound, 'BYSCORE', 'LIMIT', 0, want - got, 'WITHSCORES')
  for i = 1, #rows, 2 do
    local member, score = rows[i], tonumber(rows[i + 1])
    local payload = redis.call('GET', pprefix .. member)
    if not payload then
      redis.call('ZREM', shard, member)
      redis.call('ZREM', K_LEASED, member)
    else
      local stalled, stalls = 0, 0
      if is_lease(score) then
        stalled = 1
        stalls = redis.call('HINCRBY', K_STALLS, member, 1)
      end
      if stalls > max_stalled then
        redis.call('ZREM', shard, member)
        redis.call('ZREM', K_LEASED, member)
        redis.call('ZADD', K_DEAD, now, member)
        redis.call('HSET', K_DEAD_INFO, member,
          cjson.encode({ reason = 'stalled', stalls = stalls, at = now }))
        dead = dead + 1
      else
        redis.call('ZADD', shard, lease_s, member)
        redis.call('ZADD', K_LEASED, lease_s, member)
        local attempts = 0
        if is_retry(score) then attempts = tonumber(redis.call('HGET', K_RETRIES, member) or '0') end
        out[#out + 1] = { member, payload, fmt(score), lease_s, shard, stalled, attempts }
        got = got + 1
      end
    end
  end
  refresh_head(shard)
end
out[4] = dead
return out
