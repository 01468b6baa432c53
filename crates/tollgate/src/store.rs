//! The store interface every backend implements, so the limiter, the policy engine and the
//! server decide the same way whether buckets live in this process or in Redis.
//!
//! The operation is named, not a closure: "take `cost` from each bucket at `now`, all or
//! nothing". Rust and Lua implement the same meaning, and the conformance suite in
//! [`crate::testkit`] holds every implementation to the memory store's decisions.

use std::future::Future;

use crate::clock::{Clock, Timestamp};
use crate::decision::Decision;
use crate::error::Error;
use crate::lease::MemoryLeases;
use crate::limit::Limit;
use crate::memory::{Item, MemoryStore};

/// One bucket of a check.
#[derive(Debug, Clone, Copy)]
pub struct Take<'a> {
    /// The bucket's identity. Keys of one subject (one user, one tenant) should share a
    /// `{hash tag}` so that a clustered store can decide them in one atomic step.
    pub key: &'a str,
    /// The bucket's parameters.
    pub limit: &'a Limit,
    /// Tokens to take.
    pub cost: u64,
    /// Where this bucket's balance was kept before its parameters last changed, for a store
    /// that cannot move every bucket over when a limit changes (see [`Carry`]).
    pub carry: Option<Carry<'a>>,
}

impl<'a> Take<'a> {
    /// `cost` tokens from the bucket at `key` with parameters `limit`, nothing carried.
    pub fn new(key: &'a str, limit: &'a Limit, cost: u64) -> Self {
        Self {
            key,
            limit,
            cost,
            carry: None,
        }
    }

    /// The same take, reading the bucket's earlier balance from `carry`.
    #[must_use]
    pub fn carried_from(self, carry: Carry<'a>) -> Self {
        Self {
            carry: Some(carry),
            ..self
        }
    }
}

/// A bucket's earlier self: the same subject's bucket under the parameters a limit had before
/// a policy change, kept under another key.
///
/// When a limit's capacity or rate changes, its balances must carry over (SPEC §2: refilled
/// under the old parameters up to the change, clamped to the new capacity, refilled under the
/// new ones since). A store in this process moves every bucket at the change
/// ([`MemoryStore::rebase_where`]) and ignores this. A store shared by many processes cannot:
/// each process changes at its own moment, and there may be millions of buckets. It reads the
/// old bucket on the way instead, and keeps the emptier of the new bucket and the old one
/// carried over, so a change never hands anyone a fresh burst.
#[derive(Debug, Clone, Copy)]
pub struct Carry<'a> {
    /// The old bucket's key. A clustered store reads it only when it shares the bucket's slot
    /// (the same `{hash tag}`); otherwise the bucket is decided as if nothing were carried.
    pub key: &'a str,
    /// The parameters the old bucket was kept under.
    pub limit: &'a Limit,
    /// How long before the request the change took effect. Past the new limit's time to
    /// full nothing carried can matter, and the carry may be dropped.
    pub since: std::time::Duration,
}

/// A check of one or more buckets.
#[derive(Debug, Clone, Copy)]
pub struct CheckRequest<'a> {
    /// The buckets, decided all or nothing.
    pub takes: &'a [Take<'a>],
    /// Makes a retry free: see [`MemoryStore::check_idempotent`].
    pub request_id: Option<&'a str>,
    /// The time of the decision. `None` uses the store's own clock (for Redis, the server's
    /// `TIME`, one clock for every process sharing it). Supplying it is for tests and for
    /// replaying traces; never mix both on the same buckets.
    pub now: Option<Timestamp>,
}

/// What settling a request gave back (see [`Store::settle`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settlement {
    /// Whether anything was given back.
    pub status: SettleStatus,
    /// Each bucket's standing after the settlement, in the order of the takes: an allowed,
    /// uncharged decision whose `remaining` counts what was given back.
    pub decisions: Vec<Decision>,
}

/// How a settlement went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SettleStatus {
    /// The charge was on record: the refunds were given back, and the request is settled.
    Settled,
    /// The request was settled before with the same refunds: nothing given back again.
    Repeated,
    /// No charge on record (never charged, rejected, or recorded longer ago than the store's
    /// idempotency window): nothing given back, the charge stands.
    NotFound,
}

impl SettleStatus {
    /// A stable lowercase name, for API answers and metric labels.
    pub fn as_str(&self) -> &'static str {
        match self {
            SettleStatus::Settled => "settled",
            SettleStatus::Repeated => "repeated",
            SettleStatus::NotFound => "not_found",
        }
    }
}

/// Refuses a settlement's `refunds` that do not pair one to one with `takes`, or pass their
/// costs: the check every [`Store::settle`] makes before anything else.
///
/// # Errors
///
/// [`Error::InvalidSettlement`].
pub fn check_refunds(takes: &[Take<'_>], refunds: &[u64]) -> Result<(), Error> {
    check_refund_costs(takes.iter().map(|take| take.cost), refunds)
}

/// As [`check_refunds`], over the costs charged.
pub(crate) fn check_refund_costs(
    costs: impl ExactSizeIterator<Item = u64>,
    refunds: &[u64],
) -> Result<(), Error> {
    if costs.len() != refunds.len() {
        return Err(Error::InvalidSettlement {
            reason: "it needs one refund per bucket",
        });
    }
    if costs.zip(refunds).any(|(cost, &refund)| refund > cost) {
        return Err(Error::InvalidSettlement {
            reason: "a refund cannot pass the cost charged",
        });
    }
    Ok(())
}

/// A place where buckets live.
///
/// # Contract
///
/// Every implementation must:
///
/// * decide a request atomically with respect to every other request on the same buckets;
/// * be all-or-nothing: if any bucket rejects, none is charged. Where one atomic step over all
///   buckets is impossible, charge and then refund, so the store may briefly under-admit but
///   never over-admit (and document which it does);
/// * never grant more than the bucket math of [`crate::bucket`] allows: a `now` that goes back
///   mints no tokens, a rejection charges nothing;
/// * refuse `cost` outside `1..=capacity` with [`Error::InvalidCost`] before changing anything;
/// * return decisions in the order of `takes`;
/// * report a failure to reach its state as [`Error::StoreUnavailable`], never as a rejection.
pub trait Store: Send + Sync {
    /// Decides `request`.
    fn check(
        &self,
        request: CheckRequest<'_>,
    ) -> impl Future<Output = Result<Vec<Decision>, Error>> + Send;

    /// What each bucket of `request` would decide on its own, charging nothing and recording
    /// nothing (the request id is ignored): for "explain" endpoints.
    fn peek(
        &self,
        request: CheckRequest<'_>,
    ) -> impl Future<Output = Result<Vec<Decision>, Error>> + Send;

    /// Settles a request this store charged earlier: gives `refunds[i]` tokens back to the
    /// bucket of `request.takes[i]`, once. This is how a reservation is committed when its
    /// real cost is known only afterwards (tokens of a model's answer, bytes of an upload):
    /// check with the most it may cost and a request id, then settle with what it did not use.
    ///
    /// `request` must be the check's own (same takes and costs, same request id, which is
    /// required). A settlement repeated with the same refunds gives nothing again; one that
    /// finds no charge on record (the check was rejected, or recorded longer ago than the
    /// idempotency window) gives nothing and says so. A refund restores no more than a smaller
    /// charge would have left ([`crate::bucket`]): it never over-admits.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidSettlement`] without a request id, with a refund above its take's cost
    /// or not one per take; [`Error::IdempotencyConflict`] when the id was recorded for another
    /// check or settled with other refunds; [`Error::StoreUnavailable`]. None gives anything.
    ///
    /// # Example
    ///
    /// ```
    /// use tollgate::{CheckRequest, Limit, LocalStore, ManualClock, SettleStatus, Store, Take};
    /// use tollgate::block_on_ready;
    ///
    /// let store = LocalStore::new(ManualClock::new());
    /// let tokens = Limit::new(1000, "1000/m".parse()?)?;
    /// // Reserve the most a model's answer may cost...
    /// let takes = [Take::new("user:7", &tokens, 800)];
    /// let request = CheckRequest { takes: &takes, request_id: Some("job-1"), now: None };
    /// assert_eq!(block_on_ready(store.check(request))?[0].remaining(), 200);
    /// // ...and settle for the 300 it used: 500 go back, once.
    /// let settled = block_on_ready(store.settle(request, &[500]))?;
    /// assert_eq!(settled.status, SettleStatus::Settled);
    /// assert_eq!(settled.decisions[0].remaining(), 700);
    /// let again = block_on_ready(store.settle(request, &[500]))?;
    /// assert_eq!(again.status, SettleStatus::Repeated);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    fn settle(
        &self,
        request: CheckRequest<'_>,
        refunds: &[u64],
    ) -> impl Future<Output = Result<Settlement, Error>> + Send;

    /// Gives each take's `cost` back to its bucket, with no record of the charge it came from:
    /// for a caller that took tokens earlier and returns some (Envoy's `is_negative_hits`, hits
    /// given back once a response shows what a request really cost). Where
    /// [`settle`](Self::settle) gives back against the record of a charge, this trusts the
    /// caller: a bucket can be filled by it without having been charged. It still never holds
    /// more than its capacity, nor more than if its latest charges had been `cost` smaller (see
    /// [`crate::bucket`]): a token bucket's full time moves back by `cost`'s worth, a window
    /// gives back from its latest count that holds anything (the current window's, else a
    /// sliding window's previous one), a log from its latest entry that does, never below 0.
    /// The request id is ignored; `now` is as for a check.
    ///
    /// Returns each bucket's standing afterwards, in the order of the takes: an allowed,
    /// uncharged decision for its cost. A store that spreads buckets over several places gives
    /// back in each on its own: after [`Error::StoreUnavailable`], some may have been given
    /// back and others not (which under-admits).
    ///
    /// The default refuses with [`Error::Unsupported`].
    ///
    /// # Errors
    ///
    /// [`Error::InvalidCost`] for a cost outside `1..=capacity`, [`Error::DuplicateKey`],
    /// [`Error::EmptyCheck`] (none gives anything); [`Error::Unsupported`];
    /// [`Error::StoreUnavailable`].
    ///
    /// # Example
    ///
    /// ```
    /// use tollgate::{CheckRequest, Limit, LocalStore, ManualClock, Store, Take};
    /// use tollgate::block_on_ready;
    ///
    /// let store = LocalStore::new(ManualClock::new());
    /// let limit = Limit::new(10, "1/h".parse()?)?;
    /// let takes = |cost| [Take::new("user:7", &limit, cost)];
    /// let take = |cost| {
    ///     let takes = takes(cost);
    ///     block_on_ready(store.check(CheckRequest { takes: &takes, request_id: None, now: None }))
    /// };
    /// let give = |cost| {
    ///     let takes = takes(cost);
    ///     let request = CheckRequest { takes: &takes, request_id: None, now: None };
    ///     block_on_ready(store.give_back(request))
    /// };
    /// assert_eq!(take(8)?[0].remaining(), 2);
    /// // The request used less than it was charged: three hits come back...
    /// assert_eq!(give(3)?[0].remaining(), 5);
    /// // ...and never more than the bucket holds.
    /// assert_eq!(give(10)?[0].remaining(), 10);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    fn give_back(
        &self,
        request: CheckRequest<'_>,
    ) -> impl Future<Output = Result<Vec<Decision>, Error>> + Send {
        let _ = request;
        std::future::ready(Err(Error::Unsupported {
            operation: "give back",
        }))
    }

    /// Makes the buckets of `keys` as if never used: a token bucket full, a window or a log
    /// counting nothing. For an operator who must let a subject in again now (after an
    /// incident, or a limit set too low); nothing else changes, and idempotency records stay,
    /// so the retry of a request decided before still gets its first decision. A key that
    /// holds nothing is left as it is.
    ///
    /// The default refuses with [`Error::Unsupported`]: a store that cannot reset says so
    /// rather than pretending.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`]; [`Error::StoreUnavailable`], after which some of the keys may
    /// have been reset and others not (a reset can be repeated).
    ///
    /// # Example
    ///
    /// ```
    /// use tollgate::{CheckRequest, Limit, LocalStore, ManualClock, Store, Take};
    /// use tollgate::block_on_ready;
    ///
    /// let store = LocalStore::new(ManualClock::new());
    /// let limit = Limit::new(2, "1/h".parse()?)?;
    /// let takes = [Take::new("user:7", &limit, 2)];
    /// let request = CheckRequest { takes: &takes, request_id: None, now: None };
    /// assert!(block_on_ready(store.check(request))?[0].allowed());
    /// assert!(!block_on_ready(store.check(request))?[0].allowed());
    /// block_on_ready(store.reset(&["user:7"]))?;
    /// assert!(block_on_ready(store.check(request))?[0].allowed());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    fn reset(&self, keys: &[&str]) -> impl Future<Output = Result<(), Error>> + Send {
        let _ = keys;
        std::future::ready(Err(Error::Unsupported { operation: "reset" }))
    }
}

/// A reference decides as the store it refers to: several users (a process's shares of global
/// limits, its own checks) can share one store without wrapping it.
impl<S: Store + ?Sized> Store for &S {
    fn check(
        &self,
        request: CheckRequest<'_>,
    ) -> impl Future<Output = Result<Vec<Decision>, Error>> + Send {
        (**self).check(request)
    }

    fn peek(
        &self,
        request: CheckRequest<'_>,
    ) -> impl Future<Output = Result<Vec<Decision>, Error>> + Send {
        (**self).peek(request)
    }

    fn settle(
        &self,
        request: CheckRequest<'_>,
        refunds: &[u64],
    ) -> impl Future<Output = Result<Settlement, Error>> + Send {
        (**self).settle(request, refunds)
    }

    fn give_back(
        &self,
        request: CheckRequest<'_>,
    ) -> impl Future<Output = Result<Vec<Decision>, Error>> + Send {
        (**self).give_back(request)
    }

    fn reset(&self, keys: &[&str]) -> impl Future<Output = Result<(), Error>> + Send {
        (**self).reset(keys)
    }
}

/// Shared ownership decides as the store owned.
impl<S: Store + ?Sized> Store for std::sync::Arc<S> {
    fn check(
        &self,
        request: CheckRequest<'_>,
    ) -> impl Future<Output = Result<Vec<Decision>, Error>> + Send {
        (**self).check(request)
    }

    fn peek(
        &self,
        request: CheckRequest<'_>,
    ) -> impl Future<Output = Result<Vec<Decision>, Error>> + Send {
        (**self).peek(request)
    }

    fn settle(
        &self,
        request: CheckRequest<'_>,
        refunds: &[u64],
    ) -> impl Future<Output = Result<Settlement, Error>> + Send {
        (**self).settle(request, refunds)
    }

    fn give_back(
        &self,
        request: CheckRequest<'_>,
    ) -> impl Future<Output = Result<Vec<Decision>, Error>> + Send {
        (**self).give_back(request)
    }

    fn reset(&self, keys: &[&str]) -> impl Future<Output = Result<(), Error>> + Send {
        (**self).reset(keys)
    }
}

/// Runs `future` to its end on this thread, without an async runtime: for futures that never
/// wait on anything, as every future of [`LocalStore`] (the in-process store answers at once).
/// Code generic over [`Store`] can so serve synchronous callers too. A future that did wait
/// would be polled again and again, never woken: give those to a runtime.
pub fn block_on_ready<F: Future>(future: F) -> F::Output {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let mut future = std::pin::pin!(future);
    loop {
        if let std::task::Poll::Ready(value) = future.as_mut().poll(&mut cx) {
            return value;
        }
    }
}

/// The memory store behind the [`Store`] interface, timed by a [`Clock`].
///
/// ```
/// use tollgate::{CheckRequest, Limit, LocalStore, ManualClock, Store, Take, block_on_ready};
///
/// let store = LocalStore::new(ManualClock::new());
/// let limit = Limit::new(1, "1/s".parse()?)?;
/// let takes = [Take::new("user:{42}", &limit, 1)];
/// let request = CheckRequest { takes: &takes, request_id: None, now: None };
/// assert!(block_on_ready(store.check(request))?[0].allowed());
/// assert!(!block_on_ready(store.check(request))?[0].allowed());
/// # Ok::<(), tollgate::Error>(())
/// ```
pub struct LocalStore<C> {
    store: MemoryStore<Box<str>>,
    /// Boxed: most users of a local store never take a lease, and should not carry the
    /// table's size inline wherever they keep the store.
    leases: Box<MemoryLeases>,
    clock: C,
}

impl<C: Clock> LocalStore<C> {
    /// A default [`MemoryStore`] read through `clock`.
    pub fn new(clock: C) -> Self {
        Self::with_store(MemoryStore::default(), clock)
    }

    /// `store`, read through `clock`.
    pub fn with_store(store: MemoryStore<Box<str>>, clock: C) -> Self {
        Self {
            store,
            leases: Box::default(),
            clock,
        }
    }

    /// The same store with `leases` as its lease table (for a bound other than the default).
    #[must_use]
    pub fn with_leases(self, leases: MemoryLeases) -> Self {
        Self {
            leases: Box::new(leases),
            ..self
        }
    }

    /// The lease table inside, for concurrency limits ([`crate::LeaseStore`]).
    pub fn leases(&self) -> &MemoryLeases {
        &self.leases
    }

    /// The memory store inside.
    pub fn memory(&self) -> &MemoryStore<Box<str>> {
        &self.store
    }

    /// The clock that times requests without a `now`.
    pub fn clock(&self) -> &C {
        &self.clock
    }

    /// [`Store::check`], without the future: the memory store never waits.
    ///
    /// # Errors
    ///
    /// As [`MemoryStore::check_all`].
    pub fn check_now(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
        let now = request.now.unwrap_or_else(|| self.clock.now());
        if let [take] = request.takes {
            let decision = match request.request_id {
                None => self.store.check(take.key, take.limit, take.cost, now)?,
                Some(id) => self
                    .store
                    .check_idempotent(take.key, take.limit, take.cost, now, id)?,
            };
            return Ok(vec![decision]);
        }
        self.store
            .check_all(&items_of(request.takes), now, request.request_id)
    }

    /// [`Store::settle`], without the future.
    ///
    /// # Errors
    ///
    /// As [`MemoryStore::settle`], and [`Error::InvalidSettlement`] without a request id.
    pub fn settle_now(
        &self,
        request: CheckRequest<'_>,
        refunds: &[u64],
    ) -> Result<Settlement, Error> {
        let now = request.now.unwrap_or_else(|| self.clock.now());
        let id = request.request_id.ok_or(Error::InvalidSettlement {
            reason: "it needs the request id its check was made with",
        })?;
        self.store
            .settle(&items_of(request.takes), now, id, refunds)
    }

    /// [`Store::give_back`], without the future.
    ///
    /// # Errors
    ///
    /// As [`MemoryStore::give_back`].
    pub fn give_back_now(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
        let now = request.now.unwrap_or_else(|| self.clock.now());
        self.store.give_back(&items_of(request.takes), now)
    }

    /// [`Store::peek`], without the future.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidCost`] for any bucket.
    pub fn peek_now(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
        let now = request.now.unwrap_or_else(|| self.clock.now());
        request
            .takes
            .iter()
            .map(|take| self.store.peek(take.key, take.limit, take.cost, now))
            .collect()
    }
}

/// The memory store's items for `takes` (it keeps no carries: this process's buckets are moved
/// over when a limit changes).
fn items_of<'a>(takes: &[Take<'a>]) -> Vec<Item<'a, str>> {
    takes
        .iter()
        .map(|take| Item {
            key: take.key,
            limit: take.limit,
            cost: take.cost,
        })
        .collect()
}

impl<C: Clock> Store for LocalStore<C> {
    fn check(
        &self,
        request: CheckRequest<'_>,
    ) -> impl Future<Output = Result<Vec<Decision>, Error>> + Send {
        std::future::ready(self.check_now(request))
    }

    fn peek(
        &self,
        request: CheckRequest<'_>,
    ) -> impl Future<Output = Result<Vec<Decision>, Error>> + Send {
        std::future::ready(self.peek_now(request))
    }

    fn settle(
        &self,
        request: CheckRequest<'_>,
        refunds: &[u64],
    ) -> impl Future<Output = Result<Settlement, Error>> + Send {
        std::future::ready(self.settle_now(request, refunds))
    }

    fn give_back(
        &self,
        request: CheckRequest<'_>,
    ) -> impl Future<Output = Result<Vec<Decision>, Error>> + Send {
        std::future::ready(self.give_back_now(request))
    }

    fn reset(&self, keys: &[&str]) -> impl Future<Output = Result<(), Error>> + Send {
        for key in keys {
            self.memory().reset(*key);
        }
        std::future::ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{LeaseLimit, LeaseTake, ManualClock};

    fn limit(capacity: u64, rate: &str) -> Limit {
        Limit::new(capacity, rate.parse().unwrap()).unwrap()
    }

    fn request<'a>(takes: &'a [Take<'a>], request_id: Option<&'a str>) -> CheckRequest<'a> {
        CheckRequest {
            takes,
            request_id,
            now: None,
        }
    }

    #[test]
    fn a_local_store_decides_one_or_several_buckets_on_its_clock() {
        let clock = ManualClock::new();
        let store = LocalStore::new(clock.clone());
        let (two, one) = (limit(2, "1/s"), limit(1, "1/s"));
        let both = [Take::new("a", &two, 1), Take::new("b", &one, 1)];
        let allowed = |decisions: Vec<Decision>| decisions.iter().map(Decision::allowed).collect();
        let checked: Vec<bool> = allowed(store.check_now(request(&both, None)).unwrap());
        assert_eq!(checked, [true, true]);
        // b is empty: the pair is refused (a alone would pass), and a keeps its last token.
        let checked: Vec<bool> = allowed(store.check_now(request(&both, None)).unwrap());
        assert_eq!(checked, [true, false]);
        let peeked: Vec<bool> = allowed(store.peek_now(request(&both, None)).unwrap());
        assert_eq!(peeked, [true, false]);
        let a = [Take::new("a", &two, 1)];
        assert!(store.check_now(request(&a, Some("r-1"))).unwrap()[0].allowed());
        assert!(!store.check_now(request(&a, None)).unwrap()[0].allowed());
        // A retry gets the first decision; after the clock moves a second, b has a token.
        assert!(store.check_now(request(&a, Some("r-1"))).unwrap()[0].allowed());
        clock.advance(Duration::from_secs(1));
        let checked: Vec<bool> = allowed(store.check_now(request(&both, None)).unwrap());
        assert_eq!(checked, [true, true]);
    }

    #[test]
    fn a_local_store_settles_only_a_request_it_can_name() {
        let store = LocalStore::new(ManualClock::new());
        let l = limit(5, "1/h");
        let takes = [Take::new("a", &l, 3)];
        store.check_now(request(&takes, Some("r"))).unwrap();
        assert!(matches!(
            store.settle_now(request(&takes, None), &[2]),
            Err(Error::InvalidSettlement { .. })
        ));
        let settled = store.settle_now(request(&takes, Some("r")), &[2]).unwrap();
        assert_eq!(settled.status, SettleStatus::Settled);
        assert_eq!(settled.decisions[0].remaining(), 4, "5 - 3 + 2");
    }

    #[test]
    fn a_local_store_keeps_the_lease_table_it_was_given() {
        let store = LocalStore::new(ManualClock::new())
            .with_leases(MemoryLeases::builder().max_leases(1).build());
        let limit = LeaseLimit::new(5, Duration::from_secs(30)).unwrap();
        let takes = [LeaseTake::new("k", &limit)];
        store
            .leases()
            .acquire(&takes, "l-1", Timestamp::ZERO)
            .unwrap();
        assert!(matches!(
            store.leases().acquire(&takes, "l-2", Timestamp::ZERO),
            Err(Error::TooManyLeases { max: 1 })
        ));
    }

    #[test]
    fn refunds_pair_with_takes_and_stay_within_their_costs() {
        let l = limit(5, "1/s");
        let takes = [Take::new("a", &l, 3), Take::new("b", &l, 1)];
        assert!(check_refunds(&takes, &[3, 0]).is_ok());
        assert!(check_refunds(&takes, &[3]).is_err());
        assert!(check_refunds(&takes, &[0, 2]).is_err());
    }

    #[test]
    fn a_carried_take_names_its_old_bucket() {
        let (old, new) = (limit(5, "1/s"), limit(10, "1/s"));
        let carry = Carry {
            key: "k@1",
            limit: &old,
            since: Duration::from_secs(2),
        };
        let take = Take::new("k@2", &new, 1).carried_from(carry);
        assert_eq!(take.carry.map(|carry| carry.key), Some("k@1"));
        assert_eq!(take.key, "k@2");
    }

    #[test]
    fn settle_statuses_have_stable_names() {
        assert_eq!(SettleStatus::Settled.as_str(), "settled");
        assert_eq!(SettleStatus::Repeated.as_str(), "repeated");
        assert_eq!(SettleStatus::NotFound.as_str(), "not_found");
    }
}
