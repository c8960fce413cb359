-- stats_infra.lua: the results consumers' shared "database refuses writes" state (magpie/stats/infra.py;
-- does not use the schedule prelude lib.lua). Times are the Redis server clock, in ms.
-- KEYS[1] state hash (fields failures, since_ms, last_ms, retry_at_ms, error). ARGV[1] action:
-- 'check': returns { retry_in_ms, failures } (retry_in_ms > 0 while a backoff runs; {0, 0} with no state).
-- 'fail': ARGV[2] first backoff ms, ARGV[3] backoff cap ms, ARGV[4] error (one line), ARGV[5] state TTL ms.
--   While a backoff another consumer recorded still runs, nothing changes (concurrent trials count once);
--   else one more failure: retry_at = now + min(cap, first * 2^(failures - 1)).
--   Returns { backoff_ms, failures }.
-- 'clear': a write succeeded: deletes the state. Returns { 0, failures it held }.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local key, action = KEYS[1], ARGV[1]
local failures = tonumber(redis.call('HGET', key, 'failures') or '0')
local retry_at = tonumber(redis.call('HGET', key, 'retry_at_ms') or '0')
if action == 'check' then
  return { math.max(0, retry_at - now), failures }
end
if action == 'clear' then
  redis.call('DEL', key)
  return { 0, failures }
end
if retry_at > now then
  return { retry_at - now, failures }
end
failures = failures + 1
local backoff = math.min(tonumber(ARGV[3]), tonumber(ARGV[2]) * 2 ^ math.min(failures - 1, 30))
backoff = math.floor(backoff)
redis.call('HSETNX', key, 'since_ms', now)
redis.call('HSET', key, 'failures', failures, 'last_ms', now, 'retry_at_ms', now + backoff, 'error', ARGV[4])
redis.call('PEXPIRE', key, ARGV[5])
return { backoff, failures }
