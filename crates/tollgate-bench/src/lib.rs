//! Shared pieces of the benchmarks, so that tollgate and its peer are driven identically.
//!
//! The criterion bench (`benches/memory.rs`) and the memory probe (`src/bin/bucket-memory.rs`)
//! both need the same quotas, the same pre-generated key sequences and one way to call either
//! limiter. Keeping them here is what makes "same quota, same keys, same loop" true by
//! construction rather than by care.

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use governor::{DefaultKeyedRateLimiter, Quota};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use tollgate::{Limit, MonotonicClock, Rate, RateLimiter};

mod redis_load;
mod redis_rig;
pub use redis_load::{Run, measure, run_load};
pub use redis_rig::{REDIS_KEYS, RedisRig};

/// The number of live keys in the large-keyspace scenarios.
pub const MANY_KEYS: u64 = 1_000_000;

/// The seed of the random key order: fixed, so every run checks the same sequence.
pub const SEED: u64 = 0x7011_6a7e;

/// tollgate's keyed limiter as the benchmarks use it: `u64` keys, the production clock, the
/// default store (64 shards, at most ten million live buckets).
pub type Tollgate = RateLimiter<u64, MonotonicClock>;

/// governor's keyed limiter as `RateLimiter::keyed` builds it: a `DashMap` store and the quanta
/// clock.
pub type Governor = DefaultKeyedRateLimiter<u64>;

/// One quota, expressed for both limiters.
#[derive(Clone, Copy, Debug)]
pub struct Quotas {
    /// Burst size (tollgate's capacity, governor's `max_burst`).
    pub capacity: u32,
    /// The time to earn one token back.
    pub per_token: Duration,
}

impl Quotas {
    /// The 1,000,000-key scenarios: a burst of 10,000 and one token back per minute.
    ///
    /// tollgate forgets a bucket as soon as it is full again (lossless expiry) while governor
    /// keeps every key it has seen. To compare both at 1M *live* buckets, no bucket may refill
    /// during the run (one token per minute, longer than pre-population) and no check may be
    /// rejected (each key is checked a few hundred times at most, far below the burst).
    pub const MANY_KEYS: Quotas = Quotas {
        capacity: 10_000,
        per_token: Duration::from_secs(60),
    };

    /// One key, never limited: a token back every nanosecond, so every check is allowed.
    pub const ONE_KEY_ALLOWED: Quotas = Quotas {
        capacity: 100,
        per_token: Duration::from_nanos(1),
    };

    /// One key hammered far beyond its limit of 100 per second: nearly every check is rejected.
    pub const ONE_KEY_LIMITED: Quotas = Quotas {
        capacity: 100,
        per_token: Duration::from_millis(10),
    };

    /// The quota as a tollgate [`Limit`].
    ///
    /// # Panics
    ///
    /// If tollgate refuses the quota; the constants above are valid.
    pub fn tollgate(&self) -> Limit {
        let rate = Rate::new(1, self.per_token).expect("a non-zero rate");
        Limit::new(u64::from(self.capacity), rate).expect("a valid limit")
    }

    /// The quota as a governor [`Quota`].
    ///
    /// # Panics
    ///
    /// If the capacity or the period is zero; the constants above are not.
    pub fn governor(&self) -> Quota {
        Quota::with_period(self.per_token)
            .expect("a non-zero period")
            .allow_burst(NonZeroU32::new(self.capacity).expect("a non-zero burst"))
    }

    /// A fresh tollgate limiter with this quota.
    pub fn new_tollgate(&self) -> Tollgate {
        RateLimiter::keyed(self.tollgate(), MonotonicClock::new())
    }

    /// A fresh governor limiter with this quota.
    pub fn new_governor(&self) -> Governor {
        governor::RateLimiter::keyed(self.governor())
    }
}

/// A keyed limiter the benchmark loop can drive: one check of one `u64` key, reading the
/// limiter's own clock, returning whatever the limiter's API returns.
pub trait KeyedCheck: Sync {
    /// What one check returns; the loop passes it to `black_box` whole.
    type Outcome;

    /// Takes one token from `key`'s bucket now.
    fn check_key(&self, key: &u64) -> Self::Outcome;
}

impl KeyedCheck for Tollgate {
    type Outcome = Result<tollgate::Decision, tollgate::Error>;

    #[inline]
    fn check_key(&self, key: &u64) -> Self::Outcome {
        self.check(key)
    }
}

impl KeyedCheck for Governor {
    type Outcome = Result<(), governor::NotUntil<governor::clock::QuantaInstant>>;

    #[inline]
    fn check_key(&self, key: &u64) -> Self::Outcome {
        governor::RateLimiter::check_key(self, key)
    }
}

/// A control, not a limiter: what any keyed check must at least do, with nothing shared
/// written. It reads the same clock as tollgate, mixes the key and loads one word of a
/// read-only table of `slots` words chosen by the hash.
///
/// With one slot it measures the clock read, the hash and the loop; with a table as large as
/// 1M buckets (64 MiB) it adds the cache and TLB miss every 1M-key check pays. Its 2-thread
/// scaling is the machine's own ceiling for the same loop: no locks, no shared writes.
pub struct Floor {
    clock: MonotonicClock,
    table: Vec<u64>,
    mask: usize,
}

impl Floor {
    /// A floor over a read-only table of `slots` words (rounded up to a power of two).
    pub fn new(slots: usize) -> Self {
        let slots = slots.next_power_of_two();
        Self {
            clock: MonotonicClock::new(),
            // Distinct non-zero words, so every page is really backed by memory.
            table: (1..=slots as u64).collect(),
            mask: slots - 1,
        }
    }
}

impl KeyedCheck for Floor {
    type Outcome = (tollgate::Timestamp, u64);

    #[inline]
    fn check_key(&self, key: &u64) -> Self::Outcome {
        let now = tollgate::Clock::now(&self.clock);
        // A folded multiply, the same construction foldhash uses for a `u64`: a few cycles.
        let product = u128::from(*key ^ SEED) * 0x9e37_79b9_7f4a_7c15;
        let hash = (product as u64) ^ ((product >> 64) as u64);
        (now, self.table[hash as usize & self.mask])
    }
}

/// A second control for the 1M-key groups: [`Floor`] with each load's address depending on
/// the word the thread's previous check loaded, so no two misses overlap.
///
/// [`Floor`]'s loads are independent, so the processor runs several of them at once and its
/// time per check is less than a miss. A limiter's check mostly cannot: it locks (or
/// compare-and-swaps) around its read, and on most processors measured an atomic
/// read-modify-write waits for every load before it. Then each of its misses costs the full
/// memory latency, which this control measures in the same run: a design with one miss per
/// check costs at least this, one with two misses about twice this. Some processors start the
/// next check's miss past the lock all the same (a Zen 5 host, BENCHMARKS.md's twenty-first
/// session: tollgate's one-thread check came in below this control in two runs of three).
pub struct ChainedFloor {
    floor: Floor,
}

thread_local! {
    /// The word the thread's previous [`ChainedFloor`] check loaded: each thread its own chain.
    static LAST_WORD: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

impl ChainedFloor {
    /// A chained floor over a read-only table of `slots` words (rounded up to a power of two).
    pub fn new(slots: usize) -> Self {
        Self {
            floor: Floor::new(slots),
        }
    }
}

impl KeyedCheck for ChainedFloor {
    type Outcome = (tollgate::Timestamp, u64);

    #[inline]
    fn check_key(&self, key: &u64) -> Self::Outcome {
        let now = tollgate::Clock::now(&self.floor.clock);
        let last = LAST_WORD.with(std::cell::Cell::get);
        let product = u128::from(*key ^ SEED ^ last) * 0x9e37_79b9_7f4a_7c15;
        let hash = (product as u64) ^ ((product >> 64) as u64);
        let word = self.floor.table[hash as usize & self.floor.mask];
        LAST_WORD.with(|cell| cell.set(word));
        (now, word)
    }
}

/// A control for the 2-thread rows: tollgate's limiter as one store per thread, the even keys
/// in one and the odd keys in the other (the two threads' key sets, see [`split_by_parity`]),
/// so the two cores share no shard lock and no table.
///
/// Not a way to use tollgate (a store per thread would give a key two buckets once threads
/// share keys), but the same check code with nothing written by both cores: its 2-thread
/// scaling beside the shared store's shows, in the same run, how much the shard locks' cache
/// lines moving between the cores cost, and how much of the gap to the ideal is the host's.
pub struct StorePerThread {
    stores: [Tollgate; 2],
}

impl StorePerThread {
    /// Two fresh limiters with `quotas`, one per key parity.
    pub fn new(quotas: &Quotas) -> Self {
        Self {
            stores: [quotas.new_tollgate(), quotas.new_tollgate()],
        }
    }

    /// Live buckets in both stores.
    pub fn live_buckets(&self) -> usize {
        self.stores
            .iter()
            .map(|store| store.store().stats().live_buckets)
            .sum()
    }
}

impl KeyedCheck for StorePerThread {
    type Outcome = Result<tollgate::Decision, tollgate::Error>;

    #[inline]
    fn check_key(&self, key: &u64) -> Self::Outcome {
        self.stores[(*key % 2) as usize].check(key)
    }
}

/// Checks `iters` keys from `keys`, cycling, starting at `*cursor`, and leaves `*cursor` where
/// the next run should continue (so successive samples cover the keys evenly).
///
/// This is the whole timed loop, for both limiters and for one or two threads.
#[inline(never)]
pub fn drive<L: KeyedCheck>(limiter: &L, keys: &[u64], cursor: &mut usize, iters: u64) {
    let mut i = *cursor;
    for _ in 0..iters {
        black_box(limiter.check_key(black_box(&keys[i])));
        i += 1;
        if i == keys.len() {
            i = 0;
        }
    }
    *cursor = i;
}

/// The wall time of one thread checking `iters` keys of `keys` in order, cycling; `cursor`
/// persists across samples.
// The ban on Instant::now keeps time inside tollgate behind its Clock; this harness code times
// the library from outside.
#[allow(clippy::disallowed_methods)]
pub fn time_one_thread<L: KeyedCheck>(
    limiter: &L,
    keys: &[u64],
    cursor: &mut usize,
    iters: u64,
) -> Duration {
    let start = Instant::now();
    drive(limiter, keys, cursor, iters);
    start.elapsed()
}

/// Two threads, each checking its own key set for half of `iters`; returns the wall time from
/// the moment both are released until both are done.
// As in time_one_thread: the harness times the library from outside.
#[allow(clippy::disallowed_methods)]
pub fn time_two_threads<L: KeyedCheck>(
    limiter: &L,
    keys: &[Vec<u64>; 2],
    cursors: &mut [usize; 2],
    iters: u64,
) -> Duration {
    let counts = [iters / 2, iters - iters / 2];
    let start_line = Barrier::new(3);
    std::thread::scope(|scope| {
        let workers: Vec<_> = keys
            .iter()
            .zip(cursors.iter_mut())
            .zip(counts)
            .map(|((keys, cursor), count)| {
                let start_line = &start_line;
                scope.spawn(move || {
                    start_line.wait();
                    drive(limiter, keys, cursor, count);
                })
            })
            .collect();
        start_line.wait();
        let start = Instant::now();
        for worker in workers {
            worker.join().expect("a benchmark thread panicked");
        }
        start.elapsed()
    })
}

/// Checks every key of `keys` once: the pre-population before a large-keyspace scenario.
pub fn populate<L: KeyedCheck>(limiter: &L, keys: impl IntoIterator<Item = u64>) {
    for key in keys {
        black_box(limiter.check_key(&key));
    }
}

/// The keys `0..n` in order.
pub fn sequential_keys(n: u64) -> Vec<u64> {
    (0..n).collect()
}

/// The keys `0..n` in a random order fixed by [`SEED`] (a permutation: each key once).
pub fn random_keys(n: u64) -> Vec<u64> {
    let mut keys = sequential_keys(n);
    keys.shuffle(&mut StdRng::seed_from_u64(SEED));
    keys
}

/// Splits `keys` into the even and the odd keys, each in its original order: two disjoint key
/// sets for two threads.
pub fn split_by_parity(keys: &[u64]) -> [Vec<u64>; 2] {
    let (even, odd) = keys.iter().partition(|&&key| key % 2 == 0);
    [even, odd]
}

/// The resident set size of this process, in bytes, from `/proc/self/statm` (Linux only).
///
/// # Errors
///
/// When `/proc` cannot be read or parsed.
pub fn resident_bytes() -> std::io::Result<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm")?;
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|field| field.parse().ok())
        .ok_or_else(|| std::io::Error::other("unexpected /proc/self/statm format"))?;
    Ok(pages * page_size()?)
}

/// The page size, from the `AT_PAGESZ` entry of the auxiliary vector (no libc call needed).
fn page_size() -> std::io::Result<u64> {
    const AT_PAGESZ: u64 = 6;
    let auxv = std::fs::read("/proc/self/auxv")?;
    auxv.chunks_exact(16)
        .map(|pair| {
            let word = |bytes: &[u8]| u64::from_ne_bytes(bytes.try_into().unwrap_or([0; 8]));
            (word(&pair[..8]), word(&pair[8..]))
        })
        .find(|&(kind, _)| kind == AT_PAGESZ)
        .map(|(_, size)| size)
        .ok_or_else(|| std::io::Error::other("no AT_PAGESZ in /proc/self/auxv"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotas_agree() {
        for quotas in [
            Quotas::MANY_KEYS,
            Quotas::ONE_KEY_ALLOWED,
            Quotas::ONE_KEY_LIMITED,
        ] {
            let limit = quotas.tollgate();
            let quota = quotas.governor();
            assert_eq!(limit.capacity(), u64::from(quota.burst_size().get()));
            assert_eq!(
                limit.time_to_full(),
                quota.replenish_interval() * quota.burst_size().get()
            );
        }
    }

    #[test]
    fn random_keys_are_a_permutation() {
        let mut keys = random_keys(1_000);
        assert_ne!(keys, sequential_keys(1_000));
        keys.sort_unstable();
        assert_eq!(keys, sequential_keys(1_000));
    }

    #[test]
    fn parity_split_is_disjoint_and_complete() {
        let [even, odd] = split_by_parity(&random_keys(1_001));
        assert_eq!((even.len(), odd.len()), (501, 500));
        assert!(even.iter().all(|k| k % 2 == 0) && odd.iter().all(|k| k % 2 == 1));
    }

    #[test]
    fn page_size_is_sane() {
        let size = page_size().unwrap();
        assert!(size.is_power_of_two() && size >= 4096, "{size}");
        assert!(resident_bytes().unwrap() > 0);
    }
}
