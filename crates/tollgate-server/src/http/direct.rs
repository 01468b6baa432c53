//! `POST /v1/check` and `/v1/noop`, answered without the router.
//!
//! They are nearly every request a busy server sees, and the router's generality costs them
//! more than it gives: a lookup of the path, the route's boxed service cloned and called, its
//! path parameters (none here) put in the request's extensions, a map allocated for them, the
//! client's address added there too for the admin routes, and the body boxed and read
//! through three adapters. Here the listener matches the method and the exact path, reads the
//! body under the same bound, and hands it to the same handler code, which answers exactly
//! as through the router. Every other request goes to the router, as does every request when
//! traces are sent (the span is a layer of the router's).

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};

use super::check::{self, unreadable};
use super::error::ApiError;
use super::{AppState, MAX_BODY_BYTES};

/// A route answered here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direct {
    /// `POST /v1/check`.
    Check,
    /// `GET|POST /v1/noop`.
    Noop,
}

impl Direct {
    /// The route `request` takes here, if it is one of these: the method and the path
    /// (without the query) exactly as the router would match them.
    pub(crate) fn of<B>(request: &http::Request<B>) -> Option<Self> {
        let path = request.uri().path();
        match *request.method() {
            Method::POST if path == "/v1/check" => Some(Self::Check),
            Method::POST | Method::GET if path == "/v1/noop" => Some(Self::Noop),
            _ => None,
        }
    }

    /// Answers `request`, which [`Direct::of`] routed here.
    pub(crate) async fn answer<B>(self, state: Arc<AppState>, request: http::Request<B>) -> Response
    where
        B: Body<Data = Bytes>,
        B::Error: std::error::Error + Send + Sync + 'static,
    {
        let body = read(request.into_body()).await;
        match self {
            Self::Check => check::decide(&state, body)
                .await
                .unwrap_or_else(IntoResponse::into_response),
            Self::Noop => super::noop_answer(body.map(|_| ())),
        }
    }
}

/// The whole body, at most [`MAX_BODY_BYTES`] of it, as the router's body limit reads it:
/// 413 past the bound, 400 for a body that breaks off.
async fn read<B>(body: B) -> Result<Bytes, ApiError>
where
    B: Body<Data = Bytes>,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    match Limited::new(body, MAX_BODY_BYTES).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(err) => {
            let status = if err.is::<LengthLimitError>() {
                StatusCode::PAYLOAD_TOO_LARGE
            } else {
                StatusCode::BAD_REQUEST
            };
            // In the router's words.
            let reason = format!("Failed to buffer the request body: {err}");
            Err(unreadable(status, reason))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(method: Method, uri: &str) -> http::Request<()> {
        http::Request::builder()
            .method(method)
            .uri(uri)
            .body(())
            .unwrap()
    }

    #[test]
    fn only_the_exact_routes_are_taken() {
        assert_eq!(
            Direct::of(&request(Method::POST, "/v1/check")),
            Some(Direct::Check)
        );
        assert_eq!(
            Direct::of(&request(Method::POST, "/v1/check?trace=1")),
            Some(Direct::Check)
        );
        assert_eq!(
            Direct::of(&request(Method::POST, "http://tollgate:8080/v1/check")),
            Some(Direct::Check)
        );
        assert_eq!(
            Direct::of(&request(Method::GET, "/v1/noop")),
            Some(Direct::Noop)
        );
        assert_eq!(
            Direct::of(&request(Method::POST, "/v1/noop")),
            Some(Direct::Noop)
        );
        for (method, uri) in [
            (Method::GET, "/v1/check"),
            (Method::PUT, "/v1/check"),
            (Method::HEAD, "/v1/noop"),
            (Method::POST, "/v1/check/"),
            (Method::POST, "/v1/Check"),
            (Method::POST, "/v1/ch%65ck"),
            (Method::POST, "/v1/checks"),
            (Method::POST, "/v1/explain"),
            (Method::POST, "//v1/check"),
        ] {
            assert_eq!(
                Direct::of(&request(method.clone(), uri)),
                None,
                "{method} {uri}"
            );
        }
    }
}
