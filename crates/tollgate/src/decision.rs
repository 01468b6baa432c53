//! The answer to a check.
//!
//! A token bucket's `Decision` keeps the exact post-decision deficit rather than pre-computed
//! durations: the hot path then does no division, and each figure is derived exactly, rounded
//! the documented way, only when a caller asks for it. A window's figures come from counters
//! and window edges rather than from a deficit, so the window math works them out as it
//! decides. A denial (a policy's `deny`) has no bucket behind it at all: nothing left, and no
//! wait after which it would pass.

use std::time::Duration;

use crate::limit::Limit;

/// The outcome of taking `cost` tokens from one bucket.
///
/// ```
/// use tollgate::{Limit, ManualClock, RateLimiter};
///
/// let limiter = RateLimiter::new(Limit::new(2, "1/s".parse()?)?, ManualClock::new());
/// assert!(limiter.check("alice")?.allowed());
/// let second = limiter.check("alice")?;
/// assert_eq!(second.remaining(), 0);
/// let third = limiter.check("alice")?;
/// assert!(!third.allowed());
/// assert_eq!(third.retry_after(), Some(std::time::Duration::from_secs(1)));
/// # Ok::<(), tollgate::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    allowed: bool,
    limit: Limit,
    cost: u64,
    figures: Figures,
}

/// What a decision's figures are derived from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Figures {
    /// Units the bucket is short of full after this decision (see [`crate::bucket`]).
    Bucket { deficit: u128 },
    /// A window limit's figures, worked out as it decided.
    Window {
        remaining: u64,
        /// Nanoseconds until `cost` would pass; 0 when allowed.
        retry_after: u64,
        reset_after: u64,
    },
    /// Rejected whatever the balance: no bucket, no wait that would help.
    Denied,
}

impl Decision {
    #[inline]
    pub(crate) fn new(allowed: bool, limit: Limit, cost: u64, deficit: u128) -> Self {
        Self {
            allowed,
            limit,
            cost,
            figures: Figures::Bucket { deficit },
        }
    }

    /// A window limit's decision, worked out by the window math.
    pub(crate) fn window(
        allowed: bool,
        limit: Limit,
        cost: u64,
        remaining: u64,
        retry_after: u64,
        reset_after: u64,
    ) -> Self {
        Self {
            allowed,
            limit,
            cost,
            figures: Figures::Window {
                remaining,
                retry_after: if allowed { 0 } else { retry_after },
                reset_after,
            },
        }
    }

    /// A window limit's decision made elsewhere (by a remote store), from its figures:
    /// requests left in the window (clamped to the limit), the time until `cost` would pass
    /// (ignored when allowed) and the time until the window holds nothing.
    pub fn from_window(
        allowed: bool,
        limit: Limit,
        cost: u64,
        remaining: u64,
        retry_after: Duration,
        reset_after: Duration,
    ) -> Self {
        let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        Self::window(
            allowed,
            limit,
            cost,
            remaining.min(limit.capacity()),
            nanos(retry_after),
            nanos(reset_after),
        )
    }

    /// A rejection that no wait would turn into an admission: a block list entry, Envoy's
    /// `requests_per_unit: 0`. It reads as an empty limit of capacity 0 (`remaining` and
    /// [`capacity`](Self::capacity) 0), with no [`retry_after`](Self::retry_after) and a zero
    /// [`reset_after`](Self::reset_after). `limit` is kept for [`limit`](Self::limit) only.
    ///
    /// ```
    /// use tollgate::{Decision, Limit};
    ///
    /// let denied = Decision::denied(Limit::new(10, "10/s".parse()?)?, 1);
    /// assert!(!denied.allowed() && denied.is_denied());
    /// assert_eq!((denied.remaining(), denied.capacity()), (0, 0));
    /// assert_eq!(denied.retry_after(), None);
    /// # Ok::<(), tollgate::Error>(())
    /// ```
    pub fn denied(limit: Limit, cost: u64) -> Self {
        Self {
            allowed: false,
            limit,
            cost,
            figures: Figures::Denied,
        }
    }

    /// Whether this is a denial ([`Decision::denied`]): rejected whatever the balance, so
    /// waiting does not help.
    pub fn is_denied(&self) -> bool {
        matches!(self.figures, Figures::Denied)
    }

    /// The most the limit that decided admits at once: its capacity (for a window, its limit
    /// per window), 0 for a denial.
    pub fn capacity(&self) -> u64 {
        match self.figures {
            Figures::Denied => 0,
            _ => self.limit.capacity(),
        }
    }

    /// A decision made elsewhere (by a remote store), from the bucket's deficit after it: how
    /// many units short of full the bucket is, in `limit`'s units
    /// ([`Limit::units_per_token`]). A deficit above the capacity is clamped to it.
    ///
    /// For token buckets; a window's decision is made with [`Decision::from_window`].
    pub fn from_deficit(allowed: bool, limit: Limit, cost: u64, deficit: u128) -> Self {
        let deficit = deficit.min(limit.capacity_units());
        Self::new(allowed, limit, cost, deficit)
    }

    /// This decision as it would read `elapsed` later if nothing were charged in between: a
    /// token bucket's deficit shrinks by the refill, a window's waits by `elapsed` (its
    /// `remaining` is kept: a window frees nothing before its edge, and a sliding one's weight
    /// is not worked out again here). For a process that remembers a rejection and answers
    /// the same request from memory until its `retry_after` passes; others' charges only make
    /// the real figures later, never earlier.
    #[must_use]
    pub fn aged(&self, elapsed: Duration) -> Self {
        let nanos = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        let figures = match self.figures {
            Figures::Bucket { deficit } => Figures::Bucket {
                deficit: deficit.saturating_sub(u128::from(nanos) * u128::from(self.limit.a())),
            },
            Figures::Window {
                remaining,
                retry_after,
                reset_after,
            } => Figures::Window {
                remaining,
                retry_after: retry_after.saturating_sub(nanos),
                reset_after: reset_after.saturating_sub(nanos),
            },
            Figures::Denied => Figures::Denied,
        };
        Self { figures, ..*self }
    }

    /// Whether the tokens were taken.
    pub fn allowed(&self) -> bool {
        self.allowed
    }

    /// The limit that decided (for a denial, the limit it was asked under, which did not
    /// decide: see [`Decision::denied`]).
    pub fn limit(&self) -> &Limit {
        &self.limit
    }

    /// The cost that was asked for.
    pub fn cost(&self) -> u64 {
        self.cost
    }

    /// Whole tokens left after this decision, rounded down (for a window: requests the
    /// window still admits).
    pub fn remaining(&self) -> u64 {
        match self.figures {
            Figures::Bucket { deficit } => {
                let units = self.limit.capacity_units() - deficit;
                // At most the capacity, which is a u64.
                (units / u128::from(self.limit.p())) as u64
            }
            Figures::Window { remaining, .. } => remaining,
            Figures::Denied => 0,
        }
    }

    /// When rejected: the exact time until `cost` tokens are available, rounded up to the
    /// nanosecond, so a caller that waits this long is allowed. `None` when allowed, and for a
    /// denial, which no wait lifts.
    pub fn retry_after(&self) -> Option<Duration> {
        if self.allowed {
            return None;
        }
        match self.figures {
            Figures::Bucket { deficit } => {
                let needed = deficit + u128::from(self.cost) * u128::from(self.limit.p());
                let shortfall = needed - self.limit.capacity_units();
                Some(Duration::from_nanos(
                    self.limit.units_to_nanos_ceil(shortfall),
                ))
            }
            Figures::Window { retry_after, .. } => Some(Duration::from_nanos(retry_after)),
            Figures::Denied => None,
        }
    }

    /// The time until the bucket is full again, rounded up to the nanosecond (for a window:
    /// until it counts nothing).
    pub fn reset_after(&self) -> Duration {
        match self.figures {
            Figures::Bucket { deficit } => {
                Duration::from_nanos(self.limit.units_to_nanos_ceil(deficit))
            }
            Figures::Window { reset_after, .. } => Duration::from_nanos(reset_after),
            Figures::Denied => Duration::ZERO,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Timestamp, bucket, window};

    #[test]
    fn an_aged_rejection_reads_as_the_bucket_would_then() {
        // 10/s has one unit per nanosecond; 3/7ns three (see `crate::bucket`), and 4 tokens
        // take 9 1/3 ns to refill, a retry of 10 rounded up.
        for (rate, retry, elapsed) in [("10/s", 400_000_000, 150_000_000), ("3/7ns", 10, 5)] {
            let limit = Limit::new(10, rate.parse().unwrap()).unwrap();
            let (_, state) = bucket::take(&limit, None, Timestamp::ZERO, 10).unwrap();
            let (rejected, _) = bucket::take(&limit, state, Timestamp::ZERO, 4).unwrap();
            assert_eq!((rejected.allowed(), rejected.cost()), (false, 4));
            assert_eq!(rejected.retry_after(), Some(Duration::from_nanos(retry)));
            let later = Timestamp::from_nanos(elapsed);
            let (then, _) = bucket::take(&limit, state, later, 4).unwrap();
            assert_eq!(rejected.aged(Duration::from_nanos(elapsed)), then, "{rate}");
            assert_eq!(
                rejected.aged(Duration::from_secs(5)).reset_after(),
                Duration::ZERO
            );
        }
    }

    #[test]
    fn an_aged_window_rejection_waits_less() {
        let limit = Limit::fixed_window(2, Duration::from_secs(1)).unwrap();
        let (_, state) = window::take(&limit, None, Timestamp::ZERO, 2);
        let (rejected, _) = window::take(&limit, state, Timestamp::ZERO, 1);
        let aged = rejected.aged(Duration::from_millis(300));
        assert_eq!(aged.retry_after(), Some(Duration::from_millis(700)));
        assert_eq!(aged.reset_after(), Duration::from_millis(700));
        assert_eq!(aged.remaining(), 0);
        assert!(!aged.allowed());
    }
}
