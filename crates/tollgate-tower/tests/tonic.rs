//! A tonic service behind the layer, over a real loopback connection: a denied call is a gRPC
//! `RESOURCE_EXHAUSTED` with the rate-limit fields in its metadata, not an HTTP error the
//! client cannot decode.

use tollgate::Limit;
use tollgate_tower::{PeerIp, TollgateLayer};
use tonic::Code;
use tonic::transport::server::{TcpConnectInfo, TcpIncoming};
use tonic::transport::{Endpoint, Server};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

#[tokio::test]
async fn a_denied_call_is_resource_exhausted_with_the_fields() {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    let peer = PeerIp::from_extension(|info: &TcpConnectInfo| info.remote_addr().map(|a| a.ip()));
    let layer = TollgateLayer::limit(
        "per-ip",
        Limit::new(2, "1/h".parse().unwrap()).unwrap(),
        peer,
    )
    .build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(
        Server::builder()
            .layer(layer)
            .add_service(health)
            .serve_with_incoming_shutdown(TcpIncoming::from(listener), async {
                let _ = stopped.await;
            }),
    );

    let channel = Endpoint::from_shared(format!("http://{address}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = HealthClient::new(channel);
    for remaining in [1, 0] {
        let ok = client.check(HealthCheckRequest::default()).await.unwrap();
        let ratelimit = ok.metadata().get("ratelimit").unwrap().to_str().unwrap();
        assert!(
            ratelimit.starts_with(&format!(r#""per-ip";r={remaining};"#)),
            "{ratelimit}"
        );
    }
    let denied = client
        .check(HealthCheckRequest::default())
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::ResourceExhausted, "{denied:?}");
    assert_eq!(denied.message(), "rate limit exceeded");
    assert_eq!(denied.metadata().get("retry-after").unwrap(), "3600");
    assert_eq!(
        denied.metadata().get("ratelimit-policy").unwrap(),
        r#""per-ip";q=2;w=7200"#
    );

    let _ = stop.send(());
    server.await.unwrap().unwrap();
}
