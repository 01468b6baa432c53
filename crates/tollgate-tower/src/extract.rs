//! Who a request counts against: key extractors.
//!
//! A rate limit is only as good as its key. The extractors here read the head of a request
//! (never the body, which the layer does not buffer) through [`RequestHead`], a borrowed view
//! that does not depend on the request's body type, so one extractor serves axum, hyper and
//! tonic alike.
//!
//! # Trusting forwarded headers
//!
//! `X-Forwarded-For`, `X-Real-IP`, `Forwarded` and their kin are written by whoever sends the
//! request. Keying on them when clients can reach the service directly lets every client pick
//! its own key, and so its own fresh bucket: no limit at all. Key on a forwarded address only
//! behind a proxy you run, which overwrites (or appends to) the header, and then take the entry
//! your proxy added, counting from the right: [`ForwardedFor::trusting`] does exactly that,
//! and [`ForwardedFor::past_proxies`] where the number of your proxies varies.
//! Without such a proxy, key on the peer address ([`PeerIp`]).

use std::borrow::Cow;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use http::header::HeaderName;
use http::{Extensions, HeaderMap, Method, Request, Uri};
use tollgate_policy::{Network, forwarded_client};

use crate::error::Error;

/// The longest key kept, in bytes. A longer one is refused ([`Error::InvalidKey`]): every
/// distinct key is a bucket, and a client must not be able to park kilobytes per request in
/// the store.
pub const MAX_KEY_BYTES: usize = 256;

/// The head of a request: what extractors, cost functions and descriptor functions may read.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct RequestHead<'a> {
    /// The method.
    pub method: &'a Method,
    /// The target.
    pub uri: &'a Uri,
    /// The headers.
    pub headers: &'a HeaderMap,
    /// The extensions, where servers put connection details (the peer address).
    pub extensions: &'a Extensions,
}

impl<'a> RequestHead<'a> {
    /// The head of `request`.
    pub fn of<B>(request: &'a Request<B>) -> Self {
        Self {
            method: request.method(),
            uri: request.uri(),
            headers: request.headers(),
            extensions: request.extensions(),
        }
    }

    /// The value of header `name` as text, if present and visible ASCII.
    pub fn header(&self, name: &str) -> Option<&'a str> {
        self.headers.get(name)?.to_str().ok()
    }
}

/// Turns a request into the key of its bucket.
///
/// Implementations must not panic on any request: report what is missing or wrong as
/// [`Error::MissingKey`] or [`Error::InvalidKey`], and the layer answers it as configured
/// ([`MissingKey`]).
pub trait KeyExtractor: Send + Sync + 'static {
    /// The key of `head`'s bucket.
    ///
    /// # Errors
    ///
    /// [`Error::MissingKey`] or [`Error::InvalidKey`] when the request does not carry a usable
    /// key.
    fn extract<'a>(&self, head: &RequestHead<'a>) -> Result<Cow<'a, str>, Error>;
}

impl<K: KeyExtractor + ?Sized> KeyExtractor for Arc<K> {
    fn extract<'a>(&self, head: &RequestHead<'a>) -> Result<Cow<'a, str>, Error> {
        (**self).extract(head)
    }
}

/// What the layer does with a request whose key cannot be extracted.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum MissingKey {
    /// Answer 400 Bad Request, with the reason (the default: a request the service cannot
    /// attribute is refused rather than let through unlimited).
    Reject,
    /// Count the request against this one shared key instead: every unattributable request
    /// shares one bucket.
    Fallback(String),
}

/// The peer's IP address, from the connection details the server put in the request's
/// extensions.
///
/// By default it reads a [`SocketAddr`] or an [`IpAddr`] extension (what a hyper server loop
/// inserts with one line). Servers with their own connection-info types name them with
/// [`PeerIp::from_extension`]; for axum (served with `into_make_service_with_connect_info`):
///
/// ```
/// # #[derive(Clone)] struct ConnectInfo<T>(T); // stands in for axum::extract::ConnectInfo
/// use std::net::SocketAddr;
/// use tollgate_tower::PeerIp;
///
/// let key = PeerIp::from_extension(|info: &ConnectInfo<SocketAddr>| Some(info.0.ip()));
/// ```
///
/// and for tonic, `|info: &tonic::transport::server::TcpConnectInfo| info.remote_addr().map(|a|
/// a.ip())`. IPv6 peers are keyed by their /64 network (one host usually owns a whole /64, and
/// could otherwise rotate through it for fresh buckets); [`PeerIp::full_ipv6`] keys by the full
/// address instead.
#[derive(Clone)]
pub struct PeerIp {
    read: Arc<ReadIp>,
    ipv6_prefix: bool,
}

type ReadIp = dyn Fn(&Extensions) -> Option<IpAddr> + Send + Sync;

impl std::fmt::Debug for PeerIp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerIp")
            .field("ipv6_prefix", &self.ipv6_prefix)
            .finish_non_exhaustive()
    }
}

impl Default for PeerIp {
    fn default() -> Self {
        Self::new()
    }
}

impl PeerIp {
    /// Reads a [`SocketAddr`] or [`IpAddr`] extension.
    pub fn new() -> Self {
        Self {
            read: Arc::new(|ext: &Extensions| {
                ext.get::<SocketAddr>()
                    .map(SocketAddr::ip)
                    .or_else(|| ext.get::<IpAddr>().copied())
            }),
            ipv6_prefix: true,
        }
    }

    /// Reads the address from the extension of type `T` with `read`.
    pub fn from_extension<T, F>(read: F) -> Self
    where
        T: Send + Sync + 'static,
        F: Fn(&T) -> Option<IpAddr> + Send + Sync + 'static,
    {
        Self {
            read: Arc::new(move |ext: &Extensions| ext.get::<T>().and_then(&read)),
            ipv6_prefix: true,
        }
    }

    /// Keys IPv6 peers by their full address rather than their /64 network.
    pub fn full_ipv6(mut self) -> Self {
        self.ipv6_prefix = false;
        self
    }
}

impl KeyExtractor for PeerIp {
    fn extract<'a>(&self, head: &RequestHead<'a>) -> Result<Cow<'a, str>, Error> {
        let ip = (self.read)(head.extensions).ok_or_else(|| Error::MissingKey {
            what: "peer address (is the server inserting connection info?)".into(),
        })?;
        Ok(Cow::Owned(ip_key(ip, self.ipv6_prefix)))
    }
}

fn ip_key(ip: IpAddr, ipv6_prefix: bool) -> String {
    match ip.to_canonical() {
        IpAddr::V6(v6) if ipv6_prefix => {
            let s = v6.segments();
            format!("{:x}:{:x}:{:x}:{:x}::/64", s[0], s[1], s[2], s[3])
        }
        ip => ip.to_string(),
    }
}

/// The value of one request header, such as an API key or a user id set by an authenticating
/// proxy.
///
/// The value is the key as it is: only trust a header that your own infrastructure sets or
/// verifies (see the [module docs](self) on forwarded headers), or one that is itself the
/// credential (an API key checked downstream: a client inventing keys gets 401s, not quota).
#[derive(Debug, Clone)]
pub struct Header {
    name: HeaderName,
}

impl Header {
    /// The header `name`.
    pub fn new(name: HeaderName) -> Self {
        Self { name }
    }
}

impl KeyExtractor for Header {
    fn extract<'a>(&self, head: &RequestHead<'a>) -> Result<Cow<'a, str>, Error> {
        let value = head
            .headers
            .get(&self.name)
            .ok_or_else(|| Error::MissingKey {
                what: format!("header {}", self.name),
            })?;
        let text = value.to_str().map_err(|_| Error::InvalidKey {
            what: format!("header {}", self.name),
            reason: "not visible ASCII",
        })?;
        checked_key(text, || format!("header {}", self.name)).map(Cow::Borrowed)
    }
}

/// The client address as recorded by trusted proxies in `X-Forwarded-For`.
///
/// **Only behind proxies you run.** Each proxy appends the address it received the request
/// from, so the rightmost entries are written by your proxies and everything to their left by
/// the client, who can write anything. `ForwardedFor::trusting(n)` takes the `n`th entry from
/// the right: with one load balancer in front of the service, `trusting(1)` is the address
/// that connected to it. A request with fewer entries than that did not come through your
/// proxies and gets [`Error::MissingKey`]. Where the number of proxies varies (a CDN in front
/// of some requests), name their networks with [`ForwardedFor::past_proxies`] instead.
#[derive(Debug, Clone)]
pub struct ForwardedFor {
    hops: usize,
    proxies: Vec<Network>,
}

impl ForwardedFor {
    /// Takes the `hops`th address from the right (1 = the one your outermost proxy saw); a
    /// `hops` of 0 is taken as 1.
    pub fn trusting(hops: usize) -> Self {
        Self {
            hops: hops.max(1),
            proxies: Vec::new(),
        }
    }

    /// From the entry [`trusting`](Self::trusting) takes, goes further left past every entry
    /// inside one of `proxies`, your proxies' networks: the key is the first address from the
    /// right that none of them holds, however many of them a request crossed (nginx's
    /// `set_real_ip_from` with `real_ip_recursive`). A request only your proxies handled (a
    /// health check) is keyed by the first of them.
    ///
    /// ```
    /// use http::Request;
    /// use tollgate_tower::{ForwardedFor, KeyExtractor, RequestHead};
    ///
    /// let key = ForwardedFor::trusting(1).past_proxies(["10.0.0.0/8".parse()?]);
    /// let request = Request::builder()
    ///     .header("x-forwarded-for", "6.6.6.6, 198.51.100.7, 10.0.3.1, 10.0.0.9")
    ///     .body(())?;
    /// assert_eq!(key.extract(&RequestHead::of(&request))?, "198.51.100.7");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn past_proxies(mut self, proxies: impl IntoIterator<Item = Network>) -> Self {
        self.proxies.extend(proxies);
        self
    }
}

impl KeyExtractor for ForwardedFor {
    fn extract<'a>(&self, head: &RequestHead<'a>) -> Result<Cow<'a, str>, Error> {
        const WHAT: &str = "x-forwarded-for";
        // Several header lines form one list, in order. A line is read entry by entry whatever
        // bytes it holds: proxies append to the line the client sent, so refusing the line for
        // a byte of the client's would refuse the address they vouch for. An entry that is not
        // UTF-8 is no address, which matters only if the walk reaches it.
        let lines: Vec<Cow<'_, str>> = head
            .headers
            .get_all(WHAT)
            .iter()
            .map(|value| String::from_utf8_lossy(value.as_bytes()))
            .collect();
        let entries: Vec<&str> = lines
            .iter()
            .flat_map(|line| line.split(','))
            .map(str::trim)
            .collect();
        let missing = || Error::MissingKey {
            what: format!("{WHAT} entry {} from the right", self.hops),
        };
        let start = entries.len().checked_sub(self.hops).ok_or_else(missing)?;
        let chain = entries.get(..=start).ok_or_else(missing)?;
        let ip = forwarded_client(chain, &self.proxies)
            .ok_or_else(missing)?
            .map_err(|_| Error::InvalidKey {
                what: WHAT.into(),
                reason: "not an IP address",
            })?;
        Ok(Cow::Owned(ip_key(ip, true)))
    }
}

/// A key from a closure over the request head; `None` means the key is missing.
///
/// ```
/// use tollgate_tower::{KeyFn, RequestHead};
///
/// // The tenant from the first path segment: /t/{tenant}/...
/// let key = KeyFn::new(|head: &RequestHead<'_>| {
///     let mut segments = head.uri.path().split('/').skip(1);
///     (segments.next() == Some("t")).then(|| segments.next().map(str::to_owned)).flatten()
/// });
/// ```
#[derive(Clone)]
pub struct KeyFn<F> {
    f: F,
}

impl<F> std::fmt::Debug for KeyFn<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyFn").finish_non_exhaustive()
    }
}

impl<F> KeyFn<F>
where
    F: Fn(&RequestHead<'_>) -> Option<String> + Send + Sync + 'static,
{
    /// Keys requests with `f`.
    pub fn new(f: F) -> Self {
        Self { f }
    }
}

impl<F> KeyExtractor for KeyFn<F>
where
    F: Fn(&RequestHead<'_>) -> Option<String> + Send + Sync + 'static,
{
    fn extract<'a>(&self, head: &RequestHead<'a>) -> Result<Cow<'a, str>, Error> {
        let key = (self.f)(head).ok_or_else(|| Error::MissingKey {
            what: "key (the key function found none)".into(),
        })?;
        checked_key(&key, || "key".into())?;
        Ok(Cow::Owned(key))
    }
}

/// One key for every request: a global limit in front of the service.
#[derive(Debug, Clone, Default)]
pub struct Global;

impl KeyExtractor for Global {
    fn extract<'a>(&self, _: &RequestHead<'a>) -> Result<Cow<'a, str>, Error> {
        Ok(Cow::Borrowed("global"))
    }
}

fn checked_key(key: &str, what: impl FnOnce() -> String) -> Result<&str, Error> {
    if key.is_empty() {
        return Err(Error::MissingKey { what: what() });
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(Error::InvalidKey {
            what: what(),
            reason: "longer than 256 bytes",
        });
    }
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> http::request::Builder {
        Request::builder().uri("/t/acme/x")
    }

    fn extract(extractor: &dyn KeyExtractor, request: &Request<()>) -> Result<String, Error> {
        extractor
            .extract(&RequestHead::of(request))
            .map(Cow::into_owned)
    }

    #[test]
    fn peer_ip_reads_the_socket_address() {
        let mut req = request().body(()).unwrap();
        assert!(matches!(
            extract(&PeerIp::new(), &req),
            Err(Error::MissingKey { .. })
        ));
        req.extensions_mut()
            .insert("10.1.2.3:4567".parse::<SocketAddr>().unwrap());
        assert_eq!(extract(&PeerIp::new(), &req).unwrap(), "10.1.2.3");
    }

    #[test]
    fn ipv6_peers_share_their_64() {
        let mut req = request().body(()).unwrap();
        req.extensions_mut()
            .insert("2001:db8:1:2:aaaa::1".parse::<IpAddr>().unwrap());
        assert_eq!(extract(&PeerIp::new(), &req).unwrap(), "2001:db8:1:2::/64");
        assert_eq!(
            extract(&PeerIp::new().full_ipv6(), &req).unwrap(),
            "2001:db8:1:2:aaaa::1"
        );
        // An IPv4-mapped address is the IPv4 peer it stands for.
        req.extensions_mut()
            .insert("::ffff:10.0.0.1".parse::<IpAddr>().unwrap());
        assert_eq!(extract(&PeerIp::new(), &req).unwrap(), "10.0.0.1");
    }

    #[test]
    fn custom_connection_info() {
        #[derive(Clone)]
        struct Info(SocketAddr);
        let key = PeerIp::from_extension(|info: &Info| Some(info.0.ip()));
        let mut req = request().body(()).unwrap();
        req.extensions_mut()
            .insert(Info("127.0.0.1:1".parse().unwrap()));
        assert_eq!(extract(&key, &req).unwrap(), "127.0.0.1");
    }

    #[test]
    fn header_keys_and_their_failures() {
        let key = Header::new(HeaderName::from_static("x-api-key"));
        let req = request().header("x-api-key", "k1").body(()).unwrap();
        assert_eq!(extract(&key, &req).unwrap(), "k1");
        let req = request().body(()).unwrap();
        assert!(matches!(extract(&key, &req), Err(Error::MissingKey { .. })));
        let req = request()
            .header("x-api-key", http::HeaderValue::from_bytes(b"\xff").unwrap())
            .body(())
            .unwrap();
        assert!(matches!(extract(&key, &req), Err(Error::InvalidKey { .. })));
        let req = request()
            .header("x-api-key", "k".repeat(MAX_KEY_BYTES + 1))
            .body(())
            .unwrap();
        assert!(matches!(extract(&key, &req), Err(Error::InvalidKey { .. })));
        // The bound itself is a key.
        let longest = "k".repeat(MAX_KEY_BYTES);
        let req = request().header("x-api-key", &longest).body(()).unwrap();
        assert_eq!(extract(&key, &req).unwrap(), longest);
        let req = request().header("x-api-key", "").body(()).unwrap();
        assert!(matches!(extract(&key, &req), Err(Error::MissingKey { .. })));
    }

    #[test]
    fn forwarded_for_counts_trusted_hops_from_the_right() {
        let req = request()
            .header("x-forwarded-for", "6.6.6.6, 1.1.1.1")
            .header("x-forwarded-for", "2.2.2.2")
            .body(())
            .unwrap();
        assert_eq!(
            extract(&ForwardedFor::trusting(1), &req).unwrap(),
            "2.2.2.2"
        );
        assert_eq!(
            extract(&ForwardedFor::trusting(2), &req).unwrap(),
            "1.1.1.1"
        );
        assert!(matches!(
            extract(&ForwardedFor::trusting(4), &req),
            Err(Error::MissingKey { .. })
        ));
        let req = request()
            .header("x-forwarded-for", "not-an-ip")
            .body(())
            .unwrap();
        assert!(matches!(
            extract(&ForwardedFor::trusting(1), &req),
            Err(Error::InvalidKey { .. })
        ));
        // A client's entry that is not UTF-8 hides nothing its proxy appended to the line.
        let req = request()
            .header(
                "x-forwarded-for",
                http::HeaderValue::from_bytes(b"6.6.\xff.6, 2.2.2.2").unwrap(),
            )
            .body(())
            .unwrap();
        assert_eq!(
            extract(&ForwardedFor::trusting(1), &req).unwrap(),
            "2.2.2.2"
        );
        assert!(matches!(
            extract(&ForwardedFor::trusting(2), &req),
            Err(Error::InvalidKey { .. })
        ));
    }

    #[test]
    fn forwarded_for_walks_past_trusted_proxy_networks() {
        let key = ForwardedFor::trusting(1)
            .past_proxies(["10.0.0.0/8", "192.0.2.0/24"].map(|net| net.parse().unwrap()));
        let with = |chain: &str| request().header("x-forwarded-for", chain).body(()).unwrap();
        // However many of them a request crossed.
        for chain in [
            "6.6.6.6, 198.51.100.7",
            "6.6.6.6, 198.51.100.7, 10.0.0.9",
            "6.6.6.6, 198.51.100.7, 192.0.2.1, 10.0.0.9",
        ] {
            assert_eq!(
                extract(&key, &with(chain)).unwrap(),
                "198.51.100.7",
                "{chain}"
            );
        }
        // IPv6 clients keyed by their /64 as ever; a proxy written as mapped IPv6 is trusted.
        assert_eq!(
            extract(&key, &with("2001:db8:1:2::9, ::ffff:10.0.0.9")).unwrap(),
            "2001:db8:1:2::/64"
        );
        // Only proxies: the first of them.
        assert_eq!(
            extract(&key, &with("10.1.1.1, 10.0.0.9")).unwrap(),
            "10.1.1.1"
        );
        // Something unreadable before a client is found: refused, not skipped.
        assert!(matches!(
            extract(&key, &with("198.51.100.7, unknown, 10.0.0.9")),
            Err(Error::InvalidKey { .. })
        ));
        // The counted hops come first, whatever their address.
        let key = ForwardedFor::trusting(2).past_proxies(["10.0.0.0/8".parse().unwrap()]);
        assert_eq!(
            extract(&key, &with("198.51.100.7, 10.0.0.8, 203.0.113.1")).unwrap(),
            "198.51.100.7"
        );
    }

    #[test]
    fn closures_and_the_global_key() {
        let key = KeyFn::new(|head: &RequestHead<'_>| {
            let mut segments = head.uri.path().split('/').skip(1);
            (segments.next() == Some("t"))
                .then(|| segments.next().map(str::to_owned))
                .flatten()
        });
        assert_eq!(extract(&key, &request().body(()).unwrap()).unwrap(), "acme");
        let other = Request::builder().uri("/x").body(()).unwrap();
        assert!(matches!(
            extract(&key, &other),
            Err(Error::MissingKey { .. })
        ));
        assert_eq!(extract(&Global, &other).unwrap(), "global");
    }

    /// An extractor shared behind an `Arc` keys as the extractor itself, failures included.
    #[test]
    fn a_shared_extractor_keys_as_itself() {
        let key = Arc::new(Header::new(HeaderName::from_static("x-api-key")));
        let req = request().header("x-api-key", "k1").body(()).unwrap();
        assert_eq!(extract(&key, &req).unwrap(), "k1");
        let req = request().body(()).unwrap();
        assert!(matches!(extract(&key, &req), Err(Error::MissingKey { .. })));
        let dynamic: Arc<dyn KeyExtractor> = Arc::new(PeerIp::new());
        let mut req = request().body(()).unwrap();
        req.extensions_mut()
            .insert("10.1.2.3:4567".parse::<SocketAddr>().unwrap());
        assert_eq!(extract(&dynamic, &req).unwrap(), "10.1.2.3");
    }

    #[test]
    fn debug_output_shows_the_settings_not_the_closures() {
        assert_eq!(
            format!("{:?}", PeerIp::new()),
            "PeerIp { ipv6_prefix: true, .. }"
        );
        assert_eq!(
            format!("{:?}", PeerIp::new().full_ipv6()),
            "PeerIp { ipv6_prefix: false, .. }"
        );
        let key = KeyFn::new(|_: &RequestHead<'_>| None);
        assert_eq!(format!("{key:?}"), "KeyFn { .. }");
    }
}
