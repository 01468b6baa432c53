//! Keyed checks against the in-memory store, tollgate beside governor in the same run.
//!
//! SPEC §9 states the memory store's targets as ratios measured in one run on one machine: at
//! 1M live keys at most half of governor's time per check, and 2 threads on distinct keys at
//! least 1.8x one thread. Every scenario here runs both limiters with the same quota, the same
//! `u64` keys in the same pre-generated order and the same loop ([`tollgate_bench::drive`]);
//! each limiter reads its own clock inside the check, as callers' checks do.
//!
//! Scenarios (criterion groups), each at 1 and 2 threads:
//! * `one_key_allowed`: a single key whose every check is allowed (2 threads: one key each);
//! * `one_key_limited`: a single key far over its 100/s limit, so nearly every check is a
//!   rejection (2 threads: one key each);
//! * `many_keys_sequential`: 1,000,000 live keys checked in the order 0, 1, 2, ...;
//! * `many_keys_random`: the same keys in a fixed random order.
//!
//! Each group also runs `floor`, a control that only reads the clock, mixes the key and loads
//! one word of a read-only table (64 MiB for the 1M-key groups): the least a check can cost, and
//! the 2-thread scaling this machine gives a loop with no locks and no shared writes. Its loads
//! are independent, so the processor overlaps their misses; the 1M-key groups also run
//! `chained_floor`, whose every load waits for the one before, as a limiter's misses do (see
//! [`tollgate_bench::ChainedFloor`]): the full latency of one miss per check, the least any
//! limiter that misses once per check can cost here.
//!
//! With 2 threads each thread checks a disjoint key set (even / odd keys), the time is the wall
//! time of both, and criterion's elements/s is the combined throughput. Run with
//! `cargo bench -p tollgate-bench --bench memory` (BENCHMARKS.md has the figures).

use std::hint::black_box;
use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, Throughput, criterion_group, criterion_main};
use tollgate_bench::{
    ChainedFloor, Floor, Governor, KeyedCheck, MANY_KEYS, Quotas, Tollgate, populate, random_keys,
    sequential_keys, split_by_parity, time_one_thread, time_two_threads,
};

/// Words in the floor's table for the 1M-key scenarios: 64 MiB.
const FLOOR_SLOTS: usize = 1 << 23;

/// Registers `name/1_thread` on `keys` and `name/2_threads` on `keys_by_thread`; returns
/// whether either ran (a command-line filter may skip both).
fn bench_limiter<L: KeyedCheck>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    limiter: &L,
    keys: &[u64],
    keys_by_thread: &[Vec<u64>; 2],
) -> bool {
    let mut ran = false;
    let mut cursor = 0;
    group.bench_function(format!("{name}/1_thread"), |b| {
        ran = true;
        b.iter_custom(|iters| time_one_thread(limiter, keys, &mut cursor, iters));
    });
    let mut cursors = [0, 0];
    group.bench_function(format!("{name}/2_threads"), |b| {
        ran = true;
        b.iter_custom(|iters| time_two_threads(limiter, keys_by_thread, &mut cursors, iters));
    });
    ran
}

/// Prints, outside the timings, evidence that the scenario measured what it claims: how many
/// buckets tollgate holds and what a further check of the first key says.
fn report(scenario: &str, tollgate: &Tollgate, governor: &Governor, first_key: u64) {
    let decision = tollgate.check(&first_key).expect("a valid cost");
    eprintln!(
        "sanity {scenario}: tollgate live_buckets={} slots={} key {first_key} allowed={} \
         remaining={}; governor keys={} key {first_key} allowed={}",
        tollgate.store().stats().live_buckets,
        tollgate.store().stats().slots,
        decision.allowed(),
        decision.remaining(),
        governor.len(),
        governor.check_key(&first_key).is_ok(),
    );
}

fn one_key(c: &mut Criterion, scenario: &str, quotas: Quotas) {
    let keys = vec![0];
    let keys_by_thread = [vec![0], vec![1]];
    let tollgate = quotas.new_tollgate();
    let governor = quotas.new_governor();
    let mut group = c.benchmark_group(scenario);
    group.throughput(Throughput::Elements(1));
    let ran = bench_limiter(&mut group, "tollgate", &tollgate, &keys, &keys_by_thread)
        | bench_limiter(&mut group, "governor", &governor, &keys, &keys_by_thread);
    bench_limiter(&mut group, "floor", &Floor::new(1), &keys, &keys_by_thread);
    group.finish();
    if ran {
        report(scenario, &tollgate, &governor, 0);
    }
}

fn many_keys(c: &mut Criterion, scenario: &str, keys: &[u64]) {
    let keys_by_thread = split_by_parity(keys);
    let tollgate = Quotas::MANY_KEYS.new_tollgate();
    let governor = Quotas::MANY_KEYS.new_governor();
    populate(&tollgate, 0..MANY_KEYS);
    populate(&governor, 0..MANY_KEYS);
    assert_eq!(
        tollgate.store().stats().live_buckets as u64,
        MANY_KEYS,
        "every pre-populated bucket must be live"
    );
    let mut group = c.benchmark_group(scenario);
    group.throughput(Throughput::Elements(1));
    let ran = bench_limiter(&mut group, "tollgate", &tollgate, keys, &keys_by_thread)
        | bench_limiter(&mut group, "governor", &governor, keys, &keys_by_thread);
    // 64 MiB, larger than either limiter's tables, so every load misses the caches.
    bench_limiter(
        &mut group,
        "floor",
        &Floor::new(FLOOR_SLOTS),
        keys,
        &keys_by_thread,
    );
    // As large as tollgate's table (a 16-byte slot per `u64` key): the latency of its one miss.
    let table_words = tollgate.store().stats().slots * 2;
    bench_limiter(
        &mut group,
        "chained_floor",
        &ChainedFloor::new(table_words),
        keys,
        &keys_by_thread,
    );
    group.finish();
    if ran {
        report(scenario, &tollgate, &governor, keys[0]);
    }
    // Free one scenario's 1M buckets before the next scenario allocates its own.
    drop(black_box((tollgate, governor)));
}

fn benches(c: &mut Criterion) {
    one_key(c, "one_key_allowed", Quotas::ONE_KEY_ALLOWED);
    one_key(c, "one_key_limited", Quotas::ONE_KEY_LIMITED);
    many_keys(c, "many_keys_sequential", &sequential_keys(MANY_KEYS));
    many_keys(c, "many_keys_random", &random_keys(MANY_KEYS));
}

criterion_group! {
    name = memory;
    config = Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    targets = benches
}
criterion_main!(memory);
