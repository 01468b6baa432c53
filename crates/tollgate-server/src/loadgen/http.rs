//! The HTTP client of `tollgate bench`: by default one HTTP/1.1 keep-alive connection per
//! worker; with `--http2`, HTTP/2 streams over connections the workers share (`shared.rs`).
//!
//! A pooled client would hide how many connections the server juggles; with one connection
//! per worker and one request in flight on each, `--concurrency` is exactly the number of
//! connections and of requests the server holds at once. The JSON body is built once around
//! the key, so the generator spends its share of the two cores on I/O, not on serializing.
//! With `--forward-auth` the requests are the subrequests a proxy sends instead: a `GET`
//! whose headers carry the descriptor, built once but for the key's.

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::{self, SendRequest};
use hyper::header::{CONTENT_TYPE, HOST, HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Request, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::Verdict;
use super::args::Plan;
use super::shared::SharedConnection;
use super::tls::TlsClient;

/// The most bytes of an unexpected response body quoted in an error.
const QUOTED_BODY_BYTES: usize = 200;

/// Forward-auth reads a descriptor entry from a header of this prefix and the entry's name.
pub(crate) const ENTRY_HEADER_PREFIX: &str = "x-tollgate-";

/// One worker's connection to an HTTP target.
pub(crate) struct HttpClient {
    authority: String,
    /// The request target: the path over HTTP/1.1 (with a `Host` header), the whole URL over
    /// HTTP/2 (whose `:authority` stands for `Host`). Parsed once.
    uri: Uri,
    /// The `Host` header, over HTTP/1.1.
    host: Option<HeaderValue>,
    /// `--header`s.
    extra: HeaderMap,
    shape: Shape,
    /// TLS to an `https://` target.
    tls: Option<TlsClient>,
    transport: Transport,
}

/// What a request looks like.
enum Shape {
    /// `POST` of a JSON check: the body up to the key's value, and after it.
    Check {
        body_head: String,
        body_tail: &'static str,
    },
    /// A forward-auth `GET`: every header but the key's, and the key's name.
    ForwardAuth {
        headers: HeaderMap,
        key_header: HeaderName,
    },
}

/// How the requests travel.
enum Transport {
    /// HTTP/1.1 on this worker's connection: `None` before the first request and after a
    /// failure, when the next request reconnects.
    Http1(Option<SendRequest<Full<Bytes>>>),
    /// HTTP/2 streams on a connection shared with other workers, with its generation; `None`
    /// as above.
    Http2 {
        shared: Arc<SharedConnection>,
        client: Option<(u64, h2::client::SendRequest<Bytes>)>,
    },
}

impl HttpClient {
    /// A client posting checks to `path`, over the connection `shared` when the plan says
    /// HTTP/2.
    ///
    /// # Errors
    ///
    /// When `authority` and `path` do not make a URL.
    pub(crate) fn new(
        plan: &Plan,
        authority: &str,
        path: &str,
        shared: Arc<SharedConnection>,
    ) -> Result<Self, String> {
        // serde_json quotes the names, so any domain or entry makes a valid body.
        let quote = |text: &str| serde_json::Value::from(text).to_string();
        let mut body_head = format!(
            "{{\"domain\":{},\"cost\":{},\"descriptors\":[{{",
            quote(&plan.domain),
            plan.cost
        );
        for (entry, value) in &plan.entries {
            body_head.push_str(&format!("{}:{},", quote(entry), quote(value)));
        }
        body_head.push_str(&format!(
            "{}:\"{}",
            quote(&plan.key_entry),
            super::KEY_PREFIX
        ));
        let shape = Shape::Check {
            body_head,
            body_tail: "\"}]}",
        };
        Self::with_shape(plan, authority, path, shape, shared)
    }

    /// A client sending forward-auth subrequests to `path`, the descriptor in headers.
    ///
    /// The plan checked that every entry makes a header name and every value a header value;
    /// one that did not would be left out rather than panic.
    ///
    /// # Errors
    ///
    /// As [`HttpClient::new`].
    pub(crate) fn forward_auth(
        plan: &Plan,
        authority: &str,
        path: &str,
        shared: Arc<SharedConnection>,
    ) -> Result<Self, String> {
        let header = |entry: &str| {
            HeaderName::from_bytes(format!("{ENTRY_HEADER_PREFIX}{entry}").as_bytes()).ok()
        };
        let mut headers = HeaderMap::new();
        for (entry, value) in &plan.entries {
            if let (Some(name), Ok(value)) = (header(entry), HeaderValue::from_str(value)) {
                headers.insert(name, value);
            }
        }
        if plan.cost != 1 {
            headers.insert(
                HeaderName::from_static("x-tollgate-cost"),
                HeaderValue::from(plan.cost),
            );
        }
        let key_header =
            header(&plan.key_entry).unwrap_or(HeaderName::from_static("x-tollgate-user"));
        let shape = Shape::ForwardAuth {
            headers,
            key_header,
        };
        Self::with_shape(plan, authority, path, shape, shared)
    }

    fn with_shape(
        plan: &Plan,
        authority: &str,
        path: &str,
        shape: Shape,
        shared: Arc<SharedConnection>,
    ) -> Result<Self, String> {
        let scheme = if plan.tls.is_some() { "https" } else { "http" };
        let transport = if plan.http2 {
            Transport::Http2 {
                shared,
                client: None,
            }
        } else {
            Transport::Http1(None)
        };
        let uri = if plan.http2 {
            format!("{scheme}://{authority}{path}")
        } else {
            path.to_owned()
        };
        let uri: Uri = uri
            .parse()
            .map_err(|err| format!("{scheme}://{authority}{path}: {err}"))?;
        let host = if plan.http2 {
            None
        } else {
            let host = HeaderValue::from_str(authority)
                .map_err(|err| format!("{scheme}://{authority}: {err}"))?;
            Some(host)
        };
        Ok(Self {
            authority: authority.to_owned(),
            uri,
            host,
            extra: plan.headers.clone(),
            shape,
            tls: plan.tls.clone(),
            transport,
        })
    }

    /// Opens the connection now (or, over HTTP/2, takes the one shared), so a run does not
    /// start before every worker is connected.
    pub(crate) async fn connect(&mut self) -> Result<(), String> {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        if let Transport::Http2 { shared, client } = &mut self.transport {
            let what = format!("{scheme}://{} over HTTP/2", self.authority);
            *client = Some(
                shared
                    .take_or_open(&self.authority, self.tls.as_ref(), &what)
                    .await?,
            );
            return Ok(());
        }
        let stream = TcpStream::connect(&self.authority)
            .await
            .map_err(|err| format!("cannot connect to {scheme}://{}: {err}", self.authority))?;
        // One small request per round trip: Nagle would add tens of milliseconds.
        stream
            .set_nodelay(true)
            .map_err(|err| format!("cannot set TCP_NODELAY: {err}"))?;
        let sender = match &self.tls {
            None => self.handshake(stream).await?,
            Some(tls) => {
                let stream = tls
                    .connect(stream)
                    .await
                    .map_err(|err| format!("TLS handshake with {}: {err}", self.authority))?;
                self.handshake(stream).await?
            }
        };
        self.transport = Transport::Http1(Some(sender));
        Ok(())
    }

    /// HTTP/1.1 over `stream`.
    async fn handshake<S>(&self, stream: S) -> Result<SendRequest<Full<Bytes>>, String>
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    {
        let (sender, connection) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|err| format!("HTTP handshake with {}: {err}", self.authority))?;
        // The connection task ends when the sender is dropped or the server hangs up; the
        // sender then reports the failure on its next request.
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(sender)
    }

    /// Forgets the connection (after a timeout its state is unknown), for every worker
    /// sharing it.
    pub(crate) fn reset(&mut self) {
        match &mut self.transport {
            Transport::Http1(sender) => *sender = None,
            Transport::Http2 { shared, client } => {
                if let Some((generation, _)) = client.take() {
                    shared.drop_generation(generation);
                }
            }
        }
    }

    /// Sends one check for key `key`.
    pub(crate) async fn send(&mut self, key: u64) -> Result<Verdict, String> {
        let connected = match &self.transport {
            Transport::Http1(sender) => sender.as_ref().is_some_and(|s| !s.is_closed()),
            Transport::Http2 { client, .. } => client.is_some(),
        };
        if !connected {
            self.connect().await?;
        }
        let request = self.request(key)?;
        let answer = match &mut self.transport {
            Transport::Http1(Some(sender)) => over_http1(sender, request)
                .await
                .map_err(|err| format!("HTTP: {err}")),
            Transport::Http2 {
                client: Some((_, client)),
                ..
            } => over_http2(client, request)
                .await
                .map_err(|err| format!("HTTP/2: {err}")),
            _ => Err("no connection".into()),
        };
        let (status, body) = match answer {
            Ok(answer) => answer,
            Err(err) => {
                self.reset();
                return Err(err);
            }
        };
        let forward_auth = matches!(self.shape, Shape::ForwardAuth { .. });
        match status {
            StatusCode::OK => Ok(Verdict::Allowed),
            StatusCode::TOO_MANY_REQUESTS => Ok(Verdict::Rejected),
            // nginx's auth_request passes on only 401 and 403: forward-auth's deny status then.
            StatusCode::FORBIDDEN if forward_auth => Ok(Verdict::Rejected),
            _ => {
                let quoted = &body[..body.len().min(QUOTED_BODY_BYTES)];
                Err(format!(
                    "HTTP {status}: {}",
                    String::from_utf8_lossy(quoted).trim()
                ))
            }
        }
    }

    /// The request for key `key`, its body whole.
    fn request(&self, key: u64) -> Result<Request<Bytes>, String> {
        let mut request = match &self.shape {
            Shape::Check {
                body_head,
                body_tail,
            } => {
                let body = Bytes::from(format!("{body_head}{key}{body_tail}"));
                let mut request = Request::new(body);
                *request.method_mut() = Method::POST;
                request
                    .headers_mut()
                    .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
                request
            }
            Shape::ForwardAuth {
                headers,
                key_header,
            } => {
                let mut request = Request::new(Bytes::new());
                let mut value = itoa::Buffer::new();
                let key = format!("{}{}", super::KEY_PREFIX, value.format(key));
                let key = HeaderValue::from_str(&key)
                    .map_err(|err| format!("cannot build the request: {err}"))?;
                *request.headers_mut() = headers.clone();
                request.headers_mut().insert(key_header.clone(), key);
                request
            }
        };
        *request.uri_mut() = self.uri.clone();
        if let Some(host) = &self.host {
            request.headers_mut().insert(HOST, host.clone());
        }
        for (name, value) in &self.extra {
            request.headers_mut().insert(name, value.clone());
        }
        Ok(request)
    }
}

/// Sends `request` over HTTP/1.1 and reads its answer whole (the connection is reused only
/// once it is drained).
async fn over_http1(
    sender: &mut SendRequest<Full<Bytes>>,
    request: Request<Bytes>,
) -> Result<(StatusCode, Bytes), hyper::Error> {
    sender.ready().await?;
    let response = sender.send_request(request.map(Full::new)).await?;
    let status = response.status();
    let body = response.into_body().collect().await?.to_bytes();
    Ok((status, body))
}

/// Sends `request` as an HTTP/2 stream, its HEADERS and DATA queued together, and reads its
/// answer, keeping only as much of the body as an error would quote.
async fn over_http2(
    client: &mut h2::client::SendRequest<Bytes>,
    request: Request<Bytes>,
) -> Result<(StatusCode, Bytes), h2::Error> {
    let (head, body) = request.into_parts();
    // Waits while the connection has as many streams open as the server allows.
    std::future::poll_fn(|cx| client.poll_ready(cx)).await?;
    let (answer, mut stream) =
        client.send_request(Request::from_parts(head, ()), body.is_empty())?;
    if !body.is_empty() {
        stream.send_data(body, true)?;
    }
    let (head, mut received) = answer.await?.into_parts();
    let mut kept = Vec::new();
    while let Some(chunk) = received.data().await {
        let chunk = chunk?;
        // Credit the server's window back, or a long run stalls the connection.
        let _ = received.flow_control().release_capacity(chunk.len());
        let room = QUOTED_BODY_BYTES.saturating_sub(kept.len());
        kept.extend_from_slice(&chunk[..chunk.len().min(room)]);
    }
    Ok((head.status, Bytes::from(kept)))
}
