//! Shares of global limits against real Redis (a single node and a three-master cluster),
//! with several processes' rebalancers and requests running at once on a real clock: all of
//! them together never admit more than the global bucket, admit at least a good part of it,
//! give back what they hold at the end, and spend what they hold, then report unavailable,
//! while Redis is frozen.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::task::JoinHandle;
use tollgate::{
    CheckRequest, Clock, Decision, Error, Limit, LocalStore, MonotonicClock, Store, Take, Timestamp,
};
use tollgate_redis::test_server::{RedisCluster, RedisServer, command};
use tollgate_redis::{RedisConfig, RedisStore};
use tollgate_regional::{Options, Regional, Round};

/// The store's timeout: a debug build on a busy CI host can pass the production 20 ms, which
/// would turn requests unavailable for nothing.
const LOADED: Duration = Duration::from_secs(2);

/// Every process's round.
const INTERVAL: Duration = Duration::from_millis(50);

/// Tasks sending requests, per process.
const TASKS: usize = 8;

type Process = Regional<Arc<RedisStore>, Arc<RedisStore>, Arc<MonotonicClock>>;
type Regionals = LocalStore<Arc<MonotonicClock>>;

fn global_scope(key: &str) -> bool {
    key.starts_with("g:")
}

fn limit(capacity: u64, rate: &str) -> Limit {
    Limit::new(capacity, rate.parse().unwrap()).unwrap()
}

async fn connect(url: &str, timeout: Duration) -> Arc<RedisStore> {
    Arc::new(
        RedisStore::connect(url, RedisConfig::default().with_timeout(timeout))
            .await
            .expect("connect"),
    )
}

/// One process: its own connection to the global store (its board too), and its own
/// regional store.
struct Member {
    shares: Arc<Process>,
    regional: Arc<Regionals>,
}

async fn members(url: &str, clock: &Arc<MonotonicClock>, timeout: Duration) -> Vec<Member> {
    let mut members = Vec::new();
    for name in ["a", "b", "c"] {
        let global = connect(url, timeout).await;
        let options = Options {
            interval: INTERVAL,
            ..Options::default()
        };
        members.push(Member {
            shares: Arc::new(Regional::new(
                Arc::clone(&global),
                global,
                Arc::clone(clock),
                name,
                options,
            )),
            regional: Arc::new(LocalStore::new(Arc::clone(clock))),
        });
    }
    members
}

async fn check_one(member: &Member, key: &str, limit: &Limit) -> Result<Decision, Error> {
    let takes = [Take::new(key, limit, 1)];
    let request = CheckRequest {
        takes: &takes,
        request_id: None,
        now: None,
    };
    let decisions = member
        .shares
        .over(&*member.regional, &global_scope)
        .check(request)
        .await?;
    Ok(decisions[0])
}

/// A process's rounds, every [`INTERVAL`] until `stop`: the rounds' figures summed.
fn rebalancer(shares: Arc<Process>, stop: Arc<AtomicBool>) -> JoinHandle<Round> {
    tokio::spawn(async move {
        let mut total = Round::default();
        while !stop.load(Ordering::Relaxed) {
            let round = shares.rebalance().await;
            total.keys = total.keys.max(round.keys);
            total.fetched += round.fetched;
            total.given_back += round.given_back;
            total.failed += round.failed;
            tokio::time::sleep(INTERVAL).await;
        }
        total
    })
}

/// What one task's requests came to.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    allowed: u64,
    refused: u64,
    failed: u64,
}

/// Requests of cost 1 on `key`, one after the other, until `until` or `most` were sent.
fn hammer(
    member: &Member,
    clock: &Arc<MonotonicClock>,
    key: &str,
    limit: Limit,
    until: Timestamp,
    most: u64,
) -> JoinHandle<Tally> {
    let member = Member {
        shares: Arc::clone(&member.shares),
        regional: Arc::clone(&member.regional),
    };
    let clock = Arc::clone(clock);
    let key = key.to_owned();
    tokio::spawn(async move {
        let mut tally = Tally::default();
        let mut sent = 0;
        while sent < most && clock.now() < until {
            sent += 1;
            match check_one(&member, &key, &limit).await {
                Ok(decision) if decision.allowed() => tally.allowed += 1,
                Ok(_) => {
                    tally.refused += 1;
                    // A short reservoir answers at once: leave the others some room.
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Err(_) => tally.failed += 1,
            }
            tokio::task::yield_now().await;
        }
        tally
    })
}

/// The most a bucket of `limit` admits over `elapsed`: its capacity and its refill, rounded up.
fn bound(limit: &Limit, elapsed: Duration) -> u64 {
    let rate = limit.refill();
    let refill =
        (u128::from(rate.amount()) * elapsed.as_nanos()).div_ceil(rate.period().as_nanos().max(1));
    limit.capacity() + u64::try_from(refill).unwrap()
}

/// Three processes on the store at `url`, each with a rebalancer and [`TASKS`] tasks split
/// over `keys`, for `run`: per key and process, what was admitted; and the time from before
/// the first request to after the last.
async fn hammer_all(
    url: &str,
    keys: &[&str],
    limit: Limit,
    run: Duration,
) -> (Vec<Vec<Tally>>, Duration) {
    let clock = Arc::new(MonotonicClock::new());
    let members = members(url, &clock, LOADED).await;
    let stop = Arc::new(AtomicBool::new(false));
    let start = clock.now();
    let until = start + run;
    let rounds: Vec<_> = members
        .iter()
        .map(|m| rebalancer(Arc::clone(&m.shares), Arc::clone(&stop)))
        .collect();
    let mut tasks = Vec::new();
    for (p, member) in members.iter().enumerate() {
        for t in 0..TASKS {
            let k = t % keys.len();
            tasks.push((
                p,
                k,
                hammer(member, &clock, keys[k], limit, until, u64::MAX),
            ));
        }
    }
    let mut tallies = vec![vec![Tally::default(); members.len()]; keys.len()];
    for (p, k, task) in tasks {
        let tally = task.await.unwrap();
        let sum = &mut tallies[k][p];
        sum.allowed += tally.allowed;
        sum.refused += tally.refused;
        sum.failed += tally.failed;
    }
    let elapsed = clock.now().saturating_duration_since(start);
    stop.store(true, Ordering::Relaxed);
    for (member, round) in members.iter().zip(rounds) {
        let round = round.await.unwrap();
        eprintln!(
            "rounds: {round:?}, totals (fetched, given back) {:?}, held {:?}",
            member.shares.totals(),
            member.shares.held()
        );
    }
    (tallies, elapsed)
}

/// Per key: all processes together within the bucket's bound, at least half of it, and every
/// process admitted some.
fn assert_within_bound(keys: &[&str], limit: &Limit, tallies: &[Vec<Tally>], elapsed: Duration) {
    let most = bound(limit, elapsed);
    for (key, per_process) in keys.iter().zip(tallies) {
        let admitted: u64 = per_process.iter().map(|t| t.allowed).sum();
        eprintln!("{key}: admitted {admitted} of at most {most} in {elapsed:?}: {per_process:?}");
        assert!(
            per_process.iter().all(|t| t.failed == 0),
            "{key}: no request is unavailable with Redis up: {per_process:?}"
        );
        assert!(
            admitted <= most,
            "{key}: admitted {admitted}, more than the bucket's {most} in {elapsed:?}"
        );
        assert!(
            admitted * 2 >= most,
            "{key}: admitted {admitted}, less than half the bucket's {most} in {elapsed:?}"
        );
        assert!(
            per_process.iter().all(|t| t.allowed > 0),
            "{key}: a process was shut out: {per_process:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_on_one_redis_never_admit_more_than_the_global_bucket() {
    let server = RedisServer::start();
    let limit = limit(30, "50/s");
    let keys = ["g:tenant"];
    let (tallies, elapsed) =
        hammer_all(&server.url(), &keys, limit, Duration::from_millis(1500)).await;
    assert_within_bound(&keys, &limit, &tallies, elapsed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_on_a_redis_cluster_never_admit_more_than_the_global_buckets() {
    let cluster = RedisCluster::start();
    let limit = limit(30, "50/s");
    // Two buckets in two slots (two nodes, as the cluster splits its slots in three).
    let keys = ["g:{a}", "g:{b}"];
    let slots: Vec<String> = keys
        .iter()
        .map(|key| {
            let reply = command(
                cluster.nodes[0].port,
                &["CLUSTER", "KEYSLOT", &format!("tollgate:{key}")],
            );
            reply.expect("a slot").trim().to_owned()
        })
        .collect();
    assert_ne!(slots[0], slots[1], "the keys share a slot: {slots:?}");
    let (tallies, elapsed) =
        hammer_all(&cluster.url(), &keys, limit, Duration::from_millis(1500)).await;
    assert_within_bound(&keys, &limit, &tallies, elapsed);
}

/// What `key`'s bucket holds on `store`, read without charging.
async fn balance(store: &RedisStore, key: &str, limit: &Limit) -> u64 {
    let takes = [Take::new(key, limit, 1)];
    let request = CheckRequest {
        takes: &takes,
        request_id: None,
        now: None,
    };
    let decision = store.peek(request).await.expect("peek")[0];
    // A peek shows what would remain after taking its one token.
    decision.remaining() + u64::from(decision.allowed())
}

/// The board on Redis shows each process the others' wants, never its own, until they leave.
#[tokio::test]
async fn the_redis_board_shows_each_process_the_others_wants() {
    let server = RedisServer::start();
    let board = connect(&server.url(), LOADED).await;
    let post = |who: &'static str, tokens: u64| {
        let board = Arc::clone(&board);
        async move {
            tollgate_regional::Board::post(&*board, "g:acme", who, tokens, Duration::from_secs(10))
                .await
                .expect("post")
        }
    };
    assert_eq!(post("a", 5).await, Vec::<u64>::new());
    assert_eq!(post("b", 7).await, [5]);
    assert_eq!(post("a", 6).await, [7]);
    let mut seen = post("c", 1).await;
    seen.sort_unstable();
    assert_eq!(seen, [6, 7]);
    // Leaving: the others' wants, without its own.
    assert_eq!(post("a", 0).await, [7, 1]);
    assert_eq!(post("b", 0).await, [1]);
}

/// Every token a reservoir holds goes back at the end, whichever of its charges bought it:
/// failed about one run in four while a reservoir remembered only its last charge (two
/// requests' fetches in flight at once, or a top-up before the last charge's tokens were spent,
/// left tokens charged for good).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_give_back_at_the_end_returns_what_reservoirs_hold() {
    let server = RedisServer::start();
    let clock = Arc::new(MonotonicClock::new());
    let members = members(&server.url(), &clock, LOADED).await;
    // As good as no refill over the test: the bucket's balance is the capacity less the
    // tokens charged and not given back.
    let limit = limit(500, "1/d");
    let key = "g:slow";
    let stop = Arc::new(AtomicBool::new(false));
    let rounds: Vec<_> = members
        .iter()
        .map(|m| rebalancer(Arc::clone(&m.shares), Arc::clone(&stop)))
        .collect();
    // Fewer requests than the bucket holds, so reservoirs still hold tokens at the end.
    let until = clock.now() + Duration::from_secs(1);
    let tasks: Vec<_> = members
        .iter()
        .flat_map(|m| (0..TASKS).map(|_| hammer(m, &clock, key, limit, until, 12)))
        .collect();
    let mut tally = Tally::default();
    for task in tasks {
        let t = task.await.unwrap();
        tally.allowed += t.allowed;
        tally.refused += t.refused;
        tally.failed += t.failed;
    }
    stop.store(true, Ordering::Relaxed);
    for round in rounds {
        round.await.unwrap();
    }
    let held: u64 = members.iter().map(|m| m.shares.held().1).sum();
    let before = balance(members[0].shares.global(), key, &limit).await;
    let mut given_back = 0;
    for member in &members {
        given_back += member.shares.give_back_all().await;
    }
    let after = balance(members[0].shares.global(), key, &limit).await;
    let totals: Vec<_> = members.iter().map(|m| m.shares.totals()).collect();
    eprintln!(
        "{tally:?}; held {held} at the end, bucket {before} before the give-back, \
         {after} after ({given_back} given back); (fetched, given back) per process {totals:?}"
    );
    assert_eq!(tally.failed, 0);
    assert!(tally.allowed > 0);
    assert!(
        members.iter().all(|m| m.shares.held() == (0, 0)),
        "nothing is held after the give-back"
    );
    assert_eq!(
        after,
        500 - tally.allowed,
        "the bucket holds all but what was admitted: {held} were held, {given_back} given back"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_paused_a_process_spends_its_reservoir_then_reports_unavailable() {
    let server = RedisServer::start();
    let clock = Arc::new(MonotonicClock::new());
    let timeout = Duration::from_millis(200);
    let members = members(&server.url(), &clock, timeout).await;
    let member = &members[0];
    let limit = limit(100, "100/s");
    let key = "g:paused";
    let start = clock.now();

    // Traffic while Redis is up.
    let stop = Arc::new(AtomicBool::new(false));
    let round = rebalancer(Arc::clone(&member.shares), Arc::clone(&stop));
    let until = clock.now() + Duration::from_millis(300);
    let tasks: Vec<_> = (0..4)
        .map(|_| hammer(member, &clock, key, limit, until, u64::MAX))
        .collect();
    let mut admitted = 0;
    for task in tasks {
        let tally = task.await.unwrap();
        assert_eq!(tally.failed, 0, "{tally:?}");
        admitted += tally.allowed;
    }
    stop.store(true, Ordering::Relaxed);
    round.await.unwrap();
    // A round after the bucket refilled a little tops the reservoir up for what follows.
    tokio::time::sleep(Duration::from_millis(150)).await;
    member.shares.rebalance().await;
    let (_, held) = member.shares.held();
    let (fetched, _) = member.shares.totals();
    assert!(held > 0, "the reservoir holds tokens to spend");

    server.pause();
    let resume = Resume(&server);
    // Requests at once while Redis answers nothing: what is held, then unavailable.
    let per_task = held.div_ceil(4) + 3;
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let member = Member {
                shares: Arc::clone(&member.shares),
                regional: Arc::clone(&member.regional),
            };
            let clock = Arc::clone(&clock);
            tokio::spawn(async move {
                let mut outcomes = Vec::new();
                for _ in 0..per_task {
                    let sent = clock.now();
                    let result = check_one(&member, key, &limit).await;
                    outcomes.push((result, clock.now().saturating_duration_since(sent)));
                }
                outcomes
            })
        })
        .collect();
    let mut allowed = 0;
    let mut unavailable = 0;
    let mut longest_wait = Duration::ZERO;
    let mut slowest = Duration::ZERO;
    for task in tasks {
        let outcomes = task.await.unwrap();
        // Each task spends what it finds, and once the reservoir is dry, nothing more.
        let dry = outcomes
            .iter()
            .position(|(r, _)| !matches!(r, Ok(d) if d.allowed()))
            .unwrap_or(outcomes.len());
        for (result, took) in &outcomes[dry..] {
            match result {
                Err(Error::StoreUnavailable { .. }) => unavailable += 1,
                // The global bucket was empty when last asked (a busy host's slow rounds):
                // rejected with its wait, without asking the paused Redis.
                Ok(decision) if !decision.allowed() => {
                    longest_wait = longest_wait.max(decision.retry_after().unwrap_or_default());
                }
                other => panic!("a dry reservoir with Redis paused admitted {other:?}"),
            }
            slowest = slowest.max(*took);
        }
        for (_, took) in &outcomes[..dry] {
            slowest = slowest.max(*took);
        }
        allowed += dry as u64;
    }
    if unavailable == 0 {
        // Every request after the dry point fell within the empty bucket's wait: past it, a
        // request asks Redis, and finds it unavailable.
        tokio::time::sleep(longest_wait + Duration::from_millis(10)).await;
        let sent = clock.now();
        let result = check_one(member, key, &limit).await;
        slowest = slowest.max(clock.now().saturating_duration_since(sent));
        assert!(
            matches!(result, Err(Error::StoreUnavailable { .. })),
            "past the wait, a dry reservoir with Redis paused is unavailable, not {result:?}"
        );
        unavailable += 1;
    }
    let sent = clock.now();
    let paused_round = member.shares.rebalance().await;
    let round_took = clock.now().saturating_duration_since(sent);
    eprintln!(
        "held {held} when Redis paused: {allowed} allowed, {unavailable} unavailable, \
         slowest request {slowest:?}; a round took {round_took:?}: {paused_round:?}"
    );
    assert_eq!(allowed, held, "exactly what the reservoir held is spent");
    assert_eq!(
        member.shares.totals().0,
        fetched,
        "nothing fetched while Redis was paused"
    );
    assert!(unavailable > 0);
    // One call to Redis at most per request, and per key in a round, each bounded by the
    // timeout; the margin is for a busy host.
    let bounded = timeout + Duration::from_millis(300);
    assert!(slowest <= bounded, "a request took {slowest:?}");
    assert!(round_took <= bounded, "a round took {round_took:?}");
    assert!(paused_round.failed > 0, "{paused_round:?}");
    admitted += allowed;

    drop(resume);
    // Back: a round restores the reservoir and requests are decided again. The breaker can
    // hold calls back for its cool-down (at most 2 s) after the failures.
    let recovery = clock.now();
    let recovered = loop {
        member.shares.rebalance().await;
        match check_one(member, key, &limit).await {
            Ok(decision) if decision.allowed() => break true,
            _ if clock.now().saturating_duration_since(recovery) > Duration::from_secs(3) => {
                break false;
            }
            _ => tokio::time::sleep(INTERVAL).await,
        }
    };
    let took = clock.now().saturating_duration_since(recovery);
    assert!(recovered, "requests are decided again after Redis is back");
    admitted += 1;
    let elapsed = clock.now().saturating_duration_since(start);
    let most = bound(&limit, elapsed);
    eprintln!("recovered in {took:?}; admitted {admitted} of at most {most} in {elapsed:?}");
    assert!(admitted <= most, "admitted {admitted} of at most {most}");
}

/// Thaws a paused server when dropped, a failed assertion included, so nothing waits on it.
struct Resume<'a>(&'a RedisServer);

impl Drop for Resume<'_> {
    fn drop(&mut self) {
        self.0.resume();
    }
}
