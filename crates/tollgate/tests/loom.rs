//! Loom models of the memory store's locking, explored over every interleaving.
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p tollgate --test loom --release` (`.ci/run`
//! does). Under `--cfg loom` the store's shard mutexes are loom's, so these models exercise the
//! real store code: one check racing another on a key, and multi-key checks taking their shard
//! locks in opposite request orders.
#![cfg(loom)]

use loom::sync::Arc;
use loom::thread;
use tollgate::{Item, Limit, MemoryStore, Timestamp};

fn store(shards: usize) -> MemoryStore<u64, foldhash::fast::FixedState> {
    MemoryStore::<u64>::builder()
        .shards(shards)
        .build_with_hasher(foldhash::fast::FixedState::with_seed(7))
}

fn limit(capacity: u64) -> Limit {
    Limit::new(capacity, "1/s".parse().unwrap()).unwrap()
}

#[test]
fn two_checks_on_one_key_admit_the_capacity_once() {
    loom::model(|| {
        let store = Arc::new(store(2));
        let limit = limit(1);
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let store = store.clone();
                thread::spawn(move || {
                    store
                        .check(&1, &limit, 1, Timestamp::ZERO)
                        .unwrap()
                        .allowed()
                })
            })
            .collect();
        let admitted = handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .filter(|&allowed| allowed)
            .count();
        assert_eq!(admitted, 1);
    });
}

#[test]
fn multi_key_checks_in_opposite_orders_are_atomic_and_deadlock_free() {
    loom::model(|| {
        let store = Arc::new(store(2));
        let limit = limit(1);
        let keys = [0u64, 1, 2, 3];
        let run = |reverse: bool| {
            let store = store.clone();
            thread::spawn(move || {
                let mut order = keys;
                if reverse {
                    order.reverse();
                }
                let items: Vec<Item<'_, u64>> = order
                    .iter()
                    .map(|key| Item {
                        key,
                        limit: &limit,
                        cost: 1,
                    })
                    .collect();
                let decisions = store.check_all(&items, Timestamp::ZERO, None).unwrap();
                decisions.iter().all(|d| d.allowed())
            })
        };
        let first = run(false);
        let second = run(true);
        let (first, second) = (first.join().unwrap(), second.join().unwrap());
        // Capacity one on every key: exactly one of the two takes all four, the other none.
        assert!(first ^ second, "first {first}, second {second}");
        for key in keys {
            assert!(
                !store
                    .peek(&key, &limit, 1, Timestamp::ZERO)
                    .unwrap()
                    .allowed()
            );
        }
    });
}
