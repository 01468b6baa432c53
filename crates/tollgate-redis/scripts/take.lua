-- tollgate: decide one or more requests, each taking tokens from its buckets all or nothing.
--
-- Several independent requests may share one call (the client batches concurrent callers):
-- Redis then pays its per-call cost once for all of them. Each request is decided on its own,
-- as if it had its own call, in the order given; a request whose keys hold something that is
-- not ours fails alone (status -2), never the call.
--
-- A bucket is a token bucket or a window limit (a fixed or a sliding window, the core's
-- `window.rs`, or a sliding log, its `sliding_log.rs`); one request may mix them, and is still
-- decided all or nothing in this one call.
--
-- A request can also peek (decide without writing) or refund: give back what an earlier take
-- charged, when a request spanning several cluster slots was charged in one slot and rejected in
-- another. Refunding the exact cost restores the balance the bucket would have had uncharged
-- (clamped at full), so the store may briefly under-admit between charge and refund, never
-- over-admit.
--
-- ARGV[1]      now: "" to use the server's TIME (one clock for every client), or a caller's time
--              as "micros" or "micros:nanos" (nanos 1 to 999 past that microsecond)
-- ARGV[2]      m, the number of requests in this call
-- ARGV[3]      the call's flags: "1" when a token bucket's key is in the call more than once (in
--              two requests, or as one request's bucket and another's old bucket) and no window
--              bucket has a token bucket's key: each token bucket is then read and written once
--              (see `cache` below); the decisions are the same either way. "w" when the call
--              holds a window bucket, a log included (their functions are made only then);
--              "w1" both; else ""
-- ARGV[4]      how the requests are laid out, so that the usual ones leave out what they all
--              share: "1" when every request of the call is a plain take (one bucket, no
--              request id, mode "take"), each sending its bucket's figures and nothing before
--              them; "s" when, moreover, no bucket's key is in the call twice (ARGV[3] ""), none
--              carries an old bucket over, none is a window and the time is a whole
--              microsecond: the same arguments, decided by the straight loop below; "n" when
--              every request is a take without a request id, each sending its number of
--              buckets, then their figures; else "", each request as below. Each argument costs
--              Redis about 1.2k instructions (read, made an object, then a Lua string, then
--              freed): the four a plain take would otherwise send cost a tenth of a decision in
--              calls of 32
-- then, per request (with ARGV[4] "1" or "s" its bucket's figures only; with "n", n and the
-- figures):
--   n            the number of buckets
--   window       idempotency window in milliseconds, or "" when the request has no id
--   attempt      "content:attempt": the request's fingerprint and this attempt's own id (unique
--                per try of the request), or "" when it has no id
--   mode         "take"; "peek" to decide without writing anything; "refund" to give back
--                `cost` from each bucket and forget the request's record, only if the record
--                is still this attempt's; "settle" to give back `cost` (here what the request
--                did not use: its take's cost less its use) from each bucket of a request
--                recorded earlier, once, marking the record settled (its attempt then reads
--                "=" and the settlement's fingerprint, sent as this attempt)
--   per bucket, one argument of little-endian doubles, told apart by its length:
--     24 bytes, a token bucket: a, cap and cost
--       a    units gained per microsecond
--       cap  capacity in units (capacity * units per token)
--       cost cost in units (tokens * units per token)
--     64 bytes, a token bucket carrying an old one over (its limit changed): five more doubles,
--       the old a, cap and p (units per token), the new p, and the whole microseconds since the
--       change
--     32 bytes, a window: kind (1 fixed, 2 sliding, 3 a sliding log), W (the window in
--       milliseconds), N (the most it admits per window) and cost (requests, 1 to N)
--     40 bytes, a window in a refund: the same, then the window the take charged (its index k,
--       as the take replied it; for a log, the millisecond its charge went to, as replied);
--       a refund of 32 bytes gives back from the latest count (see below)
--   (binary because `tonumber` on a decimal string runs `strtod` twice: read that way, the three
--   figures cost about a seventh of Redis' instructions per decision; each is an integer below
--   2^51, so its double is exact)
-- KEYS: per request, its n bucket keys, then the old key of each bucket that carries one over
-- (in bucket order), then its idempotency record key when it has an id. All keys of one call
-- are in one cluster slot.
--
-- A token bucket is one string: the microsecond at which it is full again, and, when a > 1,
-- the sub-microsecond remainder: "full" or "full:frac", meaning the bucket is full at
-- (full * a - frac) units. Absent means full. The key expires exactly when the bucket is full,
-- so expiry loses nothing. A caller's time between two microseconds is read as the units it
-- holds rounded down (fewer tokens) and charged from the units rounded up (full later): never
-- more than the exact answer.
--
-- A window bucket is one string too: "wK:CUR" or "wK:CUR:PREV". Window K covers milliseconds
-- [K*W, (K+1)*W) of the request's timeline (TIME, or the caller's time), read to the
-- millisecond: floor(now / 1000) ms, so a caller's nanoseconds never move a request to
-- another window. CUR is what window K admitted, PREV what window K-1 did (sliding windows
-- only; absent means 0). Absent means nothing counted. A fixed window admits `cost` in its
-- window j when CUR + cost <= N (a later window starts from 0); a sliding one, E milliseconds
-- into window j, when PREV * (W - E) + (CUR + cost) * W <= N * W: integers, compared exactly.
-- A state for a window later than the request's (a caller's clock gone back) decides the
-- request in that window, at its start: going back frees nothing. The key expires when the
-- window frees it: at the end of window K (K+1 for a sliding window whose CUR is not 0), with
-- the same least TTL as a token bucket on a caller's time. A window's figures are the core's:
-- retry and reset are waits to a millisecond boundary, replied in whole microseconds from the
-- microsecond `now`, from which the caller takes `nanos` for the exact nanoseconds.
--
-- A refund without a record that names no take (32 bytes: tokens a caller gives back, Envoy's
-- `is_negative_hits`) gives back from the latest count that holds anything: a window's CUR,
-- else a sliding window's PREV; a log's latest entry that holds anything (a refund may have
-- emptied later ones, which stay while they are the latest); a token bucket as any refund.
-- A cross-slot refund leaves such an empty latest count where the memory store, never
-- charged, has none: read this way, both give back from the same charge.
--
-- A refund of a window gives back `cost` from the count the take charged, only while that
-- count is still in the state (the same window K, or, for a sliding window, PREV once the
-- state has moved on to K+1), never below 0; otherwise nothing (the window has passed, and
-- what it admitted can no longer be counted against anyone). It never moves the state back:
-- a count emptied by a refund stays in its window, so a request from before it (a clock gone
-- back) is still counted there.
--
-- A sliding log is a list: what each millisecond that admitted something admitted (its
-- entry), oldest first, after a header. The header is "tlog" and four doubles: the total of
-- the entries, how many entries the list holds after it, and the latest entry's millisecond
-- and cost (the latest entry lives in the header alone, so that a charge to it, the usual one
-- on a busy key, rewrites one element). Each entry is two doubles, its millisecond and cost;
-- the list holds them in rising milliseconds, one per millisecond. Absent means nothing
-- counted. A request at millisecond t (read as a window's: floor(now / 1000)) is decided at
-- p = max(t, the latest entry's millisecond): going back frees nothing. Entries of m with
-- m + W > p count; the request passes when what they total, plus `cost`, is at most N, and is
-- then added to p's entry (the latest when it is p's; otherwise p's becomes the latest),
-- after dropping the oldest entries that no longer count at p. A rejection changes nothing.
-- Its retry is the wait until the counted entries, oldest first, have freed
-- counted + cost - N: until the entry that completes it stops counting; reset, the wait
-- until the latest entry with a cost that still counts stops (when allowed: p's). Only the
-- header and the oldest entries are read at once; a walk reads runs of entries as it goes
-- (one LRANGE each), so a rejection's wait costs a call per run, not per entry. The key
-- expires when the log counts nothing, at the latest entry's millisecond plus W, with the
-- same least TTL as a token bucket on a caller's time. A key that is not a list, or whose
-- first element is not such a header, is not ours; an entry after a header of ours that does
-- not read as two integers counts as nothing (the total still holds it: under-admitting).
-- A refund (and a settlement) of a log gives back from the entry of the millisecond the take
-- charged, which its reply's `window` names, never below 0, and nothing when the log no
-- longer holds that entry (it no longer counts against anyone). An older entry emptied is
-- removed; the latest stays, at 0, as it still marks the latest time seen.
--
-- A carried-over bucket is decided on the emptier of itself and its old bucket converted: the
-- old one's deficit at the change (now - since), its balance clamped to the new capacity (in
-- the new units: exactly when one unit size divides the other, else rounded down to whole
-- tokens), then refilled at the new rate since the change. An old bucket full at the change, or
-- absent (expired: full by now), carries nothing: the new one starts full. A policy change
-- thus never adds tokens to a bucket still refilling, and charges made under the old
-- parameters by processes that changed later still count. Only new keys are written; the old
-- one expires on its own. Windows carry nothing over (the caller sends no old key for them).
--
-- A record is "content|attempt|expires|figures": the request's first reply, for retries. A
-- retry that replays it clears `attempt`: a reply now rests on that charge, so the first
-- attempt's refund, if it comes later, must leave it (under-admitting, never over-admitting).
-- A settled record's attempt is "=" and the settlement's fingerprint, which neither a replay
-- clears nor any refund takes for its own.
--
-- Every figure stays below 2^53 (the caller refuses limits whose cap passes 2^51, windows
-- longer than 2^50 microseconds or whose N * W reaches 2^53, and logs of more than 10,000 per
-- window: a charge leaves a log's total at most N), so the doubles Lua computes with hold them
-- exactly; a deficit past the capacity (a caller's clock gone back) is replied as the
-- capacity, so every figure replied stays below 2^53 too.
--
-- Reply: one string, the call's integers one after another, each as a little-endian double
-- (exact: every figure is below 2^53). A list of Redis integers costs the client's parser about
-- 1.2k instructions per integer, a string about that once; a double is copied into the string
-- whole, where packing an integer shifts out its bytes one by one, which cost Redis more than
-- the list did. Per request, 1 + 2n + 4w integers, w its number of window buckets:
--   { status, allowed_1, figure_1, ..., allowed_n, figure_n,
--     then per window bucket, in bucket order: retry, reset, window, nanos }
--   status 1: every bucket allowed and charged; 0: rejected, nothing charged;
--          2: a retry of a recorded request, its first reply returned, nothing charged;
--         -1: the request id was recorded for different content (every figure 0);
--         -2: a bucket or record key holds something that is not ours (every figure 0;
--             nothing written).
--   A settlement answers 1 (given back), 2 (settled before with the same fingerprint: nothing
--   more), 0 (no live record: nothing given back) or -1 (the record is another request's, or
--   was settled otherwise; every figure 0); each bucket then replies its standing, as a
--   refund's. A window gives back from the window its take charged, which the record's
--   figures name.
--   A refund answers 1, or 0 when the record is no longer this attempt's (nothing given back);
--   a token bucket then replies its deficit after the refund (0, 0 when nothing was given
--   back), a window its standing after the refund (allowed 1, as a balance).
--   figure_i of a token bucket, its deficit: units bucket i is short of full afterwards (when
--   rejected: as it stands, since nothing was charged), at the request's time rounded down to a
--   whole unit: at most cap, or cap + 1 when charged from a caller's time between two units.
--   figure_i of a window, its remaining: requests the window still admits afterwards (when the
--   request is rejected, a window that would have allowed reports its standing uncharged).
--   retry: microseconds from `now` until `cost` would pass (0 when allowed); reset:
--   microseconds from `now` until the window counts nothing; window: the window K the bucket
--   was decided in (and charged to, when charged), for a log the millisecond p; nanos: the
--   request's `nanos`, which the durations are to be shortened by (a replay's are its first
--   attempt's).

-- Library functions held in locals: a global is two table lookups on every use. The hot path
-- also avoids calls where an operator does (`x % 1` for the fraction, comparisons for max and
-- min): each call of a library function costs the interpreter more than the arithmetic. Those
-- only the general path uses are taken after the usual call has returned.
local find, sub, format = string.find, string.sub, string.format
local pack, concat = struct.pack, table.concat
local spread, unpack = unpack, struct.unpack

local now, nanos
if ARGV[1] == '' then
  local t = redis.call('TIME')
  -- Read by arithmetic, which converts each string once: `tonumber` converts it twice (it asks
  -- whether the string is a number, then converts it), and each conversion is a `strtod` of
  -- about a thousand instructions, a few hundredths of a one-decision call. TIME's two fields
  -- are always decimal integers.
  now = t[1] * 1000000 + t[2]
  nanos = 0
else
  local sep = find(ARGV[1], ':', 1, true)
  if sep then
    now = tonumber(sub(ARGV[1], 1, sep - 1))
    nanos = tonumber(sub(ARGV[1], sep + 1))
  else
    now = tonumber(ARGV[1])
    nanos = 0
  end
end
-- The first whole microsecond at or after the request's time: a record must have outlived it.
local now_up = now
if nanos > 0 then now_up = now + 1 end

-- x / a rounded up, exactly: the division is in doubles, so correct it by one either way.
-- (`q - q % 1` is floor(q): Lua's `%` is defined through floor, and both subtractions are exact.)
local function ceil_div(x, a)
  local q = x / a
  q = q - q % 1
  if q * a < x then q = q + 1 end
  if q > 0 and (q - 1) * a >= x then q = q - 1 end
  return q
end

local max_exact = 2 ^ 53

-- The bucket at `key` as Redis holds it: (full, frac); nil when absent (full); false when the
-- key holds anything else (another program's key, a type other than a string).
local function read(key)
  local state = redis.pcall('GET', key)
  if not state then
    return nil
  end
  if type(state) ~= 'string' then
    return false
  end
  local full, frac
  local sep = find(state, ':', 1, true)
  if sep then
    full = tonumber(sub(state, 1, sep - 1))
    frac = tonumber(sub(state, sep + 1))
  else
    full = tonumber(state)
    frac = 0
  end
  -- Integers Lua holds exactly: not NaN (which fails every comparison), infinite or negative.
  if not (full and frac and full >= 0 and frac >= 0 and full < max_exact and frac < max_exact
      and full % 1 == 0 and frac % 1 == 0) then
    return false
  end
  return full, frac
end

-- Redis expires keys on its own clock. On TIME that is the decisions' clock, and a key expires
-- exactly when its bucket is full. With a caller-supplied time the two clocks differ, so keys
-- live at least a minute: a key outliving its bucket's refill is harmless (it reads as full),
-- one expiring early would mint tokens.
local min_ttl_ms = 1
if ARGV[1] ~= '' then
  min_ttl_ms = 60000
end

-- Writes the bucket at `key` as full again at microsecond `full` less `frac` units, expiring
-- then; deletes it when `full` is 0 (full now).
local function send(key, full, frac)
  if full == 0 then
    redis.call('DEL', key)
    return
  end
  local value
  if frac == 0 then
    value = format('%d', full)
  else
    value = format('%d:%d', full, frac)
  end
  -- The TTL goes as an integer string: Redis turns a Lua number argument into a 17-digit float
  -- string and SET parses it back, which measurably costs more than formatting it here.
  local ttl = ceil_div(full - now, 1000)
  if ttl < min_ttl_ms then
    ttl = min_ttl_ms
  end
  redis.call('SET', key, value, 'PX', format('%d', ttl))
end

-- The usual call (ARGV[4] "s"): every request a plain take of a bucket in no other request of
-- the call, carrying no old bucket over, at a whole microsecond. It is most of a busy store's
-- traffic, so it is decided here in one loop, with only the functions it needs made before it
-- (the general path's come after): each function a call makes costs an allocation and its
-- collection, and calling a function costs the interpreter more than the arithmetic in it.
-- The state is read and written by the same `read` and `send`, and the figures are those the
-- general path gives these requests (lo = hi = 0, one bucket each); the tests compare both
-- with the memory store. Reply: each request's 24 bytes packed on their own, then joined (no
-- table of every figure, no format string built per call).
if ARGV[4] == 's' then
  -- A call of one request (a lone caller's) returns its reply as it is: no table to join.
  local count = #KEYS
  local replies
  if count ~= 1 then replies = {} end
  for i = 1, count do
    local key = KEYS[i]
    local a, cap, cost = unpack('<ddd', ARGV[4 + i])
    local full, frac = read(key)
    local reply
    if full == false then
      reply = pack('<ddd', -2, 0, 0)
    else
      local deficit = 0
      if full and full > now then
        deficit = (full - now) * a - frac
        if deficit < 0 then deficit = 0 end
      end
      if deficit + cost <= cap then
        local units = deficit + cost
        local micros = ceil_div(units, a)
        send(key, now + micros, micros * a - units)
        reply = pack('<ddd', 1, 1, units)
      else
        if deficit > cap then deficit = cap end
        reply = pack('<ddd', 0, 0, deficit)
      end
    end
    if count == 1 then return reply end
    replies[i] = reply
  end
  return concat(replies)
end

local fmod, min, max = math.fmod, math.min, math.max
local match, rep = string.match, string.rep

-- x / y rounded down, for integers 0 <= x < 2^53: fmod is exact, so is the division after it.
local function floor_div(x, y)
  return (x - fmod(x, y)) / y
end

-- The units a bucket gains from the microsecond `now` to the request's time, rounded down and
-- rounded up (nanos * a stays below 2^53: a is below 2^43); 0 and 0 when nanos is 0, and then
-- not made at all: each function a call makes costs an allocation and its collection, whether
-- it runs or not, and most calls are on Redis' clock. Callers ask
-- `nanos > 0 and offsets(a) or 0` (a 0 from `offsets` stands: only nil and false are false).
local offsets
if nanos > 0 then
  offsets = function(a)
    local lo = floor_div(nanos * a, 1000)
    if lo * 1000 == nanos * a then
      return lo, lo
    end
    return lo, lo + 1
  end
end

-- Units a bucket in state (full, frac) is short of full at the request's time, `lo` units into
-- the microsecond `now`; the rounded-down `lo` makes it the larger figure.
local function deficit_at(full, frac, a, lo)
  if not full or full <= now then
    return 0
  end
  local deficit = (full - now) * a - frac - lo
  if deficit > 0 then
    return deficit
  end
  return 0
end

-- How the call reads and writes its token buckets: `state_of(key)` as `read`, `store(key,
-- full, frac)` as `send`, each bucket on its own.
--
-- When a bucket's key is in the call more than once (ARGV[3]: concurrent requests on one hot
-- key, batched into one call), each bucket is instead read from Redis once and written once,
-- at the end of the call, in its final state: a `GET` and a `SET` cost Redis about 4.5k and
-- 12k instructions, more than a decision's own arithmetic. The call is atomic, so no one sees
-- the states in between. The buckets are then in `cache`: `cache[key]` is the bucket's j, and
-- 3j - 2, 3j - 1 and 3j hold its state as the call has left it (the microsecond it is full
-- again, 0 when absent: full, false when the key holds anything else; its remainder) and its
-- key once the call has decided it (false before). Records are never cached: their keys start
-- with `{`, which no bucket's does, and neither are windows: they are read and written at
-- once, and the caller leaves the cache off when a window's key is also a token bucket's, so
-- that no key is both cached and not. Calls without repeated keys make neither the table nor
-- these two functions: Lua's collector charges each byte a call allocates, and they cost
-- about 4k instructions per decision when every key is read once anyway.
local flags = ARGV[3]
local windows = flags == 'w' or flags == 'w1'
local state_of, store = read, send
local cache
if flags == '1' or flags == 'w1' then
  cache = {}
  state_of = function(key)
    local j = cache[key]
    local full, frac
    if j then
      full, frac = cache[3 * j - 2], cache[3 * j - 1]
    else
      full, frac = read(key)
      if full == nil then
        full = 0
      end
      j = #cache + 3
      cache[key] = j / 3
      cache[j - 2], cache[j - 1], cache[j] = full, frac or 0, false
    end
    if full == 0 then
      return nil
    end
    return full, frac
  end
  store = function(key, full, frac)
    local j = 3 * cache[key]
    cache[j - 2], cache[j - 1], cache[j] = full, frac, key
  end
end

-- Stores a bucket `deficit` units (> 0) short of full `lo` units into the microsecond `now`.
local function write(key, deficit, a, lo)
  local units = deficit + lo
  local micros = ceil_div(units, a)
  store(key, now + micros, micros * a - units)
end

-- The deficit, in the new units at the microsecond `now`, of the old bucket at `key` carried
-- over with the figures in `arg` (see the header); false when the key is not a bucket.
local function carried(key, arg)
  local a, cap = unpack('<dd', arg)
  local old_a, old_cap, old_p, p, since = unpack('<ddddd', arg, 25)
  local full, frac = state_of(key)
  if full == false then
    return false
  end
  local change = now - since
  if not full or full <= change then
    return 0
  end
  -- Clamped first: a product past 2^53 is inexact, but then far above old_cap.
  local old_deficit = min(old_cap, max(0, (full - change) * old_a - frac))
  local held = old_cap - old_deficit
  if p == old_p then
    -- held as it is
  elseif fmod(p, old_p) == 0 then
    held = held * (p / old_p)
  elseif fmod(old_p, p) == 0 then
    held = floor_div(held, old_p / p)
  else
    held = floor_div(held, old_p) * p
  end
  if held >= cap then
    return 0
  end
  local deficit = cap - held
  -- since * a is exact whenever it is below deficit (< 2^51); above, it only needs to compare.
  if since * a >= deficit then
    return 0
  end
  return deficit - since * a
end

-- Window buckets (see the header), made only when the call holds one (ARGV[3]), so that the
-- calls of token buckets alone make none of these functions. Every figure is an integer below
-- 2^53: N * W is (the caller refuses limits where it is not), so is each product compared with
-- it unless the state's counts are past N, and then the product, rounded or not, stays above
-- N * W, so every comparison still answers exactly.
local read_window, read_log, send_window, window_take, window_balance, give_back_window
if windows then
  -- The request's millisecond, the same for every nanosecond of its microsecond.
  local now_ms = floor_div(now, 1000)

  -- Microseconds from `now` to `ms` milliseconds into window `window + ahead`, 0 when that
  -- moment has passed (the caller subtracts `nanos`, down to 0).
  local function till(w, window, ahead, ms)
    local wait = ((window + ahead) * w + ms) * 1000 - now
    if wait > 0 then
      return wait
    end
    return 0
  end

  -- The window a request falls in for a bucket in state (k, cur, prev) (k nil: absent), the
  -- milliseconds into it, and that window's previous count (sliding only) and its own. A state
  -- of a later window (a clock gone back) takes the request to that window's start.
  local function position(w, sliding, k, cur, prev)
    local j = floor_div(now_ms, w)
    local e = now_ms - j * w
    if not k then
      return j, e, 0, 0
    end
    if k > j then
      j, e = k, 0
    end
    if j == k then
      if sliding then
        return j, e, prev, cur
      end
      return j, e, 0, cur
    end
    if sliding and j == k + 1 then
      return j, e, cur, 0
    end
    return j, e, 0, 0
  end

  -- The wait until a sliding window counts nothing: two windows after one holding a count of
  -- its own, one after one holding only its previous window's.
  local function sliding_reset(w, window, p, c)
    if c > 0 then
      return till(w, window, 2, 0)
    end
    if p > 0 then
      return till(w, window, 1, 0)
    end
    return 0
  end

  -- Sliding logs (kind 3; see the header). Each request reads its log into a table: the
  -- header's figures (total, older: entries in the list, last_ms and last_cost: the latest
  -- entry), the key, and the entries read so far (ms[i], cost[i] for list index i); a
  -- decision notes in it how many entries, oldest first, no longer count (gone) and their cost
  -- (freed), for the charge that follows. Logs are rarer than the other kinds, and a table per
  -- log is the price of walking them in runs.
  local log_tag = 'tlog'
  -- Entries read by one LRANGE when a walk reaches one not read yet: a call per entry would
  -- cost a rejection's wait on a long log a call per request it counts.
  local run = 64

  -- An integer Lua holds exactly, not negative (NaN fails every comparison).
  local function exact(x)
    return x >= 0 and x < max_exact and x % 1 == 0
  end

  local function log_header(total, older, last_ms, last_cost)
    return log_tag .. pack('<dddd', total, older, last_ms, last_cost)
  end

  local function log_entry(ms, cost)
    return pack('<dd', ms, cost)
  end

  -- Notes the entries `got[skip + 1..]`, of list indexes `first` on, in `log`. One that does
  -- not read as two integers counts as nothing (see the header).
  local function note_entries(log, first, got, skip)
    for j = skip + 1, #got do
      local e = got[j]
      local ms, cost = 0, 0
      if #e == 16 then
        ms, cost = unpack('<dd', e)
        if not (exact(ms) and exact(cost)) then
          ms, cost = 0, 0
        end
      end
      log.ms[first + j - skip - 1], log.cost[first + j - skip - 1] = ms, cost
    end
  end

  -- Entry i of `log` (1 to older + 1, the last being the latest, which the header holds): its
  -- millisecond and cost, read with the run of entries after it, or before it when walking
  -- back (`back`).
  local function log_at(log, i, back)
    if i > log.older then
      return log.last_ms, log.last_cost
    end
    if not log.ms[i] then
      local first, last = i, min(log.older, i + run - 1)
      if back then
        first, last = max(1, i - run + 1), i
      end
      note_entries(log, first, redis.call('LRANGE', log.key, first, last), 0)
      if not log.ms[i] then
        -- A list shorter than its header says: not ours to read further.
        log.ms[i], log.cost[i] = 0, 0
      end
    end
    return log.ms[i], log.cost[i]
  end

  -- The log at `key` as Redis holds it (see above); nil when absent; false when the key holds
  -- anything else (a string, another program's list). Its header and two oldest entries come
  -- in one call: most decisions look no further.
  read_log = function(key)
    local got = redis.pcall('LRANGE', key, 0, 2)
    if got.err then
      return false
    end
    if #got == 0 then
      return nil
    end
    local header = got[1]
    if #header ~= 36 or sub(header, 1, 4) ~= log_tag then
      return false
    end
    local total, older, last_ms, last_cost = unpack('<dddd', header, 5)
    if not (exact(total) and exact(older) and exact(last_ms) and exact(last_cost)
        and last_cost <= total) then
      return false
    end
    local log = {
      key = key, total = total, older = older, last_ms = last_ms, last_cost = last_cost,
      ms = {}, cost = {}, gone = 0, freed = 0,
    }
    note_entries(log, 1, got, 1)
    return log
  end

  -- Microseconds from `now` until an entry of millisecond `ms` stops counting, 0 once it has.
  local function log_until(w, ms)
    local wait = (ms + w) * 1000 - now
    if wait > 0 then
      return wait
    end
    return 0
  end

  -- The millisecond p a request is decided at against `log` (nil: absent) and what the log
  -- counts there; notes in the log which of its oldest entries no longer count (all of them,
  -- walking none, once the latest has stopped).
  local function log_position(w, log)
    if not log then
      return now_ms, 0
    end
    local p = log.last_ms
    if now_ms > p then
      p = now_ms
    end
    local gone, freed = 0, 0
    if log.last_ms + w <= p then
      gone, freed = log.older + 1, log.total
    else
      -- Ends at the latest entry at the latest, which counts.
      while true do
        local ms, cost = log_at(log, gone + 1, false)
        if ms + w > p then
          break
        end
        gone, freed = gone + 1, freed + cost
      end
    end
    log.gone, log.freed = gone, freed
    return p, log.total - freed
  end

  -- The wait until a positioned `log` counts nothing: until its latest entry with a cost that
  -- still counts stops; 0 when none does.
  local function log_reset(w, log)
    if not log then
      return 0
    end
    for i = log.older + 1, log.gone + 1, -1 do
      local ms, cost = log_at(log, i, true)
      if cost > 0 then
        return log_until(w, ms)
      end
    end
    return 0
  end

  -- Takes `cost` from a log of N `n` per `w` ms (`log` as read): allowed, remaining, retry,
  -- reset and p, the millisecond decided at (and charged, when charged). As the core's
  -- `sliding_log::decide`.
  local function log_take(w, n, cost, log)
    local p, counted = log_position(w, log)
    if counted + cost <= n then
      return 1, n - counted - cost, 0, log_until(w, p), p
    end
    local remaining = n - counted
    if remaining < 0 then
      remaining = 0
    end
    -- Counted entries, oldest first, until they free what the request needs. Some do (cost
    -- is at most N), unless the state is not the caller's limit's: then the reset.
    local need, freed, retry = counted + cost - n, 0, nil
    for i = log.gone + 1, log.older + 1 do
      local ms, c = log_at(log, i, false)
      freed = freed + c
      if freed >= need then
        retry = log_until(w, ms)
        break
      end
    end
    local reset = log_reset(w, log)
    return 0, remaining, retry or reset, reset, p
  end

  -- A log's standing, uncharged: remaining, reset and p. As the core's `sliding_log::balance`.
  local function log_balance(w, n, log)
    local p, counted = log_position(w, log)
    local remaining = n - counted
    if remaining < 0 then
      remaining = 0
    end
    return remaining, log_reset(w, log), p
  end

  -- Charges `cost` at millisecond p to the log at `key` (`log` as read and positioned at p;
  -- nil when absent): drops the entries that no longer count, adds to the latest entry when
  -- it is p's or makes p's the latest, and expires the key when the log will count nothing.
  local function log_charge(key, w, p, log, cost)
    -- Whether the latest millisecond moves, and the expiry with it.
    local later = true
    if not log then
      redis.call('RPUSH', key, log_header(cost, 0, p, cost))
    elseif log.gone > log.older then
      -- Nothing counts any more: the log starts again.
      redis.call('LSET', key, 0, log_header(cost, 0, p, cost))
      if log.older > 0 then
        redis.call('LTRIM', key, 0, 0)
      end
    else
      local older, last_cost = log.older - log.gone, cost
      if log.last_ms == p then
        later = false
        last_cost = log.last_cost + cost
      else
        redis.call('RPUSH', key, log_entry(log.last_ms, log.last_cost))
        older = older + 1
      end
      -- The header goes where the last dropped entry was, and the trim takes what is before.
      local header = log_header(log.total - log.freed + cost, older, p, last_cost)
      redis.call('LSET', key, log.gone, header)
      if log.gone > 0 then
        redis.call('LTRIM', key, log.gone, -1)
      end
    end
    -- On TIME, a key keeps the exact expiry it was given when p became the latest; on a
    -- caller's time it is given its least TTL again, as the other kinds are on every write.
    if later or min_ttl_ms > 1 then
      local ttl = ceil_div((p + w) * 1000 - now, 1000)
      if ttl < min_ttl_ms then
        ttl = min_ttl_ms
      end
      redis.call('PEXPIRE', key, format('%d', ttl))
    end
  end

  -- Gives `back` back to the log at `key` (`log` as read) from the entry of millisecond `ms`,
  -- never below 0; nothing when the log holds no such entry. An older entry emptied is removed;
  -- the latest stays, at 0. Returns the log as it stands after. As the core's
  -- `sliding_log::give_back`.
  local function log_give_back(key, log, ms, back)
    if ms == log.last_ms then
      local given = min(log.last_cost, back)
      if given > 0 then
        log.last_cost, log.total = log.last_cost - given, log.total - given
        redis.call('LSET', key, 0, log_header(log.total, log.older, ms, log.last_cost))
      end
      return log
    end
    local lo, hi = 1, log.older
    while lo <= hi do
      local mid = floor_div(lo + hi, 2)
      local at_ms, cost = log_at(log, mid, false)
      if at_ms == ms then
        local given = min(cost, back)
        if cost - given == 0 then
          -- Its bytes are unique in the list: one entry per millisecond.
          redis.call('LREM', key, 1, log_entry(at_ms, cost))
          log.older = log.older - 1
          log.ms, log.cost = {}, {}
        elseif given > 0 then
          redis.call('LSET', key, mid, log_entry(at_ms, cost - given))
          log.cost[mid] = cost - given
        else
          return log
        end
        log.total = log.total - given
        redis.call('LSET', key, 0, log_header(log.total, log.older, log.last_ms, log.last_cost))
        return log
      elseif at_ms < ms then
        lo = mid + 1
      else
        hi = mid - 1
      end
    end
    return log
  end

  -- The window bucket at `key` as Redis holds it: (k, cur, prev); nil when absent; false when
  -- the key holds anything else (a token bucket's state included).
  read_window = function(key)
    local state = redis.pcall('GET', key)
    if not state then
      return nil
    end
    if type(state) ~= 'string' then
      return false
    end
    local k, cur, prev = match(state, '^w(%d+):(%d+):?(%d*)$')
    if not k then
      return false
    end
    k, cur, prev = tonumber(k), tonumber(cur), tonumber(prev) or 0
    if k >= max_exact or cur >= max_exact or prev >= max_exact then
      return false
    end
    return k, cur, prev
  end

  -- Writes window k's counts at `key`, expiring when the window frees them (see the header).
  -- A log (kind 3) is charged instead: k is the millisecond p, cur the log as read, prev the
  -- cost (see `window_take`).
  send_window = function(key, kind, w, k, cur, prev)
    if kind == 3 then
      log_charge(key, w, k, cur, prev)
      return
    end
    local sliding = kind == 2
    local value
    local ends = k + 1
    if sliding and prev > 0 then
      value = format('w%d:%d:%d', k, cur, prev)
    else
      value = format('w%d:%d', k, cur)
    end
    if sliding and cur > 0 then
      ends = k + 2
    end
    local ttl = ceil_div(ends * w * 1000 - now, 1000)
    if ttl < min_ttl_ms then
      ttl = min_ttl_ms
    end
    redis.call('SET', key, value, 'PX', format('%d', ttl))
  end

  -- Gives `back` back to the window at `key`, in state (`held`, `cur`, `prev`), from the count
  -- of window `charged`: the current count while the state is still in it, a sliding window's
  -- previous count once it has moved on by one, never below 0; otherwise nothing (the window
  -- has passed). Writes the state if it changed, and returns its counts. A log gives back from
  -- the entry of millisecond `charged`, and returns itself as it stands after (as `cur`).
  -- `charged` nil (tokens given back with no record) gives back from the latest count that
  -- holds anything: the current one, else a sliding window's previous one; a log's latest
  -- entry that holds anything (a refund may have emptied later ones).
  give_back_window = function(key, kind, w, held, cur, prev, charged, back)
    if kind == 3 then
      if charged == nil then
        -- Refunds leave empty entries behind only now and then: the walk is short.
        local at, i, cost = cur.last_ms, cur.older, cur.last_cost
        while cost == 0 and i > 0 do
          at, cost = log_at(cur, i, true)
          i = i - 1
        end
        charged = at
      end
      return log_give_back(key, cur, charged, back), nil
    end
    local sliding = kind == 2
    if back <= 0 then
      return cur, prev
    end
    if charged == nil then
      charged = held
      if sliding and cur == 0 and held > 0 then
        charged = held - 1
      end
    end
    if held == charged and cur > 0 then
      cur = max(0, cur - back)
      send_window(key, kind, w, held, cur, sliding and prev or 0)
    elseif sliding and held == charged + 1 and prev > 0 then
      prev = max(0, prev - back)
      send_window(key, kind, w, held, cur, prev)
    end
    return cur, prev
  end

  -- Takes `cost` from a window bucket of `kind` in state (k, cur, prev): allowed (1 or 0),
  -- remaining, retry and reset (microseconds), the window decided in, and, when allowed, the
  -- counts to store for it (cur, prev). As the core's `window::take`. A log (its state the
  -- log as read, in `cur`) answers its millisecond p as the window, and what `send_window`
  -- charges it with: the log and the cost.
  window_take = function(kind, w, n, cost, k, cur, prev)
    if kind == 3 then
      local allowed, remaining, retry, reset, p = log_take(w, n, cost, cur)
      return allowed, remaining, retry, reset, p, cur, cost
    end
    local sliding = kind == 2
    local window, e, p, c = position(w, sliding, k, cur, prev)
    if not sliding then
      local reset = till(w, window, 1, 0)
      if c + cost <= n then
        return 1, n - c - cost, 0, reset, window, c + cost, 0
      end
      -- cost <= N, so the next window admits it.
      local left = n - c
      if left < 0 then
        left = 0
      end
      return 0, left, reset, reset, window
    end
    local room = n * w
    local weighted = p * (w - e) + c * w
    local after = weighted + cost * w
    if after <= room then
      return 1, floor_div(room - after, w), 0, till(w, window, 2, 0), window, c + cost, p
    end
    local remaining = 0
    if weighted < room then
      remaining = floor_div(room - weighted, w)
    end
    -- The first millisecond the previous window's weight has fallen enough: in this window,
    -- p * (W - e) <= (N - c - cost) * W, or failing that in the next, where this window's
    -- count is the previous one: c * (W - e) <= (N - cost) * W (always by its end).
    local retry
    local left = n - c - cost
    if left >= 0 and p > 0 then
      local q = floor_div(left * w, p)
      if q > 0 then
        if q > w then
          q = w
        end
        retry = till(w, window, 0, w - q)
      end
    end
    if not retry then
      local at_ms = 0
      if c > 0 then
        local q = floor_div((n - cost) * w, c)
        if q > w then
          q = w
        end
        at_ms = w - q
      end
      retry = till(w, window, 1, at_ms)
    end
    return 0, remaining, retry, sliding_reset(w, window, p, c), window
  end

  -- A window bucket's standing, uncharged: remaining, reset and the window it is read in. As
  -- the core's `window::balance`. A log's is its millisecond p.
  window_balance = function(kind, w, n, k, cur, prev)
    if kind == 3 then
      return log_balance(w, n, cur)
    end
    local sliding = kind == 2
    local window, e, p, c = position(w, sliding, k, cur, prev)
    if not sliding then
      local reset = 0
      if c > 0 then
        reset = till(w, window, 1, 0)
      end
      local left = n - c
      if left < 0 then
        left = 0
      end
      return left, reset, window
    end
    local room, weighted = n * w, p * (w - e) + c * w
    local remaining = 0
    if weighted < room then
      remaining = floor_div(room - weighted, w)
    end
    return remaining, sliding_reset(w, window, p, c), window
  end
end

-- A record's fields: content, attempt, expires (microseconds), figures; nil when unreadable.
local function parse_record(seen)
  local content, attempt, expires, figures = match(seen, '^([^|]*)|([^|]*)|([^|]*)|(.*)$')
  expires = tonumber(expires)
  if not expires then
    return nil
  end
  return content, attempt, expires, figures
end

local reply = {}
-- The states of the request being decided, its bucket i's (full, frac) at 2i - 1 and 2i: one
-- table made once per call (a table per request cost a tenth of a decision's instructions, and
-- each table a call makes costs it an allocation and its collection). Each request writes
-- indexes 1..2n before reading them. Other figures are kept in the reply as it is built. A
-- window bucket's (k, cur) are there too (a log's table at both), and, in tables made only for
-- calls with windows, its PREV (`prevs`), the index of its four figures past the pairs in the
-- reply (`extra`, false for a token bucket) and the counts a charge stores (`nexts`, as
-- `states`; for a log, the log and the cost).
local states = {}
local extra, prevs, nexts
if windows then
  extra, prevs, nexts = {}, {}, {}
end
local k = 0 -- keys used so far
local v = 4 -- arguments used so far
local layout = ARGV[4]

-- Answers request `at` with `status` and `width` zeros.
local function zeros(at, status, width)
  reply[at] = status
  for i = 1, width do reply[at + i] = 0 end
end

-- Answers window bucket i of request `at` (its figures at `x`) with its standing in state
-- (k, cur, prev): allowed, uncharged. Made, as the other window functions, only for calls with
-- windows.
local standing
if windows then
  standing = function(at, i, x, arg, k, cur, prev)
    local kind, w, n = unpack('<ddd', arg)
    local remaining, reset, window = window_balance(kind, w, n, k, cur, prev)
    reply[at + 2 * i - 1], reply[at + 2 * i] = 1, remaining
    reply[x], reply[x + 1], reply[x + 2], reply[x + 3] = 0, reset, window, nanos
  end
end

for _ = 1, tonumber(ARGV[2]) do
  local n, window, fingerprint, mode, params
  if layout == '1' then
    n, window, fingerprint, mode, params = 1, '', '', 'take', v
  elseif layout == 'n' then
    n, window, fingerprint, mode, params = tonumber(ARGV[v + 1]), '', '', 'take', v + 1
  else
    n = tonumber(ARGV[v + 1])
    window, fingerprint, mode = ARGV[v + 2], ARGV[v + 3], ARGV[v + 4]
    params = v + 4
  end
  v = params + n
  local attempt = ''
  local dry = mode == 'peek'
  local first_key = k
  k = k + n
  local at = #reply + 1
  -- Figures after the status: a pair per bucket, four more per window.
  local width = 2 * n

  -- Every bucket's state, read before anything is written, so a request with a key that is not
  -- a bucket fails whole.
  local readable = true
  for i = 1, n do
    local arg = ARGV[params + i]
    local full, frac
    if windows and (#arg == 32 or #arg == 40) then
      extra[i] = at + width + 1
      width = width + 4
      if unpack('<d', arg) == 3 then
        -- A log is its own state, in both places a window's (k, cur) go.
        full = read_log(KEYS[first_key + i])
        frac, prevs[i] = full, nil
      else
        full, frac, prevs[i] = read_window(KEYS[first_key + i])
      end
    else
      if windows then
        extra[i] = false
      end
      full, frac = state_of(KEYS[first_key + i])
      if #arg > 24 then
        k = k + 1
        local old = carried(KEYS[k], arg)
        if old == false then
          readable = false
        elseif old > 0 and mode ~= 'refund' then
          -- The emptier of the two, as a state: `old` units short at the microsecond `now`.
          local a = unpack('<d', arg)
          if old > deficit_at(full, frac, a, 0) then
            local micros = ceil_div(old, a)
            full, frac = now + micros, micros * a - old
          end
        end
      end
    end
    if full == false then
      readable = false
    end
    states[2 * i - 1], states[2 * i] = full, frac
  end

  local record
  if window ~= '' then
    k = k + 1
    record = KEYS[k]
    fingerprint, attempt = match(fingerprint, '^([^:]*):?(.*)$')
  end

  local seen
  if readable and record and not dry then
    seen = redis.pcall('GET', record)
    if seen and type(seen) ~= 'string' then
      readable = false
    end
  end

  if not readable then
    zeros(at, -2, width)
  elseif mode == 'settle' then
    -- Gives back what a charged request did not use, once: only while its record lives, was
    -- made for this request, and is not settled yet; then the record says so.
    local content, recorded, expires, figures
    if seen then
      content, recorded, expires, figures = parse_record(seen)
    end
    local status = 0
    if content and expires > now_up then
      if content ~= fingerprint then
        status = -1
      elseif sub(recorded, 1, 1) == '=' then
        status = (recorded == attempt) and 2 or -1
      else
        status = 1
      end
    end
    if status == -1 then
      zeros(at, -1, width)
    else
      reply[at] = status
      -- The check's figures, where each window names the window it charged.
      local charged = {}
      if status == 1 then
        for field in string.gmatch(figures, '[^,]+') do
          charged[#charged + 1] = tonumber(field) or 0
        end
      end
      for i = 1, n do
        local x = windows and extra[i]
        local arg = ARGV[params + i]
        if x then
          local held, c, p = states[2 * i - 1], states[2 * i], prevs[i]
          local k = charged[x - at + 2]
          if held and k then
            local kind, w, _, back = unpack('<dddd', arg)
            c, p = give_back_window(KEYS[first_key + i], kind, w, held, c, p, k, back)
          end
          standing(at, i, x, arg, held, c, p)
        else
          local a, cap, back = unpack('<ddd', arg)
          local lo = nanos > 0 and offsets(a) or 0
          local full, frac = states[2 * i - 1], states[2 * i]
          if status == 1 and full and back > 0 then
            -- The time the bucket is full again moves back by `back` units, exactly; kept
            -- even when that is past, so a request timed before this one still sees the
            -- charge.
            local whole = floor_div(frac + back, a)
            full, frac = full - whole, frac + back - whole * a
            store(KEYS[first_key + i], full, frac)
          end
          reply[at + 2 * i - 1] = 1
          reply[at + 2 * i] = min(deficit_at(full, frac, a, lo), cap)
        end
      end
      if status == 1 then
        redis.call('SET', record,
          content .. '|' .. attempt .. '|' .. format('%d', expires) .. '|' .. figures, 'KEEPTTL')
      end
    end
  elseif mode == 'refund' then
    -- Only the attempt that charged gives back, and only while nothing rests on its charge: a
    -- record gone (expired) or claimed by a retry's replay keeps the charge.
    local ours = true
    if record then
      local recorded
      if seen then
        recorded = select(2, parse_record(seen))
      end
      ours = recorded ~= nil and recorded ~= '' and recorded == attempt
    end
    if not ours then
      zeros(at, 0, width)
      for i = 1, n do
        local x = windows and extra[i]
        if x then
          standing(at, i, x, ARGV[params + i], states[2 * i - 1], states[2 * i], prevs[i])
        end
      end
    else
      reply[at] = 1
      for i = 1, n do
        local x = windows and extra[i]
        if x then
          -- Gives back from the count the take charged, while the state still holds it; with
          -- no take named (tokens given back unrecorded), from the latest count that holds
          -- anything.
          local arg = ARGV[params + i]
          local held, c, p = states[2 * i - 1], states[2 * i], prevs[i]
          if held and #arg == 40 then
            local kind, w, _, cost, charged = unpack('<ddddd', arg)
            c, p = give_back_window(KEYS[first_key + i], kind, w, held, c, p, charged, cost)
          elseif held then
            local kind, w, _, cost = unpack('<dddd', arg)
            c, p = give_back_window(KEYS[first_key + i], kind, w, held, c, p, nil, cost)
          end
          standing(at, i, x, arg, held, c, p)
        else
          local a, cap, cost = unpack('<ddd', ARGV[params + i])
          local lo = nanos > 0 and offsets(a) or 0
          local full, frac = states[2 * i - 1], states[2 * i]
          local deficit = 0
          if full then
            -- Moves the time at which the bucket is full back by `cost` units, exactly, however
            -- far the request's time is from it.
            local back = floor_div(frac + cost, a)
            full, frac = full - back, frac + cost - back * a
            deficit = deficit_at(full, frac, a, lo)
            if deficit > 0 then
              store(KEYS[first_key + i], full, frac)
            else
              store(KEYS[first_key + i], 0, 0)
            end
          end
          reply[at + 2 * i - 1] = 1
          reply[at + 2 * i] = min(deficit, cap)
        end
      end
      if record then
        redis.call('DEL', record)
      end
    end
  else
    -- A record lives for the window on the request's clock (TIME, or the caller's time) as well
    -- as by its PX, so replays with caller-supplied time expire exactly as in the memory store.
    local replayed = false
    if seen then
      local content, recorded, expires, figures = parse_record(seen)
      if content and expires > now_up then
        replayed = true
        if content ~= fingerprint then
          zeros(at, -1, width)
        else
          reply[at] = 2
          local i = 0
          for field in string.gmatch(figures, '[^,]+') do
            if i < width then
              i = i + 1
              reply[at + i] = tonumber(field) or 0
            end
          end
          for j = i + 1, width do reply[at + j] = 0 end
          -- This reply rests on the first attempt's charge now: its refund must leave it.
          if recorded ~= '' and sub(recorded, 1, 1) ~= '=' then
            redis.call('SET', record,
              content .. '||' .. format('%d', expires) .. '|' .. figures, 'KEEPTTL')
          end
        end
      end
    end

    if not replayed then
      -- A rejection's deficit is replied at most the capacity: more only says the caller's clock
      -- went back, and past 2^63 it would not fit Redis' integer reply.
      local all = true
      for i = 1, n do
        local x = windows and extra[i]
        if x then
          local kind, w, lim, cost = unpack('<dddd', ARGV[params + i])
          local allowed, remaining, retry, reset, decided, c, p =
            window_take(kind, w, lim, cost, states[2 * i - 1], states[2 * i], prevs[i])
          reply[at + 2 * i - 1], reply[at + 2 * i] = allowed, remaining
          reply[x], reply[x + 1], reply[x + 2], reply[x + 3] = retry, reset, decided, nanos
          if allowed == 1 then
            nexts[2 * i - 1], nexts[2 * i] = c, p
          else
            all = false
          end
        else
          local a, cap, cost = unpack('<ddd', ARGV[params + i])
          local lo, hi = 0, 0
          if nanos > 0 then
            lo, hi = offsets(a)
          end
          local deficit = deficit_at(states[2 * i - 1], states[2 * i], a, lo)
          if deficit + cost <= cap then
            -- Charged from the request's time rounded up: a bucket full by then is full later.
            local after = deficit
            if hi - lo > after then
              after = hi - lo
            end
            reply[at + 2 * i - 1] = 1
            reply[at + 2 * i] = after + cost
          else
            all = false
            if deficit > cap then
              deficit = cap
            end
            reply[at + 2 * i - 1] = 0
            reply[at + 2 * i] = deficit
          end
        end
      end

      if dry then
        -- A peek: each bucket's own verdict, nothing written.
        reply[at] = all and 1 or 0
      elseif all then
        reply[at] = 1
        for i = 1, n do
          local x = windows and extra[i]
          if x then
            local kind, w = unpack('<dd', ARGV[params + i])
            send_window(KEYS[first_key + i], kind, w, reply[x + 2], nexts[2 * i - 1], nexts[2 * i])
          else
            local a = unpack('<d', ARGV[params + i])
            local lo = nanos > 0 and offsets(a) or 0
            write(KEYS[first_key + i], reply[at + 2 * i], a, lo)
          end
        end
      else
        -- Nothing is charged: every bucket reports its balance as it stands, which the ones
        -- that would have allowed have yet to (their reply holds the balance after a charge).
        reply[at] = 0
        for i = 1, n do
          if reply[at + 2 * i - 1] == 1 then
            local x = windows and extra[i]
            if x then
              standing(at, i, x, ARGV[params + i], states[2 * i - 1], states[2 * i], prevs[i])
            else
              local a, cap = unpack('<dd', ARGV[params + i])
              local lo = nanos > 0 and offsets(a) or 0
              reply[at + 2 * i] = min(deficit_at(states[2 * i - 1], states[2 * i], a, lo), cap)
            end
          end
        end
      end

      if all and record and not dry then
        local fields = {}
        for i = 1, width do
          fields[i] = format('%d', reply[at + i])
        end
        local expires = format('%d', now + tonumber(window) * 1000)
        redis.call('SET', record,
          fingerprint .. '|' .. attempt .. '|' .. expires .. '|' .. concat(fields, ','),
          'PX', window)
      end
    end
  end
end

-- Each bucket a call with a cache decided, written once in its final state.
if cache then
  for j = 3, #cache, 3 do
    if cache[j] then
      send(cache[j], cache[j - 2], cache[j - 1])
    end
  end
end

-- Packed in runs: `spread` (Lua's own `unpack`) puts every integer of a run on the C stack,
-- which holds some thousands at most.
local count = #reply
if count <= 256 then
  return pack('<' .. rep('d', count), spread(reply))
end
local runs = {}
for first = 1, count, 256 do
  local last = min(first + 255, count)
  runs[#runs + 1] = pack('<' .. rep('d', last - first + 1), spread(reply, first, last))
end
return concat(runs)
