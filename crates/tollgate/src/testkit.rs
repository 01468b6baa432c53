//! One conformance suite for every [`Store`]: the same random trace, with caller-supplied
//! time, must give exactly the decisions the memory store gives.
//!
//! The memory store is the reference because its math is checked against the exact rational
//! models (`tests/bucket_model.rs`, `tests/window_model.rs`); any other store is then held to
//! it here, decision for decision, including balances, retry times, all-or-nothing rejections,
//! idempotent retries, settlements (refunds of charged requests, repeated or conflicting),
//! tokens given back with no record, resets and refused costs, for token buckets, fixed and sliding windows, sliding logs, and requests mixing
//! them. Enabled by the `testkit` feature, for other crates' tests.

use std::collections::BTreeSet;
use std::fmt;
use std::time::Duration;

use crate::clock::{ManualClock, Timestamp};
use crate::decision::Decision;
use crate::error::Error;
use crate::limit::{Algorithm, Limit, Rate};
use crate::store::{CheckRequest, LocalStore, Settlement, Store, Take};

/// Where a store under test parted from the memory store.
#[derive(Debug)]
pub struct Mismatch {
    /// The step of the trace.
    pub step: usize,
    /// The request, in words.
    pub request: String,
    /// What the memory store answered.
    pub expected: Result<Vec<Decision>, Error>,
    /// What the store under test answered.
    pub actual: Result<Vec<Decision>, Error>,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "step {}: {}\n  memory: {:?}\n  store:  {:?}",
            self.step, self.request, self.expected, self.actual
        )
    }
}

/// What a trace looks like.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Trace {
    /// Seeds the trace; the same seed gives the same trace.
    pub seed: u64,
    /// Requests in the trace.
    pub steps: usize,
    /// Distinct subjects; each has one bucket per limit it uses.
    pub subjects: usize,
    /// Prefixed to every key, so traces against a shared server do not meet old state.
    pub prefix: String,
    /// The time of the first request. Steps move it by whole microseconds, the resolution of
    /// stores that keep time in microseconds (Redis). A request on windows alone is sometimes
    /// timed a few nanoseconds past its step's microsecond: a window is read to the
    /// millisecond, and its waits are exact to the nanosecond in every store (a token bucket
    /// between two microseconds is decided conservatively by such stores, not identically).
    pub start: Timestamp,
    /// Whether keys carry a per-subject `{hash tag}`. Without one, the buckets of a
    /// multi-bucket request land in different cluster slots.
    pub hash_tags: bool,
    /// Whether the time now and then steps back (a clock gone back: it must mint nothing).
    /// Before a request timed before the latest time seen, the buckets the trace touched that
    /// are full at that latest time are reset in both stores (see [`compare_with_memory`]), so
    /// a store compared with steps back must offer [`Store::reset`].
    /// A store that charges and then refunds (a cluster, across slots) cannot put a bucket's
    /// state back as it was before the charge: a refunded token bucket is as full as it was at
    /// the charge's time, and a refunded window keeps its state in the window charged. A later
    /// request from an earlier time may then be decided otherwise than by the memory store,
    /// which never charged: compare such stores without steps back.
    pub steps_back: bool,
    /// Only limits of this algorithm, when set, and no step longer than a second. A trace over
    /// every kind spreads its requests over a key per subject and limit, and steps a minute
    /// now and then: a key is mostly asked again after its state stopped counting, so a kind
    /// whose states count briefly (a log's entries) is rarely seen full, rejecting, or given
    /// back to while its charge still counts. Focused, the same keys meet while they count.
    pub only: Option<Algorithm>,
    /// Whether the buckets of a request are now and then reset first ([`Store::reset`]), in
    /// both stores. Off by default: a store may not offer resets.
    pub resets: bool,
    /// Whether tokens are now and then given back to a request's buckets after its check
    /// ([`Store::give_back`]), in both stores. Off by default: a store may not offer it.
    pub gives_back: bool,
}

impl Trace {
    /// A trace of `steps` requests over a few subjects, keys prefixed with `prefix`.
    pub fn new(seed: u64, steps: usize, prefix: impl Into<String>) -> Self {
        Self {
            seed,
            steps,
            subjects: 4,
            prefix: prefix.into(),
            start: Timestamp::from_nanos(1_700_000_000_000_000_000),
            hash_tags: true,
            steps_back: true,
            only: None,
            resets: false,
            gives_back: false,
        }
    }

    /// The same trace with or without tokens given back (see [`Trace::gives_back`]).
    pub fn gives_back(mut self, on: bool) -> Self {
        self.gives_back = on;
        self
    }

    /// The same trace with or without resets of the buckets a request names (see
    /// [`Trace::resets`]).
    pub fn resets(mut self, on: bool) -> Self {
        self.resets = on;
        self
    }

    /// The same trace with or without hash tags.
    pub fn hash_tags(mut self, on: bool) -> Self {
        self.hash_tags = on;
        self
    }

    /// The same trace with or without steps back in time.
    pub fn steps_back(mut self, on: bool) -> Self {
        self.steps_back = on;
        self
    }

    /// The trace on limits of `algorithm` alone, with short steps (see [`Trace::only`]).
    pub fn only(mut self, algorithm: Algorithm) -> Self {
        self.only = Some(algorithm);
        self
    }
}

/// Token buckets with awkward rates (reduced amounts above one, long and short periods), then
/// windows: short ones that the trace's steps cross often (a sliding window of 1 ms weighs its
/// previous window whole), and long ones whose counts last; then sliding logs, short and long.
fn limits() -> Vec<Limit> {
    let make = |capacity, amount, period_us: u64| {
        Rate::new(amount, Duration::from_micros(period_us))
            .and_then(|rate| Limit::new(capacity, rate))
    };
    let ms = Duration::from_millis;
    [
        make(5, 5, 1_000_000),
        make(10, 3, 1_000_000),
        make(3, 7, 100_000),
        make(2, 1, 60_000_000),
        make(50, 1_000, 1_000_000),
        make(4, 9, 7),
        Limit::fixed_window(3, ms(1)),
        Limit::sliding_window(4, ms(1)),
        Limit::sliding_window(5, ms(7)),
        Limit::fixed_window(10, ms(50)),
        Limit::sliding_window(6, ms(20)),
        Limit::fixed_window(2, ms(1_000)),
        Limit::sliding_window(10, ms(1_000)),
        Limit::sliding_log(3, ms(1)),
        Limit::sliding_log(5, ms(20)),
        Limit::sliding_log(8, ms(1_000)),
    ]
    .into_iter()
    .filter_map(Result::ok)
    .collect()
}

/// xorshift64*: deterministic and dependency-free; quality is not a concern here.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// One bucket of a generated request: (subject, limit index, cost).
type Spec = (usize, usize, u64);

/// Runs `trace` through `store` and through a fresh memory store, and returns the first
/// difference.
///
/// A store may forget a bucket once it is full (lossless expiry), and when it does is its own
/// affair: the memory store drops full buckets as its tables grow, Redis when their keys
/// expire. A forgotten bucket reads as new, as a kept one reads at every time from then on;
/// at an earlier time (a clock gone back) a kept one may read fewer tokens, and SPEC §2 allows
/// both answers. So that the comparison stays exact, before each request timed before the
/// latest time seen both stores forget alike: every bucket the trace touched that is full at
/// that time (and so may have been dropped by either) is reset in both.
///
/// # Errors
///
/// The first [`Mismatch`].
pub async fn compare_with_memory<S: Store>(store: &S, trace: &Trace) -> Result<(), Box<Mismatch>> {
    let reference = LocalStore::new(ManualClock::new());
    let limits: Vec<Limit> = limits()
        .into_iter()
        .filter(|limit| trace.only.is_none_or(|only| limit.algorithm() == only))
        .collect();
    if limits.is_empty() {
        return Ok(());
    }
    let mut rng = Rng(trace.seed | 1);
    let mut now = trace.start;
    let all_steps_us = [
        0u64, 0, 1, 3, 137, 500, 1_000, 2_500, 10_000, 100_000, 333_333, 1_000_000, 70_000_000,
    ];
    let steps_us = match trace.only {
        Some(_) => &all_steps_us[..all_steps_us.len() - 1],
        None => &all_steps_us[..],
    };
    let back_us = [1u64, 137, 1_000, 7_000, 250_000];
    // The latest time of any request so far, and the keys requests named since both stores
    // last forgot them.
    let mut latest = trace.start;
    let mut touched: BTreeSet<String> = BTreeSet::new();
    // Requests that charged, by id, to retry or settle later: (id, [(subject, limit, cost)],
    // the refunds of its last settlement).
    let mut recent: Vec<(String, Vec<Spec>, Vec<u64>)> = Vec::new();
    for step in 0..trace.steps {
        if trace.steps_back && rng.below(16) == 0 {
            let back = back_us[rng.below(back_us.len() as u64) as usize];
            now = Timestamp::from_nanos(now.as_nanos().saturating_sub(back * 1_000));
        } else {
            now = now + Duration::from_micros(steps_us[rng.below(steps_us.len() as u64) as usize]);
        }
        let mut takes_spec: Vec<Spec> = Vec::new();
        // As many as there are limits, at most (a request names each bucket once).
        let buckets = match rng.below(10) {
            0..=6 => 1,
            7 | 8 => 2,
            _ => 3,
        }
        .min(limits.len());
        let subject = rng.below(trace.subjects as u64) as usize;
        while takes_spec.len() < buckets {
            let limit = rng.below(limits.len() as u64) as usize;
            if takes_spec.iter().any(|&(_, l, _)| l == limit) {
                continue;
            }
            let capacity = limits[limit].capacity();
            let cost = match rng.below(20) {
                0 => 0,
                1 => capacity + 1,
                2..=5 => capacity,
                6..=8 => 1 + rng.below(capacity),
                _ => 1 + rng.below(capacity.min(3)),
            };
            takes_spec.push((subject, limit, cost));
        }
        let mut request_id = None;
        match rng.below(10) {
            0 => request_id = Some(format!("{}-req-{step}", trace.prefix)),
            1 if !recent.is_empty() => {
                // Retry an earlier request, usually unchanged. Changed, its id is reused for
                // another request (a client's bug), which stores may tell apart differently
                // when the buckets spread over cluster slots: the memory store looks for the
                // id under the first bucket only, a cluster in every slot the request touches
                // (so it can answer a conflict where the memory store decides anew). Without
                // hash tags a retry is therefore always the request itself.
                let (id, spec, _) = &recent[rng.below(recent.len() as u64) as usize];
                request_id = Some(id.clone());
                if rng.below(4) != 0 || !trace.hash_tags {
                    takes_spec.clone_from(spec);
                }
            }
            _ => {}
        }
        let keys = keys_of(trace, &takes_spec);
        // Now and then, the request's buckets reset first: afterwards every decision must
        // agree again, for every kind of bucket.
        if trace.resets && rng.below(24) == 0 {
            let reset: Vec<&str> = keys.iter().map(String::as_str).collect();
            reset_both(&reference, store, &reset, step, String::new()).await?;
        }
        let takes: Vec<Take<'_>> = takes_spec
            .iter()
            .zip(&keys)
            .map(|(&(_, limit, cost), key)| Take::new(key, &limits[limit], cost))
            .collect();
        // A request on windows alone, now and then, between two microseconds.
        let windows_only = takes.iter().all(|take| take.limit.algorithm().is_window());
        let at = if windows_only && rng.below(3) == 0 {
            Timestamp::from_nanos(now.as_nanos() + 1 + rng.below(999))
        } else {
            now
        };
        if at < latest {
            forget_alike(&reference, store, &mut touched, latest, step).await?;
        }
        latest = latest.max(at);
        touched.extend(keys.iter().cloned());
        let request = CheckRequest {
            takes: &takes,
            request_id: request_id.as_deref(),
            now: Some(at),
        };
        // Now and then, a look without charging first: it must agree and change nothing.
        if rng.below(8) == 0 {
            let expected = reference.peek_now(request);
            let actual = store.peek(request).await;
            if !same(&expected, &actual) {
                return Err(Box::new(Mismatch {
                    step,
                    request: format!("peek {takes:?} at {at:?}"),
                    expected,
                    actual,
                }));
            }
        }
        let expected = reference.check_now(request);
        let actual = store.check(request).await;
        if let (Some(id), Ok(decisions)) = (&request_id, &expected)
            && decisions.iter().all(Decision::allowed)
        {
            recent.push((id.clone(), takes_spec.clone(), Vec::new()));
        }
        if !same(&expected, &actual) {
            return Err(Box::new(Mismatch {
                step,
                request: format!("{takes:?} id {request_id:?} at {at:?}"),
                expected,
                actual,
            }));
        }
        // Now and then, tokens given back to the request's buckets at its time, whether it
        // was charged or not: a caller returning hits (mostly within the capacity; now and
        // then the request's own costs, which may be refused alike).
        if trace.gives_back && rng.below(5) == 0 {
            let given: Vec<Take<'_>> = takes
                .iter()
                .zip(&takes_spec)
                .map(|(take, &(_, _, cost))| {
                    let cost = match rng.below(8) {
                        0 => cost,
                        _ => 1 + rng.below(take.limit.capacity()),
                    };
                    Take::new(take.key, take.limit, cost)
                })
                .collect();
            let request = CheckRequest {
                takes: &given,
                request_id: None,
                now: Some(at),
            };
            let expected = reference.give_back_now(request);
            let actual = store.give_back(request).await;
            if !same(&expected, &actual) {
                return Err(Box::new(Mismatch {
                    step,
                    request: format!("give back {given:?} at {at:?}"),
                    expected,
                    actual,
                }));
            }
        }
        // Now and then, an earlier charged request settled: for less than it cost, again with
        // the same refunds (nothing more given back), or with other ones (a conflict).
        // An id reused for another request (a client's bug) is left out: a cluster keeps a
        // record per slot, so which request it finds under the id can differ from the memory
        // store's, which keys it by the first bucket alone.
        let pick = rng.below(recent.len().max(1) as u64) as usize;
        let reused = |recent: &[(String, Vec<Spec>, Vec<u64>)], pick: usize| {
            let (id, spec, _) = &recent[pick];
            recent.iter().any(|(other, s, _)| other == id && s != spec)
        };
        if !recent.is_empty() && rng.below(6) == 0 && !reused(&recent, pick) {
            let (id, spec, last) = &mut recent[pick];
            if last.is_empty() || rng.below(3) != 0 {
                *last = spec
                    .iter()
                    .map(|&(_, _, cost)| rng.below(cost + 1))
                    .collect();
            }
            let keys = keys_of(trace, spec);
            if now < latest {
                forget_alike(&reference, store, &mut touched, latest, step).await?;
            }
            touched.extend(keys.iter().cloned());
            let takes: Vec<Take<'_>> = spec
                .iter()
                .zip(&keys)
                .map(|(&(_, limit, cost), key)| Take::new(key, &limits[limit], cost))
                .collect();
            let request = CheckRequest {
                takes: &takes,
                request_id: Some(id),
                now: Some(now),
            };
            let expected = reference.settle_now(request, last);
            let actual = store.settle(request, last).await;
            let status = |r: &Result<Settlement, Error>| r.as_ref().ok().map(|s| s.status);
            let decisions = |r: Result<Settlement, Error>| r.map(|s| s.decisions);
            if status(&expected) != status(&actual)
                || !same(&decisions(expected.clone()), &decisions(actual.clone()))
            {
                return Err(Box::new(Mismatch {
                    step,
                    request: format!(
                        "settle {takes:?} id {id:?} refunds {last:?} at {now:?}: memory {:?}, \
                         store {:?}",
                        status(&expected),
                        status(&actual)
                    ),
                    expected: decisions(expected),
                    actual: decisions(actual),
                }));
            }
        }
    }
    Ok(())
}

/// Resets, in both stores, the `touched` buckets full at `latest` (see [`compare_with_memory`]).
async fn forget_alike<S: Store>(
    reference: &LocalStore<ManualClock>,
    store: &S,
    touched: &mut BTreeSet<String>,
    latest: Timestamp,
    step: usize,
) -> Result<(), Box<Mismatch>> {
    let (full, kept): (BTreeSet<String>, BTreeSet<String>) = std::mem::take(touched)
        .into_iter()
        .partition(|key| reference.memory().forgettable(key.as_str(), latest));
    *touched = kept;
    if full.is_empty() {
        return Ok(());
    }
    let keys: Vec<&str> = full.iter().map(String::as_str).collect();
    let why = format!(", full at {latest:?}, before a step back");
    reset_both(reference, store, &keys, step, why).await
}

/// Resets `keys` in both stores, which must answer alike.
async fn reset_both<S: Store>(
    reference: &LocalStore<ManualClock>,
    store: &S,
    keys: &[&str],
    step: usize,
    why: String,
) -> Result<(), Box<Mismatch>> {
    let expected = reference.reset(keys).await;
    let actual = store.reset(keys).await;
    if expected != actual {
        return Err(Box::new(Mismatch {
            step,
            request: format!("reset {keys:?}{why}"),
            expected: expected.map(|()| Vec::new()),
            actual: actual.map(|()| Vec::new()),
        }));
    }
    Ok(())
}

fn keys_of(trace: &Trace, spec: &[Spec]) -> Vec<String> {
    spec.iter()
        .map(|&(subject, limit, _)| {
            if trace.hash_tags {
                format!("{}:{{s{subject}}}:l{limit}", trace.prefix)
            } else {
                format!("{}:s{subject}:l{limit}", trace.prefix)
            }
        })
        .collect()
}

/// Equal decisions, or the same kind of error.
fn same(expected: &Result<Vec<Decision>, Error>, actual: &Result<Vec<Decision>, Error>) -> bool {
    match (expected, actual) {
        (Ok(e), Ok(a)) => e == a,
        (Err(e), Err(a)) => std::mem::discriminant(e) == std::mem::discriminant(a),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::block_on_ready;
    use std::collections::BTreeMap;

    #[test]
    fn the_memory_store_conforms_to_itself() {
        let store = LocalStore::new(ManualClock::new());
        for seed in 1..20 {
            let trace = Trace::new(seed, 500, format!("t{seed}"));
            if let Err(mismatch) = block_on_ready(compare_with_memory(&store, &trace)) {
                panic!("{mismatch}");
            }
            let trace = Trace::new(seed, 500, format!("g{seed}")).gives_back(true);
            if let Err(mismatch) = block_on_ready(compare_with_memory(&store, &trace)) {
                panic!("{mismatch}");
            }
        }
    }

    /// A store that gives every hit back twice.
    struct Doubling(LocalStore<ManualClock>);

    impl Store for Doubling {
        async fn check(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
            self.0.check_now(request)
        }

        async fn peek(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
            self.0.peek_now(request)
        }

        async fn settle(
            &self,
            request: CheckRequest<'_>,
            refunds: &[u64],
        ) -> Result<Settlement, Error> {
            self.0.settle_now(request, refunds)
        }

        async fn give_back(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
            self.0.give_back_now(request)?;
            self.0.give_back_now(request)
        }
    }

    /// Hits given back twice are caught, on every kind of bucket: by a trace over all of them
    /// and by one on each kind alone.
    #[test]
    fn a_store_that_gives_back_too_much_is_caught() {
        let store = Doubling(LocalStore::new(ManualClock::new()));
        for seed in 1..4 {
            let trace = Trace::new(seed, 500, format!("doubling-{seed}")).gives_back(true);
            assert!(block_on_ready(compare_with_memory(&store, &trace)).is_err());
            for kind in [
                Algorithm::TokenBucket,
                Algorithm::FixedWindow,
                Algorithm::SlidingWindow,
                Algorithm::SlidingLog,
            ] {
                let trace = Trace::new(seed, 500, format!("doubling-{kind:?}-{seed}"))
                    .only(kind)
                    .gives_back(true);
                assert!(
                    block_on_ready(compare_with_memory(&store, &trace)).is_err(),
                    "{kind:?}, seed {seed}"
                );
            }
        }
    }

    /// The memory store, dropping every full bucket after each request: as early as lossless
    /// expiry allows, where the reference drops them only as its tables grow.
    struct Forgetful(LocalStore<ManualClock>);

    impl Forgetful {
        fn forget(&self, request: CheckRequest<'_>) {
            self.0
                .memory()
                .sweep(request.now.unwrap_or(Timestamp::ZERO));
        }
    }

    impl Store for Forgetful {
        async fn check(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
            let decisions = self.0.check_now(request);
            self.forget(request);
            decisions
        }

        async fn peek(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
            self.0.peek_now(request)
        }

        async fn settle(
            &self,
            request: CheckRequest<'_>,
            refunds: &[u64],
        ) -> Result<Settlement, Error> {
            let settlement = self.0.settle_now(request, refunds);
            self.forget(request);
            settlement
        }

        async fn give_back(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
            let decisions = self.0.give_back_now(request);
            self.forget(request);
            decisions
        }

        async fn reset(&self, keys: &[&str]) -> Result<(), Error> {
            self.0.reset(keys).await
        }
    }

    /// When a store forgets a full bucket is its own affair, even with the clock going back:
    /// one forgetting as early as it may conforms, on every kind of bucket.
    #[test]
    fn a_store_that_forgets_full_buckets_at_once_conforms() {
        let store = Forgetful(LocalStore::new(ManualClock::new()));
        for seed in 1..20 {
            let traces = [
                Trace::new(seed, 500, format!("forgetful-{seed}")).gives_back(true),
                Trace::new(seed, 500, format!("forgetful-logs-{seed}"))
                    .only(Algorithm::SlidingLog)
                    .gives_back(true),
            ];
            for trace in traces {
                if let Err(mismatch) = block_on_ready(compare_with_memory(&store, &trace)) {
                    panic!("{mismatch}");
                }
            }
        }
    }

    /// A store that charges one token too few must be caught.
    struct Lenient(LocalStore<ManualClock>);

    impl Store for Lenient {
        async fn check(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
            let takes: Vec<Take<'_>> = request
                .takes
                .iter()
                .map(|take| Take {
                    cost: if take.cost > 1 {
                        take.cost - 1
                    } else {
                        take.cost
                    },
                    ..*take
                })
                .collect();
            self.0.check_now(CheckRequest {
                takes: &takes,
                ..request
            })
        }

        async fn peek(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
            self.0.peek_now(request)
        }

        async fn settle(
            &self,
            request: CheckRequest<'_>,
            refunds: &[u64],
        ) -> Result<Settlement, Error> {
            self.0.settle_now(request, refunds)
        }

        async fn reset(&self, keys: &[&str]) -> Result<(), Error> {
            self.0.reset(keys).await
        }
    }

    /// A store that settles but gives nothing back must be caught.
    struct Stingy(LocalStore<ManualClock>);

    impl Store for Stingy {
        async fn check(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
            self.0.check_now(request)
        }

        async fn peek(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
            self.0.peek_now(request)
        }

        async fn settle(
            &self,
            request: CheckRequest<'_>,
            refunds: &[u64],
        ) -> Result<Settlement, Error> {
            self.0.settle_now(request, &vec![0; refunds.len()])
        }

        async fn reset(&self, keys: &[&str]) -> Result<(), Error> {
            self.0.reset(keys).await
        }
    }

    #[test]
    fn a_store_that_gives_nothing_back_is_caught() {
        let store = Stingy(LocalStore::new(ManualClock::new()));
        assert!((1..4).all(|seed| {
            let trace = Trace::new(seed, 500, format!("stingy-{seed}"));
            block_on_ready(compare_with_memory(&store, &trace)).is_err()
        }));
    }

    #[test]
    fn a_lenient_store_is_caught() {
        let store = Lenient(LocalStore::new(ManualClock::new()));
        let trace = Trace::new(3, 500, "lenient");
        assert!(block_on_ready(compare_with_memory(&store, &trace)).is_err());
    }

    /// A trace focused on logs keeps their keys counting: the memory store conforms to it,
    /// and a store that charges logs one request too few, or gives them nothing back, is
    /// caught by every seed.
    #[test]
    fn a_trace_of_logs_alone_catches_what_a_log_store_gets_wrong() {
        let logs = |seed: u64, name: &str| {
            Trace::new(seed, 500, format!("{name}-{seed}")).only(Algorithm::SlidingLog)
        };
        let store = LocalStore::new(ManualClock::new());
        for seed in 1..6 {
            if let Err(mismatch) = block_on_ready(compare_with_memory(&store, &logs(seed, "own"))) {
                panic!("{mismatch}");
            }
        }
        let lenient = Lenient(LocalStore::new(ManualClock::new()));
        let stingy = Stingy(LocalStore::new(ManualClock::new()));
        for seed in 1..4 {
            let trace = logs(seed, "lenient");
            assert!(block_on_ready(compare_with_memory(&lenient, &trace)).is_err());
            let trace = logs(seed, "stingy");
            assert!(block_on_ready(compare_with_memory(&stingy, &trace)).is_err());
        }
    }

    /// The memory store, but deciding each request as `rewrite` turns it.
    struct Rewritten<F>(LocalStore<ManualClock>, F);

    impl<F> Store for Rewritten<F>
    where
        F: Fn(&Take<'_>, Timestamp) -> (Limit, Timestamp) + Send + Sync,
    {
        async fn check(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
            let now = request.now.unwrap_or(Timestamp::ZERO);
            let rewritten: Vec<(Limit, Timestamp)> = request
                .takes
                .iter()
                .map(|take| (self.1)(take, now))
                .collect();
            let takes: Vec<Take<'_>> = request
                .takes
                .iter()
                .zip(&rewritten)
                .map(|(take, (limit, _))| Take { limit, ..*take })
                .collect();
            self.0.check_now(CheckRequest {
                takes: &takes,
                now: rewritten.first().map(|&(_, now)| now),
                ..request
            })
        }

        async fn peek(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
            self.0.peek_now(request)
        }

        async fn settle(
            &self,
            request: CheckRequest<'_>,
            refunds: &[u64],
        ) -> Result<Settlement, Error> {
            self.0.settle_now(request, refunds)
        }

        async fn reset(&self, keys: &[&str]) -> Result<(), Error> {
            self.0.reset(keys).await
        }
    }

    fn caught<F>(rewrite: F) -> bool
    where
        F: Fn(&Take<'_>, Timestamp) -> (Limit, Timestamp) + Send + Sync,
    {
        let store = Rewritten(LocalStore::new(ManualClock::new()), rewrite);
        (1..4).all(|seed| {
            let trace = Trace::new(seed, 500, format!("rewritten-{seed}"));
            block_on_ready(compare_with_memory(&store, &trace)).is_err()
        })
    }

    /// The traces decide windows, between microseconds and with the clock going back: a store
    /// that took windows for token buckets, dropped the nanoseconds, or never saw time go back
    /// would be caught.
    #[test]
    fn traces_hold_windows_nanoseconds_and_steps_back() {
        assert!(caught(|take, now| {
            let limit = match take.limit.window() {
                Some(window) => Limit::per(take.limit.capacity(), window).unwrap(),
                None => *take.limit,
            };
            (limit, now)
        }));
        assert!(caught(|take, now| {
            let whole = Timestamp::from_nanos(now.as_nanos() / 1_000 * 1_000);
            (*take.limit, whole)
        }));
        let latest = std::sync::atomic::AtomicU64::new(0);
        assert!(caught(move |take, now| {
            let seen = latest.fetch_max(now.as_nanos(), std::sync::atomic::Ordering::Relaxed);
            (*take.limit, Timestamp::from_nanos(seen.max(now.as_nanos())))
        }));
        // The same rewrites, changing nothing, are not caught.
        assert!(!(1..4).any(|seed| {
            let store = Rewritten(
                LocalStore::new(ManualClock::new()),
                |take: &Take<'_>, now| (*take.limit, now),
            );
            let trace = Trace::new(seed, 500, format!("unchanged-{seed}"));
            block_on_ready(compare_with_memory(&store, &trace)).is_err()
        }));
    }

    /// One check a trace asked for: when (whole microseconds: a request on windows alone may
    /// fall between two), with which id, and each bucket's key, algorithm, cost and capacity.
    struct Asked {
        at_us: u64,
        between_us: bool,
        id: Option<String>,
        takes: Vec<(String, Algorithm, u64, u64)>,
    }

    /// The memory store, writing down every check, settlement, look and reset it is asked for.
    struct Recorder {
        store: LocalStore<ManualClock>,
        checks: parking_lot::Mutex<Vec<Asked>>,
        settles: parking_lot::Mutex<Vec<(String, Vec<u64>)>>,
        peeks: std::sync::atomic::AtomicUsize,
        resets: std::sync::atomic::AtomicUsize,
    }

    impl Recorder {
        fn new() -> Self {
            Self {
                store: LocalStore::new(ManualClock::new()),
                checks: parking_lot::Mutex::default(),
                settles: parking_lot::Mutex::default(),
                peeks: std::sync::atomic::AtomicUsize::new(0),
                resets: std::sync::atomic::AtomicUsize::new(0),
            }
        }
    }

    impl Store for Recorder {
        async fn check(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
            self.checks.lock().push(Asked {
                at_us: request.now.map_or(0, |now| now.as_nanos() / 1_000),
                between_us: request.now.is_some_and(|now| now.as_nanos() % 1_000 != 0),
                id: request.request_id.map(str::to_owned),
                takes: request
                    .takes
                    .iter()
                    .map(|t| {
                        let capacity = t.limit.capacity();
                        (t.key.to_owned(), t.limit.algorithm(), t.cost, capacity)
                    })
                    .collect(),
            });
            self.store.check_now(request)
        }

        async fn peek(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
            self.peeks
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.store.peek_now(request)
        }

        async fn settle(
            &self,
            request: CheckRequest<'_>,
            refunds: &[u64],
        ) -> Result<Settlement, Error> {
            let id = request.request_id.unwrap_or_default().to_owned();
            self.settles.lock().push((id, refunds.to_vec()));
            self.store.settle_now(request, refunds)
        }

        async fn reset(&self, keys: &[&str]) -> Result<(), Error> {
            self.resets
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.store.reset(keys).await
        }
    }

    /// The recorders of `trace` run with seeds 1 to 6.
    fn recorders(trace: impl Fn(u64) -> Trace) -> Vec<Recorder> {
        (1..=6)
            .map(|seed| {
                let recorder = Recorder::new();
                if let Err(mismatch) = block_on_ready(compare_with_memory(&recorder, &trace(seed)))
                {
                    panic!("{mismatch}");
                }
                recorder
            })
            .collect()
    }

    /// What `trace` asked of a store, for seeds 1 to 6: every check; each settlement as
    /// (its id was settled before, with other refunds than then); how many looks.
    fn record(trace: impl Fn(u64) -> Trace) -> (Vec<Vec<Asked>>, Vec<(bool, bool)>, usize) {
        let (mut checks, mut settles, mut peeks) = (Vec::new(), Vec::new(), 0);
        for recorder in recorders(trace) {
            checks.push(recorder.checks.into_inner());
            let mut last: BTreeMap<String, Vec<u64>> = BTreeMap::new();
            for (id, refunds) in recorder.settles.into_inner() {
                let before = last.insert(id, refunds.clone());
                settles.push((before.is_some(), before.is_some_and(|b| b != refunds)));
            }
            peeks += recorder.peeks.into_inner();
        }
        (checks, settles, peeks)
    }

    /// The share of `items` for which `is` holds.
    fn share<T>(items: &[T], is: impl Fn(&T) -> bool) -> f64 {
        items.iter().filter(|item| is(item)).count() as f64 / items.len().max(1) as f64
    }

    /// Each check's step from the one before, in microseconds: forward (positive) or back.
    fn steps_us(traces: &[Vec<Asked>]) -> Vec<i128> {
        traces
            .iter()
            .flat_map(|checks| {
                checks
                    .windows(2)
                    .map(|pair| i128::from(pair[1].at_us) - i128::from(pair[0].at_us))
            })
            .collect()
    }

    /// The conformance suite is only as good as the requests it makes: a narrowed trace (no
    /// refused costs, no steps back, one bucket per request) would let a faulty store pass,
    /// and the faulty stores above might still be caught by what is left. This holds the
    /// trace to the mix it promises, close to the odds it draws with.
    #[test]
    fn a_trace_asks_for_the_mix_it_promises() {
        let (traces, settles, peeks) = record(|seed| Trace::new(seed, 500, format!("mix-{seed}")));
        let checks: Vec<&Asked> = traces.iter().flatten().collect();
        assert_eq!(checks.len(), 6 * 500);
        let within = |what: &str, got: f64, low: f64, high: f64| {
            assert!(
                (low..=high).contains(&got),
                "{what}: {got:.3}, not in {low}..={high}"
            );
        };
        // Buckets per request, drawn 7 : 2 : 1, and never one bucket twice.
        let buckets = |n: usize| share(&checks, |a| a.takes.len() == n);
        within("one bucket", buckets(1), 0.60, 0.80);
        within("two buckets", buckets(2), 0.12, 0.28);
        within("three buckets", buckets(3), 0.05, 0.15);
        assert!(checks.iter().all(|a| {
            let keys: BTreeSet<&String> = a.takes.iter().map(|(key, ..)| key).collect();
            keys.len() == a.takes.len()
        }));
        // Costs, drawn per bucket: 0 (refused) 1 in 20, capacity + 1 (refused) 1 in 20, the
        // whole capacity 4 in 20, and the rest between, some of them above 3.
        let takes: Vec<(u64, u64)> = checks
            .iter()
            .flat_map(|a| {
                a.takes
                    .iter()
                    .map(|&(_, _, cost, capacity)| (cost, capacity))
            })
            .collect();
        within("cost 0", share(&takes, |&(cost, _)| cost == 0), 0.03, 0.07);
        let over = share(&takes, |&(cost, capacity)| cost == capacity + 1);
        within("cost capacity + 1", over, 0.03, 0.07);
        assert!(takes.iter().all(|&(cost, capacity)| cost <= capacity + 1));
        let whole = share(&takes, |&(cost, capacity)| cost == capacity);
        within("cost = capacity", whole, 0.20, 0.40);
        let between = share(&takes, |&(cost, capacity)| cost > 3 && cost < capacity);
        within("cost between 4 and capacity - 1", between, 0.01, 0.10);
        // Every kind of limit.
        for algorithm in [
            Algorithm::TokenBucket,
            Algorithm::FixedWindow,
            Algorithm::SlidingWindow,
            Algorithm::SlidingLog,
        ] {
            let used = checks
                .iter()
                .any(|a| a.takes.iter().any(|&(_, kind, ..)| kind == algorithm));
            assert!(used, "{algorithm:?} never asked for");
        }
        // Time: back 1 step in 16, by 1 µs to 250 ms; forward by up to 70 s.
        let steps = steps_us(&traces);
        within("steps back", share(&steps, |&step| step < 0), 0.03, 0.10);
        assert_eq!(steps.iter().min(), Some(&-250_000));
        assert_eq!(steps.iter().max(), Some(&70_000_000));
        // A request on windows alone falls between two microseconds 1 time in 3, any
        // other never.
        let on_windows = |a: &&Asked| a.takes.iter().all(|&(_, kind, ..)| kind.is_window());
        let (windows_only, others): (Vec<&Asked>, Vec<&Asked>) =
            checks.iter().copied().partition(on_windows);
        within(
            "between",
            share(&windows_only, |a| a.between_us),
            0.22,
            0.45,
        );
        assert!(others.iter().all(|a| !a.between_us));
        // Retries of an earlier id, fresh ids, settlements and looks.
        let mut seen = BTreeSet::new();
        let retries = traces
            .iter()
            .flatten()
            .filter_map(|a| a.id.as_ref())
            .filter(|id| !seen.insert(*id))
            .count();
        within("ids", share(&checks, |a| a.id.is_some()), 0.10, 0.25);
        assert!(retries >= 100, "{retries} retries");
        // Settlements, 1 step in 6 once there is something to settle; a repeated one draws
        // other refunds 2 times in 3, equal to the last by chance now and then.
        within(
            "settlements",
            settles.len() as f64 / checks.len() as f64,
            0.10,
            0.22,
        );
        let repeats: Vec<bool> = settles.iter().filter(|s| s.0).map(|s| s.1).collect();
        within("repeated settlements", share(&settles, |s| s.0), 0.25, 0.75);
        within(
            "of those, other refunds",
            share(&repeats, |&other| other),
            0.45,
            0.80,
        );
        within("looks", peeks as f64 / checks.len() as f64, 0.08, 0.17);
    }

    /// Ids retried for another request (a client's bug the trace plays), and resets.
    fn reuses_and_resets(trace: impl Fn(u64) -> Trace) -> (usize, usize) {
        let (mut reused, mut resets) = (0, 0);
        for recorder in recorders(trace) {
            resets += recorder.resets.into_inner();
            let mut first: BTreeMap<String, Vec<(String, u64)>> = BTreeMap::new();
            for asked in recorder.checks.into_inner() {
                let Some(id) = asked.id else { continue };
                let request: Vec<(String, u64)> =
                    asked.takes.into_iter().map(|(k, _, c, _)| (k, c)).collect();
                let earlier = first.entry(id).or_insert_with(|| request.clone());
                reused += usize::from(*earlier != request);
            }
        }
        (reused, resets)
    }

    #[test]
    fn an_id_is_reused_for_another_request_only_under_hash_tags() {
        let (reused, _) = reuses_and_resets(|seed| Trace::new(seed, 500, format!("re-{seed}")));
        assert!(reused >= 10, "{reused} ids reused for another request");
        let (reused, _) =
            reuses_and_resets(|seed| Trace::new(seed, 500, format!("nt-{seed}")).hash_tags(false));
        assert_eq!(reused, 0);
    }

    #[test]
    fn buckets_are_reset_only_when_the_trace_asks_for_it() {
        // Without steps back, nor windows timed between two microseconds (token buckets
        // alone), nothing is forgotten alike: every reset is a trace's own.
        let trace = |seed| {
            Trace::new(seed, 500, format!("rs-{seed}"))
                .steps_back(false)
                .only(Algorithm::TokenBucket)
        };
        assert_eq!(reuses_and_resets(trace).1, 0);
        let (_, resets) = reuses_and_resets(|seed| trace(seed).resets(true));
        // 1 request in 24: 125 of 3,000.
        assert!((60..=250).contains(&resets), "{resets} resets");
    }

    /// A trace on one algorithm asks for nothing else, and steps no more than a second.
    #[test]
    fn a_focused_trace_stays_on_its_algorithm_and_its_short_steps() {
        let (traces, ..) =
            record(|seed| Trace::new(seed, 300, format!("log-{seed}")).only(Algorithm::SlidingLog));
        assert!(traces.iter().flatten().all(|a| {
            a.takes
                .iter()
                .all(|&(_, kind, ..)| kind == Algorithm::SlidingLog)
        }));
        assert_eq!(steps_us(&traces).iter().max(), Some(&1_000_000));
    }

    #[test]
    fn a_mismatch_shows_the_step_the_request_and_both_answers() {
        let mismatch = Mismatch {
            step: 7,
            request: "a request".into(),
            expected: Err(Error::EmptyCheck),
            actual: Ok(Vec::new()),
        };
        assert_eq!(
            mismatch.to_string(),
            "step 7: a request\n  memory: Err(EmptyCheck)\n  store:  Ok([])"
        );
    }
}
