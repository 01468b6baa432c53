//! The Redis store's fixed and sliding windows and sliding logs against a real single-node
//! Redis that each test starts for itself: the same decisions as the memory store, exactly
//! their limit per window under concurrency on Redis' own clock, all or nothing beside token
//! buckets, refunds that never give back more than the window (or the log's entry) still
//! counts, keys that expire when they count nothing, and the keys and limits Redis cannot take
//! refused. (The random traces of `single_node.rs` and `cluster.rs` hold windows and logs too.)

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use support::{RedisServer, command};
use tollgate::{
    Carry, CheckRequest, Decision, Error, Limit, LocalStore, ManualClock, Store, Take, Timestamp,
    Unavailable,
};
use tollgate_redis::{RedisConfig, RedisStore, check_limit, script_reply};

const T0: Timestamp = Timestamp::from_nanos(1_700_000_000_000_000_000);

const SECOND: Duration = Duration::from_secs(1);
const HOUR: Duration = Duration::from_secs(3_600);

fn fixed(limit: u64, window: Duration) -> Limit {
    Limit::fixed_window(limit, window).expect("a valid window")
}

fn sliding(limit: u64, window: Duration) -> Limit {
    Limit::sliding_window(limit, window).expect("a valid window")
}

fn tokens(capacity: u64, rate: &str) -> Limit {
    Limit::new(capacity, rate.parse().expect("a rate")).expect("a valid limit")
}

/// `T0` plus `nanos`.
fn at(nanos: u64) -> Timestamp {
    Timestamp::from_nanos(T0.as_nanos() + nanos)
}

async fn connect(server: &RedisServer) -> RedisStore {
    // Decisions, not latency, are what these tests look at: a loaded 2-core machine running a
    // debug build can pass the production 20 ms timeout.
    let config = RedisConfig::default().with_timeout(Duration::from_secs(2));
    RedisStore::connect(&server.url(), config)
        .await
        .expect("connect")
}

async fn check(
    store: &impl Store,
    takes: &[Take<'_>],
    now: Option<Timestamp>,
    request_id: Option<&str>,
) -> Result<Vec<Decision>, Error> {
    store
        .check(CheckRequest {
            takes,
            request_id,
            now,
        })
        .await
}

/// Redis' `TIME` in microseconds.
fn redis_micros(server: &RedisServer) -> u64 {
    let script = "local t = redis.call('TIME') return tonumber(t[1]) * 1000000 + tonumber(t[2])";
    command(server.port, &["EVAL", script, "0"])
        .and_then(|reply| reply.trim().trim_start_matches(':').parse().ok())
        .expect("TIME")
}

/// The stored value at a bucket's key (with the store's prefix), if any.
fn stored(server: &RedisServer, key: &str) -> Option<String> {
    command(server.port, &["GET", &format!("tollgate:{key}")])
        .map(|reply| reply.trim().to_owned())
        .filter(|reply| reply != "$-1")
}

/// On Redis' clock, 64 tasks over four stores (four connections, as four processes would
/// have) take one each from one key until well past the limit: exactly the limit passes in a
/// window, for a fixed window and a sliding one (whose previous window is empty). Concurrent
/// requests on one key share script calls, so this also decides a window many times in one
/// call, reading what the requests before it wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_tasks_on_one_window_admit_exactly_its_limit() {
    let server = RedisServer::start();
    let mut stores = Vec::new();
    for _ in 0..4 {
        stores.push(Arc::new(connect(&server).await));
    }
    let window_us = u64::try_from(HOUR.as_micros()).expect("an hour");
    for limit in [fixed(300, HOUR), sliding(300, HOUR)] {
        // A round that crossed a window's edge (an hour's, so hardly ever) goes again on a
        // fresh key: its two windows may admit twice the limit between them.
        for round in 0.. {
            let key: Arc<str> = format!("hot:{}:{round}", limit.algorithm().as_str()).into();
            let before = redis_micros(&server);
            let admitted = Arc::new(AtomicU64::new(0));
            let mut tasks = Vec::new();
            for task in 0..64 {
                let store = Arc::clone(&stores[task % stores.len()]);
                let (admitted, key) = (Arc::clone(&admitted), Arc::clone(&key));
                tasks.push(tokio::spawn(async move {
                    for _ in 0..8 {
                        let takes = [Take::new(&key, &limit, 1)];
                        match check(&*store, &takes, None, None).await {
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
                task.await.expect("task");
            }
            let after = redis_micros(&server);
            if before / window_us != after / window_us && round < 3 {
                continue;
            }
            assert_eq!(admitted.load(Ordering::Relaxed), 300, "{limit}");
            let state = stored(&server, &key).expect("the window's state");
            assert_eq!(state, format!("w{}:300", before / window_us), "{limit}");
            break;
        }
    }
}

/// A window's key expires when its window frees it, on Redis' clock: at the end of its window
/// for a fixed window, of the next one for a sliding window (whose count still weighs there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn window_keys_expire_when_the_window_frees_them() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let window = Duration::from_secs(10);
    let window_ms = 10_000;
    for (limit, frees_after) in [(fixed(5, window), 1), (sliding(5, window), 2)] {
        for round in 0.. {
            let key = format!("ttl:{}:{round}", limit.algorithm().as_str());
            let before = redis_micros(&server) / 1_000;
            let takes = [Take::new(&key, &limit, 2)];
            let decision = check(&store, &takes, None, None).await.expect("decided")[0];
            let pttl = command(server.port, &["PTTL", &format!("tollgate:{key}")])
                .and_then(|reply| reply.trim().trim_start_matches(':').parse::<u64>().ok())
                .expect("a PTTL");
            let after = redis_micros(&server) / 1_000;
            if before / window_ms != after / window_ms && round < 3 {
                continue;
            }
            assert!(
                decision.allowed() && decision.remaining() == 3,
                "{decision:?}"
            );
            let frees = (before / window_ms + frees_after) * window_ms;
            // Expiry is at Redis' millisecond of the call plus the PTTL, read between these.
            assert!(
                (before + pttl).saturating_sub(2) <= frees && frees <= after + pttl + 2,
                "{limit}: expires {pttl} ms after a time in [{before}, {after}] ms, \
                 frees at {frees} ms"
            );
            // The reset reported is that same moment.
            let reset = u64::try_from(decision.reset_after().as_millis()).expect("ms");
            assert!(
                before + reset <= frees + 1 && frees <= after + reset + 1,
                "{limit}: reset {reset} ms"
            );
            let state = stored(&server, &key).expect("the window's state");
            assert_eq!(state, format!("w{}:2", before / window_ms));
            break;
        }
    }
}

/// A request mixing a token bucket with room and a window that is full is rejected whole: the
/// token bucket is charged nothing and reports its balance uncharged, the window its rejection
/// (with its exact waits), as the memory store decides them. A peek tells the same and writes
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_window_charges_nothing_on_the_token_bucket_beside_it() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let memory = LocalStore::new(ManualClock::new());
    let bucket = tokens(5, "1/m");
    // The window's wait at 999,999,137 ns: to the next window for a fixed one; for a sliding
    // one, to when the 2 of this window weigh 1 in the next (half-way through it).
    for (window, wait) in [(fixed(2, SECOND), 863), (sliding(2, SECOND), 500_000_863)] {
        let name = window.algorithm().as_str();
        let (bucket_key, window_key) = (format!("{{{name}}}:tokens"), format!("{{{name}}}:win"));
        let both = [
            Take::new(&bucket_key, &bucket, 1),
            Take::new(&window_key, &window, 1),
        ];
        // Two pass (the window is then full), two are refused, 250 ms apart.
        for step in 0..4 {
            let now = Some(at(step * 250_000_000));
            let expected = check(&memory, &both, now, None).await.expect("decided");
            let decided = check(&store, &both, now, None).await.expect("decided");
            assert_eq!(decided, expected, "{name}, step {step}");
            if step >= 2 {
                assert!(decided[0].allowed() && !decided[1].allowed(), "{decided:?}");
                assert_eq!(
                    decided[0].remaining(),
                    3,
                    "{name}: the bucket's balance, uncharged"
                );
            }
        }
        let keys = command(server.port, &["DBSIZE"]);
        let peeked = store
            .peek(CheckRequest {
                takes: &both,
                request_id: None,
                now: Some(at(999_999_137)),
            })
            .await
            .expect("a peek");
        assert!(peeked[0].allowed() && !peeked[1].allowed(), "{peeked:?}");
        assert_eq!(
            peeked[1].retry_after(),
            Some(Duration::from_nanos(wait)),
            "{name}"
        );
        assert_eq!(
            command(server.port, &["DBSIZE"]),
            keys,
            "a peek writes nothing"
        );
        // The bucket was charged twice, by the two requests that passed: three tokens left.
        let rest = [Take::new(&bucket_key, &bucket, 3)];
        let now = Some(at(SECOND_NS));
        assert!(check(&store, &rest, now, None).await.expect("decided")[0].allowed());
        assert!(!check(&store, &rest, now, None).await.expect("decided")[0].allowed());
    }
}

const SECOND_NS: u64 = 1_000_000_000;

/// One request's call of `scripts/take.lua`, written by hand as the store sends it: window
/// `figures` (kind, W in ms, N, cost, and in a refund the window charged) on `key` at `now`.
fn window_call(key: &str, mode: &str, figures: &[u64], now: Timestamp) -> redis::Cmd {
    let bytes: Vec<u8> = figures
        .iter()
        .flat_map(|&figure| (figure as f64).to_le_bytes())
        .collect();
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(include_str!("../scripts/take.lua"))
        .arg(1)
        .arg(format!("tollgate:{key}"))
        .arg(now.as_nanos() / 1_000)
        .arg(1) // one request
        .arg("w") // it holds a window, no token bucket's key repeats
        .arg("") // each request whole
        .arg(1) // of one bucket
        .arg("") // no request id
        .arg("")
        .arg(mode)
        .arg(bytes);
    cmd
}

/// Sends a call written by hand and decodes the script's reply as the store does.
async fn run(call: redis::Cmd, connection: &mut redis::aio::MultiplexedConnection) -> Vec<i64> {
    let reply: Vec<u8> = call.query_async(connection).await.expect("the script");
    script_reply(&reply).unwrap_or_else(|| panic!("not a packed reply: {reply:?}"))
}

/// A refund gives a window back only what the state still counts of the charge: from the
/// current count in the window charged, from the previous one once a sliding window has moved
/// on by one, nothing once the charged window has passed (fixed) or left the previous one
/// (sliding), and never below 0. A refund that gave back from whatever window the state holds
/// now would free requests another window admitted. A refund that names no window (tokens given
/// back with no record) gives back from the latest count that holds anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_refund_gives_back_only_what_the_window_still_counts() {
    let server = RedisServer::start();
    let client = redis::Client::open(server.url()).expect("a URL");
    let mut connection = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    let ms = 1_000_000;
    let k = T0.as_nanos() / ms / 1_000; // T0's window of a second
    let state = |key: &str| stored(&server, key).expect("a window's state");
    // (kind, N) for a fixed and a sliding window of a second.
    let (fixed_kind, sliding_kind) = ([1, 1_000, 5], [2, 1_000, 5]);
    let figures = |kind: [u64; 3], cost: u64, charged: Option<u64>| -> Vec<u64> {
        let mut figures = kind.to_vec();
        figures.push(cost);
        figures.extend(charged);
        figures
    };

    // Sliding: 2 in window k, then 1 in window k + 1 (the 2 are its previous window's now).
    let take = |cost| figures(sliding_kind, cost, None);
    run(window_call("s", "take", &take(2), T0), &mut connection).await;
    let next = at(1_000 * ms);
    run(window_call("s", "take", &take(1), next), &mut connection).await;
    assert_eq!(state("s"), format!("w{}:1:2", k + 1));
    // The refund of the first take gives back from the previous window's count...
    let refund = figures(sliding_kind, 2, Some(k));
    let reply = run(window_call("s", "refund", &refund, next), &mut connection).await;
    assert_eq!(state("s"), format!("w{}:1", k + 1));
    // ... and answers the window's standing: 4 left, (status, allowed, remaining, retry,
    // reset, window, nanos).
    assert_eq!(reply, [1, 1, 4, 0, 2_000_000, (k + 1) as i64, 0]);
    // Again: nothing left of it to give back, and nothing goes below 0 or to another count.
    run(window_call("s", "refund", &refund, next), &mut connection).await;
    assert_eq!(state("s"), format!("w{}:1", k + 1));
    // A refund of window k + 1's take gives back from its current count.
    let refund = figures(sliding_kind, 1, Some(k + 1));
    run(window_call("s", "refund", &refund, next), &mut connection).await;
    assert_eq!(state("s"), format!("w{}:0", k + 1));
    // Two windows on, a refund of window k's take finds nothing of it.
    run(window_call("s2", "take", &take(3), T0), &mut connection).await;
    run(
        window_call("s2", "take", &take(1), at(2_000 * ms)),
        &mut connection,
    )
    .await;
    let refund = figures(sliding_kind, 3, Some(k));
    run(
        window_call("s2", "refund", &refund, at(2_000 * ms)),
        &mut connection,
    )
    .await;
    assert_eq!(state("s2"), format!("w{}:1", k + 2));

    // Fixed: 4 in window k, 1 in window k + 1; the refund of window k's take gives nothing.
    let take = |cost| figures(fixed_kind, cost, None);
    run(window_call("f", "take", &take(4), T0), &mut connection).await;
    run(window_call("f", "take", &take(1), next), &mut connection).await;
    let refund = figures(fixed_kind, 4, Some(k));
    let reply = run(window_call("f", "refund", &refund, next), &mut connection).await;
    assert_eq!(state("f"), format!("w{}:1", k + 1));
    assert_eq!(
        reply[2], 4,
        "window k + 1 still counts its own take: {reply:?}"
    );
    // In the same window, it gives back.
    let refund = figures(fixed_kind, 1, Some(k + 1));
    run(window_call("f", "refund", &refund, next), &mut connection).await;
    assert_eq!(state("f"), format!("w{}:0", k + 1));
    // A refund that names no window (tokens given back with no record, `Store::give_back`)
    // gives back from the latest count that holds anything: the current one...
    run(window_call("f3", "take", &take(2), T0), &mut connection).await;
    run(window_call("f3", "refund", &take(1), T0), &mut connection).await;
    assert_eq!(state("f3"), format!("w{k}:1"));
    run(window_call("f3", "refund", &take(2), T0), &mut connection).await;
    assert_eq!(state("f3"), format!("w{k}:0"));
    // ... and, a sliding window's current count empty, its previous one.
    let unnamed = |cost| figures(sliding_kind, cost, None);
    run(window_call("s3", "take", &unnamed(3), T0), &mut connection).await;
    run(
        window_call("s3", "take", &unnamed(1), next),
        &mut connection,
    )
    .await;
    run(
        window_call("s3", "refund", &unnamed(2), next),
        &mut connection,
    )
    .await;
    assert_eq!(state("s3"), format!("w{}:0:3", k + 1));
    run(
        window_call("s3", "refund", &unnamed(2), next),
        &mut connection,
    )
    .await;
    assert_eq!(state("s3"), format!("w{}:0:1", k + 1));
}

/// A key holding something that is not a window's state (another program's string, a hash, a
/// token bucket's state) fails its own request only, in a call shared with others, and stays as
/// it was; a token bucket whose key holds a window's state fails likewise.
/// Checks `bad`'s buckets and `good`'s, one request each, all queued before the dispatcher runs
/// (one thread) so that they leave in one script call: each bad one fails alone, as a script
/// error, and each good one passes.
async fn each_fails_alone(store: &RedisStore, bad: &[(&str, &Limit)], good: &[(&str, &Limit)]) {
    let requests = bad.iter().chain(good).map(|&(key, limit)| async move {
        check(store, &[Take::new(key, limit, 1)], None, None).await
    });
    let results = futures_util::future::join_all(requests).await;
    for ((key, _), result) in bad.iter().zip(&results) {
        assert!(
            matches!(
                result,
                Err(Error::StoreUnavailable {
                    reason: Unavailable::Script
                })
            ),
            "{key}: {result:?}"
        );
    }
    for ((key, _), result) in good.iter().zip(&results[bad.len()..]) {
        assert!(
            matches!(result, Ok(d) if d[0].allowed()),
            "{key}: {result:?}"
        );
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_window_key_that_is_not_ours_fails_its_request_alone() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let set = |key: &str, value: &str| {
        let reply = command(server.port, &["SET", &format!("tollgate:{key}"), value]);
        assert_eq!(reply.as_deref().map(str::trim), Some("+OK"));
    };
    set("text", "not-a-number");
    set("bucket", "1700000000000000");
    set("negative", "w-1:2");
    set("window", "w1700000000:1");
    let hash = command(server.port, &["HSET", "tollgate:hash", "f", "1"]);
    assert_eq!(hash.as_deref().map(str::trim), Some(":1"));
    let window = sliding(10, SECOND);
    let bucket = tokens(10, "1/s");
    let bad = [
        ("text", &window),
        ("bucket", &window),
        ("negative", &window),
        ("hash", &window),
        ("window", &bucket),
    ];
    let good: Vec<String> = (0..6).map(|i| format!("good{i}")).collect();
    let good: Vec<(&str, &Limit)> = good
        .iter()
        .enumerate()
        .map(|(i, key)| (key.as_str(), if i % 2 == 0 { &window } else { &bucket }))
        .collect();
    each_fails_alone(&store, &bad, &good).await;
    assert_eq!(stored(&server, "text").as_deref(), Some("not-a-number"));
    assert_eq!(
        stored(&server, "bucket").as_deref(),
        Some("1700000000000000")
    );
    assert_eq!(stored(&server, "window").as_deref(), Some("w1700000000:1"));
}

/// A retried window check with its request id gets the first decision back, to the
/// nanosecond of the first attempt's waits, and charges nothing; the same id for a token
/// bucket of the same figures is another request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_window_check_is_charged_once() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let memory = LocalStore::new(ManualClock::new());
    for window in [fixed(5, SECOND), sliding(5, SECOND)] {
        let key = format!("retry:{}", window.algorithm().as_str());
        let takes = [Take::new(&key, &window, 3)];
        let first_at = Some(at(250_000_777));
        let first = check(&store, &takes, first_at, Some("r-1"))
            .await
            .expect("first");
        let reference = check(&memory, &takes, first_at, Some("r-1")).await;
        assert_eq!(Ok(first.clone()), reference);
        // A retry later in the window, another nanosecond past another microsecond: the
        // first decision.
        let retry = check(&store, &takes, Some(at(600_000_001)), Some("r-1")).await;
        assert_eq!(retry.as_ref(), Ok(&first), "{window}");
        // Charged once: 2 more pass in the window, then none.
        let two = [Take::new(&key, &window, 2)];
        assert!(
            check(&store, &two, Some(at(700_000_000)), None)
                .await
                .expect("decided")[0]
                .allowed()
        );
        let one = [Take::new(&key, &window, 1)];
        assert!(
            !check(&store, &one, Some(at(700_000_000)), None)
                .await
                .expect("decided")[0]
                .allowed()
        );
        // A token bucket with the same capacity and rate, under the same id: not a retry.
        // (Its key must be free of the window's state, which it cannot read.)
        command(server.port, &["DEL", &format!("tollgate:{key}")]);
        let twin = Limit::per(5, SECOND).expect("a limit");
        let takes = [Take::new(&key, &twin, 3)];
        assert_eq!(
            check(&store, &takes, first_at, Some("r-1")).await,
            Err(Error::IdempotencyConflict)
        );
    }
}

/// Windows carry nothing over (the policy engine attaches no carry to them): a window take
/// naming an old bucket, and a token bucket naming an old window, are decided as if they named
/// none. Read as a token bucket, the old window's state would fail the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_carry_nothing_over() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let (bucket, window) = (tokens(4, "1/h"), fixed(4, HOUR));
    let now = Some(T0);
    let spent = [Take::new("{c}:bucket@old", &bucket, 4)];
    assert!(check(&store, &spent, now, None).await.expect("decided")[0].allowed());
    let carry = Carry {
        key: "{c}:bucket@old",
        limit: &bucket,
        since: Duration::ZERO,
    };
    let all = [Take::new("{c}:window@new", &window, 4).carried_from(carry)];
    assert!(check(&store, &all, now, None).await.expect("decided")[0].allowed());

    let carry = Carry {
        key: "{c}:window@new",
        limit: &window,
        since: Duration::ZERO,
    };
    let all = [Take::new("{c}:bucket@new", &bucket, 4).carried_from(carry)];
    let decided = check(&store, &all, now, None).await;
    assert!(matches!(&decided, Ok(d) if d[0].allowed()), "{decided:?}");

    // Nor is an old bucket's limit looked at: one Redis could not hold refuses nothing.
    let odd = tokens(1, "9/7ns");
    let carry = Carry {
        key: "{c}:odd@old",
        limit: &odd,
        since: Duration::ZERO,
    };
    let takes = [Take::new("{c}:window@odd", &window, 1).carried_from(carry)];
    let decided = check(&store, &takes, now, None).await;
    assert!(matches!(&decided, Ok(d) if d[0].allowed()), "{decided:?}");
}

/// A window whose boundaries the script could not hold exactly (longer than 2^50
/// microseconds, about 35 years) is refused before anything reaches Redis, by
/// `check_limit` as by a check; the longest it takes is decided.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_redis_cannot_hold_are_refused_up_front() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let longest_ms = (1u64 << 50) / 1_000;
    let fine = fixed(1, SECOND);
    for too_long in [
        fixed(1, Duration::from_millis(longest_ms + 1)),
        sliding(1, Duration::from_millis(1_140_000_000_000)),
    ] {
        assert!(
            matches!(check_limit(&too_long), Err(Error::UnsupportedLimit { .. })),
            "{too_long}"
        );
        let takes = [
            Take::new("{r}:fine", &fine, 1),
            Take::new("{r}:long", &too_long, 1),
        ];
        assert!(matches!(
            check(&store, &takes, None, None).await,
            Err(Error::UnsupportedLimit { .. })
        ));
    }
    assert_eq!(command(server.port, &["DBSIZE"]).as_deref(), Some(":0\r\n"));
    let longest = sliding(2, Duration::from_millis(longest_ms));
    assert_eq!(check_limit(&longest), Ok(()));
    let takes = [Take::new("longest", &longest, 2)];
    let decided = check(&store, &takes, None, None).await.expect("decided");
    assert!(decided[0].allowed(), "{decided:?}");
}

fn log(limit: u64, window: Duration) -> Limit {
    Limit::sliding_log(limit, window).expect("a valid log")
}

/// A connection of the test's own, for reading a log's binary elements.
async fn raw(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url())
        .expect("a URL")
        .get_multiplexed_async_connection()
        .await
        .expect("connect")
}

/// A log as Redis holds it at a bucket's key (see `scripts/take.lua`): its header's total,
/// older entries' count, latest millisecond and latest cost, then the older entries
/// (millisecond, cost); `None` when the key is absent.
type StoredLog = ([u64; 4], Vec<(u64, u64)>);

async fn stored_log(
    connection: &mut redis::aio::MultiplexedConnection,
    key: &str,
) -> Option<StoredLog> {
    let elements: Vec<Vec<u8>> = redis::cmd("LRANGE")
        .arg(format!("tollgate:{key}"))
        .arg(0)
        .arg(-1)
        .query_async(connection)
        .await
        .expect("a list");
    let doubles = |bytes: &[u8]| -> Vec<u64> {
        bytes
            .chunks_exact(8)
            .map(|chunk| f64::from_le_bytes(chunk.try_into().expect("8 bytes")) as u64)
            .collect()
    };
    let (header, entries) = elements.split_first()?;
    assert_eq!(&header[..4], b"tlog", "{header:?}");
    let header: [u64; 4] = doubles(&header[4..]).try_into().expect("four figures");
    let entries = entries
        .iter()
        .map(|entry| match doubles(entry)[..] {
            [ms, cost] => (ms, cost),
            _ => panic!("an entry of two figures: {entry:?}"),
        })
        .collect();
    Some((header, entries))
}

/// `T0`'s millisecond plus `ms`.
fn ms_at(ms: u64) -> u64 {
    T0.as_nanos() / 1_000_000 + ms
}

/// A log admits at most N in every window of W that ends at any millisecond, and, asked every
/// millisecond, exactly N: where a fixed window lets a burst of twice its limit through across
/// its edge, the log keeps it out, and says to the nanosecond when to come back. Every decision
/// is the memory store's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_admits_exactly_its_limit_in_any_window_and_no_burst_at_an_edge() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let memory = LocalStore::new(ManualClock::new());
    let ms = 1_000_000;

    // Four each at 996..999 ms and 1000..1003 ms, 137 ns past each: the fixed window's edge at
    // 1 s lets all eight through; the log only the first four.
    let (edge_log, edge_fixed) = (log(4, SECOND), fixed(4, SECOND));
    let mut admitted = (0, 0);
    for step in 0..8 {
        let now = Some(at((996 + step) * ms + 137));
        let takes = [
            Take::new("edge:log", &edge_log, 1),
            Take::new("edge:fixed", &edge_fixed, 1),
        ];
        let (mut logged, mut fixed_) = (Vec::new(), Vec::new());
        for (take, decided) in takes.iter().zip([&mut logged, &mut fixed_]) {
            let one = std::slice::from_ref(take);
            *decided = check(&store, one, now, None).await.expect("decided");
            assert_eq!(Ok(decided.clone()), check(&memory, one, now, None).await);
        }
        admitted.0 += u64::from(logged[0].allowed());
        admitted.1 += u64::from(fixed_[0].allowed());
        if step == 4 {
            // The four of 996..999 ms count until 1996..1999 ms: one is needed, the first.
            assert_eq!(
                logged[0].retry_after(),
                Some(Duration::from_nanos(996 * ms - 137)),
                "{logged:?}"
            );
            assert_eq!(
                logged[0].reset_after(),
                Duration::from_nanos(999 * ms - 137)
            );
        }
    }
    assert_eq!(admitted, (4, 8), "(log, fixed window) across the edge");
    let one = [Take::new("edge:log", &edge_log, 1)];
    let before = check(&store, &one, Some(at(1_996 * ms - 1)), None).await;
    let before = before.expect("decided");
    assert!(!before[0].allowed());
    assert_eq!(before[0].retry_after(), Some(Duration::from_nanos(1)));
    let on_time = check(&store, &one, Some(at(1_996 * ms)), None).await;
    assert!(on_time.expect("decided")[0].allowed());

    // Asked every millisecond for a second, 5 per 100 ms: exactly 5 in every window of 100 ms
    // that ends at any millisecond, once the first has passed.
    let steady = log(5, Duration::from_millis(100));
    let takes = [Take::new("steady", &steady, 1)];
    let mut allowed = Vec::new();
    for t in 0..1_000 {
        let now = Some(at(10 * SECOND_NS + t * ms));
        let decided = check(&store, &takes, now, None).await.expect("decided");
        assert_eq!(
            Ok(decided.clone()),
            check(&memory, &takes, now, None).await,
            "{t} ms"
        );
        allowed.push(decided[0].allowed());
    }
    for end in 99..1_000 {
        let in_window = allowed[end - 99..=end].iter().filter(|&&a| a).count();
        assert_eq!(in_window, 5, "the 100 ms ending at {end} ms");
    }
}

/// A log lives in its key, not in the script: flushed scripts are loaded again, and the log
/// decides on as if nothing happened, as the memory store does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_survives_script_flush() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let memory = LocalStore::new(ManualClock::new());
    let limit = log(3, HOUR);
    let takes = [Take::new("flushed", &limit, 1)];
    for step in 0..6 {
        if step == 2 || step == 4 {
            assert_eq!(
                command(server.port, &["SCRIPT", "FLUSH"]).as_deref(),
                Some("+OK\r\n")
            );
        }
        let now = Some(at(step * 1_000_000));
        let decided = check(&store, &takes, now, None).await.expect("decided");
        assert_eq!(Ok(decided.clone()), check(&memory, &takes, now, None).await);
        assert_eq!(decided[0].allowed(), step < 3, "step {step}");
    }
    let mut connection = raw(&server).await;
    let held = stored_log(&mut connection, "flushed").await;
    assert_eq!(
        held,
        Some(([3, 2, ms_at(2), 1], vec![(ms_at(0), 1), (ms_at(1), 1)]))
    );
}

/// A key holding something that is not a log (a string, a window's or a token bucket's state,
/// another program's list, a hash, a list whose first element only looks like a header) fails
/// its own request only, in a call shared with others, and stays as it was; a window or a
/// token bucket whose key holds a log fails likewise.
#[tokio::test(flavor = "current_thread")]
async fn a_log_key_that_is_not_ours_is_reported_not_overwritten() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let mut connection = raw(&server).await;
    let ok = |reply: Option<String>| {
        let reply = reply.expect("a reply");
        assert!(reply.starts_with('+') || reply.starts_with(':'), "{reply}");
    };
    ok(command(server.port, &["SET", "tollgate:text", "hello"]));
    ok(command(
        server.port,
        &["SET", "tollgate:window", "w1700000000:1"],
    ));
    ok(command(
        server.port,
        &["SET", "tollgate:bucket", "1700000000000000"],
    ));
    ok(command(server.port, &["RPUSH", "tollgate:list", "a", "b"]));
    ok(command(server.port, &["HSET", "tollgate:hash", "f", "1"]));
    ok(command(
        server.port,
        &["RPUSH", "tollgate:lookalike", "tlog-not-a-header"],
    ));
    let limit = log(10, SECOND);
    let (window, bucket) = (sliding(10, SECOND), tokens(10, "1/s"));
    // A log of ours, which the window and the token bucket below find.
    let made = [Take::new("logged", &limit, 1)];
    assert!(check(&store, &made, None, None).await.expect("decided")[0].allowed());
    let before = stored_log(&mut connection, "logged").await;
    let bad: [(&str, &Limit); 8] = [
        ("text", &limit),
        ("window", &limit),
        ("bucket", &limit),
        ("list", &limit),
        ("hash", &limit),
        ("lookalike", &limit),
        ("logged", &window),
        ("logged", &bucket),
    ];
    let good: Vec<String> = (0..4).map(|i| format!("good{i}")).collect();
    let good: Vec<(&str, &Limit)> = good.iter().map(|key| (key.as_str(), &limit)).collect();
    each_fails_alone(&store, &bad, &good).await;
    assert_eq!(stored(&server, "text").as_deref(), Some("hello"));
    assert_eq!(stored(&server, "window").as_deref(), Some("w1700000000:1"));
    assert_eq!(
        stored(&server, "bucket").as_deref(),
        Some("1700000000000000")
    );
    let list: Vec<String> = redis::cmd("LRANGE")
        .arg("tollgate:list")
        .arg(0)
        .arg(-1)
        .query_async(&mut connection)
        .await
        .expect("a list");
    assert_eq!(list, ["a", "b"]);
    let lookalike: Vec<String> = redis::cmd("LRANGE")
        .arg("tollgate:lookalike")
        .arg(0)
        .arg(-1)
        .query_async(&mut connection)
        .await
        .expect("a list");
    assert_eq!(lookalike, ["tlog-not-a-header"]);
    assert_eq!(stored_log(&mut connection, "logged").await, before);
}

/// Milliseconds until the key expires (`PTTL`).
fn pttl(server: &RedisServer, key: &str) -> u64 {
    command(server.port, &["PTTL", &format!("tollgate:{key}")])
        .and_then(|reply| reply.trim().trim_start_matches(':').parse::<u64>().ok())
        .expect("a PTTL")
}

/// A log's key expires when the log counts nothing: its latest entry's millisecond plus the
/// window, on Redis' clock the moment the decision reports as its reset; on a caller's time,
/// after at least a minute, as the other kinds; a request from an earlier clock, charged to
/// the latest entry, moves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_key_expires_when_the_log_counts_nothing() {
    let server = RedisServer::start();
    let store = connect(&server).await;
    let limit = log(5, Duration::from_secs(10));
    let takes = [Take::new("ttl", &limit, 2)];
    let before = redis_micros(&server) / 1_000;
    let decided = check(&store, &takes, None, None).await.expect("decided")[0];
    let left = pttl(&server, "ttl");
    let after = redis_micros(&server) / 1_000;
    assert!(decided.allowed() && decided.remaining() == 3, "{decided:?}");
    // Charged at a millisecond p in [before, after], counting until p + 10 s; the key expires
    // `left` ms after a moment in [before, after] too.
    let reset = u64::try_from(decided.reset_after().as_millis()).expect("ms");
    assert!(
        (9_999..=10_000).contains(&reset),
        "reset {reset} ms: to the end of the charge's millisecond's window"
    );
    assert!(
        before + left <= after + 10_000 && before + 10_000 <= after + left + 1,
        "expires {left} ms after a time in [{before}, {after}] ms"
    );

    // On a caller's time: the log's end on that timeline, or a minute, whichever is later.
    let hour = log(5, HOUR);
    let takes = [Take::new("caller", &hour, 1)];
    let hour_ms = 3_600_000;
    check(&store, &takes, Some(at(30 * SECOND_NS)), None)
        .await
        .expect("decided");
    let left = pttl(&server, "caller");
    assert!(hour_ms - 1_000 < left && left <= hour_ms, "{left}");
    // From 30 s earlier: charged to the entry of 30 s, which still ends an hour after it.
    let decided = check(&store, &takes, Some(T0), None)
        .await
        .expect("decided")[0];
    assert!(decided.allowed());
    assert_eq!(decided.reset_after(), HOUR + Duration::from_secs(30));
    let left = pttl(&server, "caller");
    assert!(
        hour_ms + 30_000 - 1_000 < left && left <= hour_ms + 30_000,
        "{left}"
    );
    let mut connection = raw(&server).await;
    assert_eq!(
        stored_log(&mut connection, "caller").await,
        Some(([2, 0, ms_at(30_000), 2], Vec::new()))
    );
    let short = log(5, Duration::from_millis(10));
    let takes = [Take::new("short", &short, 1)];
    check(&store, &takes, Some(T0), None)
        .await
        .expect("decided");
    let left = pttl(&server, "short");
    assert!(59_000 < left && left <= 60_000, "at least a minute: {left}");
}

/// One request's call of `scripts/take.lua` on a log, written by hand as the store sends it:
/// (W in ms, N, cost, and in a refund the millisecond charged) on `key` at `now`.
fn log_call(key: &str, mode: &str, figures: &[u64], now: Timestamp) -> redis::Cmd {
    let mut all = vec![3];
    all.extend(figures);
    window_call(key, mode, &all, now)
}

/// A refund gives a log back only what the entry its take charged still holds: an older entry
/// emptied is removed, the latest stays at 0 (it still marks the latest time seen), never below
/// 0, and nothing once the entry has been dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_refund_gives_back_from_the_entry_charged() {
    let server = RedisServer::start();
    let mut connection = raw(&server).await;
    let ms = 1_000_000;
    let (w, n) = (1_000, 5);
    let take = |cost: u64| vec![w, n, cost];
    let refund = |cost: u64, charged: u64| vec![w, n, cost, charged];
    // 2 at 0 ms, 1 at 100 ms: the take's reply names the millisecond charged.
    let first = run(log_call("r", "take", &take(2), T0), &mut connection).await;
    assert_eq!(first[5], ms_at(0) as i64, "{first:?}");
    run(
        log_call("r", "take", &take(1), at(100 * ms)),
        &mut connection,
    )
    .await;
    assert_eq!(
        stored_log(&mut connection, "r").await,
        Some(([3, 1, ms_at(100), 1], vec![(ms_at(0), 2)]))
    );
    // Give back 1 of 0 ms's 2, then more than it holds: emptied and removed.
    let now = at(200 * ms);
    let reply = run(
        log_call("r", "refund", &refund(1, ms_at(0)), now),
        &mut connection,
    )
    .await;
    // (status, allowed, remaining, retry, reset, p, nanos): 3 left, counting until 1100 ms.
    assert_eq!(reply, [1, 1, 3, 0, 900_000, ms_at(200) as i64, 0]);
    run(
        log_call("r", "refund", &refund(5, ms_at(0)), now),
        &mut connection,
    )
    .await;
    assert_eq!(
        stored_log(&mut connection, "r").await,
        Some(([1, 0, ms_at(100), 1], Vec::new()))
    );
    // The latest entry, emptied, stays: a request from before it is still decided at 100 ms.
    run(
        log_call("r", "refund", &refund(3, ms_at(100)), now),
        &mut connection,
    )
    .await;
    assert_eq!(
        stored_log(&mut connection, "r").await,
        Some(([0, 0, ms_at(100), 0], Vec::new()))
    );
    let early = run(log_call("r", "take", &take(1), T0), &mut connection).await;
    assert_eq!(early[5], ms_at(100) as i64, "{early:?}");
    // Once the entry charged has stopped counting and been dropped, nothing comes back.
    run(log_call("d", "take", &take(5), T0), &mut connection).await;
    run(
        log_call("d", "take", &take(5), at(2_000 * ms)),
        &mut connection,
    )
    .await;
    run(
        log_call("d", "refund", &refund(5, ms_at(0)), at(2_000 * ms)),
        &mut connection,
    )
    .await;
    assert_eq!(
        stored_log(&mut connection, "d").await,
        Some(([5, 0, ms_at(2_000), 5], Vec::new()))
    );
}

/// On Redis' clock, 64 tasks over four stores take one each from one log until well past its
/// limit: exactly the limit passes, however the requests share script calls (a call decides
/// the log many times, each reading what the requests before it wrote).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_tasks_on_one_log_admit_exactly_its_limit() {
    let server = RedisServer::start();
    let mut stores = Vec::new();
    for _ in 0..4 {
        stores.push(Arc::new(connect(&server).await));
    }
    let limit = log(300, HOUR);
    let admitted = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for task in 0..64 {
        let store = Arc::clone(&stores[task % stores.len()]);
        let admitted = Arc::clone(&admitted);
        tasks.push(tokio::spawn(async move {
            for _ in 0..8 {
                let takes = [Take::new("hot-log", &limit, 1)];
                match check(&*store, &takes, None, None).await {
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
        task.await.expect("task");
    }
    assert_eq!(admitted.load(Ordering::Relaxed), 300);
    let mut connection = raw(&server).await;
    let (header, entries) = stored_log(&mut connection, "hot-log").await.expect("a log");
    assert_eq!(header[0], 300, "{header:?}");
    assert_eq!(header[1] as usize, entries.len());
    let sum: u64 = entries.iter().map(|&(_, cost)| cost).sum::<u64>() + header[3];
    assert_eq!(sum, 300);
    assert!(entries.windows(2).all(|pair| pair[0].0 < pair[1].0));
}

/// Logs need only their lists' commands beside the buckets' (`support::LOG_COMMANDS`): a
/// user with just those takes, rejects, peeks and settles them. Without them, a log's request
/// fails as a key that is not ours would, and writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_least_privileged_user_keeps_logs() {
    let server = RedisServer::start();
    support::grant_tollgate_user(server.port, &[]);
    let config = RedisConfig::default().with_timeout(Duration::from_secs(2));
    let url = support::as_tollgate_user(&server.url());
    let store = RedisStore::connect(&url, config.clone())
        .await
        .expect("connect as tollgate");
    let limit = log(2, HOUR);
    let takes = [Take::new("acl", &limit, 2)];
    let refused = check(&store, &takes, Some(T0), None).await;
    assert!(
        matches!(
            refused,
            Err(Error::StoreUnavailable {
                reason: Unavailable::Script
            })
        ),
        "{refused:?}"
    );
    assert_eq!(command(server.port, &["DBSIZE"]).as_deref(), Some(":0\r\n"));

    support::grant_tollgate_user(server.port, support::LOG_COMMANDS);
    let store = RedisStore::connect(&url, config)
        .await
        .expect("connect as tollgate");
    let first = check(&store, &takes, Some(T0), Some("acl-1")).await;
    assert!(first.expect("decided")[0].allowed());
    let one = [Take::new("acl", &limit, 1)];
    let peeked = store
        .peek(CheckRequest {
            takes: &one,
            request_id: None,
            now: Some(T0),
        })
        .await
        .expect("a peek");
    assert!(!peeked[0].allowed());
    let settled = store
        .settle(
            CheckRequest {
                takes: &takes,
                request_id: Some("acl-1"),
                now: Some(T0),
            },
            &[1],
        )
        .await
        .expect("settled");
    assert_eq!(settled.decisions[0].remaining(), 1);
    assert!(check(&store, &one, Some(T0), None).await.expect("decided")[0].allowed());
    assert!(!check(&store, &one, Some(T0), None).await.expect("decided")[0].allowed());
}
