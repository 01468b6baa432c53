//! The fixed and sliding windows against the simplest reference model: a log of what each
//! window admitted, weighed with exact rationals, and `retry_after` and `reset_after` found by
//! trying every later millisecond rather than by formula. Any disagreement in a decision, a
//! count or a duration is a bug in one of them.

use std::collections::BTreeMap;
use std::time::Duration;

use num_bigint::BigInt;
use num_rational::BigRational;
use proptest::prelude::*;
use tollgate::{Algorithm, Limit, MemoryStore, Timestamp, bucket};

const MS: u64 = 1_000_000;

/// SPEC §3's windows, literally: what each window admitted, nothing else.
struct Reference {
    sliding: bool,
    limit: u64,
    window_ms: u64,
    admitted: BTreeMap<u64, u64>,
}

#[derive(Debug, PartialEq)]
struct Expected {
    allowed: bool,
    remaining: u64,
    retry_after: Option<Duration>,
    reset_after: Duration,
}

fn int(value: u64) -> BigRational {
    BigRational::from_integer(BigInt::from(value))
}

impl Reference {
    /// What the windows count at millisecond `at` (weighted, for a sliding window).
    fn used(&self, at: u64) -> BigRational {
        let window = at / self.window_ms;
        let cur = int(self.admitted.get(&window).copied().unwrap_or(0));
        if !self.sliding || window == 0 {
            return cur;
        }
        let prev = self.admitted.get(&(window - 1)).copied().unwrap_or(0);
        let elapsed = at - window * self.window_ms;
        cur + int(prev)
            * BigRational::new(
                BigInt::from(self.window_ms - elapsed),
                BigInt::from(self.window_ms),
            )
    }

    /// The millisecond a request at `now` is decided at: its own, or, when a later window has
    /// admitted something (the clock went back), that window's first.
    fn position(&self, now: u64) -> u64 {
        let latest = self.admitted.keys().next_back().copied().unwrap_or(0);
        (now / MS).max(latest * self.window_ms)
    }

    fn fits(&self, at: u64, cost: u64) -> bool {
        self.used(at) + int(cost) <= int(self.limit)
    }

    fn check(&mut self, now: u64, cost: u64) -> Expected {
        let at = self.position(now);
        let allowed = self.fits(at, cost);
        if allowed {
            *self.admitted.entry(at / self.window_ms).or_default() += cost;
        }
        let since = |ms: u64| Duration::from_nanos(ms * MS - now.min(ms * MS));
        let retry_after = (!allowed).then(|| {
            let ms = (at + 1..)
                .find(|&ms| self.fits(ms, cost))
                .expect("the window after next admits any cost up to the limit");
            since(ms)
        });
        let zero = int(0);
        let reset_after = if self.used(at) == zero {
            Duration::ZERO
        } else {
            since(
                (at + 1..)
                    .find(|&ms| self.used(ms) == zero)
                    .expect("empties"),
            )
        };
        let remaining = (int(self.limit) - self.used(at)).max(zero).floor();
        Expected {
            allowed,
            remaining: remaining.to_integer().try_into().expect("fits"),
            retry_after,
            reset_after,
        }
    }
}

fn limit_of(sliding: bool, limit: u64, window_ms: u64) -> Limit {
    let window = Duration::from_millis(window_ms);
    let made = if sliding {
        Limit::sliding_window(limit, window)
    } else {
        Limit::fixed_window(limit, window)
    };
    made.expect("valid window limit")
}

fn scenario() -> impl Strategy<Value = (bool, u64, u64, Vec<(u64, u64)>)> {
    (
        any::<bool>(),
        1u64..=12,
        prop::sample::select(vec![1u64, 2, 5, 10, 40]),
    )
        .prop_flat_map(|(sliding, limit, window_ms)| {
            // Steps of up to three windows, sometimes backwards (a clock read before another's).
            let step = (
                prop_oneof![
                    4 => 0..=3 * window_ms * MS,
                    1 => Just(0u64),
                ],
                any::<bool>(),
                1..=limit,
            );
            (
                Just(sliding),
                Just(limit),
                Just(window_ms),
                prop::collection::vec(step, 1..60).prop_map(move |steps| {
                    let mut now: u64 = 10 * window_ms * MS;
                    steps
                        .into_iter()
                        .map(|(delta, back, cost)| {
                            now = if back && delta % 5 == 0 {
                                now.saturating_sub(delta / 2)
                            } else {
                                now + delta
                            };
                            (now, cost)
                        })
                        .collect()
                }),
            )
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// The window math and the memory store decide every step as the reference does.
    #[test]
    fn windows_match_the_reference((sliding, n, window_ms, steps) in scenario()) {
        let limit = limit_of(sliding, n, window_ms);
        let mut reference = Reference {
            sliding,
            limit: n,
            window_ms,
            admitted: BTreeMap::new(),
        };
        let store: MemoryStore<u64> = MemoryStore::default();
        let mut state = None;
        for (i, &(now, cost)) in steps.iter().enumerate() {
            let expected = reference.check(now, cost);
            let (decision, next) = bucket::take(&limit, state, Timestamp::from_nanos(now), cost)
                .expect("valid cost");
            if next.is_some() {
                state = next;
            }
            let got = Expected {
                allowed: decision.allowed(),
                remaining: decision.remaining(),
                retry_after: decision.retry_after(),
                reset_after: decision.reset_after(),
            };
            prop_assert_eq!(&got, &expected, "step {} at {} ns, cost {}", i, now, cost);
            let stored = store
                .check(&7, &limit, cost, Timestamp::from_nanos(now))
                .expect("valid cost");
            prop_assert_eq!(stored, decision, "memory store, step {}", i);
        }
    }

    /// Tokens given back with no record come off the count of the latest window anything
    /// was admitted in (once that is empty, a sliding window's previous one), never below 0,
    /// as the reference takes them off its log of windows; every decision afterwards agrees
    /// with it.
    #[test]
    fn tokens_given_back_come_off_the_latest_window(
        (sliding, n, window_ms, steps) in scenario(),
        gives in prop::collection::vec(any::<bool>(), 60),
    ) {
        let limit = limit_of(sliding, n, window_ms);
        let mut reference = Reference {
            sliding,
            limit: n,
            window_ms,
            admitted: BTreeMap::new(),
        };
        let store: MemoryStore<u64> = MemoryStore::default();
        for (i, (&(now, cost), give)) in steps.iter().zip(gives).enumerate() {
            let at = Timestamp::from_nanos(now);
            if give {
                let item = tollgate::Item { key: &7, limit: &limit, cost };
                let given = store.give_back(&[item], at).expect("valid cost");
                // Off the latest window's count; when that is empty, a sliding window's count
                // of the window before it (the two it keeps).
                if let Some((&latest, &count)) = reference.admitted.last_key_value() {
                    let from = if count == 0 && sliding {
                        latest.checked_sub(1)
                    } else {
                        Some(latest)
                    };
                    if let Some(count) = from.and_then(|w| reference.admitted.get_mut(&w)) {
                        *count -= cost.min(*count);
                    }
                }
                let used = reference.used(reference.position(now));
                let remaining = (int(n) - used).max(int(0)).floor();
                let remaining: u64 = remaining.to_integer().try_into().expect("fits");
                prop_assert!(given[0].allowed());
                prop_assert_eq!(given[0].remaining(), remaining, "step {} at {} ns", i, now);
                continue;
            }
            let expected = reference.check(now, cost);
            let decision = store.check(&7, &limit, cost, at).expect("valid cost");
            let got = Expected {
                allowed: decision.allowed(),
                remaining: decision.remaining(),
                retry_after: decision.retry_after(),
                reset_after: decision.reset_after(),
            };
            prop_assert_eq!(&got, &expected, "step {} at {} ns, cost {}", i, now, cost);
        }
    }

    /// A window never admits more than its limit: per window for a fixed one, and for a
    /// sliding one, in any span of one window's length counted the way it weighs.
    #[test]
    fn windows_never_admit_past_the_limit((sliding, n, window_ms, steps) in scenario()) {
        let limit = limit_of(sliding, n, window_ms);
        prop_assert_eq!(
            limit.algorithm(),
            if sliding { Algorithm::SlidingWindow } else { Algorithm::FixedWindow }
        );
        let mut per_window: BTreeMap<u64, u64> = BTreeMap::new();
        let mut state = None;
        for &(now, cost) in &steps {
            let (decision, next) = bucket::take(&limit, state, Timestamp::from_nanos(now), cost)
                .expect("valid cost");
            if let Some(next) = next {
                state = Some(next);
                prop_assert!(decision.allowed());
                let window = next.full_at().as_nanos() / (window_ms * MS);
                *per_window.entry(window).or_default() += cost;
            }
        }
        for (&window, &count) in &per_window {
            prop_assert!(count <= n, "window {} admitted {} of {}", window, count, n);
            if sliding {
                // Two adjacent windows hold at most twice the limit, and the previous one
                // weighs at least 1/W of its count at the next one's last millisecond.
                let next = per_window.get(&(window + 1)).copied().unwrap_or(0);
                prop_assert!(count + next <= 2 * n);
            }
        }
    }
}

#[test]
fn window_limits_refuse_what_they_cannot_hold() {
    use tollgate::Error;
    let second = Duration::from_secs(1);
    assert!(matches!(
        Limit::fixed_window(0, second),
        Err(Error::ZeroCapacity)
    ));
    for window in [
        Duration::ZERO,
        Duration::from_micros(1500),
        Duration::from_nanos(1),
    ] {
        assert!(matches!(
            Limit::sliding_window(1, window),
            Err(Error::InvalidWindow { .. })
        ));
    }
    assert!(matches!(
        Limit::fixed_window(1 << 32, Duration::from_secs(3600)),
        Err(Error::InvalidWindow { .. })
    ));
    assert!(matches!(
        Limit::fixed_window(1_000_000, Duration::from_millis(1)),
        Err(Error::InvalidWindow { .. })
    ));
    // 2^53 / 86_400_000 ms: about 104 million a day at most.
    assert!(Limit::sliding_window(104_000_000, Duration::from_secs(86_400)).is_ok());
    assert!(matches!(
        Limit::sliding_window(105_000_000, Duration::from_secs(86_400)),
        Err(Error::InvalidWindow { .. })
    ));
    assert!(matches!(
        Limit::fixed_window(1, Duration::from_secs(1 << 40)),
        Err(Error::LimitTooLarge)
    ));
    let limit = Limit::fixed_window(100, Duration::from_secs(60)).unwrap();
    assert_eq!(limit.to_string(), "fixed_window limit 100 window 1m");
    assert_eq!(limit.time_to_full(), Duration::from_secs(60));
    let limit = Limit::sliding_window(5, Duration::from_millis(1500)).unwrap();
    assert_eq!(limit.to_string(), "sliding_window limit 5 window 1500ms");
    assert_eq!(limit.time_to_full(), Duration::from_secs(3));
    assert!(
        bucket::take(&limit, None, Timestamp::ZERO, 6).is_err(),
        "a cost above the limit is an error, not a rejection"
    );
}
