//! Several decisions per script call, when callers arrive together.
//!
//! Each `EVALSHA` has a fixed cost inside Redis (dispatch, argument tables, the Lua call) on top
//! of the work per bucket. Concurrent callers on one node therefore go through a dispatcher
//! that keeps a bounded number of calls in flight; while they are out, new requests queue, and
//! the next call carries all of them (up to a maximum). An idle store sends each request at once
//! in a call of its own, so batching adds no latency when there is nothing to batch with.
//!
//! Callers hand their requests to the dispatcher rather than sending them themselves: it runs
//! after the callers woken by one reply have queued their next requests, so they leave together.
//! A caller that found a slot free and sent its own request at once would leave alone, and
//! under load most calls would carry one decision (measured: a third fewer decisions per second
//! at 16 and 64 callers).
//!
//! Two calls in flight are kept apart, so that Redis decides one while this side answers the
//! other's callers and sends their next requests. Redis runs every command it has read from a
//! connection before it writes any reply: two calls that arrive in one read are answered in one
//! write, after both have run, and while this side then turns all their callers around, Redis
//! idles; and the two next calls leave together again. So with nothing in flight the waiting
//! requests are split over two calls, and a call followed at once by another is written on its
//! own before the next is formed. On this project's 2-core host (BENCHMARKS.md, sixteenth
//! session) that raised 16 callers from 150k–172k to 224k–245k decisions a second on one key and
//! from 104k–121k to 168k–175k on 100,000 keys, and 64 callers on 100,000 keys from 157k–191k to
//! 222k–281k, where Redis' core was then full. With one call in flight at most, nothing is
//! split: a second call would only wait.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use foldhash::fast::FixedState;
use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use redis::{Cmd, ErrorKind, ServerErrorKind};
use tokio::sync::{mpsc, oneshot};
use tollgate::Unavailable;

use crate::connection::{Connection, Link};
use crate::store::classify;
use crate::units::WindowKind;

/// What a request does to its buckets: the script's `mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Decide, and charge when every bucket allows.
    Take,
    /// Decide without writing anything.
    Peek,
    /// Give back what an earlier take charged.
    Refund,
    /// Give back part of what an earlier take with a request id charged, once (a reservation
    /// settled): each bucket's `cost` is what to give back.
    Settle,
}

impl Mode {
    fn as_str(self) -> &'static str {
        match self {
            Mode::Take => "take",
            Mode::Peek => "peek",
            Mode::Refund => "refund",
            Mode::Settle => "settle",
        }
    }
}

/// A request's idempotency record, in its script arguments.
pub(crate) struct Record {
    pub(crate) key: String,
    pub(crate) window_ms: u64,
    /// The request's content, as a retry must repeat it.
    pub(crate) fingerprint: String,
    /// This attempt's own id: a refund gives back only while the record still names it (no
    /// retry's reply rests on the charge yet). In a settlement, a fingerprint of its refunds,
    /// which the record keeps (marked `=`) once settled.
    pub(crate) attempt: u64,
}

/// One bucket of a request, in the script's units.
pub(crate) struct Bucket {
    pub(crate) key: String,
    pub(crate) params: Params,
}

/// What the script is told of a bucket.
pub(crate) enum Params {
    /// A token bucket.
    Tokens {
        /// Units gained per microsecond.
        a: u64,
        /// Units per token.
        p: u64,
        /// Capacity in units.
        cap: u64,
        /// Cost in units.
        cost: u64,
        /// The bucket under the parameters its limit had before a change, read on the way.
        carry: Option<Carried>,
    },
    /// A fixed or sliding window, or a sliding log.
    Window {
        kind: WindowKind,
        window_ms: u64,
        /// The most it admits per window.
        limit: u64,
        /// Requests to count.
        cost: u64,
        /// In a refund, the window the take charged (as the script replied it; a log's
        /// millisecond): what the refund gives back from. Without it, a refund gives back
        /// nothing.
        charged: Option<u64>,
    },
}

/// An old bucket to carry over (see `tollgate::Carry`), in the script's units.
#[derive(Clone)]
pub(crate) struct Carried {
    pub(crate) key: String,
    /// The old parameters: units per microsecond, units per token, capacity in units.
    pub(crate) a: u64,
    pub(crate) p: u64,
    pub(crate) cap: u64,
    /// Whole microseconds since the change (rounded down: the change is taken as later, so
    /// the old bucket is read emptier and the new one has refilled less).
    pub(crate) since_us: u64,
}

/// The most bytes of figures a bucket sends: three doubles, five more with a carry (a window
/// sends four or five).
const MAX_PARAMS: usize = 64;

impl Bucket {
    /// The bucket's figures as the script reads them, little-endian doubles, told apart by
    /// their length: a token bucket's `a`, `cap` and `cost`, and with a carry, then the old
    /// `a`, `cap` and `p`, the new `p` and the microseconds since the change; a window's kind
    /// (1 fixed, 2 sliding, 3 a sliding log), window in milliseconds, limit and cost, and in a
    /// refund, then the window (a log's millisecond) charged. All stay below 2^53 (see `ScriptLimit`; the time is capped here; the
    /// window charged is the script's own figure), so each double is exact. Returns the
    /// buffer and how much of it is used.
    fn params(&self) -> ([u8; MAX_PARAMS], usize) {
        let mut bytes = [0; MAX_PARAMS];
        let mut put = |values: &[u64], from: usize| {
            for (chunk, &value) in bytes[from..].chunks_exact_mut(8).zip(values) {
                chunk.copy_from_slice(&(value as f64).to_le_bytes());
            }
        };
        match &self.params {
            Params::Tokens {
                a,
                p,
                cap,
                cost,
                carry,
            } => {
                put(&[*a, *cap, *cost], 0);
                match carry {
                    None => (bytes, 24),
                    Some(carry) => {
                        // Beyond 2^53 microseconds (285 years) every bucket has refilled.
                        let since = carry.since_us.min(1 << 53);
                        put(&[carry.a, carry.cap, carry.p, *p, since], 24);
                        (bytes, MAX_PARAMS)
                    }
                }
            }
            Params::Window {
                kind,
                window_ms,
                limit,
                cost,
                charged,
            } => {
                put(&[kind.code(), *window_ms, *limit, *cost], 0);
                match charged {
                    None => (bytes, 32),
                    Some(window) => {
                        put(&[*window], 32);
                        (bytes, 40)
                    }
                }
            }
        }
    }

    /// The old bucket this one carries over, if any.
    fn carry(&self) -> Option<&Carried> {
        match &self.params {
            Params::Tokens { carry, .. } => carry.as_ref(),
            Params::Window { .. } => None,
        }
    }

    /// Whether the script decides this bucket as a window.
    fn is_window(&self) -> bool {
        matches!(self.params, Params::Window { .. })
    }
}

/// One request's part of a script call (see `scripts/take.lua`).
pub(crate) struct Segment {
    pub(crate) buckets: Vec<Bucket>,
    pub(crate) record: Option<Record>,
    pub(crate) mode: Mode,
}

/// How a call lays out its requests' arguments (the script's `ARGV[4]`): each argument costs
/// Redis about 1.2k instructions, so the usual requests leave out what the call's requests all
/// share (see `scripts/take.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// As [`Layout::Plain`], and moreover no bucket's key in the call twice, none carrying an
    /// old bucket over, none a window, at a whole microsecond: the script decides these in a
    /// straight loop before it makes the functions and tables the other requests need. Most
    /// calls are of this kind; it saves Redis a fifth of a call of one's instructions and a
    /// sixth of a decision's in calls of 32.
    Straight,
    /// Every request a take of one bucket without a record: its figures alone. Four arguments
    /// fewer per request, a tenth of a decision's work in calls of 32.
    Plain,
    /// Every request a take without a record: its number of buckets, then their figures.
    Counted,
    /// Each request whole: its number of buckets, record window and fingerprint, mode, figures.
    Full,
}

impl Layout {
    /// The layout of a call of `segments` at `now` (nanoseconds; `None` for Redis' `TIME`),
    /// `flags` the call's (see [`Flags`]).
    fn of(segments: &[&Segment], now: Option<u64>, flags: Flags) -> Self {
        let take = |segment: &&Segment| segment.record.is_none() && segment.mode == Mode::Take;
        if !segments.iter().all(take) {
            Layout::Full
        } else if segments.iter().all(|segment| segment.buckets.len() == 1) {
            let carries = segments
                .iter()
                .any(|segment| segment.buckets.iter().any(|b| b.carry().is_some()));
            let whole_micros = now.is_none_or(|nanos| nanos % 1_000 == 0);
            if flags.cache || flags.windows || carries || !whole_micros {
                Layout::Plain
            } else {
                Layout::Straight
            }
        } else {
            Layout::Counted
        }
    }

    /// Whether each request sends its figures alone.
    fn figures_alone(self) -> bool {
        matches!(self, Layout::Straight | Layout::Plain)
    }

    fn as_str(self) -> &'static str {
        match self {
            Layout::Straight => "s",
            Layout::Plain => "1",
            Layout::Counted => "n",
            Layout::Full => "",
        }
    }
}

/// The script's reply length for `segment`: a status, then a pair per bucket (allowed, and a
/// token bucket's deficit or a window's remaining), then four more figures per window.
fn reply_len(segment: &Segment) -> usize {
    let windows = segment.buckets.iter().filter(|b| b.is_window()).count();
    1 + 2 * segment.buckets.len() + 4 * windows
}

/// The take script, as Redis is sent it.
#[derive(Debug, Clone)]
pub(crate) struct TakeScript {
    source: &'static str,
    /// The SHA1 of `source`, which `EVALSHA` names it by.
    sha: String,
}

impl TakeScript {
    pub(crate) fn new() -> Self {
        let source = include_str!("../scripts/take.lua");
        Self {
            source,
            sha: redis::Script::new(source).get_hash().to_owned(),
        }
    }
}

/// The arguments and bytes of [`command`]'s call, at most, so that building it never
/// reallocates: an integer argument is at most 20 digits (three per call, two per segment,
/// with a mode of at most 6 bytes), the two flags a byte each, a bucket's figures at most 64
/// bytes, and keys and fingerprints are counted as they are.
fn capacity(verb: &str, script: &str, segments: &[&Segment]) -> (usize, usize) {
    let (mut args, mut bytes) = (7, verb.len() + script.len() + 62);
    for segment in segments {
        args += 4 + 2 * segment.buckets.len();
        bytes += 46 + MAX_PARAMS * segment.buckets.len();
        bytes += segment.buckets.iter().map(|b| b.key.len()).sum::<usize>();
        for carry in segment.buckets.iter().filter_map(Bucket::carry) {
            args += 1;
            bytes += carry.key.len();
        }
        if let Some(record) = &segment.record {
            args += 1;
            bytes += record.key.len() + record.fingerprint.len() + 21;
        }
    }
    (args, bytes)
}

/// The script call deciding `segments`: `verb` is `EVALSHA` with the script's hash or `EVAL`
/// with its source. Integers are written straight into the command, with no string between.
fn command(verb: &str, script: &str, now: Option<u64>, segments: &[&Segment]) -> Cmd {
    let carried = |segment: &Segment| {
        segment
            .buckets
            .iter()
            .filter(|b| b.carry().is_some())
            .count()
    };
    let keys: usize = segments
        .iter()
        .map(|segment| {
            segment.buckets.len() + carried(segment) + usize::from(segment.record.is_some())
        })
        .sum();
    let (args, bytes) = capacity(verb, script, segments);
    let mut cmd = Cmd::with_capacity(args, bytes);
    cmd.arg(verb).arg(script).arg(keys);
    for segment in segments {
        for bucket in &segment.buckets {
            cmd.arg(&bucket.key);
        }
        for carry in segment.buckets.iter().filter_map(Bucket::carry) {
            cmd.arg(&carry.key);
        }
        if let Some(record) = &segment.record {
            cmd.arg(&record.key);
        }
    }
    // The script counts in microseconds; a caller's time between two goes with its
    // nanoseconds, which the script rounds the safe way (see `scripts/take.lua`).
    match now.map(|nanos| (nanos / 1_000, nanos % 1_000)) {
        Some((micros, 0)) => cmd.arg(micros),
        Some((micros, nanos)) => cmd.arg(format!("{micros}:{nanos}")),
        None => cmd.arg(""),
    };
    cmd.arg(segments.len());
    let flags = Flags::of(segments);
    cmd.arg(flags.as_str());
    let layout = Layout::of(segments, now, flags);
    cmd.arg(layout.as_str());
    for segment in segments {
        if !layout.figures_alone() {
            cmd.arg(segment.buckets.len());
        }
        if layout == Layout::Full {
            match &segment.record {
                Some(record) => {
                    let mark = if segment.mode == Mode::Settle {
                        "="
                    } else {
                        ""
                    };
                    cmd.arg(record.window_ms)
                        .arg(format!("{}:{mark}{}", record.fingerprint, record.attempt))
                }
                None => cmd.arg("").arg(""),
            };
            cmd.arg(segment.mode.as_str());
        }
        for bucket in &segment.buckets {
            let (params, len) = bucket.params();
            cmd.arg(&params[..len]);
        }
    }
    cmd
}

/// What the script is told of a call as a whole (its `ARGV[3]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Flags {
    /// Token buckets are read and written once per call (see [`caches_token_buckets`]).
    cache: bool,
    /// The call holds a window: the script makes its window functions.
    windows: bool,
}

impl Flags {
    fn of(segments: &[&Segment]) -> Self {
        let windows = segments
            .iter()
            .any(|segment| segment.buckets.iter().any(Bucket::is_window));
        Self {
            cache: caches_token_buckets(segments, windows),
            windows,
        }
    }

    fn as_str(self) -> &'static str {
        match (self.windows, self.cache) {
            (false, false) => "",
            (false, true) => "1",
            (true, false) => "w",
            (true, true) => "w1",
        }
    }
}

/// Whether the script should read and write each token bucket once per call: when a token
/// bucket's key (its own or an old one it carries over) is in `segments` more than once. That
/// saves Redis most of a decision's cost on a hot key; the table it keeps for that would only
/// cost a call of distinct keys (see `scripts/take.lua`). Windows are never cached, so a call
/// where a window (`windows`: the call holds one) has a token bucket's key goes uncached: a
/// token bucket's state written at the end of the call would otherwise land after a window's
/// written at once, where one request after another would each have read the other's.
fn caches_token_buckets(segments: &[&Segment], windows: bool) -> bool {
    let tokens = || {
        segments.iter().flat_map(|segment| {
            segment
                .buckets
                .iter()
                .filter(|bucket| !bucket.is_window())
                .flat_map(|bucket| {
                    std::iter::once(bucket.key.as_str())
                        .chain(bucket.carry().map(|carry| carry.key.as_str()))
                })
        })
    };
    let count = segments
        .iter()
        .flat_map(|segment| &segment.buckets)
        .filter(|bucket| !bucket.is_window())
        .map(|bucket| 1 + usize::from(bucket.carry().is_some()))
        .sum();
    if count < 2 {
        return false;
    }
    // One call's keys: no one gains by making them collide.
    let mut seen = HashSet::with_capacity_and_hasher(count, FixedState::default());
    if !windows {
        return tokens().any(|key| !seen.insert(key));
    }
    // Every token bucket's key goes in, to look the windows' up in.
    let mut repeated = false;
    for key in tokens() {
        repeated |= !seen.insert(key);
    }
    repeated
        && !segments
            .iter()
            .flat_map(|segment| &segment.buckets)
            .any(|bucket| bucket.is_window() && seen.contains(bucket.key.as_str()))
}

/// Runs `segments` in one call of `script`, at `now` (nanoseconds; `None` for Redis' `TIME`),
/// returning each segment's reply: its part of the script's packed integers, decoded. A
/// `NOSCRIPT` answer (after `SCRIPT FLUSH` or a restart) sends the call again as an `EVAL` of
/// the source, which also caches the script in that node for the next `EVALSHA`: one more
/// round trip, once.
pub(crate) async fn invoke(
    script: &TakeScript,
    connection: &Connection,
    now: Option<u64>,
    segments: &[&Segment],
) -> Result<Vec<Vec<i64>>, Unavailable> {
    let call = command("EVALSHA", &script.sha, now, segments);
    let reply = match connection.query::<Vec<u8>>(&call).await {
        Err(err) if err.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
            let call = command("EVAL", script.source, now, segments);
            connection.query(&call).await
        }
        reply => reply,
    }
    .map_err(|err| classify(&err))?;
    let Some(integers) = packed(&reply) else {
        return Err(Unavailable::Protocol);
    };
    let expected: usize = segments.iter().map(|segment| reply_len(segment)).sum();
    if integers.len() != expected {
        return Err(Unavailable::Protocol);
    }
    let mut rest = integers;
    segments
        .iter()
        .map(|segment| {
            let (mine, others) = rest.split_at(reply_len(segment));
            rest = others;
            mine.iter().map(|bytes| integer(*bytes)).collect()
        })
        .collect::<Option<_>>()
        .ok_or(Unavailable::Protocol)
}

/// The script's reply cut into its packed integers: `None` unless it is whole ones.
pub(crate) fn packed(reply: &[u8]) -> Option<&[[u8; 8]]> {
    match reply.as_chunks::<8>() {
        (integers, []) => Some(integers),
        _ => None,
    }
}

/// One integer of the script's reply, which packs each as a little-endian double: `None` for
/// one that is not a whole number of at most 2^53 in magnitude, which the script never sends.
pub(crate) fn integer(bytes: [u8; 8]) -> Option<i64> {
    /// Every integer up to here is exactly a double.
    const EXACT: f64 = 9_007_199_254_740_992.0;
    let value = f64::from_le_bytes(bytes);
    // NaN fails the first test; a whole number within ±2^53 converts exactly.
    (value.abs() <= EXACT && value.fract() == 0.0).then_some(value as i64)
}

struct Job {
    now: Option<u64>,
    segment: Segment,
    reply: oneshot::Sender<Result<Vec<i64>, Unavailable>>,
}

/// The queue in front of one node's connection.
pub(crate) struct Batcher {
    jobs: mpsc::UnboundedSender<Job>,
}

impl Batcher {
    /// Starts the dispatcher on the current tokio runtime; it ends when the batcher is dropped.
    /// A call still unanswered after `timeout` is abandoned: its callers have all given up by
    /// then (each waits at most `timeout` in all), and its slot is needed.
    pub(crate) fn start(
        script: TakeScript,
        link: Arc<Link>,
        timeout: Duration,
        max_in_flight: usize,
        max_batch: usize,
    ) -> Self {
        let (jobs, queue) = mpsc::unbounded_channel();
        tokio::spawn(dispatch(
            Arc::new(script),
            link,
            timeout,
            queue,
            max_in_flight.max(1),
            max_batch.max(1),
        ));
        Self { jobs }
    }

    /// Decides `segment` in the next call.
    pub(crate) async fn submit(
        &self,
        now: Option<u64>,
        segment: Segment,
    ) -> Result<Vec<i64>, Unavailable> {
        let (reply, answer) = oneshot::channel();
        self.jobs
            .send(Job {
                now,
                segment,
                reply,
            })
            .map_err(|_| Unavailable::Connection)?;
        answer.await.map_err(|_| Unavailable::Connection)?
    }
}

/// Sends batches of queued jobs, at most `max_in_flight` calls at a time, two apart when it can
/// (see the module's comment). The calls run inside this task rather than in a task each: a
/// spawn and a task wake-up fewer per call.
async fn dispatch(
    script: Arc<TakeScript>,
    link: Arc<Link>,
    timeout: Duration,
    mut queue: mpsc::UnboundedReceiver<Job>,
    max_in_flight: usize,
    max_batch: usize,
) {
    let mut calls = FuturesUnordered::new();
    // The job taken from the queue that could not join the last batch (another `now`): the
    // next batch's first. One at most, as a batch ends at the first such job.
    let mut carried: Option<Job> = None;
    let mut open = true;
    while open || !calls.is_empty() {
        if !open || calls.len() >= max_in_flight {
            calls.next().await;
            continue;
        }
        let first = match carried.take() {
            Some(job) => Some(job),
            None => tokio::select! {
                biased;
                // A call ended: its callers have their replies, and a slot is free.
                Some(()) = calls.next(), if !calls.is_empty() => continue,
                job = queue.recv() => job,
            },
        };
        let Some(first) = first else {
            // The batcher is gone: finish the calls in flight, then stop.
            open = false;
            continue;
        };
        // With nothing in flight, half of what waits leaves now and the rest in a second call
        // right after, so that two calls alternate from then on (the module's comment).
        let waiting = 1 + queue.len();
        let size = if calls.is_empty() && max_in_flight > 1 {
            waiting.div_ceil(2).min(max_batch)
        } else {
            max_batch
        };
        let mut batch = vec![first];
        while batch.len() < size {
            let Ok(next) = queue.try_recv() else {
                break;
            };
            // One call has one `now`: requests with caller-supplied times batch only with
            // requests at the same time.
            if next.now == batch[0].now {
                batch.push(next);
            } else {
                carried = Some(next);
                break;
            }
        }
        // A caller that gave up while its request queued (its timeout passed) must not be
        // charged for a decision nobody will read.
        batch.retain(|job| !job.reply.is_closed());
        if !batch.is_empty() {
            calls.push(call(script.clone(), link.get(), timeout, batch));
            if !queue.is_empty() || carried.is_some() {
                // Another call follows at once. This one is handed to the connection first
                // (polled once) and written alone (the connection's task runs while this one
                // yields), so that Redis reads and answers the two apart: see the module's
                // comment.
                let _ = calls.next().now_or_never();
                tokio::task::yield_now().await;
            }
        }
    }
}

/// One script call deciding `batch`, each job answered with its own part of the reply.
async fn call(script: Arc<TakeScript>, connection: Connection, timeout: Duration, batch: Vec<Job>) {
    let deadline = tokio::time::Instant::now() + timeout;
    let segments: Vec<&Segment> = batch.iter().map(|job| &job.segment).collect();
    let result = tokio::time::timeout_at(
        deadline,
        invoke(&script, &connection, batch[0].now, &segments),
    )
    .await
    .unwrap_or(Err(Unavailable::Timeout));
    match result {
        Ok(replies) => {
            for (job, reply) in batch.into_iter().zip(replies) {
                let _ = job.reply.send(Ok(reply));
            }
        }
        // The script reports a request's unreadable data in that request's reply, so a failed
        // call is rare; but one request's arguments or keys must not fail the requests that
        // happened to share its call. Each goes again alone (in parallel, within the same
        // deadline), so only the one at fault gets the error. A call that failed part-way may
        // have charged the requests before the failure: sent again, they are charged twice
        // (under-admission, never over-admission), unless their request id replays the first.
        Err(Unavailable::Script) if batch.len() > 1 => {
            let alone = batch.into_iter().map(|job| {
                let connection = &connection;
                let script = &script;
                async move {
                    let reply = tokio::time::timeout_at(
                        deadline,
                        invoke(script, connection, job.now, &[&job.segment]),
                    )
                    .await
                    .unwrap_or(Err(Unavailable::Timeout))
                    .and_then(|mut replies| replies.pop().ok_or(Unavailable::Protocol));
                    let _ = job.reply.send(reply);
                }
            });
            futures_util::future::join_all(alone).await;
        }
        Err(reason) => {
            for job in batch {
                let _ = job.reply.send(Err(reason));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use redis::Arg;

    use super::{
        Bucket, Carried, Flags, Mode, Params, Record, Segment, WindowKind, caches_token_buckets,
        capacity, command, integer, reply_len,
    };

    fn bucket(key: &str, old_key: Option<&str>) -> Bucket {
        Bucket {
            key: key.to_owned(),
            params: Params::Tokens {
                a: 1,
                p: 1,
                cap: 10,
                cost: 1,
                carry: old_key.map(|key| Carried {
                    key: key.to_owned(),
                    a: 1,
                    p: 1,
                    cap: 5,
                    since_us: 0,
                }),
            },
        }
    }

    fn window(key: &str, charged: Option<u64>) -> Bucket {
        Bucket {
            key: key.to_owned(),
            params: Params::Window {
                kind: WindowKind::Sliding,
                window_ms: 1_000,
                limit: 10,
                cost: 3,
                charged,
            },
        }
    }

    fn segment(buckets: Vec<Bucket>) -> Segment {
        Segment {
            buckets,
            record: None,
            mode: Mode::Take,
        }
    }

    #[test]
    fn a_command_is_sized_up_front_closely() {
        let record = |key: &str| Record {
            key: key.to_owned(),
            window_ms: 86_400_000,
            fingerprint: "f".repeat(40),
            attempt: u64::MAX,
        };
        let recorded = |buckets: Vec<Bucket>, mode: Mode| Segment {
            record: Some(record("{k}:record")),
            mode,
            ..segment(buckets)
        };
        let calls: Vec<Vec<Segment>> = vec![
            vec![segment(vec![bucket("a", None)])],
            (0..32)
                .map(|i| segment(vec![bucket(&format!("key-{i}"), None)]))
                .collect(),
            vec![
                segment(vec![bucket("a", Some("old-a")), window("w", Some(1))]),
                recorded(vec![bucket("b", None), window("v", None)], Mode::Settle),
                recorded(vec![bucket("c", Some("old-c"))], Mode::Refund),
            ],
            // Long keys, old keys and figures.
            vec![segment(
                (0..8)
                    .map(|i| {
                        let big = (1 << 53) - 1;
                        let mut bucket = bucket(&format!("{i}{}", "k".repeat(99)), None);
                        bucket.params = Params::Tokens {
                            a: big,
                            p: big,
                            cap: big,
                            cost: big,
                            carry: Some(Carried {
                                key: format!("{i}{}", "o".repeat(99)),
                                a: big,
                                p: big,
                                cap: big,
                                since_us: big,
                            }),
                        };
                        bucket
                    })
                    .collect(),
            )],
        ];
        for segments in &calls {
            let segments: Vec<&Segment> = segments.iter().collect();
            for now in [None, Some(1_700_000_000_123_456_789)] {
                let cmd = command("EVALSHA", &"s".repeat(40), now, &segments);
                let (args, bytes) = capacity("EVALSHA", &"s".repeat(40), &segments);
                let used: Vec<usize> = cmd
                    .args_iter()
                    .map(|arg| match arg {
                        Arg::Simple(bytes) => bytes.len(),
                        _ => 0,
                    })
                    .collect();
                let used_bytes: usize = used.iter().sum();
                // Enough, and not much more: at most the four arguments a layout leaves out
                // per request, and the digits and figures an integer may but need not use.
                assert!(used.len() <= args && args <= used.len() + 4 * segments.len());
                assert!(used_bytes <= bytes, "{used_bytes} > {bytes}");
                assert!(
                    bytes <= used_bytes + 120 + 110 * segments.len(),
                    "{bytes} for {used_bytes}"
                );
            }
        }
    }

    #[test]
    fn a_key_is_repeated_within_a_request_across_requests_or_as_an_old_bucket() {
        let call = |segments: &[Segment]| {
            caches_token_buckets(&segments.iter().collect::<Vec<_>>(), false)
        };
        assert!(!call(&[segment(vec![bucket("a", None)])]));
        assert!(!call(&[
            segment(vec![bucket("a", Some("a-old")), bucket("b", None)]),
            segment(vec![bucket("c", None)]),
        ]));
        assert!(call(&[segment(vec![bucket("a", None), bucket("a", None)])]));
        assert!(call(&[
            segment(vec![bucket("a", None)]),
            segment(vec![bucket("b", None)]),
            segment(vec![bucket("a", None)]),
        ]));
        assert!(call(&[
            segment(vec![bucket("a", Some("b-old"))]),
            segment(vec![bucket("b-old", None)]),
        ]));
    }

    /// Windows are never cached: only token buckets' repeated keys turn the cache on, and a
    /// window with a token bucket's key turns it off, so that no key is both cached and not.
    #[test]
    fn the_cache_is_for_token_buckets_whose_keys_no_window_has() {
        let flags = |segments: &[Segment]| Flags::of(&segments.iter().collect::<Vec<_>>());
        let hot = || segment(vec![bucket("a", None)]);
        assert_eq!(flags(&[hot(), hot()]).as_str(), "1");
        assert_eq!(
            flags(&[hot(), segment(vec![window("w", None)])]).as_str(),
            "w"
        );
        let windows_twice = [
            segment(vec![window("w", None)]),
            segment(vec![window("w", None)]),
        ];
        assert_eq!(flags(&windows_twice).as_str(), "w");
        let both = [hot(), hot(), segment(vec![window("w", None)])];
        assert_eq!(flags(&both).as_str(), "w1");
        // Beside a window too, only a repeated key turns the cache on.
        let distinct = [
            segment(vec![bucket("a", None)]),
            segment(vec![bucket("b", None)]),
            segment(vec![window("w", None)]),
        ];
        assert_eq!(flags(&distinct).as_str(), "w");
        let shared = [hot(), hot(), segment(vec![window("a", None)])];
        assert_eq!(flags(&shared).as_str(), "w");
        // An old key a token bucket carries over is a token bucket's key too.
        let carried = [
            segment(vec![bucket("b", Some("old"))]),
            segment(vec![bucket("b", None), window("old", None)]),
        ];
        assert_eq!(flags(&carried).as_str(), "w");
    }

    /// A window's figures are four doubles, five in a refund (the window it was charged to);
    /// its reply is four figures longer than a token bucket's; and a call with one never
    /// takes the straight loop, which knows token buckets only.
    #[test]
    fn a_window_sends_its_own_figures_and_leaves_the_straight_loop() {
        let take = [segment(vec![window("w", None)])];
        let args = argv(&take);
        assert_eq!(&args[..4], [&b""[..], b"1", b"w", b"1"]);
        let figures: Vec<f64> = args[4]
            .chunks_exact(8)
            .map(|chunk| f64::from_le_bytes(chunk.try_into().unwrap()))
            .collect();
        assert_eq!(figures, [2.0, 1_000.0, 10.0, 3.0]);
        assert_eq!(reply_len(&take[0]), 7);
        let refund = [Segment {
            mode: Mode::Refund,
            ..segment(vec![
                bucket("t", None),
                window("w", Some(1_700_000_000_123)),
            ])
        }];
        let args = argv(&refund);
        assert_eq!(&args[..4], [&b""[..], b"1", b"w", b""]);
        assert_eq!((args[8].len(), args[9].len()), (24, 40));
        assert_eq!(
            f64::from_le_bytes(args[9][32..].try_into().unwrap()),
            1_700_000_000_123.0
        );
        assert_eq!(reply_len(&refund[0]), 1 + 4 + 4);
    }

    /// A sliding log is a window of kind 3 to the script, and its refund names the
    /// millisecond its take charged where a window names its index.
    #[test]
    fn a_log_is_a_window_of_its_own_kind() {
        let log = |charged| Bucket {
            key: "l".to_owned(),
            params: Params::Window {
                kind: WindowKind::Log,
                window_ms: 20,
                limit: 5,
                cost: 2,
                charged,
            },
        };
        let figures = |arg: &[u8]| -> Vec<f64> {
            arg.chunks_exact(8)
                .map(|chunk| f64::from_le_bytes(chunk.try_into().unwrap()))
                .collect()
        };
        let args = argv(&[segment(vec![log(None)])]);
        assert_eq!(args[2], b"w");
        assert_eq!(figures(&args[4]), [3.0, 20.0, 5.0, 2.0]);
        let refund = [Segment {
            mode: Mode::Refund,
            ..segment(vec![log(Some(1_700_000_000_123))])
        }];
        let args = argv(&refund);
        assert_eq!(
            figures(&args[8]),
            [3.0, 20.0, 5.0, 2.0, 1_700_000_000_123.0]
        );
        assert_eq!(reply_len(&refund[0]), 1 + 2 + 4);
    }

    /// The script's arguments in a call of `segments` (ARGV: after the verb, the script, the
    /// number of keys and the keys).
    fn argv(segments: &[Segment]) -> Vec<Vec<u8>> {
        argv_at(segments, None)
    }

    /// As `argv`, at `now` (nanoseconds; `None` for Redis' `TIME`).
    fn argv_at(segments: &[Segment], now: Option<u64>) -> Vec<Vec<u8>> {
        let segments: Vec<&Segment> = segments.iter().collect();
        let cmd = command("EVALSHA", "sha", now, &segments);
        let args: Vec<Vec<u8>> = cmd
            .args_iter()
            .map(|arg| match arg {
                Arg::Simple(bytes) => bytes.to_vec(),
                _ => panic!("the script's call has no cursor"),
            })
            .collect();
        let keys: usize = String::from_utf8_lossy(&args[2])
            .parse()
            .expect("a key count");
        args[3 + keys..].to_vec()
    }

    #[test]
    fn a_call_leaves_out_what_its_requests_all_share() {
        // Takes of one bucket of its own, carrying nothing over, at a whole microsecond: the
        // straight layout, each request's figures alone.
        let straight = [
            segment(vec![bucket("a", None)]),
            segment(vec![bucket("b", None)]),
        ];
        for (now, first) in [(None, &b""[..]), (Some(7_000), b"7")] {
            let args = argv_at(&straight, now);
            assert_eq!(&args[..4], [first, b"2", b"", b"s"]);
            assert_eq!((args[4].len(), args[5].len(), args.len()), (24, 24, 6));
        }
        // Between two microseconds, or with a key twice: the plain layout, the same arguments.
        let args = argv_at(&straight, Some(7_001));
        assert_eq!(&args[..4], [&b"7:1"[..], b"2", b"", b"1"]);
        assert_eq!(args.len(), 6);
        let twice = [
            segment(vec![bucket("a", None)]),
            segment(vec![bucket("a", None)]),
        ];
        assert_eq!(&argv(&twice)[..4], [&b""[..], b"2", b"1", b"1"]);

        // Takes of one bucket without a record, one carrying an old bucket over: each sends
        // its figures alone.
        let plain = [
            segment(vec![bucket("a", None)]),
            segment(vec![bucket("b", Some("b-old"))]),
        ];
        let args = argv(&plain);
        // Redis' time, two requests, no repeated key, the layout; then each bucket's figures.
        assert_eq!(&args[..4], [&b""[..], b"2", b"", b"1"]);
        assert_eq!(args.len(), 6);
        assert_eq!((args[4].len(), args[5].len()), (24, 64));

        // Takes without a record, one of them of two buckets: each sends its count first.
        let counted = [
            segment(vec![bucket("a", None)]),
            segment(vec![bucket("c", None), bucket("d", Some("d-old"))]),
        ];
        let args = argv(&counted);
        assert_eq!(&args[..4], [&b""[..], b"2", b"", b"n"]);
        assert_eq!((&args[4][..], args[5].len()), (&b"1"[..], 24));
        assert_eq!(
            (&args[6][..], args[7].len(), args[8].len()),
            (&b"2"[..], 24, 64)
        );
        assert_eq!(args.len(), 9);

        // A peek or a request with a record: every request whole.
        for other in [
            Segment {
                mode: Mode::Peek,
                ..segment(vec![bucket("c", None)])
            },
            Segment {
                record: Some(Record {
                    key: "{c}:r".to_owned(),
                    window_ms: 1_000,
                    fingerprint: "f".to_owned(),
                    attempt: 7,
                }),
                ..segment(vec![bucket("c", None)])
            },
        ] {
            let whole: [&[u8]; 4] = match &other.record {
                Some(_) => [b"1", b"1000", b"f:7", b"take"],
                None => [b"1", b"", b"", b"peek"],
            };
            let mixed = [segment(vec![bucket("a", None)]), other];
            let args = argv(&mixed);
            assert_eq!(&args[..4], [&b""[..], b"2", b"", b""]);
            assert_eq!(&args[4..8], [&b"1"[..], b"", b"", b"take"]);
            assert_eq!(args[8].len(), 24);
            assert_eq!(&args[9..13], whole);
            assert_eq!((args[13].len(), args.len()), (24, 14));
        }
    }

    fn packed(value: f64) -> [u8; 8] {
        value.to_le_bytes()
    }

    #[test]
    fn whole_numbers_within_two_to_the_53_are_read_exactly() {
        for value in [
            0,
            1,
            2,
            -1,
            -2,
            86_400_000_000,
            (1 << 53) - 1,
            1 << 53,
            -(1 << 53),
        ] {
            assert_eq!(integer(packed(value as f64)), Some(value), "{value}");
        }
    }

    #[test]
    fn anything_else_is_refused() {
        let beyond = 2f64.powi(53) + 2.0;
        for value in [0.5, -1.25, beyond, -beyond, f64::NAN, f64::INFINITY, 1e300] {
            assert_eq!(integer(packed(value)), None, "{value}");
        }
    }
}
