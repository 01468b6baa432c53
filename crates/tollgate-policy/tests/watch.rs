//! The watcher sees atomic renames and ConfigMap-style symlink swaps, and keeps the last good
//! version when a bad file lands. Waits are on a channel fed by the watcher, never on sleeps.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use tollgate_policy::watch::{PolicyWatcher, ReloadResult};
use tollgate_policy::{EngineOptions, PolicyEngine};

fn policy(version: &str) -> String {
    format!(
        "version: \"{version}\"\nlimits:\n  - name: a\n    domain: api\n    key: [user]\n    capacity: 1\n    refill: 1/s\n"
    )
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tollgate-watch-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    dir
}

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

/// Waits (up to 10 s) for a reload that put `version` in force, or for a refusal when
/// `version` is `None`.
fn wait_for(rx: &mpsc::Receiver<ReloadResult>, version: Option<&str>) {
    loop {
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Ok(p)) if Some(p.version()) == version => return,
            Ok(Err(_)) if version.is_none() => return,
            Ok(_) => {}
            Err(err) => panic!("no reload to {version:?}: {err}"),
        }
    }
}

fn start(
    path: &Path,
) -> (
    Arc<PolicyEngine>,
    PolicyWatcher,
    mpsc::Receiver<ReloadResult>,
) {
    let engine = PolicyEngine::from_file(path, EngineOptions::default())
        .map(Arc::new)
        .unwrap_or_else(|e| panic!("{e}"));
    let (tx, rx) = mpsc::channel();
    let watcher =
        PolicyWatcher::start_with(Arc::clone(&engine), Duration::from_millis(50), move |r| {
            let _ = tx.send(r);
        })
        .unwrap_or_else(|e| panic!("{e}"));
    (engine, watcher, rx)
}

#[test]
fn atomic_rename_and_bad_files() {
    let dir = temp_dir("rename");
    let path = dir.join("policy.yaml");
    write(&path, &policy("1"));
    let (engine, watcher, rx) = start(&path);
    assert_eq!(watcher.dir(), dir);
    assert_eq!(
        format!("{watcher:?}"),
        format!("PolicyWatcher {{ dir: {dir:?}, .. }}")
    );

    // Write elsewhere, rename over: the file watched by name is a new inode.
    let tmp = dir.join(".policy.yaml.tmp");
    write(&tmp, &policy("2"));
    std::fs::rename(&tmp, &path).unwrap_or_else(|e| panic!("{e}"));
    wait_for(&rx, Some("2"));
    assert_eq!(engine.status().version, "2");

    // A bad file is refused and 2 stays in force.
    write(&tmp, "limits: [\n");
    std::fs::rename(&tmp, &path).unwrap_or_else(|e| panic!("{e}"));
    wait_for(&rx, None);
    let status = engine.status();
    assert_eq!(status.version, "2");
    assert!(status.last_error.is_some());

    // An in-place write is seen too.
    write(&path, &policy("3"));
    wait_for(&rx, Some("3"));
    drop(watcher);
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(unix)]
#[test]
fn configmap_symlink_swap() {
    use std::os::unix::fs::symlink;
    // The layout kubelet gives a mounted ConfigMap.
    let dir = temp_dir("configmap");
    let v1 = dir.join("..2026_11_30_00_00_00.1");
    std::fs::create_dir(&v1).unwrap_or_else(|e| panic!("{e}"));
    write(&v1.join("policy.yaml"), &policy("1"));
    symlink("..2026_11_30_00_00_00.1", dir.join("..data")).unwrap_or_else(|e| panic!("{e}"));
    symlink("..data/policy.yaml", dir.join("policy.yaml")).unwrap_or_else(|e| panic!("{e}"));
    let (engine, _watcher, rx) = start(&dir.join("policy.yaml"));
    assert_eq!(engine.status().version, "1");

    // The update: a new timestamped directory, then ..data swapped to it by rename.
    let v2 = dir.join("..2026_11_30_00_01_00.2");
    std::fs::create_dir(&v2).unwrap_or_else(|e| panic!("{e}"));
    write(&v2.join("policy.yaml"), &policy("2"));
    symlink("..2026_11_30_00_01_00.2", dir.join("..data_tmp")).unwrap_or_else(|e| panic!("{e}"));
    std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap_or_else(|e| panic!("{e}"));
    let _ = std::fs::remove_dir_all(&v1);
    wait_for(&rx, Some("2"));
    assert_eq!(engine.status().version, "2");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn rollback_survives_an_unrelated_event_in_the_directory() {
    let dir = temp_dir("rollback");
    let path = dir.join("policy.yaml");
    write(&path, &policy("1"));
    let (engine, watcher, rx) = start(&path);
    write(&path, &policy("2"));
    wait_for(&rx, Some("2"));
    // Version 2 is bad in production: the operator rolls back.
    assert!(engine.rollback().is_ok_and(|p| p.version() == "1"));
    // Something unrelated is written next to the policy (an editor swap file, another config).
    write(&dir.join("notes.txt"), "hello");
    // Until the watcher answers with version 1 (a late event of the earlier write may come
    // first), version 1 must stay in force.
    loop {
        let reloaded = rx
            .recv_timeout(Duration::from_secs(10))
            .map(|r| r.map(|p| p.version().to_owned()).map_err(|e| e.to_string()));
        assert_eq!(
            engine.status().version,
            "1",
            "the rollback was undone by an unrelated file event: {reloaded:?}"
        );
        match reloaded {
            Ok(Ok(version)) if version == "1" => break,
            Ok(_) => {}
            Err(err) => panic!("no answer from the watcher: {err}"),
        }
    }
    // An explicit reload (POST /v1/policy/reload) still puts the file back in force, and a
    // real change of the file is still seen.
    assert!(engine.reload().is_ok_and(|p| p.version() == "2"));
    write(&path, &policy("3"));
    wait_for(&rx, Some("3"));
    drop(watcher);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_refused_file_is_not_retried_on_unrelated_events() {
    let dir = temp_dir("refused");
    let path = dir.join("policy.yaml");
    write(&path, &policy("1"));
    let (engine, watcher, rx) = start(&path);
    write(&path, "limits: [\n");
    wait_for(&rx, None);
    let refused_at = engine.status().last_error;
    assert!(refused_at.is_some());
    write(&dir.join("notes.txt"), "hello");
    // Nothing new was read: the version in force is reported, the refusal is not repeated.
    let reloaded = rx
        .recv_timeout(Duration::from_secs(10))
        .map(|r| r.map(|p| p.version().to_owned()).map_err(|e| e.to_string()));
    assert_eq!(
        reloaded,
        Ok(Ok("1".to_owned())),
        "the refused file was read again"
    );
    assert_eq!(engine.status().last_error, refused_at);
    drop(watcher);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A policy directory reloads as a whole when a file is added, changed or removed; a bad file
/// anywhere in it is refused and the last good version stays.
#[test]
fn a_policy_directory_reloads_on_any_of_its_files() {
    let dir = temp_dir("directory");
    let team = |name: &str| {
        format!(
            "limits:\n  - {{name: {name}, domain: api, key: [user], capacity: 1, refill: 1/s}}\n"
        )
    };
    write(&dir.join("payments.yaml"), &team("pay"));
    write(&dir.join("search.yaml"), &team("search"));
    let (engine, watcher, rx) = start(&dir);
    assert_eq!(watcher.dir(), dir);
    let names = |engine: &PolicyEngine| -> Vec<String> {
        let current = engine.current();
        current
            .limits()
            .iter()
            .map(|l| l.name().to_owned())
            .collect()
    };
    assert_eq!(names(&engine), ["pay", "search"]);
    let wait_for_limits = |expected: &[&str]| {
        loop {
            match rx.recv_timeout(Duration::from_secs(10)) {
                Ok(Ok(p))
                    if p.limits()
                        .iter()
                        .map(|l| l.name())
                        .eq(expected.iter().copied()) =>
                {
                    return;
                }
                Ok(_) => {}
                Err(err) => panic!("no reload to {expected:?}: {err}"),
            }
        }
    };

    // A new team's file, written aside and renamed in as deploy tools do.
    let tmp = dir.join(".checkout.yaml.tmp");
    write(&tmp, &team("checkout"));
    std::fs::rename(&tmp, dir.join("checkout.yaml")).unwrap_or_else(|e| panic!("{e}"));
    wait_for_limits(&["checkout", "pay", "search"]);

    // A bad file refuses the whole directory: its limits are not silently dropped.
    write(&dir.join("search.yaml"), "limits: [\n");
    wait_for(&rx, None);
    assert_eq!(names(&engine), ["checkout", "pay", "search"]);
    assert!(engine.status().last_error.is_some());

    // Removing the bad file is a change like any other.
    std::fs::remove_file(dir.join("search.yaml")).unwrap_or_else(|e| panic!("{e}"));
    wait_for_limits(&["checkout", "pay"]);
    drop(watcher);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A ConfigMap of several keys mounted as a directory: each file is a link through `..data`,
/// and an update swaps `..data` alone, changing every file at once.
#[cfg(unix)]
#[test]
fn configmap_directory_swap() {
    use std::os::unix::fs::symlink;
    let dir = temp_dir("configmap-directory");
    let mount = |stamp: &str, files: &[(&str, &str)]| {
        let real = dir.join(stamp);
        std::fs::create_dir(&real).unwrap_or_else(|e| panic!("{e}"));
        for (name, text) in files {
            write(&real.join(name), text);
        }
        symlink(stamp, dir.join("..data_tmp")).unwrap_or_else(|e| panic!("{e}"));
        std::fs::rename(dir.join("..data_tmp"), dir.join("..data"))
            .unwrap_or_else(|e| panic!("{e}"));
    };
    let limit = |name: &str| {
        format!("limits:\n  - {{name: {name}, domain: api, capacity: 1, refill: 1/s}}\n")
    };
    mount(
        "..2026_12_07_00_00_00.1",
        &[
            ("a.yaml", &limit("a")),
            ("version.yaml", "version: \"1\"\nlimits: []\n"),
        ],
    );
    for name in ["a.yaml", "version.yaml"] {
        symlink(format!("..data/{name}"), dir.join(name)).unwrap_or_else(|e| panic!("{e}"));
    }
    let (engine, _watcher, rx) = start(&dir);
    assert_eq!(engine.status().version, "1");
    assert_eq!(
        engine.current().files().len(),
        2,
        "..data is not a policy file"
    );

    mount(
        "..2026_12_07_00_01_00.2",
        &[
            ("a.yaml", &limit("a2")),
            ("version.yaml", "version: \"2\"\nlimits: []\n"),
        ],
    );
    wait_for(&rx, Some("2"));
    assert!(engine.current().limit("a2").is_some());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Releases deployed side by side and a `current` link swapped from one to the next: the
/// swap is seen, and from then on an edit inside the new release.
#[cfg(unix)]
#[test]
fn a_linked_policy_directory_reloads_when_the_link_is_swapped() {
    use std::os::unix::fs::symlink;
    let dir = temp_dir("linked-directory");
    let release = |name: &str, version: &str| {
        let path = dir.join(name);
        std::fs::create_dir(&path).unwrap_or_else(|e| panic!("{e}"));
        write(&path.join("policy.yaml"), &policy(version));
    };
    release("r1", "1");
    release("r2", "2");
    symlink("r1", dir.join("current")).unwrap_or_else(|e| panic!("{e}"));
    let (engine, _watcher, rx) = start(&dir.join("current"));
    assert_eq!(engine.status().version, "1");
    // The deploy tools' swap: a new link renamed over the old one.
    symlink("r2", dir.join("current.tmp")).unwrap_or_else(|e| panic!("{e}"));
    std::fs::rename(dir.join("current.tmp"), dir.join("current")).unwrap_or_else(|e| panic!("{e}"));
    wait_for(&rx, Some("2"));
    assert_eq!(engine.status().version, "2");
    // Edited in place, as a hotfix would be: the watch moved to r2 with the link.
    write(&dir.join("r2/policy.yaml"), &policy("3"));
    wait_for(&rx, Some("3"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A policy file linked from where the server reads it to where it is kept: an edit where it
/// is kept is seen, and so is the link moved to another file.
#[cfg(unix)]
#[test]
fn a_linked_policy_file_reloads_when_its_target_is_edited() {
    use std::os::unix::fs::symlink;
    let dir = temp_dir("linked-file");
    for sub in ["etc", "srv"] {
        std::fs::create_dir(dir.join(sub)).unwrap_or_else(|e| panic!("{e}"));
    }
    write(&dir.join("srv/prod.yaml"), &policy("1"));
    write(&dir.join("srv/next.yaml"), &policy("3"));
    let path = dir.join("etc/policy.yaml");
    symlink("../srv/prod.yaml", &path).unwrap_or_else(|e| panic!("{e}"));
    let (engine, _watcher, rx) = start(&path);
    assert_eq!(engine.status().version, "1");
    write(&dir.join("srv/prod.yaml"), &policy("2"));
    wait_for(&rx, Some("2"));
    symlink("../srv/next.yaml", dir.join("etc/.policy.yaml.tmp")).unwrap_or_else(|e| panic!("{e}"));
    std::fs::rename(dir.join("etc/.policy.yaml.tmp"), &path).unwrap_or_else(|e| panic!("{e}"));
    wait_for(&rx, Some("3"));
    let _ = std::fs::remove_dir_all(&dir);
}
