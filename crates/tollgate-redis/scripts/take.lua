-- tollgate: decide one or more requests, each taking tokens from its buckets all or nothing.
--
-- Several independent requests may share one call (the client batches concurrent callers):
-- Redis then pays its per-call cost once for all of them. Each request is decided on its own,
-- as if it had its own call, in the order given.
--
-- A request can also peek (decide without writing) or refund: give back what an earlier take
-- charged, when a request spanning several cluster slots was charged in one slot and rejected in
-- another. Refunding the exact cost restores the balance the bucket would have had uncharged
-- (clamped at full), so the store may briefly under-admit between charge and refund, never
-- over-admit.
--
-- ARGV[1]      now in microseconds, or "" to use the server's TIME (one clock for every client)
-- ARGV[2]      m, the number of requests in this call
-- then, per request:
--   n            the number of buckets
--   window       idempotency window in milliseconds, or "" when the request has no id
--   fingerprint  the request's content, or "" when it has no id
--   mode         "take"; "peek" to decide without writing anything; "refund" to give back
--                `cost` from each bucket and forget the request's record
--   per bucket, one 24-byte argument: three little-endian doubles, a, cap and cost
--     a    units gained per microsecond
--     cap  capacity in units (capacity * units per token)
--     cost cost in units (tokens * units per token)
--   (binary because `tonumber` on a decimal string runs `strtod` twice: read that way, the three
--   figures cost about a seventh of Redis' instructions per decision; each is an integer below
--   2^51, so its double is exact)
-- KEYS: per request, its n bucket keys, then its idempotency record key when it has an id.
-- All keys of one call are in one cluster slot.
--
-- A bucket is one string: the microsecond at which it is full again, and, when a > 1, the
-- sub-microsecond remainder: "full" or "full:frac", meaning the bucket is full at
-- (full * a - frac) units. Absent means full. The key expires exactly when the bucket is full,
-- so expiry loses nothing.
--
-- Every figure stays below 2^53 (the caller refuses limits whose cap passes 2^51), so the
-- doubles Lua computes with hold them exactly.
--
-- Reply: per request, 1 + 2n integers: { status, allowed_1, deficit_1, ..., allowed_n, deficit_n }
--   (a refund answers status 1 and each bucket's deficit after it)
--   status 1: every bucket allowed and charged; 0: rejected, nothing charged;
--          2: a retry of a recorded request, its first reply returned, nothing charged;
--         -1: the request id was recorded for different content (buckets reported as 0, 0).
--   deficit_i: units bucket i is short of full afterwards (when rejected: as it stands, since
--   nothing was charged).

local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[1])
end

-- x / a rounded up, exactly: the division is in doubles, so correct it by one either way.
local function ceil_div(x, a)
  local q = math.floor(x / a)
  if q * a < x then q = q + 1 end
  if q > 0 and (q - 1) * a >= x then q = q - 1 end
  return q
end

local function deficit_of(key, a)
  local state = redis.call('GET', key)
  if not state then
    return 0
  end
  local sep = string.find(state, ':', 1, true)
  local full, frac
  if sep then
    full = tonumber(string.sub(state, 1, sep - 1))
    frac = tonumber(string.sub(state, sep + 1))
  else
    full = tonumber(state)
    frac = 0
  end
  if full > now then
    return (full - now) * a - frac
  end
  return 0
end

-- Redis expires keys on its own clock. On TIME that is the decisions' clock, and a key expires
-- exactly when its bucket is full. With a caller-supplied time the two clocks differ, so keys
-- live at least a minute: a key outliving its bucket's refill is harmless (it reads as full),
-- one expiring early would mint tokens.
local min_ttl_ms = 1
if ARGV[1] ~= '' then
  min_ttl_ms = 60000
end

-- Stores a bucket `deficit` units short of full, expiring when it is full again.
local function write(key, deficit, a)
  if deficit <= 0 then
    redis.call('DEL', key)
    return
  end
  local micros = ceil_div(deficit, a)
  local frac = micros * a - deficit
  local value
  if frac == 0 then
    value = string.format('%d', now + micros)
  else
    value = string.format('%d:%d', now + micros, frac)
  end
  -- The TTL goes as an integer string: Redis turns a Lua number argument into a 17-digit float
  -- string and SET parses it back, which measurably costs more than formatting it here.
  local ttl = string.format('%d', math.max(min_ttl_ms, ceil_div(micros, 1000)))
  redis.call('SET', key, value, 'PX', ttl)
end

local reply = {}
local k = 0 -- keys used so far
local v = 2 -- arguments used so far

for _ = 1, tonumber(ARGV[2]) do
  local n = tonumber(ARGV[v + 1])
  local window = ARGV[v + 2]
  local fingerprint = ARGV[v + 3]
  local mode = ARGV[v + 4]
  local dry = mode == 'peek'
  local params = v + 4
  v = v + 4 + n
  local first_key = k
  k = k + n
  local record
  if window ~= '' then
    k = k + 1
    record = KEYS[k]
  end
  local at = #reply + 1

  -- A record lives for the window on the request's clock (TIME, or the caller's time) as well
  -- as by its PX, so replays with caller-supplied time expire exactly as in the memory store.
  local replayed = false
  if mode == 'refund' then
    replayed = true
    reply[at] = 1
    for i = 1, n do
      local a, _, cost = struct.unpack('<ddd', ARGV[params + i])
      local deficit = math.max(0, deficit_of(KEYS[first_key + i], a) - cost)
      write(KEYS[first_key + i], deficit, a)
      reply[at + 2 * i - 1] = 1
      reply[at + 2 * i] = deficit
    end
    if record then
      redis.call('DEL', record)
    end
  elseif record and not dry then
    local seen = redis.call('GET', record)
    if seen then
      local content, expires, fields = string.match(seen, '^([^|]*)|([^|]*)|(.*)$')
      if expires and tonumber(expires) > now then
        replayed = true
        if content ~= fingerprint then
          reply[at] = -1
          for i = 1, 2 * n do reply[at + i] = 0 end
        else
          reply[at] = 2
          local i = 0
          for field in string.gmatch(fields, '[^,]+') do
            i = i + 1
            reply[at + i] = tonumber(field)
          end
        end
      end
    end
  end

  if not replayed then
    local deficits = {}
    local all = true
    for i = 1, n do
      local a, cap, cost = struct.unpack('<ddd', ARGV[params + i])
      local deficit = deficit_of(KEYS[first_key + i], a)
      deficits[i] = deficit
      if deficit + cost <= cap then
        reply[at + 2 * i - 1] = 1
        reply[at + 2 * i] = deficit + cost
      else
        all = false
        reply[at + 2 * i - 1] = 0
        reply[at + 2 * i] = deficit
      end
    end

    if dry then
      -- A peek: each bucket's own verdict, nothing written.
      reply[at] = all and 1 or 0
    elseif all then
      reply[at] = 1
      for i = 1, n do
        write(KEYS[first_key + i], reply[at + 2 * i], (struct.unpack('<d', ARGV[params + i])))
      end
      if record then
        local fields = {}
        for i = 1, 2 * n do
          fields[i] = string.format('%d', reply[at + i])
        end
        local expires = string.format('%d', now + tonumber(window) * 1000)
        redis.call('SET', record, fingerprint .. '|' .. expires .. '|' .. table.concat(fields, ','),
          'PX', window)
      end
    else
      -- Nothing is charged: every bucket reports its balance as it stands.
      reply[at] = 0
      for i = 1, n do
        reply[at + 2 * i] = deficits[i]
      end
    end
  end
end

return reply
