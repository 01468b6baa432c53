//! The Redis store against a real three-master Redis Cluster that the tests start themselves.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use redis::cluster_routing::Slot;
use support::{RedisCluster, command, take_one_unit};
use tollgate::testkit::{Trace, compare_with_memory};
use tollgate::{CheckRequest, Decision, Error, Limit, Store, Take, Timestamp};
use tollgate_redis::{RedisConfig, RedisStore};

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

    conforms_with_and_without_hash_tags(&store).await;
    cross_slot_rejection_charges_nothing(&store).await;
    sixty_four_tasks_on_one_key(&url).await;
    a_master_killed_then_restarted(&mut cluster, &store).await;
}

async fn conforms_with_and_without_hash_tags(store: &RedisStore) {
    for seed in 1..=4 {
        // With per-subject hash tags every request is one slot, one atomic script.
        let tagged = Trace::new(seed, 300, format!("tagged-{seed}"));
        // Without them the buckets of one request spread over slots (and nodes): charged in
        // parallel, refunded when one slot rejects. Sequentially, the same decisions.
        let untagged = Trace::new(seed, 300, format!("untagged-{seed}")).hash_tags(false);
        for trace in [tagged, untagged] {
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
        Take {
            key: user_key,
            limit: &user,
            cost: 1,
        },
        Take {
            key: tenant_key,
            limit: &tenant,
            cost: 1,
        },
    ];
    assert!(check(store, &both).await.iter().all(Decision::allowed));
    for _ in 0..3 {
        let decisions = check(store, &both).await;
        assert!(decisions[0].allowed() && !decisions[1].allowed());
        assert_eq!(decisions[0].remaining(), 4, "charged, then refunded");
    }
    let rest = [Take {
        key: user_key,
        limit: &user,
        cost: 4,
    }];
    assert!(
        check(store, &rest).await[0].allowed(),
        "the user was charged once"
    );
    let more = [Take {
        key: user_key,
        limit: &user,
        cost: 1,
    }];
    assert!(!check(store, &more).await[0].allowed());
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
                let takes = [Take {
                    key: "{hot}:key",
                    limit: &limit,
                    cost: 1,
                }];
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
    for _ in 0..10 {
        let outcome = tokio::time::timeout(std::time::Duration::from_secs(1), attempt(&keys[0]))
            .await
            .expect("a failure within the timeout, not a hang");
        assert!(
            matches!(outcome, Err(Error::StoreUnavailable { .. })),
            "{outcome:?}"
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
}
