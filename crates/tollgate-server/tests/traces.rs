//! Traces through the real binary: a collector of the tests' own (OTLP/gRPC, on a free
//! loopback port) receives the spans `tollgate serve --trace-endpoint` sends, for HTTP checks,
//! forward-auth and Envoy's `ShouldRateLimit`, each in its caller's trace (W3C's or B3's).

mod support;

use std::collections::HashMap;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue};
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use support::http2::Http2;
use support::{Scratch, Server, binary, descriptor, metric, request, serve_refused, wait_for};
use tollgate_redis::test_server::TestCertificates;

const POLICY: &str = r#"
version: "traced-1"
limits:
  - name: per-user
    domain: api
    key: [user]
    capacity: 1
    refill: 1/h
  - name: per-user-shadow
    domain: api
    key: [user]
    capacity: 1
    refill: 1/h
    mode: shadow
"#;

/// A span as received, with the resource it came from.
#[derive(Debug, Clone)]
struct Received {
    service: String,
    span: Span,
}

impl Received {
    fn trace_id(&self) -> String {
        hex(&self.span.trace_id)
    }

    /// Whether the span's status says the server failed.
    fn is_error(&self) -> bool {
        self.span.status.as_ref().map(|s| s.code) == Some(StatusCode::Error as i32)
    }

    /// Asserts that each `(key, value)` is among the span's attributes.
    fn assert_has(&self, expected: &[(&str, &str)]) {
        for (key, value) in expected {
            assert_eq!(
                self.attribute(key).as_deref(),
                Some(*value),
                "{key} of {}",
                self.span.name
            );
        }
    }

    fn attribute(&self, key: &str) -> Option<String> {
        self.span
            .attributes
            .iter()
            .find(|kv| kv.key == key)
            .map(|kv| show(kv.value.as_ref()))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn show(value: Option<&AnyValue>) -> String {
    match value.and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::ArrayValue(array)) => {
            let items: Vec<String> = array.values.iter().map(|v| show(Some(v))).collect();
            format!("[{}]", items.join(","))
        }
        other => format!("{other:?}"),
    }
}

fn string_attribute(attributes: &[KeyValue], key: &str) -> Option<String> {
    attributes
        .iter()
        .find(|kv| kv.key == key)
        .map(|kv| show(kv.value.as_ref()))
}

/// An OTLP/gRPC trace collector that keeps what it is sent.
#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<Received>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.keep(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

impl Collector {
    /// Keeps the spans of one export.
    fn keep(&self, request: ExportTraceServiceRequest) {
        let mut spans = self.spans.lock().unwrap();
        for resource_spans in request.resource_spans {
            let service = resource_spans
                .resource
                .as_ref()
                .and_then(|r| string_attribute(&r.attributes, "service.name"))
                .unwrap_or_default();
            for scope in resource_spans.scope_spans {
                for span in scope.spans {
                    spans.push(Received {
                        service: service.clone(),
                        span,
                    });
                }
            }
        }
    }
}

impl Collector {
    /// Serves on a free loopback port of a runtime of its own: the endpoint to send to.
    fn start(runtime: &tokio::runtime::Runtime) -> (Self, String) {
        let collector = Self::default();
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let service = TraceServiceServer::new(collector.clone());
        runtime.spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream(listener)),
        );
        (collector, endpoint)
    }

    /// Serves over TLS with `certificates`' server certificate, requiring clients to present
    /// one from their authority: the `https://` endpoint to send to.
    fn start_tls(
        runtime: &tokio::runtime::Runtime,
        certificates: &TestCertificates,
    ) -> (Self, String) {
        let read = |path: &std::path::Path| std::fs::read(path).unwrap();
        let identity = tonic::transport::Identity::from_pem(
            read(&certificates.server_cert),
            read(&certificates.server_key),
        );
        let tls = tonic::transport::ServerTlsConfig::new()
            .identity(identity)
            .client_ca_root(tonic::transport::Certificate::from_pem(read(
                &certificates.ca,
            )));
        let collector = Self::default();
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let endpoint = format!("https://{}", listener.local_addr().unwrap());
        let service = TraceServiceServer::new(collector.clone())
            .accept_compressed(tonic::codec::CompressionEncoding::Gzip);
        let server = tonic::transport::Server::builder()
            .tls_config(tls)
            .unwrap()
            .add_service(service)
            .serve_with_incoming(tokio_stream(listener));
        runtime.spawn(server);
        (collector, endpoint)
    }

    /// Serves OTLP/HTTP (`POST /v1/traces`, protobuf, gzip or not) on a free loopback port,
    /// over TLS with `certificates`' server certificate and requiring a client certificate when
    /// given: the endpoint to send to (without a path), and each export's `x-tenant` and
    /// `content-encoding` headers.
    fn start_http(
        runtime: &tokio::runtime::Runtime,
        certificates: Option<&TestCertificates>,
    ) -> (Self, String, Arc<Mutex<Vec<String>>>) {
        use axum::body::Bytes;
        use prost::Message;

        let collector = Self::default();
        let tenants = Arc::new(Mutex::new(Vec::new()));
        let (keeper, seen) = (collector.clone(), Arc::clone(&tenants));
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |headers: http::HeaderMap, body: Bytes| async move {
                let header = |name: &str| {
                    let value = headers.get(name).and_then(|v| v.to_str().ok());
                    value.unwrap_or_default().to_owned()
                };
                let encoding = header("content-encoding");
                seen.lock()
                    .unwrap()
                    .push(format!("{}/{encoding}", header("x-tenant")));
                let body = match encoding.as_str() {
                    "gzip" => {
                        let mut plain = Vec::new();
                        let mut gzip = flate2::read::GzDecoder::new(&body[..]);
                        std::io::Read::read_to_end(&mut gzip, &mut plain).unwrap();
                        Bytes::from(plain)
                    }
                    _ => body,
                };
                let request = ExportTraceServiceRequest::decode(body).unwrap();
                keeper.keep(request);
                let answer = ExportTraceServiceResponse::default().encode_to_vec();
                ([("content-type", "application/x-protobuf")], answer)
            }),
        );
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let Some(certificates) = certificates else {
            runtime.spawn(async move { axum::serve(listener, app).await });
            return (collector, format!("http://{addr}"), tenants);
        };
        let acceptor = tokio_rustls::TlsAcceptor::from(mutual_tls(certificates));
        runtime.spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let (acceptor, app) = (acceptor.clone(), app.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let service = hyper::service::service_fn(move |request| {
                        tower::ServiceExt::oneshot(app.clone(), request)
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                        .await;
                });
            }
        });
        (collector, format!("https://{addr}"), tenants)
    }

    fn spans(&self) -> Vec<Received> {
        self.spans.lock().unwrap().clone()
    }

    /// The span of trace `trace_id`, once it has come.
    fn wait_for_trace(&self, trace_id: &str) -> Received {
        wait_for(&format!("a span of trace {trace_id}"), || {
            self.spans().into_iter().find(|s| s.trace_id() == trace_id)
        })
    }
}

/// The flags that trust `certificates`' authority and present its client certificate to a
/// collector.
fn client_tls_flags(certificates: &TestCertificates) -> Vec<String> {
    let path = |path: &std::path::Path| path.to_str().unwrap().to_owned();
    vec![
        "--trace-tls-ca".to_owned(),
        path(&certificates.ca),
        "--trace-tls-cert".to_owned(),
        path(&certificates.client_cert),
        "--trace-tls-key".to_owned(),
        path(&certificates.client_key),
    ]
}

/// A server's TLS with `certificates`' server certificate, requiring a client certificate
/// from their authority.
fn mutual_tls(certificates: &TestCertificates) -> Arc<rustls::ServerConfig> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};

    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_file_iter(&certificates.ca).unwrap() {
        roots.add(ca.unwrap()).unwrap();
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()
    .unwrap();
    let chain = CertificateDer::pem_file_iter(&certificates.server_cert)
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(&certificates.server_key).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .unwrap();
    Arc::new(config)
}

/// The listener's connections, as tonic's server takes them.
fn tokio_stream(
    listener: tokio::net::TcpListener,
) -> impl futures_util::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    futures_util::stream::unfold(listener, |listener| async move {
        let accepted = listener.accept().await.map(|(stream, _)| stream);
        Some((accepted, listener))
    })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// `tollgate serve --config POLICY --trace-endpoint ENDPOINT ARGS`, sending its batches every
/// `delay_ms` (`OTEL_BSP_SCHEDULE_DELAY`).
fn traced_server(scratch: &Scratch, endpoint: &str, delay_ms: &str, args: &[&str]) -> Server {
    traced_server_with_env(scratch, endpoint, delay_ms, args, &[])
}

/// As [`traced_server`], with the environment variables `env` set too.
fn traced_server_with_env(
    scratch: &Scratch,
    endpoint: &str,
    delay_ms: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> Server {
    let config = scratch.write("policy.yaml", POLICY);
    let mut command = Command::new(binary());
    command
        .args(["serve", "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"])
        .args(["--config", support::path_str(&config)])
        .args(["--trace-endpoint", endpoint])
        .args(args)
        .env("OTEL_BSP_SCHEDULE_DELAY", delay_ms)
        .env_remove("OTEL_SERVICE_NAME")
        .env_remove("OTEL_RESOURCE_ATTRIBUTES")
        .envs(env.iter().copied());
    Server::start_command(command)
}

/// Envoy's call for `user`'s descriptor in `domain`, with `metadata` as Envoy sends its trace
/// context: the answer's overall code, or the call's status code.
fn should_rate_limit(
    runtime: &tokio::runtime::Runtime,
    server: &Server,
    (domain, user): (&str, &str),
    metadata: &[(&'static str, &str)],
) -> Result<i32, tonic::Code> {
    call_rls(runtime, server, (domain, user), metadata, false)
}

/// [`should_rate_limit`], its message compressed with gzip when `gzip`.
fn call_rls(
    runtime: &tokio::runtime::Runtime,
    server: &Server,
    (domain, user): (&str, &str),
    metadata: &[(&'static str, &str)],
    gzip: bool,
) -> Result<i32, tonic::Code> {
    runtime.block_on(async {
        let mut client = RateLimitServiceClient::new(server.grpc_channel().await);
        if gzip {
            client = client.send_compressed(tonic::codec::CompressionEncoding::Gzip);
        }
        let mut call = tonic::Request::new(
            envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest {
                domain: domain.to_owned(),
                descriptors: vec![descriptor(&[("user", user)])],
                hits_addend: 1,
            },
        );
        for (key, value) in metadata {
            call.metadata_mut().insert(*key, value.parse().unwrap());
        }
        match client.should_rate_limit(call).await {
            Ok(answer) => Ok(answer.into_inner().overall_code),
            Err(status) => Err(status.code()),
        }
    })
}

fn traceparent(trace_id: &str, parent: &str, sampled: bool) -> String {
    format!(
        "00-{trace_id}-{parent}-{}",
        if sampled { "01" } else { "00" }
    )
}

fn check(server: &Server, user: &str, headers: &[(&str, &str)]) -> u16 {
    let body = format!(r#"{{"domain":"api","descriptors":[{{"user":"{user}"}}]}}"#);
    check_body(server, &body, headers)
}

/// `POST /v1/check` of `body`: the status answered.
fn check_body(server: &Server, body: &str, headers: &[(&str, &str)]) -> u16 {
    let mut all = vec![("Content-Type", "application/json")];
    all.extend_from_slice(headers);
    request(server.http, "POST", "/v1/check", &all, body).status
}

#[test]
fn each_api_answers_in_a_span_of_its_callers_trace() {
    let runtime = runtime();
    let (collector, endpoint) = Collector::start(&runtime);
    let scratch = Scratch::new("traces");
    let server = traced_server(&scratch, &endpoint, "50", &[]);
    let parent = "b7ad6b7169203331";

    // An HTTP check that passes, then one that the enforced limit rejects.
    let allowed = "0af7651916cd43dd8448eb211c800001";
    let header = traceparent(allowed, parent, true);
    assert_eq!(check(&server, "u1", &[("traceparent", &header)]), 200);
    let rejected = "0af7651916cd43dd8448eb211c800002";
    let header = traceparent(rejected, parent, true);
    assert_eq!(check(&server, "u1", &[("traceparent", &header)]), 429);

    let span = collector.wait_for_trace(allowed);
    assert_eq!(span.service, "tollgate");
    assert_eq!(span.span.name, "POST /v1/check");
    assert_eq!(span.span.kind, SpanKind::Server as i32);
    assert_eq!(hex(&span.span.parent_span_id), parent);
    span.assert_has(&[
        ("http.route", "/v1/check"),
        ("http.response.status_code", "200"),
        ("tollgate.domain", "api"),
        ("tollgate.store", "memory"),
        ("tollgate.policy_version", "traced-1"),
        ("tollgate.result", "allowed"),
        ("tollgate.limits", "[per-user,per-user-shadow]"),
        ("tollgate.limits_rejecting", "[]"),
    ]);
    // The bucket's key is the user's: never on a span.
    assert!(
        span.span
            .attributes
            .iter()
            .all(|kv| !show(kv.value.as_ref()).contains("u1")),
        "{:?}",
        span.span.attributes
    );

    let span = collector.wait_for_trace(rejected);
    span.assert_has(&[
        ("http.response.status_code", "429"),
        ("tollgate.result", "rejected"),
        ("tollgate.limits_rejecting", "[per-user,per-user-shadow]"),
    ]);
    // A rejection is the limit working, not a failure of the server.
    assert!(!span.is_error());

    // Forward-auth, named by its route rather than its domain's path.
    let forward = "0af7651916cd43dd8448eb211c800003";
    let header = traceparent(forward, parent, true);
    let answer = request(
        server.http,
        "GET",
        "/v1/forward-auth/api",
        &[("x-tollgate-user", "u2"), ("traceparent", &header)],
        "",
    );
    assert_eq!(answer.status, 200);
    let span = collector.wait_for_trace(forward);
    assert_eq!(span.span.name, "GET /v1/forward-auth/{domain}");
    span.assert_has(&[
        ("url.path", "/v1/forward-auth/api"),
        ("network.protocol.version", "1.1"),
        ("tollgate.result", "allowed"),
    ]);

    // Envoy's call, with the trace context in its metadata as Envoy sends it.
    let grpc = "0af7651916cd43dd8448eb211c800004";
    let header = traceparent(grpc, parent, true);
    let code = should_rate_limit(
        &runtime,
        &server,
        ("api", "u2"),
        &[("traceparent", &header)],
    );
    // u2's one token went to forward-auth.
    assert_eq!(code, Ok(2), "OVER_LIMIT");
    let span = collector.wait_for_trace(grpc);
    assert_eq!(
        span.span.name,
        "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
    );
    assert_eq!(span.span.kind, SpanKind::Server as i32);
    assert_eq!(hex(&span.span.parent_span_id), parent);
    span.assert_has(&[
        ("rpc.system", "grpc"),
        ("rpc.service", "envoy.service.ratelimit.v3.RateLimitService"),
        ("rpc.method", "ShouldRateLimit"),
        ("rpc.grpc.status_code", "0"),
        ("tollgate.result", "rejected"),
    ]);

    // Envoy's Zipkin tracer sends B3's headers instead.
    let zipkin = "0af7651916cd43dd8448eb211c800006";
    let b3 = [
        ("x-b3-traceid", zipkin),
        ("x-b3-spanid", parent),
        ("x-b3-sampled", "1"),
    ];
    let code = should_rate_limit(&runtime, &server, ("api", "u5"), &b3);
    assert_eq!(code, Ok(1), "OK");
    let span = collector.wait_for_trace(zipkin);
    assert_eq!(hex(&span.span.parent_span_id), parent);
    span.assert_has(&[("tollgate.result", "allowed")]);
    // A call compressed with gzip, as gRPC libraries send every call when told to.
    let gzipped = "0af7651916cd43dd8448eb211c80000a";
    let header = traceparent(gzipped, parent, true);
    let code = call_rls(
        &runtime,
        &server,
        ("api", "u9"),
        &[("traceparent", &header)],
        true,
    );
    assert_eq!(code, Ok(1), "OK");
    collector.wait_for_trace(gzipped).assert_has(&[
        ("rpc.grpc.status_code", "0"),
        ("tollgate.result", "allowed"),
    ]);
    // ...or B3's single header.
    let single = "0af7651916cd43dd8448eb211c800007";
    let header = format!("{single}-{parent}-1");
    assert_eq!(check(&server, "u6", &[("b3", &header)]), 200);
    assert_eq!(
        hex(&collector.wait_for_trace(single).span.parent_span_id),
        parent
    );

    // A call refused (no domain): its status on the span, the client's error, not the
    // server's failure.
    let refused = "0af7651916cd43dd8448eb211c800008";
    let header = traceparent(refused, parent, true);
    let code = should_rate_limit(&runtime, &server, ("", "u7"), &[("traceparent", &header)]);
    assert_eq!(code, Err(tonic::Code::InvalidArgument));
    let span = collector.wait_for_trace(refused);
    span.assert_has(&[("rpc.grpc.status_code", "3")]);
    assert!(!span.is_error());

    // Bad input: the client's error, answered in a span that is not the server's failure.
    let bad = "0af7651916cd43dd8448eb211c800005";
    let header = traceparent(bad, parent, true);
    assert_eq!(check_body(&server, "{", &[("traceparent", &header)]), 400);
    let span = collector.wait_for_trace(bad);
    span.assert_has(&[("http.response.status_code", "400")]);
    assert!(!span.is_error());

    // A cost no bucket can hold: decided as invalid, the client's error.
    let too_much = "0af7651916cd43dd8448eb211c800009";
    let header = traceparent(too_much, parent, true);
    let body = r#"{"domain":"api","descriptors":[{"user":"u8"}],"cost":5}"#;
    assert_eq!(check_body(&server, body, &[("traceparent", &header)]), 400);
    let span = collector.wait_for_trace(too_much);
    span.assert_has(&[
        ("http.response.status_code", "400"),
        ("tollgate.result", "invalid"),
    ]);
    assert!(!span.is_error());

    // Probes and scrapes: no spans, though they carry no context either.
    let before = collector.spans().len();
    for path in ["/healthz", "/readyz", "/metrics"] {
        assert_eq!(request(server.http, "GET", path, &[], "").status, 200);
    }
    runtime.block_on(async {
        use tonic_health::pb::HealthCheckRequest;
        use tonic_health::pb::health_client::HealthClient;
        let mut client = HealthClient::new(server.grpc_channel().await);
        client.check(HealthCheckRequest::default()).await.unwrap();
    });
    // No trace context: a trace of its own (every one, at the default ratio).
    assert_eq!(check(&server, "u3", &[]), 200);
    let root = wait_for("a root span", || {
        collector
            .spans()
            .into_iter()
            .skip(before)
            .find(|s| s.span.name == "POST /v1/check")
    });
    assert!(root.span.parent_span_id.is_empty());
    let names: Vec<String> = collector.spans()[before..]
        .iter()
        .map(|s| s.span.name.clone())
        .collect();
    assert_eq!(names, ["POST /v1/check"]);
    // Every span so far went out, counted.
    let sent = wait_for("the spans counted as sent", || {
        let sent = metric(
            &server,
            r#"tollgate_trace_spans_exported_total{result="sent"}"#,
        );
        (sent >= collector.spans().len() as f64).then_some(sent)
    });
    assert_eq!(sent, 11.0, "every span of this test");
    assert_eq!(
        metric(
            &server,
            r#"tollgate_trace_spans_exported_total{result="failed"}"#
        ),
        0.0
    );

    assert!(server.terminate().success());
}

#[test]
fn sampling_follows_the_caller_and_the_last_spans_go_out_at_the_stop() {
    let runtime = runtime();
    let (collector, endpoint) = Collector::start(&runtime);
    let scratch = Scratch::new("traces-sampling");
    // Batches every minute: what arrives, arrives at the stop.
    let server = traced_server(&scratch, &endpoint, "60000", &["--trace-sample-ratio", "0"]);
    let parent = "b7ad6b7169203331";
    let sampled = "1af7651916cd43dd8448eb211c800001";
    let unsampled = "1af7651916cd43dd8448eb211c800002";
    let header = traceparent(sampled, parent, true);
    assert_eq!(check(&server, "u1", &[("traceparent", &header)]), 200);
    let header = traceparent(unsampled, parent, false);
    assert_eq!(check(&server, "u2", &[("traceparent", &header)]), 200);
    // Without a context, at a ratio of 0: no trace.
    assert_eq!(check(&server, "u3", &[]), 200);
    // A malformed context counts as none.
    assert_eq!(check(&server, "u4", &[("traceparent", "00-zz-yy-01")]), 200);

    let status = server.terminate_within(Duration::from_secs(20));
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    let spans = collector.spans();
    let traces: Vec<String> = spans.iter().map(Received::trace_id).collect();
    assert_eq!(traces, [sampled], "{spans:#?}");
}

#[test]
fn a_collector_that_is_down_holds_no_request_nor_the_stop() {
    // A port nothing listens on: taken, then let go.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let scratch = Scratch::new("traces-down");
    let server = traced_server(&scratch, &format!("http://127.0.0.1:{port}"), "50", &[]);
    let mut counts: HashMap<u16, usize> = HashMap::new();
    for i in 0..200 {
        *counts
            .entry(check(&server, &format!("u{i}"), &[]))
            .or_default() += 1;
    }
    assert_eq!(counts, HashMap::from([(200, 200)]));
    // The lost spans are counted, for a dashboard to show.
    wait_for("failed exports counted", || {
        let failed = metric(
            &server,
            r#"tollgate_trace_spans_exported_total{result="failed"}"#,
        );
        (failed > 0.0).then_some(())
    });
    let status = server.terminate_within(Duration::from_secs(20));
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
}

/// A collector on TLS with a private authority, requiring a client certificate (as an
/// OTLP receiver with `client_ca_file`): spans reach it with the authority and the client
/// certificate given, and without the certificate every export fails, counted.
#[test]
fn spans_reach_a_collector_on_mutual_tls_with_a_private_authority() {
    let runtime = runtime();
    let certificates = TestCertificates::generate("traces-mtls");
    let (collector, endpoint) = Collector::start_tls(&runtime, &certificates);
    let scratch = Scratch::new("traces-mtls");
    let flags = client_tls_flags(&certificates);
    let trusted: Vec<&str> = flags.iter().map(String::as_str).collect();
    // Compressed as the SDK's variable asks, which the collector accepts.
    let gzip = [("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")];
    let server = traced_server_with_env(&scratch, &endpoint, "50", &trusted, &gzip);
    let trace_id = "5af7651916cd43dd8448eb211c80319c";
    let header = traceparent(trace_id, "b7ad6b7169203331", true);
    assert_eq!(check(&server, "u1", &[("traceparent", &header)]), 200);
    let span = collector.wait_for_trace(trace_id);
    assert_eq!(span.span.name, "POST /v1/check");
    drop(server);

    // The authority alone: no client certificate.
    let anonymous = traced_server(&scratch, &endpoint, "50", &trusted[..2]);
    let trace_id = "5af7651916cd43dd8448eb211c80319d";
    let header = traceparent(trace_id, "b7ad6b7169203331", true);
    assert_eq!(check(&anonymous, "u1", &[("traceparent", &header)]), 200);
    wait_for(
        "exports without a client certificate failed, counted",
        || {
            let failed = metric(
                &anonymous,
                r#"tollgate_trace_spans_exported_total{result="failed"}"#,
            );
            (failed > 0.0).then_some(())
        },
    );
    assert!(
        collector.spans().iter().all(|s| s.trace_id() != trace_id),
        "a span arrived without a client certificate"
    );
}

/// OTLP/HTTP, as collectors' port 4318 and vendors' HTTP-only endpoints take it: spans posted
/// to the endpoint's `/v1/traces` with the SDK's headers and compression, in plain text and on
/// mutual TLS.
#[test]
fn spans_reach_a_collector_over_otlp_http() {
    let runtime = runtime();
    let (collector, endpoint, tenants) = Collector::start_http(&runtime, None);
    let scratch = Scratch::new("traces-otlp-http");
    let env = [
        ("TOLLGATE_TRACE_PROTOCOL", "http/protobuf"),
        ("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=t1"),
        ("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip"),
    ];
    let server = traced_server_with_env(&scratch, &endpoint, "50", &[], &env);
    let trace_id = "6af7651916cd43dd8448eb211c80319c";
    let header = traceparent(trace_id, "b7ad6b7169203331", true);
    assert_eq!(check(&server, "u1", &[("traceparent", &header)]), 200);
    let span = collector.wait_for_trace(trace_id);
    assert_eq!(span.span.name, "POST /v1/check");
    assert_eq!(span.service, "tollgate");
    // A check over HTTP/2 says so.
    let over_http2 = "6af7651916cd43dd8448eb211c8031aa";
    let header = traceparent(over_http2, "b7ad6b7169203331", true);
    let answer = runtime.block_on(async {
        let connection = Http2::connect(server.http).await;
        let headers = [
            ("content-type", "application/json"),
            ("traceparent", &header),
        ];
        let body = r#"{"domain":"api","descriptors":[{"user":"u2"}]}"#;
        connection
            .request("POST", "/v1/check", &headers, body)
            .await
    });
    assert_eq!(answer.map(|a| a.status).ok(), Some(200));
    let span = collector.wait_for_trace(over_http2);
    span.assert_has(&[("network.protocol.version", "2")]);
    assert!(
        tenants.lock().unwrap().iter().all(|t| t == "t1/gzip"),
        "{tenants:?}"
    );
    wait_for("the export counted as sent", || {
        let sent = metric(
            &server,
            r#"tollgate_trace_spans_exported_total{result="sent"}"#,
        );
        (sent >= 1.0).then_some(())
    });
    drop(server);

    let certificates = TestCertificates::generate("traces-otlp-https");
    let (collector, endpoint, _) = Collector::start_http(&runtime, Some(&certificates));
    let flags = client_tls_flags(&certificates);
    let mut https = vec!["--trace-protocol", "http/protobuf"];
    https.extend(flags.iter().map(String::as_str));
    let server = traced_server(&scratch, &endpoint, "50", &https);
    let trace_id = "6af7651916cd43dd8448eb211c80319d";
    let header = traceparent(trace_id, "b7ad6b7169203331", true);
    assert_eq!(check(&server, "u1", &[("traceparent", &header)]), 200);
    let span = collector.wait_for_trace(trace_id);
    assert_eq!(span.span.name, "POST /v1/check");
}

/// `tollgate bench --header` sends a trace context with every request: over HTTP/1.1, HTTP/2
/// and gRPC (as metadata) the server's spans join it, the way a user follows a load test in
/// the traces.
#[test]
fn bench_requests_carry_the_headers_given() {
    let runtime = runtime();
    let (collector, endpoint) = Collector::start(&runtime);
    let scratch = Scratch::new("traces-bench");
    // Only callers' sampled traces: the spans that arrive are the load's.
    let server = traced_server(&scratch, &endpoint, "50", &["--trace-sample-ratio", "0"]);
    let http = format!("http://{}", server.http);
    let grpc = server.grpc.to_string();
    let cases: [(&str, &[&str], &str); 3] = [
        (
            "7af7651916cd43dd8448eb211c800001",
            &["--target", &http],
            "1.1",
        ),
        (
            "7af7651916cd43dd8448eb211c800002",
            &["--target", &http, "--http2"],
            "2",
        ),
        ("7af7651916cd43dd8448eb211c800003", &["--grpc", &grpc], ""),
    ];
    for (trace_id, target, version) in cases {
        let header = format!(
            "traceparent: {}",
            traceparent(trace_id, "b7ad6b7169203331", true)
        );
        let args = [
            &["bench"][..],
            target,
            &["-n", "2", "-c", "1", "-H", &header, "--json"],
        ];
        let (status, stdout, stderr) = support::run(&args.concat());
        assert!(status.success(), "{target:?}: {stderr}");
        let summary: serde_json::Value = serde_json::from_str(&stdout).expect("a JSON summary");
        assert_eq!(summary["errors"], 0, "{summary}");
        let span = collector.wait_for_trace(trace_id);
        if version.is_empty() {
            assert!(
                span.span.name.ends_with("/ShouldRateLimit"),
                "{}",
                span.span.name
            );
        } else {
            assert_eq!(span.span.name, "POST /v1/check");
            span.assert_has(&[("network.protocol.version", version)]);
        }
    }
    // Two requests each, every one in its run's trace, and nothing else.
    wait_for("the six requests' spans", || {
        (collector.spans().len() >= 6).then_some(())
    });
    let traces: Vec<String> = collector.spans().iter().map(Received::trace_id).collect();
    assert_eq!(traces.len(), 6, "{traces:?}");
    for (trace_id, _, _) in cases {
        assert_eq!(
            traces.iter().filter(|t| *t == trace_id).count(),
            2,
            "{traces:?}"
        );
    }
}

#[test]
fn trace_flags_are_checked_at_the_start() {
    let line = serve_refused(&["--trace-endpoint", "collector:4317"]);
    assert!(line.contains("--trace-endpoint"), "{line}");
    // A URL the exporter cannot use: one line, not a panic on the way out.
    let line = serve_refused(&["--trace-endpoint", "http://bad host:4317"]);
    assert!(
        line.contains("cannot send traces to http://bad host:4317"),
        "{line}"
    );
    support::assert_serve_flags_refused(&[
        ("--trace-sample-ratio", "2", "not a ratio from 0 to 1"),
        ("--trace-sample-ratio", "150%", "not a ratio from 0 to 1"),
        ("--trace-protocol", "http/json", "invalid value"),
    ]);
    for flag in [
        ["--trace-sample-ratio", "0.5"],
        ["--trace-protocol", "grpc"],
    ] {
        let (status, _, stderr) = support::run(&[&["serve"][..], &flag].concat());
        assert!(!status.success(), "{flag:?}");
        assert!(stderr.contains("--trace-endpoint"), "{stderr}");
    }

    // TLS files: for an https:// collector only, each read and checked at the start.
    let certificates = TestCertificates::generate("traces-flags");
    let ca = certificates.ca.to_str().unwrap();
    let key = certificates.client_key.to_str().unwrap();
    let line = serve_refused(&[
        "--trace-endpoint",
        "http://127.0.0.1:4317",
        "--trace-tls-ca",
        ca,
    ]);
    assert!(
        line.contains("are for an https:// --trace-endpoint"),
        "{line}"
    );
    let https = ["--trace-endpoint", "https://127.0.0.1:4317"];
    let line = serve_refused(&[&https[..], &["--trace-tls-ca", "/nonexistent/ca.pem"]].concat());
    assert!(
        line.contains("--trace-tls-ca /nonexistent/ca.pem"),
        "{line}"
    );
    let line = serve_refused(&[&https[..], &["--trace-tls-ca", key]].concat());
    assert!(line.contains("no certificate in PEM"), "{line}");
    let line =
        serve_refused(&[&https[..], &["--trace-tls-cert", ca, "--trace-tls-key", ca]].concat());
    assert!(
        line.contains("--trace-tls-key") && line.contains("no private key"),
        "{line}"
    );
    let (status, _, stderr) =
        support::run(&[&["serve"][..], &https, &["--trace-tls-cert", ca]].concat());
    assert!(!status.success());
    assert!(stderr.contains("--trace-tls-key"), "{stderr}");
}

/// A JSON answer's body with its times (which move between two servers asked a moment
/// apart) checked to be within a second of `other`'s and taken out; any other body as it is.
fn without_times(body: &str, other: &str) -> String {
    let (Ok(mut value), Ok(other)) = (
        serde_json::from_str::<serde_json::Value>(body),
        serde_json::from_str::<serde_json::Value>(other),
    ) else {
        return body.to_owned();
    };
    if let Some(limits) = value.get_mut("limits").and_then(|l| l.as_array_mut()) {
        for (index, limit) in limits.iter_mut().enumerate() {
            for field in ["retry_after_ms", "reset_after_ms"] {
                if let Some(ms) = limit.get(field).and_then(serde_json::Value::as_u64) {
                    let theirs = other["limits"][index][field].as_u64().unwrap_or(u64::MAX);
                    assert!(
                        ms.abs_diff(theirs) < 1000,
                        "{field}: {body} against {other}"
                    );
                    limit[field] = serde_json::Value::Null;
                }
            }
        }
    }
    value.to_string()
}

#[test]
fn the_usual_routes_answer_alike_traced_or_not() {
    // `/v1/check`, forward-auth and `/v1/noop` are answered without the router, which makes
    // the other routes' spans: traced, they get the same answers, in spans named alike.
    let runtime = runtime();
    let (collector, endpoint) = Collector::start(&runtime);
    let scratch = Scratch::new("traces-direct-routes");
    let traced = traced_server(&scratch, &endpoint, "50", &[]);
    let config = scratch.write("policy.yaml", POLICY);
    let plain = Server::start(&["--config", support::path_str(&config)]);
    // Forward-auth's descriptor comes from the headers; the others ignore this one.
    let json = [
        ("Content-Type", "application/json"),
        ("x-tollgate-user", "f1"),
    ];
    let huge = format!(
        r#"{{"domain":"api","descriptors":[{{"user":"{}"}}]}}"#,
        "x".repeat(70_000)
    );
    let cases: Vec<(&str, &str, &str)> = vec![
        (
            "POST",
            "/v1/check",
            r#"{"domain":"api","descriptors":[{"user":"u1"}]}"#,
        ),
        (
            "POST",
            "/v1/check",
            r#"{"domain":"api","descriptors":[{"user":"u1"}]}"#,
        ),
        (
            "POST",
            "/v1/check?from=test",
            r#"{"domain":"api","descriptors":[{"user":"u2"}]}"#,
        ),
        (
            "POST",
            "/v1/check",
            r#"{"domain":"other","descriptors":[{"user":"u1"}]}"#,
        ),
        (
            "POST",
            "/v1/check",
            r#"{"domain":"api","descriptors":[{"user":"u3"}],"cost":2}"#,
        ),
        (
            "POST",
            "/v1/check",
            r#"{"domain":"api","descriptors":[{"user":"u3"}],"cost":0}"#,
        ),
        (
            "POST",
            "/v1/check",
            r#"{"domain":"api","descriptors":[{"user":"u4"}],"cots":1}"#,
        ),
        (
            "POST",
            "/v1/check",
            r#"{"domain":"api","descriptors":[{"user":5}]}"#,
        ),
        ("POST", "/v1/check", "{not json"),
        ("POST", "/v1/check", ""),
        ("POST", "/v1/check", &huge),
        ("GET", "/v1/check", ""),
        (
            "POST",
            "/v1/check/",
            r#"{"domain":"api","descriptors":[{"user":"u5"}]}"#,
        ),
        ("POST", "/v1/noop", "anything"),
        ("GET", "/v1/noop", ""),
        ("HEAD", "/v1/noop", ""),
        ("POST", "/v1/noop", &huge),
        (
            "POST",
            "/v1/explain",
            r#"{"domain":"api","descriptors":[{"user":"u1"}]}"#,
        ),
        ("GET", "/v1/forward-auth/api", ""),
        ("GET", "/v1/forward-auth/a%70i?from=nginx", ""),
        ("POST", "/v1/forward-auth/other", "a body no one reads"),
        ("GET", "/v1/forward-auth/%A0", ""),
        ("GET", "/v1/forward-auth/", ""),
        ("GET", "/v1/forward-auth/api/x", ""),
        ("HEAD", "/v1/forward-auth/api", ""),
        ("PUT", "/v1/forward-auth/api", ""),
    ];
    let statuses: Vec<u16> = cases
        .iter()
        .map(|&(method, path, body)| {
            let traced_answer = request(traced.http, method, path, &json, body);
            let untraced = request(plain.http, method, path, &json, body);
            let what = format!("{method} {path} {}", &body[..body.len().min(60)]);
            assert_eq!(traced_answer.status, untraced.status, "{what}");
            assert_eq!(
                without_times(&traced_answer.body, &untraced.body),
                without_times(&untraced.body, &traced_answer.body),
                "{what}"
            );
            let mut names: Vec<&String> = traced_answer.headers.keys().collect();
            names.sort();
            let mut untraced_names: Vec<&String> = untraced.headers.keys().collect();
            untraced_names.sort();
            assert_eq!(names, untraced_names, "{what}");
            for name in ["content-type", "ratelimit-policy", "allow"] {
                assert_eq!(
                    traced_answer.header(name),
                    untraced.header(name),
                    "{what}: {name}"
                );
            }
            untraced.status
        })
        .collect();
    assert_eq!(
        statuses,
        [
            200, 429, 200, 200, 400, 400, 400, 400, 400, 400, 413, 405, 404, 200, 200, 200, 413,
            200, 200, 429, 200, 400, 404, 404, 429, 405
        ]
    );
    // The same requests counted alike: decisions, and the ones refused as malformed.
    let decisions = |api: &str, result: &str| {
        format!(
            r#"tollgate_decisions_total{{limit="per-user",result="{result}",mode="enforce",api="{api}"}}"#
        )
    };
    for (series, count) in [
        (
            r#"tollgate_invalid_requests_total{api="http"}"#.to_owned(),
            7.0,
        ),
        (
            r#"tollgate_invalid_requests_total{api="forward_auth"}"#.to_owned(),
            1.0,
        ),
        (decisions("http", "allowed"), 2.0),
        (decisions("http", "rejected"), 1.0),
        (decisions("forward_auth", "allowed"), 1.0),
        (decisions("forward_auth", "rejected"), 2.0),
    ] {
        assert_eq!(metric(&plain, &series), count, "{series}");
        assert_eq!(metric(&traced, &series), count, "{series}");
    }
    // And the traced server's checks and subrequests were each in a span.
    wait_for("a span of each check and subrequest", || {
        let spans = collector.spans();
        let named = |name: &str| spans.iter().filter(|s| s.span.name == name).count();
        (named("POST /v1/check") >= 10 && named("GET /v1/forward-auth/{domain}") >= 3).then_some(())
    });
    assert!(traced.terminate().success());
    assert!(plain.terminate().success());
}

/// On Redis, a decision's wait on the store is a client span of its own, the child of the
/// request's: in a trace, the round trip shows apart from the server's own work, and a store
/// that could not answer shows as that span's error, with its reason.
#[test]
fn a_decision_on_redis_waits_in_a_span_of_its_own() {
    let runtime = runtime();
    let (collector, endpoint) = Collector::start(&runtime);
    let scratch = Scratch::new("traces-redis");
    let mut redis = tollgate_redis::test_server::RedisServer::start();
    let url = redis.url();
    let server = traced_server(&scratch, &endpoint, "50", &["--store", &url]);
    let parent = "b7ad6b7169203331";
    // Both spans of a trace, once both have come: the request's and the store's.
    let both = |trace_id: &str, request: &str| {
        wait_for(&format!("two spans of trace {trace_id}"), || {
            let spans: Vec<Received> = collector
                .spans()
                .into_iter()
                .filter(|s| s.trace_id() == trace_id)
                .collect();
            let of = |name: &str| spans.iter().find(|s| s.span.name == name).cloned();
            Some((of(request)?, of("EVALSHA")?))
        })
    };

    let decided = "0af7651916cd43dd8448eb211c800101";
    let header = traceparent(decided, parent, true);
    assert_eq!(check(&server, "r1", &[("traceparent", &header)]), 200);
    let (request, store) = both(decided, "POST /v1/check");
    assert_eq!(store.span.parent_span_id, request.span.span_id);
    assert_eq!(store.span.kind, SpanKind::Client as i32);
    store.assert_has(&[
        ("db.system.name", "redis"),
        ("db.operation.name", "EVALSHA"),
        ("tollgate.store.call", "decide"),
    ]);
    assert!(!store.is_error());
    assert!(store.span.start_time_unix_nano >= request.span.start_time_unix_nano);
    assert!(store.span.end_time_unix_nano <= request.span.end_time_unix_nano);
    request.assert_has(&[("tollgate.store", "redis"), ("tollgate.result", "allowed")]);

    // Envoy's call, likewise.
    let called = "0af7651916cd43dd8448eb211c800102";
    let header = traceparent(called, parent, true);
    let code = should_rate_limit(
        &runtime,
        &server,
        ("api", "r2"),
        &[("traceparent", &header)],
    );
    assert_eq!(code, Ok(1), "OK");
    let (request, store) = both(
        called,
        "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
    );
    assert_eq!(store.span.parent_span_id, request.span.span_id);

    // Redis gone: the limit fails closed, and the store's span says why.
    redis.kill();
    let failed = "0af7651916cd43dd8448eb211c800103";
    let header = traceparent(failed, parent, true);
    assert_eq!(check(&server, "r3", &[("traceparent", &header)]), 503);
    let (request, store) = both(failed, "POST /v1/check");
    assert!(store.is_error(), "{:?}", store.span.status);
    assert!(store.attribute("tollgate.unavailable").is_some());
    request.assert_has(&[("tollgate.result", "failed_closed")]);
}
