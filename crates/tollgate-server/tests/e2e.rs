//! End to end: the real `tollgate` binary, over HTTP and gRPC, as clients and Envoy use it.

mod support;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use std::time::Duration;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use support::{
    Scratch, Server, assert_serve_flags_refused, descriptor, metric, path_str, post_json, request,
    run, serve_refused, serve_refused_with_env, should_rate_limit, statuses, wait_for,
};

const POLICY: &str = r#"
version: "1"
limits:
  - name: per-user
    domain: api
    key: [user]
    capacity: 3
    refill: 1/m
  - name: per-tenant
    domain: api
    key: [tenant]
    capacity: 100
    refill: 1/m
  - name: shadowed
    domain: api
    when: {route: /search}
    key: [user]
    capacity: 1
    refill: 1/h
    mode: shadow
"#;

fn check_body(user: &str) -> String {
    format!(r#"{{"domain":"api","descriptors":[{{"user":"{user}"}}]}}"#)
}

#[test]
fn http_check_until_429_with_rate_limit_headers() {
    let scratch = Scratch::new("http");
    let config = scratch.write("policy.yaml", POLICY);
    let server = Server::start(&["--config", path_str(&config)]);
    for left in [2, 1, 0] {
        let answer = post_json(server.http, "/v1/check", &check_body("alice"));
        assert_eq!(answer.status, 200, "{}", answer.body);
        let body = answer.json();
        assert_eq!(body["allowed"], true);
        assert_eq!(body["policy_version"], "1");
        assert_eq!(body["limits"][0]["remaining"], left);
        assert_eq!(
            answer.header("ratelimit-policy"),
            Some(r#""per-user";q=3;w=180"#)
        );
        assert!(answer.header("retry-after").is_none());
    }
    let answer = post_json(server.http, "/v1/check", &check_body("alice"));
    assert_eq!(answer.status, 429);
    let body = answer.json();
    assert_eq!(body["allowed"], false);
    assert_eq!(body["limits"][0]["name"], "per-user");
    // One token a minute: the next one is at most 60 s away, rounded up.
    let retry: u64 = answer.header("retry-after").unwrap().parse().unwrap();
    assert!((59..=60).contains(&retry), "Retry-After {retry}");
    let ratelimit = answer.header("ratelimit").unwrap();
    assert!(ratelimit.starts_with(r#""per-user";r=0;t="#), "{ratelimit}");
    // Another user is untouched.
    assert_eq!(
        post_json(server.http, "/v1/check", &check_body("bob")).status,
        200
    );
    // Explain shows the bucket without charging it.
    let explain = post_json(server.http, "/v1/explain", &check_body("bob"));
    assert_eq!(explain.status, 200);
    assert_eq!(explain.json()["limits"][0]["bucket_key"], "per-user|bob");
    assert_eq!(explain.json()["limits"][0]["remaining"], 1);
    assert_eq!(
        explain.json()["limits"][0]["remaining"],
        1,
        "explain charges nothing"
    );
}

#[test]
fn shadow_limits_decide_but_never_reject() {
    let scratch = Scratch::new("shadow");
    let config = scratch.write("policy.yaml", POLICY);
    let server = Server::start(&["--config", path_str(&config)]);
    let body = r#"{"domain":"api","descriptors":[{"route":"/search","user":"carol"}]}"#;
    post_json(server.http, "/v1/check", body);
    let answer = post_json(server.http, "/v1/check", body);
    assert_eq!(answer.status, 200);
    let limits = answer.json()["limits"].clone();
    let shadow = limits
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == "shadowed")
        .cloned()
        .unwrap();
    assert_eq!(shadow["mode"], "shadow");
    assert_eq!(
        shadow["allowed"], false,
        "the shadow limit would have rejected"
    );
}

#[test]
fn forward_auth_for_nginx_and_traefik() {
    let scratch = Scratch::new("forward");
    let config = scratch.write("policy.yaml", POLICY);
    let server = Server::start(&[
        "--config",
        path_str(&config),
        "--forward-auth-header",
        "user=X-User-Id",
        "--forward-auth-deny-status",
        "403",
    ]);
    let headers = [("X-User-Id", "dave"), ("X-Original-URI", "/pay?x=1")];
    for _ in 0..3 {
        let answer = request(server.http, "GET", "/v1/forward-auth/api", &headers, "");
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert_eq!(answer.body, "allowed");
        assert!(answer.header("ratelimit").is_some());
    }
    let answer = request(server.http, "GET", "/v1/forward-auth/api", &headers, "");
    assert_eq!(answer.status, 403, "nginx passes only 401/403 on");
    assert_eq!(answer.body, "rate limited");
    assert!(answer.header("retry-after").is_some());
    // x-tollgate-<entry> headers and a cost.
    let answer = request(
        server.http,
        "POST",
        "/v1/forward-auth/api",
        &[("x-tollgate-user", "erin"), ("x-tollgate-cost", "3")],
        "",
    );
    assert_eq!(answer.status, 200);
    let answer = request(
        server.http,
        "POST",
        "/v1/forward-auth/api",
        &[("x-tollgate-user", "erin"), ("x-tollgate-cost", "abc")],
        "",
    );
    assert_eq!(answer.status, 400);
}

/// `--rate-limit-headers x-ratelimit`: the check API, forward-auth and RLS answer with
/// `X-RateLimit-*` for the tightest limit, and without the draft's fields; `both` sends the
/// two sets, `none` neither; a style of another name stops the start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn x_rate_limit_headers_on_every_interface() {
    let scratch = Scratch::new("x-ratelimit");
    let config = scratch.write("policy.yaml", POLICY);
    let server = Server::start(&[
        "--config",
        path_str(&config),
        "--rate-limit-headers",
        "x-ratelimit",
    ]);
    let fields = |answer: &support::Answer| {
        [
            "x-ratelimit-limit",
            "x-ratelimit-remaining",
            "x-ratelimit-reset",
        ]
        .map(|name| answer.header(name).map(str::to_owned))
    };
    // A user's 3 and a tenant's 100, one token a minute each: the user's limit is the one to
    // heed, full again 60 s after each charge.
    let body = r#"{"domain":"api","descriptors":[{"user":"ivy","tenant":"acme"}]}"#;
    for (left, full_in) in [("2", "60"), ("1", "120"), ("0", "60")] {
        let answer = post_json(server.http, "/v1/check", body);
        assert_eq!(answer.status, 200, "{}", answer.body);
        let [limit, remaining, reset] = fields(&answer);
        assert_eq!(limit.as_deref(), Some("3"));
        assert_eq!(remaining.as_deref(), Some(left));
        // Emptied, the reset is the wait for one token, as the draft's `t`.
        assert_eq!(reset.as_deref(), Some(full_in), "{left} left");
        assert!(answer.header("ratelimit").is_none());
        assert!(answer.header("ratelimit-policy").is_none());
    }
    let answer = post_json(server.http, "/v1/check", body);
    assert_eq!(answer.status, 429);
    let [limit, remaining, reset] = fields(&answer);
    assert_eq!(
        (limit.as_deref(), remaining.as_deref()),
        (Some("3"), Some("0"))
    );
    let reset: u64 = reset.unwrap().parse().unwrap();
    assert_eq!(
        answer.header("retry-after"),
        Some(reset.to_string().as_str())
    );
    assert!((59..=60).contains(&reset), "reset {reset}");

    let answer = request(
        server.http,
        "GET",
        "/v1/forward-auth/api",
        &[("x-tollgate-user", "jay")],
        "",
    );
    assert_eq!(answer.status, 200);
    assert_eq!(
        fields(&answer).map(Option::unwrap),
        ["3", "2", "60"].map(str::to_owned)
    );
    assert!(answer.header("ratelimit").is_none());

    let rls = RateLimitRequest {
        domain: "api".to_owned(),
        descriptors: vec![descriptor(&[("user", "kim")])],
        hits_addend: 1,
    };
    let response = should_rate_limit(&server, rls.clone()).await.unwrap();
    let added: Vec<(&str, &str)> = response
        .response_headers_to_add
        .iter()
        .map(|h| (h.key.as_str(), h.value.as_str()))
        .collect();
    assert_eq!(
        added,
        [
            ("x-ratelimit-limit", "3"),
            ("x-ratelimit-remaining", "2"),
            ("x-ratelimit-reset", "60")
        ]
    );
    drop(server);

    let both = Server::start(&[
        "--config",
        path_str(&config),
        "--rate-limit-headers",
        "both",
    ]);
    let answer = post_json(both.http, "/v1/check", body);
    assert_eq!(answer.header("x-ratelimit-remaining"), Some("2"));
    assert_eq!(
        answer.header("ratelimit"),
        Some(r#""per-user";r=2;t=60, "per-tenant";r=99;t=60"#)
    );
    let response = should_rate_limit(&both, rls.clone()).await.unwrap();
    assert_eq!(response.response_headers_to_add.len(), 5);
    drop(both);

    let none = Server::start(&[
        "--config",
        path_str(&config),
        "--rate-limit-headers",
        "none",
    ]);
    for _ in 0..3 {
        let answer = post_json(none.http, "/v1/check", body);
        assert_eq!(fields(&answer), [None, None, None]);
        assert!(answer.header("ratelimit").is_none());
    }
    let answer = post_json(none.http, "/v1/check", body);
    assert_eq!(answer.status, 429);
    assert!(
        answer.header("retry-after").is_some(),
        "still told when to come back"
    );
    let response = should_rate_limit(&none, rls).await.unwrap();
    assert!(response.response_headers_to_add.is_empty());
    drop(none);

    assert_serve_flags_refused(&[(
        "--rate-limit-headers",
        "legacy",
        "expected ietf, x-ratelimit, both or none",
    )]);
}

/// A limit on part of a site, as the README shows it: every path under `/api/`, query strings
/// and all, shares a user's bucket; paths outside it are not limited.
#[test]
fn forward_auth_limits_a_path_prefix() {
    let scratch = Scratch::new("forward-prefix");
    let config = scratch.write(
        "policy.yaml",
        "limits:\n  - name: api-per-user\n    domain: api\n    when: {path: !prefix /api/}\n    key: [user]\n    capacity: 3\n    refill: 1/h\n",
    );
    let server = Server::start(&[
        "--config",
        path_str(&config),
        "--forward-auth-header",
        "user=X-User-Id",
    ]);
    let status = |uri: &str| {
        let headers = [("X-User-Id", "dave"), ("X-Forwarded-Uri", uri)];
        request(server.http, "GET", "/v1/forward-auth/api", &headers, "").status
    };
    for uri in ["/api/users", "/api/orders?page=2", "/api/"] {
        assert_eq!(status(uri), 200, "{uri}");
    }
    assert_eq!(
        status("/api/users/7"),
        429,
        "the fourth under /api/ shares the bucket"
    );
    for uri in ["/apix", "/web/api/", "/"] {
        assert_eq!(status(uri), 200, "{uri} is outside the prefix");
    }
}

/// SPEC §5: a request no limit applies to is allowed. A forward-auth subrequest that carries
/// none of the mapped headers (an anonymous client) must not be a 400, which nginx
/// `auth_request` turns into a 500 for the client.
#[test]
fn forward_auth_without_any_descriptor_header_is_allowed() {
    let scratch = Scratch::new("forward-anonymous");
    let policy =
        format!("{POLICY}  - {{name: everyone, domain: open, capacity: 1, refill: 1/h}}\n");
    let config = scratch.write("policy.yaml", &policy);
    let server = Server::start(&[
        "--config",
        path_str(&config),
        "--forward-auth-header",
        "user=X-User-Id",
    ]);
    let answer = request(server.http, "GET", "/v1/forward-auth/api", &[], "");
    assert_eq!(answer.status, 200, "{}", answer.body);
    let metrics = request(server.http, "GET", "/metrics", &[], "").body;
    assert!(
        metrics.contains("tollgate_unmatched_requests_total{api=\"forward_auth\"} 1"),
        "counted as unmatched:\n{metrics}"
    );
    // A limit on every request of a domain still applies to anonymous clients.
    let answer = request(server.http, "GET", "/v1/forward-auth/open", &[], "");
    assert_eq!(answer.status, 200, "{}", answer.body);
    let answer = request(server.http, "GET", "/v1/forward-auth/open", &[], "");
    assert_eq!(answer.status, 429, "{}", answer.body);
    // Without headers, a bad cost is still refused, and so is a domain past the bound every
    // API keeps, but not one at it.
    let cost = [("x-tollgate-cost", "0")];
    let answer = request(server.http, "GET", "/v1/forward-auth/api", &cost, "");
    assert_eq!(answer.status, 400, "{}", answer.body);
    let longest = format!("/v1/forward-auth/{}", "d".repeat(256));
    let answer = request(server.http, "GET", &longest, &[], "");
    assert_eq!(answer.status, 200, "{}", answer.body);
    let answer = request(server.http, "GET", &format!("{longest}d"), &[], "");
    assert_eq!(answer.status, 400, "{}", answer.body);
    assert_eq!(
        answer.json()["error"]["code"],
        "too_large",
        "{}",
        answer.body
    );
}

/// nginx and Traefik pass header bytes through as they came; a user id in UTF-8 (`josé`) in a
/// mapped header must be rate limited like anyone else's, not answered 400 (`invalid_header`),
/// which nginx `auth_request` turns into a 500 for that user on every request.
#[test]
fn forward_auth_accepts_a_utf8_header_value() {
    let scratch = Scratch::new("forward-utf8");
    let config = scratch.write("policy.yaml", POLICY);
    let server = Server::start(&[
        "--config",
        path_str(&config),
        "--forward-auth-header",
        "user=X-User-Id",
    ]);
    let headers = [("X-User-Id", "jos\u{e9}"), ("X-Original-URI", "/pay")];
    for _ in 0..3 {
        let answer = request(server.http, "GET", "/v1/forward-auth/api", &headers, "");
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
    let answer = request(server.http, "GET", "/v1/forward-auth/api", &headers, "");
    assert_eq!(answer.status, 429, "josé has a bucket of their own");
    let other = [("X-User-Id", "jose")];
    let answer = request(server.http, "GET", "/v1/forward-auth/api", &other, "");
    assert_eq!(answer.status, 200, "{}", answer.body);
}

/// Descriptors with different `hits_addend`s are still all or nothing: a request rejected on
/// one descriptor charges none of the others (they were once decided one cost after another).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rls_descriptors_of_different_costs_are_all_or_nothing() {
    let scratch = Scratch::new("grpc-mixed");
    let config = scratch.write("policy.yaml", POLICY);
    let server = Server::start(&["--config", path_str(&config)]);
    let http = server.http;
    let drain = r#"{"domain":"api","descriptors":[{"user":"drained"}],"cost":3}"#;
    let drained = tokio::task::spawn_blocking(move || post_json(http, "/v1/check", drain));
    assert_eq!(drained.await.unwrap().status, 200);
    let mut costly = descriptor(&[("user", "mixed")]);
    costly.hits_addend = Some(envoy_types::pb::google::protobuf::UInt64Value { value: 2 });
    let request = RateLimitRequest {
        domain: "api".to_owned(),
        descriptors: vec![costly, descriptor(&[("user", "drained")])],
        hits_addend: 1,
    };
    let response = should_rate_limit(&server, request).await.unwrap();
    assert_eq!(response.overall_code, Code::OverLimit as i32);
    assert_eq!(response.statuses[0].code, Code::Ok as i32, "mixed had room");
    assert_eq!(response.statuses[1].code, Code::OverLimit as i32);
    let all = r#"{"domain":"api","descriptors":[{"user":"mixed"}],"cost":3}"#;
    let answer = tokio::task::spawn_blocking(move || post_json(http, "/v1/check", all));
    let answer = answer.await.unwrap();
    assert_eq!(answer.status, 200, "mixed was charged: {}", answer.body);
}

/// Envoy's hits given back (`is_negative_hits`) are refused unless the server is started to
/// take them, charging nothing; taken, they go back to the buckets a check of the descriptor
/// charges, first in a call, never past full, and are counted per limit (at most a bucket each).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rls_hits_given_back_are_refused_unless_switched_on() {
    let scratch = Scratch::new("grpc-negative-hits");
    let config = scratch.write("policy.yaml", POLICY);
    let hits = |user: &str, value: u64, given_back: bool| RateLimitDescriptor {
        hits_addend: Some(envoy_types::pb::google::protobuf::UInt64Value { value }),
        is_negative_hits: given_back,
        ..descriptor(&[("user", user)])
    };
    let call = |descriptors| RateLimitRequest {
        domain: "api".to_owned(),
        descriptors,
        hits_addend: 0,
    };
    let (ok, over) = (Code::Ok as i32, Code::OverLimit as i32);

    let refusing = Server::start(&["--config", path_str(&config)]);
    let refused = should_rate_limit(&refusing, call(vec![hits("u", 2, true)]))
        .await
        .expect_err("refused by default");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(
        refused.message().contains("--negative-hits give-back"),
        "{refused:?}"
    );
    let full = should_rate_limit(&refusing, call(vec![hits("u", 3, false)]))
        .await
        .unwrap();
    assert_eq!(statuses(&full), [(ok, 0)], "nothing was charged or given");

    let server = Server::start(&[
        "--config",
        path_str(&config),
        "--negative-hits",
        "give-back",
    ]);
    let spent = should_rate_limit(&server, call(vec![hits("u", 3, false)]))
        .await
        .unwrap();
    assert_eq!(statuses(&spent), [(ok, 0)]);
    let over_limit = should_rate_limit(&server, call(vec![hits("u", 1, false)]))
        .await
        .unwrap();
    assert_eq!(over_limit.overall_code, over);
    // Two come back: the status is the standing afterwards.
    let given = should_rate_limit(&server, call(vec![hits("u", 2, true)]))
        .await
        .unwrap();
    assert_eq!(given.overall_code, ok);
    assert_eq!(statuses(&given), [(ok, 2)]);
    // Given back first in a call, then charged: one back and three taken pass together.
    let both = should_rate_limit(&server, call(vec![hits("u", 3, false), hits("u", 1, true)]))
        .await
        .unwrap();
    assert_eq!(both.overall_code, ok, "{both:?}");
    // Each status as its part left the bucket: three after the one back, none after the take.
    assert_eq!(statuses(&both), [(ok, 0), (ok, 3)]);
    // More than the bucket holds fills it, and no more.
    let flood = should_rate_limit(&server, call(vec![hits("u", 1_000_000, true)]))
        .await
        .unwrap();
    assert_eq!(statuses(&flood), [(ok, 3)]);
    let again = should_rate_limit(&server, call(vec![hits("u", 3, false)]))
        .await
        .unwrap();
    assert_eq!(statuses(&again), [(ok, 0)]);
    assert_eq!(
        should_rate_limit(&server, call(vec![hits("u", 1, false)]))
            .await
            .unwrap()
            .overall_code,
        over
    );
    // Hits of 0 given back are a check, as any hits of 0.
    let looked = should_rate_limit(&server, call(vec![hits("u", 0, true)]))
        .await
        .unwrap();
    assert_eq!(looked.overall_code, over);
    let counted = metric(
        &server,
        "tollgate_hits_given_back_total{limit=\"per-user\"}",
    );
    // 2, then 1, then the 3 that fill the bucket of the million sent.
    assert_eq!(counted, 6.0);
    assert_serve_flags_refused(&[("--negative-hits", "maybe", "invalid value")]);
}

/// Envoy's `limit` action sends a limit with the descriptor. tollgate decides by its policy
/// (a client must not set its own limit), and tells the operator once that the limit sent is
/// ignored, so a setup moved over from envoyproxy/ratelimit does not change silently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_sent_with_a_descriptor_is_ignored_and_said_once() {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
    let scratch = Scratch::new("grpc-limit-override");
    let config = scratch.write("policy.yaml", POLICY);
    let (server, stderr) = Server::start_logging(&["--config", path_str(&config)], "warn");
    let request = || {
        let mut sent = descriptor(&[("user", "overriding")]);
        sent.limit = Some(RateLimitOverride {
            requests_per_unit: 1_000,
            unit: 1,
        });
        RateLimitRequest {
            domain: "api".to_owned(),
            descriptors: vec![sent],
            hits_addend: 1,
        }
    };
    let mut codes = Vec::new();
    for _ in 0..4 {
        let response = should_rate_limit(&server, request()).await.unwrap();
        codes.push(response.overall_code);
    }
    // per-user's capacity of 3, not the 1,000 a second sent.
    let (ok, over) = (Code::Ok as i32, Code::OverLimit as i32);
    assert_eq!(codes, [ok, ok, ok, over]);
    let logs = tokio::task::spawn_blocking(move || server.terminate_and_read(stderr))
        .await
        .expect("terminate");
    assert_eq!(logs.matches("carries its own limit").count(), 1, "{logs}");
}

/// Envoy's `limit` action, where the policy asks for it: the limit sent decides, in a bucket
/// of its own, and Envoy's `current_limit` reports it; a limit that cannot be applied is
/// refused, and nothing is said about limits ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_sent_with_a_descriptor_decides_where_the_policy_applies_it() {
    let scratch = Scratch::new("grpc-request-limit");
    let config = scratch.write("policy.yaml", support::REQUEST_LIMITS);
    let (server, stderr) = Server::start_logging(&["--config", path_str(&config)], "warn");
    let asking =
        |requests_per_unit: Option<u32>| support::asking_for(requests_per_unit.map(|n| (n, 2)));
    let (ok, over) = (Code::Ok as i32, Code::OverLimit as i32);
    let mut seen = Vec::new();
    for _ in 0..3 {
        let response = should_rate_limit(&server, asking(Some(2))).await.unwrap();
        let status = &response.statuses[0];
        let limit = status.current_limit.clone().unwrap_or_default();
        seen.push((
            response.overall_code,
            status.limit_remaining,
            limit.name,
            limit.requests_per_unit,
            limit.unit,
        ));
    }
    let minute = 2;
    assert_eq!(
        seen,
        [
            (ok, 1, "per-route".to_owned(), 2, minute),
            (ok, 0, "per-route".to_owned(), 2, minute),
            (over, 0, "per-route".to_owned(), 2, minute),
        ]
    );
    // The policy's own bucket is another one, untouched.
    let own = should_rate_limit(&server, asking(None)).await.unwrap();
    assert_eq!(
        (own.overall_code, own.statuses[0].limit_remaining),
        (ok, 99)
    );
    // Envoy's "deny all": denied, reported as 0 a second, and the own bucket left untouched.
    for _ in 0..2 {
        let denied = should_rate_limit(&server, asking(Some(0))).await.unwrap();
        let status = &denied.statuses[0];
        let limit = status.current_limit.clone().unwrap_or_default();
        assert_eq!(
            (denied.overall_code, limit.requests_per_unit, limit.unit),
            (over, 0, 1),
            "{denied:?}"
        );
    }
    let own = should_rate_limit(&server, asking(None)).await.unwrap();
    assert_eq!(own.statuses[0].limit_remaining, 98);
    // The policy says which limits apply what is sent.
    let http = server.http;
    let listed = tokio::task::spawn_blocking(move || request(http, "GET", "/v1/policy", &[], ""))
        .await
        .unwrap();
    assert_eq!(
        listed.json()["limits"][0]["request_limit"],
        "apply",
        "{}",
        listed.body
    );
    let logs = tokio::task::spawn_blocking(move || server.terminate_and_read(stderr))
        .await
        .expect("terminate");
    assert!(!logs.contains("carries its own limit"), "{logs}");
}

const WINDOWS: &str = r#"
version: "w"
limits:
  - name: hourly
    domain: api
    key: [user]
    algorithm: fixed_window
    limit: 2
    window: 1h
  - name: smooth
    domain: api
    key: [tenant]
    algorithm: sliding_window
    limit: 3
    window: 1m
  - name: exact
    domain: api
    key: [client]
    algorithm: sliding_log
    limit: 2
    window: 1h
"#;

/// Whole seconds from now to the next full hour of the wall clock, rounded up.
#[allow(clippy::disallowed_methods)] // The test compares with the wall clock on purpose.
fn seconds_to_the_hour() -> u64 {
    let since_1970 = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let into_hour = since_1970.as_nanos() % 3_600_000_000_000;
    u64::try_from((3_600_000_000_000 - into_hour).div_ceil(1_000_000_000)).unwrap_or(0)
}

/// The window algorithms through both APIs: the window in the headers and in Envoy's
/// `current_limit`, a rejection's wait to the window's end (or, for a sliding log, to the
/// first request's leaving it), and no charge on a rejection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn window_limits_over_http_and_grpc() {
    let scratch = Scratch::new("windows");
    let config = scratch.write("policy.yaml", WINDOWS);
    let server = Server::start(&["--config", path_str(&config)]);
    let http = server.http;
    let answers = tokio::task::spawn_blocking(move || {
        (0..3)
            .map(|_| post_json(http, "/v1/check", &check_body("win")))
            .collect::<Vec<_>>()
    });
    let answers = answers.await.unwrap();
    assert_eq!(answers[0].status, 200, "{}", answers[0].body);
    assert_eq!(answers[1].json()["limits"][0]["remaining"], 0);
    assert_eq!(
        answers[1].header("ratelimit-policy"),
        Some(r#""hourly";q=2;w=3600"#)
    );
    assert_eq!(answers[2].status, 429);
    // Windows follow the wall clock's hours, as Envoy's do: the wait is to the next full hour
    // (read after the answer, so at most a second or two less than the wait it was given).
    let retry: u64 = answers[2].header("retry-after").unwrap().parse().unwrap();
    let to_the_hour = seconds_to_the_hour();
    assert!(
        (to_the_hour..=to_the_hour + 2).contains(&retry) || to_the_hour > 3_590,
        "Retry-After {retry}, {to_the_hour} s to the hour"
    );

    let request = |tenant: &str, hits| RateLimitRequest {
        domain: "api".to_owned(),
        descriptors: vec![descriptor(&[("tenant", tenant)])],
        hits_addend: hits,
    };
    let response = should_rate_limit(&server, request("t", 2)).await.unwrap();
    assert_eq!(response.overall_code, Code::Ok as i32);
    let status = &response.statuses[0];
    let limit = status.current_limit.as_ref().unwrap();
    assert_eq!(
        (limit.requests_per_unit, limit.unit),
        (3, 2),
        "3 per minute"
    );
    assert_eq!(status.limit_remaining, 1);
    let response = should_rate_limit(&server, request("t", 2)).await.unwrap();
    assert_eq!(response.overall_code, Code::OverLimit as i32);
    // Rejected, so nothing was charged: one more still fits.
    let response = should_rate_limit(&server, request("t", 1)).await.unwrap();
    assert_eq!(response.overall_code, Code::Ok as i32);
    assert_eq!(response.statuses[0].limit_remaining, 0);

    // A sliding log's window ends now, not on the clock's hours: the wait is until the first
    // request leaves it, an hour after it came.
    let exact = r#"{"domain":"api","descriptors":[{"client":"c"}],"cost":1}"#;
    let answers = tokio::task::spawn_blocking(move || {
        (0..3)
            .map(|_| post_json(http, "/v1/check", exact))
            .collect::<Vec<_>>()
    });
    let answers = answers.await.unwrap();
    assert_eq!(answers[1].status, 200, "{}", answers[1].body);
    assert_eq!(
        answers[1].header("ratelimit-policy"),
        Some(r#""exact";q=2;w=3600"#)
    );
    assert_eq!(answers[2].status, 429, "{}", answers[2].body);
    let retry: u64 = answers[2].header("retry-after").unwrap().parse().unwrap();
    assert!((3_599..=3_600).contains(&retry), "Retry-After {retry}");
    let mut request = request("c", 1);
    request.descriptors = vec![descriptor(&[("client", "c")])];
    let response = should_rate_limit(&server, request).await.unwrap();
    assert_eq!(response.overall_code, Code::OverLimit as i32);
    let limit = response.statuses[0].current_limit.as_ref().unwrap();
    assert_eq!((limit.requests_per_unit, limit.unit), (2, 3), "2 per hour");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_rls_over_grpc() {
    let scratch = Scratch::new("grpc");
    let config = scratch.write("policy.yaml", POLICY);
    let server = Server::start(&["--config", path_str(&config)]);
    let request = |hits| RateLimitRequest {
        domain: "api".to_owned(),
        descriptors: vec![
            descriptor(&[("user", "frank")]),
            descriptor(&[("other", "x")]),
        ],
        hits_addend: hits,
    };
    // hits_addend 0 means 1: three pass.
    for left in [2, 1, 0] {
        let response = should_rate_limit(&server, request(0)).await.unwrap();
        assert_eq!(response.overall_code, Code::Ok as i32);
        assert_eq!(
            response.statuses.len(),
            2,
            "one status per descriptor, in order"
        );
        let status = &response.statuses[0];
        assert_eq!(status.limit_remaining, left);
        let limit = status.current_limit.as_ref().unwrap();
        assert_eq!(
            (limit.name.as_str(), limit.requests_per_unit),
            ("per-user", 1)
        );
        // The unmatched descriptor is OK with no limit.
        assert_eq!(response.statuses[1].code, Code::Ok as i32);
        assert!(response.statuses[1].current_limit.is_none());
    }
    let response = should_rate_limit(&server, request(0)).await.unwrap();
    assert_eq!(response.overall_code, Code::OverLimit as i32);
    assert_eq!(response.statuses[0].code, Code::OverLimit as i32);
    // The first of the three tokens comes back a minute after it was taken, well within the
    // time this test has run.
    let until = response.statuses[0].duration_until_reset.unwrap();
    assert!((50..60).contains(&until.seconds), "{until:?}");
    assert!((0..1_000_000_000).contains(&until.nanos), "{until:?}");
    let names: Vec<&str> = response
        .response_headers_to_add
        .iter()
        .map(|h| h.key.as_str())
        .collect();
    assert!(
        names.contains(&"ratelimit") && names.contains(&"ratelimit-policy"),
        "{names:?}"
    );
    // An unknown domain is OK.
    let unknown = RateLimitRequest {
        domain: "nowhere".to_owned(),
        descriptors: vec![descriptor(&[("user", "frank")])],
        hits_addend: 1,
    };
    let response = should_rate_limit(&server, unknown).await.unwrap();
    assert_eq!(response.overall_code, Code::Ok as i32);
    // A descriptor's own hits_addend of 0 checks without charging: georgia keeps all three.
    let check_only = RateLimitRequest {
        domain: "api".to_owned(),
        descriptors: vec![RateLimitDescriptor {
            hits_addend: Some(envoy_types::pb::google::protobuf::UInt64Value { value: 0 }),
            ..descriptor(&[("user", "georgia")])
        }],
        hits_addend: 1,
    };
    for _ in 0..5 {
        let response = should_rate_limit(&server, check_only.clone())
            .await
            .unwrap();
        assert_eq!(response.overall_code, Code::Ok as i32);
        assert_eq!(
            response.statuses[0].limit_remaining, 2,
            "peeked, never charged"
        );
    }
    // Beside a check-only descriptor, a charged one pays its own hits_addend, and the
    // check-only one still nothing.
    let mut mixed = check_only.clone();
    mixed.descriptors.push(RateLimitDescriptor {
        hits_addend: Some(envoy_types::pb::google::protobuf::UInt64Value { value: 2 }),
        ..descriptor(&[("tenant", "t-mixed")])
    });
    for left in [98, 96] {
        let response = should_rate_limit(&server, mixed.clone()).await.unwrap();
        assert_eq!(response.overall_code, Code::Ok as i32);
        let remaining: Vec<u32> = response
            .statuses
            .iter()
            .map(|status| status.limit_remaining)
            .collect();
        assert_eq!(remaining, [2, left]);
    }
    // A cost above the capacity can never pass: OVER_LIMIT, which Envoy enforces (a gRPC error
    // would let the request through), and nothing charged.
    let mut too_many = check_only.clone();
    too_many.hits_addend = 50;
    too_many.descriptors[0].hits_addend = None;
    let response = should_rate_limit(&server, too_many).await.unwrap();
    assert_eq!(response.overall_code, Code::OverLimit as i32);
    assert_eq!(response.statuses[0].code, Code::OverLimit as i32);
    let response = should_rate_limit(&server, check_only).await.unwrap();
    assert_eq!(response.statuses[0].limit_remaining, 2, "nothing charged");
}

/// An exempted subject's limit is not decided at all: RLS answers OK, however often it asks,
/// while the limit keeps holding everyone else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exempted_subject_passes_rls() {
    let scratch = Scratch::new("grpc-exempt");
    let policy = r#"
version: "exempt-1"
limits:
  - {name: per-user, domain: api, key: [user], capacity: 1, refill: 1/h}
exemptions:
  - limit: per-user
    when: {user: vip}
    owner: ops@example.com
    reason: a load test
    expires: 2099-01-01T00:00:00Z
"#;
    let config = scratch.write("policy.yaml", policy);
    let server = Server::start(&["--config", path_str(&config)]);
    let request = |user| RateLimitRequest {
        domain: "api".to_owned(),
        descriptors: vec![descriptor(&[("user", user)])],
        hits_addend: 1,
    };
    for _ in 0..3 {
        let response = should_rate_limit(&server, request("vip")).await.unwrap();
        assert_eq!(response.overall_code, Code::Ok as i32);
        assert_eq!(response.statuses[0].code, Code::Ok as i32);
    }
    let codes = [
        should_rate_limit(&server, request("anyone")).await.unwrap(),
        should_rate_limit(&server, request("anyone")).await.unwrap(),
    ]
    .map(|response| response.overall_code);
    assert_eq!(codes, [Code::Ok as i32, Code::OverLimit as i32]);
    // Counted apart: the exempted calls under `exempt`, the others as decided.
    let decisions = |result: &str, mode: &str| {
        let series = format!(
            r#"tollgate_decisions_total{{limit="per-user",result="{result}",mode="{mode}",api="grpc"}}"#
        );
        metric(&server, &series)
    };
    assert_eq!(decisions("exempt", "exempt"), 3.0);
    assert_eq!(decisions("allowed", "enforce"), 1.0);
    assert_eq!(decisions("rejected", "enforce"), 1.0);
}

#[test]
fn metrics_count_decisions() {
    let server = Server::start(&[]);
    for _ in 0..12 {
        post_json(server.http, "/v1/check", &check_body("gina"));
    }
    post_json(
        server.http,
        "/v1/check",
        r#"{"domain":"elsewhere","descriptors":[{"a":"b"}]}"#,
    );
    let metrics = request(server.http, "GET", "/metrics", &[], "").body;
    let value = |series: &str| -> f64 {
        metrics
            .lines()
            .find(|line| line.starts_with(series))
            .and_then(|line| line.rsplit(' ').next())
            .and_then(|value| value.parse().ok())
            .unwrap_or_else(|| panic!("no {series} in\n{metrics}"))
    };
    assert_eq!(
        value(
            r#"tollgate_decisions_total{limit="per-user",result="allowed",mode="enforce",api="http"}"#
        ),
        10.0
    );
    assert_eq!(
        value(
            r#"tollgate_decisions_total{limit="per-user",result="rejected",mode="enforce",api="http"}"#
        ),
        2.0
    );
    assert_eq!(
        value(r#"tollgate_unmatched_requests_total{api="http"}"#),
        1.0
    );
    assert_eq!(value(r#"tollgate_policy_info{version="demo-1"}"#), 1.0);
    assert_eq!(value("tollgate_live_buckets"), 1.0);
    // Every decision is timed, under its API and its store.
    assert_eq!(
        value(r#"tollgate_decision_duration_seconds_count{api="http",store="memory"}"#),
        13.0
    );
    // Another API's decisions, on the same threads, are timed under its own label.
    for _ in 0..4 {
        let headers = [("x-tollgate-user", "hana")];
        let answer = request(server.http, "GET", "/v1/forward-auth/api", &headers, "");
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
    let metrics = request(server.http, "GET", "/metrics", &[], "").body;
    for (api, count) in [("http", "13"), ("forward_auth", "4")] {
        let series =
            format!(r#"tollgate_decision_duration_seconds_count{{api="{api}",store="memory"}} "#);
        let counted = metrics.lines().find_map(|line| line.strip_prefix(&series));
        assert_eq!(counted, Some(count), "{metrics}");
    }
    // Of the ten allowed, the 9th and 10th left more than 0.8 of the capacity spent.
    let near = r#"tollgate_near_limit_decisions_total{limit="per-user",mode="enforce",api="http"}"#;
    assert_eq!(value(near), 2.0);
    // Every family comes with its help text.
    let families: Vec<&str> = metrics
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|typed| typed.split(' ').next())
        .collect();
    assert!(families.len() >= 5, "{metrics}");
    for family in families {
        assert!(
            metrics.contains(&format!("# HELP {family} ")),
            "no help for {family}"
        );
    }
    assert!(metrics.contains(
        "# HELP tollgate_decisions_total Limit decisions by limit, result, mode and API.\n"
    ));
}

/// `--near-limit-ratio` moves the line: at 0.5, the allowed decisions that left more than 5
/// of 10 spent (the 6th to the 10th); a ratio that is not one is refused in one line.
#[test]
fn the_near_limit_ratio_is_the_operators() {
    let server = Server::start(&["--near-limit-ratio", "0.5"]);
    for _ in 0..12 {
        post_json(server.http, "/v1/check", &check_body("nina"));
    }
    let near = r#"tollgate_near_limit_decisions_total{limit="per-user",mode="enforce",api="http"}"#;
    assert_eq!(support::metric(&server, near), 5.0);
    let refused: Vec<(&str, &str, &str)> = ["0", "1.5", "0.8x", ".", "0.1234", "80%", "", "1.0001"]
        .into_iter()
        .map(|bad| ("--near-limit-ratio", bad, "a decimal above 0 and at most 1"))
        .collect();
    support::assert_serve_flags_refused(&refused);
}

/// The hot-key series on `/metrics`: (key, decisions, rejections) of limit `per-user`.
fn hot_keys(metrics: &str) -> Vec<(String, f64, f64)> {
    let series = |name: &str| -> Vec<(String, f64)> {
        let prefix = format!("{name}{{limit=\"per-user\",key=\"");
        metrics
            .lines()
            .filter_map(|line| line.strip_prefix(&prefix))
            .filter_map(|rest| rest.split_once("\"} "))
            .filter_map(|(key, value)| Some((key.to_owned(), value.parse().ok()?)))
            .collect()
    };
    let rejections = series("tollgate_hot_key_rejections");
    series("tollgate_hot_key_decisions")
        .into_iter()
        .map(|(key, decisions)| {
            let rejected = rejections
                .iter()
                .find(|(other, _)| *other == key)
                .map_or(-1.0, |(_, value)| *value);
            (key, decisions, rejected)
        })
        .collect()
}

#[test]
// Windows pass in real time: the test waits for them.
#[allow(clippy::disallowed_methods)]
fn metrics_name_the_busiest_keys_of_the_last_window() {
    let scratch = Scratch::new("hot-keys");
    let config = scratch.write("policy.yaml", POLICY);
    let server = Server::start(&[
        "--config",
        path_str(&config),
        "--hot-keys",
        "2",
        "--hot-keys-window",
        "2s",
    ]);
    // One busy user (3 allowed, the rest rejected) among many that check once.
    for i in 0..400 {
        post_json(server.http, "/v1/check", &check_body("busy"));
        if i % 10 == 0 {
            post_json(server.http, "/v1/check", &check_body(&format!("quiet-{i}")));
        }
    }
    // The checks may straddle a window's end: watch the windows that complete after them and
    // keep the busiest figure reported.
    let started = std::time::Instant::now();
    let mut reported = Vec::new();
    let mut viewed = Vec::new();
    while started.elapsed() < Duration::from_secs(7) {
        let metrics = request(server.http, "GET", "/metrics", &[], "").body;
        assert!(
            metrics.contains("# TYPE tollgate_hot_key_decisions gauge"),
            "{metrics}"
        );
        let keys = hot_keys(&metrics);
        assert!(keys.len() <= 2, "at most --hot-keys keys: {keys:?}");
        reported.extend(keys);
        // The admin view of the same windows, with each estimate's bound.
        let answer = request(server.http, "GET", "/v1/hot-keys", &[], "");
        assert_eq!(answer.status, 200, "{}", answer.body);
        let view: serde_json::Value = serde_json::from_str(&answer.body).unwrap();
        assert_eq!(view["window_ms"], 2000);
        assert_eq!(view["sample"], 8);
        for key in view["keys"].as_array().unwrap() {
            let figure = |name: &str| key[name].as_f64().unwrap();
            assert_eq!(key["limit"], "per-user", "{key}");
            assert!(figure("overcount") <= figure("decisions"), "{key}");
            assert!(figure("rejections") <= figure("decisions"), "{key}");
            viewed.push((key["key"].as_str().unwrap().to_owned(), figure("decisions")));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    let (key, decisions, rejections) = reported
        .iter()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .cloned()
        .unwrap_or_else(|| panic!("no hot key reported"));
    assert_eq!(key, "per-user|busy");
    let busiest_viewed = viewed.iter().max_by(|a, b| a.1.total_cmp(&b.1)).unwrap();
    assert_eq!(busiest_viewed.0, "per-user|busy");
    assert!(busiest_viewed.1 >= 100.0, "{viewed:?}");
    // Sampled one in 8: at least half of the 400 fell in one window, estimated within wide
    // bounds of it.
    assert!((100.0..=800.0).contains(&decisions), "{decisions}");
    // The bucket holds 3 and refills one a minute: all but the busy user's first 3 checks
    // were rejected, so at most 3 sampled ones were not.
    assert!(
        rejections <= decisions && rejections >= decisions - 3.0 * 8.0,
        "{rejections} of {decisions}"
    );
    // Every quiet user checked once: none is reported near the busy one.
    for (key, decisions, _) in &reported {
        if key != "per-user|busy" {
            assert!(*decisions <= 24.0, "{key}: {decisions}");
        }
    }
    // By the last scrape the windows since the checks were empty: nothing is reported.
    let metrics = request(server.http, "GET", "/metrics", &[], "").body;
    assert!(hot_keys(&metrics).is_empty(), "{metrics}");

    // Off unless asked for, and off when asked to be.
    for off in [&[][..], &["--hot-keys", "0"][..]] {
        let args = [
            &["--config", path_str(&config), "--hot-keys-window", "1ms"][..],
            off,
        ]
        .concat();
        let off = Server::start(&args);
        post_json(off.http, "/v1/check", &check_body("busy"));
        std::thread::sleep(Duration::from_millis(50));
        let metrics = request(off.http, "GET", "/metrics", &[], "").body;
        assert!(!metrics.contains("tollgate_hot_key"), "{metrics}");
        let answer = request(off.http, "GET", "/v1/hot-keys", &[], "");
        assert_eq!(answer.status, 404);
        assert!(answer.body.contains("hot_keys_disabled"), "{}", answer.body);
    }
    // An admin endpoint: with a token, only its bearer sees the keys.
    let guarded = Server::start(&["--hot-keys", "1", "--admin-token", "s3cret"]);
    let refused = request(guarded.http, "GET", "/v1/hot-keys", &[], "");
    assert_eq!(refused.status, 401, "{}", refused.body);
    let bearer = [("authorization", "Bearer s3cret")];
    assert_eq!(
        request(guarded.http, "GET", "/v1/hot-keys", &bearer, "").status,
        200
    );
}

#[test]
fn hot_key_settings_are_checked_at_start() {
    assert_serve_flags_refused(&[
        ("--hot-keys", "101", "0 to 100"),
        ("--hot-keys", "ten", "0 to 100"),
        ("--hot-keys-window", "0s", "longer than 0"),
        ("--idempotency-window", "0s", "longer than 0"),
        ("--idempotency-window", "2d", "longer than a day"),
    ]);
}

#[test]
fn reload_and_rollback_through_the_api() {
    let scratch = Scratch::new("reload");
    let config = scratch.write("policy.yaml", POLICY);
    let server = Server::start(&["--config", path_str(&config), "--admin-token", "s3cret"]);
    let auth = [("Authorization", "Bearer s3cret")];
    let version = |server: &Server| {
        request(server.http, "GET", "/v1/policy", &auth, "").json()["version"].clone()
    };
    assert_eq!(version(&server), "1");
    assert_eq!(
        request(server.http, "POST", "/v1/policy/reload", &[], "").status,
        401
    );

    std::fs::write(&config, POLICY.replace("version: \"1\"", "version: \"2\"")).unwrap();
    let answer = request(server.http, "POST", "/v1/policy/reload", &auth, "");
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.json()["warnings"], serde_json::json!([]));
    // What changed, as `tollgate diff` says it: here the version alone.
    let changes = &answer.json()["diff"];
    assert_eq!(
        (&changes["from_version"], &changes["to_version"]),
        (&"1".into(), &"2".into())
    );
    assert_eq!(changes["limits"], serde_json::json!([]), "{changes}");
    assert_eq!(version(&server), "2");
    let decided = post_json(server.http, "/v1/check", &check_body("hank"));
    assert_eq!(decided.json()["policy_version"], "2");

    // A broken file is refused; version 2 stays, and the error is reported.
    std::fs::write(&config, "limits: [ {name: x, capacity: 0} ]").unwrap();
    let answer = request(server.http, "POST", "/v1/policy/reload", &auth, "");
    assert_eq!(answer.status, 422);
    assert_eq!(answer.json()["error"]["code"], "policy_refused");
    let status = request(server.http, "GET", "/v1/policy", &auth, "").json();
    assert_eq!(status["version"], "2");
    assert!(
        status["last_error"]["message"]
            .as_str()
            .unwrap()
            .contains("policy.yaml")
    );

    let answer = request(server.http, "POST", "/v1/policy/rollback", &auth, "");
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.json()["diff"]["to_version"], "1");
    assert_eq!(version(&server), "1");
    let answer = request(server.http, "POST", "/v1/policy/rollback", &auth, "");
    assert_eq!(answer.status, 409);

    // A valid version with a part that does nothing goes in force, and the answer says so.
    let dark = POLICY.replacen("    capacity:", "    rollout: 0%\n    capacity:", 1);
    std::fs::write(&config, dark.replace("version: \"1\"", "version: \"3\"")).unwrap();
    let answer = request(server.http, "POST", "/v1/policy/reload", &auth, "");
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(version(&server), "3");
    let warnings = answer.json()["warnings"].clone();
    assert_eq!(warnings.as_array().map(Vec::len), Some(1), "{warnings}");
    assert!(
        warnings[0]
            .as_str()
            .unwrap_or_default()
            .contains("rollout 0%")
    );
    let changed = &answer.json()["diff"]["limits"][0];
    assert_eq!(changed["name"], "per-user", "{changed}");
    assert_eq!(
        changed["fields"],
        serde_json::json!([{"field": "rollout", "from": "100%", "to": "0%"}])
    );
    assert_eq!(changed["enforcement"], "stops rejecting");
    assert_eq!(changed["buckets"], "kept");
}

/// On the demo policy, with an audit log file, SIGHUP opens the log again (after a rotation)
/// rather than ending the process.
#[test]
fn sighup_without_a_policy_file_reopens_the_audit_log() {
    let scratch = Scratch::new("sighup-audit");
    let audit = scratch.0.join("audit.jsonl");
    let server = Server::start(&["--audit-log", path_str(&audit)]);
    std::fs::rename(&audit, scratch.0.join("audit.jsonl.1")).expect("rotate");
    let status = std::process::Command::new("kill")
        .args(["-HUP", &server.pid().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success());
    support::wait_for("the audit log opened again", || {
        audit.exists().then_some(())
    });
    let body = r#"{"domain":"api","descriptors":[{"user":"alice"}]}"#;
    assert_eq!(post_json(server.http, "/v1/check", body).status, 200);
    let status = server.terminate();
    assert!(status.success(), "{status:?}");
}

/// SIGHUP reloads the policy file, as for Prometheus and nginx, rather than ending the process:
/// here it puts the file back in force after a rollback, which the file watcher leaves alone
/// (the file has not changed since). A broken file is refused, the version in force stays.
#[test]
// The file watcher and the signal act on their own time: the test polls for their effect.
#[allow(clippy::disallowed_methods)]
fn sighup_reloads_the_policy_file() {
    let scratch = Scratch::new("sighup");
    let config = scratch.write("policy.yaml", POLICY);
    let server = Server::start(&["--config", path_str(&config), "--admin-token", "s3cret"]);
    let auth = [("Authorization", "Bearer s3cret")];
    let version = || request(server.http, "GET", "/v1/policy", &auth, "").json()["version"].clone();
    let hangup = || {
        let status = std::process::Command::new("kill")
            .args(["-HUP", &server.pid().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
    };
    let wait_for = |wanted: &str| {
        for _ in 0..100 {
            if version() == wanted {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        panic!("version {wanted} never came in force (now {})", version());
    };
    std::fs::write(&config, POLICY.replace("version: \"1\"", "version: \"2\"")).unwrap();
    wait_for("2");
    let answer = request(server.http, "POST", "/v1/policy/rollback", &auth, "");
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(version(), "1");

    hangup();
    wait_for("2");
    std::fs::write(&config, "limits: [ {name: x, capacity: 0} ]").unwrap();
    hangup();
    for _ in 0..100 {
        let status = request(server.http, "GET", "/v1/policy", &auth, "").json();
        if !status["last_error"].is_null() {
            assert_eq!(status["version"], "2");
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    panic!("the broken file was never reported");
}

/// A SIGTERM that comes as soon as the server says it listens stops it gracefully (exit 0):
/// its handlers are in place by then. They were installed only once the server first waited
/// for a signal, and a SIGTERM before that ended the process at once, as by default.
#[test]
fn a_sigterm_at_once_after_listening_is_graceful() {
    for _ in 0..5 {
        let server = Server::start(&[]);
        let status = server.terminate();
        assert!(status.success(), "{status}");
    }
}

/// `--log-format json` writes every log line as one JSON object, its fields at the top, for a
/// log pipeline to index; the default is text.
#[test]
fn json_logs_are_one_object_per_line() {
    use std::io::Read as _;
    let (server, mut stderr) = Server::start_logging(&["--log-format", "json"], "info");
    assert!(server.terminate().success());
    let mut logs = String::new();
    stderr.read_to_string(&mut logs).expect("read the logs");
    let lines: Vec<serde_json::Value> = logs
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|err| panic!("{err}: {line}")))
        .collect();
    let stopping = lines
        .iter()
        .find(|line| {
            line["message"]
                .as_str()
                .is_some_and(|message| message.starts_with("shutting down"))
        })
        .unwrap_or_else(|| panic!("no shutdown line in {logs}"));
    assert_eq!(stopping["level"], "INFO", "{stopping}");
    assert!(stopping["timestamp"].is_string(), "{stopping}");

    let (server, mut stderr) = Server::start_logging(&[], "info");
    assert!(server.terminate().success());
    let mut logs = String::new();
    stderr.read_to_string(&mut logs).expect("read the logs");
    assert!(logs.contains("INFO"), "{logs}");
    assert!(
        !logs.trim_start().starts_with('{'),
        "text by default: {logs}"
    );
}

/// `tollgate_invalid_requests_total` counts requests refused as malformed or impossible, by
/// API, whether the body, the headers or the decision refused them.
#[test]
fn malformed_requests_are_counted_as_invalid() {
    let server = Server::start(&[]);
    let over_capacity = r#"{"domain":"api","descriptors":[{"user":"u"}],"cost":11}"#;
    for (path, body) in [
        ("/v1/check", "not json"),
        (
            "/v1/check",
            r#"{"domain":"api","descriptors":[{"user":"u"}],"cost":0}"#,
        ),
        ("/v1/check", over_capacity),
        ("/v1/explain", "not json"),
        ("/v1/explain", over_capacity),
    ] {
        let answer = post_json(server.http, path, body);
        assert_eq!(answer.status, 400, "{path} {body}: {}", answer.body);
    }
    let answer = request(
        server.http,
        "GET",
        "/v1/forward-auth/api",
        &[("x-tollgate-user", "u"), ("x-tollgate-cost", "0")],
        "",
    );
    assert_eq!(answer.status, 400, "{}", answer.body);
    let metrics = request(server.http, "GET", "/metrics", &[], "").body;
    let value = |api: &str| {
        let series = format!("tollgate_invalid_requests_total{{api=\"{api}\"}} ");
        metrics
            .lines()
            .find_map(|line| line.strip_prefix(&series))
            .map(str::to_owned)
    };
    assert_eq!(value("http").as_deref(), Some("5"), "{metrics}");
    assert_eq!(value("forward_auth").as_deref(), Some("1"), "{metrics}");
}

/// http/mod.rs: "Bad input of any kind is a 4xx with {"error":{"code","message"}}", a wrong
/// method too, with the methods the path serves in `Allow`.
#[test]
fn wrong_method_is_a_json_error() {
    let server = Server::start(&[]);
    let answer = request(server.http, "GET", "/v1/check", &[], "");
    assert_eq!(answer.status, 405);
    assert_eq!(answer.json()["error"]["code"], "method_not_allowed");
    assert_eq!(answer.header("allow"), Some("POST"));
    let answer = request(server.http, "DELETE", "/v1/forward-auth/api", &[], "");
    assert_eq!(answer.status, 405);
    assert_eq!(answer.json()["error"]["code"], "method_not_allowed");
    let answer = request(server.http, "POST", "/v1/policy", &[], "");
    assert_eq!(answer.status, 405);
    assert_eq!(answer.json()["error"]["code"], "method_not_allowed");
    assert_eq!(request(server.http, "GET", "/nope", &[], "").status, 404);
}

/// `/v1/noop`, the baseline `tollgate bench` measures the decision against: a short body on
/// either method.
#[test]
fn the_noop_endpoint_answers_without_deciding() {
    let server = Server::start(&[]);
    for method in ["GET", "POST"] {
        let answer = request(server.http, method, "/v1/noop", &[], "{}");
        assert_eq!((answer.status, answer.body.as_str()), (200, "noop\n"));
    }
}

#[test]
fn bad_requests_are_4xx_and_the_server_keeps_serving() {
    let server = Server::start(&[]);
    let long = "x".repeat(5_000);
    let many: Vec<String> = (0..40).map(|i| format!(r#"{{"user":"u{i}"}}"#)).collect();
    let cases: Vec<(String, u16, &str)> = vec![
        ("not json".to_owned(), 400, "invalid_json"),
        ("{}".to_owned(), 400, "invalid_json"),
        (
            r#"{"domain":"api","descriptors":[{"user":"u"}],"cost":1,"extra":1}"#.to_owned(),
            400,
            "invalid_json",
        ),
        (
            r#"{"domain":"api","descriptors":[{"user":"u"}],"cost":0}"#.to_owned(),
            400,
            "invalid_cost",
        ),
        (
            r#"{"domain":"api","descriptors":[{"user":"u"}],"cost":-1}"#.to_owned(),
            400,
            "invalid_json",
        ),
        (
            r#"{"domain":"api","descriptors":[{"user":"u"}],"cost":11}"#.to_owned(),
            400,
            "invalid_cost",
        ),
        (
            r#"{"domain":"api","descriptors":[{"user":"u"}],"cost":1e400}"#.to_owned(),
            400,
            "invalid_json",
        ),
        (
            r#"{"domain":"","descriptors":[{"user":"u"}]}"#.to_owned(),
            400,
            "invalid_domain",
        ),
        (
            r#"{"domain":"api","descriptors":[]}"#.to_owned(),
            400,
            "invalid_descriptor",
        ),
        (
            r#"{"domain":"api","descriptors":[{}]}"#.to_owned(),
            400,
            "invalid_descriptor",
        ),
        (
            r#"{"domain":"api","descriptors":[{"":"u"}]}"#.to_owned(),
            400,
            "invalid_descriptor",
        ),
        (
            r#"{"domain":"api","descriptors":[{"user":5}]}"#.to_owned(),
            400,
            "invalid_descriptor",
        ),
        (
            r#"{"domain":"api","descriptors":[{"user":"a","user":"b"}]}"#.to_owned(),
            400,
            "invalid_descriptor",
        ),
        (
            r#"{"domain":"api","descriptors":[["user","u"]]}"#.to_owned(),
            400,
            "invalid_json",
        ),
        (
            format!(r#"{{"domain":"api","descriptors":[{{"user":"{long}"}}]}}"#),
            400,
            "too_large",
        ),
        (
            format!(r#"{{"domain":"api","descriptors":[{}]}}"#, many.join(",")),
            400,
            "too_large",
        ),
        (
            r#"{"domain":"api","descriptors":[{"user":"u"}],"request_id":""}"#.to_owned(),
            400,
            "invalid_request_id",
        ),
    ];
    for (body, status, code) in &cases {
        let answer = post_json(server.http, "/v1/check", body);
        assert_eq!(answer.status, *status, "{body}: {}", answer.body);
        assert_eq!(answer.json()["error"]["code"], *code, "{body}");
    }
    let huge = format!(
        r#"{{"domain":"api","descriptors":[{{"user":"{}"}}]}}"#,
        "y".repeat(100_000)
    );
    assert_eq!(post_json(server.http, "/v1/check", &huge).status, 413);
    assert_eq!(request(server.http, "GET", "/nope", &[], "").status, 404);
    // Nothing was charged by any of them, and the server still decides.
    let answer = post_json(server.http, "/v1/check", &check_body("u"));
    assert_eq!(answer.status, 200);
    assert_eq!(answer.json()["limits"][0]["remaining"], 9);
}

/// `--admin-token "$TOKEN"` with TOKEN unset gives an empty token, which an absent credential
/// would match: refused at start, however it is given.
#[test]
fn an_empty_admin_token_is_refused_at_start() {
    for token in ["", "  "] {
        let stderr = serve_refused(&["--admin-token", token]);
        assert!(stderr.contains("--admin-token"), "{stderr}");
        let stderr = serve_refused_with_env(&[], &[("TOLLGATE_ADMIN_TOKEN", token)]);
        assert!(stderr.contains("TOLLGATE_ADMIN_TOKEN"), "{stderr}");
    }
}

/// `--http [::]:8080` (a dual-stack listener) and `curl http://127.0.0.1:8080/v1/policy` on
/// the same machine: the peer is `::ffff:127.0.0.1`, loopback as much as `::1` is.
#[test]
fn admin_accepts_ipv4_loopback_on_a_dual_stack_listener() {
    let server = Server::start_on("[::]:0", &[]);
    let port = server.http.port();
    for local in [format!("127.0.0.1:{port}"), format!("[::1]:{port}")] {
        let answer = request(local.parse().unwrap(), "GET", "/v1/policy", &[], "");
        assert_eq!(answer.status, 200, "{local}: {}", answer.body);
    }
}

/// RFC 9110 §11.1: the auth scheme is case-insensitive.
#[test]
fn admin_bearer_scheme_is_case_insensitive() {
    // A token read from a secret file keeps its newline; no header can carry it, so it is
    // trimmed at start.
    let server = Server::start(&["--admin-token", "s3cret\n"]);
    for auth in ["Bearer s3cret", "bearer s3cret", "BEARER  s3cret"] {
        let answer = request(
            server.http,
            "GET",
            "/v1/policy",
            &[("Authorization", auth)],
            "",
        );
        assert_eq!(answer.status, 200, "{auth}: {}", answer.body);
    }
    for auth in ["Bearer", "Bearer ", "Basic s3cret", "Bearer s3cre"] {
        let answer = request(
            server.http,
            "GET",
            "/v1/policy",
            &[("Authorization", auth)],
            "",
        );
        assert_eq!(answer.status, 401, "{auth}: {}", answer.body);
        assert_eq!(
            answer.header("www-authenticate"),
            Some("Bearer realm=\"tollgate\""),
            "a 401 names the scheme it takes"
        );
    }
}

/// The standard gRPC health service answers on the RLS port, as Envoy's `grpc_health_check`
/// and Kubernetes' gRPC probes ask it, beside the RLS service; and a `Watch` left open does not
/// hold up a graceful stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_health_beside_rls_and_a_watch_ends_at_the_stop() {
    let scratch = Scratch::new("grpc-health");
    let config = scratch.write("policy.yaml", POLICY);
    let server = Server::start(&["--config", path_str(&config)]);
    let channel = server.grpc_channel().await;
    let mut health = HealthClient::new(channel.clone());
    let ask = |service: &str| HealthCheckRequest {
        service: service.to_owned(),
    };
    let services = [
        "",
        "envoy.service.ratelimit.v3.RateLimitService",
        "envoy.service.rate_limit_quota.v3.RateLimitQuotaService",
    ];
    for service in services {
        let answer = health.check(ask(service)).await.expect("a known service");
        assert_eq!(
            answer.into_inner().status,
            ServingStatus::Serving as i32,
            "{service:?}"
        );
    }
    let unknown = health.check(ask("no.such.Service")).await.unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound, "{unknown:?}");

    // The same connection still reaches the RLS service.
    let request = RateLimitRequest {
        domain: "api".to_owned(),
        descriptors: vec![descriptor(&[("user", "healthy")])],
        hits_addend: 1,
    };
    let answer = RateLimitServiceClient::new(channel)
        .should_rate_limit(request)
        .await
        .expect("RLS beside health");
    assert_eq!(answer.into_inner().overall_code, Code::Ok as i32);

    let mut watch = health.watch(ask("")).await.expect("watch").into_inner();
    let first = watch.message().await.expect("a first status");
    assert_eq!(first.map(|m| m.status), Some(ServingStatus::Serving as i32));
    let status =
        tokio::task::spawn_blocking(move || server.terminate_within(Duration::from_secs(10)))
            .await
            .unwrap();
    assert!(
        status.is_some_and(|status| status.success()),
        "a watch held the stop: {status:?}"
    );
    let end = tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await
        .expect("the watch ends with the server");
    assert!(matches!(end, Ok(None) | Err(_)), "{end:?}");
}

#[test]
fn sigterm_shuts_down_cleanly() {
    let server = Server::start(&[]);
    let health = request(server.http, "GET", "/healthz", &[], "");
    assert_eq!((health.status, health.body.as_str()), (200, "ok\n"));
    assert_eq!(
        request(server.http, "GET", "/readyz", &[], "").json()["ready"],
        true
    );
    // Only the store can be left out of readiness; a misspelt check is said, not ignored.
    let excluded = request(server.http, "GET", "/readyz?exclude=store", &[], "");
    assert_eq!(excluded.status, 200, "{}", excluded.body);
    let misspelt = request(server.http, "GET", "/readyz?exclude=stores", &[], "");
    assert_eq!(misspelt.status, 400, "{}", misspelt.body);
    assert_eq!(misspelt.json()["error"]["code"], "invalid_query");
    let status = server.terminate();
    assert!(status.success(), "exit {status:?}");
}

#[test]
fn start_up_errors_are_one_line_and_exit_non_zero() {
    let scratch = Scratch::new("errors");
    let bad = scratch.write(
        "bad.yaml",
        "limits:\n  - name: x\n    domain: api\n    capacity: 5\n    refill: 10/x\n",
    );
    let stderr = serve_refused(&["--config", path_str(&bad)]);
    assert!(
        stderr.contains("bad.yaml:5:") && stderr.contains("refill"),
        "{stderr}"
    );

    // TLS files for a store that has no TLS: a mistake, not something to ignore.
    let stderr = serve_refused(&["--store-tls-ca", "/etc/ssl/ca.pem"]);
    assert!(
        stderr.contains("--store-tls-ca") && stderr.contains("memory"),
        "{stderr}"
    );

    // A port already taken.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().to_string();
    let (status, _, stderr) = run(&["serve", "--http", &port, "--grpc", "127.0.0.1:0"]);
    assert!(!status.success());
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("cannot listen on") && stderr.contains("--http"),
        "{stderr}"
    );
    // Likewise with a runtime per thread.
    let (status, _, stderr) = run(&[
        "serve",
        "--runtime",
        "per-core",
        "--http",
        &port,
        "--grpc",
        "127.0.0.1:0",
    ]);
    assert!(!status.success());
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("cannot listen on") && stderr.contains("--http"),
        "{stderr}"
    );
}

#[test]
fn the_number_of_threads_is_a_setting() {
    let server = Server::start(&["--threads", "1"]);
    let answer = post_json(server.http, "/v1/check", &check_body("threads"));
    assert_eq!(answer.status, 200, "{}", answer.body);
    // The runtime's threads are named tollgate-worker: one here, and none of the blocking
    // pool's yet, as nothing blocking has run.
    assert_eq!(threads_named(server.pid(), "tollgate-worker"), 1);

    // Refused by the flag parser, with its usage hint on the following lines.
    let (status, _, stderr) = run(&["serve", "--threads", "0"]);
    assert!(!status.success());
    assert!(stderr.contains("--threads"), "{stderr}");
}

/// Threads of process `pid` named `name`.
fn threads_named(pid: u32, name: &str) -> usize {
    wake_ups(pid, name).len()
}

/// How often each thread of process `pid` named `name` has gone to sleep and been woken, by
/// thread id: a thread that serves a request is woken for it.
fn wake_ups(pid: u32, name: &str) -> std::collections::BTreeMap<String, u64> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|task| {
            let task = task.ok()?.path();
            let comm = std::fs::read_to_string(task.join("comm")).ok()?;
            if comm.trim() != name {
                return None;
            }
            let status = std::fs::read_to_string(task.join("status")).ok()?;
            let switches = status
                .lines()
                .find_map(|line| line.strip_prefix("voluntary_ctxt_switches:"))?
                .trim()
                .parse()
                .ok()?;
            Some((task.file_name()?.to_string_lossy().into_owned(), switches))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_core_threads_share_the_connections_and_the_buckets() {
    let scratch = Scratch::new("per-core");
    let config = scratch.write("policy.yaml", POLICY);
    let server = Server::start(&[
        "--config",
        path_str(&config),
        "--runtime",
        "per-core",
        "--threads",
        "3",
    ]);
    // The main thread and two more, each with a runtime of its own (started just after the
    // listening line).
    let mut idle = wake_ups(server.pid(), "tollgate-worker");
    for _ in 0..500 {
        if idle.len() >= 2 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        idle = wake_ups(server.pid(), "tollgate-worker");
    }
    assert_eq!(idle.len(), 2);

    // A connection per check: they are handed to the three threads in turn, and the bucket
    // (3 a minute) is still one.
    let http = server.http;
    let statuses = tokio::task::spawn_blocking(move || {
        (0..12)
            .map(|_| post_json(http, "/v1/check", &check_body("ivan")).status)
            .collect::<Vec<_>>()
    })
    .await
    .unwrap();
    assert_eq!(
        statuses.iter().filter(|&&status| status == 200).count(),
        3,
        "{statuses:?}"
    );
    assert!(
        statuses
            .iter()
            .all(|&status| status == 200 || status == 429)
    );
    // Both of the other threads served some of them.
    let served = wake_ups(server.pid(), "tollgate-worker");
    for (thread, before) in &idle {
        assert!(
            served.get(thread).is_some_and(|after| after > before),
            "thread {thread} never woke: {idle:?} then {served:?}"
        );
    }
    let request = RateLimitRequest {
        domain: "api".to_owned(),
        descriptors: vec![descriptor(&[("user", "ivan")])],
        hits_addend: 1,
    };
    for _ in 0..3 {
        let response = should_rate_limit(&server, request.clone()).await.unwrap();
        assert_eq!(response.overall_code, Code::OverLimit as i32);
    }

    let status = server.terminate();
    assert!(status.success(), "exit {status:?}");
}

#[test]
fn limits_redis_cannot_hold_exactly_are_refused_at_start() {
    let scratch = Scratch::new("unsupported");
    let config = scratch.write(
        "policy.yaml",
        "limits:\n  - name: odd\n    domain: api\n    key: [user]\n    capacity: 3\n    refill: 9/7ns\n",
    );
    // Checked before connecting: no Redis is needed to be refused.
    let stderr = serve_refused(&[
        "--config",
        path_str(&config),
        "--store",
        "redis://127.0.0.1:1",
    ]);
    assert!(
        stderr.contains("limit odd cannot be kept in Redis"),
        "{stderr}"
    );
    assert!(stderr.contains("microseconds"), "{stderr}");
}

#[test]
fn the_schema_command_prints_the_policy_files_schema() {
    let (status, stdout, stderr) = run(&["schema"]);
    assert!(status.success(), "{stderr}");
    assert_eq!(stdout, tollgate_policy::JSON_SCHEMA);
    let schema: serde_json::Value = serde_json::from_str(&stdout).expect("JSON");
    assert_eq!(schema["$schema"], "http://json-schema.org/draft-07/schema#");
}

/// `tollgate diff`: the README's two example policies, in text and JSON, and a file that does
/// not compile refused with its error.
#[test]
fn the_diff_command_says_what_a_change_does_to_buckets() {
    let examples = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/examples");
    let old = examples.join("policy.yaml");
    let new = examples.join("policy-proposed.yaml");
    let (status, stdout, stderr) = run(&["diff", path_str(&old), path_str(&new)]);
    assert!(status.success(), "{stderr}");
    assert!(
        stdout.starts_with("version current -> proposed\n~ limit per-user (domain api)\n    capacity: 10 -> 40\n    buckets: carried over on a reload"),
        "{stdout}"
    );
    assert!(
        stdout.contains("~ limit writes-per-user (domain api)\n    mode: enforce -> shadow\n    stops rejecting\n    buckets: kept as they are\n"),
        "{stdout}"
    );
    let (status, stdout, _) = run(&["diff", path_str(&old), path_str(&new), "--json"]);
    assert!(status.success());
    let diff: serde_json::Value = serde_json::from_str(&stdout).expect("JSON");
    assert_eq!(diff["limits"][0]["buckets"], "carried_over");
    assert_eq!(diff["limits"][1]["enforcement"], "stops rejecting");
    let (status, stdout, _) = run(&["diff", path_str(&old), path_str(&old)]);
    assert!(status.success());
    assert!(stdout.contains("no limit or exemption differs"), "{stdout}");

    // --deny-afresh passes a change that keeps or carries every bucket over, and fails one
    // that starts some afresh.
    let (status, _, stderr) = run(&["diff", path_str(&old), path_str(&new), "--deny-afresh"]);
    assert!(status.success(), "{stderr}");
    let scratch = Scratch::new("diff");
    let text = std::fs::read_to_string(&old).expect("the example policy");
    let rekeyed = scratch.write(
        "rekeyed.yaml",
        &text.replacen("key: [user]", "key: [tenant]", 1),
    );
    let (status, stdout, stderr) =
        run(&["diff", path_str(&old), path_str(&rekeyed), "--deny-afresh"]);
    assert_eq!(status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("buckets: start afresh"), "{stdout}");
    assert!(
        stderr.contains("the buckets of per-user would start afresh"),
        "{stderr}"
    );

    let bad = scratch.write("bad.yaml", "limits:\n  - name: x\n    capacty: 5\n");
    let (status, _, stderr) = run(&["diff", path_str(&old), path_str(&bad)]);
    assert_eq!(status.code(), Some(1));
    assert!(
        stderr.contains("bad.yaml:3:") && stderr.contains("capacty"),
        "{stderr}"
    );
}

#[test]
fn validate_check_and_import_from_the_command_line() {
    let scratch = Scratch::new("cli");
    let good = scratch.write("good.yaml", POLICY);
    let (status, stdout, _) = run(&["validate", path_str(&good)]);
    assert!(status.success());
    assert!(
        stdout.contains("valid, version 1, 3 limits, 0 exemptions, 0 warnings"),
        "{stdout}"
    );
    // Valid, with parts that do nothing: warnings on stderr, and a failure only with --strict.
    let untidy = scratch.write(
        "untidy.yaml",
        "version: 2\nlimits:\n  - name: dark\n    domain: api\n    key: [user]\n    capacity: 5\n    refill: 1/s\n    rollout: 0%\nexemptions:\n  - limit: dark\n    when: {user: vip}\n    owner: ops@example.com\n    reason: launch\n    expires: 2020-01-01T00:00:00Z\n",
    );
    let (status, stdout, stderr) = run(&["validate", path_str(&untidy)]);
    assert!(status.success(), "{stderr}");
    assert!(stdout.contains("2 warnings"), "{stdout}");
    assert!(
        stderr.contains("warning: ") && stderr.contains("rollout 0%"),
        "{stderr}"
    );
    assert!(
        stderr.contains("expired at 2020-01-01T00:00:00Z"),
        "{stderr}"
    );
    let (status, _, stderr) = run(&["validate", "--strict", path_str(&untidy)]);
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("2 warnings with --strict"), "{stderr}");
    let (status, _, _) = run(&["validate", "--strict", path_str(&good)]);
    assert!(status.success());
    let bad = scratch.write("bad.yaml", "limits:\n  - name: x\n    capacty: 5\n");
    let (status, _, stderr) = run(&["validate", path_str(&bad)]);
    assert_eq!(status.code(), Some(1));
    assert!(
        stderr.contains("bad.yaml:3:") && stderr.contains("capacty"),
        "{stderr}"
    );

    let (status, stdout, _) = run(&[
        "check",
        "--config",
        path_str(&good),
        "--domain",
        "api",
        "--descriptor",
        "user=ivy",
        "--times",
        "4",
    ]);
    assert!(status.success());
    assert_eq!(stdout.matches(" allowed (policy").count(), 3, "{stdout}");
    assert!(stdout.contains("#4 rejected"), "{stdout}");

    let envoy = scratch.write(
        "envoy.yaml",
        "domain: edge\ndescriptors:\n  - key: remote_address\n    rate_limit:\n      unit: second\n      requests_per_unit: 10\n",
    );
    let (status, stdout, stderr) = run(&["import", "envoy", path_str(&envoy)]);
    assert!(status.success(), "{stderr}");
    let imported = scratch.write("imported.yaml", &stdout);
    let (status, _, stderr) = run(&["validate", path_str(&imported)]);
    assert!(status.success(), "the import validates: {stderr}");
    let (status, stdout, stderr) = run(&["import", "envoy", path_str(&envoy), "--fixed-windows"]);
    assert!(status.success(), "{stderr}");
    assert!(
        stdout.contains("algorithm: fixed_window\n    limit: 10\n    window: 1s\n"),
        "{stdout}"
    );

    // A configuration directory, as envoyproxy/ratelimit reads one: every .yaml and .yml file
    // in it (and nothing else), one domain each, into one policy.
    let dir = Scratch::new("envoy-config-dir");
    dir.write(
        "edge.yaml",
        "domain: edge\ndescriptors:\n  - key: remote_address\n    rate_limit:\n      unit: second\n      requests_per_unit: 10\n",
    );
    dir.write(
        "api.yml",
        "domain: api\ndescriptors:\n  - key: user\n    rate_limit:\n      unit: minute\n      requests_per_unit: 600\n",
    );
    dir.write("README.md", "not a configuration\n");
    let (status, stdout, stderr) = run(&["import", "envoy", path_str(&dir.0)]);
    assert!(status.success(), "{stderr}");
    assert!(
        stderr.contains("imported 2 limits from 2 files"),
        "{stderr}"
    );
    assert!(
        stdout.contains("domain: \"edge\"") && stdout.contains("domain: \"api\""),
        "{stdout}"
    );
    let imported = scratch.write("imported-dir.yaml", &stdout);
    let (status, _, stderr) = run(&["validate", path_str(&imported)]);
    assert!(status.success(), "the import validates: {stderr}");
    // Or as a policy directory of the same layout: a file per domain, named after its source,
    // that validates as one policy of the same limits and is never written over.
    let out = scratch.0.join("policy.d");
    let out_dir = path_str(&out);
    let (status, stdout, stderr) =
        run(&["import", "envoy", path_str(&dir.0), "--out-dir", out_dir]);
    assert!(status.success(), "{stderr}");
    assert!(stdout.is_empty(), "{stdout}");
    assert!(stderr.contains("wrote 2 files to "), "{stderr}");
    let api = std::fs::read_to_string(out.join("api.yml")).expect("api.yml");
    let edge = std::fs::read_to_string(out.join("edge.yaml")).expect("edge.yaml");
    assert!(
        api.contains("domain: \"api\"") && !api.contains("domain: \"edge\""),
        "{api}"
    );
    assert!(edge.contains("domain: \"edge\""), "{edge}");
    let (status, stdout, stderr) = run(&["validate", out_dir]);
    assert!(status.success(), "the directory validates: {stderr}");
    assert!(stdout.contains("2 files, 2 limits"), "{stdout}");
    let (status, stdout, _) = run(&["diff", path_str(&imported), out_dir]);
    assert!(status.success());
    assert!(
        stdout.contains("buckets: kept as they are") && !stdout.contains("- limit"),
        "a file or a directory, the same limits: {stdout}"
    );
    let (status, _, stderr) = run(&["import", "envoy", path_str(&dir.0), "--out-dir", out_dir]);
    assert_eq!(status.code(), Some(1));
    assert!(stderr.contains("already exists"), "{stderr}");
    assert_eq!(
        std::fs::read_to_string(out.join("edge.yaml")).ok(),
        Some(edge)
    );
    // Two files of one domain are refused, naming both.
    let again = dir.write(
        "edge-again.yaml",
        "domain: edge\ndescriptors:\n  - key: user\n    rate_limit:\n      unit: second\n      requests_per_unit: 1\n",
    );
    let (status, _, stderr) = run(&["import", "envoy", path_str(&dir.0)]);
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("edge-again.yaml") && stderr.contains("edge.yaml"),
        "{stderr}"
    );
    // ...unless merged, as envoyproxy/ratelimit's MERGE_DOMAIN_CONFIG does.
    let (status, stdout, stderr) = run(&["import", "envoy", "--merge-domains", path_str(&dir.0)]);
    assert!(status.success(), "{stderr}");
    assert!(
        stderr.contains("imported 3 limits from 3 files"),
        "{stderr}"
    );
    assert_eq!(stdout.matches("domain: \"edge\"").count(), 2, "{stdout}");
    std::fs::remove_file(again).expect("remove");
    let empty = Scratch::new("envoy-empty-dir");
    let (status, _, stderr) = run(&["import", "envoy", path_str(&empty.0)]);
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("holds no .yaml or .yml file"), "{stderr}");
}

#[test]
fn idempotent_retries_over_http() {
    let server = Server::start(&[]);
    let body = r#"{"domain":"api","descriptors":[{"user":"jo"}],"cost":4,"request_id":"r-1"}"#;
    let first = post_json(server.http, "/v1/check", body).json();
    let retry = post_json(server.http, "/v1/check", body).json();
    assert_eq!(first, retry);
    assert_eq!(first["limits"][0]["remaining"], 6);
    // Four of 5/s come back in 800 ms; nothing to wait for now.
    assert_eq!(first["limits"][0]["reset_after_ms"], 800);
    assert_eq!(first["limits"][0]["retry_after_ms"], 0);
    // The same id for another request is a conflict, and charges nothing either.
    let other = r#"{"domain":"api","descriptors":[{"user":"jo"}],"cost":2,"request_id":"r-1"}"#;
    let conflict = post_json(server.http, "/v1/check", other);
    assert_eq!(conflict.status, 409, "{}", conflict.body);
    assert_eq!(conflict.json()["error"]["code"], "idempotency_conflict");
    let next = post_json(server.http, "/v1/check", &check_body("jo")).json();
    assert_eq!(
        next["limits"][0]["remaining"], 5,
        "neither the retry nor the conflict was charged"
    );
}

#[test]
fn the_policy_endpoint_lists_the_limits_and_exemptions_in_force() {
    let scratch = Scratch::new("policy-listing");
    let config = scratch.write(
        "policy.yaml",
        r#"
version: "listed-1"
limits:
  - name: per-user
    domain: api
    key: [user]
    capacity: 20
    refill: 10/s
    failure_mode: open
    emergency: 2/s
    rollout: 12.5%
    replaces: [per-route]
    overrides:
      - name: premium
        when: {tier: premium}
        capacity: 200
        refill: 100/s
      - name: eu
        when: {region: !prefix eu-}
        capacity: 50
        refill: 5/s
      - name: staff
        when: {tier: staff}
        unlimited: true
  - name: per-route
    domain: api
    when: {method: POST}
    key: [route]
    algorithm: sliding_window
    limit: 100
    window: 1m
    mode: shadow
  - name: exports
    domain: api
    key: [tenant]
    algorithm: concurrency
    max_in_flight: 2
    lease_timeout: 30s
    failure_mode: open
    emergency: 1
exemptions:
  - limit: per-user
    when: {user: vip}
    owner: ops@example.com
    reason: launch
    expires: 2099-01-01T00:00:00Z
"#,
    );
    let server = Server::start(&["--config", path_str(&config)]);
    let body = request(server.http, "GET", "/v1/policy", &[], "").json();
    assert_eq!(body["version"], "listed-1");
    let limits = body["limits"].as_array().expect("limits");
    assert_eq!(limits.len(), 3);
    let user = &limits[0];
    assert_eq!(user["name"], "per-user");
    assert_eq!(user["algorithm"], "token_bucket");
    assert_eq!(user["capacity"], 20);
    assert_eq!(user["refill"], "10/s");
    assert_eq!(user["key"], serde_json::json!(["user"]));
    assert_eq!(user["rollout"], "12.5%");
    assert_eq!(user["scope"], "regional");
    assert_eq!(user["failure_mode"], "open");
    assert_eq!(user["emergency"], "2/s");
    assert_eq!(user["replaces"], serde_json::json!(["per-route"]));
    assert!(limits[1].get("replaces").is_none());
    assert_eq!(user["overrides"][0]["name"], "premium");
    assert_eq!(user["overrides"][0]["when"]["tier"], "premium");
    assert_eq!(user["overrides"][0]["capacity"], 200);
    assert_eq!(
        user["overrides"][1]["when"]["region"],
        serde_json::json!({"prefix": "eu-"})
    );
    // The prefix override applies to a value that starts with it, and only to such values.
    let capacity_for = |region: &str| {
        let body =
            format!(r#"{{"domain":"api","descriptors":[{{"user":"u9","region":"{region}"}}]}}"#);
        let answer = request(server.http, "POST", "/v1/check", &[], &body).json();
        answer["limits"][0]["capacity"].clone()
    };
    assert_eq!(capacity_for("eu-west-1"), 50);
    assert_eq!(capacity_for("us-east-1"), 20);
    // An unlimited override is listed as such, without parameters, and its requests are out
    // of the limit.
    let staff = &user["overrides"][2];
    assert_eq!(
        (&staff["name"], &staff["unlimited"], staff.get("capacity")),
        (&serde_json::json!("staff"), &serde_json::json!(true), None)
    );
    let check = r#"{"domain":"api","descriptors":[{"user":"u9","tier":"staff"}]}"#;
    let answer = request(server.http, "POST", "/v1/check", &[], check).json();
    assert_eq!(answer["limits"], serde_json::json!([]), "{answer}");
    let route = &limits[1];
    assert_eq!(route["algorithm"], "sliding_window");
    assert_eq!(route["limit"], 100);
    assert_eq!(route["window"], "1m");
    assert_eq!(route["mode"], "shadow");
    assert_eq!(route["when"]["method"], "POST");
    assert_eq!(route["failure_mode"], "closed");
    let exports = &limits[2];
    assert_eq!(exports["max_in_flight"], 2);
    assert_eq!(exports["lease_timeout"], "30s");
    // An emergency of leases is a number in flight, not a rate.
    assert_eq!(exports["failure_mode"], "open");
    assert_eq!(exports["emergency"], 1);
    let exemption = &body["exemptions"][0];
    assert_eq!(exemption["limit"], "per-user");
    assert_eq!(exemption["when"]["user"], "vip");
    assert_eq!(exemption["active"], true);
    assert_eq!(exemption["expires"], "2099-01-01T00:00:00Z");
    assert_eq!(exemption["uses"], 0);
    let check = r#"{"domain":"api","descriptors":[{"user":"vip"}]}"#;
    assert_eq!(post_json(server.http, "/v1/check", check).status, 200);
    let body = request(server.http, "GET", "/v1/policy", &[], "").json();
    assert_eq!(body["exemptions"][0]["uses"], 1);
}

#[test]
fn without_a_config_the_banner_shows_the_demo_policy_an_example_and_the_dashboard() {
    let server = Server::start(&[]);
    let banner = &server.banner;
    assert!(banner.contains("version: demo-1"), "{banner}");
    assert!(
        banner.contains(&format!("curl -si -X POST http://{}/v1/check", server.http)),
        "{banner}"
    );
    let dashboard = format!("http://{}/dashboard", server.http);
    assert!(banner.contains(&dashboard), "{banner}");
    assert_eq!(
        request(server.http, "GET", "/dashboard", &[], "").status,
        200
    );
}

/// A block list: a deny limit and a deny override reject over HTTP, forward-auth, RLS and
/// leases as a quota of nothing (no wait offered, nothing charged or held elsewhere), and
/// `/v1/policy` lists them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deny_rejects_over_every_interface_without_a_wait() {
    let scratch = Scratch::new("deny");
    let config = scratch.write(
        "policy.yaml",
        r#"
version: "blocks-1"
limits:
  - name: per-user
    domain: api
    key: [user]
    capacity: 5
    refill: 1/s
    overrides:
      - {name: banned, when: {tier: banned}, deny: true}
  - name: blocked-ips
    domain: api
    when: {ip: [203.0.113.7, 203.0.113.8, !prefix 192.0.2., !cidr 2001:db8::/32]}
    key: [ip]
    deny: true
  - name: exports
    domain: api
    key: [user]
    algorithm: concurrency
    max_in_flight: 1
    lease_timeout: 30s
    overrides:
      - {name: banned, when: {tier: banned}, deny: true}
"#,
    );
    let server = Server::start(&["--config", path_str(&config)]);
    let blocked = r#"{"domain":"api","descriptors":[{"user":"u1","ip":"203.0.113.7"}]}"#;
    for _ in 0..3 {
        let answer = post_json(server.http, "/v1/check", blocked);
        assert_eq!(answer.status, 429, "{}", answer.body);
        assert_eq!(answer.header("retry-after"), None, "no wait lifts a deny");
        assert_eq!(
            answer.header("ratelimit-policy"),
            Some(r#""per-user";q=5;w=5, "blocked-ips";q=0"#)
        );
        assert_eq!(
            answer.header("ratelimit"),
            Some(r#""per-user";r=4;t=1, "blocked-ips";r=0"#)
        );
        let body = answer.json();
        let deny = &body["limits"][1];
        assert_eq!(
            (
                &deny["name"],
                &deny["denied"],
                &deny["capacity"],
                &deny["remaining"]
            ),
            (
                &serde_json::json!("blocked-ips"),
                &serde_json::json!(true),
                &serde_json::json!(0),
                &serde_json::json!(0)
            ),
            "{body}"
        );
        assert!(deny.get("retry_after_ms").is_none(), "{body}");
    }
    // Counted apart from quotas run dry.
    let series = r#"tollgate_decisions_total{limit="blocked-ips",result="denied",mode="enforce",api="http"}"#;
    assert_eq!(support::metric(&server, series), 3.0);
    // The rejected requests took nothing from u1's own bucket.
    let elsewhere = r#"{"domain":"api","descriptors":[{"user":"u1","ip":"198.51.100.1"}]}"#;
    let answer = post_json(server.http, "/v1/check", elsewhere);
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.json()["limits"][0]["remaining"], 4);

    // The deny override of per-user, through forward-auth.
    let banned = [("x-tollgate-user", "u2"), ("x-tollgate-tier", "banned")];
    let answer = request(server.http, "GET", "/v1/forward-auth/api", &banned, "");
    assert_eq!(answer.status, 429, "{}", answer.body);
    assert_eq!(answer.header("ratelimit"), Some(r#""per-user";r=0"#));
    assert_eq!(answer.header("retry-after"), None);

    // Over RLS: Envoy's own deny-all, 0 requests a second, with no reset to wait for.
    let request_for = |entries: &[(&str, &str)]| RateLimitRequest {
        domain: "api".to_owned(),
        descriptors: vec![descriptor(entries)],
        hits_addend: 1,
    };
    let response = should_rate_limit(&server, request_for(&[("ip", "203.0.113.7")]))
        .await
        .unwrap();
    assert_eq!(response.overall_code, Code::OverLimit as i32);
    let status = &response.statuses[0];
    let limit = status.current_limit.clone().unwrap_or_default();
    assert_eq!(
        (
            limit.name.as_str(),
            limit.requests_per_unit,
            status.limit_remaining
        ),
        ("blocked-ips", 0, 0)
    );
    assert_eq!(status.duration_until_reset, None);
    let response = should_rate_limit(&server, request_for(&[("ip", "203.0.113.8")]))
        .await
        .unwrap();
    assert_eq!(
        response.overall_code,
        Code::OverLimit as i32,
        "the list's other value"
    );
    let response = should_rate_limit(&server, request_for(&[("ip", "192.0.2.55")]))
        .await
        .unwrap();
    assert_eq!(
        response.overall_code,
        Code::OverLimit as i32,
        "the list's prefix"
    );
    for (ip, code) in [("2001:db8::5", Code::OverLimit), ("2001:db9::5", Code::Ok)] {
        let response = should_rate_limit(&server, request_for(&[("ip", ip)]))
            .await
            .unwrap();
        assert_eq!(
            response.overall_code, code as i32,
            "the list's network: {ip}"
        );
    }
    let response = should_rate_limit(&server, request_for(&[("ip", "198.51.100.1")]))
        .await
        .unwrap();
    assert_eq!(response.overall_code, Code::Ok as i32, "no limit applies");

    // A blocked client takes no lease either, and the banned tier of exports none at all;
    // nothing is held for them, so u1's one slot is free afterwards.
    let lease_body = |entries: &str| format!(r#"{{"domain":"api","descriptors":[{entries}]}}"#);
    for entries in [
        r#"{"user":"u1","ip":"203.0.113.8"}"#,
        r#"{"user":"u1","tier":"banned"}"#,
    ] {
        let answer = post_json(server.http, "/v1/leases", &lease_body(entries));
        assert_eq!(answer.status, 429, "{}", answer.body);
        assert_eq!(
            answer.header("retry-after"),
            None,
            "no release lifts a deny"
        );
        let body = answer.json();
        assert_eq!(body["lease_id"], serde_json::Value::Null, "{body}");
        let denied = body["limits"]
            .as_array()
            .and_then(|limits| limits.iter().find(|l| l["denied"] == true))
            .unwrap_or_else(|| panic!("{body}"));
        assert_eq!(
            (&denied["capacity"], &denied["allowed"]),
            (&serde_json::json!(0), &serde_json::json!(false))
        );
        assert!(denied.get("retry_after_ms").is_none(), "{body}");
    }
    let answer = post_json(server.http, "/v1/leases", &lease_body(r#"{"user":"u1"}"#));
    assert_eq!(answer.status, 200, "{}", answer.body);
    for series in [
        r#"tollgate_decisions_total{limit="blocked-ips",result="denied",mode="enforce",api="leases"}"#,
        r#"tollgate_decisions_total{limit="exports",result="denied",mode="enforce",api="leases"}"#,
    ] {
        assert_eq!(support::metric(&server, series), 1.0, "{series}");
    }

    // Listed as written: no parameters, no failure mode.
    let body = request(server.http, "GET", "/v1/policy", &[], "").json();
    let limits = &body["limits"];
    assert_eq!(limits[0]["overrides"][0]["deny"], true, "{body}");
    assert!(limits[0]["overrides"][0].get("capacity").is_none());
    let ips = &limits[1];
    assert_eq!(
        (&ips["deny"], &ips["algorithm"]),
        (&serde_json::json!(true), &serde_json::json!("deny"))
    );
    assert!(
        ips.get("capacity").is_none()
            && ips.get("failure_mode").is_none()
            && ips.get("replaces").is_none(),
        "{ips}"
    );
    assert_eq!(
        ips["when"]["ip"],
        serde_json::json!([
            "203.0.113.7",
            "203.0.113.8",
            {"prefix": "192.0.2."},
            {"cidr": "2001:db8::/32"}
        ])
    );
    tokio::task::spawn_blocking(move || server.terminate())
        .await
        .expect("terminate");
}

/// `POST /v1/reset`: an operator lets a drained user in again, behind the admin token; the
/// buckets reset are listed, counted and audited; bad requests change nothing.
#[test]
fn an_operator_resets_a_drained_users_buckets() {
    let scratch = Scratch::new("reset");
    let audit = scratch.0.join("audit.jsonl");
    let server = Server::start(&["--admin-token", "s3cret", "--audit-log", path_str(&audit)]);
    let auth = [("Authorization", "Bearer s3cret")];
    let drain = |user: &str| {
        (0..20)
            .map(|_| post_json(server.http, "/v1/check", &check_body(user)).status)
            .any(|status| status == 429)
    };
    assert!(drain("rita"));
    assert!(drain("sam"));
    let body = r#"{"domain":"api","descriptors":[{"user":"rita"}],"limits":["per-user"]}"#;
    assert_eq!(
        request(server.http, "POST", "/v1/reset", &[], body).status,
        401
    );

    // Bad requests are refused and reset nothing.
    for (bad, code) in [
        (
            r#"{"domain":"api","descriptors":[{"user":"rita"}],"limits":["nope"]}"#,
            "unknown_limit",
        ),
        (
            r#"{"domain":"api","descriptors":[{"user":"rita"}],"cost":1}"#,
            "invalid_json",
        ),
        (
            r#"{"domain":"api","descriptors":[{"user":1}]}"#,
            "invalid_descriptor",
        ),
        (r#"{"domain":"api""#, "invalid_json"),
        (
            r#"{"domain":"","descriptors":[{"user":"rita"}]}"#,
            "invalid_domain",
        ),
    ] {
        let answer = request(server.http, "POST", "/v1/reset", &auth, bad);
        assert_eq!(answer.status, 400, "{bad}: {}", answer.body);
        assert_eq!(answer.json()["error"]["code"], code, "{bad}");
    }
    assert_eq!(
        post_json(server.http, "/v1/check", &check_body("rita")).status,
        429
    );

    let answer = request(server.http, "POST", "/v1/reset", &auth, body);
    assert_eq!(answer.status, 200, "{}", answer.body);
    let reset = answer.json();
    assert_eq!(reset["policy_version"], "demo-1");
    assert_eq!(
        reset["reset"],
        serde_json::json!([{"name": "per-user", "bucket_key": "per-user|rita", "descriptor": 0}])
    );
    assert_eq!(reset["skipped"], serde_json::json!([]));
    // Rita is in again, with a full bucket; Sam is not.
    let again = post_json(server.http, "/v1/check", &check_body("rita"));
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(again.json()["limits"][0]["remaining"], 9);
    assert_eq!(
        post_json(server.http, "/v1/check", &check_body("sam")).status,
        429
    );

    let series = r#"tollgate_resets_total{limit="per-user"}"#;
    assert_eq!(
        request(server.http, "GET", "/metrics", &auth, "")
            .body
            .lines()
            .find(|line| line.starts_with(series))
            .and_then(|line| line.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok()),
        Some(1.0)
    );
    let audited = std::fs::read_to_string(&audit).unwrap_or_default();
    let resets: Vec<serde_json::Value> = audited
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|event| event["event"] == "reset")
        .collect();
    assert_eq!(resets.len(), 1, "{audited}");
    assert_eq!(resets[0]["bucket_key"], "per-user|rita");

    // At most 64 limits may be named (the same one again counts again).
    let naming = |n: usize| {
        let names = vec!["per-user"; n];
        let body = serde_json::json!({"domain": "api", "descriptors": [{"user": "sam"}],
            "limits": names});
        request(server.http, "POST", "/v1/reset", &auth, &body.to_string())
    };
    let answer = naming(65);
    assert_eq!(answer.status, 400, "{}", answer.body);
    assert_eq!(answer.json()["error"]["code"], "too_large");
    assert_eq!(
        post_json(server.http, "/v1/check", &check_body("sam")).status,
        429
    );
    let answer = naming(64);
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.json()["reset"][0]["bucket_key"], "per-user|sam");
    assert_eq!(
        post_json(server.http, "/v1/check", &check_body("sam")).status,
        200
    );
}

/// A server on `limits` (a policy's `limits:` list) with the forward-auth `flags`, and its
/// scratch directory, which must outlive it.
fn forward_auth_server(name: &str, limits: &str, flags: &[&str]) -> (Server, Scratch) {
    let scratch = Scratch::new(name);
    let config = scratch.write("policy.yaml", &format!("limits:\n{limits}"));
    let mut args = vec!["--config", path_str(&config)];
    args.extend_from_slice(flags);
    (Server::start(&args), scratch)
}

/// The status forward-auth answers on domain `edge` for a request with `headers`.
fn forward_auth_status(server: &Server, headers: &[(&str, &str)]) -> u16 {
    request(server.http, "GET", "/v1/forward-auth/edge", headers, "").status
}

/// Forward-auth with `--forward-auth-address`: a block list of networks applies to the client
/// address the trusted proxies recorded, whatever the client claims.
#[test]
fn forward_auth_blocks_networks_by_the_address_the_proxies_recorded() {
    let limits = r#"
  - name: blocked
    domain: edge
    when: {remote_address: [!cidr 203.0.113.0/24, !cidr 2001:db8::/32]}
    deny: true
"#;
    let flags = ["--forward-auth-address", "X-Forwarded-For:1"];
    let (server, _scratch) = forward_auth_server("fa-address", limits, &flags);
    let ask = |chain: &str, claim: Option<&str>| {
        let mut headers = vec![("X-Forwarded-For", chain)];
        if let Some(claim) = claim {
            headers.push(("x-tollgate-remote_address", claim));
        }
        forward_auth_status(&server, &headers)
    };
    // The client, then the load balancer in front (trusted), as the proxy calling tollgate
    // forwards them.
    assert_eq!(ask("203.0.113.5, 10.0.0.1", None), 429);
    assert_eq!(ask("2001:db8::7, 10.0.0.1", None), 429);
    assert_eq!(ask("198.51.100.1, 10.0.0.1", None), 200);
    // What the client writes itself changes nothing.
    assert_eq!(ask("198.51.100.1, 10.0.0.1", Some("203.0.113.5")), 200);
    assert_eq!(ask("203.0.113.5, 198.51.100.1, 10.0.0.1", None), 200);
    support::assert_serve_flags_refused(&[
        (
            "--forward-auth-address",
            "X-Forwarded-For:x",
            "HEADER:TRUSTED",
        ),
        ("--forward-auth-address", "bad header:1", "HEADER:TRUSTED"),
        ("--forward-auth-address", "X-Forwarded-For:99", "at most 16"),
    ]);
}

/// `--forward-auth-trusted-proxies`: the client is the first address from the right that no
/// trusted proxy's network holds, however many proxies a request crossed.
#[test]
fn forward_auth_passes_over_trusted_proxy_networks() {
    let limits = r#"
  - name: blocked
    domain: edge
    when: {remote_address: !cidr 203.0.113.0/24}
    deny: true
"#;
    let flags = [
        "--forward-auth-address",
        "X-Forwarded-For",
        "--forward-auth-trusted-proxies",
        "10.0.0.0/8,192.0.2.0/24",
    ];
    let (server, _scratch) = forward_auth_server("fa-proxies", limits, &flags);
    let ask = |chain: &str| forward_auth_status(&server, &[("X-Forwarded-For", chain)]);
    // Straight to the proxy calling tollgate, through a load balancer, through a CDN too.
    assert_eq!(ask("203.0.113.5"), 429);
    assert_eq!(ask("203.0.113.5, 10.0.0.1"), 429);
    assert_eq!(ask("203.0.113.5, 192.0.2.9, 10.0.0.1"), 429);
    assert_eq!(ask("198.51.100.1, 192.0.2.9, 10.0.0.1"), 200);
    // Left of the first address no proxy holds is the client's own writing: not read.
    assert_eq!(ask("203.0.113.5, 198.51.100.1, 10.0.0.1"), 200);
    support::assert_serve_flags_refused(&[
        (
            "--forward-auth-trusted-proxies",
            "10.1.2.3/8",
            "the network is 10.0.0.0/8",
        ),
        ("--forward-auth-trusted-proxies", "lan", "not a network"),
        // Networks to pass over mean nothing without a header to walk.
        (
            "--forward-auth-trusted-proxies",
            "10.0.0.0/8",
            "not provided:\n  --forward-auth-address <",
        ),
    ]);
}

/// `--forward-auth-address-mask`: a limit keyed by `masked_remote_address` holds one bucket
/// per client network, IPv4 and IPv6 alike.
#[test]
fn forward_auth_keys_by_the_clients_network() {
    let limits = r#"
  - name: per-network
    domain: edge
    key: [masked_remote_address]
    capacity: 2
    refill: 1/h
"#;
    let flags = [
        "--forward-auth-address",
        "X-Real-IP",
        "--forward-auth-address-mask",
        "24,64",
    ];
    let (server, _scratch) = forward_auth_server("fa-mask", limits, &flags);
    let ask = |address: &str| forward_auth_status(&server, &[("X-Real-IP", address)]);
    // Three addresses of one /24 share two tokens; the next /24 has its own.
    assert_eq!(ask("198.51.100.1"), 200);
    assert_eq!(ask("198.51.100.2"), 200);
    assert_eq!(ask("198.51.100.3"), 429);
    assert_eq!(ask("198.51.101.1"), 200);
    // A client rotating through its /64 is one subject.
    assert_eq!(ask("2001:db8:0:1::1"), 200);
    assert_eq!(ask("2001:db8:0:1:ffff::2"), 200);
    assert_eq!(ask("2001:db8:0:1:abcd:ef::3"), 429);
    assert_eq!(ask("2001:db8:0:2::1"), 200);
    support::assert_serve_flags_refused(&[
        ("--forward-auth-address-mask", "24", "V4LEN,V6LEN"),
        ("--forward-auth-address-mask", "33,64", "at most 32 and 128"),
        (
            "--forward-auth-address-mask",
            "24,64",
            "not provided:\n  --forward-auth-address <",
        ),
    ]);
}

/// A policy directory, one file per team: validated and diffed as a whole, served as one
/// version that says whose each limit is, and reloaded when a team's file changes; a bad file
/// is refused by name and leaves every team's limits in force.
#[test]
fn a_policy_directory_is_one_policy_with_a_file_per_team() {
    let scratch = Scratch::new("policy-dir");
    let dir = scratch.0.join("policy.d");
    std::fs::create_dir(&dir).expect("the policy directory");
    let limit = |name: &str, capacity: u32| {
        format!(
            "  - {{name: {name}, domain: api, when: {{team: {name}}}, key: [user], capacity: {capacity}, refill: 1/h}}\n"
        )
    };
    let write = |file: &str, text: &str| std::fs::write(dir.join(file), text).expect("write");
    write("payments.yaml", &format!("limits:\n{}", limit("pay", 2)));
    write(
        "search.yaml",
        &format!(
            "defaults: {{mode: shadow}}\nlimits:\n{}",
            limit("search", 1)
        ),
    );
    write("README.md", "Each team owns one file.\n");

    let (status, stdout, stderr) = run(&["validate", path_str(&dir)]);
    assert!(status.success(), "{stderr}");
    assert!(
        stdout.contains(": valid, version sha-") && stdout.contains(", 2 files, 2 limits, "),
        "{stdout}"
    );

    // Decided locally as the server would: the payments team's limit, from its own file.
    let (status, stdout, stderr) = run(&[
        "check",
        "--config",
        path_str(&dir),
        "--domain",
        "api",
        "--descriptor",
        "team=pay,user=u1",
        "--times",
        "3",
    ]);
    assert!(status.success(), "{stderr}");
    assert_eq!(
        stdout.matches(" allowed (policy sha-").count(),
        2,
        "{stdout}"
    );
    assert!(stdout.contains("#3 rejected"), "{stdout}");

    let server = Server::start(&["--config", path_str(&dir), "--admin-token", "s3cret"]);
    let auth = [("Authorization", "Bearer s3cret")];
    let policy = || request(server.http, "GET", "/v1/policy", &auth, "").json();
    let view = policy();
    assert_eq!(
        view["files"],
        serde_json::json!(["payments.yaml", "search.yaml"])
    );
    assert_eq!(view["source"], path_str(&dir));
    let owners: Vec<(String, String, String)> = view["limits"]
        .as_array()
        .expect("limits")
        .iter()
        .map(|l| {
            let text = |f: &str| l[f].as_str().unwrap_or_default().to_owned();
            (text("name"), text("file"), text("mode"))
        })
        .collect();
    let owned =
        |name: &str, file: &str, mode: &str| (name.to_owned(), file.to_owned(), mode.to_owned());
    assert_eq!(
        owners,
        [
            owned("pay", "payments.yaml", "enforce"),
            owned("search", "search.yaml", "shadow")
        ],
        "each file's defaults are its own"
    );
    let check = |team: &str| {
        let body = format!(r#"{{"domain":"api","descriptors":[{{"team":"{team}","user":"u1"}}]}}"#);
        post_json(server.http, "/v1/check", &body).status
    };
    assert_eq!([check("pay"), check("pay"), check("pay")], [200, 200, 429]);

    // A new team's file is seen by the watcher and goes in force.
    write(
        "checkout.yaml",
        &format!("limits:\n{}", limit("checkout", 1)),
    );
    let files = wait_for("the reload of the new file", || {
        let files = policy()["files"].clone();
        (files.as_array().map(Vec::len) == Some(3)).then_some(files)
    });
    assert_eq!(
        files,
        serde_json::json!(["checkout.yaml", "payments.yaml", "search.yaml"])
    );
    assert_eq!([check("checkout"), check("checkout")], [200, 429]);
    assert_eq!(check("pay"), 429, "the other teams' buckets are kept");

    // One team's mistake is refused by file and line; everyone's limits stay in force.
    write("search.yaml", &format!("limits:\n{}", limit("pay", 5)));
    let answer = request(server.http, "POST", "/v1/policy/reload", &auth, "");
    assert_eq!(answer.status, 422, "{}", answer.body);
    let message = answer.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let search_file = dir.join("search.yaml");
    assert!(
        message.contains(&format!("{}:2:", search_file.display()))
            && message.contains("duplicate limit name \"pay\""),
        "{message}"
    );
    assert_eq!(policy()["files"].as_array().map(Vec::len), Some(3));
    assert_eq!(check("pay"), 429);
    let (status, _, stderr) = run(&["validate", path_str(&dir)]);
    assert_eq!(status.code(), Some(1));
    assert!(stderr.contains("search.yaml:2:"), "{stderr}");

    // The diff of two directories says a limit moved between files, and keeps its buckets.
    let moved = scratch.0.join("moved.d");
    std::fs::create_dir(&moved).expect("a second directory");
    std::fs::write(
        moved.join("shared.yaml"),
        format!("limits:\n{}{}", limit("pay", 2), limit("checkout", 1)),
    )
    .expect("write");
    write("search.yaml", &format!("limits:\n{}", limit("search", 1)));
    let (status, stdout, stderr) = run(&["diff", path_str(&dir), path_str(&moved)]);
    assert!(status.success(), "{stderr}");
    assert!(
        stdout.contains(
            "\n+ file shared.yaml\n- file checkout.yaml\n- file payments.yaml\n- file search.yaml\n"
        ),
        "the files, whose change it is: {stdout}"
    );
    assert!(
        stdout.contains("~ limit pay (domain api)\n    file: payments.yaml -> shared.yaml\n    buckets: kept as they are\n"),
        "{stdout}"
    );
    assert!(stdout.contains("- limit search (domain api)"), "{stdout}");
}

/// `validate --format github` annotates the file and line of a pull request, and in a policy
/// directory each warning lands on the file of the team it concerns; `--format json` gives the
/// same as one document. The exit status is the text format's.
#[test]
fn validate_reports_for_ci_systems() {
    let scratch = Scratch::new("validate-formats");
    let dir = scratch.0.join("policy.d");
    std::fs::create_dir(&dir).expect("the policy directory");
    let write = |file: &str, text: &str| std::fs::write(dir.join(file), text).expect("write");
    write(
        "payments.yaml",
        "limits:\n  - {name: pay, domain: api, key: [user], capacity: 5, refill: 1/s}\n",
    );
    write(
        "trial.yaml",
        "limits:\n  - {name: trial, domain: api, key: [user], capacity: 5, refill: 1/s, rollout: 0%}\n",
    );
    let trial = dir.join("trial.yaml").display().to_string();

    let (status, stdout, stderr) = run(&["validate", "--format", "github", path_str(&dir)]);
    assert!(status.success(), "{stderr}");
    let mut lines = stdout.lines();
    let warning = lines.next().unwrap_or_default();
    assert!(
        warning.starts_with(&format!(
            "::warning file={trial},title=tollgate validate::limit \"trial\" has rollout 0%25"
        )),
        "{stdout}"
    );
    assert!(
        lines
            .next()
            .unwrap_or_default()
            .contains(": valid, version sha-"),
        "{stdout}"
    );
    let (status, _, _) = run(&["validate", "--format", "github", "--strict", path_str(&dir)]);
    assert_eq!(status.code(), Some(1));

    let (status, stdout, stderr) = run(&["validate", "--format", "json", path_str(&dir)]);
    assert!(status.success(), "{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("one JSON document");
    assert_eq!(report["valid"], true);
    assert_eq!(
        report["files"],
        serde_json::json!(["payments.yaml", "trial.yaml"])
    );
    assert_eq!(
        (&report["limits"], &report["exemptions"]),
        (&2.into(), &0.into())
    );
    assert_eq!(report["warnings"][0]["file"], trial.as_str());
    assert_eq!(report["error"], serde_json::Value::Null);

    // A refused directory: the error on its file, line and column.
    write(
        "trial.yaml",
        "limits:\n  - {name: trial, domain: api, capacity: 5, refill: 1/s}\n  - {name: pay, domain: api, capacity: 5, refill: 1/s}\n",
    );
    let (status, stdout, stderr) = run(&["validate", "--format", "github", path_str(&dir)]);
    assert_eq!(status.code(), Some(1), "{stdout}");
    assert!(
        stdout.starts_with(&format!(
            "::error file={trial},line=3,col=12,title=tollgate validate::limits[1].name: duplicate limit name \"pay\" (also in "
        )),
        "{stdout}"
    );
    assert!(stderr.contains("error: "), "{stderr}");
    let (status, stdout, _) = run(&["validate", "--format", "json", path_str(&dir)]);
    assert_eq!(status.code(), Some(1));
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("one JSON document");
    assert_eq!(report["valid"], false);
    let error = &report["error"];
    assert_eq!(
        (&error["file"], &error["line"], &error["path"]),
        (&trial.as_str().into(), &3.into(), &"limits[1].name".into())
    );
}

/// The incident switch: started with `--shadow-all`, the server rejects nothing and says so
/// (the status, the metric, each limit's mode); turned off through the API, the same buckets
/// reject again; turned on again through the API, checks and RLS calls pass as shadow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_all_stops_rejections_until_turned_off() {
    let scratch = Scratch::new("shadow-all");
    let config = scratch.write("policy.yaml", POLICY);
    let server = Server::start(&[
        "--config",
        path_str(&config),
        "--admin-token",
        "s3cret",
        "--shadow-all",
        "first rollout",
    ]);
    let auth = [("Authorization", "Bearer s3cret")];
    let auth_json = [
        ("Authorization", "Bearer s3cret"),
        ("Content-Type", "application/json"),
    ];
    let status = request(server.http, "GET", "/v1/policy", &auth, "").json();
    assert_eq!(status["shadow_all"]["reason"], "first rollout", "{status}");
    assert_eq!(metric(&server, "tollgate_shadow_all"), 1.0);
    for _ in 0..4 {
        let answer = post_json(server.http, "/v1/check", &check_body("ivy"));
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
    let last = post_json(server.http, "/v1/check", &check_body("ivy")).json();
    assert_eq!(last["limits"][0]["mode"], "shadow", "{last}");
    assert_eq!(
        last["limits"][0]["allowed"], false,
        "what would be rejected is seen"
    );

    let shadow = "/v1/policy/shadow-all";
    assert_eq!(
        request(server.http, "POST", shadow, &[], r#"{"on":false}"#).status,
        401
    );
    let off = request(server.http, "POST", shadow, &auth_json, r#"{"on":false}"#);
    assert_eq!(off.status, 200, "{}", off.body);
    assert_eq!(off.json()["shadow_all"], serde_json::Value::Null);
    assert_eq!(metric(&server, "tollgate_shadow_all"), 0.0);
    assert_eq!(
        post_json(server.http, "/v1/check", &check_body("ivy")).status,
        429
    );

    for bad in [
        r#"{"on":true}"#,
        r#"{"on":true,"reason":""}"#,
        r#"{"on":false,"reason":"done"}"#,
        r#"{"on":1}"#,
        r#"{"on":true,"reason":"INC-41","limits":[]}"#,
        r#"{"on":true,"reason":"INC-41","limits":"per-user"}"#,
        r#"{"on":false,"domains":["api"]}"#,
        r#"{"on":true,"reason":"INC-41","scope":"api"}"#,
    ] {
        let answer = request(server.http, "POST", shadow, &auth_json, bad);
        assert_eq!(answer.status, 400, "{bad}: {}", answer.body);
    }
    // At most 64 names in a list, counted as sent.
    let names = |n: usize| vec!["\"per-user\""; n].join(",");
    let too_many = format!(
        r#"{{"on":true,"reason":"INC-41","limits":[{}]}}"#,
        names(65)
    );
    let answer = request(server.http, "POST", shadow, &auth_json, &too_many);
    assert_eq!(answer.status, 400, "{}", answer.body);
    let most = format!(
        r#"{{"on":true,"reason":"INC-41","limits":[{}]}}"#,
        names(64)
    );
    let answer = request(server.http, "POST", shadow, &auth_json, &most);
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(
        answer.json()["shadow_all"]["limits"],
        serde_json::json!(["per-user"])
    );
    let off = request(server.http, "POST", shadow, &auth_json, r#"{"on":false}"#);
    assert_eq!(off.status, 200, "{}", off.body);
    // A misspelt name would leave the rejections the switch was meant to stop.
    let misspelt = r#"{"on":true,"reason":"INC-41","domains":["api"],"limits":["per-usr"]}"#;
    let answer = request(server.http, "POST", shadow, &auth_json, misspelt);
    assert_eq!(answer.status, 400, "{}", answer.body);
    assert_eq!(answer.json()["error"]["code"], "invalid_scope");
    assert!(
        answer.body.contains("has no limit per-usr"),
        "{}",
        answer.body
    );
    assert_eq!(
        metric(&server, "tollgate_shadow_all"),
        0.0,
        "nothing changed"
    );

    // Narrowed to a limit that is not the one rejecting: ivy is still rejected.
    let narrow = r#"{"on":true,"reason":"INC-41","limits":["per-tenant"]}"#;
    let answer = request(server.http, "POST", shadow, &auth_json, narrow);
    assert_eq!(answer.status, 200, "{}", answer.body);
    let switch = &answer.json()["shadow_all"];
    assert_eq!(
        switch["limits"],
        serde_json::json!(["per-tenant"]),
        "{switch}"
    );
    assert_eq!(switch.get("domains"), None, "{switch}");
    assert_eq!(metric(&server, "tollgate_shadow_all"), 1.0);
    assert_eq!(
        post_json(server.http, "/v1/check", &check_body("ivy")).status,
        429
    );
    // Narrowed to the domain: ivy passes, as shadow.
    let domain = r#"{"on":true,"reason":"INC-41","domains":["api"]}"#;
    let answer = request(server.http, "POST", shadow, &auth_json, domain);
    assert_eq!(answer.status, 200, "{}", answer.body);
    let passed = post_json(server.http, "/v1/check", &check_body("ivy"));
    assert_eq!(passed.status, 200, "{}", passed.body);
    assert_eq!(passed.json()["limits"][0]["mode"], "shadow");

    // Widened to every limit: a new switch, with its own reason.
    let on = r#"{"on":true,"reason":"INC-42: false rejections"}"#;
    let answer = request(server.http, "POST", shadow, &auth_json, on);
    assert_eq!(answer.status, 200, "{}", answer.body);
    let switch = &answer.json()["shadow_all"];
    assert_eq!(switch["reason"], "INC-42: false rejections", "{switch}");
    assert_eq!(switch.get("domains"), None, "{switch}");
    assert_eq!(
        post_json(server.http, "/v1/check", &check_body("ivy")).status,
        200
    );
    // RLS as Envoy calls it: OK, whatever the bucket says.
    let request = RateLimitRequest {
        domain: "api".to_owned(),
        descriptors: vec![descriptor(&[("user", "ivy")])],
        hits_addend: 1,
    };
    let reply = should_rate_limit(&server, request)
        .await
        .expect("an answer");
    assert_eq!(reply.overall_code, Code::Ok as i32);
    assert_eq!(metric(&server, "tollgate_shadow_all"), 1.0);

    assert_serve_flags_refused(&[("--shadow-all", " ", "give a reason")]);
}
