//! The token-bucket transition: the one piece of math every store implements.
//!
//! # Model
//!
//! A bucket of capacity `C` refilled at `amount` tokens per `period` holds `tokens` and was last
//! refilled at `last`. On `take(now, cost)`, as one step (SPEC §2):
//!
//! 1. `tokens = min(C, tokens + max(0, now - last) * amount / period)`, `last = max(last, now)`;
//! 2. if `tokens >= cost`, subtract and allow; otherwise reject and charge nothing.
//!
//! # Representation
//!
//! Instead of `(tokens, last)` a bucket keeps one number, the *theoretical arrival time* `tat`:
//! the instant at which it will be full again. Time is measured in *units* on a scaled timeline
//! (see [`Limit`]): one nanosecond is `a` units, one token is `p` units, both integers, so with
//! `N = now * a` the balance is exactly
//!
//! ```text
//! tokens(now) = (C*p - max(0, tat - N)) / p
//! ```
//!
//! and taking `cost` tokens moves `tat` to `max(tat, N) + cost*p`. Everything is integer
//! arithmetic on `u128`: no rounding, hence no drift over any run length. `tat` is stored as
//! `full_at = ceil(tat / a)` nanoseconds and the sub-nanosecond remainder `frac = full_at*a - tat`
//! (`frac < a < 2^32`), which lets a store expire a bucket without knowing its limit: the bucket is
//! full, and indistinguishable from a new one, exactly when `full_at <= now`.
//!
//! # Invariants
//!
//! These hold for every input, and are checked by property tests against a reference model with
//! exact rationals (`tests/bucket_model.rs`):
//!
//! * A new (absent) bucket is full.
//! * A rejection charges nothing: the stored state is not written.
//! * `tat` never decreases, so a `now` earlier than a previous one mints no tokens; the balance
//!   it shows is at most the balance at the latest time seen (fewer tokens, never more).
//! * Over any interval `[t0, t1]`, the cost allowed is at most `tokens(t0)` plus the exact refill
//!   over `t1 - t0`.
//! * `cost` outside `1..=capacity` is an [`Error::InvalidCost`], not a rejection: such a request
//!   would never pass.

use crate::clock::Timestamp;
use crate::decision::Decision;
use crate::error::Error;
use crate::limit::Limit;
use crate::sliding_log;
use crate::window;

/// The stored state of one bucket: the instant it is full again, to the sub-nanosecond.
///
/// Sixteen bytes. Meaningful only together with the [`Limit`] it was produced under, except for
/// [`BucketState::full_at`], which needs no limit to tell whether the bucket is full.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BucketState {
    full_at: u64,
    frac: u32,
}

impl BucketState {
    /// The first instant at which the bucket is full (and could be forgotten losslessly).
    pub fn full_at(&self) -> Timestamp {
        Timestamp::from_nanos(self.full_at)
    }

    /// Whether the bucket is full at `now`: then dropping it changes no future decision.
    pub fn is_full(&self, now: Timestamp) -> bool {
        self.full_at <= clamp(now)
    }

    /// A state with no sub-nanosecond remainder, full at `full_at` nanoseconds.
    pub(crate) fn whole(full_at: u64) -> Self {
        Self { full_at, frac: 0 }
    }

    /// A state from its two fields (for the windows, which give them other meanings: see
    /// [`crate::window`]).
    pub(crate) fn from_parts(full_at: u64, frac: u32) -> Self {
        Self { full_at, frac }
    }

    /// The sub-nanosecond remainder (0 for every limit whose tokens are a whole number of
    /// nanoseconds apart).
    pub(crate) fn frac(&self) -> u32 {
        self.frac
    }

    fn tat(&self, limit: &Limit) -> u128 {
        u128::from(self.full_at) * u128::from(limit.a()) - u128::from(self.frac)
    }

    fn from_tat(tat: u128, limit: &Limit) -> Self {
        let a = limit.a();
        if a == 1 {
            // The common case (any rate whose period is a multiple of its amount in ns):
            // units are nanoseconds, no division needed.
            return Self {
                full_at: tat as u64,
                frac: 0,
            };
        }
        let full_at = tat.div_ceil(u128::from(a));
        let frac = full_at * u128::from(a) - tat;
        // tat <= now*a + C*p with now <= 2^63 and C*p/a <= 2^62, and frac < a < 2^32, so both
        // casts are lossless for every input a valid Limit admits.
        Self {
            full_at: full_at as u64,
            frac: frac as u32,
        }
    }

    /// The state holding exactly `tokens` at `now`, for tests and imports of foreign state.
    /// For a window limit, the rest of the limit counts as used in the current window. `None`
    /// for a sliding log, which has no such state.
    ///
    /// `tokens` above the capacity is clamped to it.
    pub fn with_tokens(limit: &Limit, tokens: u64, now: Timestamp) -> Option<Self> {
        if limit.algorithm().keeps_log() {
            return None;
        }
        if limit.algorithm().is_window() {
            return window::with_tokens(limit, tokens, now);
        }
        let deficit = limit
            .capacity_units()
            .saturating_sub(u128::from(tokens) * u128::from(limit.p()));
        (deficit > 0).then(|| Self::from_tat(scaled(now, limit) + deficit, limit))
    }
}

/// The latest instant the math distinguishes: 2^63 ns, about 292 years after the clock's epoch.
/// Later timestamps count as this one (time stops, which mints nothing), so that `full_at`, at
/// most `MAX_NOW` plus [`crate::limit::MAX_TIME_TO_FULL`], always fits in a `u64`.
const MAX_NOW: u64 = 1 << 63;

fn clamp(now: Timestamp) -> u64 {
    now.as_nanos().min(MAX_NOW)
}

/// `now` on the limit's scaled timeline: at most 2^63 * 2^32.
fn scaled(now: Timestamp, limit: &Limit) -> u128 {
    u128::from(clamp(now)) * u128::from(limit.a())
}

/// Takes `cost` tokens from a bucket in `state` (absent: a new, full bucket) at `now`.
///
/// Returns the decision and, when allowed, the state to store. When rejected the state to store
/// is `None`: a rejection charges nothing and leaves the stored state as it was.
///
/// # Errors
///
/// [`Error::InvalidCost`] when `cost` is 0 or above the capacity; [`Error::UnsupportedLimit`]
/// for a sliding log, whose state is a log, not a [`BucketState`]. Nothing is decided.
// Always inlined: it is the whole of a memory-store check's arithmetic, and left to the
// compiler it stopped being inlined once the windows' branch joined it, which cost a check a
// third more instructions (a call, and the decision returned through memory).
#[inline(always)]
pub fn take(
    limit: &Limit,
    state: Option<BucketState>,
    now: Timestamp,
    cost: u64,
) -> Result<(Decision, Option<BucketState>), Error> {
    check_cost(limit, cost)?;
    if limit.algorithm().is_window() {
        if limit.algorithm().keeps_log() {
            return Err(Error::UnsupportedLimit {
                reason: "a sliding log is not one bucket state; check it through a store",
            });
        }
        return Ok(window::take(limit, state, now, cost));
    }
    let n = scaled(now, limit);
    let tat = state.map_or(n, |s| s.tat(limit)).max(n);
    let next = tat + u128::from(cost) * u128::from(limit.p());
    if next - n <= limit.capacity_units() {
        let decision = Decision::new(true, *limit, cost, next - n);
        Ok((decision, Some(BucketState::from_tat(next, limit))))
    } else {
        // `tat - n` exceeds the capacity when `now` is earlier than the bucket's last charge
        // (a clock read before another thread's charge, or a clock that went back). Reported
        // as empty: fewer tokens, never more, and `retry_after` then counts from the caller's
        // present, which is no earlier than that charge.
        let deficit = (tat - n).min(limit.capacity_units());
        Ok((Decision::new(false, *limit, cost, deficit), None))
    }
}

/// What [`take`] would decide at `now`, without changing anything.
///
/// # Errors
///
/// As [`take`].
pub fn peek(
    limit: &Limit,
    state: Option<BucketState>,
    now: Timestamp,
    cost: u64,
) -> Result<Decision, Error> {
    take(limit, state, now, cost).map(|(decision, _)| decision)
}

/// The bucket's balance at `now` as an allowed but *uncharged* decision for `cost`: what an
/// all-or-nothing check reports for the buckets that had room when another one rejected.
pub(crate) fn balance(
    limit: &Limit,
    state: Option<BucketState>,
    now: Timestamp,
    cost: u64,
) -> Decision {
    if limit.algorithm().keeps_log() {
        // Stores decide logs apart and never come here with one; an empty log is what a log
        // limit with no log has.
        return sliding_log::balance(limit, None, now, cost);
    }
    if limit.algorithm().is_window() {
        return window::balance(limit, state, now, cost);
    }
    let n = scaled(now, limit);
    let tat = state.map_or(n, |s| s.tat(limit)).max(n);
    // Clamped as in `take`: a `now` before the last charge shows an empty bucket.
    Decision::new(true, *limit, cost, (tat - n).min(limit.capacity_units()))
}

/// Gives `tokens` back to a bucket in `state`, for a request that was charged more
/// than it turned out to cost (a reservation settled for less: see [`crate::Settlement`]).
/// `charged_at` and `charged` are when the charge was made and the decision it got; only a
/// window needs them (they tell which window the charge went to).
///
/// A token bucket's full time moves back by exactly `tokens`' worth: the bucket is then as
/// full as if the charge had been smaller from the start, clamped at full. A window gives back
/// from the count its charge went to while the state still holds that count, never below 0,
/// and nothing once the window has passed (see [`crate::window`]). Either way a refund never
/// leaves more than a smaller charge would have: it cannot over-admit. Returns the state to
/// store; `None` when there was none (absent: full, nothing to give back).
pub(crate) fn give_back(
    limit: &Limit,
    state: Option<BucketState>,
    charged_at: Timestamp,
    charged: &Decision,
    tokens: u64,
) -> Option<BucketState> {
    let state = state?;
    if limit.algorithm().is_window() {
        let window = window::charged_window(limit, charged_at, charged.reset_after());
        return window::give_back(limit, state, window, tokens);
    }
    Some(tokens_back(limit, state, tokens))
}

/// Gives `tokens` back to a bucket in `state` with no record of the charge they came from: a
/// caller returning what it took earlier (Envoy's `is_negative_hits`), see
/// [`crate::Store::give_back`]. They come off the latest charges: a token bucket's full time
/// moves back by exactly `tokens`' worth, as in a settlement; a window gives back from the
/// latest count that holds anything (its current window's, else a sliding window's previous
/// one), never below 0.
///
/// # Invariant
///
/// At any time from the state's own on, the bucket holds at most `tokens` more than it would
/// have, and never more than its capacity: what the caller gives back is at most what it could
/// have spared by taking less, up to full. A token bucket gains exactly
/// `min(tokens, capacity - balance)`. Returns `None` when there was no state (absent: full).
pub(crate) fn give_back_latest(
    limit: &Limit,
    state: Option<BucketState>,
    tokens: u64,
) -> Option<BucketState> {
    let state = state?;
    if limit.algorithm().is_window() {
        return Some(window::give_back_latest(limit, state, tokens));
    }
    Some(tokens_back(limit, state, tokens))
}

/// A token bucket `tokens` fuller: its full time moved back by their worth.
fn tokens_back(limit: &Limit, state: BucketState, tokens: u64) -> BucketState {
    let tat = state
        .tat(limit)
        .saturating_sub(u128::from(tokens) * u128::from(limit.p()));
    // Kept even when it is already past `now`: a request timed before this one (read from a
    // clock earlier) still sees the charge's rest, as it would have without the refund.
    BucketState::from_tat(tat, limit)
}

/// Carries a bucket over a change of parameters at `now`.
///
/// The balance is refilled under `old` up to `now`, then converted to `new`: the token count is
/// kept (rounded down to `new`'s units, never up) and clamped to `new`'s capacity. Returns `None`
/// when the converted bucket is full, which is also what an absent bucket means.
///
/// A bucket full under `old` by `now` is full under `new`, whatever the capacities: a full
/// bucket and an absent one are the same bucket (lossless expiry, SPEC §2), and an absent one
/// cannot be converted, since no store knows every key that has no state. So a limit whose
/// capacity grows gives its idle subjects the new burst at once; only the balances of subjects
/// still refilling carry over (no fresh burst for those).
///
/// A window limit whose limit per window changes keeps its counts (they mean the same under
/// any limit); any other change to or from a window keeps the whole tokens left at `now`,
/// clamped to `new`'s capacity (see [`BucketState::with_tokens`]).
pub fn rebase(
    old: &Limit,
    new: &Limit,
    state: Option<BucketState>,
    now: Timestamp,
) -> Option<BucketState> {
    let state = state?;
    if old.algorithm().is_window() || new.algorithm().is_window() {
        if old.algorithm() == new.algorithm() && old.window() == new.window() {
            return (!state.is_full(now)).then_some(state);
        }
        let tokens = balance(old, Some(state), now, 1).remaining();
        return BucketState::with_tokens(new, tokens, now);
    }
    let n_old = scaled(now, old);
    let deficit_old = state.tat(old).saturating_sub(n_old);
    if deficit_old == 0 {
        return None;
    }
    // tokens = (C_old*p_old - deficit_old) / p_old; in new units, times p_new, floored.
    let tokens_old_units = old.capacity_units() - deficit_old.min(old.capacity_units());
    // floor(tokens_old_units * p_new / p_old), split into whole tokens and the rest of one:
    // the direct product can pass 2^128 (up to 2^94 units times a p near 2^64), while each
    // part stays below it (whole tokens are at most a u64, the rest is below p_old).
    let (p_old, p_new) = (u128::from(old.p()), u128::from(new.p()));
    let (whole, rest) = (tokens_old_units / p_old, tokens_old_units % p_old);
    let tokens_new_units = whole
        .saturating_mul(p_new)
        .saturating_add(rest * p_new / p_old)
        .min(new.capacity_units());
    let deficit_new = new.capacity_units() - tokens_new_units;
    (deficit_new > 0).then(|| BucketState::from_tat(scaled(now, new) + deficit_new, new))
}

#[inline]
pub(crate) fn check_cost(limit: &Limit, cost: u64) -> Result<(), Error> {
    if cost == 0 || cost > limit.capacity() {
        return Err(Error::InvalidCost {
            cost,
            capacity: limit.capacity(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Rate;
    use std::time::Duration;

    const SEC: u64 = 1_000_000_000;

    fn limit(capacity: u64, rate: &str) -> Limit {
        let rate: Rate = rate.parse().unwrap();
        Limit::new(capacity, rate).unwrap()
    }

    fn at(nanos: u64) -> Timestamp {
        Timestamp::from_nanos(nanos)
    }

    /// Runs `take` and returns (allowed, remaining) while threading the state.
    fn step(l: &Limit, state: &mut Option<BucketState>, now: u64, cost: u64) -> (bool, u64) {
        let (decision, next) = take(l, *state, at(now), cost).unwrap();
        if let Some(next) = next {
            *state = Some(next);
        }
        (decision.allowed(), decision.remaining())
    }

    #[test]
    fn new_bucket_is_full() {
        let l = limit(5, "1/s");
        let decision = peek(&l, None, at(123), 1).unwrap();
        assert!(decision.allowed());
        assert_eq!(decision.remaining(), 4);
        assert_eq!(decision.reset_after(), Duration::from_secs(1));
    }

    #[test]
    fn drains_then_rejects_repeatedly_without_charging() {
        let l = limit(3, "1/s");
        let mut state = None;
        for left in [2, 1, 0] {
            assert_eq!(step(&l, &mut state, 0, 1), (true, left));
        }
        let before = state;
        for _ in 0..5 {
            let (decision, next) = take(&l, state, at(0), 1).unwrap();
            assert!(!decision.allowed());
            assert_eq!(next, None);
            assert_eq!(decision.retry_after(), Some(Duration::from_secs(1)));
        }
        assert_eq!(state, before);
    }

    #[test]
    fn refills_exactly_at_the_boundary() {
        let l = limit(1, "1/s");
        let mut state = None;
        assert!(step(&l, &mut state, 0, 1).0);
        assert!(!step(&l, &mut state, SEC - 1, 1).0);
        assert!(step(&l, &mut state, SEC, 1).0);
    }

    #[test]
    fn retry_after_is_exact_and_rounded_up() {
        // 3 tokens per second: one token every 333_333_333.33.. ns.
        let l = limit(3, "3/s");
        let mut state = None;
        for _ in 0..3 {
            assert!(step(&l, &mut state, 0, 1).0);
        }
        let (decision, _) = take(&l, state, at(0), 1).unwrap();
        assert_eq!(
            decision.retry_after(),
            Some(Duration::from_nanos(333_333_334))
        );
        assert!(!step(&l, &mut state, 333_333_333, 1).0);
        assert!(step(&l, &mut state, 333_333_334, 1).0);
        // Two thirds of a nanosecond's refill are left over: three tokens are 1 s - 2/3 ns
        // away, which rounds up to exactly one second.
        let (decision, _) = take(&l, state, at(333_333_334), 3).unwrap();
        assert!(!decision.allowed());
        assert_eq!(decision.retry_after(), Some(Duration::from_secs(1)));
        assert!(!step(&l, &mut state, 1_333_333_333, 3).0);
        assert!(step(&l, &mut state, 1_333_333_334, 3).0);
    }

    #[test]
    fn cost_equal_to_capacity_passes_only_when_full() {
        let l = limit(10, "10/s");
        let mut state = None;
        assert_eq!(step(&l, &mut state, 0, 10), (true, 0));
        assert!(!step(&l, &mut state, SEC - 1, 10).0);
        assert_eq!(step(&l, &mut state, SEC, 10), (true, 0));
    }

    #[test]
    fn zero_or_oversized_cost_is_an_error_and_changes_nothing() {
        let l = limit(10, "10/s");
        for cost in [0, 11, u64::MAX] {
            assert_eq!(
                take(&l, None, at(0), cost),
                Err(Error::InvalidCost { cost, capacity: 10 })
            );
        }
    }

    #[test]
    fn no_time_advance_no_refill() {
        let l = limit(2, "1/ns");
        let mut state = None;
        assert!(step(&l, &mut state, 7, 2).0);
        for _ in 0..100 {
            assert!(!step(&l, &mut state, 7, 1).0);
        }
        assert!(step(&l, &mut state, 8, 1).0);
    }

    #[test]
    fn clock_going_back_mints_nothing() {
        let l = limit(10, "1/s");
        let mut state = None;
        assert!(step(&l, &mut state, 100 * SEC, 10).0);
        let full_at = state.unwrap().full_at();
        // Far in the past: the bucket is no fuller than it was at 100 s.
        for now in [0, 50 * SEC, 100 * SEC - 1] {
            let (decision, next) = take(&l, state, at(now), 1).unwrap();
            assert!(!decision.allowed());
            assert_eq!(next, None);
            // Seen from before the charge the bucket is empty, not over-empty: the deficit is
            // clamped to the capacity, so the figures stay in range (no overflow).
            assert_eq!(decision.remaining(), 0);
            assert_eq!(decision.retry_after(), Some(Duration::from_secs(1)));
            assert_eq!(decision.reset_after(), Duration::from_secs(10));
            assert_eq!(balance(&l, state, at(now), 1).remaining(), 0);
        }
        assert_eq!(state.unwrap().full_at(), full_at);
        // Time resumes: exactly one token at 101 s.
        assert_eq!(step(&l, &mut state, 101 * SEC, 1), (true, 0));
    }

    #[test]
    fn idle_for_years_is_full_and_does_not_overflow() {
        let l = limit(1_000, "1/d");
        let mut state = None;
        assert!(step(&l, &mut state, 0, 1_000).0);
        let fifty_years = 50 * 365 * 86_400 * SEC;
        assert_eq!(step(&l, &mut state, fifty_years, 1), (true, 999));
        // Past 2^63 ns (292 years) time stops: no overflow, nothing minted.
        assert_eq!(step(&l, &mut state, u64::MAX - 1, 1_000), (true, 0));
        assert!(!step(&l, &mut state, u64::MAX, 1).0);
    }

    #[test]
    fn extreme_rates() {
        // A billion per second, one per nanosecond.
        let fast = limit(1_000_000_000, "1000000000/s");
        let mut state = None;
        assert!(step(&fast, &mut state, 0, 1_000_000_000).0);
        assert_eq!(step(&fast, &mut state, 1, 1), (true, 0));
        assert!(!step(&fast, &mut state, 1, 1).0);
        // A prime rate close to a billion: a = 999_999_937 units per ns.
        let odd = limit(1, "999999937/s");
        let mut state = None;
        assert!(step(&odd, &mut state, 0, 1).0);
        assert!(!step(&odd, &mut state, 1, 1).0);
        assert!(step(&odd, &mut state, 2, 1).0);
        // One a day.
        let slow = limit(1, "1/d");
        let mut state = None;
        assert!(step(&slow, &mut state, 0, 1).0);
        assert!(!step(&slow, &mut state, 86_400 * SEC - 1, 1).0);
        assert!(step(&slow, &mut state, 86_400 * SEC, 1).0);
    }

    #[test]
    fn full_bucket_refill_is_not_counted_twice() {
        let l = limit(2, "1/s");
        let mut state = None;
        // Full and idle for an hour: still only 2 tokens.
        assert!(step(&l, &mut state, 3_600 * SEC, 2).0);
        assert!(!step(&l, &mut state, 3_600 * SEC, 1).0);
    }

    #[test]
    fn state_is_full_exactly_when_idle_past_time_to_full() {
        let l = limit(4, "3/s");
        let (_, state) = take(&l, None, at(0), 4).unwrap();
        let state = state.unwrap();
        let full = state.full_at().as_nanos();
        assert_eq!(full, l.time_to_full().as_nanos() as u64);
        assert!(!state.is_full(at(full - 1)));
        assert!(state.is_full(at(full)));
        // One ns before full the bucket is short of capacity; at full_at a cost of 4 passes.
        assert!(!peek(&l, Some(state), at(full - 1), 4).unwrap().allowed());
        assert!(peek(&l, Some(state), at(full), 4).unwrap().allowed());
    }

    #[test]
    fn rebase_refills_under_old_then_clamps_to_new() {
        let old = limit(10, "1/s");
        let (_, state) = take(&old, None, at(0), 10).unwrap();
        // 4 s later there are 4 tokens under the old limit.
        let smaller = limit(3, "1/s");
        let rebased = rebase(&old, &smaller, state, at(4 * SEC));
        assert_eq!(rebased, None, "4 tokens clamp to a full bucket of 3");
        let larger = limit(100, "50/s");
        let rebased = rebase(&old, &larger, state, at(4 * SEC));
        let decision = peek(&larger, rebased, at(4 * SEC), 1).unwrap();
        assert_eq!(decision.remaining(), 3);
        assert!(!peek(&larger, rebased, at(4 * SEC), 5).unwrap().allowed());
        // Non-integer conversions round down to fewer tokens.
        let thirds = limit(10, "3/s");
        let rebased = rebase(&old, &thirds, state, at(4 * SEC));
        assert_eq!(
            peek(&thirds, rebased, at(4 * SEC), 1).unwrap().remaining(),
            3
        );
    }

    #[test]
    fn a_bucket_full_at_the_change_is_full_under_the_new_limit() {
        // Full and absent are the same bucket: a growing limit must not treat a full bucket
        // still in memory (not swept yet) differently from one already dropped.
        let old = limit(11, "2/s");
        let (_, state) = take(&old, None, at(0), 9).unwrap();
        let grown = limit(20, "1/s");
        assert_eq!(rebase(&old, &grown, state, at(5 * SEC)), None);
        assert_eq!(rebase(&old, &grown, None, at(5 * SEC)), None);
        // Half a second earlier it is one token short, and keeps its 10 of the 20 (9 left
        // after a take of 1).
        let rebased = rebase(&old, &grown, state, at(4 * SEC));
        assert_eq!(
            peek(&grown, rebased, at(4 * SEC), 1).unwrap().remaining(),
            9
        );
    }

    #[test]
    fn rebase_between_extreme_limits_does_not_overflow() {
        // The largest capacity at a prime rate near 2^32/s (p near 2^32 units per token) to
        // and from a small daily limit (p near 2^46): the balance times the new p passes 2^128.
        let rate = Rate::new(4_294_967_291, Duration::from_secs(1)).unwrap();
        let huge = Limit::new(u64::MAX, rate).unwrap();
        let daily = limit(1, "1/d");
        let (_, state) = take(&huge, None, at(0), 1).unwrap();
        assert_eq!(rebase(&huge, &daily, state, at(0)), None, "clamps to full");
        // A bucket u64::MAX - 1 tokens full into the largest daily limit: full again.
        let roomy = Limit::new(50_000, "1/d".parse().unwrap()).unwrap();
        assert_eq!(rebase(&huge, &roomy, state, at(0)), None);
        // And back, exactly: a daily bucket two tokens short carries 49,998 tokens over.
        let (_, state) = take(&roomy, None, at(0), 2).unwrap();
        let rebased = rebase(&roomy, &huge, state, at(0));
        assert_eq!(peek(&huge, rebased, at(0), 1).unwrap().remaining(), 49_997);
    }

    #[test]
    fn rebase_keeps_a_part_of_a_token() {
        // 4.5 tokens at 4.5 s under 1/s are 4.5 under 2/s, whose tokens are half as many
        // nanoseconds apart: the half token is converted, not dropped (nor rounded up), so
        // 5 tokens are there a quarter of a second later and not a nanosecond sooner.
        let old = limit(10, "1/s");
        let (_, state) = take(&old, None, at(0), 10).unwrap();
        let new = limit(20, "2/s");
        let change = 4 * SEC + SEC / 2;
        let rebased = rebase(&old, &new, state, at(change));
        assert!(peek(&new, rebased, at(change), 4).unwrap().allowed());
        assert!(!peek(&new, rebased, at(change), 5).unwrap().allowed());
        let five = change + SEC / 4;
        assert!(!peek(&new, rebased, at(five - 1), 5).unwrap().allowed());
        assert!(peek(&new, rebased, at(five), 5).unwrap().allowed());
    }

    #[test]
    fn rebase_to_or_from_a_window_keeps_the_whole_tokens_left() {
        let bucket = limit(10, "1/s");
        let window = Limit::fixed_window(6, Duration::from_secs(1)).unwrap();
        // Emptied at 0, the bucket holds 4 tokens at 4 s: the window admits 4 more in its
        // window from 4 s, not its whole limit, nor a figure read from a bucket's state.
        let (_, state) = take(&bucket, None, at(0), 10).unwrap();
        let rebased = rebase(&bucket, &window, state, at(4 * SEC));
        assert_eq!(
            peek(&window, rebased, at(4 * SEC), 1).unwrap().remaining(),
            3
        );
        assert!(!peek(&window, rebased, at(4 * SEC), 5).unwrap().allowed());
        // A window with 1 left becomes a bucket with 1 token.
        let (_, state) = take(&window, None, at(0), 5).unwrap();
        let rebased = rebase(&window, &bucket, state, at(0));
        assert_eq!(peek(&bucket, rebased, at(0), 1).unwrap().remaining(), 0);
        assert!(!peek(&bucket, rebased, at(0), 2).unwrap().allowed());
        // The same window with a higher limit keeps its count: 5 used of 8.
        let wider = Limit::fixed_window(8, Duration::from_secs(1)).unwrap();
        let rebased = rebase(&window, &wider, state, at(0));
        assert_eq!(peek(&wider, rebased, at(0), 1).unwrap().remaining(), 2);
        // A longer window starts from the tokens left, 1 at 1 s, for the whole of its window
        // of 0 to 3 s: the 1 s window's count, which ends at 2 s, is not carried over as such.
        let (_, state) = take(&window, None, at(SEC), 5).unwrap();
        let longer = Limit::fixed_window(6, Duration::from_secs(3)).unwrap();
        let rebased = rebase(&window, &longer, state, at(SEC));
        for now in [SEC, 5 * SEC / 2] {
            let one = peek(&longer, rebased, at(now), 1).unwrap();
            assert!(one.allowed() && one.remaining() == 0, "{one:?}");
            assert!(!peek(&longer, rebased, at(now), 2).unwrap().allowed());
        }
        assert_eq!(
            peek(&longer, rebased, at(3 * SEC), 1).unwrap().remaining(),
            5
        );
    }

    #[test]
    fn with_tokens_builds_the_named_balance() {
        let l = limit(10, "7/s");
        let state = BucketState::with_tokens(&l, 4, at(SEC));
        let decision = peek(&l, state, at(SEC), 4).unwrap();
        assert!(decision.allowed());
        assert_eq!(decision.remaining(), 0);
        assert!(!peek(&l, state, at(SEC), 5).unwrap().allowed());
        assert_eq!(BucketState::with_tokens(&l, 11, at(SEC)), None);
    }
}
