//! HTTP/2 connections that `h2` reads and this module drives, one task per connection: the
//! gRPC listener's, and the HTTP listener's for clients that speak HTTP/2.
//!
//! A general HTTP/2 server (hyper's, and tonic's on top of it) spawns a task for every stream:
//! the connection's task reads the request and wakes the stream's, which answers and wakes the
//! connection's again to write. On a multi-threaded runtime the second task is often taken by
//! the other thread, so every request costs two wake-ups, and often a thread woken from sleep,
//! for a decision that takes a microsecond or two. Here a connection's requests run inside its
//! own task (a `FuturesUnordered` beside the connection): a request decided at once is answered
//! and written in the same pass that read it, and one waiting on Redis wakes only this task.
//! Connections are still spread over the runtime's threads. Calls multiplexed as Envoy sends
//! them cost the server 11–13 µs instead of 15.6–16.7 (BENCHMARKS.md, ninth session); the price
//! is that a connection's requests wait while the thread running its task is paused, which
//! shows in the tail at saturation.
//!
//! What differs between the two listeners (their metrics' name, the largest header block, a
//! client's deadline as gRPC states it) is a [`Protocol`], fixed at compile time so that the
//! gRPC path pays nothing for the HTTP one.

use std::convert::Infallible;
use std::future::poll_fn;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use h2::server::SendResponse;
use h2::{Reason, RecvStream};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tokio::sync::watch;
use tower_service::Service;

use crate::connection::{
    Admitted, ConnectionLimits, IdleClose, Listener, Quiet, StopSignal, Tracked,
};
use crate::metrics::{self, Closed};

/// Requests a client may have open at once on one connection (hyper's default): a client
/// that wants more opens another connection, as Envoy does.
const MAX_CONCURRENT_STREAMS: u32 = 200;

/// Flow-control windows, per stream and per connection, large enough that a client is never
/// held back by them on a request of a few hundred bytes (hyper's defaults).
const WINDOW: u32 = 1024 * 1024;

/// Bytes of answers buffered for a stream whose client does not read them.
const MAX_SEND_BUFFER: usize = 400 * 1024;

/// What one listener's HTTP/2 has of its own.
pub(crate) trait Protocol {
    /// The listener, as the metrics name it.
    const LISTENER: Listener;
    /// The largest header block a client may send.
    const MAX_HEADER_LIST: u32;

    /// How long the client will wait for the answer to a request with these headers, when it
    /// says so; past it the request stops waiting (on a slow Redis, say). By default clients
    /// say nothing of it.
    fn deadline(_headers: &http::HeaderMap) -> Option<Duration> {
        None
    }

    /// Adds what this listener's answers carry beyond what the service made (by default
    /// nothing).
    fn finish(_head: &mut http::response::Parts) {}

    /// The answer to a request whose client's deadline passed first (by default
    /// `504 Gateway Timeout`).
    fn too_late<B: Default>() -> http::Response<B> {
        let mut answer = http::Response::new(B::default());
        *answer.status_mut() = http::StatusCode::GATEWAY_TIMEOUT;
        answer
    }
}

/// A request's body as a service reads it: the stream's data frames, whose flow-control
/// capacity is handed back as soon as they are read (a request is small and read whole).
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

/// A service these connections can run (tonic's generated servers and axum's router are):
/// answers requests with bodies of `B`, never fails as a service, and is shared by the
/// connections' tasks.
pub(crate) trait Http2Service<B>:
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

impl<S, B> Http2Service<B> for S where
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

/// Serves one connection until the client closes it, until it has drained after `stopped`,
/// or until its client has been quiet too long (see [`ConnectionLimits`]).
pub(crate) async fn serve_connection<P, S, B>(
    service: S,
    admitted: Admitted,
    limits: ConnectionLimits,
    stopped: watch::Receiver<bool>,
) -> Result<(), h2::Error>
where
    P: Protocol,
    S: Http2Service<B>,
    B: Answer,
{
    let mut stop = StopSignal::new(stopped);
    let first_words_by = admitted.first_words_by(&limits);
    let (stream, activity) = Tracked::new(admitted);
    let handshake = h2::server::Builder::new()
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
        .initial_window_size(WINDOW)
        .initial_connection_window_size(WINDOW)
        .max_header_list_size(P::MAX_HEADER_LIST)
        .max_send_buffer_size(MAX_SEND_BUFFER)
        .handshake::<_, Bytes>(stream);
    // The handshake ends once the client's connection preface is in: a client that connects
    // and says nothing (or too slowly) is let go here.
    let handshake = tokio::time::timeout_at(first_words_by, handshake);
    let mut connection = tokio::select! {
        // Stopped before the client said a word: nothing is in flight.
        () = poll_fn(|cx| stop.poll_stopped(cx)) => return Ok(()),
        connection = handshake => match connection {
            Ok(connection) => {
                let connection = connection?;
                metrics::record_connection_opened(P::LISTENER, "h2");
                connection
            }
            Err(_) => {
                metrics::record_connection_closed(P::LISTENER, Closed::HeaderTimeout);
                return Ok(());
            }
        },
    };
    let mut idle = IdleClose::new(activity, limits.idle_timeout);
    let mut requests = FuturesUnordered::new();
    let mut stopping = false;
    // One pass reads what the client sent, starts a request per new stream, and runs the
    // requests until neither the connection nor any request can go further: answers the
    // requests write are flushed by the connection's next poll, hence the loop.
    poll_fn(move |cx| {
        if !stopping && stop.poll_stopped(cx).is_ready() {
            stopping = true;
            connection.graceful_shutdown();
        }
        while let Poll::Ready(step) = idle.poll_step(cx) {
            match step {
                Quiet::AskToClose => {
                    metrics::record_connection_closed(P::LISTENER, Closed::Idle);
                    connection.graceful_shutdown();
                }
                // Asked and still quiet: its requests wait on a client that sends nothing.
                Quiet::Drop => return Poll::Ready(Ok(())),
            }
        }
        loop {
            let mut progressed = false;
            loop {
                match connection.poll_accept(cx) {
                    Poll::Ready(Some(Ok((request, respond)))) => {
                        let answered = answer::<P, S, B>(service.clone(), request, respond);
                        // A panic fails its request alone (the stream is reset), not the
                        // connection's other requests.
                        requests.push(std::panic::AssertUnwindSafe(answered).catch_unwind());
                        progressed = true;
                    }
                    Poll::Ready(Some(Err(err))) => return Poll::Ready(Err(err)),
                    // Closed, or drained after a GOAWAY: h2 waits for every open stream first.
                    Poll::Ready(None) => return Poll::Ready(Ok(())),
                    Poll::Pending => break,
                }
            }
            while let Poll::Ready(Some(outcome)) = requests.poll_next_unpin(cx) {
                if outcome.is_err() {
                    tracing::error!(
                        listener = P::LISTENER.as_str(),
                        "a request on an HTTP/2 connection panicked"
                    );
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

/// Runs one request: its body goes to `service` as it arrives, and the answer's frames go
/// back on the stream as the service yields them.
async fn answer<P, S, B>(
    mut service: S,
    request: http::Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
) where
    P: Protocol,
    S: Http2Service<B>,
    B: Answer,
{
    let deadline = P::deadline(request.headers());
    let call = async {
        // These services are always ready; the contract is kept all the same.
        let Ok(()) = poll_fn(|cx| service.poll_ready(cx)).await;
        let Ok(response) = service.call(request.map(Received)).await;
        response
    };
    let response = match deadline {
        None => call.await,
        Some(deadline) => match tokio::time::timeout(deadline, call).await {
            Ok(response) => response,
            Err(_) => P::too_late(),
        },
    };
    let (mut head, body) = response.into_parts();
    P::finish(&mut head);
    let end = body.is_end_stream();
    let Ok(mut stream) = respond.send_response(http::Response::from_parts(head, ()), end) else {
        // The client reset the stream, or the head cannot be sent over HTTP/2: nobody is
        // waiting for the rest.
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
                tracing::debug!(
                    error = %err,
                    listener = P::LISTENER.as_str(),
                    "an answer failed mid-body"
                );
                stream.send_reset(Reason::INTERNAL_ERROR);
                return;
            }
        };
        if sent.is_err() {
            return;
        }
    }
}
