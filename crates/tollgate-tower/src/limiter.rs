//! The decision behind the layer: one state shared by every clone of the service.
//!
//! [`Shared`] holds what decides (a single limit on a store, or a policy engine), how a request
//! becomes a key or descriptors and a cost, and turns each outcome into either "call the
//! service, adding these headers" or a finished response (429, 503, 400). Memory-backed
//! decisions complete inside `call`, without boxing or waiting; Redis-backed ones return a
//! [`Pending`] step that the service finishes in a boxed future.

use std::fmt::Write as _;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, Response, StatusCode};
use tollgate::{CheckRequest, Clock, Decision, Limit, LocalStore, Take};
use tollgate_policy::PolicyEngine;

use crate::error::Error;
use crate::extract::{KeyExtractor, MissingKey, RequestHead};
use crate::headers::{
    HeaderStyle, RATELIMIT, RATELIMIT_POLICY, XRateLimit, rate_limit_headers, rate_limit_value,
    retry_after_secs, x_rate_limit,
};
use crate::reservation::{Reservation, Reserved, next_id};

/// One descriptor of a request, for a policy: `(entry, value)` pairs such as
/// `[("user", "u1"), ("route", "/v1/payments")]`.
pub type Descriptor = Vec<(String, String)>;

pub(crate) type CostFn = Box<dyn Fn(&RequestHead<'_>) -> u64 + Send + Sync>;
pub(crate) type DescriptorFn =
    Box<dyn Fn(&RequestHead<'_>) -> Result<Vec<Descriptor>, Error> + Send + Sync>;

/// The rate-limit fields added to an admitted request's response.
#[derive(Default)]
pub(crate) struct Headers {
    /// `RateLimit-Policy` and `RateLimit`.
    pub(crate) ietf: Option<(HeaderValue, HeaderValue)>,
    /// `X-RateLimit-*`.
    pub(crate) x: Option<XRateLimit>,
}

/// What to do with a request.
pub(crate) enum Verdict {
    /// Call the service, and add these headers to its response; with reservations, put this
    /// one in the request's extensions first.
    Allow(Headers, Option<Reservation>),
    /// Answer this instead of calling the service.
    Answer(Response<Bytes>),
}

/// How far `call` got.
pub(crate) enum Step {
    Done(Verdict),
    /// The store must be waited on.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    Pending(Pending),
}

/// A decision waiting on a shared store, with everything it needs from the request (which
/// moves on to the inner service).
pub(crate) enum Pending {
    #[cfg(feature = "redis")]
    Single {
        key: String,
        cost: u64,
        id: Option<String>,
    },
    #[cfg(feature = "redis")]
    Policy {
        descriptors: Vec<Descriptor>,
        cost: u64,
        id: Option<String>,
    },
}

/// The state every clone of the layer and its services share, for the life of the layer.
pub(crate) struct Shared {
    pub(crate) limiter: Limiter,
    pub(crate) cost: Option<CostFn>,
    pub(crate) headers_on_success: bool,
    /// Which rate-limit fields answers carry.
    pub(crate) header_style: HeaderStyle,
    /// Whether admitted requests are reservations, settled by the handler (see
    /// [`Reservation`]).
    pub(crate) reservations: bool,
}

pub(crate) enum Limiter {
    Single(Single),
    Policy(Policy),
}

pub(crate) struct Single {
    pub(crate) name: Arc<str>,
    pub(crate) limit: Limit,
    pub(crate) key: Box<dyn KeyExtractor>,
    pub(crate) missing: MissingKey,
    pub(crate) store: SingleStore,
    /// The limit's `RateLimit-Policy` value, which never changes: built once.
    pub(crate) policy_field: Option<HeaderValue>,
}

pub(crate) enum SingleStore {
    Memory(LocalStore<Arc<dyn Clock>>),
    #[cfg(feature = "redis")]
    Redis {
        failover: Box<tollgate_redis::Failover<tollgate_redis::RedisStore>>,
        on_failure: tollgate_redis::FailureMode,
    },
}

pub(crate) struct Policy {
    pub(crate) engine: Arc<PolicyEngine>,
    pub(crate) domain: String,
    pub(crate) descriptors: DescriptorFn,
    #[cfg(feature = "redis")]
    pub(crate) redis: Option<Box<tollgate_redis::RedisStore>>,
}

impl Shared {
    /// Decides `head` as far as it can without waiting.
    pub(crate) fn start(self: &Arc<Self>, head: &RequestHead<'_>) -> Step {
        let cost = self.cost.as_ref().map_or(1, |cost| cost(head));
        // A cost of 0 is how a cost function exempts a request (health checks, say).
        if cost == 0 {
            return Step::Done(Verdict::Allow(Headers::default(), None));
        }
        // A reservation is a check under a request id of its own, which its settlement finds.
        let id = self.reservations.then(next_id);
        match &self.limiter {
            Limiter::Single(single) => self.start_single(single, head, cost, id),
            Limiter::Policy(policy) => self.start_policy(policy, head, cost, id),
        }
    }

    /// `verdict`, carrying a reservation of `cost` under `id` when it admits a request that
    /// has one.
    fn reserve(
        self: &Arc<Self>,
        verdict: Verdict,
        id: Option<String>,
        reserved: impl FnOnce() -> Reserved,
        cost: u64,
    ) -> Verdict {
        match (verdict, id) {
            (Verdict::Allow(headers, None), Some(id)) => Verdict::Allow(
                headers,
                Some(Reservation::new(Arc::clone(self), reserved(), cost, id)),
            ),
            (verdict, _) => verdict,
        }
    }

    fn start_single(
        self: &Arc<Self>,
        single: &Single,
        head: &RequestHead<'_>,
        cost: u64,
        id: Option<String>,
    ) -> Step {
        let key = match single.key.extract(head) {
            Ok(key) => key,
            Err(err) => match &single.missing {
                MissingKey::Fallback(key) => key.as_str().into(),
                _ => return Step::Done(Verdict::Answer(error_response(&err))),
            },
        };
        if cost > single.limit.capacity() {
            return Step::Done(Verdict::Answer(error_response(&Error::CostTooHigh {
                cost,
                limit: single.name.to_string(),
                capacity: single.limit.capacity(),
            })));
        }
        // The limit's name keeps two layers on one store apart.
        let key = format!("{}|{key}", single.name);
        match &single.store {
            SingleStore::Memory(store) => {
                let takes = [Take::new(&key, &single.limit, cost)];
                let request = CheckRequest {
                    takes: &takes,
                    request_id: id.as_deref(),
                    now: None,
                };
                let verdict = match store.check_now(request) {
                    Ok(decisions) => match decisions.first() {
                        Some(decision) => self.single_verdict(single, decision),
                        None => internal_error(&Error::Store(tollgate::Error::EmptyCheck)),
                    },
                    Err(err) => internal_error(&Error::Store(err)),
                };
                Step::Done(self.reserve(verdict, id, || Reserved::Single(key), cost))
            }
            #[cfg(feature = "redis")]
            SingleStore::Redis { .. } => Step::Pending(Pending::Single { key, cost, id }),
        }
    }

    fn start_policy(
        self: &Arc<Self>,
        policy: &Policy,
        head: &RequestHead<'_>,
        cost: u64,
        id: Option<String>,
    ) -> Step {
        let descriptors = match (policy.descriptors)(head) {
            Ok(descriptors) => descriptors,
            Err(err) => return Step::Done(Verdict::Answer(error_response(&err))),
        };
        #[cfg(feature = "redis")]
        if policy.redis.is_some() {
            return Step::Pending(Pending::Policy {
                descriptors,
                cost,
                id,
            });
        }
        let verdict = match policy
            .engine
            .decide(&policy.domain, &descriptors, cost, id.as_deref())
        {
            Ok(outcome) => self.policy_verdict(&outcome),
            Err(err) => policy_error(err),
        };
        Step::Done(self.reserve(verdict, id, || Reserved::Policy(descriptors), cost))
    }

    /// Finishes a decision that waits on a shared store.
    pub(crate) async fn finish(self: &Arc<Self>, pending: Pending) -> Verdict {
        match pending {
            #[cfg(feature = "redis")]
            Pending::Single { key, cost, id } => {
                let Limiter::Single(single) = &self.limiter else {
                    return internal_error(&Error::Store(tollgate::Error::EmptyCheck));
                };
                let SingleStore::Redis {
                    failover,
                    on_failure,
                } = &single.store
                else {
                    return internal_error(&Error::Store(tollgate::Error::EmptyCheck));
                };
                let guarded = [tollgate_redis::Guarded {
                    take: Take::new(&key, &single.limit, cost),
                    on_failure: *on_failure,
                }];
                let verdict = match failover.check(&guarded, id.as_deref(), None).await {
                    Ok(outcomes) => match outcomes.first().map(|o| (o.decision(), o.degraded())) {
                        Some((Some(decision), _)) => self.single_verdict(single, decision),
                        Some((None, Some(reason))) => Verdict::Answer(unavailable(reason.as_str())),
                        _ => internal_error(&Error::Store(tollgate::Error::EmptyCheck)),
                    },
                    Err(err) => internal_error(&Error::Store(err)),
                };
                self.reserve(verdict, id, || Reserved::Single(key), cost)
            }
            #[cfg(feature = "redis")]
            Pending::Policy {
                descriptors,
                cost,
                id,
            } => {
                let Limiter::Policy(policy) = &self.limiter else {
                    return internal_error(&Error::Store(tollgate::Error::EmptyCheck));
                };
                let Some(store) = &policy.redis else {
                    return internal_error(&Error::Store(tollgate::Error::EmptyCheck));
                };
                let decided = policy
                    .engine
                    .decide_on(&**store, &policy.domain, &descriptors, cost, id.as_deref())
                    .await;
                let decided = match decided {
                    Err(tollgate_policy::Error::Check {
                        source: tollgate::Error::StoreUnavailable { reason },
                        ..
                    }) => policy.engine.decide_degraded(
                        &policy.domain,
                        &descriptors,
                        cost,
                        reason.as_str(),
                    ),
                    other => other,
                };
                let verdict = match decided {
                    Ok(outcome) => self.policy_verdict(&outcome),
                    Err(err) => policy_error(err),
                };
                self.reserve(verdict, id, || Reserved::Policy(descriptors), cost)
            }
        }
    }

    fn single_verdict(&self, single: &Single, decision: &Decision) -> Verdict {
        let items = [(&*single.name, decision)];
        if decision.allowed() {
            if !self.headers_on_success {
                return Verdict::Allow(Headers::default(), None);
            }
            let style = self.header_style;
            let headers = Headers {
                ietf: style
                    .ietf()
                    .then(|| single.policy_field.clone().zip(rate_limit_value(items)))
                    .flatten(),
                x: style.x_rate_limit().then(|| x_rate_limit(items)).flatten(),
            };
            Verdict::Allow(headers, None)
        } else {
            Verdict::Answer(too_many_requests(
                items,
                retry_after_secs(decision),
                self.header_style,
            ))
        }
    }

    fn policy_verdict(&self, outcome: &tollgate_policy::Outcome) -> Verdict {
        if outcome.failed_closed {
            return Verdict::Answer(unavailable("store unavailable, limit fails closed"));
        }
        // Only enforced limits speak to the client: shadow and outside-rollout limits are the
        // operator's to watch, and an exempt limit decided nothing.
        let items = outcome
            .limits
            .iter()
            .filter(|l| l.mode == "enforce")
            .filter_map(|l| l.decision.as_ref().map(|d| (&*l.name, d)));
        if outcome.allowed {
            return Verdict::Allow(self.success_headers(items), None);
        }
        // A denial (a policy's `deny`) is not lifted by waiting: no Retry-After at all.
        let retry = if items.clone().any(|(_, d)| d.is_denied()) {
            None
        } else {
            // At least 1 on every other 429, even if no rejecting decision said so (one
            // always does).
            let wait = items.clone().filter_map(|(_, d)| retry_after_secs(d)).max();
            Some(wait.unwrap_or(1))
        };
        Verdict::Answer(too_many_requests(items, retry, self.header_style))
    }

    fn success_headers<'a>(
        &self,
        items: impl IntoIterator<Item = (&'a str, &'a Decision)> + Clone,
    ) -> Headers {
        if !self.headers_on_success {
            return Headers::default();
        }
        let style = self.header_style;
        Headers {
            ietf: style
                .ietf()
                .then(|| rate_limit_headers(items.clone()))
                .flatten(),
            x: style.x_rate_limit().then(|| x_rate_limit(items)).flatten(),
        }
    }
}

const PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");

/// The 429: the rate-limit fields of every applicable limit in `style`, `Retry-After`, and a
/// problem document naming the limits that rejected.
fn too_many_requests<'a>(
    items: impl IntoIterator<Item = (&'a str, &'a Decision)> + Clone,
    retry_after: Option<u64>,
    style: HeaderStyle,
) -> Response<Bytes> {
    let violated = items
        .clone()
        .into_iter()
        .filter(|(_, d)| !d.allowed())
        .map(|(name, _)| name);
    let mut response = quota_exceeded(violated, retry_after);
    let headers = response.headers_mut();
    if style.ietf()
        && let Some((policy, ratelimit)) = rate_limit_headers(items.clone())
    {
        headers.insert(RATELIMIT_POLICY, policy);
        headers.insert(RATELIMIT, ratelimit);
    }
    if style.x_rate_limit()
        && let Some(fields) = x_rate_limit(items)
    {
        headers.extend(fields.fields());
    }
    response
}

/// A 429 without the rate-limit fields: `Retry-After` (when a wait helps: `retry_after` is
/// `None` only for a denial) and a problem document naming the `violated` limits. Shared by the rate limits and the concurrency limits.
pub(crate) fn quota_exceeded<'a>(
    violated: impl IntoIterator<Item = &'a str>,
    retry_after: Option<u64>,
) -> Response<Bytes> {
    let mut body = String::from(
        r#"{"type":"https://iana.org/assignments/http-problem-types#quota-exceeded","title":"Too Many Requests","status":429,"violated-policies":["#,
    );
    for (index, name) in violated.into_iter().enumerate() {
        if index > 0 {
            body.push(',');
        }
        push_json_string(&mut body, name);
    }
    body.push_str("]}");
    let mut response = problem(StatusCode::TOO_MANY_REQUESTS, body);
    // At least 1; none at all only for a denial, which no wait lifts.
    if let Some(wait) = retry_after {
        response
            .headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from(wait.max(1)));
    }
    response
}

/// The 503 of a limit that fails closed while its store is down: distinct from a 429, so
/// clients and dashboards can tell an outage from a quota.
fn unavailable(reason: &str) -> Response<Bytes> {
    tracing::warn!(
        reason,
        "rate-limit store unavailable: request denied (fails closed)"
    );
    unavailable_problem(&format!("rate limiting unavailable: {reason}"))
}

/// The 503 problem document of a limit that fails closed, `detail` saying why.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn unavailable_problem(detail: &str) -> Response<Bytes> {
    let mut body = String::from(r#"{"title":"Service Unavailable","status":503,"detail":"#);
    push_json_string(&mut body, detail);
    body.push('}');
    problem(StatusCode::SERVICE_UNAVAILABLE, body)
}

/// 400 for what the request got wrong, 500 (logged) for what the configuration did.
pub(crate) fn error_response(err: &Error) -> Response<Bytes> {
    if !err.is_client_error() {
        return internal_response(err);
    }
    tracing::debug!(error = %err, "request refused by the rate limiter");
    let mut body = String::from(r#"{"title":"Bad Request","status":400,"detail":"#);
    push_json_string(&mut body, &err.to_string());
    body.push('}');
    problem(StatusCode::BAD_REQUEST, body)
}

fn internal_error(err: &Error) -> Verdict {
    Verdict::Answer(internal_response(err))
}

fn internal_response(err: &Error) -> Response<Bytes> {
    tracing::error!(error = %err, "rate limiter cannot decide: check its configuration");
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        r#"{"title":"Internal Server Error","status":500,"detail":"the rate limiter cannot decide"}"#
            .to_owned(),
    )
}

fn policy_error(err: tollgate_policy::Error) -> Verdict {
    // A cost above a limit's capacity is the request's doing; anything else is configuration.
    let err = match err {
        tollgate_policy::Error::Check {
            limit,
            source: tollgate::Error::InvalidCost { cost, capacity },
        } => Error::CostTooHigh {
            cost,
            limit,
            capacity,
        },
        other => Error::Policy(other),
    };
    Verdict::Answer(error_response(&err))
}

/// Whether `head` is a gRPC call, which needs its answers in gRPC's own form.
pub(crate) fn is_grpc(head: &RequestHead<'_>) -> bool {
    head.header("content-type")
        .is_some_and(|ct| ct.starts_with("application/grpc"))
}

/// The limiter's answer `response` in gRPC form: a trailers-only response (HTTP 200,
/// `grpc-status` in the headers, no body), keeping the rate-limit fields. A gRPC client reads
/// a bare HTTP 429 as `UNAVAILABLE` and would try to decode the problem document as a message;
/// this way it gets `RESOURCE_EXHAUSTED` for a quota, `UNAVAILABLE` when the store fails
/// closed, `INVALID_ARGUMENT` for a request without a usable key.
pub(crate) fn for_grpc(response: Response<Bytes>) -> Response<Bytes> {
    let (code, message) = match response.status() {
        StatusCode::TOO_MANY_REQUESTS => (8, "rate limit exceeded"),
        StatusCode::SERVICE_UNAVAILABLE => (14, "rate limiting unavailable"),
        StatusCode::BAD_REQUEST => (3, "the request carries no usable rate-limit key or cost"),
        _ => (13, "the rate limiter cannot decide"),
    };
    let (mut parts, _) = response.into_parts();
    parts.status = StatusCode::OK;
    parts
        .headers
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    parts.headers.insert("grpc-status", HeaderValue::from(code));
    parts
        .headers
        .insert("grpc-message", HeaderValue::from_static(message));
    Response::from_parts(parts, Bytes::new())
}

fn problem(status: StatusCode, body: String) -> Response<Bytes> {
    let mut response = Response::new(Bytes::from(body));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, PROBLEM_JSON);
    response
}

/// Appends `s` as a JSON string.
fn push_json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_answers_are_trailers_only() {
        let response = for_grpc(too_many_requests(
            std::iter::empty(),
            Some(3),
            HeaderStyle::Ietf,
        ));
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.headers()["grpc-status"], "8");
        assert_eq!(response.headers()["content-type"], "application/grpc");
        assert_eq!(response.headers()["retry-after"], "3");
        assert!(response.body().is_empty());
        let response = for_grpc(unavailable("test"));
        assert_eq!(response.headers()["grpc-status"], "14");
    }

    #[test]
    fn json_strings_are_escaped() {
        let mut out = String::new();
        push_json_string(&mut out, "a\"b\\c\nd é");
        assert_eq!(out, r#""a\"b\\c\u000ad é""#);
    }
}
