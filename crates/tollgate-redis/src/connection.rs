//! The store's connection to Redis, and its replacement when it stops answering.
//!
//! redis-rs reconnects by itself when a connection breaks (a reset, a closed socket), but not
//! when it merely goes silent: a timeout is not an error it reconnects on. A connection goes
//! silent for good when its peer vanishes without closing it (a Redis pod replaced behind the
//! same name, a firewall or NAT that forgot the flow): the kernel gives up on it only after
//! minutes of retransmissions, and until then every decision would wait out its timeout and
//! take its failure mode, though Redis is reachable on a new connection. So the store replaces
//! the connection itself when the circuit breaker opens and whenever a probe fails (see
//! [`Link::renew`]); a connection that was merely slow costs a reconnect, once per breaker
//! trip.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use arc_swap::ArcSwap;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, RedisError};

/// One connection to a single node (multiplexed, reconnecting on errors), or to a cluster.
#[derive(Clone)]
pub(crate) enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl Connection {
    /// Sends `call`, expecting a list of integers back.
    pub(crate) async fn query(&self, call: &Cmd) -> Result<Vec<i64>, RedisError> {
        match self.clone() {
            Connection::Single(mut connection) => call.query_async(&mut connection).await,
            Connection::Cluster(mut connection) => call.query_async(&mut connection).await,
        }
    }

    pub(crate) async fn ping(&self) -> Result<(), RedisError> {
        let ping = redis::cmd("PING");
        match self.clone() {
            Connection::Single(mut connection) => ping.query_async(&mut connection).await,
            Connection::Cluster(mut connection) => ping.query_async(&mut connection).await,
        }
    }
}

/// How to open a connection like the current one.
pub(crate) enum Opener {
    Single(redis::Client, ConnectionManagerConfig),
    Cluster(ClusterClient),
}

/// The connection every call of a store takes, replaceable while calls are in flight: calls
/// already on the old connection finish (or time out) on it, new ones take the new one.
pub(crate) struct Link {
    current: ArcSwap<Connection>,
    opener: Opener,
    /// A cluster connection is opened asynchronously: one replacement at a time.
    renewing: AtomicBool,
}

impl Link {
    pub(crate) fn new(connection: Connection, opener: Opener) -> Self {
        Self {
            current: ArcSwap::from_pointee(connection),
            opener,
            renewing: AtomicBool::new(false),
        }
    }

    /// The connection to send the next call on.
    pub(crate) fn get(&self) -> Connection {
        Connection::clone(&self.current.load())
    }

    /// Drops the current connection for a new one. A single node's is opened lazily, by the
    /// next call; a cluster's is opened in the background (it must learn the cluster's layout)
    /// and replaces the current one only once it is up, so a cluster that cannot be reached
    /// keeps the connection it had.
    pub(crate) fn renew(self: &Arc<Self>) {
        match &self.opener {
            Opener::Single(client, config) => {
                match client.get_connection_manager_lazy(config.clone()) {
                    Ok(connection) => {
                        tracing::warn!("redis store: replacing its connection to Redis");
                        self.current.store(Arc::new(Connection::Single(connection)));
                    }
                    Err(err) => tracing::warn!("redis store: cannot open a connection: {err}"),
                }
            }
            Opener::Cluster(client) => {
                if self.renewing.swap(true, Ordering::AcqRel) {
                    return;
                }
                let (link, client) = (Arc::clone(self), client.clone());
                tokio::spawn(async move {
                    match client.get_async_connection().await {
                        Ok(connection) => {
                            tracing::warn!("redis store: replacing its connections to the cluster");
                            link.current
                                .store(Arc::new(Connection::Cluster(connection)));
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
