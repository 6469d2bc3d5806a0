--[[
shares.lua: report one member's demand to a share table and answer its
grant, atomically.

A share table divides one bucket's limit among the members that enforce it
themselves (Envoys subscribed to a quota bucket, through any Tollgate
instance). The same arithmetic as crates/core/src/store/shares.rs
(`grant`); the store contract suite runs both and requires the same grants.

KEYS[1]   the table, a hash `PREFIX{TAG}:sh:SCOPE:RESOURCE:KEY` beside the
          bucket it divides (same hash tag, so one Redis Cluster slot);
          field: member, value: "WEIGHT:PPM:EXPIRES_AT" (µs, Redis's clock)
ARGV[1]   the member (at most 64 bytes)
ARGV[2]   its weight, 1 to 10^9 (its demand)
ARGV[3]   TTL, µs: how long its entry (and grant) stays counted; 0 removes
          the member
ARGV[4]   most members the table holds
ARGV[5]   "now" in µs, or empty for Redis's own clock (TIME): every
          instance then uses the one clock of the Redis holding the table

Returns { ppm, members, full, waiting }: the member's grant in parts per
million of the limit, the members counted (this one included, unless the
table was full), 1 when the table was full and the member is not in it,
and 1 when the grant is short of the member's fair part by more than a
tenth (the others hold the rest until they report).

A script, not MULTI: the grant depends on every other member's entry,
read, pruned and written in one step.
]]

local PPM = 1000000

local key = KEYS[1]
local member = ARGV[1]
local weight = tonumber(ARGV[2])
local ttl = tonumber(ARGV[3])
local max_members = tonumber(ARGV[4])
local now = tonumber(ARGV[5])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local all = redis.call('HGETALL', key)
local total, others, members, current = weight, 0, 1, nil
local latest = now + ttl
local expired = {}
for i = 1, #all, 2 do
  local m = all[i]
  local w, p, e = string.match(all[i + 1], '^(%d+):(%d+):(%d+)$')
  w, p, e = tonumber(w), tonumber(p), tonumber(e)
  if not e or e <= now then
    expired[#expired + 1] = m
  elseif m == member then
    current = p
  else
    total = total + w
    others = others + p
    members = members + 1
    if e > latest then
      latest = e
    end
  end
end
-- HDEL in chunks: unpack has a limit on its values.
for i = 1, #expired, 1000 do
  redis.call('HDEL', key, unpack(expired, i, math.min(i + 999, #expired)))
end

if ttl <= 0 then
  redis.call('HDEL', key, member)
  return { 0, members - 1, 0, 0 }
end
if current == nil and members > max_members then
  return { 0, members - 1, 1, 0 }
end

local fair = math.floor(weight * PPM / total)
if fair > PPM then
  fair = PPM
end
local room = PPM - others
if room < 0 then
  room = 0
end
local grant
if current ~= nil and current <= room and math.abs(fair - current) * 10 <= current then
  grant = current
else
  grant = math.min(fair, room)
end

redis.call('HSET', key, member, string.format('%d:%d:%d', weight, grant, now + ttl))
-- The table lives as long as its longest-lived member.
redis.call('PEXPIRE', key, math.floor((latest - now) / 1000) + 1000)
local waiting = 0
if grant * 10 < fair * 9 then
  waiting = 1
end
return { grant, members, 0, waiting }
