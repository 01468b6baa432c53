//! The concurrency layer over a service whose requests end when the test says so: slots per
//! key, the 429 and its `Retry-After`, release on completion, error and drop, missing keys and
//! gRPC answers. Time is a `ManualClock`; nothing sleeps.

mod support;

use std::convert::Infallible;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::{Body, to_bytes};
use http::header::HeaderName;
use http::{Request, Response, StatusCode};
use support::Down;
use tokio::sync::Notify;
use tollgate::{LeaseLimit, ManualClock};
use tollgate_tower::{Concurrency, ConcurrencyLayer, Header, MissingKey, ResponseBody};
use tower::{Layer, Service, ServiceExt};

/// A request's end, which the test fires: the inner service waits on it before answering.
#[derive(Clone, Default)]
struct End(Arc<Notify>);

/// Counts the inner service's calls, to prove a refused request never reaches it.
#[derive(Clone, Default)]
struct Calls(Arc<AtomicUsize>);

impl Calls {
    fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

type Inner = tower::util::BoxCloneService<Request<Body>, Response<Body>, io::Error>;

/// Answers "done" once the request's [`End`] fires (at once without one), or fails when the
/// request carries `x-fail`.
fn inner(calls: &Calls) -> Inner {
    let calls = calls.clone();
    tower::util::BoxCloneService::new(tower::service_fn(move |request: Request<Body>| {
        calls.0.fetch_add(1, Ordering::SeqCst);
        let end = request.extensions().get::<End>().cloned();
        let fail = request.headers().contains_key("x-fail");
        async move {
            if let Some(End(end)) = end {
                end.notified().await;
            }
            if fail {
                return Err(io::Error::other("the service failed"));
            }
            Ok(Response::new(Body::from("done")))
        }
    }))
}

fn api_key() -> Header {
    Header::new(HeaderName::from_static("x-api-key"))
}

fn limit(max: u64) -> LeaseLimit {
    LeaseLimit::new(max, Duration::from_secs(30)).unwrap()
}

fn service(max: u64, clock: &ManualClock, calls: &Calls) -> Concurrency<Inner> {
    ConcurrencyLayer::builder("exports", limit(max), api_key())
        .clock(clock.clone())
        .build()
        .layer(inner(calls))
}

fn request(key: &str) -> Request<Body> {
    Request::get("/export")
        .header("x-api-key", key)
        .body(Body::empty())
        .unwrap()
}

/// A request on `key` that stays in flight until its [`End`] fires.
fn held(key: &str) -> (Request<Body>, End) {
    let end = End::default();
    let mut request = request(key);
    request.extensions_mut().insert(end.clone());
    (request, end)
}

/// Calls `service`: the layer decides inside `call`, so the returned future already holds its
/// slot (or carries its refusal) before it is polled.
async fn start<S>(service: &mut S, request: Request<Body>) -> S::Future
where
    S: Service<Request<Body>>,
    S::Error: std::fmt::Debug,
{
    service.ready().await.unwrap().call(request)
}

async fn text(response: Response<ResponseBody<Body>>) -> String {
    let bytes = to_bytes(Body::new(response.into_body()), 1 << 16)
        .await
        .unwrap();
    String::from_utf8(bytes.to_vec()).unwrap()
}

#[tokio::test]
async fn admits_max_in_flight_per_key_then_429s_until_one_ends() {
    let clock = ManualClock::new();
    let calls = Calls::default();
    let mut service = service(2, &clock, &calls);
    let (first, first_end) = held("k1");
    let (second, second_end) = held("k1");
    let first = start(&mut service, first).await;
    clock.advance(Duration::from_millis(500));
    let second = start(&mut service, second).await;
    assert_eq!(calls.get(), 2);

    // A clone counts against the same slots. The oldest lease ends 30 s after it was taken,
    // 19.5 s from now: rounded up, never early.
    clock.advance(Duration::from_millis(10_000));
    let mut clone = service.clone();
    let refused = clone
        .ready()
        .await
        .unwrap()
        .call(request("k1"))
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["retry-after"], "20");
    assert_eq!(
        refused.headers()["content-type"],
        "application/problem+json"
    );
    assert!(
        text(refused)
            .await
            .contains(r#""violated-policies":["exports"]"#)
    );
    assert_eq!(
        calls.get(),
        2,
        "a refused request never reaches the service"
    );

    // Another key has its own slots.
    let other = start(&mut service, request("k2")).await.await.unwrap();
    assert_eq!(other.status(), StatusCode::OK);

    // One ends: its slot is free again, and only one.
    first_end.0.notify_one();
    assert_eq!(text(first.await.unwrap()).await, "done");
    let (third, third_end) = held("k1");
    let third = start(&mut service, third).await;
    let full = start(&mut service, request("k1")).await.await.unwrap();
    assert_eq!(full.status(), StatusCode::TOO_MANY_REQUESTS);

    second_end.0.notify_one();
    third_end.0.notify_one();
    assert_eq!(second.await.unwrap().status(), StatusCode::OK);
    assert_eq!(third.await.unwrap().status(), StatusCode::OK);
}

#[tokio::test]
async fn the_slot_is_freed_when_the_response_is_ready_not_when_the_future_is_dropped() {
    let clock = ManualClock::new();
    let calls = Calls::default();
    let mut service = service(1, &clock, &calls);
    let future = start(&mut service, request("k1")).await;
    tokio::pin!(future);
    assert_eq!((&mut future).await.unwrap().status(), StatusCode::OK);
    // The finished future is still alive: its slot must already be free.
    let next = start(&mut service, request("k1")).await.await.unwrap();
    assert_eq!(next.status(), StatusCode::OK);
}

#[tokio::test]
async fn a_response_future_dropped_before_it_completes_frees_its_slot() {
    let clock = ManualClock::new();
    let calls = Calls::default();
    let mut service = service(1, &clock, &calls);

    // Dropped after being polled (a client that went away mid-request)...
    let (first, _never) = held("k1");
    // Boxed, so that `drop` below drops the future itself, not a pinned reference to it.
    let mut first = Box::pin(start(&mut service, first).await);
    tokio::select! {
        biased;
        _ = &mut first => panic!("the request was held"),
        () = std::future::ready(()) => {}
    }
    let refused = start(&mut service, request("k1")).await.await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    drop(first);

    // ...or never polled at all.
    let (second, _never) = held("k1");
    let second = start(&mut service, second).await;
    let refused = start(&mut service, request("k1")).await.await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    drop(second);

    let ok = start(&mut service, request("k1")).await.await.unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
}

#[tokio::test]
async fn an_inner_service_error_frees_its_slot() {
    let clock = ManualClock::new();
    let calls = Calls::default();
    let mut service = service(1, &clock, &calls);
    let mut failing = request("k1");
    failing
        .headers_mut()
        .insert("x-fail", http::HeaderValue::from_static("1"));
    let future = start(&mut service, failing).await;
    tokio::pin!(future);
    let Err(err) = (&mut future).await else {
        panic!("the service was to fail");
    };
    assert_eq!(err.to_string(), "the service failed");
    // Still alive, finished with an error: the slot must be free.
    let next = start(&mut service, request("k1")).await.await.unwrap();
    assert_eq!(next.status(), StatusCode::OK);
}

#[tokio::test]
async fn a_request_without_a_key_is_refused_or_shares_the_fallback_key() {
    let calls = Calls::default();
    let no_key = || Request::get("/export").body(Body::empty()).unwrap();

    let mut rejecting = ConcurrencyLayer::new("exports", limit(1), api_key()).layer(inner(&calls));
    let response = start(&mut rejecting, no_key()).await.await.unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert!(text(response).await.contains("header x-api-key"));
    assert_eq!(calls.get(), 0);

    let mut fallback = ConcurrencyLayer::builder("exports", limit(1), api_key())
        .on_missing_key(MissingKey::Fallback("anonymous".into()))
        .build()
        .layer(inner(&calls));
    let mut first = no_key();
    first.extensions_mut().insert(End::default());
    let _first = start(&mut fallback, first).await;
    let second = start(&mut fallback, no_key()).await.await.unwrap();
    assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
    // The fallback key is a key like any other, not the key-less requests' own.
    let keyed = start(&mut fallback, request("anonymous"))
        .await
        .await
        .unwrap();
    assert_eq!(keyed.status(), StatusCode::TOO_MANY_REQUESTS);
    let other = start(&mut fallback, request("k1")).await.await.unwrap();
    assert_eq!(other.status(), StatusCode::OK);
}

#[tokio::test]
async fn grpc_calls_get_trailers_only_answers() {
    let clock = ManualClock::new();
    let calls = Calls::default();
    let mut service = service(1, &clock, &calls);
    let grpc = |key: Option<&str>| {
        let mut builder = Request::post("/grpc.health.v1.Health/Check")
            .header("content-type", "application/grpc");
        if let Some(key) = key {
            builder = builder.header("x-api-key", key);
        }
        builder.body(Body::empty()).unwrap()
    };
    let (first, _never) = held("k1");
    let _first = start(&mut service, first).await;

    let refused = start(&mut service, grpc(Some("k1"))).await.await.unwrap();
    assert_eq!(refused.status(), StatusCode::OK);
    assert_eq!(refused.headers()["grpc-status"], "8");
    assert_eq!(
        refused.headers()["grpc-message"],
        "too many requests in flight"
    );
    assert_eq!(refused.headers()["content-type"], "application/grpc");
    assert_eq!(refused.headers()["retry-after"], "30");
    assert_eq!(text(refused).await, "");

    let no_key = start(&mut service, grpc(None)).await.await.unwrap();
    assert_eq!(no_key.headers()["grpc-status"], "3");
    assert_eq!(calls.get(), 1);
}

/// The layer adds no error of its own (every refusal is a response), so a service that cannot
/// fail stays one that cannot fail.
#[tokio::test]
async fn an_infallible_service_stays_infallible() {
    let service = ConcurrencyLayer::new("exports", limit(1), api_key()).layer(tower::service_fn(
        |_: Request<Body>| async { Ok::<_, Infallible>(Response::new(Body::empty())) },
    ));
    let response: Result<_, Infallible> = service.oneshot(request("k1")).await;
    assert!(matches!(response, Ok(r) if r.status() == StatusCode::OK));
}

/// A full key is answered, never waited for: the layer's readiness is the inner service's.
#[tokio::test]
async fn readiness_is_the_inner_service_s() {
    let mut service = ConcurrencyLayer::new("exports", limit(1), api_key()).layer(Down);
    let ready = service.ready().await.map(|_| ());
    assert_eq!(ready, Err("the service is down"));
}

#[tokio::test]
async fn debug_output_shows_the_limit_and_each_request_s_state() {
    let builder = ConcurrencyLayer::builder("exports", limit(1), api_key());
    let shown = format!("{builder:?}");
    assert!(
        shown.starts_with(r#"ConcurrencyBuilder { name: "exports", limit: "#)
            && shown.ends_with("missing: Reject, .. }"),
        "{shown}"
    );
    let layer = builder.clock(ManualClock::new()).build();
    let shown = format!("{layer:?}");
    assert!(
        shown.starts_with(r#"ConcurrencyLayer { name: "exports", limit: "#)
            && shown.ends_with("missing: Reject, .. }"),
        "{shown}"
    );
    assert_eq!(
        format!("{:?}", layer.layer(Down)),
        "Concurrency { inner: Down, .. }"
    );

    let calls = Calls::default();
    let mut service = layer.layer(inner(&calls));
    let (first, first_end) = held("k1");
    let first = start(&mut service, first).await;
    assert_eq!(
        format!("{first:?}"),
        r#"ConcurrencyFuture { state: "called, holding a slot" }"#
    );
    let refused = start(&mut service, request("k1")).await;
    assert_eq!(
        format!("{refused:?}"),
        r#"ConcurrencyFuture { state: "answered" }"#
    );
    first_end.0.notify_one();
    let mut first = Box::pin(first);
    assert_eq!((&mut first).await.unwrap().status(), StatusCode::OK);
    assert_eq!(
        format!("{first:?}"),
        r#"ConcurrencyFuture { state: "completed" }"#
    );
}
