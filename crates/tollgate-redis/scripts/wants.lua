-- tollgate: a board of wants for one global bucket: how many tokens each participant (a
-- process, in whichever region) wants of it, so that each can size its fair share.
--
-- The board is one hash: field the participant, value "TOKENS:EXPIRES" (decimal integers;
-- EXPIRES in milliseconds on this node's TIME). A want counts while EXPIRES is past `now`; a
-- field that has expired, or that is not in that form (no tollgate wrote it), is removed on the
-- next post. The hash expires with its last live want, so an abandoned board costs nothing.
-- Every figure stays below 2^53, so Lua's doubles hold it exactly.
--
-- KEYS[1]      the board (the store's prefix, "wants:", the bucket's key)
-- ARGV[1]      the participant (any bytes)
-- ARGV[2]      tokens wanted, 0 to 2^53 - 1: 0 removes the participant's want (it left)
-- ARGV[3]      how long the want lives, in milliseconds, 1 to 86400000 (a day); unused when
--              ARGV[2] is 0
-- Reply        { 1, then per live want (this participant's included unless it left): the
--              participant as a string, its tokens }, or { -2 } when KEYS[1] holds something
--              that is not a hash (another program's, or corrupted): nothing changed

local format, find, sub = string.format, string.find, string.sub

local MAX_TOKENS = 9007199254740991
local MAX_TTL_MS = 86400000

local board, me = KEYS[1], ARGV[1]
local tokens, ttl = tonumber(ARGV[2]), tonumber(ARGV[3])
-- The store checks these before calling; a call by hand that breaks them changes nothing.
if not tokens or tokens < 0 or tokens > MAX_TOKENS or tokens % 1 ~= 0 then
  error({ err = 'ERR tollgate: wants: tokens must be an integer from 0 to 2^53 - 1' })
end
if tokens > 0 and (not ttl or ttl < 1 or ttl > MAX_TTL_MS or ttl % 1 ~= 0) then
  error({ err = 'ERR tollgate: wants: ttl must be 1 to 86400000 milliseconds' })
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local fields = redis.pcall('HGETALL', board)
if type(fields) == 'table' and fields.err then
  if find(fields.err, 'WRONGTYPE', 1, true) then
    return { -2 }
  end
  -- Anything else (a command the user may not run, say) fails the call as Redis raised it.
  error(fields)
end

-- A field's tokens and expiry, or nil when it is not "TOKENS:EXPIRES" within range.
local function parse(value)
  local colon = find(value, ':', 1, true)
  if not colon then return nil end
  local wanted = tonumber(sub(value, 1, colon - 1))
  local expires = tonumber(sub(value, colon + 1))
  if not wanted or not expires or wanted < 1 or wanted > MAX_TOKENS or wanted % 1 ~= 0
      or expires % 1 ~= 0 or expires > now + MAX_TTL_MS then
    return nil
  end
  return wanted, expires
end

local reply = { 1 }
local stale = {}
local last = 0
for i = 1, #fields, 2 do
  local who = fields[i]
  local wanted, expires = parse(fields[i + 1])
  if not wanted or expires <= now then
    stale[#stale + 1] = who
  elseif who ~= me then
    reply[#reply + 1] = who
    reply[#reply + 1] = wanted
    if expires > last then last = expires end
  end
end

-- Removed in runs: `unpack` of a very long list would pass Lua's stack limit.
local RUN = 1000
for first = 1, #stale, RUN do
  redis.call('HDEL', board, unpack(stale, first, math.min(first + RUN - 1, #stale)))
end

if tokens > 0 then
  local expires = now + ttl
  redis.call('HSET', board, me, format('%d:%d', tokens, expires))
  reply[#reply + 1] = me
  reply[#reply + 1] = tokens
  if expires > last then last = expires end
else
  redis.call('HDEL', board, me)
end

-- The hash lives as long as its longest live want (shorter too: a participant that leaves or
-- shortens its want takes the board's expiry with it). No live want left: the HDELs above
-- emptied it, and Redis deleted it.
if last > now then
  redis.call('PEXPIRE', board, format('%d', last - now))
end
return reply
