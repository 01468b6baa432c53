//! Concurrency limits: at most N requests in flight per key, each holding a lease.
//!
//! A rate says how often; a concurrency limit says how many at once, which is what protects a
//! backend whose cost is time held (a database connection, a GPU, a slow export). A request
//! takes a lease before it starts and gives it back when it ends. A client that dies without
//! giving it back must not hold the slot for ever, so every lease also times out: the slot
//! frees itself `lease_timeout` after it was taken.
//!
//! The semantics are stated on [`LeaseStore`], where users read them.
//!
//! The in-process store is [`MemoryLeases`]; a shared store (Redis) implements [`LeaseStore`]
//! and is held to the same decisions for the same inputs.

mod memory;

use std::fmt;
use std::future::Future;
use std::time::Duration;

use crate::clock::{Clock, Timestamp};
use crate::error::Error;
use crate::store::LocalStore;

pub use memory::{MemoryLeases, MemoryLeasesBuilder};

/// The most leases one key may hold at once. A key's leases are kept, and counted, one by one
/// (in Redis, one sorted-set member each), so the bound keeps one key's work and memory small.
pub const MAX_IN_FLIGHT: u64 = 1_000_000;

/// The longest lease timeout: a day. A lease is a request in flight; one that needs longer
/// should not be held by a timeout that long after its client is gone.
pub const MAX_LEASE_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// The longest lease id, in bytes. Ids become part of stored keys, so they are bounded.
pub const MAX_LEASE_ID_BYTES: usize = 64;

/// The parameters of a concurrency limit: how many leases a key may hold at once, and how long
/// one is held unless released sooner.
///
/// ```
/// use std::time::Duration;
/// use tollgate::LeaseLimit;
///
/// let limit = LeaseLimit::new(5, Duration::from_secs(30))?;
/// assert_eq!(limit.max_in_flight(), 5);
/// assert_eq!(limit.to_string(), "5 in flight, leases of 30000ms");
/// assert!(LeaseLimit::new(0, Duration::from_secs(30)).is_err());
/// assert!(LeaseLimit::new(5, Duration::from_micros(1500)).is_err()); // not whole milliseconds
/// # Ok::<(), tollgate::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseLimit {
    max_in_flight: u32,
    timeout_ms: u32,
}

impl LeaseLimit {
    /// At most `max_in_flight` leases held at once per key, each held `timeout` unless
    /// released sooner.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidLease`] when `max_in_flight` is 0 or above [`MAX_IN_FLIGHT`], or
    /// `timeout` is not a whole number of milliseconds between 1 ms and [`MAX_LEASE_TIMEOUT`]
    /// (every store keeps lease ends in whole milliseconds or finer, so both decide alike).
    pub fn new(max_in_flight: u64, timeout: Duration) -> Result<Self, Error> {
        if max_in_flight == 0 {
            return Err(invalid("max_in_flight must be at least 1"));
        }
        if max_in_flight > MAX_IN_FLIGHT {
            return Err(invalid("max_in_flight must be at most 1000000"));
        }
        if timeout.is_zero() || timeout > MAX_LEASE_TIMEOUT {
            return Err(invalid("lease_timeout must be between 1ms and 24h"));
        }
        if !timeout.subsec_nanos().is_multiple_of(1_000_000) {
            return Err(invalid(
                "lease_timeout must be a whole number of milliseconds",
            ));
        }
        // At most 86,400,000 ms, which fits; the bound above makes the cast lossless.
        let timeout_ms = u32::try_from(timeout.as_millis())
            .map_err(|_| invalid("lease_timeout must be between 1ms and 24h"))?;
        let max_in_flight = u32::try_from(max_in_flight)
            .map_err(|_| invalid("max_in_flight must be at most 1000000"))?;
        Ok(Self {
            max_in_flight,
            timeout_ms,
        })
    }

    /// How many leases a key may hold at once.
    pub fn max_in_flight(&self) -> u64 {
        u64::from(self.max_in_flight)
    }

    /// How long a lease is held unless released sooner.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(u64::from(self.timeout_ms))
    }

    /// [`timeout`](Self::timeout) in whole milliseconds.
    pub fn timeout_ms(&self) -> u64 {
        u64::from(self.timeout_ms)
    }
}

impl fmt::Display for LeaseLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} in flight, leases of {}ms",
            self.max_in_flight, self.timeout_ms
        )
    }
}

fn invalid(reason: &'static str) -> Error {
    Error::InvalidLease { reason }
}

/// Refuses lease ids that are empty, longer than [`MAX_LEASE_ID_BYTES`], or hold anything but
/// ASCII letters, digits, `-` and `_` (ids travel in URL paths and become part of keys).
///
/// # Errors
///
/// [`Error::InvalidLeaseId`].
pub fn check_lease_id(id: &str) -> Result<(), Error> {
    let fits = !id.is_empty() && id.len() <= MAX_LEASE_ID_BYTES;
    if !fits
        || !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(Error::InvalidLeaseId { len: id.len() });
    }
    Ok(())
}

/// What an acquire decided for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseDecision {
    allowed: bool,
    max_in_flight: u64,
    in_flight: u64,
    retry_after: Option<Duration>,
    reset_after: Duration,
    denied: bool,
}

impl LeaseDecision {
    /// A decision as a store reports it: whether this key had a free slot, its limit, the
    /// leases it holds after the decision, how long until a held lease times out when it had
    /// none free (`None` when it had), and how long until every lease held has timed out.
    /// For stores outside this crate; figures are kept as given.
    pub fn new(
        allowed: bool,
        max_in_flight: u64,
        in_flight: u64,
        retry_after: Option<Duration>,
        reset_after: Duration,
    ) -> Self {
        Self {
            allowed,
            max_in_flight,
            in_flight,
            retry_after,
            reset_after,
            denied: false,
        }
    }

    /// A refusal that no slot decided: the request is denied whatever the key holds (a deny
    /// limit or override of a policy), so no release or timeout will let it in. Its limit is
    /// zero leases, it holds none, and it has no `retry_after`: waiting does not help.
    ///
    /// ```
    /// let denied = tollgate::LeaseDecision::denied();
    /// assert!(!denied.allowed() && denied.is_denied());
    /// assert_eq!((denied.max_in_flight(), denied.remaining()), (0, 0));
    /// assert_eq!(denied.retry_after(), None);
    /// ```
    pub fn denied() -> Self {
        Self {
            allowed: false,
            max_in_flight: 0,
            in_flight: 0,
            retry_after: None,
            reset_after: Duration::ZERO,
            denied: true,
        }
    }

    /// Whether this is a denial ([`LeaseDecision::denied`]): refused whatever the key holds.
    pub fn is_denied(&self) -> bool {
        self.denied
    }

    /// Whether this key had a free slot. The acquire as a whole passes only if every key had
    /// one.
    pub fn allowed(&self) -> bool {
        self.allowed
    }

    /// The limit: how many leases the key may hold at once.
    pub fn max_in_flight(&self) -> u64 {
        self.max_in_flight
    }

    /// Leases the key holds after this decision (with this one, if it was taken).
    pub fn in_flight(&self) -> u64 {
        self.in_flight
    }

    /// Slots still free after this decision.
    pub fn remaining(&self) -> u64 {
        self.max_in_flight.saturating_sub(self.in_flight)
    }

    /// When the key had no free slot: how long until its oldest lease times out, the latest a
    /// slot frees itself. `None` when it had one.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// How long until every lease the key holds has timed out (zero when it holds none).
    pub fn reset_after(&self) -> Duration {
        self.reset_after
    }
}

/// One key of an acquire.
#[derive(Debug, Clone, Copy)]
pub struct LeaseTake<'a> {
    /// The key. Keys of one subject should share a `{hash tag}`, as buckets' do, so that a
    /// clustered store can decide them in one atomic step.
    pub key: &'a str,
    /// The key's limit.
    pub limit: &'a LeaseLimit,
    /// Whether a full key fails the acquire. A key that does not (a limit in shadow mode, a
    /// key outside a rollout) is held when it has a free slot and the acquire passes, and only
    /// reports a would-reject when it has none, so that its count shows what enforcing it
    /// would do.
    pub enforce: bool,
}

impl<'a> LeaseTake<'a> {
    /// An enforced key: the acquire passes only if it has a free slot.
    pub fn new(key: &'a str, limit: &'a LeaseLimit) -> Self {
        Self {
            key,
            limit,
            enforce: true,
        }
    }

    /// The same key, held when free but never failing the acquire.
    #[must_use]
    pub fn soft(self) -> Self {
        Self {
            enforce: false,
            ..self
        }
    }
}

/// An acquire of one lease on one or more keys.
#[derive(Debug, Clone, Copy)]
pub struct LeaseRequest<'a> {
    /// The keys, decided all or nothing.
    pub takes: &'a [LeaseTake<'a>],
    /// The lease's id, chosen by the caller and unique (see [`check_lease_id`]); releasing it
    /// frees every key. Ignored when only looking ([`LeaseStore::in_flight`]).
    pub lease_id: &'a str,
    /// The time of the decision; `None` uses the store's own clock, as for
    /// [`CheckRequest::now`](crate::CheckRequest::now).
    pub now: Option<Timestamp>,
}

/// A place where leases live.
///
/// # Semantics
///
/// For a key under a [`LeaseLimit`] of `max_in_flight` N and timeout T:
///
/// * a lease taken at `t` is held on `[t, t + T)`: from `t + T` on it no longer counts, whether
///   or not it was released;
/// * an acquire at `now` passes if fewer than N leases are held at `now`, and then holds one
///   more; otherwise it is rejected and **holds nothing**;
/// * an acquire over several keys is all or nothing, as a check over several buckets is: one
///   lease id holds one slot on every key, or on none;
/// * a release frees the lease's slot on every key it holds, at once; releasing a lease that
///   timed out or was released before changes nothing and says so;
/// * a renewal, for work that runs longer than the timeout, moves the lease's end on every key
///   where it is still held to `now` plus the timeout it was taken with; a lease that timed
///   out is never revived (its slot may be another's by then);
/// * a rejected acquire's `retry_after` is when the oldest lease held times out: the latest a
///   slot can free itself (a release may free one sooner). `reset_after` is when the last one
///   does.
///
/// Concurrent acquires never hold more than N leases on a key at any instant, whatever their
/// interleaving. A clock that goes back frees nothing: a lease counts until a `now` at or past
/// its end.
///
/// # Contract
///
/// Every implementation must:
///
/// * decide an acquire atomically with respect to every other acquire and release on the same
///   keys, and never hold more than `max_in_flight` leases on a key at any `now`;
/// * be all or nothing: if any enforced key has no free slot, hold nothing anywhere; else hold
///   one slot on every enforced key and on every other key that has one free. Where one atomic
///   step over all keys is impossible, take and then give back, so the store may briefly
///   under-admit but never over-admit (and document which it does);
/// * refuse an invalid lease id ([`check_lease_id`]), a key twice in one acquire
///   ([`Error::DuplicateKey`]) and an empty acquire ([`Error::EmptyCheck`]) before changing
///   anything, and an id already held ([`Error::LeaseIdInUse`]);
/// * return decisions in the order of `takes`;
/// * report a failure to reach its state as [`Error::StoreUnavailable`], never as a rejection.
pub trait LeaseStore: Send + Sync {
    /// Takes one lease on every key of `request`, or none.
    fn acquire(
        &self,
        request: LeaseRequest<'_>,
    ) -> impl Future<Output = Result<Vec<LeaseDecision>, Error>> + Send;

    /// What each key of `request` would decide on its own, holding nothing: for "explain"
    /// endpoints. The lease id is not looked at.
    fn in_flight(
        &self,
        request: LeaseRequest<'_>,
    ) -> impl Future<Output = Result<Vec<LeaseDecision>, Error>> + Send;

    /// Gives lease `lease_id` back on every key it holds. `Ok(true)` if it was still held at
    /// `now` (the store's clock when `None`), `Ok(false)` if it timed out, was released before,
    /// or never existed.
    fn release(
        &self,
        lease_id: &str,
        now: Option<Timestamp>,
    ) -> impl Future<Output = Result<bool, Error>> + Send;
    /// Extends lease `lease_id` for work that runs longer than its timeout: on every key where
    /// it is still held at `now` (the store's clock when `None`), its end moves to `now` plus
    /// the timeout it was taken with, never earlier than it was. `Ok(Some(d))` with `d` the
    /// time until its last end, `Ok(None)` when it is held nowhere (timed out, released or
    /// unknown): a timed-out lease is never revived, since its slot may be another's by then.
    fn renew(
        &self,
        lease_id: &str,
        now: Option<Timestamp>,
    ) -> impl Future<Output = Result<Option<Duration>, Error>> + Send;
}

impl<C: Clock> LocalStore<C> {
    /// [`LeaseStore::acquire`], without the future.
    ///
    /// # Errors
    ///
    /// As [`MemoryLeases::acquire`].
    pub fn acquire_now(&self, request: LeaseRequest<'_>) -> Result<Vec<LeaseDecision>, Error> {
        let now = request.now.unwrap_or_else(|| self.clock().now());
        self.leases().acquire(request.takes, request.lease_id, now)
    }

    /// [`LeaseStore::in_flight`], without the future.
    ///
    /// # Errors
    ///
    /// As [`MemoryLeases::in_flight`].
    pub fn in_flight_now(&self, request: LeaseRequest<'_>) -> Result<Vec<LeaseDecision>, Error> {
        let now = request.now.unwrap_or_else(|| self.clock().now());
        self.leases().in_flight(request.takes, now)
    }

    /// [`LeaseStore::renew`], without the future.
    ///
    /// # Errors
    ///
    /// As [`MemoryLeases::renew`].
    pub fn renew_now(
        &self,
        lease_id: &str,
        now: Option<Timestamp>,
    ) -> Result<Option<Duration>, Error> {
        let now = now.unwrap_or_else(|| self.clock().now());
        self.leases().renew(lease_id, now)
    }

    /// [`LeaseStore::release`], without the future.
    ///
    /// # Errors
    ///
    /// As [`MemoryLeases::release`].
    pub fn release_now(&self, lease_id: &str, now: Option<Timestamp>) -> Result<bool, Error> {
        let now = now.unwrap_or_else(|| self.clock().now());
        self.leases().release(lease_id, now)
    }
}

impl<C: Clock> LeaseStore for LocalStore<C> {
    fn acquire(
        &self,
        request: LeaseRequest<'_>,
    ) -> impl Future<Output = Result<Vec<LeaseDecision>, Error>> + Send {
        std::future::ready(self.acquire_now(request))
    }

    fn in_flight(
        &self,
        request: LeaseRequest<'_>,
    ) -> impl Future<Output = Result<Vec<LeaseDecision>, Error>> + Send {
        std::future::ready(self.in_flight_now(request))
    }

    fn release(
        &self,
        lease_id: &str,
        now: Option<Timestamp>,
    ) -> impl Future<Output = Result<bool, Error>> + Send {
        std::future::ready(self.release_now(lease_id, now))
    }
    fn renew(
        &self,
        lease_id: &str,
        now: Option<Timestamp>,
    ) -> impl Future<Output = Result<Option<Duration>, Error>> + Send {
        std::future::ready(self.renew_now(lease_id, now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_out_of_range_are_refused_with_their_rule() {
        let s = Duration::from_secs(1);
        let cases = [
            (0, s, "max_in_flight must be at least 1"),
            (
                MAX_IN_FLIGHT + 1,
                s,
                "max_in_flight must be at most 1000000",
            ),
            (
                1,
                Duration::ZERO,
                "lease_timeout must be between 1ms and 24h",
            ),
            (
                1,
                MAX_LEASE_TIMEOUT + Duration::from_millis(1),
                "lease_timeout must be between 1ms and 24h",
            ),
            (
                1,
                Duration::from_nanos(1_000_001),
                "lease_timeout must be a whole number of milliseconds",
            ),
        ];
        for (max, timeout, reason) in cases {
            assert_eq!(
                LeaseLimit::new(max, timeout),
                Err(Error::InvalidLease { reason }),
                "{max} {timeout:?}"
            );
        }
        let widest = LeaseLimit::new(MAX_IN_FLIGHT, MAX_LEASE_TIMEOUT).unwrap();
        assert_eq!(widest.timeout(), MAX_LEASE_TIMEOUT);
        assert_eq!(widest.max_in_flight(), MAX_IN_FLIGHT);
        assert_eq!(
            LeaseLimit::new(1, Duration::from_millis(1))
                .unwrap()
                .timeout_ms(),
            1
        );
        assert_eq!(
            MAX_LEASE_TIMEOUT.as_secs(),
            24 * 3600,
            "the 24h the rule names"
        );
        assert_eq!(
            LeaseLimit::new(5, Duration::from_secs(30))
                .unwrap()
                .to_string(),
            "5 in flight, leases of 30000ms"
        );
    }

    #[test]
    fn only_a_denial_is_denied() {
        assert!(LeaseDecision::denied().is_denied());
        let full = LeaseDecision::new(false, 2, 2, Some(Duration::from_secs(1)), Duration::ZERO);
        assert!(!full.is_denied(), "a full key may free a slot");
    }

    #[test]
    fn a_local_store_takes_leases_on_its_clock() {
        let clock = crate::ManualClock::new();
        let store = LocalStore::new(clock.clone());
        let limit = LeaseLimit::new(1, Duration::from_secs(10)).unwrap();
        let takes = [LeaseTake::new("k", &limit)];
        let request = |lease_id| LeaseRequest {
            takes: &takes,
            lease_id,
            now: None,
        };
        assert!(store.acquire_now(request("a")).unwrap()[0].allowed());
        assert!(!store.acquire_now(request("b")).unwrap()[0].allowed());
        assert_eq!(store.in_flight_now(request("")).unwrap()[0].in_flight(), 1);
        clock.advance(Duration::from_secs(4));
        assert_eq!(
            store.renew_now("a", None).unwrap(),
            Some(Duration::from_secs(10)),
            "held until 14 s"
        );
        assert_eq!(store.renew_now("b", None).unwrap(), None, "never held");
        assert!(store.release_now("a", None).unwrap());
        assert!(!store.release_now("a", None).unwrap(), "already given back");
        assert_eq!(store.in_flight_now(request("")).unwrap()[0].in_flight(), 0);
    }

    #[test]
    fn lease_ids_are_short_url_safe_words() {
        for good in ["a", "0123456789abcdef", "lease_1-x", &"z".repeat(64)] {
            assert_eq!(check_lease_id(good), Ok(()), "{good}");
        }
        for bad in ["", &"z".repeat(65), "a b", "a/b", "é", "a:b", "{tag}"] {
            assert_eq!(
                check_lease_id(bad),
                Err(Error::InvalidLeaseId { len: bad.len() }),
                "{bad}"
            );
        }
    }
}
