//! What each algorithm costs Redis per decision: the token bucket beside a fixed and a sliding
//! window and a sliding log, through tollgate's Redis store on a `redis-server` of its own, on 1
//! key and 100,000 random keys at 1, 16 and 64 concurrent callers.
//!
//! Every quota admits every decision of a run (a billion a second; a log's 10,000 per 20 ms, or
//! per second on 100,000 keys, where no key is asked that often), so each decision is a full
//! read, decide and write. A log's cost grows with the entries it holds: one per millisecond
//! that admitted something, about 20 on a busy key with a 20 ms window, one on each of 100,000
//! keys asked about once a second. A window's decision goes through the script's general path (the
//! straight loop is for plain token-bucket takes), so the figures show what that path costs.
//! Algorithms alternate within each row, in the same run, on the same server, each from an
//! empty database.
//!
//! `cargo run --release -p tollgate-bench --bin redis-algorithms -- [SECONDS_PER_RUN]`

use std::time::Duration;

use tollgate::Limit;
use tollgate_bench::{REDIS_KEYS, RedisRig, run_load};
use tollgate_redis::test_server::command;

fn main() {
    run_load(run);
}

async fn run(seconds: f64) {
    let rig = RedisRig::start().await;
    let second = Duration::from_secs(1);
    let limits = [
        ("token_bucket", rig.limit),
        (
            "fixed_window",
            Limit::fixed_window(999_999_999, second).expect("limit"),
        ),
        (
            "sliding_window",
            Limit::sliding_window(999_999_999, second).expect("limit"),
        ),
        (
            "sliding_log 20ms",
            Limit::sliding_log(10_000, Duration::from_millis(20)).expect("limit"),
        ),
        (
            "sliding_log 1s",
            Limit::sliding_log(10_000, second).expect("limit"),
        ),
    ];
    println!(
        "| keys | callers | algorithm | decisions/s | p50 µs | p99 µs | decisions/call | script µs/decision | redis-server CPU µs/decision |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for key_count in [1, REDIS_KEYS] {
        for callers in [1usize, 16, 64] {
            for (name, limit) in limits {
                // One key asked 100k times a second would pass 10,000 in a second's log.
                if key_count == 1 && name == "sliding_log 1s" {
                    continue;
                }
                // Each algorithm keeps its own kind of state under the rig's keys, and a key
                // holding another kind fails the decision: start every run from nothing.
                command(rig.server.port, &["FLUSHALL"]);
                let run = rig.measure_limit(limit, callers, key_count, seconds).await;
                println!(
                    "| {key_count} | {callers} | {name} | {:.0} | {:.0} | {:.0} | {:.1} | {:.2} | {:.2} |",
                    run.per_second,
                    run.p50_us,
                    run.p99_us,
                    run.per_call,
                    run.script_us,
                    run.server_cpu_us,
                );
            }
        }
    }
}
