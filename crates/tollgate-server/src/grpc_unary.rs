//! `ShouldRateLimit`, the call Envoy makes for every request it rate-limits, answered straight
//! from the connection rather than through tonic's generic server.
//!
//! tonic's server is made for every kind of call (streams, compression, interceptors), and a
//! unary call pays for that generality: the request is wrapped and decoded through a streaming
//! decoder, the answer encoded through a streaming encoder. This path costs about 5,000
//! instructions less per call (BENCHMARKS.md, twelfth session). A unary call of the usual kind
//! (a gRPC content type, no compression) is a length-prefixed message in and a length-prefixed
//! message and `grpc-status: 0` out, which is what this module does. Every other call (another
//! method, a compressed message, a request that is not gRPC) still goes to tonic's server.
//! Errors are answered with tonic's codes and texts, as a trailers-only response from
//! [`Status::into_http`], with one exception: a call carrying two messages, whose first tonic
//! answers and whose second it drops, is refused here.

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

    /// Whether `request` is a call answered here: the method, as gRPC (protobuf), without
    /// compression. Anything else is tonic's to answer.
    pub(crate) fn answers<B>(request: &http::Request<B>) -> bool {
        let headers = request.headers();
        request.uri().path() == PATH
            && headers.get(CONTENT_TYPE).is_some_and(|value| {
                matches!(
                    value.as_bytes(),
                    b"application/grpc" | b"application/grpc+proto"
                )
            })
            && headers
                .get(&GRPC_ENCODING)
                .is_none_or(|value| value == "identity")
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
        if let Some(span) = self.traces.as_deref().and_then(|t| call_span(t, &request)) {
            return Box::pin(traced(rls, request.into_body(), span));
        }
        Box::pin(async move { Ok(answer(&rls, request.into_body()).await) })
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
    body: Received,
    span: opentelemetry::Context,
) -> Result<http::Response<tonic::body::Body>, Infallible> {
    use opentelemetry::context::FutureExt as _;

    let response = answer(&rls, body).with_context(span.clone()).await;
    let code = response
        .headers()
        .get(&GRPC_STATUS)
        .and_then(|code| code.to_str().ok()?.parse::<i64>().ok())
        .unwrap_or(0);
    crate::traces::end_grpc(&span, code);
    Ok(response)
}

async fn answer(rls: &Rls, body: Received) -> http::Response<tonic::body::Body> {
    let answered = match read_message(body).await {
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

/// The one message of a unary request, read whole: refused as tonic's server refuses it when
/// missing, cut short, compressed, too large or not a `RateLimitRequest`, and refused when
/// followed by another.
async fn read_message(body: Received) -> Result<RateLimitRequest, Status> {
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
    if head[0] != 0 {
        return Err(Status::internal(
            "protocol error: received message with compressed-flag but no grpc-encoding was \
             specified",
        ));
    }
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > MAX_MESSAGE {
        return Err(too_large(len));
    }
    match rest.len().cmp(&len) {
        std::cmp::Ordering::Less => Err(Status::internal(CUT_SHORT)),
        // tonic's server answers the first message and drops the rest; a client that sends
        // two has a bug, and is told so rather than charged for half its call.
        std::cmp::Ordering::Greater => Err(Status::internal(
            "a unary call carries one request message, and this one carried more",
        )),
        std::cmp::Ordering::Equal => RateLimitRequest::decode(rest)
            .map_err(|err| Status::internal(format!("failed to decode Protobuf message: {err}"))),
    }
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
