//! The engine: decisions against the policy in force, reloads, rollback, the audit trail.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tollgate::{Clock, Limit, ManualClock, block_on_ready};
use tollgate_policy::audit::AuditLog;
use tollgate_policy::{
    EngineOptions, ManualWallClock, PolicyEngine, RequestDescriptor, RequestedLimit, ShadowAll,
    ShadowScope, UnixTime, compile,
};

const NOW: UnixTime = UnixTime::from_secs(1_790_000_000); // 2026-09-21

#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Lines {
    fn events(&self) -> Vec<serde_json::Value> {
        let text = String::from_utf8(self.0.lock().clone()).unwrap_or_default();
        text.lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect()
    }

    fn kinds(&self) -> Vec<String> {
        self.events()
            .iter()
            .map(|e| e["event"].as_str().unwrap_or_default().to_owned())
            .collect()
    }
}

struct Rig {
    engine: PolicyEngine,
    clock: ManualClock,
    wall: ManualWallClock,
    audit: Lines,
}

fn rig_with(policy: &str, path: Option<PathBuf>) -> Rig {
    let clock = ManualClock::new();
    let wall = ManualWallClock::new(NOW);
    let audit = Lines::default();
    let log = AuditLog::new(Box::new(audit.clone()), Box::new(wall.clone()));
    let options = EngineOptions::default()
        .clock(Arc::new(clock.clone()))
        .wall_clock(Arc::new(wall.clone()))
        .audit(Arc::new(log))
        .history(3);
    let engine = match path {
        Some(path) => {
            std::fs::write(&path, policy).unwrap_or_else(|e| panic!("{e}"));
            PolicyEngine::from_file(&path, options)
        }
        None => compile("p.yaml", policy).map(|p| PolicyEngine::new(p, options)),
    }
    .unwrap_or_else(|e| panic!("{e}"));
    Rig {
        engine,
        clock,
        wall,
        audit,
    }
}

fn rig(policy: &str) -> Rig {
    rig_with(policy, None)
}

impl Rig {
    /// The audit events of the switches that put every limit in shadow mode.
    fn shadow_all_events(&self) -> Vec<serde_json::Value> {
        self.audit
            .events()
            .into_iter()
            .filter(|e| {
                e["event"]
                    .as_str()
                    .is_some_and(|k| k.starts_with("shadow_all"))
            })
            .collect()
    }

    /// The limits the last `loaded` audit event names as changed.
    fn last_changed_limits(&self) -> Option<serde_json::Value> {
        self.audit
            .events()
            .into_iter()
            .rfind(|e| e["event"] == "loaded")
            .map(|e| e["changed_limits"].clone())
    }
}

fn temp_file(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tollgate-policy-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    dir.join("policy.yaml")
}

const TWO: &str = r#"
version: "1"
limits:
  - name: per-user
    domain: api
    key: [user]
    capacity: 3
    refill: 1/s
  - name: per-tenant
    domain: api
    key: [tenant]
    capacity: 4
    refill: 1/s
"#;

fn user(u: &str, t: &str) -> [(&'static str, String); 2] {
    [("user", u.to_owned()), ("tenant", t.to_owned())]
}

fn decide(
    engine: &PolicyEngine,
    descriptor: &[(&str, String)],
) -> (bool, Vec<(String, bool, u64)>, String) {
    let d: Vec<(&str, &str)> = descriptor.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let outcome = engine
        .decide("api", &[d], 1, None)
        .unwrap_or_else(|e| panic!("{e}"));
    let limits = outcome
        .limits
        .iter()
        .map(|l| {
            let d = l.decision;
            (
                l.name.to_string(),
                d.is_some_and(|d| d.allowed()),
                d.map_or(0, |d| d.remaining()),
            )
        })
        .collect();
    (outcome.allowed, limits, outcome.policy_version.to_string())
}

#[test]
fn all_or_nothing_with_the_version() {
    let r = rig(TWO);
    for _ in 0..3 {
        assert!(decide(&r.engine, &user("a", "t")).0);
    }
    // per-user is empty; per-tenant had room but is not charged.
    let (allowed, limits, version) = decide(&r.engine, &user("a", "t"));
    assert!(!allowed);
    assert_eq!(version, "1");
    assert_eq!(
        limits,
        [
            ("per-user".into(), false, 0),
            ("per-tenant".into(), true, 1)
        ]
    );
    // So another user of the tenant still gets the tenant's last token.
    assert!(decide(&r.engine, &user("b", "t")).0);
    assert!(!decide(&r.engine, &user("c", "t")).0);
    r.clock.advance(Duration::from_secs(1));
    assert!(decide(&r.engine, &user("c", "t")).0);
}

#[test]
fn a_cost_per_descriptor_is_all_or_nothing_too() {
    let r = rig(TWO);
    let costs: &[u64] = &[2, 3];
    let (a, b) = ([("user", "a")], [("user", "b")]);
    // a takes 2, b takes all 3.
    let first = r.engine.decide("api", &[a, b], costs, None).unwrap();
    assert!(first.allowed);
    let left: Vec<u64> = first
        .limits
        .iter()
        .map(|l| l.decision.unwrap().remaining())
        .collect();
    assert_eq!(left, [1, 0]);
    // b is empty: a's one token stays where it is.
    let costs: &[u64] = &[1, 1];
    assert!(
        !r.engine
            .decide("api", &[a, b], costs, None)
            .unwrap()
            .allowed
    );
    assert!(decide(&r.engine, &[("user", "a".to_owned())]).0);
    // A missing or zero cost is an error, whatever applies.
    for costs in [&[1u64][..], &[1, 0]] {
        assert!(r.engine.decide("api", &[a, b], costs, None).is_err());
        assert!(
            r.engine
                .decide_degraded("api", &[a, b], costs, "test")
                .is_err()
        );
    }
}

#[test]
fn unmatched_requests_are_allowed_and_counted() {
    let r = rig(TWO);
    let outcome = r.engine.decide("api", &[[("other", "x")]], 1, None);
    assert!(outcome.as_ref().is_ok_and(|o| o.allowed && o.unmatched()));
    let outcome = r.engine.decide("nope", &[[("user", "x")]], 1, None);
    assert!(outcome.is_ok_and(|o| o.allowed && o.unmatched()));
    assert_eq!(r.engine.unmatched(), 2);
    assert_eq!(r.engine.status().unmatched, 2);
}

/// An entry with an empty value is present, as in Envoy's Rate Limit Service: every request
/// sending `user: ""` shares that one bucket, apart from every named user's. Only a missing
/// entry leaves a keyed limit out.
#[test]
fn an_empty_value_is_one_shared_bucket_not_a_missing_entry() {
    let r = rig(TWO);
    let names = |d: &[(&str, &str)]| -> Vec<String> {
        let outcome = r.engine.decide("api", &[d], 1, None);
        let outcome = outcome.unwrap_or_else(|e| panic!("{e}"));
        outcome.limits.iter().map(|l| l.name.to_string()).collect()
    };
    assert_eq!(names(&[("user", "")]), ["per-user"]);
    assert_eq!(
        names(&[("user", ""), ("tenant", "")]),
        ["per-user", "per-tenant"]
    );
    // per-user's "" bucket had 3 and has given 2: one left, then none.
    assert!(decide(&r.engine, &[("user", String::new())]).0);
    assert!(!decide(&r.engine, &[("user", String::new())]).0);
    // A named user, and the users "\"\"" and " ", have buckets of their own.
    for name in ["a", "\"\"", " "] {
        assert!(
            decide(&r.engine, &[("user", name.to_owned())]).0,
            "{name:?}"
        );
    }
    assert_eq!(r.engine.unmatched(), 0);
}

#[test]
fn invalid_costs_are_errors_that_charge_nothing() {
    let r = rig(TWO);
    let err = r
        .engine
        .decide("api", &[[("user", "a"), ("tenant", "t")]], 4, None);
    assert!(err.is_err_and(|e| e.to_string().contains("per-user")));
    assert!(r.engine.decide("api", &[[("user", "a")]], 0, None).is_err());
    assert_eq!(decide(&r.engine, &user("a", "t")).1[0].2, 2);
}

#[test]
fn cost_zero_is_an_error_even_when_every_limit_is_exempt() {
    let r = rig(EXEMPT);
    let acme = [("tenant", "acme"), ("user", "u")];
    let err = r.engine.decide("api", &[acme], 0, None);
    assert_eq!(
        err.map(|_| ()).map_err(|e| e.to_string()),
        Err("cost 0 is invalid: it must be at least 1".to_owned())
    );
    // Nor when nothing applies, nor when explaining or deciding without the store.
    assert!(
        r.engine
            .decide("api", &[[("other", "x")]], 0, None)
            .is_err()
    );
    assert!(r.engine.explain("api", &[acme], 0).is_err());
    assert!(r.engine.decide_degraded("api", &[acme], 0, "down").is_err());
    assert!(
        r.engine
            .decide_degraded("api", &[[("other", "x")]], 0, "down")
            .is_err()
    );
    // Refused before anything was looked at: no exemption use, no unmatched request.
    assert_eq!(r.engine.unmatched(), 0);
    assert!(r.audit.kinds().iter().all(|k| k != "exemption_used"));
}

const SHADOW: &str = r#"
version: "s"
limits:
  - name: enforced
    domain: api
    key: [user]
    capacity: 2
    refill: 1/s
  - name: trial
    domain: api
    key: [user]
    capacity: 1
    refill: 1/s
    mode: shadow
"#;

#[test]
fn shadow_decides_but_never_rejects() {
    let r = rig(SHADOW);
    let d = |u: &str| {
        r.engine
            .decide("api", &[[("user", u)]], 1, None)
            .unwrap_or_else(|e| panic!("{e}"))
    };
    let first = d("a");
    assert!(first.allowed);
    assert_eq!(first.limits[1].mode, "shadow");
    assert!(!first.limits[1].would_reject());
    let second = d("a");
    // The shadow limit would have rejected; the request passes anyway.
    assert!(second.allowed);
    assert!(second.limits[1].would_reject());
    assert_eq!(second.limits[0].decision.map(|d| d.remaining()), Some(0));
    let third = d("a");
    assert!(!third.allowed);
    assert_eq!(third.limits[0].mode, "enforce");
}

#[test]
fn shadow_is_not_charged_when_the_request_is_rejected() {
    let r = rig(&SHADOW.replace("capacity: 1\n", "capacity: 5\n"));
    let d = || {
        r.engine
            .decide("api", &[[("user", "a")]], 1, None)
            .unwrap_or_else(|e| panic!("{e}"))
    };
    d();
    d();
    let rejected = d();
    assert!(!rejected.allowed);
    // Uncharged, a shadow decision reports what a charge would leave: 5 - 2 - 1.
    assert_eq!(rejected.limits[1].decision.map(|d| d.remaining()), Some(2));
    // And the rejection really charged nothing: the shadow bucket still holds 3.
    let explained = r.engine.explain("api", &[[("user", "a")]], 1);
    assert!(explained.is_ok_and(|o| o.limits[1].decision.map(|d| d.remaining()) == Some(2)));
}

/// The rejection reported for a cost a bucket can never hold: shown empty, retry and reset both
/// the limit's time to full.
fn assert_never_fits(decision: Option<tollgate::Decision>, capacity: u64, time_to_full: Duration) {
    let Some(d) = decision else {
        panic!("no decision reported")
    };
    assert!(!d.allowed());
    assert_eq!(d.limit().capacity(), capacity);
    assert_eq!(
        (d.remaining(), d.retry_after(), d.reset_after()),
        (0, Some(time_to_full), time_to_full)
    );
}

#[test]
fn shadow_limit_smaller_than_cost_does_not_fail_the_request() {
    // enforced: 10 tokens; trial (shadow): 1 token.
    let r = rig(&SHADOW.replace("capacity: 2\n", "capacity: 10\n"));
    let outcome = r
        .engine
        .decide("api", &[[("user", "a")]], 2, None)
        .unwrap_or_else(|e| panic!("a shadow limit broke the request: {e}"));
    assert!(outcome.allowed);
    assert_eq!(outcome.limits[0].decision.map(|d| d.remaining()), Some(8));
    assert_eq!(outcome.limits[1].mode, "shadow");
    assert!(outcome.limits[1].would_reject());
    assert_never_fits(outcome.limits[1].decision, 1, Duration::from_secs(1));
    // The shadow bucket was charged nothing: a cost of 1 still fits it.
    let after = r.engine.explain("api", &[[("user", "a")]], 1);
    assert!(after.is_ok_and(|o| !o.limits[1].would_reject()));
    // Two descriptors on the shadow bucket sum past its capacity: the same, not an error.
    let summed = r
        .engine
        .decide("api", &[[("user", "a")], [("user", "a")]], 1, None);
    assert!(summed.is_ok_and(|o| o.allowed && o.limits[1].would_reject()));
}

#[test]
fn outside_rollout_limit_smaller_than_cost_does_not_fail_the_request() {
    let text = "limits:\n  - name: canary\n    domain: api\n    key: [user]\n    capacity: 1\n    refill: 1/s\n    rollout: 0%\n";
    let r = rig(text);
    // Far above the capacity too: the figures must not overflow.
    for cost in [2, u64::MAX] {
        let outcome = r
            .engine
            .decide("api", &[[("user", "a")]], cost, None)
            .unwrap_or_else(|e| panic!("a limit at rollout 0% broke the request: {e}"));
        assert!(outcome.allowed);
        assert_eq!(outcome.limits[0].mode, "rollout");
        assert_never_fits(outcome.limits[0].decision, 1, Duration::from_secs(1));
    }
    let after = r.engine.explain("api", &[[("user", "a")]], 1);
    assert!(after.is_ok_and(|o| !o.limits[0].would_reject()));
    // Enforced, the same cost is still an error: nothing could ever grant it.
    let enforced = rig(&text.replace("    rollout: 0%\n", ""));
    let err = enforced.engine.decide("api", &[[("user", "a")]], 2, None);
    assert!(err.is_err_and(|e| e.to_string().contains("canary")));
}

#[test]
fn outside_the_rollout_is_decided_like_shadow() {
    let r = rig(&TWO.replace("    capacity: 3\n", "    capacity: 1\n    rollout: 50%\n"));
    let mut modes = std::collections::BTreeMap::new();
    for i in 0..200 {
        let u = format!("u{i}");
        let t = format!("t{i}");
        decide(&r.engine, &user(&u, &t));
        let outcome = r.engine.decide(
            "api",
            &[[("user", u.as_str()), ("tenant", t.as_str())]],
            1,
            None,
        );
        let Ok(outcome) = outcome else { panic!() };
        let mode = outcome.limits[0].mode;
        // Inside: second request rejected; outside: allowed, but reported short.
        assert_eq!(outcome.allowed, mode == "rollout", "{u}");
        assert!(outcome.limits[0].would_reject());
        *modes.entry(mode).or_insert(0) += 1;
    }
    assert!(
        modes.get("rollout").is_some_and(|&n| n > 60 && n < 140),
        "{modes:?}"
    );
}

const EXEMPT: &str = r#"
version: "e"
limits:
  - name: per-user
    domain: api
    key: [tenant, user]
    capacity: 1
    refill: 1/d
exemptions:
  - limit: per-user
    when: {tenant: acme}
    owner: ops@example.com
    reason: launch week
    expires: 2026-12-31T00:00:00Z
"#;

#[test]
fn an_exemption_keeps_its_count_across_reloads_while_unchanged() {
    let r = rig(EXEMPT);
    let acme = [("tenant", "acme"), ("user", "u")];
    let uses = |r: &Rig| r.engine.current().exemptions()[0].uses();
    let decide = |r: &Rig| {
        let outcome = r.engine.decide("api", &[acme], 1, None);
        assert!(outcome.is_ok_and(|o| o.limits[0].mode == "exempt"));
    };
    decide(&r);
    decide(&r);
    // Another version, the exemption as it was: the count goes on.
    let v2 = EXEMPT
        .replace("version: \"e\"", "version: \"e2\"")
        .replace("capacity: 1\n", "capacity: 2\n");
    assert!(r.engine.load("p.yaml", &v2).is_ok());
    decide(&r);
    assert_eq!(uses(&r), 3);
    let last = r
        .audit
        .events()
        .into_iter()
        .rfind(|e| e["event"] == "exemption_used");
    assert_eq!(last.map(|e| e["uses"].clone()), Some(serde_json::json!(3)));
    // Rolled back, the first version's exemption has the count too.
    assert!(r.engine.rollback().is_ok());
    decide(&r);
    assert_eq!(uses(&r), 4);
    // A changed exemption (a new reason) is a new one: counted from zero.
    let v3 = EXEMPT
        .replace("version: \"e\"", "version: \"e3\"")
        .replace("launch week", "launch week, extended");
    assert!(r.engine.load("p.yaml", &v3).is_ok());
    decide(&r);
    assert_eq!(uses(&r), 1);
}

#[test]
fn an_exemption_s_expiry_is_audited_once_even_across_reloads() {
    let r = rig(EXEMPT);
    let acme = [("tenant", "acme"), ("user", "u")];
    assert!(r.engine.decide("api", &[acme], 1, None).is_ok());
    let expired = |r: &Rig| {
        r.audit
            .events()
            .into_iter()
            .filter(|e| e["event"] == "exemption_expired")
            .collect::<Vec<_>>()
    };
    assert_eq!(r.engine.report_expired_exemptions(), 0, "not yet");
    assert!(expired(&r).is_empty());

    r.wall
        .set(UnixTime::parse_rfc3339("2026-12-31T00:00:01Z").unwrap_or_default());
    assert_eq!(r.engine.report_expired_exemptions(), 1);
    assert_eq!(r.engine.report_expired_exemptions(), 0, "once");
    let events = expired(&r);
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["limit"], "per-user");
    assert_eq!(events[0]["owner"], "ops@example.com");
    assert_eq!(events[0]["expired"], "2026-12-31T00:00:00Z");
    assert_eq!(events[0]["uses"], 1);
    assert_eq!(events[0]["policy_version"], "e");

    // The same exemption in a new version was reported already; a new one is reported anew.
    let v2 = EXEMPT.replace("version: \"e\"", "version: \"e2\"");
    assert!(r.engine.load("p.yaml", &v2).is_ok());
    assert_eq!(r.engine.report_expired_exemptions(), 0);
    let v3 = EXEMPT
        .replace("version: \"e\"", "version: \"e3\"")
        .replace("launch week", "launch week, extended");
    assert!(r.engine.load("p.yaml", &v3).is_ok());
    assert_eq!(r.engine.report_expired_exemptions(), 1);
    assert_eq!(expired(&r).len(), 2);
}

#[test]
fn exemptions_are_counted_audited_and_expire_by_themselves() {
    let r = rig(EXEMPT);
    let acme = [("tenant", "acme"), ("user", "u")];
    for _ in 0..5 {
        let outcome = r
            .engine
            .decide("api", &[acme], 1, None)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(outcome.allowed);
        assert_eq!(outcome.limits[0].mode, "exempt");
        assert!(outcome.limits[0].decision.is_none());
        assert_eq!(
            outcome.limits[0].exempted_by.as_deref(),
            Some("ops@example.com")
        );
    }
    // explain does not count.
    let explained = r.engine.explain("api", &[acme], 1);
    assert!(explained.is_ok_and(|o| o.limits[0].mode == "exempt"));
    assert_eq!(r.engine.current().exemptions()[0].uses(), 5);
    let events = r.audit.events();
    let used: Vec<_> = events
        .iter()
        .filter(|e| e["event"] == "exemption_used")
        .collect();
    assert_eq!(used.len(), 5);
    assert_eq!(used[4]["uses"], 5);
    assert_eq!(used[4]["owner"], "ops@example.com");
    assert_eq!(used[4]["bucket_key"], "per-user|acme|u");
    assert_eq!(used[4]["expires"], "2026-12-31T00:00:00Z");

    // Past the expiry, with nothing reloaded, the limit applies again.
    r.wall
        .set(UnixTime::parse_rfc3339("2026-12-31T00:00:00Z").unwrap_or_default());
    let first = r
        .engine
        .decide("api", &[acme], 1, None)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(first.limits[0].mode, "enforce");
    assert!(first.allowed);
    assert!(
        r.engine
            .decide("api", &[acme], 1, None)
            .is_ok_and(|o| !o.allowed)
    );
    assert_eq!(r.engine.current().exemptions()[0].uses(), 5);
}

#[test]
fn reload_refuses_bad_files_and_keeps_the_last_good() {
    let path = temp_file("reload");
    let r = rig_with(TWO, Some(path.clone()));
    assert_eq!(r.engine.status().version, "1");
    for _ in 0..3 {
        decide(&r.engine, &user("a", "t"));
    }

    // A broken file: refused, version 1 stays, the error is kept for status.
    std::fs::write(
        &path,
        TWO.replace("version: \"1\"", "version: \"2\"")
            .replace("refill: 1/s\n  - name", "refill: 1/x\n  - name"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let err = r.engine.reload();
    assert!(err.is_err());
    let status = r.engine.status();
    assert_eq!(status.version, "1");
    let (_, message) = status.last_error.unwrap_or_default();
    assert!(
        message.contains("policy.yaml:8:13: limits[0].refill"),
        "{message}"
    );
    assert_eq!(decide(&r.engine, &user("a", "t")).2, "1");

    // A good file: in force, error cleared, balances of unchanged limits kept.
    let v2 = TWO.replace("version: \"1\"", "version: \"2\"");
    std::fs::write(&path, &v2).unwrap_or_else(|e| panic!("{e}"));
    let loaded = r.engine.reload();
    assert!(loaded.is_ok_and(|p| p.version() == "2"));
    let status = r.engine.status();
    assert!(status.last_error.is_none());
    assert_eq!(status.history, ["1"]);
    let (allowed, _, version) = decide(&r.engine, &user("a", "t"));
    assert_eq!(
        (allowed, version.as_str()),
        (false, "2"),
        "a reload must not refill buckets"
    );

    // The same content again is not a new load.
    assert!(r.engine.reload().is_ok());
    assert_eq!(r.engine.status().history, ["1"]);

    // Rollback puts 1 back, and the rolled-back-from version is gone.
    assert!(r.engine.rollback().is_ok_and(|p| p.version() == "1"));
    assert_eq!(decide(&r.engine, &user("z", "y")).2, "1");
    assert!(r.engine.rollback().is_err());
    assert!(r.engine.status().history.is_empty());
    // The file still holds 2; reloading it puts it back in force.
    assert!(r.engine.reload().is_ok_and(|p| p.version() == "2"));

    assert_eq!(
        r.audit.kinds(),
        ["loaded", "refused", "loaded", "rolled_back", "loaded"]
    );
    let events = r.audit.events();
    assert_eq!(events[1]["kept_version"], "1");
    assert_eq!(events[2]["previous"], "1");
    assert_eq!(events[3]["from"], "2");
    let _ = std::fs::remove_dir_all(path.parent().unwrap_or(&path));
}

#[test]
fn missing_file_is_refused_too() {
    let path = temp_file("missing");
    let r = rig_with(TWO, Some(path.clone()));
    let _ = std::fs::remove_file(&path);
    assert!(r.engine.reload().is_err());
    assert_eq!(r.engine.status().version, "1");
    assert!(r.engine.status().last_error.is_some());
    let _ = std::fs::remove_dir_all(path.parent().unwrap_or(&path));
}

#[test]
fn history_keeps_the_last_n_versions() {
    let r = rig(TWO);
    for v in 2..=6 {
        let text = TWO.replace("version: \"1\"", &format!("version: \"{v}\""));
        assert!(r.engine.load("p.yaml", &text).is_ok());
    }
    assert_eq!(r.engine.status().history, ["3", "4", "5"]);
    assert!(r.engine.rollback().is_ok_and(|p| p.version() == "5"));
    assert_eq!(r.engine.status().version, "5");
}

#[test]
fn reload_under_concurrent_decisions() {
    let r = rig(&TWO.replace("capacity: 3", "capacity: 1000"));
    let v2 = TWO
        .replace("capacity: 3", "capacity: 1000")
        .replace("version: \"1\"", "version: \"2\"");
    let v1 = TWO.replace("capacity: 3", "capacity: 1000");
    let engine = &r.engine;
    let allowed = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..3 {
            let allowed = &allowed;
            s.spawn(move || {
                for i in 0..600 {
                    let outcome = engine
                        .decide(
                            "api",
                            &[[("user", "shared"), ("tenant", format!("t{t}-{i}").as_str())]],
                            1,
                            None,
                        )
                        .unwrap_or_else(|e| panic!("{e}"));
                    assert!(matches!(&*outcome.policy_version, "1" | "2"));
                    if outcome.allowed {
                        allowed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            });
        }
        s.spawn(|| {
            for i in 0..200 {
                let text = if i % 2 == 0 { &v2 } else { &v1 };
                assert!(engine.load("p.yaml", text).is_ok());
            }
        });
    });
    // The shared bucket is keyed by name, not version: reloads never refilled it.
    assert_eq!(allowed.into_inner(), 1000);
}

#[test]
fn two_descriptors_on_one_bucket_charge_it_once_for_both() {
    let r = rig(TWO);
    let outcome = r
        .engine
        .decide("api", &[[("user", "a")], [("user", "a")]], 1, None)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(outcome.allowed);
    assert_eq!(outcome.limits.len(), 2);
    assert_eq!(outcome.limits[1].descriptor, 1);
    assert_eq!(decide(&r.engine, &user("a", "t")).1[0].2, 0);
}

#[test]
fn retries_with_a_request_id_are_free() {
    let r = rig(TWO);
    let d = [("user", "a")];
    for _ in 0..3 {
        assert!(
            r.engine
                .decide("api", &[d], 1, Some("req-1"))
                .is_ok_and(|o| o.allowed)
        );
    }
    assert_eq!(decide(&r.engine, &user("a", "t")).1[0].2, 1);
}

const CHANGE: &str = r#"
version: "1"
limits:
  - name: per-user
    domain: api
    key: [user]
    capacity: 20
    refill: 10/s
    overrides:
      - name: gold
        when: {tier: gold}
        capacity: 40
  - name: untouched
    domain: api
    key: [team]
    capacity: 20
    refill: 1/d
"#;

fn remaining(engine: &PolicyEngine, d: &[(&str, &str)]) -> Vec<u64> {
    engine
        .explain("api", &[d], 1)
        .unwrap_or_else(|e| panic!("{e}"))
        .limits
        .iter()
        // Explaining a cost of 1 reports the balance after a hypothetical charge when it fits.
        .map(|l| {
            l.decision
                .map_or(0, |d| d.remaining() + u64::from(d.allowed()))
        })
        .collect()
}

#[test]
fn a_capacity_change_refills_under_the_old_rate_then_clamps() {
    let r = rig(CHANGE);
    let plain = [("user", "a")];
    let gold = [("user", "a"), ("tier", "gold")];
    // Empty the plain bucket (20) and take 30 of gold's 40.
    assert!(
        r.engine
            .decide("api", &[plain], 20, None)
            .is_ok_and(|o| o.allowed)
    );
    assert!(
        r.engine
            .decide("api", &[gold], 20, None)
            .is_ok_and(|o| o.allowed)
    );
    assert!(
        r.engine
            .decide("api", &[gold], 10, None)
            .is_ok_and(|o| o.allowed)
    );
    let team = [("team", "t")];
    assert!(
        r.engine
            .decide("api", &[team], 20, None)
            .is_ok_and(|o| o.allowed)
    );
    assert_eq!(remaining(&r.engine, &plain), [0]);
    assert_eq!(remaining(&r.engine, &gold), [10]);
    assert_eq!(remaining(&r.engine, &team), [0]);

    // 0.5 s later the limit shrinks to 3 tokens at 1/s, gold to 8 at 1/s.
    r.clock.advance(Duration::from_millis(500));
    let v2 = CHANGE
        .replace("version: \"1\"", "version: \"2\"")
        .replace(
            "capacity: 20\n    refill: 10/s",
            "capacity: 3\n    refill: 1/s",
        )
        .replace("capacity: 40", "capacity: 8");
    assert!(r.engine.load("p.yaml", &v2).is_ok());
    // Plain: 0 + 0.5 s * 10/s = 5 under the old rate, clamped to 3.
    // Gold: 10 + 5 = 15 under the old rate, clamped to 8.
    // Untouched: its bucket kept its balance (0 tokens, refilling 1/d).
    assert_eq!(remaining(&r.engine, &plain), [3]);
    assert_eq!(remaining(&r.engine, &gold), [8]);
    assert_eq!(remaining(&r.engine, &team), [0]);
    assert_eq!(
        r.last_changed_limits(),
        Some(serde_json::json!(["per-user"]))
    );

    // Growing back (rollback to 1) keeps the balance: 3 tokens, not a full 20.
    assert!(
        r.engine
            .decide("api", &[plain], 2, None)
            .is_ok_and(|o| o.allowed)
    );
    assert!(r.engine.rollback().is_ok());
    assert_eq!(remaining(&r.engine, &plain), [1]);
}

const AUDITED: &str = r#"
version: "a0"
limits:
  - name: blocked
    domain: api
    key: [ip]
    capacity: 1
    refill: 1/s
  - name: tiers
    domain: api
    key: [user]
    capacity: 20
    refill: 10/s
    overrides:
      - name: gold
        when: {tier: gold}
        capacity: 20
      - name: free
        when: {tier: free}
        capacity: 5
"#;

#[test]
fn the_load_audit_names_a_limit_for_each_kind_of_change_parameters_hide() {
    // Each change leaves every rate as it was (a deny limit's nominal rate is 1/s, and an
    // unlimited or denying override keeps its limit's), so only the change itself can name it.
    let cases: [(&str, &str, &[&str]); 6] = [
        ("version: \"a0\"", "version: \"a0\"", &[]),
        ("capacity: 1\n    refill: 1/s", "deny: true", &["blocked"]),
        ("name: gold", "name: golden", &["tiers"]),
        (
            "capacity: 20\n      - name: free",
            "unlimited: true\n      - name: free",
            &["tiers"],
        ),
        (
            "capacity: 20\n      - name: free",
            "deny: true\n      - name: free",
            &["tiers"],
        ),
        (
            "capacity: 5\n",
            "capacity: 5\n      - name: trial\n        when: {tier: trial}\n        capacity: 5\n",
            &["tiers"],
        ),
    ];
    for (from, to, named) in cases {
        let r = rig(AUDITED);
        let next = AUDITED
            .replace("version: \"a0\"", "version: \"a1\"")
            .replace(from, to);
        assert!(r.engine.load("p.yaml", &next).is_ok(), "{to}");
        assert_eq!(
            r.last_changed_limits(),
            Some(serde_json::json!(named)),
            "{from:?} -> {to:?}"
        );
    }
}

const FAILURE: &str = r#"
version: "f"
defaults:
  emergency: 2/s
limits:
  - name: open-one
    domain: api
    key: [user]
    capacity: 100
    refill: 100/s
    failure_mode: open
  - name: closed-one
    domain: api
    key: [tenant]
    capacity: 100
    refill: 100/s
  - name: watching
    domain: api
    key: [user]
    capacity: 1
    refill: 1/s
    mode: shadow
"#;

#[test]
fn degraded_decisions_follow_failure_modes_and_are_audited() {
    let r = rig(FAILURE);
    // Open: the emergency budget (2 tokens, 2/s), never unlimited.
    let d = |cost| {
        r.engine
            .decide_degraded("api", &[[("user", "u")]], cost, "store timeout")
            .unwrap_or_else(|e| panic!("{e}"))
    };
    let first = d(1);
    assert!(first.allowed && first.degraded && !first.failed_closed);
    assert_eq!(
        first.limits[0].decision.map(|d| d.limit().capacity()),
        Some(2)
    );
    assert_eq!(first.limits[1].mode, "shadow");
    assert!(first.limits[1].decision.is_none());
    assert!(d(1).allowed);
    assert!(!d(1).allowed);
    // A cost above the emergency capacity is rejected, not an error.
    r.clock.advance(Duration::from_secs(5));
    assert!(!d(3).allowed);
    // Closed: denied, distinguishably.
    let closed = r
        .engine
        .decide_degraded("api", &[[("tenant", "t"), ("user", "v")]], 1, "store down")
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(!closed.allowed && closed.failed_closed);
    // Decisions against the store were not touched by any of it.
    let normal = r.engine.decide("api", &[[("user", "u")]], 1, None);
    assert!(normal.is_ok_and(|o| o.allowed
        && !o.degraded
        && o.limits[0].decision.map(|d| d.remaining()) == Some(99)));

    let degraded: Vec<_> = r
        .audit
        .events()
        .into_iter()
        .filter(|e| e["event"] == "degraded")
        .collect();
    assert_eq!(degraded.len(), 6, "{degraded:?}");
    assert_eq!(degraded[0]["reason"], "store timeout");
    assert_eq!(degraded[0]["failure_mode"], "open");
    assert_eq!(degraded[0]["allowed"], true);
    assert_eq!(
        (&degraded[3]["failure_mode"], &degraded[3]["allowed"]),
        (&"open".into(), &false.into())
    );
    // Both limits of the closed request are logged, each with its own mode.
    assert_eq!(degraded[4]["limit"], "open-one");
    assert_eq!(degraded[5]["limit"], "closed-one");
    assert_eq!(degraded[5]["failure_mode"], "closed");
    assert_eq!(degraded[5]["allowed"], false);
    // The closed request took nothing from v's emergency budget (2): it is whole.
    let v = r
        .engine
        .decide_degraded("api", &[[("user", "v")]], 2, "store down")
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(v.allowed, "{v:?}");
}

#[test]
fn degraded_two_descriptors_on_one_bucket_charge_summed_cost() {
    let text = "limits:\n  - name: per-user\n    domain: api\n    key: [user]\n    capacity: 100\n    refill: 100/s\n    failure_mode: open\n    emergency: 2/s\n";
    let r = rig(text);
    let first = r
        .engine
        .decide_degraded("api", &[[("user", "u")], [("user", "u")]], 1, "down")
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(first.allowed);
    // Both matches report the one bucket's decision, after both tokens.
    for limit in &first.limits {
        assert_eq!(limit.decision.map(|d| d.remaining()), Some(0));
    }
    // Two tokens of the emergency budget (2) are gone: the next request must be rejected.
    let second = r
        .engine
        .decide_degraded("api", &[[("user", "u")]], 1, "down")
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        !second.allowed,
        "emergency budget 2/s admitted 3 tokens in one instant"
    );
    // Summed past the emergency capacity: rejected as a whole, as one cost of 3 would be.
    r.clock.advance(Duration::from_secs(1));
    let over = r
        .engine
        .decide_degraded(
            "api",
            &[[("user", "u")], [("user", "u")], [("user", "u")]],
            1,
            "down",
        )
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(!over.allowed);
}

#[test]
fn degraded_cost_above_the_emergency_budget_is_a_reported_rejection() {
    let text = "limits:\n  - name: per-user\n    domain: api\n    key: [user]\n    capacity: 100\n    refill: 100/s\n    failure_mode: open\n    emergency: 2/s\n  - name: per-tenant\n    domain: api\n    key: [tenant]\n    capacity: 100\n    refill: 100/s\n    failure_mode: open\n    emergency: 10/s\n  - name: per-region\n    domain: api\n    key: [region]\n    capacity: 100\n    refill: 100/s\n    failure_mode: open\n    emergency: 3/s\n";
    let r = rig(text);
    let d = [("user", "u"), ("tenant", "t"), ("region", "eu")];
    let outcome = r
        .engine
        .decide_degraded("api", &[d], 3, "down")
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(!outcome.allowed && outcome.degraded && !outcome.failed_closed);
    // The limit whose emergency budget (2) cannot hold 3 reports the rejection, with real
    // figures: not "no decision", which reads as allowed.
    assert_eq!(&*outcome.limits[0].name, "per-user");
    assert!(outcome.limits[0].would_reject());
    assert_never_fits(outcome.limits[0].decision, 2, Duration::from_secs(1));
    // The other budget had room: it says so, uncharged.
    let tenant = outcome.limits[1].decision;
    assert!(tenant.is_some_and(|d| d.allowed() && d.limit().capacity() == 10));
    // So had the one whose budget is exactly the cost.
    let region = outcome.limits[2].decision;
    assert!(
        region.is_some_and(|d| d.allowed() && d.remaining() == 0),
        "{region:?}"
    );
    // Nothing was charged: both budgets are still full.
    let next = r
        .engine
        .decide_degraded("api", &[d], 2, "down")
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(next.allowed);
    let left: Vec<_> = next
        .limits
        .iter()
        .map(|l| l.decision.map(|d| d.remaining()))
        .collect();
    assert_eq!(left, [Some(0), Some(8), Some(1)]);
    // Far above every capacity: still a rejection with in-range figures, never an error.
    let huge = r.engine.decide_degraded("api", &[d], u64::MAX, "down");
    assert!(huge.is_ok_and(|o| !o.allowed && o.limits.iter().all(|l| l.would_reject())));
    let degraded: Vec<_> = r
        .audit
        .events()
        .into_iter()
        .filter(|e| e["event"] == "degraded")
        .collect();
    assert_eq!(degraded[0]["allowed"], false);
}

#[test]
fn a_sweep_drops_refilled_buckets_and_their_tables() {
    let r = rig(TWO);
    for u in 0..2_000 {
        assert!(decide(&r.engine, &user(&format!("u{u}"), &format!("t{u}"))).0);
    }
    let peak = r.engine.memory_stats();
    assert_eq!(peak.live_buckets, 4_000);
    // Nothing is full yet: the sweep keeps every bucket.
    assert_eq!(r.engine.sweep(), 0);
    // One token each, back a second later: every bucket is full, and goes.
    r.clock.advance(Duration::from_secs(1));
    assert_eq!(r.engine.sweep(), 4_000);
    let after = r.engine.memory_stats();
    assert_eq!((after.live_buckets, after.slots), (0, 0), "{after:?}");
    assert!(peak.slots > 4_000, "{peak:?}");
    // Dropped buckets were full: the next request sees a full bucket.
    let (allowed, limits, _) = decide(&r.engine, &user("u0", "t0"));
    assert!(allowed);
    assert_eq!(limits[0], ("per-user".into(), true, 2));
}

/// A shared store that answers every bucket but the shadow limit's: down for those.
struct ShadowDown(tollgate::LocalStore<ManualClock>);

impl ShadowDown {
    fn reach(request: &tollgate::CheckRequest<'_>) -> Result<(), tollgate::Error> {
        if request
            .takes
            .iter()
            .any(|take| take.key.starts_with("trial"))
        {
            return Err(tollgate::Error::StoreUnavailable {
                reason: tollgate::Unavailable::Timeout,
            });
        }
        Ok(())
    }
}

impl tollgate::Store for ShadowDown {
    async fn check(
        &self,
        request: tollgate::CheckRequest<'_>,
    ) -> Result<Vec<tollgate::Decision>, tollgate::Error> {
        Self::reach(&request)?;
        self.0.check(request).await
    }

    async fn peek(
        &self,
        request: tollgate::CheckRequest<'_>,
    ) -> Result<Vec<tollgate::Decision>, tollgate::Error> {
        Self::reach(&request)?;
        self.0.peek(request).await
    }

    async fn settle(
        &self,
        request: tollgate::CheckRequest<'_>,
        refunds: &[u64],
    ) -> Result<tollgate::Settlement, tollgate::Error> {
        Self::reach(&request)?;
        self.0.settle(request, refunds).await
    }
}

/// The store failing on a shadow limit after the enforced limit was charged must not fail the
/// request: the caller would then decide it again without the store, charging twice.
#[test]
fn a_store_failing_on_a_shadow_limit_does_not_fail_the_request() {
    let r = rig(SHADOW);
    let store = ShadowDown(tollgate::LocalStore::new(r.clock.clone()));
    let request = [[("user", "a")]];
    let outcome = block_on_ready(r.engine.decide_on(&store, "api", &request, 1, None))
        .unwrap_or_else(|e| panic!("a shadow limit's store error failed the request: {e}"));
    assert!(outcome.allowed);
    assert_eq!(outcome.limits[0].decision.map(|d| d.remaining()), Some(1));
    assert_eq!(outcome.limits[1].mode, "shadow");
    assert!(outcome.limits[1].decision.is_none());
}

/// A shared store that records what each take carries over: (bucket key, old key, old
/// capacity, time since the change).
#[derive(Default)]
struct Carries(Mutex<Vec<(String, String, u64, Duration)>>);

impl Carries {
    fn record(&self, request: &tollgate::CheckRequest<'_>) {
        let mut seen = self.0.lock();
        for take in request.takes {
            if let Some(carry) = take.carry {
                let old = carry.key.to_owned();
                seen.push((
                    take.key.to_owned(),
                    old,
                    carry.limit.capacity(),
                    carry.since,
                ));
            }
        }
    }

    /// What the last request carried, emptied for the next.
    fn take(&self) -> Vec<(String, String, u64, Duration)> {
        std::mem::take(&mut *self.0.lock())
    }

    /// Decides `d` (cost 1) through this store: what the request carried.
    fn decide(
        &self,
        engine: &PolicyEngine,
        d: &[(&str, &str)],
    ) -> Vec<(String, String, u64, Duration)> {
        block_on_ready(engine.decide_on(self, "api", &[d], 1, None))
            .unwrap_or_else(|e| panic!("{e}"));
        self.take()
    }
}

impl tollgate::Store for Carries {
    async fn check(
        &self,
        request: tollgate::CheckRequest<'_>,
    ) -> Result<Vec<tollgate::Decision>, tollgate::Error> {
        self.record(&request);
        Ok(request
            .takes
            .iter()
            .map(|take| tollgate::Decision::from_deficit(true, *take.limit, take.cost, 0))
            .collect())
    }

    async fn peek(
        &self,
        request: tollgate::CheckRequest<'_>,
    ) -> Result<Vec<tollgate::Decision>, tollgate::Error> {
        self.check(request).await
    }

    async fn settle(
        &self,
        request: tollgate::CheckRequest<'_>,
        _refunds: &[u64],
    ) -> Result<tollgate::Settlement, tollgate::Error> {
        Ok(tollgate::Settlement {
            status: tollgate::SettleStatus::NotFound,
            decisions: self.check(request).await?,
        })
    }
}

#[test]
fn a_shared_store_is_handed_the_old_bucket_until_the_new_one_would_have_refilled() {
    let r = rig(CHANGE);
    let store = Carries::default();
    let decide = |d: &[(&str, &str)]| store.decide(&r.engine, d);
    let (plain, gold, team) = (
        [("user", "a"), ("tier", "")],
        [("user", "a"), ("tier", "gold")],
        [("team", "t"), ("tier", "")],
    );
    assert_eq!(decide(&plain), []);

    // The base limit changes (20 at 10/s to 30 at 10/s: 3 s to refill); gold does not.
    let v2 = CHANGE.replace("version: \"1\"", "version: \"2\"").replace(
        "capacity: 20\n    refill: 10/s",
        "capacity: 30\n    refill: 10/s",
    );
    assert!(r.engine.load("p.yaml", &v2).is_ok());
    r.clock.advance(Duration::from_secs(1));
    let carried = decide(&plain);
    assert_eq!(carried.len(), 1, "{carried:?}");
    let (key, old, capacity, since) = &carried[0];
    assert!(key.starts_with("per-user|{a}@"), "{key}");
    assert!(old.starts_with("per-user|{a}@") && old != key, "{old}");
    assert_eq!((*capacity, *since), (20, Duration::from_secs(1)));
    assert_eq!(decide(&gold), [], "the override did not change");
    assert_eq!(decide(&team), []);

    // A reload that changes another limit keeps the first change's carry, with its own time.
    let v3 = v2
        .replace("version: \"2\"", "version: \"3\"")
        .replace("refill: 1/d", "refill: 2/d");
    assert!(r.engine.load("p.yaml", &v3).is_ok());
    r.clock.advance(Duration::from_secs(1));
    let carried = decide(&plain);
    assert_eq!(carried.len(), 1, "{carried:?}");
    assert_eq!(carried[0].3, Duration::from_secs(2));
    let carried = decide(&team);
    assert_eq!(carried.len(), 1, "{carried:?}");
    assert_eq!(carried[0].3, Duration::from_secs(1));

    // 3 s after its change the new bucket would be full from empty: nothing left to carry.
    r.clock.advance(Duration::from_secs(1));
    assert_eq!(decide(&plain), []);
    assert_eq!(decide(&team).len(), 1, "1/d takes 10 days to refill");

    // A rollback is a change too: back to version 2, 2/d to 1/d carries the other way.
    assert!(r.engine.rollback().is_ok());
    let carried = decide(&team);
    assert_eq!(carried.len(), 1, "{carried:?}");
    assert_eq!(carried[0].3, Duration::ZERO);
    assert_eq!(decide(&plain), []);
}

/// A limit grown by a reload keeps what its buckets held: a drained subject does not find a
/// full bucket under the new parameters.
#[test]
fn a_capacity_change_upward_keeps_the_balance() {
    let r = rig(CHANGE);
    let plain = [("user", "a")];
    assert!(
        r.engine
            .decide("api", &[plain], 20, None)
            .is_ok_and(|o| o.allowed)
    );
    r.clock.advance(Duration::from_millis(500));
    let v2 = CHANGE.replace("version: \"1\"", "version: \"2\"").replace(
        "capacity: 20\n    refill: 10/s",
        "capacity: 30\n    refill: 10/s",
    );
    assert!(r.engine.load("p.yaml", &v2).is_ok());
    // 0 + 0.5 s * 10/s under the old parameters, within the new capacity.
    assert_eq!(remaining(&r.engine, &plain), [5]);
}

/// A change to an override, then one to its limit's own parameters: a shared store is handed
/// each one's old bucket, the second change keeping the first's carry.
#[test]
fn an_override_s_carry_outlives_a_later_change_to_its_limit() {
    let v1 = CHANGE.replace(
        "        capacity: 40\n",
        "        capacity: 40\n      - name: silver\n        when: {tier: silver}\n        capacity: 30\n",
    );
    let r = rig(&v1);
    let store = Carries::default();
    let decide = |d: &[(&str, &str)]| store.decide(&r.engine, d);
    let (plain, gold) = (
        [("user", "a"), ("tier", "")],
        [("user", "a"), ("tier", "gold")],
    );
    // Gold grows from 40 to 60 (6 s to refill at the limit's 10/s); silver, beside it, stays.
    let v2 = v1
        .replace("version: \"1\"", "version: \"2\"")
        .replace("capacity: 40", "capacity: 60");
    assert!(r.engine.load("p.yaml", &v2).is_ok());
    r.clock.advance(Duration::from_secs(1));
    let carried = decide(&gold);
    assert_eq!(carried.len(), 1, "{carried:?}");
    assert!(
        carried[0].0.starts_with("per-user|{a}#gold@"),
        "{carried:?}"
    );
    // Gold's own old capacity, not its sibling's.
    assert_eq!((carried[0].2, carried[0].3), (40, Duration::from_secs(1)));
    assert_eq!(decide(&plain), []);
    assert_eq!(decide(&[("user", "a"), ("tier", "silver")]), []);

    // Then the limit's own capacity, 20 to 30: gold is as it was in version 2.
    let v3 = v2.replace("version: \"2\"", "version: \"3\"").replace(
        "capacity: 20\n    refill: 10/s",
        "capacity: 30\n    refill: 10/s",
    );
    assert!(r.engine.load("p.yaml", &v3).is_ok());
    r.clock.advance(Duration::from_secs(1));
    let carried = decide(&gold);
    assert_eq!(carried.len(), 1, "{carried:?}");
    assert_eq!((carried[0].2, carried[0].3), (40, Duration::from_secs(2)));
    let carried = decide(&plain);
    assert_eq!(carried.len(), 1, "{carried:?}");
    assert_eq!((carried[0].2, carried[0].3), (20, Duration::from_secs(1)));
}

const WINDOWS: &str = r#"
version: "w1"
limits:
  - name: per-minute
    domain: api
    key: [user]
    algorithm: fixed_window
    limit: 3
    window: 1m
    overrides:
      - when: {tier: gold}
        limit: 5
  - name: smooth
    domain: api
    key: [tenant]
    algorithm: sliding_window
    limit: 4
    window: 10s
  - name: metered
    domain: api
    key: [app]
    algorithm: gcra
    capacity: 2
    refill: 1/s
"#;

fn take(engine: &PolicyEngine, d: &[(&str, &str)], cost: u64) -> bool {
    engine
        .decide("api", &[d], cost, None)
        .unwrap_or_else(|e| panic!("{e}"))
        .allowed
}

#[test]
fn window_limits_decide_through_the_policy() {
    let r = rig(WINDOWS);
    let user = [("user", "a")];
    let gold = [("user", "a"), ("tier", "gold")];
    assert!(take(&r.engine, &user, 3));
    assert!(!take(&r.engine, &user, 1));
    // The override is a bucket of its own, with its own limit.
    assert!(take(&r.engine, &gold, 5));
    assert!(!take(&r.engine, &gold, 1));
    let outcome = r
        .engine
        .decide("api", &[user], 1, None)
        .unwrap_or_else(|e| panic!("{e}"));
    let decision = outcome.limits[0]
        .decision
        .unwrap_or_else(|| panic!("decided"));
    assert_eq!(decision.retry_after(), Some(Duration::from_secs(60)));
    assert_eq!(r.engine.current().limits()[0].algorithm(), "fixed_window");
    r.clock.advance(Duration::from_secs(60));
    assert!(take(&r.engine, &user, 3), "the next window starts afresh");

    // The sliding window: 4 at the end of one window still weigh 3.5 at 1.25 s into the next.
    let tenant = [("tenant", "t")];
    r.clock.advance(Duration::from_millis(9_000));
    assert!(take(&r.engine, &tenant, 4));
    r.clock.advance(Duration::from_millis(2_250));
    assert_eq!(remaining(&r.engine, &tenant), [0]);
    r.clock.advance(Duration::from_millis(7_000));
    assert_eq!(remaining(&r.engine, &tenant), [3]);

    // gcra is the token bucket by another name.
    let app = [("app", "x")];
    assert!(take(&r.engine, &app, 2));
    assert!(!take(&r.engine, &app, 1));
    r.clock.advance(Duration::from_secs(1));
    assert!(take(&r.engine, &app, 1));
    assert_eq!(r.engine.current().limits()[2].algorithm(), "gcra");
}

#[test]
fn a_window_keeps_its_counts_when_its_limit_changes_and_restarts_when_its_window_does() {
    let r = rig(WINDOWS);
    let user = [("user", "a")];
    assert!(take(&r.engine, &user, 3));
    // A higher limit per window: the 3 already counted stay counted.
    let v2 = WINDOWS
        .replace("version: \"w1\"", "version: \"w2\"")
        .replace("limit: 3\n", "limit: 4\n");
    assert!(r.engine.load("p.yaml", &v2).is_ok());
    assert_eq!(remaining(&r.engine, &user), [1]);
    assert!(take(&r.engine, &user, 1));
    assert!(!take(&r.engine, &user, 1));
    // A lower one: more counted than it admits, so nothing passes in this window.
    let v3 = v2
        .replace("version: \"w2\"", "version: \"w3\"")
        .replace("limit: 4\n", "limit: 2\n");
    assert!(r.engine.load("p.yaml", &v3).is_ok());
    assert_eq!(remaining(&r.engine, &user), [0]);
    // A new window length is a new bucket.
    let v4 = v3
        .replace("version: \"w3\"", "version: \"w4\"")
        .replace("window: 1m", "window: 2m");
    assert!(r.engine.load("p.yaml", &v4).is_ok());
    assert_eq!(remaining(&r.engine, &user), [2]);
}

// Concurrency limits: leases through the engine.

const LEASES: &str = r#"
version: "l1"
limits:
  - name: exports
    domain: api
    key: [tenant]
    algorithm: concurrency
    max_in_flight: 2
    lease_timeout: 30s
    overrides:
      - name: big
        when: {tier: big}
        max_in_flight: 4
  - name: per-user
    domain: api
    key: [user]
    capacity: 5
    refill: 1/s
"#;

fn acquire(engine: &PolicyEngine, d: &[(&str, &str)], id: &str) -> tollgate_policy::LeaseOutcome {
    engine
        .acquire("api", &[d], id)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Leases held on each limit, as `explain_leases` sees them.
fn in_flight(engine: &PolicyEngine, d: &[(&str, &str)]) -> Vec<u64> {
    engine
        .explain_leases("api", &[d])
        .unwrap_or_else(|e| panic!("{e}"))
        .limits
        .iter()
        .map(|l| l.decision.map_or(u64::MAX, |d| d.in_flight()))
        .collect()
}

#[test]
fn leases_are_held_up_to_max_in_flight_then_refused_with_retry_after() {
    let r = rig(LEASES);
    let t = [("tenant", "t")];
    let first = acquire(&r.engine, &t, "a");
    assert!(first.allowed && first.held && !first.degraded && !first.failed_closed);
    assert_eq!(&*first.policy_version, "l1");
    assert_eq!(first.limits.len(), 1, "rate limits are not leased");
    let limit = &first.limits[0];
    assert_eq!(
        (&*limit.name, limit.bucket_key.as_str(), limit.mode),
        ("exports", "exports|t", "enforce")
    );
    assert_eq!(
        limit.decision.map(|d| (d.in_flight(), d.remaining())),
        Some((1, 1))
    );
    r.clock.advance(Duration::from_secs(10));
    assert!(acquire(&r.engine, &t, "b").held);

    let full = acquire(&r.engine, &t, "c");
    assert!(!full.allowed && !full.held);
    assert!(full.limits[0].would_reject());
    // The oldest lease ends 30 s after it was taken, 10 s ago.
    assert_eq!(full.retry_after(), Some(Duration::from_secs(20)));
    assert_eq!(in_flight(&r.engine, &t), [2], "a refusal holds nothing");
    // Explaining holds nothing either, and says what an acquire would.
    let explained = r.engine.explain_leases("api", &[t]);
    assert!(explained.is_ok_and(|o| !o.allowed && !o.held));
    assert_eq!(in_flight(&r.engine, &t), [2]);
    // Another subject has its own slots.
    assert!(acquire(&r.engine, &[("tenant", "u")], "d").held);
}

#[test]
fn a_release_frees_the_slot_at_once_and_says_whether_it_was_held() {
    let r = rig(LEASES);
    let t = [("tenant", "t")];
    assert!(acquire(&r.engine, &t, "a").held);
    assert!(acquire(&r.engine, &t, "b").held);
    assert!(!acquire(&r.engine, &t, "c").allowed);
    assert!(r.engine.release("a").is_ok_and(|held| held));
    assert!(
        r.engine.release("a").is_ok_and(|held| !held),
        "released twice"
    );
    assert!(r.engine.release("never-taken").is_ok_and(|held| !held));
    assert!(acquire(&r.engine, &t, "c").held);
    assert!(!acquire(&r.engine, &t, "d").allowed);
}

#[test]
fn a_lease_nobody_releases_times_out() {
    let r = rig(LEASES);
    let t = [("tenant", "t")];
    assert!(acquire(&r.engine, &t, "a").held);
    assert!(acquire(&r.engine, &t, "b").held);
    r.clock.advance(Duration::from_millis(29_999));
    assert!(!acquire(&r.engine, &t, "c").allowed);
    r.clock.advance(Duration::from_millis(1));
    assert_eq!(in_flight(&r.engine, &t), [0]);
    assert!(acquire(&r.engine, &t, "c").held);
    // Releasing a lease that timed out changes nothing and says so.
    assert!(r.engine.release("a").is_ok_and(|held| !held));
    // The sweep drops what timed out, from the engine's own lease table too.
    r.clock.advance(Duration::from_secs(30));
    assert_eq!(
        r.engine.sweep(),
        2,
        "b and c timed out; a went with its release"
    );
}

#[test]
fn a_renewal_keeps_a_long_job_s_lease_and_a_timed_out_one_is_not_revived() {
    let r = rig(LEASES);
    let t = [("tenant", "t")];
    assert!(acquire(&r.engine, &t, "a").held);
    assert!(acquire(&r.engine, &t, "b").held);
    // Both leases are 30 s; "a" is renewed at 25 s, so it lasts to 55 s.
    r.clock.advance(Duration::from_secs(25));
    assert!(
        r.engine
            .renew("a")
            .is_ok_and(|left| left == Some(Duration::from_secs(30)))
    );
    r.clock.advance(Duration::from_secs(10));
    assert_eq!(in_flight(&r.engine, &t), [1], "b timed out, a did not");
    assert!(acquire(&r.engine, &t, "c").held);
    assert!(!acquire(&r.engine, &t, "d").allowed);
    // "b" timed out: renewing it revives nothing, and says so.
    assert!(r.engine.renew("b").is_ok_and(|left| left.is_none()));
    assert!(!acquire(&r.engine, &t, "d").allowed);
    assert!(
        r.engine
            .renew("never-taken")
            .is_ok_and(|left| left.is_none())
    );
    assert!(r.engine.renew("not an id").is_err());
    // A lease taken while the store was down is renewed where it lives.
    let failing = rig(FAILING_LEASES);
    let team = [("team", "x")];
    let degraded = failing
        .engine
        .acquire_degraded("api", &[team], "e", "store timeout")
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(degraded.held);
    failing.clock.advance(Duration::from_millis(600));
    let renewed = block_on_ready(failing.engine.renew_on(&Down, "e"));
    assert!(renewed.is_ok_and(|left| left == Some(Duration::from_secs(1))));
}

#[test]
fn an_override_is_a_lease_key_of_its_own_with_its_own_bound() {
    let r = rig(LEASES);
    let big = [("tenant", "t"), ("tier", "big")];
    for id in ["a", "b", "c", "d"] {
        let outcome = acquire(&r.engine, &big, id);
        assert!(outcome.held, "{id}");
        assert_eq!(outcome.limits[0].bucket_key, "exports|t#big");
    }
    let full = acquire(&r.engine, &big, "e");
    assert!(!full.allowed);
    assert_eq!(full.limits[0].decision.map(|d| d.max_in_flight()), Some(4));
    // The base key of the same tenant is untouched.
    assert!(acquire(&r.engine, &[("tenant", "t")], "f").held);
}

#[test]
fn lease_ids_are_checked_before_anything_applies() {
    let r = rig(LEASES);
    for bad in ["", "a b", "é", &"x".repeat(65)] {
        // Even where no concurrency limit applies, and in every call that takes an id.
        let errors = [
            r.engine.acquire("api", &[[("user", "u")]], bad).map(|_| ()),
            r.engine
                .acquire("nowhere", &[[("tenant", "t")]], bad)
                .map(|_| ()),
            r.engine
                .acquire_degraded("api", &[[("tenant", "t")]], bad, "down")
                .map(|_| ()),
            r.engine.release(bad).map(|_| ()),
        ];
        for err in errors {
            match err {
                Err(tollgate_policy::Error::Check {
                    limit,
                    source: tollgate::Error::InvalidLeaseId { len },
                }) => assert_eq!((limit.as_str(), len), ("", bad.len())),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }
    assert_eq!(r.engine.unmatched(), 0, "refused requests are not counted");
    // An id still held is refused, naming no limit; nothing more is held.
    assert!(acquire(&r.engine, &[("tenant", "t")], "a").held);
    match r.engine.acquire("api", &[[("tenant", "u")]], "a") {
        Err(tollgate_policy::Error::Check {
            limit,
            source: tollgate::Error::LeaseIdInUse,
        }) => assert_eq!(limit, ""),
        other => panic!("{other:?}"),
    }
    assert_eq!(in_flight(&r.engine, &[("tenant", "u")]), [0]);
}

const SHADOW_LEASES: &str = r#"
limits:
  - name: enforced
    domain: api
    key: [tenant]
    algorithm: concurrency
    max_in_flight: 3
    lease_timeout: 10s
  - name: trial
    domain: api
    key: [tenant]
    algorithm: concurrency
    max_in_flight: 1
    lease_timeout: 10s
    mode: shadow
  - name: canary
    domain: api
    key: [user]
    algorithm: concurrency
    max_in_flight: 1
    lease_timeout: 10s
    rollout: 0%
"#;

#[test]
fn shadow_and_outside_rollout_never_reject_and_hold_when_free() {
    let r = rig(SHADOW_LEASES);
    let d = [("tenant", "t"), ("user", "u")];
    let first = acquire(&r.engine, &d, "a");
    assert!(first.allowed && first.held);
    let modes: Vec<_> = first.limits.iter().map(|l| l.mode).collect();
    assert_eq!(modes, ["enforce", "shadow", "rollout"]);
    assert!(
        first
            .limits
            .iter()
            .all(|l| l.decision.is_some_and(|d| d.in_flight() == 1))
    );

    // Full, the shadow and canary limits report a would-reject and let the request through.
    let second = acquire(&r.engine, &d, "b");
    assert!(second.allowed && second.held);
    assert!(!second.limits[0].would_reject());
    assert!(second.limits[1].would_reject() && second.limits[2].would_reject());
    assert_eq!(second.retry_after(), None, "allowed");
    // Counted: still one each (held when free, not past the limit), two on the enforced one.
    assert_eq!(in_flight(&r.engine, &d), [2, 1, 1]);
    // Releasing the first lease frees the shadow and canary slots: the next one takes them.
    assert!(r.engine.release("a").is_ok_and(|held| held));
    let third = acquire(&r.engine, &d, "c");
    assert!(third.limits.iter().all(|l| !l.would_reject()));
    assert_eq!(in_flight(&r.engine, &d), [2, 1, 1]);
    // The enforced limit still decides: once full, nothing is held anywhere.
    assert!(acquire(&r.engine, &[("tenant", "t"), ("user", "v")], "d").held);
    let refused = acquire(&r.engine, &[("tenant", "t"), ("user", "w")], "e");
    assert!(!refused.allowed && !refused.held);
    assert_eq!(
        in_flight(&r.engine, &[("tenant", "t"), ("user", "w")]),
        [3, 1, 0]
    );
}

#[test]
fn a_lease_on_soft_limits_alone_that_are_full_holds_nothing() {
    let text = "limits:\n  - name: trial\n    domain: api\n    key: [tenant]\n    algorithm: concurrency\n    max_in_flight: 1\n    lease_timeout: 10s\n    mode: shadow\n";
    let r = rig(text);
    let t = [("tenant", "t")];
    assert!(acquire(&r.engine, &t, "a").held);
    let full = acquire(&r.engine, &t, "b");
    assert!(full.allowed && !full.held, "nothing to release");
    assert!(full.limits[0].would_reject());
}

const EXEMPT_LEASES: &str = r#"
limits:
  - name: exports
    domain: api
    key: [tenant]
    algorithm: concurrency
    max_in_flight: 1
    lease_timeout: 10s
exemptions:
  - limit: exports
    when: {tenant: acme}
    owner: ops@example.com
    reason: migration
    expires: 2026-12-31T00:00:00Z
"#;

#[test]
fn an_exempt_limit_holds_nothing_and_each_use_is_audited() {
    let r = rig(EXEMPT_LEASES);
    let acme = [("tenant", "acme")];
    for id in ["a", "b", "c"] {
        let outcome = acquire(&r.engine, &acme, id);
        assert!(outcome.allowed && !outcome.held && !outcome.unmatched());
        assert_eq!(outcome.limits[0].mode, "exempt");
        assert!(outcome.limits[0].decision.is_none());
        assert_eq!(
            outcome.limits[0].exempted_by.as_deref(),
            Some("ops@example.com")
        );
    }
    // Explaining counts no use.
    assert!(r.engine.explain_leases("api", &[acme]).is_ok());
    assert_eq!(r.engine.current().exemptions()[0].uses(), 3);
    let used: Vec<_> = r
        .audit
        .events()
        .into_iter()
        .filter(|e| e["event"] == "exemption_used")
        .collect();
    assert_eq!(used.len(), 3);
    assert_eq!(used[2]["bucket_key"], "exports|acme");
    assert_eq!(r.engine.unmatched(), 0, "an exempt request is matched");
    // Past the expiry the limit applies again.
    r.wall
        .set(UnixTime::parse_rfc3339("2026-12-31T00:00:00Z").unwrap_or_default());
    assert!(acquire(&r.engine, &acme, "d").held);
    assert!(!acquire(&r.engine, &acme, "e").allowed);
}

#[test]
fn two_descriptors_on_one_key_take_one_slot() {
    let r = rig(LEASES);
    let t = [("tenant", "t")];
    let both = r
        .engine
        .acquire("api", &[t, t], "a")
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(both.allowed && both.held);
    assert_eq!(both.limits.len(), 2);
    for limit in &both.limits {
        assert_eq!(limit.decision.map(|d| d.in_flight()), Some(1));
    }
    assert_eq!(in_flight(&r.engine, &t), [1]);
    assert!(acquire(&r.engine, &t, "b").held, "one slot was left");
    // One release frees it for both descriptors.
    assert!(r.engine.release("a").is_ok_and(|held| held));
    assert_eq!(in_flight(&r.engine, &t), [1]);
}

#[test]
fn a_reload_that_changes_max_in_flight_keeps_the_leases_held() {
    let r = rig(LEASES);
    let t = [("tenant", "t")];
    assert!(acquire(&r.engine, &t, "a").held);
    assert!(acquire(&r.engine, &t, "b").held);
    // A lower bound: the two held count against it, nothing more passes.
    let one = LEASES
        .replace("version: \"l1\"", "version: \"l2\"")
        .replace("max_in_flight: 2", "max_in_flight: 1");
    assert!(r.engine.load("p.yaml", &one).is_ok());
    let refused = acquire(&r.engine, &t, "c");
    assert!(!refused.allowed);
    assert_eq!(
        refused.limits[0]
            .decision
            .map(|d| (d.in_flight(), d.max_in_flight())),
        Some((2, 1))
    );
    assert!(r.engine.release("a").is_ok_and(|held| held));
    assert!(
        !acquire(&r.engine, &t, "c").allowed,
        "b still holds the one slot"
    );
    // A higher bound and another timeout: still the same key, b still counted.
    let three = LEASES
        .replace("version: \"l1\"", "version: \"l3\"")
        .replace("max_in_flight: 2", "max_in_flight: 3")
        .replace("lease_timeout: 30s", "lease_timeout: 1s");
    assert!(r.engine.load("p.yaml", &three).is_ok());
    assert!(acquire(&r.engine, &t, "c").held);
    assert!(acquire(&r.engine, &t, "d").held);
    assert!(!acquire(&r.engine, &t, "e").allowed);
    // b keeps the timeout it was taken with: 30 s, where c and d end after 1 s.
    r.clock.advance(Duration::from_secs(1));
    assert_eq!(in_flight(&r.engine, &t), [1]);
    // The load's audit names the changed limit.
    let loads: Vec<_> = r
        .audit
        .events()
        .into_iter()
        .filter(|e| e["event"] == "loaded")
        .collect();
    assert_eq!(loads[1]["changed_limits"], serde_json::json!(["exports"]));
}

#[test]
fn rate_and_concurrency_limits_of_one_policy_do_not_see_each_other() {
    let r = rig(LEASES);
    let both = [("tenant", "t"), ("user", "u")];
    // Checks decide the rate limit alone, and leave the leases alone.
    let checked = r
        .engine
        .decide("api", &[both], 1, None)
        .unwrap_or_else(|e| panic!("{e}"));
    let names: Vec<_> = checked.limits.iter().map(|l| l.name.to_string()).collect();
    assert_eq!(names, ["per-user"]);
    assert_eq!(in_flight(&r.engine, &both), [0]);
    // Leases hold on the concurrency limit alone, and take no token.
    for id in ["a", "b", "c"] {
        let outcome = acquire(&r.engine, &both, id);
        let names: Vec<_> = outcome.limits.iter().map(|l| l.name.to_string()).collect();
        assert_eq!(names, ["exports"]);
    }
    assert_eq!(remaining(&r.engine, &both), [4]);
    // A check only concurrency limits apply to is unmatched, and the reverse too.
    let unmatched = r.engine.decide("api", &[[("tenant", "t")]], 1, None);
    assert!(unmatched.is_ok_and(|o| o.allowed && o.unmatched()));
    assert_eq!(r.engine.unmatched(), 1);
    let no_lease = acquire(&r.engine, &[("user", "u")], "d");
    assert!(no_lease.allowed && !no_lease.held && no_lease.unmatched());
    assert_eq!(r.engine.unmatched(), 2);
    // Explaining counts nothing.
    assert!(r.engine.explain_leases("api", &[[("user", "u")]]).is_ok());
    assert_eq!(r.engine.unmatched(), 2);
    // The id held nothing: releasing it says so.
    assert!(r.engine.release("d").is_ok_and(|held| !held));
}

/// A shared store that cannot be reached at all.
struct Down;

fn unreachable_store() -> tollgate::Error {
    tollgate::Error::StoreUnavailable {
        reason: tollgate::Unavailable::Connection,
    }
}

impl tollgate::LeaseStore for Down {
    async fn acquire(
        &self,
        _: tollgate::LeaseRequest<'_>,
    ) -> Result<Vec<tollgate::LeaseDecision>, tollgate::Error> {
        Err(unreachable_store())
    }

    async fn in_flight(
        &self,
        _: tollgate::LeaseRequest<'_>,
    ) -> Result<Vec<tollgate::LeaseDecision>, tollgate::Error> {
        Err(unreachable_store())
    }

    async fn release(
        &self,
        _: &str,
        _: Option<tollgate::Timestamp>,
    ) -> Result<bool, tollgate::Error> {
        Err(unreachable_store())
    }
    async fn renew(
        &self,
        _: &str,
        _: Option<tollgate::Timestamp>,
    ) -> Result<Option<Duration>, tollgate::Error> {
        Err(unreachable_store())
    }
}

#[test]
fn a_shared_store_holds_the_leases_it_is_given() {
    let r = rig(LEASES);
    let shared = tollgate::LocalStore::new(r.clock.clone());
    let t = [("tenant", "t")];
    let on = |id| block_on_ready(r.engine.acquire_on(&shared, "api", &[t], id));
    assert!(on("a").is_ok_and(|o| o.held));
    assert!(on("b").is_ok_and(|o| o.held));
    assert!(on("c").is_ok_and(|o| !o.allowed));
    // The engine's own table is another store: it holds nothing.
    assert_eq!(in_flight(&r.engine, &t), [0]);
    let explained = block_on_ready(r.engine.explain_leases_on(&shared, "api", &[t]));
    assert!(explained.is_ok_and(|o| o.limits[0].decision.is_some_and(|d| d.in_flight() == 2)));
    // Keys carry the subject in braces, as buckets' do, so a cluster keeps them in one slot.
    assert_eq!(shared.leases().len(), 2);
    let key_in_store = shared.leases().in_flight(
        &[tollgate::LeaseTake::new(
            "exports|{t}@0787f7c7",
            &tollgate::LeaseLimit::new(2, Duration::from_secs(30))
                .unwrap_or_else(|e| panic!("{e}")),
        )],
        r.clock.now(),
    );
    assert!(key_in_store.is_ok_and(|d| d[0].in_flight() == 2));
    assert!(block_on_ready(r.engine.release_on(&shared, "a")).is_ok_and(|held| held));
    assert!(on("c").is_ok_and(|o| o.held));
    // A store that cannot answer is an error, not a rejection: the caller goes degraded.
    match block_on_ready(r.engine.acquire_on(&Down, "api", &[t], "d")) {
        Err(tollgate_policy::Error::Check { limit, source }) => {
            assert_eq!(limit, "exports");
            assert!(source.is_transient(), "{source}");
        }
        other => panic!("{other:?}"),
    }
}

const FAILING_LEASES: &str = r#"
limits:
  - name: open-one
    domain: api
    key: [user]
    algorithm: concurrency
    max_in_flight: 10
    lease_timeout: 1s
    failure_mode: open
    emergency: 1
  - name: open-own
    domain: api
    key: [team]
    algorithm: concurrency
    max_in_flight: 2
    lease_timeout: 1s
    failure_mode: open
  - name: closed-one
    domain: api
    key: [tenant]
    algorithm: concurrency
    max_in_flight: 10
    lease_timeout: 1s
  - name: watching
    domain: api
    key: [user]
    algorithm: concurrency
    max_in_flight: 1
    lease_timeout: 1s
    mode: shadow
"#;

#[test]
fn degraded_leases_follow_failure_modes_within_the_emergency_bound() {
    let r = rig(FAILING_LEASES);
    let degraded = |d: &[(&str, &str)], id: &str| {
        r.engine
            .acquire_degraded("api", &[d], id, "store timeout")
            .unwrap_or_else(|e| panic!("{e}"))
    };
    // Open with emergency: 1: one lease per user in this process, never unlimited.
    let user = [("user", "u")];
    let first = degraded(&user, "a");
    assert!(first.allowed && first.held && first.degraded && !first.failed_closed);
    assert_eq!(first.limits[0].decision.map(|d| d.max_in_flight()), Some(1));
    assert_eq!(first.limits[1].mode, "shadow");
    assert!(
        first.limits[1].decision.is_none(),
        "shadow is not decided degraded"
    );
    let second = degraded(&user, "b");
    assert!(!second.allowed && !second.held && !second.failed_closed);
    assert_eq!(second.retry_after(), Some(Duration::from_secs(1)));
    // Open without emergency: the limit's own max_in_flight, per process.
    let team = [("team", "x")];
    assert!(degraded(&team, "c").held);
    assert!(degraded(&team, "d").held);
    assert!(!degraded(&team, "e").allowed);
    // Closed: denied, distinguishably, holding nothing even where another limit is open.
    let closed = degraded(&[("tenant", "t"), ("team", "y")], "f");
    assert!(!closed.allowed && closed.failed_closed && !closed.held);
    assert!(closed.limits.iter().all(|l| l.decision.is_none()));
    assert!(degraded(&[("team", "y")], "f").held, "f was not taken");

    // A lease taken degraded is released from the emergency table, without the store.
    assert!(block_on_ready(r.engine.release_on(&Down, "a")).is_ok_and(|held| held));
    assert!(degraded(&user, "b").held);
    assert!(r.engine.release("c").is_ok_and(|held| held));
    assert!(degraded(&team, "e").held);
    // Not there: the store is asked, and its failure is the caller's to see.
    let unknown = block_on_ready(r.engine.release_on(&Down, "zz"));
    assert!(
        matches!(unknown, Err(tollgate_policy::Error::Check { source, .. }) if source.is_transient())
    );
    // The emergency leases time out like any other.
    r.clock.advance(Duration::from_secs(1));
    assert!(degraded(&team, "g").held);
    assert!(degraded(&team, "h").held);
    // The engine's own table was not touched by any of it.
    assert_eq!(in_flight(&r.engine, &user), [0, 0]);

    let events: Vec<_> = r
        .audit
        .events()
        .into_iter()
        .filter(|e| e["event"] == "degraded")
        .collect();
    assert_eq!(events[0]["limit"], "open-one");
    assert_eq!(events[0]["reason"], "store timeout");
    assert_eq!(
        (&events[0]["failure_mode"], &events[0]["allowed"]),
        (&"open".into(), &true.into())
    );
    assert_eq!(events[1]["allowed"], false);
    // The closed request logs both limits, each with its own mode.
    let closed_events: Vec<_> = events
        .iter()
        .filter(|e| e["bucket_key"] == "closed-one|t" || e["bucket_key"] == "open-own|y")
        .collect();
    assert_eq!(closed_events.len(), 3, "{closed_events:?}");
    assert_eq!(closed_events[0]["failure_mode"], "open");
    assert_eq!(closed_events[1]["failure_mode"], "closed");
    assert_eq!(closed_events[1]["allowed"], false);
}

#[test]
fn degraded_two_descriptors_on_one_key_take_one_emergency_slot() {
    let r = rig(FAILING_LEASES);
    let team = [("team", "x")];
    let both = r
        .engine
        .acquire_degraded("api", &[team, team], "a", "down")
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(both.held);
    assert!(
        both.limits
            .iter()
            .all(|l| l.decision.is_some_and(|d| d.in_flight() == 1))
    );
    let next = r.engine.acquire_degraded("api", &[team], "b", "down");
    assert!(
        next.is_ok_and(|o| o.held),
        "the bound is 2: one slot was left"
    );
    // Nothing applies: allowed, degraded, unmatched, nothing held.
    let none = r
        .engine
        .acquire_degraded("api", &[[("other", "x")]], "c", "down");
    assert!(none.is_ok_and(|o| o.allowed && o.degraded && !o.held && o.unmatched()));
    assert_eq!(r.engine.unmatched(), 1);
}

#[test]
fn a_reload_with_a_limit_the_store_cannot_keep_is_refused_and_the_last_good_version_stays() {
    let path = temp_file("limit-check.yaml");
    std::fs::write(&path, "version: \"1\"\nlimits:\n  - name: small\n    domain: api\n    key: [user]\n    capacity: 10\n    refill: 1/s\n").unwrap();
    let options = EngineOptions::default().limit_check(|limit| {
        if limit.capacity() > 100 {
            Err(tollgate::Error::UnsupportedLimit {
                reason: "capacity above 100",
            })
        } else {
            Ok(())
        }
    });
    let engine = PolicyEngine::from_file(&path, options).unwrap();
    let too_big = "version: \"2\"\nlimits:\n  - name: small\n    domain: api\n    key: [user]\n    capacity: 10\n    refill: 1/s\n    overrides:\n      - when: {tier: gold}\n        capacity: 1000\n        refill: 1/s\n";
    std::fs::write(&path, too_big).unwrap();
    let err = engine.reload().unwrap_err();
    assert!(
        matches!(&err, tollgate_policy::Error::Unsupported { limit, .. } if limit == "small"),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "limit small: this store cannot represent the limit exactly: capacity above 100"
    );
    assert_eq!(
        engine.current().version(),
        "1",
        "the last good version stays"
    );
    assert!(engine.status().last_error.is_some());
    // Concurrency limits hold no bucket: the check does not apply to them.
    let leases = "version: \"3\"\nlimits:\n  - name: slots\n    domain: api\n    key: [user]\n    algorithm: concurrency\n    max_in_flight: 1000\n    lease_timeout: 1m\n";
    std::fs::write(&path, leases).unwrap();
    assert_eq!(engine.reload().unwrap().version(), "3");
    let _ = std::fs::remove_dir_all(path.parent().unwrap_or(&path));
}

const TOKENS: &str = r#"
version: "t"
limits:
  - name: tokens-per-user
    domain: llm
    key: [user]
    capacity: 1000
    refill: 1000/m
  - name: tokens-per-user-next
    domain: llm
    key: [user]
    capacity: 900
    refill: 500/m
    mode: shadow
"#;

fn balances(outcome: &tollgate_policy::Outcome) -> Vec<Option<u64>> {
    outcome
        .limits
        .iter()
        .map(|l| l.decision.map(|d| d.remaining()))
        .collect()
}

/// A reservation checked for the most it may cost and settled for what it used gives the
/// rest back, on enforced and shadow limits alike, once.
#[test]
fn a_settled_reservation_gives_back_what_it_did_not_use() {
    let r = rig(TOKENS);
    let request = [[("user", "u1")]];
    let reserved = r.engine.decide("llm", &request, 800, Some("r1")).unwrap();
    assert!(reserved.allowed);
    assert_eq!(balances(&reserved), [Some(200), Some(100)]);
    let settled = r.engine.settle("llm", &request, 800, 300, "r1").unwrap();
    assert_eq!(settled.settled, Some(tollgate::SettleStatus::Settled));
    assert_eq!(balances(&settled), [Some(700), Some(600)]);
    let again = r.engine.settle("llm", &request, 800, 300, "r1").unwrap();
    assert_eq!(again.settled, Some(tollgate::SettleStatus::Repeated));
    assert_eq!(balances(&again), [Some(700), Some(600)]);
    let other = r.engine.settle("llm", &request, 800, 200, "r1");
    assert!(
        matches!(
            other,
            Err(tollgate_policy::Error::Check {
                source: tollgate::Error::IdempotencyConflict,
                ..
            })
        ),
        "{other:?}"
    );
    // Used more than reserved: refused, nothing changes.
    let over = r.engine.settle("llm", &request, 800, 801, "r1");
    assert!(
        matches!(
            over,
            Err(tollgate_policy::Error::Check {
                source: tollgate::Error::InvalidSettlement { .. },
                ..
            })
        ),
        "{over:?}"
    );
    // Never charged under this id: nothing to give back.
    let unknown = r.engine.settle("llm", &request, 800, 0, "r2").unwrap();
    assert_eq!(unknown.settled, Some(tollgate::SettleStatus::NotFound));
    assert_eq!(balances(&unknown), [Some(700), Some(600)]);
    // Used all it reserved: settled, nothing given back.
    let full = r.engine.decide("llm", &request, 100, Some("r4")).unwrap();
    assert_eq!(balances(&full), [Some(600), Some(500)]);
    let all = r.engine.settle("llm", &request, 100, 100, "r4").unwrap();
    assert_eq!(all.settled, Some(tollgate::SettleStatus::Settled));
    assert_eq!(balances(&all), [Some(600), Some(500)]);
    // A settlement neither counts as a decision nor as unmatched.
    let none = r.engine.settle("other", &request, 5, 1, "r3").unwrap();
    assert_eq!(none.settled, Some(tollgate::SettleStatus::NotFound));
    assert_eq!(r.engine.unmatched(), 0);
}

const REQUEST_LIMIT: &str = r#"
version: "1"
limits:
  - name: per-route
    domain: api
    key: [route]
    capacity: 100
    refill: 100/m
    request_limit: apply
"#;

#[test]
fn a_limit_sent_with_a_descriptor_decides_in_a_bucket_of_its_own() {
    let r = rig(REQUEST_LIMIT);
    let per_minute = |n| Limit::per(n, Duration::from_secs(60)).unwrap_or_else(|e| panic!("{e}"));
    let take = |limit: Option<Limit>| {
        let sent = [RequestDescriptor {
            entries: vec![("route", "search")],
            limit: limit.map(RequestedLimit::Rate),
        }];
        let outcome = r
            .engine
            .decide("api", &sent, 1, None)
            .unwrap_or_else(|e| panic!("{e}"));
        let decision = outcome.limits[0]
            .decision
            .unwrap_or_else(|| panic!("undecided"));
        (
            outcome.allowed,
            decision.remaining(),
            decision.limit().capacity(),
        )
    };
    // Three a minute asked for: three pass, the fourth is rejected, and the decision reports
    // the limit asked for.
    assert_eq!(take(Some(per_minute(3))), (true, 2, 3));
    assert_eq!(take(Some(per_minute(3))), (true, 1, 3));
    assert_eq!(take(Some(per_minute(3))), (true, 0, 3));
    assert_eq!(take(Some(per_minute(3))), (false, 0, 3));
    // The policy's own bucket was not touched, nor is another limit asked for.
    assert_eq!(take(None), (true, 99, 100));
    assert_eq!(take(Some(per_minute(4))), (true, 3, 4));
    // Asking for the policy's own parameters is its own bucket.
    assert_eq!(take(Some(per_minute(100))), (true, 98, 100));
    // The bucket asked for refills at its own rate: one token in 20 s at three a minute.
    r.clock.advance(Duration::from_secs(20));
    assert_eq!(take(Some(per_minute(3))), (true, 0, 3));
    assert_eq!(take(Some(per_minute(3))), (false, 0, 3));
    // A cost above the limit asked for can never pass: a typed error, nothing charged.
    let sent = [RequestDescriptor {
        entries: vec![("route", "bulk")],
        limit: Some(RequestedLimit::Rate(per_minute(3))),
    }];
    let err = r.engine.decide("api", &sent, 4, None).map(|o| o.allowed);
    assert!(
        matches!(
            err,
            Err(tollgate_policy::Error::Check {
                source: tollgate::Error::InvalidCost {
                    cost: 4,
                    capacity: 3
                },
                ..
            })
        ),
        "{err:?}"
    );
    let bulk = r
        .engine
        .decide("api", &sent, 1, None)
        .map(|o| o.limits[0].decision.map(|d| d.remaining()));
    assert_eq!(bulk.ok().flatten(), Some(2));
}

/// Envoy's `requests_per_unit: 0` sent with a descriptor, where the limit applies limits sent:
/// a denial, charging nothing, and kept apart from a descriptor of the same values that asks
/// for nothing.
#[test]
fn a_denial_sent_with_a_descriptor_denies_where_the_limit_applies_it() {
    let r = rig(REQUEST_LIMIT);
    let sent = |limit| RequestDescriptor {
        entries: vec![("route", "search")],
        limit,
    };
    let outcome = r
        .engine
        .decide("api", &[sent(Some(RequestedLimit::Deny))], 1, None)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(!outcome.allowed);
    assert!(outcome.limits[0].decision.is_some_and(|d| d.is_denied()));
    // Both at once: the same bucket key, yet the one asking for nothing is decided by the
    // bucket (read, not charged, as the request is denied).
    let both = [sent(None), sent(Some(RequestedLimit::Deny))];
    let outcome = r.engine.decide("api", &both, 1, None).unwrap();
    assert!(!outcome.allowed);
    let denied: Vec<bool> = outcome
        .limits
        .iter()
        .map(|l| l.decision.is_some_and(|d| d.is_denied()))
        .collect();
    assert_eq!(denied, [false, true], "{outcome:?}");
    assert_eq!(outcome.limits[0].bucket_key, outcome.limits[1].bucket_key);
    // Nothing was charged by either denied request.
    let outcome = r.engine.decide("api", &[sent(None)], 1, None).unwrap();
    assert_eq!(outcome.limits[0].decision.map(|d| d.remaining()), Some(99));
}

/// A block list beside ordinary limits: a deny limit with an exception and an exemption, a deny
/// override, a deny in shadow.
const BLOCKS: &str = r#"
version: "1"
defaults: {failure_mode: open, emergency: 2/s}
limits:
  - name: per-user
    domain: api
    key: [user]
    capacity: 3
    refill: 1/s
    overrides:
      - {name: banned, when: {tier: banned}, deny: true}
  - name: blocked-tenants
    domain: api
    when: {tenant: evil}
    key: [tenant]
    deny: true
    overrides:
      - {when: {user: ops}, unlimited: true}
  - name: watched
    domain: api
    when: {tenant: watched}
    deny: true
    mode: shadow
exemptions:
  - {limit: blocked-tenants, when: {user: auditor}, owner: sec@example.com, reason: audit, expires: "2027-01-01T00:00:00Z"}
"#;

/// What `user` has left of per-user, read without charging.
fn per_user_left(engine: &PolicyEngine, user: &str) -> u64 {
    let outcome = engine
        .explain("api", &[[("user", user), ("tenant", "good")]], 1)
        .unwrap_or_else(|e| panic!("{e}"));
    let limit = outcome.limits.iter().find(|l| &*l.name == "per-user");
    // A peek at cost 1 reports the balance less that cost.
    limit.and_then(|l| l.decision).map_or(0, |d| d.remaining()) + 1
}

#[test]
fn a_deny_rejects_whatever_is_left_and_charges_nothing_else() {
    let r = rig(BLOCKS);
    let evil = [("user", "u1"), ("tenant", "evil")];
    for attempt in 0..5 {
        let id = format!("r-{}", attempt % 2);
        let outcome = r
            .engine
            .decide("api", &[evil], 1, Some(&id))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(!outcome.allowed && !outcome.failed_closed);
        let blocked = outcome
            .limits
            .iter()
            .find(|l| &*l.name == "blocked-tenants")
            .and_then(|l| l.decision)
            .unwrap_or_else(|| panic!("{outcome:?}"));
        assert!(blocked.is_denied() && !blocked.allowed());
        assert_eq!((blocked.remaining(), blocked.capacity()), (0, 0));
        assert_eq!(blocked.retry_after(), None);
        assert_eq!(outcome.limits[0].bucket_key, "per-user|u1");
        assert!(outcome.limits[0].decision.is_some_and(|d| !d.is_denied()));
    }
    // All or nothing: five rejected requests took nothing from u1's own bucket.
    assert_eq!(per_user_left(&r.engine, "u1"), 3);
    // A cost far above any capacity is denied too, not an error: no bucket is asked.
    let huge = r
        .engine
        .decide("api", &[[("tenant", "evil")]], 1_000_000, None);
    assert!(huge.is_ok_and(|o| !o.allowed));

    // The exception (an unlimited override) and the exemption take requests out of the deny.
    for user in ["ops", "auditor"] {
        let outcome = r
            .engine
            .decide("api", &[[("user", user), ("tenant", "evil")]], 1, None)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(outcome.allowed, "{user}: {outcome:?}");
        assert!(
            outcome
                .limits
                .iter()
                .all(|l| l.decision.is_none_or(|d| !d.is_denied())),
            "{user}: {outcome:?}"
        );
        assert_eq!(per_user_left(&r.engine, user), 2, "{user}");
    }

    // A deny override: the banned tier of per-user, in a bucket key of its own, charged
    // nothing (the user's ordinary bucket stays full).
    let banned = [("user", "u2"), ("tier", "banned")];
    let outcome = r.engine.decide("api", &[banned], 1, None).unwrap();
    assert!(!outcome.allowed);
    assert_eq!(outcome.limits[0].bucket_key, "per-user|u2#banned");
    assert!(outcome.limits[0].decision.is_some_and(|d| d.is_denied()));
    assert_eq!(per_user_left(&r.engine, "u2"), 3);

    // In shadow a deny reports a would-reject and lets the request through, charged.
    let watched = [("user", "u3"), ("tenant", "watched")];
    let outcome = r.engine.decide("api", &[watched], 1, None).unwrap();
    assert!(outcome.allowed);
    let shadow = outcome
        .limits
        .iter()
        .find(|l| &*l.name == "watched")
        .unwrap();
    assert!(shadow.would_reject() && shadow.mode == "shadow");
    assert_eq!(per_user_left(&r.engine, "u3"), 2);

    // Explaining charges nothing and says the same.
    let explained = r.engine.explain("api", &[evil], 1).unwrap();
    assert!(!explained.allowed);
    assert_eq!(per_user_left(&r.engine, "u1"), 3);
}

#[test]
fn a_deny_needs_no_store_and_spends_no_emergency_budget() {
    let r = rig(BLOCKS);
    let evil = [("user", "u1"), ("tenant", "evil")];
    for _ in 0..3 {
        let outcome = r
            .engine
            .decide_degraded("api", &[evil], 1, "store timeout")
            .unwrap_or_else(|e| panic!("{e}"));
        // An ordinary rejection, decided as with the store up: not a failure.
        assert!(!outcome.allowed && !outcome.failed_closed && outcome.degraded);
        let blocked = outcome
            .limits
            .iter()
            .find(|l| &*l.name == "blocked-tenants");
        assert!(
            blocked
                .and_then(|l| l.decision)
                .is_some_and(|d| d.is_denied())
        );
    }
    // per-user's emergency budget (2 a second) is whole: the denied requests took nothing.
    let good = [("user", "u1"), ("tenant", "good")];
    for expected in [true, true, false] {
        let outcome = r
            .engine
            .decide_degraded("api", &[good], 1, "store timeout")
            .unwrap();
        assert_eq!(outcome.allowed, expected);
    }
    // Only the per-user decisions were degraded ones: a deny is not audited as degraded.
    let degraded = r
        .audit
        .events()
        .iter()
        .filter(|e| e["event"] == "degraded")
        .map(|e| e["limit"].as_str().unwrap_or_default().to_owned())
        .collect::<Vec<_>>();
    assert!(
        !degraded.is_empty() && degraded.iter().all(|l| l == "per-user"),
        "{degraded:?}"
    );
    // The exemption takes its requests out of the deny with the store down too: named, with
    // no decision of the deny's, counted.
    let auditor = [("user", "auditor"), ("tenant", "evil")];
    let outcome = r
        .engine
        .decide_degraded("api", &[auditor], 1, "store timeout")
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(outcome.allowed, "{outcome:?}");
    let blocked = outcome
        .limits
        .iter()
        .find(|l| &*l.name == "blocked-tenants")
        .unwrap_or_else(|| panic!("{outcome:?}"));
    assert_eq!(blocked.exempted_by.as_deref(), Some("sec@example.com"));
    assert!(blocked.decision.is_none(), "{outcome:?}");
    assert_eq!(r.engine.current().exemptions()[0].uses(), 1);
}

/// A block list and a banned tier beside a concurrency limit: a deny limit with an exception, a
/// concurrency limit's deny override, a deny in shadow.
const LEASE_BLOCKS: &str = r#"
version: "1"
limits:
  - name: exports
    domain: api
    key: [user]
    algorithm: concurrency
    max_in_flight: 2
    lease_timeout: 30s
    failure_mode: open
    emergency: 1
    overrides:
      - {name: banned, when: {tier: banned}, deny: true}
  - name: blocked-tenants
    domain: api
    when: {tenant: evil}
    key: [tenant]
    deny: true
    overrides:
      - {when: {user: ops}, unlimited: true}
  - name: watched
    domain: api
    when: {tenant: watched}
    deny: true
    mode: shadow
exemptions:
  - {limit: blocked-tenants, when: {user: auditor}, owner: sec@example.com, reason: audit, expires: "2027-01-01T00:00:00Z"}
"#;

#[test]
fn a_deny_refuses_a_lease_and_holds_nothing_anywhere() {
    let r = rig(LEASE_BLOCKS);
    let evil = [("user", "u1"), ("tenant", "evil")];
    for id in ["a", "b", "c"] {
        let outcome = acquire(&r.engine, &evil, id);
        assert!(!outcome.allowed && !outcome.held && !outcome.failed_closed);
        let names: Vec<&str> = outcome.limits.iter().map(|l| &*l.name).collect();
        assert_eq!(names, ["exports", "blocked-tenants"], "{outcome:?}");
        let blocked = outcome.limits[1]
            .decision
            .unwrap_or_else(|| panic!("{outcome:?}"));
        assert!(blocked.is_denied() && !blocked.allowed());
        assert_eq!((blocked.max_in_flight(), blocked.remaining()), (0, 0));
        // No release frees a slot for it: no wait is given.
        assert_eq!(outcome.retry_after(), None);
        // The concurrency limit was read, not taken.
        let exports = outcome.limits[0]
            .decision
            .unwrap_or_else(|| panic!("{outcome:?}"));
        assert!(exports.allowed() && !exports.is_denied());
        assert_eq!(exports.in_flight(), 0);
    }
    assert_eq!(in_flight(&r.engine, &[("user", "u1")]), [0]);
    // The id of a refused lease was never held: it is free to use.
    assert!(r.engine.release("a").is_ok_and(|held| !held));
    let explained = r.engine.explain_leases("api", &[evil]).unwrap();
    assert!(!explained.allowed && explained.limits[1].decision.is_some_and(|d| d.is_denied()));

    // The exception takes its requests out of the deny: leases as usual.
    let ops = acquire(&r.engine, &[("user", "ops"), ("tenant", "evil")], "d");
    assert!(ops.allowed && ops.held && ops.limits.len() == 1, "{ops:?}");
    // So does the exemption: the deny is listed, exempt, deciding nothing.
    let auditor = acquire(&r.engine, &[("user", "auditor"), ("tenant", "evil")], "d2");
    assert!(auditor.allowed && auditor.held, "{auditor:?}");
    let names: Vec<&str> = auditor.limits.iter().map(|l| &*l.name).collect();
    assert_eq!(names, ["exports", "blocked-tenants"], "{auditor:?}");
    assert!(auditor.limits[1].decision.is_none(), "{auditor:?}");
    assert_eq!(in_flight(&r.engine, &[("user", "auditor")]), [1]);

    // A concurrency limit's deny override: a key of its own, refused, nothing held.
    let banned = [("user", "u2"), ("tier", "banned")];
    let outcome = acquire(&r.engine, &banned, "e");
    assert!(!outcome.allowed && !outcome.held);
    assert_eq!(outcome.limits[0].bucket_key, "exports|u2#banned");
    assert!(outcome.limits[0].decision.is_some_and(|d| d.is_denied()));
    assert_eq!(in_flight(&r.engine, &[("user", "u2")]), [0]);

    // In shadow a deny reports a would-reject, and the lease is taken.
    let watched = acquire(&r.engine, &[("user", "u3"), ("tenant", "watched")], "f");
    assert!(watched.allowed && watched.held);
    let shadow = &watched.limits[1];
    assert!(
        shadow.would_reject() && shadow.mode == "shadow",
        "{watched:?}"
    );
    assert_eq!(in_flight(&r.engine, &[("user", "u3")]), [1]);
}

#[test]
fn a_lease_deny_needs_no_store_and_takes_nothing_from_the_emergency_table() {
    let r = rig(LEASE_BLOCKS);
    let evil = [("user", "u1"), ("tenant", "evil")];
    for id in ["a", "b"] {
        let outcome = r
            .engine
            .acquire_degraded("api", &[evil], id, "store timeout")
            .unwrap_or_else(|e| panic!("{e}"));
        // An ordinary refusal, decided as with the store up: not a failure.
        assert!(!outcome.allowed && !outcome.held && !outcome.failed_closed);
        assert!(outcome.degraded);
        assert!(outcome.limits[1].decision.is_some_and(|d| d.is_denied()));
    }
    // The same through a store that cannot answer: the denial is the engine's.
    let banned = [("user", "u1"), ("tier", "banned")];
    let outcome = r
        .engine
        .acquire_degraded("api", &[banned], "c", "store timeout")
        .unwrap();
    assert!(!outcome.allowed && outcome.limits[0].decision.is_some_and(|d| d.is_denied()));
    // exports' emergency bound (one lease) is whole: the refusals took nothing.
    let good = [("user", "u1")];
    let first = r
        .engine
        .acquire_degraded("api", &[good], "d", "store timeout")
        .unwrap();
    assert!(first.allowed && first.held);
    let second = r
        .engine
        .acquire_degraded("api", &[good], "e", "store timeout")
        .unwrap();
    assert!(!second.allowed);
    // Only exports' own keys were degraded decisions (read beside a deny, or taken): a deny
    // is not audited as one.
    let degraded: Vec<String> = r
        .audit
        .events()
        .iter()
        .filter(|e| e["event"] == "degraded")
        .map(|e| e["bucket_key"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(degraded, ["exports|u1"; 4]);
    // An exemption takes its requests out of the deny with the store down too: named, counted.
    let auditor = [("user", "auditor"), ("tenant", "evil")];
    let outcome = r
        .engine
        .acquire_degraded("api", &[auditor], "g", "store timeout")
        .unwrap();
    assert!(outcome.allowed && outcome.held, "{outcome:?}");
    let exempt = &outcome.limits[1];
    assert_eq!(exempt.exempted_by.as_deref(), Some("sec@example.com"));
    assert!(exempt.decision.is_none(), "{outcome:?}");
    assert_eq!(r.engine.current().exemptions()[0].uses(), 1);
    // Against a store that is down, an acquire fails (the caller then degrades, above).
    let down = block_on_ready(r.engine.acquire_on(&Down, "api", &[evil], "f"));
    assert!(down.is_err());
}

/// Resets: a drained subject's buckets (and emergency buckets) made new, the others untouched;
/// deny and global limits skipped; a filter by limit name; every reset audited.
const RESETS: &str = r#"
version: "r1"
defaults: {failure_mode: open, emergency: 2/s}
limits:
  - name: per-user
    domain: api
    key: [user]
    capacity: 3
    refill: 1/h
  - name: per-user-minute
    domain: api
    key: [user]
    algorithm: sliding_window
    limit: 5
    window: 1m
  - name: blocked
    domain: api
    when: {user: evil}
    deny: true
  - name: everyone
    domain: api
    capacity: 1000000
    refill: 1000/s
    scope: global
"#;

#[test]
fn a_reset_makes_a_subjects_buckets_new_and_leaves_the_rest() {
    let r = rig(RESETS);
    let u1 = [("user", "u1")];
    let u2 = [("user", "u2")];
    let left = |user: [(&str, &str); 1]| -> Vec<u64> {
        r.engine
            .explain("api", &[user], 1)
            .unwrap_or_else(|e| panic!("{e}"))
            .limits
            .iter()
            // The global bucket is everyone's: not this subject's to look at.
            .filter(|l| &*l.name != "everyone")
            .map(|l| l.decision.map_or(u64::MAX, |d| d.remaining()))
            .collect()
    };
    for _ in 0..3 {
        assert!(r.engine.decide("api", &[u1], 1, None).unwrap().allowed);
    }
    assert!(r.engine.decide("api", &[u2], 1, None).unwrap().allowed);
    assert!(!r.engine.decide("api", &[u1], 1, None).unwrap().allowed);
    // A peek at cost 1 reports what is left after it.
    assert_eq!(left(u1), [0, 1]);

    // Only the minute window, by name: the token bucket stays empty.
    let only = r
        .engine
        .reset("api", &[u1], Some(&["per-user-minute"]))
        .unwrap_or_else(|e| panic!("{e}"));
    let reset: Vec<&str> = only.reset.iter().map(|b| b.bucket_key.as_str()).collect();
    assert_eq!(reset, ["per-user-minute|u1"]);
    assert!(only.skipped.is_empty());
    assert_eq!(left(u1), [0, 4]);

    // Everything that applies: the global limit is skipped, as is a deny.
    let all = r.engine.reset("api", &[u1], None).unwrap();
    let reset: Vec<&str> = all.reset.iter().map(|b| b.bucket_key.as_str()).collect();
    assert_eq!(reset, ["per-user|u1", "per-user-minute|u1"]);
    let skipped: Vec<(&str, &str)> = all.skipped.iter().map(|s| (&*s.name, s.reason)).collect();
    assert_eq!(skipped, [("everyone", "global")]);
    assert_eq!(&*all.policy_version, "r1");
    assert_eq!(left(u1), [2, 4]);
    // u2's buckets are as they were.
    assert_eq!(left(u2), [1, 3]);
    assert!(r.engine.decide("api", &[u1], 3, None).unwrap().allowed);

    // Two descriptors on one subject's buckets: each reset (and audited) once.
    let twice = r.engine.reset("api", &[u2, u2], None).unwrap();
    assert_eq!(twice.reset.len(), 2, "{twice:?}");
    assert_eq!(left(u2), [2, 4]);
    let evil = r.engine.reset("api", &[[("user", "evil")]], None).unwrap();
    assert!(
        evil.skipped
            .iter()
            .any(|s| &*s.name == "blocked" && s.reason == "deny")
    );

    // A name the policy does not have is refused, nothing reset.
    let unknown = r.engine.reset("api", &[u2], Some(&["per-usr"]));
    assert!(
        matches!(unknown, Err(tollgate_policy::Error::UnknownLimit { ref name }) if name == "per-usr")
    );
    assert_eq!(left(u2), [2, 4]);

    // Each bucket reset is audited.
    let audited: Vec<String> = r
        .audit
        .events()
        .iter()
        .filter(|e| e["event"] == "reset")
        .map(|e| {
            format!(
                "{} {}",
                e["bucket_key"].as_str().unwrap_or(""),
                e["policy_version"]
            )
        })
        .collect();
    assert_eq!(
        audited,
        [
            "per-user-minute|u1 \"r1\"",
            "per-user|u1 \"r1\"",
            "per-user-minute|u1 \"r1\"",
            "per-user|u2 \"r1\"",
            "per-user-minute|u2 \"r1\"",
            "per-user|evil \"r1\"",
            "per-user-minute|evil \"r1\""
        ]
    );
}

#[test]
fn a_reset_makes_emergency_buckets_new_too() {
    let r = rig(r#"
defaults: {failure_mode: open, emergency: 2/s}
limits:
  - {name: per-user, domain: api, key: [user], capacity: 3, refill: 1/h}
"#);
    let u1 = [("user", "u1")];
    // The emergency budget, 2 a second, spent while the store is down.
    for expected in [true, true, false] {
        let outcome = r
            .engine
            .decide_degraded("api", &[u1], 1, "store timeout")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(outcome.allowed, expected);
    }
    r.engine.reset("api", &[u1], None).unwrap();
    let outcome = r
        .engine
        .decide_degraded("api", &[u1], 1, "store timeout")
        .unwrap();
    assert!(outcome.allowed, "{outcome:?}");
}

const GIVE_BACK: &str = r#"
version: "g1"
defaults: {failure_mode: open, emergency: 2/s}
limits:
  - {name: per-user, domain: api, key: [user], capacity: 10, refill: 1/h}
  - {name: per-user-minute, domain: api, key: [user], algorithm: fixed_window, limit: 5, window: 1m}
  - {name: trial, domain: api, key: [user], capacity: 4, refill: 1/h, mode: shadow}
  - {name: vip, domain: api, key: [user], capacity: 1, refill: 1/d, when: {user: vip}}
  - {name: blocked, domain: api, when: {user: evil}, deny: true}
  - {name: everyone, domain: api, capacity: 1000000, refill: 1000/s, scope: global}
exemptions:
  - limit: vip
    when: {user: vip}
    owner: ops@example.com
    reason: launch week
    expires: 2026-12-31T00:00:00Z
"#;

/// Hits given back with no record go to the buckets a check charges, never past full: an
/// enforced token bucket and window, a shadow limit; not an exempt limit, a deny, or a global
/// limit. Two descriptors on one bucket give back their sum; a cost of 0 is refused.
#[test]
fn hits_given_back_go_to_the_buckets_a_check_charges() {
    let r = rig(GIVE_BACK);
    let u1 = [("user", "u1")];
    let left = |user: [(&str, &str); 1]| -> Vec<(String, Option<u64>)> {
        r.engine
            .explain("api", &[user], 1)
            .unwrap_or_else(|e| panic!("{e}"))
            .limits
            .iter()
            .filter(|l| &*l.name != "everyone")
            .map(|l| (l.name.to_string(), l.decision.map(|d| d.remaining())))
            .collect()
    };
    let named = |pairs: &[(&str, Option<u64>)]| -> Vec<(String, Option<u64>)> {
        pairs.iter().map(|&(n, d)| (n.to_owned(), d)).collect()
    };
    assert!(r.engine.decide("api", &[u1], 4, None).unwrap().allowed);
    // A peek at cost 1 reports what is left after it.
    assert_eq!(
        left(u1),
        named(&[
            ("per-user", Some(5)),
            ("per-user-minute", Some(0)),
            ("trial", Some(0))
        ])
    );
    let given = r
        .engine
        .give_back("api", &[u1], 3)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(given.allowed);
    assert_eq!(&*given.policy_version, "g1");
    let standing: Vec<(&str, Option<u64>)> = given
        .limits
        .iter()
        .map(|l| (&*l.name, l.decision.map(|d| d.remaining())))
        .collect();
    // The standing after, at the cost given back; the global limit has nothing to give to.
    assert_eq!(
        standing,
        [
            ("per-user", Some(9)),
            ("per-user-minute", Some(4)),
            ("trial", Some(3)),
            ("everyone", None)
        ]
    );
    // Two descriptors on the same buckets give back their sum, never past full.
    r.engine.give_back("api", &[u1, u1], 3).unwrap();
    assert_eq!(
        left(u1),
        named(&[
            ("per-user", Some(9)),
            ("per-user-minute", Some(4)),
            ("trial", Some(3))
        ])
    );
    assert!(r.engine.decide("api", &[u1], 5, None).unwrap().allowed);

    // An exempt limit is never charged, a deny has no bucket: nothing to give back to.
    let vip = r.engine.give_back("api", &[[("user", "vip")]], 1).unwrap();
    let exempt = vip.limits.iter().find(|l| &*l.name == "vip").unwrap();
    assert_eq!(exempt.decision, None);
    assert_eq!(exempt.exempted_by.as_deref(), Some("ops@example.com"));
    let evil = r.engine.give_back("api", &[[("user", "evil")]], 1).unwrap();
    assert!(
        evil.limits
            .iter()
            .any(|l| &*l.name == "blocked" && l.decision.is_none())
    );

    // A cost of 0 gives nothing back: refused, as a check refuses it.
    assert!(r.engine.give_back("api", &[u1], 0).is_err());
    // Nothing applies: allowed, nothing given.
    assert!(r.engine.give_back("web", &[u1], 1).unwrap().unmatched());
    // Hits given back are neither decisions nor audited.
    assert!(!r.audit.kinds().iter().any(|k| k.contains("give")));
}

/// Hits given back reach the emergency budget a degraded check spent, as well as the store.
#[test]
fn hits_given_back_reach_the_emergency_budgets() {
    let r = rig(GIVE_BACK);
    let u1 = [("user", "u1")];
    let degraded = |cost| {
        r.engine
            .decide_degraded("api", &[u1], cost, "store timeout")
            .unwrap_or_else(|e| panic!("{e}"))
            .allowed
    };
    // The emergency budget, 2 a second, spent while the store is down.
    assert!(degraded(2));
    assert!(!degraded(1));
    r.engine.give_back("api", &[u1], 1).unwrap();
    assert!(degraded(1));
    assert!(!degraded(1));
}

/// A slow limit and a lease, under an engine with every option set away from its default.
const BOUNDED: &str = r#"
version: "b1"
limits:
  - {name: hourly, domain: api, key: [user], capacity: 3, refill: 1/h}
  - {name: jobs, domain: jobs, key: [user], algorithm: concurrency, max_in_flight: 5, lease_timeout: 30s, failure_mode: open}
"#;

#[test]
fn the_engine_runs_on_the_bounds_and_window_it_is_given() {
    let clock = ManualClock::new();
    let options = EngineOptions::default()
        .history(1)
        .max_buckets(64)
        .max_leases(1)
        .idempotency_window(Duration::from_secs(1))
        .clock(Arc::new(clock.clone()))
        .wall_clock(Arc::new(ManualWallClock::new(NOW)));
    assert_eq!(
        format!("{options:?}"),
        "EngineOptions { history: 1, max_buckets: 64, max_leases: 1, idempotency_window: 1s, .. }"
    );
    let policy = compile("p.yaml", BOUNDED).unwrap_or_else(|e| panic!("{e}"));
    let engine = PolicyEngine::new(policy, options);
    assert_eq!(
        format!("{engine:?}"),
        r#"PolicyEngine { version: "b1", path: None, .. }"#
    );

    // A retry inside the window is answered from the record; after it, it is a new request.
    let hourly = |id: &str| {
        let outcome = engine
            .decide("api", &[[("user", "u")]], 1, Some(id))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(outcome.allowed && !outcome.unmatched(), "{outcome:?}");
        outcome.limits[0].decision.map(|d| d.remaining())
    };
    assert_eq!(hourly("r"), Some(2));
    clock.advance(Duration::from_millis(500));
    assert_eq!(hourly("r"), Some(2));
    clock.advance(Duration::from_secs(1));
    assert_eq!(hourly("r"), Some(1));

    // A thousand subjects, 64 buckets kept.
    for i in 0..1_000 {
        let user = format!("v{i}");
        let outcome = engine.decide("api", &[[("user", user.as_str())]], 1, None);
        assert!(outcome.is_ok_and(|o| o.allowed));
    }
    let stats = engine.memory_stats();
    assert!(stats.live_buckets <= 64, "{stats:?}");
    assert!(stats.evicted >= 1_000 - 64, "{stats:?}");

    // One lease in the lease table, one in the emergency table, counted together.
    let take = |user: &str, id: &str| engine.acquire("jobs", &[[("user", user)]], id);
    assert!(take("a", "1").is_ok_and(|o| o.held));
    assert_eq!(engine.live_leases(), 1);
    let full = take("b", "2");
    assert!(
        matches!(
            full,
            Err(tollgate_policy::Error::Check {
                source: tollgate::Error::TooManyLeases { .. },
                ..
            })
        ),
        "{full:?}"
    );
    let degraded = engine.acquire_degraded("jobs", &[[("user", "b")]], "3", "store timeout");
    assert!(degraded.is_ok_and(|o| o.held));
    assert_eq!(engine.live_leases(), 2);

    // Four hours on, every bucket is full and both leases timed out: a sweep drops them all.
    clock.advance(Duration::from_secs(4 * 3600));
    let buckets = engine.memory_stats().live_buckets;
    assert!(buckets > 0);
    assert_eq!(engine.sweep(), buckets + 2);
    assert_eq!(
        (engine.memory_stats().live_buckets, engine.live_leases()),
        (0, 0)
    );
}

/// Each version put in force, by a load or a rollback, counts as a change.
#[test]
fn loads_and_rollbacks_are_counted_as_changes() {
    let r = rig(TWO);
    assert_eq!(r.engine.status().changes, 1);
    let second = TWO.replace("version: \"1\"", "version: \"2\"");
    assert!(r.engine.load("p.yaml", &second).is_ok());
    assert_eq!(r.engine.status().changes, 2);
    assert!(r.engine.rollback().is_ok());
    let status = r.engine.status();
    assert_eq!((status.changes, status.version.as_str()), (3, "1"));
}

const SWITCHED: &str = r#"
version: "s1"
limits:
  - name: per-user
    domain: api
    key: [user]
    capacity: 2
    refill: 1/h
  - name: blocked
    domain: api
    when: {user: mallory}
    deny: true
  - name: exports
    domain: api
    key: [tenant]
    algorithm: concurrency
    max_in_flight: 1
    lease_timeout: 1m
"#;

/// The operator's switch: every limit decided as in shadow mode, deny limits, degraded
/// decisions failing closed and concurrency limits included; balances kept and charged as a
/// shadow limit's are; switched back, the same buckets reject again.
#[test]
fn shadow_all_stops_every_rejection_and_keeps_the_buckets() {
    let r = rig(SWITCHED);
    let user = |name| [("user", name)];
    let decide = |name| {
        r.engine
            .decide("api", &[user(name)], 1, None)
            .unwrap_or_else(|e| panic!("{e}"))
    };
    assert!(decide("u1").allowed && decide("u1").allowed);
    assert!(!decide("u1").allowed);
    assert!(!decide("mallory").allowed);
    let tenant = [("tenant", "t")];
    assert!(acquire(&r.engine, &tenant, "a").held);
    assert!(!acquire(&r.engine, &tenant, "b").allowed);
    assert!(r.engine.shadow_all().is_none());
    assert!(r.engine.status().shadow_all.is_none());

    r.wall.set(UnixTime::from_secs(1_790_000_060));
    let on = r.engine.set_shadow_all(Some("INC-42: false rejections"));
    let on = on.unwrap_or_else(|| panic!("the switch is on"));
    assert_eq!(on.reason, "INC-42: false rejections");
    assert_eq!(on.since, UnixTime::from_secs(1_790_000_060));
    assert_eq!(r.engine.status().shadow_all, Some(on.clone()));
    assert_eq!(r.engine.shadow_all(), Some(on.clone()));

    let outcome = decide("u1");
    assert!(outcome.allowed);
    assert_eq!(outcome.limits[0].mode, "shadow");
    assert!(
        outcome.limits[0].would_reject(),
        "what would be rejected is still seen"
    );
    let denied = decide("mallory");
    assert!(denied.allowed && denied.limits.iter().all(|l| l.mode == "shadow"));
    let lease = acquire(&r.engine, &tenant, "b");
    assert!(lease.allowed && lease.limits[0].would_reject());
    assert!(
        r.engine
            .decide_degraded("api", &[user("u9")], 1, "store down")
            .is_ok_and(|o| o.allowed && !o.failed_closed),
        "a limit failing closed does not reject either"
    );
    // Outlives a reload and a rollback: it is the process's, not a version's.
    assert!(
        r.engine
            .load("p.yaml", &SWITCHED.replace("\"s1\"", "\"s2\""))
            .is_ok()
    );
    assert!(decide("u1").allowed);
    assert!(r.engine.rollback().is_ok());
    assert!(decide("u1").allowed);
    // Turned on again, the first reason and time stay, and nothing more is audited.
    r.wall.set(UnixTime::from_secs(1_790_000_120));
    assert_eq!(r.engine.set_shadow_all(Some("again")), Some(on));

    // Off: each limit has its own mode back, and the buckets are where the traffic left them.
    assert_eq!(r.engine.set_shadow_all(None), None);
    assert_eq!(r.engine.set_shadow_all(None), None);
    assert_eq!(r.engine.shadow_all(), None);
    assert!(!decide("u1").allowed);
    assert!(decide("u2").allowed, "another subject's bucket is full");
    assert!(!decide("mallory").allowed);
    assert!(!acquire(&r.engine, &tenant, "c").allowed);

    let events = r.shadow_all_events();
    assert_eq!(events.len(), 2, "{events:?}");
    assert_eq!(events[0]["event"], "shadow_all_on");
    assert_eq!(events[0]["reason"], "INC-42: false rejections");
    assert_eq!(events[0]["policy_version"], "s1");
    assert_eq!(events[1]["event"], "shadow_all_off");
    assert_eq!(events[1]["reason"], "INC-42: false rejections");
    assert_eq!(events[1]["since"], "2026-09-21T14:14:20Z");
}

/// The fleet's switch, as a server reads it from the shared store, sits beside this process's
/// own: either puts every limit in shadow mode, turning one off leaves the other, and the same
/// value read again changes and audits nothing.
#[test]
fn the_fleets_switch_and_the_processs_own_are_apart() {
    let r = rig(SWITCHED);
    let decide = || {
        r.engine
            .decide("api", &[[("user", "u1")]], 1, None)
            .unwrap_or_else(|e| panic!("{e}"))
    };
    assert!(decide().allowed && decide().allowed && !decide().allowed);
    let fleet = ShadowAll::fleet(UnixTime::from_secs(1_790_000_000), "INC-7");
    r.engine.set_fleet_shadow_all(Some(fleet.clone()));
    r.engine.set_fleet_shadow_all(Some(fleet.clone()));
    assert!(decide().allowed);
    assert_eq!(r.engine.shadow_all(), Some(fleet.clone()));
    assert!(r.engine.status().shadow_all.is_some_and(|s| s.fleet));

    // This process's switch turned on and off again: the fleet's stays in force.
    let own = r.engine.set_shadow_all(Some("local look"));
    assert!(own.is_some_and(|s| !s.fleet));
    assert_eq!(r.engine.set_shadow_all(None), None);
    assert!(decide().allowed);
    assert_eq!(r.engine.shadow_all(), Some(fleet));

    r.engine.set_fleet_shadow_all(None);
    assert!(!decide().allowed);
    assert_eq!(r.engine.shadow_all(), None);

    let events: Vec<(String, bool)> = r
        .shadow_all_events()
        .into_iter()
        .map(|e| {
            let kind = e["event"].as_str().unwrap_or_default().to_owned();
            (kind, e["fleet"].as_bool().unwrap_or_default())
        })
        .collect();
    let event = |kind: &str, fleet| (kind.to_owned(), fleet);
    assert_eq!(
        events,
        [
            event("shadow_all_on", true),
            event("shadow_all_on", false),
            event("shadow_all_off", false),
            event("shadow_all_off", true)
        ]
    );
}

const TWO_DOMAINS: &str = r#"
version: "s2"
limits:
  - {name: checkout, domain: shop, key: [user], capacity: 1, refill: 1/h}
  - {name: search, domain: shop, key: [user], capacity: 1, refill: 1/h}
  - {name: login, domain: auth, key: [user], capacity: 1, refill: 1/h}
"#;

/// A switch narrowed to some domains or limits shadows those alone, the others enforcing
/// through the incident; the process's and the fleet's scopes add up; a new scope is audited
/// with its names, the same scope again is not.
#[test]
fn a_narrowed_switch_shadows_its_scope_alone() {
    let r = rig(TWO_DOMAINS);
    let u = [("user", "u1")];
    let modes = |domain: &str| -> Vec<(String, bool)> {
        let outcome = r
            .engine
            .decide(domain, &[u], 1, None)
            .unwrap_or_else(|e| panic!("{e}"));
        outcome
            .limits
            .iter()
            .map(|l| (l.mode.to_string(), l.would_reject()))
            .collect()
    };
    assert_eq!(modes("shop").len(), 2);
    assert_eq!(modes("auth").len(), 1);
    let both = |a: &str, b: &str| vec![(a.to_owned(), true), (b.to_owned(), true)];

    let on = r
        .engine
        .set_shadow_within("INC-1", ShadowScope::limits(["checkout"]));
    assert_eq!(on.scope.limit_names(), ["checkout"]);
    assert_eq!(modes("shop"), both("shadow", "enforce"));
    assert_eq!(modes("auth"), [("enforce".to_owned(), true)]);
    // The same scope again: the first reason stays, nothing audited.
    let again = r
        .engine
        .set_shadow_within("INC-1 again", ShadowScope::limits(["checkout"]));
    assert_eq!(again.reason, "INC-1");

    // Narrowed to a domain instead: search joins checkout, login still enforces.
    let on = r
        .engine
        .set_shadow_within("INC-2", ShadowScope::domains(["shop", "shop"]));
    assert_eq!(on.scope.domain_names(), ["shop"]);
    assert!(on.scope.limit_names().is_empty());
    assert_eq!(modes("shop"), both("shadow", "shadow"));
    assert_eq!(modes("auth"), [("enforce".to_owned(), true)]);

    // The fleet's switch over auth adds to the process's over shop.
    let fleet = ShadowAll::fleet(UnixTime::from_secs(1_790_000_000), "INC-3")
        .within(ShadowScope::domains(["auth"]));
    r.engine.set_fleet_shadow_all(Some(fleet));
    assert_eq!(modes("auth"), [("shadow".to_owned(), true)]);
    r.engine.set_shadow_all(None);
    assert_eq!(modes("shop"), both("enforce", "enforce"));
    assert_eq!(modes("auth"), [("shadow".to_owned(), true)]);
    r.engine.set_fleet_shadow_all(None);
    assert_eq!(modes("auth"), [("enforce".to_owned(), true)]);
    // Whatever is handed to the fleet's switch is the fleet's.
    let own = r.engine.set_shadow_within("INC-4", ShadowScope::all());
    r.engine.set_shadow_all(None);
    r.engine.set_fleet_shadow_all(Some(own));
    assert!(r.engine.shadow_all().is_some_and(|on| on.fleet));
    r.engine.set_fleet_shadow_all(None);

    let events = r.shadow_all_events();
    let summary: Vec<(&str, &str, serde_json::Value)> = events
        .iter()
        .map(|e| {
            let scope = serde_json::json!([e.get("domains"), e.get("limits")]);
            (
                e["event"].as_str().unwrap_or_default(),
                e["reason"].as_str().unwrap_or_default(),
                scope,
            )
        })
        .collect();
    let scope =
        |domains: Option<&[&str]>, limits: Option<&[&str]>| serde_json::json!([domains, limits]);
    assert_eq!(
        summary,
        [
            ("shadow_all_on", "INC-1", scope(None, Some(&["checkout"]))),
            ("shadow_all_on", "INC-2", scope(Some(&["shop"]), None)),
            ("shadow_all_on", "INC-3", scope(Some(&["auth"]), None)),
            ("shadow_all_off", "INC-2", scope(Some(&["shop"]), None)),
            ("shadow_all_off", "INC-3", scope(Some(&["auth"]), None)),
            ("shadow_all_on", "INC-4", scope(None, None)),
            ("shadow_all_off", "INC-4", scope(None, None)),
            ("shadow_all_on", "INC-4", scope(None, None)),
            ("shadow_all_off", "INC-4", scope(None, None)),
        ]
    );

    // Names the policy lacks are found before a switch is narrowed to them.
    let scope = ShadowScope::domains(["shop", "shpo"]).with_limits(["login", "logn"]);
    assert_eq!(
        scope.unknown_in(&r.engine.current()),
        ["domain shpo", "limit logn"]
    );
    assert!(
        ShadowScope::all()
            .unknown_in(&r.engine.current())
            .is_empty()
    );
}
