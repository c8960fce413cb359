-- leader_release.lua: release a leader lock, compare-and-delete on the holder's token
-- (magpie/coordination/leader.py; does not use the schedule prelude lib.lua).
-- KEYS[1] lock key. ARGV[1] holder token.
-- Returns 1 when this holder's lock was deleted, else 0 (another holder has it, or it expired).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
