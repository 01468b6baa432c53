//! HTTP/2 connections that several workers send their requests over, as streams: gRPC calls
//! (`grpc.rs`) and, with `--http2`, HTTP checks (`http.rs`). With `--connections N` the
//! workers share N connections, as Envoy and HTTP/2 proxies send them; by default each worker
//! has one of its own.

use std::sync::{Mutex, PoisonError};

use bytes::Bytes;
use h2::client::SendRequest;
use tokio::net::TcpStream;

use super::tls::TlsClient;

/// A connection several workers send their requests over. After a failure the first worker
/// to notice drops it and the next request opens a new one, which the others then pick up.
#[derive(Default)]
pub(crate) struct SharedConnection {
    /// The generation counts the connections opened here, so a worker holding an older one
    /// cannot drop its replacement.
    current: Mutex<(u64, Option<SendRequest<Bytes>>)>,
}

impl SharedConnection {
    /// The connection and its generation: the one open, or one opened now to `authority`
    /// (over TLS when `tls` is given); `what` names the target in an error.
    pub(crate) async fn take_or_open(
        &self,
        authority: &str,
        tls: Option<&TlsClient>,
        what: &str,
    ) -> Result<(u64, SendRequest<Bytes>), String> {
        if let (generation, Some(client)) = self.get() {
            return Ok((generation, client));
        }
        let cannot = |err: &dyn std::fmt::Display| format!("cannot connect to {what}: {err}");
        let stream = TcpStream::connect(authority)
            .await
            .map_err(|err| cannot(&err))?;
        // One small request per round trip: Nagle would add tens of milliseconds.
        stream.set_nodelay(true).map_err(|err| cannot(&err))?;
        let client = match tls {
            None => http2(stream).await,
            Some(tls) => http2(tls.connect(stream).await.map_err(|err| cannot(&err))?).await,
        }
        .map_err(|err| cannot(&err))?;
        Ok((self.set(&client), client))
    }

    fn get(&self) -> (u64, Option<SendRequest<Bytes>>) {
        let current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        (current.0, current.1.clone())
    }

    fn set(&self, client: &SendRequest<Bytes>) -> u64 {
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        current.0 += 1;
        current.1 = Some(client.clone());
        current.0
    }

    /// Forgets the connection of `generation`, if it is still the one shared.
    pub(crate) fn drop_generation(&self, generation: u64) {
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        if current.0 == generation {
            current.1 = None;
        }
    }
}

/// HTTP/2 over `stream`, its driver running in a task of its own, which ends when the
/// connection does (the next request then reports the failure).
async fn http2<S>(stream: S) -> Result<SendRequest<Bytes>, h2::Error>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let (client, connection) = h2::client::handshake(stream).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}
