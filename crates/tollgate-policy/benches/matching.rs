//! Matching against a policy of 1,000 limits: the per-request cost of the control plane.
//!
//! The policy mixes the shapes real policies have: per-route limits keyed by user (filed under
//! their `when` pair), per-tenant limits with no conditions (filed under their key entry), and a
//! few global limits, over several domains. A request matches a handful of them. A second
//! policy holds a thousand routes by path prefix.

use std::fmt::Write as _;
use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tollgate::ManualClock;
use tollgate_policy::{EngineOptions, ManualWallClock, Policy, PolicyEngine, UnixTime, compile};

fn policy_text(limits: usize) -> String {
    let mut text = String::from("version: bench\nlimits:\n");
    for i in 0..limits {
        let domain = format!("domain-{}", i % 4);
        let _ = match i % 10 {
            // The request below also meets one per-tenant limit and one global limit.
            0 if i == 500 => writeln!(
                text,
                "  - name: per-tenant\n    domain: domain-2\n    key: [tenant]\n    capacity: 1000\n    refill: 600/m"
            ),
            1 if i == 21 => writeln!(
                text,
                "  - name: global-api\n    domain: domain-2\n    capacity: 100000\n    refill: 100000/s\n    mode: shadow"
            ),
            // Per-tenant-entry limits, no conditions.
            0 => writeln!(
                text,
                "  - name: by-entry-{i}\n    domain: {domain}\n    key: [entry{i}]\n    capacity: 100\n    refill: 10/s"
            ),
            // A few global limits per domain.
            1 if i < 40 => writeln!(
                text,
                "  - name: global-{i}\n    domain: {domain}\n    capacity: 100000\n    refill: 100000/s\n    mode: shadow"
            ),
            // Per-route limits keyed by user, some with overrides.
            _ => writeln!(
                text,
                "  - name: route-{i}\n    domain: {domain}\n    when: {{route: /v1/r{i}, method: POST}}\n    key: [tenant, user]\n    capacity: 20\n    refill: 10/s\n    overrides:\n      - when: {{tier: premium}}\n        capacity: 200"
            ),
        };
    }
    text
}

fn bench(c: &mut Criterion) {
    let text = policy_text(1_000);
    let policy: Policy = match compile("bench.yaml", &text) {
        Ok(policy) => policy,
        Err(err) => panic!("{err}"),
    };
    assert_eq!(policy.limits().len(), 1_000);
    let now = UnixTime::from_secs(1_800_000_000);
    // route-502, per-tenant and global-api apply; the other 997 must cost nothing.
    let hit = [
        ("route", "/v1/r502"),
        ("method", "POST"),
        ("tenant", "acme"),
        ("user", "u-42"),
        ("tier", "premium"),
    ];
    let miss = [
        ("route", "/v1/nowhere"),
        ("method", "GET"),
        ("user", "u-42"),
    ];
    let mut out = Vec::with_capacity(16);
    policy.match_into("domain-2", &[hit], now, &mut out);
    let found = out.len();
    assert_eq!(found, 3);

    let mut group = c.benchmark_group("match_1000_limits");
    group.throughput(Throughput::Elements(1));
    group.bench_function(format!("hit_{found}_limits"), |b| {
        b.iter(|| {
            out.clear();
            policy.match_into(black_box("domain-2"), black_box(&[hit]), now, &mut out);
            black_box(out.len())
        })
    });
    group.bench_function("miss", |b| {
        b.iter(|| {
            out.clear();
            policy.match_into(black_box("domain-2"), black_box(&[miss]), now, &mut out);
            black_box(out.len())
        })
    });
    group.bench_function("unknown_domain", |b| {
        b.iter(|| {
            out.clear();
            policy.match_into(black_box("nope"), black_box(&[hit]), now, &mut out);
            black_box(out.len())
        })
    });
    group.finish();

    // The same request from a tenant on a block list: one deny limit more, and the other
    // buckets only read (nothing charged).
    let blocked_text = format!(
        "{text}  - name: blocked\n    domain: domain-2\n    when: {{tenant: evil}}\n    deny: true\n"
    );
    let blocked_policy = match compile("bench.yaml", &blocked_text) {
        Ok(policy) => policy,
        Err(err) => panic!("{err}"),
    };
    let denied = [hit[0], hit[1], ("tenant", "evil"), hit[3], hit[4]];

    let clock = ManualClock::new();
    let engine_of = |policy| {
        let options = EngineOptions::default()
            .clock(Arc::new(clock.clone()))
            .wall_clock(Arc::new(ManualWallClock::new(now)));
        PolicyEngine::new(policy, options)
    };
    let engine = engine_of(policy);
    let mut group = c.benchmark_group("decide_1000_limits");
    group.throughput(Throughput::Elements(1));
    group.bench_function(format!("memory_store_{found}_limits"), |b| {
        b.iter(|| {
            // Advance time so buckets refill and every decision does the full work.
            clock.advance(std::time::Duration::from_secs(1));
            black_box(
                engine
                    .decide(black_box("domain-2"), black_box(&[hit]), 1, None)
                    .map(|o| o.allowed),
            )
        })
    });
    let blocked = engine_of(blocked_policy);
    assert!(
        blocked
            .decide("domain-2", &[denied], 1, None)
            .is_ok_and(|o| !o.allowed && o.limits.len() == found + 1)
    );
    group.bench_function(format!("memory_store_denied_{}_limits", found + 1), |b| {
        b.iter(|| {
            clock.advance(std::time::Duration::from_secs(1));
            black_box(
                blocked
                    .decide(black_box("domain-2"), black_box(&[denied]), 1, None)
                    .map(|o| o.allowed),
            )
        })
    });
    group.finish();
}

/// A thousand routes by path prefix (as an import of Envoy wildcard values gives), each keyed
/// by user: a request under one route must not test the other 999 prefixes.
fn prefixes(c: &mut Criterion) {
    let mut text = String::from("version: bench\nlimits:\n");
    for i in 0..1_000 {
        let _ = writeln!(
            text,
            "  - name: route-{i}\n    domain: api\n    when: {{path: !prefix /v1/r{i}/}}\n    key: [user]\n    capacity: 100\n    refill: 10/s"
        );
    }
    let policy: Policy = match compile("bench.yaml", &text) {
        Ok(policy) => policy,
        Err(err) => panic!("{err}"),
    };
    let now = UnixTime::from_secs(1_800_000_000);
    let hit = [("path", "/v1/r502/items/7"), ("user", "u-42")];
    let miss = [("path", "/v2/elsewhere"), ("user", "u-42")];
    let mut out = Vec::with_capacity(16);
    policy.match_into("api", &[hit], now, &mut out);
    assert_eq!(out.len(), 1);
    let mut group = c.benchmark_group("match_1000_prefixes");
    group.throughput(Throughput::Elements(1));
    for (name, descriptor) in [("hit_1_limit", hit), ("miss", miss)] {
        group.bench_function(name, |b| {
            b.iter(|| {
                out.clear();
                policy.match_into(black_box("api"), black_box(&[descriptor]), now, &mut out);
                black_box(out.len())
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench, prefixes);
criterion_main!(benches);
