//! Global limits for tollgate deployed in several regions: one quota for all of them, decided
//! in each region without a request ever waiting on another region.
//!
//! A platform running tollgate in several regions keeps each region's buckets on a store near
//! it (`--store`): a call there takes a millisecond, a call to another continent a hundred.
//! Most limits are regional anyway (per user, per route, where the user is served). Some are
//! not: a tenant's contract of 10,000 requests a minute worldwide. Deciding those on one
//! global store puts a cross-region round trip on every request, and a partition between
//! regions fails them all. Replicating counters between regions, as some rate limiters do,
//! admits more than the limit while the replicas disagree.
//!
//! Here each process holds a **reservoir** per global key: tokens it has already been charged
//! for on the global store, in batches. A request spends from the reservoir in this process,
//! exactly and at once; only a key's first request, and a burst that empties a reservoir while
//! the global bucket has tokens, wait for a fetch from the global store. In the background, every round ([`Options::interval`]), the process
//! tops each reservoir up to a **level**, or gives back what it holds beyond it:
//!
//! * its **want**: the tokens it spent or turned away over the last round, scaled to two
//!   rounds, plus a quarter ([`share::want`]);
//! * its **fair share**: each process posts its want on a [`Board`] (on the global store) and
//!   reads the others'; the limit's refill over two rounds is split max-min fair among them
//!   ([`share::fair_share`]), and never above the capacity. So a region whose traffic grows
//!   gets more of the quota within a round or two, and one that goes quiet gives its tokens
//!   back.
//!
//! The global bucket itself decides every top-up, with its own exact arithmetic: when the
//! processes together want more than the limit, top-ups find it empty and reservoirs stay
//! short. See [`regional`] for the invariant: no process ever admits a token the global store
//! did not charge it, so all regions together never admit more than the limit; what sits in
//! reservoirs is the price, a bounded under-admission.
//!
//! When the global store cannot be reached, each process goes on spending what it holds, and
//! then a global take is unavailable, so the limit's failure mode applies, as for any store.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::{CheckRequest, Limit, LocalStore, ManualClock, Store, Take, block_on_ready};
//! use tollgate_regional::{MemoryBoard, Options, Regional};
//!
//! let clock = ManualClock::new();
//! // The global store (Redis in production), and two regions' processes sharing it.
//! let global = LocalStore::new(&clock);
//! let board = MemoryBoard::new(&clock);
//! let eu = Regional::new(&global, &board, &clock, "eu-1", Options::default());
//! let us = Regional::new(&global, &board, &clock, "us-1", Options::default());
//! let regional = LocalStore::new(&clock);
//! let global_keys = |key: &str| key.starts_with("tenant:");
//!
//! let limit = Limit::new(100, "10/s".parse()?)?;
//! let takes = [Take::new("tenant:acme", &limit, 1)];
//! let request = CheckRequest { takes: &takes, request_id: None, now: None };
//! // Each region's first request fetches a few tokens; the next are spent locally.
//! assert!(block_on_ready(eu.over(&regional, &global_keys).check(request))?[0].allowed());
//! assert!(block_on_ready(us.over(&regional, &global_keys).check(request))?[0].allowed());
//! clock.advance(Duration::from_secs(1));
//! block_on_ready(eu.rebalance());
//! block_on_ready(us.rebalance());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod board;
pub mod recent;
pub mod regional;
pub mod share;

pub use board::{Board, MemoryBoard};
pub use regional::{Options, Over, Regional, Round};
