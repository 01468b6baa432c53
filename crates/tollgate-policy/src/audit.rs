//! The audit trail of the control plane, as JSON lines.
//!
//! Operators need to answer "who changed what, when, and what did it do" after the fact: every
//! policy load, refused file, rollback, exemption use, switch of every limit to shadow mode and
//! degraded decision is one JSON object
//! on one line, with a wall-clock timestamp, so the log can be shipped and queried as is.
//! Writing must never break a decision: a failed write is counted, not returned.

use std::fs::OpenOptions;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use serde::Serialize;

use crate::wall::{UnixTime, WallClock};

/// One audited event.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
#[non_exhaustive]
pub enum AuditEvent {
    /// A policy version was put in force.
    Loaded {
        /// The new version.
        version: String,
        /// The version it replaced, if any.
        previous: Option<String>,
        /// Where it came from.
        source: String,
        /// How many limits it has.
        limits: usize,
        /// How many exemptions it has.
        exemptions: usize,
        /// Limits whose parameters (their own or an override's) changed: token buckets are
        /// carried over; window counts and leases keep their keys unless the window or the
        /// algorithm changed.
        changed_limits: Vec<String>,
        /// In a policy directory, the files added, removed or changed since the version it
        /// replaced: whose change this load is. Left out when there are none.
        #[serde(skip_serializing_if = "Vec::is_empty")]
        changed_files: Vec<String>,
    },
    /// A file failed validation; the version in force stays.
    Refused {
        /// Where it came from.
        source: String,
        /// The full error, one line.
        error: String,
        /// The version that stays in force.
        kept_version: String,
    },
    /// The previous version was put back.
    RolledBack {
        /// The version taken out of force.
        from: String,
        /// The version put back.
        to: String,
    },
    /// An exemption lifted a limit for one decision.
    ExemptionUsed {
        /// The limit lifted.
        limit: String,
        /// The bucket that was not charged.
        bucket_key: String,
        /// Who owns the exemption.
        owner: String,
        /// Why it exists.
        reason: String,
        /// When it ends (RFC 3339).
        expires: String,
        /// Uses so far, including this one.
        uses: u64,
        /// The policy version that decided.
        policy_version: String,
    },
    /// An exemption's expiry passed: from now on its limit applies to the subjects it lifted.
    /// Written once per exemption, by the first housekeeping after the instant
    /// ([`crate::PolicyEngine::report_expired_exemptions`]).
    ExemptionExpired {
        /// The limit that applies again.
        limit: String,
        /// Who owns the exemption.
        owner: String,
        /// Why it existed.
        reason: String,
        /// When it ended (RFC 3339).
        expired: String,
        /// The decisions it lifted the limit for.
        uses: u64,
        /// The policy version it belongs to.
        policy_version: String,
    },
    /// A bucket an operator reset: as if never used ([`crate::PolicyEngine::reset_on`]).
    Reset {
        /// The limit.
        limit: String,
        /// The bucket.
        bucket_key: String,
        /// The policy version that matched.
        policy_version: String,
    },
    /// An operator put every limit in shadow mode ([`crate::PolicyEngine::set_shadow_all`]):
    /// nothing is rejected until it is turned off.
    ShadowAllOn {
        /// Why, as the operator gave it.
        reason: String,
        /// Whether it is the fleet's switch, read from the shared store.
        fleet: bool,
        /// The domains it is narrowed to ([`crate::ShadowScope`]); with `limits` empty too, it
        /// covers every limit.
        #[serde(skip_serializing_if = "Vec::is_empty")]
        domains: Vec<String>,
        /// The limits it is narrowed to.
        #[serde(skip_serializing_if = "Vec::is_empty")]
        limits: Vec<String>,
        /// The policy version in force.
        policy_version: String,
    },
    /// The switch is off: every limit has its own mode again, unless the other switch (this
    /// process's or the fleet's) is on.
    ShadowAllOff {
        /// Why it had been turned on.
        reason: String,
        /// When it had been turned on (RFC 3339).
        since: String,
        /// Whether it was the fleet's switch.
        fleet: bool,
        /// The domains it had been narrowed to.
        #[serde(skip_serializing_if = "Vec::is_empty")]
        domains: Vec<String>,
        /// The limits it had been narrowed to.
        #[serde(skip_serializing_if = "Vec::is_empty")]
        limits: Vec<String>,
        /// The policy version in force.
        policy_version: String,
    },
    /// A decision made without the shared store (failure mode closed or open).
    Degraded {
        /// The limit.
        limit: String,
        /// The bucket.
        bucket_key: String,
        /// Why the store could not answer.
        reason: String,
        /// `closed` or `open`.
        failure_mode: String,
        /// What was decided.
        allowed: bool,
        /// The policy version that decided.
        policy_version: String,
    },
}

#[derive(Serialize)]
struct Line<'a> {
    ts: String,
    #[serde(flatten)]
    event: &'a AuditEvent,
}

/// Where audit lines go: a file (appended), standard output, or any writer.
///
/// Shared by reference; lines from concurrent writers never interleave.
pub struct AuditLog {
    out: Mutex<Box<dyn Write + Send>>,
    /// The file lines are appended to, opened again by [`AuditLog::reopen`]; `None` for
    /// standard output or another writer.
    path: Option<PathBuf>,
    clock: Box<dyn WallClock>,
    failed_writes: AtomicU64,
}

impl std::fmt::Debug for AuditLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuditLog")
            .field("failed_writes", &self.failed_writes())
            .finish_non_exhaustive()
    }
}

impl AuditLog {
    /// Lines to `out`, stamped by `clock`.
    pub fn new(out: Box<dyn Write + Send>, clock: Box<dyn WallClock>) -> Self {
        Self {
            out: Mutex::new(out),
            path: None,
            clock,
            failed_writes: AtomicU64::new(0),
        }
    }

    /// Lines to standard output.
    pub fn stdout(clock: Box<dyn WallClock>) -> Self {
        Self::new(Box::new(io::stdout()), clock)
    }

    /// Lines appended to the file at `path` (created if absent).
    ///
    /// # Errors
    ///
    /// When the file cannot be opened for appending.
    pub fn file(path: &Path, clock: Box<dyn WallClock>) -> io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Self {
            path: Some(path.to_owned()),
            ..Self::new(Box::new(file), clock)
        })
    }

    /// Opens the log's file again at its path, and appends there from now on: after logrotate
    /// (or an operator) renamed the file away, lines would otherwise keep going to the renamed
    /// one. Nothing to do for a log that is not a file.
    ///
    /// # Errors
    ///
    /// When the file cannot be opened; lines keep going where they went.
    pub fn reopen(&self) -> io::Result<()> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        *self.out.lock() = Box::new(file);
        Ok(())
    }

    /// Writes one event as one line.
    pub fn record(&self, event: &AuditEvent) {
        let line = Line {
            ts: self.clock.now().to_rfc3339(),
            event,
        };
        let Ok(mut text) = serde_json::to_vec(&line) else {
            self.failed_writes.fetch_add(1, Ordering::Relaxed);
            return;
        };
        text.push(b'\n');
        let mut out = self.out.lock();
        // One write_all of a whole line under the lock: lines never interleave.
        if out.write_all(&text).and_then(|()| out.flush()).is_err() {
            self.failed_writes.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Events that could not be written.
    pub fn failed_writes(&self) -> u64 {
        self.failed_writes.load(Ordering::Relaxed)
    }

    /// The time the log stamps lines with.
    pub fn now(&self) -> UnixTime {
        self.clock.now()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wall::ManualWallClock;
    use std::sync::Arc;

    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    struct Broken;

    impl Write for Broken {
        fn write(&mut self, _: &[u8]) -> io::Result<usize> {
            Err(io::Error::other("disk full"))
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn one_json_object_per_line() {
        let out = Shared::default();
        let clock = ManualWallClock::new(UnixTime::from_secs(1_800_000_000));
        let log = AuditLog::new(Box::new(out.clone()), Box::new(clock));
        log.record(&AuditEvent::RolledBack {
            from: "2".into(),
            to: "1".into(),
        });
        log.record(&AuditEvent::Refused {
            source: "p.yaml".into(),
            error: "p.yaml:3:4: limits[0].name: bad\nname".into(),
            kept_version: "1".into(),
        });
        let text = String::from_utf8(out.0.lock().clone()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        let first: serde_json::Value = serde_json::from_str(lines[0]).unwrap_or_default();
        assert_eq!(first["event"], "rolled_back");
        assert_eq!(first["ts"], "2027-01-15T08:00:00Z");
        assert_eq!(first["to"], "1");
        let second: serde_json::Value = serde_json::from_str(lines[1]).unwrap_or_default();
        assert_eq!(second["kept_version"], "1");
        assert_eq!(log.now(), UnixTime::from_secs(1_800_000_000));
    }

    /// As logrotate does: the file renamed away, then the log reopened at its path.
    #[test]
    fn a_reopened_file_log_writes_to_a_new_file_at_its_path() {
        let dir = std::env::temp_dir().join(format!("tollgate-audit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("audit.jsonl");
        let rotated = dir.join("audit.jsonl.1");
        let log = AuditLog::file(&path, Box::new(ManualWallClock::default())).unwrap();
        let event = |to: &str| AuditEvent::RolledBack {
            from: "2".into(),
            to: to.into(),
        };
        log.record(&event("before"));
        std::fs::rename(&path, &rotated).unwrap();
        log.record(&event("renamed"));
        log.reopen().unwrap();
        log.record(&event("reopened"));
        let old = std::fs::read_to_string(&rotated).unwrap();
        let new = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(old.contains("before") && old.contains("renamed"), "{old}");
        assert!(!old.contains("reopened"), "{old}");
        assert_eq!(new.lines().count(), 1, "{new}");
        assert!(new.contains("reopened"), "{new}");
        assert_eq!(log.failed_writes(), 0);
    }

    #[test]
    fn a_log_that_is_no_file_has_nothing_to_reopen() {
        let out = Shared::default();
        let log = AuditLog::new(Box::new(out.clone()), Box::new(ManualWallClock::default()));
        log.reopen().unwrap();
        log.record(&AuditEvent::RolledBack {
            from: "2".into(),
            to: "1".into(),
        });
        assert_eq!(out.0.lock().iter().filter(|&&b| b == b'\n').count(), 1);
    }

    #[test]
    fn failed_writes_are_counted_not_raised() {
        let log = AuditLog::new(Box::new(Broken), Box::new(ManualWallClock::default()));
        log.record(&AuditEvent::RolledBack {
            from: "2".into(),
            to: "1".into(),
        });
        assert_eq!(log.failed_writes(), 1);
        assert_eq!(format!("{log:?}"), "AuditLog { failed_writes: 1, .. }");
    }
}
