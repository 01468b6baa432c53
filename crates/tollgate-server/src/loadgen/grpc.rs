//! The gRPC client of `tollgate bench`: Envoy RLS v3 `ShouldRateLimit`, as Envoy calls it.
//!
//! Each worker has one call in flight. By default it also has its own HTTP/2 connection, so
//! `--concurrency` means the same over gRPC as over HTTP and the two can be compared; with
//! `--connections N` the workers' calls are streams multiplexed over N shared connections, as
//! Envoy sends them. Calls go straight to the connection: tonic's `Channel` would pass every
//! call through a buffer task first, a task hop per request that the generator would pay on the
//! cores it shares with the server.

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;

use super::Verdict;
use super::args::Plan;

/// One worker's handle on a gRPC target.
pub(crate) struct GrpcClient {
    authority: String,
    domain: String,
    key_entry: String,
    fixed: Vec<Entry>,
    cost: u32,
    /// The connection this worker shares with others (or has alone).
    shared: Arc<SharedConnection>,
    /// `None` before the first call and after a failure: the next call reconnects. The number
    /// is the shared connection's generation it was taken from.
    client: Option<(u64, RateLimitServiceClient<Connection>)>,
}

/// A connection several workers send their calls over. After a failure the first worker to
/// notice drops it and the next call opens a new one, which the others then pick up.
#[derive(Default)]
pub(crate) struct SharedConnection {
    /// The generation counts the connections opened here, so a worker holding an older one
    /// cannot drop its replacement.
    current: Mutex<(u64, Option<RateLimitServiceClient<Connection>>)>,
}

impl SharedConnection {
    fn get(&self) -> (u64, Option<RateLimitServiceClient<Connection>>) {
        let current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        (current.0, current.1.clone())
    }

    fn set(&self, client: &RateLimitServiceClient<Connection>) -> u64 {
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        current.0 += 1;
        current.1 = Some(client.clone());
        current.0
    }

    fn drop_generation(&self, generation: u64) {
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        if current.0 == generation {
            current.1 = None;
        }
    }
}

/// One HTTP/2 connection as a gRPC transport. Its driver runs in a task of its own and ends
/// when the connection does.
#[derive(Clone)]
pub(crate) struct Connection(SendRequest<tonic::body::Body>);

type Exchange = Pin<
    Box<dyn Future<Output = Result<http::Response<hyper::body::Incoming>, hyper::Error>> + Send>,
>;

impl tower_service::Service<http::Request<tonic::body::Body>> for Connection {
    type Response = http::Response<hyper::body::Incoming>;
    type Error = hyper::Error;
    type Future = Exchange;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        Box::pin(self.0.send_request(request))
    }
}

impl GrpcClient {
    pub(crate) fn new(plan: &Plan, authority: &str, shared: Arc<SharedConnection>) -> Self {
        Self {
            authority: authority.to_owned(),
            domain: plan.domain.clone(),
            key_entry: plan.key_entry.clone(),
            fixed: plan
                .entries
                .iter()
                .map(|(key, value)| Entry {
                    key: key.clone(),
                    value: value.clone(),
                })
                .collect(),
            cost: plan.cost,
            shared,
            client: None,
        }
    }

    /// Takes the shared connection, or opens it now (so a run does not start before every
    /// worker is connected).
    pub(crate) async fn connect(&mut self) -> Result<(), String> {
        if let (generation, Some(client)) = self.shared.get() {
            self.client = Some((generation, client));
            return Ok(());
        }
        let origin: http::Uri = format!("http://{}", self.authority)
            .parse()
            .map_err(|err| format!("--grpc {}: {err}", self.authority))?;
        let cannot = |err: &dyn std::fmt::Display| {
            format!("cannot connect to gRPC {}: {err}", self.authority)
        };
        let stream = TcpStream::connect(&self.authority)
            .await
            .map_err(|err| cannot(&err))?;
        stream.set_nodelay(true).map_err(|err| cannot(&err))?;
        let (send, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                .await
                .map_err(|err| cannot(&err))?;
        tokio::spawn(connection);
        let client = RateLimitServiceClient::with_origin(Connection(send), origin);
        self.client = Some((self.shared.set(&client), client));
        Ok(())
    }

    /// Forgets the connection, for every worker sharing it (after a timeout or a transport
    /// error its state is unknown).
    pub(crate) fn reset(&mut self) {
        if let Some((generation, _)) = self.client.take() {
            self.shared.drop_generation(generation);
        }
    }

    /// Sends one `ShouldRateLimit` for key `key`.
    pub(crate) async fn send(&mut self, key: u64) -> Result<Verdict, String> {
        if self.client.is_none() {
            self.connect().await?;
        }
        let Some((_, client)) = self.client.as_mut() else {
            return Err("no connection".into());
        };
        let mut entries = self.fixed.clone();
        entries.push(Entry {
            key: self.key_entry.clone(),
            value: format!("{}{key}", super::KEY_PREFIX),
        });
        let request = RateLimitRequest {
            domain: self.domain.clone(),
            descriptors: vec![RateLimitDescriptor {
                entries,
                ..Default::default()
            }],
            hits_addend: self.cost,
        };
        let response = match client.should_rate_limit(request).await {
            Ok(response) => response.into_inner(),
            Err(status) => {
                // A transport failure leaves the channel in an unknown state; a request the
                // server refused (bad domain, too many entries) does not.
                if status.code() != tonic::Code::InvalidArgument {
                    self.reset();
                }
                return Err(format!("gRPC {:?}: {}", status.code(), status.message()));
            }
        };
        match response.overall_code() {
            Code::Ok => Ok(Verdict::Allowed),
            Code::OverLimit => Ok(Verdict::Rejected),
            Code::Unknown => Err("gRPC answer with overall_code UNKNOWN".into()),
        }
    }
}
