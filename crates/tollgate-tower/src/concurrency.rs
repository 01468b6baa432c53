//! A per-key concurrency limit in front of a tower service: at most N requests in flight per
//! key, in this process.
//!
//! A rate limit bounds how often a key may call; it does nothing for a backend whose cost is
//! the time a request is held (a slow export, a database connection). This layer holds a lease
//! from [`MemoryLeases`] for each admitted request and gives it back when the response is
//! ready, so a key with N requests in flight is refused a further one at once with a 429 (or
//! `RESOURCE_EXHAUSTED` for gRPC), never queued.
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
use tollgate::{Clock, LeaseLimit, LeaseTake, MemoryLeases, MonotonicClock};
use tower_layer::Layer;
use tower_service::Service;

use crate::error::Error;
use crate::extract::{KeyExtractor, MissingKey, RequestHead};
use crate::future::ResponseBody;
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
        }
    }
}

/// Builds a [`ConcurrencyLayer`]: made by [`ConcurrencyLayer::builder`].
#[must_use]
pub struct ConcurrencyBuilder {
    name: Arc<str>,
    limit: LeaseLimit,
    key: Box<dyn KeyExtractor>,
    missing: MissingKey,
    clock: Arc<dyn Clock>,
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

    /// The layer.
    pub fn build(self) -> ConcurrencyLayer {
        ConcurrencyLayer {
            shared: Arc::new(Shared {
                name: self.name,
                limit: self.limit,
                key: self.key,
                missing: self.missing,
                leases: MemoryLeases::default(),
                clock: self.clock,
            }),
        }
    }
}

/// What every clone of the layer and its services share, for the life of the layer (and of
/// the last lease guard, which releases into it).
struct Shared {
    name: Arc<str>,
    limit: LeaseLimit,
    key: Box<dyn KeyExtractor>,
    missing: MissingKey,
    leases: MemoryLeases,
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
        let id = NEXT_LEASE.fetch_add(1, Ordering::Relaxed);
        let takes = [LeaseTake::new(&key, &self.limit)];
        let decided = self
            .leases
            .acquire(&takes, itoa::Buffer::new().format(id), self.clock.now());
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
}

/// The slot of one admitted request, given back when dropped: when its response is ready, or
/// when the response future is dropped unfinished (the client went away, a timeout fired).
/// Dropping is the only way out, so the release happens exactly once.
struct Lease {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let shared = &self.shared;
        let mut id = itoa::Buffer::new();
        let id = id.format(self.id);
        // `Ok(false)` (it had timed out already) needs nothing; an error could only be an
        // invalid id, which ours never is.
        if let Err(err) = shared.leases.release(id, shared.clock.now()) {
            tracing::error!(error = %err, "concurrency limit could not release a lease");
        }
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
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ConcurrencyFuture<S::Future, ResBody>;

    // Readiness is the inner service's alone: a full key is answered, never waited for.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let head = RequestHead::of(&request);
        match self.shared.admit(&head) {
            Admission::Admit(lease) => ConcurrencyFuture {
                kind: Kind::Called {
                    future: self.inner.call(request),
                    lease: Some(lease),
                },
            },
            Admission::Answer(response) => {
                let response = if is_grpc(&head) {
                    grpc_answer(response)
                } else {
                    response
                };
                ConcurrencyFuture {
                    kind: Kind::Answered {
                        response: Some(response.map(ResponseBody::denied)),
                    },
                }
            }
        }
    }
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
    pub struct ConcurrencyFuture<F, B> {
        #[pin]
        kind: Kind<F, B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B> {
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
    }
}

impl<F, B> std::fmt::Debug for ConcurrencyFuture<F, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.kind {
            Kind::Called { lease, .. } => match lease {
                Some(_) => "called, holding a slot",
                None => "completed",
            },
            Kind::Answered { .. } => "answered",
        };
        f.debug_struct("ConcurrencyFuture")
            .field("state", &state)
            .finish()
    }
}

impl<F, B, E> Future for ConcurrencyFuture<F, B>
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
        }
    }
}
