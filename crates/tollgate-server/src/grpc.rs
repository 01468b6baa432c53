//! The gRPC listener: the Envoy RLS service (`rls`) on hyper's HTTP/2 server, connection by
//! connection, without tonic's `transport::Server`.
//!
//! tonic's server puts a router in front of its services (for several of them), wraps every
//! request in its layers, and reads each connection through a builder that could also speak
//! HTTP/1. The RLS port serves one service over HTTP/2 only, and a call is cheap enough that
//! this shows: served straight on hyper, a call costs the server about 1 µs less CPU (12.7
//! against 13.75 µs, medians of six interleaved rounds in BENCHMARKS.md). The service itself is
//! still tonic's generated one, so the protocol (framing, status codes and trailers, unknown
//! methods answered `UNIMPLEMENTED`) is tonic's.
//!
//! Shutdown is graceful as for HTTP: once stopped, no connection is accepted, each open one is
//! sent a GOAWAY, and the calls in flight finish before [`serve`] returns.

use std::convert::Infallible;
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use hyper::body::Incoming;
use hyper::server::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpStream;
use tokio::sync::watch;
use tower_service::Service;

/// How long to wait after a failed accept (out of file descriptors, say) before the next one:
/// the error is likely to repeat at once, and the connections open meanwhile still need the CPU.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Serves `service` on every connection `incoming` yields until `stopped` turns true (or
/// `incoming` ends), then lets the calls in flight finish.
pub(crate) async fn serve<S, B, I>(service: S, incoming: I, stopped: watch::Receiver<bool>)
where
    S: Service<http::Request<Incoming>, Response = http::Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    I: Stream<Item = std::io::Result<TcpStream>>,
{
    let graceful = GracefulShutdown::new();
    let builder = http2::Builder::new(TokioExecutor::new());
    // Boxed to be dropped before the wait for calls in flight: that closes the listener, so
    // clients are refused at once instead of waiting on a backlog nobody will accept.
    let mut incoming = Box::pin(incoming);
    let mut stop = std::pin::pin!(crate::until_stopped(stopped));
    loop {
        let accepted = tokio::select! {
            () = &mut stop => break,
            accepted = incoming.next() => accepted,
        };
        match accepted {
            None => break,
            Some(Ok(stream)) => {
                let service = TowerToHyperService::new(service.clone());
                let connection = builder.serve_connection(TokioIo::new(stream), service);
                let connection = graceful.watch(connection);
                tokio::spawn(async move {
                    // A client that goes away mid-call is routine for a server; not an error
                    // of ours to report louder than this.
                    if let Err(err) = connection.await {
                        tracing::debug!(error = %err, "gRPC connection ended with an error");
                    }
                });
            }
            Some(Err(err)) => {
                tracing::warn!(error = %err, "cannot accept a gRPC connection");
                tokio::select! {
                    () = &mut stop => break,
                    () = tokio::time::sleep(ACCEPT_BACKOFF) => {}
                }
            }
        }
    }
    drop(incoming);
    graceful.shutdown().await;
}

#[cfg(test)]
mod tests {
    use std::pin::Pin;
    use std::sync::Arc;
    use std::task::{Context, Poll};

    use bytes::Bytes;
    use http_body_util::Full;
    use tokio::sync::Notify;

    use super::*;

    /// A service whose calls answer only when released.
    #[derive(Clone, Default)]
    struct Held {
        started: Arc<Notify>,
        release: Arc<Notify>,
    }

    impl Service<http::Request<Incoming>> for Held {
        type Response = http::Response<Full<Bytes>>;
        type Error = Infallible;
        type Future =
            Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send + 'static>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: http::Request<Incoming>) -> Self::Future {
            let (started, release) = (Arc::clone(&self.started), Arc::clone(&self.release));
            Box::pin(async move {
                started.notify_one();
                release.notified().await;
                Ok(http::Response::new(Full::new(Bytes::from_static(b"done"))))
            })
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_in_flight_finishes_after_the_stop_and_new_clients_are_refused() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        let (stop, stopped) = watch::channel(false);
        let held = Held::default();
        let mut server = tokio::spawn(serve(held.clone(), incoming, stopped));

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
