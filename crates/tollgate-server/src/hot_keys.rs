//! The busiest bucket keys of each limit: which subjects send the most decisions, and how many
//! of theirs were rejected (SPEC §8, "hot keys (top-k)"; §7 sketches them per limit).
//!
//! When a limit starts rejecting, the first question is who. Per-limit counters cannot say, and
//! a counter per key would grow with every subject ever seen. This keeps a fixed number of
//! counters per limit instead (one limit's crowd cannot hide another's), as a Space-Saving
//! summary (Metwally, Agrawal and El Abbadi, 2005): a key not yet counted takes over the
//! counter with the smallest count, inheriting that count as its possible overcount. Any key
//! with more than `1/counters` of the decisions is then sure to be held, and no count is low.
//! Counters are kept for [`COUNTERS_PER_KEY`] times the keys reported, so the reported ones are
//! far above the churn at the bottom.
//!
//! It must cost the decision path next to nothing: one decision in [`SAMPLE`] is counted, picked
//! by a per-thread random draw, and only that one takes the summaries' lock. Counts are scaled
//! back up by [`SAMPLE`], so they are estimates. They cover whole windows (a minute by
//! default): the exported figures are those of the last window completed, so they neither grow
//! forever nor reset under a reader's eyes.

use std::borrow::Cow;
use std::cell::Cell;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::hash::{BuildHasher, RandomState};
use std::time::Duration;

use hashbrown::HashTable;
use parking_lot::Mutex;
use tollgate::Timestamp;
use tollgate_policy::Outcome;

/// One decision in this many is counted.
pub const SAMPLE: u64 = 8;

/// How long a window of counts lasts unless told otherwise.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(60);

/// Counters kept per key reported.
pub const COUNTERS_PER_KEY: usize = 4;

/// The longest key exported as a label, in bytes; a longer one is cut at a character boundary
/// and given a hash of the whole key, so that two long keys never share a label.
const LONGEST_LABEL: usize = 200;

/// Estimated decisions of a hot key in the last window: labels `limit`, `key`.
pub const HOT_KEY_DECISIONS: &str = "tollgate_hot_key_decisions";
/// Estimated rejections of a hot key in the last window (for a limit in shadow, the rejections
/// it would have made: who a limit about to be enforced would stop): labels `limit`, `key`.
pub const HOT_KEY_REJECTIONS: &str = "tollgate_hot_key_rejections";

/// A key among the busiest of a window.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct HotKey {
    /// The limit the bucket belongs to.
    pub limit: String,
    /// The bucket key, as `/v1/explain` shows it; one over 200 bytes is cut at a character
    /// boundary and ends in `…` and a hash of the whole key.
    pub key: String,
    /// Estimated decisions on it in the window (a multiple of [`SAMPLE`]).
    pub decisions: u64,
    /// Estimated rejections among them (would-be rejections for a limit in shadow).
    pub rejections: u64,
    /// How much of `decisions` may belong to keys this one's counter took over from: the
    /// estimate lies between `decisions - overcount` and `decisions`.
    pub overcount: u64,
}

/// The busiest keys of this process's decisions, by window.
pub struct HotKeys {
    top: usize,
    window: Duration,
    state: Mutex<Windows>,
}

struct Windows {
    /// When the current window began; `None` before the first decision counted.
    started: Option<Timestamp>,
    /// A summary per limit name, made on the limit's first sampled decision of the window.
    current: HashMap<Box<str>, Summary, foldhash::fast::RandomState>,
    /// The last completed window's busiest keys, by limit, each limit's busiest first.
    last: Vec<HotKey>,
}

impl HotKeys {
    /// Reports each limit's `top` busiest keys of each `window` (at least a millisecond); 0 keys
    /// turns counting off.
    pub fn new(top: usize, window: Duration) -> Self {
        Self {
            top,
            window: window.max(Duration::from_millis(1)),
            state: Mutex::new(Windows {
                started: None,
                current: HashMap::default(),
                last: Vec::new(),
            }),
        }
    }

    /// Whether anything is counted.
    pub fn enabled(&self) -> bool {
        self.top > 0
    }

    /// How long a window lasts.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// Counts `outcome`'s decided limits, if this decision is among the sampled ones.
    pub fn record(&self, now: Timestamp, outcome: &Outcome) {
        if !self.enabled() || !sampled() {
            return;
        }
        self.record_sampled(now, outcome);
    }

    /// Counts `outcome` as a sampled decision.
    fn record_sampled(&self, now: Timestamp, outcome: &Outcome) {
        let mut state = self.state.lock();
        state.roll(now, self.top, self.window);
        for limit in &outcome.limits {
            if let Some(decision) = &limit.decision {
                // Counted as it will be shown: a long key is kept cut, so a counter holds at
                // most a label's bytes whatever the request sent.
                let key = short_key(&limit.bucket_key);
                state.count(&limit.name, &key, !decision.allowed(), self.top);
            }
        }
    }

    /// The busiest keys of each limit in the last window completed by `now`, by limit name,
    /// each limit's busiest first; empty when no decision was counted in it.
    pub fn last_window(&self, now: Timestamp) -> Vec<HotKey> {
        let mut state = self.state.lock();
        state.roll(now, self.top, self.window);
        state.last.clone()
    }

    /// The last window's busiest keys as Prometheus text, appended to `out`; nothing when
    /// counting is off.
    pub fn render(&self, now: Timestamp, out: &mut String) {
        if !self.enabled() {
            return;
        }
        let keys = self.last_window(now);
        write_series(
            out,
            HOT_KEY_DECISIONS,
            "Estimated decisions on each of the busiest bucket keys in the last full window.",
            &keys,
            |key| key.decisions,
        );
        write_series(
            out,
            HOT_KEY_REJECTIONS,
            "Estimated rejections (in shadow mode, would-be rejections) on each of the busiest bucket keys in the last full window.",
            &keys,
            |key| key.rejections,
        );
    }
}

/// One gauge of `keys` in Prometheus text, each key's value taken by `figure`.
fn write_series(
    out: &mut String,
    name: &str,
    help: &str,
    keys: &[HotKey],
    figure: impl Fn(&HotKey) -> u64,
) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} gauge");
    for key in keys {
        let _ = write!(out, "{name}{{limit=\"");
        push_label(out, &key.limit);
        out.push_str("\",key=\"");
        push_label(out, &key.key);
        let _ = writeln!(out, "\"}} {}", figure(key));
    }
}

impl Windows {
    /// Counts a decision of limit `limit` on bucket `key`.
    fn count(&mut self, limit: &str, key: &str, rejected: bool, top: usize) {
        if let Some(summary) = self.current.get_mut(limit) {
            summary.count(key, rejected);
            return;
        }
        let mut summary = Summary::new(top.saturating_mul(COUNTERS_PER_KEY));
        summary.count(key, rejected);
        self.current.insert(limit.into(), summary);
    }

    /// Closes the current window if `now` is past its end, keeping its busiest keys.
    fn roll(&mut self, now: Timestamp, top: usize, window: Duration) {
        let Some(started) = self.started else {
            self.started = Some(now);
            return;
        };
        let elapsed = now.saturating_duration_since(started);
        if elapsed < window {
            return;
        }
        // Whole windows since the current one began: the current one ended after the first;
        // with more, the last complete window saw no decision at all.
        let windows = elapsed.as_nanos() / window.as_nanos();
        if windows == 1 {
            let mut limits: Vec<(&Box<str>, &Summary)> = self.current.iter().collect();
            limits.sort_unstable_by(|a, b| a.0.cmp(b.0));
            self.last = limits
                .into_iter()
                .flat_map(|(limit, summary)| summary.top(limit, top))
                .collect();
        } else {
            self.last.clear();
        }
        self.current.clear();
        let whole = u32::try_from(windows).unwrap_or(u32::MAX);
        self.started = Some(started + window.saturating_mul(whole));
    }
}

/// A Space-Saving summary over a fixed number of counters.
struct Summary {
    capacity: usize,
    counters: Vec<Counter>,
    /// Where each counted key's counter is, found by the key's hash: a key is stored once.
    index: HashTable<usize>,
    hasher: foldhash::fast::RandomState,
}

struct Counter {
    /// The bucket key.
    key: Box<str>,
    /// Sampled decisions, including up to `overcount` of keys it took over from.
    count: u64,
    rejections: u64,
    overcount: u64,
}

impl Summary {
    fn new(capacity: usize) -> Self {
        Self {
            capacity,
            counters: Vec::new(),
            index: HashTable::new(),
            hasher: foldhash::fast::RandomState::default(),
        }
    }

    fn count(&mut self, key: &str, rejected: bool) {
        if self.capacity == 0 {
            return;
        }
        let hash = self.hasher.hash_one(key);
        let counters = &self.counters;
        if let Some(&at) = self.index.find(hash, |&at| &*counters[at].key == key) {
            let counter = &mut self.counters[at];
            counter.count += 1;
            counter.rejections += u64::from(rejected);
            return;
        }
        let counter = Counter {
            key: key.into(),
            count: 1,
            rejections: u64::from(rejected),
            overcount: 0,
        };
        let at = if self.counters.len() < self.capacity {
            self.counters.push(counter);
            self.counters.len() - 1
        } else {
            // Full: the key takes over the smallest counter and its count, which it may
            // overstate by as much. A linear scan: counters are few, and a new key is a
            // sampled event.
            let Some((at, floor)) = self
                .counters
                .iter()
                .map(|counter| counter.count)
                .enumerate()
                .min_by_key(|&(_, count)| count)
            else {
                return;
            };
            let old = self.hasher.hash_one(&*self.counters[at].key);
            if let Ok(entry) = self.index.find_entry(old, |&other| other == at) {
                entry.remove();
            }
            self.counters[at] = Counter {
                count: floor + 1,
                overcount: floor,
                ..counter
            };
            at
        };
        let (counters, hasher) = (&self.counters, &self.hasher);
        self.index
            .insert_unique(hash, at, |&other| hasher.hash_one(&*counters[other].key));
    }

    /// The `top` busiest keys of limit `limit`, busiest first (ties by key, so the order is
    /// stable), scaled up to estimated decisions.
    fn top(&self, limit: &str, top: usize) -> Vec<HotKey> {
        let mut busiest: Vec<&Counter> = self.counters.iter().collect();
        busiest.sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.key.cmp(&b.key)));
        busiest
            .into_iter()
            .take(top)
            .map(|counter| HotKey {
                limit: limit.to_owned(),
                key: counter.key.to_string(),
                decisions: counter.count.saturating_mul(SAMPLE),
                rejections: counter.rejections.saturating_mul(SAMPLE),
                overcount: counter.overcount.saturating_mul(SAMPLE),
            })
            .collect()
    }
}

thread_local! {
    /// The state of this thread's sampling draws (xorshift64), seeded apart per thread.
    static DRAW: Cell<u64> = Cell::new(seed());
}

fn seed() -> u64 {
    // The standard library keys each new `RandomState` differently. Never 0, which xorshift
    // would keep forever.
    RandomState::new().hash_one(0x7011_6a7e_u64) | 1
}

/// Whether this decision is one of the sampled ones: one in [`SAMPLE`], drawn at random so that
/// traffic in step with a counter cannot hide from it.
fn sampled() -> bool {
    DRAW.with(|draw| {
        let mut x = draw.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        draw.set(x);
        x % SAMPLE == 0
    })
}

/// `key` as it is counted and shown: a long key cut and marked with a hash of the whole key.
fn short_key(key: &str) -> Cow<'_, str> {
    if key.len() <= LONGEST_LABEL {
        return Cow::Borrowed(key);
    }
    let mut end = LONGEST_LABEL;
    while !key.is_char_boundary(end) {
        end -= 1;
    }
    // Fixed-seeded: a key keeps its label across restarts.
    let hash = foldhash::fast::FixedState::with_seed(0).hash_one(key);
    Cow::Owned(format!("{}…{:016x}", &key[..end], hash))
}

/// Appends `value` escaped as a Prometheus label value (`\`, `"` and newlines).
fn push_label(out: &mut String, value: &str) {
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64) -> Timestamp {
        Timestamp::from_nanos(secs * 1_000_000_000)
    }

    #[test]
    fn keys_above_a_counters_share_are_held_and_never_undercounted() {
        // 8 counters: any key with more than 1/8 of the decisions is held, and a key that took
        // a counter over counts at most 1/8 of them. Two heavy keys (1/2 and 1/4) among light
        // ones that come back after their counters were taken over.
        let mut summary = Summary::new(8);
        let mut truth: HashMap<String, u64> = HashMap::new();
        for i in 0..1000u64 {
            let key = match i % 4 {
                0 | 1 => "heavy-a".to_owned(),
                2 => "heavy-b".to_owned(),
                _ => format!("light-{}", i % 60),
            };
            *truth.entry(key.clone()).or_default() += 1;
            summary.count(&key, false);
        }
        let top = summary.top("l", 2);
        assert_eq!(top[0].key, "heavy-a");
        assert_eq!(top[1].key, "heavy-b");
        for counter in &summary.counters {
            let real = truth[&*counter.key];
            assert!(counter.count >= real, "{} undercounted", counter.key);
            assert!(counter.count - counter.overcount <= real);
        }
        assert!(top[1].decisions > 1000 / 8 * SAMPLE);
        assert_eq!(summary.counters.len(), 8);
        // After hundreds of take-overs, every counter is found by its key, and only by it.
        assert_eq!(summary.index.len(), 8);
        for (at, counter) in summary.counters.iter().enumerate() {
            let hash = summary.hasher.hash_one(&*counter.key);
            let found = summary
                .index
                .find(hash, |&other| summary.counters[other].key == counter.key);
            assert_eq!(found, Some(&at), "{}", counter.key);
        }
    }

    #[test]
    fn each_limit_has_its_own_busiest_keys() {
        let hot = HotKeys::new(1, DEFAULT_WINDOW);
        for i in 0..200 {
            hot.record_sampled(at(1), &outcome("global", "global"));
            if i % 10 == 0 {
                hot.record_sampled(at(1), &outcome("per-user", &format!("per-user|u{i}")));
            }
        }
        for _ in 0..10 {
            hot.record_sampled(at(2), &outcome("per-user", "per-user|busy"));
        }
        let last = hot.last_window(at(61));
        let keys: Vec<(&str, &str)> = last
            .iter()
            .map(|k| (k.limit.as_str(), k.key.as_str()))
            .collect();
        // One key per limit, by limit name; a limit whose keys are all quiet still has its
        // busiest reported, however much busier another limit's key is.
        assert_eq!(
            keys,
            vec![("global", "global"), ("per-user", "per-user|busy")]
        );
        assert_eq!(last[0].decisions, 200 * SAMPLE);
    }

    #[test]
    fn rejections_are_counted_with_decisions_and_scaled_by_the_sample() {
        let mut summary = Summary::new(8);
        for i in 0..10 {
            summary.count("per-user|u1", i >= 7);
        }
        summary.count("per-user|u2", false);
        let top = summary.top("per-user", 1);
        assert_eq!(
            top,
            vec![HotKey {
                limit: "per-user".to_owned(),
                key: "per-user|u1".to_owned(),
                decisions: 10 * SAMPLE,
                rejections: 3 * SAMPLE,
                overcount: 0,
            }]
        );
    }

    #[test]
    fn the_last_complete_window_is_reported() {
        let hot = HotKeys::new(2, DEFAULT_WINDOW);
        let outcome_of = |key: &str| outcome("l", key);
        hot.record_sampled(at(0), &outcome_of("l|a"));
        hot.record_sampled(at(10), &outcome_of("l|a"));
        hot.record_sampled(at(59), &outcome_of("l|b"));
        // Nothing is complete yet.
        assert!(hot.last_window(at(59)).is_empty());
        let last = hot.last_window(at(61));
        assert_eq!(
            last.iter()
                .map(|k| (k.key.as_str(), k.decisions))
                .collect::<Vec<_>>(),
            vec![("l|a", 2 * SAMPLE), ("l|b", SAMPLE)]
        );
        // Counted after the window closed: the next window's.
        hot.record_sampled(at(70), &outcome_of("l|c"));
        assert_eq!(hot.last_window(at(119)), last);
        assert_eq!(hot.last_window(at(121))[0].key, "l|c");
        // A whole window with no decision reports nothing.
        assert!(hot.last_window(at(250)).is_empty());
    }

    /// Each thread draws its own sequence, so that traffic in step with one thread's draws is
    /// not in step with another's.
    #[test]
    fn each_thread_is_seeded_apart() {
        let seeds: Vec<u64> = (0..4)
            .map(|_| std::thread::spawn(seed).join().unwrap())
            .collect();
        for (at, seed) in seeds.iter().enumerate() {
            assert_ne!(*seed, 0);
            assert!(!seeds[..at].contains(seed), "{seeds:?}");
        }
    }

    #[test]
    fn about_one_decision_in_the_sample_is_counted() {
        let counted = (0..80_000).filter(|_| sampled()).count();
        let expected = 80_000 / SAMPLE as usize;
        assert!(
            counted.abs_diff(expected) < expected / 10,
            "{counted} of 80000 sampled"
        );
    }

    /// A long key is cut at the last character boundary within the bound, never past it.
    #[test]
    fn a_long_key_is_cut_within_the_bound() {
        // Two-byte characters from an odd offset: the bound falls inside one.
        let key = format!("l|x{}", "\u{e9}".repeat(300));
        let cut = short_key(&key);
        let (head, hash) = cut.split_once('\u{2026}').unwrap();
        assert_eq!(head.len(), LONGEST_LABEL - 1);
        assert!(key.starts_with(head));
        assert_eq!(hash.len(), 16);
        assert_eq!(short_key("l|short"), "l|short");
    }

    /// Traffic in step with the draws cannot hide: whichever of every `period` decisions are
    /// a key's, about one in [`SAMPLE`] of them is counted.
    #[test]
    fn traffic_in_step_with_a_period_is_sampled_alike() {
        for period in [2usize, 3, 8, 16] {
            let mut counted = vec![0usize; period];
            for i in 0..period * 8000 {
                counted[i % period] += usize::from(sampled());
            }
            for (phase, &n) in counted.iter().enumerate() {
                // 1000 expected, with a standard deviation of about 30.
                assert!(
                    n.abs_diff(1000) < 150,
                    "period {period}, phase {phase}: {n}"
                );
            }
        }
    }

    #[test]
    fn render_escapes_labels_and_bounds_long_keys() {
        let hot = HotKeys::new(3, DEFAULT_WINDOW);
        let long = format!("l|{}", "é".repeat(300));
        hot.record_sampled(at(0), &outcome("l", "l|quo\"te\\back\nline"));
        hot.record_sampled(at(1), &outcome("l", &long));
        let mut text = String::new();
        hot.render(at(61), &mut text);
        assert!(
            text.contains("# TYPE tollgate_hot_key_decisions gauge"),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "tollgate_hot_key_decisions{{limit=\"l\",key=\"l|quo\\\"te\\\\back\\nline\"}} {SAMPLE}"
            )),
            "{text}"
        );
        assert!(
            text.contains("tollgate_hot_key_rejections{limit=\"l\""),
            "{text}"
        );
        let long_line = text
            .lines()
            .find(|line| line.starts_with("tollgate_hot_key_decisions") && line.contains('…'))
            .unwrap();
        assert!(long_line.len() < LONGEST_LABEL + 100, "{long_line}");

        // Long keys are counted cut: the same one twice is one key, two that differ only past
        // the cut are two.
        let hot = HotKeys::new(3, DEFAULT_WINDOW);
        let prefix = "l|".to_owned() + &"x".repeat(LONGEST_LABEL);
        for key in [
            format!("{prefix}-a"),
            format!("{prefix}-a"),
            format!("{prefix}-b"),
        ] {
            hot.record_sampled(at(0), &outcome("l", &key));
        }
        let last = hot.last_window(at(61));
        let counts: Vec<u64> = last.iter().map(|k| k.decisions).collect();
        assert_eq!(counts, vec![2 * SAMPLE, SAMPLE]);
        assert_ne!(last[0].key, last[1].key);
        assert!(
            last.iter().all(|k| k.key.len() <= LONGEST_LABEL + 20),
            "{last:?}"
        );

        let mut off = String::new();
        HotKeys::new(0, DEFAULT_WINDOW).render(at(61), &mut off);
        assert!(off.is_empty());
    }

    /// An allowed outcome of limit `limit`, its bucket key set to `key`.
    fn outcome(limit: &str, key: &str) -> Outcome {
        use tollgate_policy::{EngineOptions, PolicyEngine, compile};
        let policy = format!(
            "version: v1\nlimits:\n  - {{name: {limit}, domain: api, key: [user], capacity: 9, refill: 1/s}}\n"
        );
        let engine = PolicyEngine::new(
            compile("test.yaml", &policy).unwrap(),
            EngineOptions::default(),
        );
        let mut outcome = engine
            .decide("api", &[vec![("user", "u")]], 1, None)
            .unwrap();
        outcome.limits[0].bucket_key = key.to_owned();
        outcome
    }
}
