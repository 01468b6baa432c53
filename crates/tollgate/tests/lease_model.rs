//! The lease table against a reference model, and under many threads.
//!
//! The model keeps, per key, the plain list of leases and counts the ones whose end is past
//! `now`; the table keeps them ordered, drops ended ones from the front and indexes them by id.
//! Random traces (time moving forward and sometimes back, several keys and limits, soft keys,
//! reused ids, sweeps) must get identical answers from both. The thread test counts holders
//! and asserts no key ever has more than its limit.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::Duration;

use proptest::prelude::*;
use tollgate::{Error, LeaseDecision, LeaseLimit, LeaseTake, MemoryLeases, Timestamp};

const KEYS: [&str; 3] = ["a", "b", "c"];

/// One lease held on one key, in the model.
#[derive(Debug, Clone)]
struct Held {
    id: String,
    ends: u64,
}

/// A lease's keys, each with the timeout it was taken with (nanoseconds).
type HeldKeys = Vec<(&'static str, u64)>;

/// The reference: lists, no ordering, no index.
#[derive(Debug, Default)]
struct Model {
    keys: BTreeMap<&'static str, Vec<Held>>,
    /// id → (keys held with the timeout each was taken with, last end).
    records: BTreeMap<String, (HeldKeys, u64)>,
}

impl Model {
    fn decision(&self, key: &str, max: u64, now: u64) -> LeaseDecision {
        let live: Vec<u64> = self
            .keys
            .get(key)
            .into_iter()
            .flatten()
            .filter(|held| held.ends > now)
            .map(|held| held.ends)
            .collect();
        let count = live.len() as u64;
        let first = live.iter().copied().min().unwrap_or(now);
        let last = live.iter().copied().max().unwrap_or(now);
        LeaseDecision::new(
            count < max,
            max,
            count,
            (count >= max).then(|| Duration::from_nanos(first - now)),
            Duration::from_nanos(last - now),
        )
    }

    fn forget(&mut self, id: &str) {
        for leases in self.keys.values_mut() {
            leases.retain(|held| held.id != id);
        }
    }

    fn acquire(
        &mut self,
        takes: &[(&'static str, LeaseLimit, bool)],
        id: &str,
        now: u64,
    ) -> Result<Vec<LeaseDecision>, Error> {
        if let Some((_, ends)) = self.records.get(id) {
            if *ends > now {
                return Err(Error::LeaseIdInUse);
            }
            self.records.remove(id);
            self.forget(id);
        }
        // An acquire drops what ended on the keys it touches (so a clock that later goes back
        // does not bring them back, as in every store).
        for (key, ..) in takes {
            if let Some(leases) = self.keys.get_mut(key) {
                leases.retain(|held| held.ends > now);
            }
        }
        let mut decisions: Vec<LeaseDecision> = takes
            .iter()
            .map(|(key, limit, _)| self.decision(key, limit.max_in_flight(), now))
            .collect();
        let passes = takes
            .iter()
            .zip(&decisions)
            .all(|((.., enforce), d)| d.allowed() || !enforce);
        if !passes {
            return Ok(decisions);
        }
        let mut held_keys = Vec::new();
        let mut last = 0;
        for ((key, limit, _), decision) in takes.iter().zip(&mut decisions) {
            if !decision.allowed() {
                continue;
            }
            let ends = now + limit.timeout_ms() * 1_000_000;
            last = last.max(ends);
            self.keys.entry(key).or_default().push(Held {
                id: id.to_owned(),
                ends,
            });
            held_keys.push((*key, limit.timeout_ms() * 1_000_000));
            let after = self.decision(key, limit.max_in_flight(), now);
            *decision = LeaseDecision::new(
                true,
                after.max_in_flight(),
                after.in_flight(),
                None,
                after.reset_after(),
            );
        }
        self.records.insert(id.to_owned(), (held_keys, last));
        Ok(decisions)
    }

    fn release(&mut self, id: &str, now: u64) -> bool {
        match self.records.remove(id) {
            None => false,
            Some((_, ends)) => {
                self.forget(id);
                ends > now
            }
        }
    }

    fn renew(&mut self, id: &str, now: u64) -> Option<Duration> {
        let (keys, ends) = self.records.get_mut(id)?;
        if *ends <= now {
            return None;
        }
        let mut last = None;
        for (key, timeout) in keys.iter() {
            for held in self.keys.get_mut(key).into_iter().flatten() {
                if held.id == id && held.ends > now {
                    held.ends = held.ends.max(now + timeout);
                    last = last.max(Some(held.ends));
                }
            }
        }
        let last = last?;
        *ends = (*ends).max(last);
        Some(Duration::from_nanos(last - now))
    }

    fn sweep(&mut self, now: u64) -> usize {
        for leases in self.keys.values_mut() {
            leases.retain(|held| held.ends > now);
        }
        let before = self.records.len();
        self.records.retain(|_, (_, ends)| *ends > now);
        before - self.records.len()
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// Keys (by index, with whether each is enforced) and the lease id's number.
    Acquire(Vec<(usize, bool)>, u8),
    Look(usize),
    Release(u8),
    Renew(u8),
    Sweep,
    /// Milliseconds forward.
    Forward(u16),
    /// Milliseconds back.
    Back(u16),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (proptest::sample::subsequence(vec![0usize, 1, 2], 1..=3), any::<[bool; 3]>(), 0u8..12)
            .prop_map(|(keys, soft, id)| {
                Op::Acquire(keys.into_iter().map(|k| (k, !soft[k])).collect(), id)
            }),
        1 => (0usize..3).prop_map(Op::Look),
        3 => (0u8..12).prop_map(Op::Release),
        2 => (0u8..12).prop_map(Op::Renew),
        1 => Just(Op::Sweep),
        3 => (0u16..400).prop_map(Op::Forward),
        1 => (0u16..300).prop_map(Op::Back),
    ]
}

fn limits() -> impl Strategy<Value = Vec<LeaseLimit>> {
    proptest::collection::vec((1u64..4, 1u64..6), 3).prop_map(|params| {
        params
            .into_iter()
            .map(|(max, tenths)| {
                LeaseLimit::new(max, Duration::from_millis(tenths * 100)).expect("in range")
            })
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn the_table_decides_as_the_model(limits in limits(), ops in proptest::collection::vec(op(), 1..80)) {
        let table = MemoryLeases::builder().shards(2).build();
        let mut model = Model::default();
        let mut now: u64 = 1_000_000_000_000;
        for op in ops {
            match op {
                Op::Acquire(keys, id) => {
                    let id = format!("l{id}");
                    let takes: Vec<LeaseTake<'_>> = keys
                        .iter()
                        .map(|&(k, enforce)| {
                            let take = LeaseTake::new(KEYS[k], &limits[k]);
                            if enforce { take } else { take.soft() }
                        })
                        .collect();
                    let plain: Vec<(&'static str, LeaseLimit, bool)> =
                        keys.iter().map(|&(k, enforce)| (KEYS[k], limits[k], enforce)).collect();
                    let got = table.acquire(&takes, &id, Timestamp::from_nanos(now));
                    let want = model.acquire(&plain, &id, now);
                    prop_assert_eq!(got, want, "acquire {} {:?} at {}", id, keys, now);
                }
                Op::Look(k) => {
                    let take = [LeaseTake::new(KEYS[k], &limits[k])];
                    let got = table.in_flight(&take, Timestamp::from_nanos(now)).unwrap();
                    prop_assert_eq!(got[0], model.decision(KEYS[k], limits[k].max_in_flight(), now));
                }
                Op::Release(id) => {
                    let id = format!("l{id}");
                    let got = table.release(&id, Timestamp::from_nanos(now)).unwrap();
                    prop_assert_eq!(got, model.release(&id, now), "release {} at {}", id, now);
                }
                Op::Renew(id) => {
                    let id = format!("l{id}");
                    let got = table.renew(&id, Timestamp::from_nanos(now)).unwrap();
                    prop_assert_eq!(got, model.renew(&id, now), "renew {} at {}", id, now);
                }
                Op::Sweep => {
                    prop_assert_eq!(table.sweep(Timestamp::from_nanos(now)), model.sweep(now));
                }
                Op::Forward(ms) => now += u64::from(ms) * 1_000_000,
                Op::Back(ms) => now = now.saturating_sub(u64::from(ms) * 1_000_000),
            }
            prop_assert_eq!(table.len(), model.records.len());
        }
    }
}

#[test]
fn many_threads_on_one_key_never_hold_more_than_the_limit() {
    const THREADS: usize = 8;
    const ROUNDS: usize = 2_000;
    for max in [1u64, 3, 16] {
        let table = MemoryLeases::default();
        let limit = LeaseLimit::new(max, Duration::from_secs(60)).unwrap();
        // Time is frozen: only releases free slots. A holder counts itself in after its
        // acquire returns and out before it releases, so `holding` never exceeds what the
        // table holds, and the table must never hold more than `max`.
        let holding = AtomicU64::new(0);
        let peak = AtomicU64::new(0);
        let admitted = AtomicU64::new(0);
        thread::scope(|scope| {
            for t in 0..THREADS {
                let (table, holding, peak, admitted) = (&table, &holding, &peak, &admitted);
                scope.spawn(move || {
                    let takes = [LeaseTake::new("hot", &limit)];
                    for round in 0..ROUNDS {
                        let id = format!("t{t}-{round}");
                        let decision = table.acquire(&takes, &id, Timestamp::ZERO).unwrap();
                        if decision[0].allowed() {
                            let now = holding.fetch_add(1, Ordering::SeqCst) + 1;
                            peak.fetch_max(now, Ordering::SeqCst);
                            admitted.fetch_add(1, Ordering::Relaxed);
                            assert!(now <= max, "{now} holders of a limit of {max}");
                            thread::yield_now();
                            holding.fetch_sub(1, Ordering::SeqCst);
                            assert!(table.release(&id, Timestamp::ZERO).unwrap());
                        }
                    }
                });
            }
        });
        assert!(peak.into_inner() <= max);
        assert!(admitted.into_inner() >= max, "some leases were granted");
        assert!(table.is_empty(), "every lease was released");
        let takes = [LeaseTake::new("hot", &limit)];
        assert_eq!(
            table.in_flight(&takes, Timestamp::ZERO).unwrap()[0].in_flight(),
            0
        );
    }
}
