//! tollgate embedded in a program without an HTTP server: the layer around a plain tower
//! service (here, a function that "processes jobs" addressed by tenant), called in-process.
//! The same layer would sit in front of a hyper service.
//!
//! ```sh
//! cargo run -p tollgate-tower --example embedded
//! ```

use std::convert::Infallible;

use http::header::HeaderName;
use http::{Request, Response};
use http_body::Body as _;
use tollgate::Limit;
use tollgate_tower::{Header, TollgateLayer};
use tower::{ServiceBuilder, ServiceExt, service_fn};

async fn process(job: Request<String>) -> Result<Response<String>, Infallible> {
    Ok(Response::new(format!("processed {}", job.body())))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Each tenant may run 3 jobs at once, then one every 10 seconds.
    let layer = TollgateLayer::limit(
        "jobs-per-tenant",
        Limit::new(3, "1/10s".parse()?)?,
        Header::new(HeaderName::from_static("x-tenant")),
    )
    .build();
    let service = ServiceBuilder::new()
        .layer(layer)
        .service(service_fn(process));

    for i in 1..=5 {
        let job = Request::post("/jobs")
            .header("x-tenant", "acme")
            .body(format!("job {i}"))?;
        let response = service.clone().oneshot(job).await?;
        let (parts, body) = response.into_parts();
        let fields = |name: &str| {
            parts
                .headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("-")
                .to_owned()
        };
        println!(
            "job {i}: {} ratelimit: {} retry-after: {} ({} body bytes)",
            parts.status,
            fields("ratelimit"),
            fields("retry-after"),
            body.size_hint().exact().unwrap_or(0),
        );
    }
    Ok(())
}
