//! What the Redis load generators share: a throwaway `redis-server`, tollgate's store and a raw
//! connection on it, the quota and the keys, so that `redis-load` (rates), `redis-client-cost`
//! (instructions) and the limitador comparison (`limitador/`) measure the same thing.

use std::sync::Arc;
use std::time::Duration;

use redis::Script;
use redis::aio::ConnectionManager;
use tollgate::Limit;
use tollgate_redis::test_server::{RedisServer, command};
use tollgate_redis::{RedisConfig, RedisStore};

use crate::redis_load::{Run, measure, print_row_header, take_one};

/// Distinct keys the callers spread over in the random-key runs.
pub const REDIS_KEYS: u64 = 100_000;

/// A Redis server of its own with both clients on it.
pub struct RedisRig {
    /// Killed when the rig is dropped.
    pub server: RedisServer,
    /// tollgate's store: one multiplexed connection, batched script calls, Redis `TIME`.
    pub store: Arc<RedisStore>,
    /// A raw connection of the same kind, for `EVALSHA` of [`RedisRig::noop`].
    pub raw: ConnectionManager,
    /// `return 1`: the ceiling of one script call per decision.
    pub noop: Arc<Script>,
    /// A quota that admits nearly everything, so each decision is a full read-decide-write.
    pub limit: Limit,
    /// `bench:{0}` … one hash tag per key, as per-subject keys have.
    pub keys: Arc<Vec<String>>,
}

impl RedisRig {
    /// Starts the server and connects both clients.
    ///
    /// # Panics
    ///
    /// When `redis-server` cannot start or be reached: a benchmark has nothing to measure then.
    pub async fn start() -> Self {
        let server = RedisServer::start();
        // A generous timeout: this measures throughput, and a timeout would end the run.
        let config = RedisConfig::default().with_timeout(Duration::from_secs(1));
        let store = RedisStore::connect(&server.url(), config)
            .await
            .expect("connect");
        let client = redis::Client::open(server.url()).expect("client");
        let raw = ConnectionManager::new(client)
            .await
            .expect("raw connection");
        let limit =
            Limit::new(1_000_000_000, "1000000000/s".parse().expect("rate")).expect("limit");
        Self {
            server,
            store: Arc::new(store),
            raw,
            noop: Arc::new(Script::new("return 1")),
            limit,
            keys: Arc::new((0..REDIS_KEYS).map(|k| format!("bench:{{{k}}}")).collect()),
        }
    }

    /// tollgate's store under [`measure`]: `callers` callers, each decision one unit from the
    /// bucket of one of the rig's first `key_count` keys, for `seconds`.
    pub async fn measure_store(&self, callers: usize, key_count: u64, seconds: f64) -> Run {
        self.measure_limit(self.limit, callers, key_count, seconds)
            .await
    }

    /// The table of an operation beside plain decisions: on 1 key and on [`REDIS_KEYS`], at 1,
    /// 16 and 64 callers, a token-bucket decision and then `what`, each run from an empty
    /// database. `operation` makes, for each run, what a caller does with the key index it is
    /// given.
    pub async fn beside_decisions<F, Fut>(
        &self,
        seconds: f64,
        what: &str,
        operation: impl Fn() -> F,
    ) where
        F: Fn(u64) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let port = self.server.port;
        print_row_header();
        for key_count in [1, REDIS_KEYS] {
            for callers in [1usize, 16, 64] {
                command(port, &["FLUSHALL"]);
                let run = self.measure_store(callers, key_count, seconds).await;
                run.print_row(key_count, callers, "token-bucket decision");
                command(port, &["FLUSHALL"]);
                let run = measure(port, callers, key_count, seconds, operation()).await;
                run.print_row(key_count, callers, what);
            }
        }
    }

    /// [`RedisRig::measure_store`] with another quota (one that admits every decision of the
    /// run, such as a window of a billion a second).
    pub async fn measure_limit(
        &self,
        limit: Limit,
        callers: usize,
        key_count: u64,
        seconds: f64,
    ) -> Run {
        let (store, keys) = (self.store.clone(), self.keys.clone());
        measure(self.server.port, callers, key_count, seconds, move |k| {
            let (store, keys) = (store.clone(), keys.clone());
            async move { take_one(&store, &keys[k as usize], &limit).await }
        })
        .await
    }
}
