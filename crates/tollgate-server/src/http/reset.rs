//! `POST /v1/reset`: an operator makes a subject's buckets new, without a policy change.
//!
//! ```text
//! POST /v1/reset
//! {"domain":"api","descriptors":[{"tenant":"acme","user":"u1"}],"limits":["per-user"]}
//! → 200 {"policy_version":"3","reset":[{"name":"per-user","bucket_key":"per-user|u1","descriptor":0}],"skipped":[]}
//! ```
//!
//! The request is named as a check names it; the buckets that would decide it (of the limits
//! in `limits`, when given) are made as if never used, on the shared store and in this
//! process's emergency buckets, and each is audited. Deny and global limits are skipped and
//! listed as such; concurrency limits are not looked at (leases are requests in flight). An
//! admin endpoint: the bearer token when one is configured, loopback clients only otherwise.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use tollgate_policy::Error as PolicyError;

use super::AppState;
use super::admin::authorize;
use super::check::{
    Parsed, RawDescriptor, body_bytes, check_bounds, decide_error, entries_of, json_body,
};
use super::error::ApiError;
use crate::decider::DecideError;

/// The most limit names one reset may list: a policy's limits are named in a request body of
/// bounded size anyway; this keeps the filter's scan short.
const MAX_LIMITS: usize = 64;

/// The request body: what a check would name, and optionally which of the limits that apply
/// to reset. Unknown fields are refused.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResetBody<'a> {
    #[serde(borrow)]
    domain: Cow<'a, str>,
    #[serde(borrow)]
    descriptors: Vec<RawDescriptor<'a>>,
    #[serde(default, borrow)]
    limits: Option<Vec<Cow<'a, str>>>,
}

pub(crate) async fn reset(
    State(state): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    authorize(state.options.admin_token.as_deref(), &headers, peer)?;
    let body: ResetBody<'_> = json_body(body_bytes(&body)?)?;
    let parsed = Parsed {
        domain: body.domain,
        descriptors: entries_of(body.descriptors)?,
        cost: 1,
        request_id: None,
    };
    check_bounds(&parsed)?;
    let limits: Option<Vec<&str>> = body
        .limits
        .as_ref()
        .map(|names| names.iter().map(|name| &**name).collect());
    if limits
        .as_ref()
        .is_some_and(|names| names.len() > MAX_LIMITS)
    {
        return Err(ApiError::bad_request(
            "too_large",
            format!("at most {MAX_LIMITS} limits may be named"),
        ));
    }
    let outcome = state
        .decider
        .reset(&parsed.domain, &parsed.descriptors, limits.as_deref())
        .await
        .map_err(|err| match err {
            DecideError::Internal(PolicyError::UnknownLimit { name }) => ApiError::bad_request(
                "unknown_limit",
                format!("the policy in force has no limit named {name:?}"),
            ),
            DecideError::Internal(PolicyError::Check {
                source: tollgate::Error::Unsupported { operation },
                ..
            }) => ApiError::new(
                StatusCode::CONFLICT,
                "unsupported",
                format!("this server's store cannot {operation}"),
            ),
            err => decide_error(err),
        })?;
    tracing::info!(
        domain = %parsed.domain,
        buckets = outcome.reset.len(),
        policy_version = %outcome.policy_version,
        "buckets reset"
    );
    let reset: Vec<serde_json::Value> = outcome
        .reset
        .iter()
        .map(|b| json!({"name": &*b.name, "bucket_key": b.bucket_key, "descriptor": b.descriptor}))
        .collect();
    let skipped: Vec<serde_json::Value> = outcome
        .skipped
        .iter()
        .map(|s| json!({"name": &*s.name, "descriptor": s.descriptor, "reason": s.reason}))
        .collect();
    let body = json!({
        "policy_version": &*outcome.policy_version,
        "reset": reset,
        "skipped": skipped,
    });
    Ok(Json(body).into_response())
}
