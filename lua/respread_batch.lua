-- respread_batch.lua: one bounded batch of a respread of one shard, walked with a ZSCAN cursor.
-- ZSCAN walks the shard's member dictionary, which score changes do not reorder, so moving members
-- never makes the walk skip or repeat them (a rehash while the shard grows or shrinks may repeat a few:
-- a repeated member is moved again, still inside the interval).
-- KEYS: schedule keys, KEYS[NCORE+1] shard, KEYS[NCORE+2] optional progress hash (the stored interval's hash).
-- ARGV[1] clock override, ARGV[2] scan cursor ('0' starts the shard), ARGV[3] COUNT hint,
-- ARGV[4] placed (routes placed before this batch, over every shard), ARGV[5] total routes of the run,
-- ARGV[6] interval ms, ARGV[7] run token (with KEYS[NCORE+2] only).
-- Route number p of the run gets due = now + floor((p mod total) * interval / total); a leased route
-- keeps its lease (its completion applies the interval) and still takes its number.
-- With KEYS[NCORE+2] the batch runs only while its field 'run' equals ARGV[7], and it stores its own
-- progress there in the same step: fields cursor, placed, moved, held (leased), and shard (+1 when this
-- shard's walk ended; cursor back to '0'). A stale run gets { 'superseded' } and changes nothing.
-- Returns { next cursor ('0': shard done), moved, leased, placed after the batch }.
local shard = KEYS[NCORE + 1]
local progress = KEYS[NCORE + 2]
if progress and redis.call('HGET', progress, 'run') ~= ARGV[7] then
  return { 'superseded' }
end
local now = clock(ARGV[1])
local placed = tonumber(ARGV[4])
local total = math.max(1, tonumber(ARGV[5]))
local interval = tonumber(ARGV[6])
local reply = redis.call('ZSCAN', shard, ARGV[2], 'COUNT', tonumber(ARGV[3]))
local cursor, found = reply[1], reply[2]
local moved, leased, low = 0, 0, nil
for i = 1, #found, 2 do
  local member, cur = found[i], tonumber(found[i + 1])
  if is_lease(cur) then
    leased = leased + 1
  else
    local due = now + math.floor((placed % total) * interval / total)
    redis.call('ZADD', shard, due, member)
    if not low or due < low then low = due end
    moved = moved + 1
  end
  placed = placed + 1
end
if low then lower_head(shard, low) end
if progress then
  redis.call('HSET', progress, 'cursor', cursor, 'placed', placed)
  redis.call('HINCRBY', progress, 'moved', moved)
  redis.call('HINCRBY', progress, 'held', leased)  -- routes left under a lease
  if cursor == '0' then redis.call('HINCRBY', progress, 'shard', 1) end
end
return { cursor, moved, leased, placed }
