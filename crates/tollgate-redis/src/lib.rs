//! Redis, Redis Cluster and Redis Sentinel store for tollgate: many processes, one set of
//! buckets.
//!
//! [`RedisStore`] implements [`tollgate::Store`] with one atomic Lua script per decision (per
//! cluster slot), so every tollgate process sharing a Redis decides against the same buckets,
//! on Redis' own clock, with the same exact arithmetic as the in-memory store. It also
//! implements [`tollgate::LeaseStore`]: concurrency limits, one sorted set of leases per key,
//! with the decisions of [`tollgate::MemoryLeases`]. [`Failover`] wraps any store with
//! per-limit failure modes: fail closed (a distinct "unavailable" outcome) or open on a bounded
//! local emergency budget.
//!
#![cfg_attr(feature = "test-server", doc = "```")]
#![cfg_attr(not(feature = "test-server"), doc = "```ignore")]
//! use tollgate::{CheckRequest, Limit, Store, Take};
//! use tollgate_redis::{RedisConfig, RedisStore};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let server = tollgate_redis::test_server::RedisServer::start();
//! # let url = server.url();
//! // Each call waits at most this long (20 ms by default) before the limit's failure mode
//! // decides; the first call also connects and loads the script.
//! let config = RedisConfig::default().with_timeout(std::time::Duration::from_secs(1));
//! let store = RedisStore::connect(&url, config).await?;
//! let limit = Limit::new(20, "10/s".parse()?)?;
//! let takes = [Take::new("user:{42}", &limit, 1)];
//! let decisions = store
//!     .check(CheckRequest { takes: &takes, request_id: None, now: None })
//!     .await?;
//! println!("allowed: {}", decisions[0].allowed());
//! # Ok(())
//! # }
//! ```
//!
//! # Semantics
//!
//! * Time is Redis' `TIME` (microseconds) unless the caller supplies it; a limit whose period is
//!   not a whole number of microseconds, or whose figures would pass 2^53 inside Lua, is refused
//!   with [`tollgate::Error::UnsupportedLimit`] rather than decided inexactly. A caller's time
//!   between two microseconds is decided conservatively (at most what the memory store admits,
//!   possibly a fraction of a token less), and its `retry_after` is always enough to wait.
//! * Keys expire exactly when their bucket is full again (`PX` to the time-to-full).
//! * Fixed and sliding windows ([`tollgate::Algorithm`]) are decided in the same script as token
//!   buckets, with the memory store's exact figures (a caller's time between two microseconds
//!   included): their state is the window's counts, aligned on Redis' `TIME` (Unix time) or on
//!   the caller's time, and the key expires when the window frees it. A window longer than 2^50
//!   microseconds (about 35 years) is refused with [`tollgate::Error::UnsupportedLimit`].
//!   Windows carry nothing over from a limit's earlier parameters ([`tollgate::Carry`]).
//! * Sliding logs ([`tollgate::Limit::sliding_log`]) are decided in the same script too, with
//!   the memory store's exact decisions: a log is a Redis list of what each millisecond
//!   admitted, behind a header holding its total and latest entry (see `scripts/take.lua`),
//!   expiring when it counts nothing. A decision reads the header and the oldest entries, and
//!   writes one or two elements when it charges; a rejection's wait reads the entries it must
//!   walk, in runs. A least-privileged user needs `+lrange +lset +ltrim +rpush +lrem +pexpire`
//!   for logs besides the buckets' commands; without them a log's requests fail as a key that
//!   is not a bucket's would ([`tollgate::Unavailable::Script`]).
//! * Multi-bucket checks are atomic within a cluster slot; across slots they charge, then refund
//!   if any slot rejects (never over-admitting; a retried request id whose first attempt's
//!   refund comes after the retry's admission keeps that charge, under-admitting instead; a
//!   window gives back only while it still counts the charge). Share a `{hash tag}` per subject
//!   (the policy engine's keys put the descriptor values in one).
//! * Idempotency records live at `{TAG}rid:LEN:ID:BUCKET-KEY`, in the bucket's slot, under keys
//!   no bucket can have (bucket keys start with the non-empty prefix). A settlement
//!   ([`tollgate::Store::settle`]) finds them: one call per slot, each giving back from its own
//!   buckets while its record lives, once (the record is marked settled), so a reservation
//!   checked through one process can be settled through another.
//! * With [`RedisConfig::with_rejection_memory`], a single-bucket rejection on Redis' clock is
//!   remembered and answered again without a call until its wait is over (see the method).
//! * With [`RedisConfig::with_token_batches`] (token leasing), a process takes a batch of a hot
//!   key's tokens in one check and spends it without calls; unused tokens go back by a
//!   settlement, once. Never over-admits; under-admits by at most a batch per key and process.
//! * Every call has a timeout (default 20 ms) and a circuit breaker stops waiting on a dead
//!   Redis; failures surface as [`tollgate::Error::StoreUnavailable`], never as rejections. A
//!   key holding something that is not a bucket fails its own requests only
//!   ([`tollgate::Unavailable::Script`]), and does not count towards the breaker.
//! * Leases live at `PREFIX lease:KEY` (a sorted set per key, expiring when its last lease
//!   ends) and their records at `PREFIX lease-id:{ID}`: give no bucket a key starting with
//!   `lease:` or `lease-id:`. An acquire is one script call when its keys share the record's
//!   slot (always, on a single node); across cluster slots the record is claimed first and the
//!   slots then take in parallel, giving back if any rejects (never over-admitting). A release
//!   is two calls: the record, then its sets. A renewal is two calls when the sets share the
//!   record's slot (the record, then the sets with the record), three across slots (the
//!   record, the slots in parallel, the record again); it moves each set's end by the timeout
//!   that set was taken with, which the record keeps beside its name, and never revives a set
//!   where the lease had ended. A least-privileged user needs `+zadd +zrem
//!   +zremrangebyscore +zcard +zcount +zrange +zrangebyscore +zscore +pexpire` besides the
//!   buckets' commands.
//! * [`RedisStore::post_want`] keeps a board of wants per global bucket (a hash at
//!   `PREFIX wants:KEY`, in the bucket's slot): each process posts how many tokens it wants,
//!   with a time to live on Redis' `TIME`, and reads every live want, to size a fair share. A
//!   least-privileged user needs `+hgetall +hset +hdel +pexpire` for it.
//! * A call that times out, or loses its connection, after Redis ran its script has charged
//!   the buckets though its caller hears [`tollgate::Error::StoreUnavailable`]: the store
//!   cannot tell. A retry with the same request id gets the first decision back instead of a
//!   second charge.

mod batch;
mod breaker;
mod cluster;
mod connection;
mod failover;
mod flags;
mod lease;
mod rejections;
mod store;
#[cfg(feature = "test-server")]
pub mod test_server;
mod token_batches;

/// The fingerprint a [`RedisStore`] records with a request id for `takes`, for tests that write
/// the store's script calls by hand (to pin an interleaving the store alone cannot produce).
/// Public under the `test-server` feature.
#[cfg(feature = "test-server")]
pub fn request_fingerprint(takes: &[tollgate::Take<'_>]) -> String {
    store::fingerprint(takes)
}

/// The take script's reply decoded as the store decodes it, for tests that call the script by
/// hand: `None` when it is not a string of packed integers. Public under the `test-server`
/// feature.
#[cfg(feature = "test-server")]
pub fn script_reply(reply: &[u8]) -> Option<Vec<i64>> {
    batch::packed(reply)?
        .iter()
        .map(|bytes| batch::integer(*bytes))
        .collect()
}
mod tls;
mod units;
mod wants;

pub use breaker::BreakerConfig;
pub use failover::{Failover, FailoverStats, FailureMode, Guarded, Outcome};
pub use flags::MAX_FLAG_BYTES;
pub use store::{ConnectError, RedisConfig, RedisStore, redact};
pub use tls::TlsFiles;
pub use token_batches::TokenBatchStats;
pub use units::check_limit;
pub use wants::{MAX_WANT_TOKENS, MAX_WANT_TTL, Want};
