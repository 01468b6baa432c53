//! End to end: reservations settled through `POST /v1/settle`, on the real binary and its
//! memory store (the Redis store's are in `redis_e2e.rs`).

mod support;

use support::{Scratch, Server, path_str, post_json, request};

const POLICY: &str = r#"
version: "tokens-1"
limits:
  - name: tokens-per-user
    domain: llm
    key: [user]
    capacity: 1000
    refill: 1000/h
"#;

fn body(id: &str, cost: u64, used: Option<u64>) -> String {
    let used = used
        .map(|used| format!(r#","used":{used}"#))
        .unwrap_or_default();
    format!(
        r#"{{"domain":"llm","descriptors":[{{"user":"u1"}}],"cost":{cost},"request_id":"{id}"{used}}}"#
    )
}

fn remaining(answer: &support::Answer) -> u64 {
    answer.json()["limits"][0]["remaining"]
        .as_u64()
        .unwrap_or_else(|| panic!("no remaining in {}", answer.body))
}

#[test]
fn a_reservation_settled_for_less_gives_the_rest_back_once() {
    let scratch = Scratch::new("settle");
    let config = scratch.write("policy.yaml", POLICY);
    let server = Server::start(&["--config", path_str(&config)]);

    let reserved = post_json(server.http, "/v1/check", &body("r1", 800, None));
    assert_eq!(reserved.status, 200, "{}", reserved.body);
    assert_eq!(remaining(&reserved), 200);
    // Too big to reserve now.
    let next = post_json(server.http, "/v1/check", &body("r2", 800, None));
    assert_eq!(next.status, 429, "{}", next.body);

    let settled = post_json(server.http, "/v1/settle", &body("r1", 800, Some(300)));
    assert_eq!(settled.status, 200, "{}", settled.body);
    let json = settled.json();
    assert_eq!(json["settled"], "settled");
    assert_eq!(json["policy_version"], "tokens-1");
    assert_eq!(json["limits"][0]["name"], "tokens-per-user");
    assert_eq!(remaining(&settled), 700);

    // Retried: nothing more.
    let again = post_json(server.http, "/v1/settle", &body("r1", 800, Some(300)));
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(again.json()["settled"], "repeated");
    assert_eq!(remaining(&again), 700);
    // Another amount under the same id: a conflict, nothing given.
    let other = post_json(server.http, "/v1/settle", &body("r1", 800, Some(100)));
    assert_eq!(other.status, 409, "{}", other.body);
    assert_eq!(other.json()["error"]["code"], "idempotency_conflict");
    // The rejected check was never charged: nothing to settle.
    let rejected = post_json(server.http, "/v1/settle", &body("r2", 800, Some(0)));
    assert_eq!(rejected.status, 200, "{}", rejected.body);
    assert_eq!(rejected.json()["settled"], "not_found");
    assert_eq!(remaining(&rejected), 700);

    // What was given back is spendable.
    let spend = post_json(server.http, "/v1/check", &body("r3", 700, None));
    assert_eq!(spend.status, 200, "{}", spend.body);

    let metrics = request(server.http, "GET", "/metrics", &[], "").body;
    for (status, count) in [("settled", 1), ("repeated", 1), ("not_found", 1)] {
        let series = format!("tollgate_settlements_total{{status=\"{status}\"}} {count}");
        assert!(metrics.contains(&series), "no {series} in\n{metrics}");
    }
}

#[test]
fn bad_settlements_are_refused_and_change_nothing() {
    let scratch = Scratch::new("settle-bad");
    let config = scratch.write("policy.yaml", POLICY);
    let server = Server::start(&["--config", path_str(&config)]);
    let reserved = post_json(server.http, "/v1/check", &body("r1", 500, None));
    assert_eq!(reserved.status, 200, "{}", reserved.body);

    let cases = [
        (body("r1", 500, Some(501)), 400, "invalid_settlement"),
        (
            r#"{"domain":"llm","descriptors":[{"user":"u1"}],"cost":500,"used":1}"#.to_owned(),
            400,
            "invalid_json",
        ),
        (body("r1", 500, None), 400, "invalid_json"),
        (
            body("r1", 500, Some(1)).replace(r#""used""#, r#""extra":1,"used""#),
            400,
            "invalid_json",
        ),
        (body("r1", 0, Some(0)), 400, "invalid_cost"),
        (body("", 500, Some(1)), 400, "invalid_request_id"),
        ("{".to_owned(), 400, "invalid_json"),
    ];
    for (request_body, status, code) in cases {
        let answer = post_json(server.http, "/v1/settle", &request_body);
        assert_eq!(answer.status, status, "{request_body}: {}", answer.body);
        assert_eq!(answer.json()["error"]["code"], code, "{request_body}");
    }
    // Still charged in full, and still settleable.
    let settled = post_json(server.http, "/v1/settle", &body("r1", 500, Some(0)));
    assert_eq!(settled.json()["settled"], "settled", "{}", settled.body);
    assert_eq!(remaining(&settled), 1000);
}
