-- drain.lua: unschedule and delete routes that are due or waiting in one shard, sparing leased ones.
-- KEYS: schedule keys, KEYS[NCORE+1] shard. ARGV[1] clock override, ARGV[2] payload prefix, ARGV[3] logs
-- prefix, ARGV[4] batch size, ARGV[5] rank offset (leased members already skipped).
-- Returns { due_removed, waiting_removed, leased_skipped, more(0/1) }.
local shard = KEYS[NCORE + 1]
local now = clock(ARGV[1])
local batch, offset = tonumber(ARGV[4]), tonumber(ARGV[5])
local rows = redis.call('ZRANGE', shard, offset, offset + batch - 1, 'WITHSCORES')
local due, waiting, leased = 0, 0, 0
for i = 1, #rows, 2 do
  local member, score = rows[i], tonumber(rows[i + 1])
  if is_lease(score) and score > now then
    leased = leased + 1
  else
    if score <= now then due = due + 1 else waiting = waiting + 1 end
    if is_lease(score) then unlease({ member }) end  -- an expired lease
    redis.call('ZREM', shard, member)
    redis.call('DEL', ARGV[2] .. member)
    forget(member, ARGV[3])
  end
end
refresh_head(shard)
local more = 0
if #rows == 2 * batch then more = 1 end
return { due, waiting, leased, more }
