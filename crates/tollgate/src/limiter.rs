//! One limit, one clock, many keys: the in-process entry point most callers want.

use std::borrow::Borrow;
use std::hash::{BuildHasher, Hash};

use crate::clock::{Clock, MonotonicClock};
use crate::decision::Decision;
use crate::error::Error;
use crate::limit::Limit;
use crate::memory::{DefaultHashBuilder, MemoryStore};

/// A keyed rate limiter: every key gets its own bucket with the same [`Limit`].
///
/// Cheap to share: wrap it in an `Arc` and check from any number of threads.
///
/// ```
/// use tollgate::{Limit, RateLimiter};
///
/// let limiter = RateLimiter::with_limit(Limit::new(10, "5/s".parse()?)?);
/// let decision = limiter.check_n("user-42", 3)?;
/// assert!(decision.allowed());
/// assert_eq!(decision.remaining(), 7);
/// # Ok::<(), tollgate::Error>(())
/// ```
pub struct RateLimiter<K = Box<str>, C = MonotonicClock, S = DefaultHashBuilder> {
    store: MemoryStore<K, S>,
    limit: Limit,
    clock: C,
}

impl RateLimiter {
    /// A limiter keyed by strings, on the monotonic clock, with a default [`MemoryStore`].
    pub fn with_limit(limit: Limit) -> Self {
        Self::new(limit, MonotonicClock::new())
    }
}

impl<C> RateLimiter<Box<str>, C> {
    /// A limiter keyed by strings, reading `clock`, with a default [`MemoryStore`].
    pub fn new(limit: Limit, clock: C) -> Self {
        Self::keyed(limit, clock)
    }
}

impl<K, C> RateLimiter<K, C> {
    /// A limiter keyed by any `K`, reading `clock`, with a default [`MemoryStore`].
    ///
    /// ```
    /// use tollgate::{Limit, MonotonicClock, RateLimiter};
    ///
    /// let limiter = RateLimiter::<u64, _>::keyed(Limit::new(1, "1/s".parse()?)?, MonotonicClock::new());
    /// assert!(limiter.check(&7)?.allowed());
    /// # Ok::<(), tollgate::Error>(())
    /// ```
    pub fn keyed(limit: Limit, clock: C) -> Self {
        Self::from_parts(limit, clock, MemoryStore::default())
    }
}

impl<K, C, S> RateLimiter<K, C, S> {
    /// A limiter over a store built to measure (see [`MemoryStore::builder`]).
    pub fn from_parts(limit: Limit, clock: C, store: MemoryStore<K, S>) -> Self {
        Self {
            store,
            limit,
            clock,
        }
    }

    /// The limit every key gets.
    pub fn limit(&self) -> &Limit {
        &self.limit
    }

    /// The underlying store, for stats and multi-limit checks.
    pub fn store(&self) -> &MemoryStore<K, S> {
        &self.store
    }
}

impl<K, C, S> RateLimiter<K, C, S>
where
    K: Hash + Eq + Default,
    C: Clock,
    S: BuildHasher,
{
    /// Takes one token from `key`'s bucket now.
    ///
    /// # Errors
    ///
    /// None for a valid limit; the `Result` matches [`check_n`](Self::check_n).
    #[inline]
    pub fn check<Q>(&self, key: &Q) -> Result<Decision, Error>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned + ?Sized,
        Q::Owned: Into<K>,
    {
        self.check_n(key, 1)
    }

    /// Takes `cost` tokens from `key`'s bucket now.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidCost`] when `cost` is 0 or above the capacity.
    #[inline]
    pub fn check_n<Q>(&self, key: &Q, cost: u64) -> Result<Decision, Error>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned + ?Sized,
        Q::Owned: Into<K>,
    {
        self.store.check(key, &self.limit, cost, self.clock.now())
    }
}
