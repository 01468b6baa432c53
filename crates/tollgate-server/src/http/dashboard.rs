//! `GET /dashboard`: a live page for an operator with a browser and no Grafana at hand.
//!
//! The page is one file of HTML and script, compiled into the binary, that reads what the
//! server already exposes (`/metrics`, `/readyz`, `/v1/policy`, `/v1/hot-keys`) every two
//! seconds and shows rates, the latency's 99th percentile, each limit's rejections and the
//! busiest keys. It holds no data itself, so it needs no access control of its own: the admin
//! endpoints it reads keep theirs (loopback, or the bearer token the page asks for).

use axum::http::HeaderValue;
use axum::http::header::{CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE};
use axum::response::{IntoResponse, Response};

/// The page.
pub(crate) const PAGE: &str = include_str!("dashboard.html");

/// Scripts and styles only from the page itself; requests only to this server.
const POLICY: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                      connect-src 'self'; img-src 'self'; form-action 'none'; base-uri 'none'; \
                      frame-ancestors 'none'";

pub(crate) async fn dashboard() -> Response {
    let mut response = PAGE.into_response();
    let headers = response.headers_mut();
    headers.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(CONTENT_SECURITY_POLICY, HeaderValue::from_static(POLICY));
    response
}
