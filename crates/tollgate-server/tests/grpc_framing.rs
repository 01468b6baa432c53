//! The RLS call's gRPC framing as a client writing HTTP/2 by hand sees it: a call is answered
//! whether its message comes in one data frame or several, and a malformed call gets the
//! status and message tonic's own server gives it (but for two messages in one unary call,
//! which tonic half-answers and tollgate refuses), while the server keeps serving. A message
//! compressed with gzip is inflated, within the same bound as a plain one.

mod support;

use bytes::{BufMut, Bytes, BytesMut};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use prost::Message;
use support::{Server, descriptor};

const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// What came back for one call: the answer's body and its `grpc-status` and `grpc-message`
/// (from the trailers, or from the head of a trailers-only answer).
struct Answer {
    body: Bytes,
    status: String,
    message: String,
    /// The encodings the server says it takes, when it says.
    accept_encoding: String,
}

/// A new HTTP/2 connection to the gRPC port, ready to send.
async fn connect(server: &Server) -> h2::client::SendRequest<Bytes> {
    let stream = tokio::net::TcpStream::connect(server.grpc)
        .await
        .expect("connect to the gRPC port");
    let (client, connection) = h2::client::handshake(stream).await.expect("a handshake");
    tokio::spawn(connection);
    client.ready().await.expect("ready to send")
}

/// Sends one call on a new connection, with `headers` added and `frames` as its data frames.
async fn call(
    server: &Server,
    headers: &[(&'static str, &'static str)],
    frames: Vec<Bytes>,
) -> Answer {
    let mut client = connect(server).await;
    let mut request = http::Request::post(format!("http://tollgate{PATH}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .expect("a request");
    for (name, value) in headers {
        request.headers_mut().insert(
            http::HeaderName::from_static(name),
            http::HeaderValue::from_static(value),
        );
    }
    let (answer, mut sending) = client
        .send_request(request, frames.is_empty())
        .expect("send the head");
    let count = frames.len();
    for (index, frame) in frames.into_iter().enumerate() {
        sending
            .send_data(frame, index + 1 == count)
            .expect("send a frame");
    }
    let answer = answer.await.expect("an answer");
    assert_eq!(answer.status(), 200);
    assert_eq!(answer.headers()["content-type"], "application/grpc");
    let (head, mut body) = answer.into_parts();
    let mut bytes = BytesMut::new();
    while let Some(data) = body.data().await {
        let data = data.expect("the answer's data");
        let _ = body.flow_control().release_capacity(data.len());
        bytes.extend_from_slice(&data);
    }
    let trailers = body.trailers().await.expect("trailers");
    let fields = trailers.unwrap_or(head.headers);
    let field = |name: &str| {
        fields
            .get(name)
            .map(|value| value.to_str().expect("ASCII").to_owned())
            .unwrap_or_default()
    };
    Answer {
        body: bytes.freeze(),
        status: field("grpc-status"),
        message: field("grpc-message"),
        accept_encoding: field("grpc-accept-encoding"),
    }
}

fn request(user: &str) -> RateLimitRequest {
    RateLimitRequest {
        domain: "api".to_owned(),
        descriptors: vec![descriptor(&[("user", user)])],
        hits_addend: 1,
    }
}

/// `message` as gRPC frames it: a compression flag, a 4-byte length, the bytes.
fn framed(flag: u8, length: u32, message: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(5 + message.len());
    out.put_u8(flag);
    out.put_u32(length);
    out.extend_from_slice(message);
    out.freeze()
}

/// The largest request message the server reads.
const MESSAGE_LIMIT: usize = 4 << 20;

/// A request encoded in exactly `len` bytes (kilobytes or more), its one value as long as that
/// takes: past the bounds of a descriptor entry, so decided as `INVALID_ARGUMENT` once read.
fn of_length(len: usize) -> Vec<u8> {
    let of_value = |value: usize| RateLimitRequest {
        domain: "api".to_owned(),
        descriptors: vec![descriptor(&[("user", &"u".repeat(value))])],
        hits_addend: 1,
    };
    let overhead = of_value(len).encoded_len() - len;
    let message = of_value(len - overhead).encode_to_vec();
    assert_eq!(message.len(), len);
    message
}

fn encoded(user: &str) -> Vec<u8> {
    request(user).encode_to_vec()
}

fn decoded(answer: &Answer) -> RateLimitResponse {
    assert_eq!(answer.status, "0", "{}", answer.message);
    let (prefix, message) = answer.body.split_at(5);
    assert_eq!(prefix[0], 0, "not compressed");
    let length = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]);
    assert_eq!(length as usize, message.len());
    RateLimitResponse::decode(message).expect("a RateLimitResponse")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_is_answered_in_one_frame_or_several() {
    let server = Server::start(&[]);
    let message = encoded("alice");
    let whole = framed(0, message.len() as u32, &message);
    let answer = decoded(&call(&server, &[], vec![whole.clone()]).await);
    assert_eq!(answer.overall_code, Code::Ok as i32);
    assert_eq!(answer.statuses.len(), 1);
    // The demo policy's per-user bucket holds 10: one taken above.
    assert_eq!(answer.statuses[0].limit_remaining, 9);

    // The prefix cut in two, the message in two more.
    let frames = vec![
        whole.slice(..2),
        whole.slice(2..7),
        whole.slice(7..12),
        whole.slice(12..),
    ];
    let answer = decoded(&call(&server, &[], frames).await);
    assert_eq!(answer.statuses[0].limit_remaining, 8);

    // `grpc-encoding: identity` is no compression.
    let answer = call(
        &server,
        &[("grpc-encoding", "identity")],
        vec![whole.clone()],
    )
    .await;
    assert_eq!(decoded(&answer).statuses[0].limit_remaining, 7);
    // A content type of another codec's name goes to tonic's server, which decides alike.
    let answer = call(
        &server,
        &[("content-type", "application/grpc+tollgate")],
        vec![whole],
    )
    .await;
    assert_eq!(answer.status, "0", "{}", answer.message);
    assert_eq!(decoded(&answer).statuses[0].limit_remaining, 6);
}

/// Envoy forwards tracing and custom metadata as headers: a call carrying kilobytes of them is
/// answered, and only a header block past the server's 16 KiB is refused. A message is read
/// up to 4 MiB, and a call is refused once more than that has come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_is_answered_up_to_the_header_and_message_limits() {
    let server = Server::start(&[]);
    let message = encoded("carol");
    let whole = framed(0, message.len() as u32, &message);
    let metadata: &'static str = Box::leak("a".repeat(8 * 1024).into_boxed_str());
    let answer = call(
        &server,
        &[("x-trace-context", metadata)],
        vec![whole.clone()],
    )
    .await;
    assert_eq!(decoded(&answer).overall_code, Code::Ok as i32);

    let mut client = connect(&server).await;
    let request = http::Request::post(format!("http://tollgate{PATH}"))
        .header("content-type", "application/grpc")
        .header("x-trace-context", "a".repeat(32 * 1024))
        .body(())
        .expect("a request");
    let refused = match client.send_request(request, false) {
        // The client may refuse to send what the server said it would not take.
        Err(_) => true,
        Ok((answer, mut sending)) => {
            let _ = sending.send_data(whole.clone(), true);
            answer.await.map_or(true, |answer| answer.status() != 200)
        }
    };
    assert!(refused, "a 32 KiB header block was answered");
    // A message of exactly 4 MiB is read whole and decided (its value is past the bounds of
    // a descriptor entry), not refused as too large to read.
    let limit = MESSAGE_LIMIT;
    let huge = of_length(limit);
    let whole_huge = framed(0, huge.len() as u32, &huge);
    let answer = call(&server, &[], vec![whole_huge.clone()]).await;
    assert_eq!(answer.status, "3", "{}", answer.message);
    // One byte more is refused as too large as soon as it arrives, counted as read: not read
    // on to the end and refused as a second message.
    let answer = call(&server, &[], vec![whole_huge, Bytes::from_static(&[0])]).await;
    assert_eq!(answer.status, "11", "{}", answer.message);
    let text = percent_decoded(&answer.message);
    assert!(
        text.contains(&format!("found {} bytes", limit + 1)),
        "{text}"
    );
    // And the server goes on serving.
    let answer = call(&server, &[], vec![whole]).await;
    assert_eq!(decoded(&answer).overall_code, Code::Ok as i32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_calls_are_refused_as_tonic_refuses_them_and_charge_nothing() {
    let server = Server::start(&[]);
    let message = encoded("bob");
    let len = message.len() as u32;
    let mut two = framed(0, len, &message).to_vec();
    two.extend_from_slice(&framed(0, len, &message));
    let cases: Vec<(&str, Vec<Bytes>, &str, &str)> = vec![
        ("no message", vec![], "13", "Missing request message."),
        (
            "a cut prefix",
            vec![Bytes::from_static(&[0, 0])],
            "13",
            "Unexpected EOF",
        ),
        (
            "a compressed message",
            vec![framed(1, len, &message)],
            "13",
            "compressed-flag",
        ),
        (
            "a cut message",
            vec![framed(0, len + 10, &message)],
            "13",
            "Unexpected EOF",
        ),
        // (tonic's own server answered the first and dropped the second)
        (
            "two messages",
            vec![Bytes::from(two)],
            "13",
            "carries one request message",
        ),
        (
            "a message over 4 MiB",
            vec![framed(0, 5 << 20, b"x")],
            "11",
            "too large",
        ),
        (
            "not protobuf",
            vec![framed(0, 3, &[0xff, 0xff, 0xff])],
            "13",
            "decode",
        ),
    ];
    for (what, frames, status, message) in cases {
        let answer = call(&server, &[], frames).await;
        assert_eq!(answer.status, status, "{what}: {}", answer.message);
        let text = percent_decoded(&answer.message);
        assert!(text.contains(message), "{what}: {text}");
    }
    // Nothing above was charged, and the server still answers.
    let whole = framed(0, len, &message);
    let answer = decoded(&call(&server, &[], vec![whole]).await);
    assert_eq!(answer.statuses[0].limit_remaining, 9);
}

fn gzipped(message: &[u8]) -> Vec<u8> {
    use std::io::Write;

    let mut gzip = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gzip.write_all(message).expect("compress");
    gzip.finish().expect("compress")
}

/// gRPC libraries compress every call when told to (`grpc-encoding: gzip`): such a call is
/// inflated and decided like a plain one, by the hand-written client here and by tonic's.
/// Inflating stops at the bound of a plain message, so a few kilobytes of gzip cannot make the
/// server hold megabytes; what cannot be inflated, and encodings not taken, are refused and
/// charge nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compressed_calls_are_inflated_and_decided() {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    use tonic::codec::CompressionEncoding;

    // Exactly the bound, inflated, and one byte more: compressed first, as that takes a while
    // and the bucket refills meanwhile.
    let at_bound = gzipped(&of_length(MESSAGE_LIMIT));
    let bomb = gzipped(&of_length(MESSAGE_LIMIT + 1));
    assert!(bomb.len() < 64 * 1024, "{} bytes of gzip", bomb.len());

    let server = Server::start(&[]);
    let gzip = [("grpc-encoding", "gzip")];
    let message = encoded("zip");
    let compressed = gzipped(&message);
    assert_ne!(compressed, message);
    let whole = framed(1, compressed.len() as u32, &compressed);
    let answer = decoded(&call(&server, &gzip, vec![whole.clone()]).await);
    assert_eq!(answer.overall_code, Code::Ok as i32);
    assert_eq!(answer.statuses[0].limit_remaining, 9);
    // Cut across frames as well.
    let frames = vec![whole.slice(..3), whole.slice(3..9), whole.slice(9..)];
    let answer = decoded(&call(&server, &gzip, frames).await);
    assert_eq!(answer.statuses[0].limit_remaining, 8);
    // Each message says whether it is compressed: a plain one under the same header is read
    // as it is.
    let plain = framed(0, message.len() as u32, &message);
    let answer = decoded(&call(&server, &gzip, vec![plain.clone()]).await);
    assert_eq!(answer.statuses[0].limit_remaining, 7);
    // tonic's client, told to compress.
    let mut client = RateLimitServiceClient::new(server.grpc_channel().await)
        .send_compressed(CompressionEncoding::Gzip);
    let answer = client
        .should_rate_limit(request("zip"))
        .await
        .expect("a compressed call is answered")
        .into_inner();
    assert_eq!(answer.statuses[0].limit_remaining, 6);

    // Exactly the bound, inflated, is read whole and decided (its value is past the bounds of
    // a descriptor entry: INVALID_ARGUMENT), not refused as too large; one byte more is not.
    let answer = call(
        &server,
        &gzip,
        vec![framed(1, at_bound.len() as u32, &at_bound)],
    )
    .await;
    assert_eq!(answer.status, "3", "{}", answer.message);
    // The rest are a user of their own, whose bucket they must leave full.
    let message = encoded("refused");
    let compressed = gzipped(&message);
    let plain = framed(0, message.len() as u32, &message);
    let cases = [
        (
            "past the bound once inflated",
            "gzip",
            framed(1, bomb.len() as u32, &bomb),
            "11",
            "decompressed message length too large",
        ),
        (
            "not gzip",
            "gzip",
            framed(1, message.len() as u32, &message),
            "13",
            "Error decompressing",
        ),
        (
            "gzip cut short",
            "gzip",
            framed(1, 10, &compressed[..10]),
            "13",
            "Error decompressing",
        ),
        (
            "a flag neither 0 nor 1",
            "gzip",
            framed(2, compressed.len() as u32, &compressed),
            "13",
            "invalid compression flag",
        ),
        (
            "an encoding not taken",
            "deflate",
            plain.clone(),
            "12",
            "`deflate` which isn't supported",
        ),
    ];
    for (what, encoding, frame, status, text) in cases {
        let answer = call(&server, &[("grpc-encoding", encoding)], vec![frame]).await;
        assert_eq!(answer.status, status, "{what}: {}", answer.message);
        let message = percent_decoded(&answer.message);
        assert!(message.contains(text), "{what}: {message}");
        if status == "12" {
            assert_eq!(answer.accept_encoding, "identity,gzip", "{what}");
        }
    }
    // None of those was charged.
    let answer = decoded(&call(&server, &[], vec![plain]).await);
    assert_eq!(answer.statuses[0].limit_remaining, 9);
}

/// `grpc-message` is percent-encoded.
fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        if bytes[at] == b'%'
            && let Some(byte) = text
                .get(at + 1..at + 3)
                .and_then(|hex| u8::from_str_radix(hex, 16).ok())
        {
            out.push(byte);
            at += 3;
            continue;
        }
        out.push(bytes[at]);
        at += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}
