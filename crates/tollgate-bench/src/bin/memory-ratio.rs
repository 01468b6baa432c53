//! tollgate and governor at 1,000,000 live keys, interleaved: in each round, a short timed
//! burst of each in turn over the same keys, and the ratio within the round.
//!
//! criterion (`benches/memory.rs`) measures one limiter after the other, a minute or more
//! apart. On a host whose speed moves with its neighbours, a slow spell then lands on one of
//! them only: between two full runs of one build, governor's time per check has moved by a
//! fifth or more (BENCHMARKS.md). Here each round times tollgate, governor and the chained
//! floor back to back, a fifth of a second each, so a spell hits all three alike; the median of
//! the rounds' ratios is the figure to judge the target by, and their range shows how much the
//! host moved. Same limiters, quota, keys and loop as the criterion bench. A fourth control,
//! tollgate with a store per thread (`StorePerThread`), shares nothing between the two threads:
//! the scaling line gives its speed-up beside the shared store's, which separates what the shard
//! locks shared by both cores cost from what the host allows.
//!
//! `cargo run --release -p tollgate-bench --bin memory-ratio -- [ROUNDS]` (default 15, and one
//! more first, unrecorded; 15 rounds of both scenarios took about half a minute on this
//! project's 2-core host)

use std::hint::black_box;
use std::time::Duration;

use tollgate_bench::{
    ChainedFloor, KeyedCheck, MANY_KEYS, Quotas, StorePerThread, populate, random_keys,
    sequential_keys, split_by_parity, time_one_thread, time_two_threads,
};

/// Checks per timed burst: about a fifth of a second at 1M keys.
const BURST: u64 = 2_000_000;

/// One limiter's cursors, where its next burst continues (one thread, then each of two).
#[derive(Default)]
struct Cursors {
    one: usize,
    two: [usize; 2],
}

/// Nanoseconds per check of one burst.
fn per_check(elapsed: Duration) -> f64 {
    elapsed.as_secs_f64() * 1e9 / BURST as f64
}

/// `a[i] / b[i]` for each round.
fn ratios(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| x / y).collect()
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}

/// The figures of one scenario and thread count, a value per round.
#[derive(Default)]
struct Series {
    tollgate: Vec<f64>,
    governor: Vec<f64>,
    chained_floor: Vec<f64>,
    /// The control with a store per thread (`StorePerThread`).
    per_thread: Vec<f64>,
}

impl Series {
    fn push(&mut self, tollgate: f64, governor: f64, chained_floor: f64, per_thread: f64) {
        self.tollgate.push(tollgate);
        self.governor.push(governor);
        self.chained_floor.push(chained_floor);
        self.per_thread.push(per_thread);
    }

    fn row(&self, scenario: &str, threads: usize) -> String {
        let mut ratios = ratios(&self.tollgate, &self.governor);
        let (low, high) = ratios
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), &r| (lo.min(r), hi.max(r)));
        let met = ratios.iter().filter(|&&r| r <= 0.5).count();
        let rounds = ratios.len();
        format!(
            "| {scenario} | {threads} | {:.1} | {:.1} | **{:.2}** | {low:.2}–{high:.2} | {met} of {rounds} | {:.1} |",
            median(&mut self.tollgate.clone()),
            median(&mut self.governor.clone()),
            median(&mut ratios),
            median(&mut self.chained_floor.clone()),
        )
    }
}

/// One round's bursts of `limiter` on `keys`: one thread, then two.
fn bursts<L: KeyedCheck>(
    limiter: &L,
    keys: &[u64],
    by_thread: &[Vec<u64>; 2],
    cursors: &mut Cursors,
) -> (f64, f64) {
    let one = per_check(time_one_thread(limiter, keys, &mut cursors.one, BURST));
    let two = per_check(time_two_threads(
        limiter,
        by_thread,
        &mut cursors.two,
        BURST,
    ));
    (one, two)
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(15)
        .max(1);
    println!(
        "| scenario | threads | tollgate ns/check | governor ns/check | ratio (median of rounds) | ratio range | rounds ≤ 0.5 | chained_floor ns/check |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut scaling = Vec::new();
    for (scenario, keys) in [
        ("1M sequential", sequential_keys(MANY_KEYS)),
        ("1M random", random_keys(MANY_KEYS)),
    ] {
        let by_thread = split_by_parity(&keys);
        let tollgate = Quotas::MANY_KEYS.new_tollgate();
        let governor = Quotas::MANY_KEYS.new_governor();
        let per_thread = StorePerThread::new(&Quotas::MANY_KEYS);
        populate(&tollgate, 0..MANY_KEYS);
        populate(&governor, 0..MANY_KEYS);
        populate(&per_thread, 0..MANY_KEYS);
        // As large as tollgate's table: the latency of one miss that nothing overlaps.
        let floor = ChainedFloor::new(tollgate.store().stats().slots * 2);
        let (mut ours, mut theirs, mut floors, mut split) = Default::default();
        let mut one = Series::default();
        let mut two = Series::default();
        // A first round unrecorded: page faults, the floor's table, the threads' first start.
        for round in 0..=rounds {
            let t = bursts(&tollgate, &keys, &by_thread, &mut ours);
            let g = bursts(&governor, &keys, &by_thread, &mut theirs);
            let f = bursts(&floor, &keys, &by_thread, &mut floors);
            let p = bursts(&per_thread, &keys, &by_thread, &mut split);
            if round > 0 {
                one.push(t.0, g.0, f.0, p.0);
                two.push(t.1, g.1, f.1, p.1);
            }
        }
        // Every bucket must still be live: one token a minute, a burst of 10,000.
        let stats = tollgate.store().stats();
        assert_eq!(
            stats.live_buckets as u64, MANY_KEYS,
            "buckets expired mid-run"
        );
        assert_eq!(
            per_thread.live_buckets() as u64,
            MANY_KEYS,
            "buckets expired mid-run (a store per thread)"
        );
        println!("{}", one.row(scenario, 1));
        println!("{}", two.row(scenario, 2));
        // Each limiter's own speed-up from the second thread, round by round: a ratio that
        // moves between the thread counts is explained by whichever of the two gained more.
        let speedup = |one: &[f64], two: &[f64]| median(&mut ratios(one, two));
        scaling.push(format!(
            "{scenario}: tollgate {:.2}, governor {:.2}, chained_floor {:.2}, \
             tollgate with a store per thread {:.2}",
            speedup(&one.tollgate, &two.tollgate),
            speedup(&one.governor, &two.governor),
            speedup(&one.chained_floor, &two.chained_floor),
            speedup(&one.per_thread, &two.per_thread),
        ));
        drop(black_box((tollgate, governor, per_thread)));
    }
    println!();
    println!(
        "2-thread scaling (median of rounds), {}",
        scaling.join("; ")
    );
}
