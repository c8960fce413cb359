-- pop.lua: claim up to N due routes across shards, in due-time order, leasing each one.
-- KEYS[1] heads index (zset: shard key -> lowest score), KEYS[2] lease index (zset: member -> lease score)
-- ARGV[1] max routes to claim, ARGV[2] lease length ms, ARGV[3] payload key prefix ("...proxy:"),
-- ARGV[4] max outstanding leases (0 = no limit)
-- Returns { server_now_ms, allowed, item... } where each item is
--   { member, payload, previous_score, lease_score, shard_key, stalled(0/1) }
-- Scores are returned as strings ('%.1f'): a numeric reply would lose the .5 lease marker.
local heads, leased = KEYS[1], KEYS[2]
local want = tonumber(ARGV[1])
local lease_ms = tonumber(ARGV[2])
local pprefix = ARGV[3]
local max_inflight = tonumber(ARGV[4])

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

if max_inflight > 0 then
  local live = redis.call('ZCOUNT', leased, '(' .. now, '+inf')
  local room = max_inflight - live
  if room < want then want = room end
end
local out = { tostring(now), tostring(want > 0 and want or 0) }
if want <= 0 then return out end

local lease = now + lease_ms + 0.5
local lease_s = string.format('%.1f', lease)
local got = 0
while got < want do
  local h = redis.call('ZRANGE', heads, 0, 1, 'WITHSCORES')
  if #h == 0 then break end
  local shard, low = h[1], tonumber(h[2])
  if low > now then break end
  -- stay below the next shard's head so claims keep global due-time order
  local bound = now
  if #h >= 4 and tonumber(h[4]) < bound then bound = tonumber(h[4]) end
  local rows = redis.call('ZRANGE', shard, '-inf', string.format('%.1f', bound), 'BYSCORE',
    'LIMIT', 0, want - got, 'WITHSCORES')
  for i = 1, #rows, 2 do
    local member, score = rows[i], tonumber(rows[i + 1])
    local payload = redis.call('GET', pprefix .. member)
    if not payload then
      redis.call('ZREM', shard, member)
      redis.call('ZREM', leased, member)
    else
      redis.call('ZADD', shard, lease_s, member)
      redis.call('ZADD', leased, lease_s, member)
      local stalled = 0
      if score % 1 == 0.5 then stalled = 1 end
      out[#out + 1] = { member, payload, string.format('%.1f', score), lease_s, shard, stalled }
      got = got + 1
    end
  end
  local first = redis.call('ZRANGE', shard, 0, 0, 'WITHSCORES')
  if #first == 0 then
    redis.call('ZREM', heads, shard)
  else
    redis.call('ZADD', heads, first[2], shard)
  end
end
return out
