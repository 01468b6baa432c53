//! A script call on Redis Cluster while the cluster changes shape: redirections followed here,
//! not by the cluster client.
//!
//! While a slot moves from one master to another (a rebalance, or a cluster growing), a call on
//! one of its keys meets `ASK` (the key has gone over: ask the new owner, once) and, once the
//! move is done, `MOVED`. redis-rs 1.8 follows an `ASK` by sending `ASKING` on its own and then
//! the call, on a connection other requests share: with calls in flight together, another
//! request can come between the two and take the one-shot flag, and the call then meets `MOVED`
//! back to the slot's old owner, which sends it on with `ASK` again, until its retries run out.
//! Every call on a slot being moved failed that way in a test with sixteen tasks, and three
//! failures in a row open the store's circuit breaker, for every key: a routine reshard put the
//! whole store into its failure mode. So the cluster client is built with no retries of its
//! own (see `RedisStore::connect`), and [`query_cluster`] follows redirections: `ASKING` and
//! the call go as one pipeline, which nothing can come between.
//!
//! A slot moving to a master that has just joined goes to a node the cluster client has no
//! connection to (it learns of a node once the node owns a slot), and it routes calls only over
//! connections it has. [`UnknownNodes`] opens the store's own to such a node, with the
//! cluster's credentials and TLS settings, for the redirected calls until the move is done.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{
    AsyncConnectionConfig, Cmd, ConnectionAddr, ConnectionInfo, ErrorKind, RedisError, RetryMethod,
    TlsCertificates, Value,
};

/// Attempts a call makes after its first: a slot being moved sends a call from its old owner
/// to its new one (`ASK`), a finished move from a stale owner to the new one (`MOVED`), so two
/// suffice; one more covers a move that finishes between them, or a dropped connection.
const RETRIES: usize = 3;

/// How long a `TRYAGAIN` (a call over several keys of a slot whose keys are part moved) or a
/// cluster that is reconfiguring waits before the call goes again. The caller's timeout bounds
/// all the attempts together.
const PAUSE: Duration = Duration::from_millis(1);

/// The most nodes the store keeps connections of its own to. They are wanted only while a slot
/// moves to a node the cluster client does not know yet; past this many, they are all dropped
/// and opened again as needed.
const MAX_UNKNOWN: usize = 16;

/// `call` on the cluster, following redirections, a `TRYAGAIN` and a dropped connection.
pub(crate) async fn query_cluster(
    connection: &mut ClusterConnection,
    unknown: &UnknownNodes,
    call: &Cmd,
) -> Result<Vec<u8>, RedisError> {
    let mut reply = call.query_async(connection).await;
    for _ in 0..RETRIES {
        let err = match reply {
            Ok(reply) => return Ok(reply),
            Err(err) => err,
        };
        let node = err
            .redirect_node()
            .and_then(|(node, _slot)| node_address(node));
        reply = match (err.retry_method(), node) {
            (RetryMethod::AskRedirect, Some((host, port))) => {
                send_to(connection, unknown, host, port, call, Asking::Yes).await
            }
            (RetryMethod::MovedRedirect, Some((host, port))) => {
                send_to(connection, unknown, host, port, call, Asking::No).await
            }
            (RetryMethod::WaitAndRetry, _) => {
                tokio::time::sleep(PAUSE).await;
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

/// Whether a call goes after `ASKING`, as an `ASK` wants.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Asking {
    Yes,
    No,
}

/// `call` on the node at `host:port`: over the cluster client's connection to it, or over the
/// store's own when the client has none.
async fn send_to(
    connection: &mut ClusterConnection,
    unknown: &UnknownNodes,
    host: &str,
    port: u16,
    call: &Cmd,
    asking: Asking,
) -> Result<Vec<u8>, RedisError> {
    let route = SingleNodeRoutingInfo::ByAddress {
        host: host.to_owned(),
        port,
    };
    let reply = match asking {
        // The call's reply alone: skip `ASKING`'s.
        Asking::Yes => connection
            .route_pipeline(asking_then(call), 1, 1, route)
            .await
            .and_then(only_string),
        Asking::No => connection
            .route_command(call.clone(), RoutingInfo::SingleNode(route))
            .await
            .and_then(string),
    };
    match reply {
        Err(err) if err.kind() == ErrorKind::ClusterConnectionNotFound => {
            unknown.query(host, port, call, asking).await
        }
        reply => reply,
    }
}

/// `ASKING`, then `call`, to be sent as one.
fn asking_then(call: &Cmd) -> redis::Pipeline {
    let mut pipeline = redis::pipe();
    pipeline.cmd("ASKING").add_command(call.clone());
    pipeline
}

fn string(reply: Value) -> Result<Vec<u8>, RedisError> {
    Ok(redis::from_redis_value(reply.extract_error()?)?)
}

/// The only reply in `replies`, as a string.
fn only_string(replies: Vec<Value>) -> Result<Vec<u8>, RedisError> {
    let reply = replies
        .into_iter()
        .next()
        .ok_or_else(|| RedisError::from((ErrorKind::Client, "an empty pipeline reply")))?;
    string(reply)
}

/// The host and port of a node named in a redirection, `host:port` (`[v6]:port` too).
fn node_address(node: &str) -> Option<(&str, u16)> {
    let (host, port) = node.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port = port.parse().ok()?;
    (!host.is_empty()).then_some((host, port))
}

/// The store's own connections to cluster nodes the cluster client has none to.
pub(crate) struct UnknownNodes {
    /// A node of the cluster as configured: its credentials and whether it speaks TLS are every
    /// node's.
    template: ConnectionInfo,
    certificates: Option<TlsCertificates>,
    connect_timeout: Duration,
    open: Mutex<HashMap<(String, u16), MultiplexedConnection>>,
}

impl UnknownNodes {
    pub(crate) fn new(
        template: ConnectionInfo,
        certificates: Option<TlsCertificates>,
        connect_timeout: Duration,
    ) -> Self {
        Self {
            template,
            certificates,
            connect_timeout,
            open: Mutex::new(HashMap::new()),
        }
    }

    async fn query(
        &self,
        host: &str,
        port: u16,
        call: &Cmd,
        asking: Asking,
    ) -> Result<Vec<u8>, RedisError> {
        let mut connection = self.connection(host, port).await?;
        let reply = match asking {
            Asking::Yes => {
                let mut pipeline = redis::pipe();
                pipeline.cmd("ASKING").ignore().add_command(call.clone());
                pipeline
                    .query_async::<(Vec<u8>,)>(&mut connection)
                    .await
                    .map(|(reply,)| reply)
            }
            Asking::No => call.query_async(&mut connection).await,
        };
        if reply
            .as_ref()
            .is_err_and(|err| err.is_io_error() || err.is_connection_dropped() || err.is_timeout())
        {
            self.lock().remove(&(host.to_owned(), port));
        }
        reply
    }

    async fn connection(&self, host: &str, port: u16) -> Result<MultiplexedConnection, RedisError> {
        let key = (host.to_owned(), port);
        if let Some(connection) = self.lock().get(&key) {
            return Ok(connection.clone());
        }
        let address = match self.template.addr() {
            ConnectionAddr::TcpTls { insecure, .. } => ConnectionAddr::TcpTls {
                host: host.to_owned(),
                port,
                insecure: *insecure,
                tls_params: None,
            },
            _ => ConnectionAddr::Tcp(host.to_owned(), port),
        };
        let info = self.template.clone().set_addr(address);
        let client = match &self.certificates {
            Some(certificates) => redis::Client::build_with_tls(info, certificates.clone())?,
            None => redis::Client::open(info)?,
        };
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.connect_timeout))
            .set_response_timeout(None);
        let connection = client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        let mut open = self.lock();
        if open.len() >= MAX_UNKNOWN {
            open.clear();
        }
        open.insert(key, connection.clone());
        Ok(connection)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, u16), MultiplexedConnection>> {
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::node_address;

    #[test]
    fn a_redirection_names_the_node_to_send_to() {
        assert_eq!(node_address("127.0.0.1:7001"), Some(("127.0.0.1", 7001)));
        assert_eq!(node_address("[::1]:7002"), Some(("::1", 7002)));
        assert_eq!(
            node_address("redis-0.cache:6379"),
            Some(("redis-0.cache", 6379))
        );
        for bad in ["", "7001", ":7001", "host:", "host:70000", "host:port"] {
            assert_eq!(node_address(bad), None, "{bad:?}");
        }
    }
}
