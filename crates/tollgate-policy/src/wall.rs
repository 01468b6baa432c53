//! Wall-clock time, for the one thing in a policy that is about the calendar: exemption expiry.
//!
//! Bucket math runs on the monotonic [`tollgate::Clock`]; an exemption's `expires` is an RFC 3339
//! instant, so it needs the calendar. Matching takes the time as an argument ([`UnixTime`]) and
//! the engine reads it through [`WallClock`], so tests move it with a [`ManualWallClock`].

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

/// An instant as nanoseconds since the Unix epoch (UTC).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct UnixTime(i64);

impl UnixTime {
    /// The instant `nanos` nanoseconds after the Unix epoch.
    pub const fn from_nanos(nanos: i64) -> Self {
        Self(nanos)
    }

    /// The instant `secs` seconds after the Unix epoch (saturating).
    pub const fn from_secs(secs: i64) -> Self {
        Self(secs.saturating_mul(1_000_000_000))
    }

    /// Parses an RFC 3339 instant with an offset, such as `2026-12-31T00:00:00Z`.
    pub fn parse_rfc3339(text: &str) -> Option<Self> {
        let instant: jiff::Timestamp = text.trim().parse().ok()?;
        i64::try_from(instant.as_nanosecond()).ok().map(Self)
    }

    /// Nanoseconds since the Unix epoch.
    pub const fn as_nanos(self) -> i64 {
        self.0
    }

    /// The instant in RFC 3339, UTC.
    pub fn to_rfc3339(self) -> String {
        jiff::Timestamp::from_nanosecond(i128::from(self.0))
            .map_or_else(|_| self.0.to_string(), |t| t.to_string())
    }
}

/// A source of wall-clock time.
pub trait WallClock: Send + Sync {
    /// The current time.
    fn now(&self) -> UnixTime;
}

/// The operating system's calendar clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemWallClock;

impl WallClock for SystemWallClock {
    // The one place the policy crate reads the calendar (the workspace forbids it elsewhere).
    #[allow(clippy::disallowed_methods)]
    fn now(&self) -> UnixTime {
        let now = jiff::Timestamp::now();
        UnixTime(i64::try_from(now.as_nanosecond()).unwrap_or(i64::MAX))
    }
}

/// A wall clock that moves only when told to. Clones share one time.
#[derive(Clone, Debug, Default)]
pub struct ManualWallClock(Arc<AtomicI64>);

impl ManualWallClock {
    /// A clock showing `now`.
    pub fn new(now: UnixTime) -> Self {
        Self(Arc::new(AtomicI64::new(now.0)))
    }

    /// Sets the time.
    pub fn set(&self, now: UnixTime) {
        self.0.store(now.0, Ordering::SeqCst);
    }
}

impl WallClock for ManualWallClock {
    fn now(&self) -> UnixTime {
        UnixTime(self.0.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_system_clock_reads_the_calendar() {
        // Later than this file was written, earlier than any machine running it will see.
        let written = UnixTime::parse_rfc3339("2026-12-05T00:00:00Z");
        let now = SystemWallClock.now();
        assert!(
            written.is_some_and(|written| now > written),
            "{}",
            now.to_rfc3339()
        );
        assert!(
            now < UnixTime::from_secs(4_102_444_800),
            "{}",
            now.to_rfc3339()
        ); // 2100
    }
}
