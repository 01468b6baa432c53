//! One `tollgate bench` run: connect every worker, send until the duration or count is reached,
//! and merge what the workers saw.
//!
//! Workers keep their own counts and histogram and share only two relaxed counters (requests
//! claimed, for `--requests`; requests done, for the progress bar), so the generator adds no
//! lock to the path it measures.
//!
//! In open loop (`--rate`) a pacer thread releases one ticket per scheduled send time and the
//! next free worker takes it. The pacer sleeps on the operating system's high-resolution timer:
//! tokio's timer wheel has a 1 ms tick, so workers sleeping on it would wake together and send
//! each millisecond's requests as one burst, which the server would queue and the latencies
//! would show. A request's latency counts from its ticket's time, so a server that falls behind
//! cannot hide the queue it builds (no coordinated omission).

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use tokio::sync::{Mutex, mpsc};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::Verdict;
use super::args::{BenchArgs, Plan, Stop, Target};
use super::grpc::{GrpcClient, SharedConnection};
use super::http::HttpClient;
use super::keys::{KeyPicker, zipf_cdf};
use super::report::Summary;

/// The longest latency the histogram holds, in nanoseconds (longer ones count as this).
const MAX_LATENCY_NS: u64 = 3_600_000_000_000;
/// How long a closed-loop worker waits after an error, so a dead target is not hammered.
const ERROR_PAUSE: Duration = Duration::from_millis(10);
/// How often the progress bar is redrawn.
const PROGRESS_TICK: Duration = Duration::from_millis(200);
/// Open-loop tickets the pacer may release ahead of the workers taking them. When the server
/// falls further behind, the pacer waits; the tickets keep their scheduled times.
const MAX_PENDING_TICKETS: usize = 65_536;

/// Open loop: each ticket is one request's scheduled send time.
type Tickets = Arc<Mutex<mpsc::Receiver<Instant>>>;

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
        let mut client = match &plan.target {
            Target::Http { authority, path } => {
                Client::Http(HttpClient::new(&plan, authority, path))
            }
            Target::Grpc { authority } => {
                let connection = Arc::clone(&connections[worker % connections.len()]);
                Client::Grpc(GrpcClient::new(&plan, authority, connection))
            }
        };
        client.connect().await.map_err(BenchError::Connect)?;
        clients.push(client);
    }

    let shared = Arc::new(Shared::default());
    let progress = progress_bar(&plan, args.json);
    let start = Instant::now();
    let deadline = match plan.stop {
        Stop::After(duration) => Some(start + duration),
        Stop::Count(_) => None,
    };
    let tickets: Option<Tickets> = plan.interval.map(|interval| {
        let (release, tickets) = mpsc::channel(MAX_PENDING_TICKETS);
        let (stop, shared) = (plan.stop, Arc::clone(&shared));
        std::thread::spawn(move || pace(&release, start, interval, stop, &shared));
        Arc::new(Mutex::new(tickets))
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
    // The workers hold the only receivers now: once they stop, the pacer's sends fail.
    drop(tickets);

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
    progress.finish_and_clear();
    Ok(Summary::new(args, &plan, elapsed, tallies, histogram))
}

/// Releases one ticket per `interval` from `start` until the run is over, on the operating
/// system's timer (see the module docs). Runs on a thread of its own, outside the runtime.
fn pace(
    release: &mpsc::Sender<Instant>,
    start: Instant,
    interval: Duration,
    stop: Stop,
    shared: &Shared,
) {
    let interval_ns = interval.as_nanos();
    for index in 0u64.. {
        let offset = u64::try_from(interval_ns * u128::from(index)).unwrap_or(u64::MAX);
        let due = start + Duration::from_nanos(offset);
        let over = match stop {
            Stop::After(duration) => due >= start + duration,
            Stop::Count(count) => index >= count || shared.claimed.load(Ordering::Relaxed) >= count,
        };
        if over {
            return;
        }
        let now = Instant::now();
        if due > now {
            // The generator's own thread, not the code under test: the clippy rule against
            // sleeping is for tests of the limiter.
            #[allow(clippy::disallowed_methods)]
            std::thread::sleep(due - now);
        }
        // Waits while the channel is full; fails once every worker has stopped.
        if release.blocking_send(due).is_err() {
            return;
        }
    }
}

/// Sends requests until the run is over: back to back (closed loop), or one per ticket.
async fn worker(
    plan: Arc<Plan>,
    mut client: Client,
    mut picker: KeyPicker,
    latency: Histogram<u64>,
    shared: Arc<Shared>,
    tickets: Option<Tickets>,
    deadline: Option<Instant>,
) -> Tally {
    let mut tally = Tally {
        allowed: 0,
        rejected: 0,
        errors: 0,
        first_error: None,
        latency,
    };
    loop {
        let sent = match &tickets {
            Some(tickets) => {
                // The pacer ends the run: its channel closes after the last ticket.
                let ticket = tickets.lock().await.recv().await;
                match ticket {
                    Some(due) if deadline.is_none_or(|deadline| Instant::now() < deadline) => due,
                    _ => break,
                }
            }
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
        let result = tokio::time::timeout(plan.timeout, client.send(key)).await;
        let result = result.unwrap_or_else(|_| {
            client.reset();
            Err(format!("no answer within {:?} (--timeout)", plan.timeout))
        });
        match result {
            Ok(verdict) => {
                let nanos = u64::try_from(sent.elapsed().as_nanos()).unwrap_or(u64::MAX);
                tally.latency.saturating_record(nanos.max(1));
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
    }
    tally
}

/// A progress bar on stderr, or a hidden one when nobody is watching.
fn progress_bar(plan: &Plan, json: bool) -> ProgressBar {
    if json || !std::io::stderr().is_terminal() {
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
