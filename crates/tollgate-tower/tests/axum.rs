//! An axum app behind the layer, in memory: the answers, the headers, the shared budget,
//! extractor failures and policies. Time is a `ManualClock`; nothing sleeps.

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, to_bytes};
use axum::extract::ConnectInfo;
use axum::response::Response;
use axum::routing::get;
use http::header::HeaderName;
use http::{Request, StatusCode};
use support::Down;
use tollgate::{Limit, ManualClock};
use tollgate_policy::{EngineOptions, PolicyEngine, compile};
use tollgate_tower::{Error, Header, HeaderStyle, MissingKey, PeerIp, RequestHead, TollgateLayer};
use tower::ServiceExt;

fn limit(capacity: u64, rate: &str) -> Limit {
    Limit::new(capacity, rate.parse().unwrap()).unwrap()
}

fn api_key() -> Header {
    Header::new(HeaderName::from_static("x-api-key"))
}

fn app(layer: TollgateLayer) -> Router {
    Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(layer)
}

fn get_with_key(key: &str) -> Request<Body> {
    Request::get("/")
        .header("x-api-key", key)
        .body(Body::empty())
        .unwrap()
}

async fn send(app: &Router, request: Request<Body>) -> Response {
    app.clone().oneshot(request).await.unwrap()
}

fn header<'a>(response: &'a Response, name: &str) -> &'a str {
    response
        .headers()
        .get(name)
        .unwrap_or_else(|| panic!("no {name} header"))
        .to_str()
        .unwrap()
}

async fn body(response: Response) -> String {
    let bytes = to_bytes(response.into_body(), 1 << 16).await.unwrap();
    String::from_utf8(bytes.to_vec()).unwrap()
}

#[tokio::test]
async fn answers_429_with_the_rate_limit_fields_after_the_burst() {
    let clock = ManualClock::new();
    let layer = TollgateLayer::limit("per-key", limit(3, "1/2s"), api_key())
        .clock(clock.clone())
        .build();
    let app = app(layer);

    for remaining in (0..3).rev() {
        let ok = send(&app, get_with_key("k1")).await;
        assert_eq!(ok.status(), StatusCode::OK);
        assert_eq!(header(&ok, "ratelimit-policy"), r#""per-key";q=3;w=6"#);
        // Until full while tokens remain (2 s a token), until the next token at 0.
        let t = if remaining == 0 {
            2
        } else {
            2 * (3 - remaining)
        };
        assert_eq!(
            header(&ok, "ratelimit"),
            format!(r#""per-key";r={remaining};t={t}"#)
        );
        assert!(ok.headers().get("retry-after").is_none());
        assert_eq!(body(ok).await, "hello");
    }

    clock.advance(Duration::from_millis(500));
    let denied = send(&app, get_with_key("k1")).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    // 1.5 s to the next token: rounded up, never down.
    assert_eq!(header(&denied, "retry-after"), "2");
    assert_eq!(header(&denied, "ratelimit-policy"), r#""per-key";q=3;w=6"#);
    assert_eq!(header(&denied, "ratelimit"), r#""per-key";r=0;t=2"#);
    assert_eq!(header(&denied, "content-type"), "application/problem+json");
    let text = body(denied).await;
    assert!(text.contains("quota-exceeded"), "{text}");
    assert!(
        text.contains(r#""violated-policies":["per-key"]"#),
        "{text}"
    );

    // Another key has its own bucket; the first refills on time.
    assert_eq!(
        send(&app, get_with_key("k2")).await.status(),
        StatusCode::OK
    );
    clock.advance(Duration::from_millis(1500));
    assert_eq!(
        send(&app, get_with_key("k1")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&app, get_with_key("k1")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn every_clone_and_every_service_of_a_layer_share_one_budget() {
    let layer = TollgateLayer::limit("global", limit(2, "1/h"), tollgate_tower::Global)
        .clock(ManualClock::new())
        .build();
    let a = app(layer.clone());
    let b = Router::new()
        .route("/", get(|| async { "other" }))
        .layer(layer);
    assert_eq!(send(&a, get_with_key("x")).await.status(), StatusCode::OK);
    assert_eq!(send(&b, get_with_key("y")).await.status(), StatusCode::OK);
    assert_eq!(
        send(&a.clone(), get_with_key("z")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        send(&b, get_with_key("z")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_never_over_admit() {
    const CAPACITY: u64 = 100;
    // The clock never moves: exactly the burst may pass, whatever the interleaving.
    let layer = TollgateLayer::limit("per-key", limit(CAPACITY, "1/h"), api_key())
        .clock(ManualClock::new())
        .build();
    let app = app(layer);
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move {
                let mut admitted = 0u64;
                for _ in 0..20 {
                    let response = app.clone().oneshot(get_with_key("hot")).await.unwrap();
                    match response.status() {
                        StatusCode::OK => admitted += 1,
                        StatusCode::TOO_MANY_REQUESTS => {}
                        other => panic!("unexpected {other}"),
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
    assert_eq!(admitted, CAPACITY);
}

#[tokio::test]
async fn a_missing_key_is_a_400_by_default() {
    let layer = TollgateLayer::limit("per-key", limit(5, "1/s"), api_key())
        .clock(ManualClock::new())
        .build();
    let app = app(layer);
    let response = send(&app, Request::get("/").body(Body::empty()).unwrap()).await;
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        header(&response, "content-type"),
        "application/problem+json"
    );
    let text = body(response).await;
    assert!(text.contains("header x-api-key"), "{text}");

    // Invalid values are refused the same way, never a panic.
    let bad = Request::get("/")
        .header(
            "x-api-key",
            http::HeaderValue::from_bytes(b"\xfe\xff").unwrap(),
        )
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&app, bad).await.status(), StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn a_missing_key_can_fall_back_to_one_shared_bucket() {
    let layer = TollgateLayer::limit("per-key", limit(2, "1/h"), api_key())
        .on_missing_key(MissingKey::Fallback("anonymous".into()))
        .clock(ManualClock::new())
        .build();
    let app = app(layer);
    let anonymous = || Request::get("/").body(Body::empty()).unwrap();
    assert_eq!(send(&app, anonymous()).await.status(), StatusCode::OK);
    assert_eq!(send(&app, anonymous()).await.status(), StatusCode::OK);
    assert_eq!(
        send(&app, anonymous()).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // Identified clients are unaffected by the anonymous bucket.
    assert_eq!(send(&app, get_with_key("k")).await.status(), StatusCode::OK);
}

#[tokio::test]
async fn the_peer_address_from_axum_connect_info() {
    let key = PeerIp::from_extension(|info: &ConnectInfo<SocketAddr>| Some(info.0.ip()));
    let layer = TollgateLayer::limit("per-ip", limit(1, "1/h"), key)
        .clock(ManualClock::new())
        .build();
    let app = app(layer);
    let from = |addr: &str| {
        let mut request = Request::get("/").body(Body::empty()).unwrap();
        request
            .extensions_mut()
            .insert(ConnectInfo(addr.parse::<SocketAddr>().unwrap()));
        request
    };
    assert_eq!(
        send(&app, from("10.0.0.1:1000")).await.status(),
        StatusCode::OK
    );
    // Another port of the same host is the same client.
    assert_eq!(
        send(&app, from("10.0.0.1:2000")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        send(&app, from("10.0.0.2:1000")).await.status(),
        StatusCode::OK
    );
}

#[tokio::test]
async fn the_cost_function_charges_and_exempts() {
    let cost = |head: &RequestHead<'_>| match head.uri.path() {
        "/healthz" => 0,
        "/" => 1,
        _ => 100,
    };
    let layer = TollgateLayer::limit("per-key", limit(3, "1/h"), api_key())
        .cost(cost)
        .clock(ManualClock::new())
        .build();
    let app = Router::new()
        .route("/", get(|| async { "hello" }))
        .route("/healthz", get(|| async { "ok" }))
        .route("/big", get(|| async { "big" }))
        .layer(layer);
    let path = |p: &str| {
        Request::get(p)
            .header("x-api-key", "k")
            .body(Body::empty())
            .unwrap()
    };
    for _ in 0..3 {
        assert_eq!(send(&app, path("/")).await.status(), StatusCode::OK);
    }
    assert_eq!(
        send(&app, path("/")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // Free requests pass unchecked, and carry no rate-limit fields.
    let health = send(&app, path("/healthz")).await;
    assert_eq!(health.status(), StatusCode::OK);
    assert!(health.headers().get("ratelimit").is_none());
    // A cost above the capacity could never pass: refused, not told to retry.
    let big = send(&app, path("/big")).await;
    assert_eq!(big.status(), StatusCode::BAD_REQUEST);
    assert!(big.headers().get("retry-after").is_none());
}

#[tokio::test]
async fn headers_on_success_can_be_turned_off() {
    let layer = TollgateLayer::limit("per-key", limit(1, "1/h"), api_key())
        .headers_on_success(false)
        .clock(ManualClock::new())
        .build();
    let app = app(layer);
    let ok = send(&app, get_with_key("k")).await;
    assert!(ok.headers().get("ratelimit").is_none());
    let denied = send(&app, get_with_key("k")).await;
    assert_eq!(header(&denied, "ratelimit"), r#""per-key";r=0;t=3600"#);
}

const POLICY: &str = r#"
version: "3"
limits:
  - name: per-user
    domain: api
    key: [user]
    capacity: 2
    refill: 1/s
  - name: per-tenant
    domain: api
    key: [tenant]
    capacity: 10
    refill: 10/m
  - name: watching
    domain: api
    key: [user]
    capacity: 1
    refill: 1/h
    mode: shadow
"#;

fn descriptors(head: &RequestHead<'_>) -> Result<Vec<tollgate_tower::Descriptor>, Error> {
    let user = head.header("x-user").ok_or_else(|| Error::MissingKey {
        what: "header x-user".into(),
    })?;
    let tenant = head.header("x-tenant").unwrap_or("none");
    Ok(vec![vec![
        ("user".into(), user.into()),
        ("tenant".into(), tenant.into()),
    ]])
}

/// A request from user `u` of tenant acme.
fn user(u: &str) -> Request<Body> {
    Request::get("/")
        .header("x-user", u)
        .header("x-tenant", "acme")
        .body(Body::empty())
        .unwrap()
}

#[tokio::test]
async fn a_policy_decides_all_its_limits_and_reports_the_enforced_ones() {
    let clock = ManualClock::new();
    let engine = PolicyEngine::new(
        compile("test.yaml", POLICY).unwrap(),
        EngineOptions::default().clock(Arc::new(clock.clone())),
    );
    let layer = TollgateLayer::policy(Arc::new(engine), "api", descriptors).build();
    let app = app(layer);

    let ok = send(&app, user("u1")).await;
    assert_eq!(ok.status(), StatusCode::OK);
    // The shadow limit has already run dry, but it never speaks to the client.
    assert_eq!(
        header(&ok, "ratelimit-policy"),
        r#""per-user";q=2;w=2, "per-tenant";q=10;w=60"#
    );
    assert_eq!(
        header(&ok, "ratelimit"),
        r#""per-user";r=1;t=1, "per-tenant";r=9;t=6"#
    );
    assert_eq!(send(&app, user("u1")).await.status(), StatusCode::OK);

    let denied = send(&app, user("u1")).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&denied, "retry-after"), "1");
    assert_eq!(
        header(&denied, "ratelimit"),
        r#""per-user";r=0;t=1, "per-tenant";r=8;t=12"#
    );
    let text = body(denied).await;
    assert!(
        text.contains(r#""violated-policies":["per-user"]"#),
        "{text}"
    );

    // All or nothing: the rejected request charged the tenant nothing.
    let other = send(&app, user("u2")).await;
    assert_eq!(
        header(&other, "ratelimit"),
        r#""per-user";r=1;t=1, "per-tenant";r=7;t=18"#
    );

    clock.advance(Duration::from_secs(1));
    assert_eq!(send(&app, user("u1")).await.status(), StatusCode::OK);

    // No user: the descriptor function says so, and the request is refused.
    let anonymous = Request::get("/").body(Body::empty()).unwrap();
    assert_eq!(
        send(&app, anonymous).await.status(),
        StatusCode::BAD_REQUEST
    );
}

/// `X-RateLimit-*` speak for the limit the client must heed: the one with the fewest tokens
/// left, then the one that rejected; with both styles the draft's fields come too, and with
/// none only `Retry-After` tells a client anything.
#[tokio::test]
async fn x_rate_limit_fields_follow_the_tightest_limit() {
    let clock = ManualClock::new();
    let engine = Arc::new(PolicyEngine::new(
        compile("test.yaml", POLICY).unwrap(),
        EngineOptions::default().clock(Arc::new(clock.clone())),
    ));
    let fields = |response: &Response| -> Vec<String> {
        [
            "x-ratelimit-limit",
            "x-ratelimit-remaining",
            "x-ratelimit-reset",
        ]
        .iter()
        .filter_map(|name| response.headers().get(*name))
        .map(|value| value.to_str().unwrap().to_owned())
        .collect()
    };
    let layer = |style| {
        TollgateLayer::policy(Arc::clone(&engine), "api", descriptors)
            .rate_limit_headers(style)
            .build()
    };
    let legacy = app(layer(HeaderStyle::XRateLimit));
    let ok = send(&legacy, user("u1")).await;
    assert_eq!(ok.status(), StatusCode::OK);
    // per-user has 1 of 2 left, per-tenant 9 of 10: the user's limit, full again in 1 s.
    assert_eq!(fields(&ok), ["2", "1", "1"]);
    assert!(ok.headers().get("ratelimit").is_none());
    assert!(ok.headers().get("ratelimit-policy").is_none());

    let both = app(layer(HeaderStyle::Both));
    let ok = send(&both, user("u1")).await;
    assert_eq!(fields(&ok), ["2", "0", "1"]);
    assert_eq!(
        header(&ok, "ratelimit"),
        r#""per-user";r=0;t=1, "per-tenant";r=8;t=12"#
    );
    let denied = send(&both, user("u1")).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(fields(&denied), ["2", "0", "1"]);
    assert_eq!(header(&denied, "retry-after"), "1");

    let quiet = app(layer(HeaderStyle::None));
    let denied = send(&quiet, user("u1")).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(fields(&denied).is_empty());
    assert!(denied.headers().get("ratelimit").is_none());
    assert_eq!(header(&denied, "retry-after"), "1");
    let ok = send(&quiet, user("u2")).await;
    assert_eq!(ok.status(), StatusCode::OK);
    assert!(fields(&ok).is_empty() && ok.headers().get("ratelimit").is_none());
}

/// Two layers, each adding `X-RateLimit-*`: the response keeps the figures of whichever limit
/// has fewer tokens left, whichever layer is outside.
#[tokio::test]
async fn nested_layers_keep_the_tighter_x_rate_limit() {
    for tight_outside in [true, false] {
        let layer = |name: &str, capacity| {
            TollgateLayer::limit(name, limit(capacity, "1/s"), api_key())
                .rate_limit_headers(HeaderStyle::XRateLimit)
                .clock(ManualClock::new())
                .build()
        };
        let (outer, inner) = if tight_outside {
            (layer("tight", 3), layer("roomy", 50))
        } else {
            (layer("roomy", 50), layer("tight", 3))
        };
        let app = Router::new()
            .route("/", get(|| async { "hello" }))
            .layer(inner)
            .layer(outer);
        let ok = send(&app, get_with_key("k")).await;
        assert_eq!(header(&ok, "x-ratelimit-limit"), "3", "{tight_outside}");
        assert_eq!(header(&ok, "x-ratelimit-remaining"), "2");
        assert_eq!(header(&ok, "x-ratelimit-reset"), "1");
        assert_eq!(ok.headers().get_all("x-ratelimit-limit").iter().count(), 1);
    }
}

/// On a tie in tokens left, the fields already on the response stay: the inner layer's
/// answer may be a rejection, and its figures are the ones to heed.
#[tokio::test]
async fn nested_layers_with_equal_tokens_left_keep_the_inner_fields() {
    let layer = |name: &str, capacity, rate| {
        TollgateLayer::limit(name, limit(capacity, rate), api_key())
            .rate_limit_headers(HeaderStyle::XRateLimit)
            .clock(ManualClock::new())
            .build()
    };
    let app = Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(layer("inner", 3, "1/s"))
        .layer(layer("outer", 3, "1/m"));
    // Both have 2 left; the outer one would be full later.
    let ok = send(&app, get_with_key("k")).await;
    assert_eq!(header(&ok, "x-ratelimit-remaining"), "2");
    assert_eq!(header(&ok, "x-ratelimit-reset"), "1");

    let app = Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(layer("inner", 1, "1/s"))
        .layer(layer("outer", 2, "1/m"));
    assert_eq!(send(&app, get_with_key("k")).await.status(), StatusCode::OK);
    // The outer layer admits with nothing left; the inner one refuses with nothing left.
    let refused = send(&app, get_with_key("k")).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&refused, "x-ratelimit-limit"), "1");
    assert_eq!(header(&refused, "x-ratelimit-reset"), "1");
    assert_eq!(header(&refused, "retry-after"), "1");
}

/// A request over two limits at once names both in its problem document.
#[tokio::test]
async fn a_429_names_every_limit_it_broke() {
    let engine = PolicyEngine::new(
        compile("test.yaml", POLICY).unwrap(),
        EngineOptions::default().clock(Arc::new(ManualClock::new())),
    );
    let app = app(TollgateLayer::policy(Arc::new(engine), "api", descriptors).build());
    // Five users of acme, two requests each: every one of them and the tenant run dry.
    for u in ["u1", "u2", "u3", "u4", "u5"] {
        for _ in 0..2 {
            assert_eq!(send(&app, user(u)).await.status(), StatusCode::OK);
        }
    }
    let refused = send(&app, user("u1")).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let text = body(refused).await;
    assert!(
        text.contains(r#""violated-policies":["per-user","per-tenant"]"#),
        "{text}"
    );
}

/// A descriptor function that fails for a reason of its own making (not the request's) is a
/// 500, logged, that tells the client nothing about the configuration; gRPC callers get
/// `INTERNAL`.
#[tokio::test]
async fn a_configuration_failure_is_a_500() {
    let engine = Arc::new(PolicyEngine::new(
        compile("test.yaml", POLICY).unwrap(),
        EngineOptions::default(),
    ));
    let broken = |_: &RequestHead<'_>| -> Result<Vec<tollgate_tower::Descriptor>, Error> {
        Err(Error::Store(tollgate::Error::EmptyCheck))
    };
    let app = app(TollgateLayer::policy(engine, "api", broken).build());
    let failed = send(&app, user("u1")).await;
    assert_eq!(failed.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(header(&failed, "content-type"), "application/problem+json");
    assert_eq!(
        body(failed).await,
        r#"{"title":"Internal Server Error","status":500,"detail":"the rate limiter cannot decide"}"#
    );
    let grpc = Request::post("/")
        .header("content-type", "application/grpc")
        .body(Body::empty())
        .unwrap();
    let failed = send(&app, grpc).await;
    assert_eq!(header(&failed, "grpc-status"), "13");
}

/// The layer's readiness is the inner service's: it holds no queue of its own.
#[tokio::test]
async fn readiness_is_the_inner_service_s() {
    let layer = TollgateLayer::limit("per-key", limit(2, "1/s"), api_key()).build();
    let mut service = tower::Layer::layer(&layer, Down);
    let ready = service.ready().await.map(|_| ());
    assert_eq!(ready, Err("the service is down"));
}

#[tokio::test]
async fn debug_output_says_what_decides() {
    let builder = TollgateLayer::limit("per-key", limit(2, "1/s"), api_key());
    let shown = format!("{builder:?}");
    assert!(
        shown.starts_with(r#"LimitBuilder { name: "per-key", limit: "#)
            && shown.ends_with("missing: Reject, .. }"),
        "{shown}"
    );
    let layer = builder.build();
    assert_eq!(
        format!("{layer:?}"),
        r#"TollgateLayer { limiter: "limit per-key (capacity 2 refill 1/s)", .. }"#
    );
    assert_eq!(
        format!("{:?}", tower::Layer::layer(&layer, Down)),
        "Tollgate { inner: Down, .. }"
    );
    let engine = Arc::new(PolicyEngine::new(
        compile("test.yaml", POLICY).unwrap(),
        EngineOptions::default(),
    ));
    let builder = TollgateLayer::policy(engine, "api", descriptors);
    assert_eq!(
        format!("{builder:?}"),
        r#"PolicyBuilder { domain: "api", .. }"#
    );
    assert_eq!(
        format!("{:?}", builder.build()),
        r#"TollgateLayer { limiter: "policy, domain api", .. }"#
    );
}

/// A tenant on a block list is answered 429 with a quota of nothing and no `Retry-After` (no
/// wait lifts it), even beside a limit that is merely empty; its requests charge nothing.
#[tokio::test]
async fn a_denied_request_is_told_no_wait_will_help() {
    let policy = format!(
        "{POLICY}  - name: blocked\n    domain: api\n    when: {{tenant: evil}}\n    deny: true\n"
    );
    let engine = PolicyEngine::new(
        compile("test.yaml", &policy).unwrap(),
        EngineOptions::default().clock(Arc::new(ManualClock::new())),
    );
    let layer = TollgateLayer::policy(Arc::new(engine), "api", descriptors).build();
    let app = app(layer);
    let request = |tenant: &str| {
        Request::get("/")
            .header("x-user", "u1")
            .header("x-tenant", tenant)
            .body(Body::empty())
            .unwrap()
    };
    for _ in 0..3 {
        let denied = send(&app, request("evil")).await;
        assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(denied.headers().get("retry-after").is_none());
        assert_eq!(
            header(&denied, "ratelimit"),
            // The others as a request of cost 1 would leave them: read, not charged.
            r#""per-user";r=1;t=1, "per-tenant";r=9;t=6, "blocked";r=0"#
        );
        let text = body(denied).await;
        assert!(
            text.contains(r#""violated-policies":["blocked"]"#),
            "{text}"
        );
    }
    // u1's bucket is still full: the denied requests were charged nothing.
    let ok = send(&app, request("acme")).await;
    assert_eq!(
        header(&ok, "ratelimit"),
        r#""per-user";r=1;t=1, "per-tenant";r=9;t=6"#
    );
}

/// The layer reads the clock before the store takes its lock, so on a real clock two requests
/// on one key often reach the bucket with their times in the opposite order. The later-timed
/// charge empties the bucket; the earlier-timed request must get a clean 429 showing 0 left
/// (its balance once overflowed: a panic in debug builds, a garbage `r` in release).
#[tokio::test]
async fn a_request_timed_before_the_last_charge_gets_a_clean_429() {
    let start = tollgate::Timestamp::from_nanos(10_000_000_000);
    let clock = ManualClock::starting_at(start);
    let layer = TollgateLayer::limit("per-key", limit(2, "1/s"), api_key())
        .clock(clock.clone())
        .build();
    let app = app(layer);
    for _ in 0..2 {
        assert_eq!(send(&app, get_with_key("k")).await.status(), StatusCode::OK);
    }
    clock.set(start - Duration::from_micros(1));
    let denied = send(&app, get_with_key("k")).await;
    assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(
        header(&denied, "ratelimit").starts_with(r#""per-key";r=0;"#),
        "{}",
        header(&denied, "ratelimit")
    );
}

/// A handler that settles its reservation for what the `x-used` header says, and answers
/// what the settlement said (`none` without a reservation).
fn settling_app(layer: TollgateLayer) -> Router {
    let handler = |reservation: Option<axum::Extension<tollgate_tower::Reservation>>,
                   headers: http::HeaderMap| async move {
        let Some(axum::Extension(reservation)) = reservation else {
            return "none".to_owned();
        };
        let used = headers
            .get("x-used")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .unwrap_or(reservation.cost());
        match reservation.settle(used).await {
            Ok(status) => format!("{status:?}"),
            Err(err) => format!("error: {err}"),
        }
    };
    Router::new().route("/", get(handler)).layer(layer)
}

fn using(key: &str, used: u64) -> Request<Body> {
    Request::get("/")
        .header("x-api-key", key)
        .header("x-user", key)
        .header("x-used", used.to_string())
        .body(Body::empty())
        .unwrap()
}

/// Each request reserves 60 of 100 tokens and uses 10: without reservations the second is
/// refused, with them every one passes, each settled once.
#[tokio::test]
async fn reservations_give_back_what_the_handler_did_not_use() {
    let clock = ManualClock::new();
    let reserving = TollgateLayer::limit("tokens", limit(100, "100/h"), api_key())
        .clock(clock.clone())
        .cost(|_| 60)
        .reservations()
        .build();
    let app = settling_app(reserving);
    for _ in 0..5 {
        let response = send(&app, using("k", 10)).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(body(response).await, "Settled");
    }
    // Used all of it: nothing back, so 100 - 60 left... then refused.
    let spent = send(&app, using("k2", 60)).await;
    assert_eq!(body(spent).await, "Settled");
    assert_eq!(
        send(&app, using("k2", 60)).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // More than reserved is refused and gives nothing.
    let over = send(&app, using("k3", 61)).await;
    assert!(body(over).await.starts_with("error:"));

    let plain = TollgateLayer::limit("tokens", limit(100, "100/h"), api_key())
        .clock(clock)
        .cost(|_| 60)
        .build();
    let app = settling_app(plain);
    let first = send(&app, using("k", 10)).await;
    assert_eq!(body(first).await, "none");
    assert_eq!(
        send(&app, using("k", 10)).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// A handler that settles for the whole reservation (the cost it reports) gives nothing back.
#[tokio::test]
async fn a_reservation_settled_for_its_cost_gives_nothing_back() {
    let layer = TollgateLayer::limit("tokens", limit(100, "100/h"), api_key())
        .clock(ManualClock::new())
        .cost(|_| 60)
        .reservations()
        .build();
    // No `x-used`: the handler settles for `cost()`.
    let app = settling_app(layer.clone());
    assert_eq!(body(send(&app, get_with_key("k")).await).await, "Settled");
    assert_eq!(
        send(&app, get_with_key("k")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    let shown = |axum::Extension(reservation): axum::Extension<tollgate_tower::Reservation>| async move {
        format!("{reservation:?}")
    };
    let app = Router::new().route("/", get(shown)).layer(layer);
    let text = body(send(&app, get_with_key("k2")).await).await;
    assert!(
        text.starts_with(r#"Reservation { cost: 60, request_id: "reservation-"#)
            && text.ends_with(r#"", .. }"#),
        "{text}"
    );
}

#[tokio::test]
async fn a_policy_layer_settles_every_limit_it_charged() {
    let clock = ManualClock::new();
    let engine = PolicyEngine::new(
        compile("test.yaml", POLICY).unwrap(),
        EngineOptions::default().clock(Arc::new(clock.clone())),
    );
    let layer = TollgateLayer::policy(Arc::new(engine), "api", descriptors)
        .cost(|_| 2)
        .reservations()
        .build();
    let app = settling_app(layer);
    // per-user holds 2 (time stands still): a reservation of 2 that used nothing leaves the
    // bucket full for the next; one that used 1 leaves 1, too few for the next.
    for _ in 0..4 {
        let response = send(&app, using("u1", 0)).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(body(response).await, "Settled");
    }
    assert_eq!(body(send(&app, using("u1", 1)).await).await, "Settled");
    assert_eq!(
        send(&app, using("u1", 0)).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}
