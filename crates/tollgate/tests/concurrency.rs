//! Many threads on few keys: the store must never admit more than the bucket math allows.
//!
//! These are correctness tests, not benchmarks: they count admissions, never time them.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::Duration;

use tollgate::{Clock, Item, Limit, ManualClock, MemoryStore, RateLimiter, Timestamp};

const THREADS: usize = 8;

/// Moves `clock` forward `steps` times by 100 µs, each after at least a few more checks, so
/// time and checks interleave (and a bucket never sits full while time passes, which would
/// waste refill); then says it is `done`.
fn move_time(clock: &ManualClock, steps: usize, attempts: &AtomicU64, done: &AtomicBool) {
    for _ in 0..steps {
        let seen = attempts.load(Ordering::Relaxed);
        while attempts.load(Ordering::Relaxed) < seen + 4 {
            thread::yield_now();
        }
        clock.advance(Duration::from_micros(100));
    }
    done.store(true, Ordering::Release);
}

#[test]
fn frozen_time_admits_exactly_the_capacity() {
    for capacity in [1, 7, 1_000] {
        let limit = Limit::new(capacity, "1/s".parse().unwrap()).unwrap();
        let limiter = Arc::new(RateLimiter::new(limit, ManualClock::new()));
        let admitted = AtomicU64::new(0);
        thread::scope(|scope| {
            for _ in 0..THREADS {
                scope.spawn(|| {
                    for _ in 0..capacity * 2 {
                        if limiter.check("hot").unwrap().allowed() {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(admitted.into_inner(), capacity);
    }
}

#[test]
fn moving_time_admits_at_most_capacity_plus_refill() {
    // One thread moves time forward in small steps while the others hammer one key with
    // mixed costs. The total admitted can never exceed capacity + rate * elapsed.
    let limit = Limit::new(50, "1000/s".parse().unwrap()).unwrap();
    let clock = ManualClock::new();
    let limiter = RateLimiter::new(limit, clock.clone());
    let admitted = AtomicU64::new(0);
    let attempts = AtomicU64::new(0);
    let done = AtomicBool::new(false);
    thread::scope(|scope| {
        scope.spawn(|| move_time(&clock, 2_000, &attempts, &done));
        for t in 0..THREADS as u64 {
            let (limiter, admitted, attempts, done) = (&limiter, &admitted, &attempts, &done);
            scope.spawn(move || {
                let mut i = t;
                while !done.load(Ordering::Acquire) {
                    let cost = 1 + i % 3;
                    if limiter.check_n("hot", cost).unwrap().allowed() {
                        admitted.fetch_add(cost, Ordering::Relaxed);
                    }
                    attempts.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
            });
        }
    });
    let elapsed_ms = clock.now().as_nanos() / 1_000_000;
    let bound = 50 + elapsed_ms; // 1000/s = one per millisecond
    let admitted = admitted.into_inner();
    assert!(admitted <= bound, "admitted {admitted} > bound {bound}");
    // And the limiter was not simply rejecting everything.
    assert!(admitted > bound / 2, "admitted only {admitted} of {bound}");
}

/// A sliding log hammered from many threads while time moves: in every window of its length,
/// what it admitted fits its limit. Each admission's millisecond is read back from its decision
/// (its entry counts longest, so the reset names it), which is where the log counted it.
#[test]
fn a_sliding_log_never_admits_past_its_limit_in_any_window() {
    const N: u64 = 20;
    const W_MS: u64 = 5;
    let limit = Limit::sliding_log(N, Duration::from_millis(W_MS)).unwrap();
    let store: MemoryStore<u64> = MemoryStore::default();
    let clock = ManualClock::new();
    let attempts = AtomicU64::new(0);
    let done = AtomicBool::new(false);
    let admitted = std::sync::Mutex::new(Vec::new());
    thread::scope(|scope| {
        scope.spawn(|| move_time(&clock, 1_000, &attempts, &done));
        for t in 0..THREADS as u64 {
            let (store, clock, attempts, done, admitted) =
                (&store, &clock, &attempts, &done, &admitted);
            scope.spawn(move || {
                let mut mine = Vec::new();
                let mut i = t;
                while !done.load(Ordering::Acquire) {
                    let cost = 1 + i % 3;
                    let now = clock.now();
                    let decision = store.check(&7, &limit, cost, now).unwrap();
                    if decision.allowed() {
                        let ends = now.as_nanos() + decision.reset_after().as_nanos() as u64;
                        mine.push((ends / 1_000_000 - W_MS, cost));
                    }
                    attempts.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
                admitted.lock().unwrap().extend(mine);
            });
        }
    });
    let admitted = admitted.into_inner().unwrap();
    let total: u64 = admitted.iter().map(|&(_, cost)| cost).sum();
    for &(end, _) in &admitted {
        let in_window: u64 = admitted
            .iter()
            .filter(|&&(ms, _)| ms <= end && ms + W_MS > end)
            .map(|&(_, cost)| cost)
            .sum();
        assert!(
            in_window <= N,
            "{in_window} admitted in the window ending at {end} ms"
        );
    }
    // 100 ms passed: the log admitted about N per window, not nothing.
    assert!(total > 100 / W_MS * N / 2, "admitted only {total}");
}

#[test]
fn multi_key_checks_in_opposite_orders_neither_deadlock_nor_over_admit() {
    // Two keys in every shard order, checked together and alone by many threads.
    let limit = Limit::new(100, "1/s".parse().unwrap()).unwrap();
    let store: Arc<MemoryStore<Box<str>>> = Arc::new(MemoryStore::builder().shards(4).build());
    let now = Timestamp::ZERO;
    let per_key = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];
    let names = ["a", "b", "c"];
    thread::scope(|scope| {
        for t in 0..THREADS {
            let (store, per_key) = (&store, &per_key);
            scope.spawn(move || {
                for i in 0..300 {
                    let (x, y) = match (t + i) % 3 {
                        0 => (0, 1),
                        1 => (1, 2),
                        _ => (2, 0),
                    };
                    let (x, y) = if t % 2 == 0 { (x, y) } else { (y, x) };
                    let items = [
                        Item {
                            key: names[x],
                            limit: &limit,
                            cost: 1,
                        },
                        Item {
                            key: names[y],
                            limit: &limit,
                            cost: 2,
                        },
                    ];
                    let decisions = store.check_all(&items, now, None).unwrap();
                    if decisions.iter().all(|d| d.allowed()) {
                        per_key[x].fetch_add(1, Ordering::Relaxed);
                        per_key[y].fetch_add(2, Ordering::Relaxed);
                    }
                    if i % 5 == 0 && store.check(names[x], &limit, 1, now).unwrap().allowed() {
                        per_key[x].fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    for (name, admitted) in names.iter().zip(&per_key) {
        let admitted = admitted.load(Ordering::Relaxed);
        assert!(admitted <= 100, "{name}: {admitted}");
        // Every token is accounted for: what was admitted is exactly what is gone.
        let left = 100 - admitted;
        assert!(left == 0 || store.peek(*name, &limit, left, now).unwrap().allowed());
        assert!(!store.peek(*name, &limit, left + 1, now).unwrap().allowed());
    }
}

#[test]
fn idempotent_retries_racing_are_charged_once() {
    let limit = Limit::new(1_000, "1/s".parse().unwrap()).unwrap();
    let store: MemoryStore<Box<str>> = MemoryStore::default();
    let now = Timestamp::ZERO;
    thread::scope(|scope| {
        for _ in 0..THREADS {
            scope.spawn(|| {
                for request in 0..200 {
                    let id = format!("req-{request}");
                    let decision = store.check_idempotent("k", &limit, 3, now, &id).unwrap();
                    assert!(decision.allowed());
                }
            });
        }
    });
    // 200 distinct requests of cost 3, each retried by 8 threads: charged 600, not 4_800.
    assert!(store.peek("k", &limit, 400, now).unwrap().allowed());
    assert!(!store.peek("k", &limit, 401, now).unwrap().allowed());
}

/// Threads giving tokens back race threads taking them, on one drained key with time frozen:
/// what is admitted, plus what the bucket holds at the end, is at most its capacity plus what
/// was given back (a return to a full bucket is lost, never banked), and at least twice the
/// capacity (a return is lost only to a full bucket, which a hundred returns made so), for a
/// token bucket, a window and a log alike.
#[test]
fn tokens_given_back_racing_checks_admit_no_more_than_was_returned() {
    let limits = [
        Limit::new(100, "1/h".parse().unwrap()).unwrap(),
        Limit::fixed_window(100, Duration::from_secs(3_600)).unwrap(),
        Limit::sliding_log(100, Duration::from_secs(3_600)).unwrap(),
    ];
    for limit in &limits {
        let store: MemoryStore<Box<str>> = MemoryStore::default();
        let now = Timestamp::from_nanos(1_000_000_000);
        assert!(store.check("hot", limit, 100, now).unwrap().allowed());
        let (admitted, returned) = (AtomicU64::new(100), AtomicU64::new(0));
        thread::scope(|scope| {
            for thread in 0..THREADS {
                let (store, admitted, returned) = (&store, &admitted, &returned);
                scope.spawn(move || {
                    for _ in 0..300 {
                        if thread % 2 == 0 {
                            if store.check("hot", limit, 1, now).unwrap().allowed() {
                                admitted.fetch_add(1, Ordering::Relaxed);
                            }
                        } else {
                            let item = Item {
                                key: "hot",
                                limit,
                                cost: 1,
                            };
                            let given = store.give_back(&[item], now).unwrap();
                            assert!(given[0].remaining() <= 100, "{limit:?}: {given:?}");
                            returned.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        let left = store.peek("hot", limit, 1, now).unwrap();
        let left = if left.allowed() {
            left.remaining() + 1
        } else {
            0
        };
        let (admitted, returned) = (admitted.into_inner(), returned.into_inner());
        let accounted = admitted + left;
        assert!(
            (200..=100 + returned).contains(&accounted),
            "{limit:?}: {admitted} admitted and {left} left, of 100 and {returned} returned"
        );
    }
}

/// On the real clock, threads read the time before taking the shard lock, so a hot key's
/// checks reach the bucket with their times out of order all the time; a rejection decided at
/// a time before the last charge must still report a balance in range (it once overflowed).
#[test]
fn a_hot_key_on_the_real_clock_reports_balances_in_range() {
    let limiter = RateLimiter::with_limit(Limit::new(1, "1000000/s".parse().unwrap()).unwrap());
    let checks = AtomicU64::new(0);
    thread::scope(|scope| {
        for _ in 0..4 {
            scope.spawn(|| {
                for _ in 0..100_000 {
                    let decision = limiter.check("hot").unwrap();
                    assert!(decision.remaining() <= 1, "{decision:?}");
                    checks.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
    });
    assert_eq!(checks.into_inner(), 400_000);
}
