-- token_bucket.lua: a token bucket on the Redis clock, taken from in blocks (magpie/coordination/ratelimit.py; does
-- not use the schedule prelude lib.lua).
-- KEYS[1] bucket hash {t = tokens, at = Redis time of t in ms}.
-- ARGV[1] rate (tokens per second, > 0), ARGV[2] burst (most tokens held, >= 1), ARGV[3] tokens wanted.
-- Refills at rate since the last call (never above burst), grants min(wanted, whole tokens held).
-- A negative ARGV[3] hands that many unused tokens back (never above burst) and grants 0.
-- Returns { granted, ms until the next whole token (0 when one is left) }.
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local want = math.floor(tonumber(ARGV[3]))
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local st = redis.call('HMGET', KEYS[1], 't', 'at')
local tokens = tonumber(st[1])
local at = tonumber(st[2])
if tokens == nil or at == nil then
  tokens, at = burst, now
end
if now > at then
  tokens = math.min(burst, tokens + (now - at) * rate / 1000)
end
tokens = math.min(tokens, burst)
local granted = 0
if want < 0 then
  tokens = math.min(burst, tokens - want)
else
  granted = math.min(want, math.floor(tokens))
end
tokens = tokens - granted
redis.call('HSET', KEYS[1], 't', string.format('%.6f', tokens), 'at', now)
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
local wait = 0
if tokens < 1 then wait = math.ceil((1 - tokens) * 1000 / rate) end
return { granted, wait }
