//! An Envoy's side of RLQS (`StreamRateLimitQuotas`): a stream of usage reports out and of
//! assignments in, and what the assignments received let it admit.

use std::collections::HashMap;
use std::time::Duration;

use envoy_types::pb::envoy::r#type::v3::RateLimitStrategy;
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use tokio::sync::mpsc;
use tollgate::Timestamp as Instant;
use tonic::Streaming;

use super::Server;

/// One Envoy's stream: reports go in, assignments come out.
pub struct Envoy {
    reports: mpsc::UnboundedSender<RateLimitQuotaUsageReports>,
    pub answers: Streaming<RateLimitQuotaResponse>,
}

impl Envoy {
    pub async fn connect(server: &Server) -> Self {
        let mut client = RateLimitQuotaServiceClient::new(server.grpc_channel().await);
        let (reports, mut queued) = mpsc::unbounded_channel();
        let outbound = futures_util::stream::poll_fn(move |cx| queued.poll_recv(cx));
        let answers = client
            .stream_rate_limit_quotas(outbound)
            .await
            .expect("the stream opens")
            .into_inner();
        Self { reports, answers }
    }

    pub fn send(&self, report: RateLimitQuotaUsageReports) {
        self.reports.send(report).expect("the stream is open");
    }

    /// Its reports' sender and its answers apart, for a test that reports on a schedule while
    /// a task listens, as Envoy does: a server owes no answer to a report (it keeps an
    /// assignment it cannot extend just then), so reading one per report can wait for nothing.
    pub fn split(
        self,
    ) -> (
        mpsc::UnboundedSender<RateLimitQuotaUsageReports>,
        Streaming<RateLimitQuotaResponse>,
    ) {
        (self.reports, self.answers)
    }

    /// The next answer, within a few seconds.
    pub async fn answer(&mut self) -> Result<Option<RateLimitQuotaResponse>, tonic::Status> {
        tokio::time::timeout(Duration::from_secs(5), self.answers.message())
            .await
            .expect("an answer within 5 s")
    }

    /// Reports `usages` in `domain` and returns each bucket's action.
    pub async fn report(&mut self, domain: &str, usages: Vec<BucketQuotaUsage>) -> Vec<Action> {
        self.send(RateLimitQuotaUsageReports {
            domain: domain.to_owned(),
            bucket_quota_usages: usages,
        });
        let answer = self.answer().await.expect("no error").expect("an answer");
        answer
            .bucket_action
            .into_iter()
            .map(|action| action.bucket_action.expect("an action"))
            .collect()
    }
}

pub fn bucket(entries: &[(&str, &str)]) -> BucketId {
    BucketId {
        bucket: entries
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
    }
}

pub fn usage(
    entries: &[(&str, &str)],
    allowed: u64,
    denied: u64,
    elapsed: Duration,
) -> BucketQuotaUsage {
    BucketQuotaUsage {
        bucket_id: Some(bucket(entries)),
        time_elapsed: Some(ProtoDuration {
            seconds: elapsed.as_secs() as i64,
            nanos: elapsed.subsec_nanos() as i32,
        }),
        num_requests_allowed: allowed,
        num_requests_denied: denied,
    }
}

/// What an assignment says: a token bucket (rate, fill, time-to-live) or a blanket rule.
#[derive(Debug, PartialEq)]
pub enum Assigned {
    Tokens {
        rate: u32,
        fill: Duration,
        ttl: Duration,
    },
    Allow(Duration),
    Deny(Duration),
    Abandon,
}

fn seconds(d: Option<ProtoDuration>) -> Duration {
    let d = d.expect("a duration");
    Duration::new(d.seconds as u64, d.nanos as u32)
}

pub fn assigned(action: Action) -> Assigned {
    match action {
        Action::AbandonAction(_) => Assigned::Abandon,
        Action::QuotaAssignmentAction(quota) => {
            let ttl = seconds(quota.assignment_time_to_live);
            match quota.rate_limit_strategy {
                Some(RateLimitStrategy {
                    strategy: Some(Strategy::TokenBucket(bucket)),
                }) => {
                    let per_fill = bucket.tokens_per_fill.expect("tokens per fill").value;
                    assert_eq!(bucket.max_tokens, per_fill, "a bucket of one fill");
                    Assigned::Tokens {
                        rate: per_fill,
                        fill: seconds(bucket.fill_interval),
                        ttl,
                    }
                }
                Some(RateLimitStrategy {
                    strategy: Some(Strategy::BlanketRule(rule)),
                }) if rule == BlanketRule::AllowAll as i32 => Assigned::Allow(ttl),
                Some(RateLimitStrategy {
                    strategy: Some(Strategy::BlanketRule(rule)),
                }) if rule == BlanketRule::DenyAll as i32 => Assigned::Deny(ttl),
                other => panic!("unexpected strategy {other:?}"),
            }
        }
    }
}

/// One report message.
pub fn reports(domain: &str, usages: Vec<BucketQuotaUsage>) -> RateLimitQuotaUsageReports {
    RateLimitQuotaUsageReports {
        domain: domain.to_owned(),
        bucket_quota_usages: usages,
    }
}

/// An Envoy's most admissions under the assignments it was sent, as RLQS describes them (see
/// the service's `assignment` module): a new strategy starts a full bucket, the same one
/// while active only moves the expiry, and a bucket refills its rate each fill interval.
#[derive(Default)]
pub struct Admissions {
    held: HashMap<u32, (u32, Duration, Instant, Instant)>,
    pub could_admit: f64,
}

impl Admissions {
    pub fn close(&mut self, envoy: u32, until: Instant) {
        if let Some((rate, fill, since, expires)) = self.held.remove(&envoy) {
            let end = until.min(expires);
            let held = end.saturating_duration_since(since);
            self.could_admit += f64::from(rate) * held.as_secs_f64() / fill.as_secs_f64();
        }
    }

    /// Asserts that what the Envoys could admit stays within a limit of `capacity` refilled
    /// `per_second` over `lasted` (from the first charge to the last), and that at least a
    /// full bucket was handed out, not hoarded. Prints the figures.
    pub fn assert_within(&self, capacity: f64, per_second: f64, lasted: Duration) {
        let bound = capacity + per_second * lasted.as_secs_f64();
        eprintln!("the Envoys could admit {} of {bound}", self.could_admit);
        assert!(
            self.could_admit <= bound,
            "{} could be admitted; the limit allows {bound}",
            self.could_admit
        );
        assert!(self.could_admit >= capacity, "{}", self.could_admit);
    }

    pub fn receive(&mut self, envoy: u32, now: Instant, assigned: Assigned) {
        match (self.held.get(&envoy).copied(), assigned) {
            (Some((held, fill, since, expires)), Assigned::Tokens { rate, fill: f, ttl })
                if held == rate && fill == f && now < expires =>
            {
                self.held.insert(envoy, (held, fill, since, now + ttl));
            }
            (_, Assigned::Tokens { rate, fill, ttl }) => {
                self.close(envoy, now);
                self.could_admit += f64::from(rate);
                self.held.insert(envoy, (rate, fill, now, now + ttl));
            }
            (_, Assigned::Deny(_)) => self.close(envoy, now),
            (_, other) => panic!("unexpected {other:?}"),
        }
    }
}

/// Envoys (one stream each, on the servers given) that report `entries` once, as if they
/// reported once a minute, then only listen for `listen`: all they are sent, renewals
/// included, counted into what they could admit. Returns that, and the time of the last
/// answer, from `start`.
pub async fn slow_envoys(
    servers: &[&Server],
    entries: &[(&str, &str)],
    listen: Duration,
) -> (Admissions, Duration) {
    use tollgate::{Clock, MonotonicClock};
    let clock = MonotonicClock::new();
    let start = clock.now();
    let mut listening = Vec::new();
    for (index, server) in servers.iter().enumerate() {
        let mut envoy = Envoy::connect(server).await;
        let clock = clock.clone();
        envoy.send(reports(
            "edge",
            vec![usage(entries, 1, 0, Duration::from_secs(60))],
        ));
        listening.push(tokio::spawn(async move {
            let mut received = Vec::new();
            let until = clock.now() + listen;
            while clock.now() < until {
                let message = envoy.answer().await.expect("no error").expect("an answer");
                for action in message.bucket_action {
                    let action = assigned(action.bucket_action.expect("an action"));
                    received.push((index as u32, clock.now(), action));
                }
            }
            received
        }));
    }
    let mut admissions = Admissions::default();
    let mut last = start;
    let mut tokens = 0;
    for listener in listening {
        for (index, at, action) in listener.await.expect("the listener") {
            tokens += usize::from(matches!(action, Assigned::Tokens { .. }));
            last = last.max(at);
            admissions.receive(index, at, action);
        }
    }
    assert!(tokens >= servers.len(), "{tokens} token buckets sent");
    for index in 0..servers.len() {
        admissions.close(index as u32, last + Duration::from_secs(120));
    }
    (admissions, last.saturating_duration_since(start))
}
