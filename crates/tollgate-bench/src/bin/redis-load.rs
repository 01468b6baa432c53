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
//!   the same per `return 1` call, the floor of any script call on this host;
//! * this process's own CPU per decision (`/proc/self/stat`): the client's share of the two
//!   cores, which at high concurrency bounds the rate as much as Redis does.
//!
//! `cargo run --release -p tollgate-bench --bin redis-load -- [SECONDS_PER_RUN]`

use tollgate_bench::{REDIS_KEYS, RedisRig, measure, run_load};

fn main() {
    run_load(run);
}

async fn run(seconds: f64) {
    let rig = RedisRig::start().await;
    let (port, raw, noop, keys) = (rig.server.port, &rig.raw, &rig.noop, &rig.keys);

    println!(
        "| keys | callers | tollgate decisions/s | p50 µs | p99 µs | `return 1` calls/s | ratio | decisions/call | script µs/decision | redis-server CPU µs/decision | client CPU µs/decision | `return 1` script µs/call | `return 1` redis-server CPU µs/call | `return 1` client CPU µs/call |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for key_count in [1, REDIS_KEYS] {
        for callers in [1usize, 16, 64] {
            let ours = rig.measure_store(callers, key_count, seconds).await;
            let ceiling = {
                let (raw, noop, keys) = (raw.clone(), noop.clone(), keys.clone());
                measure(port, callers, key_count, seconds, move |k| {
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
                "| {key_count} | {callers} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
                ours.per_second,
                ours.p50_us,
                ours.p99_us,
                ceiling.per_second,
                ours.per_second / ceiling.per_second,
                ours.per_call,
                ours.script_us,
                ours.server_cpu_us,
                ours.client_cpu_us,
                ceiling.script_us,
                ceiling.server_cpu_us,
                ceiling.client_cpu_us,
            );
        }
    }
}
