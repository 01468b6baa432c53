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
use tollgate_bench::{RedisRig, run_load};

fn main() {
    run_load(run);
}

async fn run(seconds: f64) {
    let rig = RedisRig::start().await;
    let limit = rig.limit;
    let operation = || {
        let (store, keys) = (rig.store.clone(), rig.keys.clone());
        let next_id = Arc::new(AtomicU64::new(0));
        move |k: u64| {
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
        }
    };
    rig.beside_decisions(seconds, "reservation checked and settled", operation)
        .await;
}
