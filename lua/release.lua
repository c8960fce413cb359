-- release.lua: hand leases back unchecked (a worker could not start them in time, or is shutting down).
-- The route becomes claimable again at once with its previous due time, without counting a stall:
-- the holder is alive and says so. A stale holder's release changes nothing. Suspicion stays.
-- KEYS: schedule keys, then the shard key of item i at KEYS[NCORE+i].
-- ARGV[1] clock override, then per item i: ARGV[3i-1] member, ARGV[3i] lease score, ARGV[3i+1] previous
-- score (before the claim).
-- The restored score is the previous score when it was a due time (ordinary or .25 retry), else now
-- (the previous score was an expired lease). Returns per item: 1 released, R_LEASE_LOST, R_GONE.
local now = clock(ARGV[1])
local n = #KEYS - NCORE
local res, done = {}, {}
for i = 1, n do
  local shard, member = KEYS[NCORE + i], ARGV[3 * i - 1]
  local ok = fence(shard, member, ARGV[3 * i])
  res[i] = ok
  if ok == 1 then
    local prev = tonumber(ARGV[3 * i + 1])
    local score
    if prev and not is_lease(prev) then score = ARGV[3 * i + 1] else score = now end
    redis.call('ZADD', shard, score, member)
    lower_head(shard, score)
    done[#done + 1] = member
  end
end
unlease(done)
-- the lease never finished checking: its start mark goes; suspicion (#q) stays until a completion
for i = 1, #done, 1000 do
  local f = {}
  for j = i, math.min(i + 999, #done) do f[#f + 1] = done[j] .. '#s' end
  redis.call('HDEL', K_STALLS, unpack(f))
end
return res
