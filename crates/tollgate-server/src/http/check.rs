//! `POST /v1/check`, `POST /v1/explain` and `POST /v1/settle`: the JSON decision API.
//!
//! ```text
//! POST /v1/check
//! {"domain":"api","descriptors":[{"tenant":"acme","user":"u1"}],"cost":1,"request_id":"r-1"}
//! ```
//!
//! 200 when allowed, 429 when an enforced limit rejects (with `Retry-After`), 503 when a limit
//! fails closed because the shared store is down, 400 for bad input. `/v1/explain` answers the
//! same body, with bucket keys, and charges nothing. `/v1/settle` takes a check's body again
//! with what the request `used`, and gives the rest of its cost back (a reservation).

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::header::{CONTENT_TYPE, RETRY_AFTER};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use serde::Deserialize;
use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use tollgate::Decision;
use tollgate_policy::Outcome;

use super::error::ApiError;
use super::plain_body;
use super::{AppState, MAX_DESCRIPTORS, MAX_ENTRIES, MAX_NAME_BYTES, MAX_VALUE_BYTES};
use crate::decider::{DecideError, Request};
use crate::metrics::{self, Api};
use tollgate_tower::HeaderStyle;
use tollgate_tower::headers as fields;

/// The request body. Unknown fields are refused: a misspelt `cost` must not silently be 1.
///
/// Strings borrow from the body where they can (no escapes in them, the usual case), so a
/// check allocates for the descriptor lists alone.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CheckBody<'a> {
    #[serde(borrow)]
    domain: Cow<'a, str>,
    #[serde(borrow)]
    descriptors: Vec<RawDescriptor<'a>>,
    #[serde(default = "one")]
    cost: u64,
    #[serde(default, borrow)]
    request_id: Option<Cow<'a, str>>,
}

fn one() -> u64 {
    1
}

/// The body of `POST /v1/settle`: the check's own fields (its request id required), and what
/// the request used in the end. The fields are listed again rather than flattened in: serde
/// cannot refuse unknown fields around a flattened struct, and a misspelt `used` must not pass.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SettleBody<'a> {
    #[serde(borrow)]
    domain: Cow<'a, str>,
    #[serde(borrow)]
    descriptors: Vec<RawDescriptor<'a>>,
    #[serde(default = "one")]
    cost: u64,
    #[serde(borrow)]
    request_id: Cow<'a, str>,
    used: u64,
}

/// A descriptor's entries in the order they came, values not yet checked to be strings. A
/// `serde_json::Map` would sort them into a tree, an allocation per entry on every request.
#[derive(Debug)]
pub(crate) struct RawDescriptor<'a>(Vec<(Cow<'a, str>, EntryValue<'a>)>);

impl<'de: 'a, 'a> Deserialize<'de> for RawDescriptor<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Entries<'a>(PhantomData<&'a ()>);

        impl<'de: 'a, 'a> Visitor<'de> for Entries<'a> {
            type Value = RawDescriptor<'a>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object of entry names to string values")
            }

            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<RawDescriptor<'a>, A::Error> {
                let mut entries = Vec::with_capacity(map.size_hint().unwrap_or(1).min(8));
                while let Some(name) = map.next_key::<Borrowed<'a>>()? {
                    entries.push((name.0, map.next_value()?));
                }
                Ok(RawDescriptor(entries))
            }
        }

        deserializer.deserialize_map(Entries(PhantomData))
    }
}

/// A string borrowed from the body when it has no escapes, owned otherwise. (A bare
/// `Cow<str>` in a tuple or a map key always deserializes owned.)
struct Borrowed<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Borrowed<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match EntryValue::deserialize(deserializer)? {
            EntryValue::String(text) => Ok(Borrowed(text)),
            EntryValue::Other => Err(serde::de::Error::custom("entry names must be strings")),
        }
    }
}

/// An entry's value: a string, or anything else (refused once its descriptor is known, so
/// the error can say where it is).
#[derive(Debug)]
enum EntryValue<'a> {
    String(Cow<'a, str>),
    Other,
}

impl<'de: 'a, 'a> Deserialize<'de> for EntryValue<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Text<'a>(PhantomData<&'a ()>);

        impl<'de: 'a, 'a> Visitor<'de> for Text<'a> {
            type Value = EntryValue<'a>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }

            fn visit_borrowed_str<E>(self, text: &'de str) -> Result<EntryValue<'a>, E> {
                Ok(EntryValue::String(Cow::Borrowed(text)))
            }

            fn visit_str<E>(self, text: &str) -> Result<EntryValue<'a>, E> {
                Ok(EntryValue::String(Cow::Owned(text.to_owned())))
            }

            fn visit_string<E>(self, text: String) -> Result<EntryValue<'a>, E> {
                Ok(EntryValue::String(Cow::Owned(text)))
            }

            fn visit_bool<E>(self, _: bool) -> Result<EntryValue<'a>, E> {
                Ok(EntryValue::Other)
            }

            fn visit_i64<E>(self, _: i64) -> Result<EntryValue<'a>, E> {
                Ok(EntryValue::Other)
            }

            fn visit_u64<E>(self, _: u64) -> Result<EntryValue<'a>, E> {
                Ok(EntryValue::Other)
            }

            fn visit_f64<E>(self, _: f64) -> Result<EntryValue<'a>, E> {
                Ok(EntryValue::Other)
            }

            fn visit_unit<E>(self) -> Result<EntryValue<'a>, E> {
                Ok(EntryValue::Other)
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<EntryValue<'a>, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(EntryValue::Other)
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<EntryValue<'a>, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(EntryValue::Other)
            }
        }

        deserializer.deserialize_any(Text(PhantomData))
    }
}

/// A descriptor's entries: (name, value) in the order given.
pub(crate) type Entries<'a> = Vec<(Cow<'a, str>, Cow<'a, str>)>;

/// A request, parsed and within bounds. Its strings borrow from the request where they can.
#[derive(Debug, PartialEq)]
pub(crate) struct Parsed<'a> {
    pub(crate) domain: Cow<'a, str>,
    pub(crate) descriptors: Vec<Entries<'a>>,
    pub(crate) cost: u64,
    pub(crate) request_id: Option<Cow<'a, str>>,
}

impl Parsed<'_> {
    pub(crate) fn request(&self) -> Request<'_, Vec<(Cow<'_, str>, Cow<'_, str>)>> {
        Request {
            domain: &self.domain,
            descriptors: &self.descriptors,
            cost: self.cost.into(),
            request_id: self.request_id.as_deref(),
        }
    }
}

fn parse(body: &Result<Bytes, BytesRejection>) -> Result<Parsed<'_>, ApiError> {
    parse_bytes(body_bytes(body)?)
}

fn parse_bytes(body: &[u8]) -> Result<Parsed<'_>, ApiError> {
    let parsed = match plain_body::read(body) {
        Some(parsed) => parsed,
        None => parse_with_serde(body)?,
    };
    check_bounds(&parsed)?;
    Ok(parsed)
}

/// The body's bytes, or the answer to a body that could not be read (too large, cut short).
pub(super) fn body_bytes(body: &Result<Bytes, BytesRejection>) -> Result<&Bytes, ApiError> {
    body.as_ref().map_err(rejected)
}

/// The answer to the router's refusal to read a body.
fn rejected(rejection: &BytesRejection) -> ApiError {
    unreadable(rejection.status(), rejection)
}

/// The answer to a body that could not be read: 413 when it is too large, 400 otherwise.
pub(super) fn unreadable(status: StatusCode, reason: impl fmt::Display) -> ApiError {
    ApiError::new(
        status,
        "body_unreadable",
        format!(
            "cannot read the body: {reason} (at most {} bytes)",
            super::MAX_BODY_BYTES
        ),
    )
}

/// `body` read by serde_json as a `T`, or the 400 that says where it is not one.
pub(super) fn json_body<'a, T: serde::Deserialize<'a>>(body: &'a [u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|err| {
        ApiError::bad_request("invalid_json", format!("invalid request body: {err}"))
    })
}

/// `body` read by serde_json: any body, and every error with its place.
pub(super) fn parse_with_serde(body: &[u8]) -> Result<Parsed<'_>, ApiError> {
    let body: CheckBody<'_> = json_body(body)?;
    Ok(Parsed {
        domain: body.domain,
        descriptors: entries_of(body.descriptors)?,
        cost: body.cost,
        request_id: body.request_id,
    })
}

/// The descriptors of a body, every value checked to be a string.
pub(crate) fn entries_of(raw: Vec<RawDescriptor<'_>>) -> Result<Vec<Entries<'_>>, ApiError> {
    // Collected in place: the lists the body was read into become the request's.
    raw.into_iter()
        .enumerate()
        .map(|(index, descriptor)| {
            descriptor
                .0
                .into_iter()
                .map(|(key, value)| match value {
                    EntryValue::String(value) => Ok((key, value)),
                    EntryValue::Other => Err(ApiError::bad_request(
                        "invalid_descriptor",
                        format!("descriptors[{index}].{key}: values must be strings"),
                    )),
                })
                .collect::<Result<Entries<'_>, ApiError>>()
        })
        .collect()
}

/// The bounds every front end applies before deciding anything.
pub(crate) fn check_bounds(parsed: &Parsed<'_>) -> Result<(), ApiError> {
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

/// Adds the rate-limit fields of `style` (`RateLimit-Policy` and `RateLimit`, or
/// `X-RateLimit-*`) and, when rejected (not denied), `Retry-After` to `headers`, from the
/// enforced limits. Added to the response's own map: a map of their own would cost an
/// allocation and a merge on every answer.
pub(crate) fn add_rate_limit_headers(
    headers: &mut HeaderMap,
    outcome: &Outcome,
    style: HeaderStyle,
) {
    if style.ietf()
        && let Some((policy, state)) = fields::rate_limit_headers(enforced_decisions(outcome))
    {
        headers.insert(fields::RATELIMIT_POLICY, policy);
        headers.insert(fields::RATELIMIT, state);
    }
    if style.x_rate_limit()
        && let Some(figures) = fields::x_rate_limit(enforced_decisions(outcome))
    {
        headers.extend(figures.fields());
    }
    // A denial is not lifted by waiting: no Retry-After that would invite a retry.
    let denied = || enforced_decisions(outcome).any(|(_, decision)| decision.is_denied());
    if !outcome.allowed && !outcome.failed_closed && !denied() {
        let wait = enforced_decisions(outcome)
            .filter_map(|(_, decision)| fields::retry_after_secs(decision))
            .max()
            .unwrap_or(1);
        headers.insert(RETRY_AFTER, HeaderValue::from(wait));
    }
}

/// The enforced limits' decisions, by name: the ones a client is held to.
fn enforced_decisions(
    outcome: &Outcome,
) -> impl Iterator<Item = (&str, &tollgate::Decision)> + Clone {
    outcome
        .limits
        .iter()
        .filter(|limit| limit.mode == "enforce")
        .filter_map(|limit| limit.decision.as_ref().map(|d| (&*limit.name, d)))
}

pub(super) fn millis_ceil(duration: std::time::Duration) -> u64 {
    u64::try_from(duration.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
}

/// The JSON body of SPEC §6 for `outcome`; `explain` adds bucket keys and descriptors.
///
/// Written by hand because it is on every request's path: serde's generic serializer cost more
/// instructions than the rest of the response put together. A string with anything to escape
/// still goes through `serde_json`; the test below holds the output to a serde-derived
/// reference, byte for byte.
pub(crate) fn write_body(outcome: &Outcome, explain: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(80 + 192 * outcome.limits.len());
    out.extend_from_slice(b"{\"allowed\":");
    push_bool(&mut out, outcome.allowed);
    out.extend_from_slice(b",\"policy_version\":");
    push_str(&mut out, &outcome.policy_version);
    out.extend_from_slice(b",\"limits\":[");
    for (index, limit) in outcome.limits.iter().enumerate() {
        if index > 0 {
            out.push(b',');
        }
        let decision = limit.decision.as_ref();
        out.extend_from_slice(b"{\"name\":");
        push_str(&mut out, &limit.name);
        out.extend_from_slice(b",\"mode\":");
        push_str(&mut out, limit.mode);
        out.extend_from_slice(b",\"allowed\":");
        push_bool(
            &mut out,
            decision.map_or(!outcome.failed_closed, Decision::allowed),
        );
        if let Some(d) = decision {
            push_number(&mut out, b",\"remaining\":", d.remaining());
            push_number(&mut out, b",\"capacity\":", d.capacity());
            // A denial has no wait that would help: no retry_after_ms at all, rather than a 0
            // that would read "retry now".
            let denied = d.is_denied();
            if !denied {
                let retry = d.retry_after().map_or(0, millis_ceil);
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
        if explain {
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
    out.push(b'}');
    out
}

/// The `error` member of a body that failed closed.
pub(super) const STORE_UNAVAILABLE: &str = concat!(
    r#","error":{"code":"store_unavailable","#,
    r#""message":"the shared store cannot answer and a limit fails closed"}"#
);

pub(super) fn push_bool(out: &mut Vec<u8>, value: bool) {
    out.extend_from_slice(if value { b"true" } else { b"false" });
}

pub(super) fn push_number(out: &mut Vec<u8>, key: &[u8], value: u64) {
    out.extend_from_slice(key);
    out.extend_from_slice(itoa::Buffer::new().format(value).as_bytes());
}

pub(super) fn push_str(out: &mut Vec<u8>, value: &str) {
    // Names and versions are nearly always plain: nothing JSON escapes (a quote, a backslash,
    // a control character), so they are copied whole.
    if !value.bytes().any(|b| b == b'"' || b == b'\\' || b < 0x20) {
        out.push(b'"');
        out.extend_from_slice(value.as_bytes());
        out.push(b'"');
        return;
    }
    // Serializing a string into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, value);
}

/// A JSON answer. Put together by hand: axum's `(status, headers, body)` sets a body's
/// `Content-Type` and then replaces it, a lookup in the headers more for every answer.
pub(super) fn json(status: StatusCode, body: Vec<u8>) -> Response {
    let mut response = Response::new(axum::body::Body::from(body));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

pub(crate) async fn check(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    decide(&state, body.map_err(|rejection| rejected(&rejection))).await
}

/// `POST /v1/check` once its body is read (or could not be), by the router or without it
/// ([`super::direct`]).
pub(super) async fn decide(
    state: &AppState,
    body: Result<Bytes, ApiError>,
) -> Result<Response, ApiError> {
    let body = body.inspect_err(|_| metrics::record_invalid(Api::Http))?;
    let parsed = parse_bytes(&body).inspect_err(|_| metrics::record_invalid(Api::Http))?;
    let outcome = state
        .decider
        .decide(Api::Http, &parsed.request())
        .await
        .map_err(decide_error)?;
    let status = status_of(&outcome, StatusCode::TOO_MANY_REQUESTS);
    let mut response = json(status, write_body(&outcome, false));
    add_rate_limit_headers(
        response.headers_mut(),
        &outcome,
        state.options.rate_limit_headers,
    );
    Ok(response)
}

pub(crate) async fn explain(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let parsed = parse(&body).inspect_err(|_| metrics::record_invalid(Api::Http))?;
    // Unlike `decide`, `explain` records no metrics; count a request it refuses here.
    let outcome = state
        .decider
        .explain(&parsed.request())
        .await
        .inspect_err(|err| {
            if matches!(err, DecideError::Invalid(_)) {
                metrics::record_invalid(Api::Http);
            }
        })
        .map_err(decide_error)?;
    Ok(json(StatusCode::OK, write_body(&outcome, true)))
}

/// `POST /v1/settle`: a reservation (a check of the most a request could cost, with a
/// `request_id`) settled for what it `used`; the rest goes back to every bucket it was charged
/// on, once. 200 with `settled` (`settled`, `repeated`: done before, nothing more given;
/// `not_found`: no charge on record, nothing given) and each limit's balance afterwards; 400,
/// 409 (the id was used for another request, or settled with another `used`), 503.
pub(crate) async fn settle(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let refused = |err| {
        metrics::record_invalid(Api::Http);
        err
    };
    let body: SettleBody<'_> = serde_json::from_slice(body_bytes(&body).map_err(refused)?)
        .map_err(|err| {
            refused(ApiError::bad_request(
                "invalid_json",
                format!("invalid request body: {err}"),
            ))
        })?;
    let parsed = Parsed {
        domain: body.domain,
        descriptors: entries_of(body.descriptors).map_err(refused)?,
        cost: body.cost,
        request_id: Some(body.request_id),
    };
    check_bounds(&parsed).map_err(refused)?;
    let outcome = state
        .decider
        .settle(&parsed.request(), body.used)
        .await
        .inspect_err(|err| {
            if matches!(err, DecideError::Invalid(_)) {
                metrics::record_invalid(Api::Http);
            }
        })
        .map_err(|err| match err {
            DecideError::Invalid(tollgate_policy::Error::Check {
                source: tollgate::Error::InvalidSettlement { reason },
                ..
            }) => ApiError::bad_request("invalid_settlement", format!("cannot settle: {reason}")),
            DecideError::Invalid(tollgate_policy::Error::Check {
                source: tollgate::Error::IdempotencyConflict,
                ..
            }) => ApiError::new(
                StatusCode::CONFLICT,
                "idempotency_conflict",
                "request_id was used for a different request, or settled with another `used`",
            ),
            other => decide_error(other),
        })?;
    let status = outcome
        .settled
        .map_or("not_found", |status| status.as_str());
    let decided = write_body(&outcome, false);
    // The check's body, with the settlement's status first.
    let mut out = Vec::with_capacity(decided.len() + 32);
    out.extend_from_slice(b"{\"settled\":");
    push_str(&mut out, status);
    out.push(b',');
    out.extend_from_slice(decided.get(1..).unwrap_or_default());
    Ok(json(StatusCode::OK, out))
}

#[cfg(test)]
mod tests {
    use serde::Serialize;
    use tollgate_policy::{EngineOptions, PolicyEngine, compile};

    use super::*;

    fn parsed(body: &'static str) -> Result<Parsed<'static>, ApiError> {
        // Leaked so that the parse may borrow from it for the test's length.
        let body: &'static Result<Bytes, BytesRejection> =
            Box::leak(Box::new(Ok(Bytes::from_static(body.as_bytes()))));
        parse(body)
    }

    #[test]
    fn plain_strings_borrow_from_the_body_and_escaped_ones_are_decoded() {
        let request =
            parsed(r#"{"domain":"api","descriptors":[{"user":"u1","path":"/a\/b"}],"request_id":"r\u0031"}"#)
                .unwrap();
        assert!(matches!(request.domain, Cow::Borrowed("api")));
        let entries = &request.descriptors[0];
        assert!(matches!(
            entries[0],
            (Cow::Borrowed("user"), Cow::Borrowed("u1"))
        ));
        assert_eq!(entries[1].0, "path");
        assert!(matches!(entries[1].1, Cow::Owned(_)));
        assert_eq!(entries[1].1, "/a/b");
        assert_eq!(request.request_id.as_deref(), Some("r1"));
        assert_eq!(request.cost, 1);
        let escaped = parsed(r#"{"domain":"a\"b","descriptors":[{"us\u0065r":"x\\y"}]}"#).unwrap();
        assert_eq!(escaped.domain, "a\"b");
        assert_eq!(escaped.descriptors[0][0].0, "user");
        assert_eq!(escaped.descriptors[0][0].1, "x\\y");
    }

    #[test]
    fn values_other_than_strings_are_refused_with_their_place() {
        for value in [
            "5",
            "-1",
            "1.5",
            "true",
            "null",
            "[1,[2]]",
            r#"{"a":{"b":1}}"#,
        ] {
            let body =
                format!(r#"{{"domain":"api","descriptors":[{{"a":"x"}},{{"user":{value}}}]}}"#);
            let body: &'static str = Box::leak(body.into_boxed_str());
            let err = format!("{:?}", parsed(body).err());
            assert!(err.contains("invalid_descriptor"), "{value}: {err}");
            assert!(
                err.contains("descriptors[1].user: values must be strings"),
                "{value}: {err}"
            );
        }
    }

    #[test]
    fn malformed_bodies_are_invalid_json() {
        for body in [
            "",
            "{",
            r#"{"domain":"api","descriptors":[{"user":"u1"}],"cots":1}"#,
            r#"{"domain":"api","descriptors":[{"user":"u1"}],"cost":-1}"#,
            r#"{"domain":5,"descriptors":[{"user":"u1"}]}"#,
            r#"{"domain":"api","descriptors":{"user":"u1"}}"#,
            r#"{"domain":"api","descriptors":["user"]}"#,
            r#"{"domain":"api","descriptors":[{"user":"u1"}]} trailing"#,
        ] {
            let err = format!("{:?}", parsed(body).err());
            assert!(err.contains("invalid_json"), "{body}: {err}");
        }
        // The message says what a descriptor must be.
        let err = format!("{:?}", parsed(r#"{"domain":"a","descriptors":[5]}"#).err());
        assert!(
            err.contains("expected an object of entry names to string values"),
            "{err}"
        );
    }

    /// Each bound holds at its value and is refused one past it, with what is wrong.
    #[test]
    fn requests_are_refused_just_past_each_bound() {
        let entry =
            |key: &str, value: &str| (Cow::Owned(key.to_owned()), Cow::Owned(value.to_owned()));
        let many = |count: usize| -> Entries<'static> {
            (0..count).map(|i| entry(&format!("k{i}"), "v")).collect()
        };
        let request = |domain: String, descriptors: Vec<Entries<'static>>| Parsed {
            domain: Cow::Owned(domain),
            descriptors,
            cost: 1,
            request_id: None,
        };
        let with_id = |id: String| Parsed {
            request_id: Some(Cow::Owned(id)),
            ..request("d".to_owned(), vec![many(1)])
        };
        let fine = [
            request("d".repeat(MAX_NAME_BYTES), vec![many(1)]),
            request("d".to_owned(), vec![many(1); MAX_DESCRIPTORS]),
            request("d".to_owned(), vec![many(MAX_ENTRIES)]),
            request(
                "d".to_owned(),
                vec![vec![entry(&"k".repeat(MAX_NAME_BYTES), "")]],
            ),
            request(
                "d".to_owned(),
                vec![vec![entry("k", &"v".repeat(MAX_VALUE_BYTES))]],
            ),
            with_id("r".repeat(MAX_NAME_BYTES)),
        ];
        for parsed in &fine {
            assert!(check_bounds(parsed).is_ok(), "{parsed:?}");
        }
        let refused = [
            (
                request(String::new(), vec![many(1)]),
                "domain must not be empty",
            ),
            (
                request("d".repeat(MAX_NAME_BYTES + 1), vec![many(1)]),
                "domain is 257 bytes long; at most 256",
            ),
            (request("d".to_owned(), vec![]), "at least one descriptor"),
            (
                request("d".to_owned(), vec![many(1); MAX_DESCRIPTORS + 1]),
                "at most 32 descriptors",
            ),
            (
                request("d".to_owned(), vec![many(1), many(MAX_ENTRIES + 1)]),
                "descriptors[1] must have 1 to 32 entries",
            ),
            (
                request("d".to_owned(), vec![many(0)]),
                "descriptors[0] must have 1 to 32 entries",
            ),
            (
                request("d".to_owned(), vec![vec![entry("", "v")]]),
                "descriptors[0] has an empty entry name",
            ),
            (
                request("d".to_owned(), vec![vec![entry("k", "v"), entry("k", "w")]]),
                "descriptors[0] names entry \\\"k\\\" twice",
            ),
            (
                request(
                    "d".to_owned(),
                    vec![vec![entry(&"k".repeat(MAX_NAME_BYTES + 1), "v")]],
                ),
                "an entry name is 257 bytes long; at most 256",
            ),
            (
                request(
                    "d".to_owned(),
                    vec![vec![entry("k", &"v".repeat(MAX_VALUE_BYTES + 1))]],
                ),
                "an entry value is 1025 bytes long; at most 1024",
            ),
            (
                Parsed {
                    cost: 0,
                    ..request("d".to_owned(), vec![many(1)])
                },
                "cost must be at least 1",
            ),
            (with_id(String::new()), "request_id must be 1 to 256 bytes"),
            (
                with_id("r".repeat(MAX_NAME_BYTES + 1)),
                "request_id must be 1 to 256 bytes",
            ),
        ];
        for (parsed, message) in &refused {
            let err = format!("{:?}", check_bounds(parsed).err());
            assert!(err.contains(message), "{message}: {err}");
        }
    }

    /// Each kind of refusal from the decision has its own status and code.
    #[test]
    fn decision_errors_are_answered_by_kind() {
        let answer = |source| {
            let err = decide_error(DecideError::Invalid(tollgate_policy::Error::Check {
                limit: "per-user".to_owned(),
                source,
            }));
            let text = format!("{err:?}");
            (err.status(), text)
        };
        for (source, status, code) in [
            (
                tollgate::Error::IdempotencyConflict,
                StatusCode::CONFLICT,
                "idempotency_conflict",
            ),
            (
                tollgate::Error::InvalidRequestId { len: 0 },
                StatusCode::BAD_REQUEST,
                "invalid_request_id",
            ),
            (
                tollgate::Error::InvalidCost {
                    cost: 9,
                    capacity: 3,
                },
                StatusCode::BAD_REQUEST,
                "invalid_cost",
            ),
        ] {
            let (got, text) = answer(source);
            assert_eq!(got, status, "{text}");
            assert!(text.contains(code), "{code}: {text}");
        }
    }

    /// Strings go out as serde writes them, those with nothing but bytes to escape too.
    #[test]
    fn strings_are_written_as_serde_writes_them() {
        for value in [
            "",
            "plain",
            "\"",
            "\\",
            "\u{1}",
            " ",
            "\"\\\u{1f}",
            "é\u{7f}",
        ] {
            let mut out = Vec::new();
            push_str(&mut out, value);
            assert_eq!(
                String::from_utf8(out).unwrap(),
                serde_json::to_string(value).unwrap(),
                "{value:?}"
            );
        }
    }

    /// Durations go out in whole milliseconds, rounded up: a wait is never shortened.
    #[test]
    fn milliseconds_round_up() {
        use std::time::Duration;
        for (duration, millis) in [
            (Duration::ZERO, 0),
            (Duration::from_nanos(1), 1),
            (Duration::from_millis(1), 1),
            (Duration::from_nanos(1_000_001), 2),
            (Duration::from_secs(60), 60_000),
            (Duration::MAX, u64::MAX),
        ] {
            assert_eq!(millis_ceil(duration), millis, "{duration:?}");
        }
    }

    /// The body as serde would write it from a derived `Serialize`: the reference that
    /// [`write_body`] must match byte for byte.
    #[derive(Serialize)]
    struct Reference<'a> {
        allowed: bool,
        policy_version: &'a str,
        limits: Vec<LimitReference<'a>>,
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        degraded: bool,
        #[serde(skip_serializing_if = "Option::is_none")]
        error: Option<serde_json::Value>,
    }

    #[derive(Serialize)]
    struct LimitReference<'a> {
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
        denied: Option<bool>,
        #[serde(skip_serializing_if = "Option::is_none")]
        exempted_by: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        bucket_key: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        descriptor: Option<usize>,
    }

    fn reference(outcome: &Outcome, explain: bool) -> Vec<u8> {
        let limits = outcome
            .limits
            .iter()
            .map(|limit| {
                let decision = limit.decision.as_ref();
                LimitReference {
                    name: &limit.name,
                    mode: limit.mode,
                    allowed: decision.map_or(!outcome.failed_closed, Decision::allowed),
                    remaining: decision.map(Decision::remaining),
                    capacity: decision.map(Decision::capacity),
                    retry_after_ms: decision
                        .filter(|d| !d.is_denied())
                        .map(|d| d.retry_after().map_or(0, millis_ceil)),
                    reset_after_ms: decision.map(|d| millis_ceil(d.reset_after())),
                    denied: decision.filter(|d| d.is_denied()).map(|_| true),
                    exempted_by: limit.exempted_by.as_deref(),
                    bucket_key: explain.then_some(limit.bucket_key.as_str()),
                    descriptor: explain.then_some(limit.descriptor),
                }
            })
            .collect();
        let body = Reference {
            allowed: outcome.allowed,
            policy_version: &outcome.policy_version,
            limits,
            degraded: outcome.degraded,
            error: outcome.failed_closed.then(|| {
                serde_json::json!({
                    "code": "store_unavailable",
                    "message": "the shared store cannot answer and a limit fails closed",
                })
            }),
        };
        serde_json::to_vec(&body).unwrap()
    }

    const POLICY: &str = r#"
version: "v\"1\" \u00e9\u0001"
defaults: {failure_mode: closed}
limits:
  - {name: per-user, domain: api, key: [user], capacity: 3, refill: 1/s}
  - {name: trial, domain: api, key: [user], capacity: 3, refill: 1/m, mode: shadow}
  - {name: vip, domain: api, key: [user], capacity: 3, refill: 1/h}
  - {name: blocked, domain: api, when: {user: "u-bad"}, deny: true}
exemptions:
  - {limit: vip, when: {user: "a\"b"}, owner: "ops <ops@example.com>", reason: test, expires: "2099-01-01T00:00:00Z"}
"#;

    #[test]
    fn the_body_matches_serde_byte_for_byte() {
        let policy = compile("test.yaml", POLICY).unwrap();
        let engine = PolicyEngine::new(policy, EngineOptions::default());
        let descriptors = |user: &str| vec![vec![("user".to_owned(), user.to_owned())]];
        let mut outcomes = Vec::new();
        // Plain, and with each kind of byte JSON escapes alone: a quote, a backslash, a
        // control character.
        for user in [
            "u1",
            "a\"b",
            "\u{1F600}\\",
            "tab\tonly",
            "nul\u{1}",
            "u-bad",
        ] {
            for cost in [1, 2, 3] {
                outcomes.push(engine.decide("api", &descriptors(user), cost, None));
            }
            outcomes.push(engine.explain("api", &descriptors(user), 1));
        }
        outcomes.push(engine.decide("api", &descriptors("u9"), 1, Some("r-1")));
        outcomes.push(engine.decide("other", &descriptors("u1"), 1, None));
        outcomes.push(engine.decide_degraded("api", &descriptors("u1"), 1, "test"));
        let outcomes: Vec<Outcome> = outcomes.into_iter().map(Result::unwrap).collect();
        assert!(
            outcomes.iter().any(|o| !o.allowed),
            "some request is rejected"
        );
        assert!(outcomes.iter().any(|o| o.failed_closed && o.degraded));
        assert!(
            outcomes
                .iter()
                .any(|o| o.limits.iter().any(|l| l.exempted_by.is_some()))
        );
        assert!(outcomes.iter().any(Outcome::unmatched));
        assert!(outcomes.iter().any(|o| {
            o.limits
                .iter()
                .any(|l| l.decision.is_some_and(|d| d.is_denied()))
        }));
        for outcome in &outcomes {
            for explain in [false, true] {
                let written = write_body(outcome, explain);
                assert_eq!(
                    String::from_utf8(written).unwrap(),
                    String::from_utf8(reference(outcome, explain)).unwrap(),
                    "{outcome:?}"
                );
            }
        }
    }
}
