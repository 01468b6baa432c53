//! Token leasing (`RedisConfig::with_token_batches`) against a real single-node Redis that each
//! test starts for itself: several stores on one Redis stand for several processes.

mod support;

use std::sync::Arc;
use std::time::Duration;

use support::{RedisServer, command, info_field};
use tollgate::{CheckRequest, Decision, Limit, Store, Take, Timestamp};
use tollgate_redis::{ConnectError, RedisConfig, RedisStore};

/// Long enough that a loaded machine never turns a slow answer into a failure.
const LOADED: Duration = Duration::from_secs(2);

/// A bucket that refills one token a day: frozen for the length of a test, so that what the
/// processes admitted and what Redis holds add up exactly.
fn frozen(capacity: u64) -> Limit {
    Limit::new(capacity, "1/d".parse().unwrap()).unwrap()
}

async fn batching(server: &RedisServer, max_tokens: u64, ttl: Duration) -> Arc<RedisStore> {
    let config = RedisConfig::default()
        .with_timeout(LOADED)
        .with_token_batches(max_tokens, ttl);
    Arc::new(RedisStore::connect(&server.url(), config).await.unwrap())
}

async fn plain(server: &RedisServer) -> RedisStore {
    let config = RedisConfig::default().with_timeout(LOADED);
    RedisStore::connect(&server.url(), config).await.unwrap()
}

async fn check_one(store: &impl Store, key: &str, limit: &Limit, cost: u64) -> Decision {
    let takes = [Take::new(key, limit, cost)];
    let request = CheckRequest {
        takes: &takes,
        request_id: None,
        now: None,
    };
    store.check(request).await.expect("decided")[0]
}

/// The whole tokens Redis' bucket holds now: a peek of one token charges nothing, and says
/// what a check would leave.
async fn balance(store: &RedisStore, key: &str, limit: &Limit) -> u64 {
    let takes = [Take::new(key, limit, 1)];
    let request = CheckRequest {
        takes: &takes,
        request_id: None,
        now: None,
    };
    let peeked = store.peek(request).await.expect("peeked")[0];
    peeked.remaining() + u64::from(peeked.allowed())
}

/// Script calls Redis has run so far (EVALSHA and EVAL).
fn script_calls(server: &RedisServer) -> f64 {
    let stats = command(server.port, &["INFO", "commandstats"]).unwrap_or_default();
    info_field(&stats, "cmdstat_evalsha:", "calls") + info_field(&stats, "cmdstat_eval:", "calls")
}

/// Three processes, eight tasks each, hammering one key: never more admitted than the bucket
/// holds; while batches are held, Redis holds exactly what was neither admitted nor held; once
/// they are given back, exactly what was not admitted: no token lost, none minted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn processes_hammering_one_key_never_over_admit_and_give_back_every_token() {
    const MOST: u64 = 16;
    let server = RedisServer::start();
    let l = frozen(1_000);
    let stores = [
        batching(&server, MOST, Duration::from_secs(30)).await,
        batching(&server, MOST, Duration::from_secs(30)).await,
        batching(&server, MOST, Duration::from_secs(30)).await,
    ];
    let witness = plain(&server).await;
    // Each task checks `rounds` times; returns what it admitted and the most any store held.
    let hammer = |rounds: usize| {
        let tasks: Vec<_> = (0..24)
            .map(|task| {
                let store = Arc::clone(&stores[task % 3]);
                tokio::spawn(async move {
                    let (mut admitted, mut most_held) = (0u64, 0u64);
                    for _ in 0..rounds {
                        admitted += u64::from(check_one(&*store, "hot", &l, 1).await.allowed());
                        most_held = most_held.max(store.token_batch_stats().held);
                    }
                    (admitted, most_held)
                })
            })
            .collect();
        async move {
            let mut total = (0, 0);
            for task in tasks {
                let (admitted, held) = task.await.unwrap();
                total = (total.0 + admitted, total.1.max(held));
            }
            total
        }
    };
    let held = |stores: &[Arc<RedisStore>]| -> u64 {
        stores.iter().map(|s| s.token_batch_stats().held).sum()
    };

    // Under the limit: 720 checks, every one admitted, most without a call.
    let calls = script_calls(&server);
    let (mut first, most_held) = hammer(30).await;
    assert_eq!(first, 720);
    assert!(
        most_held <= MOST,
        "a store held {most_held} tokens of one key"
    );
    let spent: u64 = stores.iter().map(|s| s.token_batch_stats().spent).sum();
    assert!(spent > 0, "nothing was spent from a batch");
    assert!(
        script_calls(&server) - calls < 720.0,
        "batches saved no call"
    );
    // Every store holds some of its batch (a hot key's next check takes one if need be), so
    // that giving back is seen to restore exactly that.
    for store in &stores {
        while store.token_batch_stats().held == 0 {
            first += u64::from(check_one(&**store, "hot", &l, 1).await.allowed());
        }
    }
    assert_eq!(
        balance(&witness, "hot", &l).await,
        1_000 - first - held(&stores)
    );
    for store in &stores {
        store.return_token_batches().await;
    }
    assert_eq!(balance(&witness, "hot", &l).await, 1_000 - first);

    // Past the limit: 3,600 more checks for the 280 or so tokens left.
    let (second, most_held) = hammer(150).await;
    let admitted = first + second;
    assert!(admitted <= 1_000, "admitted {admitted}");
    assert!(
        most_held <= MOST,
        "a store held {most_held} tokens of one key"
    );
    assert_eq!(
        balance(&witness, "hot", &l).await,
        1_000 - admitted - held(&stores)
    );
    for store in &stores {
        store.return_token_batches().await;
    }
    assert_eq!(balance(&witness, "hot", &l).await, 1_000 - admitted);
    for store in &stores {
        let stats = store.token_batch_stats();
        assert_eq!(stats.held, 0);
        assert_eq!(stats.lost, 0);
        assert_eq!(stats.taken, stats.spent + stats.returned, "{stats:?}");
    }
}

/// The only tokens refused that the bucket had are those another process holds, at most one
/// batch, and they come back: instance A holds a batch while B is rejected; once A gives it
/// back, B admits exactly that many more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_held_elsewhere_is_the_only_under_admission_and_comes_back() {
    const MOST: u64 = 20;
    let server = RedisServer::start();
    let l = frozen(160);
    let a = batching(&server, MOST, Duration::from_secs(30)).await;
    let b = plain(&server).await;
    for _ in 0..30 {
        assert!(check_one(&*a, "shared", &l, 1).await.allowed());
    }
    let held = a.token_batch_stats().held;
    assert!(held > 0 && held <= MOST, "A holds {held}");
    let mut by_b = 0;
    while check_one(&b, "shared", &l, 1).await.allowed() {
        by_b += 1;
    }
    // B was refused while A held `held` tokens: the under-admission, measured.
    assert_eq!(30 + by_b + held, 160);
    println!("under-admitted while A held its batch: {held} of 160 tokens");
    a.return_token_batches().await;
    let mut after = 0;
    while check_one(&b, "shared", &l, 1).await.allowed() {
        after += 1;
    }
    assert_eq!(after, held);
    assert_eq!(a.token_batch_stats().returned, held);
}

/// A batch Redis refuses (its bucket has the check's cost, not the batch's) leaves the check
/// to be asked alone: admitted with the last token, never rejected for the batch's sake. A
/// batch taken answers its check with what Redis holds after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_batch_leaves_the_check_asked_alone() {
    let server = RedisServer::start();
    let l = frozen(160);
    let (a, b) = (
        batching(&server, 20, Duration::from_secs(30)).await,
        plain(&server).await,
    );
    assert!(check_one(&b, "last", &l, 152).await.allowed());
    let before = script_calls(&server);
    // The eighth check makes the key hot: it asks for itself and a batch of 8 more, which the
    // one token left refuses, then for itself alone.
    for n in 1..=8 {
        assert!(check_one(&*a, "last", &l, 1).await.allowed(), "check {n}");
    }
    assert_eq!(script_calls(&server) - before, 7.0 + 2.0);
    assert_eq!(a.token_batch_stats().batches, 0);
    assert_eq!(balance(&b, "last", &l).await, 0);
    // With room, the eighth check takes its batch, and answers what Redis holds after it.
    let mut last = None;
    for _ in 1..=8 {
        last = Some(check_one(&*a, "roomy", &l, 1).await);
    }
    assert_eq!(a.token_batch_stats().batches, 1);
    let remaining = last.map(|decision| decision.remaining());
    assert_eq!(remaining, Some(160 - 7 - 1 - 8));
    assert_eq!(balance(&b, "roomy", &l).await, 160 - 7 - 1 - 8);
}

/// Cold keys never batch; nor do retries (a request id), a caller's time, several buckets at
/// once, windows and logs, however often they come: each is a script call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cold_keys_and_requests_other_than_plain_takes_never_batch() {
    let server = RedisServer::start();
    let store = batching(&server, 100, Duration::from_secs(30)).await;
    let l = frozen(10_000);
    // The first call loads the script (a NOSCRIPT, then an EVAL): not counted.
    check_one(&*store, "warm-up", &l, 1).await;
    let calls = script_calls(&server);
    let mut checks = 0.0;
    for key in 0..100 {
        for _ in 0..3 {
            check_one(&*store, &format!("cold-{key}"), &l, 1).await;
            checks += 1.0;
        }
    }
    for round in 0..50 {
        let takes = [Take::new("hot", &l, 1)];
        let id = format!("r-{round}");
        let retried = CheckRequest {
            takes: &takes,
            request_id: Some(&id),
            now: None,
        };
        store.check(retried).await.unwrap();
        let timed = CheckRequest {
            takes: &takes,
            request_id: None,
            now: Some(Timestamp::from_nanos(1_000_000 * round)),
        };
        store.check(timed).await.unwrap();
        let two = [Take::new("hot", &l, 1), Take::new("other", &l, 1)];
        let both = CheckRequest {
            takes: &two,
            request_id: None,
            now: None,
        };
        store.check(both).await.unwrap();
        checks += 3.0;
    }
    let windows = [
        Limit::fixed_window(10_000, Duration::from_secs(60)).unwrap(),
        Limit::sliding_window(10_000, Duration::from_secs(60)).unwrap(),
        Limit::sliding_log(10_000, Duration::from_secs(60)).unwrap(),
    ];
    for (index, window) in windows.iter().enumerate() {
        for _ in 0..50 {
            assert!(
                check_one(&*store, &format!("window-{index}"), window, 1)
                    .await
                    .allowed()
            );
            checks += 1.0;
        }
    }
    assert_eq!(store.token_batch_stats().batches, 0);
    assert_eq!(script_calls(&server) - calls, checks);

    // The same number of plain takes on one key does batch.
    for _ in 0..50 {
        check_one(&*store, "plain-hot", &l, 1).await;
    }
    assert!(store.token_batch_stats().batches > 0);
}

/// A batch held past its lifetime goes back once: by the sweep, or by its key's next check;
/// one Redis forgot (a flush) is counted lost, not given back twice or minted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_batches_are_given_back_exactly_once() {
    const TTL: Duration = Duration::from_millis(300);
    let server = RedisServer::start();
    let store = batching(&server, 16, TTL).await;
    let witness = plain(&server).await;
    let l = frozen(1_000);
    let heat = |key: &'static str| {
        let store = Arc::clone(&store);
        async move {
            for _ in 0..12 {
                assert!(check_one(&*store, key, &l, 1).await.allowed());
            }
        }
    };

    heat("swept").await;
    let held = store.token_batch_stats().held;
    assert!(held > 0);
    assert_eq!(store.sweep_token_batches().await, 0, "not expired yet");
    assert_eq!(balance(&witness, "swept", &l).await, 1_000 - 12 - held);
    // The lifetime passing, not a refill: the bucket refills a token a day.
    tokio::time::sleep(TTL + Duration::from_millis(50)).await;
    assert_eq!(store.sweep_token_batches().await, 1);
    assert_eq!(store.sweep_token_batches().await, 0, "given back once");
    assert_eq!(balance(&witness, "swept", &l).await, 1_000 - 12);
    let stats = store.token_batch_stats();
    assert_eq!((stats.returned, stats.held, stats.lost), (held, 0, 0));

    // Found by the key's next check, which is decided by Redis beside the give-back.
    heat("lazy").await;
    let lazy = store.token_batch_stats().held;
    assert!(lazy > 0);
    tokio::time::sleep(TTL + Duration::from_millis(50)).await;
    let calls = script_calls(&server);
    assert!(check_one(&*store, "lazy", &l, 1).await.allowed());
    assert_eq!(
        script_calls(&server) - calls,
        2.0,
        "the check and the give-back"
    );
    assert_eq!(balance(&witness, "lazy", &l).await, 1_000 - 13);
    assert_eq!(store.token_batch_stats().returned, held + lazy);
    assert_eq!(store.sweep_token_batches().await, 0);

    // Redis forgets the batch (and the bucket): nothing to settle, counted lost.
    heat("forgotten").await;
    let forgotten = store.token_batch_stats().held;
    assert!(forgotten > 0);
    command(server.port, &["FLUSHALL"]);
    assert_eq!(store.return_token_batches().await, 1);
    let stats = store.token_batch_stats();
    assert_eq!(stats.lost, forgotten);
    assert_eq!(stats.returned, held + lazy);
    assert_eq!(
        balance(&witness, "forgotten", &l).await,
        1_000,
        "nothing minted"
    );
}

/// A batch lifetime the idempotency window cannot cover is refused at connect; one it covers
/// is what the store reports.
#[tokio::test]
async fn a_lifetime_past_the_idempotency_window_is_refused() {
    let server = RedisServer::start();
    for (ttl, window) in [
        (Duration::ZERO, Duration::from_secs(60)),
        (Duration::from_secs(60), Duration::from_secs(60)),
    ] {
        let config = RedisConfig::default()
            .with_idempotency_window(window)
            .with_token_batches(10, ttl);
        let refused = RedisStore::connect(&server.url(), config).await;
        assert!(
            matches!(refused, Err(ConnectError::InvalidTokenBatchTtl { .. })),
            "{ttl:?}"
        );
    }
    // Off, the lifetime is not looked at, and the store says leasing is off.
    let config = RedisConfig::default().with_token_batches(0, Duration::ZERO);
    let off = RedisStore::connect(&server.url(), config).await.unwrap();
    assert_eq!(off.token_batch_ttl(), None);
    // On, it tells the lifetime (a server sweeps at a fraction of it).
    let on = batching(&server, 10, Duration::from_millis(300)).await;
    assert_eq!(on.token_batch_ttl(), Some(Duration::from_millis(300)));
}
