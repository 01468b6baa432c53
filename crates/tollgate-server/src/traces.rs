//! Traces: a span for each request the server answers, joined to its caller's trace and sent
//! to an OpenTelemetry collector over OTLP/gRPC or OTLP/HTTP (`--trace-endpoint`).
//!
//! Why: a request that was slow or refused is investigated from its trace, and the rate-limit
//! call belongs inside it: which API, how long it took, which limits applied and which one
//! said no. Envoy sends its trace context with every Rate Limit Service call once it traces
//! (W3C `traceparent` from its OpenTelemetry tracer, B3's `x-b3-*` from its Zipkin tracer),
//! and so can any HTTP client; tollgate's span becomes the child of the caller's, and is kept
//! or dropped as the caller's trace was sampled. A request without a trace context starts a
//! trace of its own, sampled at `--trace-sample-ratio`.
//!
//! Nothing here runs unless traces are asked for: the request paths look at one `Option`, and
//! the HTTP router gains its tracing layer only then. Spans are sent in batches from a thread
//! of the SDK's own, through a gRPC channel (or HTTP connections, `otlp_http.rs`) driven by a
//! small runtime of this module's, so a slow or absent collector never holds a request: spans
//! past the batch queue are dropped, and failed exports are logged (by the SDK) and counted
//! (here).

mod otlp_http;

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::HeaderMap;
use opentelemetry::propagation::TextMapCompositePropagator;
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId,
    TraceState, Tracer, TracerProvider as _, get_active_span,
};
use opentelemetry::{Context, KeyValue, Value};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig, WithTonicConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider, SpanData, SpanExporter};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tollgate_policy::Outcome;

use crate::decider::DecideError;

/// How long a stop waits for the spans still queued to reach the collector.
const FLUSH_AT_STOP: Duration = Duration::from_secs(5);

/// Why traces could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TracesError {
    /// The endpoint is not an `http://` or `https://` URL.
    #[error("--trace-endpoint {endpoint:?} is not an http:// or https:// URL of an OTLP collector")]
    Endpoint {
        /// The endpoint given.
        endpoint: String,
    },
    /// The exporter's runtime could not start.
    #[error("cannot start the runtime that sends traces: {0}")]
    Runtime(std::io::Error),
    /// TLS files were given for an `http://` collector.
    #[error(
        "--trace-tls-ca, --trace-tls-cert and --trace-tls-key are for an https:// --trace-endpoint, not {endpoint}"
    )]
    TlsInPlain {
        /// The endpoint given.
        endpoint: String,
    },
    /// A TLS file could not be read.
    #[error("{flag} {}: {source}", path.display())]
    TlsFile {
        /// The flag that named it.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// Why it could not be read.
        source: std::io::Error,
    },
    /// A TLS file holds no PEM of the kind its flag needs.
    #[error("{flag} {}: no {what} in PEM", path.display())]
    TlsPem {
        /// The flag that named it.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// What was looked for.
        what: &'static str,
    },
    /// TLS settings that cannot be made from the files.
    #[error("{0}")]
    TlsSettings(String),
    /// The exporter refused its configuration.
    #[error("cannot send traces to {endpoint}: {source}")]
    Exporter {
        /// The endpoint given.
        endpoint: String,
        /// The exporter's reason.
        source: opentelemetry_otlp::ExporterBuildError,
    },
}

/// How the exporter speaks TLS to an `https://` collector, beyond checking it against the
/// system's authorities: a private authority's, and a client certificate for a collector
/// that requires one (its OTLP receiver's `client_ca_file`).
#[derive(Debug, Clone, Default)]
pub struct TraceTls {
    /// Trust the authorities of this PEM file instead of the system's.
    pub ca: Option<PathBuf>,
    /// Present this PEM certificate chain and private key.
    pub identity: Option<(PathBuf, PathBuf)>,
}

impl TraceTls {
    /// Whether any file is given.
    fn is_set(&self) -> bool {
        self.ca.is_some() || self.identity.is_some()
    }

    /// The files' contents, each read and checked now, so that a wrong file stops the start
    /// rather than fail every export.
    fn load(&self) -> Result<LoadedTls, TracesError> {
        let certificates = |flag: &'static str, path: &Path| {
            let pem = read(flag, path)?;
            let found: Vec<_> = CertificateDer::pem_slice_iter(&pem)
                .filter_map(Result::ok)
                .collect();
            if found.is_empty() {
                return Err(TracesError::TlsPem {
                    flag,
                    path: path.to_owned(),
                    what: "certificate",
                });
            }
            Ok((pem, found))
        };
        let ca = match &self.ca {
            Some(ca) => Some(certificates("--trace-tls-ca", ca)?),
            None => None,
        };
        let identity = match &self.identity {
            Some((cert, key)) => {
                let chain = certificates("--trace-tls-cert", cert)?;
                let key_pem = read("--trace-tls-key", key)?;
                let Ok(key_der) = PrivateKeyDer::from_pem_slice(&key_pem) else {
                    return Err(TracesError::TlsPem {
                        flag: "--trace-tls-key",
                        path: key.clone(),
                        what: "private key",
                    });
                };
                Some((chain, (key_pem, key_der)))
            }
            None => None,
        };
        Ok(LoadedTls { ca, identity })
    }
}

/// A PEM file's bytes and what was parsed from them.
type Pem<T> = (Vec<u8>, T);

/// [`TraceTls`]'s files, read and parsed.
struct LoadedTls {
    ca: Option<Pem<Vec<CertificateDer<'static>>>>,
    identity: Option<(
        Pem<Vec<CertificateDer<'static>>>,
        Pem<PrivateKeyDer<'static>>,
    )>,
}

impl LoadedTls {
    /// tonic's TLS settings, for OTLP/gRPC.
    fn for_grpc(&self) -> tonic::transport::ClientTlsConfig {
        use tonic::transport::{Certificate, ClientTlsConfig, Identity};
        let config = match &self.ca {
            Some((pem, _)) => ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem)),
            None => ClientTlsConfig::new().with_native_roots(),
        };
        match &self.identity {
            Some(((chain, _), (key, _))) => config.identity(Identity::from_pem(chain, key)),
            None => config,
        }
    }

    /// rustls' settings, for OTLP/HTTP: the given authorities or the system's, and HTTP/1.1.
    fn for_http(&self) -> Result<rustls::ClientConfig, TracesError> {
        let mut roots = rustls::RootCertStore::empty();
        match &self.ca {
            Some((_, certificates)) => {
                let (added, _) = roots.add_parsable_certificates(certificates.iter().cloned());
                if added == 0 {
                    return Err(TracesError::TlsSettings(
                        "--trace-tls-ca holds no authority rustls can use".to_owned(),
                    ));
                }
            }
            None => {
                let found = rustls_native_certs::load_native_certs();
                roots.add_parsable_certificates(found.certs);
            }
        }
        let provider = std::sync::Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|err| TracesError::TlsSettings(err.to_string()))?
            .with_root_certificates(roots);
        let mut config = match &self.identity {
            Some(((_, chain), (_, key))) => builder
                .with_client_auth_cert(chain.clone(), key.clone_key())
                .map_err(|err| {
                    TracesError::TlsSettings(format!("--trace-tls-cert and --trace-tls-key: {err}"))
                })?,
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(config)
    }
}

/// A TLS file's bytes.
fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>, TracesError> {
    std::fs::read(path).map_err(|source| TracesError::TlsFile {
        flag,
        path: path.to_owned(),
        source,
    })
}

/// How spans travel to the collector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum TraceProtocol {
    /// OTLP over gRPC (a collector's port 4317).
    #[default]
    Grpc,
    /// OTLP over HTTP with protobuf bodies (port 4318), for collectors and vendors' endpoints
    /// that take only that.
    #[value(name = "http/protobuf")]
    HttpProtobuf,
}

/// The URL spans are posted to over OTLP/HTTP: `endpoint` when it has a path, else its
/// `/v1/traces`, as the SDKs make it from `OTEL_EXPORTER_OTLP_ENDPOINT`.
fn traces_url(endpoint: &str) -> String {
    let trimmed = endpoint.trim_end_matches('/');
    let after_scheme = trimmed.split_once("://").map_or(trimmed, |(_, rest)| rest);
    if after_scheme.contains('/') {
        endpoint.to_owned()
    } else {
        format!("{trimmed}/v1/traces")
    }
}

/// The share of requests without a trace context of their own that start a sampled trace: from
/// 0 (none; only callers' sampled traces are followed) to 1 (all).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleRatio(f64);

impl SampleRatio {
    /// Every such request.
    pub const ALL: SampleRatio = SampleRatio(1.0);
}

impl std::str::FromStr for SampleRatio {
    type Err = String;

    /// A number from 0 to 1 (`0.01`), or a percentage (`1%`).
    fn from_str(text: &str) -> Result<Self, String> {
        let (number, scale) = match text.strip_suffix('%') {
            Some(number) => (number, 100.0),
            None => (text, 1.0),
        };
        let ratio = number
            .trim()
            .parse::<f64>()
            .ok()
            .map(|n| n / scale)
            .filter(|r| (0.0..=1.0).contains(r))
            .ok_or_else(|| format!("{text:?} is not a ratio from 0 to 1 (0.01) or 0% to 100%"))?;
        Ok(SampleRatio(ratio))
    }
}

/// The server's tracer: where spans start, and the pipeline that sends them.
pub struct Traces {
    tracer: SdkTracer,
    /// The share of requests without a caller's trace that start one: the sampler's, known
    /// here so that none is made at 0.
    ratio: f64,
    /// Reads a caller's trace context: B3 (single or multiple headers), then W3C's, which
    /// wins when a caller sends both.
    propagator: TextMapCompositePropagator,
    provider: SdkTracerProvider,
    /// Drives the exporter's gRPC channel, apart from the runtimes that serve requests.
    runtime: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for Traces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Traces").finish_non_exhaustive()
    }
}

impl Traces {
    /// Sends spans to the OTLP collector at `endpoint` over `protocol` (`http://collector:4317`
    /// for gRPC, `http://collector:4318` for HTTP, whose path is `/v1/traces` unless the URL
    /// gives one; `https://` with the system's authorities, or as `tls` says). The service is
    /// named `tollgate` unless `OTEL_SERVICE_NAME` (or `service.name` in
    /// `OTEL_RESOURCE_ATTRIBUTES`) says otherwise; `OTEL_EXPORTER_OTLP_HEADERS` adds headers (a
    /// vendor's API key), and the `OTEL_BSP_*` variables size the batches, as in every
    /// OpenTelemetry SDK.
    ///
    /// # Errors
    ///
    /// [`TracesError`] for an endpoint that is no URL, TLS files that cannot be used, or an
    /// exporter that cannot be made.
    pub fn start(
        endpoint: &str,
        protocol: TraceProtocol,
        ratio: SampleRatio,
        tls: &TraceTls,
    ) -> Result<Self, TracesError> {
        let https = match endpoint.split_once("://") {
            Some(("http", rest)) if !rest.is_empty() => false,
            Some(("https", rest)) if !rest.is_empty() => true,
            _ => {
                return Err(TracesError::Endpoint {
                    endpoint: endpoint.to_owned(),
                });
            }
        };
        // Checked before the runtime is made: a runtime dropped on an error here would be
        // dropped inside the caller's, which tokio refuses.
        let tls = if https {
            Some(tls.load()?)
        } else if tls.is_set() {
            return Err(TracesError::TlsInPlain {
                endpoint: endpoint.to_owned(),
            });
        } else {
            None
        };
        let http_tls = match (protocol, &tls) {
            (TraceProtocol::HttpProtobuf, Some(tls)) => Some(std::sync::Arc::new(tls.for_http()?)),
            _ => None,
        };
        // One worker: the exporter's connections and its batches are all it runs.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("tollgate-traces")
            .enable_all()
            .build()
            .map_err(TracesError::Runtime)?;
        let built = match protocol {
            TraceProtocol::Grpc => {
                let mut exporter = opentelemetry_otlp::SpanExporter::builder()
                    .with_tonic()
                    .with_endpoint(endpoint);
                if let Some(tls) = &tls {
                    exporter = exporter.with_tls_config(tls.for_grpc());
                }
                // The channel is made (and its connection task spawned) on the runtime that
                // drives it.
                let _inside = runtime.enter();
                exporter.build()
            }
            TraceProtocol::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                .with_endpoint(traces_url(endpoint))
                .with_http_client(otlp_http::Client::new(runtime.handle().clone(), http_tls))
                .build(),
        };
        let exporter = match built {
            Ok(exporter) => exporter,
            Err(source) => {
                // Not dropped here, inside the caller's runtime, where tokio refuses it.
                runtime.shutdown_background();
                return Err(TracesError::Exporter {
                    endpoint: endpoint.to_owned(),
                    source,
                });
            }
        };
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(Counted(exporter))
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                ratio.0,
            ))))
            .with_resource(resource())
            .build();
        let tracer = provider.tracer("tollgate");
        let propagator = TextMapCompositePropagator::new(vec![
            Box::new(B3),
            Box::new(TraceContextPropagator::new()),
        ]);
        Ok(Self {
            tracer,
            ratio: ratio.0,
            propagator,
            provider,
            runtime: Some(runtime),
        })
    }

    /// A server span for a request whose headers are `headers`, if it is recorded: the child
    /// of the trace context they carry, if any, and sampled as it was; otherwise a trace of
    /// its own, at the sample ratio. `describe` gives its name and attributes, called for a
    /// recorded span only. The context returned holds the span; it ends when the last clone
    /// of that context is dropped.
    ///
    /// A span that would not be recorded is not made at all: tollgate calls no one on a
    /// request's behalf, so it has no context to pass on, and a request that is not traced
    /// (most of them, where callers sample) costs a few header lookups.
    pub(crate) fn server_span(
        &self,
        headers: &HeaderMap,
        describe: impl FnOnce() -> (Cow<'static, str>, Vec<KeyValue>),
    ) -> Option<Context> {
        // Looked for by constant names first: a request without a context then costs three
        // lookups, not the propagators' six.
        let carried = [&TRACEPARENT, &B3_SINGLE, &B3_TRACE_ID]
            .into_iter()
            .any(|name| headers.contains_key(name));
        // A caller that traces at a low ratio sends most requests with a context it did not
        // sample; the propagators would build a whole context (about 4.5k instructions) for
        // this to drop. A valid W3C context wins over B3's (see `propagator`), so its flag
        // alone decides.
        if carried
            && headers
                .get(&TRACEPARENT)
                .is_some_and(|value| unsampled_w3c(value.as_bytes()))
        {
            return None;
        }
        let parent = if carried {
            self.propagator.extract(&Headers(headers))
        } else {
            Context::new()
        };
        let caller = parent.span().span_context().clone();
        let dropped = if caller.is_valid() {
            !caller.is_sampled()
        } else {
            self.ratio == 0.0
        };
        if dropped {
            return None;
        }
        let mut span = self
            .tracer
            .span_builder("request")
            .with_kind(SpanKind::Server)
            .start_with_context(&self.tracer, &parent);
        if !span.is_recording() {
            return None;
        }
        let (name, attributes) = describe();
        span.update_name(name);
        span.set_attributes(attributes);
        Some(parent.with_span(span))
    }

    /// A client span for a decision's wait on Redis, the child of the request's span (the
    /// active one) when that span is recorded; `None` otherwise, costing a look at the active
    /// context. On a shared store the round trip is most of a decision's time, and a trace
    /// should show it apart from the server's own work. `charged`: a decision, or an
    /// explanation that charges nothing.
    pub(crate) fn store_span(&self, charged: bool) -> Option<Context> {
        let parent = Context::current();
        if !parent.span().is_recording() {
            return None;
        }
        let span = self
            .tracer
            .span_builder("EVALSHA")
            .with_kind(SpanKind::Client)
            .with_attributes([
                KeyValue::new("db.system.name", "redis"),
                KeyValue::new("db.operation.name", "EVALSHA"),
                KeyValue::new(
                    "tollgate.store.call",
                    if charged { "decide" } else { "explain" },
                ),
            ])
            .start_with_context(&self.tracer, &parent);
        Some(parent.with_span(span))
    }

    /// Sends the spans still queued (waiting at most a few seconds for the collector); spans
    /// that end later are not sent. Blocks: call it once serving is over, off a serving
    /// runtime's thread.
    pub fn shutdown(&self) {
        if let Err(err) = self.provider.shutdown_with_timeout(FLUSH_AT_STOP) {
            tracing::warn!(error = %err, "traces still queued at the stop were not all sent");
        }
    }
}

impl Drop for Traces {
    fn drop(&mut self) {
        // A runtime must not be dropped where blocking is not allowed, which is wherever the
        // last reference to this may go.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// An exporter whose batches are counted as they go (`tollgate_trace_spans_exported_total`), so
/// that traces that stopped reaching the collector show on a dashboard, not in logs alone.
#[derive(Debug)]
struct Counted<E>(E);

impl<E: SpanExporter> SpanExporter for Counted<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = batch.len();
        let result = self.0.export(batch).await;
        let label = if result.is_ok() { "sent" } else { "failed" };
        crate::metrics::record_trace_export(label, spans);
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.0.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.0.set_resource(resource);
    }
}

/// The resource every span names: the service, and its version.
fn resource() -> Resource {
    let detected = Resource::builder().build();
    let named = detected
        .get(&opentelemetry::Key::from_static_str("service.name"))
        .is_some_and(|name| !name.as_str().starts_with("unknown_service"));
    let mut resource = Resource::builder()
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")));
    if !named {
        resource = resource.with_service_name("tollgate");
    }
    resource.build()
}

// The headers a trace context comes in, as constants: a name given as a string is parsed on
// every lookup.
const TRACEPARENT: http::HeaderName = http::HeaderName::from_static("traceparent");

/// Whether `value` is a W3C `traceparent` of version 00 in its one canonical form
/// (`00-<32 hex>-<16 hex>-<2 hex>`, lowercase, ids not all zeros) whose sampled flag (the
/// flags' lowest bit; the others are ignored, as the specification asks) is clear: one the
/// SDK's propagator reads as a valid, unsampled caller's context. Any other form (sampled,
/// malformed, another version, spaces around) is `false`, and left to the propagator.
fn unsampled_w3c(value: &[u8]) -> bool {
    let (Some(trace), Some(span), Some(flags)) =
        (value.get(3..35), value.get(36..52), value.get(53..))
    else {
        return false;
    };
    let hex = |part: &[u8]| part.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    let non_zero = |part: &[u8]| part.iter().any(|&b| b != b'0');
    value.starts_with(b"00-")
        && value.get(35) == Some(&b'-')
        && value.get(52) == Some(&b'-')
        && hex(trace)
        && hex(span)
        && non_zero(trace)
        && non_zero(span)
        && matches!(flags, [high, low] if hex(&[*high]) && b"02468ace".contains(low))
}
const B3_SINGLE: http::HeaderName = http::HeaderName::from_static("b3");
const B3_TRACE_ID: http::HeaderName = http::HeaderName::from_static("x-b3-traceid");

/// A request's headers, as the propagator reads them.
struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

/// Zipkin's B3 trace context, read (never written: tollgate calls no one on a request's
/// behalf): the single `b3` header (`{trace}-{span}[-{sampled}[-{parent}]]`), else the
/// `x-b3-*` headers, as Envoy's Zipkin tracer sends them. Written here because the one crate
/// that reads it is deprecated with the Zipkin exporter it comes in.
#[derive(Debug)]
struct B3;

impl B3 {
    /// The caller's span, if the headers name a valid one.
    fn span_context(extractor: &dyn Extractor) -> Option<SpanContext> {
        let (trace, span, sampling) = match extractor.get("b3") {
            Some(single) => {
                let mut parts = single.split('-');
                (parts.next()?, parts.next()?, parts.next())
            }
            None => (
                extractor.get("x-b3-traceid")?,
                extractor.get("x-b3-spanid")?,
                // Debug (`x-b3-flags: 1`) means sampled.
                match extractor.get("x-b3-flags") {
                    Some("1") => Some("d"),
                    _ => extractor.get("x-b3-sampled"),
                },
            ),
        };
        let lower_hex = |id: &str, lens: &[usize]| {
            lens.contains(&id.len()) && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        };
        if !lower_hex(trace, &[16, 32]) || !lower_hex(span, &[16]) {
            return None;
        }
        // A 64-bit trace id is the low half of a 128-bit one.
        let trace = TraceId::from_hex(trace).ok()?;
        let span = SpanId::from_hex(span).ok()?;
        // No sampling state: deferred to the receiver, which has no way to take it up as the
        // child of a remote span; taken as not sampled, as OpenTelemetry's B3 readers do.
        let flags = match sampling {
            Some("1" | "d" | "true") => TraceFlags::SAMPLED,
            _ => TraceFlags::default(),
        };
        let context = SpanContext::new(trace, span, flags, true, TraceState::default());
        context.is_valid().then_some(context)
    }
}

impl TextMapPropagator for B3 {
    fn inject_context(&self, _: &Context, _: &mut dyn opentelemetry::propagation::Injector) {}

    fn extract_with_context(&self, cx: &Context, extractor: &dyn Extractor) -> Context {
        match Self::span_context(extractor) {
            Some(span) => cx.with_remote_span_context(span),
            None => cx.clone(),
        }
    }

    fn fields(&self) -> opentelemetry::propagation::text_map_propagator::FieldIter<'_> {
        const FIELDS: [String; 0] = [];
        opentelemetry::propagation::text_map_propagator::FieldIter::new(&FIELDS)
    }
}

/// Writes what a decision said on the span of the request being answered (the active one):
/// the domain, the policy version, the limits that applied and the ones that rejected, by name
/// (never their keys or the descriptors' values, which identify users).
pub(crate) fn record_outcome(domain: &str, store: &'static str, outcome: &Outcome) {
    get_active_span(|span| {
        if !span.is_recording() {
            return;
        }
        // Shadow limits' rejections included: `tollgate.result` says whether the request passed.
        let names = |rejecting_only: bool| -> Value {
            let names: Vec<opentelemetry::StringValue> = outcome
                .limits
                .iter()
                .filter(|limit| !rejecting_only || limit.would_reject())
                .map(|limit| limit.name.to_string().into())
                .collect();
            Value::Array(names.into())
        };
        let result = if outcome.failed_closed {
            "failed_closed"
        } else if outcome.limits.is_empty() {
            "unmatched"
        } else if outcome.allowed {
            "allowed"
        } else {
            "rejected"
        };
        span.set_attributes([
            KeyValue::new("tollgate.domain", domain.to_owned()),
            KeyValue::new("tollgate.store", store),
            KeyValue::new(
                "tollgate.policy_version",
                outcome.policy_version.to_string(),
            ),
            KeyValue::new("tollgate.result", result),
            KeyValue::new("tollgate.degraded", outcome.degraded),
            KeyValue::new("tollgate.limits", names(false)),
            KeyValue::new("tollgate.limits_rejecting", names(true)),
        ]);
    });
}

/// Writes on the active span why a request could not be decided: `invalid` (the caller's
/// request, such as a cost above a capacity), or, as an error of the span, `unavailable` (the
/// store could not answer) or `error` (a fault of ours).
pub(crate) fn record_error(domain: &str, error: &DecideError) {
    get_active_span(|span| {
        if !span.is_recording() {
            return;
        }
        let result = match error {
            DecideError::Invalid(_) => "invalid",
            DecideError::Unavailable(_) => "unavailable",
            DecideError::Internal(_) => "error",
        };
        span.set_attributes([
            KeyValue::new("tollgate.domain", domain.to_owned()),
            KeyValue::new("tollgate.result", result),
        ]);
        if !matches!(error, DecideError::Invalid(_)) {
            span.set_status(Status::error(error.to_string()));
        }
    });
}

/// Ends a store span ([`Traces::store_span`]): an error when the store could not answer,
/// with the reason the decision's failure mode then went by.
pub(crate) fn end_store(context: &Context, unavailable: Option<&'static str>) {
    if let Some(reason) = unavailable {
        let span = context.span();
        span.set_attribute(KeyValue::new("tollgate.unavailable", reason));
        span.set_status(Status::error(reason));
    }
}

/// Ends an HTTP request's span with its status: an error for a 5xx (the server's failure),
/// unset otherwise, since a 4xx is the client's (OpenTelemetry's HTTP conventions).
pub(crate) fn end_http(context: &Context, status: http::StatusCode) {
    let span = context.span();
    span.set_attribute(KeyValue::new(
        "http.response.status_code",
        i64::from(status.as_u16()),
    ));
    if status.is_server_error() {
        span.set_status(Status::error(status.canonical_reason().unwrap_or("")));
    }
}

/// Ends a gRPC call's span with its `grpc-status`: an error for the codes that are the
/// server's failure (OpenTelemetry's RPC conventions for servers).
pub(crate) fn end_grpc(context: &Context, code: i64) {
    let span = context.span();
    span.set_attribute(KeyValue::new("rpc.grpc.status_code", code));
    // UNKNOWN, DEADLINE_EXCEEDED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE, DATA_LOSS.
    if matches!(code, 2 | 4 | 12 | 13 | 14 | 15) {
        span.set_status(Status::error(format!("grpc-status {code}")));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_are_numbers_from_zero_to_one_or_percentages() {
        assert_eq!("0.25".parse(), Ok(SampleRatio(0.25)));
        assert_eq!("1".parse(), Ok(SampleRatio::ALL));
        assert_eq!("0".parse(), Ok(SampleRatio(0.0)));
        assert_eq!("5%".parse(), Ok(SampleRatio(0.05)));
        assert_eq!("100%".parse(), Ok(SampleRatio::ALL));
        for bad in ["", "-0.1", "1.5", "101%", "half", "NaN", "inf", "%"] {
            assert!(bad.parse::<SampleRatio>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn an_endpoint_must_be_an_http_or_https_url() {
        for bad in ["collector:4317", "grpc://collector:4317", "http://", ""] {
            assert!(
                matches!(
                    Traces::start(
                        bad,
                        TraceProtocol::Grpc,
                        SampleRatio::ALL,
                        &TraceTls::default()
                    ),
                    Err(TracesError::Endpoint { .. })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn otlp_http_posts_to_v1_traces_unless_the_url_has_a_path() {
        assert_eq!(traces_url("http://c:4318"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("https://c:4318/"), "https://c:4318/v1/traces");
        assert_eq!(
            traces_url("https://otlp.example/otlp/v1/traces"),
            "https://otlp.example/otlp/v1/traces"
        );
    }

    /// What the SDK's W3C propagator reads from a `traceparent` of `value`: whether it makes
    /// a valid context, and whether that context is sampled.
    fn w3c_reads(value: &[u8]) -> (bool, bool) {
        let mut headers = HeaderMap::new();
        if let Ok(value) = http::HeaderValue::from_bytes(value) {
            headers.insert(TRACEPARENT, value);
        }
        let parent = TraceContextPropagator::new().extract(&Headers(&headers));
        let caller = parent.span().span_context().clone();
        (caller.is_valid(), caller.is_sampled())
    }

    const UNSAMPLED: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";

    #[test]
    fn the_unsampled_shortcut_reads_only_what_the_propagator_reads_as_unsampled() {
        let (trace, span) = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331");
        let zeros = ("00000000000000000000000000000000", "0000000000000000");
        let cases = [
            (format!("00-{trace}-{span}-00"), true),
            (format!("00-{trace}-{span}-02"), true),
            (format!("00-{trace}-{span}-fe"), true),
            (format!("00-{trace}-{span}-01"), false),
            (format!("00-{trace}-{span}-03"), false),
            (format!("00-{trace}-{span}-0C"), false),
            (format!("00-{}-{span}-00", zeros.0), false),
            (format!("00-{trace}-{}-00", zeros.1), false),
            (format!("00-{}-{span}-00", trace.to_uppercase()), false),
            (format!("01-{trace}-{span}-00"), false),
            (format!("00-{trace}-{span}-00-x"), false),
            (format!(" 00-{trace}-{span}-00"), false),
            (format!("00-{trace}-{}-00", &span[1..]), false),
            (String::new(), false),
        ];
        for (value, shortcut) in cases {
            assert_eq!(unsampled_w3c(value.as_bytes()), shortcut, "{value:?}");
            if shortcut {
                assert_eq!(w3c_reads(value.as_bytes()), (true, false), "{value:?}");
            }
        }
    }

    proptest::proptest! {
        /// Whatever a caller sends, the shortcut drops a request only where the propagator
        /// would have found an unsampled caller's context (one byte of a valid context changed
        /// to anything), and in the canonical shape it drops all of those (any ids and flags).
        #[test]
        fn the_unsampled_shortcut_never_drops_what_the_propagator_would_keep(
            at in 0..UNSAMPLED.len(),
            byte in proptest::prelude::any::<u8>(),
            trace in "[0-9a-f]{32}",
            span in "[0-9a-f]{16}",
            flags in "[0-9a-f]{2}",
        ) {
            let mut changed = UNSAMPLED.as_bytes().to_vec();
            changed[at] = byte;
            // Changed anyhow: dropped only if the propagator reads it as unsampled (it may
            // read more so, another version's, which the shortcut leaves to it).
            if unsampled_w3c(&changed) {
                proptest::prop_assert_eq!(w3c_reads(&changed), (true, false));
            }
            // In the canonical shape: the two agree exactly.
            let shaped = format!("00-{trace}-{span}-{flags}");
            let (valid, sampled) = w3c_reads(shaped.as_bytes());
            proptest::prop_assert_eq!(
                unsampled_w3c(shaped.as_bytes()),
                valid && !sampled,
                "{}",
                shaped
            );
        }
    }

    #[test]
    fn b3_contexts_are_read_in_both_forms() {
        let read = |headers: &[(&str, &str)]| {
            let map: HeaderMap = headers
                .iter()
                .map(|(k, v)| (k.parse::<http::HeaderName>().unwrap(), v.parse().unwrap()))
                .collect();
            B3::span_context(&Headers(&map)).map(|c| {
                (
                    c.trace_id().to_string(),
                    c.span_id().to_string(),
                    c.is_sampled(),
                )
            })
        };
        let trace = "463ac35c9f6413ad48485a3953bb6124";
        let span = "a2fb4a1d1a96d312";
        let full = |sampled| Some((trace.to_owned(), span.to_owned(), sampled));
        let multi = |sampled: &str| {
            read(&[
                ("x-b3-traceid", trace),
                ("x-b3-spanid", span),
                ("x-b3-sampled", sampled),
            ])
        };
        assert_eq!(multi("1"), full(true));
        assert_eq!(multi("0"), full(false));
        assert_eq!(
            read(&[
                ("x-b3-traceid", trace),
                ("x-b3-spanid", span),
                ("x-b3-flags", "1")
            ]),
            full(true)
        );
        assert_eq!(
            read(&[("x-b3-traceid", trace), ("x-b3-spanid", span)]),
            full(false)
        );
        let single = format!("{trace}-{span}-1-05e3ac9a4f6e3b90");
        assert_eq!(read(&[("b3", &single)]), full(true));
        assert_eq!(read(&[("b3", &format!("{trace}-{span}"))]), full(false));
        // A 64-bit trace id, padded.
        assert_eq!(
            read(&[("b3", "48485a3953bb6124-a2fb4a1d1a96d312-d")]),
            Some((
                "000000000000000048485a3953bb6124".to_owned(),
                span.to_owned(),
                true
            ))
        );
        for bad in [
            "0",
            "48485A3953BB6124-a2fb4a1d1a96d312-1",
            "48485a3953bb612-a2fb4a1d1a96d312-1",
            "00000000000000000000000000000000-a2fb4a1d1a96d312-1",
            "463ac35c9f6413ad48485a3953bb6124-0000000000000000-1",
            "463ac35c9f6413ad48485a3953bb6124",
        ] {
            assert_eq!(read(&[("b3", bad)]), None, "{bad}");
        }
        assert_eq!(read(&[("x-b3-traceid", trace)]), None);
    }

    fn nothing() -> (Cow<'static, str>, Vec<KeyValue>) {
        ("request".into(), Vec::new())
    }

    #[test]
    fn a_span_is_the_child_of_the_callers_trace_context() {
        let traces = Traces::start(
            "http://127.0.0.1:9",
            TraceProtocol::Grpc,
            SampleRatio(0.0),
            &TraceTls::default(),
        )
        .unwrap();
        let ids = |headers: &HeaderMap| {
            let context = traces.server_span(headers, nothing)?;
            let span = context.span();
            let ids = span.span_context();
            assert!(ids.is_sampled());
            Some((ids.trace_id().to_string(), ids.span_id().to_string()))
        };
        let mut headers = HeaderMap::new();
        headers.insert(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
                .parse()
                .unwrap(),
        );
        // Sampled because the caller's was, though this server samples no trace of its own.
        let (trace, span) = ids(&headers).expect("a span");
        assert_eq!(trace, "0af7651916cd43dd8448eb211c80319c");
        assert_ne!(span, "b7ad6b7169203331");

        // The caller's trace unsampled: no span either.
        headers.insert(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
                .parse()
                .unwrap(),
        );
        assert_eq!(ids(&headers), None);
        // Zipkin's B3, as Envoy's Zipkin tracer sends it.
        let mut b3 = HeaderMap::new();
        b3.insert(
            "x-b3-traceid",
            "463ac35c9f6413ad48485a3953bb6124".parse().unwrap(),
        );
        b3.insert("x-b3-spanid", "a2fb4a1d1a96d312".parse().unwrap());
        b3.insert("x-b3-sampled", "1".parse().unwrap());
        let (trace, _) = ids(&b3).expect("a span");
        assert_eq!(trace, "463ac35c9f6413ad48485a3953bb6124");
        // Both: W3C's wins.
        b3.insert(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
                .parse()
                .unwrap(),
        );
        let (trace, _) = ids(&b3).expect("a span");
        assert_eq!(trace, "0af7651916cd43dd8448eb211c80319c");
        // No context: a root of its own, sampled at the ratio (here none).
        assert_eq!(ids(&HeaderMap::new()), None);
        traces.shutdown();

        // At a ratio of 1, every request without a context starts a trace.
        let traces = Traces::start(
            "http://127.0.0.1:9",
            TraceProtocol::Grpc,
            SampleRatio::ALL,
            &TraceTls::default(),
        )
        .unwrap();
        let context = traces
            .server_span(&HeaderMap::new(), nothing)
            .expect("a span");
        assert!(context.span().span_context().is_sampled());
        traces.shutdown();
    }
}
