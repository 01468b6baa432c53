//! Resets: an operator lets a subject in again now, without a policy change.
//!
//! After an incident (a client's retry storm that drained its own bucket) or a limit found too
//! low, waiting for a bucket to refill may be too long, and an exemption is a policy change
//! with an expiry to manage. A reset names a request as a check would (domain, descriptors,
//! optionally some limits) and makes the buckets that request would be decided by as if never
//! used, in the shared store and in this process's emergency buckets alike. Every bucket reset
//! is audited.
//!
//! Not everything has a bucket to reset: a deny limit has none, a concurrency limit's leases
//! are requests in flight (releasing them would admit more than `max_in_flight`), and a global
//! limit's tokens are held in every region's reservoir. Those are reported as skipped.

use std::sync::Arc;

use tollgate::{Store, block_on_ready};

use super::{PolicyEngine, store_key};
use crate::audit::AuditEvent;
use crate::error::Error;
use crate::key::rate_tag;
use crate::policy::{Descriptor, FailureMode, Scope};

/// What a reset did.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ResetOutcome {
    /// The policy version that matched the request.
    pub policy_version: Arc<str>,
    /// The buckets reset, in match order.
    pub reset: Vec<ResetBucket>,
    /// The limits that applied but have nothing a reset may touch.
    pub skipped: Vec<SkippedLimit>,
}

/// One bucket a reset made as new.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ResetBucket {
    /// The limit's name.
    pub name: Arc<str>,
    /// The request descriptor it matched.
    pub descriptor: usize,
    /// The bucket's key, as [`crate::Matched::bucket_key`] gives it.
    pub bucket_key: String,
}

/// A limit that applied to a reset's request and was left as it is.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SkippedLimit {
    /// The limit's name.
    pub name: Arc<str>,
    /// The request descriptor it matched.
    pub descriptor: usize,
    /// Why: `deny` (no bucket), `global` (held in every region's reservoir).
    pub reason: &'static str,
}

impl PolicyEngine {
    /// Resets, in this process's store, the buckets of the rate limits that apply to the
    /// request (of those named in `only`, when given), as [`reset_on`](Self::reset_on) does.
    ///
    /// # Errors
    ///
    /// As for `reset_on`.
    pub fn reset<D, S>(
        &self,
        domain: &str,
        descriptors: &[D],
        only: Option<&[&str]>,
    ) -> Result<ResetOutcome, Error>
    where
        D: Descriptor<S>,
        S: AsRef<str>,
    {
        block_on_ready(self.reset_on(&self.local, domain, descriptors, only))
    }

    /// Makes the buckets that would decide the request (the rate limits that apply to
    /// `domain` and `descriptors`; of them, those named in `only` when given) as if never
    /// used, on `store` and in this process's emergency buckets ([`Store::reset`]): a token
    /// bucket full, a window or a log counting nothing. A bucket a recent change of its limit
    /// carries over from is reset too, so the old balance does not come back through it.
    /// Exempt, shadow and outside-rollout limits are reset as well; deny and global limits are
    /// skipped ([`ResetOutcome::skipped`]). Each bucket reset is audited.
    ///
    /// Idempotency records stay: a retry of a request decided before the reset is answered as
    /// it was. A reset does not change a limit: the next requests spend the refilled bucket.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownLimit`] for a name in `only` that no limit of the policy has;
    /// [`Error::Check`] with the store's error ([`tollgate::Error::StoreUnavailable`],
    /// [`tollgate::Error::Unsupported`]), after which a repeat may be needed.
    pub async fn reset_on<St, D, S>(
        &self,
        store: &St,
        domain: &str,
        descriptors: &[D],
        only: Option<&[&str]>,
    ) -> Result<ResetOutcome, Error>
    where
        St: Store,
        D: Descriptor<S>,
        S: AsRef<str>,
    {
        let policy = self.current.load_full();
        if let Some(name) = only
            .into_iter()
            .flatten()
            .find(|name| policy.limit(name).is_none())
        {
            return Err(Error::UnknownLimit {
                name: (*name).to_owned(),
            });
        }
        let matched = policy.matches(domain, descriptors, self.match_time(&policy));
        let version = Arc::clone(policy.version_arc());
        let mut outcome = ResetOutcome {
            policy_version: Arc::clone(&version),
            reset: Vec::new(),
            skipped: Vec::new(),
        };
        let carries = self.carries.load();
        let now = self.options.clock.now();
        let mut keys: Vec<Box<str>> = Vec::new();
        let mut emergency: Vec<Box<str>> = Vec::new();
        for m in &matched {
            if only.is_some_and(|names| !names.contains(&m.limit.name())) {
                continue;
            }
            let skipped = if m.denied {
                Some("deny")
            } else if m.limit.scope() == Scope::Global {
                Some("global")
            } else {
                None
            };
            if let Some(reason) = skipped {
                outcome.skipped.push(SkippedLimit {
                    name: Arc::clone(&m.limit.name),
                    descriptor: m.descriptor,
                    reason,
                });
                continue;
            }
            let key = store_key(&m.bucket_key, m.subject(), m.tag);
            if let Some((old, ..)) = Self::carry_for(&carries, &key, now) {
                keys.push(old);
            }
            if let FailureMode::Open { emergency: rate } = m.limit.failure_mode() {
                emergency.push(store_key(&m.bucket_key, m.subject(), rate_tag(&rate)));
            }
            keys.push(key);
            // Two descriptors on one bucket name it twice: reported (and audited) once.
            if !outcome.reset.iter().any(|r| r.bucket_key == m.bucket_key) {
                outcome.reset.push(ResetBucket {
                    name: Arc::clone(&m.limit.name),
                    descriptor: m.descriptor,
                    bucket_key: m.bucket_key.clone(),
                });
            }
        }
        keys.sort_unstable();
        keys.dedup();
        if !keys.is_empty() {
            let keys: Vec<&str> = keys.iter().map(|key| &**key).collect();
            store.reset(&keys).await.map_err(|source| Error::Check {
                limit: outcome
                    .reset
                    .first()
                    .map(|r| r.name.to_string())
                    .unwrap_or_default(),
                source,
            })?;
        }
        for key in &emergency {
            self.emergency.reset(&**key);
        }
        for bucket in &outcome.reset {
            self.audit(|| AuditEvent::Reset {
                limit: bucket.name.to_string(),
                bucket_key: bucket.bucket_key.clone(),
                policy_version: version.to_string(),
            });
        }
        Ok(outcome)
    }
}
