-- leader_acquire.lua: take a leader lock and hand out its fencing token (magpie/coordination/leader.py; does not use
-- the schedule prelude lib.lua).
-- KEYS[1] lock key, KEYS[2] the lock's generation counter. ARGV[1] holder token, ARGV[2] lease length in
-- ms, ARGV[3] quiet period in ms after a Redis start.
-- A server that started less than ARGV[3] ms ago refuses: a holder from before a restart (the lock lost
-- with the data) may still believe it leads until its next renewal finds out, so nobody new leads until
-- then. The generation is an INCR counter raised to at least the server clock in ms, so it keeps growing
-- across a restart that lost the counter (as long as the server clock does not go back).
-- Returns { 1, generation, run_id } when this holder now owns the lock, { 0, 0, run_id } when another
-- holder has it, { 2, ms left of the quiet period, run_id } when Redis started moments ago (a state, not a
-- refusal code: leader locks do not use the schedule's refusal table).
local info = redis.call('INFO', 'server')
local run_id = string.match(info, 'run_id:(%x+)') or ''
local uptime_ms = tonumber(string.match(info, 'uptime_in_seconds:(%d+)') or '0') * 1000
local quiet = tonumber(ARGV[3])
if uptime_ms < quiet then
  return { 2, quiet - uptime_ms, run_id }
end
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return { 0, 0, run_id }
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local gen = redis.call('INCR', KEYS[2])
if gen < now then
  gen = now
  redis.call('SET', KEYS[2], string.format('%d', gen))
end
return { 1, gen, run_id }
