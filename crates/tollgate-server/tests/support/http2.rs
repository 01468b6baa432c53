//! A minimal HTTP/2 client (`h2`) for the HTTP listener, many requests at once on one
//! connection, as proxies and service meshes send them.

use std::collections::HashMap;
use std::net::SocketAddr;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite};

use super::Answer;

/// One HTTP/2 connection.
#[derive(Clone)]
pub struct Http2 {
    client: h2::client::SendRequest<Bytes>,
}

impl Http2 {
    /// HTTP/2 with prior knowledge on a plain connection to `addr`.
    pub async fn connect(addr: SocketAddr) -> Self {
        let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        Self::over(stream).await.expect("an HTTP/2 handshake")
    }

    /// HTTP/2 over `stream` (plain, or TLS that chose `h2`); its driver runs in a task of its
    /// own until the connection ends.
    pub async fn over<S>(stream: S) -> Result<Self, h2::Error>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (client, connection) = h2::client::handshake(stream).await?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(Self {
            client: client.ready().await?,
        })
    }

    /// One request on the connection, with `headers` and `body` (none when empty).
    pub async fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Result<Answer, h2::Error> {
        let mut request = http::Request::builder()
            .method(method)
            .uri(format!("http://tollgate{path}"));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request.body(()).expect("a request");
        let mut client = self.client.clone().ready().await?;
        let (answer, mut stream) = client.send_request(request, body.is_empty())?;
        if !body.is_empty() {
            stream.send_data(Bytes::copy_from_slice(body.as_bytes()), true)?;
        }
        let (head, mut received) = answer.await?.into_parts();
        let mut body = Vec::new();
        while let Some(data) = received.data().await {
            let data = data?;
            let _ = received.flow_control().release_capacity(data.len());
            body.extend_from_slice(&data);
        }
        let headers: HashMap<String, String> = head
            .headers
            .iter()
            .map(|(name, value)| {
                let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
                (name.as_str().to_owned(), value)
            })
            .collect();
        Ok(Answer {
            status: head.status.as_u16(),
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    }

    /// `METHOD path` without a body (a GET, or an admin POST).
    pub async fn send(&self, method: &str, path: &str) -> Answer {
        self.request(method, path, &[], "")
            .await
            .expect("an HTTP/2 answer")
    }

    /// `POST path` with a JSON body.
    pub async fn post_json(&self, path: &str, body: &str) -> Answer {
        self.request("POST", path, &[("content-type", "application/json")], body)
            .await
            .expect("an HTTP/2 answer")
    }
}
