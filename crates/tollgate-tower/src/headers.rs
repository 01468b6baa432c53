//! The HTTP rate-limit fields, built from decisions.
//!
//! This is the one place that turns a [`Decision`] into `RateLimit-Policy`, `RateLimit` and
//! `Retry-After`, so the layer and the server answer with the same figures. The syntax is
//! draft-ietf-httpapi-ratelimit-headers (draft 10), whose fields are Structured Field Lists
//! (RFC 9651):
//!
//! ```text
//! RateLimit-Policy: "per-user";q=20;w=2
//! RateLimit: "per-user";r=0;t=1
//! Retry-After: 1
//! ```
//!
//! * `q`: the capacity (burst); `w`: seconds for an empty bucket to refill fully, rounded up.
//! * `r`: whole tokens left after this request.
//! * `t`: seconds, rounded up, until the request could pass when `r` is 0 (until the denied
//!   request's cost is there, or one token after an admitted request that emptied the bucket);
//!   otherwise until the bucket is full again.
//! * `Retry-After`: whole seconds, rounded up, at least 1, never earlier than `t`.
//!
//! A denial ([`Decision::denied`], a policy's `deny`) is a quota of nothing that no wait
//! changes: `"name";q=0` and `"name";r=0`, without `w`, `t` or `Retry-After`.
//!
//! Every figure rounds up, so a client that waits what it is told is never refused for coming
//! back early.
//!
//! # `X-RateLimit-*`, for clients written against them
//!
//! Before the draft, APIs answered `X-RateLimit-Limit`, `X-RateLimit-Remaining` and
//! `X-RateLimit-Reset`, one limit each, and many clients still read them. A [`HeaderStyle`]
//! asks for them instead of the draft's fields or beside them ([`x_rate_limit`]):
//!
//! ```text
//! X-RateLimit-Limit: 20
//! X-RateLimit-Remaining: 0
//! X-RateLimit-Reset: 1
//! ```
//!
//! They hold one limit, so they speak for the one the client must heed: of the applicable
//! limits, a rejecting one (the longest wait of those), else the one with the fewest tokens
//! left. `Limit` is its capacity, `Remaining` its whole tokens left, and `Reset` **delta
//! seconds**, the draft's `t` (as Envoy's `x-ratelimit-reset`; GitHub's means a Unix time, so
//! a client written for GitHub reads it as long past and retries at once, where `Retry-After`
//! still holds it). A denial is `Limit: 0`, `Remaining: 0` and no `Reset`.

use std::cell::RefCell;
use std::time::Duration;

use http::HeaderValue;
use http::header::HeaderName;
use tollgate::{Decision, Limit};

/// `RateLimit-Policy`: the quota of each applicable limit.
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");

/// `RateLimit`: what is left of each applicable limit.
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// `X-RateLimit-Limit`: the capacity of the limit the client must heed.
pub const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");

/// `X-RateLimit-Remaining`: its whole tokens left.
pub const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");

/// `X-RateLimit-Reset`: seconds from now, rounded up, as the draft's `t`.
pub const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// Which rate-limit fields an answer carries. `Retry-After` goes on every 429 that a wait can
/// lift, whichever is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HeaderStyle {
    /// `RateLimit-Policy` and `RateLimit` (the IETF draft), one item per applicable limit.
    #[default]
    Ietf,
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining` and `X-RateLimit-Reset` (see
    /// [`x_rate_limit`]).
    XRateLimit,
    /// Both sets.
    Both,
    /// Neither: quotas are not shown to the client.
    None,
}

impl HeaderStyle {
    /// Whether the draft's fields are sent.
    pub fn ietf(self) -> bool {
        matches!(self, Self::Ietf | Self::Both)
    }

    /// Whether the `X-RateLimit-*` fields are sent.
    pub fn x_rate_limit(self) -> bool {
        matches!(self, Self::XRateLimit | Self::Both)
    }
}

impl std::fmt::Display for HeaderStyle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Ietf => "ietf",
            Self::XRateLimit => "x-ratelimit",
            Self::Both => "both",
            Self::None => "none",
        })
    }
}

/// A [`HeaderStyle`] name that is none of `ietf`, `x-ratelimit`, `both` and `none`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown rate-limit header style {0:?}: expected ietf, x-ratelimit, both or none")]
pub struct UnknownHeaderStyle(pub String);

impl std::str::FromStr for HeaderStyle {
    type Err = UnknownHeaderStyle;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "ietf" => Ok(Self::Ietf),
            "x-ratelimit" => Ok(Self::XRateLimit),
            "both" => Ok(Self::Both),
            "none" => Ok(Self::None),
            other => Err(UnknownHeaderStyle(other.to_owned())),
        }
    }
}

/// The figures of the `X-RateLimit-*` fields (see [`x_rate_limit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XRateLimit {
    /// `X-RateLimit-Limit`: the capacity; 0 for a denial.
    pub limit: u64,
    /// `X-RateLimit-Remaining`: whole tokens left.
    pub remaining: u64,
    /// `X-RateLimit-Reset`: seconds from now, rounded up; `None` for a denial, which no wait
    /// lifts.
    pub reset: Option<u64>,
}

impl XRateLimit {
    /// The three fields (two for a denial), as names and values.
    pub fn fields(&self) -> impl Iterator<Item = (HeaderName, HeaderValue)> + use<> {
        [
            Some((X_RATELIMIT_LIMIT, HeaderValue::from(self.limit))),
            Some((X_RATELIMIT_REMAINING, HeaderValue::from(self.remaining))),
            self.reset
                .map(|reset| (X_RATELIMIT_RESET, HeaderValue::from(reset))),
        ]
        .into_iter()
        .flatten()
    }
}

/// The `X-RateLimit-*` figures of the limit a client must heed among the applicable ones: a
/// denial, else the rejecting limit with the longest wait, else the limit with the fewest
/// tokens left (of equals, the one full last, then the first). `None` when there is none.
///
/// ```
/// use tollgate::{Limit, ManualClock, RateLimiter};
/// use tollgate_tower::headers::{XRateLimit, x_rate_limit};
///
/// let clock = ManualClock::new();
/// let per_user = RateLimiter::new(Limit::new(20, "10/s".parse()?)?, clock.clone());
/// let per_ip = RateLimiter::new(Limit::new(100, "100/m".parse()?)?, clock);
/// let user = per_user.check_n("alice", 15)?;
/// let ip = per_ip.check_n("10.0.0.1", 15)?;
/// // The user has 5 left, the address 85: the user's limit is the one to heed.
/// let fields = x_rate_limit([("per-user", &user), ("per-ip", &ip)]);
/// assert_eq!(fields, Some(XRateLimit { limit: 20, remaining: 5, reset: Some(2) }));
/// # Ok::<(), tollgate::Error>(())
/// ```
pub fn x_rate_limit<'a>(
    items: impl IntoIterator<Item = (&'a str, &'a Decision)>,
) -> Option<XRateLimit> {
    // Smaller is tighter: a denial, then rejections by longest wait, then admissions by
    // fewest tokens left and latest reset.
    let tightness = |decision: &Decision| {
        let reset = reset_secs(decision);
        if decision.is_denied() {
            (0, 0, 0)
        } else if !decision.allowed() {
            (1, u64::MAX - reset, 0)
        } else {
            (2, decision.remaining(), u64::MAX - reset)
        }
    };
    let mut tightest: Option<(&Decision, (u8, u64, u64))> = None;
    for (_, decision) in items {
        let this = tightness(decision);
        if tightest.is_none_or(|(_, best)| this < best) {
            tightest = Some((decision, this));
        }
    }
    let (decision, _) = tightest?;
    if decision.is_denied() {
        return Some(XRateLimit {
            limit: 0,
            remaining: 0,
            reset: None,
        });
    }
    Some(XRateLimit {
        limit: decision.limit().capacity(),
        remaining: decision.remaining(),
        reset: Some(reset_secs(decision)),
    })
}

/// `Duration` in whole seconds, rounded up (a nanosecond over a second is two seconds).
pub fn ceil_secs(duration: Duration) -> u64 {
    duration.as_secs() + u64::from(duration.subsec_nanos() > 0)
}

/// The `Retry-After` seconds for a rejection: its exact wait rounded up, and at least 1 (a 0
/// would invite an immediate retry that the client has no reason to expect will pass). `None`
/// when the decision allowed the request.
pub fn retry_after_secs(decision: &Decision) -> Option<u64> {
    decision.retry_after().map(|wait| ceil_secs(wait).max(1))
}

/// The `t` parameter of a `RateLimit` item, in seconds, rounded up.
///
/// When tokens remain it is the time until the bucket is full. When none remain, it is the time
/// until the request could pass: for a rejection, until its cost is there; for an admission
/// that emptied the bucket, until one token is (the reset time less the time that refills the
/// other `capacity - 1` tokens, rounded so that it never comes out early).
pub fn reset_secs(decision: &Decision) -> u64 {
    if decision.is_denied() {
        return 0;
    }
    if let Some(wait) = decision.retry_after() {
        return ceil_secs(wait);
    }
    let reset = decision.reset_after();
    let limit = decision.limit();
    // A window with nothing left frees room only as it moves on: the reset is the wait, to
    // the next window for a fixed one (for a sliding one, an upper bound on it).
    if decision.remaining() > 0 || limit.algorithm().is_window() {
        return ceil_secs(reset);
    }
    let rate = limit.refill();
    let others = u128::from(limit.capacity() - 1);
    // Floor of the time `others` tokens take: subtracted from a reset that was rounded up, the
    // result is never below the exact wait for one token.
    let others_nanos = others * rate.period().as_nanos() / u128::from(rate.amount());
    let one_token = reset.as_nanos().saturating_sub(others_nanos);
    let secs = one_token.div_ceil(1_000_000_000);
    u64::try_from(secs).unwrap_or(u64::MAX)
}

/// The `RateLimit-Policy` and `RateLimit` values for the applicable limits, one list item per
/// limit name in the order given; `None` when there is none. A name given more than once (one
/// limit applied to several descriptors, each with its own bucket) gets one item, from its most
/// constrained decision (a rejection first, then the fewest tokens left): clients tell items
/// apart by name, and the tightest bucket is the one they must respect.
///
/// Names become Structured Field strings: `"` and `\` are escaped, and characters a
/// Structured Field string cannot hold (control characters, anything outside ASCII) are
/// written as `?`, so any name yields a valid header.
///
/// ```
/// use tollgate::{Limit, ManualClock, RateLimiter};
/// use tollgate_tower::headers::rate_limit_headers;
///
/// let limiter = RateLimiter::new(Limit::new(20, "10/s".parse()?)?, ManualClock::new());
/// let decision = limiter.check_n("alice", 20)?;
/// let (policy, ratelimit) = rate_limit_headers([("per-user", &decision)]).unwrap();
/// assert_eq!(policy, r#""per-user";q=20;w=2"#);
/// assert_eq!(ratelimit, r#""per-user";r=0;t=1"#);
/// # Ok::<(), tollgate::Error>(())
/// ```
pub fn rate_limit_headers<'a>(
    items: impl IntoIterator<Item = (&'a str, &'a Decision)> + Clone,
) -> Option<(HeaderValue, HeaderValue)> {
    let mut few = items.clone().into_iter();
    if let (Some((name, decision)), None) = (few.next(), few.next()) {
        // The usual answer names one limit.
        let state = rate_limit_value([(name, decision)])?;
        let policy = if decision.is_denied() {
            list(std::iter::once((name, policy_params(decision))))?
        } else {
            kept_policy_value(name, decision.limit())?
        };
        return Some((policy, state));
    }
    let policy = list(
        most_constrained_per_name(items.clone())
            .map(|(name, decision)| (name, policy_params(decision))),
    )?;
    Some((policy, rate_limit_value(most_constrained_per_name(items))?))
}

/// The parameters of a `RateLimit-Policy` item for what decided: the limit's, or a quota of
/// nothing for a denial.
fn policy_params(decision: &Decision) -> [(&'static str, u64); 2] {
    if decision.is_denied() {
        [("q", 0), NONE]
    } else {
        limit_params(decision.limit())
    }
}

/// The parameters of a limit's `RateLimit-Policy` item.
fn limit_params(limit: &Limit) -> [(&'static str, u64); 2] {
    [
        ("q", limit.capacity()),
        ("w", ceil_secs(policy_window(limit))),
    ]
}

/// A parameter slot left empty: [`list`] writes nothing for it.
const NONE: (&str, u64) = ("", 0);

/// `items` without the repeats of a name, each name kept at its most constrained decision (the
/// first of equals), each where that decision stands in the order given. Quadratic, for the
/// few items an answer has; no allocation.
fn most_constrained_per_name<'a>(
    items: impl IntoIterator<Item = (&'a str, &'a Decision)> + Clone,
) -> impl Iterator<Item = (&'a str, &'a Decision)> {
    let tightness = |decision: &Decision| (decision.allowed(), decision.remaining());
    let all = items.clone();
    items
        .into_iter()
        .enumerate()
        .filter(move |&(i, (name, decision))| {
            !all.clone()
                .into_iter()
                .enumerate()
                .any(|(j, (other, theirs))| {
                    other == name && j != i && (tightness(theirs), j) < (tightness(decision), i)
                })
        })
        .map(|(_, item)| item)
}

/// The `RateLimit-Policy` value alone, from the limits: it does not change from one decision
/// to the next, so a caller with fixed limits can build it once. `None` when there is none.
pub fn rate_limit_policy_value<'a>(
    items: impl IntoIterator<Item = (&'a str, &'a Limit)>,
) -> Option<HeaderValue> {
    list(
        items
            .into_iter()
            .map(|(name, limit)| (name, limit_params(limit))),
    )
}

/// The `w` of a limit's policy item: the window of a window limit (what the draft's quota
/// window means), and for a token bucket the time it takes to refill from empty, over which
/// it admits at most its capacity plus that refill.
fn policy_window(limit: &Limit) -> Duration {
    limit.window().unwrap_or_else(|| limit.time_to_full())
}

/// The `RateLimit-Policy` value of one limit, made once per thread for as long as the answers
/// it makes name that limit: the value changes only with the limit, and making it again for
/// every answer cost a third of the fields' instructions.
fn kept_policy_value(name: &str, limit: &Limit) -> Option<HeaderValue> {
    thread_local! {
        static LAST: RefCell<Option<(Box<str>, Limit, HeaderValue)>> = const { RefCell::new(None) };
    }
    LAST.with_borrow_mut(|last| {
        if let Some((last_name, last_limit, value)) = last
            && **last_name == *name
            && last_limit == limit
        {
            // A reference count: the value's bytes are shared.
            return Some(value.clone());
        }
        let value = rate_limit_policy_value([(name, limit)])?;
        *last = Some((name.into(), *limit, value.clone()));
        Some(value)
    })
}

/// The `RateLimit` value alone. `None` when there is none.
pub fn rate_limit_value<'a>(
    items: impl IntoIterator<Item = (&'a str, &'a Decision)>,
) -> Option<HeaderValue> {
    list(items.into_iter().map(|(name, decision)| {
        let t = if decision.is_denied() {
            NONE
        } else {
            ("t", reset_secs(decision))
        };
        (name, [("r", decision.remaining()), t])
    }))
}

/// A Structured Field List of `"name";k=v;k=v` items; `None` when empty. Built on every answer,
/// so the integers go through `itoa` rather than the formatting machinery.
fn list<'a>(
    items: impl Iterator<Item = (&'a str, [(&'static str, u64); 2])>,
) -> Option<HeaderValue> {
    let mut value = String::with_capacity(64);
    for (name, params) in items {
        if !value.is_empty() {
            value.push_str(", ");
        }
        push_sf_string(&mut value, name);
        for (key, number) in params {
            if key.is_empty() {
                continue;
            }
            value.push(';');
            value.push_str(key);
            value.push('=');
            value.push_str(itoa::Buffer::new().format(number));
        }
    }
    to_header_value(value)
}

fn to_header_value(value: String) -> Option<HeaderValue> {
    if value.is_empty() {
        return None;
    }
    // Only visible ASCII was written, so the conversion succeeds; a failure would drop the
    // field rather than panic.
    HeaderValue::try_from(value).ok()
}

/// Appends `name` as a Structured Field string (RFC 9651 §3.3.3).
fn push_sf_string(out: &mut String, name: &str) {
    out.push('"');
    // Limit names are nearly always plain: copy them whole.
    if name
        .bytes()
        .all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\')
    {
        out.push_str(name);
        out.push('"');
        return;
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate::{Limit, ManualClock, RateLimiter};

    #[test]
    fn names_become_valid_structured_field_strings() {
        let cases = [
            ("per-user", r#""per-user""#),
            (r#"a"b\c"#, r#""a\"b\\c""#),
            ("caf\u{e9}\tx", r#""caf??x""#),
            ("", "\"\""),
            // Names made only of the characters to escape.
            ("\"", r#""\"""#),
            ("\\", r#""\\""#),
        ];
        for (name, quoted) in cases {
            let mut out = String::new();
            push_sf_string(&mut out, name);
            assert_eq!(out, quoted, "{name:?}");
        }
    }

    fn limiter(capacity: u64, rate: &str) -> (RateLimiter<Box<str>, ManualClock>, ManualClock) {
        let clock = ManualClock::new();
        let limit = Limit::new(capacity, rate.parse().unwrap()).unwrap();
        (RateLimiter::new(limit, clock.clone()), clock)
    }

    /// One limit's `RateLimit-Policy` is the one made for the last answer naming it, never
    /// another limit's: not one of the same name with other figures (an override, a new
    /// policy version), nor one of another name with the same figures.
    #[test]
    fn a_kept_policy_value_is_used_only_for_its_own_limit() {
        let limits = [
            ("per-user", limiter(3, "1/s")),
            ("per-user", limiter(3, "1/s")),
            ("per-user", limiter(4, "1/s")),
            ("per-user", limiter(3, "2/s")),
            ("per-ip", limiter(3, "1/s")),
            ("per-user", limiter(3, "1/s")),
        ];
        let mut seen = std::collections::HashSet::new();
        for round in 1..=3 {
            for (name, (limiter, _)) in &limits {
                let decision = limiter.check_n("k", round).unwrap();
                let (policy, state) = rate_limit_headers([(*name, &decision)]).unwrap();
                let made = rate_limit_policy_value([(*name, decision.limit())]).unwrap();
                assert_eq!(policy, made);
                assert_eq!(state, rate_limit_value([(*name, &decision)]).unwrap());
                seen.insert(policy);
            }
        }
        assert_eq!(seen.len(), 4, "{seen:?}");
    }

    #[test]
    fn seconds_round_up() {
        assert_eq!(ceil_secs(Duration::ZERO), 0);
        assert_eq!(ceil_secs(Duration::from_nanos(1)), 1);
        assert_eq!(ceil_secs(Duration::from_secs(2)), 2);
        assert_eq!(ceil_secs(Duration::from_millis(2001)), 3);
    }

    #[test]
    fn a_rejection_retries_after_at_least_a_second() {
        let (limiter, _) = limiter(2, "10/s");
        limiter.check_n("k", 2).unwrap();
        let denied = limiter.check("k").unwrap();
        assert_eq!(denied.retry_after(), Some(Duration::from_millis(100)));
        assert_eq!(retry_after_secs(&denied), Some(1));
        assert_eq!(reset_secs(&denied), 1);
        let (limiter, _) = limiter_slow();
        limiter.check("k").unwrap();
        let denied = limiter.check("k").unwrap();
        // One token per 90 s: a whole number of seconds stays as it is.
        assert_eq!(retry_after_secs(&denied), Some(90));
    }

    #[test]
    fn a_name_given_twice_gets_one_item_from_its_tightest_bucket() {
        let (per_user, _) = limiter(5, "1/s");
        let roomy = per_user.check("a").unwrap();
        let tight = per_user.check_n("b", 4).unwrap();
        let (global, _) = limiter(3, "1/s");
        let other = global.check("c").unwrap();
        let items = [
            ("per-user", &roomy),
            ("global", &other),
            ("per-user", &tight),
        ];
        let (policy, state) = rate_limit_headers(items).unwrap();
        assert_eq!(policy, r#""global";q=3;w=3, "per-user";q=5;w=5"#);
        assert_eq!(state, r#""global";r=2;t=1, "per-user";r=1;t=4"#);
        // Equals keep the first.
        let (_, state) = rate_limit_headers([("l", &roomy), ("l", &roomy)]).unwrap();
        assert_eq!(state, r#""l";r=4;t=1"#);
    }

    fn limiter_slow() -> (RateLimiter<Box<str>, ManualClock>, ManualClock) {
        limiter(1, "2/3m")
    }

    #[test]
    fn t_is_the_time_to_full_while_tokens_remain() {
        let (limiter, _) = limiter(10, "1/s");
        let decision = limiter.check_n("k", 3).unwrap();
        assert_eq!(decision.remaining(), 7);
        let (_, ratelimit) = rate_limit_headers([("a", &decision)]).unwrap();
        assert_eq!(ratelimit, r#""a";r=7;t=3"#);
    }

    #[test]
    fn t_is_the_time_to_one_token_when_an_admission_empties_the_bucket() {
        let (limiter, clock) = limiter(10, "1/s");
        let decision = limiter.check_n("k", 10).unwrap();
        assert_eq!(decision.remaining(), 0);
        assert_eq!(reset_secs(&decision), 1);
        // Partway through a refill, then emptied again: 0.4 s to the next token rounds up.
        clock.advance(Duration::from_millis(1600));
        let decision = limiter.check("k").unwrap();
        assert_eq!(decision.remaining(), 0);
        assert_eq!(reset_secs(&decision), 1);
        let (limiter, _) = limiter_slow();
        let decision = limiter.check("k").unwrap();
        assert_eq!(reset_secs(&decision), 90);
    }

    #[test]
    fn a_denial_is_a_quota_of_nothing_without_a_wait() {
        let denied = Decision::denied(Limit::new(5, "1/s".parse().unwrap()).unwrap(), 1);
        let (policy, ratelimit) = rate_limit_headers([("blocked", &denied)]).unwrap();
        assert_eq!(policy, r#""blocked";q=0"#);
        assert_eq!(ratelimit, r#""blocked";r=0"#);
        assert_eq!(retry_after_secs(&denied), None);
        // Beside a limit that decided, each keeps its own figures.
        let (limiter, _clock) = limiter(20, "10/s");
        let decision = limiter.check_n("alice", 20).unwrap();
        let (policy, ratelimit) =
            rate_limit_headers([("per-user", &decision), ("blocked", &denied)]).unwrap();
        assert_eq!(policy, r#""per-user";q=20;w=2, "blocked";q=0"#);
        assert_eq!(ratelimit, r#""per-user";r=0;t=1, "blocked";r=0"#);
    }

    #[test]
    fn several_limits_are_one_list() {
        let (a, _) = limiter(20, "10/s");
        let (b, _) = limiter(100, "100/m");
        let da = a.check("k").unwrap();
        let db = b.check("k").unwrap();
        let (policy, ratelimit) = rate_limit_headers([("a", &da), ("b", &db)]).unwrap();
        assert_eq!(policy, r#""a";q=20;w=2, "b";q=100;w=60"#);
        assert_eq!(ratelimit, r#""a";r=19;t=1, "b";r=99;t=1"#);
    }

    #[test]
    fn a_window_limit_names_its_window_and_its_reset() {
        let clock = ManualClock::new();
        clock.advance(Duration::from_secs(15));
        let limit = Limit::sliding_window(100, Duration::from_secs(60)).unwrap();
        let limiter: RateLimiter<Box<str>, ManualClock> = RateLimiter::new(limit, clock.clone());
        let d = limiter.check_n("k", 100).unwrap();
        let (policy, ratelimit) = rate_limit_headers([("w", &d)]).unwrap();
        // w is the window, not the two windows a sliding count takes to drop to nothing.
        assert_eq!(policy, r#""w";q=100;w=60"#);
        assert_eq!(ratelimit, r#""w";r=0;t=105"#);
        let limit = Limit::fixed_window(10, Duration::from_secs(60)).unwrap();
        let limiter: RateLimiter<Box<str>, ManualClock> = RateLimiter::new(limit, clock);
        let d = limiter.check_n("k", 10).unwrap();
        // Emptied: room comes back when the window ends, 45 s on.
        assert_eq!(reset_secs(&d), 45);
        let denied = limiter.check("k").unwrap();
        assert_eq!(retry_after_secs(&denied), Some(45));
    }

    #[test]
    fn x_rate_limit_speaks_for_the_limit_to_heed() {
        let (roomy, _) = limiter(10, "1/s");
        let (tight, _) = limiter(100, "1/s");
        let (slow, _) = limiter(2, "1/m");
        let roomy = roomy.check_n("k", 2).unwrap(); // 8 left
        let tight = tight.check_n("k", 97).unwrap(); // 3 left
        assert_eq!(
            x_rate_limit([("roomy", &roomy), ("tight", &tight)]),
            Some(XRateLimit {
                limit: 100,
                remaining: 3,
                reset: Some(97)
            })
        );
        // A rejection wins over any admission, however few tokens that left.
        slow.check_n("k", 2).unwrap();
        let rejected = slow.check("k").unwrap();
        assert!(!rejected.allowed());
        let expected = XRateLimit {
            limit: 2,
            remaining: 0,
            reset: Some(60),
        };
        let items = [("tight", &tight), ("slow", &rejected), ("roomy", &roomy)];
        assert_eq!(x_rate_limit(items), Some(expected));
        // Of two rejections, the longer wait: the client must wait for both.
        let (quick, _) = limiter(1, "1/s");
        quick.check("k").unwrap();
        let soon = quick.check("k").unwrap();
        assert_eq!(reset_secs(&soon), 1);
        assert_eq!(
            x_rate_limit([("quick", &soon), ("slow", &rejected)]),
            Some(expected)
        );
        assert_eq!(
            x_rate_limit([("slow", &rejected), ("quick", &soon)]),
            Some(expected)
        );
        // A denial over everything, and no reset: no wait lifts it.
        let denied = Decision::denied(Limit::new(5, "1/s".parse().unwrap()).unwrap(), 1);
        let denial = x_rate_limit([("slow", &rejected), ("blocked", &denied)]).unwrap();
        assert_eq!(
            denial,
            XRateLimit {
                limit: 0,
                remaining: 0,
                reset: None
            }
        );
        let names: Vec<_> = denial.fields().map(|(name, _)| name).collect();
        assert_eq!(names, [X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING]);
        let fields: Vec<_> = x_rate_limit([("slow", &rejected)])
            .unwrap()
            .fields()
            .map(|(name, value)| format!("{name}: {}", value.to_str().unwrap()))
            .collect();
        assert_eq!(
            fields,
            [
                "x-ratelimit-limit: 2",
                "x-ratelimit-remaining: 0",
                "x-ratelimit-reset: 60"
            ]
        );
        assert_eq!(x_rate_limit(std::iter::empty()), None);
    }

    #[test]
    fn x_rate_limit_of_equal_tokens_left_is_the_one_full_last() {
        let (fast, _) = limiter(10, "1/s");
        let (slow, _) = limiter(10, "1/m");
        let fast = fast.check_n("k", 5).unwrap();
        let slow = slow.check_n("k", 5).unwrap();
        let expected = Some(XRateLimit {
            limit: 10,
            remaining: 5,
            reset: Some(300),
        });
        assert_eq!(x_rate_limit([("fast", &fast), ("slow", &slow)]), expected);
        assert_eq!(x_rate_limit([("slow", &slow), ("fast", &fast)]), expected);
    }

    /// Of limits alike in tokens left and in reset, the first given speaks: the same order
    /// gives the same fields on every answer.
    #[test]
    fn x_rate_limit_of_complete_equals_is_the_first() {
        let (small, _) = limiter(10, "1/s");
        let (large, _) = limiter(20, "3/s");
        // 5 left of each, full again in 5 s.
        let small = small.check_n("k", 5).unwrap();
        let large = large.check_n("k", 15).unwrap();
        assert_eq!(reset_secs(&small), reset_secs(&large));
        let first = |items: [(&'static str, &Decision); 2]| x_rate_limit(items).map(|x| x.limit);
        assert_eq!(first([("small", &small), ("large", &large)]), Some(10));
        assert_eq!(first([("large", &large), ("small", &small)]), Some(20));
    }

    #[test]
    fn header_styles_parse_and_print_alike() {
        for style in [
            HeaderStyle::Ietf,
            HeaderStyle::XRateLimit,
            HeaderStyle::Both,
            HeaderStyle::None,
        ] {
            assert_eq!(style.to_string().parse::<HeaderStyle>(), Ok(style));
        }
        assert_eq!(HeaderStyle::default(), HeaderStyle::Ietf);
        assert!(HeaderStyle::Both.ietf() && HeaderStyle::Both.x_rate_limit());
        assert!(!HeaderStyle::None.ietf() && !HeaderStyle::None.x_rate_limit());
        let err = "legacy".parse::<HeaderStyle>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown rate-limit header style \"legacy\": expected ietf, x-ratelimit, both or none"
        );
    }

    #[test]
    fn any_name_makes_a_valid_field() {
        let (limiter, _) = limiter(1, "1/s");
        let d = limiter.check("k").unwrap();
        let (policy, _) = rate_limit_headers([("a\"b\\c\né", &d)]).unwrap();
        assert_eq!(policy, r#""a\"b\\c??";q=1;w=1"#);
        assert!(rate_limit_headers(std::iter::empty()).is_none());
    }
}
