//! The IETF rate-limit header fields (draft-ietf-httpapi-ratelimit-headers, structured fields)
//! and `Retry-After`, built from decisions.
//!
//! ```text
//! RateLimit-Policy: "per-user";q=10;w=2
//! RateLimit: "per-user";r=0;t=1
//! Retry-After: 1
//! ```
//!
//! `q` is the capacity and `w` the seconds to refill from empty; `r` the whole tokens left and
//! `t` the seconds until this request could pass (when rejected) or until the bucket is full.
//! Every figure in seconds is rounded up: a client that waits what we say is never too early.

use std::fmt::Write;
use std::time::Duration;

use tollgate::Decision;

/// Whole seconds, rounded up.
pub fn ceil_secs(duration: Duration) -> u64 {
    duration.as_secs() + u64::from(duration.subsec_nanos() > 0)
}

/// Seconds for `Retry-After` on a rejection: the wait until `cost` tokens are back, rounded up,
/// and at least one (a zero would invite an immediate retry storm).
pub fn retry_after_secs(decision: &Decision) -> u64 {
    ceil_secs(decision.retry_after().unwrap_or(Duration::ZERO)).max(1)
}

/// Writes a limit name as a structured-field string: quotes and backslashes escaped, anything
/// outside printable ASCII replaced (structured strings cannot carry it).
fn push_sf_string(out: &mut String, name: &str) {
    out.push('"');
    for c in name.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => out.push('?'),
        }
    }
    out.push('"');
}

/// `RateLimit-Policy` and `RateLimit` values for `limits` (name, decision), one list item each.
/// `None` when there is no limit to describe.
pub fn rate_limit_fields<'a>(
    limits: impl IntoIterator<Item = (&'a str, &'a Decision)>,
) -> Option<(String, String)> {
    let mut policy = String::new();
    let mut state = String::new();
    for (name, decision) in limits {
        if !policy.is_empty() {
            policy.push_str(", ");
            state.push_str(", ");
        }
        let limit = decision.limit();
        push_sf_string(&mut policy, name);
        let _ = write!(
            policy,
            ";q={};w={}",
            limit.capacity(),
            ceil_secs(limit.time_to_full())
        );
        push_sf_string(&mut state, name);
        let until = match decision.retry_after() {
            Some(wait) => wait,
            None => decision.reset_after(),
        };
        let _ = write!(state, ";r={};t={}", decision.remaining(), ceil_secs(until));
    }
    (!policy.is_empty()).then_some((policy, state))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate::{Limit, Timestamp, bucket};

    #[test]
    fn fields_round_up_and_list_every_limit() {
        let limit = Limit::new(10, "3/s".parse().unwrap()).unwrap();
        let (_, state) = bucket::take(&limit, None, Timestamp::ZERO, 10).unwrap();
        let rejected = bucket::peek(&limit, state, Timestamp::ZERO, 1).unwrap();
        let allowed = bucket::peek(&limit, None, Timestamp::ZERO, 1).unwrap();
        let (policy, ratelimit) =
            rate_limit_fields([("per-user", &rejected), ("say \"hi\"", &allowed)]).unwrap();
        assert_eq!(policy, r#""per-user";q=10;w=4, "say \"hi\"";q=10;w=4"#);
        // One token at 3/s is 1/3 s away: t=1. The allowed one is full again in 1/3 s.
        assert_eq!(ratelimit, r#""per-user";r=0;t=1, "say \"hi\"";r=9;t=1"#);
        assert_eq!(retry_after_secs(&rejected), 1);
        assert!(rate_limit_fields([]).is_none());
    }

    #[test]
    fn ceil_secs_rounds_up() {
        assert_eq!(ceil_secs(Duration::from_nanos(1)), 1);
        assert_eq!(ceil_secs(Duration::from_secs(2)), 2);
        assert_eq!(ceil_secs(Duration::from_millis(2_001)), 3);
        assert_eq!(ceil_secs(Duration::ZERO), 0);
    }
}
