-- complete.lua: finish leased cycles, schedule each route's next due time and, in the same atomic step,
-- append each completed route's result to the results stream. Never writes a payload.
-- Preludes: lib.lua, stats_floor.lua.
-- KEYS: schedule keys; with a stream policy, KEYS[9] is the results stream; then the shard key of item i.
-- ARGV[1] clock override, ARGV[2] interval ms, ARGV[3] stream policy ('' = no stream, 'evict_oldest',
-- 'drop_new', or 'refuse': change nothing when the results do not fit), ARGV[4] stream bound (unconsumed
-- entries), ARGV[5] consumer group, then per item: member, lease score, previous score (before the claim),
-- field count f, then f field/value pairs flattened (f = 0: no result for this item).
-- Next due = max(previous due, now) + interval. A completed cycle clears the route's stall and retry
-- counts ("in a row" ends here). A result is appended if and only if its lease completed.
-- Returns { dropped, trimmed, full, code_1..code_n, id_1..id_n }: code 1 completed, R_LEASE_LOST (stale
-- holder; nothing changed) or R_GONE; id the stream id or '' (not completed, no result, or dropped by the
-- policy); full = 1 when 'refuse' found no room (then nothing changed but the trimming of consumed entries).
local now = clock(ARGV[1])
local interval = tonumber(ARGV[2])
local policy, maxlen, group = ARGV[3], tonumber(ARGV[4]), ARGV[5]
local stream = nil
local off = NCORE
if policy ~= '' then stream = KEYS[NCORE + 1]; off = NCORE + 1 end
local n = #KEYS - off

-- items: member, lease, prev, and where their fields start in ARGV
local items = {}
local pos = 6
for i = 1, n do
  local nf = tonumber(ARGV[pos + 3])
  items[i] = { member = ARGV[pos], lease = ARGV[pos + 1], prev = tonumber(ARGV[pos + 2]), nf = nf, at = pos + 4 }
  pos = pos + 4 + 2 * nf
end

-- fence: one ZMSCORE per shard
local groups, order = {}, {}
for i = 1, n do
  local shard = KEYS[off + i]
  if not groups[shard] then groups[shard] = {}; order[#order + 1] = shard end
  table.insert(groups[shard], i)
end
local res, seen, results = {}, {}, 0
for _, shard in ipairs(order) do
  local idx = groups[shard]
  local members = {}
  for j, i in ipairs(idx) do members[j] = items[i].member end
  local scores = redis.call('ZMSCORE', shard, unpack(members))
  for j, i in ipairs(idx) do
    local it, cur = items[i], scores[j]
    if not cur then
      res[i] = R_GONE
    elseif seen[it.member] or tonumber(cur) ~= tonumber(it.lease) then
      res[i] = R_LEASE_LOST  -- a second lease for the same route in one call: only the first can be current
    else
      seen[it.member] = true
      res[i] = 1
      if it.nf > 0 then results = results + 1 end
    end
  end
end

-- room in the stream for the completed results (entries already consumed are trimmed first)
local first, last, dropped, trimmed = 1, results, 0, 0
if stream and results > 0 then
  local full
  first, last, dropped, trimmed, full = room_for(stream, group, maxlen, results, policy)
  if full then return { 0, trimmed, 1 } end
end

-- reschedule and append
local done, hargs = {}, {}
for _, shard in ipairs(order) do
  local zargs, low = {}, nil
  for _, i in ipairs(groups[shard]) do
    if res[i] == 1 then
      local base = math.floor(items[i].prev)
      if now > base then base = now end
      if not low or base + interval < low then low = base + interval end
      zargs[#zargs + 1] = base + interval
      zargs[#zargs + 1] = items[i].member
      done[#done + 1] = items[i].member
    end
  end
  if #zargs > 0 then
    redis.call('ZADD', shard, unpack(zargs))
    hargs[#hargs + 1] = low
    hargs[#hargs + 1] = shard
  end
end
if #hargs > 0 then redis.call('ZADD', K_HEADS, 'LT', unpack(hargs)) end
if #done > 0 then
  unlease(done)
  clear_stalls(done)
  redis.call('HDEL', K_RETRIES, unpack(done))
end

local out = { dropped, trimmed, 0 }
for i = 1, n do out[3 + i] = res[i] end
local k = 0
for i = 1, n do
  local id = ''
  local it = items[i]
  if stream and res[i] == 1 and it.nf > 0 then
    k = k + 1
    if k >= first and k <= last then
      local args = { stream, '*' }
      for j = it.at, it.at + 2 * it.nf - 1 do args[#args + 1] = ARGV[j] end
      id = redis.call('XADD', unpack(args))
    end
  end
  out[3 + n + i] = id
end
return out
