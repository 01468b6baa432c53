//! The `tollgate` command line: `serve`, `validate`, `check`, `simulate`, `bench`,
//! `import envoy` and `completions`.
//!
//! Every `serve` flag is also a `TOLLGATE_*` environment variable. Errors print as one line that
//! says what to do, and exit with status 1.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use axum::http::StatusCode;
use clap::{CommandFactory, Parser, Subcommand};
use futures_util::{Stream, StreamExt};
use tokio::net::TcpListener;
use tollgate_policy::audit::AuditLog;
use tollgate_policy::watch::PolicyWatcher;
use tollgate_policy::{EngineOptions, PolicyEngine, Scope, SystemWallClock, WallClock, compile};
use tollgate_redis::{RedisConfig, RedisStore, TlsFiles, redact};
use tollgate_tower::HeaderStyle;

use crate::ConnectionLimits;
use crate::decider::{Backend, Decider};
use crate::http::{AddressMask, AppState, ClientAddress, HttpOptions, NegativeHits};
use crate::loadgen::args::parse_duration;
use crate::rlqs::RlqsOptions;
use crate::tls::{ListenerTls, TlsFiles as ServerTlsFiles};

/// The demo policy `serve` runs without `--config`.
pub const DEMO_POLICY: &str = include_str!("demo.yaml");

/// tollgate: exact, fast rate limiting as a service.
#[derive(Debug, Parser)]
#[command(name = "tollgate", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve decisions: Envoy RLS over gRPC, HTTP JSON, forward-auth, metrics.
    // Boxed: the serve flags outweigh every other command's.
    Serve(Box<ServeArgs>),
    /// Check a policy file or directory; exit 0 if it is valid, 1 with the errors if not.
    /// Warnings (parts that load but do nothing, exemptions past or near their expiry) go to
    /// stderr.
    Validate {
        /// The policy file, or a policy directory (its .yaml and .yml files, merged).
        file: PathBuf,
        /// Exit 1 on warnings too, for a CI job that keeps policies tidy.
        #[arg(long)]
        strict: bool,
        /// How to report: lines for people, GitHub Actions annotations on the files and lines
        /// of a pull request, or one JSON document.
        #[arg(long, value_enum, default_value_t = crate::validate::Format::Text)]
        format: crate::validate::Format,
    },
    /// Show what a policy change does: each limit, override and exemption added, removed or
    /// changed, in the file's terms, and what becomes of each one's buckets (kept, carried
    /// over on a reload, or started afresh: a full burst for every subject).
    Diff {
        /// The policy in force (a file or a policy directory).
        old: PathBuf,
        /// The policy proposed (a file or a policy directory).
        new: PathBuf,
        /// One JSON document instead of text, for a bot commenting on a change.
        #[arg(long)]
        json: bool,
        /// Exit 1 when a limit's buckets would start afresh (a full burst for every subject
        /// at once), after printing the diff: a CI job that makes such a change a deliberate
        /// step.
        #[arg(long)]
        deny_afresh: bool,
    },
    /// Decide locally against a policy file (in memory) and print the decisions.
    Check(CheckArgs),
    /// Replay a trace of requests against policy files and report what each would reject.
    Simulate(crate::simulate::SimulateArgs),
    /// Load a tollgate deployment over HTTP or gRPC and report decisions/s and latency.
    // Boxed: its flags outweigh every other command's but serve's.
    Bench(Box<crate::loadgen::BenchArgs>),
    /// Convert another rate limiter's configuration into a tollgate policy.
    Import {
        #[command(subcommand)]
        from: ImportFrom,
    },
    /// Print the policy file's JSON Schema (draft 7), for editors: completion, each field's
    /// meaning, and mistakes flagged as they are typed. `tollgate validate` stays the check.
    ///
    /// `tollgate schema > policy.schema.json`, then `# yaml-language-server:
    /// $schema=policy.schema.json` atop the policy file, with the tags declared to the editor
    /// (VS Code: `"yaml.customTags": ["!prefix scalar", "!cidr scalar"]`).
    Schema,
    /// Print a completion script for a shell: commands, flags and their values at the tab key.
    ///
    /// bash: `source <(tollgate completions bash)` (or save it in
    /// /etc/bash_completion.d/tollgate); zsh: save it as `_tollgate` in a directory of
    /// `$fpath`; fish: save it in ~/.config/fish/completions/tollgate.fish.
    Completions {
        /// The shell the script is for.
        shell: clap_complete::Shell,
    },
}

#[derive(Debug, Subcommand)]
enum ImportFrom {
    /// envoyproxy/ratelimit configuration files (one domain each), into one policy (or a
    /// policy directory of one file per domain, with --out-dir).
    Envoy {
        /// The configuration files, or directories whose `.yaml` and `.yml` files are read
        /// (in name order), as envoyproxy/ratelimit reads its configuration directory.
        #[arg(required = true, num_args = 1..)]
        files: Vec<PathBuf>,
        /// Count as Envoy does, in fixed windows of N per unit, rather than in token buckets
        /// of the same rate (which have no double burst at a window's edge).
        #[arg(long)]
        fixed_windows: bool,
        /// Merge files that declare the same domain (envoyproxy/ratelimit's
        /// `MERGE_DOMAIN_CONFIG`) rather than refuse them.
        #[arg(long)]
        merge_domains: bool,
        /// Write a policy directory here, one file per domain named after the file that
        /// declares it, rather than one policy on standard output. The directory is made if
        /// missing; a file already there is never overwritten.
        #[arg(long, value_name = "DIR")]
        out_dir: Option<PathBuf>,
    },
}

/// `tollgate serve` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Policy file (YAML, see docs/policy.md), or a policy directory whose .yaml and .yml files
    /// (one per team, say) are merged into one policy. Without one, a built-in demo policy is
    /// used and printed. The file or directory is watched and reloaded when it changes.
    #[arg(long, env = "TOLLGATE_CONFIG")]
    pub config: Option<PathBuf>,
    /// HTTP listen address (JSON API, forward-auth, metrics, health, admin).
    #[arg(long, env = "TOLLGATE_HTTP", default_value = "127.0.0.1:8080")]
    pub http: SocketAddr,
    /// gRPC listen address (Envoy Rate Limit Service v3).
    #[arg(long, env = "TOLLGATE_GRPC", default_value = "127.0.0.1:8081")]
    pub grpc: SocketAddr,
    /// Serve HTTP over TLS with this PEM certificate (chain); needs --http-tls-key. The files
    /// are read again on SIGHUP and when they change.
    #[arg(
        long,
        env = "TOLLGATE_HTTP_TLS_CERT",
        value_name = "FILE",
        requires = "http_tls_key"
    )]
    pub http_tls_cert: Option<PathBuf>,
    /// The HTTP certificate's PEM private key.
    #[arg(
        long,
        env = "TOLLGATE_HTTP_TLS_KEY",
        value_name = "FILE",
        requires = "http_tls_cert"
    )]
    pub http_tls_key: Option<PathBuf>,
    /// Require HTTP clients to present a certificate signed by an authority in this PEM file
    /// (mutual TLS); needs --http-tls-cert.
    #[arg(
        long,
        env = "TOLLGATE_HTTP_TLS_CLIENT_CA",
        value_name = "FILE",
        requires = "http_tls_cert"
    )]
    pub http_tls_client_ca: Option<PathBuf>,
    /// Serve gRPC over TLS with this PEM certificate (chain); needs --grpc-tls-key. The files
    /// are read again on SIGHUP and when they change.
    #[arg(
        long,
        env = "TOLLGATE_GRPC_TLS_CERT",
        value_name = "FILE",
        requires = "grpc_tls_key"
    )]
    pub grpc_tls_cert: Option<PathBuf>,
    /// The gRPC certificate's PEM private key.
    #[arg(
        long,
        env = "TOLLGATE_GRPC_TLS_KEY",
        value_name = "FILE",
        requires = "grpc_tls_cert"
    )]
    pub grpc_tls_key: Option<PathBuf>,
    /// Require gRPC clients (Envoy) to present a certificate signed by an authority in this
    /// PEM file (mutual TLS); needs --grpc-tls-cert.
    #[arg(
        long,
        env = "TOLLGATE_GRPC_TLS_CLIENT_CA",
        value_name = "FILE",
        requires = "grpc_tls_cert"
    )]
    pub grpc_tls_client_ca: Option<PathBuf>,
    /// Where buckets live: `memory`, `redis://HOST:PORT[/DB]`,
    /// `redis+cluster://HOST:PORT,HOST:PORT` or `redis+sentinel://HOST:PORT,HOST:PORT/SERVICE`
    /// (the master Redis Sentinel names); `rediss://`, `rediss+cluster://` and
    /// `rediss+sentinel://` for TLS.
    #[arg(long, env = "TOLLGATE_STORE", default_value = "memory")]
    pub store: String,
    /// TLS to Redis: PEM file of the certificate authorities to trust instead of the
    /// system's.
    #[arg(long, env = "TOLLGATE_STORE_TLS_CA", value_name = "FILE")]
    pub store_tls_ca: Option<PathBuf>,
    /// TLS to Redis: PEM client certificate, for a Redis that requires one
    /// (`tls-auth-clients yes`); needs --store-tls-key.
    #[arg(
        long,
        env = "TOLLGATE_STORE_TLS_CERT",
        value_name = "FILE",
        requires = "store_tls_key"
    )]
    pub store_tls_cert: Option<PathBuf>,
    /// TLS to Redis: the client certificate's PEM private key.
    #[arg(
        long,
        env = "TOLLGATE_STORE_TLS_KEY",
        value_name = "FILE",
        requires = "store_tls_cert"
    )]
    pub store_tls_key: Option<PathBuf>,
    /// How many recent rejections by Redis this process remembers (0: none): the same check
    /// is then rejected here until its Retry-After passes, so a key hammered past its limit
    /// costs Redis one call per wait, not one per request. Exact, except that tokens another
    /// process gives back (POST /v1/settle) meanwhile are not seen here until then.
    #[arg(long, env = "TOLLGATE_REJECTION_MEMORY", default_value_t = 100_000)]
    pub rejection_memory: usize,
    /// Token leasing: the most tokens this process takes from Redis at once for a hot key (one
    /// checked 8 times within 100 ms here) and spends without asking Redis again; 0, the
    /// default, turns it off. Never over-admits; each process may hold back up to one batch
    /// per key from the others (at most this many tokens and an eighth of the capacity) until
    /// it spends it or gives it back. Redis store only.
    #[arg(long, env = "TOLLGATE_TOKEN_BATCH", default_value_t = 0, value_name = "TOKENS",
          value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    pub token_batch: u64,
    /// Token leasing: the longest a batch is held before its unused tokens go back to Redis;
    /// shorter than --idempotency-window.
    #[arg(long, env = "TOLLGATE_TOKEN_BATCH_TTL", default_value = "1s", value_parser = parse_timeout)]
    pub token_batch_ttl: Duration,
    /// How long a decision may wait for Redis before its limits follow their failure modes.
    #[arg(long, env = "TOLLGATE_STORE_TIMEOUT", default_value = "20ms", value_parser = parse_duration)]
    pub store_timeout: Duration,
    /// The password Redis Sentinel asks for (its `requirepass`), for a redis+sentinel:// store;
    /// the URL's credentials are the master's. Best given as the environment variable.
    #[arg(
        long,
        env = "TOLLGATE_STORE_SENTINEL_PASSWORD",
        value_name = "PASSWORD",
        hide_env_values = true
    )]
    pub store_sentinel_password: Option<String>,
    /// The most connections open at once on each listener (HTTP and gRPC); past it new
    /// clients wait in the kernel's backlog until one closes. Default: 10,000, or fewer where
    /// the open-file limit cannot hold that many on both listeners.
    #[arg(long, env = "TOLLGATE_MAX_CONNECTIONS", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: Option<u32>,
    /// How long a client may take to send a whole HTTP request head (the first counted from
    /// the connection's start, each next one from its first bytes), or to open HTTP/2 on the
    /// gRPC port.
    #[arg(long, env = "TOLLGATE_HEADER_TIMEOUT", default_value = "30s", value_parser = parse_timeout)]
    pub header_timeout: Duration,
    /// How long a client may send nothing (a kept-alive HTTP connection waiting for its next
    /// request included) before its connection is asked to close (a GOAWAY on HTTP/2); still
    /// silent as long again, it is dropped.
    #[arg(long, env = "TOLLGATE_IDLE_TIMEOUT", default_value = "10m", value_parser = parse_timeout)]
    pub idle_timeout: Duration,
    /// How long, on SIGTERM or SIGINT, connections may take to finish the requests in flight
    /// before they are dropped and the process exits.
    #[arg(long, env = "TOLLGATE_DRAIN_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub drain_timeout: Duration,
    /// How long, on SIGTERM or SIGINT, the server goes on serving out of its load balancers'
    /// rotation before it stops accepting and drains: `/readyz` and the gRPC health service
    /// answer "not ready" meanwhile, so that a Kubernetes Service or Envoy stops sending it new
    /// connections first (a few seconds covers their lag). 0, the default, stops accepting at
    /// once; a second signal ends the wait.
    #[arg(long, env = "TOLLGATE_SHUTDOWN_DELAY", default_value = "0s", value_parser = parse_shutdown_delay)]
    pub shutdown_delay: Duration,
    /// How many of each limit's busiest bucket keys `/metrics` (`tollgate_hot_key_*`) and
    /// `/v1/hot-keys` report, from a sample of the decisions; 0, the default, counts nothing.
    /// Keys are made of descriptor values (user ids, addresses, API keys): turn this on only
    /// where they may be seen on `/metrics` and kept by the metrics store.
    #[arg(long, env = "TOLLGATE_HOT_KEYS", default_value_t = crate::decider::DEFAULT_HOT_KEYS, value_parser = parse_hot_keys)]
    pub hot_keys: usize,
    /// The window the hot keys are counted over; both reports show the last one completed.
    #[arg(long, env = "TOLLGATE_HOT_KEYS_WINDOW", default_value = "1m", value_parser = parse_timeout)]
    pub hot_keys_window: Duration,
    /// The share of a limit that an allowed decision must leave spent to be counted in
    /// `tollgate_near_limit_decisions_total` (envoyproxy/ratelimit's NEAR_LIMIT_RATIO): a
    /// decimal above 0 and at most 1, to three places (1 counts nothing).
    #[arg(long, env = "TOLLGATE_NEAR_LIMIT_RATIO", default_value = "0.8", value_parser = parse_ratio)]
    pub near_limit_ratio: u32,
    /// RLQS (Envoy's rate-limit quota service): a bucket whose Envoy reports no requests for
    /// this long is abandoned (Envoy forgets it until its next request).
    #[arg(long, env = "TOLLGATE_RLQS_ABANDON_AFTER", default_value = "1m", value_parser = parse_timeout)]
    pub rlqs_abandon_after: Duration,
    /// RLQS: the most buckets one Envoy's stream is given assignments for; past it, its
    /// further buckets get none (Envoy's `no_assignment_behavior` applies to them).
    #[arg(long, env = "TOLLGATE_RLQS_MAX_BUCKETS", default_value_t = 10_000,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub rlqs_max_buckets: u32,
    /// RLQS: how often tollgate renews, between Envoy's reports, the assignments it gives a
    /// time-to-live of twice this: those a limit's capacity cannot pay for as long as the
    /// reporting interval asks (twice it), and `DENY_ALL`. Shorter lets a small capacity pay
    /// a higher rate, for a payment per bucket and renewal.
    #[arg(long, env = "TOLLGATE_RLQS_RENEW_EVERY", default_value = "1s", value_parser = parse_interval)]
    pub rlqs_renew_every: Duration,
    /// Global limits (`scope: global` in the policy): the Redis or Redis Cluster shared by
    /// every region (redis://, rediss://, redis+cluster://). Each process spends tokens it
    /// was charged for there in advance, and rebalances them in the background, so no request
    /// waits on it (except a key's first). Without it, global limits are decided on --store.
    #[arg(long, env = "TOLLGATE_GLOBAL_STORE", value_name = "URL")]
    pub global_store: Option<String>,
    /// Global limits: this process's region, named on the global store's board of wants
    /// (with a random number, so processes of one region differ).
    #[arg(long, env = "TOLLGATE_REGION", default_value = "default", value_parser = parse_region)]
    pub region: String,
    /// Global limits: how often reservoirs are topped up or trimmed. Every process sharing a
    /// global store should use the same.
    #[arg(long, env = "TOLLGATE_REBALANCE_INTERVAL", default_value = "1s", value_parser = parse_interval)]
    pub rebalance_interval: Duration,
    /// Global limits: how long a call to the global store may take (a key's first request
    /// waits on one; rounds run in the background).
    #[arg(long, env = "TOLLGATE_GLOBAL_STORE_TIMEOUT", default_value = "500ms", value_parser = parse_timeout)]
    pub global_store_timeout: Duration,
    /// Global limits: a reservoir with no request for this long is given back.
    #[arg(long, env = "TOLLGATE_GLOBAL_ABANDON_AFTER", default_value = "1m", value_parser = parse_timeout)]
    pub global_abandon_after: Duration,
    /// Global limits: the most reservoirs held; a new key beyond it is fetched for its request
    /// alone.
    #[arg(long, env = "TOLLGATE_GLOBAL_MAX_KEYS", default_value_t = 100_000,
          value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub global_max_keys: u32,
    /// Bearer token for the admin endpoints (must not be empty); without one they answer
    /// loopback clients only.
    #[arg(long, env = "TOLLGATE_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Start with every limit in shadow mode, for this reason (audited): decided and counted,
    /// never rejecting, until `POST /v1/policy/shadow-all {"on":false}`. For a first rollout
    /// in front of live traffic, or a restart in the middle of an incident.
    #[arg(long, env = "TOLLGATE_SHADOW_ALL", value_name = "REASON")]
    pub shadow_all: Option<String>,
    /// Forward-auth: take descriptor entry ENTRY from request header HEADER (repeatable).
    #[arg(
        long = "forward-auth-header",
        env = "TOLLGATE_FORWARD_AUTH_HEADER",
        value_name = "ENTRY=HEADER",
        value_delimiter = ',',
        value_parser = parse_mapping
    )]
    pub forward_auth_headers: Vec<(String, String)>,
    /// Forward-auth: the header the proxies record the client's address in, for the
    /// `remote_address` entry (`!cidr` conditions): `X-Real-IP`, or `X-Forwarded-For:N` for
    /// the entry N from its right end (0, the default: the one the proxy calling tollgate
    /// appended; N when N more trusted proxies stand in front of it). A client cannot set
    /// `remote_address` itself then.
    #[arg(
        long,
        env = "TOLLGATE_FORWARD_AUTH_ADDRESS",
        value_name = "HEADER[:TRUSTED]",
        value_parser = parse_address_source
    )]
    pub forward_auth_address: Option<ClientAddress>,
    /// Forward-auth: the networks of trusted proxies (`10.0.0.0/8,2001:db8::/32`; a lone
    /// address is a network of one). Past the entries `--forward-auth-address` passes over,
    /// an entry inside one is passed over too, so the client is the first address from the
    /// right that no trusted proxy holds, however many proxies a request crossed.
    #[arg(
        long,
        env = "TOLLGATE_FORWARD_AUTH_TRUSTED_PROXIES",
        value_name = "CIDR[,CIDR...]",
        value_delimiter = ',',
        requires = "forward_auth_address",
        value_parser = parse_network
    )]
    pub forward_auth_trusted_proxies: Vec<tollgate_policy::Network>,
    /// Forward-auth: prefix lengths for IPv4 and IPv6 (`24,64`) that add the client's
    /// network as the `masked_remote_address` entry (`198.51.100.0/24`, Envoy's form), so a
    /// limit keyed by it holds one bucket per network: a client rotating through its IPv6 /64
    /// is one subject.
    #[arg(
        long,
        env = "TOLLGATE_FORWARD_AUTH_ADDRESS_MASK",
        value_name = "V4LEN,V6LEN",
        requires = "forward_auth_address",
        value_parser = parse_address_mask
    )]
    pub forward_auth_address_mask: Option<AddressMask>,
    /// Forward-auth: the status of a rejection (429; 403 for nginx auth_request).
    #[arg(long, env = "TOLLGATE_FORWARD_AUTH_DENY_STATUS", default_value_t = 429)]
    pub forward_auth_deny_status: u16,
    /// The rate-limit fields of HTTP answers and of RLS's `response_headers_to_add`: `ietf`
    /// (`RateLimit-Policy` and `RateLimit`), `x-ratelimit` (`X-RateLimit-Limit`,
    /// `-Remaining` and `-Reset`, for clients written against them; `Reset` in seconds from
    /// now), `both`, or `none`. `Retry-After` goes on every 429 a wait can lift.
    #[arg(long, env = "TOLLGATE_RATE_LIMIT_HEADERS", default_value_t = HeaderStyle::Ietf)]
    pub rate_limit_headers: HeaderStyle,
    /// RLS descriptors whose hits are given back (Envoy's `is_negative_hits`, sent once a
    /// response shows a request cost less than it was charged): `refuse` them with
    /// `INVALID_ARGUMENT`, or `give-back` the hits to the buckets a check of the descriptor
    /// charges, never past full. Giving back trusts the caller, who could fill any bucket:
    /// only where no one but your proxies reaches the gRPC port.
    #[arg(long, env = "TOLLGATE_NEGATIVE_HITS", value_enum, default_value_t = NegativeHits::Refuse)]
    pub negative_hits: NegativeHits,
    /// Audit log (JSON lines): a file path, or `-` for stdout.
    #[arg(long, env = "TOLLGATE_AUDIT_LOG")]
    pub audit_log: Option<PathBuf>,
    /// The most buckets held in this process (memory store and emergency budgets).
    #[arg(long, env = "TOLLGATE_MAX_BUCKETS", default_value_t = 10_000_000)]
    pub max_buckets: usize,
    /// How long a charged request's `request_id` is remembered: a retried check inside it is
    /// not charged again, and a reservation can be settled (`POST /v1/settle`) within it. Give
    /// it the longest a reserved request may run. Up to a day.
    #[arg(long, env = "TOLLGATE_IDEMPOTENCY_WINDOW", default_value = "60s", value_parser = parse_timeout)]
    pub idempotency_window: Duration,
    /// The most leases of concurrency limits held in this process (the memory store's table,
    /// and apart from it the emergency table used while Redis is down); past it a lease
    /// request is answered 503 `lease_table_full`, never admitted.
    #[arg(long, env = "TOLLGATE_MAX_LEASES", default_value_t = 1_000_000,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub max_leases: u64,
    /// Threads deciding requests (default: one per core the process may use). With a Redis
    /// store on a small host that also runs Redis, one thread wakes less and costs less.
    #[arg(long, env = "TOLLGATE_THREADS", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub threads: Option<u16>,
    /// How the threads share the work: `shared`, one runtime whose threads take work from each
    /// other; or `per-core`, a runtime per thread, connections handed to the threads in turn
    /// and each kept on its thread, which costs less CPU per request and serves multiplexed
    /// gRPC faster, but cannot move a busy connection's work to an idle thread.
    #[arg(long, env = "TOLLGATE_RUNTIME", value_enum, default_value_t = RuntimeModel::Shared)]
    pub runtime: RuntimeModel,
    /// How log lines (on stderr) are written: `text`, for people; or `json`, one object per
    /// line with the level, target and fields at its top, for a log pipeline. `TOLLGATE_LOG`
    /// says which are written (default `info`).
    #[arg(long, env = "TOLLGATE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Send a span for each request answered to this OpenTelemetry collector, over OTLP/gRPC
    /// (`http://127.0.0.1:4317`) or as --trace-protocol says (`https://` checks the collector
    /// against the system's authorities). A request carrying its caller's trace context (W3C
    /// `traceparent` or B3 headers, as Envoy sends once it traces) gets a span in that trace,
    /// sampled as the caller's was. Off without it.
    #[arg(long, env = "TOLLGATE_TRACE_ENDPOINT", value_name = "URL")]
    pub trace_endpoint: Option<String>,
    /// How spans go to --trace-endpoint: `grpc` (OTLP/gRPC, a collector's port 4317) or
    /// `http/protobuf` (OTLP/HTTP, port 4318; to the URL's `/v1/traces` unless it has a path).
    #[arg(
        long,
        env = "TOLLGATE_TRACE_PROTOCOL",
        value_enum,
        default_value_t = crate::traces::TraceProtocol::Grpc,
        requires = "trace_endpoint"
    )]
    pub trace_protocol: crate::traces::TraceProtocol,
    /// The share of requests without a trace context that start a trace of their own (a
    /// caller's sampled trace is always followed): `0` to `1`, or `0%` to `100%`.
    #[arg(
        long,
        env = "TOLLGATE_TRACE_SAMPLE_RATIO",
        value_name = "RATIO",
        default_value = "1",
        requires = "trace_endpoint"
    )]
    pub trace_sample_ratio: crate::traces::SampleRatio,
    /// With an `https://` --trace-endpoint: trust the authorities of this PEM file (a private
    /// authority's) instead of the system's.
    #[arg(
        long,
        env = "TOLLGATE_TRACE_TLS_CA",
        value_name = "FILE",
        requires = "trace_endpoint"
    )]
    pub trace_tls_ca: Option<PathBuf>,
    /// With an `https://` --trace-endpoint: present this PEM client certificate to a
    /// collector that requires one (mutual TLS); needs --trace-tls-key.
    #[arg(
        long,
        env = "TOLLGATE_TRACE_TLS_CERT",
        value_name = "FILE",
        requires_all = ["trace_endpoint", "trace_tls_key"]
    )]
    pub trace_tls_cert: Option<PathBuf>,
    /// The client certificate's PEM private key.
    #[arg(
        long,
        env = "TOLLGATE_TRACE_TLS_KEY",
        value_name = "FILE",
        requires = "trace_tls_cert"
    )]
    pub trace_tls_key: Option<PathBuf>,
}

/// How `tollgate serve` spreads requests over its threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RuntimeModel {
    /// One tokio runtime whose threads steal work from each other: any thread may run any
    /// request, so an uneven spread of connections does not leave a thread idle.
    Shared,
    /// A single-threaded runtime per thread; connections are handed to the threads in turn
    /// and a connection, with every request on it, stays on its thread, so no thread hands
    /// work to another or wakes it for it. Connections are spread by count, not load: a few
    /// busy connections may share a thread while another serves idle ones.
    PerCore,
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// A line for people.
    Text,
    /// One JSON object per line.
    Json,
}

/// `tollgate check` flags.
#[derive(Debug, clap::Args)]
struct CheckArgs {
    /// The policy file or directory.
    #[arg(long)]
    config: PathBuf,
    /// The domain.
    #[arg(long)]
    domain: String,
    /// A descriptor, as `entry=value,entry=value` (repeatable).
    #[arg(long, required = true, value_parser = parse_descriptor)]
    descriptor: Vec<Vec<(String, String)>>,
    /// Tokens per matched limit.
    #[arg(long, default_value_t = 1)]
    cost: u64,
    /// How many times to send the request, back to back.
    #[arg(long, default_value_t = 1)]
    times: u32,
}

/// A connection timeout: more than nothing (a zero would close every connection at once) and
/// at most a day.
fn parse_timeout(text: &str) -> Result<Duration, String> {
    const LONGEST: Duration = Duration::from_secs(24 * 3600);
    match parse_duration(text)? {
        Duration::ZERO => Err("a timeout must be longer than 0".to_owned()),
        timeout if timeout > LONGEST => Err(format!("{text} is longer than a day (1440m)")),
        timeout => Ok(timeout),
    }
}

/// A shutdown delay: up to ten minutes, since a process that waits longer on SIGTERM is taken
/// for hung (Kubernetes' grace period, systemd's stop timeout) and killed before it drains.
fn parse_shutdown_delay(text: &str) -> Result<Duration, String> {
    match parse_duration(text)? {
        delay if delay > Duration::from_secs(600) => {
            Err(format!("{text} is longer than ten minutes (10m)"))
        }
        delay => Ok(delay),
    }
}

/// A rebalancing interval: from 10 ms (more often costs the global store more than it
/// helps) to a minute (less often leaves shares behind demand for too long).
fn parse_interval(text: &str) -> Result<Duration, String> {
    match parse_duration(text)? {
        interval if interval < Duration::from_millis(10) => {
            Err(format!("{text} is shorter than 10ms"))
        }
        interval if interval > Duration::from_secs(60) => Err(format!("{text} is longer than 1m")),
        interval => Ok(interval),
    }
}

/// A region's name: what `[A-Za-z0-9_.-]` can spell, up to 64 bytes, so it reads well in logs
/// and on the board.
fn parse_region(text: &str) -> Result<String, String> {
    let fits = !text.is_empty()
        && text.len() <= 64
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if fits {
        Ok(text.to_owned())
    } else {
        Err(format!(
            "{text:?} is not a region name (1 to 64 of A-Z a-z 0-9 _ . -)"
        ))
    }
}

/// The most hot keys reported per limit: each is two series, and a key new to a full summary
/// scans its `4 × N` counters.
const MOST_HOT_KEYS: usize = 100;

fn parse_hot_keys(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(count) if count <= MOST_HOT_KEYS => Ok(count),
        _ => Err(format!("expected 0 to {MOST_HOT_KEYS} keys, not {text}")),
    }
}

/// A ratio written as a decimal (`0.8`, `0.95`, `1`), in thousandths, read exactly.
pub(crate) fn parse_ratio(text: &str) -> Result<u32, String> {
    let refused = || format!("expected a decimal above 0 and at most 1, such as 0.8, not {text}");
    let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
    if whole.is_empty() && fraction.is_empty()
        || fraction.len() > 3
        || !whole
            .bytes()
            .chain(fraction.bytes())
            .all(|b| b.is_ascii_digit())
    {
        return Err(refused());
    }
    // Three places, padded: "0.8" is 0800 thousandths, "1" is 1000.
    let permille: u32 = format!("{whole}{fraction:0<3}")
        .parse()
        .map_err(|_| refused())?;
    match permille {
        1..=1_000 => Ok(permille),
        _ => Err(refused()),
    }
}

/// `HEADER[:TRUSTED]`: a header name, and how many trusted proxies' entries to pass over.
fn parse_address_source(text: &str) -> Result<ClientAddress, String> {
    let refused = || {
        format!(
            "expected HEADER or HEADER:TRUSTED, as in X-Forwarded-For:1 (at most 16), not {text}"
        )
    };
    let (header, trusted) = match text.split_once(':') {
        Some((header, trusted)) => (header, trusted.parse::<usize>().map_err(|_| refused())?),
        None => (text, 0),
    };
    if trusted > 16 || axum::http::HeaderName::from_bytes(header.as_bytes()).is_err() {
        return Err(refused());
    }
    Ok(ClientAddress {
        header: header.to_ascii_lowercase(),
        trusted,
        // From --forward-auth-trusted-proxies and --forward-auth-address-mask, once every
        // flag is read.
        proxies: Vec::new(),
        mask: None,
    })
}

/// `V4LEN,V6LEN`: prefix lengths within each family's width.
fn parse_address_mask(text: &str) -> Result<AddressMask, String> {
    let refused = || format!("expected V4LEN,V6LEN, as in 24,64 (at most 32 and 128), not {text}");
    let (v4, v6) = text.split_once(',').ok_or_else(refused)?;
    let (v4, v6) = (v4.trim().parse::<u8>(), v6.trim().parse::<u8>());
    match (v4, v6) {
        (Ok(v4 @ 0..=32), Ok(v6 @ 0..=128)) => Ok(AddressMask { v4, v6 }),
        _ => Err(refused()),
    }
}

/// A trusted proxy's network, as a `!cidr` condition writes it.
fn parse_network(text: &str) -> Result<tollgate_policy::Network, String> {
    text.trim().parse().map_err(|err| format!("{err}"))
}

fn parse_mapping(text: &str) -> Result<(String, String), String> {
    let (entry, header) = text
        .split_once('=')
        .ok_or_else(|| format!("expected ENTRY=HEADER, as in user=X-User-Id, not {text}"))?;
    if entry.is_empty() || header.is_empty() {
        return Err(format!(
            "expected ENTRY=HEADER, as in user=X-User-Id, not {text}"
        ));
    }
    Ok((entry.to_owned(), header.to_ascii_lowercase()))
}

fn parse_descriptor(text: &str) -> Result<Vec<(String, String)>, String> {
    text.split(',')
        .map(|pair| {
            pair.split_once('=')
                .filter(|(key, _)| !key.is_empty())
                .map(|(key, value)| (key.to_owned(), value.to_owned()))
                .ok_or_else(|| format!("expected entry=value, not {pair}"))
        })
        .collect()
}

/// Runs the command line and returns the process's exit status.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => serve_main(*args),
        Command::Validate {
            file,
            strict,
            format,
        } => crate::validate::run(&file, strict, format),
        Command::Check(args) => check(args),
        Command::Diff {
            old,
            new,
            json,
            deny_afresh,
        } => diff(&old, &new, json, deny_afresh),
        Command::Simulate(args) => crate::simulate::main(&args).map_err(anyhow::Error::from),
        Command::Bench(args) => crate::loadgen::main(&args),
        Command::Import {
            from:
                ImportFrom::Envoy {
                    files,
                    fixed_windows,
                    merge_domains,
                    out_dir,
                },
        } => import_envoy(&files, fixed_windows, merge_domains, out_dir.as_deref()),
        Command::Completions { shell } => completions(shell),
        Command::Schema => schema(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// Prints `shell`'s completion script. Written from a buffer: the generator panics on a
/// failed write, and a closed pipe (`| head`) is an error to report, not a crash.
fn completions(shell: clap_complete::Shell) -> Result<()> {
    use std::io::Write;
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "tollgate", &mut script);
    std::io::stdout()
        .write_all(&script)
        .context("cannot write the completion script")
}

fn schema() -> Result<()> {
    use std::io::Write;
    std::io::stdout()
        .write_all(tollgate_policy::JSON_SCHEMA.as_bytes())
        .context("cannot write the schema")
}

fn diff(old: &Path, new: &Path, json: bool, deny_afresh: bool) -> Result<()> {
    let old = tollgate_policy::validate(old).map_err(|err| anyhow!("{err}"))?;
    let new = tollgate_policy::validate(new).map_err(|err| anyhow!("{err}"))?;
    let diff = crate::diff::diff(&old, &new);
    if json {
        let text = serde_json::to_string_pretty(&diff).context("cannot write the diff")?;
        println!("{text}");
    } else {
        print!("{}", crate::diff::render(&diff));
    }
    let afresh: Vec<&str> = diff.afresh().map(|l| l.name.as_str()).collect();
    if deny_afresh && !afresh.is_empty() {
        bail!(
            "the buckets of {} would start afresh, full for every subject at once \
             (--deny-afresh)",
            afresh.join(", ")
        );
    }
    Ok(())
}

/// Logs what `tollgate validate` would warn about in `policy`, with the file of a policy
/// directory each warning is about.
fn log_warnings(policy: &tollgate_policy::Policy) {
    for (file, warning) in tollgate_policy::lint_by_file(policy, SystemWallClock.now()) {
        match file {
            Some(file) => tracing::warn!(%warning, file, "policy warning"),
            None => tracing::warn!(%warning, "policy warning"),
        }
    }
}

fn check(args: CheckArgs) -> Result<()> {
    let engine = PolicyEngine::from_file(&args.config, EngineOptions::default())
        .map_err(|err| anyhow!("{err}"))?;
    for attempt in 1..=args.times {
        let outcome = engine
            .decide(&args.domain, &args.descriptor, args.cost, None)
            .map_err(|err| anyhow!("{err}"))?;
        let verdict = if outcome.allowed {
            "allowed"
        } else {
            "rejected"
        };
        println!("#{attempt} {verdict} (policy {})", outcome.policy_version);
        if outcome.unmatched() {
            println!("    no limit applies");
        }
        for limit in &outcome.limits {
            match &limit.decision {
                Some(d) => println!(
                    "    {} [{}] {} remaining {}/{} reset in {:?}{}",
                    limit.name,
                    limit.mode,
                    if d.allowed() { "allowed" } else { "rejected" },
                    d.remaining(),
                    d.capacity(),
                    d.reset_after(),
                    match d.retry_after() {
                        Some(wait) => format!(", retry after {wait:?}"),
                        None if d.is_denied() => ", denied (no wait lifts it)".to_owned(),
                        None => String::new(),
                    },
                ),
                None => println!(
                    "    {} [{}] exempted by {}",
                    limit.name,
                    limit.mode,
                    limit.exempted_by.as_deref().unwrap_or("?")
                ),
            }
        }
    }
    Ok(())
}

fn import_envoy(
    paths: &[PathBuf],
    fixed_windows: bool,
    merge_domains: bool,
    out_dir: Option<&Path>,
) -> Result<()> {
    let mut files = Vec::new();
    for path in paths {
        if path.is_dir() {
            let found = tollgate_policy::policy_files_in(path).map_err(|err| anyhow!("{err}"))?;
            if found.is_empty() {
                bail!("{} holds no .yaml or .yml file", path.display());
            }
            files.extend(found);
        } else {
            files.push(path.clone());
        }
    }
    let mut texts = Vec::with_capacity(files.len());
    for file in &files {
        let text = std::fs::read_to_string(file)
            .with_context(|| format!("cannot read {}", file.display()))?;
        texts.push((file.display().to_string(), text));
    }
    let named: Vec<(&str, &str)> = texts
        .iter()
        .map(|(n, t)| (n.as_str(), t.as_str()))
        .collect();
    let options = tollgate_policy::ImportOptions::default()
        .fixed_windows(fixed_windows)
        .merge_domains(merge_domains);
    let imported =
        tollgate_policy::import_envoy_files(&named, options).map_err(|err| anyhow!("{err}"))?;
    match out_dir {
        Some(dir) => write_policy_directory(dir, &imported.files)?,
        None => print!("{}", imported.policy),
    }
    for note in &imported.notes {
        eprintln!("note: {note}");
    }
    let from = match &*files {
        [one] => one.display().to_string(),
        many => format!("{} files", many.len()),
    };
    eprintln!(
        "imported {} limits from {from}; {} notes on what could not be expressed exactly",
        imported.limits,
        imported.notes.len()
    );
    Ok(())
}

/// Writes `files` into `dir` (made if missing), each created new: an import must not overwrite
/// a team's file, nor merge into a policy directory that already holds one of the names.
fn write_policy_directory(dir: &Path, files: &[(String, String)]) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot make {}", dir.display()))?;
    if let Some((name, _)) = files.iter().find(|(name, _)| dir.join(name).exists()) {
        bail!(
            "{} already exists: write the import to a new or empty directory",
            dir.join(name).display()
        );
    }
    for (name, text) in files {
        use std::io::Write;
        let path = dir.join(name);
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .and_then(|mut file| file.write_all(text.as_bytes()))
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    eprintln!(
        "wrote {} to {}: `tollgate validate {}` reads them as one policy",
        crate::validate::counted(files.len(), "file"),
        dir.display(),
        dir.display()
    );
    Ok(())
}

fn serve_main(args: ServeArgs) -> Result<()> {
    init_tracing(args.log_format);
    if args.runtime == RuntimeModel::PerCore {
        // This thread serves too, beside the ones `serve` starts.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the async runtime")?;
        return runtime.block_on(async { serve(args, shutdown_signals()?).await });
    }
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = args.threads {
        runtime.worker_threads(usize::from(threads));
    }
    let runtime = runtime
        // Named for `top -H` and the like (a thread name holds 15 bytes).
        .thread_name("tollgate-worker")
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async { serve(args, shutdown_signals()?).await })
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("TOLLGATE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Logs go to stderr; stdout carries the start-up banner and, with --audit-log -, the audit.
    // Coloured on a terminal only: the journal, a log file or a collector would keep the escape
    // codes as text around every field.
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => logs.try_init(),
        LogFormat::Json => logs.json().flatten_event(true).try_init(),
    };
}

/// Watches for SIGINT and SIGTERM from now on: an item for each. The handlers are in place
/// when this returns, before the server says it listens: a signal caught only once the stream
/// was first polled would, if it came sooner, end the process at once (the signals' default),
/// not after the requests in flight.
fn shutdown_signals() -> Result<impl Stream<Item = ()> + Send + Unpin + 'static> {
    #[cfg(unix)]
    let signals = {
        use tokio::signal::unix::{SignalKind, signal};
        let interrupt = signal(SignalKind::interrupt()).context("cannot watch for SIGINT")?;
        let terminate = signal(SignalKind::terminate()).context("cannot watch for SIGTERM")?;
        futures_util::stream::unfold(
            (interrupt, terminate),
            |(mut interrupt, mut terminate)| async move {
                tokio::select! {
                    _ = interrupt.recv() => {},
                    _ = terminate.recv() => {},
                }
                Some(((), (interrupt, terminate)))
            },
        )
    };
    #[cfg(not(unix))]
    let signals = futures_util::stream::unfold((), |()| async {
        let _ = tokio::signal::ctrl_c().await;
        Some(((), ()))
    });
    Ok(Box::pin(signals))
}

/// Resolves when the server is to stop accepting: at the first of `signals`, or with a
/// `delay`, that long after it, out of rotation meanwhile (see [`crate::Rotation`]), or at a
/// second signal, for an operator who will not wait.
async fn stop_after(
    mut signals: impl Stream<Item = ()> + Unpin,
    delay: Duration,
    state: Arc<AppState>,
) {
    signals.next().await;
    if !delay.is_zero() {
        state.rotation().leave();
        tracing::info!(
            delay = ?delay,
            "shutting down: out of rotation (/readyz and gRPC health answer not ready), \
             still serving until the delay is over"
        );
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            _ = signals.next() => tracing::info!("a second signal: not waiting out the delay"),
        }
    }
    tracing::info!("shutting down: finishing requests in flight");
}

/// On SIGHUP, until dropped: reopens the audit log file (after logrotate renamed it away, as
/// nginx reopens its logs), reads the listeners' TLS files again (`tls`), and reloads the
/// policy file when there is one (`reload`), as Prometheus and nginx reload theirs. The reload
/// is forced: it also puts the file back in force after a rollback, which the file watcher
/// leaves alone until the file changes. A file that fails validation is refused as on any
/// reload, and the version in force stays. With no policy file, audit log nor TLS, SIGHUP
/// keeps its default (it ends the process).
fn on_hangup(
    engine: Arc<PolicyEngine>,
    reload: bool,
    audit: Option<Arc<AuditLog>>,
    tls: Vec<Arc<ListenerTls>>,
) -> Result<Option<AbortOnDrop>> {
    if !reload && audit.is_none() && tls.is_empty() {
        return Ok(None);
    }
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut hangups = signal(SignalKind::hangup()).context("cannot watch for SIGHUP")?;
        let task = tokio::spawn(async move {
            while hangups.recv().await.is_some() {
                // First, so that the reload's own line goes to the new file.
                if let Some(Err(err)) = audit.as_ref().map(|audit| audit.reopen()) {
                    tracing::warn!(
                        error = %err,
                        "SIGHUP: cannot reopen the audit log; lines keep going to the file open"
                    );
                }
                for listener in &tls {
                    listener.report(&listener.reload(), "SIGHUP");
                }
                if !reload {
                    continue;
                }
                match engine.reload() {
                    Ok(policy) => {
                        tracing::info!("SIGHUP: policy version {} in force", policy.version());
                        log_warnings(&policy);
                    }
                    Err(err) => tracing::warn!(
                        "SIGHUP: policy refused, version {} stays in force: {err}",
                        engine.current().version()
                    ),
                }
            }
        });
        Ok(Some(AbortOnDrop(task)))
    }
    #[cfg(not(unix))]
    {
        let _ = (engine, audit, tls);
        Ok(None)
    }
}

/// A listener's TLS from its flags (certificate, key, client authorities), read now so that
/// files that cannot be used stop the start with one line naming the file.
fn listener_tls(
    flag: &str,
    (cert, key, client_ca): (&Option<PathBuf>, &Option<PathBuf>, &Option<PathBuf>),
    make: fn(ServerTlsFiles) -> Result<ListenerTls, crate::tls::TlsError>,
) -> Result<Option<Arc<ListenerTls>>> {
    // clap's `requires` pairs the certificate with its key, and the authorities with both.
    let (Some(cert), Some(key)) = (cert, key) else {
        return Ok(None);
    };
    let files = ServerTlsFiles {
        cert: cert.clone(),
        key: key.clone(),
        client_ca: client_ca.clone(),
    };
    let tls = make(files).with_context(|| format!("cannot serve TLS ({flag})"))?;
    Ok(Some(Arc::new(tls)))
}

/// How the banner says a listener speaks TLS.
fn tls_note(tls: Option<&ListenerTls>) -> &'static str {
    match tls {
        Some(tls) if tls.files().client_ca.is_some() => " (TLS, client certificates required)",
        Some(_) => " (TLS)",
        None => "",
    }
}

/// A task that ends when this is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Sets everything up from `args`, prints where it listens, and serves until the first of
/// `signals` (and `--shutdown-delay` after it).
///
/// # Errors
///
/// A bad policy, an unusable store URL, a port in use: one line each.
pub async fn serve(
    args: ServeArgs,
    signals: impl Stream<Item = ()> + Send + Unpin + 'static,
) -> Result<()> {
    // `--admin-token "$TOKEN"` with TOKEN unset must not quietly stand for "no token", nor for
    // a token that an absent credential matches: both would surprise whoever set it.
    if args
        .admin_token
        .as_deref()
        .is_some_and(|token| token.trim().is_empty())
    {
        bail!(
            "--admin-token (TOLLGATE_ADMIN_TOKEN) is empty: give a non-empty token, or leave it \
             unset to keep the admin endpoints to loopback clients"
        );
    }
    // The reason is what the audit log keeps of why nothing was rejected.
    if let Some(reason) = &args.shadow_all {
        crate::http::admin::check_reason(reason)
            .map_err(|problem| anyhow!("--shadow-all (TOLLGATE_SHADOW_ALL): {problem}"))?;
    }
    let mut options = EngineOptions::default()
        .idempotency_window(args.idempotency_window)
        .max_buckets(args.max_buckets)
        .max_leases(usize::try_from(args.max_leases).unwrap_or(usize::MAX));
    if args.store != "memory" {
        // A reload must not put in force a limit Redis cannot keep exactly: every decision on
        // it would fail. (The version served at start is checked below, with a message that
        // names the store.)
        options = options.limit_check(tollgate_redis::check_limit);
    }
    let mut audit_log = None;
    if let Some(path) = &args.audit_log {
        let audit = Arc::new(if path.as_os_str() == "-" {
            AuditLog::stdout(Box::new(SystemWallClock))
        } else {
            AuditLog::file(path, Box::new(SystemWallClock))
                .with_context(|| format!("cannot open the audit log {}", path.display()))?
        });
        options = options.audit(Arc::clone(&audit));
        audit_log = Some(audit);
    }
    let engine = match &args.config {
        Some(path) => PolicyEngine::from_file(path, options).map_err(|err| anyhow!("{err}"))?,
        None => {
            let policy = compile("<built-in demo policy>", DEMO_POLICY)
                .map_err(|err| anyhow!("the built-in demo policy is invalid: {err}"))?;
            PolicyEngine::new(policy, options)
        }
    };
    let engine = Arc::new(engine);
    log_warnings(&engine.current());
    if let Some(reason) = &args.shadow_all {
        engine.set_shadow_all(Some(reason));
        tracing::warn!(
            reason = reason.as_str(),
            "every limit is in shadow mode (--shadow-all): nothing is rejected until \
             POST /v1/policy/shadow-all turns it off"
        );
    }
    // Keep the watcher alive as long as the server: dropping it stops the watching.
    let _watcher = match &args.config {
        Some(_) => Some(
            PolicyWatcher::start(Arc::clone(&engine), Duration::from_millis(200))
                .map_err(|err| anyhow!("{err}"))?,
        ),
        None => None,
    };
    let http_tls = listener_tls(
        "--http-tls-cert",
        (
            &args.http_tls_cert,
            &args.http_tls_key,
            &args.http_tls_client_ca,
        ),
        ListenerTls::for_http,
    )?;
    let grpc_tls = listener_tls(
        "--grpc-tls-cert",
        (
            &args.grpc_tls_cert,
            &args.grpc_tls_key,
            &args.grpc_tls_client_ca,
        ),
        ListenerTls::for_grpc,
    )?;
    let tls: Vec<_> = http_tls.iter().chain(&grpc_tls).cloned().collect();
    let _tls_watch = (!tls.is_empty()).then(|| {
        AbortOnDrop(tokio::spawn(crate::tls::watch(
            tls.clone(),
            crate::tls::LOOK_EVERY,
        )))
    });
    let _hangups = on_hangup(Arc::clone(&engine), args.config.is_some(), audit_log, tls)?;

    if args.token_batch > 0 && args.token_batch_ttl >= args.idempotency_window {
        bail!(
            "--token-batch-ttl {:?} must be shorter than --idempotency-window {:?}: past it \
             Redis forgets what gives a batch's unused tokens back",
            args.token_batch_ttl,
            args.idempotency_window
        );
    }
    let backend = if args.store == "memory" {
        if args.store_tls_ca.is_some() || args.store_tls_cert.is_some() {
            bail!("--store-tls-ca/--store-tls-cert are for a rediss:// store, not --store memory");
        }
        if args.token_batch > 0 {
            bail!("--token-batch is for a Redis store: the memory store needs no batches");
        }
        Backend::Memory
    } else {
        let policy = engine.current();
        for limit in policy.limits() {
            // Rate limits only: concurrency limits hold leases, not buckets.
            let params = limit
                .rate()
                .into_iter()
                .chain(limit.overrides().iter().filter_map(|o| o.rate()));
            for params in params {
                tollgate_redis::check_limit(params)
                    .with_context(|| format!("limit {} cannot be kept in Redis", limit.name()))?;
            }
        }
        let mut tls = TlsFiles::new();
        if let Some(ca) = &args.store_tls_ca {
            tls = tls.with_ca(ca);
        }
        if let (Some(cert), Some(key)) = (&args.store_tls_cert, &args.store_tls_key) {
            tls = tls.with_client_cert(cert, key);
        }
        let mut config = RedisConfig::default()
            .with_timeout(args.store_timeout)
            .with_idempotency_window(args.idempotency_window)
            .with_rejection_memory(args.rejection_memory)
            .with_token_batches(args.token_batch, args.token_batch_ttl)
            .with_tls(tls);
        if let Some(password) = &args.store_sentinel_password {
            if !args.store.contains("+sentinel://") {
                bail!(
                    "--store-sentinel-password is for a redis+sentinel:// or rediss+sentinel:// \
                     store"
                );
            }
            config = config.with_sentinel_password(password);
        }
        let store = RedisStore::connect(&args.store, config)
            .await
            .with_context(|| format!("cannot use the store {}", redact(&args.store)))?;
        Backend::Redis(Box::new(store))
    };
    let store_name = match &backend {
        Backend::Memory => "memory".to_owned(),
        Backend::Redis(_) => redact(&args.store),
    };
    let shares = match &args.global_store {
        Some(url) => Some(Arc::new(global_shares(&args, url, &engine).await?)),
        None => None,
    };
    let traces = match &args.trace_endpoint {
        Some(endpoint) => Some(Arc::new(
            crate::traces::Traces::start(
                endpoint,
                args.trace_protocol,
                args.trace_sample_ratio,
                &trace_tls(&args),
            )
            .map_err(|err| anyhow!("{err}"))?,
        )),
        None => None,
    };
    let mut decider = Decider::new(Arc::clone(&engine), backend)
        .with_hot_keys(args.hot_keys, args.hot_keys_window)
        .with_traces(traces.clone());
    if let Some(shares) = &shares {
        decider = decider.with_global(Arc::clone(shares));
    }
    let decider = Arc::new(decider);
    // On a shared store, the fleet's incident switch is read every second; stopped with the
    // server.
    let _fleet_switch = AbortOnDrop(tokio::spawn(Arc::clone(&decider).follow_fleet_switch()));

    let deny = StatusCode::from_u16(args.forward_auth_deny_status)
        .ok()
        .filter(StatusCode::is_client_error)
        .ok_or_else(|| {
            anyhow!(
                "--forward-auth-deny-status {} is not a 4xx status (use 429, or 403 for nginx)",
                args.forward_auth_deny_status
            )
        })?;
    let http_options = HttpOptions {
        // A token read from a file or a secret often ends in a newline, which no header value
        // can carry (proxies and clients strip it): compared as written, it would match nothing.
        admin_token: args
            .admin_token
            .as_deref()
            .map(|token| token.trim().to_owned()),
        forward_auth_headers: args.forward_auth_headers.clone(),
        forward_auth_deny: deny,
        rate_limit_headers: args.rate_limit_headers,
        negative_hits: args.negative_hits,
        forward_auth_address: args
            .forward_auth_address
            .clone()
            .map(|source| ClientAddress {
                proxies: args.forward_auth_trusted_proxies.clone(),
                mask: args.forward_auth_address_mask,
                ..source
            }),
    };
    crate::metrics::set_near_limit_ratio(args.near_limit_ratio);
    let metrics = match crate::metrics::install() {
        Ok(handle) => Some(handle),
        Err(err) => {
            tracing::warn!(error = %err, "metrics disabled");
            None
        }
    };
    let limits = ConnectionLimits {
        max_connections: max_connections(args.max_connections),
        header_timeout: args.header_timeout,
        idle_timeout: args.idle_timeout,
        drain_timeout: args.drain_timeout,
    };
    let state = Arc::new(
        AppState::new(Arc::clone(&decider), metrics, http_options)
            .with_connection_limits(limits)
            .with_tls(http_tls.clone(), grpc_tls.clone())
            .with_traces(traces.clone())
            .with_rlqs(RlqsOptions {
                abandon_after: args.rlqs_abandon_after,
                max_buckets: args.rlqs_max_buckets as usize,
                renew_every: args.rlqs_renew_every,
            }),
    );

    let http = TcpListener::bind(args.http)
        .await
        .with_context(|| format!("cannot listen on {} for HTTP (--http)", args.http))?;
    let grpc = TcpListener::bind(args.grpc)
        .await
        .with_context(|| format!("cannot listen on {} for gRPC (--grpc)", args.grpc))?;
    let http_addr = http.local_addr().context("HTTP listener address")?;
    let grpc_addr = grpc.local_addr().context("gRPC listener address")?;

    let policy = engine.current();
    if args.config.is_none() {
        println!("no --config given: serving the built-in demo policy\n");
        println!("{}", DEMO_POLICY.trim_end());
        println!();
    }
    println!(
        "tollgate {}: policy {} ({}), store {store_name}",
        env!("CARGO_PKG_VERSION"),
        policy.version(),
        policy.source()
    );
    let scheme = if http_tls.is_some() { "https" } else { "http" };
    println!(
        "  HTTP  {scheme}://{http_addr}{}  (/v1/check, /v1/explain, /v1/leases, /v1/forward-auth/{{domain}}, /metrics, /healthz)",
        tls_note(http_tls.as_deref())
    );
    println!(
        "  gRPC  {grpc_addr}{}  (envoy.service.ratelimit.v3.RateLimitService)",
        tls_note(grpc_tls.as_deref())
    );
    println!("  live dashboard  {scheme}://{http_addr}/dashboard");
    println!("try:");
    // A server asking for client certificates refuses curl without one.
    let curl_tls = match &args.http_tls_client_ca {
        Some(_) => " --cert client.pem --key client.key",
        None => "",
    };
    println!(
        "  curl -si{curl_tls} -X POST {scheme}://{http_addr}/v1/check -H 'content-type: application/json' \\\n    -d '{}'",
        example_body(&policy)
    );
    if http_tls.is_some() {
        println!(
            "  (a certificate from a private authority: add --cacert with the authority's PEM)"
        );
    }
    if let Some(url) = &args.global_store {
        let global = policy
            .limits()
            .iter()
            .filter(|l| l.scope() == Scope::Global)
            .count();
        println!(
            "  global limits  {global} on {} (region {}, rebalanced every {:?})",
            redact(url),
            args.region,
            args.rebalance_interval
        );
    }
    println!(
        "listening http={http_addr} grpc={grpc_addr} max_connections={}",
        limits.max_connections
    );

    let (stop_rounds, rounds_stopped) = tokio::sync::watch::channel(false);
    let rounds = shares
        .clone()
        .map(|shares| tokio::spawn(crate::global::rebalance(shares, rounds_stopped)));

    let shutdown = stop_after(signals, args.shutdown_delay, Arc::clone(&state));
    match args.runtime {
        RuntimeModel::Shared => crate::run(state, http, grpc, shutdown).await,
        RuntimeModel::PerCore => {
            let threads = match args.threads {
                Some(threads) => usize::from(threads),
                None => std::thread::available_parallelism().map_or(1, usize::from),
            };
            crate::run_per_core(state, http, grpc, threads, shutdown).await
        }
    }
    .map_err(|err| anyhow!("{err}"))?;
    // The requests are done: the reservoirs of global limits go back to the global store.
    let _ = stop_rounds.send(true);
    if let Some(rounds) = rounds {
        let _ = rounds.await;
    }
    // Tokens this process still holds in batches go back too, so that
    // the other processes can admit them at once rather than when their buckets refill.
    if let Backend::Redis(store) = decider.backend() {
        let returned = store.return_token_batches().await;
        if returned > 0 {
            tracing::info!(batches = returned, "gave back the unused tokens of batches");
        }
    }
    // The last requests' spans go out before the process does. Waiting on the collector
    // blocks, so off this runtime's thread.
    if let Some(traces) = traces {
        let _ = tokio::task::spawn_blocking(move || traces.shutdown()).await;
    }
    Ok(())
}

/// The trace exporter's TLS files, as the `--trace-tls-*` flags give them.
fn trace_tls(args: &ServeArgs) -> crate::traces::TraceTls {
    crate::traces::TraceTls {
        ca: args.trace_tls_ca.clone(),
        identity: args.trace_tls_cert.clone().zip(args.trace_tls_key.clone()),
    }
}

/// Connects to the global store of `--global-store` and makes this process's shares of it.
async fn global_shares(
    args: &ServeArgs,
    url: &str,
    engine: &PolicyEngine,
) -> Result<crate::global::Shares> {
    let policy = engine.current();
    for limit in policy
        .limits()
        .iter()
        .filter(|l| l.scope() == Scope::Global)
    {
        let params = limit
            .rate()
            .into_iter()
            .chain(limit.overrides().iter().filter_map(|o| o.rate()));
        for params in params {
            tollgate_redis::check_limit(params).with_context(|| {
                format!("global limit {} cannot be kept in Redis", limit.name())
            })?;
        }
    }
    // The reservoirs' charges carry request ids, which the memory of rejections and token
    // batches leave alone anyway; neither is wanted on a store only rounds call.
    let config = RedisConfig::default()
        .with_timeout(args.global_store_timeout)
        .with_idempotency_window(args.idempotency_window)
        .with_rejection_memory(0);
    let store = RedisStore::connect(url, config)
        .await
        .with_context(|| format!("cannot use the global store {}", redact(url)))?;
    if !policy.has_global() {
        tracing::warn!(
            "--global-store is set but no limit of the policy is `scope: global`: it is used \
             once one is"
        );
    }
    let options = tollgate_regional::Options {
        interval: args.rebalance_interval,
        abandon_after: args.global_abandon_after,
        max_keys: args.global_max_keys as usize,
        ..tollgate_regional::Options::default()
    };
    Ok(crate::global::shares(store, &args.region, options))
}

/// Descriptors the process needs beside its connections: listeners, Redis, the policy file's
/// watch, logs.
const SPARE_DESCRIPTORS: u64 = 64;

/// The bound on each listener's connections: `asked`, or by default 10,000 or as many as the
/// open-file limit holds on both listeners, whichever is fewer. The limit is raised first to
/// what the system allows this process; an `asked` bound it cannot hold is kept, with a warning.
///
/// Every connection is a descriptor, and a common default of 1,024 would refuse clients at
/// accept long before the bound. The soft limit is there to be raised up to the hard one by the
/// process that needs it, as Go's runtime and nginx's `worker_rlimit_nofile` do; a default
/// bound drawn from the limit is HAProxy's way, so that a host with a low limit still gets a
/// bound that holds, without a warning at every start.
fn max_connections(asked: Option<u32>) -> usize {
    let fits = raise_open_file_limit().map(|limit| limit.saturating_sub(SPARE_DESCRIPTORS) / 2);
    match asked {
        None => {
            let default = ConnectionLimits::default().max_connections as u64;
            usize::try_from(fits.map_or(default, |fits| fits.clamp(1, default)))
                .unwrap_or(usize::MAX)
        }
        Some(asked) => {
            if let Some(fits) = fits
                && u64::from(asked) > fits
            {
                tracing::warn!(
                    max_connections = asked,
                    open_file_limit = fits * 2 + SPARE_DESCRIPTORS,
                    "the open-file limit cannot hold --max-connections on both listeners: \
                     clients past it are refused at accept; raise the limit or lower the bound"
                );
            }
            asked as usize
        }
    }
}

/// Sets the soft open-file limit to the hard one; returns the limit then in force (`None`: no
/// limit, or none this platform reports).
#[cfg(target_os = "linux")]
fn raise_open_file_limit() -> Option<u64> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    // A hard limit of "unlimited" is not one the kernel lets a soft limit take for files.
    if let (Some(current), Some(maximum)) = (limit.current, limit.maximum)
        && current < maximum
    {
        let raised = rustix::process::Rlimit {
            current: Some(maximum),
            maximum: Some(maximum),
        };
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => limit = raised,
            Err(err) => tracing::debug!(error = %err, "cannot raise the open-file limit"),
        }
    }
    limit.current
}

#[cfg(not(target_os = "linux"))]
fn raise_open_file_limit() -> Option<u64> {
    None
}

/// A request body that matches the policy's first limit, for the banner's example.
fn example_body(policy: &tollgate_policy::Policy) -> String {
    let Some(limit) = policy.limits().first() else {
        return r#"{"domain":"api","descriptors":[{"user":"alice"}]}"#.to_owned();
    };
    let mut entries: Vec<String> = limit
        .when()
        // A prefix is itself a value that starts with it.
        .map(|(key, test)| format!("\"{key}\":\"{}\"", test.text()))
        .collect();
    entries.extend(limit.key().map(|key| format!("\"{key}\":\"alice\"")));
    format!(
        "{{\"domain\":\"{}\",\"descriptors\":[{{{}}}]}}",
        limit.domain(),
        entries.join(",")
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn ratios_are_read_exactly_in_thousandths() {
        for (text, permille) in [("0.8", 800), ("0.95", 950), ("1", 1_000), ("1.000", 1_000)] {
            assert_eq!(parse_ratio(text), Ok(permille), "{text}");
        }
        for (text, permille) in [(".5", 500), ("0.001", 1), ("00.25", 250)] {
            assert_eq!(parse_ratio(text), Ok(permille), "{text}");
        }
        for bad in [
            "0", "0.0", "1.001", "2", "0.0005", "", ".", "-0.5", "0.8x", "1e-1", "80%",
        ] {
            assert!(parse_ratio(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn durations_are_held_to_their_bounds() {
        let ms = Duration::from_millis;
        assert!(parse_timeout("0s").is_err());
        assert_eq!(parse_timeout("1ms"), Ok(ms(1)));
        assert_eq!(parse_timeout("1d"), Ok(ms(86_400_000)));
        assert_eq!(
            parse_timeout("86400001ms"),
            Err("86400001ms is longer than a day (1440m)".to_owned())
        );
        assert_eq!(parse_shutdown_delay("0s"), Ok(Duration::ZERO));
        assert_eq!(parse_shutdown_delay("10m"), Ok(ms(600_000)));
        assert!(parse_shutdown_delay("600001ms").is_err());
        assert_eq!(parse_interval("10ms"), Ok(ms(10)));
        assert_eq!(
            parse_interval("9ms"),
            Err("9ms is shorter than 10ms".to_owned())
        );
        assert_eq!(parse_interval("1m"), Ok(ms(60_000)));
        assert_eq!(
            parse_interval("60001ms"),
            Err("60001ms is longer than 1m".to_owned())
        );
        for unreadable in ["", "5", "soon", "-1s"] {
            assert!(parse_timeout(unreadable).is_err(), "{unreadable}");
            assert!(parse_shutdown_delay(unreadable).is_err(), "{unreadable}");
            assert!(parse_interval(unreadable).is_err(), "{unreadable}");
        }
    }

    #[test]
    fn region_names_are_short_and_plain() {
        for good in ["eu-west-1", "us_east.2", "a", &"r".repeat(64)] {
            assert_eq!(parse_region(good).as_deref(), Ok(good), "{good}");
        }
        for bad in ["", &"r".repeat(65), "eu west", "eu/west", "région", "a:b"] {
            assert!(parse_region(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn hot_keys_are_counted_up_to_a_hundred() {
        assert_eq!(parse_hot_keys("0"), Ok(0));
        assert_eq!(parse_hot_keys("100"), Ok(100));
        for bad in ["101", "-1", "ten", ""] {
            assert!(parse_hot_keys(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn an_address_header_names_how_many_proxies_to_pass_over() {
        let source = |text| parse_address_source(text).map(|a| (a.header, a.trusted));
        assert_eq!(source("X-Real-IP"), Ok(("x-real-ip".to_owned(), 0)));
        assert_eq!(
            source("X-Forwarded-For:16"),
            Ok(("x-forwarded-for".to_owned(), 16))
        );
        for bad in [
            "X-Forwarded-For:17",
            "X-Forwarded-For:",
            "X-Forwarded-For:-1",
            "bad header",
            "",
        ] {
            assert!(source(bad).is_err(), "{bad}");
        }
        let mask = |text| parse_address_mask(text).map(|m| (m.v4, m.v6));
        assert_eq!(mask("24,64"), Ok((24, 64)));
        assert_eq!(mask(" 0 , 0 "), Ok((0, 0)));
        assert_eq!(mask("32,128"), Ok((32, 128)));
        for bad in ["33,64", "24,129", "24", "24;64", "a,b", "-1,64"] {
            assert!(mask(bad).is_err(), "{bad}");
        }
        assert!(parse_network(" 10.0.0.0/8 ").is_ok());
        assert!(parse_network("10.0.0.0/33").is_err());
    }

    #[test]
    fn mappings_and_descriptors_name_every_entry() {
        assert_eq!(
            parse_mapping("user=X-User-Id"),
            Ok(("user".to_owned(), "x-user-id".to_owned()))
        );
        for bad in ["user", "=X-User-Id", "user="] {
            assert!(parse_mapping(bad).is_err(), "{bad}");
        }
        let pair = |k: &str, v: &str| (k.to_owned(), v.to_owned());
        assert_eq!(
            parse_descriptor("user=alice,path=/a=b,empty="),
            Ok(vec![
                pair("user", "alice"),
                pair("path", "/a=b"),
                pair("empty", "")
            ])
        );
        for bad in ["user", "=alice", "user=alice,", "user=alice,plan"] {
            assert!(parse_descriptor(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_banner_example_matches_the_first_limit() {
        let policy = |text| compile("policy.yaml", text).map_err(|err| err.to_string());
        let empty = policy("version: \"1\"\nlimits: []\n");
        assert_eq!(
            empty.map(|p| example_body(&p)),
            Ok(r#"{"domain":"api","descriptors":[{"user":"alice"}]}"#.to_owned())
        );
        let guarded = policy(
            "version: \"1\"\nlimits:\n  - name: uploads\n    domain: files\n    when: {method: POST}\n    key: [user, bucket]\n    capacity: 5\n    refill: 1/s\n",
        );
        assert_eq!(
            guarded.map(|p| example_body(&p)),
            Ok(
                r#"{"domain":"files","descriptors":[{"method":"POST","user":"alice","bucket":"alice"}]}"#
                    .to_owned()
            )
        );
    }
}
