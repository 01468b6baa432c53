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
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, ErrorKind, RedisError, RetryMethod, Value};
use tollgate::{Clock, MonotonicClock, Timestamp};

/// One connection to a single node (multiplexed, reconnecting on errors), or to a cluster.
#[derive(Clone)]
pub(crate) enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl Connection {
    /// Sends `call`, expecting a string back.
    pub(crate) async fn query(&self, call: &Cmd) -> Result<Vec<u8>, RedisError> {
        match self.clone() {
            Connection::Single(mut connection) => call.query_async(&mut connection).await,
            Connection::Cluster(mut connection) => query_cluster(&mut connection, call).await,
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

/// Attempts a cluster call makes after its first: a slot being moved sends a call from its old
/// owner to its new one (`ASK`), a finished move from a stale owner to the new one (`MOVED`), so
/// two suffice; one more covers a move that finishes between them, or a dropped connection.
const CLUSTER_RETRIES: usize = 3;

/// How long a `TRYAGAIN` (a call over several keys of a slot whose keys are part moved) or a
/// cluster that is reconfiguring waits before the call goes again. The caller's timeout bounds
/// all the attempts together.
const CLUSTER_PAUSE: Duration = Duration::from_millis(1);

/// `call` on the cluster, following redirections here rather than in redis-rs.
///
/// The cluster client is built with no retries of its own (see `RedisStore::connect`), so an
/// `ASK` or a `MOVED` comes back here. redis-rs 1.8 follows an `ASK` by sending `ASKING` on
/// its own and then the call, on a connection other requests share: with calls in flight
/// together, another request can come between the two and take the one-shot flag, and the call
/// then meets `MOVED` back to the slot's old owner, which sends it on with `ASK` again, until
/// its retries run out. Every call on a slot being moved failed that way in a test with sixteen
/// tasks, and three failures in a row open the circuit breaker, for every key. Here `ASKING`
/// and the call go as one pipeline, which nothing can come between.
async fn query_cluster(
    connection: &mut ClusterConnection,
    call: &Cmd,
) -> Result<Vec<u8>, RedisError> {
    let mut reply = call.query_async(connection).await;
    for _ in 0..CLUSTER_RETRIES {
        let err = match reply {
            Ok(reply) => return Ok(reply),
            Err(err) => err,
        };
        let redirect = err.redirect_node().and_then(|(node, _slot)| route_to(node));
        reply = match (err.retry_method(), redirect) {
            (RetryMethod::AskRedirect, Some(route)) => {
                let mut asking = redis::pipe();
                asking.cmd("ASKING").add_command(call.clone());
                // The call's reply alone: skip `ASKING`'s.
                connection
                    .route_pipeline(asking, 1, 1, route)
                    .await
                    .and_then(one_string)
            }
            (RetryMethod::MovedRedirect, Some(route)) => connection
                .route_command(call.clone(), RoutingInfo::SingleNode(route))
                .await
                .and_then(|value| Ok(redis::from_redis_value(value.extract_error()?)?)),
            (RetryMethod::WaitAndRetry, _) => {
                tokio::time::sleep(CLUSTER_PAUSE).await;
                call.query_async(connection).await
            }
            (
                RetryMethod::Reconnect
                | RetryMethod::ReconnectFromInitialConnections
                | RetryMethod::RefreshSlotsAndRetry
                | RetryMethod::RetryImmediately,
                _,
            ) => call.query_async(connection).await,
            _ => return Err(err),
        };
    }
    reply
}

/// The only reply of a pipeline's answer, as a string.
fn one_string(replies: Vec<Value>) -> Result<Vec<u8>, RedisError> {
    let reply = replies
        .into_iter()
        .next()
        .ok_or_else(|| RedisError::from((ErrorKind::Client, "an empty pipeline reply")))?;
    Ok(redis::from_redis_value(reply.extract_error()?)?)
}

/// The route to a node named in a redirection, `host:port` (`[v6]:port` too).
fn route_to(node: &str) -> Option<SingleNodeRoutingInfo> {
    let (host, port) = node.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port = port.parse().ok()?;
    (!host.is_empty()).then(|| SingleNodeRoutingInfo::ByAddress {
        host: host.to_owned(),
        port,
    })
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

/// Drives `connection` open (a `PING` it must answer) in a task of its own, for at most
/// `timeout`: a lazy connection otherwise advances only while some decision waits on it.
fn open_in_background(connection: &Connection, timeout: Duration) {
    let connection = connection.clone();
    tokio::spawn(async move {
        let _ = tokio::time::timeout(timeout, connection.ping()).await;
    });
}

#[cfg(test)]
mod tests {
    use redis::cluster_routing::SingleNodeRoutingInfo;

    use super::route_to;

    fn address(route: Option<SingleNodeRoutingInfo>) -> Option<(String, u16)> {
        match route? {
            SingleNodeRoutingInfo::ByAddress { host, port } => Some((host, port)),
            _ => None,
        }
    }

    #[test]
    fn a_redirection_names_the_node_to_route_to() {
        let at = |host: &str, port| Some((host.to_owned(), port));
        assert_eq!(address(route_to("127.0.0.1:7001")), at("127.0.0.1", 7001));
        assert_eq!(address(route_to("[::1]:7002")), at("::1", 7002));
        assert_eq!(
            address(route_to("redis-0.cache:6379")),
            at("redis-0.cache", 6379)
        );
        for bad in ["", "7001", ":7001", "host:", "host:70000", "host:port"] {
            assert_eq!(address(route_to(bad)), None, "{bad:?}");
        }
    }
}
