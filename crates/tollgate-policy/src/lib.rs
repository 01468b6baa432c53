//! tollgate's control plane: the policy file, compiled into indexes that map requests to limits.
//!
//! The policy file (YAML, documented in `docs/policy.md`) says which limits apply to which
//! requests and how to change them safely in production. This crate turns it into a [`Policy`]:
//!
//! * [`compile`] parses and validates a file in one pass; a [`Policy`] that exists is valid, and
//!   every error names the file, line, column and field path ([`Diagnostic`]).
//!   [`compile_directory`] merges the files of a policy directory (one per team) into one.
//! * [`Policy::match_into`] maps a domain and descriptors to the applicable rate limits, with
//!   bucket keys and effective parameters (overrides, shadow, rollout, exemptions), through
//!   per-domain indexes: no scan of the limits, no allocation beyond the bucket keys.
//!   [`Policy::lease_match_into`] does the same for concurrency limits, which are leased
//!   rather than checked and so never among the former.
//! * [`PolicyEngine`] holds the version in force behind an atomic pointer swap, keeps the last
//!   versions for rollback, reloads from a file (refusing a bad one and keeping the last good),
//!   decides requests against a [`tollgate::MemoryStore`] or a shared [`tollgate::Store`], all or
//!   nothing, and takes and releases leases ([`PolicyEngine::acquire`]) against a
//!   [`tollgate::LeaseStore`].
//! * [`audit`] writes loads, refusals, rollbacks, exemption uses and degraded decisions as JSON
//!   lines; [`watch`] reloads on file changes; [`envoy`] imports envoyproxy/ratelimit configs.
//!
//! ```
//! use tollgate_policy::{UnixTime, compile};
//!
//! let policy = compile("inline.yaml", r#"
//! version: "7"
//! limits:
//!   - name: per-user
//!     domain: api
//!     key: [user]
//!     capacity: 20
//!     refill: 10/s
//! "#)?;
//! let matched = policy.matches("api", &[[("user", "u1")]], UnixTime::from_secs(0));
//! assert_eq!(matched[0].bucket_key, "per-user|u1");
//! assert_eq!(matched[0].params().capacity(), 20);
//! # Ok::<(), tollgate_policy::Error>(())
//! ```
//!
//! A concurrency limit holds leases instead:
//!
//! ```
//! use tollgate_policy::{EngineOptions, PolicyEngine, compile};
//!
//! let policy = compile("inline.yaml", r#"
//! limits:
//!   - name: exports
//!     domain: api
//!     key: [tenant]
//!     algorithm: concurrency
//!     max_in_flight: 1
//!     lease_timeout: 30s
//! "#)?;
//! let engine = PolicyEngine::new(policy, EngineOptions::default());
//! let tenant = [("tenant", "acme")];
//! assert!(engine.acquire("api", &[tenant], "lease-1")?.held);
//! assert!(!engine.acquire("api", &[tenant], "lease-2")?.allowed);
//! assert!(engine.release("lease-1")?);
//! assert!(engine.acquire("api", &[tenant], "lease-2")?.allowed);
//! # Ok::<(), tollgate_policy::Error>(())
//! ```

pub mod audit;
mod compile;
mod engine;
pub mod envoy;
mod error;
mod key;
mod lint;
mod policy;
mod schema;
mod sources;
mod wall;
pub mod watch;

pub use compile::{compile, compile_directory};

pub use engine::{
    Costs, EngineOptions, LeaseLimitOutcome, LeaseOutcome, LimitOutcome, Outcome, PolicyEngine,
    PolicyStatus, ResetBucket, ResetOutcome, ShadowAll, ShadowScope, SkippedLimit,
};
pub use envoy::{ImportOptions, import_envoy, import_envoy_files, import_envoy_with};
pub use error::{Diagnostic, Error};
pub use lint::{EXPIRING_SOON, Warning, lint, lint_by_file};
pub use policy::{
    Descriptor, Effect, Exemption, FailureMode, FileChange, LeaseMatched, LimitDef, Matched, Mode,
    Network, NetworkError, Override, Params, Policy, RequestDescriptor, RequestedLimit, Scope,
    SourceFile, ValueList, ValueMatch, forwarded_client,
};
pub use sources::policy_files_in;
pub use wall::{ManualWallClock, SystemWallClock, UnixTime, WallClock};

use std::path::Path;

/// A JSON Schema (draft 7) of the policy file, for editors: completion, a description of each
/// field, and the mistakes a schema can see (a misspelt field, a rate without a unit, another
/// algorithm's parameters) flagged as they are typed. What `tollgate schema` prints.
///
/// It never flags a file [`compile`] takes (the crate's tests hold it to the compiler), but it
/// sees less than the compiler does: unique names, references between limits and
/// exact-arithmetic bounds are the compiler's alone, so [`validate`] stays the check to run.
///
/// ```
/// let schema: serde_json::Value = serde_json::from_str(tollgate_policy::JSON_SCHEMA)?;
/// assert_eq!(schema["required"][0], "limits");
/// # Ok::<(), serde_json::Error>(())
/// ```
pub const JSON_SCHEMA: &str = include_str!("../policy.schema.json");

/// Reads and validates the policy file, or the policy directory ([`compile_directory`]), at
/// `path`: what `tollgate validate PATH` runs.
///
/// # Errors
///
/// [`Error::Io`] when a file cannot be read, [`Error::EmptyDirectory`] for a directory without
/// policy files, [`Error::Invalid`] with the first problem.
pub fn validate(path: &Path) -> Result<Policy, Error> {
    sources::Sources::read(path)?.compile(&path.display().to_string())
}
