//! Each HTTP request in a server span of its own, when traces are sent
//! ([`crate::traces`]): a tower layer around the router's routes, added only then (the
//! routes answered without the router make their spans with the same [`span`]).
//!
//! A layer of its own rather than axum's `from_fn`, which boxes the rest of the router for
//! every request: a request that is not traced (most of them, where callers sample) goes
//! straight to its route.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::extract::Request;
use axum::response::Response;
use futures_util::FutureExt as _;
use futures_util::future::{BoxFuture, Either};
use opentelemetry::KeyValue;
use opentelemetry::context::FutureExt as _;
use tower_service::Service;

use crate::traces::Traces;

/// Puts each request of the routes it wraps in a span of [`Traces`].
#[derive(Clone)]
pub(super) struct TraceLayer(pub(super) Arc<Traces>);

impl<S> tower_layer::Layer<S> for TraceLayer {
    type Service = Traced<S>;

    fn layer(&self, inner: S) -> Traced<S> {
        Traced {
            inner,
            traces: Arc::clone(&self.0),
        }
    }
}

/// A route whose requests run in spans.
#[derive(Clone)]
pub(super) struct Traced<S> {
    inner: S,
    traces: Arc<Traces>,
}

impl<S> Service<Request> for Traced<S>
where
    S: Service<Request, Response = Response, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Either<BoxFuture<'static, Result<Response, Infallible>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let Some(span) = span(&self.traces, &request) else {
            return Either::Right(self.inner.call(request));
        };
        let answer = self.inner.call(request).map(|Ok(response)| response);
        Either::Left(Box::pin(in_span(span, || answer).map(Ok)))
    }
}

/// The answer `answer` makes, run in `span` so that what it decides is written there, and the
/// span ended with its status. The answer is made inside: a future made outside would be held
/// twice in this one's state (as its argument, and wrapped), and moved twice as far.
pub(super) async fn in_span<F: Future<Output = Response>>(
    span: opentelemetry::Context,
    answer: impl FnOnce() -> F,
) -> Response {
    let response = answer().with_context(span.clone()).await;
    crate::traces::end_http(&span, response.status());
    response
}

/// The span `request` runs in, if it is traced: named by its method and route
/// (OpenTelemetry's HTTP conventions: the route, never the path, which holds lease ids).
/// Health probes and metric scrapes come every few seconds from machines: never traced.
pub(super) fn span<B>(
    traces: &Traces,
    request: &http::Request<B>,
) -> Option<opentelemetry::Context> {
    let path = request.uri().path();
    if matches!(path, "/healthz" | "/readyz" | "/metrics") {
        return None;
    }
    traces.server_span(request.headers(), || {
        let method = request.method().as_str();
        let version = match request.version() {
            http::Version::HTTP_2 => "2",
            http::Version::HTTP_10 => "1.0",
            _ => "1.1",
        };
        let mut attributes = vec![
            KeyValue::new("http.request.method", method.to_owned()),
            KeyValue::new("url.path", path.to_owned()),
            KeyValue::new("network.protocol.version", version),
        ];
        let name = match route(path) {
            Some(route) => {
                attributes.push(KeyValue::new("http.route", route));
                format!("{method} {route}")
            }
            None => method.to_owned(),
        };
        (name.into(), attributes)
    })
}

/// The route of [`super::router`] a path falls under, for spans: written out here rather than
/// read from the router, whose matched route would be recorded on every request, traced or not.
fn route(path: &str) -> Option<&'static str> {
    const FIXED: [&str; 15] = [
        "/v1/check",
        "/v1/explain",
        "/v1/settle",
        "/v1/leases",
        "/v1/leases/explain",
        "/v1/noop",
        "/healthz",
        "/readyz",
        "/metrics",
        "/v1/policy",
        "/v1/policy/reload",
        "/v1/policy/rollback",
        "/v1/hot-keys",
        "/v1/reset",
        "/dashboard",
    ];
    if let Some(route) = FIXED.into_iter().find(|route| *route == path) {
        return Some(route);
    }
    if super::direct::forward_auth_domain(path).is_some() {
        return Some("/v1/forward-auth/{domain}");
    }
    let one_segment = |rest: &str| !rest.is_empty() && !rest.contains('/');
    let lease = path.strip_prefix("/v1/leases/")?;
    match lease.strip_suffix("/renew") {
        Some(id) if one_segment(id) => Some("/v1/leases/{lease_id}/renew"),
        _ if one_segment(lease) => Some("/v1/leases/{lease_id}"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::route;

    #[test]
    fn spans_are_named_by_route_never_by_a_paths_values() {
        assert_eq!(route("/v1/check"), Some("/v1/check"));
        assert_eq!(route("/v1/leases/explain"), Some("/v1/leases/explain"));
        assert_eq!(
            route("/v1/forward-auth/edge"),
            Some("/v1/forward-auth/{domain}")
        );
        assert_eq!(route("/v1/leases/5ff94"), Some("/v1/leases/{lease_id}"));
        assert_eq!(
            route("/v1/leases/5ff94/renew"),
            Some("/v1/leases/{lease_id}/renew")
        );
        for unknown in [
            "/",
            "/v1/checks",
            "/v1/forward-auth/",
            "/v1/forward-auth/a/b",
            "/v1/leases/",
            "/v1/leases//renew",
            "/v1/leases/a/b/renew",
        ] {
            assert_eq!(route(unknown), None, "{unknown}");
        }
    }
}
