//! The policy in force, its history, and decisions against it.
//!
//! A [`PolicyEngine`] lives as long as the process. Readers (every decision) load the current
//! [`Policy`] through an atomic pointer swap and keep that whole version until they finish, so
//! no decision ever sees a half-loaded policy and none waits on a reload. Writers (load, reload,
//! rollback) are serialised by a mutex that decisions never take.
//!
//! # Buckets across versions
//!
//! Buckets live in one [`MemoryStore`] shared by every version, keyed by the match's bucket key
//! (limit name and key values, never the version), so a reload keeps everyone's balance. The
//! store key adds a tag of the bucket's parameters, because a stored state means something only
//! under the parameters that produced it. When a load or rollback changes a limit's (or an
//! override's) capacity or rate, its buckets are carried over right after the swap with
//! [`MemoryStore::rebase_where`]: refilled under the old parameters up to that moment, clamped
//! to the new capacity, and re-keyed under the new tag.
//!
//! A shared store (Redis) cannot be rewritten that way: every process changes at its own
//! moment, and the buckets are not in this process. So the engine remembers each change
//! (old parameters, when) for as long as it could matter, the new limit's time to full, and
//! hands every take on a changed limit the old bucket's key as a [`Carry`]; the store reads it
//! on the way and decides on the emptier of the two.
//!
//! Concurrency limits (leases) are decided in [`leases`], against the same policy and the same
//! kind of store keys; an operator's resets of buckets are in [`reset`], hits a caller gives
//! back in [`give_back`], and the switch that puts every limit in shadow mode at once in
//! [`shadow_all`].

mod give_back;
mod leases;
mod reset;
mod shadow_all;

pub use leases::{LeaseLimitOutcome, LeaseOutcome};
pub use reset::{ResetBucket, ResetOutcome, SkippedLimit};
pub use shadow_all::{ShadowAll, ShadowScope};

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use smallvec::{SmallVec, smallvec};
use tollgate::{
    Carry, CheckRequest, Clock, Decision, Item, Limit, LocalStore, MemoryLeases, MemoryStore,
    MonotonicClock, SettleStatus, Store, Take, Timestamp, block_on_ready,
};

use crate::audit::{AuditEvent, AuditLog};
use crate::error::Error;
use crate::key::rate_tag;
use crate::policy::{Descriptor, Effect, Exemption, FailureMode, Matched, Policy};
use crate::sources::Sources;
use crate::wall::{SystemWallClock, UnixTime, WallClock};

/// One store entry of a request being decided: its bucket key, the limit, the summed cost of
/// the matches on it, and the first of those matches.
type BucketSlot = (Box<str>, Limit, u64, usize);

/// How a [`PolicyEngine`] is set up.
#[derive(Clone)]
#[non_exhaustive]
#[must_use]
pub struct EngineOptions {
    history: usize,
    max_buckets: usize,
    max_leases: usize,
    idempotency_window: Duration,
    clock: Arc<dyn Clock>,
    wall: Arc<dyn WallClock>,
    audit: Option<Arc<AuditLog>>,
    limit_check: Option<LimitCheck>,
}

/// A test every rate limit of a version must pass before it goes in force: see
/// [`EngineOptions::limit_check`].
type LimitCheck = Arc<dyn Fn(&Limit) -> Result<(), tollgate::Error> + Send + Sync>;

impl std::fmt::Debug for EngineOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineOptions")
            .field("history", &self.history)
            .field("max_buckets", &self.max_buckets)
            .field("max_leases", &self.max_leases)
            .field("idempotency_window", &self.idempotency_window)
            .finish_non_exhaustive()
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            history: 10,
            max_buckets: 10_000_000,
            max_leases: 1_000_000,
            idempotency_window: Duration::from_secs(60),
            clock: Arc::new(MonotonicClock::new()),
            wall: Arc::new(SystemWallClock),
            audit: None,
            limit_check: None,
        }
    }
}

impl EngineOptions {
    /// How many earlier versions are kept for rollback (default 10).
    pub fn history(mut self, versions: usize) -> Self {
        self.history = versions;
        self
    }

    /// The most live buckets (default ten million).
    pub fn max_buckets(mut self, max: usize) -> Self {
        self.max_buckets = max;
        self
    }

    /// The most leases held at once in this process's lease table, and separately in its
    /// emergency one (default one million). An acquire past it is an error
    /// ([`tollgate::Error::TooManyLeases`]), never an admission.
    pub fn max_leases(mut self, max: usize) -> Self {
        self.max_leases = max;
        self
    }

    /// How long a `request_id` is remembered (default 60 s).
    pub fn idempotency_window(mut self, window: Duration) -> Self {
        self.idempotency_window = window;
        self
    }

    /// The monotonic clock buckets run on (default [`MonotonicClock`]).
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// The calendar clock exemption expiry runs on (default [`SystemWallClock`]).
    pub fn wall_clock(mut self, wall: Arc<dyn WallClock>) -> Self {
        self.wall = wall;
        self
    }

    /// A test every rate limit (and override) of a version loaded later must pass, or the
    /// version is refused as an invalid file is and the last good one stays: for a shared store
    /// that cannot keep every limit exactly (`tollgate_redis::check_limit`), so that a reload
    /// cannot put in force limits every decision would then fail on. The version the engine
    /// starts with is the caller's to check.
    pub fn limit_check(
        mut self,
        check: impl Fn(&Limit) -> Result<(), tollgate::Error> + Send + Sync + 'static,
    ) -> Self {
        self.limit_check = Some(Arc::new(check));
        self
    }

    /// Where audit events go (default: nowhere).
    pub fn audit(mut self, audit: Arc<AuditLog>) -> Self {
        self.audit = Some(audit);
        self
    }
}

/// The result of deciding one request.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Outcome {
    /// Whether the request may pass: no enforced limit rejected it.
    pub allowed: bool,
    /// The policy version that decided.
    pub policy_version: Arc<str>,
    /// Every applicable limit, grouped by descriptor, in declaration order.
    pub limits: Vec<LimitOutcome>,
    /// Decided without the shared store ([`PolicyEngine::decide_degraded`]).
    pub degraded: bool,
    /// Denied because a limit fails closed while the store is down: not an ordinary rejection
    /// (HTTP 503 / gRPC UNAVAILABLE rather than 429).
    pub failed_closed: bool,
    /// For a settlement ([`PolicyEngine::settle`]): whether anything was given back. `None`
    /// for a decision.
    pub settled: Option<SettleStatus>,
}

impl Outcome {
    /// Whether no limit applied (the request is allowed and counted as unmatched).
    pub fn unmatched(&self) -> bool {
        self.limits.is_empty()
    }
}

/// What one applicable limit decided.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct LimitOutcome {
    /// The limit's name.
    pub name: Arc<str>,
    /// The request descriptor it matched.
    pub descriptor: usize,
    /// The bucket.
    pub bucket_key: String,
    /// `enforce`, `shadow`, `rollout` (outside a rollout: decided like shadow) or `exempt`.
    pub mode: &'static str,
    /// The bucket's decision; `None` when exempt (not decided at all), when the store was down
    /// (a degraded decision that failed closed), or for a limit that cannot reject (shadow,
    /// outside a rollout) whose store call failed after the enforced limits were decided.
    pub decision: Option<Decision>,
    /// The owner of the exemption that lifted the limit.
    pub exempted_by: Option<String>,
}

impl LimitOutcome {
    /// Whether the bucket was short, whatever the mode (a shadow limit that would have
    /// rejected says so here while the request is allowed).
    pub fn would_reject(&self) -> bool {
        self.decision.is_some_and(|d| !d.allowed())
    }
}

/// What a status endpoint shows about the control plane.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct PolicyStatus {
    /// The version in force.
    pub version: String,
    /// Where it came from.
    pub source: String,
    /// When it was put in force.
    pub loaded_at: UnixTime,
    /// Earlier versions kept for rollback, oldest first.
    pub history: Vec<String>,
    /// The last refused load since the last good one (one line), and when.
    pub last_error: Option<(UnixTime, String)>,
    /// Requests no limit applied to.
    pub unmatched: u64,
    /// Versions put in force since start (loads and rollbacks).
    pub changes: u64,
    /// Whether every limit is in shadow mode ([`PolicyEngine::set_shadow_all`], or the
    /// fleet's switch: [`PolicyEngine::set_fleet_shadow_all`]).
    pub shadow_all: Option<ShadowAll>,
}

struct Control {
    history: VecDeque<Arc<Policy>>,
    loaded_at: UnixTime,
    last_error: Option<(UnixTime, String)>,
    /// Hash of the text in force, to recognise a reload of an unchanged file; `None` after a
    /// rollback (what is in force then is not the file).
    text_hash: Option<u64>,
    /// Hash of the file's bytes as last read, whether they were put in force or refused. Kept
    /// apart from `text_hash` so that a watcher event that did not change the file (another
    /// file written in the directory) does not re-apply it over a rollback or a refusal.
    read_hash: Option<u64>,
    changes: u64,
    shadow_all: Option<ShadowAll>,
    fleet_shadow_all: Option<ShadowAll>,
}

/// The control plane of one process: the policy in force, earlier versions, the buckets.
pub struct PolicyEngine {
    current: ArcSwap<Policy>,
    /// Limits whose parameters changed lately, for stores that carry buckets over lazily.
    /// Replaced before the version it belongs to goes in force (entries name the new
    /// parameters' tag, so the version before never uses them).
    carries: ArcSwap<Vec<Changed>>,
    control: Mutex<Control>,
    /// The in-process buckets, behind the same [`Store`] interface a shared store offers.
    local: LocalStore<Arc<dyn Clock>>,
    /// Local emergency buckets of limits that fail open, used only while the shared store is
    /// down.
    emergency: MemoryStore<Box<str>>,
    /// Leases of concurrency limits that fail open, taken while the shared store is down; they
    /// live here until released or timed out, so releases look here first.
    emergency_leases: MemoryLeases,
    options: EngineOptions,
    path: Option<PathBuf>,
    unmatched: AtomicU64,
    /// Whether `control.shadow_all` or `control.fleet_shadow_all` is on, read by every
    /// decision without the lock.
    shadow_all: AtomicBool,
    /// What the switches on cover, read by decisions while `shadow_all` is set.
    shadow_coverage: ArcSwap<shadow_all::Coverage>,
}

impl std::fmt::Debug for PolicyEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyEngine")
            .field("version", &self.current.load().version())
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl PolicyEngine {
    /// An engine with `policy` in force.
    pub fn new(policy: Policy, options: EngineOptions) -> Self {
        Self::build(policy, None, None, options)
    }

    /// An engine with the policy file, or the policy directory ([`crate::compile_directory`]),
    /// at `path` in force; [`reload`](Self::reload) reads it again.
    ///
    /// # Errors
    ///
    /// When a file cannot be read or the policy does not validate: there is no last good
    /// version yet.
    pub fn from_file(path: &Path, options: EngineOptions) -> Result<Self, Error> {
        let sources = Sources::read(path)?;
        let policy = sources.compile(&path.display().to_string())?;
        Ok(Self::build(
            policy,
            Some(path.to_owned()),
            Some(sources.hash()),
            options,
        ))
    }

    fn build(
        policy: Policy,
        path: Option<PathBuf>,
        text_hash: Option<u64>,
        options: EngineOptions,
    ) -> Self {
        let store = MemoryStore::builder()
            .max_buckets(options.max_buckets)
            .idempotency_window(options.idempotency_window)
            .build();
        let leases = || {
            MemoryLeases::builder()
                .max_leases(options.max_leases)
                .build()
        };
        let local = LocalStore::with_store(store, Arc::clone(&options.clock)).with_leases(leases());
        let engine = Self {
            current: ArcSwap::from_pointee(policy),
            carries: ArcSwap::from_pointee(Vec::new()),
            control: Mutex::new(Control {
                history: VecDeque::new(),
                loaded_at: options.wall.now(),
                last_error: None,
                text_hash,
                read_hash: text_hash,
                changes: 1,
                shadow_all: None,
                fleet_shadow_all: None,
            }),
            local,
            emergency: MemoryStore::builder()
                .max_buckets(options.max_buckets)
                .build(),
            emergency_leases: leases(),
            options,
            path,
            unmatched: AtomicU64::new(0),
            shadow_all: AtomicBool::new(false),
            shadow_coverage: ArcSwap::from_pointee(shadow_all::Coverage::default()),
        };
        let policy = engine.current.load_full();
        engine.audit(|| AuditEvent::Loaded {
            version: policy.version().to_owned(),
            previous: None,
            source: policy.source().to_owned(),
            limits: policy.limits().len(),
            exemptions: policy.exemptions().len(),
            changed_limits: Vec::new(),
            changed_files: Vec::new(),
        });
        engine
    }

    /// The policy in force. Holding it keeps that version alive, whatever reloads happen.
    pub fn current(&self) -> Arc<Policy> {
        self.current.load_full()
    }

    /// The file or directory this engine reloads from, if any.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Validates `text` and, if it is good, puts it in force; otherwise keeps the version in
    /// force, remembers the error for [`status`](Self::status) and audits the refusal.
    ///
    /// # Errors
    ///
    /// The validation error.
    pub fn load(&self, source: &str, text: &str) -> Result<Arc<Policy>, Error> {
        let mut control = self.control.lock();
        let sources = Sources::File(text.to_owned());
        self.load_locked(&mut control, source, &sources, sources.hash())
    }

    /// Reads the engine's file again (see [`load`](Self::load)): what `POST /v1/policy/reload`
    /// runs. The file is put in force unless its content is what is already in force, so after
    /// a [`rollback`](Self::rollback) this re-applies the file.
    ///
    /// # Errors
    ///
    /// [`Error::Io`] when the engine has no file or it cannot be read; the validation error.
    /// The version in force stays in every case, and the error is kept for
    /// [`status`](Self::status).
    pub fn reload(&self) -> Result<Arc<Policy>, Error> {
        self.reload_from_file(true)
    }

    /// Like [`reload`](Self::reload), but does nothing (and answers the policy in force) when
    /// the file's bytes are the ones last read, whether those were put in force or refused:
    /// what the file watcher runs on every event in the directory. A rollback, or a refused
    /// file, then stays as it is until the file really changes.
    ///
    /// # Errors
    ///
    /// As for `reload`, when the bytes changed.
    pub fn reload_if_changed(&self) -> Result<Arc<Policy>, Error> {
        self.reload_from_file(false)
    }

    fn reload_from_file(&self, force: bool) -> Result<Arc<Policy>, Error> {
        let mut control = self.control.lock();
        let Some(path) = &self.path else {
            return Err(Error::Io {
                path: PathBuf::new(),
                source: std::io::Error::other("this engine was not started from a file"),
            });
        };
        let sources = match Sources::read(path) {
            Ok(sources) => sources,
            Err(err) => {
                self.refuse(&mut control, &path.display().to_string(), &err);
                return Err(err);
            }
        };
        let hash = sources.hash();
        if !force && control.read_hash == Some(hash) {
            return Ok(self.current.load_full());
        }
        control.read_hash = Some(hash);
        self.load_locked(&mut control, &path.display().to_string(), &sources, hash)
    }

    /// Puts `sources` in force unless they are what is in force already; `hash` is their
    /// [`Sources::hash`], which the caller has made once for its own check too.
    fn load_locked(
        &self,
        control: &mut Control,
        source: &str,
        sources: &Sources,
        hash: u64,
    ) -> Result<Arc<Policy>, Error> {
        let current = self.current.load_full();
        if control.text_hash == Some(hash) && current.source() == source {
            control.last_error = None;
            return Ok(current);
        }
        let policy = match sources
            .compile(source)
            .and_then(|p| Self::check_limits_of(&self.options, p))
        {
            Ok(policy) => Arc::new(policy),
            Err(err) => {
                self.refuse(control, source, &err);
                return Err(err);
            }
        };
        let changed = changed_limits(&current, &policy);
        let changes = param_changes(&current, &policy);
        self.remember_changes(&changes, &policy);
        carry_exemption_uses(&current, &policy);
        self.current.store(Arc::clone(&policy));
        self.carry_over(&changes);
        control.history.push_back(Arc::clone(&current));
        while control.history.len() > self.options.history {
            control.history.pop_front();
        }
        control.loaded_at = self.options.wall.now();
        control.last_error = None;
        control.text_hash = Some(hash);
        control.changes += 1;
        self.audit(|| AuditEvent::Loaded {
            version: policy.version().to_owned(),
            previous: Some(current.version().to_owned()),
            source: source.to_owned(),
            limits: policy.limits().len(),
            exemptions: policy.exemptions().len(),
            changed_limits: changed,
            changed_files: policy
                .file_changes(&current)
                .into_iter()
                .map(|(name, _)| name.to_string())
                .collect(),
        });
        Ok(policy)
    }

    /// `policy`, if every rate limit in it passes [`EngineOptions::limit_check`].
    fn check_limits_of(options: &EngineOptions, policy: Policy) -> Result<Policy, Error> {
        let Some(check) = &options.limit_check else {
            return Ok(policy);
        };
        for limit in policy.limits() {
            let rates = limit
                .rate()
                .into_iter()
                .chain(limit.overrides().iter().filter_map(|o| o.rate()));
            for rate in rates {
                check(rate).map_err(|source| Error::Unsupported {
                    limit: limit.name().to_owned(),
                    source,
                })?;
            }
        }
        Ok(policy)
    }

    fn refuse(&self, control: &mut Control, source: &str, err: &Error) {
        let message = err.to_string();
        control.last_error = Some((self.options.wall.now(), message.clone()));
        let kept = self.current.load().version().to_owned();
        self.audit(|| AuditEvent::Refused {
            source: source.to_owned(),
            error: message,
            kept_version: kept,
        });
    }

    /// Puts the previous version back in force. The version taken out is dropped, so repeated
    /// rollbacks walk further back.
    ///
    /// # Errors
    ///
    /// [`Error::NothingToRollBack`] when no earlier version is kept.
    pub fn rollback(&self) -> Result<Arc<Policy>, Error> {
        let mut control = self.control.lock();
        let previous = control.history.pop_back().ok_or(Error::NothingToRollBack)?;
        let changes = param_changes(&self.current.load(), &previous);
        self.remember_changes(&changes, &previous);
        carry_exemption_uses(&self.current.load(), &previous);
        let from = self.current.swap(Arc::clone(&previous));
        self.carry_over(&changes);
        control.loaded_at = self.options.wall.now();
        // The file no longer matches what is in force: an explicit reload must load it again.
        // `read_hash` stays, so a watcher event that did not change the file leaves the
        // rollback in force.
        control.text_hash = None;
        control.changes += 1;
        self.audit(|| AuditEvent::RolledBack {
            from: from.version().to_owned(),
            to: previous.version().to_owned(),
        });
        Ok(previous)
    }

    /// The control plane's state, for status endpoints.
    pub fn status(&self) -> PolicyStatus {
        let control = self.control.lock();
        let current = self.current.load();
        PolicyStatus {
            version: current.version().to_owned(),
            source: current.source().to_owned(),
            loaded_at: control.loaded_at,
            history: control
                .history
                .iter()
                .map(|p| p.version().to_owned())
                .collect(),
            last_error: control.last_error.clone(),
            unmatched: self.unmatched.load(Ordering::Relaxed),
            changes: control.changes,
            shadow_all: control
                .shadow_all
                .clone()
                .or_else(|| control.fleet_shadow_all.clone()),
        }
    }

    /// Requests no limit applied to, since start.
    pub fn unmatched(&self) -> u64 {
        self.unmatched.load(Ordering::Relaxed)
    }

    /// Buckets held in this process (the in-memory store's housekeeping counters).
    pub fn memory_stats(&self) -> tollgate::MemoryStats {
        self.local.memory().stats()
    }

    /// Leases recorded in this process's lease tables (its own and the emergency one),
    /// counting timed-out ones no sweep has dropped yet.
    pub fn live_leases(&self) -> usize {
        self.local.leases().len() + self.emergency_leases.len()
    }

    /// Audits the exemptions of the version in force whose expiry has passed since the last
    /// call ([`AuditEvent::ExemptionExpired`]), once each; returns how many. An exemption stops
    /// applying at its expiry by itself; this is for the trail, so a reviewer sees when a
    /// subject went back under its limit without waiting for its next request. The server
    /// calls it with its other housekeeping, every few seconds.
    pub fn report_expired_exemptions(&self) -> usize {
        let policy = self.current();
        if policy.exemptions().is_empty() {
            return 0;
        }
        let now = self.options.wall.now();
        let mut reported = 0;
        for exemption in policy.exemptions() {
            if exemption.is_active(now) || exemption.expiry_reported.swap(true, Ordering::Relaxed) {
                continue;
            }
            reported += 1;
            self.audit(|| AuditEvent::ExemptionExpired {
                limit: exemption.limit().to_owned(),
                owner: exemption.owner().to_owned(),
                reason: exemption.reason().to_owned(),
                expired: exemption.expires().to_rfc3339(),
                uses: exemption.uses(),
                policy_version: policy.version().to_owned(),
            });
        }
        reported
    }

    /// Drops this process's full buckets and shrinks tables left mostly empty
    /// ([`tollgate::MemoryStore::sweep`]), and drops the timed-out leases of its lease tables
    /// (its own and the emergency one, [`tollgate::MemoryLeases::sweep`]); returns how many
    /// buckets and leases went. Buckets and leases in a shared store expire on their own.
    pub fn sweep(&self) -> usize {
        let now = self.local.clock().now();
        self.local.memory().sweep(now)
            + self.local.leases().sweep(now)
            + self.emergency_leases.sweep(now)
    }

    /// Decides one request: `cost` tokens from every applicable bucket.
    ///
    /// * Enforced limits are checked together, all or nothing: if one rejects, none is charged.
    /// * Shadow limits, and enforced limits whose subject is outside the rollout, are decided
    ///   and reported but never reject. They are charged only when the request passes (as they
    ///   would be if enforced); when it is rejected they report their balance uncharged. A cost
    ///   above such a limit's capacity is not an error: the limit reports a would-reject (shown
    ///   as an empty bucket: `remaining` 0, `retry_after` = `reset_after` = its time to full)
    ///   and is not charged.
    /// * Exempt limits are not decided; each use is counted and audited.
    /// * A denial ([`Matched::denied`]: a deny limit or override, or a denial the descriptor
    ///   asks for) rejects whatever the cost, without a bucket or a store
    ///   ([`Decision::denied`]); the request's other buckets are then only read.
    /// * A request no limit applies to is allowed and counted as unmatched.
    /// * Two descriptors that land on one bucket charge it once for their summed cost.
    ///
    /// With a `request_id`, a retry within the idempotency window is not charged again.
    ///
    /// # Errors
    ///
    /// [`Error::Check`] when `cost` is 0 (whatever applies, even nothing or only exemptions;
    /// the error then names no limit) or above an enforced limit's capacity; nothing is
    /// charged.
    pub fn decide<'c, D, S>(
        &self,
        domain: &str,
        descriptors: &[D],
        cost: impl Into<Costs<'c>>,
        request_id: Option<&str>,
    ) -> Result<Outcome, Error>
    where
        D: Descriptor<S>,
        S: AsRef<str>,
    {
        let cost = cost.into();
        let run = Run {
            consume: true,
            carry: false,
            used: None,
        };
        block_on_ready(self.run_on(&self.local, domain, descriptors, cost, request_id, run))
    }

    /// This process's buckets, as a [`Store`]: for a wrapper that decides some buckets
    /// elsewhere (the shares of global limits) and hands the rest to [`decide_on`](Self::decide_on).
    pub fn local(&self) -> &LocalStore<Arc<dyn Clock>> {
        &self.local
    }

    /// The effective parameters of the limits that could reject a request with these
    /// descriptors now: enforced, neither in shadow mode, outside their rollout nor exempt.
    /// Nothing is decided, charged or counted. For callers that size something by the limits
    /// before deciding (RLQS assignments). `None` when one of them denies the request outright
    /// ([`Matched::denied`]): there is nothing to size.
    pub fn enforced_limits<D, S>(&self, domain: &str, descriptors: &[D]) -> Option<Vec<Limit>>
    where
        D: Descriptor<S>,
        S: AsRef<str>,
    {
        let policy = self.current.load_full();
        let mut matched = policy.matches(domain, descriptors, self.match_time(&policy));
        self.shadow_if_switched(&mut matched);
        matched
            .into_iter()
            .filter(|m| m.effect == Effect::Enforce)
            .map(|m| (!m.denied).then_some(*m.params()))
            .collect()
    }

    /// What [`decide`](Self::decide) would answer, without charging or counting anything.
    ///
    /// # Errors
    ///
    /// As for `decide`.
    pub fn explain<'c, D, S>(
        &self,
        domain: &str,
        descriptors: &[D],
        cost: impl Into<Costs<'c>>,
    ) -> Result<Outcome, Error>
    where
        D: Descriptor<S>,
        S: AsRef<str>,
    {
        let cost = cost.into();
        let run = Run {
            consume: false,
            carry: false,
            used: None,
        };
        block_on_ready(self.run_on(&self.local, domain, descriptors, cost, None, run))
    }

    /// [`decide`](Self::decide) against a shared `store` (Redis) instead of this process's
    /// buckets, on the store's clock. When the store cannot decide, the error is
    /// [`tollgate::Error::StoreUnavailable`] inside [`Error::Check`]: answer with
    /// [`decide_degraded`](Self::decide_degraded).
    ///
    /// # Errors
    ///
    /// As for `decide`, plus the store's errors.
    pub async fn decide_on<'c, St, D, S>(
        &self,
        store: &St,
        domain: &str,
        descriptors: &[D],
        cost: impl Into<Costs<'c>>,
        request_id: Option<&str>,
    ) -> Result<Outcome, Error>
    where
        St: Store,
        D: Descriptor<S>,
        S: AsRef<str>,
    {
        let cost = cost.into();
        let run = Run {
            consume: true,
            carry: true,
            used: None,
        };
        self.run_on(store, domain, descriptors, cost, request_id, run)
            .await
    }

    /// [`explain`](Self::explain) against a shared `store`.
    ///
    /// # Errors
    ///
    /// As for `decide_on`.
    pub async fn explain_on<'c, St, D, S>(
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
        let run = Run {
            consume: false,
            carry: true,
            used: None,
        };
        self.run_on(store, domain, descriptors, cost, None, run)
            .await
    }

    /// Settles a request [`decide`](Self::decide) charged with `request_id` and `cost` (a
    /// reservation: the most it could cost), now that it is known to have used `used`: every
    /// bucket it was charged on gets `cost - used` back, once (see [`tollgate::Store::settle`]).
    /// The request must be asked as it was decided (same domain, descriptors, cost and id);
    /// its limits are matched again, so a policy change in between (new parameters, new
    /// buckets) finds nothing to settle, and the charge stands.
    ///
    /// The outcome's [`Outcome::settled`] says whether anything was given back; each limit's
    /// decision is its bucket's standing afterwards. Nothing is counted or audited: the check
    /// was.
    ///
    /// # Errors
    ///
    /// As for `decide`; [`tollgate::Error::InvalidSettlement`] inside [`Error::Check`] when
    /// `used` passes `cost` for a descriptor; [`tollgate::Error::IdempotencyConflict`] when
    /// the id was used for another request, or settled with another `used`.
    pub fn settle<'c, D, S>(
        &self,
        domain: &str,
        descriptors: &[D],
        cost: impl Into<Costs<'c>>,
        used: impl Into<Costs<'c>>,
        request_id: &str,
    ) -> Result<Outcome, Error>
    where
        D: Descriptor<S>,
        S: AsRef<str>,
    {
        let run = Run {
            consume: true,
            carry: false,
            used: Some(used.into()),
        };
        block_on_ready(self.run_on(
            &self.local,
            domain,
            descriptors,
            cost.into(),
            Some(request_id),
            run,
        ))
    }

    /// [`settle`](Self::settle) on a shared `store`.
    ///
    /// # Errors
    ///
    /// As for `settle`, plus the store's errors (a store that cannot answer gives nothing
    /// back: the charge stands).
    pub async fn settle_on<'c, St, D, S>(
        &self,
        store: &St,
        domain: &str,
        descriptors: &[D],
        cost: impl Into<Costs<'c>>,
        used: impl Into<Costs<'c>>,
        request_id: &str,
    ) -> Result<Outcome, Error>
    where
        St: Store,
        D: Descriptor<S>,
        S: AsRef<str>,
    {
        let run = Run {
            consume: true,
            carry: true,
            used: Some(used.into()),
        };
        self.run_on(
            store,
            domain,
            descriptors,
            cost.into(),
            Some(request_id),
            run,
        )
        .await
    }

    async fn run_on<St, D, S>(
        &self,
        store: &St,
        domain: &str,
        descriptors: &[D],
        cost: Costs<'_>,
        request_id: Option<&str>,
        Run {
            consume,
            carry,
            used,
        }: Run<'_>,
    ) -> Result<Outcome, Error>
    where
        St: Store,
        D: Descriptor<S>,
        S: AsRef<str>,
    {
        // Before matching: whether a cost of 0 is refused must not depend on what applies
        // (an exempt or unmatched request would otherwise accept it).
        if cost.any_zero(descriptors.len()) {
            return Err(zero_cost());
        }
        if let Some(used) = used
            && (0..descriptors.len()).any(|d| used.of(d) > cost.of(d))
        {
            return Err(Error::Check {
                limit: String::new(),
                source: tollgate::Error::InvalidSettlement {
                    reason: "a request cannot have used more than it reserved",
                },
            });
        }
        let policy = self.current.load_full();
        let mut matched = policy.matches(domain, descriptors, self.match_time(&policy));
        self.shadow_if_switched(&mut matched);
        if matched.is_empty() {
            if consume && used.is_none() {
                self.unmatched.fetch_add(1, Ordering::Relaxed);
            }
            return Ok(Outcome {
                allowed: true,
                policy_version: Arc::clone(policy.version_arc()),
                limits: Vec::new(),
                degraded: false,
                failed_closed: false,
                settled: used.map(|_| SettleStatus::NotFound),
            });
        }

        // One store entry per distinct bucket, with the summed cost of the matches on it (and,
        // in a settlement, what they gave back: the summed cost less the summed use).
        // These lists hold one or two entries for the usual request: kept inline, they cost
        // no allocation of their own.
        let mut buckets: SmallVec<[BucketSlot; 2]> = SmallVec::new();
        let mut refunds: Vec<u64> = Vec::new();
        let mut slot_of: SmallVec<[usize; 4]> = SmallVec::new();
        for (i, m) in matched.iter().enumerate() {
            if let Effect::Exempt(_) = m.effect {
                slot_of.push(usize::MAX);
                continue;
            }
            let key = store_key(&m.bucket_key, m.subject(), m.tag);
            let cost = cost.of(m.descriptor);
            let refund = used.map_or(0, |used| cost - used.of(m.descriptor));
            // A denial shares no slot with a bucket the store decides (a descriptor asking
            // for a denial beside one of the same values that does not).
            let same =
                |(k, .., first): &BucketSlot| *k == key && matched[*first].denied == m.denied;
            match buckets.iter().position(same) {
                Some(slot) => {
                    buckets[slot].2 = buckets[slot].2.saturating_add(cost);
                    if let Some(total) = refunds.get_mut(slot) {
                        *total = total.saturating_add(refund);
                    }
                    slot_of.push(slot);
                }
                None => {
                    slot_of.push(buckets.len());
                    buckets.push((key, *m.params(), cost, i));
                    if used.is_some() {
                        refunds.push(refund);
                    }
                }
            }
        }
        let refunds_of = |slots: &[usize]| -> Vec<u64> {
            slots
                .iter()
                .map(|&s| refunds.get(s).copied().unwrap_or(0))
                .collect()
        };
        let mut settled: Vec<SettleStatus> = Vec::new();
        let enforced = |slot: &BucketSlot| matched[slot.3].effect == Effect::Enforce;
        // A cost above an enforced limit's capacity could never pass: a typed error, before
        // anything is charged. A limit that cannot reject (shadow, outside a rollout) must not
        // fail the request for it: it reports a would-reject and is left out of every charge.
        let mut decisions: SmallVec<[Option<Decision>; 2]> = smallvec![None; buckets.len()];
        for (slot, bucket) in buckets.iter().enumerate() {
            let (_, limit, cost, first) = bucket;
            // A deny has no bucket: decided here, whatever the cost, and never sent to a store.
            if matched[*first].denied {
                decisions[slot] = Some(Decision::denied(*limit, *cost));
                continue;
            }
            if *cost <= limit.capacity() {
                continue;
            }
            if enforced(bucket) {
                return Err(Error::Check {
                    limit: matched[*first].limit.name().to_owned(),
                    source: tollgate::Error::InvalidCost {
                        cost: *cost,
                        capacity: limit.capacity(),
                    },
                });
            }
            decisions[slot] = Some(never_fits(limit));
        }
        let enforce_slots: SmallVec<[usize; 2]> = (0..buckets.len())
            .filter(|&s| enforced(&buckets[s]) && !matched[buckets[s].3].denied)
            .collect();
        // An enforced deny rejects the request: the other buckets are then only read, so a
        // rejected request is charged nothing (a settlement still gives back what an earlier
        // admission took).
        let denied = buckets.iter().any(|b| enforced(b) && matched[b.3].denied);
        let check_error = |slot: usize, source: tollgate::Error| Error::Check {
            limit: matched[buckets[slot].3].limit.name().to_owned(),
            source,
        };
        // Buckets of limits changed lately carry their old selves over in a shared store
        // (this process's own were carried over at the change).
        let carries = self.carries.load();
        let olds: Vec<Option<(Box<str>, Limit, Duration)>> = if !carry || carries.is_empty() {
            Vec::new()
        } else {
            let now = self.options.clock.now();
            buckets
                .iter()
                .map(|(key, ..)| Self::carry_for(&carries, key, now))
                .collect()
        };
        let takes_of = |slots: &[usize]| -> SmallVec<[Take<'_>; 2]> {
            slots
                .iter()
                .map(|&s| {
                    let take = Take::new(&buckets[s].0, &buckets[s].1, buckets[s].2);
                    match olds.get(s) {
                        Some(Some((key, limit, since))) => take.carried_from(Carry {
                            key,
                            limit,
                            since: *since,
                        }),
                        _ => take,
                    }
                })
                .collect()
        };
        if !enforce_slots.is_empty() {
            let takes = takes_of(&enforce_slots);
            let request = CheckRequest {
                takes: &takes,
                request_id,
                now: None,
            };
            let results = if used.is_some() {
                store
                    .settle(request, &refunds_of(&enforce_slots))
                    .await
                    .map(|settlement| {
                        settled.push(settlement.status);
                        settlement.decisions
                    })
            } else if consume && !denied {
                store.check(request).await
            } else {
                store.peek(request).await
            };
            let results = results.map_err(|err| check_error(enforce_slots[0], err))?;
            for (&s, d) in enforce_slots.iter().zip(results) {
                decisions[s] = Some(d);
            }
        }
        // Only enforced limits decide; a would-reject of one that cannot reject is already in
        // `decisions` and must not count.
        let allowed = used.is_some()
            || !denied
                && enforce_slots
                    .iter()
                    .all(|&s| decisions[s].is_some_and(|d| d.allowed()));
        // Limits that cannot reject (shadow, outside a rollout) are charged, each on its own,
        // only when the request passes; otherwise they report their balance as it stands. One
        // already decided was asked for more than it can ever hold: charged nothing.
        for s in 0..buckets.len() {
            if enforced(&buckets[s]) || decisions[s].is_some() {
                continue;
            }
            let takes = takes_of(&[s]);
            let request = CheckRequest {
                takes: &takes,
                request_id,
                now: None,
            };
            let result = if used.is_some() {
                // Charged with the request, under its id: given back the same way.
                store
                    .settle(request, &refunds_of(&[s]))
                    .await
                    .map(|settlement| {
                        settled.push(settlement.status);
                        settlement.decisions
                    })
            } else if consume && allowed {
                store.check(request).await
            } else {
                store.peek(request).await
            };
            // A limit that cannot reject must not fail a request its enforced limits have
            // decided (and, on a shared store, charged): the caller would decide it again
            // without the store and spend emergency budgets on top. It goes undecided.
            if let Ok(mut result) = result {
                decisions[s] = result.pop();
            }
        }

        let version = Arc::clone(policy.version_arc());
        let mut limits = Vec::with_capacity(matched.len());
        for (m, &slot) in matched.into_iter().zip(&slot_of) {
            let mut exempted_by = None;
            if let Effect::Exempt(exemption) = m.effect {
                exempted_by = Some(exemption.owner().to_owned());
                if consume && used.is_none() {
                    self.use_exemption(&m, exemption, &version);
                }
            }
            limits.push(LimitOutcome {
                name: Arc::clone(&m.limit.name),
                descriptor: m.descriptor,
                bucket_key: m.bucket_key,
                mode: m.effect.as_str(),
                decision: decisions.get(slot).copied().flatten(),
                exempted_by,
            });
        }
        Ok(Outcome {
            allowed,
            policy_version: version,
            limits,
            degraded: false,
            failed_closed: false,
            settled: used.map(|_| {
                // A request given back anywhere is settled.
                let any = |status| settled.contains(&status);
                if any(SettleStatus::Settled) {
                    SettleStatus::Settled
                } else if any(SettleStatus::Repeated) {
                    SettleStatus::Repeated
                } else {
                    SettleStatus::NotFound
                }
            }),
        })
    }

    /// Decides one request while the shared store cannot answer (down, slow, failing), with
    /// `reason` for the audit log. Every enforced limit follows its `failure_mode`:
    ///
    /// * `closed`: the request is denied with [`Outcome::failed_closed`] set, distinguishable
    ///   from an ordinary rejection;
    /// * `open`: the request is checked against a local emergency bucket per key, all or
    ///   nothing; two descriptors on one bucket take their summed cost from it. A (summed) cost
    ///   above the emergency capacity is rejected, never unlimited and never charged: that
    ///   limit's [`LimitOutcome::decision`] is a rejection by its emergency limit, shown as an
    ///   empty bucket (`remaining` 0, `retry_after` = `reset_after` = the emergency budget's
    ///   time to full), and the other emergency buckets report what they would decide.
    ///
    /// A denial needs no store: it rejects as with the store up, an ordinary rejection (not
    /// failed closed, whatever fails closed beside it), spending no emergency budget and not
    /// audited as degraded. Shadow and outside-rollout limits are not decided (they could not
    /// reject anyway), but for a denial's would-reject; exemptions apply as usual. Every
    /// degraded limit decision is audited with its reason.
    ///
    /// # Errors
    ///
    /// [`Error::Check`] when `cost` is 0 (whatever applies).
    pub fn decide_degraded<'c, D, S>(
        &self,
        domain: &str,
        descriptors: &[D],
        cost: impl Into<Costs<'c>>,
        reason: &str,
    ) -> Result<Outcome, Error>
    where
        D: Descriptor<S>,
        S: AsRef<str>,
    {
        self.degraded(domain, descriptors, cost.into(), reason, true)
    }

    /// What [`decide_degraded`](Self::decide_degraded) would answer, charging, counting and
    /// auditing nothing: for a check-only request (Envoy's `hits_addend: 0`) while the store is
    /// down, so that a limit failing closed still denies and one failing open reports its
    /// emergency budget.
    ///
    /// # Errors
    ///
    /// As for `decide_degraded`.
    pub fn explain_degraded<'c, D, S>(
        &self,
        domain: &str,
        descriptors: &[D],
        cost: impl Into<Costs<'c>>,
        reason: &str,
    ) -> Result<Outcome, Error>
    where
        D: Descriptor<S>,
        S: AsRef<str>,
    {
        self.degraded(domain, descriptors, cost.into(), reason, false)
    }

    fn degraded<D, S>(
        &self,
        domain: &str,
        descriptors: &[D],
        cost: Costs<'_>,
        reason: &str,
        consume: bool,
    ) -> Result<Outcome, Error>
    where
        D: Descriptor<S>,
        S: AsRef<str>,
    {
        // Refused whatever applies, as in `decide`.
        if cost.any_zero(descriptors.len()) {
            return Err(zero_cost());
        }
        let policy = self.current.load();
        let now = self.options.clock.now();
        let mut matched = policy.matches(domain, descriptors, self.match_time(&policy));
        self.shadow_if_switched(&mut matched);
        let version = Arc::clone(policy.version_arc());
        if matched.is_empty() {
            if consume {
                self.unmatched.fetch_add(1, Ordering::Relaxed);
            }
            return Ok(Outcome {
                allowed: true,
                policy_version: version,
                limits: Vec::new(),
                degraded: true,
                failed_closed: false,
                settled: None,
            });
        }
        let mut failed_closed = false;
        // One emergency bucket per distinct key, with the summed cost of the matches on it (as
        // in `decide`: two descriptors on one bucket take from it for both).
        let mut open: Vec<(Box<str>, Limit, u64)> = Vec::new();
        let mut slot_of = vec![usize::MAX; matched.len()];
        // A deny needs no store: it rejects as it would with the store up, as an ordinary
        // rejection (a closed limit beside it changes nothing), and nothing is charged.
        let denied = matched
            .iter()
            .any(|m| m.denied && m.effect == Effect::Enforce);
        for (i, m) in matched.iter().enumerate() {
            if m.effect != Effect::Enforce || m.denied {
                continue;
            }
            match m.limit.failure_mode() {
                // A rate limit never fails open by a bound on leases (compile makes sure);
                // were it to, denying is the safe reading.
                FailureMode::Closed | FailureMode::OpenInFlight { .. } => failed_closed = true,
                FailureMode::Open { emergency } => {
                    let key = store_key(&m.bucket_key, m.subject(), rate_tag(&emergency));
                    let cost = cost.of(m.descriptor);
                    match open.iter().position(|(k, ..)| *k == key) {
                        Some(slot) => {
                            open[slot].2 = open[slot].2.saturating_add(cost);
                            slot_of[i] = slot;
                        }
                        None => {
                            slot_of[i] = open.len();
                            open.push((key, emergency, cost));
                        }
                    }
                }
            }
        }
        failed_closed &= !denied;
        let check_error = |slot: usize, source: tollgate::Error| Error::Check {
            limit: slot_of
                .iter()
                .position(|&s| s == slot)
                .map(|i| matched[i].limit.name().to_owned())
                .unwrap_or_default(),
            source,
        };
        let mut decisions: Vec<Option<Decision>> = vec![None; open.len()];
        let mut emergency_ok = true;
        if !failed_closed && !open.is_empty() {
            if open.iter().any(|(_, limit, cost)| *cost > limit.capacity()) {
                // The emergency budget can never hold this cost: rejected (never unlimited),
                // and reported as a rejection of that limit with real retry figures, not as a
                // limit that decided nothing. Nothing is charged; the other emergency buckets
                // report what they would decide.
                emergency_ok = false;
                for (slot, (key, limit, cost)) in open.iter().enumerate() {
                    decisions[slot] = Some(if *cost > limit.capacity() {
                        never_fits(limit)
                    } else {
                        self.emergency
                            .peek(&**key, limit, *cost, now)
                            .map_err(|source| check_error(slot, source))?
                    });
                }
            } else {
                let items: Vec<Item<'_, str>> = open
                    .iter()
                    .map(|(key, limit, cost)| Item {
                        key: &**key,
                        limit,
                        cost: *cost,
                    })
                    .collect();
                let results = if consume && !denied {
                    self.emergency.check_all(&items, now, None)
                } else {
                    items
                        .iter()
                        .map(|item| self.emergency.peek(item.key, item.limit, item.cost, now))
                        .collect()
                };
                let results = results.map_err(|source| check_error(0, source))?;
                for (slot, d) in results.into_iter().enumerate() {
                    emergency_ok &= d.allowed();
                    decisions[slot] = Some(d);
                }
            }
        }
        let allowed = !denied && !failed_closed && emergency_ok;
        let mut limits = Vec::with_capacity(matched.len());
        for (m, &slot) in matched.iter().zip(&slot_of) {
            let decision = match m.effect {
                Effect::Exempt(_) => None,
                _ if m.denied => Some(Decision::denied(*m.params(), cost.of(m.descriptor))),
                _ => decisions.get(slot).copied().flatten(),
            };
            let mut exempted_by = None;
            match m.effect {
                Effect::Exempt(exemption) => {
                    exempted_by = Some(exemption.owner().to_owned());
                    if consume {
                        self.use_exemption(m, exemption, &version);
                    }
                }
                Effect::Enforce if consume && !m.denied => {
                    let mode = match m.limit.failure_mode() {
                        FailureMode::Open { .. } => "open",
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
            limits.push(LimitOutcome {
                name: Arc::clone(&m.limit.name),
                descriptor: m.descriptor,
                bucket_key: m.bucket_key.clone(),
                mode: m.effect.as_str(),
                decision,
                exempted_by,
            });
        }
        Ok(Outcome {
            allowed,
            policy_version: version,
            limits,
            degraded: true,
            failed_closed,
            settled: None,
        })
    }

    /// The calendar time to match `policy` at. Matching needs it for exemptions' expiry alone,
    /// so a policy without exemptions is matched without reading the calendar (a system clock
    /// call on every decision).
    fn match_time(&self, policy: &Policy) -> UnixTime {
        if policy.exemptions().is_empty() {
            UnixTime::from_secs(0)
        } else {
            self.options.wall.now()
        }
    }

    /// Counts one use of `exemption` by the match `m` and audits it.
    fn use_exemption<P>(&self, m: &Matched<'_, P>, exemption: &Exemption, version: &str) {
        exemption.record_use();
        self.audit(|| AuditEvent::ExemptionUsed {
            limit: m.limit.name().to_owned(),
            bucket_key: m.bucket_key.clone(),
            owner: exemption.owner().to_owned(),
            reason: exemption.reason().to_owned(),
            expires: exemption.expires().to_rfc3339(),
            uses: exemption.uses(),
            policy_version: version.to_owned(),
        });
    }

    /// Carries this process's buckets of every limit and override in `changes` over to the
    /// new parameters (SPEC §2: refill under the old ones up to now, then clamp to the new
    /// capacity).
    fn carry_over(&self, changes: &[ParamChange]) -> usize {
        if changes.is_empty() {
            return 0;
        }
        let by_name: HashMap<(&str, &str), &ParamChange> = changes
            .iter()
            .map(|c| ((&*c.limit, &*c.override_), c))
            .collect();
        let now = self.options.clock.now();
        self.local.memory().rebase_where(now, |key| {
            let (limit, override_, tag, bucket) = split_store_key(key)?;
            let change = by_name.get(&(limit, override_))?;
            (tag == change.from_tag).then(|| {
                let key = format!("{bucket}@{:08x}", change.to_tag);
                (key.into_boxed_str(), change.from, change.to)
            })
        })
    }

    /// Remembers `changes` for shared stores, before `new` goes in force: takes on a changed
    /// limit carry its old bucket until the new limit's time to full has passed (by then the
    /// new bucket would have refilled from empty, so the old one cannot matter). Earlier
    /// changes stay while they still describe `new` and have time left; a limit changed again
    /// carries from the version just before only.
    fn remember_changes(&self, changes: &[ParamChange], new: &Policy) {
        let now = self.options.clock.now();
        let current = self.carries.load();
        if changes.is_empty() && current.is_empty() {
            return;
        }
        let params_in_new = |limit: &str, override_: &str| {
            let limit = new.limit(limit)?;
            if override_.is_empty() {
                return limit.rate().copied();
            }
            let found = limit.overrides().iter().find(|o| o.name() == override_)?;
            found.rate().copied()
        };
        let mut kept: Vec<Changed> = current
            .iter()
            .filter(|c| c.until > now)
            .filter(|c| {
                !changes
                    .iter()
                    .any(|n| n.limit == c.change.limit && n.override_ == c.change.override_)
            })
            .filter(|c| {
                params_in_new(&c.change.limit, &c.change.override_).map(|p| rate_tag(&p))
                    == Some(c.change.to_tag)
            })
            .cloned()
            .collect();
        kept.extend(changes.iter().map(|change| {
            let ttf = u64::try_from(change.to.time_to_full().as_nanos()).unwrap_or(u64::MAX);
            Changed {
                change: change.clone(),
                at: now,
                until: Timestamp::from_nanos(now.as_nanos().saturating_add(ttf)),
            }
        }));
        self.carries.store(Arc::new(kept));
    }

    /// The old bucket the bucket at store key `key` carries over at `now`, if its limit changed
    /// lately: (old key, old parameters, time since the change).
    fn carry_for(
        carries: &[Changed],
        key: &str,
        now: Timestamp,
    ) -> Option<(Box<str>, Limit, Duration)> {
        let (limit, override_, tag, bucket) = split_store_key(key)?;
        let carried = carries.iter().find(|c| {
            let change = &c.change;
            change.to_tag == tag
                && *change.limit == *limit
                && *change.override_ == *override_
                && now < c.until
        })?;
        let old = format!("{bucket}@{:08x}", carried.change.from_tag).into_boxed_str();
        let since = now.saturating_duration_since(carried.at);
        Some((old, carried.change.from, since))
    }

    fn audit(&self, event: impl FnOnce() -> AuditEvent) {
        if let Some(audit) = &self.options.audit {
            audit.record(&event());
        }
    }
}

/// What a request costs each limit it matches: one cost for every descriptor (the HTTP API's
/// `cost`, Envoy's request `hits_addend`), or a cost per descriptor (Envoy's per-descriptor
/// `hits_addend`), decided together all the same: one rejection charges nothing anywhere.
///
/// A `u64` converts into [`Costs::Same`] and a slice into [`Costs::Each`], so the engine's
/// methods take either.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Costs<'a> {
    /// The same cost for every descriptor.
    Same(u64),
    /// The cost of each descriptor, in order; one per descriptor (a missing one counts as 0,
    /// which is refused).
    Each(&'a [u64]),
}

impl Costs<'_> {
    /// The cost of the match on descriptor `index`.
    fn of(self, index: usize) -> u64 {
        match self {
            Costs::Same(cost) => cost,
            Costs::Each(costs) => costs.get(index).copied().unwrap_or(0),
        }
    }

    /// Whether a descriptor of `descriptors` would cost 0, an error.
    fn any_zero(self, descriptors: usize) -> bool {
        match self {
            Costs::Same(cost) => cost == 0,
            Costs::Each(costs) => costs.len() < descriptors || costs.contains(&0),
        }
    }
}

impl From<u64> for Costs<'_> {
    fn from(cost: u64) -> Self {
        Costs::Same(cost)
    }
}

impl<'a> From<&'a [u64]> for Costs<'a> {
    fn from(costs: &'a [u64]) -> Self {
        Costs::Each(costs)
    }
}

/// The error for a cost of 0, refused before any limit is looked at.
fn zero_cost() -> Error {
    Error::Check {
        limit: String::new(),
        source: tollgate::Error::InvalidCost {
            cost: 0,
            capacity: 0,
        },
    }
}

/// The rejection reported for a cost above `limit`'s capacity when that must not be an error
/// (a limit that cannot reject, or an emergency budget): the bucket is shown empty, asked for
/// its whole capacity, so `remaining` is 0 and `retry_after` equals `reset_after`, the limit's
/// time to full, the soonest it could grant the most it ever can. Asking for the real cost
/// would make `retry_after` a wait for tokens the bucket can never hold (and its arithmetic
/// could overflow for a cost far above the capacity).
fn never_fits(limit: &Limit) -> Decision {
    if let Some(window) = limit.window() {
        return Decision::from_window(false, *limit, limit.capacity(), 0, window, window);
    }
    // A deficit above the capacity is clamped to it: an empty bucket.
    Decision::from_deficit(false, *limit, limit.capacity(), u128::MAX)
}

/// The store key: the bucket key plus the tag of the parameters its state was produced under
/// ([`crate::key::params_tag`]).
///
/// The subject's values go between braces, `per-user|{acme|u1}#gold@0a1b2c3d`: a Redis Cluster
/// hashes only what is inside the first `{…}` of a key, so every bucket of one subject (its
/// limits, their overrides) lands in one slot and a request over them is one atomic script,
/// while different subjects spread over the cluster. A tag per limit or per domain would put
/// all of its traffic on one node. A limit keyed by nothing (one bucket for everyone) has its
/// whole bucket key between braces, `{global#gold}@0a1b2c3d`. Either way the parameter tag
/// stays outside the braces, so a bucket and its earlier self under other parameters share a
/// slot, and a store can read both in one script (see [`Carry`]).
fn store_key(bucket_key: &str, subject: Option<Range<usize>>, tag: u32) -> Box<str> {
    // Built on every decision, so by hand: `format!` costs several times as much. Where the
    // subject's values lie is known from the match, not searched for.
    let mut key = String::with_capacity(bucket_key.len() + 11);
    let parts = subject.and_then(|values| {
        Some((
            bucket_key.get(..values.start)?,
            bucket_key.get(values.clone())?,
            bucket_key.get(values.end..)?,
        ))
    });
    match parts {
        Some((name, values, override_)) => {
            key.push_str(name);
            key.push('{');
            key.push_str(values);
            key.push('}');
            key.push_str(override_);
        }
        None => {
            key.push('{');
            key.push_str(bucket_key);
            key.push('}');
        }
    }
    key.push('@');
    for shift in (0..8).rev() {
        key.push(char::from(
            b"0123456789abcdef"[(tag >> (shift * 4)) as usize & 0xf],
        ));
    }
    key.into_boxed_str()
}

/// Splits a store key into limit name, override name (empty for none), parameter tag and the
/// key without its tag. Names never contain `|`, `#`, `\`, `{` or `@`; values escape `|`, `#`
/// and `\`.
fn split_store_key(key: &str) -> Option<(&str, &str, u32, &str)> {
    let (bucket, tag) = key.rsplit_once('@')?;
    let tag = u32::from_str_radix(tag, 16).ok()?;
    // A limit keyed by nothing: its bucket key in braces (names hold no `{`).
    let named = match bucket.strip_prefix('{') {
        Some(inner) => inner.strip_suffix('}')?,
        None => bucket,
    };
    let limit = named.split(['|', '#']).next()?;
    let override_ = match named.rfind('#') {
        Some(at) if !escaped(named, at) => &named[at + 1..],
        _ => "",
    };
    Some((limit, override_, tag, bucket))
}

/// Whether the character at byte `at` is preceded by an odd number of backslashes.
fn escaped(text: &str, at: usize) -> bool {
    text.as_bytes()[..at]
        .iter()
        .rev()
        .take_while(|&&b| b == b'\\')
        .count()
        % 2
        == 1
}

/// How [`PolicyEngine::run_on`] decides: whether it charges (or only explains), and whether
/// takes name the old buckets of changed limits (for a shared store; this process's buckets
/// were carried over at the change).
#[derive(Clone, Copy)]
struct Run<'u> {
    consume: bool,
    carry: bool,
    /// Settling a charged request: what it used, per descriptor (the rest of its cost is
    /// given back).
    used: Option<Costs<'u>>,
}

/// Gives every exemption of `new` that `old` also has (unchanged) the uses counted so far, so
/// that the count an audit event reports is the exemption's since the process started, not
/// since the last reload. Uses counted by decisions still finishing on `old` are lost.
fn carry_exemption_uses(old: &Policy, new: &Policy) {
    for exemption in new.exemptions() {
        if let Some(before) = old.exemptions().iter().find(|e| e.same_as(exemption)) {
            exemption.uses.store(before.uses(), Ordering::Relaxed);
            // An expiry already audited is not audited again by a reload or a rollback.
            let reported = before.expiry_reported.load(Ordering::Relaxed);
            exemption.expiry_reported.store(reported, Ordering::Relaxed);
        }
    }
}

/// A limit (or one of its overrides, `override_` not empty) whose parameters differ between
/// two versions, with the tags of both parameter sets (see [`store_key`]).
#[derive(Debug, Clone)]
struct ParamChange {
    limit: Box<str>,
    override_: Box<str>,
    from: Limit,
    to: Limit,
    from_tag: u32,
    to_tag: u32,
}

/// Every limit and override present in both versions whose capacity or rate differs.
fn param_changes(old: &Policy, new: &Policy) -> Vec<ParamChange> {
    let mut changes = Vec::new();
    for limit in new.limits() {
        let Some(before) = old.limit(limit.name()) else {
            continue;
        };
        let pairs = std::iter::once(("", before.rate(), limit.rate())).chain(
            limit.overrides().iter().filter_map(|o| {
                let b = before.overrides().iter().find(|b| b.name() == o.name())?;
                Some((o.name(), b.rate(), o.rate()))
            }),
        );
        // Only token buckets carry over: a window limit whose limit per window changes keeps
        // its key and so its counts, and a change of window or algorithm starts afresh (the
        // tags differ, and no store converts between them in flight). Concurrency limits
        // carry nothing: their leases keep their key whatever the bound.
        for (name, was, is) in pairs {
            let (Some(was), Some(is)) = (was, is) else {
                continue;
            };
            if was != is && !was.algorithm().is_window() && !is.algorithm().is_window() {
                changes.push(ParamChange {
                    limit: limit.name().into(),
                    override_: name.into(),
                    from: *was,
                    to: *is,
                    from_tag: rate_tag(was),
                    to_tag: rate_tag(is),
                });
            }
        }
    }
    changes
}

/// A change remembered for shared stores: buckets under the new parameters carry those under
/// the old, from `at` until `until` (engine clock).
#[derive(Debug, Clone)]
struct Changed {
    change: ParamChange,
    at: Timestamp,
    until: Timestamp,
}

/// Names of limits present in both versions whose base or override parameters differ.
fn changed_limits(old: &Policy, new: &Policy) -> Vec<String> {
    new.limits()
        .iter()
        .filter(|limit| {
            old.limit(limit.name()).is_some_and(|before| {
                before.params() != limit.params()
                    || before.deny() != limit.deny()
                    || before.overrides().len() != limit.overrides().len()
                    || before
                        .overrides()
                        .iter()
                        .zip(limit.overrides())
                        .any(|(a, b)| {
                            a.name() != b.name()
                                || a.params() != b.params()
                                || a.unlimited() != b.unlimited()
                                || a.deny() != b.deny()
                        })
            })
        })
        .map(|limit| limit.name().to_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_keys_split_back() {
        let cases = [
            (
                "per-user|{acme|u1}@0000002a",
                ("per-user", "", 42, "per-user|{acme|u1}"),
            ),
            (
                "per-user|{a\\#b}@ffffffff",
                ("per-user", "", u32::MAX, "per-user|{a\\#b}"),
            ),
            (
                "per-user|{a\\\\}#gold@00000001",
                ("per-user", "gold", 1, "per-user|{a\\\\}#gold"),
            ),
            ("global#0@00000000", ("global", "0", 0, "global#0")),
            ("{global#0}@00000000", ("global", "0", 0, "{global#0}")),
            ("{global}@00000000", ("global", "", 0, "{global}")),
            ("l|{x@y}@00000003", ("l", "", 3, "l|{x@y}")),
        ];
        for (key, expected) in cases {
            assert_eq!(split_store_key(key), Some(expected), "{key}");
        }
        assert_eq!(split_store_key("no-tag"), None);
    }

    #[test]
    fn store_keys_carry_the_parameter_tag_in_eight_hex_digits() {
        for (capacity, rate) in [(10, "5/s"), (1, "1/d"), (1_000_000, "999999937/s")] {
            let limit = Limit::new(capacity, rate.parse().unwrap()).unwrap();
            let tag = rate_tag(&limit);
            let key = store_key("per-user|u1", Some(9..11), tag);
            assert_eq!(&*key, format!("per-user|{{u1}}@{tag:08x}"));
            assert_eq!(split_store_key(&key).map(|parts| parts.2), Some(tag));
        }
    }

    /// What a Redis Cluster hashes of a key: the first `{…}`, if not empty, else all of it.
    fn hash_tag(key: &str) -> &str {
        key.find('{')
            .and_then(|open| {
                let close = open + 1 + key[open + 1..].find('}')?;
                (close > open + 1).then(|| &key[open + 1..close])
            })
            .unwrap_or(key)
    }

    /// The store key of each limit `descriptor` matches in `policy`, as the engine makes them.
    fn store_keys(policy: &Policy, descriptor: &[(&str, &str)]) -> Vec<Box<str>> {
        let now = UnixTime::parse_rfc3339("2029-06-01T00:00:00Z").unwrap();
        policy
            .matches("api", &[descriptor.to_vec()], now)
            .iter()
            .map(|m| store_key(&m.bucket_key, m.subject(), m.tag))
            .collect()
    }

    #[test]
    fn the_buckets_of_one_subject_share_a_cluster_slot() {
        let policy = crate::compile(
            "p.yaml",
            r#"
limits:
  - name: per-user
    domain: api
    key: [tenant, user]
    capacity: 10
    refill: 5/s
    overrides:
      - {name: gold, when: {tier: gold}, capacity: 3, refill: 1/s}
  - {name: writes-per-user, domain: api, key: [tenant, user], capacity: 3, refill: 1/s}
  - name: global
    domain: api
    capacity: 100
    refill: 50/s
    overrides:
      - {name: gold, when: {tier: gold}, capacity: 300, refill: 100/s}
"#,
        )
        .unwrap();
        let plain = store_keys(&policy, &[("tenant", "acme"), ("user", "u1")]);
        let gold = store_keys(
            &policy,
            &[("tenant", "acme"), ("user", "u1"), ("tier", "gold")],
        );
        assert_eq!(plain.len(), 3);
        for key in plain
            .iter()
            .chain(&gold)
            .filter(|k| !k.starts_with("{global"))
        {
            assert_eq!(hash_tag(key), "acme|u1", "{key}");
        }
        assert!(
            gold[0].starts_with("per-user|{acme|u1}#gold@"),
            "{}",
            gold[0]
        );
        // Another subject, even one whose values hold separators or braces, gets its own.
        for (user, tier, tag) in [
            ("u2", "", "acme|u2"),
            ("a#b", "gold", "acme|a\\#b"),
            // A `#` in a value, escaped, is no override's: the braces take it in.
            ("a#b", "", "acme|a\\#b"),
            // A value ending in a backslash, escaped, before the override's `#`.
            ("a\\", "gold", "acme|a\\\\"),
            ("x}y", "", "acme|x"),
            ("a|b", "", "acme|a\\|b"),
        ] {
            let keys = store_keys(
                &policy,
                &[("tenant", "acme"), ("user", user), ("tier", tier)],
            );
            assert_eq!(hash_tag(&keys[0]), tag, "{user} {tier}: {}", keys[0]);
            let (limit, override_, _, _) = split_store_key(&keys[0]).unwrap();
            assert_eq!(
                (limit, override_),
                ("per-user", if tier.is_empty() { "" } else { "gold" })
            );
        }
        // One bucket for everyone: its bucket key is the tag, the parameters' tag outside it.
        let global = &plain[2];
        assert_eq!(hash_tag(global), "global");
        let global_gold = &gold[2];
        assert_eq!(hash_tag(global_gold), "global#gold");
        let (_, _, tag, bucket) = split_store_key(global_gold).unwrap();
        assert_eq!(
            split_store_key(global_gold),
            Some(("global", "gold", tag, "{global#gold}"))
        );
        assert_eq!(bucket, "{global#gold}");
        assert_ne!(split_store_key(global).unwrap().2, tag);
    }

    #[test]
    fn enforced_limits_leave_out_shadow_and_exempt_ones_by_the_engine_clock() {
        let policy = crate::compile(
            "p.yaml",
            r#"
limits:
  - {name: per-user, domain: api, key: [user], capacity: 10, refill: 5/s}
  - {name: watched, domain: api, key: [user], capacity: 1, refill: 1/h, mode: shadow}
  - {name: per-team, domain: api, key: [team], capacity: 7, refill: 1/s}
exemptions:
  - {limit: per-user, when: {user: vip}, owner: ops, reason: test, expires: "2030-01-01T00:00:00Z"}
"#,
        )
        .unwrap();
        let wall =
            crate::ManualWallClock::new(UnixTime::parse_rfc3339("2029-06-01T00:00:00Z").unwrap());
        let options = EngineOptions::default().wall_clock(Arc::new(wall.clone()));
        let engine = PolicyEngine::new(policy, options);
        let capacities = |entries: &[(&str, &str)]| {
            let limits = engine.enforced_limits("api", &[entries]).unwrap();
            limits.iter().map(Limit::capacity).collect::<Vec<_>>()
        };
        assert_eq!(capacities(&[("user", "u1"), ("team", "t")]), [10, 7]);
        assert_eq!(capacities(&[("user", "vip")]), [0u64; 0]);
        assert_eq!(capacities(&[("other", "x")]), [0u64; 0]);
        // Past its expiry the exemption lifts nothing.
        wall.set(UnixTime::parse_rfc3339("2030-01-02T00:00:00Z").unwrap());
        assert_eq!(capacities(&[("user", "vip")]), [10]);
    }
}
