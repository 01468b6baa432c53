//! The sliding log against the simplest reference model: every request admitted, one by one,
//! with the millisecond it was decided at, counted with no shortcut (no merging, no pruning),
//! and `retry_after` and `reset_after` found by trying every later millisecond rather than by
//! formula. Any disagreement in a decision, a count, a duration or a settlement is a bug in one
//! of them.

use std::time::Duration;

use proptest::prelude::*;
use tollgate::{Error, Item, Limit, MemoryStore, SettleStatus, Timestamp};

const MS: u64 = 1_000_000;

/// SPEC §3's exact sliding window, literally.
struct Reference {
    limit: u64,
    window_ms: u64,
    /// (millisecond decided at, cost still charged) of each admitted request.
    admitted: Vec<(u64, u64)>,
}

#[derive(Debug, PartialEq)]
struct Expected {
    allowed: bool,
    remaining: u64,
    retry_after: Option<Duration>,
    reset_after: Duration,
}

impl Reference {
    /// What the log counts at millisecond `at`: the requests of the window that ends there.
    fn used(&self, at: u64) -> u64 {
        self.admitted
            .iter()
            .filter(|&&(ms, _)| ms + self.window_ms > at && ms <= at)
            .map(|&(_, cost)| cost)
            .sum()
    }

    /// The millisecond a request at `now` is decided at: its own, or the latest one a request
    /// was admitted at when that is later (the clock went back).
    fn position(&self, now: u64) -> u64 {
        let latest = self.admitted.iter().map(|&(ms, _)| ms).max().unwrap_or(0);
        (now / MS).max(latest)
    }

    /// What the requests admitted at millisecond `ms` still charge.
    fn charged_at(&self, ms: u64) -> u64 {
        self.admitted
            .iter()
            .filter(|&&(at, _)| at == ms)
            .map(|&(_, cost)| cost)
            .sum()
    }

    /// Takes `tokens` off what the requests admitted at millisecond `ms` still charge, never
    /// below 0: off request `first` before the others, when given. A log keeps one entry per
    /// millisecond, so only their sum counts: tokens given back with no record may have taken
    /// some of a request's cost before its settlement does.
    fn take_off(&mut self, ms: u64, tokens: u64, first: Option<usize>) {
        let mut left = tokens;
        let order = first.into_iter().chain(0..self.admitted.len());
        for index in order {
            let (at, cost) = &mut self.admitted[index];
            if *at == ms {
                let back = left.min(*cost);
                *cost -= back;
                left -= back;
            }
        }
    }

    /// Decides `cost` at `now`; the index of the request when admitted.
    fn check(&mut self, now: u64, cost: u64) -> (Expected, Option<usize>) {
        let at = self.position(now);
        let allowed = self.used(at) + cost <= self.limit;
        if allowed {
            self.admitted.push((at, cost));
        }
        let since = |ms: u64| Duration::from_nanos(ms * MS - now.min(ms * MS));
        let retry_after = (!allowed).then(|| {
            let ms = (at + 1..)
                .find(|&ms| self.used(ms) + cost <= self.limit)
                .expect("a window later, every request has stopped counting");
            since(ms)
        });
        let reset_after = if self.used(at) == 0 {
            Duration::ZERO
        } else {
            since((at + 1..).find(|&ms| self.used(ms) == 0).expect("empties"))
        };
        let expected = Expected {
            allowed,
            remaining: self.limit - self.used(at),
            retry_after,
            reset_after,
        };
        (expected, allowed.then(|| self.admitted.len() - 1))
    }
}

#[derive(Debug, Clone)]
enum Step {
    /// A check of `cost` at `now`.
    Check { now: u64, cost: u64 },
    /// The settlement of the `pick`-th admitted request so far (modulo their number), giving
    /// back `share` (modulo its cost plus one).
    Settle { pick: usize, share: u64 },
    /// `tokens` given back with no record at `now`: off the latest millisecond's requests.
    GiveBack { now: u64, tokens: u64 },
}

fn scenario() -> impl Strategy<Value = (u64, u64, Vec<Step>)> {
    (1u64..=12, prop::sample::select(vec![1u64, 2, 5, 10, 40])).prop_flat_map(
        |(limit, window_ms)| {
            // Steps of up to two windows, sometimes backwards (a clock read before another's).
            let step = (
                prop_oneof![
                    4 => 0..=2 * window_ms * MS,
                    1 => Just(0u64),
                ],
                any::<bool>(),
                1..=limit,
                prop::option::weighted(0.15, (any::<usize>(), any::<u64>())),
                prop::option::weighted(0.15, 1..=limit),
            );
            (
                Just(limit),
                Just(window_ms),
                prop::collection::vec(step, 1..60).prop_map(move |steps| {
                    let mut now: u64 = 10 * window_ms * MS;
                    steps
                        .into_iter()
                        .map(|(delta, back, cost, settle, give)| {
                            now = if back && delta % 5 == 0 {
                                now.saturating_sub(delta / 2)
                            } else {
                                now + delta
                            };
                            match (settle, give) {
                                (Some((pick, share)), _) => Step::Settle { pick, share },
                                (None, Some(tokens)) => Step::GiveBack { now, tokens },
                                (None, None) => Step::Check { now, cost },
                            }
                        })
                        .collect()
                }),
            )
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// The memory store decides every check and gives back every settlement and every
    /// unrecorded return of tokens as the reference does, and never admits more than the limit
    /// in any window.
    #[test]
    fn logs_match_the_reference((n, window_ms, steps) in scenario()) {
        let limit = Limit::sliding_log(n, Duration::from_millis(window_ms)).expect("valid");
        let mut reference = Reference { limit: n, window_ms, admitted: Vec::new() };
        let store: MemoryStore<u64> = MemoryStore::default();
        // Admitted requests: (id, cost, time of the check, settled).
        let mut charged: Vec<(String, u64, u64, bool)> = Vec::new();
        let mut now = 0;
        for (i, step) in steps.iter().enumerate() {
            match *step {
                Step::Check { now: at, cost } => {
                    now = at;
                    let (expected, admitted) = reference.check(now, cost);
                    let id = format!("r{i}");
                    let decision = store
                        .check_idempotent(&7, &limit, cost, Timestamp::from_nanos(now), &id)
                        .expect("valid cost");
                    let got = Expected {
                        allowed: decision.allowed(),
                        remaining: decision.remaining(),
                        retry_after: decision.retry_after(),
                        reset_after: decision.reset_after(),
                    };
                    prop_assert_eq!(&got, &expected, "step {} at {} ns, cost {}", i, now, cost);
                    if admitted.is_some() {
                        charged.push((id, cost, now, false));
                    }
                }
                Step::GiveBack { now: at, tokens } => {
                    now = at;
                    let item = Item { key: &7u64, limit: &limit, cost: tokens };
                    let given = store
                        .give_back(&[item], Timestamp::from_nanos(now))
                        .expect("valid cost");
                    // Off the requests of the latest millisecond whose requests still charge
                    // anything.
                    let latest = reference
                        .admitted
                        .iter()
                        .filter(|&&(ms, _)| reference.charged_at(ms) > 0)
                        .map(|&(ms, _)| ms)
                        .max();
                    if let Some(latest) = latest {
                        reference.take_off(latest, tokens, None);
                    }
                    let at = reference.position(now);
                    prop_assert!(given[0].allowed());
                    prop_assert_eq!(
                        given[0].remaining(),
                        n - reference.used(at),
                        "standing after the tokens given back at step {}", i
                    );
                }
                Step::Settle { pick, share } => {
                    if charged.is_empty() {
                        continue;
                    }
                    let index = pick % charged.len();
                    let (id, cost, _, settled) = &mut charged[index];
                    let refund = share % (*cost + 1);
                    let items = [Item { key: &7u64, limit: &limit, cost: *cost }];
                    let result = store.settle(&items, Timestamp::from_nanos(now), id, &[refund]);
                    if *settled {
                        // Settled before: the same refunds repeat, others conflict.
                        let repeated = matches!(&result, Ok(s) if s.status == SettleStatus::Repeated);
                        let conflict = matches!(result, Err(Error::IdempotencyConflict));
                        prop_assert!(repeated || conflict, "step {}: {:?}", i, result);
                        continue;
                    }
                    let settlement = result.expect("a valid settlement");
                    prop_assert_eq!(settlement.status, SettleStatus::Settled, "step {}", i);
                    *settled = true;
                    let ms = reference.admitted[index].0;
                    reference.take_off(ms, refund, Some(index));
                    let at = reference.position(now);
                    prop_assert_eq!(
                        settlement.decisions[0].remaining(),
                        n - reference.used(at),
                        "standing after the settlement of step {}", i
                    );
                }
            }
        }
        // In every window of W milliseconds, what was admitted (and not given back) fits.
        for &(end, _) in &reference.admitted {
            prop_assert!(reference.used(end) <= n, "window ending at {} ms", end);
        }
    }
}

#[test]
fn log_limits_refuse_what_they_cannot_hold() {
    use tollgate::MAX_LOG_LIMIT;
    let minute = Duration::from_secs(60);
    assert!(Limit::sliding_log(MAX_LOG_LIMIT, minute).is_ok());
    assert!(matches!(
        Limit::sliding_log(MAX_LOG_LIMIT + 1, minute),
        Err(Error::InvalidWindow { .. })
    ));
    assert!(matches!(
        Limit::sliding_log(0, minute),
        Err(Error::ZeroCapacity)
    ));
    assert!(matches!(
        Limit::sliding_log(5, Duration::from_micros(1500)),
        Err(Error::InvalidWindow { .. })
    ));
    let limit = Limit::sliding_log(100, minute).unwrap();
    assert_eq!(limit.to_string(), "sliding_log limit 100 window 1m");
    assert_eq!(limit.time_to_full(), minute);
    assert_eq!(limit.window(), Some(minute));
    // A log is no bucket state: the bucket functions refuse it rather than guess.
    assert!(matches!(
        tollgate::bucket::take(&limit, None, Timestamp::ZERO, 1),
        Err(Error::UnsupportedLimit { .. })
    ));
    let store: MemoryStore<u64> = MemoryStore::default();
    assert!(matches!(
        store.check(&1, &limit, 101, Timestamp::ZERO),
        Err(Error::InvalidCost { .. })
    ));
}
