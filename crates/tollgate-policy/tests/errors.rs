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
        &format!("{HEAD}    limit: 20000\n    window: 30s\n    algorithm: sliding_log\n"),
        5,
        12,
        "limits[0].limit",
        "a sliding log admits at most 10000 per window",
    );
    case(
        &format!("{HEAD}    capacity: 5\n    refill: 5/s\n    algorithm: sliding_log\n"),
        5,
        15,
        "limits[0].capacity",
        "sliding_log takes limit and window",
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
    let long = "v".repeat(65);
    case(
        &format!("version: {long}\nlimits: []\n"),
        1,
        10,
        "version",
        "1 to 64 characters",
    );
    let longest = &long[1..];
    let policy = compile("p.yaml", &format!("version: {longest}\nlimits: []\n"));
    assert_eq!(policy.map(|p| p.version().len()).ok(), Some(64));
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

/// The whole diagnostic: file, line, column, path and message.
fn exact(text: &str, line: u64, column: u64, path: &str, message: &str) {
    let d = refused(text);
    assert_eq!(
        (
            d.file.as_str(),
            d.line,
            d.column,
            d.path.as_str(),
            d.message.as_str()
        ),
        ("p.yaml", line, column, path, message),
        "{text}"
    );
}

const CONCURRENCY: &str = "    algorithm: concurrency\n";
const LEASE_FIELDS: &str = "concurrency takes max_in_flight and lease_timeout (as in max_in_flight: 10 and lease_timeout: 30s)";
const BUCKET_NOT_LEASES: &str = "takes capacity and refill (as in capacity: 20 and refill: 10/s); max_in_flight and lease_timeout are for concurrency";
const WINDOW_NOT_LEASES: &str = "takes limit and window (as in limit: 100 and window: 1m); max_in_flight and lease_timeout are for concurrency";

#[test]
fn concurrency_limits_refuse_rate_fields_at_the_field() {
    let head = format!("{HEAD}{CONCURRENCY}    max_in_flight: 5\n    lease_timeout: 30s\n");
    let not_bucket = format!("{LEASE_FIELDS}; capacity and refill are for token_bucket and gcra");
    let not_window =
        format!("{LEASE_FIELDS}; limit and window are for fixed_window and sliding_window");
    for (field, value, column, message) in [
        ("capacity", "20", 15, &not_bucket),
        ("refill", "10/s", 13, &not_bucket),
        ("limit", "5", 12, &not_window),
        ("window", "1m", 13, &not_window),
    ] {
        exact(
            &format!("{head}    {field}: {value}\n"),
            8,
            column,
            &format!("limits[0].{field}"),
            message,
        );
    }
    // Before the lease fields too: the foreign field is the problem, wherever it is.
    exact(
        &format!("{HEAD}{CONCURRENCY}    capacity: 20\n    max_in_flight: 5\n"),
        6,
        15,
        "limits[0].capacity",
        &not_bucket,
    );
}

#[test]
fn rate_limits_refuse_lease_fields_at_the_field() {
    exact(
        &format!("{HEAD}    capacity: 20\n    refill: 10/s\n    max_in_flight: 5\n"),
        7,
        20,
        "limits[0].max_in_flight",
        &format!("token_bucket {BUCKET_NOT_LEASES}"),
    );
    exact(
        &format!(
            "{HEAD}    algorithm: gcra\n    capacity: 20\n    refill: 10/s\n    lease_timeout: 30s\n"
        ),
        8,
        20,
        "limits[0].lease_timeout",
        &format!("gcra {BUCKET_NOT_LEASES}"),
    );
    exact(
        &format!(
            "{HEAD}    algorithm: fixed_window\n    limit: 20\n    window: 1m\n    max_in_flight: 5\n"
        ),
        8,
        20,
        "limits[0].max_in_flight",
        &format!("fixed_window {WINDOW_NOT_LEASES}"),
    );
    exact(
        &format!(
            "{HEAD}    algorithm: sliding_window\n    limit: 20\n    window: 1m\n    lease_timeout: 1s\n"
        ),
        8,
        20,
        "limits[0].lease_timeout",
        &format!("sliding_window {WINDOW_NOT_LEASES}"),
    );
}

#[test]
fn concurrency_limits_need_both_fields() {
    // Reported at the limit's name, as other missing fields are.
    for (fields, missing) in [
        ("    lease_timeout: 30s\n", "max_in_flight"),
        ("    max_in_flight: 5\n", "lease_timeout"),
        ("", "max_in_flight"),
    ] {
        exact(
            &format!("{HEAD}{CONCURRENCY}{fields}"),
            2,
            11,
            "limits[0]",
            &format!("missing field `{missing}`: {LEASE_FIELDS}"),
        );
    }
}

#[test]
fn concurrency_values_out_of_range_are_refused_with_the_core_reason() {
    let limit = |max: &str, timeout: &str| {
        format!("{HEAD}{CONCURRENCY}    max_in_flight: {max}\n    lease_timeout: {timeout}\n")
    };
    let max = (6, 20, "limits[0].max_in_flight");
    let timeout = (7, 20, "limits[0].lease_timeout");
    for (text, (line, column, path), message) in [
        (
            limit("0", "30s"),
            max,
            "invalid concurrency limit: max_in_flight must be at least 1",
        ),
        (
            limit("1000001", "30s"),
            max,
            "invalid concurrency limit: max_in_flight must be at most 1000000",
        ),
        (
            limit("5", "1500us"),
            timeout,
            "invalid concurrency limit: lease_timeout must be a whole number of milliseconds",
        ),
        (
            limit("5", "25h"),
            timeout,
            "invalid concurrency limit: lease_timeout must be between 1ms and 24h",
        ),
        (
            limit("5", "10/s"),
            timeout,
            "invalid lease timeout \"10/s\": write a length such as 500ms, 30s or 2m",
        ),
        (
            limit("5", "soon"),
            timeout,
            "invalid lease timeout \"soon\": write a length such as 500ms, 30s or 2m",
        ),
    ] {
        exact(&text, line, column, path, message);
    }
    // Not a number at all: the parser's own words, at the value.
    case(&limit("-1", "30s"), 6, 20, "limits[0].max_in_flight", "u64");
}

#[test]
fn overrides_of_concurrency_limits_take_lease_fields_only() {
    let head = format!(
        "{HEAD}{CONCURRENCY}    max_in_flight: 5\n    lease_timeout: 30s\n    overrides:\n      - when: {{tier: gold}}\n"
    );
    let o = "limits[0].overrides[0]";
    exact(
        &format!("{head}        capacity: 3\n"),
        10,
        19,
        &format!("{o}.capacity"),
        &format!("{LEASE_FIELDS}; capacity and refill are for token_bucket and gcra"),
    );
    exact(
        &format!("{head}        window: 1m\n"),
        10,
        17,
        &format!("{o}.window"),
        &format!("{LEASE_FIELDS}; limit and window are for fixed_window and sliding_window"),
    );
    exact(
        &head,
        9,
        15,
        o,
        "an override of a concurrency limit must set max_in_flight, lease_timeout or both",
    );
    exact(
        &format!("{head}        max_in_flight: 0\n"),
        10,
        24,
        &format!("{o}.max_in_flight"),
        "invalid concurrency limit: max_in_flight must be at least 1",
    );
    exact(
        &format!("{head}        lease_timeout: 25h\n"),
        10,
        24,
        &format!("{o}.lease_timeout"),
        "invalid concurrency limit: lease_timeout must be between 1ms and 24h",
    );
    exact(
        &format!("{head}        max_in_flight: 2\n        lease_timeout: 1500us\n"),
        11,
        24,
        &format!("{o}.lease_timeout"),
        "invalid concurrency limit: lease_timeout must be a whole number of milliseconds",
    );
    // Overrides of rate limits refuse the lease fields.
    exact(
        &format!(
            "{HEAD}    capacity: 20\n    refill: 10/s\n    overrides:\n      - when: {{tier: gold}}\n        max_in_flight: 3\n"
        ),
        9,
        24,
        &format!("{o}.max_in_flight"),
        &format!("token_bucket {BUCKET_NOT_LEASES}"),
    );
    exact(
        &format!(
            "{HEAD}    algorithm: fixed_window\n    limit: 20\n    window: 1m\n    overrides:\n      - when: {{tier: gold}}\n        lease_timeout: 1s\n"
        ),
        10,
        24,
        &format!("{o}.lease_timeout"),
        &format!("fixed_window {WINDOW_NOT_LEASES}"),
    );
}

#[test]
fn emergency_is_a_rate_for_rate_limits_and_a_count_for_concurrency_limits() {
    let lease = format!(
        "{HEAD}{CONCURRENCY}    max_in_flight: 5\n    lease_timeout: 30s\n    failure_mode: open\n"
    );
    exact(
        &format!("{lease}    emergency: 2/s\n"),
        9,
        16,
        "limits[0].emergency",
        "a concurrency limit's emergency is the number of leases a key may hold in this \
         process while the store is down, such as emergency: 5, not a rate",
    );
    for zero_or_more in ["0", "1000001"] {
        exact(
            &format!("{lease}    emergency: {zero_or_more}\n"),
            9,
            16,
            "limits[0].emergency",
            "emergency must be 1 to 1000000 leases in flight per key (failure_mode: closed \
             denies while the store is down)",
        );
    }
    // Refused whatever the failure mode: either way the author misread the limit.
    exact(
        &format!("{HEAD}    capacity: 20\n    refill: 10/s\n    emergency: 5\n"),
        7,
        16,
        "limits[0].emergency",
        "a rate limit's emergency is a rate, such as emergency: 2/s (a number of leases in \
         flight is for concurrency limits)",
    );
    case(
        &format!("{lease}    emergency: lots\n"),
        9,
        16,
        "limits[0].emergency",
        "write a rate such as 2/s, or for a concurrency limit a number of leases in flight",
    );
    // Open without an emergency: the limit's own bound, per process; a default rate is for
    // rate limits and does not get in the way.
    assert!(compile("p.yaml", &lease).is_ok());
    assert!(compile("p.yaml", &format!("defaults:\n  emergency: 2/s\n{lease}")).is_ok());
    assert!(compile("p.yaml", &format!("{lease}    emergency: '3'\n")).is_ok());
}

#[test]
fn a_global_scope_needs_a_token_bucket() {
    case(
        &format!(
            "{HEAD}    algorithm: fixed_window\n    limit: 5\n    window: 1m\n    scope: global\n"
        ),
        8,
        12,
        "limits[0].scope",
        "scope global needs a token_bucket or gcra limit, not fixed_window",
    );
    case(
        &format!("{HEAD}    capacity: 5\n    refill: 1/s\n    scope: planet\n"),
        7,
        12,
        "limits[0].scope",
        "unknown variant `planet`",
    );
}

#[test]
fn condition_tags_other_than_prefix_are_refused_where_written() {
    case(
        &format!("{HEAD}    when:\n      path: !prefx /api/\n    capacity: 20\n    refill: 10/s\n"),
        6,
        20,
        "limits[0].when.path",
        "unknown tag !prefx",
    );
    case(
        &format!(
            "{HEAD}    capacity: 20\n    refill: 10/s\n    overrides:\n      - when: {{tier: !gold x}}\n        capacity: 3\n"
        ),
        8,
        28,
        "limits[0].overrides[0].when.tier",
        "`!prefix VALUE`",
    );
    case(
        &format!(
            "{HEAD}    capacity: 20\n    refill: 10/s\nexemptions:\n  - limit: per-user\n    when: {{user: !prefix}}\n    owner: a\n    reason: b\n    expires: 2030-01-01T00:00:00Z\n"
        ),
        9,
        25,
        "exemptions[0].when.user",
        "a value is missing",
    );
}

#[test]
fn replaces_names_another_limit_of_the_same_domain_once() {
    let other = "  - name: other\n    domain: api\n    key: [ip]\n    capacity: 1\n    refill: 1/s\n  - name: elsewhere\n    domain: edge\n    key: [ip]\n    capacity: 1\n    refill: 1/s\n  - name: exports\n    domain: api\n    key: [ip]\n    algorithm: concurrency\n    max_in_flight: 2\n    lease_timeout: 30s\n";
    for (replaces, fragment) in [
        ("[nobody]", "no limit is named \"nobody\""),
        ("[per-user]", "cannot replace itself"),
        ("[elsewhere]", "never applies to the same request"),
        ("[other, other]", "\"other\" is named twice"),
        ("[exports]", "not of this limit's kind"),
    ] {
        case(
            &format!("{HEAD}    capacity: 20\n    refill: 10/s\n    replaces: {replaces}\n{other}"),
            7,
            15,
            "limits[0].replaces",
            fragment,
        );
    }
}

#[test]
fn request_limit_is_for_regional_token_buckets() {
    case(
        &format!(
            "{HEAD}    algorithm: fixed_window\n    limit: 5\n    window: 1m\n    request_limit: apply\n"
        ),
        8,
        20,
        "limits[0].request_limit",
        "request_limit apply needs a token_bucket or gcra limit, not fixed_window",
    );
    case(
        &format!(
            "{HEAD}    algorithm: concurrency\n    max_in_flight: 2\n    lease_timeout: 30s\n    request_limit: apply\n"
        ),
        8,
        20,
        "limits[0].request_limit",
        "not concurrency",
    );
    case(
        &format!(
            "{HEAD}    capacity: 5\n    refill: 1/s\n    scope: global\n    request_limit: apply\n"
        ),
        8,
        20,
        "limits[0].request_limit",
        "needs a regional limit",
    );
    case(
        &format!("{HEAD}    capacity: 5\n    refill: 1/s\n    request_limit: always\n"),
        7,
        20,
        "limits[0].request_limit",
        "unknown variant `always`",
    );
    for (algorithm, value) in [
        ("token_bucket", "apply"),
        ("gcra", "apply"),
        ("gcra", "ignore"),
    ] {
        let text = format!(
            "{HEAD}    algorithm: {algorithm}\n    capacity: 5\n    refill: 1/s\n    request_limit: {value}\n"
        );
        let policy = compile("p.yaml", &text).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(policy.limits()[0].applies_request_limit(), value == "apply");
    }
}

#[test]
fn an_unlimited_override_sets_no_parameters() {
    for (field, value) in [("capacity", "3"), ("refill", "1/s")] {
        case(
            &format!(
                "{HEAD}    capacity: 5\n    refill: 1/s\n    overrides:\n      - when: {{tier: free}}\n        unlimited: true\n        {field}: {value}\n"
            ),
            9,
            20,
            "limits[0].overrides[0].unlimited",
            &format!("an unlimited override sets no parameters, yet {field} is set"),
        );
    }
    case(
        &format!(
            "{HEAD}    capacity: 5\n    refill: 1/s\n    overrides:\n      - when: {{tier: free}}\n        unlimited: always\n"
        ),
        9,
        20,
        "limits[0].overrides[0].unlimited",
        "",
    );
    // `unlimited: false` is an ordinary override, which must set parameters.
    case(
        &format!(
            "{HEAD}    capacity: 5\n    refill: 1/s\n    overrides:\n      - when: {{tier: free}}\n        unlimited: false\n"
        ),
        8,
        15,
        "limits[0].overrides[0]",
        "an override must set capacity, refill or both",
    );
}

#[test]
fn a_deny_limit_has_no_parameters_nor_a_failure_mode() {
    for (field, value, column) in [
        ("capacity", "3", 15),
        ("refill", "1/s", 13),
        ("limit", "3", 12),
        ("window", "1m", 13),
        ("max_in_flight", "3", 20),
        ("lease_timeout", "1s", 20),
        ("algorithm", "token_bucket", 16),
        ("emergency", "1/s", 16),
        ("request_limit", "apply", 20),
    ] {
        case(
            &format!("{HEAD}    deny: true\n    {field}: {value}\n"),
            6,
            column,
            &format!("limits[0].{field}"),
            &format!("a deny limit has no parameters, yet {field} is set"),
        );
    }
    case(
        &format!("{HEAD}    deny: true\n    failure_mode: open\n"),
        5,
        11,
        "limits[0].failure_mode",
        "a deny limit is decided without the store, so it has no failure_mode",
    );
    case(
        &format!("{HEAD}    deny: true\n    scope: global\n"),
        6,
        12,
        "limits[0].scope",
        "scope global needs a token_bucket or gcra limit, not deny",
    );
    case(
        &format!("{HEAD}    deny: yes please\n"),
        5,
        11,
        "limits[0].deny",
        "",
    );
    // Without `deny: true` the parameters are required as ever.
    case(
        &format!("{HEAD}    deny: false\n"),
        2,
        11,
        "limits[0]",
        "missing field `capacity`",
    );
    let policy = compile(
        "p.yaml",
        &format!("{HEAD}    deny: true\n    mode: shadow\n"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let limit = &policy.limits()[0];
    assert!(limit.deny());
    assert_eq!((limit.algorithm(), limit.rate()), ("deny", None));
}

#[test]
fn a_deny_limits_overrides_only_take_requests_out() {
    case(
        &format!(
            "{HEAD}    deny: true\n    overrides:\n      - when: {{tier: gold}}\n        capacity: 3\n        refill: 1/s\n"
        ),
        7,
        15,
        "limits[0].overrides[0]",
        "a deny limit's overrides can only take requests out of it (unlimited: true)",
    );
    case(
        &format!(
            "{HEAD}    deny: true\n    overrides:\n      - when: {{tier: gold}}\n        deny: true\n"
        ),
        7,
        15,
        "limits[0].overrides[0]",
        "a deny limit's overrides can only take requests out of it",
    );
    let policy = compile(
        "p.yaml",
        &format!(
            "{HEAD}    deny: true\n    overrides:\n      - when: {{tier: gold}}\n        unlimited: true\n"
        ),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(policy.limits()[0].overrides()[0].unlimited());
}

#[test]
fn a_deny_override_sets_no_parameters() {
    for (field, value) in [("capacity", "3"), ("refill", "1/s")] {
        case(
            &format!(
                "{HEAD}    capacity: 5\n    refill: 1/s\n    overrides:\n      - when: {{tier: free}}\n        deny: true\n        {field}: {value}\n"
            ),
            9,
            15,
            "limits[0].overrides[0].deny",
            &format!("a deny override sets no parameters, yet {field} is set"),
        );
    }
    case(
        &format!(
            "{HEAD}    capacity: 5\n    refill: 1/s\n    overrides:\n      - when: {{tier: free}}\n        deny: true\n        unlimited: true\n"
        ),
        9,
        15,
        "limits[0].overrides[0].deny",
        "an override is unlimited or denies, not both",
    );
    case(
        &format!(
            "{HEAD}    algorithm: concurrency\n    max_in_flight: 2\n    lease_timeout: 30s\n    overrides:\n      - when: {{tier: free}}\n        deny: true\n        max_in_flight: 1\n"
        ),
        10,
        15,
        "limits[0].overrides[0].deny",
        "a deny override sets no parameters, yet max_in_flight is set",
    );
    // A concurrency limit's deny override refuses leases (engine tests).
    let leases = compile(
        "p.yaml",
        &format!(
            "{HEAD}    algorithm: concurrency\n    max_in_flight: 2\n    lease_timeout: 30s\n    overrides:\n      - when: {{tier: free}}\n        deny: true\n"
        ),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(leases.limits()[0].overrides()[0].deny());
    let policy = compile(
        "p.yaml",
        &format!(
            "{HEAD}    capacity: 5\n    refill: 1/s\n    overrides:\n      - when: {{tier: free}}\n        deny: true\n"
        ),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let o = &policy.limits()[0].overrides()[0];
    assert!(o.deny() && !o.unlimited());
    assert_eq!(o.rate(), None);
}
