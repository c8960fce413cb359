-- promote_budget.lua: promote's budget as a token bucket per second of the Redis clock, shared by every
-- promote pass (magpie/pipeline/promote.py; does not use the schedule prelude lib.lua).
-- KEYS[1] bucket key (a string '<second>:<routes taken in it>').
-- 'take': ARGV[2] routes wanted, ARGV[3] budget per second. Grants what is left of this second's budget.
--   Returns { granted, second }.
-- 'give': ARGV[2] routes granted but not claimed, ARGV[3] the second they were granted in. Hands them
--   back while that second lasts (later, the next second's budget is whole anyway). Returns { 0, second }.
local t = redis.call('TIME')
local sec = tonumber(t[1])
local used, at = 0, -1
local raw = redis.call('GET', KEYS[1])
if raw then
  local a, b = string.match(raw, '^(%d+):(%d+)$')
  if a then at, used = tonumber(a), tonumber(b) end
end
if at ~= sec then used = 0 end
local n = tonumber(ARGV[2])
if ARGV[1] == 'take' then
  local granted = math.max(0, math.min(n, tonumber(ARGV[3]) - used))
  redis.call('SET', KEYS[1], string.format('%d:%d', sec, used + granted), 'PX', 2000)
  return { granted, sec }
end
if at == sec and tonumber(ARGV[3]) == sec then
  redis.call('SET', KEYS[1], string.format('%d:%d', sec, math.max(0, used - n)), 'PX', 2000)
end
return { 0, sec }
