-- lib.lua: prelude prepended to every script by magpie/queue/scripts.py (not run on its own).
-- Every script receives the same eleven schedule keys first (KEYS[1..NCORE]); script-specific keys follow.
-- Score fractions mark state: .0 an ordinary due time, .25 a backoff retry due time, .5 a lease.
-- K_LEASED indexes every lease handed out (member -> lease score), written with one variadic command
-- per script call; live leases are its scores above now, so an expired lease never blocks a claim.
local K_HEADS, K_LEASED, K_DEAD, K_DEAD_INFO = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local K_STALLS, K_RETRIES, K_PAUSED, K_PROGRESS = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
-- K_CADENCE: per-route cadence state (cadence helpers below): <member> its own interval ms, <member>#r an
-- operator's override, <member>#p its dead-route policy 'after:factor', <member>#d dead checks in a row.
-- K_PRIORITY: the priority lane (member -> due ms) claimed ahead of the backlog (pop.lua); K_WS_CADENCE:
-- workspace id -> 'interval_ms:dead_after:dead_factor' (0 = not set), and 'p:<workspace id>' -> the same
-- from the workspace's check profile.
local K_CADENCE, K_PRIORITY, K_WS_CADENCE = KEYS[9], KEYS[10], KEYS[11]
local NCORE = 11

-- Refusal codes, the only negative replies a script gives (magpie.errors.Refusal holds the same table).
local R_LEASE_LOST, R_GONE, R_PAYLOAD_CHANGED, R_BAD_PAYLOAD, R_LEASED = -1, -2, -3, -4, -5
local R_DEAD, R_NOT_DEAD, R_ACTIVE_LEASES, R_NOT_PAUSED, R_LAYOUT_MISMATCH = -6, -7, -8, -9, -10
-- refusals raised by Python only, listed so the table stays whole: rotators
local R_PORT_TAKEN, R_RANGE_EXHAUSTED, R_NO_SUCH_WORKSPACE = -11, -12, -13
-- nothing claimable (the claim command); an operation the provider does not serve
local R_EMPTY, R_UNSUPPORTED = -14, -15
-- a stale --expected-revision (Python only)
local R_REVISION_CHANGED = -16

-- Redis server clock in Unix ms; a positive override is accepted for deterministic tests only.
local function clock(override)
  local o = tonumber(override)
  if o and o > 0 then return o end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Scores leave scripts as strings: a numeric reply would be truncated to an integer.
local function fmt(x) return string.format('%.2f', x) end

local function is_lease(score) return score % 1 == 0.5 end
local function is_retry(score) return score % 1 == 0.25 end

-- The heads index holds, per shard, a lower bound of the shard's lowest score: writes that may lower
-- it use lower_head (ZADD LT); writes that raise it leave it low; pop.lua, which reads the shard
-- anyway, sets it exactly. A stale-low head costs one wasted read, never a missed due route.
local function lower_head(shard, score)
  redis.call('ZADD', K_HEADS, 'LT', score, shard)
end

local function refresh_head(shard)
  local first = redis.call('ZRANGE', shard, 0, 0, 'WITHSCORES')
  if #first == 0 then
    redis.call('ZREM', K_HEADS, shard)
  else
    redis.call('ZADD', K_HEADS, first[2], shard)
  end
end

-- Stall evidence in K_STALLS, per route: <member> counted stalls, <member>#s the lease score the route
-- started checking under (written by the checker), <member>#q stalls of started leases since its last
-- completion (from 2 on the route is in quarantine: checked alone, and its stalls count).
local function clear_stalls(members)
  for i = 1, #members, 500 do
    local f = {}
    for j = i, math.min(i + 499, #members) do
      local m = members[j]
      f[#f + 1] = m; f[#f + 1] = m .. '#s'; f[#f + 1] = m .. '#q'
    end
    redis.call('HDEL', K_STALLS, unpack(f))
  end
end

-- Per-route side state that goes away with the route.
local function forget(member, logs_prefix)
  clear_stalls({ member })
  redis.call('HDEL', K_RETRIES, member)
  redis.call('HDEL', K_PROGRESS, member)
  redis.call('HDEL', K_DEAD_INFO, member)
  redis.call('ZREM', K_DEAD, member)
  redis.call('HDEL', K_CADENCE, member, member .. '#r', member .. '#p', member .. '#d')
  redis.call('ZREM', K_PRIORITY, member)
  if logs_prefix then redis.call('DEL', logs_prefix .. member) end
end

-- The lease index forgets ended leases (in slices: Lua's unpack takes a few thousand values at most).
local function unlease(members)
  for i = 1, #members, 1000 do
    redis.call('ZREM', K_LEASED, unpack(members, i, math.min(i + 999, #members)))
  end
end

-- Fencing: 1 when the stored score equals the holder's lease score, else R_LEASE_LOST or R_GONE.
local function fence(shard, member, expected)
  local cur = redis.call('ZSCORE', shard, member)
  if not cur then return R_GONE, nil end
  if tonumber(cur) ~= tonumber(expected) then return R_LEASE_LOST, tonumber(cur) end
  return 1, tonumber(cur)
end

-- Workspace ids of a payload ("w":[...] closes the JSON text); nil when the shape is foreign.
local function split_w(text)
  return string.match(text, '^(.*"w":)%[([%d,]*)%]}$')
end

local function id_list(csv)
  local set, list = {}, {}
  for id in string.gmatch(csv or '', '%d+') do
    local v = tonumber(id)
    if not set[v] then set[v] = true; list[#list + 1] = v end
  end
  return set, list
end

local function join_w(head, list)
  table.sort(list)
  return head .. '[' .. table.concat(list, ',') .. ']}'
end

-- Cadence (per-route interval and dead-route policy). A workspace's cadence 'interval:after:factor' comes
-- from K_WS_CADENCE field '<id>' (magpie workspaces set-interval) and its check profile's from field
-- 'p:<id>' (magpie profiles set --interval); per field, the profile's wins over the workspace's (0 = unset).
-- A route's own interval is the operator's override (#r) or else the shortest interval of its workspaces;
-- its dead policy that of its workspaces with the smallest factor.
local function parse_cadence(row)
  if not row then return nil, nil, nil end
  local i, a, f = string.match(row, '^(%d+):(%d+):(%d+)$')
  return tonumber(i), tonumber(a), tonumber(f)
end

local function ws_cadence(ids)
  if #ids == 0 or redis.call('HLEN', K_WS_CADENCE) == 0 then return nil, nil end
  local fields = {}
  for n, id in ipairs(ids) do fields[2 * n - 1] = id; fields[2 * n] = 'p:' .. id end
  local rows = redis.call('HMGET', K_WS_CADENCE, unpack(fields))
  local interval, policy, factor = nil, nil, nil
  for n = 1, #ids do
    local i, a, f = parse_cadence(rows[2 * n - 1])
    local pi, pa, pf = parse_cadence(rows[2 * n])
    if pi and pi > 0 then i = pi end
    if pa and pa > 0 and pf and pf > 1 then a, f = pa, pf end
    if i and i > 0 and (not interval or i < interval) then interval = i end
    if a and a > 0 and f and f > 1 and (not factor or f < factor) then factor = f; policy = a .. ':' .. f end
  end
  return interval, policy
end

-- Recompute and store one route's cadence fields from its payload text (nil: gone). Returns the route's
-- own interval ms (nil: the deployment's).
local function recadence(member, payload)
  local _, have = nil, nil
  if payload then _, have = split_w(payload) end
  local _, ids = id_list(have)
  local interval, policy = ws_cadence(ids)
  local override = tonumber(redis.call('HGET', K_CADENCE, member .. '#r'))
  if override then interval = override end
  if interval then redis.call('HSET', K_CADENCE, member, interval) else redis.call('HDEL', K_CADENCE, member) end
  if policy then
    redis.call('HSET', K_CADENCE, member .. '#p', policy)
  else
    redis.call('HDEL', K_CADENCE, member .. '#p', member .. '#d')
  end
  return interval
end

-- FNV-1a 32 of a route hash (magpie.queue.keys.fnv1a_32), in doubles: 16777619 = 2^24 + 403.
local function fnv1a(s)
  local h = 2166136261
  for i = 1, #s do
    h = bit.bxor(h, string.byte(s, i)) % 4294967296
    h = ((h % 256) * 16777216 + h * 403) % 4294967296
  end
  return h
end
