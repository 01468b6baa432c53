//! End to end with Redis: several `tollgate` processes sharing one test Redis, and what they
//! answer when it dies.

mod support;

use std::path::Path;
use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::google::protobuf::UInt64Value;
use support::{Scratch, Server, metric, path_str, post_json, request, serve_refused};
use tollgate::{Clock, MonotonicClock};
use tollgate_redis::test_server::{
    RedisCluster, RedisSentinel, RedisServer, TestCertificates, command, free_port,
};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const POLICY: &str = r#"
version: "shared"
limits:
  - name: shared-quota
    domain: api
    key: [user]
    capacity: 50
    refill: 1/h
  - name: closed-limit
    domain: strict
    key: [user]
    capacity: 100
    refill: 100/s
    failure_mode: closed
  - name: watched-shadow
    domain: strict
    key: [watched]
    capacity: 100
    refill: 100/s
    mode: shadow
  - name: open-limit
    domain: lenient
    key: [user]
    capacity: 100
    refill: 100/s
    failure_mode: open
    emergency: 3/h
  - name: lenient-shadow
    domain: lenient
    key: [watched]
    capacity: 100
    refill: 100/s
    mode: shadow
    failure_mode: closed
"#;

/// `tollgate serve` with `config`, on the store at `url`, plus `args`. The store timeout is 2 s,
/// not the production 20 ms: these tests are about what is decided, not how fast, and a debug
/// build (or a TLS handshake) on a busy CI host can pass 20 ms, which would answer degraded and
/// fail them for nothing.
fn on_store(config: &Path, url: &str, args: &[&str]) -> Server {
    let store = [
        "--config",
        path_str(config),
        "--store",
        url,
        "--store-timeout",
        "2s",
    ];
    Server::start(&[&store[..], args].concat())
}

#[test]
fn two_servers_share_a_quota_exactly() {
    let redis = RedisServer::start();
    let scratch = Scratch::new("shared");
    let config = scratch.write("policy.yaml", POLICY);
    let servers = [
        on_store(&config, &redis.url(), &[]),
        on_store(&config, &redis.url(), &[]),
    ];
    let admitted = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..8)
            .map(|worker| {
                let server = &servers[worker % 2];
                scope.spawn(move || {
                    (0..20)
                        .filter(|_| {
                            let body = r#"{"domain":"api","descriptors":[{"user":"pat"}]}"#;
                            let answer = post_json(server.http, "/v1/check", body);
                            assert!(matches!(answer.status, 200 | 429), "{}", answer.body);
                            answer.status == 200
                        })
                        .count()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .sum::<usize>()
    });
    // 160 attempts through two processes against one bucket of 50 refilled at one an hour.
    assert!((50..=51).contains(&admitted), "admitted {admitted}");
}

/// A reservation checked through one process and settled through another: the record of the
/// charge lives in Redis, so either process gives the rest back, and only once.
#[test]
fn a_reservation_is_settled_through_another_server_once() {
    let redis = RedisServer::start();
    let scratch = Scratch::new("settle-shared");
    let config = scratch.write("policy.yaml", POLICY);
    let servers = [
        on_store(&config, &redis.url(), &[]),
        on_store(&config, &redis.url(), &[]),
    ];
    let body = |used: Option<u64>| {
        let used = used
            .map(|used| format!(r#","used":{used}"#))
            .unwrap_or_default();
        format!(
            r#"{{"domain":"api","descriptors":[{{"user":"sam"}}],"cost":40,"request_id":"job-7"{used}}}"#
        )
    };
    let remaining = |answer: &support::Answer| answer.json()["limits"][0]["remaining"].clone();
    let reserved = post_json(servers[0].http, "/v1/check", &body(None));
    assert_eq!(reserved.status, 200, "{}", reserved.body);
    assert_eq!(remaining(&reserved), 10);
    let settled = post_json(servers[1].http, "/v1/settle", &body(Some(15)));
    assert_eq!(settled.status, 200, "{}", settled.body);
    assert_eq!(settled.json()["settled"], "settled");
    assert_eq!(remaining(&settled), 35);
    let again = post_json(servers[0].http, "/v1/settle", &body(Some(15)));
    assert_eq!(again.json()["settled"], "repeated", "{}", again.body);
    assert_eq!(remaining(&again), 35);
    let other = post_json(servers[0].http, "/v1/settle", &body(Some(10)));
    assert_eq!(other.status, 409, "{}", other.body);
    // The check retried still answers as first decided, charging nothing.
    let retried = post_json(servers[1].http, "/v1/check", &body(None));
    assert_eq!(remaining(&retried), 10, "{}", retried.body);
    let peek = post_json(
        servers[1].http,
        "/v1/explain",
        r#"{"domain":"api","descriptors":[{"user":"sam"}]}"#,
    );
    assert_eq!(remaining(&peek), 34, "35 left, one asked: {}", peek.body);
}

fn remembered(server: &Server) -> String {
    let metrics = request(server.http, "GET", "/metrics", &[], "").body;
    metrics
        .lines()
        .find(|line| line.starts_with("tollgate_remembered_rejections_total"))
        .unwrap_or_else(|| panic!("no tollgate_remembered_rejections_total in\n{metrics}"))
        .to_owned()
}

/// Past its limit, a key is rejected from the server's memory of Redis' rejection until its
/// Retry-After passes (on by default; `--rejection-memory 0` turns it off): the same answers,
/// nothing more admitted.
#[test]
fn rejections_are_remembered_unless_turned_off() {
    let redis = RedisServer::start();
    let scratch = Scratch::new("remembered");
    let config = scratch.write("policy.yaml", POLICY);
    let servers = [
        on_store(&config, &redis.url(), &[]),
        on_store(&config, &redis.url(), &["--rejection-memory", "0"]),
    ];
    for (server, user) in servers.iter().zip(["ham", "jam"]) {
        let body = format!(r#"{{"domain":"api","descriptors":[{{"user":"{user}"}}]}}"#);
        let statuses: Vec<u16> = (0..60)
            .map(|_| post_json(server.http, "/v1/check", &body).status)
            .collect();
        assert_eq!(statuses.iter().filter(|&&s| s == 200).count(), 50);
        assert_eq!(statuses.iter().filter(|&&s| s == 429).count(), 10);
        let last = post_json(server.http, "/v1/check", &body);
        assert_eq!(last.status, 429);
        let retry: u64 = last.header("retry-after").unwrap().parse().unwrap();
        assert!((3599..=3600).contains(&retry), "{retry}");
    }
    assert_eq!(
        remembered(&servers[0]),
        "tollgate_remembered_rejections_total 10"
    );
    assert_eq!(
        remembered(&servers[1]),
        "tollgate_remembered_rejections_total 0"
    );
}

/// Token leasing (`--token-batch`): two servers hammering one key each take its tokens from
/// Redis in batches and spend them without calls, and together never admit more than the
/// bucket holds; the batches they still hold at shutdown go back, so a third server then
/// admits exactly what the first two did not.
#[test]
fn two_batching_servers_share_a_quota_without_over_admitting() {
    const BATCHED: &str = r#"
version: "batched"
limits:
  - name: quota
    domain: api
    key: [user]
    capacity: 400
    refill: 1/d
"#;
    let redis = RedisServer::start();
    let scratch = Scratch::new("batched");
    let config = scratch.write("policy.yaml", BATCHED);
    let batching = ["--token-batch", "16", "--token-batch-ttl", "30s"];
    let servers = [
        on_store(&config, &redis.url(), &batching),
        on_store(&config, &redis.url(), &batching),
    ];
    let check = |server: &Server, user: &str| {
        let body = format!(r#"{{"domain":"api","descriptors":[{{"user":"{user}"}}]}}"#);
        let answer = post_json(server.http, "/v1/check", &body);
        assert!(matches!(answer.status, 200 | 429), "{}", answer.body);
        answer.status == 200
    };
    let hammer = |user: &str, rounds: usize| -> usize {
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..8)
                .map(|worker| {
                    let server = &servers[worker % 2];
                    scope.spawn(move || (0..rounds).filter(|_| check(server, user)).count())
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        })
    };

    // Past the limit: 640 checks for 400 tokens.
    let pat = hammer("pat", 80);
    assert!(pat <= 400, "admitted {pat}");
    // Under it: 240 checks, all admitted, and tokens still held when the servers stop.
    let mut sue = hammer("sue", 30);
    assert_eq!(sue, 240);
    let held = |servers: &[Server]| -> f64 {
        servers
            .iter()
            .map(|s| metric(s, "tollgate_batched_tokens_held"))
            .sum()
    };
    while held(&servers) == 0.0 && sue < 300 {
        sue += usize::from(check(&servers[0], "sue"));
    }
    assert!(held(&servers) > 0.0);
    for server in &servers {
        assert!(metric(server, "tollgate_token_batches_total") > 0.0);
        assert!(metric(server, "tollgate_batched_tokens_taken_total") > 0.0);
        let spent = r#"tollgate_batched_tokens_total{outcome="spent"}"#;
        assert!(metric(server, spent) > 0.0);
    }
    let [a, b] = servers;
    assert!(a.terminate().success());
    assert!(b.terminate().success());

    // A server without batches finds exactly what was not admitted.
    let third = on_store(&config, &redis.url(), &[]);
    let rest = |user: &str| (0..500).take_while(|_| check(&third, user)).count();
    assert_eq!(rest("pat"), 400 - pat);
    assert_eq!(rest("sue"), 400 - sue);
}

/// Token leasing's flags refuse what cannot work, in one line that names the flag.
#[test]
fn token_batch_flags_refuse_what_cannot_work() {
    let redis = RedisServer::start();
    let url = redis.url();
    support::assert_serve_flags_refused(&[
        ("--token-batch", "many", "invalid digit"),
        ("--token-batch", "1000001", "not in 0..=1000000"),
        ("--token-batch-ttl", "0s", "longer than 0"),
        ("--token-batch-ttl", "soon", "--token-batch-ttl"),
    ]);
    for (args, says) in [
        (
            &[
                "--store",
                &url,
                "--token-batch",
                "8",
                "--token-batch-ttl",
                "2m",
            ][..],
            "shorter than --idempotency-window",
        ),
        (&["--token-batch", "8"][..], "is for a Redis store"),
    ] {
        let stderr = serve_refused(args);
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    // Without batches their lifetime is moot, whatever it is (an environment may set it for
    // every process).
    let server = Server::start(&["--store", &url, "--token-batch-ttl", "2m"]);
    assert!(server.terminate().success());
}

/// A batch whose key goes quiet is given back once its lifetime is over, by the server's own
/// sweep rather than at the key's next check; what is still held at shutdown goes back then,
/// and the log says how many batches did.
#[test]
fn a_quiet_batch_goes_back_after_its_lifetime_and_the_rest_at_shutdown() {
    const BATCHED: &str = "limits:\n  - name: quota\n    domain: api\n    key: [user]\n    capacity: 100\n    refill: 1/d\n";
    let redis = RedisServer::start();
    let scratch = Scratch::new("quiet-batch");
    let config = scratch.write("policy.yaml", BATCHED);
    let store = ["--store", &redis.url(), "--store-timeout", "2s"];
    let args = |ttl| {
        let mut args = vec!["--config", path_str(&config), "--token-batch", "10"];
        args.extend(["--token-batch-ttl", ttl]);
        args.extend(store);
        args
    };
    let held = |server: &Server| metric(server, "tollgate_batched_tokens_held");
    // Checks in a quick run until the key takes a batch (it does once it is checked often);
    // how many were admitted.
    let until_batched = |server: &Server, user: &str| {
        let body = format!(r#"{{"domain":"api","descriptors":[{{"user":"{user}"}}]}}"#);
        let mut admitted = 0;
        while held(server) == 0.0 && admitted < 50 {
            assert_eq!(post_json(server.http, "/v1/check", &body).status, 200);
            admitted += 1;
        }
        assert!(held(server) > 0.0, "no batch after {admitted} checks");
        admitted
    };
    // What a server without batches then finds in the bucket.
    let plain = Server::start(&[&["--config", path_str(&config)][..], &store].concat());
    let left = |user: &str| {
        let body = format!(r#"{{"domain":"api","descriptors":[{{"user":"{user}"}}]}}"#);
        (0..120)
            .take_while(|_| post_json(plain.http, "/v1/check", &body).status == 200)
            .count()
    };
    let logs = "tollgate_server=info";

    // A lifetime of 2 s, swept every half second: the tokens held go back by 2.5 s (and, were
    // the sweep four times rarer, not before 8 s).
    let (server, quiet_logs) = Server::start_logging(&args("2s"), logs);
    let clock = MonotonicClock::new();
    let admitted = until_batched(&server, "quiet");
    let taken = clock.now();
    support::wait_for("the quiet batch given back", || {
        (held(&server) == 0.0).then_some(())
    });
    let after = clock.now().saturating_duration_since(taken);
    assert!(after < Duration::from_secs(6), "given back after {after:?}");
    assert_eq!(left("quiet"), 100 - admitted);
    // Nothing was held at shutdown, and nothing is said of it.
    let text = server.terminate_and_read(quiet_logs);
    assert!(!text.contains("gave back the unused tokens"), "{text}");

    // Held at shutdown: given back then, said once.
    let (server, busy_logs) = Server::start_logging(&args("30s"), logs);
    let admitted = until_batched(&server, "busy");
    let text = server.terminate_and_read(busy_logs);
    assert!(
        text.contains("gave back the unused tokens of batches batches=1"),
        "{text}"
    );
    assert_eq!(left("busy"), 100 - admitted);
}

#[test]
fn a_reload_that_grows_a_limit_carries_redis_balances_over() {
    let redis = RedisServer::start();
    let scratch = Scratch::new("carry");
    // Two processes, each with its own copy of the file: one is changed, the other not yet (a
    // rolling change).
    let changing = scratch.write("changing.yaml", POLICY);
    let lagging = scratch.write("lagging.yaml", POLICY);
    let start = |config| on_store(config, &redis.url(), &["--admin-token", "s3cret"]);
    let (a, b) = (start(&changing), start(&lagging));
    let spend = |server: &Server, cost: u64| {
        let body = format!(r#"{{"domain":"api","descriptors":[{{"user":"max"}}],"cost":{cost}}}"#);
        post_json(server.http, "/v1/check", &body)
    };
    assert_eq!(spend(&a, 45).status, 200);

    // 50 → 60 tokens: max keeps his 5 (the refill of one an hour adds nothing here), he is not
    // handed a fresh 60; one taken, 4 left.
    let grown = POLICY
        .replace("version: \"shared\"", "version: \"grown\"")
        .replace("capacity: 50", "capacity: 60");
    std::fs::write(&changing, grown).unwrap();
    let auth = [("Authorization", "Bearer s3cret")];
    let answer = request(a.http, "POST", "/v1/policy/reload", &auth, "");
    assert_eq!(answer.status, 200, "{}", answer.body);
    let answer = spend(&a, 1);
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.json()["policy_version"], "grown");
    assert_eq!(answer.json()["limits"][0]["capacity"], 60);
    let remaining = |answer: &support::Answer| answer.json()["limits"][0]["remaining"].clone();
    assert_eq!(remaining(&answer), 4, "{}", answer.body);

    // The lagging process spends 3 more under the old limit: the changed one counts them, as
    // if spent at the change (1 left after this take; 3 on its own).
    assert_eq!(spend(&b, 3).status, 200);
    let answer = spend(&a, 1);
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(remaining(&answer), 1, "{}", answer.body);
    assert_eq!(spend(&a, 2).status, 429);
    // A subject with no history starts with the new burst.
    let fresh = r#"{"domain":"api","descriptors":[{"user":"new"}],"cost":60}"#;
    assert_eq!(post_json(a.http, "/v1/check", fresh).status, 200);

    // An operator resets max: his bucket starts anew in Redis for both processes. The old
    // bucket the change carries over from goes too (else its 2 tokens would come back through
    // the carry), and so does the rejection the changed process remembers.
    let body = r#"{"domain":"api","descriptors":[{"user":"max"}]}"#;
    let answer = request(a.http, "POST", "/v1/reset", &auth, body);
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.json()["reset"][0]["bucket_key"], "shared-quota|max");
    assert_eq!(spend(&a, 60).status, 200);
    assert_eq!(
        spend(&b, 50).status,
        200,
        "the lagging process's bucket is new too"
    );
}

/// A limit the Lua scripts cannot keep exactly (a refill of 9 tokens every 7 ns) is refused at
/// start on Redis, and on a reload too: the file that brings it is refused as an invalid one
/// would be, with the limit named, and the version in force keeps deciding. The memory store
/// keeps any limit, so there the same file goes in force.
#[test]
fn a_reload_to_a_limit_redis_cannot_keep_is_refused_on_redis_only() {
    let redis = RedisServer::start();
    let scratch = Scratch::new("unkeepable");
    let on_redis = scratch.write("redis.yaml", POLICY);
    let on_memory = scratch.write("memory.yaml", POLICY);
    let token = ["--admin-token", "s3cret"];
    let redis_server = on_store(&on_redis, &redis.url(), &token);
    let memory_server = Server::start(&[&["--config", path_str(&on_memory)][..], &token].concat());
    let unkeepable = POLICY
        .replace("version: \"shared\"", "version: \"odd\"")
        .replace("refill: 1/h", "refill: 9/7ns");
    std::fs::write(&on_redis, &unkeepable).unwrap();
    std::fs::write(&on_memory, &unkeepable).unwrap();
    let auth = [("Authorization", "Bearer s3cret")];

    let answer = request(redis_server.http, "POST", "/v1/policy/reload", &auth, "");
    assert_eq!(answer.status, 422, "{}", answer.body);
    assert_eq!(answer.json()["error"]["code"], "policy_refused");
    let message = answer.json()["error"]["message"].to_string();
    assert!(
        message.contains("limit shared-quota: ")
            && message.contains("microseconds")
            && message.contains("version shared stays in force"),
        "{message}"
    );
    let check = r#"{"domain":"api","descriptors":[{"user":"kim"}]}"#;
    let answer = post_json(redis_server.http, "/v1/check", check);
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.json()["policy_version"], "shared");

    let answer = request(memory_server.http, "POST", "/v1/policy/reload", &auth, "");
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.json()["version"], "odd");
}

#[test]
fn redis_killed_under_closed_and_open_limits() {
    let mut redis = RedisServer::start();
    let scratch = Scratch::new("killed");
    let config = scratch.write("policy.yaml", POLICY);
    // A killed Redis refuses connections at once, whatever the timeout; a long one keeps a
    // busy host from turning the healthy first check into a timeout.
    let server = on_store(&config, &redis.url(), &[]);
    let strict = r#"{"domain":"strict","descriptors":[{"user":"quinn"}]}"#;
    let lenient = r#"{"domain":"lenient","descriptors":[{"user":"quinn"}]}"#;
    assert_eq!(post_json(server.http, "/v1/check", strict).status, 200);
    let breakers = || {
        let metrics = request(server.http, "GET", "/metrics", &[], "").body;
        metrics
            .lines()
            .find_map(|line| line.strip_prefix("tollgate_store_circuit_open "))
            .map(str::to_owned)
    };
    assert_eq!(breakers().as_deref(), Some("0"), "healthy");

    redis.kill();
    let mut lenient_allowed = 0;
    for _ in 0..20 {
        let answer = post_json(server.http, "/v1/check", strict);
        assert_eq!(answer.status, 503, "fails closed: {}", answer.body);
        assert_eq!(answer.json()["error"]["code"], "store_unavailable");
        let answer = post_json(server.http, "/v1/check", lenient);
        assert!(matches!(answer.status, 200 | 429), "{}", answer.body);
        assert_eq!(answer.json()["degraded"], true);
        lenient_allowed += usize::from(answer.status == 200);
    }
    assert_eq!(lenient_allowed, 3, "the emergency budget, never unlimited");
    // A shadow limit beside the enforced one is decided without the store too, but no client
    // is held to it: it is not counted as a degraded decision.
    let watched = r#"{"domain":"strict","descriptors":[{"user":"quinn","watched":"w"}]}"#;
    let answer = post_json(server.http, "/v1/check", watched);
    assert_eq!(answer.status, 503, "{}", answer.body);
    assert_eq!(answer.json()["limits"][1]["name"], "watched-shadow");
    // A shadow limit failing closed beside an enforced one failing open: the request is
    // decided by the enforced one's emergency budget, and the shadow one is counted as
    // unavailable, not as passed over.
    let shadowed = r#"{"domain":"lenient","descriptors":[{"user":"wendy","watched":"w"}]}"#;
    let answer = post_json(server.http, "/v1/check", shadowed);
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.json()["degraded"], true);
    let series = r#"tollgate_decisions_total{limit="lenient-shadow",result="unavailable",mode="shadow",api="http"}"#;
    assert_eq!(support::metric(&server, series), 1.0);
    // Forward-auth fails closed too, and says why.
    let headers = [("x-tollgate-user", "quinn")];
    let answer = request(server.http, "GET", "/v1/forward-auth/strict", &headers, "");
    assert_eq!(answer.status, 503, "{}", answer.body);
    assert_eq!(answer.body, "rate limiter store unavailable");
    // A cost the emergency budget can never hold is a rejection of that limit, with its real
    // figures: not a limit reported as allowed beside a made-up Retry-After.
    let big = r#"{"domain":"lenient","descriptors":[{"user":"big"}],"cost":5}"#;
    let answer = post_json(server.http, "/v1/check", big);
    assert_eq!(answer.status, 429, "{}", answer.body);
    assert_eq!(
        answer.json()["limits"][0]["allowed"],
        false,
        "{}",
        answer.body
    );
    let ready = support::request(server.http, "GET", "/readyz", &[], "");
    assert_eq!(ready.status, 503);
    // Gone, not slow: its port refuses connections, and the server says so.
    assert_eq!(ready.json()["store_error"], "connection", "{}", ready.body);
    // Left in its Service by a probe that leaves the store out, as the limits' failure modes
    // still answer.
    let serving = support::request(server.http, "GET", "/readyz?exclude=store", &[], "");
    assert_eq!(serving.status, 200, "{}", serving.body);
    assert_eq!(breakers().as_deref(), Some("1"), "the breaker is open");
    let metrics = support::request(server.http, "GET", "/metrics", &[], "").body;
    assert!(
        metrics.contains(r#"tollgate_store_errors_total{reason="connection"}"#),
        "{metrics}"
    );
    assert!(
        !metrics.contains(r#"tollgate_store_errors_total{reason="timeout"}"#),
        "a refused connection is not a timeout: {metrics}"
    );
    // One per enforced limit decided without the store: 20 strict checks, the shadowed one
    // and the forward-auth request failed closed, 21 lenient checks and the big one open.
    assert_eq!(degraded(&server, "closed"), 22.0, "{metrics}");
    assert_eq!(degraded(&server, "open"), 22.0, "{metrics}");
    // Decided without Redis, still timed as the Redis store's decisions.
    assert!(
        metrics.contains(r#"tollgate_decision_duration_seconds_count{api="http",store="redis"}"#),
        "{metrics}"
    );
}

/// The decisions `server` made without the store on limits failing `mode` (`open` or
/// `closed`), whatever the reason.
fn degraded(server: &Server, mode: &str) -> f64 {
    let label = format!("failure_mode=\"{mode}\"");
    support::metric_sum(server, "tollgate_degraded_decisions_total", &label)
}

fn descriptor(entries: &[(&str, &str)], hits: Option<u64>) -> RateLimitDescriptor {
    RateLimitDescriptor {
        hits_addend: hits.map(|value| UInt64Value { value }),
        ..support::descriptor(entries)
    }
}

/// The gRPC health service follows the store, as `/readyz` does: Envoy's health checker takes
/// an instance whose Redis is gone out of rotation, and a watcher hears of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_health_turns_not_serving_when_redis_dies() {
    let mut redis = RedisServer::start();
    let scratch = Scratch::new("health-down");
    let config = scratch.write("policy.yaml", POLICY);
    // Once Redis is killed, pings fail at once, whatever the timeout.
    let server = on_store(&config, &redis.url(), &[]);
    let channel = server.grpc_channel().await;
    let mut health = HealthClient::new(channel);
    let ask = || HealthCheckRequest {
        service: String::new(),
    };
    let status = health
        .check(ask())
        .await
        .expect("check")
        .into_inner()
        .status;
    assert_eq!(status, ServingStatus::Serving as i32);
    let mut watch = health.watch(ask()).await.expect("watch").into_inner();
    let first = watch
        .message()
        .await
        .expect("a first status")
        .map(|m| m.status);
    assert_eq!(first, Some(ServingStatus::Serving as i32));

    redis.kill();
    let status = health
        .check(ask())
        .await
        .expect("check")
        .into_inner()
        .status;
    assert_eq!(status, ServingStatus::NotServing as i32);
    let next = tokio::time::timeout(std::time::Duration::from_secs(10), watch.message())
        .await
        .expect("the watcher hears of it")
        .expect("a status")
        .map(|m| m.status);
    assert_eq!(next, Some(ServingStatus::NotServing as i32));
}

/// With Redis down, Envoy must get an explicit OVER_LIMIT for a closed limit, never a gRPC
/// error (which Envoy lets through unless `failure_mode_deny`), even beside a check-only
/// descriptor; and only the descriptors whose own limits failed closed are marked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rls_with_redis_down_fails_closed_descriptor_by_descriptor() {
    let mut redis = RedisServer::start();
    let scratch = Scratch::new("rls-down");
    let config = scratch.write("policy.yaml", POLICY);
    let server = Server::start(&["--config", path_str(&config), "--store", &redis.url()]);
    redis.kill();
    let mut client = RateLimitServiceClient::connect(format!("http://{}", server.grpc))
        .await
        .expect("connect to the gRPC port");
    let mut ask = async |domain: &str, descriptors| {
        let request = RateLimitRequest {
            domain: domain.to_owned(),
            descriptors,
            hits_addend: 1,
        };
        client
            .should_rate_limit(request)
            .await
            .unwrap_or_else(|status| panic!("a gRPC error lets Envoy allow it: {status:?}"))
            .into_inner()
    };
    let strict = ask(
        "strict",
        vec![
            descriptor(&[("user", "q")], None),
            descriptor(&[("user", "r")], Some(0)),
        ],
    )
    .await;
    assert_eq!(strict.overall_code, Code::OverLimit as i32);
    assert_eq!(strict.statuses[0].code, Code::OverLimit as i32);
    // Beside it, neither a descriptor no limit applies to nor one whose only limit is a shadow
    // one (which cannot be decided either) fails closed.
    for other in [("nothing", "matches"), ("watched", "w")] {
        let answer = ask(
            "strict",
            vec![
                descriptor(&[("user", "q")], None),
                descriptor(&[other], None),
            ],
        )
        .await;
        assert_eq!(answer.overall_code, Code::OverLimit as i32, "{other:?}");
        let codes: Vec<i32> = answer.statuses.iter().map(|s| s.code).collect();
        assert_eq!(
            codes,
            [Code::OverLimit as i32, Code::Ok as i32],
            "{other:?}"
        );
    }
    // Failing open, a check-only descriptor reports the emergency budget and passes.
    let lenient = ask("lenient", vec![descriptor(&[("user", "q")], Some(0))]).await;
    assert_eq!(lenient.overall_code, Code::Ok as i32);
}

/// Hits given back through one server go back to the Redis bucket both share; with Redis
/// down they are lost (under-admitting, a store error counted) while the rest of the call is
/// decided by each limit's failure mode, and they reach the emergency budget a degraded
/// check spent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rls_hits_given_back_are_shared_through_redis_and_lost_when_it_is_down() {
    let mut redis = RedisServer::start();
    let scratch = Scratch::new("rls-given-back");
    let config = scratch.write(
        "policy.yaml",
        r#"
limits:
  - {name: per-user, domain: api, key: [user], capacity: 3, refill: 1/h, failure_mode: open, emergency: 2/h}
"#,
    );
    let flags = ["--negative-hits", "give-back"];
    let (a, b) = (
        on_store(&config, &redis.url(), &flags),
        on_store(&config, &redis.url(), &flags),
    );
    let hits = |value: u64, given_back: bool| RateLimitDescriptor {
        is_negative_hits: given_back,
        ..descriptor(&[("user", "q")], Some(value))
    };
    let ask = async |server: &Server, descriptors: Vec<RateLimitDescriptor>| {
        let request = RateLimitRequest {
            domain: "api".to_owned(),
            descriptors,
            hits_addend: 0,
        };
        support::should_rate_limit(server, request)
            .await
            .unwrap_or_else(|status| panic!("{status:?}"))
    };
    let (ok, over) = (Code::Ok as i32, Code::OverLimit as i32);
    assert_eq!(
        support::statuses(&ask(&a, vec![hits(3, false)]).await),
        [(ok, 0)]
    );
    assert_eq!(ask(&b, vec![hits(1, false)]).await.overall_code, over);
    assert_eq!(
        support::statuses(&ask(&b, vec![hits(2, true)]).await),
        [(ok, 2)]
    );
    assert_eq!(
        support::statuses(&ask(&a, vec![hits(2, false)]).await),
        [(ok, 0)]
    );
    assert_eq!(ask(&a, vec![hits(1, false)]).await.overall_code, over);

    redis.kill();
    let errors = |server: &Server| -> f64 {
        [
            "timeout",
            "connection",
            "circuit_open",
            "protocol",
            "script",
        ]
        .iter()
        .map(|reason| {
            let label = format!("reason=\"{reason}\"");
            support::metric_sum(server, "tollgate_store_errors_total", &label)
        })
        .sum()
    };
    let before = errors(&a);
    // Lost, and the call still answers: its charge is decided by the emergency budget.
    let lost = ask(&a, vec![hits(1, true), hits(2, false)]).await;
    assert_eq!(lost.overall_code, ok, "{lost:?}");
    assert!(errors(&a) > before, "the lost hits are a store error");
    assert_eq!(ask(&a, vec![hits(1, false)]).await.overall_code, over);
    // Given back to the emergency budget too.
    assert_eq!(ask(&a, vec![hits(1, true)]).await.overall_code, ok);
    assert_eq!(ask(&a, vec![hits(1, false)]).await.overall_code, ok);
    assert_eq!(ask(&a, vec![hits(1, false)]).await.overall_code, over);
}

/// A limit sent with a descriptor (Envoy's `limit` action) is one bucket in Redis, shared by
/// every server exactly; one the scripts cannot keep exactly is refused before anything is
/// charged, as the policy's own limits are refused at load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_sent_with_a_descriptor_is_shared_through_redis() {
    let redis = RedisServer::start();
    let scratch = Scratch::new("rls-request-limit");
    let config = scratch.write("policy.yaml", support::REQUEST_LIMITS);
    let servers = [
        on_store(&config, &redis.url(), &[]),
        on_store(&config, &redis.url(), &[]),
    ];
    let asking = |requests_per_unit, unit| support::asking_for(Some((requests_per_unit, unit)));
    let (minute, year) = (2, 6);
    let mut allowed = 0;
    for i in 0..8 {
        let server = &servers[i % 2];
        let response = support::should_rate_limit(server, asking(5, minute))
            .await
            .unwrap_or_else(|status| panic!("{status:?}"));
        if response.overall_code == Code::Ok as i32 {
            allowed += 1;
        }
    }
    assert_eq!(allowed, 5, "five a minute, across both servers");
    let refused = support::should_rate_limit(&servers[0], asking(u32::MAX, year))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    assert!(
        refused.message().starts_with("descriptors[0].limit: "),
        "{refused:?}"
    );
}

#[test]
fn decides_through_a_redis_that_requires_tls_and_a_client_certificate() {
    let certificates = TestCertificates::generate("e2e");
    let redis = RedisServer::start_tls(&certificates, true);
    let scratch = Scratch::new("tls");
    let config = scratch.write("policy.yaml", POLICY);
    let tls = [
        "--store-tls-ca",
        path_str(&certificates.ca),
        "--store-tls-cert",
        path_str(&certificates.client_cert),
        "--store-tls-key",
        path_str(&certificates.client_key),
    ];
    let server = on_store(&config, &redis.tls_url(), &tls);
    let body = r#"{"domain":"api","descriptors":[{"user":"tls"}]}"#;
    let answer = post_json(server.http, "/v1/check", body);
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.json()["limits"][0]["remaining"], 49);
    let keys = command(redis.port, &["DBSIZE"]);
    assert_eq!(keys.as_deref(), Some(":1\r\n"));
}

#[test]
fn an_unreadable_tls_file_stops_the_start_with_its_name() {
    let stderr = serve_refused(&[
        "--store",
        "rediss://127.0.0.1:1",
        "--store-tls-ca",
        "/nonexistent/tollgate-ca.pem",
    ]);
    assert!(stderr.contains("/nonexistent/tollgate-ca.pem"), "{stderr}");
}

/// Two limits on the same subject, as the per-user and writes-per-user limits of the demo.
const SUBJECT_POLICY: &str = r#"
version: "subjects"
limits:
  - name: per-user
    domain: api
    key: [user]
    capacity: 10
    refill: 1/h
  - name: writes-per-user
    domain: api
    key: [user]
    capacity: 3
    refill: 1/h
"#;

#[test]
fn on_a_cluster_the_buckets_of_one_subject_share_a_slot() {
    let cluster = RedisCluster::start();
    let scratch = Scratch::new("cluster");
    let config = scratch.write("policy.yaml", SUBJECT_POLICY);
    let server = on_store(&config, &cluster.url(), &[]);
    let users = ["ann", "bob", "cy", "dee", "eve", "fay"];
    for user in users {
        let body = format!(r#"{{"domain":"api","descriptors":[{{"user":"{user}"}}]}}"#);
        let answer = post_json(server.http, "/v1/check", &body);
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert_eq!(answer.json()["limits"].as_array().map(Vec::len), Some(2));
    }
    let integer = |port: u16, args: &[&str]| -> i64 {
        command(port, args)
            .and_then(|reply| reply.trim().trim_start_matches(':').parse().ok())
            .unwrap_or(-1)
    };
    let mut nodes_used = std::collections::BTreeSet::new();
    for user in users {
        // The slot of the user's hash tag holds both of its buckets, on whichever node owns it.
        let slot = integer(cluster.nodes[0].port, &["CLUSTER", "KEYSLOT", user]).to_string();
        let counts: Vec<i64> = cluster
            .nodes
            .iter()
            .map(|node| integer(node.port, &["CLUSTER", "COUNTKEYSINSLOT", &slot]))
            .collect();
        assert_eq!(counts.iter().sum::<i64>(), 2, "{user}: {counts:?}");
        nodes_used.insert(counts.iter().position(|&count| count == 2));
    }
    // Subjects spread over the cluster rather than sharing one slot.
    assert!(nodes_used.len() >= 2, "{nodes_used:?}");
}

/// A process whose cluster does not answer at the start (started with it, say) serves anyway:
/// not ready, its limits on their failure modes. It used to exit, to be restarted with ever
/// longer pauses by its supervisor.
#[test]
fn a_cluster_that_does_not_answer_at_the_start_leaves_the_server_unready() {
    let port = free_port();
    let scratch = Scratch::new("silent-cluster");
    let config = scratch.write("policy.yaml", POLICY);
    let url = format!("redis+cluster://127.0.0.1:{port}");
    let server = on_store(&config, &url, &[]);
    let ready = request(server.http, "GET", "/readyz", &[], "");
    assert_eq!(ready.status, 503, "{}", ready.body);
    let strict = r#"{"domain":"strict","descriptors":[{"user":"quinn"}]}"#;
    let answer = post_json(server.http, "/v1/check", strict);
    assert_eq!(answer.status, 503, "{}", answer.body);
    assert_eq!(answer.json()["error"]["code"], "store_unavailable");
    let lenient = r#"{"domain":"lenient","descriptors":[{"user":"quinn"}]}"#;
    let answer = post_json(server.http, "/v1/check", lenient);
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.json()["degraded"], true);
}

/// Through Redis Sentinel: the server decides on the master the sentinel names, and two
/// servers share its quota.
#[test]
fn decides_on_the_master_a_sentinel_names() {
    let sentinel = RedisSentinel::start();
    let scratch = Scratch::new("sentinel");
    let config = scratch.write("policy.yaml", POLICY);
    let a = on_store(&config, &sentinel.url(), &[]);
    let b = on_store(&config, &sentinel.url(), &[]);
    let body = r#"{"domain":"api","descriptors":[{"user":"sam"}],"cost":20}"#;
    assert_eq!(post_json(a.http, "/v1/check", body).status, 200);
    assert_eq!(post_json(b.http, "/v1/check", body).status, 200);
    let answer = post_json(a.http, "/v1/check", body);
    assert_eq!(answer.status, 429, "50 shared, 40 taken: {}", answer.body);
    let stored = command(sentinel.master.port, &["DBSIZE"]).unwrap_or_default();
    assert_eq!(stored.trim(), ":1", "the bucket is on the master");
    let ready = request(a.http, "GET", "/readyz", &[], "");
    assert_eq!(ready.status, 200, "{}", ready.body);
}

#[test]
fn a_sentinel_password_without_a_sentinel_store_is_refused() {
    let message = serve_refused(&[
        "--store",
        "redis://127.0.0.1:6399",
        "--store-sentinel-password",
        "x",
    ]);
    assert!(message.contains("redis+sentinel://"), "{message}");
}

const LEASES: &str = r#"
version: "leases"
limits:
  - name: shared-slots
    domain: api
    key: [tenant]
    algorithm: concurrency
    max_in_flight: 3
    lease_timeout: 1h
  - name: closed-slots
    domain: strict
    key: [tenant]
    algorithm: concurrency
    max_in_flight: 10
    lease_timeout: 1h
    failure_mode: closed
  - name: open-slots
    domain: lenient
    key: [tenant]
    algorithm: concurrency
    max_in_flight: 10
    lease_timeout: 1h
    failure_mode: open
    emergency: 2
  - name: watched-slots
    domain: lenient
    key: [tenant]
    algorithm: concurrency
    max_in_flight: 10
    lease_timeout: 1h
    mode: shadow
"#;

fn lease_body(domain: &str, tenant: &str) -> String {
    format!(r#"{{"domain":"{domain}","descriptors":[{{"tenant":"{tenant}"}}]}}"#)
}

#[test]
fn two_servers_share_concurrency_slots_and_release_each_others_leases() {
    let redis = RedisServer::start();
    let scratch = Scratch::new("shared-leases");
    let config = scratch.write("policy.yaml", LEASES);
    let servers = [
        on_store(&config, &redis.url(), &[]),
        on_store(&config, &redis.url(), &[]),
    ];
    let body = lease_body("api", "acme");
    let mut held = Vec::new();
    for attempt in 0..6 {
        let answer = post_json(servers[attempt % 2].http, "/v1/leases", &body);
        assert!(matches!(answer.status, 200 | 429), "{}", answer.body);
        if answer.status == 200 {
            held.push(answer.json()["lease_id"].as_str().unwrap().to_owned());
        }
    }
    assert_eq!(held.len(), 3, "three slots over both servers");
    // Either server explains the store's count, and holds nothing doing it.
    for server in servers.iter().chain(&servers) {
        let explained = post_json(server.http, "/v1/leases/explain", &body);
        assert_eq!(explained.status, 200, "{}", explained.body);
        assert_eq!(explained.json()["allowed"], false);
        assert_eq!(explained.json()["limits"][0]["in_flight"], 3);
    }
    // Renewed through either server: the lease is the store's, not a process's.
    for server in &servers {
        let renewed = post_json(server.http, &format!("/v1/leases/{}/renew", held[1]), "");
        assert_eq!(renewed.status, 200, "{}", renewed.body);
        let left = renewed.json()["expires_after_ms"].as_u64().unwrap();
        assert!((3_590_000..=3_600_000).contains(&left), "{left}");
    }
    // A lease taken through one server is given back through the other.
    let released = request(
        servers[1].http,
        "DELETE",
        &format!("/v1/leases/{}", held[0]),
        &[],
        "",
    );
    assert_eq!(released.status, 204, "{}", released.body);
    let again = post_json(servers[0].http, "/v1/leases", &body);
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(again.json()["limits"][0]["in_flight"], 3);
    assert_eq!(post_json(servers[1].http, "/v1/leases", &body).status, 429);

    // A retry carrying the first attempt's request id finds its lease through either server.
    let retried = r#"{"domain":"api","descriptors":[{"tenant":"initech"}],"request_id":"5d1e-r"}"#;
    let first = post_json(servers[0].http, "/v1/leases", retried);
    assert_eq!(first.status, 200, "{}", first.body);
    let second = post_json(servers[1].http, "/v1/leases", retried);
    assert_eq!(second.status, 200, "{}", second.body);
    assert_eq!(second.json()["lease_id"], first.json()["lease_id"]);
    assert_eq!(second.json()["repeated"], true);
    assert_eq!(second.json()["limits"][0]["in_flight"], 1);
}

#[test]
fn redis_killed_under_concurrency_limits() {
    let mut redis = RedisServer::start();
    let scratch = Scratch::new("killed-leases");
    let config = scratch.write("policy.yaml", LEASES);
    let server = on_store(&config, &redis.url(), &[]);
    assert_eq!(
        post_json(server.http, "/v1/leases", &lease_body("strict", "t")).status,
        200
    );
    redis.kill();
    for _ in 0..5 {
        let answer = post_json(server.http, "/v1/leases", &lease_body("strict", "t"));
        assert_eq!(answer.status, 503, "fails closed: {}", answer.body);
        assert_eq!(answer.json()["error"]["code"], "store_unavailable");
        assert_eq!(
            answer.json()["limits"][0]["allowed"],
            false,
            "{}",
            answer.body
        );
    }
    // Open: a per-process table of `emergency` slots, never unlimited; its leases are given
    // back here too.
    let mut emergency = Vec::new();
    for _ in 0..5 {
        let answer = post_json(server.http, "/v1/leases", &lease_body("lenient", "t"));
        assert!(matches!(answer.status, 200 | 429), "{}", answer.body);
        assert_eq!(answer.json()["degraded"], true, "{}", answer.body);
        if answer.status == 200 {
            emergency.push(answer.json()["lease_id"].as_str().unwrap().to_owned());
        }
    }
    assert_eq!(emergency.len(), 2, "the emergency bound");
    let released = request(
        server.http,
        "DELETE",
        &format!("/v1/leases/{}", emergency[0]),
        &[],
        "",
    );
    assert_eq!(released.status, 204, "{}", released.body);
    assert_eq!(
        post_json(server.http, "/v1/leases", &lease_body("lenient", "t")).status,
        200
    );
    // A lease the store holds cannot be given back while it is down: 503, and it times out.
    let unknown = request(
        server.http,
        "DELETE",
        "/v1/leases/0123456789abcdef0123456789abcdef",
        &[],
        "",
    );
    assert_eq!(unknown.status, 503, "{}", unknown.body);
    // Nor can the store's count be explained.
    let explained = post_json(
        server.http,
        "/v1/leases/explain",
        &lease_body("strict", "t"),
    );
    assert_eq!(explained.status, 503, "{}", explained.body);
    assert_eq!(explained.json()["error"]["code"], "store_unavailable");
    // One per enforced limit of each lease request decided without the store: 5 strict ones
    // failed closed, 6 lenient ones open (their shadow limit is not counted, nor are an
    // explanation or a release, which decide nothing).
    assert_eq!(degraded(&server, "closed"), 5.0);
    assert_eq!(degraded(&server, "open"), 6.0);
}

/// While Redis is down, leases failing open are held in this process's table, bounded by
/// `--max-leases`: a full table is the server's limit, answered 503 `lease_table_full`, not a
/// caller's bad request.
#[test]
fn a_full_emergency_lease_table_is_not_the_callers_fault() {
    let mut redis = RedisServer::start();
    let scratch = Scratch::new("full-emergency-leases");
    let config = scratch.write("policy.yaml", LEASES);
    let server = on_store(&config, &redis.url(), &["--max-leases", "1"]);
    // Held in Redis, not in the process's table.
    for tenant in ["a", "b"] {
        let answer = post_json(server.http, "/v1/leases", &lease_body("lenient", tenant));
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
    redis.kill();
    let answer = post_json(server.http, "/v1/leases", &lease_body("lenient", "c"));
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.json()["degraded"], true);
    let full = post_json(server.http, "/v1/leases", &lease_body("lenient", "d"));
    assert_eq!(full.status, 503, "{}", full.body);
    assert_eq!(full.json()["error"]["code"], "lease_table_full");
    let invalid = r#"tollgate_invalid_requests_total{api="leases"}"#;
    assert_eq!(support::metric(&server, invalid), 0.0);
}

/// Envoys on RLQS through two tollgate processes on one Redis: every assignment is paid in the
/// shared bucket before it is sent, and what replacements leave unspendable is given back, so
/// together they are never sent more than the limit allows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rlqs_envoys_on_two_servers_share_a_quota() {
    use support::rlqs::{Admissions, Envoy, assigned, reports, usage};
    use tokio::sync::watch;
    use tollgate::{Clock, MonotonicClock};

    let redis = RedisServer::start();
    let scratch = Scratch::new("rlqs-shared");
    let config = scratch.write(
        "policy.yaml",
        "limits: [{name: pool, domain: edge, key: [pool], capacity: 60, refill: 20/s}]",
    );
    let servers = [
        on_store(&config, &redis.url(), &[]),
        on_store(&config, &redis.url(), &[]),
    ];
    let clock = MonotonicClock::new();
    let start = clock.now();
    // Each Envoy reports every tenth of a second while a task takes its answers as they come,
    // each counted from when it arrived: a report whose assignment the bucket cannot extend
    // just then is answered later (at a renewal or the next report), or not at all.
    let (stop, stopped) = watch::channel(false);
    let mut senders = Vec::new();
    let mut listeners = Vec::new();
    for index in 0..4u32 {
        let (sender, mut answers) = Envoy::connect(&servers[index as usize % 2]).await.split();
        senders.push(sender);
        let (clock, mut stopped) = (clock.clone(), stopped.clone());
        listeners.push(tokio::spawn(async move {
            let mut received = Vec::new();
            loop {
                let message = tokio::select! {
                    _ = stopped.changed() => break,
                    message = answers.message() => message.expect("no error"),
                };
                let Some(message) = message else { break };
                for action in message.bucket_action {
                    let action = assigned(action.bucket_action.expect("an action"));
                    received.push((index, clock.now(), action));
                }
            }
            received
        }));
    }
    let tenth = std::time::Duration::from_millis(100);
    for round in 0u64..25 {
        for (index, sender) in senders.iter().enumerate() {
            let demand = 30 + 30 * index as u64 + round % 5 * 10;
            let usage = usage(&[("pool", "p")], demand, demand, tenth);
            sender
                .send(reports("edge", vec![usage]))
                .expect("the stream is open");
        }
        tokio::time::sleep(tenth).await;
    }
    // The last reports' answers.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let _ = stop.send(true);
    let mut admissions = Admissions::default();
    let mut answered = start;
    for listener in listeners {
        for (index, at, action) in listener.await.expect("the listener") {
            answered = answered.max(at);
            admissions.receive(index, at, action);
        }
    }
    for envoy in 0..4 {
        admissions.close(envoy, answered + std::time::Duration::from_secs(120));
    }
    admissions.assert_within(60.0, 20.0, answered.saturating_duration_since(start));
    // Both processes charged, and gave back, through Redis.
    for server in &servers {
        assert!(metric(server, "tollgate_rlqs_prepaid_tokens_total") > 0.0);
    }
    let given_back: f64 = servers
        .iter()
        .map(|server| metric(server, "tollgate_rlqs_given_back_tokens_total"))
        .sum();
    assert!(given_back > 0.0, "replacements gave nothing back");
}

/// Envoys of one bucket on two tollgate processes share its refill fairly: each process
/// posts its Envoys' wants on the store's board and sizes them by its share among the
/// processes. Without that, an Envoy on the first process holds all it took by extending it,
/// and one on the second gets what is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rlqs_envoys_on_two_servers_get_fair_shares() {
    use support::rlqs::{Admissions, Assigned, Envoy, assigned, usage};
    use tollgate::{Clock, MonotonicClock};

    let redis = RedisServer::start();
    let scratch = Scratch::new("rlqs-fair");
    let config = scratch.write(
        "policy.yaml",
        "limits: [{name: pool, domain: edge, key: [pool], capacity: 40, refill: 20/s}]",
    );
    let servers = [
        on_store(&config, &redis.url(), &[]),
        on_store(&config, &redis.url(), &[]),
    ];
    let fifth = std::time::Duration::from_millis(200);
    // Each Envoy sees 40 requests every 200 ms: far more than the 20 a second refilled.
    let busy = || vec![usage(&[("pool", "p")], 40, 0, fifth)];
    let rate = |action| match assigned(action) {
        Assigned::Tokens { rate, .. } => rate,
        _ => 0,
    };
    let clock = MonotonicClock::new();
    let start = clock.now();
    let mut admissions = Admissions::default();
    let mut first = Envoy::connect(&servers[0]).await;
    let mut alone = 0;
    for _ in 0..6 {
        let action = first.report("edge", busy()).await.remove(0);
        let at = clock.now();
        alone = rate(action);
        admissions.receive(0, at, assigned(action));
        tokio::time::sleep(fifth).await;
    }
    // Alone, it gets all a bucket of 40 can pay for 2 s ahead: 13 a second.
    assert_eq!(alone, 13);
    let mut second = Envoy::connect(&servers[1]).await;
    let mut rates = Vec::new();
    let mut answered = start;
    for _ in 0..20 {
        for (index, envoy) in [&mut first, &mut second].into_iter().enumerate() {
            let action = envoy.report("edge", busy()).await.remove(0);
            answered = clock.now();
            rates.push((index, rate(action)));
            admissions.receive(index as u32, answered, assigned(action));
        }
        tokio::time::sleep(fifth).await;
    }
    eprintln!("rates (Envoy, tokens a second): {rates:?}");
    let charges: f64 = servers
        .iter()
        .map(|server| {
            metric(server, r#"tollgate_decisions_total{limit="pool",result="allowed",mode="enforce",api="rlqs"}"#)
                + metric(server, r#"tollgate_decisions_total{limit="pool",result="rejected",mode="enforce",api="rlqs"}"#)
        })
        .sum();
    eprintln!("{charges} charges tried for {} reports", 6 + rates.len());
    // Once the processes have read each other's wants, the first Envoy's share is half.
    let late: Vec<u32> = rates[rates.len() - 10..]
        .iter()
        .filter(|(index, _)| *index == 0)
        .map(|&(_, rate)| rate)
        .collect();
    assert!(late.iter().all(|&rate| rate <= 10), "{rates:?}");
    assert!(
        rates.iter().any(|&(index, rate)| index == 1 && rate > 0),
        "{rates:?}"
    );
    for envoy in 0..2 {
        admissions.close(envoy, answered + std::time::Duration::from_secs(120));
    }
    admissions.assert_within(40.0, 20.0, answered.saturating_duration_since(start));
}

/// Envoys reporting once a minute through two tollgate processes on one Redis, on a limit
/// whose capacity cannot pay for a minute's time-to-live: each process renews its own
/// Envoys' assignments, paid in the shared bucket, and together they stay within the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rlqs_renewals_on_two_servers_share_a_quota() {
    let redis = RedisServer::start();
    let scratch = Scratch::new("rlqs-renewals");
    let config = scratch.write(
        "policy.yaml",
        "limits: [{name: small, domain: edge, key: [client], capacity: 10, refill: 10/s}]",
    );
    let servers = [
        on_store(&config, &redis.url(), &[]),
        on_store(&config, &redis.url(), &[]),
    ];
    let envoys = [&servers[0], &servers[1], &servers[0], &servers[1]];
    let (admissions, lasted) = support::rlqs::slow_envoys(
        &envoys,
        &[("client", "shared")],
        std::time::Duration::from_secs(3),
    )
    .await;
    admissions.assert_within(10.0, 10.0, lasted);
    for server in &servers {
        assert!(metric(server, "tollgate_rlqs_renewed_total") > 0.0);
    }
}

/// RLQS while Redis is down: a limit failing closed denies its buckets (renewed until it is back);
/// one failing open pays assignments from its emergency budget, never more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rlqs_with_redis_killed_follows_each_limits_failure_mode() {
    use support::rlqs::{Assigned, Envoy, assigned, usage};

    let mut redis = RedisServer::start();
    let scratch = Scratch::new("rlqs-killed");
    let config = scratch.write("policy.yaml", POLICY);
    let server = on_store(&config, &redis.url(), &[]);
    let mut envoy = Envoy::connect(&server).await;
    let second = std::time::Duration::from_secs(1);
    let report = |domain: &str| vec![usage(&[("user", domain)], 50, 0, second)];
    assert!(matches!(
        assigned(envoy.report("strict", report("a")).await.remove(0)),
        Assigned::Tokens { .. }
    ));
    redis.kill();
    assert!(matches!(
        assigned(envoy.report("strict", report("a")).await.remove(0)),
        Assigned::Deny(_)
    ));
    drop(envoy);
    // The open limit's emergency budget holds 3 (3/h): a rate of one token a second for the
    // two-second time-to-live costs all three; the next report finds it empty.
    let mut envoy = Envoy::connect(&server).await;
    let first = assigned(envoy.report("lenient", report("b")).await.remove(0));
    assert!(
        matches!(first, Assigned::Tokens { rate: 1, .. }),
        "{first:?}"
    );
    let second_answer = assigned(envoy.report("lenient", report("b")).await.remove(0));
    assert!(
        matches!(second_answer, Assigned::Deny(_)),
        "{second_answer:?}"
    );
}

/// RLQS wants that cannot be posted on the board are said once while Redis stays down, not
/// every second, and said again after posts have succeeded in between.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rlqs_board_failures_are_logged_once_per_outage() {
    use std::time::Duration;

    use support::rlqs::{Envoy, usage};

    let mut redis = RedisServer::start();
    let scratch = Scratch::new("rlqs-board-down");
    let config = scratch.write("policy.yaml", POLICY);
    let url = redis.url();
    let args = [
        "--config",
        path_str(&config),
        "--store",
        &url,
        "--store-timeout",
        "2s",
    ];
    let (server, logs) = Server::start_logging(&args, "warn");
    // The stream's want of its bucket is posted every second while the stream lasts.
    let mut envoy = Envoy::connect(&server).await;
    let report = vec![usage(&[("user", "w")], 5, 0, Duration::from_secs(1))];
    envoy.report("lenient", report).await;
    for _ in 0..2 {
        redis.kill();
        // Three rounds of posts fail.
        tokio::time::sleep(Duration::from_millis(3_500)).await;
        redis.restart();
        // The restarted Redis is empty until a post lands on it.
        let mut posted = false;
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            posted = command(redis.port, &["DBSIZE"]).is_some_and(|size| size != ":0\r\n");
            if posted {
                break;
            }
        }
        assert!(posted, "no post on the restarted Redis within 10 s");
    }
    drop(envoy);
    let logs = server.terminate_and_read(logs);
    let said = logs
        .matches("RLQS wants could not be posted on the store's board")
        .count();
    assert_eq!(said, 2, "{logs}");
}

/// The fleet's incident switch: set through one server, kept in the shared Redis, read by
/// every server within a second or two; each server's own switch stays its own; a store
/// that cannot be written refuses the change, and a store that cannot be read leaves the
/// switch as last read.
#[test]
fn the_fleets_switch_reaches_every_server_on_the_store() {
    let mut redis = RedisServer::start();
    let scratch = Scratch::new("fleet-switch");
    let config = scratch.write("policy.yaml", POLICY);
    let servers = [
        on_store(&config, &redis.url(), &[]),
        on_store(&config, &redis.url(), &[]),
    ];
    let json = [("Content-Type", "application/json")];
    let switch = |server: &Server, body: &str| {
        request(server.http, "POST", "/v1/policy/shadow-all", &json, body)
    };
    let shadowed = |server: &Server| {
        let status = request(server.http, "GET", "/v1/policy", &[], "").json();
        status["shadow_all"].clone()
    };
    let check = |server: &Server| {
        let body = r#"{"domain":"api","descriptors":[{"user":"fleet"}]}"#;
        post_json(server.http, "/v1/check", body).status
    };
    for _ in 0..50 {
        assert_eq!(check(&servers[0]), 200);
    }
    assert_eq!([check(&servers[0]), check(&servers[1])], [429, 429]);

    let on = r#"{"on":true,"reason":"INC-42: fleet-wide","fleet":true}"#;
    let answer = switch(&servers[0], on);
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.json()["shadow_all"]["fleet"], true);
    let seen = support::wait_for("the other server to read the switch", || {
        let state = shadowed(&servers[1]);
        state.is_object().then_some(state)
    });
    assert_eq!(
        (&seen["reason"], &seen["fleet"]),
        (&"INC-42: fleet-wide".into(), &true.into())
    );
    assert_eq!([check(&servers[0]), check(&servers[1])], [200, 200]);
    assert_eq!(metric(&servers[1], "tollgate_shadow_all"), 1.0);

    // A server's own switch turned off leaves the fleet's in force.
    let local_off = switch(&servers[1], r#"{"on":false}"#);
    assert_eq!(local_off.status, 200, "{}", local_off.body);
    assert_eq!(check(&servers[1]), 200);

    // Off through the other server: both enforce again.
    let off = switch(&servers[1], r#"{"on":false,"fleet":true}"#);
    assert_eq!(off.status, 200, "{}", off.body);
    support::wait_for("the first server to read the switch off", || {
        shadowed(&servers[0]).is_null().then_some(())
    });
    assert_eq!([check(&servers[0]), check(&servers[1])], [429, 429]);

    // Narrowed to another domain than the one rejecting: every server reads the narrowing,
    // and still rejects.
    let narrow = r#"{"on":true,"reason":"INC-43","fleet":true,"domains":["strict"],"limits":["open-limit"]}"#;
    assert_eq!(switch(&servers[0], narrow).status, 200);
    let seen = support::wait_for("the other server to read the narrowed switch", || {
        let state = shadowed(&servers[1]);
        state.is_object().then_some(state)
    });
    assert_eq!(seen["domains"], serde_json::json!(["strict"]), "{seen}");
    assert_eq!(seen["limits"], serde_json::json!(["open-limit"]), "{seen}");
    assert_eq!([check(&servers[0]), check(&servers[1])], [429, 429]);
    assert_eq!(
        switch(&servers[1], r#"{"on":false,"fleet":true}"#).status,
        200
    );
    support::wait_for("the first server to read the narrowed switch off", || {
        shadowed(&servers[0]).is_null().then_some(())
    });

    // Turned on again, then Redis dies: a switch that cannot be written is refused, and the
    // one last read stays in force.
    assert_eq!(switch(&servers[0], on).status, 200);
    support::wait_for("the second server to read the switch on", || {
        shadowed(&servers[1]).is_object().then_some(())
    });
    redis.kill();
    let refused = switch(&servers[0], r#"{"on":false,"fleet":true}"#);
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert_eq!(refused.json()["error"]["code"], "store_unavailable");
    // Nothing to wait for but the server's own reads: two of them fail meanwhile.
    #[allow(clippy::disallowed_methods)]
    std::thread::sleep(two_reads());
    assert!(shadowed(&servers[1]).is_object(), "kept as last read");
}

/// Long enough for a server to try reading the fleet's switch twice (it reads every second).
fn two_reads() -> Duration {
    tollgate_server::decider::FLEET_SWITCH_EVERY * 5 / 2
}

/// On the memory store no other process reads the switch: the fleet's is refused, clearly.
#[test]
fn the_fleets_switch_needs_a_shared_store() {
    let server = Server::start(&[]);
    let json = [("Content-Type", "application/json")];
    let body = r#"{"on":true,"reason":"INC-42","fleet":true}"#;
    let answer = request(server.http, "POST", "/v1/policy/shadow-all", &json, body);
    assert_eq!(answer.status, 409, "{}", answer.body);
    assert_eq!(answer.json()["error"]["code"], "no_shared_store");
    let status = request(server.http, "GET", "/v1/policy", &[], "").json();
    assert_eq!(status["shadow_all"], serde_json::Value::Null);
}
