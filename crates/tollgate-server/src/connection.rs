//! Bounds on the connections a listener keeps: how many at once, how long a client may take to
//! start speaking, and how long one may stay silent.
//!
//! A decision service sits on other services' request paths, so it must keep answering however
//! its clients behave. Without bounds, a client that opens connections and never speaks (or
//! stops halfway through a request) holds a task, buffers and a file descriptor each, forever;
//! enough of them and the process runs out of descriptors, and Envoy's and nginx's calls are
//! refused with it. So each listener admits at most [`ConnectionLimits::max_connections`] at
//! once (past that it stops accepting and new clients wait in the kernel's backlog, as a busy
//! server's should, until a connection closes), a new connection must start speaking within
//! [`ConnectionLimits::header_timeout`], and one whose client sends nothing for
//! [`ConnectionLimits::idle_timeout`] is asked to close and, silent for that long again, is
//! dropped.
//!
//! Both listeners (HTTP and gRPC) use the same pieces: [`admit`] hands out connections with
//! their place under the bound ([`Admitted`]), [`serve_each`] runs them and drains them at a
//! stop (for at most [`ConnectionLimits::drain_timeout`]), [`Tracked`] counts what a client
//! sends, [`IdleClose`] tells a connection's task when its client has gone quiet, and
//! [`StopSignal`] when the server stops. HTTP/1 adds [`HeadTimeout`], for a head partway in.
//! The HTTP listener serves HTTP/1 and HTTP/2 alike, and [`Admitted::speaks_http2`] tells which
//! a client speaks.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;
use tokio::time::{Instant, Sleep};

use crate::metrics::Closed;
use crate::tls::ListenerTls;

/// How the server bounds each listener's connections (the same for HTTP and gRPC).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// The most connections open at once on each listener. At the bound the listener stops
    /// accepting; new clients wait in the kernel's backlog until a connection closes.
    pub max_connections: usize,
    /// How long a client may take to send a whole HTTP/1 request head: the first from the
    /// connection's start (its TLS handshake included), each next one from its first bytes (a
    /// kept-alive connection waiting between requests is the idle timeout's business); or to
    /// open HTTP/2 (the handshake and the connection preface) from the connection's start.
    pub header_timeout: Duration,
    /// How long a client may send nothing at all (a kept-alive HTTP/1 connection waiting for
    /// its next request included) before its connection is asked to close (HTTP/2 GOAWAY; an
    /// HTTP/1 connection between requests closes at once). One still open after as long again
    /// is dropped, calls in flight with it.
    pub idle_timeout: Duration,
    /// How long, once the server is stopping, its connections may take to finish the requests
    /// in flight; connections still open then are dropped.
    pub drain_timeout: Duration,
}

impl Default for ConnectionLimits {
    /// 10,000 connections per listener; 30 s for a request head (hyper's own default); 10
    /// minutes of silence, since Envoy keeps its gRPC connections open and idle between bursts
    /// and a reconnection costs its next call a handshake; 10 s to drain, well inside the 30 s
    /// an orchestrator such as Kubernetes waits before killing a stopping process.
    fn default() -> Self {
        Self {
            max_connections: 10_000,
            header_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(600),
            drain_timeout: Duration::from_secs(10),
        }
    }
}

/// Both listeners' limits, admission gates and TLS, shared by every thread serving them.
#[derive(Debug)]
pub(crate) struct Connections {
    pub(crate) limits: ConnectionLimits,
    pub(crate) http: Arc<Gate>,
    pub(crate) grpc: Arc<Gate>,
    /// The HTTP listener's TLS, when it speaks TLS.
    pub(crate) http_tls: Option<Arc<ListenerTls>>,
    /// The gRPC listener's TLS, when it speaks TLS.
    pub(crate) grpc_tls: Option<Arc<ListenerTls>>,
}

/// The longest timeout kept: past it a deadline could overflow the clock, and a longer one
/// means no timeout in practice.
const LONGEST_TIMEOUT: Duration = Duration::from_secs(365 * 24 * 3600);

/// The shortest timeout kept: a zero would close every connection at once.
const SHORTEST_TIMEOUT: Duration = Duration::from_millis(1);

impl Connections {
    /// Gates for `limits`, whose timeouts are taken between a millisecond and a year.
    pub(crate) fn new(limits: ConnectionLimits) -> Self {
        let limits = ConnectionLimits {
            header_timeout: limits
                .header_timeout
                .clamp(SHORTEST_TIMEOUT, LONGEST_TIMEOUT),
            idle_timeout: limits.idle_timeout.clamp(SHORTEST_TIMEOUT, LONGEST_TIMEOUT),
            drain_timeout: limits.drain_timeout.min(LONGEST_TIMEOUT),
            ..limits
        };
        Self {
            limits,
            http: Arc::new(Gate::new(limits.max_connections)),
            grpc: Arc::new(Gate::new(limits.max_connections)),
            http_tls: None,
            grpc_tls: None,
        }
    }
}

/// A listener: the label of its connection metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Listener {
    Http,
    Grpc,
}

impl Listener {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Listener::Http => "http",
            Listener::Grpc => "grpc",
        }
    }
}

/// One listener's admission: a permit per open connection.
#[derive(Debug)]
pub(crate) struct Gate {
    permits: Arc<Semaphore>,
    /// Connections holding a [`Place`]: the permits taken, less the one the listener holds
    /// while it waits for its next connection.
    open: Arc<AtomicUsize>,
}

impl Gate {
    pub(crate) fn new(max: usize) -> Self {
        // Semaphore::MAX_PERMITS is far above any descriptor limit; at least one, or nothing
        // would ever be served.
        let max = max.clamp(1, Semaphore::MAX_PERMITS);
        Self {
            permits: Arc::new(Semaphore::new(max)),
            open: Arc::default(),
        }
    }

    /// Connections open now (admitted and not yet closed).
    pub(crate) fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Waits for room for one more connection, then holds it for the connection accepted next.
    pub(crate) async fn room(&self) -> Room {
        match Arc::clone(&self.permits).acquire_owned().await {
            Ok(permit) => Room {
                permit,
                open: Arc::clone(&self.open),
            },
            // Never closed: this gate owns the semaphore and does not close it.
            Err(_) => std::future::pending().await,
        }
    }
}

/// Room for one connection under a listener's bound, not yet taken by one.
#[derive(Debug)]
pub(crate) struct Room {
    permit: OwnedSemaphorePermit,
    open: Arc<AtomicUsize>,
}

impl Room {
    /// Taken by an accepted connection, which holds it until it closes.
    fn take(self) -> Place {
        self.open.fetch_add(1, Ordering::Relaxed);
        Place {
            _permit: self.permit,
            open: self.open,
        }
    }
}

/// An open connection's place under its listener's bound, given back when dropped.
#[derive(Debug)]
pub(crate) struct Place {
    _permit: OwnedSemaphorePermit,
    open: Arc<AtomicUsize>,
}

impl Drop for Place {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A connection the listener let in, holding its place under the bound until dropped.
#[derive(Debug)]
pub(crate) struct Admitted {
    stream: Transport,
    place: Place,
    /// When it was let in: the client's first words (a TLS handshake, the bytes that tell its
    /// protocol, its first request head or HTTP/2's preface) are all due within one head
    /// timeout of this, not one each.
    since: Instant,
}

/// What a connection's bytes travel over.
#[derive(Debug)]
enum Transport {
    Plain(TcpStream),
    /// Boxed: a TLS session's state is a few kilobytes, and most servers serve none.
    Tls(Box<Secured>),
}

/// A TLS session, with the bytes read from it to tell the client's protocol, which the server
/// is still to be given.
///
/// A plain connection's first bytes are looked at where they wait in the kernel (a peek), but
/// a TLS session's come out of its records only by being read: a client that chose no
/// protocol by ALPN and sends HTTP/2's preface (HAProxy's `proto h2` without `alpn`, HTTP/2
/// with prior knowledge over TLS) is told from HTTP/1 by its first bytes, read here and then
/// handed on before anything more.
#[derive(Debug)]
struct Secured {
    stream: tokio_rustls::server::TlsStream<TcpStream>,
    /// The bytes read ahead: `ahead[given..read]` are still to be handed on.
    ahead: [u8; HTTP2_SIGN],
    read: usize,
    given: usize,
}

impl Secured {
    fn new(stream: tokio_rustls::server::TlsStream<TcpStream>) -> Self {
        Self {
            stream,
            ahead: [0; HTTP2_SIGN],
            read: 0,
            given: 0,
        }
    }

    /// Whether the client speaks HTTP/2: chosen by ALPN, or, when it chose nothing, begun
    /// with HTTP/2's preface. A client that closes first is taken for HTTP/1.
    async fn speaks_http2(&mut self) -> io::Result<bool> {
        use tokio::io::AsyncReadExt;

        if let Some(protocol) = self.stream.get_ref().1.alpn_protocol() {
            return Ok(protocol == b"h2");
        }
        while self.read < HTTP2_SIGN {
            let read = self.stream.read(&mut self.ahead[self.read..]).await?;
            if read == 0 {
                return Ok(false);
            }
            self.read += read;
            if !HTTP2_PREFACE.starts_with(&self.ahead[..self.read]) {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

impl Admitted {
    /// `stream`, answered without delay: answers are small and written whole, so nothing is
    /// gained by holding them back (Nagle).
    pub(crate) fn new(stream: TcpStream, place: Place) -> Self {
        if let Err(err) = stream.set_nodelay(true) {
            tracing::debug!(error = %err, "cannot set TCP_NODELAY");
        }
        Self {
            stream: Transport::Plain(stream),
            place,
            since: Instant::now(),
        }
    }

    /// When the client's first words are due: a head timeout after it was let in.
    pub(crate) fn first_words_by(&self, limits: &ConnectionLimits) -> Instant {
        self.since + limits.header_timeout.min(LONGEST_TIMEOUT)
    }

    /// The connection as a std stream with its permit, to be handed to another runtime; only
    /// before any TLS handshake, which is made on the connection's own thread.
    pub(crate) fn into_std(self) -> io::Result<(std::net::TcpStream, Place)> {
        match self.stream {
            Transport::Plain(stream) => Ok((stream.into_std()?, self.place)),
            Transport::Tls(_) => Err(io::Error::other(
                "a connection past its TLS handshake cannot change threads",
            )),
        }
    }

    /// The client's address.
    pub(crate) fn peer(&self) -> io::Result<std::net::SocketAddr> {
        match &self.stream {
            Transport::Plain(stream) => stream.peer_addr(),
            Transport::Tls(secured) => secured.stream.get_ref().0.peer_addr(),
        }
    }

    /// The connection with its TLS handshake made, when its listener speaks TLS: `None` when
    /// the handshake fails or is not done by `deadline` (counted as a connection closed for
    /// it), since there is nothing to answer such a client with.
    pub(crate) async fn secure(self, tls: Option<&ListenerTls>, deadline: Instant) -> Option<Self> {
        let Some(tls) = tls else {
            return Some(self);
        };
        let Transport::Plain(stream) = self.stream else {
            return Some(self);
        };
        // Boxed: a handshake's state is kilobytes, which every plain connection's task would
        // otherwise carry too.
        let stream = Box::pin(handshake(stream, tls, deadline)).await?;
        Some(Self {
            stream: Transport::Tls(stream),
            place: self.place,
            since: self.since,
        })
    }
}

/// HTTP/2's connection preface, which a client that speaks it sends before anything else.
const HTTP2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// How much of the preface tells it from an HTTP/1 request: no method begins with `PRI`.
const HTTP2_SIGN: usize = 3;

/// How often a client whose first bytes do not yet tell its protocol is looked at again.
const SNIFF_AGAIN: Duration = Duration::from_millis(5);

impl Admitted {
    /// Whether the client speaks HTTP/2: it chose `h2` in the TLS handshake or, having chosen
    /// nothing there or on a plain connection, its first bytes begin HTTP/2's preface (HTTP/2
    /// with prior knowledge, as `curl --http2-prior-knowledge` and gRPC clients send it).
    /// Waits for the client's first bytes, and leaves them to be read. A client that closes
    /// first is taken for HTTP/1, whose server then sees it go.
    pub(crate) async fn speaks_http2(&mut self) -> io::Result<bool> {
        let stream = match &mut self.stream {
            Transport::Tls(secured) => return Box::pin(secured.speaks_http2()).await,
            Transport::Plain(stream) => stream,
        };
        let mut first = [0u8; HTTP2_SIGN];
        loop {
            let read = stream.peek(&mut first).await?;
            let seen = first.get(..read).unwrap_or_default();
            if read == 0 || !HTTP2_PREFACE.starts_with(seen) {
                return Ok(false);
            }
            if read == HTTP2_SIGN {
                return Ok(true);
            }
            // `P` or `PR` so far. The socket stays readable while those bytes wait, so a peek
            // at once would spin; this is rare (a client writes its first line whole) and
            // bounded by the head timeout.
            tokio::time::sleep(SNIFF_AGAIN).await;
        }
    }
}

/// The TLS handshake of [`Admitted::secure`].
async fn handshake(
    stream: TcpStream,
    tls: &ListenerTls,
    deadline: Instant,
) -> Option<Box<Secured>> {
    let listener = tls.listener();
    match tokio::time::timeout_at(deadline, tls.acceptor().accept(stream)).await {
        Ok(Ok(stream)) => return Some(Box::new(Secured::new(stream))),
        Ok(Err(err)) => {
            tracing::debug!(error = %err, listener = listener.as_str(), "TLS handshake failed");
        }
        Err(_) => tracing::debug!(listener = listener.as_str(), "TLS handshake too slow"),
    }
    crate::metrics::record_connection_closed(listener, Closed::TlsHandshake);
    None
}

// The plain side of each method is inlined, the TLS side kept out of line: a plain
// connection, which most servers serve, then reads and writes through hyper and h2 as the
// bare socket did, at the cost of one test of the variant, and the TLS code does not weigh
// on the compiler's inlining of those paths (BENCHMARKS.md, "TLS on the listeners").
impl AsyncRead for Transport {
    #[inline]
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Plain(stream) => Pin::new(stream).poll_read(cx, buf),
            Transport::Tls(stream) => over_tls::read(stream, cx, buf),
        }
    }
}

impl AsyncWrite for Transport {
    #[inline]
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Transport::Plain(stream) => Pin::new(stream).poll_write(cx, buf),
            Transport::Tls(stream) => over_tls::write(stream, cx, buf),
        }
    }

    #[inline]
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Transport::Plain(stream) => Pin::new(stream).poll_write_vectored(cx, bufs),
            Transport::Tls(stream) => over_tls::write_vectored(stream, cx, bufs),
        }
    }

    #[inline]
    fn is_write_vectored(&self) -> bool {
        match self {
            Transport::Plain(stream) => stream.is_write_vectored(),
            Transport::Tls(secured) => secured.stream.is_write_vectored(),
        }
    }

    #[inline]
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Plain(stream) => Pin::new(stream).poll_flush(cx),
            Transport::Tls(stream) => over_tls::flush(stream, cx),
        }
    }

    #[inline]
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Plain(stream) => Pin::new(stream).poll_shutdown(cx),
            Transport::Tls(stream) => over_tls::shutdown(stream, cx),
        }
    }
}

/// [`Transport`]'s TLS side, out of line.
mod over_tls {
    use super::*;

    type Stream = Secured;

    #[inline(never)]
    pub(super) fn read(
        secured: &mut Stream,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let ahead = &secured.ahead[secured.given..secured.read];
        if !ahead.is_empty() {
            let given = ahead.len().min(buf.remaining());
            buf.put_slice(&ahead[..given]);
            secured.given += given;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut secured.stream).poll_read(cx, buf)
    }

    #[inline(never)]
    pub(super) fn write(
        stream: &mut Stream,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut stream.stream).poll_write(cx, buf)
    }

    #[inline(never)]
    pub(super) fn write_vectored(
        stream: &mut Stream,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut stream.stream).poll_write_vectored(cx, bufs)
    }

    #[inline(never)]
    pub(super) fn flush(stream: &mut Stream, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut stream.stream).poll_flush(cx)
    }

    #[inline(never)]
    pub(super) fn shutdown(stream: &mut Stream, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut stream.stream).poll_shutdown(cx)
    }
}

/// The connections `listener` accepts, each once `gate` has room for it.
pub(crate) fn admit(
    listener: TcpListener,
    gate: Arc<Gate>,
) -> impl Stream<Item = io::Result<Admitted>> + Send + 'static {
    futures_util::stream::unfold((listener, gate), |(listener, gate)| async move {
        let room = gate.room().await;
        let accepted = listener
            .accept()
            .await
            .map(|(stream, _)| Admitted::new(stream, room.take()));
        Some((accepted, (listener, gate)))
    })
}

/// How long to wait after a failed accept (out of file descriptors, say) before the next one:
/// the error is likely to repeat at once, and the connections open meanwhile still need the CPU.
pub(crate) const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Runs `serve_one` on each connection `incoming` yields, in a task of its own, until `stopped`
/// turns true (or `incoming` ends); then stops accepting and waits for those tasks to end (each
/// connection drains on the same signal), for at most `drain`: past it, the connections still
/// open are dropped, so that a client holding one cannot hold the process's stop.
pub(crate) async fn serve_each<I, F, Fut>(
    incoming: I,
    stopped: watch::Receiver<bool>,
    listener: Listener,
    drain: Duration,
    mut serve_one: F,
) where
    I: Stream<Item = io::Result<Admitted>>,
    F: FnMut(Admitted) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut connections = JoinSet::new();
    // Boxed to be dropped before the wait for the connections: that closes the listener, so
    // clients are refused at once instead of waiting on a backlog nobody will accept.
    let mut incoming = Box::pin(incoming);
    let mut stop = std::pin::pin!(crate::until_stopped(stopped));
    loop {
        let accepted = tokio::select! {
            () = &mut stop => break,
            Some(ended) = connections.join_next() => {
                report_panic(ended, listener);
                continue;
            }
            accepted = incoming.next() => accepted,
        };
        match accepted {
            None => break,
            Some(Ok(admitted)) => {
                connections.spawn(serve_one(admitted));
            }
            Some(Err(err)) => {
                tracing::warn!(error = %err, listener = listener.as_str(), "cannot accept a connection");
                tokio::select! {
                    () = &mut stop => break,
                    () = tokio::time::sleep(ACCEPT_BACKOFF) => {}
                }
            }
        }
    }
    drop(incoming);
    let drained = tokio::time::timeout(drain, async {
        while let Some(ended) = connections.join_next().await {
            report_panic(ended, listener);
        }
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            listener = listener.as_str(),
            connections = connections.len(),
            "connections still open at the drain deadline are dropped"
        );
        connections.shutdown().await;
    }
}

/// Logs a connection task that panicked (a bug; the other connections are unaffected).
fn report_panic(ended: Result<(), tokio::task::JoinError>, listener: Listener) {
    if let Err(err) = ended
        && err.is_panic()
    {
        tracing::error!(listener = listener.as_str(), "a connection's task panicked");
    }
}

/// What a connection's client has sent and, on HTTP/1, how far its requests have got, as
/// [`Tracked`] and the listener record it and the connection's watchers ([`IdleClose`],
/// [`HeadTimeout`]) read it. Each figure has one writer, the connection's own task, so each is
/// published with a plain store rather than an atomic add.
#[derive(Debug, Clone, Default)]
pub(crate) struct Activity(Arc<Marks>);

#[derive(Debug, Default)]
struct Marks {
    /// Reads that brought bytes.
    reads: AtomicU64,
    /// Requests whose head was read whole (HTTP/1).
    started: AtomicU64,
    /// Requests whose answer has been made, to be written (HTTP/1).
    responded: AtomicU64,
    /// `responded` as of the server's last write: the requests answered (or being answered).
    /// Not `started`: an interim answer (`100 Continue`) is written before its request's body
    /// is read, and the body that follows is not the head of a next request.
    answered: AtomicU64,
    /// `reads` as of the server's last write.
    reads_at_answer: AtomicU64,
}

impl Activity {
    fn reads(&self) -> u64 {
        self.0.reads.load(Ordering::Relaxed)
    }

    /// Marks a request whose head has been read whole; called by the connection's task.
    pub(crate) fn request_started(&self) {
        let started = self.0.started.load(Ordering::Relaxed);
        self.0
            .started
            .store(started.wrapping_add(1), Ordering::Relaxed);
    }

    /// Marks a request whose answer has been made; called by the connection's task before
    /// the answer is written.
    pub(crate) fn request_responded(&self) {
        let responded = self.0.responded.load(Ordering::Relaxed);
        self.0
            .responded
            .store(responded.wrapping_add(1), Ordering::Relaxed);
    }

    /// Whether the client is partway through a request head: nothing in flight and either no
    /// request yet or bytes since the last answer. Kept-alive connections waiting for their
    /// next request have sent nothing since, and are the idle timeout's business.
    fn head_pending(&self) -> Option<u64> {
        let started = self.0.started.load(Ordering::Relaxed);
        let in_flight = started != self.0.answered.load(Ordering::Relaxed);
        let pending = !in_flight
            && (started == 0 || self.reads() != self.0.reads_at_answer.load(Ordering::Relaxed));
        pending.then_some(started)
    }
}

/// An admitted connection's stream, counting the reads that brought the client's bytes; its
/// place under the bound is given back when the server drops it.
///
/// Counted in the stream itself because both servers (hyper's and h2's) own their stream
/// whole. A read costs one plain store more: the count is kept here and published, not added
/// to atomically, since only this stream writes it.
#[derive(Debug)]
pub(crate) struct Tracked {
    admitted: Admitted,
    reads: u64,
    activity: Activity,
}

impl Tracked {
    pub(crate) fn new(admitted: Admitted) -> (Self, Activity) {
        let activity = Activity::default();
        let tracked = Self {
            admitted,
            reads: 0,
            activity: activity.clone(),
        };
        (tracked, activity)
    }
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        ready!(Pin::new(&mut this.admitted.stream).poll_read(cx, buf))?;
        if buf.filled().len() > before {
            this.reads = this.reads.wrapping_add(1);
            this.activity.0.reads.store(this.reads, Ordering::Relaxed);
        }
        Poll::Ready(Ok(()))
    }
}

impl Tracked {
    /// Notes that the server wrote: the requests started so far are being answered.
    fn wrote(&self) {
        let marks = &self.activity.0;
        marks
            .answered
            .store(marks.responded.load(Ordering::Relaxed), Ordering::Relaxed);
        marks.reads_at_answer.store(self.reads, Ordering::Relaxed);
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let written = ready!(Pin::new(&mut self.admitted.stream).poll_write(cx, buf))?;
        self.wrote();
        Poll::Ready(Ok(written))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let written = ready!(Pin::new(&mut self.admitted.stream).poll_write_vectored(cx, bufs))?;
        self.wrote();
        Poll::Ready(Ok(written))
    }

    fn is_write_vectored(&self) -> bool {
        self.admitted.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.admitted.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.admitted.stream).poll_shutdown(cx)
    }
}

/// The server's stop signal as a connection's task watches it.
///
/// A connection's task wakes for every request, and polling the signal's future each time
/// costs a few hundred instructions; once the future holds the task's waker it is polled
/// again only when the signal may have changed, which the receiver tells from one load.
pub(crate) struct StopSignal {
    changes: watch::Receiver<bool>,
    /// The signal's future, until it resolves.
    stopped: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    /// Whether `stopped` has been polled, so that it holds the task's waker.
    armed: bool,
}

impl StopSignal {
    pub(crate) fn new(stopped: watch::Receiver<bool>) -> Self {
        Self {
            changes: stopped.clone(),
            stopped: Some(Box::pin(crate::until_stopped(stopped))),
            armed: false,
        }
    }

    /// Ready once the server is stopping, and on every poll after; polled by one task.
    pub(crate) fn poll_stopped(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(stopped) = &mut self.stopped else {
            return Poll::Ready(());
        };
        // `Err`: the sender is gone, which the future reads as a stop.
        if self.armed && matches!(self.changes.has_changed(), Ok(false)) {
            return Poll::Pending;
        }
        if stopped.as_mut().poll(cx).is_pending() {
            self.armed = true;
            return Poll::Pending;
        }
        self.stopped = None;
        Poll::Ready(())
    }
}

/// What to do with a connection whose client has gone quiet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Quiet {
    /// Quiet for a whole idle period: ask the connection to close gracefully.
    AskToClose,
    /// Quiet for another period after being asked: drop it.
    Drop,
}

/// A timer that fires every `every`, polled cheaply by the one task that owns it.
///
/// A connection's task wakes for every request and polls its watchers each time; polling a
/// tokio timer costs a few hundred instructions, so once the timer holds the task's waker a
/// poll only looks at whether it has fired, which costs a load. Meant to be polled by one task
/// for its whole life (a connection's).
struct Ticker {
    every: Duration,
    next: Pin<Box<Sleep>>,
    /// Whether `next` has been polled since it was last set, so that it holds the task's waker.
    armed: bool,
}

impl Ticker {
    fn new(every: Duration) -> Self {
        let every = every.clamp(Duration::from_millis(1), LONGEST_TIMEOUT);
        Self {
            every,
            next: Box::pin(tokio::time::sleep(every)),
            armed: false,
        }
    }

    /// Ready once per tick.
    fn poll_tick(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.armed && !self.next.is_elapsed() {
            return Poll::Pending;
        }
        if self.next.as_mut().poll(cx).is_pending() {
            self.armed = true;
            return Poll::Pending;
        }
        self.armed = false;
        let deadline = Instant::now() + self.every;
        self.next.as_mut().reset(deadline);
        Poll::Ready(())
    }
}

/// Checks per timeout: a watcher looks this often, so a timeout is noticed between one and
/// one and a quarter timeouts after it began. A timer reset per read or per request would be
/// exact but would cost every request a timer update, for a bound nobody needs to the
/// millisecond.
const CHECKS_PER_PERIOD: u32 = 4;

/// Looks at a connection's [`Activity`] a few times per idle period and says when its client
/// has sent nothing for a whole period, first to ask the connection to close and then, a
/// period later, to drop it. The connection's task polls it beside the connection.
pub(crate) struct IdleClose {
    activity: Activity,
    seen: u64,
    quiet_checks: u32,
    ticker: Ticker,
    asked: bool,
}

impl IdleClose {
    pub(crate) fn new(activity: Activity, idle_timeout: Duration) -> Self {
        Self {
            seen: activity.reads(),
            activity,
            quiet_checks: 0,
            ticker: Ticker::new(idle_timeout.min(LONGEST_TIMEOUT) / CHECKS_PER_PERIOD),
            asked: false,
        }
    }

    /// Ready with the next step each time the client has been quiet for a whole period since
    /// the last step (or the start); pending while it speaks.
    pub(crate) fn poll_step(&mut self, cx: &mut Context<'_>) -> Poll<Quiet> {
        loop {
            ready!(self.ticker.poll_tick(cx));
            let seen = self.activity.reads();
            if seen == self.seen {
                self.quiet_checks += 1;
            } else {
                self.seen = seen;
                self.quiet_checks = 0;
            }
            if self.quiet_checks >= CHECKS_PER_PERIOD {
                self.quiet_checks = 0;
                let step = if self.asked {
                    Quiet::Drop
                } else {
                    Quiet::AskToClose
                };
                self.asked = true;
                return Poll::Ready(step);
            }
        }
    }

    /// The next step, once due.
    #[cfg(test)]
    async fn step(&mut self) -> Quiet {
        std::future::poll_fn(|cx| self.poll_step(cx)).await
    }
}

/// Says when an HTTP/1 client has been partway through a request head for the whole head
/// timeout: from its connection's start until its first request's head is in, or from its
/// first bytes after an answer until the next head is. A kept-alive connection that sends
/// nothing between requests is left to [`IdleClose`], so the two timeouts stay apart.
///
/// Done here from the connection's [`Activity`] rather than by hyper's own head timeout, which
/// makes a timer for every request head and so costs every request about 700 instructions
/// (BENCHMARKS.md, tenth session), and which also closes kept-alive connections that wait.
pub(crate) struct HeadTimeout {
    activity: Activity,
    /// Checks in a row that found the same head pending (the same count of requests started).
    pending_checks: u32,
    started: u64,
    ticker: Ticker,
    /// When the connection's first head is due, whatever came before it (a TLS handshake, the
    /// wait for the bytes that tell HTTP/1 from HTTP/2) took.
    first_by: Instant,
}

impl HeadTimeout {
    /// A head timeout of `header_timeout` for each head, the first one due by `first_by`.
    pub(crate) fn new(activity: Activity, header_timeout: Duration, first_by: Instant) -> Self {
        Self {
            activity,
            pending_checks: 0,
            started: 0,
            ticker: Ticker::new(header_timeout.min(LONGEST_TIMEOUT) / CHECKS_PER_PERIOD),
            first_by,
        }
    }

    /// Ready once a head has been pending for the whole timeout.
    pub(crate) fn poll_expired(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            ready!(self.ticker.poll_tick(cx));
            let pending = self.activity.head_pending();
            // Seen at the check after the deadline: at most a quarter timeout late, as any
            // head is.
            if pending == Some(0) && Instant::now() >= self.first_by {
                return Poll::Ready(());
            }
            match pending {
                None => self.pending_checks = 0,
                // Still the head the last check saw (after a check that saw none, the count
                // is back at 0 and this is a first check, as below).
                Some(started) if started == self.started => self.pending_checks += 1,
                // A head began since the last check (which may have been just before it).
                Some(started) => {
                    self.started = started;
                    self.pending_checks = 1;
                }
            }
            // The first check that saw the head came at most a quarter timeout after it
            // began; this many more make a whole timeout.
            if self.pending_checks > CHECKS_PER_PERIOD {
                return Poll::Ready(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A client's stream and the server's end of it, admitted.
    async fn pair() -> (TcpStream, Admitted) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (
            client,
            Admitted::new(server, Gate::new(1).room().await.take()),
        )
    }

    /// Quiet is a whole period without the client's bytes, counted again from each read.
    #[tokio::test(start_paused = true)]
    async fn quiet_comes_a_whole_period_after_the_last_read() {
        let (mut client, server) = pair().await;
        let (mut tracked, activity) = Tracked::new(server);
        let period = Duration::from_secs(60);
        let mut idle = IdleClose::new(activity, period);
        let started = Instant::now();
        let mut buf = [0u8; 16];

        // The client speaks at 50 s: nothing is quiet at 60 s.
        tokio::time::sleep(Duration::from_secs(50)).await;
        client.write_all(b"hello").await.unwrap();
        let read = tracked.read(&mut buf).await.unwrap();
        assert_eq!(read, 5);
        let step = idle.step().await;
        let waited = started.elapsed();
        assert_eq!(step, Quiet::AskToClose);
        assert!(
            waited >= Duration::from_secs(110) && waited <= Duration::from_secs(125),
            "asked to close after {waited:?}"
        );
        // And a period later, still quiet: dropped.
        let asked_at = Instant::now();
        assert_eq!(idle.step().await, Quiet::Drop);
        assert_eq!(asked_at.elapsed(), period);
    }

    /// Writes (the server's answers) do not count as the client speaking.
    #[tokio::test(start_paused = true)]
    async fn only_the_clients_bytes_keep_a_connection_alive() {
        let (mut client, server) = pair().await;
        let (mut tracked, activity) = Tracked::new(server);
        let mut idle = IdleClose::new(activity, Duration::from_secs(8));
        let started = Instant::now();
        let writing = async {
            for _ in 0..20 {
                tracked.write_all(b"tick").await.unwrap();
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        };
        tokio::select! {
            step = idle.step() => assert_eq!(step, Quiet::AskToClose),
            () = writing => panic!("a quiet client was missed"),
        }
        assert_eq!(started.elapsed(), Duration::from_secs(8));
        let mut buf = [0u8; 4];
        client.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"tick");
    }

    /// The signal wakes a connection's task that polled it once, and stays ready; a dropped
    /// sender is a stop too.
    #[tokio::test]
    async fn a_stop_signal_is_seen_once_sent_or_once_its_sender_is_gone() {
        let (stop, stopped) = watch::channel(false);
        let mut signal = StopSignal::new(stopped.clone());
        let waiting = tokio::spawn(async move {
            std::future::poll_fn(|cx| signal.poll_stopped(cx)).await;
            // Ready again, without panicking on a finished future.
            std::future::poll_fn(|cx| signal.poll_stopped(cx)).await;
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        stop.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("woken by the stop")
            .unwrap();

        let (stop, stopped) = watch::channel(false);
        let mut signal = StopSignal::new(stopped);
        let waiting = tokio::spawn(async move {
            std::future::poll_fn(|cx| signal.poll_stopped(cx)).await;
        });
        tokio::task::yield_now().await;
        drop(stop);
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("woken by the sender's end")
            .unwrap();
    }

    /// The head timeout runs while a head is partway in: from the start until the first
    /// request, and from the first bytes after an answer; not while a request is in flight
    /// (its body included, after an interim answer), nor while a kept-alive connection waits
    /// with nothing sent.
    #[tokio::test(start_paused = true)]
    async fn a_head_times_out_only_while_partway_in() {
        let timeout = Duration::from_secs(40);
        let (mut client, server) = pair().await;
        let (mut tracked, activity) = Tracked::new(server);
        let mut head = HeadTimeout::new(activity.clone(), timeout, Instant::now() + timeout);
        /// How long `head` took to expire, if it did within three timeouts.
        async fn expired(head: &mut HeadTimeout) -> Option<Duration> {
            let started = Instant::now();
            let expiry = std::future::poll_fn(|cx| head.poll_expired(cx));
            tokio::time::timeout(Duration::from_secs(120), expiry)
                .await
                .ok()
                .map(|()| started.elapsed())
        }
        // Silent from the start: a first head that never comes.
        let waited = expired(&mut head).await.expect("a silent start times out");
        assert!(waited >= timeout && waited <= timeout * 5 / 4, "{waited:?}");

        // A request read, then in flight while the client waits: no head is pending.
        let mut buf = [0u8; 64];
        let mut head = HeadTimeout::new(activity.clone(), timeout, Instant::now() + timeout);
        client
            .write_all(b"POST / HTTP/1.1\r\nExpect: 100-continue\r\n\r\n")
            .await
            .unwrap();
        let _ = tracked.read(&mut buf).await.unwrap();
        activity.request_started();
        assert_eq!(expired(&mut head).await, None, "timed out in flight");

        // Told to go on, the client sends its body slowly: still in flight, not a next head.
        tracked
            .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            .await
            .unwrap();
        client.write_all(b"{\"a\":").await.unwrap();
        let _ = tracked.read(&mut buf).await.unwrap();
        assert_eq!(expired(&mut head).await, None, "a slow body timed out");

        // Answered, then kept alive with nothing sent: the idle timeout's business.
        activity.request_responded();
        tracked.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
        assert_eq!(expired(&mut head).await, None, "timed out while kept alive");

        // The next head starts just before a check and stalls: it times out a whole timeout
        // after its first bytes, not at the fourth check that saw it (nor at once: the
        // connection's first words were due long ago, but those were said).
        let mut head = HeadTimeout::new(activity.clone(), timeout, Instant::now());
        tokio::time::sleep(timeout / CHECKS_PER_PERIOD - Duration::from_millis(1)).await;
        client.write_all(b"GET / HT").await.unwrap();
        let _ = tracked.read(&mut buf).await.unwrap();
        let waited = expired(&mut head).await.expect("a stalled head times out");
        assert!(waited >= timeout && waited <= timeout * 5 / 4, "{waited:?}");
    }

    /// Timeouts are kept between a millisecond and a year, whatever was asked; the drain has
    /// no floor (a zero drops the open connections at once).
    #[test]
    fn timeouts_are_kept_between_a_millisecond_and_a_year() {
        let year = Duration::from_secs(365 * 24 * 3600);
        let asked = ConnectionLimits {
            max_connections: 7,
            header_timeout: Duration::MAX,
            idle_timeout: Duration::ZERO,
            drain_timeout: Duration::ZERO,
        };
        let kept = Connections::new(asked).limits;
        assert_eq!(
            kept,
            ConnectionLimits {
                max_connections: 7,
                header_timeout: year,
                idle_timeout: Duration::from_millis(1),
                drain_timeout: Duration::ZERO,
            }
        );
        let asked = ConnectionLimits {
            max_connections: 7,
            header_timeout: Duration::from_secs(2),
            idle_timeout: year * 2,
            drain_timeout: Duration::MAX,
        };
        let kept = Connections::new(asked).limits;
        assert_eq!(kept.header_timeout, Duration::from_secs(2));
        assert_eq!((kept.idle_timeout, kept.drain_timeout), (year, year));
    }

    /// The log lines written under a test's dispatcher.
    #[derive(Clone, Default)]
    struct Lines(Arc<parking_lot::Mutex<Vec<u8>>>);

    impl io::Write for Lines {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// A connection's task that panics (a bug) is logged as such, and the listener goes on
    /// serving the next connections.
    #[tokio::test]
    async fn a_connection_task_that_panics_is_logged_and_the_rest_are_served() {
        let lines = Lines::default();
        let writer = lines.clone();
        let dispatch = tracing::Dispatch::new(
            tracing_subscriber::fmt()
                .with_writer(move || writer.clone())
                .with_ansi(false)
                .without_time()
                .finish(),
        );
        // Every task of this (current-thread) runtime logs under the dispatcher.
        let _logging = tracing::dispatcher::set_default(&dispatch);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = watch::channel(false);
        let mut served = 0;
        let serving = tokio::spawn(serve_each(
            admit(listener, Arc::new(Gate::new(4))),
            stopped,
            Listener::Grpc,
            Duration::from_secs(5),
            move |mut admitted: Admitted| {
                served += 1;
                let first = served == 1;
                async move {
                    assert!(!first, "the first connection's task panics");
                    admitted.stream.write_all(b"served").await.unwrap();
                }
            },
        ));
        for expected in [&b""[..], b"served", b"served"] {
            let mut client = TcpStream::connect(addr).await.unwrap();
            let mut read = Vec::new();
            let _ = client.read_to_end(&mut read).await;
            assert_eq!(read, expected);
        }
        stop.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(5), serving)
            .await
            .expect("stopped")
            .unwrap();
        let text = String::from_utf8(lines.0.lock().clone()).unwrap();
        let panicked: Vec<&str> = text
            .lines()
            .filter(|line| line.contains("a connection's task panicked"))
            .collect();
        assert_eq!(panicked.len(), 1, "{text}");
        assert!(
            panicked[0].contains("ERROR") && panicked[0].contains("listener=\"grpc\""),
            "{text}"
        );
    }

    /// Only reads that bring bytes count: the end of the client's stream is not it speaking.
    #[tokio::test]
    async fn the_end_of_a_clients_stream_is_not_counted_as_a_read() {
        let (mut client, server) = pair().await;
        let (mut tracked, activity) = Tracked::new(server);
        client.write_all(b"hi").await.unwrap();
        client.shutdown().await.unwrap();
        let mut buf = [0u8; 16];
        assert_eq!(tracked.read(&mut buf).await.unwrap(), 2);
        assert_eq!(tracked.read(&mut buf).await.unwrap(), 0);
        assert_eq!(tracked.read(&mut buf).await.unwrap(), 0);
        assert_eq!(activity.reads(), 1);
    }

    /// A connection's first head is due a head timeout after the connection came, whatever
    /// came before it took (a TLS handshake, the bytes that tell HTTP/1 from HTTP/2): a client
    /// cannot stretch its silence to a timeout for each.
    #[tokio::test(start_paused = true)]
    async fn a_first_head_is_due_by_the_first_words_deadline() {
        let timeout = Duration::from_secs(40);
        let limits = ConnectionLimits {
            header_timeout: timeout,
            ..ConnectionLimits::default()
        };
        let (mut client, server) = pair().await;
        assert_eq!(server.first_words_by(&limits), Instant::now() + timeout);
        // The client took most of the timeout to say `G`, which told HTTP/1.
        tokio::time::sleep(timeout * 3 / 4).await;
        let by = server.first_words_by(&limits);
        let (mut tracked, activity) = Tracked::new(server);
        client.write_all(b"G").await.unwrap();
        let mut buf = [0u8; 8];
        let _ = tracked.read(&mut buf).await.unwrap();
        let mut head = HeadTimeout::new(activity, timeout, by);
        let started = Instant::now();
        std::future::poll_fn(|cx| head.poll_expired(cx)).await;
        let waited = started.elapsed();
        // What was left of the timeout, give or take the quarter between checks.
        assert!(
            waited >= timeout / 4 && waited <= timeout / 2,
            "{waited:?} after the first byte"
        );
    }

    /// Checks that each find a head partway in, but each another head (the one before was
    /// completed and answered in between), do not add up to a timeout: a busy client is not
    /// timed out for being caught mid-head often.
    #[tokio::test(start_paused = true)]
    async fn checks_that_each_see_another_head_do_not_add_up() {
        let timeout = Duration::from_secs(40);
        let (mut client, server) = pair().await;
        let (mut tracked, activity) = Tracked::new(server);
        let mut head = HeadTimeout::new(activity.clone(), timeout, Instant::now() + timeout);
        let mut buf = [0u8; 64];
        // A millisecond over a check's period, so that each round holds exactly one check.
        let round = timeout / CHECKS_PER_PERIOD + Duration::from_millis(1);
        for request in 0..3 * CHECKS_PER_PERIOD {
            client.write_all(b"GET / HT").await.unwrap();
            let _ = tracked.read(&mut buf).await.unwrap();
            let check = std::future::poll_fn(|cx| head.poll_expired(cx));
            let expired = tokio::time::timeout(round, check).await.is_ok();
            assert!(!expired, "timed out at request {request}");
            client.write_all(b"TP/1.1\r\n\r\n").await.unwrap();
            let _ = tracked.read(&mut buf).await.unwrap();
            activity.request_started();
            activity.request_responded();
            tracked.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
        }
    }

    /// At the bound, the next connection waits for one to close.
    #[tokio::test]
    async fn a_gate_admits_up_to_its_bound_and_then_waits() {
        let gate = Arc::new(Gate::new(2));
        let first = gate.room().await.take();
        let second = gate.room().await;
        assert_eq!(gate.open(), 1, "room not yet taken is not a connection");
        let _second = second.take();
        assert_eq!(gate.open(), 2);
        let waiting = tokio::time::timeout(Duration::from_millis(50), gate.room()).await;
        assert!(waiting.is_err(), "a third connection was admitted");
        drop(first);
        assert_eq!(gate.open(), 1);
        let third = tokio::time::timeout(Duration::from_secs(5), gate.room()).await;
        assert!(third.is_ok());
        let one = Gate::new(0);
        let _only = one.room().await;
        let none = tokio::time::timeout(Duration::from_millis(50), one.room()).await;
        assert!(none.is_err(), "a bound of 0 is a bound of 1");
    }
}
