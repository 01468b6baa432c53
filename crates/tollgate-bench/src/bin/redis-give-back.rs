//! What tokens given back with no record cost through Redis (Envoy's `is_negative_hits`): a
//! check without a request id, then a return of part of its cost (one more call, in refund
//! mode naming no take), beside a plain token-bucket decision, through tollgate's Redis store
//! on a `redis-server` of its own, on 1 key and 100,000 random keys at 1, 16 and 64 concurrent
//! callers.
//!
//! The quota admits nearly everything, so every check is charged and then partly given back.
//! The kinds alternate within each row, in the same run, on the same server, each from an
//! empty database.
//!
//! `cargo run --release -p tollgate-bench --bin redis-give-back -- [SECONDS_PER_RUN]`

use tollgate::{CheckRequest, Store, Take};
use tollgate_bench::{RedisRig, run_load};

fn main() {
    run_load(run);
}

async fn run(seconds: f64) {
    let rig = RedisRig::start().await;
    let limit = rig.limit;
    let operation = || {
        let (store, keys) = (rig.store.clone(), rig.keys.clone());
        move |k: u64| {
            let (store, keys) = (store.clone(), keys.clone());
            async move {
                let key = &keys[k as usize];
                let takes = [Take::new(key, &limit, 10)];
                let request = CheckRequest {
                    takes: &takes,
                    request_id: None,
                    now: None,
                };
                let charged = store.check(request).await.expect("check");
                assert!(charged[0].allowed(), "the quota admits every check");
                let back = [Take::new(key, &limit, 7)];
                let given = CheckRequest {
                    takes: &back,
                    ..request
                };
                store.give_back(given).await.expect("give back");
            }
        }
    };
    rig.beside_decisions(seconds, "checked and given back", operation)
        .await;
}
