//! Checks with a request id that charged a reservoir, so that a retry is answered from here
//! and charges nothing again, and a reservation's settlement gives its tokens back once.
//!
//! The global store's own records cannot do it: a reservoir's tokens were charged there long
//! before, under the reservoir's request ids, not the client's. Bounded like the stores'
//! records: by a window, and by a count (the oldest go first).

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use tollgate::{Decision, Error, Timestamp};

/// How long a charged request is remembered: as long as the memory store remembers one.
pub const WINDOW: Duration = Duration::from_secs(60);

/// Records kept at most.
pub const MAX_RECORDS: usize = 100_000;

/// One charged request, as first decided.
#[derive(Debug, Clone)]
pub(crate) struct Record {
    /// What was asked (keys and costs): the same id asking something else is a client bug.
    pub(crate) content: u64,
    /// The decisions answered, in the order of the takes.
    pub(crate) decisions: Vec<Decision>,
    /// The refunds a settlement gave, once settled.
    pub(crate) settled: Option<Vec<u64>>,
    expires_at: Timestamp,
}

/// The records, oldest first.
#[derive(Default)]
pub(crate) struct Recent {
    records: HashMap<Box<str>, Record>,
    order: VecDeque<(Timestamp, Box<str>)>,
}

impl Recent {
    /// The record of `id`, if live; a conflict if it was made for other content.
    pub(crate) fn get(
        &mut self,
        id: &str,
        content: u64,
        now: Timestamp,
    ) -> Result<Option<&mut Record>, Error> {
        self.expire(now);
        match self.records.get_mut(id) {
            Some(record) if record.content != content => Err(Error::IdempotencyConflict),
            other => Ok(other),
        }
    }

    /// Remembers that `id` was charged and answered `decisions`.
    pub(crate) fn insert(
        &mut self,
        id: &str,
        content: u64,
        decisions: Vec<Decision>,
        now: Timestamp,
    ) {
        self.expire(now);
        while self.records.len() >= MAX_RECORDS {
            let Some((_, oldest)) = self.order.pop_front() else {
                break;
            };
            self.records.remove(&oldest);
        }
        let expires_at = now + WINDOW;
        self.records.insert(
            id.into(),
            Record {
                content,
                decisions,
                settled: None,
                expires_at,
            },
        );
        self.order.push_back((expires_at, id.into()));
    }

    fn expire(&mut self, now: Timestamp) {
        while let Some((expires_at, _)) = self.order.front() {
            if *expires_at > now {
                break;
            }
            if let Some((expires_at, id)) = self.order.pop_front() {
                // A record re-made under the same id later has a later end: keep it.
                if self
                    .records
                    .get(&id)
                    .is_some_and(|r| r.expires_at <= expires_at)
                {
                    self.records.remove(&id);
                }
            }
        }
    }
}

/// A fingerprint of what a request asks: its keys and costs (FNV-1a; only compared within
/// this process).
pub(crate) fn content<'a>(takes: impl IntoIterator<Item = (&'a str, u64)>) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            hash ^= u64::from(b);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    for (key, cost) in takes {
        eat(&(key.len() as u64).to_le_bytes());
        eat(key.as_bytes());
        eat(&cost.to_le_bytes());
    }
    hash
}

#[cfg(test)]
mod tests {
    use tollgate::Limit;

    use super::*;

    fn decision() -> Decision {
        let limit = Limit::new(5, "1/s".parse().unwrap()).unwrap();
        Decision::from_window(true, limit, 1, 4, Duration::ZERO, Duration::ZERO)
    }

    #[test]
    fn records_expire_and_conflict() {
        let mut recent = Recent::default();
        let t0 = Timestamp::ZERO;
        let a = content([("k", 1)]);
        assert_ne!(a, content([("k", 2)]));
        assert_ne!(
            content([("ab", 1), ("c", 1)]),
            content([("a", 1), ("bc", 1)])
        );
        recent.insert("r1", a, vec![decision()], t0);
        assert!(recent.get("r1", a, t0).unwrap().is_some());
        assert!(matches!(
            recent.get("r1", a ^ 1, t0),
            Err(Error::IdempotencyConflict)
        ));
        assert!(recent.get("r1", a, t0 + WINDOW).unwrap().is_none());
        assert!(recent.records.is_empty() && recent.order.is_empty());
    }

    /// Records live side by side up to the bound; past it, the oldest make room.
    #[test]
    fn records_are_bounded_oldest_first() {
        let mut recent = Recent::default();
        let t0 = Timestamp::ZERO;
        let a = content([("k", 1)]);
        for i in 0..=MAX_RECORDS {
            recent.insert(&format!("r{i}"), a, vec![decision()], t0);
            if i == 1 {
                assert!(recent.get("r0", a, t0).unwrap().is_some());
            }
        }
        assert_eq!(recent.records.len(), MAX_RECORDS);
        assert!(recent.get("r0", a, t0).unwrap().is_none());
        assert!(recent.get("r1", a, t0).unwrap().is_some());
        assert!(
            recent
                .get(&format!("r{MAX_RECORDS}"), a, t0)
                .unwrap()
                .is_some()
        );
    }
}
