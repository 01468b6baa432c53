//! `tollgate bench` against a server in this process, on loopback: every request is counted
//! once, and the demo policy's limit shows up as rejections over HTTP (1.1 and 2) and gRPC.
//!
//! Bounded by request count (a few hundred), never by wall time; no assertion on speed.

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::http::StatusCode;
use clap::Parser;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tollgate_policy::{EngineOptions, PolicyEngine, compile};
use tollgate_server::cli::DEMO_POLICY;
use tollgate_server::loadgen::{BenchArgs, BenchError, Summary, run};
use tollgate_server::{AppState, Backend, Decider, HttpOptions};

/// The demo policy's per-user burst and refill per second.
const CAPACITY: u64 = 10;
const REFILL_PER_S: f64 = 5.0;

/// A server on free loopback ports, stopped on drop.
struct Server {
    http: SocketAddr,
    grpc: SocketAddr,
    _stop: oneshot::Sender<()>,
}

async fn start() -> Server {
    start_denying_with(StatusCode::TOO_MANY_REQUESTS).await
}

/// A server whose forward-auth answers `deny` to a rejected request.
async fn start_denying_with(deny: StatusCode) -> Server {
    let policy = compile("demo", DEMO_POLICY).expect("demo policy compiles");
    let engine = Arc::new(PolicyEngine::new(policy, EngineOptions::default()));
    let decider = Arc::new(Decider::new(engine, Backend::Memory));
    let options = HttpOptions {
        admin_token: None,
        forward_auth_headers: Vec::new(),
        forward_auth_deny: deny,
        forward_auth_address: None,
        rate_limit_headers: tollgate_tower::HeaderStyle::Ietf,
        negative_hits: tollgate_server::http::NegativeHits::Refuse,
    };
    let state = Arc::new(AppState::new(decider, None, options));
    let http = TcpListener::bind("127.0.0.1:0").await.expect("bind http");
    let grpc = TcpListener::bind("127.0.0.1:0").await.expect("bind grpc");
    let (http_addr, grpc_addr) = (
        http.local_addr().expect("http addr"),
        grpc.local_addr().expect("grpc addr"),
    );
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(tollgate_server::run(state, http, grpc, async move {
        let _ = stopped.await;
    }));
    Server {
        http: http_addr,
        grpc: grpc_addr,
        _stop: stop,
    }
}

/// 200 requests from 4 workers over 2 keys: the demo limit both admits and rejects.
const TWO_KEYS: [&str; 6] = ["--requests", "200", "--keys", "2", "-c", "4"];

async fn bench(args: &[&str]) -> Result<Summary, BenchError> {
    let args = BenchArgs::try_parse_from(std::iter::once("bench").chain(args.iter().copied()))
        .expect("flags parse");
    run(&args).await
}

/// Every request counted once, none failed, and the demo limit both admitted and rejected
/// without admitting more than its burst plus refill over the run.
fn assert_limited(summary: &Summary, requests: u64, keys: u64) {
    assert_eq!(
        summary.allowed + summary.rejected + summary.errors,
        requests,
        "{summary:?}"
    );
    assert_eq!(summary.requests, requests);
    assert_eq!(summary.errors, 0, "{:?}", summary.first_error);
    assert!(summary.rejected > 0, "no rejection: {summary:?}");
    assert!(summary.allowed >= CAPACITY, "{summary:?}");
    let most = keys as f64 * (CAPACITY as f64 + REFILL_PER_S * summary.elapsed_s) + 1.0;
    assert!(
        summary.allowed as f64 <= most,
        "over-admission: {summary:?}"
    );
    assert!(summary.latency_us.p50 > 0.0 && summary.latency_us.p99 >= summary.latency_us.p50);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_counts_add_up_and_the_demo_limit_rejects() {
    let server = start().await;
    let target = format!("http://{}", server.http);
    let summary = bench(&[&["--target", &target][..], &TWO_KEYS].concat())
        .await
        .expect("bench runs");
    assert_eq!(summary.api, "http");
    assert_limited(&summary, 200, 2);
    assert!(
        summary.schedule_lag_us.is_none() && summary.service_us.is_none(),
        "closed loop has no schedule"
    );
}

/// As nginx's auth_request sends them, against a server denying with 403 for nginx.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forward_auth_counts_add_up_and_the_demo_limit_rejects() {
    let server = start_denying_with(StatusCode::FORBIDDEN).await;
    let target = format!("http://{}", server.http);
    let summary = bench(&[&["--target", &target, "--forward-auth"][..], &TWO_KEYS].concat())
        .await
        .expect("bench runs");
    assert_eq!(summary.api, "forward-auth");
    assert!(
        summary.target.ends_with("/v1/forward-auth/api"),
        "{}",
        summary.target
    );
    assert_limited(&summary, 200, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_counts_add_up_and_the_demo_limit_rejects() {
    let server = start().await;
    let target = server.grpc.to_string();
    let summary = bench(
        &[
            &["--grpc", &target, "--distribution", "zipf"][..],
            &TWO_KEYS,
        ]
        .concat(),
    )
    .await
    .expect("bench runs");
    assert_eq!(summary.api, "grpc");
    assert_limited(&summary, 200, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_multiplexed_over_shared_connections_all_count() {
    let server = start().await;
    let (target, accepted) = counting_proxy(server.grpc).await;
    let target = target.to_string();
    let summary = bench(&[
        "--grpc",
        &target,
        "--requests",
        "200",
        "--keys",
        "2",
        "-c",
        "8",
        "--connections",
        "2",
    ])
    .await
    .expect("bench runs");
    assert_eq!((summary.concurrency, summary.connections), (8, 2));
    assert_eq!(accepted.load(Ordering::Relaxed), 2, "connections opened");
    assert_limited(&summary, 200, 2);
}

/// Checks and forward-auth subrequests as HTTP/2 streams, the workers sharing connections
/// when asked, as proxies that keep HTTP/2 to their upstreams send them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_requests_multiplexed_over_shared_connections_all_count() {
    let server = start().await;
    let (target, accepted) = counting_proxy(server.http).await;
    let target = format!("http://{target}");
    let shared = ["--http2", "-c", "8", "--connections", "2"];
    let two_keys = ["--requests", "200", "--keys", "2"];
    let summary = bench(&[&["--target", &target][..], &two_keys, &shared].concat())
        .await
        .expect("bench runs");
    assert_eq!((summary.api, summary.protocol), ("http", "HTTP/2"));
    assert_eq!((summary.concurrency, summary.connections), (8, 2));
    assert_eq!(accepted.load(Ordering::Relaxed), 2, "connections opened");
    assert_limited(&summary, 200, 2);

    let forward_auth = start_denying_with(StatusCode::FORBIDDEN).await;
    let target = format!("http://{}", forward_auth.http);
    let summary = bench(
        &[
            &["--target", &target, "--forward-auth", "--http2"][..],
            &TWO_KEYS,
        ]
        .concat(),
    )
    .await
    .expect("bench runs");
    assert_eq!((summary.api, summary.protocol), ("forward-auth", "HTTP/2"));
    assert_limited(&summary, 200, 2);
}

/// A loopback proxy to `upstream` that counts the connections it accepts.
async fn counting_proxy(upstream: SocketAddr) -> (SocketAddr, Arc<AtomicUsize>) {
    proxy(upstream, false).await
}

/// A loopback proxy to `upstream` that counts the connections it accepts; with `silent_first`
/// the first is held open and never forwarded, as a peer that stopped answering.
async fn proxy(upstream: SocketAddr, silent_first: bool) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
    let addr = listener.local_addr().expect("proxy addr");
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&accepted);
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            if counter.fetch_add(1, Ordering::Relaxed) == 0 && silent_first {
                tokio::spawn(async move {
                    let _held = inbound;
                    std::future::pending::<()>().await;
                });
                continue;
            }
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(upstream).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    (addr, accepted)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_noop_endpoint_allows_everything() {
    let server = start().await;
    let target = format!("http://{}", server.http);
    let summary = bench(&[
        "--target",
        &target,
        "--path",
        "/v1/noop",
        "--requests",
        "150",
        "--keys",
        "1",
    ])
    .await
    .expect("bench runs");
    assert_eq!(
        (summary.allowed, summary.rejected, summary.errors),
        (150, 0, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unexpected_statuses_are_errors_with_the_reason() {
    let server = start().await;
    let target = format!("http://{}", server.http);
    let summary = bench(&[
        "--target",
        &target,
        "--path",
        "/v1/nowhere",
        "--requests",
        "20",
        "-c",
        "2",
    ])
    .await
    .expect("bench runs");
    let first = all_failed(summary, 20);
    assert!(first.starts_with("HTTP 404"), "{first}");
}

/// Asserts that every one of `requests` failed, and returns the first error.
fn all_failed(summary: Summary, requests: u64) -> String {
    assert_eq!(
        (summary.allowed, summary.rejected, summary.errors),
        (0, 0, requests)
    );
    summary.first_error.unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_errors_say_the_status_and_the_server_message() {
    let server = start().await;
    let target = server.grpc.to_string();
    // A domain longer than the server accepts: refused as an invalid argument, every time.
    let domain = "d".repeat(300);
    let summary = bench(&[
        "--grpc",
        &target,
        "--domain",
        &domain,
        "--requests",
        "20",
        "-c",
        "2",
    ])
    .await
    .expect("bench runs");
    let first = all_failed(summary, 20);
    assert!(
        first.starts_with("gRPC InvalidArgument: domain must be"),
        "{first}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_keeps_to_its_rate() {
    let server = start().await;
    let target = format!("http://{}", server.http);
    // 40 requests at 400/s cannot finish in much less than 0.1 s.
    let summary = bench(&[
        "--target",
        &target,
        "--path",
        "/v1/noop",
        "--requests",
        "40",
        "-c",
        "4",
        "--rate",
        "400",
    ])
    .await
    .expect("bench runs");
    assert_eq!(summary.allowed, 40);
    assert!(summary.elapsed_s >= 0.075, "{summary:?}");
    // Every request's lateness is part of its latency, so each percentile of one is at most
    // that of the other.
    let lag = summary.schedule_lag_us.expect("open loop reports its lag");
    let service = summary.service_us.expect("and the time from the send");
    let latency = summary.latency_us;
    assert!(lag.p50 > 0.0, "{lag:?}");
    for part in [lag, service] {
        assert!(
            part.p50 <= latency.p50 && part.p99 <= latency.p99 && part.max <= latency.max,
            "{part:?} {latency:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_for_a_duration_sends_the_rate_times_the_duration() {
    let server = start().await;
    let target = format!("http://{}", server.http);
    // 200/s for half a second: 100 tickets, the first at the start; none after the deadline.
    let summary = bench(&[
        "--target", &target, "--path", "/v1/noop", "-d", "500ms", "-c", "8", "--rate", "200",
    ])
    .await
    .expect("bench runs");
    assert_eq!(summary.errors, 0, "{summary:?}");
    assert!(
        (90..=100).contains(&summary.allowed),
        "{} requests: {summary:?}",
        summary.allowed
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_target_is_one_clear_error() {
    let closed = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = closed.local_addr().expect("addr");
    drop(closed);
    let target = format!("http://{addr}");
    let err = bench(&["--target", &target, "--requests", "5"]).await.err();
    let message = err.map(|err| err.to_string()).unwrap_or_default();
    assert!(
        message.starts_with(&format!("cannot connect to http://{addr}")),
        "{message}"
    );
}

/// The `tollgate bench` command, on the real binary: a run in which every request got a
/// decision exits 0 whatever the mix of admissions and rejections, printing its summary as
/// text or, with `--json`, as JSON; one in which none did exits 1 and says why.
#[test]
fn the_command_fails_only_when_no_request_got_a_decision() {
    let scratch = support::Scratch::new("bench-command");
    let policy = scratch.write(
        "policy.yaml",
        "version: \"1\"\nlimits:\n  - name: ten\n    domain: api\n    key: [user]\n    capacity: 10\n    refill: 1/h\n",
    );
    let server = support::Server::start(&["--config", support::path_str(&policy)]);
    let target = format!("http://{}", server.http);
    let bench = |extra: &[&str]| {
        let base = ["bench", "--target", &target, "-c", "2", "--keys", "1"];
        support::run(&[&base[..], extra].concat())
    };
    // Only admissions.
    let (status, out, err) = bench(&["--path", "/v1/noop", "-n", "30"]);
    assert!(status.success(), "{err}");
    assert!(
        out.contains("  allowed      30\n") && out.contains("  rejected     0\n"),
        "{out}"
    );
    // As many rejections as admissions: one key's ten, then ten refused.
    let (status, out, err) = bench(&["-n", "20", "--json"]);
    assert!(status.success(), "{err}");
    let summary: serde_json::Value = serde_json::from_str(out.trim()).expect("one line of JSON");
    assert_eq!(
        (summary["allowed"].as_u64(), summary["rejected"].as_u64()),
        (Some(10), Some(10))
    );
    // Nothing decided: every request went to a path that does not exist.
    let (status, out, err) = bench(&["--path", "/v1/nowhere", "-n", "5"]);
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(err.contains("no request got a decision: HTTP 404"), "{err}");
}

/// A 403 is forward-auth's deny (nginx's auth_request passes on only 401 and 403); from the
/// JSON check it is an error, with its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_403_is_a_rejection_only_from_forward_auth() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let refusing = axum::Router::new().fallback(|| async { (StatusCode::FORBIDDEN, "go away") });
    tokio::spawn(async move { axum::serve(listener, refusing).await });
    let target = format!("http://{addr}");
    let checks = bench(&["--target", &target, "-n", "10", "-c", "2"])
        .await
        .expect("bench runs");
    let first = all_failed(checks, 10);
    assert_eq!(first, "HTTP 403 Forbidden: go away");
    let forward = bench(&["--target", &target, "--forward-auth", "-n", "10", "-c", "2"])
        .await
        .expect("bench runs");
    assert_eq!(
        (forward.allowed, forward.rejected, forward.errors),
        (0, 10, 0)
    );
}

/// `--cost` goes with forward-auth's requests as with checks: 5 of the demo's 10 tokens each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forward_auth_requests_carry_the_cost() {
    let server = start_denying_with(StatusCode::FORBIDDEN).await;
    let target = format!("http://{}", server.http);
    let args = [
        "--forward-auth",
        "--cost",
        "5",
        "--keys",
        "1",
        "-n",
        "6",
        "-c",
        "1",
    ];
    let summary = bench(&[&["--target", &target][..], &args].concat())
        .await
        .expect("bench runs");
    assert_eq!((summary.allowed, summary.rejected), (2, 4), "{summary:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_loop_for_a_duration_sends_until_its_end() {
    let server = start().await;
    let target = format!("http://{}", server.http);
    let summary = bench(&[
        "--target", &target, "--path", "/v1/noop", "-d", "300ms", "-c", "2",
    ])
    .await
    .expect("bench runs");
    assert_eq!(summary.errors, 0, "{summary:?}");
    assert!(summary.allowed > 0, "{summary:?}");
    assert!(summary.elapsed_s >= 0.3, "ended early: {summary:?}");
}

/// A server that answers each check after `delay`.
async fn slow_upstream(delay: std::time::Duration) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let slow = axum::Router::new().fallback(move || async move {
        tokio::time::sleep(delay).await;
        StatusCode::OK
    });
    tokio::spawn(async move { axum::serve(listener, slow).await });
    addr
}

/// An open-loop run that falls behind its schedule still ends at its deadline: the tickets
/// left over are not sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_open_loop_stops_at_its_deadline() {
    let upstream = slow_upstream(std::time::Duration::from_millis(50)).await;
    let target = format!("http://{upstream}");
    // 200 tickets in 200 ms, and one worker taking at least 50 ms a request: the fifth
    // would leave at the deadline or later, so at most 4 leave.
    let summary = bench(&[
        "--target", &target, "-d", "200ms", "-c", "1", "--rate", "1000",
    ])
    .await
    .expect("bench runs");
    assert!(summary.allowed > 0, "{summary:?}");
    assert!(
        summary.requests <= 4,
        "sent after the deadline: {summary:?}"
    );
    // Every answer took the upstream's 50 ms at least, from the send and from the schedule.
    let service = summary.service_us.expect("open loop");
    assert!(service.p50 >= 50_000.0, "{service:?}");
    assert!(
        summary.latency_us.p50 >= 50_000.0,
        "{:?}",
        summary.latency_us
    );
}

/// A request that times out leaves its connection in an unknown state: the next one opens
/// another rather than wait behind the lost answer, over HTTP and over gRPC.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_timed_out_is_followed_on_a_new_connection() {
    let server = start().await;
    for (flag, upstream, extra) in [
        ("--target", server.http, None),
        ("--target", server.http, Some("--http2")),
        ("--grpc", server.grpc, None),
    ] {
        let (silent, accepted) = proxy(upstream, true).await;
        let target = match flag {
            "--target" => format!("http://{silent}"),
            _ => silent.to_string(),
        };
        let args = ["-n", "3", "-c", "1", "--keys", "1", "--timeout", "200ms"];
        let extra: &[&str] = extra.as_slice();
        let summary = bench(&[&[flag, &target][..], &args, extra].concat())
            .await
            .expect("bench runs");
        assert_eq!(
            (summary.allowed, summary.errors),
            (2, 1),
            "{flag}: {:?}",
            summary.first_error
        );
        assert_eq!(
            summary.first_error.as_deref(),
            Some("no answer within 200ms (--timeout)")
        );
        assert_eq!(accepted.load(Ordering::Relaxed), 2, "{flag}: connections");
    }
}
