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
//!   bucket, which must be paid again; a rate held below the share is replaced only by a
//!   larger one the bucket pays for, and extended otherwise. On Redis the fair share spans
//!   processes: each posts its Envoys' wants on the store's board every second (the `board`
//!   module) and splits its share among them.
//! * A report's buckets are paid together (on Redis their charges share round trips).
//! * The time-to-live is twice the reporting interval (at least 2 s, at most 2 min), so one
//!   late report does not let an assignment lapse. Paid whole when sent, from buckets holding
//!   at most their capacity, that long would cap the rate of a limit whose capacity is a few
//!   seconds of its refill (and deny one of a minute's, under Envoy's minute-long reporting
//!   intervals). Such assignments get twice `renew_every` (1 s by default) instead, and
//!   tollgate renews them itself between reports, extending the strategy Envoy holds.
//! * No limit applies, or none that can reject (shadow, exempt): `ALLOW_ALL`. The bucket is
//!   empty, or a limit fails closed while the store is down: `DENY_ALL`, renewed (another
//!   try at an assignment) every `renew_every` until tokens can be paid again. Limits
//!   failing open are paid from their emergency budgets, as checks are.
//! * A bucket that reports no requests for `abandon_after` (a minute by default) is abandoned:
//!   Envoy forgets it until its next request.
//!
//! Assumed of Envoy, as the RLQS protocol describes it: an assignment's time-to-live counts
//! from its arrival; the same strategy while active only moves the expiry; anything else
//! starts a full bucket. What Envoy does once an assignment expires (its
//! `expired_assignment_behavior`) is its own configuration: a fallback more generous than the
//! last assignment admits beyond the quota, which tollgate cannot see.

pub(crate) mod assignment;
mod board;
mod message;
mod payer;

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::BlanketRule;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    AbandonAction, BucketAction as Action,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::{
    RateLimitQuotaService, RateLimitQuotaServiceServer,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use futures_util::{Stream, StreamExt, stream};
use tokio::sync::{Semaphore, watch};
use tollgate::{Clock, MonotonicClock, Timestamp};
use tonic::{Request, Response, Status, Streaming};

use self::message::{Entries, blanket, elapsed, entries, invalid, quota, token_bucket};
use self::payer::{Answer, Demands, Held, Payer, Step};
use crate::decider::{Backend, Decider};
use crate::http::MAX_NAME_BYTES;
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
    /// How often tollgate renews, between reports, the assignments it gave a short
    /// time-to-live (twice this): those a limit's capacity could not pay for the reporting
    /// interval's, and `DENY_ALL`. Shorter renewals let a small capacity pay a higher rate,
    /// at the cost of a payment per bucket and renewal.
    pub renew_every: Duration,
}

impl Default for RlqsOptions {
    fn default() -> Self {
        Self {
            abandon_after: Duration::from_secs(60),
            max_buckets: 10_000,
            renew_every: Duration::from_secs(1),
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
    /// Bounds the store calls of all streams together.
    in_flight: Arc<Semaphore>,
    streams: AtomicU64,
    /// Random, told apart from other processes' in request ids.
    nonce: u64,
    stopped: watch::Receiver<bool>,
}

impl Rlqs {
    /// A service assigning quotas through `decider`'s policy and store; its streams end once
    /// `stopped` turns true.
    ///
    /// On Redis, the service posts its Envoys' wants for fair shares across processes (the
    /// `board` module) from a task on the Tokio runtime it is created in; created outside
    /// one, it shares buckets fairly among its own streams only.
    pub fn new(
        decider: Arc<Decider>,
        options: RlqsOptions,
        stopped: watch::Receiver<bool>,
    ) -> Self {
        let rlqs = Self {
            decider,
            clock: MonotonicClock::new(),
            options,
            demands: Arc::default(),
            in_flight: Arc::new(Semaphore::new(payer::IN_FLIGHT)),
            streams: AtomicU64::new(0),
            nonce: rand::random(),
            stopped,
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(board::post_wants(
                Arc::clone(&rlqs.decider),
                Arc::clone(&rlqs.demands),
                Arc::clone(&rlqs.in_flight),
                rlqs.nonce,
                rlqs.stopped.clone(),
            ));
        }
        rlqs
    }

    /// The tonic server for this service.
    pub fn into_server(self) -> RateLimitQuotaServiceServer<Self> {
        RateLimitQuotaServiceServer::new(self)
    }

    /// The tonic server for this service, shared by every serving thread.
    pub(crate) fn server(rlqs: Arc<Self>) -> RateLimitQuotaServiceServer<Self> {
        RateLimitQuotaServiceServer::from_arc(rlqs)
    }
}

/// What tollgate told one stream about one bucket.
struct Bucket {
    /// The token bucket the Envoy holds, if the last answer was one.
    held: Option<Held>,
    last_report: Timestamp,
    /// Since when it has reported no requests.
    idle_since: Option<Timestamp>,
    /// The last report's requests and the time they covered: the demand renewals assume.
    requests: u64,
    interval: Duration,
    /// A report after the first has come: the demand is measured.
    sized: bool,
    /// When tollgate renews the last answer itself, if it had the short time-to-live.
    renew_at: Option<Timestamp>,
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
    /// Ticks at half the renewal interval, to renew what is due.
    renewals: tokio::time::Interval,
    /// When a renewal may next be due: at or before every bucket's `renew_at` (none if no
    /// bucket has one).
    next_renewal: Option<Timestamp>,
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

/// The time-to-live for a reporting interval: twice it, rounded up to whole seconds, within
/// the bounds.
fn ttl_for(interval: Duration) -> Duration {
    let doubled = interval.saturating_mul(2);
    let seconds = doubled
        .as_secs()
        .saturating_add(u64::from(doubled.subsec_nanos() > 0));
    Duration::from_secs(seconds).clamp(MIN_TTL, MAX_TTL)
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
                _ = self.renewals.tick() => {
                    match self.renew().await {
                        Some(response) => return Some((Ok(response), self)),
                        None => continue,
                    }
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
        let actions = self.deliver(&domain, work).await;
        self.forget_silent(&domain);
        Ok((!actions.is_empty()).then_some(RateLimitQuotaResponse {
            bucket_action: actions,
        }))
    }

    /// Renews the answers due for it (see [`Payer::assign`](payer::Payer)): a token bucket
    /// the capacity could only pay for a short time, or `DENY_ALL`, of a bucket the Envoy
    /// still reports. Nothing to send if none is due.
    async fn renew(&mut self) -> Option<RateLimitQuotaResponse> {
        let domain = self.domain.clone()?;
        let now = self.clock.now();
        // Most ticks find nothing due: a stream's buckets are looked at only when one is.
        if self.next_renewal.is_none_or(|at| at > now) {
            return None;
        }
        let renew_every = self.options.renew_every;
        let mut work = Vec::new();
        let mut next = None::<Timestamp>;
        for (entries, bucket) in &mut self.buckets {
            let Some(at) = bucket.renew_at else {
                continue;
            };
            if at > now {
                next = Some(next.map_or(at, |next| next.min(at)));
                continue;
            }
            bucket.renew_at = None;
            // Envoy reports every bucket it has each interval: one missing from two reports
            // in a row is gone, and renewing it would only pay for tokens no one spends.
            let reported = now.saturating_duration_since(bucket.last_report)
                <= bucket
                    .interval
                    .saturating_mul(2)
                    .saturating_add(renew_every);
            if !reported {
                continue;
            }
            let step = Step::Assign {
                held: bucket.held.take(),
                requests: bucket.requests,
                first: !bucket.sized,
                interval: bucket.interval,
                ttl: ttl_for(bucket.interval),
                now,
                renewal: true,
            };
            work.push((entries.clone(), step));
        }
        self.next_renewal = next;
        if work.is_empty() {
            return None;
        }
        let actions = self.deliver(&domain, work).await;
        metrics::record_rlqs_renewed(actions.len());
        (!actions.is_empty()).then_some(RateLimitQuotaResponse {
            bucket_action: actions,
        })
    }

    /// Pays for each bucket's step, keeps what its Envoy holds after it, and returns the
    /// actions to send.
    async fn deliver(
        &mut self,
        domain: &Arc<str>,
        mut work: Vec<(Entries, Step)>,
    ) -> Vec<BucketAction> {
        // When each step was prepared, and the time-to-live its reporting interval called
        // for: an answer with a shorter one is renewed by tollgate.
        let prepared: Vec<Option<(Timestamp, Duration)>> = work
            .iter()
            .map(|(_, step)| match step {
                Step::Assign { now, ttl, .. } => Some((*now, *ttl)),
                _ => None,
            })
            .collect();
        let payer = &self.payer;
        let paid = match payer.decider.backend() {
            Backend::Memory => {
                let mut paid = Vec::with_capacity(work.len());
                for (entries, step) in &mut work {
                    paid.push(payer.pay(domain, entries, step).await);
                }
                paid
            }
            Backend::Redis(_) => {
                let paying = work
                    .iter_mut()
                    .map(|(entries, step)| payer.pay(domain, entries, step));
                futures_util::future::join_all(paying).await
            }
        };
        let mut actions = Vec::with_capacity(paid.len());
        let now = self.clock.now();
        let renew_every = self.options.renew_every;
        for (((entries, _), (answer, held)), prepared) in work.into_iter().zip(paid).zip(prepared) {
            metrics::record_rlqs_answer(answer.label());
            let renewed = match (&answer, prepared) {
                // Tried again at the next renewal, unless a report comes first.
                (Answer::Deny(_) | Answer::Keep, _) => true,
                (Answer::Tokens(assigned), Some((then, ttl))) => assigned.expires_at < then + ttl,
                _ => false,
            };
            if let Some(bucket) = self.buckets.get_mut(&entries) {
                bucket.held = held;
                // Ticks come every half interval: renewed three quarters to one and a
                // quarter intervals after this answer, an assignment of twice the interval
                // still has more than its margin (a quarter of it) to run.
                bucket.renew_at = renewed.then(|| now + (renew_every - renew_every / 4));
                if let Some(at) = bucket.renew_at {
                    self.next_renewal = Some(self.next_renewal.map_or(at, |next| next.min(at)));
                }
            }
            let action = match answer {
                Answer::None | Answer::Keep => continue,
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
        actions
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
        let first = !self.buckets.contains_key(entries);
        if first && self.buckets.len() >= self.options.max_buckets {
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
        // A known bucket is found by reference: only a new one copies its entries.
        if first {
            let bucket = Bucket {
                held: None,
                last_report: now,
                idle_since: None,
                requests: 0,
                interval: DEFAULT_INTERVAL,
                sized: false,
                renew_at: None,
            };
            self.buckets.insert(entries.clone(), bucket);
        }
        let Some(bucket) = self.buckets.get_mut(entries) else {
            return Step::Refused;
        };
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
        bucket.requests = requests;
        bucket.interval = interval;
        bucket.sized |= !first;
        Step::Assign {
            held,
            requests,
            first,
            interval,
            ttl: ttl_for(interval),
            now,
            renewal: false,
        }
    }
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
            in_flight: Arc::clone(&self.in_flight),
            short_ttl: self.options.renew_every.saturating_mul(2),
            warned_small: AtomicBool::new(false),
        };
        let tick = self.options.renew_every / 2;
        let mut renewals = tokio::time::interval_at(tokio::time::Instant::now() + tick, tick);
        renewals.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
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
            renewals,
            next_renewal: None,
        };
        Ok(Response::new(
            stream::unfold(session, Session::next).boxed(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_time_to_live_is_twice_the_interval_in_whole_seconds_within_bounds() {
        let ms = Duration::from_millis;
        assert_eq!(ttl_for(ms(1_000)), Duration::from_secs(2));
        assert_eq!(ttl_for(ms(1_200)), Duration::from_secs(3));
        assert_eq!(ttl_for(ms(1_500)), Duration::from_secs(3));
        assert_eq!(ttl_for(Duration::from_secs(10)), Duration::from_secs(20));
        assert_eq!(
            ttl_for(Duration::from_nanos(10_000_000_001)),
            Duration::from_secs(21)
        );
        // Within the bounds: a late report needs two seconds' slack; a policy change must
        // reach the Envoy within two minutes.
        assert_eq!(ttl_for(Duration::ZERO), MIN_TTL);
        assert_eq!(ttl_for(ms(300)), MIN_TTL);
        assert_eq!(ttl_for(Duration::from_secs(60)), MAX_TTL);
        assert_eq!(ttl_for(Duration::from_secs(61)), MAX_TTL);
        assert_eq!(ttl_for(Duration::MAX), MAX_TTL);
    }
}
