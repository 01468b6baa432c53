//! The algorithms side by side in the memory store: what a fixed or a sliding window, or a
//! sliding log, costs per check beside the token bucket, on one key and on 1,000,000 live keys
//! in random order.
//!
//! On many keys every limit admits every check (a burst of 10,000 per hour, each key checked a
//! few hundred times at most), so all four do the work a passing check does and no bucket
//! expires during the run; on one key all but the first 10,000 are rejections. A sliding window
//! keeps its previous window's count beside its state once a window has passed; within the hour
//! here none has, so its state fits the slot as the others' do. A sliding log keeps its entries
//! (one per millisecond that admitted something) in a table of its own, beside the slots. Run
//! with `cargo bench -p tollgate-bench --bench algorithms`.

use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tollgate::{Limit, MonotonicClock, RateLimiter};
use tollgate_bench::{MANY_KEYS, Tollgate, populate, random_keys, time_one_thread};

fn limits() -> [(&'static str, Limit); 4] {
    let hour = Duration::from_secs(3_600);
    let made = |limit: Result<Limit, tollgate::Error>| limit.expect("a valid limit");
    [
        ("token_bucket", made(Limit::per(10_000, hour))),
        ("fixed_window", made(Limit::fixed_window(10_000, hour))),
        ("sliding_window", made(Limit::sliding_window(10_000, hour))),
        ("sliding_log", made(Limit::sliding_log(10_000, hour))),
    ]
}

fn benches(c: &mut Criterion) {
    let mut group = c.benchmark_group("one_key");
    group.throughput(Throughput::Elements(1));
    for (name, limit) in limits() {
        let limiter: Tollgate = RateLimiter::keyed(limit, MonotonicClock::new());
        let keys = [0];
        let mut cursor = 0;
        group.bench_function(name, |b| {
            b.iter_custom(|iters| time_one_thread(&limiter, &keys, &mut cursor, iters));
        });
    }
    group.finish();

    let keys = random_keys(MANY_KEYS);
    let mut group = c.benchmark_group("many_keys_random");
    group.throughput(Throughput::Elements(1));
    for (name, limit) in limits() {
        let limiter: Tollgate = RateLimiter::keyed(limit, MonotonicClock::new());
        populate(&limiter, 0..MANY_KEYS);
        let stats = limiter.store().stats();
        assert_eq!(
            stats.live_buckets as u64, MANY_KEYS,
            "{name}: every bucket live"
        );
        assert_eq!(stats.spilled, 0, "{name}: every state in its slot");
        let mut cursor = 0;
        group.bench_function(name, |b| {
            b.iter_custom(|iters| time_one_thread(&limiter, &keys, &mut cursor, iters));
        });
    }
    group.finish();
}

criterion_group! {
    name = algorithms;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = benches
}
criterion_main!(algorithms);
