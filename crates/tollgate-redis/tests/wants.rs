//! Boards of wants (`RedisStore::post_want`) on a single node and on a three-master cluster:
//! participants see each other's wants, a want expires with its ttl and the board with its last
//! want, zero tokens leaves, odd names survive the trip, bad arguments never reach Redis, and a
//! dead, slow or foreign-holding Redis answers as unavailable.

mod support;

use std::time::Duration;

use support::{
    CLUSTER_COMMANDS, Inspector, RedisCluster, RedisServer, as_tollgate_user, command, info_field,
};
use tollgate::{Error, Unavailable};
use tollgate_redis::{MAX_WANT_TOKENS, MAX_WANT_TTL, RedisConfig, RedisStore, Want};

/// The store's timeout: a cluster in a debug build on a busy machine can pass the production
/// 20 ms, which would fail a scenario for nothing.
const LOADED: Duration = Duration::from_secs(2);

/// A ttl no scenario outlives.
const LONG: Duration = Duration::from_secs(60);

/// The short ttl of the expiry scenarios, and the wait that surely outlives it.
const SHORT: Duration = Duration::from_millis(200);
const PAST_SHORT: Duration = Duration::from_millis(500);

/// The commands a least-privileged user needs for wants, besides the buckets' (the README's).
const WANT_COMMANDS: &[&str] = &["+hgetall", "+hset", "+hdel", "+pexpire"];

async fn connect(url: &str) -> RedisStore {
    RedisStore::connect(url, RedisConfig::default().with_timeout(LOADED))
        .await
        .expect("connect")
}

fn want(participant: &str, tokens: u64) -> Want {
    Want {
        participant: participant.to_owned(),
        tokens,
    }
}

/// Posts and expects the board back.
async fn post(store: &RedisStore, key: &str, who: &str, tokens: u64, ttl: Duration) -> Vec<Want> {
    store
        .post_want(key, who, tokens, ttl)
        .await
        .unwrap_or_else(|err| panic!("post {who} on {key}: {err}"))
}

impl Inspector {
    async fn exists(&mut self, key: &str) -> bool {
        self.query::<i64>(&["EXISTS", key]).await == 1
    }

    async fn pttl(&mut self, key: &str) -> i64 {
        self.query(&["PTTL", key]).await
    }
}

// ---------------------------------------------------------------------------------------------
// Scenarios, each run on a single node and on a cluster.

async fn scenarios(store: &RedisStore, inspect: &mut Inspector) {
    two_participants_see_each_other(store, inspect).await;
    a_want_expires_after_its_ttl(store).await;
    zero_tokens_leaves(store, inspect).await;
    the_board_disappears_with_its_last_want(store, inspect).await;
    odd_names_and_the_largest_want_survive_the_trip(store, inspect).await;
    bad_arguments_are_refused_before_redis(store, inspect).await;
    a_key_of_another_type_is_unreadable(store, inspect).await;
    boards_of_many_slots_are_kept_apart(store).await;
}

async fn two_participants_see_each_other(store: &RedisStore, inspect: &mut Inspector) {
    let key = "{global:api}";
    assert_eq!(post(store, key, "us", 30, LONG).await, [want("us", 30)]);
    assert_eq!(
        post(store, key, "eu", 10, LONG).await,
        [want("eu", 10), want("us", 30)]
    );
    // A post replaces the participant's earlier one.
    assert_eq!(
        post(store, key, "us", 5, LONG).await,
        [want("eu", 10), want("us", 5)]
    );
    // The board lives in the bucket's slot, under the prefix, as a hash.
    let board = "tollgate:wants:{global:api}";
    let fields: Vec<String> = inspect.query(&["HKEYS", board]).await;
    assert_eq!(fields.len(), 2, "{fields:?}");
    let ttl = inspect.pttl(board).await;
    assert!(ttl > 50_000 && ttl <= 60_000, "{ttl}");
}

async fn a_want_expires_after_its_ttl(store: &RedisStore) {
    let key = "{expiry}:bucket";
    post(store, key, "brief", 7, SHORT).await;
    assert_eq!(
        post(store, key, "steady", 3, LONG).await,
        [want("brief", 7), want("steady", 3)]
    );
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(
        post(store, key, "steady", 3, LONG).await,
        [want("steady", 3)]
    );
    // Posting again renews a want that would have expired (a wider ttl here, for a margin a
    // loaded machine cannot eat).
    let ttl = 2 * SHORT;
    post(store, key, "brief", 7, ttl).await;
    tokio::time::sleep(ttl / 2).await;
    post(store, key, "brief", 8, ttl).await;
    tokio::time::sleep(ttl / 2 + ttl / 4).await;
    assert_eq!(
        post(store, key, "steady", 3, LONG).await,
        [want("brief", 8), want("steady", 3)]
    );
}

async fn zero_tokens_leaves(store: &RedisStore, inspect: &mut Inspector) {
    let key = "{leaving}";
    post(store, key, "a", 1, LONG).await;
    post(store, key, "b", 2, LONG).await;
    assert_eq!(post(store, key, "a", 0, LONG).await, [want("b", 2)]);
    assert_eq!(
        post(store, key, "c", 4, LONG).await,
        [want("b", 2), want("c", 4)]
    );
    // Leaving needs no valid ttl, and leaving twice is harmless.
    assert_eq!(
        post(store, key, "c", 0, Duration::ZERO).await,
        [want("b", 2)]
    );
    assert_eq!(
        post(store, key, "c", 0, Duration::ZERO).await,
        [want("b", 2)]
    );
    // The last to leave takes the board with it.
    assert_eq!(post(store, key, "b", 0, LONG).await, []);
    assert!(!inspect.exists("tollgate:wants:{leaving}").await);
    // Leaving a board that does not exist creates none.
    assert_eq!(post(store, "{never}", "x", 0, LONG).await, []);
    assert!(!inspect.exists("tollgate:wants:{never}").await);
}

async fn the_board_disappears_with_its_last_want(store: &RedisStore, inspect: &mut Inspector) {
    let key = "{abandoned}";
    let board = "tollgate:wants:{abandoned}";
    let longer = Duration::from_secs(1);
    post(store, key, "long", 1, longer).await;
    post(store, key, "short", 1, SHORT).await;
    // The hash expires with its longest live want, not the last one posted.
    let ttl = inspect.pttl(board).await;
    assert!(ttl > 200 && ttl <= 1_000, "{ttl}");
    // Nobody posts again: Redis drops the board on its own.
    tokio::time::sleep(longer + PAST_SHORT).await;
    assert!(!inspect.exists(board).await);
    // A participant whose want outlives the others' keeps the board that long, and a
    // shorter post cuts the board's expiry down to the wants still live.
    post(store, key, "a", 1, LONG).await;
    post(store, key, "a", 1, SHORT).await;
    let ttl = inspect.pttl(board).await;
    assert!(ttl > 0 && ttl <= 200, "{ttl}");
    tokio::time::sleep(PAST_SHORT).await;
    assert!(!inspect.exists(board).await);
}

async fn odd_names_and_the_largest_want_survive_the_trip(
    store: &RedisStore,
    inspect: &mut Inspector,
) {
    let key = "{odd}:clé \0\r\n\"*$:";
    let names = ["", ":", "1:2", "région \0\r\n*3\r\n", "😀{tag}"];
    for (tokens, name) in (1..).zip(names) {
        post(store, key, name, tokens, LONG).await;
    }
    let board = post(store, key, "max", MAX_WANT_TOKENS, LONG).await;
    let mut expected: Vec<Want> = (1..).zip(names).map(|(t, n)| want(n, t)).collect();
    expected.push(want("max", MAX_WANT_TOKENS));
    expected.sort_by(|a, b| a.participant.cmp(&b.participant));
    assert_eq!(board, expected);
    assert!(inspect.exists(&format!("tollgate:wants:{key}")).await);
}

async fn bad_arguments_are_refused_before_redis(store: &RedisStore, inspect: &mut Inspector) {
    let key = "{refused}";
    let refused = [
        (MAX_WANT_TOKENS + 1, LONG),
        (u64::MAX, LONG),
        (1, Duration::ZERO),
        (1, MAX_WANT_TTL + Duration::from_nanos(1)),
        (1, Duration::MAX),
    ];
    for (tokens, ttl) in refused {
        assert!(
            matches!(
                store.post_want(key, "p", tokens, ttl).await,
                Err(Error::UnsupportedLimit { .. })
            ),
            "{tokens} for {ttl:?}"
        );
    }
    assert!(!inspect.exists("tollgate:wants:{refused}").await);
    // The bounds themselves are taken; under a millisecond is rounded up to one.
    post(store, key, "p", MAX_WANT_TOKENS, MAX_WANT_TTL).await;
    assert_eq!(
        post(store, key, "q", 1, Duration::from_nanos(1))
            .await
            .len(),
        2
    );
}

async fn a_key_of_another_type_is_unreadable(store: &RedisStore, inspect: &mut Inspector) {
    let board = "tollgate:wants:{foreign}";
    let _: () = inspect.query(&["SET", board, "not a board"]).await;
    assert_eq!(
        store.post_want("{foreign}", "p", 1, LONG).await,
        Err(Error::StoreUnavailable {
            reason: Unavailable::Script
        })
    );
    // Untouched, and the breaker stays closed: Redis answered.
    let value: String = inspect.query(&["GET", board]).await;
    assert_eq!(value, "not a board");
    assert!(!store.is_degraded());
    // A field no tollgate wrote (not "TOKENS:EXPIRES", no tokens, an expiry past any ttl
    // from now) is dropped from the board, as an expired one is.
    let board = "tollgate:wants:{corrupt}";
    let _: () = inspect
        .query(&[
            "HSET",
            board,
            "bad",
            "x",
            "worse",
            "1:notime",
            "far",
            "1:99999999999999",
        ])
        .await;
    let _: () = inspect
        .query(&["HSET", board, "zero", "0:99999999999999"])
        .await;
    assert_eq!(post(store, "{corrupt}", "p", 2, LONG).await, [want("p", 2)]);
    let fields: Vec<String> = inspect.query(&["HKEYS", board]).await;
    assert_eq!(fields, ["p"]);
    let _: () = inspect.query(&["DEL", "tollgate:wants:{foreign}"]).await;
}

/// Boards whose keys hash to different slots (every master, on a cluster) each hold their own.
async fn boards_of_many_slots_are_kept_apart(store: &RedisStore) {
    for n in 0..24 {
        let key = format!("spread:{n}");
        assert_eq!(
            post(store, &key, "only", n + 1, LONG).await,
            [want("only", n + 1)]
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Single node.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node() {
    let server = RedisServer::start();
    let store = connect(&server.url()).await;
    let mut inspect = Inspector::single(&server).await;
    scenarios(&store, &mut inspect).await;
}

/// After `SCRIPT FLUSH` (or a restart) the script is sent again by its source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flushed_script_is_sent_again() {
    let server = RedisServer::start();
    let store = connect(&server.url()).await;
    post(&store, "{flush}", "a", 1, LONG).await;
    assert_eq!(
        command(server.port, &["SCRIPT", "FLUSH"]).as_deref(),
        Some("+OK\r\n")
    );
    assert_eq!(
        post(&store, "{flush}", "b", 2, LONG).await,
        [want("a", 1), want("b", 2)]
    );
}

/// Only a script Redis does not have is sent again as source: another error (here, Redis out
/// of memory) is answered as it is, not retried with the source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_missing_script_is_sent_again() {
    let server = RedisServer::start();
    let store = connect(&server.url()).await;
    post(&store, "{loaded}", "a", 1, LONG).await;
    let full = command(server.port, &["CONFIG", "SET", "maxmemory", "1"]);
    assert_eq!(full.as_deref(), Some("+OK\r\n"));
    let refused = store.post_want("{loaded}", "b", 1, LONG).await;
    assert!(
        matches!(refused, Err(Error::StoreUnavailable { .. })),
        "{refused:?}"
    );
    let stats = command(server.port, &["INFO", "commandstats"]).unwrap_or_default();
    assert_eq!(info_field(&stats, "cmdstat_eval:", "calls"), 1.0, "{stats}");
    assert_eq!(
        info_field(&stats, "cmdstat_eval:", "rejected_calls"),
        0.0,
        "{stats}"
    );
}

/// The commands the module's comment and the README list suffice, under `~tollgate:*`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_least_privilege_user_with_the_want_commands_suffices() {
    let server = RedisServer::start();
    support::grant_tollgate_user(server.port, WANT_COMMANDS);
    let store = connect(&as_tollgate_user(&server.url())).await;
    let mut inspect = Inspector::single(&server).await;
    // Everything the script does: expire (HDEL), post (HSET), leave (HDEL), PEXPIRE.
    post(&store, "{acl}", "brief", 1, SHORT).await;
    post(&store, "{acl}", "a", 2, LONG).await;
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(
        post(&store, "{acl}", "b", 3, LONG).await,
        [want("a", 2), want("b", 3)]
    );
    assert_eq!(post(&store, "{acl}", "a", 0, LONG).await, [want("b", 3)]);
    assert!(inspect.exists("tollgate:wants:{acl}").await);
}

/// A dead Redis, then a stalled one, answer as unavailable within the timeout, never as a
/// hang; bad arguments are refused all the same, as they never reach Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_or_stalled_redis_is_unavailable() {
    let mut server = RedisServer::start();
    let timeout = Duration::from_millis(100);
    let store = RedisStore::connect(&server.url(), RedisConfig::default().with_timeout(timeout))
        .await
        .expect("connect");
    post(&store, "{down}", "a", 1, LONG).await;

    server.pause();
    let stalled = tokio::time::timeout(
        Duration::from_secs(2),
        store.post_want("{down}", "a", 1, LONG),
    )
    .await
    .expect("no hang");
    assert_eq!(
        stalled,
        Err(Error::StoreUnavailable {
            reason: Unavailable::Timeout
        })
    );
    server.resume();

    server.kill();
    for _ in 0..5 {
        let dead = tokio::time::timeout(
            Duration::from_secs(2),
            store.post_want("{down}", "a", 1, LONG),
        )
        .await
        .expect("no hang");
        assert!(
            matches!(dead, Err(Error::StoreUnavailable { .. })),
            "{dead:?}"
        );
    }
    assert!(matches!(
        store.post_want("{down}", "a", 1, Duration::ZERO).await,
        Err(Error::UnsupportedLimit { .. })
    ));
}

// ---------------------------------------------------------------------------------------------
// Cluster: one for every test of this binary, as starting one takes seconds.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster() {
    let cluster = RedisCluster::start();
    let store = connect(&cluster.url()).await;
    assert!(store.is_cluster());
    let mut inspect = Inspector::cluster(&cluster).await;
    scenarios(&store, &mut inspect).await;

    // As the least-privileged user, on every master.
    for node in &cluster.nodes {
        let commands: Vec<&str> = CLUSTER_COMMANDS
            .iter()
            .chain(WANT_COMMANDS)
            .copied()
            .collect();
        support::grant_tollgate_user(node.port, &commands);
    }
    let user = connect(&as_tollgate_user(&cluster.url())).await;
    boards_of_many_slots_are_kept_apart(&user).await;
    assert_eq!(
        post(&user, "spread:0", "second", 9, LONG).await,
        [want("only", 1), want("second", 9)]
    );
}
