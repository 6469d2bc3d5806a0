-- The least a decision script does per call on Tollgate's layout (one key
-- per bucket), with no decision in it: read every key with one MGET,
-- write each back with SET ... KEEPTTL (as the usual call writes a bucket
-- whose expiry stays), reply one value per decision. scripts/script-cost
-- drives it like lua/token_bucket.lua (SHAPE=buckets: the last key is the
-- tenant's ceiling, shared by every decision of the call), so what
-- token_bucket.lua costs above it is the deciding itself:
--
--   SCRIPT=bench/lua/floor-keys.lua SHAPE=buckets scripts/script-cost
local raw = redis.call('MGET', unpack(KEYS))
for i = 1, #KEYS do
  redis.call('SET', KEYS[i], raw[i] or '0', 'KEEPTTL')
end
local out = {}
for i = 1, #KEYS - 1 do
  out[i] = 1
end
return out
