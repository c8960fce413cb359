-- renew.lua: extend a lease, fenced on the lease score the holder keeps.
-- KEYS[1] shard key, KEYS[2] heads index, KEYS[3] lease index
-- ARGV[1] member, ARGV[2] expected lease score, ARGV[3] lease length ms
-- Returns the new lease score as a '%.1f' string, -1 when the lease was lost, -2 when the route is gone.
local shard, heads, leased = KEYS[1], KEYS[2], KEYS[3]
local member, expected, lease_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local cur = redis.call('ZSCORE', shard, member)
if not cur then return -2 end
if tonumber(cur) ~= expected then return -1 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease_s = string.format('%.1f', now + lease_ms + 0.5)
redis.call('ZADD', shard, lease_s, member)
redis.call('ZADD', leased, lease_s, member)
local first = redis.call('ZRANGE', shard, 0, 0, 'WITHSCORES')
redis.call('ZADD', heads, first[2], shard)
return lease_s
