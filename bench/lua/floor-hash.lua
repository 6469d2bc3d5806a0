-- The least a decision script does per call if a tenant's buckets were
-- fields of one hash (a layout Tollgate does not use; see BENCHMARKS.md,
-- "Redis's own CPU per decision"): read every bucket with one HMGET,
-- write all with one HSET, reply one value per decision. Driven by
-- scripts/script-cost like lua/token_bucket.lua, with the call's keys as
-- the fields of one hash:
--
--   SCRIPT=bench/lua/floor-hash.lua SHAPE=buckets scripts/script-cost
local hash = 'tollgate:{bench}:h'
local raw = redis.call('HMGET', hash, unpack(KEYS))
local write = { hash }
for i = 1, #KEYS do
  write[2 * i] = KEYS[i]
  write[2 * i + 1] = raw[i] or '0'
end
redis.call('HSET', unpack(write))
local out = {}
for i = 1, #KEYS - 1 do
  out[i] = 1
end
return out
