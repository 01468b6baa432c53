//! Reservations: requests charged the most they may cost, settled for what they used.
//!
//! A handler whose cost is known only once it has worked (the tokens a model produced, the
//! bytes it streamed) cannot be charged its real cost up front. With
//! [`LimitBuilder::reservations`](crate::LimitBuilder::reservations) (or the policy builder's),
//! the layer charges what the cost function says as the most the request may cost, under a
//! request id of its own, and hands the handler a [`Reservation`] in the request's extensions;
//! the handler settles it when it knows, and the rest goes back to the buckets
//! ([`tollgate::Store::settle`]). A reservation never settled keeps its whole cost: nothing is
//! given back late, and nothing is over-admitted.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tollgate::{CheckRequest, SettleStatus, Take};

use crate::error::Error;
use crate::limiter::{Descriptor, Limiter, Shared, SingleStore};

/// What a request was charged, to be settled once its real cost is known: found in the
/// request's extensions when the layer was built with reservations. Cloning it shares it.
///
/// ```
/// use axum::{Extension, Router, body::Body, routing::post};
/// use http::{Request, StatusCode, header::HeaderName};
/// use tollgate::Limit;
/// use tollgate_tower::{Header, Reservation, TollgateLayer};
/// use tower::ServiceExt;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // 1,000 tokens per key, a request reserving 800, the most an answer may take.
/// let layer = TollgateLayer::limit(
///     "tokens",
///     Limit::new(1000, "1000/h".parse()?)?,
///     Header::new(HeaderName::from_static("x-api-key")),
/// )
/// .cost(|_| 800)
/// .reservations()
/// .build();
/// let answer = |Extension(reservation): Extension<Reservation>| async move {
///     let used = 150; // what the work turned out to cost
///     reservation.settle(used).await.map_or("not settled", |_| "answered")
/// };
/// let app = Router::new().route("/ask", post(answer)).layer(layer);
///
/// let ask = || Request::post("/ask").header("x-api-key", "k").body(Body::empty()).unwrap();
/// // 800 reserved, 650 given back: 850 left, so a second one fits (700 left after it);
/// // without the settlement, it would not.
/// for _ in 0..2 {
///     assert_eq!(app.clone().oneshot(ask()).await?.status(), StatusCode::OK);
/// }
/// assert_eq!(app.clone().oneshot(ask()).await?.status(), StatusCode::TOO_MANY_REQUESTS);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Reservation {
    inner: Arc<Inner>,
}

struct Inner {
    shared: Arc<Shared>,
    reserved: Reserved,
    cost: u64,
    request_id: String,
}

/// What the check charged.
pub(crate) enum Reserved {
    /// One limit's bucket at this store key.
    Single(String),
    /// A policy's limits, through these descriptors.
    Policy(Vec<Descriptor>),
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation")
            .field("cost", &self.inner.cost)
            .field("request_id", &self.inner.request_id)
            .finish_non_exhaustive()
    }
}

impl Reservation {
    pub(crate) fn new(shared: Arc<Shared>, reserved: Reserved, cost: u64, id: String) -> Self {
        Self {
            inner: Arc::new(Inner {
                shared,
                reserved,
                cost,
                request_id: id,
            }),
        }
    }

    /// What the request was charged: the most it may cost.
    pub fn cost(&self) -> u64 {
        self.inner.cost
    }

    /// Settles the reservation for `used` (at most [`cost`](Self::cost)): `cost - used` goes
    /// back to every bucket the request was charged on, once. Settling again with the same
    /// `used` gives nothing more ([`SettleStatus::Repeated`]); a reservation checked longer ago
    /// than the store's idempotency window, or decided on an emergency budget while a shared
    /// store was down, has no charge on record ([`SettleStatus::NotFound`]) and keeps it.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] or [`Error::Policy`]: `used` above the cost, settled before with
    /// another `used`, or the store could not answer (nothing given back).
    pub async fn settle(&self, used: u64) -> Result<SettleStatus, Error> {
        let Inner {
            shared,
            reserved,
            cost,
            request_id,
        } = &*self.inner;
        if used > *cost {
            return Err(Error::Store(tollgate::Error::InvalidSettlement {
                reason: "a request cannot have used more than it reserved",
            }));
        }
        let refund = [cost - used];
        match (&shared.limiter, reserved) {
            (Limiter::Single(single), Reserved::Single(key)) => {
                let takes = [Take::new(key, &single.limit, *cost)];
                let request = CheckRequest {
                    takes: &takes,
                    request_id: Some(request_id),
                    now: None,
                };
                let settled = match &single.store {
                    SingleStore::Memory(store) => store.settle_now(request, &refund),
                    #[cfg(feature = "redis")]
                    SingleStore::Redis { failover, .. } => {
                        use tollgate::Store as _;
                        failover.store().settle(request, &refund).await
                    }
                };
                Ok(settled?.status)
            }
            (Limiter::Policy(policy), Reserved::Policy(descriptors)) => {
                #[cfg(feature = "redis")]
                if let Some(store) = &policy.redis {
                    let outcome = policy
                        .engine
                        .settle_on(
                            &**store,
                            &policy.domain,
                            descriptors,
                            *cost,
                            used,
                            request_id,
                        )
                        .await?;
                    return Ok(outcome.settled.unwrap_or(SettleStatus::NotFound));
                }
                let outcome =
                    policy
                        .engine
                        .settle(&policy.domain, descriptors, *cost, used, request_id)?;
                Ok(outcome.settled.unwrap_or(SettleStatus::NotFound))
            }
            // A reservation is made by the limiter it settles with.
            _ => Ok(SettleStatus::NotFound),
        }
    }
}

/// Request ids for reservations: unique within the process (counted) and across processes
/// sharing a store (a random prefix per process).
pub(crate) fn next_id() -> String {
    use std::hash::{BuildHasher, RandomState};
    use std::sync::LazyLock;
    static PROCESS: LazyLock<u64> = LazyLock::new(|| RandomState::new().hash_one(0x7e5e_7a71_u64));
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "reservation-{:016x}-{}",
        *PROCESS,
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}
