//! End to end: Envoy's rate-limit quota service (RLQS) on the real binary, through a tonic
//! client built from the same Envoy types, sending usage reports as Envoy's RLQS filter does.

mod support;

use std::time::Duration;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::RateLimitQuotaUsageReports;
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use tollgate::{Clock, MonotonicClock};

use support::rlqs::{Admissions, Assigned, Envoy, assigned, reports, slow_envoys, usage};
use support::{Scratch, Server, assert_serve_flags_refused, metric, post_json, request};

const POLICY: &str = r#"
version: "1"
limits:
  - name: per-tenant
    domain: edge
    key: [tenant]
    capacity: 1000
    refill: 10/s
  - name: pool
    domain: edge
    key: [pool]
    capacity: 60
    refill: 20/s
  - name: tiny
    domain: edge
    key: [team]
    capacity: 10
    refill: 1/s
  - name: small
    domain: edge
    key: [client]
    capacity: 10
    refill: 10/s
  - name: per-minute
    domain: edge
    key: [account]
    capacity: 100
    refill: 100/m
  - name: single
    domain: edge
    key: [seat]
    capacity: 1
    refill: 1/s
  - name: watched
    domain: edge
    key: [probe]
    capacity: 1
    refill: 1/h
    mode: shadow
  - name: blocked
    domain: edge
    when: {tenant: [evil, worse]}
    key: [tenant]
    deny: true
"#;

/// What one more request would leave of `entry`'s bucket, as `/v1/explain` says.
fn remaining(server: &Server, entry: &str, value: &str) -> u64 {
    let body = format!(r#"{{"domain":"edge","descriptors":[{{"{entry}":"{value}"}}]}}"#);
    let answer = post_json(server.http, "/v1/explain", &body);
    assert_eq!(answer.status, 200, "{}", answer.body);
    answer.json()["limits"][0]["remaining"]
        .as_u64()
        .expect("remaining")
}

fn start() -> (Server, Scratch) {
    start_with("rlqs", &[])
}

fn start_with(name: &str, args: &[&str]) -> (Server, Scratch) {
    let scratch = Scratch::new(name);
    let policy = scratch.write("policy.yaml", POLICY);
    let config = ["--config", policy.to_str().expect("utf-8")];
    let server = Server::start(&[&config[..], args].concat());
    (server, scratch)
}

const SECOND: Duration = Duration::from_secs(1);

/// The rate of the token bucket assigned for the one bucket in `usages`.
async fn token_rate(envoy: &mut Envoy, usages: Vec<BucketQuotaUsage>) -> u32 {
    match assigned(envoy.report("edge", usages).await.remove(0)) {
        Assigned::Tokens { rate, .. } => rate,
        other => panic!("a token bucket, not {other:?}"),
    }
}

#[tokio::test]
async fn an_assignment_is_sized_to_demand_and_paid_from_the_shared_bucket() {
    let (server, _scratch) = start();
    let mut envoy = Envoy::connect(&server).await;
    let actions = envoy
        .report("edge", vec![usage(&[("tenant", "a")], 5, 0, SECOND)])
        .await;
    // Demand 5/s, a quarter more and one: 7 tokens a second, for twice the interval.
    let [action] = <[Action; 1]>::try_from(actions).expect("one action");
    let Assigned::Tokens { rate, fill, ttl } = assigned(action) else {
        panic!("a token bucket");
    };
    // A first report comes with the bucket's first request and says little of its demand:
    // the Envoy starts with all it may have, the limit's 10 a second, for twice the interval.
    assert_eq!((rate, fill), (10, SECOND));
    assert!(ttl <= 2 * SECOND && ttl > SECOND, "{ttl:?}");
    // Paid before it was sent: a full bucket and two seconds of refill.
    let prepaid = || metric(&server, "tollgate_rlqs_prepaid_tokens_total");
    assert_eq!(prepaid(), 30.0);
    let left = remaining(&server, "tenant", "a");
    // (An explanation's remaining is what one more request would leave.)
    assert!(
        (968..=980).contains(&left),
        "{left} left of 1000 after 30 taken"
    );

    // A second later the demand is known, 6 a second: a bucket of 8 replaces the first, and
    // the refill the first had paid beyond the replacement (less half a second's margin for
    // the answer's trip) goes back.
    tokio::time::sleep(SECOND).await;
    assert_eq!(
        token_rate(&mut envoy, vec![usage(&[("tenant", "a")], 6, 0, SECOND)]).await,
        8
    );
    assert_eq!(prepaid(), 30.0 + 24.0);
    let given_back = metric(&server, "tollgate_rlqs_given_back_tokens_total");
    // At most half a second of the first's refill (5): less when the report came late.
    assert!((1.0..=5.0).contains(&given_back), "{given_back}");

    // At the same demand a second later, the bucket held is extended: one more second of
    // refill, and no new full bucket.
    tokio::time::sleep(SECOND).await;
    assert_eq!(
        token_rate(&mut envoy, vec![usage(&[("tenant", "a")], 6, 0, SECOND)]).await,
        8
    );
    let extended = prepaid() - 54.0;
    assert!((8.0..=12.0).contains(&extended), "{extended}: about 8 more");
    let charges = metric(
        &server,
        r#"tollgate_decisions_total{limit="per-tenant",result="allowed",mode="enforce",api="rlqs"}"#,
    );
    assert_eq!(charges, 3.0);
}

#[tokio::test]
async fn envoys_on_one_bucket_get_fair_shares_of_the_refill() {
    fair_shares(start()).await;
}

/// With a runtime per core, the two Envoys' connections are served by different threads,
/// which must still see each other's demand.
#[tokio::test]
async fn fair_shares_span_the_threads_of_a_runtime_per_core() {
    let args = ["--runtime", "per-core", "--threads", "2"];
    fair_shares(start_with("rlqs-per-core", &args)).await;
}

async fn fair_shares((server, _scratch): (Server, Scratch)) {
    let (mut first, mut second) = (Envoy::connect(&server).await, Envoy::connect(&server).await);
    let busy = || vec![usage(&[("tenant", "b")], 400, 100, SECOND)];
    let rate = |actions: Vec<Action>| match assigned(actions.into_iter().next().expect("one")) {
        Assigned::Tokens { rate, .. } => rate,
        other => panic!("a token bucket, not {other:?}"),
    };
    // Alone, the first may have all of the limit's 10 a second.
    assert_eq!(rate(first.report("edge", busy()).await), 10);
    // Two Envoys wanting more than all of it: half each, the first shrunk at its next report.
    assert_eq!(rate(second.report("edge", busy()).await), 5);
    assert_eq!(rate(first.report("edge", busy()).await), 5);
    // A quiet Envoy takes what it needs and leaves the rest to the busy one, which keeps the
    // rate it holds as long as that is within a fifth of its new share (6).
    let quiet = vec![usage(&[("tenant", "b")], 3, 0, SECOND)];
    assert_eq!(rate(second.report("edge", quiet).await), 4);
    assert_eq!(rate(first.report("edge", busy()).await), 5);
    assert_eq!(metric(&server, "tollgate_rlqs_streams"), 2.0);

    // When an Envoy leaves, its demand goes with it, once the server has seen its stream
    // end: asked again until then (at most 5 s), not after a guess at how long that takes.
    drop(second);
    let mut alone = 0;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        alone = rate(first.report("edge", busy()).await);
        if alone == 10 {
            break;
        }
    }
    assert_eq!(alone, 10, "the first Envoy is alone again");
    // Its stream was counted out before its demand was forgotten.
    assert_eq!(metric(&server, "tollgate_rlqs_streams"), 1.0);
}

#[tokio::test]
async fn an_empty_bucket_denies_and_one_without_an_enforced_limit_allows() {
    let (server, _scratch) = start();
    // Another client spends the team's whole quota over HTTP.
    let spend = r#"{"domain":"edge","descriptors":[{"team":"t"}],"cost":10}"#;
    assert_eq!(post_json(server.http, "/v1/check", spend).status, 200);
    let mut envoy = Envoy::connect(&server).await;
    let actions = envoy
        .report(
            "edge",
            vec![
                usage(&[("team", "t")], 3, 0, SECOND),
                usage(&[("probe", "p")], 3, 0, SECOND),
                usage(&[("nobody", "n")], 3, 0, SECOND),
            ],
        )
        .await;
    let actions: Vec<Assigned> = actions.into_iter().map(assigned).collect();
    assert!(
        matches!(actions[0], Assigned::Deny(ttl) if ttl >= 2 * SECOND),
        "{actions:?}"
    );
    // A shadow limit never rejects, and no limit at all applies to the third.
    assert!(matches!(actions[1], Assigned::Allow(_)), "{actions:?}");
    assert!(matches!(actions[2], Assigned::Allow(_)), "{actions:?}");
    assert_eq!(
        metric(&server, r#"tollgate_rlqs_answers_total{action="deny_all"}"#),
        1.0
    );
    assert_eq!(
        metric(
            &server,
            r#"tollgate_rlqs_answers_total{action="allow_all"}"#
        ),
        2.0
    );
    assert_eq!(
        metric(
            &server,
            r#"tollgate_rlqs_reported_requests_total{result="allowed"}"#
        ),
        9.0
    );
}

/// A tenant on a block list gets a deny-all assignment at once: nothing to pay for, nothing
/// charged to its other limits.
#[tokio::test]
async fn a_denied_bucket_is_assigned_deny_all_and_charged_nothing() {
    let (server, _scratch) = start();
    let mut envoy = Envoy::connect(&server).await;
    for _ in 0..2 {
        let actions = envoy
            .report("edge", vec![usage(&[("tenant", "worse")], 5, 0, SECOND)])
            .await;
        let actions: Vec<Assigned> = actions.into_iter().map(assigned).collect();
        assert!(matches!(actions[..], [Assigned::Deny(_)]), "{actions:?}");
    }
    // per-tenant, which applies too, was not charged for the assignments (a peek at cost 1).
    assert_eq!(remaining(&server, "tenant", "worse"), 999);
    assert_eq!(
        metric(&server, r#"tollgate_rlqs_answers_total{action="deny_all"}"#),
        2.0
    );
}

#[tokio::test]
async fn a_quiet_bucket_is_abandoned() {
    let scratch = Scratch::new("rlqs-abandon");
    let policy = scratch.write("policy.yaml", POLICY);
    let server = Server::start(&[
        "--config",
        policy.to_str().expect("utf-8"),
        "--rlqs-abandon-after",
        "1s",
    ]);
    let mut envoy = Envoy::connect(&server).await;
    let quiet = || vec![usage(&[("tenant", "q")], 0, 0, SECOND)];
    assert!(matches!(
        assigned(envoy.report("edge", quiet()).await.remove(0)),
        Assigned::Tokens { .. }
    ));
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert_eq!(
        metric(&server, "tollgate_rlqs_given_back_tokens_total"),
        0.0
    );
    assert_eq!(
        assigned(envoy.report("edge", quiet()).await.remove(0)),
        Assigned::Abandon
    );
    // Its refill was paid 2 s ahead: what lies past the abandonment (and the margin for the
    // message's trip) goes back.
    assert!(metric(&server, "tollgate_rlqs_given_back_tokens_total") > 0.0);
    // A request after that subscribes afresh.
    let busy = vec![usage(&[("tenant", "q")], 1, 0, SECOND)];
    assert!(matches!(
        assigned(envoy.report("edge", busy).await.remove(0)),
        Assigned::Tokens { .. }
    ));
}

#[tokio::test]
async fn busy_envoys_together_never_get_more_than_the_limit() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    let (server, _scratch) = start();
    let clock = MonotonicClock::new();
    let start = clock.now();
    let reporting = Arc::new(AtomicBool::new(true));
    // Each Envoy listens in a task of its own, as Envoy does: a report is owed no answer (the
    // server keeps an assignment it cannot extend just then), and renewals come unasked.
    let mut senders = Vec::new();
    let mut listening = Vec::new();
    for index in 0..4u32 {
        let (sender, mut answers) = Envoy::connect(&server).await.split();
        senders.push(sender);
        let (clock, reporting) = (clock.clone(), Arc::clone(&reporting));
        listening.push(tokio::spawn(async move {
            let mut received = Vec::new();
            let mut quiet_since = None;
            loop {
                let next = tokio::time::timeout(SECOND / 2, answers.message()).await;
                match next {
                    Ok(Ok(Some(message))) => {
                        for action in message.bucket_action {
                            let action = assigned(action.bucket_action.expect("an action"));
                            received.push((index, clock.now(), action));
                        }
                    }
                    Ok(Ok(None)) => break,
                    Ok(Err(status)) => panic!("the stream failed: {status}"),
                    // Reports are over, and their answers have had a second to come.
                    Err(_) if !reporting.load(Ordering::Relaxed) => {
                        let since = *quiet_since.get_or_insert_with(|| clock.now());
                        if clock.now().saturating_duration_since(since) >= SECOND {
                            break;
                        }
                    }
                    Err(_) => {}
                }
            }
            received
        }));
    }
    // Four Envoys report busy every 100 ms for 3 s, each at its own demand: assignments
    // change, extend and shrink. Whatever they were sent, all they could admit together
    // stays within the bucket's capacity and its refill over the run.
    for round in 0u64..30 {
        for (index, sender) in senders.iter().enumerate() {
            let demand = 20 + 40 * index as u64 + round % 7 * 10;
            let usage = usage(&[("pool", "shared")], demand, demand, SECOND / 10);
            sender
                .send(reports("edge", vec![usage]))
                .expect("the stream is open");
        }
        tokio::time::sleep(SECOND / 10).await;
    }
    reporting.store(false, Ordering::Relaxed);
    let mut admissions = Admissions::default();
    let mut answered = start;
    for listener in listening {
        for (index, at, action) in listener.await.expect("the listener") {
            answered = answered.max(at);
            admissions.receive(index, at, action);
        }
    }
    drop(senders);
    // Every assignment ends at its expiry at the latest: count its refill up to there. All
    // of it was paid by the last answer, from a bucket holding 60 and refilling 20 a second.
    let end = clock.now() + Duration::from_secs(120);
    for envoy in 0..4 {
        admissions.close(envoy, end);
    }
    admissions.assert_within(60.0, 20.0, answered.saturating_duration_since(start));
}

#[tokio::test]
async fn bad_reports_end_the_stream_with_invalid_argument_and_charge_nothing() {
    let (server, _scratch) = start();
    let ok = || usage(&[("tenant", "c")], 1, 0, SECOND);
    let negative = BucketQuotaUsage {
        time_elapsed: Some(ProtoDuration {
            seconds: -1,
            nanos: 0,
        }),
        ..ok()
    };
    let long = "v".repeat(2_000);
    let long_domain = "d".repeat(257);
    let cases: Vec<(&str, Vec<RateLimitQuotaUsageReports>, &str)> = vec![
        ("no domain", vec![reports("", vec![ok()])], "domain"),
        (
            "a domain too long",
            vec![reports(&long_domain, vec![ok()])],
            "domain must be 1 to 256 bytes",
        ),
        (
            "an empty bucket id",
            vec![reports(
                "edge",
                vec![BucketQuotaUsage {
                    bucket_id: None,
                    ..ok()
                }],
            )],
            "bucket_id",
        ),
        (
            "a negative time",
            vec![reports("edge", vec![ok(), negative])],
            "time_elapsed",
        ),
        (
            "a huge value",
            vec![reports(
                "edge",
                vec![usage(&[("tenant", &long)], 1, 0, SECOND)],
            )],
            "values",
        ),
        (
            "another domain later",
            vec![reports("edge", vec![]), reports("other", vec![ok()])],
            "domain",
        ),
        (
            "a bucket twice",
            vec![reports("edge", vec![ok(), ok()])],
            "same bucket_id",
        ),
    ];
    for (case, sent, says) in cases {
        let mut envoy = Envoy::connect(&server).await;
        for report in sent {
            envoy.send(report);
        }
        let status = envoy.answer().await.expect_err(case);
        assert_eq!(
            status.code(),
            tonic::Code::InvalidArgument,
            "{case}: {status:?}"
        );
        assert!(
            status.message().contains(says),
            "{case}: {}",
            status.message()
        );
    }
    assert_eq!(metric(&server, "tollgate_rlqs_prepaid_tokens_total"), 0.0);
    assert_eq!(remaining(&server, "tenant", "c"), 999);
    // The server still serves.
    let mut envoy = Envoy::connect(&server).await;
    assert_eq!(envoy.report("edge", vec![ok()]).await.len(), 1);
    // A domain of the longest name is one, which no limit of this policy names.
    let mut envoy = Envoy::connect(&server).await;
    let answer = envoy.report(&"d".repeat(256), vec![ok()]).await;
    assert!(
        matches!(assigned(answer[0]), Assigned::Allow(_)),
        "{answer:?}"
    );
    // A report covering the longest time a protobuf duration holds is no error: the
    // time-to-live is capped, and so is the time a renewal waits for the next report.
    let ancient = BucketQuotaUsage {
        time_elapsed: Some(ProtoDuration {
            seconds: i64::MAX,
            nanos: 999_999_999,
        }),
        ..usage(&[("tenant", "d")], 1, 0, SECOND)
    };
    let mut envoy = Envoy::connect(&server).await;
    assert!(token_rate(&mut envoy, vec![ancient]).await > 0);
    assert!(matches!(
        renewal(&mut envoy).await[..],
        [Assigned::Tokens { .. }]
    ));
}

#[tokio::test]
async fn a_sigterm_ends_the_streams_and_the_process_exits_cleanly() {
    let (server, _scratch) = start();
    let mut envoy = Envoy::connect(&server).await;
    let actions = envoy
        .report("edge", vec![usage(&[("tenant", "d")], 1, 0, SECOND)])
        .await;
    assert_eq!(actions.len(), 1);
    let status = tokio::task::spawn_blocking(move || server.terminate())
        .await
        .expect("terminate");
    assert!(status.success(), "{status:?}");
    // The stream ended (cleanly or with the connection), rather than hanging.
    let ended = tokio::time::timeout(Duration::from_secs(5), envoy.answers.message()).await;
    assert!(matches!(ended, Ok(Ok(None) | Err(_))), "{ended:?}");
}

/// A reloaded policy reaches the Envoys at their next report: a limit put in shadow mode
/// turns the bucket's assignment into `ALLOW_ALL`, and a slower refill into a longer fill
/// interval.
#[tokio::test]
async fn a_reloaded_policy_changes_the_next_assignment() {
    let (server, scratch) = start();
    let config = scratch.0.join("policy.yaml");
    let mut envoy = Envoy::connect(&server).await;
    let busy = || vec![usage(&[("team", "r")], 3, 0, SECOND)];
    assert!(matches!(
        assigned(envoy.report("edge", busy()).await.remove(0)),
        Assigned::Tokens { fill, .. } if fill == SECOND
    ));
    let tenant = || vec![usage(&[("tenant", "r")], 3, 0, SECOND)];
    assert!(matches!(
        assigned(envoy.report("edge", tenant()).await.remove(0)),
        Assigned::Tokens { .. }
    ));
    let reload = |text: String| {
        std::fs::write(&config, text).expect("write the policy");
        let answer = request(server.http, "POST", "/v1/policy/reload", &[], "");
        assert_eq!(answer.status, 200, "{}", answer.body);
    };
    // The team limit refills 10 a minute: a token every 6 s.
    reload(POLICY.replace(
        "    capacity: 10\n    refill: 1/s",
        "    capacity: 10\n    refill: 10/m",
    ));
    let actions = envoy.report("edge", busy()).await;
    assert!(
        matches!(
            assigned(actions[0]),
            Assigned::Tokens { rate: 1, fill, .. } if fill == 6 * SECOND
        ),
        "{actions:?}"
    );
    reload(
        POLICY
            .replace(
                "    capacity: 10\n    refill: 1/s",
                "    capacity: 10\n    refill: 1/s\n    mode: shadow",
            )
            .replace(
                "    capacity: 1000\n    refill: 10/s",
                "    capacity: 1000\n    refill: 10/s\n    mode: shadow",
            ),
    );
    assert!(matches!(
        assigned(envoy.report("edge", busy()).await.remove(0)),
        Assigned::Allow(_)
    ));
    // The tenant's token bucket was paid for 2 s of refill: once it is `ALLOW_ALL`, what
    // lies past the margin for the message's trip goes back.
    let before = metric(&server, "tollgate_rlqs_given_back_tokens_total");
    assert!(matches!(
        assigned(envoy.report("edge", tenant()).await.remove(0)),
        Assigned::Allow(_)
    ));
    let given = metric(&server, "tollgate_rlqs_given_back_tokens_total") - before;
    assert!(given > 0.0, "{given}");
}

/// An Envoy reporting more buckets than a stream may be assigned gets assignments for the
/// first it reported, and none for the rest, which its `no_assignment_behavior` then covers.
#[tokio::test]
async fn buckets_past_the_bound_get_no_assignment() {
    let scratch = Scratch::new("rlqs-bound");
    let policy = scratch.write("policy.yaml", POLICY);
    let args = [
        "--config",
        policy.to_str().expect("utf-8"),
        "--rlqs-max-buckets",
        "2",
    ];
    let (server, logs) = Server::start_logging(&args, "warn");
    let mut envoy = Envoy::connect(&server).await;
    let tenants = |names: &[&str]| -> Vec<BucketQuotaUsage> {
        names
            .iter()
            .map(|name| usage(&[("tenant", name)], 1, 0, SECOND))
            .collect()
    };
    let answered = envoy.report("edge", tenants(&["a", "b", "c"])).await;
    assert_eq!(answered.len(), 2);
    let answered = envoy.report("edge", tenants(&["c", "b", "a"])).await;
    assert_eq!(answered.len(), 2);
    assert_eq!(
        metric(&server, r#"tollgate_rlqs_answers_total{action="refused"}"#),
        2.0
    );
    // Said once per stream, not at every report.
    drop(envoy);
    let logs = server.terminate_and_read(logs);
    let said = logs
        .matches("an RLQS stream reports more buckets than it may be assigned")
        .count();
    assert_eq!(said, 1, "{logs}");
}

/// The actions of the next message tollgate sends of itself (a renewal).
async fn renewal(envoy: &mut Envoy) -> Vec<Assigned> {
    let message = envoy.answer().await.expect("no error").expect("a renewal");
    message
        .bucket_action
        .into_iter()
        .map(|action| assigned(action.bucket_action.expect("an action")))
        .collect()
}

/// An Envoy reporting once a minute: an assignment paid for twice that (two minutes) could
/// not be paid at all by a limit whose capacity is a second or a minute of refill. tollgate
/// gives those a time-to-live of 2 s instead and renews them itself every second, as the
/// same strategy (extended, never restarted), so Envoy never waits on its own next report.
#[tokio::test]
async fn assignments_a_small_capacity_cannot_pay_for_long_are_renewed_by_tollgate() {
    let (server, _scratch) = start();
    let clock = MonotonicClock::new();
    let mut envoy = Envoy::connect(&server).await;
    let start = clock.now();
    let minute = 60 * SECOND;
    let actions = envoy
        .report(
            "edge",
            vec![
                usage(&[("client", "c")], 1, 0, minute),
                usage(&[("account", "a")], 1, 0, minute),
            ],
        )
        .await;
    let mut admissions = Admissions::default();
    let answered: Vec<Assigned> = actions.into_iter().map(assigned).collect();
    // 10 and 10 a second: a full bucket of 3 and 2 s of its refill is all 10 can pay.
    // 100 a minute: a token a second, its whole refill, for 2 s.
    assert!(
        matches!(answered[..], [
            Assigned::Tokens { rate: 3, fill: f1, ttl: t1 },
            Assigned::Tokens { rate: 1, fill: f2, ttl: t2 },
        ] if f1 == SECOND && f2 == SECOND && t1 <= 2 * SECOND && t2 <= 2 * SECOND),
        "{answered:?}"
    );
    let mut answered = answered.into_iter();
    admissions.receive(0, clock.now(), answered.next().expect("client"));
    let prepaid = || metric(&server, "tollgate_rlqs_prepaid_tokens_total");
    assert_eq!(prepaid(), 9.0 + 3.0);
    for _ in 0..3 {
        // Renewals come in no particular order of buckets: the larger rate is the client's.
        let mut renewed = renewal(&mut envoy).await;
        renewed.sort_by_key(|action| match action {
            Assigned::Tokens { rate, .. } => std::cmp::Reverse(*rate),
            _ => std::cmp::Reverse(0),
        });
        assert!(
            matches!(renewed[..], [
                Assigned::Tokens { rate: 3, ttl: t1, .. },
                Assigned::Tokens { rate: 1, ttl: t2, .. },
            ] if t1 <= 2 * SECOND && t2 <= 2 * SECOND),
            "{renewed:?}"
        );
        let mut renewed = renewed.into_iter();
        admissions.receive(0, clock.now(), renewed.next().expect("client"));
    }
    let last = clock.now();
    // Renewals extend the bucket Envoy holds: no full bucket paid again, only refill.
    assert_eq!(
        metric(
            &server,
            r#"tollgate_decisions_total{limit="small",result="allowed",mode="enforce",api="rlqs"}"#
        ),
        4.0
    );
    assert_eq!(metric(&server, "tollgate_rlqs_renewed_total"), 6.0);
    admissions.close(0, last + Duration::from_secs(120));
    admissions.assert_within(10.0, 10.0, last.saturating_duration_since(start));
}

/// Renewing more often buys a small capacity a higher rate: a quarter-second renewal sends
/// time-to-lives of half a second, and a capacity of 10 then pays 6 a second.
#[tokio::test]
async fn shorter_renewals_let_a_small_capacity_pay_a_higher_rate() {
    let (server, _scratch) = start_with("rlqs-renew", &["--rlqs-renew-every", "250ms"]);
    let mut envoy = Envoy::connect(&server).await;
    let slow = || vec![usage(&[("client", "r")], 1, 0, 60 * SECOND)];
    match assigned(envoy.report("edge", slow()).await.remove(0)) {
        Assigned::Tokens { rate, ttl, .. } => {
            assert_eq!(rate, 6);
            assert!(ttl <= SECOND / 2, "{ttl:?}");
        }
        other => panic!("a token bucket, not {other:?}"),
    }
    let renewed = renewal(&mut envoy).await;
    assert!(
        matches!(renewed[..], [Assigned::Tokens { rate: 6, .. }]),
        "{renewed:?}"
    );
    // An Envoy reporting often on a limit that can pay its reporting interval's
    // time-to-live is not renewed: its own reports extend it.
    let mut fast = Envoy::connect(&server).await;
    let busy = || vec![usage(&[("tenant", "r")], 5, 0, SECOND / 10)];
    assert!(matches!(
        assigned(fast.report("edge", busy()).await.remove(0)),
        Assigned::Tokens { .. }
    ));
    let quiet = tokio::time::timeout(SECOND, fast.answers.message()).await;
    assert!(quiet.is_err(), "nothing sent unasked: {quiet:?}");
}

/// `DENY_ALL` is renewed too, with another try at an assignment each time: a bucket emptied
/// by other clients is assigned tokens again once it has refilled, even if its Envoy
/// reports only once a minute.
#[tokio::test]
async fn an_empty_bucket_is_assigned_again_once_refilled_without_a_report() {
    let (server, _scratch) = start();
    let spend = r#"{"domain":"edge","descriptors":[{"team":"e"}],"cost":10}"#;
    assert_eq!(post_json(server.http, "/v1/check", spend).status, 200);
    let mut envoy = Envoy::connect(&server).await;
    let slow = vec![usage(&[("team", "e")], 1, 0, 60 * SECOND)];
    let first = assigned(envoy.report("edge", slow).await.remove(0));
    assert!(
        matches!(first, Assigned::Deny(ttl) if ttl <= 2 * SECOND),
        "{first:?}"
    );
    // The team's bucket refills a token a second; a token a second for 2 s costs 3.
    let mut denied = 0;
    loop {
        match &renewal(&mut envoy).await[..] {
            [Assigned::Deny(_)] => denied += 1,
            [Assigned::Tokens { rate: 1, .. }] => break,
            other => panic!("{other:?}"),
        }
        assert!(denied < 10, "still denied after {denied} renewals");
    }
    assert!(denied >= 1, "denied until refilled");
}

/// Three Envoys reporting once a minute on one small limit: renewed, replaced and denied by
/// turns for 4 s, all they could admit together stays within the limit.
#[tokio::test]
async fn renewed_envoys_together_never_get_more_than_the_limit() {
    let (server, _scratch) = start();
    let (admissions, lasted) =
        slow_envoys(&[&server; 3], &[("client", "shared")], 4 * SECOND).await;
    admissions.assert_within(10.0, 10.0, lasted);
}

/// A capacity of 1 cannot pay for any assignment (a full bucket and the start of its refill
/// cost 2): the bucket is denied to every Envoy, and the server says why, once per stream.
#[tokio::test]
async fn a_capacity_too_small_for_any_assignment_is_denied_and_logged() {
    let scratch = Scratch::new("rlqs-single");
    let policy = scratch.write("policy.yaml", POLICY);
    // Renewals a minute apart: none comes during the test, so each warning is a report's.
    let args = ["--config", policy.to_str().expect("utf-8")];
    let (server, stderr) =
        Server::start_logging(&[&args[..], &["--rlqs-renew-every", "1m"]].concat(), "warn");
    // Two streams, of two reports and of one: said on the first report of each.
    for reports in [2, 1] {
        let mut envoy = Envoy::connect(&server).await;
        for _ in 0..reports {
            let actions = envoy
                .report("edge", vec![usage(&[("seat", "s")], 1, 0, SECOND)])
                .await;
            assert!(
                matches!(assigned(actions[0]), Assigned::Deny(_)),
                "{actions:?}"
            );
        }
    }
    assert_eq!(metric(&server, "tollgate_rlqs_prepaid_tokens_total"), 0.0);
    let logs = tokio::task::spawn_blocking(move || server.terminate_and_read(stderr))
        .await
        .expect("terminate");
    let said = logs.matches("cannot pay for any assignment").count();
    assert_eq!(said, 2, "{logs}");
}

/// A renewal asks for the demand the last report measured: a bucket that reports little
/// keeps its small rate between reports instead of growing to the whole refill, as only a
/// bucket's first report (sent with its first request) does.
#[tokio::test]
async fn a_renewal_keeps_the_rate_the_last_report_sized() {
    let (server, _scratch) = start();
    let mut envoy = Envoy::connect(&server).await;
    // Reported every minute: a capacity of 60 pays only tollgate's short time-to-live.
    let minute = Duration::from_secs(60);
    let report = |requests| vec![usage(&[("pool", "slow")], requests, 0, minute)];
    assert_eq!(token_rate(&mut envoy, report(1)).await, 20);
    // 120 requests a minute: 2 a second, a quarter more and one.
    assert_eq!(token_rate(&mut envoy, report(120)).await, 3);
    let renewed = renewal(&mut envoy).await;
    assert!(
        matches!(renewed[..], [Assigned::Tokens { rate: 3, .. }]),
        "{renewed:?}"
    );
}

/// A renewal interval outside 10 ms to a minute is refused at the start, in one line.
#[test]
fn renewal_intervals_out_of_bounds_are_refused() {
    assert_serve_flags_refused(&[
        ("--rlqs-renew-every", "1ms", "is shorter than 10ms"),
        ("--rlqs-renew-every", "2m", "is longer than 1m"),
        ("--rlqs-renew-every", "soon", "soon"),
    ]);
}

/// An assignment whose extension the bucket cannot pay just now (other clients spent it) is
/// kept as it is, paid for until it expires, and extended by a later renewal: not replaced by
/// whatever the bucket holds at that moment, which would be nothing.
#[tokio::test]
async fn an_assignment_the_bucket_cannot_extend_just_now_is_kept() {
    let (server, _scratch) = start();
    let mut envoy = Envoy::connect(&server).await;
    let busy = || vec![usage(&[("client", "k")], 10, 0, SECOND)];
    // All 10 and 10/s can pay for 2 s: 3 a second, a full bucket of 3 and 6 of refill.
    assert!(matches!(
        assigned(envoy.report("edge", busy()).await.remove(0)),
        Assigned::Tokens { rate: 3, .. }
    ));
    let kept = || metric(&server, r#"tollgate_rlqs_answers_total{action="kept"}"#);
    let spend = r#"{"domain":"edge","descriptors":[{"client":"k"}],"cost":1}"#;
    let clock = MonotonicClock::new();
    for _ in 0..5 {
        // Other clients spend what the bucket holds; extending the assignment right after
        // costs a token it does not have (unless one refilled meanwhile: then again).
        while post_json(server.http, "/v1/check", spend).status == 200 {}
        envoy.send(reports("edge", busy()));
        let until = clock.now() + SECOND / 2;
        while kept() < 1.0 && clock.now() < until {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if kept() >= 1.0 {
            break;
        }
        let extended = renewal(&mut envoy).await.remove(0);
        assert!(
            matches!(extended, Assigned::Tokens { rate: 3, .. }),
            "{extended:?}"
        );
    }
    assert_eq!(kept(), 1.0, "no answer for the bucket, the assignment kept");
    // The bucket refills 10 a second: a renewal extends the same strategy.
    let renewed = renewal(&mut envoy).await;
    assert!(
        matches!(renewed[..], [Assigned::Tokens { rate: 3, .. }]),
        "{renewed:?}"
    );
    assert_eq!(
        metric(&server, r#"tollgate_rlqs_answers_total{action="deny_all"}"#),
        0.0
    );
}

/// A bucket an Envoy stops reporting while its stream goes on (its requests moved to other
/// buckets) keeps its want in the fair share until `--rlqs-abandon-after`, then leaves it to
/// the other Envoys: a stream's state does not hold every bucket it ever had.
#[tokio::test]
async fn a_bucket_a_stream_stops_reporting_leaves_the_fair_share() {
    let (server, _scratch) = start_with("rlqs-silent", &["--rlqs-abandon-after", "1s"]);
    let (mut first, mut second) = (Envoy::connect(&server).await, Envoy::connect(&server).await);
    let busy = || vec![usage(&[("tenant", "s")], 400, 100, SECOND)];
    let elsewhere = || vec![usage(&[("tenant", "t")], 1, 0, SECOND)];
    assert_eq!(token_rate(&mut first, busy()).await, 10);
    assert_eq!(token_rate(&mut second, busy()).await, 5);
    let clock = MonotonicClock::new();
    let silent_since = clock.now();
    // Half a second on, the first reports only another bucket: its want on the shared one
    // still counts.
    tokio::time::sleep(SECOND / 2).await;
    first.report("edge", elsewhere()).await;
    assert_eq!(token_rate(&mut second, busy()).await, 5);
    // Past the bound it is forgotten at the first's next report.
    let past = silent_since + Duration::from_millis(1_100);
    tokio::time::sleep(past.saturating_duration_since(clock.now())).await;
    first.report("edge", elsewhere()).await;
    assert_eq!(token_rate(&mut second, busy()).await, 10);
}

/// A report without `time_elapsed` is taken to cover the time since the bucket's last one.
#[tokio::test]
async fn a_report_without_its_time_covers_the_time_since_the_last() {
    let (server, _scratch) = start();
    let mut envoy = Envoy::connect(&server).await;
    let untimed = |requests| BucketQuotaUsage {
        time_elapsed: None,
        ..usage(&[("tenant", "untimed")], requests, 0, SECOND)
    };
    assert_eq!(token_rate(&mut envoy, vec![untimed(1)]).await, 10);
    tokio::time::sleep(2 * SECOND).await;
    // 8 requests in a little over 2 s: 4 a second, a quarter more and one.
    assert_eq!(token_rate(&mut envoy, vec![untimed(8)]).await, 6);
}

/// A bucket's first assignment, cut short by a bucket that held little, grows at the
/// renewals before the next report: a first report says nothing of the demand, and a busy
/// bucket should not wait a reporting interval for its share.
#[tokio::test]
async fn renewals_after_a_first_report_grow_towards_the_full_share() {
    let (server, _scratch) = start();
    let spend = r#"{"domain":"edge","descriptors":[{"pool":"drained"}],"cost":45}"#;
    assert_eq!(post_json(server.http, "/v1/check", spend).status, 200);
    let mut envoy = Envoy::connect(&server).await;
    let minute = Duration::from_secs(60);
    let report = vec![usage(&[("pool", "drained")], 1, 0, minute)];
    let first = token_rate(&mut envoy, report).await;
    assert!(first < 20, "{first}: the bucket held about 15");
    let mut grown = first;
    for _ in 0..3 {
        if let [Assigned::Tokens { rate, .. }] = renewal(&mut envoy).await[..] {
            grown = rate;
        }
        if grown > first {
            break;
        }
    }
    assert!(grown > first, "still {grown} after three renewals");
}
