"""The Lua scripts that make each store operation one atomic Redis call."""

from __future__ import annotations

# Shared by every script that touches reservations. A record is "cost tokens key1 expireat1 key2 …":
# the reserved amounts and the window buckets they were added to, so settle and expiry undo exactly
# what reserve did even when the clock has moved on to new buckets. unhold returns the buckets that
# still exist (they keep the TTL reserve gave them), or nil when the reservation is not open.
PRELUDE = """
local function split(s)
  local out = {}
  for w in string.gmatch(s, '%S+') do out[#out + 1] = w end
  return out
end
-- the negative of a decimal amount for HINCRBY; Redis refuses '-0', so 0 gives nil (nothing to undo)
local function negated(amount)
  if amount == '0' then return nil end
  return '-' .. amount
end
local function unhold(records, zset, id)
  local rec = redis.call('HGET', records, id)
  redis.call('ZREM', zset, id)
  if not rec then return nil end
  redis.call('HDEL', records, id)
  local p = split(rec)
  local usd, tok = negated(p[1]), negated(p[2])
  local live = {}
  for i = 3, #p, 2 do
    -- a bucket that already expired must not come back as a key without a TTL
    if redis.call('EXISTS', p[i]) == 1 then
      if usd then redis.call('HINCRBY', p[i], 'rusd', usd) end
      if tok then redis.call('HINCRBY', p[i], 'rtok', tok) end
      live[#live + 1] = p[i]
    end
  end
  return live
end
local function expire_stale(records, zset, now_ms)
  -- bounded so one call never stalls Redis; later calls finish the rest
  local ids = redis.call('ZRANGEBYSCORE', zset, '-inf', now_ms, 'LIMIT', 0, 200)
  for _, id in ipairs(ids) do unhold(records, zset, id) end
end
"""

# reserve: KEYS[1]=reservation zset (id -> expiry ms), KEYS[2]=reservation records hash,
#   KEYS[3]=tenant index set, KEYS[4]=session hash, KEYS[5..]=window buckets;
#   ARGV: now_ms, expires_ms, id, cost_nusd, tokens, max_concurrent (-1: none), deployment, tenant,
#   session (1|0), session_ttl_s, then per bucket 6 values: usd limit name, hard nusd, tokens limit name,
#   hard tokens, hard requests (-1: none for each), expireat_s
#   -> {1} admitted (or already held), or {0, name of the limit that would be crossed}
RESERVE = (
    PRELUDE
    + """
local now, zset, records = tonumber(ARGV[1]), KEYS[1], KEYS[2]
if redis.call('ZSCORE', zset, ARGV[3]) then return {1} end
expire_stale(records, zset, now)
local cost, tokens, max_conc = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
if max_conc >= 0 and redis.call('ZCARD', zset) >= max_conc then return {0, 'concurrent'} end
local n = #KEYS - 4
for i = 1, n do
  local a = 10 + (i - 1) * 6
  local h = redis.call('HMGET', KEYS[4 + i], 'usd', 'rusd', 'tok', 'rtok', 'req')
  local usd = (tonumber(h[1]) or 0) + (tonumber(h[2]) or 0)
  local tok = (tonumber(h[3]) or 0) + (tonumber(h[4]) or 0)
  local hard_usd, hard_tok, hard_req = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5])
  if hard_req >= 0 and (tonumber(h[5]) or 0) + 1 > hard_req then
    return {0, 'requests_per_minute'}
  end
  if hard_usd >= 0 and usd + cost > hard_usd then return {0, ARGV[a + 1]} end
  if hard_tok >= 0 and tok + tokens > hard_tok then return {0, ARGV[a + 3]} end
end
local rec = {ARGV[4], ARGV[5]}
for i = 1, n do
  local key, at = KEYS[4 + i], ARGV[10 + (i - 1) * 6 + 6]
  redis.call('HINCRBY', key, 'rusd', ARGV[4])
  redis.call('HINCRBY', key, 'rtok', ARGV[5])
  -- req only grows, so 1 means this reserve created the bucket: give it its TTL once
  if redis.call('HINCRBY', key, 'req', 1) == 1 then redis.call('EXPIREAT', key, at) end
  rec[#rec + 1] = key
  rec[#rec + 1] = at
end
redis.call('ZADD', zset, ARGV[2], ARGV[3])
redis.call('HSET', records, ARGV[3], table.concat(rec, ' '))
local ttl_ms = tonumber(ARGV[2]) - now + 60000
for _, k in ipairs({zset, records}) do
  if redis.call('PTTL', k) < ttl_ms then redis.call('PEXPIRE', k, ttl_ms) end
end
if ARGV[9] == '1' then
  redis.call('EXPIRE', KEYS[4], ARGV[10])
end
redis.call('SADD', KEYS[3], ARGV[8])
return {1}
"""
)

# settle: KEYS[1]=reservation zset, KEYS[2]=reservation records, KEYS[3]=session hash,
#   KEYS[4..]=the current window buckets (used only when the reservation is gone; otherwise the spend
#   goes to the buckets it was reserved in that still exist);
#   ARGV: id, cost_nusd, tokens_in, tokens_out, deployment (the one that answered), session (1|0), then
#   expireat_s per KEYS[4..]; a session's first settled step pins it to that deployment
#   -> 1 when the reservation was open, 0 when it had expired (the spend is recorded either way)
SETTLE = (
    PRELUDE
    + """
local live = unhold(KEYS[2], KEYS[1], ARGV[1])
local found = 1
local targets = {}
if live then
  for _, key in ipairs(live) do targets[#targets + 1] = {key, false} end
else
  found = 0
  for i = 4, #KEYS do targets[#targets + 1] = {KEYS[i], ARGV[7 + i - 4]} end
end
local tok = tonumber(ARGV[3]) + tonumber(ARGV[4])
local d = 'd:' .. ARGV[5] .. ':'
for _, t in ipairs(targets) do
  redis.call('HINCRBY', t[1], 'usd', ARGV[2])
  redis.call('HINCRBY', t[1], 'tok', tok)
  redis.call('HINCRBY', t[1], d .. 'usd', ARGV[2])
  redis.call('HINCRBY', t[1], d .. 'in', ARGV[3])
  redis.call('HINCRBY', t[1], d .. 'out', ARGV[4])
  redis.call('HINCRBY', t[1], d .. 'req', 1)
  if t[2] then redis.call('EXPIREAT', t[1], t[2]) end
end
if ARGV[6] == '1' and redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('HINCRBY', KEYS[3], 'cost', ARGV[2])
  redis.call('HSETNX', KEYS[3], 'pinned', ARGV[5])
end
return found
"""
)

# release: KEYS[1]=reservation zset, KEYS[2]=reservation records; ARGV[1]=id -> 1 if it was open, else 0
RELEASE = (
    PRELUDE
    + """
if unhold(KEYS[2], KEYS[1], ARGV[1]) then return 1 end
return 0
"""
)

# Counts one step of a session and reports it; the steps set bounded so a runaway loop cannot grow it.
STEP_FN = """
local function step(session, times, now, window, ttl, member)
  local steps = redis.call('HINCRBY', session, 'steps', 1)
  redis.call('ZADD', times, now, member)
  redis.call('ZREMRANGEBYSCORE', times, '-inf', now - window)
  redis.call('ZREMRANGEBYRANK', times, 0, -1001)
  redis.call('EXPIRE', session, ttl)
  redis.call('EXPIRE', times, ttl)
  local h = redis.call('HMGET', session, 'cost', 'pinned')
  return {steps, redis.call('ZCARD', times), tonumber(h[1]) or 0, h[2] or ''}
end
"""

# observe: KEYS[1]=reservation zset, KEYS[2]=reservation records, KEYS[3..6]=window buckets,
#   optional KEYS[7]=session hash, KEYS[8]=step times zset; ARGV: now_ms[, rate_window_ms, ttl_s, member]
#   -> {open reservations, {usd, rusd, tok, rtok, req} per bucket[, step result as STEP returns it]}
OBSERVE = (
    PRELUDE
    + STEP_FN
    + """
local now = tonumber(ARGV[1])
expire_stale(KEYS[2], KEYS[1], now)
local out = {redis.call('ZCARD', KEYS[1])}
for i = 3, 6 do
  out[#out + 1] = redis.call('HMGET', KEYS[i], 'usd', 'rusd', 'tok', 'rtok', 'req')
end
if #KEYS == 8 then out[#out + 1] = step(KEYS[7], KEYS[8], now, tonumber(ARGV[2]), ARGV[3], ARGV[4]) end
return out
"""
)

# step: KEYS[1]=session hash, KEYS[2]=step times zset; ARGV: now_ms, rate_window_ms, ttl_s, member
#   -> {steps, steps inside the rate window, cost_nusd, pinned deployment or ''}
STEP = STEP_FN + "return step(KEYS[1], KEYS[2], tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], ARGV[4])"
