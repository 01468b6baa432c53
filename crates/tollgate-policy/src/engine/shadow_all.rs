//! An operator's switch that puts every limit in shadow mode at once.
//!
//! When a rate limiter rejects traffic it should not (a bad policy, a client that changed how
//! it names itself, a store answering wrong), the first thing an operator wants is for the
//! rejections to stop now, before anyone works out which limit or which change is to blame.
//! Editing the policy takes a review and a deploy, and a rollback only helps when the last
//! change is the cause. This switch takes effect on the next decision: every limit that would
//! enforce is decided as in shadow mode (charged, counted and reported as `shadow`, never
//! rejecting), deny limits and limits failing closed included, so the metrics keep showing
//! what would have been rejected while nothing is. It outlives reloads and rollbacks, since
//! it is about the process and not about one version, and each switch is audited with its
//! reason. Exemptions still apply, and buckets are kept: switching back finds every balance
//! where the traffic left it.

use std::sync::atomic::Ordering;

use crate::audit::AuditEvent;
use crate::policy::{Effect, Matched};
use crate::wall::UnixTime;

use super::PolicyEngine;

/// Every limit decided in shadow mode, since when and why ([`PolicyEngine::set_shadow_all`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShadowAll {
    /// When the switch was turned on.
    pub since: UnixTime,
    /// Why, as the operator gave it.
    pub reason: String,
    /// Whether it is the fleet's switch, read from a store every process shares
    /// ([`PolicyEngine::set_fleet_shadow_all`]), rather than this process's own.
    pub fleet: bool,
}

impl ShadowAll {
    /// The fleet's switch, as a process read it from the shared store: turned on at `since`
    /// for `reason`.
    pub fn fleet(since: UnixTime, reason: impl Into<String>) -> Self {
        Self {
            since,
            reason: reason.into(),
            fleet: true,
        }
    }
}

impl PolicyEngine {
    /// Puts every limit in shadow mode, for `reason` (`Some`), or gives each its own mode back
    /// (`None`), from the next decision on; answers the switch's state after. Turning on what
    /// is on, or off what is off, changes nothing (the first reason and time stay) and is not
    /// audited; each change is.
    ///
    /// ```
    /// use tollgate_policy::{EngineOptions, PolicyEngine, compile};
    ///
    /// let policy = compile("p.yaml", "limits:\n  - {name: one, domain: api, capacity: 1, refill: 1/h}\n")?;
    /// let engine = PolicyEngine::new(policy, EngineOptions::default());
    /// assert!(engine.decide("api", &[[("user", "u1")]], 1, None)?.allowed);
    /// assert!(!engine.decide("api", &[[("user", "u1")]], 1, None)?.allowed);
    ///
    /// engine.set_shadow_all(Some("INC-42: checkout rejected by mistake"));
    /// let outcome = engine.decide("api", &[[("user", "u1")]], 1, None)?;
    /// assert!(outcome.allowed && outcome.limits[0].would_reject());
    /// assert_eq!(outcome.limits[0].mode, "shadow");
    ///
    /// engine.set_shadow_all(None);
    /// assert!(!engine.decide("api", &[[("user", "u1")]], 1, None)?.allowed);
    /// # Ok::<(), tollgate_policy::Error>(())
    /// ```
    pub fn set_shadow_all(&self, reason: Option<&str>) -> Option<ShadowAll> {
        let mut control = self.control.lock();
        if let (Some(_), Some(on)) = (reason, &control.shadow_all) {
            return Some(on.clone());
        }
        let on = reason.map(|reason| ShadowAll {
            since: self.options.wall.now(),
            reason: reason.to_owned(),
            fleet: false,
        });
        let was = std::mem::replace(&mut control.shadow_all, on.clone());
        self.switched(&control, was, on.clone());
        on
    }

    /// Puts every limit in shadow mode by the fleet's switch (`Some`), or takes that away
    /// (`None`), beside this process's own switch: either puts every limit in shadow mode.
    /// What a server calls with what it reads, every second, from the store its fleet shares;
    /// a value equal to the one in force changes nothing, and each change is audited (with
    /// `fleet: true`) in every process that reads it.
    pub fn set_fleet_shadow_all(&self, fleet: Option<ShadowAll>) {
        let mut control = self.control.lock();
        let fleet = fleet.map(|on| ShadowAll { fleet: true, ..on });
        if control.fleet_shadow_all == fleet {
            return;
        }
        let was = std::mem::replace(&mut control.fleet_shadow_all, fleet.clone());
        self.switched(&control, was, fleet);
    }

    /// Audits a change of one switch from `was` to `now`, and sets what decisions read.
    fn switched(&self, control: &super::Control, was: Option<ShadowAll>, now: Option<ShadowAll>) {
        let on = control.shadow_all.is_some() || control.fleet_shadow_all.is_some();
        self.shadow_all.store(on, Ordering::Relaxed);
        let version = self.current.load().version().to_owned();
        match (was, now) {
            (_, Some(now)) => self.audit(|| AuditEvent::ShadowAllOn {
                reason: now.reason,
                fleet: now.fleet,
                policy_version: version,
            }),
            // Off when it was off already: nothing to audit.
            (Some(was), None) => self.audit(|| AuditEvent::ShadowAllOff {
                reason: was.reason,
                since: was.since.to_rfc3339(),
                fleet: was.fleet,
                policy_version: version,
            }),
            (None, None) => {}
        }
    }

    /// Whether every limit is in shadow mode now, since when and why: this process's switch
    /// when it is on, else the fleet's.
    pub fn shadow_all(&self) -> Option<ShadowAll> {
        let control = self.control.lock();
        control
            .shadow_all
            .clone()
            .or_else(|| control.fleet_shadow_all.clone())
    }

    /// Under the switch, an enforced match is decided as a shadow one. One relaxed load per
    /// decision while it is off.
    pub(super) fn shadow_if_switched<P>(&self, matched: &mut [Matched<'_, P>]) {
        if self.shadow_all.load(Ordering::Relaxed) {
            for m in matched {
                if m.effect == Effect::Enforce {
                    m.effect = Effect::Shadow;
                }
            }
        }
    }
}
