//! Arbitrary `ShouldRateLimit` calls against the RLS service, in this process: domains empty
//! or too long, descriptors too many or empty, entries with empty or oversized keys and
//! values, `hits_addend` of every size on the request and per descriptor, hits given back
//! (`is_negative_hits`), and limits sent with descriptors in every unit, known or not. Whatever arrives, the service answers: on the
//! memory store, which cannot fail, with a status per descriptor, an overall code that is
//! `OVER_LIMIT` exactly when one of them is, or `INVALID_ARGUMENT`, never another gRPC
//! status; and neither a refused nor an over-limit call charges anything. With hits given back
//! switched on (`--negative-hits give-back`), the same holds, a descriptor giving hits back is
//! `OK`, a call that takes nothing charges nothing, and no bucket ever holds more than full.
//!
//! The gRPC framing around the calls is `grpc_framing.rs`'s; this holds the service itself.

use std::sync::Arc;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::google::protobuf::UInt64Value;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use tollgate_policy::{EngineOptions, PolicyEngine, compile};
use tollgate_server::decider::Request;
use tollgate_server::http::NegativeHits;
use tollgate_server::rls::Rls;
use tollgate_server::{Backend, Decider};

/// Limits that refill a token a day, so that a charge shows as a lower `remaining`; some run
/// out during the run. Tenants take the limit a descriptor sends.
const POLICY: &str = r#"
version: arbitrary
limits:
  - name: per-user
    domain: api
    key: [user]
    capacity: 10000
    refill: 1/d
  - name: per-address
    domain: api
    key: [remote_address]
    capacity: 200
    refill: 1/d
  - name: per-tenant
    domain: api
    key: [tenant]
    capacity: 100
    refill: 1/d
    request_limit: apply
"#;

/// Values the calls draw from: the first three are read by the probes.
const VALUES: [&str; 5] = ["u1", "u2", "10.0.0.1", "", "ü"];

/// A service and the decider behind it, for the probes.
struct Service {
    rls: Rls,
    decider: Arc<Decider>,
}

impl Service {
    fn new(negative_hits: NegativeHits) -> Self {
        let policy = compile("arbitrary.yaml", POLICY).expect("the policy compiles");
        let engine = Arc::new(PolicyEngine::new(policy, EngineOptions::default()));
        let decider = Arc::new(Decider::new(engine, Backend::Memory));
        Self {
            rls: Rls::new(Arc::clone(&decider)).with_negative_hits(negative_hits),
            decider,
        }
    }

    /// The `remaining` of every bucket the calls can charge that the probes read: users' and
    /// addresses'.
    async fn balances(&self) -> Vec<u64> {
        let mut all = Vec::new();
        for value in &VALUES[..3] {
            for entry in ["user", "remote_address"] {
                let descriptors = [vec![(entry.to_owned(), (*value).to_owned())]];
                let request = Request {
                    domain: "api",
                    descriptors: &descriptors,
                    cost: 1.into(),
                    request_id: None,
                };
                let outcome = self
                    .decider
                    .explain(&request)
                    .await
                    .expect("a probe is decided");
                let decision = outcome.limits[0].decision.expect("a probe's decision");
                all.push(decision.remaining());
            }
        }
        all
    }
}

fn entry() -> impl Strategy<Value = Entry> {
    let key = prop_oneof![
        40 => prop::sample::select(vec!["user", "remote_address", "tenant", "path"])
            .prop_map(str::to_owned),
        1 => Just(String::new()),
        1 => Just("k".repeat(300)),
    ];
    let value = prop_oneof![
        40 => prop::sample::select(VALUES.to_vec()).prop_map(str::to_owned),
        1 => Just("v".repeat(5_000)),
        1 => "\\PC{0,8}",
    ];
    (key, value).prop_map(|(key, value)| Entry { key, value })
}

fn sent_limit() -> impl Strategy<Value = RateLimitOverride> {
    (
        prop_oneof![Just(0u32), 1u32..1_000, Just(u32::MAX)],
        -1i32..8,
    )
        .prop_map(|(requests_per_unit, unit)| RateLimitOverride {
            requests_per_unit,
            unit,
        })
}

fn descriptor() -> impl Strategy<Value = RateLimitDescriptor> {
    (
        prop_oneof![
            12 => prop::collection::vec(entry(), 1..3),
            1 => prop::collection::vec(entry(), 0..1),
        ],
        prop::option::weighted(0.1, sent_limit()),
        prop::option::weighted(0.2, prop_oneof![0u64..4, Just(10_000), Just(u64::MAX)]),
        prop::bool::weighted(0.05),
    )
        .prop_map(
            |(entries, limit, hits, is_negative_hits)| RateLimitDescriptor {
                entries,
                limit,
                hits_addend: hits.map(|value| UInt64Value { value }),
                is_negative_hits,
            },
        )
}

fn call() -> impl Strategy<Value = RateLimitRequest> {
    let domain = prop_oneof![
        12 => Just("api".to_owned()),
        1 => Just("other".to_owned()),
        1 => Just(String::new()),
        1 => Just("d".repeat(300)),
    ];
    let descriptors = prop_oneof![
        12 => prop::collection::vec(descriptor(), 1..4),
        1 => prop::collection::vec(descriptor(), 0..1),
        1 => prop::collection::vec(descriptor(), 33..34),
    ];
    let hits = prop_oneof![8 => 0u32..4, 1 => Just(u32::MAX)];
    (domain, descriptors, hits).prop_map(|(domain, descriptors, hits_addend)| RateLimitRequest {
        domain,
        descriptors,
        hits_addend,
    })
}

/// What the run saw, to show that it reached charges, rejections and refusals, and hits
/// given back that raised a balance.
#[derive(Debug, Default)]
struct Seen {
    charged: usize,
    over: usize,
    answered: usize,
    refused: usize,
    given_back: usize,
}

/// The most a probe can report: a full bucket's `remaining` after the probe's own 1, per probe
/// (users', then addresses', per value).
const FULL: [u64; 6] = [9_999, 199, 9_999, 199, 9_999, 199];

/// Whether a descriptor of `sent` gives hits back (`true`), takes them (`false`), or only
/// checks (`None`, its hits 0): its own `hits_addend`, else the request's (0 there meaning 1).
fn gives_back(sent: &RateLimitRequest, descriptor: &RateLimitDescriptor) -> Option<bool> {
    let hits = descriptor
        .hits_addend
        .as_ref()
        .map_or(u64::from(sent.hits_addend.max(1)), |hits| hits.value);
    (hits > 0).then_some(descriptor.is_negative_hits)
}

async fn one(
    service: &Service,
    seen: &mut Seen,
    sent: RateLimitRequest,
) -> Result<(), TestCaseError> {
    let before = service.balances().await;
    let descriptors = sent.descriptors.len();
    let answer = service
        .rls
        .should_rate_limit(tonic::Request::new(sent.clone()))
        .await;
    let after = service.balances().await;
    let charged: Vec<usize> = (0..before.len())
        .filter(|&i| after[i] < before[i])
        .collect();
    prop_assert!(
        after.iter().zip(FULL).all(|(&left, full)| left <= full),
        "past full: {after:?} after {sent:?}"
    );
    if (0..before.len()).any(|i| after[i] > before[i]) {
        seen.given_back += 1;
    }
    match answer {
        Err(status) => {
            prop_assert_eq!(
                status.code(),
                tonic::Code::InvalidArgument,
                "{:?} for {:?}",
                status,
                sent
            );
            prop_assert!(!status.message().is_empty());
            prop_assert!(
                charged.is_empty(),
                "refused, but charged {charged:?}: {sent:?}"
            );
            seen.refused += 1;
        }
        Ok(answer) => {
            let answer = answer.into_inner();
            prop_assert_eq!(answer.statuses.len(), descriptors, "{:?}", answer);
            for (status, descriptor) in answer.statuses.iter().zip(&sent.descriptors) {
                if gives_back(&sent, descriptor) == Some(true) {
                    prop_assert_eq!(status.code, Code::Ok as i32, "{:?} in {:?}", status, sent);
                }
            }
            if !sent
                .descriptors
                .iter()
                .any(|d| gives_back(&sent, d) == Some(false))
            {
                prop_assert!(
                    charged.is_empty(),
                    "nothing taken, but charged {charged:?}: {sent:?}"
                );
            }
            let over = answer
                .statuses
                .iter()
                .any(|s| s.code == Code::OverLimit as i32);
            let overall = if over { Code::OverLimit } else { Code::Ok };
            prop_assert_eq!(answer.overall_code, overall as i32, "{:?}", answer);
            if over {
                prop_assert!(
                    charged.is_empty(),
                    "over, but charged {charged:?}: {sent:?}"
                );
                seen.over += 1;
            } else if charged.is_empty() {
                seen.answered += 1;
            } else {
                seen.charged += 1;
            }
        }
    }
    Ok(())
}

/// Runs 3,000 arbitrary calls through a service treating hits given back as `negative_hits`
/// says.
fn run(negative_hits: NegativeHits) -> Seen {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let service = Service::new(negative_hits);
    let seen = std::cell::RefCell::new(Seen::default());
    let mut runner = TestRunner::new(Config {
        cases: 3_000,
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&call(), |sent| {
        runtime.block_on(one(&service, &mut seen.borrow_mut(), sent))
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
    seen.into_inner()
}

#[test]
fn any_call_is_answered_and_neither_a_refused_nor_an_over_limit_one_charges() {
    let seen = run(NegativeHits::Refuse);
    assert!(
        seen.charged >= 200 && seen.over >= 200 && seen.refused >= 500,
        "{seen:?}"
    );
}

#[test]
fn with_hits_given_back_any_call_is_answered_and_no_bucket_passes_full() {
    let seen = run(NegativeHits::GiveBack);
    assert!(
        seen.charged >= 200 && seen.over >= 200 && seen.refused >= 300 && seen.given_back >= 20,
        "{seen:?}"
    );
}
