//! `POST /v1/check` and `POST /v1/explain`: the JSON decision API.
//!
//! ```text
//! POST /v1/check
//! {"domain":"api","descriptors":[{"tenant":"acme","user":"u1"}],"cost":1,"request_id":"r-1"}
//! ```
//!
//! 200 when allowed, 429 when an enforced limit rejects (with `Retry-After`), 503 when a limit
//! fails closed because the shared store is down, 400 for bad input. `/v1/explain` answers the
//! same body, with bucket keys, and charges nothing.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use std::fmt;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tollgate::Decision;
use tollgate_policy::Outcome;

use super::error::ApiError;
use super::{AppState, MAX_DESCRIPTORS, MAX_ENTRIES, MAX_NAME_BYTES, MAX_VALUE_BYTES};
use crate::decider::{DecideError, Request};
use crate::metrics::Api;
use tollgate_tower::headers as fields;

/// The request body. Unknown fields are refused: a misspelt `cost` must not silently be 1.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CheckBody {
    domain: String,
    descriptors: Vec<RawDescriptor>,
    #[serde(default = "one")]
    cost: u64,
    #[serde(default)]
    request_id: Option<String>,
}

fn one() -> u64 {
    1
}

/// A descriptor's entries in the order they came, values not yet checked to be strings. A
/// `serde_json::Map` would sort them into a tree, an allocation per entry on every request.
#[derive(Debug)]
struct RawDescriptor(Vec<(String, Value)>);

impl<'de> Deserialize<'de> for RawDescriptor {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Entries;

        impl<'de> Visitor<'de> for Entries {
            type Value = RawDescriptor;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object of entry names to string values")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawDescriptor, A::Error> {
                let mut entries = Vec::with_capacity(map.size_hint().unwrap_or(1).min(8));
                while let Some(entry) = map.next_entry()? {
                    entries.push(entry);
                }
                Ok(RawDescriptor(entries))
            }
        }

        deserializer.deserialize_map(Entries)
    }
}

/// A request, parsed and within bounds.
pub(crate) struct Parsed {
    pub(crate) domain: String,
    pub(crate) descriptors: Vec<Vec<(String, String)>>,
    pub(crate) cost: u64,
    pub(crate) request_id: Option<String>,
}

impl Parsed {
    pub(crate) fn request(&self) -> Request<'_> {
        Request {
            domain: &self.domain,
            descriptors: &self.descriptors,
            cost: self.cost,
            request_id: self.request_id.as_deref(),
        }
    }
}

fn parse(body: Result<Bytes, BytesRejection>) -> Result<Parsed, ApiError> {
    let body = body.map_err(|rejection| {
        ApiError::new(
            rejection.status(),
            "body_unreadable",
            format!(
                "cannot read the body: {rejection} (at most {} bytes)",
                super::MAX_BODY_BYTES
            ),
        )
    })?;
    let body: CheckBody = serde_json::from_slice(&body).map_err(|err| {
        ApiError::bad_request("invalid_json", format!("invalid request body: {err}"))
    })?;
    let mut descriptors = Vec::with_capacity(body.descriptors.len());
    for (index, descriptor) in body.descriptors.into_iter().enumerate() {
        let mut entries = Vec::with_capacity(descriptor.0.len());
        for (key, value) in descriptor.0 {
            let Value::String(value) = value else {
                return Err(ApiError::bad_request(
                    "invalid_descriptor",
                    format!("descriptors[{index}].{key}: values must be strings"),
                ));
            };
            entries.push((key, value));
        }
        descriptors.push(entries);
    }
    let parsed = Parsed {
        domain: body.domain,
        descriptors,
        cost: body.cost,
        request_id: body.request_id,
    };
    check_bounds(&parsed)?;
    Ok(parsed)
}

/// The bounds every front end applies before deciding anything.
pub(crate) fn check_bounds(parsed: &Parsed) -> Result<(), ApiError> {
    let too_long = |what: &str, len: usize, max: usize| {
        ApiError::bad_request(
            "too_large",
            format!("{what} is {len} bytes long; at most {max} are accepted"),
        )
    };
    if parsed.domain.is_empty() {
        return Err(ApiError::bad_request(
            "invalid_domain",
            "domain must not be empty",
        ));
    }
    if parsed.domain.len() > MAX_NAME_BYTES {
        return Err(too_long("domain", parsed.domain.len(), MAX_NAME_BYTES));
    }
    if parsed.descriptors.is_empty() {
        return Err(ApiError::bad_request(
            "invalid_descriptor",
            "at least one descriptor is needed, such as {\"user\":\"u1\"}",
        ));
    }
    if parsed.descriptors.len() > MAX_DESCRIPTORS {
        return Err(ApiError::bad_request(
            "too_large",
            format!("at most {MAX_DESCRIPTORS} descriptors per request"),
        ));
    }
    for (index, entries) in parsed.descriptors.iter().enumerate() {
        if entries.is_empty() || entries.len() > MAX_ENTRIES {
            return Err(ApiError::bad_request(
                "invalid_descriptor",
                format!("descriptors[{index}] must have 1 to {MAX_ENTRIES} entries"),
            ));
        }
        for (at, (key, value)) in entries.iter().enumerate() {
            if key.is_empty() {
                return Err(ApiError::bad_request(
                    "invalid_descriptor",
                    format!("descriptors[{index}] has an empty entry name"),
                ));
            }
            if entries[..at].iter().any(|(earlier, _)| earlier == key) {
                return Err(ApiError::bad_request(
                    "invalid_descriptor",
                    format!("descriptors[{index}] names entry {key:?} twice"),
                ));
            }
            if key.len() > MAX_NAME_BYTES {
                return Err(too_long("an entry name", key.len(), MAX_NAME_BYTES));
            }
            if value.len() > MAX_VALUE_BYTES {
                return Err(too_long("an entry value", value.len(), MAX_VALUE_BYTES));
            }
        }
    }
    if parsed.cost == 0 {
        return Err(ApiError::bad_request(
            "invalid_cost",
            "cost must be at least 1",
        ));
    }
    if let Some(id) = &parsed.request_id
        && (id.is_empty() || id.len() > MAX_NAME_BYTES)
    {
        return Err(ApiError::bad_request(
            "invalid_request_id",
            format!("request_id must be 1 to {MAX_NAME_BYTES} bytes"),
        ));
    }
    Ok(())
}

/// Maps a decision failure to its answer.
pub(crate) fn decide_error(err: DecideError) -> ApiError {
    match err {
        DecideError::Invalid(err) => {
            let source = match &err {
                tollgate_policy::Error::Check { source, .. } => Some(source),
                _ => None,
            };
            match source {
                Some(tollgate::Error::IdempotencyConflict) => ApiError::new(
                    StatusCode::CONFLICT,
                    "idempotency_conflict",
                    "request_id was already used for a different request",
                ),
                Some(tollgate::Error::InvalidRequestId { .. }) => {
                    ApiError::bad_request("invalid_request_id", err.to_string())
                }
                _ => ApiError::bad_request("invalid_cost", err.to_string()),
            }
        }
        DecideError::Unavailable(reason) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "store_unavailable",
            format!("the shared store cannot answer ({reason})"),
        ),
        DecideError::Internal(err) => {
            tracing::error!(error = %err, "decision failed");
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                err.to_string(),
            )
        }
    }
}

/// The status an outcome is answered with: 503 when failing closed, 429 when rejected.
pub(crate) fn status_of(outcome: &Outcome, deny: StatusCode) -> StatusCode {
    if outcome.failed_closed {
        StatusCode::SERVICE_UNAVAILABLE
    } else if outcome.allowed {
        StatusCode::OK
    } else {
        deny
    }
}

/// `RateLimit-Policy`, `RateLimit` and, when rejected, `Retry-After`, from the enforced limits.
pub(crate) fn rate_limit_headers(outcome: &Outcome) -> HeaderMap {
    let mut headers = HeaderMap::new();
    let enforced = enforced_decisions(outcome);
    if let Some((policy, state)) = fields::rate_limit_headers(enforced.iter().copied()) {
        headers.insert(fields::RATELIMIT_POLICY, policy);
        headers.insert(fields::RATELIMIT, state);
    }
    if !outcome.allowed && !outcome.failed_closed {
        let wait = enforced
            .iter()
            .filter_map(|(_, decision)| fields::retry_after_secs(decision))
            .max()
            .unwrap_or(1);
        headers.insert("retry-after", HeaderValue::from(wait));
    }
    headers
}

/// The enforced limits' decisions, by name: the ones a client is held to.
pub(crate) fn enforced_decisions(outcome: &Outcome) -> Vec<(&str, &tollgate::Decision)> {
    outcome
        .limits
        .iter()
        .filter(|limit| limit.mode == "enforce")
        .filter_map(|limit| limit.decision.as_ref().map(|d| (limit.name.as_str(), d)))
        .collect()
}

fn millis_ceil(duration: std::time::Duration) -> u64 {
    u64::try_from(duration.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
}

/// One limit in the JSON body.
#[derive(Serialize)]
struct LimitBody<'a> {
    name: &'a str,
    mode: &'a str,
    allowed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    remaining: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    capacity: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    retry_after_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reset_after_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    exempted_by: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    bucket_key: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    descriptor: Option<usize>,
}

/// The JSON body of SPEC §6, serialized straight from the outcome (no intermediate tree: this
/// is on every request's path).
#[derive(Serialize)]
pub(crate) struct Body<'a> {
    allowed: bool,
    policy_version: &'a str,
    limits: Vec<LimitBody<'a>>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    degraded: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<Value>,
}

/// The body for `outcome`; `explain` adds bucket keys and descriptors.
pub(crate) fn body_of(outcome: &Outcome, explain: bool) -> Body<'_> {
    let limits = outcome
        .limits
        .iter()
        .map(|limit| {
            let decision = limit.decision.as_ref();
            LimitBody {
                name: &limit.name,
                mode: limit.mode,
                allowed: decision.map_or(!outcome.failed_closed, Decision::allowed),
                remaining: decision.map(Decision::remaining),
                capacity: decision.map(|d| d.limit().capacity()),
                retry_after_ms: decision.map(|d| d.retry_after().map_or(0, millis_ceil)),
                reset_after_ms: decision.map(|d| millis_ceil(d.reset_after())),
                exempted_by: limit.exempted_by.as_deref(),
                bucket_key: explain.then_some(limit.bucket_key.as_str()),
                descriptor: explain.then_some(limit.descriptor),
            }
        })
        .collect();
    Body {
        allowed: outcome.allowed,
        policy_version: &outcome.policy_version,
        limits,
        degraded: outcome.degraded,
        error: outcome.failed_closed.then(|| {
            json!({
                "code": "store_unavailable",
                "message": "the shared store cannot answer and a limit fails closed",
            })
        }),
    }
}

pub(crate) async fn check(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let parsed = parse(body)?;
    let outcome = state
        .decider
        .decide(Api::Http, &parsed.request())
        .await
        .map_err(decide_error)?;
    let status = status_of(&outcome, StatusCode::TOO_MANY_REQUESTS);
    Ok((
        status,
        rate_limit_headers(&outcome),
        axum::Json(body_of(&outcome, false)),
    )
        .into_response())
}

pub(crate) async fn explain(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let parsed = parse(body)?;
    let outcome = state
        .decider
        .explain(&parsed.request())
        .await
        .map_err(decide_error)?;
    Ok(axum::Json(body_of(&outcome, true)).into_response())
}
