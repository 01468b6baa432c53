//! The gRPC listener: the Envoy RLS service (`rls`, with gRPC health beside it, `health`) on
//! HTTP/2 connections that `h2` reads and this module drives, one task per connection.
//!
//! A general HTTP/2 server (hyper's, and tonic's on top of it) spawns a task for every stream:
//! the connection's task reads the call and wakes the stream's, which answers and wakes the
//! connection's again to write. On a multi-threaded runtime the second task is often taken by
//! the other thread, so every call costs two wake-ups, and often a thread woken from sleep,
//! for a decision that takes a microsecond or two. Here a connection's calls run inside its own
//! task (a `FuturesUnordered` beside the connection): a call decided at once is answered and
//! written in the same pass that read it, and one waiting on Redis wakes only this task.
//! Connections are still spread over the runtime's threads. Calls multiplexed as Envoy sends
//! them cost the server 11–13 µs instead of 15.6–16.7 (BENCHMARKS.md, ninth session); the price
//! is that a connection's calls wait while the thread running its task is paused, which shows
//! in the tail at saturation. The services are tonic's generated ones, so the protocol (framing,
//! status codes and trailers, unknown methods answered `UNIMPLEMENTED`, message size limits)
//! is tonic's, but for the usual `ShouldRateLimit` call, whose one message in and one out are
//! framed by [`crate::grpc_unary`]; this module only moves frames.
//!
//! Shutdown is graceful as for HTTP: once stopped, no connection is accepted, each open one is
//! sent a GOAWAY, and the calls in flight finish before [`serve`] returns.

use std::convert::Infallible;
use std::future::poll_fn;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, Stream, StreamExt};
use h2::server::SendResponse;
use h2::{Reason, RecvStream};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tokio::sync::watch;
use tower_service::Service;

use crate::connection::{
    self, Admitted, ConnectionLimits, IdleClose, Listener, Quiet, StopSignal, Tracked,
};
use crate::metrics::{self, Closed};
use crate::tls::ListenerTls;

/// Calls a client may have open at once on one connection (hyper's default): a client that
/// wants more opens another connection, as Envoy does.
const MAX_CONCURRENT_STREAMS: u32 = 200;

/// Flow-control windows, per stream and per connection, large enough that a client is never
/// held back by them on a call of a few hundred bytes (hyper's defaults).
const WINDOW: u32 = 1024 * 1024;

/// The largest header block a client may send: an RLS call's headers are a few hundred bytes.
const MAX_HEADER_LIST: u32 = 16 * 1024;

/// Bytes of answers buffered for a stream whose client does not read them.
const MAX_SEND_BUFFER: usize = 400 * 1024;

/// A request's body as tonic reads it: the stream's data frames, whose flow-control capacity
/// is handed back as soon as they are read (the message is small and read whole).
pub(crate) struct Received(RecvStream);

impl Body for Received {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        let stream = &mut self.0;
        match stream.poll_data(cx) {
            Poll::Ready(Some(Ok(data))) => {
                // Fails only once the stream is reset, which the next read reports.
                let _ = stream.flow_control().release_capacity(data.len());
                Poll::Ready(Some(Ok(Frame::data(data))))
            }
            Poll::Ready(Some(Err(err))) => Poll::Ready(Some(Err(err))),
            Poll::Ready(None) => match stream.poll_trailers(cx) {
                Poll::Ready(Ok(Some(trailers))) => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
                Poll::Ready(Ok(None)) => Poll::Ready(None),
                Poll::Ready(Err(err)) => Poll::Ready(Some(Err(err))),
                Poll::Pending => Poll::Pending,
            },
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }
}

/// A service this listener can run on its connections (tonic's generated servers are): answers
/// calls with bodies of `B`, never fails as a service, and is shared by the connections' tasks.
pub(crate) trait GrpcService<B>:
    Service<
        http::Request<Received>,
        Response = http::Response<B>,
        Error = Infallible,
        Future: Send + 'static,
    > + Clone
    + Send
    + 'static
{
}

impl<S, B> GrpcService<B> for S where
    S: Service<
            http::Request<Received>,
            Response = http::Response<B>,
            Error = Infallible,
            Future: Send + 'static,
        > + Clone
        + Send
        + 'static
{
}

/// An answer's body: frames of bytes, and a default (empty) body for answers made here.
pub(crate) trait Answer:
    Body<Data = Bytes, Error: std::fmt::Display> + Default + Send + 'static
{
}

impl<B> Answer for B where B: Body<Data = Bytes, Error: std::fmt::Display> + Default + Send + 'static
{}

/// Serves `service` on every connection `incoming` yields until `stopped` turns true (or
/// `incoming` ends), then lets the calls in flight finish.
pub(crate) async fn serve<S, B, I>(
    service: S,
    incoming: I,
    limits: ConnectionLimits,
    tls: Option<Arc<ListenerTls>>,
    stopped: watch::Receiver<bool>,
) where
    S: GrpcService<B>,
    B: Answer,
    I: Stream<Item = std::io::Result<Admitted>>,
{
    let each = |admitted: Admitted| {
        let (service, stopped, tls) = (service.clone(), stopped.clone(), tls.clone());
        async move {
            // The handshake is the connection's first words: bounded as the preface is.
            let Some(admitted) = admitted.secure(tls.as_deref(), limits.header_timeout).await
            else {
                return;
            };
            // A client that goes away mid-call is routine for a server; not an error of ours
            // to report louder than this.
            if let Err(err) = serve_connection(service, admitted, limits, stopped).await {
                tracing::debug!(error = %err, "gRPC connection ended with an error");
            }
        }
    };
    let drain = limits.drain_timeout;
    connection::serve_each(incoming, stopped.clone(), Listener::Grpc, drain, each).await;
}

/// Serves one connection until the client closes it, until it has drained after `stopped`,
/// or until its client has been quiet too long (see [`ConnectionLimits`]).
async fn serve_connection<S, B>(
    service: S,
    admitted: Admitted,
    limits: ConnectionLimits,
    stopped: watch::Receiver<bool>,
) -> Result<(), h2::Error>
where
    S: GrpcService<B>,
    B: Answer,
{
    let mut stop = StopSignal::new(stopped);
    let (stream, activity) = Tracked::new(admitted);
    let handshake = h2::server::Builder::new()
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
        .initial_window_size(WINDOW)
        .initial_connection_window_size(WINDOW)
        .max_header_list_size(MAX_HEADER_LIST)
        .max_send_buffer_size(MAX_SEND_BUFFER)
        .handshake::<_, Bytes>(stream);
    // The handshake ends once the client's connection preface is in: a client that connects
    // and says nothing (or too slowly) is let go here.
    let handshake = tokio::time::timeout(limits.header_timeout, handshake);
    let mut connection = tokio::select! {
        // Stopped before the client said a word: nothing is in flight.
        () = poll_fn(|cx| stop.poll_stopped(cx)) => return Ok(()),
        connection = handshake => match connection {
            Ok(connection) => connection?,
            Err(_) => {
                metrics::record_connection_closed(Listener::Grpc, Closed::HeaderTimeout);
                return Ok(());
            }
        },
    };
    let mut idle = IdleClose::new(activity, limits.idle_timeout);
    let mut calls = FuturesUnordered::new();
    let mut stopping = false;
    // One pass reads what the client sent, starts a call per new stream, and runs the calls
    // until neither the connection nor any call can go further: answers the calls write are
    // flushed by the connection's next poll, hence the loop.
    poll_fn(move |cx| {
        if !stopping && stop.poll_stopped(cx).is_ready() {
            stopping = true;
            connection.graceful_shutdown();
        }
        while let Poll::Ready(step) = idle.poll_step(cx) {
            match step {
                Quiet::AskToClose => {
                    metrics::record_connection_closed(Listener::Grpc, Closed::Idle);
                    connection.graceful_shutdown();
                }
                // Asked and still quiet: its calls wait on a client that sends nothing.
                Quiet::Drop => return Poll::Ready(Ok(())),
            }
        }
        loop {
            let mut progressed = false;
            loop {
                match connection.poll_accept(cx) {
                    Poll::Ready(Some(Ok((request, respond)))) => {
                        let call = answer(service.clone(), request, respond);
                        // A panic fails its call alone (the stream is reset), not the
                        // connection's other calls.
                        calls.push(std::panic::AssertUnwindSafe(call).catch_unwind());
                        progressed = true;
                    }
                    Poll::Ready(Some(Err(err))) => return Poll::Ready(Err(err)),
                    // Closed, or drained after a GOAWAY: h2 waits for every open stream first.
                    Poll::Ready(None) => return Poll::Ready(Ok(())),
                    Poll::Pending => break,
                }
            }
            while let Poll::Ready(Some(outcome)) = calls.poll_next_unpin(cx) {
                if outcome.is_err() {
                    tracing::error!("a gRPC call panicked");
                }
                progressed = true;
            }
            if !progressed {
                return Poll::Pending;
            }
        }
    })
    .await
}

/// Runs one call: the request's body goes to `service` as it arrives, and the answer's frames
/// go back on the stream as the service yields them.
async fn answer<S, B>(
    mut service: S,
    request: http::Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
) where
    S: GrpcService<B>,
    B: Answer,
{
    let deadline = grpc_timeout(request.headers());
    let call = async {
        // tonic's services are always ready; the contract is kept all the same.
        let Ok(()) = poll_fn(|cx| service.poll_ready(cx)).await;
        let Ok(response) = service.call(request.map(Received)).await;
        response
    };
    // The client's deadline (Envoy sends its rate-limit timeout): past it the client has given
    // up, so the call stops waiting (on a slow Redis, say) and says so.
    let response = match deadline {
        None => call.await,
        Some(deadline) => match tokio::time::timeout(deadline, call).await {
            Ok(response) => response,
            Err(_) => {
                tonic::Status::deadline_exceeded("the call's grpc-timeout passed").into_http()
            }
        },
    };
    let (head, body) = response.into_parts();
    let end = body.is_end_stream();
    let Ok(mut stream) = respond.send_response(http::Response::from_parts(head, ()), end) else {
        // The client reset the stream: nobody is waiting for the answer.
        return;
    };
    if end {
        return;
    }
    let mut body = std::pin::pin!(body);
    loop {
        let sent = match body.frame().await {
            None => {
                let _ = stream.send_data(Bytes::new(), true);
                return;
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => stream.send_data(data, false),
                Err(frame) => match frame.into_trailers() {
                    Ok(trailers) => {
                        let _ = stream.send_trailers(trailers);
                        return;
                    }
                    Err(_) => continue,
                },
            },
            Some(Err(err)) => {
                tracing::debug!(error = %err, "a gRPC answer failed mid-body");
                stream.send_reset(Reason::INTERNAL_ERROR);
                return;
            }
        };
        if sent.is_err() {
            return;
        }
    }
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
    use std::sync::Arc;

    use http_body_util::Full;
    use tokio::sync::Notify;

    use tokio::net::TcpStream;

    use super::*;
    use crate::connection::Gate;

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
