//! The serde mirror of the policy file.
//!
//! These types say what the YAML may contain and nothing more: every struct refuses unknown
//! fields (a misspelt `capacty` must not silently fall back to a default), and scalars that have
//! a syntax of their own (rates, percentages, RFC 3339 times) are parsed here, so their errors
//! come out of the deserializer with the line, column and field path of the offending value.
//! Rules that span several fields (unique names, references between sections, parameter ranges)
//! live in [`crate::compile`].

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};
use serde_saphyr::{Spanned, Tagged};
use tollgate::Rate;

use crate::error::{Diagnostic, Error};
use crate::policy::Network;

/// The whole file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PolicyFile {
    #[serde(default)]
    pub(crate) version: Option<Spanned<Text>>,
    #[serde(default)]
    pub(crate) defaults: Defaults,
    /// Required, even if empty: a truncated or empty file (caught mid-write) must be refused,
    /// not read as a policy without limits.
    pub(crate) limits: Vec<LimitSpec>,
    #[serde(default)]
    pub(crate) exemptions: Vec<ExemptionSpec>,
}

/// Policy-wide defaults for the per-limit fields that have them.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Defaults {
    #[serde(default)]
    pub(crate) failure_mode: Option<FailureModeSpec>,
    #[serde(default)]
    pub(crate) emergency: Option<Spanned<RateText>>,
    #[serde(default)]
    pub(crate) mode: Option<ModeSpec>,
}

/// One entry of `limits`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LimitSpec {
    pub(crate) name: Spanned<String>,
    pub(crate) domain: Spanned<String>,
    #[serde(default)]
    pub(crate) when: Option<Spanned<BTreeMap<String, WhenValue>>>,
    #[serde(default)]
    pub(crate) key: Option<Spanned<Vec<String>>>,
    #[serde(default)]
    pub(crate) capacity: Option<Spanned<u64>>,
    #[serde(default)]
    pub(crate) refill: Option<Spanned<RateText>>,
    /// The limit per window of `fixed_window` and `sliding_window`.
    #[serde(default)]
    pub(crate) limit: Option<Spanned<u64>>,
    #[serde(default)]
    pub(crate) window: Option<Spanned<WindowText>>,
    /// The leases a key may hold at once, for `concurrency`.
    #[serde(default)]
    pub(crate) max_in_flight: Option<Spanned<u64>>,
    /// How long a lease is held unless released sooner, for `concurrency`.
    #[serde(default)]
    pub(crate) lease_timeout: Option<Spanned<LeaseTimeoutText>>,
    #[serde(default)]
    pub(crate) exact: bool,
    #[serde(default)]
    pub(crate) algorithm: Option<Spanned<String>>,
    #[serde(default)]
    pub(crate) mode: Option<ModeSpec>,
    #[serde(default)]
    pub(crate) rollout: Option<Percent>,
    #[serde(default)]
    pub(crate) failure_mode: Option<FailureModeSpec>,
    /// `regional` (the default) or `global`.
    #[serde(default)]
    pub(crate) scope: Option<Spanned<ScopeSpec>>,
    /// A rate for rate limits, a number of leases for concurrency limits: which one is
    /// allowed depends on the algorithm, so it is checked in
    /// [`crate::compile`](mod@crate::compile).
    #[serde(default)]
    pub(crate) emergency: Option<Spanned<EmergencyText>>,
    #[serde(default)]
    pub(crate) overrides: Vec<OverrideSpec>,
    /// Names of limits of the same domain this one takes the place of when it applies.
    #[serde(default)]
    pub(crate) replaces: Option<Spanned<Vec<String>>>,
    /// Whether a limit an RLS descriptor carries (Envoy's `limit` action) is applied.
    #[serde(default)]
    pub(crate) request_limit: Option<Spanned<RequestLimitSpec>>,
    /// `true`: every request the limit applies to is rejected (a block list), in place of
    /// parameters.
    #[serde(default)]
    pub(crate) deny: Option<Spanned<bool>>,
}

/// `ignore` (the default) or `apply`: what a limit does with a limit a descriptor carries.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum RequestLimitSpec {
    Ignore,
    Apply,
}

/// One entry of a limit's `overrides`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct OverrideSpec {
    #[serde(default)]
    pub(crate) name: Option<Spanned<String>>,
    pub(crate) when: Spanned<BTreeMap<String, WhenValue>>,
    #[serde(default)]
    pub(crate) capacity: Option<Spanned<u64>>,
    #[serde(default)]
    pub(crate) refill: Option<Spanned<RateText>>,
    #[serde(default)]
    pub(crate) limit: Option<Spanned<u64>>,
    #[serde(default)]
    pub(crate) window: Option<Spanned<WindowText>>,
    #[serde(default)]
    pub(crate) max_in_flight: Option<Spanned<u64>>,
    #[serde(default)]
    pub(crate) lease_timeout: Option<Spanned<LeaseTimeoutText>>,
    /// `true`: the limit does not apply to the requests the override matches.
    #[serde(default)]
    pub(crate) unlimited: Option<Spanned<bool>>,
    /// `true`: the limit rejects every request the override matches.
    #[serde(default)]
    pub(crate) deny: Option<Spanned<bool>>,
}

/// One entry of `exemptions`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ExemptionSpec {
    pub(crate) limit: Spanned<String>,
    #[serde(default)]
    pub(crate) when: BTreeMap<String, WhenValue>,
    pub(crate) owner: Spanned<String>,
    pub(crate) reason: Spanned<String>,
    pub(crate) expires: Expiry,
}

/// `enforce` or `shadow`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum ModeSpec {
    Enforce,
    Shadow,
}

/// `regional` or `global`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum ScopeSpec {
    Regional,
    Global,
}

/// `closed` or `open`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum FailureModeSpec {
    Closed,
    Open,
}

/// A rate such as `10/s`, parsed by the core's own syntax.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(try_from = "String")]
pub(crate) struct RateText(pub(crate) Rate);

impl TryFrom<String> for RateText {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        text.parse().map(RateText).map_err(|err: tollgate::Error| {
            format!("{err} (write AMOUNT/PERIOD, as in 10/s, 600/m, 5/100ms or 1/d)")
        })
    }
}

/// A window length such as `1m`, `30s` or `100ms`: a count (1 when left out) and a unit, as
/// in the period of a rate.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(try_from = "String")]
pub(crate) struct WindowText(pub(crate) std::time::Duration);

impl TryFrom<String> for WindowText {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        parse_length(&text).map(WindowText).ok_or_else(|| {
            format!("invalid window {text:?}: write a length such as 100ms, 30s, 1m or 1h")
        })
    }
}

/// A lease timeout, written as a window is (`500ms`, `30s`, `2m`). Its range (1 ms to a day,
/// whole milliseconds) is the core's rule, checked in [`crate::compile`](mod@crate::compile).
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(try_from = "String")]
pub(crate) struct LeaseTimeoutText(pub(crate) std::time::Duration);

impl TryFrom<String> for LeaseTimeoutText {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        parse_length(&text).map(LeaseTimeoutText).ok_or_else(|| {
            format!("invalid lease timeout {text:?}: write a length such as 500ms, 30s or 2m")
        })
    }
}

/// A length written as the period of a rate: a count (1 when left out) and a unit.
fn parse_length(text: &str) -> Option<std::time::Duration> {
    let trimmed = text.trim();
    if trimmed.is_empty() || trimmed.contains('/') {
        return None;
    }
    format!("1/{trimmed}")
        .parse::<Rate>()
        .ok()
        .map(|rate| rate.period())
}

/// A limit's `emergency`: a rate such as `2/s` (the local bucket of a rate limit) or a plain
/// number such as `5` (the leases a concurrency limit's key may hold in this process). The
/// file may write the number unquoted or quoted; the algorithm decides which kind is allowed.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(try_from = "Text")]
pub(crate) enum EmergencyText {
    Rate(Rate),
    InFlight(u64),
}

impl TryFrom<Text> for EmergencyText {
    type Error = String;

    fn try_from(text: Text) -> Result<Self, String> {
        let trimmed = text.0.trim();
        if !trimmed.is_empty() && trimmed.bytes().all(|b| b.is_ascii_digit()) {
            return trimmed
                .parse()
                .map(EmergencyText::InFlight)
                .map_err(|_| format!("emergency {trimmed} is too large: at most {}", u64::MAX));
        }
        trimmed.parse().map(EmergencyText::Rate).map_err(|err: tollgate::Error| {
            format!(
                "{err} (write a rate such as 2/s, or for a concurrency limit a number of leases \
                 in flight such as 5)"
            )
        })
    }
}

/// A percentage in hundredths: `12.5%` is 1250. At most two decimals, at most 100%.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(try_from = "Text")]
pub(crate) struct Percent(pub(crate) u16);

impl TryFrom<Text> for Percent {
    type Error = String;

    fn try_from(text: Text) -> Result<Self, String> {
        parse_percent(&text.0).ok_or_else(|| {
            format!(
                "invalid percentage {:?}: write 0% to 100%, with at most two decimals, as in 25% or 12.5%",
                text.0
            )
        })
    }
}

fn parse_percent(text: &str) -> Option<Percent> {
    let number = text.trim().strip_suffix('%')?.trim_end();
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty()
        || whole.len() > 3
        || fraction.len() > 2
        || !whole
            .bytes()
            .chain(fraction.bytes())
            .all(|b| b.is_ascii_digit())
    {
        return None;
    }
    let whole: u16 = whole.parse().ok()?;
    let mut hundredths: u16 = 0;
    for (i, b) in fraction.bytes().enumerate() {
        let digit = u16::from(b - b'0');
        hundredths += if i == 0 { digit * 10 } else { digit };
    }
    let value = whole.checked_mul(100)?.checked_add(hundredths)?;
    (value <= 10_000).then_some(Percent(value))
}

/// An RFC 3339 instant with an explicit offset, such as `2026-12-31T00:00:00Z`, as nanoseconds
/// since the Unix epoch.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(try_from = "String")]
pub(crate) struct Expiry(pub(crate) i64);

impl TryFrom<String> for Expiry {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        let instant: jiff::Timestamp = text.trim().parse().map_err(|err| {
            format!("invalid RFC 3339 time {text:?} ({err}): write it as 2026-12-31T00:00:00Z")
        })?;
        i64::try_from(instant.as_nanosecond())
            .map(Expiry)
            .map_err(|_| format!("time {text:?} is out of range"))
    }
}

/// Any YAML scalar taken as text, exactly as written: descriptor values such as `443`,
/// `01234`, `2.1` or `true` are strings on the wire (Envoy sends strings), so the file may
/// write them unquoted and they must match what a request sends. Asking the deserializer for a
/// string (rather than for "any" value) makes serde-saphyr hand over the scalar's own text
/// instead of resolving it to a number first, which would turn `01234` into `1234`, `1.50` into
/// `1.5`, and refuse floats altogether.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Text(pub(crate) String);

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct TextVisitor;

        impl Visitor<'_> for TextVisitor {
            type Value = Text;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string, number or boolean")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Text, E> {
                Ok(Text(v.to_owned()))
            }

            fn visit_string<E: de::Error>(self, v: String) -> Result<Text, E> {
                Ok(Text(v))
            }
        }

        deserializer.deserialize_str(TextVisitor)
    }
}

/// A `when` value: a plain scalar, which the descriptor entry's value must equal,
/// `!prefix TEXT`, which it must start with, or `!cidr NETWORK`, a network it must be an
/// address in. Each is taken as written, as [`Text`] is (a network is then parsed).
///
/// A YAML tag, not a map such as `{prefix: …}`: the parser hands a string request the scalar's
/// own text (`01234` stays `01234`) but has no way to ask "a string or a map" without resolving
/// the scalar into a number first.
///
/// A list (`method: [GET, HEAD]`, `path: [/health, !prefix /internal/]`) matches any of its
/// values, prefixes and networks. Telling a list from a scalar
/// needs the deserializer's "any" request, which resolves a plain scalar such as `01234` or
/// `true` before handing it over; such a scalar's text is then read back from the source, at
/// the position the parser reports for it (see [`Source`]), so it is still taken as written.
#[derive(Debug)]
pub(crate) enum WhenValue {
    Exact(String),
    Prefix(String),
    Network(Network),
    AnyOf {
        values: Vec<String>,
        prefixes: Vec<String>,
        networks: Vec<Network>,
    },
}

/// The tag of `!prefix` as the parser reports it.
const PREFIX_TAG: &str = "!prefix";
/// The tag of `!cidr`.
const CIDR_TAG: &str = "!cidr";

/// The network written after `!cidr`: `ADDRESS/LENGTH` (a lone address is a network of one).
fn network<E: de::Error>(text: &str) -> Result<Network, E> {
    text.parse().map_err(E::custom)
}

impl<'de> Deserialize<'de> for WhenValue {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let Tagged(spanned, tag) = Tagged::<Spanned<Raw>>::deserialize(deserializer)?;
        let text = match spanned.value {
            Raw::Text(text) => text,
            Raw::Resolved => Source::text_at(spanned.referenced).ok_or_else(|| {
                de::Error::custom("this value could not be read back as written: quote it")
            })?,
            Raw::List(values) if tag.is_none() => {
                if values.is_empty() {
                    return Err(de::Error::custom(
                        "an empty list of values matches nothing: give at least one",
                    ));
                }
                let (mut exact, mut prefixes, mut networks) = (Vec::new(), Vec::new(), Vec::new());
                for item in values {
                    match item {
                        Item::Exact(text) => exact.push(text),
                        Item::Prefix(text) => prefixes.push(text),
                        Item::Network(network) => networks.push(network),
                    }
                }
                return Ok(Self::AnyOf {
                    values: exact,
                    prefixes,
                    networks,
                });
            }
            Raw::List(_) => {
                return Err(de::Error::custom(
                    "a tag applies to one value: tag each item of the list (`[!prefix /a/, \
                     !prefix /b/]`), not the list",
                ));
            }
        };
        match tag.as_deref() {
            None | Some("tag:yaml.org,2002:str") => Ok(Self::Exact(text)),
            Some(PREFIX_TAG) => Ok(Self::Prefix(text)),
            Some(CIDR_TAG) => network(&text).map(Self::Network),
            Some(other) => Err(de::Error::custom(format!(
                "unknown tag {other} on a condition: write the value plain to match it exactly, \
                 `!prefix VALUE` to match the values that start with it, or `!cidr NETWORK` the \
                 addresses in a network"
            ))),
        }
    }
}

/// A `when` value as the deserializer's "any" request hands it over.
enum Raw {
    /// A string, as written.
    Text(String),
    /// A plain scalar the parser resolved (a number, a boolean): its text is in the source.
    Resolved,
    /// A list of values, prefixes and networks, each taken as written ([`Text`]).
    List(Vec<Item>),
}

/// An item of a list in a `when`: a value, with `!prefix` a prefix, with `!cidr` a network.
enum Item {
    Exact(String),
    Prefix(String),
    Network(Network),
}

impl<'de> Deserialize<'de> for Raw {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct RawVisitor;

        impl<'de> Visitor<'de> for RawVisitor {
            type Value = Raw;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a value or a list of values")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Raw, E> {
                Ok(Raw::Text(v.to_owned()))
            }

            fn visit_string<E: de::Error>(self, v: String) -> Result<Raw, E> {
                Ok(Raw::Text(v))
            }

            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Raw, E> {
                Ok(Raw::Resolved)
            }

            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Raw, E> {
                Ok(Raw::Resolved)
            }

            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Raw, E> {
                Ok(Raw::Resolved)
            }

            fn visit_i128<E: de::Error>(self, _: i128) -> Result<Raw, E> {
                Ok(Raw::Resolved)
            }

            fn visit_u128<E: de::Error>(self, _: u128) -> Result<Raw, E> {
                Ok(Raw::Resolved)
            }

            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Raw, E> {
                Ok(Raw::Resolved)
            }

            fn visit_unit<E: de::Error>(self) -> Result<Raw, E> {
                // Worded as the parser words it for a string, which `message_of` rewrites.
                Err(E::custom("cannot deserialize null into string"))
            }

            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Raw, A::Error> {
                let mut values = Vec::new();
                while let Some(Tagged(Text(text), tag)) = seq.next_element::<Tagged<Text>>()? {
                    // A tag read as nothing would turn `!foo /api/` into the exact value
                    // `/api/` without a word.
                    let item = match tag.as_deref() {
                        None | Some("tag:yaml.org,2002:str") => Item::Exact(text),
                        Some(PREFIX_TAG) => Item::Prefix(text),
                        Some(CIDR_TAG) => Item::Network(network(&text)?),
                        Some(other) => {
                            return Err(de::Error::custom(format!(
                                "unknown tag {other} in a list: an item is a plain value, \
                                 `!prefix VALUE` for the values that start with it, or `!cidr \
                                 NETWORK` for the addresses in a network"
                            )));
                        }
                    };
                    values.push(item);
                }
                Ok(Raw::List(values))
            }
        }

        deserializer.deserialize_any(RawVisitor)
    }
}

/// The text being parsed, for the values the parser resolved before handing them over (see
/// [`WhenValue`]): set by [`parse_as`] for the length of one parse, on its own thread.
struct Source;

thread_local! {
    static SOURCE: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

impl Source {
    /// Runs `parse` with `text` as the source.
    fn with<T>(text: &str, parse: impl FnOnce() -> T) -> T {
        SOURCE.with_borrow_mut(|source| text.clone_into(source));
        let result = parse();
        SOURCE.with_borrow_mut(String::clear);
        result
    }

    /// The source text of the plain scalar at `location`.
    fn text_at(location: serde_saphyr::Location) -> Option<String> {
        let span = location.span();
        let start = usize::try_from(span.byte_offset()?).ok()?;
        let len = usize::try_from(span.byte_len()?).ok()?;
        SOURCE.with_borrow(|source| {
            source
                .get(start..start.checked_add(len)?)
                .map(str::to_owned)
        })
    }
}

/// Parses `text` (named `file` in errors) into the mirror, or the first problem with its
/// position and field path.
pub(crate) fn parse(file: &str, text: &str) -> Result<PolicyFile, Error> {
    parse_as(file, text, true)
}

/// Parses any mirror type the same way: shared with the Envoy importer. `spanned` says the type
/// uses [`Spanned`], whose inner `.value` step is dropped from paths (users never wrote it).
pub(crate) fn parse_as<T: de::DeserializeOwned>(
    file: &str,
    text: &str,
    spanned: bool,
) -> Result<T, Error> {
    let options = serde_saphyr::options! {
        with_snippet: false,
        duplicate_keys: serde_saphyr::DuplicateKeyPolicy::Error,
        // `.inf` and `.nan` written as condition values are read back as written (see
        // `WhenValue`); nothing else in the file asks for "any" value.
        non_finite_float_policy: serde_saphyr::NonFiniteFloatPolicy::PassThrough,
    };
    let mut path = String::new();
    let result = Source::with(text, || {
        serde_saphyr::with_deserializer_from_str_with_options(text, options, |de| {
            serde_path_to_error::deserialize(de).map_err(|err| {
                path = err.path().to_string();
                err.into_inner()
            })
        })
    });
    result.map_err(|err| {
        let (line, column) = err
            .location()
            .map_or((0, 0), |location| (location.line(), location.column()));
        let message = message_of(&err);
        Error::Invalid(Box::new(Diagnostic {
            file: file.to_owned(),
            line,
            column,
            path: clean_path(&path, spanned),
            message,
        }))
    })
}

/// The path as the user wrote it: serde_path_to_error writes `.` for the root and `?` for a
/// step it cannot name (a map key), and [`Spanned`] adds a `.value` step of its own.
fn clean_path(path: &str, spanned: bool) -> String {
    let mut cleaned = if path == "." { "" } else { path }.to_owned();
    if spanned {
        cleaned = cleaned.replace(".value", "");
    }
    while let Some(stripped) = cleaned.strip_suffix(".?") {
        cleaned.truncate(stripped.len());
    }
    // A `when` value is read as a tagged, spanned value (see [`WhenValue`]), which the parser
    // hands over as a pair (value, tag) around a map (value, position): an error in the value
    // adds a `[0]` and a `.value` step after the entry name (and an element's index within a
    // list of values after that, which is kept).
    let dotted = format!(".{cleaned}");
    if let Some(at) = dotted.rfind(".when.") {
        let after = &dotted[at + ".when.".len()..];
        for wrapper in ["[0].value", "[0]"] {
            if let Some(index) = after.find(wrapper)
                && !after[..index].contains(['[', '.'])
            {
                let start = at + ".when.".len() + index - 1;
                cleaned.replace_range(start..start + wrapper.len(), "");
                break;
            }
        }
        // An element of a list is a tagged value too: `k[1][0]` is the list's second value.
        let tail = &cleaned[at.saturating_sub(1).min(cleaned.len())..];
        if let Some(element) = tail.strip_suffix("[0]")
            && element.ends_with(']')
            && element.matches('[').count() == 1
        {
            cleaned.truncate(cleaned.len() - "[0]".len());
        }
    }
    cleaned
}

/// The bare message of a deserializer error, without the position the renderer appends (the
/// diagnostic carries that itself).
fn message_of(err: &serde_saphyr::Error) -> String {
    let mut message = match err.without_snippet() {
        serde_saphyr::Error::Message { msg, .. } => msg.clone(),
        other => other.to_string(),
    };
    if let Some(at) = message.rfind(" at line ") {
        message.truncate(at);
    }
    // The parser suggests a Rust type; the operator needs the fix in the file.
    if message.starts_with("cannot deserialize null into string") {
        message = "a value is missing here: write one (quote \"\" for an empty string)".into();
    }
    // The parser suggests a library option; the operator needs the fix in the file.
    if let Some(at) = message.find(", set DuplicateKeyPolicy") {
        message.truncate(at);
        message.push_str(" (each entry may appear once)");
    }
    message
}

/// A diagnostic at a spanned value.
pub(crate) fn at<T>(file: &str, spanned: &Spanned<T>, path: String, message: String) -> Error {
    at_location(file, spanned.referenced, path, message)
}

/// A diagnostic at a position of the file.
pub(crate) fn at_location(
    file: &str,
    location: serde_saphyr::Location,
    path: String,
    message: String,
) -> Error {
    Error::Invalid(Box::new(Diagnostic {
        file: file.to_owned(),
        line: location.line(),
        column: location.column(),
        path,
        message,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize)]
    struct Values {
        when: BTreeMap<String, WhenValue>,
    }

    fn values(text: &str) -> Result<Vec<String>, Error> {
        parse_as::<Values>("v.yaml", text, false).map(|v| {
            v.when
                .into_values()
                .map(|value| match value {
                    WhenValue::Exact(text) => text,
                    WhenValue::Prefix(text) => format!("prefix {text}"),
                    WhenValue::Network(network) => format!("cidr {}", network.net()),
                    WhenValue::AnyOf {
                        values,
                        prefixes,
                        networks,
                    } => {
                        let prefixes = prefixes.iter().map(|p| format!("!prefix {p}"));
                        let networks = networks.iter().map(|n| format!("!cidr {}", n.net()));
                        let items: Vec<String> = values
                            .iter()
                            .cloned()
                            .chain(prefixes)
                            .chain(networks)
                            .collect();
                        format!("any of {}", items.join(" | "))
                    }
                })
                .collect()
        })
    }

    #[test]
    fn an_unknown_tag_or_a_prefix_without_a_value_is_refused() {
        for (text, needle) in [
            ("when:\n  k: !prefx /api\n", "unknown tag !prefx"),
            ("when:\n  k: !prefix\n", "a value is missing"),
            ("when:\n  k: !prefix [a]\n", ""),
            ("when:\n  k: !!int 12\n", ""),
        ] {
            let err = values(text).map(|_| ()).unwrap_err();
            let d = err.diagnostic().cloned().unwrap_or_else(|| panic!("{err}"));
            assert_eq!((d.line, d.path.as_str()), (2, "when.k"), "{text:?}: {d}");
            assert!(d.message.contains(needle), "{text:?}: {d}");
        }
    }

    #[test]
    fn scalars_and_prefixes_are_taken_as_written() {
        // serde-saphyr hands a string request the scalar's own text: nothing is resolved to a
        // number or a boolean and printed back.
        for (written, text) in [
            ("01234", "01234"),
            ("2.1", "2.1"),
            ("1.50", "1.50"),
            ("1e3", "1e3"),
            ("0x1F", "0x1F"),
            (".inf", ".inf"),
            ("-0", "-0"),
            ("443", "443"),
            ("true", "true"),
            ("True", "True"),
            ("'007'", "007"),
            ("\"a: b\"", "a: b"),
            ("/v1/payments", "/v1/payments"),
            // A prefix is a tagged scalar, taken as written too.
            ("!prefix /api/", "prefix /api/"),
            ("!prefix 0012", "prefix 0012"),
            ("!prefix 2.10", "prefix 2.10"),
            ("!prefix ''", "prefix "),
            ("!prefix \"eu-\"", "prefix eu-"),
            ("!<!prefix> x", "prefix x"),
            ("!!str 443", "443"),
        ] {
            let parsed = values(&format!("when: {{k: {written}}}\n"));
            assert_eq!(
                parsed.map_err(|e| e.to_string()),
                Ok(vec![text.to_owned()]),
                "{written}"
            );
        }
    }

    #[test]
    fn what_is_neither_a_value_nor_a_list_of_values_is_refused_with_its_position() {
        for (text, line, column, path, needle) in [
            (
                "when:\n  k: {a: 1}\n",
                2,
                6,
                "when.k",
                "a value or a list of values",
            ),
            ("when:\n  k:\n", 2, 4, "when.k", "a value is missing"),
            (
                "when:\n  k: []\n",
                2,
                6,
                "when.k",
                "an empty list of values",
            ),
            ("when:\n  k: [a, {b: 1}]\n", 2, 10, "when.k[1]", ""),
            ("when:\n  k: [a, [b]]\n", 2, 10, "when.k[1]", ""),
            (
                "when:\n  k: [a, ~]\n",
                2,
                10,
                "when.k[1]",
                "a value is missing",
            ),
            (
                "when:\n  k: !prefix [a]\n",
                2,
                14,
                "when.k",
                "a tag applies to one value",
            ),
            (
                "when:\n  k: [a, !prefx b]\n",
                2,
                6,
                "when.k",
                "unknown tag !prefx in a list",
            ),
        ] {
            let err = values(text).map(|_| ()).unwrap_err();
            let d = err.diagnostic().cloned().unwrap_or_else(|| panic!("{err}"));
            assert_eq!(
                (d.file.as_str(), d.line, d.column, d.path.as_str()),
                ("v.yaml", line, column, path),
                "{text:?}: {d}"
            );
            assert!(d.message.contains(needle), "{text:?}: {d}");
            assert!(!d.message.contains("Option<"), "{d}");
        }
    }

    #[test]
    fn a_list_of_values_is_taken_as_written() {
        for (written, text) in [
            ("[GET, HEAD]", "any of GET | HEAD"),
            (
                "[01234, 1.50, true, .inf, 0x1F]",
                "any of 01234 | 1.50 | true | .inf | 0x1F",
            ),
            (
                "['007', \"a: b\", /v1/x, !!str 443]",
                "any of 007 | a: b | /v1/x | 443",
            ),
            ("\n    - 443\n    - 8443", "any of 443 | 8443"),
            // Prefixes among them, tagged one by one, as written too.
            (
                "[/health, !prefix /internal/, !prefix 0012, !prefix '']",
                "any of /health | !prefix /internal/ | !prefix 0012 | !prefix ",
            ),
            (
                "\n    - !prefix 10.\n    - 192.168.1.1",
                "any of 192.168.1.1 | !prefix 10.",
            ),
        ] {
            let parsed = values(&format!("when:\n  k: {written}\n"));
            assert_eq!(
                parsed.map_err(|e| e.to_string()),
                Ok(vec![text.to_owned()]),
                "{written}"
            );
        }
    }

    #[test]
    fn percentages() {
        let ok = [
            ("0%", 0),
            ("100%", 10_000),
            ("25%", 2_500),
            ("12.5%", 1_250),
            ("0.01%", 1),
            (" 50 %", 5_000),
        ];
        for (text, hundredths) in ok {
            assert_eq!(parse_percent(text).map(|p| p.0), Some(hundredths), "{text}");
        }
        for text in [
            "", "%", "50", "101%", "100.01%", "1.234%", "-1%", "+1%", "a%", "1e2%", ".5%",
        ] {
            assert!(parse_percent(text).is_none(), "{text:?}");
        }
    }
}
