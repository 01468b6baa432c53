//! How much of a global limit one process should hold: its demand, capped by a fair share of
//! what the limit refills.
//!
//! Safety does not depend on anything here: every token a process spends was charged on the
//! global store first, whatever these numbers say. They decide fairness and how much sits
//! unspent in reservoirs (the under-admission), so they only need to be sensible, and they
//! round the way that keeps reservoirs small.

use std::time::Duration;

use tollgate::Limit;

/// The most one participant wanting `mine` may have of `supply` when the others want
/// `others`: max-min fair shares (one wanting less than an equal share gets what it wants, and
/// what it leaves is split among the rest). At least one, so no participant is shut out by
/// rounding.
pub fn fair_share(supply: u64, mine: u64, others: impl IntoIterator<Item = u64>) -> u64 {
    let mut wants: Vec<u64> = others.into_iter().collect();
    wants.push(mine);
    wants.sort_unstable();
    let mut left = supply;
    let mut sharing = wants.len() as u64;
    for want in wants {
        let level = left / sharing;
        if want > level {
            // Everyone from here on wants more than an equal share of what is left.
            return mine.min(level).max(1);
        }
        left -= want;
        sharing -= 1;
    }
    mine.max(1)
}

/// What a participant that used `demand` tokens over `elapsed` wants for the next `span`: its
/// rate over that span, a quarter more for growth, and one, so that a quiet key still holds a
/// token for its next request.
///
/// Demand counts the requests a short reservoir turned away too, so a key whose traffic jumps
/// asks for what it needed, not for what it was allowed.
pub fn want(demand: u64, elapsed: Duration, span: Duration) -> u64 {
    let elapsed = elapsed.as_nanos().max(1);
    let per_span = (u128::from(demand) * span.as_nanos()).div_ceil(elapsed);
    let wanted = per_span + per_span / 4 + 1;
    u64::try_from(wanted).unwrap_or(u64::MAX)
}

/// Tokens `limit` refills over `span`, rounded down: what the participants share each span.
/// At least one, so a limit slower than a token a span still lets each hold one.
pub fn supply(limit: &Limit, span: Duration) -> u64 {
    let rate = limit.refill();
    let tokens = u128::from(rate.amount()) * span.as_nanos() / rate.period().as_nanos().max(1);
    u64::try_from(tokens).unwrap_or(u64::MAX).max(1)
}

/// The level a participant tops its reservoir up to: its fair share of the limit's refill over
/// `span` for its want, never above the capacity (the global bucket never holds more at once).
pub fn level(limit: &Limit, span: Duration, want: u64, others: &[u64]) -> u64 {
    fair_share(supply(limit, span), want, others.iter().copied()).min(limit.capacity())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fair_shares_are_max_min() {
        assert_eq!(fair_share(100, 10, [200]), 10);
        assert_eq!(fair_share(100, 200, [10]), 90);
        assert_eq!(fair_share(100, 80, [80]), 50);
        assert_eq!(fair_share(100, 80, [10, 80]), 45);
        assert_eq!(fair_share(100, 30, []), 30);
        // A want of exactly an equal share is met, and what rounding left goes on to the next.
        assert_eq!(fair_share(101, 80, [50]), 51);
        assert_eq!(
            fair_share(2, 5, [5, 5, 5]),
            1,
            "rounding never shuts one out"
        );
    }

    #[test]
    fn fair_shares_never_sum_above_the_supply_unless_rounding_lifts_them() {
        let wants = [3u64, 50, 50, 200, 7];
        for supply in [0u64, 1, 10, 64, 100, 1_000] {
            let total: u64 = (0..wants.len())
                .map(|i| {
                    let others = wants
                        .iter()
                        .enumerate()
                        .filter(|&(j, _)| j != i)
                        .map(|(_, &w)| w);
                    fair_share(supply, wants[i], others)
                })
                .sum();
            assert!(total <= supply.max(wants.len() as u64), "{supply}: {total}");
        }
    }

    #[test]
    fn wants_scale_demand_to_the_span() {
        let second = Duration::from_secs(1);
        assert_eq!(want(0, second, 2 * second), 1);
        assert_eq!(want(100, second, 2 * second), 251);
        assert_eq!(want(100, 4 * second, 2 * second), 63);
        // A round that came at once after the last does not make a huge rate of a few.
        assert!(want(3, Duration::ZERO, second) > 0);
    }

    #[test]
    fn supply_and_level() {
        let limit = Limit::new(50, "10/s".parse().unwrap()).unwrap();
        let span = Duration::from_secs(2);
        assert_eq!(supply(&limit, span), 20);
        assert_eq!(level(&limit, span, 5, &[100]), 5);
        assert_eq!(level(&limit, span, 100, &[5]), 15);
        let slow = Limit::new(1_000, "1/h".parse().unwrap()).unwrap();
        assert_eq!(supply(&slow, span), 1);
        let small = Limit::new(3, "1000/s".parse().unwrap()).unwrap();
        assert_eq!(level(&small, span, 500, &[]), 3, "never above the capacity");
    }
}
