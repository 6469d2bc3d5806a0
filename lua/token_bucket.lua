--[[
token_bucket.lua: decide one request against all of its buckets, atomically.

The same arithmetic as src/bucket.rs (`decide` and `plan`); the differential
test in tests/redis_store.rs feeds both the same random sequences and requires
identical answers.

KEYS[i]   the i-th bucket, `PREFIX{TAG}:SCOPE:RESOURCE:KEY`. Every key of one
          call shares the hash tag, so the script runs on one Redis Cluster
          slot.
ARGV[1]   "now" in microseconds since the Unix epoch, or "" to read Redis's
          own clock (TIME). Production passes "": every instance then uses
          the one clock of the Redis that holds the bucket, so instances with
          skewed clocks still agree. Tests pass a value to control time.
ARGV[2]   "1" to spend when allowed, "0" for a dry run.
ARGV[3]   the expiry margin in milliseconds added to each bucket's TTL.
then four per key, for key i at ARGV[4 + 4(i-1)] ...:
          interval  microseconds to refill one token (>= 1)
          burst     capacity in tokens (>= 1)
          cost      tokens to spend (>= 1)
          enforce   "1" for an enforced rule, "0" for a shadow rule

Stored value per bucket: the string "FULL_AT:INTERVAL:BURST", the instant (µs)
the bucket is full again and the limit it was written under. A missing key is
a full bucket. The key expires (PEXPIRE) when the bucket is full again, plus
the margin, so Redis holds only active buckets.

Returns an array: { allowed, now, then four per key: allowed, remaining,
retry_after, reset_after }, with allowed as 1/0 and times in microseconds;
retry_after is -1 when the cost exceeds the capacity (it can never pass).

The request is allowed when every enforced bucket admits its cost. Only then
(and only when spending) is anything written: each admitting bucket,
shadow ones included. Otherwise nothing changes, and buckets that would have
admitted the cost report what they hold now.

Why a script and not MULTI/EXEC: the decision needs to read every bucket,
decide, then write only if all of them admit. MULTI cannot branch on what it
read, and WATCH-based optimistic retries would collapse under contention on a
hot key. The script is one round trip and runs atomically.

Numbers are Lua doubles; every value stays below 2^53 (Tollgate refuses limits
whose refill time exceeds 100 years), so the integer arithmetic is exact.
Division goes through floor_div/ceil_div, which correct the rounding of `/`.
]]

local function floor_div(a, b)
  local q = math.floor(a / b)
  if q * b > a then
    q = q - 1
  elseif (q + 1) * b <= a then
    q = q + 1
  end
  return q
end

local function ceil_div(a, b)
  local q = floor_div(a, b)
  if q * b < a then
    q = q + 1
  end
  return q
end

local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[1])
end
local spend = ARGV[2] == '1'
local margin_ms = tonumber(ARGV[3])

local n = #KEYS
local interval, burst, cost, enforce = {}, {}, {}, {}
local allowed, remaining, retry, reset, full_at = {}, {}, {}, {}, {}
local all_allowed = true

for i = 1, n do
  local a = 4 + (i - 1) * 4
  interval[i] = tonumber(ARGV[a])
  burst[i] = tonumber(ARGV[a + 1])
  cost[i] = tonumber(ARGV[a + 2])
  enforce[i] = ARGV[a + 3] == '1'
  local tolerance = burst[i] * interval[i]

  -- The debt: time until full, carried into this limit's terms.
  local debt = 0
  local stored = redis.call('GET', KEYS[i])
  if stored then
    local f, si, sb = string.match(stored, '^(%d+):(%d+):(%d+)$')
    if f then
      f, si, sb = tonumber(f), tonumber(si), tonumber(sb)
      debt = math.max(f - now, 0)
      if si ~= interval[i] or sb ~= burst[i] then
        -- The limit changed: spent tokens stay spent, clamped to the new burst.
        debt = math.min(ceil_div(debt, math.max(si, 1)) * interval[i], tolerance)
      end
    end
  end

  local debt_after = debt + cost[i] * interval[i]
  if cost[i] > burst[i] then
    allowed[i] = false
    remaining[i] = floor_div(math.max(tolerance - debt, 0), interval[i])
    retry[i] = -1
    reset[i] = debt
  elseif debt_after <= tolerance then
    allowed[i] = true
    remaining[i] = floor_div(tolerance - debt_after, interval[i])
    retry[i] = 0
    reset[i] = debt_after
    full_at[i] = now + debt_after
  else
    allowed[i] = false
    remaining[i] = floor_div(math.max(tolerance - debt, 0), interval[i])
    retry[i] = debt_after - tolerance
    reset[i] = debt
  end
  if enforce[i] and not allowed[i] then
    all_allowed = false
  end
end

if all_allowed and spend then
  for i = 1, n do
    if allowed[i] then
      local ttl_ms = ceil_div(reset[i], 1000) + margin_ms
      redis.call('SET', KEYS[i], string.format('%d:%d:%d', full_at[i], interval[i], burst[i]), 'PX', ttl_ms)
    end
  end
elseif not all_allowed then
  -- Nothing is spent: report what the admitting buckets hold now.
  for i = 1, n do
    if allowed[i] then
      remaining[i] = remaining[i] + cost[i]
      reset[i] = reset[i] - cost[i] * interval[i]
    end
  end
end

local out = { all_allowed and 1 or 0, now }
for i = 1, n do
  out[#out + 1] = allowed[i] and 1 or 0
  out[#out + 1] = remaining[i]
  out[#out + 1] = retry[i]
  out[#out + 1] = reset[i]
end
return out
