//! Token leasing: a process takes a batch of a hot key's tokens from Redis and spends it here,
//! so that most checks of that key cost no round trip and no script run.
//!
//! A key checked thousands of times a second under its limit costs Redis a script call per
//! check, all on the one core that decides every key; the answer is nearly always "allowed".
//! Taking `cost + extra` in one check and answering the next checks from the `extra` trades
//! those calls for a bounded under-admission: tokens this process holds are charged in Redis,
//! so no other process can admit them, and nothing is ever admitted that Redis did not charge
//! (no over-admission, whatever the interleaving). What is held and not spent goes back with
//! [`tollgate::Store::settle`] under the batch's own request id, once, when the batch expires,
//! runs short or the process shuts down.
//!
//! Only what the memory of rejections may answer is batched (one token bucket, on Redis'
//! clock, no request id, no carry), and only for keys this process sees often: a key must be
//! checked [`HOT_CHECKS`] times within a [`SPAN`] first, and a batch holds at most what the key
//! asked for in a span, the configured most, and an eighth of the capacity (none when that is
//! below [`MIN_EXTRA`]). So a process holds at most one batch per key, of at most that size.
//!
//! While one request fetches (or gives back) a key's batch, the key's other requests go to
//! Redis as plain checks rather than wait: waiting would tie their latency, and their failure,
//! to one call they did not make, and a plain check is exactly what they would get without
//! batching.
//!
//! This module keeps the books (which key holds what, who may fetch); `store.rs` makes the
//! calls.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tollgate::{Decision, Limit, Timestamp};

/// Shards of the books, so concurrent checks on different keys rarely share a lock.
const SHARDS: usize = 16;

/// Keys followed per shard. Beyond it, keys that hold no batch are forgotten (they start
/// counting again); when every one holds a batch, new keys are not followed and go to Redis.
const KEYS_PER_SHARD: usize = 1_024;

/// The span over which a key's checks are counted.
pub(crate) const SPAN: Duration = Duration::from_millis(100);

/// Checks within a span that make a key hot (80 a second): below it a batch would mostly sit
/// unused until it expires, an under-admission for nothing saved.
pub(crate) const HOT_CHECKS: u32 = 8;

/// The fewest tokens worth holding: a batch of one saves at most one call, for a call of its
/// own (the batch's settlement).
pub(crate) const MIN_EXTRA: u64 = 2;

/// A batch holds at most the capacity divided by this, so that the processes holding batches
/// of one key cannot keep much of its capacity from each other.
pub(crate) const CAPACITY_SHARE: u64 = 8;

/// Give-backs waiting for the next sweep (calls that failed, or whose caller gave up, so that
/// Redis may or may not hold their charge): at most this many, the oldest dropped first.
const MAX_DOUBTFUL: usize = 10_000;

/// Tokens this process holds from Redis for one key.
#[derive(Debug)]
pub(crate) struct Held {
    /// The bucket's key, as stored (with the prefix).
    pub(crate) key: String,
    pub(crate) limit: Limit,
    /// Tokens not spent yet.
    pub(crate) left: u64,
    /// When it was taken, on this process's monotonic clock.
    pub(crate) taken: Timestamp,
    /// What settles it: the request id and the whole cost of the check that took it.
    pub(crate) request_id: String,
    pub(crate) cost: u64,
    /// Whether Redis is known to have charged it (a call that failed may or may not have).
    pub(crate) doubtful: bool,
}

/// What a check of one token bucket should do.
pub(crate) enum Plan<'a> {
    /// Answered here, from the key's batch.
    Spent(Decision),
    /// A plain check, as without batching.
    Plain,
    /// Ask Redis for `cost + extra`, with `batch.request_id`, keeping `extra` if admitted; the
    /// key's other requests go plain meanwhile.
    Fetch { extra: u64, turn: Turn<'a> },
    /// Give `batch` back (it expired, ran short or belongs to another limit) beside a plain
    /// check; no batch is fetched for the key meanwhile.
    Return { batch: Held, turn: Turn<'a> },
}

/// A key's right to fetch or give back its batch: one request at a time. Dropped, it lets the
/// next request have a turn; a fetch it was given that never settled into a batch (the call
/// failed, or its caller gave up) is kept for the sweep to give back, as Redis may hold it.
pub(crate) struct Turn<'a> {
    books: &'a TokenBatches,
    key: String,
    /// The fetch in flight, until it is known to be kept or refused.
    pending: Option<Held>,
}

impl Turn<'_> {
    /// The request id of the fetch this turn is for.
    pub(crate) fn request_id(&self) -> &str {
        self.pending.as_ref().map_or("", |held| &held.request_id)
    }

    /// Redis admitted the fetch: the batch's `extra` tokens are this key's to spend.
    pub(crate) fn keep(mut self, extra: u64) {
        let Some(mut held) = self.pending.take() else {
            return;
        };
        held.left = extra;
        let books = self.books;
        books.stats.batches.fetch_add(1, Ordering::Relaxed);
        books.stats.taken.fetch_add(extra, Ordering::Relaxed);
        books.stats.held.fetch_add(extra, Ordering::Relaxed);
        let mut shard = books.shard(&self.key);
        // A key with a turn is never forgotten (see `admit`).
        if let Some(entry) = shard.get_mut(&self.key) {
            entry.batch = Some(held);
        }
    }

    /// Redis refused the fetch (the bucket has less than `cost + extra`): nothing was charged,
    /// and the key asks for no batch until a span has passed.
    pub(crate) fn refused(mut self, now: Timestamp) {
        self.pending = None;
        if let Some(entry) = self.books.shard(&self.key).get_mut(&self.key) {
            entry.quiet_until = Some(now + SPAN);
        }
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        if let Some(mut held) = self.pending.take() {
            held.doubtful = true;
            self.books.doubt(held);
        }
        if let Some(entry) = self.books.shard(&self.key).get_mut(&self.key) {
            entry.busy = false;
        }
    }
}

/// What this process knows of one key.
struct Entry {
    /// The span checks are being counted in: its start, and the checks and tokens so far.
    span: Timestamp,
    checks: u32,
    tokens: u64,
    /// The span before, when it was the one just before this one (else zeros).
    last_checks: u32,
    last_tokens: u64,
    batch: Option<Held>,
    /// A fetch or a give-back is in flight.
    busy: bool,
    /// No batch is asked for before this (Redis refused the last one).
    quiet_until: Option<Timestamp>,
}

impl Entry {
    fn new(now: Timestamp) -> Self {
        Self {
            span: now,
            checks: 0,
            tokens: 0,
            last_checks: 0,
            last_tokens: 0,
            batch: None,
            busy: false,
            quiet_until: None,
        }
    }

    fn count(&mut self, now: Timestamp, cost: u64) {
        let since = now.saturating_duration_since(self.span);
        if since >= SPAN {
            (self.last_checks, self.last_tokens) = if since < 2 * SPAN {
                (self.checks, self.tokens)
            } else {
                (0, 0)
            };
            (self.span, self.checks, self.tokens) = (now, 0, 0);
        }
        self.checks = self.checks.saturating_add(1);
        self.tokens = self.tokens.saturating_add(cost);
    }

    /// Whether the key may be forgotten: it holds nothing and nothing is in flight.
    fn idle(&self) -> bool {
        self.batch.is_none() && !self.busy
    }
}

/// Counters of token leasing, for metrics (see [`crate::RedisStore::token_batch_stats`]).
#[derive(Default)]
struct Counters {
    batches: AtomicU64,
    taken: AtomicU64,
    spent: AtomicU64,
    returned: AtomicU64,
    lost: AtomicU64,
    held: AtomicU64,
}

/// What token leasing has done so far in this process (see
/// [`RedisConfig::with_token_batches`](crate::RedisConfig::with_token_batches)). Tokens taken
/// are later spent, returned or lost, or still held: `taken = spent + returned + lost + held`,
/// give or take the give-backs in flight.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TokenBatchStats {
    /// Batches taken from Redis.
    pub batches: u64,
    /// Tokens taken in batches (beyond the cost of the checks that took them).
    pub taken: u64,
    /// Tokens of batches spent here: checks admitted without a call.
    pub spent: u64,
    /// Unused tokens given back to Redis.
    pub returned: u64,
    /// Unused tokens that could not be given back (the call failed, or Redis had forgotten the
    /// batch: a restart, a flush): an under-admission until their bucket refills.
    pub lost: u64,
    /// Tokens held now, not spent yet.
    pub held: u64,
}

/// The batches this process holds, by bucket key (as stored, with the prefix).
pub(crate) struct TokenBatches {
    shards: Box<[Mutex<HashMap<String, Entry>>]>,
    hasher: RandomState,
    max_tokens: u64,
    ttl: Duration,
    /// Batches whose fetch failed or was abandoned: given back at the next sweep, in case
    /// Redis charged them.
    doubtful: Mutex<Vec<Held>>,
    /// Request ids: randomly keyed, so processes sharing a Redis do not repeat each other's.
    ids: (RandomState, AtomicU64),
    stats: Counters,
}

impl TokenBatches {
    /// Batches of at most `max_tokens` tokens kept at most `ttl`; `None` for 0 tokens (off).
    pub(crate) fn new(max_tokens: u64, ttl: Duration) -> Option<Self> {
        (max_tokens > 0).then(|| Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: RandomState::new(),
            max_tokens,
            ttl,
            doubtful: Mutex::default(),
            ids: (RandomState::new(), AtomicU64::new(0)),
            stats: Counters::default(),
        })
    }

    fn shard(&self, key: &str) -> MutexGuard<'_, HashMap<String, Entry>> {
        let index = (self.hasher.hash_one(key) as usize) % self.shards.len();
        // A poisoned shard only means a panic elsewhere mid-update; its map is still whole.
        self.shards[index]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// What a check of `cost` from `key`'s bucket under `limit` (a token bucket) should do at
    /// `now`, counting the check towards the key's heat.
    pub(crate) fn plan(&self, key: &str, limit: &Limit, cost: u64, now: Timestamp) -> Plan<'_> {
        let mut shard = self.shard(key);
        let Some(entry) = Self::admit(&mut shard, key, now) else {
            return Plan::Plain;
        };
        entry.count(now, cost);
        let mut retired = None;
        if let Some(batch) = &mut entry.batch {
            let expired = now.saturating_duration_since(batch.taken) >= self.ttl;
            if batch.limit == *limit && !expired && batch.left >= cost {
                batch.left -= cost;
                self.stats.spent.fetch_add(cost, Ordering::Relaxed);
                self.stats.held.fetch_sub(cost, Ordering::Relaxed);
                return Plan::Spent(spent(limit, cost, batch.left));
            }
            retired = entry.batch.take();
        }
        if let Some(batch) = retired {
            self.stats.held.fetch_sub(batch.left, Ordering::Relaxed);
            if batch.left == 0 {
                // Spent to the last token: nothing to give back.
            } else {
                entry.busy = true;
                let turn = Turn {
                    books: self,
                    key: key.to_owned(),
                    pending: None,
                };
                return Plan::Return { batch, turn };
            }
        }
        if entry.busy || entry.quiet_until.is_some_and(|until| now < until) {
            return Plan::Plain;
        }
        if entry.checks.max(entry.last_checks) < HOT_CHECKS {
            return Plan::Plain;
        }
        let extra = self
            .max_tokens
            .min(limit.capacity() / CAPACITY_SHARE)
            .min(entry.tokens.max(entry.last_tokens))
            .min(limit.capacity().saturating_sub(cost));
        if extra < MIN_EXTRA {
            return Plan::Plain;
        }
        entry.busy = true;
        let (hasher, count) = &self.ids;
        let request_id = format!(
            "tb-{:016x}",
            hasher.hash_one(count.fetch_add(1, Ordering::Relaxed))
        );
        Plan::Fetch {
            extra,
            turn: Turn {
                books: self,
                key: key.to_owned(),
                pending: Some(Held {
                    key: key.to_owned(),
                    limit: *limit,
                    // What a give-back in doubt returns: the batch, not the check's own cost.
                    left: extra,
                    taken: now,
                    request_id,
                    cost: cost + extra,
                    doubtful: false,
                }),
            },
        }
    }

    /// `key`'s entry, made if need be; `None` when its shard is full of keys holding batches.
    fn admit<'m>(
        shard: &'m mut HashMap<String, Entry>,
        key: &str,
        now: Timestamp,
    ) -> Option<&'m mut Entry> {
        if !shard.contains_key(key) {
            if shard.len() >= KEYS_PER_SHARD {
                // Keys quiet for two spans first; then, if that freed nothing, every idle key.
                shard.retain(|_, entry| {
                    !entry.idle() || now.saturating_duration_since(entry.span) < 2 * SPAN
                });
                if shard.len() >= KEYS_PER_SHARD {
                    shard.retain(|_, entry| !entry.idle());
                }
                if shard.len() >= KEYS_PER_SHARD {
                    return None;
                }
            }
            shard.insert(key.to_owned(), Entry::new(now));
        }
        shard.get_mut(key)
    }

    /// Takes out the batches to give back at `now`: the expired ones (every one, with
    /// `everything`), and the fetches in doubt. Their keys stay busy until their turns drop.
    pub(crate) fn retire(&self, now: Timestamp, everything: bool) -> Vec<(Held, Turn<'_>)> {
        let mut retired = Vec::new();
        for shard in self.shards.iter() {
            let mut shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
            shard.retain(|_, entry| {
                !entry.idle() || now.saturating_duration_since(entry.span) < 2 * SPAN
            });
            for (key, entry) in shard.iter_mut() {
                let due = entry.batch.as_ref().is_some_and(|batch| {
                    everything || now.saturating_duration_since(batch.taken) >= self.ttl
                });
                if !due {
                    continue;
                }
                let Some(batch) = entry.batch.take() else {
                    continue;
                };
                self.stats.held.fetch_sub(batch.left, Ordering::Relaxed);
                if batch.left > 0 {
                    entry.busy = true;
                    let turn = Turn {
                        books: self,
                        key: key.clone(),
                        pending: None,
                    };
                    retired.push((batch, turn));
                }
            }
        }
        let doubtful =
            std::mem::take(&mut *self.doubtful.lock().unwrap_or_else(PoisonError::into_inner));
        for batch in doubtful {
            let turn = Turn {
                books: self,
                key: String::new(),
                pending: None,
            };
            retired.push((batch, turn));
        }
        retired
    }

    /// Keeps `held`, a fetch that may or may not have charged Redis, for the next sweep.
    fn doubt(&self, held: Held) {
        let mut doubtful = self.doubtful.lock().unwrap_or_else(PoisonError::into_inner);
        if doubtful.len() >= MAX_DOUBTFUL {
            doubtful.remove(0);
        }
        doubtful.push(held);
    }

    /// Counts the outcome of giving `batch` back: `Some(true)` settled, `Some(false)` found
    /// nothing to settle (Redis forgot it, or settled it before), `None` the call failed.
    pub(crate) fn returned(&self, batch: &Held, outcome: Option<bool>) {
        let counter = match (outcome, batch.doubtful) {
            (Some(true), false) => &self.stats.returned,
            (_, false) => &self.stats.lost,
            // A fetch in doubt that Redis did charge: taken and given back. One it did not
            // (or that cannot be told) was never counted as taken.
            (Some(true), true) => {
                self.stats.batches.fetch_add(1, Ordering::Relaxed);
                self.stats.taken.fetch_add(batch.left, Ordering::Relaxed);
                &self.stats.returned
            }
            (_, true) => return,
        };
        counter.fetch_add(batch.left, Ordering::Relaxed);
    }

    /// The counters so far.
    pub(crate) fn stats(&self) -> TokenBatchStats {
        let read = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        TokenBatchStats {
            batches: read(&self.stats.batches),
            taken: read(&self.stats.taken),
            spent: read(&self.stats.spent),
            returned: read(&self.stats.returned),
            lost: read(&self.stats.lost),
            held: read(&self.stats.held),
        }
    }
}

/// The answer to a check of `cost` spent from a batch that holds `left` after it: the tokens
/// this process still holds are the only ones certain to be there (others may have emptied the
/// rest of the bucket in Redis), so `remaining` is `left` and `reset_after` the time to refill
/// the rest at the limit's rate: never more than the bucket holds, never sooner than it is
/// full.
pub(crate) fn spent(limit: &Limit, cost: u64, left: u64) -> Decision {
    let missing = limit.capacity().saturating_sub(left);
    Decision::from_deficit(
        true,
        *limit,
        cost,
        u128::from(missing) * u128::from(limit.units_per_token()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(millis: u64) -> Timestamp {
        Timestamp::from_nanos(millis * 1_000_000)
    }

    fn limit(capacity: u64) -> Limit {
        Limit::new(capacity, "1/h".parse().unwrap()).unwrap()
    }

    /// Warms `key` up with plain checks until a fetch is planned, all at `now`.
    fn heat<'a>(books: &'a TokenBatches, key: &str, limit: &Limit, now: Timestamp) -> Plan<'a> {
        for _ in 0..HOT_CHECKS - 1 {
            assert!(matches!(books.plan(key, limit, 1, now), Plan::Plain));
        }
        books.plan(key, limit, 1, now)
    }

    #[test]
    fn a_cold_key_is_never_batched_and_a_hot_one_is_batched_to_its_demand() {
        let books = TokenBatches::new(100, Duration::from_secs(1)).unwrap();
        let l = limit(1_000);
        for span in 0..20 {
            for _ in 0..HOT_CHECKS - 1 {
                assert!(matches!(
                    books.plan("cold", &l, 1, at(span * 100)),
                    Plan::Plain
                ));
            }
        }
        match heat(&books, "hot", &l, at(0)) {
            // Eight tokens asked in the span so far: a batch of eight.
            Plan::Fetch { extra, turn } => {
                assert_eq!(extra, u64::from(HOT_CHECKS));
                assert!(turn.request_id().starts_with("tb-"));
            }
            _ => panic!("a hot key fetches"),
        }
        assert_eq!(
            books.stats(),
            TokenBatchStats::default(),
            "nothing taken yet"
        );
    }

    #[test]
    fn a_batch_is_at_most_the_configured_most_and_an_eighth_of_the_capacity() {
        let books = TokenBatches::new(5, Duration::from_secs(1)).unwrap();
        let asked = |l: &Limit, cost: u64| {
            for _ in 0..100 {
                if let Plan::Fetch { extra, .. } = books.plan("k", l, cost, at(0)) {
                    return Some(extra);
                }
            }
            None
        };
        assert_eq!(asked(&limit(1_000), 1), Some(5));
        // Demand of a thousand tokens in the span before: the caps decide.
        let books = TokenBatches::new(1_000, Duration::from_secs(1)).unwrap();
        let asked = |key: &str, l: &Limit, cost: u64| {
            for _ in 0..1_000 {
                let _ = books.plan(key, l, cost, at(0));
            }
            match books.plan(key, l, cost, at(100)) {
                Plan::Fetch { extra, .. } => Some(extra),
                _ => None,
            }
        };
        assert_eq!(asked("a", &limit(800), 1), Some(100));
        // An eighth of 15 is one token: not worth a batch.
        assert_eq!(asked("b", &limit(15), 1), None);
        // An eighth of 16 is two: the smallest batch worth holding.
        assert_eq!(asked("d", &limit(16), 1), Some(MIN_EXTRA));
        // The batch and the cost together stay within the capacity.
        assert_eq!(asked("c", &limit(64), 60), Some(4));
    }

    #[test]
    fn a_kept_batch_is_spent_here_then_given_back_once_when_it_expires() {
        let books = TokenBatches::new(10, Duration::from_secs(1)).unwrap();
        let l = limit(1_000);
        let Plan::Fetch { extra, turn } = heat(&books, "k", &l, at(0)) else {
            panic!("a hot key fetches");
        };
        assert_eq!(extra, 8);
        // Meanwhile the key's other checks go to Redis.
        assert!(matches!(books.plan("k", &l, 1, at(1)), Plan::Plain));
        turn.keep(extra);
        for left in (5..8).rev() {
            let Plan::Spent(decision) = books.plan("k", &l, 1, at(2)) else {
                panic!("spent here");
            };
            assert!(decision.allowed());
            assert_eq!(decision.remaining(), left);
            assert_eq!(decision.cost(), 1);
            assert_eq!(
                decision.reset_after(),
                Duration::from_secs(3600 * (1_000 - left))
            );
        }
        let stats = books.stats();
        assert_eq!(
            (stats.batches, stats.taken, stats.spent, stats.held),
            (1, 8, 3, 5)
        );
        // Not due before the TTL; due after, once.
        assert!(books.retire(at(999), false).is_empty());
        let mut retired = books.retire(at(1_000), false);
        assert_eq!(retired.len(), 1);
        let (batch, turn) = retired.pop().unwrap();
        assert_eq!((batch.left, batch.cost), (5, 9));
        assert!(
            matches!(books.plan("k", &l, 1, at(1_001)), Plan::Plain),
            "busy"
        );
        books.returned(&batch, Some(true));
        drop(turn);
        assert!(books.retire(at(5_000), true).is_empty());
        let stats = books.stats();
        assert_eq!((stats.returned, stats.lost, stats.held), (5, 0, 0));
    }

    #[test]
    fn a_batch_too_short_expired_or_of_another_limit_is_returned_on_the_check_path() {
        let books = TokenBatches::new(10, Duration::from_secs(1)).unwrap();
        let l = limit(1_000);
        let fresh = |books: &TokenBatches| {
            let Plan::Fetch { extra, turn } = heat(books, "k", &l, at(0)) else {
                panic!("a hot key fetches");
            };
            turn.keep(extra);
        };
        fresh(&books);
        // Too short for a cost of 9.
        let Plan::Return { batch, turn } = books.plan("k", &l, 9, at(1)) else {
            panic!("returned");
        };
        assert_eq!(batch.left, 8);
        drop(turn);
        let books = TokenBatches::new(10, Duration::from_secs(1)).unwrap();
        fresh(&books);
        assert!(matches!(
            books.plan("k", &l, 1, at(1_000)),
            Plan::Return { .. }
        ));
        let books = TokenBatches::new(10, Duration::from_secs(1)).unwrap();
        fresh(&books);
        assert!(matches!(
            books.plan("k", &limit(2_000), 1, at(1)),
            Plan::Return { .. }
        ));
        // Spent to the last token, a batch has nothing to give back: the next check fetches.
        let books = TokenBatches::new(10, Duration::from_secs(1)).unwrap();
        fresh(&books);
        for _ in 0..8 {
            assert!(matches!(books.plan("k", &l, 1, at(1)), Plan::Spent(_)));
        }
        assert!(matches!(books.plan("k", &l, 1, at(1)), Plan::Fetch { .. }));
    }

    #[test]
    fn a_refused_fetch_quiets_the_key_and_a_failed_one_is_given_back_in_doubt() {
        let books = TokenBatches::new(10, Duration::from_secs(1)).unwrap();
        let l = limit(1_000);
        let Plan::Fetch { turn, .. } = heat(&books, "k", &l, at(0)) else {
            panic!("a hot key fetches");
        };
        turn.refused(at(0));
        assert!(matches!(books.plan("k", &l, 1, at(50)), Plan::Plain));
        assert!(matches!(
            books.plan("k", &l, 1, at(100)),
            Plan::Fetch { .. }
        ));
        // That turn was dropped without an answer: in doubt, for the sweep.
        let mut retired = books.retire(at(101), false);
        assert_eq!(retired.len(), 1);
        let (batch, _turn) = retired.pop().unwrap();
        assert!(batch.doubtful);
        assert_eq!(batch.left, 9);
        books.returned(&batch, Some(true));
        let stats = books.stats();
        assert_eq!((stats.batches, stats.taken, stats.returned), (1, 9, 9));
        books.returned(&batch, Some(false));
        assert_eq!(books.stats().lost, 0, "never known to be taken");
    }

    #[test]
    fn only_the_span_just_before_counts_towards_heat() {
        let books = TokenBatches::new(10, Duration::from_secs(1)).unwrap();
        let l = limit(1_000);
        // Hot in the span from 0 and from 1 ms (the refusals quiet them for a span), then one
        // check each: 199 ms after the span began is still the next span, 200 ms is not.
        for (key, start) in [("near", 0), ("far", 1)] {
            let Plan::Fetch { turn, .. } = heat(&books, key, &l, at(start)) else {
                panic!("a hot key fetches");
            };
            turn.refused(at(start));
        }
        assert!(matches!(
            books.plan("near", &l, 1, at(199)),
            Plan::Fetch { .. }
        ));
        assert!(matches!(books.plan("far", &l, 1, at(201)), Plan::Plain));
    }

    #[test]
    fn idle_keys_make_room_and_are_swept() {
        let books = TokenBatches::new(10, Duration::from_secs(1)).unwrap();
        let l = limit(1_000);
        let followed = |books: &TokenBatches| -> usize {
            books.shards.iter().map(|s| s.lock().unwrap().len()).sum()
        };
        for key in 0..100_000 {
            books.plan(&format!("k{key}"), &l, 1, at(0));
        }
        // Every shard filled with idle keys and was emptied of them: a new key is followed.
        assert!(matches!(heat(&books, "new", &l, at(0)), Plan::Fetch { .. }));
        assert!(followed(&books) > 0);
        // The new key's fetch was dropped unanswered: in doubt, given back at the sweep.
        assert_eq!(books.retire(at(1_000), false).len(), 1);
        assert_eq!(followed(&books), 0, "quiet for two spans, idle");
    }

    #[test]
    fn a_full_shard_forgets_keys_quiet_for_two_spans_first_then_every_idle_one() {
        let shard_of = |entries: &[(u64, bool)]| -> HashMap<String, Entry> {
            let mut shard = HashMap::new();
            for (i, &(span, busy)) in entries.iter().cycle().take(KEYS_PER_SHARD).enumerate() {
                let mut entry = Entry::new(at(span));
                entry.busy = busy;
                shard.insert(format!("k{i}"), entry);
            }
            shard
        };
        // Half began a span exactly two spans before, half half a span before.
        let mut shard = shard_of(&[(100, false), (250, false)]);
        assert!(TokenBatches::admit(&mut shard, "new", at(300)).is_some());
        assert_eq!(shard.len(), KEYS_PER_SHARD / 2 + 1);
        assert!(
            shard
                .keys()
                .all(|key| key == "new" || shard[key].span == at(250))
        );
        // None quiet that long: every idle key goes, the busy ones stay.
        let mut shard = shard_of(&[(250, false), (250, true)]);
        assert!(TokenBatches::admit(&mut shard, "new", at(300)).is_some());
        assert_eq!(shard.len(), KEYS_PER_SHARD / 2 + 1);
        assert!(shard.keys().all(|key| key == "new" || shard[key].busy));
        // Every key busy: the new one is not followed.
        let mut shard = shard_of(&[(0, true)]);
        assert!(TokenBatches::admit(&mut shard, "new", at(300)).is_none());
        assert_eq!(shard.len(), KEYS_PER_SHARD);
    }

    #[test]
    fn a_sweep_forgets_idle_keys_quiet_for_two_spans_and_gives_back_no_empty_batch() {
        let books = TokenBatches::new(10, Duration::from_secs(1)).unwrap();
        let l = limit(1_000);
        // Spent to the last token, and expired by the sweep.
        let Plan::Fetch { extra, turn } = heat(&books, "spent", &l, at(250)) else {
            panic!("a hot key fetches");
        };
        turn.keep(extra);
        for _ in 0..extra {
            assert!(matches!(
                books.plan("spent", &l, 1, at(250)),
                Plan::Spent(_)
            ));
        }
        assert!(books.retire(at(1_250), false).is_empty());
        // Its empty batch is dropped: the next check neither spends nor returns one.
        assert!(matches!(books.plan("spent", &l, 1, at(1_251)), Plan::Plain));
        let books = TokenBatches::new(10, Duration::from_secs(1)).unwrap();
        let followed = |key: &str| books.shard(key).contains_key(key);
        books.plan("old", &l, 1, at(100));
        books.plan("recent", &l, 1, at(250));
        assert!(books.retire(at(300), false).is_empty());
        assert!(!followed("old"));
        assert!(followed("recent"));
    }

    #[test]
    fn the_books_stay_bounded() {
        let books = TokenBatches::new(10, Duration::from_secs(1)).unwrap();
        let l = limit(1_000);
        for key in 0..100_000 {
            books.plan(&format!("k{key}"), &l, 1, at(0));
        }
        let followed: usize = books.shards.iter().map(|s| s.lock().unwrap().len()).sum();
        assert!(followed <= SHARDS * KEYS_PER_SHARD, "{followed}");
        assert!(TokenBatches::new(0, Duration::from_secs(1)).is_none());
    }
}
