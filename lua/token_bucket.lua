--[[
token_bucket.lua: decide requests against all of their buckets, atomically.

One call decides one request or, when Tollgate coalesces concurrent
decisions, several requests one after another (each all-or-nothing on its
own, each seeing what the earlier ones wrote), all at the same instant.
Every bucket of the call is read with one MGET before the first decision.

The same arithmetic as src/algorithm/token_bucket.rs (`decide`), plan.rs (`plan`) and window.rs
(fixed and sliding windows); the differential test in tests/redis_store.rs
feeds both the same random sequences and requires identical answers.

KEYS[i]   the i-th bucket, `PREFIX{TAG}:SCOPE:RESOURCE:KEY`, the requests'
          buckets in request order. Every key of one call shares the hash
          tag, so the script runs on one Redis Cluster slot.
ARGV[1]   "now" in microseconds since the Unix epoch, or "" to read Redis's
          own clock (TIME). Production passes "": every instance then uses
          the one clock of the Redis that holds the bucket, so instances with
          skewed clocks still agree. Tests pass a value to control time.
ARGV[2]   the requests: for each, its number of keys and "s" to spend when
          allowed or "d" for a dry run, comma-separated ("2s" is one
          request of two buckets; "2s,1d,1s" three requests over 4 keys).
ARGV[3]   the expiry margin in milliseconds added to each bucket's TTL.
then five per key, for key i at ARGV[4 + 5(i-1)] ...:
          algorithm "t" token bucket, "f" fixed window, "s" sliding window
          interval  token bucket: µs to refill one token; windows: the
                    window length in µs (a whole number of milliseconds)
          burst     token bucket: capacity; windows: requests per window
          cost      tokens to spend (>= 1)
          enforce   "1" for an enforced rule, "0" for a shadow rule

Stored value per key: for a token bucket "FULL_AT:INTERVAL:BURST", the instant
(µs) the bucket is full again and the limit it was written under; for a
window "w:START:COUNT:PREVIOUS", the window's start, its count and the
previous window's count. A missing key is a full bucket or an empty window; a
value of the other kind (the rule changed algorithm) counts as missing. Each
key expires (SET ... PX) when its state no longer matters (the bucket is full,
the window is over), plus the margin, so Redis holds only active buckets.

Returns an array: { now, then per request: allowed, then four per key of
that request: allowed, remaining, retry_after, reset_after }, with allowed
as 1/0 and times in microseconds; retry_after is -1 when the cost exceeds
the capacity (it can never pass).
Windows are aligned to the Unix epoch.

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

-- Token bucket. Returns allowed, remaining, retry_after, reset_after, and
-- when allowed the value to store and its lifetime (µs). `limit` is
-- "INTERVAL:BURST" as the caller wrote them, so that the usual case (the
-- limit did not change) compares one string instead of converting numbers.
local function decide_tokens(stored, now, interval, burst, cost, limit)
  local tolerance = burst * interval
  local debt = 0
  if stored then
    local f, rest = string.match(stored, '^(%d+):(%d+:%d+)$')
    if f then
      debt = math.max(tonumber(f) - now, 0)
      if rest ~= limit then
        -- The limit changed: spent tokens stay spent, clamped to the new burst.
        local si = tonumber(string.match(rest, '^%d+'))
        debt = math.min(ceil_div(debt, math.max(si, 1)) * interval, tolerance)
      end
    end
  end
  local debt_after = debt + cost * interval
  if debt_after <= tolerance then
    local value = string.format('%d:%s', now + debt_after, limit)
    return true, floor_div(tolerance - debt_after, interval), 0, debt_after, value, debt_after
  end
  return false, floor_div(math.max(tolerance - debt, 0), interval), debt_after - tolerance, debt
end

-- Fixed (sliding = false) or sliding window counter.
local function decide_window(stored, now, sliding, window, max, cost)
  local start = floor_div(now, window) * window
  local count, prev = 0, 0
  if stored then
    local s, c, p = string.match(stored, '^w:(%d+):(%d+):(%d+)$')
    if s then
      s, c, p = tonumber(s), tonumber(c), tonumber(p)
      if s > start then
        -- The clock went back: keep the stored window.
        start, count, prev, now = s, c, p, s
      elseif s == start then
        count, prev = c, p
      elseif s + window == start then
        count, prev = 0, c
      end
    end
  end
  local w = window / 1000
  local weighted = 0
  if sliding then
    weighted = ceil_div(prev * (w - floor_div(now - start, 1000)), w)
  else
    prev = 0
  end
  local used = count + weighted
  local idle = start + (sliding and 2 * window or window)
  local function reset(c)
    if c == 0 and (not sliding or prev == 0) then
      return 0
    elseif not sliding or c == 0 then
      return start + window - now
    end
    return start + 2 * window - now
  end
  if used + cost <= max then
    local c = count + cost
    return true, max - used - cost, 0, reset(c), string.format('w:%d:%d:%d', start, c, prev), idle - now
  end
  local retry_at = start + window
  if sliding then
    local avail = max - cost
    if count <= avail then
      retry_at = start + (w - floor_div((avail - count) * w, prev)) * 1000
    else
      retry_at = start + window + (w - floor_div(avail * w, count)) * 1000
    end
  end
  return false, math.max(max - used, 0), retry_at - now, reset(count)
end

-- Decides the bucket of key k (whose ARGV fields start at `a`, with the
-- interval and burst already read) for `cost`.
local function decide(stored, now, a, interval, burst, cost)
  if ARGV[a] == 't' then
    return decide_tokens(stored, now, interval, burst, cost, ARGV[a + 1] .. ':' .. ARGV[a + 2])
  end
  return decide_window(stored, now, ARGV[a] == 's', interval, burst, cost)
end

-- A cost from ARGV: "1" is by far the most common, and comparing interned
-- strings is cheaper than converting.
local function read_cost(s)
  if s == '1' then
    return 1
  end
  return tonumber(s)
end

local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[1])
end
local margin_ms = tonumber(ARGV[3])

-- What every bucket of the call held when it started, read with one MGET
-- (a few for very large calls: unpack has a limit): a call of twenty
-- coalesced decisions or a batch of a hundred items pays one command's
-- overhead, not one per request or per item.
local function read_all()
  local stored, i = {}, 1
  while i <= #KEYS do
    local j = math.min(i + 3999, #KEYS)
    local part = redis.call('MGET', unpack(KEYS, i, j))
    if i == 1 and j == #KEYS then
      return part
    end
    for x = 1, #part do
      stored[i + x - 1] = part[x]
    end
    i = j + 1
  end
  return stored
end

-- Decides the request whose keys are KEYS[first .. first + n - 1] and
-- appends its answer to `out`. `stored` is read_all()'s snapshot and
-- `written` what earlier requests of this call stored since (key -> value),
-- which this one must see. (Plain arrays and no table per key: a batch call
-- decides thousands of keys, and each table is garbage to collect.)
local function decide_request(first, n, spend, out, snapshot, written)
  local stored, allowed, remaining, retry, reset, value, ttl = {}, {}, {}, {}, {}, {}, {}
  local all_allowed = true

  for i = 1, n do
    local k = first + i - 1
    stored[i] = written[KEYS[k]]
    if stored[i] == nil then
      stored[i] = snapshot[k]
    end
    local a = 4 + (k - 1) * 5
    local interval, burst, cost = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), read_cost(ARGV[a + 3])
    if cost > burst then
      -- It can never pass: report what the bucket holds, and "never".
      local _, rem, _, rst = decide(stored[i], now, a, interval, burst, 0)
      allowed[i], remaining[i], retry[i], reset[i] = false, rem, -1, rst
    else
      allowed[i], remaining[i], retry[i], reset[i], value[i], ttl[i] =
        decide(stored[i], now, a, interval, burst, cost)
    end
    if not allowed[i] and ARGV[a + 4] == '1' then
      all_allowed = false
    end
  end

  if all_allowed and spend then
    for i = 1, n do
      if allowed[i] then
        -- PX as an integer string: Lua would otherwise print the number
        -- with "%.14g", which costs more than the SET itself.
        local key = KEYS[first + i - 1]
        redis.call('SET', key, value[i], 'PX', string.format('%d', ceil_div(ttl[i], 1000) + margin_ms))
        written[key] = value[i]
      end
    end
  elseif not all_allowed then
    -- Nothing is spent: report what the admitting buckets hold now.
    for i = 1, n do
      if allowed[i] then
        local a = 4 + (first + i - 2) * 5
        local _, rem, _, rst = decide(stored[i], now, a, tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), 0)
        remaining[i], reset[i] = rem, rst
      end
    end
  end

  local o = #out
  out[o + 1] = all_allowed and 1 or 0
  for i = 1, n do
    local j = o + 2 + (i - 1) * 4
    out[j] = allowed[i] and 1 or 0
    out[j + 1] = remaining[i]
    out[j + 2] = retry[i]
    out[j + 3] = reset[i]
  end
end

-- Read the whole request list before deciding anything, so a malformed
-- call writes nothing.
local requests, total = {}, 0
for n, mode in string.gmatch(ARGV[2], '(%d+)([sd])') do
  requests[#requests + 1] = { tonumber(n), mode == 's' }
  total = total + tonumber(n)
end
if total ~= #KEYS or #requests == 0 then
  return redis.error_reply('token_bucket.lua: ARGV[2] ' .. ARGV[2] .. ' covers ' .. total ..
    ' keys, but the call has ' .. #KEYS)
end

local stored, written = read_all(), {}
local out = { now }
local first = 1
for _, r in ipairs(requests) do
  decide_request(first, r[1], r[2], out, stored, written)
  first = first + r[1]
end
return out
