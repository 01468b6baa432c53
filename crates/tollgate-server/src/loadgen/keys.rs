//! Which key each request carries: uniform, or skewed the way real traffic is.
//!
//! Real deployments see a few very hot subjects and a long tail; a uniform spread flatters a
//! store (no contention on one bucket), a skewed one shows what a hot key costs. Zipf is drawn
//! by inverting a precomputed cumulative distribution, so a draw is one uniform number and a
//! binary search, cheap next to a network round trip.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::args::Distribution;

/// The Zipf exponent of `--distribution zipf`: with 10,000 keys the hottest takes about 15%
/// of the requests and the top 1% of keys about two thirds.
pub(crate) const ZIPF_EXPONENT: f64 = 1.1;

/// Draws key indexes in `0..keys`; each worker owns one.
pub(crate) struct KeyPicker {
    rng: SmallRng,
    keys: u64,
    /// Zipf only: `cdf[k]` is the probability of a key at most `k`, rising to 1.
    cdf: Option<std::sync::Arc<[f64]>>,
}

/// The cumulative Zipf distribution over `keys` keys, shared by all workers.
pub(crate) fn zipf_cdf(keys: u64) -> std::sync::Arc<[f64]> {
    let mut total = 0.0;
    let mut cdf: Vec<f64> = (0..keys)
        .map(|k| {
            total += 1.0 / ((k + 1) as f64).powf(ZIPF_EXPONENT);
            total
        })
        .collect();
    for p in &mut cdf {
        *p /= total;
    }
    cdf.into()
}

impl KeyPicker {
    /// A picker for `distribution`; `cdf` is [`zipf_cdf`] for Zipf, shared between workers.
    pub(crate) fn new(
        distribution: Distribution,
        keys: u64,
        seed: u64,
        cdf: Option<std::sync::Arc<[f64]>>,
    ) -> Self {
        Self {
            rng: SmallRng::seed_from_u64(seed),
            keys,
            cdf: match distribution {
                Distribution::Uniform => None,
                Distribution::Zipf => cdf,
            },
        }
    }

    /// The next key index.
    pub(crate) fn next(&mut self) -> u64 {
        match &self.cdf {
            None => self.rng.random_range(0..self.keys),
            Some(cdf) => {
                let u: f64 = self.rng.random();
                // The first key whose cumulative probability reaches u; rounding can leave the
                // last entry a hair under 1, hence the clamp.
                let index = cdf.partition_point(|&p| p < u);
                (index as u64).min(self.keys - 1)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_stays_in_range_and_covers_it() {
        let mut picker = KeyPicker::new(Distribution::Uniform, 10, 1, None);
        let mut seen = [0u32; 10];
        for _ in 0..10_000 {
            let k = picker.next();
            assert!(k < 10);
            seen[k as usize] += 1;
        }
        assert!(seen.iter().all(|&n| n > 800), "{seen:?}");
    }

    #[test]
    fn zipf_is_skewed_towards_low_keys() {
        let keys = 10_000;
        let mut picker = KeyPicker::new(Distribution::Zipf, keys, 7, Some(zipf_cdf(keys)));
        let draws = 100_000;
        let mut hottest = 0;
        let mut top_percent = 0;
        for _ in 0..draws {
            let k = picker.next();
            assert!(k < keys);
            hottest += u32::from(k == 0);
            top_percent += u32::from(k < keys / 100);
        }
        let share = |n: u32| f64::from(n) / f64::from(draws);
        assert!((0.12..0.18).contains(&share(hottest)), "{}", share(hottest));
        assert!(share(top_percent) > 0.55, "{}", share(top_percent));
    }

    #[test]
    fn a_distribution_short_of_one_still_draws_keys_in_range() {
        // Rounding could leave the last entry of a long sum a hair under one: draws past it
        // go to the last key.
        let short: std::sync::Arc<[f64]> = [0.25, 0.5, 0.75].into();
        let mut picker = KeyPicker::new(Distribution::Zipf, 3, 11, Some(short));
        let mut seen = [0u32; 3];
        for _ in 0..1_000 {
            let k = picker.next();
            assert!(k < 3, "{k}");
            seen[k as usize] += 1;
        }
        // A quarter each below its entry, and the last key's quarter with the one past it.
        assert!(seen[2] > 400, "{seen:?}");
    }
}
