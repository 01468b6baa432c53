//! The Prometheus alerting rules shipped in `docs/examples/alerts.yaml` stay true: every
//! series they read is one the server exports, and `promtool test rules` runs their unit tests
//! (each alert raised by the series that should raise it, and quiet on those that should not).
//!
//! promtool comes with Prometheus; `.ci/run` fetches it when missing. A machine without it
//! fails this test with what to install, as one without `redis-server` fails the Redis tests.

mod support;

use std::path::{Path, PathBuf};

use tollgate_server::metrics;

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/examples")
}

#[test]
fn the_alerts_read_series_the_server_exports() {
    let rules = std::fs::read_to_string(examples().join("alerts.yaml")).expect("alerts.yaml");
    let tests =
        std::fs::read_to_string(examples().join("alerts.test.yaml")).expect("alerts.test.yaml");
    let names: Vec<&str> = support::series_named(&rules)
        .into_iter()
        .chain(support::series_named(&tests))
        .collect();
    assert!(names.len() > 10, "{names:?}");
    for name in names {
        // A histogram's series: its buckets, sum and count.
        let metric = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| name.strip_suffix(suffix))
            .filter(|base| [metrics::LATENCY, metrics::GLOBAL_ROUNDS].contains(base))
            .unwrap_or(name);
        assert!(
            metrics::ALL.contains(&metric),
            "{name} is no series tollgate exports (tollgate_server::metrics::ALL)"
        );
    }
}

#[test]
fn the_alerts_pass_their_promtool_tests() {
    support::run_promtool(&examples(), &["test", "rules", "alerts.test.yaml"]);
}
