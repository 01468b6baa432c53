//! A circuit breaker, so a dead or stalled Redis costs one timeout, not one per request.
//!
//! After `threshold` consecutive failures the breaker opens: requests fail at once with
//! [`Unavailable::CircuitOpen`] and take their limit's failure mode, keeping latency bounded.
//! After the cool-down one request is let through as a probe (half-open); its success closes
//! the breaker, its failure reopens it with twice the cool-down, up to a maximum. Requests are
//! never queued while open, so recovery sends Redis one probe and then ordinary traffic, not a
//! backlog released at once. A probe whose caller gives up on it (drops the request) says
//! nothing about Redis: it hands the probe on to the next request rather than leaving the breaker
//! half-open, refusing everything, for good.

use std::sync::Mutex;
use std::time::Duration;

use tollgate::{Clock, Timestamp, Unavailable};

/// Breaker settings.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct BreakerConfig {
    /// Consecutive failures that open the breaker (default 3).
    pub threshold: u32,
    /// First cool-down before a probe (default 500 ms).
    pub cool_down: Duration,
    /// Longest cool-down after repeated failed probes (default 2 s). It bounds how long
    /// decisions keep taking their failure modes after Redis is back (a restart, a cluster's
    /// failover), so it is short: a probe costs one call, at most the store's timeout.
    pub max_cool_down: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            threshold: 3,
            cool_down: Duration::from_millis(500),
            max_cool_down: Duration::from_secs(2),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Closed {
        failures: u32,
    },
    Open {
        until: Timestamp,
        cool_down: Duration,
    },
    HalfOpen {
        cool_down: Duration,
    },
}

/// What the breaker says about a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Permit {
    /// Go ahead.
    Call,
    /// Go ahead: this request is the probe; report its result.
    Probe,
}

/// Breaker state changes worth a log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Transition {
    Opened,
    /// A probe failed: the breaker is open again, for longer.
    ProbeFailed,
    Closed,
}

/// The breaker. Its lock is held for a few instructions, never across a call.
#[derive(Debug)]
pub(crate) struct Breaker<C> {
    config: BreakerConfig,
    clock: C,
    state: Mutex<State>,
}

impl<C: Clock> Breaker<C> {
    pub(crate) fn new(config: BreakerConfig, clock: C) -> Self {
        Self {
            config,
            clock,
            state: Mutex::new(State::Closed { failures: 0 }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding this lock cannot leave the state half-written (every write is a
        // single assignment), so a poisoned lock is still usable.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// May a request go to Redis now? The answer is a ticket to report the request's result
    /// with; dropped unreported, it gives a probe back.
    pub(crate) fn permit(&self) -> Result<Ticket<'_, C>, Unavailable> {
        let mut state = self.state();
        let permit = match *state {
            State::Closed { .. } => Permit::Call,
            State::Open { until, cool_down } if self.clock.now() >= until => {
                *state = State::HalfOpen { cool_down };
                Permit::Probe
            }
            State::Open { .. } | State::HalfOpen { .. } => return Err(Unavailable::CircuitOpen),
        };
        Ok(Ticket {
            breaker: self,
            permit: Some(permit),
        })
    }

    /// A probe ended without a result: the breaker is open as before, with its cool-down
    /// already over, so the next request probes.
    fn release(&self, permit: Permit) {
        let mut state = self.state();
        if let (State::HalfOpen { cool_down }, Permit::Probe) = (*state, permit) {
            *state = State::Open {
                until: self.clock.now(),
                cool_down,
            };
        }
    }

    /// Reports a request's result.
    fn record(&self, permit: Permit, ok: bool) -> Option<Transition> {
        let mut state = self.state();
        match (*state, permit, ok) {
            (State::HalfOpen { .. }, Permit::Probe, true) => {
                *state = State::Closed { failures: 0 };
                Some(Transition::Closed)
            }
            (State::HalfOpen { cool_down }, Permit::Probe, false) => {
                let cool_down = (cool_down * 2).min(self.config.max_cool_down);
                *state = State::Open {
                    until: self.clock.now() + cool_down,
                    cool_down,
                };
                Some(Transition::ProbeFailed)
            }
            (State::Closed { .. }, _, true) => {
                *state = State::Closed { failures: 0 };
                None
            }
            (State::Closed { failures }, _, false) => {
                let failures = failures + 1;
                if failures >= self.config.threshold.max(1) {
                    *state = State::Open {
                        until: self.clock.now() + self.config.cool_down,
                        cool_down: self.config.cool_down,
                    };
                    Some(Transition::Opened)
                } else {
                    *state = State::Closed { failures };
                    None
                }
            }
            // Results of calls that started before the breaker opened: already accounted for.
            _ => None,
        }
    }

    /// Whether requests are being failed fast now.
    pub(crate) fn is_open(&self) -> bool {
        !matches!(*self.state(), State::Closed { .. })
    }
}

/// One request's leave to go to Redis, from [`Breaker::permit`] until its result is reported.
/// Callers drop requests (a client gone, an outer timeout): a probe dropped before its result
/// is reported is released, so the breaker cannot stay half-open with no probe left to end it.
#[derive(Debug)]
#[must_use = "report the request's result with `record`"]
pub(crate) struct Ticket<'a, C: Clock> {
    breaker: &'a Breaker<C>,
    /// `None` once reported.
    permit: Option<Permit>,
}

impl<C: Clock> Ticket<'_, C> {
    /// What the breaker said.
    #[cfg(test)]
    pub(crate) fn permit(&self) -> Option<Permit> {
        self.permit
    }

    /// Reports the request's result: `ok` when Redis answered in time.
    pub(crate) fn record(mut self, ok: bool) -> Option<Transition> {
        let permit = self.permit.take()?;
        self.breaker.record(permit, ok)
    }
}

impl<C: Clock> Drop for Ticket<'_, C> {
    fn drop(&mut self) {
        if let Some(permit) = self.permit.take() {
            self.breaker.release(permit);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate::ManualClock;

    /// Asks for a permit and reports `ok` with it at once.
    fn call(breaker: &Breaker<ManualClock>, ok: bool) -> Option<Transition> {
        breaker.permit().ok()?.record(ok)
    }

    #[test]
    fn opens_after_threshold_probes_and_closes() {
        let clock = ManualClock::new();
        let breaker = Breaker::new(BreakerConfig::default(), clock.clone());
        for _ in 0..2 {
            let ticket = breaker.permit().unwrap();
            assert_eq!(ticket.permit(), Some(Permit::Call));
            assert_eq!(ticket.record(false), None);
        }
        assert_eq!(call(&breaker, false), Some(Transition::Opened));
        assert_eq!(breaker.permit().err(), Some(Unavailable::CircuitOpen));
        clock.advance(Duration::from_millis(500));
        let probe = breaker.permit().unwrap();
        assert_eq!(probe.permit(), Some(Permit::Probe));
        // Only one probe at a time.
        assert_eq!(breaker.permit().err(), Some(Unavailable::CircuitOpen));
        assert_eq!(probe.record(true), Some(Transition::Closed));
        assert_eq!(breaker.permit().unwrap().permit(), Some(Permit::Call));
    }

    #[test]
    fn failed_probes_back_off_up_to_the_maximum() {
        let clock = ManualClock::new();
        let breaker = Breaker::new(BreakerConfig::default(), clock.clone());
        for _ in 0..3 {
            call(&breaker, false);
        }
        let mut wait = Duration::from_millis(500);
        for _ in 0..8 {
            clock.advance(wait - Duration::from_nanos(1));
            assert!(breaker.permit().is_err());
            clock.advance(Duration::from_nanos(1));
            let probe = breaker.permit().unwrap();
            assert_eq!(probe.permit(), Some(Permit::Probe));
            assert_eq!(probe.record(false), Some(Transition::ProbeFailed));
            wait = (wait * 2).min(Duration::from_secs(2));
        }
        assert!(breaker.is_open());
    }

    #[test]
    fn a_success_resets_the_failure_count() {
        let breaker = Breaker::new(BreakerConfig::default(), ManualClock::new());
        for _ in 0..10 {
            call(&breaker, false);
            call(&breaker, false);
            call(&breaker, true);
        }
        assert!(!breaker.is_open());
    }

    #[test]
    fn a_dropped_probe_hands_the_probe_on() {
        let clock = ManualClock::new();
        let breaker = Breaker::new(BreakerConfig::default(), clock.clone());
        for _ in 0..3 {
            call(&breaker, false);
        }
        clock.advance(Duration::from_millis(500));
        let probe = breaker.permit().unwrap();
        assert_eq!(probe.permit(), Some(Permit::Probe));
        drop(probe);
        // Still open (nothing was learned), but the next request is the probe, at once.
        assert!(breaker.is_open());
        let probe = breaker.permit().unwrap();
        assert_eq!(probe.permit(), Some(Permit::Probe));
        assert_eq!(probe.record(true), Some(Transition::Closed));
        // A dropped ordinary call changes nothing.
        drop(breaker.permit().unwrap());
        assert!(!breaker.is_open());
    }
}
