//! The bucket math and the memory store against the specification, written as the simplest
//! possible reference model: `(tokens, last)` with exact big rationals, step for step as SPEC §2
//! states it. Any disagreement in a decision, a balance or a duration is a bug in one of them.

use std::time::Duration;

use num_bigint::BigInt;
use num_rational::BigRational;
use proptest::prelude::*;
use tollgate::{BucketState, Limit, MemoryStore, Rate, Timestamp, bucket};

/// SPEC §2, literally.
struct Reference {
    capacity: BigRational,
    /// Tokens per nanosecond.
    rate: BigRational,
    tokens: BigRational,
    last: Option<u64>,
}

/// What the reference decided, in the units a `Decision` reports.
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

fn ceil_nanos(value: &BigRational) -> Duration {
    let nanos: u64 = value.ceil().to_integer().try_into().expect("fits in u64");
    Duration::from_nanos(nanos)
}

impl Reference {
    fn new(capacity: u64, amount: u64, period_ns: u64) -> Self {
        Self {
            capacity: int(capacity),
            rate: BigRational::new(BigInt::from(amount), BigInt::from(period_ns)),
            tokens: int(capacity),
            last: None,
        }
    }

    /// Steps 1 and 2: refill, clamp, never move `last` back.
    fn refill(&mut self, now: u64) {
        if let Some(last) = self.last {
            let elapsed = now.saturating_sub(last);
            let refilled = &self.tokens + int(elapsed) * &self.rate;
            self.tokens = refilled.min(self.capacity.clone());
        }
        self.last = Some(self.last.map_or(now, |last| last.max(now)));
    }

    /// Step 3: take or reject, charging nothing on rejection.
    fn check(&mut self, now: u64, cost: u64) -> Expected {
        self.refill(now);
        let cost = int(cost);
        let allowed = self.tokens >= cost;
        if allowed {
            self.tokens = &self.tokens - &cost;
        }
        Expected {
            allowed,
            remaining: self.tokens.floor().to_integer().try_into().expect("fits"),
            retry_after: (!allowed).then(|| ceil_nanos(&((&cost - &self.tokens) / &self.rate))),
            reset_after: ceil_nanos(&((&self.capacity - &self.tokens) / &self.rate)),
        }
    }
}

fn limit_strategy() -> impl Strategy<Value = (u64, u64, u64)> {
    let periods = prop::sample::select(vec![
        1u64,
        7,
        1_000,
        3_000_000,
        1_000_000_000,
        60_000_000_000,
        86_400_000_000_000,
    ]);
    (1u64..=50, 1u64..=40, periods, 1u64..=5)
        .prop_map(|(capacity, amount, unit, count)| (capacity, amount, unit * count))
}

/// Time steps scaled to the period, so traces exercise empty, partial and full buckets.
fn trace_strategy(period_ns: u64, capacity: u64) -> impl Strategy<Value = Vec<(u64, u64)>> {
    let step = (period_ns / 4).max(1);
    prop::collection::vec((0u64..=12, 0u64..=step, 1u64..=capacity), 1..80).prop_map(move |ops| {
        ops.into_iter()
            .map(|(coarse, fine, cost)| (coarse * step / 3 + fine * (coarse % 2), cost))
            .collect()
    })
}

/// `(capacity, amount, period_ns)`, a start time, and `(time step, cost)` operations.
type Case = ((u64, u64, u64), u64, Vec<(u64, u64)>);

fn case_strategy() -> impl Strategy<Value = Case> {
    limit_strategy().prop_flat_map(|(capacity, amount, period)| {
        (
            Just((capacity, amount, period)),
            0u64..=u64::from(u32::MAX),
            trace_strategy(period, capacity),
        )
    })
}

fn make_limit(capacity: u64, amount: u64, period_ns: u64) -> Limit {
    let rate = Rate::new(amount, Duration::from_nanos(period_ns)).expect("valid rate");
    Limit::new(capacity, rate).expect("valid limit")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    /// Same decisions and the same balances and durations as the rational model, step by step,
    /// for monotonic time.
    #[test]
    fn bucket_math_matches_the_reference(
        ((capacity, amount, period), start, trace) in case_strategy()
    ) {
        let limit = make_limit(capacity, amount, period);
        let mut reference = Reference::new(capacity, amount, period);
        let mut state: Option<BucketState> = None;
        let mut now = start;
        for (dt, cost) in trace {
            now += dt;
            let expected = reference.check(now, cost);
            let (decision, next) = bucket::take(&limit, state, Timestamp::from_nanos(now), cost)
                .expect("valid cost");
            if next.is_some() {
                state = next;
            }
            let actual = Expected {
                allowed: decision.allowed(),
                remaining: decision.remaining(),
                retry_after: decision.retry_after(),
                reset_after: decision.reset_after(),
            };
            prop_assert_eq!(actual, expected, "at {} ns, cost {}", now, cost);
        }
    }

    /// The memory store decides exactly like the math, on interleaved keys.
    #[test]
    fn memory_store_matches_the_reference(
        ((capacity, amount, period), start, trace) in case_strategy(),
        keys in prop::collection::vec(0u8..3, 80),
    ) {
        let limit = make_limit(capacity, amount, period);
        let store: MemoryStore<u8> = MemoryStore::builder().shards(2).build();
        let mut references: Vec<Reference> =
            (0..3).map(|_| Reference::new(capacity, amount, period)).collect();
        let mut now = start;
        for ((dt, cost), key) in trace.into_iter().zip(keys) {
            now += dt;
            let expected = references[usize::from(key)].check(now, cost);
            let decision = store
                .check(&key, &limit, cost, Timestamp::from_nanos(now))
                .expect("valid cost");
            prop_assert_eq!(decision.allowed(), expected.allowed);
            prop_assert_eq!(decision.remaining(), expected.remaining);
            prop_assert_eq!(decision.retry_after(), expected.retry_after);
        }
    }

    /// Over every interval [t_i, t_j] of a trace, the cost allowed is at most the balance at
    /// t_i plus the exact refill over t_j - t_i.
    #[test]
    fn interval_property(((capacity, amount, period), start, trace) in case_strategy()) {
        let limit = make_limit(capacity, amount, period);
        let mut reference = Reference::new(capacity, amount, period);
        let mut state: Option<BucketState> = None;
        let mut now = start;
        // (time, balance before the op after refill, cost allowed by tollgate)
        let mut ops: Vec<(u64, BigRational, u64)> = Vec::new();
        for (dt, cost) in trace {
            now += dt;
            reference.refill(now);
            let before = reference.tokens.clone();
            reference.check(now, cost);
            let (decision, next) = bucket::take(&limit, state, Timestamp::from_nanos(now), cost)
                .expect("valid cost");
            if next.is_some() {
                state = next;
            }
            ops.push((now, before, if decision.allowed() { cost } else { 0 }));
        }
        for i in 0..ops.len() {
            let mut allowed = 0u64;
            for j in i..ops.len() {
                allowed += ops[j].2;
                let bound = &ops[i].1 + int(ops[j].0 - ops[i].0) * &reference.rate;
                prop_assert!(int(allowed) <= bound, "ops {}..={}", i, j);
            }
        }
    }

    /// With time jumping backwards and forwards, no prefix of the trace is allowed more than a
    /// full bucket plus the refill up to the latest time seen: going back mints nothing.
    #[test]
    fn time_going_back_mints_nothing(
        (capacity, amount, period) in limit_strategy(),
        times in prop::collection::vec(0u64..1_000, 1..100),
        costs in prop::collection::vec(1u64..=50, 100),
    ) {
        let limit = make_limit(capacity, amount, period);
        let rate = BigRational::new(BigInt::from(amount), BigInt::from(period));
        let step = (period / 100).max(1);
        let mut state: Option<BucketState> = None;
        let first = times[0] * step;
        let mut latest = first;
        let mut allowed = 0u64;
        for (time, cost) in times.into_iter().zip(costs) {
            let now = time * step;
            let cost = cost.min(capacity);
            latest = latest.max(now);
            let (decision, next) = bucket::take(&limit, state, Timestamp::from_nanos(now), cost)
                .expect("valid cost");
            if let Some(next) = next {
                prop_assert!(state.is_none_or(|s| next.full_at() >= s.full_at()));
                state = Some(next);
            }
            if decision.allowed() {
                allowed += cost;
            }
            // Decided from before the last charge, the figures stay in range.
            prop_assert!(decision.remaining() <= capacity);
            let bound = int(capacity) + int(latest - first.min(latest)) * &rate;
            prop_assert!(int(allowed) <= bound);
        }
    }

    /// Reservations settled for less than they cost: a refund is `tokens = min(capacity,
    /// tokens + refund)` at the settlement's time, exactly, and every later decision agrees
    /// with the model; a second settlement of the same check gives nothing.
    #[test]
    fn settlements_match_the_reference(
        ((capacity, amount, period), start, trace) in case_strategy(),
        settles in prop::collection::vec((any::<bool>(), 0usize..8, 0u64..=4), 80),
    ) {
        let limit = make_limit(capacity, amount, period);
        // Long enough for every trace: a settlement is never too late here.
        let store: MemoryStore<u8> = MemoryStore::builder()
            .idempotency_window(Duration::from_secs(20 * 365 * 86_400))
            .build();
        let mut reference = Reference::new(capacity, amount, period);
        // Checks that charged: (request id, cost, the refund they were settled with).
        let mut charged: Vec<(String, u64, Option<u64>)> = Vec::new();
        let mut now = start;
        for (step, ((dt, cost), (settle, pick, quarters))) in
            trace.into_iter().zip(settles).enumerate()
        {
            now += dt;
            let at = Timestamp::from_nanos(now);
            if settle && !charged.is_empty() {
                let len = charged.len();
                let (id, cost, done) = &mut charged[pick % len];
                // Settled again with the same refund (another would be a conflict).
                let refund = done.unwrap_or(*cost * quarters / 4);
                let item = tollgate::Item { key: &0u8, limit: &limit, cost: *cost };
                let settled = store.settle(&[item], at, id, &[refund]).expect("valid");
                reference.refill(now);
                if done.is_some() {
                    prop_assert_eq!(settled.status, tollgate::SettleStatus::Repeated);
                } else {
                    prop_assert_eq!(settled.status, tollgate::SettleStatus::Settled);
                    reference.tokens = (&reference.tokens + int(refund)).min(reference.capacity.clone());
                    *done = Some(refund);
                }
                let remaining: u64 = reference.tokens.floor().to_integer().try_into().expect("fits");
                prop_assert_eq!(settled.decisions[0].remaining(), remaining, "at {} ns", now);
                continue;
            }
            let id = format!("r{step}");
            let expected = reference.check(now, cost);
            let decision = store.check_idempotent(&0u8, &limit, cost, at, &id).expect("valid");
            prop_assert_eq!(decision.allowed(), expected.allowed, "at {} ns", now);
            prop_assert_eq!(decision.remaining(), expected.remaining);
            prop_assert_eq!(decision.retry_after(), expected.retry_after);
            if decision.allowed() {
                charged.push((id, cost, None));
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    /// Tokens given back with no record (`give_back`) add exactly what is given to the
    /// reference's balance at their time, clamped at the capacity, and every later decision
    /// agrees with the model, as do the standings reported.
    #[test]
    fn tokens_given_back_match_the_reference(
        ((capacity, amount, period), start, trace) in case_strategy(),
        gives in prop::collection::vec((any::<bool>(), 1u64..=60), 80),
    ) {
        let limit = make_limit(capacity, amount, period);
        let store: MemoryStore<u8> = MemoryStore::default();
        let mut reference = Reference::new(capacity, amount, period);
        let mut now = start;
        for ((dt, cost), (give, tokens)) in trace.into_iter().zip(gives) {
            now += dt;
            let at = Timestamp::from_nanos(now);
            if give {
                let tokens = tokens.min(capacity);
                let item = tollgate::Item { key: &0u8, limit: &limit, cost: tokens };
                let given = store.give_back(&[item], at).expect("valid");
                reference.refill(now);
                reference.tokens = (&reference.tokens + int(tokens)).min(reference.capacity.clone());
                let remaining: u64 = reference.tokens.floor().to_integer().try_into().expect("fits");
                prop_assert!(given[0].allowed());
                prop_assert_eq!(given[0].remaining(), remaining, "at {} ns", now);
                continue;
            }
            let expected = reference.check(now, cost);
            let decision = store.check(&0u8, &limit, cost, at).expect("valid");
            prop_assert_eq!(decision.allowed(), expected.allowed, "at {} ns", now);
            prop_assert_eq!(decision.remaining(), expected.remaining);
            prop_assert_eq!(decision.retry_after(), expected.retry_after);
            prop_assert_eq!(decision.reset_after(), expected.reset_after);
        }
    }
}

#[test]
fn extreme_rates_match_the_reference() {
    // Rates at both ends of the supported range, with awkward (coprime) amounts.
    let cases = [
        (1, 1, 86_400_000_000_000),
        (7, 1, 86_400_000_000_000),
        (1_000_000_000, 1_000_000_000, 1_000_000_000),
        (3, 999_999_937, 1_000_000_000),
        (50_000, 1, 86_400_000_000_000),
        (10, 4_294_967_295, 1),
    ];
    for (capacity, amount, period) in cases {
        let limit = make_limit(capacity, amount, period);
        let mut reference = Reference::new(capacity, amount, period);
        let mut state = None;
        let mut now = 0u64;
        for i in 0..2_000u64 {
            now += (i * 7919) % (period / 3 + 2);
            let cost = 1 + (i * 31) % capacity.min(1_000);
            let expected = reference.check(now, cost);
            let (decision, next) =
                bucket::take(&limit, state, Timestamp::from_nanos(now), cost).expect("valid cost");
            if next.is_some() {
                state = next;
            }
            assert_eq!(
                decision.allowed(),
                expected.allowed,
                "{capacity} {amount}/{period}ns"
            );
            assert_eq!(decision.remaining(), expected.remaining);
            assert_eq!(decision.retry_after(), expected.retry_after);
            assert_eq!(decision.reset_after(), expected.reset_after);
        }
    }
}

#[test]
fn a_decade_of_steady_traffic_does_not_drift() {
    // 3 tokens a second into a bucket of two million, drained at 0, then a million tokens taken
    // at the exact nanosecond each million has arrived, for ten years of simulated time. The
    // bucket never caps, so any rounding carried from step to step would show up as a check
    // that fails on time or passes a nanosecond early.
    let n = 1_000_000u64;
    let limit = make_limit(2 * n, 3, 1_000_000_000);
    let (_, mut state) = bucket::take(&limit, None, Timestamp::ZERO, 2 * n).expect("valid");
    for k in 1..=950u64 {
        let due = (u128::from(k * n) * 1_000_000_000).div_ceil(3) as u64;
        let early = bucket::peek(&limit, state, Timestamp::from_nanos(due - 1), n).expect("valid");
        assert!(!early.allowed(), "step {k} passed early");
        assert_eq!(
            early.retry_after(),
            Some(Duration::from_nanos(1)),
            "step {k}"
        );
        let (on_time, next) =
            bucket::take(&limit, state, Timestamp::from_nanos(due), n).expect("valid");
        assert!(on_time.allowed(), "step {k} failed on time");
        state = next;
    }
}
