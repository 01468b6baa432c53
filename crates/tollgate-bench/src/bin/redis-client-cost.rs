//! Drives the Redis store (or a raw `EVALSHA` of `return 1`) for a fixed number of decisions,
//! so that `scripts/redis-client-cost.sh` can count the client's instructions per decision under
//! callgrind.
//!
//! Wall-clock rates of the client move with the host's load; instruction counts do not, so two
//! versions of the store's client path can be compared on a busy machine. Everything runs on one
//! current-thread runtime, as in `redis-load`. A run of 0 decisions does the same setup (its own
//! `redis-server`, connections, the key list), which the script subtracts.
//!
//! `redis-client-cost DECISIONS CALLERS [tollgate|return1]`

use tollgate::{CheckRequest, Store, Take};
use tollgate_bench::{REDIS_KEYS, RedisRig};

fn main() {
    let mut args = std::env::args().skip(1);
    let decisions: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(20_000);
    let callers: u64 = args
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(16)
        .max(1);
    let raw = match args.next().as_deref() {
        None | Some("tollgate") => false,
        Some("return1") => true,
        Some(other) => {
            eprintln!("unknown client {other:?}: tollgate or return1");
            std::process::exit(2);
        }
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(run(decisions, callers, raw));
}

async fn run(decisions: u64, callers: u64, raw: bool) {
    let RedisRig {
        server: _server,
        store,
        raw: connection,
        noop,
        limit,
        keys,
    } = RedisRig::start().await;

    // Both paths once before counting starts: the script is loaded, the connections are up.
    let takes = [Take::new(&keys[0], &limit, 1)];
    let request = CheckRequest {
        takes: &takes,
        request_id: None,
        now: None,
    };
    store.check(request).await.expect("warm-up decision");
    let _: i64 = noop
        .key(&keys[0])
        .invoke_async(&mut connection.clone())
        .await
        .expect("warm-up return 1");

    let mut tasks = Vec::new();
    for caller in 0..callers {
        let (store, keys, noop) = (store.clone(), keys.clone(), noop.clone());
        let mut connection = connection.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..decisions / callers {
                // A fixed spread over the keys: the same sequence in every run.
                let key = &keys[((caller * 7_919 + i * 104_729) % REDIS_KEYS) as usize];
                if raw {
                    let reply: redis::RedisResult<i64> =
                        noop.key(key).invoke_async(&mut connection).await;
                    reply.expect("return 1");
                } else {
                    let takes = [Take::new(key, &limit, 1)];
                    let request = CheckRequest {
                        takes: &takes,
                        request_id: None,
                        now: None,
                    };
                    store.check(request).await.expect("decision");
                }
            }
        }));
    }
    for task in tasks {
        task.await.expect("caller");
    }
}
