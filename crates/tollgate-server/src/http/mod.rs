//! The HTTP front end: the JSON decision API, forward-auth, health, metrics and admin.
//!
//! Every handler is a thin translation: parse and bound the input, call the shared
//! [`Decider`], and shape its outcome into a status code, a JSON body and the IETF rate-limit
//! headers. Bad input of any kind is a 4xx with `{"error":{"code","message"}}` and decides
//! nothing.

pub(crate) mod admin;
pub(crate) mod check;
mod dashboard;
mod direct;
mod error;
mod forward_auth;
pub(crate) mod leases;
pub(crate) mod listener;
mod plain_body;
mod reset;
mod traced;

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::DefaultBodyLimit;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use metrics_exporter_prometheus::PrometheusHandle;
use parking_lot::Mutex;
use tollgate_tower::HeaderStyle;

use crate::connection::{ConnectionLimits, Connections};
use crate::decider::Decider;
use crate::health::Rotation;
use crate::rlqs::RlqsOptions;
use crate::tls::ListenerTls;

pub use error::ApiError;

/// The largest request body accepted, in bytes.
pub const MAX_BODY_BYTES: usize = 64 * 1024;
/// The most descriptors in one request.
pub const MAX_DESCRIPTORS: usize = 32;
/// The most entries in one descriptor.
pub const MAX_ENTRIES: usize = 32;
/// The longest domain, entry name or request id, in bytes.
pub const MAX_NAME_BYTES: usize = 256;
/// The longest entry value, in bytes.
pub const MAX_VALUE_BYTES: usize = 1024;

/// How the HTTP front end behaves.
#[derive(Debug, Clone)]
pub struct HttpOptions {
    /// Bearer token for admin endpoints; without one they answer loopback clients only. An
    /// empty token lets no one in (the CLI refuses one).
    pub admin_token: Option<String>,
    /// `(entry, header)` pairs: forward-auth takes `entry` from `header`.
    pub forward_auth_headers: Vec<(String, String)>,
    /// The status forward-auth answers when a request is over its limit (429, or 403 for
    /// nginx, whose `auth_request` passes on only 401 and 403).
    pub forward_auth_deny: StatusCode,
    /// Where forward-auth reads the client's address (the `remote_address` entry), if
    /// anywhere.
    pub forward_auth_address: Option<ClientAddress>,
    /// The rate-limit fields of `/v1/check`'s and forward-auth's answers (and of RLS's
    /// `response_headers_to_add`).
    pub rate_limit_headers: HeaderStyle,
    /// What RLS does with hits sent as given back (Envoy's `is_negative_hits`).
    pub negative_hits: NegativeHits,
}

/// What the Rate Limit Service does with a descriptor whose hits are given back (Envoy's
/// `is_negative_hits`): tokens its caller took earlier and returns, with no record of the
/// charge they came from (see [`tollgate::Store::give_back`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum NegativeHits {
    /// Refuse the call with `INVALID_ARGUMENT`, charging nothing: whoever can reach the gRPC
    /// port could otherwise fill any bucket.
    #[default]
    Refuse,
    /// Give the hits back to the buckets a check of the descriptor charges, never past full:
    /// for a gRPC port only trusted proxies reach.
    GiveBack,
}

/// The header a proxy records the client's address in, for forward-auth's `remote_address`
/// entry: the address `trusted` hops from its right end (0: the last one, which the proxy
/// calling tollgate appended itself; 1 when one more trusted proxy stands in front of it),
/// and further left past every address inside `proxies`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientAddress {
    /// The header, in lower case (`x-forwarded-for`, `x-real-ip`).
    pub header: String,
    /// How many trusted proxies' entries to pass over from the right.
    pub trusted: usize,
    /// The networks of trusted proxies: past the `trusted` entries, an entry inside one is
    /// passed over too, for chains whose length varies (a CDN in front of some requests and
    /// not others).
    pub proxies: Vec<tollgate_policy::Network>,
    /// The prefix lengths of the `masked_remote_address` entry, if one is given.
    pub mask: Option<AddressMask>,
}

/// Prefix lengths for forward-auth's `masked_remote_address` entry, Envoy's name and form for
/// a client's network (`198.51.100.0/24`, `2001:db8:1:2::/64`): a limit keyed by it holds one
/// bucket per network, so a client rotating through the addresses of its IPv6 /64 (or a NAT
/// pool's /24) is one subject.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressMask {
    /// For IPv4 addresses, at most 32.
    pub v4: u8,
    /// For IPv6 addresses, at most 128.
    pub v6: u8,
}

/// What every handler shares.
pub struct AppState {
    pub(crate) decider: Arc<Decider>,
    pub(crate) metrics: Option<PrometheusHandle>,
    pub(crate) options: HttpOptions,
    /// The policy version last exported as a metric.
    pub(crate) exported_version: Mutex<Option<String>>,
    /// Both listeners' connection bounds, and the connections open under them.
    pub(crate) connections: Connections,
    /// How the RLQS service treats its streams' buckets.
    pub(crate) rlqs: RlqsOptions,
    /// Whether the server is in its load balancers' rotation (`/readyz` says so).
    pub(crate) rotation: Rotation,
    /// Where each request's span goes, when traces are sent.
    pub(crate) traces: Option<Arc<crate::traces::Traces>>,
}

impl AppState {
    /// State for the router.
    pub fn new(
        decider: Arc<Decider>,
        metrics: Option<PrometheusHandle>,
        options: HttpOptions,
    ) -> Self {
        Self {
            decider,
            metrics,
            options,
            exported_version: Mutex::new(None),
            connections: Connections::new(ConnectionLimits::default()),
            rlqs: RlqsOptions::default(),
            rotation: Rotation::new(),
            traces: None,
        }
    }

    /// The same state, with a span for each request sent to `traces` (`None`: no spans).
    #[must_use]
    pub fn with_traces(mut self, traces: Option<Arc<crate::traces::Traces>>) -> Self {
        self.traces = traces;
        self
    }

    /// Whether the server is in its load balancers' rotation: taken out of it on the way out.
    pub fn rotation(&self) -> &Rotation {
        &self.rotation
    }

    /// The same state, with `options` for the RLQS service instead of the defaults.
    #[must_use]
    pub fn with_rlqs(mut self, options: RlqsOptions) -> Self {
        self.rlqs = options;
        self
    }

    /// The same state, with `limits` on both listeners' connections instead of the defaults
    /// (timeouts are taken between a millisecond and a year).
    #[must_use]
    pub fn with_connection_limits(mut self, limits: ConnectionLimits) -> Self {
        let connections = Connections::new(limits);
        self.connections = Connections {
            http_tls: self.connections.http_tls.take(),
            grpc_tls: self.connections.grpc_tls.take(),
            ..connections
        };
        self
    }

    /// The same state, with the HTTP listener speaking TLS as `http` says and the gRPC
    /// listener as `grpc` says (`None`: plain TCP).
    #[must_use]
    pub fn with_tls(
        mut self,
        http: Option<Arc<ListenerTls>>,
        grpc: Option<Arc<ListenerTls>>,
    ) -> Self {
        self.connections.http_tls = http;
        self.connections.grpc_tls = grpc;
        self
    }
}

/// The routes of SPEC §6, each request in a span of its own when traces are sent.
pub fn router(state: Arc<AppState>) -> Router {
    let traces = state.traces.clone();
    let router = routes(state);
    match traces {
        // Only then: the layer costs every request a little even with nothing to send.
        Some(traces) => router.layer(traced::TraceLayer(traces)),
        None => router,
    }
}

/// The routes of SPEC §6.
fn routes(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/check", post(check::check))
        .route("/v1/explain", post(check::explain))
        .route("/v1/settle", post(check::settle))
        .route(
            "/v1/forward-auth/{domain}",
            get(forward_auth::forward_auth).post(forward_auth::forward_auth),
        )
        .route("/v1/leases", post(leases::acquire))
        .route("/v1/leases/explain", post(leases::explain))
        .route("/v1/leases/{lease_id}", delete(leases::release))
        .route("/v1/leases/{lease_id}/renew", post(leases::renew))
        .route("/v1/noop", get(noop).post(noop))
        .route("/healthz", get(admin::healthz))
        .route("/readyz", get(admin::readyz))
        .route("/metrics", get(admin::metrics))
        .route("/v1/policy", get(admin::policy))
        .route("/v1/policy/reload", post(admin::reload))
        .route("/v1/policy/rollback", post(admin::rollback))
        .route("/v1/policy/shadow-all", post(admin::shadow_all))
        .route("/v1/hot-keys", get(admin::hot_keys))
        .route("/v1/reset", post(reset::reset))
        .route("/dashboard", get(dashboard::dashboard))
        .route("/v1/openapi.json", get(openapi))
        // After the routes: it applies to the routes registered before it.
        .method_not_allowed_fallback(error::method_not_allowed)
        .fallback(error::not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// This API as an OpenAPI 3.1 document, for the teams that call it: client generators, API
/// catalogues, request validators. The tests hold it to the server's own answers.
pub const OPENAPI: &str = include_str!("openapi.json");

/// `GET /v1/openapi.json`: [`OPENAPI`]. Not an admin endpoint: it says what any caller may
/// already send.
async fn openapi() -> Response {
    ([(CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

/// `GET|POST /v1/noop`: 200 and a short body, deciding nothing. The baseline of
/// `tollgate bench --path /v1/noop`: it goes through the same listener, dispatch and body
/// reading as `/v1/check` (on the router or, as usual, without it: [`direct`]), so the two
/// rates differ only by the decision.
async fn noop(body: Result<Bytes, BytesRejection>) -> Response {
    noop_answer(check::body_bytes(&body).map(|_| ()))
}

/// `/v1/noop`'s answer once its body is read (or could not be).
fn noop_answer(body: Result<(), ApiError>) -> Response {
    match body {
        Ok(()) => "noop\n".into_response(),
        Err(err) => err.into_response(),
    }
}
