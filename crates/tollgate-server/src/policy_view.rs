//! A compiled policy as the file writes it, in JSON: what `GET /v1/policy` lists, so that an
//! operator can read what is in force without the file at hand, and what `tollgate diff`
//! compares, so that a change reads in the file's own terms (`capacity`, `refill`, `12.5%`).

use serde_json::json;
use tollgate_policy::{Exemption, FailureMode, LimitDef, Override, Params, ValueMatch};

/// A limit as the policy file gives it, in force; `limits` are its policy's, among which its
/// `replaces` are named.
pub(crate) fn limit(limits: &[LimitDef], limit: &LimitDef) -> serde_json::Value {
    let mut body = json!({
        "name": limit.name(),
        "domain": limit.domain(),
        "when": conditions(limit.when()),
        "key": limit.key().collect::<Vec<_>>(),
        "algorithm": limit.algorithm(),
        "mode": limit.mode().as_str(),
        "rollout": rollout(limit.rollout()),
        "scope": limit.scope().as_str(),
        "overrides": limit.overrides().iter().map(override_entry).collect::<Vec<_>>(),
    });
    if let Some(file) = limit.file() {
        // Whose limit it is, in a policy directory kept one file per team.
        body["file"] = json!(file);
    }
    if limit.deny() {
        // No parameters, and no failure mode: a deny is decided without the store.
        body["deny"] = json!(true);
        if !limit.replaces().is_empty() {
            body["replaces"] = json!(replaced_names(limits, limit));
        }
        return body;
    }
    params_into(&mut body, limit.params());
    if !limit.replaces().is_empty() {
        body["replaces"] = json!(replaced_names(limits, limit));
    }
    if limit.applies_request_limit() {
        body["request_limit"] = json!("apply");
    }
    match limit.failure_mode() {
        FailureMode::Closed => body["failure_mode"] = json!("closed"),
        FailureMode::Open { emergency } => {
            body["failure_mode"] = json!("open");
            body["emergency"] = json!(emergency.refill().to_string());
        }
        FailureMode::OpenInFlight { emergency } => {
            body["failure_mode"] = json!("open");
            body["emergency"] = json!(emergency);
        }
        _ => {}
    }
    body
}

/// An override as the file gives it.
pub(crate) fn override_entry(o: &Override) -> serde_json::Value {
    let mut body = json!({"name": o.name(), "when": conditions(o.when())});
    if o.unlimited() {
        body["unlimited"] = json!(true);
    } else if o.deny() {
        body["deny"] = json!(true);
    } else {
        params_into(&mut body, o.params());
    }
    body
}

/// The names of the limits `limit` replaces.
fn replaced_names<'a>(limits: &'a [LimitDef], limit: &LimitDef) -> Vec<&'a str> {
    limit
        .replaces()
        .iter()
        .filter_map(|&i| limits.get(i as usize).map(LimitDef::name))
        .collect()
}

/// `params` under the names the policy file gives them: `capacity` and `refill`; `limit` and
/// `window`; `max_in_flight` and `lease_timeout`.
fn params_into(body: &mut serde_json::Value, params: &Params) {
    match params {
        Params::Rate(rate) => match rate.window() {
            None => {
                body["capacity"] = json!(rate.capacity());
                body["refill"] = json!(rate.refill().to_string());
            }
            Some(window) => {
                body["limit"] = json!(rate.capacity());
                body["window"] = json!(duration(window));
            }
        },
        Params::Concurrency(lease) => {
            body["max_in_flight"] = json!(lease.max_in_flight());
            body["lease_timeout"] = json!(duration(lease.timeout()));
        }
        _ => {}
    }
}

/// A `when` as JSON: an exact value as a string, a prefix as `{"prefix": …}`, a network as
/// `{"cidr": …}`, a list as an array of them (its values, prefixes, then networks, each
/// sorted).
fn conditions<'a>(entries: impl Iterator<Item = (&'a str, &'a ValueMatch)>) -> serde_json::Value {
    entries
        .map(|(name, test)| {
            let value = match test {
                ValueMatch::Prefix(prefix) => json!({ "prefix": prefix }),
                ValueMatch::Network(network) => json!({ "cidr": network.net().to_string() }),
                ValueMatch::AnyOf(list) => {
                    let values = list.values().iter().map(|v| json!(v));
                    let prefixes = list.prefixes().iter().map(|p| json!({ "prefix": p }));
                    let networks = list
                        .networks()
                        .iter()
                        .map(|n| json!({ "cidr": n.net().to_string() }));
                    serde_json::Value::Array(values.chain(prefixes).chain(networks).collect())
                }
                other => json!(other.text()),
            };
            (name.to_owned(), value)
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// `12.5%` from hundredths of a percent, as the file writes it.
fn rollout(hundredths: u16) -> String {
    match hundredths % 100 {
        0 => format!("{}%", hundredths / 100),
        part if part % 10 == 0 => format!("{}.{}%", hundredths / 100, part / 10),
        part => format!("{}.{part:02}%", hundredths / 100),
    }
}

/// `1m`, `30s`, `250ms`: a whole number of milliseconds in its largest exact unit, as the
/// file writes durations.
fn duration(length: std::time::Duration) -> String {
    let ms = length.as_millis();
    for (unit, name) in [
        (86_400_000, "d"),
        (3_600_000, "h"),
        (60_000, "m"),
        (1_000, "s"),
    ] {
        if ms >= unit && ms.is_multiple_of(unit) {
            return format!("{}{name}", ms / unit);
        }
    }
    format!("{ms}ms")
}

/// An exemption as the file gives it (without what only a running server knows: whether it is
/// active now, how often it was used).
pub(crate) fn exemption(exemption: &Exemption) -> serde_json::Value {
    let mut body = json!({
        "limit": exemption.limit(),
        "when": conditions(exemption.when()),
        "owner": exemption.owner(),
        "reason": exemption.reason(),
        "expires": exemption.expires().to_rfc3339(),
    });
    if let Some(file) = exemption.file() {
        body["file"] = json!(file);
    }
    body
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn rollouts_and_durations_read_as_the_file_writes_them() {
        assert_eq!(rollout(10_000), "100%");
        assert_eq!(rollout(1_250), "12.5%");
        assert_eq!(rollout(1_234), "12.34%");
        assert_eq!(rollout(5), "0.05%");
        assert_eq!(rollout(0), "0%");
        assert_eq!(duration(Duration::from_secs(60)), "1m");
        assert_eq!(duration(Duration::from_secs(90)), "90s");
        assert_eq!(duration(Duration::from_millis(1_500)), "1500ms");
        assert_eq!(duration(Duration::from_secs(86_400)), "1d");
        assert_eq!(duration(Duration::from_secs(7_200)), "2h");
    }
}
