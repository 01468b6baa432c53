//! `GET|POST /v1/forward-auth/{domain}`: rate limiting as an auth subrequest, for nginx
//! `auth_request` and Traefik `ForwardAuth`.
//!
//! The proxy forwards the client's headers; one descriptor is built from them:
//! `x-tollgate-<entry>: value` gives that entry, `--forward-auth-header ENTRY=HEADER` maps an
//! existing header (`user=X-User-Id`), and `X-Forwarded-Method`, `X-Forwarded-Uri` or
//! `X-Original-URI` give `method` and `path` (normalised as the proxies route it). With
//! `--forward-auth-address HEADER[:TRUSTED]`, `remote_address` is the client's address as the
//! proxies recorded it, and nothing the client sends sets it. The cost comes from
//! `x-tollgate-cost` (default 1).
//! Allowed: 200 with the rate-limit headers; over the limit: 429 (or the configured deny status,
//! 403 for nginx); failing closed: 503.
//!
//! Whoever reaches this endpoint chooses the entries, so the proxy must pass only the headers
//! it vouches for (nginx: `proxy_pass_request_headers off` and each header set by name;
//! Traefik: `authRequestHeaders`), never the client's own `x-tollgate-*`.

use std::borrow::Cow;
use std::net::IpAddr;
use std::num::NonZeroU64;
use std::sync::Arc;

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use ipnet::IpNet;

use super::check::{
    Entries, Parsed, add_rate_limit_headers, check_bounds, decide_error, status_of,
};
use super::error::ApiError;
use super::{AddressMask, AppState, ClientAddress, MAX_NAME_BYTES};
use crate::metrics::{self, Api};

const PREFIX: &str = "x-tollgate-";
const COST: &str = "x-tollgate-cost";

fn header_str<'h>(headers: &'h HeaderMap, name: &str) -> Result<Option<&'h str>, ApiError> {
    match headers.get(name) {
        None => Ok(None),
        // Proxies pass header bytes on as they came, and user ids and paths are often UTF-8;
        // `HeaderValue::to_str` would refuse everything but visible ASCII.
        Some(value) => std::str::from_utf8(value.as_bytes())
            .map(Some)
            .map_err(|_| {
                ApiError::bad_request(
                    "invalid_header",
                    format!("header {name} is not valid UTF-8"),
                )
            }),
    }
}

/// The entry a client's address goes under: Envoy's name for it (its `remote_address` action).
const REMOTE_ADDRESS: &str = "remote_address";
/// The entry a client's network goes under, as Envoy's `masked_remote_address` action names it.
const MASKED_REMOTE_ADDRESS: &str = "masked_remote_address";

/// The client's address as `source` records it: the entry `source.trusted` from the right of
/// the header's comma-separated list (its lines joined in order), or further left while that
/// entry is inside a trusted proxy's network; in canonical form (an IPv4-mapped IPv6 address
/// as IPv4). When every entry is a trusted proxy's (a request only they handled), the first.
/// `None` when the header is absent, too short, or the entry reached is not an address alone:
/// a walk stops at the first entry it cannot read, as everything left of it is unvouched for.
///
/// A line is read entry by entry, whatever bytes it holds: proxies append to the line the
/// client sent (nginx's `$proxy_add_x_forwarded_for`), so a line dropped for one bad byte of
/// the client's would drop the address they vouch for too, and with it every limit keyed by
/// the address. An entry that is not UTF-8 is unreadable, and stops a walk that reaches it.
fn client_address(headers: &HeaderMap, source: &ClientAddress) -> Option<IpAddr> {
    let lines: Vec<Cow<'_, str>> = headers
        .get_all(source.header.as_str())
        .iter()
        .map(|value| String::from_utf8_lossy(value.as_bytes()))
        .collect();
    let entries: Vec<&str> = lines
        .iter()
        .flat_map(|line| line.split(','))
        .map(str::trim)
        .filter(|entry| !entry.is_empty())
        .collect();
    let start = entries.len().checked_sub(source.trusted + 1)?;
    tollgate_policy::forwarded_client(entries.get(..=start)?, &source.proxies)?.ok()
}

/// `address`'s network under `mask`, written as Envoy writes `masked_remote_address`: the
/// network's first address and its length.
fn masked(address: IpAddr, mask: AddressMask) -> String {
    let len = if address.is_ipv4() { mask.v4 } else { mask.v6 };
    // The lengths were checked against each family's width when the flag was read.
    IpNet::new(address, len).map_or_else(|_| address.to_string(), |net| net.trunc().to_string())
}

/// `path` as the proxy routes it, so that a limit on a path holds for every spelling of it.
/// The proxies pass the request's path on as the client wrote it (nginx's `$request_uri`,
/// Traefik's `X-Forwarded-Uri`) but route it normalised, so `/v1//pay%6Dents/./` reaches the
/// same handler as `/v1/payments/` and must meet the same limit. As nginx matches its
/// locations: escapes of visible ASCII are decoded once (`%2F` too, so `/admin%2Fusers` meets
/// a limit on the `/admin/` prefix; `%25`, the percent sign, and escapes of anything else keep
/// their form, hex digits upper-cased), then `.` and `..` segments removed (RFC 3986 5.2.4)
/// and runs of slashes merged (`merge_slashes`). Erring this way, a limit counts every
/// spelling a proxy may route to its path, at worst also a resource that an application
/// tells apart by an escaped slash. A path that does not start with `/` is left as it is.
fn normalized_path(path: &str) -> Cow<'_, str> {
    let plain = !path.contains('%') && !path.contains("//") && !path.contains("/.");
    if plain || !path.starts_with('/') {
        return Cow::Borrowed(path);
    }
    let hex = |b: u8| char::from(b).to_digit(16);
    let bytes = path.as_bytes();
    let mut decoded = String::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        let escape = (bytes[i] == b'%')
            .then(|| Some((hex(*bytes.get(i + 1)?)?, hex(*bytes.get(i + 2)?)?)))
            .flatten();
        match escape {
            Some((high, low)) => {
                // Two hex digits: the value fits a byte.
                let byte = u8::try_from(high * 16 + low).unwrap_or(b'%');
                if byte.is_ascii_graphic() && byte != b'%' {
                    decoded.push(char::from(byte));
                } else {
                    decoded.push_str(&format!("%{byte:02X}"));
                }
                i += 3;
            }
            None => {
                // Not an escape: copy up to the next '%' whole (the path is UTF-8).
                let next = path[i + 1..].find('%').map_or(path.len(), |at| i + 1 + at);
                decoded.push_str(&path[i..next]);
                i = next;
            }
        }
    }
    let mut segments: Vec<&str> = Vec::new();
    let mut trailing = false;
    for segment in decoded.split('/').skip(1) {
        trailing = matches!(segment, "" | "." | "..");
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            _ => segments.push(segment),
        }
    }
    let mut out = String::with_capacity(decoded.len());
    for segment in &segments {
        out.push('/');
        out.push_str(segment);
    }
    if trailing || segments.is_empty() {
        out.push('/');
    }
    Cow::Owned(out)
}

/// The descriptor the headers give, its strings borrowed from them and from `mapping`.
fn descriptor<'a>(
    headers: &'a HeaderMap,
    mapping: &'a [(String, String)],
    address: Option<&ClientAddress>,
) -> Result<Entries<'a>, ApiError> {
    let mut entries: Entries<'a> = Vec::new();
    let mut set = |entry: &'a str, value: Cow<'a, str>| match entries
        .iter_mut()
        .find(|(key, _)| key == entry)
    {
        Some(existing) => existing.1 = value,
        None => entries.push((Cow::Borrowed(entry), value)),
    };
    if let Some(method) = header_str(headers, "x-forwarded-method")? {
        set("method", Cow::Borrowed(method));
    }
    let uri = match header_str(headers, "x-forwarded-uri")? {
        Some(uri) => Some(uri),
        None => header_str(headers, "x-original-uri")?,
    };
    if let Some(uri) = uri {
        // The path alone: a query string would make every URL its own bucket.
        set(
            "path",
            normalized_path(uri.split('?').next().unwrap_or(uri)),
        );
    }
    for (entry, header) in mapping {
        if let Some(value) = header_str(headers, header)? {
            set(entry, Cow::Borrowed(value));
        }
    }
    // Explicit entries come last, so they win over mapped and derived ones.
    for name in headers.keys() {
        let name = name.as_str();
        if let Some(entry) = name.strip_prefix(PREFIX)
            && name != COST
            && !entry.is_empty()
            && let Some(value) = header_str(headers, name)?
        {
            set(entry, Cow::Borrowed(value));
        }
    }
    // Last, so that it wins: what the trusted proxies recorded, never what the client sent
    // (an `x-tollgate-remote_address` of its own, or a network, is dropped when no address
    // is found).
    if let Some(source) = address {
        entries.retain(|(key, _)| key != REMOTE_ADDRESS && key != MASKED_REMOTE_ADDRESS);
        if let Some(found) = client_address(headers, source) {
            entries.push((Cow::Borrowed(REMOTE_ADDRESS), Cow::Owned(found.to_string())));
            if let Some(mask) = source.mask {
                entries.push((
                    Cow::Borrowed(MASKED_REMOTE_ADDRESS),
                    Cow::Owned(masked(found, mask)),
                ));
            }
        }
    }
    Ok(entries)
}

/// The request the headers describe, within the bounds of every front end.
fn parse<'a>(
    domain: String,
    headers: &'a HeaderMap,
    mapping: &'a [(String, String)],
    address: Option<&ClientAddress>,
) -> Result<Parsed<'a>, ApiError> {
    let cost = match header_str(headers, COST)? {
        None => NonZeroU64::MIN,
        Some(text) => text.trim().parse().map_err(|_| {
            ApiError::bad_request("invalid_cost", format!("{COST} must be a whole number ≥ 1"))
        })?,
    };
    let parsed = Parsed {
        domain: Cow::Owned(domain),
        descriptors: vec![descriptor(headers, mapping, address)?],
        cost: cost.get(),
        request_id: None,
    };
    if parsed.descriptors.iter().all(Vec::is_empty) {
        // A client with none of the headers (an anonymous one, say) is not bad input, as an
        // empty descriptor in a JSON body is, which `check_bounds` refuses: only limits that
        // apply to every request of the domain match it, and with none the request is allowed
        // and counted as unmatched (SPEC §5). A 400 would be a 500 for the client behind nginx.
        if parsed.domain.len() > MAX_NAME_BYTES {
            return Err(ApiError::bad_request(
                "too_large",
                format!(
                    "domain is {} bytes long; at most {MAX_NAME_BYTES} are accepted",
                    parsed.domain.len()
                ),
            ));
        }
    } else {
        check_bounds(&parsed)?;
    }
    Ok(parsed)
}

pub(crate) async fn forward_auth(
    State(state): State<Arc<AppState>>,
    domain: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    decide(&state, domain.ok().map(|Path(domain)| domain), &headers).await
}

/// `/v1/forward-auth/{domain}` once its domain is percent-decoded (`None`: not UTF-8 then),
/// by the router or without it ([`super::direct`]).
pub(super) async fn decide(
    state: &AppState,
    domain: Option<String>,
    headers: &HeaderMap,
) -> Result<Response, ApiError> {
    let options = &state.options;
    // axum refuses a domain that is not UTF-8 once percent-decoded (`%A0`) in plain text; the
    // proxy's logs should get the error body of every other refusal.
    let Some(domain) = domain else {
        metrics::record_invalid(Api::ForwardAuth);
        return Err(ApiError::bad_request(
            "invalid_domain",
            "the domain in the path is not UTF-8 once percent-decoded",
        ));
    };
    let parsed = parse(
        domain,
        headers,
        &options.forward_auth_headers,
        options.forward_auth_address.as_ref(),
    )
    .inspect_err(|_| metrics::record_invalid(Api::ForwardAuth))?;
    let outcome = state
        .decider
        .decide(Api::ForwardAuth, &parsed.request())
        .await
        .map_err(decide_error)?;
    let status = status_of(&outcome, state.options.forward_auth_deny);
    let text = match status {
        StatusCode::OK => "allowed",
        StatusCode::SERVICE_UNAVAILABLE => "rate limiter store unavailable",
        _ => "rate limited",
    };
    let mut response = (status, text).into_response();
    add_rate_limit_headers(
        response.headers_mut(),
        &outcome,
        state.options.rate_limit_headers,
    );
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn owned(entries: Entries<'_>) -> Vec<(String, String)> {
        entries
            .into_iter()
            .map(|(key, value)| (key.into_owned(), value.into_owned()))
            .collect()
    }

    #[test]
    fn builds_one_descriptor_from_headers() {
        let mut headers = HeaderMap::new();
        headers.insert("x-forwarded-method", HeaderValue::from_static("POST"));
        headers.insert("x-original-uri", HeaderValue::from_static("/v1/pay?x=1"));
        headers.insert("x-user-id", HeaderValue::from_static("u1"));
        headers.insert("x-tollgate-tenant", HeaderValue::from_static("acme"));
        headers.insert("x-tollgate-cost", HeaderValue::from_static("3"));
        let mapping = vec![("user".to_owned(), "x-user-id".to_owned())];
        let mut entries = owned(descriptor(&headers, &mapping, None).unwrap());
        entries.sort();
        let expected = [
            ("method", "POST"),
            ("path", "/v1/pay"),
            ("tenant", "acme"),
            ("user", "u1"),
        ];
        let expected: Vec<(String, String)> = expected
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        assert_eq!(entries, expected);
    }

    /// Every spelling of a path the proxies route alike is one `path` value; a plain path is
    /// taken as it is, without a copy.
    #[test]
    fn paths_are_normalised_as_proxies_route_them() {
        for (raw, path) in [
            ("/orders", "/orders"),
            ("/", "/"),
            ("", ""),
            ("*", "*"),
            ("//orders///2", "/orders/2"),
            ("/a/./b/../c", "/a/c"),
            ("/a/b/..", "/a/"),
            ("/a/b/.", "/a/b/"),
            ("/../../etc", "/etc"),
            ("/a/.hidden/..x", "/a/.hidden/..x"),
            ("/v1//pay%6Dents/./", "/v1/payments/"),
            ("/%2E%2E/%2e/x", "/x"),
            ("/a%2fb%3F", "/a/b?"),
            ("/admin%2F..%2Fpublic", "/public"),
            ("/%2541/%20/%ff", "/%2541/%20/%FF"),
            ("/%7Euser/%41", "/~user/A"),
            ("/100%/%zz/%4", "/100%/%zz/%4"),
            ("/ü%C3%BC", "/ü%C3%BC"),
            ("/a/", "/a/"),
        ] {
            assert_eq!(normalized_path(raw), path, "{raw}");
        }
        assert!(matches!(normalized_path("/v1/orders/7"), Cow::Borrowed(_)));
        // Through the headers, with the query left out first.
        let mut headers = HeaderMap::new();
        headers.insert(
            "x-original-uri",
            HeaderValue::from_static("/v1//%6Frders/../orders?page=2"),
        );
        let entries = owned(descriptor(&headers, &[], None).unwrap());
        assert_eq!(entries, [("path".to_owned(), "/v1/orders".to_owned())]);
    }

    /// Paths built of segments, escapes among them, as clients spell them.
    fn spelt_paths() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let piece = prop::sample::select(vec![
            "a", "b", ".", "..", "", "%2F", "%2f", "%2E", "%2e%2E", "%41", "%2541", "%20", "~",
            "a%2Fb", "%FF",
        ]);
        prop::collection::vec(piece, 0..8).prop_map(|pieces| format!("/{}", pieces.join("/")))
    }

    proptest::proptest! {
        /// A normalised path is normal: normalising it again changes nothing, and it holds no
        /// empty, `.` or `..` segment but a last empty one (a trailing slash).
        #[test]
        fn a_normalised_path_is_a_fixed_point(path in spelt_paths()) {
            let once = normalized_path(&path).into_owned();
            proptest::prop_assert_eq!(normalized_path(&once), once.as_str());
            let segments: Vec<&str> = once.split('/').skip(1).collect();
            if let Some((_, inner)) = segments.split_last() {
                proptest::prop_assert!(
                    inner.iter().all(|s| !matches!(*s, "" | "." | "..")),
                    "{} -> {}", path, once
                );
            }
            proptest::prop_assert!(!once.ends_with("/.") && !once.ends_with("/.."), "{}", once);
        }
    }

    /// The client's address: from the right of a forwarded chain, past the trusted proxies;
    /// canonical; never from what the client sends when a source is set.
    #[test]
    fn the_client_address_is_the_proxies_not_the_clients() {
        let xff = |trusted| ClientAddress {
            header: "x-forwarded-for".to_owned(),
            trusted,
            proxies: Vec::new(),
            mask: None,
        };
        let address = |headers: &HeaderMap, source: &ClientAddress| {
            owned(descriptor(headers, &[], Some(source)).unwrap())
                .into_iter()
                .find(|(key, _)| key == REMOTE_ADDRESS)
                .map(|(_, value)| value)
        };
        let mut headers = HeaderMap::new();
        // The client wrote the first two; the proxy in front appended 198.51.100.4, the one
        // calling tollgate 203.0.113.7.
        headers.append(
            "x-forwarded-for",
            HeaderValue::from_static("6.6.6.6, 10.0.0.1,198.51.100.4"),
        );
        headers.append("x-forwarded-for", HeaderValue::from_static("203.0.113.7"));
        headers.insert(
            "x-tollgate-remote_address",
            HeaderValue::from_static("1.1.1.1"),
        );
        assert_eq!(address(&headers, &xff(0)).as_deref(), Some("203.0.113.7"));
        assert_eq!(address(&headers, &xff(1)).as_deref(), Some("198.51.100.4"));
        assert_eq!(address(&headers, &xff(3)).as_deref(), Some("6.6.6.6"));
        // Past the chain's start, or no address there: none, and not the client's own.
        assert_eq!(address(&headers, &xff(4)), None);
        headers.insert("x-forwarded-for", HeaderValue::from_static("unknown"));
        assert_eq!(address(&headers, &xff(0)), None);
        headers.insert(
            "x-forwarded-for",
            HeaderValue::from_static("203.0.113.7:443"),
        );
        assert_eq!(address(&headers, &xff(0)), None);
        // A client's entry that is not even UTF-8 stops a walk that reaches it, and only then:
        // what its proxies appended to the same line is read.
        headers.insert(
            "x-forwarded-for",
            HeaderValue::from_bytes(b"6.6.6.\xff, 198.51.100.4,203.0.113.7").unwrap(),
        );
        assert_eq!(address(&headers, &xff(0)).as_deref(), Some("203.0.113.7"));
        assert_eq!(address(&headers, &xff(1)).as_deref(), Some("198.51.100.4"));
        assert_eq!(address(&headers, &xff(2)), None);
        // One address alone, IPv4-mapped IPv6 read as IPv4.
        let real = ClientAddress {
            header: "x-real-ip".to_owned(),
            trusted: 0,
            proxies: Vec::new(),
            mask: None,
        };
        headers.insert("x-real-ip", HeaderValue::from_static(" ::ffff:192.0.2.9 "));
        assert_eq!(address(&headers, &real).as_deref(), Some("192.0.2.9"));
        // Without a source, the client's own entry stands, as any x-tollgate- entry does.
        let entries = owned(descriptor(&headers, &[], None).unwrap());
        assert!(entries.contains(&(REMOTE_ADDRESS.to_owned(), "1.1.1.1".to_owned())));
    }

    /// Past the counted hops, the walk goes left over every trusted proxy's address, stops at
    /// the first other one, and stops short at anything it cannot read.
    #[test]
    fn the_walk_passes_over_trusted_proxy_networks() {
        let networks = |list: &[&str]| {
            list.iter()
                .map(|text| text.parse().unwrap())
                .collect::<Vec<tollgate_policy::Network>>()
        };
        let walk = |chain: &str, trusted, proxies: &[&str]| {
            let mut headers = HeaderMap::new();
            headers.insert("x-forwarded-for", HeaderValue::from_str(chain).unwrap());
            let source = ClientAddress {
                header: "x-forwarded-for".to_owned(),
                trusted,
                proxies: networks(proxies),
                mask: None,
            };
            client_address(&headers, &source).map(|found| found.to_string())
        };
        let lan = ["10.0.0.0/8", "fd00::/8"];
        assert_eq!(
            walk("6.6.6.6, 198.51.100.4, 10.1.1.1, 10.2.2.2", 0, &lan).as_deref(),
            Some("198.51.100.4")
        );
        // A mapped IPv6 proxy is the IPv4 one; an IPv6 client stays IPv6.
        assert_eq!(
            walk("2001:db8::5, ::ffff:10.1.1.1, fd00::1", 0, &lan).as_deref(),
            Some("2001:db8::5")
        );
        // The counted hops come first, whatever their address: the CDN at 203.0.113.1 is
        // trusted by count, the balancer by network.
        assert_eq!(
            walk("198.51.100.4, 10.1.1.1, 203.0.113.1", 1, &lan).as_deref(),
            Some("198.51.100.4")
        );
        // Only trusted proxies handled it (a health check): the first of them.
        assert_eq!(
            walk("10.9.9.9, 10.1.1.1", 0, &lan).as_deref(),
            Some("10.9.9.9")
        );
        // An entry that is no address stops the walk: nothing left of it is vouched for.
        assert_eq!(walk("198.51.100.4, unknown, 10.1.1.1", 0, &lan), None);
        // Without networks, the counted entry alone.
        assert_eq!(
            walk("198.51.100.4, 10.1.1.1", 0, &[]).as_deref(),
            Some("10.1.1.1")
        );
    }

    /// With a mask, the client's network goes under `masked_remote_address` as Envoy writes
    /// it, beside the address; a client's own network entry is dropped as its address is.
    #[test]
    fn the_masked_address_is_the_clients_network() {
        let source = ClientAddress {
            header: "x-real-ip".to_owned(),
            trusted: 0,
            proxies: Vec::new(),
            mask: Some(AddressMask { v4: 24, v6: 64 }),
        };
        let entries_for = |address: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert("x-real-ip", HeaderValue::from_static(address));
            headers.insert(
                "x-tollgate-masked_remote_address",
                HeaderValue::from_static("0.0.0.0/0"),
            );
            let mut entries = owned(descriptor(&headers, &[], Some(&source)).unwrap());
            entries.sort();
            entries
        };
        let pair = |key: &str, value: &str| (key.to_owned(), value.to_owned());
        assert_eq!(
            entries_for("198.51.100.77"),
            [
                pair(MASKED_REMOTE_ADDRESS, "198.51.100.0/24"),
                pair(REMOTE_ADDRESS, "198.51.100.77")
            ]
        );
        assert_eq!(
            entries_for("2001:db8:1:2:aaaa::9"),
            [
                pair(MASKED_REMOTE_ADDRESS, "2001:db8:1:2::/64"),
                pair(REMOTE_ADDRESS, "2001:db8:1:2:aaaa::9")
            ]
        );
        // An IPv4 client written as IPv6 gets the IPv4 mask.
        assert_eq!(
            entries_for("::ffff:198.51.100.77")[0],
            pair(MASKED_REMOTE_ADDRESS, "198.51.100.0/24")
        );
        // No address found: neither entry, and not the client's own.
        assert!(entries_for("unknown").is_empty());
    }

    #[test]
    fn utf8_header_values_are_taken_and_invalid_bytes_refused() {
        let mapping = vec![("user".to_owned(), "x-user-id".to_owned())];
        let mut headers = HeaderMap::new();
        headers.insert(
            "x-user-id",
            HeaderValue::from_bytes("jos\u{e9}".as_bytes()).unwrap(),
        );
        let entries = owned(descriptor(&headers, &mapping, None).unwrap());
        assert_eq!(entries, vec![("user".to_owned(), "jos\u{e9}".to_owned())]);
        headers.insert("x-user-id", HeaderValue::from_bytes(b"jos\xe9").unwrap());
        let err = descriptor(&headers, &mapping, None).unwrap_err();
        assert!(format!("{err:?}").contains("invalid_header"), "{err:?}");
    }

    #[test]
    fn no_descriptor_header_is_an_empty_descriptor_not_an_error() {
        let none = HeaderMap::new();
        let parsed = parse("api".to_owned(), &none, &[], None).unwrap();
        assert_eq!(parsed.descriptors, vec![Entries::new()]);
        assert_eq!(parsed.cost, 1);
        let mut headers = HeaderMap::new();
        headers.insert("x-tollgate-cost", HeaderValue::from_static("0"));
        assert!(parse("api".to_owned(), &headers, &[], None).is_err());
        assert!(parse("d".repeat(MAX_NAME_BYTES + 1), &HeaderMap::new(), &[], None).is_err());
    }

    /// A header sent empty is an entry with the empty value (one bucket shared by every such
    /// request, as over the JSON API), not a missing entry.
    #[test]
    fn an_empty_header_is_an_empty_value() {
        let mapping = vec![("user".to_owned(), "x-user-id".to_owned())];
        let mut headers = HeaderMap::new();
        headers.insert("x-user-id", HeaderValue::from_static(""));
        headers.insert("x-tollgate-tier", HeaderValue::from_static(""));
        let mut entries = owned(descriptor(&headers, &mapping, None).unwrap());
        entries.sort();
        let expected = [("tier", ""), ("user", "")].map(|(k, v)| (k.to_owned(), v.to_owned()));
        assert_eq!(entries, expected);
    }

    #[test]
    fn explicit_entries_win() {
        let mut headers = HeaderMap::new();
        headers.insert("x-forwarded-method", HeaderValue::from_static("GET"));
        headers.insert("x-tollgate-method", HeaderValue::from_static("POST"));
        let entries = owned(descriptor(&headers, &[], None).unwrap());
        assert_eq!(entries, vec![("method".to_owned(), "POST".to_owned())]);
    }
}
