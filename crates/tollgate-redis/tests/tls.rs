//! `rediss://`: the Redis store over TLS, against Redis servers the tests start with their own
//! throwaway certificate authority.

mod support;

use support::{RedisCluster, RedisServer, SlotMove, TestCertificates, command, take_one_unit};
use tollgate::{Decision, Error, Limit};
use tollgate_redis::{ConnectError, RedisConfig, RedisStore, TlsFiles};

fn limit() -> Limit {
    Limit::new(3, "1/h".parse().unwrap()).unwrap()
}

async fn check(store: &RedisStore, key: &str) -> Result<Vec<Decision>, Error> {
    take_one_unit(store, key, &limit(), None).await
}

async fn connect(url: &str, tls: TlsFiles) -> Result<RedisStore, ConnectError> {
    // A TLS handshake on a busy test machine can take longer than the default 20 ms.
    let config = RedisConfig::default()
        .with_timeout(std::time::Duration::from_secs(2))
        .with_tls(tls);
    RedisStore::connect(url, config).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decides_over_tls_with_a_private_authority() {
    let certificates = TestCertificates::generate("private-ca");
    let server = RedisServer::start_tls(&certificates, false);
    let store = connect(&server.tls_url(), TlsFiles::new().with_ca(&certificates.ca))
        .await
        .unwrap();
    let allowed: Vec<bool> = {
        let mut allowed = Vec::new();
        for _ in 0..4 {
            allowed.push(check(&store, "k").await.unwrap()[0].allowed());
        }
        allowed
    };
    assert_eq!(allowed, [true, true, true, false]);
    // The bucket is in that Redis, read over its plain port.
    assert_eq!(
        command(server.port, &["EXISTS", "tollgate:k"]).as_deref(),
        Some(":1\r\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_is_presented_when_the_server_requires_one() {
    let certificates = TestCertificates::generate("mutual");
    let server = RedisServer::start_tls(&certificates, true);
    let with_cert = connect(
        &server.tls_url(),
        TlsFiles::new()
            .with_ca(&certificates.ca)
            .with_client_cert(&certificates.client_cert, &certificates.client_key),
    )
    .await
    .unwrap();
    assert!(check(&with_cert, "k").await.unwrap()[0].allowed());

    let without = connect(&server.tls_url(), TlsFiles::new().with_ca(&certificates.ca))
        .await
        .unwrap();
    let refused = check(&without, "k").await;
    assert!(
        matches!(refused, Err(Error::StoreUnavailable { .. })),
        "{refused:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_the_store_does_not_trust_is_refused() {
    let certificates = TestCertificates::generate("server-side");
    let other = TestCertificates::generate("other-authority");
    let server = RedisServer::start_tls(&certificates, false);
    // Another authority, then the system's (which never signed the test authority).
    for tls in [TlsFiles::new().with_ca(&other.ca), TlsFiles::new()] {
        let store = connect(&server.tls_url(), tls).await.unwrap();
        let refused = check(&store, "k").await;
        assert!(
            matches!(refused, Err(Error::StoreUnavailable { .. })),
            "{refused:?}"
        );
    }
    assert_eq!(
        command(server.port, &["EXISTS", "tollgate:k"]).as_deref(),
        Some(":0\r\n")
    );
}

#[tokio::test]
async fn certificate_files_are_checked_when_the_store_connects() {
    let certificates = TestCertificates::generate("files");
    let ca = TlsFiles::new().with_ca(&certificates.ca);
    // Files for a URL without TLS: a mistake, not something to ignore.
    assert!(matches!(
        connect("redis://127.0.0.1:1", ca.clone()).await,
        Err(ConnectError::TlsFilesWithoutTls)
    ));
    assert!(matches!(
        connect("redis+cluster://127.0.0.1:1", ca).await,
        Err(ConnectError::TlsFilesWithoutTls)
    ));
    let missing = TlsFiles::new().with_ca(certificates.ca.with_file_name("missing.pem"));
    assert!(matches!(
        connect("rediss://127.0.0.1:1", missing).await,
        Err(ConnectError::TlsFile { .. })
    ));
    // A key given as the authority: no certificate in it.
    let swapped = TlsFiles::new().with_ca(&certificates.client_key);
    let refused = connect("rediss://127.0.0.1:1", swapped).await;
    assert!(
        matches!(refused, Err(ConnectError::TlsNoCertificate { .. })),
        "{:?}",
        refused.err()
    );
    // A certificate given as the client's key: the client cannot use it.
    let swapped = TlsFiles::new().with_client_cert(&certificates.client_cert, &certificates.ca);
    let refused = connect("rediss://127.0.0.1:1", swapped).await;
    assert!(
        matches!(refused, Err(ConnectError::InvalidTls { .. })),
        "{:?}",
        refused.err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decides_on_a_cluster_over_tls() {
    let certificates = TestCertificates::generate("cluster");
    let mut cluster = RedisCluster::start_tls(&certificates);
    let store = connect(
        &cluster.tls_url(),
        TlsFiles::new().with_ca(&certificates.ca),
    )
    .await
    .unwrap();
    assert!(store.is_cluster());
    // Keys spread over the three masters, each decided exactly.
    for key in ["a", "b", "c", "d", "e", "f"] {
        let allowed: Vec<bool> = {
            let mut allowed = Vec::new();
            for _ in 0..4 {
                allowed.push(check(&store, key).await.unwrap()[0].allowed());
            }
            allowed
        };
        assert_eq!(allowed, [true, true, true, false], "{key}");
    }
    let stored: usize = cluster
        .nodes
        .iter()
        .map(|node| {
            command(node.port, &["DBSIZE"])
                .and_then(|reply| reply.trim().trim_start_matches(':').parse().ok())
                .unwrap_or(0)
        })
        .sum();
    assert_eq!(stored, 6);

    // A slot moved to a master that joins now, which the cluster client has no connection to:
    // the store reaches it on a TLS connection of its own, and the bucket keeps its balance.
    let new = cluster.add_master(Some(&certificates));
    let slot: u16 = command(cluster.nodes[0].port, &["CLUSTER", "KEYSLOT", "tollgate:a"])
        .and_then(|reply| reply.trim().trim_start_matches(':').parse().ok())
        .expect("a slot");
    let owner = (0..3)
        .find(|&master| {
            command(
                cluster.nodes[master].port,
                &["CLUSTER", "COUNTKEYSINSLOT", &slot.to_string()],
            )
            .is_some_and(|reply| reply.trim() == ":1")
        })
        .expect("a master holds the bucket");
    let step = SlotMove::new(&cluster, slot, owner, new);
    step.begin().await;
    assert_eq!(step.migrate_keys().await, 1);
    assert!(
        !check(&store, "a").await.unwrap()[0].allowed(),
        "a is still empty"
    );
    step.finish().await;
    assert!(
        !check(&store, "a").await.unwrap()[0].allowed(),
        "a is still empty"
    );
}
