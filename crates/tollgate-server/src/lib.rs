//! The tollgate decision service.
//!
//! `tollgate serve` answers rate-limit decisions over front ends that share one [`Decider`]:
//! Envoy's Rate Limit Service v3 over gRPC ([`rls`]), its Rate Limit Quota Service ([`rlqs`],
//! quotas Envoys spend on their own, paid in the shared buckets first), an HTTP JSON API and a
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
//! let request = Request { domain: "api", descriptors: &descriptors, cost: 1.into(), request_id: None };
//! assert!(decider.decide(Api::Http, &request).await?.allowed);
//! assert!(decider.decide(Api::Http, &request).await?.allowed);
//! let third = decider.decide(Api::Http, &request).await?;
//! assert!(!third.allowed);
//! assert_eq!(&*third.limits[0].name, "per-user");
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
mod connection;
pub mod decider;
mod diff;
pub mod global;
mod grpc;
mod grpc_unary;
mod health;
pub mod hot_keys;
pub mod http;
mod http2;
pub mod loadgen;
pub mod metrics;
mod policy_view;
mod progress;
pub mod rlqs;
pub mod rls;
pub mod simulate;
pub mod tls;
pub mod traces;
mod validate;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

pub use connection::ConnectionLimits;
use connection::{Admitted, Place};
pub use decider::{Backend, Decider};
pub use health::Rotation;
pub use http::{AppState, HttpOptions};

/// Why serving stopped with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
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
    let rlqs = rlqs_service(&state, &stopped);
    serve_listeners(state, http, grpc, stopped, rlqs).await
}

/// The RLQS service, one per process so that fair shares and the bound on store calls
/// span every serving thread.
fn rlqs_service(state: &AppState, stopped: &watch::Receiver<bool>) -> Arc<rlqs::Rlqs> {
    let decider = Arc::clone(&state.decider);
    Arc::new(rlqs::Rlqs::new(decider, state.rlqs, stopped.clone()))
}

/// Serves like [`run`], on `threads` threads, each with a single-threaded runtime of its own:
/// this one (call it from a current-thread runtime) and `threads - 1` it starts. This thread
/// accepts every connection and hands each to the threads in turn; a connection, with every
/// request and HTTP/2 stream on it, then stays on its thread, where a shared runtime's threads
/// would hand work to each other and wake each other up for it. Turn by turn, long-lived
/// connections are spread evenly by count (a kernel hash of `SO_REUSEPORT` listeners would not
/// be). The decision state (policy, buckets, store) is shared by all. One thread stopping, for
/// whatever reason, stops them all.
///
/// # Errors
///
/// [`ServeError`] when a thread cannot start or a server fails; the first error is returned
/// once every thread has stopped.
pub async fn run_per_core(
    state: Arc<AppState>,
    http: TcpListener,
    grpc: TcpListener,
    threads: usize,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let (stop, stopped) = watch::channel(false);
    let stop = Arc::new(stop);
    let (own_http, own_grpc) = (mpsc::unbounded_channel(), mpsc::unbounded_channel());
    let (mut to_http, mut to_grpc) = (vec![own_http.0], vec![own_grpc.0]);
    let mut spawned = Vec::with_capacity(threads.saturating_sub(1));
    let mut started = Ok(());
    let rlqs = rlqs_service(&state, &stopped);
    for index in 1..threads.max(1) {
        let (http_in, http_out) = mpsc::unbounded_channel();
        let (grpc_in, grpc_out) = mpsc::unbounded_channel();
        let (state, stopped, stopping) = (Arc::clone(&state), stopped.clone(), Arc::clone(&stop));
        let rlqs = Arc::clone(&rlqs);
        let thread = std::thread::Builder::new()
            // Named for `top -H` and the like (a thread name holds 15 bytes).
            .name("tollgate-worker".to_owned())
            .spawn(move || {
                let result = serve_on_own_runtime(state, (http_out, grpc_out), stopped, rlqs);
                if let Err(err) = &result {
                    tracing::error!(thread = index, error = %err, "serving thread failed");
                }
                let _ = stopping.send(true);
                result
            });
        match thread {
            Ok(thread) => {
                spawned.push(thread);
                to_http.push(http_in);
                to_grpc.push(grpc_in);
            }
            Err(err) => {
                started = Err(ServeError::Thread(err));
                let _ = stop.send(true);
                break;
            }
        }
    }
    let signal = Arc::clone(&stop);
    tokio::spawn(async move {
        shutdown.await;
        let _ = signal.send(true);
    });
    housekeeping(&state, &stopped);
    let gates = &state.connections;
    let http = connection::admit(http, Arc::clone(&gates.http));
    let grpc = connection::admit(grpc, Arc::clone(&gates.grpc));
    tokio::spawn(hand_out(http, to_http, stopped.clone()));
    tokio::spawn(hand_out(grpc, to_grpc, stopped.clone()));
    let (http_in, grpc_in) = (handed(own_http.1), handed(own_grpc.1));
    let served = serve_incoming(state, http_in, grpc_in, stopped, rlqs).await;
    let _ = stop.send(true);
    let joined = tokio::task::spawn_blocking(move || {
        spawned
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

/// A connection handed from the accepting thread to another runtime's thread, with its place
/// under the listener's bound.
type Handoff = (std::net::TcpStream, Place);

/// Hands the connections `incoming` admits to `threads` in turn, until `stopped`.
async fn hand_out(
    incoming: impl futures_util::Stream<Item = std::io::Result<Admitted>>,
    threads: Vec<mpsc::UnboundedSender<Handoff>>,
    stopped: watch::Receiver<bool>,
) {
    let mut incoming = std::pin::pin!(incoming);
    let mut turn = 0;
    let stop = until_stopped(stopped);
    tokio::pin!(stop);
    loop {
        let accepted = tokio::select! {
            accepted = incoming.next() => accepted,
            () = &mut stop => return,
        };
        match accepted.map(|accepted| accepted.and_then(Admitted::into_std)) {
            None => return,
            Some(Ok(handoff)) => {
                if let Some(thread) = threads.get(turn % threads.len().max(1)) {
                    // A thread that is gone has stopped them all; the connection just closes.
                    let _ = thread.send(handoff);
                }
                turn = turn.wrapping_add(1);
            }
            Some(Err(err)) => {
                // Out of file descriptors, most likely: wait rather than spin.
                tracing::warn!(error = %err, "cannot accept a connection");
                tokio::time::sleep(connection::ACCEPT_BACKOFF).await;
            }
        }
    }
}

/// The connections handed to this thread, admitted as they were by the accepting thread.
fn handed(
    mut connections: mpsc::UnboundedReceiver<Handoff>,
) -> impl futures_util::Stream<Item = std::io::Result<Admitted>> + Send + 'static {
    futures_util::stream::poll_fn(move |cx| {
        connections.poll_recv(cx).map(|handoff| {
            handoff.map(|(stream, place)| {
                let stream = tokio::net::TcpStream::from_std(stream)?;
                Ok(Admitted::new(stream, place))
            })
        })
    })
}

/// One thread of [`run_per_core`]: its own runtime, serving the connections handed to it.
fn serve_on_own_runtime(
    state: Arc<AppState>,
    (http, grpc): (
        mpsc::UnboundedReceiver<Handoff>,
        mpsc::UnboundedReceiver<Handoff>,
    ),
    stopped: watch::Receiver<bool>,
    rlqs: Arc<rlqs::Rlqs>,
) -> Result<(), ServeError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(ServeError::Thread)?;
    runtime.block_on(serve_incoming(
        state,
        handed(http),
        handed(grpc),
        stopped,
        rlqs,
    ))
}

/// Resolves once `stopped` turns true, or once nothing can turn it any more.
async fn until_stopped(mut stopped: watch::Receiver<bool>) {
    let _ = stopped.wait_for(|stop| *stop).await;
}

/// How often, at most, batches of tokens held past their lifetime are looked for: a quarter
/// of the lifetime, so a batch whose key went quiet is held at most a quarter longer.
fn token_batch_sweep_every(ttl: Duration) -> Duration {
    (ttl / 4).max(Duration::from_millis(10))
}

/// The process-wide chores, once per process, until `stopped`.
fn housekeeping(state: &Arc<AppState>, stopped: &watch::Receiver<bool>) {
    if let Backend::Redis(store) = state.decider.backend()
        && let Some(ttl) = store.token_batch_ttl()
    {
        let decider = Arc::clone(&state.decider);
        let stop = until_stopped(stopped.clone());
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(token_batch_sweep_every(ttl));
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let sweeping = async {
                loop {
                    ticks.tick().await;
                    if let Backend::Redis(store) = decider.backend() {
                        store.sweep_token_batches().await;
                    }
                }
            };
            tokio::select! {
                () = sweeping => {}
                () = stop => {}
            }
        });
    }
    let engine = Arc::clone(state.decider.engine());
    tokio::spawn(every(
        SWEEP_EVERY,
        until_stopped(stopped.clone()),
        move || {
            let dropped = engine.sweep();
            tracing::debug!(dropped, "swept full buckets and ended leases");
            engine.report_expired_exemptions();
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
    rlqs: Arc<rlqs::Rlqs>,
) -> Result<(), ServeError> {
    let gates = &state.connections;
    let http = connection::admit(http, Arc::clone(&gates.http));
    let grpc = connection::admit(grpc, Arc::clone(&gates.grpc));
    serve_incoming(state, http, grpc, stopped, rlqs).await
}

/// Serves HTTP on the connections `http` yields and gRPC on those `grpc` yields, until
/// `stopped`, then lets requests in flight finish.
async fn serve_incoming<H, G>(
    state: Arc<AppState>,
    http: H,
    grpc: G,
    stopped: watch::Receiver<bool>,
    rlqs: Arc<rlqs::Rlqs>,
) -> Result<(), ServeError>
where
    H: futures_util::Stream<Item = std::io::Result<Admitted>>,
    G: futures_util::Stream<Item = std::io::Result<Admitted>>,
{
    let limits = state.connections.limits;
    let rls = Arc::new(
        rls::Rls::new(Arc::clone(&state.decider))
            .with_header_style(state.options.rate_limit_headers)
            .with_negative_hits(state.options.negative_hits),
    );
    let unary = grpc_unary::ShouldRateLimit::new(Arc::clone(&rls), state.traces.clone());
    let rls = rls::Rls::server(rls);
    let health =
        health::GrpcHealth::new(Arc::clone(&state.decider), &state.rotation, stopped.clone())
            .into_server();
    let grpc_server = grpc::serve(
        health::Routes::new(rls, unary, health, rlqs::Rlqs::server(rlqs)),
        grpc,
        limits,
        state.connections.grpc_tls.clone(),
        stopped.clone(),
    );
    let http_server = http::listener::serve(state, http, stopped);
    tokio::join!(http_server, grpc_server);
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
