//! Concurrency limits through the engine: leases taken and given back against the policy in
//! force.
//!
//! A concurrency limit is not checked the way a rate is: a request takes a lease before it
//! starts and gives it back when it ends, and a lease nobody gives back times out (SPEC §3,
//! [`tollgate::LeaseStore`]). So it has calls of its own, which servers put behind
//! `POST /v1/leases` and `DELETE /v1/leases/{lease_id}`: the engine matches the policy's
//! concurrency limits ([`crate::Policy::lease_matches`], the same rules as for rate limits),
//! takes one lease over all of them in one all-or-nothing acquire, and frees it by its id
//! alone.
//!
//! A deny limit that applies, or a concurrency limit's deny override, refuses the lease
//! whatever is held ([`LeaseDecision::denied`]): nothing is taken anywhere, the other keys are
//! only read, and the store is not needed for it, so the refusal stands while the store is
//! down too (an ordinary rejection then, not a failure).
//!
//! # Keys across versions
//!
//! Leases live under the same store keys as buckets (`store_key`: the bucket key, the subject
//! in `{braces}`, a parameter tag), but a concurrency limit's tag covers only its algorithm. A
//! reload that changes `max_in_flight` or `lease_timeout` keeps every lease held under its key,
//! counted against the new bound (a lower one admits nothing until enough of them end); a
//! lease keeps the timeout it was taken with. Nothing is carried over: there is no balance to
//! convert.
//!
//! # While the shared store is down
//!
//! [`PolicyEngine::acquire_degraded`] follows each limit's failure mode: closed denies, open
//! takes the lease in a table of this process bounded per key by the limit's emergency. Such a
//! lease lives there until released or timed out, which is why a release looks there first.
//! The shared store never sees it: for one lease timeout after the store is back, a key may
//! hold up to its emergency bound beyond `max_in_flight`.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tollgate::{
    LeaseDecision, LeaseLimit, LeaseRequest, LeaseStore, LeaseTake, block_on_ready, check_lease_id,
};

use super::{PolicyEngine, store_key};
use crate::audit::AuditEvent;
use crate::error::Error;
use crate::policy::{Descriptor, Effect, FailureMode, LeaseMatched};

/// The result of one lease request (an acquire, or an explanation of one).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct LeaseOutcome {
    /// Whether the request may go ahead: no enforced limit was full.
    pub allowed: bool,
    /// The policy version that decided.
    pub policy_version: Arc<str>,
    /// Every applicable concurrency limit, grouped by descriptor, in declaration order.
    pub limits: Vec<LeaseLimitOutcome>,
    /// Decided without the shared store ([`PolicyEngine::acquire_degraded`]).
    pub degraded: bool,
    /// Denied because a limit fails closed while the store is down: not an ordinary rejection
    /// (HTTP 503 / gRPC UNAVAILABLE rather than 429).
    pub failed_closed: bool,
    /// Whether the lease id now holds a slot somewhere, so that the caller must release it
    /// (or let it time out). False when rejected, when no concurrency limit applied, when
    /// every one was exempt, when every one that applied was full but could not reject, and
    /// for an explanation.
    pub held: bool,
}

impl LeaseOutcome {
    /// Whether no concurrency limit applied (the request is allowed, holding nothing, and
    /// counted as unmatched).
    pub fn unmatched(&self) -> bool {
        self.limits.is_empty()
    }

    /// For a rejected request, how long until every enforced limit that was full has a slot
    /// free by timeout (the largest of their `retry_after`): the latest a retry can wait for,
    /// since a release may free one sooner. `None` when allowed or failed closed.
    pub fn retry_after(&self) -> Option<Duration> {
        if self.allowed {
            return None;
        }
        self.limits
            .iter()
            .filter(|l| l.mode == Effect::Enforce.as_str())
            .filter_map(|l| l.decision.and_then(|d| d.retry_after()))
            .max()
    }

    fn unmatched_at(policy_version: Arc<str>, degraded: bool) -> Self {
        Self {
            allowed: true,
            policy_version,
            limits: Vec::new(),
            degraded,
            failed_closed: false,
            held: false,
        }
    }
}

/// What one applicable concurrency limit decided.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct LeaseLimitOutcome {
    /// The limit's name.
    pub name: Arc<str>,
    /// The request descriptor it matched.
    pub descriptor: usize,
    /// The key its leases are counted under.
    pub bucket_key: String,
    /// `enforce`, `shadow`, `rollout` (outside a rollout: held when free, like shadow) or
    /// `exempt`.
    pub mode: &'static str,
    /// The key's decision; `None` when exempt (not decided at all), or degraded and either
    /// failing closed or not enforced.
    pub decision: Option<LeaseDecision>,
    /// The owner of the exemption that lifted the limit.
    pub exempted_by: Option<String>,
}

impl LeaseLimitOutcome {
    /// Whether the key was full, whatever the mode (a shadow limit that would have rejected
    /// says so here while the request is allowed).
    pub fn would_reject(&self) -> bool {
        self.decision.is_some_and(|d| !d.allowed())
    }
}

/// One distinct key of an acquire, with the limit it is counted under.
struct Slot {
    key: Box<str>,
    limit: LeaseLimit,
    /// Whether a full key fails the acquire: any enforced match on it.
    enforce: bool,
    /// The first match on it, to name its limit in errors.
    first: usize,
}

/// The distinct keys of `matched` (exempt matches and denials left out: they hold nothing),
/// and the slot of each match (`usize::MAX` for none). Two descriptors that land on one key
/// take one slot.
fn slots(matched: &[LeaseMatched<'_>]) -> (Vec<Slot>, Vec<usize>) {
    let mut slots: Vec<Slot> = Vec::with_capacity(matched.len());
    let mut slot_of = Vec::with_capacity(matched.len());
    for (i, m) in matched.iter().enumerate() {
        if matches!(m.effect, Effect::Exempt(_)) || m.denied {
            slot_of.push(usize::MAX);
            continue;
        }
        let key = store_key(&m.bucket_key, m.subject(), m.tag);
        let enforce = m.effect == Effect::Enforce;
        match slots.iter().position(|s| s.key == key) {
            Some(at) => {
                // One key is one limit and one subject, so its matches agree, but for an
                // exemption that looks at entries outside the key: those are left out above.
                slots[at].enforce |= enforce;
                slot_of.push(at);
            }
            None => {
                slot_of.push(slots.len());
                slots.push(Slot {
                    key,
                    limit: *m.params(),
                    enforce,
                    first: i,
                });
            }
        }
    }
    (slots, slot_of)
}

/// What `m` decided, given the decision of its slot: a denial decides by itself, an exempt
/// match not at all.
fn decision_of(m: &LeaseMatched<'_>, slot: Option<LeaseDecision>) -> Option<LeaseDecision> {
    match m.effect {
        Effect::Exempt(_) => None,
        _ if m.denied => Some(LeaseDecision::denied()),
        _ => slot,
    }
}

/// A lease error from the core, as the policy's check error: errors about the lease id or the
/// lease table name no limit, the others `limit`.
fn lease_error(limit: &str, source: tollgate::Error) -> Error {
    let limit = match source {
        tollgate::Error::InvalidLeaseId { .. }
        | tollgate::Error::LeaseIdInUse
        | tollgate::Error::TooManyLeases { .. } => String::new(),
        _ => limit.to_owned(),
    };
    Error::Check { limit, source }
}

impl PolicyEngine {
    /// Takes lease `lease_id` on every concurrency limit that applies to the request, in this
    /// process's lease table, all or nothing.
    ///
    /// * Enforced limits pass only if each has a free slot; if one is full, nothing is held
    ///   anywhere, and [`LeaseOutcome::retry_after`] says when a slot frees itself.
    /// * Shadow limits, and enforced limits whose subject is outside the rollout, never reject:
    ///   they hold a slot when they have one free (so their counts show what enforcing them
    ///   would do) and report a would-reject when they have none.
    /// * Exempt limits are left out; each use is counted and audited.
    /// * A deny limit that applies ([`crate::LimitDef::deny`], a rate limit's kind otherwise)
    ///   or a concurrency limit's deny override refuses the lease whatever is held
    ///   ([`LeaseDecision::denied`], no `retry_after`): nothing is held anywhere, the other
    ///   keys are only read. In shadow mode or outside its rollout it reports a would-reject.
    /// * Two descriptors that land on one key take one slot.
    /// * A request no concurrency limit applies to is allowed, holds nothing (`held` false)
    ///   and is counted as unmatched, as a check is.
    ///
    /// The lease is held until [`release`](Self::release) or its limit's `lease_timeout`. Rate
    /// limits of the policy are not looked at ([`decide`](Self::decide) is for them), but for
    /// deny limits.
    ///
    /// # Errors
    ///
    /// [`Error::Check`] with [`tollgate::Error::InvalidLeaseId`] for an id that is not 1 to 64
    /// ASCII letters, digits, `-` or `_` (whatever applies), with
    /// [`tollgate::Error::LeaseIdInUse`] for an id still held, and with
    /// [`tollgate::Error::TooManyLeases`] when the table is full; nothing is held.
    pub fn acquire<D, S>(
        &self,
        domain: &str,
        descriptors: &[D],
        lease_id: &str,
    ) -> Result<LeaseOutcome, Error>
    where
        D: Descriptor<S>,
        S: AsRef<str>,
    {
        block_on_ready(self.lease_run_on(&self.local, domain, descriptors, Some(lease_id)))
    }

    /// [`acquire`](Self::acquire) against a shared `store` (Redis) instead of this process's
    /// lease table, on the store's clock. When the store cannot decide, the error is
    /// [`tollgate::Error::StoreUnavailable`] inside [`Error::Check`]: answer with
    /// [`acquire_degraded`](Self::acquire_degraded).
    ///
    /// # Errors
    ///
    /// As for `acquire`, plus the store's errors.
    pub async fn acquire_on<St, D, S>(
        &self,
        store: &St,
        domain: &str,
        descriptors: &[D],
        lease_id: &str,
    ) -> Result<LeaseOutcome, Error>
    where
        St: LeaseStore,
        D: Descriptor<S>,
        S: AsRef<str>,
    {
        self.lease_run_on(store, domain, descriptors, Some(lease_id))
            .await
    }

    /// What [`acquire`](Self::acquire) would answer now, each key decided on its own, holding,
    /// counting and auditing nothing.
    ///
    /// # Errors
    ///
    /// None in this process's table; the signature matches the shared store's.
    pub fn explain_leases<D, S>(
        &self,
        domain: &str,
        descriptors: &[D],
    ) -> Result<LeaseOutcome, Error>
    where
        D: Descriptor<S>,
        S: AsRef<str>,
    {
        block_on_ready(self.lease_run_on(&self.local, domain, descriptors, None))
    }

    /// [`explain_leases`](Self::explain_leases) against a shared `store`.
    ///
    /// # Errors
    ///
    /// The store's.
    pub async fn explain_leases_on<St, D, S>(
        &self,
        store: &St,
        domain: &str,
        descriptors: &[D],
    ) -> Result<LeaseOutcome, Error>
    where
        St: LeaseStore,
        D: Descriptor<S>,
        S: AsRef<str>,
    {
        self.lease_run_on(store, domain, descriptors, None).await
    }

    /// Gives lease `lease_id` back on every key it holds, in this process: `Ok(true)` if it was
    /// still held, `Ok(false)` if it had timed out, was released before, or never held
    /// anything.
    ///
    /// # Errors
    ///
    /// [`Error::Check`] with [`tollgate::Error::InvalidLeaseId`], before looking.
    pub fn release(&self, lease_id: &str) -> Result<bool, Error> {
        block_on_ready(self.release_on(&self.local, lease_id))
    }

    /// [`release`](Self::release) against a shared `store`. A lease taken while the store was
    /// down lives in this process's emergency table: that is looked at first, and the store
    /// only if the lease was not held there.
    ///
    /// # Errors
    ///
    /// As for `release`, plus the store's errors (a lease the store cannot release times out
    /// by itself).
    pub async fn release_on<St: LeaseStore>(
        &self,
        store: &St,
        lease_id: &str,
    ) -> Result<bool, Error> {
        check_lease_id(lease_id).map_err(|source| lease_error("", source))?;
        // Empty nearly always (the store is up): skip its lock.
        if !self.emergency_leases.is_empty() {
            let now = self.options.clock.now();
            let released = self
                .emergency_leases
                .release(lease_id, now)
                .map_err(|source| lease_error("", source))?;
            if released {
                return Ok(true);
            }
        }
        store
            .release(lease_id, None)
            .await
            .map_err(|source| lease_error("", source))
    }

    /// Extends lease `lease_id` in this process, for work that runs longer than its
    /// `lease_timeout`: on every key where it is still held, its end moves to now plus the
    /// timeout it was taken with. `Ok(Some(d))` with `d` the time until its last end;
    /// `Ok(None)` when it is held nowhere (timed out, released, never taken): a lease that
    /// timed out is not revived, and the caller must acquire a new one.
    ///
    /// # Errors
    ///
    /// [`Error::Check`] with [`tollgate::Error::InvalidLeaseId`], before looking.
    pub fn renew(&self, lease_id: &str) -> Result<Option<Duration>, Error> {
        block_on_ready(self.renew_on(&self.local, lease_id))
    }

    /// [`renew`](Self::renew) against a shared `store`; a lease taken while the store was down
    /// is renewed in this process's emergency table, which is looked at first.
    ///
    /// # Errors
    ///
    /// As for `renew`, plus the store's errors.
    pub async fn renew_on<St: LeaseStore>(
        &self,
        store: &St,
        lease_id: &str,
    ) -> Result<Option<Duration>, Error> {
        check_lease_id(lease_id).map_err(|source| lease_error("", source))?;
        if !self.emergency_leases.is_empty() {
            let now = self.options.clock.now();
            let renewed = self
                .emergency_leases
                .renew(lease_id, now)
                .map_err(|source| lease_error("", source))?;
            if renewed.is_some() {
                return Ok(renewed);
            }
        }
        store
            .renew(lease_id, None)
            .await
            .map_err(|source| lease_error("", source))
    }

    /// Takes lease `lease_id` while the shared store cannot answer (down, slow, failing), with
    /// `reason` for the audit log. Every enforced concurrency limit follows its `failure_mode`:
    ///
    /// * `closed`: the request is denied with [`LeaseOutcome::failed_closed`] set,
    ///   distinguishable from an ordinary rejection, and nothing is held;
    /// * `open`: the lease is taken, all or nothing, in this process's emergency table, where
    ///   a key may hold at most the limit's `emergency` leases (its own `max_in_flight`, its
    ///   override's when one applies, when the file sets none), each for the key's
    ///   `lease_timeout`. Two descriptors on one key take one slot.
    ///
    /// Shadow and outside-rollout limits are not decided (they could not reject anyway);
    /// exemptions apply as usual. A denial needs no store: it refuses as it does with the store
    /// up (an ordinary rejection, whatever fails closed beside it), takes nothing from the
    /// emergency table and is not audited as degraded. Every degraded limit decision is
    /// audited with its reason, and
    /// a request no concurrency limit applies to is counted as unmatched. The lease is given
    /// back by [`release_on`](Self::release_on) (or [`release`](Self::release)), which looks
    /// in the emergency table first.
    ///
    /// # Errors
    ///
    /// As for [`acquire`](Self::acquire), against the emergency table.
    pub fn acquire_degraded<D, S>(
        &self,
        domain: &str,
        descriptors: &[D],
        lease_id: &str,
        reason: &str,
    ) -> Result<LeaseOutcome, Error>
    where
        D: Descriptor<S>,
        S: AsRef<str>,
    {
        // Refused whatever applies, as in `acquire`.
        check_lease_id(lease_id).map_err(|source| lease_error("", source))?;
        let policy = self.current.load_full();
        let now = self.options.clock.now();
        let mut matched = policy.lease_matches(domain, descriptors, self.match_time(&policy));
        self.shadow_if_switched(&mut matched);
        let version = Arc::clone(policy.version_arc());
        if matched.is_empty() {
            self.unmatched.fetch_add(1, Ordering::Relaxed);
            return Ok(LeaseOutcome::unmatched_at(version, true));
        }
        let mut failed_closed = false;
        let mut open: Vec<Slot> = Vec::new();
        let mut slot_of = vec![usize::MAX; matched.len()];
        let denied = matched
            .iter()
            .any(|m| m.denied && m.effect == Effect::Enforce);
        for (i, m) in matched.iter().enumerate() {
            if m.effect != Effect::Enforce || m.denied {
                continue;
            }
            match m.limit.failure_mode() {
                FailureMode::OpenInFlight { emergency } => {
                    let own = m.params();
                    let bound = emergency.unwrap_or(own.max_in_flight());
                    // Both figures were validated at compile; a failure here is still a typed
                    // error, not a panic.
                    let limit = LeaseLimit::new(bound, own.timeout())
                        .map_err(|source| lease_error(m.limit.name(), source))?;
                    let key = store_key(&m.bucket_key, m.subject(), m.tag);
                    match open.iter().position(|s| s.key == key) {
                        Some(at) => slot_of[i] = at,
                        None => {
                            slot_of[i] = open.len();
                            open.push(Slot {
                                key,
                                limit,
                                enforce: true,
                                first: i,
                            });
                        }
                    }
                }
                // A concurrency limit never fails open by a rate (compile makes sure); were it
                // to, denying is the safe reading.
                FailureMode::Closed | FailureMode::Open { .. } => failed_closed = true,
            }
        }
        failed_closed &= !denied;
        let mut decisions: Vec<Option<LeaseDecision>> = vec![None; open.len()];
        let mut allowed = !failed_closed && !denied;
        let mut held = false;
        if !failed_closed && !open.is_empty() {
            let takes: Vec<LeaseTake<'_>> = open
                .iter()
                .map(|s| LeaseTake::new(&s.key, &s.limit))
                .collect();
            let results = if denied {
                self.emergency_leases.in_flight(&takes, now)
            } else {
                self.emergency_leases.acquire(&takes, lease_id, now)
            };
            let results = results
                .map_err(|source| lease_error(matched[open[0].first].limit.name(), source))?;
            allowed &= results.iter().all(LeaseDecision::allowed);
            held = allowed;
            decisions = results.into_iter().map(Some).collect();
        }

        let mut limits = Vec::with_capacity(matched.len());
        for (m, &slot) in matched.iter().zip(&slot_of) {
            let mut exempted_by = None;
            match m.effect {
                Effect::Exempt(exemption) => {
                    exempted_by = Some(exemption.owner().to_owned());
                    self.use_exemption(m, exemption, &version);
                }
                Effect::Enforce if !m.denied => {
                    let mode = match m.limit.failure_mode() {
                        FailureMode::OpenInFlight { .. } => "open",
                        _ => "closed",
                    };
                    self.audit(|| AuditEvent::Degraded {
                        limit: m.limit.name().to_owned(),
                        bucket_key: m.bucket_key.clone(),
                        reason: reason.to_owned(),
                        failure_mode: mode.to_owned(),
                        allowed,
                        policy_version: version.to_string(),
                    });
                }
                _ => {}
            }
            limits.push(LeaseLimitOutcome {
                name: Arc::clone(&m.limit.name),
                descriptor: m.descriptor,
                bucket_key: m.bucket_key.clone(),
                mode: m.effect.as_str(),
                decision: decision_of(m, decisions.get(slot).copied().flatten()),
                exempted_by,
            });
        }
        Ok(LeaseOutcome {
            allowed,
            policy_version: version,
            limits,
            degraded: true,
            failed_closed,
            held,
        })
    }

    /// An acquire of `lease_id` on `store`, or with `None` an explanation (holding nothing).
    async fn lease_run_on<St, D, S>(
        &self,
        store: &St,
        domain: &str,
        descriptors: &[D],
        lease_id: Option<&str>,
    ) -> Result<LeaseOutcome, Error>
    where
        St: LeaseStore,
        D: Descriptor<S>,
        S: AsRef<str>,
    {
        // Before matching: whether an id is refused must not depend on what applies.
        if let Some(id) = lease_id {
            check_lease_id(id).map_err(|source| lease_error("", source))?;
        }
        let acquire = lease_id.is_some();
        let policy = self.current.load_full();
        let mut matched = policy.lease_matches(domain, descriptors, self.match_time(&policy));
        self.shadow_if_switched(&mut matched);
        let version = Arc::clone(policy.version_arc());
        if matched.is_empty() {
            if acquire {
                self.unmatched.fetch_add(1, Ordering::Relaxed);
            }
            return Ok(LeaseOutcome::unmatched_at(version, false));
        }

        let (slots, slot_of) = slots(&matched);
        // A denial needs no slot: the other keys are only read, so nothing is held for it.
        let denied = matched
            .iter()
            .any(|m| m.denied && m.effect == Effect::Enforce);
        let mut decisions: Vec<Option<LeaseDecision>> = vec![None; slots.len()];
        let mut allowed = !denied;
        let mut held = false;
        if !slots.is_empty() {
            let takes: Vec<LeaseTake<'_>> = slots
                .iter()
                .map(|s| {
                    let take = LeaseTake::new(&s.key, &s.limit);
                    if s.enforce { take } else { take.soft() }
                })
                .collect();
            let request = LeaseRequest {
                takes: &takes,
                // The store does not look at it when only looking.
                lease_id: lease_id.unwrap_or_default(),
                now: None,
            };
            let results = if acquire && !denied {
                store.acquire(request).await
            } else {
                store.in_flight(request).await
            };
            let results = results.map_err(|source| {
                let first = slots.iter().find(|s| s.enforce).unwrap_or(&slots[0]).first;
                lease_error(matched[first].limit.name(), source)
            })?;
            // Only enforced keys decide; a soft key that was full is a would-reject.
            allowed &= slots
                .iter()
                .zip(&results)
                .all(|(slot, d)| d.allowed() || !slot.enforce);
            // Allowed, the store held every key that had room: at least one is held if any had.
            held = acquire && allowed && results.iter().any(LeaseDecision::allowed);
            decisions = results.into_iter().map(Some).collect();
        }

        let mut limits = Vec::with_capacity(matched.len());
        for (m, &slot) in matched.into_iter().zip(&slot_of) {
            let mut exempted_by = None;
            if let Effect::Exempt(exemption) = m.effect {
                exempted_by = Some(exemption.owner().to_owned());
                if acquire {
                    self.use_exemption(&m, exemption, &version);
                }
            }
            let decision = decision_of(&m, decisions.get(slot).copied().flatten());
            limits.push(LeaseLimitOutcome {
                name: Arc::clone(&m.limit.name),
                descriptor: m.descriptor,
                bucket_key: m.bucket_key,
                mode: m.effect.as_str(),
                decision,
                exempted_by,
            });
        }
        Ok(LeaseOutcome {
            allowed,
            policy_version: version,
            limits,
            degraded: false,
            failed_closed: false,
            held,
        })
    }
}
