//! An OpenTelemetry collector that keeps nothing: it takes OTLP/gRPC trace exports, counts
//! their spans and answers success, so that what `tollgate serve --trace-endpoint` costs can
//! be measured with spans really sent (`SERVE_ARGS` of `scripts/server-cost.sh`) and not
//! refused at the door, which costs the sender differently.
//!
//! `otlp-sink [PORT]` prints `listening PORT` once ready (port 0, the default, picks a free
//! one), then the spans taken so far each time a line arrives on its standard input, and runs
//! until killed.

use std::io::BufRead;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};

/// The spans taken.
#[derive(Clone, Default)]
struct Sink {
    spans: Arc<AtomicU64>,
}

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let spans: usize = request
            .get_ref()
            .resource_spans
            .iter()
            .flat_map(|resource| &resource.scope_spans)
            .map(|scope| scope.spans.len())
            .sum();
        self.spans.fetch_add(spans as u64, Ordering::Relaxed);
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let port: u16 = match std::env::args().nth(1) {
        Some(port) => port.parse()?,
        None => 0,
    };
    let sink = Sink::default();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let listener = runtime.block_on(tokio::net::TcpListener::bind(("127.0.0.1", port)))?;
    println!("listening {}", listener.local_addr()?.port());
    let incoming = futures_util::stream::unfold(listener, |listener| async move {
        let accepted = listener.accept().await.map(|(stream, _)| stream);
        Some((accepted, listener))
    });
    runtime.spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(sink.clone()))
            .serve_with_incoming(incoming),
    );
    for line in std::io::stdin().lock().lines() {
        line?;
        println!("spans {}", sink.spans.load(Ordering::Relaxed));
    }
    // Standard input closed: serve on until killed.
    loop {
        std::thread::park();
    }
}
