//! The HTTP client of `tollgate bench`: one HTTP/1.1 keep-alive connection per worker.
//!
//! A pooled client would hide how many connections the server juggles; with one connection
//! per worker and one request in flight on each, `--concurrency` is exactly the number of
//! connections and of requests the server holds at once. The JSON body is built once around
//! the key, so the generator spends its share of the two cores on I/O, not on serializing.
//! With `--forward-auth` the requests are the subrequests a proxy sends instead: a `GET`
//! whose headers carry the descriptor, built once but for the key's.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::{self, SendRequest};
use hyper::header::{CONTENT_TYPE, HOST, HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::Verdict;
use super::args::Plan;
use super::tls::TlsClient;

/// The most bytes of an unexpected response body quoted in an error.
const QUOTED_BODY_BYTES: usize = 200;

/// Forward-auth reads a descriptor entry from a header of this prefix and the entry's name.
pub(crate) const ENTRY_HEADER_PREFIX: &str = "x-tollgate-";

/// One worker's connection to an HTTP target.
pub(crate) struct HttpClient {
    authority: String,
    path: String,
    shape: Shape,
    /// TLS to an `https://` target.
    tls: Option<TlsClient>,
    /// `None` before the first request and after a failure: the next request reconnects.
    sender: Option<SendRequest<Full<Bytes>>>,
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

impl HttpClient {
    pub(crate) fn new(plan: &Plan, authority: &str, path: &str) -> Self {
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
        Self {
            authority: authority.to_owned(),
            path: path.to_owned(),
            shape: Shape::Check {
                body_head,
                body_tail: "\"}]}",
            },
            tls: plan.tls.clone(),
            sender: None,
        }
    }

    /// A client sending forward-auth subrequests to `path`, the descriptor in headers.
    ///
    /// The plan checked that every entry makes a header name and every value a header value;
    /// one that did not would be left out rather than panic.
    pub(crate) fn forward_auth(plan: &Plan, authority: &str, path: &str) -> Self {
        let header = |entry: &str| {
            HeaderName::from_bytes(format!("{ENTRY_HEADER_PREFIX}{entry}").as_bytes()).ok()
        };
        let mut headers = HeaderMap::new();
        if let Ok(host) = HeaderValue::from_str(authority) {
            headers.insert(HOST, host);
        }
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
        Self {
            authority: authority.to_owned(),
            path: path.to_owned(),
            shape: Shape::ForwardAuth {
                headers,
                key_header,
            },
            tls: plan.tls.clone(),
            sender: None,
        }
    }

    /// Opens the connection now, so a run does not start before every worker is connected.
    pub(crate) async fn connect(&mut self) -> Result<(), String> {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
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
        self.sender = Some(sender);
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

    /// Forgets the connection (after a timeout its state is unknown).
    pub(crate) fn reset(&mut self) {
        self.sender = None;
    }

    /// Sends one check for key `key`.
    pub(crate) async fn send(&mut self, key: u64) -> Result<Verdict, String> {
        if self.sender.as_ref().is_none_or(SendRequest::is_closed) {
            self.connect().await?;
        }
        let Some(sender) = self.sender.as_mut() else {
            return Err("no connection".into());
        };
        let request = match &self.shape {
            Shape::Check {
                body_head,
                body_tail,
            } => Request::post(self.path.as_str())
                .header(HOST, self.authority.as_str())
                .header(CONTENT_TYPE, "application/json")
                .body(Full::new(Bytes::from(format!(
                    "{body_head}{key}{body_tail}"
                ))))
                .map_err(|err| format!("cannot build the request: {err}"))?,
            Shape::ForwardAuth {
                headers,
                key_header,
            } => {
                let mut request = Request::new(Full::new(Bytes::new()));
                *request.method_mut() = Method::GET;
                *request.uri_mut() = self
                    .path
                    .parse()
                    .map_err(|err| format!("cannot build the request: {err}"))?;
                let mut value = itoa::Buffer::new();
                let key = format!("{}{}", super::KEY_PREFIX, value.format(key));
                let key = HeaderValue::from_str(&key)
                    .map_err(|err| format!("cannot build the request: {err}"))?;
                *request.headers_mut() = headers.clone();
                request.headers_mut().insert(key_header.clone(), key);
                request
            }
        };
        let forward_auth = matches!(self.shape, Shape::ForwardAuth { .. });
        let result = async {
            sender.ready().await?;
            let response = sender.send_request(request).await?;
            let status = response.status();
            // Read the whole body: the connection is reused only once it is drained.
            let body = response.into_body().collect().await?.to_bytes();
            Ok::<_, hyper::Error>((status, body))
        }
        .await;
        let (status, body) = match result {
            Ok(answer) => answer,
            Err(err) => {
                self.reset();
                return Err(format!("HTTP: {err}"));
            }
        };
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
}
