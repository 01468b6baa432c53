//! The listeners over TLS, through the real binary: HTTPS (HTTP/1.1, and HTTP/2 when ALPN
//! chooses it) and gRPC over TLS deciding as they do in plain, clients without TLS or without
//! a trusted certificate refused in the handshake (and counted), certificates replaced while
//! the server runs (on SIGHUP and when the files change, a broken set refused with the one in
//! force kept), and files that cannot be used refused at the start.

mod support;

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};
use support::http2::Http2;
use support::{Answer, Scratch, Server, descriptor, exchange, path_str, run, wait_for};
use tollgate_redis::test_server::TestCertificates;

/// A client trusting the authorities `cas`, presenting `identity`'s client certificate when
/// given, offering `alpn` (nothing when empty).
fn client(cas: &[&Path], identity: Option<&TestCertificates>, alpn: &[u8]) -> Arc<ClientConfig> {
    let mut roots = RootCertStore::empty();
    for ca in cas {
        for cert in CertificateDer::pem_file_iter(ca).expect("read a CA file") {
            roots
                .add(cert.expect("a CA certificate"))
                .expect("trust it");
        }
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("protocol versions")
        .with_root_certificates(roots);
    let mut config = match identity {
        Some(identity) => {
            let chain = CertificateDer::pem_file_iter(&identity.client_cert)
                .expect("read the client certificate")
                .collect::<Result<Vec<_>, _>>()
                .expect("a client certificate");
            let key = PrivateKeyDer::from_pem_file(&identity.client_key).expect("the client key");
            builder
                .with_client_auth_cert(chain, key)
                .expect("a client identity")
        }
        None => builder.with_no_client_auth(),
    };
    if !alpn.is_empty() {
        config.alpn_protocols = vec![alpn.to_vec()];
    }
    Arc::new(config)
}

/// One HTTPS request on a connection of its own: the answer and the certificate the server
/// presented, or the error that ended it.
fn https(
    addr: SocketAddr,
    config: &Arc<ClientConfig>,
    method: &str,
    path: &str,
    body: &str,
) -> std::io::Result<(Answer, CertificateDer<'static>)> {
    let tcp = TcpStream::connect(addr)?;
    tcp.set_read_timeout(Some(Duration::from_secs(10)))?;
    let name = ServerName::try_from("localhost").expect("a server name");
    let connection =
        ClientConnection::new(Arc::clone(config), name).map_err(std::io::Error::other)?;
    let mut stream = StreamOwned::new(connection, tcp);
    let headers = [("Content-Type", "application/json")];
    let answer = exchange(&mut stream, "localhost", method, path, &headers, body)?;
    let presented = stream
        .conn
        .peer_certificates()
        .and_then(|chain| chain.first())
        .map(|cert| cert.clone().into_owned())
        .ok_or_else(|| std::io::Error::other("no server certificate"))?;
    Ok((answer, presented))
}

/// A stream whose first bytes written were sent already, by hand: they are passed over when
/// the client writes them again.
struct AlreadySent<S> {
    inner: S,
    sent: &'static [u8],
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for AlreadySent<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for AlreadySent<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        if !self.sent.is_empty() {
            let passed = self.sent.len().min(buf.len());
            assert_eq!(buf[..passed], self.sent[..passed], "the bytes sent by hand");
            self.sent = &self.sent[passed..];
            return std::task::Poll::Ready(Ok(passed));
        }
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The first certificate of a PEM file.
fn certificate(path: &Path) -> CertificateDer<'static> {
    CertificateDer::pem_file_iter(path)
        .expect("read a certificate file")
        .next()
        .expect("a certificate")
        .expect("a whole certificate")
}

/// A metric's value from `/metrics` read over HTTPS, 0 when absent.
fn metric_over_tls(addr: SocketAddr, config: &Arc<ClientConfig>, series: &str) -> f64 {
    let (answer, _) = https(addr, config, "GET", "/metrics", "").expect("the metrics");
    answer
        .body
        .lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// A gRPC client over TLS with `config`, as Envoy's cluster with an `UpstreamTlsContext`.
async fn grpc_over_tls(
    addr: SocketAddr,
    config: Arc<ClientConfig>,
) -> Result<RateLimitServiceClient<tonic::transport::Channel>, tonic::transport::Error> {
    let connector = tokio_rustls::TlsConnector::from(config);
    let channel = tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: http::Uri| {
            let connector = connector.clone();
            async move {
                let tcp = tokio::net::TcpStream::connect(addr).await?;
                let name = ServerName::try_from("localhost").map_err(std::io::Error::other)?;
                let tls = connector.connect(name, tcp).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
            }
        }))
        .await?;
    Ok(RateLimitServiceClient::new(channel))
}

/// One `ShouldRateLimit` call for user `u1` over TLS with `config`: the answer, or why there
/// was none (the handshake refused: with TLS 1.3 a refused client certificate shows only on
/// the first call).
async fn call_over_tls(
    addr: SocketAddr,
    config: Arc<ClientConfig>,
) -> Result<RateLimitResponse, String> {
    call(grpc_over_tls(addr, config).await).await
}

/// The same call in plain text.
async fn call_in_plain(addr: SocketAddr) -> Result<RateLimitResponse, String> {
    call(RateLimitServiceClient::connect(format!("http://{addr}")).await).await
}

async fn call(
    client: Result<RateLimitServiceClient<tonic::transport::Channel>, tonic::transport::Error>,
) -> Result<RateLimitResponse, String> {
    let mut client = client.map_err(|err| err.to_string())?;
    let request = RateLimitRequest {
        domain: "api".to_owned(),
        descriptors: vec![descriptor(&[("user", "u1")])],
        hits_addend: 1,
    };
    client
        .should_rate_limit(request)
        .await
        .map(tonic::Response::into_inner)
        .map_err(|status| status.to_string())
}

const CHECK: &str = r#"{"domain":"api","descriptors":[{"user":"u1"}]}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_and_grpc_over_tls_decide_as_in_plain_and_plain_clients_are_refused() {
    let certificates = TestCertificates::generate("serve-both");
    let (cert, key) = (
        path_str(&certificates.server_cert),
        path_str(&certificates.server_key),
    );
    // The HTTP listener's files from the environment, the gRPC listener's from flags; each
    // connection handed to a thread of its own before its handshake (the other tests run the
    // shared runtime).
    let mut command = std::process::Command::new(support::binary());
    command
        .args(["serve", "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"])
        .args(["--runtime", "per-core", "--threads", "2"])
        .args(["--grpc-tls-cert", cert, "--grpc-tls-key", key])
        .env("TOLLGATE_HTTP_TLS_CERT", cert)
        .env("TOLLGATE_HTTP_TLS_KEY", key);
    let server = Server::start_command(command);
    assert!(
        server
            .banner
            .contains(&format!("HTTP  https://{} (TLS)", server.http)),
        "{}",
        server.banner
    );
    assert!(
        server
            .banner
            .contains(&format!("gRPC  {} (TLS)", server.grpc)),
        "{}",
        server.banner
    );
    assert!(
        server
            .banner
            .contains(&format!("-X POST https://{}/v1/check", server.http)),
        "{}",
        server.banner
    );

    let http_client = client(&[&certificates.ca], None, b"http/1.1");
    let (answer, presented) =
        https(server.http, &http_client, "POST", "/v1/check", CHECK).expect("an HTTPS answer");
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.json()["allowed"], true, "{answer:?}");
    assert_eq!(presented, certificate(&certificates.server_cert));

    let answer = call_over_tls(server.grpc, client(&[&certificates.ca], None, b"h2"))
        .await
        .expect("a gRPC answer over TLS");
    assert_eq!(answer.overall_code, 1, "OK: {answer:?}");

    // Plain HTTP on the TLS port: the handshake fails, nothing is answered in plain text.
    let mut plain = TcpStream::connect(server.http).expect("connect");
    plain
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let refused = exchange(&mut plain, "localhost", "POST", "/v1/check", &[], CHECK);
    assert!(refused.is_err(), "answered in plain text: {refused:?}");
    let mut rest = Vec::new();
    let _ = plain.read_to_end(&mut rest);
    assert!(!String::from_utf8_lossy(&rest).contains("allowed"));
    // Plain gRPC on the TLS port.
    let plain_grpc = call_in_plain(server.grpc).await;
    assert!(
        plain_grpc.is_err(),
        "answered in plain text: {plain_grpc:?}"
    );
    // A client that chooses HTTP/2 by ALPN is answered over it.
    let connector = tokio_rustls::TlsConnector::from(client(&[&certificates.ca], None, b"h2"));
    let tcp = tokio::net::TcpStream::connect(server.http)
        .await
        .expect("connect");
    let name = ServerName::try_from("localhost").expect("a server name");
    let tls = connector.connect(name, tcp).await.expect("a TLS handshake");
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let over_http2 = Http2::over(tls).await.expect("an HTTP/2 handshake");
    let answer = over_http2.post_json("/v1/check", CHECK).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.json()["allowed"], true, "{answer:?}");
    // A client that chooses nothing by ALPN is served as its first bytes say: HTTP/2 when they
    // are its preface (HAProxy's `proto h2` without `alpn`), byte by byte or whole...
    let no_alpn = client(&[&certificates.ca], None, b"");
    for whole in [true, false] {
        let tcp = tokio::net::TcpStream::connect(server.http)
            .await
            .expect("connect");
        let name = ServerName::try_from("localhost").expect("a server name");
        let connector = tokio_rustls::TlsConnector::from(Arc::clone(&no_alpn));
        let mut tls = connector.connect(name, tcp).await.expect("a TLS handshake");
        assert_eq!(tls.get_ref().1.alpn_protocol(), None);
        if !whole {
            // The first bytes one record at a time, each flushed, the server reading between.
            use tokio::io::AsyncWriteExt;
            for byte in b"PR" {
                tls.write_all(&[*byte]).await.expect("a byte");
                tls.flush().await.expect("flushed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let rest = AlreadySent {
                inner: tls,
                sent: b"PR",
            };
            let over_http2 = Http2::over(rest).await.expect("an HTTP/2 handshake");
            let answer = over_http2.post_json("/v1/check", CHECK).await;
            assert_eq!(answer.status, 200, "{answer:?}");
            continue;
        }
        let over_http2 = Http2::over(tls).await.expect("an HTTP/2 handshake");
        let answer = over_http2.post_json("/v1/check", CHECK).await;
        assert_eq!(answer.status, 200, "{answer:?}");
    }
    // ...and HTTP/1.1 otherwise.
    let (answer, _) =
        https(server.http, &no_alpn, "POST", "/v1/check", CHECK).expect("an HTTPS answer");
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.json()["allowed"], true, "{answer:?}");
    // A client offering only a protocol the listener does not speak is refused in the
    // handshake rather than misread after it.
    let spdy_on_http = https(
        server.http,
        &client(&[&certificates.ca], None, b"spdy/3.1"),
        "GET",
        "/healthz",
        "",
    );
    assert!(spdy_on_http.is_err(), "{spdy_on_http:?}");

    let refusals = |listener: &str| {
        metric_over_tls(
            server.http,
            &http_client,
            &format!(
                "tollgate_connections_closed_total{{listener=\"{listener}\",reason=\"tls_handshake\"}}"
            ),
        )
    };
    // Each listener's certificate expires when rcgen's do by default: 4096-01-01T00:00:00Z.
    for listener in ["http", "grpc"] {
        let series =
            format!("tollgate_tls_certificate_expiry_timestamp_seconds{{listener=\"{listener}\"}}");
        assert_eq!(
            metric_over_tls(server.http, &http_client, &series),
            67_090_118_400.0,
            "{series}"
        );
    }
    wait_for("the HTTP listener's handshakes refused, counted", || {
        (refusals("http") >= 2.0).then_some(())
    });
    wait_for("the gRPC listener's handshake refused, counted", || {
        (refusals("grpc") >= 1.0).then_some(())
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_clients_without_a_certificate_from_the_authority_are_refused() {
    let certificates = TestCertificates::generate("mutual");
    let stranger = TestCertificates::generate("mutual-stranger");
    let server = Server::start(&[
        "--grpc-tls-cert",
        path_str(&certificates.server_cert),
        "--grpc-tls-key",
        path_str(&certificates.server_key),
        "--grpc-tls-client-ca",
        path_str(&certificates.ca),
    ]);
    assert!(
        server.banner.contains(&format!(
            "gRPC  {} (TLS, client certificates required)",
            server.grpc
        )),
        "{}",
        server.banner
    );
    // The HTTP listener stays plain: probes and scrapes reach it as before.
    assert_eq!(
        support::request(server.http, "GET", "/healthz", &[], "").status,
        200
    );

    let trusted = client(&[&certificates.ca], Some(&certificates), b"h2");
    let answer = call_over_tls(server.grpc, trusted)
        .await
        .expect("a client with a certificate from the authority is answered");
    assert_eq!(answer.overall_code, 1, "OK: {answer:?}");

    let anonymous = call_over_tls(server.grpc, client(&[&certificates.ca], None, b"h2")).await;
    assert!(
        anonymous.is_err(),
        "answered without a certificate: {anonymous:?}"
    );
    let other_authority = call_over_tls(
        server.grpc,
        client(&[&certificates.ca], Some(&stranger), b"h2"),
    )
    .await;
    assert!(
        other_authority.is_err(),
        "answered with another authority's certificate: {other_authority:?}"
    );
    let series = "tollgate_connections_closed_total{listener=\"grpc\",reason=\"tls_handshake\"}";
    wait_for("both refusals counted", || {
        (support::metric(&server, series) >= 2.0).then_some(())
    });
}

/// Writes `cert` and `key` over the files the server reads.
fn install(from: &TestCertificates, cert: &Path, key: &Path) {
    std::fs::copy(&from.server_cert, cert).expect("copy the certificate");
    std::fs::copy(&from.server_key, key).expect("copy the key");
}

#[test]
fn a_replaced_certificate_is_served_to_new_connections_and_a_broken_one_is_refused() {
    let first = TestCertificates::generate("rotate-first");
    let second = TestCertificates::generate("rotate-second");
    let scratch = Scratch::new("tls-rotate");
    let (cert, key) = (scratch.0.join("server.pem"), scratch.0.join("server.key"));
    install(&first, &cert, &key);
    let (server, logs) = Server::start_logging(
        &[
            "--http-tls-cert",
            path_str(&cert),
            "--http-tls-key",
            path_str(&key),
        ],
        "info",
    );
    let config = client(&[&first.ca, &second.ca], None, b"http/1.1");
    let presented = || {
        https(server.http, &config, "GET", "/healthz", "")
            .expect("an HTTPS answer")
            .1
    };
    assert_eq!(presented(), certificate(&first.server_cert));

    // Replaced, then SIGHUP: new connections get the new certificate.
    install(&second, &cert, &key);
    server.signal("HUP");
    wait_for("the second certificate served after SIGHUP", || {
        (presented() == certificate(&second.server_cert)).then_some(())
    });

    // A certificate with another's key: refused, counted, and the one in force stays.
    std::fs::copy(&first.server_cert, &cert).expect("copy a mismatched certificate");
    let refused = "tollgate_tls_reloads_total{listener=\"http\",result=\"refused\"}";
    wait_for("the mismatched pair refused by the periodic look", || {
        (metric_over_tls(server.http, &config, refused) >= 1.0).then_some(())
    });
    assert_eq!(presented(), certificate(&second.server_cert));

    // Mended without a signal: the periodic look puts it in force.
    std::fs::copy(&first.server_key, &key).expect("copy the matching key");
    wait_for(
        "the first certificate served again once its files changed",
        || (presented() == certificate(&first.server_cert)).then_some(()),
    );
    let reloaded = "tollgate_tls_reloads_total{listener=\"http\",result=\"reloaded\"}";
    assert!(metric_over_tls(server.http, &config, reloaded) >= 2.0);

    let logs = server.terminate_and_read(logs);
    assert!(logs.contains("SIGHUP: TLS certificate reloaded"), "{logs}");
    assert!(
        logs.contains("TLS files refused, the certificate in force stays"),
        "{logs}"
    );
}

#[test]
fn tls_files_that_cannot_be_used_stop_the_start_naming_the_file() {
    let certificates = TestCertificates::generate("refused");
    let scratch = Scratch::new("tls-refused");
    let garbage = scratch.write("garbage.pem", "not a PEM file\n");
    let other = TestCertificates::generate("refused-other");
    let (cert, key) = (
        path_str(&certificates.server_cert),
        path_str(&certificates.server_key),
    );
    let missing = "/nonexistent/tollgate-server.pem";
    let garbage = path_str(&garbage);
    let cases: [(&[&str], &str); 6] = [
        (
            &["--http-tls-cert", missing, "--http-tls-key", key],
            missing,
        ),
        (
            &["--grpc-tls-cert", garbage, "--grpc-tls-key", key],
            "holds no PEM certificate",
        ),
        (
            &["--grpc-tls-cert", cert, "--grpc-tls-key", garbage],
            "holds no PEM private key",
        ),
        (
            &["--grpc-tls-cert", cert, "--grpc-tls-key", cert],
            "holds no PEM private key",
        ),
        (
            &[
                "--http-tls-cert",
                cert,
                "--http-tls-key",
                path_str(&other.server_key),
            ],
            "do not make a usable certificate",
        ),
        (
            &[
                "--grpc-tls-cert",
                cert,
                "--grpc-tls-key",
                key,
                "--grpc-tls-client-ca",
                garbage,
            ],
            "holds no PEM certificate",
        ),
    ];
    for (args, reason) in cases {
        let line = support::serve_refused(args);
        assert!(line.contains(reason), "{args:?}: {line}");
        let flag = if args[0].starts_with("--http") {
            "--http-tls-cert"
        } else {
            "--grpc-tls-cert"
        };
        assert!(line.contains(flag), "{args:?}: {line}");
    }

    // A certificate without its key, and authorities without a certificate, are refused by
    // the flags' parser, naming what is missing.
    for (args, missing) in [
        (&["--http-tls-cert", cert][..], "--http-tls-key"),
        (&["--grpc-tls-key", key][..], "--grpc-tls-cert"),
        (&["--http-tls-client-ca", cert][..], "--http-tls-cert"),
    ] {
        let mut all = vec!["serve"];
        all.extend_from_slice(args);
        let (status, _, stderr) = run(&all);
        assert!(!status.success(), "{args:?} accepted");
        assert!(stderr.contains(missing), "{args:?}: {stderr}");
    }
}

/// `tollgate bench ARGS --json`: its summary, or what it said on failing.
fn bench_json(args: &[&str]) -> Result<serde_json::Value, String> {
    let mut all = vec!["bench", "--json", "-c", "2", "-n", "40"];
    all.extend_from_slice(args);
    let (status, stdout, stderr) = run(&all);
    if !status.success() {
        return Err(stderr);
    }
    serde_json::from_str(&stdout).map_err(|err| format!("{err}: {stdout}"))
}

#[test]
fn tollgate_bench_loads_tls_listeners_with_the_client_certificate_asked_for() {
    let certificates = TestCertificates::generate("bench");
    let (cert, key, ca) = (
        path_str(&certificates.server_cert),
        path_str(&certificates.server_key),
        path_str(&certificates.ca),
    );
    let server = Server::start(&[
        "--http-tls-cert",
        cert,
        "--http-tls-key",
        key,
        "--grpc-tls-cert",
        cert,
        "--grpc-tls-key",
        key,
        "--grpc-tls-client-ca",
        ca,
    ]);
    let decided = |summary: &serde_json::Value| {
        summary["allowed"].as_u64().unwrap_or(0) + summary["rejected"].as_u64().unwrap_or(0)
    };

    let https_target = format!("https://{}", server.http);
    let summary = bench_json(&["--target", &https_target, "--tls-ca", ca]).expect("a run");
    assert_eq!(decided(&summary), 40, "{summary}");
    assert_eq!(summary["errors"], 0, "{summary}");
    assert_eq!(
        summary["target"],
        format!("https://{}/v1/check", server.http),
        "{summary}"
    );
    let forward_auth = bench_json(&["--target", &https_target, "--tls-ca", ca, "--forward-auth"])
        .expect("a forward-auth run");
    assert_eq!(decided(&forward_auth), 40, "{forward_auth}");
    // HTTP/2, chosen by ALPN, the workers' checks over one connection.
    let http2 = ["--http2", "--connections", "1"];
    let over_http2 =
        bench_json(&[&["--target", &https_target, "--tls-ca", ca][..], &http2].concat())
            .expect("a run over HTTP/2");
    assert_eq!(decided(&over_http2), 40, "{over_http2}");
    assert_eq!(over_http2["errors"], 0, "{over_http2}");
    assert_eq!(over_http2["protocol"], "HTTP/2", "{over_http2}");

    let grpc_target = format!("https://{}", server.grpc);
    let client = path_str(&certificates.client_cert);
    let client_key = path_str(&certificates.client_key);
    let summary = bench_json(&[
        "--grpc",
        &grpc_target,
        "--tls-ca",
        ca,
        "--tls-cert",
        client,
        "--tls-key",
        client_key,
        "--connections",
        "1",
    ])
    .expect("a gRPC run over TLS");
    assert_eq!(decided(&summary), 40, "{summary}");
    assert_eq!(summary["errors"], 0, "{summary}");

    // Without the client certificate the server asks for, nothing is decided.
    let refused = bench_json(&["--grpc", &grpc_target, "--tls-ca", ca]);
    assert!(refused.is_err(), "{refused:?}");
    // A certificate for another name than the one asked for fails the handshake.
    let other_name = bench_json(&[
        "--target",
        &https_target,
        "--tls-ca",
        ca,
        "--tls-server-name",
        "elsewhere.example",
    ])
    .expect_err("a certificate without the name");
    assert!(other_name.contains("TLS handshake"), "{other_name}");
}

/// A client that connects to a TLS port and says nothing, or starts its handshake and stops,
/// is let go after the header timeout, as a silent plain client is; counted as a handshake
/// that failed.
#[test]
fn a_client_silent_in_its_handshake_is_let_go_after_the_header_timeout() {
    use std::io::Write;

    let certificates = TestCertificates::generate("silent");
    let (cert, key) = (
        path_str(&certificates.server_cert),
        path_str(&certificates.server_key),
    );
    let server = Server::start(&[
        "--header-timeout",
        "500ms",
        "--grpc-tls-cert",
        cert,
        "--grpc-tls-key",
        key,
    ]);
    let silent = TcpStream::connect(server.grpc).expect("connect");
    // A TLS record header announcing a handshake message, and nothing after it.
    let mut halfway = TcpStream::connect(server.grpc).expect("connect");
    halfway
        .write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01])
        .expect("start a handshake");
    for mut stream in [silent, halfway] {
        stream
            .set_read_timeout(Some(Duration::from_secs(15)))
            .expect("timeout");
        let mut rest = Vec::new();
        // Closed by the server: the read ends (rather than timing out) with nothing sent.
        let read = stream.read_to_end(&mut rest);
        assert!(
            read.is_ok()
                || read
                    .as_ref()
                    .is_err_and(|err| err.kind() == std::io::ErrorKind::ConnectionReset),
            "still open: {read:?}"
        );
    }
    let series = "tollgate_connections_closed_total{listener=\"grpc\",reason=\"tls_handshake\"}";
    wait_for("both counted", || {
        (support::metric(&server, series) >= 2.0).then_some(())
    });
    // The server serves on.
    let answer = support::post_json(server.http, "/v1/check", CHECK);
    assert_eq!(answer.status, 200, "{answer:?}");
}
