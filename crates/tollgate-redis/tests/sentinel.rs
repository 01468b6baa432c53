//! The Redis store through Redis Sentinel (`redis+sentinel://`): it decides on the master the
//! sentinels name, follows a failover to the promoted replica, and starts without a sentinel
//! that answers, as it starts without a single server.

mod support;

use std::time::Duration;

use support::{
    RedisSentinel, as_tollgate_user, command, grant_tollgate_user, take_one_unit, until_decided,
    wait_for_replicas,
};
use tollgate::{CheckRequest, Error, Limit, Store, Take, Unavailable};
use tollgate_redis::{ConnectError, RedisConfig, RedisStore, TlsFiles};

/// A debug build on a busy 2-core machine can pass the production 20 ms: these tests are
/// about which server decides, not how fast.
const PATIENT: Duration = Duration::from_secs(2);

fn limit(capacity: u64) -> Limit {
    Limit::new(capacity, "1/h".parse().expect("a rate")).expect("a limit")
}

async fn remaining(store: &RedisStore, key: &str, limit: &Limit) -> Result<u64, Error> {
    Ok(take_one_unit(store, key, limit, None).await?[0].remaining())
}

/// As [`remaining`], as one request (`id`) however often it is retried: should an attempt run
/// in Redis but lose its reply (a connection closed in a failover), the retry, with the same
/// id, is not charged again.
async fn once(store: &RedisStore, key: &str, limit: &Limit, id: &str) -> Result<u64, Error> {
    let takes = [Take::new(key, limit, 1)];
    let request = CheckRequest {
        takes: &takes,
        request_id: Some(id),
        now: None,
    };
    Ok(store.check(request).await?[0].remaining())
}

/// The master dies; the sentinel promotes its replica (one second of silence, then an
/// election); the store answers "unavailable" meanwhile, within its timeout, then decides on
/// the new master with the balance replication carried over, without a restart. The user
/// it runs as is the least-privileged one the README gives, on both servers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follows_the_master_the_sentinel_names_through_a_failover() {
    let mut sentinel = RedisSentinel::start();
    for server in [&sentinel.master, &sentinel.replica] {
        grant_tollgate_user(server.port, support::SENTINEL_COMMANDS);
    }
    let url = as_tollgate_user(&sentinel.url());
    let store = RedisStore::connect(&url, RedisConfig::default().with_timeout(PATIENT))
        .await
        .expect("connect through the sentinel");
    assert!(!store.is_cluster());
    assert_eq!(store.ping().await, Ok(()));
    let ten = limit(10);
    for left in [9, 8, 7, 6] {
        assert_eq!(remaining(&store, "k", &ten).await.ok(), Some(left));
    }
    // Replication is asynchronous: wait until the replica has the writes.
    let replicated = wait_for_replicas(sentinel.master.port, "barrier", 1, PATIENT);
    assert_eq!(replicated, Some(1));

    sentinel.master.kill();
    let (left, unavailable) =
        until_decided(PATIENT * 3, || once(&store, "k", &ten, "after-the-kill")).await;
    assert!(unavailable > 0, "the store noticed the dead master");
    assert_eq!(left, 5, "the replica carried the balance over");
    sentinel.wait_for_master(sentinel.replica.port);
    assert_eq!(store.ping().await, Ok(()));
}

/// A process started while no sentinel answers starts anyway, not ready and deciding by its
/// failure modes, and decides once a sentinel answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_silent_at_the_start_is_asked_again() {
    let sentinel = RedisSentinel::start();
    sentinel.sentinel.pause();
    let started = RedisStore::connect(&sentinel.url(), RedisConfig::default()).await;
    let ping = match &started {
        Ok(store) => Some(store.ping().await),
        Err(_) => None,
    };
    sentinel.sentinel.resume();
    let store = started.expect("starts while no sentinel answers");
    assert_eq!(ping, Some(Err(Unavailable::Connection)), "not ready");
    let ten = limit(10);
    let asked_again = async {
        while store.ping().await.is_err() || remaining(&store, "k", &ten).await.is_err() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), asked_again)
        .await
        .expect("ready, and deciding, once the sentinel answers");
}

/// Sentinels that ask for a password (`requirepass`) get it from
/// `RedisConfig::sentinel_password`; the URL's credentials are the master's. Without it the
/// store starts, not ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinels_that_ask_for_a_password_get_their_own() {
    let sentinel = RedisSentinel::start_with(Some("watchword"));
    let without = RedisStore::connect(&sentinel.url(), RedisConfig::default())
        .await
        .expect("starts, not ready");
    assert_eq!(without.ping().await, Err(Unavailable::Connection));
    let store = RedisStore::connect(
        &sentinel.url(),
        RedisConfig::default()
            .with_timeout(PATIENT)
            .with_sentinel_password("watchword"),
    )
    .await
    .expect("connect through the sentinel");
    assert_eq!(remaining(&store, "k", &limit(3)).await.ok(), Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_url_names_its_service() {
    for bad in [
        "redis+sentinel://127.0.0.1:26379",
        "redis+sentinel://127.0.0.1:26379/",
        "redis+sentinel://127.0.0.1:port/svc",
        "redis+sentinel://:26379/svc",
        "redis+sentinel://127.0.0.1:26379/svc/not-a-db",
    ] {
        let result = RedisStore::connect(bad, RedisConfig::default()).await;
        assert!(
            matches!(result, Err(ConnectError::InvalidUrl { .. })),
            "{bad}: {:?}",
            result.err()
        );
    }
}

/// A planned failover (`SENTINEL FAILOVER`, as in a rolling upgrade): the old master stays up,
/// demoted to a replica that refuses writes (`READONLY`) on the connection the store holds.
/// The store must go to the master the sentinel names now rather than fail every decision on
/// the old one until it is restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planned_failover_moves_decisions_to_the_new_master() {
    let sentinel = RedisSentinel::start();
    let store = RedisStore::connect(
        &sentinel.url(),
        RedisConfig::default().with_timeout(PATIENT),
    )
    .await
    .expect("connect through the sentinel");
    let ten = limit(10);
    assert_eq!(remaining(&store, "k", &ten).await.ok(), Some(9));
    let replicated = wait_for_replicas(sentinel.master.port, "barrier", 1, PATIENT);
    assert_eq!(replicated, Some(1));

    let reply = command(
        sentinel.sentinel.port,
        &["SENTINEL", "FAILOVER", support::SENTINEL_SERVICE],
    );
    assert_eq!(reply.as_deref(), Some("+OK\r\n"));
    sentinel.wait_for_master(sentinel.replica.port);
    let demoted = async {
        loop {
            let role = command(sentinel.master.port, &["ROLE"]).unwrap_or_default();
            if role.starts_with("*5") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(20), demoted)
        .await
        .expect("the old master became a replica");
    let moved = async {
        loop {
            if let Ok(left) = remaining(&store, "k", &ten).await {
                break left;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let left = tokio::time::timeout(Duration::from_secs(20), moved)
        .await
        .expect("decides on the new master");
    assert_eq!(left, 8, "the new master has the balance");
    let keys = command(sentinel.replica.port, &["EXISTS", "tollgate:k"]).unwrap_or_default();
    assert_eq!(keys.trim(), ":1", "the bucket is on the new master");
}

/// `rediss+sentinel://`: TLS to the sentinels and to the master they name, on a private
/// authority, through a failover too (the promoted replica is reached on its TLS port).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_to_the_sentinels_and_the_master() {
    let certificates = support::TestCertificates::generate("sentinel-tls");
    let mut sentinel = RedisSentinel::start_tls(&certificates);
    let config = RedisConfig::default()
        .with_timeout(PATIENT)
        .with_tls(TlsFiles::new().with_ca(&certificates.ca));
    let store = RedisStore::connect(&sentinel.tls_url(), config)
        .await
        .expect("connect through the sentinel");
    let ten = limit(10);
    // The first call also opens the TLS connections (to a sentinel, then to the master it
    // names), which on a busy host can take longer than one timeout: retried as one request,
    // charged once.
    let (first, _) = until_decided(PATIENT * 3, || once(&store, "k", &ten, "first")).await;
    assert_eq!(first, 9);
    let stored = command(sentinel.master.port, &["EXISTS", "tollgate:k"]);
    assert_eq!(stored.as_deref(), Some(":1\r\n"), "on the master");
    let replicated = wait_for_replicas(sentinel.master.port, "barrier", 1, PATIENT);
    assert_eq!(replicated, Some(1));

    sentinel.master.kill();
    let (left, _) = until_decided(PATIENT * 3, || once(&store, "k", &ten, "after-the-kill")).await;
    assert_eq!(left, 8, "the replica carried the balance over");
    let replica_tls = sentinel.replica.tls_port.expect("a TLS port");
    sentinel.wait_for_master(replica_tls);
    // Without the authority the sentinels' certificate is not trusted: not ready.
    let untrusting = RedisStore::connect(&sentinel.tls_url(), RedisConfig::default())
        .await
        .expect("starts, not ready");
    assert_eq!(untrusting.ping().await, Err(Unavailable::Connection));
}

/// Of the sentinels the URL names, one that is down is passed over for the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_sentinel_is_passed_over_for_the_next() {
    let sentinel = RedisSentinel::start();
    let dead = support::free_port();
    let url = format!(
        "redis+sentinel://127.0.0.1:{dead},127.0.0.1:{}/{}",
        sentinel.sentinel.port,
        support::SENTINEL_SERVICE
    );
    let store = RedisStore::connect(&url, RedisConfig::default().with_timeout(PATIENT))
        .await
        .expect("connect through the live sentinel");
    assert_eq!(store.ping().await, Ok(()));
    assert_eq!(remaining(&store, "k", &limit(3)).await.ok(), Some(2));
}
