//! Arbitrary RLQS streams against the real binary: reports in any domain, buckets with no
//! entries, empty or long ones, the same bucket twice, counts up to 2^64 - 1, and times
//! elapsed absent, zero, negative, malformed or the longest a protobuf duration holds. However
//! a stream's reports go, it ends with its client's half or with `INVALID_ARGUMENT`, never
//! another status; every answer holds an action for a bucket, and every token bucket assigned
//! is one Envoy can run (tokens and a fill interval); and the server, its logs free of any
//! panic, goes on assigning.
//!
//! `rlqs.rs` holds each refusal and assignment by name; this holds the service against
//! streams nobody thought to send.

mod support;

use std::time::Duration;

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::Strategy as Assigned;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, TestRunner};
use support::rlqs::{Envoy, usage};
use support::{Scratch, Server, path_str};

const POLICY: &str = r#"
version: "1"
limits:
  - name: per-tenant
    domain: edge
    key: [tenant]
    capacity: 1000
    refill: 10/s
  - name: tiny
    domain: edge
    key: [team]
    capacity: 1
    refill: 1/h
  - name: blocked
    domain: edge
    when: {tenant: evil}
    key: [tenant]
    deny: true
"#;

fn bucket_id() -> impl Strategy<Value = Option<BucketId>> {
    let entry = (
        prop_oneof![
            20 => prop::sample::select(vec!["tenant", "team", "other"]).prop_map(str::to_owned),
            1 => Just(String::new()),
            1 => Just("k".repeat(300)),
        ],
        prop_oneof![
            20 => prop::sample::select(vec!["a", "b", "c", "d", "e", "f", "evil", ""]).prop_map(str::to_owned),
            1 => Just("v".repeat(2_000)),
            1 => "\\PC{0,6}",
        ],
    );
    prop_oneof![
        40 => prop::collection::btree_map(entry.0, entry.1, 1..3)
            .prop_map(|bucket| Some(BucketId { bucket: bucket.into_iter().collect() })),
        1 => Just(Some(BucketId::default())),
        1 => Just(None),
    ]
}

fn elapsed() -> impl Strategy<Value = Option<ProtoDuration>> {
    let duration = |seconds, nanos| Some(ProtoDuration { seconds, nanos });
    prop_oneof![
        60 => (0i64..3, 0i32..1_000_000_000).prop_map(move |(s, n)| duration(s, n)),
        1 => Just(None),
        1 => Just(duration(0, 0)),
        1 => Just(duration(-1, 0)),
        1 => Just(duration(0, -1)),
        1 => Just(duration(0, 1_000_000_000)),
        1 => Just(duration(i64::MAX, 999_999_999)),
    ]
}

fn count() -> impl Strategy<Value = u64> {
    prop_oneof![8 => 0u64..20, 1 => Just(1_000_000), 1 => Just(u64::MAX)]
}

fn report() -> impl Strategy<Value = RateLimitQuotaUsageReports> {
    let usage = (bucket_id(), elapsed(), count(), count()).prop_map(
        |(bucket_id, time_elapsed, allowed, denied)| BucketQuotaUsage {
            bucket_id,
            time_elapsed,
            num_requests_allowed: allowed,
            num_requests_denied: denied,
        },
    );
    (
        prop_oneof![
            30 => Just("edge".to_owned()),
            1 => Just("other".to_owned()),
            1 => Just(String::new()),
        ],
        prop::collection::vec(usage, 0..4),
    )
        .prop_map(|(domain, bucket_quota_usages)| RateLimitQuotaUsageReports {
            domain,
            bucket_quota_usages,
        })
}

/// Checks one answer: an action for a bucket, each, that Envoy can carry out. Returns how many
/// token buckets it assigns.
fn check_answer(answer: &RateLimitQuotaResponse, sent: &[RateLimitQuotaUsageReports]) -> usize {
    let mut buckets = 0;
    for action in &answer.bucket_action {
        let bucket = action
            .bucket_id
            .as_ref()
            .expect("an action names its bucket");
        assert!(!bucket.bucket.is_empty(), "{answer:?} for {sent:?}");
        match action.bucket_action.as_ref().expect("an action") {
            Action::AbandonAction(_) => {}
            Action::QuotaAssignmentAction(quota) => {
                let ttl = quota.assignment_time_to_live.expect("a time to live");
                assert!(ttl.seconds >= 0 && (0..1_000_000_000).contains(&ttl.nanos));
                match quota
                    .rate_limit_strategy
                    .as_ref()
                    .and_then(|s| s.strategy.as_ref())
                {
                    Some(Assigned::TokenBucket(tokens)) => {
                        let fill = tokens.fill_interval.expect("a fill interval");
                        assert!(tokens.max_tokens > 0, "{answer:?} for {sent:?}");
                        assert!(
                            fill.seconds > 0 || fill.nanos > 0,
                            "{answer:?} for {sent:?}"
                        );
                        buckets += 1;
                    }
                    Some(Assigned::BlanketRule(_)) => {}
                    other => panic!("no strategy Envoy runs: {other:?} for {sent:?}"),
                }
            }
        }
    }
    buckets
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_stream_of_reports_is_answered_or_refused_and_the_server_serves_on() {
    let scratch = Scratch::new("arbitrary-rlqs");
    let config = scratch.write("policy.yaml", POLICY);
    let (server, logs) = Server::start_logging(&["--config", path_str(&config)], "error");
    let mut runner = TestRunner::new(Config {
        failure_persistence: None,
        ..Config::default()
    });
    let streams = prop::collection::vec(report(), 1..4);
    let (mut refused, mut ended, mut buckets) = (0, 0, 0);
    // Driven by hand, each stream in turn: the runner's own loop cannot await.
    for _ in 0..1000 {
        let sent = streams
            .new_tree(&mut runner)
            .expect("a stream of reports")
            .current();
        let (reports, mut answers) = Envoy::connect(&server).await.split();
        // A stream the server has refused is over: the client drops its side, and the reports
        // queued after the refused one have nowhere to go. How many were sent by then depends
        // on how fast the server refused, so the test sends until the stream takes no more.
        let taken = sent
            .iter()
            .take_while(|report| reports.send((*report).clone()).is_ok())
            .count();
        // Closing its half, as an Envoy going away does: the server answers what it owes and
        // ends the stream, or refuses it.
        drop(reports);
        let delivered = &sent[..taken];
        loop {
            let next = tokio::time::timeout(Duration::from_secs(5), answers.message())
                .await
                .unwrap_or_else(|_| panic!("the stream ends within 5 s: {sent:?}"));
            match next {
                Ok(Some(answer)) => buckets += check_answer(&answer, delivered),
                Ok(None) => {
                    // Only a refusal ends a stream before its client does.
                    assert_eq!(taken, sent.len(), "ended early for {sent:?}");
                    ended += 1;
                    break;
                }
                Err(status) => {
                    assert_eq!(
                        status.code(),
                        tonic::Code::InvalidArgument,
                        "{status:?} for {sent:?}"
                    );
                    refused += 1;
                    break;
                }
            }
        }
    }
    assert!(
        refused >= 200 && ended >= 200 && buckets >= 100,
        "refused {refused}, ended {ended}, token buckets assigned {buckets}"
    );
    // Still assigning.
    let mut envoy = Envoy::connect(&server).await;
    let actions = envoy
        .report(
            "edge",
            vec![usage(&[("tenant", "a")], 1, 0, Duration::from_secs(1))],
        )
        .await;
    assert_eq!(actions.len(), 1);
    drop(envoy);
    let logs = server.terminate_and_read(logs);
    assert!(!logs.contains("panicked"), "{logs}");
}
