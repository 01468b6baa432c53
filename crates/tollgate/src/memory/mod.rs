//! The in-memory keyed store: many buckets, many threads, bounded memory.
//!
//! # Concurrency
//!
//! Keys are spread over shards, each a small hash table behind its own mutex (no global lock).
//! A check hashes the key once, locks one shard, runs [`bucket::take`] on the slot and unlocks:
//! the critical section is a lookup and a few integer operations, so two threads collide only
//! when they touch the same shard at the same moment. A multi-key check locks its shards in
//! ascending index order, which makes it deadlock-free and all-or-nothing.
//!
//! # Memory
//!
//! A live bucket costs its key plus 8 bytes in a slot of the shard's table: a byte of the key's
//! hash and the nanosecond at which the bucket is full again. That is its whole state for every
//! limit whose tokens are a whole number of nanoseconds apart (`10/s`, `600/m`, `5/100ms`, `1/d`,
//! ...), for the first 2^55 ns (417 days) of the clock's epoch. Rates such as `3/s` also carry a
//! sub-nanosecond remainder; such a bucket, or one full again later than that, keeps its exact
//! state in the shard's spill table, under a second copy of its key (counted in
//! [`MemoryStats::spilled`]). Window limits use the same state: a fixed window's always fits
//! the slot, and a sliding window's does until it has a previous window's count to keep, which
//! takes the remainder's place (see [`Algorithm`](crate::Algorithm)). A sliding log has no
//! fixed-size state: it lives in the shard's table of logs, its key beside its latest entry and
//! its older entries in an allocation of their own (counted in [`MemoryStats::logs`], and in
//! the bound as a bucket). Keys are stored as given (use `u64` or `Box<str>` rather than
//! `String` to save bytes).
//!
//! A slot is nothing more: no control byte, no stored hash. The table is open addressing with
//! linear probing, so a lookup reads slots from the key's home onward and usually touches a single
//! cache line. A table doubles when 3/4 of its slots are in use, so between 3/8 and 3/4 of them
//! hold buckets (fewer after expiry empties some, until a [`MemoryStore::sweep`] shrinks a table
//! left under an eighth full). With `u64` keys a slot is 16 bytes and a live bucket costs 21 to 43
//! bytes of table, about 34 at a million keys.
//!
//! * **Lossless expiry.** A bucket idle for its time-to-full is full, which is what an absent
//!   bucket means, so dropping it changes nothing. Each shard drops its full buckets whenever its
//!   table would otherwise grow, and when it reaches its bound: an amortised sweep, with no timer
//!   or thread per bucket. [`MemoryStore::sweep`] does it for every shard at once, for an owner
//!   that calls it now and then (the server, every 10 s). Counted in [`MemoryStats::expired`].
//! * **The bound.** [`MemoryStoreBuilder::max_buckets`] caps live buckets, split evenly across
//!   shards. When a shard is at its share and a new key arrives, it first drops its full buckets;
//!   if none can go, it evicts the 1/64 of its buckets closest to full (earliest `full_at`),
//!   because a re-created bucket starts full and those grant the smallest unearned burst. Those
//!   evictions are counted in [`MemoryStats::evicted`]. A shard at its share has fewer than 8/3
//!   slots per bucket of the share (the power of two that holds it at 3/4).

use std::borrow::Borrow;
use std::hash::{BuildHasher, Hash};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hashbrown::HashTable;

use self::table::{Slot, Table};
use crate::bucket::{self, BucketState};
use crate::clock::Timestamp;
use crate::decision::Decision;
use crate::error::Error;
use crate::idempotency::{self, Recorded, Records, Settle};
use crate::limit::Limit;
use crate::sliding_log::{self, RequestLog};
use crate::store::{SettleStatus, Settlement, check_refund_costs};
use crate::sync::{self, Mutex, MutexGuard};

mod table;

/// The default hasher: fast, and seeded per store so keys cannot be chosen to collide.
pub type DefaultHashBuilder = foldhash::fast::RandomState;

/// One bucket of an all-or-nothing [`MemoryStore::check_all`].
#[derive(Debug)]
pub struct Item<'a, Q: ?Sized> {
    /// The bucket.
    pub key: &'a Q,
    /// Its parameters.
    pub limit: &'a Limit,
    /// Tokens to take from it.
    pub cost: u64,
}

impl<Q: ?Sized> Clone for Item<'_, Q> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<Q: ?Sized> Copy for Item<'_, Q> {}

/// Counters of the memory store's housekeeping.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemoryStats {
    /// Buckets held now.
    pub live_buckets: usize,
    /// Full buckets dropped (lossless: nobody can tell).
    pub expired: u64,
    /// Non-full buckets dropped to stay within the bound (each may grant one extra burst).
    pub evicted: u64,
    /// Idempotency records held now.
    pub idempotency_records: usize,
    /// Live buckets whose state has a sub-nanosecond remainder and is kept in a spill table
    /// (limits such as `3/s`; see the module docs).
    pub spilled: usize,
    /// Bucket slots allocated, used or free: the tables' memory is this many times the key's
    /// size plus 8 bytes. Tables grow as buckets arrive and shrink in [`MemoryStore::sweep`].
    pub slots: usize,
    /// Live sliding logs (also counted in `live_buckets`), kept apart from the slots.
    pub logs: usize,
    /// Entries those logs hold, 8 bytes each: one per millisecond that admitted something.
    pub log_entries: usize,
}

/// Builds a [`MemoryStore`].
///
/// ```
/// use std::time::Duration;
/// use tollgate::MemoryStore;
///
/// let store: MemoryStore<u64> = MemoryStore::builder()
///     .max_buckets(100_000)
///     .idempotency_window(Duration::from_secs(30))
///     .build();
/// assert_eq!(store.stats().live_buckets, 0);
/// ```
#[derive(Debug)]
#[must_use]
pub struct MemoryStoreBuilder<K> {
    shards: usize,
    max_buckets: usize,
    idempotency_window: Duration,
    max_idempotency_records: usize,
    keys: PhantomData<fn() -> K>,
}

impl<K> Default for MemoryStoreBuilder<K> {
    fn default() -> Self {
        Self {
            shards: 64,
            max_buckets: 10_000_000,
            idempotency_window: Duration::from_secs(60),
            max_idempotency_records: 1 << 20,
            keys: PhantomData,
        }
    }
}

impl<K> MemoryStoreBuilder<K> {
    /// The number of independently locked shards (default 64; at least 1). More shards mean
    /// fewer collisions between threads and a finer-grained bound.
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards.max(1);
        self
    }

    /// The most live buckets the store keeps (default ten million; at least one per shard),
    /// split evenly across shards.
    pub fn max_buckets(mut self, max_buckets: usize) -> Self {
        self.max_buckets = max_buckets;
        self
    }

    /// How long a charged check's `request_id` is remembered (default 60 s).
    pub fn idempotency_window(mut self, window: Duration) -> Self {
        self.idempotency_window = window;
        self
    }

    /// The most idempotency records kept (default 2^20), split evenly across shards (at least
    /// one each); a shard at its share forgets its oldest record first. Records are spread by
    /// request id, so one key's requests use every shard's share.
    pub fn max_idempotency_records(mut self, max: usize) -> Self {
        self.max_idempotency_records = max;
        self
    }

    /// The store, with the default hasher.
    pub fn build(self) -> MemoryStore<K> {
        self.build_with_hasher(DefaultHashBuilder::default())
    }

    /// The store, with `hasher` for keys.
    pub fn build_with_hasher<S: BuildHasher>(self, hasher: S) -> MemoryStore<K, S> {
        let shards = self.shards;
        // Split the bound exactly: the first `max % shards` shards take one more.
        let max_buckets = self.max_buckets.max(shards);
        let shard_bound = |i: usize| max_buckets / shards + usize::from(i < max_buckets % shards);
        let record_bound = self.max_idempotency_records.div_ceil(shards).max(1);
        MemoryStore {
            shards: (0..shards)
                .map(|i| Padded(Mutex::new(Shard::new(shard_bound(i)))))
                .collect(),
            hasher,
            id_hashers: (
                foldhash::quality::RandomState::default(),
                foldhash::quality::RandomState::default(),
            ),
            record_bound,
            window_ns: u64::try_from(self.idempotency_window.as_nanos()).unwrap_or(u64::MAX),
            expired: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
        }
    }
}

/// Token buckets in memory, keyed by `K`, shared by any number of threads.
///
/// Every method takes `now`: the store keeps no clock, so it is deterministic under test. Feed
/// one store from one [`Clock`](crate::Clock). For a store bundled with a limit and a clock, see
/// [`RateLimiter`](crate::RateLimiter).
///
/// # Keys
///
/// Checks need `K: Hash + Eq + Default`. The default value fills the table's free slots and is
/// never compared with a key or returned, so it is an ordinary key too (`0`, `""`); `u64`,
/// `Box<str>`, `String` and `Arc<str>` all qualify.
///
/// # Guarantees
///
/// * Each check is atomic per bucket: concurrent checks on one key never admit more than the
///   bucket math allows for the sequence of times they were given.
/// * A rejection, an error or a rejected multi-check charges nothing.
/// * A `now` earlier than one already seen for a bucket mints no tokens.
/// * `cost` outside `1..=capacity` is an [`Error::InvalidCost`] and changes nothing.
/// * A key's bucket is forgotten only when full (lossless) or, at the bound, by the documented
///   eviction policy, counted in [`MemoryStats::evicted`].
///
/// ```
/// use tollgate::{Limit, MemoryStore, Timestamp};
///
/// let store: MemoryStore<Box<str>> = MemoryStore::builder().build();
/// let limit = Limit::new(2, "1/s".parse()?)?;
/// let now = Timestamp::ZERO;
/// assert!(store.check("alice", &limit, 2, now)?.allowed());
/// assert!(!store.check("alice", &limit, 1, now)?.allowed());
/// assert!(store.check("bob", &limit, 1, now)?.allowed());
/// # Ok::<(), tollgate::Error>(())
/// ```
pub struct MemoryStore<K, S = DefaultHashBuilder> {
    shards: Box<[Padded<Mutex<Shard<K>>>]>,
    hasher: S,
    /// Two independent hashers give request ids 128-bit identities: a collision would hand one
    /// request another's decision, so 64 bits are not enough at this scale.
    id_hashers: (
        foldhash::quality::RandomState,
        foldhash::quality::RandomState,
    ),
    record_bound: usize,
    window_ns: u64,
    expired: AtomicU64,
    evicted: AtomicU64,
}

/// Keeps each shard's lock on its own cache lines (two, for adjacent-line prefetchers), so
/// threads working on different shards do not slow each other down.
#[repr(align(128))]
struct Padded<T>(T);

struct Shard<K> {
    buckets: Table<K>,
    /// Exact states of the slots marked [`SPILLED`].
    spill: HashTable<Spilled<K>>,
    /// Sliding logs, which have no fixed-size state to keep in a slot.
    logs: HashTable<Logged<K>>,
    /// This shard's share of the store's bucket bound (logs count as buckets).
    bound: usize,
    records: Records,
}

impl<K> Shard<K> {
    fn new(bound: usize) -> Self {
        Self {
            buckets: Table::new(),
            spill: HashTable::new(),
            logs: HashTable::new(),
            bound,
            records: Records::default(),
        }
    }

    /// Buckets and logs held.
    fn len(&self) -> usize {
        self.buckets.len() + self.logs.len()
    }

    fn log<Q>(&self, hash: u64, key: &Q) -> Option<&RequestLog>
    where
        K: Borrow<Q>,
        Q: Eq + ?Sized,
    {
        self.logs
            .find(hash, |logged| logged.key.borrow() == key)
            .map(|logged| &logged.log)
    }

    fn log_mut<Q>(&mut self, hash: u64, key: &Q) -> Option<&mut Logged<K>>
    where
        K: Borrow<Q>,
        Q: Eq + ?Sized,
    {
        self.logs
            .find_mut(hash, |logged| logged.key.borrow() == key)
    }
}

/// A sliding log and its key.
struct Logged<K> {
    key: K,
    log: RequestLog,
    /// When the log counts nothing any more (its [`RequestLog::free_at`] under the limit it
    /// was last charged with): the log's `full_at`, for expiry and eviction.
    free_at: u64,
}

/// A state too wide for a [`Slot`], kept exactly.
struct Spilled<K> {
    key: K,
    state: BucketState,
}

/// The state of a slot whose exact state is in the spill table. Whole states are below it.
///
/// A live bucket's slot holds its key and, packed into 8 bytes, its state. For a limit whose
/// tokens are a whole number of nanoseconds apart (any `N/period` where N divides the period in
/// ns: `10/s`, `600/m`, `5/100ms`, `1/d`, ...) the state is just the nanosecond the bucket is full
/// again, which fits in the slot's 55 bits for every instant in the first 2^55 ns (417 days) of
/// the clock's epoch, so a slot is the key plus 8 bytes. A state with a sub-nanosecond remainder
/// (rates such as `3/s`), or one further in time, does not fit: the slot then holds `SPILLED` and
/// the exact state lives in the shard's spill table under the same key.
const SPILLED: u64 = table::MAX_STATE;

/// The packed form of `state`, if it fits in a slot.
fn pack(state: BucketState) -> Option<u64> {
    let full_at = state.full_at().as_nanos();
    (state.frac() == 0 && full_at < SPILLED).then_some(full_at)
}

/// Where shard `index`'s guard is among those [`MemoryStore::lock_all`] took.
fn guard_at<G>(guards: &[(usize, G)], index: usize) -> usize {
    guards.iter().position(|(i, _)| *i == index).unwrap_or(0)
}

/// The state of the slot holding `key` (with hash `hash`) and `packed`.
fn unpack<K: Eq>(
    packed: u64,
    key: &K,
    hash: u64,
    spill: &HashTable<Spilled<K>>,
) -> Option<BucketState> {
    if packed & SPILLED == 0 {
        return Some(BucketState::whole(packed));
    }
    // A spilled slot always has its entry (they are written and removed together); were it
    // missing, the bucket would read as new.
    spill
        .find(hash, |spilled| spilled.key == *key)
        .map(|spilled| spilled.state)
}

/// The instant the slot's bucket is full again, for expiry and eviction.
fn full_at_of<K: Eq>(packed: u64, key: &K, hash: u64, spill: &HashTable<Spilled<K>>) -> u64 {
    unpack(packed, key, hash, spill).map_or(0, |state| state.full_at().as_nanos())
}

/// Removes the spill entry of a slot that is going away or becoming packed.
fn unspill<K: Eq>(packed: u64, key: &K, hash: u64, spill: &mut HashTable<Spilled<K>>) {
    if packed & SPILLED != 0
        && let Ok(entry) = spill.find_entry(hash, |spilled| spilled.key == *key)
    {
        entry.remove();
    }
}

impl<K> MemoryStore<K> {
    /// A builder with the defaults.
    pub fn builder() -> MemoryStoreBuilder<K> {
        MemoryStoreBuilder::default()
    }
}

impl<K> Default for MemoryStore<K> {
    fn default() -> Self {
        MemoryStoreBuilder::default().build()
    }
}

impl<K, S> MemoryStore<K, S>
where
    K: Hash + Eq + Default,
    S: BuildHasher,
{
    /// Takes `cost` tokens from `key`'s bucket at `now`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidCost`] when `cost` is 0 or above `limit`'s capacity.
    #[inline]
    pub fn check<Q>(
        &self,
        key: &Q,
        limit: &Limit,
        cost: u64,
        now: Timestamp,
    ) -> Result<Decision, Error>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned + ?Sized,
        Q::Owned: Into<K>,
    {
        bucket::check_cost(limit, cost)?;
        let hash = self.hash(key);
        let mut shard = self.lock(hash);
        self.take_one(&mut shard, hash, key, limit, cost, now)
    }

    /// Like [`check`](Self::check), but a retry with the same `key` and `request_id` within the
    /// idempotency window gets the first (charged) decision back and is not charged again.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidCost`] as for `check`; [`Error::InvalidRequestId`] for an empty or
    /// oversized id; [`Error::IdempotencyConflict`] when the id was used for this key with
    /// another limit or cost.
    pub fn check_idempotent<Q>(
        &self,
        key: &Q,
        limit: &Limit,
        cost: u64,
        now: Timestamp,
        request_id: &str,
    ) -> Result<Decision, Error>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned + ?Sized,
        Q::Owned: Into<K>,
    {
        bucket::check_cost(limit, cost)?;
        idempotency::check_request_id(request_id)?;
        let hash = self.hash(key);
        let id = self.request_identity(request_id, key);
        let content = self.hasher.hash_one((limit, cost));
        // The bucket's shard and the record's, locked in ascending order like a multi-key
        // check; one lock when they are the same shard.
        let (bucket_index, record_index) = (self.shard_index(hash), self.record_shard(id));
        let first = sync::lock(&self.shards[bucket_index.min(record_index)].0);
        let second = (bucket_index != record_index)
            .then(|| sync::lock(&self.shards[bucket_index.max(record_index)].0));
        let (mut shard, mut record_shard) = match second {
            Some(second) if bucket_index > record_index => (second, Some(first)),
            second => (first, second),
        };
        let records =
            record_shard
                .as_deref()
                .unwrap_or(&*shard)
                .records
                .get(id, content, now.as_nanos());
        if let Some(found) = records {
            return match found? {
                Recorded::One(decision) => Ok(decision),
                Recorded::Many(_) => Err(Error::IdempotencyConflict),
            };
        }
        let decision = self.take_one(&mut shard, hash, key, limit, cost, now)?;
        if decision.allowed() {
            let records = record_shard.as_deref_mut().unwrap_or(&mut *shard);
            self.record(records, id, content, Recorded::One(decision), now);
        }
        Ok(decision)
    }

    /// Takes from several buckets at once, all or nothing: if any would reject, none is
    /// charged. Decisions come back in the order of `items`.
    ///
    /// In a rejected check, the buckets that had enough tokens report `allowed` with their
    /// uncharged balance; the check as a whole passed only if every decision is `allowed`.
    /// With a `request_id`, a retry within the window (same keys, limits and costs, same order)
    /// gets the first decisions back and is not charged again.
    ///
    /// # Errors
    ///
    /// [`Error::EmptyCheck`], [`Error::DuplicateKey`], [`Error::InvalidCost`] for any item,
    /// [`Error::IdempotencyConflict`]. None of them charges anything.
    pub fn check_all<Q>(
        &self,
        items: &[Item<'_, Q>],
        now: Timestamp,
        request_id: Option<&str>,
    ) -> Result<Vec<Decision>, Error>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned + ?Sized,
        Q::Owned: Into<K>,
    {
        let first = items.first().ok_or(Error::EmptyCheck)?;
        if let Some(id) = request_id {
            idempotency::check_request_id(id)?;
        }
        let hashes = self.hashes_of(items)?;
        let identity = request_id.map(|id| {
            let content = self.hasher.hash_one(
                items
                    .iter()
                    .map(|item| (item.key, item.limit, item.cost))
                    .collect::<Vec<_>>(),
            );
            (self.request_identity(id, first.key), content)
        });

        let mut guards = self.lock_all(&hashes, identity.map(|(id, _)| id));
        let guard_of = |guards: &[(usize, MutexGuard<'_, Shard<K>>)], hash: u64| {
            guard_at(guards, self.shard_index(hash))
        };

        let record_guard = identity.map(|(id, _)| guard_at(&guards, self.record_shard(id)));
        if let (Some((id, content)), Some(record_guard)) = (identity, record_guard) {
            let records = &guards[record_guard].1.records;
            if let Some(found) = records.get(id, content, now.as_nanos()) {
                return match found? {
                    Recorded::Many(decisions) => Ok(decisions.into_vec()),
                    Recorded::One(_) => Err(Error::IdempotencyConflict),
                };
            }
        }

        let mut decisions = Vec::with_capacity(items.len());
        let mut next_states = Vec::with_capacity(items.len());
        for (item, &hash) in items.iter().zip(&hashes) {
            let shard = &guards[guard_of(&guards, hash)].1;
            if item.limit.algorithm().keeps_log() {
                let log = shard.log(hash, item.key);
                decisions.push(sliding_log::decide(item.limit, log, now, item.cost));
                next_states.push((None, None));
                continue;
            }
            let state = shard
                .buckets
                .find(hash, item.key)
                .and_then(|slot| unpack(slot.state(), &slot.key, hash, &shard.spill));
            let (decision, next) = bucket::take(item.limit, state, now, item.cost)?;
            decisions.push(decision);
            next_states.push((state, next));
        }

        if decisions.iter().all(Decision::allowed) {
            for ((item, &hash), (_, next)) in items.iter().zip(&hashes).zip(&next_states) {
                let g = guard_of(&guards, hash);
                if item.limit.algorithm().keeps_log() {
                    self.charge_log(&mut guards[g].1, hash, item.key, item.limit, item.cost, now);
                } else if let Some(next) = *next {
                    self.store(&mut guards[g].1, hash, item.key, next, now);
                }
            }
            if let (Some((id, content)), Some(record_guard)) = (identity, record_guard) {
                let recorded = Recorded::Many(decisions.clone().into_boxed_slice());
                self.record(&mut guards[record_guard].1, id, content, recorded, now);
            }
        } else {
            // Nothing is charged: the buckets that would have allowed report their balance as
            // it stands.
            let lists = items
                .iter()
                .zip(&hashes)
                .zip(&mut decisions)
                .zip(&next_states);
            for (((item, &hash), decision), (state, _)) in lists {
                if !decision.allowed() {
                    continue;
                }
                *decision = if item.limit.algorithm().keeps_log() {
                    let shard = &guards[guard_of(&guards, hash)].1;
                    sliding_log::balance(item.limit, shard.log(hash, item.key), now, item.cost)
                } else {
                    bucket::balance(item.limit, *state, now, item.cost)
                };
            }
        }
        Ok(decisions)
    }

    /// Settles a request charged earlier with `request_id` (a reservation whose real cost is
    /// now known): gives `refunds[i]` tokens back to `items[i]`'s bucket, once. `items` must be
    /// what the check asked (same keys, limits and costs, same order), so that a settlement
    /// finds the check's record; a check of one bucket made with
    /// [`check_idempotent`](Self::check_idempotent) and one of several made with
    /// [`check_all`](Self::check_all) are both found.
    ///
    /// Only a charge still on record is given back from: a retried settlement with the same
    /// amounts gives nothing again ([`SettleStatus::Repeated`]), and a request never charged,
    /// rejected, or recorded longer ago than the idempotency window (or pushed out by the
    /// record bound) gets nothing ([`SettleStatus::NotFound`]): its charge stands, which
    /// under-admits, never over-admits. A refund restores no more than a smaller charge would
    /// have left (see [`bucket`]).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidSettlement`] when a refund passes its item's cost or there is not one
    /// refund per item; the check's own errors for its items and id;
    /// [`Error::IdempotencyConflict`] when the id was recorded for another request, or settled
    /// with other amounts. None of them changes anything.
    pub fn settle<Q>(
        &self,
        items: &[Item<'_, Q>],
        now: Timestamp,
        request_id: &str,
        refunds: &[u64],
    ) -> Result<Settlement, Error>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned + ?Sized,
        Q::Owned: Into<K>,
    {
        let first = items.first().ok_or(Error::EmptyCheck)?;
        idempotency::check_request_id(request_id)?;
        check_refund_costs(items.iter().map(|item| item.cost), refunds)?;
        let hashes = self.hashes_of(items)?;
        let id = self.request_identity(request_id, first.key);
        let mark = self.hasher.hash_one(refunds);
        let mut guards = self.lock_all(&hashes, Some(id));
        // Which content the record holds depends on how the check was made: one bucket by
        // `check_idempotent`, several (or one) by `check_all`.
        let content = |recorded: &Recorded| match recorded {
            Recorded::One(_) => match items {
                [item] => self.hasher.hash_one((item.limit, item.cost)),
                _ => 0,
            },
            Recorded::Many(_) => self.hasher.hash_one(
                items
                    .iter()
                    .map(|item| (item.key, item.limit, item.cost))
                    .collect::<Vec<_>>(),
            ),
        };
        let record_guard = guard_at(&guards, self.record_shard(id));
        let found = guards[record_guard]
            .1
            .records
            .settle(id, content, now.as_nanos(), mark)?;
        let status = match found {
            Settle::Missing => SettleStatus::NotFound,
            Settle::Repeated => SettleStatus::Repeated,
            Settle::Charged(..) => SettleStatus::Settled,
        };
        let mut decisions = Vec::with_capacity(items.len());
        for (i, ((item, &hash), &refund)) in items.iter().zip(&hashes).zip(refunds).enumerate() {
            let g = guard_at(&guards, self.shard_index(hash));
            let shard = &mut guards[g].1;
            let charged = match &found {
                Settle::Charged(at, Recorded::One(decision)) if i == 0 => Some((*at, decision)),
                Settle::Charged(at, Recorded::Many(decisions)) => {
                    decisions.get(i).map(|decision| (*at, decision))
                }
                _ => None,
            };
            if item.limit.algorithm().keeps_log() {
                if let (Some((charged_at, decision)), Some(logged)) =
                    (charged, shard.log_mut(hash, item.key))
                {
                    let ms = sliding_log::charged_ms(
                        item.limit,
                        Timestamp::from_nanos(charged_at),
                        decision,
                    );
                    sliding_log::give_back(&mut logged.log, ms, refund);
                }
                let log = shard.log(hash, item.key);
                decisions.push(sliding_log::balance(item.limit, log, now, item.cost));
                continue;
            }
            let mut state = shard
                .buckets
                .find(hash, item.key)
                .and_then(|slot| unpack(slot.state(), &slot.key, hash, &shard.spill));
            if let Some((charged_at, decision)) = charged
                && refund > 0
                && state.is_some()
            {
                let charged_at = Timestamp::from_nanos(charged_at);
                state = bucket::give_back(item.limit, state, charged_at, decision, refund);
                if let Some(next) = state {
                    self.store(shard, hash, item.key, next, now);
                }
            }
            decisions.push(bucket::balance(item.limit, state, now, item.cost));
        }
        Ok(Settlement { status, decisions })
    }

    /// Gives `items[i].cost` tokens back to each bucket at `now`, with no record of the charge
    /// they came from (see [`Store::give_back`](crate::Store::give_back)): a token bucket gets
    /// them back as if its latest charges had been smaller, up to full; a window from its latest
    /// count that holds anything, a log from its latest entry that does, never below 0. A
    /// bucket with no state is full, and stays as it is. Returns each bucket's standing afterwards, in the
    /// order of `items`: an allowed, uncharged decision for its `cost`.
    ///
    /// # Errors
    ///
    /// [`Error::EmptyCheck`], [`Error::DuplicateKey`], [`Error::InvalidCost`] for any item (a
    /// cost is at most the capacity, as in a check: more would fill the bucket just the same).
    /// None of them changes anything.
    pub fn give_back<Q>(
        &self,
        items: &[Item<'_, Q>],
        now: Timestamp,
    ) -> Result<Vec<Decision>, Error>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned + ?Sized,
        Q::Owned: Into<K>,
    {
        if items.is_empty() {
            return Err(Error::EmptyCheck);
        }
        let hashes = self.hashes_of(items)?;
        let mut guards = self.lock_all(&hashes, None);
        let mut decisions = Vec::with_capacity(items.len());
        for (item, &hash) in items.iter().zip(&hashes) {
            let g = guard_at(&guards, self.shard_index(hash));
            let shard = &mut guards[g].1;
            if item.limit.algorithm().keeps_log() {
                if let Some(logged) = shard.log_mut(hash, item.key) {
                    sliding_log::give_back_latest(&mut logged.log, item.cost);
                }
                let log = shard.log(hash, item.key);
                decisions.push(sliding_log::balance(item.limit, log, now, item.cost));
                continue;
            }
            let state = shard
                .buckets
                .find(hash, item.key)
                .and_then(|slot| unpack(slot.state(), &slot.key, hash, &shard.spill));
            let state = bucket::give_back_latest(item.limit, state, item.cost);
            if let Some(next) = state {
                self.store(shard, hash, item.key, next, now);
            }
            decisions.push(bucket::balance(item.limit, state, now, item.cost));
        }
        Ok(decisions)
    }

    /// What [`check`](Self::check) would decide, without changing anything.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidCost`] when `cost` is 0 or above `limit`'s capacity.
    pub fn peek<Q>(
        &self,
        key: &Q,
        limit: &Limit,
        cost: u64,
        now: Timestamp,
    ) -> Result<Decision, Error>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        bucket::check_cost(limit, cost)?;
        let hash = self.hash(key);
        let shard = self.lock(hash);
        if limit.algorithm().keeps_log() {
            return Ok(sliding_log::decide(limit, shard.log(hash, key), now, cost));
        }
        let state = shard
            .buckets
            .find(hash, key)
            .and_then(|slot| unpack(slot.state(), &slot.key, hash, &shard.spill));
        bucket::peek(limit, state, now, cost)
    }

    /// Makes the bucket of `key` as if never used: a token bucket full, a window or a log
    /// counting nothing (see [`Store::reset`](crate::Store::reset)). Says whether it held
    /// anything. Idempotency records stay.
    pub fn reset<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hash(key);
        let mut shard = self.lock(hash);
        let Shard {
            buckets,
            spill,
            logs,
            ..
        } = &mut *shard;
        let mut held = false;
        if let Some(slot) = buckets.find_mut(hash, key) {
            // Full since the clock's start: what absent means, so the slot expires at the next
            // sweep, and its exact state, if spilled, goes with it now.
            unspill(slot.state(), &slot.key, hash, spill);
            slot.set_state(0);
            held = true;
        }
        if let Ok(entry) = logs.find_entry(hash, |logged| logged.key.borrow() == key) {
            entry.remove();
            held = true;
        }
        held
    }

    /// Whether a sweep at `now` may drop the state of `key`, or there is none: then it reads
    /// as new at `now` and at every later time, but a store that kept it can tell it from a
    /// new one at an earlier time (a clock gone back), where one that dropped it cannot. The
    /// conformance traces ask, before they step back, to make two stores agree on what they
    /// forgot (see [`crate::testkit`]).
    #[cfg(feature = "testkit")]
    pub(crate) fn forgettable<Q>(&self, key: &Q, now: Timestamp) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hash(key);
        let shard = self.lock(hash);
        let is_full = |full_at| BucketState::whole(full_at).is_full(now);
        let bucket = shard
            .buckets
            .find(hash, key)
            .is_none_or(|slot| is_full(self.full_at(slot, &shard.spill)));
        let log = shard
            .logs
            .find(hash, |logged| logged.key.borrow() == key)
            .is_none_or(|logged| is_full(logged.free_at));
        bucket && log
    }

    /// Live buckets and housekeeping counters. Locks each shard in turn, so the figures are a
    /// consistent sum only when the store is quiet.
    pub fn stats(&self) -> MemoryStats {
        let mut stats = MemoryStats {
            expired: self.expired.load(Ordering::Relaxed),
            evicted: self.evicted.load(Ordering::Relaxed),
            ..MemoryStats::default()
        };
        for shard in &self.shards {
            let shard = sync::lock(&shard.0);
            stats.live_buckets += shard.len();
            stats.logs += shard.logs.len();
            stats.log_entries += shard
                .logs
                .iter()
                .map(|logged| logged.log.len())
                .sum::<usize>();
            stats.slots += shard.buckets.slots();
            stats.spilled += shard.spill.len();
            stats.idempotency_records += shard.records.len();
        }
        stats
    }

    /// Drops every full bucket now, instead of waiting for the amortised sweeps, and gives back
    /// the memory of tables left mostly empty (after a spike of keys, say). Returns how many
    /// buckets were dropped.
    ///
    /// Without sweeps, full buckets are dropped only when a table is about to grow, so a store
    /// whose traffic has fallen keeps its tables at their peak size. A server calls this now and
    /// then; each shard is locked in turn, for one pass over its table.
    pub fn sweep(&self, now: Timestamp) -> usize {
        let mut dropped = 0;
        for shard in &self.shards {
            let mut shard = sync::lock(&shard.0);
            dropped += self.drop_full(&mut shard, now);
            let Shard {
                buckets,
                spill,
                logs,
                ..
            } = &mut *shard;
            if buckets.shrink(|key| self.hash(key)) {
                spill.shrink_to_fit(|spilled| self.hash(&spilled.key));
            }
            logs.shrink_to_fit(|logged| self.hash(&logged.key));
        }
        dropped
    }

    /// Carries buckets over a change of parameters: the policy engine calls it when a reload
    /// changes a limit's capacity or rate.
    ///
    /// For every stored bucket for which `change` returns `Some((new_key, old, new))`, the
    /// bucket is removed and its balance is refilled under `old` up to `at`, clamped to `new`'s
    /// capacity ([`bucket::rebase`]), and stored under `new_key`. A converted bucket that is
    /// full is simply dropped (absent means full). If `new_key` already holds a bucket (checked
    /// under `new` since the change), the one with fewer tokens is kept, so the conversion never
    /// adds tokens. Returns the number of buckets carried over (full or not).
    ///
    /// `new_key` must differ from every key `change` selects (the caller names parameters in
    /// its keys, so state is never read under parameters it was not produced under). Shards are
    /// locked one at a time: checks proceed meanwhile, and a check of `new_key` that runs before
    /// its bucket is carried over sees a new, full bucket (bounded by one burst per key, for the
    /// duration of the pass).
    pub fn rebase_where<F>(&self, at: Timestamp, mut change: F) -> usize
    where
        K: Clone,
        F: FnMut(&K) -> Option<(K, Limit, Limit)>,
    {
        let mut moved = Vec::new();
        for shard in &self.shards {
            let mut shard = sync::lock(&shard.0);
            let Shard { buckets, spill, .. } = &mut *shard;
            buckets.retain(
                |slot| match change(&slot.key) {
                    Some((key, old, new)) => {
                        let hash = self.hash(&slot.key);
                        let state = unpack(slot.state(), &slot.key, hash, spill);
                        unspill(slot.state(), &slot.key, hash, spill);
                        moved.push((key, bucket::rebase(&old, &new, state, at)));
                        false
                    }
                    None => true,
                },
                |key| self.hash(key),
            );
        }
        let count = moved.len();
        for (key, state) in moved {
            let Some(state) = state else { continue };
            let hash = self.hash(&key);
            let mut shard = self.lock(hash);
            let Shard { buckets, spill, .. } = &mut *shard;
            match buckets.find_mut(hash, &key) {
                Some(slot) => {
                    // Same parameters on both sides: the later full_at holds fewer tokens.
                    let current = full_at_of(slot.state(), &slot.key, hash, spill);
                    if state.full_at().as_nanos() > current {
                        self.write(slot, spill, hash, state, || key.clone());
                    }
                }
                None => self.insert(&mut shard, hash, || key.clone(), state, at),
            }
        }
        count
    }

    /// The hash every table of the store uses for `key`: the hasher's, spread once more. The
    /// shard, the home slot and the tag come from different bits of it, so they must all be
    /// good; a fast hasher's top bits follow its middle ones for keys that differ only in their
    /// low bits (sequential integers), which with some seeds crowded a shard's keys one to six
    /// slots from their homes. One more folded multiply costs a nanosecond and carries a
    /// difference in any of the hasher's bits, low or high, to all the bits the store uses,
    /// whatever hasher it was given (tested with hashers that return the key, and the key
    /// shifted to the top bits).
    #[inline]
    fn hash<Q: Hash + ?Sized>(&self, key: &Q) -> u64 {
        let product = u128::from(self.hasher.hash_one(key)) * 0x9e37_79b9_7f4a_7c15;
        (product as u64) ^ ((product >> 64) as u64)
    }

    #[inline]
    fn shard_index(&self, hash: u64) -> usize {
        // Bits 24..56 pick the shard: a shard's table takes a key's home slot from the low bits
        // and its tag from bits 32..40 (see `table::home` and `table::tag`), and hashbrown's spill
        // table uses the low bits for the slot and the top seven as its tag, so a shard's keys
        // must not share those, or probes would slow down.
        ((((hash >> 24) as u32 as u64) * self.shards.len() as u64) >> 32) as usize
    }

    /// The shard that keeps the idempotency record `id`: drawn from the id, not from the key,
    /// so that one busy key's records spread over every shard's share of the record bound
    /// instead of crowding its own shard's (where they would be forgotten within the window).
    /// The high half of the id, which the records' own table does not hash by.
    fn record_shard(&self, id: u128) -> usize {
        self.shard_index((id >> 64) as u64)
    }

    #[inline]
    fn lock(&self, hash: u64) -> MutexGuard<'_, Shard<K>> {
        sync::lock(&self.shards[self.shard_index(hash)].0)
    }

    #[inline]
    fn take_one<Q>(
        &self,
        shard: &mut Shard<K>,
        hash: u64,
        key: &Q,
        limit: &Limit,
        cost: u64,
        now: Timestamp,
    ) -> Result<Decision, Error>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned + ?Sized,
        Q::Owned: Into<K>,
    {
        if limit.algorithm().keeps_log() {
            return Ok(self.take_log(shard, hash, key, limit, cost, now));
        }
        let Shard { buckets, spill, .. } = shard;
        if let Some(slot) = buckets.find_mut(hash, key) {
            let state = unpack(slot.state(), &slot.key, hash, spill);
            let (decision, next) = bucket::take(limit, state, now, cost)?;
            if let Some(next) = next {
                self.write(slot, spill, hash, next, || key.to_owned().into());
            }
            return Ok(decision);
        }
        let (decision, next) = bucket::take(limit, None, now, cost)?;
        if let Some(next) = next {
            self.insert(shard, hash, || key.to_owned().into(), next, now);
        }
        Ok(decision)
    }

    /// [`take_one`](Self::take_one) for a sliding log.
    #[cold]
    fn take_log<Q>(
        &self,
        shard: &mut Shard<K>,
        hash: u64,
        key: &Q,
        limit: &Limit,
        cost: u64,
        now: Timestamp,
    ) -> Decision
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned + ?Sized,
        Q::Owned: Into<K>,
    {
        let decision = sliding_log::decide(limit, shard.log(hash, key), now, cost);
        if decision.allowed() {
            self.charge_log(shard, hash, key, limit, cost, now);
        }
        decision
    }

    /// Charges `cost` to `key`'s sliding log at `now`, making the log if it is new: for a
    /// request [`sliding_log::decide`] allowed under the same lock.
    fn charge_log<Q>(
        &self,
        shard: &mut Shard<K>,
        hash: u64,
        key: &Q,
        limit: &Limit,
        cost: u64,
        now: Timestamp,
    ) where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned + ?Sized,
        Q::Owned: Into<K>,
    {
        if let Some(logged) = shard.log_mut(hash, key) {
            sliding_log::charge(limit, &mut logged.log, now, cost);
            logged.free_at = logged.log.free_at(limit).as_nanos();
            return;
        }
        if shard.len() >= shard.bound {
            self.make_room(shard, now);
        }
        let mut log = RequestLog::default();
        sliding_log::charge(limit, &mut log, now, cost);
        let free_at = log.free_at(limit).as_nanos();
        shard.logs.insert_unique(
            hash,
            Logged {
                key: key.to_owned().into(),
                log,
                free_at,
            },
            |logged| self.hash(&logged.key),
        );
    }

    /// Writes `state` for `key`, inserting the bucket if it is new.
    fn store<Q>(&self, shard: &mut Shard<K>, hash: u64, key: &Q, state: BucketState, now: Timestamp)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned + ?Sized,
        Q::Owned: Into<K>,
    {
        let Shard { buckets, spill, .. } = shard;
        match buckets.find_mut(hash, key) {
            Some(slot) => self.write(slot, spill, hash, state, || key.to_owned().into()),
            None => self.insert(shard, hash, || key.to_owned().into(), state, now),
        }
    }

    /// Stores `state` in `slot`: packed when it fits, else in the spill table (`new_key` makes
    /// the spill entry's copy of the key).
    #[inline]
    fn write(
        &self,
        slot: &mut Slot<K>,
        spill: &mut HashTable<Spilled<K>>,
        hash: u64,
        state: BucketState,
        new_key: impl FnOnce() -> K,
    ) {
        if let Some(packed) = pack(state) {
            unspill(slot.state(), &slot.key, hash, spill);
            slot.set_state(packed);
            return;
        }
        if slot.state() & SPILLED != 0
            && let Some(spilled) = spill.find_mut(hash, |spilled| spilled.key == slot.key)
        {
            spilled.state = state;
            return;
        }
        spill.insert_unique(
            hash,
            Spilled {
                key: new_key(),
                state,
            },
            |spilled| self.hash(&spilled.key),
        );
        slot.set_state(SPILLED);
    }

    #[cold]
    fn insert(
        &self,
        shard: &mut Shard<K>,
        hash: u64,
        new_key: impl Fn() -> K,
        state: BucketState,
        now: Timestamp,
    ) {
        let len = shard.buckets.len();
        if shard.len() >= shard.bound {
            self.make_room(shard, now);
        } else if len == shard.buckets.capacity() && len > 0 {
            // The table is about to grow: first drop what no one can miss. If that frees less
            // than an eighth, grow anyway, so sweeps stay at least len/8 inserts apart.
            let dropped = self.drop_full(shard, now);
            if dropped < len / 8 {
                shard.buckets.grow(|key| self.hash(key));
            }
        }
        let Shard { buckets, spill, .. } = shard;
        // Any state will do: `write` sets the real one.
        let slot = buckets.insert(hash, new_key(), 0, |key| self.hash(key));
        self.write(slot, spill, hash, state, new_key);
    }

    /// Drops the buckets `drop` selects (given each bucket's `full_at`), with their spill
    /// entries. Returns how many went.
    fn drop_where(&self, shard: &mut Shard<K>, mut drop: impl FnMut(u64) -> bool) -> usize {
        let before = shard.buckets.len();
        let Shard { buckets, spill, .. } = shard;
        buckets.retain(
            |slot| {
                let going = drop(self.full_at(slot, spill));
                if going && slot.state() & SPILLED != 0 {
                    let hash = self.hash(&slot.key);
                    unspill(slot.state(), &slot.key, hash, spill);
                }
                !going
            },
            |key| self.hash(key),
        );
        before - shard.buckets.len()
    }

    /// When `slot`'s bucket is full again; only a spilled slot needs its key hashed.
    fn full_at(&self, slot: &Slot<K>, spill: &HashTable<Spilled<K>>) -> u64 {
        if slot.state() & SPILLED == 0 {
            return slot.state();
        }
        let hash = self.hash(&slot.key);
        full_at_of(slot.state(), &slot.key, hash, spill)
    }

    fn drop_full(&self, shard: &mut Shard<K>, now: Timestamp) -> usize {
        let is_full = |full_at| BucketState::whole(full_at).is_full(now);
        let logs = shard.logs.len();
        shard.logs.retain(|logged| !is_full(logged.free_at));
        let dropped = logs - shard.logs.len() + self.drop_where(shard, is_full);
        if dropped > 0 {
            self.expired.fetch_add(dropped as u64, Ordering::Relaxed);
        }
        dropped
    }

    /// The shard is at its bound: free at least 1/64 of it, full buckets first, then those
    /// closest to full. Freeing a fixed fraction keeps the O(len) pass amortised.
    #[cold]
    fn make_room(&self, shard: &mut Shard<K>, now: Timestamp) {
        let count = (shard.len() / 64).max(1);
        let dropped = self.drop_full(shard, now);
        if dropped >= count || shard.len() == 0 {
            return;
        }
        let count = (count - dropped).min(shard.len());
        // A log's `free_at` is its `full_at`: the one closest to counting nothing goes first.
        let mut full_at: Vec<u64> = shard
            .buckets
            .iter()
            .map(|slot| self.full_at(slot, &shard.spill))
            .chain(shard.logs.iter().map(|logged| logged.free_at))
            .collect();
        let (earlier, &mut threshold, _) = full_at.select_nth_unstable(count - 1);
        // Evict everything before the threshold and as many at it as make up `count`.
        let mut at_threshold = count - earlier.iter().filter(|&&t| t < threshold).count();
        let mut evict = |t: u64| {
            if t < threshold {
                true
            } else if t == threshold && at_threshold > 0 {
                at_threshold -= 1;
                true
            } else {
                false
            }
        };
        self.drop_where(shard, &mut evict);
        shard.logs.retain(|logged| !evict(logged.free_at));
        self.evicted.fetch_add(count as u64, Ordering::Relaxed);
    }

    /// The hashes of `items`' keys, once their costs are valid and no key is there twice.
    fn hashes_of<Q>(&self, items: &[Item<'_, Q>]) -> Result<Vec<u64>, Error>
    where
        Q: Hash + Eq + ?Sized,
    {
        let mut hashes = Vec::with_capacity(items.len());
        for (index, item) in items.iter().enumerate() {
            bucket::check_cost(item.limit, item.cost)?;
            let hash = self.hash(item.key);
            let duplicate = hashes
                .iter()
                .zip(items)
                .any(|(&h, earlier)| h == hash && earlier.key == item.key);
            if duplicate {
                return Err(Error::DuplicateKey { index });
            }
            hashes.push(hash);
        }
        Ok(hashes)
    }

    /// Locks every shard the keys of `hashes` and the record `id` live in, in ascending order:
    /// deadlock-free against other multi-key operations, and nothing can change between
    /// deciding and charging. Find a shard's guard with [`guard_at`].
    fn lock_all(&self, hashes: &[u64], id: Option<u128>) -> Vec<(usize, MutexGuard<'_, Shard<K>>)> {
        let mut order: Vec<usize> = hashes.iter().map(|&h| self.shard_index(h)).collect();
        order.extend(id.map(|id| self.record_shard(id)));
        order.sort_unstable();
        order.dedup();
        order
            .into_iter()
            .map(|index| (index, sync::lock(&self.shards[index].0)))
            .collect()
    }

    fn request_identity<Q: Hash + ?Sized>(&self, request_id: &str, key: &Q) -> u128 {
        let high = self.id_hashers.0.hash_one((request_id, key));
        let low = self.id_hashers.1.hash_one((request_id, key));
        (u128::from(high) << 64) | u128::from(low)
    }

    fn record(
        &self,
        shard: &mut Shard<K>,
        id: u128,
        content: u64,
        decisions: Recorded,
        now: Timestamp,
    ) {
        let now = now.as_nanos();
        let expires_at = now.saturating_add(self.window_ns);
        shard
            .records
            .insert(id, content, decisions, now, expires_at, self.record_bound);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;

    fn at(nanos: u64) -> Timestamp {
        Timestamp::from_nanos(nanos)
    }

    fn limit(capacity: u64, rate: &str) -> Limit {
        Limit::new(capacity, rate.parse().unwrap()).unwrap()
    }

    #[test]
    fn rebase_where_refills_under_old_then_clamps_under_new() {
        let store: MemoryStore<String> = MemoryStore::default();
        let old = limit(20, "10/s");
        let new = limit(10, "1/s");
        // a: 20 - 20 = 0 tokens at 0; at 0.5 s it holds 5 under the old rate.
        assert!(store.check("a@old", &old, 20, at(0)).unwrap().allowed());
        // b: 20 - 2 = 18 tokens; clamped to the new capacity, 10.
        assert!(store.check("b@old", &old, 2, at(0)).unwrap().allowed());
        // c: another limit, untouched.
        assert!(store.check("c", &old, 20, at(0)).unwrap().allowed());
        let moved = store.rebase_where(at(SEC / 2), |key: &String| {
            key.strip_suffix("@old")
                .map(|base| (format!("{base}@new"), old, new))
        });
        assert_eq!(moved, 2);
        let a = store.peek("a@new", &new, 1, at(SEC / 2)).unwrap();
        assert_eq!(a.remaining(), 4, "5 tokens carried over, 1 asked");
        // b was full under the new capacity: dropped, and absent means full.
        assert_eq!(
            store
                .peek("b@new", &new, 1, at(SEC / 2))
                .unwrap()
                .remaining(),
            9
        );
        assert_eq!(store.stats().live_buckets, 2);
        assert!(!store.check("c", &old, 1, at(0)).unwrap().allowed());
        assert!(
            store
                .peek("a@old", &old, 1, at(SEC / 2))
                .unwrap()
                .remaining()
                == 19
        );
    }

    #[test]
    fn rebase_where_keeps_the_emptier_bucket_on_collision() {
        let store: MemoryStore<String> = MemoryStore::default();
        let l = limit(10, "1/s");
        assert!(store.check("k@old", &l, 3, at(0)).unwrap().allowed());
        assert!(store.check("k@new", &l, 8, at(0)).unwrap().allowed());
        store.rebase_where(at(0), |key: &String| {
            (key == "k@old").then(|| ("k@new".to_owned(), l, l))
        });
        assert_eq!(store.peek("k@new", &l, 1, at(0)).unwrap().remaining(), 1);
        assert_eq!(store.stats().live_buckets, 1);
        // And when the bucket moved is the emptier one, it replaces the one it lands on.
        assert!(store.check("j@old", &l, 8, at(0)).unwrap().allowed());
        assert!(store.check("j@new", &l, 3, at(0)).unwrap().allowed());
        store.rebase_where(at(0), |key: &String| {
            (key == "j@old").then(|| ("j@new".to_owned(), l, l))
        });
        assert_eq!(store.peek("j@new", &l, 1, at(0)).unwrap().remaining(), 1);
    }

    #[test]
    fn states_past_the_slots_room_spill_and_stay_exact() {
        let store: MemoryStore<u64> = MemoryStore::builder().shards(1).build();
        let l = limit(10, "10/s");
        assert!(store.check(&1, &l, 1, at(0)).unwrap().allowed());
        assert_eq!(store.stats().spilled, 0);
        // Full again after 2^55 ns: the state no longer fits in the slot.
        let late = 1u64 << 56;
        assert_eq!(store.check(&2, &l, 4, at(late)).unwrap().remaining(), 6);
        assert_eq!(store.stats().spilled, 1);
        // 0.1 s refills one token; one is taken.
        let later = at(late + SEC / 10);
        assert_eq!(store.check(&2, &l, 1, later).unwrap().remaining(), 6);
        assert_eq!(store.peek(&1, &l, 10, later).unwrap().remaining(), 0);
        assert_eq!(store.sweep(at(late + 10 * SEC)), 2);
        assert_eq!(store.stats().spilled, 0);
    }

    #[test]
    fn a_state_full_at_the_first_instant_a_slot_cannot_hold_spills() {
        let store: MemoryStore<u64> = MemoryStore::builder().shards(1).build();
        let l = limit(2, "1/ms");
        // Full again at 2^55 ns - 1: packed.
        assert!(
            store
                .check(&1, &l, 1, at(SPILLED - 1_000_001))
                .unwrap()
                .allowed()
        );
        assert_eq!(store.stats().spilled, 0);
        // Full again at 2^55 ns: spilled, and read back exactly.
        let now = at(SPILLED - 1_000_000);
        assert!(store.check(&2, &l, 1, now).unwrap().allowed());
        assert_eq!(store.stats().spilled, 1);
        assert_eq!(store.check(&2, &l, 1, now).unwrap().remaining(), 0);
        assert!(!store.check(&2, &l, 1, now).unwrap().allowed());
    }

    #[test]
    fn the_bound_is_split_over_the_shards_exactly() {
        // Ten over four shards: 3, 3, 2 and 2, so the store holds ten, not eight or twelve.
        let store: MemoryStore<u64> = MemoryStore::builder().shards(4).max_buckets(10).build();
        let l = limit(10, "1/h");
        for key in 0..1_000 {
            assert!(store.check(&key, &l, 1, at(0)).unwrap().allowed());
        }
        let stats = store.stats();
        assert_eq!(stats.live_buckets, 10);
        assert_eq!(stats.evicted, 990);
    }

    #[test]
    fn a_shard_at_its_share_of_records_forgets_its_oldest() {
        let store: MemoryStore<Box<str>> = MemoryStore::builder()
            .shards(1)
            .max_idempotency_records(2)
            .build();
        let l = limit(10, "1/h");
        for id in ["r-0", "r-1", "r-2"] {
            assert!(
                store
                    .check_idempotent("k", &l, 1, at(0), id)
                    .unwrap()
                    .allowed()
            );
        }
        assert_eq!(store.stats().idempotency_records, 2);
        let retry = |id| store.check_idempotent("k", &l, 1, at(1), id).unwrap();
        assert_eq!(
            retry("r-2").remaining(),
            7,
            "remembered: its first decision"
        );
        assert_eq!(retry("r-0").remaining(), 6, "forgotten: charged again");
    }

    #[cfg(feature = "testkit")]
    #[test]
    fn a_bucket_or_log_is_forgettable_once_it_reads_as_new() {
        let store: MemoryStore<Box<str>> = MemoryStore::default();
        assert!(store.forgettable("k", at(0)), "nothing held");
        let l = limit(2, "1/s");
        assert!(store.check("k", &l, 1, at(0)).unwrap().allowed());
        assert!(!store.forgettable("k", at(SEC - 1)));
        assert!(store.forgettable("k", at(SEC)));
        let window = log(2, 1_000);
        assert!(store.check("l", &window, 1, at(0)).unwrap().allowed());
        assert!(!store.forgettable("l", at(SEC - 1)));
        assert!(store.forgettable("l", at(SEC)));
    }

    #[test]
    fn keys_are_independent() {
        let store: MemoryStore<u64> = MemoryStore::default();
        let l = limit(1, "1/s");
        assert!(store.check(&1, &l, 1, at(0)).unwrap().allowed());
        assert!(!store.check(&1, &l, 1, at(0)).unwrap().allowed());
        assert!(store.check(&2, &l, 1, at(0)).unwrap().allowed());
        assert_eq!(store.stats().live_buckets, 2);
    }

    #[test]
    fn string_keys_borrow_as_str() {
        let store: MemoryStore<Box<str>> = MemoryStore::default();
        let l = limit(1, "1/s");
        assert!(store.check("a", &l, 1, at(0)).unwrap().allowed());
        assert!(!store.check("a", &l, 1, at(0)).unwrap().allowed());
    }

    #[test]
    fn errors_change_nothing() {
        let store: MemoryStore<u64> = MemoryStore::default();
        let l = limit(3, "1/s");
        assert!(store.check(&1, &l, 0, at(0)).is_err());
        assert!(store.check(&1, &l, 4, at(0)).is_err());
        assert_eq!(store.stats().live_buckets, 0);
        assert_eq!(store.check(&1, &l, 3, at(0)).unwrap().remaining(), 0);
    }

    #[test]
    fn full_buckets_are_dropped_losslessly_before_growth() {
        let store: MemoryStore<u64> = MemoryStore::builder().shards(1).build();
        let l = limit(1, "1/s");
        for key in 0..1_000 {
            store.check(&key, &l, 1, at(0)).unwrap();
        }
        // A new key every 10 ms, each full again a second later: about a hundred are ever
        // non-full, and the full ones make room instead of the table growing.
        for key in 1_000..100_000 {
            store.check(&key, &l, 1, at(key * SEC / 100)).unwrap();
        }
        let stats = store.stats();
        assert!(stats.expired > 90_000, "{stats:?}");
        assert_eq!(stats.evicted, 0);
        assert!(stats.live_buckets < 4_096, "{stats:?}");
    }

    #[test]
    fn a_full_table_grows_unless_dropping_its_full_buckets_frees_an_eighth() {
        // 24 buckets fill a 32-slot table to its 3/4; the 25th insert first drops the full
        // ones, and grows the table unless that freed an eighth (3), so that the next sweep is
        // at least that many inserts away.
        for (full, slots) in [(0, 64), (1, 64), (2, 64), (3, 32), (4, 32)] {
            let store: MemoryStore<u64> = MemoryStore::builder().shards(1).build();
            let (brief, long) = (limit(1, "1/ms"), limit(1, "1/h"));
            for key in 0..24 {
                let l = if key < full { &brief } else { &long };
                assert!(store.check(&key, l, 1, at(0)).unwrap().allowed());
            }
            assert_eq!(store.stats().slots, 32);
            assert!(store.check(&24, &long, 1, at(SEC)).unwrap().allowed());
            let stats = store.stats();
            assert_eq!(stats.slots, slots, "{full} full");
            assert_eq!(stats.expired, full);
            assert_eq!(stats.live_buckets, 25 - full as usize);
        }
    }

    #[test]
    fn a_sweep_after_a_spike_gives_the_tables_back() {
        let store: MemoryStore<u64> = MemoryStore::builder().build();
        // A hundred buckets stay in use for a minute; a spike of keys is full again in a second.
        // Everything is checked at 0, when nothing is full, so no insert drops anything.
        let lasting = limit(1, "1/m");
        let spike = limit(10, "1/s");
        for key in 0..100 {
            store.check(&(1_000_000 + key), &lasting, 1, at(0)).unwrap();
        }
        for key in 0..50_000 {
            store.check(&key, &spike, 1, at(0)).unwrap();
        }
        let peak = store.stats();
        assert_eq!(peak.live_buckets, 50_100);
        assert!(peak.slots >= 50_100 * 4 / 3, "{peak:?}");

        assert_eq!(store.sweep(at(30 * SEC)), 50_000);
        let after = store.stats();
        assert_eq!(after.live_buckets, 100);
        // 64 shards of 16 slots, or 32 for the rare shard that drew more than 8 of the 100.
        assert!(after.slots <= 64 * 32, "{after:?}");
        for key in 0..100 {
            let d = store
                .peek(&(1_000_000 + key), &lasting, 1, at(30 * SEC))
                .unwrap();
            assert!(
                !d.allowed(),
                "bucket {key} kept its state through the shrink"
            );
        }

        // Once those are full too, nothing is held at all, and the store still works.
        assert_eq!(store.sweep(at(61 * SEC)), 100);
        assert_eq!(store.stats().slots, 0);
        let again = limit(1, "1/s");
        assert!(store.check(&7, &again, 1, at(61 * SEC)).unwrap().allowed());
        assert!(!store.check(&7, &again, 1, at(61 * SEC)).unwrap().allowed());
    }

    #[test]
    fn a_shards_keys_spread_over_its_whole_table() {
        // Every key of a shard shares the hash bits that chose the shard: were its home slot
        // drawn from them, a shard's keys would crowd into a fraction of its table.
        let (_, mean) = fill_and_measure(&MemoryStore::default());
        // Linear probing at load a finds a key (1 + 1 / (1 - a)) / 2 - 1 slots past its home
        // on average: 0.5 here, 1.5 at the 3/4 bound.
        assert!(mean < 0.75, "{mean} slots past home on average");
    }

    /// Fills `store` with 128,000 sequential keys, 2,000 a shard on average (4,096 slots each,
    /// about half in use), and returns the most one shard holds and how many slots past its
    /// home a key sits on average.
    fn fill_and_measure<S: BuildHasher>(store: &MemoryStore<u64, S>) -> (usize, f64) {
        let l = limit(1, "1/h");
        let keys = 128_000;
        for key in 0..keys {
            store.check(&key, &l, 1, at(0)).unwrap();
        }
        let (mut held, mut fullest, mut displacement) = (0, 0, 0);
        for shard in &store.shards {
            let shard = sync::lock(&shard.0);
            held += shard.buckets.len();
            fullest = fullest.max(shard.buckets.len());
            displacement += shard.buckets.displacement(|key| store.hash(key));
        }
        assert_eq!(held as u64, keys);
        (fullest, displacement as f64 / held as f64)
    }

    /// A weak hasher: the key, moved up `SHIFT` bits (all of them out at 64: every key hashes
    /// to 0). Sequential keys then differ only in a few bits (the low ones, or high ones), and
    /// the store's own mixing must carry them to the bits that pick the shard, the home slot
    /// and the tag.
    #[derive(Default)]
    struct Shifted<const SHIFT: u32>(u64);

    impl<const SHIFT: u32> std::hash::Hasher for Shifted<SHIFT> {
        fn finish(&self) -> u64 {
            self.0.checked_shl(SHIFT).unwrap_or(0)
        }
        fn write(&mut self, bytes: &[u8]) {
            for &byte in bytes {
                self.0 = self.0 << 8 | u64::from(byte);
            }
        }
        fn write_u64(&mut self, n: u64) {
            self.0 = n;
        }
    }

    fn assert_spread<const SHIFT: u32>(most_past_home: f64) {
        let store: MemoryStore<u64, _> = MemoryStore::builder()
            .build_with_hasher(std::hash::BuildHasherDefault::<Shifted<SHIFT>>::default());
        let (fullest, mean) = fill_and_measure(&store);
        assert!(
            fullest < 2_400,
            "{fullest} keys in one shard (shift {SHIFT})"
        );
        assert!(
            mean < most_past_home,
            "{mean} slots past home on average (shift {SHIFT})"
        );
    }

    #[test]
    fn keys_whose_hashes_collide_stay_apart() {
        // Every key hashes alike: only comparing the keys tells them apart.
        let store: MemoryStore<u64, _> = MemoryStore::builder()
            .build_with_hasher(std::hash::BuildHasherDefault::<Shifted<64>>::default());
        let l = limit(1, "1/s");
        assert!(store.check(&1, &l, 1, at(0)).unwrap().allowed());
        assert!(store.check(&2, &l, 1, at(0)).unwrap().allowed());
        assert!(!store.check(&1, &l, 1, at(0)).unwrap().allowed());
        let both = [
            Item {
                key: &3,
                limit: &l,
                cost: 1,
            },
            Item {
                key: &4,
                limit: &l,
                cost: 1,
            },
        ];
        let decisions = store.check_all(&both, at(0), None).unwrap();
        assert!(decisions.iter().all(Decision::allowed));
        assert!(matches!(
            store.check_all(&[both[0], both[0]], at(0), None),
            Err(Error::DuplicateKey { index: 1 })
        ));
    }

    #[test]
    fn a_weak_hashers_sequential_keys_still_spread_over_shards_and_slots() {
        // Half a slot past home on average, as with a good hasher (see the test above).
        assert_spread::<0>(0.75);
        // Keys that differ only in bits 40..57 keep some structure through one multiply (one
        // slot past home, measured): still no worse than linear probing at the 3/4 bound.
        assert_spread::<40>(1.5);
    }

    #[test]
    fn bound_evicts_buckets_closest_to_full_first() {
        let store: MemoryStore<u64> = MemoryStore::builder().shards(1).max_buckets(64).build();
        let l = limit(10, "1/s");
        // Key k is charged 1 + k % 10 tokens at time 0: higher k % 10 means further from full.
        for key in 0..64u64 {
            store.check(&key, &l, 1 + key % 10, at(0)).unwrap();
        }
        store.check(&1_000, &l, 10, at(0)).unwrap();
        let stats = store.stats();
        assert_eq!((stats.live_buckets, stats.evicted), (64, 1));
        // The evicted bucket was one of those charged a single token (k % 10 == 0).
        let survivors_of_cost_one = [0u64, 10, 20, 30, 40, 50, 60]
            .iter()
            .filter(|k| store.peek(*k, &l, 10, at(0)).map(|d| !d.allowed()).unwrap())
            .count();
        assert_eq!(survivors_of_cost_one, 6);
    }

    /// A shard at its bound frees 1/64 of it (at least one): full buckets first, then the
    /// closest to full, taking only as many of a tie as make up the count.
    #[test]
    fn the_bound_frees_exactly_its_share() {
        let brief = limit(1, "1/ms");
        let long = limit(2, "1/h");
        // (bound, buckets full when the next key comes, live after it, expired, evicted)
        let cases = [
            // One slot: the only bucket is evicted.
            (1, 0, 1, 0, 1),
            // A bucket gone full makes the room; nothing is evicted.
            (4, 1, 4, 1, 0),
            // 128 frees two: one full, then one of the 127 tied closest to full.
            (128, 1, 127, 1, 1),
            // 192 frees three: the bucket closest to full (not full yet), then two of the tie.
            (192, 0, 190, 0, 3),
        ];
        for (bound, full, live, expired, evicted) in cases {
            let store: MemoryStore<u64> =
                MemoryStore::builder().shards(1).max_buckets(bound).build();
            // Key 0 is full again after 1 ms; the rest after half an hour, all at once.
            assert!(store.check(&0, &brief, 1, at(0)).unwrap().allowed());
            for key in 1..bound as u64 {
                assert!(store.check(&key, &long, 1, at(0)).unwrap().allowed());
            }
            let next = if full == 1 { at(SEC) } else { at(1) };
            assert!(store.check(&u64::MAX, &long, 1, next).unwrap().allowed());
            let stats = store.stats();
            assert_eq!(
                (stats.live_buckets, stats.expired, stats.evicted),
                (live, expired, evicted),
                "bound {bound}"
            );
        }
    }

    #[test]
    fn spilled_states_expire_and_are_evicted_with_their_buckets() {
        // 3/s: one token is 333,333,333.3 ns, so states carry a remainder and spill.
        let l = limit(3, "3/s");
        let store: MemoryStore<u64> = MemoryStore::builder().shards(1).max_buckets(64).build();
        for key in 0..100 {
            assert!(store.check(&key, &l, 1, at(0)).unwrap().allowed());
        }
        let stats = store.stats();
        assert_eq!(stats.live_buckets, 64);
        assert_eq!(
            stats.spilled, 64,
            "one spill entry per live bucket, none left behind"
        );
        // A spilled bucket decides exactly: two more tokens, then a wait of 1/3 s rounded up.
        assert!(store.check(&99, &l, 2, at(0)).unwrap().allowed());
        let wait = store.check(&99, &l, 1, at(0)).unwrap().retry_after();
        assert_eq!(wait, Some(Duration::from_nanos(333_333_334)));
        // Whole-nanosecond rates pack; full buckets go with their spill entries.
        assert!(
            store
                .check(&1_000, &limit(3, "1/s"), 1, at(0))
                .unwrap()
                .allowed()
        );
        assert_eq!(store.sweep(at(2 * SEC)), 64);
        let stats = store.stats();
        assert_eq!((stats.live_buckets, stats.spilled), (0, 0), "{stats:?}");
    }

    #[test]
    fn idempotent_retry_is_not_charged() {
        let store: MemoryStore<Box<str>> = MemoryStore::default();
        let l = limit(2, "1/s");
        let first = store.check_idempotent("k", &l, 1, at(0), "r-1").unwrap();
        let retry = store.check_idempotent("k", &l, 1, at(1), "r-1").unwrap();
        assert_eq!(first, retry);
        assert_eq!(store.peek("k", &l, 1, at(1)).unwrap().remaining(), 0);
        assert_eq!(
            store.check_idempotent("k", &l, 2, at(1), "r-1"),
            Err(Error::IdempotencyConflict)
        );
        // Another id is another request; the same id on another key too.
        assert!(
            store
                .check_idempotent("k", &l, 1, at(1), "r-2")
                .unwrap()
                .allowed()
        );
        assert!(
            store
                .check_idempotent("j", &l, 1, at(1), "r-1")
                .unwrap()
                .allowed()
        );
    }

    #[test]
    fn a_busy_keys_records_use_every_shards_share() {
        // 640 records over 64 shards: 10 per shard. Twenty requests on one key would overflow
        // the key's own shard and forget the first id inside its window; spread by id, they
        // fit, and the retry of the first is not charged again.
        let store: MemoryStore<Box<str>> =
            MemoryStore::builder().max_idempotency_records(640).build();
        let l = limit(1_000, "1/h");
        for i in 0..20 {
            let id = format!("r-{i}");
            assert!(
                store
                    .check_idempotent("k", &l, 1, at(0), &id)
                    .unwrap()
                    .allowed()
            );
        }
        store.check_idempotent("k", &l, 1, at(1), "r-0").unwrap();
        assert_eq!(store.peek("k", &l, 1, at(1)).unwrap().remaining(), 979);
        assert_eq!(store.stats().idempotency_records, 20);
    }

    #[test]
    fn a_check_timed_before_the_last_charge_sees_an_empty_bucket() {
        // Two threads read the clock in one order and take the shard lock in the other: the
        // second decides at a `now` 100 ns before the first one's charge.
        let store: MemoryStore<Box<str>> = MemoryStore::default();
        let l = limit(5, "10/s");
        assert!(store.check("k", &l, 5, at(SEC + 100)).unwrap().allowed());
        let late = store.check("k", &l, 1, at(SEC)).unwrap();
        assert!(!late.allowed());
        assert_eq!(late.remaining(), 0);
        assert_eq!(late.retry_after(), Some(Duration::from_millis(100)));
    }

    #[test]
    fn idempotency_window_expires() {
        let store: MemoryStore<Box<str>> = MemoryStore::builder()
            .idempotency_window(Duration::from_secs(1))
            .build();
        let l = limit(5, "1/ms");
        store.check_idempotent("k", &l, 5, at(0), "r").unwrap();
        // Past the window the id is forgotten and the request is new (and the bucket refilled).
        let again = store.check_idempotent("k", &l, 5, at(SEC), "r").unwrap();
        assert!(again.allowed());
        assert!(
            !store
                .check_idempotent("k", &l, 5, at(SEC), "r2")
                .unwrap()
                .allowed()
        );
    }

    #[test]
    fn rejected_checks_are_not_recorded() {
        let store: MemoryStore<Box<str>> = MemoryStore::default();
        let l = limit(1, "1/s");
        store.check("k", &l, 1, at(0)).unwrap();
        assert!(
            !store
                .check_idempotent("k", &l, 1, at(0), "r")
                .unwrap()
                .allowed()
        );
        assert!(
            store
                .check_idempotent("k", &l, 1, at(SEC), "r")
                .unwrap()
                .allowed()
        );
    }

    #[test]
    fn check_all_is_all_or_nothing() {
        let store: MemoryStore<Box<str>> = MemoryStore::default();
        let user = limit(5, "1/s");
        let tenant = limit(2, "1/s");
        let items = |cost| {
            [
                Item {
                    key: "user",
                    limit: &user,
                    cost,
                },
                Item {
                    key: "tenant",
                    limit: &tenant,
                    cost,
                },
            ]
        };
        let decisions = store.check_all(&items(2), at(0), None).unwrap();
        assert!(decisions.iter().all(Decision::allowed));
        assert_eq!(decisions[0].remaining(), 3);
        // The tenant is empty: nothing is taken from the user either.
        let decisions = store.check_all(&items(1), at(0), None).unwrap();
        assert!(decisions[0].allowed() && !decisions[1].allowed());
        assert_eq!(decisions[0].remaining(), 3, "the uncharged balance");
        assert_eq!(store.peek("user", &user, 1, at(0)).unwrap().remaining(), 2);
    }

    #[test]
    fn check_all_refuses_bad_requests_without_charging() {
        let store: MemoryStore<Box<str>> = MemoryStore::default();
        let l = limit(2, "1/s");
        let empty: [Item<'_, str>; 0] = [];
        assert_eq!(store.check_all(&empty, at(0), None), Err(Error::EmptyCheck));
        let dup = [
            Item {
                key: "a",
                limit: &l,
                cost: 1,
            },
            Item {
                key: "a",
                limit: &l,
                cost: 1,
            },
        ];
        assert_eq!(
            store.check_all(&dup, at(0), None),
            Err(Error::DuplicateKey { index: 1 })
        );
        let bad_cost = [
            Item {
                key: "a",
                limit: &l,
                cost: 1,
            },
            Item {
                key: "b",
                limit: &l,
                cost: 3,
            },
        ];
        assert!(matches!(
            store.check_all(&bad_cost, at(0), None),
            Err(Error::InvalidCost { .. })
        ));
        assert_eq!(store.stats().live_buckets, 0);
    }

    #[test]
    fn check_all_idempotent() {
        let store: MemoryStore<Box<str>> = MemoryStore::default();
        let l = limit(3, "1/s");
        let items = [
            Item {
                key: "a",
                limit: &l,
                cost: 1,
            },
            Item {
                key: "b",
                limit: &l,
                cost: 2,
            },
        ];
        let first = store.check_all(&items, at(0), Some("r")).unwrap();
        let retry = store.check_all(&items, at(5), Some("r")).unwrap();
        assert_eq!(first, retry);
        assert_eq!(store.peek("b", &l, 1, at(5)).unwrap().remaining(), 0);
        let other = [
            Item {
                key: "a",
                limit: &l,
                cost: 2,
            },
            items[1],
        ];
        assert_eq!(
            store.check_all(&other, at(5), Some("r")),
            Err(Error::IdempotencyConflict)
        );
    }

    #[test]
    fn a_settlement_gives_back_once_what_was_not_used() {
        let store: MemoryStore<Box<str>> = MemoryStore::default();
        let l = limit(10, "1/s");
        let item = |cost| Item {
            key: "k",
            limit: &l,
            cost,
        };
        assert_eq!(
            store
                .check_idempotent("k", &l, 8, at(0), "r")
                .unwrap()
                .remaining(),
            2
        );
        // Used 3 of the 8 reserved: 5 back, at any later time, exactly.
        let settled = store.settle(&[item(8)], at(SEC / 2), "r", &[5]).unwrap();
        assert_eq!(settled.status, SettleStatus::Settled);
        assert_eq!(settled.decisions[0].remaining(), 7);
        let again = store.settle(&[item(8)], at(SEC), "r", &[5]).unwrap();
        assert_eq!(again.status, SettleStatus::Repeated);
        assert_eq!(
            again.decisions[0].remaining(),
            8,
            "nothing more, half a token refilled"
        );
        assert_eq!(
            store.settle(&[item(8)], at(SEC), "r", &[4]),
            Err(Error::IdempotencyConflict)
        );
        assert_eq!(
            store.settle(&[item(7)], at(SEC), "r", &[4]),
            Err(Error::IdempotencyConflict),
            "not the check recorded"
        );
        // A retried check still gets its first decision, charging nothing.
        assert_eq!(
            store
                .check_idempotent("k", &l, 8, at(SEC), "r")
                .unwrap()
                .remaining(),
            2
        );
        assert_eq!(
            store.peek("k", &l, 1, at(SEC)).unwrap().remaining(),
            7,
            "8 left, one taken"
        );
    }

    #[test]
    fn a_refund_never_fills_a_bucket_past_full() {
        let store: MemoryStore<Box<str>> = MemoryStore::default();
        let l = limit(10, "1/s");
        store.check_idempotent("k", &l, 4, at(0), "r").unwrap();
        let item = Item {
            key: "k",
            limit: &l,
            cost: 4,
        };
        let settled = store.settle(&[item], at(3 * SEC), "r", &[4]).unwrap();
        assert_eq!(settled.decisions[0].remaining(), 10);
        assert!(store.check("k", &l, 10, at(3 * SEC)).unwrap().allowed());
        assert!(!store.check("k", &l, 1, at(3 * SEC)).unwrap().allowed());
    }

    #[test]
    fn nothing_is_given_back_without_a_charge_on_record() {
        let store: MemoryStore<Box<str>> = MemoryStore::builder()
            .idempotency_window(Duration::from_secs(60))
            .build();
        let l = limit(5, "1/s");
        let item = |cost| Item {
            key: "k",
            limit: &l,
            cost,
        };
        store.check("k", &l, 5, at(0)).unwrap();
        // Rejected: not charged, so not recorded.
        assert!(
            !store
                .check_idempotent("k", &l, 5, at(0), "r")
                .unwrap()
                .allowed()
        );
        let settled = store.settle(&[item(5)], at(0), "r", &[5]).unwrap();
        assert_eq!(settled.status, SettleStatus::NotFound);
        assert_eq!(settled.decisions[0].remaining(), 0);
        // Charged, but settled after the window: the charge stands.
        assert!(
            store
                .check_idempotent("k", &l, 2, at(2 * SEC), "late")
                .unwrap()
                .allowed()
        );
        let settled = store
            .settle(&[item(2)], at(62 * SEC), "late", &[2])
            .unwrap();
        assert_eq!(settled.status, SettleStatus::NotFound);
        assert_eq!(
            store.settle(&[item(2)], at(3 * SEC), "late", &[3]),
            Err(Error::InvalidSettlement {
                reason: "a refund cannot pass the cost charged"
            })
        );
        assert_eq!(
            store.settle(&[item(2)], at(3 * SEC), "late", &[1, 1]),
            Err(Error::InvalidSettlement {
                reason: "it needs one refund per bucket"
            })
        );
    }

    #[test]
    fn a_settlement_of_several_buckets_gives_each_its_own() {
        let store: MemoryStore<Box<str>> = MemoryStore::default();
        let bucket = limit(10, "1/s");
        let window = Limit::fixed_window(10, Duration::from_secs(60)).unwrap();
        let items = [
            Item {
                key: "a",
                limit: &bucket,
                cost: 6,
            },
            Item {
                key: "b",
                limit: &window,
                cost: 6,
            },
        ];
        store.check_all(&items, at(0), Some("r")).unwrap();
        let settled = store.settle(&items, at(0), "r", &[6, 2]).unwrap();
        assert_eq!(settled.status, SettleStatus::Settled);
        let remaining: Vec<u64> = settled.decisions.iter().map(Decision::remaining).collect();
        assert_eq!(remaining, [10, 6]);
        // In the window's next minute its count is gone anyway: nothing given back there.
        store.check_all(&items, at(SEC), Some("s")).unwrap();
        let settled = store.settle(&items, at(61 * SEC), "s", &[0, 6]).unwrap();
        assert_eq!(settled.decisions[1].remaining(), 10);
        assert!(
            store
                .check("b", &window, 10, at(61 * SEC))
                .unwrap()
                .allowed()
        );
        assert!(
            !store
                .check("b", &window, 1, at(61 * SEC))
                .unwrap()
                .allowed()
        );
    }

    fn log(n: u64, window_ms: u64) -> Limit {
        Limit::sliding_log(n, Duration::from_millis(window_ms)).unwrap()
    }

    /// Tokens given back with no record come off every kind of bucket's latest charges: a
    /// token bucket (packed or spilled) gains exactly what it is given, up to full; a window
    /// gets back from the count of its current window, a log from its latest entry, never
    /// below 0; a bucket never charged stays full; a refused request changes nothing.
    #[test]
    fn tokens_given_back_come_off_the_latest_charges() {
        let store: MemoryStore<Box<str>> = MemoryStore::default();
        fn item<'a>(key: &'a str, limit: &'a Limit, cost: u64) -> Item<'a, str> {
            Item { key, limit, cost }
        }
        for limit in [limit(10, "1/h"), limit(10, "3/s")] {
            store.check("t", &limit, 9, at(SEC)).unwrap();
            let given = store.give_back(&[item("t", &limit, 4)], at(SEC)).unwrap();
            assert!(given[0].allowed());
            assert_eq!(given[0].remaining(), 5);
            let given = store.give_back(&[item("t", &limit, 10)], at(SEC)).unwrap();
            assert_eq!(given[0].remaining(), 10, "never past full");
            assert!(store.check("t", &limit, 10, at(SEC)).unwrap().allowed());
            assert!(!store.check("t", &limit, 1, at(SEC)).unwrap().allowed());
            store.reset("t");
        }
        let fixed = Limit::fixed_window(5, Duration::from_secs(60)).unwrap();
        let sliding = Limit::sliding_window(5, Duration::from_secs(60)).unwrap();
        // (window, left after this minute's 1, left once it is given back).
        for (window, before, after) in [(&fixed, 4, 5), (&sliding, 0, 1)] {
            // Last minute's 4 stay counted where they weigh (4 * 59/60 of them for the sliding
            // window, a second into this minute); this minute's 1 comes back, and no more.
            store.check("w", window, 4, at(30 * SEC)).unwrap();
            let charged = store.check("w", window, 1, at(61 * SEC)).unwrap();
            assert_eq!(charged.remaining(), before, "{window:?}");
            let given = store
                .give_back(&[item("w", window, 3)], at(61 * SEC))
                .unwrap();
            assert_eq!(given[0].remaining(), after, "{window:?}");
            store.reset("w");
        }
        let log = log(5, 60_000);
        store.check("l", &log, 2, at(SEC)).unwrap();
        store.check("l", &log, 2, at(2 * SEC)).unwrap();
        let given = store.give_back(&[item("l", &log, 5)], at(3 * SEC)).unwrap();
        assert_eq!(
            given[0].remaining(),
            3,
            "the latest entry's 2, not the older one's"
        );
        assert_eq!(
            store.check("l", &log, 3, at(3 * SEC)).unwrap().remaining(),
            0
        );
        // Never charged: full, and nothing stored.
        let fresh = limit(10, "1/s");
        let live = store.stats().live_buckets;
        let given = store.give_back(&[item("new", &fresh, 3)], at(SEC)).unwrap();
        assert_eq!(given[0].remaining(), 10);
        assert_eq!(store.stats().live_buckets, live);
        // Refused as a check is, changing nothing.
        store.check("t", &fresh, 10, at(SEC)).unwrap();
        for refused in [
            store.give_back(&[item("t", &fresh, 0)], at(SEC)),
            store.give_back(&[item("t", &fresh, 11)], at(SEC)),
            store.give_back(&[item("t", &fresh, 1), item("t", &fresh, 1)], at(SEC)),
            store.give_back::<str>(&[], at(SEC)),
        ] {
            assert!(refused.is_err(), "{refused:?}");
        }
        assert_eq!(store.peek("t", &fresh, 1, at(SEC)).unwrap().remaining(), 0);
    }

    /// A reset makes every kind of bucket as if never used: a packed token bucket, one whose
    /// exact state spilled (a rate of 3/s), a fixed and a sliding window (with a previous
    /// window's count), a log; idempotency records stay; other keys are untouched.
    #[test]
    fn a_reset_makes_a_bucket_as_if_never_used() {
        let store: MemoryStore<Box<str>> = MemoryStore::default();
        let kinds = [
            ("packed", limit(5, "1/h")),
            ("spilled", limit(5, "3/s")),
            (
                "fixed",
                Limit::fixed_window(5, Duration::from_secs(60)).unwrap(),
            ),
            (
                "sliding",
                Limit::sliding_window(5, Duration::from_secs(60)).unwrap(),
            ),
            ("log", log(5, 60_000)),
        ];
        for (key, limit) in &kinds {
            // The sliding window keeps last minute's count as well as this one's.
            store.check(*key, limit, 3, at(30 * SEC)).unwrap();
            let drained =
                (0..10).any(|_| !store.check(*key, limit, 1, at(70 * SEC)).unwrap().allowed());
            assert!(drained, "{key}");
            store.check("other", limit, 5, at(70 * SEC)).unwrap();
            assert!(store.reset(*key), "{key}");
            let decision = store.check(*key, limit, 5, at(70 * SEC)).unwrap();
            assert!(decision.allowed(), "{key}: {decision:?}");
            assert!(
                !store
                    .check("other", limit, 1, at(70 * SEC))
                    .unwrap()
                    .allowed(),
                "{key}"
            );
            assert!(store.reset("other"));
        }
        // The states the last checks spilled go with their resets.
        assert!(store.stats().spilled > 0);
        for (key, _) in &kinds {
            store.reset(*key);
        }
        assert_eq!(store.stats().spilled, 0);
        assert!(!store.reset("never-seen"));
        // A recorded request is answered as recorded after a reset, not charged again.
        let once = limit(1, "1/h");
        let first = store.check_idempotent("id", &once, 1, at(0), "r").unwrap();
        store.reset("id");
        assert_eq!(
            store.check_idempotent("id", &once, 1, at(0), "r").unwrap(),
            first
        );
        assert!(store.check("id", &once, 1, at(0)).unwrap().allowed());
    }

    #[test]
    fn a_sliding_log_joins_all_or_nothing_checks() {
        let store: MemoryStore<Box<str>> = MemoryStore::default();
        let user = limit(5, "1/s");
        let minute = log(2, 60_000);
        let items = |cost| {
            [
                Item {
                    key: "user",
                    limit: &user,
                    cost,
                },
                Item {
                    key: "user:log",
                    limit: &minute,
                    cost,
                },
            ]
        };
        let decisions = store.check_all(&items(2), at(0), None).unwrap();
        assert!(decisions.iter().all(Decision::allowed));
        // The log is full: the bucket is not charged, and the log reports its wait.
        let decisions = store.check_all(&items(1), at(SEC), None).unwrap();
        assert!(decisions[0].allowed() && !decisions[1].allowed());
        assert_eq!(decisions[0].remaining(), 4, "the uncharged balance");
        assert_eq!(decisions[1].retry_after(), Some(Duration::from_secs(59)));
        assert_eq!(
            store.peek("user", &user, 1, at(SEC)).unwrap().remaining(),
            3
        );
        // A bucket that rejects leaves the log uncharged.
        let decisions = store.check_all(&items(1), at(60 * SEC), None).unwrap();
        assert!(decisions.iter().all(Decision::allowed));
        let big = [Item {
            key: "user",
            limit: &user,
            cost: 5,
        }];
        assert!(!store.check_all(&big, at(60 * SEC), None).unwrap()[0].allowed());
        let peeked = store.peek("user:log", &minute, 1, at(60 * SEC)).unwrap();
        assert_eq!(peeked.remaining(), 0, "one charged, one more fits");
        // Settled for less: the refund comes off the log's entry.
        let id = "job";
        let once = [Item {
            key: "user:log",
            limit: &minute,
            cost: 1,
        }];
        store.check_all(&once, at(200 * SEC), Some(id)).unwrap();
        let settled = store.settle(&once, at(201 * SEC), id, &[1]).unwrap();
        assert_eq!(settled.status, SettleStatus::Settled);
        assert_eq!(settled.decisions[0].remaining(), 2);
    }

    #[test]
    fn logs_count_in_the_bound_and_expire_when_they_count_nothing() {
        let store: MemoryStore<u64> = MemoryStore::builder().shards(1).max_buckets(8).build();
        let short = log(3, 1_000);
        let bucket = limit(10, "1/s");
        for key in 0..4u64 {
            store
                .check(&key, &short, 1 + key % 3, at(key * SEC / 10))
                .unwrap();
            store.check(&(100 + key), &bucket, 3, at(0)).unwrap();
        }
        let stats = store.stats();
        assert_eq!(
            (stats.live_buckets, stats.logs, stats.log_entries),
            (8, 4, 4)
        );
        // At the bound, the entry closest to counting nothing goes: the log of key 0.
        store.check(&1_000, &bucket, 10, at(SEC / 2)).unwrap();
        let stats = store.stats();
        assert_eq!((stats.live_buckets, stats.logs, stats.evicted), (8, 3, 1));
        assert_eq!(
            store.peek(&0, &short, 3, at(SEC / 2)).unwrap().remaining(),
            0
        );
        assert!(!store.peek(&1, &short, 3, at(SEC / 2)).unwrap().allowed());
        // Once its latest entry stops counting, a log is dropped like a full bucket.
        assert_eq!(store.sweep(at(2 * SEC)), 3);
        assert_eq!((store.stats().live_buckets, store.stats().logs), (5, 0));
        assert_eq!(store.sweep(at(11 * SEC)), 5);
    }
}
