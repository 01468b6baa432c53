//! Load against the Redis store, beside the ceiling of one script call per decision.
//!
//! Starts its own `redis-server` on a free loopback port (never someone else's), then for 1 key
//! and 100,000 random keys at 1, 16 and 64 concurrent callers measures:
//!
//! * tollgate decisions per second and their p50/p99 latency, through `RedisStore` (one
//!   multiplexed connection, Redis `TIME`, concurrent decisions sharing `EVALSHA` calls), and
//!   how many decisions a call carried on average;
//! * the same for a raw `EVALSHA` of `return 1` on the same kind of connection: no client in
//!   the world can make one script call per decision faster;
//! * Redis' own CPU per decision: the `usec` of `EVALSHA` from `INFO commandstats` (the
//!   scripts' time inside Redis) and the whole server's CPU (`INFO cpu`), over decisions; and
//!   the same per `return 1` call, the floor of any script call on this host.
//!
//! `cargo run --release -p tollgate-bench --bin redis-load -- [SECONDS_PER_RUN]`

use std::sync::Arc;
use std::time::Duration;

use hdrhistogram::Histogram;
use rand::Rng;
use tollgate::{CheckRequest, Store, Take};
use tollgate_bench::{REDIS_KEYS, RedisRig};
use tollgate_redis::test_server::{command, info_field};

/// One measured run.
struct Run {
    per_second: f64,
    p50_us: f64,
    p99_us: f64,
    script_us: f64,
    server_cpu_us: f64,
    /// Decisions per script call: how much the batcher shares calls.
    per_call: f64,
}

fn server_cpu_seconds(port: u16) -> f64 {
    let info = command(port, &["INFO", "cpu"]).unwrap_or_default();
    info_field(&info, "used_cpu_user:", "used_cpu_user")
        + info_field(&info, "used_cpu_sys:", "used_cpu_sys")
}

/// Runs `callers` tasks calling `decide(key index)` for `seconds`, and reads Redis' figures.
async fn measure<F, Fut>(port: u16, callers: usize, keys: u64, seconds: f64, decide: F) -> Run
where
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    command(port, &["CONFIG", "RESETSTAT"]);
    let cpu_before = server_cpu_seconds(port);
    let decide = Arc::new(decide);
    let started = tokio::time::Instant::now();
    let until = started + Duration::from_secs_f64(seconds);
    let mut tasks = Vec::new();
    for caller in 0..callers {
        let decide = decide.clone();
        tasks.push(tokio::spawn(async move {
            let mut histogram = Histogram::<u64>::new(3).expect("histogram");
            let mut rng = rand::rngs::SmallRng::seed_from_u64(caller as u64);
            let mut count = 0u64;
            while tokio::time::Instant::now() < until {
                let key = if keys == 1 {
                    0
                } else {
                    rng.random_range(0..keys)
                };
                let at = tokio::time::Instant::now();
                decide(key).await;
                let _ = histogram.record(at.elapsed().as_nanos() as u64);
                count += 1;
            }
            (count, histogram)
        }));
    }
    let mut total = 0;
    let mut histogram = Histogram::<u64>::new(3).expect("histogram");
    for task in tasks {
        let (count, h) = task.await.expect("load task");
        total += count;
        let _ = histogram.add(h);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let stats = command(port, &["INFO", "commandstats"]).unwrap_or_default();
    // Total script time over decisions: one call may carry several decisions.
    let script_us = info_field(&stats, "cmdstat_evalsha:", "usec") / total.max(1) as f64;
    let cpu = server_cpu_seconds(port) - cpu_before;
    let calls = info_field(&stats, "cmdstat_evalsha:", "calls");
    Run {
        per_second: total as f64 / elapsed,
        p50_us: histogram.value_at_quantile(0.5) as f64 / 1_000.0,
        p99_us: histogram.value_at_quantile(0.99) as f64 / 1_000.0,
        script_us,
        server_cpu_us: cpu * 1e6 / total.max(1) as f64,
        per_call: total as f64 / calls.max(1.0),
    }
}

use rand::SeedableRng;

fn main() {
    let seconds: f64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(3.0);
    // One core for the load generator; redis-server has the other.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(run(seconds));
}

async fn run(seconds: f64) {
    let RedisRig {
        server,
        store,
        raw,
        noop,
        limit,
        keys,
    } = RedisRig::start().await;

    println!(
        "| keys | callers | tollgate decisions/s | p50 µs | p99 µs | `return 1` calls/s | ratio | decisions/call | script µs/decision | redis-server CPU µs/decision | `return 1` script µs/call | `return 1` redis-server CPU µs/call |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for key_count in [1, REDIS_KEYS] {
        for callers in [1usize, 16, 64] {
            let ours = {
                let (store, keys) = (store.clone(), keys.clone());
                measure(server.port, callers, key_count, seconds, move |k| {
                    let (store, keys) = (store.clone(), keys.clone());
                    async move {
                        let takes = [Take::new(&keys[k as usize], &limit, 1)];
                        let request = CheckRequest {
                            takes: &takes,
                            request_id: None,
                            now: None,
                        };
                        if let Err(err) = store.check(request).await {
                            panic!("decision failed: {err}");
                        }
                    }
                })
                .await
            };
            let ceiling = {
                let (raw, noop, keys) = (raw.clone(), noop.clone(), keys.clone());
                measure(server.port, callers, key_count, seconds, move |k| {
                    let (mut raw, noop, keys) = (raw.clone(), noop.clone(), keys.clone());
                    async move {
                        let reply: redis::RedisResult<i64> =
                            noop.key(&keys[k as usize]).invoke_async(&mut raw).await;
                        if let Err(err) = reply {
                            panic!("return 1 failed: {err}");
                        }
                    }
                })
                .await
            };
            println!(
                "| {key_count} | {callers} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} |",
                ours.per_second,
                ours.p50_us,
                ours.p99_us,
                ceiling.per_second,
                ours.per_second / ceiling.per_second,
                ours.per_call,
                ours.script_us,
                ours.server_cpu_us,
                ceiling.script_us,
                ceiling.server_cpu_us,
            );
        }
    }
}
