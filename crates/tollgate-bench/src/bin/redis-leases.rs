//! What a concurrency limit costs through Redis: a lease taken and given back (one acquire
//! call, then a release of two: the lease's record, then its sets) beside a token-bucket
//! decision, through tollgate's Redis store on a `redis-server` of its own, on 1 key and
//! 100,000 random keys at 1, 16 and 64 concurrent callers.
//!
//! The concurrency limit is high enough that every acquire passes, so each lease is a full
//! acquire and release. The two kinds alternate within each row, in the same run, on the same
//! server, each from an empty database.
//!
//! `cargo run --release -p tollgate-bench --bin redis-leases -- [SECONDS_PER_RUN]`

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tollgate::{LeaseLimit, LeaseRequest, LeaseStore, LeaseTake};
use tollgate_bench::{RedisRig, run_load};

fn main() {
    run_load(run);
}

async fn run(seconds: f64) {
    let rig = RedisRig::start().await;
    let lease = LeaseLimit::new(1_000_000, Duration::from_secs(60)).expect("limit");
    let operation = || {
        let (store, keys) = (rig.store.clone(), rig.keys.clone());
        let next_id = Arc::new(AtomicU64::new(0));
        move |k: u64| {
            let (store, keys, next_id) = (store.clone(), keys.clone(), next_id.clone());
            async move {
                let id = format!("bench-{}", next_id.fetch_add(1, Ordering::Relaxed));
                let takes = [LeaseTake::new(&keys[k as usize], &lease)];
                let request = LeaseRequest {
                    takes: &takes,
                    lease_id: &id,
                    now: None,
                };
                let taken = store.acquire(request).await.expect("acquire");
                assert!(taken[0].allowed(), "the limit admits every lease");
                assert!(store.release(&id, None).await.expect("release"));
            }
        }
    };
    rig.beside_decisions(seconds, "lease taken and released", operation)
        .await;
}
