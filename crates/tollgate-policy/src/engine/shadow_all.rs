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
//!
//! When the trouble is known to be one service's, the switch can be narrowed to some domains
//! or some limits ([`ShadowScope`]), so that the limits protecting everything else keep
//! enforcing through the incident.

use std::sync::atomic::Ordering;

use crate::audit::AuditEvent;
use crate::policy::{Effect, LimitDef, Matched, Policy};
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
    /// Which limits it puts in shadow mode: every limit unless narrowed.
    pub scope: ShadowScope,
}

impl ShadowAll {
    /// The fleet's switch, as a process read it from the shared store: turned on at `since`
    /// for `reason`, for every limit.
    pub fn fleet(since: UnixTime, reason: impl Into<String>) -> Self {
        Self {
            since,
            reason: reason.into(),
            fleet: true,
            scope: ShadowScope::all(),
        }
    }

    /// The same switch for the limits of `scope` alone.
    #[must_use]
    pub fn within(self, scope: ShadowScope) -> Self {
        Self { scope, ..self }
    }
}

/// The limits a switch puts in shadow mode: those of its domains and those it names, or every
/// limit when it lists neither.
///
/// ```
/// use tollgate_policy::{EngineOptions, PolicyEngine, ShadowScope, compile};
///
/// let policy = compile("p.yaml", "limits:
///   - {name: checkout, domain: shop, capacity: 1, refill: 1/h}
///   - {name: search, domain: shop, capacity: 1, refill: 1/h}
///   - {name: login, domain: auth, capacity: 1, refill: 1/h}
/// ")?;
/// let engine = PolicyEngine::new(policy, EngineOptions::default());
/// let user = [[("user", "u1")]];
/// for domain in ["shop", "auth", "shop", "auth"] {
///     engine.decide(domain, &user, 1, None)?;
/// }
///
/// // Only checkout stops rejecting: search and login protect what they did.
/// engine.set_shadow_within("INC-42: checkout", ShadowScope::limits(["checkout"]));
/// let shop = engine.decide("shop", &user, 1, None)?;
/// assert!(!shop.allowed);
/// assert_eq!(shop.limits[0].mode, "shadow");
/// assert_eq!(shop.limits[1].mode, "enforce");
///
/// // The whole auth domain stops rejecting.
/// engine.set_shadow_within("INC-43: logins", ShadowScope::domains(["auth"]));
/// assert!(engine.decide("auth", &user, 1, None)?.allowed);
/// assert!(!engine.decide("shop", &user, 1, None)?.allowed);
/// # Ok::<(), tollgate_policy::Error>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShadowScope {
    domains: Vec<String>,
    limits: Vec<String>,
}

impl ShadowScope {
    /// Every limit.
    pub fn all() -> Self {
        Self::default()
    }

    /// The limits of these domains.
    pub fn domains<S: Into<String>>(domains: impl IntoIterator<Item = S>) -> Self {
        Self::all().with_domains(domains)
    }

    /// The limits of these names.
    pub fn limits<S: Into<String>>(limits: impl IntoIterator<Item = S>) -> Self {
        Self::all().with_limits(limits)
    }

    /// The limits of these domains as well.
    #[must_use]
    pub fn with_domains<S: Into<String>>(mut self, domains: impl IntoIterator<Item = S>) -> Self {
        self.domains.extend(domains.into_iter().map(Into::into));
        self.domains.sort_unstable();
        self.domains.dedup();
        self
    }

    /// The limits of these names as well.
    #[must_use]
    pub fn with_limits<S: Into<String>>(mut self, limits: impl IntoIterator<Item = S>) -> Self {
        self.limits.extend(limits.into_iter().map(Into::into));
        self.limits.sort_unstable();
        self.limits.dedup();
        self
    }

    /// The domains listed, in order.
    pub fn domain_names(&self) -> &[String] {
        &self.domains
    }

    /// The limits named, in order.
    pub fn limit_names(&self) -> &[String] {
        &self.limits
    }

    /// Whether it is every limit.
    pub fn is_all(&self) -> bool {
        self.domains.is_empty() && self.limits.is_empty()
    }

    /// Whether `limit` is in it.
    pub fn covers(&self, limit: &LimitDef) -> bool {
        self.is_all()
            || self.domains.iter().any(|d| d == limit.domain())
            || self.limits.iter().any(|n| n == limit.name())
    }

    /// The domains and limits it lists that `policy` has none of (`domain NAME`, `limit
    /// NAME`): a switch narrowed to a misspelt name would leave the rejections it was meant to
    /// stop.
    pub fn unknown_in(&self, policy: &Policy) -> Vec<String> {
        let domains = self
            .domains
            .iter()
            .filter(|d| !policy.limits().iter().any(|l| l.domain() == d.as_str()))
            .map(|d| format!("domain {d}"));
        let limits = self
            .limits
            .iter()
            .filter(|n| policy.limit(n).is_none())
            .map(|n| format!("limit {n}"));
        domains.chain(limits).collect()
    }
}

/// What the switches in force cover, read by decisions while one is on.
#[derive(Debug, Default)]
pub(super) struct Coverage(Vec<ShadowScope>);

impl Coverage {
    fn covers(&self, limit: &LimitDef) -> bool {
        self.0.iter().any(|scope| scope.covers(limit))
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
        match reason {
            Some(reason) => Some(self.set_shadow_within(reason, ShadowScope::all())),
            None => {
                let mut control = self.control.lock();
                let was = control.shadow_all.take();
                self.switched(&control, was, None);
                None
            }
        }
    }

    /// Puts the limits of `scope` in shadow mode, for `reason`, from the next decision on, in
    /// place of what this process's switch covered before; answers the switch's state after.
    /// Turning on what is on, over the same scope, changes nothing (the first reason and time
    /// stay) and is not audited; a new scope is a change, audited with its reason. Names
    /// `scope` lists that the policy lacks cover nothing ([`ShadowScope::unknown_in`] finds
    /// them).
    pub fn set_shadow_within(&self, reason: &str, scope: ShadowScope) -> ShadowAll {
        let mut control = self.control.lock();
        if let Some(on) = &control.shadow_all
            && on.scope == scope
        {
            return on.clone();
        }
        let on = ShadowAll {
            since: self.options.wall.now(),
            reason: reason.to_owned(),
            fleet: false,
            scope,
        };
        let was = control.shadow_all.replace(on.clone());
        self.switched(&control, was, Some(on.clone()));
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
        let scopes: Vec<ShadowScope> = [&control.shadow_all, &control.fleet_shadow_all]
            .into_iter()
            .flatten()
            .map(|on| on.scope.clone())
            .collect();
        let on = !scopes.is_empty();
        // The scopes go first: a decision that sees the flag must find them.
        self.shadow_coverage
            .store(std::sync::Arc::new(Coverage(scopes)));
        self.shadow_all.store(on, Ordering::Release);
        let version = self.current.load().version().to_owned();
        match (was, now) {
            (_, Some(now)) => self.audit(|| AuditEvent::ShadowAllOn {
                reason: now.reason,
                fleet: now.fleet,
                domains: now.scope.domains,
                limits: now.scope.limits,
                policy_version: version,
            }),
            // Off when it was off already: nothing to audit.
            (Some(was), None) => self.audit(|| AuditEvent::ShadowAllOff {
                reason: was.reason,
                since: was.since.to_rfc3339(),
                fleet: was.fleet,
                domains: was.scope.domains,
                limits: was.scope.limits,
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

    /// Under a switch, an enforced match it covers is decided as a shadow one. One load per
    /// decision while none is on.
    pub(super) fn shadow_if_switched<P>(&self, matched: &mut [Matched<'_, P>]) {
        if self.shadow_all.load(Ordering::Acquire) {
            let coverage = self.shadow_coverage.load();
            for m in matched {
                if m.effect == Effect::Enforce && coverage.covers(m.limit) {
                    m.effect = Effect::Shadow;
                }
            }
        }
    }
}
