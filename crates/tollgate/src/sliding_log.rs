//! The sliding log: SPEC §3's exact sliding window, which [`crate::window`]'s two counters
//! approximate.
//!
//! A counter approximation guesses how the previous window's requests were spread over it; a
//! log knows. It is the algorithm to choose when "at most N in any minute" must hold for every
//! minute, not just on average, and the limit is small enough to keep every request's time.
//!
//! # Model
//!
//! A log limit admits at most `N` (its capacity) in any window of `W` milliseconds that ends
//! now. Time is read to the millisecond, as for the other windows, so a log holds at most one
//! entry per millisecond: the cost that millisecond admitted. A request of `cost` at
//! millisecond `t` passes when
//!
//! ```text
//! sum of the costs admitted at milliseconds m with t - W < m <= t,  plus cost,  <= N
//! ```
//!
//! and is then added to millisecond `t`'s entry. A request timed before the log's latest entry
//! (a clock gone back) is decided at that entry's millisecond: going back frees nothing.
//!
//! # Invariants
//!
//! Checked against a reference model that keeps every request and counts with no shortcut
//! (`tests/log_model.rs`):
//!
//! * A rejection charges nothing; an absent log counts nothing.
//! * In every window of `W` milliseconds, what the log admitted totals at most `N`.
//! * `retry_after` is exact: waiting it, the same request passes; a nanosecond less, it does
//!   not. `reset_after` is the wait until the log counts nothing.
//! * A refund (a settlement) takes cost off the entry its charge went to, never below 0, and
//!   nothing once that entry no longer counts: it never leaves more than a smaller charge would
//!   have.
//!
//! # Representation
//!
//! Entries are packed into a `u64` each, the millisecond above the cost, oldest first; the
//! latest apart from the others, so that a log of one entry needs no allocation. A cost is at
//! most [`MAX_LOG_LIMIT`] (14 bits of the 20 kept) and a millisecond below 2^44 (time is
//! clamped at 2^63 ns, as for buckets), so the packing is lossless. Entries that stopped
//! counting at the latest entry's millisecond are dropped when a charge starts a new one
//! (nothing earlier can be asked of the log); those that stopped counting only at a later
//! request's time are skipped, not dropped, since a later request may come from an earlier
//! clock. The log thus holds at most `N` entries with a cost, plus its latest entry when a
//! refund emptied it (kept: it still marks the latest time seen).

use std::collections::VecDeque;

use crate::clock::Timestamp;
use crate::decision::Decision;
use crate::limit::{Limit, MAX_LOG_LIMIT};

const NANOS_PER_MS: u64 = 1_000_000;

/// The latest instant the log math distinguishes, as for token buckets.
const MAX_NOW: u64 = 1 << 63;

/// Bits of an entry that hold its cost; the millisecond is above them.
const COST_BITS: u32 = 20;
const COST_MASK: u64 = (1 << COST_BITS) - 1;
const _: () = assert!(MAX_LOG_LIMIT <= COST_MASK);

/// One key's log: what each millisecond admitted, oldest first.
///
/// The latest entry is kept apart from the older ones: a key asked about now and then holds
/// that one entry alone, with no allocation (a million such keys would otherwise each cost an
/// allocation and a cache miss more), and a busy key's usual charge, to the latest
/// millisecond, touches only it. The Redis store keeps its logs the same way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RequestLog {
    /// The entries before the latest, oldest first; boxed, and absent when there are none, so
    /// that a log of one entry is three words.
    #[allow(
        clippy::box_collection,
        reason = "a box is one word where a deque is four, in every log"
    )]
    older: Option<Box<VecDeque<u64>>>,
    /// The latest entry, or [`NONE`].
    latest: u64,
    /// The sum of the entries' costs.
    total: u64,
}

/// No entry: a millisecond no clamped time reaches (they stay below 2^44 - 1).
const NONE: u64 = u64::MAX;

impl Default for RequestLog {
    fn default() -> Self {
        Self {
            older: None,
            latest: NONE,
            total: 0,
        }
    }
}

fn entry(ms: u64, cost: u64) -> u64 {
    (ms << COST_BITS) | cost
}

fn ms_of(entry: u64) -> u64 {
    entry >> COST_BITS
}

fn cost_of(entry: u64) -> u64 {
    entry & COST_MASK
}

/// Where a request stands against a log.
struct At {
    /// The request's own nanosecond (clamped), which waits are measured from.
    now: u64,
    /// The millisecond it is decided at: its own, or the latest entry's when that is later.
    ms: u64,
    /// The window in milliseconds.
    w: u64,
}

impl At {
    fn of(limit: &Limit, log: &RequestLog, now: Timestamp) -> Self {
        let now = now.as_nanos().min(MAX_NOW);
        let own = now / NANOS_PER_MS;
        let ms = log.latest().map_or(own, |latest| latest.max(own));
        Self {
            now,
            ms,
            w: limit.window_ns() / NANOS_PER_MS,
        }
    }

    /// Whether an entry of millisecond `ms` still counts here.
    fn counts(&self, ms: u64) -> bool {
        ms + self.w > self.ms
    }

    /// Nanoseconds from the request to the instant an entry of millisecond `ms` stops counting.
    fn until_gone(&self, ms: u64) -> u64 {
        ((ms + self.w) * NANOS_PER_MS).saturating_sub(self.now)
    }
}

impl RequestLog {
    /// Every entry, oldest first.
    fn entries(&self) -> impl DoubleEndedIterator<Item = u64> + '_ {
        let latest = (self.latest != NONE).then_some(self.latest);
        let older = self.older.iter().flat_map(|older| older.iter().copied());
        older.chain(latest)
    }

    /// The millisecond of the latest entry.
    fn latest(&self) -> Option<u64> {
        (self.latest != NONE).then(|| ms_of(self.latest))
    }

    /// The instant the log counts nothing any more, however it is asked: its latest entry's
    /// millisecond plus the window, in nanoseconds (0 for an empty log). A store may drop the
    /// log then, as it drops a full bucket: nothing later can tell.
    pub(crate) fn free_at(&self, limit: &Limit) -> Timestamp {
        let w = limit.window_ns() / NANOS_PER_MS;
        Timestamp::from_nanos(self.latest().map_or(0, |ms| (ms + w) * NANOS_PER_MS))
    }

    /// Entries held, for a store's accounting.
    pub(crate) fn len(&self) -> usize {
        self.older.as_ref().map_or(0, |older| older.len()) + usize::from(self.latest != NONE)
    }

    /// What the log counts at `at`: the total less the entries that stopped counting (the
    /// oldest ones).
    fn counted(&self, at: &At) -> u64 {
        let gone: u64 = self
            .entries()
            .take_while(|&e| !at.counts(ms_of(e)))
            .map(cost_of)
            .sum();
        self.total - gone
    }

    /// The wait until the log counts nothing: until its latest entry with a cost stops.
    fn reset(&self, at: &At) -> u64 {
        self.entries()
            .rev()
            .find(|&e| cost_of(e) > 0 && at.counts(ms_of(e)))
            .map_or(0, |e| at.until_gone(ms_of(e)))
    }

    /// The wait until `need` of what the log counts has stopped counting: until the entry
    /// that completes it, oldest first, stops.
    fn retry(&self, at: &At, need: u64) -> u64 {
        let mut freed = 0;
        for e in self.entries().filter(|&e| at.counts(ms_of(e))) {
            freed += cost_of(e);
            if freed >= need {
                return at.until_gone(ms_of(e));
            }
        }
        // Unreachable for a cost of at most N: everything counted stops by the latest entry's
        // end, and the request then passes.
        self.reset(at)
    }

    /// Adds `cost` at `at` (no earlier than the latest entry), dropping first, when a new
    /// millisecond begins, what no request can count any more.
    fn charge(&mut self, at: &At, cost: u64) {
        if self.latest != NONE && ms_of(self.latest) == at.ms {
            self.latest += cost;
            self.total += cost;
            return;
        }
        if self.latest != NONE {
            if at.counts(ms_of(self.latest)) {
                self.older.get_or_insert_default().push_back(self.latest);
            } else {
                // Nothing older counts either.
                self.older = None;
                self.total = 0;
            }
        }
        if let Some(older) = &mut self.older {
            while let Some(&e) = older.front() {
                if at.counts(ms_of(e)) {
                    break;
                }
                self.total -= cost_of(e);
                older.pop_front();
            }
            // A burst's entries stay allocated after they leave the window unless given back:
            // a store of many keys would otherwise keep every key's busiest moment.
            if older.is_empty() {
                self.older = None;
            } else if older.capacity() > 16 && older.len() * 4 < older.capacity() {
                older.shrink_to(older.len() * 2);
            }
        }
        self.latest = entry(at.ms, cost);
        self.total += cost;
    }
}

/// Decides `cost` (already checked to be in `1..=N`) against `log` at `now`, charging it when
/// allowed; as [`crate::bucket::take`], with the log changed in place. (Stores decide and
/// charge apart, as they make a log only for a charge.)
#[cfg(test)]
fn take(limit: &Limit, log: &mut RequestLog, now: Timestamp, cost: u64) -> Decision {
    let decision = decide(limit, Some(log), now, cost);
    if decision.allowed() {
        charge(limit, log, now, cost);
    }
    decision
}

/// Decides `cost` (already checked to be in `1..=N`) against `log` (absent: nothing counted)
/// at `now`, without charging: the decision an allowed charge will have.
pub(crate) fn decide(
    limit: &Limit,
    log: Option<&RequestLog>,
    now: Timestamp,
    cost: u64,
) -> Decision {
    let empty = RequestLog::default();
    let log = log.unwrap_or(&empty);
    let at = At::of(limit, log, now);
    let counted = log.counted(&at);
    let n = limit.capacity();
    if counted + cost <= n {
        // The charge lands at `at.ms`, which then counts longest.
        let reset = at.until_gone(at.ms);
        return Decision::window(true, *limit, cost, n - counted - cost, 0, reset);
    }
    let retry = log.retry(&at, counted + cost - n);
    // A log can count more than its limit: the limit was lowered since it was charged.
    let remaining = n.saturating_sub(counted);
    Decision::window(false, *limit, cost, remaining, retry, log.reset(&at))
}

/// Charges `cost` at `now`, for a request [`decide`] allowed under the same lock.
pub(crate) fn charge(limit: &Limit, log: &mut RequestLog, now: Timestamp, cost: u64) {
    let at = At::of(limit, log, now);
    log.charge(&at, cost);
}

/// The log's standing at `now` as an allowed but uncharged decision for `cost`; as
/// [`crate::bucket::balance`].
pub(crate) fn balance(
    limit: &Limit,
    log: Option<&RequestLog>,
    now: Timestamp,
    cost: u64,
) -> Decision {
    let empty = RequestLog::default();
    let log = log.unwrap_or(&empty);
    let at = At::of(limit, log, now);
    let counted = log.counted(&at);
    let n = limit.capacity();
    Decision::window(
        true,
        *limit,
        cost,
        n.saturating_sub(counted),
        0,
        log.reset(&at),
    )
}

/// The millisecond a charge at `charged_at` went to, from its decision's `reset_after`: a
/// charge's entry counts longest, so the decision's reset is the end of that entry. Not simply
/// `charged_at`'s millisecond: a clock gone back charges the latest entry's.
pub(crate) fn charged_ms(limit: &Limit, charged_at: Timestamp, charged: &Decision) -> u64 {
    let reset = u64::try_from(charged.reset_after().as_nanos()).unwrap_or(u64::MAX);
    let ends = charged_at.as_nanos().min(MAX_NOW).saturating_add(reset) / NANOS_PER_MS;
    ends.saturating_sub(limit.window_ns() / NANOS_PER_MS)
}

/// Gives `tokens` back from the latest entry that holds anything, never below 0: the latest
/// charge, for tokens given back with no record of the charge they came from (see
/// [`crate::Store::give_back`]). Later entries may be empty: a refund emptied the latest, which
/// stays to mark the latest time seen, and a later charge may have made it an older one.
pub(crate) fn give_back_latest(log: &mut RequestLog, tokens: u64) {
    let latest = log.entries().rev().find(|&e| cost_of(e) > 0);
    if let Some(entry) = latest {
        give_back(log, ms_of(entry), tokens);
    }
}

/// Gives `tokens` back from the entry of millisecond `ms` (see [`charged_ms`]), never below 0;
/// nothing when the entry is gone (it no longer counted against anyone). An entry emptied is
/// dropped, unless it is the latest, which still marks the latest time seen.
pub(crate) fn give_back(log: &mut RequestLog, ms: u64, tokens: u64) {
    if log.latest != NONE && ms_of(log.latest) == ms {
        let back = cost_of(log.latest).min(tokens);
        log.latest -= back;
        log.total -= back;
        return;
    }
    let Some(older) = &mut log.older else {
        return;
    };
    let Ok(index) = older.binary_search_by_key(&ms, |&e| ms_of(e)) else {
        return;
    };
    let Some(e) = older.get_mut(index) else {
        return;
    };
    let back = cost_of(*e).min(tokens);
    *e -= back;
    log.total -= back;
    if cost_of(*e) == 0 {
        older.remove(index);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const MS: u64 = NANOS_PER_MS;
    const SEC: u64 = 1_000 * MS;

    fn at(nanos: u64) -> Timestamp {
        Timestamp::from_nanos(nanos)
    }

    fn log_limit(n: u64, window: Duration) -> Limit {
        Limit::sliding_log(n, window).unwrap()
    }

    fn run(limit: &Limit, log: &mut RequestLog, steps: &[(u64, u64)]) -> Vec<Decision> {
        steps
            .iter()
            .map(|&(t, cost)| take(limit, log, at(t), cost))
            .collect()
    }

    #[test]
    fn a_log_counts_exactly_the_window_that_ends_now() {
        let limit = log_limit(3, Duration::from_secs(1));
        let mut log = RequestLog::default();
        let steps = [
            (100 * MS, 2),
            (900 * MS, 1),
            (1_099 * MS, 1),
            (1_100 * MS, 1),
        ];
        let d = run(&limit, &mut log, &steps);
        assert!(d[0].allowed() && d[1].allowed());
        assert_eq!(d[1].reset_after(), Duration::from_millis(1_000));
        // The 2 of 100 ms count until 1100 ms, to the millisecond.
        assert!(!d[2].allowed());
        assert_eq!(d[2].remaining(), 0);
        assert_eq!(d[2].retry_after(), Some(Duration::from_millis(1)));
        assert_eq!(d[2].reset_after(), Duration::from_millis(801));
        assert!(d[3].allowed());
        assert_eq!(d[3].remaining(), 1);
        assert_eq!(d[3].reset_after(), Duration::from_millis(1_000));
    }

    #[test]
    fn no_burst_at_a_window_edge() {
        // A fixed window would admit 4 more at 1 s, a sliding window 3 (it guesses the 4 were
        // spread over the window); the log knows they came at its end.
        let limit = log_limit(4, Duration::from_secs(1));
        let mut log = RequestLog::default();
        let d = run(
            &limit,
            &mut log,
            &[(999 * MS, 4), (SEC, 1), (1_998 * MS, 1)],
        );
        assert!(d[0].allowed());
        assert!(!d[1].allowed());
        assert_eq!(d[1].retry_after(), Some(Duration::from_millis(999)));
        assert!(!d[2].allowed());
        assert_eq!(d[2].retry_after(), Some(Duration::from_millis(1)));
    }

    #[test]
    fn a_retry_is_exact_to_the_nanosecond() {
        let limit = log_limit(2, Duration::from_millis(10));
        let mut log = RequestLog::default();
        let d = run(&limit, &mut log, &[(3, 1), (4 * MS + 7, 1), (9 * MS, 2)]);
        // 2 need both entries gone: the later one, of 4 ms, stops at 14 ms.
        assert_eq!(d[2].retry_after(), Some(Duration::from_millis(5)));
        let before = take(&limit, &mut log, at(14 * MS - 1), 2);
        assert!(!before.allowed());
        assert_eq!(before.retry_after(), Some(Duration::from_nanos(1)));
        assert!(take(&limit, &mut log, at(14 * MS), 2).allowed());
    }

    #[test]
    fn a_rejection_changes_nothing() {
        let limit = log_limit(2, Duration::from_secs(1));
        let mut log = RequestLog::default();
        take(&limit, &mut log, at(0), 2);
        let kept = log.clone();
        assert!(!take(&limit, &mut log, at(10 * MS), 1).allowed());
        assert_eq!(log, kept);
    }

    #[test]
    fn time_going_back_frees_nothing() {
        let limit = log_limit(2, Duration::from_secs(1));
        let mut log = RequestLog::default();
        let d = run(
            &limit,
            &mut log,
            &[(1_500 * MS, 2), (0, 1), (2_499 * MS, 1)],
        );
        assert!(d[0].allowed());
        assert!(!d[1].allowed(), "an earlier millisecond reopened the log");
        assert!(!d[2].allowed());
        assert!(d[1].retry_after() > d[2].retry_after());
        // A charge from an earlier clock lands on the latest entry, which counts longest.
        let mut log = RequestLog::default();
        let d = run(&limit, &mut log, &[(1_500 * MS, 1), (700 * MS, 1)]);
        assert!(d[1].allowed());
        assert_eq!(log.len(), 1);
        assert_eq!(d[1].reset_after(), Duration::from_millis(1_800));
        assert_eq!(charged_ms(&limit, at(700 * MS), &d[1]), 1_500);
    }

    #[test]
    fn requests_of_one_millisecond_share_an_entry() {
        let limit = log_limit(10, Duration::from_secs(1));
        let mut log = RequestLog::default();
        run(&limit, &mut log, &[(MS, 1), (MS + 5, 2), (2 * MS - 1, 3)]);
        assert_eq!(log.len(), 1);
        assert_eq!(balance(&limit, Some(&log), at(2 * MS), 1).remaining(), 4);
        assert_eq!(log.free_at(&limit), at(SEC + MS));
        // Charging drops what the latest millisecond no longer counts.
        take(&limit, &mut log, at(SEC + MS), 1);
        assert_eq!(log.len(), 1);
    }

    #[test]
    fn a_lowered_limit_admits_nothing_until_enough_has_left() {
        let wide = log_limit(5, Duration::from_secs(1));
        let narrow = log_limit(2, Duration::from_secs(1));
        let mut log = RequestLog::default();
        run(&wide, &mut log, &[(0, 2), (100 * MS, 3)]);
        let d = take(&narrow, &mut log, at(200 * MS), 1);
        assert!(!d.allowed());
        assert_eq!(d.remaining(), 0);
        // The 3 of 100 ms must go too: 5 counted, 1 more asked, 2 allowed.
        assert_eq!(d.retry_after(), Some(Duration::from_millis(900)));
        assert_eq!(balance(&narrow, Some(&log), at(200 * MS), 1).remaining(), 0);
        assert!(take(&narrow, &mut log, at(1_100 * MS), 2).allowed());
    }

    #[test]
    fn a_burst_leaves_no_memory_behind() {
        let limit = log_limit(10_000, Duration::from_secs(3_600));
        let mut log = RequestLog::default();
        for ms in 0..5_000 {
            take(&limit, &mut log, at(ms * MS), 1);
        }
        assert_eq!(log.len(), 5_000);
        take(&limit, &mut log, at(4_000 * SEC), 1);
        assert_eq!(log.len(), 1);
        assert!(
            log.older.is_none(),
            "{:?}",
            log.older.as_ref().map(|o| o.capacity())
        );
    }

    #[test]
    fn a_thinning_log_gives_back_a_bursts_room_but_keeps_a_small_one() {
        let limit = log_limit(10_000, Duration::from_secs(1));
        let capacity = |log: &RequestLog| log.older.as_ref().map_or(0, |o| o.capacity());
        // A thousand entries, then two of them still counting: most of the room goes back.
        let mut log = RequestLog::default();
        for ms in 0..1_000 {
            take(&limit, &mut log, at(ms * MS), 1);
        }
        assert!(capacity(&log) >= 999);
        take(&limit, &mut log, at(1_997 * MS), 1);
        assert_eq!(log.len(), 3);
        assert!(capacity(&log) <= 16, "{}", capacity(&log));
        // Room for 16 or fewer is kept, too little to be worth a reallocation.
        let mut log = RequestLog::default();
        for ms in 0..16 {
            take(&limit, &mut log, at(ms * MS), 1);
        }
        let room = capacity(&log);
        assert!((15..=16).contains(&room), "{room}");
        // The latest entry joins the older ones (16 of them) before the 14 oldest leave.
        take(&limit, &mut log, at(1_013 * MS), 1);
        assert_eq!(log.len(), 3);
        assert_eq!(capacity(&log), room);
    }

    #[test]
    fn a_refund_comes_off_the_charged_entry_while_it_counts() {
        let limit = log_limit(5, Duration::from_secs(1));
        let mut log = RequestLog::default();
        let d = run(&limit, &mut log, &[(0, 4), (500 * MS, 1)]);
        give_back(&mut log, charged_ms(&limit, at(0), &d[0]), 3);
        assert_eq!(balance(&limit, Some(&log), at(600 * MS), 1).remaining(), 3);
        // Emptied and not the latest: gone. Never below 0.
        give_back(&mut log, 0, 9);
        assert_eq!(log.len(), 1);
        assert_eq!(balance(&limit, Some(&log), at(600 * MS), 1).remaining(), 4);
        // The latest entry, emptied, stays to mark the latest time seen.
        give_back(&mut log, 500, 1);
        assert_eq!(log.len(), 1);
        let d = take(&limit, &mut log, at(0), 5);
        assert!(d.allowed());
        assert_eq!(charged_ms(&limit, at(0), &d), 500);
        // An entry no longer held gives nothing.
        let mut log = RequestLog::default();
        take(&limit, &mut log, at(0), 5);
        take(&limit, &mut log, at(2 * SEC), 5);
        give_back(&mut log, 0, 5);
        assert_eq!(balance(&limit, Some(&log), at(2 * SEC), 1).remaining(), 0);
    }
}
