//! Hits given back: a caller returns tokens it took earlier, with no record of the charge.
//!
//! Envoy's rate-limit filter can send a descriptor's hits as given back (`is_negative_hits`),
//! typically once a response shows that its request cost less than it was charged (a model's
//! answer shorter than reserved, an error not worth counting). tollgate's own reservations
//! give back against the record of a charge ([`PolicyEngine::settle`]); these come with none,
//! so the caller is trusted with what it returns, and the buckets bound the harm: a bucket is
//! never fuller than full, nor fuller than if its latest charges had been smaller
//! ([`tollgate::Store::give_back`]). Only a trusted caller should be let to do this (the server
//! asks for it to be switched on).
//!
//! The buckets given back to are those a check of the same descriptors charges: enforced
//! limits (and, for those that fail open, their emergency budgets, which a check charges while
//! the shared store is down), shadow and outside-rollout limits. Not exempt limits (never
//! charged), deny limits (no bucket), nor a global limit's shared bucket (its tokens are held
//! in every region's reservoir; its emergency budget, this process's own, is given back to).

use std::sync::Arc;

use tollgate::{CheckRequest, Item, Limit, Store, Take, block_on_ready};

use super::{Costs, LimitOutcome, Outcome, PolicyEngine, store_key, zero_cost};
use crate::error::Error;
use crate::key::rate_tag;
use crate::policy::{Descriptor, Effect, FailureMode, Scope};

impl PolicyEngine {
    /// Gives `cost` back to the buckets of this process that a check of the request would
    /// charge, as [`give_back_on`](Self::give_back_on) does.
    ///
    /// # Errors
    ///
    /// As for `give_back_on`.
    pub fn give_back<'c, D, S>(
        &self,
        domain: &str,
        descriptors: &[D],
        cost: impl Into<Costs<'c>>,
    ) -> Result<Outcome, Error>
    where
        D: Descriptor<S>,
        S: AsRef<str>,
    {
        block_on_ready(self.give_back_on(&self.local, domain, descriptors, cost))
    }

    /// Gives each descriptor's `cost` back to the buckets a check of the request would charge
    /// (see the module docs), on `store` and in this process's emergency budgets, with no
    /// record of a charge: hits a trusted caller took earlier and returns. Two descriptors on
    /// one bucket give back their summed cost; more than a bucket holds fills it.
    ///
    /// The outcome is allowed; each limit's decision is its bucket's standing afterwards (an
    /// allowed, uncharged decision for the cost), `None` for a limit that has nothing to give
    /// back to. Nothing is counted or audited: hits given back are not decisions.
    ///
    /// # Errors
    ///
    /// [`Error::Check`] when a cost is 0 (whatever applies), or with the store's error
    /// ([`tollgate::Error::StoreUnavailable`]: the shared buckets may then have been given
    /// back to in some slots and not in others, which under-admits; the emergency budgets were
    /// given back to either way).
    pub async fn give_back_on<'c, St, D, S>(
        &self,
        store: &St,
        domain: &str,
        descriptors: &[D],
        cost: impl Into<Costs<'c>>,
    ) -> Result<Outcome, Error>
    where
        St: Store,
        D: Descriptor<S>,
        S: AsRef<str>,
    {
        let cost = cost.into();
        if cost.any_zero(descriptors.len()) {
            return Err(zero_cost());
        }
        let policy = self.current.load_full();
        let mut matched = policy.matches(domain, descriptors, self.match_time(&policy));
        self.shadow_if_switched(&mut matched);
        // One take per distinct bucket with the summed cost of the matches on it, as a check
        // charges them; the same for emergency budgets.
        let mut buckets: Vec<(Box<str>, Limit, u64, usize)> = Vec::new();
        let mut emergency: Vec<(Box<str>, Limit, u64)> = Vec::new();
        let mut slot_of: Vec<usize> = Vec::with_capacity(matched.len());
        for (i, m) in matched.iter().enumerate() {
            if matches!(m.effect, Effect::Exempt(_)) || m.denied {
                slot_of.push(usize::MAX);
                continue;
            }
            let cost = cost.of(m.descriptor);
            if m.limit.scope() == Scope::Global {
                slot_of.push(usize::MAX);
            } else {
                let key = store_key(&m.bucket_key, m.subject(), m.tag);
                match buckets.iter().position(|(k, ..)| *k == key) {
                    Some(slot) => {
                        buckets[slot].2 = buckets[slot].2.saturating_add(cost);
                        slot_of.push(slot);
                    }
                    None => {
                        slot_of.push(buckets.len());
                        buckets.push((key, *m.params(), cost, i));
                    }
                }
            }
            // A global limit's emergency budget is this process's own, as any other's.
            if m.effect == Effect::Enforce
                && let FailureMode::Open { emergency: budget } = m.limit.failure_mode()
            {
                let key = store_key(&m.bucket_key, m.subject(), rate_tag(&budget));
                match emergency.iter_mut().find(|(k, ..)| *k == key) {
                    Some(open) => open.2 = open.2.saturating_add(cost),
                    None => emergency.push((key, budget, cost)),
                }
            }
        }
        if !emergency.is_empty() {
            let items: Vec<Item<'_, str>> = emergency
                .iter()
                .map(|(key, limit, cost)| Item {
                    key: &**key,
                    limit,
                    cost: (*cost).min(limit.capacity()),
                })
                .collect();
            // Distinct keys and costs within their capacities: nothing to refuse.
            let _ = self.emergency.give_back(&items, self.options.clock.now());
        }
        let mut decisions = Vec::new();
        if !buckets.is_empty() {
            let takes: Vec<Take<'_>> = buckets
                .iter()
                .map(|(key, limit, cost, _)| Take::new(key, limit, (*cost).min(limit.capacity())))
                .collect();
            let request = CheckRequest {
                takes: &takes,
                request_id: None,
                now: None,
            };
            decisions = store
                .give_back(request)
                .await
                .map_err(|source| Error::Check {
                    limit: matched[buckets[0].3].limit.name().to_owned(),
                    source,
                })?;
        }
        let limits = matched
            .into_iter()
            .zip(slot_of)
            .map(|(m, slot)| LimitOutcome {
                name: Arc::clone(&m.limit.name),
                descriptor: m.descriptor,
                mode: m.effect.as_str(),
                decision: decisions.get(slot).copied(),
                exempted_by: match m.effect {
                    Effect::Exempt(exemption) => Some(exemption.owner().to_owned()),
                    _ => None,
                },
                bucket_key: m.bucket_key,
            })
            .collect();
        Ok(Outcome {
            allowed: true,
            policy_version: Arc::clone(policy.version_arc()),
            limits,
            degraded: false,
            failed_closed: false,
            settled: None,
        })
    }
}
