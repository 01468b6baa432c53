//! `POST /v1/leases` and `DELETE /v1/leases/{lease_id}`: concurrency limits over HTTP.
//!
//! ```text
//! POST /v1/leases
//! {"domain":"api","descriptors":[{"tenant":"acme","route":"/export"}]}
//! → 200 {"allowed":true,"lease_id":"9f0c…","policy_version":"3","limits":[…]}
//!
//! POST /v1/leases/9f0c…/renew
//! → 200 {"lease_id":"9f0c…","expires_after_ms":30000}
//!
//! DELETE /v1/leases/9f0c…
//! → 204
//!
//! POST /v1/leases/explain
//! {"domain":"api","descriptors":[{"tenant":"acme","route":"/export"}]}
//! → 200 {"allowed":false,"policy_version":"3","limits":[{…,"in_flight":2,"bucket_key":…}]}
//! ```
//!
//! A caller takes a lease before the work it limits and gives it back after. The server picks
//! the id (128 random bits), so ids cannot collide and cannot be guessed from another's. 429
//! when an enforced concurrency limit is full (with `Retry-After`: when the oldest lease times
//! out, the latest a slot frees itself), 503 when one fails closed because the shared store is
//! down. `lease_id` is `null` when the request holds nothing (no concurrency limit applied, or
//! only exempt ones): there is nothing to give back. A deny (a deny limit that applies, or a
//! concurrency limit's deny override) answers 429 without `Retry-After`, its limit
//! `"denied":true`: no release frees a slot for it.
//!
//! Rate limits are not decided here, nor concurrency limits by `/v1/check`: a request that
//! needs both calls both, so neither API's answer depends on the other's. Deny limits are
//! decided by both: a client on a block list is refused a lease as it is refused a check.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::header::RETRY_AFTER;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use tollgate::LeaseDecision;
use tollgate_policy::LeaseOutcome;

use super::AppState;
use super::check::{
    Parsed, RawDescriptor, STORE_UNAVAILABLE, body_bytes, check_bounds, decide_error, entries_of,
    json, json_body, millis_ceil, push_bool, push_number, push_str,
};
use super::error::ApiError;
use crate::decider::DecideError;
use crate::metrics::{self, Api};

/// The request body: which limits apply, as for a check, and an optional `request_id` that
/// makes a retried acquire return the lease the first one took. No cost: a lease is one
/// request in flight. Unknown fields are refused.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LeaseBody<'a> {
    #[serde(borrow)]
    domain: Cow<'a, str>,
    #[serde(borrow)]
    descriptors: Vec<RawDescriptor<'a>>,
    #[serde(default, borrow)]
    request_id: Option<Cow<'a, str>>,
}

fn parse(body: &Result<Bytes, BytesRejection>) -> Result<Parsed<'_>, ApiError> {
    let body = body_bytes(body)?;
    let body: LeaseBody<'_> = json_body(body)?;
    let parsed = Parsed {
        domain: body.domain,
        descriptors: entries_of(body.descriptors)?,
        cost: 1,
        request_id: body.request_id,
    };
    check_bounds(&parsed)?;
    Ok(parsed)
}

/// The lease id of a request that carries `request_id`: the same for every retry, in every
/// process sharing the store (a hash of the domain and the request id), so that a retried
/// acquire finds the lease the first one took instead of taking a second slot. Its secrecy is
/// the request id's: use an unguessable one (a UUID).
pub(crate) fn lease_id_of(domain: &str, request_id: &str) -> String {
    let mut input = Vec::with_capacity(domain.len() + 1 + request_id.len());
    input.extend_from_slice(domain.as_bytes());
    input.push(0);
    input.extend_from_slice(request_id.as_bytes());
    let bits = xxhash_rust::xxh3::xxh3_128(&input);
    let mut id = String::with_capacity(32);
    // Writing to a String cannot fail.
    let _ = write!(id, "{bits:032x}");
    id
}

/// A fresh lease id: 128 random bits in hex.
fn new_lease_id() -> String {
    let bits: u128 = rand::random();
    let mut id = String::with_capacity(32);
    // Writing to a String cannot fail.
    let _ = write!(id, "{bits:032x}");
    id
}

pub(crate) async fn acquire(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let parsed = parse(&body).inspect_err(|_| metrics::record_invalid(Api::Leases))?;
    let lease_id = match &parsed.request_id {
        Some(request_id) => lease_id_of(&parsed.domain, request_id),
        None => new_lease_id(),
    };
    let acquired = state
        .decider
        .acquire(&parsed.domain, &parsed.descriptors, &lease_id)
        .await;
    let outcome = match acquired {
        Err(DecideError::Invalid(tollgate_policy::Error::Check {
            source: tollgate::Error::LeaseIdInUse,
            ..
        })) if parsed.request_id.is_some() => {
            return Ok(repeated(&state, &parsed, &lease_id).await);
        }
        acquired => acquired.map_err(lease_error)?,
    };
    let status = if outcome.failed_closed {
        StatusCode::SERVICE_UNAVAILABLE
    } else if outcome.allowed {
        StatusCode::OK
    } else {
        StatusCode::TOO_MANY_REQUESTS
    };
    let held = outcome.held.then_some(lease_id.as_str());
    let mut response = json(status, write_body(&outcome, Body::Taken(held)));
    let denied = enforced(&outcome).any(LeaseDecision::is_denied);
    if !outcome.allowed && !outcome.failed_closed && !denied {
        let wait = enforced(&outcome)
            .filter_map(LeaseDecision::retry_after)
            .map(|wait| wait.as_nanos().div_ceil(1_000_000_000))
            .max()
            .unwrap_or(1)
            .max(1);
        let wait = u64::try_from(wait).unwrap_or(u64::MAX);
        response
            .headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from(wait));
    }
    Ok(response)
}

/// The answer to a retried acquire whose lease is still held: 200 with that lease, each
/// limit's count as it stands now (it includes this lease), and `"repeated":true`. Without
/// the store the counts cannot be read, and only the lease is given back, with the version
/// in force (every other answer names one).
async fn repeated(state: &AppState, parsed: &Parsed<'_>, lease_id: &str) -> Response {
    let body = match state
        .decider
        .explain_leases(&parsed.domain, &parsed.descriptors)
        .await
    {
        Ok(outcome) => write_body(&outcome, Body::Repeated(lease_id)),
        Err(_) => {
            let mut out = Vec::with_capacity(96);
            out.extend_from_slice(b"{\"allowed\":true,\"lease_id\":");
            push_str(&mut out, lease_id);
            out.extend_from_slice(b",\"policy_version\":");
            push_str(&mut out, state.decider.engine().current().version());
            out.extend_from_slice(b",\"limits\":[],\"repeated\":true}");
            out
        }
    };
    json(StatusCode::OK, body)
}

/// `POST /v1/leases/explain`: what `POST /v1/leases` would answer now, with each limit's key
/// and the descriptor it matched, holding nothing and counting nothing (`/v1/explain` for
/// concurrency limits). Always 200 when it can look; 503 when the shared store cannot answer.
pub(crate) async fn explain(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let parsed = parse(&body).inspect_err(|_| metrics::record_invalid(Api::Leases))?;
    let outcome = state
        .decider
        .explain_leases(&parsed.domain, &parsed.descriptors)
        .await
        .map_err(lease_error)?;
    Ok(json(StatusCode::OK, write_body(&outcome, Body::Explained)))
}

pub(crate) async fn release(
    State(state): State<Arc<AppState>>,
    lease_id: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let lease_id = checked_id(lease_id)?;
    let released = state
        .decider
        .release(&lease_id)
        .await
        .map_err(lease_error)?;
    if released {
        Ok(StatusCode::NO_CONTENT.into_response())
    } else {
        Err(not_found())
    }
}

/// `POST /v1/leases/{lease_id}/renew`: for work that runs longer than the lease timeout. 200
/// with `{"lease_id","expires_after_ms"}` (when its last slot now times out); 404 when it is
/// held nowhere any more (a lease that timed out is not revived: take a new one).
pub(crate) async fn renew(
    State(state): State<Arc<AppState>>,
    lease_id: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let lease_id = checked_id(lease_id)?;
    let left = state
        .decider
        .renew(&lease_id)
        .await
        .map_err(lease_error)?
        .ok_or_else(not_found)?;
    let mut out = Vec::with_capacity(96);
    out.extend_from_slice(b"{\"lease_id\":");
    push_str(&mut out, &lease_id);
    push_number(&mut out, b",\"expires_after_ms\":", millis_ceil(left));
    out.push(b'}');
    Ok(json(StatusCode::OK, out))
}

/// The lease id of the path, or a 400 naming what one is. A path segment that is not UTF-8
/// once percent-decoded (`%A0`) is no lease id either: it gets the same answer, where axum's
/// own refusal would be plain text rather than the error body of every other refusal.
fn checked_id(lease_id: Result<Path<String>, PathRejection>) -> Result<String, ApiError> {
    match lease_id {
        Ok(Path(id)) if tollgate::check_lease_id(&id).is_ok() => Ok(id),
        _ => {
            metrics::record_invalid(Api::Leases);
            Err(ApiError::bad_request(
                "invalid_lease_id",
                "a lease id is 1 to 64 characters of ASCII letters, digits, '-' and '_'",
            ))
        }
    }
}

fn not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "lease_not_found",
        "no such lease is held: it was released before, timed out, or never existed",
    )
}

/// Maps a failure to take or give back a lease to its answer.
fn lease_error(err: DecideError) -> ApiError {
    let source = match &err {
        DecideError::Invalid(tollgate_policy::Error::Check { source, .. })
        | DecideError::Internal(tollgate_policy::Error::Check { source, .. }) => Some(source),
        _ => None,
    };
    match source {
        Some(tollgate::Error::TooManyLeases { .. }) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "lease_table_full",
            err.to_string(),
        ),
        Some(tollgate::Error::InvalidLeaseId { .. }) => {
            ApiError::bad_request("invalid_lease_id", err.to_string())
        }
        _ => decide_error(err),
    }
}

/// The enforced limits' decisions: the ones a client is held to.
fn enforced(outcome: &LeaseOutcome) -> impl Iterator<Item = &LeaseDecision> {
    outcome
        .limits
        .iter()
        .filter(|limit| limit.mode == "enforce")
        .filter_map(|limit| limit.decision.as_ref())
}

/// Which answer a body is.
#[derive(Debug, Clone, Copy)]
enum Body<'a> {
    /// An acquire's: the lease id, `None` (`null`) when nothing is held.
    Taken(Option<&'a str>),
    /// An explanation's: no lease id; each limit's bucket key and descriptor.
    Explained,
    /// A retried acquire's, whose lease is held already: allowed on every limit, with the
    /// counts as they stand (this lease among them), and `"repeated":true`.
    Repeated(&'a str),
}

/// The JSON answer: the shape of a check's, with `lease_id` and each limit's `in_flight`;
/// `capacity` is the limit's `max_in_flight`.
fn write_body(outcome: &LeaseOutcome, body: Body<'_>) -> Vec<u8> {
    let mut out = Vec::with_capacity(120 + 192 * outcome.limits.len());
    let repeated = matches!(body, Body::Repeated(_));
    out.extend_from_slice(b"{\"allowed\":");
    push_bool(&mut out, outcome.allowed || repeated);
    let lease_id = match body {
        Body::Taken(lease_id) => Some(lease_id),
        Body::Repeated(lease_id) => Some(Some(lease_id)),
        Body::Explained => None,
    };
    if let Some(lease_id) = lease_id {
        out.extend_from_slice(b",\"lease_id\":");
        match lease_id {
            Some(id) => push_str(&mut out, id),
            None => out.extend_from_slice(b"null"),
        }
    }
    out.extend_from_slice(b",\"policy_version\":");
    push_str(&mut out, &outcome.policy_version);
    out.extend_from_slice(b",\"limits\":[");
    for (index, limit) in outcome.limits.iter().enumerate() {
        if index > 0 {
            out.push(b',');
        }
        out.extend_from_slice(b"{\"name\":");
        push_str(&mut out, &limit.name);
        out.extend_from_slice(b",\"mode\":");
        push_str(&mut out, limit.mode);
        out.extend_from_slice(b",\"allowed\":");
        let decision = limit.decision.as_ref();
        push_bool(
            &mut out,
            repeated || decision.map_or(!outcome.failed_closed, LeaseDecision::allowed),
        );
        if let Some(d) = decision {
            push_number(&mut out, b",\"in_flight\":", d.in_flight());
            push_number(&mut out, b",\"remaining\":", d.remaining());
            push_number(&mut out, b",\"capacity\":", d.max_in_flight());
            // As in a check's body: a denial has no wait that would help, so no
            // retry_after_ms rather than a 0 that would read "retry now".
            let denied = d.is_denied();
            if !denied {
                let retry = d.retry_after().filter(|_| !repeated).map_or(0, millis_ceil);
                push_number(&mut out, b",\"retry_after_ms\":", retry);
            }
            push_number(
                &mut out,
                b",\"reset_after_ms\":",
                millis_ceil(d.reset_after()),
            );
            if denied {
                out.extend_from_slice(b",\"denied\":true");
            }
        }
        if let Some(owner) = &limit.exempted_by {
            out.extend_from_slice(b",\"exempted_by\":");
            push_str(&mut out, owner);
        }
        if let Body::Explained = body {
            out.extend_from_slice(b",\"bucket_key\":");
            push_str(&mut out, &limit.bucket_key);
            push_number(&mut out, b",\"descriptor\":", limit.descriptor as u64);
        }
        out.push(b'}');
    }
    out.push(b']');
    if outcome.degraded {
        out.extend_from_slice(b",\"degraded\":true");
    }
    if outcome.failed_closed {
        out.extend_from_slice(STORE_UNAVAILABLE.as_bytes());
    }
    if repeated {
        out.extend_from_slice(b",\"repeated\":true");
    }
    out.push(b'}');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(body: &'static str) -> Result<Parsed<'static>, ApiError> {
        let body: &'static Result<Bytes, BytesRejection> =
            Box::leak(Box::new(Ok(Bytes::from_static(body.as_bytes()))));
        parse(body)
    }

    #[test]
    fn a_lease_body_names_limits_and_nothing_else() {
        let ok = parsed(r#"{"domain":"api","descriptors":[{"user":"u1"}]}"#).unwrap();
        assert_eq!(ok.domain, "api");
        assert_eq!(ok.descriptors[0][0].1, "u1");
        let retried = parsed(r#"{"domain":"api","descriptors":[{"user":"u1"}],"request_id":"r"}"#);
        assert_eq!(retried.unwrap().request_id.as_deref(), Some("r"));
        for bad in [
            r#"{"domain":"api","descriptors":[{"user":"u1"}],"cost":2}"#,
            r#"{"domain":"api","descriptors":[{"user":"u1"}],"request_id":""}"#,
            r#"{"domain":"api","descriptors":[]}"#,
            r#"{"domain":"","descriptors":[{"user":"u1"}]}"#,
            r#"{"domain":"api","descriptors":[{"user":1}]}"#,
            r#"{"domain":"api""#,
        ] {
            assert!(parsed(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_request_id_gives_one_lease_id_per_domain() {
        let id = lease_id_of("api", "3f8e2c1a-retry");
        assert_eq!(id, lease_id_of("api", "3f8e2c1a-retry"));
        assert_ne!(id, lease_id_of("api", "3f8e2c1a-other"));
        assert_ne!(id, lease_id_of("api2", "3f8e2c1a-retry"));
        // The separator keeps ("ab", "c") and ("a", "bc") apart.
        assert_ne!(lease_id_of("ab", "c"), lease_id_of("a", "bc"));
        assert_eq!(id.len(), 32);
        assert_eq!(tollgate::check_lease_id(&id), Ok(()));
    }

    #[test]
    fn lease_ids_are_fresh_and_valid() {
        let a = new_lease_id();
        let b = new_lease_id();
        assert_ne!(a, b);
        assert_eq!(a.len(), 32);
        assert_eq!(tollgate::check_lease_id(&a), Ok(()));
    }
}
