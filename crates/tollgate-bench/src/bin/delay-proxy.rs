//! A TCP proxy that delays every byte by a fixed time each way: a store "in another region"
//! on one machine, for measuring what a cross-region round trip does to decisions
//! (`scripts/global-latency.sh`).
//!
//! Each direction of each connection reads what arrives, stamps it with its arrival time, and
//! writes it out once the delay has passed since then, so pipelined requests stay pipelined:
//! the link has latency, not a bandwidth of one message per delay.
//!
//! `delay-proxy LISTEN_PORT UPSTREAM_HOST:PORT ONE_WAY_MS` (prints `listening PORT` once
//! ready; port 0 picks a free one).

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [port, upstream, delay] = args.as_slice() else {
        return Err("usage: delay-proxy LISTEN_PORT UPSTREAM_HOST:PORT ONE_WAY_MS".into());
    };
    let port: u16 = port.parse()?;
    let delay = Duration::from_millis(delay.parse()?);
    let upstream = upstream.clone();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = TcpListener::bind(("127.0.0.1", port)).await?;
        println!("listening {}", listener.local_addr()?.port());
        loop {
            let (client, _) = listener.accept().await?;
            let upstream = upstream.clone();
            tokio::spawn(async move {
                let Ok(server) = TcpStream::connect(&upstream).await else {
                    return;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                tokio::spawn(pipe(client_read, server_write, delay));
                tokio::spawn(pipe(server_read, client_write, delay));
            });
        }
    })
}

/// Copies `from` to `to`, each chunk `delay` after it arrived.
async fn pipe(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, delay: Duration) {
    let (chunks, mut due) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let writer = tokio::spawn(async move {
        while let Some((at, bytes)) = due.recv().await {
            tokio::time::sleep_until(at + delay).await;
            if to.write_all(&bytes).await.is_err() {
                break;
            }
        }
    });
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if chunks.send((Instant::now(), buffer[..n].to_vec())).is_err() {
                    break;
                }
            }
        }
    }
    drop(chunks);
    let _ = writer.await;
}
