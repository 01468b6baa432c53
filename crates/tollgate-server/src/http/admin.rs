//! Health, readiness, metrics and the policy admin endpoints.
//!
//! `/v1/policy`, `/v1/policy/reload` and `/v1/policy/rollback` change or reveal the control
//! plane, so they need the bearer token when one is configured and are answered to loopback
//! clients only when none is.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{ConnectInfo, RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use tollgate_policy::{
    Error as PolicyError, Policy, ShadowAll, ShadowScope, SystemWallClock, WallClock,
};

use super::AppState;
use super::check::{body_bytes, json_body};
use super::error::ApiError;
use crate::decider::{FleetError, add_scope};
use crate::{metrics, policy_view};

pub(crate) async fn healthz() -> &'static str {
    "ok\n"
}

/// `GET /readyz[?exclude=store]`: ready when the policy is loaded, the store answers and the
/// server is in rotation. `exclude=store` leaves the store out, as Kubernetes' own `/readyz`
/// takes `exclude=etcd`: every replica shares one store, so when it is down a readiness that
/// asks it takes them all out of their Service at once, and clients get no answer at all,
/// where the servers would have answered by each limit's failure mode.
pub(crate) async fn readyz(
    State(state): State<Arc<AppState>>,
    RawQuery(query): RawQuery,
) -> Response {
    let ask_store = match excluded(query.as_deref()) {
        Ok(exclude_store) => !exclude_store,
        Err(name) => {
            return ApiError::bad_request(
                "invalid_query",
                format!("readiness has no check named {name:?} to exclude (only \"store\")"),
            )
            .into_response();
        }
    };
    let version = state.decider.engine().current().version().to_owned();
    let store = state.decider.backend().name();
    if state.rotation.is_leaving() {
        // On its way out (`--shutdown-delay`): still serving, but no new work should come.
        let body = json!({
            "ready": false,
            "policy_version": version,
            "store": store,
            "shutting_down": true,
        });
        return (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response();
    }
    let store_ready = if ask_store {
        state.decider.store_ready().await
    } else {
        Ok(())
    };
    match store_ready {
        Ok(()) => {
            Json(json!({"ready": true, "policy_version": version, "store": store})).into_response()
        }
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({
                "ready": false,
                "policy_version": version,
                "store": store,
                "store_error": reason.as_str(),
            })),
        )
            .into_response(),
    }
}

/// Whether a readiness query excludes the store: `Err` with a name it cannot exclude. Other
/// parameters are left alone (a probe may carry a cache buster).
fn excluded(query: Option<&str>) -> Result<bool, &str> {
    let mut store = false;
    for (name, value) in query
        .unwrap_or_default()
        .split('&')
        .filter_map(|pair| pair.split_once('='))
    {
        if name != "exclude" {
            continue;
        }
        match value {
            "store" => store = true,
            other => return Err(other),
        }
    }
    Ok(store)
}

pub(crate) async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let Some(handle) = &state.metrics else {
        return ApiError::new(
            StatusCode::NOT_FOUND,
            "metrics_disabled",
            "metrics are not enabled in this process",
        )
        .into_response();
    };
    metrics::refresh(state.decider.engine(), &mut state.exported_version.lock());
    metrics::refresh_connections(&state.connections);
    metrics::refresh_store(state.decider.backend());
    let mut text = handle.render();
    let decider = &state.decider;
    decider.hot_keys().render(decider.now(), &mut text);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// Lets the request through if it carries the admin token, or, with no token configured,
/// comes from this machine.
pub(super) fn authorize(
    token: Option<&str>,
    headers: &HeaderMap,
    peer: SocketAddr,
) -> Result<(), ApiError> {
    match token {
        Some(token) => {
            let given = headers
                .get(header::AUTHORIZATION)
                .and_then(|value| value.to_str().ok())
                .and_then(bearer_credentials);
            // An empty token would match an absent credential: the CLI refuses one, and a
            // server built without the CLI must not open admin to everyone either.
            let matches = given.is_some_and(|given| {
                !token.trim().is_empty() && constant_time_eq(given.as_bytes(), token.as_bytes())
            });
            if matches {
                Ok(())
            } else {
                Err(ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "unauthorized",
                    "admin endpoints need Authorization: Bearer <admin token>",
                ))
            }
        }
        // On a dual-stack listener an IPv4 client shows up as `::ffff:a.b.c.d`, which
        // `is_loopback` alone does not recognise as 127.0.0.1.
        None if peer.ip().to_canonical().is_loopback() => Ok(()),
        None => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            "admin endpoints answer loopback clients only; set --admin-token to open them",
        )),
    }
}

/// The credentials of an `Authorization: Bearer <credentials>` value, or `None` for another
/// scheme or no credentials. RFC 9110 §11.1 makes the scheme case-insensitive, and clients and
/// proxies differ in the spaces they put around it.
fn bearer_credentials(value: &str) -> Option<&str> {
    let (scheme, credentials) = value.trim().split_once([' ', '\t'])?;
    let credentials = credentials.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !credentials.is_empty()).then_some(credentials)
}

/// Compares without an early exit, so response times do not reveal how much of a guess matched.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for (i, &byte) in b.iter().enumerate() {
        diff |= usize::from(a.get(i).copied().unwrap_or(0) ^ byte);
    }
    diff == 0
}

fn status_body(state: &AppState) -> serde_json::Value {
    let status = state.decider.engine().status();
    json!({
        "version": status.version,
        "source": status.source,
        "loaded_at": status.loaded_at.to_rfc3339(),
        "history": status.history,
        "last_error": status.last_error.map(|(at, message)| json!({
            "at": at.to_rfc3339(),
            "message": message,
        })),
        "unmatched": status.unmatched,
        "changes": status.changes,
        "shadow_all": status.shadow_all.map(|on| {
            let mut switch = json!({
                "since": on.since.to_rfc3339(),
                "reason": on.reason,
                "fleet": on.fleet,
            });
            add_scope(&mut switch, &on.scope);
            switch
        }),
    })
}

/// Sets the fleet's switch through the shared store.
async fn set_fleet(state: &AppState, on: Option<ShadowAll>) -> Result<(), ApiError> {
    state
        .decider
        .set_fleet_shadow_all(on)
        .await
        .map_err(|err| match err {
            FleetError::NoSharedStore => {
                ApiError::new(StatusCode::CONFLICT, "no_shared_store", err.to_string())
            }
            FleetError::Store(_) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store_unavailable",
                format!("{err}; the switch is as it was: try again"),
            ),
        })
}

/// The longest reason the switch of every limit to shadow mode takes: a line of the audit log,
/// such as an incident's name and a few words.
const MAX_REASON: usize = 256;

/// Why a reason for the switch is refused, if it is.
pub(crate) fn check_reason(reason: &str) -> Result<(), String> {
    if reason.trim().is_empty() {
        return Err("give a reason (an incident, a rollout): the audit log keeps it".to_owned());
    }
    if reason.len() > MAX_REASON {
        return Err(format!("a reason is at most {MAX_REASON} bytes"));
    }
    if reason.chars().any(char::is_control) {
        return Err("a reason is one line of text, without control characters".to_owned());
    }
    Ok(())
}

/// The most domains, and the most limits, a narrowed switch lists: an incident's few services,
/// with room to spare.
const MAX_SCOPE: usize = 64;

/// The body of `POST /v1/policy/shadow-all`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ShadowAllBody {
    on: bool,
    #[serde(default)]
    reason: Option<String>,
    /// The fleet's switch, in the shared store every server reads, rather than this one's.
    #[serde(default)]
    fleet: bool,
    /// Narrowed to the limits of these domains (and of `limits`), rather than every limit.
    #[serde(default)]
    domains: Option<Vec<String>>,
    /// Narrowed to these limits (and those of `domains`).
    #[serde(default)]
    limits: Option<Vec<String>>,
}

impl ShadowAllBody {
    /// The limits the switch is for, each name known to the policy in force.
    fn scope(&mut self, policy: &Policy) -> Result<ShadowScope, ApiError> {
        let (domains, limits) = (self.domains.take(), self.limits.take());
        for list in [&domains, &limits].into_iter().flatten() {
            if list.is_empty() || list.len() > MAX_SCOPE {
                return Err(ApiError::bad_request(
                    "invalid_scope",
                    format!(
                        "\"domains\" and \"limits\" list 1 to {MAX_SCOPE} names; leave both out \
                         for every limit"
                    ),
                ));
            }
        }
        let scope = ShadowScope::domains(domains.unwrap_or_default())
            .with_limits(limits.unwrap_or_default());
        let unknown = scope.unknown_in(policy);
        if !unknown.is_empty() {
            return Err(ApiError::bad_request(
                "invalid_scope",
                format!(
                    "the policy in force ({}) has no {}: the switch would not cover what it \
                     names",
                    policy.version(),
                    unknown.join(", no ")
                ),
            ));
        }
        Ok(scope)
    }
}

/// `POST /v1/policy/shadow-all`: every limit in shadow mode (`{"on":true,"reason":"..."}`),
/// or each back to its own (`{"on":false}`), from the next decision on; answers the policy
/// status with the switch's state. See [`tollgate_policy::PolicyEngine::set_shadow_all`].
pub(crate) async fn shadow_all(
    State(state): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    authorize(state.options.admin_token.as_deref(), &headers, peer)?;
    let mut body: ShadowAllBody = json_body(body_bytes(&body)?)?;
    let engine = state.decider.engine();
    if !body.on && (body.domains.is_some() || body.limits.is_some()) {
        return Err(ApiError::bad_request(
            "invalid_scope",
            "\"domains\" and \"limits\" narrow a switch turned on; turning off takes neither",
        ));
    }
    match (body.on, body.reason.take()) {
        (true, Some(reason)) => {
            check_reason(&reason)
                .map_err(|problem| ApiError::bad_request("invalid_reason", problem))?;
            let scope = body.scope(&engine.current())?;
            if body.fleet {
                let on = ShadowAll::fleet(SystemWallClock.now(), reason).within(scope);
                set_fleet(&state, Some(on)).await?;
            } else {
                engine.set_shadow_within(&reason, scope);
            }
        }
        (true, None) => {
            return Err(ApiError::bad_request(
                "invalid_reason",
                "give a reason to turn it on (an incident, a rollout): the audit log keeps it",
            ));
        }
        (false, None) if body.fleet => set_fleet(&state, None).await?,
        (false, None) => {
            engine.set_shadow_all(None);
        }
        (false, Some(_)) => {
            return Err(ApiError::bad_request(
                "invalid_reason",
                "a reason is given to turn it on; the audit log keeps it with the turning off",
            ));
        }
    }
    Ok(Json(status_body(&state)).into_response())
}

pub(crate) async fn policy(
    State(state): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(state.options.admin_token.as_deref(), &headers, peer)?;
    let mut body = status_body(&state);
    let policy = state.decider.engine().current();
    if !policy.files().is_empty() {
        body["files"] = policy.files().iter().map(|f| json!(f.name())).collect();
    }
    body["limits"] = policy
        .limits()
        .iter()
        .map(|limit| policy_view::limit(policy.limits(), limit))
        .collect();
    let now = SystemWallClock.now();
    body["exemptions"] = policy
        .exemptions()
        .iter()
        .map(|exemption| {
            let mut body = policy_view::exemption(exemption);
            body["active"] = json!(exemption.is_active(now));
            body["uses"] = json!(exemption.uses());
            body
        })
        .collect();
    Ok(Json(body).into_response())
}

/// `GET /v1/hot-keys`: each limit's busiest keys of the last full window, with how much each
/// estimate may overstate. Admin only: keys are made of request values.
pub(crate) async fn hot_keys(
    State(state): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(state.options.admin_token.as_deref(), &headers, peer)?;
    let decider = &state.decider;
    let hot = decider.hot_keys();
    if !hot.enabled() {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "hot_keys_disabled",
            "hot keys are not counted in this process; start it with --hot-keys N",
        ));
    }
    let keys = hot.last_window(decider.now());
    let body = json!({
        "window_ms": u64::try_from(hot.window().as_millis()).unwrap_or(u64::MAX),
        "sample": crate::hot_keys::SAMPLE,
        "keys": keys,
    });
    Ok(Json(body).into_response())
}

pub(crate) async fn reload(
    State(state): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(state.options.admin_token.as_deref(), &headers, peer)?;
    let engine = state.decider.engine();
    if engine.path().is_none() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "no_policy_file",
            "this server runs the built-in demo policy; start it with --config FILE to reload",
        ));
    }
    let before = engine.current();
    match engine.reload() {
        Ok(policy) => {
            // What `tollgate validate` would warn about in the version now in force, and what
            // the reload changed, as `tollgate diff` says it.
            let mut body = status_body(&state);
            body["warnings"] = tollgate_policy::lint_by_file(&policy, SystemWallClock.now())
                .iter()
                .map(|(file, warning)| match file {
                    Some(file) => format!("{file}: {warning}"),
                    None => warning.to_string(),
                })
                .collect();
            body["diff"] = diff(&before, &policy);
            Ok(Json(body).into_response())
        }
        Err(
            err @ (PolicyError::Invalid(_)
            | PolicyError::Io { .. }
            | PolicyError::Unsupported { .. }),
        ) => Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "policy_refused",
            format!(
                "{err}; version {} stays in force",
                engine.current().version()
            ),
        )),
        Err(err) => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            err.to_string(),
        )),
    }
}

/// What changed from `before` to `after`, as `tollgate diff --json` gives it: so that whoever
/// reloads or rolls back reads at once which limits changed and whose buckets started afresh.
fn diff(before: &Policy, after: &Policy) -> serde_json::Value {
    serde_json::to_value(crate::diff::diff(before, after)).unwrap_or_default()
}

pub(crate) async fn rollback(
    State(state): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(state.options.admin_token.as_deref(), &headers, peer)?;
    let engine = state.decider.engine();
    let before = engine.current();
    match engine.rollback() {
        Ok(policy) => {
            let mut body = status_body(&state);
            body["diff"] = diff(&before, &policy);
            Ok(Json(body).into_response())
        }
        Err(PolicyError::NothingToRollBack) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "nothing_to_roll_back",
            "no earlier policy version is kept",
        )),
        Err(err) => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            err.to_string(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reason is what the audit log keeps of why nothing was rejected: one line of text,
    /// not blank, of bounded length.
    #[test]
    fn a_reason_is_one_line_of_text() {
        assert_eq!(check_reason("INC-42: false rejections, é"), Ok(()));
        assert_eq!(check_reason(&"x".repeat(MAX_REASON)), Ok(()));
        for bad in ["", " \t ", "two\nlines", "a\rb", "bell\u{7}"] {
            assert!(check_reason(bad).is_err(), "{bad:?}");
        }
        let long = check_reason(&"x".repeat(MAX_REASON + 1));
        assert_eq!(long, Err("a reason is at most 256 bytes".to_owned()));
    }

    #[test]
    fn readiness_may_leave_the_store_out_and_nothing_else() {
        assert_eq!(excluded(None), Ok(false));
        assert_eq!(excluded(Some("")), Ok(false));
        assert_eq!(excluded(Some("exclude=store")), Ok(true));
        assert_eq!(excluded(Some("t=1&exclude=store")), Ok(true));
        assert_eq!(excluded(Some("verbose")), Ok(false));
        assert_eq!(excluded(Some("exclude=redis")), Err("redis"));
        assert_eq!(excluded(Some("exclude=store&exclude=")), Err(""));
    }

    const REMOTE: &str = "203.0.113.7:40000";

    fn with_authorization(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, value.parse().unwrap());
        headers
    }

    fn peer(addr: &str) -> SocketAddr {
        addr.parse().unwrap()
    }

    /// `--admin-token ""` (say `--admin-token "$TOKEN"` with TOKEN unset) is refused at start;
    /// a server built without the CLI must still not let a client without credentials in,
    /// which would be worse than no token (admin kept to loopback).
    #[test]
    fn an_empty_admin_token_does_not_open_admin_to_everyone() {
        for token in ["", "  "] {
            for headers in [
                HeaderMap::new(),
                with_authorization("Bearer "),
                with_authorization("Bearer"),
                with_authorization(""),
            ] {
                assert!(
                    authorize(Some(token), &headers, peer(REMOTE)).is_err(),
                    "token {token:?}, {headers:?}"
                );
            }
        }
        assert!(authorize(Some("s3cret"), &HeaderMap::new(), peer(REMOTE)).is_err());
        assert!(authorize(Some("s3cret"), &HeaderMap::new(), peer("127.0.0.1:1")).is_err());
    }

    /// RFC 9110 §11.1: the auth scheme is case-insensitive; `bearer TOKEN` is a valid
    /// credential.
    #[test]
    fn the_bearer_scheme_is_case_insensitive_and_spaces_are_allowed() {
        for value in [
            "Bearer s3cret",
            "bearer s3cret",
            "BEARER s3cret",
            "  Bearer   s3cret  ",
            "Bearer\ts3cret",
        ] {
            let headers = with_authorization(value);
            assert!(
                authorize(Some("s3cret"), &headers, peer(REMOTE)).is_ok(),
                "{value:?}"
            );
        }
        for value in [
            "Bearer s3cre",
            "Bearer s3crets",
            "Basic s3cret",
            "Bearers3cret",
            "s3cret",
        ] {
            let headers = with_authorization(value);
            assert!(
                authorize(Some("s3cret"), &headers, peer(REMOTE)).is_err(),
                "{value:?}"
            );
        }
    }

    /// On a dual-stack listener (`--http [::]:8080`) `curl http://127.0.0.1:8080/v1/policy`
    /// comes from `::ffff:127.0.0.1`.
    #[test]
    fn ipv4_loopback_mapped_to_ipv6_is_loopback() {
        let none = HeaderMap::new();
        for local in [
            "127.0.0.1:1",
            "[::1]:1",
            "[::ffff:127.0.0.1]:1",
            "[::ffff:127.1.2.3]:1",
        ] {
            assert!(authorize(None, &none, peer(local)).is_ok(), "{local}");
        }
        for remote in [REMOTE, "[::ffff:203.0.113.7]:1", "[2001:db8::1]:1"] {
            assert!(authorize(None, &none, peer(remote)).is_err(), "{remote}");
        }
    }

    #[test]
    fn compares_tokens() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secre", b"secret"));
        assert!(!constant_time_eq(b"secrets", b"secret"));
        assert!(!constant_time_eq(b"", b"secret"));
    }
}
