//! Concurrency limits (leases) in Redis, single node and Redis Cluster, against the memory
//! store's decisions: the same scenarios with exact figures, random traces (acquires, looks,
//! releases, renewals) compared answer by answer with `MemoryLeases`, 64 tasks on one key that
//! must never hold more than its limit, and the keys the store leaves behind (TTLs, records).

mod support;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::cluster_routing::Slot;
use support::{Inspector, RedisCluster, RedisServer, command, free_port, info_field};
use tollgate::{
    Error, LeaseDecision, LeaseLimit, LeaseRequest, LeaseStore, LeaseTake, MemoryLeases, Timestamp,
    Unavailable,
};
use tollgate_redis::{RedisConfig, RedisStore};

/// A time far from 0 (2023), in whole microseconds, as callers supply it.
const T0: u64 = 1_700_000_000_000_000_000;

/// The timeout of stores that decide under load or in a cluster: 64 tasks on a busy 2-core
/// machine, in a debug build, can pass the production 20 ms, which would fail a comparison
/// for nothing.
const LOADED: Duration = Duration::from_secs(2);

/// `ms` milliseconds after [`T0`].
fn at(ms: u64) -> Timestamp {
    Timestamp::from_nanos(T0 + ms * 1_000_000)
}

fn limit(max: u64, timeout_ms: u64) -> LeaseLimit {
    LeaseLimit::new(max, Duration::from_millis(timeout_ms)).expect("a valid limit")
}

async fn connect(url: &str) -> RedisStore {
    RedisStore::connect(url, RedisConfig::default().with_timeout(LOADED))
        .await
        .expect("connect")
}

async fn acquire(
    store: &impl LeaseStore,
    takes: &[LeaseTake<'_>],
    id: &str,
    now: Option<Timestamp>,
) -> Result<Vec<LeaseDecision>, Error> {
    store
        .acquire(LeaseRequest {
            takes,
            lease_id: id,
            now,
        })
        .await
}

async fn in_flight(
    store: &impl LeaseStore,
    takes: &[LeaseTake<'_>],
    now: Option<Timestamp>,
) -> Vec<LeaseDecision> {
    store
        .in_flight(LeaseRequest {
            takes,
            lease_id: "",
            now,
        })
        .await
        .expect("looked")
}

/// The store and the memory store side by side: every answer of the store is checked against
/// the memory store's for the same call, and returned.
struct Both<'a> {
    redis: &'a RedisStore,
    memory: MemoryLeases,
}

impl<'a> Both<'a> {
    fn new(redis: &'a RedisStore) -> Self {
        Self {
            redis,
            memory: MemoryLeases::default(),
        }
    }

    async fn acquire(
        &self,
        takes: &[LeaseTake<'_>],
        id: &str,
        now: Timestamp,
    ) -> Result<Vec<LeaseDecision>, Error> {
        let got = acquire(self.redis, takes, id, Some(now)).await;
        let want = self.memory.acquire(takes, id, now);
        assert_eq!(got, want, "acquire {id} at {now:?}");
        got
    }

    async fn in_flight(&self, takes: &[LeaseTake<'_>], now: Timestamp) -> Vec<LeaseDecision> {
        let got = in_flight(self.redis, takes, Some(now)).await;
        assert_eq!(Ok(&got), self.memory.in_flight(takes, now).as_ref());
        got
    }

    async fn release(&self, id: &str, now: Timestamp) -> bool {
        let got = self.redis.release(id, Some(now)).await.expect("released");
        assert_eq!(
            Ok(got),
            self.memory.release(id, now),
            "release {id} at {now:?}"
        );
        got
    }

    async fn renew(&self, id: &str, now: Timestamp) -> Option<Duration> {
        let got = self.redis.renew(id, Some(now)).await.expect("renewed");
        assert_eq!(Ok(got), self.memory.renew(id, now), "renew {id} at {now:?}");
        got
    }
}

impl Inspector {
    async fn integer(&mut self, args: &[&str]) -> i64 {
        self.query(args).await
    }

    /// Lease `id`'s end on `set`, in microseconds (`None` when the set does not hold it).
    async fn score(&mut self, set: &str, id: &str) -> Option<u64> {
        let score: Option<f64> = self.query(&["ZSCORE", set, id]).await;
        // Scores are whole microseconds below 2^53: exact in a double.
        score.map(|score| score as u64)
    }

    /// Redis' `TIME`, in microseconds, from the node holding `key`.
    async fn time_at(&mut self, key: &str) -> u64 {
        // `TIME` names no key, so a cluster would send it anywhere: ask the node of `key`
        // through a script that names it.
        let (seconds, micros): (u64, u64) = self
            .query(&[
                "EVAL",
                "local t = redis.call('TIME') return { tonumber(t[1]), tonumber(t[2]) }",
                "1",
                key,
            ])
            .await;
        seconds * 1_000_000 + micros
    }
}

// ---------------------------------------------------------------------------------------------
// Scenarios, each run on a single node and on a cluster.

/// The memory store's first scenario, figure for figure: at most `max` held, a rejection with
/// the oldest lease's end as `retry_after` and the last one's as `reset_after`, a release that
/// frees at once and says so once, a timeout that frees, and a lease counting up to its end.
async fn holds_at_most_max_then_frees_on_release_or_timeout(store: &RedisStore, name: &str) {
    let both = Both::new(store);
    let l = limit(2, 1_000);
    let key = format!("{name}:basic");
    let takes = [LeaseTake::new(&key, &l)];
    let a = both
        .acquire(&takes, &format!("{name}-basic-a"), at(0))
        .await
        .unwrap()[0];
    assert!(a.allowed());
    assert_eq!((a.in_flight(), a.remaining()), (1, 1));
    assert_eq!(a.reset_after(), Duration::from_secs(1));
    let b = both
        .acquire(&takes, &format!("{name}-basic-b"), at(300))
        .await
        .unwrap()[0];
    assert_eq!(
        b,
        LeaseDecision::new(true, 2, 2, None, Duration::from_millis(1_000))
    );

    let c = both
        .acquire(&takes, &format!("{name}-basic-c"), at(400))
        .await
        .unwrap()[0];
    assert_eq!(
        c,
        LeaseDecision::new(
            false,
            2,
            2,
            Some(Duration::from_millis(600)),
            Duration::from_millis(900)
        )
    );
    assert_eq!(
        both.in_flight(&takes, at(400)).await[0].in_flight(),
        2,
        "a rejection holds nothing"
    );

    // A lease counts up to its end, not at it; a microsecond matters.
    let just_before = Timestamp::from_nanos(at(1_000).as_nanos() - 1_000);
    let c = format!("{name}-basic-c");
    assert!(!both.acquire(&takes, &c, just_before).await.unwrap()[0].allowed());
    assert!(both.acquire(&takes, &c, at(1_000)).await.unwrap()[0].allowed());
    // Released: the slot is free at once, and the second release says it was not held.
    assert!(both.release(&format!("{name}-basic-b"), at(1_001)).await);
    assert!(!both.release(&format!("{name}-basic-b"), at(1_001)).await);
    assert!(
        both.acquire(&takes, &format!("{name}-basic-d"), at(1_001))
            .await
            .unwrap()[0]
            .allowed()
    );
    assert!(
        !both
            .acquire(&takes, &format!("{name}-basic-e"), at(1_001))
            .await
            .unwrap()[0]
            .allowed()
    );
    // Releasing a lease that timed out changes nothing and says so.
    assert!(!both.release(&format!("{name}-basic-a"), at(1_001)).await);
    // Time going back frees nothing: both leases still count at 500.
    let back = both
        .acquire(&takes, &format!("{name}-basic-f"), at(500))
        .await
        .unwrap()[0];
    assert_eq!(back.retry_after(), Some(Duration::from_millis(1_500)));
}

/// Several keys in one slot (a shared hash tag): all or nothing, a rejection holding nothing on
/// the key that had room.
async fn an_acquire_over_several_keys_holds_all_or_nothing(store: &RedisStore, name: &str) {
    let both = Both::new(store);
    let one = limit(1, 1_000);
    let two = limit(2, 5_000);
    let (user, tenant) = (
        format!("{{{name}}}:all:user"),
        format!("{{{name}}}:all:tenant"),
    );
    let keys = [LeaseTake::new(&user, &two), LeaseTake::new(&tenant, &one)];
    let first = both
        .acquire(&keys, &format!("{name}-all-a"), at(0))
        .await
        .unwrap();
    assert!(first.iter().all(LeaseDecision::allowed));
    let refused = both
        .acquire(&keys, &format!("{name}-all-b"), at(10))
        .await
        .unwrap();
    assert!(refused[0].allowed() && !refused[1].allowed());
    assert_eq!(
        refused[0].in_flight(),
        1,
        "nothing taken on the key with room"
    );
    assert_eq!(refused[1].retry_after(), Some(Duration::from_millis(990)));
    assert_eq!(both.in_flight(&keys[..1], at(10)).await[0].in_flight(), 1);
    assert!(both.release(&format!("{name}-all-a"), at(20)).await);
    assert_eq!(both.in_flight(&keys, at(20)).await[1].in_flight(), 0);
}

/// A soft key is held while it has room and never fails the acquire.
async fn a_soft_key_is_held_when_free_and_never_fails(store: &RedisStore, name: &str) {
    let both = Both::new(store);
    let one = limit(1, 1_000);
    let five = limit(5, 1_000);
    let (user, shadow) = (
        format!("{{{name}}}:soft:user"),
        format!("{{{name}}}:soft:shadow"),
    );
    let keys = [
        LeaseTake::new(&user, &five),
        LeaseTake::new(&shadow, &one).soft(),
    ];
    let first = both
        .acquire(&keys, &format!("{name}-soft-a"), at(0))
        .await
        .unwrap();
    assert!(first[0].allowed() && first[1].allowed());
    let second = both
        .acquire(&keys, &format!("{name}-soft-b"), at(0))
        .await
        .unwrap();
    assert!(second[0].allowed(), "the acquire passes");
    assert!(!second[1].allowed(), "and reports the would-reject");
    assert_eq!(second[1].in_flight(), 1, "without holding past the limit");
    assert_eq!(both.in_flight(&keys[..1], at(0)).await[0].in_flight(), 2);
    assert!(both.release(&format!("{name}-soft-b"), at(1)).await);
    assert_eq!(both.in_flight(&keys, at(1)).await[1].in_flight(), 1);
    // An enforced key full: nothing is held, the soft key included.
    let fresh = format!("{{{name}}}:soft:fresh");
    let full = [
        LeaseTake::new(&shadow, &one),
        LeaseTake::new(&fresh, &one).soft(),
    ];
    assert!(
        !both
            .acquire(&full, &format!("{name}-soft-c"), at(2))
            .await
            .unwrap()[0]
            .allowed()
    );
    assert_eq!(both.in_flight(&full[1..], at(2)).await[0].in_flight(), 0);
    // Every key soft and full: the acquire passes holding nothing, so the lease is not held.
    let only_soft = [LeaseTake::new(&shadow, &one).soft()];
    let held = both
        .acquire(&only_soft, &format!("{name}-soft-d"), at(3))
        .await
        .unwrap();
    assert!(!held[0].allowed());
    assert!(!both.release(&format!("{name}-soft-d"), at(3)).await);
}

/// An id still held is refused, and may be taken again once its lease has ended (the ended
/// lease then goes whole, from keys the new one does not name too).
async fn an_id_is_held_until_its_lease_ends(store: &RedisStore, name: &str) {
    let both = Both::new(store);
    let l = limit(1, 1_000);
    let (k, other) = (format!("{name}:id:k"), format!("{name}:id:other"));
    let k = [LeaseTake::new(&k, &l)];
    let other = [LeaseTake::new(&other, &l)];
    let id = format!("{name}-id-same");
    assert!(both.acquire(&k, &id, at(0)).await.unwrap()[0].allowed());
    assert_eq!(
        both.acquire(&other, &id, at(1)).await,
        Err(Error::LeaseIdInUse)
    );
    assert_eq!(
        both.acquire(&k, &id, at(999)).await,
        Err(Error::LeaseIdInUse)
    );
    assert!(both.acquire(&other, &id, at(1_000)).await.unwrap()[0].allowed());
    // The first lease went with its record: even for a clock gone back, `k` is free.
    assert_eq!(both.in_flight(&k, at(500)).await[0].in_flight(), 0);
    assert!(both.release(&id, at(1_001)).await);
}

/// The memory store's renewal scenario, figure for figure, on two keys of different timeouts
/// (in two slots of a cluster, whose record is in a third): each key's end moves by its own
/// timeout, a key where the lease ended is not revived, a lease ended or released is not
/// renewed, and a renewal at a time gone back never shortens a lease.
async fn a_renewal_moves_each_keys_end_by_its_own_timeout(store: &RedisStore, name: &str) {
    let both = Both::new(store);
    let short = limit(1, 1_000);
    let long = limit(1, 5_000);
    let (short_key, long_key) = (format!("{name}:renew:short"), format!("{name}:renew:long"));
    let keys = [
        LeaseTake::new(&short_key, &short),
        LeaseTake::new(&long_key, &long),
    ];
    let id = |tag: &str| format!("{name}-renew-{tag}");
    assert!(
        both.acquire(&keys, &id("a"), at(0))
            .await
            .unwrap()
            .iter()
            .all(LeaseDecision::allowed)
    );
    // Each key's end moves to now plus its own timeout: 1.8 s and 5.8 s.
    assert_eq!(
        both.renew(&id("a"), at(800)).await,
        Some(Duration::from_millis(5_000))
    );
    let full = both.acquire(&keys, &id("b"), at(1_500)).await.unwrap();
    assert_eq!(full[0].retry_after(), Some(Duration::from_millis(300)));
    assert_eq!(full[1].retry_after(), Some(Duration::from_millis(4_300)));
    // Past the short key's end only the long key is renewed: the short slot stays free.
    assert_eq!(
        both.renew(&id("a"), at(2_000)).await,
        Some(Duration::from_millis(5_000))
    );
    assert_eq!(both.in_flight(&keys, at(2_000)).await[0].in_flight(), 0);
    assert!(both.acquire(&keys[..1], &id("c"), at(2_000)).await.unwrap()[0].allowed());
    // A renewal at a time gone back never shortens: the long key still ends at 7 s.
    assert_eq!(
        both.renew(&id("a"), at(1_000)).await,
        Some(Duration::from_millis(6_000))
    );
    let back = both.in_flight(&keys[1..], at(6_999)).await[0];
    assert_eq!(back.reset_after(), Duration::from_millis(1));
    // Ended everywhere (its end counts as ended), released, or never taken: nothing renewed.
    assert_eq!(both.renew(&id("a"), at(7_000)).await, None);
    assert_eq!(
        both.renew(&id("c"), at(2_500)).await,
        Some(Duration::from_millis(1_000))
    );
    assert!(both.release(&id("c"), at(2_600)).await);
    assert_eq!(both.renew(&id("c"), at(2_600)).await, None);
    assert_eq!(both.renew(&id("nope"), at(0)).await, None);
    // Renewed a microsecond before its end, a lease lives on; at its end, it is over.
    assert!(
        both.acquire(&keys[1..], &id("d"), at(10_000))
            .await
            .unwrap()[0]
            .allowed()
    );
    let before_end = Timestamp::from_nanos(at(15_000).as_nanos() - 1_000);
    assert_eq!(
        both.renew(&id("d"), before_end).await,
        Some(Duration::from_millis(5_000))
    );
    assert_eq!(
        both.renew(&id("d"), at(19_999)).await,
        Some(Duration::from_millis(5_000))
    );
    assert_eq!(both.renew(&id("d"), at(24_999)).await, None);
    // The id taken again on the other key: its record now says that key's timeout.
    assert!(
        both.acquire(&keys[..1], &id("d"), at(30_000))
            .await
            .unwrap()[0]
            .allowed()
    );
    assert_eq!(
        both.renew(&id("d"), at(30_500)).await,
        Some(Duration::from_millis(1_000))
    );
    assert!(both.release(&id("d"), at(30_600)).await);
}

/// Bad requests are refused before any call: here by a store whose Redis does not exist,
/// which would otherwise answer that it is unavailable. And they leave nothing behind.
async fn bad_requests_are_refused_before_any_call() {
    let nowhere = RedisStore::connect(
        &format!("redis://127.0.0.1:{}", free_port()),
        RedisConfig::default(),
    )
    .await
    .expect("a lazy connection");
    let l = limit(1, 1_000);
    let k = LeaseTake::new("k", &l);
    for bad in ["", "a b", "{tag}", "é", &"z".repeat(65)] {
        assert_eq!(
            acquire(&nowhere, &[k], bad, None).await,
            Err(Error::InvalidLeaseId { len: bad.len() }),
            "{bad:?}"
        );
        assert_eq!(
            nowhere.release(bad, None).await,
            Err(Error::InvalidLeaseId { len: bad.len() })
        );
        assert_eq!(
            nowhere.renew(bad, None).await,
            Err(Error::InvalidLeaseId { len: bad.len() })
        );
    }
    assert_eq!(
        acquire(&nowhere, &[], "a", None).await,
        Err(Error::EmptyCheck)
    );
    assert_eq!(
        acquire(&nowhere, &[k, k], "a", None).await,
        Err(Error::DuplicateKey { index: 1 })
    );
    let look = nowhere
        .in_flight(LeaseRequest {
            takes: &[k, k],
            lease_id: "",
            now: None,
        })
        .await;
    assert_eq!(look, Err(Error::DuplicateKey { index: 1 }));
    assert!(matches!(
        acquire(&nowhere, &[k], "a", Some(Timestamp::from_nanos(u64::MAX))).await,
        Err(Error::UnsupportedLimit { .. })
    ));
    assert!(matches!(
        nowhere
            .renew("a", Some(Timestamp::from_nanos(u64::MAX)))
            .await,
        Err(Error::UnsupportedLimit { .. })
    ));
    // A valid request does reach for Redis, and says it is unavailable.
    assert!(matches!(
        acquire(&nowhere, &[k], "a", None).await,
        Err(Error::StoreUnavailable { .. })
    ));
    assert!(matches!(
        nowhere.renew("a", None).await,
        Err(Error::StoreUnavailable { .. })
    ));
}

/// Each scenario, with keys named after `name` so that scenarios sharing a server stay apart.
async fn scenarios(store: &RedisStore, name: &str) {
    holds_at_most_max_then_frees_on_release_or_timeout(store, name).await;
    an_acquire_over_several_keys_holds_all_or_nothing(store, name).await;
    a_soft_key_is_held_when_free_and_never_fails(store, name).await;
    an_id_is_held_until_its_lease_ends(store, name).await;
    a_renewal_moves_each_keys_end_by_its_own_timeout(store, name).await;
}

// ---------------------------------------------------------------------------------------------
// Random traces against the memory store.

/// splitmix64: a trace is its seed, reproducible anywhere.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A random trace of `steps` operations on `keys` (each with its own limit and timeout), with
/// caller times in whole microseconds that mostly go forward and sometimes back, ids that are
/// reused (held, or ended), soft keys, looks, releases and renewals: every answer must be the
/// memory store's.
async fn a_trace_decides_as_memory(store: &RedisStore, seed: u64, keys: &[String], steps: usize) {
    let mut rng = Rng(seed);
    let limits: Vec<LeaseLimit> = keys
        .iter()
        .map(|_| limit(1 + rng.below(3), 100 + rng.below(500)))
        .collect();
    let both = Both::new(store);
    let mut now = T0;
    let ids: Vec<String> = (0..10).map(|i| format!("t{seed}-l{i}")).collect();
    let (mut admitted, mut rejected, mut in_use, mut held_releases) = (0, 0, 0, 0);
    let (mut renewed, mut not_renewed) = (0, 0);
    for _ in 0..steps {
        let time = Timestamp::from_nanos(now);
        match rng.below(14) {
            0..=4 => {
                let mut chosen: Vec<usize> = (0..keys.len()).collect();
                let count = 1 + rng.below(3.min(keys.len() as u64)) as usize;
                for i in 0..count {
                    let j = i + rng.below((chosen.len() - i) as u64) as usize;
                    chosen.swap(i, j);
                }
                let takes: Vec<LeaseTake<'_>> = chosen[..count]
                    .iter()
                    .map(|&k| {
                        let take = LeaseTake::new(&keys[k], &limits[k]);
                        if rng.below(4) == 0 { take.soft() } else { take }
                    })
                    .collect();
                let id = &ids[rng.below(ids.len() as u64) as usize];
                match both.acquire(&takes, id, time).await {
                    Ok(decisions) => {
                        let passed = takes
                            .iter()
                            .zip(&decisions)
                            .all(|(take, d)| d.allowed() || !take.enforce);
                        if passed { admitted += 1 } else { rejected += 1 }
                    }
                    Err(Error::LeaseIdInUse) => in_use += 1,
                    Err(err) => panic!("{err}"),
                }
            }
            5 => {
                let k = rng.below(keys.len() as u64) as usize;
                both.in_flight(&[LeaseTake::new(&keys[k], &limits[k])], time)
                    .await;
            }
            6..=8 => {
                let id = &ids[rng.below(ids.len() as u64) as usize];
                if both.release(id, time).await {
                    held_releases += 1;
                }
            }
            9..=10 => {
                let id = &ids[rng.below(ids.len() as u64) as usize];
                match both.renew(id, time).await {
                    Some(_) => renewed += 1,
                    None => not_renewed += 1,
                }
            }
            11..=12 => now += rng.below(400_000) * 1_000,
            _ => now -= rng.below(300_000) * 1_000,
        }
    }
    // Every kind of answer came up: the trace compared something.
    assert!(
        admitted > 0
            && rejected > 0
            && in_use > 0
            && held_releases > 0
            && renewed > 0
            && not_renewed > 0,
        "seed {seed}: {admitted} admitted, {rejected} rejected, {in_use} in use, \
         {held_releases} releases of held leases, {renewed} renewed, {not_renewed} not"
    );
}

// ---------------------------------------------------------------------------------------------
// Under concurrency, on Redis' own clock.

/// 64 tasks over four connections take leases on one key of `max` 5, hold them a moment and
/// release them. Each counts itself in after its acquire returns and out before it releases,
/// so the count is never above what Redis holds: it must never pass 5. Then the key is empty.
async fn sixty_four_tasks_never_hold_more_than_max(url: &str, key: &str, inspect: &mut Inspector) {
    const MAX: u64 = 5;
    let mut stores = Vec::new();
    for _ in 0..4 {
        stores.push(Arc::new(connect(url).await));
    }
    let l = limit(MAX, 60_000);
    let holding = Arc::new(AtomicU64::new(0));
    let most = Arc::new(AtomicU64::new(0));
    let admitted = Arc::new(AtomicU64::new(0));
    let rejected = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for task in 0..64 {
        let store = Arc::clone(&stores[task % stores.len()]);
        let (holding, most) = (Arc::clone(&holding), Arc::clone(&most));
        let (admitted, rejected) = (Arc::clone(&admitted), Arc::clone(&rejected));
        let key = key.to_owned();
        tasks.push(tokio::spawn(async move {
            let takes = [LeaseTake::new(&key, &l)];
            for round in 0..15 {
                let id = format!("task{task}-{round}");
                let decision = acquire(&*store, &takes, &id, None).await.expect("decided")[0];
                assert!(decision.in_flight() <= MAX, "{decision:?}");
                if !decision.allowed() {
                    assert!(decision.retry_after().is_some());
                    rejected.fetch_add(1, Ordering::Relaxed);
                    tokio::task::yield_now().await;
                    continue;
                }
                admitted.fetch_add(1, Ordering::Relaxed);
                let now_holding = holding.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now_holding, Ordering::SeqCst);
                tokio::task::yield_now().await;
                holding.fetch_sub(1, Ordering::SeqCst);
                assert_eq!(store.release(&id, None).await, Ok(true), "{id}");
            }
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }
    let most = most.load(Ordering::SeqCst);
    assert!(most <= MAX, "{most} leases held at once, of at most {MAX}");
    assert!(most > 1, "the tasks overlapped");
    assert!(admitted.load(Ordering::Relaxed) > 0 && rejected.load(Ordering::Relaxed) > 0);
    let set = format!("tollgate:lease:{key}");
    assert_eq!(
        inspect.integer(&["EXISTS", &set]).await,
        0,
        "every lease released"
    );
    assert_eq!(
        in_flight(&*stores[0], &[LeaseTake::new(key, &l)], None).await[0].in_flight(),
        0
    );
}

/// A key's set expires when its last lease ends (leases of a longer timeout, from another
/// policy, keep it longer); a record when its lease does, and at once on release.
async fn keys_expire_with_their_last_lease(
    store: &RedisStore,
    name: &str,
    inspect: &mut Inspector,
) {
    let (short, long) = (limit(10, 10_000), limit(10, 20_000));
    let key = format!("{name}:ttl");
    let set = format!("tollgate:lease:{key}");
    let record = |id: &str| format!("tollgate:lease-id:{{{id}}}");
    let (a, b, c) = (
        format!("{name}-ttl-a"),
        format!("{name}-ttl-b"),
        format!("{name}-ttl-c"),
    );
    assert!(
        acquire(store, &[LeaseTake::new(&key, &short)], &a, None)
            .await
            .unwrap()[0]
            .allowed()
    );
    let pttl = inspect.integer(&["PTTL", &set]).await;
    assert!((9_000..=10_000).contains(&pttl), "set PTTL {pttl}");
    let pttl = inspect.integer(&["PTTL", &record(&a)]).await;
    assert!((9_000..=10_000).contains(&pttl), "record PTTL {pttl}");
    assert!(
        acquire(store, &[LeaseTake::new(&key, &long)], &b, None)
            .await
            .unwrap()[0]
            .allowed()
    );
    let pttl = inspect.integer(&["PTTL", &set]).await;
    assert!((19_000..=20_000).contains(&pttl), "set PTTL {pttl}");
    // A shorter lease after a longer one keeps the longer end.
    assert!(
        acquire(store, &[LeaseTake::new(&key, &short)], &c, None)
            .await
            .unwrap()[0]
            .allowed()
    );
    let pttl = inspect.integer(&["PTTL", &set]).await;
    assert!((19_000..=20_000).contains(&pttl), "set PTTL {pttl}");
    assert_eq!(store.release(&b, None).await, Ok(true));
    assert_eq!(inspect.integer(&["EXISTS", &record(&b)]).await, 0);
    assert_eq!(inspect.integer(&["ZCARD", &set]).await, 2);
    for id in [&a, &c] {
        assert_eq!(store.release(id, None).await, Ok(true));
    }
    assert_eq!(inspect.integer(&["EXISTS", &set]).await, 0);
    assert_eq!(inspect.integer(&["EXISTS", &record(&a)]).await, 0);
}

/// On Redis' own clock, a renewal moves each set's end to now plus its own timeout, and its
/// TTL and its record's with it. The keys' TTLs are first cut short by hand, standing in for
/// time that passed since the acquire: only the renewal can bring them back to a timeout.
async fn a_renewal_moves_the_keys_ttls_with_the_ends(
    store: &RedisStore,
    name: &str,
    inspect: &mut Inspector,
) {
    let (ten, twenty) = (limit(10, 10_000), limit(10, 20_000));
    let (a, b) = (format!("{name}:rttl:a"), format!("{name}:rttl:b"));
    let (set_a, set_b) = (format!("tollgate:lease:{a}"), format!("tollgate:lease:{b}"));
    let id = format!("{name}-rttl");
    let record = format!("tollgate:lease-id:{{{id}}}");
    let takes = [LeaseTake::new(&a, &ten), LeaseTake::new(&b, &twenty)];
    assert!(
        acquire(store, &takes, &id, None)
            .await
            .unwrap()
            .iter()
            .all(LeaseDecision::allowed)
    );
    for key in [&set_a, &set_b, &record] {
        assert_eq!(inspect.integer(&["PEXPIRE", key, "3000"]).await, 1);
    }
    let until = store.renew(&id, None).await.expect("renewed");
    let until = until.expect("held");
    assert!(
        until > Duration::from_millis(19_000) && until <= Duration::from_secs(20),
        "{until:?}"
    );
    for (set, timeout_ms) in [(&set_a, 10_000), (&set_b, 20_000)] {
        let ends = inspect.score(set, &id).await.expect("held");
        let left_us = ends.saturating_sub(inspect.time_at(set).await);
        assert!(
            left_us > (timeout_ms - 1_000) * 1_000 && left_us <= timeout_ms * 1_000,
            "{set}: ends in {left_us} us"
        );
        let pttl = inspect.integer(&["PTTL", set]).await;
        let pttl = u64::try_from(pttl).expect("an expiry");
        assert!(
            pttl.abs_diff(left_us / 1_000) <= 1_000,
            "{set}: PTTL {pttl} for an end in {left_us} us"
        );
    }
    let pttl = inspect.integer(&["PTTL", &record]).await;
    assert!((19_000..=20_000).contains(&pttl), "record PTTL {pttl}");
    assert_eq!(store.release(&id, None).await, Ok(true));
    for key in [&set_a, &set_b, &record] {
        assert_eq!(inspect.integer(&["EXISTS", key]).await, 0, "{key}");
    }
}

// ---------------------------------------------------------------------------------------------
// Single node.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node_scenarios() {
    let server = RedisServer::start();
    let store = connect(&server.url()).await;
    scenarios(&store, "single").await;
    bad_requests_are_refused_before_any_call().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node_traces_decide_as_memory() {
    let server = RedisServer::start();
    let store = connect(&server.url()).await;
    for seed in 1..=6 {
        let keys: Vec<String> = ["a", "b", "c", "d"]
            .iter()
            .map(|k| format!("trace{seed}:{k}"))
            .collect();
        a_trace_decides_as_memory(&store, seed, &keys, 400).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node_sixty_four_tasks_never_hold_more_than_max() {
    let server = RedisServer::start();
    let mut inspect = Inspector::single(&server).await;
    sixty_four_tasks_never_hold_more_than_max(&server.url(), "hot", &mut inspect).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node_keys_expire_with_their_last_lease() {
    let server = RedisServer::start();
    let store = connect(&server.url()).await;
    let mut inspect = Inspector::single(&server).await;
    keys_expire_with_their_last_lease(&store, "single", &mut inspect).await;
    a_renewal_moves_the_keys_ttls_with_the_ends(&store, "single", &mut inspect).await;
}

/// A record written before records said their sets' timeouts (`END|LEN:SET`) still reads: a
/// renewal keeps its set's end as it is (the timeout is unknown; the lease is still held), an
/// acquire under its id is refused while it is held, and a release frees its set. A timeout
/// that is not a number is a record that is not ours.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_without_timeouts_is_renewed_as_it_stands() {
    let server = RedisServer::start();
    let store = connect(&server.url()).await;
    let mut inspect = Inspector::single(&server).await;
    let set = "tollgate:lease:before";
    let ends = (at(5_000).as_nanos() / 1_000).to_string();
    let old_record = format!("{ends}|{}:{set}", set.len());
    assert_eq!(inspect.integer(&["ZADD", set, &ends, "old"]).await, 1);
    let _: () = inspect
        .query(&["SET", "tollgate:lease-id:{old}", &old_record, "PX", "60000"])
        .await;
    assert_eq!(
        store.renew("old", Some(at(1_000))).await,
        Ok(Some(Duration::from_millis(4_000)))
    );
    assert_eq!(
        inspect.score(set, "old").await,
        Some(at(5_000).as_nanos() / 1_000)
    );
    let l = limit(5, 1_000);
    let takes = [LeaseTake::new("before", &l)];
    assert_eq!(
        acquire(&store, &takes, "old", Some(at(2_000))).await,
        Err(Error::LeaseIdInUse)
    );
    assert_eq!(
        in_flight(&store, &takes, Some(at(2_000))).await[0].in_flight(),
        1
    );
    assert_eq!(store.release("old", Some(at(3_000))).await, Ok(true));
    assert_eq!(inspect.integer(&["EXISTS", set]).await, 0);
    assert_eq!(store.renew("old", Some(at(3_000))).await, Ok(None));

    for timeout in ["ten", "", "-5", "1.5", "86400001"] {
        let bad = format!("{ends}|{}:{set}={timeout};", set.len());
        let _: () = inspect
            .query(&["SET", "tollgate:lease-id:{bad}", &bad, "PX", "60000"])
            .await;
        assert_eq!(
            store.renew("bad", Some(at(1_000))).await,
            Err(Error::StoreUnavailable {
                reason: Unavailable::Script
            }),
            "{bad}"
        );
    }
}

/// The calls of a renewal follow one another: a release, or a new lease under the id, between
/// its first call and the next leaves nothing of its lease to renew. Here the script is called
/// by hand, as the store would, around such a change; the record's end, rewritten across
/// slots, only ever grows, and only while the record names the sets that were renewed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_whose_record_changed_between_its_calls_renews_nothing() {
    let server = RedisServer::start();
    let store = connect(&server.url()).await;
    let mut inspect = Inspector::single(&server).await;
    let script = include_str!("../scripts/lease.lua");
    let (set, record) = ("tollgate:lease:moving", "tollgate:lease-id:{m}");
    let micros = |ms: u64| at(ms).as_nanos() / 1_000;
    let (one, two) = (limit(1, 1_000), limit(1, 2_000));
    assert!(
        acquire(&store, &[LeaseTake::new("moving", &one)], "m", Some(at(0)))
            .await
            .unwrap()[0]
            .allowed()
    );
    let now = micros(100).to_string();
    let holds: Vec<redis::Value> = inspect
        .query(&["EVAL", script, "1", record, "holds", &now, "m"])
        .await;
    assert_eq!(
        holds.len(),
        5,
        "status, now, end, one timeout, one set: {holds:?}"
    );
    assert_eq!(holds[3], redis::Value::Int(1_000));
    // Released and taken again under another timeout before the renewal's next call.
    assert_eq!(store.release("m", Some(at(100))).await, Ok(true));
    assert!(
        acquire(
            &store,
            &[LeaseTake::new("moving", &two)],
            "m",
            Some(at(200))
        )
        .await
        .unwrap()[0]
            .allowed()
    );
    let now = micros(300).to_string();
    let renew: Vec<i64> = inspect
        .query(&[
            "EVAL", script, "2", record, set, "renew", &now, "m", "1", "1000",
        ])
        .await;
    let as_reply = |ms: u64| i64::try_from(micros(ms)).expect("a figure below 2^53");
    assert_eq!(renew, [0, as_reply(300)]);
    assert_eq!(inspect.score(set, "m").await, Some(micros(2_200)));
    // The record as it now is: renewed, the set and the record with it.
    let renew: Vec<i64> = inspect
        .query(&[
            "EVAL", script, "2", record, set, "renew", &now, "m", "1", "2000",
        ])
        .await;
    assert_eq!(renew, [1, as_reply(300), as_reply(2_300)]);
    assert_eq!(inspect.score(set, "m").await, Some(micros(2_300)));
    // Across slots the record's end moves last: never back, and not on a record naming
    // other sets (or the same set under another timeout).
    for (last, timeout, status, ends) in [
        (2_100, "2000", 1, 2_300),
        (3_000, "2000", 1, 3_000),
        (4_000, "1000", 0, 3_000),
    ] {
        let last = micros(last).to_string();
        let reply: Vec<i64> = inspect
            .query(&[
                "EVAL", script, "1", record, "prolong", &now, "m", &last, timeout, set,
            ])
            .await;
        assert_eq!(reply[0], status, "prolong to {last} under {timeout}");
        let stored: String = inspect.query(&["GET", record]).await;
        let expected = format!("{}|{}:{set}=2000;", micros(ends), set.len());
        assert_eq!(stored, expected);
    }
    assert!(inspect.integer(&["PTTL", record]).await >= 59_000);
    // A record that ended renews nothing, even where a set still holds the lease (a node
    // whose clock ran ahead of the record's): the lease is over.
    let ahead = micros(5_000).to_string();
    assert_eq!(inspect.integer(&["ZADD", set, &ahead, "m"]).await, 0);
    let now = micros(3_000).to_string();
    let renew: Vec<i64> = inspect
        .query(&[
            "EVAL", script, "2", record, set, "renew", &now, "m", "1", "2000",
        ])
        .await;
    assert_eq!(renew, [0, as_reply(3_000)]);
    assert_eq!(inspect.score(set, "m").await, Some(micros(5_000)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survives_script_flush_mid_run() {
    let server = RedisServer::start();
    let store = connect(&server.url()).await;
    let both = Both::new(&store);
    let l = limit(3, 1_000);
    let takes = [LeaseTake::new("flushed", &l)];
    let flush = || {
        assert_eq!(
            command(server.port, &["SCRIPT", "FLUSH"]).as_deref(),
            Some("+OK\r\n")
        );
    };
    for i in 0..5 {
        if i == 1 || i == 3 {
            flush();
        }
        let decision = both.acquire(&takes, &format!("f{i}"), at(i)).await.unwrap()[0];
        assert_eq!(decision.allowed(), i < 3, "acquire {i}");
    }
    flush();
    both.in_flight(&takes, at(5)).await;
    flush();
    assert!(both.release("f0", at(6)).await);
    assert!(both.acquire(&takes, "f5", at(7)).await.unwrap()[0].allowed());
}

/// Only a script Redis does not have is sent again as source: another error (here, a user
/// refused the keys the store's prefix names) is answered as it is, not retried as an `EVAL`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_missing_script_is_sent_again() {
    let server = RedisServer::start();
    support::grant_tollgate_user(server.port, support::LEASE_COMMANDS);
    let store = RedisStore::connect(
        &support::as_tollgate_user(&server.url()),
        RedisConfig::default()
            .with_timeout(LOADED)
            .with_prefix("elsewhere:"),
    )
    .await
    .expect("connect");
    let l = limit(3, 1_000);
    let refused = acquire(&store, &[LeaseTake::new("k", &l)], "refused", None).await;
    assert!(
        matches!(refused, Err(Error::StoreUnavailable { .. })),
        "{refused:?}"
    );
    support::assert_refused_once_and_not_sent_again(server.port);
}

/// A key holding something that is not a set of leases fails its own acquires as a script
/// error, which is Redis answering: not a rejection, and nothing written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_that_is_not_a_set_fails_as_a_script_error() {
    let server = RedisServer::start();
    let store = connect(&server.url()).await;
    assert_eq!(
        command(server.port, &["SET", "tollgate:lease:taken", "x"]).as_deref(),
        Some("+OK\r\n")
    );
    let l = limit(3, 1_000);
    let takes = [LeaseTake::new("fine", &l), LeaseTake::new("taken", &l)];
    assert_eq!(
        acquire(&store, &takes, "w", None).await,
        Err(Error::StoreUnavailable {
            reason: Unavailable::Script
        })
    );
    assert_eq!(in_flight(&store, &takes[..1], None).await[0].in_flight(), 0);
    let look = LeaseRequest {
        takes: &takes,
        lease_id: "",
        now: None,
    };
    let script_error = || Error::StoreUnavailable {
        reason: Unavailable::Script,
    };
    assert_eq!(store.in_flight(look).await, Err(script_error()));
    // A record that is not one: its release and renewal fail alike.
    assert_eq!(
        command(server.port, &["SET", "tollgate:lease-id:{junk}", "x"]).as_deref(),
        Some("+OK\r\n")
    );
    assert_eq!(store.release("junk", None).await, Err(script_error()));
    assert_eq!(store.renew("junk", None).await, Err(script_error()));
    // A set that turned into something else under a lease fails its renewal.
    let turned = [LeaseTake::new("turned", &l)];
    assert!(acquire(&store, &turned, "turned", None).await.unwrap()[0].allowed());
    assert_eq!(
        command(server.port, &["SET", "tollgate:lease:turned", "x"]).as_deref(),
        Some("+OK\r\n")
    );
    assert_eq!(store.renew("turned", None).await, Err(script_error()));
    assert_eq!(
        command(server.port, &["EXISTS", "tollgate:lease-id:{w}"]).as_deref(),
        Some(":0\r\n")
    );
}

/// Script calls the servers on `ports` have run so far (`EVALSHA`, and `EVAL` when a script
/// had to be sent as source).
fn script_calls(ports: &[u16]) -> f64 {
    ports
        .iter()
        .map(|&port| {
            let stats = command(port, &["INFO", "commandstats"]).unwrap_or_default();
            info_field(&stats, "cmdstat_evalsha:", "calls")
                + info_field(&stats, "cmdstat_eval:", "calls")
        })
        .sum()
}

/// On a single node a lease's record shares its sets' node, so an acquire, or a renewal's
/// move, is one call, whatever slots a cluster would put them in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_node_acquires_and_renews_in_one_call_each() {
    let server = RedisServer::start();
    let store = connect(&server.url()).await;
    let l = limit(1, 1_000);
    let (a, b) = ("one:a", "one:b");
    assert_ne!(
        Slot::for_key(format!("tollgate:lease:{a}")),
        Slot::for_key(format!("tollgate:lease:{b}")),
    );
    let takes = [LeaseTake::new(a, &l), LeaseTake::new(b, &l)];
    assert!(acquire(&store, &takes, "warm", Some(at(0))).await.unwrap()[0].allowed());
    let before = script_calls(&[server.port]);
    assert!(!acquire(&store, &takes, "one", Some(at(1))).await.unwrap()[0].allowed());
    assert!(store.release("warm", Some(at(2))).await.unwrap());
    assert!(acquire(&store, &takes, "one", Some(at(3))).await.unwrap()[0].allowed());
    // Two acquires of one call each, and a release of two (the record, then the sets).
    assert_eq!(script_calls(&[server.port]) - before, 4.0);
    // A renewal: the record read, then the sets and the record moved together.
    let before = script_calls(&[server.port]);
    assert_eq!(
        store.renew("one", Some(at(4))).await,
        Ok(Some(Duration::from_secs(1)))
    );
    assert_eq!(script_calls(&[server.port]) - before, 2.0);
}

/// A release that lands between a renewal's two calls (the record read, then the sets moved)
/// leaves that renewal nothing to renew: it says so, not a failure. Started together on one
/// connection, the two calls of each go out in that order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_between_a_renewals_calls_leaves_it_nothing() {
    let server = RedisServer::start();
    let store = connect(&server.url()).await;
    let l = limit(100, 1_000);
    let takes = [LeaseTake::new("raced", &l)];
    let mut raced = 0;
    for i in 0..20 {
        let id = format!("raced-{i}");
        assert!(acquire(&store, &takes, &id, Some(at(0))).await.unwrap()[0].allowed());
        let (renewed, released) = tokio::join!(
            store.renew(&id, Some(at(1))),
            store.release(&id, Some(at(1)))
        );
        assert_eq!(released, Ok(true));
        match renewed {
            Ok(None) => raced += 1,
            Ok(Some(_)) => {}
            other => panic!("renewal {i}: {other:?}"),
        }
    }
    assert!(raced > 0, "no release came between a renewal's calls");
}

/// A caller's time between two microseconds: the lease ends at the next whole microsecond past
/// its timeout, so it is held a fraction of a microsecond longer than in the memory store,
/// never shorter, and the figures say so exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_time_between_two_microseconds_holds_a_little_longer_never_shorter() {
    let server = RedisServer::start();
    let store = connect(&server.url()).await;
    let l = limit(1, 1_000);
    let takes = [LeaseTake::new("nanos", &l)];
    let t = |nanos: u64| Some(Timestamp::from_nanos(T0 + nanos));
    let first = acquire(&store, &takes, "n1", t(500)).await.unwrap()[0];
    assert_eq!(
        first.reset_after(),
        Duration::from_secs(1) + Duration::from_nanos(500)
    );
    // The memory store frees the slot at 1 s + 500 ns; here it is held to the microsecond.
    let at_end = acquire(&store, &takes, "n2", t(1_000_000_500))
        .await
        .unwrap()[0];
    assert!(!at_end.allowed());
    assert_eq!(at_end.retry_after(), Some(Duration::from_nanos(500)));
    assert!(
        acquire(&store, &takes, "n2", t(1_000_001_000))
            .await
            .unwrap()[0]
            .allowed()
    );
}

/// A lease still on a set whose record is gone (a release between its two calls, which
/// deletes the record first) is still held: an acquire under its id is refused rather than
/// counted as the same member.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_id_still_on_a_set_is_held_without_its_record() {
    let server = RedisServer::start();
    let store = connect(&server.url()).await;
    let l = limit(2, 1_000);
    let takes = [LeaseTake::new("orphan", &l)];
    assert!(acquire(&store, &takes, "o", Some(at(0))).await.unwrap()[0].allowed());
    assert_eq!(
        command(server.port, &["DEL", "tollgate:lease-id:{o}"]).as_deref(),
        Some(":1\r\n")
    );
    assert_eq!(
        acquire(&store, &takes, "o", Some(at(1))).await,
        Err(Error::LeaseIdInUse)
    );
    assert_eq!(
        in_flight(&store, &takes, Some(at(1))).await[0].in_flight(),
        1
    );
    // Ended, it may be taken again.
    assert!(acquire(&store, &takes, "o", Some(at(1_000))).await.unwrap()[0].allowed());
}

/// The least a Redis user needs for leases: the commands buckets need (the README's) and
/// those of `support::LEASE_COMMANDS`, on the same `~tollgate:*` keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_least_privilege_user_with_the_lease_commands_suffices() {
    let server = RedisServer::start();
    support::grant_tollgate_user(server.port, support::LEASE_COMMANDS);
    let store = connect(&support::as_tollgate_user(&server.url())).await;
    let both = Both::new(&store);
    let l = limit(1, 1_000);
    let takes = [
        LeaseTake::new("acl:a", &l),
        LeaseTake::new("acl:b", &l).soft(),
    ];
    assert!(both.acquire(&takes, "acl-1", at(0)).await.unwrap()[0].allowed());
    assert!(!both.acquire(&takes, "acl-2", at(1)).await.unwrap()[0].allowed());
    both.in_flight(&takes, at(2)).await;
    assert_eq!(
        both.renew("acl-1", at(2)).await,
        Some(Duration::from_millis(1_000))
    );
    assert!(both.release("acl-1", at(3)).await);
    // A stale record's sets are cleaned up by a second call, under the same rights.
    assert!(both.acquire(&takes[..1], "acl-1", at(4)).await.unwrap()[0].allowed());
    assert!(both.acquire(&takes[1..], "acl-3", at(5)).await.unwrap()[0].allowed());
    assert!(both.acquire(&takes[1..], "acl-1", at(2_000)).await.unwrap()[0].allowed());
    // And on Redis' own clock.
    let clock = [LeaseTake::new("acl:clock", &l)];
    assert!(acquire(&store, &clock, "acl-4", None).await.unwrap()[0].allowed());
    assert!(matches!(store.renew("acl-4", None).await, Ok(Some(_))));
    assert_eq!(store.release("acl-4", None).await, Ok(true));
}

// ---------------------------------------------------------------------------------------------
// Cluster: one for every test of this binary, as starting one takes seconds.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster() {
    let cluster = RedisCluster::start();
    let url = cluster.url();
    let store = connect(&url).await;
    assert!(store.is_cluster());
    let mut inspect = Inspector::cluster(&cluster).await;

    scenarios(&store, "cluster").await;
    cluster_traces_decide_as_memory(&store).await;
    a_cross_slot_rejection_holds_nothing_on_the_other_slot(&store, &mut inspect).await;
    a_cross_slot_acquire_with_a_full_soft_key_records_only_what_it_holds(&store, &mut inspect)
        .await;
    an_id_held_in_another_slot_is_refused_across_slots(&store, &mut inspect).await;
    a_lease_whose_keys_share_its_records_slot_is_one_call(&store).await;
    let ports: Vec<u16> = cluster.nodes.iter().map(|node| node.port).collect();
    an_acquire_takes_one_call_per_slot_and_the_claim(&store, &ports, &mut inspect).await;
    unreadable_keys_fail_across_slots(&store, &mut inspect).await;
    an_id_found_on_one_slot_is_left_there_when_the_others_give_back(&store, &mut inspect).await;
    a_lease_over_several_slots_is_renewed_on_all_of_them(&store, &mut inspect).await;
    keys_expire_with_their_last_lease(&store, "cluster", &mut inspect).await;
    a_renewal_moves_the_keys_ttls_with_the_ends(&store, "cluster", &mut inspect).await;
    sixty_four_tasks_never_hold_more_than_max(&url, "{hot}:leases", &mut inspect).await;
}

async fn cluster_traces_decide_as_memory(store: &RedisStore) {
    for seed in 1..=6 {
        // Two keys hashed whole (slots of their own), two sharing a hash tag: acquires within
        // one slot, across two or three, with the record in a slot of its own.
        let keys: Vec<String> = [
            format!("ct{seed}:a"),
            format!("ct{seed}:b"),
            format!("{{ct{seed}}}:c"),
            format!("{{ct{seed}}}:d"),
        ]
        .into();
        let slots: HashSet<Slot> = keys
            .iter()
            .map(|key| Slot::for_key(format!("tollgate:lease:{key}")))
            .collect();
        assert!(slots.len() >= 2, "seed {seed}: keys in one slot");
        a_trace_decides_as_memory(store, 100 + seed, &keys, 400).await;
    }
}

/// Two keys in different slots; the one with no room rejects, so the other, which took the
/// lease in its own call, gives it back: nothing is held anywhere, and no record is left.
async fn a_cross_slot_rejection_holds_nothing_on_the_other_slot(
    store: &RedisStore,
    inspect: &mut Inspector,
) {
    let (roomy, tight) = (limit(5, 60_000), limit(1, 60_000));
    let (user, tenant) = ("xs:user:alice", "xs:tenant:acme");
    assert_ne!(
        Slot::for_key(format!("tollgate:lease:{user}")),
        Slot::for_key(format!("tollgate:lease:{tenant}")),
        "the keys must live in different slots for this test"
    );
    let both = Both::new(store);
    let tenant_only = [LeaseTake::new(tenant, &tight)];
    assert!(both.acquire(&tenant_only, "xs-first", at(0)).await.unwrap()[0].allowed());
    let takes = [LeaseTake::new(user, &roomy), LeaseTake::new(tenant, &tight)];
    for attempt in 0..3 {
        let id = format!("xs-{attempt}");
        let refused = both.acquire(&takes, &id, at(1)).await.unwrap();
        assert!(refused[0].allowed() && !refused[1].allowed());
        assert_eq!(refused[0].in_flight(), 0, "the user's key, as it stood");
        assert_eq!(
            inspect
                .integer(&["EXISTS", &format!("tollgate:lease:{user}")])
                .await,
            0,
            "given back"
        );
        assert_eq!(
            inspect
                .integer(&["EXISTS", &format!("tollgate:lease-id:{{{id}}}")])
                .await,
            0,
            "the claim went"
        );
        assert!(!both.release(&id, at(2)).await);
    }
    assert!(both.release("xs-first", at(2)).await);
    assert!(
        both.acquire(&takes, "xs-last", at(3))
            .await
            .unwrap()
            .iter()
            .all(LeaseDecision::allowed)
    );
    assert!(both.release("xs-last", at(4)).await);
}

/// Across slots, a soft key that was full does not hold the lease: the record names only the
/// keys that do, and ends with them, so a release after their end says the lease had ended.
async fn a_cross_slot_acquire_with_a_full_soft_key_records_only_what_it_holds(
    store: &RedisStore,
    inspect: &mut Inspector,
) {
    let (short, long) = (limit(5, 1_000), limit(1, 9_000));
    let (user, shadow) = ("soft:user:bob", "soft:shadow:bob");
    assert_ne!(
        Slot::for_key(format!("tollgate:lease:{user}")),
        Slot::for_key(format!("tollgate:lease:{shadow}")),
    );
    let both = Both::new(store);
    assert!(
        both.acquire(&[LeaseTake::new(shadow, &long)], "soft-a", at(0))
            .await
            .unwrap()[0]
            .allowed()
    );
    let takes = [
        LeaseTake::new(user, &short),
        LeaseTake::new(shadow, &long).soft(),
    ];
    let decisions = both.acquire(&takes, "soft-b", at(0)).await.unwrap();
    assert!(decisions[0].allowed() && !decisions[1].allowed());
    let pttl = inspect
        .integer(&["PTTL", "tollgate:lease-id:{soft-b}"])
        .await;
    assert!(
        pttl >= 59_000,
        "caller's time: at least a minute, not {pttl}"
    );
    // Held on the user's key only, until 1 s: at 2 s the lease has ended.
    assert!(!both.release("soft-b", at(2_000)).await);
    assert!(!both.release("soft-a", at(9_000)).await);
}

/// An id held on keys of one slot is refused by an acquire of keys in others: the claim finds
/// its record first, and nothing is taken.
async fn an_id_held_in_another_slot_is_refused_across_slots(
    store: &RedisStore,
    inspect: &mut Inspector,
) {
    let l = limit(3, 5_000);
    let both = Both::new(store);
    assert!(
        both.acquire(&[LeaseTake::new("dup:one", &l)], "dup", at(0))
            .await
            .unwrap()[0]
            .allowed()
    );
    let takes = [
        LeaseTake::new("dup:two", &l),
        LeaseTake::new("dup:three", &l),
    ];
    assert_eq!(
        both.acquire(&takes, "dup", at(1)).await,
        Err(Error::LeaseIdInUse)
    );
    for key in ["dup:two", "dup:three"] {
        assert_eq!(
            inspect
                .integer(&["EXISTS", &format!("tollgate:lease:{key}")])
                .await,
            0
        );
    }
    assert!(both.release("dup", at(2)).await);
    assert!(
        both.acquire(&takes, "dup", at(3))
            .await
            .unwrap()
            .iter()
            .all(LeaseDecision::allowed)
    );
    assert!(both.release("dup", at(4)).await);
    for key in ["dup:two", "dup:three"] {
        assert_eq!(
            inspect
                .integer(&["EXISTS", &format!("tollgate:lease:{key}")])
                .await,
            0
        );
    }
}

/// Keys whose hash tag is the lease id share its record's slot: decided, and recorded, in one
/// call, as on a single node.
/// An acquire over two slots, its record in a third, is three calls: the claim, then one per
/// slot; the record is rewritten only when a soft key was full. One whose keys share the
/// record's slot is one call.
async fn an_acquire_takes_one_call_per_slot_and_the_claim(
    store: &RedisStore,
    ports: &[u16],
    inspect: &mut Inspector,
) {
    let l = limit(2, 1_000);
    let (a, b) = ("calls:a", "calls:b");
    let slots = [
        Slot::for_key(format!("tollgate:lease:{a}")),
        Slot::for_key(format!("tollgate:lease:{b}")),
        Slot::for_key("tollgate:lease-id:{calls}"),
    ];
    assert!(slots[0] != slots[1] && slots[1] != slots[2] && slots[0] != slots[2]);
    let takes = [LeaseTake::new(a, &l), LeaseTake::new(b, &l)];
    // Every node has the script by now.
    assert!(
        acquire(store, &takes, "calls-warm", Some(at(0)))
            .await
            .unwrap()[0]
            .allowed()
    );
    let before = script_calls(ports);
    assert!(acquire(store, &takes, "calls", Some(at(1))).await.unwrap()[0].allowed());
    assert_eq!(script_calls(ports) - before, 3.0);
    // A renewal whose sets are gone (deleted by hand) moves nothing: the record read, then
    // one call per slot, and no record to move.
    for key in [a, b] {
        let _: () = inspect
            .query(&["DEL", &format!("tollgate:lease:{key}")])
            .await;
    }
    let before = script_calls(ports);
    assert_eq!(store.renew("calls", Some(at(2))).await, Ok(None));
    assert_eq!(script_calls(ports) - before, 3.0);
    let shared = [LeaseTake::new("calls:{calls-one}", &l)];
    let before = script_calls(ports);
    assert!(
        acquire(store, &shared, "calls-one", Some(at(1)))
            .await
            .unwrap()[0]
            .allowed()
    );
    assert_eq!(script_calls(ports) - before, 1.0);
}

/// A set or a record holding something else fails an acquire across slots, and a look, as a
/// script error: not a rejection, not a protocol failure.
async fn unreadable_keys_fail_across_slots(store: &RedisStore, inspect: &mut Inspector) {
    let l = limit(2, 1_000);
    let script_error = Err(Error::StoreUnavailable {
        reason: Unavailable::Script,
    });
    let (fine, bad) = ("unreadable:fine", "unreadable:bad");
    assert_ne!(
        Slot::for_key(format!("tollgate:lease:{fine}")),
        Slot::for_key(format!("tollgate:lease:{bad}")),
    );
    let bad_set = format!("tollgate:lease:{bad}");
    let _: () = inspect.query(&["SET", &bad_set, "x"]).await;
    let takes = [LeaseTake::new(fine, &l), LeaseTake::new(bad, &l)];
    assert_eq!(
        acquire(store, &takes, "unreadable", Some(at(0))).await,
        script_error
    );
    // A record of another type, in a slot of its own.
    assert_ne!(
        Slot::for_key(format!("tollgate:lease:{fine}")),
        Slot::for_key("tollgate:lease-id:{bad-record}"),
    );
    let _: () = inspect
        .query(&["SET", "tollgate:lease-id:{bad-record}", "x"])
        .await;
    assert_eq!(
        acquire(store, &takes[..1], "bad-record", Some(at(0))).await,
        script_error
    );
    assert_eq!(
        in_flight(store, &takes[..1], Some(at(0))).await[0].in_flight(),
        0
    );
    let _: () = inspect
        .query(&["DEL", &bad_set, "tollgate:lease-id:{bad-record}"])
        .await;
    // A set that turned into something else under a lease fails its renewal.
    assert!(
        acquire(store, &takes, "turned", Some(at(0)))
            .await
            .unwrap()
            .iter()
            .all(LeaseDecision::allowed)
    );
    let _: () = inspect.query(&["SET", &bad_set, "x"]).await;
    assert_eq!(
        store.renew("turned", Some(at(1))).await,
        Err(Error::StoreUnavailable {
            reason: Unavailable::Script
        })
    );
    let _: () = inspect.query(&["DEL", &bad_set]).await;
}

/// A set that still holds an id whose record is gone refuses it across slots, and keeps it:
/// only the slots that took give the lease back.
async fn an_id_found_on_one_slot_is_left_there_when_the_others_give_back(
    store: &RedisStore,
    inspect: &mut Inspector,
) {
    let l = limit(2, 60_000);
    let (held, other) = ("orphan:held", "orphan:other");
    assert_ne!(
        Slot::for_key(format!("tollgate:lease:{held}")),
        Slot::for_key(format!("tollgate:lease:{other}")),
    );
    let first = [LeaseTake::new(held, &l)];
    assert!(acquire(store, &first, "orphan", Some(at(0))).await.unwrap()[0].allowed());
    assert_eq!(
        inspect
            .integer(&["DEL", "tollgate:lease-id:{orphan}"])
            .await,
        1
    );
    let takes = [LeaseTake::new(held, &l), LeaseTake::new(other, &l)];
    assert_eq!(
        acquire(store, &takes, "orphan", Some(at(1))).await,
        Err(Error::LeaseIdInUse)
    );
    let held_set = format!("tollgate:lease:{held}");
    assert_eq!(
        inspect.score(&held_set, "orphan").await,
        Some(at(60_000).as_nanos() / 1_000)
    );
    let other_set = format!("tollgate:lease:{other}");
    assert_eq!(inspect.score(&other_set, "orphan").await, None);
}

async fn a_lease_whose_keys_share_its_records_slot_is_one_call(store: &RedisStore) {
    let l = limit(1, 1_000);
    let (k1, k2) = ("job:{same}:a", "job:{same}:b");
    assert_eq!(
        Slot::for_key(format!("tollgate:lease:{k1}")),
        Slot::for_key("tollgate:lease-id:{same}")
    );
    let both = Both::new(store);
    let takes = [LeaseTake::new(k1, &l), LeaseTake::new(k2, &l)];
    assert!(
        both.acquire(&takes, "same", at(0))
            .await
            .unwrap()
            .iter()
            .all(LeaseDecision::allowed)
    );
    assert_eq!(
        both.acquire(&takes, "same", at(1)).await,
        Err(Error::LeaseIdInUse)
    );
    assert!(!both.acquire(&takes, "other", at(1)).await.unwrap()[0].allowed());
    // Renewed in one call too, the record with its sets.
    assert_eq!(
        both.renew("same", at(500)).await,
        Some(Duration::from_millis(1_000))
    );
    assert!(!both.acquire(&takes, "other", at(1_000)).await.unwrap()[0].allowed());
    assert!(both.release("same", at(1_200)).await);
    assert!(both.acquire(&takes, "other", at(1_300)).await.unwrap()[0].allowed());
    assert_eq!(both.renew("same", at(1_300)).await, None);
}

/// A lease over three keys in three slots, its record in a fourth, each key with its own
/// timeout: a renewal moves each set's end by that key's timeout, in each slot, leaves the
/// key where the lease had ended as it is, and moves the record's end to the last of them.
async fn a_lease_over_several_slots_is_renewed_on_all_of_them(
    store: &RedisStore,
    inspect: &mut Inspector,
) {
    let limits = [limit(1, 1_000), limit(1, 2_000), limit(1, 3_000)];
    let keys = ["spread:one", "spread:two", "spread:three"];
    let sets = keys.map(|key| format!("tollgate:lease:{key}"));
    let slots: HashSet<Slot> = sets
        .iter()
        .map(Slot::for_key)
        .chain([Slot::for_key("tollgate:lease-id:{spread}")])
        .collect();
    assert_eq!(
        slots.len(),
        4,
        "the keys and the record must be in four slots"
    );
    let takes: Vec<LeaseTake<'_>> = keys
        .iter()
        .zip(&limits)
        .map(|(key, limit)| LeaseTake::new(key, limit))
        .collect();
    let both = Both::new(store);
    let micros = |ms: u64| at(ms).as_nanos() / 1_000;
    assert!(
        both.acquire(&takes, "spread", at(0))
            .await
            .unwrap()
            .iter()
            .all(LeaseDecision::allowed)
    );
    assert_eq!(
        both.renew("spread", at(500)).await,
        Some(Duration::from_millis(3_000))
    );
    for (set, ends) in sets.iter().zip([1_500, 2_500, 3_500]) {
        assert_eq!(
            inspect.score(set, "spread").await,
            Some(micros(ends)),
            "{set}"
        );
    }
    let looked = both.in_flight(&takes, at(1_400)).await;
    assert_eq!(looked[0].reset_after(), Duration::from_millis(100));
    // The first key's lease ended at 1.5 s: not revived, its score left as it was.
    assert_eq!(
        both.renew("spread", at(1_600)).await,
        Some(Duration::from_millis(3_000))
    );
    for (set, ends) in sets.iter().zip([1_500, 3_600, 4_600]) {
        assert_eq!(
            inspect.score(set, "spread").await,
            Some(micros(ends)),
            "{set}"
        );
    }
    assert!(
        both.acquire(&takes[..1], "spread-other", at(1_600))
            .await
            .unwrap()[0]
            .allowed()
    );
    // The record ends with the last key: ended at it, held a moment before.
    assert_eq!(both.renew("spread", at(4_600)).await, None);
    assert!(both.release("spread", at(4_599)).await);
    assert!(!both.release("spread-other", at(4_600)).await);
}
