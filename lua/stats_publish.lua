-- stats_publish.lua: append a batch of result entries to the results stream under a bound on its
-- unconsumed entries (prelude: stats_floor.lua).
-- KEYS[1] stream. ARGV[1] maxlen, ARGV[2] policy ('evict_oldest' or 'drop_new'), ARGV[3] consumer group,
-- ARGV[4] entry count n, then per entry: field count f, then its f field/value pairs flattened (2f values).
-- When the batch does not fit, entries the group has already consumed (acknowledged, below the replay
-- floor) are trimmed first; only then does the policy decide: 'evict_oldest' trims the oldest unconsumed
-- entries (exact MAXLEN), 'drop_new' stores what fits and drops the rest of the batch.
-- Returns { dropped, trimmed_consumed, id_1, ..., id_n } with '' for a dropped entry.
local key = KEYS[1]
local maxlen, policy, group, n = tonumber(ARGV[1]), ARGV[2], ARGV[3], tonumber(ARGV[4])
local first, last, dropped, trimmed = room_for(key, group, maxlen, n, policy)
local out = { dropped, trimmed }
local pos = 5
for i = 1, n do
  local nf = tonumber(ARGV[pos])
  if i >= first and i <= last then
    local args = { key, '*' }
    for j = pos + 1, pos + 2 * nf do args[#args + 1] = ARGV[j] end
    out[#out + 1] = redis.call('XADD', unpack(args))
  else
    out[#out + 1] = ''
  end
  pos = pos + 1 + 2 * nf
end
return out
