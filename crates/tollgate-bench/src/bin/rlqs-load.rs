//! Load for tollgate's RLQS service: Envoys reporting bucket usage over their streams, as fast
//! as each answer comes back, to measure what a bucket report costs the server (the script
//! `scripts/rlqs-cost.sh` sets it beside RLS checks on the same server).
//!
//! Each of `STREAMS` streams stands for an Envoy reporting `BUCKETS` buckets in every message
//! (`tenant=bench-{stream}-{bucket}`, or with `--shared` `tenant=bench-{bucket}`, one bucket
//! every stream shares). It sends its next report once the last is answered, for `SECONDS`,
//! and prints one JSON line: bucket reports and messages a second, message latency, and what
//! the answers assigned.
//!
//! With `--renewals`, each stream reports its buckets once, as an Envoy reporting once a
//! minute would, and then only listens for `SECONDS`: on a limit whose capacity cannot pay
//! for a minute's time-to-live, what comes is tollgate renewing the assignments itself, and
//! the JSON line counts those bucket renewals.
//!
//! `rlqs-load HOST:PORT DOMAIN STREAMS BUCKETS SECONDS [--shared] [--renewals]`

use std::time::Duration;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use hdrhistogram::Histogram;
use tokio::sync::mpsc;
use tollgate::{Clock, MonotonicClock};

/// What one stream saw.
struct Seen {
    messages: u64,
    tokens: u64,
    blanket: u64,
    latency: Histogram<u64>,
}

fn usage(name: String, seconds: i64) -> BucketQuotaUsage {
    BucketQuotaUsage {
        bucket_id: Some(BucketId {
            bucket: [("tenant".to_owned(), name)].into_iter().collect(),
        }),
        time_elapsed: Some(ProtoDuration { seconds, nanos: 0 }),
        num_requests_allowed: 50,
        num_requests_denied: 0,
    }
}

async fn stream(
    target: String,
    domain: String,
    index: usize,
    buckets: usize,
    shared: bool,
    renewals: bool,
    seconds: f64,
) -> Seen {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{target}"))
        .expect("a valid target")
        .connect()
        .await
        .expect("connect to the gRPC port");
    let mut client = RateLimitQuotaServiceClient::new(channel);
    let (reports, mut queued) = mpsc::unbounded_channel();
    let outbound = futures_util::stream::poll_fn(move |cx| queued.poll_recv(cx));
    let mut answers = client
        .stream_rate_limit_quotas(outbound)
        .await
        .expect("the stream opens")
        .into_inner();
    let names: Vec<String> = (0..buckets)
        .map(|bucket| match shared {
            true => format!("bench-{bucket}"),
            false => format!("bench-{index}-{bucket}"),
        })
        .collect();
    let clock = MonotonicClock::new();
    let run_for = Duration::from_secs_f64(seconds);
    let mut seen = Seen {
        messages: 0,
        tokens: 0,
        blanket: 0,
        latency: Histogram::new(3).expect("a histogram"),
    };
    if renewals {
        let report = RateLimitQuotaUsageReports {
            domain: domain.clone(),
            bucket_quota_usages: names.iter().map(|n| usage(n.clone(), 60)).collect(),
        };
        reports.send(report).expect("the stream is open");
        answers
            .message()
            .await
            .expect("an answer, not an error")
            .expect("the stream stays open");
    }
    let start = clock.now();
    while clock.now().saturating_duration_since(start) < run_for {
        let sent = clock.now();
        if !renewals {
            let report = RateLimitQuotaUsageReports {
                domain: domain.clone(),
                bucket_quota_usages: names.iter().map(|n| usage(n.clone(), 1)).collect(),
            };
            reports.send(report).expect("the stream is open");
        }
        let left = run_for.saturating_sub(clock.now().saturating_duration_since(start));
        let answer = match tokio::time::timeout(left, answers.message()).await {
            Ok(answer) => answer
                .expect("an answer, not an error")
                .expect("the stream stays open"),
            // Listening for renewals, the time ran out first.
            Err(_) => break,
        };
        let took = clock.now().saturating_duration_since(sent);
        let _ = seen
            .latency
            .record(u64::try_from(took.as_micros()).unwrap_or(u64::MAX));
        seen.messages += 1;
        for action in answer.bucket_action {
            match action.bucket_action {
                Some(BucketAction::QuotaAssignmentAction(quota)) => {
                    let tokens = quota.rate_limit_strategy.and_then(|s| s.strategy);
                    match tokens {
                        Some(envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::Strategy::TokenBucket(_)) => seen.tokens += 1,
                        _ => seen.blanket += 1,
                    }
                }
                _ => seen.blanket += 1,
            }
        }
    }
    seen
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage_line = "rlqs-load HOST:PORT DOMAIN STREAMS BUCKETS SECONDS [--shared] [--renewals]";
    let [target, domain, streams, buckets, seconds, rest @ ..] = args.as_slice() else {
        eprintln!("usage: {usage_line}");
        std::process::exit(2);
    };
    let parse = |text: &str, what: &str| -> f64 {
        text.parse().unwrap_or_else(|_| {
            eprintln!("{what} must be a number; usage: {usage_line}");
            std::process::exit(2);
        })
    };
    let streams = parse(streams, "STREAMS") as usize;
    let buckets = parse(buckets, "BUCKETS") as usize;
    let seconds = parse(seconds, "SECONDS");
    let shared = rest.iter().any(|arg| arg == "--shared");
    let renewals = rest.iter().any(|arg| arg == "--renewals");
    let clock = MonotonicClock::new();
    let start = clock.now();
    let tasks: Vec<_> = (0..streams)
        .map(|index| {
            tokio::spawn(stream(
                target.clone(),
                domain.clone(),
                index,
                buckets,
                shared,
                renewals,
                seconds,
            ))
        })
        .collect();
    let mut latency = Histogram::<u64>::new(3).expect("a histogram");
    let (mut messages, mut tokens, mut blanket) = (0, 0, 0);
    for task in tasks {
        let seen = task.await.expect("a stream task");
        latency.add(&seen.latency).expect("same histogram bounds");
        messages += seen.messages;
        tokens += seen.tokens;
        blanket += seen.blanket;
    }
    let elapsed = clock.now().saturating_duration_since(start).as_secs_f64();
    if renewals {
        let renewed = tokens + blanket;
        println!(
            "{{\"renewals\":{renewed},\"renewals_per_s\":{:.0},\"messages_per_s\":{:.0},\
             \"tokens\":{tokens},\"blanket\":{blanket}}}",
            renewed as f64 / seconds,
            messages as f64 / seconds,
        );
        return;
    }
    let reports = messages * buckets as u64;
    println!(
        "{{\"bucket_reports\":{reports},\"bucket_reports_per_s\":{:.0},\"messages_per_s\":{:.0},\
         \"p50_us\":{},\"p99_us\":{},\"tokens\":{tokens},\"blanket\":{blanket}}}",
        reports as f64 / elapsed,
        messages as f64 / elapsed,
        latency.value_at_quantile(0.5),
        latency.value_at_quantile(0.99),
    );
}
