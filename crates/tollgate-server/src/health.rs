//! The standard gRPC health service (`grpc.health.v1.Health`) on the RLS port, and the router
//! that puts it beside the RLS service.
//!
//! Envoy health-checks a gRPC cluster with this protocol (`grpc_health_check`), as do
//! Kubernetes' gRPC probes, so an instance that cannot decide (its Redis unreachable) is taken
//! out of rotation by the very client that calls it, without an HTTP port to probe. The answer
//! is `/readyz`'s: serving when the store answers (always, on the memory store), computed on
//! every `Check` so that the two never disagree. The service names known are the server as a
//! whole (`""`) and the RLS service; others are `NOT_FOUND`, as the protocol asks.
//!
//! Both also say "not serving" once the server has left its load balancers' [`Rotation`] on
//! its way out (`--shutdown-delay`), while it still answers every call.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::future::Either;
use futures_util::{Stream, StreamExt, stream};
use tokio::sync::watch;
use tonic::{Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tower_service::Service;

use crate::decider::Decider;
use crate::grpc_unary::ShouldRateLimit;

/// The path prefix of the health service's methods.
const HEALTH_PATH: &str = "/grpc.health.v1.Health/";

/// The service names `Check` and `Watch` know.
const SERVICES: [&str; 3] = [
    "",
    "envoy.service.ratelimit.v3.RateLimitService",
    "envoy.service.rate_limit_quota.v3.RateLimitQuotaService",
];

/// How often a `Watch` looks at the store again: a ping every few seconds per watcher is
/// nothing to Redis, and a status a few seconds late is what health checking tolerates.
const WATCH_EVERY: Duration = Duration::from_secs(2);

/// Whether the server is in its load balancers' rotation.
///
/// A server stopped at once refuses the new connections that load balancers, which learn of
/// the stop later (a Kubernetes Service's endpoints, Envoy's health checks), still send it
/// for a few seconds: refused calls a client treats as the limiter being down. With
/// `--shutdown-delay`, the first SIGTERM takes the server out of rotation instead: `/readyz`
/// and the gRPC health service answer "not ready", so the balancers stop sending, while it
/// goes on serving every request, new connections included, until the delay is over and it
/// drains. It never comes back: leaving is for a server on its way out.
#[derive(Debug)]
pub struct Rotation {
    leaving: watch::Sender<bool>,
}

impl Rotation {
    /// A server in rotation.
    pub fn new() -> Self {
        Self {
            leaving: watch::Sender::new(false),
        }
    }

    /// Takes the server out of rotation, waking every health `Watch` to say so.
    pub fn leave(&self) {
        self.leaving.send_replace(true);
    }

    /// Whether the server has left rotation.
    pub fn is_leaving(&self) -> bool {
        *self.leaving.borrow()
    }

    fn subscribe(&self) -> watch::Receiver<bool> {
        self.leaving.subscribe()
    }
}

impl Default for Rotation {
    fn default() -> Self {
        Self::new()
    }
}

/// The health service of one server.
pub(crate) struct GrpcHealth {
    decider: Arc<Decider>,
    /// Whether the server has left rotation (see [`Rotation`]).
    leaving: watch::Receiver<bool>,
    /// Ends every `Watch` stream at shutdown: a stream that never ends would hold the graceful
    /// stop forever.
    stopped: watch::Receiver<bool>,
}

impl GrpcHealth {
    pub(crate) fn new(
        decider: Arc<Decider>,
        rotation: &Rotation,
        stopped: watch::Receiver<bool>,
    ) -> Self {
        Self {
            decider,
            leaving: rotation.subscribe(),
            stopped,
        }
    }

    pub(crate) fn into_server(self) -> HealthServer<Self> {
        HealthServer::new(self)
    }
}

/// The status of `service` now: `None` for a name this server does not know.
async fn status(decider: &Decider, leaving: bool, service: &str) -> Option<ServingStatus> {
    if !SERVICES.contains(&service) {
        return None;
    }
    if leaving {
        return Some(ServingStatus::NotServing);
    }
    Some(match decider.store_ready().await {
        Ok(()) => ServingStatus::Serving,
        Err(_) => ServingStatus::NotServing,
    })
}

fn response(status: ServingStatus) -> HealthCheckResponse {
    HealthCheckResponse {
        status: status as i32,
    }
}

/// A `Watch` stream's state between two messages.
struct Watching {
    decider: Arc<Decider>,
    service: String,
    last: Option<ServingStatus>,
    leaving: watch::Receiver<bool>,
    stopped: watch::Receiver<bool>,
}

impl Watching {
    /// The next status that differs from the last one sent, or `None` once the server stops.
    async fn next(mut self) -> Option<(Result<HealthCheckResponse, Status>, Self)> {
        loop {
            if *self.stopped.borrow() {
                return None;
            }
            let leaving = *self.leaving.borrow_and_update();
            let now = status(&self.decider, leaving, &self.service)
                .await
                .unwrap_or(ServingStatus::ServiceUnknown);
            if self.last != Some(now) {
                self.last = Some(now);
                return Some((Ok(response(now)), self));
            }
            tokio::select! {
                () = tokio::time::sleep(WATCH_EVERY) => {}
                // Said at once, not up to WATCH_EVERY later: the delay out of rotation is short.
                // (A sender gone, at the server's end, no longer matches: the others decide.)
                Ok(()) = self.leaving.changed() => {}
                changed = self.stopped.changed() => {
                    // The server that would say "stop" is gone: so is the reason to watch.
                    if changed.is_err() {
                        return None;
                    }
                }
            }
        }
    }
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Health for GrpcHealth {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        let service = request.into_inner().service;
        let leaving = *self.leaving.borrow();
        match status(&self.decider, leaving, &service).await {
            Some(status) => Ok(Response::new(response(status))),
            None => Err(Status::not_found(format!("unknown service {service:?}"))),
        }
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<WatchStream>, Status> {
        let watching = Watching {
            decider: Arc::clone(&self.decider),
            service: request.into_inner().service,
            last: None,
            leaving: self.leaving.clone(),
            stopped: self.stopped.clone(),
        };
        Ok(Response::new(
            stream::unfold(watching, Watching::next).boxed(),
        ))
    }
}

/// The gRPC port's services: health calls go to `health`, RLQS streams to `rlqs`, the usual
/// `ShouldRateLimit` calls to `unary` (see [`ShouldRateLimit::answers`]), everything else to
/// `rls` (tonic's server, which answers `UNIMPLEMENTED` for methods it does not have).
#[derive(Clone)]
pub(crate) struct Routes<R, U, H, Q> {
    rls: R,
    unary: U,
    health: H,
    rlqs: Q,
}

impl<R, U, H, Q> Routes<R, U, H, Q> {
    pub(crate) fn new(rls: R, unary: U, health: H, rlqs: Q) -> Self {
        Self {
            rls,
            unary,
            health,
            rlqs,
        }
    }
}

impl<R, U, H, Q, B, Req> Service<http::Request<Req>> for Routes<R, U, H, Q>
where
    R: Service<http::Request<Req>, Response = http::Response<B>, Error = Infallible>,
    U: Service<http::Request<Req>, Response = http::Response<B>, Error = Infallible>,
    H: Service<http::Request<Req>, Response = http::Response<B>, Error = Infallible>,
    Q: Service<http::Request<Req>, Response = http::Response<B>, Error = Infallible>,
{
    type Response = http::Response<B>;
    type Error = Infallible;
    type Future = Either<Either<R::Future, Q::Future>, Either<U::Future, H::Future>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // All are always ready; asked anyway, as the contract says.
        let Poll::Ready(Ok(())) = self.rls.poll_ready(cx) else {
            return Poll::Pending;
        };
        let Poll::Ready(Ok(())) = self.unary.poll_ready(cx) else {
            return Poll::Pending;
        };
        let Poll::Ready(Ok(())) = self.rlqs.poll_ready(cx) else {
            return Poll::Pending;
        };
        self.health.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Req>) -> Self::Future {
        let path = request.uri().path();
        if path.starts_with(HEALTH_PATH) {
            Either::Right(Either::Right(self.health.call(request)))
        } else if path.starts_with(crate::rlqs::PATH) {
            Either::Left(Either::Right(self.rlqs.call(request)))
        } else if ShouldRateLimit::answers(&request) {
            Either::Right(Either::Left(self.unary.call(request)))
        } else {
            Either::Left(Either::Left(self.rls.call(request)))
        }
    }
}

#[cfg(test)]
mod tests {
    use tollgate_policy::{EngineOptions, PolicyEngine, compile};

    use super::*;
    use crate::Backend;

    fn decider() -> Arc<Decider> {
        let policy = compile(
            "p.yaml",
            "limits: [{name: l, domain: api, key: [user], capacity: 1, refill: 1/s}]",
        )
        .expect("policy");
        let engine = Arc::new(PolicyEngine::new(policy, EngineOptions::default()));
        Arc::new(Decider::new(engine, Backend::Memory))
    }

    /// A service ready or not, as told.
    #[derive(Clone, Copy)]
    struct Told(bool);

    impl Service<http::Request<()>> for Told {
        type Response = http::Response<()>;
        type Error = Infallible;
        type Future = std::future::Ready<Result<http::Response<()>, Infallible>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            if self.0 {
                Poll::Ready(Ok(()))
            } else {
                Poll::Pending
            }
        }

        fn call(&mut self, _: http::Request<()>) -> Self::Future {
            std::future::ready(Ok(http::Response::new(())))
        }
    }

    /// The routes are ready only when every service they may route to is: a call must not be
    /// routed to one that has not said it can take it.
    #[test]
    fn the_routes_are_ready_when_every_service_is() {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        for not_ready in 0..4 {
            let told = |index| Told(index != not_ready);
            let mut routes = Routes::new(told(0), told(1), told(2), told(3));
            assert!(routes.poll_ready(&mut cx).is_pending(), "{not_ready}");
        }
        let mut routes = Routes::new(Told(true), Told(true), Told(true), Told(true));
        assert!(matches!(routes.poll_ready(&mut cx), Poll::Ready(Ok(()))));
    }

    /// The stream's next status, which must come in less than `WATCH_EVERY`: a stream that
    /// stays silent fails the test rather than hanging it (time is paused, and it would look
    /// again every `WATCH_EVERY` forever).
    async fn said(statuses: &mut WatchStream) -> i32 {
        tokio::time::timeout(WATCH_EVERY / 2, statuses.next())
            .await
            .expect("a status at once")
            .expect("a status")
            .expect("ok")
            .status
    }

    fn watch(service: &str, stopped: watch::Receiver<bool>) -> WatchStream {
        watch_in(&Rotation::new(), service, stopped)
    }

    fn watch_in(rotation: &Rotation, service: &str, stopped: watch::Receiver<bool>) -> WatchStream {
        let watching = Watching {
            decider: decider(),
            service: service.to_owned(),
            last: None,
            leaving: rotation.subscribe(),
            stopped,
        };
        stream::unfold(watching, Watching::next).boxed()
    }

    #[tokio::test(start_paused = true)]
    async fn leaving_rotation_is_said_at_once_to_a_watch_and_to_a_check() {
        let rotation = Rotation::new();
        let (_stop, stopped) = watch::channel(false);
        let mut statuses = watch_in(&rotation, "", stopped.clone());
        assert_eq!(said(&mut statuses).await, ServingStatus::Serving as i32);
        let health = GrpcHealth::new(decider(), &rotation, stopped);
        let asked = || async {
            let request = Request::new(HealthCheckRequest {
                service: "envoy.service.ratelimit.v3.RateLimitService".to_owned(),
            });
            health
                .check(request)
                .await
                .expect("known")
                .into_inner()
                .status
        };
        assert_eq!(asked().await, ServingStatus::Serving as i32);

        rotation.leave();
        // Woken by the leaving, not by its next look WATCH_EVERY later.
        assert_eq!(said(&mut statuses).await, ServingStatus::NotServing as i32);
        assert_eq!(asked().await, ServingStatus::NotServing as i32);
        assert!(rotation.is_leaving());
    }

    #[tokio::test(start_paused = true)]
    async fn a_watch_says_the_status_once_and_ends_at_the_stop() {
        let (stop, stopped) = watch::channel(false);
        let mut statuses = watch("", stopped);
        assert_eq!(said(&mut statuses).await, ServingStatus::Serving as i32);
        // Unchanged: nothing more, however long it runs.
        let more = tokio::time::timeout(WATCH_EVERY * 10, statuses.next()).await;
        assert!(more.is_err(), "{more:?}");
        stop.send(true).expect("watched");
        assert!(statuses.next().await.is_none());
    }

    #[test]
    fn an_unknown_service_is_said_unknown_and_a_watch_ends_without_a_server() {
        // On a thread of its own: a stream that spins instead of ending never gives its thread
        // back, and the test must fail, not hang.
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()
                .expect("runtime");
            let end = runtime.block_on(async {
                let (stop, stopped) = watch::channel(false);
                let mut statuses = watch("no.such.Service", stopped);
                let first = statuses.next().await.expect("a status").expect("ok");
                assert_eq!(first.status, ServingStatus::ServiceUnknown as i32);
                // The stop's sender dropped without a stop: the stream ends.
                drop(stop);
                statuses.next().await.is_none()
            });
            let _ = done.send(end);
        });
        let ended = finished
            .recv_timeout(Duration::from_secs(10))
            .expect("the watch ended instead of spinning");
        assert!(ended);
    }
}
