//! The gRPC client of `tollgate bench`: Envoy RLS v3 `ShouldRateLimit`, as Envoy calls it.
//!
//! Each worker has one call in flight. By default it also has its own HTTP/2 connection, so
//! `--concurrency` means the same over gRPC as over HTTP and the two can be compared; with
//! `--connections N` the workers' calls are streams multiplexed over N shared connections, as
//! Envoy sends them.
//!
//! Calls are HTTP/2 streams written with `h2` directly, not through a gRPC client library, for
//! what the server sees: a call's HEADERS and its one DATA frame leave in one write, as Envoy
//! sends them. A client that hands the message over as a streaming body (tonic over hyper) has
//! it written a pass later, so every call arrived as two TCP segments, and the server paid for
//! the second one out of the cores it shares with the generator. The message is encoded with
//! prost, and the answer's status read from the trailers (or from the headers, when the server
//! answers with headers only).

use bytes::{BufMut, Bytes, BytesMut};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use h2::client::SendRequest;
use http::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue, TE};
use http::{Method, Request, StatusCode, Uri};
use prost::Message;
use std::sync::Arc;

use super::Verdict;
use super::args::Plan;
use super::shared::SharedConnection;
use super::tls::TlsClient;
use crate::grpc_unary::Gathered;

/// The method's path, from the service's package, name and method.
const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
/// The length-prefixed message framing of gRPC: a compression flag and a big-endian length.
const PREFIX_BYTES: usize = 5;
/// The largest answer accepted: far above any real one, so a broken server cannot make a worker
/// buffer without end.
const MAX_ANSWER_BYTES: usize = 1 << 20;
/// A name given as a string is parsed on every lookup; a constant is not.
const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");

/// The one field of `RateLimitResponse` a worker reads. Decoding into it skips the statuses and
/// the response headers without building them: the generator shares the cores with the server
/// it measures, and a full decode was a thirteenth of its work per call.
#[derive(Clone, PartialEq, prost::Message)]
struct Overall {
    /// `RateLimitResponse.overall_code`, field 1.
    #[prost(enumeration = "Code", tag = "1")]
    overall_code: i32,
}

/// One worker's handle on a gRPC target.
pub(crate) struct GrpcClient {
    authority: String,
    /// `http://authority/…/ShouldRateLimit` (`https://` over TLS), parsed once.
    uri: Uri,
    /// The request with every field but the key's value filled in.
    template: RateLimitRequest,
    /// `--header`s, as metadata.
    headers: HeaderMap,
    /// Where the message is encoded; each call's body is split off it.
    buffer: BytesMut,
    /// The connection this worker shares with others (or has alone).
    shared: Arc<SharedConnection>,
    /// TLS to an `https://` target.
    tls: Option<TlsClient>,
    /// `None` before the first call and after a failure: the next call reconnects. The number
    /// is the shared connection's generation it was taken from.
    client: Option<(u64, SendRequest<Bytes>)>,
}

/// Why a call failed, and whether the connection can still be trusted.
struct CallError {
    message: String,
    /// A transport failure leaves the connection in an unknown state; an answer the server
    /// chose (a bad domain, too many entries) does not.
    transport: bool,
}

impl CallError {
    fn transport(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            transport: true,
        }
    }
}

impl From<h2::Error> for CallError {
    fn from(err: h2::Error) -> Self {
        Self::transport(format!("HTTP/2: {err}"))
    }
}

impl GrpcClient {
    /// A client for `authority` (`host:port`).
    ///
    /// # Errors
    ///
    /// When `authority` does not make a URI.
    pub(crate) fn new(
        plan: &Plan,
        authority: &str,
        shared: Arc<SharedConnection>,
    ) -> Result<Self, String> {
        let scheme = if plan.tls.is_some() { "https" } else { "http" };
        let uri: Uri = format!("{scheme}://{authority}{PATH}")
            .parse()
            .map_err(|err| format!("--grpc {authority}: {err}"))?;
        let mut entries: Vec<Entry> = plan
            .entries
            .iter()
            .map(|(key, value)| Entry {
                key: key.clone(),
                value: value.clone(),
            })
            .collect();
        entries.push(Entry {
            key: plan.key_entry.clone(),
            value: String::new(),
        });
        let template = RateLimitRequest {
            domain: plan.domain.clone(),
            descriptors: vec![RateLimitDescriptor {
                entries,
                ..Default::default()
            }],
            hits_addend: plan.cost,
        };
        Ok(Self {
            authority: authority.to_owned(),
            uri,
            template,
            headers: plan.headers.clone(),
            buffer: BytesMut::new(),
            shared,
            tls: plan.tls.clone(),
            client: None,
        })
    }

    /// Takes the shared connection, or opens it now (so a run does not start before every
    /// worker is connected).
    pub(crate) async fn connect(&mut self) -> Result<(), String> {
        let what = format!("gRPC {}", self.authority);
        let client = self
            .shared
            .take_or_open(&self.authority, self.tls.as_ref(), &what)
            .await?;
        self.client = Some(client);
        Ok(())
    }

    /// Forgets the connection, for every worker sharing it (after a timeout or a transport
    /// error its state is unknown).
    pub(crate) fn reset(&mut self) {
        if let Some((generation, _)) = self.client.take() {
            self.shared.drop_generation(generation);
        }
    }

    /// Sends one `ShouldRateLimit` for key `key`.
    pub(crate) async fn send(&mut self, key: u64) -> Result<Verdict, String> {
        if self.client.is_none() {
            self.connect().await?;
        }
        let body = self.encode(key)?;
        let Some((_, client)) = self.client.as_mut() else {
            return Err("no connection".into());
        };
        match call(client, &self.uri, &self.headers, body).await {
            Ok(response) => match response.overall_code() {
                Code::Ok => Ok(Verdict::Allowed),
                Code::OverLimit => Ok(Verdict::Rejected),
                Code::Unknown => Err("gRPC answer with overall_code UNKNOWN".into()),
            },
            Err(err) => {
                if err.transport {
                    self.reset();
                }
                Err(err.message)
            }
        }
    }

    /// The length-prefixed message for `key`.
    fn encode(&mut self, key: u64) -> Result<Bytes, String> {
        if let Some(entry) = self
            .template
            .descriptors
            .first_mut()
            .and_then(|descriptor| descriptor.entries.last_mut())
        {
            entry.value.clear();
            entry.value.push_str(super::KEY_PREFIX);
            entry.value.push_str(itoa::Buffer::new().format(key));
        }
        let length = self.template.encoded_len();
        let prefix = u32::try_from(length).map_err(|_| "the request is too large")?;
        self.buffer.reserve(PREFIX_BYTES + length);
        self.buffer.put_u8(0);
        self.buffer.put_u32(prefix);
        self.template
            .encode(&mut self.buffer)
            .map_err(|err| format!("cannot encode the request: {err}"))?;
        Ok(self.buffer.split().freeze())
    }
}

/// One call on `client`: the request's HEADERS and DATA queued together, then the answer.
async fn call(
    client: &mut SendRequest<Bytes>,
    uri: &Uri,
    extra: &HeaderMap,
    body: Bytes,
) -> Result<Overall, CallError> {
    // Built from parts already checked: a builder parses and validates every header again.
    let mut request = Request::new(());
    *request.method_mut() = Method::POST;
    *request.uri_mut() = uri.clone();
    let headers = request.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    headers.insert(TE, HeaderValue::from_static("trailers"));
    for (name, value) in extra {
        headers.insert(name, value.clone());
    }
    // Waits while the connection has as many streams open as the server allows.
    std::future::poll_fn(|cx| client.poll_ready(cx)).await?;
    let (response, mut stream) = client.send_request(request, false)?;
    stream.send_data(body, true)?;
    let response = response.await?;
    let (head, mut body) = response.into_parts();
    if head.status != StatusCode::OK {
        return Err(CallError::transport(format!(
            "HTTP/2 status {}",
            head.status
        )));
    }
    // An error may come as headers alone, without a message.
    status(&head.headers)?;
    let mut message = Gathered::default();
    while let Some(chunk) = body.data().await {
        let chunk = chunk?;
        // Credit the server's window back, or a long run stalls the connection.
        let _ = body.flow_control().release_capacity(chunk.len());
        if message.len() + chunk.len() > MAX_ANSWER_BYTES {
            return Err(CallError::transport(format!(
                "an answer over {MAX_ANSWER_BYTES} bytes"
            )));
        }
        message.push(chunk);
    }
    match body.trailers().await? {
        Some(trailers) => status(&trailers)?,
        None if head.headers.contains_key(&GRPC_STATUS) => {}
        None => return Err(CallError::transport("an answer without grpc-status")),
    }
    decode(&message.into_bytes())
}

/// Fails when `headers` carry a `grpc-status` other than OK (the message percent-decoded).
fn status(headers: &HeaderMap) -> Result<(), CallError> {
    // OK is nearly every answer, and has no message to read.
    match headers.get(&GRPC_STATUS) {
        None => return Ok(()),
        Some(code) if code == "0" => return Ok(()),
        Some(_) => {}
    }
    let Some(status) = tonic::Status::from_header_map(headers) else {
        return Ok(());
    };
    if status.code() == tonic::Code::Ok {
        return Ok(());
    }
    Err(CallError {
        message: format!("gRPC {:?}: {}", status.code(), status.message()),
        transport: status.code() != tonic::Code::InvalidArgument,
    })
}

/// The one message of a unary answer.
fn decode(message: &[u8]) -> Result<Overall, CallError> {
    let Some((&[compressed, a, b, c, d], rest)) = message.split_first_chunk::<PREFIX_BYTES>()
    else {
        return Err(CallError::transport("an answer without a message"));
    };
    if compressed != 0 {
        return Err(CallError::transport(
            "a compressed answer (none was asked for)",
        ));
    }
    let length = usize::try_from(u32::from_be_bytes([a, b, c, d])).unwrap_or(usize::MAX);
    if rest.len() != length {
        return Err(CallError::transport(format!(
            "an answer of {} bytes announced as {length}",
            rest.len()
        )));
    }
    Overall::decode(rest)
        .map_err(|err| CallError::transport(format!("cannot decode the answer: {err}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::DescriptorStatus;
    use std::sync::atomic::{AtomicU64, Ordering};
    use tokio::net::TcpListener;

    /// How the test server answers one call.
    struct Reply {
        status: StatusCode,
        headers: Vec<(&'static str, &'static str)>,
        /// The framed message, if any.
        body: Option<Vec<u8>>,
        trailers: Option<Vec<(&'static str, &'static str)>>,
    }

    impl Reply {
        /// A well-formed answer with `code` overall, its message padded to `message_bytes`
        /// when given (with a field the client skips).
        fn decision(code: Code, message_bytes: Option<usize>) -> Self {
            let mut answer = RateLimitResponse {
                overall_code: code.into(),
                ..Default::default()
            };
            if let Some(size) = message_bytes {
                // The padding's own tag and length take a few bytes more than it does.
                let mut padding = size;
                while answer.encoded_len() != size && padding > 0 {
                    padding -= 1;
                    answer.raw_body = vec![b'x'; padding];
                }
                assert_eq!(answer.encoded_len(), size, "no padding fits");
            }
            Self {
                status: StatusCode::OK,
                headers: vec![("content-type", "application/grpc")],
                body: Some(framed(&answer.encode_to_vec())),
                trailers: Some(vec![("grpc-status", "0")]),
            }
        }

        /// An answer with headers only, as a gRPC error comes.
        fn refusal(grpc_status: &'static str) -> Self {
            Self {
                status: StatusCode::OK,
                headers: vec![
                    ("content-type", "application/grpc"),
                    ("grpc-status", grpc_status),
                ],
                body: None,
                trailers: None,
            }
        }
    }

    /// A gRPC server on a free loopback port answering the `n`-th call (counted over every
    /// connection, from 0) with `reply(n)`; returns its address and how many connections it
    /// accepted.
    async fn serve(
        reply: impl Fn(u64) -> Reply + Send + Sync + 'static,
    ) -> (String, Arc<AtomicU64>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let authority = listener.local_addr().expect("address").to_string();
        let connections = Arc::new(AtomicU64::new(0));
        let accepted = Arc::clone(&connections);
        let reply = Arc::new(reply);
        let calls = Arc::new(AtomicU64::new(0));
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                accepted.fetch_add(1, Ordering::SeqCst);
                let reply = Arc::clone(&reply);
                let calls = Arc::clone(&calls);
                tokio::spawn(async move {
                    let Ok(mut connection) = h2::server::handshake(socket).await else {
                        return;
                    };
                    while let Some(Ok((_, mut respond))) = connection.accept().await {
                        let reply = reply(calls.fetch_add(1, Ordering::SeqCst));
                        let mut response = http::Response::new(());
                        *response.status_mut() = reply.status;
                        for (name, value) in reply.headers {
                            response
                                .headers_mut()
                                .insert(name, HeaderValue::from_static(value));
                        }
                        let only_headers = reply.body.is_none() && reply.trailers.is_none();
                        let Ok(mut stream) = respond.send_response(response, only_headers) else {
                            continue;
                        };
                        if let Some(body) = reply.body {
                            let _ = stream.send_data(body.into(), reply.trailers.is_none());
                        }
                        if let Some(trailers) = reply.trailers {
                            let mut map = HeaderMap::new();
                            for (name, value) in trailers {
                                map.insert(name, HeaderValue::from_static(value));
                            }
                            let _ = stream.send_trailers(map);
                        }
                    }
                });
            }
        });
        (authority, connections)
    }

    /// A client of `authority` with a connection of its own.
    fn client(authority: &str) -> GrpcClient {
        sharing(authority, &Arc::default())
    }

    /// A client of `authority` sharing `connection` with others.
    fn sharing(authority: &str, connection: &Arc<SharedConnection>) -> GrpcClient {
        let plan = crate::loadgen::args::parse(&["--grpc", authority])
            .and_then(|args| args.plan())
            .expect("plan");
        GrpcClient::new(&plan, authority, Arc::clone(connection)).expect("client")
    }

    #[tokio::test]
    async fn every_answer_but_a_whole_decision_is_an_error_that_says_why() {
        let (authority, _) = serve(|n| match n {
            0 => Reply::decision(Code::Ok, None),
            1 => Reply::decision(Code::OverLimit, None),
            2 => Reply::decision(Code::Unknown, None),
            3 => Reply {
                status: StatusCode::SERVICE_UNAVAILABLE,
                ..Reply::decision(Code::Ok, None)
            },
            4 => Reply {
                trailers: None,
                ..Reply::decision(Code::Ok, None)
            },
            // The status in the headers, the message after them, and no trailers.
            5 => Reply {
                headers: vec![("content-type", "application/grpc"), ("grpc-status", "0")],
                trailers: None,
                ..Reply::decision(Code::OverLimit, None)
            },
            6 => Reply::refusal("8"),
            // The largest answer taken, and one byte more.
            7 => Reply::decision(Code::OverLimit, Some(MAX_ANSWER_BYTES - PREFIX_BYTES)),
            8 => Reply::decision(Code::OverLimit, Some(MAX_ANSWER_BYTES - PREFIX_BYTES + 1)),
            _ => Reply::refusal("13"),
        })
        .await;
        let mut client = client(&authority);
        let mut outcomes = Vec::new();
        for key in 0..9 {
            outcomes.push(client.send(key).await);
        }
        let expected: Vec<Result<Verdict, String>> = vec![
            Ok(Verdict::Allowed),
            Ok(Verdict::Rejected),
            Err("gRPC answer with overall_code UNKNOWN".into()),
            Err("HTTP/2 status 503 Service Unavailable".into()),
            Err("an answer without grpc-status".into()),
            Ok(Verdict::Rejected),
            Err("gRPC ResourceExhausted: ".into()),
            Ok(Verdict::Rejected),
            Err(format!("an answer over {MAX_ANSWER_BYTES} bytes")),
        ];
        assert_eq!(outcomes, expected);
    }

    #[tokio::test]
    async fn a_broken_connection_is_replaced_and_a_refusal_keeps_it() {
        // Calls 1 and 2 fail: a refusal the server chose, then a transport failure, after which
        // the next call opens a new connection.
        let (authority, connections) = serve(|n| match n {
            1 => Reply::refusal("3"),
            2 => Reply {
                status: StatusCode::BAD_GATEWAY,
                ..Reply::decision(Code::Ok, None)
            },
            _ => Reply::decision(Code::Ok, None),
        })
        .await;
        let mut client = client(&authority);
        let mut opened = Vec::new();
        for key in 0..4 {
            let _ = client.send(key).await;
            opened.push(connections.load(Ordering::SeqCst));
        }
        assert_eq!(opened, [1, 1, 1, 2], "connections opened after each call");
    }

    #[tokio::test]
    async fn a_stale_failure_leaves_the_shared_replacement_alone() {
        let (authority, connections) = serve(|n| match n {
            0 | 2 => Reply {
                status: StatusCode::BAD_GATEWAY,
                ..Reply::decision(Code::Ok, None)
            },
            _ => Reply::decision(Code::Ok, None),
        })
        .await;
        let shared = Arc::default();
        let (mut first, mut second) = (sharing(&authority, &shared), sharing(&authority, &shared));
        first.connect().await.expect("connect");
        second.connect().await.expect("connect");
        // The first fails and replaces the connection; then the second, still on the old one,
        // fails too, which must not drop the replacement.
        assert!(first.send(0).await.is_err());
        assert_eq!(
            connections.load(Ordering::SeqCst),
            1,
            "one shared connection"
        );
        assert_eq!(first.send(1).await, Ok(Verdict::Allowed));
        assert_eq!(connections.load(Ordering::SeqCst), 2);
        assert!(second.send(2).await.is_err());
        let mut third = sharing(&authority, &shared);
        third.connect().await.expect("connect");
        assert_eq!(third.send(3).await, Ok(Verdict::Allowed));
        assert_eq!(second.send(4).await, Ok(Verdict::Allowed));
        assert_eq!(
            connections.load(Ordering::SeqCst),
            2,
            "the replacement is shared by all three"
        );
    }

    fn framed(message: &[u8]) -> Vec<u8> {
        let mut framed = vec![0];
        framed.extend_from_slice(&u32::try_from(message.len()).unwrap_or(0).to_be_bytes());
        framed.extend_from_slice(message);
        framed
    }

    #[test]
    fn an_answer_decodes_from_its_frame() {
        // A whole answer, as the server sends it: the fields skipped come before and after.
        let answer = RateLimitResponse {
            overall_code: Code::OverLimit.into(),
            statuses: vec![DescriptorStatus {
                code: Code::OverLimit.into(),
                limit_remaining: 0,
                ..Default::default()
            }],
            response_headers_to_add: vec![envoy_types::pb::envoy::config::core::v3::HeaderValue {
                key: "RateLimit".into(),
                value: "\"per-user\";r=0;t=1".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let decoded = decode(&framed(&answer.encode_to_vec()));
        assert_eq!(
            decoded.ok().map(|answer| answer.overall_code()),
            Some(Code::OverLimit)
        );
    }

    #[test]
    fn broken_frames_are_errors() {
        let message = RateLimitResponse::default().encode_to_vec();
        let mut short = framed(&message);
        short.push(0);
        let mut compressed = framed(&message);
        compressed[0] = 1;
        for frame in [&[0u8, 0, 0][..], &short, &compressed] {
            assert!(decode(frame).is_err(), "{frame:?}");
        }
    }

    #[test]
    fn a_grpc_status_other_than_ok_says_which_and_why() {
        let mut headers = HeaderMap::new();
        assert!(status(&headers).is_ok(), "no status yet");
        headers.insert("grpc-status", HeaderValue::from_static("0"));
        assert!(status(&headers).is_ok());
        headers.insert("grpc-status", HeaderValue::from_static("3"));
        headers.insert(
            "grpc-message",
            HeaderValue::from_static("domain%20is%20empty"),
        );
        let refused = status(&headers).err();
        assert_eq!(
            refused
                .as_ref()
                .map(|err| (err.message.as_str(), err.transport)),
            Some(("gRPC InvalidArgument: domain is empty", false))
        );
        headers.insert("grpc-status", HeaderValue::from_static("14"));
        assert!(status(&headers).is_err_and(|err| err.transport));
    }
}
