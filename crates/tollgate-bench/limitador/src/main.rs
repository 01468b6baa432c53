//! limitador's Redis store beside tollgate's, in one run on one redis-server: the Redis-backed
//! check, which is what most of a Redis-backed rate-limit server's time goes to.
//!
//! limitador-server is built from its repository, which this project cannot fetch; its library,
//! whose Redis store the server uses, is on crates.io. Both stores go through the one loop of
//! `redis-load` ([`tollgate_bench::measure`]): one redis-server of this run's own, one
//! multiplexed connection each, the same callers on one runtime thread, the same key indexes.
//! Each is given a quota that admits every request of the run, so every decision reads and
//! writes its counter or bucket:
//!
//! * tollgate: [`tollgate_redis::RedisStore`] as `redis-load` drives it (Redis `TIME`, the
//!   exact token bucket, concurrent callers sharing script calls);
//! * limitador: `AsyncRateLimiter` over `AsyncRedisStorage` with one limit in namespace `bench`
//!   counted per `user` (10^9 per 60 s), and `check_rate_limited_and_update`, the call
//!   limitador-server makes for each request. It reads every counter in one script call and
//!   then updates them in a second round trip.
//!
//! `cargo run --release --manifest-path crates/tollgate-bench/limitador/Cargo.toml -- [SECONDS]`
//! (needs libclang for limitador's RocksDB store: `apt-get install -y libclang-dev`).

use std::collections::HashMap;
use std::sync::Arc;

use limitador::AsyncRateLimiter;
use limitador::limit::{Context, Expression, Limit, Predicate};
use limitador::storage::redis::AsyncRedisStorage;
use tollgate_bench::{REDIS_KEYS, RedisRig, Run, measure, run_load};

/// limitador's namespace for the run's one limit.
const NAMESPACE: &str = "bench";

fn main() {
    run_load(run);
}

async fn run(seconds: f64) {
    let rig = RedisRig::start().await;

    let storage = AsyncRedisStorage::new(&rig.server.url())
        .await
        .expect("limitador's Redis store");
    let limiter = Arc::new(AsyncRateLimiter::new_with_storage(Box::new(storage)));
    let user = Expression::parse("user").expect("the limit's variable");
    limiter.add_limit(Limit::new(
        NAMESPACE,
        1_000_000_000,
        60,
        Vec::<Predicate>::new(),
        [user],
    ));
    // The values limitador is given per key: its context is built from owned strings.
    let users: Arc<Vec<String>> = Arc::new((0..REDIS_KEYS).map(|k| k.to_string()).collect());

    println!(
        "| keys | callers | tollgate decisions/s | limitador decisions/s | tollgate ÷ limitador | tollgate p50 / p99 µs | limitador p50 / p99 µs | redis-server CPU µs/decision, tollgate / limitador | client CPU µs/decision, tollgate / limitador | script calls per decision, tollgate / limitador |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for key_count in [1, REDIS_KEYS] {
        for callers in [1usize, 16, 64] {
            let ours = rig.measure_store(callers, key_count, seconds).await;
            let theirs = {
                let (limiter, users) = (limiter.clone(), users.clone());
                measure(rig.server.port, callers, key_count, seconds, move |k| {
                    let (limiter, users) = (limiter.clone(), users.clone());
                    async move {
                        let values =
                            HashMap::from([("user".to_string(), users[k as usize].clone())]);
                        let context = Context::from(values);
                        match limiter
                            .check_rate_limited_and_update(&NAMESPACE.into(), &context, 1)
                            .await
                        {
                            Ok(result) => assert!(!result.limited, "limitador rejected"),
                            Err(err) => panic!("limitador's decision failed: {err}"),
                        }
                    }
                })
                .await
            };
            print_row(key_count, callers, &ours, &theirs);
        }
    }
}

fn print_row(keys: u64, callers: usize, ours: &Run, theirs: &Run) {
    println!(
        "| {keys} | {callers} | {:.0} | {:.0} | {:.2} | {:.0} / {:.0} | {:.0} / {:.0} | {:.2} / {:.2} | {:.2} / {:.2} | {:.2} / {:.2} |",
        ours.per_second,
        theirs.per_second,
        ours.per_second / theirs.per_second,
        ours.p50_us,
        ours.p99_us,
        theirs.p50_us,
        theirs.p99_us,
        ours.server_cpu_us,
        theirs.server_cpu_us,
        ours.client_cpu_us,
        theirs.client_cpu_us,
        1.0 / ours.per_call,
        1.0 / theirs.per_call,
    );
}
