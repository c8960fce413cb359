-- stats_floor.lua: prelude of stats_publish.lua and stats_trim.lua, prepended by magpie/stats/scripts.py
-- (not run on its own; the results-stream scripts do not use the schedule prelude lib.lua).
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
