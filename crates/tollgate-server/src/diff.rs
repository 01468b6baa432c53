//! `tollgate diff OLD NEW`: what a policy change does, before it is deployed.
//!
//! A policy change is reviewed as a diff of YAML, which shows what was written, not what it
//! does to the buckets in use. Some changes keep every balance, some convert them, and some
//! start every key's bucket afresh, which hands every subject a full burst at once: a reviewer
//! should see that before the change reaches production. This compares two compiled policies
//! limit by limit (by name) and override by override, in the file's own terms, and says for
//! each what becomes of its buckets, by the same rules the engine and the stores follow (a
//! bucket is found by its limit's name, key values and the tag of its parameters; a reload
//! converts token buckets' balances to new parameters). `tests` hold each claim to what an
//! engine does on a reload.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;
use serde_json::Value;
use tollgate_policy::{FileChange, LimitDef, Mode, Override, Policy};

use crate::policy_view;

/// What becomes of the buckets of a limit or an override.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Buckets {
    /// Found as they are: same key entries, same parameters' tag (a window's limit per window
    /// may change: its counts mean the same under any).
    Kept,
    /// Converted on a reload: a token bucket's balance refilled under the old parameters up
    /// to the reload, clamped to the new capacity, refilled under the new ones since. A
    /// process started on the new file (not reloaded) starts them full.
    CarriedOver,
    /// Others from now on, each starting full (a window counting nothing): another algorithm
    /// or window, other key entries. Every subject gets a whole burst at once.
    Afresh,
    /// New: the limit or override did not exist; its buckets start full.
    New,
    /// No longer read; they expire as they refill.
    Dropped,
    /// A deny limit, or an unlimited or denying override: no bucket before or after.
    None,
}

impl Buckets {
    /// Whether nothing happens to the buckets: kept, or none before and after.
    fn unchanged(self) -> bool {
        matches!(self, Buckets::Kept | Buckets::None)
    }

    fn says(self) -> &'static str {
        match self {
            Buckets::Kept => "kept as they are",
            Buckets::CarriedOver => {
                "carried over on a reload (refilled at the old rate up to it, clamped to the new \
                 capacity); a process started on the new file starts them full"
            }
            Buckets::Afresh => "start afresh, full: every subject gets a whole burst at once",
            Buckets::New => "new, starting full",
            Buckets::Dropped => "no longer read (they expire as they refill)",
            Buckets::None => "none (nothing is counted)",
        }
    }
}

/// Added, removed or changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Change {
    Added,
    Removed,
    Changed,
}

impl Change {
    fn sign(self) -> char {
        match self {
            Change::Added => '+',
            Change::Removed => '-',
            Change::Changed => '~',
        }
    }
}

/// One field of the file that differs, as the file writes it (`null`: not set).
#[derive(Debug, PartialEq, Serialize)]
pub(crate) struct Field {
    pub(crate) field: String,
    pub(crate) from: Value,
    pub(crate) to: Value,
}

/// A limit that was added, removed or changed.
#[derive(Debug, Serialize)]
pub(crate) struct LimitChange {
    pub(crate) name: String,
    pub(crate) domain: String,
    pub(crate) change: Change,
    pub(crate) fields: Vec<Field>,
    /// What becomes of the limit's own buckets (those no override takes).
    pub(crate) buckets: Buckets,
    /// Whether it rejects requests it did not before, or stops rejecting ones it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) enforcement: Option<&'static str>,
    pub(crate) overrides: Vec<OverrideChange>,
}

/// An override that was added, removed or changed, in a limit of both versions.
#[derive(Debug, Serialize)]
pub(crate) struct OverrideChange {
    pub(crate) name: String,
    pub(crate) change: Change,
    pub(crate) fields: Vec<Field>,
    pub(crate) buckets: Buckets,
}

/// An exemption added, removed or changed (found by its limit and conditions).
#[derive(Debug, Serialize)]
pub(crate) struct ExemptionChange {
    pub(crate) limit: String,
    pub(crate) when: Value,
    pub(crate) change: Change,
    pub(crate) fields: Vec<Field>,
}

/// A file of a policy directory added, removed or changed.
#[derive(Debug, Serialize)]
pub(crate) struct FileDiff {
    pub(crate) name: String,
    pub(crate) change: Change,
}

/// Everything that differs between two versions of a policy.
#[derive(Debug, Serialize)]
pub(crate) struct PolicyDiff {
    pub(crate) from_version: String,
    pub(crate) to_version: String,
    /// In a policy directory, the files added, removed or changed: whose change it is.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) files: Vec<FileDiff>,
    pub(crate) limits: Vec<LimitChange>,
    pub(crate) exemptions: Vec<ExemptionChange>,
}

impl PolicyDiff {
    /// Whether the two versions decide alike (their version names aside).
    pub(crate) fn is_empty(&self) -> bool {
        self.limits.is_empty() && self.exemptions.is_empty()
    }

    /// The limits whose buckets, or one of whose overrides' buckets, start afresh.
    pub(crate) fn afresh(&self) -> impl Iterator<Item = &LimitChange> {
        self.limits.iter().filter(|l| {
            l.buckets == Buckets::Afresh || l.overrides.iter().any(|o| o.buckets == Buckets::Afresh)
        })
    }
}

/// What changes from `old` to `new`: limits in `new`'s order, then those `old` alone has.
pub(crate) fn diff(old: &Policy, new: &Policy) -> PolicyDiff {
    let mut limits = Vec::new();
    for limit in new.limits() {
        match old.limit(limit.name()) {
            Some(before) => limits.extend(changed(old, before, new, limit)),
            None => limits.push(whole(limit, Change::Added)),
        }
    }
    for limit in old.limits() {
        if new.limit(limit.name()).is_none() {
            limits.push(whole(limit, Change::Removed));
        }
    }
    let files = new
        .file_changes(old)
        .into_iter()
        .map(|(name, change)| FileDiff {
            name: name.to_string(),
            change: match change {
                FileChange::Added => Change::Added,
                FileChange::Removed => Change::Removed,
                FileChange::Changed => Change::Changed,
            },
        })
        .collect();
    PolicyDiff {
        from_version: old.version().to_owned(),
        to_version: new.version().to_owned(),
        files,
        limits,
        exemptions: exemptions(old, new),
    }
}

/// Whether a limit rejects anyone: enforced, for some subjects at least.
fn enforces(limit: &LimitDef) -> bool {
    limit.mode() == Mode::Enforce && limit.rollout() > 0
}

/// A limit that only one version has: `Added` (its buckets start full) or `Removed`.
fn whole(limit: &LimitDef, change: Change) -> LimitChange {
    let (buckets, enforcement) = match change {
        Change::Added => (Buckets::New, "starts rejecting"),
        _ => (Buckets::Dropped, "stops rejecting"),
    };
    LimitChange {
        name: limit.name().to_owned(),
        domain: limit.domain().to_owned(),
        change,
        fields: Vec::new(),
        buckets: if limit.deny() { Buckets::None } else { buckets },
        enforcement: enforces(limit).then_some(enforcement),
        overrides: Vec::new(),
    }
}

/// A limit of both versions, if anything about it differs.
fn changed(old: &Policy, before: &LimitDef, new: &Policy, after: &LimitDef) -> Option<LimitChange> {
    let fields = fields(
        &policy_view::limit(old.limits(), before),
        &policy_view::limit(new.limits(), after),
        &["name", "overrides"],
    );
    let same_key = before.key().eq(after.key());
    let buckets = fate(
        (before.deny(), before.params().rate(), before.bucket_tag()),
        (after.deny(), after.params().rate(), after.bucket_tag()),
        same_key,
    );
    let mut overrides = Vec::new();
    for o in after.overrides() {
        let found = before.overrides().iter().find(|b| b.name() == o.name());
        match found {
            Some(b) => {
                let fields = fields_of_override(b, o);
                let buckets = fate(
                    (no_bucket(b), b.params().rate(), b.bucket_tag()),
                    (no_bucket(o), o.params().rate(), o.bucket_tag()),
                    same_key,
                );
                if !fields.is_empty() || !buckets.unchanged() {
                    overrides.push(OverrideChange {
                        name: o.name().to_owned(),
                        change: Change::Changed,
                        fields,
                        buckets,
                    });
                }
            }
            None => overrides.push(OverrideChange {
                name: o.name().to_owned(),
                change: Change::Added,
                fields: Vec::new(),
                buckets: if no_bucket(o) {
                    Buckets::None
                } else {
                    Buckets::New
                },
            }),
        }
    }
    for b in before.overrides() {
        if !after.overrides().iter().any(|o| o.name() == b.name()) {
            overrides.push(OverrideChange {
                name: b.name().to_owned(),
                change: Change::Removed,
                fields: Vec::new(),
                buckets: if no_bucket(b) {
                    Buckets::None
                } else {
                    Buckets::Dropped
                },
            });
        }
    }
    let enforcement = match (enforces(before), enforces(after)) {
        (false, true) => Some("starts rejecting"),
        (true, false) => Some("stops rejecting"),
        _ if before.rollout() != after.rollout() && after.mode() == Mode::Enforce => {
            Some(if after.rollout() > before.rollout() {
                "enforced for more subjects"
            } else {
                "enforced for fewer subjects"
            })
        }
        _ => None,
    };
    let unchanged = fields.is_empty() && overrides.is_empty() && buckets.unchanged();
    (!unchanged).then(|| LimitChange {
        name: after.name().to_owned(),
        domain: after.domain().to_owned(),
        change: Change::Changed,
        fields,
        buckets,
        enforcement,
        overrides,
    })
}

/// Whether an override counts nothing (it takes its requests out of the limit, or denies
/// them).
fn no_bucket(o: &Override) -> bool {
    o.unlimited() || o.deny()
}

/// An override's fields that differ, as `GET /v1/policy` shows an override.
fn fields_of_override(before: &Override, after: &Override) -> Vec<Field> {
    fields(
        &policy_view::override_entry(before),
        &policy_view::override_entry(after),
        &["name"],
    )
}

/// What becomes of buckets under (deny, token-bucket rate, tag) before and after, the key
/// entries the same or not.
fn fate(
    (was_none, was_rate, was_tag): (bool, Option<&tollgate::Limit>, u32),
    (is_none, is_rate, is_tag): (bool, Option<&tollgate::Limit>, u32),
    same_key: bool,
) -> Buckets {
    let token_bucket = |rate: Option<&tollgate::Limit>| rate.is_some_and(|r| r.window().is_none());
    match (was_none, is_none) {
        (true, true) => Buckets::None,
        (false, true) => Buckets::Dropped,
        (true, false) => Buckets::New,
        (false, false) if !same_key => Buckets::Afresh,
        (false, false) if was_tag == is_tag => Buckets::Kept,
        // The engine converts token buckets alone; a window or a log under another window or
        // algorithm is another bucket.
        (false, false) if token_bucket(was_rate) && token_bucket(is_rate) => Buckets::CarriedOver,
        (false, false) => Buckets::Afresh,
    }
}

/// The fields of two JSON objects that differ, `skip` left out, in the new object's order
/// then the old one's.
fn fields(before: &Value, after: &Value, skip: &[&str]) -> Vec<Field> {
    let empty = serde_json::Map::new();
    let before = before.as_object().unwrap_or(&empty);
    let after = after.as_object().unwrap_or(&empty);
    let names = after
        .keys()
        .chain(before.keys().filter(|k| !after.contains_key(*k)));
    names
        .filter(|name| !skip.contains(&name.as_str()))
        .filter_map(|name| {
            let from = before.get(name).cloned().unwrap_or(Value::Null);
            let to = after.get(name).cloned().unwrap_or(Value::Null);
            (from != to).then(|| Field {
                field: name.clone(),
                from,
                to,
            })
        })
        .collect()
}

/// Exemptions added, removed or changed, found by their limit and conditions.
fn exemptions(old: &Policy, new: &Policy) -> Vec<ExemptionChange> {
    let keyed = |policy: &Policy| -> BTreeMap<(String, String), Value> {
        policy
            .exemptions()
            .iter()
            .map(|e| {
                let view = policy_view::exemption(e);
                ((e.limit().to_owned(), view["when"].to_string()), view)
            })
            .collect()
    };
    let (before, after) = (keyed(old), keyed(new));
    let mut changes = Vec::new();
    for ((limit, _), view) in &after {
        let key = (limit.clone(), view["when"].to_string());
        let (change, fields) = match before.get(&key) {
            None => (Change::Added, Vec::new()),
            Some(was) => {
                let fields = fields(was, view, &["limit", "when"]);
                if fields.is_empty() {
                    continue;
                }
                (Change::Changed, fields)
            }
        };
        changes.push(ExemptionChange {
            limit: limit.clone(),
            when: view["when"].clone(),
            change,
            fields,
        });
    }
    for ((limit, when), view) in &before {
        if !after.contains_key(&(limit.clone(), when.clone())) {
            changes.push(ExemptionChange {
                limit: limit.clone(),
                when: view["when"].clone(),
                change: Change::Removed,
                fields: Vec::new(),
            });
        }
    }
    changes
}

/// A value as the file writes it: a string bare, anything else as JSON, `-` for not set.
fn shown(value: &Value) -> String {
    match value {
        Value::Null => "-".to_owned(),
        Value::String(text) => text.clone(),
        other => other.to_string(),
    }
}

/// `field: from -> to`, a line each, after `indent`.
fn write_fields(out: &mut String, fields: &[Field], indent: &str) {
    for f in fields {
        let (from, to) = (shown(&f.from), shown(&f.to));
        let _ = writeln!(out, "{indent}{}: {from} -> {to}", f.field);
    }
}

/// The diff for people, one change a line or a few.
pub(crate) fn render(diff: &PolicyDiff) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "version {} -> {}", diff.from_version, diff.to_version);
    for file in &diff.files {
        let _ = writeln!(out, "{} file {}", file.change.sign(), file.name);
    }
    if diff.is_empty() {
        out.push_str("no limit or exemption differs\n");
        return out;
    }
    for limit in &diff.limits {
        let _ = writeln!(
            out,
            "{} limit {} (domain {})",
            limit.change.sign(),
            limit.name,
            limit.domain
        );
        write_fields(&mut out, &limit.fields, "    ");
        if let Some(enforcement) = limit.enforcement {
            let _ = writeln!(out, "    {enforcement}");
        }
        let _ = writeln!(out, "    buckets: {}", limit.buckets.says());
        for o in &limit.overrides {
            let _ = writeln!(out, "  {} override {}", o.change.sign(), o.name);
            write_fields(&mut out, &o.fields, "      ");
            let _ = writeln!(out, "      buckets: {}", o.buckets.says());
        }
    }
    for e in &diff.exemptions {
        let _ = writeln!(
            out,
            "{} exemption of {} when {}",
            e.change.sign(),
            e.limit,
            e.when
        );
        write_fields(&mut out, &e.fields, "    ");
    }
    let count = |change: Change| diff.limits.iter().filter(|l| l.change == change).count();
    let afresh = diff.afresh().count();
    let _ = writeln!(
        out,
        "limits: {} changed, {} added, {} removed; {} whose buckets start afresh; exemptions: {} \
         changed",
        count(Change::Changed),
        count(Change::Added),
        count(Change::Removed),
        afresh,
        diff.exemptions.len()
    );
    out
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use tollgate::ManualClock;
    use tollgate_policy::{EngineOptions, PolicyEngine, compile};

    use super::*;

    const OLD: &str = "version: old\nlimits:\n";

    fn policy(limits: &str) -> Policy {
        match compile("p.yaml", &format!("{OLD}{limits}")) {
            Ok(policy) => policy,
            Err(err) => panic!("{err}\n{limits}"),
        }
    }

    /// The one limit change between two one-limit files.
    fn change(before: &str, after: &str) -> LimitChange {
        let mut diff = diff(&policy(before), &policy(after));
        assert_eq!(diff.limits.len(), 1, "{diff:?}");
        diff.limits.remove(0)
    }

    fn bucket(extra: &str) -> String {
        format!("  - {{name: a, domain: api, key: [user]{extra}}}\n")
    }

    /// What a request of 1 would leave a subject that spent 2 under `before`, right after a
    /// reload to `after`, on an engine, with no time passing: the truth the diff's claims are
    /// held to.
    fn remaining_after_reload(before: &str, after: &str, descriptor: &[(&str, &str)]) -> u64 {
        let clock = Arc::new(ManualClock::new());
        let options = EngineOptions::default().clock(clock.clone());
        let engine = PolicyEngine::new(policy(before), options);
        for _ in 0..2 {
            let outcome = engine
                .decide("api", &[descriptor], 1, None)
                .expect("decided");
            assert!(outcome.allowed, "{outcome:?}");
        }
        clock.advance(Duration::from_millis(1));
        engine
            .load("p.yaml", &format!("{OLD}{after}"))
            .expect("the new version loads");
        let outcome = engine.explain("api", &[descriptor], 1).expect("explained");
        outcome.limits[0]
            .decision
            .expect("a bucket decides")
            .remaining()
    }

    #[test]
    fn the_same_file_differs_in_nothing() {
        let text = bucket(", capacity: 5, refill: 1/s");
        assert!(diff(&policy(&text), &policy(&text)).is_empty());
        // Nor do limits and overrides that count nothing, before and after.
        let text = format!(
            "{}  - name: blocked\n    domain: api\n    key: [ip]\n    deny: true\n    overrides:\n      - {{when: {{ip: 10.0.0.1}}, unlimited: true}}\n",
            bucket(", capacity: 5, refill: 1/s, overrides: [{when: {tier: s}, unlimited: true}]")
        );
        let d = diff(&policy(&text), &policy(&text));
        assert!(d.is_empty(), "{d:?}");
    }

    #[test]
    fn each_claim_about_buckets_is_what_a_reload_does() {
        let user = [("user", "u1")];
        // Kept: a window's limit per window changes, its counts stay (2 of 10 used, so a
        // request would leave 17 of 20).
        let before = bucket(", algorithm: fixed_window, limit: 10, window: 1h");
        let after = bucket(", algorithm: fixed_window, limit: 20, window: 1h");
        let kept = change(&before, &after);
        assert_eq!(kept.buckets, Buckets::Kept);
        assert_eq!(
            kept.fields,
            vec![Field {
                field: "limit".into(),
                from: 10.into(),
                to: 20.into()
            }]
        );
        assert_eq!(remaining_after_reload(&before, &after, &user), 17);
        // Afresh: another window length, a new count (a whole burst: 19 of 20 left after one).
        let after = bucket(", algorithm: fixed_window, limit: 20, window: 2h");
        assert_eq!(change(&before, &after).buckets, Buckets::Afresh);
        assert_eq!(remaining_after_reload(&before, &after, &user), 19);
        // Afresh: another algorithm.
        let after = bucket(", algorithm: sliding_window, limit: 10, window: 1h");
        assert_eq!(change(&before, &after).buckets, Buckets::Afresh);
        assert_eq!(remaining_after_reload(&before, &after, &user), 9);
        // Carried over: a token bucket's capacity doubles, its balance is kept (3 of 5 left,
        // then 3 of 10, not a full 10; 2 after one more).
        let before = bucket(", capacity: 5, refill: 1/h");
        let after = bucket(", capacity: 10, refill: 1/h");
        assert_eq!(change(&before, &after).buckets, Buckets::CarriedOver);
        assert_eq!(remaining_after_reload(&before, &after, &user), 2);
        // Afresh: other key entries, other bucket keys.
        let after = "  - {name: a, domain: api, key: [user, tier], capacity: 5, refill: 1/h}\n";
        assert_eq!(change(&before, after).buckets, Buckets::Afresh);
        let both = [("user", "u1"), ("tier", "t")];
        let clock = Arc::new(ManualClock::new());
        let engine = PolicyEngine::new(policy(&before), EngineOptions::default().clock(clock));
        assert!(engine.decide("api", &[&both], 5, None).expect("ok").allowed);
        engine
            .load("p.yaml", &format!("{OLD}{after}"))
            .expect("loads");
        let fresh = engine.explain("api", &[&both], 1).expect("explained");
        assert_eq!(fresh.limits[0].decision.expect("a bucket").remaining(), 4);
        // Kept: only the mode changes.
        let shadow = bucket(", capacity: 5, refill: 1/h, mode: shadow");
        let kept = change(&before, &shadow);
        assert_eq!(kept.buckets, Buckets::Kept);
        assert_eq!(kept.enforcement, Some("stops rejecting"));
        assert_eq!(remaining_after_reload(&before, &shadow, &user), 2);
    }

    #[test]
    fn overrides_limits_and_exemptions_are_found_by_name() {
        let before = "  - name: a\n    domain: api\n    key: [user]\n    capacity: 5\n    refill: 1/s\n    overrides:\n      - {name: premium, when: {tier: p}, capacity: 50}\n      - {name: staff, when: {tier: s}, unlimited: true}\n  - {name: gone, domain: api, key: [ip], capacity: 1, refill: 1/s}\n";
        let after = "  - name: a\n    domain: api\n    key: [user]\n    capacity: 5\n    refill: 1/s\n    overrides:\n      - {name: premium, when: {tier: p}, limit: 1, window: 1m}\n      - {name: gold, when: {tier: g}, capacity: 500}\n  - {name: blocked, domain: api, when: {user: m}, key: [user], deny: true}\n";
        let bad = compile("p.yaml", &format!("{OLD}{after}"));
        assert!(bad.is_err(), "an override of another algorithm is refused");
        let after = after.replace("limit: 1, window: 1m", "capacity: 60, refill: 2/s");
        let d = diff(&policy(before), &policy(&after));
        let names: Vec<(&str, Change)> = d
            .limits
            .iter()
            .map(|l| (l.name.as_str(), l.change))
            .collect();
        assert_eq!(
            names,
            vec![
                ("a", Change::Changed),
                ("blocked", Change::Added),
                ("gone", Change::Removed)
            ]
        );
        let a = &d.limits[0];
        assert!(a.fields.is_empty(), "{:?}", a.fields);
        assert_eq!(a.buckets, Buckets::Kept);
        let overrides: Vec<(&str, Change, Buckets)> = a
            .overrides
            .iter()
            .map(|o| (o.name.as_str(), o.change, o.buckets))
            .collect();
        assert_eq!(
            overrides,
            vec![
                ("premium", Change::Changed, Buckets::CarriedOver),
                ("gold", Change::Added, Buckets::New),
                ("staff", Change::Removed, Buckets::None),
            ]
        );
        assert_eq!(
            d.limits[1].buckets,
            Buckets::None,
            "a deny limit counts nothing"
        );
        assert_eq!(d.limits[1].enforcement, Some("starts rejecting"));
        assert_eq!(d.limits[2].buckets, Buckets::Dropped);

        let text = render(&d);
        assert!(
            text.starts_with("version old -> old\n~ limit a (domain api)\n"),
            "{text}"
        );
        assert!(
            text.contains("  ~ override premium\n      capacity: 50 -> 60\n"),
            "{text}"
        );
        assert!(text.contains("      refill: 1/s -> 2/s\n"), "{text}");
        assert!(
            text.contains("+ limit blocked (domain api)\n    starts rejecting\n"),
            "{text}"
        );
        assert!(text.ends_with(
            "limits: 1 changed, 1 added, 1 removed; 0 whose buckets start afresh; exemptions: 0 changed\n"
        ), "{text}");

        let with = |expires: &str| {
            format!(
                "{}exemptions:\n  - {{limit: a, when: {{user: vip}}, owner: o, reason: r, expires: {expires}}}\n",
                bucket(", capacity: 5, refill: 1/s")
            )
        };
        let d = diff(
            &policy(&bucket(", capacity: 5, refill: 1/s")),
            &policy(&with("2030-01-01T00:00:00Z")),
        );
        assert_eq!(d.exemptions.len(), 1);
        assert_eq!(d.exemptions[0].change, Change::Added);
        let d = diff(
            &policy(&with("2030-01-01T00:00:00Z")),
            &policy(&with("2031-01-01T00:00:00Z")),
        );
        assert_eq!(d.exemptions[0].change, Change::Changed);
        assert_eq!(d.exemptions[0].fields[0].field, "expires");
        assert!(d.limits.is_empty());
    }
}
