-- migrate_payload.lua: rewrite route payloads into another credential form (sealed or plaintext),
-- each one only while it is still the text the caller read and no live lease holds its route.
-- A lease holder keeps the payload it claimed (remove.lua compares it), and an import that merged a
-- workspace after the read changed the text: both leave the payload as it is, for a later pass.
-- KEYS: schedule keys. ARGV[1] clock override, ARGV[2] payload key prefix, then per item i:
-- ARGV[3i] member, ARGV[3i+1] the payload text read, ARGV[3i+2] its new text.
-- Returns one code per item: 1 rewritten, 0 changed since the read (or gone), 2 leased.
local now = clock(ARGV[1])
local pprefix = ARGV[2]
local out = {}
for i = 1, math.floor((#ARGV - 2) / 3) do
  local member, seen, new = ARGV[3 * i], ARGV[3 * i + 1], ARGV[3 * i + 2]
  local lease = redis.call('ZSCORE', K_LEASED, member)
  if lease and tonumber(lease) > now then
    out[i] = 2
  elseif redis.call('GET', pprefix .. member) ~= seen then
    out[i] = 0
  else
    redis.call('SET', pprefix .. member, new)
    out[i] = 1
  end
end
return out
