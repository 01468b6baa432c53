//! Validated limit parameters: a bucket's capacity and its refill rate.
//!
//! A [`Limit`] is the only way parameters reach the bucket math, and it cannot hold a value the
//! math would mishandle: zero rates, zero capacities and magnitudes that could overflow the
//! integer arithmetic are refused here, once, when the limit is built. Everything downstream can
//! then compute without checking again.
//!
//! # Units
//!
//! The math works on a scaled timeline (see [`crate::bucket`]). With `g = gcd(amount, period)`,
//! one nanosecond is worth `a = amount / g` *units* and one token costs `p = period / g` units.
//! Both are integers, so refill is exact: `elapsed_ns * a` units is exactly the refill of
//! `elapsed_ns * amount / period` tokens, with no rounding at any step.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::error::Error;

/// The largest reduced refill amount `a` (units per nanosecond). Keeping `a` below 2^32 keeps
/// the sub-nanosecond remainder of a bucket's state in 32 bits.
const MAX_REDUCED_AMOUNT: u64 = u32::MAX as u64;

/// The longest time a bucket may take to refill from empty to full: 2^62 ns, about 146 years.
/// Bounding it keeps every timestamp the math produces inside a `u64` of nanoseconds.
pub const MAX_TIME_TO_FULL: Duration = Duration::from_nanos(1 << 62);

/// A refill rate: `amount` tokens every `period`.
///
/// Parsed from strings such as `10/s`, `600/m`, `5/100ms` or `1/d`; the period is an optional
/// count followed by a unit (`ns`, `us`, `ms`, `s`, `m`, `h`, `d`).
///
/// ```
/// use std::time::Duration;
/// use tollgate::Rate;
///
/// let rate: Rate = "5/100ms".parse()?;
/// assert_eq!(rate.amount(), 5);
/// assert_eq!(rate.period(), Duration::from_millis(100));
/// # Ok::<(), tollgate::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rate {
    amount: u64,
    period_ns: u64,
}

impl Rate {
    /// A rate of `amount` tokens per `period`.
    ///
    /// Fails when either is zero, or when the period does not fit in a `u64` of nanoseconds.
    pub fn new(amount: u64, period: Duration) -> Result<Self, Error> {
        if amount == 0 {
            return Err(Error::ZeroRefill);
        }
        let period_ns = u64::try_from(period.as_nanos()).map_err(|_| Error::LimitTooLarge)?;
        if period_ns == 0 {
            return Err(Error::ZeroPeriod);
        }
        Ok(Self { amount, period_ns })
    }

    /// `amount` tokens per second.
    pub fn per_second(amount: u64) -> Result<Self, Error> {
        Self::new(amount, Duration::from_secs(1))
    }

    /// Tokens added every period.
    pub fn amount(&self) -> u64 {
        self.amount
    }

    /// The period over which `amount` tokens are added.
    pub fn period(&self) -> Duration {
        Duration::from_nanos(self.period_ns)
    }

    #[cfg(test)]
    fn period_ns(&self) -> u64 {
        self.period_ns
    }
}

impl FromStr for Rate {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self, Error> {
        let bad = |reason: &'static str| Error::InvalidRate {
            text: text.chars().take(64).collect(),
            reason,
        };
        let (amount, period) = text
            .trim()
            .split_once('/')
            .ok_or_else(|| bad("expected AMOUNT/PERIOD, as in 10/s or 5/100ms"))?;
        let amount: u64 =
            parse_digits(amount.trim()).ok_or_else(|| bad("amount is not a whole number"))?;
        let period = period.trim();
        let split = period
            .find(|c: char| !c.is_ascii_digit())
            .ok_or_else(|| bad("period needs a unit: ns, us, ms, s, m, h or d"))?;
        let (count, unit) = period.split_at(split);
        let count: u64 = if count.is_empty() {
            1
        } else {
            parse_digits(count).ok_or_else(|| bad("period count is not a whole number"))?
        };
        let unit_ns: u64 = match unit {
            "ns" => 1,
            "us" | "µs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            "d" => 86_400_000_000_000,
            _ => return Err(bad("unknown period unit: use ns, us, ms, s, m, h or d")),
        };
        let period_ns = count.checked_mul(unit_ns).ok_or(Error::LimitTooLarge)?;
        Rate::new(amount, Duration::from_nanos(period_ns))
    }
}

/// Parses plain ASCII digits; `str::parse` would also take a leading `+`.
fn parse_digits(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match period_parts(self.period_ns) {
            (1, unit) => write!(f, "{}/{unit}", self.amount),
            (n, unit) => write!(f, "{}/{n}{unit}", self.amount),
        }
    }
}

/// A period as a count of the largest unit that divides it exactly, so that the text parses
/// back to the same period.
fn period_parts(period_ns: u64) -> (u64, &'static str) {
    const UNITS: [(u64, &str); 7] = [
        (86_400_000_000_000, "d"),
        (3_600_000_000_000, "h"),
        (60_000_000_000, "m"),
        (1_000_000_000, "s"),
        (1_000_000, "ms"),
        (1_000, "us"),
        (1, "ns"),
    ];
    let (unit_ns, unit) = UNITS
        .into_iter()
        .find(|(ns, _)| period_ns.is_multiple_of(*ns))
        .unwrap_or((1, "ns"));
    (period_ns / unit_ns, unit)
}

/// A token bucket's parameters: it holds at most `capacity` tokens and gains `refill` over time.
/// Or a window's, made by [`Limit::fixed_window`], [`Limit::sliding_window`] and
/// [`Limit::sliding_log`]: at most `capacity` per window, the window being the refill's period
/// (see [`Algorithm`]).
///
/// A `Limit` is always valid: `capacity > 0`, a non-zero rate, a reduced rate below 2^32 units
/// per nanosecond, and a time to refill from empty at most [`MAX_TIME_TO_FULL`]. `Copy` and
/// small, so decisions carry it by value.
///
/// ```
/// use tollgate::Limit;
///
/// let limit = Limit::new(20, "10/s".parse()?)?;
/// assert_eq!(limit.capacity(), 20);
/// assert_eq!(limit.time_to_full().as_secs(), 2);
/// # Ok::<(), tollgate::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Limit {
    capacity: u64,
    refill: Rate,
    /// Units gained per nanosecond: `amount / gcd(amount, period)`.
    a: u32,
    /// How the limit decides; for the windows, `capacity` is the limit per window and the
    /// refill's period is the window.
    algorithm: Algorithm,
    /// Units per token: `period / gcd(amount, period)`.
    p: u64,
}

/// How a [`Limit`] decides (SPEC §3). Every algorithm decides through the same [`Decision`]
/// and in every store, with identical results for identical inputs.
///
/// GCRA is not listed: a GCRA of emission interval `period / amount` and burst tolerance
/// `(capacity - 1)` intervals admits exactly what the token bucket of that capacity and rate
/// admits, and the token bucket here keeps GCRA's state (the theoretical arrival time, see
/// [`crate::bucket`]). The policy's `algorithm: gcra` is that token bucket.
///
/// [`Decision`]: crate::Decision
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Algorithm {
    /// A bucket of `capacity` tokens refilled continuously at `refill` (the default).
    TokenBucket,
    /// At most `limit` per window; windows start at whole multiples of the window on the
    /// clock's timeline and forget everything when they end. The cheapest to explain, and it
    /// admits up to twice the limit across a window's edge (the end of one, the start of the
    /// next).
    FixedWindow,
    /// At most `limit` per window, with the previous window's count weighted by how much of
    /// it still overlaps the sliding window that ends now (the counter approximation): no
    /// double burst at the edge, two counters of state.
    SlidingWindow,
    /// At most `limit` in any window that ends now, counted exactly from a log of what each
    /// millisecond admitted: what the sliding window approximates, at the price of a log per
    /// key of up to `limit` entries, hence a limit of at most [`MAX_LOG_LIMIT`]. A request
    /// timed before the log's latest entry (a clock gone back) is decided at that entry's
    /// millisecond: going back frees nothing. Stores keep a log apart from the fixed-size
    /// states of the other algorithms, so [`crate::bucket`]'s functions refuse it.
    SlidingLog,
}

impl Algorithm {
    /// The name the policy file uses.
    pub fn as_str(&self) -> &'static str {
        match self {
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingWindow => "sliding_window",
            Algorithm::SlidingLog => "sliding_log",
        }
    }

    /// Whether the limit counts requests in windows rather than refilling a bucket.
    pub fn is_window(&self) -> bool {
        !matches!(self, Algorithm::TokenBucket)
    }

    /// Whether the limit keeps a log of its requests rather than one fixed-size state
    /// ([`BucketState`](crate::BucketState)): stores keep such a key's state apart.
    pub fn keeps_log(&self) -> bool {
        matches!(self, Algorithm::SlidingLog)
    }
}

/// The most a sliding log admits per window. The log keeps an entry per millisecond that
/// admitted something, so a key may hold up to this many, and a rejection's wait is found by
/// walking them: bounded here so that one key's memory and one decision's work stay small
/// (80 KB and a few hundred microseconds at worst, in a Redis script too). Above it, the
/// sliding window's two counters approximate the same window in constant space.
pub const MAX_LOG_LIMIT: u64 = 10_000;

/// The most a window limit admits per window: its counters are kept in 32 bits.
pub const MAX_WINDOW_LIMIT: u64 = u32::MAX as u64;

/// The longest window: 2^60 ns, about 36 years. With it, a window's state (see
/// [`crate::bucket`]) and every instant the window math forms fit in a `u64` of nanoseconds.
const MAX_WINDOW_NS: u64 = 1 << 60;

impl Limit {
    /// A bucket of `capacity` tokens refilled at `refill`.
    pub fn new(capacity: u64, refill: Rate) -> Result<Self, Error> {
        if capacity == 0 {
            return Err(Error::ZeroCapacity);
        }
        let g = gcd(refill.amount, refill.period_ns);
        let a = refill.amount / g;
        let p = refill.period_ns / g;
        if a > MAX_REDUCED_AMOUNT {
            return Err(Error::LimitTooLarge);
        }
        let limit = Self {
            capacity,
            refill,
            a: a as u32,
            algorithm: Algorithm::TokenBucket,
            p,
        };
        if limit.capacity_units().div_ceil(u128::from(limit.a)) > MAX_TIME_TO_FULL.as_nanos() {
            return Err(Error::LimitTooLarge);
        }
        Ok(limit)
    }

    /// A bucket of `capacity` tokens that refills `capacity` tokens every `period`: "N per period".
    pub fn per(capacity: u64, period: Duration) -> Result<Self, Error> {
        Self::new(capacity, Rate::new(capacity, period)?)
    }

    /// At most `limit` per `window`, counted in fixed windows ([`Algorithm::FixedWindow`]).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{Algorithm, Limit};
    ///
    /// let limit = Limit::fixed_window(100, Duration::from_secs(60))?;
    /// assert_eq!(limit.algorithm(), Algorithm::FixedWindow);
    /// assert_eq!(limit.window(), Some(Duration::from_secs(60)));
    /// # Ok::<(), tollgate::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`Limit::sliding_window`].
    pub fn fixed_window(limit: u64, window: Duration) -> Result<Self, Error> {
        Self::window_of(Algorithm::FixedWindow, limit, window)
    }

    /// At most `limit` per `window`, counted in a sliding window ([`Algorithm::SlidingWindow`]).
    ///
    /// # Errors
    ///
    /// [`Error::ZeroCapacity`] for a limit of 0; [`Error::InvalidWindow`] for a window that is
    /// not a whole, non-zero number of milliseconds, or a limit of more than
    /// [`MAX_WINDOW_LIMIT`], of one per nanosecond of the window or more, or whose product
    /// with the window in milliseconds reaches 2^53 (the bound of exact arithmetic in the
    /// Redis store's scripts, kept here so that every store takes the same limits);
    /// [`Error::LimitTooLarge`] for a window longer than about 36 years.
    pub fn sliding_window(limit: u64, window: Duration) -> Result<Self, Error> {
        Self::window_of(Algorithm::SlidingWindow, limit, window)
    }

    /// At most `limit` in any `window` that ends now, counted exactly from a log
    /// ([`Algorithm::SlidingLog`]).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{Algorithm, Limit};
    ///
    /// let limit = Limit::sliding_log(100, Duration::from_secs(60))?;
    /// assert_eq!(limit.algorithm(), Algorithm::SlidingLog);
    /// assert!(Limit::sliding_log(20_000, Duration::from_secs(60)).is_err());
    /// # Ok::<(), tollgate::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`Limit::sliding_window`], and [`Error::InvalidWindow`] for a limit above
    /// [`MAX_LOG_LIMIT`].
    pub fn sliding_log(limit: u64, window: Duration) -> Result<Self, Error> {
        if limit > MAX_LOG_LIMIT {
            return Err(Error::InvalidWindow {
                reason: "a sliding log admits at most 10000 per window (sliding_window has no such bound)",
            });
        }
        Self::window_of(Algorithm::SlidingLog, limit, window)
    }

    fn window_of(algorithm: Algorithm, limit: u64, window: Duration) -> Result<Self, Error> {
        if limit == 0 {
            return Err(Error::ZeroCapacity);
        }
        let window_ns = u64::try_from(window.as_nanos()).map_err(|_| Error::LimitTooLarge)?;
        if window_ns > MAX_WINDOW_NS {
            return Err(Error::LimitTooLarge);
        }
        let invalid = |reason| Err(Error::InvalidWindow { reason });
        if window_ns == 0 || !window_ns.is_multiple_of(1_000_000) {
            return invalid("the window must be a whole number of milliseconds, at least 1ms");
        }
        if limit > MAX_WINDOW_LIMIT {
            return invalid("the limit per window must be at most 4294967295");
        }
        if limit >= window_ns {
            return invalid("the limit per window must be below one per nanosecond of it");
        }
        if u128::from(limit) * u128::from(window_ns / 1_000_000) >= 1 << 53 {
            return invalid("the limit times the window in milliseconds must stay below 2^53");
        }
        let mut made = Self::new(limit, Rate::new(limit, window)?)?;
        made.algorithm = algorithm;
        Ok(made)
    }

    /// How the limit decides.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// The window of a window limit (its refill period); `None` for a token bucket.
    pub fn window(&self) -> Option<Duration> {
        self.algorithm.is_window().then(|| self.refill.period())
    }

    /// The window in nanoseconds; meaningful for window limits only.
    pub(crate) fn window_ns(&self) -> u64 {
        self.refill.period_ns
    }

    /// The most tokens the bucket holds (its burst); for a window limit, the limit per window.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The refill rate.
    pub fn refill(&self) -> Rate {
        self.refill
    }

    /// How long an empty bucket takes to become full, rounded up to the nanosecond: for a
    /// fixed window or a sliding log, the window; for a sliding window, two (the current
    /// window's count still weighs in the next).
    pub fn time_to_full(&self) -> Duration {
        match self.algorithm {
            // Bounded by MAX_TIME_TO_FULL at construction, so the cast cannot truncate.
            Algorithm::TokenBucket => {
                Duration::from_nanos(self.units_to_nanos_ceil(self.capacity_units()))
            }
            Algorithm::FixedWindow | Algorithm::SlidingLog => {
                Duration::from_nanos(self.window_ns())
            }
            Algorithm::SlidingWindow => Duration::from_nanos(2 * self.window_ns()),
        }
    }

    /// Units gained per nanosecond on the limit's exact scaled timeline: `amount / g` with
    /// `g = gcd(amount, period in ns)`. See [`crate::bucket`].
    pub fn units_per_nanosecond(&self) -> u32 {
        self.a
    }

    /// Units per token on the same timeline: `period in ns / g`.
    pub fn units_per_token(&self) -> u64 {
        self.p
    }

    pub(crate) fn a(&self) -> u32 {
        self.a
    }

    pub(crate) fn p(&self) -> u64 {
        self.p
    }

    /// The capacity in units: at most 2^62 * 2^32, far below `u128::MAX`.
    pub(crate) fn capacity_units(&self) -> u128 {
        u128::from(self.capacity) * u128::from(self.p)
    }

    /// `units` converted to nanoseconds, rounded up. Callers pass at most the capacity in units
    /// (or a shortfall smaller than it), so the result is at most 2^62.
    pub(crate) fn units_to_nanos_ceil(&self, units: u128) -> u64 {
        let nanos = units.div_ceil(u128::from(self.a));
        u64::try_from(nanos).unwrap_or(u64::MAX)
    }
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.algorithm {
            Algorithm::TokenBucket => {
                write!(f, "capacity {} refill {}", self.capacity, self.refill)
            }
            window => {
                let (count, unit) = period_parts(self.refill.period_ns);
                write!(
                    f,
                    "{} limit {} window {count}{unit}",
                    window.as_str(),
                    self.capacity
                )
            }
        }
    }
}

fn gcd(mut x: u64, mut y: u64) -> u64 {
    while y != 0 {
        (x, y) = (y, x % y);
    }
    x
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rate(text: &str) -> Rate {
        match text.parse() {
            Ok(rate) => rate,
            Err(err) => panic!("{text}: {err}"),
        }
    }

    #[test]
    fn parses_the_documented_forms() {
        let cases = [
            ("10/s", 10, 1_000_000_000),
            ("600/m", 600, 60_000_000_000),
            ("5/100ms", 5, 100_000_000),
            ("1/d", 1, 86_400_000_000_000),
            ("100000/d", 100_000, 86_400_000_000_000),
            (" 3 / 2h ", 3, 7_200_000_000_000),
            ("7/1us", 7, 1_000),
            ("1000000000/s", 1_000_000_000, 1_000_000_000),
        ];
        for (text, amount, period_ns) in cases {
            let parsed = rate(text);
            assert_eq!(parsed.amount(), amount, "{text}");
            assert_eq!(parsed.period_ns(), period_ns, "{text}");
        }
    }

    #[test]
    fn refuses_malformed_and_zero_rates() {
        for text in [
            "", "10", "/s", "10/", "x/s", "10/x", "10/5", "-1/s", "+1/s", "1.5/s", "10/0s", "0/s",
            "10/s/s", "10/1 s",
        ] {
            assert!(text.parse::<Rate>().is_err(), "{text:?} parsed");
        }
        assert!(matches!("0/s".parse::<Rate>(), Err(Error::ZeroRefill)));
        assert!(matches!("1/0ms".parse::<Rate>(), Err(Error::ZeroPeriod)));
        assert!(matches!(
            "1/99999999999999999d".parse::<Rate>(),
            Err(Error::LimitTooLarge)
        ));
        assert!(matches!(
            "99999999999999999999999/s".parse::<Rate>(),
            Err(Error::InvalidRate { .. })
        ));
    }

    #[test]
    fn display_round_trips() {
        for text in [
            "10/s", "600/m", "5/100ms", "1/d", "3/2h", "7/1500us", "9/7ns",
        ] {
            let parsed = rate(text);
            assert_eq!(rate(&parsed.to_string()), parsed, "{text}");
        }
        assert_eq!(rate("60/60s").to_string(), "60/m");
    }

    #[test]
    fn limits_reduce_the_rate() {
        // Through the public figures, which the Redis store converts its units from.
        let units = |limit: Limit| (limit.units_per_nanosecond(), limit.units_per_token());
        let limit = Limit::new(20, rate("10/s")).unwrap();
        assert_eq!(units(limit), (1, 100_000_000));
        let limit = Limit::new(1, rate("1000000000/s")).unwrap();
        assert_eq!(units(limit), (1, 1));
        let limit = Limit::new(5, rate("999999937/s")).unwrap();
        assert_eq!(units(limit), (999_999_937, 1_000_000_000));
        assert_eq!((limit.a(), limit.p()), units(limit));
    }

    #[test]
    fn refuses_zero_and_overflowing_limits() {
        assert!(matches!(
            Limit::new(0, rate("1/s")),
            Err(Error::ZeroCapacity)
        ));
        // 2^33 tokens per nanosecond: the reduced amount does not fit in 32 bits.
        assert!(matches!(
            Limit::new(1, rate("8589934592/1ns")),
            Err(Error::LimitTooLarge)
        ));
        // A billion tokens at one a day takes millions of years to fill.
        assert!(matches!(
            Limit::new(1_000_000_000, rate("1/d")),
            Err(Error::LimitTooLarge)
        ));
        assert!(Limit::new(u64::MAX, rate("1/1ns")).is_err());
        assert!(Limit::new(u64::MAX, rate("4000000000/1ns")).is_ok());
    }

    #[test]
    fn window_limits_are_taken_up_to_their_bounds() {
        let ms = Duration::from_millis;
        // The longest window is the last whole millisecond within 2^60 ns.
        let longest = ms((1 << 60) / 1_000_000);
        assert!(Limit::fixed_window(1, longest).is_ok());
        assert!(matches!(
            Limit::fixed_window(1, longest + ms(1)),
            Err(Error::LimitTooLarge)
        ));
        // The most per window is what 32-bit counters hold.
        let window = Duration::from_secs(1_000);
        let most = Limit::sliding_window(MAX_WINDOW_LIMIT, window).unwrap();
        assert_eq!(most.capacity(), MAX_WINDOW_LIMIT);
        assert!(matches!(
            Limit::sliding_window(MAX_WINDOW_LIMIT + 1, window),
            Err(Error::InvalidWindow { .. })
        ));
    }

    #[test]
    fn time_to_full_rounds_up() {
        let limit = Limit::new(1, rate("3/1ns")).unwrap();
        assert_eq!(limit.time_to_full(), Duration::from_nanos(1));
        let limit = Limit::new(10, rate("3/s")).unwrap();
        assert_eq!(limit.time_to_full(), Duration::from_nanos(3_333_333_334));
        let limit = Limit::new(50_000, rate("1/d")).unwrap();
        assert_eq!(limit.time_to_full(), Duration::from_secs(50_000 * 86_400));
    }
}
