//! `RedisStore`: buckets in Redis or Redis Cluster, decided by one Lua script per slot.
//!
//! Each decision runs in an `EVALSHA` of `scripts/take.lua` (falling back to an `EVAL` of its
//! source on `NOSCRIPT`, so `SCRIPT FLUSH` and restarts are survived): the read, the decision
//! and the write happen inside Redis in one atomic step, so processes sharing a Redis can never
//! over-admit between a read and a write. Concurrent callers share one multiplexed connection
//! per node, so their scripts are pipelined onto the wire together without a connection per
//! request, and on a single node concurrent decisions share script calls (see `batch`).
//!
//! A bucket is a token bucket, a fixed or sliding window (the core's `window`) or a sliding log
//! (its `sliding_log`): the script decides every kind, so a request mixing them is still one
//! call per slot, all or nothing.
//!
//! A multi-bucket request whose keys share a slot (always, on a single node) is one script call,
//! all or nothing. Keys in different cluster slots are decided in parallel, one call per slot;
//! if any slot rejects or cannot decide, the slots that charged are refunded (by the same
//! script; best effort after a failure): the store may under-admit for the moment between
//! charge and refund, never over-admit. A window is refunded from the window its take charged
//! (the take's reply names it; a log's, the millisecond), only while its state still counts
//! that window (a log, while it holds that millisecond's entry), and reports its standing after
//! the refund. With a request id, a refund gives back only while no retry's
//! reply rests on the charge (see `scripts/take.lua`). Give the keys of one subject a shared
//! `{hash tag}` to keep them in one slot.
//!
//! A take may name the bucket's earlier self ([`tollgate::Carry`]: the same subject under a
//! limit's parameters before a policy change). Processes sharing Redis change policy at their
//! own moments and cannot rewrite millions of keys, so the script reads the old bucket beside
//! the new one and decides on the emptier of the two, the old one carried over as SPEC §2 says
//! (refilled under its parameters up to the change, clamped to the new capacity, refilled under
//! the new ones since). The old key must share the new one's slot; in a cluster, one that does
//! not is not read. Windows carry nothing over: a window's take with a carry, or a token
//! bucket's carrying a window over, is decided as if it carried nothing.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::future::join_all;
use redis::aio::ConnectionManagerConfig;
use redis::sentinel::{SentinelClientBuilder, SentinelServerType};
use redis::{ConnectionAddr, IntoConnectionInfo, RedisError, TlsMode};
use tollgate::{
    Algorithm, CheckRequest, Clock, Decision, Error, MonotonicClock, SettleStatus, Settlement,
    Store, Take, Timestamp, Unavailable,
};

use crate::batch::{self, Batcher, Bucket, Carried, Mode, Params, Record, Segment, TakeScript};
use crate::breaker::{Breaker, BreakerConfig, Transition};
use crate::cluster::DirectConnections;
use crate::connection::{Connection, Link, Opener, SentinelMaster};
use crate::lease::LeaseScript;
use crate::rejections::Rejections;
use crate::tls::{self, TlsFiles};
use crate::token_batches::{Held, Plan, TokenBatchStats, TokenBatches, Turn};
use crate::units::{ScriptLimit, WindowFigures};

/// How a [`RedisStore`] talks to Redis.
#[derive(Clone)]
#[non_exhaustive]
pub struct RedisConfig {
    /// Prefixed to every bucket's key (default `tollgate:`); must not be empty or contain `{`:
    /// idempotency records have keys starting with `{`, which no bucket's key can then take.
    pub prefix: String,
    /// The longest a decision may wait for Redis before it fails with
    /// [`Unavailable::Timeout`] (default 20 ms, Envoy's own default timeout for a rate-limit
    /// call: past it, Envoy has given up anyway).
    pub timeout: Duration,
    /// How long a charged request's id is remembered (default 60 s; at most a year).
    pub idempotency_window: Duration,
    /// When to stop waiting on a failing Redis.
    pub breaker: BreakerConfig,
    /// Script calls in flight at once per single-node store before requests queue up and
    /// share calls (default 4). With fewer calls in flight each carries more decisions, and a
    /// call's own cost inside Redis is about that of a decision: through `tollgate serve` at
    /// 16 concurrent checks, Redis spent 33 %, 21 % and 12 % less per decision with 1, 2 and 4
    /// calls in flight than with 8, at the same throughput (1: a few percent lower). 4 leaves
    /// room for a Redis farther away, where every call waits longer for its round trip.
    pub max_in_flight: usize,
    /// The most requests one script call carries (default 32).
    pub max_batch: usize,
    /// Certificate files for `rediss://` (default none: the system's authorities).
    pub tls: TlsFiles,
    /// The password the sentinels of a `redis+sentinel://` store ask for, when they ask for
    /// one (`requirepass` in their configuration); the URL's credentials are the master's.
    pub sentinel_password: Option<String>,
    /// How many recent rejections this process remembers, answering the same request again
    /// without Redis until its `retry_after` passes (default 0: off; see
    /// [`RedisConfig::with_rejection_memory`]).
    pub rejection_memory: usize,
    /// The most tokens a batch of token leasing holds (default 0: off; see
    /// [`RedisConfig::with_token_batches`]).
    pub token_batch: u64,
    /// The longest a batch is held before its unused tokens go back (default 1 s).
    pub token_batch_ttl: Duration,
}

impl std::fmt::Debug for RedisConfig {
    // By hand, so that the sentinels' password never reaches a log line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConfig")
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .field("idempotency_window", &self.idempotency_window)
            .field("breaker", &self.breaker)
            .field("max_in_flight", &self.max_in_flight)
            .field("max_batch", &self.max_batch)
            .field("tls", &self.tls)
            .field(
                "sentinel_password",
                &self.sentinel_password.as_ref().map(|_| "***"),
            )
            .field("rejection_memory", &self.rejection_memory)
            .field("token_batch", &self.token_batch)
            .field("token_batch_ttl", &self.token_batch_ttl)
            .finish()
    }
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            prefix: "tollgate:".to_owned(),
            timeout: Duration::from_millis(20),
            idempotency_window: Duration::from_secs(60),
            breaker: BreakerConfig::default(),
            max_in_flight: 4,
            max_batch: 32,
            tls: TlsFiles::default(),
            sentinel_password: None,
            rejection_memory: 0,
            token_batch: 0,
            token_batch_ttl: Duration::from_secs(1),
        }
    }
}

impl RedisConfig {
    /// Remembers up to about `max` recent rejections (0: none): a check of one bucket, on
    /// Redis' clock and without a request id, that Redis rejected is answered again from this
    /// process's memory until its `retry_after` has passed since it was sent, aged by the time
    /// gone. A key hammered far past its limit (an abusive client, a retry storm) then costs
    /// Redis one call per wait instead of one per request. Tokens only come back with time, and
    /// others' charges only take more, so such an answer is Redis' own, except after tokens
    /// were given back meanwhile by another process (a settlement, a cluster's cross-slot
    /// refund) or Redis lost the bucket (a restart without persistence): then it under-admits
    /// until the wait is over, never over-admits.
    #[must_use]
    pub fn with_rejection_memory(mut self, max: usize) -> Self {
        self.rejection_memory = max;
        self
    }

    /// Turns on token leasing (SPEC §7) with batches of at most `max_tokens` tokens (0: off),
    /// each held at most `ttl`. A key this process checks often (8 checks within 100 ms) takes
    /// its tokens from Redis in batches: a check of `cost` asks Redis for `cost + extra`, and
    /// if admitted, the next checks of that key spend the `extra` here, without a call. Redis
    /// has charged every token spent here, so processes sharing the bucket never admit more
    /// than it holds; the price is an under-admission of at most one batch per key and
    /// process: tokens held here are not available to others until spent or given back.
    ///
    /// `extra` is at most `max_tokens`, an eighth of the capacity and the tokens the key asked
    /// for in the last 100 ms (no batch when that is below 2), so a batch lasts about that long
    /// at the key's own pace. Only what the rejection memory may answer is batched: one token
    /// bucket on Redis' clock, without a request id or a carry; windows, logs, multi-bucket
    /// checks, retries and a caller's time go to Redis every time. When Redis refuses a batch
    /// (the bucket has less than `cost + extra`) the check is asked again for `cost` alone,
    /// exactly, and the key asks for no batch for 100 ms.
    ///
    /// A check answered from a batch reports `remaining` as the tokens still held here (the
    /// only ones certain to be there: other processes may have emptied the rest of the bucket
    /// meanwhile) and `reset_after` as the time to refill the rest; the check that took the
    /// batch reports Redis' own figures, the batch counted as spent. Both are never more than
    /// the bucket holds, and never sooner than it is full.
    ///
    /// Unused tokens go back ([`tollgate::Store::settle`] with the batch's own request id,
    /// once) when the batch expires, found by the next check of its key or by
    /// [`RedisStore::sweep_token_batches`], which a process should call every fraction of
    /// `ttl`; when the key's next check needs more than is left, or another limit; and on
    /// [`RedisStore::return_token_batches`], at shutdown. `ttl` must be shorter than
    /// [`RedisConfig::idempotency_window`], in which Redis keeps what a settlement needs.
    /// [`RedisStore::token_batch_stats`] counts it all.
    #[must_use]
    pub fn with_token_batches(mut self, max_tokens: u64, ttl: Duration) -> Self {
        self.token_batch = max_tokens;
        self.token_batch_ttl = ttl;
        self
    }

    /// Sets [`RedisConfig::timeout`].
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets [`RedisConfig::prefix`].
    #[must_use]
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Sets [`RedisConfig::idempotency_window`].
    #[must_use]
    pub fn with_idempotency_window(mut self, window: Duration) -> Self {
        self.idempotency_window = window;
        self
    }

    /// Sets [`RedisConfig::max_in_flight`] and [`RedisConfig::max_batch`]; `(1, 1)` sends
    /// every request in a call of its own, one at a time.
    #[must_use]
    pub fn with_batching(mut self, max_in_flight: usize, max_batch: usize) -> Self {
        self.max_in_flight = max_in_flight;
        self.max_batch = max_batch;
        self
    }

    /// Sets [`RedisConfig::breaker`].
    #[must_use]
    pub fn with_breaker(mut self, breaker: BreakerConfig) -> Self {
        self.breaker = breaker;
        self
    }

    /// Sets [`RedisConfig::tls`].
    #[must_use]
    pub fn with_tls(mut self, tls: TlsFiles) -> Self {
        self.tls = tls;
        self
    }

    /// Sets [`RedisConfig::sentinel_password`].
    #[must_use]
    pub fn with_sentinel_password(mut self, password: impl Into<String>) -> Self {
        self.sentinel_password = Some(password.into());
        self
    }
}

/// Why a [`RedisStore`] could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The store URL is not one of the accepted forms.
    #[error(
        "invalid store URL {url:?}: expected redis://HOST:PORT[/DB], \
         redis+cluster://HOST:PORT,HOST:PORT,... or \
         redis+sentinel://HOST:PORT,HOST:PORT,.../SERVICE[/DB] (rediss://, \
         rediss+cluster:// and rediss+sentinel:// for TLS)"
    )]
    InvalidUrl {
        /// The URL, with any password removed.
        url: String,
    },
    /// TLS certificate files were given for a URL without TLS.
    #[error(
        "TLS certificate files were given, but the store URL is not rediss:// or rediss+cluster://"
    )]
    TlsFilesWithoutTls,
    /// A client certificate without its key, or a key without its certificate.
    #[error("a TLS client certificate and its key go together: give both or neither")]
    TlsClientPair,
    /// The certificate files could not be used (not PEM, a key that does not match).
    #[error("invalid TLS certificate files: {source}")]
    InvalidTls {
        /// The client's error.
        source: RedisError,
    },
    /// A certificate file holds no PEM certificate.
    #[error("{} holds no PEM certificate (-----BEGIN CERTIFICATE-----)", path.display())]
    TlsNoCertificate {
        /// The file.
        path: std::path::PathBuf,
    },
    /// A certificate file could not be read.
    #[error("cannot read TLS file {}: {source}", path.display())]
    TlsFile {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Token leasing is on with a batch lifetime that is zero, or not shorter than the
    /// idempotency window (past it Redis forgets what gives a batch back).
    #[error(
        "the token batch lifetime ({ttl:?}) must be longer than 0 and shorter than the \
         idempotency window ({window:?})"
    )]
    InvalidTokenBatchTtl {
        /// The lifetime asked for.
        ttl: Duration,
        /// The idempotency window.
        window: Duration,
    },
    /// The prefix is empty or contains `{` (see [`RedisConfig::prefix`]).
    #[error("the key prefix must not be empty or contain '{{'")]
    InvalidPrefix,
    /// The cluster client refused the nodes of a well-formed URL, such as nodes given
    /// different passwords.
    #[error("the cluster nodes of {url} cannot be used together: {source}")]
    InvalidCluster {
        /// The URL, with any password removed.
        url: String,
        /// The client's error.
        source: RedisError,
    },
    /// Redis answered but cannot be used as asked (a node given as a cluster's that is not in
    /// cluster mode, say). Redis that cannot be reached is not this error: the store starts
    /// without it and connects once it answers.
    #[error("cannot connect to Redis at {url}: {source}")]
    Connect {
        /// The URL, with any password removed.
        url: String,
        /// The client's error.
        source: RedisError,
    },
}

/// Removes passwords from `redis://user:password@host` URLs, for logs and errors.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let nodes: Vec<String> = rest
        .split(',')
        .map(|node| match node.rsplit_once('@') {
            Some((credentials, host)) if credentials.contains(':') => {
                let user = credentials.split_once(':').map_or("", |(user, _)| user);
                format!("{user}:***@{host}")
            }
            _ => node.to_owned(),
        })
        .collect();
    format!("{scheme}://{}", nodes.join(","))
}

/// The node URLs in `nodes`, a cluster URL after its scheme (`[USERINFO@]HOST:PORT,...`). A
/// password given once, on the first node (as other multi-host URLs carry it), applies to every
/// node without one: the cluster client wants them all to carry the same.
fn cluster_nodes(nodes: &str, secure: bool) -> Vec<String> {
    let scheme = if secure { "rediss://" } else { "redis://" };
    let nodes: Vec<&str> = nodes
        .split(',')
        .map(str::trim)
        .filter(|node| !node.is_empty())
        .collect();
    let userinfo = nodes
        .first()
        .and_then(|node| node.rsplit_once('@'))
        .map(|(userinfo, _)| userinfo);
    nodes
        .iter()
        .map(|node| match userinfo {
            Some(userinfo) if !node.contains('@') => format!("{scheme}{userinfo}@{node}"),
            _ => format!("{scheme}{node}"),
        })
        .collect()
}

/// What a store URL leads to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Topology {
    /// One server (`redis://`).
    Single,
    /// Redis Cluster (`redis+cluster://`).
    Cluster,
    /// The master Redis Sentinel names for a service (`redis+sentinel://`).
    Sentinel,
}

/// A `redis+sentinel://` URL after its scheme: `[USERINFO@]HOST[:PORT],.../SERVICE[/DB]`.
struct SentinelTarget {
    sentinels: Vec<ConnectionAddr>,
    service: String,
    /// The master's credentials and database, from the URL's userinfo and path.
    master: redis::RedisConnectionInfo,
}

impl SentinelTarget {
    /// The port sentinels listen on unless told otherwise.
    const PORT: u16 = 26_379;

    /// `rest` after the scheme; `secure` for `rediss+sentinel://`, TLS to every sentinel.
    fn parse(rest: &str, secure: bool) -> Option<Self> {
        let (authority, path) = rest.split_once('/')?;
        let (service, db) = match path.split_once('/') {
            Some((service, db)) => (service, Some(db)),
            None => (path, None),
        };
        if service.is_empty() {
            return None;
        }
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => (Some(userinfo), hosts),
            None => (None, authority),
        };
        let sentinels = hosts
            .split(',')
            .map(|node| {
                // `host`, `host:port`, `[v6]` or `[v6]:port`.
                let (host, port) = match node.strip_prefix('[') {
                    Some(v6) => {
                        let (host, after) = v6.split_once(']')?;
                        (host, after.strip_prefix(':'))
                    }
                    None => match node.split_once(':') {
                        Some((host, port)) => (host, Some(port)),
                        None => (node, None),
                    },
                };
                let port = port.map_or(Some(Self::PORT), |port| port.parse().ok())?;
                (!host.is_empty()).then(|| match secure {
                    true => ConnectionAddr::TcpTls {
                        host: host.to_owned(),
                        port,
                        insecure: false,
                        tls_params: None,
                    },
                    false => ConnectionAddr::Tcp(host.to_owned(), port),
                })
            })
            .collect::<Option<Vec<_>>>()?;
        // The master's settings read as redis-rs reads a node's URL (percent-decoding and all).
        let master = format!(
            "redis://{}127.0.0.1/{}",
            userinfo
                .map(|userinfo| format!("{userinfo}@"))
                .unwrap_or_default(),
            db.unwrap_or("0")
        )
        .into_connection_info()
        .ok()?
        .redis_settings()
        .clone();
        Some(Self {
            sentinels,
            service: service.to_owned(),
            master,
        })
    }
}

/// Buckets, and leases (concurrency limits, `src/lease.rs`), in Redis, Redis Cluster or behind
/// Redis Sentinel. Cheap to share (`Arc` it); one per process is enough.
pub struct RedisStore {
    pub(crate) link: Arc<Link>,
    pub(crate) cluster: bool,
    /// Batches concurrent requests into shared script calls (single node only: in a cluster,
    /// one call can only touch one slot, and random keys rarely share one).
    batcher: Option<Batcher>,
    take: TakeScript,
    /// Concurrency limits' script (see `lease`): called on its own, never batched.
    pub(crate) lease: LeaseScript,
    pub(crate) config: RedisConfig,
    /// One circuit breaker on a single node; on a cluster, one per range of [`SLOT_RANGE`]
    /// slots (see [`RedisStore::breakers_of`]).
    breakers: Box<[Breaker<MonotonicClock>]>,
    /// Ids for the attempts of requests with a request id: randomly keyed, so processes sharing
    /// a Redis do not repeat each other's, and counted, so one process does not repeat its own.
    attempts: (RandomState, AtomicU64),
    /// Recent rejections, answered again without Redis (see [`RedisConfig::rejection_memory`]).
    rejections: Option<Rejections>,
    /// Batches of hot keys' tokens held here (see [`RedisConfig::with_token_batches`]).
    batches: Option<TokenBatches>,
    /// Times requests for `rejections` and `batches`.
    clock: MonotonicClock,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("cluster", &self.cluster)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// One script call: the buckets of one slot.
struct Group {
    /// Indexes into the request's takes.
    takes: Vec<usize>,
    /// The idempotency record's key, when the request has an id.
    record: Option<String>,
}

/// What one slot's script said.
struct GroupReply {
    status: i64,
    /// Per bucket of the group.
    buckets: Vec<Answer>,
}

/// Which of a group's buckets are windows, whose replies are longer: nothing allocated for a
/// group of token buckets alone, the usual one.
struct Kinds {
    buckets: usize,
    /// Per bucket, whether it is a window; `None` when none is.
    windows: Option<Vec<bool>>,
}

impl Kinds {
    fn of(group: &Group, limits: &[ScriptLimit]) -> Self {
        let window = |&i: &usize| limits[i].is_window();
        Self {
            buckets: group.takes.len(),
            windows: group
                .takes
                .iter()
                .any(window)
                .then(|| group.takes.iter().map(window).collect()),
        }
    }

    fn is_window(&self, bucket: usize) -> bool {
        self.windows
            .as_ref()
            .and_then(|windows| windows.get(bucket))
            .is_some_and(|&window| window)
    }
}

/// What the script said of one bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// A token bucket: allowed, and the units it is short of full.
    Tokens { allowed: bool, deficit: i64 },
    /// A window.
    Window(WindowFigures),
}

impl RedisStore {
    /// Connects to `url`: `redis://HOST:PORT[/DB]` for one server,
    /// `redis+cluster://HOST:PORT,HOST:PORT,...` for a cluster (any reachable nodes; the rest are
    /// discovered), or `redis+sentinel://HOST[:PORT],.../SERVICE[/DB]` for the master Redis
    /// Sentinel names for `SERVICE` (the URL's credentials are the master's; see
    /// [`RedisConfig::sentinel_password`]). `rediss://`, `rediss+cluster://` and
    /// `rediss+sentinel://` are the same over TLS (to the sentinels and the master alike), with
    /// [`RedisConfig::tls`]'s files. A process can start while Redis is down and
    /// serve from its failure modes: a single server is connected lazily, and a cluster none of
    /// whose nodes answers, or sentinels that name no master that answers, are tried again in
    /// the background until they do (a warning says so).
    ///
    /// # Errors
    ///
    /// [`ConnectError`] for a malformed URL, unusable TLS files, or a cluster whose nodes
    /// answer but cannot be used (not in cluster mode, say).
    pub async fn connect(url: &str, config: RedisConfig) -> Result<Self, ConnectError> {
        if config.prefix.is_empty() || config.prefix.contains('{') {
            return Err(ConnectError::InvalidPrefix);
        }
        if config.token_batch > 0
            && (config.token_batch_ttl.is_zero()
                || config.token_batch_ttl >= config.idempotency_window)
        {
            return Err(ConnectError::InvalidTokenBatchTtl {
                ttl: config.token_batch_ttl,
                window: config.idempotency_window,
            });
        }
        let invalid = || ConnectError::InvalidUrl { url: redact(url) };
        let connect_error = |source| ConnectError::Connect {
            url: redact(url),
            source,
        };
        // (scheme, TLS, topology) for each accepted form.
        let (scheme, secure, topology) = [
            ("redis+cluster://", false, Topology::Cluster),
            ("rediss+cluster://", true, Topology::Cluster),
            ("redis+sentinel://", false, Topology::Sentinel),
            ("rediss+sentinel://", true, Topology::Sentinel),
            ("redis://", false, Topology::Single),
            ("rediss://", true, Topology::Single),
        ]
        .into_iter()
        .find(|(scheme, _, _)| url.starts_with(scheme))
        .ok_or_else(invalid)?;
        let cluster = topology == Topology::Cluster;
        if !secure && !config.tls.is_empty() {
            return Err(ConnectError::TlsFilesWithoutTls);
        }
        let certificates = config.tls.load()?;
        if secure {
            tls::install_provider();
        }
        // Opening a connection happens beside the decisions, which wait only their own timeout;
        // a TLS handshake takes two more round trips and a signature check, so it gets longer.
        let connect_timeout =
            config
                .timeout
                .max(Duration::from_millis(if secure { 1_000 } else { 100 }));
        // A single node's connection, and a sentinel's master's. One connect attempt per
        // reconnect, no retries: decisions that arrive while a reconnect is under way wait on
        // it, and with retries they would wait out their timeout through the back-off sleeps
        // whenever Redis refuses connections, reported as `timeout` though Redis is plainly
        // down. A single attempt fails at once on a refused port (`connection`), and the next
        // decision, or the breaker's probe, tries again.
        let manager = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(connect_timeout))
            .set_response_timeout(None)
            .set_number_of_retries(0)
            .set_max_delay(Duration::from_secs(1));
        let link = if topology == Topology::Sentinel {
            let target = SentinelTarget::parse(&url[scheme.len()..], secure).ok_or_else(invalid)?;
            let mut sentinels = SentinelClientBuilder::new(
                target.sentinels,
                &target.service,
                SentinelServerType::Master,
            )
            .map_err(|_| invalid())?
            .set_client_to_redis_db(target.master.db());
            if let Some(username) = target.master.username() {
                sentinels = sentinels.set_client_to_redis_username(username);
            }
            if let Some(password) = target.master.password() {
                sentinels = sentinels.set_client_to_redis_password(password);
            }
            if let Some(password) = &config.sentinel_password {
                sentinels = sentinels.set_client_to_sentinel_password(password);
            }
            // TLS to the sentinels and to the master alike, on the same authorities.
            if secure {
                sentinels = sentinels
                    .set_client_to_sentinel_tls_mode(TlsMode::Secure)
                    .set_client_to_redis_tls_mode(TlsMode::Secure);
            }
            if let Some(certificates) = &certificates {
                sentinels = sentinels
                    .set_client_to_sentinel_certificates(certificates.clone())
                    .set_client_to_redis_certificates(certificates.clone());
            }
            let sentinels = sentinels
                .build()
                .map_err(|source| ConnectError::InvalidTls { source })?;
            // Asking is a round trip to a sentinel, then a connection to the master it names.
            let opener = Opener::Sentinel(Arc::new(SentinelMaster::new(
                sentinels,
                manager,
                connect_timeout * 2,
            )));
            match opener.open().await {
                Ok(connection) => Arc::new(Link::new(connection, opener, connect_timeout)),
                Err(err) => {
                    tracing::warn!(
                        "redis store: the sentinels of {} name no master that answers yet \
                         ({err}); deciding by the failure modes, and not ready, until one does",
                        redact(url)
                    );
                    Link::unopened(opener, connect_timeout)
                }
            }
        } else if cluster {
            let nodes = cluster_nodes(&url[scheme.len()..], secure);
            if nodes.is_empty() {
                return Err(invalid());
            }
            for node in &nodes {
                node.as_str()
                    .into_connection_info()
                    .map_err(|_| invalid())?;
            }
            let builder = || {
                redis::cluster::ClusterClientBuilder::new(nodes.clone())
                    .connection_timeout(connect_timeout)
                    .response_timeout(config.timeout)
                    // The store follows redirections and `TRYAGAIN` itself (see `cluster.rs`).
                    .retries(0)
            };
            // The nodes' URLs alone first, so a typo is not reported as bad files.
            let client = builder()
                .build()
                .map_err(|source| ConnectError::InvalidCluster {
                    url: redact(url),
                    source,
                })?;
            let client = match &certificates {
                Some(certificates) => builder()
                    .certs(certificates.clone())
                    .build()
                    .map_err(|source| ConnectError::InvalidTls { source })?,
                None => client,
            };
            let template = nodes[0]
                .as_str()
                .into_connection_info()
                .map_err(|_| invalid())?;
            let direct = Arc::new(DirectConnections::new(
                template,
                certificates,
                connect_timeout,
            ));
            match client.get_async_connection().await {
                Ok(connection) => Arc::new(Link::new(
                    Connection::Cluster(connection, Arc::clone(&direct)),
                    Opener::Cluster(client, direct),
                    connect_timeout,
                )),
                // No node could be reached (or none let this client in): start without, as a
                // single node's lazy connection does, and say why once.
                Err(err) if err.is_io_error() => {
                    tracing::warn!(
                        "redis store: no node of {} answers yet ({err}); deciding by the \
                         failure modes, and not ready, until one does",
                        redact(url)
                    );
                    Link::unopened(Opener::Cluster(client, direct), connect_timeout)
                }
                Err(err) => return Err(connect_error(err)),
            }
        } else {
            let client = redis::Client::open(url).map_err(|_| invalid())?;
            let client = match certificates {
                Some(certificates) => redis::Client::build_with_tls(url, certificates)
                    .map_err(|source| ConnectError::InvalidTls { source })?,
                None => client,
            };
            let connection = client
                .get_connection_manager_lazy(manager.clone())
                .map_err(connect_error)?;
            Arc::new(Link::new(
                Connection::Single(connection),
                Opener::Single(client, manager),
                connect_timeout,
            ))
        };
        let take = TakeScript::new();
        let batcher = (!cluster).then(|| {
            Batcher::start(
                take.clone(),
                Arc::clone(&link),
                config.timeout,
                config.max_in_flight,
                config.max_batch,
            )
        });
        Ok(Self {
            link,
            cluster,
            batcher,
            take,
            lease: LeaseScript::new(),
            breakers: (0..if cluster { SLOTS / SLOT_RANGE } else { 1 })
                .map(|_| Breaker::new(config.breaker, MonotonicClock::new()))
                .collect(),
            rejections: Rejections::new(config.rejection_memory),
            batches: TokenBatches::new(config.token_batch, config.token_batch_ttl),
            clock: MonotonicClock::new(),
            config,
            attempts: (RandomState::new(), AtomicU64::new(0)),
        })
    }

    /// Checks answered from the memory of recent rejections so far (see
    /// [`RedisConfig::with_rejection_memory`]).
    pub fn rejections_answered(&self) -> u64 {
        self.rejections.as_ref().map_or(0, Rejections::answered)
    }

    /// What token leasing has done so far (all zeros when it is off; see
    /// [`RedisConfig::with_token_batches`]).
    pub fn token_batch_stats(&self) -> TokenBatchStats {
        self.batches
            .as_ref()
            .map_or_else(TokenBatchStats::default, TokenBatches::stats)
    }

    /// How long a batch of token leasing is held at most; `None` when leasing is off.
    pub fn token_batch_ttl(&self) -> Option<Duration> {
        self.batches.as_ref().map(|_| self.config.token_batch_ttl)
    }

    /// Gives back the unused tokens of the batches held longer than their lifetime, and of
    /// batches whose fetch failed or was abandoned (Redis may have charged them); returns how
    /// many batches it tried to give back. Call it every fraction of the lifetime: a batch
    /// whose key is not checked again is otherwise held until its key's next check.
    pub async fn sweep_token_batches(&self) -> usize {
        self.give_back_batches(false).await
    }

    /// Gives back the unused tokens of every batch held, at shutdown; returns how many batches
    /// it tried to give back. Checks after it may take batches again.
    pub async fn return_token_batches(&self) -> usize {
        self.give_back_batches(true).await
    }

    async fn give_back_batches(&self, everything: bool) -> usize {
        let Some(books) = &self.batches else {
            return 0;
        };
        let retired = books.retire(self.clock.now(), everything);
        let count = retired.len();
        join_all(
            retired
                .into_iter()
                .map(|(batch, turn)| self.give_back(books, batch, turn)),
        )
        .await;
        count
    }

    /// Settles `batch`: its unused tokens go back to its bucket, once. `turn` keeps its key
    /// from fetching another batch meanwhile.
    async fn give_back(&self, books: &TokenBatches, batch: Held, turn: Turn<'_>) {
        let key = batch
            .key
            .strip_prefix(self.config.prefix.as_str())
            .unwrap_or(&batch.key);
        let takes = [Take::new(key, &batch.limit, batch.cost)];
        let request = CheckRequest {
            takes: &takes,
            request_id: Some(&batch.request_id),
            now: None,
        };
        let outcome = match self.settle(request, &[batch.left]).await {
            Ok(settled) => Some(settled.status == SettleStatus::Settled),
            Err(err) => {
                tracing::debug!(error = %err, "a token batch could not be given back");
                None
            }
        };
        books.returned(&batch, outcome);
        drop(turn);
    }

    /// Whether this store talks to a cluster.
    pub fn is_cluster(&self) -> bool {
        self.cluster
    }

    /// Whether Redis answers a `PING` within the timeout: for readiness checks. A `PING` left
    /// unanswered replaces the connection as a failed decision would: a process taken out of
    /// service because it is not ready gets no decisions to find that out.
    pub async fn ping(&self) -> Result<(), Unavailable> {
        match tokio::time::timeout(self.config.timeout, self.link.get().ping()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(err)) => Err(classify(&err)),
            Err(_) => {
                self.link.renew();
                Err(Unavailable::Timeout)
            }
        }
    }

    /// Whether a circuit breaker is failing requests fast now (on a cluster: for some slots).
    pub fn is_degraded(&self) -> bool {
        self.breakers.iter().any(Breaker::is_open)
    }

    /// How many circuit breakers are failing requests fast now: 0 or 1 on a single node; on a
    /// cluster, of its breakers, one per range of 128 slots (a dead master's third of a
    /// three-master cluster is about 43), for a gauge an operator can alert on.
    pub fn open_breakers(&self) -> usize {
        self.breakers
            .iter()
            .filter(|breaker| breaker.is_open())
            .count()
    }

    /// The breakers of a request on `keys` (stored keys), each once.
    ///
    /// A cluster has a breaker per range of slots, not one for all: a master that dies takes
    /// its slots' calls down with it, and a single breaker, opened by those failures, would
    /// fail every other master's calls fast too, turning one master's outage into the whole
    /// store's. `redis-cli --cluster create` deals each master a run of whole slot ranges, and
    /// a reshard moves a few ranges at a time, so a range's calls mostly share one master's
    /// fate. A request over several ranges goes through each range's breaker, and its outcome
    /// counts for all of them.
    fn breakers_of(&self, keys: &[String]) -> Vec<usize> {
        if !self.cluster {
            return vec![0];
        }
        let mut ranges: Vec<usize> = keys.iter().map(|key| range_of(key)).collect();
        ranges.sort_unstable();
        ranges.dedup();
        ranges
    }

    async fn decide(
        &self,
        request: CheckRequest<'_>,
        prepared: &Prepared,
        dry: bool,
    ) -> Result<Result<Vec<Decision>, Error>, Unavailable> {
        let (limits, keys) = (&prepared.limits[..], &prepared.keys[..]);
        // A peek records nothing, so it has no use for the request id.
        let request = CheckRequest {
            request_id: request.request_id.filter(|_| !dry),
            ..request
        };
        let now = request.now.map(Timestamp::as_nanos);
        let fingerprint = request.request_id.map(|_| fingerprint(request.takes));
        let attempt = match request.request_id {
            Some(_) => {
                let (hasher, count) = &self.attempts;
                hasher.hash_one(count.fetch_add(1, Ordering::Relaxed))
            }
            None => 0,
        };
        let groups = self.groups(keys, request.request_id);
        let window_ms = window_ms(self.config.idempotency_window);
        let record = |group: &Group| {
            group
                .record
                .as_deref()
                .zip(fingerprint.as_deref())
                .map(|(key, fingerprint)| Record {
                    key: key.to_owned(),
                    window_ms,
                    fingerprint: fingerprint.to_owned(),
                    attempt,
                })
        };

        let mode = if dry { Mode::Peek } else { Mode::Take };
        let call = |group: &Group| {
            let segment = segment(group, prepared, request.takes, mode, record(group), None);
            let kinds = Kinds::of(group, limits);
            async move {
                let reply = match &self.batcher {
                    Some(batcher) => batcher.submit(now, segment).await?,
                    None => self.call(now, &segment).await?,
                };
                parse_reply(&reply, &kinds)
            }
        };
        // Gives back what a slot charged, and its record (if no retry's reply rests on it yet):
        // the request as a whole was not charged. Its windows give back from the windows the
        // take charged, as `charged` (the take's reply) names them, and reply their standing
        // after the refund.
        let refund = |group: &Group, charged: &GroupReply| {
            let segment = segment(
                group,
                prepared,
                request.takes,
                Mode::Refund,
                record(group),
                Some(charged),
            );
            let kinds = Kinds::of(group, limits);
            async move { parse_reply(&self.call(now, &segment).await?, &kinds) }
        };
        // A slot this attempt charged (1), not one it replayed (2): a mix of the two is
        // admitted, since the replay claimed its record, so the attempt that charged that slot
        // can no longer refund it (see the script).
        let charged = |reply: &GroupReply| reply.status == 1;
        // On a single node (and for a cluster request within one slot) there is one call:
        // awaited directly, without the bookkeeping of joining several.
        let replies: Vec<GroupReply> = match groups.as_slice() {
            [group] => vec![call(group).await?],
            groups => {
                let replies = join_all(groups.iter().map(call)).await;
                if let Some(&failed) = replies.iter().find_map(|reply| reply.as_ref().err()) {
                    // One slot could not decide (its master is down, say), so the store does
                    // not admit the request: the other slots' charges go back, or their buckets
                    // would pay for it, and keep paying past the outage. Best effort: a refund
                    // that fails too leaves a charge, which under-admits.
                    if !dry {
                        let refunds = groups.iter().zip(&replies).filter_map(|(group, reply)| {
                            let reply = reply.as_ref().ok().filter(|reply| charged(reply))?;
                            Some(refund(group, reply))
                        });
                        join_all(refunds).await;
                    }
                    return Err(failed);
                }
                replies.into_iter().collect::<Result<_, _>>()?
            }
        };

        let conflict = replies.iter().any(|reply| reply.status == -1);
        let unreadable = replies.iter().any(|reply| reply.status == -2);
        let rejected = replies.iter().any(|reply| reply.status == 0);
        // Each group's refund's reply, by group: allocated only when something is refunded,
        // as most requests are admitted whole.
        let mut refunded: Vec<Option<GroupReply>> = Vec::new();
        if (conflict || unreadable || rejected) && !dry {
            let charged: Vec<usize> = (0..groups.len())
                .filter(|&index| charged(&replies[index]))
                .collect();
            let refunds = charged
                .iter()
                .map(|&index| refund(&groups[index], &replies[index]));
            let results = join_all(refunds).await;
            refunded = (0..groups.len()).map(|_| None).collect();
            for (index, result) in charged.into_iter().zip(results) {
                refunded[index] = Some(result?);
            }
        }
        if conflict {
            return Ok(Err(Error::IdempotencyConflict));
        }
        if unreadable {
            // A key holding something that is not a bucket (another program's, or corrupted):
            // this request cannot be decided, which its limits' failure modes answer for.
            return Ok(Err(Error::StoreUnavailable {
                reason: Unavailable::Script,
            }));
        }

        // The request's time past its whole microsecond, which the script rounded.
        let nanos = now.map_or(0, |now| now % 1_000);
        let mut decisions: Vec<Option<Decision>> = vec![None; request.takes.len()];
        for (index, (group, reply)) in groups.iter().zip(&replies).enumerate() {
            let refund = refunded.get(index).and_then(Option::as_ref);
            for (at, (&i, answer)) in group.takes.iter().zip(&reply.buckets).enumerate() {
                let take = &request.takes[i];
                let decision = match (&limits[i], *answer) {
                    (ScriptLimit::Tokens(limit), Answer::Tokens { allowed, deficit }) => {
                        // A refunded bucket reports the balance it has uncharged.
                        let deficit = if refund.is_some() {
                            i64::try_from(limit.cost(take.cost))
                                .ok()
                                .and_then(|cost| deficit.checked_sub(cost))
                                .ok_or(Unavailable::Protocol)?
                        } else {
                            deficit
                        };
                        // A replay's figures are from its first attempt's time: as the script
                        // rounded them, slightly short of full the more, never less.
                        let nanos = if reply.status == 2 { 0 } else { nanos };
                        limit.decision(take.limit, allowed, take.cost, deficit, nanos)?
                    }
                    (ScriptLimit::Window(limit), Answer::Window(figures)) => {
                        // A refunded window reports its standing after the refund: uncharged,
                        // unless a retry's reply claimed the charge first.
                        let figures = match refund.map(|refund| refund.buckets.get(at)) {
                            Some(Some(Answer::Window(after))) => *after,
                            Some(_) => return Err(Unavailable::Protocol),
                            None => figures,
                        };
                        limit.decision(take.limit, take.cost, &figures)?
                    }
                    _ => return Err(Unavailable::Protocol),
                };
                decisions[i] = Some(decision);
            }
        }
        Ok(Ok(decisions.into_iter().flatten().collect()))
    }

    /// One script call carrying one segment, outside the batcher.
    async fn call(&self, now: Option<u64>, segment: &Segment) -> Result<Vec<i64>, Unavailable> {
        batch::invoke(&self.take, &self.link.get(), now, &[segment])
            .await?
            .pop()
            .ok_or(Unavailable::Protocol)
    }

    /// Groups the request's keys by cluster slot, in the order they first appear.
    fn groups(&self, keys: &[String], request_id: Option<&str>) -> Vec<Group> {
        let mut groups: Vec<Group> = Vec::new();
        if self.cluster {
            let mut by_slot: HashMap<u16, usize> = HashMap::new();
            for (i, key) in keys.iter().enumerate() {
                let index = *by_slot.entry(slot(key)).or_insert_with(|| {
                    groups.push(Group {
                        takes: Vec::new(),
                        record: None,
                    });
                    groups.len() - 1
                });
                groups[index].takes.push(i);
            }
        } else {
            groups.push(Group {
                takes: (0..keys.len()).collect(),
                record: None,
            });
        }
        if let Some(id) = request_id {
            for group in &mut groups {
                group.record = Some(record_key(&keys[group.takes[0]], id));
            }
        }
        groups
    }
}

impl RedisStore {
    /// Validates `request` and decides it (or peeks), through the breaker and the timeout.
    async fn run(&self, request: CheckRequest<'_>, dry: bool) -> Result<Vec<Decision>, Error> {
        let prepared = self.prepare(request)?;
        // A single bucket on Redis' clock, asked anew (a retry must get its first decision):
        // what the memory of rejections may answer and learn from, and batches may serve.
        let take = match request.takes {
            [take]
                if !dry
                    && request.now.is_none()
                    && request.request_id.is_none()
                    && take.carry.is_none() =>
            {
                take
            }
            _ => {
                return self
                    .guarded(&prepared.keys, self.decide(request, &prepared, dry))
                    .await;
            }
        };
        let key = &prepared.keys[0];
        let sent = self.clock.now();
        if let Some(memory) = &self.rejections
            && let Some(decision) = memory.answer(key, take.limit, take.cost, sent)
        {
            return Ok(vec![decision]);
        }
        let plan = match &self.batches {
            Some(books) if take.limit.algorithm() == Algorithm::TokenBucket => {
                books.plan(key, take.limit, take.cost, sent)
            }
            _ => Plan::Plain,
        };
        match plan {
            Plan::Spent(decision) => Ok(vec![decision]),
            Plan::Plain => self.decide_one(request, &prepared, sent).await,
            Plan::Fetch { extra, turn } => {
                self.fetch_batch(request, take, &prepared, extra, turn, sent)
                    .await
            }
            Plan::Return { batch, turn } => {
                let books = self.batches.as_ref().ok_or(Error::StoreUnavailable {
                    reason: Unavailable::Protocol,
                })?;
                let (decided, ()) = futures_util::future::join(
                    self.decide_one(request, &prepared, sent),
                    self.give_back(books, batch, turn),
                )
                .await;
                // The tokens given back may have come after a rejection remembered beside.
                if let Some(memory) = &self.rejections {
                    memory.forget(key);
                }
                decided
            }
        }
    }

    /// Decides a check of one bucket in Redis, remembering a rejection if the memory is on.
    async fn decide_one(
        &self,
        request: CheckRequest<'_>,
        prepared: &Prepared,
        sent: Timestamp,
    ) -> Result<Vec<Decision>, Error> {
        let decided = self
            .guarded(&prepared.keys, self.decide(request, prepared, false))
            .await;
        if let (Some(memory), Ok([decision])) = (&self.rejections, decided.as_deref())
            && !decision.allowed()
        {
            memory.remember(&prepared.keys[0], decision, sent);
        }
        decided
    }

    /// Asks Redis for `take`'s cost and `extra` more, under the batch's own request id; keeps
    /// the `extra` if admitted, and answers `take`. A refused batch is asked again as `take`
    /// alone, whose decision is the answer.
    async fn fetch_batch(
        &self,
        request: CheckRequest<'_>,
        take: &Take<'_>,
        prepared: &Prepared,
        extra: u64,
        turn: Turn<'_>,
        sent: Timestamp,
    ) -> Result<Vec<Decision>, Error> {
        let batch = [Take::new(take.key, take.limit, take.cost + extra)];
        let fetch = CheckRequest {
            takes: &batch,
            request_id: Some(turn.request_id()),
            now: None,
        };
        // The same bucket and limit as `take`: what was prepared for it serves (costs are
        // read from the takes).
        let decided = self
            .guarded(&prepared.keys, self.decide(fetch, prepared, false))
            .await;
        match decided.as_deref() {
            Ok([decision]) if decision.allowed() => {
                let limit = take.limit;
                let missing = limit.capacity().saturating_sub(decision.remaining());
                let answer = Decision::from_deficit(
                    true,
                    *limit,
                    take.cost,
                    u128::from(missing) * u128::from(limit.units_per_token()),
                );
                turn.keep(extra);
                Ok(vec![answer])
            }
            Ok([_]) => {
                turn.refused(sent);
                self.decide_one(request, prepared, sent).await
            }
            // A failed call may have charged the batch: the turn, dropped, keeps it for the
            // sweep to give back.
            _ => decided,
        }
    }

    /// Validates `request` (as a check: costs, keys, request id) and works out what the script
    /// is sent of each take.
    fn prepare(&self, request: CheckRequest<'_>) -> Result<Prepared, Error> {
        let takes = request.takes;
        if takes.is_empty() {
            return Err(Error::EmptyCheck);
        }
        let mut limits = Vec::with_capacity(takes.len());
        for (index, take) in takes.iter().enumerate() {
            if take.cost == 0 || take.cost > take.limit.capacity() {
                return Err(Error::InvalidCost {
                    cost: take.cost,
                    capacity: take.limit.capacity(),
                });
            }
            if takes[..index].iter().any(|earlier| earlier.key == take.key) {
                return Err(Error::DuplicateKey { index });
            }
            limits.push(ScriptLimit::new(take.limit)?);
        }
        if let Some(id) = request.request_id {
            tollgate::check_request_id(id)?;
        }
        let keys: Vec<String> = takes.iter().map(|take| self.prefixed(take.key)).collect();
        // Empty (no allocation) unless a take carries an old bucket: the usual case.
        let carries = if takes.iter().any(|take| take.carry.is_some()) {
            takes
                .iter()
                .zip(&keys)
                .map(|(take, key)| self.carry_of(take, key))
                .collect::<Result<_, _>>()?
        } else {
            Vec::new()
        };
        Ok(Prepared {
            limits,
            keys,
            carries,
        })
    }

    /// Sends each group's segment (made by `segment_of`) in parallel and reads the replies,
    /// for a settlement and for hits given back. The calls share script calls with concurrent
    /// requests through the batcher, as checks do: to the script they are requests like any
    /// other.
    async fn call_groups(
        &self,
        now: Option<u64>,
        groups: &[Group],
        prepared: &Prepared,
        segment_of: impl Fn(&Group) -> Segment,
    ) -> Result<Vec<GroupReply>, Unavailable> {
        let call = |group: &Group| {
            let segment = segment_of(group);
            let kinds = Kinds::of(group, &prepared.limits);
            async move {
                let reply = match &self.batcher {
                    Some(batcher) => batcher.submit(now, segment).await?,
                    None => self.call(now, &segment).await?,
                };
                parse_reply(&reply, &kinds)
            }
        };
        join_all(groups.iter().map(call))
            .await
            .into_iter()
            .collect()
    }

    /// Settles `request` (see [`Store::settle`]): one call per slot, in parallel, each giving
    /// back from its own buckets once, while the slot's record of the check lives.
    async fn settle_groups(
        &self,
        request: CheckRequest<'_>,
        prepared: &Prepared,
        request_id: &str,
        refunds: &[u64],
    ) -> Result<Result<Settlement, Error>, Unavailable> {
        let now = request.now.map(Timestamp::as_nanos);
        let fingerprint = fingerprint(request.takes);
        let mark = refunds_mark(refunds);
        let window_ms = window_ms(self.config.idempotency_window);
        // What to give back goes where a take's cost goes; carries are not read again.
        let given: Vec<Take<'_>> = request
            .takes
            .iter()
            .zip(refunds)
            .map(|(take, &refund)| Take::new(take.key, take.limit, refund))
            .collect();
        let groups = self.groups(&prepared.keys, Some(request_id));
        let replies = self
            .call_groups(now, &groups, prepared, |group| {
                let record = group.record.clone().map(|key| Record {
                    key,
                    window_ms,
                    fingerprint: fingerprint.clone(),
                    attempt: mark,
                });
                segment(group, prepared, &given, Mode::Settle, record, None)
            })
            .await?;
        if replies.iter().any(|reply| reply.status == -1) {
            return Ok(Err(Error::IdempotencyConflict));
        }
        if replies.iter().any(|reply| reply.status == -2) {
            return Ok(Err(Error::StoreUnavailable {
                reason: Unavailable::Script,
            }));
        }
        // Slots settle on their own: a request given back anywhere is settled.
        let status = if replies.iter().any(|reply| reply.status == 1) {
            SettleStatus::Settled
        } else if replies.iter().any(|reply| reply.status == 2) {
            SettleStatus::Repeated
        } else {
            SettleStatus::NotFound
        };
        let decisions = standings(request, prepared, &groups, &replies, now)?;
        Ok(Ok(Settlement { status, decisions }))
    }

    /// Gives back `request`'s costs (see [`Store::give_back`]): one refund per slot that names
    /// no record and no take, in parallel, each giving back from its own buckets' latest
    /// counts.
    async fn give_back_groups(
        &self,
        request: CheckRequest<'_>,
        prepared: &Prepared,
    ) -> Result<Result<Vec<Decision>, Error>, Unavailable> {
        let now = request.now.map(Timestamp::as_nanos);
        let groups = self.groups(&prepared.keys, None);
        let replies = self
            .call_groups(now, &groups, prepared, |group| {
                segment(group, prepared, request.takes, Mode::Refund, None, None)
            })
            .await?;
        if replies.iter().any(|reply| reply.status != 1) {
            return Ok(Err(Error::StoreUnavailable {
                reason: Unavailable::Script,
            }));
        }
        Ok(Ok(standings(request, prepared, &groups, &replies, now)?))
    }

    /// Runs `work`, a call (or calls) on `keys` (stored keys), through their breakers and
    /// within the timeout: the one way every operation of the store reaches Redis.
    pub(crate) async fn guarded<T>(
        &self,
        keys: &[String],
        work: impl Future<Output = Result<Result<T, Error>, Unavailable>>,
    ) -> Result<T, Error> {
        // Dropped with this future (a caller that gives up), a ticket hands a probe on; so do
        // the tickets already taken when a later breaker refuses.
        let ranges = self.breakers_of(keys);
        let tickets = ranges
            .iter()
            .map(|&index| self.breakers[index].permit())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|reason| Error::StoreUnavailable { reason })?;
        let outcome = tokio::time::timeout(self.config.timeout, work)
            .await
            .map_err(|_| Unavailable::Timeout)
            .and_then(|result| result);
        // The breaker is about a dead or stalled Redis. A script error is Redis answering: one
        // request's data (or its arguments) is at fault, and failing every other key fast for it
        // would turn one bad key into an outage.
        let answered = !matches!(outcome, Err(reason) if reason != Unavailable::Script);
        for (ticket, &range) in tickets.into_iter().zip(&ranges) {
            match ticket.record(answered) {
                Some(Transition::Opened) => {
                    let slots = slots_of_breaker(self.cluster, range);
                    tracing::warn!(
                        "redis store failing{slots}: circuit breaker open, decisions take their \
                         failure modes"
                    );
                    // The probe after the cool-down must not go to a connection that stopped
                    // answering (see `connection`).
                    self.link.renew();
                }
                Some(Transition::ProbeFailed) => self.link.renew(),
                Some(Transition::Closed) => {
                    let slots = slots_of_breaker(self.cluster, range);
                    tracing::info!("redis store recovered{slots}: circuit breaker closed");
                }
                None => {}
            }
        }
        outcome.map_err(|reason| Error::StoreUnavailable { reason })?
    }
}

impl RedisStore {
    /// `key` as stored: after the store's prefix. Built at its exact size, as it is on every
    /// decision's path (`format!` would grow it as it writes).
    fn prefixed(&self, key: &str) -> String {
        let mut stored = String::with_capacity(self.config.prefix.len() + key.len());
        stored.push_str(&self.config.prefix);
        stored.push_str(key);
        stored
    }

    /// The old bucket `take` carries over, if the script should read it: not when it is the
    /// bucket itself, lies in another cluster slot (a script cannot read it atomically), or
    /// changed so long ago that the new bucket would have refilled from empty since.
    ///
    /// Windows carry nothing over, either way: a window take with a carry, or a token bucket's
    /// carrying a window over, is decided as if nothing were carried (the policy engine
    /// attaches no carry to a window; a window's counts and a bucket's balance do not convert
    /// in one script step as the core's `rebase` converts them).
    fn carry_of(&self, take: &Take<'_>, key: &str) -> Result<Option<Carried>, Error> {
        let Some(carry) = take.carry else {
            return Ok(None);
        };
        if take.limit.algorithm().is_window() || carry.limit.algorithm().is_window() {
            return Ok(None);
        }
        if carry.since >= take.limit.time_to_full() {
            return Ok(None);
        }
        let old = self.prefixed(carry.key);
        if old == key || (self.cluster && slot(&old) != slot(key)) {
            return Ok(None);
        }
        let ScriptLimit::Tokens(limit) = ScriptLimit::new(carry.limit)? else {
            return Ok(None);
        };
        Ok(Some(Carried {
            key: old,
            a: limit.a,
            p: limit.p,
            cap: limit.cap,
            since_us: u64::try_from(carry.since.as_micros()).unwrap_or(u64::MAX),
        }))
    }
}

/// A request's takes as the scripts see them, index for index.
struct Prepared {
    limits: Vec<ScriptLimit>,
    /// Bucket keys, with the store's prefix.
    keys: Vec<String>,
    /// The old bucket each take carries over; empty when none does.
    carries: Vec<Option<Carried>>,
}

impl Store for RedisStore {
    async fn check(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
        self.run(request, false).await
    }

    /// Deletes each key: absent, a token bucket is full and a window or a log counts nothing,
    /// as the script reads them. One `DEL` per key, sent together (on a cluster each goes to
    /// its key's master); a rejection remembered for a key is forgotten after. Tokens a
    /// process holds in a batch of the key (`with_token_batches`) stay spendable there.
    async fn reset(&self, keys: &[&str]) -> Result<(), Error> {
        let stored: Vec<String> = keys.iter().map(|key| self.prefixed(key)).collect();
        let work = async {
            let connection = self.link.get();
            let deletes = stored.iter().map(|key| {
                let connection = connection.clone();
                let mut delete = redis::cmd("DEL");
                delete.arg(key);
                async move { connection.query::<i64>(&delete).await }
            });
            for deleted in join_all(deletes).await {
                deleted.map_err(|err| classify(&err))?;
            }
            Ok(Ok(()))
        };
        self.guarded(&stored, work).await?;
        if let Some(memory) = &self.rejections {
            for key in &stored {
                memory.forget(key);
            }
        }
        Ok(())
    }

    async fn peek(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
        self.run(request, true).await
    }

    /// One script call per slot in refund mode, naming no record: the tokens go back as a
    /// cross-slot refund gives back a charge (a token bucket's full time moves back, clamped at
    /// full), and a window's or a log's from its latest count. A rejection remembered for a
    /// key is forgotten after, as for a settlement.
    async fn give_back(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
        let request = CheckRequest {
            request_id: None,
            ..request
        };
        let prepared = self.prepare(request)?;
        let given = self
            .guarded(&prepared.keys, self.give_back_groups(request, &prepared))
            .await;
        if let Some(memory) = &self.rejections {
            for key in &prepared.keys {
                memory.forget(key);
            }
        }
        given
    }

    async fn settle(
        &self,
        request: CheckRequest<'_>,
        refunds: &[u64],
    ) -> Result<Settlement, Error> {
        let id = request.request_id.ok_or(Error::InvalidSettlement {
            reason: "it needs the request id its check was made with",
        })?;
        tollgate::check_refunds(request.takes, refunds)?;
        let prepared = self.prepare(request)?;
        let settled = self
            .guarded(
                &prepared.keys,
                self.settle_groups(request, &prepared, id, refunds),
            )
            .await;
        // Tokens may have come back: a remembered rejection of these buckets no longer holds.
        if let Some(memory) = &self.rejections {
            for key in &prepared.keys {
                memory.forget(key);
            }
        }
        settled
    }
}

/// Each take's standing after a settlement or tokens given back, from the replies of the slot
/// groups that hold them: allowed, uncharged decisions, in the order of the takes.
fn standings(
    request: CheckRequest<'_>,
    prepared: &Prepared,
    groups: &[Group],
    replies: &[GroupReply],
    now: Option<u64>,
) -> Result<Vec<Decision>, Unavailable> {
    let nanos = now.map_or(0, |now| now % 1_000);
    let mut decisions: Vec<Option<Decision>> = vec![None; request.takes.len()];
    for (group, reply) in groups.iter().zip(replies) {
        for (&i, answer) in group.takes.iter().zip(&reply.buckets) {
            let take = &request.takes[i];
            decisions[i] = Some(match (&prepared.limits[i], *answer) {
                (ScriptLimit::Tokens(limit), Answer::Tokens { deficit, .. }) => {
                    limit.decision(take.limit, true, take.cost, deficit, nanos)?
                }
                (ScriptLimit::Window(limit), Answer::Window(figures)) => {
                    limit.decision(take.limit, take.cost, &figures)?
                }
                _ => return Err(Unavailable::Protocol),
            });
        }
    }
    Ok(decisions.into_iter().flatten().collect())
}

/// A fingerprint of a settlement's refunds, the same in every process (FNV-1a), so that a
/// settlement retried through another process is known as the same one.
fn refunds_mark(refunds: &[u64]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in refunds.iter().flat_map(|refund| refund.to_le_bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// One request of a script call (see `scripts/take.lua`): `group`'s buckets, in `mode`, with
/// its idempotency record if any; for a refund, `charged` is the take's reply, which names the
/// window each window bucket was charged to.
fn segment(
    group: &Group,
    prepared: &Prepared,
    takes: &[Take<'_>],
    mode: Mode,
    record: Option<Record>,
    charged: Option<&GroupReply>,
) -> Segment {
    Segment {
        buckets: group
            .takes
            .iter()
            .enumerate()
            .map(|(at, &i)| {
                let params = match &prepared.limits[i] {
                    ScriptLimit::Tokens(limit) => {
                        // A refund gives back what the take charged to the bucket as it was
                        // written, the carry included: nothing to read again.
                        let carry = match mode {
                            Mode::Refund | Mode::Settle => None,
                            Mode::Take | Mode::Peek => prepared.carries.get(i).cloned().flatten(),
                        };
                        Params::Tokens {
                            a: limit.a,
                            p: limit.p,
                            cap: limit.cap,
                            cost: limit.cost(takes[i].cost),
                            carry,
                        }
                    }
                    ScriptLimit::Window(limit) => Params::Window {
                        kind: limit.kind,
                        window_ms: limit.window_ms,
                        limit: limit.limit,
                        cost: takes[i].cost,
                        charged: charged.and_then(|reply| match reply.buckets.get(at) {
                            Some(Answer::Window(figures)) => Some(figures.window),
                            _ => None,
                        }),
                    },
                };
                Bucket {
                    key: prepared.keys[i].clone(),
                    params,
                }
            })
            .collect(),
        record,
        mode,
    }
}

/// A stable fingerprint of what a request asks (keys, limits, costs), the same in every
/// process: FNV-1a over the fields.
pub(crate) fn fingerprint(takes: &[Take<'_>]) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |bytes: &[u8]| {
        for &byte in bytes {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    };
    for take in takes {
        feed(take.key.as_bytes());
        feed(&[0]);
        feed(&take.limit.capacity().to_le_bytes());
        feed(&take.limit.refill().amount().to_le_bytes());
        feed(&take.limit.refill().period().as_nanos().to_le_bytes());
        feed(&take.cost.to_le_bytes());
        // A window of N per W has a token bucket's capacity and refill: its algorithm tells
        // them apart (and leaves token buckets' fingerprints as they were).
        if take.limit.algorithm().is_window() {
            feed(take.limit.algorithm().as_str().as_bytes());
        }
    }
    format!("{hash:016x}")
}

/// The idempotency record's key for `request_id` on `bucket_key`: `{TAG}rid:LEN:ID:BUCKET`, in
/// the same cluster slot as the bucket. It starts with `{`, which no bucket's key can (they
/// start with the prefix, which is not empty and has no `{`), so a record never takes the place
/// of a bucket; and the id's length makes (bucket, id) readable back from it, so two records
/// never share a key.
fn record_key(bucket_key: &str, request_id: &str) -> String {
    let key = |tag: &str| {
        format!(
            "{{{tag}}}rid:{}:{request_id}:{bucket_key}",
            request_id.len()
        )
    };
    // The bucket's own hash tag, or, for a key hashed whole, the key itself, when it can stand
    // in braces as a tag (ends at the first `}`).
    let tag = hash_tag(bucket_key).unwrap_or(bucket_key);
    if !tag.contains('}') {
        return key(tag);
    }
    // A key hashed whole with a `}` in it (`a}b`, `a{}b`): any tag in its slot will do. One
    // short decimal in 16384 has it, so this ends quickly.
    let bucket_slot = slot(bucket_key);
    let tag = (0u32..)
        .map(|n| n.to_string())
        .find(|tag| slot(tag) == bucket_slot)
        .unwrap_or_default();
    key(&tag)
}

/// The Redis Cluster slot of `key`: CRC16 (XMODEM) of its hash tag, or of the whole key
/// without one, modulo 16,384.
pub(crate) fn slot(key: &str) -> u16 {
    let hashed = hash_tag(key).unwrap_or(key);
    crc16::State::<crc16::XMODEM>::calculate(hashed.as_bytes()) % SLOTS
}

/// The slots of Redis Cluster.
const SLOTS: u16 = 16_384;

/// Slots per circuit breaker on a cluster: 128 breakers, so a master of a cluster of up to
/// dozens holds several ranges whole.
const SLOT_RANGE: u16 = 128;

/// The range of [`SLOT_RANGE`] slots `key` falls in: on a cluster, its breaker's index.
fn range_of(key: &str) -> usize {
    usize::from(slot(key) / SLOT_RANGE)
}

/// The first and the last slot of range `index`.
fn slots_of_range(index: usize) -> (usize, usize) {
    let first = index * usize::from(SLOT_RANGE);
    (first, first + usize::from(SLOT_RANGE) - 1)
}

/// The slots breaker `index` answers for, as log lines name them (` on slots 0-127`) on a
/// cluster; nothing on a single node, which has one breaker for all.
fn slots_of_breaker(cluster: bool, index: usize) -> String {
    if !cluster {
        return String::new();
    }
    let (first, last) = slots_of_range(index);
    format!(" on slots {first}-{last}")
}

/// The part of `key` Redis Cluster hashes, when it is not the whole key: between the first `{`
/// and the first `}` after it, if not empty.
fn hash_tag(key: &str) -> Option<&str> {
    let open = key.find('{')?;
    let rest = &key[open + 1..];
    let tag = &rest[..rest.find('}')?];
    (!tag.is_empty()).then_some(tag)
}

/// A request's part of the script's reply, checked: a figure the script never sends is not a
/// decision: a pair of figures per bucket, then four more per window (`kinds` tells which are),
/// in the windows' order.
fn parse_reply(reply: &[i64], kinds: &Kinds) -> Result<GroupReply, Unavailable> {
    let (&status, rest) = reply.split_first().ok_or(Unavailable::Protocol)?;
    let windows = (0..kinds.buckets)
        .filter(|&bucket| kinds.is_window(bucket))
        .count();
    if !(-2..=2).contains(&status) || rest.len() != 2 * kinds.buckets + 4 * windows {
        return Err(Unavailable::Protocol);
    }
    let (pairs, extra) = rest.split_at(2 * kinds.buckets);
    let mut extra = extra.chunks_exact(4);
    let buckets = pairs
        .chunks_exact(2)
        .enumerate()
        .map(|(bucket, pair)| {
            if kinds.is_window(bucket) {
                WindowFigures::from_reply(pair[0], pair[1], extra.next()?).map(Answer::Window)
            } else {
                // A negative deficit is never the script's: not read as a full bucket.
                (pair[1] >= 0).then_some(Answer::Tokens {
                    allowed: pair[0] == 1,
                    deficit: pair[1],
                })
            }
        })
        .collect::<Option<_>>()
        .ok_or(Unavailable::Protocol)?;
    Ok(GroupReply { status, buckets })
}

/// Maps a client error to a closed set of reasons for metrics and failure modes.
pub(crate) fn classify(err: &RedisError) -> Unavailable {
    // The cause, for whoever turns on this crate's debug logs: the reasons are a closed set.
    tracing::debug!(error = %err, "redis store call failed");
    if err.is_timeout() {
        Unavailable::Timeout
    } else if err.is_io_error() || err.is_cluster_error() || refuses_every_call(err) {
        // A dropped or refused connection is an I/O error too (the client's own tests for
        // them look at the I/O error's kind).
        Unavailable::Connection
    } else if matches!(err.kind(), redis::ErrorKind::Server(_)) {
        Unavailable::Script
    } else {
        Unavailable::Protocol
    }
}

/// Whether `err` is Redis refusing every call of the store for now, not one request's: a
/// replica refusing writes (the connection leads to a primary demoted since, by a failover
/// behind one address), a dataset still loading, a replica cut off from its primary, a script
/// of someone else's running too long, memory full, credentials or permissions refused. As
/// the connection's failures these open the breaker, which fails decisions fast and replaces
/// the connection with one to whatever the address leads to now; as script errors (one
/// request at fault) they would fail every decision at the cost of a round trip, and a demoted
/// primary's connection would be kept until a restart.
fn refuses_every_call(err: &RedisError) -> bool {
    matches!(
        err.code(),
        Some(
            "READONLY"
                | "LOADING"
                | "MASTERDOWN"
                | "BUSY"
                | "OOM"
                | "NOAUTH"
                | "WRONGPASS"
                | "NOPERM"
        )
    )
}

/// The longest idempotency window sent to Redis: a record's deadline (the request's time plus
/// the window, in microseconds) must stay an exact Lua integer, and its `PX` a valid expiry; a
/// year is far beyond any retry.
const MAX_WINDOW_MS: u64 = 365 * 24 * 3600 * 1000;
// Added to a time in microseconds since 1970 (about 2^51 today), it keeps the sum below 2^53.
const _: () = assert!(MAX_WINDOW_MS * 1000 < 1 << 46);

/// How long idempotency records live, in whole milliseconds: at least one, at most a year.
fn window_ms(window: Duration) -> u64 {
    u64::try_from(window.as_millis())
        .unwrap_or(u64::MAX)
        .clamp(1, MAX_WINDOW_MS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sentinel_url_gives_the_sentinels_the_service_and_the_masters_settings() {
        let target = SentinelTarget::parse("u:p%40ss@s1:26380,s2,[::1]:7000,[::2]/cache/3", false)
            .expect("a valid URL");
        assert_eq!(
            target.sentinels,
            [
                ConnectionAddr::Tcp("s1".into(), 26_380),
                ConnectionAddr::Tcp("s2".into(), 26_379),
                ConnectionAddr::Tcp("::1".into(), 7_000),
                ConnectionAddr::Tcp("::2".into(), 26_379),
            ]
        );
        assert_eq!(target.service, "cache");
        assert_eq!(target.master.username(), Some("u"));
        assert_eq!(target.master.password(), Some("p@ss"));
        assert_eq!(target.master.db(), 3);
        let plain = SentinelTarget::parse("s1/cache", false).expect("a valid URL");
        assert_eq!((plain.master.password(), plain.master.db()), (None, 0));
        for bad in [
            "s1",
            "s1/",
            "s1:x/cache",
            ":1/cache",
            "s1,/cache",
            "[::1/cache",
        ] {
            assert!(SentinelTarget::parse(bad, false).is_none(), "{bad}");
        }
        assert_eq!(
            redact("redis+sentinel://u:secret@s1,s2/cache"),
            "redis+sentinel://u:***@s1,s2/cache"
        );
        let config = format!(
            "{:?}",
            RedisConfig::default().with_sentinel_password("hush")
        );
        assert!(!config.contains("hush"), "{config}");
    }

    #[test]
    fn idempotency_windows_are_whole_milliseconds_between_one_and_a_year() {
        assert_eq!(window_ms(Duration::from_secs(60)), 60_000);
        assert_eq!(window_ms(Duration::ZERO), 1);
        assert_eq!(window_ms(Duration::from_micros(1_500)), 1);
        // Duration::MAX once went out as a PX Redis refuses: every request with an id failed.
        assert_eq!(window_ms(Duration::MAX), 31_536_000_000);
        assert_eq!(MAX_WINDOW_MS, 31_536_000_000);
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact("redis://user:secret@h:6379/0"),
            "redis://user:***@h:6379/0"
        );
        assert_eq!(redact("redis://h:6379"), "redis://h:6379");
        assert_eq!(
            redact("redis+cluster://:pw@a:1,b:2"),
            "redis+cluster://:***@a:1,b:2"
        );
        // A user name alone is no secret: it stays as it is.
        assert_eq!(redact("redis://reader@h:6379"), "redis://reader@h:6379");
        assert_eq!(
            redact("rediss+cluster://reader@a:1,u:pw@b:2"),
            "rediss+cluster://reader@a:1,u:***@b:2"
        );
    }

    /// Processes of different versions share a Redis: a request's fingerprint, and a
    /// settlement's mark, must not change with the build. FNV-1a over the fields, pinned here.
    #[test]
    fn fingerprints_and_refund_marks_are_fnv_1a_and_stable() {
        let rate = |amount, secs| tollgate::Rate::new(amount, Duration::from_secs(secs));
        let limit = |capacity, amount, secs| {
            tollgate::Limit::new(capacity, rate(amount, secs).expect("a rate")).expect("a limit")
        };
        let print =
            |key: &str, limit: &tollgate::Limit, cost| fingerprint(&[Take::new(key, limit, cost)]);
        let base = limit(10, 1, 1);
        assert_eq!(print("k", &base, 1), "7a6e5bb16631f7ed");
        // Every field counts: key, capacity, refill amount and period, cost.
        let others = [
            print("j", &base, 1),
            print("k", &limit(11, 1, 1), 1),
            print("k", &limit(10, 2, 1), 1),
            print("k", &limit(10, 1, 2), 1),
            print("k", &base, 2),
            fingerprint(&[]),
        ];
        for other in &others {
            assert_ne!(other, "7a6e5bb16631f7ed");
        }
        // A window shares a token bucket's capacity and refill; its algorithm tells them apart.
        let second = Duration::from_secs(1);
        let bucket = tollgate::Limit::per(10, second).expect("a limit");
        let window = tollgate::Limit::fixed_window(10, second).expect("a window");
        let sliding = tollgate::Limit::sliding_window(10, second).expect("a window");
        assert_eq!(
            (bucket.capacity(), bucket.refill()),
            (window.capacity(), window.refill())
        );
        let prints = [
            print("k", &bucket, 1),
            print("k", &window, 1),
            print("k", &sliding, 1),
        ];
        assert_ne!(prints[0], prints[1]);
        assert_ne!(prints[1], prints[2]);

        assert_eq!(refunds_mark(&[]), 0xcbf2_9ce4_8422_2325);
        assert_eq!(refunds_mark(&[5, 0]), 0xfd29_b2d1_0195_eb20);
        assert_ne!(refunds_mark(&[0, 5]), refunds_mark(&[5, 0]));
    }

    /// Each builder sets its own setting and keeps those set before it.
    #[test]
    fn each_builder_sets_its_own_setting() {
        let breaker = BreakerConfig {
            threshold: 9,
            ..BreakerConfig::default()
        };
        let tls = TlsFiles {
            ca: Some("ca.pem".into()),
            ..TlsFiles::default()
        };
        let config = RedisConfig::default()
            .with_rejection_memory(7)
            .with_token_batches(11, Duration::from_millis(300))
            .with_timeout(Duration::from_millis(45))
            .with_prefix("elsewhere:")
            .with_idempotency_window(Duration::from_secs(90))
            .with_batching(2, 5)
            .with_breaker(breaker)
            .with_tls(tls.clone())
            .with_sentinel_password("hush");
        assert_eq!(config.rejection_memory, 7);
        assert_eq!(
            (config.token_batch, config.token_batch_ttl),
            (11, Duration::from_millis(300))
        );
        assert_eq!(config.timeout, Duration::from_millis(45));
        assert_eq!(config.prefix, "elsewhere:");
        assert_eq!(config.idempotency_window, Duration::from_secs(90));
        assert_eq!((config.max_in_flight, config.max_batch), (2, 5));
        assert_eq!(config.breaker.threshold, 9);
        assert_eq!(config.tls, tls);
        assert_eq!(config.sentinel_password.as_deref(), Some("hush"));
        // The settings show in logs, but for the password.
        let shown = format!("{config:?}");
        for field in [
            "prefix: \"elsewhere:\"",
            "timeout: 45ms",
            "max_batch: 5",
            "rejection_memory: 7",
            "token_batch_ttl: 300ms",
            "sentinel_password: Some(\"***\")",
        ] {
            assert!(shown.contains(field), "{field} not in {shown}");
        }
        assert!(!shown.contains("hush"), "{shown}");
    }

    /// A prefix that is empty or holds `{` could give a bucket the key of an idempotency
    /// record (see [`record_key`]): refused before anything is connected.
    #[tokio::test]
    async fn a_prefix_records_could_share_is_refused() {
        let url = "redis://127.0.0.1:1";
        for prefix in ["", "{", "a{b}:"] {
            let config = RedisConfig::default().with_prefix(prefix);
            let refused = RedisStore::connect(url, config).await;
            assert!(
                matches!(refused, Err(ConnectError::InvalidPrefix)),
                "{prefix:?}: {refused:?}"
            );
        }
        // A single node is connected lazily: a good prefix sets up a store with nothing there.
        let config = RedisConfig::default().with_prefix("a}b:");
        let store = RedisStore::connect(url, config).await.expect("a store");
        let shown = format!("{store:?}");
        assert!(
            shown
                .starts_with("RedisStore { cluster: false, config: RedisConfig { prefix: \"a}b:\""),
            "{shown}"
        );
    }

    /// Redis refusing every call for now (a demoted primary, a dataset loading, ...) counts
    /// against the connection, so the breaker opens and the connection is replaced; an error
    /// of one request's script does not.
    #[test]
    fn refusals_of_every_call_are_the_connections_failures() {
        let error = |reply: &str| {
            redis::parse_redis_value(reply.as_bytes())
                .and_then(redis::Value::extract_error)
                .expect_err("an error reply")
        };
        for code in [
            "READONLY",
            "LOADING",
            "MASTERDOWN",
            "BUSY",
            "OOM",
            "NOAUTH",
            "WRONGPASS",
            "NOPERM",
        ] {
            let reply = format!("-{code} refused\r\n");
            assert_eq!(classify(&error(&reply)), Unavailable::Connection, "{code}");
        }
        let script = "-ERR user_script:1: Script attempted to access nonexistent global\r\n";
        assert_eq!(classify(&error(script)), Unavailable::Script);
        // A cluster in the middle of a change refuses every call for now, too.
        for reply in ["-TRYAGAIN keys moving\r\n", "-CLUSTERDOWN no master\r\n"] {
            assert_eq!(classify(&error(reply)), Unavailable::Connection, "{reply}");
        }
        // A connection that fails in any way, and one that waits too long.
        let io = |kind| RedisError::from(std::io::Error::new(kind, "from the socket"));
        for kind in [
            std::io::ErrorKind::ConnectionRefused,
            std::io::ErrorKind::ConnectionReset,
            std::io::ErrorKind::Other,
        ] {
            assert_eq!(classify(&io(kind)), Unavailable::Connection, "{kind:?}");
        }
        assert_eq!(
            classify(&io(std::io::ErrorKind::TimedOut)),
            Unavailable::Timeout
        );
        // A reply of a shape nothing asked for is the protocol's fault.
        let parse = redis::parse_redis_value(b"?\r\n").expect_err("not a reply");
        assert_eq!(classify(&parse), Unavailable::Protocol);
    }

    /// The slots Redis Cluster gives these keys (`CLUSTER KEYSLOT`, and the CRC16 check value
    /// of the cluster specification for `123456789`).
    #[test]
    fn slots_are_redis_clusters() {
        for (key, expected) in [
            ("123456789", 12_739),
            ("foo", 12_182),
            ("bar", 5_061),
            ("{foo}.following", 12_182),
            ("x{foo}", 12_182),
            ("", 0),
        ] {
            assert_eq!(slot(key), expected, "{key:?}");
        }
        // An empty tag is no tag: the whole key is hashed.
        assert_ne!(slot("{}foo"), slot("foo"));
    }

    #[test]
    fn record_keys_share_the_bucket_slot() {
        for key in [
            "tollgate:{u1}:l0",
            "tollgate:plain",
            "a{}b",
            "x{y",
            "{}",
            "}{a}",
            "a}b",
        ] {
            let record = record_key(key, "r-1");
            assert_eq!(slot(&record), slot(key), "{key} -> {record}");
        }
    }

    #[test]
    fn record_keys_are_no_bucket_keys_and_never_shared() {
        // Bucket keys start with the prefix, which is not empty and has no `{`.
        let record = record_key("tollgate:{u1}:k", "r1");
        assert_eq!(record, "{u1}rid:2:r1:tollgate:{u1}:k");
        assert!(!record.starts_with("tollgate:"));
        // Ids and keys that could run into each other keep their records apart.
        let pairs = [
            ("tollgate:{u}:a:rid:9:b", "c"),
            ("tollgate:{u}:a", "b:rid:1:c"),
            ("tollgate:{u}:a", "9:b:c"),
            ("tollgate:{u}:a:9", "b:c"),
        ];
        let records: std::collections::HashSet<String> =
            pairs.iter().map(|(key, id)| record_key(key, id)).collect();
        assert_eq!(records.len(), pairs.len(), "{records:?}");
    }

    #[test]
    fn a_password_given_once_applies_to_every_node() {
        assert_eq!(
            cluster_nodes(":pw@h1:1, h2:2,,", false),
            ["redis://:pw@h1:1", "redis://:pw@h2:2"]
        );
        assert_eq!(
            cluster_nodes("u:pw@h1:1,v:other@h2:2", true),
            ["rediss://u:pw@h1:1", "rediss://v:other@h2:2"]
        );
        assert_eq!(
            cluster_nodes("h1:1,h2:2", false),
            ["redis://h1:1", "redis://h2:2"]
        );
        assert!(cluster_nodes(" , ", false).is_empty());
    }

    /// A cluster's breakers each answer for a run of 128 slots, which holds every key that
    /// goes through it; the 128 runs cover the 16,384 slots.
    #[test]
    fn each_breaker_answers_for_the_slots_of_its_keys() {
        for n in 0..2_000 {
            let key = format!("k{n}");
            let (first, last) = slots_of_range(range_of(&key));
            let slot = usize::from(slot(&key));
            assert!(
                (first..=last).contains(&slot),
                "{key}: slot {slot}, not in {first}-{last}"
            );
        }
        assert_eq!(slots_of_range(0), (0, 127));
        assert_eq!(slots_of_range(1), (128, 255));
        assert_eq!(slots_of_range(127), (16_256, 16_383));
        assert_eq!(SLOTS / SLOT_RANGE, 128);
        assert_eq!(slots_of_breaker(true, 2), " on slots 256-383");
        assert_eq!(slots_of_breaker(false, 0), "");
    }

    #[test]
    fn malformed_replies_are_protocol_errors() {
        let tokens = |buckets: usize| Kinds {
            buckets,
            windows: None,
        };
        assert!(parse_reply(&[], &tokens(1)).is_err());
        assert!(parse_reply(&[1, 1], &tokens(1)).is_err());
        assert!(parse_reply(&[7, 1, 0], &tokens(1)).is_err());
        assert!(parse_reply(&[-1], &tokens(3)).is_err());
        assert!(parse_reply(&[-1, 0, 0], &tokens(1)).is_ok());
        assert!(parse_reply(&[-2, 0, 0], &tokens(1)).is_ok());
        assert!(parse_reply(&[-3, 0, 0], &tokens(1)).is_err());
        // A negative deficit is never the script's: not read as a full bucket.
        assert!(parse_reply(&[0, 0, -5], &tokens(1)).is_err());
        let reply = parse_reply(&[0, 1, 5, 0, 9], &tokens(2)).unwrap();
        assert_eq!(
            reply.buckets,
            vec![
                Answer::Tokens {
                    allowed: true,
                    deficit: 5
                },
                Answer::Tokens {
                    allowed: false,
                    deficit: 9
                }
            ]
        );
    }

    /// A window's pair is followed, after every bucket's pair, by its four figures; a reply
    /// without them, or with a figure the script never sends, is not a decision.
    #[test]
    fn window_figures_follow_the_pairs() {
        let kinds = |windows: &[bool]| Kinds {
            buckets: windows.len(),
            windows: Some(windows.to_vec()),
        };
        let three = kinds(&[true, false, true]);
        let reply = [0, 1, 4, 0, 7, 0, 2, 0, 900, 17, 5, 3_000, 1_200, 18, 5];
        let parsed = parse_reply(&reply, &three).unwrap();
        let window = |allowed, remaining, retry_us, reset_us, window| {
            Answer::Window(WindowFigures {
                allowed,
                remaining,
                retry_us,
                reset_us,
                window,
                nanos: 5,
            })
        };
        assert_eq!(
            parsed.buckets,
            vec![
                window(true, 4, 0, 900, 17),
                Answer::Tokens {
                    allowed: false,
                    deficit: 7
                },
                window(false, 2, 3_000, 1_200, 18),
            ]
        );
        assert!(parse_reply(&reply[..11], &three).is_err());
        assert!(parse_reply(&reply, &kinds(&[true, false])).is_err());
        // Nanoseconds past a microsecond are below 1,000; no figure is negative.
        let mut bad = reply;
        bad[14] = 1_000;
        assert!(parse_reply(&bad, &three).is_err());
        let mut bad = reply;
        bad[9] = -1;
        assert!(parse_reply(&bad, &three).is_err());
        // An unreadable key's reply is zeros throughout, windows' figures included.
        assert!(parse_reply(&[-2, 0, 0, 0, 0, 0, 0], &kinds(&[true])).is_ok());
    }
}
