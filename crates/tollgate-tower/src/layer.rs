//! The layer and its builders: where a limiter is configured once and shared.
//!
//! [`TollgateLayer`] is cheap to clone and every service it makes, and every clone of those,
//! decides against one [`Arc`]-shared limiter (like tower's `GlobalConcurrencyLimitLayer`, and
//! unlike tower's own `RateLimit`, whose clones each get a fresh budget).

use std::sync::Arc;

use tollgate::{Clock, Limit, LocalStore, MonotonicClock};
use tollgate_policy::PolicyEngine;
use tower_layer::Layer;

use crate::error::Error;
use crate::extract::{KeyExtractor, MissingKey, RequestHead};
use crate::headers::HeaderStyle;
use crate::limiter::{CostFn, Descriptor, Limiter, Policy, Shared, Single, SingleStore};
use crate::service::Tollgate;

/// Puts tollgate in front of a service: see the [crate docs](crate).
#[derive(Clone)]
pub struct TollgateLayer {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for TollgateLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.shared.limiter {
            Limiter::Single(single) => format!("limit {} ({})", single.name, single.limit),
            Limiter::Policy(policy) => format!("policy, domain {}", policy.domain),
        };
        f.debug_struct("TollgateLayer")
            .field("limiter", &kind)
            .finish_non_exhaustive()
    }
}

impl<S> Layer<S> for TollgateLayer {
    type Service = Tollgate<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Tollgate::new(inner, Arc::clone(&self.shared))
    }
}

impl TollgateLayer {
    /// One limit, named `name` in the rate-limit headers, with a bucket per key that `key`
    /// extracts. Buckets live in this process's memory unless set otherwise.
    pub fn limit(name: impl Into<String>, limit: Limit, key: impl KeyExtractor) -> LimitBuilder {
        LimitBuilder {
            name: name.into().into(),
            limit,
            key: Box::new(key),
            missing: MissingKey::Reject,
            store: StoreChoice::Memory(Arc::new(MonotonicClock::new())),
            common: Common::default(),
        }
    }

    /// The limits of a policy: each request becomes `descriptors` in `domain`, and every limit
    /// of the policy in force that applies to them decides, all or nothing. Buckets live in the
    /// engine's memory unless set otherwise.
    ///
    /// The descriptor function reads the request head; an [`Error::MissingKey`] or
    /// [`Error::InvalidKey`] from it is answered 400.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use axum::{Router, body::Body, routing::post};
    /// use http::{Request, StatusCode};
    /// use tollgate_policy::{EngineOptions, PolicyEngine, compile};
    /// use tollgate_tower::{Error, RequestHead, TollgateLayer};
    /// use tower::ServiceExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let policy = compile("inline.yaml", r#"
    /// version: "1"
    /// limits:
    ///   - name: payments-per-user
    ///     domain: api
    ///     when: {method: POST}
    ///     key: [user]
    ///     capacity: 1
    ///     refill: 1/m
    /// "#)?;
    /// let engine = Arc::new(PolicyEngine::new(policy, EngineOptions::default()));
    /// // One descriptor per request: the user (from a header set by the auth proxy) and the
    /// // method.
    /// let layer = TollgateLayer::policy(engine, "api", |head: &RequestHead<'_>| {
    ///     let user = head.header("x-user-id").ok_or_else(|| Error::MissingKey {
    ///         what: "header x-user-id".into(),
    ///     })?;
    ///     Ok(vec![vec![
    ///         ("user".to_owned(), user.to_owned()),
    ///         ("method".to_owned(), head.method.to_string()),
    ///     ]])
    /// })
    /// .build();
    /// let app = Router::new().route("/pay", post(|| async { "paid" })).layer(layer);
    ///
    /// let pay = || Request::post("/pay").header("x-user-id", "u1").body(Body::empty()).unwrap();
    /// assert_eq!(app.clone().oneshot(pay()).await?.status(), StatusCode::OK);
    /// let denied = app.clone().oneshot(pay()).await?;
    /// assert_eq!(denied.status(), StatusCode::TOO_MANY_REQUESTS);
    /// assert_eq!(denied.headers()["retry-after"], "60");
    /// # Ok(())
    /// # }
    /// ```
    pub fn policy<F>(
        engine: Arc<PolicyEngine>,
        domain: impl Into<String>,
        descriptors: F,
    ) -> PolicyBuilder
    where
        F: Fn(&RequestHead<'_>) -> Result<Vec<Descriptor>, Error> + Send + Sync + 'static,
    {
        PolicyBuilder {
            engine,
            domain: domain.into(),
            descriptors: Box::new(descriptors),
            #[cfg(feature = "redis")]
            redis: None,
            common: Common::default(),
        }
    }
}

/// Options every layer has.
struct Common {
    cost: Option<CostFn>,
    headers_on_success: bool,
    header_style: HeaderStyle,
    reservations: bool,
}

impl Default for Common {
    fn default() -> Self {
        Self {
            cost: None,
            headers_on_success: true,
            header_style: HeaderStyle::default(),
            reservations: false,
        }
    }
}

enum StoreChoice {
    Memory(Arc<dyn Clock>),
    #[cfg(feature = "redis")]
    // Boxed: a store is large, and the common case is memory.
    Redis(Box<tollgate_redis::RedisStore>, tollgate_redis::FailureMode),
}

/// Builds a [`TollgateLayer`] over one limit: made by [`TollgateLayer::limit`].
#[must_use]
pub struct LimitBuilder {
    name: Arc<str>,
    limit: Limit,
    key: Box<dyn KeyExtractor>,
    missing: MissingKey,
    store: StoreChoice,
    common: Common,
}

impl std::fmt::Debug for LimitBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LimitBuilder")
            .field("name", &self.name)
            .field("limit", &self.limit)
            .field("missing", &self.missing)
            .finish_non_exhaustive()
    }
}

impl LimitBuilder {
    /// What to do with a request whose key cannot be extracted (default:
    /// [`MissingKey::Reject`], a 400).
    pub fn on_missing_key(mut self, missing: MissingKey) -> Self {
        self.missing = missing;
        self
    }

    /// The clock of the in-memory buckets (default [`MonotonicClock`]; tests pass a
    /// [`tollgate::ManualClock`]).
    pub fn clock(mut self, clock: impl Clock + 'static) -> Self {
        self.store = StoreChoice::Memory(Arc::new(clock));
        self
    }

    /// Buckets in a shared Redis, so that every process sharing it shares the limit. When
    /// Redis cannot decide, the limit follows `on_failure`: fail closed (503) or decide on a
    /// local emergency budget per key.
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::get};
    /// use http::{Request, StatusCode};
    /// use tollgate::Limit;
    /// use tollgate_redis::{FailureMode, RedisConfig, RedisStore};
    /// use tollgate_tower::{Global, TollgateLayer};
    /// use tower::ServiceExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let server = tollgate_redis::test_server::RedisServer::start();
    /// # let url = server.url();
    /// let store = RedisStore::connect(&url, RedisConfig::default()).await?;
    /// let layer = TollgateLayer::limit("global", Limit::new(100, "100/s".parse()?)?, Global)
    ///     // While Redis is unreachable, each process admits up to 10 a second on its own.
    ///     .redis(store, FailureMode::Open { emergency: Limit::new(10, "10/s".parse()?)? })
    ///     .build();
    /// let app = Router::new().route("/", get(|| async { "hello" })).layer(layer);
    /// let response = app.oneshot(Request::get("/").body(Body::empty())?).await?;
    /// assert_eq!(response.status(), StatusCode::OK);
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(feature = "redis")]
    pub fn redis(
        mut self,
        store: tollgate_redis::RedisStore,
        on_failure: tollgate_redis::FailureMode,
    ) -> Self {
        self.store = StoreChoice::Redis(Box::new(store), on_failure);
        self
    }

    /// The cost of each request (default 1). A cost of 0 lets the request through unchecked;
    /// one above the limit's capacity can never pass and is answered 400.
    pub fn cost(mut self, cost: impl Fn(&RequestHead<'_>) -> u64 + Send + Sync + 'static) -> Self {
        self.common.cost = Some(Box::new(cost));
        self
    }

    /// Whether admitted responses carry the rate-limit fields too
    /// (default true; 429s always do).
    pub fn headers_on_success(mut self, on: bool) -> Self {
        self.common.headers_on_success = on;
        self
    }

    /// Which rate-limit fields answers carry (default [`HeaderStyle::Ietf`]): the draft's,
    /// `X-RateLimit-*` for clients written against them, both, or none. `Retry-After` goes on
    /// every 429 a wait can lift.
    ///
    /// ```
    /// use axum::{Router, body::Body, routing::get};
    /// use http::Request;
    /// use tollgate::Limit;
    /// use tollgate_tower::{Global, HeaderStyle, TollgateLayer};
    /// use tower::ServiceExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let layer = TollgateLayer::limit("global", Limit::new(100, "10/s".parse()?)?, Global)
    ///     .rate_limit_headers(HeaderStyle::XRateLimit)
    ///     .build();
    /// let app = Router::new().route("/", get(|| async { "hello" })).layer(layer);
    /// let response = app.oneshot(Request::get("/").body(Body::empty())?).await?;
    /// assert_eq!(response.headers()["x-ratelimit-limit"], "100");
    /// assert_eq!(response.headers()["x-ratelimit-remaining"], "99");
    /// // Seconds from now until the bucket is full again, rounded up.
    /// assert_eq!(response.headers()["x-ratelimit-reset"], "1");
    /// assert!(response.headers().get("ratelimit").is_none());
    /// # Ok(())
    /// # }
    /// ```
    pub fn rate_limit_headers(mut self, style: HeaderStyle) -> Self {
        self.common.header_style = style;
        self
    }

    /// Makes every admitted request a reservation: charged its cost as the most it may cost,
    /// with a [`Reservation`](crate::Reservation) in its extensions that the handler settles
    /// for what it used, giving the rest back. Each check then keeps a record for its
    /// settlement, for the store's idempotency window (a Redis record is one more key per
    /// request): settle within it.
    pub fn reservations(mut self) -> Self {
        self.common.reservations = true;
        self
    }

    /// The layer.
    pub fn build(self) -> TollgateLayer {
        let store = match self.store {
            StoreChoice::Memory(clock) => SingleStore::Memory(LocalStore::new(clock)),
            #[cfg(feature = "redis")]
            StoreChoice::Redis(store, on_failure) => SingleStore::Redis {
                failover: Box::new(tollgate_redis::Failover::new(*store)),
                on_failure,
            },
        };
        TollgateLayer {
            shared: Arc::new(Shared {
                limiter: Limiter::Single(Single {
                    policy_field: crate::headers::rate_limit_policy_value([(
                        &*self.name,
                        &self.limit,
                    )]),
                    name: self.name,
                    limit: self.limit,
                    key: self.key,
                    missing: self.missing,
                    store,
                }),
                cost: self.common.cost,
                headers_on_success: self.common.headers_on_success,
                header_style: self.common.header_style,
                reservations: self.common.reservations,
            }),
        }
    }
}

/// Builds a [`TollgateLayer`] over a policy: made by [`TollgateLayer::policy`].
#[must_use]
pub struct PolicyBuilder {
    engine: Arc<PolicyEngine>,
    domain: String,
    descriptors: crate::limiter::DescriptorFn,
    #[cfg(feature = "redis")]
    redis: Option<Box<tollgate_redis::RedisStore>>,
    common: Common,
}

impl std::fmt::Debug for PolicyBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyBuilder")
            .field("domain", &self.domain)
            .finish_non_exhaustive()
    }
}

impl PolicyBuilder {
    /// Buckets in a shared Redis rather than the engine's memory. When Redis cannot decide,
    /// each limit follows its `failure_mode` in the policy: `closed` answers 503, `open`
    /// decides on the limit's local emergency budget.
    #[cfg(feature = "redis")]
    pub fn redis(mut self, store: tollgate_redis::RedisStore) -> Self {
        self.redis = Some(Box::new(store));
        self
    }

    /// The cost of each request (default 1). A cost of 0 lets the request through unchecked;
    /// one above an applicable limit's capacity can never pass and is answered 400.
    pub fn cost(mut self, cost: impl Fn(&RequestHead<'_>) -> u64 + Send + Sync + 'static) -> Self {
        self.common.cost = Some(Box::new(cost));
        self
    }

    /// Whether admitted responses carry the rate-limit fields too
    /// (default true; 429s always do).
    pub fn headers_on_success(mut self, on: bool) -> Self {
        self.common.headers_on_success = on;
        self
    }

    /// Which rate-limit fields answers carry (default [`HeaderStyle::Ietf`]; see
    /// [`LimitBuilder::rate_limit_headers`]).
    pub fn rate_limit_headers(mut self, style: HeaderStyle) -> Self {
        self.common.header_style = style;
        self
    }

    /// Makes every admitted request a reservation: charged its cost as the most it may cost,
    /// with a [`Reservation`](crate::Reservation) in its extensions that the handler settles
    /// for what it used, giving the rest back. Each check then keeps a record for its
    /// settlement, for the store's idempotency window (a Redis record is one more key per
    /// request): settle within it.
    pub fn reservations(mut self) -> Self {
        self.common.reservations = true;
        self
    }

    /// The layer.
    pub fn build(self) -> TollgateLayer {
        TollgateLayer {
            shared: Arc::new(Shared {
                limiter: Limiter::Policy(Policy {
                    engine: self.engine,
                    domain: self.domain,
                    descriptors: self.descriptors,
                    #[cfg(feature = "redis")]
                    redis: self.redis,
                }),
                cost: self.common.cost,
                headers_on_success: self.common.headers_on_success,
                header_style: self.common.header_style,
                reservations: self.common.reservations,
            }),
        }
    }
}
