//! From the serde mirror to a [`Policy`]: every rule that spans fields, and the indexes.
//!
//! This is the only constructor of [`Policy`], so a policy that exists is valid: parameters are
//! core [`Limit`]s or [`LeaseLimit`]s, names are unique and key-safe, references resolve, open
//! failure modes have a bounded emergency budget. The first problem found is reported, with its
//! position and path.

use std::collections::{BTreeMap, HashMap as StdHashMap, HashSet};
use std::hash::BuildHasher;
use std::sync::Arc;

use hashbrown::{HashMap, HashTable};
use serde_saphyr::Spanned;
use tollgate::{Algorithm, LeaseLimit, Limit, MAX_IN_FLIGHT, Rate};

use crate::error::Error;
use crate::key::{self, stable_hash};
use crate::policy::{
    Conditions, DomainIndex, Exemption, FailureMode, Filed, LimitDef, Mode, NetLengths, Override,
    Params, Policy, Scope, SourceFile, ValueMatch,
};
use crate::schema::{
    self, EmergencyText, ExemptionSpec, FailureModeSpec, LeaseTimeoutText, LimitSpec, ModeSpec,
    PolicyFile, RateText, RequestLimitSpec, ScopeSpec, WhenValue, WindowText, at, at_location,
};
use crate::wall::UnixTime;

/// The longest name a limit or override may have: names go into every bucket key.
const MAX_NAME: usize = 128;

/// The most limits (and, separately, exemptions) one policy may hold: far above any real
/// policy, and low enough that positions fit the `u32` indexes of the matcher.
const MAX_ENTRIES: usize = 1_000_000;

/// Parses and validates policy `text`, reporting problems against `file`.
pub fn compile(file: &str, text: &str) -> Result<Policy, Error> {
    let parsed = schema::parse(file, text)?;
    let unit = Unit {
        file: file.to_owned(),
        source: None,
        parsed,
    };
    build(file, &Version::OfText(text), vec![unit])
}

/// Parses and validates the policy files of directory `dir`, given as (file name, text), and
/// merges them into one policy: what `--config DIR` loads. Problems are reported against
/// `dir/name`.
///
/// Each file is written as a policy file of its own and its `defaults` apply to its own
/// limits; names are unique across the directory, and `replaces` and exemptions may name a
/// limit of any file. At most one file may set `version`; without one, the version is a hash of
/// the names and contents. The files are taken in the order given (the directory reader sorts
/// them by name), which is the order of [`Policy::limits`].
///
/// ```
/// let policy = tollgate_policy::compile_directory("policy.d", &[
///     ("payments.yaml", "limits:\n  - {name: pay, domain: api, capacity: 5, refill: 1/s}\n"),
///     ("search.yaml", "limits:\n  - {name: search, domain: api, capacity: 50, refill: 10/s}\n"),
/// ])?;
/// assert_eq!(policy.files()[1].name(), "search.yaml");
/// assert_eq!(policy.limit("search").and_then(|l| l.file()), Some("search.yaml"));
/// # Ok::<(), tollgate_policy::Error>(())
/// ```
///
/// # Errors
///
/// The first problem found, in the file it is in; [`Error::EmptyDirectory`] for no files.
pub fn compile_directory(dir: &str, files: &[(&str, &str)]) -> Result<Policy, Error> {
    if files.is_empty() {
        return Err(Error::EmptyDirectory { path: dir.into() });
    }
    let mut units = Vec::with_capacity(files.len());
    for (name, text) in files {
        let file = std::path::Path::new(dir).join(name).display().to_string();
        let parsed = schema::parse(&file, text)?;
        units.push(Unit {
            file,
            source: Some(SourceFile {
                name: (*name).into(),
                digest: stable_hash(text.as_bytes()),
            }),
            parsed,
        });
    }
    build(dir, &Version::OfFiles(files), units)
}

/// One parsed file of a policy being compiled.
struct Unit {
    /// The file as diagnostics name it.
    file: String,
    /// Its name and digest in a policy directory; `None` for a policy of one file.
    source: Option<SourceFile>,
    parsed: PolicyFile,
}

impl Unit {
    /// Its name in a policy directory, which its limits and exemptions keep.
    fn name(&self) -> Option<Arc<str>> {
        self.source.as_ref().map(|s| Arc::clone(&s.name))
    }
}

/// What a policy that declares no version is versioned by.
enum Version<'a> {
    OfText(&'a str),
    OfFiles(&'a [(&'a str, &'a str)]),
}

/// The hash a directory's policy is versioned by, and an engine recognises unchanged files by:
/// names and contents, each length-prefixed so that no two sets of files hash the same bytes.
pub(crate) fn files_hash<'a>(files: impl IntoIterator<Item = (&'a str, &'a str)>) -> u64 {
    let mut bytes = Vec::new();
    for (name, text) in files {
        for part in [name, text] {
            bytes.extend_from_slice(&(part.len() as u64).to_le_bytes());
            bytes.extend_from_slice(part.as_bytes());
        }
    }
    stable_hash(&bytes)
}

fn check_name(file: &str, name: &Spanned<String>, path: String, what: &str) -> Result<(), Error> {
    let value = &name.value;
    let valid = !value.is_empty()
        && value.len() <= MAX_NAME
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if valid {
        return Ok(());
    }
    Err(at(
        file,
        name,
        path,
        format!(
            "invalid {what} name {value:?}: use 1 to {MAX_NAME} characters among letters, digits, \
             '-', '_' and '.'"
        ),
    ))
}

fn conditions(
    file: &str,
    when: &Spanned<BTreeMap<String, WhenValue>>,
    path: String,
) -> Result<Conditions, Error> {
    if when.value.keys().any(String::is_empty) {
        return Err(at(
            file,
            when,
            path,
            "descriptor entry names must not be empty".into(),
        ));
    }
    Ok(plain_conditions(&when.value))
}

fn plain_conditions(when: &BTreeMap<String, WhenValue>) -> Conditions {
    when.iter()
        .map(|(k, v)| {
            let test = match v {
                WhenValue::Exact(text) => ValueMatch::Exact(text.as_str().into()),
                WhenValue::Prefix(text) => ValueMatch::Prefix(text.as_str().into()),
                WhenValue::Network(network) => ValueMatch::Network(Box::new(network.clone())),
                WhenValue::AnyOf {
                    values,
                    prefixes,
                    networks,
                } => {
                    let boxed = |list: &[String]| list.iter().map(|v| v.as_str().into()).collect();
                    // The schema refuses an empty list; were one to come, it would match
                    // nothing, as an empty `AnyOf` does.
                    ValueMatch::any_of(boxed(values), boxed(prefixes), networks.clone())
                        .unwrap_or_else(|| ValueMatch::AnyOf(Box::default()))
                }
            };
            (k.as_str().into(), test)
        })
        .collect()
}

/// Resolves each limit's `replaces` to positions: names of other limits of its own domain
/// (a limit of another domain never applies to the same request), each once.
fn resolve_replaces(specs: &[Spec<'_, LimitSpec>], limits: &mut [LimitDef]) -> Result<(), Error> {
    for (i, spec) in specs.iter().enumerate() {
        let Some(names) = &spec.spec.replaces else {
            continue;
        };
        let file = spec.file();
        let path = format!("limits[{}].replaces", spec.at);
        let mut replaced = Vec::with_capacity(names.value.len());
        for name in &names.value {
            let problem = match limits.iter().position(|l| *l.name == **name) {
                None => Some(format!("no limit is named {name:?}")),
                Some(j) if j == i => Some("a limit cannot replace itself".to_owned()),
                Some(j) if limits[j].domain != limits[i].domain => Some(format!(
                    "limit {name:?} is of domain {:?}, not {:?}: it never applies to the same \
                     request",
                    limits[j].domain, limits[i].domain
                )),
                // Rate limits and concurrency limits are matched apart (a check or a lease).
                Some(j)
                    if limits[j].params.rate().is_some() != limits[i].params.rate().is_some() =>
                {
                    Some(format!(
                        "limit {name:?} is not of this limit's kind (a rate limit or a \
                         concurrency limit): it never applies to the same request"
                    ))
                }
                // At most MAX_ENTRIES limits, checked before.
                Some(j) if replaced.contains(&(j as u32)) => {
                    Some(format!("{name:?} is named twice"))
                }
                Some(j) => {
                    replaced.push(j as u32);
                    None
                }
            };
            if let Some(message) = problem {
                return Err(at(file, names, path, message));
            }
        }
        limits[i].replaces = replaced.into_boxed_slice();
    }
    Ok(())
}

fn limit_of(file: &str, capacity: &Spanned<u64>, refill: Rate, path: &str) -> Result<Limit, Error> {
    Limit::new(capacity.value, refill)
        .map_err(|err| at(file, capacity, format!("{path}.capacity"), format!("{err}")))
}

/// A limit's `algorithm`: the policy's name for it and how its parameters are made.
#[derive(Debug, Clone, Copy)]
struct AlgorithmSpec {
    name: &'static str,
    kind: Kind,
}

/// What an algorithm limits: a rate (by one of the core's algorithms), or leases in flight.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Rate(Algorithm),
    Concurrency,
}

/// The parameter fields an algorithm takes, which no other one does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    /// `capacity` and `refill`.
    Bucket,
    /// `limit` and `window`.
    Window,
    /// `max_in_flight` and `lease_timeout`.
    Concurrency,
}

impl Family {
    fn of(params: &Params) -> Family {
        match params {
            Params::Rate(limit) if limit.algorithm().is_window() => Family::Window,
            Params::Rate(_) => Family::Bucket,
            Params::Concurrency(_) => Family::Concurrency,
        }
    }
}

impl Kind {
    fn family(self) -> Family {
        match self {
            Kind::Rate(algorithm) if algorithm.is_window() => Family::Window,
            Kind::Rate(_) => Family::Bucket,
            Kind::Concurrency => Family::Concurrency,
        }
    }
}

/// The names the policy accepts. `gcra` is the token bucket under GCRA's name: both admit
/// exactly the same requests (see [`Algorithm`]), so a file written for a GCRA limiter keeps
/// its meaning.
const ALGORITHMS: [AlgorithmSpec; 6] = [
    AlgorithmSpec {
        name: "token_bucket",
        kind: Kind::Rate(Algorithm::TokenBucket),
    },
    AlgorithmSpec {
        name: "gcra",
        kind: Kind::Rate(Algorithm::TokenBucket),
    },
    AlgorithmSpec {
        name: "fixed_window",
        kind: Kind::Rate(Algorithm::FixedWindow),
    },
    AlgorithmSpec {
        name: "sliding_window",
        kind: Kind::Rate(Algorithm::SlidingWindow),
    },
    AlgorithmSpec {
        name: "sliding_log",
        kind: Kind::Rate(Algorithm::SlidingLog),
    },
    AlgorithmSpec {
        name: "concurrency",
        kind: Kind::Concurrency,
    },
];

fn algorithm_of(
    file: &str,
    algorithm: Option<&Spanned<String>>,
    path: &str,
) -> Result<AlgorithmSpec, Error> {
    let Some(algorithm) = algorithm else {
        return Ok(ALGORITHMS[0]);
    };
    if let Some(known) = ALGORITHMS.iter().find(|a| a.name == algorithm.value) {
        return Ok(*known);
    }
    let message = format!(
        "unknown algorithm {:?}: use token_bucket (the default), gcra, fixed_window, \
         sliding_window, sliding_log or concurrency",
        algorithm.value
    );
    Err(at(file, algorithm, format!("{path}.algorithm"), message))
}

/// A limit's own parameters under `algorithm`: `capacity` and `refill` for a token bucket,
/// `limit` and `window` for the windows, `max_in_flight` and `lease_timeout` for concurrency,
/// never a mix.
fn base_params(
    file: &str,
    spec: &schema::LimitSpec,
    algorithm: AlgorithmSpec,
    path: &str,
) -> Result<Params, Error> {
    let name = algorithm.name;
    let family = algorithm.kind.family();
    Fields {
        capacity: spec.capacity.as_ref(),
        refill: spec.refill.as_ref(),
        limit: spec.limit.as_ref(),
        window: spec.window.as_ref(),
        max_in_flight: spec.max_in_flight.as_ref(),
        lease_timeout: spec.lease_timeout.as_ref(),
    }
    .refuse_foreign(file, path, family, name)?;
    let missing = |field: &str| {
        let message = format!(
            "missing field `{field}`: {}",
            fields_message(name, family, None)
        );
        at(file, &spec.name, path.to_owned(), message)
    };
    let kind = match algorithm.kind {
        Kind::Rate(kind) => kind,
        Kind::Concurrency => {
            let (Some(max), Some(timeout)) = (&spec.max_in_flight, &spec.lease_timeout) else {
                return Err(missing(if spec.max_in_flight.is_none() {
                    "max_in_flight"
                } else {
                    "lease_timeout"
                }));
            };
            let fallback = |message| at(file, &spec.name, path.to_owned(), message);
            return lease_limit(
                file,
                (max.value, Some(max)),
                (timeout.value.0, Some(timeout)),
                &fallback,
                path,
            )
            .map(Params::Concurrency);
        }
    };
    if kind.is_window() {
        let (Some(limit), Some(window)) = (&spec.limit, &spec.window) else {
            return Err(missing(if spec.limit.is_none() {
                "limit"
            } else {
                "window"
            }));
        };
        let fallback = |message| at(file, &spec.name, path.to_owned(), message);
        return window_limit(
            file,
            kind,
            (limit.value, Some(limit)),
            (window.value.0, Some(window)),
            &fallback,
            path,
        )
        .map(Params::Rate);
    }
    let (Some(capacity), Some(refill)) = (&spec.capacity, &spec.refill) else {
        return Err(missing(if spec.capacity.is_none() {
            "capacity"
        } else {
            "refill"
        }));
    };
    limit_of(file, capacity, refill.value.0, path).map(Params::Rate)
}

/// An override's parameters: the fields it sets, the limit's own for the others.
fn override_params(
    file: &str,
    o: &schema::OverrideSpec,
    base: &Params,
    path: &str,
) -> Result<Params, Error> {
    let name = match base {
        Params::Rate(limit) => limit.algorithm().as_str(),
        Params::Concurrency(_) => "concurrency",
    };
    Fields {
        capacity: o.capacity.as_ref(),
        refill: o.refill.as_ref(),
        limit: o.limit.as_ref(),
        window: o.window.as_ref(),
        max_in_flight: o.max_in_flight.as_ref(),
        lease_timeout: o.lease_timeout.as_ref(),
    }
    .refuse_foreign(file, path, Family::of(base), name)?;
    let base = match base {
        Params::Rate(limit) => limit,
        Params::Concurrency(lease) => return override_lease(file, o, lease, path),
    };
    if base.algorithm().is_window() {
        if o.limit.is_none() && o.window.is_none() {
            return Err(at(
                file,
                &o.when,
                path.to_owned(),
                "an override of a window limit must set limit, window or both".into(),
            ));
        }
        let window = o
            .window
            .as_ref()
            .map_or_else(|| base.window().unwrap_or_default(), |w| w.value.0);
        let limit = o.limit.as_ref().map_or(base.capacity(), |l| l.value);
        let fallback = |message| at(file, &o.when, path.to_owned(), message);
        return window_limit(
            file,
            base.algorithm(),
            (limit, o.limit.as_ref()),
            (window, o.window.as_ref()),
            &fallback,
            path,
        )
        .map(Params::Rate);
    }
    match (&o.capacity, &o.refill) {
        (None, None) => Err(at(
            file,
            &o.when,
            path.to_owned(),
            "an override must set capacity, refill or both".into(),
        )),
        (Some(capacity), refill) => {
            let rate = refill.as_ref().map_or(base.refill(), |r| r.value.0);
            limit_of(file, capacity, rate, path).map(Params::Rate)
        }
        (None, Some(refill)) => Limit::new(base.capacity(), refill.value.0)
            .map(Params::Rate)
            .map_err(|err| at(file, refill, format!("{path}.refill"), err.to_string())),
    }
}

/// An override of a concurrency limit (its fields already checked): `max_in_flight`,
/// `lease_timeout` or both, the limit's own for the other.
fn override_lease(
    file: &str,
    o: &schema::OverrideSpec,
    base: &LeaseLimit,
    path: &str,
) -> Result<Params, Error> {
    if o.max_in_flight.is_none() && o.lease_timeout.is_none() {
        return Err(at(
            file,
            &o.when,
            path.to_owned(),
            "an override of a concurrency limit must set max_in_flight, lease_timeout or both"
                .into(),
        ));
    }
    let max = o
        .max_in_flight
        .as_ref()
        .map_or(base.max_in_flight(), |m| m.value);
    let timeout = o
        .lease_timeout
        .as_ref()
        .map_or(base.timeout(), |t| t.value.0);
    let fallback = |message| at(file, &o.when, path.to_owned(), message);
    lease_limit(
        file,
        (max, o.max_in_flight.as_ref()),
        (timeout, o.lease_timeout.as_ref()),
        &fallback,
        path,
    )
    .map(Params::Concurrency)
}

/// A concurrency limit of `max` leases held `timeout` each (the override's own fields, or
/// `None` where it keeps its limit's); an error points at the field its reason names.
fn lease_limit(
    file: &str,
    (max, max_at): (u64, Option<&Spanned<u64>>),
    (timeout, timeout_at): (std::time::Duration, Option<&Spanned<LeaseTimeoutText>>),
    fallback: &dyn Fn(String) -> Error,
    path: &str,
) -> Result<LeaseLimit, Error> {
    LeaseLimit::new(max, timeout).map_err(|err| {
        let about_timeout = matches!(
            err,
            tollgate::Error::InvalidLease { reason } if reason.starts_with("lease_timeout")
        );
        match (about_timeout, timeout_at, max_at) {
            (true, Some(t), _) | (false, Some(t), None) => {
                at(file, t, format!("{path}.lease_timeout"), err.to_string())
            }
            (_, _, Some(m)) => at(file, m, format!("{path}.max_in_flight"), err.to_string()),
            (_, None, None) => fallback(err.to_string()),
        }
    })
}

/// A window limit of `limit` per `window` (the override's own window, or `None` when it
/// keeps its limit's); an error about the window's length points at the window.
fn window_limit(
    file: &str,
    algorithm: Algorithm,
    (limit, limit_at): (u64, Option<&Spanned<u64>>),
    (window, window_at): (std::time::Duration, Option<&Spanned<WindowText>>),
    fallback: &dyn Fn(String) -> Error,
    path: &str,
) -> Result<Limit, Error> {
    let made = match algorithm {
        Algorithm::SlidingWindow => Limit::sliding_window(limit, window),
        Algorithm::SlidingLog => Limit::sliding_log(limit, window),
        _ => Limit::fixed_window(limit, window),
    };
    made.map_err(|err| {
        let about_window = matches!(err, tollgate::Error::LimitTooLarge)
            || matches!(err, tollgate::Error::InvalidWindow { reason } if reason.starts_with("the window"));
        match (about_window, window_at, limit_at) {
            (true, Some(w), _) | (false, Some(w), None) => {
                at(file, w, format!("{path}.window"), err.to_string())
            }
            (_, _, Some(l)) => at(file, l, format!("{path}.limit"), err.to_string()),
            (_, None, None) => fallback(err.to_string()),
        }
    })
}

/// The parameter fields of a limit or an override, as the file gives them.
struct Fields<'a> {
    capacity: Option<&'a Spanned<u64>>,
    refill: Option<&'a Spanned<RateText>>,
    limit: Option<&'a Spanned<u64>>,
    window: Option<&'a Spanned<WindowText>>,
    max_in_flight: Option<&'a Spanned<u64>>,
    lease_timeout: Option<&'a Spanned<LeaseTimeoutText>>,
}

impl Fields<'_> {
    /// Refuses, at the field, the first one `family` does not take, in the order capacity,
    /// refill, limit, window, max_in_flight, lease_timeout (`name` is the algorithm as the file
    /// calls it).
    fn refuse_foreign(
        &self,
        file: &str,
        path: &str,
        family: Family,
        name: &str,
    ) -> Result<(), Error> {
        let given = [
            (
                "capacity",
                Family::Bucket,
                self.capacity.map(|f| f.referenced),
            ),
            ("refill", Family::Bucket, self.refill.map(|f| f.referenced)),
            ("limit", Family::Window, self.limit.map(|f| f.referenced)),
            ("window", Family::Window, self.window.map(|f| f.referenced)),
            (
                "max_in_flight",
                Family::Concurrency,
                self.max_in_flight.map(|f| f.referenced),
            ),
            (
                "lease_timeout",
                Family::Concurrency,
                self.lease_timeout.map(|f| f.referenced),
            ),
        ];
        for (field, of, location) in given {
            if let Some(location) = location
                && of != family
            {
                return Err(at_location(
                    file,
                    location,
                    format!("{path}.{field}"),
                    fields_message(name, family, Some(of)),
                ));
            }
        }
        Ok(())
    }
}

/// What `algorithm` (of `family`) takes, for an error about a field of family `foreign` it
/// was given, or (`None`) about one it lacks.
fn fields_message(algorithm: &str, family: Family, foreign: Option<Family>) -> String {
    let (takes, rest) = match family {
        Family::Bucket => (
            "capacity and refill (as in capacity: 20 and refill: 10/s)",
            match foreign {
                Some(Family::Concurrency) => {
                    "; max_in_flight and lease_timeout are for concurrency"
                }
                _ => "; limit and window are for fixed_window and sliding_window",
            },
        ),
        Family::Window => (
            "limit and window (as in limit: 100 and window: 1m)",
            match foreign {
                Some(Family::Concurrency) => {
                    "; max_in_flight and lease_timeout are for concurrency"
                }
                _ => ", not capacity and refill",
            },
        ),
        Family::Concurrency => (
            "max_in_flight and lease_timeout (as in max_in_flight: 10 and lease_timeout: 30s)",
            match foreign {
                Some(Family::Bucket) => "; capacity and refill are for token_bucket and gcra",
                Some(Family::Window) => {
                    "; limit and window are for fixed_window and sliding_window"
                }
                _ => "",
            },
        ),
    };
    format!("{algorithm} takes {takes}{rest}")
}

/// What a `deny: true` limit is made of: no parameters (every one of them is refused with its
/// position, as is `algorithm`), so its `algorithm` reads `deny`; a nominal rate stands in its
/// [`Params`], which nothing decides by (matching marks its requests denied), and its failure
/// mode is moot: a deny is decided without the store.
fn deny_limit(
    file: &str,
    spec: &schema::LimitSpec,
    deny: &Spanned<bool>,
    path: &str,
) -> Result<(AlgorithmSpec, Params, FailureMode), Error> {
    let present = [
        ("capacity", spec.capacity.as_ref().map(|s| s.referenced)),
        ("refill", spec.refill.as_ref().map(|s| s.referenced)),
        ("limit", spec.limit.as_ref().map(|s| s.referenced)),
        ("window", spec.window.as_ref().map(|s| s.referenced)),
        (
            "max_in_flight",
            spec.max_in_flight.as_ref().map(|s| s.referenced),
        ),
        (
            "lease_timeout",
            spec.lease_timeout.as_ref().map(|s| s.referenced),
        ),
        ("algorithm", spec.algorithm.as_ref().map(|s| s.referenced)),
        ("emergency", spec.emergency.as_ref().map(|s| s.referenced)),
        (
            "request_limit",
            spec.request_limit.as_ref().map(|s| s.referenced),
        ),
    ];
    if let Some((field, Some(location))) = present.iter().find(|(_, at)| at.is_some()) {
        return Err(at_location(
            file,
            *location,
            format!("{path}.{field}"),
            format!("a deny limit has no parameters, yet {field} is set"),
        ));
    }
    if spec.failure_mode.is_some() {
        return Err(at(
            file,
            deny,
            format!("{path}.failure_mode"),
            "a deny limit is decided without the store, so it has no failure_mode".into(),
        ));
    }
    let nominal = Limit::per(1, std::time::Duration::from_secs(1))
        .map_err(|err| at(file, deny, format!("{path}.deny"), err.to_string()))?;
    Ok((DENY, Params::Rate(nominal), FailureMode::Closed))
}

/// The algorithm a deny limit reports: it decides as no algorithm does.
const DENY: AlgorithmSpec = AlgorithmSpec {
    name: "deny",
    kind: Kind::Rate(Algorithm::TokenBucket),
};

/// A limit's failure mode. An `emergency` must be of the limit's kind: a rate for a rate limit,
/// a number of leases for a concurrency limit (checked whatever the failure mode, since either
/// way it says the author misread what the limit is). `defaults.emergency`, a rate, is for rate
/// limits only: a concurrency limit without its own falls back to its `max_in_flight`.
fn failure_mode_of(
    file: &str,
    spec: &schema::LimitSpec,
    params: &Params,
    (default_failure, default_emergency): (FailureModeSpec, Option<&Spanned<RateText>>),
    path: &str,
) -> Result<FailureMode, Error> {
    let open = matches!(
        spec.failure_mode.unwrap_or(default_failure),
        FailureModeSpec::Open
    );
    let own = spec.emergency.as_ref();
    let own_path = || format!("{path}.emergency");
    if let Params::Concurrency(_) = params {
        let emergency = match own {
            None => None,
            Some(e) => match e.value {
                EmergencyText::InFlight(n) if (1..=MAX_IN_FLIGHT).contains(&n) => Some(n),
                EmergencyText::InFlight(_) => {
                    return Err(at(
                        file,
                        e,
                        own_path(),
                        format!(
                            "emergency must be 1 to {MAX_IN_FLIGHT} leases in flight per key \
                             (failure_mode: closed denies while the store is down)"
                        ),
                    ));
                }
                EmergencyText::Rate(_) => {
                    return Err(at(
                        file,
                        e,
                        own_path(),
                        "a concurrency limit's emergency is the number of leases a key may \
                         hold in this process while the store is down, such as emergency: 5, \
                         not a rate"
                            .into(),
                    ));
                }
            },
        };
        return Ok(if open {
            FailureMode::OpenInFlight { emergency }
        } else {
            FailureMode::Closed
        });
    }
    // The error points at the rate that was used: the limit's own, or the default.
    let rate = match (own, default_emergency) {
        (Some(e), _) => match e.value {
            EmergencyText::Rate(rate) => Some((rate, own_path(), e.referenced)),
            EmergencyText::InFlight(_) => {
                return Err(at(
                    file,
                    e,
                    own_path(),
                    "a rate limit's emergency is a rate, such as emergency: 2/s (a number of \
                     leases in flight is for concurrency limits)"
                        .into(),
                ));
            }
        },
        (None, Some(default)) => Some((
            default.value.0,
            "defaults.emergency".to_owned(),
            default.referenced,
        )),
        (None, None) => None,
    };
    if !open {
        return Ok(FailureMode::Closed);
    }
    let Some((rate, rate_path, location)) = rate else {
        return Err(at(
            file,
            &spec.name,
            own_path(),
            "failure_mode open needs an emergency rate (here or in defaults), such as \
             emergency: 2/s: a failing store must never mean unlimited"
                .into(),
        ));
    };
    let emergency = Limit::new(rate.amount(), rate)
        .map_err(|err| at_location(file, location, rate_path, err.to_string()))?;
    Ok(FailureMode::Open { emergency })
}

/// One entry of `limits` or `exemptions`, with the file it is in.
struct Spec<'a, T> {
    unit: &'a Unit,
    /// Its position in its file's list, for diagnostics.
    at: usize,
    spec: &'a T,
}

impl<T> Spec<'_, T> {
    fn file(&self) -> &str {
        &self.unit.file
    }
}

/// The version a policy declares, or the hash of its content: one file's text, or a
/// directory's names and contents. In a directory at most one file may declare it, since a
/// version names all of them.
fn version_of(units: &[Unit], content: &Version<'_>) -> Result<Arc<str>, Error> {
    let mut declared: Option<(&Unit, &str)> = None;
    for unit in units {
        let Some(version) = &unit.parsed.version else {
            continue;
        };
        let value = version.value.0.trim();
        if value.is_empty() || value.len() > 64 {
            return Err(at(
                &unit.file,
                version,
                "version".into(),
                "version must be 1 to 64 characters".into(),
            ));
        }
        if let Some((first, _)) = declared {
            return Err(at(
                &unit.file,
                version,
                "version".into(),
                format!(
                    "version is also set in {}: one version names every file of a policy \
                     directory, so set it in one file, or in none for a hash of the contents",
                    first.file
                ),
            ));
        }
        declared = Some((unit, value));
    }
    Ok(match (declared, content) {
        (Some((_, value)), _) => value.into(),
        // Same content, same version: a reload of an unchanged file is recognisable as such.
        (None, Version::OfText(text)) => {
            format!("sha-{:016x}", stable_hash(text.as_bytes())).into()
        }
        (None, Version::OfFiles(files)) => {
            format!("sha-{:016x}", files_hash(files.iter().copied())).into()
        }
    })
}

fn build(source: &str, content: &Version<'_>, units: Vec<Unit>) -> Result<Policy, Error> {
    let version = version_of(&units, content)?;
    let specs: Vec<Spec<'_, LimitSpec>> = units
        .iter()
        .flat_map(|unit| {
            (unit.parsed.limits.iter().enumerate()).map(move |(at, spec)| Spec { unit, at, spec })
        })
        .collect();
    let exemption_specs: Vec<Spec<'_, ExemptionSpec>> = units
        .iter()
        .flat_map(|unit| {
            (unit.parsed.exemptions.iter().enumerate()).map(move |(at, spec)| Spec {
                unit,
                at,
                spec,
            })
        })
        .collect();

    if let Some(spec) = specs.get(MAX_ENTRIES) {
        return Err(at(
            spec.file(),
            &spec.spec.name,
            format!("limits[{}]", spec.at),
            format!("a policy may hold at most {MAX_ENTRIES} limits"),
        ));
    }
    if let Some(spec) = exemption_specs.get(MAX_ENTRIES) {
        return Err(at(
            spec.file(),
            &spec.spec.limit,
            format!("exemptions[{}]", spec.at),
            format!("a policy may hold at most {MAX_ENTRIES} exemptions"),
        ));
    }
    // Where each name was first written, to point a duplicate in another file at it.
    let mut names: StdHashMap<&str, &Unit> = StdHashMap::new();
    let mut limits = Vec::with_capacity(specs.len());
    for (i, entry) in specs.iter().enumerate() {
        let (unit, spec) = (entry.unit, entry.spec);
        let file = unit.file.as_str();
        let defaults = &unit.parsed.defaults;
        let default_mode = defaults.mode.unwrap_or(ModeSpec::Enforce);
        let default_failure = defaults.failure_mode.unwrap_or(FailureModeSpec::Closed);
        let default_emergency = defaults.emergency.as_ref();
        let path = format!("limits[{}]", entry.at);
        check_name(file, &spec.name, format!("{path}.name"), "limit")?;
        if let Some(first) = names.insert(&spec.name.value, unit) {
            let elsewhere = if first.file == unit.file {
                String::new()
            } else {
                format!(" (also in {})", first.file)
            };
            return Err(at(
                file,
                &spec.name,
                format!("{path}.name"),
                format!(
                    "duplicate limit name {:?}{elsewhere}: names identify buckets",
                    spec.name.value
                ),
            ));
        }
        if spec.domain.value.is_empty() {
            return Err(at(
                file,
                &spec.domain,
                format!("{path}.domain"),
                "domain must not be empty".into(),
            ));
        }
        let when = match &spec.when {
            Some(when) => conditions(file, when, format!("{path}.when"))?,
            None => Box::new([]),
        };
        let key: &[String] = spec.key.as_ref().map_or(&[], |k| &k.value);
        let mut seen = HashSet::new();
        for (entry, spanned) in key.iter().zip(spec.key.iter().cycle()) {
            if entry.is_empty() || !seen.insert(entry.as_str()) {
                return Err(at(
                    file,
                    spanned,
                    format!("{path}.key"),
                    format!("key entry {entry:?} is empty or repeated"),
                ));
            }
        }
        let deny = spec.deny.as_ref().filter(|d| d.value);
        let (algorithm, params, failure_mode) = match deny {
            None => {
                let algorithm = algorithm_of(file, spec.algorithm.as_ref(), &path)?;
                let params = base_params(file, spec, algorithm, &path)?;
                let failure_mode = failure_mode_of(
                    file,
                    spec,
                    &params,
                    (default_failure, default_emergency),
                    &path,
                )?;
                (algorithm, params, failure_mode)
            }
            Some(spanned) => deny_limit(file, spec, spanned, &path)?,
        };

        let mut override_names = HashSet::new();
        let mut overrides = Vec::with_capacity(spec.overrides.len());
        for (j, o) in spec.overrides.iter().enumerate() {
            let opath = format!("{path}.overrides[{j}]");
            let name: Box<str> = match &o.name {
                Some(name) => {
                    check_name(file, name, format!("{opath}.name"), "override")?;
                    name.value.as_str().into()
                }
                None => j.to_string().into(),
            };
            if !override_names.insert(name.clone()) {
                let message = format!("duplicate override name {name:?}");
                return Err(match &o.name {
                    Some(spanned) => at(file, spanned, format!("{opath}.name"), message),
                    None => at(file, &o.when, format!("{opath}.name"), message),
                });
            }
            if o.when.value.is_empty() {
                return Err(at(
                    file,
                    &o.when,
                    format!("{opath}.when"),
                    "an override needs conditions: without them it would replace the limit's \
                     own parameters (change those instead)"
                        .into(),
                ));
            }
            let when = conditions(file, &o.when, format!("{opath}.when"))?;
            let unlimited = o.unlimited.as_ref().filter(|u| u.value);
            let denies = o.deny.as_ref().filter(|d| d.value);
            if let (Some(_), Some(d)) = (unlimited, denies) {
                return Err(at(
                    file,
                    d,
                    format!("{opath}.deny"),
                    "an override is unlimited or denies, not both".into(),
                ));
            }
            let params = match unlimited
                .map(|u| ("unlimited", u))
                .or(denies.map(|d| ("deny", d)))
            {
                _ if deny.is_some() && unlimited.is_none() => {
                    // A deny limit has no parameters for an override to change.
                    return Err(at(
                        file,
                        &o.when,
                        opath,
                        "a deny limit's overrides can only take requests out of it (unlimited: \
                         true); for a rate, write a limit with parameters and a deny override"
                            .into(),
                    ));
                }
                None => override_params(file, o, &params, &opath)?,
                Some((what, spanned)) => {
                    // Parameters beside `unlimited: true` or `deny: true` would never apply:
                    // refused rather than left to mislead a reader.
                    let set = [
                        ("capacity", o.capacity.is_some()),
                        ("refill", o.refill.is_some()),
                        ("limit", o.limit.is_some()),
                        ("window", o.window.is_some()),
                        ("max_in_flight", o.max_in_flight.is_some()),
                        ("lease_timeout", o.lease_timeout.is_some()),
                    ];
                    if let Some((field, _)) = set.iter().find(|(_, set)| *set) {
                        let article = if what == "deny" {
                            "a deny"
                        } else {
                            "an unlimited"
                        };
                        return Err(at(
                            file,
                            spanned,
                            format!("{opath}.{what}"),
                            format!("{article} override sets no parameters, yet {field} is set"),
                        ));
                    }
                    params
                }
            };
            overrides.push(Override {
                name,
                when,
                tag: key::params_tag(&params),
                params,
                unlimited: unlimited.is_some(),
                deny: denies.is_some(),
            });
        }

        let scope = match &spec.scope {
            None => Scope::Regional,
            Some(s) => match s.value {
                ScopeSpec::Regional => Scope::Regional,
                // A share is paid for in advance as tokens of a bucket and given back the
                // same way; window counts and leases have no such tokens to hand over.
                ScopeSpec::Global if !matches!(algorithm.name, "token_bucket" | "gcra") => {
                    return Err(at(
                        file,
                        s,
                        format!("{path}.scope"),
                        format!(
                            "scope global needs a token_bucket or gcra limit, not {}",
                            algorithm.name
                        ),
                    ));
                }
                ScopeSpec::Global => Scope::Global,
            },
        };
        let request_limit = match &spec.request_limit {
            None => false,
            Some(r) => match r.value {
                RequestLimitSpec::Ignore => false,
                // Envoy says a limit as "N per unit", which is a bucket of N refilled N per
                // unit; a window or a number of leases would need another reading of it.
                RequestLimitSpec::Apply if !matches!(algorithm.name, "token_bucket" | "gcra") => {
                    return Err(at(
                        file,
                        r,
                        format!("{path}.request_limit"),
                        format!(
                            "request_limit apply needs a token_bucket or gcra limit, not {}",
                            algorithm.name
                        ),
                    ));
                }
                // A global limit's shares are sized by its parameters, the same everywhere;
                // a limit asked for per request has none to size them by.
                RequestLimitSpec::Apply if scope == Scope::Global => {
                    return Err(at(
                        file,
                        r,
                        format!("{path}.request_limit"),
                        "request_limit apply needs a regional limit, not scope global".into(),
                    ));
                }
                RequestLimitSpec::Apply => true,
            },
        };
        let mode = match spec.mode.unwrap_or(default_mode) {
            ModeSpec::Enforce => Mode::Enforce,
            ModeSpec::Shadow => Mode::Shadow,
        };
        // A key entry also listed in `when` is one entry of the descriptor, not two.
        let exact = spec.exact.then(|| {
            let in_when = |k: &String| spec.when.as_ref().is_some_and(|w| w.value.contains_key(k));
            when.len() + key.iter().filter(|k| !in_when(k)).count()
        });
        limits.push(LimitDef {
            // At most MAX_ENTRIES, checked above.
            index: i as u32,
            name: spec.name.value.as_str().into(),
            domain: spec.domain.value.as_str().into(),
            when,
            key: key.iter().map(|k| k.as_str().into()).collect(),
            exact,
            filed: Filed::Always,
            tag: key::params_tag(&params),
            params,
            algorithm: algorithm.name,
            mode,
            rollout: spec.rollout.map_or(10_000, |p| p.0),
            failure_mode,
            scope,
            overrides: overrides.into_boxed_slice(),
            exemptions: Box::new([]),
            replaces: Box::new([]),
            request_limit,
            deny: deny.is_some(),
            file: unit.name(),
        });
    }
    resolve_replaces(&specs, &mut limits)?;

    let mut exemptions = Vec::with_capacity(exemption_specs.len());
    let mut per_limit: Vec<Vec<u32>> = vec![Vec::new(); limits.len()];
    for (i, entry) in exemption_specs.iter().enumerate() {
        let (file, spec) = (entry.file(), entry.spec);
        let path = format!("exemptions[{}]", entry.at);
        let Some(limit) = limits.iter().position(|l| *l.name == *spec.limit.value) else {
            return Err(at(
                file,
                &spec.limit,
                format!("{path}.limit"),
                format!("no limit is named {:?}", spec.limit.value),
            ));
        };
        for (field, value) in [("owner", &spec.owner), ("reason", &spec.reason)] {
            if value.value.trim().is_empty() {
                return Err(at(
                    file,
                    value,
                    format!("{path}.{field}"),
                    format!("an exemption needs a non-empty {field}"),
                ));
            }
        }
        per_limit[limit].push(i as u32);
        exemptions.push(Exemption {
            limit: spec.limit.value.as_str().into(),
            when: plain_conditions(&spec.when),
            owner: spec.owner.value.as_str().into(),
            reason: spec.reason.value.as_str().into(),
            expires: UnixTime::from_nanos(spec.expires.0),
            uses: Default::default(),
            expiry_reported: Default::default(),
            file: entry.unit.name(),
        });
    }
    for (limit, list) in limits.iter_mut().zip(per_limit) {
        limit.exemptions = list.into_boxed_slice();
    }

    let hasher = foldhash::fast::RandomState::default();
    let mut domains: HashMap<Box<str>, DomainIndex, _> =
        HashMap::with_hasher(foldhash::fast::RandomState::default());
    type Lists = StdHashMap<u64, Vec<u32>>;
    // File each limit under its most selective condition: the exact `when` pair, else the
    // prefix or network condition, else the key entry, that the fewest limits of its domain
    // share. Filing under a pair such as method=POST would make every POST request try every
    // limit filed there.
    let mut pair_use: StdHashMap<(&str, &str, &str), usize> = StdHashMap::new();
    let mut prefix_use: StdHashMap<(&str, &str, &str), usize> = StdHashMap::new();
    let mut network_use: StdHashMap<(&str, &str, ipnet::IpNet), usize> = StdHashMap::new();
    let mut entry_use: StdHashMap<(&str, &str), usize> = StdHashMap::new();
    for limit in &limits {
        let domain = &*limit.domain;
        for (entry, test) in &*limit.when {
            for prefix in test.prefixes() {
                *prefix_use.entry((domain, &**entry, prefix)).or_default() += 1;
            }
            for network in test.networks() {
                *network_use
                    .entry((domain, &**entry, network.net()))
                    .or_default() += 1;
            }
            for value in test.exact_values() {
                *pair_use.entry((domain, &**entry, value)).or_default() += 1;
            }
        }
        for entry in &*limit.key {
            *entry_use.entry((domain, &**entry)).or_default() += 1;
        }
    }
    // Among a limit's exact conditions (`wide` false) or its prefix and network ones (true).
    let rarest = |limit: &LimitDef, wide: bool| {
        (0..limit.when.len())
            .filter(|&i| limit.when[i].1.is_wide() == wide)
            .min_by_key(|&i| {
                // A list is as rare as its most shared item: a request with that value tries
                // every limit filed there.
                let (entry, test) = &limit.when[i];
                let key = (&*limit.domain, &**entry);
                let uses_of = |uses: &StdHashMap<(&str, &str, &str), usize>, item: &str| {
                    uses.get(&(key.0, key.1, item)).copied().unwrap_or(0)
                };
                if !wide {
                    return test
                        .exact_values()
                        .iter()
                        .map(|v| uses_of(&pair_use, v))
                        .max()
                        .unwrap_or(0);
                }
                let prefixes = test.prefixes().iter().map(|p| uses_of(&prefix_use, p));
                let networks = test.networks().iter().map(|n| {
                    network_use
                        .get(&(key.0, key.1, n.net()))
                        .copied()
                        .unwrap_or(0)
                });
                prefixes.chain(networks).max().unwrap_or(0)
            })
    };
    #[derive(Default)]
    struct Staged<'a> {
        pairs: Lists,
        prefixes: Lists,
        lengths: StdHashMap<&'a str, Vec<usize>>,
        networks: Lists,
        net_lengths: StdHashMap<&'a str, Vec<ipnet::IpNet>>,
        entries: Lists,
        always: Vec<u32>,
        request_limits: bool,
    }
    let mut filed_at = Vec::with_capacity(limits.len());
    let mut staging: StdHashMap<&str, Staged<'_>> = StdHashMap::new();
    for limit in &limits {
        let staged = staging.entry(&*limit.domain).or_default();
        staged.request_limits |= limit.request_limit;
        let filed = if let Some(i) = rarest(limit, false) {
            Filed::Pair(i)
        } else if let Some(i) = rarest(limit, true) {
            Filed::Items(i)
        } else if let Some(i) = (0..limit.key.len()).min_by_key(|&i| {
            entry_use
                .get(&(&*limit.domain, &*limit.key[i]))
                .copied()
                .unwrap_or(0)
        }) {
            Filed::Key(i)
        } else {
            Filed::Always
        };
        let list = match filed {
            Filed::Pair(i) | Filed::Items(i) => {
                // Under each of its values, prefixes and networks; two of them whose hashes
                // collide file it once.
                let (entry, test) = (&*limit.when[i].0, &limit.when[i].1);
                let file = |lists: &mut Lists, hash: u64| {
                    let list = lists.entry(hash).or_default();
                    if list.last() != Some(&limit.index) {
                        list.push(limit.index);
                    }
                };
                for value in test.exact_values() {
                    file(&mut staged.pairs, hasher.hash_one((entry, &**value)));
                }
                for prefix in test.prefixes() {
                    file(&mut staged.prefixes, hasher.hash_one((entry, &**prefix)));
                    staged.lengths.entry(entry).or_default().push(prefix.len());
                }
                for network in test.networks() {
                    let net = network.net();
                    file(&mut staged.networks, hasher.hash_one((entry, net)));
                    staged.net_lengths.entry(entry).or_default().push(net);
                }
                filed_at.push(filed);
                continue;
            }
            Filed::Key(i) => staged.entries.entry(hasher.hash_one(&*limit.key[i])),
            Filed::Always => {
                staged.always.push(limit.index);
                filed_at.push(filed);
                continue;
            }
        };
        list.or_default().push(limit.index);
        filed_at.push(filed);
    }
    for (domain, staged) in staging {
        let table = |lists: Lists| {
            let mut table = HashTable::with_capacity(lists.len());
            for (hash, list) in lists {
                table.insert_unique(hash, (hash, list.into_boxed_slice()), |(h, _)| *h);
            }
            table
        };
        let mut prefix_lengths = HashTable::with_capacity(staged.lengths.len());
        for (entry, mut lengths) in staged.lengths {
            lengths.sort_unstable();
            lengths.dedup();
            let hash = hasher.hash_one(entry);
            prefix_lengths.insert_unique(
                hash,
                (hash, entry.into(), lengths.into_boxed_slice()),
                |(h, ..)| *h,
            );
        }
        let mut network_lengths = HashTable::with_capacity(staged.net_lengths.len());
        for (entry, nets) in staged.net_lengths {
            let hash = hasher.hash_one(entry);
            network_lengths.insert_unique(
                hash,
                (hash, entry.into(), NetLengths::of(nets.iter())),
                |(h, ..)| *h,
            );
        }
        domains.insert(
            domain.into(),
            DomainIndex {
                by_pair: table(staged.pairs),
                by_prefix: table(staged.prefixes),
                prefix_lengths,
                by_network: table(staged.networks),
                network_lengths,
                by_entry: table(staged.entries),
                always: staged.always.into_boxed_slice(),
                request_limits: staged.request_limits,
            },
        );
    }

    for (limit, filed) in limits.iter_mut().zip(filed_at) {
        limit.filed = filed;
    }
    let files = units.iter().filter_map(|u| u.source.clone()).collect();
    Ok(Policy {
        version,
        source: source.into(),
        files,
        limits: limits.into_boxed_slice(),
        exemptions: exemptions.into_boxed_slice(),
        domains,
        hasher,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Matching finds the same limits wherever one is filed, so only the index shows which
    /// condition was chosen: the one the fewest limits of the domain share, so that a request
    /// with the shared value does not try every limit filed under it.
    #[test]
    fn each_limit_is_filed_under_its_rarest_condition() {
        let mut text = String::from("limits:\n");
        let common = "domain: d, capacity: 1, refill: 1/s";
        for i in 0..3 {
            text.push_str(&format!(
                "  - {{name: r{i}, {common}, when: {{method: POST, route: /r{i}}}}}\n  \
                   - {{name: p{i}, {common}, when: {{a: !prefix /all/, b: !prefix /p{i}/}}}}\n  \
                   - {{name: n{i}, {common}, when: {{a: !cidr 10.0.0.0/8, b: !cidr 10.{i}.0.0/16}}}}\n  \
                   - {{name: k{i}, {common}, key: [tenant, user{i}]}}\n"
            ));
        }
        let policy = compile("p.yaml", &text).unwrap_or_else(|e| panic!("{e}"));
        let filed: Vec<String> = policy
            .limits()
            .iter()
            .map(|l| format!("{} {:?}", l.name(), l.filed))
            .collect();
        let expected: Vec<String> = (0..3)
            .flat_map(|i| {
                [
                    format!("r{i} Pair(1)"),
                    format!("p{i} Items(1)"),
                    format!("n{i} Items(1)"),
                    format!("k{i} Key(1)"),
                ]
            })
            .collect();
        assert_eq!(filed, expected);
    }
}
