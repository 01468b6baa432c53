//! Every metric tollgate serves, named once, with labels from closed sets.
//!
//! Names and labels are stable API for dashboards and alerts (SPEC §8). Label values come from
//! the policy (limit names), fixed enums (result, mode, api, store, reason) and never from
//! request data such as keys or addresses, so cardinality stays bounded by the policy. The one
//! exception, the busiest keys, is rendered apart by [`crate::hot_keys`], a bounded number of
//! series that an operator can turn off.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use metrics::{Counter, Histogram, counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use metrics_util::MetricKindMask;
use parking_lot::RwLock;
use tollgate::Unavailable;
use tollgate_policy::{LeaseOutcome, LimitOutcome, Outcome, PolicyEngine};

use crate::connection::{Connections, Listener};
use crate::decider::{Backend, DecideError};

/// Decisions per limit: labels `limit`, `result` (`allowed`, `rejected`, `denied`: by a deny
/// limit or override, which no wait lifts, `unavailable`, `exempt`), `mode` (`enforce`,
/// `shadow`, `rollout`, `exempt`), `api`.
pub const DECISIONS: &str = "tollgate_decisions_total";
/// Allowed decisions that left their limit nearly used up: more than the near-limit ratio of
/// its capacity (`--near-limit-ratio`, 0.8 by default) spent, or of its `max_in_flight` held.
/// Labels `limit`, `mode`, `api`. Counted beside `result="allowed"`, not instead of it: a
/// warning before rejections begin (envoyproxy/ratelimit's `near_limit`).
pub const NEAR_LIMIT: &str = "tollgate_near_limit_decisions_total";
/// Buckets an operator reset through `POST /v1/reset`: label `limit`.
pub const RESETS: &str = "tollgate_resets_total";
/// Requests no limit applied to (allowed): label `api`.
pub const UNMATCHED: &str = "tollgate_unmatched_requests_total";
/// Requests refused as malformed or impossible: label `api`.
pub const INVALID: &str = "tollgate_invalid_requests_total";
/// Time to decide a request, in seconds: labels `api`, `store`.
pub const LATENCY: &str = "tollgate_decision_duration_seconds";
/// Shared-store failures: label `reason` (`timeout`, `connection`, `circuit_open`, `protocol`,
/// `script`).
pub const STORE_ERRORS: &str = "tollgate_store_errors_total";
/// Limit decisions made without the shared store: labels `reason`, `failure_mode` (`open`: an
/// emergency budget decided; `closed`: denied as unavailable).
pub const DEGRADED: &str = "tollgate_degraded_decisions_total";
/// Circuit breakers of the shared store failing decisions fast now: 0 when healthy; 1 for a
/// single Redis whose breaker is open; on Redis Cluster, one per range of 128 slots. Absent on
/// the memory store.
pub const STORE_CIRCUIT_OPEN: &str = "tollgate_store_circuit_open";
/// Checks answered from the memory of recent Redis rejections, without a call
/// (`--rejection-memory`).
pub const REMEMBERED_REJECTIONS: &str = "tollgate_remembered_rejections_total";
/// Batches of tokens taken from Redis by token leasing (`--token-batch`).
pub const TOKEN_BATCHES: &str = "tollgate_token_batches_total";
/// Tokens taken from Redis in batches (beyond the cost of the checks that took them).
pub const BATCHED_TOKENS_TAKEN: &str = "tollgate_batched_tokens_taken_total";
/// Where batched tokens went: label `outcome` (`spent`: admitted here without a call;
/// `returned`: given back unused; `lost`: could not be given back, an under-admission until
/// the bucket refills).
pub const BATCHED_TOKENS: &str = "tollgate_batched_tokens_total";
/// Batched tokens held in this process now, not spent yet: what it keeps from the others.
pub const BATCHED_TOKENS_HELD: &str = "tollgate_batched_tokens_held";
/// Leases given back through `DELETE /v1/leases/{id}`: label `result` (`released`: it was
/// held; `not_found`: it had timed out, was released before, or never existed).
pub const LEASES_RELEASED: &str = "tollgate_lease_releases_total";
/// Lease renewals through `POST /v1/leases/{id}/renew`: label `result` (`renewed`, or
/// `not_found`: it had timed out, was released, or never existed).
pub const LEASES_RENEWED: &str = "tollgate_lease_renewals_total";
/// Reservations settled through `POST /v1/settle`: label `status` (`settled`; `repeated`:
/// settled before; `not_found`: no charge on record).
pub const SETTLEMENTS: &str = "tollgate_settlements_total";
/// Hits given back through RLS (`is_negative_hits`), each descriptor's at most its bucket's
/// capacity (a bucket takes back no more than fills it): label `limit`.
pub const GIVEN_BACK: &str = "tollgate_hits_given_back_total";
/// Leases held in this process's lease tables (the memory store's, and emergency leases taken
/// while the shared store was down), counting ended ones not yet swept.
pub const LIVE_LEASES: &str = "tollgate_live_leases";
/// Buckets held in this process.
pub const LIVE_BUCKETS: &str = "tollgate_live_buckets";
/// Non-full buckets dropped to stay within the bucket bound.
pub const EVICTIONS: &str = "tollgate_evictions_total";
/// Full buckets dropped (lossless).
pub const EXPIRED: &str = "tollgate_expired_buckets_total";
/// The policy version in force: label `version`, value 1.
pub const POLICY_INFO: &str = "tollgate_policy_info";
/// Versions put in force since start (loads and rollbacks).
pub const POLICY_CHANGES: &str = "tollgate_policy_changes_total";
/// 1 while the last attempt to load the policy file was refused (the previous version is in
/// force), else 0.
pub const POLICY_REFUSED: &str = "tollgate_policy_last_load_refused";
/// 1 while an operator's switch puts limits in shadow mode (every limit, or those it is
/// narrowed to: they reject nothing), else 0.
pub const SHADOW_ALL: &str = "tollgate_shadow_all";

/// Connections open: label `listener` (`http`, `grpc`).
pub const CONNECTIONS_OPEN: &str = "tollgate_connections_open";
/// Connections by the protocol they turned out to speak: labels `listener`, `protocol`
/// (`http/1.1`, `h2`), counted once the client's first bytes (or its TLS handshake) told; on
/// the HTTP listener, whether clients multiplex their requests over HTTP/2.
pub const CONNECTIONS_OPENED: &str = "tollgate_connections_opened_total";
/// Connections the server closed on its clients: labels `listener`, `reason` (`header_timeout`:
/// a request head or the HTTP/2 preface did not arrive in time; `idle`: the client sent
/// nothing for the idle timeout; `tls_handshake`: the TLS handshake failed or was too slow).
pub const CONNECTIONS_CLOSED: &str = "tollgate_connections_closed_total";
/// When the certificate a TLS listener serves expires (its `notAfter`), in Unix seconds: label
/// `listener`.
pub const TLS_EXPIRY: &str = "tollgate_tls_certificate_expiry_timestamp_seconds";
/// Looks at a TLS listener's certificate files that found them changed: labels `listener`,
/// `result` (`reloaded`: in force for new connections; `refused`: unusable, the certificate in
/// force stays).
pub const TLS_RELOADS: &str = "tollgate_tls_reloads_total";
/// Spans of `--trace-endpoint` the collector was sent: label `result` (`sent`: it took them;
/// `failed`: the export failed after its retries, and they are lost).
pub const TRACE_SPANS: &str = "tollgate_trace_spans_exported_total";
/// RLQS streams open now (Envoys connected for quota assignments).
pub const RLQS_STREAMS: &str = "tollgate_rlqs_streams";
/// Requests RLQS clients reported deciding themselves: label `result` (`allowed`, `denied`).
pub const RLQS_REPORTED: &str = "tollgate_rlqs_reported_requests_total";
/// Answers to RLQS bucket reports, and renewals: label `action` (`tokens`, `allow_all`,
/// `deny_all`, `abandon`, `refused`: a stream over its bound of buckets; `kept`: nothing
/// sent, the token bucket held stays, its extension not payable just then).
pub const RLQS_ANSWERS: &str = "tollgate_rlqs_answers_total";
/// Tokens charged to the shared buckets for RLQS assignments, before they could be spent.
pub const RLQS_PREPAID: &str = "tollgate_rlqs_prepaid_tokens_total";
/// Prepaid RLQS tokens given back: refill an assignment replaced could no longer reach.
pub const RLQS_GIVEN_BACK: &str = "tollgate_rlqs_given_back_tokens_total";
/// RLQS assignments tollgate renewed between an Envoy's reports (those with the short
/// time-to-live a small capacity calls for, and `DENY_ALL`).
pub const RLQS_RENEWED: &str = "tollgate_rlqs_renewed_total";
/// Gauge: reservoirs of global limits held in this process.
pub const GLOBAL_RESERVOIRS: &str = "tollgate_global_reservoirs";
/// Gauge: tokens of global limits held in this process's reservoirs, paid for and unspent.
pub const GLOBAL_HELD: &str = "tollgate_global_held_tokens";
/// Counter: tokens of global limits charged on the global store for the reservoirs.
pub const GLOBAL_FETCHED: &str = "tollgate_global_fetched_tokens_total";
/// Counter: tokens of global limits given back to the global store.
pub const GLOBAL_GIVEN_BACK: &str = "tollgate_global_given_back_tokens_total";
/// Counter: calls of a rebalancing round the global store could not answer.
pub const GLOBAL_ROUND_FAILURES: &str = "tollgate_global_round_failures_total";
/// Histogram: time a rebalancing round of the global limits took, in seconds; its `_count`
/// counts the rounds, one per `--rebalance-interval` while they keep up. Rounds that take
/// longer than the interval run back to back, and reservoirs follow demand that much later.
pub const GLOBAL_ROUNDS: &str = "tollgate_global_round_duration_seconds";

/// Every metric name above, for dashboards, alerts and tests to check theirs against (the
/// busiest keys' two series are [`crate::hot_keys`]'s).
pub const ALL: &[&str] = &[
    DECISIONS,
    NEAR_LIMIT,
    RESETS,
    UNMATCHED,
    INVALID,
    LATENCY,
    STORE_ERRORS,
    DEGRADED,
    STORE_CIRCUIT_OPEN,
    REMEMBERED_REJECTIONS,
    TOKEN_BATCHES,
    BATCHED_TOKENS_TAKEN,
    BATCHED_TOKENS,
    BATCHED_TOKENS_HELD,
    LEASES_RELEASED,
    LEASES_RENEWED,
    SETTLEMENTS,
    GIVEN_BACK,
    LIVE_LEASES,
    LIVE_BUCKETS,
    EVICTIONS,
    EXPIRED,
    POLICY_INFO,
    POLICY_CHANGES,
    POLICY_REFUSED,
    SHADOW_ALL,
    CONNECTIONS_OPEN,
    CONNECTIONS_OPENED,
    CONNECTIONS_CLOSED,
    TLS_RELOADS,
    TLS_EXPIRY,
    TRACE_SPANS,
    RLQS_STREAMS,
    RLQS_REPORTED,
    RLQS_ANSWERS,
    RLQS_PREPAID,
    RLQS_GIVEN_BACK,
    RLQS_RENEWED,
    GLOBAL_RESERVOIRS,
    GLOBAL_HELD,
    GLOBAL_FETCHED,
    GLOBAL_GIVEN_BACK,
    GLOBAL_ROUND_FAILURES,
    GLOBAL_ROUNDS,
];

/// Why the server closed a connection on its client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Closed {
    /// A request head (HTTP/1) or the connection preface (gRPC) did not arrive in time.
    HeaderTimeout,
    /// The client sent nothing for the idle timeout.
    Idle,
    /// The TLS handshake failed (no common protocol, a client certificate missing or not
    /// trusted, not TLS at all) or did not end within the header timeout.
    TlsHandshake,
}

impl Closed {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Closed::HeaderTimeout => "header_timeout",
            Closed::Idle => "idle",
            Closed::TlsHandshake => "tls_handshake",
        }
    }
}

/// The front end a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `POST /v1/check` and `POST /v1/explain`.
    Http,
    /// `/v1/forward-auth/{domain}`.
    ForwardAuth,
    /// Envoy RLS `ShouldRateLimit`.
    Grpc,
    /// `POST /v1/leases` (concurrency limits).
    Leases,
    /// Envoy RLQS `StreamRateLimitQuotas`: charges for quota assignments.
    Rlqs,
}

impl Api {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Api::Http => "http",
            Api::ForwardAuth => "forward_auth",
            Api::Grpc => "grpc",
            Api::Leases => "leases",
            Api::Rlqs => "rlqs",
        }
    }
}

/// Installs the process-wide recorder and returns the handle that renders `/metrics`.
///
/// # Errors
///
/// When a recorder is already installed (a second server in one process).
pub fn install() -> Result<PrometheusHandle, metrics_exporter_prometheus::BuildError> {
    let handle = builder(GAUGE_IDLE_TIMEOUT)?.install_recorder()?;
    describe();
    Ok(handle)
}

/// How long a gauge stays exported after its last update. Every gauge in force is set on each
/// scrape ([`refresh`]); what stops being set is the `tollgate_policy_info` series of a version
/// no longer in force, which would otherwise stay, at 0, for every version ever loaded.
const GAUGE_IDLE_TIMEOUT: Duration = Duration::from_secs(600);

fn builder(
    gauge_idle: Duration,
) -> Result<PrometheusBuilder, metrics_exporter_prometheus::BuildError> {
    // Sub-millisecond buckets: a memory decision takes microseconds, a Redis one a few hundred.
    let buckets = [
        0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01,
        0.025, 0.05, 0.1,
    ];
    // A round makes a call per reservoir, a few at a time: milliseconds for a few keys, up to
    // the longest interval (1 m) for the most a process may hold.
    let rounds = [
        0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ];
    Ok(PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full(LATENCY.to_owned()), &buckets)?
        .set_buckets_for_metric(Matcher::Full(GLOBAL_ROUNDS.to_owned()), &rounds)?
        .idle_timeout(MetricKindMask::GAUGE, Some(gauge_idle)))
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_counter!(DECISIONS, "Limit decisions by limit, result, mode and API.");
    describe_counter!(
        NEAR_LIMIT,
        "Allowed decisions that left their limit nearly used up, by limit, mode and API."
    );
    describe_counter!(UNMATCHED, "Requests no limit applied to (allowed).");
    describe_counter!(RESETS, "Buckets reset by an operator, by limit.");
    describe_counter!(INVALID, "Requests refused as malformed or impossible.");
    describe_histogram!(LATENCY, metrics::Unit::Seconds, "Time to decide a request.");
    describe_counter!(STORE_ERRORS, "Shared-store failures by reason.");
    describe_counter!(DEGRADED, "Limit decisions made without the shared store.");
    describe_gauge!(
        STORE_CIRCUIT_OPEN,
        "Circuit breakers of the shared store open now (on Redis Cluster, one per 128 slots)."
    );
    describe_gauge!(LIVE_BUCKETS, "Buckets held in this process.");
    describe_counter!(
        REMEMBERED_REJECTIONS,
        "Checks rejected from the memory of recent Redis rejections, without a call."
    );
    describe_counter!(TOKEN_BATCHES, "Batches of tokens taken from Redis.");
    describe_counter!(
        BATCHED_TOKENS_TAKEN,
        "Tokens taken from Redis in batches, beyond the checks that took them."
    );
    describe_counter!(
        BATCHED_TOKENS,
        "Batched tokens spent here, given back unused, or lost."
    );
    describe_gauge!(BATCHED_TOKENS_HELD, "Batched tokens held here now.");
    describe_counter!(
        LEASES_RELEASED,
        "Leases given back, by whether they were held."
    );
    describe_gauge!(LIVE_LEASES, "Leases held in this process's lease tables.");
    describe_counter!(
        SETTLEMENTS,
        "Reservations settled, by whether anything was given back."
    );
    describe_counter!(
        GIVEN_BACK,
        "Hits given back through RLS (is_negative_hits), by limit."
    );
    describe_counter!(
        EVICTIONS,
        "Non-full buckets dropped to stay within the bound."
    );
    describe_counter!(EXPIRED, "Full buckets dropped (lossless).");
    describe_gauge!(POLICY_INFO, "The policy version in force (value 1).");
    describe_counter!(
        POLICY_CHANGES,
        "Policy versions put in force (loads and rollbacks)."
    );
    describe_gauge!(POLICY_REFUSED, "1 while the last policy load was refused.");
    describe_gauge!(
        SHADOW_ALL,
        "1 while every limit is in shadow mode by an operator's switch."
    );
    describe_gauge!(CONNECTIONS_OPEN, "Connections open, by listener.");
    describe_counter!(
        CONNECTIONS_OPENED,
        "Connections by the protocol they speak, by listener and protocol."
    );
    describe_counter!(
        CONNECTIONS_CLOSED,
        "Connections closed by the server on a slow or silent client, by listener and reason."
    );
    describe_counter!(
        TLS_RELOADS,
        "TLS certificate files found changed, by listener and result."
    );
    describe_gauge!(
        TLS_EXPIRY,
        "When the certificate a TLS listener serves expires, in Unix seconds."
    );
    describe_counter!(
        TRACE_SPANS,
        "Spans sent to the trace collector, by result (sent, failed)."
    );
    describe_gauge!(RLQS_STREAMS, "RLQS streams open now.");
    describe_counter!(
        RLQS_REPORTED,
        "Requests RLQS clients reported deciding, by result."
    );
    describe_counter!(
        RLQS_ANSWERS,
        "Answers to RLQS bucket reports and renewals, by action."
    );
    describe_counter!(
        RLQS_RENEWED,
        "RLQS assignments renewed by tollgate between an Envoy's reports."
    );
    describe_counter!(
        RLQS_PREPAID,
        "Tokens charged for RLQS assignments before they could be spent."
    );
    describe_counter!(
        RLQS_GIVEN_BACK,
        "Prepaid RLQS tokens given back when an assignment was replaced."
    );
    describe_gauge!(GLOBAL_RESERVOIRS, "Reservoirs of global limits held here.");
    describe_gauge!(
        GLOBAL_HELD,
        "Tokens of global limits held here, paid for on the global store and unspent."
    );
    describe_counter!(
        GLOBAL_FETCHED,
        "Tokens of global limits charged on the global store for reservoirs."
    );
    describe_counter!(
        GLOBAL_GIVEN_BACK,
        "Tokens of global limits given back to the global store."
    );
    describe_counter!(
        GLOBAL_ROUND_FAILURES,
        "Calls of rebalancing rounds the global store could not answer."
    );
    describe_histogram!(
        GLOBAL_ROUNDS,
        metrics::Unit::Seconds,
        "Time a rebalancing round of the global limits took."
    );
}

/// The near-limit ratio in thousandths ([`set_near_limit_ratio`]).
static NEAR_PERMILLE: AtomicU32 = AtomicU32::new(DEFAULT_NEAR_PERMILLE);

/// The near-limit ratio a server starts with, in thousandths: envoyproxy/ratelimit's default.
pub const DEFAULT_NEAR_PERMILLE: u32 = 800;

/// Sets the share of a limit that, once spent by an allowed decision, counts it as near the
/// limit ([`NEAR_LIMIT`]), in thousandths (1 to 1,000; 1,000 counts nothing).
pub fn set_near_limit_ratio(permille: u32) {
    NEAR_PERMILLE.store(permille.clamp(1, 1_000), Ordering::Relaxed);
}

/// Whether `used` of `capacity` is past the process's near-limit ratio ([`is_near`]).
fn near(used: u64, capacity: u64) -> bool {
    is_near(used, capacity, NEAR_PERMILLE.load(Ordering::Relaxed))
}

/// Whether `used` of `capacity` is past `permille` thousandths of it: `used > capacity ×
/// ratio`, in integers (as envoyproxy/ratelimit's `used > floor(capacity × ratio)` for whole
/// `used`). `tollgate simulate` counts by the same test.
pub fn is_near(used: u64, capacity: u64, permille: u32) -> bool {
    u128::from(used) * 1_000 > u128::from(capacity) * u128::from(permille)
}

/// Metric handles already registered, so a decision costs an atomic add rather than a registry
/// lookup with freshly allocated labels. Bounded: limit names come from the policies loaded.
struct Handles {
    /// Per limit name: ((result, mode, api), counter); near-limit counters under the result
    /// [`NEAR`].
    decisions: RwLock<HashMap<String, Vec<(DecisionLabels, Counter)>>>,
    latency: RwLock<Vec<((Api, &'static str), Histogram)>>,
}

/// `result`, `mode` and `api` of a decision counter.
type DecisionLabels = (&'static str, &'static str, Api);

/// The result under which [`Handles`] keeps a limit's [`NEAR_LIMIT`] counters: no decision
/// counter has it.
const NEAR: &str = "near_limit";

static HANDLES: LazyLock<Handles> = LazyLock::new(|| Handles {
    decisions: RwLock::new(HashMap::new()),
    latency: RwLock::new(Vec::new()),
});

thread_local! {
    /// This thread's copies of the handles in [`HANDLES`]. Taking the shared lock and cloning a
    /// handle (then dropping the clone) are writes to cache lines every thread shares, four per
    /// handle; with the copies kept here, a decision's only shared writes are the increments
    /// themselves.
    static LOCAL: RefCell<LocalHandles> = RefCell::new(LocalHandles::default());
}

/// A thread's handles, filled from [`HANDLES`] on first use (so bounded like it).
#[derive(Default)]
struct LocalHandles {
    /// Per limit name: ((result, mode, api), counter).
    decisions:
        hashbrown::HashMap<String, Vec<(DecisionLabels, Counter)>, foldhash::fast::RandomState>,
    latency: Vec<((Api, &'static str), Histogram)>,
}

impl LocalHandles {
    fn decision(
        &mut self,
        limit: &str,
        result: &'static str,
        mode: &'static str,
        api: Api,
    ) -> &Counter {
        let key = (result, mode, api);
        let handles = self.decisions.entry_ref(limit).or_default();
        let at = match handles.iter().position(|(k, _)| *k == key) {
            Some(at) => at,
            None => {
                handles.push((key, decision_counter(limit, result, mode, api)));
                handles.len() - 1
            }
        };
        &handles[at].1
    }

    fn latency(&mut self, api: Api, store: &'static str) -> &Histogram {
        let key = (api, store);
        let at = match self.latency.iter().position(|(k, _)| *k == key) {
            Some(at) => at,
            None => {
                self.latency.push((key, latency_histogram(api, store)));
                self.latency.len() - 1
            }
        };
        &self.latency[at].1
    }
}

fn decision_counter(limit: &str, result: &'static str, mode: &'static str, api: Api) -> Counter {
    let key = (result, mode, api);
    let cached = HANDLES.decisions.read().get(limit).and_then(|handles| {
        handles
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, counter)| counter.clone())
    });
    if let Some(counter) = cached {
        return counter;
    }
    let counter = if result == NEAR {
        counter!(
            NEAR_LIMIT,
            "limit" => limit.to_owned(),
            "mode" => mode,
            "api" => api.as_str()
        )
    } else {
        counter!(
            DECISIONS,
            "limit" => limit.to_owned(),
            "result" => result,
            "mode" => mode,
            "api" => api.as_str()
        )
    };
    HANDLES
        .decisions
        .write()
        .entry(limit.to_owned())
        .or_default()
        .push((key, counter.clone()));
    counter
}

fn latency_histogram(api: Api, store: &'static str) -> Histogram {
    let key = (api, store);
    let cached = HANDLES
        .latency
        .read()
        .iter()
        .find(|(k, _)| *k == key)
        .map(|(_, histogram)| histogram.clone());
    if let Some(histogram) = cached {
        return histogram;
    }
    let histogram = histogram!(LATENCY, "api" => api.as_str(), "store" => store);
    HANDLES.latency.write().push((key, histogram.clone()));
    histogram
}

/// Records one decided request.
pub fn record_decision(
    api: Api,
    store: &'static str,
    elapsed: Duration,
    outcome: &Result<Outcome, DecideError>,
) {
    let limits = outcome.iter().flat_map(|outcome| {
        outcome.limits.iter().map(|limit| {
            let result = result_of(limit, outcome.failed_closed);
            let near = result == "allowed"
                && limit.decision.is_some_and(|d| {
                    let capacity = d.capacity();
                    near(capacity.saturating_sub(d.remaining()), capacity)
                });
            (&*limit.name, result, limit.mode, near)
        })
    });
    record_limits(api, store, elapsed, limits);
    let outcome = match outcome {
        Ok(outcome) => outcome,
        Err(DecideError::Invalid(_)) => {
            record_invalid(api);
            return;
        }
        // Not the caller's fault: the store (counted as a store error) or this server.
        Err(DecideError::Unavailable(_) | DecideError::Internal(_)) => return,
    };
    if outcome.unmatched() {
        counter!(UNMATCHED, "api" => api.as_str()).increment(1);
    }
}

/// Records one lease request: its latency, and each concurrency limit's decision under
/// `api="leases"`, with the same `result` and `mode` labels as a check's.
pub fn record_lease_decision(
    store: &'static str,
    elapsed: Duration,
    outcome: &Result<LeaseOutcome, DecideError>,
) {
    let api = Api::Leases;
    let limits = outcome.iter().flat_map(|outcome| {
        outcome.limits.iter().map(|limit| {
            let result = match limit.decision {
                Some(d) if d.is_denied() && !outcome.failed_closed => "denied",
                decision => result_label(
                    decision.map(|d| d.allowed()),
                    limit.mode,
                    outcome.failed_closed,
                ),
            };
            let near = result == "allowed"
                && limit
                    .decision
                    .is_some_and(|d| near(d.in_flight(), d.max_in_flight()));
            (&*limit.name, result, limit.mode, near)
        })
    });
    record_limits(api, store, elapsed, limits);
    match outcome {
        Ok(outcome) if outcome.limits.is_empty() => {
            counter!(UNMATCHED, "api" => api.as_str()).increment(1);
        }
        // A lease id still held is a retried acquire (its id comes from its request id),
        // answered with the lease it holds: not a bad request.
        Err(DecideError::Invalid(tollgate_policy::Error::Check {
            source: tollgate::Error::LeaseIdInUse,
            ..
        })) => {}
        Err(DecideError::Invalid(_)) => record_invalid(api),
        _ => {}
    }
}

/// Records a request's latency and its limits' decisions: (limit, result, mode, whether near
/// the limit) each.
fn record_limits<'a>(
    api: Api,
    store: &'static str,
    elapsed: Duration,
    limits: impl Iterator<Item = (&'a str, &'static str, &'static str, bool)> + Clone,
) {
    let record = |handles: &mut LocalHandles| {
        handles.latency(api, store).record(elapsed.as_secs_f64());
        for (name, result, mode, near) in limits.clone() {
            handles.decision(name, result, mode, api).increment(1);
            if near {
                handles.decision(name, NEAR, mode, api).increment(1);
            }
        }
    };
    let recorded =
        LOCAL.try_with(|local| local.try_borrow_mut().map(|mut local| record(&mut local)));
    if !matches!(recorded, Ok(Ok(()))) {
        // The thread is being torn down (or, were it ever, re-entered): from the shared handles.
        record(&mut LocalHandles::default());
    }
}

/// Records a bucket of `limit` reset by an operator.
pub fn record_reset(limit: &str) {
    counter!(RESETS, "limit" => limit.to_owned()).increment(1);
}

/// Records `tokens` given back to a bucket of `limit`.
pub fn record_given_back(limit: &str, tokens: u64) {
    counter!(GIVEN_BACK, "limit" => limit.to_owned()).increment(tokens);
}

/// Records a lease given back (or not found).
pub fn record_release(released: bool) {
    let result = if released { "released" } else { "not_found" };
    counter!(LEASES_RELEASED, "result" => result).increment(1);
}

/// Records a lease renewed (or not found).
pub fn record_renewal(renewed: bool) {
    let result = if renewed { "renewed" } else { "not_found" };
    counter!(LEASES_RENEWED, "result" => result).increment(1);
}

/// The `result` label of a limit's decision.
fn result_of(limit: &LimitOutcome, failed_closed: bool) -> &'static str {
    // A block list's hits apart from quotas run dry: an operator alerts on the one, not the
    // other.
    if limit.decision.is_some_and(|d| d.is_denied()) && !failed_closed {
        return "denied";
    }
    result_label(
        limit.decision.map(|d| d.allowed()),
        limit.mode,
        failed_closed,
    )
}

/// The `result` label of a decision that allowed or not (`None`: not decided).
fn result_label(allowed: Option<bool>, mode: &str, failed_closed: bool) -> &'static str {
    match (allowed, failed_closed) {
        (_, true) => "unavailable",
        (None, false) if mode == "exempt" => "exempt",
        // A shadow or rollout limit the store failed to answer after the enforced ones.
        (None, false) => "unavailable",
        (Some(true), false) => "allowed",
        (Some(false), false) => "rejected",
    }
}

/// Records a request refused as malformed before anything was decided (a request the
/// decision refuses is counted by [`record_decision`]).
pub fn record_invalid(api: Api) {
    counter!(INVALID, "api" => api.as_str()).increment(1);
}

/// Records an RLQS stream opening (`true`) or closing.
pub fn record_rlqs_stream(opened: bool) {
    let streams = gauge!(RLQS_STREAMS);
    if opened {
        streams.increment(1.0);
    } else {
        streams.decrement(1.0);
    }
}

/// Records what an RLQS client reported deciding for one bucket.
pub fn record_rlqs_usage(allowed: u64, denied: u64) {
    counter!(RLQS_REPORTED, "result" => "allowed").increment(allowed);
    counter!(RLQS_REPORTED, "result" => "denied").increment(denied);
}

/// Records the answer to one bucket's report.
pub fn record_rlqs_answer(action: &'static str) {
    counter!(RLQS_ANSWERS, "action" => action).increment(1);
}

/// Records tokens charged for an RLQS assignment.
pub fn record_rlqs_prepaid(tokens: u64) {
    counter!(RLQS_PREPAID).increment(tokens);
}

/// Records RLQS assignments renewed between reports.
pub fn record_rlqs_renewed(buckets: usize) {
    counter!(RLQS_RENEWED).increment(buckets as u64);
}

/// Records prepaid RLQS tokens given back.
pub fn record_rlqs_given_back(tokens: u64) {
    counter!(RLQS_GIVEN_BACK).increment(tokens);
}

/// Records one rebalancing round of the global limits' reservoirs, what they hold after it,
/// and what requests and rounds have fetched and given back so far.
pub fn record_global_round(
    shares: &crate::global::Shares,
    round: &tollgate_regional::Round,
    took: Duration,
) {
    histogram!(GLOBAL_ROUNDS).record(took.as_secs_f64());
    let (fetched, given_back) = shares.totals();
    let (reservoirs, held) = shares.held();
    counter!(GLOBAL_FETCHED).absolute(fetched);
    counter!(GLOBAL_GIVEN_BACK).absolute(given_back);
    counter!(GLOBAL_ROUND_FAILURES).increment(round.failed as u64);
    gauge!(GLOBAL_RESERVOIRS).set(reservoirs as f64);
    gauge!(GLOBAL_HELD).set(held as f64);
}

/// Records a settlement of a reservation.
pub fn record_settlement(status: tollgate::SettleStatus) {
    counter!(SETTLEMENTS, "status" => status.as_str()).increment(1);
}

/// Records a failure of the shared store.
pub fn record_store_error(reason: Unavailable) {
    counter!(STORE_ERRORS, "reason" => reason.as_str()).increment(1);
}

/// Records the limits a degraded outcome decided without the store.
pub fn record_degraded(reason: Unavailable, outcome: &Outcome) {
    // A denial is decided as with the store up: not degraded.
    let enforced = outcome
        .limits
        .iter()
        .filter(|l| l.mode == "enforce" && !l.decision.is_some_and(|d| d.is_denied()));
    record_degraded_limits(reason, outcome.failed_closed, enforced.count());
}

/// Records the concurrency limits of a lease request decided without the shared store.
pub fn record_degraded_leases(reason: Unavailable, outcome: &LeaseOutcome) {
    let enforced = outcome
        .limits
        .iter()
        .filter(|l| l.mode == "enforce" && !l.decision.is_some_and(|d| d.is_denied()));
    record_degraded_limits(reason, outcome.failed_closed, enforced.count());
}

fn record_degraded_limits(reason: Unavailable, failed_closed: bool, count: usize) {
    let mode = if failed_closed { "closed" } else { "open" };
    counter!(DEGRADED, "reason" => reason.as_str(), "failure_mode" => mode).increment(count as u64);
}

/// Records a connection whose client turned out to speak `protocol` (`http/1.1` or `h2`).
pub(crate) fn record_connection_opened(listener: Listener, protocol: &'static str) {
    counter!(CONNECTIONS_OPENED, "listener" => listener.as_str(), "protocol" => protocol)
        .increment(1);
}

/// Records a connection the server closed on its client.
pub(crate) fn record_connection_closed(listener: Listener, reason: Closed) {
    counter!(CONNECTIONS_CLOSED, "listener" => listener.as_str(), "reason" => reason.as_str())
        .increment(1);
}

/// Counts a look at a TLS listener's files that found them changed (`reloaded` or `refused`).
pub(crate) fn record_tls_reload(listener: Listener, result: &'static str) {
    counter!(TLS_RELOADS, "listener" => listener.as_str(), "result" => result).increment(1);
}

/// Counts `spans` exported to the trace collector (`sent` or `failed`).
pub(crate) fn record_trace_export(result: &'static str, spans: usize) {
    counter!(TRACE_SPANS, "result" => result).increment(spans as u64);
}

/// Sets the shared store's breaker gauge; called on scrape.
pub(crate) fn refresh_store(backend: &Backend) {
    if let Backend::Redis(store) = backend {
        gauge!(STORE_CIRCUIT_OPEN).set(store.open_breakers() as f64);
        counter!(REMEMBERED_REJECTIONS).absolute(store.rejections_answered());
        if store.token_batch_ttl().is_some() {
            let batches = store.token_batch_stats();
            counter!(TOKEN_BATCHES).absolute(batches.batches);
            counter!(BATCHED_TOKENS_TAKEN).absolute(batches.taken);
            for (outcome, tokens) in [
                ("spent", batches.spent),
                ("returned", batches.returned),
                ("lost", batches.lost),
            ] {
                counter!(BATCHED_TOKENS, "outcome" => outcome).absolute(tokens);
            }
            gauge!(BATCHED_TOKENS_HELD).set(batches.held as f64);
        }
    }
}

/// Sets the open-connection gauges; called on scrape.
pub(crate) fn refresh_connections(connections: &Connections) {
    for (listener, gate) in [
        (Listener::Http, &connections.http),
        (Listener::Grpc, &connections.grpc),
    ] {
        gauge!(CONNECTIONS_OPEN, "listener" => listener.as_str()).set(gate.open() as f64);
    }
    for (listener, tls) in [
        (Listener::Http, &connections.http_tls),
        (Listener::Grpc, &connections.grpc_tls),
    ] {
        if let Some(expires) = tls.as_ref().and_then(|tls| tls.expires()) {
            gauge!(TLS_EXPIRY, "listener" => listener.as_str()).set(expires as f64);
        }
    }
}

/// Refreshes the figures read from state rather than counted as they happen; called on scrape.
/// `previous` remembers the version last exported, to retire its series.
pub fn refresh(engine: &PolicyEngine, previous: &mut Option<String>) {
    let status = engine.status();
    let version = status.version.as_str();
    counter!(POLICY_CHANGES).absolute(status.changes);
    gauge!(POLICY_REFUSED).set(if status.last_error.is_some() {
        1.0
    } else {
        0.0
    });
    gauge!(SHADOW_ALL).set(if status.shadow_all.is_some() {
        1.0
    } else {
        0.0
    });
    let stats = engine.memory_stats();
    gauge!(LIVE_BUCKETS).set(stats.live_buckets as f64);
    gauge!(LIVE_LEASES).set(engine.live_leases() as f64);
    counter!(EVICTIONS).absolute(stats.evicted);
    counter!(EXPIRED).absolute(stats.expired);
    if previous.as_deref() != Some(version) {
        if let Some(old) = previous.take() {
            // Shown at 0 for a while, then dropped when idle (GAUGE_IDLE_TIMEOUT).
            gauge!(POLICY_INFO, "version" => old).set(0.0);
        }
        *previous = Some(version.to_owned());
    }
    // Set on every scrape, so that the version in force never goes idle.
    gauge!(POLICY_INFO, "version" => version.to_owned()).set(1.0);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ALL` holds every name this file gives a metric, so a check against it is complete.
    #[test]
    fn all_lists_every_metric_named_here() {
        let source = include_str!("metrics.rs");
        let named: Vec<&str> = source
            .lines()
            .filter_map(|line| line.strip_prefix("pub const "))
            .filter_map(|line| line.split_once(": &str = \"tollgate_"))
            .filter_map(|(_, rest)| rest.split_once('"'))
            .map(|(name, _)| name)
            .collect();
        assert_eq!(named.len(), ALL.len(), "{named:?}");
        for name in named {
            assert!(
                ALL.contains(&format!("tollgate_{name}").as_str()),
                "{name} not in ALL"
            );
        }
    }

    /// `near` is envoyproxy/ratelimit's `used > floor(capacity × ratio)`, in integers, at every
    /// ratio and capacity tried (the ratio is process-wide: set and read back in one test).
    #[test]
    fn near_is_past_the_floor_of_the_share() {
        for permille in [1, 333, 500, 800, 999, 1_000] {
            set_near_limit_ratio(permille);
            for capacity in 0..=40u64 {
                let threshold = capacity * u64::from(permille) / 1_000;
                for used in 0..=capacity {
                    assert_eq!(
                        near(used, capacity),
                        used > threshold,
                        "{used} of {capacity} at {permille}"
                    );
                }
            }
        }
        assert!(!near(u64::MAX, u64::MAX), "1,000 thousandths count nothing");
        set_near_limit_ratio(DEFAULT_NEAR_PERMILLE);
        assert!(near(u64::MAX, u64::MAX) && !near(4, 5) && near(5, 5));
    }
    use std::sync::Arc;
    use tollgate_policy::{EngineOptions, compile};

    const POLICY: &str =
        "version: v1\nlimits: [{name: l, domain: api, key: [user], capacity: 1, refill: 1/s}]\n";

    /// Each thread counts through handles of its own: every decision still lands in its own
    /// series (limit and result), whichever thread recorded it and in whatever order the threads
    /// met the series, and a thread that starts late joins the same series.
    #[test]
    fn decisions_recorded_on_many_threads_land_in_their_own_series() {
        const TWO: &str = "version: v1\nlimits:\n  - {name: a, domain: api, key: [user], capacity: 2, refill: 1/d}\n  - {name: b, domain: api, key: [team], capacity: 1, refill: 1/d}\n";
        let recorder = builder(GAUGE_IDLE_TIMEOUT).unwrap().build_recorder();
        let handle = recorder.handle();
        let engine = PolicyEngine::new(compile("p.yaml", TWO).unwrap(), EngineOptions::default());
        // On thread t, user i of limit a: allowed twice, then rejected; team t of limit b once
        // allowed, then rejected. Threads take the two limits in opposite orders.
        let work = |t: usize| {
            metrics::with_local_recorder(&recorder, || {
                for round in 0..3 {
                    for i in 0..10 {
                        let user = [("user".to_owned(), format!("{t}-{i}"))];
                        let team = [("team".to_owned(), format!("{t}-{i}"))];
                        let order = if t.is_multiple_of(2) {
                            [&user, &team]
                        } else {
                            [&team, &user]
                        };
                        for descriptor in order {
                            let outcome = engine
                                .decide("api", &[descriptor], 1, None)
                                .map_err(DecideError::Invalid);
                            if round < 2 || descriptor == &user {
                                record_decision(Api::Grpc, "memory", Duration::ZERO, &outcome);
                            }
                        }
                    }
                }
            });
        };
        std::thread::scope(|scope| {
            for t in 0..4 {
                scope.spawn(move || work(t));
            }
        });
        std::thread::scope(|scope| {
            scope.spawn(|| work(4));
        });
        let rendered = handle.render();
        let value = |limit: &str, result: &str| -> u64 {
            let series = format!(
                "tollgate_decisions_total{{limit=\"{limit}\",result=\"{result}\",mode=\"enforce\",api=\"grpc\"}} "
            );
            rendered
                .lines()
                .find_map(|line| line.strip_prefix(&series))
                .and_then(|value| value.parse().ok())
                .unwrap_or_else(|| panic!("no {series} in\n{rendered}"))
        };
        // 5 threads x 10 keys: a twice allowed and once rejected each; b once allowed, and
        // once rejected (its third round is not recorded).
        assert_eq!(value("a", "allowed"), 100);
        assert_eq!(value("a", "rejected"), 50);
        assert_eq!(value("b", "allowed"), 50);
        assert_eq!(value("b", "rejected"), 50);
        assert!(
            rendered.contains(
                r#"tollgate_decision_duration_seconds_count{api="grpc",store="memory"} 250"#
            ),
            "{rendered}"
        );
    }

    /// A version no longer in force shows at 0, then goes: its series must not pile up, one per
    /// version ever loaded. The version in force stays however long the scrapes are apart.
    #[test]
    // Waiting out the idle timeout needs real time: the exporter reads its own clock.
    #[allow(clippy::disallowed_methods)]
    fn old_policy_versions_leave_the_export() {
        let idle = Duration::from_secs(1);
        let recorder = builder(idle).unwrap().build_recorder();
        let handle = recorder.handle();
        let policy = compile("p.yaml", POLICY).unwrap();
        let engine = Arc::new(PolicyEngine::new(policy, EngineOptions::default()));
        let mut previous = None;
        let scrape = |previous: &mut Option<String>| {
            metrics::with_local_recorder(&recorder, || refresh(&engine, previous));
            handle.render()
        };
        assert!(scrape(&mut previous).contains(r#"tollgate_policy_info{version="v1"} 1"#));
        engine.load("p.yaml", &POLICY.replace("v1", "v2")).unwrap();
        let both = scrape(&mut previous);
        assert!(
            both.contains(r#"tollgate_policy_info{version="v1"} 0"#),
            "{both}"
        );
        assert!(
            both.contains(r#"tollgate_policy_info{version="v2"} 1"#),
            "{both}"
        );
        std::thread::sleep(idle * 2);
        let after = scrape(&mut previous);
        assert!(!after.contains(r#"version="v1""#), "{after}");
        assert!(
            after.contains(r#"tollgate_policy_info{version="v2"} 1"#),
            "{after}"
        );
    }
}
