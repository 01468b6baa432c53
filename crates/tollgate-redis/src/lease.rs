//! Concurrency limits in Redis: [`tollgate::LeaseStore`] for [`RedisStore`], so that processes
//! sharing a Redis share one count of requests in flight per key, with the decisions of
//! [`tollgate::MemoryLeases`].
//!
//! Each key's leases are a sorted set (member the lease id, score its end in microseconds, on
//! Redis' `TIME` unless the caller gives the time), decided by `scripts/lease.lua` in one
//! atomic step per cluster slot: drop the ended leases, count, take. A release or a renewal
//! names only the lease id, so each lease also has a record naming the sets it holds and the
//! timeout each was taken with (`END|LEN:SET=TIMEOUT_MS;…`, see the script; records from
//! before renewals, without timeouts, still read). Sets live at `PREFIX lease:KEY` (a key's
//! `{hash tag}` keeps its slot), records at `PREFIX lease-id:{ID}` (the id is their hash tag,
//! so records spread over the cluster rather than crowd one slot); the two never meet, but a
//! bucket given a key starting with `lease:` or `lease-id:` would share their names, and fail
//! as a key that is not its own.
//!
//! Every call names all the keys it touches, so the same script serves a single node and a
//! cluster, and a record's sets are read in one call and changed in the next:
//!
//! * An acquire whose sets share the record's slot (always, on a single node) is one call: the
//!   record is checked (an id still held is refused), the sets decided and the record written
//!   together. Sets of an ended lease under the same id that this acquire does not name are
//!   replied, and its slots there removed by a second call; they have ended, so they no longer
//!   count for any `now` past their end either way.
//! * Across cluster slots the record is claimed first, in its own slot: written, with every
//!   set of the request and its timeout, to end after the longest, unless the id is held. Only then are the sets
//!   decided, one call per slot, in parallel; if a slot rejects, fails, or finds the id held,
//!   the slots that took give the lease back and the claim is deleted. So the store may
//!   under-admit for the moment between a take and its give-back, and after a give-back that
//!   fails (the slot is held until its lease times out), but never over-admits: a set only
//!   ever loses a slot by a lease ending or by this id's own removal, and no second acquire
//!   can take a slot under an id while its claim is live (a set also refuses an id it holds
//!   itself, should a node's clock run ahead of the record's). When a soft key was full, the
//!   record is then rewritten to the sets that hold the lease and their last end. A release
//!   meanwhile (which only a caller that already gave the lease up could send) deletes the
//!   claim before the sets are taken: they are then held until they time out.
//! * A release deletes the record in one call (so of two releases, one is told the lease was
//!   held) and removes the id from its sets in the next (one call per slot, in parallel).
//! * A renewal reads the record in one call (ended or missing: nothing to renew). When its sets
//!   share the record's slot (always, on a single node) the next call checks that the record
//!   still names them, moves the lease's end on each set where it is still held, and moves the
//!   record's end with them. Across slots, each slot moves its sets in parallel, and a last call
//!   moves the record's end, if it still names the same sets, to the last of theirs: a
//!   release between the calls leaves the sets moved and then removes the id from them, and a
//!   failure between leaves the record ending first, so the caller hears it and may renew again.
//!   An end only ever grows, so concurrent renewals of one lease agree, and none revives a set
//!   where the lease had ended.
//!
//! A call that times out after Redis ran it has done its work though the caller hears
//! [`Unavailable::Timeout`]: an acquire may then hold a lease its caller does not know of.
//! Releasing the id frees it; otherwise it times out, under-admitting until then.
//!
//! Besides the commands buckets use, a least-privileged Redis user needs `+zadd +zrem
//! +zremrangebyscore +zcard +zcount +zrange +zrangebyscore +zscore +pexpire` for leases.

use std::time::Duration;

use futures_util::future::{join, join_all};
use redis::{Cmd, ErrorKind, ServerErrorKind, Value};
use tollgate::{
    Error, LeaseDecision, LeaseRequest, LeaseStore, LeaseTake, Timestamp, Unavailable,
    check_lease_id,
};

use crate::connection::Connection;
use crate::store::{RedisStore, classify, slot};

/// The lease script, as Redis is sent it.
#[derive(Debug, Clone)]
pub(crate) struct LeaseScript {
    source: &'static str,
    /// The SHA1 of `source`, which `EVALSHA` names it by.
    sha: String,
}

impl LeaseScript {
    pub(crate) fn new() -> Self {
        let source = include_str!("../scripts/lease.lua");
        Self {
            source,
            sha: redis::Script::new(source).get_hash().to_owned(),
        }
    }
}

/// The script's operations (see `scripts/lease.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Acquire,
    Look,
    Claim,
    Fix,
    Unhold,
    Release,
    Holds,
    Renew,
    Prolong,
}

impl Op {
    fn as_str(self) -> &'static str {
        match self {
            Op::Acquire => "acquire",
            Op::Look => "look",
            Op::Claim => "claim",
            Op::Fix => "fix",
            Op::Unhold => "unhold",
            Op::Release => "release",
            Op::Holds => "holds",
            Op::Renew => "renew",
            Op::Prolong => "prolong",
        }
    }
}

/// One call of the lease script: its keys (all in one slot) and its arguments after the
/// operation, the time and the lease id.
struct Call<'a> {
    op: Op,
    now: &'a str,
    id: &'a str,
    keys: Vec<&'a str>,
    args: Vec<String>,
}

impl Call<'_> {
    /// The call as `verb` (`EVALSHA` with the script's hash, or `EVAL` with its source).
    fn command(&self, verb: &str, script: &str) -> Cmd {
        let mut cmd = redis::cmd(verb);
        cmd.arg(script).arg(self.keys.len());
        for key in &self.keys {
            cmd.arg(*key);
        }
        cmd.arg(self.op.as_str()).arg(self.now).arg(self.id);
        for arg in &self.args {
            cmd.arg(arg);
        }
        cmd
    }
}

/// What a call replied: its status, its integers (the first is the script's `now` for every
/// operation but "unhold"), then its keys.
#[derive(Debug)]
struct Reply {
    status: i64,
    integers: Vec<i64>,
    keys: Vec<String>,
}

impl Reply {
    /// The reply as the script sends it: a list of integers, then keys as strings. `None` for
    /// anything else.
    fn parse(value: Value) -> Option<Self> {
        let Value::Array(items) = value else {
            return None;
        };
        let mut items = items.into_iter().peekable();
        let Some(Value::Int(status)) = items.next() else {
            return None;
        };
        let mut integers = Vec::new();
        while let Some(Value::Int(integer)) = items.peek() {
            integers.push(*integer);
            items.next();
        }
        let keys = items
            .map(|item| match item {
                Value::BulkString(bytes) => String::from_utf8(bytes).ok(),
                _ => None,
            })
            .collect::<Option<_>>()?;
        Some(Self {
            status,
            integers,
            keys,
        })
    }

    /// The script's `now`, as nanoseconds: the caller's own time when it gave one (the
    /// script counted from its whole microsecond, which decides alike; see the script).
    fn now_ns(&self, caller: Option<Timestamp>) -> Result<u64, Unavailable> {
        let micros = self.integer(0)?;
        Ok(caller.map_or(micros.saturating_mul(1_000), Timestamp::as_nanos))
    }

    /// Integer `at`, which the script never sends negative.
    fn integer(&self, at: usize) -> Result<u64, Unavailable> {
        self.integers
            .get(at)
            .and_then(|&integer| u64::try_from(integer).ok())
            .ok_or(Unavailable::Protocol)
    }

    /// The four figures of each of `count` sets, after `now`.
    fn standings(&self, count: usize) -> Result<Vec<Standing>, Unavailable> {
        if self.integers.len() != 1 + 4 * count {
            return Err(Unavailable::Protocol);
        }
        (0..count)
            .map(|set| {
                let figure = |at| self.integer(1 + 4 * set + at);
                Ok(Standing {
                    count: figure(0)?,
                    oldest: figure(1)?,
                    newest: figure(2)?,
                    taken: figure(3)?,
                })
            })
            .collect()
    }
}

/// One set as a call found it: its leases still held before the call (ended ones left out),
/// the earliest and latest of their ends (microseconds, 0 when none), and the end of the lease
/// the call took on it (0 when it took none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Standing {
    count: u64,
    oldest: u64,
    newest: u64,
    taken: u64,
}

impl Standing {
    /// The decision for this set under `max` at `now` (nanoseconds), as the memory store
    /// reports it: after the lease when `admitted` (the acquire as a whole passed) and this
    /// set took it, else as the set stands without it.
    fn decision(&self, max: u64, now: u64, admitted: bool) -> LeaseDecision {
        let until = |end: u64| Duration::from_nanos(end.saturating_mul(1_000).saturating_sub(now));
        if admitted && self.taken > 0 {
            let last = self.newest.max(self.taken);
            return LeaseDecision::new(true, max, self.count + 1, None, until(last));
        }
        if self.count == 0 {
            return LeaseDecision::new(true, max, 0, None, Duration::ZERO);
        }
        let allowed = self.count < max;
        LeaseDecision::new(
            allowed,
            max,
            self.count,
            (!allowed).then(|| until(self.oldest)),
            until(self.newest),
        )
    }
}

/// Runs `call`. A `NOSCRIPT` answer (after `SCRIPT FLUSH` or a restart) sends it again as an
/// `EVAL` of the source, which also caches the script in that node for the next `EVALSHA`.
async fn invoke(
    script: &LeaseScript,
    connection: &Connection,
    call: &Call<'_>,
) -> Result<Reply, Unavailable> {
    let reply = match connection
        .query::<Value>(&call.command("EVALSHA", &script.sha))
        .await
    {
        Err(err) if err.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
            connection
                .query::<Value>(&call.command("EVAL", script.source))
                .await
        }
        reply => reply,
    }
    .map_err(|err| classify(&err))?;
    Reply::parse(reply).ok_or(Unavailable::Protocol)
}

/// The latest time the script's arithmetic takes from a caller: 2^52 microseconds (the year
/// 2112), so that a lease's end, a day later at most, stays an exact Lua integer.
const MAX_CALLER_MICROS: u64 = 1 << 52;

/// The script's `now`: "" for Redis' `TIME`, or the caller's time as "micros" or
/// "micros:nanos".
fn time_arg(now: Option<Timestamp>) -> Result<String, Error> {
    let Some(now) = now else {
        return Ok(String::new());
    };
    let (micros, nanos) = (now.as_nanos() / 1_000, now.as_nanos() % 1_000);
    if micros >= MAX_CALLER_MICROS {
        return Err(Error::UnsupportedLimit {
            reason: "a lease's time must be before 2^52 microseconds since 1970 (the year 2112)",
        });
    }
    Ok(match nanos {
        0 => micros.to_string(),
        nanos => format!("{micros}:{nanos}"),
    })
}

/// The sets of `takes` at `indexes` as "claim" and "fix" write them into a record: each
/// one's timeout in milliseconds (for a renewal), then the set.
fn recorded_sets(
    takes: &[LeaseTake<'_>],
    sets: &[String],
    indexes: impl IntoIterator<Item = usize>,
) -> Vec<String> {
    indexes
        .into_iter()
        .flat_map(|i| [takes[i].limit.timeout_ms().to_string(), sets[i].clone()])
        .collect()
}

/// An empty acquire, or one naming a key twice, is refused before any call.
fn check_takes(takes: &[LeaseTake<'_>]) -> Result<(), Error> {
    if takes.is_empty() {
        return Err(Error::EmptyCheck);
    }
    for (index, take) in takes.iter().enumerate() {
        if takes[..index].iter().any(|earlier| earlier.key == take.key) {
            return Err(Error::DuplicateKey { index });
        }
    }
    Ok(())
}

/// A key holding something that is not ours (another program's, or corrupted): the request
/// cannot be decided, which its limits' failure modes answer for. Redis answered, so this does
/// not count against the breaker.
const UNREADABLE: Error = Error::StoreUnavailable {
    reason: Unavailable::Script,
};

/// What a renewal's first call read in a lease's record: the sets it holds, and the timeout
/// each was taken with (milliseconds; 0 for a record written before records said, whose sets
/// a renewal leaves as they are).
struct Holding {
    sets: Vec<String>,
    timeouts: Vec<u64>,
}

impl Holding {
    /// The "holds" reply: its end, a timeout per set, then the sets.
    fn parse(reply: Reply) -> Result<Self, Unavailable> {
        let count = reply.keys.len();
        if reply.integers.len() != 2 + count {
            return Err(Unavailable::Protocol);
        }
        let timeouts = (0..count)
            .map(|set| reply.integer(2 + set))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            sets: reply.keys,
            timeouts,
        })
    }

    /// The "renew" call of `group` (indexes into the sets), with the record when `record` is
    /// given: every set is then in its slot.
    fn renew_call<'a>(
        &'a self,
        group: &[usize],
        now: &'a str,
        id: &'a str,
        record: Option<&'a str>,
    ) -> Call<'a> {
        let flag = if record.is_some() { "1" } else { "" };
        Call {
            op: Op::Renew,
            now,
            id,
            keys: record
                .into_iter()
                .chain(group.iter().map(|&i| self.sets[i].as_str()))
                .collect(),
            args: std::iter::once(flag.to_owned())
                .chain(group.iter().map(|&i| self.timeouts[i].to_string()))
                .collect(),
        }
    }
}

/// What the "renew" calls replied, gathered: the lease's last end (microseconds, 0 when no set
/// held it), and the time from each call's `now` until it (the answer).
#[derive(Debug, Default)]
struct Renewed {
    last: u64,
    until: Option<Duration>,
}

impl Renewed {
    /// Adds one call's reply for `count` sets: its `now`, then each set's end after the call
    /// (0 where the lease was not held).
    fn add(
        &mut self,
        reply: &Reply,
        count: usize,
        caller: Option<Timestamp>,
    ) -> Result<(), Unavailable> {
        if reply.integers.len() != 1 + count {
            return Err(Unavailable::Protocol);
        }
        let now = reply.now_ns(caller)?;
        for set in 0..count {
            let ends = reply.integer(1 + set)?;
            if ends == 0 {
                continue;
            }
            self.last = self.last.max(ends);
            let until = Duration::from_nanos(ends.saturating_mul(1_000).saturating_sub(now));
            self.until = self.until.max(Some(until));
        }
        Ok(())
    }
}

/// What one slot's acquire replied, checked.
struct SlotReply {
    status: i64,
    now: u64,
    standings: Vec<Standing>,
}

impl RedisStore {
    /// The sorted set of `key`'s leases, as stored.
    fn lease_set(&self, key: &str) -> String {
        let prefix = &self.config.prefix;
        let mut stored = String::with_capacity(prefix.len() + 6 + key.len());
        stored.push_str(prefix);
        stored.push_str("lease:");
        stored.push_str(key);
        stored
    }

    /// The record of lease `id`, as stored: the id (letters, digits, `-` and `_` only) is its
    /// hash tag.
    fn lease_record(&self, id: &str) -> String {
        format!("{}lease-id:{{{id}}}", self.config.prefix)
    }

    async fn lease_call(&self, call: &Call<'_>) -> Result<Reply, Unavailable> {
        invoke(&self.lease, &self.link.get(), call).await
    }

    /// Indexes into `keys` by cluster slot, in the order slots first appear; one group on a
    /// single node.
    fn slot_groups<S: AsRef<str>>(&self, keys: &[S]) -> Vec<Vec<usize>> {
        if !self.cluster {
            return vec![(0..keys.len()).collect()];
        }
        let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
        for (index, key) in keys.iter().enumerate() {
            let key_slot = slot(key.as_ref());
            match groups
                .iter_mut()
                .find(|(group_slot, _)| *group_slot == key_slot)
            {
                Some((_, group)) => group.push(index),
                None => groups.push((key_slot, vec![index])),
            }
        }
        groups.into_iter().map(|(_, group)| group).collect()
    }

    /// Removes lease `id` from `sets`, one call per slot, in parallel.
    async fn unhold(&self, id: &str, sets: &[String]) -> Result<(), Unavailable> {
        if sets.is_empty() {
            return Ok(());
        }
        let calls = self.slot_groups(sets).into_iter().map(|group| async move {
            let call = Call {
                op: Op::Unhold,
                now: "",
                id,
                keys: group.iter().map(|&i| sets[i].as_str()).collect(),
                args: Vec::new(),
            };
            self.lease_call(&call).await.map(drop)
        });
        join_all(calls).await.into_iter().collect()
    }

    /// The acquire call of `group` (indexes into `takes`), with the record when `record` is
    /// given: every set is then in its slot.
    fn acquire_call<'a>(
        takes: &[LeaseTake<'_>],
        sets: &'a [String],
        group: &[usize],
        now: &'a str,
        id: &'a str,
        record: Option<&'a str>,
    ) -> Call<'a> {
        let mut args = Vec::with_capacity(1 + 3 * group.len());
        args.push(if record.is_some() { "1" } else { "" }.to_owned());
        for &i in group {
            let take = &takes[i];
            args.push(take.limit.max_in_flight().to_string());
            args.push(take.limit.timeout_ms().to_string());
            args.push(if take.enforce { "1" } else { "0" }.to_owned());
        }
        Call {
            op: Op::Acquire,
            now,
            id,
            keys: record
                .into_iter()
                .chain(group.iter().map(|&i| sets[i].as_str()))
                .collect(),
            args,
        }
    }

    /// A slot's acquire reply, checked: a status the script sends, with a standing per set
    /// unless the id was held.
    fn slot_reply(
        reply: Result<Reply, Unavailable>,
        sets: usize,
        caller: Option<Timestamp>,
    ) -> Result<SlotReply, Unavailable> {
        let reply = reply?;
        let standings = match reply.status {
            -2 | -1 => Vec::new(),
            0 | 1 => reply.standings(sets)?,
            _ => return Err(Unavailable::Protocol),
        };
        Ok(SlotReply {
            status: reply.status,
            now: reply.now_ns(caller)?,
            standings,
        })
    }

    async fn acquire_leases(&self, request: LeaseRequest<'_>) -> Result<Vec<LeaseDecision>, Error> {
        check_lease_id(request.lease_id)?;
        check_takes(request.takes)?;
        let now = time_arg(request.now)?;
        let sets: Vec<String> = request
            .takes
            .iter()
            .map(|take| self.lease_set(take.key))
            .collect();
        let record = self.lease_record(request.lease_id);
        let mut touched = sets.clone();
        touched.push(record.clone());
        self.guarded(
            &touched,
            self.acquire_in_redis(request, &now, &sets, &record),
        )
        .await
    }

    async fn acquire_in_redis(
        &self,
        request: LeaseRequest<'_>,
        now: &str,
        sets: &[String],
        record: &str,
    ) -> Result<Result<Vec<LeaseDecision>, Error>, Unavailable> {
        let (takes, id) = (request.takes, request.lease_id);
        let groups = self.slot_groups(sets);
        let decide = |group: &[usize],
                      reply: &SlotReply,
                      admitted: bool,
                      into: &mut [Option<LeaseDecision>]| {
            for (&i, standing) in group.iter().zip(&reply.standings) {
                let max = takes[i].limit.max_in_flight();
                into[i] = Some(standing.decision(max, reply.now, admitted));
            }
        };
        let mut decisions: Vec<Option<LeaseDecision>> = vec![None; takes.len()];

        if let [group] = groups.as_slice()
            && (!self.cluster || slot(record) == slot(&sets[group[0]]))
        {
            let call = Self::acquire_call(takes, sets, group, now, id, Some(record));
            let reply = self.lease_call(&call).await;
            let stale = reply
                .as_ref()
                .map(|reply| reply.keys.clone())
                .unwrap_or_default();
            let reply = Self::slot_reply(reply, group.len(), request.now)?;
            match reply.status {
                -2 => return Ok(Err(UNREADABLE)),
                -1 => return Ok(Err(Error::LeaseIdInUse)),
                _ => {}
            }
            // Best effort: these slots have ended, and count for no `now` past their end.
            let _ = self.unhold(id, &stale).await;
            decide(group, &reply, reply.status == 1, &mut decisions);
            return Ok(Ok(decisions.into_iter().flatten().collect()));
        }

        // Across slots: the claim first (see the module's comment).
        let claim = Call {
            op: Op::Claim,
            now,
            id,
            keys: vec![record],
            args: recorded_sets(takes, sets, 0..sets.len()),
        };
        let claim = self.lease_call(&claim).await?;
        match claim.status {
            -2 => return Ok(Err(UNREADABLE)),
            -1 => return Ok(Err(Error::LeaseIdInUse)),
            1 => {}
            _ => return Err(Unavailable::Protocol),
        }
        let claimed = claim.integer(1)?;
        // The ended lease's slots on sets this acquire does not name: removed beside it (on
        // the sets it names, they go with the other ended leases).
        let stale: Vec<String> = claim
            .keys
            .into_iter()
            .filter(|set| !sets.contains(set))
            .collect();
        let acquires = groups.iter().map(|group| async move {
            let call = Self::acquire_call(takes, sets, group, now, id, None);
            Self::slot_reply(self.lease_call(&call).await, group.len(), request.now)
        });
        let (replies, _) = join(join_all(acquires), self.unhold(id, &stale)).await;

        let fix = |ends: u64, held: Vec<usize>| async move {
            let call = Call {
                op: Op::Fix,
                now,
                id,
                keys: vec![record],
                args: [claimed.to_string(), ends.to_string()]
                    .into_iter()
                    .chain(recorded_sets(takes, sets, held))
                    .collect(),
            };
            self.lease_call(&call).await
        };
        let passed = replies
            .iter()
            .all(|reply| reply.as_ref().is_ok_and(|reply| reply.status == 1));
        if !passed {
            // The slots that took give the lease back, and the claim goes: best effort, as a
            // slot left held only under-admits until it times out. A rejection is reported
            // as one even then: the store knows the request is over its limit, and a failure
            // would let a limit that fails open admit it.
            let mut taken = Vec::new();
            for (group, reply) in groups.iter().zip(&replies) {
                let Ok(reply) = reply else { continue };
                for (&i, standing) in group.iter().zip(&reply.standings) {
                    if standing.taken > 0 {
                        taken.push(sets[i].clone());
                    }
                }
            }
            let _ = join(self.unhold(id, &taken), fix(0, Vec::new())).await;
            if let Some(failed) = replies.iter().find_map(|reply| reply.as_ref().err()) {
                return Err(*failed);
            }
        }
        let said = |status| {
            replies
                .iter()
                .any(|reply| reply.as_ref().is_ok_and(|reply| reply.status == status))
        };
        if said(-2) {
            return Ok(Err(UNREADABLE));
        }
        if said(-1) {
            return Ok(Err(Error::LeaseIdInUse));
        }
        let mut held = Vec::new();
        let mut last = 0;
        for (group, reply) in groups.iter().zip(&replies) {
            let Ok(reply) = reply else { continue };
            decide(group, reply, passed, &mut decisions);
            for (&i, standing) in group.iter().zip(&reply.standings) {
                if standing.taken > 0 {
                    held.push(i);
                    last = last.max(standing.taken);
                }
            }
        }
        if passed && held.len() != sets.len() {
            // A soft key was full: the record names only the sets that hold the lease, and
            // ends with the last of them. Best effort: the claim names more sets (removing
            // the id from one that lacks it changes nothing) and may end later, when a
            // release would call the lease held a little longer.
            let _ = fix(last, held).await;
        }
        Ok(Ok(decisions.into_iter().flatten().collect()))
    }

    async fn look_leases(&self, request: LeaseRequest<'_>) -> Result<Vec<LeaseDecision>, Error> {
        check_takes(request.takes)?;
        let now = time_arg(request.now)?;
        let sets: Vec<String> = request
            .takes
            .iter()
            .map(|take| self.lease_set(take.key))
            .collect();
        let work = async {
            let groups = self.slot_groups(&sets);
            let looks = groups.iter().map(|group| {
                let call = Call {
                    op: Op::Look,
                    now: &now,
                    id: "",
                    keys: group.iter().map(|&i| sets[i].as_str()).collect(),
                    args: Vec::new(),
                };
                async move {
                    let reply = self.lease_call(&call).await?;
                    match reply.status {
                        -2 => Ok(None),
                        1 => Ok(Some((
                            reply.now_ns(request.now)?,
                            reply.standings(group.len())?,
                        ))),
                        _ => Err(Unavailable::Protocol),
                    }
                }
            });
            let mut decisions: Vec<Option<LeaseDecision>> = vec![None; sets.len()];
            for (group, reply) in groups.iter().zip(join_all(looks).await) {
                let Some((now, standings)) = reply? else {
                    return Ok(Err(UNREADABLE));
                };
                for (&i, standing) in group.iter().zip(&standings) {
                    let max = request.takes[i].limit.max_in_flight();
                    decisions[i] = Some(standing.decision(max, now, false));
                }
            }
            Ok(Ok(decisions.into_iter().flatten().collect()))
        };
        self.guarded(&sets, work).await
    }

    async fn release_lease(&self, id: &str, now: Option<Timestamp>) -> Result<bool, Error> {
        check_lease_id(id)?;
        let now_arg = time_arg(now)?;
        let record = self.lease_record(id);
        let work = async {
            let call = Call {
                op: Op::Release,
                now: &now_arg,
                id,
                keys: vec![record.as_str()],
                args: Vec::new(),
            };
            let reply = self.lease_call(&call).await?;
            match reply.status {
                -2 => Ok(Err(UNREADABLE)),
                0 => Ok(Ok(None)),
                1 => {
                    let held = reply.integer(1)?.saturating_mul(1_000) > reply.now_ns(now)?;
                    Ok(Ok(Some((held, reply.keys))))
                }
                _ => Err(Unavailable::Protocol),
            }
        };
        let Some((held, sets)) = self.guarded(std::slice::from_ref(&record), work).await? else {
            return Ok(false);
        };
        // The record is gone: should this fail, the sets hold the lease until it times out.
        self.guarded(&sets, async { self.unhold(id, &sets).await.map(Ok) })
            .await?;
        Ok(held)
    }

    /// [`LeaseStore::renew`]: the record read, then its sets moved and the record with them
    /// (see the module's comment).
    async fn renew_lease(
        &self,
        id: &str,
        now: Option<Timestamp>,
    ) -> Result<Option<Duration>, Error> {
        check_lease_id(id)?;
        let now_arg = time_arg(now)?;
        let record = self.lease_record(id);
        let read = async {
            let call = Call {
                op: Op::Holds,
                now: &now_arg,
                id,
                keys: vec![record.as_str()],
                args: Vec::new(),
            };
            let reply = self.lease_call(&call).await?;
            match reply.status {
                -2 => Ok(Err(UNREADABLE)),
                0 => Ok(Ok(None)),
                1 => Holding::parse(reply).map(|holding| Ok(Some(holding))),
                _ => Err(Unavailable::Protocol),
            }
        };
        let Some(holding) = self.guarded(std::slice::from_ref(&record), read).await? else {
            return Ok(None);
        };
        if holding.sets.is_empty() {
            return Ok(None);
        }
        let mut touched = holding.sets.clone();
        touched.push(record.clone());
        self.guarded(
            &touched,
            self.renew_in_redis(id, &now_arg, now, &record, &holding),
        )
        .await
    }

    /// A renewal's sets, then its record: one call when they share the record's slot (always,
    /// on a single node), else one call per slot in parallel and then the record's.
    async fn renew_in_redis(
        &self,
        id: &str,
        now: &str,
        caller: Option<Timestamp>,
        record: &str,
        holding: &Holding,
    ) -> Result<Result<Option<Duration>, Error>, Unavailable> {
        let sets = &holding.sets;
        let groups = self.slot_groups(sets);
        let mut renewed = Renewed::default();

        if let [group] = groups.as_slice()
            && (!self.cluster || slot(record) == slot(&sets[group[0]]))
        {
            let call = holding.renew_call(group, now, id, Some(record));
            let reply = self.lease_call(&call).await?;
            match reply.status {
                -2 => return Ok(Err(UNREADABLE)),
                // The record went or changed since it was read: a release, or the lease's end,
                // came first, and this renewal finds nothing of it to renew.
                0 => return Ok(Ok(None)),
                1 => renewed.add(&reply, group.len(), caller)?,
                _ => return Err(Unavailable::Protocol),
            }
            return Ok(Ok(renewed.until));
        }

        let calls = groups.iter().map(|group| {
            let call = holding.renew_call(group, now, id, None);
            async move { self.lease_call(&call).await }
        });
        let mut failed = None;
        let mut unreadable = false;
        for (group, reply) in groups.iter().zip(join_all(calls).await) {
            let added = reply.and_then(|reply| match reply.status {
                -2 => {
                    unreadable = true;
                    Ok(())
                }
                1 => renewed.add(&reply, group.len(), caller),
                _ => Err(Unavailable::Protocol),
            });
            if let Err(err) = added {
                failed = Some(err);
            }
        }
        // The slots that moved are written into the record even when another failed, so that
        // the record, which a release needs to find the sets, lives as long as they hold the
        // lease. Should this call fail, the caller hears so and may renew again (which finds
        // the sets already moved and tries the record once more); the record may otherwise
        // expire first, and a release then reports the lease as not held and leaves its slots
        // to time out. The record changed since it was read (a release) is left alone.
        if renewed.last > 0 {
            let call = Call {
                op: Op::Prolong,
                now,
                id,
                keys: vec![record],
                args: std::iter::once(renewed.last.to_string())
                    .chain(
                        sets.iter()
                            .zip(&holding.timeouts)
                            .flat_map(|(set, timeout)| [timeout.to_string(), set.clone()]),
                    )
                    .collect(),
            };
            match self.lease_call(&call).await.map(|reply| reply.status) {
                Ok(-2) => unreadable = true,
                Ok(0 | 1) => {}
                Ok(_) => failed = Some(Unavailable::Protocol),
                Err(err) => failed = Some(err),
            }
        }
        if let Some(err) = failed {
            return Err(err);
        }
        if unreadable {
            return Ok(Err(UNREADABLE));
        }
        Ok(Ok(renewed.until))
    }
}

impl LeaseStore for RedisStore {
    async fn acquire(&self, request: LeaseRequest<'_>) -> Result<Vec<LeaseDecision>, Error> {
        self.acquire_leases(request).await
    }

    async fn in_flight(&self, request: LeaseRequest<'_>) -> Result<Vec<LeaseDecision>, Error> {
        self.look_leases(request).await
    }

    async fn release(&self, lease_id: &str, now: Option<Timestamp>) -> Result<bool, Error> {
        self.release_lease(lease_id, now).await
    }

    async fn renew(
        &self,
        lease_id: &str,
        now: Option<Timestamp>,
    ) -> Result<Option<Duration>, Error> {
        self.renew_lease(lease_id, now).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_go_as_microseconds_and_their_nanoseconds() {
        assert_eq!(time_arg(None).unwrap(), "");
        assert_eq!(
            time_arg(Some(Timestamp::from_nanos(1_700_000_000_000_000_000))).unwrap(),
            "1700000000000000"
        );
        assert_eq!(
            time_arg(Some(Timestamp::from_nanos(5_001_250))).unwrap(),
            "5001:250"
        );
        assert!(matches!(
            time_arg(Some(Timestamp::from_nanos(MAX_CALLER_MICROS * 1_000))),
            Err(Error::UnsupportedLimit { .. })
        ));
    }

    #[test]
    fn decisions_are_the_memory_stores() {
        let now = 1_000_000; // 1 ms, in nanoseconds
        let empty = Standing {
            count: 0,
            oldest: 0,
            newest: 0,
            taken: 0,
        };
        assert_eq!(
            empty.decision(2, now, false),
            LeaseDecision::new(true, 2, 0, None, Duration::ZERO)
        );
        let full = Standing {
            count: 2,
            oldest: 1_600,
            newest: 1_900,
            taken: 0,
        };
        assert_eq!(
            full.decision(2, now, true),
            LeaseDecision::new(
                false,
                2,
                2,
                Some(Duration::from_micros(600)),
                Duration::from_micros(900)
            )
        );
        let taken = Standing {
            count: 1,
            oldest: 1_600,
            newest: 1_600,
            taken: 2_000,
        };
        assert_eq!(
            taken.decision(2, now, true),
            LeaseDecision::new(true, 2, 2, None, Duration::from_millis(1))
        );
        // Taken in a slot, given back because another rejected: as it stood.
        assert_eq!(
            taken.decision(2, now, false),
            LeaseDecision::new(true, 2, 1, None, Duration::from_micros(600))
        );
    }

    #[test]
    fn replies_are_integers_then_keys() {
        let reply = Value::Array(vec![
            Value::Int(1),
            Value::Int(7),
            Value::Int(9),
            Value::BulkString(b"k".to_vec()),
        ]);
        let reply = Reply::parse(reply).expect("a reply");
        assert_eq!((reply.status, &reply.integers[..]), (1, &[7, 9][..]));
        assert_eq!(reply.keys, ["k"]);
        for bad in [
            Value::Int(1),
            Value::Array(vec![]),
            Value::Array(vec![Value::BulkString(b"k".to_vec())]),
            Value::Array(vec![
                Value::Int(1),
                Value::BulkString(b"k".to_vec()),
                Value::Int(2),
            ]),
        ] {
            assert!(Reply::parse(bad).is_none());
        }
        // Four figures per set, after `now`; none negative.
        let reply = Reply {
            status: 1,
            integers: vec![5, 1, 2, 3, 0],
            keys: Vec::new(),
        };
        assert_eq!(reply.standings(1).unwrap()[0].newest, 3);
        assert!(reply.standings(2).is_err());
        let negative = Reply {
            status: 1,
            integers: vec![5, -1, 2, 3, 0],
            keys: Vec::new(),
        };
        assert!(negative.standings(1).is_err());
    }

    #[test]
    fn the_script_bounds_a_recorded_timeout_as_the_core_does() {
        let line = format!(
            "local MAX_TIMEOUT_MS = {}\n",
            tollgate::MAX_LEASE_TIMEOUT.as_millis()
        );
        assert!(LeaseScript::new().source.contains(&line), "{line}");
    }

    #[test]
    fn a_renewals_replies_are_checked_figure_by_figure() {
        let reply = |integers: Vec<i64>, keys: &[&str]| Reply {
            status: 1,
            integers,
            keys: keys.iter().map(|key| (*key).to_owned()).collect(),
        };
        // "holds": now, end, a timeout per set, then the sets.
        let holding = Holding::parse(reply(vec![5, 9, 1_000, 0], &["a", "b"])).unwrap();
        assert_eq!(
            (holding.sets.len(), &holding.timeouts[..]),
            (2, &[1_000, 0][..])
        );
        assert!(Holding::parse(reply(vec![5, 9, 1_000], &["a", "b"])).is_err());
        assert!(Holding::parse(reply(vec![5, 9, -1], &["a"])).is_err());
        let call = holding.renew_call(&[1], "7", "id", Some("rec"));
        assert_eq!(
            (call.keys, call.args),
            (vec!["rec", "b"], vec!["1".into(), "0".into()])
        );

        // "renew": now, then each set's end (0: not held). The answer is the time from each
        // call's `now` to the last end, the caller's nanosecond when it gave one.
        let mut renewed = Renewed::default();
        renewed
            .add(&reply(vec![1_000, 0, 4_000], &[]), 2, None)
            .unwrap();
        renewed
            .add(&reply(vec![2_000, 3_000], &[]), 1, None)
            .unwrap();
        assert_eq!(renewed.last, 4_000);
        assert_eq!(renewed.until, Some(Duration::from_millis(3)));
        let mut none = Renewed::default();
        none.add(&reply(vec![1_000, 0], &[]), 1, None).unwrap();
        assert_eq!((none.last, none.until), (0, None));
        let caller = Some(Timestamp::from_nanos(1_000_500));
        let mut exact = Renewed::default();
        exact
            .add(&reply(vec![1_000, 2_001], &[]), 1, caller)
            .unwrap();
        assert_eq!(exact.until, Some(Duration::from_nanos(1_000_500)));
        assert!(
            Renewed::default()
                .add(&reply(vec![1_000], &[]), 1, None)
                .is_err()
        );
        assert!(
            Renewed::default()
                .add(&reply(vec![1_000, -4], &[]), 1, None)
                .is_err()
        );
    }
}
