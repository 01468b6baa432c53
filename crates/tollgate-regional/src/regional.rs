//! The reservoirs of one process, and the store that spends them.
//!
//! **Invariant:** a process only ever admits a global limit's tokens that the global store
//! charged it, and gives back only tokens it has taken out of its reservoir first. So however
//! the rounds, the requests and the other processes interleave, the requests all processes
//! admit on a global key never pass what its bucket on the global store admitted: at most its
//! capacity plus its refill over any interval (SPEC §2), across regions. What reservoirs hold
//! unspent is lost to everyone for as long as it sits there: under-admission, never
//! over-admission. A give-back is a settlement of the charge that bought the tokens, so the
//! global store's own rules keep it from restoring more than it took.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use parking_lot::Mutex;
use tollgate::{
    CheckRequest, Clock, Decision, Error, Limit, SettleStatus, Settlement, Store, Take, Timestamp,
    Unavailable, check_refunds, check_request_id,
};

use crate::board::Board;
use crate::recent::{self, Recent};
use crate::share;

/// How a process holds its shares of global limits.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// How often each reservoir is topped up or trimmed. Every process sharing a global store
    /// should use the same: wants are tokens per two rounds.
    pub interval: Duration,
    /// A reservoir with no request for this long is given back and forgotten.
    pub abandon_after: Duration,
    /// Reservoirs held at most. A new key beyond it is fetched for its request alone, and
    /// what is left given back at once: a round trip to the global store per request.
    pub max_keys: usize,
    /// Calls to the global store a round has in flight at most.
    pub in_flight: usize,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(1),
            abandon_after: Duration::from_secs(60),
            max_keys: 100_000,
            in_flight: 64,
        }
    }
}

/// What a round did, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Round {
    /// Reservoirs looked at.
    pub keys: usize,
    /// Tokens charged on the global store.
    pub fetched: u64,
    /// Tokens given back to it.
    pub given_back: u64,
    /// Reservoirs forgotten after going quiet.
    pub abandoned: usize,
    /// Calls the global store or the board could not answer.
    pub failed: usize,
}

/// Unsettled charges a reservoir keeps. Tokens bought by charges older than these can only be
/// spent, not given back: a reservoir topped up every round holds a few rounds' charges.
const KEPT_CHARGES: usize = 16;

/// A charge made on the global store, kept so that its tokens can be given back.
#[derive(Debug, Clone)]
struct Charge {
    id: Box<str>,
    limit: Limit,
    cost: u64,
}

/// One key's prepaid tokens.
#[derive(Debug)]
struct Reservoir {
    limit: Limit,
    tokens: u64,
    /// Tokens spent and turned away since the last round: the demand.
    spent: u64,
    refused: u64,
    last_used: Timestamp,
    last_round: Timestamp,
    /// Charges not yet settled, oldest first, at most [`KEPT_CHARGES`]: what its tokens can
    /// be given back under.
    charges: VecDeque<Charge>,
    /// The global bucket was empty when last asked: not before this time can asking help.
    empty_until: Timestamp,
    /// The global store could not be reached, by the last round or a fetch since: cleared by
    /// the next round that reaches it.
    unavailable: Option<Unavailable>,
    /// The level the last round sized it to, doubled at each shortfall since.
    level: u64,
    /// A request found it short since the last round, and fetched.
    ran_short: bool,
}

impl Reservoir {
    /// Adds what `charge` bought.
    fn add(&mut self, tokens: u64, charge: Option<Charge>) {
        self.tokens = self.tokens.saturating_add(tokens);
        if let Some(charge) = charge {
            self.charges.push_back(charge);
            if self.charges.len() > KEPT_CHARGES {
                self.charges.pop_front();
            }
        }
    }
}

/// The books of one process.
#[derive(Default)]
struct Books {
    reservoirs: HashMap<Box<str>, Reservoir>,
    recent: Recent,
}

/// One process's shares of the global limits: reservoirs of tokens paid for in advance on
/// the global store `G`, the wants posted on board `B`, timed by `C`.
///
/// Decide through [`over`](Self::over), which pairs it with the regional store; run
/// [`rebalance`](Self::rebalance) every [`Options::interval`].
pub struct Regional<G, B, C> {
    global: G,
    board: B,
    clock: C,
    participant: Box<str>,
    options: Options,
    books: Mutex<Books>,
    charges: AtomicU64,
    /// Tokens charged on the global store and given back to it, since the start.
    fetched: AtomicU64,
    given_back: AtomicU64,
}

impl<G: Store, B: Board, C: Clock> Regional<G, B, C> {
    /// Shares of the limits on `global`, posted on `board` as `participant`, which must be
    /// unique among the processes sharing the global store (and stable only for a process's
    /// life: a region name and a random number).
    pub fn new(global: G, board: B, clock: C, participant: &str, options: Options) -> Self {
        Self {
            global,
            board,
            clock,
            participant: participant.into(),
            options,
            books: Mutex::new(Books::default()),
            charges: AtomicU64::new(0),
            fetched: AtomicU64::new(0),
            given_back: AtomicU64::new(0),
        }
    }

    /// The global store.
    pub fn global(&self) -> &G {
        &self.global
    }

    /// The options.
    pub fn options(&self) -> &Options {
        &self.options
    }

    /// Tokens charged on the global store for reservoirs and requests, and tokens given back
    /// to it, since the start: by rounds and by requests alike.
    pub fn totals(&self) -> (u64, u64) {
        (
            self.fetched.load(Ordering::Relaxed),
            self.given_back.load(Ordering::Relaxed),
        )
    }

    /// Reservoirs held, and the tokens in them.
    pub fn held(&self) -> (usize, u64) {
        let books = self.books.lock();
        let tokens = books.reservoirs.values().map(|r| r.tokens).sum();
        (books.reservoirs.len(), tokens)
    }

    /// A store that decides the takes `scope` says are global from the reservoirs, and the
    /// rest on `regional`, all or nothing.
    pub fn over<'a, S: Store>(
        &'a self,
        regional: &'a S,
        scope: &'a (dyn Fn(&str) -> bool + Send + Sync),
    ) -> Over<'a, S, G, B, C> {
        Over {
            shares: self,
            regional,
            scope,
        }
    }

    /// The span wants and supplies are counted over.
    fn span(&self) -> Duration {
        self.options.interval.saturating_mul(2)
    }

    fn next_id(&self) -> Box<str> {
        let n = self.charges.fetch_add(1, Ordering::Relaxed);
        format!("share-{}-{n}", self.participant).into()
    }

    /// Charges up to `amount` of `key` on the global store, and at least `least` when `amount`
    /// is not there: what was charged, and until when the bucket is empty when nothing was.
    async fn charge(
        &self,
        key: &str,
        limit: &Limit,
        amount: u64,
        least: u64,
    ) -> Result<(u64, Option<Charge>, Option<Duration>), Error> {
        let mut ask = amount.min(limit.capacity());
        let mut retry = None;
        for _ in 0..2 {
            let id = self.next_id();
            let takes = [Take::new(key, limit, ask)];
            let request = CheckRequest {
                takes: &takes,
                request_id: Some(&id),
                now: None,
            };
            let decisions = self.global.check(request).await?;
            let Some(decision) = decisions.first() else {
                return Err(Error::StoreUnavailable {
                    reason: Unavailable::Protocol,
                });
            };
            if decision.allowed() {
                self.fetched.fetch_add(ask, Ordering::Relaxed);
                let charge = Charge {
                    id,
                    limit: *limit,
                    cost: ask,
                };
                return Ok((ask, Some(charge), None));
            }
            // The bucket refills linearly: `least` tokens are there sooner than `ask` by
            // the time the difference takes to refill.
            let rate = limit.refill();
            let sooner = u128::from(ask.saturating_sub(least.max(1))) * rate.period().as_nanos()
                / u128::from(rate.amount().max(1));
            let sooner = Duration::from_nanos(u64::try_from(sooner).unwrap_or(u64::MAX));
            retry = decision
                .retry_after()
                .map(|wait| wait.saturating_sub(sooner));
            let there = decision.remaining();
            if there < least.max(1) || there >= ask {
                break;
            }
            ask = there;
        }
        Ok((0, None, retry))
    }

    /// Gives back `tokens` (taken out of a reservoir already) under `charges`, newest first,
    /// each settled once for as much of it as is left to give: the global store restores no
    /// more than each charge took. Charges settled, or that the store no longer knows (past
    /// its idempotency window), are removed; those left are still unsettled. Returns what was
    /// given back: the caller keeps the rest.
    async fn give_back(
        &self,
        key: &str,
        charges: &mut Vec<Charge>,
        tokens: u64,
    ) -> Result<u64, Error> {
        let mut given = 0;
        while given < tokens {
            let Some(charge) = charges.pop() else {
                break;
            };
            let refund = (tokens - given).min(charge.cost);
            let takes = [Take::new(key, &charge.limit, charge.cost)];
            let request = CheckRequest {
                takes: &takes,
                request_id: Some(&charge.id),
                now: None,
            };
            match self.global.settle(request, &[refund]).await {
                Ok(settled) if settled.status == SettleStatus::Settled => {
                    self.given_back.fetch_add(refund, Ordering::Relaxed);
                    given += refund;
                }
                Ok(_) => {}
                Err(err) => {
                    charges.push(charge);
                    if given == 0 {
                        return Err(err);
                    }
                    break;
                }
            }
        }
        Ok(given)
    }

    /// Fetches a first reservoir for `take`'s key, unless another request did meanwhile.
    /// Beyond [`Options::max_keys`] nothing is kept: the tokens fetched are returned, for the
    /// caller to spend and give back itself.
    async fn first(&self, take: &Take<'_>) -> Result<Option<Transient>, Error> {
        let now = self.clock.now();
        let span = self.span();
        let want = share::want(take.cost, self.options.interval, span);
        let keep = self.books.lock().reservoirs.len() < self.options.max_keys;
        let extra = if keep {
            share::level(take.limit, span, want, &[])
        } else {
            0
        };
        let (tokens, charge, retry) = self
            .charge(
                take.key,
                take.limit,
                take.cost.saturating_add(extra),
                take.cost,
            )
            .await?;
        let empty_until = now + retry.unwrap_or(Duration::ZERO);
        if !keep {
            return Ok(Some(Transient {
                tokens,
                charge,
                empty_until,
            }));
        }
        let mut books = self.books.lock();
        let reservoir = books
            .reservoirs
            .entry(take.key.into())
            .or_insert_with(|| Reservoir {
                limit: *take.limit,
                tokens: 0,
                spent: 0,
                refused: 0,
                last_used: now,
                last_round: now,
                charges: VecDeque::new(),
                empty_until,
                unavailable: None,
                level: extra,
                ran_short: false,
            });
        reservoir.add(tokens, charge);
        Ok(None)
    }

    /// Fetches, for a request its reservoir is `short` for, what it lacks and the reservoir's
    /// `level` besides (at least what it lacks, or nothing), and doubles the level until the
    /// next round: a reservoir that runs short within a round is sized below its demand, and
    /// each shortfall costs a request a round trip to the global store. A global store that
    /// cannot answer marks the reservoir, so the request follows its limit's failure mode.
    async fn more(&self, take: &Take<'_>, short: u64, level: u64, now: Timestamp) {
        let result = self
            .charge(take.key, take.limit, short.saturating_add(level), short)
            .await;
        let mut books = self.books.lock();
        let Some(r) = books.reservoirs.get_mut(take.key) else {
            return;
        };
        match result {
            Ok((tokens, charge, retry)) => {
                r.add(tokens, charge);
                r.ran_short = true;
                r.level = r
                    .level
                    .saturating_mul(2)
                    .max(short)
                    .min(take.limit.capacity());
                r.empty_until = now + retry.unwrap_or(Duration::ZERO);
            }
            Err(err) => r.unavailable = unavailable(&err).or(r.unavailable),
        }
    }

    /// Tops up, trims or forgets every reservoir once: what a process runs every
    /// [`Options::interval`]. Calls go out [`Options::in_flight`] at a time.
    pub async fn rebalance(&self) -> Round {
        let now = self.clock.now();
        let keys: Vec<Box<str>> = self.books.lock().reservoirs.keys().cloned().collect();
        let mut round = Round {
            keys: keys.len(),
            ..Round::default()
        };
        let steps: Vec<Step> = futures_util::stream::iter(keys)
            .map(|key| async move { self.rebalance_key(&key, now).await })
            .buffer_unordered(self.options.in_flight.max(1))
            .collect()
            .await;
        for step in steps {
            round.fetched += step.fetched;
            round.given_back += step.given_back;
            round.abandoned += usize::from(step.abandoned);
            round.failed += step.failed;
        }
        round
    }

    async fn rebalance_key(&self, key: &str, now: Timestamp) -> Step {
        let mut step = Step::default();
        // Read and reset the demand, or take a quiet reservoir out whole.
        let read = {
            let mut books = self.books.lock();
            match books.reservoirs.get_mut(key) {
                None => return step,
                Some(r)
                    if now.saturating_duration_since(r.last_used) >= self.options.abandon_after =>
                {
                    Err(books.reservoirs.remove(key))
                }
                Some(r) => {
                    let demand = r.spent.saturating_add(r.refused);
                    r.spent = 0;
                    r.refused = 0;
                    let elapsed = now.saturating_duration_since(r.last_round);
                    r.last_round = now;
                    // A reservoir that ran short since the last round grew its level to keep
                    // up; what it spent meanwhile was held back by the waits, so it is no
                    // measure of what it needs. Otherwise the level falls by half a round at
                    // most, so a key quiet for a moment does not start from nothing.
                    let kept = if std::mem::take(&mut r.ran_short) {
                        r.level
                    } else {
                        r.level / 2
                    };
                    Ok((r.limit, demand, elapsed, kept))
                }
            }
        };
        let (limit, demand, elapsed, kept) = match read {
            Ok(read) => read,
            Err(quiet) => {
                step.abandoned = true;
                if self
                    .board
                    .post(key, &self.participant, 0, self.span())
                    .await
                    .is_err()
                {
                    step.failed += 1;
                }
                if let Some(r) = quiet {
                    let mut charges = Vec::from(r.charges);
                    match self.give_back(key, &mut charges, r.tokens).await {
                        Ok(tokens) => step.given_back = tokens,
                        Err(_) => step.failed += 1,
                    }
                }
                return step;
            }
        };
        let span = self.span();
        let want = share::want(demand, elapsed, span).max(kept);
        let ttl = self.options.interval.saturating_mul(3);
        let others = match self.board.post(key, &self.participant, want, ttl).await {
            Ok(others) => others,
            Err(err) => {
                step.failed += 1;
                self.mark(key, unavailable(&err));
                return step;
            }
        };
        let level = share::level(&limit, span, want, &others);
        if let Some(r) = self.books.lock().reservoirs.get_mut(key) {
            r.level = level;
        }

        let (tokens, empty_until) = {
            let books = self.books.lock();
            let Some(r) = books.reservoirs.get(key) else {
                return step;
            };
            (r.tokens, r.empty_until)
        };
        if tokens < level && now >= empty_until {
            match self.charge(key, &limit, level - tokens, 1).await {
                Ok((fetched, charge, retry)) => {
                    step.fetched = fetched;
                    let mut books = self.books.lock();
                    if let Some(r) = books.reservoirs.get_mut(key) {
                        r.add(fetched, charge);
                        r.unavailable = None;
                        r.empty_until = now + retry.unwrap_or(Duration::ZERO);
                    }
                }
                Err(err) => {
                    step.failed += 1;
                    self.mark(key, unavailable(&err));
                }
            }
        } else if tokens > level.saturating_add(level / 4).saturating_add(1) {
            // Others need what this process holds beyond its share (or it wants less): give
            // the excess back, out of the reservoir first so nothing spends it meanwhile. Only
            // whole charges, newest first: one settled in part could never give back its rest,
            // which the reservoir may still have to return when it goes quiet.
            let (mut charges, excess) = {
                let mut books = self.books.lock();
                let Some(r) = books.reservoirs.get_mut(key) else {
                    return step;
                };
                let mut excess = 0u64;
                let mut charges = Vec::new();
                let over = r.tokens.saturating_sub(level);
                while let Some(charge) = r.charges.back() {
                    if excess + charge.cost > over {
                        break;
                    }
                    excess += charge.cost;
                    charges.extend(r.charges.pop_back());
                }
                charges.reverse();
                r.tokens -= excess;
                (charges, excess)
            };
            let back = match self.give_back(key, &mut charges, excess).await {
                Ok(back) => back,
                Err(_) => {
                    step.failed += 1;
                    0
                }
            };
            step.given_back = back;
            let mut books = self.books.lock();
            if let Some(r) = books.reservoirs.get_mut(key) {
                r.tokens = r.tokens.saturating_add(excess - back);
                // Charges not settled (the store failed) can still give back later.
                for charge in charges {
                    r.charges.push_back(charge);
                }
            }
        } else {
            let mut books = self.books.lock();
            if let Some(r) = books.reservoirs.get_mut(key) {
                r.unavailable = None;
            }
        }
        step
    }

    fn mark(&self, key: &str, reason: Option<Unavailable>) {
        if let Some(r) = self.books.lock().reservoirs.get_mut(key) {
            r.unavailable = reason.or(r.unavailable);
        }
    }

    /// Gives back, at shutdown, everything every reservoir holds, and takes this process off
    /// the board. Requests decided meanwhile find empty reservoirs.
    pub async fn give_back_all(&self) -> u64 {
        let drained: Vec<(Box<str>, Reservoir)> = self.books.lock().reservoirs.drain().collect();
        let span = self.span();
        futures_util::stream::iter(drained)
            .map(|(key, r)| async move {
                let _ = self.board.post(&key, &self.participant, 0, span).await;
                let mut charges = Vec::from(r.charges);
                self.give_back(&key, &mut charges, r.tokens)
                    .await
                    .unwrap_or(0)
            })
            .buffer_unordered(self.options.in_flight.max(1))
            .fold(0u64, |sum, back| async move { sum.saturating_add(back) })
            .await
    }

    /// The next round of `r`, from `now`.
    fn until_round(&self, r: &Reservoir, now: Timestamp) -> Duration {
        (r.last_round + self.options.interval).saturating_duration_since(now)
    }
}

/// What one key's round did.
#[derive(Default)]
struct Step {
    fetched: u64,
    given_back: u64,
    abandoned: bool,
    failed: usize,
}

/// What a global take needs before it can be decided.
enum Need {
    First,
    More { short: u64, level: u64 },
    Nothing,
}

/// Tokens fetched for one request beyond the bound on reservoirs.
struct Transient {
    tokens: u64,
    charge: Option<Charge>,
    empty_until: Timestamp,
}

fn unavailable(err: &Error) -> Option<Unavailable> {
    match err {
        Error::StoreUnavailable { reason } => Some(*reason),
        _ => None,
    }
}

/// [`Regional::over`]: the process's shares and the regional store, deciding as one store.
///
/// All or nothing: a request's global takes are taken from their reservoirs first, under one
/// lock, and put back if a regional take rejects or the regional store fails. A key seen for
/// the first time, or a reservoir too short for a take while the global bucket may have
/// tokens, is fetched for from the global store before the request is decided (the only
/// waits on it). A take still short is rejected, with the wait until the next round or until
/// the global bucket has tokens again; when the global store cannot be reached, the take is
/// unavailable instead, so the limit's failure mode applies.
pub struct Over<'a, S, G, B, C> {
    shares: &'a Regional<G, B, C>,
    regional: &'a S,
    scope: &'a (dyn Fn(&str) -> bool + Send + Sync),
}

impl<S: Store, G: Store, B: Board, C: Clock> Over<'_, S, G, B, C> {
    fn split<'t>(&self, takes: &'t [Take<'t>]) -> (Vec<usize>, Vec<Take<'t>>, Vec<usize>) {
        let mut global = Vec::new();
        let mut regional = Vec::new();
        let mut at = Vec::new();
        for (i, take) in takes.iter().enumerate() {
            if (self.scope)(take.key) {
                global.push(i);
            } else {
                regional.push(*take);
                at.push(i);
            }
        }
        (global, regional, at)
    }

    async fn decide(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
        let takes = request.takes;
        let (global, regional, regional_at) = self.split(takes);
        if global.is_empty() {
            return self.regional.check(request).await;
        }
        for &i in &global {
            let take = &takes[i];
            if take.cost == 0 || take.cost > take.limit.capacity() {
                return Err(Error::InvalidCost {
                    cost: take.cost,
                    capacity: take.limit.capacity(),
                });
            }
        }
        let shares = self.shares;
        // What the request asks, fingerprinted only for a request id to be recorded under.
        let content = request
            .request_id
            .map(|_| recent::content(takes.iter().map(|t| (t.key, t.cost))));
        if let (Some(id), Some(content)) = (request.request_id, content) {
            check_request_id(id)?;
            let now = shares.clock.now();
            if let Some(record) = shares.books.lock().recent.get(id, content, now)? {
                return Ok(record.decisions.clone());
            }
        }

        // A key seen for the first time, or a reservoir a burst has emptied while the global
        // bucket may have tokens, is fetched for at once: the only cases where a request waits
        // on the global store.
        let mut transients: Vec<(usize, Transient)> = Vec::new();
        let now = shares.clock.now();
        for &i in &global {
            let take = &takes[i];
            let need = {
                let mut books = shares.books.lock();
                match books.reservoirs.get_mut(take.key) {
                    None => Need::First,
                    Some(r)
                        if r.tokens < take.cost
                            && r.unavailable.is_none()
                            && now >= r.empty_until =>
                    {
                        // In use from now: a round must not abandon it while the fetch is on
                        // its way, or what the fetch brings would have nowhere to go.
                        r.last_used = now;
                        Need::More {
                            short: take.cost - r.tokens,
                            level: r.level,
                        }
                    }
                    Some(_) => Need::Nothing,
                }
            };
            match need {
                Need::First => {
                    if let Some(transient) = shares.first(take).await? {
                        transients.push((i, transient));
                    }
                }
                Need::More { short, level } => shares.more(take, short, level, now).await,
                Need::Nothing => {}
            }
        }

        // Take from the reservoirs, all or nothing.
        let now = shares.clock.now();
        let mut decisions: Vec<Option<Decision>> = vec![None; takes.len()];
        let (short, down) = {
            let mut books = shares.books.lock();
            let mut short = false;
            let mut down = None;
            for &i in &global {
                let take = &takes[i];
                if let Some((_, t)) = transients.iter().find(|(at, _)| *at == i) {
                    let ok = t.tokens >= take.cost;
                    short |= !ok;
                    let wait = t.empty_until.saturating_duration_since(now);
                    decisions[i] = Some(figures(ok, take, t.tokens, wait));
                    continue;
                }
                let Some(r) = books.reservoirs.get_mut(take.key) else {
                    short = true;
                    decisions[i] = Some(figures(false, take, 0, shares.options.interval));
                    continue;
                };
                r.last_used = now;
                let ok = r.tokens >= take.cost;
                if !ok {
                    short = true;
                    r.refused = r.refused.saturating_add(take.cost);
                    down = down.or(r.unavailable);
                }
                let wait = shares
                    .until_round(r, now)
                    .max(r.empty_until.saturating_duration_since(now));
                decisions[i] = Some(figures(ok, take, r.tokens, wait));
            }
            if down.is_none() && !short {
                for &i in &global {
                    let take = &takes[i];
                    if let Some(r) = books.reservoirs.get_mut(take.key) {
                        r.tokens -= take.cost;
                        r.spent = r.spent.saturating_add(take.cost);
                        let wait = shares.until_round(r, now);
                        decisions[i] = Some(figures(true, take, r.tokens, wait));
                    }
                }
                for (i, t) in &mut transients {
                    t.tokens -= takes[*i].cost;
                }
            }
            (short, down)
        };
        if let Some(reason) = down {
            // Nothing was taken: the request is undecided, and each limit's failure mode
            // applies, as for a regional store that is down.
            shares.settle_transients(takes, transients).await;
            return Err(Error::StoreUnavailable { reason });
        }

        let regional_decisions = if regional.is_empty() {
            Vec::new()
        } else {
            let inner = CheckRequest {
                takes: &regional,
                request_id: request.request_id,
                now: request.now,
            };
            let result = if short {
                self.regional.peek(inner).await
            } else {
                self.regional.check(inner).await
            };
            match result {
                Ok(d) => d,
                Err(err) => {
                    if !short {
                        shares.put_back(takes, &global, &mut transients);
                    }
                    shares.settle_transients(takes, transients).await;
                    return Err(err);
                }
            }
        };
        let regional_ok = regional_decisions.iter().all(Decision::allowed);
        if !short && !regional_ok {
            shares.put_back(takes, &global, &mut transients);
            for &i in &global {
                if let Some(d) = &mut decisions[i] {
                    // Allowed but not charged: what it would have taken is back.
                    *d = figures(
                        true,
                        &takes[i],
                        d.remaining() + takes[i].cost,
                        Duration::ZERO,
                    );
                }
            }
        }
        for (at, d) in regional_at.into_iter().zip(regional_decisions) {
            decisions[at] = Some(d);
        }
        shares.settle_transients(takes, transients).await;
        let decisions: Vec<Decision> = decisions.into_iter().flatten().collect();
        if decisions.len() != takes.len() {
            return Err(Error::StoreUnavailable {
                reason: Unavailable::Protocol,
            });
        }
        if let (Some(id), Some(content)) = (request.request_id, content)
            && !short
            && regional_ok
        {
            let now = shares.clock.now();
            shares
                .books
                .lock()
                .recent
                .insert(id, content, decisions.clone(), now);
        }
        Ok(decisions)
    }
}

impl<G: Store, B: Board, C: Clock> Regional<G, B, C> {
    /// Returns the global takes' tokens to their reservoirs (a regional take rejected).
    fn put_back(
        &self,
        takes: &[Take<'_>],
        global: &[usize],
        transients: &mut [(usize, Transient)],
    ) {
        let mut books = self.books.lock();
        for &i in global {
            let take = &takes[i];
            if let Some((_, t)) = transients.iter_mut().find(|(at, _)| *at == i) {
                t.tokens += take.cost;
                continue;
            }
            if let Some(r) = books.reservoirs.get_mut(take.key) {
                r.tokens = r.tokens.saturating_add(take.cost);
                r.spent = r.spent.saturating_sub(take.cost);
            }
        }
    }

    /// Gives back what requests beyond the bound on reservoirs fetched and did not spend.
    async fn settle_transients(&self, takes: &[Take<'_>], transients: Vec<(usize, Transient)>) {
        for (i, t) in transients {
            if let Some(charge) = t.charge
                && t.tokens > 0
            {
                // A failure leaves the tokens charged: under-admission, never more.
                let _ = self
                    .give_back(takes[i].key, &mut vec![charge], t.tokens)
                    .await;
            }
        }
    }
}

/// A global take's decision, from its reservoir's figures: `remaining` tokens held, and when
/// more may come (the next round, or when the global bucket has some again).
fn figures(allowed: bool, take: &Take<'_>, remaining: u64, wait: Duration) -> Decision {
    let retry = if allowed {
        Duration::ZERO
    } else {
        wait.max(Duration::from_millis(1))
    };
    Decision::from_window(allowed, *take.limit, take.cost, remaining, retry, wait)
}

impl<S: Store, G: Store, B: Board, C: Clock> Store for Over<'_, S, G, B, C> {
    async fn check(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
        self.decide(request).await
    }

    /// Resets regional buckets on the regional store. A global bucket is refused: its tokens
    /// are held in every region's reservoir, which a reset here could not take back.
    async fn reset(&self, keys: &[&str]) -> Result<(), Error> {
        if keys.iter().any(|key| (self.scope)(key)) {
            return Err(Error::Unsupported {
                operation: "reset a global limit",
            });
        }
        self.regional.reset(keys).await
    }

    async fn peek(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
        let takes = request.takes;
        let (global, regional, regional_at) = self.split(takes);
        if global.is_empty() {
            return self.regional.peek(request).await;
        }
        let now = self.shares.clock.now();
        let mut decisions: Vec<Option<Decision>> = vec![None; takes.len()];
        let mut unknown = Vec::new();
        {
            let books = self.shares.books.lock();
            for &i in &global {
                let take = &takes[i];
                match books.reservoirs.get(take.key) {
                    Some(r) => {
                        let wait = self.shares.until_round(r, now);
                        decisions[i] = Some(figures(r.tokens >= take.cost, take, r.tokens, wait));
                    }
                    None => unknown.push(i),
                }
            }
        }
        if !unknown.is_empty() {
            // No reservoir yet: the global bucket is what a first request would draw on.
            let asked: Vec<Take<'_>> = unknown.iter().map(|&i| takes[i]).collect();
            let peeked = self
                .shares
                .global
                .peek(CheckRequest {
                    takes: &asked,
                    request_id: None,
                    now: None,
                })
                .await?;
            for (i, d) in unknown.into_iter().zip(peeked) {
                decisions[i] = Some(d);
            }
        }
        if !regional.is_empty() {
            let peeked = self
                .regional
                .peek(CheckRequest {
                    takes: &regional,
                    request_id: None,
                    now: request.now,
                })
                .await?;
            for (at, d) in regional_at.into_iter().zip(peeked) {
                decisions[at] = Some(d);
            }
        }
        let decisions: Vec<Decision> = decisions.into_iter().flatten().collect();
        if decisions.len() != takes.len() {
            return Err(Error::StoreUnavailable {
                reason: Unavailable::Protocol,
            });
        }
        Ok(decisions)
    }

    async fn settle(
        &self,
        request: CheckRequest<'_>,
        refunds: &[u64],
    ) -> Result<Settlement, Error> {
        let takes = request.takes;
        let (global, regional, regional_at) = self.split(takes);
        if global.is_empty() {
            return self.regional.settle(request, refunds).await;
        }
        check_refunds(takes, refunds)?;
        let Some(id) = request.request_id else {
            return Err(Error::InvalidSettlement {
                reason: "it needs the request_id the check was made with",
            });
        };
        check_request_id(id)?;
        let shares = self.shares;
        let content = recent::content(takes.iter().map(|t| (t.key, t.cost)));
        let now = shares.clock.now();
        let mut decisions: Vec<Option<Decision>> = vec![None; takes.len()];
        let status = {
            let mut books = shares.books.lock();
            let Books { reservoirs, recent } = &mut *books;
            let status = match recent.get(id, content, now)? {
                None => SettleStatus::NotFound,
                Some(record) => match &record.settled {
                    Some(given) if given.as_slice() == refunds => SettleStatus::Repeated,
                    Some(_) => return Err(Error::IdempotencyConflict),
                    None => {
                        record.settled = Some(refunds.to_vec());
                        for &i in &global {
                            if let Some(r) = reservoirs.get_mut(takes[i].key) {
                                r.tokens = r.tokens.saturating_add(refunds[i]);
                                r.spent = r.spent.saturating_sub(refunds[i]);
                            }
                        }
                        SettleStatus::Settled
                    }
                },
            };
            for &i in &global {
                let tokens = reservoirs.get(takes[i].key).map_or(0, |r| r.tokens);
                decisions[i] = Some(figures(true, &takes[i], tokens, Duration::ZERO));
            }
            status
        };
        let mut status = status;
        if !regional.is_empty() {
            let regional_refunds: Vec<u64> = regional_at.iter().map(|&i| refunds[i]).collect();
            let settled = self
                .regional
                .settle(
                    CheckRequest {
                        takes: &regional,
                        request_id: Some(id),
                        now: request.now,
                    },
                    &regional_refunds,
                )
                .await?;
            if status == SettleStatus::NotFound {
                status = settled.status;
            }
            for (at, d) in regional_at.into_iter().zip(settled.decisions) {
                decisions[at] = Some(d);
            }
        }
        Ok(Settlement {
            status,
            decisions: decisions.into_iter().flatten().collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use tollgate::{LocalStore, ManualClock, block_on_ready};

    use super::*;
    use crate::MemoryBoard;

    type Local = Regional<Flaky, MemoryBoard<ManualClock>, ManualClock>;

    /// An in-memory global store that can be cut off.
    struct Flaky {
        store: LocalStore<ManualClock>,
        down: std::sync::atomic::AtomicBool,
    }

    impl Flaky {
        fn reach(&self) -> Result<(), Error> {
            if self.down.load(Ordering::Relaxed) {
                return Err(Error::StoreUnavailable {
                    reason: Unavailable::Connection,
                });
            }
            Ok(())
        }
    }

    impl Store for Flaky {
        async fn check(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
            self.reach()?;
            self.store.check(request).await
        }

        async fn peek(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
            self.reach()?;
            self.store.peek(request).await
        }

        async fn settle(
            &self,
            request: CheckRequest<'_>,
            refunds: &[u64],
        ) -> Result<Settlement, Error> {
            self.reach()?;
            self.store.settle(request, refunds).await
        }
    }

    /// One process, alone on an in-memory global store.
    fn alone() -> Local {
        let clock = ManualClock::new();
        clock.advance(Duration::from_secs(10));
        let global = Flaky {
            store: LocalStore::new(clock.clone()),
            down: false.into(),
        };
        let board = MemoryBoard::new(clock.clone());
        Regional::new(global, board, clock, "eu", Options::default())
    }

    /// 10,000 tokens, a token a millisecond.
    fn limit() -> Limit {
        Limit::new(10_000, "1000/s".parse().unwrap()).unwrap()
    }

    /// Puts in a reservoir of `key` holding `tokens`, bought by charges of `costs` (oldest
    /// first) made on the global store, sized to `level` by a round that found it short, so
    /// the next round keeps that level.
    fn holding(shares: &Local, key: &str, costs: &[u64], tokens: u64, level: u64) {
        let limit = limit();
        let now = shares.clock.now();
        let mut charges = VecDeque::new();
        for &cost in costs {
            let id = shares.next_id();
            let takes = [Take::new(key, &limit, cost)];
            let request = CheckRequest {
                takes: &takes,
                request_id: Some(&id),
                now: None,
            };
            assert!(block_on_ready(shares.global.check(request)).unwrap()[0].allowed());
            charges.push_back(Charge { id, limit, cost });
        }
        let reservoir = Reservoir {
            limit,
            tokens,
            spent: 0,
            refused: 0,
            last_used: now,
            last_round: now,
            charges,
            empty_until: now,
            unavailable: None,
            level,
            ran_short: true,
        };
        shares.books.lock().reservoirs.insert(key.into(), reservoir);
    }

    fn round(shares: &Local, key: &str) -> (u64, Step) {
        shares.clock.advance(Duration::from_secs(1));
        let step = block_on_ready(shares.rebalance_key(key, shares.clock.now()));
        (shares.books.lock().reservoirs[key].tokens, step)
    }

    #[test]
    fn a_round_tops_up_to_the_level_and_no_further() {
        let shares = alone();
        holding(&shares, "short", &[10], 10, 100);
        let (held, step) = round(&shares, "short");
        assert_eq!((held, step.fetched, step.failed), (100, 90, 0));
        // At the level already: nothing to fetch, and no empty fetch tried.
        holding(&shares, "full", &[100], 100, 100);
        let (held, step) = round(&shares, "full");
        assert_eq!((held, step.fetched, step.failed), (100, 0, 0));
    }

    /// Above the level by a quarter and a token at most, a reservoir keeps what it holds;
    /// past that, it gives back whole charges, newest first, while they fit in the excess.
    #[test]
    fn a_round_trims_whole_charges_past_a_quarter_over_the_level() {
        let shares = alone();
        holding(&shares, "within", &[100, 26], 126, 100);
        let (held, step) = round(&shares, "within");
        assert_eq!((held, step.given_back), (126, 0));
        holding(&shares, "past", &[100, 27], 127, 100);
        let (held, step) = round(&shares, "past");
        assert_eq!((held, step.given_back), (100, 27));
        // A trim the global store cannot take keeps the tokens and the charges, for later.
        holding(&shares, "cut", &[100, 27], 127, 100);
        shares.global.down.store(true, Ordering::Relaxed);
        let (held, step) = round(&shares, "cut");
        assert_eq!((held, step.given_back, step.failed), (127, 0, 1));
        assert_eq!(shares.books.lock().reservoirs["cut"].charges.len(), 2);
    }

    /// A top-up that finds the global bucket empty waits, before asking again, until the
    /// token the reservoir lacks is there.
    #[test]
    fn a_top_up_that_finds_the_global_bucket_empty_waits_for_a_token() {
        let shares = alone();
        holding(&shares, "k", &[10], 10, 100);
        let limit = limit();
        let rest = [Take::new("k", &limit, 10_000 - 10)];
        let request = CheckRequest {
            takes: &rest,
            request_id: None,
            now: None,
        };
        assert!(block_on_ready(shares.global.check(request)).unwrap()[0].allowed());
        // A second passes in `round`: 1,000 tokens refilled, taken back at once.
        let refill = [Take::new("k", &limit, 1_000)];
        let request = CheckRequest {
            takes: &refill,
            request_id: None,
            now: Some(shares.clock.now() + Duration::from_secs(1)),
        };
        assert!(block_on_ready(shares.global.check(request)).unwrap()[0].allowed());
        let (held, step) = round(&shares, "k");
        assert_eq!((held, step.fetched), (10, 0));
        let now = shares.clock.now();
        let empty_until = shares.books.lock().reservoirs["k"].empty_until;
        assert_eq!(empty_until, now + Duration::from_millis(1));
    }

    /// A reservoir keeps its newest charges, as many as it may, to give tokens back under.
    #[test]
    fn a_reservoir_keeps_its_newest_charges() {
        let limit = Limit::new(100, "10/s".parse().unwrap()).unwrap();
        let mut reservoir = Reservoir {
            limit,
            tokens: 0,
            spent: 0,
            refused: 0,
            last_used: Timestamp::ZERO,
            last_round: Timestamp::ZERO,
            charges: VecDeque::new(),
            empty_until: Timestamp::ZERO,
            unavailable: None,
            level: 0,
            ran_short: false,
        };
        for n in 0..=KEPT_CHARGES {
            let id = format!("c{n}").into();
            reservoir.add(2, Some(Charge { id, limit, cost: 2 }));
        }
        reservoir.add(1, None);
        assert_eq!(reservoir.tokens, 2 * KEPT_CHARGES as u64 + 3);
        let ids: Vec<&str> = reservoir.charges.iter().map(|c| &*c.id).collect();
        let newest: Vec<String> = (1..=KEPT_CHARGES).map(|n| format!("c{n}")).collect();
        assert_eq!(ids, newest);
    }
}
