-- tollgate: concurrency limits ("leases"): at most N requests in flight per key.
--
-- A key's leases are one sorted set: member the lease id, score the microsecond the lease ends
-- (taken at t with timeout T, it ends at t + T and counts while its end is past `now`). The
-- set expires when its last lease ends, so a key nobody uses costs nothing. A lease's record
-- names the sets it holds, so that a release, which names only the id, finds them, and the
-- timeout each was taken with, so that a renewal moves each set's end by its own; it expires
-- when the lease's last slot does. Its value is "END|" then, per set, "LEN:KEY=TIMEOUT_MS;"
-- (keys may hold any byte, so each goes with its length). A record written before renewals
-- existed has "LEN:KEY" alone: it still reads, and a renewal keeps such a set's end as it is
-- (held until then, neither extended nor shortened), since its timeout is unknown. The scripts
-- before that format read a new record as not theirs (-2): run one version at a time, or let
-- leases taken across an upgrade time out.
--
-- Every operation touches only the keys in KEYS, all in one cluster slot: a record's keys are
-- replied to the caller, which sends them back in KEYS of a later call (see `src/lease.rs` for
-- how the calls follow each other, on a single node and across cluster slots).
--
-- ARGV[1]      the operation (below)
-- ARGV[2]      now: "" to use the server's TIME (one clock for every client), or a caller's time
--              as "micros" or "micros:nanos" (nanos 1 to 999 past that microsecond). A lease
--              counts while its end is past the microsecond `now`, which is the same as past
--              the caller's nanosecond (ends are whole microseconds); a new lease's end counts
--              from the next whole microsecond (`now_up`), so it never ends before the memory
--              store's would. Unused by "unhold".
-- ARGV[3]      the lease id ("" for "look")
--
-- "acquire": take one lease on each key with a free slot, if every enforced key has one.
--   KEYS       [the record, when ARGV[4] is "1"], then the sets
--   ARGV[4]    "1" when KEYS[1] is the lease's record (a single node, or every key in the
--              record's slot): the record is checked and written in this same call; else ""
--   then per set: max in flight, timeout in milliseconds, "1" enforced or "0" soft
--   Reply      { status, now, per set: count, oldest, newest, taken, [then the stale record's
--              sets that are not among these, as strings] }
--              status 1: every enforced set had a free slot, and each set with one holds the
--                        lease (soft ones included); 0: rejected, nothing held, nothing written
--                        but ended leases dropped; -1: the id is held (its record, or a set,
--                        holds it past `now`), nothing changed, no figures; -2: see below
--              count: leases the set held before this call, ended ones left out; oldest and
--              newest: the earliest and latest of their ends (0 when none); taken: the new
--              lease's end, 0 when this set was not taken
-- "look": each set's standing, changing nothing.
--   KEYS       the sets
--   Reply      { 1, now, per set: count, oldest, newest, 0 } (leases past `now` only)
-- "claim": check and write a lease's record ahead of the sets (a cluster request whose sets
--   are not all in the record's slot).
--   KEYS       [the record]
--   then per set: its timeout in milliseconds, the set as stored
--   Reply      { 1, now, end, [then the sets of the stale record it replaced] }, or { -1, now }
--              when the id is held (nothing changed). `end`, now_up plus the longest timeout,
--              is the record's until "fix" changes it
-- "fix": rewrite a claimed record once the sets have decided: only if it is still the one
--   claimed (its end is ARGV[4]); deleted when no set holds the lease.
--   KEYS       [the record]
--   ARGV[4]    the end "claim" replied
--   ARGV[5]    the lease's last end
--   then per set it holds: its timeout in milliseconds, the set as stored
--   Reply      { 1, now } rewritten, { 0, now } the record was not the one claimed
-- "unhold": remove the lease from sets (a release, a give-back, a stale record's sets).
--   KEYS       the sets
--   Reply      { 1 }
-- "release": delete a lease's record.
--   KEYS       [the record]
--   Reply      { 1, now, end, then the sets it held }, or { 0, now, 0 } when there was none
-- "holds": a renewal's first call: read a lease's record, changing nothing.
--   KEYS       [the record]
--   Reply      { 1, now, end, per set its timeout in milliseconds (0: not recorded), then the
--              sets }, or { 0, now } when there is none or it ended at `now`
-- "renew": move the lease's end on sets where it is still held (its score past `now`) to
--   now_up plus the set's timeout, never earlier than it was; a set where it ended, or that
--   does not hold it, is left alone (its slot may be another's by now).
--   KEYS       [the record, when ARGV[4] is "1"], then the sets
--   ARGV[4]    "1" when KEYS[1] is the lease's record (every set in the record's slot, always
--              on a single node): the record must still be held and name these sets with these
--              timeouts, else nothing changes ({ 0, now }); its end then becomes the last of
--              its own and the new ones, in this same call. Else ""
--   then per set: its timeout in milliseconds, as "holds" replied it
--   Reply      { 1, now, per set its lease's end after the call (0: not held there) }
-- "prolong": a renewal across slots: once the sets have moved, the record's end becomes the
--   last of its own and ARGV[4], if it still names the same sets with the same timeouts (a
--   concurrent renewal of the lease only moves it further; a release, or a new lease under the
--   id, is left alone).
--   KEYS       [the record]
--   ARGV[4]    the last end the sets replied
--   then per set: its timeout in milliseconds, the set, as "holds" replied them
--   Reply      { 1, now } the same record (its end moved if it was earlier), { 0, now } not
--
-- Every operation but "unhold" replies { -2, now } and writes nothing when a key it reads holds
-- something that is not ours (another program's key, a corrupted record): every key is read
-- before the first write. "unhold" leaves such a key alone.
--
-- Every figure is an integer below 2^53 (microseconds since 1970 are about 2^51; a timeout is
-- at most a day; a set holds at most a million leases), so Lua's doubles and the sets' scores
-- hold them exactly.

local format, find, sub, concat = string.format, string.find, string.sub, table.concat
local op = ARGV[1]

local now, nanos
if op ~= 'unhold' then
  if ARGV[2] == '' then
    local t = redis.call('TIME')
    now = t[1] * 1000000 + t[2]
    nanos = 0
  else
    local sep = find(ARGV[2], ':', 1, true)
    if sep then
      now = tonumber(sub(ARGV[2], 1, sep - 1))
      nanos = tonumber(sub(ARGV[2], sep + 1))
    else
      now = tonumber(ARGV[2])
      nanos = 0
    end
  end
end
local now_up = now
if nanos and nanos > 0 then now_up = now + 1 end
local now_text = now and format('%d', now)

-- Redis expires keys on its own clock. On TIME that is the leases' clock, and a key expires
-- when its last lease ends. With a caller's time the two differ, so keys live at least a
-- minute, as buckets do: a key outliving its leases is harmless (they have ended by the
-- caller's clock and are dropped), one expiring early would free slots still held.
local min_ttl_ms = 1
if ARGV[2] ~= '' then
  min_ttl_ms = 60000
end

-- Milliseconds from `now` until microsecond `ends`, rounded up, at least `min_ttl_ms`, as PX
-- and PEXPIRE take them.
local function ttl_until(ends)
  local wait = ends - now
  local ttl = (wait - wait % 1000) / 1000
  if ttl * 1000 < wait then ttl = ttl + 1 end
  if ttl < min_ttl_ms then ttl = min_ttl_ms end
  return format('%d', ttl)
end

-- The reply when a key holds something that is not ours: another program's, or corrupted.
local function unreadable()
  return { -2, now }
end

-- The longest lease timeout, in milliseconds (tollgate's MAX_LEASE_TIMEOUT, a day).
local MAX_TIMEOUT_MS = 86400000

-- What `read` answers for a key of another type.
local WRONG = {}

-- Runs a command that reads a key: its reply, or WRONG when the key is of another type. Any
-- other error (a command the user may not run, say) fails the call as Redis raised it.
local function read(...)
  local reply = redis.pcall(...)
  if type(reply) == 'table' and reply.err then
    if find(reply.err, 'WRONGTYPE', 1, true) then
      return WRONG
    end
    error(reply)
  end
  return reply
end

-- The record at `key`: its end, its sets, their timeouts in milliseconds (0 for a set of a
-- record that did not say) and the text after its end (the sets, as stored); nil when absent;
-- false when the key holds anything else.
local function read_record(key)
  local value = read('GET', key)
  if not value then
    return nil
  end
  if value == WRONG then
    return false
  end
  local bar = find(value, '|', 1, true)
  local ends = bar and tonumber(sub(value, 1, bar - 1))
  if not ends then
    return false
  end
  local sets, timeouts = {}, {}
  local at = bar + 1
  while at <= #value do
    local colon = find(value, ':', at, true)
    local len = colon and tonumber(sub(value, at, colon - 1))
    if not len or colon + len > #value then
      return false
    end
    sets[#sets + 1] = sub(value, colon + 1, colon + len)
    at = colon + len + 1
    local timeout = 0
    if sub(value, at, at) == '=' then
      local semi = find(value, ';', at, true)
      timeout = semi and tonumber(sub(value, at + 1, semi - 1))
      -- A lease's timeout is whole milliseconds, at most a day: anything else is not ours.
      if not timeout or timeout < 0 or timeout > MAX_TIMEOUT_MS or timeout % 1 ~= 0 then
        return false
      end
      at = semi + 1
    end
    timeouts[#timeouts + 1] = timeout
  end
  return ends, sets, timeouts, sub(value, bar + 1)
end

-- Writes the record at `key`: the lease ends at `ends` and holds `sets`, taken with
-- `timeouts` (milliseconds, one per set).
local function write_record(key, ends, sets, timeouts)
  local parts = { format('%d|', ends) }
  for i = 1, #sets do
    parts[i + 1] = format('%d:', #sets[i]) .. sets[i] .. format('=%d;', timeouts[i])
  end
  redis.call('SET', key, concat(parts), 'PX', ttl_until(ends))
end

-- Sets the end of the record at `key` to `ends`, keeping its sets as they are stored (`body`,
-- as `read_record` gives it).
local function move_record(key, ends, body)
  redis.call('SET', key, format('%d|', ends) .. body, 'PX', ttl_until(ends))
end

-- Whether a record's `sets` and `timeouts` are `n` given ones: set i is `set_of(i)`, taken
-- with timeout `timeout_of(i)` (text, as the caller sends it).
local function same_sets(sets, timeouts, n, set_of, timeout_of)
  if #sets ~= n then
    return false
  end
  for i = 1, n do
    if sets[i] ~= set_of(i) or timeouts[i] ~= tonumber(timeout_of(i)) then
      return false
    end
  end
  return true
end

-- The earliest end in the set at `key` from score bound `from` on ("-inf", or "(NOW": past
-- `now`), and the latest end in the set.
local function ends_of(key, from)
  local first = redis.call('ZRANGEBYSCORE', key, from, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  return tonumber(first[2]), tonumber(last[2])
end

if op == 'acquire' then
  local id = ARGV[3]
  local with_record = ARGV[4] == '1'
  local first = 0
  if with_record then first = 1 end
  local n = #KEYS - first

  local stale
  if with_record then
    local ends, sets = read_record(KEYS[1])
    if ends == false then
      return unreadable()
    end
    if ends then
      if ends > now then
        return { -1, now }
      end
      stale = sets
    end
  end
  -- The id held on a set: a lease under it whose record is gone or younger elsewhere (a
  -- release between its two calls, a cluster node's clock ahead of the record's). Counting
  -- two leases as one member would over-admit, so the acquire is refused as the id's.
  -- Read first: a set that is not one fails the acquire before anything is written.
  for i = 1, n do
    local held = read('ZSCORE', KEYS[first + i], id)
    if held == WRONG then
      return unreadable()
    end
    if held and tonumber(held) > now then
      return { -1, now }
    end
  end

  -- An earlier lease under this id has ended: it goes whole, as in the memory store. On the
  -- sets of this acquire its slot has ended too, and goes with the other ended ones below;
  -- the others are replied, for the caller to remove it from.
  local leftover = {}
  if stale then
    local mine = {}
    for i = 1, n do mine[KEYS[first + i]] = true end
    for _, set in ipairs(stale) do
      if not mine[set] then leftover[#leftover + 1] = set end
    end
  end

  local reply = { 1, now }
  local passes = true
  for i = 1, n do
    local key = KEYS[first + i]
    local max = tonumber(ARGV[2 + 3 * i])
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now_text)
    local count = redis.call('ZCARD', key)
    local oldest, newest = 0, 0
    if count > 0 then
      oldest, newest = ends_of(key, '-inf')
    end
    local at = #reply
    reply[at + 1], reply[at + 2], reply[at + 3], reply[at + 4] = count, oldest, newest, 0
    if count >= max and ARGV[4 + 3 * i] == '1' then
      passes = false
    end
  end

  if passes then
    local held, held_timeouts, last = {}, {}, 0
    for i = 1, n do
      local key = KEYS[first + i]
      local max, timeout = tonumber(ARGV[2 + 3 * i]), tonumber(ARGV[3 + 3 * i])
      local at = 2 + 4 * (i - 1)
      if reply[at + 1] < max then
        local ends = now_up + timeout * 1000
        redis.call('ZADD', key, format('%d', ends), id)
        -- Until the latest lease the set holds ends: leases taken under a longer timeout (an
        -- earlier policy's) keep it alive as long as they count.
        local newest = reply[at + 3]
        if ends > newest then newest = ends end
        redis.call('PEXPIRE', key, ttl_until(newest))
        reply[at + 4] = ends
        held[#held + 1] = key
        held_timeouts[#held] = timeout
        if ends > last then last = ends end
      end
    end
    if with_record then
      if #held > 0 then
        write_record(KEYS[1], last, held, held_timeouts)
      elseif stale then
        -- Every set soft and full: no lease to release, and the ended one is gone.
        redis.call('DEL', KEYS[1])
      end
    end
  else
    reply[1] = 0
    if stale then
      redis.call('DEL', KEYS[1])
    end
  end
  for _, set in ipairs(leftover) do
    reply[#reply + 1] = set
  end
  return reply
end

if op == 'look' then
  local reply = { 1, now }
  local after = '(' .. now_text
  for i = 1, #KEYS do
    local key = KEYS[i]
    local count = read('ZCOUNT', key, after, '+inf')
    if count == WRONG then
      return unreadable()
    end
    local oldest, newest = 0, 0
    if count > 0 then
      oldest, newest = ends_of(key, after)
    end
    local at = #reply
    reply[at + 1], reply[at + 2], reply[at + 3], reply[at + 4] = count, oldest, newest, 0
  end
  return reply
end

if op == 'claim' then
  local ends, sets = read_record(KEYS[1])
  if ends == false then
    return unreadable()
  end
  if ends and ends > now then
    return { -1, now }
  end
  local mine, timeouts, longest = {}, {}, 0
  for i = 4, #ARGV - 1, 2 do
    local timeout = tonumber(ARGV[i])
    timeouts[#timeouts + 1] = timeout
    mine[#mine + 1] = ARGV[i + 1]
    if timeout > longest then longest = timeout end
  end
  local claimed = now_up + longest * 1000
  write_record(KEYS[1], claimed, mine, timeouts)
  local reply = { 1, now, claimed }
  for _, set in ipairs(sets or {}) do
    reply[#reply + 1] = set
  end
  return reply
end

if op == 'fix' then
  local ends = read_record(KEYS[1])
  if ends == false then
    return unreadable()
  end
  if ends ~= tonumber(ARGV[4]) then
    return { 0, now }
  end
  local sets, timeouts = {}, {}
  for i = 6, #ARGV - 1, 2 do
    timeouts[#timeouts + 1] = tonumber(ARGV[i])
    sets[#sets + 1] = ARGV[i + 1]
  end
  if #sets == 0 then
    redis.call('DEL', KEYS[1])
  else
    write_record(KEYS[1], tonumber(ARGV[5]), sets, timeouts)
  end
  return { 1, now }
end

if op == 'unhold' then
  local id = ARGV[3]
  for i = 1, #KEYS do
    -- A key that is not a set holds no lease of ours: nothing to remove.
    read('ZREM', KEYS[i], id)
  end
  return { 1 }
end

if op == 'release' then
  local ends, sets = read_record(KEYS[1])
  if ends == false then
    return unreadable()
  end
  if not ends then
    return { 0, now, 0 }
  end
  redis.call('DEL', KEYS[1])
  local reply = { 1, now, ends }
  for _, set in ipairs(sets) do
    reply[#reply + 1] = set
  end
  return reply
end

if op == 'holds' then
  local ends, sets, timeouts = read_record(KEYS[1])
  if ends == false then
    return unreadable()
  end
  if not ends or ends <= now then
    return { 0, now }
  end
  local reply = { 1, now, ends }
  for i = 1, #timeouts do
    reply[#reply + 1] = timeouts[i]
  end
  for i = 1, #sets do
    reply[#reply + 1] = sets[i]
  end
  return reply
end

if op == 'renew' then
  local id = ARGV[3]
  local with_record = ARGV[4] == '1'
  local first = 0
  if with_record then first = 1 end
  local n = #KEYS - first

  local record_ends, body
  if with_record then
    local ends, sets, timeouts
    ends, sets, timeouts, body = read_record(KEYS[1])
    if ends == false then
      return unreadable()
    end
    -- Released, ended, or a new lease under the id naming other sets since "holds": this
    -- renewal comes after that, when there is nothing of its lease to renew.
    if not ends or ends <= now
      or not same_sets(sets, timeouts, n,
        function(i) return KEYS[first + i] end,
        function(i) return ARGV[4 + i] end) then
      return { 0, now }
    end
    record_ends = ends
  end
  -- Every set is read before the first write.
  local scores = {}
  for i = 1, n do
    local score = read('ZSCORE', KEYS[first + i], id)
    if score == WRONG then
      return unreadable()
    end
    scores[i] = score and tonumber(score)
  end

  local reply = { 1, now }
  local last = 0
  for i = 1, n do
    local key = KEYS[first + i]
    local ends = scores[i]
    if ends and ends > now then
      local wanted = now_up + tonumber(ARGV[4 + i]) * 1000
      if wanted > ends then
        local newest = tonumber(redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2])
        redis.call('ZADD', key, 'XX', format('%d', wanted), id)
        -- The set lives until its latest lease ends: longer only when this one is now it.
        if wanted > newest then
          redis.call('PEXPIRE', key, ttl_until(wanted))
        end
        ends = wanted
      end
      if ends > last then last = ends end
    else
      ends = 0
    end
    reply[#reply + 1] = ends
  end
  if with_record and last > record_ends then
    move_record(KEYS[1], last, body)
  end
  return reply
end

if op == 'prolong' then
  local ends, sets, timeouts, body = read_record(KEYS[1])
  if ends == false then
    return unreadable()
  end
  local n = (#ARGV - 4) / 2
  if not ends or not same_sets(sets, timeouts, n,
      function(i) return ARGV[4 + 2 * i] end,
      function(i) return ARGV[3 + 2 * i] end) then
    return { 0, now }
  end
  local last = tonumber(ARGV[4])
  if last > ends then
    move_record(KEYS[1], last, body)
  end
  return { 1, now }
end

error({ err = 'ERR tollgate: unknown lease operation' })
