-- leader_extend.lua: renew a leader lock, compare-and-extend on the holder's token
-- (magpie/leader.py; does not use the schedule prelude lib.lua).
-- KEYS[1] lock key. ARGV[1] holder token, ARGV[2] lease length in ms.
-- Returns 1 when the lock was this holder's and now lives ARGV[2] ms more, else 0 (lost or expired).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
