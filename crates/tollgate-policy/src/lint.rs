//! Warnings about a valid policy: parts that load but do nothing, or soon will not.
//!
//! Validation refuses what cannot work; a policy kept as code in a repository also gathers
//! what works and means nothing: an exemption whose expiry has passed, an override that an
//! earlier one always wins over, a rollout of 0 %. None of it is an error (the server runs the
//! file as written), but a reviewer wants to hear of it, and a CI job may want to refuse it
//! (`tollgate validate --strict`).

use std::fmt;
use std::time::Duration;

use crate::policy::{LimitDef, Mode, Policy, ValueMatch};
use crate::wall::UnixTime;

/// How soon an exemption's expiry is worth a warning: a week, time to renew or let it go.
pub const EXPIRING_SOON: Duration = Duration::from_secs(7 * 86_400);

/// One thing worth a reviewer's look in a valid policy.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Warning {
    /// An exemption whose expiry has passed: it no longer applies.
    ExemptionExpired {
        /// The limit it lifted.
        limit: String,
        /// Who owns it.
        owner: String,
        /// When it expired.
        expired: UnixTime,
    },
    /// An exemption that expires within [`EXPIRING_SOON`].
    ExemptionExpiring {
        /// The limit it lifts.
        limit: String,
        /// Who owns it.
        owner: String,
        /// When it expires.
        expires: UnixTime,
    },
    /// An enforced limit whose rollout is 0 %: it rejects no one, as a shadow limit.
    RolloutZero {
        /// The limit.
        limit: String,
    },
    /// A shadow limit with a rollout below 100 %: shadow mode wins, the rollout does nothing.
    RolloutOfShadow {
        /// The limit.
        limit: String,
    },
    /// An override that never applies: an earlier one matches every request it would.
    OverrideUnreachable {
        /// The limit.
        limit: String,
        /// The override that never applies.
        unreachable: String,
        /// The earlier one that wins.
        by: String,
    },
    /// An override with its limit's own parameters: it changes nothing but the bucket key.
    OverrideSameParams {
        /// The limit.
        limit: String,
        /// The override.
        name: String,
    },
    /// A `when` value ending in `*`, matched exactly as written: Envoy's wildcard spelling,
    /// which here is `!prefix`.
    StarValue {
        /// The limit whose condition, override's or exemption's it is.
        limit: String,
        /// The descriptor entry.
        entry: String,
        /// The value as written.
        value: String,
    },
    /// A deny limit without `when`: it rejects every request of its domain (that carries its
    /// key entries), which a block list rarely means.
    DenyWithoutConditions {
        /// The limit.
        limit: String,
        /// Its domain.
        domain: String,
    },
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Warning::ExemptionExpired {
                limit,
                owner,
                expired,
            } => write!(
                f,
                "exemption of limit {limit:?} (owner {owner}) expired at {}: it no longer \
                 applies; remove it",
                expired.to_rfc3339()
            ),
            Warning::ExemptionExpiring {
                limit,
                owner,
                expires,
            } => write!(
                f,
                "exemption of limit {limit:?} (owner {owner}) expires at {}, within a week",
                expires.to_rfc3339()
            ),
            Warning::RolloutZero { limit } => write!(
                f,
                "limit {limit:?} has rollout 0%: it rejects no one; say mode: shadow if that \
                 is meant"
            ),
            Warning::RolloutOfShadow { limit } => write!(
                f,
                "limit {limit:?} is in shadow mode, so its rollout does nothing: shadow \
                 decides for every subject"
            ),
            Warning::OverrideUnreachable {
                limit,
                unreachable,
                by,
            } => write!(
                f,
                "override {unreachable:?} of limit {limit:?} never applies: override {by:?} \
                 before it matches every request it would (the first match wins)"
            ),
            Warning::OverrideSameParams { limit, name } => write!(
                f,
                "override {name:?} of limit {limit:?} sets the limit's own parameters: it \
                 only moves its subjects to buckets of their own"
            ),
            Warning::StarValue {
                limit,
                entry,
                value,
            } => {
                write!(
                    f,
                    "limit {limit:?}: `{entry}: {value}` matches the value {value:?} exactly, \
                     star included; "
                )?;
                match value.trim_end_matches('*') {
                    "" => write!(f, "to match any value, write `{entry}: !prefix ''`"),
                    prefix => write!(
                        f,
                        "to match the values that start with {prefix:?}, write `{entry}: \
                         !prefix {prefix}`"
                    ),
                }
            }
            Warning::DenyWithoutConditions { limit, domain } => write!(
                f,
                "deny limit {limit:?} has no `when`: it rejects every request of domain \
                 {domain:?} that has its key entries; list what it blocks in `when`"
            ),
        }
    }
}

/// The warnings about `policy` at `now` (for exemptions' expiry), in file order.
pub fn lint(policy: &Policy, now: UnixTime) -> Vec<Warning> {
    lint_by_file(policy, now)
        .into_iter()
        .map(|(_, warning)| warning)
        .collect()
}

/// [`lint`], each warning with the file of a policy directory the limit or exemption it is
/// about is written in (`None` for a policy of one file), so that it reaches the team that
/// owns that file.
pub fn lint_by_file(policy: &Policy, now: UnixTime) -> Vec<(Option<&str>, Warning)> {
    let mut warnings = Vec::new();
    for limit in policy.limits() {
        let mut found = Vec::new();
        lint_limit(limit, &mut found);
        warnings.extend(found.into_iter().map(|w| (limit.file(), w)));
    }
    for exemption in policy.exemptions() {
        let mut found = Vec::new();
        star_values(exemption.limit(), exemption.when(), &mut found);
        warnings.extend(found.into_iter().map(|w| (exemption.file(), w)));
    }
    let soon = i64::try_from(EXPIRING_SOON.as_nanos()).unwrap_or(i64::MAX);
    for exemption in policy.exemptions() {
        let (limit, owner) = (exemption.limit().to_owned(), exemption.owner().to_owned());
        let expires = exemption.expires();
        if !exemption.is_active(now) {
            warnings.push((
                exemption.file(),
                Warning::ExemptionExpired {
                    limit,
                    owner,
                    expired: expires,
                },
            ));
        } else if expires.as_nanos().saturating_sub(now.as_nanos()) <= soon {
            warnings.push((
                exemption.file(),
                Warning::ExemptionExpiring {
                    limit,
                    owner,
                    expires,
                },
            ));
        }
    }
    warnings
}

fn lint_limit(limit: &LimitDef, warnings: &mut Vec<Warning>) {
    let name = || limit.name().to_owned();
    match (limit.mode(), limit.rollout()) {
        (Mode::Enforce, 0) => warnings.push(Warning::RolloutZero { limit: name() }),
        (Mode::Shadow, rollout) if rollout < 10_000 => {
            warnings.push(Warning::RolloutOfShadow { limit: name() });
        }
        _ => {}
    }
    if limit.deny() && limit.when().next().is_none() {
        warnings.push(Warning::DenyWithoutConditions {
            limit: name(),
            domain: limit.domain().to_owned(),
        });
    }
    star_values(limit.name(), limit.when(), warnings);
    for o in limit.overrides() {
        star_values(limit.name(), o.when(), warnings);
    }
    let overrides = limit.overrides();
    for (at, this) in overrides.iter().enumerate() {
        // An earlier override each of whose conditions one of this one's implies (same entry,
        // a value or prefix within the earlier's) matches whenever this one would, and is
        // tried first.
        let winner = overrides[..at].iter().find(|earlier| {
            earlier.when().all(|(entry, wider)| {
                this.when()
                    .any(|(e, test)| e == entry && test.within(wider))
            })
        });
        if let Some(earlier) = winner {
            warnings.push(Warning::OverrideUnreachable {
                limit: name(),
                unreachable: this.name().to_owned(),
                by: earlier.name().to_owned(),
            });
        } else if !this.unlimited() && !this.deny() && this.params() == limit.params() {
            warnings.push(Warning::OverrideSameParams {
                limit: name(),
                name: this.name().to_owned(),
            });
        }
    }
}

/// Exact `when` values ending in `*` (Envoy's wildcard spelling, not tollgate's).
fn star_values<'a>(
    limit: &str,
    when: impl Iterator<Item = (&'a str, &'a ValueMatch)>,
    warnings: &mut Vec<Warning>,
) {
    for (entry, test) in when {
        for value in test.exact_values() {
            if value.ends_with('*') {
                warnings.push(Warning::StarValue {
                    limit: limit.to_owned(),
                    entry: entry.to_owned(),
                    value: value.to_string(),
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile;

    #[test]
    fn a_deny_limit_without_conditions_is_named() {
        let yaml = "version: 1\nlimits:\n  - {name: all, domain: edge, key: [ip], deny: true}\n  - {name: listed, domain: edge, when: {ip: [a, b]}, key: [ip], deny: true}\n  - {name: banned, domain: edge, key: [user], capacity: 5, refill: 1/s, overrides: [{when: {tier: banned}, deny: true}]}\n";
        let policy = compile("p.yaml", yaml).unwrap_or_else(|e| panic!("{e}"));
        let warnings = lint(&policy, NOW);
        assert_eq!(
            warnings,
            [Warning::DenyWithoutConditions {
                limit: "all".into(),
                domain: "edge".into()
            }]
        );
        assert!(warnings[0].to_string().contains("rejects every request"));
    }

    const NOW: UnixTime = UnixTime::from_secs(1_795_946_400); // 2026-11-29T10:00:00Z

    fn warnings(yaml: &str) -> Vec<String> {
        let policy = compile("t.yaml", yaml).unwrap();
        lint(&policy, NOW).iter().map(ToString::to_string).collect()
    }

    #[test]
    fn a_tidy_policy_has_no_warnings() {
        let yaml = "version: 1\nlimits:\n  - name: a\n    domain: api\n    key: [user]\n    capacity: 5\n    refill: 1/s\n    overrides:\n      - when: {tier: gold}\n        capacity: 50\n        refill: 10/s\n      - when: {tier: internal}\n        unlimited: true\n  - {name: watched, domain: api, key: [ip], capacity: 5, refill: 1/s, mode: shadow, rollout: 100%}\n";
        // An unlimited override keeps its limit's parameters inside, never applying them: it
        // is not an override that changes nothing. A shadow limit over every subject is what
        // shadow mode is for.
        assert_eq!(warnings(yaml), Vec::<String>::new());
    }

    #[test]
    fn dead_rollouts_and_overrides_are_named() {
        let yaml = "\
version: 1
limits:
  - name: zero
    domain: api
    key: [user]
    capacity: 5
    refill: 1/s
    rollout: 0%
  - name: shadowed
    domain: api
    key: [user]
    capacity: 5
    refill: 1/s
    mode: shadow
    rollout: 50%
  - name: tiers
    domain: api
    key: [user]
    capacity: 5
    refill: 1/s
    overrides:
      - name: gold
        when: {tier: gold}
        capacity: 50
        refill: 10/s
      - name: gold-eu
        when: {tier: gold, region: eu}
        capacity: 80
        refill: 10/s
      - name: silver
        when: {tier: silver}
        capacity: 5
        refill: 1/s
";
        let found = warnings(yaml);
        assert_eq!(found.len(), 4, "{found:#?}");
        assert!(found[0].contains("\"zero\" has rollout 0%"), "{}", found[0]);
        assert!(
            found[1].contains("\"shadowed\" is in shadow mode"),
            "{}",
            found[1]
        );
        assert!(
            found[2].contains("override \"gold-eu\"") && found[2].contains("override \"gold\""),
            "{}",
            found[2]
        );
        assert!(found[3].contains("\"silver\"") && found[3].contains("own parameters"));
    }

    #[test]
    fn an_override_behind_a_wider_prefix_is_named() {
        let yaml = "\
version: 1
limits:
  - name: paths
    domain: api
    key: [path]
    capacity: 5
    refill: 1/s
    overrides:
      - name: health
        when: {path: /api/health}
        capacity: 50
        refill: 10/s
      - name: api
        when: {path: !prefix /api/}
        capacity: 20
        refill: 10/s
      - name: v2
        when: {path: !prefix /api/v2/}
        capacity: 80
        refill: 10/s
      - name: admin
        when: {path: /api/admin}
        capacity: 1
        refill: 1/s
      - name: web
        when: {path: !prefix /web}
        capacity: 2
        refill: 1/s
      - name: web-exact
        when: {path: /web}
        capacity: 3
        refill: 1/s
";
        let found = warnings(yaml);
        let unreachable = |name: &str, by: &str| {
            found.iter().any(|w| {
                w.contains(&format!("override \"{name}\"")) && w.contains(&format!("\"{by}\""))
            })
        };
        // An exact value first, then a prefix that covers it: both reachable.
        assert!(
            !found.iter().any(|w| w.contains("\"health\"")),
            "{found:#?}"
        );
        assert!(unreachable("v2", "api"), "{found:#?}");
        assert!(unreachable("admin", "api"), "{found:#?}");
        assert!(unreachable("web-exact", "web"), "{found:#?}");
        assert_eq!(found.len(), 3, "{found:#?}");
    }

    #[test]
    fn a_value_spelt_as_an_envoy_wildcard_is_named() {
        let yaml = "\
version: 1
limits:
  - name: paths
    domain: api
    when: {path: /api/*}
    capacity: 5
    refill: 1/s
    overrides:
      - when: {tier: gold*}
        capacity: 50
        refill: 10/s
  - name: fine
    domain: api
    when: {path: !prefix /api/, glob: '*'}
    capacity: 5
    refill: 1/s
exemptions:
  - limit: paths
    when: {user: svc-*}
    owner: ops@example.com
    reason: internal
    expires: 2099-01-01T00:00:00Z
";
        let found = warnings(yaml);
        assert_eq!(found.len(), 4, "{found:#?}");
        assert!(found[0].contains("`path: /api/*`") && found[0].contains("!prefix /api/"));
        assert!(found[1].contains("`tier: gold*`"), "{}", found[1]);
        assert!(
            found[2].contains("`glob: *`") && found[2].contains("`glob: !prefix ''`"),
            "{}",
            found[2]
        );
        assert!(found[3].contains("`user: svc-*`"), "{}", found[3]);
    }

    #[test]
    fn exemptions_past_or_near_their_expiry_are_named() {
        let exemption = |expires: &str| {
            format!(
                "version: 1\nlimits:\n  - name: a\n    domain: api\n    key: [user]\n    capacity: 5\n    refill: 1/s\nexemptions:\n  - limit: a\n    when: {{user: vip}}\n    owner: ops@example.com\n    reason: launch\n    expires: {expires}\n"
            )
        };
        let expired = warnings(&exemption("2026-11-01T00:00:00Z"));
        assert_eq!(expired.len(), 1);
        assert!(
            expired[0].contains("expired at 2026-11-01T00:00:00Z"),
            "{}",
            expired[0]
        );
        let soon = warnings(&exemption("2026-12-03T00:00:00Z"));
        assert!(soon[0].contains("within a week"), "{}", soon[0]);
        assert!(warnings(&exemption("2027-01-01T00:00:00Z")).is_empty());
    }
}
