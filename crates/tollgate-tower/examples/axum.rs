//! An axum app behind tollgate: 5 requests of burst per client IP, refilled at 1 per second,
//! and a health check that is never limited.
//!
//! ```sh
//! cargo run -p tollgate-tower --example axum
//! for i in $(seq 7); do curl -si localhost:3000/ | head -1; done
//! ```

use std::net::SocketAddr;

use axum::Router;
use axum::extract::ConnectInfo;
use axum::routing::get;
use tollgate::Limit;
use tollgate_tower::{PeerIp, RequestHead, TollgateLayer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // axum puts the peer address in `ConnectInfo` when served with connect info (below).
    let peer = PeerIp::from_extension(|info: &ConnectInfo<SocketAddr>| Some(info.0.ip()));
    let layer = TollgateLayer::limit("per-ip", Limit::new(5, "1/s".parse()?)?, peer)
        // Health checks cost nothing, so a load balancer never trips the limit.
        .cost(|head: &RequestHead<'_>| u64::from(head.uri.path() != "/healthz"))
        .build();

    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .route("/healthz", get(|| async { "ok\n" }))
        .layer(layer);

    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}
