//! Every refused policy names the file, line, column and field path of the problem.

use tollgate_policy::{Diagnostic, compile};

fn refused(text: &str) -> Diagnostic {
    match compile("p.yaml", text) {
        Ok(_) => panic!("accepted:\n{text}"),
        Err(err) => match err.diagnostic() {
            Some(d) => d.clone(),
            None => panic!("no diagnostic: {err}"),
        },
    }
}

const HEAD: &str = "limits:\n  - name: per-user\n    domain: api\n    key: [user]\n";

/// (text, line, column, path, a fragment of the message)
fn case(text: &str, line: u64, column: u64, path: &str, fragment: &str) {
    let d = refused(text);
    assert_eq!(
        (d.line, d.column, d.path.as_str()),
        (line, column, path),
        "{d}"
    );
    assert!(d.message.contains(fragment), "{d}");
    assert_eq!(d.file, "p.yaml");
    assert!(!d.message.contains(" at line "), "position repeated: {d}");
}

#[test]
fn unknown_fields_are_refused_everywhere() {
    case(
        &format!("{HEAD}    capacity: 20\n    refill: 10/s\n    capacty: 3\n"),
        7,
        5,
        "limits[0].capacty",
        "unknown field `capacty`",
    );
    case("limit: []\n", 1, 1, "limit", "unknown field `limit`");
    case(
        &format!(
            "{HEAD}    capacity: 20\n    refill: 10/s\n    overrides:\n      - when: {{a: b}}\n        burst: 3\n"
        ),
        9,
        9,
        "limits[0].overrides[0].burst",
        "unknown field",
    );
    case(
        "defaults:\n  failure: open\nlimits: []\n",
        2,
        3,
        "defaults.failure",
        "unknown field",
    );
    case(
        &format!(
            "{HEAD}    capacity: 20\n    refill: 10/s\nexemptions:\n  - limit: per-user\n    owner: a\n    reason: b\n    expires: 2030-01-01T00:00:00Z\n    ticket: 7\n"
        ),
        12,
        5,
        "exemptions[0].ticket",
        "unknown field",
    );
}

#[test]
fn bad_scalars_point_at_the_value() {
    case(
        &format!("{HEAD}    capacity: 20\n    refill: 10/x\n"),
        6,
        13,
        "limits[0].refill",
        "unknown period unit",
    );
    case(
        &format!("{HEAD}    capacity: -1\n    refill: 10/s\n"),
        5,
        15,
        "limits[0].capacity",
        "u64",
    );
    case(
        &format!("{HEAD}    capacity: 20\n    refill: 10/s\n    rollout: 150%\n"),
        7,
        14,
        "limits[0].rollout",
        "percentage",
    );
    case(
        &format!("{HEAD}    capacity: 20\n    refill: 10/s\n    mode: loud\n"),
        7,
        11,
        "limits[0].mode",
        "unknown variant `loud`",
    );
    case(
        &format!("{HEAD}    capacity: 20\n    refill: 10/s\n    failure_mode: maybe\n"),
        7,
        19,
        "limits[0].failure_mode",
        "unknown variant",
    );
    case(
        &format!(
            "{HEAD}    capacity: 20\n    refill: 10/s\nexemptions:\n  - limit: per-user\n    owner: a\n    reason: b\n    expires: tomorrow\n"
        ),
        11,
        14,
        "exemptions[0].expires",
        "RFC 3339",
    );
}

#[test]
fn rules_across_fields_point_at_the_field() {
    case(
        &format!("{HEAD}    capacity: 0\n    refill: 10/s\n"),
        5,
        15,
        "limits[0].capacity",
        "capacity must be greater than zero",
    );
    case(
        &format!("{HEAD}    capacity: 1000000000\n    refill: 1/d\n"),
        5,
        15,
        "limits[0].capacity",
        "146 years",
    );
    case(
        &format!(
            "{HEAD}    capacity: 20\n    refill: 10/s\n  - name: per-user\n    domain: api\n    capacity: 1\n    refill: 1/s\n"
        ),
        7,
        11,
        "limits[1].name",
        "duplicate limit name",
    );
    case(
        "limits:\n  - name: a b\n    domain: api\n    capacity: 1\n    refill: 1/s\n",
        2,
        11,
        "limits[0].name",
        "invalid limit name",
    );
    case(
        "limits:\n  - name: a|b\n    domain: api\n    capacity: 1\n    refill: 1/s\n",
        2,
        11,
        "limits[0].name",
        "invalid limit name",
    );
    case(
        &format!(
            "{HEAD}    capacity: 20\n    refill: 10/s\nexemptions:\n  - limit: nope\n    owner: a\n    reason: b\n    expires: 2026-01-01T00:00:00Z\n"
        ),
        8,
        12,
        "exemptions[0].limit",
        "no limit is named",
    );
    case(
        &format!(
            "{HEAD}    capacity: 20\n    refill: 10/s\nexemptions:\n  - limit: per-user\n    owner: \" \"\n    reason: b\n    expires: 2026-01-01T00:00:00Z\n"
        ),
        9,
        12,
        "exemptions[0].owner",
        "non-empty owner",
    );
    case(
        "limits:\n  - name: x\n    domain: api\n    key: [a, a]\n    capacity: 1\n    refill: 1/s\n",
        4,
        10,
        "limits[0].key",
        "repeated",
    );
    case(
        &format!("{HEAD}    capacity: 20\n    refill: 10/s\n    algorithm: leaky\n"),
        7,
        16,
        "limits[0].algorithm",
        "unknown algorithm \"leaky\": use token_bucket",
    );
    case(
        &format!("{HEAD}    limit: 5\n    window: 30s\n    algorithm: concurrency\n"),
        7,
        16,
        "limits[0].algorithm",
        "not available in this release",
    );
    case(
        &format!("{HEAD}    capacity: 20\n    refill: 10/s\n    failure_mode: open\n"),
        2,
        11,
        "limits[0].emergency",
        "emergency rate",
    );
    case(
        &format!(
            "{HEAD}    capacity: 20\n    refill: 10/s\n    overrides:\n      - when: {{}}\n        capacity: 3\n"
        ),
        8,
        15,
        "limits[0].overrides[0].when",
        "needs conditions",
    );
    case(
        &format!(
            "{HEAD}    capacity: 20\n    refill: 10/s\n    overrides:\n      - when: {{tier: gold}}\n"
        ),
        8,
        15,
        "limits[0].overrides[0]",
        "capacity, refill or both",
    );
    case(
        &format!(
            "{HEAD}    capacity: 20\n    refill: 10/s\n    overrides:\n      - when: {{tier: gold}}\n        capacity: 0\n"
        ),
        9,
        19,
        "limits[0].overrides[0].capacity",
        "greater than zero",
    );
    case(
        &format!(
            "{HEAD}    capacity: 20\n    refill: 10/s\n    overrides:\n      - name: x\n        when: {{tier: gold}}\n        capacity: 2\n      - name: x\n        when: {{tier: silver}}\n        capacity: 3\n"
        ),
        11,
        15,
        "limits[0].overrides[1].name",
        "duplicate override name",
    );
    case(
        "version: \"\"\nlimits: []\n",
        1,
        10,
        "version",
        "1 to 64 characters",
    );
}

#[test]
fn emergency_error_points_at_the_emergency_field() {
    let open = "limits:\n  - name: l\n    domain: api\n    capacity: 1\n    refill: 1/s\n    failure_mode: open\n";
    case(
        &format!("{open}    emergency: 1/60000d\n"),
        7,
        16,
        "limits[0].emergency",
        "146 years",
    );
    // From the defaults: the default is what needs fixing.
    case(
        &format!("defaults:\n  emergency: 1/60000d\n{open}"),
        2,
        14,
        "defaults.emergency",
        "146 years",
    );
}

#[test]
fn syntax_errors_have_positions() {
    let d = refused("limits: [\n");
    assert_eq!(d.line, 1);
    let d = refused(
        "limits:\n  - name: x\n    domain: api\n    when: {a: 1, a: 2}\n    capacity: 1\n    refill: 1/s\n",
    );
    assert_eq!((d.line, d.path.as_str()), (4, "limits[0].when"), "{d}");
    assert!(d.message.contains("duplicate"), "{d}");
    assert!(!d.message.contains("DuplicateKeyPolicy"), "{d}");
    // A missing field is reported at the limit's name: the start of the entry lacking it.
    let d = refused(&format!("{HEAD}    capacity: 20\n"));
    assert_eq!((d.line, d.path.as_str()), (2, "limits[0]"), "{d}");
    assert!(d.message.contains("missing field `refill`"), "{d}");
}

#[test]
fn an_empty_or_truncated_file_is_not_an_empty_policy() {
    for text in ["", "\n", "# only a comment\n", "version: 3\n"] {
        let d = refused(text);
        assert!(
            d.message.contains("limits") || d.message.contains("EOF") || d.message.contains("end"),
            "{text:?}: {d}"
        );
    }
    assert!(compile("p.yaml", "limits: []\n").is_ok_and(|p| p.limits().is_empty()));
}

#[test]
fn display_is_one_line_with_everything() {
    let err = compile("conf/p.yaml", "limits:\n  - nme: x\n")
        .map(|_| ())
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.starts_with("conf/p.yaml:2:5: limits[0].nme: unknown field `nme`"),
        "{text}"
    );
    assert!(!text.contains('\n'));
}

#[test]
fn window_limits_take_limit_and_window_and_nothing_else() {
    case(
        &format!("{HEAD}    capacity: 20\n    refill: 10/s\n    algorithm: fixed_window\n"),
        5,
        15,
        "limits[0].capacity",
        "fixed_window takes limit and window",
    );
    case(
        &format!("{HEAD}    algorithm: sliding_window\n    limit: 20\n"),
        2,
        11,
        "limits[0]",
        "sliding_window takes limit and window",
    );
    case(
        &format!("{HEAD}    limit: 20\n    window: 1m\n"),
        5,
        12,
        "limits[0].limit",
        "token_bucket takes capacity and refill",
    );
    case(
        &format!("{HEAD}    algorithm: gcra\n    capacity: 20\n"),
        2,
        11,
        "limits[0]",
        "gcra takes capacity and refill",
    );
    case(
        &format!("{HEAD}    algorithm: fixed_window\n    limit: 20\n    window: 1500us\n"),
        7,
        13,
        "limits[0].window",
        "whole number of milliseconds",
    );
    case(
        &format!("{HEAD}    algorithm: fixed_window\n    limit: 20\n    window: 10/s\n"),
        7,
        13,
        "limits[0].window",
        "invalid window",
    );
    case(
        &format!("{HEAD}    algorithm: fixed_window\n    limit: 0\n    window: 1s\n"),
        6,
        12,
        "limits[0].limit",
        "greater than zero",
    );
    case(
        &format!(
            "{HEAD}    algorithm: fixed_window\n    limit: 20\n    window: 1m\n    overrides:\n      - when: {{tier: gold}}\n        capacity: 3\n"
        ),
        10,
        19,
        "limits[0].overrides[0].capacity",
        "fixed_window takes limit and window",
    );
    case(
        &format!(
            "{HEAD}    algorithm: sliding_window\n    limit: 20\n    window: 1m\n    overrides:\n      - when: {{tier: gold}}\n"
        ),
        9,
        15,
        "limits[0].overrides[0]",
        "must set limit, window or both",
    );
    case(
        &format!(
            "{HEAD}    algorithm: sliding_window\n    limit: 20\n    window: 1m\n    overrides:\n      - when: {{tier: gold}}\n        limit: 5000000000\n"
        ),
        10,
        16,
        "limits[0].overrides[0].limit",
        "at most 4294967295",
    );
    case(
        &format!(
            "{HEAD}    capacity: 20\n    refill: 10/s\n    overrides:\n      - when: {{tier: gold}}\n        window: 1m\n"
        ),
        9,
        17,
        "limits[0].overrides[0].window",
        "token_bucket takes capacity and refill",
    );
}
