//! The gRPC listener: the Envoy RLS service (`rls`, with gRPC health beside it, `health`) on
//! HTTP/2 connections driven as [`crate::http2`] drives them, one task per connection.
//!
//! The services are tonic's generated ones, so the protocol (framing, status codes and
//! trailers, unknown methods answered `UNIMPLEMENTED`, message size limits) is tonic's, but
//! for the usual `ShouldRateLimit` call, whose one message in and one out are framed by
//! [`crate::grpc_unary`]; the connections only move frames. What this listener adds to them is
//! gRPC's: a client's `grpc-timeout` bounds its call.
//!
//! Shutdown is graceful as for HTTP: once stopped, no connection is accepted, each open one is
//! sent a GOAWAY, and the calls in flight finish before [`serve`] returns.

use std::sync::Arc;
use std::time::Duration;

use futures_util::Stream;
use tokio::sync::watch;

use crate::connection::{self, Admitted, ConnectionLimits, Listener};
use crate::http2::{self, Answer, Http2Service, Protocol};
use crate::tls::ListenerTls;

/// The gRPC listener's HTTP/2.
struct Grpc;

impl Protocol for Grpc {
    const LISTENER: Listener = Listener::Grpc;
    /// An RLS call's headers are a few hundred bytes.
    const MAX_HEADER_LIST: u32 = 16 * 1024;

    /// The client's deadline (Envoy sends its rate-limit timeout): past it the client has
    /// given up, so the call stops waiting and says so.
    fn deadline(headers: &http::HeaderMap) -> Option<Duration> {
        grpc_timeout(headers)
    }

    fn too_late<B: Default>() -> http::Response<B> {
        tonic::Status::deadline_exceeded("the call's grpc-timeout passed").into_http()
    }
}

/// Serves `service` on every connection `incoming` yields until `stopped` turns true (or
/// `incoming` ends), then lets the calls in flight finish.
pub(crate) async fn serve<S, B, I>(
    service: S,
    incoming: I,
    limits: ConnectionLimits,
    tls: Option<Arc<ListenerTls>>,
    stopped: watch::Receiver<bool>,
) where
    S: Http2Service<B>,
    B: Answer,
    I: Stream<Item = std::io::Result<Admitted>>,
{
    let each = |admitted: Admitted| {
        let (service, stopped, tls) = (service.clone(), stopped.clone(), tls.clone());
        async move {
            // The handshake is the connection's first words: bounded as the preface is.
            let by = admitted.first_words_by(&limits);
            let Some(admitted) = admitted.secure(tls.as_deref(), by).await else {
                return;
            };
            let served = http2::serve_connection::<Grpc, _, _>(service, admitted, limits, stopped);
            // A client that goes away mid-call is routine for a server; not an error of ours
            // to report louder than this.
            if let Err(err) = served.await {
                tracing::debug!(error = %err, "gRPC connection ended with an error");
            }
        }
    };
    let drain = limits.drain_timeout;
    connection::serve_each(incoming, stopped.clone(), Listener::Grpc, drain, each).await;
}

/// The `grpc-timeout` header: at most 8 digits and a unit (`H`, `M`, `S`, `m`, `u`, `n`). A
/// malformed one is ignored, as if absent: the call then runs without a deadline of its own,
/// still bounded by the store's timeout.
fn grpc_timeout(headers: &http::HeaderMap) -> Option<Duration> {
    // A constant name: one given as a string is parsed on every call.
    const GRPC_TIMEOUT: http::HeaderName = http::HeaderName::from_static("grpc-timeout");
    let (&unit, digits) = headers.get(&GRPC_TIMEOUT)?.as_bytes().split_last()?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    // At most 8 digits: no overflow, even in hours.
    let amount = digits
        .iter()
        .fold(0u64, |amount, digit| amount * 10 + u64::from(digit - b'0'));
    Some(match unit {
        b'H' => Duration::from_secs(amount * 3600),
        b'M' => Duration::from_secs(amount * 60),
        b'S' => Duration::from_secs(amount),
        b'm' => Duration::from_millis(amount),
        b'u' => Duration::from_micros(amount),
        b'n' => Duration::from_nanos(amount),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use tokio::net::TcpStream;
    use tokio::sync::Notify;
    use tower_service::Service;

    use super::*;
    use crate::connection::Gate;
    use crate::http2::Received;

    /// A service whose calls answer only when released.
    #[derive(Clone, Default)]
    struct Held {
        started: Arc<Notify>,
        release: Arc<Notify>,
    }

    impl Service<http::Request<Received>> for Held {
        type Response = http::Response<Full<Bytes>>;
        type Error = Infallible;
        type Future =
            Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send + 'static>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        /// `/echo` answers its request's body at once and `/panic` panics; any other path is
        /// held until released.
        fn call(&mut self, request: http::Request<Received>) -> Self::Future {
            let (started, release) = (Arc::clone(&self.started), Arc::clone(&self.release));
            Box::pin(async move {
                match request.uri().path() {
                    "/echo" => {
                        let body = request.into_body().collect().await.unwrap().to_bytes();
                        Ok(http::Response::new(Full::new(body)))
                    }
                    "/panic" => panic!("a call's own failure"),
                    _ => {
                        started.notify_one();
                        release.notified().await;
                        Ok(http::Response::new(Full::new(Bytes::from_static(b"done"))))
                    }
                }
            })
        }
    }

    /// Sends a POST to `path` with `body` on `client`'s connection.
    fn post(
        client: &mut h2::client::SendRequest<Bytes>,
        path: &str,
        body: &'static [u8],
    ) -> h2::client::ResponseFuture {
        let request = http::Request::post(format!("http://tollgate{path}"))
            .body(())
            .unwrap();
        let (answer, mut stream) = client.send_request(request, false).unwrap();
        stream.send_data(Bytes::from_static(body), true).unwrap();
        answer
    }

    /// `serve` running a [`Held`] service on a free port, with a client connected to it.
    struct Running {
        held: Held,
        stop: watch::Sender<bool>,
        server: tokio::task::JoinHandle<()>,
        client: h2::client::SendRequest<Bytes>,
    }

    impl Running {
        async fn start() -> Self {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let incoming = connection::admit(listener, Arc::new(Gate::new(100)));
            let (stop, stopped) = watch::channel(false);
            let held = Held::default();
            let server = tokio::spawn(serve(
                held.clone(),
                incoming,
                ConnectionLimits::default(),
                None,
                stopped,
            ));
            let stream = TcpStream::connect(addr).await.unwrap();
            let (client, connection) = h2::client::handshake(stream).await.unwrap();
            tokio::spawn(connection);
            let client = client.ready().await.unwrap();
            Self {
                held,
                stop,
                server,
                client,
            }
        }
    }

    /// The whole body of an answer.
    async fn read(answer: h2::client::ResponseFuture) -> Result<Bytes, h2::Error> {
        let mut body = answer.await?.into_body();
        let mut all = Vec::new();
        while let Some(data) = body.data().await {
            all.extend_from_slice(&data?);
        }
        Ok(Bytes::from(all))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn calls_on_one_connection_do_not_wait_for_each_other_and_a_panic_fails_its_call_alone() {
        let Running {
            held,
            stop,
            server,
            mut client,
        } = Running::start().await;

        // A call that waits (on Redis, say) holds up none of the others on its connection.
        let waiting = post(&mut client, "/hold", b"");
        held.started.notified().await;
        let echoed = tokio::time::timeout(
            Duration::from_secs(10),
            read(post(&mut client, "/echo", b"a request body")),
        )
        .await
        .expect("answered while another call waits");
        assert_eq!(&echoed.unwrap()[..], b"a request body");

        // A call that panics has its stream reset; the connection and its calls go on.
        let failed = read(post(&mut client, "/panic", b"")).await;
        assert!(failed.is_err(), "a panicked call answered: {failed:?}");
        let echoed = read(post(&mut client, "/echo", b"still here")).await;
        assert_eq!(&echoed.unwrap()[..], b"still here");

        held.release.notify_one();
        assert_eq!(&read(waiting).await.unwrap()[..], b"done");
        stop.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("serve returns once stopped")
            .unwrap();
    }

    #[test]
    fn grpc_timeouts_parse_by_the_protocol_and_malformed_ones_are_ignored() {
        let parse = |value: &'static str| {
            let mut headers = http::HeaderMap::new();
            headers.insert("grpc-timeout", http::HeaderValue::from_static(value));
            grpc_timeout(&headers)
        };
        assert_eq!(parse("20m"), Some(Duration::from_millis(20)));
        assert_eq!(parse("1S"), Some(Duration::from_secs(1)));
        assert_eq!(parse("2M"), Some(Duration::from_secs(120)));
        assert_eq!(
            parse("99999999H"),
            Some(Duration::from_secs(99_999_999 * 3600))
        );
        assert_eq!(parse("5u"), Some(Duration::from_micros(5)));
        assert_eq!(parse("7n"), Some(Duration::from_nanos(7)));
        for bad in ["", "m", "20", "20x", "123456789m", "-1S", "1.5S", " 1S"] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
        assert_eq!(grpc_timeout(&http::HeaderMap::new()), None);
    }

    /// A call still waiting when its client's `grpc-timeout` passes is answered
    /// `DEADLINE_EXCEEDED` then, not when the service would have finished.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_past_its_grpc_timeout_is_answered_deadline_exceeded() {
        let Running {
            held,
            stop,
            server,
            mut client,
        } = Running::start().await;

        let request = http::Request::post("http://tollgate/hold")
            .header("grpc-timeout", "50m")
            .body(())
            .unwrap();
        let (answer, _) = client.send_request(request, true).unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(10), answer)
            .await
            .expect("answered at the deadline, though the call is still held")
            .unwrap();
        // A trailers-only answer: the status is in the headers.
        assert_eq!(
            answer.headers().get("grpc-status").map(|v| v.as_bytes()),
            Some(&b"4"[..]),
            "{answer:?}"
        );
        held.release.notify_waiters();
        stop.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("serve returns once stopped")
            .unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_in_flight_finishes_after_the_stop_and_new_clients_are_refused() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let incoming = connection::admit(listener, Arc::new(Gate::new(100)));
        let (stop, stopped) = watch::channel(false);
        let held = Held::default();
        let mut server = tokio::spawn(serve(
            held.clone(),
            incoming,
            ConnectionLimits::default(),
            None,
            stopped,
        ));

        let (mut client, connection) =
            h2::client::handshake(TcpStream::connect(addr).await.unwrap())
                .await
                .unwrap();
        tokio::spawn(connection);
        let request = http::Request::post(format!("http://{addr}/x"))
            .body(())
            .unwrap();
        let (answer, _) = client.send_request(request, true).unwrap();
        held.started.notified().await;

        stop.send(true).unwrap();
        let early = tokio::time::timeout(Duration::from_millis(100), &mut server).await;
        assert!(early.is_err(), "returned with a call in flight");
        // The listener is closed: a new client is refused, not left waiting.
        let mut refused = false;
        for _ in 0..200 {
            if TcpStream::connect(addr).await.is_err() {
                refused = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(refused, "still accepting after the stop");

        held.release.notify_one();
        let answer = answer.await.unwrap();
        assert_eq!(answer.status(), http::StatusCode::OK);
        let mut body = answer.into_body();
        let data = body.data().await.unwrap().unwrap();
        assert_eq!(&data[..], b"done");
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("serve returns once the call is answered")
            .unwrap();
    }
}
