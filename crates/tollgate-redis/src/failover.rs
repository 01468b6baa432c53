//! What a limit does when its shared store cannot decide.
//!
//! A shared store can be down, slow or broken; a rate limiter in front of production traffic
//! must still answer, quickly, and in a way the operator chose per limit:
//!
//! * [`FailureMode::Closed`]: deny, with an [`Outcome::Unavailable`] that callers turn into a
//!   distinct answer (HTTP 503, not 429), so clients and dashboards can tell an outage from
//!   a quota.
//! * [`FailureMode::Open`]: decide on a local emergency bucket per key, at a budget the
//!   operator set, never unlimited. Each process has its own emergency buckets, so N processes
//!   admit up to N times the budget: size it per process.
//!
//! Every degraded outcome is counted (in [`FailoverStats`] and the
//! `tollgate_degraded_decisions_total` metric, by reason and mode) and logged, at most once a
//! second with a count of what was not logged, so an outage does not flood the logs.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tollgate::{
    CheckRequest, Clock, Decision, Error, Item, Limit, MemoryStore, MonotonicClock, Store, Take,
    Timestamp, Unavailable,
};

/// What a limit does when the store cannot decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailureMode {
    /// Deny, distinguishably from a rejection.
    Closed,
    /// Decide on a local bucket per key with this limit.
    Open {
        /// The emergency budget per key, per process.
        emergency: Limit,
    },
}

/// A bucket of a check, with what to do if the store fails.
#[derive(Debug, Clone, Copy)]
pub struct Guarded<'a> {
    /// The bucket.
    pub take: Take<'a>,
    /// Its failure mode.
    pub on_failure: FailureMode,
}

/// The answer for one bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// The store decided.
    Decided(Decision),
    /// The store failed; the limit fails open and its emergency budget decided.
    Emergency {
        /// The emergency bucket's decision.
        decision: Decision,
        /// Why the store could not decide.
        reason: Unavailable,
    },
    /// The store failed and the limit fails closed (or the request cannot be served by its
    /// emergency budget): deny, as unavailable rather than over quota.
    Unavailable {
        /// Why the store could not decide.
        reason: Unavailable,
    },
}

impl Outcome {
    /// Whether this bucket let the request through.
    pub fn allowed(&self) -> bool {
        match self {
            Outcome::Decided(decision) | Outcome::Emergency { decision, .. } => decision.allowed(),
            Outcome::Unavailable { .. } => false,
        }
    }

    /// The decision, when there is one.
    pub fn decision(&self) -> Option<&Decision> {
        match self {
            Outcome::Decided(decision) | Outcome::Emergency { decision, .. } => Some(decision),
            Outcome::Unavailable { .. } => None,
        }
    }

    /// Why the store failed, for degraded outcomes.
    pub fn degraded(&self) -> Option<Unavailable> {
        match self {
            Outcome::Decided(_) => None,
            Outcome::Emergency { reason, .. } | Outcome::Unavailable { reason } => Some(*reason),
        }
    }
}

/// Degraded outcomes so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct FailoverStats {
    /// Buckets decided by an emergency budget.
    pub emergency: u64,
    /// Buckets answered unavailable.
    pub unavailable: u64,
}

/// A store with per-limit failure modes.
pub struct Failover<S, C = MonotonicClock> {
    store: S,
    emergency: MemoryStore<Box<str>>,
    clock: C,
    emergency_count: AtomicU64,
    unavailable_count: AtomicU64,
    log: Mutex<LogThrottle>,
}

#[derive(Default)]
struct LogThrottle {
    last: Option<Timestamp>,
    suppressed: u64,
}

impl<S: Store> Failover<S, MonotonicClock> {
    /// `store`, with emergency buckets on the monotonic clock.
    pub fn new(store: S) -> Self {
        Self::with_clock(store, MonotonicClock::new())
    }
}

impl<S: Store, C: Clock> Failover<S, C> {
    /// `store`, with emergency buckets timed by `clock`.
    pub fn with_clock(store: S, clock: C) -> Self {
        Self {
            store,
            // Emergency buckets are per key and per process; bound them like any memory store.
            emergency: MemoryStore::builder().max_buckets(1_000_000).build(),
            clock,
            emergency_count: AtomicU64::new(0),
            unavailable_count: AtomicU64::new(0),
            log: Mutex::new(LogThrottle::default()),
        }
    }

    /// The store inside.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// Degraded outcomes so far.
    pub fn stats(&self) -> FailoverStats {
        FailoverStats {
            emergency: self.emergency_count.load(Ordering::Relaxed),
            unavailable: self.unavailable_count.load(Ordering::Relaxed),
        }
    }

    /// Decides `takes` on the store, all or nothing; if the store fails, each bucket follows its
    /// failure mode. Outcomes come back in the order of `takes`.
    ///
    /// When the store fails and any bucket fails closed, the request is denied and no emergency
    /// bucket is charged (all or nothing still holds); the open ones report their uncharged
    /// emergency balance.
    ///
    /// # Errors
    ///
    /// The store's errors other than unavailability (bad costs, duplicate keys, unsupported
    /// limits, idempotency conflicts): those are the caller's to fix, not an outage.
    pub async fn check(
        &self,
        takes: &[Guarded<'_>],
        request_id: Option<&str>,
        now: Option<Timestamp>,
    ) -> Result<Vec<Outcome>, Error> {
        let plain: Vec<Take<'_>> = takes.iter().map(|guarded| guarded.take).collect();
        let request = CheckRequest {
            takes: &plain,
            request_id,
            now,
        };
        match self.store.check(request).await {
            Ok(decisions) => Ok(decisions.into_iter().map(Outcome::Decided).collect()),
            Err(Error::StoreUnavailable { reason }) => Ok(self.degrade(takes, reason, request_id)),
            Err(err) => Err(err),
        }
    }

    fn degrade(
        &self,
        takes: &[Guarded<'_>],
        reason: Unavailable,
        request_id: Option<&str>,
    ) -> Vec<Outcome> {
        let now = self.clock.now();
        let emergency: Vec<Option<Limit>> = takes
            .iter()
            .map(|guarded| match guarded.on_failure {
                // A cost the emergency budget can never hold cannot be served by it.
                FailureMode::Open { emergency } if guarded.take.cost <= emergency.capacity() => {
                    Some(emergency)
                }
                _ => None,
            })
            .collect();
        let outcomes: Vec<Outcome> = if emergency.iter().all(Option::is_some) {
            let items: Vec<Item<'_, str>> = takes
                .iter()
                .zip(&emergency)
                .filter_map(|(guarded, limit)| {
                    limit.as_ref().map(|limit| Item {
                        key: guarded.take.key,
                        limit,
                        cost: guarded.take.cost,
                    })
                })
                .collect();
            match self.emergency.check_all(&items, now, request_id) {
                Ok(decisions) => decisions
                    .into_iter()
                    .map(|decision| Outcome::Emergency { decision, reason })
                    .collect(),
                // Only an idempotency conflict can get here (costs were checked against the
                // emergency capacities): deny rather than guess.
                Err(_) => takes
                    .iter()
                    .map(|_| Outcome::Unavailable { reason })
                    .collect(),
            }
        } else {
            takes
                .iter()
                .zip(&emergency)
                .map(|(guarded, limit)| match limit {
                    Some(limit) => self
                        .emergency
                        .peek(guarded.take.key, limit, guarded.take.cost, now)
                        .map(|decision| Outcome::Emergency { decision, reason })
                        .unwrap_or(Outcome::Unavailable { reason }),
                    None => Outcome::Unavailable { reason },
                })
                .collect()
        };
        self.count(&outcomes, reason);
        outcomes
    }

    fn count(&self, outcomes: &[Outcome], reason: Unavailable) {
        let (mut emergency, mut unavailable) = (0u64, 0u64);
        for outcome in outcomes {
            match outcome {
                Outcome::Emergency { .. } => emergency += 1,
                Outcome::Unavailable { .. } => unavailable += 1,
                Outcome::Decided(_) => {}
            }
        }
        self.emergency_count.fetch_add(emergency, Ordering::Relaxed);
        self.unavailable_count
            .fetch_add(unavailable, Ordering::Relaxed);
        let label = reason.as_str();
        metrics::counter!("tollgate_degraded_decisions_total", "reason" => label, "mode" => "open")
            .increment(emergency);
        metrics::counter!("tollgate_degraded_decisions_total", "reason" => label, "mode" => "closed")
            .increment(unavailable);

        let now = self.clock.now();
        let mut log = self
            .log
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let quiet = log
            .last
            .is_some_and(|last| now.saturating_duration_since(last) < Duration::from_secs(1));
        if quiet {
            log.suppressed += emergency + unavailable;
        } else {
            tracing::warn!(
                reason = label,
                emergency,
                unavailable,
                not_logged_since_last = log.suppressed,
                "store unavailable: decisions degraded to their failure modes"
            );
            *log = LogThrottle {
                last: Some(now),
                suppressed: 0,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate::{LocalStore, ManualClock, block_on_ready};

    /// A store that is always down.
    struct Down;

    impl Store for Down {
        async fn check(&self, _: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
            Err(Error::StoreUnavailable {
                reason: Unavailable::Connection,
            })
        }

        async fn peek(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
            self.check(request).await
        }

        async fn settle(
            &self,
            _: CheckRequest<'_>,
            _: &[u64],
        ) -> Result<tollgate::Settlement, Error> {
            Err(Error::StoreUnavailable {
                reason: Unavailable::Connection,
            })
        }
    }

    fn limit(capacity: u64, rate: &str) -> Limit {
        Limit::new(capacity, rate.parse().unwrap()).unwrap()
    }

    #[test]
    fn healthy_store_decides() {
        let failover =
            Failover::with_clock(LocalStore::new(ManualClock::new()), ManualClock::new());
        let l = limit(1, "1/s");
        let takes = [Guarded {
            take: Take::new("k", &l, 1),
            on_failure: FailureMode::Closed,
        }];
        let outcomes = block_on_ready(failover.check(&takes, None, None)).unwrap();
        assert!(matches!(outcomes[0], Outcome::Decided(d) if d.allowed()));
        assert_eq!(outcomes[0].decision().map(Decision::remaining), Some(0));
        assert_eq!(outcomes[0].degraded(), None);
        assert_eq!(failover.stats(), FailoverStats::default());
    }

    /// A cost the emergency budget can never hold makes its own limit unavailable; the
    /// request's other open limits are read on their emergency budgets, not charged, as
    /// beside a closed limit.
    #[test]
    fn a_cost_above_the_emergency_budget_is_unavailable_and_charges_the_others_nothing() {
        let failover = Failover::with_clock(Down, ManualClock::new());
        let l = limit(10, "1/s");
        let open = |key, cost, capacity| Guarded {
            take: Take::new(key, &l, cost),
            on_failure: FailureMode::Open {
                emergency: limit(capacity, "1/s"),
            },
        };
        let takes = [open("small", 1, 1), open("large", 3, 2)];
        for _ in 0..3 {
            let outcomes = block_on_ready(failover.check(&takes, None, None)).unwrap();
            let read = outcomes[0].decision().copied();
            assert!(read.is_some_and(|d| d.allowed()), "{outcomes:?}");
            assert_eq!(
                outcomes[1],
                Outcome::Unavailable {
                    reason: Unavailable::Connection
                }
            );
            assert_eq!(outcomes[1].decision(), None);
        }
        let alone = [takes[0]];
        assert!(block_on_ready(failover.check(&alone, None, None)).unwrap()[0].allowed());
        assert!(!block_on_ready(failover.check(&alone, None, None)).unwrap()[0].allowed());
    }

    #[test]
    fn open_limits_spend_a_bounded_emergency_budget() {
        let clock = ManualClock::new();
        let failover = Failover::with_clock(Down, clock.clone());
        let l = limit(100, "100/s");
        let takes = [Guarded {
            take: Take::new("k", &l, 1),
            on_failure: FailureMode::Open {
                emergency: limit(2, "2/s"),
            },
        }];
        let allowed = (0..10)
            .filter(|_| block_on_ready(failover.check(&takes, None, None)).unwrap()[0].allowed())
            .count();
        assert_eq!(
            allowed, 2,
            "the emergency budget, not the limit and not unlimited"
        );
        clock.advance(Duration::from_millis(500));
        assert!(block_on_ready(failover.check(&takes, None, None)).unwrap()[0].allowed());
        let outcome = block_on_ready(failover.check(&takes, None, None)).unwrap()[0];
        assert_eq!(outcome.degraded(), Some(Unavailable::Connection));
        assert_eq!(failover.stats().emergency, 12);
    }

    #[test]
    fn a_closed_limit_denies_the_request_and_charges_no_emergency_bucket() {
        let failover = Failover::with_clock(Down, ManualClock::new());
        let l = limit(10, "1/s");
        let emergency = limit(1, "1/s");
        let takes = [
            Guarded {
                take: Take::new("open", &l, 1),
                on_failure: FailureMode::Open { emergency },
            },
            Guarded {
                take: Take::new("closed", &l, 1),
                on_failure: FailureMode::Closed,
            },
        ];
        for _ in 0..3 {
            let outcomes = block_on_ready(failover.check(&takes, None, None)).unwrap();
            assert!(outcomes[0].allowed(), "the open limit alone would pass");
            assert_eq!(
                outcomes[1],
                Outcome::Unavailable {
                    reason: Unavailable::Connection
                }
            );
        }
        assert_eq!(
            failover.stats(),
            FailoverStats {
                emergency: 3,
                unavailable: 3
            }
        );
        // Nothing was charged: the single emergency token is still there.
        let alone = [takes[0]];
        assert!(block_on_ready(failover.check(&alone, None, None)).unwrap()[0].allowed());
        assert!(!block_on_ready(failover.check(&alone, None, None)).unwrap()[0].allowed());
    }

    /// Where the test's log lines go.
    #[derive(Clone, Default)]
    struct Lines(std::sync::Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// An outage logs a line a second at most, and the next line counts the degraded
    /// decisions the quiet second held back.
    #[test]
    fn degraded_decisions_are_logged_once_a_second_with_a_count_of_the_rest() {
        let clock = ManualClock::new();
        let failover = Failover::with_clock(Down, clock.clone());
        let l = limit(10, "1/s");
        let takes = [
            Guarded {
                take: Take::new("open", &l, 1),
                on_failure: FailureMode::Open {
                    emergency: limit(100, "100/s"),
                },
            },
            Guarded {
                take: Take::new("closed", &l, 1),
                on_failure: FailureMode::Closed,
            },
        ];
        let lines = Lines::default();
        let writer = lines.clone();
        let dispatch = tracing::Dispatch::new(
            tracing_subscriber::fmt()
                .with_writer(move || writer.clone())
                .with_ansi(false)
                .without_time()
                .finish(),
        );
        let logged = |calls: usize| {
            tracing::dispatcher::with_default(&dispatch, || {
                for _ in 0..calls {
                    block_on_ready(failover.check(&takes, None, None)).unwrap();
                }
            });
            let text = String::from_utf8(std::mem::take(&mut *lines.0.lock().unwrap())).unwrap();
            text.lines().map(str::to_owned).collect::<Vec<_>>()
        };
        let first = logged(1);
        assert_eq!(first.len(), 1, "{first:?}");
        assert!(
            first[0].contains("emergency=1 unavailable=1 not_logged_since_last=0"),
            "{first:?}"
        );
        clock.advance(Duration::from_millis(999));
        assert_eq!(logged(3), Vec::<String>::new());
        clock.advance(Duration::from_millis(1));
        let next = logged(2);
        assert_eq!(next.len(), 1, "{next:?}");
        assert!(
            next[0].contains("emergency=1 unavailable=1 not_logged_since_last=6"),
            "{next:?}"
        );
    }

    #[test]
    fn input_errors_are_not_outages() {
        let failover =
            Failover::with_clock(LocalStore::new(ManualClock::new()), ManualClock::new());
        let l = limit(1, "1/s");
        let takes = [Guarded {
            take: Take::new("k", &l, 2),
            on_failure: FailureMode::Closed,
        }];
        assert!(matches!(
            block_on_ready(failover.check(&takes, None, None)),
            Err(Error::InvalidCost { .. })
        ));
    }
}
