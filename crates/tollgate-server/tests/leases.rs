//! End to end: concurrency limits through `POST /v1/leases` and `DELETE /v1/leases/{id}`, on
//! the real binary and its memory store.

mod support;

use support::{Scratch, Server, path_str, post_json, request};

const POLICY: &str = r#"
version: "leases-1"
limits:
  - name: exports-per-tenant
    domain: api
    when: {route: /export}
    key: [tenant]
    algorithm: concurrency
    max_in_flight: 2
    lease_timeout: 1h
  - name: per-user
    domain: api
    key: [user]
    capacity: 1
    refill: 1/h
"#;

fn export(tenant: &str) -> String {
    format!(r#"{{"domain":"api","descriptors":[{{"route":"/export","tenant":"{tenant}"}}]}}"#)
}

fn release(server: &Server, id: &str) -> support::Answer {
    request(server.http, "DELETE", &format!("/v1/leases/{id}"), &[], "")
}

fn metric(server: &Server, series: &str) -> f64 {
    let metrics = request(server.http, "GET", "/metrics", &[], "").body;
    metrics
        .lines()
        .find(|line| line.starts_with(series))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("no {series} in\n{metrics}"))
}

#[test]
fn leases_up_to_max_in_flight_then_429_until_one_is_released() {
    let scratch = Scratch::new("leases");
    let config = scratch.write("policy.yaml", POLICY);
    let server = Server::start(&["--config", path_str(&config)]);

    let mut held = Vec::new();
    for in_flight in [1, 2] {
        let answer = post_json(server.http, "/v1/leases", &export("acme"));
        assert_eq!(answer.status, 200, "{}", answer.body);
        let body = answer.json();
        assert_eq!(body["allowed"], true);
        assert_eq!(body["policy_version"], "leases-1");
        let limit = &body["limits"][0];
        assert_eq!(limit["name"], "exports-per-tenant");
        assert_eq!(limit["allowed"], true);
        assert_eq!(limit["in_flight"], in_flight);
        assert_eq!(limit["capacity"], 2);
        assert_eq!(limit["remaining"], 2 - in_flight);
        let id = body["lease_id"].as_str().expect("a lease id").to_owned();
        assert_eq!(id.len(), 32);
        held.push(id);
    }
    assert_ne!(held[0], held[1]);

    let full = post_json(server.http, "/v1/leases", &export("acme"));
    assert_eq!(full.status, 429, "{}", full.body);
    let body = full.json();
    assert_eq!(body["allowed"], false);
    assert!(body["lease_id"].is_null(), "a rejection holds nothing");
    assert_eq!(body["limits"][0]["allowed"], false);
    assert_eq!(body["limits"][0]["in_flight"], 2);
    // The oldest lease times out within the hour: the latest a slot frees itself.
    let retry: u64 = full.header("retry-after").unwrap().parse().unwrap();
    assert!((3_590..=3_600).contains(&retry), "Retry-After {retry}");
    // Another tenant has its own slots.
    assert_eq!(
        post_json(server.http, "/v1/leases", &export("globex")).status,
        200
    );

    // Released: the slot is free at once; a second release finds nothing.
    assert_eq!(release(&server, &held[0]).status, 204);
    let gone = release(&server, &held[0]);
    assert_eq!(gone.status, 404, "{}", gone.body);
    assert_eq!(gone.json()["error"]["code"], "lease_not_found");
    let again = post_json(server.http, "/v1/leases", &export("acme"));
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(again.json()["limits"][0]["in_flight"], 2);

    // Rate limits are not decided by leases, nor concurrency limits by checks.
    let user = r#"{"domain":"api","descriptors":[{"user":"ursula"}]}"#;
    let lease = post_json(server.http, "/v1/leases", user);
    assert_eq!(lease.status, 200, "{}", lease.body);
    assert!(
        lease.json()["lease_id"].is_null(),
        "no concurrency limit applies"
    );
    assert_eq!(lease.json()["limits"].as_array().unwrap().len(), 0);
    let check = post_json(server.http, "/v1/check", &export("acme"));
    assert_eq!(check.status, 200, "{}", check.body);
    assert_eq!(check.json()["limits"].as_array().unwrap().len(), 0);

    let series = |result: &str| {
        format!(
            r#"tollgate_decisions_total{{limit="exports-per-tenant",result="{result}",mode="enforce",api="leases"}}"#
        )
    };
    assert_eq!(metric(&server, &series("allowed")), 4.0);
    assert_eq!(metric(&server, &series("rejected")), 1.0);
    // The two acquires that took acme's last slot left it full: past 0.8 of max_in_flight.
    let near = r#"tollgate_near_limit_decisions_total{limit="exports-per-tenant",mode="enforce",api="leases"}"#;
    assert_eq!(metric(&server, near), 2.0);
    // Only the lease no concurrency limit applied to is unmatched.
    let unmatched = r#"tollgate_unmatched_requests_total{api="leases"}"#;
    assert_eq!(metric(&server, unmatched), 1.0);
    assert_eq!(
        metric(
            &server,
            r#"tollgate_lease_releases_total{result="released"}"#
        ),
        1.0
    );
    assert_eq!(
        metric(
            &server,
            r#"tollgate_lease_releases_total{result="not_found"}"#
        ),
        1.0
    );
    assert_eq!(metric(&server, "tollgate_live_leases"), 3.0);
}

#[test]
fn bad_lease_requests_are_4xx_and_change_nothing() {
    let scratch = Scratch::new("bad-leases");
    let config = scratch.write("policy.yaml", POLICY);
    let server = Server::start(&["--config", path_str(&config)]);
    let bodies = [
        (
            r#"{"domain":"api","descriptors":[{"route":"/export","tenant":"a"}],"cost":2}"#,
            400,
        ),
        (r#"{"domain":"api","descriptors":[]}"#, 400),
        (r#"{"domain":"api","descriptors":[{"tenant":7}]}"#, 400),
        (r#"{"domain":"api""#, 400),
        ("", 400),
    ];
    for (body, status) in bodies {
        let answer = post_json(server.http, "/v1/leases", body);
        assert_eq!(answer.status, status, "{body}: {}", answer.body);
        assert!(
            answer.json()["error"]["code"].is_string(),
            "{}",
            answer.body
        );
    }
    // Each counted once as invalid, under the lease API (a lease has no cost to give).
    let invalid = r#"tollgate_invalid_requests_total{api="leases"}"#;
    assert_eq!(metric(&server, invalid), bodies.len() as f64);
    for (id, code) in [
        ("not%20an%20id", "invalid_lease_id"),
        (&*"x".repeat(65), "invalid_lease_id"),
        ("00000000000000000000000000000000", "lease_not_found"),
    ] {
        let answer = release(&server, id);
        assert_eq!(
            answer.json()["error"]["code"],
            code,
            "{id}: {}",
            answer.body
        );
        let renewed = post_json(server.http, &format!("/v1/leases/{id}/renew"), "");
        assert_eq!(
            renewed.json()["error"]["code"],
            code,
            "{id}: {}",
            renewed.body
        );
    }
    // A lease id that cannot be one is a bad request too; one that could be, but is held
    // nowhere, is not.
    assert_eq!(metric(&server, invalid), bodies.len() as f64 + 4.0);
    assert_eq!(
        request(server.http, "GET", "/v1/leases", &[], "").status,
        405
    );
    // Nothing was held by any of it: both slots are free.
    for _ in 0..2 {
        assert_eq!(
            post_json(server.http, "/v1/leases", &export("a")).status,
            200
        );
    }
    assert_eq!(
        post_json(server.http, "/v1/leases", &export("a")).status,
        429
    );
}

#[test]
fn a_renewal_keeps_a_lease_and_one_released_is_not_revived() {
    let scratch = Scratch::new("renew");
    let policy = r#"
version: "renew-1"
limits:
  - name: jobs
    domain: api
    key: [tenant]
    algorithm: concurrency
    max_in_flight: 1
    lease_timeout: 10m
"#;
    let config = scratch.write("policy.yaml", policy);
    let server = Server::start(&["--config", path_str(&config)]);
    let body = r#"{"domain":"api","descriptors":[{"tenant":"t"}]}"#;
    let taken = post_json(server.http, "/v1/leases", body);
    assert_eq!(taken.status, 200, "{}", taken.body);
    let id = taken.json()["lease_id"].as_str().unwrap().to_owned();

    let renewed = post_json(server.http, &format!("/v1/leases/{id}/renew"), "");
    assert_eq!(renewed.status, 200, "{}", renewed.body);
    assert_eq!(renewed.json()["lease_id"], id.as_str());
    let left = renewed.json()["expires_after_ms"].as_u64().unwrap();
    assert!((599_000..=600_000).contains(&left), "{left}");
    assert_eq!(post_json(server.http, "/v1/leases", body).status, 429);

    assert_eq!(release(&server, &id).status, 204);
    let gone = post_json(server.http, &format!("/v1/leases/{id}/renew"), "");
    assert_eq!(gone.status, 404, "{}", gone.body);
    assert_eq!(gone.json()["error"]["code"], "lease_not_found");
    let bad = post_json(server.http, "/v1/leases/not%20one/renew", "");
    assert_eq!(bad.status, 400, "{}", bad.body);
    assert_eq!(
        metric(
            &server,
            r#"tollgate_lease_renewals_total{result="renewed"}"#
        ),
        1.0
    );
    assert_eq!(
        metric(
            &server,
            r#"tollgate_lease_renewals_total{result="not_found"}"#
        ),
        1.0
    );
}

#[test]
fn an_explanation_shows_what_is_held_and_holds_nothing() {
    let scratch = Scratch::new("leases-explain");
    let config = scratch.write("policy.yaml", POLICY);
    let server = Server::start(&["--config", path_str(&config)]);
    let explain = |tenant: &str| {
        let answer = post_json(server.http, "/v1/leases/explain", &export(tenant));
        assert_eq!(answer.status, 200, "{}", answer.body);
        answer.json()
    };

    let body = explain("acme");
    assert_eq!(body["allowed"], true);
    assert!(
        body.get("lease_id").is_none(),
        "an explanation has no lease: {body}"
    );
    let limit = &body["limits"][0];
    assert_eq!(limit["name"], "exports-per-tenant");
    assert_eq!(limit["in_flight"], 0);
    assert_eq!(limit["bucket_key"], "exports-per-tenant|acme");
    assert_eq!(limit["descriptor"], 0);

    let mut held = Vec::new();
    for _ in 0..2 {
        let answer = post_json(server.http, "/v1/leases", &export("acme"));
        assert_eq!(answer.status, 200, "{}", answer.body);
        held.push(
            answer.json()["lease_id"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        );
    }
    // Explained again and again: full, and still only the two leases held.
    for _ in 0..3 {
        let body = explain("acme");
        assert_eq!(body["allowed"], false, "{body}");
        assert_eq!(body["limits"][0]["in_flight"], 2);
        assert_eq!(body["limits"][0]["remaining"], 0);
        assert!(body["limits"][0]["retry_after_ms"].as_u64() > Some(3_500_000));
    }
    assert_eq!(metric(&server, "tollgate_live_leases"), 2.0);
    assert_eq!(release(&server, &held[0]).status, 204);
    assert_eq!(explain("acme")["limits"][0]["in_flight"], 1);
    // Only concurrency limits: a rate limit the same request matches is not shown, nor charged.
    let both = r#"{"domain":"api","descriptors":[{"route":"/export","tenant":"acme","user":"u"}]}"#;
    let answer = post_json(server.http, "/v1/leases/explain", both);
    assert_eq!(answer.json()["limits"].as_array().map(Vec::len), Some(1));
    let check = r#"{"domain":"api","descriptors":[{"user":"u"}]}"#;
    assert_eq!(post_json(server.http, "/v1/check", check).status, 200);

    let bad = post_json(server.http, "/v1/leases/explain", r#"{"domain":"api"}"#);
    assert_eq!(bad.status, 400, "{}", bad.body);
}

#[test]
fn a_full_lease_table_is_a_503_and_admits_nothing() {
    let scratch = Scratch::new("leases-full");
    let config = scratch.write("policy.yaml", POLICY);
    let server = Server::start(&["--config", path_str(&config), "--max-leases", "2"]);
    let mut held = Vec::new();
    for tenant in ["acme", "globex"] {
        let answer = post_json(server.http, "/v1/leases", &export(tenant));
        assert_eq!(answer.status, 200, "{}", answer.body);
        held.push(
            answer.json()["lease_id"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        );
    }
    // A third tenant has free slots of its own, but the process holds all it may.
    let full = post_json(server.http, "/v1/leases", &export("initech"));
    assert_eq!(full.status, 503, "{}", full.body);
    assert_eq!(full.json()["error"]["code"], "lease_table_full");
    assert_eq!(metric(&server, "tollgate_live_leases"), 2.0);
    assert_eq!(release(&server, &held[0]).status, 204);
    assert_eq!(
        post_json(server.http, "/v1/leases", &export("initech")).status,
        200
    );
}

#[test]
fn a_retried_acquire_with_a_request_id_returns_the_lease_it_holds() {
    let scratch = Scratch::new("leases-retry");
    let config = scratch.write("policy.yaml", POLICY);
    let server = Server::start(&["--config", path_str(&config)]);
    let with_id = |id: &str| {
        format!(
            r#"{{"domain":"api","descriptors":[{{"route":"/export","tenant":"acme"}}],"request_id":"{id}"}}"#
        )
    };
    let first = post_json(server.http, "/v1/leases", &with_id("9b2f-retry"));
    assert_eq!(first.status, 200, "{}", first.body);
    let lease = first.json()["lease_id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert_eq!(lease.len(), 32);
    assert!(first.json().get("repeated").is_none());

    // The client timed out and sends it again: the same lease, no second slot.
    for _ in 0..2 {
        let again = post_json(server.http, "/v1/leases", &with_id("9b2f-retry"));
        assert_eq!(again.status, 200, "{}", again.body);
        let body = again.json();
        assert_eq!(body["lease_id"], lease.as_str());
        assert_eq!(body["repeated"], true);
        assert_eq!(body["limits"][0]["in_flight"], 1);
    }
    assert_eq!(metric(&server, "tollgate_live_leases"), 1.0);
    let metrics = request(server.http, "GET", "/metrics", &[], "").body;
    assert!(
        !metrics.contains(r#"tollgate_invalid_requests_total{api="leases"}"#),
        "a retry is not a bad request: {metrics}"
    );

    // Another request id is another lease; when full, a retry of a held one still answers.
    let other = post_json(server.http, "/v1/leases", &with_id("c41d-other"));
    assert_eq!(other.status, 200, "{}", other.body);
    assert_ne!(other.json()["lease_id"], lease.as_str());
    let full = post_json(server.http, "/v1/leases", &with_id("e77a-third"));
    assert_eq!(full.status, 429, "{}", full.body);
    let again = post_json(server.http, "/v1/leases", &with_id("9b2f-retry"));
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(again.json()["allowed"], true);
    // Allowed on its limit too, full as it is: this lease is one of the two it holds.
    assert_eq!(again.json()["limits"][0]["allowed"], true);
    assert_eq!(again.json()["limits"][0]["in_flight"], 2);

    // Given back, the request id takes a lease again (the same id: it is derived from it).
    assert_eq!(release(&server, &lease).status, 204);
    let anew = post_json(server.http, "/v1/leases", &with_id("9b2f-retry"));
    assert_eq!(anew.status, 200, "{}", anew.body);
    assert_eq!(anew.json()["lease_id"], lease.as_str());
    assert!(anew.json().get("repeated").is_none());
}

/// A deny limit holds on the lease path too: no lease, no wait offered, and the decision
/// counted as `denied`, apart from a concurrency limit run dry.
#[test]
fn a_deny_refuses_a_lease_and_is_counted_as_denied() {
    let scratch = Scratch::new("leases-deny");
    let policy = format!(
        "{POLICY}  - name: blocked\n    domain: api\n    when: {{tenant: evil}}\n    deny: true\n"
    );
    let config = scratch.write("policy.yaml", &policy);
    let server = Server::start(&["--config", path_str(&config)]);
    let answer = post_json(server.http, "/v1/leases", &export("evil"));
    assert_eq!(answer.status, 429, "{}", answer.body);
    assert!(answer.json()["lease_id"].is_null(), "{}", answer.body);
    assert!(answer.header("retry-after").is_none(), "{}", answer.body);
    let denied =
        r#"tollgate_decisions_total{limit="blocked",result="denied",mode="enforce",api="leases"}"#;
    assert_eq!(metric(&server, denied), 1.0);
    assert_eq!(
        post_json(server.http, "/v1/leases", &export("acme")).status,
        200
    );
}
