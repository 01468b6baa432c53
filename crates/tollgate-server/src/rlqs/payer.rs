//! Paying for assignments: sizing each by demand and fair shares, charging the shared buckets
//! before it is sent, and giving back what a replaced one can no longer spend.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Semaphore;
use tollgate::{Limit, Timestamp};
use tollgate_policy::Outcome;

use super::assignment::{self, Assignment};
use super::message::Entries;
use crate::decider::{DecideError, Decider, Request as Decide};
use crate::metrics::{self, Api};

/// Store calls (charges and give-backs) the RLQS streams of one process have in flight at
/// most. Envoys may report thousands of buckets each at once; sent all together on Redis,
/// their calls queue past the store timeout, which opens the breaker for every decision of
/// the process, RLS and HTTP ones included. In waves of this many, a call waits for a permit
/// rather than for Redis, and the store batches them into few round trips.
pub(super) const IN_FLIGHT: usize = 64;

/// What each stream's Envoy wants of each bucket (tokens a fill), so that shares are fair
/// across the streams of this process, and, on a shared store, what the other processes
/// serving the bucket want (the `board` module posts and reads those). Streams remove their
/// own entries as they end.
#[derive(Default)]
pub(super) struct Demands {
    /// Per domain and bucket. Nested so that a report on a known bucket finds it by
    /// reference, without copying its entries.
    wants: Mutex<HashMap<Arc<str>, HashMap<Entries, Wants>>>,
}

/// One bucket's wants, in tokens a fill.
#[derive(Default)]
struct Wants {
    /// Stream → want.
    streams: HashMap<u64, u64>,
    /// Each other process's want (its Envoys' together), as the board last said.
    elsewhere: Vec<u64>,
}

impl Wants {
    /// What this process's Envoys want together.
    fn here(&self) -> u64 {
        self.streams
            .values()
            .fold(0, |sum, &want| sum.saturating_add(want))
    }
}

impl Demands {
    /// Records `want` for `stream` and returns its fair share of `supply`: this process's
    /// max-min fair share of it among the processes on the board, split max-min fairly
    /// among its streams. With no other process, the process's share is what its streams
    /// want (at most the supply), and the split is a max-min fair share of the supply.
    fn share(
        &self,
        domain: &Arc<str>,
        entries: &Entries,
        stream: u64,
        want: u64,
        supply: u64,
    ) -> u64 {
        let mut wants = self.wants.lock();
        if !wants.contains_key(&**domain) {
            wants.insert(Arc::clone(domain), HashMap::new());
        }
        let Some(of_domain) = wants.get_mut(&**domain) else {
            return 1;
        };
        if !of_domain.contains_key(entries) {
            of_domain.insert(entries.clone(), Wants::default());
        }
        let Some(of_bucket) = of_domain.get_mut(entries) else {
            return 1;
        };
        of_bucket.streams.insert(stream, want);
        let ours = assignment::fair_share(
            supply,
            of_bucket.here(),
            of_bucket.elsewhere.iter().copied(),
        );
        let others = of_bucket
            .streams
            .iter()
            .filter(|&(&other, _)| other != stream)
            .map(|(_, &want)| want);
        assignment::fair_share(ours, want, others)
    }

    /// Drops `stream`'s want of a bucket (it ended, or the bucket went quiet).
    pub(super) fn forget(&self, domain: &Arc<str>, entries: &Entries, stream: u64) {
        let mut wants = self.wants.lock();
        let Some(of_domain) = wants.get_mut(&**domain) else {
            return;
        };
        if let Some(of_bucket) = of_domain.get_mut(entries) {
            of_bucket.streams.remove(&stream);
            if of_bucket.streams.is_empty() {
                of_domain.remove(entries);
            }
        }
        if of_domain.is_empty() {
            wants.remove(&**domain);
        }
    }

    /// Every bucket some stream of this process wants, with what its streams want together.
    pub(super) fn totals(&self) -> Vec<(Arc<str>, Entries, u64)> {
        let wants = self.wants.lock();
        wants
            .iter()
            .flat_map(|(domain, of_domain)| {
                of_domain.iter().map(|(entries, of_bucket)| {
                    (Arc::clone(domain), entries.clone(), of_bucket.here())
                })
            })
            .collect()
    }

    /// Records what the other processes serving a bucket want, as the board said.
    pub(super) fn set_elsewhere(&self, domain: &Arc<str>, entries: &Entries, elsewhere: Vec<u64>) {
        let mut wants = self.wants.lock();
        if let Some(of_bucket) = wants
            .get_mut(&**domain)
            .and_then(|of_domain| of_domain.get_mut(entries))
        {
            of_bucket.elsewhere = elsewhere;
        }
    }
}

/// A charge made for an assignment: its request id, and what it took.
struct Charge {
    id: String,
    cost: u64,
}

/// A token bucket an Envoy holds, and the last charge made for it.
pub(super) struct Held {
    assignment: Assignment,
    charge: Option<Charge>,
}

/// What pays a stream's assignments: the store, through the policy, and the shares. Shared
/// by the buckets of one report, which are paid at once.
pub(super) struct Payer {
    /// The stream's number in this process.
    pub(super) id: u64,
    /// This process's, so that request ids differ from every other process's on one store.
    pub(super) nonce: u64,
    /// Charges made, numbering their request ids.
    pub(super) charges: AtomicU64,
    pub(super) decider: Arc<Decider>,
    pub(super) demands: Arc<Demands>,
    /// Store calls all RLQS streams of this process may have in flight (see [`IN_FLIGHT`]).
    pub(super) in_flight: Arc<Semaphore>,
    /// The time-to-live of assignments tollgate renews itself (see [`Payer::assign`]).
    pub(super) short_ttl: Duration,
    /// A bucket no assignment can be paid for was logged once on this stream.
    pub(super) warned_small: AtomicBool,
}

/// What one report asks of one bucket.
pub(super) enum Answer {
    /// A token bucket.
    Tokens(Assignment),
    /// `ALLOW_ALL` for this long.
    Allow(Duration),
    /// `DENY_ALL` for this long.
    Deny(Duration),
    Abandon,
    /// Nothing (the stream is at its bound of buckets).
    None,
    /// Nothing new: the token bucket held stays as it is, paid for until it expires, since
    /// the bucket could not pay its extension just now. Tried again at the next report or
    /// renewal; replacing it by what the bucket holds at that moment would hand the refill
    /// to whichever Envoy asked last.
    Keep,
}

impl Answer {
    pub(super) fn label(&self) -> &'static str {
        match self {
            Answer::Tokens(_) => "tokens",
            Answer::Allow(_) => "allow_all",
            Answer::Deny(_) => "deny_all",
            Answer::Abandon => "abandon",
            Answer::None => "refused",
            Answer::Keep => "kept",
        }
    }
}

/// How a charge went.
enum Charged {
    /// Paid.
    Paid,
    /// No limit that can reject applies.
    Free,
    /// A limit fails closed while the store is down.
    Closed,
    /// Too few tokens: this many are left in the tightest enforced bucket.
    Short(u64),
}

/// One bucket's report, between [`Session::prepare`] and its payment.
pub(super) enum Step {
    /// Past the stream's bound of buckets: no answer.
    Refused,
    /// Quiet for too long: Envoy is told to forget it.
    Abandon { held: Option<Held>, now: Timestamp },
    /// An assignment to size and pay.
    Assign {
        held: Option<Held>,
        requests: u64,
        /// No report but the bucket's first on this stream has come yet.
        first: bool,
        interval: Duration,
        /// The time-to-live the Envoy's reporting interval calls for.
        ttl: Duration,
        now: Timestamp,
        /// Sent by tollgate between reports, to keep an assignment alive: the demand is the
        /// last report's, and the rate held is kept if the share still allows it.
        renewal: bool,
    },
}

impl Payer {
    /// Pays for what `step` asks (the state it holds is taken out of it), and returns the
    /// answer and what the Envoy holds after it.
    pub(super) async fn pay(
        &self,
        domain: &Arc<str>,
        entries: &Entries,
        step: &mut Step,
    ) -> (Answer, Option<Held>) {
        match std::mem::replace(step, Step::Refused) {
            Step::Refused => (Answer::None, None),
            Step::Abandon { held, now } => {
                // Envoy forgets the bucket: what it had paid ahead goes back.
                self.give_back(domain, entries, held, now, self.short_ttl / 4)
                    .await;
                (Answer::Abandon, None)
            }
            Step::Assign {
                held,
                requests,
                first,
                interval,
                ttl,
                now,
                renewal,
            } => {
                // A first report is sent as the bucket's first request arrives, and says
                // little about its demand: the Envoy starts with a full share, so that a
                // busy bucket is not denied until its next report. The next report sizes it.
                // A renewal learns nothing new of the demand: it asks for the rate held.
                let kept = match (&held, renewal) {
                    (Some(held), true) => u64::from(held.assignment.rate),
                    _ => 0,
                };
                let want = |fill, supply: u64| {
                    let want = assignment::wanted_rate(requests, interval, fill).max(kept);
                    if first { want.max(supply) } else { want }
                };
                self.assign(domain, entries, held, want, ttl, now).await
            }
        }
    }

    /// The answer for a bucket whose Envoy holds `held` and wants `want(fill, supply)`
    /// tokens a fill, paid for in the store, and what the Envoy holds after it.
    ///
    /// An assignment is paid for its whole time-to-live when sent, from buckets that hold at
    /// most their capacity: a rate `r` a fill `f` for a time-to-live `t` costs `r × (f + t)
    /// / f`, so no rate above `capacity × f / (f + t)` can be paid. The `ttl` of the Envoy's
    /// reporting interval (twice it) would cap a limit whose capacity is a few seconds of
    /// its refill well below its rate, and deny one of a minute's capacity altogether when
    /// Envoy reports every minute. Where it would cap the rate, the assignment gets the
    /// short time-to-live instead, and tollgate renews it itself between reports
    /// ([`super::RlqsOptions::renew_every`]); `DENY_ALL` has the short one too, so that a
    /// bucket refilled is assigned again without waiting for a slow report.
    async fn assign(
        &self,
        domain: &Arc<str>,
        entries: &Entries,
        held: Option<Held>,
        want: impl FnOnce(Duration, u64) -> u64,
        ttl: Duration,
        now: Timestamp,
    ) -> (Answer, Option<Held>) {
        // A message is taken to reach the Envoy within a quarter of the time-to-live.
        let margin = ttl / 4;
        let Some(limits) = self
            .decider
            .engine()
            .enforced_limits(domain, std::slice::from_ref(entries))
        else {
            // A deny (a block list entry): nothing to pay for, nothing to share.
            self.give_back(domain, entries, held, now, margin).await;
            return (Answer::Deny(ttl), None);
        };
        // None applies, or none can reject (shadow, exempt): nothing to pay for.
        let Some(capacity) = limits.iter().map(Limit::capacity).min() else {
            self.give_back(domain, entries, held, now, margin).await;
            return (Answer::Allow(ttl), None);
        };
        let refills = || {
            limits
                .iter()
                .map(|l| (l.refill().amount(), l.refill().period()))
        };
        let fill = assignment::fill_interval(refills());
        // What the limits refill in a fill interval: the most all Envoys can share.
        let supply = refills()
            .map(|(amount, period)| assignment::refill_per(fill, amount, period))
            .min()
            .unwrap_or(0);
        let want = want(fill, supply);
        let share = self.demands.share(domain, entries, self.id, want, supply);
        let share_rate = u32::try_from(share).unwrap_or(u32::MAX);
        let short_ttl = self.short_ttl.min(ttl);
        let most_short = assignment::largest_rate(capacity, fill, short_ttl);
        let most_long = assignment::largest_rate(capacity, fill, ttl);
        let (ttl, most) = if share_rate.min(most_short) <= most_long {
            (ttl, most_long)
        } else {
            (short_ttl, most_short)
        };
        let rate = share_rate.min(most);
        if most_short == 0 && !self.warned_small.swap(true, Ordering::Relaxed) {
            // Not one token a fill can be paid for even the short time-to-live: the bucket
            // is denied for as long as its limits stay as they are. Said once per stream.
            tracing::warn!(
                domain = &**domain,
                bucket = ?entries,
                capacity,
                renew_every = ?self.short_ttl / 2,
                "an RLQS bucket's capacity cannot pay for any assignment, so every Envoy is \
                 denied it; decide its limit with RLS or /v1/check, or renew more often \
                 (--rlqs-renew-every)"
            );
        }
        let margin = ttl / 4;
        // The rate held is kept when it is no more than this Envoy's share and close to the
        // rate it would get: a new strategy is a new full bucket to pay, and demand jitters.
        let close = |held: u32| {
            let (held, rate) = (u64::from(held), u64::from(rate));
            held <= share && held * 5 >= rate * 4 && held * 4 <= rate * 5
        };
        let held = match held {
            Some(held)
                if held.assignment.fill == fill
                    && held.assignment.extendable(now, margin)
                    && close(held.assignment.rate) =>
            {
                match self.extend(domain, entries, held, ttl, now).await {
                    Ok(answer) => return answer,
                    // Replaced below by what the bucket still pays for.
                    Err(held) => Some(held),
                }
            }
            other => other,
        };
        // A rate held below the one wanted is replaced only by a larger one the bucket pays
        // for: a new strategy is a full bucket to pay at once, and replacing a small
        // assignment by another small one would spend the refill on full buckets instead of
        // letting it build up. Envoys whose shares changed then trade places a little at a
        // time, as refill frees, instead of each knocking the other down to a token or two.
        let held = match held {
            Some(held)
                if held.assignment.fill == fill
                    && held.assignment.extendable(now, margin)
                    && held.assignment.rate < rate =>
            {
                match self.grow(domain, entries, held, rate, ttl, now).await {
                    Ok(answer) => return answer,
                    Err(held) => Some(held),
                }
            }
            other => other,
        };
        // Whatever the Envoy holds is replaced: the refill it will not reach goes back first,
        // so that it can pay for the new assignment (its own or another Envoy's).
        self.give_back(domain, entries, held, now, margin).await;
        let mut rate = rate;
        for _ in 0..2 {
            if rate == 0 {
                break;
            }
            let (fresh, cost) = Assignment::fresh(rate, fill, now, ttl);
            match self.charge(domain, entries, cost).await {
                (Charged::Paid, charge) => {
                    let held = Held {
                        assignment: fresh,
                        charge,
                    };
                    return (Answer::Tokens(fresh), Some(held));
                }
                (Charged::Free, _) => return (Answer::Allow(ttl), None),
                (Charged::Closed, _) => break,
                // Too few tokens: the largest fresh bucket what is left pays for, if any.
                (Charged::Short(available), _) => {
                    rate = rate.min(assignment::largest_rate(available, fill, ttl));
                }
            }
        }
        (Answer::Deny(short_ttl), None)
    }

    /// For an Envoy holding `held`, below `rate`: the largest fresh assignment up to `rate`
    /// the bucket pays for, if larger than `held` (which then gives back what it will not
    /// reach), or else `held` extended, or kept as it is when the bucket cannot pay even
    /// that. `Err(held)` when a limit fails closed.
    async fn grow(
        &self,
        domain: &Arc<str>,
        entries: &Entries,
        held: Held,
        rate: u32,
        ttl: Duration,
        now: Timestamp,
    ) -> Result<(Answer, Option<Held>), Held> {
        let margin = ttl / 4;
        let fill = held.assignment.fill;
        let mut rate = rate;
        for _ in 0..2 {
            if rate <= held.assignment.rate {
                break;
            }
            let (fresh, cost) = Assignment::fresh(rate, fill, now, ttl);
            match self.charge(domain, entries, cost).await {
                (Charged::Paid, charge) => {
                    self.give_back(domain, entries, Some(held), now, margin)
                        .await;
                    let fresh_held = Held {
                        assignment: fresh,
                        charge,
                    };
                    return Ok((Answer::Tokens(fresh), Some(fresh_held)));
                }
                (Charged::Free, _) => {
                    self.give_back(domain, entries, Some(held), now, margin)
                        .await;
                    return Ok((Answer::Allow(ttl), None));
                }
                (Charged::Closed, _) => return Err(held),
                (Charged::Short(available), _) => {
                    rate = rate.min(assignment::largest_rate(available, fill, ttl));
                }
            }
        }
        self.extend(domain, entries, held, ttl, now).await
    }

    /// `held` extended to `ttl` from `now` (the caller checked it is extendable), paying only
    /// the refill beyond what is paid; kept as it is when the bucket cannot pay that just now
    /// (tried again at the next report or renewal). `Err(held)` when a limit fails closed.
    async fn extend(
        &self,
        domain: &Arc<str>,
        entries: &Entries,
        held: Held,
        ttl: Duration,
        now: Timestamp,
    ) -> Result<(Answer, Option<Held>), Held> {
        let (extended, cost) = held.assignment.extended(now, ttl);
        match self.charge(domain, entries, cost).await {
            (Charged::Paid, charge) => {
                let extended_held = Held {
                    assignment: extended,
                    charge: charge.or(held.charge),
                };
                Ok((Answer::Tokens(extended), Some(extended_held)))
            }
            (Charged::Free, _) => {
                self.give_back(domain, entries, Some(held), now, ttl / 4)
                    .await;
                Ok((Answer::Allow(ttl), None))
            }
            (Charged::Short(_), _) => Ok((Answer::Keep, Some(held))),
            (Charged::Closed, _) => Err(held),
        }
    }

    /// Gives back the refill `held` paid for beyond `now + margin`, which its Envoy will not
    /// reach once its assignment is replaced, from the last charge made for it. A store that
    /// cannot answer keeps it (the quota under-admits, never over-admits).
    async fn give_back(
        &self,
        domain: &str,
        entries: &Entries,
        held: Option<Held>,
        now: Timestamp,
        margin: Duration,
    ) {
        let Some(Held {
            assignment,
            charge: Some(charge),
        }) = held
        else {
            return;
        };
        let refund = assignment.unused(now, margin).min(charge.cost);
        if refund == 0 {
            return;
        }
        let request = Decide {
            domain,
            descriptors: std::slice::from_ref(entries),
            cost: charge.cost.into(),
            request_id: Some(&charge.id),
        };
        let Ok(_permit) = self.in_flight.acquire().await else {
            return;
        };
        match self.decider.settle(&request, charge.cost - refund).await {
            Ok(_) => metrics::record_rlqs_given_back(refund),
            Err(err) => {
                tracing::debug!(domain, error = %err, "unused RLQS tokens could not be given back");
            }
        }
    }

    /// Takes `cost` tokens from every limit on the bucket, all or nothing, under a request
    /// id of its own so that what goes unused can be given back.
    async fn charge(
        &self,
        domain: &str,
        entries: &Entries,
        cost: u64,
    ) -> (Charged, Option<Charge>) {
        if cost == 0 {
            return (Charged::Paid, None);
        }
        let charge = self.charges.fetch_add(1, Ordering::Relaxed);
        let id = format!("rlqs-{:016x}-{}-{charge}", self.nonce, self.id);
        let request = Decide {
            domain,
            descriptors: std::slice::from_ref(entries),
            cost: cost.into(),
            request_id: Some(&id),
        };
        let Ok(_permit) = self.in_flight.acquire().await else {
            return (Charged::Closed, None);
        };
        let outcome: Outcome = match self.decider.decide(Api::Rlqs, &request).await {
            Ok(outcome) => outcome,
            // Larger than a capacity (a policy reloaded between sizing and charging), or a
            // limit the store cannot represent: nothing was charged, and nothing is given.
            Err(err @ (DecideError::Invalid(_) | DecideError::Internal(_))) => {
                tracing::warn!(domain, error = %err, "an RLQS assignment could not be charged");
                return (Charged::Short(0), None);
            }
            Err(DecideError::Unavailable(_)) => return (Charged::Closed, None),
        };
        if outcome.failed_closed {
            return (Charged::Closed, None);
        }
        let enforced = outcome
            .limits
            .iter()
            .filter(|limit| limit.mode == "enforce")
            .filter_map(|limit| limit.decision);
        let mut tightest = None::<u64>;
        for decision in enforced {
            tightest = Some(tightest.map_or(decision.remaining(), |t| t.min(decision.remaining())));
        }
        match tightest {
            None => (Charged::Free, None),
            Some(_) if outcome.allowed => {
                metrics::record_rlqs_prepaid(cost);
                (Charged::Paid, Some(Charge { id, cost }))
            }
            // A cost above an emergency budget's capacity is shown as an empty bucket: what
            // the budgets hold is asked apart, so that a smaller assignment can be paid.
            Some(_) if outcome.degraded => {
                (Charged::Short(self.emergency_left(domain, entries)), None)
            }
            Some(left) => (Charged::Short(left), None),
        }
    }

    /// What the emergency budgets of the bucket's limits hold now (0 if any is empty).
    fn emergency_left(&self, domain: &str, entries: &Entries) -> u64 {
        let descriptors = std::slice::from_ref(entries);
        let explained =
            self.decider
                .engine()
                .explain_degraded(domain, descriptors, 1u64, "store unavailable");
        let Ok(outcome) = explained else {
            return 0;
        };
        if !outcome.allowed {
            return 0;
        }
        outcome
            .limits
            .iter()
            .filter(|limit| limit.mode == "enforce")
            .filter_map(|limit| limit.decision)
            .map(|decision| decision.remaining().saturating_add(1))
            .min()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use tollgate::{Clock, ManualClock};
    use tollgate_policy::{EngineOptions, PolicyEngine, compile};

    use super::*;

    fn bucket() -> (Arc<str>, Entries) {
        (Arc::from("edge"), vec![("pool".to_owned(), "p".to_owned())])
    }

    #[test]
    fn streams_of_one_process_split_the_supply_max_min() {
        let demands = Demands::default();
        let (domain, entries) = bucket();
        assert_eq!(demands.share(&domain, &entries, 1, 30, 20), 20);
        // A second stream: 10 each; one that wants little gets it, the other the rest.
        assert_eq!(demands.share(&domain, &entries, 2, 30, 20), 10);
        assert_eq!(demands.share(&domain, &entries, 2, 4, 20), 4);
        assert_eq!(demands.share(&domain, &entries, 1, 30, 20), 16);
        assert_eq!(
            demands.totals(),
            vec![(Arc::clone(&domain), entries.clone(), 34)]
        );
    }

    #[test]
    fn other_processes_on_the_board_take_their_share_first() {
        let demands = Demands::default();
        let (domain, entries) = bucket();
        assert_eq!(demands.share(&domain, &entries, 1, 30, 20), 20);
        // Another process wants 30 too: this one gets half, for its one stream.
        demands.set_elsewhere(&domain, &entries, vec![30]);
        assert_eq!(demands.share(&domain, &entries, 1, 30, 20), 10);
        // Two more processes that want little: 2 each, and 8 for each of the busy two,
        // which this process's two streams split.
        demands.set_elsewhere(&domain, &entries, vec![30, 2, 2]);
        assert_eq!(demands.share(&domain, &entries, 2, 30, 20), 4);
        // The others left the board: the supply is this process's again.
        demands.set_elsewhere(&domain, &entries, Vec::new());
        assert_eq!(demands.share(&domain, &entries, 1, 30, 20), 10);
        // A bucket every stream forgot is no longer posted (its post expires on the board).
        demands.forget(&domain, &entries, 1);
        demands.forget(&domain, &entries, 2);
        assert!(demands.totals().is_empty());
    }

    const SECOND: Duration = Duration::from_secs(1);

    /// A stream's payer on the memory store, with one limit on the `pool` entry, over a
    /// clock the test moves.
    struct Stream {
        payer: Payer,
        clock: ManualClock,
        domain: Arc<str>,
        entries: Entries,
    }

    impl Stream {
        fn new(capacity: u64, renew_every: Duration) -> Self {
            let text = format!(
                "limits: [{{name: pool, domain: edge, key: [pool], capacity: {capacity}, \
                 refill: 105/s}}]"
            );
            let policy = compile("p.yaml", &text).expect("policy");
            let clock = ManualClock::new();
            let options = EngineOptions::default().clock(Arc::new(clock.clone()));
            let engine = Arc::new(PolicyEngine::new(policy, options));
            let payer = Payer {
                id: 1,
                nonce: 7,
                charges: AtomicU64::new(0),
                decider: Arc::new(Decider::new(engine, crate::decider::Backend::Memory)),
                demands: Arc::default(),
                in_flight: Arc::new(Semaphore::new(IN_FLIGHT)),
                short_ttl: renew_every * 2,
                warned_small: AtomicBool::new(false),
            };
            let (domain, entries) = bucket();
            Self {
                payer,
                clock,
                domain,
                entries,
            }
        }

        /// A report of `requests` over a second, now, asking for `ttl`: the rate assigned.
        async fn report(&self, held: &mut Option<Held>, requests: u64, ttl: Duration) -> u32 {
            let mut step = Step::Assign {
                held: held.take(),
                requests,
                first: false,
                interval: SECOND,
                ttl,
                now: self.clock.now(),
                renewal: false,
            };
            let (answer, after) = self.payer.pay(&self.domain, &self.entries, &mut step).await;
            *held = after;
            match answer {
                Answer::Tokens(assignment) => assignment.rate,
                _ => panic!("a token bucket, not {}", answer.label()),
            }
        }

        fn request(&self, cost: u64) -> Decide<'_, Entries> {
            Decide {
                domain: &self.domain,
                descriptors: std::slice::from_ref(&self.entries),
                cost: cost.into(),
                request_id: None,
            }
        }

        /// Whether the bucket holds `cost` tokens now.
        async fn holds(&self, cost: u64) -> bool {
            let request = self.request(cost);
            let outcome = self.payer.decider.check_only(&request).await;
            outcome.expect("decided").allowed
        }
    }

    /// Wanted rates, as a report of `requests` in a second asks: demand and a quarter, and one.
    const WANTS_51: u64 = 40;
    const WANTS_84: u64 = 67;
    const WANTS_67: u64 = 53;
    const WANTS_106: u64 = 84;

    #[tokio::test]
    async fn a_rate_held_within_the_band_is_extended_and_one_outside_replaced() {
        assert_eq!(assignment::wanted_rate(WANTS_84, SECOND, SECOND), 84);
        let stream = Stream::new(1_000, SECOND);
        let mut held = None;
        assert_eq!(stream.report(&mut held, WANTS_84, 2 * SECOND).await, 84);
        // 105 a second is all the limit refills: 84 is exactly four fifths of it, and kept.
        stream.clock.advance(SECOND / 10);
        assert_eq!(stream.report(&mut held, WANTS_106, 2 * SECOND).await, 84);
        // Less demand than the rate held: replaced by the smaller one.
        assert_eq!(stream.report(&mut held, WANTS_67, 2 * SECOND).await, 67);
        // 67 is below four fifths of 105: grown to it.
        assert_eq!(stream.report(&mut held, WANTS_106, 2 * SECOND).await, 105);
    }

    /// The rate held is replaced when it is more than a quarter above the one the capacity
    /// pays for now: an Envoy reporting every 2 s gets a time-to-live of 4 s, which a
    /// capacity of 30 pays at 6 a second (a fill and four more), down from 10 for 2 s.
    #[tokio::test]
    async fn a_rate_held_far_above_what_the_capacity_pays_is_replaced() {
        let stream = Stream::new(30, 2 * SECOND);
        let mut held = None;
        assert_eq!(stream.report(&mut held, WANTS_106, 2 * SECOND).await, 10);
        stream.clock.advance(SECOND / 2);
        assert_eq!(stream.report(&mut held, WANTS_106, 4 * SECOND).await, 6);
    }

    /// A rate held below the one wanted grows only to a larger one the bucket pays for: with
    /// 10 tokens left the bucket pays a fresh 3, so the 51 held is extended instead (nothing
    /// to pay, as it is paid for 2 s) rather than given back and replaced by what that frees.
    #[tokio::test]
    async fn a_rate_held_grows_only_to_a_larger_one_the_bucket_pays_for() {
        assert_eq!(assignment::wanted_rate(WANTS_51, SECOND, SECOND), 51);
        let stream = Stream::new(1_000, SECOND);
        let mut held = None;
        assert_eq!(stream.report(&mut held, WANTS_51, 2 * SECOND).await, 51);
        let drain = stream.request(1_000 - 153 - 10);
        let drained = stream.payer.decider.decide(Api::Http, &drain).await;
        assert!(drained.expect("decided").allowed);
        assert_eq!(stream.report(&mut held, WANTS_106, 2 * SECOND).await, 51);
        assert!(stream.holds(10).await && !stream.holds(11).await);
    }

    /// Grown, the old assignment gives back the refill it paid beyond the new one's arrival
    /// (a quarter of the time-to-live after now): 51 a second for 1.5 s, 76 tokens.
    #[tokio::test]
    async fn a_grown_assignment_gives_back_what_the_old_one_paid_ahead() {
        let stream = Stream::new(1_000, SECOND);
        let mut held = None;
        assert_eq!(stream.report(&mut held, WANTS_51, 2 * SECOND).await, 51);
        assert_eq!(stream.report(&mut held, WANTS_106, 2 * SECOND).await, 105);
        let left = 1_000 - 153 - 315 + 76;
        assert!(stream.holds(left).await && !stream.holds(left + 1).await);
    }
}
