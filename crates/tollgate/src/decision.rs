//! The answer to a check.
//!
//! A `Decision` keeps the exact post-decision deficit rather than pre-computed durations: the
//! hot path then does no division, and each figure is derived exactly, rounded the documented
//! way, only when a caller asks for it.

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
    /// Units the bucket is short of full after this decision (see [`crate::bucket`]).
    deficit: u128,
}

impl Decision {
    pub(crate) fn new(allowed: bool, limit: Limit, cost: u64, deficit: u128) -> Self {
        Self {
            allowed,
            limit,
            cost,
            deficit,
        }
    }

    /// A decision made elsewhere (by a remote store), from the bucket's deficit after it: how
    /// many units short of full the bucket is, in `limit`'s units
    /// ([`Limit::units_per_token`]). A deficit above the capacity is clamped to it.
    pub fn from_deficit(allowed: bool, limit: Limit, cost: u64, deficit: u128) -> Self {
        let deficit = deficit.min(limit.capacity_units());
        Self::new(allowed, limit, cost, deficit)
    }

    /// Whether the tokens were taken.
    pub fn allowed(&self) -> bool {
        self.allowed
    }

    /// The limit that decided.
    pub fn limit(&self) -> &Limit {
        &self.limit
    }

    /// The cost that was asked for.
    pub fn cost(&self) -> u64 {
        self.cost
    }

    /// Whole tokens left after this decision, rounded down.
    pub fn remaining(&self) -> u64 {
        let units = self.limit.capacity_units() - self.deficit;
        // At most the capacity, which is a u64.
        (units / u128::from(self.limit.p())) as u64
    }

    /// When rejected: the exact time until `cost` tokens are available, rounded up to the
    /// nanosecond, so a caller that waits this long is allowed. `None` when allowed.
    pub fn retry_after(&self) -> Option<Duration> {
        if self.allowed {
            return None;
        }
        let needed = self.deficit + u128::from(self.cost) * u128::from(self.limit.p());
        let shortfall = needed - self.limit.capacity_units();
        Some(Duration::from_nanos(
            self.limit.units_to_nanos_ceil(shortfall),
        ))
    }

    /// The time until the bucket is full again, rounded up to the nanosecond.
    pub fn reset_after(&self) -> Duration {
        Duration::from_nanos(self.limit.units_to_nanos_ceil(self.deficit))
    }
}
