//! The concurrency layer on a shared Redis (a throwaway `redis-server` owned by each test): two
//! layers with connections of their own count one set of slots, a finished or abandoned
//! request gives its slot back, and the failure modes when Redis is gone.
//!
//! A release is sent from a spawned task once a request ends, so a test that needs the slot
//! back polls for it, a bounded number of times; nothing asserts on how long anything takes.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::routing::get;
use http::header::HeaderName;
use http::{HeaderMap, Request, StatusCode};
use tokio::sync::Notify;
use tollgate::{LeaseLimit, LeaseRequest, LeaseStore, LeaseTake};
use tollgate_redis::test_server::RedisServer;
use tollgate_redis::{RedisConfig, RedisStore};
use tollgate_tower::{ConcurrencyLayer, Header, LeaseFailure};
use tower::ServiceExt;

/// What the handler shares with the test: how many held requests are inside it, and the gate
/// that lets them all finish.
#[derive(Clone, Default)]
struct Gate {
    inside: Arc<AtomicUsize>,
    open: Arc<Notify>,
}

async fn handler(State(gate): State<Gate>, headers: HeaderMap) -> &'static str {
    if headers.contains_key("x-hold") {
        let opened = gate.open.notified();
        gate.inside.fetch_add(1, Ordering::SeqCst);
        opened.await;
    }
    "done"
}

fn limit(max: u64) -> LeaseLimit {
    LeaseLimit::new(max, Duration::from_secs(60)).unwrap()
}

async fn store(server: &RedisServer) -> RedisStore {
    // A generous timeout: this machine is shared, and a slow answer is not what is tested.
    let config = RedisConfig::default().with_timeout(Duration::from_secs(2));
    RedisStore::connect(&server.url(), config).await.unwrap()
}

fn app(store: RedisStore, max: u64, on_failure: LeaseFailure, gate: &Gate) -> Router {
    let layer = ConcurrencyLayer::builder(
        "exports",
        limit(max),
        Header::new(HeaderName::from_static("x-tenant")),
    )
    .redis(store, on_failure)
    .build();
    Router::new()
        .route("/", get(handler))
        .with_state(gate.clone())
        .layer(layer)
}

fn request(tenant: &str, hold: bool) -> Request<Body> {
    let mut request = Request::get("/").header("x-tenant", tenant);
    if hold {
        request = request.header("x-hold", "1");
    }
    request.body(Body::empty()).unwrap()
}

async fn status(app: &Router, tenant: &str) -> StatusCode {
    app.clone()
        .oneshot(request(tenant, false))
        .await
        .unwrap()
        .status()
}

/// Starts a request that stays inside the handler until the gate opens.
fn hold(app: &Router, tenant: &str) -> tokio::task::JoinHandle<StatusCode> {
    let app = app.clone();
    let request = request(tenant, true);
    tokio::spawn(async move { app.oneshot(request).await.unwrap().status() })
}

/// Waits until `count` held requests are inside the handler (a bounded number of looks).
async fn inside(gate: &Gate, count: usize) {
    for _ in 0..500 {
        if gate.inside.load(Ordering::SeqCst) >= count {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{count} requests never got inside");
}

/// How many leases Redis holds on `key` (the layer's name, `|`, the extracted key).
async fn in_flight(store: &RedisStore, key: &str) -> u64 {
    let limit = limit(2);
    let takes = [LeaseTake::new(key, &limit)];
    let request = LeaseRequest {
        takes: &takes,
        lease_id: "look",
        now: None,
    };
    store.in_flight(request).await.unwrap()[0].in_flight()
}

/// Waits until `tenant` is admitted again: its releases are sent from spawned tasks.
async fn admitted_again(app: &Router, tenant: &str) {
    for _ in 0..500 {
        if status(app, tenant).await == StatusCode::OK {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{tenant} never got its slot back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_layers_on_one_redis_share_the_slots_and_get_them_back() {
    let server = RedisServer::start();
    let gate = Gate::default();
    // Two processes' worth of layers, each with its own connection.
    let a = app(store(&server).await, 2, LeaseFailure::Closed, &gate);
    let b = app(store(&server).await, 2, LeaseFailure::Closed, &gate);
    let first = hold(&a, "acme");
    let second = hold(&b, "acme");
    inside(&gate, 2).await;

    for app in [&a, &b] {
        let full = app.clone().oneshot(request("acme", false)).await.unwrap();
        assert_eq!(full.status(), StatusCode::TOO_MANY_REQUESTS);
        let retry: u64 = full.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!((1..=60).contains(&retry), "{retry}");
    }
    assert_eq!(
        status(&b, "globex").await,
        StatusCode::OK,
        "a key of its own"
    );

    gate.open.notify_waiters();
    assert_eq!(first.await.unwrap(), StatusCode::OK);
    assert_eq!(second.await.unwrap(), StatusCode::OK);
    admitted_again(&a, "acme").await;
    // Both slots came back (and the one just used): nothing is held in Redis.
    let look = store(&server).await;
    for _ in 0..500 {
        if in_flight(&look, "exports|acme").await == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(in_flight(&look, "exports|acme").await, 0);
    let again = [hold(&a, "acme"), hold(&b, "acme")];
    inside(&gate, 4).await;
    assert_eq!(status(&a, "acme").await, StatusCode::TOO_MANY_REQUESTS);
    gate.open.notify_waiters();
    for held in again {
        assert_eq!(held.await.unwrap(), StatusCode::OK);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_request_gives_its_slot_back() {
    let server = RedisServer::start();
    let gate = Gate::default();
    let app = app(store(&server).await, 1, LeaseFailure::Closed, &gate);
    let held = hold(&app, "acme");
    inside(&gate, 1).await;
    assert_eq!(status(&app, "acme").await, StatusCode::TOO_MANY_REQUESTS);
    // The client goes away: its future is dropped mid-request.
    held.abort();
    assert!(held.await.unwrap_err().is_cancelled());
    admitted_again(&app, "acme").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_redis_is_gone_closed_answers_503_and_open_holds_its_emergency_bound() {
    let mut server = RedisServer::start();
    let gate = Gate::default();
    let closed = app(store(&server).await, 5, LeaseFailure::Closed, &gate);
    let open = app(
        store(&server).await,
        5,
        LeaseFailure::Open {
            emergency: limit(1),
        },
        &gate,
    );
    assert_eq!(status(&closed, "acme").await, StatusCode::OK);
    server.kill();

    let unavailable = closed
        .clone()
        .oneshot(request("acme", false))
        .await
        .unwrap();
    assert_eq!(unavailable.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(unavailable.headers().get("retry-after").is_none());

    // Open: one in flight per key in this process, never unlimited; given back locally.
    let held = hold(&open, "acme");
    inside(&gate, 1).await;
    assert_eq!(status(&open, "acme").await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(status(&open, "globex").await, StatusCode::OK);
    gate.open.notify_waiters();
    assert_eq!(held.await.unwrap(), StatusCode::OK);
    assert_eq!(status(&open, "acme").await, StatusCode::OK);
}
