//! The JSON Schema editors check policy files with (`policy.schema.json`, printed by
//! `tollgate schema`), held to the compiler. The compiler is the judge; the schema may let
//! through what only the compiler can refuse (unique names, references between limits,
//! exact-arithmetic bounds), but it must never flag a file the compiler takes, or an editor
//! would teach people to ignore it. So: every policy the project ships, every file the
//! arbitrary-files generator makes that compiles and every policy an Envoy import writes is
//! valid under the schema; and the mistakes an editor is for (a misspelt field, a wrong kind
//! of value, parameters of another algorithm) are flagged as the compiler refuses them.

mod support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::Value;
use tollgate_policy::{JSON_SCHEMA, compile};

/// The schema's complaints about `text`, which must be YAML.
fn complaints(text: &str) -> Vec<String> {
    support::schema_complaints(text).unwrap_or_else(|| panic!("not YAML:\n{text}"))
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|err| panic!("{path}: {err}"))
}

#[test]
fn the_schema_is_a_draft_7_schema() {
    let schema: Value = serde_json::from_str(JSON_SCHEMA).expect("the schema is JSON");
    if let Err(err) = jsonschema::draft7::meta::validate(&schema) {
        panic!("not a draft 7 schema: {err}");
    }
    assert_eq!(
        schema["$schema"], "http://json-schema.org/draft-07/schema#",
        "editors pick the draft from here"
    );
}

/// The policies a reader copies: the demo the server prints, the examples, the Kubernetes
/// ConfigMap's, and every whole policy (a block with top-level `limits:`) in the README and
/// the policy reference.
fn shipped_policies() -> Vec<(String, String)> {
    let mut policies = vec![];
    for path in [
        "crates/tollgate-server/src/demo.yaml",
        "docs/examples/policy.yaml",
        "docs/examples/policy-proposed.yaml",
    ] {
        policies.push((path.to_owned(), read(path)));
    }
    let kubernetes = read("deploy/kubernetes/tollgate.yaml");
    let embedded: Vec<&str> = kubernetes
        .lines()
        .skip_while(|line| *line != "  policy.yaml: |")
        .skip(1)
        .take_while(|line| line.is_empty() || line.starts_with("    "))
        .map(|line| line.get(4..).unwrap_or(""))
        .collect();
    assert!(embedded.len() > 3, "the ConfigMap's policy was not found");
    policies.push(("the Kubernetes ConfigMap".to_owned(), embedded.join("\n")));
    for path in ["README.md", "docs/policy.md"] {
        let text = read(path);
        let mut n = 0;
        for rest in text.split("```yaml\n").skip(1) {
            let block = rest.split("\n```").next().unwrap_or("");
            if block.lines().any(|line| line.starts_with("limits:")) {
                n += 1;
                policies.push((format!("{path}, policy block {n}"), block.to_owned()));
            }
        }
        assert!(n > 0, "{path} shows no whole policy");
    }
    policies
}

#[test]
fn every_policy_the_project_ships_compiles_and_is_valid() {
    let policies = shipped_policies();
    assert!(policies.len() >= 7, "{} policies", policies.len());
    for (name, text) in policies {
        if let Err(err) = compile(&name, &text) {
            panic!("{name} does not compile: {err}\n{text}");
        }
        let complaints = complaints(&text);
        assert!(
            complaints.is_empty(),
            "{name} compiles, but the schema says\n{}\n{text}",
            complaints.join("\n")
        );
    }
}

/// The fields of each kind of object, as the compiler lists them when it meets one it does not
/// know, are the schema's: a field added to the file's format and not to the schema (or the
/// other way round) fails here.
#[test]
fn the_schema_has_every_field_the_compiler_has() {
    let schema: Value = serde_json::from_str(JSON_SCHEMA).expect("the schema is JSON");
    let bucket = "{name: a, domain: api, capacity: 5, refill: 1/s";
    let objects = [
        ("the file", "limits: []\nzzz: 1\n".to_owned(), "/properties"),
        (
            "defaults",
            "defaults: {zzz: 1}\nlimits: []\n".to_owned(),
            "/properties/defaults/properties",
        ),
        (
            "a limit",
            format!("limits:\n  - {bucket}, zzz: 1}}\n"),
            "/definitions/limit/properties",
        ),
        (
            "an override",
            format!("limits:\n  - {bucket}, overrides: [{{when: {{a: b}}, zzz: 1}}]}}\n"),
            "/definitions/override/properties",
        ),
        (
            "an exemption",
            format!(
                "limits:\n  - {bucket}}}\nexemptions:\n  - {{limit: a, owner: o, reason: r, expires: 2026-12-31T00:00:00Z, zzz: 1}}\n"
            ),
            "/definitions/exemption/properties",
        ),
    ];
    for (what, text, pointer) in objects {
        let err = compile("p.yaml", &text).expect_err(what).to_string();
        let (_, listed) = err
            .split_once("expected one of ")
            .unwrap_or_else(|| panic!("{what}: {err}"));
        let compiler: BTreeSet<&str> = listed.split(", ").map(str::trim).collect();
        let properties = schema
            .pointer(pointer)
            .and_then(Value::as_object)
            .unwrap_or_else(|| panic!("no {pointer} in the schema"));
        let schema: BTreeSet<&str> = properties.keys().map(String::as_str).collect();
        assert_eq!(
            schema, compiler,
            "{what}: the schema's fields, the compiler's"
        );
    }
}

/// A field left empty (`capacity:`, null in YAML) is a field not set where the compiler reads
/// it so, and refused where it refuses it: the schema agrees field by field.
#[test]
fn empty_fields_are_read_as_the_compiler_reads_them() {
    let bucket = "name: a, domain: api, key: [user], capacity: 5, refill: 1/s";
    let window = "name: a, domain: api, algorithm: fixed_window, limit: 5, window: 1m";
    let mut files = vec![
        ("version: ~\nlimits: []\n".to_owned(), true),
        ("defaults: ~\nlimits: []\n".to_owned(), false),
        ("limits: ~\n".to_owned(), false),
        ("limits: []\nexemptions: ~\n".to_owned(), false),
    ];
    for field in ["mode", "failure_mode", "emergency"] {
        files.push((format!("defaults: {{{field}: ~}}\nlimits: []\n"), true));
    }
    for field in [
        "when",
        "algorithm",
        "mode",
        "rollout",
        "failure_mode",
        "scope",
        "emergency",
        "replaces",
        "request_limit",
        "deny",
        "limit",
        "window",
        "max_in_flight",
        "lease_timeout",
    ] {
        files.push((format!("limits:\n  - {{{bucket}, {field}: ~}}\n"), true));
    }
    for field in ["capacity", "refill"] {
        files.push((format!("limits:\n  - {{{window}, {field}: ~}}\n"), true));
    }
    for field in ["exact", "overrides"] {
        files.push((format!("limits:\n  - {{{bucket}, {field}: ~}}\n"), false));
    }
    files.push((
        format!("limits:\n  - {{{bucket}, when: {{tier: ~}}}}\n"),
        false,
    ));
    for field in [
        "name",
        "refill",
        "limit",
        "window",
        "max_in_flight",
        "lease_timeout",
        "unlimited",
        "deny",
    ] {
        let text = format!(
            "limits:\n  - {{{bucket}, overrides: [{{when: {{a: b}}, capacity: 6, {field}: ~}}]}}\n"
        );
        files.push((text, true));
    }
    files.push((
        format!("limits:\n  - {{{bucket}, overrides: [{{when: ~, capacity: 6}}]}}\n"),
        false,
    ));
    for (text, taken) in files {
        assert_eq!(
            compile("p.yaml", &text).is_ok(),
            taken,
            "the compiler on\n{text}"
        );
        assert_eq!(complaints(&text).is_empty(), taken, "the schema on\n{text}");
    }
}

/// Files an editor must flag, each refused by the compiler too.
const MISTAKES: &[(&str, &str)] = &[
    ("no limits", "version: \"1\"\n"),
    (
        "a misspelt field",
        "limits:\n  - {name: a, domain: api, capacty: 5, refill: 1/s}\n",
    ),
    ("a misspelt top-level field", "limits: []\nexemption: []\n"),
    (
        "an unknown algorithm",
        "limits:\n  - {name: a, domain: api, algorithm: leaky_bucket, capacity: 5, refill: 1/s}\n",
    ),
    (
        "a rate without a unit",
        "limits:\n  - {name: a, domain: api, capacity: 5, refill: 10}\n",
    ),
    (
        "a rate of nothing",
        "limits:\n  - {name: a, domain: api, capacity: 5, refill: 0/s}\n",
    ),
    (
        "an unknown unit",
        "limits:\n  - {name: a, domain: api, capacity: 5, refill: 10/w}\n",
    ),
    (
        "a capacity of 0",
        "limits:\n  - {name: a, domain: api, capacity: 0, refill: 1/s}\n",
    ),
    (
        "a fractional capacity",
        "limits:\n  - {name: a, domain: api, capacity: 1.5, refill: 1/s}\n",
    ),
    (
        "a token bucket without its refill",
        "limits:\n  - {name: a, domain: api, capacity: 5}\n",
    ),
    (
        "a token bucket with a window",
        "limits:\n  - {name: a, domain: api, capacity: 5, refill: 1/s, window: 1m}\n",
    ),
    (
        "a window limit with a capacity",
        "limits:\n  - {name: a, domain: api, algorithm: fixed_window, limit: 5, window: 1m, capacity: 5}\n",
    ),
    (
        "a window limit without its window",
        "limits:\n  - {name: a, domain: api, algorithm: sliding_window, limit: 5}\n",
    ),
    (
        "a window of no length",
        "limits:\n  - {name: a, domain: api, algorithm: fixed_window, limit: 5, window: 0s}\n",
    ),
    (
        "a concurrency limit without its lease timeout",
        "limits:\n  - {name: a, domain: api, algorithm: concurrency, max_in_flight: 2}\n",
    ),
    (
        "a concurrency limit with a refill",
        "limits:\n  - {name: a, domain: api, algorithm: concurrency, max_in_flight: 2, lease_timeout: 30s, refill: 1/s}\n",
    ),
    (
        "a deny limit with parameters",
        "limits:\n  - {name: a, domain: api, deny: true, capacity: 5, refill: 1/s}\n",
    ),
    (
        "a deny limit with a failure mode",
        "limits:\n  - {name: a, domain: api, deny: true, failure_mode: open}\n",
    ),
    (
        "a mode that is not one",
        "limits:\n  - {name: a, domain: api, capacity: 5, refill: 1/s, mode: off}\n",
    ),
    (
        "a rollout without its percent sign",
        "limits:\n  - {name: a, domain: api, capacity: 5, refill: 1/s, rollout: 50}\n",
    ),
    (
        "a rollout past 100%",
        "limits:\n  - {name: a, domain: api, capacity: 5, refill: 1/s, rollout: 101%}\n",
    ),
    (
        "a rollout of three decimals",
        "limits:\n  - {name: a, domain: api, capacity: 5, refill: 1/s, rollout: 12.345%}\n",
    ),
    (
        "a failure mode that is not one",
        "limits:\n  - {name: a, domain: api, capacity: 5, refill: 1/s, failure_mode: half}\n",
    ),
    (
        "a name with a space",
        "limits:\n  - {name: a b, domain: api, capacity: 5, refill: 1/s}\n",
    ),
    (
        "an empty domain",
        "limits:\n  - {name: a, domain: \"\", capacity: 5, refill: 1/s}\n",
    ),
    (
        "a limit without a domain",
        "limits:\n  - {name: a, capacity: 5, refill: 1/s}\n",
    ),
    (
        "an empty list of values",
        "limits:\n  - {name: a, domain: api, when: {method: []}, capacity: 5, refill: 1/s}\n",
    ),
    (
        "a map as a value",
        "limits:\n  - {name: a, domain: api, when: {method: {a: b}}, capacity: 5, refill: 1/s}\n",
    ),
    (
        "an empty entry name",
        "limits:\n  - {name: a, domain: api, when: {\"\": x}, capacity: 5, refill: 1/s}\n",
    ),
    (
        "a key entry twice",
        "limits:\n  - {name: a, domain: api, key: [user, user], capacity: 5, refill: 1/s}\n",
    ),
    (
        "an override without conditions",
        "limits:\n  - name: a\n    domain: api\n    capacity: 5\n    refill: 1/s\n    overrides:\n      - {capacity: 10}\n",
    ),
    (
        "an override of empty conditions",
        "limits:\n  - name: a\n    domain: api\n    capacity: 5\n    refill: 1/s\n    overrides:\n      - {when: {}, capacity: 10}\n",
    ),
    (
        "a misspelt field in an override",
        "limits:\n  - name: a\n    domain: api\n    capacity: 5\n    refill: 1/s\n    overrides:\n      - {when: {tier: x}, capcity: 10}\n",
    ),
    (
        "a scope that is not one",
        "limits:\n  - {name: a, domain: api, capacity: 5, refill: 1/s, scope: world}\n",
    ),
    (
        "an exemption without an owner",
        "limits:\n  - {name: a, domain: api, capacity: 5, refill: 1/s}\nexemptions:\n  - {limit: a, reason: r, expires: 2026-12-31T00:00:00Z}\n",
    ),
    (
        "an exemption with a blank reason",
        "limits:\n  - {name: a, domain: api, capacity: 5, refill: 1/s}\nexemptions:\n  - {limit: a, owner: o, reason: \" \", expires: 2026-12-31T00:00:00Z}\n",
    ),
    (
        "an exemption expiring tomorrow",
        "limits:\n  - {name: a, domain: api, capacity: 5, refill: 1/s}\nexemptions:\n  - {limit: a, owner: o, reason: r, expires: tomorrow}\n",
    ),
    (
        "defaults with a capacity",
        "defaults: {capacity: 5}\nlimits: []\n",
    ),
    (
        "an emergency of no rate",
        "limits:\n  - {name: a, domain: api, capacity: 5, refill: 1/s, failure_mode: open, emergency: 2/x}\n",
    ),
];

#[test]
fn the_mistakes_an_editor_is_for_are_flagged_as_the_compiler_refuses_them() {
    for (what, text) in MISTAKES {
        assert!(
            compile("p.yaml", text).is_err(),
            "{what}: the compiler takes it\n{text}"
        );
        assert!(
            !complaints(text).is_empty(),
            "{what}: the schema takes it\n{text}"
        );
    }
}

/// Expiry times in the forms the compiler reads (RFC 3339 and the ISO 8601 forms near it) and
/// in forms it refuses: the schema agrees on each.
#[test]
fn the_schema_reads_expiry_times_as_the_compiler_does() {
    let times = [
        ("2026-12-31T00:00:00Z", true),
        ("2026-12-31t00:00:00z", true),
        ("2026-12-31 00:00:00Z", true),
        ("2026-12-31T00:00Z", true),
        ("2026-12-31T00Z", true),
        ("2026-12-31T00:00:00+02", true),
        ("2026-12-31T00:00:00+0200", true),
        ("2026-12-31T00:00:00-05:30", true),
        ("2026-12-31T00:00:00.5Z", true),
        ("2026-12-31T00:00:00,123456789Z", true),
        ("2026-12-31T00:00:00Z[UTC]", true),
        ("20261231T000000Z", true),
        ("+002026-12-31T00:00:00Z", true),
        ("2026-12-31", false),
        ("2026-12-31T00:00:00", false),
        ("2026-13-01T00:00:00Z", false),
        ("2026-12-32T00:00:00Z", false),
        ("2026-12-31T00:00:00\u{2212}02:00", false),
        ("tomorrow", false),
        ("1790000000", false),
    ];
    for (time, valid) in times {
        let text = format!(
            "limits:\n  - {{name: a, domain: api, capacity: 5, refill: 1/s}}\nexemptions:\n  - {{limit: a, owner: o, reason: r, expires: \"{time}\"}}\n"
        );
        assert_eq!(
            compile("p.yaml", &text).is_ok(),
            valid,
            "the compiler on {time}"
        );
        assert_eq!(complaints(&text).is_empty(), valid, "the schema on {time}");
    }
}

/// The mistakes above, mended, pass both: each refusal is for the mistake, not for something
/// else in the file.
#[test]
fn near_misses_are_valid() {
    let good = [
        "limits: []\n",
        "limits:\n  - {name: a, domain: api, capacity: 5, refill: 1/s}\n",
        "limits:\n  - {name: a, domain: api, algorithm: gcra, capacity: 1, refill: 5/100ms}\n",
        "limits:\n  - {name: a, domain: api, algorithm: fixed_window, limit: 5, window: 1m}\n",
        "limits:\n  - {name: a, domain: api, algorithm: sliding_log, limit: 5, window: 100ms}\n",
        "limits:\n  - {name: a, domain: api, algorithm: concurrency, max_in_flight: 2, lease_timeout: 30s, failure_mode: open, emergency: 1}\n",
        "limits:\n  - {name: a, domain: api, deny: true, when: {ip: [!cidr 10.0.0.0/8, !prefix 192.168., 203.0.113.7]}, key: [ip]}\n",
        "limits:\n  - {name: a, domain: api, deny: false, capacity: 5, refill: 1/s}\n",
        "limits:\n  - {name: a, domain: api, when: {port: 443, zip: 01234, v: 2.10, on: true}, capacity: 5, refill: 1/s, rollout: 12.5%, mode: shadow}\n",
        "version: 7\ndefaults: {mode: shadow, failure_mode: open, emergency: 2/s}\nlimits:\n  - {name: a, domain: api, capacity: 5, refill: 1/s, scope: global}\n",
        "limits:\n  - name: a\n    domain: api\n    key: [tenant]\n    capacity: 5\n    refill: 1/s\n    request_limit: apply\n    overrides:\n      - {name: premium, when: {tier: premium}, capacity: 10}\n      - {when: {tier: staff}, unlimited: true}\n      - {when: {tier: banned}, deny: true}\n  - {name: b, domain: api, when: {plan: partner}, key: [tenant], capacity: 50, refill: 10/s, replaces: [a]}\nexemptions:\n  - {limit: a, when: {tenant: acme}, owner: ops@example.com, reason: launch, expires: 2026-12-31T00:00:00+02:00}\n",
    ];
    for text in good {
        if let Err(err) = compile("p.yaml", text) {
            panic!("the compiler refuses it: {err}\n{text}");
        }
        let complaints = complaints(text);
        assert!(complaints.is_empty(), "{}\n{text}", complaints.join("\n"));
    }
}
