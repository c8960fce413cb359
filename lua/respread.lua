-- respread.lua: set new due times for a batch of routes of one shard, skipping leased ones.
-- KEYS: schedule keys, KEYS[NCORE+1] shard. ARGV[1] clock override, then pairs ARGV[2i] member,
-- ARGV[2i+1] offset ms from now. Returns { moved, skipped_leased, missing }.
local shard = KEYS[NCORE + 1]
local now = clock(ARGV[1])
local moved, leased, missing, low = 0, 0, 0, nil
for i = 2, #ARGV, 2 do
  local member = ARGV[i]
  local cur = redis.call('ZSCORE', shard, member)
  if not cur then
    missing = missing + 1
  elseif is_lease(tonumber(cur)) then
    leased = leased + 1
  else
    local due = now + math.floor(tonumber(ARGV[i + 1]))
    redis.call('ZADD', shard, due, member)
    if not low or due < low then low = due end
    moved = moved + 1
  end
end
if low then lower_head(shard, low) end
return { moved, leased, missing }
