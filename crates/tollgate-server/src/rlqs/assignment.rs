//! What an RLQS quota assignment costs the shared bucket, so that Envoys enforcing quotas on
//! their own never let through more than tollgate's limits allow.
//!
//! Under RLQS an Envoy decides every request itself, against a token bucket tollgate assigns
//! it for a while, and only afterwards reports what it let through. A report is history: what
//! it counts was admitted already and cannot be refused. So tollgate charges the shared bucket
//! *before* an assignment can spend anything, for everything it could spend:
//!
//! * Envoy starts a new assignment's bucket full, so a strategy Envoy will start afresh costs
//!   its `max_tokens` (here always equal to its rate, one fill of tokens);
//! * the bucket refills `rate` tokens a fill interval for as long as the assignment is active,
//!   so the whole time-to-live sent is paid at that rate when it is sent;
//! * an assignment Envoy still holds is extended by sending the same strategy again with a new
//!   time-to-live, counted from its arrival: only the time beyond what is already paid costs
//!   anything, and what was paid for is tracked to the nanosecond (`paid_until`).
//!
//! **Invariant** (the property test below drives it with random report timings): for every
//! bucket of every stream, the tokens charged are at least what the assignments sent could
//! admit, `max_tokens` per start plus `rate` per fill interval active, and no time-to-live
//! sent reaches past `paid_until`. An Envoy that adds whole fills on a timer admits no more
//! than one filling continuously, so the bound holds for both. What is paid and not spent is lost
//! to the quota: under-admission, never over-admission. The one part given back is the refill
//! paid beyond the moment an assignment is replaced ([`Assignment::unused`]): Envoy ends the
//! old bucket as the new strategy arrives, so that time can never be spent.
//!
//! No floating point: rates are whole tokens a fill interval, times are nanoseconds, and every
//! rounding goes the quota's way (costs up, paid time down).

use std::time::Duration;

use tollgate::Timestamp;

/// The fill interval when every limit refills at least a token a second: rates are then tokens
/// a second.
pub(crate) const ONE_SECOND: Duration = Duration::from_secs(1);

/// The longest fill interval: a limit slower than a token an hour is not one RLQS can share.
pub(crate) const MAX_FILL: Duration = Duration::from_secs(3_600);

/// Tokens `rate` a `fill` refills over `span`, rounded up.
pub(crate) fn refill_cost(rate: u32, fill: Duration, span: Duration) -> u64 {
    let tokens = (u128::from(rate) * span.as_nanos()).div_ceil(fill.as_nanos().max(1));
    u64::try_from(tokens).unwrap_or(u64::MAX)
}

/// The time `tokens` pay for at `rate` a `fill`, rounded down. It is at least the span they
/// were computed for by [`refill_cost`]: `tokens × fill ≥ rate × span`.
fn paid_span(rate: u32, fill: Duration, tokens: u64) -> Duration {
    match rate {
        0 => Duration::MAX,
        rate => {
            let nanos = u128::from(tokens) * fill.as_nanos() / u128::from(rate);
            Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
        }
    }
}

/// What a fresh assignment of `rate` a `fill` for `ttl` costs: a full bucket, then its refill.
pub(crate) fn fresh_cost(rate: u32, fill: Duration, ttl: Duration) -> u64 {
    u64::from(rate).saturating_add(refill_cost(rate, fill, ttl))
}

/// The highest rate whose fresh assignment for `ttl` costs at most `available` tokens.
///
/// `rate × (fill + ttl) ≤ available × fill` is `rate + rate × ttl / fill ≤ available`; the
/// left side rounded up is [`fresh_cost`] and `available` is whole, so the floor below is
/// exactly the largest rate that fits, and one more would not.
pub(crate) fn largest_rate(available: u64, fill: Duration, ttl: Duration) -> u32 {
    let fill = fill.as_nanos().max(1);
    let rate = u128::from(available) * fill / (fill + ttl.as_nanos());
    u32::try_from(rate).unwrap_or(u32::MAX)
}

/// The fill interval for limits refilling `amount` every `period` each: a second, or the
/// whole seconds in which the slowest refills a token (at most [`MAX_FILL`]), so that every
/// assignment can hold at least one.
pub(crate) fn fill_interval(refills: impl IntoIterator<Item = (u64, Duration)>) -> Duration {
    refills
        .into_iter()
        .map(|(amount, period)| {
            let nanos = period.as_nanos().div_ceil(u128::from(amount.max(1)));
            let seconds = nanos.div_ceil(ONE_SECOND.as_nanos());
            Duration::from_secs(u64::try_from(seconds).unwrap_or(u64::MAX))
        })
        .fold(ONE_SECOND, Duration::max)
        .min(MAX_FILL)
}

/// Tokens a `fill` refilled by `amount` every `period`, rounded down.
pub(crate) fn refill_per(fill: Duration, amount: u64, period: Duration) -> u64 {
    let tokens = u128::from(amount) * fill.as_nanos() / period.as_nanos().max(1);
    u64::try_from(tokens).unwrap_or(u64::MAX)
}

/// Tokens a `fill` for an Envoy that saw `requests` in `elapsed`: its demand and a quarter
/// more, so that growth shows in the next report rather than as denials, plus one so that a
/// quiet Envoy can still let its next request through.
pub(crate) fn wanted_rate(requests: u64, elapsed: Duration, fill: Duration) -> u64 {
    let per_fill = match elapsed.as_nanos() {
        // Under a fill (a first report, sent as the first request arrives) the count is taken
        // as one fill's: a tiny elapsed time would make a huge rate of a few requests.
        nanos if nanos < fill.as_nanos() => u128::from(requests),
        nanos => (u128::from(requests) * fill.as_nanos()).div_ceil(nanos),
    };
    let wanted = per_fill + per_fill / 4 + 1;
    u64::try_from(wanted).unwrap_or(u64::MAX)
}

/// Max-min fair shares, as global limits' reservoirs share a limit among processes: here among
/// the Envoys of this process.
pub(crate) use tollgate_regional::share::fair_share;

/// A token-bucket assignment an Envoy holds: `max_tokens` and `tokens_per_fill` both `rate`,
/// a fill every `fill`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Assignment {
    /// Tokens a fill, and the bucket's size.
    pub(crate) rate: u32,
    /// The fill interval.
    pub(crate) fill: Duration,
    /// Up to when its refill is paid for.
    pub(crate) paid_until: Timestamp,
    /// When the Envoy lets it expire: the last time-to-live sent, from when it was sent.
    pub(crate) expires_at: Timestamp,
}

impl Assignment {
    /// A new assignment of `rate` a `fill` for `ttl` from `now`, and what it costs.
    pub(crate) fn fresh(rate: u32, fill: Duration, now: Timestamp, ttl: Duration) -> (Self, u64) {
        let refill = refill_cost(rate, fill, ttl);
        let assignment = Self {
            rate,
            fill,
            paid_until: now + paid_span(rate, fill, refill),
            expires_at: now + ttl,
        };
        (assignment, fresh_cost(rate, fill, ttl))
    }

    /// Whether sending the same strategy at `now` extends this assignment rather than starts
    /// it afresh: it must not have expired, with `margin` to spare for the message's trip
    /// (an Envoy that saw it expire would start the "extension" full, uncharged).
    pub(crate) fn extendable(&self, now: Timestamp, margin: Duration) -> bool {
        now + margin < self.expires_at
    }

    /// Refill paid for after `now + margin`, in whole tokens (rounded down): what replacing
    /// this assignment at `now` leaves unspendable, if the replacement reaches the Envoy
    /// within `margin`.
    pub(crate) fn unused(&self, now: Timestamp, margin: Duration) -> u64 {
        let unused = self.paid_until.saturating_duration_since(now + margin);
        let tokens = u128::from(self.rate) * unused.as_nanos() / self.fill.as_nanos().max(1);
        u64::try_from(tokens).unwrap_or(u64::MAX)
    }

    /// This assignment extended to `now + ttl`, and what that costs: the refill beyond what
    /// is paid already.
    pub(crate) fn extended(&self, now: Timestamp, ttl: Duration) -> (Self, u64) {
        let end = now + ttl;
        let (paid_until, cost) = if end <= self.paid_until {
            (self.paid_until, 0)
        } else {
            let unpaid = end.saturating_duration_since(self.paid_until);
            let cost = refill_cost(self.rate, self.fill, unpaid);
            (
                self.paid_until + paid_span(self.rate, self.fill, cost),
                cost,
            )
        };
        let extended = Self {
            paid_until,
            expires_at: end,
            ..*self
        };
        (extended, cost)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn a_fresh_assignment_pays_a_full_bucket_and_its_refill() {
        let now = Timestamp::from_nanos(5);
        let (assignment, cost) = Assignment::fresh(10, SECOND, now, 2 * SECOND);
        assert_eq!(cost, 30);
        assert_eq!(assignment.paid_until, now + 2 * SECOND);
        assert_eq!(assignment.expires_at, now + 2 * SECOND);
        // A third of a token's time still costs a whole token, and pays for all of its time.
        let (assignment, cost) = Assignment::fresh(3, SECOND, now, Duration::from_millis(1_100));
        assert_eq!(cost, 3 + 4);
        assert_eq!(
            assignment.paid_until,
            now + Duration::from_nanos(1_333_333_333)
        );
        // A token every 6 s, for 2 s: the full bucket and the token it starts to refill.
        let (_, cost) = Assignment::fresh(1, 6 * SECOND, now, 2 * SECOND);
        assert_eq!(cost, 2);
    }

    #[test]
    fn an_extension_pays_only_the_time_beyond_what_is_paid() {
        let start = Timestamp::ZERO;
        let (assignment, _) = Assignment::fresh(10, SECOND, start, 2 * SECOND);
        let (extended, cost) = assignment.extended(start + SECOND, 2 * SECOND);
        assert_eq!(cost, 10);
        assert_eq!(extended.paid_until, start + 3 * SECOND);
        assert_eq!(extended.expires_at, start + 3 * SECOND);
        // Sent again at once: nothing more to pay.
        let (again, cost) = extended.extended(start + SECOND, SECOND);
        assert_eq!(cost, 0);
        assert_eq!(again.paid_until, start + 3 * SECOND);
    }

    #[test]
    fn an_assignment_is_extendable_only_with_its_margin_to_run() {
        let start = Timestamp::ZERO;
        let (assignment, _) = Assignment::fresh(10, SECOND, start, 2 * SECOND);
        let margin = SECOND / 2;
        assert!(assignment.extendable(start, margin));
        let last = start + Duration::from_nanos(1_499_999_999);
        assert!(assignment.extendable(last, margin));
        // The extension would arrive as it expires: Envoy may have started a new bucket.
        assert!(!assignment.extendable(start + SECOND + margin, margin));
        assert!(!assignment.extendable(start + 3 * SECOND, margin));
        assert!(!assignment.extendable(start + 3 * SECOND, Duration::ZERO));
    }

    #[test]
    fn a_replaced_assignment_gives_back_the_refill_past_its_margin() {
        let start = Timestamp::ZERO;
        let (assignment, _) = Assignment::fresh(10, SECOND, start, 2 * SECOND);
        // Paid until 2 s; replaced at 1 s, reaching the Envoy within 250 ms: 0.75 s of
        // refill can never be spent, 7.5 tokens, rounded down.
        assert_eq!(assignment.unused(start + SECOND, SECOND / 4), 7);
        assert_eq!(assignment.unused(start + SECOND, Duration::ZERO), 10);
        assert_eq!(assignment.unused(start + 2 * SECOND, Duration::ZERO), 0);
        assert_eq!(assignment.unused(start + 5 * SECOND, SECOND), 0);
    }

    #[test]
    fn the_largest_rate_fits_and_one_more_does_not() {
        let cases = [
            (30, SECOND, 2 * SECOND),
            (29, SECOND, 2 * SECOND),
            (0, SECOND, SECOND),
            (7, SECOND, SECOND / 3),
            (2, 6 * SECOND, 2 * SECOND),
        ];
        for (available, fill, ttl) in cases {
            let rate = largest_rate(available, fill, ttl);
            assert!(
                fresh_cost(rate, fill, ttl) <= available,
                "{available} {ttl:?}"
            );
            assert!(
                fresh_cost(rate + 1, fill, ttl) > available,
                "{available} {ttl:?}"
            );
        }
        assert_eq!(largest_rate(30, SECOND, 2 * SECOND), 10);
        assert_eq!(largest_rate(u64::MAX, SECOND, Duration::ZERO), u32::MAX);
    }

    #[test]
    fn the_fill_interval_lets_the_slowest_limit_refill_a_token() {
        let minute = Duration::from_secs(60);
        assert_eq!(fill_interval([(600, minute), (5, SECOND)]), SECOND);
        assert_eq!(fill_interval([(600, minute), (10, minute)]), 6 * SECOND);
        assert_eq!(fill_interval([(7, minute)]), 9 * SECOND);
        assert_eq!(fill_interval([(1, Duration::from_secs(86_400))]), MAX_FILL);
        assert_eq!(refill_per(6 * SECOND, 10, minute), 1);
        assert_eq!(refill_per(SECOND, 600, minute), 10);
    }

    #[test]
    fn wanted_rates_follow_demand_with_a_margin() {
        assert_eq!(wanted_rate(0, SECOND, SECOND), 1);
        assert_eq!(wanted_rate(100, 2 * SECOND, SECOND), 50 + 12 + 1);
        assert_eq!(wanted_rate(100, 2 * SECOND, 4 * SECOND), 100 + 25 + 1);
        // A first report, a moment after the first request: counted as a fill's.
        assert_eq!(wanted_rate(4, Duration::from_millis(3), SECOND), 4 + 1 + 1);
        assert_eq!(wanted_rate(u64::MAX, SECOND, SECOND), u64::MAX);
    }

    #[test]
    fn fair_shares_give_the_small_what_they_want_and_split_the_rest() {
        assert_eq!(fair_share(100, 10, [30]), 10);
        assert_eq!(fair_share(100, 80, [30]), 70);
        assert_eq!(fair_share(100, 80, [60]), 50);
        assert_eq!(fair_share(100, 80, [10, 20]), 70);
        assert_eq!(fair_share(100, 80, [90, 90]), 33);
        assert_eq!(fair_share(5, 80, [90; 9]), 1);
        assert_eq!(fair_share(100, 80, []), 80);
    }

    proptest! {
        #[test]
        fn fair_shares_never_exceed_the_supply(
            supply in 10u64..1_000_000,
            wants in prop::collection::vec(0u64..2_000_000, 1..12),
        ) {
            let shares: Vec<u64> = (0..wants.len())
                .map(|me| {
                    let others = wants.iter().enumerate().filter(|&(i, _)| i != me);
                    fair_share(supply, wants[me], others.map(|(_, &w)| w))
                })
                .collect();
            // Shares are at least one each, so the supply bounds them once it covers that.
            if supply >= wants.len() as u64 {
                prop_assert!(shares.iter().sum::<u64>() <= supply, "{shares:?}");
            }
            for (share, want) in shares.iter().zip(&wants) {
                prop_assert!(*share <= (*want).max(1));
            }
        }
    }

    /// What an Envoy does with the assignments it is sent, as RLQS describes it: a strategy
    /// that differs from the one it holds, or arrives after that one expired, starts a bucket
    /// full; the same strategy while held only moves the expiry. It counts the most it could
    /// admit: `max_tokens` per start and `rate` per fill interval held.
    #[derive(Default)]
    struct Envoy {
        /// Rate, fill, held since, expiry.
        held: Option<(u32, Duration, Timestamp, Timestamp)>,
        could_admit: u128,
    }

    impl Envoy {
        /// The refill of the assignment held from its start until `until` (or its expiry).
        fn close(&mut self, until: Timestamp) {
            if let Some((rate, fill, since, expires_at)) = self.held.take() {
                let held = until.min(expires_at).saturating_duration_since(since);
                self.could_admit += (u128::from(rate) * held.as_nanos()).div_ceil(fill.as_nanos());
            }
        }

        fn receive(&mut self, now: Timestamp, rate: u32, fill: Duration, ttl: Duration) {
            match self.held {
                Some((held, held_fill, since, expires_at))
                    if held == rate && held_fill == fill && now < expires_at =>
                {
                    self.held = Some((held, fill, since, now + ttl));
                }
                _ => {
                    self.close(now);
                    self.could_admit += u128::from(rate);
                    self.held = Some((rate, fill, now, now + ttl));
                }
            }
        }
    }

    proptest! {
        /// The module's invariant: over any timing of reports, any rates, fills and
        /// time-to-live, with the margin the service keeps, the tokens charged (less what
        /// replacements gave back, up to the last charge) cover what the Envoy could admit. It
        /// fails if an extension is charged from the send rather than from what is paid, if a
        /// late extension is not treated as a fresh start, or if a replacement gives back
        /// refill the old assignment could still spend.
        #[test]
        fn what_is_charged_covers_what_envoy_could_admit(
            steps in prop::collection::vec(
                (0u64..3_000_000_000, 0u32..50, 1u64..4, 1u64..4_000_000_000, any::<bool>()),
                1..40,
            ),
        ) {
            let mut now = Timestamp::ZERO;
            let mut envoy = Envoy::default();
            let mut held: Option<Assignment> = None;
            let mut charged: u128 = 0;
            let mut last_cost = 0;
            for (gap, rate, fill, ttl, keep) in steps {
                now = now + Duration::from_nanos(gap);
                let (fill, ttl) = (Duration::from_secs(fill), Duration::from_nanos(ttl));
                let (assignment, cost) = match held {
                    Some(current) if keep && current.extendable(now, ttl / 4) => {
                        current.extended(now, ttl)
                    }
                    _ => {
                        if let Some(current) = held {
                            let refund = current.unused(now, Duration::ZERO).min(last_cost);
                            charged -= u128::from(refund);
                        }
                        Assignment::fresh(rate.max(1), fill, now, ttl)
                    }
                };
                prop_assert!(assignment.expires_at <= assignment.paid_until);
                charged += u128::from(cost);
                last_cost = cost;
                held = Some(assignment);
                envoy.receive(now, assignment.rate, assignment.fill, ttl);
            }
            envoy.close(Timestamp::from_nanos(u64::MAX));
            prop_assert!(envoy.could_admit <= charged, "{} > {charged}", envoy.could_admit);
        }
    }
}
