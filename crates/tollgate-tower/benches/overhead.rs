//! The cost of the layer: a no-op axum handler called in-process (`oneshot`, no network), bare
//! and behind `TollgateLayer`, in the same run. The limits never reject, so every request pays
//! the full path: key extraction, a bucket check, the rate-limit fields on the response.

use std::hint::black_box;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use http::Request;
use http::header::HeaderName;
use tollgate::Limit;
use tollgate_policy::{EngineOptions, PolicyEngine, compile};
use tollgate_tower::{Header, RequestHead, TollgateLayer};
use tower::ServiceExt;

/// Distinct clients, so the store works on a realistic spread of buckets.
const KEYS: usize = 1024;

fn requests() -> Vec<String> {
    (0..KEYS).map(|i| format!("client-{i}")).collect()
}

fn bench(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime");
    let noop = Router::new().route("/", get(|| async {}));
    // Any layer makes axum box the layered route: this pass-through layer shows that share of
    // the overhead, which is axum's, not tollgate's.
    let passthrough = noop
        .clone()
        .layer(tower::util::MapResponseLayer::new(|response| response));
    // A billion tokens of burst, a billion a second: never rejects.
    let limit = Limit::new(1_000_000_000, "1000000000/s".parse().expect("rate")).expect("limit");
    let header = || Header::new(HeaderName::from_static("x-api-key"));
    let single = noop
        .clone()
        .layer(TollgateLayer::limit("bench", limit, header()).build());
    // The same without the fields on admitted responses: what building them costs.
    let quiet = noop.clone().layer(
        TollgateLayer::limit("bench", limit, header())
            .headers_on_success(false)
            .build(),
    );
    let policy = compile(
        "bench.yaml",
        r#"
version: "1"
limits:
  - name: bench
    domain: api
    key: [user]
    capacity: 1000000000
    refill: 1000000000/s
"#,
    )
    .expect("policy");
    let engine = Arc::new(PolicyEngine::new(policy, EngineOptions::default()));
    let by_policy = noop.clone().layer(
        TollgateLayer::policy(engine, "api", |head: &RequestHead<'_>| {
            let user = head.header("x-api-key").unwrap_or("-");
            Ok(vec![vec![("user".to_owned(), user.to_owned())]])
        })
        .build(),
    );

    let keys = requests();
    let mut group = c.benchmark_group("tower_layer");
    group.throughput(Throughput::Elements(1));
    for (name, app) in [
        ("no-op handler", &noop),
        ("behind a pass-through layer", &passthrough),
        ("behind TollgateLayer::limit (memory)", &single),
        (
            "behind TollgateLayer::limit (memory), no fields on 200",
            &quiet,
        ),
        ("behind TollgateLayer::policy (memory)", &by_policy),
    ] {
        let mut i = 0;
        group.bench_function(name, |b| {
            b.iter(|| {
                i = (i + 1) % KEYS;
                let request = Request::get("/")
                    .header("x-api-key", &keys[i])
                    .body(Body::empty())
                    .expect("request");
                let response = runtime
                    .block_on(app.clone().oneshot(request))
                    .expect("infallible");
                black_box(response)
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
