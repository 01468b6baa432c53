//! What one policy did to a trace: counts per limit, the keys it rejected most, and a timeline.
//!
//! Counting is exact (a simulation is not on a request's path, so nothing is sampled), and
//! bounded: a limit remembers at most [`MAX_KEYS`] distinct rejected keys, and counts the
//! rejections of any key past those as `other_keys`, so a trace of a billion subjects cannot
//! exhaust memory.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tollgate_policy::{LeaseOutcome, Outcome, Policy, UnixTime};

use crate::metrics::is_near;

/// The most distinct rejected keys remembered per limit.
pub(crate) const MAX_KEYS: usize = 100_000;

/// Counts of one limit.
#[derive(Debug, Clone, Default)]
pub(crate) struct LimitTally {
    /// The limit's name.
    pub(crate) name: Arc<str>,
    /// Its algorithm, as the policy names it.
    pub(crate) algorithm: &'static str,
    /// Requests it applied to, each descriptor it matched counted once.
    pub(crate) decisions: u64,
    /// Where it was enforced and said no.
    pub(crate) rejected: u64,
    /// Where it was in shadow mode or outside its rollout and would have said no.
    pub(crate) would_reject: u64,
    /// Where an exemption lifted it.
    pub(crate) exempt: u64,
    /// Allowed decisions that left it nearly used up: past the near-limit ratio of its
    /// capacity spent (or of its `max_in_flight` held), as `tollgate serve` counts them.
    pub(crate) near_limit: u64,
    /// The first instant it rejected or would have.
    pub(crate) first_rejection: Option<UnixTime>,
    /// Rejections (and would-rejections) per bucket key, for the first [`MAX_KEYS`] keys.
    pub(crate) keys: HashMap<Box<str>, u64>,
    /// Rejections of keys past those.
    pub(crate) other_keys: u64,
}

impl LimitTally {
    /// This limit's most rejected keys, most first (ties by key, so reports are stable).
    pub(crate) fn top_keys(&self, top: usize) -> Vec<(&str, u64)> {
        let mut keys: Vec<(&str, u64)> = self.keys.iter().map(|(k, n)| (&**k, *n)).collect();
        keys.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        keys.truncate(top);
        keys
    }

    fn count_key(&mut self, key: &str) {
        if let Some(count) = self.keys.get_mut(key) {
            *count += 1;
        } else if self.keys.len() < MAX_KEYS {
            self.keys.insert(key.into(), 1);
        } else {
            self.other_keys += 1;
        }
    }
}

/// Requests in one interval of the timeline.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Slot {
    /// Requests decided.
    pub(crate) requests: u64,
    /// Requests an enforced limit rejected.
    pub(crate) rejected: u64,
    /// Requests allowed that a shadow limit (or one outside its rollout) would have rejected.
    pub(crate) would_reject: u64,
}

/// What a policy made of the trace's requests, as the report gives it.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub(crate) struct Counts {
    /// Requests decided.
    pub(crate) requests: u64,
    /// Requests allowed.
    pub(crate) allowed: u64,
    /// Requests rejected by an enforced limit.
    pub(crate) rejected: u64,
    /// Requests allowed that a shadow limit (or one outside its rollout) would have rejected.
    pub(crate) would_reject: u64,
    /// Requests no limit applied to.
    pub(crate) unmatched: u64,
    /// Requests the policy refused to decide (a cost above a capacity, a request id reused
    /// for another request): the server would answer them 400 or 409.
    pub(crate) invalid: u64,
}

/// Everything one policy did to the trace.
#[derive(Debug, Clone)]
pub(crate) struct Tally {
    /// The requests' fates.
    pub(crate) counts: Counts,
    /// The first of those: its line and why.
    pub(crate) first_invalid: Option<(u64, String)>,
    /// The policy's limits in declaration order, then any other name an outcome showed.
    pub(crate) limits: Vec<LimitTally>,
    /// The policy's concurrency limits: exercised only by lines that say how long their
    /// request was in flight.
    pub(crate) concurrency_limits: usize,
    /// Requests that took a lease (allowed, holding a slot of at least one concurrency limit).
    pub(crate) leases: u64,
    /// Leases that were still held past their limit's `lease_timeout` when their request
    /// ended, and had timed out instead: a timeout shorter than the requests it guards.
    pub(crate) leases_timed_out: u64,
    /// Reservations (lines with `used`) allowed and settled at their end.
    pub(crate) settled: u64,
    /// Tokens those settlements gave back (`cost - used`, on every bucket the request was
    /// charged on).
    pub(crate) given_back: u64,
    /// Reservations allowed but not settled: ended after the idempotency window (the whole
    /// cost stays charged), or their limits changed meanwhile.
    pub(crate) settle_missed: u64,
    /// Requests by interval: the key is the interval's start as a multiple of its length
    /// since the Unix epoch.
    pub(crate) timeline: BTreeMap<u64, Slot>,
    interval_ns: u64,
    /// The near-limit ratio, in thousandths.
    near_permille: u32,
    index: HashMap<Arc<str>, usize>,
}

impl Tally {
    /// An empty tally for `policy`, with a timeline in intervals of `interval` (at least 1 ms),
    /// counting decisions past `near_permille` thousandths of their limit as near it.
    pub(crate) fn new(policy: &Policy, interval: Duration, near_permille: u32) -> Self {
        let mut tally = Self {
            counts: Counts::default(),
            first_invalid: None,
            limits: Vec::new(),
            concurrency_limits: 0,
            leases: 0,
            leases_timed_out: 0,
            settled: 0,
            given_back: 0,
            settle_missed: 0,
            timeline: BTreeMap::new(),
            interval_ns: u64::try_from(interval.as_nanos())
                .unwrap_or(u64::MAX)
                .max(1_000_000),
            near_permille,
            index: HashMap::new(),
        };
        for def in policy.limits() {
            if def.concurrency().is_some() {
                tally.concurrency_limits += 1;
            }
            let name: Arc<str> = def.name().into();
            tally.index.insert(name.clone(), tally.limits.len());
            tally.limits.push(LimitTally {
                name,
                algorithm: def.algorithm(),
                ..LimitTally::default()
            });
        }
        tally
    }

    /// The timeline's interval.
    pub(crate) fn interval(&self) -> Duration {
        Duration::from_nanos(self.interval_ns)
    }

    /// Counts a decided request that arrived `at`: its rate limits' `outcome`, and when it
    /// passed them and took a lease, its concurrency limits' `lease`.
    pub(crate) fn record(&mut self, at: UnixTime, outcome: &Outcome, lease: Option<&LeaseOutcome>) {
        self.counts.requests += 1;
        let permille = self.near_permille;
        let rates = outcome.limits.iter().map(|l| {
            let near = l.decision.is_some_and(|d| {
                d.allowed() && !d.is_denied() && {
                    let capacity = d.capacity();
                    is_near(capacity.saturating_sub(d.remaining()), capacity, permille)
                }
            });
            (&l.name, l.mode, l.would_reject(), near, &*l.bucket_key)
        });
        // A deny limit applies to both calls (names are unique across kinds, so a name in
        // both lists is one): counted once, as the check decided it.
        let leases = lease
            .iter()
            .flat_map(|lease| &lease.limits)
            .filter(|l| !outcome.limits.iter().any(|r| r.name == l.name))
            .map(|l| {
                let near = l.decision.is_some_and(|d| {
                    d.allowed() && is_near(d.in_flight(), d.max_in_flight(), permille)
                });
                (&l.name, l.mode, l.would_reject(), near, &*l.bucket_key)
            });
        let mut would_reject = false;
        for (name, mode, short, near, key) in rates.chain(leases) {
            self.row(name).near_limit += u64::from(near);
            would_reject |= self.count(at, name, mode, short, key);
        }
        self.leases += u64::from(lease.is_some_and(|lease| lease.held));
        let rejected = !outcome.allowed || lease.is_some_and(|lease| !lease.allowed);
        let would_reject = !rejected && would_reject;
        let slot = self.slot(at);
        slot.requests += 1;
        slot.rejected += u64::from(rejected);
        slot.would_reject += u64::from(would_reject);
        self.counts.rejected += u64::from(rejected);
        self.counts.allowed += u64::from(!rejected);
        self.counts.would_reject += u64::from(would_reject);
        if outcome.unmatched() && lease.is_none_or(LeaseOutcome::unmatched) {
            self.counts.unmatched += 1;
        }
    }

    /// Counts one limit's part in a decision; says whether it was a would-reject of a limit
    /// that cannot reject (shadow, outside its rollout).
    fn count(
        &mut self,
        at: UnixTime,
        name: &Arc<str>,
        mode: &str,
        short: bool,
        bucket_key: &str,
    ) -> bool {
        let row = self.row(name);
        row.decisions += 1;
        let would_reject = match mode {
            "exempt" => {
                row.exempt += 1;
                return false;
            }
            _ if !short => return false,
            "enforce" => {
                row.rejected += 1;
                false
            }
            _ => {
                row.would_reject += 1;
                true
            }
        };
        row.first_rejection.get_or_insert(at);
        row.count_key(bucket_key);
        would_reject
    }

    /// Counts a lease that was no longer held when its request ended.
    pub(crate) fn lease_timed_out(&mut self) {
        self.leases_timed_out += 1;
    }

    /// Counts a reservation settled, `given_back` tokens returned, or missed (`None`).
    pub(crate) fn settlement(&mut self, given_back: Option<u64>) {
        match given_back {
            Some(tokens) => {
                self.settled += 1;
                self.given_back = self.given_back.saturating_add(tokens);
            }
            None => self.settle_missed += 1,
        }
    }

    /// Counts a request the policy refused to decide.
    pub(crate) fn refuse(&mut self, line: u64, why: String) {
        self.counts.invalid += 1;
        self.first_invalid.get_or_insert((line, why));
    }

    fn row(&mut self, name: &Arc<str>) -> &mut LimitTally {
        let at = match self.index.get(name) {
            Some(&at) => at,
            None => {
                self.index.insert(name.clone(), self.limits.len());
                self.limits.push(LimitTally {
                    name: name.clone(),
                    algorithm: "unknown",
                    ..LimitTally::default()
                });
                self.limits.len() - 1
            }
        };
        &mut self.limits[at]
    }

    fn slot(&mut self, at: UnixTime) -> &mut Slot {
        // Trace times are never before 1970 (the trace reader refuses them).
        let nanos = u64::try_from(at.as_nanos()).unwrap_or(0);
        self.timeline.entry(nanos / self.interval_ns).or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_at_most_max_keys_and_counts_the_rest() {
        let mut limit = LimitTally::default();
        for key in 0..MAX_KEYS + 10 {
            limit.count_key(&key.to_string());
        }
        limit.count_key("0");
        limit.count_key(&(MAX_KEYS + 5).to_string());
        assert_eq!(limit.keys.len(), MAX_KEYS);
        assert_eq!(limit.other_keys, 11);
        assert_eq!(limit.top_keys(2), vec![("0", 2), ("1", 1)]);
    }

    #[test]
    fn an_interval_is_at_least_a_millisecond() {
        let policy = tollgate_policy::compile("t.yaml", "version: 1\nlimits: []\n").unwrap();
        assert_eq!(
            Tally::new(&policy, Duration::ZERO, 800).interval(),
            Duration::from_millis(1)
        );
    }
}
