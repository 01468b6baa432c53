//! The HTTP client of `tollgate bench`: one HTTP/1.1 keep-alive connection per worker.
//!
//! A pooled client would hide how many connections the server juggles; with one connection
//! per worker and one request in flight on each, `--concurrency` is exactly the number of
//! connections and of requests the server holds at once. The JSON body is built once around
//! the key, so the generator spends its share of the two cores on I/O, not on serializing.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::{self, SendRequest};
use hyper::header::{CONTENT_TYPE, HOST};
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::Verdict;
use super::args::Plan;

/// The most bytes of an unexpected response body quoted in an error.
const QUOTED_BODY_BYTES: usize = 200;

/// One worker's connection to an HTTP target.
pub(crate) struct HttpClient {
    authority: String,
    path: String,
    /// The body up to the key's value, and after it.
    body_head: String,
    body_tail: &'static str,
    /// `None` before the first request and after a failure: the next request reconnects.
    sender: Option<SendRequest<Full<Bytes>>>,
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
            body_head,
            body_tail: "\"}]}",
            sender: None,
        }
    }

    /// Opens the connection now, so a run does not start before every worker is connected.
    pub(crate) async fn connect(&mut self) -> Result<(), String> {
        let stream = TcpStream::connect(&self.authority)
            .await
            .map_err(|err| format!("cannot connect to http://{}: {err}", self.authority))?;
        // One small request per round trip: Nagle would add tens of milliseconds.
        stream
            .set_nodelay(true)
            .map_err(|err| format!("cannot set TCP_NODELAY: {err}"))?;
        let (sender, connection) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|err| format!("HTTP handshake with {}: {err}", self.authority))?;
        // The connection task ends when the sender is dropped or the server hangs up; the
        // sender then reports the failure on its next request.
        tokio::spawn(async move {
            let _ = connection.await;
        });
        self.sender = Some(sender);
        Ok(())
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
        let body = format!("{}{key}{}", self.body_head, self.body_tail);
        let request = Request::post(self.path.as_str())
            .header(HOST, self.authority.as_str())
            .header(CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|err| format!("cannot build the request: {err}"))?;
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
