-- stats_drop_consumers.lua: delete each named consumer of the results stream's group that holds no
-- pending entry at this instant. The check and the deletion are atomic, so a consumer that read entries
-- after the caller listed it keeps them (deleting it would drop them from the pending list for good).
-- KEYS[1] stream. ARGV[1] consumer group, ARGV[2..] consumer names.
-- Returns the names of the deleted consumers.
local removed = {}
for i = 2, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[i])
  if #p == 0 then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[i])
    removed[#removed + 1] = ARGV[i]
  end
end
return removed
