-- pop.lua: claim up to N due routes across shards, in due-time order, leasing each one.
-- KEYS: the schedule keys (lib.lua).
-- ARGV[1] clock override (0 = server clock), ARGV[2] max routes, ARGV[3] lease ms,
-- ARGV[4] payload key prefix, ARGV[5] max outstanding leases (0 = no cap), ARGV[6] max stalls,
-- ARGV[7] priority share (0..1; 0 or absent: no lane), ARGV[8] shard key prefix, ARGV[9] shard count.
-- The priority lane (K_PRIORITY: new imports, check-now) is claimed first, due members in lane order, for
-- at most floor(share * N) of the N routes of the call; the due backlog fills the rest in due-time order,
-- and the lane again whatever room the backlog leaves. So the backlog keeps (1 - share) of every claim.
-- Returns { now, allowed, paused(0/1), dead_lettered, lease_score, item... }, each item
--   { member, payload, previous_score, shard, stalled + 2 * alone + 4 * retry_attempts }; every claim
--   of one call shares the lease score.
-- Re-claiming an expired lease is a stall. It is evidence against the route only when the route had
-- started checking under that lease (its #s mark, lib.lua): a lease that never started (prefetched,
-- queued behind others) counts nothing. Each started stall counts. A crash of a process takes its
-- neighbours down with it, and a whole-worker crash (OOM, a kill) takes hundreds, so the first
-- max(max stalls, 2) - 1 stalls since the last completion only make the route a suspect (#q): it is
-- re-run as usual. A route that stalled max(max stalls, 2) times in a row is in quarantine (alone = 1:
-- dispatched alone, checked alone), so its next stall is its own. More than max stalls in a row, the
-- last of them while checked alone, move it to the dead-letter set instead of claiming it, with the
-- evidence: a route that kills its process is dead-lettered within max(max + 1, 3) claims.
local now = clock(ARGV[1])
local want = tonumber(ARGV[2])
local lease_ms = tonumber(ARGV[3])
local pprefix = ARGV[4]
local max_inflight = tonumber(ARGV[5])
local max_stalled = tonumber(ARGV[6])
local alone_at = math.max(max_stalled, 2)  -- started stalls in a row that quarantine a route
local share, sprefix, nshards = tonumber(ARGV[7]) or 0, ARGV[8], tonumber(ARGV[9]) or 0

if redis.call('EXISTS', K_PAUSED) == 1 then return { tostring(now), 0, 1, 0, '' } end
if max_inflight > 0 then
  local room = max_inflight - redis.call('ZCOUNT', K_LEASED, '(' .. now, '+inf')
  if room < want then want = room end
end
if want < 0 then want = 0 end
local out = { tostring(now), want, 0, 0, '' }
if want == 0 then return out end
local lease_s = fmt(now + lease_ms + 0.5)
local got, dead = 0, 0
local leased_args, unleased = {}, {}
local due = redis.call('ZRANGE', K_HEADS, '-inf', now, 'BYSCORE')
table.sort(due)  -- rank shards by key once: ties on score then compare numbers, not strings
local cursors = {}
for rank, shard in ipairs(due) do cursors[#cursors + 1] = { shard = shard, rank = rank, read = 0 } end

-- fetch the next `chunk` due rows of a cursor (rows already claimed this call moved past now)
local function fill(c, chunk)
  local rows = redis.call('ZRANGE', c.shard, '-inf', now, 'BYSCORE', 'LIMIT', c.read, chunk, 'WITHSCORES')
  local members, scores = {}, {}
  for j = 1, #rows, 2 do
    members[#members + 1] = rows[j]
    scores[#scores + 1] = tonumber(rows[j + 1])
  end
  c.members, c.scores, c.i, c.more = members, scores, 1, (#members == chunk)
  c.read = c.read + #members
end

local taken = {}
-- claim candidates { cursor (its .shard), member, score }: one MGET, one HMGET of stall state, one
-- variadic ZADD per shard; true when some were dropped (payload gone) or dead-lettered
local function take(cand)
  local pkeys = {}
  for j, c in ipairs(cand) do pkeys[j] = pprefix .. c[2] end
  local payloads = redis.call('MGET', unpack(pkeys))
  local sfields = {}
  for j, c in ipairs(cand) do sfields[2 * j - 1] = c[2] .. '#s'; sfields[2 * j] = c[2] .. '#q' end
  local svals = redis.call('HMGET', K_STALLS, unpack(sfields))
  local claim, drop = {}, {}
  local dropped = false
  for j, c in ipairs(cand) do
    local cur, member, score = c[1], c[2], c[3]
    local shard = cur.shard
    local payload = payloads[j]
    local keep = false
    if payload then
      keep = true
      local stalled, stalls, alone, q = 0, 0, 0, 0
      local mark = svals[2 * j - 1]
      q = tonumber(svals[2 * j] or '0')
      if is_lease(score) then
        stalled = 1
        if mark and tonumber(mark) == score then
          q = redis.call('HINCRBY', K_STALLS, member .. '#q', 1)
          stalls = redis.call('HINCRBY', K_STALLS, member, 1)
          redis.call('HDEL', K_STALLS, member .. '#s')
        end
      end
      if q >= alone_at then alone = 1 end
      if stalls > max_stalled and q > alone_at then  -- the lease that stalled was checked alone
        keep = false
        redis.call('ZADD', K_DEAD, now, member)
        redis.call('HSET', K_DEAD_INFO, member, cjson.encode({ reason = 'stalled', stalls = stalls, claims = q,
          alone = true, at = now }))
        dead = dead + 1
        unleased[#unleased + 1] = member
      else
        claim[shard] = claim[shard] or {}
        table.insert(claim[shard], lease_s)
        table.insert(claim[shard], member)
        leased_args[#leased_args + 1] = lease_s
        leased_args[#leased_args + 1] = member
        local attempts = 0
        if is_retry(score) then attempts = tonumber(redis.call('HGET', K_RETRIES, member) or '0') end
        out[#out + 1] = { member, payload, fmt(score), shard, stalled + 2 * alone + 4 * attempts }
        got = got + 1
      end
    else
      unleased[#unleased + 1] = member
    end
    if not keep then
      drop[shard] = drop[shard] or {}
      table.insert(drop[shard], member)
      dropped = true
    end
  end
  for shard, args in pairs(claim) do redis.call('ZADD', shard, unpack(args)) end
  for shard, members in pairs(drop) do redis.call('ZREM', shard, unpack(members)) end
  return dropped
end

-- the priority lane: up to `cap` due members, lane order; entries that are gone, leased or claimed leave it
local lane = share > 0 and nshards > 0 and redis.call('EXISTS', K_PRIORITY) == 1
local function lane_pass(cap)
  if not lane or cap <= 0 then return end
  local rows = redis.call('ZRANGE', K_PRIORITY, '-inf', now, 'BYSCORE', 'LIMIT', 0, cap * 2 + 8)
  local cand, out_of_lane = {}, {}
  for _, m in ipairs(rows) do
    if #cand >= cap then break end
    local shard = sprefix .. (fnv1a(m) % nshards)
    local sc = tonumber(redis.call('ZSCORE', shard, m))
    if sc and sc <= now then
      cand[#cand + 1] = { { shard = shard }, m, sc }
    elseif sc and not is_lease(sc) then
      redis.call('ZADD', K_PRIORITY, sc, m)  -- due later than the lane thought: wait for it there
    else
      out_of_lane[#out_of_lane + 1] = m
    end
  end
  for _, c in ipairs(cand) do out_of_lane[#out_of_lane + 1] = c[2] end
  if #out_of_lane > 0 then redis.call('ZREM', K_PRIORITY, unpack(out_of_lane)) end
  if #cand > 0 then take(cand) end
end
local lane_got = 0
if lane then
  lane_pass(math.floor(want * share))
  lane_got = #taken
end

-- Rounds: merge the due shards (k-way, smallest (score, shard key, member) first) into up to `need`
-- candidates, then claim them with one MGET and one variadic ZADD per shard. Another round runs only
-- when candidates were dropped (payload gone) or dead-lettered.
while got < want and #cursors > 0 do
  local need = want - got
  local chunk = math.max(4, math.ceil(need / #cursors) * 2)
  for _, c in ipairs(cursors) do
    c.read = 0  -- claims of the previous round moved out of the due range
    fill(c, chunk)
  end
  -- current head score of each cursor in a flat array: one numeric scan per pick
  local k = #cursors
  local head = {}
  for j = 1, k do head[j] = cursors[j].scores[1] or false end
  local cand = {}
  while #cand < need do
    local bj, bs = nil, nil
    for j = 1, k do
      local sc = head[j]
      if sc and (not bs or sc < bs) then bj, bs = j, sc end  -- ties keep the lower rank (earlier j)
    end
    if not bj then break end
    local c = cursors[bj]
    cand[#cand + 1] = { c, c.members[c.i], bs }
    c.i = c.i + 1
    if c.i > #c.members and c.more then fill(c, chunk) end
    head[bj] = c.scores[c.i] or false
  end
  if #cand == 0 then break end

  local dropped = take(cand)
  if not dropped then break end
end

if lane then
  if #taken > lane_got then
    for i = lane_got + 1, #taken, 1000 do
      redis.call('ZREM', K_PRIORITY, unpack(taken, i, math.min(i + 999, #taken)))
    end
  end
  if got < want then lane_pass(want - got) end
end

-- Exact heads for every shard read: the next unclaimed due row, or the shard's lowest score.
local hargs, gone = {}, {}
for _, c in ipairs(cursors) do
  local low = c.scores and c.scores[c.i]
  if not low then
    local first = redis.call('ZRANGE', c.shard, 0, 0, 'WITHSCORES')
    low = first[2]
  end
  if low then
    hargs[#hargs + 1] = low
    hargs[#hargs + 1] = c.shard
  else
    gone[#gone + 1] = c.shard
  end
end
if #hargs > 0 then redis.call('ZADD', K_HEADS, unpack(hargs)) end
if #gone > 0 then redis.call('ZREM', K_HEADS, unpack(gone)) end
if #leased_args > 0 then redis.call('ZADD', K_LEASED, unpack(leased_args)) end
unlease(unleased)
out[4] = dead
out[5] = lease_s
return out
