//! A tonic gRPC service (the standard health service) behind tollgate, with a client in the
//! same process: 2 calls of burst per client IP, then the limiter answers.
//!
//! A denied call ends with status `RESOURCE_EXHAUSTED`; the rate-limit fields and
//! `Retry-After` are in the response metadata.
//!
//! ```sh
//! cargo run -p tollgate-tower --example tonic
//! ```

use tollgate::Limit;
use tollgate_tower::{PeerIp, TollgateLayer};
use tonic::transport::server::{TcpConnectInfo, TcpIncoming};
use tonic::transport::{Endpoint, Server};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;

    // tonic puts the peer address in `TcpConnectInfo`.
    let peer = PeerIp::from_extension(|info: &TcpConnectInfo| info.remote_addr().map(|a| a.ip()));
    let layer = TollgateLayer::limit("per-ip", Limit::new(2, "1/s".parse()?)?, peer).build();

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    tokio::spawn(
        Server::builder()
            .layer(layer)
            .add_service(health)
            .serve_with_incoming(TcpIncoming::from(listener)),
    );

    let channel = Endpoint::from_shared(format!("http://{address}"))?
        .connect()
        .await?;
    let mut client = HealthClient::new(channel);
    for i in 1..=3 {
        match client.check(HealthCheckRequest::default()).await {
            Ok(response) => println!(
                "call {i}: {:?}, ratelimit: {:?}",
                response.get_ref().status(),
                response.metadata().get("ratelimit")
            ),
            Err(status) => println!(
                "call {i}: {:?} ({}), retry-after: {:?}",
                status.code(),
                status.message(),
                status.metadata().get("retry-after")
            ),
        }
    }
    Ok(())
}
