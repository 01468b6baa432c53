//! Where every API's decision is made: the policy in force, against the configured store.
//!
//! The HTTP, forward-auth and gRPC front ends all call [`Decider::decide`], so they answer the
//! same request the same way. With the memory store the policy engine decides against its own
//! buckets; with Redis it decides against the shared store, and when Redis cannot answer
//! (down, slow, breaker open) each limit follows its failure mode through
//! [`PolicyEngine::decide_degraded`].

use std::sync::Arc;
use std::time::Duration;

use tollgate::{Clock, Error as CoreError, Limit, MonotonicClock, Store, Unavailable};
use tollgate_policy::{
    Costs, Descriptor, Error as PolicyError, LeaseOutcome, Outcome, Policy, PolicyEngine,
    ResetOutcome, ShadowAll, ShadowScope, UnixTime,
};
use tollgate_redis::RedisStore;

use crate::global::Shares;
use crate::hot_keys::{self, HotKeys};
use crate::metrics::{self, Api};
use crate::traces::Traces;

/// Where buckets live.
pub enum Backend {
    /// In this process (the policy engine's own store).
    Memory,
    /// In Redis or Redis Cluster, shared by every tollgate process pointed at it.
    Redis(Box<RedisStore>),
}

impl Backend {
    /// `memory` or `redis`, for metric labels.
    pub fn name(&self) -> &'static str {
        match self {
            Backend::Memory => "memory",
            Backend::Redis(_) => "redis",
        }
    }
}

/// One request, as every API hands it over. A descriptor `D` is a list of `(entry, value)`
/// pairs whose strings are owned, or borrowed from the request's own bytes where the front end
/// can (the JSON body's unescaped strings); or, from Envoy's RLS, a
/// [`RequestDescriptor`](tollgate_policy::RequestDescriptor) that may carry a limit.
pub struct Request<'a, D = Vec<(String, String)>> {
    /// The Envoy RLS domain (HTTP callers pass it too).
    pub domain: &'a str,
    /// Descriptors: entry → value lists.
    pub descriptors: &'a [D],
    /// Tokens per matched limit: one cost for every descriptor, or one per descriptor.
    pub cost: Costs<'a>,
    /// Makes a retry free.
    pub request_id: Option<&'a str>,
}

/// Why a request could not be decided.
#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    /// The request asks for something no limit can give (a cost above a capacity): the caller's
    /// to fix, answered 400.
    #[error("{0}")]
    Invalid(PolicyError),
    /// A fault on our side (a limit the store cannot represent), answered 500.
    #[error("{0}")]
    Internal(PolicyError),
    /// The store cannot answer and nothing was decided (an explanation needs the store).
    #[error("store unavailable: {0}")]
    Unavailable(Unavailable),
}

/// The busiest keys reported per limit unless told otherwise: none, because keys are made of
/// request values (user ids, addresses, API keys) that must not reach metrics unasked.
pub const DEFAULT_HOT_KEYS: usize = 0;

/// The decision maker shared by all front ends.
pub struct Decider {
    engine: Arc<PolicyEngine>,
    backend: Backend,
    /// Times decisions for the latency histogram.
    clock: MonotonicClock,
    /// The busiest bucket keys.
    hot_keys: HotKeys,
    /// The shares of global limits, with `--global-store`.
    global: Option<Arc<Shares>>,
    /// Where spans go, when decisions are written on the spans of the requests they answer
    /// and their waits on Redis get spans of their own.
    traces: Option<Arc<Traces>>,
}

impl Decider {
    /// Decides with `engine`'s policy against `backend`.
    pub fn new(engine: Arc<PolicyEngine>, backend: Backend) -> Self {
        Self {
            engine,
            backend,
            clock: MonotonicClock::new(),
            hot_keys: HotKeys::new(DEFAULT_HOT_KEYS, hot_keys::DEFAULT_WINDOW),
            global: None,
            traces: None,
        }
    }

    /// The same decider, writing what each decision said on the span of the request it
    /// answers (see [`crate::traces`]), and each wait on Redis in a span of its own, when
    /// `traces` are sent.
    #[must_use]
    pub fn with_traces(mut self, traces: Option<Arc<Traces>>) -> Self {
        self.traces = traces;
        self
    }

    /// The same decider, deciding the buckets of `scope: global` limits from `shares`.
    #[must_use]
    pub fn with_global(mut self, shares: Arc<Shares>) -> Self {
        self.global = Some(shares);
        self
    }

    /// The same decider, reporting each limit's `top` busiest keys of each `window` (0 keys:
    /// none, and nothing counted).
    #[must_use]
    pub fn with_hot_keys(mut self, top: usize, window: Duration) -> Self {
        self.hot_keys = HotKeys::new(top, window);
        self
    }

    /// The busiest bucket keys of its decisions.
    pub fn hot_keys(&self) -> &HotKeys {
        &self.hot_keys
    }

    /// Now, on the clock the hot keys' windows are measured by.
    pub fn now(&self) -> tollgate::Timestamp {
        self.clock.now()
    }

    /// The policy engine (for admin endpoints).
    pub fn engine(&self) -> &Arc<PolicyEngine> {
        &self.engine
    }

    /// The store.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// Whether the store can decide `limit` exactly: a limit that comes with a request (Envoy's
    /// `limit` action) was not checked when the policy was loaded, as the policy's own were.
    ///
    /// # Errors
    ///
    /// The store's reason, for a limit Redis' scripts cannot keep exactly.
    pub fn supports(&self, limit: &Limit) -> Result<(), CoreError> {
        match self.backend {
            Backend::Memory => Ok(()),
            Backend::Redis(_) => tollgate_redis::check_limit(limit),
        }
    }

    /// Decides `request`, charging the buckets it passes, and records the metrics.
    ///
    /// # Errors
    ///
    /// [`DecideError`] when the request cannot be decided at all.
    pub async fn decide<S: AsRef<str>, D: Descriptor<S>>(
        &self,
        api: Api,
        request: &Request<'_, D>,
    ) -> Result<Outcome, DecideError> {
        let started = self.clock.now();
        let outcome = self.run(request, true).await;
        let now = self.clock.now();
        metrics::record_decision(
            api,
            self.backend.name(),
            now.saturating_duration_since(started),
            &outcome,
        );
        if let Ok(outcome) = &outcome {
            self.hot_keys.record(now, outcome);
        }
        self.trace(request.domain, &outcome);
        outcome
    }

    /// Writes `outcome` on the span of the request it answers, when traces are sent.
    fn trace(&self, domain: &str, outcome: &Result<Outcome, DecideError>) {
        if self.traces.is_some() {
            match outcome {
                Ok(outcome) => crate::traces::record_outcome(domain, self.backend.name(), outcome),
                Err(err) => crate::traces::record_error(domain, err),
            }
        }
    }

    /// What [`decide`](Self::decide) would answer, charging nothing.
    ///
    /// # Errors
    ///
    /// As for `decide`.
    pub async fn explain<S: AsRef<str>, D: Descriptor<S>>(
        &self,
        request: &Request<'_, D>,
    ) -> Result<Outcome, DecideError> {
        self.run(request, false).await
    }

    /// What [`decide`](Self::decide) would answer, charging nothing, for a check that must be
    /// answered even while the store is down (Envoy's check-only `hits_addend: 0`): then each
    /// limit follows its failure mode, as in a degraded decision, without spending its
    /// emergency budget. An explanation, by contrast, has no balances to show without the store.
    ///
    /// # Errors
    ///
    /// As for `decide`.
    pub async fn check_only<S: AsRef<str>, D: Descriptor<S>>(
        &self,
        request: &Request<'_, D>,
    ) -> Result<Outcome, DecideError> {
        let outcome = match self.run(request, false).await {
            Err(DecideError::Unavailable(reason)) => self
                .engine
                .explain_degraded(
                    request.domain,
                    request.descriptors,
                    request.cost,
                    reason.as_str(),
                )
                .map_err(refused),
            other => other,
        };
        self.trace(request.domain, &outcome);
        outcome
    }

    /// Settles a reservation: `request` as it was checked (its cost the most it could cost,
    /// its request id required), `used` what it cost in the end; each bucket it was charged on
    /// gets the difference back, once. A store that cannot answer gives nothing back (the
    /// charge stands, under-admitting): no failure mode applies, nothing is decided.
    ///
    /// # Errors
    ///
    /// [`DecideError::Invalid`] without a request id, or for `used` above the cost, or an id
    /// used for another request; [`DecideError::Unavailable`] when the store cannot answer.
    pub async fn settle<S: AsRef<str>, D: Descriptor<S>>(
        &self,
        request: &Request<'_, D>,
        used: u64,
    ) -> Result<Outcome, DecideError> {
        let Request {
            domain,
            descriptors,
            cost,
            request_id,
        } = *request;
        let Some(request_id) = request_id else {
            return Err(DecideError::Invalid(PolicyError::Check {
                limit: String::new(),
                source: CoreError::InvalidSettlement {
                    reason: "it needs the request_id the check was made with",
                },
            }));
        };
        let policy = self.global.as_ref().map(|_| self.engine.current());
        let scope = |key: &str| policy.as_deref().is_some_and(|p| p.is_global_key(key));
        let result = match (&self.backend, self.global_shares(policy.as_deref())) {
            (Backend::Memory, None) => {
                self.engine
                    .settle(domain, descriptors, cost, used, request_id)
            }
            (Backend::Redis(store), None) => {
                self.engine
                    .settle_on(&**store, domain, descriptors, cost, used, request_id)
                    .await
            }
            (Backend::Memory, Some(shares)) => {
                let store = shares.over(self.engine.local(), &scope);
                self.engine
                    .settle_on(&store, domain, descriptors, cost, used, request_id)
                    .await
            }
            (Backend::Redis(redis), Some(shares)) => {
                let store = shares.over(&**redis, &scope);
                self.engine
                    .settle_on(&store, domain, descriptors, cost, used, request_id)
                    .await
            }
        };
        match result {
            Ok(outcome) => {
                if let Some(status) = outcome.settled {
                    metrics::record_settlement(status);
                }
                Ok(outcome)
            }
            Err(PolicyError::Check {
                source: CoreError::StoreUnavailable { reason },
                ..
            }) => {
                metrics::record_store_error(reason);
                Err(DecideError::Unavailable(reason))
            }
            Err(err) => Err(refused(err)),
        }
    }

    async fn run<S: AsRef<str>, D: Descriptor<S>>(
        &self,
        request: &Request<'_, D>,
        consume: bool,
    ) -> Result<Outcome, DecideError> {
        let Request {
            domain,
            descriptors,
            cost,
            request_id,
        } = *request;
        // The policy is read here only with a global store: its limits say which buckets the
        // shares decide.
        let policy = self.global.as_ref().map(|_| self.engine.current());
        let scope = |key: &str| policy.as_deref().is_some_and(|p| p.is_global_key(key));
        // The futures of the stores that wait are boxed: held inline, the largest of them
        // (kilobytes) would size every decision's future, the memory store's too, and every
        // request would copy it into the box its handler's future is kept in. A decision that
        // waits on a network pays one allocation instead.
        let result = match (&self.backend, self.global_shares(policy.as_deref())) {
            (Backend::Memory, None) if consume => {
                self.engine.decide(domain, descriptors, cost, request_id)
            }
            (Backend::Memory, None) => self.engine.explain(domain, descriptors, cost),
            (Backend::Redis(store), None) => {
                let on = Box::pin(self.on(&**store, request, consume));
                self.waited_on_redis(on, consume).await
            }
            (Backend::Memory, Some(shares)) => {
                let store = shares.over(self.engine.local(), &scope);
                Box::pin(self.on(&store, request, consume)).await
            }
            (Backend::Redis(redis), Some(shares)) => {
                let store = shares.over(&**redis, &scope);
                let on = Box::pin(self.on(&store, request, consume));
                self.waited_on_redis(on, consume).await
            }
        };
        match result {
            Ok(outcome) => Ok(outcome),
            Err(PolicyError::Check {
                source: CoreError::StoreUnavailable { reason },
                ..
            }) => {
                metrics::record_store_error(reason);
                self.degraded(request, reason, consume)
            }
            Err(err) => Err(refused(err)),
        }
    }

    /// `on`, a decision made on Redis, in a span of its own when the request's is recorded.
    async fn waited_on_redis(
        &self,
        on: impl Future<Output = Result<Outcome, PolicyError>>,
        charged: bool,
    ) -> Result<Outcome, PolicyError> {
        use opentelemetry::context::FutureExt as _;

        let Some(span) = self.traces.as_deref().and_then(|t| t.store_span(charged)) else {
            return on.await;
        };
        let result = on.with_context(span.clone()).await;
        let unavailable = match &result {
            Err(PolicyError::Check {
                source: CoreError::StoreUnavailable { reason },
                ..
            }) => Some(reason.as_str()),
            _ => None,
        };
        crate::traces::end_store(&span, unavailable);
        result
    }

    /// The shares, when the policy in force has a global limit for them to decide.
    fn global_shares(&self, policy: Option<&Policy>) -> Option<&Shares> {
        self.global
            .as_deref()
            .filter(|_| policy.is_some_and(Policy::has_global))
    }

    /// Decides or explains `request` on `store`.
    async fn on<St: Store, S: AsRef<str>, D: Descriptor<S>>(
        &self,
        store: &St,
        request: &Request<'_, D>,
        consume: bool,
    ) -> Result<Outcome, PolicyError> {
        let Request {
            domain,
            descriptors,
            cost,
            request_id,
        } = *request;
        if consume {
            self.engine
                .decide_on(store, domain, descriptors, cost, request_id)
                .await
        } else {
            self.engine
                .explain_on(store, domain, descriptors, cost)
                .await
        }
    }

    /// The store could not answer: every limit follows its failure mode.
    fn degraded<S: AsRef<str>, D: Descriptor<S>>(
        &self,
        request: &Request<'_, D>,
        reason: Unavailable,
        consume: bool,
    ) -> Result<Outcome, DecideError> {
        if !consume {
            // An explanation reports the store's balances; without the store there are none.
            return Err(DecideError::Unavailable(reason));
        }
        let outcome = self
            .engine
            .decide_degraded(
                request.domain,
                request.descriptors,
                request.cost,
                reason.as_str(),
            )
            .map_err(refused)?;
        metrics::record_degraded(reason, &outcome);
        Ok(outcome)
    }

    /// Takes lease `lease_id` on the concurrency limits that apply to `descriptors` (all or
    /// nothing), and records the metrics. While the shared store cannot answer, each limit
    /// follows its failure mode.
    ///
    /// # Errors
    ///
    /// [`DecideError`] when the request cannot be decided at all.
    pub async fn acquire<S: AsRef<str>>(
        &self,
        domain: &str,
        descriptors: &[Vec<(S, S)>],
        lease_id: &str,
    ) -> Result<LeaseOutcome, DecideError> {
        let started = self.clock.now();
        let result = match &self.backend {
            Backend::Memory => self.engine.acquire(domain, descriptors, lease_id),
            // Boxed, as in `run`: a Redis future inline would size the memory store's too.
            Backend::Redis(store) => {
                Box::pin(
                    self.engine
                        .acquire_on(&**store, domain, descriptors, lease_id),
                )
                .await
            }
        };
        let outcome = match result {
            Ok(outcome) => Ok(outcome),
            Err(PolicyError::Check {
                source: CoreError::StoreUnavailable { reason },
                ..
            }) => {
                metrics::record_store_error(reason);
                self.engine
                    .acquire_degraded(domain, descriptors, lease_id, reason.as_str())
                    .map_err(refused)
                    .inspect(|outcome| metrics::record_degraded_leases(reason, outcome))
            }
            Err(err) => Err(refused(err)),
        };
        let elapsed = self.clock.now().saturating_duration_since(started);
        metrics::record_lease_decision(self.backend.name(), elapsed, &outcome);
        outcome
    }

    /// What [`acquire`](Self::acquire) would answer now, each key looked at on its own,
    /// holding, counting and recording nothing.
    ///
    /// # Errors
    ///
    /// [`DecideError::Unavailable`] when the shared store cannot answer: an explanation has no
    /// counts to show without it.
    pub async fn explain_leases<S: AsRef<str>>(
        &self,
        domain: &str,
        descriptors: &[Vec<(S, S)>],
    ) -> Result<LeaseOutcome, DecideError> {
        let result = match &self.backend {
            Backend::Memory => self.engine.explain_leases(domain, descriptors),
            Backend::Redis(store) => {
                self.engine
                    .explain_leases_on(&**store, domain, descriptors)
                    .await
            }
        };
        result.map_err(|err| self.op_error(err))
    }

    /// Gives lease `lease_id` back: `Ok(true)` if it was still held.
    ///
    /// # Errors
    ///
    /// [`DecideError::Unavailable`] when the shared store cannot answer (the lease then times
    /// out by itself); [`DecideError::Invalid`] for an id that is not one.
    pub async fn release(&self, lease_id: &str) -> Result<bool, DecideError> {
        let result = match &self.backend {
            Backend::Memory => self.engine.release(lease_id),
            Backend::Redis(store) => Box::pin(self.engine.release_on(&**store, lease_id)).await,
        };
        let released = result.map_err(|err| self.op_error(err))?;
        metrics::record_release(released);
        Ok(released)
    }

    /// Extends lease `lease_id` from now: `Ok(Some(d))` with the time until its last end,
    /// `Ok(None)` when it is held nowhere any more.
    ///
    /// # Errors
    ///
    /// As for [`release`](Self::release).
    pub async fn renew(&self, lease_id: &str) -> Result<Option<Duration>, DecideError> {
        let result = match &self.backend {
            Backend::Memory => self.engine.renew(lease_id),
            Backend::Redis(store) => Box::pin(self.engine.renew_on(&**store, lease_id)).await,
        };
        let renewed = result.map_err(|err| self.op_error(err))?;
        metrics::record_renewal(renewed.is_some());
        Ok(renewed)
    }

    /// The answer to an operation other than a decision (a release, a renewal, an
    /// explanation of leases, a reset) that the engine could not do.
    fn op_error(&self, err: PolicyError) -> DecideError {
        match err {
            PolicyError::Check {
                source: CoreError::StoreUnavailable { reason },
                ..
            } => {
                metrics::record_store_error(reason);
                DecideError::Unavailable(reason)
            }
            err => refused(err),
        }
    }

    /// Makes the buckets that would decide `descriptors` (of the limits in `only`, when
    /// given) as if never used, on this server's store and in its emergency buckets; each
    /// bucket reset is counted and audited ([`PolicyEngine::reset_on`]).
    ///
    /// # Errors
    ///
    /// [`DecideError::Unavailable`] when the shared store cannot answer (some buckets may have
    /// been reset: a reset can be repeated); [`DecideError::Internal`] with
    /// [`PolicyError::UnknownLimit`] for a name the policy does not have.
    pub async fn reset<S: AsRef<str>>(
        &self,
        domain: &str,
        descriptors: &[Vec<(S, S)>],
        only: Option<&[&str]>,
    ) -> Result<ResetOutcome, DecideError> {
        let result = match &self.backend {
            Backend::Memory => self.engine.reset(domain, descriptors, only),
            Backend::Redis(store) => {
                self.engine
                    .reset_on(&**store, domain, descriptors, only)
                    .await
            }
        };
        let outcome = result.map_err(|err| self.op_error(err))?;
        for bucket in &outcome.reset {
            metrics::record_reset(&bucket.name);
        }
        Ok(outcome)
    }

    /// Gives `request`'s cost back to the buckets a check of it would charge (hits a trusted
    /// caller took earlier and returns: Envoy's `is_negative_hits`), on this server's store and
    /// in its emergency budgets ([`PolicyEngine::give_back_on`]); the hits are counted per
    /// limit, each descriptor's at most its bucket's capacity. Global limits' shared
    /// reservoirs are left as they are.
    ///
    /// # Errors
    ///
    /// [`DecideError::Unavailable`] when the shared store cannot answer (nothing, or only some
    /// of it, was given back there: under-admitting); [`DecideError::Invalid`] for a cost of 0.
    pub async fn give_back<S: AsRef<str>, D: Descriptor<S>>(
        &self,
        request: &Request<'_, D>,
    ) -> Result<Outcome, DecideError> {
        let Request {
            domain,
            descriptors,
            cost,
            ..
        } = *request;
        let result = match &self.backend {
            Backend::Memory => self.engine.give_back(domain, descriptors, cost),
            Backend::Redis(store) => {
                self.engine
                    .give_back_on(&**store, domain, descriptors, cost)
                    .await
            }
        };
        let outcome = result.map_err(|err| self.op_error(err))?;
        for limit in &outcome.limits {
            if let Some(decision) = &limit.decision {
                let tokens = match cost {
                    Costs::Same(tokens) => tokens,
                    Costs::Each(costs) => costs.get(limit.descriptor).copied().unwrap_or(0),
                };
                // More than a bucket holds fills it, and would soon overflow the counter.
                metrics::record_given_back(&limit.name, tokens.min(decision.limit().capacity()));
            }
        }
        Ok(outcome)
    }

    /// Writes the fleet's incident switch to the shared store (`Some`: every limit in shadow
    /// mode in every process that reads it; `None`: off), and applies it here at once. The
    /// others follow within [`FLEET_SWITCH_EVERY`] ([`Decider::follow_fleet_switch`]).
    ///
    /// # Errors
    ///
    /// [`FleetError::NoSharedStore`] on the memory store, which no other process reads;
    /// [`FleetError::Store`] when the store cannot be written (nothing changed here).
    pub async fn set_fleet_shadow_all(&self, on: Option<ShadowAll>) -> Result<(), FleetError> {
        let Backend::Redis(store) = &self.backend else {
            return Err(FleetError::NoSharedStore);
        };
        let value = on.as_ref().map(|on| {
            let mut value =
                serde_json::json!({"reason": on.reason, "since": on.since.to_rfc3339()});
            // Servers that predate narrowing read any value as every limit.
            add_scope(&mut value, &on.scope);
            value.to_string()
        });
        store
            .write_flag(FLEET_SHADOW_ALL, value.as_deref())
            .await
            .map_err(FleetError::Store)?;
        self.engine.set_fleet_shadow_all(on);
        Ok(())
    }

    /// Reads the fleet's incident switch from the shared store every [`FLEET_SWITCH_EVERY`]
    /// and applies it, for as long as the server runs; on the memory store, returns at once.
    /// A read that fails keeps what was last read: an unreachable store must not turn the
    /// switch on or off by itself.
    pub async fn follow_fleet_switch(self: Arc<Self>) {
        let Backend::Redis(store) = &self.backend else {
            return;
        };
        let mut every = tokio::time::interval(FLEET_SWITCH_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            match store.read_flag(FLEET_SHADOW_ALL).await {
                Ok(None) => self.engine.set_fleet_shadow_all(None),
                Ok(Some(text)) => match fleet_switch_of(&text) {
                    Some(on) => self.engine.set_fleet_shadow_all(Some(on)),
                    None => tracing::warn!(
                        value = text.as_str(),
                        "the fleet's shadow-all switch in the store is unreadable; kept as it was"
                    ),
                },
                Err(err) => tracing::debug!(%err, "cannot read the fleet's shadow-all switch"),
            }
        }
    }

    /// Whether the store answers: for `/readyz`.
    pub async fn store_ready(&self) -> Result<(), Unavailable> {
        match &self.backend {
            Backend::Memory => Ok(()),
            Backend::Redis(store) => store.ping().await,
        }
    }
}

/// The flag the fleet's incident switch is kept in, in the shared store.
const FLEET_SHADOW_ALL: &str = "shadow-all";

/// How often each server reads the fleet's incident switch: how soon a change reaches every
/// process, for one small read per second per process.
pub const FLEET_SWITCH_EVERY: Duration = Duration::from_secs(1);

/// Why the fleet's incident switch could not be set.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// The memory store is this process's alone.
    #[error(
        "this server runs on the memory store, which no other process reads: start the fleet on \
         a shared store (--store redis://...) for a fleet's switch, or leave out \"fleet\""
    )]
    NoSharedStore,
    /// The shared store could not be written.
    #[error("the shared store cannot be written: {0}")]
    Store(CoreError),
}

/// Adds what `scope` narrows a switch to, as `"domains"` and `"limits"` lists of names, to
/// the object `value`; neither for a switch of every limit. How the status and the store's
/// flag both write it.
pub(crate) fn add_scope(value: &mut serde_json::Value, scope: &ShadowScope) {
    if !scope.domain_names().is_empty() {
        value["domains"] = serde_json::json!(scope.domain_names());
    }
    if !scope.limit_names().is_empty() {
        value["limits"] = serde_json::json!(scope.limit_names());
    }
}

/// The switch as written in the store: `{"reason": ..., "since": RFC 3339}`, with `"domains"`
/// and `"limits"` (lists of names) when it is narrowed.
fn fleet_switch_of(text: &str) -> Option<ShadowAll> {
    let value: serde_json::Value = serde_json::from_str(text).ok()?;
    let reason = value["reason"].as_str()?;
    let since = UnixTime::parse_rfc3339(value["since"].as_str()?)?;
    let names = |field: &str| -> Option<Vec<String>> {
        match &value[field] {
            serde_json::Value::Null => Some(Vec::new()),
            list => serde_json::from_value(list.clone()).ok(),
        }
    };
    let scope = ShadowScope::domains(names("domains")?).with_limits(names("limits")?);
    Some(ShadowAll::fleet(since, reason).within(scope))
}

/// A refusal other than the store's: the request's fault, or the server's.
fn refused(err: PolicyError) -> DecideError {
    if is_caller_error(&err) {
        DecideError::Invalid(err)
    } else {
        DecideError::Internal(err)
    }
}

/// Costs the buckets can never hold, ids out of bounds: the request is wrong, not the server.
fn is_caller_error(err: &PolicyError) -> bool {
    matches!(
        err,
        PolicyError::Check {
            source: CoreError::InvalidCost { .. }
                | CoreError::InvalidRequestId { .. }
                | CoreError::IdempotencyConflict
                | CoreError::InvalidSettlement { .. }
                | CoreError::InvalidLeaseId { .. }
                | CoreError::LeaseIdInUse,
            ..
        }
    )
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tollgate_policy::{EngineOptions, PolicyEngine, compile};

    use super::*;

    /// The fleet's switch as the store keeps it: every limit, or narrowed; a value this
    /// server cannot read entirely is not half-read (the switch stays as it was).
    #[test]
    fn the_fleet_switch_is_read_whole_or_not_at_all() {
        let since = r#""since":"2026-12-07T10:00:00Z""#;
        let all = fleet_switch_of(&format!(r#"{{"reason":"INC-1",{since}}}"#));
        assert!(all.is_some_and(|on| on.fleet && on.scope.is_all() && on.reason == "INC-1"));
        let narrowed = fleet_switch_of(&format!(
            r#"{{"reason":"INC-2",{since},"domains":["shop"],"limits":["login","auth"]}}"#
        ));
        let scope = narrowed.map(|on| on.scope);
        assert_eq!(
            scope,
            Some(ShadowScope::domains(["shop"]).with_limits(["auth", "login"]))
        );
        for bad in [
            format!(r#"{{"reason":"INC-3",{since},"domains":"shop"}}"#),
            format!(r#"{{"reason":"INC-3",{since},"limits":[1]}}"#),
            r#"{"reason":"INC-3","since":"yesterday"}"#.to_owned(),
            "on".to_owned(),
        ] {
            assert_eq!(fleet_switch_of(&bad), None, "{bad}");
        }
    }

    /// The request's faults are answered 400 by every API; anything else is the server's: a
    /// full lease table, an error that is no check's (a limit the policy does not have).
    #[test]
    fn refusals_are_the_callers_or_the_servers() {
        let check = |source| PolicyError::Check {
            limit: "l".to_owned(),
            source,
        };
        let callers = [
            CoreError::InvalidCost {
                cost: 0,
                capacity: 1,
            },
            CoreError::InvalidRequestId { len: 0 },
            CoreError::IdempotencyConflict,
            CoreError::InvalidSettlement { reason: "used" },
            CoreError::InvalidLeaseId { len: 0 },
            CoreError::LeaseIdInUse,
        ];
        for source in callers {
            let what = source.to_string();
            assert!(
                matches!(refused(check(source)), DecideError::Invalid(_)),
                "{what}"
            );
        }
        for err in [
            check(CoreError::TooManyLeases { max: 1 }),
            check(CoreError::EmptyCheck),
            PolicyError::UnknownLimit {
                name: "l".to_owned(),
            },
        ] {
            let what = err.to_string();
            assert!(matches!(refused(err), DecideError::Internal(_)), "{what}");
        }
    }

    /// A decision's future holds what the memory store needs, not the Redis store's futures:
    /// every request copies it into a box (7 KB each, before those were boxed).
    #[test]
    fn a_decisions_future_stays_small() {
        let policy = compile(
            "p.yaml",
            "limits: [{name: l, domain: api, key: [user], capacity: 1, refill: 1/s}]",
        )
        .expect("policy");
        let engine = Arc::new(PolicyEngine::new(policy, EngineOptions::default()));
        let decider = Decider::new(engine, Backend::Memory);
        let descriptors = vec![vec![("user", "u1")]];
        let request = Request {
            domain: "api",
            descriptors: &descriptors,
            cost: Costs::Same(1),
            request_id: None,
        };
        let sizes = [
            std::mem::size_of_val(&decider.decide(Api::Http, &request)),
            std::mem::size_of_val(&decider.check_only(&request)),
            std::mem::size_of_val(&decider.acquire("api", &descriptors, "lease-1")),
            std::mem::size_of_val(&decider.release("lease-1")),
        ];
        assert!(sizes.iter().all(|&size| size < 1024), "{sizes:?}");
    }
}
