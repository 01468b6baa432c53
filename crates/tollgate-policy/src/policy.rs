//! A compiled policy and request matching.
//!
//! A [`Policy`] is built only by [`crate::compile`], so everything in it has been validated:
//! limits hold a [`tollgate::Limit`] (never a zero rate) or a [`tollgate::LeaseLimit`], names
//! are unique and safe to put in a bucket key, and every exemption names an existing limit.
//! Matching then needs no checks and no fallible step.
//!
//! # Two kinds of limits
//!
//! A rate limit (token bucket, window) is checked: a request takes tokens and is done. A
//! concurrency limit is acquired: a request holds a lease until it ends. The two are asked
//! through different calls (a check, a lease), so they are matched apart too, by the same
//! rules: [`Policy::matches`] finds the rate limits only, which is all that checks, Envoy's
//! RLS and forward-auth deal in, and [`Policy::lease_matches`] the concurrency limits. A
//! deny limit ([`LimitDef::deny`]) is of neither kind, and both find it: a client on a block
//! list takes no lease either.
//!
//! # Indexes
//!
//! Matching runs on every request, so it must not scan the limits. Per domain, each limit is
//! filed once, under the most specific thing it requires:
//!
//! * the exact `when` entry and value (a hash of the pair) that the fewest limits of its domain
//!   share (a list of values: under each of its values), or else
//! * the `!prefix` condition (a hash of the entry and the prefix) that the fewest share (a list
//!   holding prefixes: under each of its prefixes, and its values as pairs), or else
//! * the `key` entry name that the fewest share, or else
//! * nothing: it applies to every descriptor of the domain.
//!
//! A descriptor of `n` entries then costs `2n` hash lookups plus a verification of each
//! candidate's remaining conditions, whatever the number of limits. An entry that prefixes are
//! filed under costs one more lookup per distinct prefix length filed for it (the value cut to
//! each length), not one test per prefix: a thousand routes by prefix cost a handful of
//! lookups. Results are returned in declaration order, so decisions do not depend on hash order.
//! Last, the limits named in the `replaces` of a limit found for the request are left out.

use std::hash::BuildHasher;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use hashbrown::{HashMap, HashTable};
use ipnet::{IpNet, Ipv4Net};
use tollgate::{LeaseLimit, Limit};

use crate::key;
use crate::wall::UnixTime;

/// Descriptor entries and what their values must be.
pub(crate) type Conditions = Box<[(Box<str>, ValueMatch)]>;

/// What a `when` condition asks of a descriptor entry's value.
///
/// A plain value in the file must be equal; `!prefix VALUE` asks for a value that starts with
/// it (Envoy's `value: "foo*"`), so that one condition covers a family of values (`/api/v1/…`,
/// tenants named `eu-…`); `!cidr NETWORK` asks for an IP address inside the network. With the
/// entry also in `key`, each full value still gets a bucket of its own. A list asks for any of
/// its values, prefixes and networks.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ValueMatch {
    /// The value equals this text.
    Exact(Box<str>),
    /// The value starts with this text (the empty text: any value, the entry being present).
    Prefix(Box<str>),
    /// The value is an IP address inside this network (`!cidr 203.0.113.0/24`; see
    /// [`Network`]).
    Network(Box<Network>),
    /// The value is one of a list's values, starts with one of its prefixes, or is an address
    /// in one of its networks (a list in the file: `method: [GET, HEAD]`, `path: [/health,
    /// !prefix /internal/]`). A list that comes down to one item is that item.
    AnyOf(Box<ValueList>),
}

/// The network of a `!cidr` condition.
///
/// A value matches when it is an IP address alone (`203.0.113.7`, `2001:db8::1`; no port, no
/// zone) inside the network. An IPv4 address written as IPv6 (`::ffff:203.0.113.7`) is the
/// IPv4 address, in a value and in a network, so either spelling of a client matches.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Network {
    net: IpNet,
    /// The network's first address as text: a value it matches.
    address: Box<str>,
}

impl Network {
    /// `net`, whose address must have no bits past its prefix length (a network as written
    /// in a policy: `10.0.0.0/8`, not `10.1.2.3/8`); `None` otherwise. An IPv4-mapped IPv6
    /// network (`::ffff:10.0.0.0/104`) is made the IPv4 one (`10.0.0.0/8`).
    pub fn new(net: IpNet) -> Option<Self> {
        if net.trunc() != net {
            return None;
        }
        let net = match net {
            IpNet::V6(v6) if v6.prefix_len() >= 96 => match v6.addr().to_ipv4_mapped() {
                Some(v4) => IpNet::V4(Ipv4Net::new(v4, v6.prefix_len() - 96).ok()?),
                None => net,
            },
            _ => net,
        };
        Some(Self {
            net,
            address: net.network().to_string().into(),
        })
    }

    /// The network.
    pub fn net(&self) -> IpNet {
        self.net
    }

    /// Whether `address` is inside it (an IPv4-mapped IPv6 address as the IPv4 one).
    ///
    /// ```
    /// use tollgate_policy::Network;
    ///
    /// let proxies: Network = "10.0.0.0/8".parse()?;
    /// assert!(proxies.contains("10.1.2.3".parse()?));
    /// assert!(proxies.contains("::ffff:10.1.2.3".parse()?));
    /// assert!(!proxies.contains("192.0.2.1".parse()?));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn contains(&self, address: IpAddr) -> bool {
        self.holds(address.to_canonical())
    }

    /// Whether `address` is inside it.
    fn holds(&self, address: IpAddr) -> bool {
        self.net.contains(&address)
    }

    /// Whether `value` is an address inside it. Out of line, as a list's test is: the exact
    /// and prefix tests that most conditions are stay small enough to inline.
    #[inline(never)]
    fn matches(&self, value: &str) -> bool {
        address(value).is_some_and(|a| self.holds(a))
    }
}

/// Why a text is not a network, as `!cidr` (or a flag taking networks) reads it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NetworkError {
    /// Neither `ADDRESS/LENGTH` nor an address alone.
    #[error("{0:?} is not a network: write ADDRESS/LENGTH, as 203.0.113.0/24 or 2001:db8::/32")]
    Malformed(String),
    /// An address with bits past the length, which is a typo more often than not: the
    /// network meant is said.
    #[error("{written} has bits set past its length: the network is {network}")]
    HostBits {
        /// The text as written.
        written: String,
        /// The network its length makes.
        network: IpNet,
    },
}

impl std::str::FromStr for Network {
    type Err = NetworkError;

    /// `ADDRESS/LENGTH`, or an address alone (a network of one), with no bits past the length.
    ///
    /// ```
    /// use tollgate_policy::{Network, NetworkError};
    ///
    /// assert_eq!("203.0.113.9".parse::<Network>()?.net().to_string(), "203.0.113.9/32");
    /// let typo = "10.1.2.3/8".parse::<Network>().unwrap_err();
    /// assert_eq!(typo.to_string(), "10.1.2.3/8 has bits set past its length: the network is 10.0.0.0/8");
    /// assert!(matches!("eu-west".parse::<Network>(), Err(NetworkError::Malformed(_))));
    /// # Ok::<(), NetworkError>(())
    /// ```
    fn from_str(text: &str) -> Result<Self, NetworkError> {
        let net = match text.parse::<IpNet>() {
            Ok(net) => net,
            Err(_) => match text.parse::<IpAddr>() {
                Ok(address) => IpNet::from(address),
                Err(_) => return Err(NetworkError::Malformed(text.to_owned())),
            },
        };
        Self::new(net).ok_or_else(|| NetworkError::HostBits {
            written: text.to_owned(),
            network: net.trunc(),
        })
    }
}

/// The client's address in a forwarded chain (an `X-Forwarded-For` list, each proxy's entry
/// appended on the right), `chain` ending at the entry the caller's count of trusted hops
/// reached: from there leftwards past every address inside one of `proxies`, the first address
/// none of them holds, or the first entry when all are proxies' (a request only they handled).
/// In canonical form (an IPv4-mapped IPv6 address as IPv4). `None` for an empty chain;
/// `Some(Err(entry))` when the walk meets an entry that is no address alone, as nothing left of
/// it can be vouched for.
///
/// ```
/// use tollgate_policy::{Network, forwarded_client};
///
/// let proxies: Vec<Network> = vec!["10.0.0.0/8".parse()?];
/// let chain = ["6.6.6.6", "198.51.100.7", "10.0.3.1", "10.0.0.9"];
/// assert_eq!(forwarded_client(&chain, &proxies), Some(Ok("198.51.100.7".parse()?)));
/// assert_eq!(forwarded_client(&["unknown", "10.0.0.9"], &proxies), Some(Err("unknown")));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn forwarded_client<'a>(
    chain: &[&'a str],
    proxies: &[Network],
) -> Option<Result<IpAddr, &'a str>> {
    let mut client = None;
    for &entry in chain.iter().rev() {
        let Ok(found) = entry.parse::<IpAddr>() else {
            return Some(Err(entry));
        };
        let found = found.to_canonical();
        client = Some(Ok(found));
        if !proxies.iter().any(|proxy| proxy.holds(found)) {
            break;
        }
    }
    client
}

/// `value` read as an IP address alone, an IPv4-mapped IPv6 address as IPv4; `None` for
/// anything else (a name, an address with a port or a zone).
fn address(value: &str) -> Option<IpAddr> {
    value.parse::<IpAddr>().ok().map(|a| a.to_canonical())
}

/// The prefix lengths networks are filed under, by address family, each shortest first.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub(crate) struct NetLengths {
    pub(crate) v4: Box<[u8]>,
    pub(crate) v6: Box<[u8]>,
}

impl NetLengths {
    /// The distinct prefix lengths of `nets`.
    pub(crate) fn of<'a>(nets: impl Iterator<Item = &'a IpNet>) -> Self {
        let (mut v4, mut v6) = (Vec::new(), Vec::new());
        for net in nets {
            match net {
                IpNet::V4(_) => v4.push(net.prefix_len()),
                IpNet::V6(_) => v6.push(net.prefix_len()),
            }
        }
        for lengths in [&mut v4, &mut v6] {
            lengths.sort_unstable();
            lengths.dedup();
        }
        Self {
            v4: v4.into_boxed_slice(),
            v6: v6.into_boxed_slice(),
        }
    }

    /// The networks of `address` at each of its family's lengths, shortest first.
    pub(crate) fn networks_of(&self, address: IpAddr) -> impl Iterator<Item = IpNet> + '_ {
        let lengths = match address {
            IpAddr::V4(_) => &self.v4,
            IpAddr::V6(_) => &self.v6,
        };
        lengths
            .iter()
            .filter_map(move |&length| IpNet::new(address, length).ok().map(|n| n.trunc()))
    }
}

/// The values, prefixes and networks of a list condition ([`ValueMatch::AnyOf`]).
///
/// Invariant: each kind sorted and without repeats; what another item of the list covers is
/// left out (a prefix that starts with a shorter one, a value that starts with a prefix or is
/// an address in a network, a network inside a wider one). So a value matches at most one
/// value, one prefix and one network of the list, which lets an index file the list under
/// each item; matching drops the repeat where a prefix and a network both hold a value.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct ValueList {
    values: Box<[Box<str>]>,
    prefixes: Box<[Box<str>]>,
    /// The distinct byte lengths of `prefixes`, shortest first.
    lengths: Box<[usize]>,
    networks: Box<[Network]>,
    net_lengths: NetLengths,
}

impl ValueList {
    /// The exact values, sorted.
    pub fn values(&self) -> &[Box<str>] {
        &self.values
    }

    /// The prefixes, sorted; none starts with another, nor is a value covered by one.
    pub fn prefixes(&self) -> &[Box<str>] {
        &self.prefixes
    }

    /// The networks, sorted; none inside another.
    pub fn networks(&self) -> &[Network] {
        &self.networks
    }

    /// Whether `value` is one of the values, starts with one of the prefixes or is an address
    /// in one of the networks (out of line: see [`Network::matches`]).
    #[inline(never)]
    fn matches(&self, value: &str) -> bool {
        self.has_value(value) || self.prefix_of(value).is_some() || self.in_network(value)
    }

    /// Whether `value` is one of the exact values.
    fn has_value(&self, value: &str) -> bool {
        self.values.binary_search_by(|v| (**v).cmp(value)).is_ok()
    }

    /// The prefix of the list that `value` starts with, if any (at most one: see the type's
    /// invariant). One binary search per distinct prefix length, not one test per prefix.
    fn prefix_of(&self, value: &str) -> Option<&str> {
        self.lengths.iter().find_map(|&length| {
            let head = value.get(..length)?;
            let at = self.prefixes.binary_search_by(|p| (**p).cmp(head)).ok()?;
            Some(&*self.prefixes[at])
        })
    }

    /// Whether `value` is an address in one of the networks: one binary search per distinct
    /// prefix length of its family.
    fn in_network(&self, value: &str) -> bool {
        if self.networks.is_empty() {
            return false;
        }
        address(value).is_some_and(|address| {
            self.net_lengths
                .networks_of(address)
                .any(|net| has_network(&self.networks, &net))
        })
    }
}

/// Whether the sorted `networks` hold `net` itself.
fn has_network(networks: &[Network], net: &IpNet) -> bool {
    networks.binary_search_by(|n| n.net.cmp(net)).is_ok()
}

impl ValueMatch {
    /// The condition a list of `values`, `prefixes` and `networks` (any order, repeats
    /// allowed) asks for: what another item covers is left out, and a list that comes down to
    /// one item is that item (`None` for an empty list, which matches nothing).
    pub fn any_of(
        values: Vec<Box<str>>,
        prefixes: Vec<Box<str>>,
        networks: Vec<Network>,
    ) -> Option<Self> {
        let mut prefixes = prefixes;
        // Shortest first, so that a prefix is kept only when none kept before covers it.
        prefixes.sort_unstable_by(|a, b| a.len().cmp(&b.len()).then_with(|| a.cmp(b)));
        prefixes.dedup();
        let mut kept: Vec<Box<str>> = Vec::with_capacity(prefixes.len());
        for prefix in prefixes {
            if !kept.iter().any(|k| prefix.starts_with(&**k)) {
                kept.push(prefix);
            }
        }
        // The same for networks: the widest first.
        let mut networks = networks;
        networks.sort_unstable_by_key(|n| (n.net.prefix_len(), n.net));
        networks.dedup();
        let mut nets: Vec<Network> = Vec::with_capacity(networks.len());
        for network in networks {
            if !nets.iter().any(|n| n.net.contains(&network.net)) {
                nets.push(network);
            }
        }
        let mut values: Vec<Box<str>> = values
            .into_iter()
            .filter(|v| !kept.iter().any(|k| v.starts_with(&**k)))
            .filter(|v| address(v).is_none_or(|a| !nets.iter().any(|n| n.holds(a))))
            .collect();
        values.sort_unstable();
        values.dedup();
        let mut lengths: Vec<usize> = kept.iter().map(|p| p.len()).collect();
        lengths.dedup();
        kept.sort_unstable();
        let net_lengths = NetLengths::of(nets.iter().map(|n| &n.net));
        nets.sort_unstable_by_key(|n| n.net);
        Some(match (values.len(), kept.len(), nets.len()) {
            (0, 0, 0) => return None,
            (1, 0, 0) => Self::Exact(values.pop()?),
            (0, 1, 0) => Self::Prefix(kept.pop()?),
            (0, 0, 1) => Self::Network(Box::new(nets.pop()?)),
            _ => Self::AnyOf(Box::new(ValueList {
                values: values.into_boxed_slice(),
                prefixes: kept.into_boxed_slice(),
                lengths: lengths.into_boxed_slice(),
                networks: nets.into_boxed_slice(),
                net_lengths,
            })),
        })
    }

    /// Whether `value` satisfies the condition.
    #[inline]
    pub fn matches(&self, value: &str) -> bool {
        match self {
            Self::Exact(text) => value == &**text,
            Self::Prefix(text) => value.starts_with(&**text),
            Self::Network(network) => network.matches(value),
            Self::AnyOf(list) => list.matches(value),
        }
    }

    /// The text the file gave: the value, or the prefix; of a network, its first address; of
    /// a list, its first value in sorted order, or its first prefix or network's (a value it
    /// matches, whichever).
    pub fn text(&self) -> &str {
        match self {
            Self::Exact(text) | Self::Prefix(text) => text,
            Self::Network(network) => &network.address,
            Self::AnyOf(list) => list
                .values
                .first()
                .or(list.prefixes.first())
                .map(|v| &**v)
                .or(list.networks.first().map(|n| &*n.address))
                .unwrap_or(""),
        }
    }

    /// Whether every value this condition matches also matches `wider`.
    pub fn within(&self, wider: &Self) -> bool {
        // Infinitely many values: only a prefix of the prefix holds them all.
        let prefix_within = |a: &str| match wider {
            Self::Prefix(b) => a.starts_with(&**b),
            Self::AnyOf(list) => list.prefixes.iter().any(|b| a.starts_with(&**b)),
            Self::Exact(_) | Self::Network(_) => false,
        };
        // Many addresses: a network that holds the whole network.
        let network_within = |a: &Network| match wider {
            Self::Network(b) => b.net.contains(&a.net),
            Self::AnyOf(list) => list.networks.iter().any(|b| b.net.contains(&a.net)),
            Self::Exact(_) | Self::Prefix(_) => false,
        };
        match self {
            Self::Exact(value) => wider.matches(value),
            Self::Prefix(a) => prefix_within(a),
            Self::Network(a) => network_within(a),
            Self::AnyOf(list) => {
                list.values.iter().all(|v| wider.matches(v))
                    && list.prefixes.iter().all(|p| prefix_within(p))
                    && list.networks.iter().all(network_within)
            }
        }
    }

    /// The exact values it is filed under in an index: its value, or each of its list's.
    pub(crate) fn exact_values(&self) -> &[Box<str>] {
        match self {
            Self::Exact(value) => std::slice::from_ref(value),
            Self::AnyOf(list) => &list.values,
            Self::Prefix(_) | Self::Network(_) => &[],
        }
    }

    /// The prefixes it is filed under in an index: its prefix, or each of its list's.
    pub(crate) fn prefixes(&self) -> &[Box<str>] {
        match self {
            Self::Prefix(prefix) => std::slice::from_ref(prefix),
            Self::AnyOf(list) => &list.prefixes,
            Self::Exact(_) | Self::Network(_) => &[],
        }
    }

    /// The networks it is filed under in an index: its network, or each of its list's.
    pub(crate) fn networks(&self) -> &[Network] {
        match self {
            Self::Network(network) => std::slice::from_ref(&**network),
            Self::AnyOf(list) => &list.networks,
            Self::Exact(_) | Self::Prefix(_) => &[],
        }
    }

    /// Whether it is filed under more than its exact values (prefixes or networks).
    pub(crate) fn is_wide(&self) -> bool {
        !self.prefixes().is_empty() || !self.networks().is_empty()
    }

    /// Whether `value` is one of its exact values (not one a prefix or network covers).
    fn has_value(&self, value: &str) -> bool {
        match self {
            Self::Exact(text) => value == &**text,
            Self::AnyOf(list) => list.has_value(value),
            Self::Prefix(_) | Self::Network(_) => false,
        }
    }

    /// Whether `prefix` is one of its prefixes (they are sorted).
    fn has_prefix(&self, prefix: &str) -> bool {
        self.prefixes()
            .binary_search_by(|p| (**p).cmp(prefix))
            .is_ok()
    }

    /// Whether `net` is one of its networks (they are sorted).
    fn has_network(&self, net: &IpNet) -> bool {
        has_network(self.networks(), net)
    }
}

/// Whether a limit can reject requests or only reports what it would have done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Mode {
    /// Decide, and reject when the bucket is empty.
    Enforce,
    /// Decide and count, but always allow: for trying a limit on live traffic.
    Shadow,
}

impl Mode {
    /// The name used in the policy file, metrics and the audit log.
    pub fn as_str(&self) -> &'static str {
        match self {
            Mode::Enforce => "enforce",
            Mode::Shadow => "shadow",
        }
    }
}

/// What a limit does when its shared store cannot answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FailureMode {
    /// Deny, distinguishably from an ordinary rejection.
    Closed,
    /// Allow within an emergency budget: a local bucket per key with these parameters (its
    /// capacity is one period's worth of the configured rate), never unlimited. The failure
    /// mode of a rate limit.
    Open {
        /// The local budget per key.
        emergency: Limit,
    },
    /// Allow within a bound of leases in flight per key, held in this process, never
    /// unlimited: the failure mode of a concurrency limit that fails open. Leases keep the
    /// key's own lease timeout.
    OpenInFlight {
        /// The leases a key may hold at once in this process; `None`: the key's own
        /// `max_in_flight` (its override's, when one applies).
        emergency: Option<u64>,
    },
}

/// Where a limit's buckets are decided when a server also has a global store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Scope {
    /// On the store of this region (`--store`), every request a call to it: the default.
    #[default]
    Regional,
    /// One quota for every region, kept on the global store: each process spends a share it
    /// has paid for there in advance, and rebalances the shares in the background, so no
    /// request waits on another region (see the `tollgate-regional` crate). Without a global
    /// store, decided like a regional limit.
    Global,
}

impl Scope {
    /// The name used in the policy file and on `/v1/policy`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Scope::Regional => "regional",
            Scope::Global => "global",
        }
    }
}

/// The parameters of a limit or an override: a rate, or a bound on leases in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Params {
    /// A rate limit (`token_bucket`, `gcra`, `fixed_window`, `sliding_window`).
    Rate(Limit),
    /// A concurrency limit (`concurrency`).
    Concurrency(LeaseLimit),
}

impl Params {
    /// The rate, for a rate limit.
    pub fn rate(&self) -> Option<&Limit> {
        match self {
            Params::Rate(limit) => Some(limit),
            Params::Concurrency(_) => None,
        }
    }

    /// The bound on leases, for a concurrency limit.
    pub fn concurrency(&self) -> Option<&LeaseLimit> {
        match self {
            Params::Concurrency(limit) => Some(limit),
            Params::Rate(_) => None,
        }
    }
}

impl std::fmt::Display for Params {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Params::Rate(limit) => limit.fmt(f),
            Params::Concurrency(limit) => limit.fmt(f),
        }
    }
}

/// One kind of parameters that matching can look for: [`Limit`] (rate limits) or
/// [`LeaseLimit`] (concurrency limits).
pub(crate) trait Kind: Copy {
    /// `params` if they are of this kind.
    fn pick(params: &Params) -> Option<&Self>;

    /// The limit a descriptor asks for, if limits of this kind can take it: rate limits can,
    /// a number of leases cannot be said in Envoy's terms.
    fn requested(limit: &Limit) -> Option<Self>;

    /// Whether a deny limit, whose parameters are a nominal rate, is matched for this kind
    /// with [`for_deny`](Self::for_deny) standing in: a constant, so that matching rate
    /// limits, where the nominal rate serves, compiles to no test at all.
    const DENY_STANDS_IN: bool;

    /// What stands in for the parameters of a deny limit when it is matched for this kind:
    /// nothing decides by them.
    fn for_deny() -> Option<Self>;
}

impl Kind for Limit {
    fn pick(params: &Params) -> Option<&Self> {
        params.rate()
    }

    const DENY_STANDS_IN: bool = false;

    fn for_deny() -> Option<Self> {
        None
    }

    fn requested(limit: &Limit) -> Option<Self> {
        Some(*limit)
    }
}

impl Kind for LeaseLimit {
    fn pick(params: &Params) -> Option<&Self> {
        params.concurrency()
    }

    fn requested(_: &Limit) -> Option<Self> {
        None
    }

    const DENY_STANDS_IN: bool = true;

    fn for_deny() -> Option<Self> {
        // One lease for a second: valid, and never taken (a denial holds nothing).
        LeaseLimit::new(1, std::time::Duration::from_secs(1)).ok()
    }
}

/// A request descriptor as matching reads it: its `(entry, value)` pairs and, when its sender
/// asks for one, a limit of its own.
///
/// Any list of pairs is a descriptor that asks for nothing (`Vec<(String, String)>`,
/// `[(&str, &str); N]`, …); [`RequestDescriptor`] also carries a limit, as Envoy's `limit`
/// rate-limit action sends one. Only limits written with `request_limit: apply` take it (see
/// [`LimitDef::applies_request_limit`]); every other limit decides by its own parameters.
pub trait Descriptor<S> {
    /// The entries, in the order sent. Within a descriptor the first occurrence of an entry
    /// counts.
    fn entries(&self) -> &[(S, S)];

    /// The limit the sender asks for, if any.
    fn requested_limit(&self) -> Option<&RequestedLimit> {
        None
    }
}

/// A limit a descriptor asks for (Envoy's `limit` action): a rate, or none at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RequestedLimit {
    /// This rate, in a bucket of its own.
    Rate(Limit),
    /// Nothing admitted (Envoy's `requests_per_unit: 0`): the request is denied, as by a
    /// [`LimitDef::deny`] limit.
    Deny,
}

impl<S, T: AsRef<[(S, S)]> + ?Sized> Descriptor<S> for T {
    fn entries(&self) -> &[(S, S)] {
        self.as_ref()
    }
}

/// A descriptor that may carry the limit its sender asks for.
///
/// ```
/// use tollgate::Limit;
/// use tollgate_policy::{Descriptor, RequestDescriptor, RequestedLimit};
///
/// let fifty = Limit::per(50, std::time::Duration::from_secs(60))?;
/// let sent = RequestDescriptor {
///     entries: vec![("route", "checkout")],
///     limit: Some(RequestedLimit::Rate(fifty)),
/// };
/// assert_eq!(sent.entries(), &[("route", "checkout")]);
/// assert_eq!(sent.requested_limit(), Some(&RequestedLimit::Rate(fifty)));
/// # Ok::<(), tollgate::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestDescriptor<S> {
    /// The `(entry, value)` pairs.
    pub entries: Vec<(S, S)>,
    /// The limit asked for: taken by the limits that apply it in place of their own
    /// parameters, ignored by the others.
    pub limit: Option<RequestedLimit>,
}

impl<S> Descriptor<S> for RequestDescriptor<S> {
    fn entries(&self) -> &[(S, S)] {
        &self.entries
    }

    fn requested_limit(&self) -> Option<&RequestedLimit> {
        self.limit.as_ref()
    }
}

/// One limit of a compiled policy.
#[derive(Debug)]
pub struct LimitDef {
    /// Position in declaration order.
    pub(crate) index: u32,
    /// Shared with every outcome that names the limit: a reference count, not a copy, per
    /// decision.
    pub(crate) name: Arc<str>,
    pub(crate) domain: Box<str>,
    pub(crate) when: Conditions,
    pub(crate) key: Box<[Box<str>]>,
    /// With `exact: true`, the number of distinct entries a descriptor must have (those of
    /// `when` and `key`, no others).
    pub(crate) exact: Option<usize>,
    /// What the limit is filed under in its domain's index.
    pub(crate) filed: Filed,
    pub(crate) params: Params,
    /// [`key::params_tag`] of `params`, made once.
    pub(crate) tag: u32,
    /// The `algorithm` as the file names it (`gcra` is a token bucket by another name).
    pub(crate) algorithm: &'static str,
    pub(crate) mode: Mode,
    /// Hundredths of a percent of subjects that are enforced (10,000 = all).
    pub(crate) rollout: u16,
    pub(crate) failure_mode: FailureMode,
    pub(crate) scope: Scope,
    pub(crate) overrides: Box<[Override]>,
    /// Indexes into the policy's exemptions that name this limit.
    pub(crate) exemptions: Box<[u32]>,
    /// Indexes of the limits this one replaces: left out of a request this one applies to.
    pub(crate) replaces: Box<[u32]>,
    /// Whether a limit a descriptor carries takes the place of `params` and the overrides'
    /// (`request_limit: apply`).
    pub(crate) request_limit: bool,
    /// `deny: true`: every request it applies to is rejected; `params` is then a nominal rate
    /// that nothing decides by.
    pub(crate) deny: bool,
    /// The file of a policy directory it is written in.
    pub(crate) file: Option<Arc<str>>,
}

impl LimitDef {
    /// The limit's name: its identity, in bucket keys, metrics and the audit log.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The file of a policy directory it is written in (its name in the directory), so that a
    /// reader knows whose limit it is; `None` in a policy of one file.
    pub fn file(&self) -> Option<&str> {
        self.file.as_deref()
    }

    /// The domain it applies to.
    pub fn domain(&self) -> &str {
        &self.domain
    }

    /// Descriptor entries and what their values must be.
    pub fn when(&self) -> impl Iterator<Item = (&str, &ValueMatch)> {
        self.when.iter().map(|(k, v)| (&**k, v))
    }

    /// Descriptor entries whose values identify the bucket.
    pub fn key(&self) -> impl Iterator<Item = &str> {
        self.key.iter().map(|k| &**k)
    }

    /// Whether a descriptor must hold exactly the `when` and `key` entries, no others.
    pub fn exact(&self) -> bool {
        self.exact.is_some()
    }

    /// The limits this one replaces (`replaces`, by position in the policy): a request this one
    /// applies to is not decided by them.
    pub fn replaces(&self) -> &[u32] {
        &self.replaces
    }

    /// The parameters when no override applies. A [`deny`](Self::deny) limit has none to
    /// decide by: its parameters are a nominal rate of `1/s`.
    pub fn params(&self) -> &Params {
        &self.params
    }

    /// The rate when no override applies, for a rate limit; `None` for a concurrency limit
    /// and for a [`deny`](Self::deny) limit.
    pub fn rate(&self) -> Option<&Limit> {
        self.params.rate().filter(|_| !self.deny)
    }

    /// The tag that ends the store keys of the limit's own buckets: a hash of the parameters
    /// a bucket's state only means something under (a token bucket's capacity and refill, a
    /// window's algorithm and length; not a window's limit per window, whose counts mean the
    /// same under any). Two versions of a limit with the same name, key entries and tag share
    /// their buckets; with another tag, the new version's buckets are others (a reload
    /// converts token buckets' balances across, see [`crate::PolicyEngine`]).
    pub fn bucket_tag(&self) -> u32 {
        self.tag
    }

    /// Whether every request the limit applies to is rejected (`deny: true`, a block list;
    /// Envoy's `requests_per_unit: 0`), whatever was spent before: no bucket, nothing charged
    /// anywhere, decided without the store. Its overrides can only take requests out of it
    /// ([`Override::unlimited`]). Its `algorithm` reads `deny`.
    pub fn deny(&self) -> bool {
        self.deny
    }

    /// The bound on leases when no override applies, for a concurrency limit; `None` for a
    /// rate limit.
    pub fn concurrency(&self) -> Option<&LeaseLimit> {
        self.params.concurrency()
    }

    /// The algorithm as the policy file names it: `token_bucket`, `gcra` (the same
    /// decisions), `fixed_window`, `sliding_window` or `concurrency`. Overrides keep their
    /// limit's.
    pub fn algorithm(&self) -> &'static str {
        self.algorithm
    }

    /// Enforce or shadow.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The enforced share of subjects, in hundredths of a percent (10,000 = 100%).
    pub fn rollout(&self) -> u16 {
        self.rollout
    }

    /// What to do when the store fails.
    pub fn failure_mode(&self) -> FailureMode {
        self.failure_mode
    }

    /// Whether its buckets are regional or global (overrides keep their limit's).
    pub fn scope(&self) -> Scope {
        self.scope
    }

    /// The overrides, in the order they are tried.
    pub fn overrides(&self) -> &[Override] {
        &self.overrides
    }

    /// Whether the limit a descriptor carries ([`Descriptor::requested_limit`], Envoy's
    /// `limit` action) decides in place of this limit's parameters and overrides
    /// (`request_limit: apply`), in a bucket of its own per limit asked for.
    pub fn applies_request_limit(&self) -> bool {
        self.request_limit
    }
}

/// Other parameters for the requests of a limit that match extra conditions.
#[derive(Debug)]
pub struct Override {
    pub(crate) name: Box<str>,
    pub(crate) when: Conditions,
    /// Always of the same kind as its limit's; its limit's own when `unlimited`.
    pub(crate) params: Params,
    /// [`key::params_tag`] of `params`, made once.
    pub(crate) tag: u32,
    /// `unlimited: true`: the requests it matches are not limited by its limit at all.
    pub(crate) unlimited: bool,
    /// `deny: true`: its limit rejects every request it matches.
    pub(crate) deny: bool,
}

impl Override {
    /// The override's name (its position when the file gives none): part of the bucket key.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The descriptor entries, beyond its limit's, and what their values must be.
    pub fn when(&self) -> impl Iterator<Item = (&str, &ValueMatch)> {
        self.when.iter().map(|(k, v)| (&**k, v))
    }

    /// The parameters it applies; for an [`unlimited`](Self::unlimited) or a
    /// [`deny`](Self::deny) override, which apply none, its limit's.
    pub fn params(&self) -> &Params {
        &self.params
    }

    /// The tag that ends its buckets' store keys, as [`LimitDef::bucket_tag`].
    pub fn bucket_tag(&self) -> u32 {
        self.tag
    }

    /// The rate it applies, in an override of a rate limit (`None` when unlimited or when
    /// it denies).
    pub fn rate(&self) -> Option<&Limit> {
        self.params.rate().filter(|_| !self.unlimited && !self.deny)
    }

    /// The bound on leases it applies, in an override of a concurrency limit (`None` when
    /// unlimited).
    pub fn concurrency(&self) -> Option<&LeaseLimit> {
        self.params.concurrency().filter(|_| !self.unlimited)
    }

    /// Whether the requests it matches are left out of its limit altogether (`unlimited:
    /// true`, Envoy's `unlimited`): the limit does not apply to them, as if its conditions
    /// had not held.
    pub fn unlimited(&self) -> bool {
        self.unlimited
    }

    /// Whether its limit rejects every request it matches (`deny: true`; Envoy's
    /// `requests_per_unit: 0` on a value), without a bucket: in the limit's mode, so a shadow
    /// limit reports a would-reject and passes the request.
    pub fn deny(&self) -> bool {
        self.deny
    }
}

/// A documented, expiring exception to one limit.
#[derive(Debug)]
pub struct Exemption {
    pub(crate) limit: Box<str>,
    pub(crate) when: Conditions,
    pub(crate) owner: Box<str>,
    pub(crate) reason: Box<str>,
    pub(crate) expires: UnixTime,
    pub(crate) uses: AtomicU64,
    /// Whether its expiry has been audited (carried across reloads, as `uses` is).
    pub(crate) expiry_reported: std::sync::atomic::AtomicBool,
    /// The file of a policy directory it is written in.
    pub(crate) file: Option<Arc<str>>,
}

impl Exemption {
    /// The limit it lifts.
    pub fn limit(&self) -> &str {
        &self.limit
    }

    /// The file of a policy directory it is written in; `None` in a policy of one file.
    pub fn file(&self) -> Option<&str> {
        self.file.as_deref()
    }

    /// The descriptor entries and what their values must be for it to apply (none: every
    /// subject of the limit).
    pub fn when(&self) -> impl Iterator<Item = (&str, &ValueMatch)> {
        self.when.iter().map(|(k, v)| (&**k, v))
    }

    /// Who is accountable for it.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// Why it exists.
    pub fn reason(&self) -> &str {
        &self.reason
    }

    /// When it stops applying.
    pub fn expires(&self) -> UnixTime {
        self.expires
    }

    /// Whether it applies at `now`: an exemption ends by itself at its expiry.
    pub fn is_active(&self, now: UnixTime) -> bool {
        now < self.expires
    }

    /// How many decisions it has lifted the limit for.
    pub fn uses(&self) -> u64 {
        self.uses.load(Ordering::Relaxed)
    }

    pub(crate) fn record_use(&self) {
        self.uses.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether `other` is the same exemption (same limit, conditions, owner, reason and
    /// expiry), as written again in another version of the policy.
    pub(crate) fn same_as(&self, other: &Exemption) -> bool {
        self.limit == other.limit
            && self.when == other.when
            && self.owner == other.owner
            && self.reason == other.reason
            && self.expires == other.expires
    }
}

/// Why a matched limit will or will not reject.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Effect<'p> {
    /// Enforced: an empty bucket rejects the request.
    Enforce,
    /// The limit is in shadow mode: decided and counted, always allowed.
    Shadow,
    /// The subject is outside the limit's rollout: decided and counted like shadow.
    OutsideRollout,
    /// An active exemption lifts the limit: not decided at all.
    Exempt(&'p Exemption),
}

impl PartialEq for Effect<'_> {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            // The same exemption of the same policy, not merely an equal one.
            (Effect::Exempt(a), Effect::Exempt(b)) => std::ptr::eq(*a, *b),
            (a, b) => std::mem::discriminant(a) == std::mem::discriminant(b),
        }
    }
}

impl Eq for Effect<'_> {}

impl Effect<'_> {
    /// The mode label for metrics and responses: `enforce`, `shadow`, `rollout` or `exempt`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Effect::Enforce => "enforce",
            Effect::Shadow => "shadow",
            Effect::OutsideRollout => "rollout",
            Effect::Exempt(_) => "exempt",
        }
    }
}

/// A limit that applies to a request, with its bucket and effective parameters: a rate limit
/// ([`Policy::matches`]), or with `P` = [`LeaseLimit`] a concurrency limit
/// ([`Policy::lease_matches`], [`LeaseMatched`]).
#[derive(Debug, Clone)]
pub struct Matched<'p, P = Limit> {
    /// The index of the request descriptor it matched.
    pub descriptor: usize,
    /// The limit.
    pub limit: &'p LimitDef,
    /// The override that set the parameters, if any (the first that matched).
    pub override_: Option<&'p Override>,
    /// The bucket's key in the store: `limit-name|value...[#override]`, with `\`, `|` and `#` in
    /// values escaped by a backslash, so different subjects never share a bucket.
    pub bucket_key: String,
    /// Whether it can reject.
    pub effect: Effect<'p>,
    /// Whether the parameters are the ones the descriptor asked for
    /// ([`LimitDef::applies_request_limit`]); then no override applies.
    pub requested: bool,
    /// Whether the request is rejected by this limit whatever its bucket holds: a
    /// [`LimitDef::deny`] limit, a [`Override::deny`] override, or a denial the descriptor asks
    /// for ([`RequestedLimit::Deny`]). No bucket is read or charged; the parameters are not
    /// what decides.
    pub denied: bool,
    /// The effective parameters, of the kind matched for.
    pub(crate) params: P,
    /// The tag of the effective parameters ([`key::params_tag`]), which ends the bucket's
    /// store key, so that a bucket is not read under other parameters than its own.
    pub(crate) tag: u32,
}

/// A concurrency limit that applies to a request: its lease key and effective bound.
pub type LeaseMatched<'p> = Matched<'p, LeaseLimit>;

impl<P> Matched<'_, P> {
    /// The effective parameters: the descriptor's own limit where the limit applies it, or
    /// else the override's, or else the limit's.
    pub fn params(&self) -> &P {
        &self.params
    }

    /// Where the subject's values lie in [`Matched::bucket_key`] (`acme|u1` of
    /// `per-user|acme|u1#gold`), or `None` for a limit keyed by nothing.
    pub(crate) fn subject(&self) -> Option<std::ops::Range<usize>> {
        if self.limit.key.is_empty() {
            return None;
        }
        let suffix = self.override_.map_or(0, |o| o.name.len() + 1);
        Some(self.limit.name.len() + 1..self.bucket_key.len().checked_sub(suffix)?)
    }
}

/// What a limit is filed under in its domain's [`DomainIndex`] (see the module docs).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Filed {
    /// The pair of `when[i]`, an exact condition (or each pair of a list of exact values), in
    /// `by_pair`.
    Pair(usize),
    /// The items of `when[i]`, a prefix or network condition or a list holding one: each
    /// prefix in `by_prefix`, each network in `by_network`, each exact value in `by_pair`.
    Items(usize),
    /// The entry name `key[i]`, in `by_entry`.
    Key(usize),
    /// Nothing: the limit is in `always`.
    Always,
}

impl LimitDef {
    /// Whether the limit is filed under the exact pair (`entry`, `value`): its condition there
    /// is that value, or a list holding it.
    fn filed_under_pair(&self, entry: &str, value: &str) -> bool {
        match self.filed {
            Filed::Pair(i) | Filed::Items(i) => {
                &*self.when[i].0 == entry && self.when[i].1.has_value(value)
            }
            _ => false,
        }
    }

    /// Whether the limit is filed under the prefix (`entry`, `prefix`): its condition there is
    /// that prefix, or a list holding it.
    fn filed_under_prefix(&self, entry: &str, prefix: &str) -> bool {
        match self.filed {
            Filed::Items(i) => &*self.when[i].0 == entry && self.when[i].1.has_prefix(prefix),
            _ => false,
        }
    }

    /// Whether the limit is filed under the network (`entry`, `net`): its condition there is
    /// that network, or a list holding it.
    fn filed_under_network(&self, entry: &str, net: &IpNet) -> bool {
        match self.filed {
            Filed::Items(i) => &*self.when[i].0 == entry && self.when[i].1.has_network(net),
            _ => false,
        }
    }

    /// The key entry name the limit is filed under, if any.
    fn filed_entry(&self) -> Option<&str> {
        match self.filed {
            Filed::Key(i) => Some(&self.key[i]),
            _ => None,
        }
    }
}

/// Candidate lists of one domain.
#[derive(Debug, Default)]
pub(crate) struct DomainIndex {
    /// Keyed by the hash of the `when` (entry, value) a limit is filed under.
    pub(crate) by_pair: HashTable<(u64, Box<[u32]>)>,
    /// Keyed by the hash of the `!prefix` (entry, prefix) a limit is filed under.
    pub(crate) by_prefix: HashTable<(u64, Box<[u32]>)>,
    /// Keyed by the hash of an entry name that prefixes are filed under: the distinct lengths
    /// of those prefixes, in bytes, shortest first.
    pub(crate) prefix_lengths: HashTable<(u64, Box<str>, Box<[usize]>)>,
    /// Keyed by the hash of the (entry, network) a limit is filed under.
    pub(crate) by_network: HashTable<(u64, Box<[u32]>)>,
    /// Keyed by the hash of an entry name that networks are filed under: the distinct prefix
    /// lengths of those networks, per address family.
    pub(crate) network_lengths: HashTable<(u64, Box<str>, NetLengths)>,
    /// Keyed by the hash of the key entry name a limit without conditions is filed under.
    pub(crate) by_entry: HashTable<(u64, Box<[u32]>)>,
    /// Limits with neither conditions nor key entries.
    pub(crate) always: Box<[u32]>,
    /// Whether a limit of the domain applies the limits descriptors carry.
    pub(crate) request_limits: bool,
}

/// One file of a policy directory, as it was compiled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceFile {
    pub(crate) name: Arc<str>,
    pub(crate) digest: u64,
}

impl SourceFile {
    /// Its name in the directory.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A stable hash of its text: two versions whose file has the same digest have the same
    /// text in it, so a reload can say which files it changed.
    pub fn digest(&self) -> u64 {
        self.digest
    }
}

/// How a file of a policy directory differs from one version to the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileChange {
    /// Only the later version has it.
    Added,
    /// Only the earlier version has it.
    Removed,
    /// Both have it, with other text.
    Changed,
}

/// A validated, indexed policy: one version of the control plane.
///
/// Immutable once built, and shared behind an `Arc` so that readers hold a whole version for as
/// long as they need it, whatever reloads happen meanwhile.
#[derive(Debug)]
pub struct Policy {
    pub(crate) version: Arc<str>,
    pub(crate) source: Arc<str>,
    /// The files of a policy directory, in the order read; empty for a policy of one file.
    pub(crate) files: Box<[SourceFile]>,
    pub(crate) limits: Box<[LimitDef]>,
    pub(crate) exemptions: Box<[Exemption]>,
    pub(crate) domains: HashMap<Box<str>, DomainIndex, foldhash::fast::RandomState>,
    pub(crate) hasher: foldhash::fast::RandomState,
}

impl Policy {
    /// The version: declared in the file, or `sha-` and a hash of its content.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The version, cheaply cloned into decisions.
    pub fn version_arc(&self) -> &Arc<str> {
        &self.version
    }

    /// Where the policy came from: a file, a directory, or `<input>`.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The files of a policy directory, in the order they were merged; empty for a policy of
    /// one file.
    pub fn files(&self) -> &[SourceFile] {
        &self.files
    }

    /// The files of a policy directory added, removed or changed since `before`: this
    /// version's in its order, then those only `before` had. Empty when both are policies of
    /// one file; from a policy of one file to a directory, every file is added.
    pub fn file_changes(&self, before: &Policy) -> Vec<(Arc<str>, FileChange)> {
        let find = |files: &[SourceFile], name: &str| -> Option<u64> {
            files.iter().find(|f| *f.name == *name).map(|f| f.digest)
        };
        let mut changes: Vec<(Arc<str>, FileChange)> = self
            .files
            .iter()
            .filter_map(|file| match find(&before.files, &file.name) {
                None => Some((Arc::clone(&file.name), FileChange::Added)),
                Some(digest) if digest != file.digest => {
                    Some((Arc::clone(&file.name), FileChange::Changed))
                }
                Some(_) => None,
            })
            .collect();
        changes.extend(
            (before.files.iter())
                .filter(|file| find(&self.files, &file.name).is_none())
                .map(|file| (Arc::clone(&file.name), FileChange::Removed)),
        );
        changes
    }

    /// The limits in declaration order.
    pub fn limits(&self) -> &[LimitDef] {
        &self.limits
    }

    /// The limit named `name`.
    pub fn limit(&self, name: &str) -> Option<&LimitDef> {
        self.limits.iter().find(|l| &*l.name == name)
    }

    /// Whether any limit is `scope: global`: without one, a global store has nothing to do.
    pub fn has_global(&self) -> bool {
        self.limits.iter().any(|l| l.scope == Scope::Global)
    }

    /// Whether a limit of `domain` applies the limits descriptors carry
    /// ([`LimitDef::applies_request_limit`]): where none does, a limit sent with a request
    /// changes nothing.
    pub fn applies_request_limits(&self, domain: &str) -> bool {
        self.domains.get(domain).is_some_and(|d| d.request_limits)
    }

    /// Whether the store key `key` (as the engine hands it to a store: the limit's name, then
    /// `|{values}` or `{name}`, an override and a parameter tag) is a bucket of a
    /// `scope: global` limit. Names are made of `[A-Za-z0-9_.-]` only, so the name is what
    /// precedes the first other character, after an opening `{`.
    pub fn is_global_key(&self, key: &str) -> bool {
        let key = key.strip_prefix('{').unwrap_or(key);
        let end = key
            .bytes()
            .position(|b| !(b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-')))
            .unwrap_or(key.len());
        let name = &key[..end];
        // Global limits are few; a policy's limits may be thousands.
        self.limits
            .iter()
            .any(|l| l.scope == Scope::Global && &*l.name == name)
    }

    /// The exemptions in declaration order.
    pub fn exemptions(&self) -> &[Exemption] {
        &self.exemptions
    }

    /// Appends to `out` the rate limits that apply to one request: `domain` and its
    /// descriptors, each a list of `(entry, value)` pairs. Within a descriptor the first
    /// occurrence of an entry counts. Allocates only the bucket keys (and `out`'s growth, which
    /// a reused buffer avoids). Concurrency limits are never among them (see
    /// [`lease_match_into`](Self::lease_match_into)).
    ///
    /// `now` is the wall-clock time, used only for exemption expiry; it is an argument so that
    /// matching is a pure function of its inputs.
    pub fn match_into<'p, D, S>(
        &'p self,
        domain: &str,
        descriptors: &[D],
        now: UnixTime,
        out: &mut Vec<Matched<'p>>,
    ) where
        D: Descriptor<S>,
        S: AsRef<str>,
    {
        self.match_kind(domain, descriptors, now, out);
    }

    /// Appends to `out` the concurrency limits that apply to one request, by the same rules as
    /// [`match_into`](Self::match_into) (domain, `when`, `key`, overrides, mode, rollout,
    /// exemptions); the bucket key names the limit's leases. Deny limits that apply are among
    /// them too ([`Matched::denied`], with a nominal bound of one lease that nothing takes): a
    /// denied client takes no lease.
    pub fn lease_match_into<'p, D, S>(
        &'p self,
        domain: &str,
        descriptors: &[D],
        now: UnixTime,
        out: &mut Vec<LeaseMatched<'p>>,
    ) where
        D: Descriptor<S>,
        S: AsRef<str>,
    {
        self.match_kind(domain, descriptors, now, out);
    }

    /// The concurrency limits that apply to one request (see
    /// [`lease_match_into`](Self::lease_match_into)).
    pub fn lease_matches<'p, D, S>(
        &'p self,
        domain: &str,
        descriptors: &[D],
        now: UnixTime,
    ) -> Vec<LeaseMatched<'p>>
    where
        D: Descriptor<S>,
        S: AsRef<str>,
    {
        let mut out = Vec::new();
        self.match_kind(domain, descriptors, now, &mut out);
        out
    }

    fn match_kind<'p, P, D, S>(
        &'p self,
        domain: &str,
        descriptors: &[D],
        now: UnixTime,
        out: &mut Vec<Matched<'p, P>>,
    ) where
        P: Kind,
        D: Descriptor<S>,
        S: AsRef<str>,
    {
        let Some(index) = self.domains.get(domain) else {
            return;
        };
        let begin = out.len();
        for (position, descriptor) in descriptors.iter().enumerate() {
            let entries = descriptor.entries();
            let requested = descriptor.requested_limit();
            let start = out.len();
            let found = |limit, out: &mut Vec<Matched<'p, P>>| {
                self.try_limit(limit, position, (entries, requested), now, out);
            };
            for &limit in &*index.always {
                found(limit, out);
            }
            for (i, (entry, value)) in entries.iter().enumerate() {
                let (entry, value) = (entry.as_ref(), value.as_ref());
                if entries[..i].iter().any(|(e, _)| e.as_ref() == entry) {
                    continue;
                }
                let pair = self.hasher.hash_one((entry, value));
                if let Some((_, list)) = index.by_pair.find(pair, |(h, _)| *h == pair) {
                    for &limit in &**list {
                        // A hash collision could file another pair's limits here: check the
                        // pair this limit is filed under, so it is tried once only.
                        let candidate = &self.limits[limit as usize];
                        if candidate.filed_under_pair(entry, value) {
                            found(limit, out);
                        }
                    }
                }
                let name = self.hasher.hash_one(entry);
                if !index.prefix_lengths.is_empty()
                    && let Some((_, _, lengths)) = index
                        .prefix_lengths
                        .find(name, |(h, filed, _)| *h == name && &**filed == entry)
                {
                    for &length in &**lengths {
                        let Some(prefix) = value.get(..length) else {
                            // Longer than the value, or inside a character: no such prefix.
                            continue;
                        };
                        let hash = self.hasher.hash_one((entry, prefix));
                        let Some((_, list)) = index.by_prefix.find(hash, |(h, _)| *h == hash)
                        else {
                            continue;
                        };
                        for &limit in &**list {
                            // No prefix of a list starts with another, so a value finds a
                            // limit under one of its prefixes at most (see `ValueList`).
                            let candidate = &self.limits[limit as usize];
                            if candidate.filed_under_prefix(entry, prefix) {
                                found(limit, out);
                            }
                        }
                    }
                }
                if !index.network_lengths.is_empty()
                    && let Some((_, _, lengths)) = index
                        .network_lengths
                        .find(name, |(h, filed, _)| *h == name && &**filed == entry)
                    && let Some(address) = address(value)
                {
                    // One lookup per distinct prefix length of the address's family, as for
                    // prefixes: a block list of a thousand networks costs a handful.
                    for net in lengths.networks_of(address) {
                        let hash = self.hasher.hash_one((entry, net));
                        let Some((_, list)) = index.by_network.find(hash, |(h, _)| *h == hash)
                        else {
                            continue;
                        };
                        for &limit in &**list {
                            let candidate = &self.limits[limit as usize];
                            if candidate.filed_under_network(entry, &net) {
                                found(limit, out);
                            }
                        }
                    }
                }
                if let Some((_, list)) = index.by_entry.find(name, |(h, _)| *h == name) {
                    for &limit in &**list {
                        let candidate = &self.limits[limit as usize];
                        if candidate.filed_entry() == Some(entry) {
                            found(limit, out);
                        }
                    }
                }
            }
            out[start..].sort_unstable_by_key(|m| m.limit.index);
            if !index.network_lengths.is_empty() {
                // A list whose prefix and network both hold a value finds its limit twice.
                dedup_from(out, start);
            }
        }
        // Envoy's `replaces`: a limit that applies to the request, through any descriptor,
        // takes the place of the limits it names.
        if out[begin..].iter().any(|m| !m.limit.replaces.is_empty()) {
            let replaced: Vec<u32> = out[begin..]
                .iter()
                .flat_map(|m| m.limit.replaces.iter().copied())
                .collect();
            let mut position = 0;
            out.retain(|m| {
                let keep = position < begin || !replaced.contains(&m.limit.index);
                position += 1;
                keep
            });
        }
    }

    /// The rate limits that apply to one request (see [`match_into`](Self::match_into)).
    pub fn matches<'p, D, S>(
        &'p self,
        domain: &str,
        descriptors: &[D],
        now: UnixTime,
    ) -> Vec<Matched<'p>>
    where
        D: Descriptor<S>,
        S: AsRef<str>,
    {
        let mut out = Vec::new();
        self.match_into(domain, descriptors, now, &mut out);
        out
    }

    fn try_limit<'p, P: Kind, S: AsRef<str>>(
        &'p self,
        index: u32,
        position: usize,
        (entries, requested): (&[(S, S)], Option<&RequestedLimit>),
        now: UnixTime,
        out: &mut Vec<Matched<'p, P>>,
    ) {
        let limit = &self.limits[index as usize];
        // The other kind is left out first: it is one comparison (a deny limit is of both).
        if (P::pick(&limit.params).is_none() && !(P::DENY_STANDS_IN && limit.deny))
            || limit.exact.is_some_and(|n| n != entries.len())
            || !all_hold(&limit.when, entries)
        {
            return;
        }
        let mut size = limit.name.len();
        for entry in &*limit.key {
            match lookup(entries, entry) {
                Some(value) => size += value.len() + 1,
                None => return,
            }
        }
        // A limit the descriptor asks for, where this limit applies one, takes the place of
        // its own parameters and its overrides'; its tag gives it a bucket of its own.
        // A denial asked for keeps the limit's own parameters and bucket key, which decide
        // nothing.
        let asked = match requested.filter(|_| limit.request_limit) {
            Some(RequestedLimit::Rate(sent)) => {
                P::requested(sent).map(|params| Some((params, key::rate_tag(sent))))
            }
            Some(RequestedLimit::Deny) => Some(None),
            None => None,
        };
        let override_ = match asked {
            Some(_) => None,
            None => limit.overrides.iter().find(|o| all_hold(&o.when, entries)),
        };
        if override_.is_some_and(|o| o.unlimited) {
            return;
        }
        let (params, tag) = match asked {
            Some(Some(rate)) => rate,
            // An override's parameters are of its limit's kind (compile makes sure).
            _ => match P::pick(override_.map_or(&limit.params, |o| &o.params)) {
                Some(params) => (*params, override_.map_or(limit.tag, |o| o.tag)),
                // A deny limit's overrides are all unlimited (compile makes sure).
                None if P::DENY_STANDS_IN && limit.deny => match P::for_deny() {
                    Some(params) => (params, limit.tag),
                    None => return,
                },
                None => return,
            },
        };
        let mut bucket_key =
            String::with_capacity(size + override_.map_or(0, |o| o.name.len() + 1));
        bucket_key.push_str(&limit.name);
        for entry in &*limit.key {
            bucket_key.push('|');
            key::push_escaped(&mut bucket_key, lookup(entries, entry).unwrap_or_default());
        }
        let exemption = limit
            .exemptions
            .iter()
            .map(|&e| &self.exemptions[e as usize])
            .find(|e| e.is_active(now) && all_hold(&e.when, entries));
        let effect = if let Some(exemption) = exemption {
            Effect::Exempt(exemption)
        } else if limit.mode == Mode::Shadow {
            Effect::Shadow
        } else if !key::in_rollout(&bucket_key, limit.rollout) {
            // Hashed before the override suffix: a subject is in or out of the rollout whatever
            // override its request picks.
            Effect::OutsideRollout
        } else {
            Effect::Enforce
        };
        if let Some(o) = override_ {
            bucket_key.push('#');
            bucket_key.push_str(&o.name);
        }
        out.push(Matched {
            descriptor: position,
            limit,
            override_,
            bucket_key,
            effect,
            requested: asked.is_some(),
            denied: limit.deny || override_.is_some_and(|o| o.deny) || matches!(asked, Some(None)),
            params,
            tag,
        });
    }
}

/// Drops, from `out[start..]` (sorted by limit), the matches of a limit found before.
fn dedup_from<P>(out: &mut Vec<Matched<'_, P>>, start: usize) {
    let mut kept = start;
    for i in start..out.len() {
        if kept > start && out[kept - 1].limit.index == out[i].limit.index {
            continue;
        }
        out.swap(kept, i);
        kept += 1;
    }
    out.truncate(kept);
}

fn lookup<'e, S: AsRef<str>>(entries: &'e [(S, S)], entry: &str) -> Option<&'e str> {
    entries
        .iter()
        .find(|(e, _)| e.as_ref() == entry)
        .map(|(_, v)| v.as_ref())
}

fn all_hold<S: AsRef<str>>(conditions: &[(Box<str>, ValueMatch)], entries: &[(S, S)]) -> bool {
    conditions
        .iter()
        .all(|(entry, test)| lookup(entries, entry).is_some_and(|value| test.matches(value)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile;

    fn network(text: &str) -> Network {
        text.parse().unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn the_client_is_the_first_address_from_the_right_no_proxy_holds() {
        let proxies = [network("10.0.0.0/8"), network("2001:db8::/32")];
        let client = |chain: &[&'static str]| forwarded_client(chain, &proxies);
        let ip = |text: &str| text.parse::<IpAddr>().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(client(&[]), None);
        assert_eq!(client(&["198.51.100.7"]), Some(Ok(ip("198.51.100.7"))));
        assert_eq!(
            client(&["6.6.6.6", "198.51.100.7", "2001:db8::1", "10.0.0.9"]),
            Some(Ok(ip("198.51.100.7")))
        );
        // Only proxies: the leftmost, the first that handled the request.
        assert_eq!(
            client(&["10.0.0.1", "::ffff:10.0.0.2"]),
            Some(Ok(ip("10.0.0.1")))
        );
        // Canonical: an IPv4-mapped client is the IPv4 address, and a mapped proxy is one.
        assert_eq!(
            client(&["::ffff:198.51.100.7", "::ffff:10.0.0.2"]),
            Some(Ok(ip("198.51.100.7")))
        );
        // Nothing left of an entry that is no address alone can be vouched for.
        assert_eq!(client(&["6.6.6.6", "x", "10.0.0.9"]), Some(Err("x")));
        assert_eq!(
            client(&["x", "198.51.100.7", "10.0.0.9"]),
            Some(Ok(ip("198.51.100.7")))
        );
        assert!(proxies[0].contains(ip("::ffff:10.1.2.3")));
        assert!(!proxies[0].contains(ip("11.0.0.1")));
        assert!(proxies[1].contains(ip("2001:db8::5")));
    }

    /// One item stays that item, matched inline, not a list of one searched out of line.
    #[test]
    fn a_list_that_comes_down_to_one_item_is_that_item() {
        let one = |values: &[&str], prefixes: &[&str], networks: &[&str]| {
            ValueMatch::any_of(
                values.iter().map(|&v| v.into()).collect(),
                prefixes.iter().map(|&p| p.into()).collect(),
                networks.iter().map(|&n| network(n)).collect(),
            )
        };
        assert_eq!(one(&[], &[], &[]), None);
        assert_eq!(
            one(&["a", "a"], &[], &[]),
            Some(ValueMatch::Exact("a".into()))
        );
        assert_eq!(
            one(&["eu-1"], &["eu-", "eu-w"], &[]),
            Some(ValueMatch::Prefix("eu-".into()))
        );
        assert_eq!(
            one(&["10.1.2.3"], &[], &["10.0.0.0/8", "10.1.0.0/16"]),
            Some(ValueMatch::Network(Box::new(network("10.0.0.0/8"))))
        );
        assert!(matches!(
            one(&["a"], &[], &["10.0.0.0/8"]),
            Some(ValueMatch::AnyOf(_))
        ));
    }

    /// A hash collision in the index could hand matching another pair's limits: what a limit
    /// is filed under must answer for the very value, prefix or network, not for any.
    #[test]
    fn a_limit_is_filed_under_its_own_items_only() {
        let policy = compile(
            "p.yaml",
            "limits:\n  - {name: l, domain: d, capacity: 1, refill: 1/s, \
             when: {tier: [gold, silver, !prefix beta-, !cidr 10.0.0.0/8]}}\n  \
             - {name: one, domain: d, capacity: 1, refill: 1/s, when: {tier: gold}}\n",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let list = &policy.limits()[0];
        assert!(list.filed_under_pair("tier", "gold"));
        assert!(list.filed_under_pair("tier", "silver"));
        assert!(!list.filed_under_pair("tier", "bronze"));
        assert!(!list.filed_under_pair("tier", "beta-1"), "a prefix's value");
        assert!(!list.filed_under_pair("plan", "gold"));
        assert!(list.filed_under_prefix("tier", "beta-"));
        assert!(!list.filed_under_prefix("tier", "beta"));
        assert!(!list.filed_under_prefix("plan", "beta-"));
        assert!(list.filed_under_network("tier", &network("10.0.0.0/8").net()));
        assert!(!list.filed_under_network("tier", &network("10.0.0.0/16").net()));
        assert!(!list.filed_under_network("plan", &network("10.0.0.0/8").net()));
        let one = &policy.limits()[1];
        assert!(one.filed_under_pair("tier", "gold"));
        assert!(!one.filed_under_pair("tier", "silver"));
        assert!(!one.filed_under_prefix("tier", "gold"));
        assert!(!one.filed_under_network("tier", &network("10.0.0.0/8").net()));
    }
}
