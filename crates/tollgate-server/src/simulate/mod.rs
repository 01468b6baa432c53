//! `tollgate simulate`: replays a trace of requests against one or more policy files and
//! reports what each would have rejected, before any of them goes in force.
//!
//! The question before a limit is lowered, a shadow limit enforced or a rollout widened is
//! "whom would this have stopped last week?". Shadow mode answers it on live traffic, slowly;
//! a replay answers it in seconds from a log. Each policy gets its own [`PolicyEngine`] on
//! manual clocks that follow the trace's timestamps, so the decisions are the ones a `tollgate
//! serve` on the memory store would have made had the requests arrived at those instants:
//! buckets refill by the trace's time, fixed windows start on the same wall-clock minutes (the
//! clock's epoch is the midnight UTC before the first request, as the server's is the midnight
//! before it started), exemptions expire mid-trace, `request_id` retries are free, and a
//! request whose line says how long it ran holds a lease on its concurrency limits until
//! then (given back at that instant, before any later arrival is decided), and one whose line
//! says what it `used` of its cost is a reservation, settled then (`POST /v1/settle`). Several
//! policies are fed each line in one pass, so a trace on standard input can be compared
//! against all of them.
//!
//! The trace format is in `trace.rs`; the counting in `tally.rs`; the text and JSON report in
//! `report.rs`; the SVG plot in `plot.rs`.

mod plot;
mod report;
mod tally;
mod trace;

use std::borrow::Cow;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fs::File;
use std::io::{self, BufRead, BufReader};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use tollgate::{ManualClock, Timestamp};
use tollgate_policy::{EngineOptions, ManualWallClock, PolicyEngine, UnixTime};

use crate::decider::Request;
use crate::http::leases::lease_id_of;
use crate::loadgen::args::parse_duration;
use report::{BadLine, PolicyReport, Report, TraceSummary};
use tally::Tally;

/// How many skipped lines the report quotes.
const QUOTED_BAD_LINES: usize = 5;

/// A trace line longer than this is not a request (the HTTP API takes at most 64 KiB).
const MAX_LINE_BYTES: usize = crate::http::MAX_BODY_BYTES;

/// Requests between two sweeps of each engine's idle buckets.
const SWEEP_EVERY: u64 = 1 << 16;

const DAY_NS: i64 = 86_400 * 1_000_000_000;

/// `tollgate simulate` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct SimulateArgs {
    /// The trace: one JSON request per line, the body `POST /v1/check` takes plus `time` (an
    /// RFC 3339 instant or Unix milliseconds), such as
    /// {"time":"2026-11-29T10:00:00.250Z","domain":"api","descriptors":[{"user":"u1"}]},
    /// and optionally `duration_ms`, how long it was in flight (for concurrency limits);
    /// `-` reads standard input.
    pub trace: PathBuf,
    /// A policy file or directory; repeat it to compare several on the same trace (the first
    /// is the baseline).
    #[arg(long, required = true, value_name = "PATH")]
    pub config: Vec<PathBuf>,
    /// Length of the timeline's intervals: `500ms`, `10s`, `1m`, `1h`, `1d`.
    #[arg(long, default_value = "1m", value_parser = parse_interval)]
    pub interval: Duration,
    /// How many of each limit's most rejected keys to show.
    #[arg(long, default_value_t = 5)]
    pub top: usize,
    /// Print the report as JSON (with the whole timeline) instead of text.
    #[arg(long)]
    pub json: bool,
    /// Also write an SVG plot of requests and rejections over time to FILE.
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
    /// How long a charge can be settled, as `tollgate serve --idempotency-window`: a
    /// reservation (a line with `used`) that ends later keeps its whole cost.
    #[arg(long, default_value = "60s", value_parser = parse_window)]
    pub idempotency_window: Duration,
    /// The share of a limit an allowed decision must leave spent to count as near the limit,
    /// as `tollgate serve --near-limit-ratio`: how close the traffic runs to a limit that
    /// rejects nothing yet.
    #[arg(long, default_value = "0.8", value_parser = crate::cli::parse_ratio)]
    pub near_limit_ratio: u32,
}

fn parse_window(text: &str) -> Result<Duration, String> {
    match parse_duration(text)? {
        Duration::ZERO => Err("the window must be longer than 0".to_owned()),
        window => Ok(window),
    }
}

/// An interval of the timeline: a whole number of milliseconds (the only durations
/// `parse_duration` reads), and not 0.
fn parse_interval(text: &str) -> Result<Duration, String> {
    match parse_duration(text)? {
        Duration::ZERO => Err(format!("{text}: an interval is at least 1ms")),
        interval => Ok(interval),
    }
}

/// Why a simulation could not run.
#[derive(Debug, thiserror::Error)]
pub enum SimulateError {
    /// A policy file could not be read or does not validate.
    #[error("{0}")]
    Policy(#[from] tollgate_policy::Error),
    /// The trace could not be read.
    #[error("cannot read the trace {source_name}: {error}")]
    Trace {
        /// The trace's name.
        source_name: String,
        /// What failed.
        error: io::Error,
    },
    /// The plot could not be written.
    #[error("cannot write the plot {path}: {error}")]
    Plot {
        /// Where it was to go.
        path: String,
        /// What failed.
        error: io::Error,
    },
    /// The trace held no request at all.
    #[error("{0} holds no request: see `tollgate simulate --help` for the line format")]
    Empty(String),
}

/// One policy under simulation.
struct Simulation {
    file: String,
    engine: PolicyEngine,
    clock: ManualClock,
    wall: ManualWallClock,
    tally: Tally,
    /// Leases held, by the instant their request ends (nanoseconds since the epoch), and their
    /// ids, soonest first.
    held: BinaryHeap<Reverse<(u64, String)>>,
    leases_taken: u64,
    /// Reservations to settle, by the instant their request ends, soonest first (then in the
    /// order they came).
    settling: BinaryHeap<Reverse<(u64, u64, Reservation)>>,
    reservations: u64,
}

/// A reservation allowed and not yet settled: the request as it was checked, and what it used.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Reservation {
    /// Its end on the calendar (Unix nanoseconds), for the wall clock at the settlement.
    wall: i64,
    domain: String,
    descriptors: Vec<Vec<(String, String)>>,
    cost: u64,
    used: u64,
    request_id: String,
}

impl Simulation {
    /// Ends every request that ended by `now`, each at its own instant and in the order they
    /// ended (a lease before a settlement at the same instant): gives its lease back and
    /// settles its reservation, so that a request arriving at `now` finds the slots and the
    /// buckets as a server would have.
    fn release_until(&mut self, now: u64) {
        loop {
            let lease = self.held.peek().map(|Reverse((end, _))| *end);
            let settle = self.settling.peek().map(|Reverse((end, ..))| *end);
            match (lease, settle) {
                (Some(lease), settle) if lease <= now && settle.is_none_or(|s| lease <= s) => {
                    let Some(Reverse((end, id))) = self.held.pop() else {
                        break;
                    };
                    self.clock.set(Timestamp::from_nanos(end));
                    if let Ok(false) = self.engine.release(&id) {
                        self.tally.lease_timed_out();
                    }
                }
                (_, Some(settle)) if settle <= now => {
                    let Some(Reverse((end, _, reservation))) = self.settling.pop() else {
                        break;
                    };
                    self.settle(end, &reservation);
                }
                _ => break,
            }
        }
    }

    /// Settles every reservation still open, at its end: the trace is over.
    fn settle_all(&mut self) {
        while let Some(Reverse((end, _, reservation))) = self.settling.pop() {
            self.settle(end, &reservation);
        }
    }

    fn settle(&mut self, end: u64, reservation: &Reservation) {
        self.clock.set(Timestamp::from_nanos(end));
        self.wall.set(UnixTime::from_nanos(reservation.wall));
        let settled = self.engine.settle(
            &reservation.domain,
            &reservation.descriptors,
            reservation.cost,
            reservation.used,
            &reservation.request_id,
        );
        match settled.map(|outcome| outcome.settled) {
            Ok(Some(tollgate::SettleStatus::Settled)) => {
                let buckets = self.buckets_of(reservation);
                let given = (reservation.cost - reservation.used).saturating_mul(buckets);
                self.tally.settlement(Some(given));
            }
            // A retried line's reservation, settled with the first.
            Ok(Some(tollgate::SettleStatus::Repeated)) => {}
            _ => self.tally.settlement(None),
        }
    }

    /// How many buckets a reservation was charged on: the limits that applied to it, less
    /// the exempt ones (as `/v1/explain` would list them now).
    fn buckets_of(&self, reservation: &Reservation) -> u64 {
        self.engine
            .explain(
                &reservation.domain,
                &reservation.descriptors,
                reservation.cost,
            )
            .map_or(0, |outcome| {
                outcome
                    .limits
                    .iter()
                    // Exempt limits are not decided, so hold no decision.
                    .filter(|limit| limit.decision.is_some())
                    .count() as u64
            })
    }

    /// Decides one request at `now` (since the epoch), `at` on the calendar: its rate limits,
    /// then, if they let it through and the trace says how long it ran, a lease on its
    /// concurrency limits until its end.
    fn decide(
        &mut self,
        line: u64,
        now: u64,
        at: UnixTime,
        request: &Request<'_, Vec<(Cow<'_, str>, Cow<'_, str>)>>,
        duration: Option<Duration>,
        reservation: Option<(u64, u64)>,
    ) {
        self.release_until(now);
        self.clock.set(Timestamp::from_nanos(now));
        self.wall.set(at);
        // A reservation needs a request id to be settled by: the line's, or one of its own.
        // Its number also orders settlements that end at the same instant.
        self.reservations += u64::from(reservation.is_some());
        let own_id;
        let request_id = match (reservation, request.request_id) {
            (Some(_), None) => {
                own_id = format!("sim-reservation-{}", self.reservations);
                Some(own_id.as_str())
            }
            (_, id) => id,
        };
        let outcome = match self.engine.decide(
            request.domain,
            request.descriptors,
            request.cost,
            request_id,
        ) {
            Ok(outcome) => outcome,
            Err(err) => return self.tally.refuse(line, err.to_string()),
        };
        if let (Some((cost, used)), Some(request_id), true) =
            (reservation, request_id, outcome.allowed)
            && used < cost
        {
            let nanos = duration.map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
            let reservation = Reservation {
                wall: at
                    .as_nanos()
                    .saturating_add(i64::try_from(nanos).unwrap_or(i64::MAX)),
                domain: request.domain.to_owned(),
                descriptors: request
                    .descriptors
                    .iter()
                    .map(|d| {
                        d.iter()
                            .map(|(k, v)| (k.to_string(), v.to_string()))
                            .collect()
                    })
                    .collect(),
                cost,
                used,
                request_id: request_id.to_owned(),
            };
            self.settling.push(Reverse((
                now.saturating_add(nanos),
                self.reservations,
                reservation,
            )));
        }
        let Some(duration) = duration.filter(|_| outcome.allowed) else {
            return self.tally.record(at, &outcome, None);
        };
        self.leases_taken += 1;
        let number = self.leases_taken;
        // As the server does: a request id names the lease, so that a retry finds it held.
        let id = match request.request_id {
            Some(request_id) => lease_id_of(request.domain, request_id),
            None => format!("sim-{number}"),
        };
        match self
            .engine
            .acquire(request.domain, request.descriptors, &id)
        {
            Ok(lease) => {
                if lease.held {
                    let nanos = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
                    self.held.push(Reverse((now.saturating_add(nanos), id)));
                }
                self.tally.record(at, &outcome, Some(&lease));
            }
            // A retry of a request whose lease is held: answered with that lease, as the
            // server answers it, taking no second slot.
            Err(tollgate_policy::Error::Check {
                source: tollgate::Error::LeaseIdInUse,
                ..
            }) if request.request_id.is_some() => self.tally.record(at, &outcome, None),
            Err(err) => self.tally.refuse(line, err.to_string()),
        }
    }
}

/// A replay in progress: feed it lines, then ask for the report.
pub struct Simulator {
    policies: Vec<Simulation>,
    top: usize,
    lines: u64,
    requests: u64,
    skipped: u64,
    first_skipped: Vec<BadLine>,
    out_of_order: u64,
    /// Requests whose line says how long they were in flight.
    with_duration: u64,
    /// Requests whose line says what they used of their cost.
    with_used: u64,
    first: Option<UnixTime>,
    latest: Option<UnixTime>,
    /// The engines' clock epoch: the midnight UTC before the first request.
    epoch: i64,
}

impl Simulator {
    /// A simulator of the policy files `configs`, with a timeline in `interval`s, the `top`
    /// most rejected keys of each limit, and decisions near a limit counted past
    /// `near_limit_permille` thousandths of it spent.
    ///
    /// # Errors
    ///
    /// The first policy file that cannot be read or does not validate.
    pub fn new(
        configs: &[PathBuf],
        interval: Duration,
        top: usize,
        idempotency_window: Duration,
        near_limit_permille: u32,
    ) -> Result<Self, SimulateError> {
        let mut policies = Vec::with_capacity(configs.len());
        for path in configs {
            let clock = ManualClock::new();
            let wall = ManualWallClock::new(UnixTime::from_nanos(0));
            let options = EngineOptions::default()
                .clock(Arc::new(clock.clone()))
                .wall_clock(Arc::new(wall.clone()))
                .idempotency_window(idempotency_window);
            let engine = PolicyEngine::from_file(path, options)?;
            let tally = Tally::new(&engine.current(), interval, near_limit_permille);
            policies.push(Simulation {
                file: path.display().to_string(),
                engine,
                clock,
                wall,
                tally,
                held: BinaryHeap::new(),
                leases_taken: 0,
                settling: BinaryHeap::new(),
                reservations: 0,
            });
        }
        Ok(Self {
            policies,
            top,
            lines: 0,
            requests: 0,
            skipped: 0,
            first_skipped: Vec::new(),
            out_of_order: 0,
            with_duration: 0,
            with_used: 0,
            first: None,
            latest: None,
            epoch: 0,
        })
    }

    /// Replays one line of the trace (its newline may be left on).
    pub fn feed(&mut self, line: &[u8]) {
        self.lines += 1;
        let number = self.lines;
        let line = line.strip_suffix(b"\n").unwrap_or(line);
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.iter().all(u8::is_ascii_whitespace) {
            return;
        }
        if line.len() > MAX_LINE_BYTES {
            let why = format!(
                "{} bytes long; a request is at most {MAX_LINE_BYTES}",
                line.len()
            );
            return self.skip(number, why);
        }
        let Ok(text) = std::str::from_utf8(line) else {
            return self.skip(number, "not UTF-8".to_owned());
        };
        let parsed = match trace::parse_line(text) {
            Ok(parsed) => parsed,
            Err(err) => return self.skip(number, err.message().to_owned()),
        };
        let at = self.arrive(parsed.at);
        // The engines' clocks count from the epoch; `at` is never before it (see `arrive`).
        let since_epoch = u64::try_from(at.as_nanos() - self.epoch).unwrap_or(0);
        let request = parsed.request.request();
        self.requests += 1;
        self.with_duration += u64::from(parsed.duration.is_some());
        self.with_used += u64::from(parsed.used.is_some());
        let reservation = parsed.used.map(|used| (parsed.request.cost, used));
        for policy in &mut self.policies {
            policy.decide(
                number,
                since_epoch,
                at,
                &request,
                parsed.duration,
                reservation,
            );
            if self.requests.is_multiple_of(SWEEP_EVERY) {
                policy.engine.sweep();
            }
        }
    }

    /// The instant a request arriving at `at` is decided at: `at`, or the latest instant seen
    /// when it came out of order (time in a replay never goes back, as in a server).
    fn arrive(&mut self, at: UnixTime) -> UnixTime {
        let Some(latest) = self.latest else {
            self.first = Some(at);
            self.latest = Some(at);
            self.epoch = at.as_nanos() - at.as_nanos().rem_euclid(DAY_NS);
            return at;
        };
        if at < latest {
            self.out_of_order += 1;
            return latest;
        }
        self.latest = Some(at);
        at
    }

    fn skip(&mut self, line: u64, error: String) {
        self.skipped += 1;
        if self.first_skipped.len() < QUOTED_BAD_LINES {
            self.first_skipped.push(BadLine { line, error });
        }
    }

    /// Ends the replay: settles the reservations still open, each at its end (no later
    /// request can see them, but the report counts them).
    pub fn finish(&mut self) {
        for policy in &mut self.policies {
            policy.settle_all();
        }
    }

    /// Requests replayed so far.
    pub fn requests(&self) -> u64 {
        self.requests
    }

    /// The report so far, naming the trace `source`.
    pub(crate) fn report(&self, source: &str) -> Report {
        let interval = self
            .policies
            .first()
            .map_or(Duration::from_secs(60), |p| p.tally.interval());
        Report {
            trace: TraceSummary {
                source: source.to_owned(),
                lines: self.lines,
                requests: self.requests,
                skipped: self.skipped,
                first_skipped: self.first_skipped.clone(),
                out_of_order: self.out_of_order,
                with_duration: self.with_duration,
                with_used: self.with_used,
                first: self.first.map(UnixTime::to_rfc3339),
                last: self.latest.map(UnixTime::to_rfc3339),
                interval_ms: u64::try_from(interval.as_millis()).unwrap_or(u64::MAX),
            },
            policies: self
                .policies
                .iter()
                .map(|p| {
                    PolicyReport::new(
                        p.file.clone(),
                        p.engine.current().version().to_owned(),
                        &p.tally,
                        self.top,
                    )
                })
                .collect(),
        }
    }

    /// The SVG plot of the timeline so far.
    pub fn plot(&self) -> String {
        let series: Vec<plot::Series<'_>> = self
            .policies
            .iter()
            .map(|p| plot::Series {
                label: &p.file,
                timeline: &p.tally.timeline,
            })
            .collect();
        let interval = self
            .policies
            .first()
            .map_or(Duration::from_secs(60), |p| p.tally.interval());
        plot::svg(&series, interval)
    }
}

/// `tollgate simulate`: replays the trace, prints the report on stdout, writes the plot.
///
/// # Errors
///
/// A policy that does not load, a trace that cannot be read or holds no request, a plot that
/// cannot be written.
pub fn main(args: &SimulateArgs) -> Result<(), SimulateError> {
    let mut simulator = Simulator::new(
        &args.config,
        args.interval,
        args.top,
        args.idempotency_window,
        args.near_limit_ratio,
    )?;
    let source = args.trace.display().to_string();
    let trace_error = |error| SimulateError::Trace {
        source_name: source.clone(),
        error,
    };
    let (mut reader, length): (Box<dyn BufRead>, Option<u64>) = if source == "-" {
        (Box::new(io::stdin().lock()), None)
    } else {
        let file = File::open(&args.trace).map_err(trace_error)?;
        let length = file.metadata().ok().map(|m| m.len());
        (Box::new(BufReader::with_capacity(1 << 16, file)), length)
    };
    let progress = progress_bar(length, crate::progress::shown(args.json));
    let mut line = Vec::with_capacity(1024);
    loop {
        line.clear();
        let read = reader.read_until(b'\n', &mut line).map_err(trace_error)?;
        if read == 0 {
            break;
        }
        simulator.feed(&line);
        progress.inc(read as u64);
    }
    progress.finish_and_clear();
    simulator.finish();
    if simulator.requests() == 0 {
        return Err(SimulateError::Empty(source));
    }
    let report = simulator.report(&source);
    if let Some(path) = &args.plot {
        std::fs::write(path, simulator.plot()).map_err(|error| SimulateError::Plot {
            path: path.display().to_string(),
            error,
        })?;
    }
    if args.json {
        match serde_json::to_string_pretty(&report) {
            Ok(json) => println!("{json}"),
            Err(err) => eprintln!("error: cannot write the report as JSON: {err}"),
        }
    } else {
        print!("{}", report.text());
    }
    Ok(())
}

/// Bytes of the trace read (of `length`, when the trace is a file), or a hidden bar when it is
/// not `shown`.
fn progress_bar(length: Option<u64>, shown: bool) -> ProgressBar {
    if !shown {
        return ProgressBar::hidden();
    }
    match length {
        Some(length) => {
            let style = ProgressStyle::with_template(
                "{bar:40} {bytes}/{total_bytes} of the trace  {bytes_per_sec}  eta {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar());
            ProgressBar::new(length).with_style(style)
        }
        None => {
            let style = ProgressStyle::with_template("{spinner} {bytes} of the trace read")
                .unwrap_or_else(|_| ProgressStyle::default_spinner());
            ProgressBar::new_spinner().with_style(style)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hidden_progress_bar_is_hidden_and_a_shown_one_as_long_as_the_trace() {
        let hidden = progress_bar(Some(1000), false);
        assert!(hidden.is_hidden());
        assert_eq!(hidden.length(), None);
        assert_eq!(progress_bar(Some(1000), true).length(), Some(1000));
        // A trace from a pipe has no length: a spinner counts the bytes.
        assert_eq!(progress_bar(None, true).length(), None);
    }

    /// A simulator of a one-limit policy written to a scratch file (removed on drop).
    struct Scratch(PathBuf);

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn simulator(name: &str) -> (Simulator, Scratch) {
        let path = std::env::temp_dir().join(format!(
            "tollgate-simulate-{}-{name}.yaml",
            std::process::id()
        ));
        let policy = "version: t\nlimits:\n  - name: per-user\n    domain: api\n    key: [user]\n    capacity: 2\n    refill: 1/h\n";
        std::fs::write(&path, policy).unwrap();
        let simulator = Simulator::new(
            std::slice::from_ref(&path),
            Duration::from_secs(60),
            3,
            Duration::from_secs(60),
            800,
        );
        (simulator.unwrap(), Scratch(path))
    }

    const LINE: &str =
        r#"{"time":"2026-11-29T10:00:00Z","domain":"api","descriptors":[{"user":"u1"}]}"#;

    #[test]
    fn line_endings_and_blank_lines_are_not_requests_nor_errors() {
        let (mut simulator, _scratch) = simulator("endings");
        simulator.feed(format!("{LINE}\r\n").as_bytes());
        simulator.feed(b"\n");
        simulator.feed(b"   \r\n");
        simulator.feed(LINE.as_bytes());
        let report = simulator.report("t");
        assert_eq!(report.trace.lines, 4);
        assert_eq!(report.trace.requests, 2);
        assert_eq!(report.trace.skipped, 0);
        assert_eq!(report.policies[0].counts.allowed, 2);
    }

    #[test]
    fn bytes_that_are_not_a_request_are_skipped_and_decide_nothing() {
        let (mut simulator, _scratch) = simulator("bytes");
        simulator.feed(b"{\"time\":0,\xff}\n");
        let long = format!(
            r#"{{"time":0,"domain":"api","descriptors":[{{"user":"u1"}}],"request_id":"{}"}}"#,
            "r".repeat(MAX_LINE_BYTES)
        );
        simulator.feed(long.as_bytes());
        for _ in 0..QUOTED_BAD_LINES + 2 {
            simulator.feed(b"[]");
        }
        let report = simulator.report("t");
        assert_eq!(report.trace.requests, 0);
        assert_eq!(report.trace.skipped, 2 + QUOTED_BAD_LINES as u64 + 2);
        let quoted = &report.trace.first_skipped;
        assert_eq!(
            quoted.len(),
            QUOTED_BAD_LINES,
            "only the first few are quoted"
        );
        assert_eq!((quoted[0].line, quoted[0].error.as_str()), (1, "not UTF-8"));
        assert_eq!(quoted[1].line, 2);
        assert!(
            quoted[1].error.contains("bytes long"),
            "{}",
            quoted[1].error
        );
        assert_eq!(report.policies[0].counts.requests, 0);
        // Nothing was charged: a request now finds the bucket full.
        simulator.feed(LINE.as_bytes());
        simulator.feed(LINE.as_bytes());
        simulator.feed(LINE.as_bytes());
        let report = simulator.report("t");
        assert_eq!(report.policies[0].counts.allowed, 2);
        assert_eq!(report.policies[0].counts.rejected, 1);
    }

    #[test]
    fn a_line_as_long_as_the_bound_is_a_request() {
        let (mut simulator, _scratch) = simulator("bound");
        let padded = |len: usize| {
            let mut line = LINE.trim_end_matches('}').to_owned();
            line.push_str(&" ".repeat(len - line.len() - 1));
            line + "}\r\n"
        };
        simulator.feed(padded(MAX_LINE_BYTES).as_bytes());
        simulator.feed(padded(MAX_LINE_BYTES + 1).as_bytes());
        let report = simulator.report("t");
        assert_eq!((report.trace.requests, report.trace.skipped), (1, 1));
        assert!(
            report.trace.first_skipped[0]
                .error
                .contains("65537 bytes long")
        );
    }

    #[test]
    fn intervals_are_whole_milliseconds_and_not_zero() {
        for (text, interval) in [
            ("1ms", 1),
            ("250ms", 250),
            ("1500ms", 1500),
            ("2m", 120_000),
        ] {
            assert_eq!(parse_interval(text), Ok(Duration::from_millis(interval)));
        }
        for (text, why) in [
            ("0ms", "at least 1ms"),
            ("0d", "at least 1ms"),
            ("1.5s", "unknown unit"),
            ("ms", "not a duration"),
            ("999us", "unknown unit"),
        ] {
            let refused = parse_interval(text).unwrap_err();
            assert!(refused.contains(why), "{text}: {refused}");
        }
    }
}
