//! Bytes of memory per live bucket, measured as the growth of this process's resident set.
//!
//! SPEC §9 asks for at most 40 bytes per live bucket beyond the key's own bytes at 1M keys.
//! Allocator counters would miss what the allocator keeps but does not hand out (tables freed
//! while growing, fragmentation), so this probe reads RSS before and after inserting N distinct
//! `u64` keys, one check each, with the limiter still alive. Run each limiter in its own process
//! so neither sees the other's freed memory:
//!
//! ```text
//! cargo run --release -p tollgate-bench --bin bucket-memory -- tollgate [N]
//! cargo run --release -p tollgate-bench --bin bucket-memory -- governor [N]
//! cargo run --release -p tollgate-bench --bin bucket-memory -- sliding-log [N]
//! ```
//!
//! `sliding-log` measures tollgate's sliding logs instead of its buckets (10,000 per hour, one
//! entry each): what the exact window costs per key beside the slot a bucket takes.

use std::hint::black_box;
use std::process::ExitCode;
use std::time::Duration;

use tollgate::{Limit, MonotonicClock, RateLimiter};
use tollgate_bench::{MANY_KEYS, Quotas, Tollgate, populate, resident_bytes};

/// The bytes a `u64` key occupies, which the target does not count.
const KEY_BYTES: f64 = 8.0;

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let which = args.next().unwrap_or_default();
    let n = match args.next().map(|n| n.replace('_', "").parse::<u64>()) {
        None => MANY_KEYS,
        Some(Ok(n)) if n > 0 => n,
        Some(_) => return usage("N must be a positive whole number"),
    };
    let result = match which.as_str() {
        "tollgate" => measure(n, Quotas::MANY_KEYS.new_tollgate(), |limiter| {
            format!("live_buckets={}", limiter.store().stats().live_buckets)
        }),
        "governor" => measure(n, Quotas::MANY_KEYS.new_governor(), |limiter| {
            format!("keys={}", limiter.len())
        }),
        "sliding-log" => {
            let Ok(limit) = Limit::sliding_log(10_000, Duration::from_secs(3_600)) else {
                return usage("the sliding log's limit is invalid");
            };
            let limiter: Tollgate = RateLimiter::keyed(limit, MonotonicClock::new());
            measure(n, limiter, |limiter| {
                let stats = limiter.store().stats();
                format!("logs={} log_entries={}", stats.logs, stats.log_entries)
            })
        }
        _ => return usage("which limiter: tollgate, governor or sliding-log"),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("bucket-memory: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Inserts keys `0..n` into `limiter` and prints the RSS growth per key.
fn measure<L: tollgate_bench::KeyedCheck>(
    n: u64,
    limiter: L,
    describe: impl Fn(&L) -> String,
) -> std::io::Result<()> {
    let before = resident_bytes()?;
    populate(&limiter, 0..n);
    let after = resident_bytes()?;
    let per_key = after.saturating_sub(before) as f64 / n as f64;
    println!(
        "keys={n} rss_before={before} rss_after={after} delta={} bytes_per_key={per_key:.1} \
         beyond_8_byte_key={:.1} {}",
        after.saturating_sub(before),
        per_key - KEY_BYTES,
        describe(&limiter),
    );
    // The limiter lives until here, after the second reading.
    drop(black_box(limiter));
    Ok(())
}

fn usage(problem: &str) -> ExitCode {
    eprintln!("bucket-memory: {problem}");
    eprintln!("usage: bucket-memory tollgate|governor|sliding-log [N (default {MANY_KEYS})]");
    ExitCode::from(2)
}
