-- stats_floor.lua: prelude of stats_trim.lua (prepended by magpie/stats/scripts.py), complete.lua and the
-- PostgreSQL schedule's outbox relay (not run on its own).
-- consumed_floor(key, group): the replay floor of consumer group `group` on stream `key`: the oldest
-- pending entry's id, or, with nothing pending, the id right after the last delivered entry. Every entry
-- below it is acknowledged (consumed). Returns nil when the stream or the group does not exist.
local function consumed_floor(key, group)
  local groups = redis.pcall('XINFO', 'GROUPS', key)
  if type(groups) ~= 'table' or groups.err then return nil end
  for _, g in ipairs(groups) do
    local f = {}
    for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
    if f['name'] == group then
      if tonumber(f['pending']) > 0 then
        return redis.call('XPENDING', key, group)[2]
      end
      local ms, seq = string.match(f['last-delivered-id'], '^(%d+)-(%d+)$')
      if not ms then return nil end
      return ms .. '-' .. string.format('%d', tonumber(seq) + 1)
    end
  end
  return nil
end

-- room_for(key, group, maxlen, n, policy): make room on stream `key` for n new entries under a bound of
-- `maxlen` unconsumed entries. Consumed entries (below the replay floor) are trimmed first; then the
-- policy decides: 'evict_oldest' trims the oldest unconsumed entries (and keeps the tail of a batch above
-- the bound), 'drop_new' keeps what fits, 'refuse' keeps nothing and reports the stream full.
-- Returns first, last (the range of the n new entries to append), dropped, trimmed, full.
local function room_for(key, group, maxlen, n, policy)
  local len = redis.call('XLEN', key)
  local trimmed = 0
  if len + n > maxlen and len > 0 then
    local floor = consumed_floor(key, group)
    if floor then
      trimmed = redis.call('XTRIM', key, 'MINID', floor)
      len = len - trimmed
    end
  end
  if len + n <= maxlen then return 1, n, 0, trimmed, false end
  if policy == 'refuse' then return 1, 0, 0, trimmed, true end
  local first, last, dropped = 1, n, 0
  if policy == 'drop_new' then
    local room = math.max(0, maxlen - len)
    last, dropped = room, n - room
  else
    if n > maxlen then first, dropped = n - maxlen + 1, n - maxlen end
    local over = len + (last - first + 1) - maxlen
    if over > 0 then
      redis.call('XTRIM', key, 'MAXLEN', maxlen - (last - first + 1))
      dropped = dropped + over
    end
  end
  return first, last, dropped, trimmed, false
end

