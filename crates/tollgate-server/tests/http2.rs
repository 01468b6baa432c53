//! The HTTP API over HTTP/2 with prior knowledge, through the real binary: many checks at once
//! on one connection deciding exactly as over HTTP/1.1 (the same bucket, headers and errors),
//! the admin endpoints' loopback rule knowing the client, HTTP/1.1 on the same port, and an
//! answer larger than the client's flow-control window arriving whole.

mod support;

use support::http2::Http2;
use support::{Scratch, Server, metric, path_str, post_json};

const POLICY: &str = r#"
version: "7"
limits:
  - name: per-user
    domain: api
    key: [user]
    capacity: 5
    refill: 1/m
"#;

fn check_body(user: &str) -> String {
    format!(r#"{{"domain":"api","descriptors":[{{"user":"{user}"}}]}}"#)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checks_multiplexed_on_one_connection_admit_exactly_the_capacity() {
    let scratch = Scratch::new("http2");
    let config = scratch.write("policy.yaml", POLICY);
    let server = Server::start(&["--config", path_str(&config)]);
    let connection = Http2::connect(server.http).await;

    // Twelve checks in flight at once on one connection: five admitted, seven refused.
    let body = check_body("alice");
    let answers =
        futures_util::future::join_all((0..12).map(|_| connection.post_json("/v1/check", &body)))
            .await;
    let (allowed, rejected): (Vec<_>, Vec<_>) =
        answers.into_iter().partition(|answer| answer.status == 200);
    assert_eq!(allowed.len(), 5, "{allowed:?}");
    assert_eq!(rejected.len(), 7, "{rejected:?}");
    let mut remaining: Vec<_> = allowed
        .iter()
        .map(|answer| answer.json()["limits"][0]["remaining"].as_u64())
        .collect();
    remaining.sort_unstable();
    assert_eq!(remaining, [Some(0), Some(1), Some(2), Some(3), Some(4)]);
    for answer in &allowed {
        assert_eq!(answer.json()["policy_version"], "7");
        assert_eq!(
            answer.header("ratelimit-policy"),
            Some(r#""per-user";q=5;w=300"#),
            "{answer:?}"
        );
        assert_eq!(answer.header("retry-after"), None, "{answer:?}");
        // Dated as HTTP/1.1's answers are: `Mon, 07 Dec 2026 09:30:00 GMT`.
        let date = answer.header("date").unwrap_or_default();
        assert!(date.len() == 29 && date.ends_with(" GMT"), "{answer:?}");
    }
    for answer in &rejected {
        assert_eq!(answer.status, 429, "{answer:?}");
        assert_eq!(answer.json()["allowed"], false);
        // One token a minute: the next one is at most 60 s away, rounded up.
        let retry = answer
            .header("retry-after")
            .and_then(|v| v.parse::<u64>().ok());
        assert!(matches!(retry, Some(59..=60)), "{answer:?}");
        let ratelimit = answer.header("ratelimit").unwrap_or_default();
        assert!(ratelimit.starts_with(r#""per-user";r=0;t="#), "{answer:?}");
    }

    // The same bucket over HTTP/1.1 on the same port.
    let over_http1 = post_json(server.http, "/v1/check", &body);
    assert_eq!(over_http1.status, 429, "{}", over_http1.body);
    assert_eq!(
        post_json(server.http, "/v1/check", &check_body("bob")).status,
        200
    );

    // Bad input is refused as over HTTP/1.1, and the connection goes on.
    let bad = connection.post_json("/v1/check", "{\"domain\":").await;
    assert_eq!(bad.status, 400, "{bad:?}");
    assert_eq!(bad.json()["error"]["code"], "invalid_json", "{bad:?}");
    let unknown = connection
        .post_json(
            "/v1/check",
            r#"{"domain":"api","descriptors":[],"colour":"red"}"#,
        )
        .await;
    assert_eq!(unknown.status, 400, "{unknown:?}");
    let missing = connection.send("GET", "/v1/nowhere").await;
    assert_eq!(missing.status, 404, "{missing:?}");
    let health = connection.send("GET", "/healthz").await;
    assert_eq!(health.status, 200, "{health:?}");

    // The admin endpoints see a loopback client, as over HTTP/1.1 (no token configured).
    let policy = connection.send("GET", "/v1/policy").await;
    assert_eq!(policy.status, 200, "{policy:?}");
    assert_eq!(policy.json()["version"], "7");
    std::fs::write(&config, POLICY.replace("\"7\"", "\"8\"")).expect("write the policy");
    let reloaded = connection.send("POST", "/v1/policy/reload").await;
    assert_eq!(reloaded.status, 200, "{reloaded:?}");
    let decided = connection
        .post_json("/v1/check", &check_body("carol"))
        .await;
    assert_eq!(decided.json()["policy_version"], "8", "{decided:?}");

    // Every check counted, over either protocol, as the HTTP API's.
    let decisions = |result: &str| {
        metric(
            &server,
            &format!(
                r#"tollgate_decisions_total{{limit="per-user",result="{result}",mode="enforce",api="http"}}"#
            ),
        )
    };
    assert_eq!(decisions("allowed"), 7.0);
    assert_eq!(decisions("rejected"), 8.0);
}

/// An answer larger than the client's flow-control window (64 KiB, HTTP/2's default) arrives
/// whole, as the client gives the window back: the policy of a thousand limits, the same
/// bytes as over HTTP/1.1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_larger_than_the_flow_control_window_arrives_whole() {
    let mut policy = String::from("version: \"big\"\nlimits:\n");
    for i in 0..1000 {
        policy.push_str(&format!(
            "  - {{name: limit-{i}, domain: d{i}, key: [user], capacity: 10, refill: 1/s}}\n"
        ));
    }
    let scratch = Scratch::new("http2-big");
    let config = scratch.write("policy.yaml", &policy);
    let server = Server::start(&["--config", path_str(&config)]);
    let over_http1 = support::request(server.http, "GET", "/v1/policy", &[], "");
    assert_eq!(over_http1.status, 200);
    assert!(
        over_http1.body.len() > 3 * 65_535,
        "{}",
        over_http1.body.len()
    );
    let connection = Http2::connect(server.http).await;
    let over_http2 = connection.send("GET", "/v1/policy").await;
    assert_eq!(over_http2.status, 200);
    assert_eq!(over_http2.body.len(), over_http1.body.len());
    assert_eq!(over_http2.json(), over_http1.json());
}
