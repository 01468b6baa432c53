//! The summary of a `tollgate bench` run, as text for people and JSON for scripts.

use std::fmt;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

use super::args::{BenchArgs, Distribution, Plan, Target};
use super::run::Tally;

/// A distribution of durations in microseconds: the latency of the requests that got a
/// decision, or how late requests left in open loop.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Latency {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p99_9: f64,
    /// The slowest.
    pub max: f64,
    /// The mean.
    pub mean: f64,
}

impl Latency {
    /// The percentiles of `nanos`, a histogram in nanoseconds.
    fn of(nanos: &Histogram<u64>) -> Self {
        let micros = |nanos: u64| nanos as f64 / 1000.0;
        Self {
            p50: micros(nanos.value_at_quantile(0.5)),
            p90: micros(nanos.value_at_quantile(0.9)),
            p99: micros(nanos.value_at_quantile(0.99)),
            p99_9: micros(nanos.value_at_quantile(0.999)),
            max: micros(nanos.max()),
            mean: nanos.mean() / 1000.0,
        }
    }

    /// `p50 … max` in milliseconds.
    fn milliseconds(&self) -> String {
        format!(
            "p50 {:.3}  p90 {:.3}  p99 {:.3}  p99.9 {:.3}  max {:.3}",
            self.p50 / 1000.0,
            self.p90 / 1000.0,
            self.p99 / 1000.0,
            self.p99_9 / 1000.0,
            self.max / 1000.0
        )
    }
}

/// What a run measured.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct Summary {
    /// `http`, `forward-auth` or `grpc`.
    pub api: &'static str,
    /// What the requests travelled over: `HTTP/1.1` or `HTTP/2` (gRPC's).
    pub protocol: &'static str,
    /// Where the load went: a URL, or `HOST:PORT` for gRPC.
    pub target: String,
    /// Concurrent workers, each with one request in flight.
    pub concurrency: usize,
    /// Connections they sent over (fewer than the workers when gRPC calls were multiplexed).
    pub connections: usize,
    /// How keys were drawn.
    pub distribution: Distribution,
    /// Distinct keys.
    pub keys: u64,
    /// The open-loop target rate per second, if any.
    pub rate: Option<f64>,
    /// Wall time of the run, in seconds.
    pub elapsed_s: f64,
    /// Requests sent.
    pub requests: u64,
    /// Requests allowed (HTTP 200, gRPC `OK`).
    pub allowed: u64,
    /// Requests rejected (HTTP 429, gRPC `OVER_LIMIT`).
    pub rejected: u64,
    /// Requests without a decision: another status, a transport failure, a timeout.
    pub errors: u64,
    /// Allowed and rejected per second of the run.
    pub decisions_per_s: f64,
    /// Latency of the decisions, from each request's scheduled time in open loop.
    pub latency_us: Latency,
    /// Open loop only: how late requests left after their scheduled time. It is part of the
    /// latency above; when it is most of it, the generator itself fell behind (starved of CPU,
    /// or every worker busy), not the target.
    pub schedule_lag_us: Option<Latency>,
    /// Open loop only: the latency counted from when each request was sent rather than from
    /// its scheduled time, so without the lateness above: what the target (and the network, and
    /// the generator's receiving) took once asked. It hides any queue the target makes its
    /// clients wait in; read it beside the latency, not instead of it.
    pub service_us: Option<Latency>,
    /// The first error, to say what went wrong.
    pub first_error: Option<String>,
}

impl Summary {
    /// Merges the workers' tallies into `merged` (an empty histogram of their bounds).
    pub(crate) fn new(
        args: &BenchArgs,
        plan: &Plan,
        elapsed: Duration,
        tallies: Vec<Tally>,
        mut merged: Histogram<u64>,
    ) -> Self {
        let (mut allowed, mut rejected, mut errors) = (0, 0, 0);
        let mut first_error = None;
        let mut lag = merged.clone();
        let mut service = merged.clone();
        for tally in tallies {
            allowed += tally.allowed;
            rejected += tally.rejected;
            errors += tally.errors;
            first_error = first_error.or(tally.first_error);
            // Same bounds on every histogram, so adding cannot overflow their range; a count
            // that did would only be lost from the percentiles.
            let _ = merged.add(&tally.latency);
            let _ = lag.add(&tally.lag);
            let _ = service.add(&tally.service);
        }
        let elapsed_s = elapsed.as_secs_f64();
        let scheme = if plan.tls.is_some() { "https" } else { "http" };
        let (api, target) = match &plan.target {
            Target::Http { authority, path } => ("http", format!("{scheme}://{authority}{path}")),
            Target::Grpc { authority } if plan.tls.is_some() => {
                ("grpc", format!("https://{authority}"))
            }
            Target::Grpc { authority } => ("grpc", authority.clone()),
            Target::ForwardAuth { authority, path } => {
                ("forward-auth", format!("{scheme}://{authority}{path}"))
            }
        };
        let protocol = match plan.target {
            Target::Grpc { .. } => "HTTP/2",
            _ if plan.http2 => "HTTP/2",
            _ => "HTTP/1.1",
        };
        Self {
            api,
            protocol,
            target,
            concurrency: plan.concurrency,
            connections: plan.connections,
            distribution: plan.distribution,
            keys: plan.keys,
            rate: args.rate,
            elapsed_s,
            requests: allowed + rejected + errors,
            allowed,
            rejected,
            errors,
            decisions_per_s: if elapsed_s > 0.0 {
                (allowed + rejected) as f64 / elapsed_s
            } else {
                0.0
            },
            latency_us: Latency::of(&merged),
            schedule_lag_us: plan.interval.map(|_| Latency::of(&lag)),
            service_us: plan.interval.map(|_| Latency::of(&service)),
            first_error,
        }
    }

    /// The summary as one line of JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|err| format!("{{\"error\":\"{err}\"}}"))
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let distribution = match self.distribution {
            Distribution::Uniform => "uniform",
            Distribution::Zipf => "zipf",
        };
        let load = match self.rate {
            Some(rate) => format!("open loop at {rate:.0}/s"),
            None => "closed loop".to_owned(),
        };
        writeln!(
            f,
            "tollgate bench: {} {} ({}), {} workers over {} connections, {load}, {distribution} \
             over {} keys, {:.2} s",
            self.api,
            self.target,
            self.protocol,
            self.concurrency,
            self.connections,
            self.keys,
            self.elapsed_s
        )?;
        writeln!(f, "  decisions/s  {:.0}", self.decisions_per_s)?;
        writeln!(f, "  requests     {}", self.requests)?;
        writeln!(f, "  allowed      {}", self.allowed)?;
        writeln!(f, "  rejected     {}", self.rejected)?;
        match &self.first_error {
            Some(first) => writeln!(f, "  errors       {} (first: {first})", self.errors)?,
            None => writeln!(f, "  errors       {}", self.errors)?,
        }
        writeln!(f, "  latency ms   {}", self.latency_us.milliseconds())?;
        if let Some(lag) = &self.schedule_lag_us {
            writeln!(
                f,
                "  late ms      {}  (sent after the scheduled time; part of the latency)",
                lag.milliseconds()
            )?;
        }
        if let Some(service) = &self.service_us {
            writeln!(
                f,
                "  sent→answer  {}  (the latency without the lateness)",
                service.milliseconds()
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {

    use super::super::run::MAX_LATENCY_NS;
    use super::*;

    /// An empty histogram of the bounds a run's workers use.
    fn histogram() -> Histogram<u64> {
        Histogram::new_with_bounds(1, MAX_LATENCY_NS, 3).unwrap_or_else(|err| panic!("{err}"))
    }

    fn tally(
        allowed: u64,
        rejected: u64,
        errors: u64,
        first_error: Option<&str>,
        at_us: &[u64],
    ) -> Tally {
        let mut latency = histogram();
        for &us in at_us {
            let _ = latency.record(us * 1_000);
        }
        Tally {
            allowed,
            rejected,
            errors,
            first_error: first_error.map(str::to_owned),
            lag: latency.clone(),
            service: latency.clone(),
            latency,
        }
    }

    fn summary(args: &[&str], tallies: Vec<Tally>, elapsed: Duration) -> Summary {
        let args = crate::loadgen::args::parse(args).unwrap_or_else(|err| panic!("{err}"));
        let plan = args.plan().unwrap_or_else(|err| panic!("{err}"));
        Summary::new(&args, &plan, elapsed, tallies, histogram())
    }

    #[test]
    fn workers_tallies_add_up_and_only_decisions_count_per_second() {
        let tallies = vec![
            tally(6, 2, 0, None, &[100, 200]),
            tally(3, 1, 2, Some("timed out"), &[300]),
            tally(0, 0, 1, Some("refused"), &[]),
        ];
        let args = [
            "--target",
            "http://127.0.0.1:8080",
            "-c",
            "3",
            "--requests",
            "15",
        ];
        let summary = summary(&args, tallies, Duration::from_secs(2));
        assert_eq!(summary.api, "http");
        assert_eq!(summary.protocol, "HTTP/1.1");
        assert_eq!(summary.target, "http://127.0.0.1:8080/v1/check");
        assert_eq!((summary.concurrency, summary.connections), (3, 3));
        assert_eq!(
            (
                summary.requests,
                summary.allowed,
                summary.rejected,
                summary.errors
            ),
            (15, 9, 3, 3)
        );
        // Twelve decisions in two seconds; errors are not decisions.
        assert!(
            (summary.decisions_per_s - 6.0).abs() < 1e-9,
            "{}",
            summary.decisions_per_s
        );
        assert_eq!(summary.first_error.as_deref(), Some("timed out"));
        // Every worker's latencies, merged: 100, 200 and 300 µs.
        let latency = summary.latency_us;
        assert!((latency.p50 - 200.0).abs() < 1.0, "{latency:?}");
        assert!((latency.max - 300.0).abs() < 1.0, "{latency:?}");
        assert!((latency.mean - 200.0).abs() < 1.0, "{latency:?}");
        // Closed loop: no schedule to be late for.
        assert_eq!((summary.schedule_lag_us, summary.service_us), (None, None));

        let text = summary.to_string();
        for line in [
            "tollgate bench: http http://127.0.0.1:8080/v1/check (HTTP/1.1), 3 workers over 3 connections, closed loop, uniform over",
            "  decisions/s  6\n",
            "  requests     15\n",
            "  allowed      9\n",
            "  rejected     3\n",
            "  errors       3 (first: timed out)\n",
            "  latency ms   p50 0.200  p90 0.300  p99 0.300  p99.9 0.300  max 0.300\n",
        ] {
            assert!(text.contains(line), "{line:?} in {text}");
        }
        assert!(!text.contains("late ms"), "{text}");
        let json: serde_json::Value =
            serde_json::from_str(&summary.to_json()).unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(json["allowed"], 9);
        assert_eq!(
            json["latency_us"]["p50"].as_f64().map(f64::round),
            Some(200.0)
        );
    }

    #[test]
    fn an_open_loop_run_says_how_late_requests_left() {
        let args = ["--grpc", "127.0.0.1:8081", "--rate", "100", "-d", "1s"];
        let summary = summary(&args, vec![tally(5, 0, 0, None, &[1_000])], Duration::ZERO);
        assert_eq!(
            (summary.api, summary.protocol, summary.target.as_str()),
            ("grpc", "HTTP/2", "127.0.0.1:8081")
        );
        assert_eq!(summary.rate, Some(100.0));
        // A run that took no time measured no rate, rather than an infinite one.
        assert_eq!(summary.decisions_per_s, 0.0);
        assert!(summary.schedule_lag_us.is_some() && summary.service_us.is_some());
        let text = summary.to_string();
        assert!(text.contains("open loop at 100/s"), "{text}");
        assert!(text.contains("  errors       0\n"), "{text}");
        assert!(text.contains("  late ms      p50 1.000"), "{text}");
        assert!(text.contains("  sent→answer  p50 1.000"), "{text}");
    }
}
