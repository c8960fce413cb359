-- complete.lua: finish leased cycles, schedule each route's next due time and, in the same atomic step,
-- apply the holders' ownership changes and append each completed route's result to the results stream.
-- Preludes: lib.lua, stats_floor.lua.
-- KEYS: schedule keys; with a stream policy, KEYS[NCORE+1] is the results stream; then the shard key of item i.
-- ARGV[1] clock override, ARGV[2] interval ms, ARGV[3] stream policy ('' = no stream, 'evict_oldest',
-- 'drop_new', or 'refuse': change nothing when the results do not fit), ARGV[4] stream bound (unconsumed
-- entries), ARGV[5] consumer group, ARGV[6] payload key prefix, ARGV[7] logs key prefix, ARGV[8] default
-- dead-route policy: dead checks in a row before backing off (0 = off), ARGV[9] its interval factor, then
-- per item: member, lease score, previous score (before the claim), alive (1, 0 dead, -1 unknown),
-- owner-change count c (0, or 2 followed by the
-- holder's original payload and its desired payload), field count f, then f field/value pairs flattened
-- (f = 0: no result for this item).
-- Next due = max(previous due, now) + interval, the interval being the route's own (K_CADENCE, read only
-- while that hash is not empty) or ARGV[2]; under a dead-route policy (the route's own, else ARGV[8..9])
-- a route dead that many checks in a row waits interval * factor until a check finds it alive. A completed cycle clears the route's stall and retry
-- counts ("in a row" ends here). A result is appended if and only if its lease completed. An ownership
-- change applies only the holder's delta (workspace ids removed or added between its original and desired
-- payloads, JSON of any encoding: only their "w" lists are read) to the payload as stored now, so
-- workspaces an import added meanwhile and the current credentials stay; ordinary items never write the
-- payload. When no workspace is left the route is removed and its result is not appended.
-- Returns { dropped, trimmed, full, code_1..code_n, id_1..id_n }: code 1 completed, 2 removed,
-- R_LEASE_LOST (stale holder; nothing changed), R_GONE or R_BAD_PAYLOAD (a payload shape the ownership
-- change cannot merge; nothing changed for that item); id the stream id or '' (not completed, no result,
-- or dropped by the policy); full = 1 when 'refuse' found no room (then nothing changed but the trimming
-- of consumed entries).
local now = clock(ARGV[1])
local interval = tonumber(ARGV[2])
local policy, maxlen, group = ARGV[3], tonumber(ARGV[4]), ARGV[5]
local payload_prefix, logs_prefix = ARGV[6], ARGV[7]
local dead_after, dead_factor = tonumber(ARGV[8]) or 0, tonumber(ARGV[9]) or 1
local stream = nil
local off = NCORE
if policy ~= '' then stream = KEYS[NCORE + 1]; off = NCORE + 1 end
local n = #KEYS - off

-- items: member, lease, prev, the ownership change, and where their fields start in ARGV
local items = {}
local pos = 10
for i = 1, n do
  local it = { member = ARGV[pos], lease = ARGV[pos + 1], prev = tonumber(ARGV[pos + 2]),
               alive = tonumber(ARGV[pos + 3]) }
  local nc = tonumber(ARGV[pos + 4])
  if nc > 0 then it.orig, it.want = ARGV[pos + 5], ARGV[pos + 6] end
  pos = pos + 5 + nc
  it.nf = tonumber(ARGV[pos])
  it.at = pos + 1
  pos = pos + 1 + 2 * it.nf
  items[i] = it
end

-- the "w" ids of a holder's payload in any JSON encoding, as a set; nil when it has none
local function ws_set(text)
  local ok, doc = pcall(cjson.decode, text)
  if not ok or type(doc) ~= 'table' or type(doc['w']) ~= 'table' then return nil end
  local set = {}
  for _, v in pairs(doc['w']) do
    local id = tonumber(v)
    if not id then return nil end
    set[id] = true
  end
  return set
end

-- the payload stored now with the holder's delta applied: new text ('' when no workspace is left), or nil
local function owner_delta(cur, orig_text, want_text)
  local head, have = split_w(cur)
  local orig, want = ws_set(orig_text), ws_set(want_text)
  if not head or not orig or not want then return nil end
  local _, list = id_list(have)
  local result, seen = {}, {}
  for _, v in ipairs(list) do
    if not (orig[v] and not want[v]) then result[#result + 1] = v; seen[v] = true end
  end
  for v in pairs(want) do
    if not orig[v] and not seen[v] then result[#result + 1] = v; seen[v] = true end
  end
  if #result == 0 then return '' end
  return join_w(head, result)
end

-- fence: one ZMSCORE per shard; an ownership change is merged here (reads only)
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
      res[i] = 1
      if it.orig then
        local stored = redis.call('GET', payload_prefix .. it.member)
        if not stored then
          res[i] = R_GONE
        else
          local updated = owner_delta(stored, it.orig, it.want)
          if not updated then
            res[i] = R_BAD_PAYLOAD
          elseif updated == '' then
            res[i] = 2
          elseif updated ~= stored then
            it.updated = updated
          end
        end
      end
      if res[i] > 0 then seen[it.member] = true end
      if res[i] == 1 and it.nf > 0 then results = results + 1 end
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

-- each completed route's interval: its own (one HMGET, only while K_CADENCE holds anything) and the
-- dead-route policy's factor; dead streaks are counted here
local own, streak_set, streak_del = {}, {}, {}
if redis.call('EXISTS', K_CADENCE) == 1 or dead_after > 0 then
  local fields, who = {}, {}
  for i = 1, n do
    if res[i] == 1 then
      local m = items[i].member
      fields[#fields + 1] = m; fields[#fields + 1] = m .. '#p'; fields[#fields + 1] = m .. '#d'
      who[#who + 1] = i
    end
  end
  if #fields > 0 then
    local vals = redis.call('HMGET', K_CADENCE, unpack(fields))
    for j, i in ipairs(who) do
      local it = items[i]
      local iv, pol, streak = tonumber(vals[3 * j - 2]), vals[3 * j - 1], tonumber(vals[3 * j]) or 0
      iv = iv or interval
      local after, factor = dead_after, dead_factor
      if pol then
        local a, f = string.match(pol, '^(%d+):(%d+)$')
        after, factor = tonumber(a), tonumber(f)
      end
      if after > 0 and it.alive == 0 then
        streak = streak + 1
        streak_set[#streak_set + 1] = it.member .. '#d'; streak_set[#streak_set + 1] = streak
        if streak >= after then iv = iv * factor end
      elseif it.alive == 1 and streak > 0 then
        streak_del[#streak_del + 1] = it.member .. '#d'
      elseif after > 0 and streak >= after then
        iv = iv * factor  -- no verdict: the route stays where it was
      end
      own[i] = iv
    end
  end
end
if #streak_set > 0 then redis.call('HSET', K_CADENCE, unpack(streak_set)) end
if #streak_del > 0 then redis.call('HDEL', K_CADENCE, unpack(streak_del)) end

-- reschedule (or remove) and append
local done, hargs = {}, {}
for _, shard in ipairs(order) do
  local zargs, low = {}, nil
  for _, i in ipairs(groups[shard]) do
    local it = items[i]
    if res[i] == 1 then
      local base = math.floor(it.prev)
      if now > base then base = now end
      local next_due = base + (own[i] or interval)
      if not low or next_due < low then low = next_due end
      zargs[#zargs + 1] = next_due
      zargs[#zargs + 1] = it.member
      done[#done + 1] = it.member
      if it.updated then redis.call('SET', payload_prefix .. it.member, it.updated) end
    elseif res[i] == 2 then
      redis.call('ZREM', shard, it.member)
      redis.call('DEL', payload_prefix .. it.member)
      forget(it.member, logs_prefix)
      unlease({ it.member })
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
