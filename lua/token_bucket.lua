--[[
token_bucket.lua: decide requests against all of their buckets, atomically.

One call decides one request or, when Tollgate coalesces concurrent
decisions, several requests one after another (each all-or-nothing on its
own, each seeing what the earlier ones wrote), all at the same instant.
Every bucket of the call is read with one MGET before the first decision.

This header describes the general form of a call. The usual call (every
request spends, every bucket a token bucket) comes in a compact form of its
own, ARGV[2] starting with "=": it is described where it is decided, below
the clock's reading, and crates/core/src/store/redis/usual.rs writes it.

The same arithmetic as src/algorithm/token_bucket.rs (`decide`), plan.rs (`plan`) and window.rs
(fixed and sliding windows); the differential test in tests/redis_store.rs
feeds both the same random sequences and requires identical answers.

KEYS      the requests' keys, in request order: each request's buckets,
          `PREFIX{TAG}:SCOPE:RESOURCE:KEY`, then for a reserve or a settle
          its record, `PREFIX{TAG}:r:NONCE`. Every key of one call shares
          the hash tag, so the script runs on one Redis Cluster slot (a
          settle reads and writes the buckets its record names: they share
          the record's tag).
ARGV[1]   "[NOW][@DEADLINE]": NOW, "now" in microseconds since the Unix
          epoch, or nothing to read Redis's own clock (TIME). Production
          passes no NOW: every instance then uses the one clock of the Redis
          that holds the bucket, so instances with skewed clocks still
          agree. Tests pass a value to control time. DEADLINE, on Redis's
          clock (µs), is when the caller stops waiting and is answered by
          policy: a call that runs at or after it (it queued behind a frozen
          or busy Redis) applies nothing and returns { -1, TIME }, so a
          request answered "store unavailable" is never charged later.
ARGV[2]   the requests, comma-separated, each its number of buckets and its
          operation:
            Ns        decide, and spend when allowed
            Nd        decide without spending (a dry run)
            Nc        charge usage after the fact, in full, into debt down
                      to each bucket's floor; never refused
            NrSINCE   refund: give each bucket its cost back, a token
                      bucket never above its capacity, a window or quota
                      only while the one counting at SINCE (µs) still
                      counts; never refused
            NvTTL     reserve: decide and spend like Ns and, when allowed,
                      write the record (its key follows the N buckets, then
                      with a CAP in ARGV[3] the tenant's record set) that
                      expires TTL µs from now (plus a grace period); the
                      record's body is this request's extra argument
            0uACTUAL  settle the record (its key is the request's only key)
                      at ACTUAL per line
            NaTTL     acquire a lease: decide and spend like Ns and, when
                      allowed, add the lease (its member is this request's
                      extra argument) to every admitting concurrency set,
                      scored by its expiry TTL µs from now, and write its
                      record (its key follows the N buckets)
            0x        release the lease whose record is the only key
            0eTTL     renew it: it expires TTL µs from now
          For example "2s,1d,1s" is three decisions over 4 keys.
ARGV[3]   "MARGIN[:CAP][j]": the expiry margin in milliseconds added to each
          bucket's TTL; CAP, when given, the most reservation records one
          tenant holds: each reserve's keys then end with the tenant's
          record set (a sorted set of its records scored by when each is
          gone, `PREFIX{TAG}:rq::`), and a reserve finding CAP records there
          decides nothing and answers, per bucket, 0, -2 and the records
          held. With "j", the call's last key is a quota journal
          (`PREFIX{TAG}:qj::`, src/store/journal.rs): each quota counter the
          call writes into a period it did not hold appends
          "o START END QUOTA PREVIOUS_START PREVIOUS_END PREVIOUS_COUNT KEY"
          to it (the previous period's fields 0 when it held none), each
          alert threshold its count reaches "a START END QUOTA PERCENT USED
          KEY", and the reply ends with how many lines the call appended.
then three per bucket, for the i-th bucket of the call (record keys do
not count) at ARGV[4 + 3(i-1)] ...:
          rule      the algorithm: "t" token bucket, "f" fixed window, "s"
                    sliding window, "q" quota, "l" concurrency cap (a sorted
                    set of leases); then "1" for an enforced rule, "0" for a shadow
                    rule; then ":DEBT" when charges after the fact may take
                    the balance DEBT tokens below zero ("t1", "l0", "t1:500")
          limit     "INTERVAL:BURST": interval, for a token bucket µs to
                    refill one token, for a window its length in µs (a whole
                    number of milliseconds); burst, a token bucket's
                    capacity, a window's requests per window, a concurrency
                    cap's most leases held at once; a quota's is
                    "LENGTH:COUNT:START[:ALERTS]", its period's length and
                    first instant (µs), its count per period, and its alert
                    thresholds in percent ("50.80.100")
          cost      tokens to spend, or "COST/NEED" when the bucket must
                    hold more than the request spends (an ask: "0/1")
          (The limit is also the stored value's suffix, so it is passed
          as written there; consecutive buckets with the same limit read
          it once.)
then one extra argument per reserve or acquire, in request order: a
reserve's record body, per bucket "ALG INTERVAL BURST DEBT COST LINES
KEYLEN\nKEY" (the charge it spends and how many lines it merges; a quota
has " START" after KEYLEN, its period's start, then " ALERTS" when it has
alert thresholds); an acquire's lease member (32 hex digits).

Stored value per bucket: for a token bucket "FULL_AT:INTERVAL:BURST", the
instant (µs) the bucket is full again and the limit it was written under;
for a window "w:START:COUNT:PREVIOUS", the window's start, its count and the
previous window's count; for a quota "q:START:COUNT:END", the period counted
(kept one period's length past its end: see apply_window). A missing key is a full bucket or an empty window; a
value of the other kind (the rule changed algorithm) counts as missing. Each
key expires (PSETEX) when its state no longer matters (the bucket is full,
the window is over), plus the margin, so Redis holds only active buckets
(the usual call, below, keeps a token bucket's expiry while it covers the
new state with half the margin to spare).
A token bucket in debt is full again later than a full refill: its balance
is below zero.

Stored per concurrency cap: a sorted set of lease members scored by their
expiry (µs); leases expired at now are removed (ZREMRANGEBYSCORE) whenever
the set is read, and the set expires with its last lease, plus the margin.
A lease is held while its expiry is after now.

Stored value per lease: "L EXPIRES_AT MEMBER\n" then per set it holds
"KEYLEN\nKEY"; once released, "R" (kept with the record's TTL, so a second
release answers "already released"). The record lives until the lease
expires plus the grace period.

Stored value per reservation: "P RESERVED_AT EXPIRES_AT MASK\n" and the
body, MASK marking with 1 the buckets the reserve spent; once settled,
"S ACTUAL ESTIMATE" (kept, with the record's TTL, so a second settle answers
what the first did).

Returns an array: { clock, then per request ... }, clock being Redis's
TIME when it was read (a deadline, or no NOW), otherwise NOW:
  decide, charge, reserve, acquire: three per bucket: 2 * balance + allowed,
          retry_after, reset_after, with allowed as 1/0, balance the whole
          tokens left (negative: the tokens owed below zero) and times in
          microseconds; retry_after is -1 when the need exceeds the
          capacity (it can never pass). For a charge, the second value is
          the tokens forgiven at the debt floor instead. The request is
          allowed when every enforced bucket is (the caller knows which
          are), so the reply does not repeat it.
  release, renew: status (1 released or renewed, 2 already released,
          3 expired, 4 unknown), and for a renew the µs until the lease
          expires now (0 otherwise).
  A concurrency cap's three values: allowed with the leases that could
          still be taken (after this one when granted), retry_after (when
          refused: until enough held leases expire for one to fit, an upper
          bound), reset_after (until every held lease has expired).
  settle: status (1 settled, 2 already settled, 3 expired, 4 unknown),
          the actual cost settled (now, or by the settle that counted), the
          estimate, the number of buckets settled, then three per bucket as
          for a charge.
Windows are aligned to the Unix epoch.

A decision is allowed when every enforced bucket holds what it needs. Only
then (and only when spending) is anything written: each admitting bucket,
shadow ones included. Otherwise nothing changes, and buckets that would have
admitted the cost report what they hold now. A charge or a settle changes
every bucket it names.

Why a script and not MULTI/EXEC: the decision needs to read every bucket,
decide, then write only if all of them admit. MULTI cannot branch on what it
read, and WATCH-based optimistic retries would collapse under contention on a
hot key. The script is one round trip and runs atomically.

Numbers are Lua doubles; every value stays below 2^53 (Tollgate refuses limits
whose refill time from the debt floor exceeds 100 years, and clamps costs),
so the integer arithmetic is exact.
Division goes through floor_div/ceil_div, which correct the rounding of `/`.
]]

-- ARGV[1] is "[NOW][@DEADLINE]". Redis's clock is read when the call has
-- no pinned now or has a deadline; a call that runs past its deadline
-- returns before anything is read or written.
local pinned, deadline = string.match(ARGV[1], '^(%d*)@?(%d*)$')
local now, clock
if pinned == '' or deadline ~= '' then
  local t = redis.call('TIME')
  clock = tonumber(t[1]) * 1000000 + tonumber(t[2])
  if deadline ~= '' and clock >= tonumber(deadline) then
    return { -1, clock }
  end
end
now = tonumber(pinned) or clock

--[[ The usual call, first and on its own, in a form of its own (ARGV[2]
starts with "="): every request decides and spends ("Ns"), every bucket is
a token bucket without a debt floor, every cost is spent as needed, and
there is no record cap and no journal. Tollgate writes it so:

KEYS      the call's bucket keys, each once, in the order first named.
ARGV[2]   "=", then bytes: L, the number of limits; then per request its
          number of buckets N (1 to 255) and per bucket three bytes: its
          key (1 to #KEYS), its limit (1 to L, plus 128 for a shadow
          bucket), its cost (0: 1 token; C: ARGV[3 + L + C]).
ARGV[3]   MARGIN, the expiry margin in milliseconds.
ARGV[4 .. 3 + L]  the limits, "INTERVAL:BURST".
ARGV[4 + L ..]    the costs other than 1.
Reply     { clock, then one value per bucket: 2 * reset_after + allowed }.
          Balance and retry_after follow from it and the bucket's limit and
          cost, which the caller knows (crates/core/src/store/redis/usual.rs): a
          bucket holds floor((BURST * INTERVAL - reset_after) / INTERVAL)
          whole tokens (negative: owed), and a refused one may retry
          reset_after + COST * INTERVAL - BURST * INTERVAL µs later, never
          when COST > BURST.

The same arithmetic as the general path below (apply_tokens, token_debt,
decide_request), exactly: the differential tests in tests/redis_store.rs
take it at nearly every spend. What makes it cheaper, in Redis's
instructions (scripts/script-cost):

- a key and a limit are sent, read and parsed once per call, not once per
  bucket: a tenant's ceiling shared by every decision of a coalesced call
  is one key, one value parsed, one write;
- one reply value per bucket instead of three;
- no function is defined before it returns (each `local function` is a
  closure allocated on every call), no table grows one entry at a time
  (the per-key tables are sized by copying MGET's reply, the per-limit ones
  made with room for two limits, and MGET's reply itself keeps each key's
  starting instant), and the loop runs a few dozen Lua instructions per
  bucket;
- each bucket it changes is written once, at the end;
- a write rarely sets the expiry: SET ... KEEPTTL keeps the one a key has
  when its new full-again instant falls in the same step of `quantum` µs
  (half the expiry margin, counted from the epoch) as the instant it held,
  and only a write that crosses into another step sets one (PSETEX, as the
  general path does; with a pinned now, whose instants are not the ones
  expiry runs on, every write does). Wherever an expiry is set, it is the
  full-again instant F0 written then plus the margin, and every later
  instant F the key holds without a new expiry is in F0's step, so the key
  still expires after F + margin - quantum = F + margin / 2: never before
  its state stops mattering (the bucket is full again at F).

Anything else, found at any point before that final write (a value
written under another limit, or of another kind), falls through to the
general path, given the call rewritten in the general form: nothing has
been written. ]]
local KEYS, ARGV = KEYS, ARGV
local usual = string.byte(ARGV[2], 1) == 61
if usual then
  repeat
    local byte, find, sub, fmt, call = string.byte, string.find, string.sub, string.format, redis.call
    local spec = ARGV[2]
    local plan = { byte(spec, 2, -1) }
    local nkeys, nlimits, margin_ms = #KEYS, plan[1], tonumber(ARGV[3])
    if not nlimits or not margin_ms or nkeys == 0 then
      break
    end
    -- Expiry runs on Redis's clock: with a pinned now (tests), whose
    -- instants are not Redis's, every write sets it.
    local quantum = 0
    if pinned == '' then
      quantum = margin_ms * 500
    end
    -- Per limit, at its index and at its index + 128 (the same limit on a
    -- shadow bucket): the stored value's suffix (":INTERVAL:BURST"), the
    -- interval and the capacity in µs. A cost above the burst needs more
    -- than the capacity, so the capacity alone decides. Each table is
    -- made with room for two limits, so that the usual one or two are
    -- stored without the table growing (an index the call has no limit
    -- for holds false).
    local lsuffix = { false, false, [129] = false, [130] = false }
    local linterval = { false, false, [129] = false, [130] = false }
    local ltolerance = { false, false, [129] = false, [130] = false }
    local bad = false
    for l = 1, nlimits do
      local limit = ARGV[3 + l]
      local i_, b_ = string.match(limit or '', '^(%d+):(%d+)$')
      if not i_ then
        bad = true
        break
      end
      local suffix, interval = ':' .. limit, tonumber(i_)
      local tolerance = interval * tonumber(b_)
      lsuffix[l], linterval[l], ltolerance[l] = suffix, interval, tolerance
      lsuffix[l + 128], linterval[l + 128], ltolerance[l + 128] = suffix, interval, tolerance
    end
    if bad then
      break
    end
    local costs = { [0] = 1 }
    for c = 1, #ARGV - 3 - nlimits do
      local cost = tonumber(ARGV[3 + nlimits + c])
      if not cost then
        bad = true
        break
      end
      costs[c] = cost
    end
    if bad then
      break
    end
    local raw = call('MGET', unpack(KEYS))
    -- Per key, each table sized once by copying `raw`: the suffix of the
    -- limit its state is held under (until first read: the raw value, or
    -- false when missing) and its full-again instant (false: none; until
    -- first read, the raw value too). `raw` itself, once a key is read,
    -- holds the instant the key held when the call started. A key is
    -- written when the two instants differ.
    local ksuffix, kfull, kheld = { unpack(raw) }, { unpack(raw) }, raw
    -- The reply, sized once by copying the first of the plan's bytes (a
    -- bucket takes three, so a third of them and one more are at least as
    -- many as the clock and the buckets) and cut after the last bucket's
    -- value.
    local out = { byte(spec, 1, 2 + (#spec - 2) / 3) }
    out[1] = clock or now
    local p, o, np = 2, 1, #plan
    while p <= np do
      local n = plan[p]
      p = p + 1
      if n == 0 then
        bad = true
        break
      end
      local first, all = p, true
      for _ = 1, n do
        local ki, lb = plan[p], plan[p + 1]
        local suffix, cost, held = lsuffix[lb], costs[plan[p + 2]], ksuffix[ki]
        p = p + 3
        if not suffix or not cost or held == nil then
          bad = true
          break
        end
        -- The full-again instant the bucket holds: as an earlier request
        -- of the call wrote it, else as the call found it.
        local f = false
        if held == suffix then
          f = kfull[ki]
        elseif held == kheld[ki] then
          if held then
            local cut = #held - #suffix
            f = cut >= 1 and find(held, suffix, cut + 1, true) and tonumber(sub(held, 1, cut))
            if not f then
              -- Written under another limit, or of another kind.
              bad = true
              break
            end
            ksuffix[ki], kfull[ki], kheld[ki] = suffix, f, f
          end
        else
          bad = true
          break
        end
        local debt = 0
        if f and f > now then
          debt = f - now
        end
        local needed = debt + cost * linterval[lb]
        o = o + 1
        if needed > ltolerance[lb] then
          out[o] = debt * 2
          if lb < 128 then
            all = false
          end
        else
          out[o] = needed * 2 + 1
          if n == 1 then
            -- The request's only bucket: spent now.
            ksuffix[ki], kfull[ki] = suffix, now + needed
          end
        end
      end
      if bad then
        break
      end
      if n > 1 then
        -- The request's buckets again, once all are decided: each admitting
        -- one spends when every enforced bucket admits, else reports what
        -- it holds (nothing is spent).
        local base = o - n
        p = first
        for j = base + 1, o do
          local v = out[j]
          if v % 2 == 1 then
            local ki = plan[p]
            if all then
              ksuffix[ki], kfull[ki] = lsuffix[plan[p + 1]], now + (v - 1) / 2
            else
              local f = kfull[ki]
              if f and f > now then
                out[j] = (f - now) * 2 + 1
              else
                out[j] = 1
              end
            end
          end
          p = p + 3
        end
      end
    end
    if bad or o == 1 then
      break
    end
    out[o + 1] = nil
    for ki = 1, nkeys do
      local full, was = kfull[ki], kheld[ki]
      if full ~= was then
        local value = fmt('%d', full) .. ksuffix[ki]
        if was and quantum > 0 and full - full % quantum == was - was % quantum then
          call('SET', KEYS[ki], value, 'KEEPTTL')
        else
          call('PSETEX', KEYS[ki], fmt('%d', (full - now - (full - now) % 1000) / 1000 + margin_ms + 1), value)
        end
      end
    end
    return out
  until true
  -- The general form of the same call: per bucket its key, rule, limit and
  -- cost; per request "Ns".
  local plan = { string.byte(ARGV[2], 2, -1) }
  local nlimits = plan[1] or 0
  local keys, argv, shape = {}, { ARGV[1], '', ARGV[3] }, {}
  local p = 2
  while p <= #plan do
    local n = plan[p]
    if n == 0 then
      return redis.error_reply('token_bucket.lua: a request in ARGV[2] has no buckets')
    end
    shape[#shape + 1] = n .. 's'
    p = p + 1
    for _ = 1, n do
      local ki, lb, ci = plan[p], plan[p + 1], plan[p + 2]
      local li = (lb or 0) % 128
      local limit, cost = ARGV[3 + li], ci and (ci == 0 and '1' or ARGV[3 + nlimits + ci])
      if not ci or not KEYS[ki] or li < 1 or li > nlimits or not cost then
        return redis.error_reply('token_bucket.lua: ARGV[2] names a key, limit or cost the call does not have')
      end
      keys[#keys + 1] = KEYS[ki]
      argv[#argv + 1] = lb >= 128 and 't0' or 't1'
      argv[#argv + 1] = limit
      argv[#argv + 1] = cost
      p = p + 3
    end
  end
  argv[2] = table.concat(shape, ',')
  KEYS, ARGV = keys, argv
end

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

-- A token bucket's debt at `now` (µs until full) from its stored value.
-- `limit` is "INTERVAL:BURST" as the caller wrote them, so that the usual
-- case (the limit did not change) compares one string instead of
-- converting numbers. On a change, spent tokens stay spent, clamped to the
-- new floor.
local function token_debt(stored, now, interval, limit, floor)
  if not stored then
    return 0
  end
  local colon = string.find(stored, ':', 1, true)
  local f = colon and tonumber(string.sub(stored, 1, colon - 1))
  if not f then
    return 0
  end
  local debt = math.max(f - now, 0)
  local rest = string.sub(stored, colon + 1)
  if rest ~= limit then
    local si = string.match(rest, '^(%d+):%d+$')
    if not si then
      return 0
    end
    debt = math.min(ceil_div(debt, math.max(tonumber(si), 1)) * interval, floor)
  end
  return debt
end

-- Whole tokens left for a debt of `debt` µs, or minus the whole tokens owed
-- below zero (rounded up).
local function token_balance(debt, tolerance, interval)
  if debt <= tolerance then
    return floor_div(tolerance - debt, interval)
  end
  return -ceil_div(debt - tolerance, interval)
end

-- Token bucket, with op 'd' (decide: spend `cost` if it holds `need`),
-- 'c' (charge `cost` in full, down to the floor) or 'r' (refund `cost`).
-- Returns allowed, balance, retry_after (a charge: tokens forgiven),
-- reset_after, and when it changes the value to store and its lifetime (µs).
local function apply_tokens(stored, now, interval, burst, debt_max, cost, need, limit, op)
  local tolerance = burst * interval
  local floor = (burst + debt_max) * interval
  local debt = token_debt(stored, now, interval, limit, floor)
  local after, third
  if op == 'd' then
    local needed = debt + need * interval
    if needed > tolerance then
      return false, token_balance(debt, tolerance, interval), needed - tolerance, debt
    end
    after, third = debt + cost * interval, 0
  else
    -- Past burst + debt + 1 tokens every amount lands on the floor (or
    -- at full): clamp first so the product stays exact.
    local capped = math.min(cost, burst + debt_max + 1)
    if op == 'c' then
      -- A charge never lowers the debt, not even one seen past the floor
      -- through a clock that stepped back.
      after = math.max(math.min(debt + capped * interval, floor), debt)
      third = cost - ceil_div(after - debt, interval)
    else
      after, third = math.max(debt - capped * interval, 0), 0
    end
  end
  return true, token_balance(after, tolerance, interval), third, after,
    string.format('%d:%s', now + after, limit), after
end

-- What the last quota apply_window saw, for the journal (note()): whether
-- the counter enters a period it did not hold (then the period it held,
-- if any: start, end, count), the count before this decision in the
-- period counted, the count after it, and that period's bounds.
local q_open, q_ps, q_pe, q_pc, q_before, q_after, q_start, q_stop = false, 0, 0, 0, 0, 0, 0, 0

-- Fixed (alg "f") or sliding ("s") window counter; a refund uncounts
-- tokens charged at `since` while that window still counts.
local function apply_window(stored, now, alg, window, max, debt_max, cost, need, op, since)
  local sliding = alg == 's'
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
  local stop = start + window
  if not sliding then
    prev = 0
  end
  if op == 'r' then
    if since >= start and since < stop then
      count = math.max(count - cost, 0)
    elseif sliding and since < start and since + window >= start then
      prev = math.max(prev - cost, 0)
    end
  end
  local w = window / 1000
  local weighted = 0
  if sliding then
    weighted = ceil_div(prev * (w - floor_div(now - start, 1000)), w)
  end
  local used = count + weighted
  local idle = sliding and stop + window or stop
  local function reset(c)
    if c == 0 and (not sliding or prev == 0) then
      return 0
    elseif not sliding or c == 0 then
      return stop - now
    end
    return stop + window - now
  end
  local third = 0
  if op == 'd' then
    if used + need > max then
      local retry_at = stop
      if sliding then
        local avail = max - need
        if count <= avail then
          retry_at = start + (w - floor_div((avail - count) * w, prev)) * 1000
        else
          retry_at = start + window + (w - floor_div(avail * w, count)) * 1000
        end
      end
      return false, max - used, retry_at - now, reset(count)
    end
    count, used = count + cost, used + cost
  elseif op == 'c' then
    local applied = math.min(cost, math.max(max + debt_max - used, 0))
    count, used, third = count + applied, used + applied, cost - applied
  end
  return true, max - used, third, reset(count), string.format('w:%d:%d:%d', start, count, prev), idle - now
end

-- A quota ("q"): a count over the period [pstart, pstart + window) the
-- caller names. A period stored that began later is counted in instead (an
-- instance whose clock runs ahead turned it already); `now` outside the
-- period counted is taken as its nearest instant; a refund uncounts tokens
-- charged at `since` only while their period counts. What it saw is left
-- in the q_* values for the journal.
local qs_start, qs_window, qs_start_s, qs_stop_s = -1, -1, '', ''
local function apply_quota(stored, now, window, max, debt_max, cost, need, op, since, pstart)
  -- The period's bounds as the stored value writes them, kept from the
  -- last call (the quotas of a call mostly share a period).
  if pstart ~= qs_start or window ~= qs_window then
    qs_start, qs_window = pstart, window
    qs_start_s, qs_stop_s = string.format('%d', pstart), string.format('%d', pstart + window)
  end
  local start, stop, count = pstart, pstart + window, 0
  local named = true
  q_open, q_ps, q_pe, q_pc = true, 0, 0, 0
  local c2 = stored and string.find(stored, ':', 3, true)
  if c2 and string.sub(stored, 3, c2 - 1) == qs_start_s then
    -- The usual case, the period named: only the count is read.
    local c3 = string.find(stored, ':', c2 + 1, true)
    count = c3 and tonumber(string.sub(stored, c2 + 1, c3 - 1)) or 0
    q_open = false
  elseif stored then
    local s, c, e = string.match(stored, '^q:(%d+):(%d+):(%d+)$')
    if s then
      s, c, e = tonumber(s), tonumber(c), tonumber(e)
      if s > start then
        start, count, stop, q_open, named = s, c, e, false, false
      elseif s == start then
        count, q_open = c, false
      else
        q_ps, q_pe, q_pc = s, e, c
      end
    end
  end
  q_before, q_start, q_stop = count, start, stop
  now = math.min(math.max(now, start), stop - 1)
  local third = 0
  if op == 'r' then
    if since >= start and since < stop then
      count = math.max(count - cost, 0)
    end
  elseif op == 'd' then
    if count + need > max then
      return false, max - count, stop - now, count == 0 and 0 or stop - now
    end
    count = count + cost
  elseif op == 'c' then
    local applied = math.min(cost, math.max(max + debt_max - count, 0))
    count, third = count + applied, cost - applied
  end
  q_after = count
  -- A counter outlives its period by one more period's length: expiry
  -- runs on Redis's clock, and a Redis clock that jumps ahead must not
  -- forget a period the instances still name.
  local value
  if named then
    -- A count below 10^14 prints exactly as a number ("%.14g").
    local c = count < 1e14 and count or string.format('%d', count)
    value = 'q:' .. qs_start_s .. ':' .. c .. ':' .. qs_stop_s
  else
    value = string.format('q:%d:%d:%d', start, count, stop)
  end
  return true, max - count, third, count == 0 and 0 or stop - now, value, stop + window - now
end

-- Applies `op` to a bucket of algorithm `alg` ("t", "f" or "s"). `limit`
-- is "INTERVAL:BURST" as written by the caller (never a number formatted
-- by Lua, which would print 1.5768e+15).
local function apply(stored, now, alg, interval, burst, debt_max, cost, need, op, since, limit, pstart)
  if alg == 't' then
    return apply_tokens(stored, now, interval, burst, debt_max, cost, need, limit, op)
  elseif alg == 'q' then
    return apply_quota(stored, now, interval, burst, debt_max, cost, need, op, since, pstart)
  end
  return apply_window(stored, now, alg, interval, burst, debt_max, cost, need, op, since)
end

-- A bucket's rule field: its algorithm's letter, then "1" (enforced) or
-- "0" (shadow), then ":DEBT" when it has a debt floor ("t1", "l0",
-- "t1:500"). Returns the letter, whether enforced, and the debt. The
-- common rule of a coalesced call, an enforced token bucket, is answered
-- without reading the field.
local function read_rule(s)
  if s == 't1' then
    return 't', true, 0
  elseif s == 'q1' then
    return 'q', true, 0
  end
  local alg = string.sub(s, 1, 1)
  if #s == 2 and string.find('tfslq', alg, 1, true) then
    return alg, string.byte(s, 2) == 49, 0
  end
  local e, d = string.match(s, '^[tfslq]([01]):(%d+)$')
  if not e then
    error('token_bucket.lua: unreadable rule field ' .. s)
  end
  return alg, e == '1', tonumber(d)
end

-- A bucket's limit field, "INTERVAL:BURST" (a quota's "LENGTH:COUNT:START[:ALERTS]"),
-- as numbers: the interval, the burst and the period's start (0 but for a
-- quota). The last one read is kept: the decisions of a call mostly repeat
-- the same rule.
local last_limit, last_interval, last_burst, last_start, last_alerts
local function read_limit(s)
  if s ~= last_limit then
    local interval, burst, start, alerts = string.match(s, '^(%d+):(%d+):?(%d*):?([%d.]*)$')
    if not interval then
      error('token_bucket.lua: unreadable limit field ' .. s)
    end
    last_limit, last_interval, last_burst = s, tonumber(interval), tonumber(burst)
    last_start, last_alerts = tonumber(start) or 0, alerts
  end
  return last_interval, last_burst, last_start, last_alerts
end

-- A cost from ARGV, "COST" or "COST/NEED": "1" is by far the most common,
-- and comparing interned strings is cheaper than converting.
local function read_cost(s)
  if s == '1' then
    return 1, 1
  end
  local c, n = string.match(s, '^(%d+)/(%d+)$')
  if c then
    return tonumber(c), math.max(tonumber(n), tonumber(c))
  end
  local v = tonumber(s)
  return v, v
end

local margin_ms, record_cap, journaled = string.match(ARGV[3], '^(%d+):?(%d*)(j?)$')
margin_ms, record_cap = tonumber(margin_ms), tonumber(record_cap)
local journal = journaled == 'j' and KEYS[#KEYS]
local noted = 0

-- Journals the write into the quota counter `key` (of `quota` per period,
-- alerting at `alerts`) that the last quota apply_window described (q_*):
-- the period it enters, if new, and each alert threshold it reaches.
local function note(key, quota, alerts, open, ps, pe, pc, before, after, start, stop)
  if open then
    redis.call('RPUSH', journal, string.format('o %d %d %d %d %d %d ', start, stop, quota, ps, pe, pc) .. key)
    noted = noted + 1
  end
  -- Each alert threshold the count reached: ceil(quota * percent / 100),
  -- computed as src/algorithm/alerts.rs does (exact in a double).
  if alerts and alerts ~= '' then
    for p in string.gmatch(alerts, '%d+') do
      p = tonumber(p)
      local level = math.floor(quota / 100) * p + ceil_div((quota % 100) * p, 100)
      if before < level and level <= after then
        redis.call('RPUSH', journal, string.format('a %d %d %d %d %d ', start, stop, quota, p, after) .. key)
        noted = noted + 1
      end
    end
  end
end


-- How long a reservation's record outlives its time to live, so that a late
-- settle is answered "expired" rather than "unknown" (src/store/reservation.rs,
-- EXPIRED_GRACE).
local EXPIRED_GRACE = 600000000

local function store(key, value, ttl)
  -- PSETEX rather than SET ... PX: one argument fewer and no options to
  -- parse, 1 % of a coalesced decision. The milliseconds as an integer
  -- string: Lua would otherwise print the number with "%.14g", which costs
  -- more than the write itself. Rounded up by at most a millisecond more
  -- than needed (cheaper than an exact ceiling).
  redis.call('PSETEX', key, string.format('%d', math.floor(ttl / 1000) + margin_ms + 1), value)
end

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

-- The value a key holds now: what an earlier request of this call wrote,
-- else the snapshot (keys of the call), else Redis (a settle's buckets).
local function current(key, k, snapshot, written)
  local v = written[key]
  if v ~= nil then
    return v
  end
  if k then
    v = snapshot[k]
  else
    v = redis.call('GET', key)
  end
  if v == false then
    return nil
  end
  return v
end

-- Appends one bucket's three reply values: its balance and whether it
-- admitted in one (2 * balance + 1 or 0), the third value, reset_after.
local function push(out, allowed, balance, third, reset)
  local o = #out
  out[o + 1] = allowed and balance * 2 + 1 or balance * 2
  out[o + 2] = third
  out[o + 3] = reset
end

-- A concurrency cap's set at `now`, pruned: leases held, when one more fits
-- under `cap` (now if one fits already), and when the last one expires.
local function occupancy(key, cap)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%d', now))
  local held = redis.call('ZCARD', key)
  if held == 0 then
    return 0, now, now
  end
  local free_at = now
  if held >= cap then
    free_at = tonumber(redis.call('ZRANGE', key, held - cap, held - cap, 'WITHSCORES')[2])
  end
  local last = tonumber(redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2])
  return held, free_at, last
end

-- Decides a lease of `need` slots on a concurrency cap (src/algorithm/
-- concurrency.rs, `decide`); `grant` is the new lease's expiry when the
-- decision takes one. Returns allowed, slots left, retry_after,
-- reset_after, and when granting the instant the set's last lease expires.
local function apply_leases(key, cap, need, grant)
  local held, free_at, last = occupancy(key, cap)
  if need > cap then
    return false, math.max(cap - held, 0), -1, last - now
  end
  if held + need > cap then
    return false, math.max(cap - held, 0), math.max(free_at - now, 1), last - now
  end
  local taken, all_free = 0, last
  if grant then
    taken, all_free = math.min(1, need), math.max(last, grant)
  end
  return true, cap - held - taken, 0, all_free - now, all_free
end

-- A PX/PEXPIRE argument for `us` µs from now, plus the margin.
local function px(us)
  return string.format('%d', math.max(ceil_div(us, 1000) + margin_ms, 1))
end

-- Decides (op 'd'), charges (op 'c') or refunds (op 'r', tokens charged
-- at `since`) the request whose keys are
-- KEYS[first .. first + n - 1] and whose fields start at bucket `b`, and
-- appends its answer to `out`. `snapshot` is read_all()'s and `written`
-- what earlier requests of this call stored since (key -> value), which
-- this one must see. An acquire passes `grant`, its lease's expiry, and
-- `member`: the lease is added to every admitting concurrency set.
-- Returns whether it was allowed. (Plain arrays and no
-- table per key: a batch call decides thousands of keys, and each table is
-- garbage to collect.)
-- Per bucket of the request being decided, SLOTS values at these offsets:
-- whether it admits, the value to store and its lifetime (µs), the value it
-- held, its algorithm. One table for every request of the call: each table
-- is an allocation, and garbage to collect.
local scratch = {}
local SLOTS, ADMITS, VALUE, TTL, HELD, ALG = 15, 1, 2, 3, 4, 5
-- A quota's, for the journal: burst, alerts, then the q_* of its decision.
local QBURST, QALERTS, QOPEN, QPS, QPE, QPC, QBEFORE, QAFTER, QSTART, QSTOP = 6, 7, 8, 9, 10, 11, 12, 13, 14, 15

local function decide_request(first, n, b, op, spend, out, snapshot, written, grant, member, since)
  local all_allowed = true
  local o = #out
  for i = 1, n do
    local k, x = first + i - 1, (i - 1) * SLOTS
    -- What an earlier request of the call wrote, else the snapshot.
    local held = written[KEYS[k]]
    if held == nil then
      held = snapshot[k]
    end
    held = held or nil
    local a = 4 + (b + i - 2) * 3
    local alg, enforced, debt_max = read_rule(ARGV[a])
    local limit = ARGV[a + 1]
    local interval, burst, pstart, alerts = read_limit(limit)
    local cost, need = read_cost(ARGV[a + 2])
    local ok, balance, third, reset, value, ttl
    if alg == 'l' then
      -- A concurrency cap: only an acquire takes a slot; a charge or a
      -- refund only reports.
      if op ~= 'd' then
        need = 0
      end
      ok, balance, third, reset, ttl = apply_leases(KEYS[k], burst, need, grant)
    elseif op == 'd' and need > burst then
      -- It can never pass: report what the bucket holds, and "never".
      local _
      _, balance, _, reset = apply(held, now, alg, interval, burst, debt_max, 0, 0, 'd', 0, limit, pstart)
      ok, third = false, -1
    elseif alg == 't' then
      ok, balance, third, reset, value, ttl = apply_tokens(held, now, interval, burst, debt_max, cost, need, limit,
        op)
    else
      ok, balance, third, reset, value, ttl = apply(held, now, alg, interval, burst, debt_max, cost, need, op,
        since or 0, limit, pstart)
      if alg == 'q' and journal then
        if q_open or alerts ~= '' then
          scratch[x + QBURST], scratch[x + QALERTS], scratch[x + QOPEN], scratch[x + QPS], scratch[x + QPE] =
            burst, alerts, q_open, q_ps, q_pe
          scratch[x + QPC], scratch[x + QBEFORE], scratch[x + QAFTER], scratch[x + QSTART], scratch[x + QSTOP] =
            q_pc, q_before, q_after, q_start, q_stop
        else
          -- The usual case: the period held before, no thresholds.
          scratch[x + QOPEN], scratch[x + QALERTS] = false, ''
        end
      end
    end
    if not ok and enforced then
      all_allowed = false
    end
    scratch[x + ADMITS], scratch[x + VALUE], scratch[x + TTL], scratch[x + HELD], scratch[x + ALG] =
      ok, value, ttl, held, alg
    -- The reply's three values (push(), inlined: this runs for every
    -- bucket of every decision).
    out[o + 1] = ok and balance * 2 + 1 or balance * 2
    out[o + 2] = third
    out[o + 3] = reset
    o = o + 3
  end

  if all_allowed and spend then
    for i = 1, n do
      local x = (i - 1) * SLOTS
      if scratch[x + ADMITS] then
        local key = KEYS[first + i - 1]
        if scratch[x + ALG] == 'l' then
          if grant then
            redis.call('ZADD', key, string.format('%d', grant), member)
            redis.call('PEXPIRE', key, px(scratch[x + TTL] - now))
          end
        else
          store(key, scratch[x + VALUE], scratch[x + TTL])
          written[key] = scratch[x + VALUE]
          if journal and scratch[x + ALG] == 'q' and (scratch[x + QOPEN] or scratch[x + QALERTS] ~= '') then
            note(key, scratch[x + QBURST], scratch[x + QALERTS], scratch[x + QOPEN], scratch[x + QPS],
              scratch[x + QPE], scratch[x + QPC], scratch[x + QBEFORE], scratch[x + QAFTER], scratch[x + QSTART],
              scratch[x + QSTOP])
          end
        end
      end
    end
  elseif not all_allowed then
    -- Nothing is spent: report what the admitting buckets hold now.
    o = #out - 3 * n
    for i = 1, n do
      local x = (i - 1) * SLOTS
      if scratch[x + ADMITS] then
        local a = 4 + (b + i - 2) * 3
        local alg, _, debt_max = read_rule(ARGV[a])
        local interval, burst, pstart = read_limit(ARGV[a + 1])
        local balance, reset
        if alg == 'l' then
          _, balance, _, reset = apply_leases(KEYS[first + i - 1], burst, 0, nil)
        else
          _, balance, _, reset = apply(scratch[x + HELD], now, alg, interval, burst, debt_max, 0, 0, 'd', 0,
            ARGV[a + 1], pstart)
        end
        out[o + 3 * i - 2] = balance * 2 + 1
        out[o + 3 * i] = reset
      end
    end
  end
  return all_allowed
end

-- Writes the record of a reservation admitted at `now` for `ttl` µs:
-- which of the request's `n` buckets it charged (those that admitted), then
-- `body` (the charges, as Tollgate wrote them). With `records`, the
-- tenant's set of records, scored by when each is gone, holds it too.
-- `written` learns the record, as it learns every value the call stores.
local function write_reservation(record, n, ttl, body, records, written)
  local mask = {}
  for i = 1, n do
    mask[i] = scratch[(i - 1) * SLOTS + ADMITS] and '1' or '0'
  end
  local value = string.format('P %d %d %s\n', now, now + ttl, table.concat(mask)) .. body
  store(record, value, ttl + EXPIRED_GRACE)
  written[record] = value
  if records then
    redis.call('ZADD', records, now + ttl + EXPIRED_GRACE, record)
    local ms = math.floor((ttl + EXPIRED_GRACE) / 1000) + margin_ms + 1
    if redis.call('PTTL', records) < ms then
      redis.call('PEXPIRE', records, ms)
    end
  end
end

-- Writes the record of a lease granted until `grant` as `member`: the
-- concurrency sets among the request's `n` buckets (KEYS[first ..]) that
-- took it. None (every cap was shadow and full): no record.
local function write_lease(record, first, n, ttl, grant, member, written)
  local sets = {}
  for i = 1, n do
    local key = KEYS[first + i - 1]
    local x = (i - 1) * SLOTS
    if scratch[x + ADMITS] and scratch[x + ALG] == 'l' then
      sets[#sets + 1] = string.format('%d\n', #key) .. key
    end
  end
  if #sets > 0 then
    local value = string.format('L %d %s\n', grant, member) .. table.concat(sets)
    store(record, value, ttl + EXPIRED_GRACE)
    written[record] = value
  end
end

-- Settles the reservation whose record is `key` at `actual` per line.
-- Appends status (1 settled, 2 already settled, 3 expired, 4 unknown), the
-- actual cost settled, the estimate, the number of buckets, and three values
-- per bucket settled. Returns an error reply for an unreadable record,
-- before changing anything.
local function settle(key, actual, out, written)
  local record = current(key, nil, nil, written)
  local o = #out
  if not record then
    out[o + 1], out[o + 2], out[o + 3], out[o + 4] = 4, 0, 0, 0
    return
  end
  local done, estimate_done = string.match(record, '^S (%d+) (%d+)$')
  if done then
    out[o + 1], out[o + 2], out[o + 3], out[o + 4] = 2, tonumber(done), tonumber(estimate_done), 0
    return
  end
  local unreadable = redis.error_reply('token_bucket.lua: reservation ' .. key .. ' holds an unreadable record')
  local reserved_at, expires_at, mask, estimate, pos = string.match(record, '^P (%d+) (%d+) ([01]*)\n(%d+)\n()')
  if not reserved_at then
    return unreadable
  end
  reserved_at, expires_at, estimate = tonumber(reserved_at), tonumber(expires_at), tonumber(estimate)
  if now >= expires_at then
    out[o + 1], out[o + 2], out[o + 3], out[o + 4] = 3, 0, estimate, 0
    return
  end
  -- Parse every entry before changing anything.
  local entries = {}
  for i = 1, #mask do
    local alg, interval, burst, debt_max, cost, lines, len, pstart, alerts, at = string.match(record,
      '^([tfsq]) (%d+) (%d+) (%d+) (%d+) (%d+) (%d+) ?(%d*) ?([%d.]*)\n()', pos)
    if not alg then
      return unreadable
    end
    len = tonumber(len)
    pos = at + len
    if string.sub(mask, i, i) == '1' then
      entries[#entries + 1] = { alg, tonumber(interval), tonumber(burst), tonumber(debt_max), tonumber(cost),
        tonumber(lines), string.sub(record, at, at + len - 1), interval .. ':' .. burst, tonumber(pstart) or 0,
        alerts }
    end
  end
  out[o + 1], out[o + 2], out[o + 3], out[o + 4] = 1, actual, estimate, #entries
  for _, e in ipairs(entries) do
    local alg, interval, burst, debt_max, cost, lines, bucket, limit = e[1], e[2], e[3], e[4], e[5], e[6], e[7], e[8]
    local pstart = e[9]
    local target = math.min(lines * actual, 9007199254740992)
    local stored = current(bucket, nil, nil, written)
    local ok, bal, third, rst, value, ttl
    if target > cost then
      ok, bal, third, rst, value, ttl = apply(stored, now, alg, interval, burst, debt_max, target - cost, 0, 'c', 0,
        limit, pstart)
    elseif target < cost then
      ok, bal, third, rst, value, ttl = apply(stored, now, alg, interval, burst, debt_max, cost - target, 0, 'r',
        reserved_at, limit, pstart)
    else
      ok, bal, third, rst = apply(stored, now, alg, interval, burst, debt_max, 0, 0, 'd', 0, limit, pstart)
    end
    if value then
      store(bucket, value, ttl)
      written[bucket] = value
      if journal and alg == 'q' then
        note(bucket, burst, e[10], q_open, q_ps, q_pe, q_pc, q_before, q_after, q_start, q_stop)
      end
    end
    push(out, ok, bal, third, rst)
  end
  local value = string.format('S %d %d', actual, estimate)
  redis.call('SET', key, value, 'KEEPTTL')
  written[key] = value
end

-- Releases (mode 'x') or renews for `ttl` µs (mode 'e') the lease whose
-- record is `key`. Appends status (1 done, 2 already released, 3 expired,
-- 4 unknown) and, renewed, the µs until it expires. Returns an error reply
-- for an unreadable record, before changing anything.
local function lease_op(key, mode, ttl, out, written)
  local record = current(key, nil, nil, written)
  local o = #out
  out[o + 2] = 0
  if not record then
    out[o + 1] = 4
    return
  end
  if record == 'R' then
    out[o + 1] = 2
    return
  end
  local unreadable = redis.error_reply('token_bucket.lua: lease ' .. key .. ' holds an unreadable record')
  local expires_at, member, pos = string.match(record, '^L (%d+) (%x+)\n()')
  if not expires_at then
    return unreadable
  end
  if now >= tonumber(expires_at) then
    out[o + 1] = 3
    return
  end
  local body = string.sub(record, pos)
  local sets = {}
  while pos <= #record do
    local len, at = string.match(record, '^(%d+)\n()', pos)
    if not len then
      return unreadable
    end
    sets[#sets + 1] = string.sub(record, at, at + tonumber(len) - 1)
    pos = at + tonumber(len)
  end
  out[o + 1] = 1
  if mode == 'x' then
    for _, set in ipairs(sets) do
      redis.call('ZREM', set, member)
    end
    redis.call('SET', key, 'R', 'KEEPTTL')
    written[key] = 'R'
    return
  end
  local expires = now + ttl
  for _, set in ipairs(sets) do
    redis.call('ZADD', set, string.format('%d', expires), member)
    local last = tonumber(redis.call('ZRANGE', set, -1, -1, 'WITHSCORES')[2])
    redis.call('PEXPIRE', set, px(last - now))
  end
  local value = string.format('L %d %s\n', expires, member) .. body
  store(key, value, ttl + EXPIRED_GRACE)
  written[key] = value
  out[o + 2] = ttl
end

-- Read the whole request list before deciding anything, so a malformed
-- call writes nothing.
-- (Three slots per request in one array: each table is an allocation.)
local requests, count, keys, buckets = {}, 0, 0, 0
for n, mode, arg in string.gmatch(ARGV[2], '(%d+)([sdcrvuaxe])(%d*)') do
  n = tonumber(n)
  requests[count * 3 + 1], requests[count * 3 + 2], requests[count * 3 + 3] = n, mode, tonumber(arg) or 0
  count = count + 1
  keys = keys + n
  buckets = buckets + n
  if mode ~= 's' and mode ~= 'd' and mode ~= 'c' and mode ~= 'r' then
    keys = keys + 1
  end
  if mode == 'v' and record_cap then
    keys = keys + 1
  end
end
if journal then
  keys = keys + 1
end
if keys ~= #KEYS or count == 0 then
  return redis.error_reply('token_bucket.lua: ARGV[2] ' .. ARGV[2] .. ' covers ' .. keys ..
    ' keys, but the call has ' .. #KEYS)
end

local snapshot, written = read_all(), {}
local out = { clock or now }
local first, b, extra = 1, 1, 4 + buckets * 3
for q = 0, count - 1 do
  local n, mode, arg = requests[q * 3 + 1], requests[q * 3 + 2], requests[q * 3 + 3]
  if mode == 'u' or mode == 'x' or mode == 'e' then
    local err
    if mode == 'u' then
      err = settle(KEYS[first], arg, out, written)
    else
      err = lease_op(KEYS[first], mode, arg, out, written)
    end
    if err then
      return err
    end
    first = first + 1
  else
    local grant, member, records, full, since
    if mode == 'a' then
      grant, member = now + arg, ARGV[extra]
    elseif mode == 'r' then
      since = arg
    elseif mode == 'v' and record_cap then
      -- The tenant's records, scored by when each is gone.
      records = KEYS[first + n + 1]
      redis.call('ZREMRANGEBYSCORE', records, '-inf', now)
      local held = redis.call('ZCARD', records)
      if held >= record_cap then
        full = true
        for _ = 1, n do
          push(out, false, 0, -2, held)
        end
      end
    end
    local op = (mode == 'c' or mode == 'r') and mode or 'd'
    local ok = not full and decide_request(first, n, b, op, mode ~= 'd', out, snapshot, written, grant, member,
      since)
    first, b = first + n, b + n
    if mode == 'v' then
      if ok then
        write_reservation(KEYS[first], n, arg, ARGV[extra], records, written)
      end
      first, extra = first + 1, extra + 1
      if records then
        first = first + 1
      end
    elseif mode == 'a' then
      if ok then
        write_lease(KEYS[first], first - n, n, arg, grant, member, written)
      end
      first, extra = first + 1, extra + 1
    end
  end
end
if journal then
  out[#out + 1] = noted
end
if usual then
  -- The usual form's reply: one value per bucket, 2 * reset_after + allowed.
  local r = { out[1] }
  for i = 1, (#out - 1) / 3 do
    r[i + 1] = out[3 * i + 1] * 2 + out[3 * i - 1] % 2
  end
  return r
end
return out
