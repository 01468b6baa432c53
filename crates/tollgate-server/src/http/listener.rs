//! The HTTP listener: the router served with hyper's HTTP/1 on each admitted connection, under
//! the server's connection bounds ([`ConnectionLimits`]).
//!
//! axum's own `serve` gives no say over how a connection is run, and with it a client could
//! take forever over a request head. Here each connection's task also watches its client:
//! partway through a head for too long ([`HeadTimeout`]), or silent for too long
//! ([`IdleClose`]). Clients see
//! what they saw with axum's: HTTP/1.1 with keep-alive, the peer's address for the admin
//! endpoints' loopback rule, and a graceful stop.

use std::future::poll_fn;
use std::net::SocketAddr;
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;

use axum::Router;
use axum::extract::ConnectInfo;
use futures_util::{FutureExt, Stream};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::sync::watch;
use tower_service::Service;

use super::AppState;
use crate::connection::{
    self, Admitted, ConnectionLimits, HeadTimeout, IdleClose, Listener, Quiet, StopSignal, Tracked,
};
use crate::metrics::{self, Closed};

/// Serves the HTTP API on every connection `incoming` yields until `stopped` turns true (or
/// `incoming` ends), then lets the requests in flight finish.
pub(crate) async fn serve<I>(state: Arc<AppState>, incoming: I, stopped: watch::Receiver<bool>)
where
    I: Stream<Item = std::io::Result<Admitted>>,
{
    let limits = state.connections.limits;
    let tls = state.connections.http_tls.clone();
    let app = super::router(state);
    let each = |admitted: Admitted| {
        let (app, tls, stopped) = (app.clone(), tls.clone(), stopped.clone());
        async move {
            // The handshake is the connection's first words: bounded as a request head is.
            if let Some(admitted) = admitted.secure(tls.as_deref(), limits.header_timeout).await {
                serve_connection(app, admitted, limits, stopped).await;
            }
        }
    };
    let drain = limits.drain_timeout;
    connection::serve_each(incoming, stopped.clone(), Listener::Http, drain, each).await;
}

/// Serves one connection until the client closes it, until it has drained after `stopped`,
/// or until its client has been slow or quiet too long.
async fn serve_connection(
    app: Router,
    admitted: Admitted,
    limits: ConnectionLimits,
    stopped: watch::Receiver<bool>,
) {
    let peer = match admitted.peer() {
        Ok(peer) => peer,
        // Gone between the accept and now.
        Err(_) => return,
    };
    let (stream, activity) = Tracked::new(admitted);
    let requests = activity.clone();
    let service = hyper::service::service_fn(move |mut request: hyper::Request<Incoming>| {
        requests.request_started();
        request
            .extensions_mut()
            .insert(ConnectInfo::<SocketAddr>(peer));
        // A router is always ready, and cloning it is a reference count.
        let answer = app.clone().call(request);
        let responded = requests.clone();
        // Marked before hyper writes it: a write before then is an interim answer.
        answer.inspect(move |_| responded.request_responded())
    });
    // No timer for hyper: the head timeout is kept by `HeadTimeout` (see why there).
    let builder = hyper::server::conn::http1::Builder::new();
    let mut connection = pin!(builder.serve_connection(TokioIo::new(stream), service));
    let mut stop = StopSignal::new(stopped);
    let mut stopping = false;
    let mut head = HeadTimeout::new(activity.clone(), limits.header_timeout);
    let mut idle = IdleClose::new(activity, limits.idle_timeout);
    // Polled by hand rather than with `select!`: the stop signal and the idle timer are looked
    // at cheaply on each of the many wake-ups that are the connection's (see their docs).
    let served = poll_fn(|cx| {
        if !stopping && stop.poll_stopped(cx).is_ready() {
            stopping = true;
            connection.as_mut().graceful_shutdown();
        }
        if head.poll_expired(cx).is_ready() {
            // Partway through a head: there is no request to finish.
            metrics::record_connection_closed(Listener::Http, Closed::HeaderTimeout);
            return Poll::Ready(Ok(()));
        }
        while let Poll::Ready(step) = idle.poll_step(cx) {
            match step {
                Quiet::AskToClose => {
                    metrics::record_connection_closed(Listener::Http, Closed::Idle);
                    connection.as_mut().graceful_shutdown();
                }
                // Asked and still quiet: a request waits on a body that is not coming.
                Quiet::Drop => return Poll::Ready(Ok(())),
            }
        }
        connection.as_mut().poll(cx)
    })
    .await;
    if let Err(err) = served {
        tracing::debug!(error = %err, "HTTP connection ended with an error");
    }
}
