//! The Redis store against a real three-master Redis Cluster that the tests start themselves.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use redis::cluster_routing::Slot;
use std::time::Duration;
use support::{RedisCluster, command, info_field, take_one_unit};
use tollgate::testkit::{Trace, compare_with_memory};

use tollgate::{
    Algorithm, Carry, CheckRequest, Decision, Error, Limit, Store, Take, Timestamp, Unavailable,
};
use tollgate_redis::{ConnectError, RedisConfig, RedisStore};
use tollgate_redis::{request_fingerprint, script_reply};

/// The timeout of the stress test's stores: 64 tasks on a busy 2-core machine, in a debug
/// build, can take longer than the production default of 20 ms.
const LOADED: std::time::Duration = std::time::Duration::from_secs(2);

const T0: Timestamp = Timestamp::from_nanos(1_700_000_000_000_000_000);

fn limit(capacity: u64, rate: &str) -> Limit {
    Limit::new(capacity, rate.parse().unwrap()).unwrap()
}

async fn check(store: &RedisStore, takes: &[Take<'_>]) -> Vec<Decision> {
    store
        .check(CheckRequest {
            takes,
            request_id: None,
            now: Some(T0),
        })
        .await
        .expect("decided")
}

/// One cluster for every test in this binary: starting one takes seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster() {
    let mut cluster = RedisCluster::start();
    let url = cluster.url();
    let store = RedisStore::connect(&url, RedisConfig::default())
        .await
        .expect("connect to the cluster");
    assert!(store.is_cluster());

    // Decisions, not latency, are compared here: a loaded 2-core machine running a debug build
    // can pass the production 20 ms timeout, which would fail the comparison for nothing.
    let patient = RedisStore::connect(&url, RedisConfig::default().with_timeout(LOADED))
        .await
        .expect("connect to the cluster");
    conforms_with_and_without_hash_tags(&patient).await;
    cross_slot_rejection_charges_nothing(&patient).await;
    a_conflict_across_slots_charges_nothing(&patient).await;
    a_full_window_charges_nothing_beside_it_in_its_slot(&patient).await;
    a_window_charged_across_slots_is_refunded(&patient).await;
    a_changed_limit_carries_over_within_its_slot(&patient).await;
    a_late_cross_slot_refund_never_over_admits_a_retried_request(&url).await;
    a_refund_sent_twice_gives_back_once(&url).await;
    sixty_four_tasks_on_one_key(&url).await;
    a_master_killed_then_restarted(&mut cluster, &store).await;
    a_cluster_silent_at_the_start_is_joined_when_it_answers(&cluster).await;
    a_least_privilege_acl_user_suffices(&cluster).await;
}

/// The least a Redis user needs on every node of a cluster to be tollgate's, as the README
/// gives it: the single node's commands, the cluster's layout (`CLUSTER SLOTS`) and `ASKING`
/// (for a slot being moved). A cross-slot request that one slot rejects is refunded under it.
async fn a_least_privilege_acl_user_suffices(cluster: &RedisCluster) {
    for node in &cluster.nodes {
        support::grant_tollgate_user(node.port, support::CLUSTER_COMMANDS);
    }
    let url = support::as_tollgate_user(&cluster.url());
    let store = RedisStore::connect(&url, RedisConfig::default().with_timeout(LOADED))
        .await
        .expect("connect as tollgate");
    assert_eq!(store.ping().await, Ok(()));
    let (roomy, tight) = (limit(10, "1/h"), limit(1, "1/h"));
    let user = [Take::new("{acl-user}", &roomy, 1)];
    assert_eq!(check(&store, &user).await[0].remaining(), 9);
    let tenant = [Take::new("{acl-tenant}", &tight, 1)];
    assert!(check(&store, &tenant).await[0].allowed());
    // Two slots; the tenant's rejects, so the user's charge is given back.
    let both = [user[0], tenant[0]];
    assert!(!check(&store, &both).await[1].allowed());
    assert_eq!(check(&store, &user).await[0].remaining(), 8, "refunded");
}

async fn conforms_with_and_without_hash_tags(store: &RedisStore) {
    for seed in 1..=4 {
        // With per-subject hash tags every request is one slot, one atomic script.
        let tagged = Trace::new(seed, 300, format!("tagged-{seed}"));
        // Without them the buckets of one request spread over slots (and nodes): charged in
        // parallel, refunded when one slot rejects. Sequentially, the same decisions, as long
        // as time does not go back: a refund gives the charge back but cannot put the bucket
        // back as it was (a token bucket stays as full as at the charge's time, a window's
        // state in the window charged), which a request from an earlier time would then see
        // (see `Trace::steps_back`).
        let untagged = Trace::new(seed, 300, format!("untagged-{seed}"))
            .hash_tags(false)
            .steps_back(false);
        // Logs alone, whose keys then meet while they count (see `Trace::only`): charged,
        // rejected, refunded across slots and settled while their entries still count.
        let mut logs =
            Trace::new(seed, 300, format!("logs-tagged-{seed}")).only(Algorithm::SlidingLog);
        let mut logs_untagged = Trace::new(seed, 300, format!("logs-untagged-{seed}"))
            .only(Algorithm::SlidingLog)
            .hash_tags(false)
            .steps_back(false);
        logs.subjects = 1;
        logs_untagged.subjects = 1;
        for trace in [tagged, untagged, logs, logs_untagged] {
            // Resets among the requests, each key deleted on its own master; tokens given back
            // in each slot on its own.
            let trace = trace.resets(true).gives_back(true);
            if let Err(mismatch) = compare_with_memory(store, &trace).await {
                panic!("{mismatch}");
            }
        }
    }
}

async fn cross_slot_rejection_charges_nothing(store: &RedisStore) {
    let user = limit(5, "1/m");
    let tenant = limit(1, "1/m");
    let (user_key, tenant_key) = ("xs:user:alice", "xs:tenant:acme");
    assert_ne!(
        Slot::for_key(format!("tollgate:{user_key}")),
        Slot::for_key(format!("tollgate:{tenant_key}")),
        "the keys must live in different slots for this test"
    );
    let both = [
        Take::new(user_key, &user, 1),
        Take::new(tenant_key, &tenant, 1),
    ];
    assert!(check(store, &both).await.iter().all(Decision::allowed));
    for _ in 0..3 {
        let decisions = check(store, &both).await;
        assert!(decisions[0].allowed() && !decisions[1].allowed());
        assert_eq!(decisions[0].remaining(), 4, "charged, then refunded");
    }
    let rest = [Take::new(user_key, &user, 4)];
    assert!(
        check(store, &rest).await[0].allowed(),
        "the user was charged once"
    );
    let more = [Take::new(user_key, &user, 1)];
    assert!(!check(store, &more).await[0].allowed());
}

/// A request whose id one slot has seen on another request (a conflict) while another slot,
/// new to it, charged: that charge is given back, and the request fails as a conflict.
async fn a_conflict_across_slots_charges_nothing(store: &RedisStore) {
    let l = limit(5, "1/h");
    let (seen, new) = ("{conflict-seen}k", "{conflict-new}k");
    assert_ne!(Slot::for_key(seen), Slot::for_key(new));
    let request = |takes| CheckRequest {
        takes,
        request_id: Some("c-1"),
        now: Some(T0),
    };
    let first = [Take::new(seen, &l, 1)];
    let decided = store.check(request(&first)).await.expect("decided");
    assert_eq!(decided[0].remaining(), 4);
    let both = [Take::new(seen, &l, 1), Take::new(new, &l, 1)];
    assert_eq!(
        store.check(request(&both)).await,
        Err(Error::IdempotencyConflict)
    );
    let alone = [Take::new(new, &l, 1)];
    assert_eq!(check(store, &alone).await[0].remaining(), 4, "refunded");
}

fn windows(limit: u64, window: Duration) -> [Limit; 2] {
    [
        Limit::fixed_window(limit, window).expect("a valid window"),
        Limit::sliding_window(limit, window).expect("a valid window"),
    ]
}

/// A token bucket with room beside a full window in one slot: one script decides both, and the
/// rejection charges the token bucket nothing.
async fn a_full_window_charges_nothing_beside_it_in_its_slot(store: &RedisStore) {
    let bucket = limit(5, "1/m");
    for window in windows(1, Duration::from_secs(3_600)) {
        let name = window.algorithm().as_str();
        let (bucket_key, window_key) =
            (format!("{{mx-{name}}}:tokens"), format!("{{mx-{name}}}:w"));
        let both = [
            Take::new(&bucket_key, &bucket, 1),
            Take::new(&window_key, &window, 1),
        ];
        assert!(check(store, &both).await.iter().all(Decision::allowed));
        for _ in 0..3 {
            let decisions = check(store, &both).await;
            assert!(
                decisions[0].allowed() && !decisions[1].allowed(),
                "{decisions:?}"
            );
            assert_eq!(
                decisions[0].remaining(),
                4,
                "{name}: the bucket's balance, uncharged"
            );
        }
        let rest = [Take::new(&bucket_key, &bucket, 4)];
        assert!(
            check(store, &rest).await[0].allowed(),
            "{name}: charged once"
        );
        let more = [Take::new(&bucket_key, &bucket, 1)];
        assert!(!check(store, &more).await[0].allowed(), "{name}");
    }
}

/// A window charged in one slot while another slot rejects is refunded: its count is as if the
/// request never came, and it reports its standing uncharged, as the memory store (which
/// decides the whole request in one step) reports it.
async fn a_window_charged_across_slots_is_refunded(store: &RedisStore) {
    let tenant = limit(1, "1/h");
    for window in windows(3, Duration::from_secs(3_600)) {
        let name = window.algorithm().as_str();
        let window_key = format!("xw:{name}:user");
        let slot = |key: &str| Slot::for_key(format!("tollgate:{key}"));
        let tenant_key = (0..)
            .map(|i| format!("xw:{name}:tenant{i}"))
            .find(|key| slot(key) != slot(&window_key))
            .expect("a key in another slot");
        let memory = tollgate::LocalStore::new(tollgate::ManualClock::new());
        let request = |takes| CheckRequest {
            takes,
            request_id: None,
            now: Some(T0),
        };
        // The tenant's one token goes first: the requests over both slots are then refused.
        let alone = [Take::new(&tenant_key, &tenant, 1)];
        assert!(check(store, &alone).await[0].allowed());
        memory.check_now(request(&alone)).expect("decided");
        let both = [
            Take::new(&window_key, &window, 1),
            Take::new(&tenant_key, &tenant, 1),
        ];
        for _ in 0..3 {
            let decisions = check(store, &both).await;
            assert!(
                decisions[0].allowed() && !decisions[1].allowed(),
                "{decisions:?}"
            );
            assert_eq!(
                decisions[0].remaining(),
                3,
                "{name}: charged, then refunded"
            );
            assert_eq!(Ok(decisions), memory.check_now(request(&both)), "{name}");
        }
        let three = [Take::new(&window_key, &window, 3)];
        assert!(
            check(store, &three).await[0].allowed(),
            "{name}: nothing counted"
        );
        let more = [Take::new(&window_key, &window, 1)];
        assert!(!check(store, &more).await[0].allowed(), "{name}");
    }
}

async fn a_changed_limit_carries_over_within_its_slot(store: &RedisStore) {
    let (old, new) = (limit(10, "1/h"), limit(20, "1/h"));
    // Spent under the old limit: 1 token left, carried into the new bucket of the same subject.
    let spent = [Take::new("carry|{bo}@old", &old, 9)];
    assert!(check(store, &spent).await[0].allowed());
    let carry = Carry {
        key: "carry|{bo}@old",
        limit: &old,
        since: Duration::ZERO,
    };
    let two = [Take::new("carry|{bo}@new", &new, 2).carried_from(carry)];
    assert!(
        !check(store, &two).await[0].allowed(),
        "1 token carried over"
    );
    let one = [Take::new("carry|{bo}@new", &new, 1).carried_from(carry)];
    assert!(check(store, &one).await[0].allowed());

    // An old key in another slot cannot be read in the same atomic script: it is not read.
    let (old_key, new_key) = ("carry:old:cy", "carry:new:cy");
    assert_ne!(
        Slot::for_key(format!("tollgate:{old_key}")),
        Slot::for_key(format!("tollgate:{new_key}")),
        "the keys must live in different slots for this test"
    );
    let spent = [Take::new(old_key, &old, 10)];
    assert!(check(store, &spent).await[0].allowed());
    let carry = Carry {
        key: old_key,
        limit: &old,
        since: Duration::ZERO,
    };
    let twenty = [Take::new(new_key, &new, 20).carried_from(carry)];
    assert!(check(store, &twenty).await[0].allowed());
}

async fn sixty_four_tasks_on_one_key(url: &str) {
    let mut stores = Vec::new();
    for _ in 0..4 {
        stores.push(Arc::new(
            // A timeout here would only hide a charge from the count: wait as long as it takes.
            RedisStore::connect(url, RedisConfig::default().with_timeout(LOADED))
                .await
                .expect("connect"),
        ));
    }
    let limit = limit(500, "1/h");
    let admitted = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for task in 0..64 {
        let store = stores[task % stores.len()].clone();
        let admitted = admitted.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..20 {
                let takes = [Take::new("{hot}:key", &limit, 1)];
                if check(&store, &takes).await[0].allowed() {
                    admitted.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }
    assert_eq!(admitted.load(Ordering::Relaxed), 500);
}

/// A master dies (its slots, then the whole cluster, stop answering), then comes back empty:
/// the store fails fast and distinguishably meanwhile, and decides on every master again once
/// the cluster is whole, on connections it opened anew.
async fn a_master_killed_then_restarted(cluster: &mut RedisCluster, store: &RedisStore) {
    let limit = limit(1_000, "1/s");
    // One key in each master's third of the slots, as `redis-cli --cluster create` deals them.
    let port = cluster.nodes[0].port;
    let slot = |key: &str| -> u32 {
        command(port, &["CLUSTER", "KEYSLOT", key])
            .and_then(|reply| reply.trim().trim_start_matches(':').parse().ok())
            .expect("a slot")
    };
    let keys: Vec<String> = (0..3)
        .map(|third| {
            (0..)
                .map(|n| format!("{{failover-{n}}}"))
                .find(|key| slot(key) / 5462 == third)
                .expect("a key in every third")
        })
        .collect();
    let attempt = |key: &str| {
        let key = key.to_owned();
        async move { take_one_unit(store, &key, &limit, Some(T0)).await }
    };
    for key in &keys {
        assert!(attempt(key).await.is_ok());
    }

    cluster.nodes[0].kill();
    // A request over a live master's slot and the dead one's is not admitted, and the live
    // slot's charge is given back: its bucket does not pay for the outage.
    let both = [
        Take::new(&keys[1], &limit, 1),
        Take::new(&keys[0], &limit, 1),
    ];
    let outcome = store
        .check(CheckRequest {
            takes: &both,
            request_id: None,
            now: Some(T0),
        })
        .await;
    assert!(
        matches!(outcome, Err(Error::StoreUnavailable { .. })),
        "{outcome:?}"
    );
    let after = take_one_unit(store, &keys[1], &limit, Some(T0)).await;
    assert_eq!(
        after.map(|decisions| decisions[0].remaining()).ok(),
        Some(998),
        "one unit taken before, one now: the failed request's was refunded"
    );
    for _ in 0..10 {
        let outcome = tokio::time::timeout(std::time::Duration::from_secs(1), attempt(&keys[0]))
            .await
            .expect("a failure within the timeout, not a hang");
        assert!(
            matches!(outcome, Err(Error::StoreUnavailable { .. })),
            "{outcome:?}"
        );
    }
    // The dead master's failures opened a circuit breaker, but only for its slots: the other
    // masters' keys are decided as before, not failed fast with it.
    for key in &keys[1..] {
        let outcome = attempt(key).await;
        assert!(outcome.is_ok(), "{key} on a live master: {outcome:?}");
    }
    assert!(store.is_degraded(), "the dead master's slots fail fast");
    // Only breakers of its third of the slots (43 ranges of 128) can be open.
    let open = store.open_breakers();
    assert!((1..=43).contains(&open), "{open} breakers open");
    // Ready: the store reaches the cluster. A master down is every process's problem alike,
    // and taking them all out of service would not bring it back.
    assert_eq!(store.ping().await, Ok(()));

    // Traffic over the dead master's slots (dozens of breakers' first failures and probes)
    // must not make the live masters accept connection after connection: following each call's
    // `MOVED` through the cluster client, and sending calls again after a dropped connection,
    // made it reconnect to every node it was first given, once per call (263 connections to
    // this master in these 2 s, in a build that did).
    let received = || {
        command(cluster.nodes[1].port, &["INFO", "stats"]).map_or(0.0, |info| {
            info_field(
                &info,
                "total_connections_received",
                "total_connections_received",
            )
        })
    };
    let live = cluster.nodes[1].port;
    let dead_keys: Vec<String> = (0..)
        .map(|n| format!("{{dead-{n}}}"))
        .filter(|key| {
            command(live, &["CLUSTER", "KEYSLOT", key])
                .and_then(|reply| reply.trim().trim_start_matches(':').parse::<u32>().ok())
                .is_some_and(|slot| slot / 5462 == 0)
        })
        .take(40)
        .collect();
    let before = received();
    let started = tokio::time::Instant::now();
    while started.elapsed() < std::time::Duration::from_secs(2) {
        for key in &dead_keys {
            let _ = attempt(key).await;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // The second count's own connection is among them.
    let made = received() - before;
    assert!(made <= 8.0, "{made} connections to a live master in 2 s");

    // Once the cluster has marked the master failed, a cluster that needs every slot covered
    // (Redis' default) refuses every key; this one does not (`cluster-require-full-coverage
    // no`, as the README advises), and the live masters' keys are still decided, their
    // breakers closed.
    for node in &cluster.nodes[1..] {
        let reply = command(
            node.port,
            &["CONFIG", "SET", "cluster-require-full-coverage", "no"],
        );
        assert_eq!(reply.as_deref(), Some("+OK\r\n"));
    }
    let dead_id = command(live, &["CLUSTER", "NODES"])
        .and_then(|nodes| {
            nodes
                .lines()
                .find(|line| line.contains(&format!(":{port}@")))
                .and_then(|line| line.split(' ').next().map(str::to_owned))
        })
        .expect("the dead master's id");
    let marked_failed = async {
        while !command(live, &["CLUSTER", "NODES"]).is_some_and(|nodes| {
            nodes.lines().any(|line| {
                line.starts_with(&dead_id) && line.contains(",fail") && !line.contains("fail?")
            })
        }) {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(20), marked_failed)
        .await
        .expect("the cluster marks the dead master failed");
    for key in &keys[1..] {
        let outcome = attempt(key).await;
        assert!(
            outcome.is_ok(),
            "{key} after the master was marked failed: {outcome:?}"
        );
    }

    cluster.nodes[0].restart();
    cluster.wait_until_ready();
    let recovered = async {
        for key in &keys {
            while attempt(key).await.is_err() {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(30), recovered)
        .await
        .expect("decides on every master again");

    // A master that stops answering (paused) leaves the store ready too: the others answer.
    cluster.nodes[1].pause();
    let ping = store.ping().await;
    cluster.nodes[1].resume();
    assert_eq!(ping, Ok(()));
}

/// A process started while no node of its cluster answers (every master paused, as in a site
/// powered up at once) starts anyway, not ready and deciding by its failure modes, and decides
/// on the cluster once it answers, without a restart. It used to stop at the start.
async fn a_cluster_silent_at_the_start_is_joined_when_it_answers(cluster: &RedisCluster) {
    for node in &cluster.nodes {
        node.pause();
    }
    let a_limit = limit(10, "1/s");
    let take = async |store: &RedisStore| take_one_unit(store, "{silent}", &a_limit, None).await;
    let started = RedisStore::connect(&cluster.url(), RedisConfig::default()).await;
    let (ping, decided) = match &started {
        Ok(store) => (Some(store.ping().await), Some(take(store).await.err())),
        Err(_) => (None, None),
    };
    // Well within the cluster's node timeout (2 s): no master is taken for failed.
    for node in &cluster.nodes {
        node.resume();
    }
    let store = started.expect("starts while no node answers");
    assert_eq!(ping, Some(Err(Unavailable::Connection)), "not ready");
    assert!(
        matches!(
            decided,
            Some(Some(Error::StoreUnavailable {
                reason: Unavailable::Connection
            }))
        ),
        "{decided:?}"
    );
    let joined = async {
        while store.ping().await.is_err() || take(&store).await.is_err() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), joined)
        .await
        .expect("ready, and deciding, once the cluster answers");
}

/// A connection of the cluster's own, beside the store's, for script calls written by hand.
async fn raw_connection(url: &str) -> redis::cluster_async::ClusterConnection {
    let first_node = url.replace("redis+cluster", "redis");
    let first_node = first_node.split(',').next().unwrap_or_default().to_owned();
    let client = redis::cluster::ClusterClient::new(vec![first_node]).unwrap();
    client.get_async_connection().await.unwrap()
}

/// One request's call of `scripts/take.lua` on bucket `tollgate:{key}` of a 1/d limit of
/// capacity 5, cost 1, at `now`, with request id `r-1` and this attempt's id: the arguments the
/// store sends, written out by hand to pin an interleaving of two attempts.
fn attempt_call(
    key: &str,
    mode: &str,
    fingerprint: &str,
    attempt: u64,
    now: Timestamp,
) -> redis::Cmd {
    let p: u64 = 86_400_000_000; // units per token of 1/d on the microsecond timeline
    let mut params = Vec::new();
    for value in [1u64, 5 * p, p] {
        params.extend_from_slice(&(value as f64).to_le_bytes());
    }
    let bucket = format!("tollgate:{key}");
    let tag = &key[1..key.find('}').expect("a hash tag")];
    let record = format!("{{{tag}}}rid:3:r-1:{bucket}");
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(include_str!("../scripts/take.lua"))
        .arg(2)
        .arg(bucket)
        .arg(record)
        .arg(now.as_nanos() / 1_000)
        .arg(1) // one request
        .arg("") // no key repeats
        .arg("") // not a plain take: it has an id
        .arg(1) // of one bucket
        .arg(7_200_000)
        .arg(format!("{fingerprint}:{attempt}"))
        .arg(mode)
        .arg(&params[..]);
    cmd
}

/// Sends a call written by hand and decodes the script's reply as the store does.
async fn run(
    call: redis::Cmd,
    connection: &mut redis::cluster_async::ClusterConnection,
) -> Vec<i64> {
    let reply: Vec<u8> = call.query_async(connection).await.unwrap();
    script_reply(&reply).unwrap_or_else(|| panic!("not a packed reply: {reply:?}"))
}

/// Cross-slot charge-then-refund with a request id. Attempt 1 of a request over A and B
/// charges A (recording the id there) while B rejects; before its refund of A reaches Redis,
/// the client's retry (attempt 2, same id) arrives: A replays "allowed" without charging, B has
/// refilled and charges, so the retry is admitted. Then attempt 1's refund lands on A: it must
/// not give back the charge the retry's admission rests on (it used to, and deleted the record:
/// an admitted request A was never charged for). Attempt 1's own script calls are sent by hand,
/// exactly as the store sends them, to pin that interleaving; the retry goes through the store.
async fn a_late_cross_slot_refund_never_over_admits_a_retried_request(url: &str) {
    let store = RedisStore::connect(
        url,
        RedisConfig::default()
            .with_timeout(LOADED)
            .with_idempotency_window(std::time::Duration::from_secs(7_200)),
    )
    .await
    .unwrap();
    let (a_limit, b_limit) = (limit(5, "1/d"), limit(1, "1/h"));
    let (a_key, b_key) = ("{ra}:x", "{rb}:y");
    let both = [Take::new(a_key, &a_limit, 1), Take::new(b_key, &b_limit, 1)];
    let one = |key, limit, cost| [Take::new(key, limit, cost)];
    let hour = 3_600 * 1_000_000_000;
    let t1 = Timestamp::from_nanos(T0.as_nanos() + hour);
    // B is empty at T0.
    assert!(check(&store, &one(b_key, &b_limit, 1)).await[0].allowed());

    // Attempt 1's call on A's slot at T0: take, with the request's record.
    let mut connection = raw_connection(url).await;
    let first = request_fingerprint(&both);
    let charged = run(attempt_call(a_key, "take", &first, 1, T0), &mut connection).await;
    assert_eq!(charged[0], 1, "attempt 1 charged A");
    // (Attempt 1's call on B rejects: nothing written.)

    // The retry, through the store, an hour later: B has refilled.
    let retry = store
        .check(CheckRequest {
            takes: &both,
            request_id: Some("r-1"),
            now: Some(t1),
        })
        .await
        .unwrap();
    assert!(retry.iter().all(Decision::allowed), "{retry:?}");

    // Attempt 1's refund of A lands now: the retry's admission rests on that charge.
    let refund = run(
        attempt_call(a_key, "refund", &first, 1, T0),
        &mut connection,
    )
    .await;
    assert_eq!(refund[0], 0, "nothing given back: {refund:?}");

    // One request was admitted on A: 4 tokens (and 1/24 of a refill) are left, not 5.
    let all = store
        .check(CheckRequest {
            takes: &one(a_key, &a_limit, 5),
            request_id: None,
            now: Some(t1),
        })
        .await
        .unwrap();
    assert!(
        !all[0].allowed(),
        "A admitted 6 tokens within an hour at capacity 5 and 1/d: {all:?}"
    );
}

/// A refund that reaches Redis twice (a client library retrying it, say) gives back once: the
/// first deletes the attempt's record, and the second finds none.
async fn a_refund_sent_twice_gives_back_once(url: &str) {
    let store = RedisStore::connect(url, RedisConfig::default().with_timeout(LOADED))
        .await
        .unwrap();
    let a_limit = limit(5, "1/d");
    let key = "{rc}:x";
    let takes = [Take::new(key, &a_limit, 1)];
    let mut connection = raw_connection(url).await;
    let print = request_fingerprint(&takes);
    // Another request takes a token, then this attempt takes one and is refunded twice.
    assert!(check(&store, &takes).await[0].allowed());
    for (mode, status) in [("take", 1), ("refund", 1), ("refund", 0)] {
        let reply = run(attempt_call(key, mode, &print, 7, T0), &mut connection).await;
        assert_eq!(reply[0], status, "{mode}: {reply:?}");
    }
    let four = [Take::new(key, &a_limit, 4)];
    assert!(check(&store, &four).await[0].allowed(), "4 tokens left");
    assert!(
        !check(&store, &takes).await[0].allowed(),
        "and no more: the other request's token was not given back"
    );
}

/// `redis+cluster://:password@h:p,h:p`: the password given once, in front, as for every other
/// multi-host URL. It was refused as a malformed URL; only repeating it on every node worked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_url_with_one_password_is_not_malformed() {
    let result = RedisStore::connect(
        "redis+cluster://:pw@127.0.0.1:1,127.0.0.1:2",
        RedisConfig::default(),
    )
    .await;
    // Nothing listens there: the store starts, not ready (see
    // `a_cluster_silent_at_the_start_is_joined_when_it_answers`).
    let store = result.expect("a well-formed URL");
    assert_eq!(store.ping().await, Err(Unavailable::Connection));
    // Nodes given different passwords cannot be used together: said so, not "malformed".
    let result = RedisStore::connect(
        "redis+cluster://:pw@127.0.0.1:1,:other@127.0.0.1:2",
        RedisConfig::default(),
    )
    .await;
    assert!(
        matches!(result, Err(ConnectError::InvalidCluster { .. })),
        "{:?}",
        result.err()
    );
}

/// A node that answers but is no cluster's (a `redis://` server given as `redis+cluster://`)
/// cannot become one by waiting: that stops the start, with the client's reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_outside_cluster_mode_stops_the_start() {
    let server = support::RedisServer::start();
    let url = server.url().replace("redis://", "redis+cluster://");
    let result = RedisStore::connect(&url, RedisConfig::default()).await;
    assert!(
        matches!(result, Err(ConnectError::Connect { .. })),
        "{:?}",
        result.err()
    );
}

/// A store dropped while its cluster is still silent stops trying it: the task that tries does
/// not keep the store's connections alive for the rest of the process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_dropped_before_its_cluster_answers_stops_trying() {
    let silent = support::RedisServer::start();
    silent.pause();
    let proxy = support::Proxy::start(silent.port);
    let url = proxy.url().replace("redis://", "redis+cluster://");
    let store = RedisStore::connect(&url, RedisConfig::default())
        .await
        .expect("starts while no node answers");
    let trying = async {
        while proxy.connections() < 3 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), trying)
        .await
        .expect("tries again while the cluster is silent");
    drop(store);
    // A try under way may end, and the task wakes from its pause (at most a second) to stop.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let after_drop = proxy.connections();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let later = proxy.connections();
    silent.resume();
    assert_eq!(later, after_drop, "no tries after the store was dropped");
}

/// A cluster that does not answer at the start is tried again ever less often, up to once a
/// second: not in a loop that would hammer the addresses it was given (and this process' CPU)
/// for as long as it stays away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_away_at_the_start_is_tried_again_ever_less_often() {
    // A port that takes connections and closes them at once, counting them.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a free loopback port");
    let port = listener.local_addr().expect("its address").port();
    let tries = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&tries);
    let acceptor = tokio::spawn(async move {
        while let Ok((connection, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            drop(connection);
        }
    });
    let url = format!("redis+cluster://127.0.0.1:{port}");
    let store = RedisStore::connect(&url, RedisConfig::default())
        .await
        .expect("starts without it");
    tokio::time::sleep(Duration::from_millis(1_600)).await;
    // The first try, then tries 0.1, 0.3, 0.7 and 1.5 s after it: five (a slow machine may
    // see one fewer; a try may open a second connection).
    let tries = tries.load(Ordering::SeqCst);
    assert!((3..=10).contains(&tries), "{tries} tries in 1.6 s");
    drop(store);
    acceptor.abort();
}
