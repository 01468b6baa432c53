//! Shares of global limits, with the global store, the board and the regional store all in
//! memory on one manual clock: exactness across processes, fair shares, all-or-nothing,
//! idempotency, outages and give-backs.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use proptest::prelude::*;
use tollgate::{
    CheckRequest, Clock, Decision, Error, Limit, LocalStore, ManualClock, SettleStatus, Settlement,
    Store, Take, Unavailable, block_on_ready,
};
use tollgate_regional::{Board, MemoryBoard, Options, Regional};

const SECOND: Duration = Duration::from_secs(1);

/// A store, or a board, that can be cut off.
struct Switch<S> {
    store: S,
    down: AtomicBool,
}

impl<S> Switch<S> {
    fn new(store: S) -> Self {
        Self {
            store,
            down: AtomicBool::new(false),
        }
    }

    fn cut(&self, down: bool) {
        self.down.store(down, Ordering::Relaxed);
    }

    fn reach(&self) -> Result<(), Error> {
        if self.down.load(Ordering::Relaxed) {
            return Err(Error::StoreUnavailable {
                reason: Unavailable::Connection,
            });
        }
        Ok(())
    }
}

impl<S: Store> Store for Switch<S> {
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

impl<B: Board> Board for Switch<B> {
    async fn post(
        &self,
        key: &str,
        participant: &str,
        tokens: u64,
        ttl: Duration,
    ) -> Result<Vec<u64>, Error> {
        self.reach()?;
        self.store.post(key, participant, tokens, ttl).await
    }
}

/// 1,000 tokens and no refill to speak of over a test, so every token back is a token given
/// back.
fn slow() -> Limit {
    Limit::new(1_000, "1/d".parse().unwrap()).unwrap()
}

fn everything_global(key: &str) -> bool {
    key.starts_with("g:")
}

type Time = Arc<ManualClock>;
type Global = Switch<LocalStore<Time>>;
type Process<'w> = Regional<&'w Global, &'w Switch<MemoryBoard<Time>>, Time>;

/// One manual clock, a global store and its board that can each be cut off, and a regional
/// store.
struct World {
    clock: Time,
    global: Global,
    board: Switch<MemoryBoard<Time>>,
    regional: LocalStore<Time>,
}

impl World {
    fn new() -> Self {
        let clock = Arc::new(ManualClock::new());
        Self {
            global: Switch::new(LocalStore::new(Arc::clone(&clock))),
            board: Switch::new(MemoryBoard::new(Arc::clone(&clock))),
            regional: LocalStore::new(Arc::clone(&clock)),
            clock,
        }
    }

    /// A process sharing the global store as `name`.
    fn process(&self, name: &str, options: Options) -> Process<'_> {
        Regional::new(
            &self.global,
            &self.board,
            Arc::clone(&self.clock),
            name,
            options,
        )
    }

    fn check(
        &self,
        process: &Process<'_>,
        takes: &[Take<'_>],
        request_id: Option<&str>,
    ) -> Result<Vec<Decision>, Error> {
        let request = CheckRequest {
            takes,
            request_id,
            now: None,
        };
        block_on_ready(
            process
                .over(&self.regional, &everything_global)
                .check(request),
        )
    }

    /// A process that forgets a reservoir after `abandon_after` quiet, once one request on
    /// `g:acme` ([`slow`]) gave it a reservoir: the process, and what the reservoir holds.
    fn holding_one(&self, abandon_after: Duration) -> (Process<'_>, u64) {
        let options = Options {
            abandon_after,
            ..Options::default()
        };
        let shares = self.process("eu", options);
        let limit = slow();
        let takes = [Take::new("g:acme", &limit, 1)];
        assert!(self.check(&shares, &takes, None).unwrap()[0].allowed());
        let held = shares.held().1;
        assert!(held > 0);
        (shares, held)
    }

    /// The global bucket's balance, read without charging.
    fn balance(&self, key: &str, limit: &Limit) -> u64 {
        let takes = [Take::new(key, limit, 1)];
        let request = CheckRequest {
            takes: &takes,
            request_id: None,
            now: None,
        };
        let decision = block_on_ready(self.global.peek(request)).unwrap()[0];
        // A peek shows what would remain after taking its one token.
        decision.remaining() + u64::from(decision.allowed())
    }
}

#[test]
fn a_first_request_fetches_a_few_tokens_and_the_next_are_spent_here() {
    let w = World::new();
    let shares = w.process("eu", Options::default());
    let limit = Limit::new(100, "10/s".parse().unwrap()).unwrap();
    let takes = [Take::new("g:acme", &limit, 1)];

    assert!(w.check(&shares, &takes, None).unwrap()[0].allowed());
    let (keys, held) = shares.held();
    assert_eq!(keys, 1);
    // The global bucket was charged for the request and what the reservoir holds.
    assert_eq!(w.balance("g:acme", &limit), 100 - 1 - held);
    w.global.cut(true);
    for _ in 0..held {
        assert!(w.check(&shares, &takes, None).unwrap()[0].allowed());
    }
    // Empty, and the fetch it now needs cannot reach the global store: the failure mode's
    // turn, not a rejection.
    assert!(matches!(
        w.check(&shares, &takes, None),
        Err(Error::StoreUnavailable { .. })
    ));
}

/// A request that finds its reservoir short fetches only what it lacks (and what the round
/// would add): when the global bucket holds just that, the request passes.
#[test]
fn a_short_reservoir_fetches_what_it_lacks() {
    let w = World::new();
    let shares = w.process("eu", Options::default());
    let limit = Limit::new(100, "10/s".parse().unwrap()).unwrap();
    let one = [Take::new("g:acme", &limit, 1)];
    assert!(w.check(&shares, &one, None).unwrap()[0].allowed());
    assert_eq!(shares.held().1, 3);
    // Someone else takes all but two tokens: the reservoir's 3 and those 2 make 5.
    let others = [Take::new("g:acme", &limit, 94)];
    let request = CheckRequest {
        takes: &others,
        request_id: None,
        now: None,
    };
    assert!(block_on_ready(w.global.check(request)).unwrap()[0].allowed());
    let five = [Take::new("g:acme", &limit, 5)];
    assert!(w.check(&shares, &five, None).unwrap()[0].allowed());
    assert_eq!((shares.held().1, w.balance("g:acme", &limit)), (0, 0));
    // A cost of the whole capacity is a cost like any other.
    let all = [Take::new("g:all", &limit, 100)];
    assert!(w.check(&shares, &all, None).unwrap()[0].allowed());
}

/// Beyond the bound on reservoirs, a request the global bucket cannot cover is refused, with
/// the wait for its tokens, and charges nothing.
#[test]
fn beyond_the_bound_a_request_the_global_bucket_cannot_cover_is_refused() {
    let w = World::new();
    let options = Options {
        max_keys: 0,
        ..Options::default()
    };
    let shares = w.process("eu", options);
    let limit = Limit::new(3, "1/m".parse().unwrap()).unwrap();
    let takes = [Take::new("g:acme", &limit, 2)];
    assert!(w.check(&shares, &takes, None).unwrap()[0].allowed());
    let refused = w.check(&shares, &takes, None).unwrap()[0];
    assert!(!refused.allowed());
    assert_eq!(refused.retry_after(), Some(60 * SECOND));
    assert_eq!((shares.held(), w.balance("g:acme", &limit)), ((0, 0), 1));
}

/// Global takes for the reservoirs, regional ones on the regional store.
fn global_scope(key: &str) -> bool {
    key.starts_with("g:")
}

/// A request a regional limit refuses takes nothing from the reservoirs, and what a request
/// beyond the bound on reservoirs fetched goes back to the global bucket; the global take's
/// decision shows the reservoir as it is, untouched.
#[test]
fn a_regional_refusal_puts_the_global_tokens_back() {
    for max_keys in [100, 0] {
        let w = World::new();
        let options = Options {
            max_keys,
            ..Options::default()
        };
        let shares = w.process("eu", options);
        let over = shares.over(&w.regional, &global_scope);
        let global = Limit::new(100, "1/d".parse().unwrap()).unwrap();
        let regional = Limit::new(1, "1/d".parse().unwrap()).unwrap();
        let takes = [
            Take::new("g:acme", &global, 2),
            Take::new("r:alice", &regional, 1),
        ];
        let check = || {
            let request = CheckRequest {
                takes: &takes,
                request_id: None,
                now: None,
            };
            block_on_ready(over.check(request)).unwrap()
        };
        // Only the first request's 2 tokens are spent: the rest of what was fetched is held,
        // or was given back.
        let spent_only_the_first = || {
            let (fetched, given_back) = shares.totals();
            let held = shares.held().1;
            assert_eq!(fetched - given_back, 2 + held, "{max_keys}");
            assert_eq!(w.balance("g:acme", &global), 100 - 2 - held, "{max_keys}");
            held
        };
        assert!(check().iter().all(Decision::allowed));
        let refused = check();
        assert!(refused[0].allowed() && !refused[1].allowed(), "{max_keys}");
        let held = spent_only_the_first();
        if max_keys > 0 {
            // Not charged: the reservoir still holds the 2 it would have taken.
            assert_eq!(refused[0].remaining(), held);
        }
        // A regional take the regional store refuses outright (a cost above its capacity)
        // takes nothing either.
        let invalid = [
            Take::new("g:acme", &global, 2),
            Take::new("r:bob", &regional, 2),
        ];
        let request = CheckRequest {
            takes: &invalid,
            request_id: None,
            now: None,
        };
        assert!(matches!(
            block_on_ready(over.check(request)),
            Err(Error::InvalidCost { .. })
        ));
        spent_only_the_first();
    }
}

/// A look at global takes reads the reservoir, or the global bucket for a key this process
/// holds none of; regional ones read the regional store; nothing is charged.
#[test]
fn a_peek_reads_reservoirs_the_global_bucket_and_the_regional_store() {
    let w = World::new();
    let shares = w.process("eu", Options::default());
    let over = shares.over(&w.regional, &global_scope);
    let global = Limit::new(100, "1/d".parse().unwrap()).unwrap();
    let regional = Limit::new(5, "1/d".parse().unwrap()).unwrap();
    let one = [Take::new("g:held", &global, 1)];
    assert!(w.check(&shares, &one, None).unwrap()[0].allowed());
    let held = shares.held().1;
    let peek = |takes: &[Take<'_>]| {
        let request = CheckRequest {
            takes,
            request_id: None,
            now: None,
        };
        block_on_ready(over.peek(request)).unwrap()
    };
    let takes = [
        Take::new("g:held", &global, held),
        Take::new("g:new", &global, 40),
        Take::new("r:alice", &regional, 2),
    ];
    let seen = peek(&takes);
    assert_eq!(seen.len(), 3);
    assert!(seen.iter().all(Decision::allowed), "{seen:?}");
    assert_eq!(
        seen.iter().map(Decision::remaining).collect::<Vec<_>>(),
        [held, 60, 3]
    );
    let too_much = peek(&[Take::new("g:held", &global, held + 1)]);
    assert!(!too_much[0].allowed());
    assert_eq!(shares.held().1, held);
    assert_eq!(w.balance("g:new", &global), 100);
}

/// A reset reaches regional buckets only: a global bucket's tokens sit in every region's
/// reservoir, which no reset here could take back.
#[test]
fn a_reset_of_a_global_bucket_is_refused() {
    let w = World::new();
    let shares = w.process("eu", Options::default());
    let over = shares.over(&w.regional, &global_scope);
    let regional = Limit::new(1, "1/d".parse().unwrap()).unwrap();
    let alice = [Take::new("r:alice", &regional, 1)];
    let check = || {
        let request = CheckRequest {
            takes: &alice,
            request_id: None,
            now: None,
        };
        block_on_ready(over.check(request)).unwrap()[0].allowed()
    };
    assert!(check());
    assert!(!check());
    assert!(matches!(
        block_on_ready(over.reset(&["g:acme", "r:alice"])),
        Err(Error::Unsupported { .. })
    ));
    assert!(!check());
    block_on_ready(over.reset(&["r:alice"])).unwrap();
    assert!(check());
}

/// What a reservoir holds changes at the next round: that is an admission's reset.
#[test]
fn an_admission_resets_at_the_next_round() {
    let w = World::new();
    let shares = w.process("eu", Options::default());
    let limit = Limit::new(100, "10/s".parse().unwrap()).unwrap();
    let takes = [Take::new("g:acme", &limit, 1)];
    let first = w.check(&shares, &takes, None).unwrap()[0];
    assert!(first.allowed());
    assert_eq!(first.reset_after(), SECOND);
    w.clock.advance(Duration::from_millis(300));
    let next = w.check(&shares, &takes, None).unwrap()[0];
    assert_eq!(next.reset_after(), Duration::from_millis(700));
}

#[test]
fn a_burst_gets_the_whole_capacity_then_the_global_buckets_wait() {
    let w = World::new();
    let shares = w.process("eu", Options::default());
    // A token a minute, refilled two at a time.
    let limit = Limit::new(3, "2/2m".parse().unwrap()).unwrap();
    let takes = [Take::new("g:slow", &limit, 1)];
    let mut allowed = 0;
    for _ in 0..10 {
        let d = w.check(&shares, &takes, None).unwrap();
        if d[0].allowed() {
            allowed += 1;
        } else {
            // Until the global bucket holds the one token the request needs, though the
            // fetch asked for more.
            assert_eq!(d[0].retry_after(), Some(60 * SECOND));
        }
    }
    // A reservoir a burst empties fetches at once while the global bucket has tokens.
    assert_eq!(allowed, 3);
}

/// A fetch that asks more than the global bucket holds takes what is there when that covers
/// the request: the last tokens of a global bucket are spent, not stranded.
#[test]
fn a_fetch_takes_what_is_left_when_it_covers_the_request() {
    let w = World::new();
    let eu = w.process("eu", Options::default());
    let limit = Limit::new(100, "10/s".parse().unwrap()).unwrap();
    let takes = [Take::new("g:acme", &limit, 1)];
    assert!(w.check(&eu, &takes, None).unwrap()[0].allowed());
    let (_, held) = eu.held();
    // Someone else takes all but two tokens.
    let others = [Take::new("g:acme", &limit, 100 - 1 - held - 2)];
    let request = CheckRequest {
        takes: &others,
        request_id: None,
        now: None,
    };
    assert!(block_on_ready(w.global.check(request)).unwrap()[0].allowed());
    for _ in 0..held + 2 {
        assert!(w.check(&eu, &takes, None).unwrap()[0].allowed());
    }
    assert_eq!(w.balance("g:acme", &limit), 0);
    assert!(!w.check(&eu, &takes, None).unwrap()[0].allowed());
}

#[test]
fn shares_follow_demand_and_are_fair() {
    let w = World::new();
    let small = w.process("small", Options::default());
    let big = w.process("big", Options::default());
    let limit = Limit::new(100, "100/s".parse().unwrap()).unwrap();
    let takes = [Take::new("g:tenant", &limit, 1)];
    // `small` wants 20 a second, `big` 300; each round is 10 steps of 100 ms.
    let mut last = (0, 0);
    for round in 0..30 {
        let mut got = (0, 0);
        for _ in 0..10 {
            for _ in 0..2 {
                got.0 += u32::from(w.check(&small, &takes, None).unwrap()[0].allowed());
            }
            for _ in 0..30 {
                got.1 += u32::from(w.check(&big, &takes, None).unwrap()[0].allowed());
            }
            w.clock.advance(SECOND / 10);
        }
        block_on_ready(small.rebalance());
        block_on_ready(big.rebalance());
        if round >= 20 {
            last.0 += got.0;
            last.1 += got.1;
        }
    }
    // Over the last ten seconds the limit allowed at most 1,100 (its refill, and its
    // capacity at most, long spent): the small one got all it asked, the big one the rest,
    // less what sits in reservoirs.
    assert_eq!(last.0, 200, "{last:?}");
    assert!((700..=900).contains(&last.1), "{last:?}");
}

#[test]
fn a_rejected_regional_take_charges_no_global_token() {
    let w = World::new();
    let shares = w.process("eu", Options::default());
    let tenant = Limit::new(100, "10/s".parse().unwrap()).unwrap();
    let user = Limit::new(1, "1/h".parse().unwrap()).unwrap();
    let takes = [
        Take::new("g:acme", &tenant, 1),
        Take::new("user:7", &user, 1),
    ];
    let first = w.check(&shares, &takes, None).unwrap();
    assert!(first.iter().all(Decision::allowed));
    let held = shares.held().1;
    let second = w.check(&shares, &takes, None).unwrap();
    assert!(!second[1].allowed());
    assert!(second[0].allowed(), "the tenant would have passed");
    assert_eq!(shares.held().1, held, "and its token is back");
    // A cost above the capacity is an error that takes nothing.
    let too_much = [Take::new("g:acme", &tenant, 101)];
    assert!(matches!(
        w.check(&shares, &too_much, None),
        Err(Error::InvalidCost {
            cost: 101,
            capacity: 100
        })
    ));
    assert_eq!(shares.held().1, held);
}

#[test]
fn a_retry_is_free_and_a_settlement_gives_back_once() {
    let w = World::new();
    let shares = w.process("eu", Options::default());
    let limit = Limit::new(1_000, "100/s".parse().unwrap()).unwrap();
    let takes = [Take::new("g:acme", &limit, 10)];
    let first = w.check(&shares, &takes, Some("r1")).unwrap();
    let held = shares.held().1;
    assert_eq!(w.check(&shares, &takes, Some("r1")).unwrap(), first);
    assert_eq!(shares.held().1, held, "a retry charges nothing");
    let other = [Take::new("g:acme", &limit, 11)];
    assert!(matches!(
        w.check(&shares, &other, Some("r1")),
        Err(Error::IdempotencyConflict)
    ));

    let request = CheckRequest {
        takes: &takes,
        request_id: Some("r1"),
        now: None,
    };
    let over = shares.over(&w.regional, &everything_global);
    let settled = block_on_ready(over.settle(request, &[7])).unwrap();
    assert_eq!(settled.status, SettleStatus::Settled);
    assert_eq!(shares.held().1, held + 7);
    let again = block_on_ready(over.settle(request, &[7])).unwrap();
    assert_eq!(again.status, SettleStatus::Repeated);
    assert_eq!(shares.held().1, held + 7);
    // Settled once: other refunds under the same id are a conflict, and give nothing.
    assert!(matches!(
        block_on_ready(over.settle(request, &[3])),
        Err(Error::IdempotencyConflict)
    ));
    assert_eq!(shares.held().1, held + 7);
    let unknown = CheckRequest {
        request_id: Some("r2"),
        ..request
    };
    let none = block_on_ready(over.settle(unknown, &[7])).unwrap();
    assert_eq!(none.status, SettleStatus::NotFound);
}

#[test]
fn a_reservoir_whose_demand_falls_gives_its_excess_back() {
    let w = World::new();
    let shares = w.process("eu", Options::default());
    let limit = Limit::new(10_000, "1000/s".parse().unwrap()).unwrap();
    let takes = [Take::new("g:acme", &limit, 1)];
    // A busy round, with shortfalls, grows the reservoir...
    let mut admitted = 0;
    for _ in 0..500 {
        admitted += u64::from(w.check(&shares, &takes, None).unwrap()[0].allowed());
    }
    w.clock.advance(SECOND);
    block_on_ready(shares.rebalance());
    let busy = shares.held().1;
    assert!(busy > 100, "held {busy}");
    // ...and quiet rounds trim it back, whole charges at a time.
    let mut given_back = 0;
    for _ in 0..10 {
        w.clock.advance(SECOND);
        given_back += block_on_ready(shares.rebalance()).given_back;
    }
    let quiet = shares.held().1;
    assert!(quiet < busy / 4, "held {quiet} of {busy}");
    assert!(given_back > 0);
    // Nothing minted, nothing lost: what was charged less what went back is what was
    // admitted and what is still held.
    let (fetched, returned) = shares.totals();
    assert_eq!(fetched - returned, admitted + quiet);
}

#[test]
fn a_quiet_reservoir_is_given_back_and_forgotten() {
    let w = World::new();
    let (shares, held) = w.holding_one(5 * SECOND);
    assert_eq!(shares.options().abandon_after, 5 * SECOND);
    let limit = slow();
    assert_eq!(w.balance("g:acme", &limit), 1_000 - 1 - held);
    w.clock.advance(5 * SECOND);
    let round = block_on_ready(shares.rebalance());
    assert_eq!((round.abandoned, round.given_back), (1, held));
    assert_eq!(shares.held(), (0, 0));
    assert_eq!(w.balance("g:acme", &limit), 999);
}

/// The global store remembers a charge for its idempotency window (a minute) only: a
/// reservoir quiet for longer has nothing left to give back under, and says so.
#[test]
fn a_reservoir_quiet_past_the_store_s_memory_gives_nothing_back() {
    let w = World::new();
    let (shares, held) = w.holding_one(120 * SECOND);
    let limit = slow();
    w.clock.advance(120 * SECOND);
    let round = block_on_ready(shares.rebalance());
    assert_eq!((round.abandoned, round.given_back, round.failed), (1, 0, 0));
    assert_eq!(shares.totals(), (1 + held, 0));
    assert_eq!(w.balance("g:acme", &limit), 1_000 - 1 - held);
}

/// A quiet reservoir forgotten while the global store is down cannot give back: the round
/// counts the failure.
#[test]
fn a_give_back_the_global_store_cannot_take_is_a_failure() {
    let w = World::new();
    let (shares, _) = w.holding_one(5 * SECOND);
    w.global.cut(true);
    w.clock.advance(5 * SECOND);
    let round = block_on_ready(shares.rebalance());
    assert_eq!((round.abandoned, round.given_back, round.failed), (1, 0, 1));
    assert_eq!(shares.held(), (0, 0));
}

/// A round that cannot reach the board neither tops up nor trims (it cannot know its share),
/// and counts the failure, as does a quiet reservoir that cannot take itself off the board
/// (it gives its tokens back all the same).
#[test]
fn a_board_out_of_reach_fails_the_round_and_keeps_what_is_held() {
    let w = World::new();
    let (shares, held) = w.holding_one(5 * SECOND);
    let limit = slow();
    w.board.cut(true);
    w.clock.advance(SECOND);
    let round = block_on_ready(shares.rebalance());
    assert_eq!((round.fetched, round.given_back, round.failed), (0, 0, 1));
    assert_eq!(shares.held(), (1, held));
    // The board and the global store are one Redis in production: a request the reservoir
    // cannot cover follows its failure mode rather than wait on a store just found down.
    let all = [Take::new("g:acme", &limit, held + 1)];
    assert!(matches!(
        w.check(&shares, &all, None),
        Err(Error::StoreUnavailable { .. })
    ));
    assert_eq!(shares.held(), (1, held));
    w.clock.advance(5 * SECOND);
    let round = block_on_ready(shares.rebalance());
    assert_eq!(
        (round.abandoned, round.given_back, round.failed),
        (1, held, 1)
    );
    assert_eq!(w.balance("g:acme", &limit), 999);
}

/// A key's first request that finds the global bucket empty is told to come back when the
/// token it needs is there, not at the next round.
#[test]
fn a_first_request_on_an_empty_global_bucket_waits_for_its_token() {
    let w = World::new();
    let shares = w.process("eu", Options::default());
    // A token a minute, refilled two at a time.
    let limit = Limit::new(10, "2/2m".parse().unwrap()).unwrap();
    let all = [Take::new("g:acme", &limit, 10)];
    let request = CheckRequest {
        takes: &all,
        request_id: None,
        now: None,
    };
    assert!(block_on_ready(w.global.check(request)).unwrap()[0].allowed());
    let takes = [Take::new("g:acme", &limit, 1)];
    let refused = w.check(&shares, &takes, None).unwrap()[0];
    assert!(!refused.allowed());
    assert_eq!(refused.retry_after(), Some(60 * SECOND));
}

/// A key quiet for one round keeps at least half of what it held: a pause between bursts
/// does not start it from nothing.
#[test]
fn a_key_quiet_for_a_round_keeps_half_its_reservoir() {
    let w = World::new();
    let shares = w.process("eu", Options::default());
    let limit = Limit::new(10_000, "1000/s".parse().unwrap()).unwrap();
    let takes = [Take::new("g:acme", &limit, 1)];
    for _ in 0..500 {
        w.check(&shares, &takes, None).unwrap();
    }
    w.clock.advance(SECOND);
    block_on_ready(shares.rebalance());
    // A steady round, then a quiet one.
    for _ in 0..200 {
        w.check(&shares, &takes, None).unwrap();
    }
    w.clock.advance(SECOND);
    block_on_ready(shares.rebalance());
    let steady = shares.held().1;
    w.clock.advance(SECOND);
    block_on_ready(shares.rebalance());
    let quiet = shares.held().1;
    assert!(quiet >= steady * 2 / 5, "held {quiet} of {steady}");
}

#[test]
fn beyond_the_bound_a_key_is_fetched_for_its_request_alone() {
    let w = World::new();
    let options = Options {
        max_keys: 1,
        ..Options::default()
    };
    let shares = w.process("eu", options);
    let limit = Limit::new(1_000, "1/d".parse().unwrap()).unwrap();
    let a = [Take::new("g:a", &limit, 1)];
    let b = [Take::new("g:b", &limit, 3)];
    assert!(w.check(&shares, &a, None).unwrap()[0].allowed());
    assert!(w.check(&shares, &b, None).unwrap()[0].allowed());
    assert_eq!(shares.held().0, 1);
    assert_eq!(
        w.balance("g:b", &limit),
        997,
        "exactly the cost, nothing held"
    );
}

#[test]
fn without_the_global_store_what_is_held_is_spent_and_rounds_fail_until_it_is_back() {
    let w = World::new();
    let shares = w.process("eu", Options::default());
    let limit = Limit::new(1_000, "100/s".parse().unwrap()).unwrap();
    let takes = [Take::new("g:acme", &limit, 1)];
    for _ in 0..50 {
        w.check(&shares, &takes, None).unwrap();
    }
    w.clock.advance(SECOND);
    block_on_ready(shares.rebalance());
    let held = shares.held().1;
    w.global.cut(true);
    // What is held is spent without the global store...
    for _ in 0..held {
        assert!(w.check(&shares, &takes, None).unwrap()[0].allowed());
    }
    // ...and a round cannot top it up.
    w.clock.advance(SECOND);
    let round = block_on_ready(shares.rebalance());
    assert_eq!(round.failed, 1);
    assert_eq!(shares.held().1, 0);
    w.global.cut(false);
    w.clock.advance(SECOND);
    let round = block_on_ready(shares.rebalance());
    assert_eq!((round.keys, round.failed, round.given_back), (1, 0, 0));
    assert!(shares.held().1 > 0, "topped up again");
    assert_eq!(round.fetched, shares.held().1);
    assert!(w.check(&shares, &takes, None).unwrap()[0].allowed());
}

/// One step of a random run.
#[derive(Debug, Clone)]
enum Step {
    /// Process `p` checks `cost`.
    Check { p: usize, cost: u64 },
    /// Process `p` runs a round.
    Round { p: usize },
    /// Time passes.
    Wait { ms: u64 },
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    let step = prop_oneof![
        6 => (0..3usize, 1..=5u64).prop_map(|(p, cost)| Step::Check { p, cost }),
        1 => (0..3usize).prop_map(|p| Step::Round { p }),
        2 => (1..700u64).prop_map(|ms| Step::Wait { ms }),
    ];
    prop::collection::vec(step, 1..400)
}

proptest! {
    /// Three processes on one global limit, with random requests, rounds and waits: all of
    /// them together never admit more than the limit's bucket could (its capacity plus its
    /// refill since the start), and never more than the global store charged less what it
    /// was given back.
    #[test]
    fn processes_together_never_admit_more_than_the_limit(
        steps in steps(),
        capacity in 1..50u64,
        per_second in 1..40u64,
    ) {
        let w = World::new();
        let options = Options { abandon_after: 3 * SECOND, ..Options::default() };
        let processes: Vec<_> = ["a", "b", "c"].iter().map(|p| w.process(p, options)).collect();
        let limit = Limit::new(capacity, tollgate::Rate::per_second(per_second).unwrap()).unwrap();
        let start = w.clock.now();
        let mut admitted = 0u128;
        for step in steps {
            match step {
                Step::Check { p, cost } => {
                    let cost = cost.min(capacity);
                    let takes = [Take::new("g:k", &limit, cost)];
                    if let Ok(d) = w.check(&processes[p], &takes, None)
                        && d[0].allowed()
                    {
                        admitted += u128::from(cost);
                    }
                }
                Step::Round { p } => {
                    block_on_ready(processes[p].rebalance());
                }
                Step::Wait { ms } => w.clock.advance(Duration::from_millis(ms)),
            }
            let elapsed = w.clock.now().saturating_duration_since(start).as_nanos();
            let bound = u128::from(capacity) + u128::from(per_second) * elapsed / 1_000_000_000;
            prop_assert!(admitted <= bound, "{admitted} > {bound}");
            let held: u128 = processes.iter().map(|p| u128::from(p.held().1)).sum();
            prop_assert!(admitted + held <= bound, "{admitted} + {held} held > {bound}");
        }
    }
}

/// A global store that holds its next check until the test lets it go, saying when it
/// arrived: so a round can run while a request's fetch is on its way.
struct Gated {
    store: LocalStore<Time>,
    gate: std::sync::Mutex<Option<Gate>>,
}

type Gate = (
    tokio::sync::oneshot::Sender<()>,
    tokio::sync::oneshot::Receiver<()>,
);

impl Store for Gated {
    async fn check(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
        let gate = self.gate.lock().unwrap().take();
        if let Some((arrived, release)) = gate {
            let _ = arrived.send(());
            let _ = release.await;
        }
        self.store.check(request).await
    }

    async fn peek(&self, request: CheckRequest<'_>) -> Result<Vec<Decision>, Error> {
        self.store.peek(request).await
    }

    async fn settle(
        &self,
        request: CheckRequest<'_>,
        refunds: &[u64],
    ) -> Result<Settlement, Error> {
        self.store.settle(request, refunds).await
    }
}

/// A key quiet past `abandon_after` gets a request its reservoir is short for: the fetch it
/// makes keeps a round that runs meanwhile from abandoning the reservoir, so what the fetch
/// brings has somewhere to go (it was lost, charged and never spent, before).
#[tokio::test]
async fn a_round_during_a_fetch_does_not_abandon_the_reservoir_it_fills() {
    let w = World::new();
    let global = Gated {
        store: LocalStore::new(Arc::clone(&w.clock)),
        gate: std::sync::Mutex::new(None),
    };
    let options = Options {
        abandon_after: 5 * SECOND,
        ..Options::default()
    };
    let shares = Regional::new(&global, &w.board, Arc::clone(&w.clock), "eu", options);
    let limit = Limit::new(1_000, "1/d".parse().unwrap()).unwrap();
    let takes = [Take::new("g:acme", &limit, 1)];
    let decide = || async {
        let request = CheckRequest {
            takes: &takes,
            request_id: None,
            now: None,
        };
        shares
            .over(&w.regional, &everything_global)
            .check(request)
            .await
    };
    // A first request, then what the reservoir holds: it is dry, the bucket far from empty.
    assert!(decide().await.unwrap()[0].allowed());
    let mut admitted = 1;
    while shares.held().1 > 0 {
        assert!(decide().await.unwrap()[0].allowed());
        admitted += 1;
    }
    w.clock.advance(6 * SECOND);
    let (arrived, arrival) = tokio::sync::oneshot::channel();
    let (release, released) = tokio::sync::oneshot::channel();
    *global.gate.lock().unwrap() = Some((arrived, released));
    let round = async {
        arrival.await.unwrap();
        let round = shares.rebalance().await;
        release.send(()).unwrap();
        round
    };
    let (decision, round) = futures_util::future::join(decide(), round).await;
    assert_eq!(round.abandoned, 0, "{round:?}");
    assert!(decision.unwrap()[0].allowed());
    admitted += 1;
    let (fetched, returned) = shares.totals();
    assert_eq!(fetched - returned, admitted + shares.held().1);
}
