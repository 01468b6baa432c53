//! Flags (`RedisStore::read_flag`, `write_flag`) on a single node and on a three-master
//! cluster: what one store writes another reads, a cleared flag reads as unset, odd values
//! survive the trip, the base commands of a least-privileged user suffice, bad names and
//! values never reach Redis, and what is no flag, or a dead Redis, answers as unavailable.

mod support;

use std::time::Duration;

use support::{CLUSTER_COMMANDS, RedisCluster, RedisServer, as_tollgate_user, command};
use tollgate::{Error, Unavailable};
use tollgate_redis::{MAX_FLAG_BYTES, RedisConfig, RedisStore};

/// The store's timeout: a cluster in a debug build on a busy machine can pass the production
/// 20 ms, which would fail a scenario for nothing.
const LOADED: Duration = Duration::from_secs(2);

async fn connect(url: &str) -> RedisStore {
    RedisStore::connect(url, RedisConfig::default().with_timeout(LOADED))
        .await
        .expect("connect")
}

/// What one store writes, another reads back, until it is cleared.
async fn scenarios(writer: &RedisStore, reader: &RedisStore) {
    assert_eq!(reader.read_flag("shadow-all").await, Ok(None));
    let value = r#"{"reason":"INC-42: é, {braces}","since":"2026-12-07T20:00:00Z"}"#;
    assert_eq!(writer.write_flag("shadow-all", Some(value)).await, Ok(()));
    assert_eq!(
        reader.read_flag("shadow-all").await,
        Ok(Some(value.to_owned()))
    );
    assert_eq!(reader.read_flag("other").await, Ok(None), "flags are apart");
    assert_eq!(writer.write_flag("shadow-all", None).await, Ok(()));
    assert_eq!(reader.read_flag("shadow-all").await, Ok(None));
    // Cleared twice is cleared.
    assert_eq!(writer.write_flag("shadow-all", None).await, Ok(()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flag_written_by_one_store_is_read_by_another() {
    let server = RedisServer::start();
    let (writer, reader) = (connect(&server.url()).await, connect(&server.url()).await);
    scenarios(&writer, &reader).await;
    assert_eq!(
        command(server.port, &["EXISTS", "tollgate:flag:shadow-all"]).as_deref(),
        Some(":0\r\n")
    );
    writer
        .write_flag("shadow-all", Some("on"))
        .await
        .expect("write");
    assert_eq!(
        command(server.port, &["GET", "tollgate:flag:shadow-all"]).as_deref(),
        Some("on\r\n"),
        "kept under the store's prefix"
    );
    writer.write_flag("shadow-all", None).await.expect("clear");

    // The buckets' commands of the README's least-privileged user suffice.
    support::grant_tollgate_user(server.port, &[]);
    let user = connect(&as_tollgate_user(&server.url())).await;
    scenarios(&user, &reader).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flag_on_a_cluster_is_read_from_its_slot() {
    let cluster = RedisCluster::start();
    let (writer, reader) = (connect(&cluster.url()).await, connect(&cluster.url()).await);
    scenarios(&writer, &reader).await;
    for node in &cluster.nodes {
        support::grant_tollgate_user(node.port, CLUSTER_COMMANDS);
    }
    let user = connect(&as_tollgate_user(&cluster.url())).await;
    scenarios(&user, &reader).await;
}

/// Names and values out of bounds are refused before Redis; a key holding what is no flag
/// (another type, bytes that are no text, more than a flag holds) reads as unavailable rather
/// than as a value; a dead Redis reads and writes as unavailable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_is_no_flag_is_refused_or_unavailable() {
    let mut server = RedisServer::start();
    let store = connect(&server.url()).await;
    let long = "x".repeat(MAX_FLAG_BYTES + 1);
    assert!(matches!(
        store.write_flag("", Some("on")).await,
        Err(Error::UnsupportedLimit { .. })
    ));
    assert!(matches!(
        store.write_flag("f", Some(&long)).await,
        Err(Error::UnsupportedLimit { .. })
    ));
    assert!(matches!(
        store.read_flag(&long).await,
        Err(Error::UnsupportedLimit { .. })
    ));
    let protocol = Err(Error::StoreUnavailable {
        reason: Unavailable::Protocol,
    });
    command(server.port, &["RPUSH", "tollgate:flag:list", "a"]);
    assert!(store.read_flag("list").await.is_err());
    command(server.port, &["SET", "tollgate:flag:long", &long]);
    assert_eq!(store.read_flag("long").await, protocol);
    let mut bytes = support::node(server.port).await;
    redis::cmd("SET")
        .arg("tollgate:flag:bytes")
        .arg(&[0xff_u8, 0xfe][..])
        .query_async::<()>(&mut bytes)
        .await
        .expect("set");
    assert_eq!(store.read_flag("bytes").await, protocol);

    server.kill();
    assert!(matches!(
        store.read_flag("shadow-all").await,
        Err(Error::StoreUnavailable { .. })
    ));
    assert!(matches!(
        store.write_flag("shadow-all", None).await,
        Err(Error::StoreUnavailable { .. })
    ));
}
