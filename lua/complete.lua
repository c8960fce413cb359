-- complete.lua: finish leased cycles and schedule each route's next due time. Never writes a payload.
-- KEYS: schedule keys, then the shard key of item i at KEYS[8+i].
-- ARGV[1] clock override, ARGV[2] interval ms, then per item i: ARGV[3i] member, ARGV[3i+1] lease
-- score, ARGV[3i+2] previous score (before the claim).
-- Next due = max(previous due, now) + interval. A completed cycle clears the route's stall and retry
-- counts ("in a row" ends here).
-- Returns per item: 1 completed, R_LEASE_LOST (stale holder; nothing changed), R_GONE.
local now = clock(ARGV[1])
local interval = tonumber(ARGV[2])
local n = #KEYS - NCORE
local res = {}
-- group items by shard: one ZMSCORE to fence and one variadic ZADD to reschedule per shard
local groups, order = {}, {}
for i = 1, n do
  local shard = KEYS[NCORE + i]
  if not groups[shard] then groups[shard] = {}; order[#order + 1] = shard end
  table.insert(groups[shard], i)
end
local done = {}
local hargs = {}
for _, shard in ipairs(order) do
  local items = groups[shard]
  local members = {}
  for j, i in ipairs(items) do members[j] = ARGV[3 * i] end
  local scores = redis.call('ZMSCORE', shard, unpack(members))
  local zargs, seen, low = {}, {}, nil
  for j, i in ipairs(items) do
    local member, prev = ARGV[3 * i], tonumber(ARGV[3 * i + 2])
    local cur = scores[j]
    if not cur then
      res[i] = R_GONE
    elseif seen[member] or tonumber(cur) ~= tonumber(ARGV[3 * i + 1]) then
      res[i] = R_LEASE_LOST  -- a second lease for the same route in one call: only the first can be current
    else
      seen[member] = true
      res[i] = 1
      local base = math.floor(prev)
      if now > base then base = now end
      if not low or base + interval < low then low = base + interval end
      zargs[#zargs + 1] = base + interval
      zargs[#zargs + 1] = member
      done[#done + 1] = member
    end
  end
  if #zargs > 0 then
    redis.call('ZADD', shard, unpack(zargs))
    hargs[#hargs + 1] = low
    hargs[#hargs + 1] = shard
  end
end
if #hargs > 0 then redis.call('ZADD', K_HEADS, 'LT', unpack(hargs)) end
-- a completed cycle ends the lease and resets the route's stall and retry counts
if #done > 0 then
  unlease(done)
  redis.call('HDEL', K_STALLS, unpack(done))
  redis.call('HDEL', K_RETRIES, unpack(done))
end
return res
