-- remove.lua: unschedule and delete a leased route, fenced twice: on the lease score and on the payload.
-- KEYS[1] shard key, KEYS[2] heads index, KEYS[3] lease index, KEYS[4] payload key
-- ARGV[1] member, ARGV[2] expected lease score, ARGV[3] the caller's original payload text
-- Returns 1 removed, -1 lease lost, -2 gone, -3 payload changed since the claim (a concurrent import).
local shard, heads, leased, pkey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local member, expected, original = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local cur = redis.call('ZSCORE', shard, member)
if not cur then return -2 end
if tonumber(cur) ~= expected then return -1 end
if redis.call('GET', pkey) ~= original then return -3 end
redis.call('ZREM', shard, member)
redis.call('ZREM', leased, member)
redis.call('DEL', pkey)
local first = redis.call('ZRANGE', shard, 0, 0, 'WITHSCORES')
if #first == 0 then
  redis.call('ZREM', heads, shard)
else
  redis.call('ZADD', heads, first[2], shard)
end
return 1
