//! `ShouldRateLimit`, the call Envoy makes for every request it rate-limits, answered straight
//! from the connection rather than through tonic's generic server.
//!
//! tonic's server is made for every kind of call (streams, compression, interceptors), and a
//! unary call pays for that generality: the request is wrapped and decoded through a streaming
//! decoder, the answer encoded through a streaming encoder. This path costs about 5,000
//! instructions less per call (BENCHMARKS.md, twelfth session). A unary call is a
//! length-prefixed message in and a length-prefixed message and `grpc-status: 0` out, which is
//! what this module does, for every `ShouldRateLimit` call with a gRPC content type. Every
//! other call (another method, a request that is not gRPC) still goes to tonic's server.
//! Errors are answered with tonic's codes and texts, as a trailers-only response from
//! [`Status::into_http`], with one exception: a call carrying two messages, whose first tonic
//! answers and whose second it drops, is refused here.
//!
//! A client may compress its message with gzip (`grpc-encoding: gzip`, as gRPC libraries do
//! when told to compress every call): it is inflated here, up to the same 4 MiB as a plain
//! message, so a small compressed message cannot make the server hold a huge one. Answers go
//! uncompressed, which gRPC lets a server choose whatever the client accepts: they are a few
//! hundred bytes. Another encoding is answered `UNIMPLEMENTED`, naming the ones taken
//! (`grpc-accept-encoding`), as the gRPC protocol asks.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderName, HeaderValue};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use prost::Message;
use tonic::Status;
use tonic::metadata::MetadataValue;
use tower_service::Service;

use crate::http2::Received;
use crate::rls::Rls;
use crate::traces::Traces;

/// The method's path.
pub(crate) const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// The largest request message read: tonic's default, as before this path.
const MAX_MESSAGE: usize = 4 * 1024 * 1024;

// Header names as constants: a name given as a string is parsed and checked on every use.
const GRPC_ENCODING: HeaderName = HeaderName::from_static("grpc-encoding");
const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");

/// The message encodings a call may use, as `grpc-accept-encoding` lists them.
const ACCEPTED: &str = "identity,gzip";

/// The five bytes before a message: a compression flag and the message's length.
const PREFIX: usize = 5;

/// The `ShouldRateLimit` calls this module answers.
#[derive(Clone)]
pub(crate) struct ShouldRateLimit {
    rls: Arc<Rls>,
    /// Where each call's span goes, when traces are sent.
    traces: Option<Arc<Traces>>,
}

impl ShouldRateLimit {
    pub(crate) fn new(rls: Arc<Rls>, traces: Option<Arc<Traces>>) -> Self {
        Self { rls, traces }
    }

    /// Whether `request` is a call answered here: the method, as gRPC (protobuf). Anything
    /// else is tonic's to answer.
    pub(crate) fn answers<B>(request: &http::Request<B>) -> bool {
        request.uri().path() == PATH
            && request.headers().get(CONTENT_TYPE).is_some_and(|value| {
                matches!(
                    value.as_bytes(),
                    b"application/grpc" | b"application/grpc+proto"
                )
            })
    }
}

/// How a call's message may be compressed, as its `grpc-encoding` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Encoding {
    Identity,
    Gzip,
}

impl Encoding {
    /// The encoding `headers` name; an unknown one is refused as tonic refuses it.
    fn of(headers: &HeaderMap) -> Result<Self, Status> {
        let Some(value) = headers.get(&GRPC_ENCODING) else {
            return Ok(Encoding::Identity);
        };
        match value.as_bytes() {
            b"identity" => Ok(Encoding::Identity),
            b"gzip" => Ok(Encoding::Gzip),
            other => {
                let mut status = Status::unimplemented(format!(
                    "Content is compressed with `{}` which isn't supported",
                    String::from_utf8_lossy(other)
                ));
                status
                    .metadata_mut()
                    .insert("grpc-accept-encoding", MetadataValue::from_static(ACCEPTED));
                Err(status)
            }
        }
    }
}

impl Service<http::Request<Received>> for ShouldRateLimit {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Received>) -> Self::Future {
        let rls = Arc::clone(&self.rls);
        let encoding = Encoding::of(request.headers());
        if let Some(span) = self.traces.as_deref().and_then(|t| call_span(t, &request)) {
            return Box::pin(traced(rls, encoding, request.into_body(), span));
        }
        Box::pin(async move { Ok(answer(&rls, encoding, request.into_body()).await) })
    }
}

/// A server span for a call, named by its method as OpenTelemetry's RPC conventions have it:
/// only for the calls answered here, Envoy's usual `ShouldRateLimit` (not health checks, which
/// come every few seconds from load balancers, nor RLQS streams, which last as long as their
/// Envoy). Cold and out of line, as [`traced`]: untraced calls keep a test of an `Option`.
#[cold]
#[inline(never)]
fn call_span(traces: &Traces, request: &http::Request<Received>) -> Option<opentelemetry::Context> {
    use opentelemetry::KeyValue;

    traces.server_span(request.headers(), || {
        let attributes = vec![
            KeyValue::new("rpc.system", "grpc"),
            KeyValue::new("rpc.service", "envoy.service.ratelimit.v3.RateLimitService"),
            KeyValue::new("rpc.method", "ShouldRateLimit"),
        ];
        (PATH.trim_start_matches('/').into(), attributes)
    })
}

/// A call answered in `span`, which what it decides is written on, and then its status: an
/// error's in the trailers-only answer's headers, `0` otherwise.
#[cold]
#[inline(never)]
async fn traced(
    rls: Arc<Rls>,
    encoding: Result<Encoding, Status>,
    body: Received,
    span: opentelemetry::Context,
) -> Result<http::Response<tonic::body::Body>, Infallible> {
    use opentelemetry::context::FutureExt as _;

    let response = answer(&rls, encoding, body)
        .with_context(span.clone())
        .await;
    let code = response
        .headers()
        .get(&GRPC_STATUS)
        .and_then(|code| code.to_str().ok()?.parse::<i64>().ok())
        .unwrap_or(0);
    crate::traces::end_grpc(&span, code);
    Ok(response)
}

async fn answer(
    rls: &Rls,
    encoding: Result<Encoding, Status>,
    body: Received,
) -> http::Response<tonic::body::Body> {
    let read = match encoding {
        Ok(encoding) => read_message(body, encoding).await,
        Err(status) => Err(status),
    };
    let answered = match read {
        Ok(request) => rls.decide(request).await,
        Err(status) => Err(status),
    };
    let message = match answered {
        Ok(message) => message,
        Err(status) => return status.into_http(),
    };
    let len = message.encoded_len();
    let mut framed = BytesMut::with_capacity(PREFIX + len);
    framed.put_u8(0);
    // An answer is a few hundred bytes: far below 4 GiB.
    framed.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
    message.encode_raw(&mut framed);
    let mut trailers = HeaderMap::with_capacity(1);
    trailers.insert(GRPC_STATUS, HeaderValue::from_static("0"));
    let mut response = http::Response::new(tonic::body::Body::new(Unary {
        message: Some(framed.freeze()),
        trailers: Some(trailers),
    }));
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    response
}

/// What tonic's server answers for a message cut short.
const CUT_SHORT: &str = "Unexpected EOF decoding stream.";

/// The one message of a unary request, read whole and inflated when compressed with
/// `encoding`: refused as tonic's server refuses it when missing, cut short, compressed
/// without an encoding, too large or not a `RateLimitRequest`, and refused when followed by
/// another.
async fn read_message(body: Received, encoding: Encoding) -> Result<RateLimitRequest, Status> {
    let mut body = std::pin::pin!(body);
    let mut gathered = Gathered::default();
    while let Some(frame) = body.frame().await {
        // The client reset the stream: nobody will read the answer.
        let frame = frame.map_err(|err| Status::cancelled(err.to_string()))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let read = gathered.len() + data.len();
        if read > PREFIX + MAX_MESSAGE {
            return Err(too_large(read - PREFIX));
        }
        gathered.push(data);
    }
    let whole = gathered.into_bytes();
    let Some((head, rest)) = whole.split_first_chunk::<PREFIX>() else {
        return Err(Status::internal(if whole.is_empty() {
            "Missing request message."
        } else {
            CUT_SHORT
        }));
    };
    let compressed = match (head[0], encoding) {
        (0, _) => false,
        (1, Encoding::Gzip) => true,
        (1, Encoding::Identity) => {
            return Err(Status::internal(
                "protocol error: received message with compressed-flag but no grpc-encoding \
                 was specified",
            ));
        }
        (flag, _) => {
            return Err(Status::internal(format!(
                "protocol error: received message with invalid compression flag: {flag} \
                 (valid flags are 0 and 1)"
            )));
        }
    };
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > MAX_MESSAGE {
        return Err(too_large(len));
    }
    match rest.len().cmp(&len) {
        std::cmp::Ordering::Less => return Err(Status::internal(CUT_SHORT)),
        // tonic's server answers the first message and drops the rest; a client that sends
        // two has a bug, and is told so rather than charged for half its call.
        std::cmp::Ordering::Greater => {
            return Err(Status::internal(
                "a unary call carries one request message, and this one carried more",
            ));
        }
        std::cmp::Ordering::Equal => {}
    }
    let decoded = if compressed {
        RateLimitRequest::decode(&gunzip(rest)?[..])
    } else {
        RateLimitRequest::decode(rest)
    };
    decoded.map_err(|err| Status::internal(format!("failed to decode Protobuf message: {err}")))
}

/// A gzip-compressed message, inflated: refused when it is not gzip, or once it grows past
/// the largest message read (which a few kilobytes of gzip can reach), without inflating
/// further.
fn gunzip(compressed: &[u8]) -> Result<Vec<u8>, Status> {
    use std::io::Read;

    let mut plain = Vec::with_capacity(compressed.len().saturating_mul(4).min(MAX_MESSAGE));
    let bound = u64::try_from(MAX_MESSAGE + 1).unwrap_or(u64::MAX);
    flate2::read::GzDecoder::new(compressed)
        .take(bound)
        .read_to_end(&mut plain)
        .map_err(|err| Status::internal(format!("Error decompressing: {err}")))?;
    if plain.len() > MAX_MESSAGE {
        return Err(Status::out_of_range(format!(
            "Error, decompressed message length too large: more than {MAX_MESSAGE} bytes"
        )));
    }
    Ok(plain)
}

/// A message's data frames, which usually come as one: the first kept as it came, without a
/// copy, the rest, if any, joined to it. The generator reads answers so too.
#[derive(Default)]
pub(crate) struct Gathered {
    first: Bytes,
    joined: Option<BytesMut>,
}

impl Gathered {
    /// The bytes so far.
    pub(crate) fn len(&self) -> usize {
        self.joined.as_ref().map_or(self.first.len(), BytesMut::len)
    }

    /// Adds the next frame's bytes.
    pub(crate) fn push(&mut self, data: Bytes) {
        if self.first.is_empty() && self.joined.is_none() {
            self.first = data;
        } else {
            self.joined
                .get_or_insert_with(|| BytesMut::from(&self.first[..]))
                .extend_from_slice(&data);
        }
    }

    /// All of it.
    pub(crate) fn into_bytes(self) -> Bytes {
        self.joined.map_or(self.first, BytesMut::freeze)
    }
}

fn too_large(len: usize) -> Status {
    Status::out_of_range(format!(
        "Error, decoded message length too large: found {len} bytes, the limit is: \
         {MAX_MESSAGE} bytes"
    ))
}

/// A unary answer's body: the message, then the trailers.
struct Unary {
    message: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

impl Body for Unary {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some(message) = self.message.take() {
            return Poll::Ready(Some(Ok(Frame::data(message))));
        }
        Poll::Ready(
            self.trailers
                .take()
                .map(|trailers| Ok(Frame::trailers(trailers))),
        )
    }

    fn is_end_stream(&self) -> bool {
        self.message.is_none() && self.trailers.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The answer's body says it has ended only once the trailers, which carry the status,
    /// have gone: a server that trusted an earlier end would send a message without a status.
    #[tokio::test]
    async fn an_answer_ends_after_its_trailers() {
        let mut trailers = HeaderMap::new();
        trailers.insert(GRPC_STATUS, HeaderValue::from_static("0"));
        let mut body = std::pin::pin!(Unary {
            message: Some(Bytes::from_static(b"answer")),
            trailers: Some(trailers),
        });
        assert!(!body.is_end_stream());
        let data = body
            .frame()
            .await
            .and_then(Result::ok)
            .map(Frame::into_data);
        assert!(matches!(data, Some(Ok(bytes)) if bytes == "answer"));
        assert!(!body.is_end_stream(), "ended before its trailers");
        let trailers = body
            .frame()
            .await
            .and_then(Result::ok)
            .map(Frame::into_trailers);
        assert!(matches!(trailers, Some(Ok(fields)) if fields[GRPC_STATUS] == "0"));
        assert!(body.is_end_stream());
        assert!(body.frame().await.is_none());
    }
}
