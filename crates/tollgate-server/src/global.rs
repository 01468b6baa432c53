//! The server's half of global limits (`scope: global`): the global store, the shares this
//! process holds of it, and the rounds that rebalance them in the background.
//!
//! The decisions themselves are [`tollgate_regional`]'s: [`Decider`](crate::decider::Decider)
//! hands a request's global takes to the shares and the rest to the regional store
//! (`--store`), all or nothing. What lives here is the process's side: connecting to the
//! global store, naming this process on the board, running a round every interval and
//! recording what it did, and giving every reservoir back when the process stops.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tollgate::{Clock, MonotonicClock};
use tollgate_redis::RedisStore;
use tollgate_regional::{Options, Regional};

use crate::metrics;

/// The shares of a process: on a global Redis, which is also the board.
pub type Shares = Regional<Arc<RedisStore>, Arc<RedisStore>, MonotonicClock>;

/// This process's shares of the limits on `global`, posted on the board as `region` and a
/// random number (unique among the processes of every region).
pub fn shares(global: RedisStore, region: &str, options: Options) -> Shares {
    let global = Arc::new(global);
    let participant = format!("{region}-{:016x}", rand::random::<u64>());
    Regional::new(
        Arc::clone(&global),
        global,
        MonotonicClock::new(),
        &participant,
        options,
    )
}

/// Runs a round every interval until `stopped`, then gives back what every reservoir holds,
/// so the other processes can spend it at once.
pub async fn rebalance(shares: Arc<Shares>, mut stopped: watch::Receiver<bool>) {
    let clock = MonotonicClock::new();
    let mut every = tokio::time::interval(shares.options().interval);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = every.tick() => {}
            _ = stopped.changed() => break,
        }
        if *stopped.borrow() {
            break;
        }
        let started = clock.now();
        let round = shares.rebalance().await;
        let took = clock.now().saturating_duration_since(started);
        metrics::record_global_round(&shares, &round, took);
        if round.failed > 0 {
            tracing::warn!(
                failed = round.failed,
                keys = round.keys,
                "the global store did not answer part of a rebalancing round; reservoirs keep \
                 what they hold"
            );
        }
    }
    let given = tokio::time::timeout(Duration::from_secs(5), shares.give_back_all()).await;
    match given {
        Ok(tokens) if tokens > 0 => {
            tracing::info!(tokens, "gave back the global limits' unspent reservoirs");
        }
        Ok(_) => {}
        Err(_) => tracing::warn!("the global store did not take the reservoirs back in 5 s"),
    }
}
