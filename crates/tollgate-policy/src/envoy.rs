//! Import of envoyproxy/ratelimit configurations: what `tollgate import envoy FILE` runs.
//!
//! An envoyproxy/ratelimit file declares one domain and a tree of descriptors; a request
//! descriptor (an ordered list of entries) walks the tree one entry per level, preferring a node
//! with the entry's value over a wildcard node of the same key, and gets the limit of the node
//! its last entry lands on. The conversion:
//!
//! * Every node with a `rate_limit` becomes a limit with `exact: true` (a descriptor with extra
//!   entries does not match, as in Envoy); entries of the path with a `value` become `when`,
//!   wildcard ones become `key` (one bucket per value, as in Envoy).
//! * A node with a value next to a wildcard sibling with a limit becomes an **override** of the
//!   sibling's limit, which is exactly Envoy's precedence (first match wins, same key).
//! * A wildcard value (`foo*`) becomes a `!prefix foo` condition with the entry in `key` too
//!   (Envoy counts each full value apart). Envoy tries exact values, then wildcard values in file
//!   order, then the key-only node, so beside a key-only sibling they are overrides after the
//!   exact ones; without one, an exact value a wildcard value covers is an override of it.
//! * A limit under a valued node with the shape of one under its key-only sibling
//!   (`tenant=acme > user` beside `tenant > user`) is what Envoy applies for that value instead
//!   of the sibling's: an override of it, tried before its own. A limit under the sibling that
//!   nothing under the value matches is one Envoy never reaches for that value: it gets an
//!   `unlimited: true` override for the value, in the same place.
//! * A valued node without a limit (`unlimited: true`, or no `rate_limit`) beside a wider node
//!   with one is limited by nothing in Envoy: an `unlimited: true` override of the wider
//!   node's limit. Likewise each limit of a wildcard value and of its subtree gets an
//!   `unlimited: true` override for what Envoy takes before it: the exact values it covers,
//!   and the earlier wildcard values that overlap it (Envoy takes the first that matches).
//! * An override has its limit's mode, replaces what its limit replaces and is replaced with
//!   it, so a valued node whose `shadow_mode` differs from its wider sibling's, or where either
//!   has `replaces` or is named by one, stays a limit of its own, and the sibling's limit
//!   leaves its values out (an `unlimited: true` override).
//! * Overrides of one limit next to one another that apply the same thing (the same
//!   parameters, `deny: true`, or `unlimited: true`) to exact values of one entry are written
//!   as one override listing the values (`when: {remote_address: [203.0.113.7, …]}`), named
//!   after the first: a block list of many addresses is one override. Only neighbours merge,
//!   so the first match is the same; a prefix never joins a list. Each value keeps a bucket of
//!   its own (`limit|value#first`), the entry being in the limit's key, as Envoy counts each
//!   value apart.
//! * `N` requests per `unit` becomes capacity `N`, refill `N/unit`: Envoy counts in calendar fixed
//!   windows, tollgate refills a token bucket continuously, so a client can no longer burst `2N`
//!   across a window edge. Said once in the notes.
//! * `requests_per_unit: 0` (Envoy's "deny all", a block list) becomes `deny: true`, whatever
//!   the `unit`, and so does a `unit` without `requests_per_unit` (Envoy reads 0; noted, since
//!   it may be a slip): where the node becomes an override, a `deny: true` override in the same
//!   place; where it becomes a limit, a `deny: true` limit with no parameters. A deny limit's
//!   overrides can only take requests out (`unlimited: true`), so a valued node with a limit
//!   beside a deny sibling, or covered by a deny wildcard value, stays a limit of its own, and
//!   the deny limit leaves its values out; likewise a limit under a valued node shaped as one
//!   under a deny sibling.
//! * `shadow_mode` becomes `mode: shadow` (for a deny, a would-reject); `unlimited` means no
//!   limit, even with `requests_per_unit: 0`; `replaces` becomes `replaces` by the names the
//!   limits were imported under, a deny limit's as any other's.
//! * `value: ""` is a wildcard, as in Envoy; values are taken as written (`1.50`, `007`).
//!
//! What tollgate cannot express is listed in [`EnvoyImport::notes`], with the descriptor path:
//! a `replaces` naming what is not a limit (no such `name`, or an unlimited one), the
//! `replaces` of an unlimited limit, a key repeated further down its own path (skipped), entry
//! order, month and year units (approximated), and fields it does not know.
//! `tests/envoy_model.rs` checks the rest against a model of envoyproxy/ratelimit's own
//! lookup, on random configurations and descriptors, bucket keys included.

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;
use std::ops::Range;

use serde::de::{self, IgnoredAny};
use serde::{Deserialize, Deserializer};

use crate::compile::{compile, compile_directory};
use crate::error::{Diagnostic, Error};
use crate::policy::ValueMatch;
use crate::schema::{Text, parse_as};

/// A converted configuration.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct EnvoyImport {
    /// The tollgate policy, as YAML text that [`crate::compile`] accepts.
    pub policy: String,
    /// The same policy as a policy directory, which [`crate::compile_directory`] accepts: one
    /// file per domain, named after the file that declares it (as envoyproxy/ratelimit's
    /// configuration directory holds one domain per file), in the order the domains came.
    pub files: Vec<(String, String)>,
    /// How many limits it holds.
    pub limits: usize,
    /// What could not be expressed exactly, one line each, with the descriptor path.
    pub notes: Vec<String>,
}

#[derive(Debug, Deserialize)]
struct Config {
    #[serde(deserialize_with = "non_empty")]
    domain: String,
    #[serde(default)]
    descriptors: Vec<Node>,
    #[serde(flatten)]
    other: BTreeMap<String, IgnoredAny>,
}

#[derive(Debug, Deserialize)]
struct Node {
    #[serde(deserialize_with = "non_empty")]
    key: String,
    #[serde(default)]
    value: Option<Text>,
    #[serde(default)]
    rate_limit: Option<RateLimit>,
    #[serde(default)]
    descriptors: Vec<Node>,
    #[serde(default)]
    shadow_mode: bool,
    #[serde(default)]
    detailed_metric: bool,
    #[serde(flatten)]
    other: BTreeMap<String, IgnoredAny>,
}

/// A domain or a descriptor's key, which envoyproxy/ratelimit refuses empty too: refused as the
/// file is read, at its place in it, rather than in the policy the import writes, at a line of
/// a file its operator never saw.
fn non_empty<'de, D: Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    let text = String::deserialize(deserializer)?;
    if text.is_empty() {
        return Err(de::Error::custom("must not be empty"));
    }
    Ok(text)
}

impl Node {
    /// The node's value, `None` for a wildcard. envoyproxy/ratelimit builds a node's map key as
    /// `key`, plus `_value` only when the value is not empty, so `value: ""` is a wildcard.
    fn value(&self) -> Option<&str> {
        self.value
            .as_ref()
            .map(|v| v.0.as_str())
            .filter(|v| !v.is_empty())
    }
}

#[derive(Debug, Deserialize)]
struct RateLimit {
    #[serde(default)]
    unit: Option<String>,
    #[serde(default)]
    requests_per_unit: Option<u64>,
    #[serde(default)]
    unlimited: bool,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    replaces: Vec<Replaced>,
    #[serde(flatten)]
    other: BTreeMap<String, IgnoredAny>,
}

impl RateLimit {
    /// The units envoyproxy/ratelimit knows.
    const UNITS: [&str; 7] = ["second", "minute", "hour", "day", "week", "month", "year"];

    /// Whether Envoy rejects every request under this limit ("deny all", a block list):
    /// `requests_per_unit: 0`, or a known unit without `requests_per_unit`, which
    /// envoyproxy/ratelimit reads as 0; an unlimited limit admits everything, 0 or not.
    ///
    /// One test for both places that ask, so that a node the importer writes as a deny limit
    /// is also the one it keeps overrides with parameters away from (the compiler refuses
    /// those on a deny).
    fn denies_all(&self) -> bool {
        if self.unlimited {
            return false;
        }
        match self.requests_per_unit {
            Some(n) => n == 0,
            None => self
                .unit
                .as_deref()
                .is_some_and(|unit| Self::UNITS.contains(&unit.to_ascii_lowercase().as_str())),
        }
    }
}

/// An entry of a `rate_limit`'s `replaces`: another limit's `name`.
#[derive(Debug, Deserialize)]
struct Replaced {
    #[serde(default)]
    name: String,
    #[serde(flatten)]
    other: BTreeMap<String, IgnoredAny>,
}

/// One limit on its way out.
struct Out {
    /// The descriptor path it came from, for notes.
    path: String,
    /// The same path, step by step: each entry and its value (`None`: any value).
    steps: Vec<(String, Option<String>)>,
    name: String,
    when: Vec<(String, ValueMatch)>,
    key: Vec<String>,
    rate: Rate,
    shadow: bool,
    overrides: Vec<OverrideOut>,
    /// The `rate_limit.name` the file gave, which `replaces` refers to.
    declared: Option<String>,
    /// The names (as the file gives them) of the limits this one replaces.
    replaces: Vec<String>,
}

/// What a converted limit or override does to the requests it matches.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Rate {
    /// `N` per unit: `N` (a bucket's capacity, a window's limit) and the refill (`N/period`).
    Every(u64, String),
    /// `requests_per_unit: 0`, Envoy's "deny all": every request is rejected, nothing is
    /// counted (`deny: true`).
    Deny,
}

/// One override on its way out: name, condition, and what it applies, or `None` for
/// `unlimited: true`.
type OverrideOut = (String, (String, ValueMatch), Option<Rate>);

/// Whether a node limits nothing in Envoy: `unlimited: true`, or no `rate_limit` at all (a
/// descriptor that ends on it gets no limit, whatever its siblings have).
fn unlimited(node: &Node) -> bool {
    node.rate_limit.as_ref().is_none_or(|r| r.unlimited)
}

/// Whether a node's limit is Envoy's "deny all", which [`Importer::parsed_rate`] reads as
/// [`Rate::Deny`].
fn denies(node: &Node) -> bool {
    node.rate_limit.as_ref().is_some_and(RateLimit::denies_all)
}

/// Unlimited overrides, on entry `key`, for what Envoy takes before a node (`(value as the
/// file gives it, condition)` each).
fn taken_out(key: &str, taken: &[(&str, ValueMatch)]) -> Vec<OverrideOut> {
    let mut overrides = Vec::with_capacity(taken.len());
    for (value, test) in taken {
        Importer::add_override(&mut overrides, value, (key, test.clone()), None);
    }
    overrides
}

/// An Envoy wildcard value (`foo*`) as the prefix it stands for.
fn prefix_of(value: &str) -> Option<&str> {
    value.strip_suffix('*')
}

/// The condition a path step with `value` puts in `when`.
fn condition_of(value: &str) -> ValueMatch {
    match prefix_of(value) {
        Some(prefix) => ValueMatch::Prefix(prefix.into()),
        None => ValueMatch::Exact(value.into()),
    }
}

struct Importer {
    domain: String,
    limits: Vec<Out>,
    names: HashSet<String>,
    notes: Vec<String>,
    /// Limits become fixed windows rather than token buckets.
    windows: bool,
    /// The `rate_limit.name`s some `replaces` of the domain names: such a limit neither becomes
    /// an override nor takes others as overrides, since a replacement applies to a whole limit
    /// (its overrides with it) and in Envoy to that one node only.
    replaced: HashSet<String>,
}

/// The names every `replaces` under `nodes` gives.
fn replaced_names(nodes: &[Node], into: &mut HashSet<String>) {
    for node in nodes {
        if let Some(rate) = &node.rate_limit {
            into.extend(rate.replaces.iter().map(|r| r.name.clone()));
        }
        replaced_names(&node.descriptors, into);
    }
}

/// Whether a replacement names the node's limit.
fn is_replaced(replaced: &HashSet<String>, node: &Node) -> bool {
    node.rate_limit
        .as_ref()
        .and_then(|r| r.name.as_ref())
        .is_some_and(|name| replaced.contains(name))
}

/// Converts the envoyproxy/ratelimit configuration `text` (named `file` in errors and notes)
/// into a tollgate policy, listing what it cannot express.
///
/// # Errors
///
/// [`Error::Invalid`] when the file is not an envoyproxy/ratelimit configuration (not YAML, no
/// `domain`, a descriptor without `key`), with its position; also when the result would not
/// validate (a rate tollgate cannot represent), which names the limit.
pub fn import_envoy(file: &str, text: &str) -> Result<EnvoyImport, Error> {
    import_envoy_with(file, text, ImportOptions::default())
}

/// How [`import_envoy_with`] expresses Envoy's limits.
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub struct ImportOptions {
    fixed_windows: bool,
    merge_domains: bool,
}

impl ImportOptions {
    /// Each `N` per `unit` becomes `algorithm: fixed_window`, `limit: N`, `window: 1<unit>`:
    /// Envoy's own counting (on Redis, whose clock is Unix time, the windows start where
    /// Envoy's do), double burst at a window's edge included. Without it, a token bucket of
    /// capacity `N` refilled at `N` per unit: the same long-run rate, no double burst.
    #[must_use]
    pub fn fixed_windows(mut self, yes: bool) -> Self {
        self.fixed_windows = yes;
        self
    }

    /// Files of [`import_envoy_files`] that declare the same domain are merged, their
    /// top-level descriptors one list in file order (envoyproxy/ratelimit's
    /// `MERGE_DOMAIN_CONFIG`), rather than refused.
    #[must_use]
    pub fn merge_domains(mut self, yes: bool) -> Self {
        self.merge_domains = yes;
        self
    }
}

/// [`import_envoy`] with `options`.
///
/// # Errors
///
/// As [`import_envoy`].
pub fn import_envoy_with(
    file: &str,
    text: &str,
    options: ImportOptions,
) -> Result<EnvoyImport, Error> {
    import_envoy_files(&[(file, text)], options)
}

/// Converts several envoyproxy/ratelimit configuration files, `(name, text)` each with a
/// domain of its own (as envoyproxy/ratelimit loads every file of its configuration
/// directory), into one policy. Limit names stay unique across the files; a `replaces` refers
/// to limits of its own domain. With more than one file, each note starts with its file's
/// name (the files', joined by ` + `, for a merged domain).
///
/// ```
/// use tollgate_policy::{ImportOptions, import_envoy_files};
///
/// let edge = "domain: edge\ndescriptors:\n  - key: remote_address\n    rate_limit: {unit: second, requests_per_unit: 50}\n";
/// let api = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 600}\n";
/// let imported = import_envoy_files(&[("edge.yaml", edge), ("api.yaml", api)], ImportOptions::default())?;
/// assert_eq!(imported.limits, 2);
/// # Ok::<(), tollgate_policy::Error>(())
/// ```
///
/// # Errors
///
/// As [`import_envoy`], for any of the files; [`Error::Invalid`] also when two files declare
/// the same domain, unless [`ImportOptions::merge_domains`] (envoyproxy/ratelimit refuses
/// that too, unless told to merge them).
pub fn import_envoy_files(
    files: &[(&str, &str)],
    options: ImportOptions,
) -> Result<EnvoyImport, Error> {
    let several = files.len() > 1;
    // Each domain with the files that declare it, in the order they come.
    let mut domains: Vec<(Config, Vec<&str>)> = Vec::with_capacity(files.len());
    for &(file, text) in files {
        let config: Config = parse_as(file, text, false)?;
        match domains.iter_mut().find(|(d, _)| d.domain == config.domain) {
            Some((merged, from)) if options.merge_domains => {
                // envoyproxy/ratelimit's MERGE_DOMAIN_CONFIG: the files' top-level descriptors
                // become one list, in file order.
                merged.descriptors.extend(config.descriptors);
                merged.other.extend(config.other);
                from.push(file);
            }
            Some((_, from)) => {
                return Err(Error::Invalid(Box::new(Diagnostic {
                    file: file.to_owned(),
                    line: 0,
                    column: 0,
                    path: "domain".into(),
                    message: format!(
                        "domain {:?} is also the domain of {}: each file must have its own, \
                         or merge them (--merge-domains, envoyproxy/ratelimit's \
                         MERGE_DOMAIN_CONFIG)",
                        config.domain, from[0]
                    ),
                })));
            }
            None => domains.push((config, vec![file])),
        }
    }
    let mut names = HashSet::new();
    let mut header = String::new();
    let mut body = String::new();
    let mut directory: Vec<(String, String)> = Vec::with_capacity(domains.len());
    let (mut limits, mut notes) = (0, Vec::new());
    // Limits that count requests: a deny counts nothing, so the note on counting is not for it.
    let mut counting = 0;
    for (config, from) in &domains {
        let mut importer = Importer {
            domain: config.domain.clone(),
            limits: Vec::new(),
            names: std::mem::take(&mut names),
            notes: Vec::new(),
            windows: options.fixed_windows,
            replaced: HashSet::new(),
        };
        replaced_names(&config.descriptors, &mut importer.replaced);
        for field in config.other.keys() {
            importer.note("", format!("unknown field `{field}` ignored"));
        }
        importer.level(&config.descriptors, &[]);
        importer.resolve_replaces();
        let label = from.join(" + ");
        let mut own = String::new();
        importer.render_header(&mut own, &label);
        header.push_str(&own);
        let mut limits_text = String::new();
        importer.render_limits(&mut limits_text);
        body.push_str(&limits_text);
        own.push_str(&limits_list(&limits_text));
        directory.push((file_name_for(from[0], &directory), own));
        limits += importer.limits.len();
        counting += importer
            .limits
            .iter()
            .filter(|l| l.rate != Rate::Deny)
            .count();
        notes.extend(importer.notes.into_iter().map(|note| {
            if several {
                format!("{label}: {note}")
            } else {
                note
            }
        }));
        names = importer.names;
    }
    let mut policy = header;
    policy.push_str(&limits_list(&body));
    // The output must be a policy tollgate accepts, in one file or as a directory: compile it
    // now rather than hand the operator files that fail at load time.
    let named: Vec<&str> = files.iter().map(|(file, _)| *file).collect();
    let source = format!("{} (imported)", named.join(", "));
    compile(&source, &policy)?;
    let as_directory: Vec<(&str, &str)> = directory
        .iter()
        .map(|(n, t)| (n.as_str(), t.as_str()))
        .collect();
    compile_directory(&source, &as_directory)?;
    if limits > 0 {
        notes.insert(
            0,
            "envoy matches descriptor entries in order; tollgate's exact limits match the same \
             entries in any order"
                .to_owned(),
        );
    }
    if counting > 0 {
        let counting = if options.fixed_windows {
            "envoy counts requests in calendar fixed windows; each limit becomes a fixed_window \
             of N per unit (on Redis, windows start on the same Unix-time boundaries)"
        } else {
            "envoy counts requests in calendar fixed windows; each limit becomes a token bucket \
             of capacity N refilled at N per unit (same long-run rate, no double burst at window \
             edges; --fixed-windows keeps envoy's counting)"
        };
        notes.insert(0, counting.to_owned());
    }
    Ok(EnvoyImport {
        limits,
        policy,
        files: directory,
        notes,
    })
}

/// A policy's `limits` list of rendered entries (none: an empty list, which a policy file
/// still needs).
fn limits_list(entries: &str) -> String {
    if entries.is_empty() {
        "limits: []\n".to_owned()
    } else {
        format!("limits:\n{entries}")
    }
}

/// The name in a policy directory of the domain `source` declares: the source's own file name
/// (`config/api.yaml` gives `api.yaml`), with `.yaml` added to another extension, and `-2`,
/// `-3`... for a name already `taken` (two sources of one name in different directories).
/// Never hidden, so that the directory reader takes it.
fn file_name_for(source: &str, taken: &[(String, String)]) -> String {
    let base = std::path::Path::new(source)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let base = base.trim_start_matches('.');
    let (stem, extension) = match base.rsplit_once('.') {
        Some((stem, ext)) if !stem.is_empty() && (ext == "yaml" || ext == "yml") => (stem, ext),
        _ if base.is_empty() => ("domain", "yaml"),
        _ => (base, "yaml"),
    };
    let mut name = format!("{stem}.{extension}");
    let mut n = 2;
    while taken.iter().any(|(t, _)| *t == name) {
        name = format!("{stem}-{n}.{extension}");
        n += 1;
    }
    name
}

type Path<'a> = [(&'a str, Option<&'a str>)];

fn describe(path: &Path<'_>) -> String {
    let mut text = String::new();
    for (key, value) in path {
        if !text.is_empty() {
            text.push_str(" > ");
        }
        match value {
            Some(value) => {
                let _ = write!(text, "{key}={value}");
            }
            None => text.push_str(key),
        }
    }
    text
}

impl Importer {
    fn note(&mut self, path: &str, message: String) {
        self.notes.push(if path.is_empty() {
            message
        } else {
            format!("{path}: {message}")
        });
    }

    /// One level of the descriptor tree under `path`.
    fn level<'a>(&mut self, nodes: &'a [Node], path: &Path<'a>) {
        let mut keys: Vec<&str> = Vec::new();
        for node in nodes {
            if !keys.contains(&node.key.as_str()) {
                keys.push(&node.key);
            }
        }
        for key in keys {
            let group: Vec<&Node> = nodes.iter().filter(|n| n.key == key).collect();
            // Envoy walks one level per descriptor entry, so `a > a` is legal there (a request
            // [a=1, a=2]); a tollgate descriptor is matched by entry name, the first occurrence
            // counting, so a limit cannot name one entry twice.
            if path.iter().any(|(k, _)| *k == key) {
                for node in &group {
                    let mut here_path = path.to_vec();
                    here_path.push((key, node.value()));
                    self.note(
                        &describe(&here_path),
                        format!(
                            "entry `{key}` already appears above on this path, which tollgate \
                             cannot express: this node and its children were skipped"
                        ),
                    );
                }
                continue;
            }
            let wildcards: Vec<&Node> = group
                .iter()
                .copied()
                .filter(|n| n.value().is_none())
                .collect();
            if wildcards.len() > 1 {
                let here = describe(&[path, &[(key, None)]].concat());
                self.note(
                    &here,
                    "several wildcard nodes for one key: envoy uses one; all were converted".into(),
                );
            }
            let wildcard = wildcards.first().copied();
            let wildcard_limit =
                wildcard.and_then(|w| self.parsed_rate(w, &[path, &[(key, None)]].concat()));

            // Envoy looks a value up exactly first, then among the wildcard values (`foo*`, in
            // file order), then takes the key-only node: overrides of one limit, tried in that
            // order, say the same. Exact nodes come first, prefixes after them.
            let (prefixed, exact): (Vec<&Node>, Vec<&Node>) = group
                .iter()
                .copied()
                .filter(|n| n.value().is_some())
                .partition(|n| n.value().and_then(prefix_of).is_some());
            let prefix_limits: Vec<Option<Rate>> = prefixed
                .iter()
                .map(|n| {
                    let value = n.value().unwrap_or_default();
                    self.parsed_rate(n, &[path, &[(key, Some(value))]].concat())
                })
                .collect();
            let mut prefix_overrides: Vec<Vec<OverrideOut>> = vec![Vec::new(); prefixed.len()];
            // The limits each valued node's subtree gave, by value.
            let mut subtrees: Vec<(&str, Range<usize>)> = Vec::new();
            let mut overrides = Vec::new();
            for node in &exact {
                let Some(value) = node.value() else {
                    continue;
                };
                let mut here_path = path.to_vec();
                here_path.push((key, Some(value)));
                let here = describe(&here_path);
                self.check_node(node, &here);
                let rate = self.parsed_rate(node, &here_path);
                // Without a key-only sibling, the first wildcard value covering this one.
                let covering = prefixed.iter().zip(&prefix_limits).position(|(p, limit)| {
                    limit.is_some()
                        && p.value()
                            .and_then(prefix_of)
                            .is_some_and(|prefix| value.starts_with(prefix))
                });
                // A value without a limit of its own (unlimited, or none) beside a wider
                // node with one: Envoy applies no limit to it, so neither does the override
                // it becomes (`unlimited: true`). A limit that could not be converted was
                // noted already; the wider one then applies.
                let rate = match rate {
                    Some(rate) => Some(Some(rate)),
                    None if unlimited(node) => Some(None),
                    None => None,
                };
                match (&wildcard_limit, covering, rate) {
                    (Some(_), _, Some(rate)) => {
                        let wider = wildcard.unwrap_or(node);
                        let condition = (key, ValueMatch::Exact(value.into()));
                        self.adopt(
                            &mut overrides,
                            node,
                            &here_path,
                            condition,
                            (rate, Vec::new()),
                            wider,
                        );
                    }
                    (None, Some(j), Some(rate)) => {
                        let condition = (key, ValueMatch::Exact(value.into()));
                        let into = &mut prefix_overrides[j];
                        self.adopt(
                            into,
                            node,
                            &here_path,
                            condition,
                            (rate, Vec::new()),
                            prefixed[j],
                        );
                    }
                    (Some(_), _, None) | (None, Some(_), None) => {}
                    (None, None, Some(Some(rate))) => {
                        self.push(&here_path, rate, node, Vec::new());
                    }
                    (None, None, _) => {}
                }
                let before = self.limits.len();
                self.level(&node.descriptors, &here_path);
                subtrees.push((value, before..self.limits.len()));
            }
            for (j, node) in prefixed.iter().enumerate() {
                let value = node.value().unwrap_or_default();
                let prefix = prefix_of(value).unwrap_or_default();
                let mut here_path = path.to_vec();
                here_path.push((key, Some(value)));
                let here = describe(&here_path);
                self.check_node(node, &here);
                // The wildcard values before this one that take some of its values.
                let overlapping: Vec<&str> = prefixed[..j]
                    .iter()
                    .filter_map(|p| p.value())
                    .filter(|other| {
                        let other = prefix_of(other).unwrap_or_default();
                        prefix.starts_with(other) || other.starts_with(prefix)
                    })
                    .collect();
                // What Envoy takes before this wildcard value: the exact values it covers, and
                // the earlier wildcard values that take some of its values.
                let mut taken: Vec<(&str, ValueMatch)> = exact
                    .iter()
                    .filter_map(|e| e.value())
                    .filter(|v| v.starts_with(prefix))
                    .map(|v| (v, ValueMatch::Exact(v.into())))
                    .collect();
                taken.extend(overlapping.iter().map(|&earlier| {
                    let other = prefix_of(earlier).unwrap_or_default();
                    (earlier, ValueMatch::Prefix(other.into()))
                }));
                match (&wildcard_limit, prefix_limits[j].clone()) {
                    (Some(_), Some(rate)) => {
                        let wider = wildcard.unwrap_or(node);
                        let condition = (key, ValueMatch::Prefix(prefix.into()));
                        let rate = (Some(rate), taken_out(key, &taken));
                        self.adopt(&mut overrides, node, &here_path, condition, rate, wider);
                    }
                    (Some(_), None) if unlimited(node) => {
                        let wider = wildcard.unwrap_or(node);
                        let condition = (key, ValueMatch::Prefix(prefix.into()));
                        let rate = (None, Vec::new());
                        self.adopt(&mut overrides, node, &here_path, condition, rate, wider);
                    }
                    (Some(_), None) => self.note(
                        &here,
                        format!(
                            "its limit was skipped but the wildcard sibling `{key}` has one: \
                             in tollgate the sibling's limit applies to these values"
                        ),
                    ),
                    (None, Some(rate)) => {
                        // Envoy takes the first wildcard value that matches: the values an
                        // earlier one takes are out of this one's limit (an unlimited override
                        // each, after the exact values this one covers).
                        let mut overrides = std::mem::take(&mut prefix_overrides[j]);
                        for &earlier in &overlapping {
                            let other = prefix_of(earlier).unwrap_or_default();
                            let condition = (key, ValueMatch::Prefix(other.into()));
                            Self::add_override(&mut overrides, earlier, condition, None);
                        }
                        self.push(&here_path, rate, node, overrides);
                    }
                    (None, None) => {}
                }
                let before = self.limits.len();
                self.level(&node.descriptors, &here_path);
                subtrees.push((value, before..self.limits.len()));
                // Envoy walks this subtree for none of the values an exact value or an earlier
                // wildcard value takes.
                self.exclude_hidden(&taken, before..self.limits.len(), key);
            }
            if let Some(w) = wildcard {
                let mut here_path = path.to_vec();
                here_path.push((key, None));
                self.check_node(w, &describe(&here_path));
                if let Some(rate) = wildcard_limit {
                    self.push(&here_path, rate, w, overrides);
                }
                let before = self.limits.len();
                self.level(&w.descriptors, &here_path);
                self.merge_hidden_subtrees(&subtrees, before..self.limits.len(), path, key);
            }
            for extra in wildcards.iter().skip(1) {
                let mut here_path = path.to_vec();
                here_path.push((key, None));
                if let Some(rate) = self.parsed_rate(extra, &here_path) {
                    self.push(&here_path, rate, extra, Vec::new());
                }
                self.level(&extra.descriptors, &here_path);
            }
        }
    }

    /// Envoy walks a valued node's subtree instead of its key-only sibling's (see
    /// [`note_hidden_subtree`](Self::note_hidden_subtree)). Where a limit under the valued node
    /// has the shape of one under the sibling (the same entries, the same values but this one),
    /// it is what Envoy applies instead of the sibling's for that value: it becomes an override
    /// of the sibling's limit (`when` that value), tried before the overrides the limit had,
    /// since Envoy chose the value at this level before looking further down. A sibling's limit
    /// that nothing under the value replaces does not apply to the value in Envoy at all: it
    /// gets an `unlimited` override for it, in the same place.
    fn merge_hidden_subtrees(
        &mut self,
        subtrees: &[(&str, Range<usize>)],
        nested: Range<usize>,
        path: &Path<'_>,
        key: &str,
    ) {
        let depth = path.len();
        // (limit under the sibling, the value, the limit under the value that replaces it or
        // none), in the order Envoy tries the values.
        let mut adds: Vec<(usize, &str, Option<usize>)> = Vec::new();
        for &(value, ref range) in subtrees {
            for into in nested.clone() {
                // A limit in another mode than the sibling's cannot be its override (an
                // override has its limit's mode), nor can any limit be an override of a deny
                // limit (whose overrides only take requests out): it stays a limit of its
                // own, and the sibling's leaves the value out.
                let apart = |limit: &Out| {
                    !limit.replaces.is_empty()
                        || limit
                            .declared
                            .as_ref()
                            .is_some_and(|name| self.replaced.contains(name))
                };
                let from = range.clone().find(|&from| {
                    self.limits[from].overrides.is_empty()
                        && self.limits[from].shadow == self.limits[into].shadow
                        && self.limits[into].rate != Rate::Deny
                        && !apart(&self.limits[from])
                        && !apart(&self.limits[into])
                        && !adds.iter().any(|&(.., taken)| taken == Some(from))
                        && same_shape(
                            &self.limits[from].steps,
                            &self.limits[into].steps,
                            depth,
                            value,
                        )
                });
                adds.push((into, value, from));
            }
        }
        // Per limit overridden, how many overrides were put in front of its own so far.
        let mut in_front: Vec<(usize, usize)> = Vec::new();
        for &(into, value, from) in &adds {
            let rate = from.map(|from| self.limits[from].rate.clone());
            let at = match in_front.iter_mut().find(|(limit, _)| *limit == into) {
                Some((_, count)) => {
                    *count += 1;
                    *count - 1
                }
                None => {
                    in_front.push((into, 1));
                    0
                }
            };
            let overrides = &self.limits[into].overrides;
            let name = Self::override_name(overrides, value);
            let condition = (key.to_owned(), condition_of(value));
            self.limits[into]
                .overrides
                .insert(at, (name, condition, rate));
        }
        let mut gone: Vec<usize> = adds.iter().filter_map(|&(.., from)| from).collect();
        gone.sort_unstable();
        for from in gone.into_iter().rev() {
            self.limits.remove(from);
        }
    }

    /// Envoy looks an entry up by `key_value` first, then among the wildcard values in file
    /// order: a request whose value an exact value or an earlier wildcard value takes walks
    /// that node's subtree and never reaches a later wildcard value's. tollgate matches every
    /// limit on its own, so each limit of the wildcard value's subtree (`nested`) gets an
    /// `unlimited` override for each of those (`taken`: the value as the file gives it, and
    /// its condition), in front of its own overrides, since Envoy chose the value before
    /// looking further down.
    fn exclude_hidden(&mut self, taken: &[(&str, ValueMatch)], nested: Range<usize>, key: &str) {
        for limit in nested {
            for (at, (value, test)) in taken.iter().enumerate() {
                let overrides = &self.limits[limit].overrides;
                let name = Self::override_name(overrides, value);
                let condition = (key.to_owned(), test.clone());
                self.limits[limit]
                    .overrides
                    .insert(at, (name, condition, None));
            }
        }
    }

    /// Turns each limit's `replaces`, names as the file gave them (`rate_limit.name`), into
    /// the names the limits were imported under, noting those that did not become limits of
    /// their own (skipped, or overrides of another limit) and so cannot be replaced.
    fn resolve_replaces(&mut self) {
        let mut notes = Vec::new();
        let declared: Vec<(Option<String>, String)> = self
            .limits
            .iter()
            .map(|l| (l.declared.clone(), l.name.clone()))
            .collect();
        for limit in &mut self.limits {
            let wanted = std::mem::take(&mut limit.replaces);
            for name in wanted {
                let found = declared
                    .iter()
                    .find(|(d, _)| d.as_deref() == Some(name.as_str()))
                    .map(|(_, imported)| imported.clone());
                match found {
                    Some(imported) if imported != limit.name => {
                        if !limit.replaces.contains(&imported) {
                            limit.replaces.push(imported);
                        }
                    }
                    _ => notes.push((
                        limit.path.clone(),
                        format!(
                            "replaces {name:?}, which is not a limit of its own here (not \
                             named so, skipped, or an override): that part is dropped"
                        ),
                    )),
                }
            }
        }
        for (path, message) in notes {
            self.note(&path, message);
        }
    }

    /// `node` (at `here`) becomes an override, for `condition` at `rate`, of the limit of the
    /// `wider` node that also matches its values (its key-only sibling, or a wildcard value
    /// covering it). An override has its limit's mode and no `replaces` of its own, and a deny
    /// limit's overrides only take requests out: where the node needs other, it stays a limit
    /// of its own.
    fn adopt(
        &mut self,
        overrides: &mut Vec<OverrideOut>,
        node: &Node,
        here_path: &Path<'_>,
        condition: (&str, ValueMatch),
        (rate, narrower): (Option<Rate>, Vec<OverrideOut>),
        wider: &Node,
    ) {
        if let Some(own) = rate.clone()
            && (wider.shadow_mode != node.shadow_mode
                || denies(wider)
                || is_replaced(&self.replaced, node)
                || is_replaced(&self.replaced, wider)
                || [node, wider].iter().any(|n| {
                    n.rate_limit
                        .as_ref()
                        .is_some_and(|r| !r.replaces.is_empty())
                }))
        {
            // An override has its limit's mode, replaces what its limit replaces and is
            // replaced with it, and a deny limit can have no override that applies anything: a
            // value in another mode, where either replaces others or is named by a
            // replacement, or beside a deny, stays a limit of its own, leaving out what Envoy
            // takes before it (`narrower`), and the wider limit leaves its values out.
            self.push(here_path, own, node, narrower);
            Self::add_override(overrides, node.value().unwrap_or_default(), condition, None);
            return;
        }
        // Named after the value as the file gives it (`gold*` → `gold_`).
        Self::add_override(overrides, node.value().unwrap_or_default(), condition, rate);
    }

    fn check_node(&mut self, node: &Node, here: &str) {
        for field in node.other.keys() {
            self.note(here, format!("unknown field `{field}` ignored"));
        }
        if node.detailed_metric {
            self.note(here, "detailed_metric ignored: tollgate labels metrics by limit name only, never by value".into());
        }
        if let Some(rate) = &node.rate_limit {
            for field in rate.other.keys() {
                self.note(here, format!("unknown rate_limit field `{field}` ignored"));
            }
            if rate.replaces.iter().any(|r| !r.other.is_empty()) {
                self.note(here, "unknown fields of replaces ignored".into());
            }
            // Envoy applies an unlimited limit's `replaces` still; in tollgate there is no
            // limit to carry them.
            if rate.unlimited && !rate.replaces.is_empty() {
                self.note(
                    here,
                    "replaces of an unlimited limit dropped: envoy still leaves the replaced \
                     limits out, tollgate has no limit here to do so"
                        .into(),
                );
            }
        }
    }

    /// The node's limit, or `None` for no limit (absent or unlimited) or one that cannot be
    /// converted (noted).
    fn parsed_rate(&mut self, node: &Node, path: &Path<'_>) -> Option<Rate> {
        let rate = node.rate_limit.as_ref()?;
        // Envoy checks `unlimited` before it counts: an unlimited 0 admits everything.
        if rate.unlimited {
            return None;
        }
        let here = describe(path);
        // Envoy's "deny all" (a block list): over the limit from the first request, whatever
        // the unit, so the unit says nothing (nor needs approximating).
        if rate.denies_all() {
            // A known unit without a number: envoyproxy/ratelimit reads the number as 0.
            // Imported as Envoy decides, and said, since it may be a slip.
            if rate.requests_per_unit.is_none() {
                self.note(
                    &here,
                    "rate_limit without requests_per_unit: envoy reads 0 and denies every \
                     request; imported as deny: true (give requests_per_unit if a limit was \
                     meant)"
                        .into(),
                );
            }
            return Some(Rate::Deny);
        }
        let (Some(unit), Some(n)) = (rate.unit.as_deref(), rate.requests_per_unit) else {
            self.note(
                &here,
                "rate_limit without unit and requests_per_unit skipped".into(),
            );
            return None;
        };
        let period = match unit.to_ascii_lowercase().as_str() {
            "second" => "s",
            "minute" => "m",
            "hour" => "h",
            "day" => "d",
            "week" => "7d",
            "month" => {
                self.note(&here, "unit month approximated as 30 days".into());
                "30d"
            }
            "year" => {
                self.note(&here, "unit year approximated as 365 days".into());
                "365d"
            }
            other => {
                self.note(&here, format!("unknown unit `{other}`: skipped"));
                return None;
            }
        };
        Some(Rate::Every(n, format!("{n}/{period}")))
    }

    fn unique(&mut self, base: String) -> String {
        let mut name = base.clone();
        let mut n = 2;
        while !self.names.insert(name.clone()) {
            name = format!("{base}-{n}");
            n += 1;
        }
        name
    }

    /// Adds to `overrides` one whose name comes from `value`, for `condition`, at `rate`
    /// (`None`: unlimited).
    fn add_override(
        overrides: &mut Vec<OverrideOut>,
        value: &str,
        (key, test): (&str, ValueMatch),
        rate: Option<Rate>,
    ) {
        let name = Self::override_name(overrides, value);
        overrides.push((name, (key.to_owned(), test), rate));
    }

    fn override_name(taken: &[OverrideOut], value: &str) -> String {
        let base = sanitize(value, 100);
        let mut name = base.clone();
        let mut n = 2;
        while taken.iter().any(|(t, ..)| *t == name) {
            name = format!("{base}-{n}");
            n += 1;
        }
        name
    }

    fn push(&mut self, path: &Path<'_>, rate: Rate, node: &Node, overrides: Vec<OverrideOut>) {
        let declared = node.rate_limit.as_ref().and_then(|r| r.name.as_deref());
        let base = match declared {
            Some(name) => sanitize(name, 120),
            None => {
                let mut parts = vec![self.domain.clone()];
                for (key, value) in path {
                    parts.push(match value {
                        Some(value) => format!("{key}_{value}"),
                        None => (*key).to_owned(),
                    });
                }
                sanitize(&parts.join("."), 120)
            }
        };
        let name = self.unique(base);
        let when = path
            .iter()
            .filter_map(|(k, v)| v.map(|v| ((*k).to_owned(), condition_of(v))))
            .collect();
        // A wildcard value (`foo*`) counts each full value apart in Envoy: keyed too.
        let key = path
            .iter()
            .filter(|(_, v)| v.is_none_or(|v| prefix_of(v).is_some()))
            .map(|(k, _)| (*k).to_owned())
            .collect();
        self.limits.push(Out {
            path: describe(path),
            steps: path
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.map(str::to_owned)))
                .collect(),
            name,
            when,
            key,
            rate,
            shadow: node.shadow_mode,
            declared: declared.map(str::to_owned),
            replaces: node
                .rate_limit
                .iter()
                .flat_map(|r| &r.replaces)
                .map(|r| r.name.clone())
                .collect(),
            overrides,
        });
    }

    /// The comment naming where the limits come from.
    fn render_header(&self, out: &mut String, file: &str) {
        // Both come from outside (the domain from the file, the file name from the caller):
        // quoted and escaped, so a line break in either cannot end the comment and add fields
        // to the policy. Debug formatting escapes every control and line-separator character.
        let _ = writeln!(
            out,
            "# Imported from envoyproxy/ratelimit config {file:?} (domain {:?}).",
            self.domain
        );
    }

    /// The limits, as entries of the policy's `limits` list.
    fn render_limits(&self, out: &mut String) {
        let q = |text: &str| serde_json::to_string(text).unwrap_or_else(|_| "\"\"".into());
        let condition = |test: &ValueMatch| match test {
            ValueMatch::Prefix(prefix) => format!("!prefix {}", q(prefix)),
            ValueMatch::Network(network) => format!("!cidr {}", network.net()),
            other => q(other.text()),
        };
        for limit in &self.limits {
            let _ = writeln!(out, "  - name: {}", q(&limit.name));
            let _ = writeln!(out, "    domain: {}", q(&self.domain));
            if !limit.when.is_empty() {
                out.push_str("    when:\n");
                for (k, v) in &limit.when {
                    let _ = writeln!(out, "      {}: {}", q(k), condition(v));
                }
            }
            if !limit.key.is_empty() {
                let keys: Vec<String> = limit.key.iter().map(|k| q(k)).collect();
                let _ = writeln!(out, "    key: [{}]", keys.join(", "));
            }
            out.push_str("    exact: true\n");
            // A deny limit has no algorithm: it counts nothing.
            if self.windows && limit.rate != Rate::Deny {
                out.push_str("    algorithm: fixed_window\n");
            }
            self.render_rate(out, "    ", &limit.rate);
            if limit.shadow {
                out.push_str("    mode: shadow\n");
            }
            if !limit.replaces.is_empty() {
                let names: Vec<String> = limit.replaces.iter().map(|n| q(n)).collect();
                let _ = writeln!(out, "    replaces: [{}]", names.join(", "));
            }
            if !limit.overrides.is_empty() {
                out.push_str("    overrides:\n");
                for run in merge_runs(&limit.overrides, &limit.key) {
                    let _ = writeln!(out, "      - name: {}", q(run.name));
                    let test = match run.tests.as_slice() {
                        [one] => condition(one),
                        several => {
                            let values: Vec<String> = several.iter().map(|v| q(v.text())).collect();
                            format!("[{}]", values.join(", "))
                        }
                    };
                    let _ = writeln!(out, "        when: {{{}: {test}}}", q(run.entry));
                    match run.rate {
                        Some(rate) => self.render_rate(out, "        ", rate),
                        None => out.push_str("        unlimited: true\n"),
                    }
                }
            }
        }
    }
}

impl Importer {
    /// `N` per period as the algorithm takes it (capacity and refill, or limit and window), or
    /// `deny: true`.
    fn render_rate(&self, out: &mut String, indent: &str, rate: &Rate) {
        let (n, refill) = match rate {
            Rate::Every(n, refill) => (*n, refill.as_str()),
            Rate::Deny => {
                let _ = writeln!(out, "{indent}deny: true");
                return;
            }
        };
        if !self.windows {
            let _ = writeln!(out, "{indent}capacity: {n}");
            let _ = writeln!(out, "{indent}refill: {refill}");
            return;
        }
        let period = refill.split_once('/').map_or(refill, |(_, period)| period);
        let count = if period.starts_with(|c: char| c.is_ascii_digit()) {
            ""
        } else {
            "1"
        };
        let _ = writeln!(out, "{indent}limit: {n}");
        let _ = writeln!(out, "{indent}window: {count}{period}");
    }
}

/// An override as written out: one of [`OverrideOut`], or a run of them merged by
/// [`merge_runs`].
struct Written<'a> {
    /// The first override's name.
    name: &'a str,
    /// The one entry its `when` tests.
    entry: &'a str,
    /// One condition, or (a list in the file) several exact values, in the overrides' order.
    tests: Vec<&'a ValueMatch>,
    rate: &'a Option<Rate>,
}

/// The overrides of a limit keyed by `key`, each run of adjacent ones that apply the same thing
/// (the same parameters, deny or unlimited) to exact values of the same entry merged into one
/// whose `when` lists the values: a block list of many values is one override, as a reader
/// would write it. It keeps the first one's name, which is unique among them already, and which
/// values added after it on a later import leave alone: a reload carries an override's balances
/// over by name.
///
/// Only adjacent ones merge, so first-match order is unchanged: a request whose value is in the
/// list matched one of the run before, and that one applied what the merged one applies. A
/// prefix condition never joins a run (a list holds plain values, and an exact value after a
/// prefix that covers it must stay after it). The bucket of an override is
/// `limit|values#override`: with parameters, values of one entry share a bucket unless the entry
/// is in `key`, where Envoy counts each value apart, so such overrides only merge when it is.
/// Every override with parameters the import makes tests an entry of its limit's key (the
/// wildcard or wildcard value it overrides); a deny or unlimited override has no bucket.
fn merge_runs<'a>(overrides: &'a [OverrideOut], key: &[String]) -> Vec<Written<'a>> {
    let mut written: Vec<Written<'a>> = Vec::with_capacity(overrides.len());
    for (name, (entry, test), rate) in overrides {
        let joins = |run: &Written<'_>| {
            matches!(test, ValueMatch::Exact(_))
                && run.tests.iter().all(|t| matches!(t, ValueMatch::Exact(_)))
                && run.entry == entry
                && run.rate == rate
                && (!matches!(rate, Some(Rate::Every(..))) || key.contains(entry))
        };
        match written.last_mut() {
            Some(run) if joins(run) => {
                // A repeated value: the first of the two matched it before, with the same
                // effect.
                if !run.tests.contains(&test) {
                    run.tests.push(test);
                }
            }
            _ => written.push(Written {
                name,
                entry,
                tests: vec![test],
                rate,
            }),
        }
    }
    written
}

/// Whether a limit under a valued node (`steps` of `narrow`) stands where one under its
/// key-only sibling does (`wide`): the same entries with the same values, but at `depth`,
/// where the narrow one has `value` and the wide one any value.
fn same_shape(
    narrow: &[(String, Option<String>)],
    wide: &[(String, Option<String>)],
    depth: usize,
    value: &str,
) -> bool {
    narrow.len() == wide.len()
        && narrow.iter().zip(wide).enumerate().all(|(i, (n, w))| {
            n.0 == w.0
                && if i == depth {
                    n.1.as_deref() == Some(value) && w.1.is_none()
                } else {
                    n.1 == w.1
                }
        })
}

/// A limit or override name from arbitrary text: other characters become `_`.
fn sanitize(text: &str, max: usize) -> String {
    let mut name: String = text
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .take(max)
        .collect();
    if name.is_empty() {
        name.push('_');
    }
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A policy directory's file for each source: its name kept where it is a visible YAML
    /// name, made one otherwise (never hidden, never empty), numbered when taken.
    #[test]
    fn each_domain_gets_a_visible_yaml_file_name() {
        let taken = |names: &[&str]| -> Vec<(String, String)> {
            names
                .iter()
                .map(|n| ((*n).to_owned(), String::new()))
                .collect()
        };
        let name = |source: &str, names: &[&str]| file_name_for(source, &taken(names));
        assert_eq!(name("config/api.yaml", &[]), "api.yaml");
        assert_eq!(name("config/api.yml", &[]), "api.yml");
        assert_eq!(name("config/api.conf", &[]), "api.conf.yaml");
        assert_eq!(name("config/.api.yaml", &[]), "api.yaml");
        assert_eq!(name("config/api", &[]), "api.yaml");
        assert_eq!(name("config/.yaml", &[]), "yaml.yaml");
        assert_eq!(name("", &[]), "domain.yaml");
        assert_eq!(name("config/...", &[]), "domain.yaml");
        assert_eq!(
            name("b/api.yaml", &["api.yaml", "api-2.yaml"]),
            "api-3.yaml"
        );
    }

    fn exact(entry: &str, value: &str, rate: Option<Rate>) -> OverrideOut {
        let test = ValueMatch::Exact(value.into());
        (sanitize(value, 100), (entry.to_owned(), test), rate)
    }

    /// Each written override: its name and its values (a prefix as `foo*`).
    fn written(overrides: &[OverrideOut], key: &[&str]) -> Vec<(String, Vec<String>)> {
        let key: Vec<String> = key.iter().map(|k| (*k).to_owned()).collect();
        merge_runs(overrides, &key)
            .iter()
            .map(|run| {
                let values = run
                    .tests
                    .iter()
                    .map(|test| match test {
                        ValueMatch::Prefix(prefix) => format!("{prefix}*"),
                        other => other.text().to_owned(),
                    })
                    .collect();
                (run.name.to_owned(), values)
            })
            .collect()
    }

    fn run(name: &str, values: &[&str]) -> (String, Vec<String>) {
        let values = values.iter().map(|v| (*v).to_owned()).collect();
        (name.to_owned(), values)
    }

    /// Values that read the same as names (`_` for what a name cannot hold) count up.
    #[test]
    fn override_names_count_up_past_the_names_taken() {
        let mut overrides = Vec::new();
        for value in ["a b", "a;b", "a,b"] {
            let condition = ("k", ValueMatch::Exact(value.into()));
            Importer::add_override(&mut overrides, value, condition, None);
        }
        let names: Vec<&str> = overrides.iter().map(|(n, ..)| n.as_str()).collect();
        assert_eq!(names, ["a_b", "a_b-2", "a_b-3"]);
    }

    #[test]
    fn a_run_of_exact_values_applying_the_same_thing_is_one_override() {
        let every = || Some(Rate::Every(5, "5/s".into()));
        let overrides = [
            exact("ip", "a", Some(Rate::Deny)),
            exact("ip", "b", Some(Rate::Deny)),
            // The same value again: the first of the two already took it.
            exact("ip", "a", Some(Rate::Deny)),
            exact("ip", "c", every()),
            exact("ip", "d", every()),
            exact("ip", "e", None),
            exact("ip", "f", None),
        ];
        assert_eq!(
            written(&overrides, &["ip"]),
            [
                run("a", &["a", "b"]),
                run("c", &["c", "d"]),
                run("e", &["e", "f"])
            ]
        );
    }

    #[test]
    fn a_prefix_another_entry_or_another_effect_splits_a_run() {
        let prefix = |value: &str| {
            let test = ValueMatch::Prefix(value.into());
            (format!("{value}_"), ("ip".to_owned(), test), None)
        };
        // An exact value after a prefix that covers it is taken by the prefix first: merged
        // with the exact value before the prefix, it would come first.
        let overrides = [
            exact("ip", "a", None),
            prefix("a"),
            exact("ip", "ab", None),
            exact("user", "ac", None),
            exact("ip", "ad", Some(Rate::Deny)),
            exact("ip", "ae", Some(Rate::Every(5, "5/s".into()))),
            exact("ip", "af", Some(Rate::Every(6, "6/s".into()))),
        ];
        assert_eq!(
            written(&overrides, &["ip"]),
            [
                run("a", &["a"]),
                run("a_", &["a*"]),
                run("ab", &["ab"]),
                run("ac", &["ac"]),
                run("ad", &["ad"]),
                run("ae", &["ae"]),
                run("af", &["af"]),
            ]
        );
    }

    /// An override's bucket is `limit|key values#override`: values of an entry that is not in
    /// the key would share one bucket, where Envoy counts each apart. A deny or unlimited
    /// override has no bucket.
    #[test]
    fn overrides_with_parameters_merge_only_on_an_entry_of_the_key() {
        let every = || Some(Rate::Every(5, "5/s".into()));
        let counting = [
            exact("tier", "gold", every()),
            exact("tier", "silver", every()),
        ];
        assert_eq!(
            written(&counting, &["user"]),
            [run("gold", &["gold"]), run("silver", &["silver"])]
        );
        assert_eq!(
            written(&counting, &["user", "tier"]),
            [run("gold", &["gold", "silver"])]
        );
        let denying = [
            exact("tier", "gold", Some(Rate::Deny)),
            exact("tier", "silver", Some(Rate::Deny)),
        ];
        assert_eq!(
            written(&denying, &["user"]),
            [run("gold", &["gold", "silver"])]
        );
    }
}
