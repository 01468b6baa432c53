//! The check body in its usual shape, read without serde.
//!
//! Nearly every check body is a small object of plain strings,
//! `{"domain":"api","descriptors":[{"user":"u1"}],"cost":1}`, and serde_json reads one through
//! its generic visitors for more instructions than the decision itself takes (BENCHMARKS.md,
//! twelfth session). This reader takes only what it is sure of: strings without escapes, a
//! cost written as plain digits, `null` or a string for the request id, each field at most
//! once and no other. For anything else it answers `None` and the body goes to serde_json,
//! so every error, and every body this reader does not know, is read and answered exactly as
//! before; a property test holds its readings to serde_json's of the same bytes.

use std::borrow::Cow;

use super::check::{Entries, Parsed};

/// `body` read, when it has the usual shape; `None` sends it to serde_json.
pub(super) fn read(body: &[u8]) -> Option<Parsed<'_>> {
    // Once for the whole body: every string is then a slice of it between ASCII quotes.
    let text = std::str::from_utf8(body).ok()?;
    let mut reader = Reader { text, at: 0 };
    let mut domain = None;
    let mut descriptors = None;
    let mut cost = None;
    let mut request_id = None;
    reader.open(b'{')?;
    if !reader.eat(b'}') {
        loop {
            let field = reader.string()?;
            reader.open(b':')?;
            // A field given twice is serde's error to report.
            match field {
                "domain" if domain.is_none() => domain = Some(reader.string()?),
                "descriptors" if descriptors.is_none() => descriptors = Some(reader.descriptors()?),
                "cost" if cost.is_none() => cost = Some(reader.number()?),
                "request_id" if request_id.is_none() => request_id = Some(reader.string_or_null()?),
                _ => return None,
            }
            if !reader.next(b'}')? {
                break;
            }
        }
    }
    reader.skip_space();
    if reader.at != text.len() {
        return None;
    }
    Some(Parsed {
        domain: Cow::Borrowed(domain?),
        descriptors: descriptors?,
        cost: cost.unwrap_or(1),
        request_id: request_id.flatten().map(Cow::Borrowed),
    })
}

/// The bytes that end a run of plain string: the closing quote, a backslash (an escape) and
/// the control characters (JSON refuses them raw). One table lookup a byte.
const ENDS_RUN: [bool; 256] = {
    let mut ends = [false; 256];
    let mut byte = 0;
    while byte < 0x20 {
        ends[byte] = true;
        byte += 1;
    }
    ends[b'"' as usize] = true;
    ends[b'\\' as usize] = true;
    ends
};

struct Reader<'a> {
    text: &'a str,
    /// The byte offset of the next unread byte.
    at: usize,
}

impl<'a> Reader<'a> {
    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.at).copied()
    }

    /// Skips JSON's whitespace.
    fn skip_space(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.at += 1;
        }
    }

    /// Takes `byte` (after any whitespace) if it comes next.
    fn eat(&mut self, byte: u8) -> bool {
        // Bodies are seldom spaced: look for the byte before looking for spaces.
        if self.peek() != Some(byte) {
            self.skip_space();
            if self.peek() != Some(byte) {
                return false;
            }
        }
        self.at += 1;
        true
    }

    /// Takes `byte`, which must come next.
    fn open(&mut self, byte: u8) -> Option<()> {
        self.eat(byte).then_some(())
    }

    /// After a member or an element: `Some(true)` for a comma (another follows),
    /// `Some(false)` for `close`, `None` for anything else.
    fn next(&mut self, close: u8) -> Option<bool> {
        if self.eat(b',') {
            Some(true)
        } else {
            self.eat(close).then_some(false)
        }
    }

    /// A string without escapes or control characters, as the slice of the body it is.
    fn string(&mut self) -> Option<&'a str> {
        self.open(b'"')?;
        let start = self.at;
        let bytes = self.text.as_bytes();
        let mut end = start;
        while !ENDS_RUN[usize::from(*bytes.get(end)?)] {
            end += 1;
        }
        // Else an escape or a control character: serde_json's to read or refuse.
        (bytes[end] == b'"').then_some(())?;
        self.at = end + 1;
        self.text.get(start..end)
    }

    fn string_or_null(&mut self) -> Option<Option<&'a str>> {
        self.skip_space();
        if self.text.as_bytes()[self.at..].starts_with(b"null") {
            self.at += 4;
            return Some(None);
        }
        self.string().map(Some)
    }

    /// An unsigned integer in plain digits that fits a `u64` (at most 19 of them, without a
    /// leading zero). A sign, fraction or exponent is left unread, for the caller to refuse.
    fn number(&mut self) -> Option<u64> {
        self.skip_space();
        let digits = &self.text.as_bytes()[self.at..];
        let len = digits.iter().take_while(|b| b.is_ascii_digit()).count();
        if len == 0 || len > 19 || (len > 1 && digits[0] == b'0') {
            return None;
        }
        self.at += len;
        Some(
            digits[..len]
                .iter()
                .fold(0, |value, &digit| value * 10 + u64::from(digit - b'0')),
        )
    }

    /// `[{"name":"value",…},…]`.
    fn descriptors(&mut self) -> Option<Vec<Entries<'a>>> {
        self.open(b'[')?;
        // Sized for the usual one: growing from empty costs more than the allocation.
        let mut list = Vec::with_capacity(1);
        if self.eat(b']') {
            return Some(list);
        }
        loop {
            list.push(self.entries()?);
            if !self.next(b']')? {
                return Some(list);
            }
        }
    }

    /// `{"name":"value",…}`, in the order given.
    fn entries(&mut self) -> Option<Entries<'a>> {
        self.open(b'{')?;
        let mut entries = Vec::with_capacity(2);
        if self.eat(b'}') {
            return Some(entries);
        }
        loop {
            let name = self.string()?;
            self.open(b':')?;
            let value = self.string()?;
            entries.push((Cow::Borrowed(name), Cow::Borrowed(value)));
            if !self.next(b'}')? {
                return Some(entries);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use proptest::strategy::ValueTree;

    use super::super::check::parse_with_serde;
    use super::*;

    #[test]
    fn the_usual_bodies_are_read_here() {
        let read = |body: &'static str| read(body.as_bytes());
        let parsed = read(r#"{"domain":"api","descriptors":[{"user":"u1"}]}"#).unwrap();
        assert_eq!(parsed.domain, "api");
        assert_eq!(parsed.descriptors, vec![vec![("user".into(), "u1".into())]]);
        assert_eq!((parsed.cost, parsed.request_id), (1, None));
        let parsed = read(
            " {\n \"cost\" : 12 ,\"request_id\":\"r-1\",\t\"descriptors\":[{\"a\":\"1\",\"b\":\"\"},{}],\
             \"domain\":\"\u{e9}\"}\r\n",
        )
        .unwrap();
        assert_eq!(parsed.domain, "\u{e9}");
        assert_eq!(parsed.descriptors.len(), 2);
        assert_eq!(parsed.descriptors[0][1], ("b".into(), "".into()));
        assert!(parsed.descriptors[1].is_empty());
        assert_eq!(parsed.cost, 12);
        assert_eq!(parsed.request_id.as_deref(), Some("r-1"));
        let parsed = read(r#"{"domain":"a","descriptors":[],"request_id":null,"cost":0}"#).unwrap();
        assert!(parsed.descriptors.is_empty());
        assert_eq!((parsed.cost, parsed.request_id), (0, None));
        // Spaces and DEL are plain in a JSON string: only the bytes below a space end a run.
        let parsed =
            super::read(b"{\"domain\":\"a b\",\"descriptors\":[{\"user\":\" \x7f~\"}]}").unwrap();
        assert_eq!(parsed.domain, "a b");
        assert_eq!(parsed.descriptors[0][0].1, " \u{7f}~");
        // Every cost of 19 digits fits a u64 and is read here (20 go to serde, below).
        for (digits, cost) in [
            ("1000000000000000000", 1_000_000_000_000_000_000),
            ("9999999999999999999", 9_999_999_999_999_999_999),
        ] {
            let body = format!(r#"{{"domain":"a","descriptors":[],"cost":{digits}}}"#);
            assert_eq!(
                super::read(body.as_bytes()).map(|parsed| parsed.cost),
                Some(cost)
            );
        }
    }

    #[test]
    fn anything_else_goes_to_serde() {
        for body in [
            "",
            "{",
            "{}",
            r#"{"descriptors":[{"user":"u1"}]}"#,
            r#"{"domain":"a\"b","descriptors":[{"user":"u1"}]}"#,
            r#"{"domain":"api","descriptors":[{"user":"u\u0031"}]}"#,
            r#"{"domain":"api","descriptors":[{"user":5}]}"#,
            r#"{"domain":"api","descriptors":[{"user":"u1"}],"cost":-1}"#,
            r#"{"domain":"api","descriptors":[{"user":"u1"}],"cost":1.0}"#,
            r#"{"domain":"api","descriptors":[{"user":"u1"}],"cost":1e2}"#,
            r#"{"domain":"api","descriptors":[{"user":"u1"}],"cost":01}"#,
            r#"{"domain":"api","descriptors":[{"user":"u1"}],"cost":18446744073709551616}"#,
            r#"{"domain":"api","descriptors":[{"user":"u1"}],"cost":null}"#,
            r#"{"domain":"api","descriptors":[{"user":"u1"}],"cots":1}"#,
            r#"{"domain":"api","domain":"api","descriptors":[{"user":"u1"}]}"#,
            r#"{"domain":"api","descriptors":[{"user":"u1"}],}"#,
            r#"{"domain":"api","descriptors":[{"user":"u1"},]}"#,
            r#"{"domain":"api","descriptors":[{"user":"u1"}]} x"#,
            r#"{"domain":"api","descriptors":[{"user":"u1"}],"request_id":nul}"#,
            "{\"domain\":\"a\tb\",\"descriptors\":[]}",
        ] {
            assert!(read(body.as_bytes()).is_none(), "{body}");
        }
        assert!(read(b"{\"domain\":\"\xff\",\"descriptors\":[]}").is_none());
    }

    /// A JSON value for a string field: mostly plain strings (this reader's), sometimes not.
    fn string_token() -> impl Strategy<Value = String> {
        prop_oneof![
            20 => "[a-z0-9_\\-]{0,6}".prop_map(|s| format!("\"{s}\"")),
            3 => "[a-z\u{e9}\u{1F600}]{0,3}".prop_map(|s| format!("\"{s}\"")),
            1 => Just(r#""a\"b""#.to_owned()),
            1 => Just(r#""\u0041""#.to_owned()),
            1 => Just("\"a\tb\"".to_owned()),
            1 => prop_oneof![Just("5"), Just("null"), Just("true"), Just("[]"), Just("{}")]
                .prop_map(str::to_owned),
        ]
    }

    fn number_token() -> impl Strategy<Value = String> {
        prop_oneof![
            4 => (0u64..1000).prop_map(|n| n.to_string()),
            1 => any::<u64>().prop_map(|n| n.to_string()),
            1 => prop_oneof![
                Just("-1"), Just("-0"), Just("01"), Just("1.0"), Just("1e3"), Just("null"),
                Just("18446744073709551616"), Just("99999999999999999999"), Just("\"1\""),
            ]
            .prop_map(str::to_owned),
        ]
    }

    fn space() -> impl Strategy<Value = &'static str> {
        prop_oneof![8 => Just(""), 1 => Just(" "), 1 => Just("\n\t "), 1 => Just("\r\n")]
    }

    fn object(members: &[(String, String)], spaces: &[&str]) -> String {
        let mut out = String::from("{");
        for (index, (name, value)) in members.iter().enumerate() {
            if index > 0 {
                out.push(',');
            }
            let space = spaces.get(index).copied().unwrap_or("");
            out.push_str(&format!("{space}{name}{space}:{value}"));
        }
        out.push('}');
        out
    }

    fn descriptors_token() -> impl Strategy<Value = String> {
        let entry = (string_token(), string_token());
        let descriptor = (
            prop::collection::vec(entry, 0..4),
            prop::collection::vec(space(), 4),
        )
            .prop_map(|(members, spaces)| object(&members, &spaces));
        prop_oneof![
            8 => prop::collection::vec(descriptor, 0..4)
                .prop_map(|list| format!("[{}]", list.join(","))),
            1 => Just(r#"{"user":"u1"}"#.to_owned()),
            1 => Just(r#"["user"]"#.to_owned()),
        ]
    }

    /// Any member of a check body, known or not, well-formed or not.
    fn member() -> impl Strategy<Value = (String, String)> {
        prop_oneof![
            string_token().prop_map(|v| ("\"domain\"".to_owned(), v)),
            descriptors_token().prop_map(|v| ("\"descriptors\"".to_owned(), v)),
            number_token().prop_map(|v| ("\"cost\"".to_owned(), v)),
            prop_oneof![string_token(), Just("null".to_owned())]
                .prop_map(|v| ("\"request_id\"".to_owned(), v)),
            string_token().prop_map(|v| ("\"other\"".to_owned(), v)),
            string_token().prop_map(|v| (r#""dom\u0061in""#.to_owned(), v)),
        ]
    }

    /// A check body: usually a domain and descriptors, with other members in any order.
    fn body() -> impl Strategy<Value = String> {
        let members = (
            prop::option::weighted(0.9, string_token()),
            prop::option::weighted(0.9, descriptors_token()),
            prop::collection::vec(member(), 0..3),
        )
            .prop_flat_map(|(domain, descriptors, mut members)| {
                members.extend(domain.map(|v| ("\"domain\"".to_owned(), v)));
                members.extend(descriptors.map(|v| ("\"descriptors\"".to_owned(), v)));
                Just(members).prop_shuffle()
            });
        (
            members,
            prop::collection::vec(space(), 6),
            space(),
            prop_oneof![8 => Just(""), 1 => Just(","), 1 => Just("x")],
        )
            .prop_map(|(members, spaces, around, tail)| {
                format!("{around}{}{around}{tail}", object(&members, &spaces))
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]

        /// Whatever this reader reads, serde_json reads the same from the same bytes; and the
        /// usual bodies (every string plain, the cost in digits) are read here.
        #[test]
        fn what_is_read_here_is_what_serde_reads(body in body(), cut in 0usize..200) {
            for bytes in [body.as_bytes(), &body.as_bytes()[..cut.min(body.len())]] {
                if let Some(fast) = read(bytes) {
                    let slow = parse_with_serde(bytes);
                    prop_assert!(slow.is_ok(), "{body}: serde refused {:?}", slow.err());
                    prop_assert_eq!(&fast, &slow.ok().unwrap(), "{}", body);
                }
            }
        }
    }

    #[test]
    fn the_generated_bodies_include_many_read_here() {
        let mut runner = proptest::test_runner::TestRunner::deterministic();
        let strategy = body();
        let mut read_here = 0;
        for _ in 0..2000 {
            let body = strategy.new_tree(&mut runner).unwrap().current();
            read_here += usize::from(read(body.as_bytes()).is_some());
        }
        // Otherwise the property above would hold by reading nothing.
        assert!(read_here > 100, "only {read_here} of 2000 read here");
    }
}
