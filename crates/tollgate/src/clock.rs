//! Where time comes from.
//!
//! The bucket math never reads a clock: it is handed a [`Timestamp`]. This module is the one
//! place allowed to ask the operating system for the time (clippy's `disallowed-methods` enforces
//! that), so tests can freeze or rewind time with a [`ManualClock`] and benchmarks measure the
//! same clock production uses.

use std::ops::{Add, Sub};
use std::sync::Arc;
use std::time::Duration;

use std::sync::atomic::{AtomicU64, Ordering};

/// A point in time: whole nanoseconds since the epoch of the [`Clock`] that produced it.
///
/// Timestamps from different clocks are not comparable. A store must be fed from one clock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(u64);

impl Timestamp {
    /// The clock's epoch.
    pub const ZERO: Timestamp = Timestamp(0);

    /// A timestamp `nanos` nanoseconds after the epoch.
    pub const fn from_nanos(nanos: u64) -> Self {
        Self(nanos)
    }

    /// Nanoseconds since the epoch.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// The time from `earlier` to `self`, or zero if `earlier` is later.
    pub fn saturating_duration_since(self, earlier: Timestamp) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl Add<Duration> for Timestamp {
    type Output = Timestamp;

    /// Saturates at `u64::MAX` nanoseconds (about 584 years after the epoch).
    fn add(self, rhs: Duration) -> Timestamp {
        let nanos = u64::try_from(rhs.as_nanos()).unwrap_or(u64::MAX);
        Timestamp(self.0.saturating_add(nanos))
    }
}

impl Sub<Duration> for Timestamp {
    type Output = Timestamp;

    /// Saturates at the epoch.
    fn sub(self, rhs: Duration) -> Timestamp {
        let nanos = u64::try_from(rhs.as_nanos()).unwrap_or(u64::MAX);
        Timestamp(self.0.saturating_sub(nanos))
    }
}

/// A source of [`Timestamp`]s.
///
/// Implementations must be monotonic for the store's guarantees to be tight; the math stays
/// safe when they are not (a clock that goes back mints no tokens).
pub trait Clock: Send + Sync {
    /// The current time.
    fn now(&self) -> Timestamp;
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> Timestamp {
        (**self).now()
    }
}

impl<C: Clock + ?Sized> Clock for &C {
    fn now(&self) -> Timestamp {
        (**self).now()
    }
}

/// The production clock: monotonic, nanosecond resolution, epoch at the last midnight (UTC)
/// before construction.
///
/// Backed by `quanta`, which reads the CPU's invariant time-stamp counter where it is
/// reliable (a few nanoseconds a read) and the OS monotonic clock otherwise. The wall clock is
/// read once, at construction, only to place the epoch: from then on time is the monotonic
/// clock's, and a change of the wall clock moves nothing.
///
/// Why midnight: window limits ([`crate::Limit::fixed_window`]) start their windows at whole
/// multiples of the window from the epoch, so with this epoch a window whose length divides a
/// day (`1s`, `1m`, `1h`, `1d`, ...) starts where the wall clock's does, as on Redis, whose
/// windows follow its `TIME`. An epoch at the process's start would put a per-minute window's
/// edge wherever the process happened to start.
#[derive(Clone, Debug)]
pub struct MonotonicClock {
    clock: quanta::Clock,
    start: u64,
    /// Nanoseconds from the last midnight UTC to `start`: less than a day.
    since_midnight: u64,
}

/// Nanoseconds in a day.
const DAY_NS: u128 = 86_400_000_000_000;

impl MonotonicClock {
    /// A clock whose epoch is the last midnight UTC.
    #[allow(clippy::disallowed_methods)]
    pub fn new() -> Self {
        let clock = quanta::Clock::new();
        let start = clock.raw();
        // A wall clock set before 1970 gives an epoch at construction instead.
        let since_1970 = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        // Below a day, so below 2^47.
        let since_midnight = (since_1970.as_nanos() % DAY_NS) as u64;
        Self {
            clock,
            start,
            since_midnight,
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now(&self) -> Timestamp {
        let elapsed = self.clock.delta_as_nanos(self.start, self.clock.raw());
        Timestamp(elapsed.saturating_add(self.since_midnight))
    }
}

/// A clock that moves only when told to, for tests and simulations.
///
/// Clones share one time, so a test can hand a clone to a limiter and advance the original.
///
/// ```
/// use std::time::Duration;
/// use tollgate::{Clock, ManualClock, Timestamp};
///
/// let clock = ManualClock::new();
/// let shared = clock.clone();
/// clock.advance(Duration::from_millis(5));
/// assert_eq!(shared.now(), Timestamp::from_nanos(5_000_000));
/// ```
#[derive(Clone, Debug, Default)]
pub struct ManualClock {
    nanos: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock at its epoch.
    pub fn new() -> Self {
        Self::default()
    }

    /// A clock at `start`.
    pub fn starting_at(start: Timestamp) -> Self {
        let clock = Self::default();
        clock.set(start);
        clock
    }

    /// Moves time forward by `by` (saturating).
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        // fetch_update cannot fail with a closure that always returns Some.
        let _ = self
            .nanos
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |now| {
                Some(now.saturating_add(by))
            });
    }

    /// Sets the time, forward or backward: tests use it to make time go back.
    pub fn set(&self, to: Timestamp) {
        self.nanos.store(to.0, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp(self.nanos.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monotonic_clock_never_goes_back() {
        let clock = MonotonicClock::new();
        let mut last = clock.now();
        for _ in 0..10_000 {
            let now = clock.now();
            assert!(now >= last);
            last = now;
        }
    }

    /// The epoch is the last midnight UTC: the clock reads the wall clock's time of day (to
    /// within the moments between the two reads), so windows start where the wall clock's do.
    #[test]
    #[allow(clippy::disallowed_methods)]
    fn monotonic_clock_counts_from_midnight_utc() {
        let clock = MonotonicClock::new();
        let now = u128::from(clock.now().as_nanos());
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() % DAY_NS)
            .unwrap_or_default();
        // Compared around the day, in case midnight passed between the reads.
        let apart = (wall + DAY_NS - now % DAY_NS) % DAY_NS;
        let apart = apart.min(DAY_NS - apart);
        assert!(
            apart < 1_000_000_000,
            "{apart} ns from the wall clock's time of day"
        );
        assert!(
            now < DAY_NS + 1_000_000_000,
            "the epoch is the last midnight"
        );
    }

    #[test]
    fn manual_clock_clones_share_time() {
        let clock = ManualClock::starting_at(Timestamp::from_nanos(10));
        let other = clock.clone();
        other.advance(Duration::from_nanos(5));
        assert_eq!(clock.now(), Timestamp::from_nanos(15));
        clock.set(Timestamp::from_nanos(3));
        assert_eq!(other.now(), Timestamp::from_nanos(3));
        clock.advance(Duration::MAX);
        assert_eq!(other.now().as_nanos(), u64::MAX);
    }

    #[test]
    fn shared_and_borrowed_clocks_read_the_clock_they_point_to() {
        fn read(clock: impl Clock) -> Timestamp {
            clock.now()
        }
        let clock = ManualClock::starting_at(Timestamp::from_nanos(42));
        assert_eq!(read(&clock), Timestamp::from_nanos(42));
        let shared: Arc<dyn Clock> = Arc::new(clock.clone());
        clock.advance(Duration::from_nanos(1));
        assert_eq!(read(shared), Timestamp::from_nanos(43));
    }

    #[test]
    fn timestamp_arithmetic_saturates() {
        let t = Timestamp::from_nanos(5);
        assert_eq!(t - Duration::from_nanos(10), Timestamp::ZERO);
        assert_eq!(t - Duration::from_nanos(2), Timestamp::from_nanos(3));
        assert_eq!(
            Timestamp::from_nanos(9).saturating_duration_since(t),
            Duration::from_nanos(4)
        );
        assert_eq!((t + Duration::MAX).as_nanos(), u64::MAX);
        assert_eq!(
            t.saturating_duration_since(Timestamp::from_nanos(9)),
            Duration::ZERO
        );
    }
}
