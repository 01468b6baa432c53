//! What a reservation costs through Redis: a check with a request id (the reservation, which
//! writes its record) and its settlement (one more call, giving back part of the cost), beside a
//! plain token-bucket decision, through tollgate's Redis store on a `redis-server` of its own,
//! on 1 key and 100,000 random keys at 1, 16 and 64 concurrent callers.
//!
//! The quota admits nearly everything, so every reservation is charged and then settled. The
//! kinds alternate within each row, in the same run, on the same server, each from an empty
//! database.
//!
//! `cargo run --release -p tollgate-bench --bin redis-settle -- [SECONDS_PER_RUN]`

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tollgate::{CheckRequest, SettleStatus, Store, Take};
use tollgate_bench::{REDIS_KEYS, RedisRig, measure, print_row_header, run_load};
use tollgate_redis::test_server::command;

fn main() {
    run_load(run);
}

async fn run(seconds: f64) {
    let rig = RedisRig::start().await;
    let limit = rig.limit;
    print_row_header();
    for key_count in [1, REDIS_KEYS] {
        for callers in [1usize, 16, 64] {
            command(rig.server.port, &["FLUSHALL"]);
            let run = rig.measure_store(callers, key_count, seconds).await;
            run.print_row(key_count, callers, "token-bucket decision");

            command(rig.server.port, &["FLUSHALL"]);
            let (store, keys) = (rig.store.clone(), rig.keys.clone());
            let next_id = Arc::new(AtomicU64::new(0));
            let run = measure(rig.server.port, callers, key_count, seconds, move |k| {
                let (store, keys, next_id) = (store.clone(), keys.clone(), next_id.clone());
                async move {
                    let id = format!("bench-{}", next_id.fetch_add(1, Ordering::Relaxed));
                    let takes = [Take::new(&keys[k as usize], &limit, 10)];
                    let request = CheckRequest {
                        takes: &takes,
                        request_id: Some(&id),
                        now: None,
                    };
                    let reserved = store.check(request).await.expect("reserve");
                    assert!(reserved[0].allowed(), "the quota admits every reservation");
                    let settled = store.settle(request, &[7]).await.expect("settle");
                    assert_eq!(settled.status, SettleStatus::Settled);
                }
            })
            .await;
            run.print_row(key_count, callers, "reservation checked and settled");
        }
    }
}
