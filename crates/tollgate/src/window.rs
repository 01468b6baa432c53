//! Fixed and sliding windows: the other algorithms of SPEC §3, decided through the same
//! [`Decision`] and kept in the same [`BucketState`] as a token bucket, so that every store
//! holds them without knowing which algorithm a bucket follows.
//!
//! # Model
//!
//! A window limit admits at most `N` (its capacity) per window of `W` milliseconds. Windows are
//! aligned on the clock's timeline: window `k` covers `[k*W, (k+1)*W)` milliseconds, and a
//! request at `now` falls in window `j = floor(now_ms / W)` (time is read to the millisecond,
//! which keeps the Redis scripts' doubles exact; see [`Limit::sliding_window`]).
//!
//! * **Fixed window**: a count `c` of what window `k` admitted. A request of `cost` passes when
//!   `c + cost <= N` in its own window (a later window starts from 0). Up to `2N` can pass
//!   around a window's edge.
//! * **Sliding window** (the counter approximation): the counts `cur` of window `k` and `prev`
//!   of window `k - 1`. At `e` milliseconds into window `j`, the previous window still weighs
//!   `(W - e) / W` of its count, and a request passes when
//!   `prev * (W - e) + (cur + cost) * W <= N * W`: integers, compared exactly.
//!
//! # Representation
//!
//! The state is the instant the bucket counts nothing again, so that a store expires it
//! without knowing its limit (`full_at <= now`), with the current count in the nanoseconds
//! past it:
//!
//! * fixed: `full_at = (k + 1) * W_ns + c`, `frac = 0`;
//! * sliding: `full_at = (k + 2) * W_ns + cur`, `frac = prev`.
//!
//! A count is below the window in nanoseconds (a limit is refused otherwise), so it can be
//! read back as `full_at mod W_ns`. The state thus reads as full a few nanoseconds after the
//! window frees it: kept a little longer, never dropped early.
//!
//! # Invariants
//!
//! Checked against a reference model with exact rationals (`tests/window_model.rs`):
//!
//! * A rejection charges nothing; an absent state is an empty window.
//! * A `now` earlier than the window of the state is decided in that window, from its start
//!   (the previous window weighing fully): going back in time frees nothing.
//! * A fixed window admits at most `N` per window; a sliding window's weighted count never
//!   passes `N`.
//! * `retry_after` is exact: waiting it, the same request passes; a moment less, it does not.

use std::time::Duration;

use crate::bucket::BucketState;
use crate::clock::Timestamp;
use crate::decision::Decision;
use crate::limit::{Algorithm, Limit};

const NANOS_PER_MS: u64 = 1_000_000;

/// The latest instant the window math distinguishes, as for token buckets.
const MAX_NOW: u64 = 1 << 63;

/// Where a request falls: its window, the milliseconds into it, and its own nanosecond.
struct At {
    now: u64,
    window: u64,
    elapsed_ms: u64,
}

/// The counts a state holds for the window `at` falls in: (window, prev, cur). A state for a
/// later window than `at` (time went back) moves the request to that window's start.
fn counts(limit: &Limit, state: Option<BucketState>, now: Timestamp) -> (At, u64, u64) {
    let w_ns = limit.window_ns();
    let w_ms = w_ns / NANOS_PER_MS;
    let now = now.as_nanos().min(MAX_NOW);
    let j = now / NANOS_PER_MS / w_ms;
    let Some(state) = state else {
        let elapsed_ms = now / NANOS_PER_MS - j * w_ms;
        return (
            At {
                now,
                window: j,
                elapsed_ms,
            },
            0,
            0,
        );
    };
    let full_at = state.full_at().as_nanos();
    let cur = full_at % w_ns;
    let ends = (full_at - cur) / w_ns;
    let (k, prev) = match limit.algorithm() {
        Algorithm::SlidingWindow => (ends.saturating_sub(2), u64::from(state.frac())),
        _ => (ends.saturating_sub(1), 0),
    };
    let (window, elapsed_ms) = if k > j {
        (k, 0)
    } else {
        (j, now / NANOS_PER_MS - j * w_ms)
    };
    let at = At {
        now,
        window,
        elapsed_ms,
    };
    let (prev, cur) = match window - k {
        0 => (prev, cur),
        1 if limit.algorithm() == Algorithm::SlidingWindow => (cur, 0),
        _ => (0, 0),
    };
    (at, prev, cur)
}

/// Nanoseconds from `now` to the start of window `window + ahead`, plus `ms` into it.
fn until(limit: &Limit, at: &At, ahead: u64, ms: u64) -> u64 {
    let start = (at.window + ahead) * limit.window_ns() + ms * NANOS_PER_MS;
    start.saturating_sub(at.now)
}

/// Takes `cost` (already checked to be in `1..=N`) from a window limit; as
/// [`crate::bucket::take`].
///
/// Never inlined: in the token bucket's `take`, this body made it too large to inline into
/// the stores' check paths, which then cost a quarter more instructions per token-bucket check.
#[inline(never)]
pub(crate) fn take(
    limit: &Limit,
    state: Option<BucketState>,
    now: Timestamp,
    cost: u64,
) -> (Decision, Option<BucketState>) {
    let (at, prev, cur) = counts(limit, state, now);
    let w = limit.window_ns() / NANOS_PER_MS;
    // A fixed window has no previous count, so this is `cur + cost <= N` for it.
    if weighted(&at, w, prev, cur + cost) <= u128::from(limit.capacity()) * u128::from(w) {
        let (remaining, reset) = standing(limit, &at, prev, cur + cost);
        let frac = match limit.algorithm() {
            Algorithm::SlidingWindow => u32::try_from(prev).unwrap_or(u32::MAX),
            _ => 0,
        };
        let state = BucketState::from_parts(free_at(limit, &at) + cur + cost, frac);
        let decision = Decision::window(true, *limit, cost, remaining, 0, reset);
        return (decision, Some(state));
    }
    let (remaining, reset) = standing(limit, &at, prev, cur);
    let retry = match limit.algorithm() {
        Algorithm::SlidingWindow => sliding_retry(limit, &at, prev, cur, cost),
        // cost <= N, so the next window admits it.
        _ => until(limit, &at, 1, 0),
    };
    let decision = Decision::window(false, *limit, cost, remaining, retry, reset);
    (decision, None)
}

/// The counts weighed as a sliding window weighs them, times `w` (the window in ms) so that
/// they are integers: `prev * (W - e) + cur * W`.
fn weighted(at: &At, w: u64, prev: u64, cur: u64) -> u128 {
    u128::from(prev) * u128::from(w - at.elapsed_ms) + u128::from(cur) * u128::from(w)
}

/// What a window holding `prev` and `cur` at `at` still admits, and the nanoseconds until it
/// counts nothing: the end of this window once the previous one weighs nothing more, the end
/// of the next while this one has a count.
fn standing(limit: &Limit, at: &At, prev: u64, cur: u64) -> (u64, u64) {
    let w = limit.window_ns() / NANOS_PER_MS;
    let room = u128::from(limit.capacity()) * u128::from(w);
    // At most the limit, a u64.
    let remaining = (room.saturating_sub(weighted(at, w, prev, cur)) / u128::from(w)) as u64;
    let reset = match (limit.algorithm(), prev, cur) {
        (Algorithm::SlidingWindow, _, 1..) => until(limit, at, 2, 0),
        (_, 0, 0) => 0,
        _ => until(limit, at, 1, 0),
    };
    (remaining, reset)
}

/// The instant a state written in `at`'s window reads as full, before its count is added: the
/// end of the window (fixed) or of the next (sliding).
fn free_at(limit: &Limit, at: &At) -> u64 {
    let ends = match limit.algorithm() {
        Algorithm::SlidingWindow => at.window + 2,
        _ => at.window + 1,
    };
    ends * limit.window_ns()
}

/// The wait until a sliding window admits `cost`: the first millisecond at which the previous
/// window's weight has fallen enough, in this window or, failing that, in the next (where this
/// window's count is the previous one). `cost <= N`, so the next window's end always admits it.
fn sliding_retry(limit: &Limit, at: &At, prev: u64, cur: u64, cost: u64) -> u64 {
    let n = u128::from(limit.capacity());
    let w = u128::from(limit.window_ns() / NANOS_PER_MS);
    // In this window: prev * (W - e) <= (N - cur - cost) * W.
    let left = n.checked_sub(u128::from(cur) + u128::from(cost));
    if let (Some(left), true) = (left, prev > 0) {
        let e = w - (left * w / u128::from(prev)).min(w);
        if e < w {
            return until(limit, at, 0, e as u64);
        }
    }
    // In the next: cur * (W - e) <= (N - cost) * W.
    let e = if cur == 0 {
        0
    } else {
        w - ((n - u128::from(cost)) * w / u128::from(cur)).min(w)
    };
    until(limit, at, 1, e as u64)
}

/// The window's standing at `now` as an allowed but uncharged decision for `cost`; as
/// [`crate::bucket::balance`]. Never inlined, as [`take`].
#[inline(never)]
pub(crate) fn balance(
    limit: &Limit,
    state: Option<BucketState>,
    now: Timestamp,
    cost: u64,
) -> Decision {
    let (at, prev, cur) = counts(limit, state, now);
    let (remaining, reset) = standing(limit, &at, prev, cur);
    Decision::window(true, *limit, cost, remaining, 0, reset)
}

/// The state of a window limit that has `tokens` left at `now`: the rest of the limit counted
/// as used in the current window (as the current window's count of a sliding one). `None` when
/// nothing is used.
pub(crate) fn with_tokens(limit: &Limit, tokens: u64, now: Timestamp) -> Option<BucketState> {
    let used = limit.capacity().saturating_sub(tokens);
    if used == 0 {
        return None;
    }
    let (at, _, _) = counts(limit, None, now);
    Some(BucketState::from_parts(free_at(limit, &at) + used, 0))
}

/// The window a charge at `charged_at` went to, from its decision's `reset_after`: a charged
/// window counts something, so it resets at the end of its window (fixed) or of the next
/// (sliding). Not simply the window `charged_at` falls in: a clock gone back charges the later
/// window its state was in.
pub(crate) fn charged_window(limit: &Limit, charged_at: Timestamp, reset_after: Duration) -> u64 {
    let w_ns = limit.window_ns();
    let reset = u64::try_from(reset_after.as_nanos()).unwrap_or(u64::MAX);
    let ends = charged_at.as_nanos().min(MAX_NOW).saturating_add(reset) / w_ns;
    match limit.algorithm() {
        Algorithm::SlidingWindow => ends.saturating_sub(2),
        _ => ends.saturating_sub(1),
    }
}

/// Gives `tokens` back from the latest count that holds anything, never below 0: the current
/// count, else a sliding window's previous one; for tokens given back with no record of the
/// charge they came from (see [`crate::bucket::give_back_latest`]). A count a refund emptied
/// is passed over, so the state a cross-slot charge and refund left (an empty later window)
/// gives back as the state of a store never charged does.
pub(crate) fn give_back_latest(limit: &Limit, state: BucketState, tokens: u64) -> BucketState {
    let k = held_window(limit, state);
    let cur = state.full_at().as_nanos() % limit.window_ns();
    let charged = if cur == 0 && limit.algorithm() == Algorithm::SlidingWindow {
        k.checked_sub(1)
    } else {
        Some(k)
    };
    charged
        .and_then(|charged| give_back(limit, state, charged, tokens))
        .unwrap_or(state)
}

/// The window a state counts in (its current count's): the latest window anything was charged
/// to.
fn held_window(limit: &Limit, state: BucketState) -> u64 {
    let w_ns = limit.window_ns();
    let ends = state.full_at().as_nanos() / w_ns;
    match limit.algorithm() {
        Algorithm::SlidingWindow => ends.saturating_sub(2),
        _ => ends.saturating_sub(1),
    }
}

/// Gives `tokens` back to a window state for a charge that went to window `charged`: from the
/// current count while the state is still in the charged window, from a sliding window's previous count
/// once it has moved on by one, never below 0; otherwise the state is returned as it was (the
/// window has passed, and what it admitted no longer counts against anyone). The state keeps
/// its window, so a request timed before the refund (a clock gone back) is still counted there.
pub(crate) fn give_back(
    limit: &Limit,
    state: BucketState,
    charged: u64,
    tokens: u64,
) -> Option<BucketState> {
    let w_ns = limit.window_ns();
    let full_at = state.full_at().as_nanos();
    let cur = full_at % w_ns;
    let sliding = limit.algorithm() == Algorithm::SlidingWindow;
    let k = held_window(limit, state);
    let prev = u64::from(state.frac());
    if k == charged {
        let left = cur - cur.min(tokens);
        Some(BucketState::from_parts(full_at - cur + left, state.frac()))
    } else if sliding && k == charged + 1 {
        let prev = prev - prev.min(tokens);
        Some(BucketState::from_parts(
            full_at,
            u32::try_from(prev).unwrap_or(u32::MAX),
        ))
    } else {
        Some(state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const MS: u64 = NANOS_PER_MS;
    const SEC: u64 = 1_000 * MS;

    fn at(nanos: u64) -> Timestamp {
        Timestamp::from_nanos(nanos)
    }

    fn fixed(n: u64, window: Duration) -> Limit {
        Limit::fixed_window(n, window).unwrap()
    }

    fn sliding(n: u64, window: Duration) -> Limit {
        Limit::sliding_window(n, window).unwrap()
    }

    /// Runs `costs` at `times` through `limit` from an empty state; the decisions.
    fn run(limit: &Limit, steps: &[(u64, u64)]) -> Vec<Decision> {
        let mut state = None;
        steps
            .iter()
            .map(|&(t, cost)| {
                let (decision, next) = take(limit, state, at(t), cost);
                if next.is_some() {
                    state = next;
                }
                decision
            })
            .collect()
    }

    #[test]
    fn a_fixed_window_admits_its_limit_and_forgets_at_the_edge() {
        let limit = fixed(3, Duration::from_secs(1));
        let d = run(
            &limit,
            &[(100 * MS, 1), (200 * MS, 2), (300 * MS, 1), (SEC, 3)],
        );
        assert!(d[0].allowed() && d[1].allowed());
        assert_eq!(d[1].remaining(), 0);
        assert_eq!(d[1].reset_after(), Duration::from_millis(800));
        assert!(!d[2].allowed());
        assert_eq!(d[2].retry_after(), Some(Duration::from_millis(700)));
        assert_eq!(d[2].reset_after(), Duration::from_millis(700));
        // The next window starts afresh: the double burst at the edge is the algorithm's own.
        assert!(d[3].allowed());
        assert_eq!(d[3].remaining(), 0);
    }

    #[test]
    fn a_fixed_windows_retry_is_exact_to_the_nanosecond() {
        let limit = fixed(1, Duration::from_millis(10));
        let d = run(&limit, &[(3, 1), (9_999_999, 1), (10_000_000, 1)]);
        assert_eq!(d[1].retry_after(), Some(Duration::from_nanos(1)));
        assert!(d[2].allowed());
    }

    #[test]
    fn a_sliding_window_weighs_the_previous_one() {
        let limit = sliding(10, Duration::from_secs(1));
        // 10 in window 0; at 1.25 s the previous window weighs 3/4: 7.5 used, 2 left.
        let d = run(&limit, &[(500 * MS, 10), (1_250 * MS, 3), (1_250 * MS, 2)]);
        assert!(d[0].allowed());
        assert!(!d[1].allowed());
        assert_eq!(d[1].remaining(), 2);
        // 3 more pass once 10 * (W - e) <= (10 - 0 - 3) * W: e >= 300 ms.
        assert_eq!(d[1].retry_after(), Some(Duration::from_millis(50)));
        assert!(d[2].allowed());
        assert_eq!(d[2].remaining(), 0);
        assert_eq!(d[2].reset_after(), Duration::from_millis(1_750));
    }

    #[test]
    fn a_sliding_windows_retry_can_fall_in_the_next_window() {
        let limit = sliding(4, Duration::from_secs(1));
        // 4 in window 0 still weigh 4/1000 at 1.999 s: nothing passes before window 2.
        let d = run(&limit, &[(0, 4), (SEC + 999 * MS, 4)]);
        assert!(!d[1].allowed());
        assert_eq!(d[1].retry_after(), Some(Duration::from_millis(1)));
        let d = run(&limit, &[(500 * MS, 4), (1_900 * MS, 2), (1_900 * MS, 2)]);
        // At 1.9 s window 0 weighs 4 * 0.1 = 0.4: 2 pass, then 2.4 + 2 > 4.
        assert!(d[1].allowed());
        assert!(!d[2].allowed());
        // In window 2, the 2 of window 1 weigh 2 * (W - e) / W: 2 more pass at once.
        assert_eq!(d[2].retry_after(), Some(Duration::from_millis(100)));
    }

    #[test]
    fn time_going_back_frees_nothing() {
        for limit in [
            fixed(2, Duration::from_secs(1)),
            sliding(2, Duration::from_secs(1)),
        ] {
            let d = run(&limit, &[(1_500 * MS, 2), (500 * MS, 1), (1_999 * MS, 1)]);
            assert!(d[0].allowed());
            assert!(!d[1].allowed(), "{limit}: an earlier window reopened");
            assert!(!d[2].allowed(), "{limit}");
            assert!(d[1].retry_after() > d[2].retry_after());
        }
    }

    #[test]
    fn states_read_as_full_once_the_window_frees_them() {
        let limit = fixed(5, Duration::from_secs(1));
        let (_, state) = take(&limit, None, at(200 * MS), 3);
        let state = state.unwrap();
        assert!(!state.is_full(at(SEC - 1)));
        assert!(state.is_full(at(SEC + 3)));
        let limit = sliding(5, Duration::from_secs(1));
        let (_, state) = take(&limit, None, at(200 * MS), 3);
        let state = state.unwrap();
        assert!(!state.is_full(at(2 * SEC - 1)));
        assert!(state.is_full(at(2 * SEC + 3)));
        let (d, _) = take(&limit, Some(state), at(2 * SEC), 5);
        assert!(d.allowed());
    }

    #[test]
    fn a_count_of_most_of_the_windows_nanoseconds_reads_back() {
        // The largest limit a 1 ms window takes: a count past half the window's nanoseconds,
        // kept past the window's end, still reads as this window's and frees at its edge.
        for limit in [
            fixed(999_999, Duration::from_millis(1)),
            sliding(999_999, Duration::from_millis(1)),
        ] {
            let d = run(&limit, &[(0, 600_000), (MS / 2, 1), (2 * MS, 1)]);
            assert!(d[0].allowed() && d[1].allowed(), "{limit}");
            assert_eq!(d[1].remaining(), 399_998, "{limit}");
            assert_eq!(d[2].remaining(), 999_998, "{limit}");
        }
        let limit = fixed(999_999, Duration::from_millis(1));
        let d = run(&limit, &[(0, 600_000), (MS / 2, 1), (MS, 1)]);
        assert_eq!(d[1].reset_after(), Duration::from_nanos(MS / 2));
        assert_eq!(d[2].remaining(), 999_998);
        // And a refund finds that count in its window.
        let (d, state) = take(&limit, None, at(0), 600_000);
        let charged = charged_window(&limit, at(0), d.reset_after());
        let refunded = give_back(&limit, state.unwrap(), charged, 100_000);
        assert_eq!(balance(&limit, refunded, at(0), 1).remaining(), 499_999);
    }

    #[test]
    fn a_window_that_counts_nothing_has_nothing_to_reset() {
        for limit in [
            fixed(5, Duration::from_secs(1)),
            sliding(5, Duration::from_secs(1)),
        ] {
            let empty = balance(&limit, None, at(SEC / 2), 1);
            assert_eq!(empty.remaining(), 5, "{limit}");
            assert_eq!(empty.reset_after(), Duration::ZERO, "{limit}");
        }
        // A sliding window whose previous window counted something is not empty until this
        // window ends, though this one has counted nothing yet.
        let limit = sliding(5, Duration::from_secs(1));
        let (_, state) = take(&limit, None, at(SEC / 2), 2);
        let later = balance(&limit, state, at(SEC + SEC / 4), 1);
        assert_eq!(later.reset_after(), Duration::from_millis(750));
    }

    #[test]
    fn a_refund_goes_back_to_the_window_charged() {
        let charge_at = at(2 * SEC + SEC / 2);
        let (fixed, sliding) = (
            fixed(5, Duration::from_secs(1)),
            sliding(5, Duration::from_secs(1)),
        );
        // 3 charged in window 2, 2 given back while the state is still there.
        for limit in [fixed, sliding] {
            let (d, state) = take(&limit, None, charge_at, 3);
            assert_eq!(
                charged_window(&limit, charge_at, d.reset_after()),
                2,
                "{limit}"
            );
            let refunded = give_back(&limit, state.unwrap(), 2, 2);
            assert_eq!(
                balance(&limit, refunded, charge_at, 1).remaining(),
                4,
                "{limit}"
            );
        }
        // Fixed: nothing given back once window 3 counts.
        let now = at(3 * SEC + SEC / 5);
        let (_, state) = take(&fixed, None, charge_at, 3);
        let (_, later) = take(&fixed, state, now, 1);
        let later = later.unwrap();
        assert_eq!(give_back(&fixed, later, 2, 2), Some(later));
        // Sliding: then from the previous count, 3 * 0.8 + 1 counted becoming 2 * 0.8 + 1.
        let (_, state) = take(&sliding, None, charge_at, 3);
        let (_, later) = take(&sliding, state, now, 1);
        assert_eq!(balance(&sliding, later, now, 1).remaining(), 1);
        let refunded = give_back(&sliding, later.unwrap(), 2, 1);
        assert_eq!(balance(&sliding, refunded, now, 1).remaining(), 2);
        // Two windows on, window 2's count weighs nothing, and window 3's is not the refund's.
        let (_, moved) = take(&sliding, later, at(4 * SEC + SEC / 5), 1);
        let moved = moved.unwrap();
        assert_eq!(give_back(&sliding, moved, 2, 1), Some(moved));
    }

    #[test]
    fn with_tokens_counts_the_rest_as_used() {
        let limit = fixed(5, Duration::from_secs(1));
        let state = with_tokens(&limit, 2, at(SEC / 2));
        assert_eq!(balance(&limit, state, at(SEC / 2), 1).remaining(), 2);
        assert_eq!(with_tokens(&limit, 9, at(0)), None);
    }
}
