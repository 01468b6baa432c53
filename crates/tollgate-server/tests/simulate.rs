//! `tollgate simulate` through the real binary: a trace replayed on the trace's own time,
//! several policies compared in one pass, shadow limits, exemptions that expire mid-trace,
//! windows on wall-clock minutes, leases held as long as each request ran, bad lines skipped
//! with their numbers, and the plot.

mod support;

use serde_json::Value;
use support::{Scratch, path_str, run};

/// `tollgate simulate ARGS --json`, expected to succeed: the report.
fn simulate_json(args: &[&str]) -> Value {
    let mut all = vec!["simulate", "--json"];
    all.extend_from_slice(args);
    let (status, stdout, stderr) = run(&all);
    assert!(status.success(), "simulate {args:?} failed: {stderr}");
    serde_json::from_str(&stdout).unwrap_or_else(|err| panic!("{err}: {stdout}"))
}

fn line(time: &str, user: &str) -> String {
    format!(r#"{{"time":"{time}","domain":"api","descriptors":[{{"user":"{user}"}}]}}"#)
}

fn limit<'a>(policy: &'a Value, name: &str) -> &'a Value {
    policy["limits"]
        .as_array()
        .and_then(|limits| limits.iter().find(|l| l["name"] == name))
        .unwrap_or_else(|| panic!("no limit {name} in {policy}"))
}

const BUCKET: &str = "\
version: small
limits:
  - name: per-user
    domain: api
    key: [user]
    capacity: 5
    refill: 1/s
";

#[test]
fn a_burst_is_cut_at_the_capacity_and_refills_on_the_trace_time() {
    let dir = Scratch::new("simulate-burst");
    let policy_file = dir.write("policy.yaml", BUCKET);
    // Ten at once from u1, then one a second later (refilled), then one 0.5 s after that (not
    // yet), and three from u2 (all within its own bucket).
    let mut trace: Vec<String> = (0..10)
        .map(|_| line("2026-11-29T10:00:00Z", "u1"))
        .collect();
    trace.push(line("2026-11-29T10:00:01Z", "u1"));
    trace.push(line("2026-11-29T10:00:01.500Z", "u1"));
    trace.extend((0..3).map(|_| line("2026-11-29T10:00:02Z", "u2")));
    let trace = dir.write("trace.jsonl", &(trace.join("\n") + "\n"));

    let report = simulate_json(&[path_str(&trace), "--config", path_str(&policy_file)]);
    assert_eq!(report["trace"]["requests"], 15);
    assert_eq!(report["trace"]["first"], "2026-11-29T10:00:00Z");
    let policy = &report["policies"][0];
    assert_eq!(policy["version"], "small");
    assert_eq!(policy["requests"], 15);
    assert_eq!(policy["allowed"], 5 + 1 + 3);
    assert_eq!(policy["rejected"], 5 + 1);
    let per_user = limit(policy, "per-user");
    assert_eq!(per_user["decisions"], 15);
    assert_eq!(per_user["rejected"], 6);
    assert_eq!(per_user["first_rejection"], "2026-11-29T10:00:00Z");
    assert_eq!(per_user["top_keys"][0]["rejections"], 6);
    assert!(
        per_user["top_keys"][0]["key"]
            .as_str()
            .is_some_and(|key| key.contains("u1")),
        "{per_user}"
    );
    assert_eq!(per_user["top_keys"].as_array().map(Vec::len), Some(1));
    let timeline = policy["timeline"].as_array().expect("a timeline");
    assert_eq!(timeline.len(), 1, "{timeline:?}");
    assert_eq!(timeline[0]["start"], "2026-11-29T10:00:00Z");
    assert_eq!(timeline[0]["requests"], 15);
    assert_eq!(timeline[0]["rejected"], 6);
    // Near the limit, past 0.8 of its 5 tokens spent: u1's fifth request, and its one a second
    // later that took the token refilled. u2 spent 3 of 5.
    assert_eq!(per_user["near_limit"], 2);
    let half = simulate_json(&[
        path_str(&trace),
        "--config",
        path_str(&policy_file),
        "--near-limit-ratio",
        "0.5",
    ]);
    // Past half: u1's third to fifth and the refilled one, u2's third.
    assert_eq!(limit(&half["policies"][0], "per-user")["near_limit"], 5);
    let (status, text, _) = run(&[
        "simulate",
        path_str(&trace),
        "--config",
        path_str(&policy_file),
    ]);
    assert!(status.success());
    assert!(text.contains("near limit"), "{text}");
    let (status, _, stderr) = run(&[
        "simulate",
        path_str(&trace),
        "--config",
        path_str(&policy_file),
        "--near-limit-ratio",
        "1.5",
    ]);
    assert!(
        !status.success() && stderr.contains("at most 1"),
        "{stderr}"
    );
}

#[test]
fn policies_are_compared_on_one_pass_of_the_trace() {
    let dir = Scratch::new("simulate-compare");
    let small = dir.write("small.yaml", BUCKET);
    let large = dir.write(
        "large.yaml",
        &BUCKET
            .replace("capacity: 5", "capacity: 8")
            .replace("small", "large"),
    );
    let trace: Vec<String> = (0..10)
        .map(|_| line("2026-11-29T10:00:00Z", "u1"))
        .collect();
    let trace = dir.write("trace.jsonl", &trace.join("\n"));

    let report = simulate_json(&[
        path_str(&trace),
        "--config",
        path_str(&small),
        "--config",
        path_str(&large),
    ]);
    assert_eq!(report["policies"][0]["rejected"], 5);
    assert_eq!(report["policies"][1]["version"], "large");
    assert_eq!(report["policies"][1]["rejected"], 2);

    let (status, text, stderr) = run(&[
        "simulate",
        path_str(&trace),
        "--config",
        path_str(&small),
        "--config",
        path_str(&large),
    ]);
    assert!(status.success(), "{stderr}");
    assert!(text.contains("replayed 10 requests"), "{text}");
    assert!(text.contains("rejected 5 -> 2 (-3)"), "{text}");
}

#[test]
fn shadow_limits_would_reject_and_exemptions_expire_mid_trace() {
    let dir = Scratch::new("simulate-shadow");
    let policy = dir.write(
        "policy.yaml",
        "\
version: 3
limits:
  - name: per-user
    domain: api
    key: [user]
    capacity: 2
    refill: 1/m
  - name: per-user-shadow
    domain: api
    key: [user]
    capacity: 1
    refill: 1/m
    mode: shadow
exemptions:
  - limit: per-user
    when: {user: vip}
    owner: ops@example.com
    reason: launch
    expires: 2026-11-29T10:00:30Z
",
    );
    // vip: three before the exemption ends (exempt from per-user, shadow would reject two),
    // three after (per-user now counts from a full bucket: two pass, one is rejected).
    let mut trace: Vec<String> = (0..3)
        .map(|_| line("2026-11-29T10:00:00Z", "vip"))
        .collect();
    trace.extend((0..3).map(|_| line("2026-11-29T10:00:40Z", "vip")));
    let trace = dir.write("trace.jsonl", &trace.join("\n"));

    let report = simulate_json(&[path_str(&trace), "--config", path_str(&policy)]);
    let policy = &report["policies"][0];
    assert_eq!(policy["rejected"], 1, "{policy}");
    assert_eq!(policy["allowed"], 5);
    let per_user = limit(policy, "per-user");
    assert_eq!(per_user["exempt"], 3);
    assert_eq!(per_user["rejected"], 1);
    assert_eq!(per_user["first_rejection"], "2026-11-29T10:00:40Z");
    let shadow = limit(policy, "per-user-shadow");
    // Shadow: the first request holds its one token, every later one would be rejected (the
    // one rejected by per-user included, which a shadow limit reports uncharged).
    assert_eq!(shadow["would_reject"], 5);
    assert_eq!(shadow["rejected"], 0);
    // Requests allowed that the shadow limit would have stopped, all in the one minute.
    assert_eq!(policy["would_reject"], 4);
    let timeline = policy["timeline"].as_array().expect("a timeline");
    assert_eq!(
        (timeline.len(), &timeline[0]["would_reject"]),
        (1, &4.into()),
        "{timeline:?}"
    );
}

#[test]
fn fixed_windows_start_on_the_wall_clock_minute() {
    let dir = Scratch::new("simulate-window");
    let policy = dir.write(
        "policy.yaml",
        "\
version: w
limits:
  - name: per-minute
    domain: api
    key: [user]
    algorithm: fixed_window
    limit: 3
    window: 1m
",
    );
    // Three in the last second of 10:00 and three in the first of 10:01: two windows, all
    // six pass. Two more at 10:01:30 are over the second window's limit.
    let mut trace: Vec<String> = (0..3)
        .map(|_| line("2026-11-29T10:00:59.900Z", "u"))
        .collect();
    trace.extend((0..3).map(|_| line("2026-11-29T10:01:00Z", "u")));
    trace.extend((0..2).map(|_| line("2026-11-29T10:01:30Z", "u")));
    let trace = dir.write("trace.jsonl", &trace.join("\n"));

    let report = simulate_json(&[
        path_str(&trace),
        "--config",
        path_str(&policy),
        "--interval",
        "30s",
    ]);
    let policy = &report["policies"][0];
    assert_eq!(policy["allowed"], 6, "{policy}");
    assert_eq!(policy["rejected"], 2);
    let timeline: Vec<(String, u64, u64)> = policy["timeline"]
        .as_array()
        .expect("a timeline")
        .iter()
        .map(|slot| {
            (
                slot["start"].as_str().unwrap_or_default().to_owned(),
                slot["requests"].as_u64().unwrap_or_default(),
                slot["rejected"].as_u64().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        timeline,
        [
            ("2026-11-29T10:00:30Z".to_owned(), 3, 0),
            ("2026-11-29T10:01:00Z".to_owned(), 3, 0),
            ("2026-11-29T10:01:30Z".to_owned(), 2, 2),
        ]
    );
}

#[test]
fn bad_lines_are_skipped_with_their_numbers_and_bad_requests_change_nothing() {
    let dir = Scratch::new("simulate-bad");
    let policy = dir.write("policy.yaml", BUCKET);
    let trace = [
        line("2026-11-29T10:00:00Z", "u1"),
        String::new(),
        "not json".to_owned(),
        r#"{"time":"2026-11-29T10:00:00Z","domain":"api","descriptors":[{"user":"u1"}],"cots":2}"#
            .to_owned(),
        // A cost above the capacity: the server would answer 400 and charge nothing.
        r#"{"time":"2026-11-29T10:00:00Z","domain":"api","descriptors":[{"user":"u1"}],"cost":6}"#
            .to_owned(),
        r#"{"time":"2026-11-29T10:00:00Z","domain":"api","descriptors":[{"user":"u1"}],"cost":4}"#
            .to_owned(),
        // Earlier than the line before: decided at the latest time seen.
        line("2026-11-29T09:00:00Z", "u1"),
    ];
    let trace = dir.write("trace.jsonl", &trace.join("\n"));

    let report = simulate_json(&[path_str(&trace), "--config", path_str(&policy)]);
    assert_eq!(report["trace"]["lines"], 7);
    assert_eq!(report["trace"]["skipped"], 2);
    assert_eq!(report["trace"]["first_skipped"][0]["line"], 3);
    assert_eq!(report["trace"]["first_skipped"][1]["line"], 4);
    assert!(
        report["trace"]["first_skipped"][1]["error"]
            .as_str()
            .is_some_and(|e| e.contains("unknown field `cots`")),
        "{report}"
    );
    assert_eq!(report["trace"]["out_of_order"], 1);
    assert_eq!(report["trace"]["requests"], 4);
    let policy = &report["policies"][0];
    assert_eq!(policy["invalid"], 1);
    assert_eq!(policy["first_invalid"]["line"], 5);
    // 1 + 4 fit in the bucket of 5 (the refused cost of 6 took nothing); the late one does
    // not (no time passed for it).
    assert_eq!(policy["allowed"], 2, "{policy}");
    assert_eq!(policy["rejected"], 1);
}

#[test]
fn writes_a_plot_and_refuses_what_it_cannot_run() {
    let dir = Scratch::new("simulate-plot");
    let policy = dir.write("policy.yaml", BUCKET);
    let trace: Vec<String> = (0..120)
        .map(|i| line(&format!("2026-11-29T10:{:02}:00Z", i / 4), "u1"))
        .collect();
    let trace = dir.write("trace.jsonl", &trace.join("\n"));
    let plot = dir.0.join("plot.svg");
    let (status, _, stderr) = run(&[
        "simulate",
        path_str(&trace),
        "--config",
        path_str(&policy),
        "--plot",
        path_str(&plot),
    ]);
    assert!(status.success(), "{stderr}");
    let svg = std::fs::read_to_string(&plot).expect("the plot was written");
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("per 1m"), "{svg}");
    assert_eq!(svg.matches("<polyline").count(), 2, "{svg}");

    let empty = dir.write("empty.jsonl", "\n\nnot json\n");
    let bad_policy = dir.write(
        "bad.yaml",
        "version: 1\nlimits:\n  - name: x\n    capacity: 0\n",
    );
    let cases: [(&[&str], &str); 5] = [
        (
            &[path_str(&empty), "--config", path_str(&policy)],
            "holds no request",
        ),
        (
            &["/nonexistent/trace", "--config", path_str(&policy)],
            "cannot read the trace",
        ),
        (
            &[path_str(&trace), "--config", path_str(&bad_policy)],
            "bad.yaml",
        ),
        (&[path_str(&trace)], "--config"),
        (
            &[
                path_str(&trace),
                "--config",
                path_str(&policy),
                "--interval",
                "0s",
            ],
            "at least 1ms",
        ),
    ];
    for (args, expected) in cases {
        let mut all = vec!["simulate"];
        all.extend_from_slice(args);
        let (status, _, stderr) = run(&all);
        assert!(!status.success(), "{args:?} succeeded");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}

#[test]
fn a_request_that_says_how_long_it_ran_holds_a_lease_that_long() {
    let dir = Scratch::new("simulate-leases");
    let policy = dir.write(
        "policy.yaml",
        "\
version: c
limits:
  - name: in-flight
    domain: api
    key: [user]
    algorithm: concurrency
    max_in_flight: 2
    lease_timeout: 10s
",
    );
    let ran = |time: &str, ms: u64| {
        format!(
            r#"{{"time":"2026-11-29T10:00:{time}Z","domain":"api","descriptors":[{{"user":"u1"}}],"duration_ms":{ms}}}"#
        )
    };
    let trace = [
        ran("00", 5_000),
        ran("00", 5_000),
        // Both slots held: rejected.
        ran("01", 100),
        // No duration: no lease taken, allowed whatever is held.
        line("2026-11-29T10:00:02Z", "u1"),
        // The first two ended at 5 s, before these arrive at 5 s.
        ran("05", 20_000),
        ran("05", 1_000),
        // The 20 s one timed out at 15 s, the 1 s one ended at 6 s: both slots free.
        ran("30", 1_000),
    ];
    let trace = dir.write("trace.jsonl", &trace.join("\n"));

    let report = simulate_json(&[path_str(&trace), "--config", path_str(&policy)]);
    assert_eq!(report["trace"]["with_duration"], 6);
    let policy = &report["policies"][0];
    assert_eq!(policy["rejected"], 1, "{policy}");
    assert_eq!(policy["allowed"], 6);
    assert_eq!(policy["leases"], 5);
    assert_eq!(policy["leases_timed_out"], 1);
    let in_flight = limit(policy, "in-flight");
    assert_eq!(in_flight["algorithm"], "concurrency");
    assert_eq!(in_flight["decisions"], 6);
    assert_eq!(in_flight["rejected"], 1);
    assert_eq!(in_flight["first_rejection"], "2026-11-29T10:00:01Z");
    // The leases that filled both slots (past 0.8 of 2): the second at 0 s and at 5 s.
    assert_eq!(in_flight["near_limit"], 2);
}

/// A deny limit applies to checks and leases alike; a replay counts each request it decides
/// once, and a banned tier of a concurrency limit refuses leases.
#[test]
fn a_deny_counts_once_and_refuses_leases() {
    let dir = Scratch::new("simulate-deny");
    let policy = dir.write(
        "policy.yaml",
        "\
version: d
limits:
  - name: in-flight
    domain: api
    key: [user]
    algorithm: concurrency
    max_in_flight: 5
    lease_timeout: 10s
    overrides:
      - {name: banned, when: {tier: banned}, deny: true}
  - name: watched
    domain: api
    when: {user: w}
    deny: true
    mode: shadow
",
    );
    let ran = |time: &str, entries: &str| {
        format!(
            r#"{{"time":"2026-11-29T10:00:{time}Z","domain":"api","descriptors":[{entries}],"duration_ms":1000}}"#
        )
    };
    let trace = [
        ran("00", r#"{"user":"w"}"#),
        ran("01", r#"{"user":"w"}"#),
        ran("02", r#"{"user":"b","tier":"banned"}"#),
    ];
    let trace = dir.write("trace.jsonl", &trace.join("\n"));
    let report = simulate_json(&[path_str(&trace), "--config", path_str(&policy)]);
    let policy = &report["policies"][0];
    assert_eq!(
        (&policy["allowed"], &policy["rejected"]),
        (&2.into(), &1.into()),
        "{policy}"
    );
    assert_eq!(policy["leases"], 2);
    let watched = limit(policy, "watched");
    assert_eq!(watched["decisions"], 2, "{watched}");
    assert_eq!(watched["would_reject"], 2, "{watched}");
    let in_flight = limit(policy, "in-flight");
    assert_eq!(
        (&in_flight["decisions"], &in_flight["rejected"]),
        (&3.into(), &1.into()),
        "{in_flight}"
    );
}

#[test]
fn a_retried_request_finds_its_lease_held_as_the_server_would() {
    let dir = Scratch::new("simulate-lease-retry");
    let policy = dir.write(
        "policy.yaml",
        "version: r\nlimits:\n  - name: one-at-a-time\n    domain: api\n    key: [user]\n    algorithm: concurrency\n    max_in_flight: 1\n    lease_timeout: 1m\n",
    );
    let ran = |time: &str, request_id: &str| {
        format!(
            r#"{{"time":"2026-11-29T10:00:{time}Z","domain":"api","descriptors":[{{"user":"u1"}}],"request_id":"{request_id}","duration_ms":10000}}"#
        )
    };
    // The retry of a-1 takes no second slot; b-2 finds the one slot held by a-1.
    let trace = [ran("00", "a-1"), ran("01", "a-1"), ran("02", "b-2")];
    let trace = dir.write("trace.jsonl", &trace.join("\n"));
    let report = simulate_json(&[path_str(&trace), "--config", path_str(&policy)]);
    let policy = &report["policies"][0];
    assert_eq!(policy["allowed"], 2, "{policy}");
    assert_eq!(policy["rejected"], 1);
    assert_eq!(policy["invalid"], 0);
    assert_eq!(policy["leases"], 1);
}

/// The example the README gives (`docs/examples`): it runs, and says what the README says.
#[test]
fn the_documented_example_runs_as_described() {
    let examples = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/examples");
    let path = |file: &str| format!("{examples}/{file}");
    let (trace, current, proposed) = (
        path("trace.jsonl"),
        path("policy.yaml"),
        path("policy-proposed.yaml"),
    );
    let report = simulate_json(&[&trace, "--config", &current, "--config", &proposed]);
    assert_eq!(report["trace"]["requests"], 931);
    let (now, then) = (&report["policies"][0], &report["policies"][1]);
    assert_eq!(
        (now["rejected"].as_u64(), now["would_reject"].as_u64()),
        (Some(150), Some(0))
    );
    assert_eq!(
        (then["rejected"].as_u64(), then["would_reject"].as_u64()),
        (Some(0), Some(55))
    );
    assert_eq!(limit(now, "per-user")["top_keys"][0]["key"], "per-user|bob");
}

const TOKENS: &str = "\
version: tokens
limits:
  - name: tokens-per-user
    domain: llm
    key: [user]
    capacity: 1000
    refill: 1000/h
";

fn reservation(time: &str, cost: u64, used: Option<u64>, duration_ms: Option<u64>) -> String {
    let used = used.map(|u| format!(r#","used":{u}"#)).unwrap_or_default();
    let duration = duration_ms
        .map(|d| format!(r#","duration_ms":{d}"#))
        .unwrap_or_default();
    format!(
        r#"{{"time":"{time}","domain":"llm","descriptors":[{{"user":"u1"}}],"cost":{cost}{used}{duration}}}"#
    )
}

/// Reservations (lines with `used`) give back what they did not use when they end: a trace of
/// large reservations that use little is mostly admitted, the same trace without `used` is
/// not; one that ends past the idempotency window keeps its whole cost.
#[test]
fn reservations_give_back_what_they_did_not_use_when_they_end() {
    let dir = Scratch::new("simulate-reservations");
    let policy = dir.write("policy.yaml", TOKENS);
    // Four requests a minute apart, each reserving 600 tokens and using 100, each running 30 s.
    let times = ["10:00:00", "10:01:00", "10:02:00", "10:03:00"];
    let lines = |used: Option<u64>| {
        let lines: Vec<String> = times
            .iter()
            .map(|t| reservation(&format!("2026-11-29T{t}Z"), 600, used, Some(30_000)))
            .collect();
        lines.join("\n") + "\n"
    };
    let settled = dir.write("settled.jsonl", &lines(Some(100)));
    let report = simulate_json(&[path_str(&settled), "--config", path_str(&policy)]);
    let p = &report["policies"][0];
    assert_eq!(report["trace"]["with_used"], 4);
    assert_eq!(
        (p["allowed"].clone(), p["rejected"].clone()),
        (4.into(), 0.into())
    );
    assert_eq!(p["settled"], 4);
    assert_eq!(p["given_back"], 4 * 500);
    assert_eq!(p["settle_missed"], 0);

    let unsettled = dir.write("unsettled.jsonl", &lines(None));
    let report = simulate_json(&[path_str(&unsettled), "--config", path_str(&policy)]);
    let p = &report["policies"][0];
    // 1000 - 600 = 400 left, and about 17 a minute come back: the next three are refused.
    assert_eq!(
        (p["allowed"].clone(), p["rejected"].clone()),
        (1.into(), 3.into())
    );
    assert_eq!(p["settled"], 0);

    // Running two minutes, past a 60 s window: nothing given back, so the second is refused.
    let late: Vec<String> = ["10:00:00", "10:03:00"]
        .iter()
        .map(|t| reservation(&format!("2026-11-29T{t}Z"), 600, Some(100), Some(120_000)))
        .collect();
    let late = dir.write("late.jsonl", &(late.join("\n") + "\n"));
    let report = simulate_json(&[path_str(&late), "--config", path_str(&policy)]);
    let p = &report["policies"][0];
    assert_eq!(
        (p["allowed"].clone(), p["rejected"].clone()),
        (1.into(), 1.into())
    );
    assert_eq!(
        (p["settled"].clone(), p["settle_missed"].clone()),
        (0.into(), 1.into())
    );
    // With a window as long as the requests, it is.
    let report = simulate_json(&[
        path_str(&late),
        "--config",
        path_str(&policy),
        "--idempotency-window",
        "5m",
    ]);
    let p = &report["policies"][0];
    assert_eq!(
        (p["allowed"].clone(), p["settled"].clone()),
        (2.into(), 2.into())
    );
}

/// A reservation is settled at its end and no sooner, after the leases that ended before it,
/// on every rate limit it was charged on (not a concurrency limit, which holds no tokens, nor
/// one it is exempt from); a retried line's reservation is settled once, and a line that used
/// all it reserved is no reservation at all.
#[test]
fn reservations_settle_at_their_end_after_leases_that_ended_first() {
    let dir = Scratch::new("simulate-settle-order");
    let policy = dir.write(
        "policy.yaml",
        "\
version: settle
limits:
  - name: tokens-per-user
    domain: llm
    key: [user]
    capacity: 1000
    refill: 1/d
  - name: tokens-total
    domain: llm
    capacity: 2000
    refill: 1/d
  - name: in-flight
    domain: llm
    key: [user]
    algorithm: concurrency
    max_in_flight: 1
    lease_timeout: 1m
exemptions:
  - limit: tokens-total
    when: {user: u2}
    owner: ops@example.com
    reason: batch
    expires: 2026-11-30T00:00:00Z
",
    );
    let request = |time: &str, user: &str, cost: u64, rest: &str| {
        format!(
            r#"{{"time":"2026-11-29T10:00:{time}Z","domain":"llm","descriptors":[{{"user":"{user}"}}],"cost":{cost}{rest}}}"#
        )
    };
    let trace = [
        // u1 reserves 600 and uses 100, for 10 s (its lease and its reservation end at 10 s).
        request(
            "00",
            "u1",
            600,
            r#","used":100,"duration_ms":10000,"request_id":"r-1""#,
        ),
        // A retry of it: the first decision again, charged and settled once.
        request(
            "01",
            "u1",
            600,
            r#","used":100,"duration_ms":10000,"request_id":"r-1""#,
        ),
        // u1's bucket holds 400 until 10 s (nothing given back yet): refused by it.
        request("05", "u1", 500, ""),
        // u1 holds its slot until 22 s; u2's reservation ends later, at 25 s.
        request("20", "u1", 1, r#","duration_ms":2000"#),
        request("20", "u2", 100, r#","used":50,"duration_ms":5000"#),
        // u1's slot was given back at 22 s, before u2's settlement comes due.
        request("23", "u1", 1, r#","duration_ms":1000"#),
        // Used all it reserved: nothing to settle.
        request("30", "u3", 10, r#","used":10"#),
    ];
    let trace = dir.write("trace.jsonl", &trace.join("\n"));
    let report = simulate_json(&[path_str(&trace), "--config", path_str(&policy)]);
    let p = &report["policies"][0];
    assert_eq!(
        (p["allowed"].clone(), p["rejected"].clone()),
        (6.into(), 1.into()),
        "{p}"
    );
    assert_eq!(limit(p, "tokens-per-user")["rejected"], 1, "{p}");
    assert_eq!(limit(p, "in-flight")["rejected"], 0, "{p}");
    assert_eq!(
        (p["settled"].clone(), p["settle_missed"].clone()),
        (2.into(), 0.into()),
        "{p}"
    );
    // 500 back on each of u1's two token buckets, 50 on u2's one (exempt from the other).
    assert_eq!(p["given_back"], 2 * 500 + 50, "{p}");
}

/// A request no limit applies to is unmatched; one that only a concurrency limit applies to,
/// and that took its lease, is not.
#[test]
fn requests_no_limit_applies_to_are_counted_unmatched() {
    let dir = Scratch::new("simulate-unmatched");
    let policy = dir.write(
        "policy.yaml",
        &format!(
            "{BUCKET}  - name: jobs-in-flight\n    domain: jobs\n    key: [user]\n    \
             algorithm: concurrency\n    max_in_flight: 1\n    lease_timeout: 10s\n"
        ),
    );
    let trace = [
        line("2026-11-29T10:00:00Z", "u1"),
        r#"{"time":"2026-11-29T10:00:01Z","domain":"web","descriptors":[{"user":"u1"}]}"#
            .to_owned(),
        r#"{"time":"2026-11-29T10:00:02Z","domain":"jobs","descriptors":[{"user":"u1"}],"duration_ms":1000}"#
            .to_owned(),
    ];
    let trace = dir.write("trace.jsonl", &trace.join("\n"));
    let report = simulate_json(&[path_str(&trace), "--config", path_str(&policy)]);
    let p = &report["policies"][0];
    assert_eq!(
        (&p["requests"], &p["allowed"], &p["unmatched"], &p["leases"]),
        (&3.into(), &3.into(), &1.into(), &1.into()),
        "{p}"
    );
}
