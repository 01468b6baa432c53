//! `POST /v1/check`, forward-auth and `/v1/noop`, answered without the router.
//!
//! They are nearly every request a busy server sees, and the router's generality costs them
//! more than it gives: a lookup of the path, the route's boxed service cloned and called, its
//! path parameters (none here) put in the request's extensions, a map allocated for them, the
//! client's address added there too for the admin routes, and the body boxed and read
//! through three adapters. Here the listener matches the method and the exact path, reads the
//! body under the same bound, and hands it to the same handler code, which answers exactly
//! as through the router, in the same span when traces are sent. Every other request goes to
//! the router.

use std::borrow::Cow;
use std::pin::pin;
use std::sync::Arc;

use axum::body::Bytes;
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::BytesMut;
use futures_util::future::Either;
use http_body::Body;
use http_body_util::BodyExt;
use percent_encoding::percent_decode_str;

use super::check::{self, unreadable};
use super::error::ApiError;
use super::{AppState, MAX_BODY_BYTES};
use super::{forward_auth, traced};

/// A route answered here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direct {
    /// `POST /v1/check`.
    Check,
    /// `GET|POST /v1/forward-auth/{domain}`.
    ForwardAuth,
    /// `GET|POST /v1/noop`.
    Noop,
}

/// The path of forward-auth's subrequests, up to the domain.
const FORWARD_AUTH: &str = "/v1/forward-auth/";

/// The domain segment of a forward-auth path, still percent-encoded: one segment, not empty,
/// as the router's `{domain}` matches it.
pub(super) fn forward_auth_domain(path: &str) -> Option<&str> {
    path.strip_prefix(FORWARD_AUTH)
        .filter(|domain| !domain.is_empty() && !domain.contains('/'))
}

impl Direct {
    /// The route `request` takes here, if it is one of these: the method and the path
    /// (without the query) exactly as the router would match them.
    pub(crate) fn of<B>(request: &http::Request<B>) -> Option<Self> {
        let path = request.uri().path();
        match *request.method() {
            Method::POST if path == "/v1/check" => Some(Self::Check),
            Method::POST | Method::GET if forward_auth_domain(path).is_some() => {
                Some(Self::ForwardAuth)
            }
            Method::POST | Method::GET if path == "/v1/noop" => Some(Self::Noop),
            _ => None,
        }
    }

    /// Answers `request`, which [`Direct::of`] routed here, in a span of its own if it is
    /// traced. Chosen before the answer starts: an untraced answer's future stays as small
    /// as without traces.
    pub(crate) fn answer<B>(
        self,
        state: Arc<AppState>,
        request: http::Request<B>,
    ) -> impl Future<Output = Response> + use<B>
    where
        B: Body<Data = Bytes>,
        B::Error: std::fmt::Display,
    {
        let traced = (state.traces.as_deref()).and_then(|traces| traced::span(traces, &request));
        match traced {
            None => Either::Left(self.answer_untraced(state, request)),
            Some(span) => Either::Right(traced::in_span(span, move || {
                self.answer_untraced(state, request)
            })),
        }
    }

    async fn answer_untraced<B>(self, state: Arc<AppState>, request: http::Request<B>) -> Response
    where
        B: Body<Data = Bytes>,
        B::Error: std::fmt::Display,
    {
        match self {
            Self::Check => {
                let body = read(request.into_body()).await;
                check::decide(&state, body)
                    .await
                    .unwrap_or_else(IntoResponse::into_response)
            }
            Self::ForwardAuth => {
                // A subrequest's body, if it has one, says nothing: it is not read, as the
                // router's handler does not read it.
                let (head, _) = request.into_parts();
                let domain = forward_auth_domain(head.uri.path())
                    .and_then(|domain| percent_decode_str(domain).decode_utf8().ok())
                    .map(Cow::into_owned);
                forward_auth::decide(&state, domain, &head.headers)
                    .await
                    .unwrap_or_else(IntoResponse::into_response)
            }
            Self::Noop => super::noop_answer(read(request.into_body()).await.map(|_| ())),
        }
    }
}

/// The whole body, at most [`MAX_BODY_BYTES`] of it, as the router's body limit reads it:
/// 413 past the bound, 400 for a body that breaks off. The usual body comes in one frame,
/// which is kept as it is rather than copied into a list of frames first.
async fn read<B>(body: B) -> Result<Bytes, ApiError>
where
    B: Body<Data = Bytes>,
    B::Error: std::fmt::Display,
{
    // In the router's words.
    let failed = |status, reason: &dyn std::fmt::Display| {
        unreadable(
            status,
            format!("Failed to buffer the request body: {reason}"),
        )
    };
    let mut body = pin!(body);
    let mut first: Option<Bytes> = None;
    let mut joined = BytesMut::new();
    let mut length = 0;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|err| failed(StatusCode::BAD_REQUEST, &err))?;
        // Trailers, if any, say nothing a decision reads.
        let Ok(data) = frame.into_data() else {
            continue;
        };
        length += data.len();
        if length > MAX_BODY_BYTES {
            return Err(failed(
                StatusCode::PAYLOAD_TOO_LARGE,
                &"length limit exceeded",
            ));
        }
        if first.is_none() && joined.is_empty() {
            first = Some(data);
            continue;
        }
        if let Some(earlier) = first.take() {
            joined.extend_from_slice(&earlier);
        }
        joined.extend_from_slice(&data);
    }
    Ok(first.unwrap_or_else(|| joined.freeze()))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures_util::stream;
    use http_body::Frame;
    use http_body_util::{Full, StreamBody};
    use tollgate::ManualClock;
    use tollgate_policy::{EngineOptions, PolicyEngine, compile};
    use tower_service::Service;

    use super::*;
    use crate::decider::{Backend, Decider};
    use crate::http::{HttpOptions, NegativeHits};

    /// A server's state on `clock`, with a limit of one request an hour per user.
    fn state(clock: &ManualClock) -> Arc<AppState> {
        let policy = compile(
            "p.yaml",
            "limits: [{name: per-user, domain: api, key: [user], capacity: 1, refill: 1/h}]",
        )
        .unwrap();
        let options = EngineOptions::default().clock(Arc::new(clock.clone()));
        let engine = Arc::new(PolicyEngine::new(policy, options));
        let decider = Arc::new(Decider::new(engine, Backend::Memory));
        let options = HttpOptions {
            admin_token: None,
            forward_auth_headers: vec![("user".to_owned(), "x-user-id".to_owned())],
            forward_auth_deny: StatusCode::FORBIDDEN,
            forward_auth_address: None,
            rate_limit_headers: tollgate_tower::HeaderStyle::default(),
            negative_hits: NegativeHits::Refuse,
        };
        Arc::new(AppState::new(decider, None, options))
    }

    /// An answer's status, headers and body. The router writes the body's length in the
    /// headers itself; hyper writes the same length from the body's size on the wire.
    async fn parts(response: Response) -> (StatusCode, http::HeaderMap, Bytes) {
        let (mut head, body) = response.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        if let Some(length) = head.headers.remove(http::header::CONTENT_LENGTH) {
            assert_eq!(length.to_str().unwrap(), body.len().to_string());
        }
        (head.status, head.headers, body)
    }

    #[tokio::test]
    async fn the_routes_answer_here_as_through_the_router() {
        // Two servers on one manual clock: every figure, times included, must agree.
        let clock = ManualClock::new();
        let (routed, direct) = (state(&clock), state(&clock));
        let router = crate::http::router(Arc::clone(&routed));
        let check =
            |user: &str| format!(r#"{{"domain":"api","descriptors":[{{"user":"{user}"}}]}}"#);
        let huge = check(&"x".repeat(MAX_BODY_BYTES));
        /// A request: its method, target, headers and body.
        type Case<'a> = (Method, &'a str, &'a [(&'a str, &'a str)], String);
        let cases: Vec<Case<'_>> = vec![
            (Method::POST, "/v1/check", &[], check("u1")),
            (Method::POST, "/v1/check?x=1", &[], check("u1")),
            (
                Method::POST,
                "/v1/check",
                &[],
                check("u2").replace('}', r#","cost":2}"#),
            ),
            (Method::POST, "/v1/check", &[], "{".to_owned()),
            (Method::POST, "/v1/check", &[], String::new()),
            (
                Method::POST,
                "/v1/check",
                &[],
                r#"{"domain":"api","descriptors":[{"user":1}]}"#.to_owned(),
            ),
            (Method::POST, "/v1/check", &[], huge.clone()),
            (
                Method::GET,
                "/v1/forward-auth/api",
                &[("x-user-id", "f1")],
                String::new(),
            ),
            (
                Method::POST,
                "/v1/forward-auth/a%70i",
                &[("x-user-id", "f1")],
                "ignored".to_owned(),
            ),
            (
                Method::GET,
                "/v1/forward-auth/%A0",
                &[("x-user-id", "f1")],
                String::new(),
            ),
            (Method::GET, "/v1/forward-auth/api", &[], String::new()),
            (Method::GET, "/v1/noop", &[], String::new()),
            (Method::POST, "/v1/noop", &[], huge),
        ];
        for (method, uri, headers, body) in cases {
            let make = || {
                let mut request = http::Request::builder().method(method.clone()).uri(uri);
                for (name, value) in headers {
                    request = request.header(*name, *value);
                }
                request.body(Full::new(Bytes::from(body.clone()))).unwrap()
            };
            let route = Direct::of(&make()).expect("a route answered here");
            // A router is always ready.
            let via_router = router.clone().call(make().map(axum::body::Body::new)).await;
            let via_router = parts(via_router.unwrap()).await;
            let directly = parts(route.answer(Arc::clone(&direct), make()).await).await;
            assert_eq!(via_router, directly, "{method} {uri}");
            clock.advance(Duration::from_millis(1));
        }
    }

    /// A body of `frames`, in order.
    fn body(
        frames: Vec<Result<Frame<Bytes>, &'static str>>,
    ) -> StreamBody<impl futures_util::Stream<Item = Result<Frame<Bytes>, &'static str>>> {
        StreamBody::new(stream::iter(frames))
    }

    fn data(text: &'static str) -> Result<Frame<Bytes>, &'static str> {
        Ok(Frame::data(Bytes::from_static(text.as_bytes())))
    }

    fn read_now<B>(body: B) -> Result<Bytes, ApiError>
    where
        B: Body<Data = Bytes>,
        B::Error: std::fmt::Display,
    {
        futures_util::FutureExt::now_or_never(read(body)).expect("ready")
    }

    #[test]
    fn a_body_is_read_whole_whatever_its_frames() {
        let one = Bytes::from_static(b"{\"domain\":\"api\"}");
        let read_one = read_now(body(vec![Ok(Frame::data(one.clone()))])).unwrap();
        assert_eq!(read_one, one);
        // The one frame is kept, not copied.
        assert_eq!(read_one.as_ptr(), one.as_ptr());
        let joined = read_now(body(vec![
            data("{\"dom"),
            data(""),
            data("ain\""),
            data("}"),
        ]));
        assert_eq!(joined.unwrap(), "{\"domain\"}");
        let trailers = Ok(Frame::trailers(http::HeaderMap::new()));
        assert_eq!(read_now(body(vec![data("ab"), trailers])).unwrap(), "ab");
        assert_eq!(read_now(body(vec![data(""), data("x")])).unwrap(), "x");
        assert_eq!(read_now(body(vec![])).unwrap(), "");
    }

    #[test]
    fn a_body_past_the_bound_or_broken_off_is_refused() {
        let half: &'static str = "x".repeat(MAX_BODY_BYTES / 2).leak();
        assert_eq!(
            read_now(body(vec![data(half), data(half)])).unwrap().len(),
            MAX_BODY_BYTES
        );
        let over = read_now(body(vec![data(half), data(half), data("x")])).unwrap_err();
        assert_eq!(over.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert!(over.message().contains("length limit exceeded"), "{over:?}");
        let broken = read_now(body(vec![data("{\"dom"), Err("connection reset")])).unwrap_err();
        assert_eq!(broken.status(), StatusCode::BAD_REQUEST);
        assert!(broken.message().contains("connection reset"), "{broken:?}");
    }

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
        for uri in [
            "/v1/forward-auth/api",
            "/v1/forward-auth/a%70i?x=1",
            "/v1/forward-auth/%A0",
        ] {
            for method in [Method::GET, Method::POST] {
                assert_eq!(
                    Direct::of(&request(method, uri)),
                    Some(Direct::ForwardAuth),
                    "{uri}"
                );
            }
        }
        assert_eq!(forward_auth_domain("/v1/forward-auth/a%70i"), Some("a%70i"));
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
            (Method::GET, "/v1/forward-auth/"),
            (Method::GET, "/v1/forward-auth"),
            (Method::GET, "/v1/forward-auth/api/"),
            (Method::GET, "/v1/forward-auth/api/x"),
            (Method::HEAD, "/v1/forward-auth/api"),
            (Method::PUT, "/v1/forward-auth/api"),
        ] {
            assert_eq!(
                Direct::of(&request(method.clone(), uri)),
                None,
                "{method} {uri}"
            );
        }
    }
}
