//! Envoy's Rate Limit Service v3 (`envoy.service.ratelimit.v3.RateLimitService`), so Envoy,
//! Istio, Gloo and Contour can use tollgate unchanged.
//!
//! What Envoy expects, and how it maps onto tollgate:
//!
//! * `hits_addend` is the cost; Envoy sends 0 (or nothing) to mean 1. A descriptor may carry its
//!   own `hits_addend`, which wins; 0 there means "check only, charge nothing" (would one more
//!   hit pass?). All descriptors are decided together, all or nothing: the check-only ones
//!   first, then the charged ones in one decision with a cost each, charged only if every
//!   check passed; a rejected request is charged nowhere.
//! * `statuses` has one entry per request descriptor, in order. A descriptor no limit applies
//!   to gets `OK`; otherwise its most constrained enforced limit fills `current_limit` (with its
//!   name), `limit_remaining` and `duration_until_reset`, from which Envoy builds its own
//!   `X-RateLimit-*` headers when asked to. The rate-limit fields of the server's style
//!   (`--rate-limit-headers`: the IETF `RateLimit-Policy`/`RateLimit` by default, or tollgate's
//!   own `X-RateLimit-*`, both, or none) go in `response_headers_to_add`.
//! * A descriptor with `is_negative_hits` gives its hits back rather than taking them (Envoy
//!   sends them once a response shows its request cost less than it was charged). Refused with
//!   `INVALID_ARGUMENT` unless the server is started with `--negative-hits give-back`: the
//!   hits then go back, before anything else of the call is decided, to the buckets a check of
//!   the descriptor charges, never past full ([`tollgate::Store::give_back`]), and its status
//!   is `OK` with the standing afterwards. A store that cannot take them back loses them
//!   (under-admitting), counted as a store error, and the rest of the call is decided as
//!   usual.
//! * Never `UNKNOWN`. An unknown domain answers `OK`. A `hits_addend` above a limit's capacity
//!   can never pass: the request's charged descriptors answer `OVER_LIMIT` (as a gRPC error,
//!   Envoy would let the request through).
//! * When the shared store is down, a limit that fails closed answers `OVER_LIMIT` with the
//!   response header `x-tollgate-unavailable: store` (so logs tell an outage from a quota). We
//!   deliberately do not answer a gRPC error: Envoy treats an error as "allow" unless its own
//!   `failure_mode_deny` is set, which would quietly turn a closed limit open. Limits that fail
//!   open are decided by their emergency budgets and answer as usual.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit, rate_limit::Unit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::envoy::r#type::v3::RateLimitUnit;
use tollgate::{Decision, Limit};
use tollgate_policy::{
    Costs, Error as PolicyError, LimitOutcome, Outcome, RequestDescriptor, RequestedLimit,
};
use tonic::{Request, Response, Status};

use crate::decider::{DecideError, Decider, Request as Decide};
use crate::http::{MAX_DESCRIPTORS, MAX_ENTRIES, MAX_NAME_BYTES, MAX_VALUE_BYTES, NegativeHits};
use crate::metrics::{self, Api};
use tollgate_tower::HeaderStyle;
use tollgate_tower::headers as fields;

/// The gRPC service.
pub struct Rls {
    decider: Arc<Decider>,
    /// The rate-limit fields put in `response_headers_to_add`.
    header_style: HeaderStyle,
    /// Whether a descriptor's own `limit` has been reported as ignored (once per process).
    told_limit_ignored: AtomicBool,
    /// What a descriptor whose hits are given back does.
    negative_hits: NegativeHits,
}

impl Rls {
    /// A service deciding through `decider`.
    pub fn new(decider: Arc<Decider>) -> Self {
        Self {
            decider,
            header_style: HeaderStyle::default(),
            told_limit_ignored: AtomicBool::new(false),
            negative_hits: NegativeHits::default(),
        }
    }

    /// The same service, treating descriptors whose hits are given back (`is_negative_hits`)
    /// as `negative_hits` says (default: refused).
    pub fn with_negative_hits(mut self, negative_hits: NegativeHits) -> Self {
        self.negative_hits = negative_hits;
        self
    }

    /// The same service, answering with the rate-limit fields of `style` in
    /// `response_headers_to_add` (default: the draft's).
    pub fn with_header_style(mut self, style: HeaderStyle) -> Self {
        self.header_style = style;
        self
    }

    /// Envoy's `limit` rate-limit action (from dynamic metadata) sends a limit with the
    /// descriptor, which envoyproxy/ratelimit applies instead of its configuration. tollgate
    /// applies it only in the limits that say `request_limit: apply`, so that no caller sets
    /// its own limit unasked; an operator moving such a setup over must hear, once, that in a
    /// domain without such a limit the limit sent does nothing.
    fn tell_limit_ignored(&self, request: &RateLimitRequest, applied: bool) {
        let Some(limit) = request.descriptors.iter().find_map(|d| d.limit.as_ref()) else {
            return;
        };
        if !applied && !self.told_limit_ignored.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                domain = %request.domain,
                requests_per_unit = limit.requests_per_unit,
                "an RLS descriptor carries its own limit (Envoy's `limit` action), and no limit \
                 of its domain applies one: tollgate decides by its policy and ignores it; \
                 write `request_limit: apply` on the limits that should take it \
                 (said once per process)"
            );
        }
    }

    /// The tonic server for this service.
    pub fn into_server(self) -> RateLimitServiceServer<Self> {
        RateLimitServiceServer::new(self)
    }

    /// The tonic server for this service, shared with the calls answered without it.
    pub(crate) fn server(rls: Arc<Self>) -> RateLimitServiceServer<Self> {
        RateLimitServiceServer::from_arc(rls)
    }
}

fn invalid(message: impl Into<String>) -> Status {
    Status::invalid_argument(message.into())
}

/// The gRPC status of a request that could not be decided.
fn status(err: DecideError) -> Status {
    match err {
        DecideError::Invalid(err) => invalid(err.to_string()),
        DecideError::Unavailable(reason) => {
            Status::unavailable(format!("store unavailable: {reason}"))
        }
        DecideError::Internal(err) => Status::internal(err.to_string()),
    }
}

/// A descriptor as the policy reads it: its entries and the limit it carries, if any.
type Sent = RequestDescriptor<String>;

/// Why a limit sent with a descriptor cannot be applied.
#[derive(Debug, thiserror::Error)]
enum SentLimitError {
    #[error("unit {0} is not a known unit")]
    UnknownUnit(i32),
    /// Not a limit the core (or the store) can keep exactly.
    #[error(transparent)]
    Unrepresentable(#[from] tollgate::Error),
}

/// The limit a descriptor carries, as tollgate's: `requests_per_unit` a unit is a bucket of
/// that many refilled as many a unit, as a `rate_limit` of envoyproxy/ratelimit's file is
/// imported (a month is 30 days and a year 365, as there), and 0, Envoy's "deny all", a
/// denial.
fn requested_limit(sent: &RateLimitOverride) -> Result<RequestedLimit, SentLimitError> {
    const DAY: u64 = 86_400;
    let seconds = match RateLimitUnit::try_from(sent.unit) {
        Ok(RateLimitUnit::Second) => 1,
        Ok(RateLimitUnit::Minute) => 60,
        Ok(RateLimitUnit::Hour) => 3_600,
        Ok(RateLimitUnit::Day) => DAY,
        Ok(RateLimitUnit::Month) => 30 * DAY,
        Ok(RateLimitUnit::Year) => 365 * DAY,
        Ok(RateLimitUnit::Unknown) | Err(_) => return Err(SentLimitError::UnknownUnit(sent.unit)),
    };
    if sent.requests_per_unit == 0 {
        return Ok(RequestedLimit::Deny);
    }
    Ok(RequestedLimit::Rate(Limit::per(
        u64::from(sent.requests_per_unit),
        Duration::from_secs(seconds),
    )?))
}

/// A descriptor as parsed: what it names, its hits, and whether they are given back.
struct Parsed {
    sent: Sent,
    hits: u64,
    given_back: bool,
}

/// Descriptors and their costs, checked against the same bounds as the HTTP API. The
/// descriptors are taken out of `request`: their strings move rather than copy. The limits
/// they carry are read only where a limit applies them (`applied`), and refused then when they
/// cannot be: elsewhere they change nothing, so they fail nothing either. Hits given back are
/// refused unless `negative_hits` lets them through.
fn parse(
    request: &mut RateLimitRequest,
    applied: bool,
    decider: &Decider,
    negative_hits: NegativeHits,
) -> Result<Vec<Parsed>, Status> {
    if request.domain.is_empty() || request.domain.len() > MAX_NAME_BYTES {
        return Err(invalid(format!(
            "domain must be 1 to {MAX_NAME_BYTES} bytes"
        )));
    }
    if request.descriptors.len() > MAX_DESCRIPTORS {
        return Err(invalid(format!("at most {MAX_DESCRIPTORS} descriptors")));
    }
    // Envoy: a request hits_addend of 0 means 1.
    let default_cost = u64::from(request.hits_addend.max(1));
    std::mem::take(&mut request.descriptors)
        .into_iter()
        .enumerate()
        .map(|(index, descriptor)| {
            if descriptor.entries.len() > MAX_ENTRIES {
                return Err(invalid(format!(
                    "descriptors[{index}]: at most {MAX_ENTRIES} entries"
                )));
            }
            // Envoy's newer refunds: the hits given back rather than taken. Read as an ordinary
            // descriptor (as before the field existed), a refund would charge its subject
            // instead. Giving back with no record of the charge trusts the caller, so it is
            // the operator's to switch on; otherwise the call is refused, charging nothing.
            if descriptor.is_negative_hits && negative_hits == NegativeHits::Refuse {
                return Err(invalid(format!(
                    "descriptors[{index}]: is_negative_hits (giving hits back) is refused by \
                     this server (start it with --negative-hits give-back to allow it); \
                     nothing was charged"
                )));
            }
            let mut entries = Vec::with_capacity(descriptor.entries.len());
            for entry in descriptor.entries {
                if entry.key.is_empty() || entry.key.len() > MAX_NAME_BYTES {
                    return Err(invalid(format!(
                        "descriptors[{index}]: entry keys must be 1 to {MAX_NAME_BYTES} bytes"
                    )));
                }
                if entry.value.len() > MAX_VALUE_BYTES {
                    return Err(invalid(format!(
                        "descriptors[{index}]: entry values must be at most {MAX_VALUE_BYTES} bytes"
                    )));
                }
                entries.push((entry.key, entry.value));
            }
            let limit = match descriptor.limit.as_ref().filter(|_| applied) {
                Some(sent) => Some(
                    requested_limit(sent)
                        .and_then(|limit| {
                            // A denial needs no store, so any store supports it.
                            if let RequestedLimit::Rate(rate) = &limit {
                                decider.supports(rate)?;
                            }
                            Ok(limit)
                        })
                        .map_err(|reason| {
                            invalid(format!("descriptors[{index}].limit: {reason}"))
                        })?,
                ),
                None => None,
            };
            // A descriptor's own hits_addend wins, and 0 there means check only.
            let cost = descriptor
                .hits_addend
                .as_ref()
                .map_or(default_cost, |hits| hits.value);
            Ok(Parsed {
                sent: RequestDescriptor { entries, limit },
                hits: cost,
                given_back: descriptor.is_negative_hits,
            })
        })
        .collect()
}

/// Envoy's `current_limit`: the refill as requests per whole unit. Envoy can only say "N per
/// second/minute/hour/day", so the smallest unit at least as long as the refill period in which
/// the refill is a whole number is used (`600/m` stays 600 per minute), falling back to a
/// per-day figure rounded down.
fn current_limit(name: &str, decision: &Decision) -> RateLimit {
    if decision.is_denied() {
        // Envoy's own way of saying "deny all": 0 requests a second.
        return RateLimit {
            name: name.to_owned(),
            requests_per_unit: 0,
            unit: Unit::Second as i32,
        };
    }
    let refill = decision.limit().refill();
    let period = refill.period().as_nanos();
    let units = [
        (Unit::Second, 1_000_000_000u128),
        (Unit::Minute, 60_000_000_000),
        (Unit::Hour, 3_600_000_000_000),
        (Unit::Day, 86_400_000_000_000),
    ];
    let (unit, per_unit) = units
        .iter()
        .filter(|(_, unit_ns)| *unit_ns >= period)
        .find(|(_, unit_ns)| (u128::from(refill.amount()) * unit_ns) % period == 0)
        .map(|&(unit, unit_ns)| (unit, u128::from(refill.amount()) * unit_ns / period))
        .unwrap_or((
            Unit::Day,
            u128::from(refill.amount()) * 86_400_000_000_000 / period,
        ));
    RateLimit {
        name: name.to_owned(),
        requests_per_unit: u32::try_from(per_unit).unwrap_or(u32::MAX),
        unit: unit as i32,
    }
}

fn duration(d: Duration) -> envoy_types::pb::google::protobuf::Duration {
    envoy_types::pb::google::protobuf::Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

fn header(key: &str, value: String) -> HeaderValue {
    HeaderValue {
        key: key.to_owned(),
        value,
        ..HeaderValue::default()
    }
}

/// A descriptor's status: its most constrained enforced limit (rejected first, then the fewest
/// tokens left).
fn status_of(limits: &[&LimitOutcome], failed_closed: bool) -> DescriptorStatus {
    let enforced = limits
        .iter()
        .filter(|limit| limit.mode == "enforce")
        .filter_map(|limit| limit.decision.as_ref().map(|d| (&*limit.name, d)))
        .min_by_key(|(_, d)| (d.allowed(), d.remaining()));
    let over = failed_closed || enforced.is_some_and(|(_, d)| !d.allowed());
    let mut status = DescriptorStatus {
        code: if over { Code::OverLimit } else { Code::Ok } as i32,
        ..DescriptorStatus::default()
    };
    if let Some((name, decision)) = enforced {
        status.current_limit = Some(current_limit(name, decision));
        status.limit_remaining = u32::try_from(decision.remaining()).unwrap_or(u32::MAX);
        // A denial does not reset: no duration to wait out.
        if !decision.is_denied() {
            let until = decision
                .retry_after()
                .unwrap_or_else(|| decision.reset_after());
            status.duration_until_reset = Some(duration(until));
        }
    }
    status
}

#[tonic::async_trait]
impl RateLimitService for Rls {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        self.decide(request.into_inner()).await.map(Response::new)
    }
}

impl Rls {
    /// Answers one `ShouldRateLimit` call: through tonic's server ([`RateLimitService`]) or
    /// straight from the connection ([`crate::grpc_unary`]).
    pub(crate) async fn decide(
        &self,
        mut request: RateLimitRequest,
    ) -> Result<RateLimitResponse, Status> {
        // The policy is read only when a descriptor carries a limit (rare), and the limits
        // decide by the version in force when they are decided, as always.
        let applied = request.descriptors.iter().any(|d| d.limit.is_some())
            && self
                .decider
                .engine()
                .current()
                .applies_request_limits(&request.domain);
        self.tell_limit_ignored(&request, applied);
        let descriptors = parse(&mut request, applied, &self.decider, self.negative_hits)
            .inspect_err(|_| metrics::record_invalid(Api::Grpc))?;
        let count = descriptors.len();

        // Hits given back go back first: they return what earlier requests took. Check-only
        // descriptors (`hits_addend: 0`, given back or not) are decided next, charging nothing;
        // the charged ones then go in one decision with a cost each, all or nothing, and are
        // charged only if every check passed: a rejected request is charged nowhere.
        let (mut checked, mut charged) = ((Vec::new(), Vec::new()), (Vec::new(), Vec::new()));
        let mut returned = (Vec::new(), Vec::new());
        let (mut costs, mut returned_costs) = (Vec::with_capacity(count), Vec::new());
        for (index, parsed) in descriptors.into_iter().enumerate() {
            let (indexes, group) = if parsed.hits == 0 {
                &mut checked
            } else if parsed.given_back {
                returned_costs.push(parsed.hits);
                &mut returned
            } else {
                costs.push(parsed.hits);
                &mut charged
            };
            indexes.push(index);
            group.push(parsed.sent);
        }
        let mut decided: Vec<(Vec<usize>, Outcome)> = Vec::with_capacity(3);
        let mut impossible: Vec<usize> = Vec::new();
        if !returned.0.is_empty() {
            let give_back = Decide {
                domain: &request.domain,
                descriptors: &returned.1,
                cost: Costs::Each(&returned_costs),
                request_id: None,
            };
            match self.decider.give_back(&give_back).await {
                Ok(outcome) => decided.push((returned.0, outcome)),
                // Lost, which under-admits; the store error is counted (logged at debug only:
                // an outage would log every call). The call's checks meet the outage
                // themselves, each limit by its failure mode.
                Err(DecideError::Unavailable(reason)) => {
                    tracing::debug!(%reason, "hits given back lost: the store cannot answer");
                }
                Err(err) => return Err(status(err)),
            }
        }
        if !checked.0.is_empty() {
            let check = Decide {
                domain: &request.domain,
                descriptors: &checked.1,
                cost: Costs::Same(1),
                request_id: None,
            };
            let outcome = self.decider.check_only(&check).await.map_err(status)?;
            decided.push((checked.0, outcome));
        }
        if !charged.0.is_empty() {
            let decide = Decide {
                domain: &request.domain,
                descriptors: &charged.1,
                cost: Costs::Each(&costs),
                request_id: None,
            };
            let outcome = if decided.iter().all(|(_, outcome)| outcome.allowed) {
                self.decider.decide(Api::Grpc, &decide).await
            } else {
                self.decider.check_only(&decide).await
            };
            match outcome {
                Ok(outcome) => decided.push((charged.0, outcome)),
                // More hits than a limit can ever hold: OVER_LIMIT, which Envoy enforces. As a
                // gRPC error it would let the request through (Envoy allows on errors unless
                // `failure_mode_deny`), so a large enough hits_addend would pass any limit.
                Err(DecideError::Invalid(PolicyError::Check {
                    source: tollgate::Error::InvalidCost { .. },
                    ..
                })) => impossible = charged.0,
                Err(err) => return Err(status(err)),
            }
        }

        // A descriptor fails closed when one of its own enforced limits went undecided because
        // the store was down; a descriptor no limit applies to stays OK.
        let failed_closed = decided.iter().any(|(_, outcome)| outcome.failed_closed);
        let mut per_descriptor: Vec<(Vec<&LimitOutcome>, bool)> = vec![(Vec::new(), false); count];
        for (indexes, outcome) in &decided {
            for limit in &outcome.limits {
                if let Some((limits, closed)) = indexes
                    .get(limit.descriptor)
                    .and_then(|&index| per_descriptor.get_mut(index))
                {
                    *closed |= outcome.failed_closed
                        && limit.mode == "enforce"
                        && limit.decision.is_none();
                    limits.push(limit);
                }
            }
        }

        let mut statuses: Vec<DescriptorStatus> = per_descriptor
            .iter()
            .map(|(limits, closed)| status_of(limits, *closed))
            .collect();
        for &index in &impossible {
            if let Some(status) = statuses.get_mut(index) {
                status.code = Code::OverLimit as i32;
            }
        }
        let over = failed_closed || statuses.iter().any(|s| s.code == Code::OverLimit as i32);
        let mut response_headers = Vec::new();
        let enforced: Vec<(&str, &Decision)> = per_descriptor
            .iter()
            .flat_map(|(limits, _)| limits)
            .filter(|limit| limit.mode == "enforce")
            .filter_map(|limit| limit.decision.as_ref().map(|d| (&*limit.name, d)))
            .collect();
        if self.header_style.ietf()
            && let Some((policy, state)) = fields::rate_limit_headers(enforced.iter().copied())
        {
            // The values are visible ASCII by construction.
            for (name, value) in [("ratelimit-policy", policy), ("ratelimit", state)] {
                if let Ok(value) = value.to_str() {
                    response_headers.push(header(name, value.to_owned()));
                }
            }
        }
        if self.header_style.x_rate_limit()
            && let Some(figures) = fields::x_rate_limit(enforced.iter().copied())
        {
            for (name, value) in figures.fields() {
                if let Ok(value) = value.to_str() {
                    response_headers.push(header(name.as_str(), value.to_owned()));
                }
            }
        }
        if failed_closed {
            response_headers.push(header("x-tollgate-unavailable", "store".to_owned()));
        }
        Ok(RateLimitResponse {
            overall_code: if over { Code::OverLimit } else { Code::Ok } as i32,
            statuses,
            response_headers_to_add: response_headers,
            ..RateLimitResponse::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate::{Limit, Timestamp, bucket};

    fn decision(capacity: u64, rate: &str) -> Decision {
        let limit = Limit::new(capacity, rate.parse().unwrap()).unwrap();
        bucket::peek(&limit, None, Timestamp::ZERO, 1).unwrap()
    }

    #[test]
    fn a_limit_sent_is_a_bucket_refilled_per_unit() {
        let sent = |requests_per_unit, unit: RateLimitUnit| RateLimitOverride {
            requests_per_unit,
            unit: unit as i32,
        };
        let day = 86_400;
        for (requests, unit, seconds) in [
            (5, RateLimitUnit::Second, 1),
            (100, RateLimitUnit::Minute, 60),
            (7, RateLimitUnit::Hour, 3_600),
            (1, RateLimitUnit::Day, day),
            (3, RateLimitUnit::Month, 30 * day),
            (u32::MAX, RateLimitUnit::Year, 365 * day),
        ] {
            let Ok(RequestedLimit::Rate(limit)) = requested_limit(&sent(requests, unit)) else {
                panic!("{requests} a {unit:?} is a rate");
            };
            assert_eq!(limit.capacity(), u64::from(requests));
            assert_eq!(limit.refill().amount(), u64::from(requests));
            assert_eq!(limit.refill().period(), Duration::from_secs(seconds));
        }
        // Envoy's "deny all", whatever the unit.
        for unit in [RateLimitUnit::Second, RateLimitUnit::Year] {
            assert_eq!(
                requested_limit(&sent(0, unit)).ok(),
                Some(RequestedLimit::Deny)
            );
        }
        for (limit, fragment) in [
            (
                sent(10, RateLimitUnit::Unknown),
                "unit 0 is not a known unit",
            ),
            (
                RateLimitOverride {
                    requests_per_unit: 10,
                    unit: 42,
                },
                "unit 42",
            ),
        ] {
            let err = requested_limit(&limit).unwrap_err().to_string();
            assert!(err.contains(fragment), "{err}");
        }
    }

    /// Each bound of a request (the HTTP API's too) holds at its value and refuses one past
    /// it, as an invalid argument naming what is wrong.
    #[test]
    fn requests_are_refused_just_past_each_bound() {
        use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
        use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
        use tollgate_policy::{EngineOptions, PolicyEngine, compile};

        use crate::decider::Backend;

        let policy = compile("p.yaml", "limits: []").expect("policy");
        let engine = Arc::new(PolicyEngine::new(policy, EngineOptions::default()));
        let decider = Decider::new(engine, Backend::Memory);
        let entry = |key: String, value: String| Entry { key, value };
        let request = |domain: String, descriptors: Vec<Vec<Entry>>| RateLimitRequest {
            domain,
            descriptors: descriptors
                .into_iter()
                .map(|entries| RateLimitDescriptor {
                    entries,
                    ..RateLimitDescriptor::default()
                })
                .collect(),
            ..RateLimitRequest::default()
        };
        let many = |count| vec![entry("k".to_owned(), "v".to_owned()); count];
        let one = || many(1);
        let fine = [
            request("d".repeat(MAX_NAME_BYTES), vec![one()]),
            request("d".to_owned(), vec![one(); MAX_DESCRIPTORS]),
            request("d".to_owned(), vec![many(MAX_ENTRIES)]),
            request(
                "d".to_owned(),
                vec![vec![entry("k".repeat(MAX_NAME_BYTES), String::new())]],
            ),
            request(
                "d".to_owned(),
                vec![vec![entry("k".to_owned(), "v".repeat(MAX_VALUE_BYTES))]],
            ),
        ];
        for mut request in fine {
            let sizes = (request.domain.len(), request.descriptors.len());
            assert!(
                parse(&mut request, false, &decider, NegativeHits::Refuse).is_ok(),
                "{sizes:?}"
            );
        }
        let refused = [
            (
                request(String::new(), vec![one()]),
                "domain must be 1 to 256",
            ),
            (
                request("d".repeat(MAX_NAME_BYTES + 1), vec![one()]),
                "domain must be 1 to 256",
            ),
            (
                request("d".to_owned(), vec![one(); MAX_DESCRIPTORS + 1]),
                "at most 32 descriptors",
            ),
            (
                request("d".to_owned(), vec![one(), many(MAX_ENTRIES + 1)]),
                "descriptors[1]: at most 32 entries",
            ),
            (
                request(
                    "d".to_owned(),
                    vec![vec![entry(String::new(), "v".to_owned())]],
                ),
                "descriptors[0]: entry keys must be 1 to 256",
            ),
            (
                request(
                    "d".to_owned(),
                    vec![vec![entry("k".repeat(MAX_NAME_BYTES + 1), "v".to_owned())]],
                ),
                "descriptors[0]: entry keys must be 1 to 256",
            ),
            (
                request(
                    "d".to_owned(),
                    vec![vec![entry("k".to_owned(), "v".repeat(MAX_VALUE_BYTES + 1))]],
                ),
                "descriptors[0]: entry values must be at most 1024",
            ),
            (
                {
                    let mut refund = request("d".to_owned(), vec![one(), one()]);
                    refund.descriptors[1].is_negative_hits = true;
                    refund
                },
                "descriptors[1]: is_negative_hits (giving hits back) is refused by this server",
            ),
        ];
        for (request, message) in refused {
            let Err(status) = parse(&mut request.clone(), false, &decider, NegativeHits::Refuse)
            else {
                panic!("{message}: accepted");
            };
            assert_eq!(status.code(), tonic::Code::InvalidArgument, "{message}");
            assert!(status.message().starts_with(message), "{status:?}");
            // Allowing hits given back changes nothing else.
            let allowed = parse(
                &mut request.clone(),
                false,
                &decider,
                NegativeHits::GiveBack,
            );
            assert_eq!(
                allowed.is_err(),
                !message.contains("is_negative_hits"),
                "{message}"
            );
        }
    }

    #[test]
    fn current_limit_picks_a_whole_unit() {
        let cases = [
            ("10/s", 10, Unit::Second),
            ("600/m", 600, Unit::Minute),
            ("1/m", 1, Unit::Minute),
            ("5/100ms", 50, Unit::Second),
            ("1/d", 1, Unit::Day),
            ("7/2h", 84, Unit::Day),
            ("1/7s", 12_342, Unit::Day),
        ];
        for (rate, per_unit, unit) in cases {
            let limit = current_limit("l", &decision(10, rate));
            assert_eq!(
                (limit.requests_per_unit, limit.unit),
                (per_unit, unit as i32),
                "{rate}"
            );
        }
    }
}
