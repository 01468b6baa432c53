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
//! failures in a row open the store's circuit breaker. So the cluster client is built with no
//! retries of its own (see `RedisStore::connect`), and [`query_cluster`] follows redirections
//! over connections of the store's own to the nodes they name ([`DirectConnections`]), with
//! `ASKING` and the call sent as one pipeline, which nothing can come between.
//!
//! Its own, not the cluster client's: the client routes a call to a named node only over a
//! connection it has, and it has none to a master that has just joined (it learns of a node
//! once the node owns a slot); and a call it cannot route that way makes it reconnect to every
//! node it was first given, once per call. Nor is a call sent again after a dropped
//! connection: the client is still repairing it, and the call would go to a fallback node and
//! meet `MOVED`; the store's breaker and failure modes answer for that call instead. While a
//! master was down, those two made a live master accept over a hundred connections a second
//! from one process.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::{BoxFuture, Shared};
use redis::aio::MultiplexedConnection;
use redis::cluster_async::ClusterConnection;
use redis::{
    AsyncConnectionConfig, Cmd, ConnectionAddr, ConnectionInfo, ErrorKind, FromRedisValue,
    RedisError, RetryMethod, TlsCertificates,
};

/// Attempts a call makes after its first: a slot being moved sends a call from its old owner
/// to its new one (`ASK`), a finished move from a stale owner to the new one (`MOVED`), so two
/// suffice; one more covers a move that finishes between them.
const RETRIES: usize = 3;

/// How long a `TRYAGAIN` (a call over several keys of a slot whose keys are part moved) or a
/// cluster that is reconfiguring waits before the call goes again. The caller's timeout bounds
/// all the attempts together.
const PAUSE: Duration = Duration::from_millis(1);

/// The most nodes the store keeps connections of its own to; past this many, they are all
/// dropped and opened again as redirections need them.
const MAX_DIRECT: usize = 16;

/// `call` on the cluster, following redirections and a `TRYAGAIN`.
pub(crate) async fn query_cluster<T: FromRedisValue>(
    connection: &mut ClusterConnection,
    direct: &DirectConnections,
    call: &Cmd,
) -> Result<T, RedisError> {
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
                direct.query(host, port, call, Asking::Yes).await
            }
            (RetryMethod::MovedRedirect, Some((host, port))) => {
                direct.query(host, port, call, Asking::No).await
            }
            (RetryMethod::WaitAndRetry, _) => {
                tokio::time::sleep(PAUSE).await;
                call.query_async(connection).await
            }
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

/// The host and port of a node named in a redirection, `host:port` (`[v6]:port` too).
fn node_address(node: &str) -> Option<(&str, u16)> {
    let (host, port) = node.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port = port.parse().ok()?;
    (!host.is_empty()).then_some((host, port))
}

/// The store's own connections to single nodes of the cluster, for calls a redirection sends
/// there.
pub(crate) struct DirectConnections {
    /// A node of the cluster as configured: its credentials and whether it speaks TLS are every
    /// node's.
    template: ConnectionInfo,
    certificates: Option<TlsCertificates>,
    connect_timeout: Duration,
    open: Open,
}

impl DirectConnections {
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

    async fn query<T: FromRedisValue>(
        &self,
        host: &str,
        port: u16,
        call: &Cmd,
        asking: Asking,
    ) -> Result<T, RedisError> {
        let mut connection = self.connection(host, port).await?;
        let reply = match asking {
            Asking::Yes => {
                let mut pipeline = redis::pipe();
                pipeline.cmd("ASKING").ignore().add_command(call.clone());
                pipeline
                    .query_async::<(T,)>(&mut connection)
                    .await
                    .map(|(reply,)| reply)
            }
            Asking::No => call.query_async(&mut connection).await,
        };
        // A dropped connection is an I/O error too.
        if reply.as_ref().is_err_and(RedisError::is_io_error) {
            lock(&self.open).remove(&(host.to_owned(), port));
        }
        reply
    }

    /// The connection to `host:port`, opened if there is none. Calls redirected to one node
    /// together (every call in flight on a slot that has just moved) share one opening: each
    /// opening its own would send a burst of handshakes to the node, TLS ones too, from every
    /// process at once, and keep one connection of them. It is opened in a task of its own, so
    /// that a caller whose short timeout ends during a handshake (TLS to a distant node) does
    /// not abandon it: the next call finds it open.
    async fn connection(&self, host: &str, port: u16) -> Result<MultiplexedConnection, RedisError> {
        let key = (host.to_owned(), port);
        let opening = {
            let mut open = lock(&self.open);
            match open.get(&key) {
                Some(opening) => opening.clone(),
                None => {
                    let opening = self.start_opening(host, port)?;
                    if open.len() >= MAX_DIRECT {
                        open.clear();
                    }
                    open.insert(key.clone(), opening.clone());
                    opening
                }
            }
        };
        let connection = opening.clone().await;
        if connection.is_err() {
            // The next call opens anew, unless another has already.
            let mut open = lock(&self.open);
            if open
                .get(&key)
                .is_some_and(|current| current.ptr_eq(&opening))
            {
                open.remove(&key);
            }
        }
        connection
    }

    /// Starts opening a connection to `host:port`, as the cluster's nodes are configured.
    fn start_opening(&self, host: &str, port: u16) -> Result<Opening, RedisError> {
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
        let task = tokio::spawn(async move {
            client
                .get_multiplexed_async_connection_with_config(&config)
                .await
        });
        Ok(async move {
            task.await.unwrap_or_else(|_| {
                Err(RedisError::from((
                    ErrorKind::Client,
                    "the task opening a connection ended without one",
                )))
            })
        }
        .boxed()
        .shared())
    }
}

/// A connection to a node being opened, or open: its callers all await the one opening.
type Opening = Shared<BoxFuture<'static, Result<MultiplexedConnection, RedisError>>>;

/// Connections by node, open or being opened.
type Open = Mutex<HashMap<(String, u16), Opening>>;

fn lock(open: &Open) -> MutexGuard<'_, HashMap<(String, u16), Opening>> {
    open.lock().unwrap_or_else(PoisonError::into_inner)
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

#[cfg(all(test, feature = "test-server"))]
mod opening_tests {
    use std::sync::Arc;
    use std::time::Duration;

    use redis::IntoConnectionInfo;

    use super::{Asking, DirectConnections, MAX_DIRECT};
    use crate::test_server::{Proxy, RedisServer, free_port};

    /// A node's connection is opened once and taken by every call redirected there, beside
    /// other nodes' connections; past `MAX_DIRECT` nodes they are all dropped, and opened again
    /// as calls need them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn connections_to_nodes_are_kept_up_to_a_bound() {
        let server = RedisServer::start();
        let nodes: Vec<Proxy> = (0..=MAX_DIRECT)
            .map(|_| Proxy::start(server.port))
            .collect();
        let template = nodes[0].url().into_connection_info().expect("a node's URL");
        let direct = DirectConnections::new(template, None, Duration::from_secs(5));
        let echo = redis::cmd("ECHO").arg("here").clone();
        let call = |node: &Proxy| {
            let port = node.port;
            let echo = &echo;
            let direct = &direct;
            async move {
                let reply = direct
                    .query::<Vec<u8>>("127.0.0.1", port, echo, Asking::No)
                    .await;
                assert_eq!(reply.as_deref().ok(), Some(&b"here"[..]), "{reply:?}");
            }
        };
        for node in [&nodes[0], &nodes[1], &nodes[0], &nodes[1]] {
            call(node).await;
        }
        assert_eq!((nodes[0].connections(), nodes[1].connections()), (1, 1));
        // As many nodes as the bound: every connection kept.
        for node in &nodes[2..MAX_DIRECT] {
            call(node).await;
        }
        call(&nodes[0]).await;
        assert_eq!(nodes[0].connections(), 1);
        // One node more: the others' connections are dropped.
        call(&nodes[MAX_DIRECT]).await;
        call(&nodes[0]).await;
        assert_eq!(nodes[0].connections(), 2);
        assert_eq!(nodes[MAX_DIRECT].connections(), 1);
    }

    /// Calls redirected to one node together (a slot has just moved under traffic) share one
    /// connection's opening; each opened its own, and sixteen calls made sixteen handshakes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn calls_redirected_together_open_one_connection() {
        let server = RedisServer::start();
        let proxy = Proxy::start(server.port);
        // Every caller arrives while the first handshake is still under way.
        proxy.delay_new_connections(Duration::from_millis(100));
        let template = proxy.url().into_connection_info().expect("a node's URL");
        let direct = Arc::new(DirectConnections::new(
            template,
            None,
            Duration::from_secs(5),
        ));
        let port = proxy.port;
        let calls: Vec<_> = (0..16)
            .map(|_| {
                let direct = Arc::clone(&direct);
                tokio::spawn(async move {
                    let echo = redis::cmd("ECHO").arg("here").clone();
                    direct
                        .query::<Vec<u8>>("127.0.0.1", port, &echo, Asking::No)
                        .await
                })
            })
            .collect();
        for call in calls {
            let reply = call.await.expect("the call's task");
            assert_eq!(reply.as_deref().ok(), Some(&b"here"[..]), "{reply:?}");
        }
        assert_eq!(proxy.connections(), 1);
    }

    /// An opening that failed is not kept: the next call to the node opens anew.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_opening_is_tried_again() {
        let server = RedisServer::start();
        let dead = free_port();
        let proxy = Proxy::start(dead);
        let template = proxy.url().into_connection_info().expect("a node's URL");
        let direct = DirectConnections::new(template, None, Duration::from_secs(5));
        let echo = redis::cmd("ECHO").arg("here").clone();
        let first = direct
            .query::<Vec<u8>>("127.0.0.1", proxy.port, &echo, Asking::No)
            .await;
        assert!(first.is_err(), "{first:?}");
        proxy.retarget(server.port);
        let second = direct
            .query::<Vec<u8>>("127.0.0.1", proxy.port, &echo, Asking::No)
            .await;
        assert_eq!(second.as_deref().ok(), Some(&b"here"[..]), "{second:?}");
    }
}
