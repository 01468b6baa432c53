//! `GET /dashboard` on the real binary: the page is served with its guards, and everything it
//! reads exists under the names it reads them by, so renaming a metric or an endpoint breaks
//! this test rather than the page.

mod support;

use support::{Server, post_json, request};

/// What the page's script reads, by name: endpoints, and metric series in `/metrics`.
const ENDPOINTS: [&str; 4] = ["/metrics", "/readyz", "/v1/policy", "/v1/hot-keys"];
/// The first six are on every server once its decisions have run a limit near its end (the
/// test's do); the others appear once what they count happens (a store error, a rejection
/// answered from memory on Redis, a settlement).
const SERIES: [&str; 9] = [
    "tollgate_decisions_total",
    "tollgate_near_limit_decisions_total",
    "tollgate_decision_duration_seconds_bucket",
    "tollgate_unmatched_requests_total",
    "tollgate_live_buckets",
    "tollgate_live_leases",
    "tollgate_store_errors_total",
    "tollgate_remembered_rejections_total",
    "tollgate_settlements_total",
];

#[test]
fn the_page_is_served_and_what_it_reads_is_there() {
    let server = Server::start(&["--hot-keys", "5"]);
    let page = request(server.http, "GET", "/dashboard", &[], "");
    assert_eq!(page.status, 200, "{}", page.body);
    assert_eq!(
        page.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    assert_eq!(page.header("cache-control"), Some("no-store"));
    let csp = page.header("content-security-policy").unwrap_or_default();
    assert!(
        csp.contains("default-src 'none'") && csp.contains("connect-src 'self'"),
        "{csp}"
    );
    assert!(page.body.starts_with("<!doctype html>"));
    assert!(
        !page.body.contains("http://") && !page.body.contains("https://"),
        "the page loads nothing from elsewhere"
    );

    // A few decisions, rejected ones and an unmatched one among them, so that the series the
    // page reads have samples (a store error series is absent on the memory store: the page
    // sums an absent series as 0).
    let body = r#"{"domain":"api","descriptors":[{"user":"u1"}]}"#;
    for _ in 0..12 {
        assert!(matches!(
            post_json(server.http, "/v1/check", body).status,
            200 | 429
        ));
    }
    let unmatched = r#"{"domain":"elsewhere","descriptors":[{"user":"u1"}]}"#;
    assert_eq!(post_json(server.http, "/v1/check", unmatched).status, 200);
    for path in ENDPOINTS {
        assert!(
            page.body.contains(&format!("\"{path}\"")),
            "the page reads {path}"
        );
        let answer = request(server.http, "GET", path, &[], "");
        assert_eq!(answer.status, 200, "{path}: {}", answer.body);
    }
    let metrics = request(server.http, "GET", "/metrics", &[], "").body;
    for series in SERIES {
        assert!(page.body.contains(series), "the page reads {series}");
    }
    // The RLQS and global-limit cards' series appear only on servers with Envoys on RLQS or
    // a global store; read by the names the server records them under.
    use tollgate_server::metrics;
    for series in [
        metrics::RLQS_STREAMS,
        metrics::RLQS_ANSWERS,
        metrics::RLQS_RENEWED,
        metrics::RLQS_PREPAID,
        metrics::GLOBAL_RESERVOIRS,
        metrics::GLOBAL_HELD,
        metrics::GLOBAL_FETCHED,
        metrics::GLOBAL_GIVEN_BACK,
        metrics::GLOBAL_ROUND_FAILURES,
    ] {
        assert!(
            page.body.contains(&format!("\"{series}\"")),
            "the page reads {series}"
        );
    }
    for series in &SERIES[..6] {
        assert!(
            metrics.lines().any(|line| line.starts_with(series)),
            "{series} is not in /metrics:\n{metrics}"
        );
    }
    // The labels the page splits decisions by.
    let decision = metrics
        .lines()
        .find(|line| line.starts_with("tollgate_decisions_total{") && line.contains("rejected"))
        .unwrap_or_else(|| panic!("no rejected decision in\n{metrics}"));
    for label in [
        "limit=\"per-user\"",
        "result=\"rejected\"",
        "mode=\"enforce\"",
    ] {
        assert!(decision.contains(label), "{decision}");
    }
}

#[test]
fn with_an_admin_token_the_page_is_public_and_its_admin_reads_are_not() {
    let server = Server::start(&["--admin-token", "s3cret"]);
    assert_eq!(
        request(server.http, "GET", "/dashboard", &[], "").status,
        200
    );
    assert_eq!(
        request(server.http, "GET", "/v1/policy", &[], "").status,
        401
    );
    let authorized = request(
        server.http,
        "GET",
        "/v1/policy",
        &[("Authorization", "Bearer s3cret")],
        "",
    );
    assert_eq!(authorized.status, 200, "{}", authorized.body);
}
