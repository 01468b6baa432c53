//! The store's connection to Redis, and its replacement when it stops answering.
//!
//! redis-rs reconnects by itself when a connection breaks (a reset, a closed socket), but not
//! when it merely goes silent: a timeout is not an error it reconnects on. A connection goes
//! silent for good when its peer vanishes without closing it (a Redis pod replaced behind the
//! same name, a firewall or NAT that forgot the flow): the kernel gives up on it only after
//! minutes of retransmissions, and until then every decision would wait out its timeout and
//! take its failure mode, though Redis is reachable on a new connection. So the store replaces
//! the connection itself when the circuit breaker opens, whenever a probe fails and when a
//! readiness `PING` goes unanswered (see [`Link::renew`]); a connection that was merely slow
//! costs a reconnect, at most once per connection timeout.
//!
//! A new connection is opened by a task of its own, not by the decisions that will use it:
//! they wait only their own short timeout, and a connection that must finish a handshake over
//! a slow network would otherwise be abandoned, and replaced, before it was ever up.
//!
//! Behind Redis Sentinel a new connection goes to the master the sentinels name at the time, so
//! the same replacement follows a failover: the old master's calls fail (dead, or refusing
//! writes once demoted), the breaker opens, and the next connection leads to the new one.
//!
//! A cluster none of whose nodes answers when the store starts, or sentinels none of which
//! names a master that answers, leave it without a connection ([`Connection::Unopened`])
//! rather than stopping the process: a task keeps trying until one opens. Processes started
//! together with their Redis (a whole site powered up, a test environment) would otherwise
//! exit, and be restarted with ever longer pauses, when they can serve from their failure
//! modes and be ready as soon as Redis is.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use arc_swap::ArcSwap;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo};
use redis::sentinel::SentinelClient;
use redis::{Cmd, ErrorKind, FromRedisValue, RedisError};
use tollgate::{Clock, MonotonicClock, Timestamp};

use crate::cluster::{DirectConnections, query_cluster};

/// One connection to a single node (multiplexed, reconnecting on errors), or to a cluster
/// (with the store's own connections to single nodes, for the calls redirections send there).
#[derive(Clone)]
pub(crate) enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection, Arc<DirectConnections>),
    /// Not connected yet (no cluster node, or no sentinel, has answered): every call fails at
    /// once, as a connection failure.
    Unopened,
}

/// The failure of every call made while [`Connection::Unopened`].
fn unopened() -> RedisError {
    RedisError::from((ErrorKind::Io, "no connection to Redis yet"))
}

impl Connection {
    /// Sends `call`, expecting a `T` back: the take script's packed string, the lease
    /// script's list.
    pub(crate) async fn query<T: FromRedisValue>(&self, call: &Cmd) -> Result<T, RedisError> {
        match self.clone() {
            Connection::Single(mut connection) => call.query_async(&mut connection).await,
            Connection::Cluster(mut connection, direct) => {
                query_cluster(&mut connection, &direct, call).await
            }
            Connection::Unopened => Err(unopened()),
        }
    }

    pub(crate) async fn ping(&self) -> Result<(), RedisError> {
        let ping = redis::cmd("PING");
        match self.clone() {
            Connection::Single(mut connection) => ping.query_async(&mut connection).await,
            // Any master's answer will do: the client sends `PING` to every master and wants
            // all of them to answer, so one master down (or paused: a timeout) made every
            // process sharing the cluster unready at once, which brings no master back.
            Connection::Cluster(mut connection, _) => connection
                .route_command(
                    ping,
                    RoutingInfo::MultiNode((
                        MultipleNodeRoutingInfo::AllMasters,
                        Some(ResponsePolicy::OneSucceeded),
                    )),
                )
                .await
                .map(drop),
            Connection::Unopened => Err(unopened()),
        }
    }
}

/// How to open a connection like the current one.
pub(crate) enum Opener {
    Single(redis::Client, ConnectionManagerConfig),
    Cluster(ClusterClient, Arc<DirectConnections>),
    /// Ask Redis Sentinel which server is the master, then connect to it as to a single node.
    Sentinel(Arc<SentinelMaster>),
}

/// The master a group of sentinels names for a service.
pub(crate) struct SentinelMaster {
    /// Asks the sentinels in turn; one question at a time.
    sentinels: tokio::sync::Mutex<SentinelClient>,
    /// For the master's connection, as for a single node's.
    manager: ConnectionManagerConfig,
    /// The longest the sentinels and the master may take to answer who the master is.
    timeout: Duration,
}

impl SentinelMaster {
    pub(crate) fn new(
        sentinels: SentinelClient,
        manager: ConnectionManagerConfig,
        timeout: Duration,
    ) -> Self {
        Self {
            sentinels: tokio::sync::Mutex::new(sentinels),
            manager,
            timeout,
        }
    }

    /// A connection to the master the sentinels name now (which, asked, says it is one).
    async fn connect(&self) -> Result<Connection, RedisError> {
        let asked = async { self.sentinels.lock().await.async_get_client().await };
        let client = tokio::time::timeout(self.timeout, asked)
            .await
            .map_err(|_| {
                RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the sentinels did not name a master in time",
                ))
            })??;
        let connection = client.get_connection_manager_lazy(self.manager.clone())?;
        Ok(Connection::Single(connection))
    }
}

impl Opener {
    /// Opens a connection like the current one: a single node's lazily; a cluster's, or the
    /// sentinels' master's, once the network has answered (the cluster's layout, the master's
    /// address), so this waits on it.
    pub(crate) async fn open(&self) -> Result<Connection, RedisError> {
        match self {
            Opener::Single(client, config) => Ok(Connection::Single(
                client.get_connection_manager_lazy(config.clone())?,
            )),
            Opener::Cluster(client, direct) => Ok(Connection::Cluster(
                client.get_async_connection().await?,
                Arc::clone(direct),
            )),
            Opener::Sentinel(master) => master.connect().await,
        }
    }

    /// What the connections lead to, for log lines.
    fn target(&self) -> &'static str {
        match self {
            Opener::Single(..) => "Redis",
            Opener::Cluster(..) => "the cluster",
            Opener::Sentinel(..) => "the master the sentinels name",
        }
    }
}

/// The connection every call of a store takes, replaceable while calls are in flight: calls
/// already on the old connection finish (or time out) on it, new ones take the new one.
pub(crate) struct Link {
    current: ArcSwap<Connection>,
    opener: Opener,
    /// A cluster connection is opened asynchronously: one replacement at a time.
    renewing: AtomicBool,
    /// The longest a connection may take to open.
    connect_timeout: Duration,
    /// When the current connection was opened: a younger one than `connect_timeout` may still
    /// be connecting, and is not replaced.
    opened: Mutex<Timestamp>,
    clock: MonotonicClock,
}

impl Link {
    /// A link over `connection`, which it starts opening now (a single node's connection is
    /// lazy until then).
    pub(crate) fn new(connection: Connection, opener: Opener, connect_timeout: Duration) -> Self {
        let clock = MonotonicClock::new();
        open_in_background(&connection, connect_timeout);
        Self {
            current: ArcSwap::from_pointee(connection),
            opener,
            renewing: AtomicBool::new(false),
            connect_timeout,
            opened: Mutex::new(clock.now()),
            clock,
        }
    }

    /// The connection to send the next call on.
    pub(crate) fn get(&self) -> Connection {
        Connection::clone(&self.current.load())
    }

    /// A link that could not open its first connection (no cluster node, or no sentinel,
    /// answered): calls fail as connection failures while a task tries again, ever less often
    /// up to every [`UNOPENED_RETRY_MAX`], until one opens.
    pub(crate) fn unopened(opener: Opener, connect_timeout: Duration) -> Arc<Self> {
        let link = Arc::new(Self::new(Connection::Unopened, opener, connect_timeout));
        // Held for good by the task below: a `renew` meanwhile would only open a second one.
        link.renewing.store(true, Ordering::Release);
        // Not kept alive by its own task: a store dropped meanwhile stops the tries.
        let task = Arc::downgrade(&link);
        tokio::spawn(async move {
            let mut pause = UNOPENED_RETRY_MIN;
            loop {
                tokio::time::sleep(pause).await;
                let Some(link) = task.upgrade() else { break };
                match link.opener.open().await {
                    Ok(connection) => {
                        tracing::info!("redis store: connected to {}", link.opener.target());
                        open_in_background(&connection, link.connect_timeout);
                        link.current.store(Arc::new(connection));
                        link.renewing.store(false, Ordering::Release);
                        break;
                    }
                    Err(err) => {
                        tracing::debug!(
                            "redis store: still cannot reach {}: {err}",
                            link.opener.target()
                        );
                        pause = (pause * 2).min(UNOPENED_RETRY_MAX);
                    }
                }
            }
        });
        link
    }

    /// Drops the current connection for a new one, unless the current one is still within its
    /// time to open. A single node's replaces it at once and opens in the background; a
    /// cluster's, or the sentinels' master's, is opened in the background (the cluster's layout
    /// or the master's address must be asked first) and replaces the current one only once it
    /// is up, so a cluster or sentinels that cannot be reached keep the connection there was.
    pub(crate) fn renew(self: &Arc<Self>) {
        {
            let now = self.clock.now();
            let mut opened = self.opened.lock().unwrap_or_else(PoisonError::into_inner);
            if now < *opened + self.connect_timeout {
                return;
            }
            *opened = now;
        }
        match &self.opener {
            Opener::Single(client, config) => {
                match client.get_connection_manager_lazy(config.clone()) {
                    Ok(connection) => {
                        tracing::warn!("redis store: replacing its connection to Redis");
                        let connection = Connection::Single(connection);
                        open_in_background(&connection, self.connect_timeout);
                        self.current.store(Arc::new(connection));
                    }
                    Err(err) => tracing::warn!("redis store: cannot open a connection: {err}"),
                }
            }
            Opener::Cluster(..) | Opener::Sentinel(..) => {
                if self.renewing.swap(true, Ordering::AcqRel) {
                    return;
                }
                let link = Arc::clone(self);
                tokio::spawn(async move {
                    match link.opener.open().await {
                        Ok(connection) => {
                            tracing::warn!(
                                "redis store: replacing its connections to {}",
                                link.opener.target()
                            );
                            open_in_background(&connection, link.connect_timeout);
                            link.current.store(Arc::new(connection));
                        }
                        Err(err) => tracing::warn!(
                            "redis store: cannot reconnect to {}: {err}",
                            link.opener.target()
                        ),
                    }
                    link.renewing.store(false, Ordering::Release);
                });
            }
        }
    }
}

/// The first pause before a cluster, or sentinels, that did not answer at the start are tried
/// again.
const UNOPENED_RETRY_MIN: Duration = Duration::from_millis(100);

/// The longest pause between tries at a cluster, or sentinels, that have not answered since the
/// start: a process started before its Redis is ready within this long of it.
const UNOPENED_RETRY_MAX: Duration = Duration::from_secs(1);

/// Drives `connection` open (a `PING` it must answer) in a task of its own, for at most
/// `timeout`: a lazy connection otherwise advances only while some decision waits on it.
fn open_in_background(connection: &Connection, timeout: Duration) {
    if matches!(connection, Connection::Unopened) {
        return;
    }
    let connection = connection.clone();
    tokio::spawn(async move {
        let _ = tokio::time::timeout(timeout, connection.ping()).await;
    });
}

#[cfg(test)]
mod tests {
    use redis::IntoConnectionInfo;
    use redis::sentinel::{SentinelClientBuilder, SentinelServerType};

    use super::*;

    /// Log lines about connecting say what the store connects to, one name for each way of
    /// reaching Redis.
    #[test]
    fn each_opener_names_what_it_leads_to() {
        let url = "redis://127.0.0.1:1";
        let manager = ConnectionManagerConfig::new();
        let single = Opener::Single(redis::Client::open(url).expect("a URL"), manager.clone());
        let direct = DirectConnections::new(
            url.into_connection_info().expect("a URL"),
            None,
            Duration::from_secs(1),
        );
        let cluster = Opener::Cluster(
            ClusterClient::new(vec![url]).expect("a cluster client"),
            Arc::new(direct),
        );
        let sentinels = SentinelClientBuilder::new(
            [url.into_connection_info().expect("a URL").addr().clone()],
            "cache",
            SentinelServerType::Master,
        )
        .and_then(|builder| builder.build())
        .expect("a sentinel client");
        let sentinel = Opener::Sentinel(Arc::new(SentinelMaster::new(
            sentinels,
            manager,
            Duration::from_secs(1),
        )));
        assert_eq!(
            [single.target(), cluster.target(), sentinel.target()],
            ["Redis", "the cluster", "the master the sentinels name"]
        );
    }
}
