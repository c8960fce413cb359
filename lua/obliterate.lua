-- obliterate.lua: delete the whole schedule keyspace in bounded batches.
-- KEYS: schedule keys, the layout key, then every shard key. ARGV[1] clock override, ARGV[2] payload prefix,
-- ARGV[3] logs prefix, ARGV[4] batch size, ARGV[5] force (1/0).
-- Refuses unless the queue is paused, and while leases are live unless forced.
-- Returns { status, deleted_routes } with status 'more' or 'done', or R_NOT_PAUSED, R_ACTIVE_LEASES.
local now = clock(ARGV[1])
if redis.call('EXISTS', K_PAUSED) == 0 then return R_NOT_PAUSED end
if ARGV[5] ~= '1' and redis.call('ZCOUNT', K_LEASED, '(' .. now, '+inf') > 0 then
  return R_ACTIVE_LEASES
end
local budget = tonumber(ARGV[4])
local deleted = 0
local function sweep(zkey)
  while budget > 0 do
    local rows = redis.call('ZRANGE', zkey, 0, budget - 1)
    if #rows == 0 then return true end
    for _, member in ipairs(rows) do
      redis.call('DEL', ARGV[2] .. member)
      redis.call('DEL', ARGV[3] .. member)
      redis.call('ZREM', zkey, member)
    end
    budget = budget - #rows
    deleted = deleted + #rows
  end
  return redis.call('ZCARD', zkey) == 0
end
for i = NCORE + 2, #KEYS do
  if not sweep(KEYS[i]) then return { 'more', deleted } end
end
if not sweep(K_DEAD) then return { 'more', deleted } end
redis.call('DEL', K_HEADS, K_LEASED, K_DEAD_INFO, K_STALLS, K_RETRIES, K_PROGRESS, K_PAUSED, K_CADENCE, K_PRIORITY,
  K_WS_CADENCE, KEYS[NCORE + 1])
return { 'done', deleted }
