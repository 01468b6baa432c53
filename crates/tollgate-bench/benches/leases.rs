//! What a concurrency limit costs in the memory store: a lease taken and given back, beside a
//! token-bucket check through the same store, on one key and on 100,000 keys in random order.
//!
//! A lease is two operations (acquire, release), each taking its key's shard lock and the
//! lease id's, against one shard lock for a check; the pair is what a request under a
//! concurrency limit pays. Run with `cargo bench -p tollgate-bench --bench leases`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tollgate::{CheckRequest, LeaseLimit, LeaseRequest, Limit, LocalStore, MonotonicClock, Take};
use tollgate_bench::random_keys;

const KEYS: u64 = 100_000;

fn benches(c: &mut Criterion) {
    let store = LocalStore::new(MonotonicClock::new());
    let lease = LeaseLimit::new(64, Duration::from_secs(60)).expect("a valid limit");
    let rate = Limit::per(1_000_000_000, Duration::from_secs(1)).expect("a valid limit");
    let many: Vec<String> = random_keys(KEYS)
        .into_iter()
        .map(|k| format!("key:{{{k}}}"))
        .collect();
    let one = vec!["key:{0}".to_owned()];

    for (group, keys) in [("one_key", &one), ("many_keys_random", &many)] {
        let mut group = c.benchmark_group(group);
        group.throughput(Throughput::Elements(1));
        let mut cursor = 0;
        group.bench_function("lease_acquire_release", |b| {
            b.iter_custom(|iters| {
                #[allow(clippy::disallowed_methods, reason = "a benchmark's own timing")]
                let started = Instant::now();
                for _ in 0..iters {
                    let key = &keys[cursor % keys.len()];
                    cursor += 1;
                    let takes = [tollgate::LeaseTake::new(key, &lease)];
                    let request = LeaseRequest {
                        takes: &takes,
                        lease_id: "bench-lease",
                        now: None,
                    };
                    let taken = store.acquire_now(request).expect("a valid acquire");
                    black_box(&taken);
                    let released = store.release_now("bench-lease", None);
                    black_box(released.expect("a valid id"));
                }
                started.elapsed()
            });
        });
        let mut cursor = 0;
        group.bench_function("token_bucket_check", |b| {
            b.iter_custom(|iters| {
                #[allow(clippy::disallowed_methods, reason = "a benchmark's own timing")]
                let started = Instant::now();
                for _ in 0..iters {
                    let key = &keys[cursor % keys.len()];
                    cursor += 1;
                    let takes = [Take::new(key, &rate, 1)];
                    let request = CheckRequest {
                        takes: &takes,
                        request_id: None,
                        now: None,
                    };
                    black_box(store.check_now(request).expect("a valid check"));
                }
                started.elapsed()
            });
        });
        group.finish();
    }
}

criterion_group! {
    name = leases;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = benches
}
criterion_main!(leases);
