//! The in-process lease table.
//!
//! Leases are few per key (at most `max_in_flight`) but their keys are as many as the callers,
//! so the table is sharded by key like the bucket store, and bounded in leases. Each key keeps
//! its leases ordered by when they end: the ones that timed out are then at the front, so an
//! acquire drops them in time proportional to their number, and the oldest one still held,
//! which sets `retry_after`, is the first.
//!
//! A release names only the lease id, so a second map, sharded by id, tells which keys it
//! holds. Lock order is id shard first, then key shards in ascending index, the same in every
//! operation, so none can deadlock.

use std::collections::VecDeque;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use hashbrown::HashMap;
use parking_lot::{Mutex, MutexGuard};

use super::{LeaseDecision, LeaseTake, check_lease_id};
use crate::clock::Timestamp;
use crate::error::Error;

type Hasher = foldhash::fast::RandomState;

/// A lease held on one key: its id and when it stops counting (nanoseconds).
#[derive(Debug)]
struct Held {
    id: Arc<str>,
    ends: u64,
}

/// The leases held on one key, ordered by `ends`.
type Leases = VecDeque<Held>;

/// One key shard: each key's leases.
type KeyShard = HashMap<String, Leases, Hasher>;

/// One id shard: each lease's record.
type IdShard = HashMap<Arc<str>, Record, Hasher>;

/// Which keys a lease holds (each with the timeout it was taken with, in nanoseconds, for a
/// renewal), and when the last of them times out.
#[derive(Debug)]
struct Record {
    keys: Box<[(Box<str>, u64)]>,
    ends: u64,
}

/// A full sweep runs at most this often when the table is full, so that a table full of live
/// leases refuses acquires in constant time instead of walking every lease each time.
const FULL_SWEEP_EVERY: Duration = Duration::from_millis(100);

/// How a [`MemoryLeases`] is set up.
#[derive(Debug, Clone)]
#[must_use]
pub struct MemoryLeasesBuilder {
    shards: usize,
    max_leases: usize,
}

impl MemoryLeasesBuilder {
    /// Number of lock shards, rounded up to a power of two (default 64).
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards.max(1).next_power_of_two();
        self
    }

    /// The most leases held at once, over every key (default 1,000,000). An acquire past it
    /// is refused with [`Error::TooManyLeases`]: never admitted, never evicting a live lease.
    pub fn max_leases(mut self, max: usize) -> Self {
        self.max_leases = max.max(1);
        self
    }

    /// The table.
    pub fn build(self) -> MemoryLeases {
        let hasher = Hasher::default();
        MemoryLeases {
            keys: (0..self.shards).map(|_| Mutex::default()).collect(),
            ids: (0..self.shards).map(|_| Mutex::default()).collect(),
            mask: self.shards - 1,
            hasher,
            live: AtomicUsize::new(0),
            max_leases: self.max_leases,
            last_full_sweep: AtomicU64::new(u64::MAX),
        }
    }
}

/// Leases held in this process, with the semantics [`LeaseStore`](crate::LeaseStore) states.
///
/// ```
/// use std::time::Duration;
/// use tollgate::{LeaseLimit, LeaseTake, MemoryLeases, Timestamp};
///
/// let leases = MemoryLeases::default();
/// let limit = LeaseLimit::new(1, Duration::from_secs(30))?;
/// let takes = [LeaseTake::new("export:{acme}", &limit)];
/// let t0 = Timestamp::ZERO;
/// assert!(leases.acquire(&takes, "lease-1", t0)?[0].allowed());
/// let busy = leases.acquire(&takes, "lease-2", t0)?;
/// assert!(!busy[0].allowed());
/// assert_eq!(busy[0].retry_after(), Some(Duration::from_secs(30)));
///
/// assert!(leases.release("lease-1", t0)?);
/// assert!(leases.acquire(&takes, "lease-2", t0)?[0].allowed());
/// # Ok::<(), tollgate::Error>(())
/// ```
pub struct MemoryLeases {
    keys: Box<[Mutex<KeyShard>]>,
    ids: Box<[Mutex<IdShard>]>,
    mask: usize,
    hasher: Hasher,
    /// Records in `ids`, timed out or not.
    live: AtomicUsize,
    max_leases: usize,
    /// When the table was last swept whole for being full (`u64::MAX`: never).
    last_full_sweep: AtomicU64,
}

impl std::fmt::Debug for MemoryLeases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryLeases")
            .field("shards", &self.keys.len())
            .field("live", &self.live.load(Ordering::Relaxed))
            .field("max_leases", &self.max_leases)
            .finish_non_exhaustive()
    }
}

impl Default for MemoryLeases {
    fn default() -> Self {
        Self::builder().build()
    }
}

impl MemoryLeases {
    /// A builder with the defaults: 64 shards, at most 1,000,000 leases.
    pub fn builder() -> MemoryLeasesBuilder {
        MemoryLeasesBuilder {
            shards: 64,
            max_leases: 1_000_000,
        }
    }

    /// Leases recorded, including timed-out ones no acquire, release or sweep has dropped yet.
    pub fn len(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// Whether no lease is recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard_of(&self, text: &str) -> usize {
        (self.hasher.hash_one(text) as usize) & self.mask
    }

    /// Takes lease `lease_id` on every key of `takes` at `now`, or on none.
    ///
    /// # Errors
    ///
    /// Before changing anything: [`Error::InvalidLeaseId`], [`Error::EmptyCheck`],
    /// [`Error::DuplicateKey`], [`Error::LeaseIdInUse`] when a lease with this id is still
    /// held, and [`Error::TooManyLeases`] when the table is full of leases still held.
    pub fn acquire(
        &self,
        takes: &[LeaseTake<'_>],
        lease_id: &str,
        now: Timestamp,
    ) -> Result<Vec<LeaseDecision>, Error> {
        check_lease_id(lease_id)?;
        check_keys(takes)?;
        let now = now.as_nanos();
        if self.live.load(Ordering::Relaxed) >= self.max_leases {
            self.sweep_when_full(now);
            if self.live.load(Ordering::Relaxed) >= self.max_leases {
                return Err(Error::TooManyLeases {
                    max: self.max_leases,
                });
            }
        }

        let mut ids = self.ids[self.shard_of(lease_id)].lock();
        if let Some(record) = ids.get(lease_id) {
            if record.ends > now {
                return Err(Error::LeaseIdInUse);
            }
            // A timed-out lease under the same id: its slots count no more, drop it whole.
            if let Some(stale) = ids.remove(lease_id) {
                self.live.fetch_sub(1, Ordering::Relaxed);
                self.forget(lease_id, &stale.keys);
            }
        }
        let (of_take, mut shards) = self.lock_shards(takes);
        let mut decisions = Vec::with_capacity(takes.len());
        let mut allowed = true;
        for (take, &shard) in takes.iter().zip(&of_take) {
            let map = shards.guard(shard);
            let held = map.get_mut(take.key).map(|leases| {
                drop_ended(leases, now);
                &*leases
            });
            let decision = decide(held, take.limit.max_in_flight(), now);
            allowed &= decision.allowed() || !take.enforce;
            decisions.push(decision);
        }
        if !allowed {
            return Ok(decisions);
        }

        let id: Arc<str> = Arc::from(lease_id);
        let mut last = 0;
        let mut keys = Vec::with_capacity(takes.len());
        for ((take, &shard), decision) in takes.iter().zip(&of_take).zip(&mut decisions) {
            if !decision.allowed() {
                // A key that cannot fail the acquire, full: reported, not held.
                continue;
            }
            let timeout = take.limit.timeout_ms() * 1_000_000;
            keys.push((Box::from(take.key), timeout));
            let ends = now.saturating_add(timeout);
            last = last.max(ends);
            let map = shards.guard(shard);
            let leases = map.entry_ref(take.key).or_insert_with(Leases::new);
            let at = leases.partition_point(|held| held.ends <= ends);
            leases.insert(
                at,
                Held {
                    id: Arc::clone(&id),
                    ends,
                },
            );
            *decision = decide(Some(leases), take.limit.max_in_flight(), now);
            // Taken: the figures are those after the lease, with a free slot before it.
            decision.set_taken();
        }
        drop(shards);
        let keys = keys.into_boxed_slice();
        ids.insert(id, Record { keys, ends: last });
        self.live.fetch_add(1, Ordering::Relaxed);
        Ok(decisions)
    }

    /// What an acquire on each key of `takes` alone would decide at `now`, holding nothing.
    ///
    /// # Errors
    ///
    /// [`Error::EmptyCheck`] and [`Error::DuplicateKey`], as for an acquire.
    pub fn in_flight(
        &self,
        takes: &[LeaseTake<'_>],
        now: Timestamp,
    ) -> Result<Vec<LeaseDecision>, Error> {
        check_keys(takes)?;
        let now = now.as_nanos();
        Ok(takes
            .iter()
            .map(|take| {
                let map = self.keys[self.shard_of(take.key)].lock();
                let held = map.get(take.key);
                // Leases that ended are not dropped here (looking changes nothing); they
                // are skipped, and they sit at the front.
                let live = held.map(|leases| {
                    let ended = leases.partition_point(|held| held.ends <= now);
                    leases.range(ended..)
                });
                decide_iter(live, take.limit.max_in_flight(), now)
            })
            .collect())
    }

    /// Gives lease `lease_id` back on every key it holds: `Ok(true)` if it was still held at
    /// `now`, `Ok(false)` if it had timed out or is unknown (released before, or never taken).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidLeaseId`], before looking.
    pub fn release(&self, lease_id: &str, now: Timestamp) -> Result<bool, Error> {
        check_lease_id(lease_id)?;
        let mut ids = self.ids[self.shard_of(lease_id)].lock();
        let Some(record) = ids.remove(lease_id) else {
            return Ok(false);
        };
        self.live.fetch_sub(1, Ordering::Relaxed);
        self.forget(lease_id, &record.keys);
        drop(ids);
        Ok(record.ends > now.as_nanos())
    }

    /// Extends lease `lease_id` from `now`: on every key where it is still held, its end moves
    /// to `now` plus the timeout it was taken with (never earlier than it was). `Ok(Some(d))`
    /// with `d` the time until its last end; `Ok(None)` when it is not held (timed out,
    /// released, or unknown). A lease that timed out on a key is not revived there: its slot
    /// may be someone else's by now.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidLeaseId`], before looking.
    pub fn renew(&self, lease_id: &str, now: Timestamp) -> Result<Option<Duration>, Error> {
        check_lease_id(lease_id)?;
        let now = now.as_nanos();
        let mut ids = self.ids[self.shard_of(lease_id)].lock();
        let Some(record) = ids.get_mut(lease_id) else {
            return Ok(None);
        };
        if record.ends <= now {
            return Ok(None);
        }
        let mut last = None;
        for (key, timeout) in &*record.keys {
            let mut map = self.keys[self.shard_of(key)].lock();
            let Some(leases) = map.get_mut(&**key) else {
                continue;
            };
            let Some(at) = leases
                .iter()
                .position(|held| &*held.id == lease_id && held.ends > now)
            else {
                continue;
            };
            let Some(held) = leases.remove(at) else {
                continue;
            };
            let ends = held.ends.max(now.saturating_add(*timeout));
            last = last.max(Some(ends));
            let at = leases.partition_point(|other| other.ends <= ends);
            leases.insert(at, Held { id: held.id, ends });
        }
        let Some(last) = last else {
            return Ok(None);
        };
        record.ends = record.ends.max(last);
        Ok(Some(Duration::from_nanos(last - now)))
    }

    /// Drops every lease that has timed out at `now`, and every key left without one; returns
    /// how many leases went. Acquires drop a key's ended leases on the way, so this is for
    /// memory: run it now and then (the policy engine does, with the bucket sweep).
    pub fn sweep(&self, now: Timestamp) -> usize {
        let now = now.as_nanos();
        for shard in &*self.keys {
            shard.lock().retain(|_, leases| {
                drop_ended(leases, now);
                !leases.is_empty()
            });
        }
        let mut dropped = 0;
        for shard in &*self.ids {
            let mut ids = shard.lock();
            let before = ids.len();
            ids.retain(|_, record| record.ends > now);
            dropped += before - ids.len();
        }
        self.live.fetch_sub(dropped, Ordering::Relaxed);
        dropped
    }

    fn sweep_when_full(&self, now: u64) {
        let last = self.last_full_sweep.load(Ordering::Relaxed);
        let due =
            last == u64::MAX || now < last || now - last >= FULL_SWEEP_EVERY.as_nanos() as u64;
        if due
            && self
                .last_full_sweep
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.sweep(Timestamp::from_nanos(now));
        }
    }

    /// Removes lease `id` from each of `keys` (a key left empty goes too).
    fn forget(&self, id: &str, keys: &[(Box<str>, u64)]) {
        for (key, _) in keys {
            let mut map = self.keys[self.shard_of(key)].lock();
            if let Some(leases) = map.get_mut(&**key) {
                if let Some(at) = leases.iter().position(|held| &*held.id == id) {
                    leases.remove(at);
                }
                if leases.is_empty() {
                    map.remove(&**key);
                }
            }
        }
    }

    /// Each take's shard, and those shards locked.
    fn lock_shards(&self, takes: &[LeaseTake<'_>]) -> (Vec<usize>, Locked<'_>) {
        let of_take: Vec<usize> = takes.iter().map(|t| self.shard_of(t.key)).collect();
        let mut order = of_take.clone();
        order.sort_unstable();
        order.dedup();
        let guards = order.iter().map(|&s| (s, self.keys[s].lock())).collect();
        (of_take, Locked { guards })
    }
}

/// The key shards one acquire holds, locked in ascending order.
struct Locked<'a> {
    guards: Vec<(usize, MutexGuard<'a, KeyShard>)>,
}

impl Locked<'_> {
    fn guard(&mut self, shard: usize) -> &mut KeyShard {
        let at = self.guards.partition_point(|(s, _)| *s < shard);
        &mut self.guards[at].1
    }
}

fn check_keys(takes: &[LeaseTake<'_>]) -> Result<(), Error> {
    if takes.is_empty() {
        return Err(Error::EmptyCheck);
    }
    for (index, take) in takes.iter().enumerate() {
        if takes[..index].iter().any(|t| t.key == take.key) {
            return Err(Error::DuplicateKey { index });
        }
    }
    Ok(())
}

/// Drops the leases at the front that ended at or before `now`.
fn drop_ended(leases: &mut Leases, now: u64) {
    while leases.front().is_some_and(|held| held.ends <= now) {
        leases.pop_front();
    }
}

fn decide(held: Option<&Leases>, max: u64, now: u64) -> LeaseDecision {
    decide_iter(held.map(|leases| leases.range(..)), max, now)
}

/// The decision for a key holding the leases of `live` (all still held, ordered by end).
fn decide_iter<'a>(
    live: Option<impl ExactSizeIterator<Item = &'a Held> + DoubleEndedIterator>,
    max: u64,
    now: u64,
) -> LeaseDecision {
    let Some(mut live) = live else {
        return LeaseDecision::new(true, max, 0, None, Duration::ZERO);
    };
    let count = live.len() as u64;
    let last = live.next_back().map_or(now, |held| held.ends);
    let first = live.next().map_or(last, |held| held.ends);
    let allowed = count < max;
    let retry_after = (!allowed).then(|| Duration::from_nanos(first.saturating_sub(now)));
    LeaseDecision::new(
        allowed,
        max,
        count,
        retry_after,
        Duration::from_nanos(last.saturating_sub(now)),
    )
}

impl LeaseDecision {
    /// After a lease was taken the key holds up to `max` leases, which `decide` would read as
    /// full; it had a free slot, so the decision is an admission.
    fn set_taken(&mut self) {
        self.allowed = true;
        self.retry_after = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::LeaseLimit;

    fn at(ms: u64) -> Timestamp {
        Timestamp::from_nanos(ms * 1_000_000)
    }

    fn limit(max: u64, timeout_ms: u64) -> LeaseLimit {
        LeaseLimit::new(max, Duration::from_millis(timeout_ms)).unwrap()
    }

    #[test]
    fn holds_at_most_max_then_frees_on_release_or_timeout() {
        let leases = MemoryLeases::default();
        let l = limit(2, 1_000);
        let takes = [LeaseTake::new("k", &l)];
        let a = leases.acquire(&takes, "a", at(0)).unwrap()[0];
        assert!(a.allowed());
        assert_eq!((a.in_flight(), a.remaining()), (1, 1));
        assert_eq!(a.reset_after(), Duration::from_secs(1));
        let b = leases.acquire(&takes, "b", at(300)).unwrap()[0];
        assert!(b.allowed());
        assert_eq!(
            (b.in_flight(), b.remaining(), b.retry_after()),
            (2, 0, None)
        );
        assert_eq!(b.reset_after(), Duration::from_millis(1_000));

        let c = leases.acquire(&takes, "c", at(400)).unwrap()[0];
        assert!(!c.allowed());
        assert_eq!((c.in_flight(), c.remaining()), (2, 0));
        assert_eq!(c.retry_after(), Some(Duration::from_millis(600)));
        assert_eq!(c.reset_after(), Duration::from_millis(900));
        assert_eq!(leases.len(), 2, "a rejection holds nothing");

        // A lease counts up to its end, not at it.
        assert!(!leases.acquire(&takes, "c", at(999)).unwrap()[0].allowed());
        assert!(leases.acquire(&takes, "c", at(1_000)).unwrap()[0].allowed());
        // Released: the slot is free at once, and the second release says it was not held.
        assert!(leases.release("b", at(1_001)).unwrap());
        assert!(!leases.release("b", at(1_001)).unwrap());
        assert!(leases.acquire(&takes, "d", at(1_001)).unwrap()[0].allowed());
        assert!(!leases.acquire(&takes, "e", at(1_001)).unwrap()[0].allowed());
        // Releasing a lease that timed out changes nothing and says so.
        assert!(!leases.release("a", at(1_001)).unwrap());
    }

    #[test]
    fn an_acquire_over_several_keys_holds_all_or_nothing() {
        let leases = MemoryLeases::default();
        let one = limit(1, 1_000);
        let two = limit(2, 5_000);
        let both = [LeaseTake::new("user", &two), LeaseTake::new("tenant", &one)];
        assert!(
            leases
                .acquire(&both, "a", at(0))
                .unwrap()
                .iter()
                .all(LeaseDecision::allowed)
        );
        let refused = leases.acquire(&both, "b", at(10)).unwrap();
        assert!(refused[0].allowed() && !refused[1].allowed());
        assert_eq!(
            refused[0].in_flight(),
            1,
            "nothing taken on the key with room"
        );
        let user = [both[0]];
        let alone = leases.in_flight(&user, at(10)).unwrap()[0];
        assert_eq!(alone.in_flight(), 1);
        // Released, both keys are free again.
        assert!(leases.release("a", at(20)).unwrap());
        assert_eq!(leases.in_flight(&both, at(20)).unwrap()[1].in_flight(), 0);
        assert!(leases.is_empty());
    }

    #[test]
    fn a_soft_key_is_held_when_free_and_never_fails_the_acquire() {
        let leases = MemoryLeases::default();
        let one = limit(1, 1_000);
        let five = limit(5, 1_000);
        let both = [
            LeaseTake::new("user", &five),
            LeaseTake::new("shadow", &one).soft(),
        ];
        let first = leases.acquire(&both, "a", at(0)).unwrap();
        assert!(first[0].allowed() && first[1].allowed());
        assert_eq!(first[1].in_flight(), 1, "held while free");
        let second = leases.acquire(&both, "b", at(0)).unwrap();
        assert!(second[0].allowed(), "the acquire passes");
        assert!(!second[1].allowed(), "and reports the would-reject");
        assert_eq!(second[1].in_flight(), 1, "without holding past the limit");
        assert_eq!(
            leases.in_flight(&[both[0]], at(0)).unwrap()[0].in_flight(),
            2
        );
        // Releasing the lease that was refused on the soft key leaves the first one's slot.
        assert!(leases.release("b", at(1)).unwrap());
        assert_eq!(leases.in_flight(&both, at(1)).unwrap()[1].in_flight(), 1);
        // An enforced key full: nothing is held, the soft key included.
        let full = [
            LeaseTake::new("shadow", &one),
            LeaseTake::new("fresh", &one).soft(),
        ];
        assert!(!leases.acquire(&full, "c", at(2)).unwrap()[0].allowed());
        assert_eq!(
            leases.in_flight(&[full[1]], at(2)).unwrap()[0].in_flight(),
            0
        );
    }

    #[test]
    fn bad_requests_change_nothing() {
        let leases = MemoryLeases::default();
        let l = limit(1, 1_000);
        let k = LeaseTake::new("k", &l);
        assert_eq!(
            leases.acquire(&[k, k], "a", at(0)),
            Err(Error::DuplicateKey { index: 1 })
        );
        assert_eq!(leases.acquire(&[], "a", at(0)), Err(Error::EmptyCheck));
        assert_eq!(
            leases.acquire(&[k], "a b", at(0)),
            Err(Error::InvalidLeaseId { len: 3 })
        );
        assert!(leases.is_empty());
        assert!(leases.acquire(&[k], "a", at(0)).unwrap()[0].allowed());
        let other = LeaseTake::new("other", &l);
        assert_eq!(
            leases.acquire(&[other], "a", at(1)),
            Err(Error::LeaseIdInUse)
        );
        // Once the first lease under the id timed out, the id may be taken again.
        assert!(leases.acquire(&[other], "a", at(1_000)).unwrap()[0].allowed());
        assert_eq!(leases.len(), 1);
        assert!(leases.in_flight(&[k], at(1_000)).unwrap()[0].in_flight() == 0);
    }

    #[test]
    fn a_renewal_moves_the_end_of_a_lease_still_held_and_revives_none() {
        let leases = MemoryLeases::default();
        let short = limit(1, 1_000);
        let long = limit(1, 5_000);
        let both = [
            LeaseTake::new("short", &short),
            LeaseTake::new("long", &long),
        ];
        assert!(leases.acquire(&both, "a", at(0)).unwrap()[0].allowed());
        // Each key's end moves to now plus its own timeout.
        assert_eq!(
            leases.renew("a", at(800)).unwrap(),
            Some(Duration::from_millis(5_000))
        );
        let full = leases.acquire(&both, "b", at(1_500)).unwrap();
        assert_eq!(full[0].retry_after(), Some(Duration::from_millis(300)));
        assert_eq!(full[1].retry_after(), Some(Duration::from_millis(4_300)));
        // Past the short key's end, only the long key is renewed: the short slot is free.
        assert_eq!(
            leases.renew("a", at(2_000)).unwrap(),
            Some(Duration::from_millis(5_000))
        );
        let short_key = [both[0]];
        assert!(leases.acquire(&short_key, "c", at(2_000)).unwrap()[0].allowed());
        // A lease that ended everywhere, or was released, is not renewed.
        assert_eq!(leases.renew("a", at(7_000)).unwrap(), None);
        assert_eq!(
            leases.renew("c", at(2_500)).unwrap(),
            Some(Duration::from_millis(1_000))
        );
        assert!(leases.release("c", at(2_600)).unwrap());
        assert_eq!(leases.renew("c", at(2_600)).unwrap(), None);
        assert_eq!(leases.renew("nope", at(0)).unwrap(), None);
        assert_eq!(
            leases.renew("a b", at(0)),
            Err(Error::InvalidLeaseId { len: 3 })
        );
    }

    #[test]
    fn time_going_back_frees_nothing() {
        let leases = MemoryLeases::default();
        let l = limit(1, 1_000);
        let k = [LeaseTake::new("k", &l)];
        assert!(leases.acquire(&k, "a", at(5_000)).unwrap()[0].allowed());
        let back = leases.acquire(&k, "b", at(100)).unwrap()[0];
        assert!(!back.allowed());
        assert_eq!(back.retry_after(), Some(Duration::from_millis(5_900)));
    }

    #[test]
    fn the_bound_refuses_rather_than_evicts_and_sweeps_make_room() {
        let leases = MemoryLeases::builder().shards(4).max_leases(3).build();
        let l = limit(10, 1_000);
        for (i, key) in ["a", "b", "c"].iter().enumerate() {
            let take = [LeaseTake::new(key, &l)];
            assert!(leases.acquire(&take, &format!("id{i}"), at(0)).unwrap()[0].allowed());
        }
        let d = [LeaseTake::new("d", &l)];
        assert_eq!(
            leases.acquire(&d, "id3", at(10)),
            Err(Error::TooManyLeases { max: 3 })
        );
        // Once they time out, the full table sweeps itself before refusing.
        assert!(leases.acquire(&d, "id3", at(1_000)).unwrap()[0].allowed());
        assert_eq!(leases.len(), 1);
        assert!(!leases.is_empty());
        assert_eq!(leases.sweep(at(2_000)), 1);
        assert!(leases.is_empty());
    }

    /// A table of `max` leases on distinct keys, all taken at 0 for one second.
    fn full_table(max: usize) -> MemoryLeases {
        let leases = MemoryLeases::builder().shards(4).max_leases(max).build();
        let l = limit(1, 1_000);
        for i in 0..max {
            let key = format!("k{i}");
            let take = [LeaseTake::new(&key, &l)];
            assert!(leases.acquire(&take, &format!("id{i}"), at(0)).unwrap()[0].allowed());
        }
        leases
    }

    /// Whether one more lease, on a key of its own, is taken at `ms`.
    fn one_more(leases: &MemoryLeases, ms: u64) -> Result<bool, Error> {
        let l = limit(1, 1_000);
        let take = [LeaseTake::new("one-more", &l)];
        Ok(leases.acquire(&take, "one-more", at(ms))?[0].allowed())
    }

    #[test]
    fn a_full_table_sweeps_itself_at_most_every_hundred_milliseconds() {
        let leases = full_table(2);
        let full = Err(Error::TooManyLeases { max: 2 });
        // Swept at 950 ms, dropping nothing: every lease is held until 1,000.
        assert_eq!(one_more(&leases, 950), full);
        // Timed out at 1,000, but the last sweep was less than 100 ms ago: refused, in
        // constant time, until the next one is due.
        assert_eq!(one_more(&leases, 1_000), full);
        assert_eq!(one_more(&leases, 1_049), full);
        assert_eq!(leases.len(), 2);
        assert_eq!(one_more(&leases, 1_050), Ok(true));
        assert_eq!(leases.len(), 1);
    }

    #[test]
    fn a_full_table_sweeps_again_when_time_goes_back() {
        let leases = full_table(2);
        let full = Err(Error::TooManyLeases { max: 2 });
        assert_eq!(one_more(&leases, 950), full);
        // An earlier time (another thread's clock reading, say) sweeps, and counts from there.
        assert_eq!(one_more(&leases, 500), full);
        assert_eq!(one_more(&leases, 1_000), Ok(true));
    }

    #[test]
    fn a_lease_released_or_renewed_at_its_end_was_not_held() {
        let leases = MemoryLeases::default();
        let l = limit(1, 1_000);
        let k = [LeaseTake::new("k", &l)];
        assert!(leases.acquire(&k, "a", at(0)).unwrap()[0].allowed());
        assert!(!leases.release("a", at(1_000)).unwrap(), "ended at 1,000");

        let short = limit(1, 1_000);
        let long = limit(1, 5_000);
        let both = [LeaseTake::new("s", &short), LeaseTake::new("l", &long)];
        assert!(leases.acquire(&both, "b", at(0)).unwrap()[0].allowed());
        // At the short key's end only the long key is renewed: the short slot is free.
        assert_eq!(
            leases.renew("b", at(1_000)).unwrap(),
            Some(Duration::from_millis(5_000))
        );
        assert_eq!(
            leases.in_flight(&both, at(1_000)).unwrap()[0].in_flight(),
            0
        );
    }

    #[test]
    fn keys_and_ids_spread_over_the_shards() {
        let leases = MemoryLeases::builder().shards(16).build();
        let l = limit(1, 1_000);
        for i in 0..160 {
            let key = format!("key-{i}");
            let take = [LeaseTake::new(&key, &l)];
            assert!(leases.acquire(&take, &format!("id-{i}"), at(0)).unwrap()[0].allowed());
        }
        let keys = leases.keys.iter().filter(|s| !s.lock().is_empty()).count();
        let ids = leases.ids.iter().filter(|s| !s.lock().is_empty()).count();
        // 160 keys over 16 shards, 10 each on average: nearly every shard is used, where a
        // hash that ignored the key would put everything in one.
        assert!(
            keys >= 12 && ids >= 12,
            "{keys} key shards, {ids} id shards"
        );

        // One shard holds everything, and works.
        let one = MemoryLeases::builder().shards(1).build();
        let both = [LeaseTake::new("x", &l), LeaseTake::new("y", &l)];
        assert!(one.acquire(&both, "a", at(0)).unwrap()[1].allowed());
        assert!(one.release("a", at(1)).unwrap());
    }

    #[test]
    fn debug_shows_the_table_s_size_and_bound() {
        let leases = full_table(3);
        assert_eq!(
            format!("{leases:?}"),
            "MemoryLeases { shards: 4, live: 3, max_leases: 3, .. }"
        );
    }
}
