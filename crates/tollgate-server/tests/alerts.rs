//! The Prometheus alerting rules shipped in `docs/examples/alerts.yaml` stay true: every
//! series they read is one the server exports, and `promtool test rules` runs their unit tests
//! (each alert raised by the series that should raise it, and quiet on those that should not).
//!
//! promtool comes with Prometheus; `.ci/run` fetches it when missing. A machine without it
//! fails this test with what to install, as one without `redis-server` fails the Redis tests.

use std::path::{Path, PathBuf};
use std::process::Command;

use tollgate_server::metrics;

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/examples")
}

/// The `tollgate_*` names a text mentions, in order of appearance.
fn series_named(text: &str) -> Vec<&str> {
    let mut names = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("tollgate_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.push(&tail[..end]);
        rest = &tail[end..];
    }
    names
}

#[test]
fn the_alerts_read_series_the_server_exports() {
    let rules = std::fs::read_to_string(examples().join("alerts.yaml")).expect("alerts.yaml");
    let tests =
        std::fs::read_to_string(examples().join("alerts.test.yaml")).expect("alerts.test.yaml");
    let names: Vec<&str> = series_named(&rules)
        .into_iter()
        .chain(series_named(&tests))
        .collect();
    assert!(names.len() > 10, "{names:?}");
    for name in names {
        // A histogram's series: its buckets, sum and count.
        let metric = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| name.strip_suffix(suffix))
            .filter(|base| *base == metrics::LATENCY)
            .unwrap_or(name);
        assert!(
            metrics::ALL.contains(&metric),
            "{name} is no series tollgate exports (tollgate_server::metrics::ALL)"
        );
    }
}

#[test]
fn the_alerts_pass_their_promtool_tests() {
    let promtool = std::env::var_os("TOLLGATE_PROMTOOL").unwrap_or_else(|| "promtool".into());
    let output = Command::new(&promtool)
        .arg("test")
        .arg("rules")
        .arg("alerts.test.yaml")
        .current_dir(examples())
        .output()
        .unwrap_or_else(|err| {
            panic!(
                "cannot run {promtool:?} ({err}): these tests need Prometheus' promtool on \
                 the PATH or in TOLLGATE_PROMTOOL (Debian: apt-get install prometheus, or \
                 extract usr/bin/promtool from `apt-get download prometheus` as .ci/run does)"
            )
        });
    assert!(
        output.status.success(),
        "promtool test rules failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}
