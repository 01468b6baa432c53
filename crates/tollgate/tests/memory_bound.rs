//! The live-bucket bound holds under a flood of distinct keys, and what it costs is counted.

use tollgate::{Limit, MemoryStore, Timestamp};

#[test]
fn ten_times_more_keys_than_the_bound() {
    let bound = 10_000;
    let store: MemoryStore<u64> = MemoryStore::builder().max_buckets(bound).build();
    // A long refill: every bucket stays non-full for the whole test, so nothing is free to go.
    let limit = Limit::new(10, "1/h".parse().unwrap()).unwrap();
    let mut peak = 0;
    for key in 0..10 * bound as u64 {
        let now = Timestamp::from_nanos(key);
        assert!(store.check(&key, &limit, 1, now).unwrap().allowed());
        if key % 1_000 == 0 {
            peak = peak.max(store.stats().live_buckets);
        }
    }
    let stats = store.stats();
    assert!(
        peak <= bound && stats.live_buckets <= bound,
        "{stats:?}, peak {peak}"
    );
    assert_eq!(
        stats.live_buckets as u64 + stats.evicted,
        10 * bound as u64,
        "{stats:?}"
    );
    assert_eq!(stats.expired, 0);
}

#[test]
fn full_buckets_go_first_and_are_not_counted_as_evictions() {
    let bound = 4_096;
    let store: MemoryStore<u64> = MemoryStore::builder().max_buckets(bound).build();
    let limit = Limit::new(1, "1/s".parse().unwrap()).unwrap();
    // One new key per millisecond: each bucket is full again a second after its check, so
    // about a thousand are ever non-full and the rest can be dropped losslessly.
    for key in 0..100_000u64 {
        store
            .check(&key, &limit, 1, Timestamp::from_nanos(key * 1_000_000))
            .unwrap();
    }
    let stats = store.stats();
    assert_eq!(stats.evicted, 0, "{stats:?}");
    assert!(stats.live_buckets <= bound, "{stats:?}");
    assert_eq!(
        stats.live_buckets as u64 + stats.expired,
        100_000,
        "{stats:?}"
    );
    // Every bucket still held is one that is not full yet.
    let now = Timestamp::from_nanos(100_000 * 1_000_000);
    assert!(store.sweep(now) > 0);
    assert!(store.stats().live_buckets <= 1_000);
}

#[test]
fn a_bucket_evicted_at_the_bound_was_the_closest_to_full() {
    let store: MemoryStore<u64> = MemoryStore::builder().shards(1).max_buckets(128).build();
    let limit = Limit::new(100, "1/s".parse().unwrap()).unwrap();
    // Bucket k is charged k + 1 tokens: bucket 0 is the closest to full.
    for key in 0..128u64 {
        store
            .check(&key, &limit, key % 100 + 1, Timestamp::ZERO)
            .unwrap();
    }
    store.check(&1_000, &limit, 100, Timestamp::ZERO).unwrap();
    // Bucket 0 (one token short) went; bucket 1 (two short) is still there.
    let zero = store.peek(&0, &limit, 100, Timestamp::ZERO).unwrap();
    let one = store.peek(&1, &limit, 99, Timestamp::ZERO).unwrap();
    assert!(zero.allowed(), "bucket 0 was evicted, so it reads as new");
    assert!(!one.allowed());
    assert_eq!(store.stats().evicted, 2, "1/64 of 128");
}
