//! The Redis store while the Redis Cluster under it changes shape: a slot moves from one master
//! to another (a rebalance, `redis-cli --cluster reshard`), a master hands over to its replica
//! and back (a planned failover, as in a rolling upgrade), and a master fails over to its
//! replica (a crash). Production clusters do both while traffic flows. Through either, the
//! store must keep every bucket's state and idempotency records, never over-admit, and decide
//! again by itself once the cluster has settled.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use redis::AsyncCommands;
use support::{
    RedisCluster, SlotMove, as_tollgate_user, command, info_field, node, until_decided,
    wait_for_replicas,
};
use tollgate::{CheckRequest, Decision, Error, Limit, Store, Take, Timestamp};
use tollgate_redis::{RedisConfig, RedisStore};

/// The stores' timeout: a debug build on a loaded 2-core machine, while Redis migrates keys,
/// can pass the production default of 20 ms; these tests are about decisions, not latency.
const PATIENT: Duration = Duration::from_secs(2);

const T0: Timestamp = Timestamp::from_nanos(1_700_000_000_000_000_000);

/// `redis-cli --cluster create` deals the 16,384 slots to three masters in thirds of 5,462
/// (the last one short).
const THIRD: u16 = 5_462;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_changes() {
    let mut cluster = RedisCluster::start();
    cluster.add_replica(0);
    // Every change runs as the least-privileged user the README gives (the replica needs it
    // too: users are not replicated, and it becomes a master).
    for node in cluster.nodes.iter().chain(&cluster.replicas) {
        support::grant_tollgate_user(node.port, support::CLUSTER_COMMANDS);
    }
    let store = RedisStore::connect(
        &as_tollgate_user(&cluster.url()),
        RedisConfig::default()
            .with_timeout(PATIENT)
            .with_idempotency_window(Duration::from_secs(3_600)),
    )
    .await
    .expect("connect to the cluster");
    a_slot_moved_between_masters_keeps_its_buckets_and_records(&cluster, &store).await;
    a_check_over_a_slot_half_moved_is_asked_again(&cluster, &store).await;
    a_busy_key_moved_mid_traffic_is_never_over_admitted(&cluster, 0).await;
    // As a cluster grows: to a master the store has never talked to.
    let new = cluster.add_master(None);
    support::grant_tollgate_user(cluster.nodes[new].port, support::CLUSTER_COMMANDS);
    a_busy_key_moved_mid_traffic_is_never_over_admitted(&cluster, new).await;
    a_planned_failover_and_back_under_traffic_loses_nothing(&cluster).await;
    a_master_failed_over_to_its_replica_keeps_its_buckets(&mut cluster, &store).await;
}

/// `key`'s slot, as the cluster computes it.
fn slot_of(cluster: &RedisCluster, key: &str) -> u16 {
    command(cluster.nodes[2].port, &["CLUSTER", "KEYSLOT", key])
        .and_then(|reply| reply.trim().trim_start_matches(':').parse().ok())
        .expect("a slot")
}

/// A key with a hash tag of its own, in master `master`'s third of the slots.
fn key_of_master(cluster: &RedisCluster, name: &str, master: u16) -> String {
    (0..)
        .map(|n| format!("{{{name}-{n}}}"))
        .find(|key| slot_of(cluster, key) / THIRD == master)
        .unwrap_or_default()
}

/// `capacity`, one token back a minute: time stands still at `T0` here, so nothing refills.
fn limit(capacity: u64) -> Limit {
    Limit::new(capacity, "1/m".parse().expect("a rate")).expect("a limit")
}

/// One unit of `limit` on `key` at `T0`, with `request_id` when given.
async fn take(
    store: &RedisStore,
    key: &str,
    limit: &Limit,
    request_id: Option<&str>,
) -> Result<Decision, Error> {
    let takes = [Take::new(key, limit, 1)];
    let decisions = store
        .check(CheckRequest {
            takes: &takes,
            request_id,
            now: Some(T0),
        })
        .await?;
    Ok(decisions[0])
}

/// What a take left in the bucket, or the error as text for the assertion's message.
async fn remaining(store: &RedisStore, key: &str, limit: &Limit, id: Option<&str>) -> String {
    match take(store, key, limit, id).await {
        Ok(decision) if decision.allowed() => decision.remaining().to_string(),
        Ok(decision) => format!("rejected, {} left", decision.remaining()),
        Err(err) => format!("error: {err}"),
    }
}

/// A bucket keeps its balance at every step of a move, whether the store finds it on the source
/// or is redirected to the target (`ASK`, then `MOVED`); a bucket first made mid-move is made
/// on the target; a retried request is still recognised after its record moved.
async fn a_slot_moved_between_masters_keeps_its_buckets_and_records(
    cluster: &RedisCluster,
    store: &RedisStore,
) {
    let ten = limit(10);
    let key = key_of_master(cluster, "move", 1);
    let fresh = format!("{key}:fresh");
    let step = SlotMove::new(cluster, slot_of(cluster, &key), 1, 2);

    for left in ["9", "8", "7"] {
        assert_eq!(remaining(store, &key, &ten, None).await, left);
    }
    assert_eq!(remaining(store, &key, &ten, Some("r-1")).await, "6");

    step.begin().await;
    // Still on the source.
    assert_eq!(remaining(store, &key, &ten, None).await, "5");
    // Not on the source: the source redirects to the target, which makes it.
    assert_eq!(remaining(store, &fresh, &ten, None).await, "9");

    // The bucket and the request's record go over together.
    assert!(step.migrate_keys().await >= 2, "the bucket and its record");
    assert_eq!(remaining(store, &key, &ten, None).await, "4");
    // A retry of r-1 gets its first decision back, and is not charged.
    assert_eq!(remaining(store, &key, &ten, Some("r-1")).await, "6");

    step.finish().await;
    assert_eq!(remaining(store, &key, &ten, None).await, "3");
    assert_eq!(remaining(store, &fresh, &ten, None).await, "8");
    assert_eq!(remaining(store, &key, &ten, Some("r-1")).await, "6");
    let mut target = node(step.target).await;
    let stored: bool = target
        .exists(format!("tollgate:{key}"))
        .await
        .expect("EXISTS");
    assert!(stored, "the bucket lives on the target now");
}

/// A check of two buckets of one slot, one moved to the target and the other not yet: no node
/// holds both, and the source answers `TRYAGAIN`. The store asks again (a move of a slot's
/// last keys ends soon); while the move stays half done the check fails as the store's,
/// charging nothing, and once it ends both buckets have their balance.
async fn a_check_over_a_slot_half_moved_is_asked_again(cluster: &RedisCluster, store: &RedisStore) {
    let ten = limit(10);
    let tag = key_of_master(cluster, "half", 1);
    let (a, b) = (format!("{tag}:a"), format!("{tag}:b"));
    let both = || async {
        let takes = [Take::new(&a, &ten, 1), Take::new(&b, &ten, 1)];
        let request = CheckRequest {
            takes: &takes,
            request_id: None,
            now: Some(T0),
        };
        store.check(request).await.map(|decisions| {
            decisions
                .iter()
                .map(|decision| (decision.allowed(), decision.remaining()))
                .collect::<Vec<_>>()
        })
    };
    assert_eq!(both().await.unwrap(), [(true, 9), (true, 9)]);
    let source = cluster.nodes[1].port;
    let refused = || {
        let stats = command(source, &["INFO", "commandstats"]).unwrap_or_default();
        info_field(&stats, "cmdstat_evalsha:", "rejected_calls")
    };
    let step = SlotMove::new(cluster, slot_of(cluster, &a), 1, 2);
    step.begin().await;
    step.migrate(&[format!("tollgate:{a}")]).await;
    let before = refused();
    let failed = both().await;
    assert!(
        matches!(failed, Err(Error::StoreUnavailable { .. })),
        "{failed:?}"
    );
    assert_eq!(refused() - before, 4.0, "the first call, then three more");
    assert_eq!(step.migrate_keys().await, 1);
    step.finish().await;
    assert_eq!(both().await.unwrap(), [(true, 8), (true, 8)]);
}

/// Sixteen tasks taking one token at a time from one bucket, as fast as the store answers,
/// until stopped; the bucket holds more than they can take meanwhile, so every take is
/// admitted and the balance counts them.
struct Traffic {
    store: Arc<RedisStore>,
    key: String,
    limit: Limit,
    allowed: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    running: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Traffic {
    const CAPACITY: u64 = 1_000_000;

    /// Starts the traffic on `key`, through a store of its own.
    async fn start(cluster: &RedisCluster, key: String) -> Self {
        let limit = limit(Self::CAPACITY);
        let store = RedisStore::connect(
            &as_tollgate_user(&cluster.url()),
            RedisConfig::default().with_timeout(PATIENT),
        )
        .await
        .map(Arc::new)
        .expect("connect to the cluster");
        let allowed = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let running = Arc::new(AtomicBool::new(true));
        let tasks = (0..16)
            .map(|_| {
                let (store, key) = (store.clone(), key.clone());
                let (allowed, failed, running) = (allowed.clone(), failed.clone(), running.clone());
                tokio::spawn(async move {
                    while running.load(Ordering::Relaxed) {
                        match take(&store, &key, &limit, None).await {
                            Ok(decision) if decision.allowed() => {
                                allowed.fetch_add(1, Ordering::Relaxed);
                            }
                            Ok(decision) => panic!("rejected with room left: {decision:?}"),
                            Err(err) => {
                                if failed.fetch_add(1, Ordering::Relaxed) < 5 {
                                    eprintln!("failed: {err}");
                                }
                            }
                        }
                        // A store that fails fast must not starve the test's own task.
                        tokio::task::yield_now().await;
                    }
                })
            })
            .collect();
        Self {
            store,
            key,
            limit,
            allowed,
            failed,
            running,
            tasks,
        }
    }

    fn decided(&self) -> u64 {
        self.allowed.load(Ordering::Relaxed) + self.failed.load(Ordering::Relaxed)
    }

    /// Returns once `more` takes have been decided (or have failed) from now.
    async fn after(&self, more: u64) {
        let until = self.decided() + more;
        while self.decided() < until {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Stops the traffic and checks its accounting: every take decided and charged exactly
    /// once, never over-admitted.
    async fn stop_and_check(self) {
        self.running.store(false, Ordering::Relaxed);
        for task in self.tasks {
            task.await.expect("a task ran to the end");
        }
        let (allowed, failed) = (
            self.allowed.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        );
        // One more take reads what is left, wherever the bucket is now.
        let last = take(&self.store, &self.key, &self.limit, None)
            .await
            .expect("decided after the change");
        let left = last.remaining() + 1;
        assert!(
            allowed + left <= Self::CAPACITY,
            "over-admitted: {allowed} admitted and {left} left of {}",
            Self::CAPACITY
        );
        assert_eq!(
            (allowed + left, failed),
            (Self::CAPACITY, 0),
            "every call decided and charged once ({allowed} admitted)"
        );
    }
}

/// Decisions to see at each step of a change before the next.
const PER_STEP: u64 = 100;

/// A busy bucket's slot moves from master 1 to master `to` under traffic, step by step.
async fn a_busy_key_moved_mid_traffic_is_never_over_admitted(cluster: &RedisCluster, to: usize) {
    let key = key_of_master(cluster, &format!("busy-to-{to}"), 1);
    let step = SlotMove::new(cluster, slot_of(cluster, &key), 1, to);
    let traffic = Traffic::start(cluster, key).await;
    traffic.after(PER_STEP).await;
    step.begin().await;
    traffic.after(PER_STEP).await;
    assert!(step.migrate_keys().await >= 1, "the bucket went over");
    traffic.after(PER_STEP).await;
    step.finish().await;
    traffic.after(PER_STEP).await;
    traffic.stop_and_check().await;
}

/// A planned failover (`CLUSTER FAILOVER` on the replica: a rolling upgrade, say) under
/// traffic on a busy bucket of master 0, then back again. Redis pauses the master's clients
/// until its replica has every write, then swaps them; calls the old master then redirects
/// (`MOVED`) follow the slot. Nothing is lost, so the accounting is exact, and no call fails.
async fn a_planned_failover_and_back_under_traffic_loses_nothing(cluster: &RedisCluster) {
    let key = key_of_master(cluster, "planned", 0);
    let traffic = Traffic::start(cluster, key).await;
    traffic.after(PER_STEP).await;
    for (to, from) in [
        (cluster.replicas[0].port, cluster.nodes[0].port),
        (cluster.nodes[0].port, cluster.replicas[0].port),
    ] {
        let reply = command(to, &["CLUSTER", "FAILOVER"]);
        assert_eq!(reply.as_deref(), Some("+OK\r\n"));
        // Settled: every node knows the old master as a replica now (the masters vote for
        // the planned failover back only then), and that replica is in sync.
        let from_id = command(from, &["CLUSTER", "MYID"]).unwrap_or_default();
        let ports: Vec<u16> = cluster
            .nodes
            .iter()
            .chain(&cluster.replicas)
            .map(|node| node.port)
            .collect();
        let settled = async {
            loop {
                let demoted = ports.iter().all(|&port| {
                    command(port, &["CLUSTER", "NODES"]).is_some_and(|nodes| {
                        nodes
                            .lines()
                            .any(|line| line.starts_with(from_id.trim()) && line.contains("slave"))
                    })
                });
                let synced = command(from, &["INFO", "replication"])
                    .is_some_and(|info| info.contains("master_link_status:up"));
                if demoted && synced {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(20), settled)
            .await
            .expect("the replica took over");
        traffic.after(PER_STEP).await;
    }
    traffic.stop_and_check().await;
}

/// Master 0 dies; after the cluster's node timeout its replica takes over its slots. The store
/// answers "unavailable" meanwhile, within its timeout, and decides again once the replica is
/// master (by itself: nothing tells it), with the balance the bucket had: replication carried
/// it.
async fn a_master_failed_over_to_its_replica_keeps_its_buckets(
    cluster: &mut RedisCluster,
    store: &RedisStore,
) {
    let ten = limit(10);
    let key = key_of_master(cluster, "failover", 0);
    for left in ["9", "8", "7", "6"] {
        assert_eq!(remaining(store, &key, &ten, None).await, left);
    }
    // Redis replicates asynchronously: wait until the replica has the writes, as a failover
    // would lose the last ones otherwise (a bounded under-charge, not this test's subject).
    let barrier = format!("{key}barrier");
    let replicated = wait_for_replicas(cluster.nodes[0].port, &barrier, 1, PATIENT);
    assert_eq!(replicated, Some(1));

    cluster.nodes[0].kill();
    let noticed = tokio::time::timeout(PATIENT * 3, take(store, &key, &ten, None))
        .await
        .expect("an answer within the timeout bound, not a hang");
    assert!(
        matches!(noticed, Err(Error::StoreUnavailable { .. })),
        "the store noticed the dead master: {noticed:?}"
    );
    promoted(cluster, cluster.replicas[0].port).await;
    let (first, _) = until_decided(PATIENT * 3, || take(store, &key, &ten, None)).await;
    assert!(first.allowed());
    assert_eq!(first.remaining(), 5, "the replica carried the balance over");
}

/// Waits until the replica on `port` is a master and the cluster serves every slot again:
/// each live node says `cluster_state:ok`. The election is Redis' and usually done in a few
/// seconds (the node timeout, then a vote of the masters); but a master that voted in the
/// planned failover moments before refuses to vote again for a while, and a replica whose
/// elections keep failing for long enough judges its data too old to stand at all. And a
/// replica that does become master can claim its slots with a configuration epoch no greater
/// than the dead master's (seen here after the planned failover and back: the two tied), so
/// the other masters keep the slots on the dead one and the cluster stays down. So when the
/// cluster has not recovered in 20 s, the replica is told to take over without a vote, or,
/// if it is a master already, to raise its epoch above every other (`CLUSTER BUMPEPOCH`), as an
/// operator would: what comes after, the store finding the new master, is this test's subject.
async fn promoted(cluster: &RedisCluster, port: u16) {
    let live: Vec<u16> = cluster.nodes[1..]
        .iter()
        .chain(&cluster.replicas)
        .map(|node| node.port)
        .collect();
    let is_master =
        || command(port, &["INFO", "replication"]).is_some_and(|info| info.contains("role:master"));
    let recovered = || {
        is_master()
            && live.iter().all(|&node| {
                command(node, &["CLUSTER", "INFO"])
                    .is_some_and(|info| info.contains("cluster_state:ok"))
            })
    };
    let within = |limit: Duration| async move {
        tokio::time::timeout(limit, async {
            while !recovered() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .is_ok()
    };
    if within(Duration::from_secs(20)).await {
        return;
    }
    let nodes = command(port, &["CLUSTER", "NODES"]).unwrap_or_default();
    let (nudge, answer): (&[&str], &[&str]) = if is_master() {
        eprintln!(
            "the cluster is down 20 s on; the new master raises its epoch. Its view:\n{nodes}"
        );
        (&["CLUSTER", "BUMPEPOCH"], &["+BUMPED", "+STILL"])
    } else {
        eprintln!("no election in 20 s; the replica takes over. Its view:\n{nodes}");
        (&["CLUSTER", "FAILOVER", "TAKEOVER"], &["+OK"])
    };
    let reply = command(port, nudge).unwrap_or_default();
    assert!(
        answer.iter().any(|ok| reply.starts_with(ok)),
        "{nudge:?}: {reply}"
    );
    assert!(
        within(Duration::from_secs(10)).await,
        "the cluster serves every slot again"
    );
}
