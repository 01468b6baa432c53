//! Limits in the units the Lua scripts compute with.
//!
//! Redis keeps time in microseconds (`TIME`), and Lua computes in doubles, exact only below
//! 2^53. So a token bucket's limit is re-expressed on a microsecond timeline (`a` units per
//! microsecond, `p` units per token, reduced by their gcd like the core's nanosecond units), and
//! refused up front when its capacity in those units passes 2^51: then every sum the script
//! forms (a deficit plus a cost, a time plus a wait) stays below 2^53, and the script is as
//! exact as the memory store.
//!
//! A window limit is sent as it is (its kind, its window in milliseconds, its limit per window):
//! the core already refuses those whose limit times window reaches 2^53, and the scripts'
//! window boundaries, up to three windows past the request's time in microseconds, stay below
//! 2^53 for every window of at most [`MAX_WINDOW_US`]. A sliding log is such a window too: the
//! instants it waits for are an entry's millisecond (at most the request's, or a later one a
//! caller's clock wrote) plus one window.

use std::time::Duration;

use tollgate::{Algorithm, Decision, Error, Limit, Unavailable};

/// The largest capacity in units the scripts accept: deficits up to twice this, plus times in
/// microseconds since 1970 (about 2^51 today), stay below 2^53.
const MAX_CAPACITY_UNITS: u64 = 1 << 51;

/// The longest window the scripts take: 2^50 microseconds, about 35 years. A time in
/// microseconds since 1970 (about 2^50.6 today, 2^51 in 2041) plus two such windows, the
/// furthest boundary the script waits for, stays below 2^53.
const MAX_WINDOW_US: u64 = 1 << 50;

/// A limit prepared for the scripts: a token bucket in the scripts' units, or a window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ScriptLimit {
    Tokens(TokenLimit),
    Window(WindowLimit),
}

impl ScriptLimit {
    pub(crate) fn new(limit: &Limit) -> Result<Self, Error> {
        if limit.algorithm().is_window() {
            WindowLimit::new(limit).map(Self::Window)
        } else {
            TokenLimit::new(limit).map(Self::Tokens)
        }
    }

    /// Whether the script decides this limit as a window.
    pub(crate) fn is_window(&self) -> bool {
        matches!(self, Self::Window(_))
    }
}

/// Which window a window limit is: the script's `kind`, which decides how its key is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WindowKind {
    /// Counts per window, a string.
    Fixed,
    /// Counts of this window and the last, weighted; a string.
    Sliding,
    /// A sliding log: what each millisecond admitted, a list.
    Log,
}

impl WindowKind {
    /// The kind of a window `algorithm` (a fixed window for any other: only windows come here).
    fn of(algorithm: Algorithm) -> Self {
        match algorithm {
            Algorithm::SlidingWindow => Self::Sliding,
            Algorithm::SlidingLog => Self::Log,
            _ => Self::Fixed,
        }
    }

    /// The figure the script reads (see `scripts/take.lua`).
    pub(crate) fn code(self) -> u64 {
        match self {
            Self::Fixed => 1,
            Self::Sliding => 2,
            Self::Log => 3,
        }
    }
}

/// A window limit as the scripts take it (see `scripts/take.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WindowLimit {
    pub(crate) kind: WindowKind,
    /// The window in milliseconds: at most 2^50 / 1000.
    pub(crate) window_ms: u64,
    /// The most it admits per window: below 2^32.
    pub(crate) limit: u64,
}

/// A window bucket's figures as the script replies them (see `scripts/take.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WindowFigures {
    pub(crate) allowed: bool,
    /// Requests the window still admits.
    pub(crate) remaining: u64,
    /// Microseconds from the script's microsecond until `cost` would pass.
    pub(crate) retry_us: u64,
    /// Microseconds from the script's microsecond until the window counts nothing.
    pub(crate) reset_us: u64,
    /// The window the bucket was decided in (and charged to, when charged); for a sliding
    /// log, the millisecond.
    pub(crate) window: u64,
    /// The request's time past that microsecond (0 to 999 ns), which the waits count from.
    pub(crate) nanos: u64,
}

impl WindowFigures {
    /// The figures from the script's `allowed`, `remaining` and four extra integers; `None` for
    /// any the script never sends (negative, or nanoseconds past a microsecond).
    pub(crate) fn from_reply(allowed: i64, remaining: i64, extra: &[i64]) -> Option<Self> {
        let &[retry_us, reset_us, window, nanos] = extra else {
            return None;
        };
        let figure = |value: i64| u64::try_from(value).ok();
        let nanos = figure(nanos).filter(|&nanos| nanos < 1_000)?;
        Some(Self {
            allowed: allowed == 1,
            remaining: figure(remaining)?,
            retry_us: figure(retry_us)?,
            reset_us: figure(reset_us)?,
            window: figure(window)?,
            nanos,
        })
    }
}

impl WindowLimit {
    fn new(limit: &Limit) -> Result<Self, Error> {
        let Some(window) = limit.window() else {
            return Err(Error::UnsupportedLimit {
                reason: "a window limit without a window",
            });
        };
        // The core keeps windows whole milliseconds of at most 2^60 ns: this is exact.
        let window_us = u64::try_from(window.as_micros()).unwrap_or(u64::MAX);
        if window_us > MAX_WINDOW_US {
            return Err(Error::UnsupportedLimit {
                reason: "the window must be at most 2^50 microseconds, about 35 years (exact \
                         arithmetic in Lua)",
            });
        }
        Ok(Self {
            kind: WindowKind::of(limit.algorithm()),
            window_ms: window_us / 1_000,
            limit: limit.capacity(),
        })
    }

    /// The core's decision for a script's figures about this window: the waits, replied in
    /// whole microseconds from the script's microsecond, shortened by the request's own
    /// nanoseconds past it, so they count exactly from the request's time (down to 0, as the
    /// core's do).
    ///
    /// # Errors
    ///
    /// [`Unavailable::Protocol`] for a wait no `Duration` of nanoseconds holds: the script
    /// never replies one.
    pub(crate) fn decision(
        &self,
        limit: &Limit,
        cost: u64,
        figures: &WindowFigures,
    ) -> Result<Decision, Unavailable> {
        let wait = |micros: u64| {
            micros
                .checked_mul(1_000)
                .map(|nanos| Duration::from_nanos(nanos.saturating_sub(figures.nanos)))
                .ok_or(Unavailable::Protocol)
        };
        Ok(Decision::from_window(
            figures.allowed,
            *limit,
            cost,
            figures.remaining,
            wait(figures.retry_us)?,
            wait(figures.reset_us)?,
        ))
    }
}

/// A token bucket's limit prepared for the scripts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TokenLimit {
    /// Units per microsecond. At most 1000 times the core's reduced amount per nanosecond
    /// (below 2^32), so far below 2^51 like `cap`: the scripts' doubles hold both exactly.
    pub(crate) a: u64,
    /// Units per token.
    pub(crate) p: u64,
    /// Capacity in units.
    pub(crate) cap: u64,
    /// Core units (nanosecond timeline) per script unit: the core's `p` over ours, an integer.
    ratio: u64,
}

impl TokenLimit {
    fn new(limit: &Limit) -> Result<Self, Error> {
        let refill = limit.refill();
        let period_ns = refill.period().as_nanos();
        if !period_ns.is_multiple_of(1_000) {
            return Err(Error::UnsupportedLimit {
                reason: "the refill period must be a whole number of microseconds",
            });
        }
        let period_us = u64::try_from(period_ns / 1_000).map_err(|_| Error::LimitTooLarge)?;
        let g = gcd(refill.amount(), period_us);
        let (a, p) = (refill.amount() / g, period_us / g);
        let cap = u128::from(limit.capacity()) * u128::from(p);
        if cap > u128::from(MAX_CAPACITY_UNITS) {
            return Err(Error::UnsupportedLimit {
                reason: "capacity times the refill period per token must stay below 2^51 \
                         microseconds (exact arithmetic in Lua)",
            });
        }
        // The core reduces amount/period_ns by gcd(amount, 1000 * period_us), a multiple of
        // ours that divides 1000 times ours, so its units per token are a whole multiple.
        let core_p = limit.units_per_token();
        if !core_p.is_multiple_of(p) {
            return Err(Error::UnsupportedLimit {
                reason: "refill period not representable in microseconds",
            });
        }
        Ok(Self {
            a,
            p,
            cap: cap as u64,
            ratio: core_p / p,
        })
    }

    /// `cost` tokens in units. `cost <= capacity` was checked, so this is at most `cap`.
    pub(crate) fn cost(&self, cost: u64) -> u64 {
        cost * self.p
    }

    /// The core's decision for a script's reply about this bucket, made at a time `nanos`
    /// (0 to 999) past a whole microsecond.
    ///
    /// The script replies the deficit at that time rounded down to a whole unit of its own
    /// (`offsets` in `take.lua`); the core's units are `ratio` times finer and hold the exact
    /// time, so the deficit is given back the part of a unit the rounding took, and the
    /// decision's `retry_after` and `reset_after`, waited from the request's own time, are
    /// enough.
    ///
    /// # Errors
    ///
    /// [`Unavailable::Protocol`] for a negative deficit: the script never replies one, so it
    /// is not a reply of ours, and reading it as 0 would report a full bucket.
    pub(crate) fn decision(
        &self,
        limit: &Limit,
        allowed: bool,
        cost: u64,
        deficit: i64,
        nanos: u64,
    ) -> Result<Decision, Unavailable> {
        let deficit = u128::try_from(deficit).map_err(|_| Unavailable::Protocol)?;
        // The script replies at most `cap + 1` (below 2^52) and `ratio` is below 2^64.
        let deficit = deficit.saturating_mul(u128::from(self.ratio));
        // Units gained in `nanos`: exactly `nanos * a_core` core units, `lo` whole script units
        // rounded down (as the script computes it), so `rounded` is below one script unit.
        let nanos = u128::from(nanos % 1_000);
        let lo = nanos * u128::from(self.a) / 1_000;
        let rounded =
            nanos * u128::from(limit.units_per_nanosecond()) - lo * u128::from(self.ratio);
        Ok(Decision::from_deficit(
            allowed,
            *limit,
            cost,
            deficit.saturating_sub(rounded),
        ))
    }
}

/// Whether the Redis store can decide `limit` exactly (a token bucket, a window or a sliding
/// log); callers check a policy's limits up front, so a limit Lua cannot represent is refused
/// at start, not at the first request.
///
/// # Errors
///
/// [`Error::UnsupportedLimit`] naming the bound it passes.
pub fn check_limit(limit: &Limit) -> Result<(), Error> {
    ScriptLimit::new(limit).map(drop)
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

    fn limit(capacity: u64, rate: &str) -> Limit {
        Limit::new(capacity, rate.parse().unwrap()).unwrap()
    }

    #[test]
    fn converts_and_keeps_the_core_ratio_integral() {
        for (capacity, rate) in [
            (10, "3/s"),
            (5, "1000/s"),
            (7, "7/1ms"),
            (3, "999999937/s"),
            (100, "1/d"),
        ] {
            let l = limit(capacity, rate);
            let s = TokenLimit::new(&l).unwrap();
            assert_eq!(s.p * s.ratio, l.units_per_token(), "{rate}");
            // The same rate: tokens per microsecond = 1000 * tokens per nanosecond.
            assert_eq!(
                u128::from(s.a) * u128::from(l.units_per_token()),
                u128::from(l.units_per_nanosecond()) * 1_000 * u128::from(s.p),
                "{rate}"
            );
        }
    }

    #[test]
    fn a_negative_deficit_is_a_protocol_error_not_a_full_bucket() {
        let l = limit(3, "999999937/s");
        let s = TokenLimit::new(&l).unwrap();
        assert_eq!(s.decision(&l, false, 1, -1, 0), Err(Unavailable::Protocol));
        assert_eq!(
            s.decision(&l, false, 1, i64::MIN, 0),
            Err(Unavailable::Protocol)
        );
        let empty = s.decision(&l, false, 1, s.cap as i64, 0).unwrap();
        assert_eq!(empty.remaining(), 0);
    }

    #[test]
    fn a_time_between_microseconds_gets_back_what_the_script_rounded_off() {
        // 3/s: 3 script units per microsecond, a token is 10^6 of them; 334 ns past a
        // microsecond is 1.002 units, 1 as the script counts. A bucket the script says is one
        // token short (10^6 units) at that rounded time is exactly 0.002 units less short.
        let l = limit(1, "3/s");
        let s = TokenLimit::new(&l).unwrap();
        // In the core's units (10^3 finer): 10^9 - 2, full in 333,333,332.7 ns.
        let d = s.decision(&l, true, 1, 1_000_000, 334).unwrap();
        assert_eq!(d.reset_after().as_nanos(), 333_333_333);
        let whole = s.decision(&l, true, 1, 1_000_000, 0).unwrap();
        assert_eq!(whole.reset_after().as_nanos(), 333_333_334);
    }

    /// A window goes to the script as it is; its waits come back in whole microseconds from the
    /// script's microsecond, and lose the request's nanoseconds past it (down to 0, as the
    /// core's).
    #[test]
    fn a_windows_waits_count_from_the_requests_nanosecond() {
        let l = Limit::sliding_window(7, Duration::from_millis(1_500)).unwrap();
        let Ok(ScriptLimit::Window(w)) = ScriptLimit::new(&l) else {
            panic!("a window");
        };
        assert_eq!(
            w,
            WindowLimit {
                kind: WindowKind::Sliding,
                window_ms: 1_500,
                limit: 7
            }
        );
        let figures = WindowFigures {
            allowed: false,
            remaining: 2,
            retry_us: 3,
            reset_us: 0,
            window: 9,
            nanos: 400,
        };
        let d = w.decision(&l, 1, &figures).unwrap();
        assert_eq!(d.retry_after(), Some(Duration::from_nanos(2_600)));
        assert_eq!(d.reset_after(), Duration::ZERO);
        assert_eq!(d.remaining(), 2);
        let far = WindowFigures {
            retry_us: u64::MAX / 10,
            ..figures
        };
        assert_eq!(w.decision(&l, 1, &far), Err(Unavailable::Protocol));
    }

    /// Sliding logs go to the script as windows of their own kind, under the same bound on
    /// the window.
    #[test]
    fn a_sliding_log_is_a_window_of_its_own_kind() {
        let l = Limit::sliding_log(10_000, Duration::from_secs(60)).unwrap();
        assert_eq!(
            ScriptLimit::new(&l),
            Ok(ScriptLimit::Window(WindowLimit {
                kind: WindowKind::Log,
                window_ms: 60_000,
                limit: 10_000
            }))
        );
        assert_eq!(
            [WindowKind::Fixed, WindowKind::Sliding, WindowKind::Log].map(WindowKind::code),
            [1, 2, 3]
        );
        let longest_ms = MAX_WINDOW_US / 1_000;
        let beyond = Limit::sliding_log(1, Duration::from_millis(longest_ms + 1)).unwrap();
        assert!(check_limit(&beyond).is_err());
    }

    #[test]
    fn refuses_windows_whose_boundaries_lua_cannot_hold() {
        let longest_ms = MAX_WINDOW_US / 1_000;
        let fits = Limit::fixed_window(1, Duration::from_millis(longest_ms)).unwrap();
        assert!(ScriptLimit::new(&fits).is_ok());
        let beyond = Limit::fixed_window(1, Duration::from_millis(longest_ms + 1)).unwrap();
        assert!(matches!(
            ScriptLimit::new(&beyond),
            Err(Error::UnsupportedLimit { .. })
        ));
    }

    #[test]
    fn refuses_what_lua_cannot_hold() {
        assert!(matches!(
            TokenLimit::new(&limit(1, "9/7ns")),
            Err(Error::UnsupportedLimit { .. })
        ));
        // 50,000 tokens at one a day: 4.3e15 microseconds to fill, past 2^51.
        assert!(matches!(
            TokenLimit::new(&limit(50_000, "1/d")),
            Err(Error::UnsupportedLimit { .. })
        ));
        assert!(TokenLimit::new(&limit(20_000, "1/d")).is_ok());
    }
}
