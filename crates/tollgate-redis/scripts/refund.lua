-- tollgate: give back what take.lua charged, when a request spanning several cluster slots was
-- charged in one slot and rejected in another. Refunding the exact cost restores the balance
-- the bucket would have had uncharged (clamped at full), so the store may briefly under-admit
-- (between charge and refund) but never over-admits.
--
-- KEYS[1..n]   bucket keys, as charged
-- KEYS[n+1]    optional: the idempotency record the charge left, to forget
--
-- ARGV[1]      now in microseconds, or "" to use the server's TIME
-- ARGV[2]      n, the number of buckets
-- ARGV[3..]    per bucket, two integers: a (units per microsecond), cost (units to give back)
--
-- Reply: { the number of buckets refunded }.

local n = tonumber(ARGV[2])

local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[1])
end

local function ceil_div(x, a)
  local q = math.floor(x / a)
  if q * a < x then q = q + 1 end
  if q > 0 and (q - 1) * a >= x then q = q - 1 end
  return q
end

for i = 1, n do
  local a = tonumber(ARGV[3 + (i - 1) * 2])
  local cost = tonumber(ARGV[4 + (i - 1) * 2])
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
    local deficit = 0
    if full > now then
      deficit = (full - now) * a - frac
    end
    deficit = deficit - cost
    if deficit <= 0 then
      redis.call('DEL', KEYS[i])
    else
      local micros = ceil_div(deficit, a)
      local rest = micros * a - deficit
      local value
      if rest == 0 then
        value = string.format('%d', now + micros)
      else
        value = string.format('%d:%d', now + micros, rest)
      end
      redis.call('SET', KEYS[i], value, 'PX', math.max(1, ceil_div(micros, 1000)))
    end
  end
end

if KEYS[n + 1] then
  redis.call('DEL', KEYS[n + 1])
end
return { n }
