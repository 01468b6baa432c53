//! The layer on a shared Redis (a throwaway `redis-server` owned by each test): the same
//! answers as in memory, one budget across layers, and the failure modes when Redis is gone.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::header::HeaderName;
use http::{Request, StatusCode};
use tollgate::Limit;
use tollgate_policy::{EngineOptions, PolicyEngine, compile};
use tollgate_redis::test_server::RedisServer;
use tollgate_redis::{FailureMode, RedisConfig, RedisStore};
use tollgate_tower::{Header, RequestHead, TollgateLayer};
use tower::ServiceExt;

fn limit(capacity: u64, rate: &str) -> Limit {
    Limit::new(capacity, rate.parse().unwrap()).unwrap()
}

async fn store(server: &RedisServer) -> RedisStore {
    // A generous timeout: this machine is shared, and a slow answer is not what is tested.
    let config = RedisConfig::default().with_timeout(Duration::from_secs(2));
    RedisStore::connect(&server.url(), config).await.unwrap()
}

fn app(layer: TollgateLayer) -> Router {
    Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(layer)
}

fn keyed(key: &str) -> Request<Body> {
    Request::get("/")
        .header("x-api-key", key)
        .body(Body::empty())
        .unwrap()
}

async fn status(app: &Router, key: &str) -> StatusCode {
    app.clone().oneshot(keyed(key)).await.unwrap().status()
}

fn layer(store: RedisStore, on_failure: FailureMode) -> TollgateLayer {
    TollgateLayer::limit(
        "per-key",
        limit(3, "1/h"),
        Header::new(HeaderName::from_static("x-api-key")),
    )
    .redis(store, on_failure)
    .build()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_backed_layer_answers_429_with_the_fields() {
    let server = RedisServer::start();
    let app = app(layer(store(&server).await, FailureMode::Closed));
    for _ in 0..3 {
        assert_eq!(status(&app, "k1").await, StatusCode::OK);
    }
    let denied = app.clone().oneshot(keyed("k1")).await.unwrap();
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        denied.headers()["ratelimit-policy"],
        r#""per-key";q=3;w=10800"#
    );
    let ratelimit = denied.headers()["ratelimit"].to_str().unwrap();
    assert!(ratelimit.starts_with(r#""per-key";r=0;t="#), "{ratelimit}");
    let retry: u64 = denied.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((3590..=3600).contains(&retry), "{retry}");
    assert_eq!(status(&app, "k2").await, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_layers_on_one_redis_share_the_budget_under_concurrency() {
    let server = RedisServer::start();
    // Two processes' worth of layers, each with its own connection.
    let a = app(layer(store(&server).await, FailureMode::Closed));
    let b = app(layer(store(&server).await, FailureMode::Closed));
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let app = if i % 2 == 0 { a.clone() } else { b.clone() };
            tokio::spawn(async move {
                let mut admitted = 0;
                for _ in 0..4 {
                    if status(&app, "shared").await == StatusCode::OK {
                        admitted += 1;
                    }
                }
                admitted
            })
        })
        .collect();
    let mut admitted = 0;
    for task in tasks {
        admitted += task.await.unwrap();
    }
    assert_eq!(admitted, 3, "the burst, once, across both layers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_redis_is_gone_closed_limits_answer_503_and_open_ones_spend_their_budget() {
    let mut server = RedisServer::start();
    let closed = app(layer(store(&server).await, FailureMode::Closed));
    let open = app(layer(
        store(&server).await,
        FailureMode::Open {
            emergency: limit(1, "1/h"),
        },
    ));
    assert_eq!(status(&closed, "k").await, StatusCode::OK);
    server.kill();

    let unavailable = closed.clone().oneshot(keyed("k")).await.unwrap();
    assert_eq!(unavailable.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(unavailable.headers().get("retry-after").is_none());

    assert_eq!(status(&open, "k").await, StatusCode::OK);
    assert_eq!(status(&open, "k").await, StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_on_redis_follows_each_limits_failure_mode() {
    let mut server = RedisServer::start();
    let policy = compile(
        "redis.yaml",
        r#"
version: "1"
limits:
  - name: per-user
    domain: api
    key: [user]
    capacity: 2
    refill: 1/h
    failure_mode: closed
"#,
    )
    .unwrap();
    let engine = Arc::new(PolicyEngine::new(policy, EngineOptions::default()));
    let descriptors = |head: &RequestHead<'_>| {
        let user = head.header("x-api-key").unwrap_or("anonymous");
        Ok(vec![vec![("user".to_owned(), user.to_owned())]])
    };
    let layer = TollgateLayer::policy(engine, "api", descriptors)
        .redis(store(&server).await)
        .build();
    let app = app(layer);
    assert_eq!(status(&app, "u1").await, StatusCode::OK);
    let second = app.clone().oneshot(keyed("u1")).await.unwrap();
    assert_eq!(
        second.headers()["ratelimit"]
            .to_str()
            .unwrap()
            .split(";t=")
            .next(),
        Some(r#""per-user";r=0"#)
    );
    assert_eq!(status(&app, "u1").await, StatusCode::TOO_MANY_REQUESTS);
    server.kill();
    assert_eq!(status(&app, "u2").await, StatusCode::SERVICE_UNAVAILABLE);
}

/// A reservation through Redis, on one limit and on a policy: settled once, the rest back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_are_settled_in_redis() {
    let server = RedisServer::start();
    let layer = TollgateLayer::limit(
        "tokens",
        limit(100, "100/h"),
        Header::new(HeaderName::from_static("x-api-key")),
    )
    .redis(store(&server).await, FailureMode::Closed)
    .cost(|_| 60)
    .reservations()
    .build();
    let settle = |axum::Extension(reservation): axum::Extension<tollgate_tower::Reservation>| async move {
        let first = reservation
            .settle(10)
            .await
            .map_or_else(|e| e.to_string(), |s| format!("{s:?}"));
        let again = reservation
            .settle(10)
            .await
            .map_or_else(|e| e.to_string(), |s| format!("{s:?}"));
        format!("{first} {again}")
    };
    let app = Router::new().route("/", get(settle)).layer(layer);
    for _ in 0..4 {
        let response = app.clone().oneshot(keyed("k")).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let bytes = axum::body::to_bytes(response.into_body(), 1024)
            .await
            .unwrap();
        assert_eq!(&bytes[..], b"Settled Repeated");
    }

    let engine = PolicyEngine::new(
        compile(
            "p.yaml",
            "version: \"1\"\nlimits:\n  - name: per-user\n    domain: api\n    key: [user]\n    capacity: 100\n    refill: 100/h\n",
        )
        .unwrap(),
        EngineOptions::default(),
    );
    let layer = TollgateLayer::policy(Arc::new(engine), "api", |head: &RequestHead<'_>| {
        Ok(vec![vec![(
            "user".to_owned(),
            head.header("x-api-key").unwrap_or("none").to_owned(),
        )]])
    })
    .redis(store(&server).await)
    .cost(|_| 60)
    .reservations()
    .build();
    let app = Router::new().route("/", get(settle)).layer(layer);
    for _ in 0..4 {
        let response = app.clone().oneshot(keyed("p")).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
}
