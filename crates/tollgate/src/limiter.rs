//! One limit, one clock, many keys: the in-process entry point most callers want.

use std::borrow::Borrow;
use std::future::Future;
use std::hash::{BuildHasher, Hash};
use std::time::Duration;

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

    /// Waits until `key`'s bucket holds one token, then takes it; see [`wait_n`](Self::wait_n).
    ///
    /// # Errors
    ///
    /// None for a valid limit; the `Result` matches [`wait_n`](Self::wait_n).
    pub async fn wait<Q, F, W>(
        &self,
        key: &Q,
        patience: Duration,
        sleep: F,
    ) -> Result<Decision, Error>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned + ?Sized,
        Q::Owned: Into<K>,
        F: FnMut(Duration) -> W,
        W: Future<Output = ()>,
    {
        self.wait_n(key, 1, patience, sleep).await
    }

    /// Waits until `key`'s bucket holds `cost` tokens, then takes them, for callers that would
    /// rather be late than refused: a client pacing its calls to someone else's API, a job
    /// draining a queue at a set rate.
    ///
    /// Each rejected check says exactly how long until `cost` tokens are there
    /// ([`Decision::retry_after`]); this sleeps that long with `sleep` and checks again. Nothing
    /// is charged while waiting (a rejected check charges nothing), so dropping the future at
    /// any point, or wrapping it in a timeout, costs the bucket nothing. `sleep` must let the
    /// asked time pass on the clock this limiter reads: `tokio::time::sleep` for the
    /// [`MonotonicClock`], a closure advancing a [`ManualClock`](crate::ManualClock) in tests.
    /// A caller that wants jitter adds it in `sleep`.
    ///
    /// `patience` bounds the wait, counted from the call on this limiter's clock: when the next
    /// wait would end past it, the rejected decision is returned at once, without sleeping, so
    /// a caller learns early that it will not get through in time (`Duration::MAX`: wait as
    /// long as it takes). Waiters form no queue: each checks again when its own wait is over,
    /// and a token another caller took first sends it back to sleep, so under contention a
    /// large `cost` can keep losing to small ones until its patience runs out.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{Limit, RateLimiter};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tollgate::Error> {
    /// // Someone else's API takes 2 calls at once and 100 per second.
    /// let limiter = RateLimiter::with_limit(Limit::new(2, "100/s".parse()?)?);
    /// for _ in 0..4 {
    ///     let decision = limiter
    ///         .wait("their-api", Duration::from_secs(1), tokio::time::sleep)
    ///         .await?;
    ///     assert!(decision.allowed());
    ///     // ...make the call
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidCost`] when `cost` is 0 or above the capacity, before any wait: no wait
    /// would let it through.
    pub async fn wait_n<Q, F, W>(
        &self,
        key: &Q,
        cost: u64,
        patience: Duration,
        mut sleep: F,
    ) -> Result<Decision, Error>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned + ?Sized,
        Q::Owned: Into<K>,
        F: FnMut(Duration) -> W,
        W: Future<Output = ()>,
    {
        let deadline = self.clock.now() + patience;
        loop {
            let now = self.clock.now();
            let decision = self.store.check(key, &self.limit, cost, now)?;
            // `None` only when allowed: a limit of this kind never denies outright.
            let Some(wait) = decision.retry_after() else {
                return Ok(decision);
            };
            if now + wait > deadline {
                return Ok(decision);
            }
            sleep(wait).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::{Ready, ready};
    use std::time::Duration;

    use super::RateLimiter;
    use crate::clock::{Clock, ManualClock, MonotonicClock};
    use crate::decision::Decision;
    use crate::error::Error;
    use crate::limit::Limit;

    const TENTH: Duration = Duration::from_millis(100);

    /// Two tokens, one every 100 ms, both taken: the next is 100 ms away.
    fn drained() -> (RateLimiter<Box<str>, ManualClock>, ManualClock) {
        let clock = ManualClock::new();
        let limit = Limit::new(2, "10/s".parse().unwrap()).unwrap();
        let limiter = RateLimiter::new(limit, clock.clone());
        assert!(limiter.check_n("k", 2).unwrap().allowed());
        (limiter, clock)
    }

    /// A sleep that lets the time pass on `clock` and writes down how long it was asked for.
    fn sleeper<'a>(
        clock: &'a ManualClock,
        asked: &'a mut Vec<Duration>,
    ) -> impl FnMut(Duration) -> Ready<()> + 'a {
        move |wait| {
            asked.push(wait);
            clock.advance(wait);
            ready(())
        }
    }

    /// `wait_n` of `cost` on key `k` with `patience`, sleeping on `clock`: what it returned
    /// and the sleeps it asked for.
    async fn wait_on(
        limiter: &RateLimiter<Box<str>, ManualClock>,
        clock: &ManualClock,
        cost: u64,
        patience: Duration,
    ) -> (Decision, Vec<Duration>) {
        let mut asked = Vec::new();
        let decision = limiter
            .wait_n("k", cost, patience, sleeper(clock, &mut asked))
            .await
            .unwrap();
        (decision, asked)
    }

    #[tokio::test]
    async fn a_token_there_is_taken_without_sleeping() {
        let clock = ManualClock::new();
        let limit = Limit::new(2, "10/s".parse().unwrap()).unwrap();
        let limiter = RateLimiter::new(limit, clock.clone());
        let (decision, asked) = wait_on(&limiter, &clock, 2, Duration::ZERO).await;
        assert!(decision.allowed());
        assert!(asked.is_empty());
        assert!(
            !limiter.check("k").unwrap().allowed(),
            "the wait took both tokens"
        );
    }

    #[tokio::test]
    async fn sleeps_exactly_until_the_tokens_are_there_then_takes_them() {
        let (limiter, clock) = drained();
        let (decision, asked) = wait_on(&limiter, &clock, 1, Duration::MAX).await;
        assert!(decision.allowed());
        assert_eq!(asked, [TENTH]);
        assert_eq!(clock.now().as_nanos(), 100_000_000);
        assert!(
            !limiter.check("k").unwrap().allowed(),
            "the token was taken"
        );
    }

    #[tokio::test]
    async fn a_wait_ending_exactly_at_the_patience_is_waited() {
        let (limiter, clock) = drained();
        let (decision, asked) = wait_on(&limiter, &clock, 1, TENTH).await;
        assert!(decision.allowed());
        assert_eq!(asked, [TENTH]);
    }

    #[tokio::test]
    async fn a_wait_past_the_patience_returns_the_rejection_at_once_and_charges_nothing() {
        let (limiter, clock) = drained();
        let patience = TENTH - Duration::from_nanos(1);
        let (decision, asked) = wait_on(&limiter, &clock, 1, patience).await;
        assert!(!decision.allowed());
        assert_eq!(decision.retry_after(), Some(TENTH));
        assert!(asked.is_empty(), "no sleep when it could not end in time");
        assert_eq!(clock.now().as_nanos(), 0);
        clock.advance(TENTH);
        assert!(
            limiter.check("k").unwrap().allowed(),
            "the refused wait took nothing"
        );
    }

    #[tokio::test]
    async fn a_token_taken_while_asleep_sends_the_waiter_back_to_sleep() {
        let (limiter, clock) = drained();
        let mut asked = Vec::new();
        let decision = limiter
            .wait("k", Duration::MAX, |wait| {
                asked.push(wait);
                clock.advance(wait);
                if asked.len() == 1 {
                    // Another caller wakes first and takes the token.
                    assert!(limiter.check("k").unwrap().allowed());
                }
                ready(())
            })
            .await
            .unwrap();
        assert!(decision.allowed());
        assert_eq!(asked, [TENTH, TENTH]);
    }

    #[tokio::test]
    async fn the_patience_counts_the_time_already_waited() {
        let (limiter, clock) = drained();
        let mut asked = Vec::new();
        let decision = limiter
            .wait("k", TENTH + TENTH / 2, |wait| {
                asked.push(wait);
                clock.advance(wait);
                assert!(
                    limiter.check("k").unwrap().allowed(),
                    "someone else woke first"
                );
                ready(())
            })
            .await
            .unwrap();
        assert!(
            !decision.allowed(),
            "a second 100 ms would end at 200 ms, past 150"
        );
        assert_eq!(asked, [TENTH]);
    }

    #[tokio::test]
    async fn a_cost_no_wait_can_pay_is_refused_before_any_sleep() {
        let (limiter, clock) = drained();
        let mut asked = Vec::new();
        for cost in [0, 3] {
            let refused = limiter
                .wait_n("k", cost, Duration::MAX, sleeper(&clock, &mut asked))
                .await;
            assert!(
                matches!(refused, Err(Error::InvalidCost { .. })),
                "{refused:?}"
            );
        }
        assert!(asked.is_empty());
    }

    #[tokio::test]
    async fn on_the_real_clock_waits_pace_the_calls_at_the_rate() {
        // One token at a time, one every 10 ms: five takes need at least 40 ms whatever the
        // load (a busy host only makes them later).
        let clock = MonotonicClock::new();
        let limiter = RateLimiter::new(
            Limit::new(1, "1/10ms".parse().unwrap()).unwrap(),
            clock.clone(),
        );
        let start = clock.now();
        for _ in 0..5 {
            let decision = limiter
                .wait("k", Duration::MAX, tokio::time::sleep)
                .await
                .unwrap();
            assert!(decision.allowed());
        }
        let took = clock.now().saturating_duration_since(start);
        assert!(took >= Duration::from_millis(40), "{took:?}");
    }
}
