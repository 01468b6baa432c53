//! The measuring loop of the Redis load generators: callers in tasks on one runtime, each
//! deciding on its own keys as fast as its answers come back, and what Redis and this process
//! spent meanwhile. Shared so that tollgate's store, a `return 1` script and a peer's Redis
//! store are measured by one loop, in one way.

use std::sync::Arc;
use std::time::Duration;

use hdrhistogram::Histogram;
use rand::{Rng, SeedableRng};
use tollgate::{CheckRequest, Limit, Store, Take};
use tollgate_redis::RedisStore;
use tollgate_redis::test_server::{command, info_field};

/// A load binary's `main`: the seconds per run from the first argument (3 when absent), and
/// `run` with them on a runtime of one thread: one core for the clients, redis-server has the
/// other.
///
/// # Panics
///
/// When the runtime cannot be built.
pub fn run_load<F, Fut>(run: F)
where
    F: FnOnce(f64) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let seconds: f64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(3.0);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(run(seconds));
}

/// One decision of tollgate's Redis store: one unit of `limit` from `key`'s bucket.
///
/// # Panics
///
/// When the store fails or rejects: the rig's quota admits every request of a run, so either
/// means the run would not measure what it says.
pub(crate) async fn take_one(store: &RedisStore, key: &str, limit: &Limit) {
    let takes = [Take::new(key, limit, 1)];
    let request = CheckRequest {
        takes: &takes,
        request_id: None,
        now: None,
    };
    match store.check(request).await {
        Ok(decisions) => assert!(decisions.iter().all(|d| d.allowed()), "tollgate rejected"),
        Err(err) => panic!("tollgate's decision failed: {err}"),
    }
}

/// Prints the header of the table [`Run::print_row`] fills: a kind of operation beside
/// another, by keys and callers.
pub(crate) fn print_row_header() {
    println!(
        "| keys | callers | what | per second | p50 µs | p99 µs | script calls each | script µs each | redis-server CPU µs each |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
}

/// One measured run. "Per decision" means per completed call of `decide`.
pub struct Run {
    /// Decisions per second, over the run's wall time.
    pub per_second: f64,
    /// Median latency of a decision, in microseconds.
    pub p50_us: f64,
    /// 99th-percentile latency of a decision, in microseconds.
    pub p99_us: f64,
    /// Redis' time inside `EVALSHA` (`INFO commandstats`) per decision, in microseconds.
    pub script_us: f64,
    /// redis-server's whole CPU (`INFO cpu`) per decision, in microseconds.
    pub server_cpu_us: f64,
    /// This process's CPU (the client: batching, arguments, replies) per decision.
    pub client_cpu_us: f64,
    /// Decisions per `EVALSHA` call: how much a client shares calls (below 1 when a decision
    /// takes several).
    pub per_call: f64,
}

impl Run {
    /// This run as a row of the table [`print_row_header`] heads: `what` was done, `callers`
    /// at a time, over `key_count` keys.
    pub(crate) fn print_row(&self, key_count: u64, callers: usize, what: &str) {
        println!(
            "| {key_count} | {callers} | {what} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} | {:.2} |",
            self.per_second,
            self.p50_us,
            self.p99_us,
            1.0 / self.per_call,
            self.script_us,
            self.server_cpu_us,
        );
    }
}

/// This process's user and system CPU so far, in seconds (0 where `/proc` is not there).
fn own_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect();
    // utime and stime are fields 14 and 15 of the line: indexes 11 and 12 after the name.
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / CLOCK_TICKS_PER_SECOND
}

/// The unit of `/proc/<pid>/stat`'s times: `USER_HZ`, 100 on every Linux architecture.
const CLOCK_TICKS_PER_SECOND: f64 = 100.0;

fn server_cpu_seconds(port: u16) -> f64 {
    let info = command(port, &["INFO", "cpu"]).unwrap_or_default();
    info_field(&info, "used_cpu_user:", "used_cpu_user")
        + info_field(&info, "used_cpu_sys:", "used_cpu_sys")
}

/// Runs `callers` tasks calling `decide(key index)` for `seconds`, and reads Redis' figures.
/// With one key every caller decides on key 0; otherwise each draws its keys uniformly from
/// `0..keys`, from a seed of its own (the same sequence in every run).
///
/// # Panics
///
/// When a caller's task panics (a decision that failed): the run has nothing to report then.
pub async fn measure<F, Fut>(port: u16, callers: usize, keys: u64, seconds: f64, decide: F) -> Run
where
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    command(port, &["CONFIG", "RESETSTAT"]);
    let cpu_before = server_cpu_seconds(port);
    let own_before = own_cpu_seconds();
    let decide = Arc::new(decide);
    let started = tokio::time::Instant::now();
    let until = started + Duration::from_secs_f64(seconds);
    let mut tasks = Vec::new();
    for caller in 0..callers {
        let decide = decide.clone();
        tasks.push(tokio::spawn(async move {
            let mut histogram = Histogram::<u64>::new(3).expect("histogram");
            let mut rng = rand::rngs::SmallRng::seed_from_u64(caller as u64);
            let mut count = 0u64;
            while tokio::time::Instant::now() < until {
                let key = if keys == 1 {
                    0
                } else {
                    rng.random_range(0..keys)
                };
                let at = tokio::time::Instant::now();
                decide(key).await;
                let _ = histogram.record(at.elapsed().as_nanos() as u64);
                count += 1;
            }
            (count, histogram)
        }));
    }
    let mut total = 0;
    let mut histogram = Histogram::<u64>::new(3).expect("histogram");
    for task in tasks {
        let (count, h) = task.await.expect("load task");
        total += count;
        let _ = histogram.add(h);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let stats = command(port, &["INFO", "commandstats"]).unwrap_or_default();
    // Total script time over decisions: one call may carry several decisions.
    let script_us = info_field(&stats, "cmdstat_evalsha:", "usec") / total.max(1) as f64;
    let cpu = server_cpu_seconds(port) - cpu_before;
    let own = own_cpu_seconds() - own_before;
    let calls = info_field(&stats, "cmdstat_evalsha:", "calls");
    Run {
        per_second: total as f64 / elapsed,
        p50_us: histogram.value_at_quantile(0.5) as f64 / 1_000.0,
        p99_us: histogram.value_at_quantile(0.99) as f64 / 1_000.0,
        script_us,
        server_cpu_us: cpu * 1e6 / total.max(1) as f64,
        client_cpu_us: own * 1e6 / total.max(1) as f64,
        per_call: total as f64 / calls.max(1.0),
    }
}
