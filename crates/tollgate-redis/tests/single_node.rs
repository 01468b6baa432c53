//! The Redis store against a real single-node Redis that each test starts for itself.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use support::{Proxy, RedisServer, command, info_field, take_one_unit};
use tollgate::testkit::{Trace, compare_with_memory};
use tollgate::{
    Algorithm, Carry, CheckRequest, Decision, Error, Limit, LocalStore, ManualClock, Store, Take,
    Timestamp, Unavailable,
};
use tollgate_redis::{
    BreakerConfig, ConnectError, Failover, FailureMode, Guarded, Outcome, RedisConfig, RedisStore,
};

fn limit(capacity: u64, rate: &str) -> Limit {
    Limit::new(capacity, rate.parse().unwrap()).unwrap()
}

/// How long a decision may wait in the tests that are not about timeouts: long enough that a
/// loaded machine (a build beside the tests) never turns a slow answer into a failure.
const LOADED: Duration = Duration::from_secs(2);

async fn connect(server: &RedisServer) -> RedisStore {
    RedisStore::connect(&server.url(), RedisConfig::default().with_timeout(LOADED))
        .await
        .expect("connect")
}

/// A store with the default timeout (20 ms), for the tests of what a timeout does.
async fn connect_impatient(server: &RedisServer) -> RedisStore {
    RedisStore::connect(&server.url(), RedisConfig::default())
        .await
        .expect("connect")
}

/// A store with one script call in flight at a time, so concurrent requests queue and share
/// the next call: the batcher's tests. `timeout` bounds each decision.
async fn one_call_in_flight(server: &RedisServer, timeout: Duration) -> Arc<RedisStore> {
    let config = RedisConfig::default()
        .with_batching(1, 64)
        .with_timeout(timeout);
    Arc::new(RedisStore::connect(&server.url(), config).await.unwrap())
}

async fn check(
    store: &impl Store,
    takes: &[Take<'_>],
    now: Option<Timestamp>,
) -> Result<Vec<Decision>, Error> {
    store
        .check(CheckRequest {
            takes,
            request_id: None,
            now,
        })
        .await
}

/// Decides `requests` concurrently from one task: on a current-thread runtime every one of them
/// is queued before the batcher's dispatcher runs.
async fn decide_together<'a, T: AsRef<[Take<'a>]>>(
    store: &impl Store,
    requests: &'a [T],
) -> Vec<Result<Vec<Decision>, Error>> {
    futures_util::future::join_all(requests.iter().map(|takes| {
        store.check(CheckRequest {
            takes: takes.as_ref(),
            request_id: None,
            now: None,
        })
    }))
    .await
}

/// Decides `requests` together (as `decide_together`) and returns the decisions, once it has
/// checked that they left in one script call and that each is the memory store's, deciding the
/// same requests one after another at one instant.
async fn one_call_as_the_memory_store<'a, T: AsRef<[Take<'a>]>>(
    server: &RedisServer,
    store: &impl Store,
    requests: &'a [T],
) -> Vec<Vec<Decision>> {
    command(server.port, &["CONFIG", "RESETSTAT"]);
    let decided = decide_together(store, requests).await;
    let stats = command(server.port, &["INFO", "commandstats"]).unwrap_or_default();
    assert_eq!(info_field(&stats, "cmdstat_evalsha:", "calls"), 1.0);
    let reference = LocalStore::new(ManualClock::new());
    let mut expected = Vec::new();
    for takes in requests {
        let request = CheckRequest {
            takes: takes.as_ref(),
            request_id: None,
            now: None,
        };
        expected.push(reference.check(request).await.expect("decided"));
    }
    let decided: Vec<Vec<Decision>> = decided.into_iter().map(|r| r.expect("decided")).collect();
    assert_eq!(decided, expected);
    decided
}

/// One unit of `limit` on `key` at Redis' time, as a future that can be spawned.
fn take_one(
    store: &Arc<RedisStore>,
    limit: Limit,
    key: &'static str,
) -> impl Future<Output = Result<Vec<Decision>, Error>> + Send + 'static {
    let store = Arc::clone(store);
    async move { take_one_unit(&*store, key, &limit, None).await }
}

const T0: Timestamp = Timestamp::from_nanos(1_700_000_000_000_000_000);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decides_exactly_like_the_memory_store() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    assert!(!store.is_cluster());
    for seed in 1..=6 {
        // Resets among the requests: after one, every kind of bucket decides as new, as in
        // the memory store.
        // Tokens given back among them too, with no record (Envoy's `is_negative_hits`).
        let trace = Trace::new(seed, 400, format!("conformance-{seed}"))
            .resets(true)
            .gives_back(true);
        // Logs alone too, of one subject: in a trace of every kind, their keys have mostly
        // stopped counting by the time they are asked again (see `Trace::only`). And each kind
        // of window alone, given back to while its counts still count.
        let mut logs = Trace::new(seed, 400, format!("logs-{seed}"))
            .only(Algorithm::SlidingLog)
            .resets(true)
            .gives_back(true);
        logs.subjects = 1;
        let focused = |kind: Algorithm, name: &str| {
            let mut trace = Trace::new(seed, 300, format!("{name}-{seed}"))
                .only(kind)
                .gives_back(true);
            trace.subjects = 1;
            trace
        };
        let fixed = focused(Algorithm::FixedWindow, "fixed");
        let sliding = focused(Algorithm::SlidingWindow, "sliding");
        let tokens = focused(Algorithm::TokenBucket, "tokens");
        for trace in [trace, logs, fixed, sliding, tokens] {
            if let Err(mismatch) = compare_with_memory(&store, &trace).await {
                panic!("{mismatch}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_tasks_on_one_key_never_over_admit() {
    let server = RedisServer::start();
    // Several stores: several connections, as several processes would have.
    let mut stores = Vec::new();
    // A timeout here would only hide a charge from the count: wait as long as it takes (64
    // tasks on a busy 2-core machine, in a debug build, can pass the default 20 ms).
    let config = RedisConfig::default().with_timeout(Duration::from_secs(2));
    for _ in 0..4 {
        stores.push(Arc::new(
            RedisStore::connect(&server.url(), config.clone())
                .await
                .unwrap(),
        ));
    }
    let limit = limit(1_000, "1/h");
    let admitted = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for task in 0..64 {
        let store = stores[task % stores.len()].clone();
        let admitted = admitted.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..40 {
                let takes = [Take::new("hot", &limit, 1)];
                // Time frozen for every caller: exactly the capacity may pass.
                match check(&*store, &takes, Some(T0)).await {
                    Ok(decisions) if decisions[0].allowed() => {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => {}
                    Err(err) => panic!("{err}"),
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(admitted.load(Ordering::Relaxed), 1_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survives_script_flush_mid_run() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let limit = limit(10, "1/s");
    let takes = [Take::new("k", &limit, 1)];
    for i in 0..20 {
        if i == 5 || i == 12 {
            assert_eq!(
                command(server.port, &["SCRIPT", "FLUSH"]).as_deref(),
                Some("+OK\r\n")
            );
        }
        let decisions = check(&store, &takes, Some(T0)).await.unwrap();
        assert_eq!(decisions[0].allowed(), i < 10, "check {i}");
    }
    // The first call and the first after each flush found no script and fell back to one EVAL
    // of the source, which cached it again: every call went out as an EVALSHA first.
    let stats = command(server.port, &["INFO", "commandstats"]).unwrap();
    assert_eq!(info_field(&stats, "cmdstat_eval:", "calls"), 3.0, "{stats}");
    assert_eq!(
        info_field(&stats, "cmdstat_evalsha:", "calls"),
        20.0,
        "{stats}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_limit_charges_nothing_on_the_others() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let user = limit(5, "1/m");
    let tenant = limit(1, "1/m");
    let both = [
        Take::new("{acme}:user", &user, 1),
        Take::new("{acme}:tenant", &tenant, 1),
    ];
    assert!(
        check(&store, &both, Some(T0))
            .await
            .unwrap()
            .iter()
            .all(Decision::allowed)
    );
    for _ in 0..3 {
        let decisions = check(&store, &both, Some(T0)).await.unwrap();
        assert!(decisions[0].allowed() && !decisions[1].allowed());
        assert_eq!(decisions[0].remaining(), 4, "the user's balance, uncharged");
    }
    // The user was charged once: four tokens left.
    let user_only = [Take::new("{acme}:user", &user, 4)];
    assert!(check(&store, &user_only, Some(T0)).await.unwrap()[0].allowed());
    let one_more = [Take::new("{acme}:user", &user, 1)];
    assert!(!check(&store, &one_more, Some(T0)).await.unwrap()[0].allowed());
}

/// The script packs its reply in runs of 256 integers: a request of 130 buckets (261 integers)
/// spans two runs, and every bucket's answer must land where it belongs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_longer_than_one_run_answers_every_bucket() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let limits: Vec<Limit> = (1..=130).map(|capacity| limit(capacity, "1/m")).collect();
    let keys: Vec<String> = (1..=130).map(|i| format!("{{wide}}:{i}")).collect();
    let takes: Vec<Take<'_>> = keys
        .iter()
        .zip(&limits)
        .map(|(key, limit)| Take::new(key, limit, 1))
        .collect();
    let decisions = check(&store, &takes, Some(T0)).await.unwrap();
    assert_eq!(decisions.len(), 130);
    for (capacity, decision) in (1..=130).zip(&decisions) {
        assert!(decision.allowed(), "bucket {capacity}: {decision:?}");
        assert_eq!(decision.remaining(), capacity - 1, "bucket {capacity}");
    }
    // The first bucket (capacity 1) is empty now: the whole request is refused, and the other
    // 129 report their balance as it stands, uncharged.
    let decisions = check(&store, &takes, Some(T0)).await.unwrap();
    assert!(!decisions[0].allowed());
    for (capacity, decision) in (2..=130).zip(&decisions[1..]) {
        assert!(decision.allowed(), "bucket {capacity}: {decision:?}");
        assert_eq!(
            decision.remaining(),
            capacity - 1,
            "bucket {capacity}, uncharged"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_with_a_request_id_are_charged_once() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let limit = limit(3, "1/m");
    let takes = [Take::new("k", &limit, 2)];
    let request = |id| CheckRequest {
        takes: &takes,
        request_id: Some(id),
        now: None,
    };
    let first = store.check(request("r-1")).await.unwrap();
    let retry = store.check(request("r-1")).await.unwrap();
    assert_eq!(first, retry);
    assert!(first[0].allowed());
    assert!(!store.check(request("r-2")).await.unwrap()[0].allowed());
    let other_cost = [Take::new("k", &limit, 1)];
    let conflict = store
        .check(CheckRequest {
            takes: &other_cost,
            request_id: Some("r-1"),
            now: None,
        })
        .await;
    assert_eq!(conflict, Err(Error::IdempotencyConflict));
    let too_long = "x".repeat(300);
    assert!(matches!(
        store.check(request(&too_long)).await,
        Err(Error::InvalidRequestId { len: 300 })
    ));
}

/// A peek records nothing, so its request id counts for nothing: it neither replays the
/// decision a take with that id had, nor claims the id, which a take after it still charges;
/// and its call leaves the record's key out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peek_neither_replays_nor_claims_a_request_id() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let limit = limit(10, "1/h");
    let takes = [Take::new("k", &limit, 2)];
    let request = |id| CheckRequest {
        takes: &takes,
        request_id: Some(id),
        now: None,
    };
    assert_eq!(store.check(request("r-1")).await.unwrap()[0].remaining(), 8);
    log_every_command(&server);
    assert_eq!(
        store.peek(request("r-1")).await.unwrap()[0].remaining(),
        6,
        "what a take would leave now, not the first take's reply"
    );
    assert_eq!(keys_per_script_call(&server), [1], "the bucket's key alone");
    assert_eq!(store.peek(request("r-2")).await.unwrap()[0].remaining(), 6);
    assert_eq!(
        store.check(request("r-2")).await.unwrap()[0].remaining(),
        6,
        "charged: the peek claimed nothing"
    );
    // Only the takes' records were written, and their bucket.
    assert_eq!(command(server.port, &["DBSIZE"]).as_deref(), Some(":3\r\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_bad_input_without_touching_redis_state() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let limit1 = limit(2, "1/s");
    for cost in [0, 3] {
        let takes = [Take::new("k", &limit1, cost)];
        assert!(matches!(
            check(&store, &takes, None).await,
            Err(Error::InvalidCost { .. })
        ));
    }
    let odd = limit(1, "9/7ns");
    let takes = [Take::new("k", &odd, 1)];
    assert!(matches!(
        check(&store, &takes, None).await,
        Err(Error::UnsupportedLimit { .. })
    ));
    let dup = [Take::new("k", &limit1, 1), Take::new("k", &limit1, 1)];
    assert_eq!(
        check(&store, &dup, None).await,
        Err(Error::DuplicateKey { index: 1 })
    );
    assert_eq!(command(server.port, &["DBSIZE"]).as_deref(), Some(":0\r\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_expire_when_their_bucket_is_full() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let limit = limit(2, "1/s");
    let takes = [Take::new("ttl", &limit, 2)];
    check(&store, &takes, None).await.unwrap();
    let ttl = command(server.port, &["PTTL", "tollgate:ttl"]).unwrap();
    let ttl: i64 = ttl.trim().trim_start_matches(':').parse().unwrap();
    assert!(
        (1_900..=2_000).contains(&ttl),
        "PTTL {ttl}: two tokens take 2 s to refill"
    );
}

/// The script reads Redis' `TIME` itself. A misread clock still gives the right TTL and the
/// right answers within a second (both count from the same misread `now`), so this test reads
/// the bucket's stored state, the microsecond it is full again, against `TIME` read here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_time_a_bucket_is_full_again_at_a_microsecond_of_that_clock() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let micros = || -> i64 {
        let script =
            "local t = redis.call('TIME') return tonumber(t[1]) * 1000000 + tonumber(t[2])";
        let reply = command(server.port, &["EVAL", script, "0"]).expect("TIME");
        reply
            .trim()
            .trim_start_matches(':')
            .parse()
            .expect("an integer")
    };
    let limit = limit(2, "1/s");
    let takes = [Take::new("clock", &limit, 2)];
    let before = micros();
    check(&store, &takes, None).await.unwrap();
    let after = micros();
    let state = command(server.port, &["GET", "tollgate:clock"]).expect("the bucket");
    let full: i64 = state
        .trim()
        .split(':')
        .next()
        .and_then(|full| full.parse().ok())
        .expect("a bucket's state");
    // Two tokens at one a second: full again 2 s after Redis timed the take.
    assert!(
        (before + 2_000_000..=after + 2_000_000).contains(&full),
        "full again at {full} µs, the take timed between {before} and {after}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_mid_run_then_restarted() {
    let mut server = RedisServer::start();
    let store = connect_impatient(&server).await;
    let failover = Failover::new(store);
    let limit = limit(100, "100/s");
    let closed = [Guarded {
        take: Take::new("closed", &limit, 1),
        on_failure: FailureMode::Closed,
    }];
    let open = [Guarded {
        take: Take::new("open", &limit, 1),
        on_failure: FailureMode::Open {
            emergency: Limit::new(3, "1/h".parse().unwrap()).unwrap(),
        },
    }];
    assert!(matches!(
        failover.check(&closed, None, None).await.unwrap()[0],
        Outcome::Decided(_)
    ));

    server.kill();
    let mut open_allowed = 0;
    let mut slowest = Duration::ZERO;
    for _ in 0..50 {
        let started = tokio::time::Instant::now();
        let outcome = failover.check(&closed, None, None).await.unwrap()[0];
        assert!(
            matches!(outcome, Outcome::Unavailable { .. }),
            "{outcome:?}"
        );
        let outcome = failover.check(&open, None, None).await.unwrap()[0];
        assert!(matches!(outcome, Outcome::Emergency { .. }), "{outcome:?}");
        open_allowed += usize::from(outcome.allowed());
        slowest = slowest.max(started.elapsed());
    }
    assert_eq!(open_allowed, 3, "the emergency budget, never unlimited");
    // Bounded by the 20 ms timeout per call, with room for a loaded machine: never seconds.
    assert!(
        slowest < Duration::from_millis(500),
        "slowest pair took {slowest:?}"
    );
    let stats = failover.stats();
    assert_eq!((stats.unavailable, stats.emergency), (50, 50));

    server.restart();
    let decided = || async {
        matches!(
            failover.check(&closed, None, None).await.unwrap()[0],
            Outcome::Decided(_)
        )
    };
    until(Duration::from_secs(15), decided)
        .await
        .expect("recovers once Redis is back");
}

/// A Redis that is gone (its port refuses connections) is told apart from a slow one: the
/// calls fail at once as connection failures, not after the timeout as timeouts, so an
/// operator reading `tollgate_store_errors_total{reason}` or `/readyz` sees which it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_redis_is_a_connection_failure_not_a_timeout() {
    let mut server = RedisServer::start();
    // A timeout far longer than a refused connect takes, so waiting on a reconnect would show.
    let config = RedisConfig::default().with_timeout(Duration::from_secs(2));
    let store = RedisStore::connect(&server.url(), config).await.unwrap();
    let limit = limit(10, "1/s");
    let takes = [Take::new("k", &limit, 1)];
    assert!(check(&store, &takes, None).await.is_ok());

    server.kill();
    let mut reasons = Vec::new();
    for _ in 0..6 {
        match check(&store, &takes, None).await {
            Err(Error::StoreUnavailable { reason }) => reasons.push(reason),
            other => panic!("expected unavailable, got {other:?}"),
        }
        reasons.extend(store.ping().await.err());
    }
    assert!(
        reasons
            .iter()
            .all(|r| matches!(r, Unavailable::Connection | Unavailable::CircuitOpen)),
        "{reasons:?}"
    );
    assert_eq!(reasons[0], Unavailable::Connection);

    server.restart();
    until(Duration::from_secs(15), || async {
        check(&store, &takes, None).await.is_ok()
    })
    .await
    .expect("recovers once Redis is back");
    assert_eq!(store.ping().await, Ok(()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_redis_times_out_and_the_breaker_stops_waiting() {
    let server = RedisServer::start();
    let store = connect_impatient(&server).await;
    let limit = limit(10, "1/s");
    let takes = [Take::new("k", &limit, 1)];
    assert!(check(&store, &takes, None).await.is_ok());

    server.pause();
    let mut reasons = Vec::new();
    for _ in 0..6 {
        match check(&store, &takes, None).await {
            Err(Error::StoreUnavailable { reason }) => reasons.push(reason),
            other => panic!("expected unavailable, got {other:?}"),
        }
    }
    server.resume();
    // The first calls wait out the timeout; then the breaker fails the rest fast.
    assert_eq!(reasons[0], Unavailable::Timeout);
    assert!(reasons.contains(&Unavailable::CircuitOpen), "{reasons:?}");
    assert!(store.is_degraded());
    assert_eq!(store.open_breakers(), 1, "a single node's one breaker");

    until(Duration::from_secs(15), || async {
        check(&store, &takes, None).await.is_ok()
    })
    .await
    .expect("recovers once Redis answers");
    assert!(!store.is_degraded());
    assert_eq!(store.open_breakers(), 0);
}

/// A store whose connections go through a proxy in front of its own Redis, so a test can make
/// them go silent.
async fn behind_proxy() -> (RedisServer, Proxy, Arc<RedisStore>) {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.port);
    let store = RedisStore::connect(&proxy.url(), RedisConfig::default())
        .await
        .unwrap();
    (server, proxy, Arc::new(store))
}

/// Waits until a first decision goes through `store` (at most 5 s): on a loaded host the first
/// call, which also loads the script, can pass the production 20 ms timeout these tests keep.
async fn warm_up(store: &RedisStore, limit: &Limit) {
    until(Duration::from_secs(5), || async {
        take_one_unit(store, "warm-up", limit, None).await.is_ok()
    })
    .await
    .expect("a first decision within 5 s");
}

/// Tries `attempt` every 50 ms until it succeeds, for at most `within`.
async fn until<F, Fut>(within: Duration, attempt: F) -> Result<(), tokio::time::error::Elapsed>
where
    F: Fn() -> Fut,
    Fut: Future<Output = bool>,
{
    tokio::time::timeout(within, async {
        while !attempt().await {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
}

/// A connection whose peer vanished without closing it (the kernel would give up on it only
/// after minutes of retransmissions) must not hold the store in its failure modes once Redis
/// is reachable again: the store replaces it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_stops_answering_is_replaced() {
    let (_server, proxy, store) = behind_proxy().await;
    let limit = limit(1_000, "1/s");
    let take = |key| take_one(&store, limit, key);
    warm_up(&store, &limit).await;
    let before = proxy.connections();

    proxy.black_hole();
    // Enough concurrent requests to fill every call slot of the batcher with a call that will
    // never be answered.
    let stuck: Vec<_> = (0..16).map(|_| tokio::spawn(take("k"))).collect();
    for request in stuck {
        let outcome = request.await.unwrap();
        assert!(
            matches!(
                outcome,
                Err(Error::StoreUnavailable {
                    reason: Unavailable::Timeout | Unavailable::CircuitOpen
                })
            ),
            "{outcome:?}"
        );
    }

    until(Duration::from_secs(10), || async {
        take("k").await.is_ok()
    })
    .await
    .expect("a new connection once the old one stopped answering");
    assert!(proxy.connections() > before, "{}", proxy.connections());
    assert!(!store.is_degraded());
    // The silent connection is closed once its last call has timed out, not leaked.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while proxy.open_connections() > 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} connections still open",
            proxy.open_connections()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A managed Redis fails over behind one name (a cloud endpoint, a Kubernetes Service): the
/// name now leads to the new primary, but the store's connection, still open, reaches the old
/// one, now its replica, which refuses every write (`READONLY`). That is Redis answering, but
/// not as a bucket's store: the store must go to the name again, not fail every decision
/// until it is restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_demoted_behind_its_address_is_left_for_the_new_one() {
    let (old, proxy, store) = behind_proxy().await;
    let new = RedisServer::start();
    let limit = limit(1_000, "1/s");
    let take = |key| take_one(&store, limit, key);
    warm_up(&store, &limit).await;
    let before = proxy.connections();

    proxy.retarget(new.port);
    let reply = command(old.port, &["REPLICAOF", "127.0.0.1", &new.port.to_string()]);
    assert_eq!(reply.as_deref(), Some("+OK\r\n"));
    let demoted = command(old.port, &["INFO", "replication"]).unwrap_or_default();
    assert!(demoted.contains("role:slave"), "{demoted}");

    until(Duration::from_secs(10), || async {
        take("k").await.is_ok()
    })
    .await
    .expect("decides on the new primary");
    assert!(proxy.connections() > before, "{}", proxy.connections());
    assert!(!store.is_degraded());
}

/// After a connection goes silent, its replacement's first exchange takes longer than a
/// decision may wait (a handshake across a slow network): the store must still get it up,
/// rather than give up on each new connection before it is ready and open another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replacement_slower_to_open_than_the_timeout_still_opens() {
    let (_server, proxy, store) = behind_proxy().await;
    let limit = limit(1_000, "1/s");
    warm_up(&store, &limit).await;

    proxy.delay_new_connections(Duration::from_millis(60));
    proxy.black_hole();
    let decided = || async { take_one_unit(&*store, "k", &limit, None).await.is_ok() };
    until(Duration::from_secs(10), decided)
        .await
        .expect("a replacement connection, however slow its first exchange");
    // Readiness follows: the store's ping answers on the new connection.
    assert_eq!(store.ping().await, Ok(()));
}

/// A process whose readiness check fails gets no traffic: its pings alone must bring back a
/// connection that went silent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_pings_replace_a_silent_connection() {
    let (_server, proxy, store) = behind_proxy().await;
    assert_eq!(store.ping().await, Ok(()));
    proxy.black_hole();
    assert_eq!(store.ping().await, Err(Unavailable::Timeout));
    until(Duration::from_secs(5), || async {
        store.ping().await.is_ok()
    })
    .await
    .expect("ready again on a new connection");
    assert!(proxy.connections() >= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_callers_share_script_calls() {
    let server = RedisServer::start();
    // A generous timeout: this is about how many calls, not how fast.
    let store = one_call_in_flight(&server, Duration::from_secs(5)).await;
    let limit = limit(1_000_000, "1000/s");
    command(server.port, &["CONFIG", "RESETSTAT"]);
    let tasks: Vec<_> = (0..64)
        .map(|task| {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                for round in 0..10 {
                    let key = format!("k{task}-{round}");
                    let takes = [Take::new(&key, &limit, 1)];
                    let decided = check(&*store, &takes, None).await.unwrap();
                    assert!(decided[0].allowed());
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    // 640 decisions; with one call in flight, those that arrive during a call share the next.
    let stats = command(server.port, &["INFO", "commandstats"]).unwrap_or_default();
    let calls = info_field(&stats, "cmdstat_evalsha:", "calls") as u64;
    assert!((1..640).contains(&calls), "{calls} calls for 640 decisions");
    assert_eq!(
        command(server.port, &["DBSIZE"]).as_deref(),
        Some(":640\r\n"),
        "every decision charged its own bucket"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_requests_at_different_times_are_each_decided_at_their_own() {
    let server = RedisServer::start();
    // Requests queue and batches form; a batch holds one time only.
    let store = one_call_in_flight(&server, Duration::from_secs(5)).await;
    let limit = limit(10, "1/s");
    let keys: Vec<String> = (0..64).map(|i| format!("k{i}")).collect();
    for key in &keys {
        let takes = [Take::new(key, &limit, 10)];
        assert!(check(&*store, &takes, Some(T0)).await.unwrap()[0].allowed());
    }
    // Every bucket is empty at T0. Key i is checked d = 1 + i % 4 seconds later for d tokens,
    // exactly what refilled by then: decided at its own time it is allowed and leaves nothing;
    // at a neighbour's time it would be rejected (earlier) or leave tokens (later).
    let at = |i: usize| {
        let d = 1 + i as u64 % 4;
        (Timestamp::from_nanos(T0.as_nanos() + d * 1_000_000_000), d)
    };
    for round in 0..2 {
        let tasks: Vec<_> = (0..keys.len())
            .map(|i| {
                let (store, key) = (Arc::clone(&store), keys[i].clone());
                tokio::spawn(async move {
                    let (now, d) = at(i);
                    // The second round asks one token more than is left: rejected.
                    let cost = if round == 0 { d } else { 1 };
                    let takes = [Take::new(&key, &limit, cost)];
                    check(&*store, &takes, Some(now)).await.unwrap()[0]
                })
            })
            .collect();
        for (i, task) in tasks.into_iter().enumerate() {
            let decision = task.await.unwrap();
            assert_eq!(decision.allowed(), round == 0, "key {i}, round {round}");
            assert_eq!(decision.remaining(), 0, "key {i}, round {round}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_caller_gave_up_in_the_queue_is_not_charged() {
    let server = RedisServer::start();
    let store = one_call_in_flight(&server, Duration::from_millis(500)).await;
    let limit = limit(10, "1/h");
    let take = |key| take_one(&store, limit, key);
    assert!(take("warm").await.is_ok());

    server.pause();
    // `first` takes the only call slot and is sent; `queued` waits for the slot, and its caller
    // drops it after 100 ms (a client that went away), well before `first` times out and frees
    // the slot, all while Redis is frozen.
    let first = tokio::spawn(take("first"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let queued = tokio::spawn(tokio::time::timeout(
        Duration::from_millis(100),
        take("queued"),
    ));
    let (first, queued) = (first.await.unwrap(), queued.await.unwrap());
    assert!(
        matches!(first, Err(Error::StoreUnavailable { .. })),
        "{first:?}"
    );
    assert!(queued.is_err(), "{queued:?}");
    server.resume();

    // The sent call runs once Redis wakes up; the abandoned one was never sent.
    let exists = |key: &str| command(server.port, &["EXISTS", key]);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while exists("tollgate:first").as_deref() != Some(":1\r\n") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the sent call never ran"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(exists("tollgate:queued").as_deref(), Some(":0\r\n"));
}

/// One take of `cost` on `key` at `now` (Redis' time when `None`), with `request_id`.
async fn check_at(
    store: &impl Store,
    key: &str,
    limit: &Limit,
    cost: u64,
    now: Option<Timestamp>,
    request_id: Option<&str>,
) -> Result<Vec<Decision>, Error> {
    let takes = [Take::new(key, limit, cost)];
    store
        .check(CheckRequest {
            takes: &takes,
            request_id,
            now,
        })
        .await
}

/// Idempotency records once shared the buckets' key space: the record of (`{u1}:k`, `r1`) was
/// the key of the bucket `{u1}:k:rid:r1`, so that bucket, never used before, could not be
/// decided. Records now start with `{`, which no bucket key does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucket_whose_key_equals_a_record_key_is_still_decided() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let l = limit(10, "1/s");
    let first = check_at(&store, "{u1}:k", &l, 1, None, Some("r1"))
        .await
        .unwrap();
    assert!(first[0].allowed());
    // A fresh bucket: full, so this must be allowed.
    let fresh = check_at(&store, "{u1}:k:rid:r1", &l, 1, None, None).await;
    assert!(
        matches!(&fresh, Ok(d) if d[0].allowed()),
        "a fresh bucket must be decided, got {fresh:?}"
    );
    // And the record still replays: the bucket did not overwrite it.
    let retry = check_at(&store, "{u1}:k", &l, 1, None, Some("r1"))
        .await
        .unwrap();
    assert_eq!(retry, first);
}

/// Writes values the take script cannot read as buckets at two bucket keys (a string that is
/// not a number, and a hash), as another program sharing the Redis might, and returns those
/// buckets' keys.
fn poisoned_keys(server: &RedisServer) -> [&'static str; 2] {
    let set = command(server.port, &["SET", "tollgate:{p}:text", "not-a-number"]);
    assert_eq!(set.as_deref().map(str::trim), Some("+OK"));
    let hash = command(server.port, &["HSET", "tollgate:{p}:hash", "f", "1"]);
    assert_eq!(hash.as_deref().map(str::trim), Some(":1"));
    ["{p}:text", "{p}:hash"]
}

/// A request whose bucket key holds something else is a store error of that request alone: it
/// must not fail the other requests batched in the same script call.
#[tokio::test(flavor = "current_thread")]
async fn one_failing_request_does_not_fail_the_others_in_its_batch() {
    let server = RedisServer::start();
    let store = RedisStore::connect(
        &server.url(),
        RedisConfig::default().with_timeout(Duration::from_secs(2)),
    )
    .await
    .unwrap();
    let l = limit(10, "1/s");
    let keys: Vec<String> = (0..8).map(|i| format!("good{i}")).collect();
    // All queued before the dispatcher runs (one thread): they leave in one script call. Each
    // bad key twice, so the call reads its keys once each, as for a hot key.
    let mut futures = Vec::new();
    for bad in poisoned_keys(&server).iter().cycle().take(4) {
        futures.push(Box::pin(check_at(&store, bad, &l, 1, None, None)));
    }
    for key in &keys {
        futures.push(Box::pin(check_at(&store, key, &l, 1, None, None)));
    }
    let results = futures_util::future::join_all(futures).await;
    for bad in &results[..4] {
        assert!(
            matches!(
                bad,
                Err(Error::StoreUnavailable {
                    reason: Unavailable::Script
                })
            ),
            "{bad:?}"
        );
    }
    for (key, result) in keys.iter().zip(&results[4..]) {
        assert!(
            matches!(result, Ok(d) if d[0].allowed()),
            "{key}: {result:?} (the bad requests were {:?})",
            &results[..4]
        );
    }
    // Nothing was written at the bad keys.
    assert_eq!(
        command(server.port, &["GET", "tollgate:{p}:text"]).as_deref(),
        Some("not-a-number\r\n")
    );
}

/// A call that fails as a whole (Redis' error, not a request's status) is sent again request
/// by request, so that only the request at fault fails: here a sliding log's, on a Redis whose
/// `RPUSH` is renamed away, in a call with token buckets, which that call failing first left
/// uncharged. Alone in its call, a failing request is not sent twice.
#[tokio::test(flavor = "current_thread")]
async fn a_failed_call_is_sent_again_request_by_request() {
    let server = RedisServer::start_with_args(&["--rename-command", "RPUSH", "tollgate-hidden"]);
    let store = one_call_in_flight(&server, LOADED).await;
    let (l, log) = (
        limit(10, "1/h"),
        Limit::sliding_log(3, Duration::from_secs(60)).expect("a log"),
    );
    let keys = ["a", "b", "c"];
    // Redis knows the script from here on: no `NOSCRIPT` among the calls counted.
    assert!(check_at(&store, "warm", &l, 1, None, None).await.is_ok());
    command(server.port, &["CONFIG", "RESETSTAT"]);
    // All queued before the dispatcher runs (one thread): one call, which fails, then one each.
    let mut futures = vec![Box::pin(check_at(&store, "log", &log, 1, None, None))];
    for key in keys {
        futures.push(Box::pin(check_at(&store, key, &l, 1, None, None)));
    }
    let results = futures_util::future::join_all(futures).await;
    let script_error = |result: &Result<Vec<Decision>, Error>| {
        matches!(
            result,
            Err(Error::StoreUnavailable {
                reason: Unavailable::Script
            })
        )
    };
    assert!(script_error(&results[0]), "{:?}", results[0]);
    for (key, result) in keys.iter().zip(&results[1..]) {
        let decided = result.as_ref().expect("decided alone");
        assert_eq!(
            (decided[0].allowed(), decided[0].remaining()),
            (true, 9),
            "{key}"
        );
    }
    assert_eq!(script_calls(&server), 1.0 + 4.0);
    command(server.port, &["CONFIG", "RESETSTAT"]);
    let alone = check_at(&store, "log", &log, 1, None, None).await;
    assert!(script_error(&alone), "{alone:?}");
    assert_eq!(script_calls(&server), 1.0);
}

/// Concurrent requests on one hot key share a script call, which reads that bucket once and
/// writes it once at the end: each request must still see what the ones before it took, a
/// rejected request must charge none of its buckets, and the bucket written at the end must
/// hold the last state and expire when it is full again.
#[tokio::test(flavor = "current_thread")]
async fn requests_on_one_key_in_one_call_are_decided_in_turn() {
    let server = RedisServer::start();
    // One call in flight at most: the waiting requests are not split over two calls.
    let store = one_call_in_flight(&server, Duration::from_secs(5)).await;
    let l = limit(5, "1/s");
    let one = |key: &'static str| vec![Take::new(key, &l, 1)];
    let requests = [
        one("hot"),
        one("hot"),
        one("cold"),
        one("hot"),
        one("hot"),
        one("hot"),
        // hot is empty: rejected, and side is not charged.
        vec![Take::new("side", &l, 1), Take::new("hot", &l, 1)],
        vec![Take::new("side", &l, 5)],
        one("hot"),
    ];
    // All queued before the dispatcher runs (one thread): they leave in one script call.
    let decided = one_call_as_the_memory_store(&server, &*store, &requests).await;
    // The five tokens went to the first five requests on hot; side's whole capacity was still
    // there after the rejected request that named it.
    assert!(decided[5][0].allowed() && decided[5][0].remaining() == 0);
    assert!(!decided[6][1].allowed() && !decided[8][0].allowed());
    assert!(decided[7][0].allowed());
    // The bucket as written: empty, full again 5 s from the call.
    let pttl = command(server.port, &["PTTL", "tollgate:hot"]).unwrap_or_default();
    let pttl: i64 = pttl.trim_start_matches(':').trim().parse().expect("a PTTL");
    assert!((4_000..=5_000).contains(&pttl), "PTTL {pttl}");
    let after = check_at(&*store, "hot", &l, 1, None, None).await.unwrap();
    assert!(!after[0].allowed());
}

/// A call of plain takes (one bucket each, no request id) sends each request's figures without
/// the arguments that describe it: the decisions must be the memory store's all the same, on a
/// hot key read once for the call (the script's general path) as on distinct keys (its
/// straight loop).
#[tokio::test(flavor = "current_thread")]
async fn a_call_of_plain_takes_decides_as_the_memory_store() {
    let server = RedisServer::start();
    let store = one_call_in_flight(&server, Duration::from_secs(5)).await;
    let l = limit(3, "1/s");
    let keys = ["hot", "cold", "hot", "hot", "other", "hot", "cold", "hot"];
    let requests: Vec<[Take<'_>; 1]> = keys.iter().map(|key| [Take::new(key, &l, 1)]).collect();
    let decided = one_call_as_the_memory_store(&server, &*store, &requests).await;
    // hot's three tokens went to its first three requests.
    assert!(decided[3][0].allowed() && decided[3][0].remaining() == 0);
    assert!(!decided[5][0].allowed() && !decided[7][0].allowed());
    // Distinct keys only: the same kind of call, without a repeated key, in the straight loop.
    command(server.port, &["FLUSHALL"]);
    one_call_as_the_memory_store(&server, &*store, &requests[..2]).await;
}

/// A call of takes on distinct keys, none carrying an old bucket over, at a whole microsecond
/// goes to the script's straight loop: each request must be decided as the memory store decides
/// it, on buckets already drawn from (remainders between two microseconds included) as on fresh
/// ones, and a key that is not a bucket must fail its own request alone and stay as it is.
#[tokio::test(flavor = "current_thread")]
async fn a_straight_call_decides_as_the_memory_store() {
    fn at<'a>(takes: &'a [Take<'a>], now: Timestamp) -> CheckRequest<'a> {
        CheckRequest {
            takes,
            request_id: None,
            now: Some(now),
        }
    }
    let server = RedisServer::start();
    let store = one_call_in_flight(&server, Duration::from_secs(5)).await;
    let reference = LocalStore::new(ManualClock::new());
    let (slow, odd) = (limit(3, "1/s"), limit(4, "9/7us"));
    let [text, hash] = poisoned_keys(&server);
    // Each round: microseconds since the last, then its requests' (key, limit, cost).
    type Round<'a> = (u64, &'a [(&'a str, &'a Limit, u64)]);
    let rounds: [Round<'_>; 3] = [
        (0, &[("a", &slow, 1), ("b", &slow, 3), ("c", &odd, 3)]),
        // a has two tokens left and b none: both rejected. c, charged 21 of its 28 units
        // (7 a token) and refilled 18 since (9 a microsecond), is 3 units short of full:
        // rejected too, with its remainder between two microseconds in the state.
        (
            2,
            &[
                ("a", &slow, 3),
                ("b", &slow, 1),
                (text, &slow, 1),
                ("c", &odd, 4),
                ("d", &odd, 1),
                (hash, &slow, 1),
            ],
        ),
        (
            1_000_005,
            &[("a", &slow, 2), ("c", &odd, 2), ("b", &slow, 1)],
        ),
    ];
    let mut now = T0;
    for (step_us, requests) in rounds {
        now = now + Duration::from_micros(step_us);
        let takes: Vec<[Take<'_>; 1]> = requests
            .iter()
            .map(|&(key, limit, cost)| [Take::new(key, limit, cost)])
            .collect();
        command(server.port, &["CONFIG", "RESETSTAT"]);
        let decided =
            futures_util::future::join_all(takes.iter().map(|t| store.check(at(t, now)))).await;
        let stats = command(server.port, &["INFO", "commandstats"]).unwrap_or_default();
        assert_eq!(info_field(&stats, "cmdstat_evalsha:", "calls"), 1.0);
        for ((takes, decided), &(key, ..)) in takes.iter().zip(decided).zip(requests) {
            if key == text || key == hash {
                assert!(
                    matches!(
                        decided,
                        Err(Error::StoreUnavailable {
                            reason: Unavailable::Script
                        })
                    ),
                    "{key}: {decided:?}"
                );
            } else {
                let expected = reference.check_now(at(takes, now));
                assert_eq!(decided, expected, "{key} at {now:?}");
            }
        }
    }
    assert_eq!(
        command(server.port, &["GET", "tollgate:{p}:text"]).as_deref(),
        Some("not-a-number\r\n")
    );
    assert_eq!(
        command(server.port, &["TYPE", "tollgate:{p}:hash"]).as_deref(),
        Some("+hash\r\n")
    );
}

/// With nothing in flight and calls to spare, the waiting requests leave in two calls, so that
/// Redis decides one while the other's callers are answered; every request is decided once.
#[tokio::test(flavor = "current_thread")]
async fn waiting_requests_leave_in_two_calls_when_none_is_in_flight() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let l = limit(100, "1/s");
    command(server.port, &["CONFIG", "RESETSTAT"]);
    log_every_command(&server);
    let keys: Vec<String> = (0..15).map(|k| format!("k{k}")).collect();
    let requests: Vec<[Take<'_>; 1]> = keys.iter().map(|key| [Take::new(key, &l, 1)]).collect();
    // All queued before the dispatcher runs (one thread).
    let decided = decide_together(&store, &requests).await;
    let stats = command(server.port, &["INFO", "commandstats"]).unwrap_or_default();
    assert_eq!(
        info_field(&stats, "cmdstat_evalsha:", "calls"),
        2.0,
        "{stats}"
    );
    // Half of the waiting requests (rounded up) in the first call, the rest in the second.
    assert_eq!(keys_per_script_call(&server), [8, 7]);
    for decision in decided {
        let decision = decision.expect("decided");
        assert!(decision[0].allowed() && decision[0].remaining() == 99);
    }
    assert_eq!(
        command(server.port, &["DBSIZE"]).as_deref(),
        Some(":15\r\n"),
        "every request charged its own bucket once"
    );
}

/// Has Redis keep every command it runs, from now on, in its slow log.
fn log_every_command(server: &RedisServer) {
    for (setting, value) in [
        ("slowlog-max-len", "1024"),
        ("slowlog-log-slower-than", "0"),
    ] {
        let set = command(server.port, &["CONFIG", "SET", setting, value]);
        assert_eq!(set.as_deref(), Some("+OK\r\n"));
    }
    assert_eq!(
        command(server.port, &["SLOWLOG", "RESET"]).as_deref(),
        Some("+OK\r\n")
    );
}

/// The number of keys of each script call in Redis' slow log (see [`log_every_command`]),
/// oldest first: with one key a request, how many requests each call carried.
fn keys_per_script_call(server: &RedisServer) -> Vec<u64> {
    type Entry = (i64, i64, i64, Vec<Vec<u8>>, Vec<u8>, Vec<u8>);
    let client = redis::Client::open(server.url()).expect("a client");
    let mut connection = client.get_connection().expect("a connection");
    let entries: Vec<Entry> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(-1)
        .query(&mut connection)
        .expect("the slow log");
    let mut keys: Vec<u64> = entries
        .iter()
        .filter(|(.., args, _, _)| args.first().is_some_and(|verb| verb == b"EVALSHA"))
        .map(|(.., args, _, _)| {
            let keys = args.get(2).expect("a key count");
            std::str::from_utf8(keys)
                .expect("text")
                .parse()
                .expect("a number")
        })
        .collect();
    keys.reverse();
    keys
}

/// A script error caused by one key's data is not an outage: it must not open the circuit
/// breaker for every other key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_bad_key_does_not_open_the_breaker_for_every_key() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let [bad, _] = poisoned_keys(&server);
    let l = limit(10, "1/s");
    for _ in 0..5 {
        let _ = check_at(&store, bad, &l, 1, None, None).await;
    }
    assert!(!store.is_degraded());
    let other = check_at(&store, "innocent", &l, 1, None, None).await;
    assert!(
        matches!(&other, Ok(d) if d[0].allowed()),
        "an unrelated key: {other:?}"
    );
}

/// The half-open probe is a request like any other, and callers drop requests (a client that
/// went away, an outer timeout). A dropped probe must not leave the breaker half-open forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_probe_does_not_wedge_the_breaker() {
    let server = RedisServer::start();
    let mut breaker = BreakerConfig::default();
    breaker.threshold = 1;
    breaker.cool_down = Duration::from_millis(100);
    breaker.max_cool_down = Duration::from_millis(200);
    let store = RedisStore::connect(&server.url(), RedisConfig::default().with_breaker(breaker))
        .await
        .unwrap();
    let l = limit(1_000, "1/s");
    // The first call also loads the script: on a loaded host it can pass the 20 ms timeout
    // (and open this breaker, which closes again once a call goes through).
    warm_up(&store, &l).await;

    server.pause();
    // Times out: the breaker opens.
    assert!(take_one_unit(&store, "k", &l, None).await.is_err());
    assert!(store.is_degraded());
    tokio::time::sleep(Duration::from_millis(150)).await;
    // The probe is sent, and its caller gives up on it after 2 ms.
    let dropped = tokio::time::timeout(
        Duration::from_millis(2),
        take_one_unit(&store, "k", &l, None),
    )
    .await;
    assert!(dropped.is_err(), "the probe was dropped in flight");
    server.resume();

    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut last = None;
    while tokio::time::Instant::now() < deadline {
        match take_one_unit(&store, "k", &l, None).await {
            Ok(_) => return,
            Err(err) => last = Some(err),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("never recovered in 5 s with Redis up: last {last:?}");
}

/// Caller-supplied times were cut to whole microseconds: a take at 999 ns was booked at 0, so a
/// take at 1998 ns saw a full microsecond of refill. The memory store (and the bucket math)
/// sees 999 ns: 0.999 tokens, a rejection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sub_microsecond_caller_times_do_not_over_admit() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let reference = LocalStore::new(ManualClock::new());
    let l = limit(1, "1/1us");
    let at = |ns: u64| Some(Timestamp::from_nanos(T0.as_nanos() + ns));
    for (ns, expected) in [(999, true), (1998, false)] {
        let memory = check_at(&reference, "k", &l, 1, at(ns), None)
            .await
            .unwrap();
        assert_eq!(memory[0].allowed(), expected, "reference at +{ns} ns");
        let redis = check_at(&store, "k", &l, 1, at(ns), None).await.unwrap();
        assert_eq!(
            redis[0].allowed(),
            expected,
            "redis at +{ns} ns (1 token per µs, capacity 1: two takes 999 ns apart)"
        );
    }
    // Many takes at random sub-microsecond times never pass what the exact memory store
    // admits at the same times (the store may admit fewer, never more).
    let l = limit(3, "7/3us");
    let (mut redis_admitted, mut memory_admitted) = (0, 0);
    let mut ns = 10_000u64;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..300 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        ns += seed % 700;
        let now = at(ns);
        if check_at(&reference, "many", &l, 1, now, None)
            .await
            .unwrap()[0]
            .allowed()
        {
            memory_admitted += 1;
        }
        if check_at(&store, "many", &l, 1, now, None).await.unwrap()[0].allowed() {
            redis_admitted += 1;
        }
        assert!(
            redis_admitted <= memory_admitted,
            "at +{ns} ns: redis admitted {redis_admitted}, the exact model {memory_admitted}"
        );
    }
    assert!(redis_admitted > 0);
}

/// A caller that waits exactly the `retry_after` (or `reset_after`) it was given must find the
/// tokens there, as in the memory store, also when that wait is not whole microseconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_retry_after_is_enough() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let reference = LocalStore::new(ManualClock::new());
    let after = |wait: Duration| Timestamp::from_nanos(T0.as_nanos() + wait.as_nanos() as u64);
    for (rate, capacity) in [("3/s", 1), ("7/3us", 2), ("1/1us", 1), ("999999937/s", 3)] {
        let l = limit(capacity, rate);
        for (name, store) in [("memory", &reference as &dyn Checker), ("redis", &store)] {
            let key = format!("retry:{rate}");
            assert!(store.at(&key, &l, capacity, T0).await[0].allowed());
            let rejected = store.at(&key, &l, 1, T0).await[0];
            let wait = rejected.retry_after().expect("rejected");
            let retried = store.at(&key, &l, 1, after(wait)).await[0];
            assert!(
                retried.allowed(),
                "{name} {rate}: waited retry_after = {wait:?} and was rejected again: {retried:?}"
            );
            if capacity == 1 {
                // Taking a whole bucket at a time between microseconds charges Redis from the
                // next one, up to a unit more than the capacity, which a `Decision` cannot
                // carry: its `reset_after` may be short by that unit (never `retry_after`).
                continue;
            }
            let full = retried.reset_after();
            let all = store.at(&key, &l, capacity, after(wait + full)).await[0];
            assert!(
                all.allowed(),
                "{name} {rate}: waited reset_after = {full:?} and the bucket was not full: {all:?}"
            );
        }
    }
}

/// At a time between microseconds, Redis (which counts whole ones) decides as from the next,
/// and gives the decision back the part of a unit its rounding took: a new bucket's
/// `reset_after` is the exact store's and less than a microsecond more. A retry's replay
/// answers from the first attempt's time, as the script rounded it, never shorter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn between_microseconds_waits_are_exact_within_one() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let reference = LocalStore::new(ManualClock::new());
    let at = |ns: u64| Some(Timestamp::from_nanos(T0.as_nanos() + ns));
    for rate in ["1/ms", "7/3us", "3/s"] {
        let l = limit(10, rate);
        for ns in [1, 400, 999, 1_300] {
            let key = format!("{rate}:{ns}");
            let exact = check_at(&reference, &key, &l, 3, at(ns), None)
                .await
                .unwrap();
            let redis = check_at(&store, &key, &l, 3, at(ns), None).await.unwrap();
            let (exact, redis) = (exact[0].reset_after(), redis[0].reset_after());
            assert!(
                exact <= redis && redis < exact + Duration::from_micros(1),
                "{rate} at +{ns} ns: {redis:?}, exactly {exact:?}"
            );
        }
        let (key, id) = (format!("replayed:{rate}"), format!("id:{rate}"));
        let first = check_at(&store, &key, &l, 3, at(500), Some(&id))
            .await
            .unwrap()[0];
        let replay = check_at(&store, &key, &l, 3, at(700), Some(&id))
            .await
            .unwrap()[0];
        assert_eq!(
            (replay.allowed(), replay.remaining()),
            (first.allowed(), first.remaining())
        );
        assert!(
            replay.reset_after() >= first.reset_after(),
            "{rate}: replayed {replay:?}, first {first:?}"
        );
    }
}

/// Object-safe shim over the two stores for `waiting_retry_after_is_enough`.
trait Checker {
    fn at<'a>(
        &'a self,
        key: &'a str,
        l: &'a Limit,
        cost: u64,
        now: Timestamp,
    ) -> std::pin::Pin<Box<dyn Future<Output = Vec<Decision>> + 'a>>;
}

impl<S: Store> Checker for S {
    fn at<'a>(
        &'a self,
        key: &'a str,
        l: &'a Limit,
        cost: u64,
        now: Timestamp,
    ) -> std::pin::Pin<Box<dyn Future<Output = Vec<Decision>> + 'a>> {
        Box::pin(async move { check_at(self, key, l, cost, Some(now), None).await.unwrap() })
    }
}

/// A caller-supplied time a day behind a bucket's state: the store may show fewer tokens, but
/// its rejection must not claim a full bucket (the deficit overflowed Redis' integer reply).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_gone_back_never_reports_a_full_bucket_on_a_rejection() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let l = limit(3, "999999937/s");
    assert!(
        check_at(&store, "back", &l, 3, Some(T0), None)
            .await
            .unwrap()[0]
            .allowed()
    );
    let day_before = Timestamp::from_nanos(T0.as_nanos() - 86_400 * 1_000_000_000);
    let decision = check_at(&store, "back", &l, 1, Some(day_before), None)
        .await
        .unwrap()[0];
    assert!(!decision.allowed(), "time going back mints nothing");
    assert_eq!(
        decision.remaining(),
        0,
        "rejected while reporting tokens left: {decision:?}"
    );
    let wait = std::panic::catch_unwind(|| decision.retry_after());
    assert!(
        matches!(wait, Ok(Some(wait)) if wait > Duration::ZERO),
        "retry_after of a rejection: {wait:?}"
    );
}

/// Malformed URLs give a typed error, never a panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_urls_are_typed_errors() {
    for url in [
        "",
        "localhost:6379",
        "http://h:1",
        "redis+cluster://",
        "redis+cluster://,,",
        "rediss+cluster:// , ",
        "redis+cluster://h:notaport,h:1",
        "redis://h:notaport",
        "redis://[::1",
        "redis://h:99999",
    ] {
        let url = url.to_owned();
        let result = tokio::spawn(async move {
            RedisStore::connect(&url, RedisConfig::default())
                .await
                .map(drop)
        })
        .await;
        match result {
            Ok(Err(ConnectError::InvalidUrl { .. } | ConnectError::Connect { .. })) => {}
            other => panic!("{other:?}"),
        }
    }
}

/// The script's units per token for `limit` (see `units.rs`): its period in microseconds over
/// gcd(amount, period).
fn units_per_token(limit: &Limit) -> u64 {
    let amount = limit.refill().amount();
    let period = limit.refill().period().as_micros() as u64;
    let (mut x, mut y) = (amount, period);
    while y != 0 {
        (x, y) = (y, x % y);
    }
    period / x
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_limit_carries_its_buckets_over_as_the_memory_store_does() {
    // Random histories: charges under an old limit, a change of capacity and rate, takes under
    // the new one. The memory store carries its bucket over at the change (`rebase_where`);
    // Redis reads the old bucket on the way (`Carry`). Where one unit size divides the other
    // the two must grant the same, take after take; otherwise Redis rounds the carried
    // balance down to whole tokens: never more, less by under one token.
    let server = RedisServer::start();
    let store = connect(&server).await;
    let rates = [
        "1/s", "2/s", "3/s", "10/s", "5/100ms", "7/3s", "3/7s", "1/m",
    ];
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = move |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % n
    };
    let ms = 1_000_000;
    let (mut exact_cases, mut rounded_cases, mut carried_short) = (0, 0, 0);
    for case in 0..300 {
        let old = limit(1 + next(20), rates[next(rates.len() as u64) as usize]);
        let new = limit(1 + next(20), rates[next(rates.len() as u64) as usize]);
        let (p_old, p_new) = (units_per_token(&old), units_per_token(&new));
        let exact = p_old.is_multiple_of(p_new) || p_new.is_multiple_of(p_old);
        let old_key = format!("{{s{case}}}:k@old");
        let new_key = format!("{{s{case}}}:k@new");
        let memory = LocalStore::new(ManualClock::new());
        let mut t = T0.as_nanos();
        for _ in 0..next(5) {
            t += next(3_000) * ms;
            let takes = [Take::new(&old_key, &old, 1 + next(old.capacity()))];
            let now = Some(Timestamp::from_nanos(t));
            let in_memory = check(&memory, &takes, now).await.unwrap();
            assert_eq!(check(&store, &takes, now).await.unwrap(), in_memory);
        }
        t += next(3_000) * ms;
        let change = t;
        memory
            .memory()
            .rebase_where(Timestamp::from_nanos(change), |key| {
                (**key == *old_key).then(|| (new_key.clone().into_boxed_str(), old, new))
            });
        for step in 0..1 + next(4) {
            t += next(2_000) * ms;
            let now = Some(Timestamp::from_nanos(t));
            let cost = 1 + next(new.capacity());
            let in_memory = check(&memory, &[Take::new(&new_key, &new, cost)], now)
                .await
                .unwrap()[0];
            let carry = Carry {
                key: &old_key,
                limit: &old,
                since: Duration::from_nanos(t - change),
            };
            let takes = [Take::new(&new_key, &new, cost).carried_from(carry)];
            let in_redis = check(&store, &takes, now).await.unwrap()[0];
            let context = format!("case {case} step {step}: {old:?} -> {new:?}");
            if exact {
                // Redis keeps microseconds, the memory store nanoseconds: converted, a balance
                // is rounded down to the script's unit, a microsecond of refill at most, which
                // never changes a whole token.
                assert_eq!(in_redis.allowed(), in_memory.allowed(), "{context}");
                assert_eq!(in_redis.remaining(), in_memory.remaining(), "{context}");
                let late = in_redis.reset_after().checked_sub(in_memory.reset_after());
                assert!(
                    late.is_some_and(|late| late <= Duration::from_micros(1)),
                    "{context}"
                );
                continue;
            }
            // A whole token short at most, never more generous.
            assert!(in_redis.remaining() <= in_memory.remaining(), "{context}");
            assert!(
                in_redis.remaining() + 1 >= in_memory.remaining(),
                "{context}"
            );
            assert!(!in_redis.allowed() || in_memory.allowed(), "{context}");
            if in_redis != in_memory {
                carried_short += 1;
            }
            // The histories part ways once a decision differs.
            break;
        }
        if exact {
            exact_cases += 1;
        } else {
            rounded_cases += 1;
        }
    }
    // Both kinds were exercised.
    assert!(
        exact_cases > 100 && rounded_cases > 10,
        "{exact_cases} {rounded_cases}"
    );
    eprintln!("{exact_cases} exact, {rounded_cases} rounded ({carried_short} a token short)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn charges_under_the_old_limit_still_count_after_the_change() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let (old, new) = (limit(10, "1/h"), limit(20, "1/h"));
    let second = Duration::from_secs(1);
    let at = |seconds: u64| {
        Some(Timestamp::from_nanos(
            T0.as_nanos() + seconds * 1_000_000_000,
        ))
    };
    // This process changed to `new` at T0. One still on `old` spends the old bucket a second
    // later: the capacity it grants under `old` is all either version may grant.
    let spent = [Take::new("{u1}:k@old", &old, 10)];
    assert!(check(&store, &spent, at(1)).await.unwrap()[0].allowed());
    let carry = Carry {
        key: "{u1}:k@old",
        limit: &old,
        since: 2 * second,
    };
    let one = [Take::new("{u1}:k@new", &new, 1).carried_from(carry)];
    let decision = check(&store, &one, at(2)).await.unwrap()[0];
    assert!(!decision.allowed(), "{decision:?}");
    assert_eq!(decision.remaining(), 0);
    // Without the carry, the new bucket alone would have granted it: the test can tell.
    let alone = [Take::new("{u1}:k@new", &new, 1)];
    assert!(check(&store, &alone, at(2)).await.unwrap()[0].allowed());

    // A peek carries over too, and a rejection writes nothing.
    let carry = Carry {
        key: "{u2}:k@old",
        limit: &old,
        since: second,
    };
    let spent = [Take::new("{u2}:k@old", &old, 4)];
    assert!(check(&store, &spent, at(0)).await.unwrap()[0].allowed());
    let six = [Take::new("{u2}:k@new", &new, 6).carried_from(carry)];
    let peeked = store
        .peek(CheckRequest {
            takes: &six,
            request_id: None,
            now: at(1),
        })
        .await
        .unwrap()[0];
    assert!(peeked.allowed() && peeked.remaining() == 0, "{peeked:?}");
    let seven = [Take::new("{u2}:k@new", &new, 7).carried_from(carry)];
    assert!(!check(&store, &seven, at(1)).await.unwrap()[0].allowed());
    assert_eq!(
        command(server.port, &["EXISTS", "tollgate:{u2}:k@new"]).as_deref(),
        Some(":0\r\n")
    );
    let six = [Take::new("{u2}:k@new", &new, 6).carried_from(carry)];
    assert!(check(&store, &six, at(1)).await.unwrap()[0].allowed());
    assert_eq!(
        command(server.port, &["EXISTS", "tollgate:{u2}:k@new"]).as_deref(),
        Some(":1\r\n")
    );

    // A change older than the new limit's time to full (20 h here) cannot matter: the new
    // bucket is full whatever the old one held (the store does not even read it).
    let spent = [Take::new("{u4}:k@old", &old, 10)];
    assert!(check(&store, &spent, at(0)).await.unwrap()[0].allowed());
    let long_ago = Carry {
        key: "{u4}:k@old",
        limit: &old,
        since: new.time_to_full(),
    };
    let twenty = [Take::new("{u4}:k@new", &new, 20).carried_from(long_ago)];
    assert!(check(&store, &twenty, at(1)).await.unwrap()[0].allowed());

    // An old key holding something else fails the request, as a bucket key would.
    command(server.port, &["HSET", "tollgate:{u3}:k@old", "f", "v"]).unwrap();
    let carry = Carry {
        key: "{u3}:k@old",
        limit: &old,
        since: second,
    };
    let takes = [Take::new("{u3}:k@new", &new, 1).carried_from(carry)];
    assert!(matches!(
        check(&store, &takes, at(1)).await,
        Err(Error::StoreUnavailable {
            reason: Unavailable::Script
        })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn carried_and_plain_requests_share_script_calls_without_mixing_keys() {
    // Requests with and without a carry, some with a request id (whose record key follows the
    // old keys), batched into shared calls: each must read its own old key and record.
    let server = RedisServer::start();
    let store = one_call_in_flight(&server, Duration::from_secs(5)).await;
    let (old, new) = (limit(10, "1/h"), limit(20, "1/h"));
    let old_key = |subject: u64| format!("{{s{subject}}}:k@old");
    let new_key = |subject: u64| format!("{{s{subject}}}:k@new");
    for subject in 0..48 {
        let key = old_key(subject);
        let spent = [Take::new(&key, &old, 1 + subject % 8)];
        assert!(check(&*store, &spent, Some(T0)).await.unwrap()[0].allowed());
    }
    command(server.port, &["CONFIG", "RESETSTAT"]);
    let tasks: Vec<_> = (0..48)
        .map(|subject| {
            let store = Arc::clone(&store);
            let (old_key, new_key) = (old_key(subject), new_key(subject));
            tokio::spawn(async move {
                let carry = Carry {
                    key: &old_key,
                    limit: &old,
                    since: Duration::ZERO,
                };
                let take = Take::new(&new_key, &new, 1);
                let takes = [if subject % 3 == 0 {
                    take
                } else {
                    take.carried_from(carry)
                }];
                let id = format!("r-{subject}");
                let request = CheckRequest {
                    takes: &takes,
                    request_id: (subject % 2 == 0).then_some(id.as_str()),
                    now: Some(T0),
                };
                (subject, store.check(request).await.unwrap()[0])
            })
        })
        .collect();
    for task in tasks {
        let (subject, decision) = task.await.unwrap();
        // Carried: the 10 - (1 + subject % 8) tokens left of the old bucket, one taken. Not
        // carried: a full 20, one taken.
        let expected = if subject % 3 == 0 {
            19
        } else {
            8 - subject % 8
        };
        assert!(decision.allowed(), "{subject}: {decision:?}");
        assert_eq!(decision.remaining(), expected, "{subject}");
    }
    let stats = command(server.port, &["INFO", "commandstats"]).unwrap_or_default();
    let calls = info_field(&stats, "cmdstat_evalsha:", "calls") as u64;
    assert!(
        calls < 48,
        "{calls} calls for 48 decisions: nothing was batched"
    );
}

/// A Redis at its `maxmemory` with `noeviction` refuses every write (`OOM`): no bucket can be
/// charged, so decisions take their failure modes, fast once the breaker opens, rather than
/// failing one by one as a request's own error; nothing is charged meanwhile, and decisions
/// resume once Redis has room again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_redis_fails_decisions_as_the_store_until_it_has_room() {
    let server = RedisServer::start();
    let store = Arc::new(connect(&server).await);
    let limit = limit(10, "1/h");
    let take = |key| take_one(&store, limit, key);
    assert_eq!(take("k").await.expect("decided")[0].remaining(), 9);

    let set = |name: &str, value: &str| command(server.port, &["CONFIG", "SET", name, value]);
    assert_eq!(
        set("maxmemory-policy", "noeviction").as_deref(),
        Some("+OK\r\n")
    );
    assert_eq!(set("maxmemory", "1").as_deref(), Some("+OK\r\n"));
    let full = take("k").await;
    assert!(
        matches!(
            full,
            Err(Error::StoreUnavailable {
                reason: Unavailable::Connection
            })
        ),
        "{full:?}"
    );
    for _ in 0..3 {
        let _ = take("other").await;
    }
    assert!(store.is_degraded(), "the breaker opened");

    assert_eq!(set("maxmemory", "0").as_deref(), Some("+OK\r\n"));
    until(Duration::from_secs(10), || async {
        take("k").await.is_ok()
    })
    .await
    .expect("decides again once Redis has room");
    let balance = take("k").await.expect("decided")[0].remaining();
    assert_eq!(balance, 7, "the takes Redis refused charged nothing");
}

/// The least a Redis user needs to be tollgate's, as the README gives it: the script calls and
/// the commands the script makes, on the store's keys and its idempotency records, and `PING`
/// for readiness. Every kind of request is decided under it: a plain take, one with a request
/// id (and its retry), several buckets at once, a peek, and a take after `SCRIPT FLUSH`, which
/// loads the script again by `EVAL`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_least_privilege_acl_user_suffices() {
    let server = RedisServer::start();
    support::grant_tollgate_user(server.port, &[]);
    let url = support::as_tollgate_user(&server.url());
    let store = RedisStore::connect(&url, RedisConfig::default())
        .await
        .expect("connect");
    assert_eq!(store.ping().await, Ok(()));
    let (a, b) = (limit(10, "1/h"), limit(5, "1/h"));
    let takes = [Take::new("u1", &a, 1)];
    assert_eq!(
        check(&store, &takes, None).await.expect("a take")[0].remaining(),
        9
    );
    let both = [Take::new("{t}u1", &a, 1), Take::new("{t}t", &b, 2)];
    let decided = check(&store, &both, None).await.expect("two buckets");
    assert_eq!((decided[0].remaining(), decided[1].remaining()), (9, 3));
    let window = Limit::sliding_window(2, Duration::from_secs(3_600)).expect("a window");
    let windowed = [Take::new("{t}w", &window, 2)];
    let decided = check(&store, &windowed, None).await.expect("a window");
    assert_eq!(decided[0].remaining(), 0);
    for _ in 0..2 {
        let retried = store
            .check(CheckRequest {
                takes: &takes,
                request_id: Some("r-1"),
                now: None,
            })
            .await
            .expect("a take with a request id");
        assert_eq!(retried[0].remaining(), 8, "charged once");
    }
    let peeked = store
        .peek(CheckRequest {
            takes: &takes,
            request_id: None,
            now: None,
        })
        .await
        .expect("a peek");
    assert_eq!(peeked[0].remaining(), 7, "what the take would leave");
    command(server.port, &["SCRIPT", "FLUSH"]);
    assert_eq!(
        check(&store, &takes, None).await.expect("after a flush")[0].remaining(),
        7
    );
}

/// Only a script Redis is missing is sent again as its source: an `EVALSHA` refused for
/// anything else (here, keys the user may not touch) fails the decision at once, with no
/// `EVAL` behind it to be refused again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_missing_script_is_sent_again() {
    let server = RedisServer::start();
    support::grant_tollgate_user(server.port, &[]);
    let url = support::as_tollgate_user(&server.url());
    let config = RedisConfig::default()
        .with_timeout(LOADED)
        .with_prefix("elsewhere:");
    let store = RedisStore::connect(&url, config).await.expect("connect");
    let l = limit(10, "1/h");
    let refused = check(&store, &[Take::new("k", &l, 1)], None).await;
    assert!(
        matches!(refused, Err(Error::StoreUnavailable { .. })),
        "{refused:?}"
    );
    support::assert_refused_once_and_not_sent_again(server.port);
}

/// Script calls Redis has run so far (EVALSHA and EVAL).
fn script_calls(server: &RedisServer) -> f64 {
    let stats = command(server.port, &["INFO", "commandstats"]).unwrap_or_default();
    info_field(&stats, "cmdstat_evalsha:", "calls") + info_field(&stats, "cmdstat_eval:", "calls")
}

/// A key hammered past its limit is answered from the memory of rejections until its wait is
/// over: Redis sees one call, the answers are Redis' own aged, nothing more is admitted, and a
/// retry (request id), a caller's time or a settlement in this process goes to Redis again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remembered_rejection_spares_redis_until_its_wait_is_over() {
    let server = RedisServer::start();
    let config = RedisConfig::default()
        .with_timeout(LOADED)
        .with_rejection_memory(1_000);
    let store = RedisStore::connect(&server.url(), config).await.unwrap();
    let l = limit(2, "1/h");
    let takes = [Take::new("hammered", &l, 1)];
    let mut allowed = 0;
    for _ in 0..2 {
        allowed += usize::from(check(&store, &takes, None).await.unwrap()[0].allowed());
    }
    let first = check(&store, &takes, None).await.unwrap()[0];
    assert!(!first.allowed());
    let calls = script_calls(&server);
    for _ in 0..200 {
        let again = check(&store, &takes, None).await.unwrap()[0];
        assert!(!again.allowed());
        assert!(again.retry_after() <= first.retry_after());
        assert!(again.retry_after() > Some(Duration::from_secs(1_700)));
        assert_eq!(again.remaining(), 0);
    }
    assert_eq!(allowed, 2);
    assert_eq!(script_calls(&server), calls, "answered here");
    assert_eq!(store.rejections_answered(), 200);

    // Another cost, a retry and a caller's time all ask Redis.
    let two = [Take::new("hammered", &l, 2)];
    assert!(!check(&store, &two, None).await.unwrap()[0].allowed());
    let retried = CheckRequest {
        takes: &takes,
        request_id: Some("r-1"),
        now: None,
    };
    assert!(!store.check(retried).await.unwrap()[0].allowed());
    assert_eq!(script_calls(&server), calls + 2.0);

    // A settlement in this process gives a token back and forgets the rejection.
    let reserved = [Take::new("reserved", &l, 2)];
    let reservation = CheckRequest {
        takes: &reserved,
        request_id: Some("job"),
        now: None,
    };
    assert!(store.check(reservation).await.unwrap()[0].allowed());
    let one = [Take::new("reserved", &l, 1)];
    assert!(!check(&store, &one, None).await.unwrap()[0].allowed());
    let settled = store.settle(reservation, &[1]).await.unwrap();
    assert_eq!(settled.status, tollgate::SettleStatus::Settled);
    assert!(check(&store, &one, None).await.unwrap()[0].allowed());
}

/// Without the memory (the default), every check is Redis' call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_memory_every_rejection_asks_redis() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let l = limit(1, "1/h");
    let takes = [Take::new("k", &l, 1)];
    assert!(check(&store, &takes, None).await.unwrap()[0].allowed());
    let calls = script_calls(&server);
    for _ in 0..10 {
        assert!(!check(&store, &takes, None).await.unwrap()[0].allowed());
    }
    assert_eq!(script_calls(&server), calls + 10.0);
    assert_eq!(store.rejections_answered(), 0);
}
