//! Matching: which limits apply to a request, with which bucket and which parameters.

use std::time::Duration;

use tollgate::Limit;
use tollgate_policy::{
    Effect, FailureMode, Mode, Policy, RequestDescriptor, RequestedLimit, UnixTime, ValueMatch,
    compile,
};

const POLICY: &str = r#"
version: "12"
defaults:
  failure_mode: open
  emergency: 2/s
limits:
  - name: payments-per-user
    domain: api
    when: {route: /v1/payments, method: POST}
    key: [tenant, user]
    capacity: 20
    refill: 10/s
    failure_mode: closed
    overrides:
      - name: premium
        when: {tier: premium}
        capacity: 200
        refill: 100/s
      - when: {tier: premium, region: eu}
        capacity: 1
      - name: gold
        when: {tier: gold}
        refill: 1/s
  - name: per-tenant
    domain: api
    key: [tenant]
    capacity: 1000
    refill: 600/m
  - name: global
    domain: api
    capacity: 100000
    refill: 100000/s
    mode: shadow
  - name: per-ip
    domain: edge
    key: [ip]
    capacity: 5
    refill: 5/100ms
  - name: port-443
    domain: edge
    when: {port: 443}
    capacity: 1
    refill: 1/d
"#;

fn policy() -> Policy {
    compile("p.yaml", POLICY).unwrap_or_else(|err| panic!("{err}"))
}

const NOW: UnixTime = UnixTime::from_secs(1_800_000_000);

fn names(policy: &Policy, domain: &str, descriptors: &[&[(&str, &str)]]) -> Vec<String> {
    policy
        .matches(domain, descriptors, NOW)
        .iter()
        .map(|m| format!("{}@{}", m.bucket_key, m.descriptor))
        .collect()
}

#[test]
fn matching_table() {
    let p = policy();
    let pay = [
        ("route", "/v1/payments"),
        ("method", "POST"),
        ("tenant", "acme"),
        ("user", "u1"),
    ];
    type Case<'a> = (&'a str, &'a [&'a [(&'a str, &'a str)]], &'a [&'a str]);
    let cases: &[Case<'_>] = &[
        // Every applicable limit, in declaration order.
        (
            "api",
            &[&pay],
            &[
                "payments-per-user|acme|u1@0",
                "per-tenant|acme@0",
                "global@0",
            ],
        ),
        // A `when` that differs excludes the limit.
        (
            "api",
            &[&[
                ("route", "/v1/payments"),
                ("method", "GET"),
                ("tenant", "acme"),
                ("user", "u1"),
            ]],
            &["per-tenant|acme@0", "global@0"],
        ),
        // A key entry missing excludes the limit, even when `when` matches.
        (
            "api",
            &[&[
                ("route", "/v1/payments"),
                ("method", "POST"),
                ("tenant", "acme"),
            ]],
            &["per-tenant|acme@0", "global@0"],
        ),
        // Limits without conditions or key apply to every descriptor of their domain.
        ("api", &[&[]], &["global@0"]),
        (
            "api",
            &[&[("x", "y")], &[("tenant", "t")]],
            &["global@0", "per-tenant|t@1", "global@1"],
        ),
        // Another domain sees none of api's limits.
        ("edge", &[&[("tenant", "acme")]], &[]),
        (
            "edge",
            &[&[("ip", "10.0.0.1"), ("port", "443")]],
            &["per-ip|10.0.0.1@0", "port-443@0"],
        ),
        // Unquoted numbers in the file match string values.
        ("edge", &[&[("port", "443")]], &["port-443@0"]),
        ("edge", &[&[("port", "0443")]], &[]),
        ("unknown", &[&pay], &[]),
        // The first occurrence of an entry counts.
        ("edge", &[&[("ip", "a"), ("ip", "b")]], &["per-ip|a@0"]),
        // Separators in values are escaped, so keys stay distinct.
        ("edge", &[&[("ip", "a|b#c\\")]], &["per-ip|a\\|b\\#c\\\\@0"]),
    ];
    for (domain, descriptors, expected) in cases {
        assert_eq!(
            names(&p, domain, descriptors),
            *expected,
            "{domain} {descriptors:?}"
        );
    }
}

#[test]
fn overrides_first_match_wins() {
    let p = policy();
    let base = [
        ("route", "/v1/payments"),
        ("method", "POST"),
        ("tenant", "acme"),
        ("user", "u1"),
    ];
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut d = base.to_vec();
        d.extend_from_slice(extra);
        let m = p.matches("api", &[d], NOW);
        let first = &m[0];
        (
            first.bucket_key.clone(),
            first.params().capacity(),
            first.params().refill().to_string(),
        )
    };
    assert_eq!(
        with(&[]),
        ("payments-per-user|acme|u1".into(), 20, "10/s".into())
    );
    assert_eq!(
        with(&[("tier", "premium")]),
        (
            "payments-per-user|acme|u1#premium".into(),
            200,
            "100/s".into()
        )
    );
    // The second override also matches, but the first one listed wins.
    assert_eq!(
        with(&[("tier", "premium"), ("region", "eu")]),
        (
            "payments-per-user|acme|u1#premium".into(),
            200,
            "100/s".into()
        )
    );
    // An override that sets only refill keeps the limit's capacity.
    assert_eq!(
        with(&[("tier", "gold")]),
        ("payments-per-user|acme|u1#gold".into(), 20, "1/s".into())
    );
    let unnamed = &p.limits()[0].overrides()[1];
    let rate = unnamed
        .rate()
        .unwrap_or_else(|| panic!("a rate limit's override"));
    assert_eq!((unnamed.name(), rate.capacity()), ("1", 1));
    assert_eq!(rate.refill().to_string(), "10/s");
    assert!(unnamed.concurrency().is_none());
}

#[test]
fn defaults_modes_and_failure_modes() {
    let p = policy();
    assert_eq!(p.version(), "12");
    let pay = p.limit("payments-per-user").map(|l| l.failure_mode());
    assert_eq!(pay, Some(FailureMode::Closed));
    let Some(tenant) = p.limit("per-tenant") else {
        panic!("missing")
    };
    match tenant.failure_mode() {
        FailureMode::Open { emergency } => {
            assert_eq!(
                (emergency.capacity(), emergency.refill().to_string()),
                (2, "2/s".into())
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(tenant.mode(), Mode::Enforce);
    assert_eq!(tenant.rollout(), 10_000);
    // The names the file, metrics and the audit log use.
    let global_mode = p.limit("global").map(|l| l.mode());
    assert_eq!(global_mode.map(|m| m.as_str()), Some("shadow"));
    assert_eq!(tenant.mode().as_str(), "enforce");
    let keys = |name: &str| p.limit(name).map(|l| l.key().collect::<Vec<_>>());
    assert_eq!(keys("payments-per-user"), Some(vec!["tenant", "user"]));
    assert_eq!(keys("global"), Some(vec![]));
    let global = p.matches("api", &[[("a", "b")]], NOW);
    assert_eq!(global[0].effect, Effect::Shadow);
    assert_eq!(global[0].effect.as_str(), "shadow");
}

#[test]
fn version_is_derived_from_content_when_not_declared() {
    let text = "limits:\n  - name: a\n    domain: d\n    capacity: 1\n    refill: 1/s\n";
    let a = compile("a.yaml", text).map(|p| p.version().to_owned());
    let b = compile("b.yaml", text).map(|p| p.version().to_owned());
    let c = compile("a.yaml", &text.replace("1/s", "2/s")).map(|p| p.version().to_owned());
    let (Ok(a), Ok(b), Ok(c)) = (a, b, c) else {
        panic!("refused")
    };
    assert!(a.starts_with("sha-") && a.len() == 20, "{a}");
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert_eq!(
        compile("v", "version: 3\nlimits: []\n")
            .map(|p| p.version().to_owned())
            .ok(),
        Some("3".into())
    );
}

#[test]
fn numeric_version_with_decimals_is_accepted() {
    // Taken as written: not refused as a float, not printed back as 1.5 from 1.50.
    for (written, version) in [("1.5", "1.5"), ("1.50", "1.50"), ("007", "007")] {
        let p = compile("p.yaml", &format!("version: {written}\nlimits: []\n"));
        assert_eq!(
            p.map(|p| p.version().to_owned()).map_err(|e| e.to_string()),
            Ok(version.to_owned())
        );
    }
}

fn when_policy(when: &str) -> Policy {
    let text = format!(
        "limits:\n  - name: l\n    domain: api\n    when: {{{when}}}\n    capacity: 1\n    refill: 1/s\n"
    );
    compile("p.yaml", &text).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn when_value_with_decimals_is_accepted() {
    let p = when_policy("api_version: 2.1");
    assert_eq!(names(&p, "api", &[&[("api_version", "2.1")]]), ["l@0"]);
    let p = when_policy("api_version: 2.10");
    assert_eq!(names(&p, "api", &[&[("api_version", "2.10")]]), ["l@0"]);
    assert!(names(&p, "api", &[&[("api_version", "2.1")]]).is_empty());
}

#[test]
fn when_value_with_leading_zero_matches_as_written() {
    let p = when_policy("zip: 01234");
    assert_eq!(names(&p, "api", &[&[("zip", "01234")]]), ["l@0"]);
    assert!(names(&p, "api", &[&[("zip", "1234")]]).is_empty());
    assert!(names(&p, "api", &[&[("zip", "668")]]).is_empty());
}

const PREFIXES: &str = r#"
limits:
  - name: api-paths
    domain: d
    when: {path: !prefix /api/}
    key: [path]
    capacity: 5
    refill: 1/s
    overrides:
      - name: health
        when: {path: /api/health}
        capacity: 100
        refill: 100/s
      - name: v2
        when: {path: !prefix /api/v2/}
        capacity: 50
        refill: 10/s
  - name: eu-tenants
    domain: d
    when: {method: POST, tenant: !prefix eu-}
    capacity: 10
    refill: 1/s
  - name: any-region
    domain: d
    when: {region: !prefix ''}
    capacity: 10
    refill: 1/s
exemptions:
  - limit: api-paths
    when: {user: !prefix svc-}
    owner: ops@example.com
    reason: internal callers
    expires: 2099-01-01T00:00:00Z
"#;

#[test]
fn prefix_conditions_match_the_values_that_start_with_them() {
    let p = compile("p.yaml", PREFIXES).unwrap_or_else(|e| panic!("{e}"));
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str]);
    let cases: &[Case<'_>] = &[
        // One bucket per full value, as in Envoy's wildcard values.
        (&[("path", "/api/users")], &["api-paths|/api/users@0"]),
        (&[("path", "/api/")], &["api-paths|/api/@0"]),
        (&[("path", "/ap")], &[]),
        (&[("path", "/apix")], &[]),
        (&[("path", "/web/api/x")], &[]),
        // Overrides: an exact value first, then a narrower prefix, in file order.
        (
            &[("path", "/api/health")],
            &["api-paths|/api/health#health@0"],
        ),
        (&[("path", "/api/v2/x")], &["api-paths|/api/v2/x#v2@0"]),
        (&[("path", "/api/v2")], &["api-paths|/api/v2@0"]),
        // A prefix beside an exact condition: both must hold.
        (
            &[("method", "POST"), ("tenant", "eu-acme")],
            &["eu-tenants@0"],
        ),
        (&[("method", "GET"), ("tenant", "eu-acme")], &[]),
        (&[("method", "POST"), ("tenant", "us-acme")], &[]),
        (&[("method", "POST"), ("tenant", "eu")], &[]),
        // An empty prefix: the entry present, whatever its value.
        (&[("region", "")], &["any-region@0"]),
        (&[("region", "anything")], &["any-region@0"]),
        (&[("zone", "anything")], &[]),
    ];
    for (descriptor, expected) in cases {
        assert_eq!(names(&p, "d", &[descriptor]), *expected, "{descriptor:?}");
    }
    let effect = |user: &str| {
        let m = p.matches("d", &[&[("path", "/api/a"), ("user", user)]], NOW);
        matches!(m[0].effect, Effect::Exempt(_))
    };
    assert!(effect("svc-billing"));
    assert!(!effect("alice"));
    assert!(!effect("svc"));
}

#[test]
fn an_exact_and_a_prefix_condition_on_one_value_are_different_conditions() {
    // `!prefix /a` is not `/a`: a policy may hold both, and they match differently.
    let exact = when_policy("path: /a");
    let prefix = when_policy("path: !prefix /a");
    assert_eq!(names(&exact, "api", &[&[("path", "/a")]]), ["l@0"]);
    assert!(names(&exact, "api", &[&[("path", "/ab")]]).is_empty());
    assert_eq!(names(&prefix, "api", &[&[("path", "/a")]]), ["l@0"]);
    assert_eq!(names(&prefix, "api", &[&[("path", "/ab")]]), ["l@0"]);
    // Values are taken as written, prefixes too.
    let zip = when_policy("zip: !prefix 012");
    assert_eq!(names(&zip, "api", &[&[("zip", "01234")]]), ["l@0"]);
    assert!(names(&zip, "api", &[&[("zip", "1234")]]).is_empty());
}

#[test]
fn many_prefix_limits_are_found_through_the_index() {
    // Limits with only prefix conditions are filed under the entry they require, beside keyed
    // limits: each is tried for descriptors holding that entry only.
    let mut text = String::from("limits:\n");
    for i in 0..40 {
        text.push_str(&format!(
            "  - name: p{i}\n    domain: d\n    when: {{route{}: !prefix /r{i}/}}\n    capacity: 1\n    refill: 1/s\n",
            i % 4
        ));
    }
    let p = compile("x.yaml", &text).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(names(&p, "d", &[&[("route3", "/r7/x")]]), ["p7@0"]);
    assert_eq!(names(&p, "d", &[&[("route1", "/r13/")]]), ["p13@0"]);
    assert!(names(&p, "d", &[&[("route0", "/r13/")]]).is_empty());
    assert!(names(&p, "d", &[&[("other", "/r7/x")]]).is_empty());
}

#[test]
fn prefixes_of_one_entry_are_found_by_length_not_tried_one_by_one() {
    // Nested, overlapping and empty prefixes, multi-byte characters, a limit with two prefix
    // conditions, and a hundred routes besides: each limit that matches is found once, in
    // declaration order, and no other.
    let mut text = String::from("limits:\n");
    for (name, when) in [
        ("a", "path: !prefix /a"),
        ("ab", "path: !prefix /a/b"),
        ("abc", "path: !prefix /a/b/c"),
        ("any", "path: !prefix ''"),
        ("accent", "path: !prefix /é"),
        ("two", "path: !prefix /a, tenant: !prefix eu-"),
    ] {
        text.push_str(&format!(
            "  - name: {name}\n    domain: d\n    when: {{{when}}}\n    capacity: 1\n    refill: 1/s\n"
        ));
    }
    for i in 0..100 {
        text.push_str(&format!(
            "  - name: r{i}\n    domain: d\n    when: {{path: !prefix /r/{i}/}}\n    capacity: 1\n    refill: 1/s\n"
        ));
    }
    let p = compile("x.yaml", &text).unwrap_or_else(|e| panic!("{e}"));
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str]);
    let cases: &[Case<'_>] = &[
        (&[("path", "/a/b/c/d")], &["a@0", "ab@0", "abc@0", "any@0"]),
        (&[("path", "/a/b")], &["a@0", "ab@0", "any@0"]),
        (&[("path", "/a")], &["a@0", "any@0"]),
        (&[("path", "/")], &["any@0"]),
        (&[("path", "")], &["any@0"]),
        (&[("path", "/éa")], &["any@0", "accent@0"]),
        (&[("path", "/e")], &["any@0"]),
        // The length of `/a` cuts `/é` inside the two bytes of é: no prefix there, no panic.
        (&[("path", "/\u{e9}")], &["any@0", "accent@0"]),
        (
            &[("path", "/a/x"), ("tenant", "eu-1")],
            &["a@0", "any@0", "two@0"],
        ),
        (&[("path", "/a/x"), ("tenant", "us-1")], &["a@0", "any@0"]),
        (&[("path", "/r/42/items")], &["any@0", "r42@0"]),
        (&[("path", "/r/4/items")], &["any@0", "r4@0"]),
        (&[("path", "/r/420")], &["any@0"]),
        (&[("route", "/a/b")], &[]),
    ];
    for (descriptor, expected) in cases {
        assert_eq!(names(&p, "d", &[descriptor]), *expected, "{descriptor:?}");
    }
}

const REPLACES: &str = r#"
limits:
  - name: per-user
    domain: d
    key: [user]
    capacity: 10
    refill: 1/s
  - name: per-ip
    domain: d
    key: [ip]
    capacity: 5
    refill: 1/s
  - name: partners
    domain: d
    when: {plan: partner}
    key: [user]
    capacity: 1000
    refill: 100/s
    replaces: [per-user, per-ip]
  - name: trial
    domain: d
    when: {plan: trial}
    capacity: 3
    refill: 1/s
    mode: shadow
    replaces: [per-user]
"#;

#[test]
fn a_limit_that_applies_takes_the_place_of_those_it_replaces() {
    let p = compile("p.yaml", REPLACES).unwrap_or_else(|e| panic!("{e}"));
    let m = |descriptors: &[&[(&str, &str)]]| names(&p, "d", descriptors);
    // Without the replacing limit, the others apply.
    assert_eq!(
        m(&[&[("user", "u1"), ("ip", "a")]]),
        ["per-user|u1@0", "per-ip|a@0"]
    );
    // With it, through the same descriptor or another one of the request, they do not.
    assert_eq!(
        m(&[&[("user", "u1"), ("ip", "a"), ("plan", "partner")]]),
        ["partners|u1@0"]
    );
    assert_eq!(
        m(&[
            &[("user", "u1")],
            &[("ip", "a")],
            &[("plan", "partner"), ("user", "u1")]
        ]),
        ["partners|u1@2"]
    );
    // A shadow limit replaces too: which limits apply is configuration, not enforcement.
    assert_eq!(m(&[&[("user", "u1"), ("plan", "trial")]]), ["trial@0"]);
    assert_eq!(p.limits()[2].replaces(), [0, 1]);
    // A request's earlier matches in a reused buffer are left alone.
    let mut out = p.matches("d", &[[("user", "u1")]], NOW);
    p.match_into("d", &[[("plan", "partner"), ("user", "u2")]], NOW, &mut out);
    let keys: Vec<&str> = out.iter().map(|m| m.bucket_key.as_str()).collect();
    assert_eq!(keys, ["per-user|u1", "partners|u2"]);
}

const REQUEST_LIMITS: &str = r#"
limits:
  - name: per-route
    domain: edge
    key: [route]
    capacity: 100
    refill: 100/m
    request_limit: apply
    overrides:
      - name: checkout
        when: {route: checkout}
        capacity: 10
        refill: 10/m
  - name: per-client
    domain: edge
    key: [client]
    capacity: 5
    refill: 5/s
"#;

#[test]
fn a_limit_sent_with_a_descriptor_decides_where_the_limit_applies_it() {
    let p = compile("p.yaml", REQUEST_LIMITS).unwrap_or_else(|e| panic!("{e}"));
    assert!(p.limits()[0].applies_request_limit());
    assert!(!p.limits()[1].applies_request_limit());
    assert!(p.applies_request_limits("edge"));
    assert!(!p.applies_request_limits("other"));
    let per_minute = |n| Limit::per(n, Duration::from_secs(60)).unwrap_or_else(|e| panic!("{e}"));
    let sent =
        |route: &'static str, client: &'static str, limit: Option<Limit>| RequestDescriptor {
            entries: vec![("route", route), ("client", client)],
            limit: limit.map(RequestedLimit::Rate),
        };
    let seen = |descriptor: RequestDescriptor<&str>| -> Vec<(String, String, bool)> {
        p.matches("edge", &[descriptor], NOW)
            .iter()
            .map(|m| (m.bucket_key.clone(), m.params().to_string(), m.requested))
            .collect()
    };
    let owned = |rows: &[(&str, &str, bool)]| -> Vec<(String, String, bool)> {
        rows.iter()
            .map(|&(k, p, r)| (k.to_owned(), p.to_owned(), r))
            .collect()
    };
    // Nothing asked: the limit's own parameters, and the override's for checkout.
    assert_eq!(
        seen(sent("search", "c1", None)),
        owned(&[
            ("per-route|search", "capacity 100 refill 100/m", false),
            ("per-client|c1", "capacity 5 refill 5/s", false)
        ])
    );
    assert_eq!(
        seen(sent("checkout", "c1", None))[0],
        owned(&[(
            "per-route|checkout#checkout",
            "capacity 10 refill 10/m",
            false
        )])[0]
    );
    // A limit asked for: per-route takes it, in place of the override too; per-client, which
    // does not apply limits sent, keeps its own.
    assert_eq!(
        seen(sent("search", "c1", Some(per_minute(7)))),
        owned(&[
            ("per-route|search", "capacity 7 refill 7/m", true),
            ("per-client|c1", "capacity 5 refill 5/s", false)
        ])
    );
    assert_eq!(
        seen(sent("checkout", "c1", Some(per_minute(7))))[0],
        owned(&[("per-route|checkout", "capacity 7 refill 7/m", true)])[0]
    );
    // Plain pairs ask for nothing, whatever the limit.
    let m = p.matches("edge", &[[("route", "search")]], NOW);
    assert_eq!(m[0].params().capacity(), 100);
    assert!(!m[0].requested);
}

const UNLIMITED: &str = r#"
limits:
  - name: per-tenant
    domain: api
    key: [tenant]
    capacity: 10
    refill: 10/s
    overrides:
      - name: internal
        when: {tenant: internal}
        unlimited: true
      - name: staff
        when: {tenant: !prefix staff-}
        unlimited: true
      - name: staff-lab
        when: {tenant: staff-lab}
        capacity: 1
  - name: per-user
    domain: api
    key: [user]
    capacity: 5
    refill: 5/s
    replaces: [per-tenant]
    overrides:
      - when: {user: root}
        unlimited: true
"#;

#[test]
fn an_unlimited_override_leaves_its_requests_out_of_the_limit() {
    let p = compile("p.yaml", UNLIMITED).unwrap_or_else(|e| panic!("{e}"));
    let m = |descriptors: &[&[(&str, &str)]]| names(&p, "api", descriptors);
    assert_eq!(m(&[&[("tenant", "acme")]]), ["per-tenant|acme@0"]);
    // Unlimited by value and by prefix: the limit does not apply at all, and the first
    // override that matches wins, as for any override.
    assert!(m(&[&[("tenant", "internal")]]).is_empty());
    assert!(m(&[&[("tenant", "staff-lab")]]).is_empty());
    // Only the limit whose override matched is left out.
    assert_eq!(
        m(&[&[("tenant", "internal"), ("user", "u1")]]),
        ["per-user|u1@0"]
    );
    // A limit left out by an unlimited override does not apply, so it replaces nothing.
    assert_eq!(
        m(&[&[("tenant", "acme"), ("user", "root")]]),
        ["per-tenant|acme@0"]
    );
    let overrides = p.limits()[0].overrides();
    assert!(overrides[0].unlimited() && overrides[1].unlimited());
    assert!(!overrides[2].unlimited());
    assert_eq!(overrides[0].rate(), None);
    assert_eq!(overrides[2].rate().map(|r| r.capacity()), Some(1));
}

fn rollout_policy(percent: &str) -> Policy {
    let text = format!(
        "limits:\n  - name: canary\n    domain: api\n    key: [user]\n    capacity: 1\n    refill: 1/s\n    rollout: {percent}\n"
    );
    compile("r.yaml", &text).unwrap_or_else(|err| panic!("{err}"))
}

fn enforced(policy: &Policy, user: &str) -> bool {
    let m = policy.matches("api", &[[("user", user)]], NOW);
    match m[0].effect {
        Effect::Enforce => true,
        Effect::OutsideRollout => false,
        other => panic!("{other:?}"),
    }
}

#[test]
fn rollout_is_stable_and_proportional() {
    let quarter = rollout_policy("25%");
    let users: Vec<String> = (0..4_000).map(|i| format!("user-{i}")).collect();
    let inside: Vec<bool> = users.iter().map(|u| enforced(&quarter, u)).collect();
    let count = inside.iter().filter(|&&b| b).count();
    assert!((850..1_150).contains(&count), "{count} of 4000 at 25%");
    // Recompiling (a reload) keeps every subject on the same side.
    let again = rollout_policy("25%");
    assert!(
        users
            .iter()
            .zip(&inside)
            .all(|(u, &i)| enforced(&again, u) == i)
    );
    // Widening the rollout only adds subjects.
    let half = rollout_policy("50%");
    assert!(
        users
            .iter()
            .zip(&inside)
            .all(|(u, &i)| !i || enforced(&half, u))
    );
    let (all, none) = (rollout_policy("100%"), rollout_policy("0%"));
    assert!(
        users
            .iter()
            .all(|u| enforced(&all, u) && !enforced(&none, u))
    );
}

const EXEMPT: &str = r#"
limits:
  - name: per-user
    domain: api
    key: [tenant, user]
    capacity: 5
    refill: 1/s
    mode: shadow
exemptions:
  - limit: per-user
    when: {tenant: acme}
    owner: ops@example.com
    reason: launch week
    expires: 2026-12-31T00:00:00Z
"#;

#[test]
fn exemptions_apply_until_they_expire() {
    let p = compile("e.yaml", EXEMPT).unwrap_or_else(|err| panic!("{err}"));
    let expiry = UnixTime::parse_rfc3339("2026-12-31T00:00:00Z").unwrap_or_default();
    let acme = [("tenant", "acme"), ("user", "u1")];
    let other = [("tenant", "globex"), ("user", "u1")];
    let before = UnixTime::from_nanos(expiry.as_nanos() - 1);
    let m = p.matches("api", &[acme], before);
    match m[0].effect {
        Effect::Exempt(e) => {
            assert_eq!(
                (e.owner(), e.reason(), e.limit()),
                ("ops@example.com", "launch week", "per-user")
            );
            assert_eq!(e.expires(), expiry);
        }
        other => panic!("{other:?}"),
    }
    // Exemptions win over shadow; other tenants are not exempt.
    assert_eq!(p.matches("api", &[other], before)[0].effect, Effect::Shadow);
    // At the expiry instant the exemption has ended, with nobody touching the policy.
    assert_eq!(p.matches("api", &[acme], expiry)[0].effect, Effect::Shadow);
    assert_eq!(expiry.to_rfc3339(), "2026-12-31T00:00:00Z");
}

#[test]
fn match_into_reuses_the_buffer() {
    let p = policy();
    let mut out = Vec::with_capacity(8);
    p.match_into("edge", &[[("ip", "1")]], NOW, &mut out);
    p.match_into("edge", &[[("ip", "2")]], NOW, &mut out);
    let keys: Vec<&str> = out.iter().map(|m| m.bucket_key.as_str()).collect();
    assert_eq!(keys, ["per-ip|1", "per-ip|2"]);
}

#[test]
fn owned_descriptors_work_too() {
    let p = policy();
    let descriptors: Vec<Vec<(String, String)>> = vec![vec![("ip".into(), "9".into())]];
    assert_eq!(
        p.matches("edge", &descriptors, NOW)[0].bucket_key,
        "per-ip|9"
    );
}

#[test]
fn exact_limits_want_exactly_their_entries() {
    let text = "limits:\n  - name: exact\n    domain: d\n    when: {a: \"1\"}\n    key: [b]\n    exact: true\n    capacity: 1\n    refill: 1/s\n  - name: loose\n    domain: d\n    when: {a: \"1\"}\n    key: [b]\n    capacity: 1\n    refill: 1/s\n";
    let p = compile("x.yaml", text).unwrap_or_else(|e| panic!("{e}"));
    assert!(p.limits()[0].exact() && !p.limits()[1].exact());
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str]);
    let cases: &[Case<'_>] = &[
        (&[("a", "1"), ("b", "x")], &["exact|x@0", "loose|x@0"]),
        (&[("b", "x"), ("a", "1")], &["exact|x@0", "loose|x@0"]),
        (&[("a", "1"), ("b", "x"), ("c", "y")], &["loose|x@0"]),
        (&[("a", "1")], &[]),
    ];
    for (descriptor, expected) in cases {
        assert_eq!(names(&p, "d", &[descriptor]), *expected, "{descriptor:?}");
    }
}

#[test]
fn limits_sharing_a_condition_are_filed_under_their_rarest_one() {
    let mut text = String::from("limits:\n");
    for i in 0..50 {
        text.push_str(&format!(
            "  - name: r{i}\n    domain: d\n    when: {{method: POST, route: /r{i}}}\n    key: [user, tenant]\n    capacity: 1\n    refill: 1/s\n"
        ));
    }
    for i in 0..3 {
        text.push_str(&format!(
            "  - name: t{i}\n    domain: d\n    key: [tenant, user{i}]\n    capacity: 1\n    refill: 1/s\n"
        ));
    }
    let p = compile("x.yaml", &text).unwrap_or_else(|e| panic!("{e}"));
    let d = [
        ("method", "POST"),
        ("route", "/r7"),
        ("user", "u"),
        ("tenant", "t"),
        ("user1", "v"),
    ];
    assert_eq!(names(&p, "d", &[&d]), ["r7|u|t@0", "t1|t|v@0"]);
    let d = [("route", "/r7"), ("user", "u"), ("tenant", "t")];
    assert_eq!(names(&p, "d", &[&d]), Vec::<String>::new());
}

#[test]
fn the_documented_example_is_a_valid_policy() {
    let doc = include_str!("../../../docs/policy.md");
    let start = doc
        .find("```yaml\n")
        .map(|i| i + "```yaml\n".len())
        .unwrap_or_default();
    let end = doc[start..].find("```").map_or(doc.len(), |i| start + i);
    let p = compile("docs/policy.md", &doc[start..end]).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(p.version(), "2026-11-30.1");
    assert_eq!(p.limits().len(), 7);
    assert_eq!(p.limits()[6].algorithm(), "sliding_window");
    // The partner plan's limit takes the place of per-tenant.
    let partner = [("tenant", "globex"), ("plan", "partner")];
    let keys: Vec<String> = p
        .matches("api", &[partner], NOW)
        .into_iter()
        .map(|m| m.bucket_key)
        .collect();
    assert_eq!(keys, ["partner-tenants|globex"]);
    let pay = [
        ("route", "/v1/payments"),
        ("method", "POST"),
        ("tenant", "globex"),
        ("user", "u1"),
        ("tier", "premium"),
    ];
    let m = p.matches("api", &[pay], NOW);
    assert_eq!(m[0].bucket_key, "payments-per-user|globex|u1#premium");
    assert_eq!(m[0].params().capacity(), 200);
    // Staff are out of payments-per-user altogether; per-tenant still counts them.
    let staff = [pay[0], pay[1], pay[2], pay[3], ("tier", "staff")];
    let keys: Vec<String> = p
        .matches("api", &[staff], NOW)
        .into_iter()
        .map(|m| m.bucket_key)
        .collect();
    assert_eq!(keys, ["per-tenant|globex"]);
    // The banned tier is denied by payments-per-user; the block list denies its addresses
    // but the one it makes an exception of.
    let banned = [pay[0], pay[1], pay[2], pay[3], ("tier", "banned")];
    let m = p.matches("api", &[banned], NOW);
    assert!(m[0].denied && m[0].bucket_key.ends_with("#banned"));
    let denied = |address: &str| {
        let m = p.matches("edge", &[[("remote_address", address)]], NOW);
        m.iter()
            .map(|m| (m.limit.name().to_owned(), m.denied))
            .collect::<Vec<_>>()
    };
    let blocked = || ("blocked-addresses".to_owned(), true);
    let per_ip = || ("per-ip".to_owned(), false);
    assert_eq!(denied("203.0.113.7"), [blocked(), per_ip()]);
    assert_eq!(denied("203.0.113.9"), [per_ip()]);
    assert_eq!(denied("198.51.100.1"), [per_ip()]);
    // The list's other prefix and its value.
    assert_eq!(denied("198.51.100.77"), [blocked(), per_ip()]);
    assert_eq!(denied("192.0.2.10"), [blocked(), per_ip()]);
    assert_eq!(denied("192.0.2.100"), [per_ip()]);
    // Its networks, IPv6 among them.
    assert_eq!(denied("2001:db8:bad::1"), [blocked(), per_ip()]);
    assert_eq!(denied("2001:db8:bae::1"), [per_ip()]);
    let before_expiry = UnixTime::from_secs(1_790_000_000);
    let acme = [
        ("route", "/v1/payments"),
        ("method", "POST"),
        ("tenant", "acme"),
        ("user", "u1"),
    ];
    assert!(matches!(
        p.matches("api", &[acme], before_expiry)[0].effect,
        Effect::Exempt(_)
    ));
}

const MIXED: &str = r#"
defaults:
  failure_mode: open
  emergency: 2/s
limits:
  - name: per-user
    domain: api
    key: [user]
    capacity: 10
    refill: 1/s
  - name: exports
    domain: api
    when: {route: /v1/export}
    key: [tenant]
    algorithm: concurrency
    max_in_flight: 3
    lease_timeout: 30s
    emergency: 1
    overrides:
      - name: big
        when: {tier: big}
        max_in_flight: 20
      - name: slow
        when: {tier: slow}
        lease_timeout: 2m
  - name: gpu
    domain: api
    key: [tenant]
    algorithm: concurrency
    max_in_flight: 2
    lease_timeout: 500ms
    failure_mode: closed
    mode: shadow
exemptions:
  - limit: exports
    when: {tenant: acme}
    owner: ops@example.com
    reason: migration
    expires: 2028-01-01T00:00:00Z
"#;

#[test]
fn concurrency_limits_are_matched_apart_from_rate_limits() {
    let p = compile("p.yaml", MIXED).unwrap_or_else(|e| panic!("{e}"));
    let exports = p.limit("exports").unwrap_or_else(|| panic!("missing"));
    assert_eq!(exports.algorithm(), "concurrency");
    assert!(exports.rate().is_none());
    let own = exports
        .concurrency()
        .map(|l| (l.max_in_flight(), l.timeout_ms()));
    assert_eq!(own, Some((3, 30_000)));
    assert_eq!(
        exports.params().to_string(),
        "3 in flight, leases of 30000ms"
    );
    // An override sets one field; the other is the limit's.
    let big = exports.overrides()[0]
        .concurrency()
        .map(|l| (l.max_in_flight(), l.timeout_ms()));
    let slow = exports.overrides()[1]
        .concurrency()
        .map(|l| (l.max_in_flight(), l.timeout_ms()));
    assert_eq!((big, slow), (Some((20, 30_000)), Some((3, 120_000))));
    assert_eq!(
        exports.failure_mode(),
        FailureMode::OpenInFlight { emergency: Some(1) }
    );
    // The default rate is for rate limits: a concurrency limit failing open without its own
    // emergency keeps its own bound, and closed stays closed.
    assert_eq!(
        p.limit("gpu").map(|l| l.failure_mode()),
        Some(FailureMode::Closed)
    );
    let rate = p.limit("per-user").map(|l| l.failure_mode());
    assert!(matches!(rate, Some(FailureMode::Open { .. })), "{rate:?}");

    let export = [
        ("route", "/v1/export"),
        ("tenant", "t1"),
        ("user", "u"),
        ("tier", "big"),
    ];
    // Checks see the rate limits only.
    let checked: Vec<_> = p
        .matches("api", &[export], NOW)
        .iter()
        .map(|m| m.bucket_key.clone())
        .collect();
    assert_eq!(checked, ["per-user|u"]);
    // Leases see the concurrency limits only, by the same rules.
    let leased = p.lease_matches("api", &[export], NOW);
    let seen: Vec<_> = leased
        .iter()
        .map(|m| {
            (
                m.bucket_key.as_str(),
                m.params().max_in_flight(),
                m.effect.as_str(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [("exports|t1#big", 20, "enforce"), ("gpu|t1", 2, "shadow")]
    );
    // `when` must hold; the exemption lifts the limit until it expires.
    let other_route = [("route", "/v1/other"), ("tenant", "t1")];
    let names: Vec<_> = p
        .lease_matches("api", &[other_route], NOW)
        .iter()
        .map(|m| m.bucket_key.clone())
        .collect();
    assert_eq!(names, ["gpu|t1"]);
    // Into a buffer the caller reuses: appended after what it holds.
    let mut into = p.lease_matches("api", &[other_route], NOW);
    p.lease_match_into("api", &[export], NOW, &mut into);
    let keys: Vec<_> = into.iter().map(|m| m.bucket_key.as_str()).collect();
    assert_eq!(keys, ["gpu|t1", "exports|t1#big", "gpu|t1"]);
    let acme = [("route", "/v1/export"), ("tenant", "acme")];
    assert!(matches!(
        p.lease_matches("api", &[acme], NOW)[0].effect,
        Effect::Exempt(_)
    ));
    let after = UnixTime::from_secs(1_900_000_000);
    assert_eq!(
        p.lease_matches("api", &[acme], after)[0].effect,
        Effect::Enforce
    );
    assert!(p.lease_matches("edge", &[acme], NOW).is_empty());
}

#[test]
fn the_documented_concurrency_example_is_a_valid_policy() {
    let doc = include_str!("../../../docs/policy.md");
    let section = doc
        .find("### Concurrency limits")
        .unwrap_or_else(|| panic!("no concurrency section"));
    let start = doc[section..]
        .find("```yaml\n")
        .map(|i| section + i + "```yaml\n".len())
        .unwrap_or_else(|| panic!("no example"));
    let end = doc[start..].find("```").map_or(doc.len(), |i| start + i);
    let p = compile("docs/policy.md", &doc[start..end]).unwrap_or_else(|e| panic!("{e}"));
    assert!(p.limits().iter().all(|l| l.algorithm() == "concurrency"));
    let d = [
        ("route", "/v1/export"),
        ("tenant", "acme"),
        ("plan", "enterprise"),
    ];
    let m = p.lease_matches("api", &[d], NOW);
    assert_eq!(m[0].bucket_key, "exports-in-flight|acme#enterprise");
    assert_eq!(m[0].params().max_in_flight(), 20);
    assert_eq!(m[1].effect, Effect::Shadow);
    assert_eq!(
        p.limits()[0].failure_mode(),
        FailureMode::OpenInFlight { emergency: Some(2) }
    );
    assert!(p.matches("api", &[d], NOW).is_empty());
}

#[test]
fn global_scope_is_read_and_its_store_keys_are_recognised() {
    let policy = compile(
        "p.yaml",
        "limits:\n  - name: per-tenant\n    domain: api\n    key: [tenant]\n    capacity: 10\n    refill: 1/s\n    scope: global\n  - name: per-user\n    domain: api\n    key: [user]\n    capacity: 10\n    refill: 1/s\n  - name: all\n    domain: api\n    capacity: 10\n    refill: 1/s\n    algorithm: gcra\n    scope: global\n",
    )
    .unwrap();
    let scopes: Vec<_> = policy.limits().iter().map(|l| l.scope().as_str()).collect();
    assert_eq!(scopes, ["global", "regional", "global"]);
    assert!(policy.has_global());
    assert!(policy.is_global_key("per-tenant|{acme}@0000002a"));
    assert!(policy.is_global_key("per-tenant|{acme}#gold@0000002a"));
    assert!(policy.is_global_key("{all}@0000002a"));
    assert!(!policy.is_global_key("per-user|{acme}@0000002a"));
    // A name that merely starts like a global one is another limit.
    assert!(!policy.is_global_key("per-tenant-x|{acme}@0000002a"));
    assert!(!policy.is_global_key(""));
    let regional = compile(
        "p.yaml",
        "limits:\n  - name: a\n    domain: api\n    capacity: 1\n    refill: 1/s\n",
    )
    .unwrap();
    assert!(!regional.has_global());
}

#[test]
fn an_unlimited_override_leaves_requests_out_of_a_concurrency_limit_too() {
    let text = "limits:\n  - name: exports\n    domain: api\n    key: [tenant]\n    algorithm: concurrency\n    max_in_flight: 2\n    lease_timeout: 30s\n    overrides:\n      - when: {tenant: internal}\n        unlimited: true\n";
    let p = compile("p.yaml", text).unwrap_or_else(|e| panic!("{e}"));
    let leases = |tenant: &str| p.lease_matches("api", &[[("tenant", tenant)]], NOW).len();
    assert_eq!((leases("acme"), leases("internal")), (1, 0));
    let o = &p.limits()[0].overrides()[0];
    assert!(o.unlimited() && o.concurrency().is_none());
}

/// A list of values matches any of them, in a limit, an override and an exemption, found
/// through the index under each value (a limit with a list is filed under every value in it).
#[test]
fn a_list_of_values_matches_any_of_them() {
    let p = compile(
        "p.yaml",
        r#"
limits:
  - name: reads
    domain: api
    when: {method: [GET, HEAD, "01"]}
    key: [user]
    capacity: 100
    refill: 10/s
    overrides:
      - name: bulk
        when: {tier: [batch, bulk]}
        capacity: 1000
  - name: blocked
    domain: api
    when: {tenant: [evil, worse]}
    key: [tenant]
    deny: true
  - name: one
    domain: api
    when: {method: [POST]}
    key: [user]
    capacity: 5
    refill: 1/s
exemptions:
  - limit: reads
    when: {user: [ops, sre]}
    owner: ops@example.com
    reason: tooling
    expires: 2099-01-01T00:00:00Z
"#,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let keys = |d: &[(&str, &str)]| -> Vec<(String, bool)> {
        p.matches("api", &[d], NOW)
            .iter()
            .map(|m| (m.bucket_key.clone(), matches!(m.effect, Effect::Exempt(_))))
            .collect()
    };
    let key = |k: &str| (k.to_owned(), false);
    assert_eq!(keys(&[("method", "GET"), ("user", "u")]), [key("reads|u")]);
    assert_eq!(keys(&[("method", "HEAD"), ("user", "u")]), [key("reads|u")]);
    // Taken as written: "01", not 1.
    assert_eq!(keys(&[("method", "01"), ("user", "u")]), [key("reads|u")]);
    assert_eq!(keys(&[("method", "1"), ("user", "u")]), []);
    assert_eq!(keys(&[("method", "PUT"), ("user", "u")]), []);
    // A list of one value is that value.
    assert_eq!(keys(&[("method", "POST"), ("user", "u")]), [key("one|u")]);
    let one = &p.limits()[2];
    assert!(matches!(one.when().next(), Some((_, ValueMatch::Exact(v))) if &**v == "POST"));
    // The override's list.
    for tier in ["batch", "bulk"] {
        let d = [("method", "GET"), ("user", "u"), ("tier", tier)];
        assert_eq!(keys(&d), [key("reads|u#bulk")], "{tier}");
    }
    // The exemption's list.
    for user in ["ops", "sre"] {
        let d = [("method", "GET"), ("user", user)];
        assert_eq!(keys(&d), [(format!("reads|{user}"), true)], "{user}");
    }
    // A block list of tenants.
    let d = [("tenant", "worse")];
    let m = p.matches("api", &[d], NOW);
    assert_eq!((m.len(), m[0].denied), (1, true));
    assert!(p.matches("api", &[[("tenant", "good")]], NOW).is_empty());
}

/// A block list of thousands of values is one limit, filed under each value: a request costs
/// the same lookups as against a limit of one value, and every listed value (and only those)
/// matches.
#[test]
fn a_long_list_is_filed_under_every_value() {
    let listed: Vec<String> = (0..5_000)
        .map(|i| format!("10.0.{}.{}", i / 256, i % 256))
        .collect();
    let text = format!(
        "limits:\n  - name: blocked\n    domain: edge\n    when: {{ip: [{}]}}\n    key: [ip]\n    deny: true\n",
        listed.join(", ")
    );
    let p = compile("p.yaml", &text).unwrap_or_else(|e| panic!("{e}"));
    for ip in &listed {
        let m = p.matches("edge", &[[("ip", ip.as_str())]], NOW);
        assert_eq!(m.len(), 1, "{ip}");
    }
    for ip in ["10.0.19.136", "10.0.0", "10.0.0.1.2", ""] {
        assert!(p.matches("edge", &[[("ip", ip)]], NOW).is_empty(), "{ip}");
    }
}

/// Lint reads a list as the values it holds: an override whose list lies within an earlier
/// override's is unreachable, and a value ending in `*` in a list is named.
#[test]
fn lint_reads_lists_as_their_values() {
    let p = compile(
        "p.yaml",
        r#"
limits:
  - name: reads
    domain: api
    key: [user]
    capacity: 100
    refill: 10/s
    overrides:
      - {name: wide, when: {tier: [a, b, c]}, capacity: 5}
      - {name: narrow, when: {tier: [a, c]}, capacity: 7}
      - {name: other, when: {tier: [c, d]}, capacity: 9}
      - {name: star, when: {path: [/x, "/api/*"]}, capacity: 3}
"#,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let warnings: Vec<String> = tollgate_policy::lint(&p, NOW)
        .iter()
        .map(ToString::to_string)
        .collect();
    let about = |name: &str| warnings.iter().filter(|w| w.contains(name)).count();
    assert_eq!(about("narrow"), 1, "{warnings:?}");
    assert_eq!(about("\"other\""), 0, "{warnings:?}");
    assert!(
        warnings.iter().any(|w| w.contains("/api/*")),
        "{warnings:?}"
    );
}

/// A list can hold prefixes beside values (`[/health, !prefix /internal/]`): in a limit, an
/// override and an exemption, found through the index under each item, and once only.
#[test]
fn a_list_with_prefixes_matches_its_values_and_what_starts_with_its_prefixes() {
    let p = compile(
        "p.yaml",
        r#"
limits:
  - name: private
    domain: api
    when: {path: [/health, !prefix /internal/, !prefix /admin, !prefix /admin/users]}
    key: [user]
    capacity: 10
    refill: 1/s
    overrides:
      - name: ops-tools
        when: {path: [!prefix /admin/tools/, /internal/status]}
        capacity: 100
  - name: blocked-ranges
    domain: api
    when: {ip: [!prefix 203.0.113., !prefix 198.51.100., 192.0.2.7]}
    key: [ip]
    deny: true
exemptions:
  - limit: private
    when: {user: [!prefix svc-, root]}
    owner: ops@example.com
    reason: internal callers
    expires: 2099-01-01T00:00:00Z
"#,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let keys = |d: &[(&str, &str)]| -> Vec<(String, bool)> {
        p.matches("api", &[d], NOW)
            .iter()
            .map(|m| (m.bucket_key.clone(), matches!(m.effect, Effect::Exempt(_))))
            .collect()
    };
    let key = |k: &str| vec![(k.to_owned(), false)];
    for path in [
        "/health",
        "/internal/",
        "/internal/x",
        "/admin",
        "/admin/users/7",
        "/adminx",
    ] {
        assert_eq!(
            keys(&[("path", path), ("user", "u")]),
            key("private|u"),
            "{path}"
        );
    }
    for path in ["/healthz", "/internal", "/admi", "/", ""] {
        assert!(keys(&[("path", path), ("user", "u")]).is_empty(), "{path}");
    }
    // The override: a prefix and a value of its own list.
    for path in ["/admin/tools/x", "/internal/status"] {
        let d = [("path", path), ("user", "u")];
        assert_eq!(keys(&d), key("private|u#ops-tools"), "{path}");
    }
    // The exemption: a prefix and a value.
    for user in ["svc-export", "root"] {
        let d = [("path", "/health"), ("user", user)];
        assert_eq!(keys(&d), [(format!("private|{user}"), true)], "{user}");
    }
    // A block list of ranges, as written: a prefix is text, not an address range.
    for ip in ["203.0.113.9", "198.51.100.200", "192.0.2.7"] {
        let m = p.matches("api", &[[("ip", ip)]], NOW);
        assert_eq!(
            (m.len(), m.first().map(|m| m.denied)),
            (1, Some(true)),
            "{ip}"
        );
    }
    for ip in ["192.0.2.70", "203.0.114.1", "203.0.113"] {
        assert!(p.matches("api", &[[("ip", ip)]], NOW).is_empty(), "{ip}");
    }
    // What a shorter prefix covers is left out of the list in force.
    let Some((_, ValueMatch::AnyOf(list))) = p.limits()[0].when().next() else {
        panic!("{:?}", p.limits()[0]);
    };
    let texts = |items: &[Box<str>]| items.iter().map(|i| i.to_string()).collect::<Vec<_>>();
    assert_eq!(texts(list.values()), ["/health"]);
    assert_eq!(texts(list.prefixes()), ["/admin", "/internal/"]);
}

/// `ValueMatch::any_of` keeps the list's items apart: no value or prefix covered by another
/// prefix, a list of one item is that item.
#[test]
fn a_list_comes_down_to_the_items_nothing_else_covers() {
    let b = |items: &[&str]| items.iter().map(|&i| i.into()).collect::<Vec<Box<str>>>();
    assert_eq!(ValueMatch::any_of(b(&[]), b(&[]), vec![]), None);
    assert_eq!(
        ValueMatch::any_of(b(&["a", "a"]), b(&[]), vec![]),
        Some(ValueMatch::Exact("a".into()))
    );
    assert_eq!(
        ValueMatch::any_of(b(&["ab", "abc"]), b(&["ab", "a"]), vec![]),
        Some(ValueMatch::Prefix("a".into()))
    );
    // The empty prefix covers every value.
    assert_eq!(
        ValueMatch::any_of(b(&["x"]), b(&["", "y"]), vec![]),
        Some(ValueMatch::Prefix("".into()))
    );
    let Some(ValueMatch::AnyOf(list)) =
        ValueMatch::any_of(b(&["b", "ax", "c"]), b(&["bb", "a"]), vec![])
    else {
        panic!("a list");
    };
    // `b` stays: the prefix `bb` does not cover it.
    assert_eq!(list.values(), &*b(&["b", "c"]));
    assert_eq!(list.prefixes(), &*b(&["a", "bb"]));
}

/// Through the index, the limits that apply are those whose items as written match: random
/// lists of values and prefixes over a small alphabet (so that they overlap and cover each
/// other), random values.
#[test]
fn lists_with_prefixes_are_found_through_the_index_as_a_scan_finds_them() {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};

    let item = || "[ab]{0,3}";
    let list = || {
        (
            prop::collection::vec(item(), 0..4),
            prop::collection::vec(item(), 0..4),
        )
    };
    let mut runner = TestRunner::new(Config::with_cases(300));
    let strategy = (
        prop::collection::vec(list(), 1..6),
        prop::collection::vec(item(), 1..20),
    );
    runner
        .run(&strategy, |(lists, values)| {
            let items: Vec<Vec<String>> = lists
                .iter()
                .map(|(exact, prefixes)| {
                    let exact = exact.iter().map(|v| format!("'{v}'"));
                    exact
                        .chain(prefixes.iter().map(|p| format!("!prefix '{p}'")))
                        .collect()
                })
                .collect();
            // By the items as written, not by the list in force.
            index_finds_what_holds(&items, &values, |i, value| {
                let (exact, prefixes) = &lists[i];
                exact.iter().any(|v| v == value) || prefixes.iter().any(|p| value.starts_with(p))
            })
        })
        .unwrap_or_else(|e| panic!("{e}"));
}

/// Compiles a limit `l{i}` per non-empty list of `items` (`when: {k: [items]}`, each as the
/// file writes it) and checks that matching `k: value` finds, in order, exactly the limits
/// whose list `holds(i, value)`, for every value: the index against the items as written.
fn index_finds_what_holds(
    items: &[Vec<String>],
    values: &[String],
    holds: impl Fn(usize, &str) -> bool,
) -> Result<(), proptest::test_runner::TestCaseError> {
    use proptest::prelude::*;

    let mut text = String::from("limits:\n");
    for (i, list) in items.iter().enumerate().filter(|(_, l)| !l.is_empty()) {
        text.push_str(&format!(
            "  - name: l{i}\n    domain: d\n    when: {{k: [{}]}}\n    capacity: 1\n    refill: 1/s\n",
            list.join(", ")
        ));
    }
    if items.iter().all(Vec::is_empty) {
        return Ok(());
    }
    let p = compile("p.yaml", &text).map_err(|e| TestCaseError::fail(e.to_string()))?;
    for value in values {
        let found: Vec<String> = p
            .matches("d", &[[("k", value.as_str())]], NOW)
            .iter()
            .map(|m| m.limit.name().to_owned())
            .collect();
        let expected: Vec<String> = (0..items.len())
            .filter(|&i| !items[i].is_empty() && holds(i, value))
            .map(|i| format!("l{i}"))
            .collect();
        prop_assert_eq!(&found, &expected, "{} for {:?}", text, value);
    }
    Ok(())
}

/// `!cidr` matches the IP addresses inside a network, IPv4 and IPv6, alone or in a list, in a
/// limit, an override and an exemption; a value that is not an address alone matches no
/// network.
#[test]
fn a_network_matches_the_addresses_inside_it() {
    let p = compile(
        "p.yaml",
        r#"
limits:
  - name: blocked
    domain: edge
    when: {ip: [!cidr 203.0.113.0/24, !cidr 2001:db8::/32, !cidr 198.51.100.0/22, 192.0.2.7, 203.0.113.9]}
    key: [ip]
    deny: true
  - name: per-ip
    domain: edge
    key: [ip]
    capacity: 10
    refill: 1/s
    overrides:
      - name: office
        when: {ip: !cidr 10.20.0.0/16}
        capacity: 100
  - name: internal
    domain: edge
    when: {ip: !cidr 10.0.0.0/8}
    capacity: 1000
    refill: 100/s
exemptions:
  - limit: per-ip
    when: {ip: [!cidr 10.99.0.0/16, !cidr ::1/128]}
    owner: ops@example.com
    reason: probes
    expires: 2099-01-01T00:00:00Z
"#,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let found = |ip: &str| -> Vec<String> {
        p.matches("edge", &[[("ip", ip)]], NOW)
            .iter()
            .map(|m| match m.effect {
                Effect::Exempt(_) => format!("{}:exempt", m.bucket_key),
                _ => m.bucket_key.clone(),
            })
            .collect()
    };
    for ip in [
        "203.0.113.0",
        "203.0.113.255",
        "2001:db8::1",
        "2001:db8:ffff::",
        "198.51.103.4",
        "192.0.2.7",
        "::ffff:203.0.113.5",
    ] {
        assert_eq!(found(ip)[0], format!("blocked|{ip}"), "{ip}");
    }
    for ip in ["203.0.114.0", "2001:db9::1", "198.51.104.1", "192.0.2.8"] {
        assert_eq!(found(ip), [format!("per-ip|{ip}")], "{ip}");
    }
    // Not an address alone: with a port, a name, a zone, text around it.
    for value in [
        "203.0.113.5:443",
        "host.example",
        "fe80::1%eth0",
        " 203.0.113.5",
        "",
    ] {
        assert!(
            found(value).iter().all(|k| k.starts_with("per-ip")),
            "{value}"
        );
    }
    // The override, and the limit beside it on the wider network.
    assert_eq!(found("10.20.3.4"), ["per-ip|10.20.3.4#office", "internal"]);
    assert_eq!(found("10.21.3.4"), ["per-ip|10.21.3.4", "internal"]);
    // The exemption's list.
    assert_eq!(found("10.99.1.1"), ["per-ip|10.99.1.1:exempt", "internal"]);
    assert_eq!(found("::1"), ["per-ip|::1:exempt"]);
    // What a network of the list holds is left out of it: 203.0.113.9 is in 203.0.113.0/24.
    let Some((_, ValueMatch::AnyOf(list))) = p.limits()[0].when().next() else {
        panic!("{:?}", p.limits()[0]);
    };
    assert_eq!(list.values().len(), 1);
    let networks: Vec<String> = list
        .networks()
        .iter()
        .map(|n| n.net().to_string())
        .collect();
    assert_eq!(
        networks,
        ["198.51.100.0/22", "203.0.113.0/24", "2001:db8::/32"]
    );
}

/// A network is written as one: an address and a length, no bits past the length.
#[test]
fn a_network_that_is_not_one_is_refused_with_its_position() {
    let limit = |when: &str| {
        format!(
            "limits:\n  - name: l\n    domain: d\n    when: {{ip: {when}}}\n    capacity: 1\n    refill: 1/s\n"
        )
    };
    for (when, needle) in [
        (
            "!cidr 10.1.2.3/8",
            "has bits set past its length: the network is 10.0.0.0/8",
        ),
        ("!cidr 10.0.0.0/33", "is not a network"),
        ("!cidr example.com/8", "is not a network"),
        ("!cidr ''", "is not a network"),
        ("[a, !cidr 2001:db8::1/32]", "the network is 2001:db8::/32"),
        ("[a, !cdr 10.0.0.0/8]", "unknown tag !cdr in a list"),
        ("!cdr 10.0.0.0/8", "`!cidr NETWORK`"),
    ] {
        let err = compile("p.yaml", &limit(when)).map(|_| ()).unwrap_err();
        let d = err.diagnostic().cloned().unwrap_or_else(|| panic!("{err}"));
        assert_eq!(
            (d.line, d.path.as_str()),
            (4, "limits[0].when.ip"),
            "{when}: {d}"
        );
        assert!(d.message.contains(needle), "{when}: {d}");
    }
    // A lone address is a network of one, and a mapped IPv6 network is the IPv4 one.
    let p = compile(
        "p.yaml",
        &limit("[!cidr 192.0.2.7, !cidr '::ffff:10.0.0.0/104']"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    for (ip, applies) in [
        ("192.0.2.7", true),
        ("10.9.9.9", true),
        ("192.0.2.8", false),
    ] {
        assert_eq!(
            !p.matches("d", &[[("ip", ip)]], NOW).is_empty(),
            applies,
            "{ip}"
        );
    }
}

/// Through the index, the limits that apply are those whose items as written match: random
/// lists of networks (nested, of both families), prefixes and values, random addresses.
#[test]
fn networks_are_found_through_the_index_as_a_scan_finds_them() {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};
    use std::net::IpAddr;

    // Few addresses, so that networks nest and values fall inside them.
    let v4 = || (0u8..3, 0u8..3).prop_map(|(a, b)| format!("10.{a}.0.{b}"));
    let v6 = || (0u16..3, 0u16..3).prop_map(|(a, b)| format!("2001:db8:{a}::{b}"));
    let address = move || prop_oneof![v4(), v6(), Just("::ffff:10.1.0.1".to_owned())];
    let network = move || {
        prop_oneof![
            (v4(), prop::sample::select(vec![8u8, 15, 16, 24, 31, 32])),
            (v6(), prop::sample::select(vec![32u8, 47, 48, 127, 128])),
        ]
        .prop_map(|(a, len)| {
            let net = ipnet::IpNet::new(a.parse::<IpAddr>().unwrap_or(IpAddr::from([0; 4])), len);
            net.map(|n| n.trunc().to_string()).unwrap_or_default()
        })
    };
    let list = move || {
        (
            prop::collection::vec(address(), 0..3),
            prop::collection::vec(prop::sample::select(vec!["10.", "10.1", "2001:", ""]), 0..2),
            prop::collection::vec(network(), 0..4),
        )
    };
    let mut runner = TestRunner::new(Config::with_cases(300));
    let strategy = (
        prop::collection::vec(list(), 1..5),
        prop::collection::vec(address(), 1..12),
    );
    runner
        .run(&strategy, |(lists, values)| {
            let items: Vec<Vec<String>> = lists
                .iter()
                .map(|(exact, prefixes, nets)| {
                    let exact = exact.iter().map(|v| format!("'{v}'"));
                    exact
                        .chain(prefixes.iter().map(|p| format!("!prefix '{p}'")))
                        .chain(nets.iter().map(|n| format!("!cidr '{n}'")))
                        .collect()
                })
                .collect();
            index_finds_what_holds(&items, &values, |i, value| {
                let (exact, prefixes, nets) = &lists[i];
                let canonical = value.parse::<IpAddr>().ok().map(|a| a.to_canonical());
                exact.iter().any(|v| v == value)
                    || prefixes.iter().any(|p| value.starts_with(p))
                    || nets.iter().any(|n| {
                        let net: ipnet::IpNet = n.parse().unwrap_or_default();
                        canonical.is_some_and(|a| net.contains(&a))
                    })
            })
        })
        .unwrap_or_else(|e| panic!("{e}"));
}
