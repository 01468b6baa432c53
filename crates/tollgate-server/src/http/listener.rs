//! The HTTP listener: the router served on each admitted connection, under the server's
//! connection bounds ([`ConnectionLimits`]), over HTTP/1.1 or HTTP/2, as the client speaks.
//!
//! axum's own `serve` gives no say over how a connection is run, and with it a client could
//! take forever over a request head. Here each HTTP/1 connection's task also watches its
//! client: partway through a head for too long ([`HeadTimeout`]), or silent for too long
//! ([`IdleClose`]). Clients see what they saw with axum's: HTTP/1.1 with keep-alive, the
//! peer's address for the admin endpoints' loopback rule, and a graceful stop.
//!
//! A client that speaks HTTP/2 (by ALPN over TLS, or with prior knowledge on a plain
//! connection) is served as the gRPC listener serves its clients ([`crate::http2`]): many
//! requests at once on one connection, each answered in the connection's own task. Proxies
//! and service meshes that keep a few HTTP/2 connections to their upstreams, and clients that
//! negotiate it over TLS, then need no connection per request in flight.

use std::convert::Infallible;
use std::future::poll_fn;
use std::net::SocketAddr;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::Router;
use axum::extract::ConnectInfo;
use futures_util::future::{BoxFuture, Either};
use futures_util::{FutureExt, Stream};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::sync::watch;
use tollgate_policy::{SystemWallClock, WallClock};
use tower_service::Service;

use super::AppState;
use super::direct::Direct;
use crate::connection::{
    self, Admitted, ConnectionLimits, HeadTimeout, IdleClose, Listener, Quiet, StopSignal, Tracked,
};
use crate::http2::{self, Protocol, Received};
use crate::metrics::{self, Closed};

/// The HTTP listener's HTTP/2.
struct Http2;

impl Protocol for Http2 {
    const LISTENER: Listener = Listener::Http;
    /// A forward-auth subrequest carries the headers of the request it asks about, cookies
    /// and all; an RLS call's 16 KiB would refuse some that HTTP/1 takes.
    const MAX_HEADER_LIST: u32 = 64 * 1024;

    /// A `Date`, as an origin server with a clock must send (RFC 9110, 6.6.1) and hyper
    /// writes on the HTTP/1.1 answers.
    fn finish(head: &mut http::response::Parts) {
        if let Some(date) = http_date() {
            head.headers.insert(http::header::DATE, date);
        }
    }
}

thread_local! {
    /// The `Date` of the second this thread last answered in, with that second: formatted
    /// once a second, not once an answer.
    static DATE: std::cell::RefCell<Option<(i64, http::HeaderValue)>> =
        const { std::cell::RefCell::new(None) };
}

/// Now as an HTTP date (`Sun, 06 Nov 1994 08:49:37 GMT`); `None` for a calendar clock that
/// jiff cannot print (before year -9999 or past 9999).
fn http_date() -> Option<http::HeaderValue> {
    let second = SystemWallClock.now().as_nanos().div_euclid(1_000_000_000);
    DATE.with_borrow_mut(|cached| {
        if let Some((at, value)) = cached
            && *at == second
        {
            return Some(value.clone());
        }
        let timestamp = jiff::Timestamp::from_second(second).ok()?;
        let text = jiff::fmt::rfc2822::DateTimePrinter::new()
            .timestamp_to_rfc9110_string(&timestamp)
            .ok()?;
        let value = http::HeaderValue::from_str(&text).ok()?;
        *cached = Some((second, value.clone()));
        Some(value)
    })
}

/// Serves the HTTP API on every connection `incoming` yields until `stopped` turns true (or
/// `incoming` ends), then lets the requests in flight finish.
pub(crate) async fn serve<I>(state: Arc<AppState>, incoming: I, stopped: watch::Receiver<bool>)
where
    I: Stream<Item = std::io::Result<Admitted>>,
{
    let limits = state.connections.limits;
    let tls = state.connections.http_tls.clone();
    let app = Front {
        state: state.clone(),
        router: super::router(state),
    };
    let each = |admitted: Admitted| {
        let (app, tls, stopped) = (app.clone(), tls.clone(), stopped.clone());
        async move {
            // The handshake is the connection's first words: bounded as a request head is.
            let by = admitted.first_words_by(&limits);
            let Some(mut admitted) = admitted.secure(tls.as_deref(), by).await else {
                return;
            };
            match first_words(&mut admitted, limits, &stopped).await {
                Some(false) => serve_connection(app, admitted, limits, stopped).await,
                Some(true) => serve_http2(app, admitted, limits, stopped).await,
                None => {}
            }
        }
    };
    let drain = limits.drain_timeout;
    connection::serve_each(incoming, stopped.clone(), Listener::Http, drain, each).await;
}

/// Whether the client speaks HTTP/2, once its first words say: `None` when it has said
/// nothing by the time its first words are due (counted as a head too slow), goes away, or the
/// server stops first.
async fn first_words(
    admitted: &mut Admitted,
    limits: ConnectionLimits,
    stopped: &watch::Receiver<bool>,
) -> Option<bool> {
    let by = admitted.first_words_by(&limits);
    let sniffed = tokio::time::timeout_at(by, admitted.speaks_http2());
    tokio::select! {
        // Stopped before the client said a word: nothing is in flight.
        () = crate::until_stopped(stopped.clone()) => None,
        sniffed = sniffed => match sniffed {
            Ok(Ok(http2)) => Some(http2),
            Ok(Err(_)) => None,
            Err(_) => {
                metrics::record_connection_closed(Listener::Http, Closed::HeaderTimeout);
                None
            }
        },
    }
}

/// What answers a connection's requests: the usual routes directly ([`Direct`]), the router
/// the others.
#[derive(Clone)]
struct Front {
    router: Router,
    state: Arc<AppState>,
}

impl Front {
    /// The route and state that answer `request` without the router, if it takes one.
    fn direct<B>(&self, request: &http::Request<B>) -> Option<(Direct, Arc<AppState>)> {
        Direct::of(request).map(|route| (route, self.state.clone()))
    }
}

/// Serves one HTTP/2 connection as [`http2::serve_connection`] does the gRPC listener's.
async fn serve_http2(
    app: Front,
    admitted: Admitted,
    limits: ConnectionLimits,
    stopped: watch::Receiver<bool>,
) {
    let Ok(peer) = admitted.peer() else {
        // Gone between the accept and now.
        return;
    };
    let service = Peered { app, peer };
    let served = http2::serve_connection::<Http2, _, _>(service, admitted, limits, stopped);
    if let Err(err) = served.await {
        tracing::debug!(error = %err, "HTTP/2 connection ended with an error");
    }
}

/// The connection's front, telling the router each request's client address as the HTTP/1
/// connections tell it (the admin endpoints' loopback rule reads it).
#[derive(Clone)]
struct Peered {
    app: Front,
    peer: SocketAddr,
}

impl Service<http::Request<Received>> for Peered {
    type Response = http::Response<axum::body::Body>;
    type Error = Infallible;
    type Future = Either<
        BoxFuture<'static, Result<Self::Response, Infallible>>,
        <Router as Service<http::Request<Received>>>::Future,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Service::<http::Request<Received>>::poll_ready(&mut self.app.router, cx)
    }

    fn call(&mut self, mut request: http::Request<Received>) -> Self::Future {
        if let Some((route, state)) = self.app.direct(&request) {
            return Either::Left(route.answer(state, request).map(Ok).boxed());
        }
        request
            .extensions_mut()
            .insert(ConnectInfo::<SocketAddr>(self.peer));
        Either::Right(self.app.router.call(request))
    }
}

/// Serves one connection until the client closes it, until it has drained after `stopped`,
/// or until its client has been slow or quiet too long.
async fn serve_connection(
    app: Front,
    admitted: Admitted,
    limits: ConnectionLimits,
    stopped: watch::Receiver<bool>,
) {
    let peer = match admitted.peer() {
        Ok(peer) => peer,
        // Gone between the accept and now.
        Err(_) => return,
    };
    metrics::record_connection_opened(Listener::Http, "http/1.1");
    let first_words_by = admitted.first_words_by(&limits);
    let (stream, activity) = Tracked::new(admitted);
    let requests = activity.clone();
    let service = hyper::service::service_fn(move |mut request: hyper::Request<Incoming>| {
        requests.request_started();
        let answer = match app.direct(&request) {
            Some((route, state)) => Either::Left(route.answer(state, request).map(Ok)),
            None => {
                request
                    .extensions_mut()
                    .insert(ConnectInfo::<SocketAddr>(peer));
                // A router is always ready, and cloning it is a reference count.
                Either::Right(app.router.clone().call(request))
            }
        };
        let responded = requests.clone();
        // Marked before hyper writes it: a write before then is an interim answer.
        answer.inspect(move |_| responded.request_responded())
    });
    // No timer for hyper: the head timeout is kept by `HeadTimeout` (see why there).
    let builder = hyper::server::conn::http1::Builder::new();
    let mut connection = pin!(builder.serve_connection(TokioIo::new(stream), service));
    let mut stop = StopSignal::new(stopped);
    let mut stopping = false;
    let mut head = HeadTimeout::new(activity.clone(), limits.header_timeout, first_words_by);
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
