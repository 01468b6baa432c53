//! The throwaway servers of `src/test_server.rs`, compiled into the tests directly (a crate's
//! tests cannot turn on its own features).

#[allow(dead_code, unreachable_pub)]
#[path = "../../src/test_server.rs"]
mod test_server;

#[allow(unused_imports)]
pub(crate) use test_server::*;
