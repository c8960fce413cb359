-- leader_extend.lua: renew a leader lock, compare-and-extend on the holder's token and on the server it
-- was taken on (magpie/coordination/leader.py; does not use the schedule prelude lib.lua).
-- KEYS[1] lock key. ARGV[1] holder token, ARGV[2] lease length in ms, ARGV[3] the server's run_id when the
-- lock was taken.
-- Returns 1 when the lock was this holder's and now lives ARGV[2] ms more; 0 when it is lost or expired;
-- 2 when this is not the server the lock was taken on (Redis restarted or failed over: whatever it
-- holds now, the lease cannot be confirmed).
local run_id = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)') or ''
if run_id ~= ARGV[3] then
  return 2
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
