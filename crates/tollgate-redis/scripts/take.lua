-- tollgate: take tokens from one or more buckets, all or nothing, in one atomic step.
--
-- KEYS[1..n]   bucket keys (one slot: the caller groups keys by cluster slot)
-- KEYS[n+1]    optional: the idempotency record of this request
--
-- ARGV[1]      now in microseconds, or "" to use the server's TIME (one clock for every client)
-- ARGV[2]      n, the number of buckets
-- ARGV[3]      idempotency window in milliseconds ("" when there is no record key)
-- ARGV[4]      fingerprint of the request's content ("" when there is no record key)
-- ARGV[5..]    per bucket, four integers: a, p, cap, cost
--                a    units gained per microsecond
--                p    units per token
--                cap  capacity in units (capacity * p)
--                cost cost in units (tokens * p)
--
-- A bucket is one string: the microsecond at which it is full again, and, when a > 1, the
-- sub-microsecond remainder: "full" or "full:frac", meaning the bucket is full at
-- (full * a - frac) units. Absent means full. The key expires exactly when the bucket is full,
-- so expiry loses nothing.
--
-- Every figure stays below 2^53 (the caller refuses limits whose cap passes 2^51), so the
-- doubles Lua computes with hold them exactly.
--
-- Reply: { status, allowed_1, deficit_1, ..., allowed_n, deficit_n }
--   status 1: every bucket allowed and charged; 0: rejected, nothing charged;
--          2: a retry of a recorded request, its first reply returned, nothing charged;
--         -1: the request id was recorded for different content.
--   deficit_i: units bucket i is short of full afterwards (when rejected: as it stands, since
--   nothing was charged).

local n = tonumber(ARGV[2])
local record = KEYS[n + 1]

local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[1])
end

-- A record lives for the window on the request's clock (TIME, or the caller's time) as well as
-- by its PX, so replays with caller-supplied time expire exactly as in the memory store.
if record then
  local seen = redis.call('GET', record)
  if seen then
    local content, expires, fields = string.match(seen, '^([^|]*)|([^|]*)|(.*)$')
    if expires and tonumber(expires) > now then
      if content ~= ARGV[4] then
        return { -1 }
      end
      local reply = { 2 }
      for field in string.gmatch(fields, '[^,]+') do
        reply[#reply + 1] = tonumber(field)
      end
      return reply
    end
  end
end

-- x / a rounded up, exactly: the division is in doubles, so correct it by one either way.
local function ceil_div(x, a)
  local q = math.floor(x / a)
  if q * a < x then q = q + 1 end
  if q > 0 and (q - 1) * a >= x then q = q - 1 end
  return q
end

local reply = { 1 }
local deficits = {}
local all = true
for i = 1, n do
  local base = 4 + (i - 1) * 4
  local a = tonumber(ARGV[base + 1])
  local cap = tonumber(ARGV[base + 3])
  local cost = tonumber(ARGV[base + 4])
  local deficit = 0
  local state = redis.call('GET', KEYS[i])
  if state then
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
      deficit = (full - now) * a - frac
    end
  end
  deficits[i] = deficit
  if deficit + cost <= cap then
    reply[2 * i] = 1
    reply[2 * i + 1] = deficit + cost
  else
    all = false
    reply[2 * i] = 0
    reply[2 * i + 1] = deficit
  end
end

if not all then
  -- Nothing is charged: every bucket reports its balance as it stands.
  reply[1] = 0
  for i = 1, n do
    reply[2 * i + 1] = deficits[i]
  end
  return reply
end

for i = 1, n do
  local a = tonumber(ARGV[4 + (i - 1) * 4 + 1])
  local deficit = reply[2 * i + 1]
  local micros = ceil_div(deficit, a)
  local frac = micros * a - deficit
  local value
  if frac == 0 then
    value = string.format('%d', now + micros)
  else
    value = string.format('%d:%d', now + micros, frac)
  end
  redis.call('SET', KEYS[i], value, 'PX', math.max(1, ceil_div(micros, 1000)))
end

if record then
  local fields = {}
  for i = 2, #reply do
    fields[#fields + 1] = string.format('%d', reply[i])
  end
  local expires = string.format('%d', now + tonumber(ARGV[3]) * 1000)
  redis.call('SET', record, ARGV[4] .. '|' .. expires .. '|' .. table.concat(fields, ','), 'PX', ARGV[3])
end
return reply
