//! The Envoy import against a model of envoyproxy/ratelimit's own lookup: for random
//! configurations and requests, the imported policy applies exactly the limits Envoy would, in
//! their modes, less those another one of the request replaces (or none where Envoy applies
//! none), as token buckets or, with `--fixed-windows`, fixed windows of the same `N` per unit,
//! and where Envoy's limit is `requests_per_unit: 0` ("deny all"), a deny.
//!
//! The model walks the descriptor's entries down the tree as envoyproxy/ratelimit does: at each
//! level the node with the entry's exact value, else the first wildcard value (`foo*`, in file
//! order) the value starts with, else the key-only node; the limit is that of the node the last
//! entry lands on (`unlimited` is none), and a walk that runs out of nodes applies none. Of a
//! request's limits, those whose `name` another one's `replaces` gives are left out.
//!
//! Envoy counts each descriptor apart (its counter's key holds every entry and value), so two
//! descriptors with different entries must never share a tollgate bucket either: the import
//! writes a run of overrides that apply the same thing as one override listing their values,
//! and this checks each value keeps a bucket of its own. A second property draws levels of many
//! values at few rates (`runs()`), where such runs are common.
//!
//! Each level of a generated tree uses keys of its own (`a1`/`b1`, then `a2`/`b2`, …), so a
//! descriptor written in tree order is the only order its entries can have: Envoy's ordered
//! walk and tollgate's exact limits (which ignore order) agree by construction there, and the
//! import's general note about order does not apply.

use proptest::prelude::*;
use tollgate_policy::{ImportOptions, UnixTime, compile, import_envoy_with};

/// A descriptor node of the generated configuration.
#[derive(Debug, Clone)]
struct Node {
    key: String,
    /// `None`: the key-only node; `Some("a*")`: a wildcard value.
    value: Option<String>,
    rate: Rate,
    shadow: bool,
    /// Picks of other limits this one replaces (resolved to names by [`name_limits`]).
    picks: Vec<u8>,
    /// `rate_limit.name` and the names it replaces, once named.
    name: String,
    replaces: Vec<String>,
    children: Vec<Node>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Rate {
    /// Requests per `unit` (a second, unless 0: Envoy's "deny all", whose unit is then any).
    Limited(u32),
    Unlimited,
    /// No `rate_limit` at all.
    Absent,
}

const VALUES: &[&str] = &["a", "ab", "abc", "b", "ba"];
const WILDCARDS: &[&str] = &["a*", "ab*", "b*", "*"];
/// The values descriptors send: the exact values, others the wildcard values take, and others
/// no value takes.
const SENT: &[&str] = &["a", "ab", "abc", "abz", "b", "ba", "bz", "c", "z"];

fn rate() -> impl Strategy<Value = Rate> {
    prop_oneof![
        4 => (1u32..50).prop_map(Rate::Limited),
        2 => Just(Rate::Limited(0)),
        1 => Just(Rate::Unlimited),
        2 => Just(Rate::Absent),
    ]
}

/// The nodes of one level (depth `depth`, 1-based), each with a unique key and value.
fn level(depth: u32) -> BoxedStrategy<Vec<Node>> {
    let keys = vec![format!("a{depth}"), format!("b{depth}")];
    let value = prop_oneof![
        2 => Just(None),
        3 => prop::sample::select(VALUES).prop_map(|v| Some(v.to_owned())),
        2 => prop::sample::select(WILDCARDS).prop_map(|v| Some(v.to_owned())),
    ];
    let children = if depth < 3 {
        prop_oneof![2 => Just(Vec::new()), 1 => level(depth + 1)].boxed()
    } else {
        Just(Vec::new()).boxed()
    };
    let picks = prop_oneof![3 => Just(Vec::new()), 1 => prop::collection::vec(any::<u8>(), 1..3)];
    let node = (
        prop::sample::select(keys),
        value,
        rate(),
        prop::bool::weighted(0.1),
        picks,
        children,
    )
        .prop_map(|(key, value, rate, shadow, picks, children)| Node {
            key,
            value,
            rate,
            shadow,
            picks,
            name: String::new(),
            replaces: Vec::new(),
            children,
        });
    prop::collection::vec(node, 1..6)
        .prop_map(|nodes| {
            // envoyproxy/ratelimit refuses a (key, value) twice at one level.
            let mut unique: Vec<Node> = Vec::new();
            for node in nodes {
                if !unique
                    .iter()
                    .any(|n| n.key == node.key && n.value == node.value)
                {
                    unique.push(node);
                }
            }
            unique
        })
        .boxed()
}

/// A top level shaped for runs of overrides: one key's key-only node and up to ten valued
/// siblings (of any value a descriptor sends), their rates drawn from a few (deny, unlimited,
/// none, 1 or 2 a second) so that neighbours often apply the same thing and the import writes
/// them as one override listing their values; other rates, wildcard values and other modes
/// among them split the runs. Subtrees as [`level`] makes them, so that limits under the
/// values shaped as ones under the key-only node (overrides of those, in runs too) come up.
fn runs() -> BoxedStrategy<Vec<Node>> {
    let few = prop_oneof![
        3 => Just(Rate::Limited(1)),
        2 => Just(Rate::Limited(0)),
        1 => Just(Rate::Limited(2)),
        1 => Just(Rate::Unlimited),
        1 => Just(Rate::Absent),
    ];
    let value = prop_oneof![
        6 => prop::sample::select(SENT).prop_map(|v| Some(v.to_owned())),
        1 => prop::sample::select(WILDCARDS).prop_map(|v| Some(v.to_owned())),
    ];
    let children = prop_oneof![3 => Just(Vec::new()), 1 => level(2)];
    let valued = (value, few, prop::bool::weighted(0.1), children.clone()).prop_map(
        |(value, rate, shadow, children)| Node {
            key: "a1".to_owned(),
            value,
            rate,
            shadow,
            picks: Vec::new(),
            name: String::new(),
            replaces: Vec::new(),
            children,
        },
    );
    // Mostly a rate, sometimes a deny (whose overrides only take requests out).
    let rate = prop_oneof![4 => (1u32..3).prop_map(Rate::Limited), 1 => Just(Rate::Limited(0))];
    let wide = (rate, children).prop_map(|(rate, children)| Node {
        key: "a1".to_owned(),
        value: None,
        rate,
        shadow: false,
        picks: Vec::new(),
        name: String::new(),
        replaces: Vec::new(),
        children,
    });
    (wide, prop::collection::vec(valued, 2..11), 0usize..11)
        .prop_map(|(wide, valued, at)| {
            // The key-only node anywhere among them: Envoy's precedence does not depend on it.
            let mut unique: Vec<Node> = Vec::new();
            for node in valued {
                if !unique.iter().any(|n| n.value == node.value) {
                    unique.push(node);
                }
            }
            unique.insert(at.min(unique.len()), wide);
            unique
        })
        .boxed()
}

/// Units a deny is written with: a deny counts nothing, so none of them (month and year
/// included, which a limit approximates with a note) may change the import. Every other deny
/// by number is written with its unit alone, no `requests_per_unit`, which Envoy reads as 0.
const DENY_UNITS: &[&str] = &["second", "minute", "hour", "day", "week", "month", "year"];

fn render(nodes: &[Node], indent: usize, out: &mut String) {
    let pad = " ".repeat(indent);
    for node in nodes {
        out.push_str(&format!("{pad}- key: {}\n", node.key));
        if let Some(value) = &node.value {
            out.push_str(&format!("{pad}  value: \"{value}\"\n"));
        }
        match node.rate {
            Rate::Limited(n) => {
                let replaces: Vec<String> = node
                    .replaces
                    .iter()
                    .map(|r| format!("{{name: {r}}}"))
                    .collect();
                // A deny's unit, picked by its number (`n7`): any of them, with or without
                // `requests_per_unit: 0`.
                let (unit, count) = match n {
                    0 => {
                        let number: usize = node.name[1..].parse().unwrap_or_default();
                        let unit = DENY_UNITS[number % DENY_UNITS.len()];
                        let implied = number / DENY_UNITS.len() % 2 == 1;
                        let count = if implied {
                            ""
                        } else {
                            " requests_per_unit: 0,"
                        };
                        (unit, count.to_owned())
                    }
                    _ => ("second", format!(" requests_per_unit: {n},")),
                };
                out.push_str(&format!(
                    "{pad}  rate_limit: {{unit: {unit},{count} name: {}, replaces: [{}]}}\n",
                    node.name,
                    replaces.join(", ")
                ));
            }
            Rate::Unlimited => out.push_str(&format!("{pad}  rate_limit: {{unlimited: true}}\n")),
            Rate::Absent => {}
        }
        if node.shadow {
            out.push_str(&format!("{pad}  shadow_mode: true\n"));
        }
        if !node.children.is_empty() {
            out.push_str(&format!("{pad}  descriptors:\n"));
            render(&node.children, indent + 4, out);
        }
    }
}

/// Names every limited node (`n0`, `n1`, …) and turns its picks into the names of other
/// limited nodes it replaces.
fn name_limits(tree: &mut [Node]) {
    let mut count = 0;
    number(tree, &mut count);
    let names: Vec<String> = (0..count).map(|i| format!("n{i}")).collect();
    pick(tree, &names);
}

fn number(nodes: &mut [Node], count: &mut usize) {
    for node in nodes {
        if let Rate::Limited(_) = node.rate {
            node.name = format!("n{count}");
            *count += 1;
        }
        number(&mut node.children, count);
    }
}

fn pick(nodes: &mut [Node], names: &[String]) {
    for node in nodes {
        if !node.name.is_empty() && names.len() > 1 {
            let mut replaces: Vec<String> = node
                .picks
                .iter()
                .map(|&p| names[usize::from(p) % names.len()].clone())
                .filter(|n| *n != node.name)
                .collect();
            replaces.dedup();
            node.replaces = replaces;
        }
        pick(&mut node.children, names);
    }
}

/// envoyproxy/ratelimit's lookup: the limit node Envoy finds for `entries`.
fn envoy<'t>(mut nodes: &'t [Node], entries: &[(String, String)]) -> Option<&'t Node> {
    let mut found = None;
    for (i, (key, value)) in entries.iter().enumerate() {
        let of_key = || nodes.iter().filter(|n| n.key == *key);
        let next = of_key()
            .find(|n| n.value.as_deref() == Some(value))
            .or_else(|| {
                of_key().find(|n| {
                    n.value
                        .as_deref()
                        .and_then(|v| v.strip_suffix('*'))
                        .is_some_and(|prefix| value.starts_with(prefix))
                })
            })
            .or_else(|| of_key().find(|n| n.value.is_none()));
        let Some(node) = next else {
            break;
        };
        if i == entries.len() - 1 && matches!(node.rate, Rate::Limited(_)) {
            found = Some(node);
        }
        if node.children.is_empty() {
            break;
        }
        nodes = &node.children;
    }
    found
}

/// A descriptor written in tree order: one entry per level, with values that hit exact
/// values, wildcard values and neither, sometimes one entry deeper than the tree.
fn descriptor() -> impl Strategy<Value = Vec<(String, String)>> {
    let entry = |depth: u32| {
        (
            prop::sample::select(vec![format!("a{depth}"), format!("b{depth}")]),
            prop::sample::select(SENT),
        )
            .prop_map(|(k, v)| (k, v.to_owned()))
    };
    (1usize..=4, entry(1), entry(2), entry(3), entry(4))
        .prop_map(|(len, e1, e2, e3, e4)| [e1, e2, e3, e4].into_iter().take(len).collect())
}

/// The general notes an import with limits carries (the one on counting, when one counts).
fn general(note: &str) -> bool {
    note.starts_with("envoy counts requests in calendar fixed windows")
        || note.starts_with("envoy matches descriptor entries in order")
}

/// Imports `tree` and checks every request of `requests` against Envoy's lookup: the limits
/// applied, their parameters and modes, and that no two descriptors share a bucket.
fn check(
    mut tree: Vec<Node>,
    requests: &[Vec<Vec<(String, String)>>],
    windows: bool,
) -> Result<(), TestCaseError> {
    name_limits(&mut tree);
    let mut text = String::from("domain: model\ndescriptors:\n");
    render(&tree, 2, &mut text);
    let options = ImportOptions::default().fixed_windows(windows);
    let imported = import_envoy_with("model.yaml", &text, options)
        .map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
    // Everything these configurations hold can be expressed: the import notes nothing
    // beyond what it says of every import, and of each deny written without its count that
    // it is one (which may be a slip in the file).
    let unexpressed: Vec<&String> = imported
        .notes
        .iter()
        .filter(|n| !general(n) && !n.contains("rate_limit without requests_per_unit"))
        .collect();
    prop_assert!(unexpressed.is_empty(), "{:?}\n{}", unexpressed, text);
    let policy = compile("out.yaml", &imported.policy)
        .map_err(|e| TestCaseError::fail(format!("{e}\n{}", imported.policy)))?;
    let algorithm = if windows {
        "fixed_window"
    } else {
        "token_bucket"
    };
    // Each bucket charged, with the entries of the first descriptor that charged it.
    let mut buckets: Vec<(String, &Vec<(String, String)>)> = Vec::new();
    for descriptors in requests {
        // Envoy: each descriptor's limit, less those any of them replaces.
        let found: Vec<(usize, &Node)> = descriptors
            .iter()
            .enumerate()
            .filter_map(|(i, entries)| envoy(&tree, entries).map(|node| (i, node)))
            .collect();
        let replaced: Vec<&String> = found.iter().flat_map(|(_, node)| &node.replaces).collect();
        // (descriptor, what decides it, mode): `N N/s algorithm`, or `deny`, which has no
        // parameters to compare.
        let mut expected: Vec<(usize, String, &str)> = found
            .iter()
            .filter(|(_, node)| !replaced.contains(&&node.name))
            .filter_map(|&(i, node)| {
                let mode = if node.shadow { "shadow" } else { "enforce" };
                match node.rate {
                    Rate::Limited(0) => Some((i, "deny".to_owned(), mode)),
                    Rate::Limited(n) => Some((i, format!("{n} {n}/s {algorithm}"), mode)),
                    _ => None,
                }
            })
            .collect();
        let matches = policy.matches("model", descriptors, UnixTime::from_secs(0));
        let mut applied: Vec<(usize, String, &str)> = matches
            .iter()
            .map(|m| {
                let params = m.params();
                let decides = if m.denied {
                    "deny".to_owned()
                } else {
                    format!(
                        "{} {} {}",
                        params.capacity(),
                        params.refill(),
                        params.algorithm().as_str()
                    )
                };
                (m.descriptor, decides, m.effect.as_str())
            })
            .collect();
        expected.sort();
        applied.sort();
        prop_assert_eq!(
            &applied,
            &expected,
            "descriptors {:?}\nconfig:\n{}\nimported:\n{}",
            descriptors,
            text,
            imported.policy
        );
        // A deny charges no bucket; every other limit charges one per distinct descriptor, as
        // Envoy keeps a counter per distinct descriptor.
        for m in matches.iter().filter(|m| !m.denied) {
            let entries = &descriptors[m.descriptor];
            match buckets.iter().find(|(key, _)| *key == m.bucket_key) {
                Some((_, first)) => prop_assert_eq!(
                    *first,
                    entries,
                    "two descriptors share bucket {}\nconfig:\n{}\nimported:\n{}",
                    m.bucket_key,
                    text,
                    imported.policy
                ),
                None => buckets.push((m.bucket_key.clone(), entries)),
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn the_import_applies_the_limits_envoy_applies(
        tree in level(1),
        requests in prop::collection::vec(prop::collection::vec(descriptor(), 1..4), 1..12),
        windows in any::<bool>(),
    ) {
        check(tree, &requests, windows)?;
    }

    #[test]
    fn runs_of_overrides_apply_the_limits_envoy_applies(
        tree in runs(),
        requests in prop::collection::vec(prop::collection::vec(descriptor(), 1..4), 1..12),
        windows in any::<bool>(),
    ) {
        check(tree, &requests, windows)?;
    }
}
