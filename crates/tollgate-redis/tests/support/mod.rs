//! The throwaway servers of `src/test_server.rs`, compiled into the tests directly (a crate's
//! tests cannot turn on its own features).

#[allow(dead_code, unreachable_pub)]
#[path = "../../src/test_server.rs"]
mod test_server;

#[allow(unused_imports)]
pub(crate) use test_server::*;

use tollgate::{CheckRequest, Decision, Error, Limit, Store, Take, Timestamp};

/// Checks one unit of `limit` on `key` at `now` (Redis' own time when `None`).
#[allow(dead_code)] // not every test binary uses it
pub(crate) async fn take_one_unit(
    store: &impl Store,
    key: &str,
    limit: &Limit,
    now: Option<Timestamp>,
) -> Result<Vec<Decision>, Error> {
    let takes = [Take::new(key, limit, 1)];
    store
        .check(CheckRequest {
            takes: &takes,
            request_id: None,
            now,
        })
        .await
}
