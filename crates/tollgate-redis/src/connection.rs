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

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use arc_swap::ArcSwap;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo};
use redis::{Cmd, RedisError};
use tollgate::{Clock, MonotonicClock, Timestamp};

use crate::cluster::{DirectConnections, query_cluster};

/// One connection to a single node (multiplexed, reconnecting on errors), or to a cluster
/// (with the store's own connections to single nodes, for the calls redirections send there).
#[derive(Clone)]
pub(crate) enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection, Arc<DirectConnections>),
}

impl Connection {
    /// Sends `call`, expecting a string back.
    pub(crate) async fn query(&self, call: &Cmd) -> Result<Vec<u8>, RedisError> {
        match self.clone() {
            Connection::Single(mut connection) => call.query_async(&mut connection).await,
            Connection::Cluster(mut connection, direct) => {
                query_cluster(&mut connection, &direct, call).await
            }
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
        }
    }
}

/// How to open a connection like the current one.
pub(crate) enum Opener {
    Single(redis::Client, ConnectionManagerConfig),
    Cluster(ClusterClient, Arc<DirectConnections>),
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

    /// Drops the current connection for a new one, unless the current one is still within its
    /// time to open. A single node's replaces it at once and opens in the background; a
    /// cluster's is opened in the background (it must learn the cluster's layout) and replaces
    /// the current one only once it is up, so a cluster that cannot be reached keeps the
    /// connection it had.
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
            Opener::Cluster(client, direct) => {
                if self.renewing.swap(true, Ordering::AcqRel) {
                    return;
                }
                let (link, client, direct) = (Arc::clone(self), client.clone(), Arc::clone(direct));
                tokio::spawn(async move {
                    match client.get_async_connection().await {
                        Ok(connection) => {
                            tracing::warn!("redis store: replacing its connections to the cluster");
                            link.current
                                .store(Arc::new(Connection::Cluster(connection, direct)));
                        }
                        Err(err) => {
                            tracing::warn!("redis store: cannot reconnect to the cluster: {err}");
                        }
                    }
                    link.renewing.store(false, Ordering::Release);
                });
            }
        }
    }
}

/// Drives `connection` open (a `PING` it must answer) in a task of its own, for at most
/// `timeout`: a lazy connection otherwise advances only while some decision waits on it.
fn open_in_background(connection: &Connection, timeout: Duration) {
    let connection = connection.clone();
    tokio::spawn(async move {
        let _ = tokio::time::timeout(timeout, connection.ping()).await;
    });
}
