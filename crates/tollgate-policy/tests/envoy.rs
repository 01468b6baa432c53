//! Import of envoyproxy/ratelimit configurations: the output compiles, matches what Envoy would
//! match, and the notes list what cannot be expressed.

use tollgate_policy::envoy::EnvoyImport;
use tollgate_policy::{Policy, UnixTime, compile, import_envoy};

fn import(text: &str) -> (EnvoyImport, Policy) {
    let imported = import_envoy("ratelimit.yaml", text).unwrap_or_else(|e| panic!("{e}"));
    let policy = compile("out.yaml", &imported.policy)
        .unwrap_or_else(|e| panic!("{e}\n{}", imported.policy));
    (imported, policy)
}

fn matched(policy: &Policy, domain: &str, d: &[(&str, &str)]) -> Vec<String> {
    policy
        .matches(domain, &[d], UnixTime::from_secs(0))
        .iter()
        .map(|m| format!("{} {}", m.bucket_key, m.params()))
        .collect()
}

/// A gateway: per-client limits, a per-route limit nested under a header match, and a
/// per-address limit with a stricter value for one known address.
const GATEWAY: &str = r#"
domain: edge_proxy
descriptors:
  - key: client_id
    value: mobile-app
    rate_limit:
      unit: minute
      requests_per_unit: 600
  - key: client_id
    rate_limit:
      unit: second
      requests_per_unit: 20
  - key: header_match
    value: api-v2
    descriptors:
      - key: path
        value: /v2/search
        rate_limit:
          unit: second
          requests_per_unit: 5
      - key: remote_address
        rate_limit:
          unit: hour
          requests_per_unit: 3600
  - key: remote_address
    rate_limit:
      unit: second
      requests_per_unit: 50
  - key: remote_address
    value: 10.0.0.1
    rate_limit:
      unit: second
      requests_per_unit: 1
"#;

#[test]
fn gateway_config_matches_like_envoy() {
    let (imported, p) = import(GATEWAY);
    assert_eq!(imported.limits, 4, "{}", imported.policy);
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str]);
    let cases: &[Case<'_>] = &[
        // The specific value wins over the wildcard: an override of the wildcard's limit.
        (
            &[("client_id", "mobile-app")],
            &["edge_proxy.client_id|mobile-app#mobile-app capacity 600 refill 600/m"],
        ),
        (
            &[("client_id", "web")],
            &["edge_proxy.client_id|web capacity 20 refill 20/s"],
        ),
        (
            &[("header_match", "api-v2"), ("path", "/v2/search")],
            &["edge_proxy.header_match_api-v2.path__v2_search capacity 5 refill 5/s"],
        ),
        // Nested under header_match: only the nested limit applies, not the top-level one.
        (
            &[("header_match", "api-v2"), ("remote_address", "1.2.3.4")],
            &["edge_proxy.header_match_api-v2.remote_address|1.2.3.4 capacity 3600 refill 3600/h"],
        ),
        (
            &[("remote_address", "1.2.3.4")],
            &["edge_proxy.remote_address|1.2.3.4 capacity 50 refill 50/s"],
        ),
        (
            &[("remote_address", "10.0.0.1")],
            &["edge_proxy.remote_address|10.0.0.1#10.0.0.1 capacity 1 refill 1/s"],
        ),
        // A descriptor that goes deeper than the tree matches nothing, as in Envoy.
        (&[("client_id", "web"), ("path", "/")], &[]),
        (&[("header_match", "api-v2")], &[]),
    ];
    for (descriptor, expected) in cases {
        assert_eq!(
            matched(&p, "edge_proxy", descriptor),
            *expected,
            "{descriptor:?}\n{}",
            imported.policy
        );
    }
    assert!(
        imported.notes[0].contains("fixed windows"),
        "{:?}",
        imported.notes
    );
}

/// A multi-tenant API: shadow limits being tried, metrics detail, replaces, unlimited tenants,
/// prefix wildcards and long units.
const TENANTS: &str = r#"
domain: tenants
descriptors:
  - key: tenant
    rate_limit:
      unit: second
      requests_per_unit: 100
    descriptors:
      - key: user
        detailed_metric: true
        rate_limit:
          unit: minute
          requests_per_unit: 60
  - key: tenant
    value: internal
    rate_limit:
      unlimited: true
  - key: plan
    value: free
    shadow_mode: true
    rate_limit:
      name: free-plan
      unit: day
      requests_per_unit: 1000
      replaces:
        - name: tenant-default
  - key: bucket
    value: "uploads-*"
    rate_limit:
      unit: second
      requests_per_unit: 3
  - key: billing
    rate_limit:
      unit: month
      requests_per_unit: 100000
  - key: export
    rate_limit:
      unit: week
      requests_per_unit: 7
    quota_mode: true
"#;

#[test]
fn tenant_config_with_everything_envoy_has() {
    let (imported, p) = import(TENANTS);
    let notes = imported.notes.join("\n");
    for fragment in [
        "tenant > user: detailed_metric ignored",
        "tenant=internal: has no limit of its own but a wildcard sibling `tenant` does",
        "plan=free: replaces cannot be expressed",
        "bucket=uploads-*: wildcard values (prefix*) cannot be expressed",
        "billing: unit month approximated as 30 days",
        "export: unknown field `quota_mode` ignored",
    ] {
        assert!(notes.contains(fragment), "missing {fragment:?} in\n{notes}");
    }
    assert_eq!(
        matched(&p, "tenants", &[("tenant", "acme"), ("user", "u1")]),
        ["tenants.tenant.user|acme|u1 capacity 60 refill 60/m"]
    );
    assert_eq!(
        matched(&p, "tenants", &[("tenant", "acme")]),
        ["tenants.tenant|acme capacity 100 refill 100/s"]
    );
    let free = p.matches("tenants", &[[("plan", "free")]], UnixTime::from_secs(0));
    assert_eq!(free.len(), 1);
    assert_eq!(
        (free[0].bucket_key.as_str(), free[0].effect.as_str()),
        ("free-plan", "shadow")
    );
    assert_eq!(
        matched(&p, "tenants", &[("export", "x")]),
        ["tenants.export|x capacity 7 refill 7/7d"]
    );
    assert_eq!(
        matched(&p, "tenants", &[("bucket", "uploads-1")]),
        Vec::<String>::new()
    );
}

#[test]
fn values_with_yaml_specials_survive_the_round_trip() {
    let text = "domain: \"odd: domain\"\ndescriptors:\n  - key: \"k: #1\"\n    value: \"v|\\\"quoted\\\"\"\n    rate_limit: {unit: second, requests_per_unit: 2}\n";
    let (imported, p) = import(text);
    assert_eq!(imported.limits, 1);
    let m = p.matches(
        "odd: domain",
        &[[("k: #1", "v|\"quoted\"")]],
        UnixTime::from_secs(0),
    );
    assert_eq!(m.len(), 1, "{}", imported.policy);
    assert_eq!(m[0].params().capacity(), 2);
}

#[test]
fn not_an_envoy_config_is_an_error_with_a_position() {
    let err = import_envoy("r.yaml", "descriptors:\n  - value: x\n").map(|_| ());
    let text = err.map_err(|e| e.to_string()).unwrap_err();
    assert!(text.starts_with("r.yaml:"), "{text}");
    let err = import_envoy("r.yaml", "domain: d\ndescriptors:\n  - value: x\n").map(|_| ());
    let text = err.map_err(|e| e.to_string()).unwrap_err();
    assert!(
        text.contains("descriptors[0]") && text.contains("key"),
        "{text}"
    );
}

#[test]
fn an_empty_config_imports_to_an_empty_policy() {
    let (imported, p) = import("domain: quiet\n");
    assert_eq!((imported.limits, p.limits().len()), (0, 0));
    assert!(imported.notes.is_empty());
}
