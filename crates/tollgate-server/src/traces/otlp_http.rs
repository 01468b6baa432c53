//! OTLP over HTTP (`--trace-protocol http/protobuf`): the client the exporter hands each batch
//! to, for collectors and vendors' endpoints that take OTLP on HTTP only (port 4318,
//! `/v1/traces`).
//!
//! The exporter asks for a client of opentelemetry-http's trait; the ones it offers bring
//! reqwest, or hyper with a connector of their own and no say over TLS. This one is hyper's
//! HTTP/1.1 client, keeping its connections alive between batches, with TLS by tokio-rustls
//! on the authorities and client certificate `--trace-tls-*` give, as the gRPC exporter has.
//! The SDK calls the exporter from a thread of its own, outside any runtime, so each request
//! runs on the exporter's runtime and is bounded there by [`TIMEOUT`] (the SDK's default for
//! an export).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client as Pool;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::{TokioExecutor, TokioIo};
use opentelemetry_http::{HttpClient, HttpError, Request, Response};
use rustls::ClientConfig;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

/// How long one export may take, connecting and reading the answer included.
const TIMEOUT: Duration = Duration::from_secs(10);

/// The largest answer read: a collector's answer to an export is a few bytes.
const MAX_ANSWER: usize = 64 * 1024;

/// Sends the exporter's requests, on `runtime`.
pub(super) struct Client {
    runtime: tokio::runtime::Handle,
    pool: Pool<Connector, Full<Bytes>>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").finish_non_exhaustive()
    }
}

impl Client {
    /// A client whose connections run on `runtime`, speaking TLS as `tls` says to `https://`
    /// URLs (plain HTTP is refused on those, and TLS is never tried on `http://` ones).
    pub(super) fn new(runtime: tokio::runtime::Handle, tls: Option<Arc<ClientConfig>>) -> Self {
        let connector = Connector {
            tls: tls.map(TlsConnector::from),
        };
        let pool = Pool::builder(TokioExecutor::new()).build(connector);
        Self { runtime, pool }
    }
}

#[async_trait::async_trait]
impl HttpClient for Client {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let pool = self.pool.clone();
        let exchange = async move {
            let answer = pool.request(request.map(Full::new)).await?;
            let (head, body) = answer.into_parts();
            let body = Limited::new(body, MAX_ANSWER).collect().await?.to_bytes();
            Ok::<_, HttpError>(Response::from_parts(head, body))
        };
        let running = self
            .runtime
            .spawn(async move { tokio::time::timeout(TIMEOUT, exchange).await });
        match running.await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(format!("no answer within {} s", TIMEOUT.as_secs()).into()),
            // The runtime is shutting down with the process.
            Err(err) => Err(Box::new(err)),
        }
    }
}

/// Opens the pool's connections: TCP, then TLS for `https://` URLs.
#[derive(Clone)]
struct Connector {
    tls: Option<TlsConnector>,
}

impl tower_service::Service<http::Uri> for Connector {
    type Response = TokioIo<Stream>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<TokioIo<Stream>>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let tls = self.tls.clone();
        Box::pin(async move {
            let secure = match uri.scheme_str() {
                Some("https") => true,
                Some("http") => false,
                _ => return Err(io::Error::other(format!("not an http(s) URL: {uri}"))),
            };
            let host = uri
                .host()
                .ok_or_else(|| io::Error::other(format!("no host in {uri}")))?;
            // `[::1]` in a URL, `::1` to connect and to name.
            let host = host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned();
            let port = uri.port_u16().unwrap_or(if secure { 443 } else { 80 });
            let tcp = TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            if !secure {
                return Ok(TokioIo::new(Stream::Plain(tcp)));
            }
            let tls =
                tls.ok_or_else(|| io::Error::other("an https:// URL without TLS settings"))?;
            let name = ServerName::try_from(host).map_err(io::Error::other)?;
            let stream = tls.connect(name, tcp).await?;
            Ok(TokioIo::new(Stream::Tls(Box::new(stream))))
        })
    }
}

/// A pooled connection.
enum Stream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl Connection for Stream {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(stream) => Pin::new(stream).poll_read(cx, buf),
            Stream::Tls(stream) => Pin::new(stream.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(stream) => Pin::new(stream).poll_write(cx, buf),
            Stream::Tls(stream) => Pin::new(stream.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(stream) => Pin::new(stream).poll_flush(cx),
            Stream::Tls(stream) => Pin::new(stream.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(stream) => Pin::new(stream).poll_shutdown(cx),
            Stream::Tls(stream) => Pin::new(stream.as_mut()).poll_shutdown(cx),
        }
    }
}
