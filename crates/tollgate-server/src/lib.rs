//! The tollgate decision service.
//!
//! `tollgate serve` answers rate-limit decisions over three front ends that share one
//! [`Decider`]: Envoy's Rate Limit Service v3 over gRPC ([`rls`]), an HTTP JSON API and a
//! forward-auth endpoint for nginx and Traefik ([`http`]), with Prometheus metrics, health and
//! admin endpoints. [`run`] serves them on listeners it is given until a shutdown future
//! resolves, so `main` and the end-to-end tests start the server the same way.
//!
//! Every front end decides through the [`Decider`]: the policy in force against the memory
//! store or Redis.
//!
//! ```
//! use std::sync::Arc;
//! use tollgate_policy::{EngineOptions, PolicyEngine, compile};
//! use tollgate_server::decider::Request;
//! use tollgate_server::metrics::Api;
//! use tollgate_server::{Backend, Decider};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let policy = compile(
//!     "inline.yaml",
//!     "limits: [{name: per-user, domain: api, key: [user], capacity: 2, refill: 1/s}]",
//! )?;
//! let engine = Arc::new(PolicyEngine::new(policy, EngineOptions::default()));
//! let decider = Decider::new(engine, Backend::Memory);
//!
//! let descriptors = [vec![("user".to_owned(), "u1".to_owned())]];
//! let request = Request { domain: "api", descriptors: &descriptors, cost: 1, request_id: None };
//! assert!(decider.decide(Api::Http, &request).await?.allowed);
//! assert!(decider.decide(Api::Http, &request).await?.allowed);
//! let third = decider.decide(Api::Http, &request).await?;
//! assert!(!third.allowed);
//! assert_eq!(third.limits[0].name, "per-user");
//! # Ok(())
//! # }
//! ```
//!
//! # Semantics
//!
//! * A request carries a domain and descriptors; every limit whose domain, `when` entries and
//!   `key` entries match applies, all or nothing. No limit applying means allowed (counted).
//! * HTTP answers 200 / 429 (with `Retry-After`, rounded up) / 503 (a limit failing closed
//!   while Redis is down) / 400 (bad input, nothing decided); gRPC answers Envoy's codes.

pub mod cli;
pub mod decider;
pub mod http;
pub mod loadgen;
pub mod metrics;
pub mod rls;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::ListenerExt;
use tokio::net::TcpListener;
use tokio::sync::watch;

pub use decider::{Backend, Decider};
pub use http::{AppState, HttpOptions};

/// Why serving stopped with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The HTTP server failed.
    #[error("HTTP server: {0}")]
    Http(std::io::Error),
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Grpc(tonic::transport::Error),
    /// A serving thread of [`run_per_core`] could not start, or failed.
    #[error("serving thread: {0}")]
    Thread(std::io::Error),
}

/// How often this process's full buckets are dropped and emptied tables shrunk, so that after
/// a spike of keys the live-bucket count falls and the tables give their memory back instead of
/// staying at their peak until the next growth.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// How often the metrics' histogram samples are folded into their buckets. The exporter keeps
/// every sample until then (or until `/metrics` is scraped): a server nobody scrapes would
/// otherwise grow by a sample per decision, without end. Often, so that each fold is short: it
/// runs on a worker thread, ahead of the requests queued behind it.
const METRICS_UPKEEP_EVERY: Duration = Duration::from_secs(1);

/// Runs `task` every `period` (the first time one period from now) until `stopped` resolves.
async fn every(period: Duration, stopped: impl Future<Output = ()>, mut task: impl FnMut()) {
    let mut ticks = tokio::time::interval(period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is immediate; there is nothing to do at the start.
    ticks.tick().await;
    let repeating = async {
        loop {
            ticks.tick().await;
            task();
        }
    };
    tokio::select! {
        () = repeating => {}
        () = stopped => {}
    }
}

/// Serves HTTP on `http` and gRPC on `grpc` until `shutdown` resolves, then stops accepting,
/// lets requests in flight finish, and returns.
///
/// # Errors
///
/// [`ServeError`] when a server fails.
pub async fn run(
    state: Arc<AppState>,
    http: TcpListener,
    grpc: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let (stop, stopped) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop.send(true);
    });
    housekeeping(&state, &stopped);
    serve_listeners(state, http, grpc, stopped).await
}

/// Serves like [`run`], and serves `others` too, each pair of listeners on a thread of its own
/// with a single-threaded runtime. The listeners are meant to share their ports
/// (`SO_REUSEPORT`): the kernel then spreads new connections over the threads, and each
/// connection, with every request and HTTP/2 stream on it, stays on one thread, where a shared
/// runtime's threads would hand work to each other and wake each other up for it. The decision
/// state (policy, buckets, store) is shared by all. One thread stopping, for whatever reason,
/// stops them all.
///
/// # Errors
///
/// [`ServeError`] when a thread cannot start or a server fails; the first error is returned
/// once every thread has stopped.
pub async fn run_per_core(
    state: Arc<AppState>,
    http: TcpListener,
    grpc: TcpListener,
    others: Vec<(std::net::TcpListener, std::net::TcpListener)>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let (stop, stopped) = watch::channel(false);
    let stop = Arc::new(stop);
    let mut threads = Vec::with_capacity(others.len());
    let mut started = Ok(());
    for (index, (http, grpc)) in others.into_iter().enumerate() {
        let (state, stopped, stopping) = (Arc::clone(&state), stopped.clone(), Arc::clone(&stop));
        let spawned = std::thread::Builder::new()
            // Named for `top -H` and the like (a thread name holds 15 bytes).
            .name("tollgate-worker".to_owned())
            .spawn(move || {
                let result = serve_on_own_runtime(state, http, grpc, stopped);
                if let Err(err) = &result {
                    tracing::error!(thread = index + 1, error = %err, "serving thread failed");
                }
                let _ = stopping.send(true);
                result
            });
        match spawned {
            Ok(thread) => threads.push(thread),
            Err(err) => {
                started = Err(ServeError::Thread(err));
                let _ = stop.send(true);
                break;
            }
        }
    }
    let signal = Arc::clone(&stop);
    let mut stopping = stopped.clone();
    tokio::spawn(async move {
        tokio::select! {
            () = shutdown => {}
            _ = stopping.wait_for(|stop| *stop) => {}
        }
        let _ = signal.send(true);
    });
    housekeeping(&state, &stopped);
    let served = serve_listeners(state, http, grpc, stopped).await;
    let _ = stop.send(true);
    let joined = tokio::task::spawn_blocking(move || {
        threads
            .into_iter()
            .map(|thread| {
                thread.join().unwrap_or_else(|_| {
                    Err(ServeError::Thread(std::io::Error::other(
                        "a serving thread panicked",
                    )))
                })
            })
            .collect::<Vec<_>>()
    })
    .await
    .map_err(|err| ServeError::Thread(std::io::Error::other(err)))?;
    started?;
    served?;
    joined.into_iter().collect()
}

/// One thread of [`run_per_core`]: its own runtime, serving its own listeners.
fn serve_on_own_runtime(
    state: Arc<AppState>,
    http: std::net::TcpListener,
    grpc: std::net::TcpListener,
    stopped: watch::Receiver<bool>,
) -> Result<(), ServeError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(ServeError::Thread)?;
    runtime.block_on(async move {
        let http = TcpListener::from_std(http).map_err(ServeError::Thread)?;
        let grpc = TcpListener::from_std(grpc).map_err(ServeError::Thread)?;
        serve_listeners(state, http, grpc, stopped).await
    })
}

/// Resolves once `stopped` turns true, or once nothing can turn it any more.
async fn until_stopped(mut stopped: watch::Receiver<bool>) {
    let _ = stopped.wait_for(|stop| *stop).await;
}

/// The process-wide chores, once per process, until `stopped`.
fn housekeeping(state: &Arc<AppState>, stopped: &watch::Receiver<bool>) {
    let engine = Arc::clone(state.decider.engine());
    tokio::spawn(every(
        SWEEP_EVERY,
        until_stopped(stopped.clone()),
        move || {
            let dropped = engine.sweep();
            tracing::debug!(dropped, "swept full buckets");
        },
    ));
    if let Some(metrics) = state.metrics.clone() {
        tokio::spawn(every(
            METRICS_UPKEEP_EVERY,
            until_stopped(stopped.clone()),
            move || {
                metrics.run_upkeep();
            },
        ));
    }
}

/// Serves HTTP on `http` and gRPC on `grpc` until `stopped`, then lets requests in flight
/// finish.
async fn serve_listeners(
    state: Arc<AppState>,
    http: TcpListener,
    grpc: TcpListener,
    stopped: watch::Receiver<bool>,
) -> Result<(), ServeError> {
    let app = http::router(Arc::clone(&state)).into_make_service_with_connect_info::<SocketAddr>();
    // Answers are small and written whole: nothing is gained by holding them back (Nagle).
    let http = http.tap_io(|stream| {
        if let Err(err) = stream.set_nodelay(true) {
            tracing::debug!(error = %err, "cannot set TCP_NODELAY");
        }
    });
    let http_server = axum::serve(http, app).with_graceful_shutdown(until_stopped(stopped.clone()));

    let rls = rls::Rls::new(Arc::clone(&state.decider)).into_server();
    let incoming = tonic::transport::server::TcpIncoming::from(grpc).with_nodelay(Some(true));
    let grpc_server = tonic::transport::Server::builder()
        .add_service(rls)
        .serve_with_incoming_shutdown(incoming, until_stopped(stopped));

    let (http_result, grpc_result) = tokio::join!(http_server, grpc_server);
    http_result.map_err(ServeError::Http)?;
    grpc_result.map_err(ServeError::Grpc)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate::ManualClock;
    use tollgate_policy::{EngineOptions, PolicyEngine, compile};

    #[tokio::test(start_paused = true)]
    async fn the_sweeper_drops_refilled_buckets_every_interval_until_stopped() {
        let policy = compile(
            "p.yaml",
            "limits: [{name: per-user, domain: api, key: [user], capacity: 2, refill: 1/s}]",
        )
        .expect("policy");
        let clock = ManualClock::new();
        let options = EngineOptions::default().clock(Arc::new(clock.clone()));
        let engine = Arc::new(PolicyEngine::new(policy, options));
        let decide = |user: &str| {
            let descriptor = [("user", user)];
            engine
                .decide("api", &[descriptor], 1, None)
                .expect("decides");
        };
        decide("a");
        decide("b");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let swept = Arc::clone(&engine);
        let sweeper = tokio::spawn(every(
            SWEEP_EVERY,
            async {
                let _ = stopped.await;
            },
            move || {
                swept.sweep();
            },
        ));

        // Not yet refilled at the first sweep; refilled (full, so dropped) by the second.
        tokio::time::sleep(SWEEP_EVERY + Duration::from_millis(1)).await;
        assert_eq!(engine.memory_stats().live_buckets, 2);
        clock.advance(Duration::from_secs(1));
        tokio::time::sleep(SWEEP_EVERY).await;
        assert_eq!(engine.memory_stats().live_buckets, 0);

        drop(stop);
        sweeper.await.expect("the sweeper stops with the server");
    }
}
