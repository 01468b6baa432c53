//! Import of envoyproxy/ratelimit configurations: the output compiles, matches what Envoy would
//! match, and the notes list what cannot be expressed.

use tollgate_policy::envoy::EnvoyImport;
use tollgate_policy::{
    ImportOptions, Policy, UnixTime, ValueMatch, compile, compile_directory, import_envoy,
    import_envoy_files,
};

fn import(text: &str) -> (EnvoyImport, Policy) {
    let imported = import_envoy("ratelimit.yaml", text).unwrap_or_else(|e| panic!("{e}"));
    let policy = compile("out.yaml", &imported.policy)
        .unwrap_or_else(|e| panic!("{e}\n{}", imported.policy));
    (imported, policy)
}

/// Each limit that applies to descriptor `d`: its bucket key and parameters, or `deny` for a
/// deny, whose parameters decide nothing.
fn matched(policy: &Policy, domain: &str, d: &[(&str, &str)]) -> Vec<String> {
    policy
        .matches(domain, &[d], UnixTime::from_secs(0))
        .iter()
        .map(|m| {
            if m.denied {
                format!("{} deny", m.bucket_key)
            } else {
                format!("{} {}", m.bucket_key, m.params())
            }
        })
        .collect()
}

/// The notes beyond the two general ones (counting and entry order).
fn particular(imported: &EnvoyImport) -> Vec<&String> {
    imported
        .notes
        .iter()
        .filter(|n| !n.starts_with("envoy "))
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
        "plan=free: replaces \"tenant-default\", which is not a limit of its own here",
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
    // An unlimited tenant is limited neither by the tenants' limit nor by the per-user limit
    // of the wildcard's subtree, which Envoy never walks for it.
    for descriptor in [
        &[("tenant", "internal")][..],
        &[("tenant", "internal"), ("user", "u1")],
    ] {
        assert_eq!(
            matched(&p, "tenants", descriptor),
            Vec::<String>::new(),
            "{descriptor:?}\n{}",
            imported.policy
        );
    }
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
    // A wildcard value: a prefix condition, one bucket per full value as in Envoy.
    assert_eq!(
        matched(&p, "tenants", &[("bucket", "uploads-1")]),
        ["tenants.bucket_uploads-_|uploads-1 capacity 3 refill 3/s"]
    );
    assert_eq!(
        matched(&p, "tenants", &[("bucket", "downloads-1")]),
        Vec::<String>::new()
    );
}

/// Wildcard values (`foo*`) beside exact values, a key-only node and each other.
const WILDCARDS: &str = r#"
domain: paths
descriptors:
  - key: path
    value: "/api/*"
    rate_limit: {unit: second, requests_per_unit: 20}
    descriptors:
      - key: user
        rate_limit: {unit: second, requests_per_unit: 2}
  - key: path
    value: /api/health
    rate_limit: {unit: second, requests_per_unit: 1000}
  - key: path
    value: /api/quiet
  - key: tier
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: tier
    value: "gold*"
    rate_limit: {unit: second, requests_per_unit: 30}
  - key: tier
    value: gold-plus
    rate_limit: {unit: second, requests_per_unit: 300}
  - key: tier
    value: "*"
    rate_limit: {unit: second, requests_per_unit: 9}
"#;

#[test]
fn wildcard_values_become_prefix_conditions_with_envoys_precedence() {
    let (imported, p) = import(WILDCARDS);
    assert!(
        imported.policy.contains("\"path\": !prefix \"/api/\""),
        "{}",
        imported.policy
    );
    let m = |d: &[(&str, &str)]| matched(&p, "paths", d);
    // Each full value its own bucket, as Envoy's cache keys hold the request's values.
    assert_eq!(
        m(&[("path", "/api/users")]),
        ["paths.path__api__|/api/users capacity 20 refill 20/s"]
    );
    assert_eq!(m(&[("path", "/web/users")]), Vec::<String>::new());
    // An exact value under a wildcard value is its override: Envoy tries exact values first.
    assert_eq!(
        m(&[("path", "/api/health")]),
        ["paths.path__api__|/api/health#_api_health capacity 1000 refill 1000/s"]
    );
    // A value with no limit of its own under a wildcard value: no limit, as in Envoy (an
    // unlimited override of the wildcard value's limit).
    assert_eq!(m(&[("path", "/api/quiet")]), Vec::<String>::new());
    // The wildcard value's subtree, keyed by both entries.
    assert_eq!(
        m(&[("path", "/api/x"), ("user", "u1")]),
        ["paths.path__api__.user|/api/x|u1 capacity 2 refill 2/s"]
    );
    // Beside a key-only node: exact value, then wildcard values in file order, then the
    // key-only node's own limit, as overrides of one limit.
    assert_eq!(
        m(&[("tier", "gold-plus")]),
        ["paths.tier|gold-plus#gold-plus capacity 300 refill 300/s"]
    );
    assert_eq!(
        m(&[("tier", "gold-1")]),
        ["paths.tier|gold-1#gold_ capacity 30 refill 30/s"]
    );
    // `*` is a wildcard value with an empty prefix: every value, ahead of the key-only node.
    assert_eq!(
        m(&[("tier", "silver")]),
        ["paths.tier|silver#_ capacity 9 refill 9/s"]
    );
    // Exact values the wildcard value covers: Envoy walks their own (empty) subtrees, never
    // the wildcard value's, so its per-user limit does not apply to them.
    for path in ["/api/health", "/api/quiet"] {
        assert_eq!(
            m(&[("path", path), ("user", "u1")]),
            Vec::<String>::new(),
            "{path}\n{}",
            imported.policy
        );
    }
    let notes = imported.notes.join("\n");
    assert!(!notes.contains("hides the subtree"), "{notes}");
    assert!(!notes.contains("cannot be expressed: this node"), "{notes}");
}

/// A common shape: every tenant's users limited, one tenant's users limited otherwise, and one
/// user of every tenant limited otherwise again. Envoy walks `tenant=acme` first and never
/// reaches `tenant`'s subtree for acme: acme's users get acme's limit alone.
const TENANT_USERS: &str = r#"
domain: api
descriptors:
  - key: tenant
    value: acme
    descriptors:
      - key: user
        rate_limit: {unit: second, requests_per_unit: 100}
      - key: route
        rate_limit: {unit: second, requests_per_unit: 7}
  - key: tenant
    value: "eu-*"
    descriptors:
      - key: user
        rate_limit: {unit: second, requests_per_unit: 50}
  - key: tenant
    descriptors:
      - key: user
        rate_limit: {unit: second, requests_per_unit: 10}
      - key: user
        value: bot
        rate_limit: {unit: second, requests_per_unit: 1}
      - key: ip
        rate_limit: {unit: second, requests_per_unit: 5}
"#;

#[test]
fn a_valued_nodes_subtree_overrides_the_same_limits_of_its_wildcard_sibling() {
    let (imported, p) = import(TENANT_USERS);
    let m = |d: &[(&str, &str)]| matched(&p, "api", d);
    // acme's users: acme's limit alone, as an override of the per-user limit.
    assert_eq!(
        m(&[("tenant", "acme"), ("user", "u1")]),
        ["api.tenant.user|acme|u1#acme capacity 100 refill 100/s"]
    );
    // The tenant chosen first wins over the user below it, as in Envoy: acme's bot is acme's.
    assert_eq!(
        m(&[("tenant", "acme"), ("user", "bot")]),
        ["api.tenant.user|acme|bot#acme capacity 100 refill 100/s"]
    );
    // A wildcard value's subtree too, after the exact values.
    assert_eq!(
        m(&[("tenant", "eu-1"), ("user", "u1")]),
        ["api.tenant.user|eu-1|u1#eu-_ capacity 50 refill 50/s"]
    );
    // Everyone else: the sibling's limits, and its own override below.
    assert_eq!(
        m(&[("tenant", "other"), ("user", "u1")]),
        ["api.tenant.user|other|u1 capacity 10 refill 10/s"]
    );
    assert_eq!(
        m(&[("tenant", "other"), ("user", "bot")]),
        ["api.tenant.user|other|bot#bot capacity 1 refill 1/s"]
    );
    // A limit under a value with no counterpart stays a limit of its own.
    assert_eq!(
        m(&[("tenant", "acme"), ("route", "/x")]),
        ["api.tenant_acme.route|/x capacity 7 refill 7/s"]
    );
    // What nothing under a value replaces does not apply to it, as in Envoy (which never
    // reaches the sibling's subtree for acme): an unlimited override of it for acme.
    assert_eq!(
        m(&[("tenant", "acme"), ("ip", "10.0.0.1")]),
        Vec::<String>::new()
    );
    assert_eq!(
        m(&[("tenant", "eu-1"), ("ip", "10.0.0.1")]),
        Vec::<String>::new()
    );
    assert_eq!(
        m(&[("tenant", "other"), ("ip", "10.0.0.1")]),
        ["api.tenant.ip|other|10.0.0.1 capacity 5 refill 5/s"]
    );
    assert!(
        imported.policy.contains("unlimited: true"),
        "{}",
        imported.policy
    );
    let notes = imported.notes.join("\n");
    assert!(!notes.contains("hides the subtree"), "{notes}");
}

#[test]
fn replaces_become_replaces_by_the_imported_names() {
    let text = r#"
domain: d
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 10, name: per user}
  - key: ip
    rate_limit: {unit: second, requests_per_unit: 5, name: per-ip}
  - key: plan
    value: partner
    rate_limit:
      unit: second
      requests_per_unit: 1000
      name: partners
      replaces: [{name: per user}, {name: per-ip}, {name: per user}]
"#;
    let (imported, p) = import(text);
    assert!(
        imported
            .policy
            .contains("replaces: [\"per_user\", \"per-ip\"]"),
        "{}",
        imported.policy
    );
    // Envoy sends one descriptor per action; the replacing limit applies through another.
    let found = p.matches(
        "d",
        &[
            &[("user", "u1")][..],
            &[("ip", "10.0.0.1")][..],
            &[("plan", "partner")][..],
        ],
        UnixTime::from_secs(0),
    );
    let keys: Vec<&str> = found.iter().map(|m| m.bucket_key.as_str()).collect();
    assert_eq!(keys, ["partners"]);
    assert!(
        imported.notes.iter().all(|n| !n.contains("replaces")),
        "{:?}",
        imported.notes
    );
}

/// An override has its limit's mode, and replaces (and is replaced) with its limit: a node in
/// another mode than its wildcard sibling, or one that replaces others, stays a limit of its
/// own, the sibling's leaving its value out.
#[test]
fn a_value_in_another_mode_or_with_replaces_stays_a_limit_of_its_own() {
    let text = r#"
domain: d
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 10}
    descriptors:
      - key: user
        rate_limit: {unit: second, requests_per_unit: 5}
  - key: tenant
    value: acme
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 100}
    descriptors:
      - key: user
        shadow_mode: true
        rate_limit: {unit: second, requests_per_unit: 50}
  - key: tenant
    value: globex
    rate_limit: {unit: second, requests_per_unit: 30, replaces: [{name: other}]}
    descriptors:
      - key: user
        rate_limit: {unit: second, requests_per_unit: 3, replaces: [{name: other}]}
  - key: tenant
    value: initech
    rate_limit: {unit: second, requests_per_unit: 20}
  - key: other
    rate_limit: {unit: second, requests_per_unit: 1, name: other}
"#;
    let (imported, p) = import(text);
    let notes: Vec<&String> = imported
        .notes
        .iter()
        .filter(|n| !n.starts_with("envoy "))
        .collect();
    assert!(notes.is_empty(), "{notes:?}");
    let found = |d: &[&[(&str, &str)]]| -> Vec<(String, &str)> {
        p.matches("d", d, UnixTime::from_secs(0))
            .iter()
            .map(|m| (m.bucket_key.clone(), m.effect.as_str()))
            .collect()
    };
    // acme's limits keep their shadow mode, as in Envoy, and the wildcard's leave acme out.
    assert_eq!(
        found(&[&[("tenant", "acme")]]),
        [("d.tenant_acme".to_owned(), "shadow")]
    );
    assert_eq!(
        found(&[&[("tenant", "acme"), ("user", "u1")]]),
        [("d.tenant_acme.user|u1".to_owned(), "shadow")]
    );
    // globex's replace `other` wherever they apply, and only they: initech, an override of the
    // wildcard's limit, replaces nothing.
    assert_eq!(
        found(&[&[("tenant", "globex")], &[("other", "x")]]),
        [("d.tenant_globex".to_owned(), "enforce")]
    );
    assert_eq!(
        found(&[&[("tenant", "globex"), ("user", "u1")], &[("other", "x")]]),
        [("d.tenant_globex.user|u1".to_owned(), "enforce")]
    );
    assert_eq!(
        found(&[&[("tenant", "initech")], &[("other", "x")]]),
        [
            ("d.tenant|initech#initech".to_owned(), "enforce"),
            ("other|x".to_owned(), "enforce")
        ]
    );
}

/// A block list: every address limited, a few denied outright (`requests_per_unit: 0`, Envoy's
/// "deny all", whatever the unit). The denied values become `deny: true` overrides of the
/// address limit, where Envoy's precedence puts them; one in another mode stays a deny limit
/// of its own, which the address limit leaves out.
#[test]
fn a_block_list_becomes_deny_overrides() {
    let text = r#"
domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: remote_address
    value: 203.0.113.7
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: remote_address
    value: "198.51.100.*"
    rate_limit: {unit: month, requests_per_unit: 0}
  - key: remote_address
    value: 198.51.100.1
    rate_limit: {unit: second, requests_per_unit: 50}
  - key: remote_address
    value: 192.0.2.9
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 0}
  - key: remote_address
    value: 192.0.2.10
    rate_limit: {unlimited: true, requests_per_unit: 0}
"#;
    let (imported, p) = import(text);
    // Nothing left out, and a deny's unit (month here) is not approximated: it counts nothing.
    assert!(particular(&imported).is_empty(), "{:?}", imported.notes);
    assert_eq!(imported.limits, 2, "{}", imported.policy);
    let wide = p
        .limits()
        .iter()
        .find(|l| l.name() == "edge.remote_address")
        .unwrap_or_else(|| panic!("{}", imported.policy));
    assert!(!wide.deny());
    let denies: Vec<&str> = wide
        .overrides()
        .iter()
        .filter(|o| o.deny())
        .map(|o| o.name())
        .collect();
    assert_eq!(denies, ["203.0.113.7", "198.51.100._"]);
    let m = |address: &str| matched(&p, "edge", &[("remote_address", address)]);
    assert_eq!(
        m("1.2.3.4"),
        ["edge.remote_address|1.2.3.4 capacity 10 refill 10/s"]
    );
    assert_eq!(
        m("203.0.113.7"),
        ["edge.remote_address|203.0.113.7#203.0.113.7 deny"]
    );
    assert_eq!(
        m("198.51.100.77"),
        ["edge.remote_address|198.51.100.77#198.51.100._ deny"]
    );
    // Envoy takes the exact value before the wildcard value that covers it.
    assert_eq!(
        m("198.51.100.1"),
        ["edge.remote_address|198.51.100.1#198.51.100.1 capacity 50 refill 50/s"]
    );
    // Unlimited wins over 0, as Envoy checks it before counting.
    assert_eq!(m("192.0.2.10"), Vec::<String>::new());
    // The shadow deny: a limit of its own, in its mode; the enforced address limit leaves it out.
    let found = p.matches(
        "edge",
        &[&[("remote_address", "192.0.2.9")]],
        UnixTime::from_secs(0),
    );
    let found: Vec<(&str, bool, &str)> = found
        .iter()
        .map(|m| (m.limit.name(), m.denied, m.effect.as_str()))
        .collect();
    assert_eq!(found, [("edge.remote_address_192.0.2.9", true, "shadow")]);
}

/// Values that apply the same thing, next to one another in the file, are one override
/// listing them (a list matches any of its values): a block list of many addresses is one
/// `deny: true` override, tenants at one rate one override with that rate. A value that
/// applies something else splits the run, so each value is still decided by what Envoy gives
/// it, and each keeps a bucket of its own, as Envoy counts each apart.
#[test]
fn runs_of_values_that_apply_the_same_thing_become_one_override_with_a_list() {
    let mut text = String::from(
        "domain: edge\ndescriptors:\n  - key: remote_address\n    rate_limit: {unit: second, requests_per_unit: 10}\n",
    );
    let blocked: Vec<String> = (1..=200).map(|i| format!("203.0.113.{i}")).collect();
    for address in &blocked {
        text.push_str(&format!(
            "  - key: remote_address\n    value: {address}\n    rate_limit: {{unit: hour, requests_per_unit: 0}}\n"
        ));
    }
    text.push_str(
        r#"
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: tenant
    value: acme
    rate_limit: {unit: minute, requests_per_unit: 100}
  - key: tenant
    value: globex
    rate_limit: {unit: minute, requests_per_unit: 100}
  - key: tenant
    value: initech
    rate_limit: {unit: minute, requests_per_unit: 100}
  - key: tenant
    value: hooli
    rate_limit: {unit: second, requests_per_unit: 5}
  - key: tenant
    value: umbrella
    rate_limit: {unit: minute, requests_per_unit: 100}
  - key: tenant
    value: wayne
    rate_limit: {unit: minute, requests_per_unit: 100}
  - key: tenant
    value: internal
  - key: tenant
    value: staff
    rate_limit: {unlimited: true}
"#,
    );
    let (imported, p) = import(&text);
    assert!(particular(&imported).is_empty(), "{:?}", imported.notes);
    assert_eq!(imported.limits, 2, "{}", imported.policy);
    // Each override: its name and the values its one condition lists.
    let overrides = |limit: &str| -> Vec<(String, Vec<String>)> {
        let limit = p
            .limit(limit)
            .unwrap_or_else(|| panic!("no {limit} in\n{}", imported.policy));
        limit
            .overrides()
            .iter()
            .map(|o| {
                let values = o
                    .when()
                    .flat_map(|(_, test)| match test {
                        ValueMatch::AnyOf(list) => {
                            list.values().iter().map(|v| v.to_string()).collect()
                        }
                        other => vec![other.text().to_owned()],
                    })
                    .collect();
                (o.name().to_owned(), values)
            })
            .collect()
    };
    // 200 addresses, one override, named after the first; written in the file's order.
    let mut sorted = blocked.clone();
    sorted.sort();
    assert_eq!(
        overrides("edge.remote_address"),
        [(blocked[0].clone(), sorted)]
    );
    let written = format!(
        "when: {{\"remote_address\": [\"{}\", \"{}\", ",
        blocked[0], blocked[1]
    );
    assert!(imported.policy.contains(&written), "{}", imported.policy);
    let m = |d: &[(&str, &str)]| matched(&p, "edge", d);
    assert_eq!(
        m(&[("remote_address", "203.0.113.17")]),
        ["edge.remote_address|203.0.113.17#203.0.113.1 deny"]
    );
    assert_eq!(
        m(&[("remote_address", "203.0.113.201")]),
        ["edge.remote_address|203.0.113.201 capacity 10 refill 10/s"]
    );
    // The tenants: hooli's rate splits the run in two, in Envoy's order; the unlimited ones
    // are a run of their own.
    let list = |values: &[&str]| values.iter().map(|v| (*v).to_owned()).collect::<Vec<_>>();
    assert_eq!(
        overrides("edge.tenant"),
        [
            ("acme".to_owned(), list(&["acme", "globex", "initech"])),
            ("hooli".to_owned(), list(&["hooli"])),
            ("umbrella".to_owned(), list(&["umbrella", "wayne"])),
            ("internal".to_owned(), list(&["internal", "staff"])),
        ]
    );
    // One override, and still a bucket per tenant.
    assert_eq!(
        m(&[("tenant", "acme")]),
        ["edge.tenant|acme#acme capacity 100 refill 100/m"]
    );
    assert_eq!(
        m(&[("tenant", "globex")]),
        ["edge.tenant|globex#acme capacity 100 refill 100/m"]
    );
    assert_eq!(
        m(&[("tenant", "hooli")]),
        ["edge.tenant|hooli#hooli capacity 5 refill 5/s"]
    );
    assert_eq!(
        m(&[("tenant", "wayne")]),
        ["edge.tenant|wayne#umbrella capacity 100 refill 100/m"]
    );
    assert_eq!(m(&[("tenant", "staff")]), Vec::<String>::new());
    assert_eq!(
        m(&[("tenant", "other")]),
        ["edge.tenant|other capacity 10 refill 10/s"]
    );
}

/// A value denied with no wider node beside it is a deny limit: no parameters, no algorithm
/// (with `--fixed-windows` neither), and it replaces and is replaced like any limit.
#[test]
fn a_denied_value_of_its_own_becomes_a_deny_limit() {
    let text = r#"
domain: api
descriptors:
  - key: user_agent
    value: badbot
    rate_limit: {unit: minute, requests_per_unit: 0, name: bots, replaces: [{name: per-user}]}
  - key: user
    rate_limit: {unit: second, requests_per_unit: 5, name: per-user}
  - key: scanner
    value: yes
    rate_limit: {unit: second, requests_per_unit: 1, replaces: [{name: bots}]}
"#;
    for windows in [false, true] {
        let options = ImportOptions::default().fixed_windows(windows);
        let imported = tollgate_policy::import_envoy_with("ratelimit.yaml", text, options)
            .unwrap_or_else(|e| panic!("{e}"));
        let p = compile("out.yaml", &imported.policy)
            .unwrap_or_else(|e| panic!("{e}\n{}", imported.policy));
        assert!(particular(&imported).is_empty(), "{:?}", imported.notes);
        let bots = p
            .limits()
            .iter()
            .find(|l| l.name() == "bots")
            .unwrap_or_else(|| panic!("{}", imported.policy));
        assert!(bots.deny() && bots.rate().is_none() && bots.overrides().is_empty());
        let entry = imported
            .policy
            .split("  - name: ")
            .find(|l| l.starts_with("\"bots\""))
            .unwrap_or_default();
        assert!(entry.contains("deny: true"), "{entry}");
        for absent in ["capacity", "refill", "algorithm", "limit:", "window"] {
            assert!(!entry.contains(absent), "{absent} in {entry}");
        }
        assert_eq!(
            matched(&p, "api", &[("user_agent", "badbot")]),
            ["bots deny"]
        );
        assert_eq!(
            matched(&p, "api", &[("user_agent", "curl")]),
            Vec::<String>::new()
        );
        let names = |d: &[&[(&str, &str)]]| -> Vec<String> {
            p.matches("api", d, UnixTime::from_secs(0))
                .iter()
                .map(|m| m.limit.name().to_owned())
                .collect()
        };
        // The deny replaces the per-user limit, and a scanner's limit replaces the deny.
        assert_eq!(
            names(&[&[("user_agent", "badbot")], &[("user", "u1")]]),
            ["bots"]
        );
        assert_eq!(
            names(&[&[("user_agent", "badbot")], &[("scanner", "yes")]]),
            ["api.scanner_yes"]
        );
        // The notes on counting and order stay: the other limits count.
        assert!(
            imported.notes[0].starts_with("envoy counts"),
            "{:?}",
            imported.notes
        );
    }
    // Only denies: nothing counts, so no note on counting.
    let only = "domain: api\ndescriptors:\n  - key: user_agent\n    value: badbot\n    rate_limit: {unit: second, requests_per_unit: 0}\n";
    let (imported, _) = import(only);
    assert!(
        !imported.notes.iter().any(|n| n.starts_with("envoy counts")),
        "{:?}",
        imported.notes
    );
}

/// A deny limit's overrides only take requests out, so what would be an override with
/// parameters of one stays a limit of its own, and the deny leaves its values out: a value
/// beside a denied key-only node, and a limit under a value shaped as one under it.
#[test]
fn what_a_deny_cannot_take_as_an_override_stays_a_limit_of_its_own() {
    let text = r#"
domain: d
descriptors:
  - key: country
    rate_limit: {unit: second, requests_per_unit: 0}
    descriptors:
      - key: user
        rate_limit: {unit: second, requests_per_unit: 0}
  - key: country
    value: US
    rate_limit: {unit: second, requests_per_unit: 100}
    descriptors:
      - key: user
        rate_limit: {unit: second, requests_per_unit: 5}
  - key: country
    value: CA
  - key: country
    value: KP
    rate_limit: {unit: second, requests_per_unit: 0}
"#;
    let (imported, p) = import(text);
    assert!(particular(&imported).is_empty(), "{:?}", imported.notes);
    for limit in p.limits().iter().filter(|l| l.deny()) {
        assert!(
            limit.overrides().iter().all(|o| o.unlimited()),
            "{}",
            imported.policy
        );
    }
    let m = |d: &[(&str, &str)]| matched(&p, "d", d);
    assert_eq!(m(&[("country", "FR")]), ["d.country|FR deny"]);
    assert_eq!(
        m(&[("country", "US")]),
        ["d.country_US capacity 100 refill 100/s"]
    );
    // No rate_limit on CA: Envoy applies nothing to it.
    assert_eq!(m(&[("country", "CA")]), Vec::<String>::new());
    assert_eq!(m(&[("country", "KP")]), ["d.country_KP deny"]);
    assert_eq!(
        m(&[("country", "FR"), ("user", "u1")]),
        ["d.country.user|FR|u1 deny"]
    );
    assert_eq!(
        m(&[("country", "US"), ("user", "u1")]),
        ["d.country_US.user|u1 capacity 5 refill 5/s"]
    );
    // Envoy walks CA's (empty) subtree, not the key-only node's.
    assert_eq!(
        m(&[("country", "CA"), ("user", "u1")]),
        Vec::<String>::new()
    );
}

/// A deny written without `requests_per_unit` (Envoy reads 0) is a deny wherever the importer
/// asks, not only where it writes the limit: a value beside such a key-only node, denied too or
/// limited, is kept from becoming an override the compiler refuses on a deny, and the import
/// writes what it writes for the one with 0.
#[test]
fn a_deny_without_requests_per_unit_takes_overrides_as_one_written_with_0() {
    let written = |wider: &str| {
        format!(
            r#"
domain: d
descriptors:
  - key: addr
    value: a1
    rate_limit: {{unit: second, requests_per_unit: 0}}
    descriptors:
      - key: user
  - key: addr
    value: a2
    rate_limit: {{unit: second, requests_per_unit: 7}}
  - key: addr
    rate_limit: {wider}
"#
        )
    };
    let (with_0, _) = import(&written("{unit: second, requests_per_unit: 0}"));
    let (without, implied) = import(&written("{unit: minute}"));
    assert!(
        without
            .notes
            .iter()
            .any(|n| n.contains("rate_limit without requests_per_unit")),
        "{:?}",
        without.notes
    );
    assert_eq!(with_0.policy, without.policy);
    assert_eq!(
        matched(&implied, "d", &[("addr", "a3")]),
        ["d.addr|a3 deny"]
    );
    assert_eq!(
        matched(&implied, "d", &[("addr", "a2")]),
        ["d.addr_a2 capacity 7 refill 7/s"]
    );
}

#[test]
fn overlapping_wildcard_values_decide_as_envoy_the_first_that_matches() {
    let text = r#"
domain: d
descriptors:
  - key: path
    value: "/api/*"
    rate_limit: {unit: second, requests_per_unit: 20}
  - key: path
    value: "/api/v2*"
    rate_limit: {unit: second, requests_per_unit: 5}
  - key: path
    value: "/web*"
    rate_limit: {unit: second, requests_per_unit: 5}
"#;
    let (imported, p) = import(text);
    assert!(
        !imported.notes.join("\n").contains("overlaps"),
        "{:?}",
        imported.notes
    );
    // `/api/*` comes first and takes every `/api/` value, `/api/v2/x` included: Envoy never
    // reaches `/api/v2*`.
    assert_eq!(
        matched(&p, "d", &[("path", "/api/v2/x")]),
        ["d.path__api__|/api/v2/x capacity 20 refill 20/s"]
    );
    assert_eq!(matched(&p, "d", &[("path", "/web/x")]).len(), 1);
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

#[test]
fn envoy_empty_value_is_a_wildcard() {
    // envoyproxy/ratelimit: `finalKey := key; if value != "" { finalKey += "_" + value }`.
    let cfg = "domain: d\ndescriptors:\n  - key: user\n    value: \"\"\n    rate_limit:\n      unit: second\n      requests_per_unit: 5\n";
    let (imported, p) = import(cfg);
    assert_eq!(
        matched(&p, "d", &[("user", "alice")]),
        ["d.user|alice capacity 5 refill 5/s"],
        "{}",
        imported.policy
    );
}

#[test]
fn envoy_valued_node_hides_the_wildcard_subtree() {
    // Envoy walks `key_value` first: [client=vip, path=x] lands on node client=vip, which has
    // no child `path`, so no limit applies. The wildcard's child gets an unlimited override
    // for vip, so none applies in tollgate either.
    let cfg = "domain: d\ndescriptors:\n  - key: client\n    value: vip\n    rate_limit:\n      unit: second\n      requests_per_unit: 100\n  - key: client\n    rate_limit:\n      unit: second\n      requests_per_unit: 10\n    descriptors:\n      - key: path\n        rate_limit:\n          unit: second\n          requests_per_unit: 1\n";
    let (imported, p) = import(cfg);
    assert_eq!(
        matched(&p, "d", &[("client", "vip"), ("path", "/a")]),
        Vec::<String>::new(),
        "{}",
        imported.policy
    );
    assert_eq!(
        matched(&p, "d", &[("client", "web"), ("path", "/a")]),
        ["d.client.path|web|/a capacity 1 refill 1/s"]
    );
    assert_eq!(
        matched(&p, "d", &[("client", "vip")]),
        ["d.client|vip#vip capacity 100 refill 100/s"]
    );
    assert!(
        imported.notes.iter().all(|n| !n.contains("hides")),
        "{:?}",
        imported.notes
    );
    // A wildcard without a subtree hides nothing: no such note.
    let flat = import(&cfg[..cfg.find("    descriptors:").unwrap_or(cfg.len())]).0;
    assert!(
        flat.notes.iter().all(|n| !n.contains("hides")),
        "{:?}",
        flat.notes
    );
}

#[test]
fn envoy_decimal_value_imports() {
    let cfg = "domain: d\ndescriptors:\n  - key: version\n    value: 1.50\n    rate_limit:\n      unit: second\n      requests_per_unit: 5\n";
    let (imported, p) = import(cfg);
    // As written, as Envoy compares it: "1.50", not "1.5".
    assert_eq!(
        matched(&p, "d", &[("version", "1.50")]).len(),
        1,
        "{}",
        imported.policy
    );
    assert!(matched(&p, "d", &[("version", "1.5")]).is_empty());
}

#[test]
fn envoy_same_key_at_two_levels_imports() {
    // Legal in envoy (descriptor [a=1, a=2] walks both levels); skipped with a note here.
    let cfg = "domain: d\ndescriptors:\n  - key: a\n    descriptors:\n      - key: a\n        rate_limit:\n          unit: second\n          requests_per_unit: 5\n      - key: b\n        rate_limit:\n          unit: second\n          requests_per_unit: 3\n  - key: c\n    value: \"1\"\n    descriptors:\n      - key: c\n        value: \"2\"\n        rate_limit:\n          unit: second\n          requests_per_unit: 5\n";
    let (imported, p) = import(cfg);
    // The sibling that does not repeat a key is kept.
    assert_eq!(imported.limits, 1, "{}", imported.policy);
    assert_eq!(
        matched(&p, "d", &[("a", "1"), ("b", "2")]),
        ["d.a.b|1|2 capacity 3 refill 3/s"]
    );
    let notes = imported.notes.join("\n");
    for fragment in [
        "a > a: entry `a` already appears above",
        "c=1 > c=2: entry `c` already appears above",
    ] {
        assert!(notes.contains(fragment), "missing {fragment:?} in\n{notes}");
    }
}

#[test]
fn envoy_domain_cannot_inject_policy_fields() {
    let cfg = "domain: \"x\\nversion: injected\\r\\nexemptions: []\\u2028#\"\ndescriptors:\n  - key: user\n    rate_limit:\n      unit: second\n      requests_per_unit: 5\n";
    let (imported, p) = import(cfg);
    assert_ne!(p.version(), "injected", "{}", imported.policy);
    // The comment stays one line, and the domain is kept whole for matching.
    assert_eq!(
        imported
            .policy
            .lines()
            .filter(|l| l.starts_with('#'))
            .count(),
        1
    );
    assert!(imported.policy.lines().all(|l| !l.starts_with("version")));
    let domain = "x\nversion: injected\r\nexemptions: []\u{2028}#";
    assert_eq!(matched(&p, domain, &[("user", "u")]).len(), 1);
}

/// With fixed windows, every limit and override counts as Envoy does: N per unit, in windows.
#[test]
fn fixed_windows_keep_envoys_counting() {
    let options = tollgate_policy::ImportOptions::default().fixed_windows(true);
    let imported = tollgate_policy::import_envoy_with("ratelimit.yaml", GATEWAY, options)
        .unwrap_or_else(|e| panic!("{e}"));
    let policy = compile("out.yaml", &imported.policy)
        .unwrap_or_else(|e| panic!("{e}\n{}", imported.policy));
    assert!(
        imported.notes[0].contains("fixed_window"),
        "{:?}",
        imported.notes
    );
    for limit in policy.limits() {
        assert_eq!(limit.algorithm(), "fixed_window", "{}", limit.name());
    }
    assert_eq!(
        matched(&policy, "edge_proxy", &[("client_id", "mobile-app")]),
        ["edge_proxy.client_id|mobile-app#mobile-app fixed_window limit 600 window 1m"]
    );
    assert_eq!(
        matched(&policy, "edge_proxy", &[("remote_address", "10.0.0.1")]),
        ["edge_proxy.remote_address|10.0.0.1#10.0.0.1 fixed_window limit 1 window 1s"]
    );
    // Without the option, the same file makes token buckets of the same rate.
    let (_, buckets) = import(GATEWAY);
    assert!(
        buckets
            .limits()
            .iter()
            .all(|l| l.algorithm() == "token_bucket")
    );
}

#[test]
fn several_files_import_into_one_policy_with_names_unique_across_them() {
    let edge = "domain: edge\ndescriptors:\n  - key: remote_address\n    rate_limit: {unit: second, requests_per_unit: 50, name: per-client}\n  - key: plan\n    value: free\n    rate_limit: {unit: minute, requests_per_unit: 5, replaces: [{name: per-client}]}\n";
    let api = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 600, name: per-client}\n    detailed_metric: true\n";
    let imported = import_envoy_files(
        &[("edge.yaml", edge), ("api.yaml", api)],
        ImportOptions::default(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(imported.limits, 3, "{}", imported.policy);
    let p = compile("out.yaml", &imported.policy).unwrap_or_else(|e| panic!("{e}"));
    // One `rate_limit.name` in two files: two limits, the second renamed.
    assert_eq!(
        matched(&p, "edge", &[("remote_address", "1.2.3.4")]),
        ["per-client|1.2.3.4 capacity 50 refill 50/s"]
    );
    assert_eq!(
        matched(&p, "api", &[("user", "u1")]),
        ["per-client-2|u1 capacity 600 refill 600/m"]
    );
    // A `replaces` names a limit of its own file.
    let free = p
        .limits()
        .iter()
        .find(|l| l.domain() == "edge" && l.name() != "per-client");
    let replaced: Vec<&str> = free
        .map(|l| {
            l.replaces()
                .iter()
                .map(|&i| p.limits()[i as usize].name())
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(replaced, ["per-client"]);
    // Notes name their file; the general ones come once.
    assert!(
        imported
            .notes
            .iter()
            .any(|n| n.starts_with("api.yaml: user: detailed_metric")),
        "{:?}",
        imported.notes
    );
    assert_eq!(
        imported
            .notes
            .iter()
            .filter(|n| n.contains("calendar fixed windows"))
            .count(),
        1
    );
    // Two files of one domain: refused, naming both.
    let twice = import_envoy_files(
        &[("edge.yaml", edge), ("edge-2.yaml", edge)],
        ImportOptions::default(),
    )
    .map(|_| ())
    .map_err(|e| e.to_string());
    let err = twice.unwrap_err();
    assert!(
        err.starts_with("edge-2.yaml") && err.contains("also the domain of edge.yaml"),
        "{err}"
    );
    // Merged as envoyproxy/ratelimit's MERGE_DOMAIN_CONFIG does: one level, so a value in
    // one file is an override of the key-only node of the other, as Envoy looks it up.
    let wide = "domain: edge\ndescriptors:\n  - key: remote_address\n    rate_limit: {unit: second, requests_per_unit: 50}\n";
    let narrow = "domain: edge\ndescriptors:\n  - key: remote_address\n    value: 10.0.0.1\n    rate_limit: {unit: second, requests_per_unit: 1}\n";
    let merged = import_envoy_files(
        &[("wide.yaml", wide), ("narrow.yaml", narrow)],
        ImportOptions::default().merge_domains(true),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let p = compile("out.yaml", &merged.policy).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(merged.limits, 1, "{}", merged.policy);
    assert_eq!(
        matched(&p, "edge", &[("remote_address", "10.0.0.1")]),
        ["edge.remote_address|10.0.0.1#10.0.0.1 capacity 1 refill 1/s"]
    );
    assert!(
        merged.policy.contains("\"wide.yaml + narrow.yaml\""),
        "{}",
        merged.policy
    );
    // One file behaves as `import_envoy`.
    let one = import_envoy_files(&[("api.yaml", api)], ImportOptions::default())
        .unwrap_or_else(|e| panic!("{e}"));
    let alone = import_envoy("api.yaml", api).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        one.notes
            .iter()
            .any(|n| n.starts_with("user: detailed_metric")),
        "a note of one file does not name it: {:?}",
        one.notes
    );
    assert_eq!((one.policy, one.notes), (alone.policy, alone.notes));
    // The note on entry order comes where there is a limit to match, and only there.
    assert!(
        imported
            .notes
            .iter()
            .any(|n| n.starts_with("envoy matches descriptor entries in order")),
        "{:?}",
        imported.notes
    );
    let none = import_envoy("empty.yaml", "domain: empty\ndescriptors: []\n")
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(none.limits, 0);
    assert!(
        none.notes.iter().all(|n| !n.contains("in order")),
        "{:?}",
        none.notes
    );
}

/// A key-only node, a wildcard value and an exact value it covers, each with a subtree of the
/// same shape: Envoy walks exactly one of the three subtrees for a request, the most specific.
const THREE_SUBTREES: &str = r#"
domain: mix
descriptors:
  - key: path
    rate_limit: {unit: second, requests_per_unit: 100}
    descriptors:
      - key: user
        rate_limit: {unit: second, requests_per_unit: 10}
  - key: path
    value: "/api/*"
    descriptors:
      - key: user
        rate_limit: {unit: second, requests_per_unit: 5}
  - key: path
    value: /api/health
    descriptors:
      - key: user
        rate_limit: {unit: second, requests_per_unit: 1}
"#;

#[test]
fn of_a_key_a_wildcard_value_and_an_exact_value_only_the_most_specific_subtree_applies() {
    let (imported, p) = import(THREE_SUBTREES);
    let capacities = |d: &[(&str, &str)]| -> Vec<u64> {
        p.matches("mix", &[d], UnixTime::from_secs(0))
            .iter()
            .map(|m| m.params().capacity())
            .collect()
    };
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a [u64]);
    let cases: &[Case<'_>] = &[
        (&[("path", "/web"), ("user", "u")], &[10]),
        (&[("path", "/api/x"), ("user", "u")], &[5]),
        (&[("path", "/api/health"), ("user", "u")], &[1]),
        (&[("path", "/web")], &[100]),
        // The wildcard value and the exact value have no limit of their own at this depth.
        (&[("path", "/api/x")], &[]),
        (&[("path", "/api/health")], &[]),
    ];
    for (descriptor, expected) in cases {
        assert_eq!(
            capacities(descriptor),
            *expected,
            "{descriptor:?}\n{}",
            imported.policy
        );
    }
}

/// A `rate_limit` with a unit and no `requests_per_unit` is a deny-all in envoyproxy/ratelimit
/// (the number reads as 0): imported as such, and said, since it may be a slip. Without a unit
/// Envoy refuses the file, and the import skips the limit with a note.
#[test]
fn a_rate_limit_without_a_number_denies_as_in_envoy() {
    let text = r#"
domain: api
descriptors:
  - key: user
    rate_limit: {unit: minute}
  - key: tenant
    rate_limit: {requests_per_unit: 5}
"#;
    let imported =
        tollgate_policy::import_envoy("ratelimit.yaml", text).unwrap_or_else(|e| panic!("{e}"));
    let p = compile("out.yaml", &imported.policy).unwrap_or_else(|e| panic!("{e}"));
    let user: Vec<String> = matched(&p, "api", &[("user", "u1")])
        .iter()
        .map(|m| m.rsplit(' ').next().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(user, ["deny"], "{}", imported.policy);
    assert!(matched(&p, "api", &[("tenant", "t1")]).is_empty());
    let notes = particular(&imported);
    assert_eq!(notes.len(), 2, "{notes:?}");
    assert!(
        notes[0].contains("envoy reads 0 and denies every request"),
        "{notes:?}"
    );
    assert!(notes[1].contains("skipped"), "{notes:?}");
}

/// A value whose limit cannot be converted is not a value without a limit: the wildcard
/// sibling's limit applies to it (noted), where an `unlimited: true` value would be let through.
#[test]
fn a_value_whose_limit_is_skipped_keeps_its_sibling_s_limit() {
    let (imported, p) = import(
        "domain: skip\ndescriptors:\n  \
         - key: user\n    rate_limit: {unit: second, requests_per_unit: 10}\n  \
         - key: user\n    value: vip\n    rate_limit: {unit: fortnight, requests_per_unit: 5}\n  \
         - key: user\n    value: \"svc-*\"\n    rate_limit: {unit: fortnight, requests_per_unit: 5}\n  \
         - key: user\n    value: root\n    rate_limit: {unlimited: true}\n",
    );
    let notes = imported.notes.join("\n");
    assert!(
        notes.contains("unknown unit `fortnight`: skipped"),
        "{notes}"
    );
    assert!(
        notes.contains("its limit was skipped but the wildcard sibling `user` has one"),
        "{notes}"
    );
    for user in ["vip", "svc-1", "u1"] {
        assert_eq!(
            matched(&p, "skip", &[("user", user)]),
            [format!("skip.user|{user} capacity 10 refill 10/s")],
            "{user}\n{}",
            imported.policy
        );
    }
    assert_eq!(
        matched(&p, "skip", &[("user", "root")]),
        Vec::<String>::new()
    );
}

/// Names stay unique however often one repeats, and a limit that names itself in `replaces`
/// replaces nothing (said), rather than an output that would not compile.
#[test]
fn repeated_names_count_up_and_a_limit_does_not_replace_itself() {
    let (imported, p) = import(
        "domain: names\ndescriptors:\n  \
         - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, name: dup}\n  \
         - key: b\n    rate_limit: {unit: second, requests_per_unit: 2, name: dup}\n  \
         - key: c\n    rate_limit: {unit: second, requests_per_unit: 3, name: dup}\n  \
         - key: d\n    rate_limit: {unit: second, requests_per_unit: 4, name: me, replaces: [{name: me}]}\n",
    );
    let names: Vec<&str> = p.limits().iter().map(|l| l.name()).collect();
    assert_eq!(names, ["dup", "dup-2", "dup-3", "me"]);
    assert!(p.limits()[3].replaces().is_empty());
    let notes = imported.notes.join("\n");
    assert!(
        notes.contains("d: replaces \"me\", which is not a limit of its own here"),
        "{notes}"
    );
}

/// What envoyproxy/ratelimit refuses empty, a domain or a descriptor's key, is refused at its
/// place in the file imported: not as an error in the policy the import would have written, at
/// a line of a file nobody saw.
#[test]
fn an_empty_domain_or_key_is_refused_where_the_file_has_it() {
    for (text, line, column, path) in [
        (
            "domain: \"\"\ndescriptors:\n  - key: user\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
            1,
            9,
            "domain",
        ),
        (
            "domain: api\ndescriptors:\n  - key: user\n    descriptors:\n      - key: \"\"\n        rate_limit: {unit: second, requests_per_unit: 1}\n",
            5,
            14,
            "descriptors[0].descriptors[0].key",
        ),
    ] {
        let err = import_envoy("ratelimit.yaml", text).expect_err(text);
        let d = err
            .diagnostic()
            .unwrap_or_else(|| panic!("no place: {err}"));
        assert_eq!(
            (d.file.as_str(), d.line, d.column, d.path.as_str()),
            ("ratelimit.yaml", line, column, path),
            "{d}"
        );
        assert_eq!(d.message, "must not be empty", "{d}");
    }
}

/// As a policy directory: a file per domain, named after its source (numbered when two
/// sources share a name), holding that domain's limits alone, and compiling to the same limits
/// as the one-file import, names made unique across files included.
#[test]
fn several_files_import_into_a_policy_directory_of_the_same_limits() {
    let edge = "domain: edge\ndescriptors:\n  - key: remote_address\n    rate_limit: {unit: second, requests_per_unit: 50, name: per-client}\n";
    let api = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 600, name: per-client}\n";
    let empty = "domain: quiet\n";
    let imported = import_envoy_files(
        &[
            ("a/config.yaml", edge),
            ("b/config.yaml", api),
            ("c/quiet.conf", empty),
        ],
        ImportOptions::default(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let names: Vec<&str> = imported.files.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["config.yaml", "config-2.yaml", "quiet.conf.yaml"]);
    assert!(
        imported.files[0].1.contains("domain: \"edge\"")
            && !imported.files[0].1.contains("domain: \"api\""),
        "{}",
        imported.files[0].1
    );
    assert!(
        imported.files[2].1.contains("limits: []"),
        "{}",
        imported.files[2].1
    );
    let files: Vec<(&str, &str)> = imported
        .files
        .iter()
        .map(|(n, t)| (n.as_str(), t.as_str()))
        .collect();
    let directory = compile_directory("policy.d", &files).unwrap_or_else(|e| panic!("{e}"));
    let single = compile("out.yaml", &imported.policy).unwrap_or_else(|e| panic!("{e}"));
    let limits = |p: &Policy| -> Vec<(String, String, Option<u64>)> {
        p.limits()
            .iter()
            .map(|l| {
                let capacity = l.params().rate().map(|r| r.capacity());
                (l.name().to_owned(), l.domain().to_owned(), capacity)
            })
            .collect()
    };
    assert_eq!(limits(&directory), limits(&single));
    assert_eq!(
        directory.limit("per-client-2").and_then(|l| l.file()),
        Some("config-2.yaml")
    );
}
