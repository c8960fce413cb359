-- update.lua: an operator replaces a stored route's payload (ownership, credentials, format).
-- The schedule is untouched; a holder of a lease taken before the update can no longer remove the
-- route (remove.lua compares payloads), while its ordinary completion still applies.
-- KEYS: schedule keys. ARGV[1] payload prefix, ARGV[2] member, ARGV[3] new payload.
-- Returns 1 updated, R_GONE.
local pkey = ARGV[1] .. ARGV[2]
if redis.call('EXISTS', pkey) == 0 then return R_GONE end
redis.call('SET', pkey, ARGV[3])
return 1
