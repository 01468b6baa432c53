//! A process's memory of the rejections Redis recently gave, so that a key hammered far past
//! its limit is answered here until its `retry_after` passes, without a round trip.
//!
//! An abusive client, or a retry storm, sends one key many times its limit; every one of those
//! requests would be rejected, and asking Redis each time spends its single core on answers
//! known in advance. A rejection of `cost` from a bucket stays a rejection of `cost` until the
//! bucket has refilled that much: tokens come back with time alone, and other processes'
//! charges only take more. So a remembered rejection is answered for the same bucket, limit
//! and cost until its `retry_after` has passed since the request was *sent* (no later than
//! Redis decided it), aged by the time gone ([`Decision::aged`]).
//!
//! What can make such an answer wrong, always towards under-admitting: tokens given back by
//! another process's settlement ([`tollgate::Store::settle`]; this process's own forget the
//! keys they touch) or a cross-slot refund in a cluster, before the remembered wait is over.
//! Only single-bucket checks on Redis' clock without a request id are remembered or answered:
//! a retried request must get its first decision from Redis, and a caller's own time (tests,
//! replays) is not this process's clock.
//!
//! Memory is bounded: a shard that fills up is emptied whole (cheap, and only costs round
//! trips), and an entry whose wait has passed is dropped when next looked up.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tollgate::{Decision, Limit, Timestamp};

/// Shards of the memory, so concurrent checks on different keys rarely share a lock.
const SHARDS: usize = 16;

/// Rejections waiting less than this are not remembered: the next request would likely find
/// the bucket refilled, and the memory would only churn.
const SHORTEST: Duration = Duration::from_millis(1);

struct Entry {
    limit: Limit,
    cost: u64,
    /// When the request that got `decision` was sent, on this process's monotonic clock.
    sent: Timestamp,
    decision: Decision,
}

/// Recent rejections by bucket key (as stored, with the prefix).
pub(crate) struct Rejections {
    shards: Box<[Mutex<HashMap<String, Entry>>]>,
    per_shard: usize,
    hasher: RandomState,
    answered: AtomicU64,
}

impl Rejections {
    /// A memory of at most about `max` rejections; `None` for 0 (off).
    pub(crate) fn new(max: usize) -> Option<Self> {
        (max > 0).then(|| Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            per_shard: max.div_ceil(SHARDS),
            hasher: RandomState::new(),
            answered: AtomicU64::new(0),
        })
    }

    fn shard(&self, key: &str) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        let index = (self.hasher.hash_one(key) as usize) % self.shards.len();
        // A poisoned shard only means a panic elsewhere mid-insert; its map is still whole.
        self.shards[index]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The rejection to answer for `cost` from `key`'s bucket under `limit` at `now`, if one is
    /// remembered and its wait has not passed.
    pub(crate) fn answer(
        &self,
        key: &str,
        limit: &Limit,
        cost: u64,
        now: Timestamp,
    ) -> Option<Decision> {
        let mut shard = self.shard(key);
        let entry = shard.get(key)?;
        let elapsed = now.saturating_duration_since(entry.sent);
        let waiting = entry
            .decision
            .retry_after()
            .is_some_and(|wait| elapsed < wait);
        if !waiting {
            shard.remove(key);
            return None;
        }
        if entry.limit != *limit || entry.cost != cost {
            return None;
        }
        self.answered.fetch_add(1, Ordering::Relaxed);
        Some(entry.decision.aged(elapsed))
    }

    /// Remembers `decision` for `key` if it is a rejection worth remembering, `sent` being when
    /// its request left this process.
    pub(crate) fn remember(&self, key: &str, decision: &Decision, sent: Timestamp) {
        if decision.retry_after().is_none_or(|wait| wait < SHORTEST) {
            return;
        }
        let mut shard = self.shard(key);
        if shard.len() >= self.per_shard && !shard.contains_key(key) {
            shard.clear();
        }
        shard.insert(
            key.to_owned(),
            Entry {
                limit: *decision.limit(),
                cost: decision.cost(),
                sent,
                decision: *decision,
            },
        );
    }

    /// Forgets `key`: this process gave its bucket tokens back.
    pub(crate) fn forget(&self, key: &str) {
        self.shard(key).remove(key);
    }

    /// Checks answered from memory so far.
    pub(crate) fn answered(&self) -> u64 {
        self.answered.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rejection(limit: &Limit, cost: u64) -> Decision {
        // Empty (a deficit past the capacity is read as the capacity), so `cost` waits
        // cost / rate.
        Decision::from_deficit(false, *limit, cost, u128::MAX)
    }

    fn at(millis: u64) -> Timestamp {
        Timestamp::from_nanos(millis * 1_000_000)
    }

    #[test]
    fn a_rejection_is_answered_until_its_wait_passes() {
        let memory = Rejections::new(100).unwrap();
        let limit = Limit::new(10, "10/s".parse().unwrap()).unwrap();
        let decision = rejection(&limit, 2);
        assert_eq!(decision.retry_after(), Some(Duration::from_millis(200)));
        memory.remember("k", &decision, at(1_000));
        let answered = memory.answer("k", &limit, 2, at(1_050)).unwrap();
        assert!(!answered.allowed());
        assert_eq!(answered.retry_after(), Some(Duration::from_millis(150)));
        assert!(
            memory.answer("k", &limit, 1, at(1_050)).is_none(),
            "another cost"
        );
        let other = Limit::new(20, "10/s".parse().unwrap()).unwrap();
        assert!(
            memory.answer("k", &other, 2, at(1_050)).is_none(),
            "another limit"
        );
        assert!(
            memory.answer("k", &limit, 2, at(1_200)).is_none(),
            "waited out"
        );
        assert!(
            memory.answer("k", &limit, 2, at(1_100)).is_none(),
            "and dropped"
        );
        assert_eq!(memory.answered(), 1);
    }

    #[test]
    fn allowed_and_short_waits_are_not_remembered_and_settled_keys_are_forgotten() {
        let memory = Rejections::new(100).unwrap();
        let limit = Limit::new(1_000_000, "1000000/s".parse().unwrap()).unwrap();
        memory.remember("short", &rejection(&limit, 1), at(0));
        assert!(memory.answer("short", &limit, 1, at(0)).is_none());
        let allowed = Decision::from_deficit(true, limit, 1, 1);
        memory.remember("allowed", &allowed, at(0));
        assert!(memory.answer("allowed", &limit, 1, at(0)).is_none());
        memory.remember("long", &rejection(&limit, 10_000), at(0));
        assert!(memory.answer("long", &limit, 10_000, at(1)).is_some());
        memory.forget("long");
        assert!(memory.answer("long", &limit, 10_000, at(1)).is_none());
    }

    #[test]
    fn a_wait_of_exactly_the_shortest_is_remembered() {
        let memory = Rejections::new(100).unwrap();
        let limit = Limit::new(1_000, "1000/s".parse().unwrap()).unwrap();
        let decision = rejection(&limit, 1);
        assert_eq!(decision.retry_after(), Some(SHORTEST));
        memory.remember("k", &decision, at(0));
        assert!(memory.answer("k", &limit, 1, at(0)).is_some());
    }

    #[test]
    fn keys_stay_until_their_shard_fills_even_when_remembered_again() {
        // 100 keys over 16 shards: many share one, none fills its 10_000 / 16.
        let memory = Rejections::new(10_000).unwrap();
        let limit = Limit::new(1, "1/h".parse().unwrap()).unwrap();
        let keys: Vec<String> = (0..100).map(|key| format!("k{key}")).collect();
        for _ in 0..2 {
            for key in &keys {
                memory.remember(key, &rejection(&limit, 1), at(0));
            }
        }
        let held = keys
            .iter()
            .filter(|key| memory.answer(key, &limit, 1, at(1)).is_some())
            .count();
        assert_eq!(held, 100);
    }

    #[test]
    fn memory_stays_bounded() {
        let memory = Rejections::new(32).unwrap();
        let limit = Limit::new(1, "1/h".parse().unwrap()).unwrap();
        for key in 0..10_000 {
            memory.remember(&format!("k{key}"), &rejection(&limit, 1), at(0));
        }
        let held: usize = memory.shards.iter().map(|s| s.lock().unwrap().len()).sum();
        assert!(held <= 32, "{held}");
        assert!(Rejections::new(0).is_none());
    }
}
