//! The server's bounds on its connections, seen by clients of the real binary: a client that
//! never finishes a request head, never finishes HTTP/2's preface or goes quiet is let go (and
//! counted), while clients that speak keep their connections; past `--max-connections` a new
//! client waits until a connection closes. On the way out, with `--shutdown-delay`, the server
//! leaves its load balancers' rotation and goes on serving before it drains.

mod support;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use support::{Server, assert_serve_flags_refused, descriptor, metric, post_json, request};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const CHECK: &str = r#"{"domain":"api","descriptors":[{"user":"alice"}]}"#;

/// Whether the server closed `stream` (end of stream or reset) within `limit`, reading and
/// dropping whatever it sends.
// The server's timeouts run on its own clock, in another process: only real time can see them.
#[allow(clippy::disallowed_methods)]
fn closed_within(stream: &mut TcpStream, limit: Duration) -> bool {
    let started = Instant::now();
    stream
        .set_read_timeout(Some(Duration::from_millis(100)))
        .expect("set a read timeout");
    let mut buf = [0u8; 4096];
    while started.elapsed() < limit {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(err) if matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return true,
        }
    }
    false
}

const HTTP_HEADER_TIMEOUTS: &str =
    r#"tollgate_connections_closed_total{listener="http",reason="header_timeout"}"#;
const GRPC_HEADER_TIMEOUTS: &str =
    r#"tollgate_connections_closed_total{listener="grpc",reason="header_timeout"}"#;
const HTTP_IDLE: &str = r#"tollgate_connections_closed_total{listener="http",reason="idle"}"#;
const GRPC_IDLE: &str = r#"tollgate_connections_closed_total{listener="grpc",reason="idle"}"#;

/// HTTP/2's connection preface, a client's first bytes.
const HTTP2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// A SETTINGS frame with no settings: the rest of a client's opening.
const EMPTY_SETTINGS: [u8; 9] = [0, 0, 0, 4, 0, 0, 0, 0, 0];

fn connect(addr: SocketAddr) -> TcpStream {
    TcpStream::connect(addr).expect("connect")
}

/// Writes a check on `stream`, with `extra` headers (each ending in CRLF).
fn send_check(stream: &mut TcpStream, extra: &str) {
    write!(
        stream,
        "POST /v1/check HTTP/1.1\r\nHost: tollgate\r\nContent-Type: application/json\r\n\
         {extra}Content-Length: {}\r\n\r\n{CHECK}",
        CHECK.len()
    )
    .expect("send a request");
}

/// Sends a check on `stream` and reads its answer whole, leaving the connection open.
fn check_kept_alive(stream: &mut TcpStream) {
    send_check(stream, "");
    let head = read_answer(stream);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
}

/// Reads an answer whole from `stream` and returns its head.
fn read_answer(stream: &mut TcpStream) -> String {
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("set a read timeout");
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let read = stream.read(&mut buf).expect("read the answer");
        assert!(read > 0, "closed before answering");
        answer.extend_from_slice(&buf[..read]);
        let text = String::from_utf8_lossy(&answer);
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length: usize = head
                .lines()
                .find_map(|line| {
                    line.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(str::to_owned)
                })
                .and_then(|value| value.trim().parse().ok())
                .expect("a content-length");
            if body.len() >= length {
                return head.to_owned();
            }
        }
    }
}

#[test]
// As in closed_within: the server's timeouts can only be seen in real time.
#[allow(clippy::disallowed_methods)]
fn clients_that_never_finish_a_request_head_are_let_go() {
    let server = Server::start(&["--header-timeout", "1s", "--idle-timeout", "3s"]);
    let started = Instant::now();
    // Connects and says nothing, on each port.
    let mut silent_http = connect(server.http);
    let mut silent_grpc = connect(server.grpc);
    // Starts a request and stops halfway through its head.
    let mut half_head = connect(server.http);
    half_head
        .write_all(b"POST /v1/check HTTP/1.1\r\nHost: tollgate\r\n")
        .expect("send half a head");
    // Is answered, then starts its next request and stops halfway through that head.
    let mut half_next_head = connect(server.http);
    check_kept_alive(&mut half_next_head);
    half_next_head
        .write_all(b"POST /v1/check HTTP/1.1\r\n")
        .expect("send half a head");
    // Begins HTTP/2's preface: too little to tell it from an HTTP/1 head, then more of it.
    let mut half_sign = connect(server.http);
    half_sign.write_all(b"PR").expect("send two bytes");
    let mut half_preface = connect(server.http);
    half_preface
        .write_all(&HTTP2_PREFACE[..16])
        .expect("send half a preface");
    // Is answered and keeps the connection, waiting with nothing to send.
    let mut kept_alive = connect(server.http);
    check_kept_alive(&mut kept_alive);
    // Opens HTTP/2 whole (preface and settings), then sends nothing.
    let mut kept_http2 = connect(server.http);
    kept_http2
        .write_all(HTTP2_PREFACE)
        .expect("send the preface");
    kept_http2
        .write_all(&EMPTY_SETTINGS)
        .expect("send the settings");

    // The server keeps serving everyone else meanwhile.
    assert_eq!(post_json(server.http, "/v1/check", CHECK).status, 200);

    for (name, stream) in [
        ("silent HTTP", &mut silent_http),
        ("silent gRPC", &mut silent_grpc),
        ("half a head", &mut half_head),
        ("half the next head", &mut half_next_head),
        ("two bytes of HTTP/2's preface", &mut half_sign),
        ("half of HTTP/2's preface", &mut half_preface),
    ] {
        assert!(
            closed_within(stream, Duration::from_secs(15)),
            "{name}: still open after 15 s"
        );
        // Not closed at once: given the whole timeout (less the time to set the others up).
        let open_for = started.elapsed();
        assert!(
            open_for >= Duration::from_millis(900),
            "{name}: closed after {open_for:?}, before its 1 s"
        );
    }
    // A kept-alive connection waiting for its next request is idle, not slow: it stays past
    // the head timeout and goes at the idle timeout.
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_millis(2500),
        "the checks above took {waited:?}: too long to see the kept-alive connection open"
    );
    assert!(
        !closed_within(&mut kept_alive, Duration::from_millis(2500) - waited),
        "a kept-alive connection was closed by the head timeout"
    );
    assert!(
        !closed_within(&mut kept_http2, Duration::from_millis(100)),
        "a quiet HTTP/2 connection was closed by the head timeout"
    );
    for (name, stream) in [
        ("a kept-alive connection", &mut kept_alive),
        ("a quiet HTTP/2 connection", &mut kept_http2),
    ] {
        assert!(
            closed_within(stream, Duration::from_secs(15)),
            "{name} outlived its idle timeout"
        );
    }
    assert!(started.elapsed() >= Duration::from_millis(2900));
    assert_eq!(metric(&server, HTTP_HEADER_TIMEOUTS), 5.0);
    assert_eq!(metric(&server, GRPC_HEADER_TIMEOUTS), 1.0);
    assert_eq!(metric(&server, HTTP_IDLE), 2.0);
}

#[test]
// As in closed_within: the server's timeouts can only be seen in real time.
#[allow(clippy::disallowed_methods)]
fn a_body_sent_after_100_continue_is_not_taken_for_a_slow_head() {
    let server = Server::start(&["--header-timeout", "1s", "--idle-timeout", "10s"]);
    let mut stream = connect(server.http);
    // As curl sends a large body: the head, then the body once the server says to go on.
    write!(
        stream,
        "POST /v1/check HTTP/1.1\r\nHost: tollgate\r\nContent-Type: application/json\r\n\
         Expect: 100-continue\r\nContent-Length: {}\r\n\r\n",
        CHECK.len()
    )
    .expect("send a head");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("set a read timeout");
    let mut interim = [0u8; 25];
    stream
        .read_exact(&mut interim)
        .expect("read the interim answer");
    assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");
    // Half the body, a pause past the head timeout (well within the idle one), the rest.
    let (first, rest) = CHECK.split_at(CHECK.len() / 2);
    stream
        .write_all(first.as_bytes())
        .expect("send half a body");
    std::thread::sleep(Duration::from_millis(2500));
    stream.write_all(rest.as_bytes()).expect("send the rest");
    let head = read_answer(&mut stream);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(metric(&server, HTTP_HEADER_TIMEOUTS), 0.0);
    // The connection is kept for the next request.
    check_kept_alive(&mut stream);
}

/// One RLS call on `client`, which must be answered OK.
async fn call(client: &mut RateLimitServiceClient<tonic::transport::Channel>) {
    let request = RateLimitRequest {
        domain: "unknown-domain".to_owned(),
        descriptors: vec![descriptor(&[("user", "alice")])],
        hits_addend: 1,
    };
    let answer = client
        .should_rate_limit(request)
        .await
        .expect("an RLS answer");
    assert_eq!(answer.into_inner().overall_code, Code::Ok as i32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_grpc_connection_is_sent_away_and_busy_ones_are_kept() {
    let server = Server::start(&["--idle-timeout", "2s"]);
    // Opens HTTP/2, then is quiet.
    let quiet = tokio::net::TcpStream::connect(server.grpc)
        .await
        .expect("connect");
    let (_quiet_client, quiet_connection) = h2::client::handshake(quiet)
        .await
        .expect("an HTTP/2 handshake");
    let quiet_connection = tokio::spawn(quiet_connection);
    // Calls every 300 ms, for twice the idle timeout.
    let mut busy = RateLimitServiceClient::new(server.grpc_channel().await);
    for _ in 0..14 {
        call(&mut busy).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // Closed by the client, before it could go quiet too.
    drop(busy);
    // Asked to close between 2 and 2.5 s, with no calls open it is closed by then.
    let ended = tokio::time::timeout(Duration::from_secs(10), quiet_connection).await;
    let ended = ended.expect("the quiet connection is still open");
    assert!(matches!(ended, Ok(Ok(()))), "not a graceful end: {ended:?}");
    assert_eq!(metric(&server, GRPC_IDLE), 1.0, "only the quiet connection");

    // A client whose connection went quiet and was sent away reconnects on its next call.
    let mut idle_client = RateLimitServiceClient::new(server.grpc_channel().await);
    call(&mut idle_client).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    call(&mut idle_client).await;
    assert_eq!(metric(&server, GRPC_IDLE), 2.0);
}

#[test]
fn past_max_connections_a_client_waits_for_one_to_close() {
    let server = Server::start(&["--max-connections", "2"]);
    let first = connect(server.http);
    let _second = connect(server.http);
    // Both are admitted (the bound is per listener): the gRPC port is not affected.
    let _grpc = connect(server.grpc);
    // The server accepts in the order the kernel queued: these two took the places.

    let mut third = connect(server.http);
    send_check(&mut third, "Connection: close\r\n");
    third
        .set_read_timeout(Some(Duration::from_secs(1)))
        .expect("set a read timeout");
    let mut answer = Vec::new();
    let waited = third.read_to_end(&mut answer);
    assert!(
        matches!(&waited, Err(err) if matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)),
        "answered past the bound: {waited:?} {}",
        String::from_utf8_lossy(&answer)
    );

    drop(first);
    third
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("set a read timeout");
    third
        .read_to_end(&mut answer)
        .expect("answered once a connection closed");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    // The silent second connection and the scrape's own.
    assert_eq!(
        metric(&server, r#"tollgate_connections_open{listener="http"}"#),
        2.0
    );
    assert_eq!(
        metric(&server, r#"tollgate_connections_open{listener="grpc"}"#),
        1.0
    );
}

#[test]
fn connection_limits_are_checked_at_start() {
    assert_serve_flags_refused(&[
        ("--header-timeout", "0s", "longer than 0"),
        ("--idle-timeout", "1441m", "longer than a day"),
        ("--max-connections", "0", "not in 1.."),
        ("--shutdown-delay", "11m", "longer than ten minutes"),
    ]);
}

/// The gRPC health service's status for the server as a whole, asked on a new connection.
async fn health_on_a_new_connection(server: &Server) -> i32 {
    let mut health = HealthClient::new(server.grpc_channel().await);
    let ask = HealthCheckRequest {
        service: String::new(),
    };
    health
        .check(ask)
        .await
        .expect("a status")
        .into_inner()
        .status
}

/// Whether `/readyz` answers 503 and says the server is shutting down.
fn out_of_rotation(server: &Server) -> bool {
    let ready = request(server.http, "GET", "/readyz", &[], "");
    ready.status == 503 && ready.json()["shutting_down"] == true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_delay_takes_the_server_out_of_rotation_while_it_serves_on() {
    // The delay is long enough for the calls below on a busy host; nothing waits it out but
    // the end, which is a drain of nothing.
    let server = Server::start(&["--shutdown-delay", "5s", "--drain-timeout", "1s"]);
    assert_eq!(request(server.http, "GET", "/readyz", &[], "").status, 200);
    let mut watch = HealthClient::new(server.grpc_channel().await)
        .watch(HealthCheckRequest {
            service: "envoy.service.ratelimit.v3.RateLimitService".to_owned(),
        })
        .await
        .expect("a watch")
        .into_inner();
    let first = watch.message().await.expect("a status").expect("open");
    assert_eq!(first.status, ServingStatus::Serving as i32);
    let mut kept = HealthClient::new(server.grpc_channel().await);
    let mut rls = RateLimitServiceClient::new(server.grpc_channel().await);

    server.signal("TERM");
    // Said to the watch as it happens (its own look comes every 2 s).
    let next = tokio::time::timeout(Duration::from_secs(1), watch.message()).await;
    let next = next.expect("told within a second").expect("a status");
    assert_eq!(next.expect("open").status, ServingStatus::NotServing as i32);
    assert!(out_of_rotation(&server));
    let asked = kept
        .check(HealthCheckRequest::default())
        .await
        .expect("a status");
    assert_eq!(asked.into_inner().status, ServingStatus::NotServing as i32);
    // Still serving: on connections opened before, and on new ones, both APIs.
    call(&mut rls).await;
    assert_eq!(post_json(server.http, "/v1/check", CHECK).status, 200);
    assert_eq!(
        health_on_a_new_connection(&server).await,
        ServingStatus::NotServing as i32
    );
    let mut late = RateLimitServiceClient::new(server.grpc_channel().await);
    call(&mut late).await;
    assert!(
        out_of_rotation(&server),
        "the delay ended before the calls above"
    );

    let status = tokio::task::spawn_blocking(move || server.wait_within(Duration::from_secs(30)));
    let status = status.await.expect("waited");
    let status = status.expect("still running 30 s after SIGTERM, with a 5 s delay");
    assert!(status.success(), "{status:?}");
}

#[test]
fn a_second_signal_ends_the_shutdown_delay() {
    // Both runtimes: the per-core one watches the signals on its accepting thread's own.
    for runtime in ["shared", "per-core"] {
        let server = Server::start(&["--shutdown-delay", "10m", "--runtime", runtime]);
        assert_eq!(request(server.http, "GET", "/readyz", &[], "").status, 200);
        server.signal("TERM");
        support::wait_for("readyz to say shutting down", || {
            out_of_rotation(&server).then_some(())
        });
        assert_eq!(post_json(server.http, "/v1/check", CHECK).status, 200);
        // An operator at a terminal, pressing Ctrl-C again.
        server.signal("INT");
        let status = server.wait_within(Duration::from_secs(10));
        let status = status.expect("still running 10 s after a second signal");
        assert!(status.success(), "{runtime}: {status:?}");
    }
}

#[test]
fn a_stop_waits_for_requests_in_flight_only_until_the_drain_deadline() {
    let server = Server::start(&["--drain-timeout", "1s"]);
    // A request whose body never comes: its handler waits for it, and a graceful stop with it.
    let mut stalled = connect(server.http);
    stalled
        .write_all(
            b"POST /v1/check HTTP/1.1\r\nHost: tollgate\r\nContent-Type: application/json\r\n\
              Content-Length: 100\r\n\r\n{\"domain\":",
        )
        .expect("send part of a request");
    // The server has it in hand once another request on a later connection is answered.
    assert_eq!(post_json(server.http, "/v1/check", CHECK).status, 200);

    let status = server.terminate_within(Duration::from_secs(10));
    let status = status.expect("still running 10 s after SIGTERM, with a 1 s drain deadline");
    assert!(status.success(), "{status:?}");
    assert!(closed_within(&mut stalled, Duration::from_secs(1)));
}

/// The soft and hard open-file limits of process `pid`.
fn open_file_limits(pid: u32) -> (u64, u64) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("read the limits");
    let line = limits
        .lines()
        .find(|line| line.starts_with("Max open files"))
        .expect("a Max open files line");
    let mut figures = line
        .split_whitespace()
        .filter_map(|word| word.parse::<u64>().ok());
    let soft = figures.next().expect("a soft limit");
    let hard = figures.next().expect("a hard limit");
    (soft, hard)
}

/// Started under a shell's low soft limit on open files, the server raises it to the hard
/// limit, so that connections are not refused at accept long before `--max-connections`.
#[test]
#[cfg(target_os = "linux")]
fn the_open_file_limit_is_raised_to_the_hard_limit() {
    let (_, hard) = open_file_limits(std::process::id());
    assert!(
        hard > 256,
        "this test needs a hard open-file limit above 256, not {hard}"
    );
    let server = Server::start_after("ulimit -Sn 256", &[]);
    assert_eq!(open_file_limits(server.pid()), (hard, hard));
    assert_eq!(post_json(server.http, "/v1/check", CHECK).status, 200);
}

/// Where even the hard limit is low, the default bound is what it holds on both listeners
/// (half of it, less 64 descriptors for the rest); a bound asked for is kept as asked, with a
/// warning when the limit cannot hold it.
#[test]
#[cfg(target_os = "linux")]
fn the_default_connection_bound_fits_the_open_file_limit() {
    let server = Server::start_after("ulimit -n 256", &[]);
    assert!(
        server.listening.ends_with(" max_connections=96"),
        "{}",
        server.listening
    );
    let warning = "the open-file limit cannot hold --max-connections";
    let (server, logs) = Server::start_after_logging(
        "ulimit -n 256",
        &["--max-connections", "500"],
        "tollgate_server=warn",
    );
    assert!(
        server.listening.ends_with(" max_connections=500"),
        "{}",
        server.listening
    );
    let logs = server.terminate_and_read(logs);
    assert!(
        logs.contains(warning) && logs.contains("open_file_limit=256"),
        "{logs}"
    );
    // Plain text off a terminal, without colours' escape codes around the fields.
    assert!(!logs.contains('\x1b'), "{logs:?}");
    // The most the limit holds: no warning.
    let (server, logs) = Server::start_after_logging(
        "ulimit -n 256",
        &["--max-connections", "96"],
        "tollgate_server=warn",
    );
    let logs = server.terminate_and_read(logs);
    assert!(!logs.contains(warning), "{logs}");
    let server = Server::start(&[]);
    let (_, hard) = open_file_limits(server.pid());
    let expected = ((hard - 64) / 2).min(10_000);
    assert!(
        server
            .listening
            .ends_with(&format!(" max_connections={expected}")),
        "{}",
        server.listening
    );
}

/// Connections are counted by the protocol their clients turn out to speak, on each listener:
/// whether clients multiplex their requests over HTTP/2, or open one connection per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_counted_by_the_protocol_they_speak() {
    let server = Server::start(&[]);
    let opened = |listener: &str, protocol: &str| {
        metric(
            &server,
            &format!(
                r#"tollgate_connections_opened_total{{listener="{listener}",protocol="{protocol}"}}"#
            ),
        )
    };
    let before = [
        opened("http", "http/1.1"),
        opened("http", "h2"),
        opened("grpc", "h2"),
    ];
    // Two HTTP/1.1 requests on connections of their own.
    for _ in 0..2 {
        assert_eq!(post_json(server.http, "/v1/check", CHECK).status, 200);
    }
    // Three requests over one HTTP/2 connection.
    let multiplexed = support::http2::Http2::connect(server.http).await;
    for _ in 0..3 {
        assert_eq!(multiplexed.post_json("/v1/check", CHECK).await.status, 200);
    }
    // Two gRPC connections.
    for _ in 0..2 {
        let mut client = RateLimitServiceClient::new(server.grpc_channel().await);
        call(&mut client).await;
    }
    let after = [
        opened("http", "http/1.1"),
        opened("http", "h2"),
        opened("grpc", "h2"),
    ];
    // Each scrape is an HTTP/1.1 connection too: the two checks, the last two of the three
    // scrapes before (the first was counted in `before`), and this one.
    let new: Vec<f64> = after.iter().zip(before).map(|(a, b)| a - b).collect();
    assert_eq!(new, [2.0 + 3.0, 1.0, 2.0]);
}
