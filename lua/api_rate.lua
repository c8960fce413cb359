-- Token bucket of one API token, on the Redis clock: take one request's token or say how long to wait.
-- KEYS[1]: the bucket hash (tokens, ts = Unix microseconds of the last refill)
-- KEYS[2]: the counters hash of refused requests (field ARGV[3] += 1 on a refusal)
-- ARGV[1]: refill rate, tokens per second; ARGV[2]: bucket size (burst); ARGV[3]: counter field
-- Returns {1, 0} when the request may go on, {0, retry_after_ms} when it is refused.
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local got = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(got[1])
local ts = tonumber(got[2])
if tokens == nil or ts == nil then
  tokens = burst
  ts = now
end
if now > ts then
  tokens = math.min(burst, tokens + (now - ts) * rate / 1000000)
  ts = now
end
local ttl = math.ceil(burst / rate * 1000) + 1000
local allowed = 0
if tokens >= 1 then
  tokens = tokens - 1
  allowed = 1
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.6f', tokens), 'ts', string.format('%.0f', ts))
redis.call('PEXPIRE', KEYS[1], ttl)
if allowed == 1 then
  return {1, 0}
end
redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
return {0, math.ceil((1 - tokens) * 1000 / rate)}
