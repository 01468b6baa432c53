//! A per-key concurrency limit in front of a tower service: at most N requests in flight per
//! key, in this process, or across every process sharing a Redis (the `redis` feature).
//!
//! A rate limit bounds how often a key may call; it does nothing for a backend whose cost is
//! the time a request is held (a slow export, a database connection). This layer holds a lease
//! for each admitted request, from a [`MemoryLeases`] table or a shared [`LeaseStore`], and
//! gives it back when the response is ready, so a key with N requests in flight is refused a
//! further one at once with a 429 (or `RESOURCE_EXHAUSTED` for gRPC), never queued.
//!
//! On Redis, acquiring waits for the store (bounded by its timeout), and a release is sent
//! from a task spawned on the current Tokio runtime when the request ends, so that dropping a
//! response future never blocks. A release that cannot be sent (no runtime, the store down)
//! leaves the lease to time out. While Redis cannot answer, requests follow the layer's
//! [`LeaseFailure`]: a 503, or a per-process emergency table.
//!
//! It is its own layer, service and future rather than a mode of [`TollgateLayer`]: the rate
//! limit decides once and forgets the request, while this one must follow each admitted
//! request to its end, which only a future that owns a release guard can do.
//!
//! [`TollgateLayer`]: crate::TollgateLayer

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use pin_project_lite::pin_project;
#[cfg(feature = "redis")]
use tollgate::LeaseStore;
use tollgate::{Clock, LeaseDecision, LeaseLimit, LeaseTake, MemoryLeases, MonotonicClock};
use tower_layer::Layer;
use tower_service::Service;

use crate::error::Error;
use crate::extract::{KeyExtractor, MissingKey, RequestHead};
use crate::future::{BoxResponseFuture, ResponseBody};
use crate::headers::ceil_secs;
use crate::limiter::{error_response, for_grpc, is_grpc, quota_exceeded};

/// Limits how many requests each key has in flight at once: see the [crate docs](crate).
///
/// Cheap to clone: the layer, every service it makes and every clone of those count against
/// one lease table, so cloning never hands out fresh slots.
#[derive(Clone)]
pub struct ConcurrencyLayer {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ConcurrencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConcurrencyLayer")
            .field("name", &self.shared.name)
            .field("limit", &self.shared.limit)
            .field("missing", &self.shared.missing)
            .finish_non_exhaustive()
    }
}

impl<S> Layer<S> for ConcurrencyLayer {
    type Service = Concurrency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Concurrency {
            inner,
            shared: Arc::clone(&self.shared),
        }
    }
}

impl ConcurrencyLayer {
    /// At most `limit.max_in_flight()` requests in flight per key that `key` extracts, named
    /// `name` in 429s; a request without a key is answered 400 ([`MissingKey::Reject`]), and
    /// time is read from a [`MonotonicClock`]. [`ConcurrencyLayer::builder`] changes those.
    pub fn new(name: impl Into<String>, limit: LeaseLimit, key: impl KeyExtractor) -> Self {
        Self::builder(name, limit, key).build()
    }

    /// As [`ConcurrencyLayer::new`], with options.
    pub fn builder(
        name: impl Into<String>,
        limit: LeaseLimit,
        key: impl KeyExtractor,
    ) -> ConcurrencyBuilder {
        ConcurrencyBuilder {
            name: name.into().into(),
            limit,
            key: Box::new(key),
            missing: MissingKey::Reject,
            clock: Arc::new(MonotonicClock::new()),
            #[cfg(feature = "redis")]
            redis: None,
        }
    }
}

/// What a Redis-backed [`ConcurrencyLayer`] does while Redis cannot answer (down, slow past
/// its timeout, its circuit breaker open).
#[cfg(feature = "redis")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseFailure {
    /// Answer 503 (gRPC `UNAVAILABLE`): distinct from a full key's 429.
    Closed,
    /// Admit up to `emergency` requests in flight per key in this process, in a table of its
    /// own that the Redis leases never see; never unlimited.
    Open {
        /// The per-process bound.
        emergency: LeaseLimit,
    },
}

/// Builds a [`ConcurrencyLayer`]: made by [`ConcurrencyLayer::builder`].
#[must_use]
pub struct ConcurrencyBuilder {
    name: Arc<str>,
    limit: LeaseLimit,
    key: Box<dyn KeyExtractor>,
    missing: MissingKey,
    clock: Arc<dyn Clock>,
    #[cfg(feature = "redis")]
    redis: Option<(tollgate_redis::RedisStore, LeaseFailure)>,
}

impl std::fmt::Debug for ConcurrencyBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConcurrencyBuilder")
            .field("name", &self.name)
            .field("limit", &self.limit)
            .field("missing", &self.missing)
            .finish_non_exhaustive()
    }
}

impl ConcurrencyBuilder {
    /// What to do with a request whose key cannot be extracted (default:
    /// [`MissingKey::Reject`], a 400). With [`MissingKey::Fallback`], every such request
    /// shares the fallback key's slots.
    pub fn on_missing_key(mut self, missing: MissingKey) -> Self {
        self.missing = missing;
        self
    }

    /// The clock that times leases out (default [`MonotonicClock`]; tests pass a
    /// [`tollgate::ManualClock`]).
    pub fn clock(mut self, clock: impl Clock + 'static) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Counts leases in `store`, shared by every process (and every layer of the same name)
    /// pointed at it, on Redis' clock; while it cannot answer, requests follow `on_failure`.
    /// The service then needs a Tokio runtime, to wait on Redis and to send releases.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use http::header::HeaderName;
    /// use tollgate::LeaseLimit;
    /// use tollgate_redis::{RedisConfig, RedisStore};
    /// use tollgate_tower::{ConcurrencyLayer, Header, LeaseFailure};
    ///
    /// let store = RedisStore::connect("redis://127.0.0.1:6379", RedisConfig::default()).await?;
    /// let limit = LeaseLimit::new(4, Duration::from_secs(30))?;
    /// let emergency = LeaseLimit::new(1, Duration::from_secs(30))?;
    /// let layer = ConcurrencyLayer::builder("exports", limit, Header::new(HeaderName::from_static("x-tenant")))
    ///     .redis(store, LeaseFailure::Open { emergency })
    ///     .build();
    /// # let _ = layer;
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(feature = "redis")]
    pub fn redis(mut self, store: tollgate_redis::RedisStore, on_failure: LeaseFailure) -> Self {
        self.redis = Some((store, on_failure));
        self
    }

    /// The layer.
    pub fn build(self) -> ConcurrencyLayer {
        #[cfg(feature = "redis")]
        let leases = match self.redis {
            Some((store, on_failure)) => Leases::Redis(Box::new(RedisLeases {
                store,
                on_failure,
                emergency: MemoryLeases::default(),
            })),
            None => Leases::Memory(MemoryLeases::default()),
        };
        #[cfg(not(feature = "redis"))]
        let leases = Leases::Memory(MemoryLeases::default());
        ConcurrencyLayer {
            shared: Arc::new(Shared {
                name: self.name,
                limit: self.limit,
                key: self.key,
                missing: self.missing,
                leases,
                clock: self.clock,
            }),
        }
    }
}

/// Where a layer's leases are counted.
enum Leases {
    /// In this process.
    Memory(MemoryLeases),
    /// In Redis, shared.
    #[cfg(feature = "redis")]
    Redis(Box<RedisLeases>),
}

#[cfg(feature = "redis")]
struct RedisLeases {
    store: tollgate_redis::RedisStore,
    on_failure: LeaseFailure,
    /// Leases taken while Redis could not answer, under `on_failure`'s emergency bound.
    emergency: MemoryLeases,
}

/// What every clone of the layer and its services share, for the life of the layer (and of
/// the last lease guard, which releases into it).
struct Shared {
    name: Arc<str>,
    limit: LeaseLimit,
    key: Box<dyn KeyExtractor>,
    missing: MissingKey,
    leases: Leases,
    clock: Arc<dyn Clock>,
}

/// Lease ids, unique in the process. One table per layer would only need them unique per
/// layer, but a process-wide counter costs the same and stays right if tables are ever shared.
static NEXT_LEASE: AtomicU64 = AtomicU64::new(0);

/// What to do with a request.
enum Admission {
    /// Call the service; the guard holds the request's slot.
    Admit(Lease),
    /// Answer this instead.
    Answer(Response<Bytes>),
    /// Ask the shared store first, for this key.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    Ask(Box<str>),
}

/// Which table holds a lease, for its release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Table {
    /// The memory table of a layer without Redis.
    Memory,
    /// The emergency table of a Redis-backed layer, whose store could not answer.
    #[cfg(feature = "redis")]
    Emergency,
    /// Redis.
    #[cfg(feature = "redis")]
    Redis,
}

impl Shared {
    fn admit(self: &Arc<Self>, head: &RequestHead<'_>) -> Admission {
        let key = match self.key.extract(head) {
            Ok(key) => key,
            Err(err) => match &self.missing {
                MissingKey::Fallback(key) => key.as_str().into(),
                _ => return Admission::Answer(error_response(&err)),
            },
        };
        match &self.leases {
            Leases::Memory(table) => self.admit_in(table, Table::Memory, &key, &self.limit),
            // The limit's name keeps two layers on one store apart.
            #[cfg(feature = "redis")]
            Leases::Redis(_) => Admission::Ask(format!("{}|{key}", self.name).into()),
        }
    }

    /// Decides `key` in an in-process `table` under `limit`.
    fn admit_in(
        self: &Arc<Self>,
        table: &MemoryLeases,
        kind: Table,
        key: &str,
        limit: &LeaseLimit,
    ) -> Admission {
        let id = NEXT_LEASE.fetch_add(1, Ordering::Relaxed);
        let takes = [LeaseTake::new(key, limit)];
        let decided = table.acquire(&takes, itoa::Buffer::new().format(id), self.clock.now());
        self.admission(decided, kind, id)
    }

    /// The admission a store's answer makes: `decided` for the lease numbered `id` in `table`.
    fn admission(
        self: &Arc<Self>,
        decided: Result<Vec<LeaseDecision>, tollgate::Error>,
        table: Table,
        id: u64,
    ) -> Admission {
        let decisions = match decided {
            Ok(decisions) => decisions,
            // The table is full (`TooManyLeases`): answered 500 and logged, like any store
            // refusal, rather than admitted past the limit.
            Err(err) => return Admission::Answer(error_response(&Error::Store(err))),
        };
        match decisions.as_slice() {
            [decision] if decision.allowed() => Admission::Admit(Lease {
                shared: Arc::clone(self),
                id,
                table,
            }),
            [decision] => {
                // When the oldest lease times out: the latest a slot frees itself (a release
                // may free one sooner). Rounded up, so the client never comes back before it.
                let retry = decision.retry_after().map(|wait| ceil_secs(wait).max(1));
                Admission::Answer(quota_exceeded([&*self.name], retry))
            }
            // One take gives one decision; anything else is a store fault.
            _ => Admission::Answer(error_response(&Error::Store(tollgate::Error::EmptyCheck))),
        }
    }

    /// Decides `key` in Redis, or, when Redis cannot answer, by the layer's failure mode.
    #[cfg(feature = "redis")]
    async fn admit_shared(self: &Arc<Self>, key: &str) -> Admission {
        let Leases::Redis(redis) = &self.leases else {
            return self.admit_in_memory(key);
        };
        let id = NEXT_LEASE.fetch_add(1, Ordering::Relaxed);
        let lease_id = shared_id(id);
        let takes = [LeaseTake::new(key, &self.limit)];
        let request = tollgate::LeaseRequest {
            takes: &takes,
            lease_id: &lease_id,
            now: None,
        };
        match redis.store.acquire(request).await {
            Err(tollgate::Error::StoreUnavailable { reason }) => match redis.on_failure {
                LeaseFailure::Closed => {
                    tracing::warn!(
                        limit = %self.name,
                        reason = reason.as_str(),
                        "concurrency store unavailable: request denied (fails closed)"
                    );
                    Admission::Answer(crate::limiter::unavailable_problem(&format!(
                        "concurrency limiting unavailable: {}",
                        reason.as_str()
                    )))
                }
                LeaseFailure::Open { emergency } => {
                    tracing::warn!(
                        limit = %self.name,
                        reason = reason.as_str(),
                        "concurrency store unavailable: deciding on the emergency bound"
                    );
                    self.admit_in(&redis.emergency, Table::Emergency, key, &emergency)
                }
            },
            decided => self.admission(decided, Table::Redis, id),
        }
    }

    #[cfg(feature = "redis")]
    fn admit_in_memory(self: &Arc<Self>, key: &str) -> Admission {
        match &self.leases {
            Leases::Memory(table) => self.admit_in(table, Table::Memory, key, &self.limit),
            Leases::Redis(_) => {
                Admission::Answer(error_response(&Error::Store(tollgate::Error::EmptyCheck)))
            }
        }
    }
}

/// A Redis lease id: unique across processes (a random 64-bit prefix drawn once per process,
/// then the process's counter), so that two processes never hold the same id.
#[cfg(feature = "redis")]
fn shared_id(id: u64) -> String {
    use std::hash::{BuildHasher, RandomState};
    use std::sync::LazyLock;
    static PROCESS: LazyLock<u64> =
        LazyLock::new(|| RandomState::new().hash_one(0x70_11_6a_7e_u64));
    format!("{:016x}-{id}", *PROCESS)
}

/// The slot of one admitted request, given back when dropped: when its response is ready, or
/// when the response future is dropped unfinished (the client went away, a timeout fired).
/// Dropping is the only way out, so the release happens exactly once.
struct Lease {
    shared: Arc<Shared>,
    id: u64,
    table: Table,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let shared = &self.shared;
        let table = match (&shared.leases, self.table) {
            (Leases::Memory(table), _) => table,
            #[cfg(feature = "redis")]
            (Leases::Redis(redis), Table::Emergency) => &redis.emergency,
            #[cfg(feature = "redis")]
            (Leases::Redis(_), _) => return self.release_shared(),
        };
        let mut id = itoa::Buffer::new();
        let id = id.format(self.id);
        // `Ok(false)` (it had timed out already) needs nothing; an error could only be an
        // invalid id, which ours never is.
        if let Err(err) = table.release(id, shared.clock.now()) {
            tracing::error!(error = %err, "concurrency limit could not release a lease");
        }
    }
}

#[cfg(feature = "redis")]
impl Lease {
    /// Sends the release to Redis from a task of its own: a drop cannot wait. Without a
    /// runtime, or with Redis down, the lease times out instead (its slot comes back then).
    fn release_shared(&self) {
        let shared = Arc::clone(&self.shared);
        let id = shared_id(self.id);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                limit = %shared.name,
                "concurrency lease not released (no Tokio runtime): it times out"
            );
            return;
        };
        runtime.spawn(async move {
            let Leases::Redis(redis) = &shared.leases else {
                return;
            };
            if let Err(err) = redis.store.release(&id, None).await {
                tracing::warn!(
                    limit = %shared.name,
                    error = %err,
                    "concurrency lease not released: it times out"
                );
            }
        });
    }
}

/// A service behind a concurrency limit: made by [`ConcurrencyLayer`]. Every clone shares the
/// layer's slots.
pub struct Concurrency<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S> Concurrency<S> {
    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The wrapped service, unwrapped.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone> Clone for Concurrency<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: std::fmt::Debug> std::fmt::Debug for Concurrency<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Concurrency")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Concurrency<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Send + 'static,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ConcurrencyFuture<S::Future, ResBody, S::Error>;

    // Readiness is the inner service's alone: a full key is answered, never waited for.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let head = RequestHead::of(&request);
        let grpc = is_grpc(&head);
        match self.shared.admit(&head) {
            Admission::Admit(lease) => ConcurrencyFuture {
                kind: Kind::Called {
                    future: self.inner.call(request),
                    lease: Some(lease),
                },
            },
            Admission::Answer(response) => ConcurrencyFuture::answered(response, grpc),
            #[cfg(feature = "redis")]
            Admission::Ask(key) => {
                // The service that was made ready goes into the future; this one keeps a
                // fresh clone, which is polled ready before its own next call.
                let clone = self.inner.clone();
                let mut inner = std::mem::replace(&mut self.inner, clone);
                let shared = Arc::clone(&self.shared);
                ConcurrencyFuture {
                    kind: Kind::Deciding {
                        future: Box::pin(async move {
                            match shared.admit_shared(&key).await {
                                Admission::Admit(lease) => {
                                    let response = inner.call(request).await;
                                    // The request is over, answered or failed: its slot goes
                                    // back now.
                                    drop(lease);
                                    response.map(|response| response.map(ResponseBody::inner))
                                }
                                Admission::Answer(response) => Ok(answer(response, grpc)),
                                Admission::Ask(_) => Ok(answer(
                                    error_response(&Error::Store(tollgate::Error::EmptyCheck)),
                                    grpc,
                                )),
                            }
                        }),
                    },
                }
            }
            #[cfg(not(feature = "redis"))]
            Admission::Ask(_) => ConcurrencyFuture::answered(
                error_response(&Error::Store(tollgate::Error::EmptyCheck)),
                grpc,
            ),
        }
    }
}

/// The layer's own answer, in gRPC's form for a gRPC request.
fn answer<B>(response: Response<Bytes>, grpc: bool) -> Response<ResponseBody<B>> {
    let response = if grpc {
        grpc_answer(response)
    } else {
        response
    };
    response.map(ResponseBody::denied)
}

/// The gRPC form of an answer, with a message that says which limit it is: a client seeing
/// `RESOURCE_EXHAUSTED` should know that waiting for its own calls to end is what helps.
fn grpc_answer(response: Response<Bytes>) -> Response<Bytes> {
    let too_many = response.status() == http::StatusCode::TOO_MANY_REQUESTS;
    let mut response = for_grpc(response);
    if too_many {
        response.headers_mut().insert(
            "grpc-message",
            HeaderValue::from_static("too many requests in flight"),
        );
    }
    response
}

pin_project! {
    /// The future of [`Concurrency`]'s response.
    ///
    /// An admitted request holds its slot until this future completes (with the inner
    /// service's response or error) or is dropped. The slot is therefore held until the
    /// response *head* is ready, not while its body streams, as with tower's own
    /// `ConcurrencyLimit`. A request that runs longer than the limit's lease timeout loses its
    /// slot to the timeout (the guard against leaked slots), and another request may then be
    /// admitted while it still runs.
    ///
    /// # Panics
    ///
    /// When a refused request's future is polled again after it completed, like most futures.
    pub struct ConcurrencyFuture<F, B, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B, E> {
        // Admitted: the inner service is answering, under `lease`.
        Called {
            #[pin]
            future: F,
            lease: Option<Lease>,
        },
        // Answered by the layer (a full key, a missing key).
        Answered {
            response: Option<Response<ResponseBody<B>>>,
        },
        // Waiting on the shared store, then on the inner service under the lease it gave.
        Deciding {
            future: BoxResponseFuture<B, E>,
        },
    }
}

impl<F, B, E> ConcurrencyFuture<F, B, E> {
    fn answered(response: Response<Bytes>, grpc: bool) -> Self {
        Self {
            kind: Kind::Answered {
                response: Some(answer(response, grpc)),
            },
        }
    }
}

impl<F, B, E> std::fmt::Debug for ConcurrencyFuture<F, B, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.kind {
            Kind::Called { lease, .. } => match lease {
                Some(_) => "called, holding a slot",
                None => "completed",
            },
            Kind::Answered { .. } => "answered",
            Kind::Deciding { .. } => "deciding",
        };
        f.debug_struct("ConcurrencyFuture")
            .field("state", &state)
            .finish()
    }
}

impl<F, B, E> Future for ConcurrencyFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Called { future, lease } => {
                let result = ready!(future.poll(cx));
                // Ok or Err, the request is over: free its slot now rather than whenever the
                // caller drops this future.
                drop(lease.take());
                Poll::Ready(result.map(|response| response.map(ResponseBody::inner)))
            }
            KindProj::Answered { response } => Poll::Ready(Ok(response
                .take()
                .expect("ConcurrencyFuture polled after completion"))),
            KindProj::Deciding { future } => future.as_mut().poll(cx),
        }
    }
}
