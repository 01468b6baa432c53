//! Where the processes sharing a global limit say what they want of it, so each can work out
//! a fair share without a coordinator.
//!
//! Every process posts its want for each key it holds a reservoir of, once a round, with a
//! time-to-live of a few rounds, and reads the others' back in the same call. A process that
//! stops posting (it left, or lost the global store) drops out when its entry expires. Nothing
//! on the board is a promise: a stale or missing entry makes shares less fair for a round or
//! two, never lets anyone spend a token the global store did not charge.

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use parking_lot::Mutex;
use tollgate::{Clock, Error, Timestamp};
use tollgate_redis::RedisStore;

/// A board of wants per key.
pub trait Board: Send + Sync {
    /// Records that `participant` wants `tokens` of `key` for the next `ttl`, and returns the
    /// wants of every other participant still live. `tokens == 0` takes the participant off.
    ///
    /// # Errors
    ///
    /// [`Error::StoreUnavailable`] when the board cannot be reached.
    fn post(
        &self,
        key: &str,
        participant: &str,
        tokens: u64,
        ttl: Duration,
    ) -> impl Future<Output = Result<Vec<u64>, Error>> + Send;
}

impl<B: Board + ?Sized> Board for &B {
    fn post(
        &self,
        key: &str,
        participant: &str,
        tokens: u64,
        ttl: Duration,
    ) -> impl Future<Output = Result<Vec<u64>, Error>> + Send {
        (**self).post(key, participant, tokens, ttl)
    }
}

impl<B: Board + ?Sized> Board for std::sync::Arc<B> {
    fn post(
        &self,
        key: &str,
        participant: &str,
        tokens: u64,
        ttl: Duration,
    ) -> impl Future<Output = Result<Vec<u64>, Error>> + Send {
        (**self).post(key, participant, tokens, ttl)
    }
}

/// A board in this process: for tests, and for processes that share a global store only with
/// each other in one process (a library embedding several regions' limiters).
pub struct MemoryBoard<C> {
    clock: C,
    wants: Mutex<HashMap<Box<str>, Posts>>,
}

/// One key's posts: participant → (want, expires at).
type Posts = HashMap<Box<str>, (u64, Timestamp)>;

impl<C: Clock> MemoryBoard<C> {
    /// An empty board timed by `clock`.
    pub fn new(clock: C) -> Self {
        Self {
            clock,
            wants: Mutex::new(HashMap::new()),
        }
    }
}

impl<C: Clock> Board for MemoryBoard<C> {
    async fn post(
        &self,
        key: &str,
        participant: &str,
        tokens: u64,
        ttl: Duration,
    ) -> Result<Vec<u64>, Error> {
        let now = self.clock.now();
        let mut wants = self.wants.lock();
        let of_key = wants.entry(key.into()).or_default();
        of_key.retain(|_, &mut (_, expires)| expires > now);
        if tokens == 0 {
            of_key.remove(participant);
        } else {
            of_key.insert(participant.into(), (tokens, now + ttl));
        }
        let others = of_key
            .iter()
            .filter(|&(who, _)| &**who != participant)
            .map(|(_, &(want, _))| want)
            .collect();
        if of_key.is_empty() {
            wants.remove(key);
        }
        Ok(others)
    }
}

impl Board for RedisStore {
    async fn post(
        &self,
        key: &str,
        participant: &str,
        tokens: u64,
        ttl: Duration,
    ) -> Result<Vec<u64>, Error> {
        let wants = self.post_want(key, participant, tokens, ttl).await?;
        Ok(wants
            .into_iter()
            .filter(|want| want.participant != participant)
            .map(|want| want.tokens)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use tollgate::{ManualClock, block_on_ready};

    use super::*;

    #[test]
    fn wants_are_seen_by_others_until_they_expire() {
        let clock = ManualClock::new();
        let board = MemoryBoard::new(&clock);
        let second = Duration::from_secs(1);
        assert_eq!(block_on_ready(board.post("k", "a", 5, second)), Ok(vec![]));
        assert_eq!(block_on_ready(board.post("k", "b", 7, second)), Ok(vec![5]));
        assert_eq!(
            block_on_ready(board.post("other", "b", 7, second)),
            Ok(vec![])
        );
        clock.advance(second);
        assert_eq!(block_on_ready(board.post("k", "b", 7, second)), Ok(vec![]));
        assert_eq!(block_on_ready(board.post("k", "a", 0, second)), Ok(vec![7]));
        assert_eq!(block_on_ready(board.post("k", "b", 0, second)), Ok(vec![]));
        assert!(
            board.wants.lock().get("k").is_none(),
            "an empty key is dropped"
        );
    }
}
