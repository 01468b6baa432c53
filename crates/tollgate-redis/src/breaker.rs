//! A circuit breaker, so a dead or stalled Redis costs one timeout, not one per request.
//!
//! After `threshold` consecutive failures the breaker opens: requests fail at once with
//! [`Unavailable::CircuitOpen`] and take their limit's failure mode, keeping latency bounded.
//! After the cool-down one request is let through as a probe (half-open); its success closes
//! the breaker, its failure reopens it with twice the cool-down, up to a maximum. Requests are
//! never queued while open, so recovery sends Redis one probe and then ordinary traffic, not a
//! backlog released at once.

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
    /// Longest cool-down after repeated failed probes (default 10 s).
    pub max_cool_down: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            threshold: 3,
            cool_down: Duration::from_millis(500),
            max_cool_down: Duration::from_secs(10),
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

    /// May a request go to Redis now?
    pub(crate) fn permit(&self) -> Result<Permit, Unavailable> {
        let mut state = self.state();
        match *state {
            State::Closed { .. } => Ok(Permit::Call),
            State::Open { until, cool_down } if self.clock.now() >= until => {
                *state = State::HalfOpen { cool_down };
                Ok(Permit::Probe)
            }
            State::Open { .. } | State::HalfOpen { .. } => Err(Unavailable::CircuitOpen),
        }
    }

    /// Reports a request's result.
    pub(crate) fn record(&self, permit: Permit, ok: bool) -> Option<Transition> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate::ManualClock;

    #[test]
    fn opens_after_threshold_probes_and_closes() {
        let clock = ManualClock::new();
        let breaker = Breaker::new(BreakerConfig::default(), clock.clone());
        for _ in 0..2 {
            assert_eq!(breaker.permit(), Ok(Permit::Call));
            assert_eq!(breaker.record(Permit::Call, false), None);
        }
        assert_eq!(
            breaker.record(Permit::Call, false),
            Some(Transition::Opened)
        );
        assert_eq!(breaker.permit(), Err(Unavailable::CircuitOpen));
        clock.advance(Duration::from_millis(500));
        assert_eq!(breaker.permit(), Ok(Permit::Probe));
        // Only one probe at a time.
        assert_eq!(breaker.permit(), Err(Unavailable::CircuitOpen));
        assert_eq!(
            breaker.record(Permit::Probe, true),
            Some(Transition::Closed)
        );
        assert_eq!(breaker.permit(), Ok(Permit::Call));
    }

    #[test]
    fn failed_probes_back_off_up_to_the_maximum() {
        let clock = ManualClock::new();
        let breaker = Breaker::new(BreakerConfig::default(), clock.clone());
        for _ in 0..3 {
            breaker.record(Permit::Call, false);
        }
        let mut wait = Duration::from_millis(500);
        for _ in 0..8 {
            clock.advance(wait - Duration::from_nanos(1));
            assert!(breaker.permit().is_err());
            clock.advance(Duration::from_nanos(1));
            assert_eq!(breaker.permit(), Ok(Permit::Probe));
            assert_eq!(
                breaker.record(Permit::Probe, false),
                Some(Transition::ProbeFailed)
            );
            wait = (wait * 2).min(Duration::from_secs(10));
        }
        assert!(breaker.is_open());
    }

    #[test]
    fn a_success_resets_the_failure_count() {
        let breaker = Breaker::new(BreakerConfig::default(), ManualClock::new());
        for _ in 0..10 {
            breaker.record(Permit::Call, false);
            breaker.record(Permit::Call, false);
            breaker.record(Permit::Call, true);
        }
        assert!(!breaker.is_open());
    }
}
