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
        let version = self.current.load().version().to_owned();
        match reason {
            Some(reason) => {
                let on = ShadowAll {
                    since: self.options.wall.now(),
                    reason: reason.to_owned(),
                };
                control.shadow_all = Some(on.clone());
                self.shadow_all.store(true, Ordering::Relaxed);
                self.audit(|| AuditEvent::ShadowAllOn {
                    reason: on.reason.clone(),
                    policy_version: version,
                });
                Some(on)
            }
            None => {
                self.shadow_all.store(false, Ordering::Relaxed);
                // Off when it is off already: nothing to audit.
                if let Some(was) = control.shadow_all.take() {
                    self.audit(|| AuditEvent::ShadowAllOff {
                        reason: was.reason,
                        since: was.since.to_rfc3339(),
                        policy_version: version,
                    });
                }
                None
            }
        }
    }

    /// Whether every limit is in shadow mode now, since when and why.
    pub fn shadow_all(&self) -> Option<ShadowAll> {
        self.control.lock().shadow_all.clone()
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
