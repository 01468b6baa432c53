//! The Grafana dashboard shipped in `docs/examples/grafana-dashboard.json` stays true: every
//! series its panels read is one the server exports, every query is PromQL Prometheus parses,
//! and every query over series a real server exports (after checks allowed, rejected, near the
//! limit, in shadow, unmatched and malformed) finds data in that server's own scrape.
//!
//! Prometheus' promtool parses and evaluates the queries; `.ci/run` fetches it when missing,
//! and a machine without it fails these tests with what to install, as for the alerting rules.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde_json::{Value, json};
use support::{Scratch, Server, post_json, request, run_promtool};
use tollgate_server::{hot_keys, metrics};

fn dashboard() -> Value {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/examples/grafana-dashboard.json");
    let text = std::fs::read_to_string(path).expect("grafana-dashboard.json");
    serde_json::from_str(&text).expect("the dashboard is JSON")
}

/// Every panel, those inside rows included.
fn panels(dashboard: &Value) -> Vec<&Value> {
    let mut all = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        all.push(panel);
        if let Some(inner) = panel["panels"].as_array() {
            all.extend(inner);
        }
    }
    all
}

/// (panel title, query) for every query of every panel, with Grafana's variables given the
/// values a dashboard showing everything gives them.
fn queries(dashboard: &Value) -> Vec<(String, String)> {
    panels(dashboard)
        .into_iter()
        .flat_map(|panel| {
            let title = panel["title"].as_str().unwrap_or_default().to_owned();
            panel["targets"]
                .as_array()
                .into_iter()
                .flatten()
                .map(move |target| {
                    let expr = target["expr"].as_str().expect("a query").to_owned();
                    (title.clone(), expr)
                })
        })
        .map(|(title, expr)| {
            let expr = expr
                .replace("$__rate_interval", "1m")
                .replace("$instance", ".*")
                .replace("$limit", ".*");
            (title, expr)
        })
        .collect()
}

/// The `tollgate_*` names a query reads, histogram suffixes folded into their metric.
fn series_in(query: &str) -> BTreeSet<String> {
    support::series_named(query)
        .into_iter()
        .map(|name| {
            name.strip_suffix("_bucket")
                .filter(|base| *base == metrics::LATENCY)
                .unwrap_or(name)
                .to_owned()
        })
        .collect()
}

#[test]
fn the_dashboard_reads_series_the_server_exports() {
    let dashboard = dashboard();
    let queries = queries(&dashboard);
    assert!(queries.len() >= 20, "{}", queries.len());
    let hot = [hot_keys::HOT_KEY_DECISIONS, hot_keys::HOT_KEY_REJECTIONS];
    for (title, query) in &queries {
        let names = series_in(query);
        assert!(!names.is_empty(), "{title}: {query}");
        for name in names {
            assert!(
                metrics::ALL.contains(&name.as_str()) || hot.contains(&name.as_str()),
                "{title}: {name} is no series tollgate exports"
            );
        }
    }
    // Grafana places panels by id and asks the data source the dashboard's variable names.
    let ids: Vec<u64> = panels(&dashboard)
        .iter()
        .filter_map(|panel| panel["id"].as_u64())
        .collect();
    let distinct: BTreeSet<&u64> = ids.iter().collect();
    assert_eq!(ids.len(), distinct.len(), "panel ids repeat: {ids:?}");
    for panel in panels(&dashboard) {
        if panel["type"] != "row" {
            assert_eq!(
                panel["datasource"]["uid"], "${datasource}",
                "{}",
                panel["title"]
            );
        }
    }
}

#[test]
fn prometheus_parses_every_query() {
    let scratch = Scratch::new("grafana-parse");
    let rules: Vec<Value> = queries(&dashboard())
        .into_iter()
        .enumerate()
        .map(|(index, (_, expr))| json!({"record": format!("dashboard:query_{index}"), "expr": expr}))
        .collect();
    // JSON is YAML: promtool reads it as a rules file.
    let file = json!({"groups": [{"name": "dashboard", "rules": rules}]});
    scratch.write("rules.yaml", &file.to_string());
    run_promtool(&scratch.0, &["check", "rules", "rules.yaml"]);
}

/// A server's `/metrics` as promtool input series: counters (and a histogram's series) rising by
/// their scraped value every 15 s, gauges holding it. Only tollgate's own series.
fn input_series(scrape: &str) -> (Vec<Value>, BTreeSet<String>) {
    let mut kinds = BTreeMap::new();
    for line in scrape.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut words = rest.split_whitespace();
            if let (Some(name), Some(kind)) = (words.next(), words.next()) {
                kinds.insert(name.to_owned(), kind.to_owned());
            }
        }
    }
    let mut series = Vec::new();
    let mut names = BTreeSet::new();
    for line in scrape.lines().filter(|line| line.starts_with("tollgate_")) {
        let Some((selector, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        let name = &selector[..selector.find('{').unwrap_or(selector.len())];
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| {
                name.strip_suffix(suffix)
                    .filter(|base| kinds.contains_key(*base))
            })
            .unwrap_or(name);
        let rising = matches!(
            kinds.get(family).map(String::as_str),
            Some("counter" | "histogram")
        );
        let values = if rising {
            format!("0+{value}x8")
        } else {
            format!("{value}x8")
        };
        series.push(json!({"series": selector, "values": values}));
        names.insert(family.to_owned());
    }
    (series, names)
}

#[test]
fn every_query_over_exported_series_finds_them() {
    let scratch = Scratch::new("grafana-data");
    let policy = scratch.write(
        "policy.yaml",
        "version: grafana\nlimits:\n\
         - {name: per-user, domain: api, key: [user], capacity: 5, refill: 1/m}\n\
         - {name: trial, domain: api, key: [user], capacity: 2, refill: 1/m, mode: shadow}\n",
    );
    let server = Server::start(&["--config", policy.to_str().expect("a UTF-8 path")]);
    // Allowed, near the limit, rejected, would-be rejected in shadow; unmatched; malformed.
    for _ in 0..8 {
        post_json(
            server.http,
            "/v1/check",
            r#"{"domain":"api","descriptors":[{"user":"u1"}]}"#,
        );
    }
    post_json(
        server.http,
        "/v1/check",
        r#"{"domain":"other","descriptors":[{"user":"u1"}]}"#,
    );
    assert_eq!(post_json(server.http, "/v1/check", "{").status, 400);
    let scrape = request(server.http, "GET", "/metrics", &[], "").body;
    let (series, exported) = input_series(&scrape);
    assert!(exported.contains(metrics::DECISIONS), "{scrape}");

    let mut checked = Vec::new();
    let tests: Vec<Value> = queries(&dashboard())
        .into_iter()
        .filter(|(_, expr)| series_in(expr).is_subset(&exported))
        .map(|(title, expr)| {
            checked.push(title);
            // One sample, 1, when the query finds anything; none when it finds nothing.
            json!({
                "expr": format!("count({expr}) > bool 0"),
                "eval_time": "2m",
                "exp_samples": [{"labels": "{}", "value": 1}],
            })
        })
        .collect();
    assert!(tests.len() >= 10, "only {checked:?}");
    let file = json!({
        "evaluation_interval": "15s",
        "tests": [{"interval": "15s", "input_series": series, "promql_expr_test": tests}],
    });
    scratch.write("dashboard.test.yaml", &file.to_string());
    run_promtool(&scratch.0, &["test", "rules", "dashboard.test.yaml"]);
}
