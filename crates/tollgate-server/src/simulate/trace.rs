//! A trace line: the body `POST /v1/check` takes, plus the instant the request arrived.
//!
//! ```text
//! {"time":"2026-11-29T10:00:00.250Z","domain":"api","descriptors":[{"user":"u1"}],"cost":1}
//! ```
//!
//! One definition of a request serves both: a trace line is read by the same descriptor
//! parser and held to the same bounds as the HTTP API, so a request the server would refuse
//! with a 400 is refused here too, and one it would decide is decided the same way. `time` is
//! an RFC 3339 instant or whole milliseconds since the Unix epoch (what most access logs can
//! be turned into with one `jq` expression). An optional `duration_ms`, how long the request
//! was in flight (nginx's `$request_time`, Envoy's `%DURATION%`), lets the replay hold a lease
//! for that long on the concurrency limits the request matches. An optional `used` makes the
//! request a reservation: `cost` is the most it could cost, `used` what it did, and the rest
//! is given back when it ends (`POST /v1/settle`), at `time` plus `duration_ms` (or at once).

use std::borrow::Cow;
use std::fmt;
use std::time::Duration;

use serde::Deserialize;
use serde::de::{Deserializer, Visitor};
use tollgate_policy::UnixTime;

use crate::http::ApiError;
use crate::http::check::{Parsed, RawDescriptor, check_bounds, entries_of};

/// One request of a trace, parsed and within the HTTP API's bounds.
#[derive(Debug)]
pub(crate) struct TraceRequest<'a> {
    /// When it arrived.
    pub(crate) at: UnixTime,
    /// How long it was in flight, when the trace says.
    pub(crate) duration: Option<Duration>,
    /// What it used of its `cost`, when it was a reservation settled at its end.
    pub(crate) used: Option<u64>,
    /// What it asked.
    pub(crate) request: Parsed<'a>,
}

/// The check body's fields, then `time` and `duration_ms`. Unknown fields are refused, as in
/// the HTTP API (a misspelt `cost` must not silently be 1), which is why the body's fields are
/// listed again rather than flattened in: serde cannot refuse unknown fields around a
/// flattened struct.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Line<'a> {
    time: Time,
    #[serde(borrow)]
    domain: Cow<'a, str>,
    #[serde(borrow)]
    descriptors: Vec<RawDescriptor<'a>>,
    #[serde(default = "one")]
    cost: u64,
    #[serde(default, borrow)]
    request_id: Option<Cow<'a, str>>,
    #[serde(default)]
    duration_ms: Option<u64>,
    #[serde(default)]
    used: Option<u64>,
}

fn one() -> u64 {
    1
}

/// `time`: an RFC 3339 string, or a whole number of Unix milliseconds.
struct Time(UnixTime);

const TIME_FORMS: &str =
    "an RFC 3339 instant such as \"2026-11-29T10:00:00.250Z\", or whole Unix milliseconds";

impl<'de> Deserialize<'de> for Time {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Instant;

        impl Visitor<'_> for Instant {
            type Value = Time;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(TIME_FORMS)
            }

            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Time, E> {
                match UnixTime::parse_rfc3339(text) {
                    Some(at) if at.as_nanos() >= 0 => Ok(Time(at)),
                    Some(_) => Err(E::custom(format!("time {text:?} is before 1970"))),
                    None => Err(E::custom(format!("time {text:?} is not {TIME_FORMS}"))),
                }
            }

            fn visit_u64<E: serde::de::Error>(self, millis: u64) -> Result<Time, E> {
                i64::try_from(millis)
                    .ok()
                    .and_then(|millis| millis.checked_mul(1_000_000))
                    .map(|nanos| Time(UnixTime::from_nanos(nanos)))
                    .ok_or_else(|| E::custom(format!("time {millis} ms is past the year 2262")))
            }

            fn visit_i64<E: serde::de::Error>(self, millis: i64) -> Result<Time, E> {
                match u64::try_from(millis) {
                    Ok(millis) => self.visit_u64(millis),
                    Err(_) => Err(E::custom(format!("time {millis} ms is before 1970"))),
                }
            }

            fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Time, E> {
                Err(E::custom(format!("time must be {TIME_FORMS}")))
            }
        }

        deserializer.deserialize_any(Instant)
    }
}

/// Reads one trace line.
///
/// # Errors
///
/// The HTTP API's error for the same body (bad JSON, unknown field, out of bounds), or a bad
/// `time`.
pub(crate) fn parse_line(line: &str) -> Result<TraceRequest<'_>, ApiError> {
    let line: Line<'_> = serde_json::from_str(line)
        .map_err(|err| ApiError::bad_request("invalid_json", format!("{err}")))?;
    let request = Parsed {
        domain: line.domain,
        descriptors: entries_of(line.descriptors)?,
        cost: line.cost,
        request_id: line.request_id,
    };
    check_bounds(&request)?;
    if let Some(used) = line.used.filter(|&used| used > line.cost) {
        return Err(ApiError::bad_request(
            "invalid_settlement",
            format!("used {used} passes the cost reserved ({})", line.cost),
        ));
    }
    Ok(TraceRequest {
        at: line.time.0,
        duration: line.duration_ms.map(Duration::from_millis),
        used: line.used,
        request,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(line: &str) -> String {
        match parse_line(line) {
            Ok(parsed) => panic!("{line} was accepted as {parsed:?}"),
            Err(err) => err.message().to_owned(),
        }
    }

    #[test]
    fn reads_both_forms_of_time() {
        let text = parse_line(
            r#"{"time":"2026-11-29T10:00:00.250Z","domain":"api","descriptors":[{"user":"u1"}]}"#,
        )
        .unwrap();
        let millis = parse_line(
            r#"{"time":1795946400250,"domain":"api","descriptors":[{"user":"u1"}],"cost":3}"#,
        )
        .unwrap();
        assert_eq!(text.at, millis.at);
        assert_eq!(text.at.as_nanos(), 1_795_946_400_250_000_000);
        assert_eq!(text.request.cost, 1);
        assert_eq!(millis.request.cost, 3);
        assert_eq!(&*text.request.descriptors[0][0].1, "u1");
        assert_eq!(text.duration, None);
    }

    #[test]
    fn reads_how_long_a_request_was_in_flight() {
        let line = parse_line(
            r#"{"time":0,"domain":"api","descriptors":[{"user":"u1"}],"duration_ms":1500}"#,
        )
        .unwrap();
        assert_eq!(line.duration, Some(Duration::from_millis(1500)));
        assert!(
            message(r#"{"time":0,"domain":"api","descriptors":[{"user":"u1"}],"duration_ms":-1}"#)
                .contains("integer `-1`")
        );
    }

    #[test]
    fn reads_what_a_reservation_used_and_refuses_more_than_it_reserved() {
        let line = parse_line(
            r#"{"time":0,"domain":"llm","descriptors":[{"user":"u1"}],"cost":900,"used":120}"#,
        )
        .unwrap();
        assert_eq!((line.request.cost, line.used), (900, Some(120)));
        assert!(
            message(r#"{"time":0,"domain":"llm","descriptors":[{"user":"u1"}],"used":2}"#)
                .contains("used 2 passes the cost reserved (1)")
        );
    }

    #[test]
    fn keeps_a_request_id() {
        let line = parse_line(
            r#"{"time":0,"domain":"api","descriptors":[{"user":"u1"}],"request_id":"r-1"}"#,
        )
        .unwrap();
        assert_eq!(line.request.request_id.as_deref(), Some("r-1"));
    }

    #[test]
    fn refuses_what_the_http_api_refuses() {
        let cases = [
            (r#"{"domain":"api","descriptors":[{"user":"u1"}]}"#, "time"),
            (
                r#"{"time":true,"domain":"api","descriptors":[{"user":"u1"}]}"#,
                "invalid type: boolean `true`, expected an RFC 3339 instant such as",
            ),
            (
                r#"{"time":0,"domain":"api","descriptors":[{"user":"u1"}],"cots":2}"#,
                "unknown field `cots`",
            ),
            (
                r#"{"time":0,"domain":"api","descriptors":[{"user":"u1"}],"cost":0}"#,
                "cost must be at least 1",
            ),
            (
                r#"{"time":0,"domain":"","descriptors":[{"user":"u1"}]}"#,
                "domain must not be empty",
            ),
            (
                r#"{"time":0,"domain":"api","descriptors":[]}"#,
                "at least one",
            ),
            (
                r#"{"time":0,"domain":"api","descriptors":[{"user":7}]}"#,
                "values must be strings",
            ),
            (
                r#"{"time":"yesterday","domain":"api","descriptors":[{"user":"u1"}]}"#,
                "not an RFC 3339 instant",
            ),
            (
                r#"{"time":1.5,"domain":"api","descriptors":[{"user":"u1"}]}"#,
                "whole Unix milliseconds",
            ),
            (
                r#"{"time":-1,"domain":"api","descriptors":[{"user":"u1"}]}"#,
                "before 1970",
            ),
            (
                r#"{"time":"1969-12-31T23:59:59Z","domain":"api","descriptors":[{"user":"u1"}]}"#,
                "before 1970",
            ),
            (
                r#"{"time":18446744073709551615,"domain":"api","descriptors":[{"user":"u1"}]}"#,
                "2262",
            ),
            ("not json", "expected"),
        ];
        for (line, expected) in cases {
            let message = message(line);
            assert!(
                message.contains(expected),
                "{line}: {message:?} does not say {expected:?}"
            );
        }
        let long = format!(
            r#"{{"time":0,"domain":"api","descriptors":[{{"user":"{}"}}]}}"#,
            "u".repeat(2000)
        );
        assert!(message(&long).contains("at most 1024"));
    }
}
