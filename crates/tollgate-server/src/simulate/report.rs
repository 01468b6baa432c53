//! The report of a simulation, as text for people and as JSON for scripts.
//!
//! Both are built from one [`Report`] so they cannot disagree. Times are RFC 3339 (UTC).

use std::fmt::Write as _;

use serde::Serialize;
use tollgate_policy::UnixTime;

use super::tally::{Counts, Slot, Tally};

/// A line of the trace that was not a request, and why.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub(crate) struct BadLine {
    /// Its number, from 1.
    pub(crate) line: u64,
    /// Why it was skipped.
    pub(crate) error: String,
}

/// What the trace held.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct TraceSummary {
    /// Where it was read from (`-` for standard input).
    pub(crate) source: String,
    /// Lines read, blank ones included.
    pub(crate) lines: u64,
    /// Requests replayed.
    pub(crate) requests: u64,
    /// Lines skipped because they were not valid requests.
    pub(crate) skipped: u64,
    /// The first few of those.
    pub(crate) first_skipped: Vec<BadLine>,
    /// Requests that came earlier than one before them; replayed at the latest time seen, as a
    /// server receiving them in that order would have decided them.
    pub(crate) out_of_order: u64,
    /// Requests whose line says how long they were in flight (`duration_ms`): the ones that
    /// take leases of concurrency limits.
    pub(crate) with_duration: u64,
    /// Requests whose line says what they used of their cost (`used`): reservations, settled
    /// at their end.
    pub(crate) with_used: u64,
    /// The first request's time.
    pub(crate) first: Option<String>,
    /// The last request's time.
    pub(crate) last: Option<String>,
    /// The timeline's interval, in milliseconds.
    pub(crate) interval_ms: u64,
}

/// One policy's report.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct PolicyReport {
    /// The policy file or directory.
    pub(crate) file: String,
    /// Its version.
    pub(crate) version: String,
    /// The requests' fates.
    #[serde(flatten)]
    pub(crate) counts: Counts,
    /// The first of those.
    pub(crate) first_invalid: Option<BadLine>,
    /// Concurrency limits in the policy, exercised by the requests whose line gives
    /// `duration_ms` only.
    pub(crate) concurrency_limits: usize,
    /// Requests that held a lease of a concurrency limit.
    pub(crate) leases: u64,
    /// Leases that timed out before their request ended (`lease_timeout` shorter than the
    /// request).
    pub(crate) leases_timed_out: u64,
    /// Reservations settled at their end.
    pub(crate) settled: u64,
    /// Tokens their settlements gave back.
    pub(crate) given_back: u64,
    /// Reservations that ended too late to be settled (past the idempotency window).
    pub(crate) settle_missed: u64,
    /// Each rate limit.
    pub(crate) limits: Vec<LimitReport>,
    /// Requests by interval: every interval from the first request's to the last's, or only
    /// those that saw requests when that would be more than 100,000.
    pub(crate) timeline: Vec<TimelineSlot>,
}

/// One limit's counts.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct LimitReport {
    /// The limit's name.
    pub(crate) name: String,
    /// Its algorithm.
    pub(crate) algorithm: String,
    /// Times it applied.
    pub(crate) decisions: u64,
    /// Times it was enforced and rejected.
    pub(crate) rejected: u64,
    /// Times it would have rejected (shadow mode, outside its rollout).
    pub(crate) would_reject: u64,
    /// Times an exemption lifted it.
    pub(crate) exempt: u64,
    /// Allowed decisions that left it nearly used up (`--near-limit-ratio`).
    pub(crate) near_limit: u64,
    /// When it first rejected or would have.
    pub(crate) first_rejection: Option<String>,
    /// The keys it rejected most (rejections and would-rejections).
    pub(crate) top_keys: Vec<KeyCount>,
    /// Rejections of keys past the first 100,000 distinct ones, not counted by key.
    pub(crate) other_keys: u64,
}

/// A bucket key and how often it was rejected.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub(crate) struct KeyCount {
    /// The bucket key, as `/v1/explain` shows it.
    pub(crate) key: String,
    /// Its rejections.
    pub(crate) rejections: u64,
}

/// One interval of the timeline.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub(crate) struct TimelineSlot {
    /// The interval's start.
    pub(crate) start: String,
    /// Requests decided.
    pub(crate) requests: u64,
    /// Requests rejected.
    pub(crate) rejected: u64,
    /// Requests allowed that a shadow limit would have rejected.
    pub(crate) would_reject: u64,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Report {
    /// The trace.
    pub(crate) trace: TraceSummary,
    /// Each policy, in the order given; the first is the baseline the others compare with.
    pub(crate) policies: Vec<PolicyReport>,
}

impl PolicyReport {
    /// The report of `tally`, for the policy `file` at `version`, its most rejected `top` keys.
    pub(crate) fn new(file: String, version: String, tally: &Tally, top: usize) -> Self {
        Self {
            file,
            version,
            counts: tally.counts,
            first_invalid: tally.first_invalid.as_ref().map(|(line, error)| BadLine {
                line: *line,
                error: error.clone(),
            }),
            concurrency_limits: tally.concurrency_limits,
            leases: tally.leases,
            leases_timed_out: tally.leases_timed_out,
            settled: tally.settled,
            given_back: tally.given_back,
            settle_missed: tally.settle_missed,
            limits: tally
                .limits
                .iter()
                .map(|limit| LimitReport {
                    name: limit.name.to_string(),
                    algorithm: limit.algorithm.to_owned(),
                    decisions: limit.decisions,
                    rejected: limit.rejected,
                    would_reject: limit.would_reject,
                    exempt: limit.exempt,
                    near_limit: limit.near_limit,
                    first_rejection: limit.first_rejection.map(UnixTime::to_rfc3339),
                    top_keys: limit
                        .top_keys(top)
                        .into_iter()
                        .map(|(key, rejections)| KeyCount {
                            key: key.to_owned(),
                            rejections,
                        })
                        .collect(),
                    other_keys: limit.other_keys,
                })
                .collect(),
            timeline: timeline(tally),
        }
    }
}

/// The most intervals a timeline lists with the empty ones among them.
pub(crate) const MAX_DENSE_INTERVALS: u64 = 100_000;

/// Every interval from the first to the last, the empty ones too, so that a script can chart
/// it as it comes; or, when that would be more than [`MAX_DENSE_INTERVALS`] (a long trace
/// in short intervals), the intervals that saw requests.
fn timeline(tally: &Tally) -> Vec<TimelineSlot> {
    let (Some((&first, _)), Some((&last, _))) = (
        tally.timeline.first_key_value(),
        tally.timeline.last_key_value(),
    ) else {
        return Vec::new();
    };
    let interval_ns = u64::try_from(tally.interval().as_nanos()).unwrap_or(u64::MAX);
    let slot_at = |index: u64, slot: Slot| {
        let start = i64::try_from(index.saturating_mul(interval_ns)).unwrap_or(i64::MAX);
        TimelineSlot {
            start: UnixTime::from_nanos(start).to_rfc3339(),
            requests: slot.requests,
            rejected: slot.rejected,
            would_reject: slot.would_reject,
        }
    };
    if last - first < MAX_DENSE_INTERVALS {
        (first..=last)
            .map(|index| {
                slot_at(
                    index,
                    tally.timeline.get(&index).copied().unwrap_or_default(),
                )
            })
            .collect()
    } else {
        tally
            .timeline
            .iter()
            .map(|(&index, &slot)| slot_at(index, slot))
            .collect()
    }
}

/// `12.34 %` of `part` in `whole` (`-` of nothing). Only for people to read: no decision
/// rests on it.
fn percent(part: u64, whole: u64) -> String {
    if whole == 0 {
        return "-".to_owned();
    }
    let hundredths = u128::from(part) * 10_000 / u128::from(whole);
    format!("{}.{:02} %", hundredths / 100, hundredths % 100)
}

impl Report {
    /// The report for people.
    pub(crate) fn text(&self) -> String {
        let mut out = String::new();
        let trace = &self.trace;
        let span = match (&trace.first, &trace.last) {
            (Some(first), Some(last)) => format!(" from {first} to {last}"),
            _ => String::new(),
        };
        let _ = writeln!(
            out,
            "replayed {} requests of {} ({} lines){span}",
            trace.requests, trace.source, trace.lines
        );
        if trace.out_of_order > 0 {
            let _ = writeln!(
                out,
                "{} requests came earlier than one before them and were decided at the latest \
                 time seen",
                trace.out_of_order
            );
        }
        if trace.skipped > 0 {
            let _ = writeln!(
                out,
                "skipped {} lines that are not requests:",
                trace.skipped
            );
            for bad in &trace.first_skipped {
                let _ = writeln!(out, "  line {}: {}", bad.line, bad.error);
            }
        }
        for policy in &self.policies {
            policy.text(&mut out, trace.with_duration);
        }
        if let Some((baseline, others)) = self.policies.split_first()
            && !others.is_empty()
        {
            let _ = writeln!(out, "\ncompared with {}:", baseline.file);
            for other in others {
                let _ = writeln!(
                    out,
                    "  {}: rejected {} -> {} ({:+}), would reject {} -> {} ({:+})",
                    other.file,
                    baseline.counts.rejected,
                    other.counts.rejected,
                    i128::from(other.counts.rejected) - i128::from(baseline.counts.rejected),
                    baseline.counts.would_reject,
                    other.counts.would_reject,
                    i128::from(other.counts.would_reject)
                        - i128::from(baseline.counts.would_reject),
                );
            }
        }
        out
    }
}

impl PolicyReport {
    fn text(&self, out: &mut String, with_duration: u64) {
        let _ = writeln!(out, "\npolicy {} (version {})", self.file, self.version);
        let _ = writeln!(
            out,
            "  allowed {}, rejected {} ({}), would reject {} ({}), unmatched {}",
            self.counts.allowed,
            self.counts.rejected,
            percent(self.counts.rejected, self.counts.requests),
            self.counts.would_reject,
            percent(self.counts.would_reject, self.counts.requests),
            self.counts.unmatched,
        );
        if let Some(bad) = &self.first_invalid {
            let _ = writeln!(
                out,
                "  refused {} requests (the server would answer 400); first, line {}: {}",
                self.counts.invalid, bad.line, bad.error
            );
        }
        if self.settled + self.settle_missed > 0 {
            let _ = writeln!(
                out,
                "  {} reservations settled, giving back {} tokens; {} ended too late to settle \
                 (past the idempotency window)",
                self.settled, self.given_back, self.settle_missed
            );
        }
        if self.concurrency_limits > 0 && with_duration == 0 {
            let _ = writeln!(
                out,
                "  {} concurrency limits not exercised: no line says how long its request ran \
                 (duration_ms)",
                self.concurrency_limits
            );
        } else if self.concurrency_limits > 0 {
            let _ = writeln!(
                out,
                "  {} requests held leases; {} of those outlived their lease_timeout",
                self.leases, self.leases_timed_out
            );
        }
        let width = self
            .limits
            .iter()
            .map(|limit| limit.name.len())
            .chain([5])
            .max()
            .unwrap_or(5);
        let _ = writeln!(
            out,
            "  {:<width$}  {:<14}  {:>10}  {:>10}  {:>12}  {:>8}  {:>10}  first rejection",
            "limit", "algorithm", "decisions", "rejected", "would reject", "exempt", "near limit"
        );
        for limit in &self.limits {
            let _ = writeln!(
                out,
                "  {:<width$}  {:<14}  {:>10}  {:>10}  {:>12}  {:>8}  {:>10}  {}",
                limit.name,
                limit.algorithm,
                limit.decisions,
                limit.rejected,
                limit.would_reject,
                limit.exempt,
                limit.near_limit,
                limit.first_rejection.as_deref().unwrap_or("-"),
            );
        }
        for limit in self.limits.iter().filter(|l| !l.top_keys.is_empty()) {
            let keys: Vec<String> = limit
                .top_keys
                .iter()
                .map(|k| format!("{} ({})", k.key, k.rejections))
                .collect();
            let _ = writeln!(
                out,
                "  most rejected keys of {}: {}",
                limit.name,
                keys.join(", ")
            );
            if limit.other_keys > 0 {
                let _ = writeln!(
                    out,
                    "    and {} rejections of keys past the first {} distinct ones, not counted \
                     by key",
                    limit.other_keys,
                    super::tally::MAX_KEYS
                );
            }
        }
        if let Some(peak) = self
            .timeline
            .iter()
            .filter(|slot| slot.rejected + slot.would_reject > 0)
            .max_by_key(|slot| {
                (
                    slot.rejected + slot.would_reject,
                    std::cmp::Reverse(&slot.start),
                )
            })
        {
            let _ = writeln!(
                out,
                "  most rejections in one interval: {} rejected and {} would be, of {} \
                 requests, from {}",
                peak.rejected, peak.would_reject, peak.requests, peak.start
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentages_round_down_to_hundredths() {
        assert_eq!(percent(1, 3), "33.33 %");
        assert_eq!(percent(2, 3), "66.66 %");
        assert_eq!(percent(5, 5), "100.00 %");
        assert_eq!(percent(0, 0), "-");
        assert_eq!(percent(u64::MAX, u64::MAX), "100.00 %");
    }

    fn tally_with_slots(indices: &[u64]) -> Tally {
        let policy = tollgate_policy::compile("t.yaml", "version: 1\nlimits: []\n").unwrap();
        let mut tally = Tally::new(&policy, std::time::Duration::from_secs(1), 800);
        for &index in indices {
            let slot = Slot {
                requests: 1,
                ..Slot::default()
            };
            tally.timeline.insert(index, slot);
        }
        tally
    }

    #[test]
    fn a_timeline_lists_empty_intervals_up_to_its_bound() {
        let dense = timeline(&tally_with_slots(&[5, 5 + MAX_DENSE_INTERVALS - 1]));
        assert_eq!(dense.len() as u64, MAX_DENSE_INTERVALS);
        assert_eq!(dense[0].start, "1970-01-01T00:00:05Z");
        assert_eq!((dense[0].requests, dense[1].requests), (1, 0));
        let sparse = timeline(&tally_with_slots(&[5, 5 + MAX_DENSE_INTERVALS]));
        let starts: Vec<&str> = sparse.iter().map(|slot| slot.start.as_str()).collect();
        assert_eq!(starts, ["1970-01-01T00:00:05Z", "1970-01-02T03:46:45Z"]);
        assert!(timeline(&tally_with_slots(&[])).is_empty());
    }

    fn trace(with_duration: u64) -> TraceSummary {
        TraceSummary {
            source: "t.jsonl".to_owned(),
            lines: 3,
            requests: 3,
            skipped: 0,
            first_skipped: Vec::new(),
            out_of_order: 0,
            with_duration,
            with_used: 0,
            first: None,
            last: None,
            interval_ms: 60_000,
        }
    }

    fn policy(file: &str) -> PolicyReport {
        PolicyReport {
            file: file.to_owned(),
            version: "1".to_owned(),
            counts: Counts {
                requests: 3,
                allowed: 3,
                ..Counts::default()
            },
            first_invalid: None,
            concurrency_limits: 0,
            leases: 0,
            leases_timed_out: 0,
            settled: 0,
            given_back: 0,
            settle_missed: 0,
            limits: vec![limit("per-user", &[], 0)],
            timeline: vec![slot("2026-11-29T10:00:00Z", 3, 0, 0)],
        }
    }

    fn limit(name: &str, top_keys: &[(&str, u64)], other_keys: u64) -> LimitReport {
        LimitReport {
            name: name.to_owned(),
            algorithm: "token_bucket".to_owned(),
            decisions: 3,
            rejected: 0,
            would_reject: 0,
            exempt: 0,
            near_limit: 0,
            first_rejection: None,
            top_keys: top_keys
                .iter()
                .map(|&(key, rejections)| KeyCount {
                    key: key.to_owned(),
                    rejections,
                })
                .collect(),
            other_keys,
        }
    }

    fn slot(start: &str, requests: u64, rejected: u64, would_reject: u64) -> TimelineSlot {
        TimelineSlot {
            start: start.to_owned(),
            requests,
            rejected,
            would_reject,
        }
    }

    /// Lines of the text report that only some reports have: none of them in a report where
    /// nothing they tell of happened.
    const OCCASIONAL: [&str; 9] = [
        " from ",
        "earlier than one before them",
        "skipped",
        "reservations settled",
        "concurrency limits not exercised",
        "held leases",
        "most rejected keys",
        "most rejections in one interval",
        "compared with",
    ];

    #[test]
    fn a_quiet_report_has_no_line_for_what_did_not_happen() {
        let report = Report {
            trace: trace(0),
            policies: vec![policy("a.yaml")],
        };
        let text = report.text();
        assert!(
            text.starts_with("replayed 3 requests of t.jsonl (3 lines)\n"),
            "{text}"
        );
        for occasional in OCCASIONAL {
            assert!(!text.contains(occasional), "{occasional}: {text}");
        }
        // A concurrency limit is only news when there is one.
        let report = Report {
            trace: trace(1),
            ..report
        };
        assert!(!report.text().contains("held leases"), "{}", report.text());
    }

    #[test]
    fn a_busy_report_tells_each_thing_that_happened() {
        let mut trace = trace(0);
        trace.lines = 4;
        trace.first = Some("2026-11-29T10:00:00Z".to_owned());
        trace.last = Some("2026-11-29T10:02:00Z".to_owned());
        trace.out_of_order = 1;
        trace.skipped = 1;
        trace.first_skipped = vec![BadLine {
            line: 2,
            error: "not UTF-8".to_owned(),
        }];
        let mut a = policy("a.yaml");
        a.counts.rejected = 1;
        a.counts.would_reject = 2;
        a.settle_missed = 1;
        a.concurrency_limits = 1;
        a.limits = vec![
            limit("per-user", &[("per-user|bob", 2)], 1),
            limit("per-ip", &[], 0),
        ];
        a.timeline = vec![
            slot("2026-11-29T10:00:00Z", 5, 0, 0),
            slot("2026-11-29T10:01:00Z", 3, 1, 0),
            slot("2026-11-29T10:02:00Z", 4, 0, 2),
        ];
        let mut b = policy("b.yaml");
        b.counts.rejected = 3;
        b.settled = 2;
        b.given_back = 10;
        b.limits = vec![limit("per-user", &[("per-user|alice", 1)], 0)];
        let text = Report {
            trace,
            policies: vec![a, b],
        }
        .text();
        for expected in [
            "replayed 3 requests of t.jsonl (4 lines) from 2026-11-29T10:00:00Z to \
             2026-11-29T10:02:00Z\n",
            "\n1 requests came earlier than one before them",
            "\nskipped 1 lines that are not requests:\n  line 2: not UTF-8\n",
            "\n  0 reservations settled, giving back 0 tokens; 1 ended too late",
            "\n  2 reservations settled, giving back 10 tokens; 0 ended too late",
            "\n  1 concurrency limits not exercised",
            "\n  most rejected keys of per-user: per-user|bob (2)\n    and 1 rejections of keys \
             past the first 100000 distinct ones",
            "\n  most rejected keys of per-user: per-user|alice (1)\n",
            "\n  most rejections in one interval: 0 rejected and 2 would be, of 4 requests, from \
             2026-11-29T10:02:00Z\n",
            "\ncompared with a.yaml:\n  b.yaml: rejected 1 -> 3 (+2), would reject 2 -> 0 (-2)\n",
        ] {
            assert!(text.contains(expected), "{expected}: {text}");
        }
        for (line, times) in [
            ("most rejected keys", 2),
            ("keys past the first", 1),
            ("most rejections in one interval", 1),
            ("held leases", 0),
        ] {
            assert_eq!(text.matches(line).count(), times, "{line}: {text}");
        }
    }

    #[test]
    fn leases_are_told_when_lines_say_how_long_requests_ran() {
        let mut a = policy("a.yaml");
        a.concurrency_limits = 1;
        a.leases = 2;
        a.leases_timed_out = 1;
        let text = Report {
            trace: trace(1),
            policies: vec![a, policy("b.yaml")],
        }
        .text();
        assert!(
            text.contains("\n  2 requests held leases; 1 of those outlived their lease_timeout\n"),
            "{text}"
        );
        assert_eq!(text.matches("held leases").count(), 1, "{text}");
        assert!(!text.contains("not exercised"), "{text}");
    }
}
