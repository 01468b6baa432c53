//! Records of charged checks, so that a retried request is not charged twice.
//!
//! Clients retry on timeouts without knowing whether the first attempt reached us. A check that
//! carries a `request_id` leaves a record here when it charges; a retry with the same id inside
//! the window finds it and gets the first decision back, charging nothing. A record is kept in a
//! shard chosen by its request id, locked together with the bucket's shard for the whole check,
//! so a retry racing the first attempt sees either nothing or the finished record, never a
//! half-made one; spreading by id keeps one busy key's records from crowding a single shard.
//!
//! Memory is bounded twice: records expire after the window, and each shard keeps at most a
//! fixed number (the oldest go first). Both expire in insertion order, so a queue finds them.
//!
//! Only charged (allowed) checks are recorded: a rejection charges nothing, so retrying it is
//! already harmless, and a client that waited out `Retry-After` must be evaluated afresh.

use std::collections::VecDeque;

use hashbrown::HashTable;

use crate::decision::Decision;
use crate::error::Error;

/// The longest `request_id` accepted, in bytes: ids are stored (and, in Redis, become part of a
/// key), so they are bounded like any other input.
pub const MAX_REQUEST_ID_BYTES: usize = 256;

/// Refuses empty and oversized request ids.
///
/// # Errors
///
/// [`Error::InvalidRequestId`].
pub fn check_request_id(id: &str) -> Result<(), Error> {
    if id.is_empty() || id.len() > MAX_REQUEST_ID_BYTES {
        return Err(Error::InvalidRequestId { len: id.len() });
    }
    Ok(())
}

/// The decisions a request got the first time.
#[derive(Debug, Clone)]
pub(crate) enum Recorded {
    One(Decision),
    Many(Box<[Decision]>),
}

#[derive(Debug)]
struct Record {
    /// Identifies the request: its id and first key, hashed to 128 bits.
    id: u128,
    /// Identifies what was asked (keys, limits, costs): a retry asking something else under the
    /// same id is a client bug, answered with [`Error::IdempotencyConflict`].
    content: u64,
    /// When the request was charged: a window gives a refund back only while it still counts
    /// that charge.
    charged_at: u64,
    expires_at: u64,
    decisions: Recorded,
    /// Once the request is settled, a fingerprint of what was given back: a retried
    /// settlement gives nothing twice.
    settled: Option<u64>,
}

/// What a settlement finds for a request.
#[derive(Debug, Clone)]
pub(crate) enum Settle {
    /// No live record: never charged, forgotten, or past the window. Nothing may be given back.
    Missing,
    /// Settled before with the same amounts: nothing more to give back.
    Repeated,
    /// Charged at this instant with these decisions, and now marked settled: give back.
    Charged(u64, Recorded),
}

/// One shard's records.
#[derive(Debug, Default)]
pub(crate) struct Records {
    by_id: HashTable<Record>,
    /// `(id, expires_at)` in insertion order, which is expiry order up to the skew of threads
    /// that read the clock before they lock: a record queued behind a later one is freed with it,
    /// a little past its window (`get` ignores it from its deadline on).
    queue: VecDeque<(u128, u64)>,
}

impl Records {
    /// The decisions recorded for `id`, if a live record exists.
    pub(crate) fn get(&self, id: u128, content: u64, now: u64) -> Option<Result<Recorded, Error>> {
        let record = self.by_id.find(id as u64, |r| r.id == id)?;
        if record.expires_at <= now {
            return None;
        }
        Some(if record.content == content {
            Ok(record.decisions.clone())
        } else {
            Err(Error::IdempotencyConflict)
        })
    }

    /// Marks `id`'s live record settled with `mark` (a fingerprint of the amounts given back).
    /// `content` says what the record must have been made for, from the kind of request it
    /// recorded (one bucket or several hash what was asked differently).
    ///
    /// # Errors
    ///
    /// [`Error::IdempotencyConflict`] when the record was made for another request, or settled
    /// with other amounts.
    pub(crate) fn settle(
        &mut self,
        id: u128,
        content: impl FnOnce(&Recorded) -> u64,
        now: u64,
        mark: u64,
    ) -> Result<Settle, Error> {
        let Some(record) = self.by_id.find_mut(id as u64, |r| r.id == id) else {
            return Ok(Settle::Missing);
        };
        if record.expires_at <= now {
            return Ok(Settle::Missing);
        }
        if record.content != content(&record.decisions) {
            return Err(Error::IdempotencyConflict);
        }
        match record.settled {
            Some(earlier) if earlier == mark => Ok(Settle::Repeated),
            Some(_) => Err(Error::IdempotencyConflict),
            None => {
                record.settled = Some(mark);
                Ok(Settle::Charged(record.charged_at, record.decisions.clone()))
            }
        }
    }

    /// Records `decisions` for `id` until `expires_at`, keeping at most `max` records.
    pub(crate) fn insert(
        &mut self,
        id: u128,
        content: u64,
        decisions: Recorded,
        now: u64,
        expires_at: u64,
        max: usize,
    ) {
        self.expire(now);
        while self.queue.len() >= max.max(1) {
            self.pop_oldest();
        }
        let record = Record {
            id,
            content,
            charged_at: now,
            expires_at,
            decisions,
            settled: None,
        };
        // An expired record under the same id may still be in the table: replace it.
        match self.by_id.entry(id as u64, |r| r.id == id, |r| r.id as u64) {
            hashbrown::hash_table::Entry::Occupied(mut entry) => *entry.get_mut() = record,
            hashbrown::hash_table::Entry::Vacant(entry) => {
                entry.insert(record);
            }
        }
        self.queue.push_back((id, expires_at));
    }

    fn expire(&mut self, now: u64) {
        while self.queue.front().is_some_and(|&(_, at)| at <= now) {
            self.pop_oldest();
        }
    }

    fn pop_oldest(&mut self) {
        if let Some((id, expires_at)) = self.queue.pop_front() {
            // Remove only the record this queue entry was made for: a newer one under the
            // same id has its own, later queue entry.
            if let Ok(entry) = self
                .by_id
                .find_entry(id as u64, |r| r.id == id && r.expires_at == expires_at)
            {
                entry.remove();
            }
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.by_id.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Limit, bucket};

    fn decision() -> Decision {
        let limit = Limit::per(5, std::time::Duration::from_secs(1)).unwrap();
        bucket::peek(&limit, None, crate::Timestamp::ZERO, 1).unwrap()
    }

    #[test]
    fn returns_live_records_and_refuses_conflicts() {
        let mut records = Records::default();
        records.insert(7, 1, Recorded::One(decision()), 0, 10, 4);
        assert!(matches!(records.get(7, 1, 9), Some(Ok(Recorded::One(_)))));
        assert!(matches!(
            records.get(7, 2, 9),
            Some(Err(Error::IdempotencyConflict))
        ));
        assert!(records.get(7, 1, 10).is_none(), "expired at its deadline");
        assert!(records.get(8, 1, 0).is_none());
    }

    #[test]
    fn keeps_at_most_max_records_and_expires_in_order() {
        let mut records = Records::default();
        for id in 0..10u128 {
            records.insert(id, 0, Recorded::One(decision()), 0, 100 + id as u64, 4);
        }
        assert_eq!(records.len(), 4);
        assert!(records.get(5, 0, 0).is_none());
        assert!(records.get(6, 0, 0).is_some());
        records.insert(20, 0, Recorded::One(decision()), 108, 200, 4);
        // 6 and 7 expired at 106 and 107; 8 expires at 108 too.
        assert_eq!(records.len(), 2);
    }

    #[test]
    fn a_record_is_settled_once() {
        let mut records = Records::default();
        records.insert(3, 1, Recorded::One(decision()), 5, 50, 4);
        assert!(matches!(
            records.settle(3, |_| 2, 6, 9),
            Err(Error::IdempotencyConflict)
        ));
        assert!(matches!(
            records.settle(3, |_| 1, 6, 9),
            Ok(Settle::Charged(5, Recorded::One(_)))
        ));
        assert!(matches!(
            records.settle(3, |_| 1, 7, 9),
            Ok(Settle::Repeated)
        ));
        assert!(matches!(
            records.settle(3, |_| 1, 7, 8),
            Err(Error::IdempotencyConflict)
        ));
        assert!(
            matches!(records.settle(3, |_| 1, 50, 9), Ok(Settle::Missing)),
            "expired"
        );
        assert!(matches!(
            records.settle(4, |_| 1, 6, 9),
            Ok(Settle::Missing)
        ));
        assert!(
            matches!(records.get(3, 1, 7), Some(Ok(Recorded::One(_)))),
            "a retried check still gets its first decision"
        );
    }

    #[test]
    fn a_reused_id_replaces_its_expired_record() {
        let mut records = Records::default();
        records.insert(1, 0, Recorded::One(decision()), 0, 10, 4);
        records.insert(1, 5, Recorded::One(decision()), 10, 20, 4);
        assert!(matches!(records.get(1, 5, 15), Some(Ok(_))));
        assert_eq!(records.len(), 1);
    }

    #[test]
    fn a_stale_queue_entry_leaves_its_ids_newer_record() {
        // Threads read the clock before they lock, so one may record at an instant before the
        // last record's: the queue is then out of expiry order, and the record 1 made at 50
        // outlives its queue entry's turn. Reused at 70, 1 gets a second queue entry; when
        // the bound pops the first, the record made at 70 must stay.
        let mut records = Records::default();
        records.insert(9, 0, Recorded::One(decision()), 100, 110, 3);
        records.insert(1, 0, Recorded::One(decision()), 50, 60, 3);
        assert!(records.get(1, 0, 70).is_none(), "expired at 60");
        records.insert(1, 2, Recorded::One(decision()), 70, 80, 3);
        records.insert(3, 0, Recorded::One(decision()), 75, 85, 3);
        records.insert(4, 0, Recorded::One(decision()), 76, 86, 3);
        assert!(records.get(9, 0, 77).is_none(), "the oldest went first");
        assert!(
            matches!(records.get(1, 2, 77), Some(Ok(_))),
            "popping the stale entry kept the live record"
        );
    }

    #[test]
    fn request_ids_are_one_to_max_bytes() {
        assert!(matches!(
            check_request_id(""),
            Err(Error::InvalidRequestId { len: 0 })
        ));
        assert!(check_request_id("a").is_ok());
        assert!(check_request_id(&"a".repeat(MAX_REQUEST_ID_BYTES)).is_ok());
        assert!(matches!(
            check_request_id(&"a".repeat(MAX_REQUEST_ID_BYTES + 1)),
            Err(Error::InvalidRequestId { len }) if len == MAX_REQUEST_ID_BYTES + 1
        ));
    }
}
