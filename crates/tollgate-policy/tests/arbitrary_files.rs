//! Arbitrary policy files: YAML built near the real schema, every field sometimes given a
//! wrong value, a wrong type or a wrong name, then some files cut short or with a character
//! changed. A file is compiled or refused, never a panic; a refusal points at a place in the
//! file; and a compiled one is linted and decides random requests, checks and leases, without
//! a panic either, each decision within its limit's capacity. envoyproxy/ratelimit
//! configurations, built and broken the same way, are imported into a policy the compiler
//! takes, or refused.
//!
//! A file the compiler takes is valid under the policy file's JSON Schema, and so is what an
//! import writes: an editor never flags a good file.
//!
//! `errors.rs` holds each refusal by name; this holds the compiler and the engine against
//! files nobody thought to write.

mod support;

use std::sync::Arc;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use tollgate::ManualClock;
use tollgate_policy::{EngineOptions, ManualWallClock, PolicyEngine, UnixTime, compile, lint};

/// 2026-09-21: some exemptions in the files have expired, some have not.
const NOW: UnixTime = UnixTime::from_secs(1_790_000_000);

/// `right` mostly, else `wrong`.
fn mostly(right: Vec<&'static str>, wrong: Vec<&'static str>) -> BoxedStrategy<String> {
    prop_oneof![
        8 => prop::sample::select(right).prop_map(str::to_owned),
        1 => prop::sample::select(wrong).prop_map(str::to_owned),
    ]
    .boxed()
}

/// The entries requests and files name, and their values.
const ENTRIES: [&str; 4] = ["user", "tenant", "remote_address", "tier"];
const VALUES: [&str; 5] = ["u1", "acme", "10.1.2.3", "premium", "2001:db8::1"];

fn value() -> BoxedStrategy<String> {
    mostly(
        vec![
            "u1",
            "acme",
            "premium",
            "[u1, acme]",
            "!prefix 10.",
            "!cidr 10.0.0.0/8",
            "!cidr 2001:db8::/32",
            "\"10.1.2.3\"",
        ],
        vec![
            "",
            "!cidr 10.0.0.0/40",
            "!cidr nonsense",
            "!prefix",
            "!regex .*",
            "[]",
            "{a: b}",
            "7",
            "null",
            "~",
            "u*",
        ],
    )
}

fn when() -> BoxedStrategy<String> {
    let entry = (
        mostly(ENTRIES.to_vec(), vec!["", "\"\"", "a b", "ü"]),
        value(),
    );
    prop::collection::vec(entry, 0..3)
        .prop_map(|entries| {
            let pairs: Vec<String> = entries.iter().map(|(k, v)| format!("{k}: {v}")).collect();
            format!("{{{}}}", pairs.join(", "))
        })
        .boxed()
}

fn name() -> BoxedStrategy<String> {
    prop_oneof![
        8 => prop::sample::select(vec!["a", "b", "per-user", "c.d_e"]).prop_map(str::to_owned),
        1 => prop_oneof![
            Just(String::new()),
            Just("bad name".to_owned()),
            Just("n".repeat(129)),
            Just("ü".to_owned()),
            Just("7".to_owned()),
        ],
    ]
    .boxed()
}

fn rate() -> BoxedStrategy<String> {
    mostly(
        vec![
            "10/s",
            "600/m",
            "5/100ms",
            "1/d",
            "9/7ns",
            "1000000000/s",
            "3/h",
        ],
        vec![
            "0/s",
            "10/0s",
            "10/x",
            "\"\"",
            "1/99999999999999999999d",
            "18446744073709551616/s",
            "-1/s",
            "1.5/s",
            "10",
            "/s",
            "10/",
            "4294967296/ns",
        ],
    )
}

fn number() -> BoxedStrategy<String> {
    mostly(
        vec!["1", "5", "20", "1000", "4294967295"],
        vec![
            "0",
            "-1",
            "1.5",
            "\"20\"",
            "18446744073709551616",
            "99999999999999999999999",
            "null",
            "[1]",
            "1e3",
        ],
    )
}

fn duration() -> BoxedStrategy<String> {
    mostly(
        vec!["100ms", "30s", "1m", "1h", "1d"],
        vec![
            "0s",
            "1.5s",
            "7ns",
            "25h",
            "-1s",
            "99999999999999999999d",
            "s",
            "10",
        ],
    )
}

/// One field of a limit or an override, as `name: value`.
fn limit_field() -> BoxedStrategy<String> {
    prop_oneof![
        when().prop_map(|w| format!("when: {w}")),
        prop::collection::vec(mostly(ENTRIES.to_vec(), vec!["", "a b"]), 0..3)
            .prop_map(|k| format!("key: [{}]", k.join(", "))),
        mostly(vec!["true", "false"], vec!["yes", "1"]).prop_map(|v| format!("exact: {v}")),
        number().prop_map(|v| format!("capacity: {v}")),
        rate().prop_map(|v| format!("refill: {v}")),
        mostly(
            vec![
                "token_bucket",
                "gcra",
                "fixed_window",
                "sliding_window",
                "sliding_log",
                "concurrency"
            ],
            vec!["leaky_bucket", "", "TOKEN_BUCKET"],
        )
        .prop_map(|v| format!("algorithm: {v}")),
        number().prop_map(|v| format!("limit: {v}")),
        duration().prop_map(|v| format!("window: {v}")),
        number().prop_map(|v| format!("max_in_flight: {v}")),
        duration().prop_map(|v| format!("lease_timeout: {v}")),
        mostly(vec!["enforce", "shadow"], vec!["off", ""]).prop_map(|v| format!("mode: {v}")),
        mostly(
            vec!["0%", "10%", "12.5%", "100%"],
            vec!["101%", "-1%", "12.345%", "abc", "50", "%"],
        )
        .prop_map(|v| format!("rollout: {v}")),
        mostly(vec!["open", "closed"], vec!["half", ""]).prop_map(|v| format!("failure_mode: {v}")),
        prop_oneof![rate(), number()].prop_map(|v| format!("emergency: {v}")),
        mostly(vec!["regional", "global"], vec!["world"]).prop_map(|v| format!("scope: {v}")),
        mostly(vec!["ignore", "apply"], vec!["maybe"]).prop_map(|v| format!("request_limit: {v}")),
        mostly(vec!["true", "false"], vec!["1"]).prop_map(|v| format!("deny: {v}")),
        mostly(vec!["true", "false"], vec!["1"]).prop_map(|v| format!("unlimited: {v}")),
        prop::collection::vec(name(), 0..3).prop_map(|n| format!("replaces: [{}]", n.join(", "))),
        Just("unknown_field: 1".to_owned()),
    ]
    .boxed()
}

/// A limit: its name, domain and key mostly, and other fields, some of them overrides.
fn limit() -> BoxedStrategy<String> {
    let overrides = prop::collection::vec(
        (
            prop::option::of(name()),
            prop::option::weighted(0.9, when()),
            prop::collection::vec(limit_field(), 0..3),
        ),
        0..3,
    );
    (
        prop::option::weighted(0.95, name()),
        prop::option::weighted(0.95, mostly(vec!["api", "edge"], vec!["", "\"\""])),
        prop::option::weighted(
            0.9,
            prop::collection::vec(mostly(ENTRIES.to_vec(), vec![""]), 1..3),
        ),
        prop::collection::vec(limit_field(), 0..6),
        prop::option::weighted(0.3, overrides),
    )
        .prop_map(|(name, domain, key, fields, overrides)| {
            let mut lines = Vec::new();
            if let Some(name) = name {
                lines.push(format!("name: {name}"));
            }
            if let Some(domain) = domain {
                lines.push(format!("domain: {domain}"));
            }
            if let Some(key) = key {
                lines.push(format!("key: [{}]", key.join(", ")));
            }
            lines.extend(fields);
            let mut text = String::new();
            for (i, line) in lines.iter().enumerate() {
                let lead = if i == 0 { "  - " } else { "    " };
                text.push_str(&format!("{lead}{line}\n"));
            }
            if text.is_empty() {
                text.push_str("  - {}\n");
            }
            if let Some(overrides) = overrides {
                text.push_str("    overrides:\n");
                for (name, when, fields) in overrides {
                    let mut lines = Vec::new();
                    lines.extend(name.map(|n| format!("name: {n}")));
                    lines.extend(when.map(|w| format!("when: {w}")));
                    lines.extend(fields);
                    if lines.is_empty() {
                        lines.push("{}".to_owned());
                    }
                    for (i, line) in lines.iter().enumerate() {
                        let lead = if i == 0 { "      - " } else { "        " };
                        text.push_str(&format!("{lead}{line}\n"));
                    }
                }
            }
            text
        })
        .boxed()
}

fn exemption() -> BoxedStrategy<String> {
    (
        prop::option::weighted(0.95, name()),
        prop::option::weighted(0.9, when()),
        prop::option::weighted(0.95, mostly(vec!["ops@example.com"], vec!["\"\""])),
        prop::option::weighted(0.95, mostly(vec!["launch week"], vec!["\"\""])),
        prop::option::weighted(
            0.95,
            mostly(
                vec![
                    "2026-12-31T00:00:00Z",
                    "2026-01-01T00:00:00+02:00",
                    "2030-06-01T12:00:00Z",
                ],
                vec![
                    "2026-13-01T00:00:00Z",
                    "tomorrow",
                    "2026-12-31",
                    "99999-01-01T00:00:00Z",
                ],
            ),
        ),
    )
        .prop_map(|(limit, when, owner, reason, expires)| {
            let mut lines = Vec::new();
            lines.extend(limit.map(|v| format!("limit: {v}")));
            lines.extend(when.map(|v| format!("when: {v}")));
            lines.extend(owner.map(|v| format!("owner: {v}")));
            lines.extend(reason.map(|v| format!("reason: {v}")));
            lines.extend(expires.map(|v| format!("expires: {v}")));
            if lines.is_empty() {
                lines.push("{}".to_owned());
            }
            let mut text = String::new();
            for (i, line) in lines.iter().enumerate() {
                let lead = if i == 0 { "  - " } else { "    " };
                text.push_str(&format!("{lead}{line}\n"));
            }
            text
        })
        .boxed()
}

/// A whole file, then maybe cut short or with a character changed.
fn file() -> impl Strategy<Value = String> {
    let defaults = prop::collection::vec(
        prop_oneof![
            mostly(vec!["enforce", "shadow"], vec!["x"]).prop_map(|v| format!("mode: {v}")),
            mostly(vec!["open", "closed"], vec!["x"]).prop_map(|v| format!("failure_mode: {v}")),
            prop_oneof![rate(), number()].prop_map(|v| format!("emergency: {v}")),
            Just("capacity: 5".to_owned()),
        ],
        0..3,
    );
    let text = (
        prop::option::weighted(
            0.5,
            mostly(
                vec!["\"v1\"", "2026-11-30.1", "7"],
                vec!["\"\"", "[1]", "{a: b}"],
            ),
        ),
        prop::option::weighted(0.3, defaults),
        prop::option::weighted(0.97, prop::collection::vec(limit(), 0..4)),
        prop::option::weighted(0.2, prop::collection::vec(exemption(), 0..3)),
    )
        .prop_map(|(version, defaults, limits, exemptions)| {
            let mut text = String::new();
            if let Some(version) = version {
                text.push_str(&format!("version: {version}\n"));
            }
            if let Some(defaults) = defaults {
                text.push_str("defaults:\n");
                if defaults.is_empty() {
                    text.push_str("  {}\n");
                }
                for field in defaults {
                    text.push_str(&format!("  {field}\n"));
                }
            }
            if let Some(limits) = limits {
                if limits.is_empty() {
                    text.push_str("limits: []\n");
                } else {
                    text.push_str("limits:\n");
                    limits.iter().for_each(|l| text.push_str(l));
                }
            }
            if let Some(exemptions) = exemptions {
                text.push_str("exemptions:\n");
                exemptions.iter().for_each(|e| text.push_str(e));
                if exemptions.is_empty() {
                    text.push_str("  []\n");
                }
            }
            text
        });
    (text, 0u8..12, any::<prop::sample::Index>(), any::<char>()).prop_map(|(text, how, at, c)| {
        let mut chars: Vec<char> = text.chars().collect();
        match how {
            0 if !chars.is_empty() => chars.truncate(at.index(chars.len())),
            1 if !chars.is_empty() => {
                let i = at.index(chars.len());
                chars[i] = c;
            }
            2 if !chars.is_empty() => chars.insert(at.index(chars.len()), ' '),
            _ => {}
        }
        chars.into_iter().collect()
    })
}

/// A request: a domain, descriptors of the entries the files name, and a cost.
type Request = (String, Vec<Vec<(String, String)>>, u64);

fn request() -> impl Strategy<Value = Request> {
    let pair = (
        prop::sample::select(ENTRIES.to_vec()),
        prop::sample::select(VALUES.to_vec()),
    )
        .prop_map(|(k, v)| (k.to_owned(), v.to_owned()));
    (
        prop::sample::select(vec!["api", "edge", "other"]).prop_map(str::to_owned),
        prop::collection::vec(prop::collection::vec(pair, 1..4), 1..3),
        0u64..6,
    )
}

/// What the run saw, to show that it reached both kinds of file.
#[derive(Debug, Default)]
struct Seen {
    compiled: usize,
    decided: usize,
    refused: usize,
    /// Refused files an editor flags too (the schema, or the YAML itself).
    flagged: usize,
}

fn one(seen: &mut Seen, text: &str, requests: &[Request]) -> Result<(), TestCaseError> {
    let policy = match compile("p.yaml", text) {
        Ok(policy) => policy,
        Err(err) => {
            seen.refused += 1;
            if support::schema_complaints(text).is_none_or(|c| !c.is_empty()) {
                seen.flagged += 1;
            }
            let Some(d) = err.diagnostic() else {
                return Err(TestCaseError::fail(format!("no diagnostic: {err}\n{text}")));
            };
            prop_assert_eq!(&d.file, "p.yaml");
            let lines = text.lines().count() as u64;
            prop_assert!(
                d.line <= lines + 1,
                "line {} of {lines}: {d}\n{text}",
                d.line
            );
            prop_assert!(!d.message.is_empty(), "{d}");
            return Ok(());
        }
    };
    seen.compiled += 1;
    prop_assert!(!policy.version().is_empty());
    let complaints = support::schema_complaints(text);
    prop_assert!(
        complaints.as_ref().is_some_and(Vec::is_empty),
        "the compiler takes it, the schema says {complaints:?}\n{text}"
    );
    let _ = lint(&policy, NOW);
    let options = EngineOptions::default()
        .clock(Arc::new(ManualClock::new()))
        .wall_clock(Arc::new(ManualWallClock::new(NOW)));
    let engine = PolicyEngine::new(policy, options);
    for (domain, descriptors, cost) in requests {
        if let Ok(outcome) = engine.decide(domain, descriptors, *cost, None) {
            seen.decided += 1;
            for limit in &outcome.limits {
                if let Some(decision) = limit.decision {
                    prop_assert!(
                        decision.remaining() <= decision.capacity(),
                        "{limit:?}\n{text}"
                    );
                }
            }
        }
        let _ = engine.explain(domain, descriptors, *cost);
        if engine.acquire(domain, descriptors, "lease-1").is_ok() {
            let _ = engine.release("lease-1");
        }
    }
    Ok(())
}

#[test]
fn any_file_is_compiled_or_refused_and_a_compiled_one_decides() {
    let mut runner = TestRunner::new(Config {
        cases: 3_000,
        failure_persistence: None,
        ..Config::default()
    });
    let seen = std::cell::RefCell::new(Seen::default());
    let cases = (file(), prop::collection::vec(request(), 1..6));
    let result = runner.run(&cases, |(text, requests)| {
        one(&mut seen.borrow_mut(), &text, &requests)
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
    let seen = seen.into_inner();
    assert!(
        seen.compiled >= 300 && seen.decided >= 300 && seen.refused >= 300,
        "{seen:?}"
    );
    // What only the compiler sees (a name no limit has, an amount past 2^64) is rare here:
    // an editor flags nearly every file the compiler refuses (98.9 to 99.3 % in six runs).
    assert!(seen.flagged * 100 >= seen.refused * 95, "{seen:?}");
}

/// An envoyproxy/ratelimit descriptor node, `depth` levels deep at most, as YAML lines
/// indented by `indent`.
fn envoy_node(depth: u32) -> BoxedStrategy<Vec<String>> {
    let rate_limit = (
        mostly(
            vec!["second", "minute", "hour", "day", "month", "year", "SECOND"],
            vec!["week", "", "7"],
        ),
        mostly(
            vec!["0", "1", "10", "600", "4294967295"],
            vec!["-1", "1.5", "\"10\"", "18446744073709551616"],
        ),
        prop::option::weighted(0.3, name()),
        prop::collection::vec(name(), 0..2),
        prop::bool::weighted(0.1),
    )
        .prop_map(|(unit, requests, name, replaces, unlimited)| {
            let mut fields = vec![
                format!("unit: {unit}"),
                format!("requests_per_unit: {requests}"),
            ];
            fields.extend(name.map(|n| format!("name: {n}")));
            if !replaces.is_empty() {
                let names: Vec<String> =
                    replaces.iter().map(|n| format!("{{name: {n}}}")).collect();
                fields.push(format!("replaces: [{}]", names.join(", ")));
            }
            if unlimited {
                fields.push("unlimited: true".to_owned());
            }
            format!("{{{}}}", fields.join(", "))
        });
    let long_key: &'static str = "k".repeat(300).leak();
    let long_value: &'static str = "v".repeat(2_000).leak();
    let leaf = (
        mostly(
            ENTRIES.to_vec(),
            vec!["", "\"\"", "a b", "ü", long_key, "\"a.b\""],
        ),
        prop::option::weighted(
            0.7,
            mostly(
                VALUES.to_vec(),
                vec![
                    "\"\"", "u*", "*", "[a]", "7", "null", "a b", "ü/ß", long_value,
                ],
            ),
        ),
        prop::option::weighted(0.7, rate_limit),
        prop::bool::weighted(0.1),
        prop::bool::weighted(0.05),
    );
    let children = if depth == 0 {
        Just(Vec::new()).boxed()
    } else {
        prop::collection::vec(envoy_node(depth - 1), 0..3).boxed()
    };
    (leaf, children)
        .prop_map(|((key, value, rate_limit, shadow, unknown), children)| {
            let mut lines = vec![format!("- key: {key}")];
            lines.extend(value.map(|v| format!("  value: {v}")));
            lines.extend(rate_limit.map(|r| format!("  rate_limit: {r}")));
            if shadow {
                lines.push("  shadow_mode: true".to_owned());
            }
            if unknown {
                lines.push("  quota: 3".to_owned());
            }
            if !children.is_empty() {
                lines.push("  descriptors:".to_owned());
                for child in children {
                    lines.extend(child.into_iter().map(|line| format!("    {line}")));
                }
            }
            lines
        })
        .boxed()
}

/// An envoyproxy/ratelimit configuration file, then maybe cut short or a character changed.
fn envoy_file() -> impl Strategy<Value = String> {
    let text = (
        prop::option::weighted(
            0.95,
            mostly(
                vec!["api", "edge"],
                vec!["\"\"", "[a]", "a b", "ü", "\"a.b\""],
            ),
        ),
        prop::collection::vec(envoy_node(2), 0..4),
    )
        .prop_map(|(domain, nodes)| {
            let mut text = String::new();
            if let Some(domain) = domain {
                text.push_str(&format!("domain: {domain}\n"));
            }
            text.push_str("descriptors:\n");
            for line in nodes.into_iter().flatten() {
                text.push_str(&format!("  {line}\n"));
            }
            text
        });
    (text, 0u8..12, any::<prop::sample::Index>(), any::<char>()).prop_map(|(text, how, at, c)| {
        let mut chars: Vec<char> = text.chars().collect();
        match how {
            0 if !chars.is_empty() => chars.truncate(at.index(chars.len())),
            1 if !chars.is_empty() => {
                let i = at.index(chars.len());
                chars[i] = c;
            }
            _ => {}
        }
        chars.into_iter().collect()
    })
}

/// What an import writes is a policy the compiler takes, whatever the configuration it came
/// from; a configuration it cannot take is refused with a place in the file (the file's own,
/// not the policy's the import wrote), never a panic.
#[test]
fn any_envoy_configuration_is_imported_into_a_policy_that_compiles_or_refused() {
    let mut runner = TestRunner::new(Config {
        cases: 3_000,
        failure_persistence: None,
        ..Config::default()
    });
    let seen = std::cell::RefCell::new((0usize, 0usize));
    let result = runner.run(&envoy_file(), |text| {
        let mut seen = seen.borrow_mut();
        match tollgate_policy::import_envoy("config.yaml", &text) {
            Ok(import) => {
                seen.0 += 1;
                if let Err(err) = compile("imported.yaml", &import.policy) {
                    return Err(TestCaseError::fail(format!(
                        "{err}\nimported from\n{text}\nas\n{}",
                        import.policy
                    )));
                }
                let complaints = support::schema_complaints(&import.policy);
                prop_assert!(
                    complaints.as_ref().is_some_and(Vec::is_empty),
                    "the import wrote a policy the schema flags: {complaints:?}\n{}",
                    import.policy
                );
            }
            Err(err) => {
                seen.1 += 1;
                let Some(d) = err.diagnostic() else {
                    return Err(TestCaseError::fail(format!("no diagnostic: {err}\n{text}")));
                };
                prop_assert!(!d.message.is_empty(), "{d}");
                // The import compiles what it writes before answering, and says so by the
                // file name: a refusal there is the import's fault, not the configuration's.
                prop_assert!(
                    !d.file.ends_with("(imported)"),
                    "the import wrote a policy the compiler refuses: {d}\nfrom\n{text}"
                );
            }
        }
        Ok(())
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
    let (imported, refused) = seen.into_inner();
    assert!(
        imported >= 300 && refused >= 300,
        "imported {imported}, refused {refused}"
    );
}
