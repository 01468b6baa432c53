//! The throwaway servers of `src/test_server.rs`, compiled into the tests directly (a crate's
//! tests cannot turn on its own features).

#[allow(dead_code, unreachable_pub)]
#[path = "../../src/test_server.rs"]
mod test_server;

#[allow(unused_imports)]
pub(crate) use test_server::*;

use tollgate::{CheckRequest, Decision, Error, Limit, Store, Take, Timestamp};

/// Checks one unit of `limit` on `key` at `now` (Redis' own time when `None`).
#[allow(dead_code)] // not every test binary uses it
pub(crate) async fn take_one_unit(
    store: &impl Store,
    key: &str,
    limit: &Limit,
    now: Option<Timestamp>,
) -> Result<Vec<Decision>, Error> {
    let takes = [Take::new(key, limit, 1)];
    store
        .check(CheckRequest {
            takes: &takes,
            request_id: None,
            now,
        })
        .await
}

/// A connection to one node, for the commands that move a slot.
#[allow(dead_code)] // not every test binary moves slots
pub(crate) async fn node(port: u16) -> redis::aio::MultiplexedConnection {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .expect("a node's URL")
        .get_multiplexed_async_connection()
        .await
        .expect("connect to a node")
}

/// The slot move Redis documents (what `redis-cli --cluster reshard` does), one step at a time:
/// the target imports, the source migrates, the keys go over, then every node learns the new
/// owner.
#[allow(dead_code)]
pub(crate) struct SlotMove {
    slot: u16,
    source: u16,
    /// The new owner's port.
    pub(crate) target: u16,
    /// The port the source sends keys to: the target's TLS port in a cluster that speaks TLS
    /// between nodes.
    target_migrate: u16,
    source_id: String,
    target_id: String,
    /// Every master's port, to announce the new owner to all.
    masters: Vec<u16>,
}

#[allow(dead_code)]
impl SlotMove {
    pub(crate) fn new(cluster: &RedisCluster, slot: u16, from: usize, to: usize) -> Self {
        Self {
            slot,
            source: cluster.nodes[from].port,
            target: cluster.nodes[to].port,
            target_migrate: cluster.nodes[to].tls_port.unwrap_or(cluster.nodes[to].port),
            source_id: cluster.node_id(from),
            target_id: cluster.node_id(to),
            masters: cluster.nodes.iter().map(|node| node.port).collect(),
        }
    }

    /// The slot is `MIGRATING` on the source and `IMPORTING` on the target: keys still on the
    /// source are served there, the rest are redirected (`ASK`) to the target.
    pub(crate) async fn begin(&self) {
        let slot = self.slot.to_string();
        let setslot = |port: u16, state: &'static str, id: String| {
            let slot = slot.clone();
            async move {
                let reply: String = redis::cmd("CLUSTER")
                    .arg(&["SETSLOT", &slot, state, &id][..])
                    .query_async(&mut node(port).await)
                    .await
                    .unwrap_or_else(|err| panic!("SETSLOT {state}: {err}"));
                assert_eq!(reply, "OK");
            }
        };
        setslot(self.target, "IMPORTING", self.source_id.clone()).await;
        setslot(self.source, "MIGRATING", self.target_id.clone()).await;
    }

    /// Moves every key of the slot still on the source to the target. Returns how many went.
    pub(crate) async fn migrate_keys(&self) -> usize {
        let mut source = node(self.source).await;
        let keys: Vec<String> = redis::cmd("CLUSTER")
            .arg("GETKEYSINSLOT")
            .arg(self.slot)
            .arg(1_000)
            .query_async(&mut source)
            .await
            .expect("GETKEYSINSLOT");
        if keys.is_empty() {
            return 0;
        }
        self.migrate(&keys).await;
        keys.len()
    }

    /// Moves `keys`, all on the source, to the target.
    pub(crate) async fn migrate(&self, keys: &[String]) {
        let mut source = node(self.source).await;
        let reply: String = redis::cmd("MIGRATE")
            .arg("127.0.0.1")
            .arg(self.target_migrate)
            .arg("") // several keys, named after KEYS
            .arg(0) // database
            .arg(5_000) // ms
            .arg("KEYS")
            .arg(keys)
            .query_async(&mut source)
            .await
            .expect("MIGRATE");
        assert_eq!(reply, "OK");
    }

    /// Every master now says the target owns the slot.
    pub(crate) async fn finish(&self) {
        for &port in [self.target, self.source].iter().chain(&self.masters) {
            let reply: String = redis::cmd("CLUSTER")
                .arg(&["SETSLOT", &self.slot.to_string(), "NODE", &self.target_id][..])
                .query_async(&mut node(port).await)
                .await
                .expect("SETSLOT NODE");
            assert_eq!(reply, "OK");
        }
    }
}

/// Creates, on the server at `port`, the least-privileged user tollgate can run as, as the
/// README gives it: `tollgate`, password `secret`, with the commands a topology adds (a
/// cluster's `+cluster|slots +asking`, a sentinel's master's `+role`).
#[allow(dead_code)] // not every test binary runs as that user
pub(crate) fn grant_tollgate_user(port: u16, topology: &[&str]) {
    let mut acl = vec![
        "ACL",
        "SETUSER",
        "tollgate",
        "on",
        ">secret",
        "resetkeys",
        "~tollgate:*",
        "~{*}rid:*",
        "resetchannels",
        "-@all",
        "+evalsha",
        "+eval",
        "+ping",
        "+time",
        "+get",
        "+set",
        "+del",
    ];
    acl.extend(topology);
    assert_eq!(command(port, &acl).as_deref(), Some("+OK\r\n"));
}

/// What a cluster's nodes add to [`grant_tollgate_user`].
#[allow(dead_code)]
pub(crate) const CLUSTER_COMMANDS: &[&str] = &["+cluster|slots", "+asking"];

/// What a sentinel's master (and the replicas it may promote) add to [`grant_tollgate_user`]:
/// the store asks the master the sentinels name whether it is one.
#[allow(dead_code)]
pub(crate) const SENTINEL_COMMANDS: &[&str] = &["+role"];

/// What concurrency limits (leases, `src/lease.rs`) add to [`grant_tollgate_user`]: their
/// sorted sets' commands, and `PEXPIRE` for the sets' expiry.
#[allow(dead_code)]
pub(crate) const LEASE_COMMANDS: &[&str] = &[
    "+zadd",
    "+zrem",
    "+zremrangebyscore",
    "+zcard",
    "+zcount",
    "+zrange",
    "+zrangebyscore",
    "+zscore",
    "+pexpire",
];

/// What sliding logs add to [`grant_tollgate_user`]: their lists' commands (a log is a list,
/// see `scripts/take.lua`), and `PEXPIRE` for their expiry.
#[allow(dead_code)]
pub(crate) const LOG_COMMANDS: &[&str] =
    &["+lrange", "+lset", "+ltrim", "+rpush", "+lrem", "+pexpire"];

/// `url` (`redis://` or `redis+cluster://`) as the user of [`grant_tollgate_user`].
#[allow(dead_code)]
pub(crate) fn as_tollgate_user(url: &str) -> String {
    url.replacen("://", "://tollgate:secret@", 1)
}

/// Runs `attempt` until the store decides, after a master died: each attempt must end within
/// `bound` (the timeout bound, not a hang) and fail, until then, only as unavailable. Returns
/// the decision and how many attempts were unavailable.
#[allow(dead_code)] // not every test binary fails a master over
pub(crate) async fn until_decided<T, F, Fut>(bound: std::time::Duration, attempt: F) -> (T, u32)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, Error>>,
{
    let started = tokio::time::Instant::now();
    let mut unavailable = 0;
    let mut last = String::new();
    loop {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "no decision within a minute of the master's death ({unavailable} attempts \
             unavailable, the last: {last})"
        );
        let outcome = tokio::time::timeout(bound, attempt())
            .await
            .expect("an answer within the timeout bound, not a hang");
        match outcome {
            Ok(decided) => return (decided, unavailable),
            Err(err @ Error::StoreUnavailable { .. }) => {
                last = err.to_string();
                unavailable += 1;
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(err) => panic!("an unavailable store, not {err}"),
        }
    }
}

/// Raw commands on the keys a store leaves behind, on a single node or a cluster. Test files
/// add the readings they need in `impl Inspector` blocks of their own.
#[allow(dead_code)] // not every test binary inspects keys
pub(crate) enum Inspector {
    Single(redis::aio::MultiplexedConnection),
    Cluster(redis::cluster_async::ClusterConnection),
}

#[allow(dead_code)]
impl Inspector {
    pub(crate) async fn single(server: &RedisServer) -> Self {
        let client = redis::Client::open(server.url()).expect("a URL");
        Self::Single(
            client
                .get_multiplexed_async_connection()
                .await
                .expect("connect"),
        )
    }

    pub(crate) async fn cluster(cluster: &RedisCluster) -> Self {
        let nodes: Vec<String> = cluster
            .nodes
            .iter()
            .map(|node| format!("redis://127.0.0.1:{}", node.port))
            .collect();
        let client = redis::cluster::ClusterClient::new(nodes).expect("the nodes");
        Self::Cluster(client.get_async_connection().await.expect("connect"))
    }

    pub(crate) async fn query<T: redis::FromRedisValue>(&mut self, args: &[&str]) -> T {
        let mut cmd = redis::cmd(args[0]);
        for arg in &args[1..] {
            cmd.arg(*arg);
        }
        match self {
            Inspector::Single(connection) => cmd.query_async(connection).await,
            Inspector::Cluster(connection) => cmd.query_async(connection).await,
        }
        .unwrap_or_else(|err| panic!("{args:?}: {err}"))
    }
}

/// Asserts that Redis refused one `EVALSHA` and was sent no `EVAL` after it: only a missing
/// script is sent again as its source.
#[allow(dead_code)] // not every test binary uses it
pub(crate) fn assert_refused_once_and_not_sent_again(port: u16) {
    let stats = command(port, &["INFO", "commandstats"]).unwrap_or_default();
    assert_eq!(
        info_field(&stats, "cmdstat_evalsha:", "rejected_calls"),
        1.0,
        "{stats}"
    );
    assert!(!stats.contains("cmdstat_eval:"), "{stats}");
}
