-- stats_trim.lua: remove the results-stream entries below the replay floor, all of them acknowledged
-- (prelude: stats_floor.lua). Keeps the stream's length equal to its backlog.
-- KEYS[1] stream. ARGV[1] consumer group.
-- Returns the number of entries removed (0 when the stream or the group does not exist).
local floor = consumed_floor(KEYS[1], ARGV[1])
if not floor then return 0 end
return redis.call('XTRIM', KEYS[1], 'MINID', floor)
