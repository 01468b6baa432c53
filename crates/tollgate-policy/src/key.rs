//! Bucket keys and the rollout hash.
//!
//! A bucket key names one bucket in a store, so two different subjects must never produce the
//! same key, whatever bytes their descriptor values hold. The encoding is
//!
//! ```text
//! limit-name ( "|" escaped-value )* [ "#" override-name ]
//! ```
//!
//! Names are restricted to `[A-Za-z0-9_.-]` at compile time, and in values `\`, `|` and `#` are
//! escaped with a backslash, so the separators that remain are unambiguous and the mapping from
//! (limit, values, override) to key is injective. It stays readable in logs and in Redis.
//!
//! The key holds the limit's name and never the policy version: a reload keeps everyone's
//! balance. An override is a bucket of its own (`#override`), because a bucket's stored state is
//! only meaningful with the parameters it was charged under.

use tollgate::{Algorithm, Limit};

use crate::policy::Params;

/// Appends `value` to `key`, escaped.
pub(crate) fn push_escaped(key: &mut String, value: &str) {
    if !value.bytes().any(|b| matches!(b, b'\\' | b'|' | b'#')) {
        key.push_str(value);
        return;
    }
    for c in value.chars() {
        if matches!(c, '\\' | '|' | '#') {
            key.push('\\');
        }
        key.push(c);
    }
}

/// A stable 64-bit hash (FNV-1a with a final avalanche step): it must give the same answer in
/// every process and every release, because it decides who is inside a rollout. Hashers of the
/// standard library and of hashing crates promise no such stability.
pub(crate) fn stable_hash(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // FNV's low bits mix poorly; the splitmix64 finaliser spreads every input bit over all of
    // them before the value is reduced modulo 10,000.
    hash ^= hash >> 30;
    hash = hash.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    hash ^= hash >> 27;
    hash = hash.wrapping_mul(0x94d0_49bb_1331_11eb);
    hash ^ (hash >> 31)
}

/// 32 bits of a stable hash of a limit's parameters: the tag that ends a store key, so that a
/// bucket made under other parameters is never read as this one's. Made once per limit and
/// override when a policy is compiled, and per request for a limit a descriptor carries.
///
/// A window limit's tag covers its algorithm and window, not its limit per window: its counts
/// mean the same under any limit, so a change of the limit keeps them (the bucket stays under
/// its key), where a change of window or algorithm starts afresh under a new key.
///
/// A concurrency limit's tag covers its algorithm alone: a lease is held whatever the bound it
/// was taken under, so a change of `max_in_flight` or `lease_timeout` keeps the leases held
/// counted (a lower bound admits nothing until enough of them end).
pub(crate) fn params_tag(params: &Params) -> u32 {
    match params {
        Params::Rate(limit) => rate_tag(limit),
        Params::Concurrency(_) => (stable_hash(b"concurrency") >> 32) as u32,
    }
}

/// [`params_tag`] of a rate limit's parameters.
pub(crate) fn rate_tag(params: &Limit) -> u32 {
    if let Some(window) = params.window() {
        let mut bytes = [0u8; 9];
        bytes[0] = match params.algorithm() {
            Algorithm::SlidingWindow => b's',
            Algorithm::SlidingLog => b'l',
            _ => b'f',
        };
        let window = u64::try_from(window.as_nanos()).unwrap_or(u64::MAX);
        bytes[1..].copy_from_slice(&window.to_le_bytes());
        return (stable_hash(&bytes) >> 32) as u32;
    }
    let mut bytes = [0u8; 24];
    bytes[..8].copy_from_slice(&params.capacity().to_le_bytes());
    bytes[8..16].copy_from_slice(&params.refill().amount().to_le_bytes());
    let period = u64::try_from(params.refill().period().as_nanos()).unwrap_or(u64::MAX);
    bytes[16..].copy_from_slice(&period.to_le_bytes());
    (stable_hash(&bytes) >> 32) as u32
}

/// Whether the subject whose key starts with `subject` is inside a rollout of `hundredths`
/// percent (0..=10,000).
pub(crate) fn in_rollout(subject: &str, hundredths: u16) -> bool {
    if hundredths >= 10_000 {
        return true;
    }
    (stable_hash(subject.as_bytes()) % 10_000) < u64::from(hundredths)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tags are part of the keys buckets are stored under (in Redis, across restarts and
    /// upgrades): a change to how they are made would put every bucket of a running
    /// deployment under a new key, full again.
    #[test]
    fn parameter_tags_do_not_change_between_versions() {
        let tag = |capacity, refill: &str| {
            params_tag(&Params::Rate(
                Limit::new(capacity, refill.parse().unwrap()).unwrap(),
            ))
        };
        assert_eq!(format!("{:08x}", tag(10, "5/s")), "6769e342");
        assert_eq!(format!("{:08x}", tag(1, "1/d")), "df8bd37b");
        // A window's tag covers its algorithm and window, not its limit.
        let window = |limit: Limit| format!("{:08x}", params_tag(&Params::Rate(limit)));
        let minute = std::time::Duration::from_secs(60);
        let logs = [5, 50].map(|n| window(Limit::sliding_log(n, minute).unwrap()));
        assert_eq!(logs[0], logs[1]);
        assert_ne!(logs[0], window(Limit::sliding_window(5, minute).unwrap()));
        assert_ne!(logs[0], window(Limit::fixed_window(5, minute).unwrap()));
        let sliding = window(Limit::sliding_window(5, minute).unwrap());
        assert_ne!(sliding, window(Limit::fixed_window(5, minute).unwrap()));
        assert_eq!(sliding, "dfa35909");
        // Leases keep their key whatever the bound or timeout.
        let lease = |max, ms| {
            let limit = tollgate::LeaseLimit::new(max, std::time::Duration::from_millis(ms));
            params_tag(&Params::Concurrency(limit.unwrap()))
        };
        assert_eq!(
            format!("{:08x}", lease(5, 30_000)),
            format!("{:08x}", lease(9, 500))
        );
        assert_eq!(format!("{:08x}", lease(1, 1)), "0787f7c7");
    }

    fn key(values: &[&str]) -> String {
        let mut key = String::from("l");
        for value in values {
            key.push('|');
            push_escaped(&mut key, value);
        }
        key
    }

    #[test]
    fn encoding_is_injective_on_tricky_values() {
        let cases: &[&[&str]] = &[
            &["a|b"],
            &["a", "b"],
            &["a\\", "b"],
            &["a\\|b"],
            &["a#x"],
            &["a", ""],
            &[""],
            &[],
            &["|"],
            &["\\"],
            &["a|", "b"],
            &["a", "|b"],
        ];
        let keys: Vec<String> = cases.iter().map(|c| key(c)).collect();
        for (i, a) in keys.iter().enumerate() {
            for (j, b) in keys.iter().enumerate() {
                if i != j {
                    assert_ne!(a, b, "{:?} and {:?}", cases[i], cases[j]);
                }
            }
        }
        assert_eq!(key(&["a|b", "c#d"]), "l|a\\|b|c\\#d");
    }

    proptest::proptest! {
        #[test]
        fn different_values_never_share_a_key(
            a in proptest::collection::vec("[a|#\\\\b]{0,4}", 0..4),
            b in proptest::collection::vec("[a|#\\\\b]{0,4}", 0..4),
        ) {
            let a_ref: Vec<&str> = a.iter().map(String::as_str).collect();
            let b_ref: Vec<&str> = b.iter().map(String::as_str).collect();
            proptest::prop_assert_eq!(a == b, key(&a_ref) == key(&b_ref));
        }
    }

    #[test]
    fn hash_is_stable() {
        // Pinned values: changing them would move subjects in or out of every rollout.
        assert_eq!(stable_hash(b""), stable_hash(b""));
        assert_eq!(stable_hash(b"payments|acme|u1"), 0x0a19_9647_80c2_c040);
    }

    #[test]
    fn rollout_fraction_is_close_to_the_percentage() {
        let inside = (0..20_000)
            .filter(|i| in_rollout(&format!("limit|user-{i}"), 2_500))
            .count();
        assert!((4_600..5_400).contains(&inside), "{inside}");
        assert!(in_rollout("x", 10_000));
        assert!(!in_rollout("x", 0));
    }

    /// A subject is inside a rollout of `p` hundredths when its hash lands below `p`: the one
    /// whose hash lands on 7024 joins at 70.25 %, not at 70.24 %.
    #[test]
    fn a_subject_joins_the_rollout_just_above_its_hash() {
        let subject = "payments|acme|u1";
        assert_eq!(stable_hash(subject.as_bytes()) % 10_000, 7024);
        assert!(!in_rollout(subject, 7024));
        assert!(in_rollout(subject, 7025));
    }
}
