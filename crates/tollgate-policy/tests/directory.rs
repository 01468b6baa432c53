//! A policy directory: one file per team, merged into one policy with one version. Each rule
//! here is one a team relies on when it owns a file and not the whole policy.

use std::path::Path;
use std::sync::Arc;

use tollgate_policy::audit::AuditLog;
use tollgate_policy::{
    Diagnostic, EngineOptions, Error, FileChange, Mode, PolicyEngine, UnixTime, compile,
    compile_directory, validate,
};

fn limit(name: &str) -> String {
    format!("  - {{name: {name}, domain: api, key: [user], capacity: 3, refill: 1/h}}\n")
}

fn limits(names: &[&str]) -> String {
    let mut text = String::from("limits:\n");
    for name in names {
        text.push_str(&limit(name));
    }
    text
}

fn refused(files: &[(&str, &str)]) -> Diagnostic {
    match compile_directory("policy.d", files) {
        Ok(_) => panic!("{files:?} was taken"),
        Err(err) => match err.diagnostic() {
            Some(d) => d.clone(),
            None => panic!("no position: {err}"),
        },
    }
}

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

#[test]
fn files_merge_in_order_and_each_limit_keeps_its_file() {
    let pay = limits(&["pay", "refund"]);
    let search = limits(&["search"]);
    let policy = compile_directory("policy.d", &[("pay.yaml", &pay), ("search.yaml", &search)])
        .unwrap_or_else(|e| panic!("{e}"));
    let seen: Vec<(&str, Option<&str>)> = policy
        .limits()
        .iter()
        .map(|l| (l.name(), l.file()))
        .collect();
    assert_eq!(
        seen,
        [
            ("pay", Some("pay.yaml")),
            ("refund", Some("pay.yaml")),
            ("search", Some("search.yaml"))
        ]
    );
    let files: Vec<&str> = policy.files().iter().map(|f| f.name()).collect();
    assert_eq!(files, ["pay.yaml", "search.yaml"]);
    assert_eq!(policy.source(), "policy.d");
    // Requests match across files as in one file.
    let matched = policy.matches("api", &[[("user", "u1")]], UnixTime::from_secs(0));
    assert_eq!(matched.len(), 3);

    // A policy of one file names no file per limit: there is nothing to tell apart.
    let single = compile("p.yaml", &pay).unwrap_or_else(|e| panic!("{e}"));
    assert!(single.files().is_empty());
    assert_eq!(single.limits()[0].file(), None);
}

/// A file's defaults are its own: one team's `mode: shadow` does not put another team's
/// limits in shadow.
#[test]
fn defaults_apply_to_their_own_file() {
    let trial = format!("defaults: {{mode: shadow}}\n{}", limits(&["trial"]));
    let pay = limits(&["pay"]);
    let policy = compile_directory("policy.d", &[("pay.yaml", &pay), ("trial.yaml", &trial)])
        .unwrap_or_else(|e| panic!("{e}"));
    let mode = |name| policy.limit(name).map(|l| l.mode());
    assert_eq!(mode("pay"), Some(Mode::Enforce));
    assert_eq!(mode("trial"), Some(Mode::Shadow));
}

/// Names identify buckets across the whole directory; the error is in the second file and
/// says where the first one is.
#[test]
fn a_name_taken_in_another_file_is_refused_where_it_is_taken_again() {
    let pay = limits(&["pay", "shared"]);
    let search = limits(&["search", "shared"]);
    let d = refused(&[("pay.yaml", &pay), ("search.yaml", &search)]);
    assert_eq!(
        d.file,
        format!("{}", Path::new("policy.d/search.yaml").display())
    );
    assert_eq!((d.line, d.path.as_str()), (3, "limits[1].name"));
    assert!(
        d.message.contains("duplicate limit name \"shared\"")
            && d.message
                .contains(&format!("{}", Path::new("policy.d/pay.yaml").display())),
        "{d}"
    );
    // Inside one file the message needs no other file.
    let d = refused(&[("pay.yaml", &limits(&["a", "a"]))]);
    assert!(!d.message.contains("also in"), "{d}");
}

/// Every problem is reported in the file it is in, with that file's line and path.
#[test]
fn an_error_names_its_own_file_line_and_path() {
    let good = limits(&["a", "b"]);
    let bad = "limits:\n  - {name: c, domain: api, capacity: 3, refill: 1/h}\n  - {name: d, domain: api, capacity: 0, refill: 1/h}\n";
    let d = refused(&[("a.yaml", &good), ("z.yaml", bad)]);
    assert_eq!(
        d.file,
        format!("{}", Path::new("policy.d/z.yaml").display())
    );
    assert_eq!((d.line, d.path.as_str()), (3, "limits[1].capacity"));
    // A file that does not parse is reported the same way.
    let d = refused(&[("a.yaml", &good), ("z.yaml", "limits: [\n")]);
    assert_eq!(
        d.file,
        format!("{}", Path::new("policy.d/z.yaml").display())
    );
    // An exemption's path counts in its own file.
    let ops = "limits: []\nexemptions:\n  - {limit: nope, owner: ops, reason: r, expires: 2030-01-01T00:00:00Z}\n";
    let d = refused(&[("a.yaml", &good), ("ops.yaml", ops)]);
    assert_eq!((d.line, d.path.as_str()), (3, "exemptions[0].limit"));
    assert!(d.file.ends_with("ops.yaml"), "{d}");
}

/// An operations team's file may exempt or replace a limit another team owns.
#[test]
fn references_cross_files() {
    let pay = limits(&["pay"]);
    let ops = "limits:\n  - {name: pay-outage, domain: api, key: [user], capacity: 1, refill: 1/h, replaces: [pay]}\nexemptions:\n  - {limit: pay, when: {user: vip}, owner: ops@example.com, reason: launch, expires: 2030-01-01T00:00:00Z}\n";
    let policy = compile_directory("policy.d", &[("ops.yaml", ops), ("pay.yaml", &pay)])
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(policy.exemptions()[0].file(), Some("ops.yaml"));
    assert_eq!(policy.exemptions()[0].limit(), "pay");
    let matched = policy.matches("api", &[[("user", "u1")]], UnixTime::from_secs(0));
    let names: Vec<&str> = matched.iter().map(|m| m.limit.name()).collect();
    assert_eq!(names, ["pay-outage"], "the replaced limit is left out");
}

/// One version names every file: at most one file sets it, and without one the version is a
/// hash of the names and contents, so any change of any file is a new version.
#[test]
fn one_version_for_the_directory() {
    let a = limits(&["a"]);
    let b = limits(&["b"]);
    let versioned = format!("version: \"2026-12-07.1\"\n{b}");
    let policy = compile_directory("policy.d", &[("a.yaml", &a), ("b.yaml", &versioned)])
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(policy.version(), "2026-12-07.1");

    let twice = format!("version: \"7\"\n{a}");
    let d = refused(&[("a.yaml", &twice), ("b.yaml", &versioned)]);
    assert!(d.file.ends_with("b.yaml") && d.path == "version", "{d}");
    assert!(d.message.contains("also set in"), "{d}");
    assert!(d.message.contains("a.yaml"), "{d}");

    let version = |files: &[(&str, &str)]| {
        compile_directory("policy.d", files)
            .map(|p| p.version().to_owned())
            .unwrap_or_else(|e| panic!("{e}"))
    };
    let base = version(&[("a.yaml", &a), ("b.yaml", &b)]);
    assert!(base.starts_with("sha-"), "{base}");
    assert_eq!(base, version(&[("a.yaml", &a), ("b.yaml", &b)]));
    assert_ne!(base, version(&[("a.yaml", &a), ("c.yaml", &b)]), "renamed");
    assert_ne!(base, version(&[("a.yaml", &a)]), "removed");
    let b2 = b.replace("capacity: 3", "capacity: 4");
    assert_ne!(base, version(&[("a.yaml", &a), ("b.yaml", &b2)]), "edited");
    // The version does not depend on where the directory is mounted.
    let elsewhere = compile_directory("/etc/tollgate/policy.d", &[("a.yaml", &a), ("b.yaml", &b)])
        .map(|p| p.version().to_owned())
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(base, elsewhere);
}

#[test]
fn an_empty_directory_is_refused() {
    assert!(matches!(
        compile_directory("policy.d", &[]),
        Err(Error::EmptyDirectory { .. })
    ));
    // Read from disk: only hidden or other files is the same as none.
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    write(&dir.path().join(".draft.yaml"), &limits(&["a"]));
    write(&dir.path().join("README.md"), "# policies\n");
    let err = validate(dir.path()).err().map(|e| e.to_string());
    let err = err.unwrap_or_default();
    assert!(
        err.contains("holds no policy file") && err.contains(".yaml or .yml"),
        "{err}"
    );
    assert!(PolicyEngine::from_file(dir.path(), EngineOptions::default()).is_err());
}

/// The engine reads a directory as it reads a file: a new file is a reload, a refused file
/// keeps the last good version, and a limit moved from one file to another keeps its buckets
/// (its name and parameters say which bucket it is, not its file).
#[test]
fn the_engine_reloads_a_directory_and_moves_keep_buckets() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let path = dir.path();
    write(&path.join("pay.yaml"), &limits(&["pay"]));
    let engine =
        PolicyEngine::from_file(path, EngineOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(engine.path(), Some(path));
    let user = [("user", "u1")];
    let remaining = |engine: &PolicyEngine| {
        let outcome = engine
            .decide("api", &[user], 1, None)
            .unwrap_or_else(|e| panic!("{e}"));
        outcome
            .limits
            .iter()
            .map(|l| {
                let left = l.decision.as_ref().map_or(u64::MAX, |d| d.remaining());
                (l.name.to_string(), left)
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(remaining(&engine), [("pay".to_owned(), 2)]);

    // Nothing changed: an event-driven reload reads and leaves everything as it is.
    let before = engine.current();
    assert!(
        engine
            .reload_if_changed()
            .is_ok_and(|p| std::sync::Arc::ptr_eq(&p, &before))
    );

    // The pay team's limit moves to a shared file beside a new one.
    std::fs::remove_file(path.join("pay.yaml")).unwrap_or_else(|e| panic!("{e}"));
    write(&path.join("shared.yaml"), &limits(&["pay", "search"]));
    let before = engine.current();
    let policy = engine.reload().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        policy.limit("pay").and_then(|l| l.file()),
        Some("shared.yaml")
    );
    assert_eq!(
        changed_files(&policy, &before),
        [
            ("shared.yaml".to_owned(), FileChange::Added),
            ("pay.yaml".to_owned(), FileChange::Removed)
        ]
    );
    assert_eq!(
        remaining(&engine),
        [("pay".to_owned(), 1), ("search".to_owned(), 2)],
        "the moved limit kept its bucket"
    );

    // A bad file anywhere refuses the whole directory.
    write(
        &path.join("zz.yaml"),
        "limits:\n  - {name: pay, domain: api, capacity: 1, refill: 1/s}\n",
    );
    let err = engine
        .reload()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("zz.yaml") && err.contains("duplicate limit name"),
        "{err}"
    );
    let status = engine.status();
    assert_eq!(status.version, policy.version());
    assert!(
        status
            .last_error
            .is_some_and(|(_, e)| e.contains("zz.yaml"))
    );
}

/// A file's digest is its text's: a reload says which files it changed (and the audit log's
/// `loaded` event names them), and a file left as it was is not among them.
#[test]
fn a_version_says_which_files_changed() {
    let a = limits(&["a"]);
    let b = limits(&["b"]);
    let compiled = |files: &[(&str, &str)]| {
        compile_directory("policy.d", files).unwrap_or_else(|e| panic!("{e}"))
    };
    let before = compiled(&[("a.yaml", &a), ("b.yaml", &b)]);
    let b2 = b.replace("capacity: 3", "capacity: 4");
    let after = compiled(&[("a.yaml", &a), ("b.yaml", &b2), ("c.yaml", "limits: []\n")]);
    assert_eq!(
        changed_files(&after, &before),
        [
            ("b.yaml".to_owned(), FileChange::Changed),
            ("c.yaml".to_owned(), FileChange::Added)
        ]
    );
    assert!(after.file_changes(&after).is_empty());
    assert_ne!(before.files()[1].digest(), after.files()[1].digest());
    assert_eq!(before.files()[0].digest(), after.files()[0].digest());
    // Between policies of one file there are no files to name.
    let one = compile("p.yaml", &a).unwrap_or_else(|e| panic!("{e}"));
    assert!(one.file_changes(&one).is_empty());

    // The audit log's `loaded` event names the files a reload changed.
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    write(&dir.path().join("a.yaml"), &a);
    write(&dir.path().join("b.yaml"), &b);
    let lines = Arc::new(parking_lot::Mutex::new(Vec::<u8>::new()));
    let log = AuditLog::new(
        Box::new(Sink(Arc::clone(&lines))),
        Box::new(tollgate_policy::SystemWallClock),
    );
    let options = EngineOptions::default().audit(Arc::new(log));
    let engine = PolicyEngine::from_file(dir.path(), options).unwrap_or_else(|e| panic!("{e}"));
    write(&dir.path().join("b.yaml"), &b2);
    assert!(engine.reload().is_ok());
    let text = String::from_utf8(lines.lock().clone()).unwrap_or_default();
    let loaded: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .filter(|e: &serde_json::Value| e["event"] == "loaded")
        .collect();
    assert_eq!(loaded.len(), 2, "{text}");
    assert_eq!(
        loaded[0].get("changed_files"),
        None,
        "the first load replaces nothing"
    );
    assert_eq!(loaded[1]["changed_files"], serde_json::json!(["b.yaml"]));
}

/// Audit lines, kept for reading.
struct Sink(Arc<parking_lot::Mutex<Vec<u8>>>);

impl std::io::Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The files `after` added, removed or changed since `before`, by name.
fn changed_files(
    after: &tollgate_policy::Policy,
    before: &tollgate_policy::Policy,
) -> Vec<(String, FileChange)> {
    after
        .file_changes(before)
        .into_iter()
        .map(|(name, change)| (name.to_string(), change))
        .collect()
}
