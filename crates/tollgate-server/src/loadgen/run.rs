//! One `tollgate bench` run: connect every worker, send until the duration or count is reached,
//! and merge what the workers saw.
//!
//! Workers keep their own counts and histogram and share only two relaxed counters (requests
//! claimed, for `--requests`; requests done, for the progress bar), so the generator adds no
//! lock to the path it measures.
//!
//! In open loop (`--rate`) a pacer releases tickets, one per scheduled send time, and the next
//! free worker takes each. The pacer sleeps on a high-resolution timer: tokio's timer wheel has
//! a 1 ms tick, so workers sleeping on it would wake together and send each millisecond's
//! requests as one burst, which the server would queue and the latencies would show. On Linux
//! the pacer is a task woken by a `timerfd` the runtime's reactor watches (`timer.rs`); elsewhere
//! it is a thread sleeping on the operating system's timer, whose every wake-up then wakes the
//! runtime too. It wakes at most every [`PACER_TICK`] and then releases every ticket due at
//! once: waking the runtime once per ticket cost the generator as much CPU per request as the
//! server spends deciding it, on the cores the two share. Workers also release the tickets due
//! whenever they finish a request, and take one themselves without waking anyone: on a busy
//! machine the pacer can wait milliseconds for a CPU while the workers, woken by every answer,
//! keep the schedule. A request's latency counts from its ticket's time, so neither a late
//! generator nor a server that falls behind can hide a queue (no coordinated omission), and the
//! summary reports the lateness, and the latency from the send, on their own.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::Verdict;
use super::args::{BenchArgs, Plan, Stop, Target};
use super::grpc::GrpcClient;
use super::http::HttpClient;
use super::keys::{KeyPicker, zipf_cdf};
use super::report::Summary;
use super::shared::SharedConnection;

/// The longest latency the histogram holds, in nanoseconds (longer ones count as this).
pub(super) const MAX_LATENCY_NS: u64 = 3_600_000_000_000;
/// How long a closed-loop worker waits after an error, so a dead target is not hammered.
const ERROR_PAUSE: Duration = Duration::from_millis(10);
/// How often the progress bar is redrawn.
const PROGRESS_TICK: Duration = Duration::from_millis(200);
/// Open-loop tickets the pacer may release ahead of the workers taking them. When the server
/// falls further behind, the pacer waits; the tickets keep their scheduled times.
const MAX_PENDING_TICKETS: usize = 65_536;
/// The pacer's shortest sleep: below it, waking for each ticket costs more than it measures.
const PACER_TICK: Duration = Duration::from_micros(100);

/// Open loop: the run's schedule (ticket `k` is due at `start + k * interval`), how many
/// tickets have been released (are due) and how many the workers have taken.
///
/// A worker that finishes a request releases what is due and takes a ticket itself, without
/// waking anyone: under load most tickets go that way, and the generator costs about what it
/// does in closed loop. Only workers that found nothing to take wait, and each ticket released
/// beyond the one its releaser takes wakes one of them.
struct Tickets {
    start: Instant,
    interval_ns: u128,
    /// Tickets in the whole run.
    total: u64,
    /// Tickets released so far, by the pacer or a worker: tickets `0..released` are due.
    released: AtomicU64,
    /// Tickets taken so far: tickets `0..taken` are sent or being sent. Never above `released`.
    taken: AtomicU64,
    /// Wakes a worker waiting for a ticket.
    wake: Notify,
    /// Set when the run ends: waiting workers stop, the pacer too.
    closed: AtomicBool,
}

impl Tickets {
    fn new(start: Instant, interval: Duration, stop: Stop) -> Self {
        let interval_ns = interval.as_nanos().max(1);
        let total = match stop {
            Stop::Count(count) => count,
            // Tickets 0, 1, ... while `k * interval < duration`.
            Stop::After(duration) => {
                u64::try_from(duration.as_nanos().div_ceil(interval_ns)).unwrap_or(u64::MAX)
            }
        };
        Self {
            start,
            interval_ns,
            total,
            released: AtomicU64::new(0),
            taken: AtomicU64::new(0),
            wake: Notify::new(),
            closed: AtomicBool::new(false),
        }
    }

    /// When ticket `k` is due.
    fn due(&self, k: u64) -> Instant {
        let offset = u64::try_from(u128::from(k) * self.interval_ns).unwrap_or(u64::MAX);
        self.start + Duration::from_nanos(offset)
    }

    /// How many tickets are due by `now`.
    fn due_by(&self, now: Instant) -> u64 {
        let elapsed = now.saturating_duration_since(self.start).as_nanos();
        u64::try_from(elapsed / self.interval_ns + 1)
            .unwrap_or(u64::MAX)
            .min(self.total)
    }

    /// Tickets released and not yet taken.
    fn pending(&self) -> u64 {
        let taken = self.taken.load(Ordering::Acquire);
        self.released.load(Ordering::Acquire).saturating_sub(taken)
    }

    /// Releases every ticket due by `now` and not released yet, keeping at most
    /// [`MAX_PENDING_TICKETS`] untaken, and returns `(released in all, released by this call)`.
    /// The pacer and the workers may call it at once: each ticket is released exactly once.
    fn release_due(&self, now: Instant) -> (u64, u64) {
        let due = self.due_by(now);
        let mut released = self.released.load(Ordering::Acquire);
        let mut by_me = 0;
        while due > released {
            let room = (MAX_PENDING_TICKETS as u64).saturating_sub(self.pending());
            if room == 0 {
                break;
            }
            let upto = due.min(released.saturating_add(room));
            match self.released.compare_exchange_weak(
                released,
                upto,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    by_me += upto - released;
                    released = upto;
                }
                Err(current) => released = current,
            }
        }
        (released, by_me)
    }

    /// Wakes `count` waiting workers (fewer if fewer wait: a worker checks for tickets before
    /// it waits, so none is left waiting beside an untaken ticket).
    fn wake(&self, count: u64) {
        for _ in 0..count.min(MAX_PENDING_TICKETS as u64) {
            self.wake.notify_one();
        }
    }

    /// Takes a released ticket, if there is one.
    fn try_take(&self) -> Option<u64> {
        let mut taken = self.taken.load(Ordering::Acquire);
        loop {
            if taken >= self.released.load(Ordering::Acquire) {
                return None;
            }
            match self.taken.compare_exchange_weak(
                taken,
                taken + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    if taken + 1 == self.total {
                        // The last one: whoever still waits has nothing left to wait for.
                        self.wake.notify_waiters();
                    }
                    return Some(taken);
                }
                Err(current) => taken = current,
            }
        }
    }

    /// Whether no ticket will be taken any more: all are, or the run ended.
    fn finished(&self) -> bool {
        self.closed.load(Ordering::Acquire) || self.taken.load(Ordering::Acquire) >= self.total
    }

    /// Ends the run: waiting workers stop, and so does the pacer.
    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.wake.notify_waiters();
    }

    /// One step of the pacer at `now`: releases the tickets due and wakes a waiting worker for
    /// each, then returns how long to sleep before the next step, at least [`PACER_TICK`].
    /// `None` once the pacer has nothing left to do: every ticket released, or the run closed
    /// (by the run once its workers are done: nobody takes tickets any more).
    fn pacer_step(&self, now: Instant) -> Option<Duration> {
        if self.closed.load(Ordering::Acquire) {
            return None;
        }
        let (released, by_me) = self.release_due(now);
        self.wake(by_me);
        if released >= self.total {
            return None;
        }
        // The next ticket's time; if it is already due, the pending tickets are at their bound
        // and the pacer waits for workers to take some.
        let next = self.due(released);
        Some(next.saturating_duration_since(now).max(PACER_TICK))
    }

    /// Takes a released ticket, waiting for one if need be, and returns its due time; `None`
    /// once the run's tickets are all taken or the run ended.
    async fn next(&self) -> Option<Instant> {
        loop {
            if let Some(k) = self.try_take() {
                return Some(self.due(k));
            }
            if self.finished() {
                return None;
            }
            let notified = self.wake.notified();
            let mut notified = std::pin::pin!(notified);
            // Registered before looking again, so a ticket released in between wakes it.
            notified.as_mut().enable();
            if let Some(k) = self.try_take() {
                return Some(self.due(k));
            }
            if self.finished() {
                return None;
            }
            notified.await;
        }
    }
}

/// Why a run could not start or finish.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// A flag is wrong; the message names it.
    #[error("{0}")]
    Args(String),
    /// The target could not be reached before the run started.
    #[error("{0}")]
    Connect(String),
    /// The generator itself failed.
    #[error("load generator: {0}")]
    Internal(String),
}

/// A worker's connection, whichever the API.
enum Client {
    Http(HttpClient),
    Grpc(GrpcClient),
}

impl Client {
    async fn connect(&mut self) -> Result<(), String> {
        match self {
            Self::Http(client) => client.connect().await,
            Self::Grpc(client) => client.connect().await,
        }
    }

    fn reset(&mut self) {
        match self {
            Self::Http(client) => client.reset(),
            Self::Grpc(client) => client.reset(),
        }
    }

    async fn send(&mut self, key: u64) -> Result<Verdict, String> {
        match self {
            Self::Http(client) => client.send(key).await,
            Self::Grpc(client) => client.send(key).await,
        }
    }
}

/// What one worker saw.
pub(crate) struct Tally {
    pub(crate) allowed: u64,
    pub(crate) rejected: u64,
    pub(crate) errors: u64,
    pub(crate) first_error: Option<String>,
    /// Latencies of the requests that got a decision, in nanoseconds.
    pub(crate) latency: Histogram<u64>,
    /// Open loop: how late each request left after its scheduled time, in nanoseconds.
    pub(crate) lag: Histogram<u64>,
    /// Open loop: the latencies counted from the send instead of the schedule.
    pub(crate) service: Histogram<u64>,
}

/// The counters workers share with each other and the progress bar.
#[derive(Default)]
struct Shared {
    claimed: AtomicU64,
    done: AtomicU64,
}

/// Runs the load `args` describe and returns what it measured. The progress bar goes to stderr
/// when stderr is a terminal and `--json` is off.
///
/// # Errors
///
/// [`BenchError::Args`] for bad flags, [`BenchError::Connect`] when a worker cannot connect
/// before the start. Failures during the run are counted as errors in the [`Summary`].
pub async fn run(args: &BenchArgs) -> Result<Summary, BenchError> {
    let plan = Arc::new(args.plan().map_err(BenchError::Args)?);
    let histogram = Histogram::<u64>::new_with_bounds(1, MAX_LATENCY_NS, 3)
        .map_err(|err| BenchError::Internal(err.to_string()))?;
    let cdf = match plan.distribution {
        super::Distribution::Uniform => None,
        super::Distribution::Zipf => Some(zipf_cdf(plan.keys)),
    };

    let connections: Vec<Arc<SharedConnection>> =
        (0..plan.connections).map(|_| Arc::default()).collect();
    let mut clients = Vec::with_capacity(plan.concurrency);
    for worker in 0..plan.concurrency {
        // Shared over gRPC and HTTP/2; over HTTP/1.1 there are as many as workers, unused.
        let connection = Arc::clone(&connections[worker % connections.len()]);
        let mut client = match &plan.target {
            Target::Http { authority, path } => Client::Http(
                HttpClient::new(&plan, authority, path, connection).map_err(BenchError::Args)?,
            ),
            Target::ForwardAuth { authority, path } => Client::Http(
                HttpClient::forward_auth(&plan, authority, path, connection)
                    .map_err(BenchError::Args)?,
            ),
            Target::Grpc { authority } => Client::Grpc(
                GrpcClient::new(&plan, authority, connection).map_err(BenchError::Args)?,
            ),
        };
        client.connect().await.map_err(BenchError::Connect)?;
        clients.push(client);
    }

    let shared = Arc::new(Shared::default());
    let progress = progress_bar(&plan, crate::progress::shown(args.json));
    let start = Instant::now();
    let deadline = match plan.stop {
        Stop::After(duration) => Some(start + duration),
        Stop::Count(_) => None,
    };
    let tickets: Option<Arc<Tickets>> = plan.interval.map(|interval| {
        let tickets = Arc::new(Tickets::new(start, interval, plan.stop));
        start_pacer(Arc::clone(&tickets));
        tickets
    });
    let mut workers = JoinSet::new();
    for (id, client) in clients.into_iter().enumerate() {
        // Distinct, reproducible key sequences per worker.
        let seed = plan
            .seed
            .wrapping_add((id as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let picker = KeyPicker::new(plan.distribution, plan.keys, seed, cdf.clone());
        workers.spawn(worker(
            Arc::clone(&plan),
            client,
            picker,
            histogram.clone(),
            Arc::clone(&shared),
            tickets.clone(),
            deadline,
        ));
    }

    let ticker = tokio::spawn(tick(
        progress.clone(),
        Arc::clone(&shared),
        plan.stop,
        start,
    ));
    let mut tallies = Vec::with_capacity(plan.concurrency);
    while let Some(joined) = workers.join_next().await {
        tallies.push(joined.map_err(|err| BenchError::Internal(err.to_string()))?);
    }
    let elapsed = start.elapsed();
    ticker.abort();
    if let Some(tickets) = &tickets {
        tickets.close();
    }
    progress.finish_and_clear();
    Ok(Summary::new(args, &plan, elapsed, tallies, histogram))
}

/// Starts releasing `tickets` at their times: on Linux in a task of the runtime, on a timer
/// its reactor watches (`timer.rs`); elsewhere, or when no such timer can be made, on a thread
/// of its own.
fn start_pacer(tickets: Arc<Tickets>) {
    #[cfg(target_os = "linux")]
    match super::timer::Timer::new() {
        Ok(timer) => {
            tokio::spawn(pace_on_timer(timer, tickets));
            return;
        }
        Err(err) => tracing::debug!(error = %err, "no timerfd: the pacer runs on a thread"),
    }
    std::thread::spawn(move || pace(&tickets));
}

/// As [`pace`], inside the runtime, sleeping on `timer`. Should the timer fail, a pacer thread
/// takes over: workers with nothing to send wait for the pacer's wake-ups.
#[cfg(target_os = "linux")]
async fn pace_on_timer(timer: super::timer::Timer, tickets: Arc<Tickets>) {
    while let Some(wait) = tickets.pacer_step(Instant::now()) {
        if let Err(err) = timer.sleep(wait).await {
            tracing::warn!(error = %err, "the pacer's timer failed: pacing on a thread instead");
            std::thread::spawn(move || pace(&tickets));
            return;
        }
    }
}

/// Releases each ticket at its time, waking at most every [`PACER_TICK`] and a waiting worker
/// per ticket it released. Runs on a thread of its own, outside the runtime, on the operating
/// system's timer.
fn pace(tickets: &Tickets) {
    // Linux lets a sleep end up to 50 µs late by default, to batch wake-ups; every ticket would
    // leave that much later, and its latency show it. Best effort: a pacer that cannot ask for
    // precise wake-ups is still correct, only later.
    #[cfg(target_os = "linux")]
    let _ = rustix::thread::set_current_timer_slack(std::num::NonZeroU64::new(1));
    while let Some(wait) = tickets.pacer_step(Instant::now()) {
        // The generator's own thread, not the code under test: the clippy rule against
        // sleeping is for tests of the limiter.
        #[allow(clippy::disallowed_methods)]
        std::thread::sleep(wait);
    }
}

/// Sends requests until the run is over: back to back (closed loop), or one per ticket.
async fn worker(
    plan: Arc<Plan>,
    mut client: Client,
    mut picker: KeyPicker,
    latency: Histogram<u64>,
    shared: Arc<Shared>,
    tickets: Option<Arc<Tickets>>,
    deadline: Option<Instant>,
) -> Tally {
    let mut tally = Tally {
        allowed: 0,
        rejected: 0,
        errors: 0,
        first_error: None,
        lag: latency.clone(),
        service: latency.clone(),
        latency,
    };
    loop {
        let sent = match &tickets {
            // The pacer's tickets end the run; a worker past the deadline stops early.
            Some(tickets) => match tickets.next().await {
                Some(due) if deadline.is_none_or(|deadline| Instant::now() < deadline) => due,
                _ => break,
            },
            None => {
                let now = Instant::now();
                if deadline.is_some_and(|deadline| now >= deadline) {
                    break;
                }
                now
            }
        };
        if let Stop::Count(count) = plan.stop
            && shared.claimed.fetch_add(1, Ordering::Relaxed) >= count
        {
            break;
        }
        let key = picker.next();
        // In closed loop a request leaves as it is scheduled.
        let started = match tickets {
            Some(_) => Instant::now(),
            None => sent,
        };
        if tickets.is_some() {
            tally.lag.saturating_record(nanos(started - sent));
        }
        let result = tokio::time::timeout(plan.timeout, client.send(key)).await;
        let result = result.unwrap_or_else(|_| {
            client.reset();
            Err(format!("no answer within {:?} (--timeout)", plan.timeout))
        });
        let finished = Instant::now();
        match result {
            Ok(verdict) => {
                tally.latency.saturating_record(nanos(finished - sent));
                if tickets.is_some() {
                    tally.service.saturating_record(nanos(finished - started));
                }
                match verdict {
                    Verdict::Allowed => tally.allowed += 1,
                    Verdict::Rejected => tally.rejected += 1,
                }
            }
            Err(message) => {
                tally.errors += 1;
                tally.first_error.get_or_insert(message);
                if tickets.is_none() {
                    tokio::time::sleep(ERROR_PAUSE).await;
                }
            }
        }
        shared.done.fetch_add(1, Ordering::Relaxed);
        if let Some(tickets) = &tickets {
            // It takes one of them itself, next.
            let (_, by_me) = tickets.release_due(finished);
            tickets.wake(by_me.saturating_sub(1));
        }
    }
    tally
}

/// `duration` for a histogram of nanoseconds, which holds no zero.
fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// A progress bar on stderr, or a hidden one when it is not `shown`.
fn progress_bar(plan: &Plan, shown: bool) -> ProgressBar {
    if !shown {
        return ProgressBar::hidden();
    }
    let (len, template) = match plan.stop {
        Stop::Count(count) => (count, "{bar:40} {pos}/{len} requests  {msg}"),
        Stop::After(duration) => (
            u64::try_from(duration.as_millis()).unwrap_or(u64::MAX),
            "{bar:40} {elapsed_precise}  {msg}",
        ),
    };
    let style =
        ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar());
    ProgressBar::new(len).with_style(style)
}

/// Redraws the progress bar until aborted.
async fn tick(progress: ProgressBar, shared: Arc<Shared>, stop: Stop, start: Instant) {
    let mut ticks = tokio::time::interval(PROGRESS_TICK);
    let mut last = (start, 0u64);
    loop {
        ticks.tick().await;
        let now = Instant::now();
        let done = shared.done.load(Ordering::Relaxed);
        let position = match stop {
            Stop::Count(_) => done,
            Stop::After(_) => u64::try_from(now.duration_since(start).as_millis()).unwrap_or(0),
        };
        progress.set_position(position);
        let seconds = now.duration_since(last.0).as_secs_f64();
        if seconds > 0.0 {
            let rate = done.saturating_sub(last.1) as f64 / seconds;
            progress.set_message(format!("{done} sent, {rate:.0}/s"));
        }
        last = (now, done);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `count` tickets from now, `every` apart, shared as a run shares them.
    fn tickets_from_now(every: Duration, count: u64) -> Arc<Tickets> {
        Arc::new(Tickets::new(Instant::now(), every, Stop::Count(count)))
    }

    #[test]
    fn the_schedule_covers_the_run_and_nothing_after_it() {
        let start = Instant::now();
        let ms = Duration::from_millis(1);
        let count = Tickets::new(start, ms, Stop::Count(7));
        assert_eq!(count.total, 7);
        let timed = Tickets::new(start, ms, Stop::After(Duration::from_micros(10_500)));
        // Tickets at 0, 1, ..., 10 ms: all before the end at 10.5 ms.
        assert_eq!(timed.total, 11);
        assert_eq!(timed.due(10), start + 10 * ms);
        let exact = Tickets::new(start, ms, Stop::After(10 * ms));
        assert_eq!(exact.total, 10, "a ticket at the end itself is not sent");
    }

    #[test]
    fn tickets_fall_due_one_interval_apart_from_the_start() {
        let start = Instant::now();
        let ms = Duration::from_millis(1);
        let tickets = Tickets::new(start, ms, Stop::Count(5));
        assert_eq!(tickets.due_by(start), 1, "the first is due at the start");
        assert_eq!(tickets.due_by(start + ms - Duration::from_nanos(1)), 1);
        assert_eq!(tickets.due_by(start + ms), 2);
        assert_eq!(
            tickets.due_by(start + 100 * ms),
            5,
            "never more than the run has"
        );
    }

    #[test]
    fn each_due_ticket_is_released_and_taken_once_whoever_does_it() {
        let start = Instant::now();
        let tickets = Tickets::new(start, Duration::from_micros(1), Stop::Count(10_000));
        let late = start + Duration::from_secs(1);
        // Four callers release as time goes by, then everything; each says how many it did.
        let released: u64 = std::thread::scope(|scope| {
            let callers: Vec<_> = (0..4)
                .map(|_| {
                    scope.spawn(|| {
                        (0..=100u32)
                            .map(|step| {
                                let now = start + Duration::from_micros(u64::from(step) * 100);
                                tickets.release_due(now).1
                            })
                            .sum::<u64>()
                            + tickets.release_due(late).1
                    })
                })
                .collect();
            callers
                .into_iter()
                .map(|caller| caller.join().unwrap_or(0))
                .sum()
        });
        assert_eq!(released, 10_000);
        assert_eq!(tickets.release_due(late), (10_000, 0), "nothing left");
        // Four takers at once: every ticket once.
        let taken: usize = std::thread::scope(|scope| {
            let takers: Vec<_> = (0..4)
                .map(|_| scope.spawn(|| std::iter::from_fn(|| tickets.try_take()).count()))
                .collect();
            takers
                .into_iter()
                .map(|taker| taker.join().unwrap_or(0))
                .sum()
        });
        assert_eq!(taken, 10_000);
        assert_eq!(tickets.pending(), 0);
    }

    #[test]
    fn released_tickets_wait_for_workers_beyond_the_bound() {
        let start = Instant::now();
        let total = 3 * MAX_PENDING_TICKETS as u64;
        let tickets = Tickets::new(start, Duration::from_nanos(1), Stop::Count(total));
        let late = start + Duration::from_secs(1);
        let bound = MAX_PENDING_TICKETS as u64;
        assert_eq!(tickets.release_due(late), (bound, bound));
        assert_eq!(
            tickets.release_due(late),
            (bound, 0),
            "none while the bound is full"
        );
        for _ in 0..10 {
            assert!(tickets.try_take().is_some());
        }
        assert_eq!(tickets.release_due(late), (bound + 10, 10));
        assert_eq!(tickets.pending(), bound);
    }

    #[test]
    fn the_pacer_stops_when_the_run_closes_its_tickets() {
        let tickets = tickets_from_now(Duration::from_millis(1), u64::MAX);
        let (done, finished) = std::sync::mpsc::channel();
        let pacer = Arc::clone(&tickets);
        std::thread::spawn(move || {
            pace(&pacer);
            let _ = done.send(());
        });
        tickets.close();
        assert!(
            finished.recv_timeout(Duration::from_secs(5)).is_ok(),
            "the pacer still runs after the run ended"
        );
    }

    /// `count` tasks taking tickets until there are none; each returns how many it took.
    fn takers(tickets: &Arc<Tickets>, count: usize) -> Vec<tokio::task::JoinHandle<u64>> {
        (0..count)
            .map(|_| {
                let tickets = Arc::clone(tickets);
                tokio::spawn(async move {
                    let mut taken = 0;
                    while tickets.next().await.is_some() {
                        taken += 1;
                    }
                    taken
                })
            })
            .collect()
    }

    /// The tickets four workers take from `tickets` until there are none; the pacer must
    /// release them all, or the workers never finish.
    async fn taken_by_four(tickets: &Arc<Tickets>) -> u64 {
        let mut taken = 0;
        for worker in takers(tickets, 4) {
            taken += tokio::time::timeout(Duration::from_secs(10), worker)
                .await
                .expect("every ticket is released: the workers finish")
                .expect("worker");
        }
        taken
    }

    #[tokio::test]
    async fn every_waiting_worker_stops_once_the_tickets_are_taken() {
        let tickets = tickets_from_now(Duration::from_micros(10), 20);
        let pacer = Arc::clone(&tickets);
        let paced = std::thread::spawn(move || pace(&pacer));
        assert_eq!(taken_by_four(&tickets).await, 20);
        paced.join().expect("pacer");
    }

    #[tokio::test]
    async fn the_platform_pacer_releases_every_ticket_to_waiting_workers() {
        let tickets = tickets_from_now(Duration::from_micros(300), 50);
        start_pacer(Arc::clone(&tickets));
        assert_eq!(taken_by_four(&tickets).await, 50);
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn the_pacer_on_a_timer_stops_when_the_run_closes_its_tickets() {
        let tickets = tickets_from_now(Duration::from_millis(1), u64::MAX);
        let timer = crate::loadgen::timer::Timer::new().expect("a timerfd");
        let pacer = tokio::spawn(pace_on_timer(timer, Arc::clone(&tickets)));
        tickets.close();
        tokio::time::timeout(Duration::from_secs(5), pacer)
            .await
            .expect("the pacer still runs after the run ended")
            .expect("pacer");
    }

    fn plan(stop: &str) -> Plan {
        crate::loadgen::args::parse(&["--target", "http://127.0.0.1:1", stop])
            .and_then(|args| args.plan())
            .expect("plan")
    }

    #[test]
    fn a_hidden_progress_bar_is_hidden_and_a_shown_one_as_long_as_the_run() {
        let hidden = progress_bar(&plan("-n100"), false);
        assert!(hidden.is_hidden());
        assert_eq!(hidden.length(), None);
        // Shown, its length is the requests or the milliseconds of the run.
        assert_eq!(progress_bar(&plan("-n100"), true).length(), Some(100));
        assert_eq!(progress_bar(&plan("-d1s"), true).length(), Some(1000));
    }

    #[tokio::test(start_paused = true)]
    async fn the_progress_bar_follows_the_requests_done_or_the_time_spent() {
        for (stop, position) in [("-n100", 7), ("-d1s", 200)] {
            let progress = ProgressBar::hidden();
            let shared = Arc::new(Shared::default());
            let ticker = tokio::spawn(tick(
                progress.clone(),
                Arc::clone(&shared),
                plan(stop).stop,
                Instant::now(),
            ));
            // The clock is paused: it moves only when every task waits. The first redraw, at
            // the start, has no rate to say yet.
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert_eq!(progress.message(), "", "{stop}");
            shared.done.store(7, Ordering::Relaxed);
            // The next, at 200 ms: the requests done, or the milliseconds spent.
            tokio::time::sleep(Duration::from_millis(150)).await;
            ticker.abort();
            assert_eq!(progress.position(), position, "{stop}");
            assert_eq!(progress.message(), "7 sent, 35/s", "{stop}");
        }
    }

    #[tokio::test]
    async fn waiting_workers_stop_when_the_run_closes() {
        let tickets = tickets_from_now(Duration::from_secs(3600), 1_000);
        // The first ticket is due at once; the next in an hour.
        assert_eq!(tickets.release_due(Instant::now()), (1, 1));
        let workers = takers(&tickets, 3);
        tokio::task::yield_now().await;
        tickets.close();
        let mut taken = 0;
        for worker in workers {
            taken += tokio::time::timeout(Duration::from_secs(5), worker)
                .await
                .expect("a waiting worker stops when the run closes")
                .expect("worker");
        }
        assert!(taken <= 1, "{taken}");
    }
}
