//! `tollgate bench`: a load generator to point at a tollgate deployment before raising a limit.
//!
//! It answers "how many decisions per second does this deployment sustain, and at what
//! latency?" over the same APIs production uses: the HTTP JSON check (`http.rs`) and Envoy RLS
//! over gRPC (`grpc.rs`). Keys are drawn uniformly or Zipf-skewed (`keys.rs`); a run is closed
//! loop (each worker sends as soon as its previous answer arrives: the peak rate) or open loop
//! at `--rate` (latency at a given load). Latencies go into an HDR histogram per worker, merged
//! at the end (`report.rs`).
//!
//! The generator shares the machine with the server when both run on one host; the figures
//! are then for the pair, which is the documented setup of crates/tollgate-server/BENCHMARKS-server.md.

pub(crate) mod args;
mod grpc;
mod http;
mod keys;
mod report;
mod run;
mod shared;
#[cfg(target_os = "linux")]
mod timer;
mod tls;

pub use args::{BenchArgs, Distribution};
pub use report::{Latency, Summary};
pub use run::{BenchError, run};

/// Every key value is this prefix and a number, so bench traffic is easy to tell apart in an
/// audit log and never collides with a real subject.
pub const KEY_PREFIX: &str = "bench-";

/// What a decision said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// HTTP 200, or gRPC `OK`.
    Allowed,
    /// HTTP 429, or gRPC `OVER_LIMIT`.
    Rejected,
}

/// `tollgate bench`: runs, prints the summary (text or JSON) on stdout, and fails when no
/// request got a decision.
///
/// # Errors
///
/// Bad flags, an unreachable target, or a run in which every request failed.
pub fn main(args: &BenchArgs) -> anyhow::Result<()> {
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = args.threads {
        runtime.worker_threads(usize::from(threads));
    }
    let runtime = runtime
        .enable_all()
        .build()
        .map_err(|err| anyhow::anyhow!("cannot start the async runtime: {err}"))?;
    let summary = runtime.block_on(run(args))?;
    if args.json {
        println!("{}", summary.to_json());
    } else {
        print!("{summary}");
    }
    if summary.allowed + summary.rejected == 0 {
        anyhow::bail!(
            "no request got a decision: {}",
            summary
                .first_error
                .as_deref()
                .unwrap_or("no request was sent")
        );
    }
    Ok(())
}
