-- stats_redrive.lua: move dead-lettered entries back into the results stream, atomically per entry
-- (magpie/stats/redrive.py; does not use the schedule prelude lib.lua).
-- KEYS[1] dead-letter stream, KEYS[2] results stream. ARGV[1] exclusive start id ('-' from the oldest),
-- ARGV[2] most dead letters to look at, ARGV[3] '1' to delete dead letters that hold nothing to re-ingest,
-- ARGV[4] last id to look at (inclusive; '+' for no bound: entries dead-lettered again after a redrive
-- began are left for the next one).
-- Each dead letter whose `entry` field holds the original fields (JSON object of strings) is appended to
-- the results stream with `origin_id` = the original entry's id (kept when the entry had one already, so
-- the replay ledger sees one id however often it is redriven) and deleted from the dead-letter stream in
-- the same step, so a concurrent or repeated redrive never appends it twice.
-- Returns { moved, unrecoverable, last id looked at ('' when none) }.
local dead, results = KEYS[1], KEYS[2]
local start = ARGV[1]
if start ~= '-' then start = '(' .. start end
local rows = redis.call('XRANGE', dead, start, ARGV[4], 'COUNT', tonumber(ARGV[2]))
local moved, unrecoverable, last = 0, 0, ''
for _, row in ipairs(rows) do
  local id, kv = row[1], row[2]
  last = id
  local f = {}
  for i = 1, #kv, 2 do f[kv[i]] = kv[i + 1] end
  local ok, fields = pcall(cjson.decode, f['entry'] or '')
  local args = nil
  if ok and type(fields) == 'table' and next(fields) ~= nil then
    args = { results, '*' }
    for k, v in pairs(fields) do
      if type(k) ~= 'string' or (type(v) ~= 'string' and type(v) ~= 'number') then
        args = nil
        break
      end
      if k ~= 'origin_id' then
        args[#args + 1] = k
        args[#args + 1] = tostring(v)
      end
    end
  end
  local origin = (ok and type(fields) == 'table' and type(fields['origin_id']) == 'string'
                  and fields['origin_id'] ~= '') and fields['origin_id'] or f['stream_id']
  if args and origin and origin ~= '' then
    args[#args + 1] = 'origin_id'
    args[#args + 1] = origin
    redis.call('XADD', unpack(args))
    redis.call('XDEL', dead, id)
    moved = moved + 1
  else
    unrecoverable = unrecoverable + 1
    if ARGV[3] == '1' then redis.call('XDEL', dead, id) end
  end
end
return { moved, unrecoverable, last }
