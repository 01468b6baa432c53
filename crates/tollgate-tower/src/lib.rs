//! tollgate in front of any tower service: axum, hyper or tonic, in-process.
//!
//! [`TollgateLayer`] decides every request against a tollgate limit (or a whole policy), in
//! memory or in a shared Redis, before the service sees it. A request over its limit is
//! answered `429 Too Many Requests` at once, with the IETF rate-limit fields and `Retry-After`;
//! it is never queued (the layer applies no back-pressure).
//!
//! ```
//! use axum::{Router, body::Body, routing::get};
//! use http::{Request, StatusCode, header::HeaderName};
//! use tollgate::Limit;
//! use tollgate_tower::{Header, TollgateLayer};
//! use tower::ServiceExt;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // 2 requests of burst per API key, refilled at 1 per second.
//! let layer = TollgateLayer::limit(
//!     "per-key",
//!     Limit::new(2, "1/s".parse()?)?,
//!     Header::new(HeaderName::from_static("x-api-key")),
//! )
//! .build();
//! let app = Router::new().route("/", get(|| async { "hello" })).layer(layer);
//!
//! let request = || Request::get("/").header("x-api-key", "k1").body(Body::empty()).unwrap();
//! assert_eq!(app.clone().oneshot(request()).await?.status(), StatusCode::OK);
//! assert_eq!(app.clone().oneshot(request()).await?.status(), StatusCode::OK);
//!
//! let denied = app.clone().oneshot(request()).await?;
//! assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
//! assert_eq!(denied.headers()["ratelimit-policy"], r#""per-key";q=2;w=2"#);
//! assert_eq!(denied.headers()["ratelimit"], r#""per-key";r=0;t=1"#);
//! assert_eq!(denied.headers()["retry-after"], "1");
//! # Ok(())
//! # }
//! ```
//!
//! # Semantics
//!
//! * **Shared**: the layer, every service it makes and every clone of those decide against one
//!   limiter; cloning a service never hands out a fresh budget.
//! * **Keys** ([`extract`]): the peer address ([`PeerIp`]), a header ([`Header`]), the
//!   `X-Forwarded-For` entry your own proxy wrote ([`ForwardedFor`]; never trust forwarded
//!   headers unless a proxy you run sets them), a closure ([`KeyFn`]) or one global bucket
//!   ([`Global`]). A request without a usable key is answered 400 or counted against a
//!   fallback key ([`MissingKey`]); nothing a request carries can make the layer panic.
//! * **Cost**: 1 per request, or what a cost function says; 0 lets a request through
//!   unchecked, more than the capacity is a 400 (it could never pass).
//! * **Limits**: one [`tollgate::Limit`] ([`TollgateLayer::limit`]), or a
//!   [`tollgate_policy::PolicyEngine`] fed with descriptors built from the request
//!   ([`TollgateLayer::policy`]): several limits, all or nothing, hot reload, shadow mode.
//! * **Answers**: admitted responses get `RateLimit-Policy` and `RateLimit` (one list item per
//!   enforced limit; see [`headers`]); a denial is a 429 with those, `Retry-After` in whole
//!   seconds rounded up (at least 1), and an `application/problem+json` body. `X-RateLimit-*`
//!   instead, both sets, or none: [`LimitBuilder::rate_limit_headers`]. When a shared
//!   store is down, a limit that fails closed answers 503 (not 429), one that fails open
//!   decides on its bounded emergency budget.
//! * **Reservations** ([`LimitBuilder::reservations`], [`PolicyBuilder::reservations`]): for
//!   handlers whose cost is known only afterwards (a model's tokens, a streamed body), the
//!   cost function gives the most a request may cost, and the handler settles the
//!   [`Reservation`] it finds in the request's extensions for what it used; the rest goes back.
//! * **Stores**: memory by default; Redis with the `redis` feature (`LimitBuilder::redis`,
//!   `PolicyBuilder::redis`, `ConcurrencyBuilder::redis`), so many processes share one budget.
//! * **hyper**: hyper 1 has its own `Service` trait; wrap the layered service with
//!   `hyper_util::service::TowerToHyperService`, and insert the peer's `SocketAddr` into each
//!   request's extensions in the accept loop for [`PeerIp`].
//! * **gRPC**: calls (`content-type: application/grpc…`) get the same answers in gRPC's form,
//!   a trailers-only response: `RESOURCE_EXHAUSTED` for a quota, `UNAVAILABLE` when failing
//!   closed, `INVALID_ARGUMENT` for a missing key; the rate-limit fields and `Retry-After` are
//!   in the response metadata. (A bare HTTP 429 would reach a gRPC client as a decoding
//!   error.)
//!
//! # Concurrency limits
//!
//! [`ConcurrencyLayer`] bounds how many requests each key has **in flight at once**, in this
//! process, for backends whose cost is time held (exports, database connections) rather than
//! calls. An admitted request holds a lease from a [`tollgate::MemoryLeases`] shared by every
//! clone of the layer; a key with none free is answered at once with a 429 (gRPC:
//! `RESOURCE_EXHAUSTED`) and `Retry-After` up to the time its oldest lease times out, rounded
//! up; the inner service never sees it, and nothing queues. Missing keys follow [`MissingKey`]
//! as above.
//!
//! The slot is given back when the response future completes, with a response or an error, or
//! is dropped unfinished (a client that went away): so it is held until the response **head**
//! is ready, not while the body streams, as with tower's own `ConcurrencyLimit`. A request
//! still running after the [`tollgate::LeaseLimit`]'s timeout loses its slot to that timeout.
//!
//! With the `redis` feature, `ConcurrencyBuilder::redis` counts the slots in Redis instead,
//! shared by every process (and every layer of the same name) pointed at it; the release is
//! sent from a task spawned on the Tokio runtime when the request ends, and while Redis cannot
//! answer the layer follows its `LeaseFailure` (503, or a per-process emergency bound).
//!
//! ```
//! use std::{sync::Arc, time::Duration};
//! use axum::{Router, body::Body, routing::get};
//! use http::{Request, StatusCode, header::HeaderName};
//! use tokio::sync::Notify;
//! use tollgate::LeaseLimit;
//! use tollgate_tower::{ConcurrencyLayer, Header};
//! use tower::ServiceExt;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // One export at a time per API key; a slot left behind frees itself after 5 minutes.
//! let layer = ConcurrencyLayer::new(
//!     "exports",
//!     LeaseLimit::new(1, Duration::from_secs(300))?,
//!     Header::new(HeaderName::from_static("x-api-key")),
//! );
//! // The export runs until `finish` is notified, and says when it has started.
//! let (started, finish) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
//! let handler = {
//!     let (started, finish) = (started.clone(), finish.clone());
//!     move || async move {
//!         started.notify_one();
//!         finish.notified().await;
//!         "exported"
//!     }
//! };
//! let app = Router::new().route("/export", get(handler)).layer(layer);
//! let request = || Request::get("/export").header("x-api-key", "k1").body(Body::empty()).unwrap();
//!
//! let running = tokio::spawn(app.clone().oneshot(request()));
//! started.notified().await;
//! let busy = app.clone().oneshot(request()).await?;
//! assert_eq!(busy.status(), StatusCode::TOO_MANY_REQUESTS);
//! assert_eq!(busy.headers()["retry-after"], "300");
//!
//! finish.notify_one();
//! assert_eq!(running.await??.status(), StatusCode::OK);
//! finish.notify_one(); // lets the next export finish at once
//! assert_eq!(app.oneshot(request()).await?.status(), StatusCode::OK);
//! # Ok(())
//! # }
//! ```

mod concurrency;
mod error;
pub mod extract;
mod future;
pub mod headers;
mod layer;
mod limiter;
mod reservation;
mod service;

#[cfg(feature = "redis")]
pub use concurrency::LeaseFailure;
pub use concurrency::{Concurrency, ConcurrencyBuilder, ConcurrencyFuture, ConcurrencyLayer};
pub use error::Error;
pub use extract::{
    ForwardedFor, Global, Header, KeyExtractor, KeyFn, MissingKey, PeerIp, RequestHead,
};
pub use future::{ResponseBody, ResponseFuture};
pub use headers::HeaderStyle;
pub use layer::{LimitBuilder, PolicyBuilder, TollgateLayer};
pub use limiter::Descriptor;
pub use reservation::Reservation;
pub use service::Tollgate;

/// The README's Rust examples (the library's and this layer's), compiled and run as this
/// crate's doctests: the front door's code cannot stop compiling unnoticed. This crate, which
/// has both `tollgate` and axum within reach, is where they can run.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeExamples;
