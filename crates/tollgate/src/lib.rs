//! Exact token-bucket rate limiting.
//!
//! `tollgate` decides, for a key and a cost, whether a request may pass, with exact integer
//! arithmetic, monotonic time and bounded memory. It is the core of the tollgate rate-limiting
//! system: the server, the policy engine and the tower layer all decide through the math in
//! [`bucket`].
//!
//! ```
//! use std::time::Duration;
//! use tollgate::{Limit, ManualClock, RateLimiter};
//!
//! // 20 tokens of burst, refilled at 10 per second.
//! let clock = ManualClock::new();
//! let limiter = RateLimiter::new(Limit::new(20, "10/s".parse()?)?, clock.clone());
//!
//! assert!(limiter.check_n("tenant-a", 20)?.allowed());
//! let denied = limiter.check("tenant-a")?;
//! assert!(!denied.allowed());
//! assert_eq!(denied.retry_after(), Some(Duration::from_millis(100)));
//!
//! clock.advance(Duration::from_millis(100));
//! assert!(limiter.check("tenant-a")?.allowed());
//! # Ok::<(), tollgate::Error>(())
//! ```
//!
//! # Semantics
//!
//! * A bucket holds at most `capacity` tokens and gains `amount` per `period`, lazily, exactly.
//!   A new bucket is full.
//! * A check of `cost` passes if the bucket holds `cost` tokens, and takes them; otherwise it is
//!   rejected and **charges nothing**. `cost` must be in `1..=capacity`, else it is an error.
//! * Time only moves forward: a clock that goes back mints no tokens.
//! * Concurrent checks never admit more than the math allows; several buckets can be checked
//!   all-or-nothing ([`MemoryStore::check_all`]); a `request_id` makes a retry free.
//! * A [`Decision`] reports `remaining` (floored), `retry_after` (exact, rounded up) and
//!   `reset_after`.
//! * A request charged with a `request_id` can be settled once for less than it cost
//!   ([`Store::settle`]): a reservation whose real cost is known afterwards gets the rest back.
//!
//! # Algorithms
//!
//! A [`Limit`] is a token bucket by default ([`Limit::new`]); [`Limit::fixed_window`],
//! [`Limit::sliding_window`] and [`Limit::sliding_log`] count at most `limit` per window
//! instead (see [`Algorithm`]). All four decide through the same [`Decision`] and live in
//! the same stores.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::{Limit, ManualClock, RateLimiter};
//!
//! let clock = ManualClock::new();
//! let window = Limit::sliding_window(10, Duration::from_secs(1))?;
//! let limiter = RateLimiter::new(window, clock.clone());
//! assert!(limiter.check_n("k", 10)?.allowed());
//! // A quarter into the next window, the last one still weighs three quarters: 7.5 of 10.
//! clock.advance(Duration::from_millis(1_250));
//! let decision = limiter.check_n("k", 3)?;
//! assert!(!decision.allowed());
//! assert_eq!(decision.remaining(), 2);
//! assert_eq!(decision.retry_after(), Some(Duration::from_millis(50)));
//! # Ok::<(), tollgate::Error>(())
//! ```
//!
//! # Concurrency limits
//!
//! A [`LeaseLimit`] caps how many requests per key are in flight at once rather than how often
//! they come: a request takes a lease before its work and gives it back after, and a lease
//! nobody gives back times out. [`LeaseStore`] states the semantics; [`MemoryLeases`] (inside
//! every [`LocalStore`]) keeps leases in this process.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::{LeaseLimit, LeaseTake, MemoryLeases, Timestamp};
//!
//! let leases = MemoryLeases::default();
//! let limit = LeaseLimit::new(2, Duration::from_secs(30))?;
//! let takes = [LeaseTake::new("exports:{acme}", &limit)];
//! let t0 = Timestamp::ZERO;
//! assert!(leases.acquire(&takes, "a", t0)?[0].allowed());
//! assert!(leases.acquire(&takes, "b", t0)?[0].allowed());
//! assert!(!leases.acquire(&takes, "c", t0)?[0].allowed());
//! leases.release("a", t0)?;
//! assert!(leases.acquire(&takes, "c", t0)?[0].allowed());
//! # Ok::<(), tollgate::Error>(())
//! ```

pub mod bucket;
mod clock;
mod decision;
mod error;
mod idempotency;
mod lease;
mod limit;
mod limiter;
pub mod memory;
mod sliding_log;
mod store;
mod sync;
#[cfg(feature = "testkit")]
pub mod testkit;
mod window;

pub use bucket::BucketState;
pub use clock::{Clock, ManualClock, MonotonicClock, Timestamp};
pub use decision::Decision;
pub use error::{Error, Unavailable};
pub use idempotency::{MAX_REQUEST_ID_BYTES, check_request_id};
pub use lease::{
    LeaseDecision, LeaseLimit, LeaseRequest, LeaseStore, LeaseTake, MAX_IN_FLIGHT,
    MAX_LEASE_ID_BYTES, MAX_LEASE_TIMEOUT, MemoryLeases, MemoryLeasesBuilder, check_lease_id,
};
pub use limit::{Algorithm, Limit, MAX_LOG_LIMIT, MAX_TIME_TO_FULL, MAX_WINDOW_LIMIT, Rate};
pub use limiter::RateLimiter;
pub use memory::{Item, MemoryStats, MemoryStore, MemoryStoreBuilder};
pub use store::{
    Carry, CheckRequest, LocalStore, SettleStatus, Settlement, Store, Take, block_on_ready,
    check_refunds,
};
