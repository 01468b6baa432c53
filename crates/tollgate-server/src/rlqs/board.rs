//! Fair shares across tollgate processes: Envoys of one bucket connect to whichever process
//! their load balancer picks, and each process only sees its own.
//!
//! Left alone, every process would size its Envoys' assignments as if it served the bucket
//! alone, and the processes would meet in the store first come, first served: the Envoys of
//! the first to pay keep their rates by extending them, the others get what is left. So on a
//! shared store each process posts, every [`POST_EVERY`], what its Envoys want of each bucket
//! together, on the store's board of wants (the one global limits use), and reads back what
//! the other processes want. A process's share of a bucket's refill is then a max-min fair
//! share among the processes, which its streams split the same way ([`super::payer`]).
//!
//! Nothing on the board is a promise: every assignment is still paid for in the store before
//! it is sent. A stale or missing post makes shares less fair for a second or two, never lets
//! an Envoy admit what was not paid for.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::{Semaphore, watch};
use tollgate_redis::MAX_WANT_TOKENS;
use tollgate_regional::board::Board as _;

use super::message::Entries;
use super::payer::Demands;
use crate::decider::{Backend, Decider};

/// How often a process posts its wants.
pub(super) const POST_EVERY: Duration = Duration::from_secs(1);

/// How long a post stands: a process that stops posting (it stopped, or its Envoys left)
/// drops out of the others' shares within this.
const POST_TTL: Duration = Duration::from_secs(3);

/// The board key of a bucket: its domain and entries, each prefixed with its length, so no
/// two buckets share one whatever bytes they hold.
fn key(domain: &str, entries: &Entries) -> String {
    let mut key = format!("rlqs:{}:{domain}", domain.len());
    for (name, value) in entries {
        key.push_str(&format!(":{}:{name}:{}:{value}", name.len(), value.len()));
    }
    key
}

/// Posts this process's wants every [`POST_EVERY`] and records the others', until `stopped`
/// turns true. Does nothing on the memory store, which no other process shares.
pub(super) async fn post_wants(
    decider: Arc<Decider>,
    demands: Arc<Demands>,
    in_flight: Arc<Semaphore>,
    nonce: u64,
    mut stopped: watch::Receiver<bool>,
) {
    let Backend::Redis(store) = decider.backend() else {
        return;
    };
    let participant = format!("rlqs-{nonce:016x}");
    // A failing post is said once until posts succeed again: Redis down is logged by the
    // decisions; a user without the board's commands is not.
    let failing = std::sync::atomic::AtomicBool::new(false);
    let mut rounds = tokio::time::interval(POST_EVERY);
    rounds.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = rounds.tick() => {}
            changed = stopped.changed() => {
                if changed.is_err() || *stopped.borrow() {
                    return;
                }
                continue;
            }
        }
        let posts = demands.totals().into_iter().map(|(domain, entries, want)| {
            let (participant, in_flight, demands, failing) =
                (&participant, &in_flight, &demands, &failing);
            async move {
                // Posts share the RLQS service's bound on store calls with its payments.
                let Ok(_permit) = in_flight.acquire().await else {
                    return;
                };
                let key = key(&domain, &entries);
                // A want of 0 would take this process off the board: it still has Envoys.
                let tokens = want.clamp(1, MAX_WANT_TOKENS);
                match store.post(&key, participant, tokens, POST_TTL).await {
                    Ok(elsewhere) => {
                        failing.store(false, Ordering::Relaxed);
                        demands.set_elsewhere(&domain, &entries, elsewhere);
                    }
                    Err(err) if !failing.swap(true, Ordering::Relaxed) => {
                        tracing::warn!(
                            domain = &*domain,
                            error = %err,
                            "RLQS wants could not be posted on the store's board: until they \
                             can, each server shares buckets among its own Envoys only"
                        );
                    }
                    Err(err) => {
                        tracing::debug!(domain = &*domain, error = %err, "RLQS wants could not be posted");
                    }
                }
            }
        });
        futures_util::future::join_all(posts).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_tell_every_bucket_apart() {
        let entries = |pairs: &[(&str, &str)]| -> Entries {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        assert_eq!(key("edge", &entries(&[("a", "b")])), "rlqs:4:edge:1:a:1:b");
        assert_ne!(
            key("edge", &entries(&[("a", "b:1:c")])),
            key("edge", &entries(&[("a", "b"), ("c", "")])),
        );
        assert_ne!(key("e:1", &entries(&[])), key("e", &entries(&[("1", "")])));
    }
}
