//! Envoy's Rate Limit Quota Service (`envoy.service.rate_limit_quota.v3`, RLQS), for Envoys
//! that enforce quotas themselves instead of asking about every request.
//!
//! With RLS an Envoy waits on tollgate for each request. With RLQS it sorts requests into
//! buckets (a `BucketId`, a map of strings), decides each against a token bucket tollgate
//! assigned it, and reports over one long-lived stream, every reporting interval, how many
//! requests each bucket allowed and denied. tollgate answers with assignments sized to each
//! Envoy's demand and pushes new ones as demand moves.
//!
//! How a bucket maps onto tollgate:
//!
//! * The stream's domain and the `BucketId`'s entries are a request descriptor (entries in
//!   any order, as the policy matches entries by name): the limits that apply to it are the
//!   ones an RLS or HTTP check with the same entries meets, on the same buckets. An Envoy on
//!   RLQS and a service on `/v1/check` share one quota.
//! * Every assignment is paid for in the shared buckets before it is sent, for all it could
//!   admit until it expires (the `assignment` module), so Envoys never admit more than the
//!   limits allow together, across any number of tollgate processes on one Redis. What an
//!   Envoy is given and leaves unused is lost to the quota for the time being (but for the
//!   refill an assignment replaced can no longer reach, which is given back): RLQS trades a
//!   bounded under-admission for taking tollgate off the request path.
//! * An assignment is `max_tokens` = `tokens_per_fill` = a rate, per fill interval: a second,
//!   or as many as the slowest limit takes to refill a token. The rate is the Envoy's reported
//!   demand with a margin, capped by a max-min fair share of the limits' refill among the
//!   Envoys this process serves on that bucket, and by what the bucket holds (a bucket's
//!   first report, sent with its first request, starts it with a full share). The rate held
//!   is extended rather than replaced while it is within a fifth below or a quarter above
//!   that and no more than the fair share, since a new strategy makes Envoy start a full
//!   bucket, which must be paid again. Envoys on other processes meet in the store: each
//!   process pays from the same buckets, first come, first served.
//! * A report's buckets are paid together (on Redis their charges share round trips).
//! * The time-to-live is twice the reporting interval (at least 2 s, at most 2 min), so one
//!   late report does not let an assignment lapse.
//! * No limit applies, or none that can reject (shadow, exempt): `ALLOW_ALL`. The bucket is
//!   empty, or a limit fails closed while the store is down: `DENY_ALL` until the next
//!   report. Limits failing open are paid from their emergency budgets, as checks are.
//! * A bucket that reports no requests for `abandon_after` (a minute by default) is abandoned:
//!   Envoy forgets it until its next request.
//!
//! Assumed of Envoy, as the RLQS protocol describes it: an assignment's time-to-live counts
//! from its arrival; the same strategy while active only moves the expiry; anything else
//! starts a full bucket. What Envoy does once an assignment expires (its
//! `expired_assignment_behavior`) is its own configuration: a fallback more generous than the
//! last assignment admits beyond the quota, which tollgate cannot see.

pub(crate) mod assignment;

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket};
use envoy_types::pb::google::protobuf::UInt32Value;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    AbandonAction, BucketAction as Action, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::{
    RateLimitQuotaService, RateLimitQuotaServiceServer,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use futures_util::{Stream, StreamExt, stream};
use parking_lot::Mutex;
use tokio::sync::watch;
use tollgate::{Clock, Limit, MonotonicClock, Timestamp};
use tollgate_policy::Outcome;
use tonic::{Request, Response, Status, Streaming};

use self::assignment::Assignment;
use crate::decider::{Backend, DecideError, Decider, Request as Decide};
use crate::http::{MAX_ENTRIES, MAX_NAME_BYTES, MAX_VALUE_BYTES};
use crate::metrics::{self, Api};

/// The gRPC path prefix of the service.
pub(crate) const PATH: &str = "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/";

/// Reporting interval assumed until a report says how long it covered.
const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);

/// Bounds of the time-to-live: long enough that one late report does not let an assignment
/// lapse, short enough that a changed policy or share reaches Envoy soon.
const MIN_TTL: Duration = Duration::from_secs(2);
const MAX_TTL: Duration = Duration::from_secs(120);

/// How the RLQS service treats the buckets of its streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RlqsOptions {
    /// A bucket reporting no requests for this long is abandoned.
    pub abandon_after: Duration,
    /// Buckets one stream may have assigned; an Envoy reporting more gets no assignment for
    /// the rest (its `no_assignment_behavior` applies to them).
    pub max_buckets: usize,
}

impl Default for RlqsOptions {
    fn default() -> Self {
        Self {
            abandon_after: Duration::from_secs(60),
            max_buckets: 10_000,
        }
    }
}

/// A bucket: its entries sorted by name, as `BucketId` entries have no order.
type Entries = Vec<(String, String)>;

/// A bucket of a domain.
type BucketKey = (Arc<str>, Entries);

/// What each stream's Envoy wants of each bucket (tokens a fill), so that shares are fair
/// across the streams of this process. Streams remove their own entries as they end.
#[derive(Default)]
struct Demands {
    /// Per bucket: stream → want.
    wants: Mutex<HashMap<BucketKey, HashMap<u64, u64>>>,
}

impl Demands {
    /// Records `want` for `stream` and returns its fair share of `supply`.
    fn share(&self, bucket: (Arc<str>, &Entries), stream: u64, want: u64, supply: u64) -> u64 {
        let mut wants = self.wants.lock();
        let key = (bucket.0, bucket.1.clone());
        let of_bucket = wants.entry(key).or_default();
        of_bucket.insert(stream, want);
        let others = of_bucket
            .iter()
            .filter(|&(&other, _)| other != stream)
            .map(|(_, &want)| want);
        assignment::fair_share(supply, want, others)
    }

    fn forget(&self, domain: &Arc<str>, entries: &Entries, stream: u64) {
        let mut wants = self.wants.lock();
        let key = (Arc::clone(domain), entries.clone());
        if let Some(of_bucket) = wants.get_mut(&key) {
            of_bucket.remove(&stream);
            if of_bucket.is_empty() {
                wants.remove(&key);
            }
        }
    }
}

/// The gRPC service.
pub struct Rlqs {
    decider: Arc<Decider>,
    /// The time of assignments' expiries and of reports (the store keeps its own).
    clock: MonotonicClock,
    options: RlqsOptions,
    demands: Arc<Demands>,
    streams: AtomicU64,
    /// Random, told apart from other processes' in request ids.
    nonce: u64,
    stopped: watch::Receiver<bool>,
}

impl Rlqs {
    /// A service assigning quotas through `decider`'s policy and store; its streams end once
    /// `stopped` turns true.
    pub fn new(
        decider: Arc<Decider>,
        options: RlqsOptions,
        stopped: watch::Receiver<bool>,
    ) -> Self {
        Self {
            decider,
            clock: MonotonicClock::new(),
            options,
            demands: Arc::default(),
            streams: AtomicU64::new(0),
            nonce: rand::random(),
            stopped,
        }
    }

    /// The tonic server for this service.
    pub fn into_server(self) -> RateLimitQuotaServiceServer<Self> {
        RateLimitQuotaServiceServer::new(self)
    }
}

/// A charge made for an assignment: its request id, and what it took.
struct Charge {
    id: String,
    cost: u64,
}

/// A token bucket an Envoy holds, and the last charge made for it.
struct Held {
    assignment: Assignment,
    charge: Option<Charge>,
}

/// What tollgate told one stream about one bucket.
struct Bucket {
    /// The token bucket the Envoy holds, if the last answer was one.
    held: Option<Held>,
    last_report: Timestamp,
    /// Since when it has reported no requests.
    idle_since: Option<Timestamp>,
}

/// What pays a stream's assignments: the store, through the policy, and the shares. Shared
/// by the buckets of one report, which are paid at once.
struct Payer {
    /// The stream's number in this process.
    id: u64,
    /// This process's, so that request ids differ from every other process's on one store.
    nonce: u64,
    /// Charges made, numbering their request ids.
    charges: AtomicU64,
    decider: Arc<Decider>,
    demands: Arc<Demands>,
}

/// One Envoy's stream.
struct Session {
    payer: Payer,
    clock: MonotonicClock,
    options: RlqsOptions,
    domain: Option<Arc<str>>,
    buckets: HashMap<Entries, Bucket>,
    inbound: Streaming<RateLimitQuotaUsageReports>,
    stopped: watch::Receiver<bool>,
    /// An error was sent: the stream is over.
    ended: bool,
    /// Buckets refused for the bound were logged once.
    warned_full: bool,
}

impl Drop for Session {
    fn drop(&mut self) {
        metrics::record_rlqs_stream(false);
        if let Some(domain) = &self.domain {
            for entries in self.buckets.keys() {
                self.payer.demands.forget(domain, entries, self.payer.id);
            }
        }
    }
}

fn invalid(message: impl Into<String>) -> Status {
    Status::invalid_argument(message.into())
}

fn duration(d: Duration) -> envoy_types::pb::google::protobuf::Duration {
    envoy_types::pb::google::protobuf::Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

/// A bucket's entries, checked against the bounds of every other API and sorted by name.
fn entries(index: usize, id: Option<BucketId>) -> Result<Entries, Status> {
    let bucket = id.map(|id| id.bucket).unwrap_or_default();
    if bucket.is_empty() || bucket.len() > MAX_ENTRIES {
        return Err(invalid(format!(
            "bucket_quota_usages[{index}]: a bucket_id needs 1 to {MAX_ENTRIES} entries"
        )));
    }
    let mut entries: Entries = bucket.into_iter().collect();
    for (key, value) in &entries {
        if key.is_empty() || key.len() > MAX_NAME_BYTES {
            return Err(invalid(format!(
                "bucket_quota_usages[{index}]: entry names must be 1 to {MAX_NAME_BYTES} bytes"
            )));
        }
        if value.len() > MAX_VALUE_BYTES {
            return Err(invalid(format!(
                "bucket_quota_usages[{index}]: entry values must be at most {MAX_VALUE_BYTES} bytes"
            )));
        }
    }
    entries.sort_unstable();
    Ok(entries)
}

/// The reported `time_elapsed`: `None` when absent or zero.
fn elapsed(index: usize, usage: &BucketQuotaUsage) -> Result<Option<Duration>, Status> {
    let Some(elapsed) = usage.time_elapsed else {
        return Ok(None);
    };
    let (Ok(seconds), Ok(nanos)) = (u64::try_from(elapsed.seconds), u32::try_from(elapsed.nanos))
    else {
        return Err(invalid(format!(
            "bucket_quota_usages[{index}]: time_elapsed must not be negative"
        )));
    };
    if nanos >= 1_000_000_000 {
        return Err(invalid(format!(
            "bucket_quota_usages[{index}]: time_elapsed nanos must be below a second"
        )));
    }
    let elapsed = Duration::new(seconds, nanos);
    Ok((!elapsed.is_zero()).then_some(elapsed))
}

/// The time-to-live for a reporting interval: twice it, rounded up to whole seconds, within
/// the bounds.
fn ttl_for(interval: Duration) -> Duration {
    let doubled = interval.saturating_mul(2);
    let seconds = doubled.as_secs() + u64::from(doubled.subsec_nanos() > 0);
    Duration::from_secs(seconds).clamp(MIN_TTL, MAX_TTL)
}

fn blanket(rule: BlanketRule) -> RateLimitStrategy {
    RateLimitStrategy {
        strategy: Some(Strategy::BlanketRule(rule as i32)),
    }
}

fn token_bucket(rate: u32, fill: Duration) -> RateLimitStrategy {
    RateLimitStrategy {
        strategy: Some(Strategy::TokenBucket(TokenBucket {
            max_tokens: rate,
            tokens_per_fill: Some(UInt32Value { value: rate }),
            fill_interval: Some(duration(fill)),
        })),
    }
}

/// What one report asks of one bucket.
enum Answer {
    /// A token bucket.
    Tokens(Assignment),
    /// `ALLOW_ALL` for this long.
    Allow(Duration),
    /// `DENY_ALL` for this long.
    Deny(Duration),
    Abandon,
    /// Nothing (the stream is at its bound of buckets).
    None,
}

impl Answer {
    fn label(&self) -> &'static str {
        match self {
            Answer::Tokens(_) => "tokens",
            Answer::Allow(_) => "allow_all",
            Answer::Deny(_) => "deny_all",
            Answer::Abandon => "abandon",
            Answer::None => "refused",
        }
    }
}

/// How a charge went.
enum Charged {
    /// Paid.
    Paid,
    /// No limit that can reject applies.
    Free,
    /// A limit fails closed while the store is down.
    Closed,
    /// Too few tokens: this many are left in the tightest enforced bucket.
    Short(u64),
}

impl Session {
    async fn next(mut self) -> Option<(Result<RateLimitQuotaResponse, Status>, Self)> {
        loop {
            if self.ended || *self.stopped.borrow() {
                return None;
            }
            let message = tokio::select! {
                message = self.inbound.message() => message,
                changed = self.stopped.changed() => {
                    if changed.is_err() {
                        return None;
                    }
                    continue;
                }
            };
            match message {
                Ok(Some(reports)) => match self.answer(reports).await {
                    Ok(Some(response)) => return Some((Ok(response), self)),
                    Ok(None) => {}
                    Err(status) => {
                        metrics::record_invalid(Api::Rlqs);
                        self.ended = true;
                        return Some((Err(status), self));
                    }
                },
                // The Envoy closed its side, or went away.
                Ok(None) | Err(_) => return None,
            }
        }
    }

    async fn answer(
        &mut self,
        reports: RateLimitQuotaUsageReports,
    ) -> Result<Option<RateLimitQuotaResponse>, Status> {
        let domain = match (&self.domain, reports.domain.as_str()) {
            (Some(domain), "") => Arc::clone(domain),
            (Some(domain), named) if **domain == *named => Arc::clone(domain),
            (Some(_), _) => {
                return Err(invalid(
                    "the domain is set once per stream; open another stream for another domain",
                ));
            }
            (None, "") => return Err(invalid("the first report must name the domain")),
            (None, named) if named.len() > MAX_NAME_BYTES => {
                return Err(invalid(format!(
                    "domain must be 1 to {MAX_NAME_BYTES} bytes"
                )));
            }
            (None, named) => {
                let domain: Arc<str> = Arc::from(named);
                self.domain = Some(Arc::clone(&domain));
                domain
            }
        };
        // A report holds one usage per bucket the Envoy tracks, as many as gRPC's message
        // size allows: past the stream's bound of buckets, new ones get no assignment.
        // Checked whole before anything is charged: a bad report changes nothing.
        let usages = reports
            .bucket_quota_usages
            .into_iter()
            .enumerate()
            .map(|(index, usage)| {
                let elapsed = elapsed(index, &usage)?;
                let entries = entries(index, usage.bucket_id)?;
                Ok((
                    entries,
                    usage.num_requests_allowed,
                    usage.num_requests_denied,
                    elapsed,
                ))
            })
            .collect::<Result<Vec<_>, Status>>()?;
        let mut seen = std::collections::HashSet::with_capacity(usages.len());
        if let Some(index) = usages.iter().position(|usage| !seen.insert(&usage.0)) {
            return Err(invalid(format!(
                "bucket_quota_usages[{index}]: the same bucket_id as an earlier one"
            )));
        }
        // Each bucket's state is taken out in turn, then all are sized and paid: on
        // Redis at once, so that their charges share round trips instead of queueing one by
        // one; in memory one after the other, as each is decided on the spot.
        let mut work = Vec::with_capacity(usages.len());
        for (entries, allowed, denied, elapsed) in usages {
            metrics::record_rlqs_usage(allowed, denied);
            let step = self.prepare(&domain, &entries, allowed, denied, elapsed);
            work.push((entries, step));
        }
        let payer = &self.payer;
        let paid = match payer.decider.backend() {
            Backend::Memory => {
                let mut paid = Vec::with_capacity(work.len());
                for (entries, step) in &mut work {
                    paid.push(payer.pay(&domain, entries, step).await);
                }
                paid
            }
            Backend::Redis(_) => {
                let paying = work
                    .iter_mut()
                    .map(|(entries, step)| payer.pay(&domain, entries, step));
                futures_util::future::join_all(paying).await
            }
        };
        let mut actions = Vec::with_capacity(paid.len());
        let now = self.clock.now();
        for ((entries, _), (answer, held)) in work.into_iter().zip(paid) {
            metrics::record_rlqs_answer(answer.label());
            if let Some(bucket) = self.buckets.get_mut(&entries) {
                bucket.held = held;
            }
            let action = match answer {
                Answer::None => continue,
                Answer::Abandon => Action::AbandonAction(AbandonAction {}),
                Answer::Tokens(assigned) => {
                    let ttl = assigned.expires_at.saturating_duration_since(now);
                    quota(token_bucket(assigned.rate, assigned.fill), ttl)
                }
                Answer::Allow(ttl) => quota(blanket(BlanketRule::AllowAll), ttl),
                Answer::Deny(ttl) => quota(blanket(BlanketRule::DenyAll), ttl),
            };
            actions.push(BucketAction {
                bucket_id: Some(BucketId {
                    bucket: entries.into_iter().collect(),
                }),
                bucket_action: Some(action),
            });
        }
        self.forget_silent(&domain);
        Ok((!actions.is_empty()).then_some(RateLimitQuotaResponse {
            bucket_action: actions,
        }))
    }

    /// Buckets no longer reported at all (Envoy dropped them) are forgotten after
    /// `abandon_after`, so a stream's state does not grow with every bucket it ever had.
    fn forget_silent(&mut self, domain: &Arc<str>) {
        let now = self.clock.now();
        let after = self.options.abandon_after;
        let (demands, id) = (&self.payer.demands, self.payer.id);
        self.buckets.retain(|entries, bucket| {
            let keep = now.saturating_duration_since(bucket.last_report) < after;
            if !keep {
                demands.forget(domain, entries, id);
            }
            keep
        });
    }

    /// What one bucket's report asks for, before anything is paid: the bucket's state is
    /// taken out (and put back once paid), so that the buckets of a report are paid at once.
    fn prepare(
        &mut self,
        domain: &Arc<str>,
        entries: &Entries,
        allowed: u64,
        denied: u64,
        elapsed: Option<Duration>,
    ) -> Step {
        let now = self.clock.now();
        let requests = allowed.saturating_add(denied);
        if !self.buckets.contains_key(entries) && self.buckets.len() >= self.options.max_buckets {
            if !self.warned_full {
                self.warned_full = true;
                tracing::warn!(
                    domain = &**domain,
                    bound = self.options.max_buckets,
                    "an RLQS stream reports more buckets than it may be assigned; the rest get none"
                );
            }
            return Step::Refused;
        }
        let first = !self.buckets.contains_key(entries);
        let bucket = self.buckets.entry(entries.clone()).or_insert(Bucket {
            held: None,
            last_report: now,
            idle_since: None,
        });
        let since_last = now.saturating_duration_since(bucket.last_report);
        bucket.last_report = now;
        let held = bucket.held.take();
        if requests == 0 {
            let idle_since = *bucket.idle_since.get_or_insert(now);
            if now.saturating_duration_since(idle_since) >= self.options.abandon_after {
                self.buckets.remove(entries);
                self.payer.demands.forget(domain, entries, self.payer.id);
                return Step::Abandon { held, now };
            }
        } else {
            bucket.idle_since = None;
        }
        let interval = elapsed
            .or((!since_last.is_zero()).then_some(since_last))
            .unwrap_or(DEFAULT_INTERVAL);
        Step::Assign {
            held,
            requests,
            first,
            interval,
            ttl: ttl_for(interval),
            now,
        }
    }
}

/// One bucket's report, between [`Session::prepare`] and its payment.
enum Step {
    /// Past the stream's bound of buckets: no answer.
    Refused,
    /// Quiet for too long: Envoy is told to forget it.
    Abandon { held: Option<Held>, now: Timestamp },
    /// An assignment to size and pay.
    Assign {
        held: Option<Held>,
        requests: u64,
        /// The bucket's first report on this stream.
        first: bool,
        interval: Duration,
        ttl: Duration,
        now: Timestamp,
    },
}

impl Payer {
    /// Pays for what `step` asks (the state it holds is taken out of it), and returns the
    /// answer and what the Envoy holds after it.
    async fn pay(
        &self,
        domain: &Arc<str>,
        entries: &Entries,
        step: &mut Step,
    ) -> (Answer, Option<Held>) {
        match std::mem::replace(step, Step::Refused) {
            Step::Refused => (Answer::None, None),
            Step::Abandon { held, now } => {
                // Envoy forgets the bucket: what it had paid ahead goes back.
                self.give_back(domain, entries, held, now, MIN_TTL / 4)
                    .await;
                (Answer::Abandon, None)
            }
            Step::Assign {
                held,
                requests,
                first,
                interval,
                ttl,
                now,
            } => {
                // A first report is sent as the bucket's first request arrives, and says
                // little about its demand: the Envoy starts with a full share, so that a
                // busy bucket is not denied until its next report. The next report sizes it.
                let want = |fill, supply: u64| {
                    let want = assignment::wanted_rate(requests, interval, fill);
                    if first { want.max(supply) } else { want }
                };
                self.assign(domain, entries, held, want, ttl, now).await
            }
        }
    }

    /// The answer for a bucket whose Envoy holds `held` and wants `want(fill, supply)`
    /// tokens a fill, paid for in the store, and what the Envoy holds after it.
    async fn assign(
        &self,
        domain: &Arc<str>,
        entries: &Entries,
        held: Option<Held>,
        want: impl FnOnce(Duration, u64) -> u64,
        ttl: Duration,
        now: Timestamp,
    ) -> (Answer, Option<Held>) {
        // A message is taken to reach the Envoy within a quarter of the time-to-live.
        let margin = ttl / 4;
        let limits = self
            .decider
            .engine()
            .enforced_limits(domain, std::slice::from_ref(entries));
        // None applies, or none can reject (shadow, exempt): nothing to pay for.
        let Some(capacity) = limits.iter().map(Limit::capacity).min() else {
            self.give_back(domain, entries, held, now, margin).await;
            return (Answer::Allow(ttl), None);
        };
        let refills = || {
            limits
                .iter()
                .map(|l| (l.refill().amount(), l.refill().period()))
        };
        let fill = assignment::fill_interval(refills());
        // What the limits refill in a fill interval: the most all Envoys can share.
        let supply = refills()
            .map(|(amount, period)| assignment::refill_per(fill, amount, period))
            .min()
            .unwrap_or(0);
        let want = want(fill, supply);
        let share = self
            .demands
            .share((Arc::clone(domain), entries), self.id, want, supply);
        let most = assignment::largest_rate(capacity, fill, ttl);
        let rate = u32::try_from(share).unwrap_or(u32::MAX).min(most);
        // The rate held is kept when it is no more than this Envoy's share and close to the
        // rate it would get: a new strategy is a new full bucket to pay, and demand jitters.
        let close = |held: u32| {
            let (held, rate) = (u64::from(held), u64::from(rate));
            held <= share && held * 5 >= rate * 4 && held * 4 <= rate * 5
        };
        let held = match held {
            Some(held)
                if held.assignment.fill == fill
                    && held.assignment.extendable(now, margin)
                    && close(held.assignment.rate) =>
            {
                let (extended, cost) = held.assignment.extended(now, ttl);
                match self.charge(domain, entries, cost).await {
                    (Charged::Paid, charge) => {
                        let charge = charge.or(held.charge);
                        let held = Held {
                            assignment: extended,
                            charge,
                        };
                        return (Answer::Tokens(extended), Some(held));
                    }
                    (Charged::Free, _) => {
                        self.give_back(domain, entries, Some(held), now, margin)
                            .await;
                        return (Answer::Allow(ttl), None);
                    }
                    // Replaced below by what the bucket still pays for.
                    (Charged::Closed | Charged::Short(_), _) => Some(held),
                }
            }
            other => other,
        };
        // Whatever the Envoy holds is replaced: the refill it will not reach goes back first,
        // so that it can pay for the new assignment (its own or another Envoy's).
        self.give_back(domain, entries, held, now, margin).await;
        let mut rate = rate;
        for _ in 0..2 {
            if rate == 0 {
                break;
            }
            let (fresh, cost) = Assignment::fresh(rate, fill, now, ttl);
            match self.charge(domain, entries, cost).await {
                (Charged::Paid, charge) => {
                    let held = Held {
                        assignment: fresh,
                        charge,
                    };
                    return (Answer::Tokens(fresh), Some(held));
                }
                (Charged::Free, _) => return (Answer::Allow(ttl), None),
                (Charged::Closed, _) => break,
                // Too few tokens: the largest fresh bucket what is left pays for, if any.
                (Charged::Short(available), _) => {
                    rate = rate.min(assignment::largest_rate(available, fill, ttl));
                }
            }
        }
        (Answer::Deny(ttl), None)
    }

    /// Gives back the refill `held` paid for beyond `now + margin`, which its Envoy will not
    /// reach once its assignment is replaced, from the last charge made for it. A store that
    /// cannot answer keeps it (the quota under-admits, never over-admits).
    async fn give_back(
        &self,
        domain: &str,
        entries: &Entries,
        held: Option<Held>,
        now: Timestamp,
        margin: Duration,
    ) {
        let Some(Held {
            assignment,
            charge: Some(charge),
        }) = held
        else {
            return;
        };
        let refund = assignment.unused(now, margin).min(charge.cost);
        if refund == 0 {
            return;
        }
        let request = Decide {
            domain,
            descriptors: std::slice::from_ref(entries),
            cost: charge.cost.into(),
            request_id: Some(&charge.id),
        };
        match self.decider.settle(&request, charge.cost - refund).await {
            Ok(_) => metrics::record_rlqs_given_back(refund),
            Err(err) => {
                tracing::debug!(domain, error = %err, "unused RLQS tokens could not be given back");
            }
        }
    }

    /// Takes `cost` tokens from every limit on the bucket, all or nothing, under a request
    /// id of its own so that what goes unused can be given back.
    async fn charge(
        &self,
        domain: &str,
        entries: &Entries,
        cost: u64,
    ) -> (Charged, Option<Charge>) {
        if cost == 0 {
            return (Charged::Paid, None);
        }
        let charge = self.charges.fetch_add(1, Ordering::Relaxed);
        let id = format!("rlqs-{:016x}-{}-{charge}", self.nonce, self.id);
        let request = Decide {
            domain,
            descriptors: std::slice::from_ref(entries),
            cost: cost.into(),
            request_id: Some(&id),
        };
        let outcome: Outcome = match self.decider.decide(Api::Rlqs, &request).await {
            Ok(outcome) => outcome,
            // Larger than a capacity (a policy reloaded between sizing and charging), or a
            // limit the store cannot represent: nothing was charged, and nothing is given.
            Err(err @ (DecideError::Invalid(_) | DecideError::Internal(_))) => {
                tracing::warn!(domain, error = %err, "an RLQS assignment could not be charged");
                return (Charged::Short(0), None);
            }
            Err(DecideError::Unavailable(_)) => return (Charged::Closed, None),
        };
        if outcome.failed_closed {
            return (Charged::Closed, None);
        }
        let enforced = outcome
            .limits
            .iter()
            .filter(|limit| limit.mode == "enforce")
            .filter_map(|limit| limit.decision);
        let mut tightest = None::<u64>;
        for decision in enforced {
            tightest = Some(tightest.map_or(decision.remaining(), |t| t.min(decision.remaining())));
        }
        match tightest {
            None => (Charged::Free, None),
            Some(_) if outcome.allowed => {
                metrics::record_rlqs_prepaid(cost);
                (Charged::Paid, Some(Charge { id, cost }))
            }
            // A cost above an emergency budget's capacity is shown as an empty bucket: what
            // the budgets hold is asked apart, so that a smaller assignment can be paid.
            Some(_) if outcome.degraded => {
                (Charged::Short(self.emergency_left(domain, entries)), None)
            }
            Some(left) => (Charged::Short(left), None),
        }
    }

    /// What the emergency budgets of the bucket's limits hold now (0 if any is empty).
    fn emergency_left(&self, domain: &str, entries: &Entries) -> u64 {
        let descriptors = std::slice::from_ref(entries);
        let explained =
            self.decider
                .engine()
                .explain_degraded(domain, descriptors, 1u64, "store unavailable");
        let Ok(outcome) = explained else {
            return 0;
        };
        if !outcome.allowed {
            return 0;
        }
        outcome
            .limits
            .iter()
            .filter(|limit| limit.mode == "enforce")
            .filter_map(|limit| limit.decision)
            .map(|decision| decision.remaining().saturating_add(1))
            .min()
            .unwrap_or(0)
    }
}

fn quota(strategy: RateLimitStrategy, ttl: Duration) -> Action {
    Action::QuotaAssignmentAction(QuotaAssignmentAction {
        assignment_time_to_live: Some(duration(ttl)),
        rate_limit_strategy: Some(strategy),
    })
}

type Assignments = Pin<Box<dyn Stream<Item = Result<RateLimitQuotaResponse, Status>> + Send>>;

#[tonic::async_trait]
impl RateLimitQuotaService for Rlqs {
    type StreamRateLimitQuotasStream = Assignments;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Assignments>, Status> {
        metrics::record_rlqs_stream(true);
        let payer = Payer {
            id: self.streams.fetch_add(1, Ordering::Relaxed),
            nonce: self.nonce,
            charges: AtomicU64::new(0),
            decider: Arc::clone(&self.decider),
            demands: Arc::clone(&self.demands),
        };
        let session = Session {
            payer,
            clock: self.clock.clone(),
            options: self.options,
            domain: None,
            buckets: HashMap::new(),
            inbound: request.into_inner(),
            stopped: self.stopped.clone(),
            ended: false,
            warned_full: false,
        };
        Ok(Response::new(
            stream::unfold(session, Session::next).boxed(),
        ))
    }
}
