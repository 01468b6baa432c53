//! The systemd unit shipped in `deploy/systemd` stays true to the binary: systemd accepts it,
//! its commands start, reload and drain the server as its comments say, the settings its
//! environment file offers are real ones, and everything the server does (deciding over HTTP
//! and gRPC, on memory and on Redis, reloading, writing its audit log, draining) passes the
//! unit's system call filter, which would otherwise answer a call outside it with EPERM.
//!
//! The logrotate file beside it rotates the audit log the unit's settings write, with nothing
//! lost. systemd's own tools judge the unit (`systemd-analyze`), logrotate runs its file, and
//! strace records the server's system calls; `.ci/run` installs them when missing. A machine without them fails these tests
//! with what to install, as one without `redis-server` fails the Redis tests.

mod support;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use support::{Scratch, Server, binary, post_json, request, run, seconds, wait_for};
use tollgate_redis::test_server::{RedisServer, TestCertificates};

/// Where the unit installs the binary and its files.
const INSTALLED_BINARY: &str = "/usr/local/bin/tollgate";
const INSTALLED_POLICY: &str = "/etc/tollgate/policy.yaml";
const INSTALLED_AUDIT_LOG: &str = "/var/log/tollgate/audit.jsonl";

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/systemd")
}

fn unit() -> String {
    std::fs::read_to_string(deploy().join("tollgate.service")).expect("tollgate.service")
}

/// The values of `key=` in the unit, in order (a key may be given more than once).
fn directive(unit: &str, key: &str) -> Vec<String> {
    unit.lines()
        .filter_map(|line| line.strip_prefix(key)?.strip_prefix('='))
        .map(str::to_owned)
        .collect()
}

/// The one value of `key=`.
fn single(unit: &str, key: &str) -> String {
    let values = directive(unit, key);
    assert_eq!(values.len(), 1, "{key}: {values:?}");
    values.into_iter().next().unwrap_or_default()
}

/// Runs one of systemd's or strace's tools, failing with what to install when it is missing.
fn tool(program: &str, args: &[&str], package: &str) -> Output {
    Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|err| {
            panic!(
                "cannot run {program} ({err}): the systemd unit's tests need it on PATH \
                 (Debian: apt-get install -y {package})"
            )
        })
}

/// Waits on the real server, which runs on real time: there is no clock to advance here.
#[allow(clippy::disallowed_methods)]
fn pause(duration: Duration) {
    std::thread::sleep(duration);
}

#[test]
fn systemd_accepts_the_unit() {
    let unit = unit();
    assert!(unit.contains(INSTALLED_BINARY));
    // verify checks that ExecStart's program exists: this build's stands in for the installed.
    let scratch = Scratch::new("unit-verify");
    let path = scratch.write(
        "tollgate.service",
        &unit.replace(INSTALLED_BINARY, binary()),
    );
    let output = tool(
        "systemd-analyze",
        &["verify", path.to_str().expect("a UTF-8 path")],
        "systemd",
    );
    let complaints = String::from_utf8_lossy(&output.stderr);
    // A misspelt or unknown setting is only a warning to systemd, and is ignored: here it fails.
    assert!(
        output.status.success() && complaints.trim().is_empty(),
        "systemd-analyze verify: {complaints}"
    );
}

/// The environment file's settings, each uncommented: (name, value).
fn offered_settings() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(deploy().join("tollgate.env")).expect("tollgate.env");
    text.lines()
        .filter_map(|line| line.strip_prefix('#'))
        .filter_map(|line| line.split_once('='))
        .filter(|(name, _)| name.starts_with("TOLLGATE_"))
        .map(|(name, value)| (name.to_owned(), value.to_owned()))
        .collect()
}

#[test]
fn the_environment_file_offers_real_settings() {
    let (status, help, _) = run(&["serve", "--help"]);
    assert!(status.success());
    let mut known: BTreeSet<&str> = help
        .split("[env: ")
        .skip(1)
        .filter_map(|rest| {
            // `[env: NAME=]`, or `[env: NAME]` where the value is a secret.
            rest.split(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
                .next()
        })
        .collect();
    // The log filter, read by the logger rather than a flag.
    known.insert("TOLLGATE_LOG");
    let offered = offered_settings();
    assert!(offered.len() >= 5, "{offered:?}");
    for (name, _) in &offered {
        assert!(
            known.contains(name.as_str()),
            "{name} is no setting of tollgate serve"
        );
    }
    // The time out of rotation, then the requests in flight drained, before systemd kills
    // what is left.
    let stop = seconds(&single(&unit(), "TimeoutStopSec"));
    let offered_seconds = |setting: &str, default: u64| {
        offered
            .iter()
            .find(|(name, _)| name == setting)
            .map_or(default, |(_, value)| seconds(value))
    };
    let drain = offered_seconds("TOLLGATE_DRAIN_TIMEOUT", 10);
    let delay = offered_seconds("TOLLGATE_SHUTDOWN_DELAY", 0);
    assert!(
        delay + drain < stop,
        "delay {delay} s and drain {drain} s, TimeoutStopSec {stop} s"
    );
}

/// A server started as the unit starts it, with every setting of the environment file given
/// (addresses on loopback, files in `scratch`, the memory store), on `policy`; run by
/// `wrapper` (a program and its arguments, such as strace's) when not empty.
fn as_the_unit_starts_it(scratch: &Scratch, policy: &Path, wrapper: &[&str]) -> Command {
    let unit = unit();
    let exec = single(&unit, "ExecStart");
    let mut words = exec.split_whitespace();
    assert_eq!(words.next(), Some(INSTALLED_BINARY), "{exec}");
    let args: Vec<String> = words
        .map(|word| match word {
            INSTALLED_POLICY => policy.to_str().expect("a UTF-8 path").to_owned(),
            other => other.to_owned(),
        })
        .collect();
    let mut command = match wrapper.split_first() {
        Some((program, rest)) => {
            let mut command = Command::new(program);
            command.args(rest).arg(binary());
            command
        }
        None => Command::new(binary()),
    };
    command.args(&args);
    let audit = scratch.0.join("audit.jsonl");
    let certificates = TestCertificates::generate("unit-traces");
    for (name, value) in offered_settings() {
        let value = match name.as_str() {
            "TOLLGATE_HTTP" | "TOLLGATE_GRPC" => "127.0.0.1:0".to_owned(),
            "TOLLGATE_STORE" => "memory".to_owned(),
            "TOLLGATE_AUDIT_LOG" => {
                // The one place the sandbox lets the process write.
                let logs = format!("/var/log/{}/", single(&unit, "LogsDirectory"));
                assert!(value.starts_with(&logs), "{value} outside {logs}");
                assert_eq!(value, INSTALLED_AUDIT_LOG);
                audit.to_str().expect("a UTF-8 path").to_owned()
            }
            "TOLLGATE_LOG" => "warn".to_owned(),
            // A port nothing listens on (taken, then let go), rather than whatever may
            // listen on the collector's usual port here: spans go nowhere, the way there is
            // still taken (and at the stop, the last batch tried).
            // Over TLS, as the file's trust and client certificate settings ask.
            "TOLLGATE_TRACE_ENDPOINT" => {
                let free = std::net::TcpListener::bind("127.0.0.1:0")
                    .and_then(|listener| listener.local_addr())
                    .expect("a free port");
                format!("https://{free}")
            }
            "TOLLGATE_TRACE_TLS_CA" => tls_file(scratch, &certificates.ca),
            "TOLLGATE_TRACE_TLS_CERT" => tls_file(scratch, &certificates.client_cert),
            "TOLLGATE_TRACE_TLS_KEY" => tls_file(scratch, &certificates.client_key),
            _ => value,
        };
        command.env(name, value);
    }
    command
}

/// A copy of the PEM file `from` in `scratch`, which outlives the certificates' own directory:
/// its path.
fn tls_file(scratch: &Scratch, from: &Path) -> String {
    let name = from.file_name().expect("a file name");
    let to = scratch.0.join(name);
    std::fs::copy(from, &to).expect("copy a PEM file");
    to.to_str().expect("a UTF-8 path").to_owned()
}

const POLICY: &str = "version: first\nlimits: [{name: per-user, domain: api, key: [user], capacity: 5, refill: 1/s}]\n";
const NEXT_POLICY: &str = "version: second\nlimits: [{name: per-user, domain: api, key: [user], capacity: 9, refill: 1/s}]\n";

/// The admin token the environment file sets, as a header.
fn admin_authorization() -> String {
    let token = offered_settings()
        .into_iter()
        .find(|(name, _)| name == "TOLLGATE_ADMIN_TOKEN")
        .map(|(_, token)| token)
        .unwrap_or_default();
    format!("Bearer {token}")
}

fn policy_version(server: &Server) -> String {
    let authorization = admin_authorization();
    let headers = [("authorization", authorization.as_str())];
    let answer = request(server.http, "GET", "/v1/policy", &headers, "");
    assert_eq!(answer.status, 200, "{}", answer.body);
    answer.json()["version"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// Waits until the server reports policy `version`, for up to 10 s.
fn wait_for_version(server: &Server, version: &str) {
    wait_for(&format!("policy {version} in force"), || {
        (policy_version(server) == version).then_some(())
    });
}

/// Sends `signal` (`HUP`, `TERM`) to process `pid`.
fn signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{signal} {pid}");
}

/// The signal `ExecReload=/bin/kill -HUP $MAINPID` sends, and the one systemd stops with.
fn unit_signals() -> (String, String) {
    let unit = unit();
    let reload = single(&unit, "ExecReload");
    let words: Vec<&str> = reload.split_whitespace().collect();
    assert!(
        matches!(words.as_slice(), [kill, _, "$MAINPID"] if kill.ends_with("/kill")),
        "{reload}"
    );
    let reload = words[1].trim_start_matches('-').to_owned();
    let stop = single(&unit, "KillSignal");
    (reload, stop.trim_start_matches("SIG").to_owned())
}

#[test]
fn the_units_commands_start_reload_and_stop_the_server() {
    let scratch = Scratch::new("unit-commands");
    let policy = scratch.write("policy.yaml", POLICY);
    let server = Server::start_command(as_the_unit_starts_it(&scratch, &policy, &[]));
    assert_eq!(request(server.http, "GET", "/readyz", &[], "").status, 200);
    assert_eq!(policy_version(&server), "first");
    let (reload, stop) = unit_signals();
    // `systemctl reload`: the process lives on, on the policy it reads again.
    signal(server.pid(), &reload);
    pause(Duration::from_millis(300));
    let check = r#"{"domain":"api","descriptors":[{"user":"u1"}]}"#;
    assert_eq!(post_json(server.http, "/v1/check", check).status, 200);
    assert_eq!(policy_version(&server), "first");
    let audit = std::fs::read_to_string(scratch.0.join("audit.jsonl")).unwrap_or_default();
    assert!(
        !audit.is_empty(),
        "the audit log, where the unit's settings put it"
    );
    // `systemctl stop`: drained and gone, with success, well inside TimeoutStopSec.
    signal(server.pid(), &stop);
    let limit = Duration::from_secs(seconds(&single(&unit(), "TimeoutStopSec")));
    let status = server
        .wait_within(limit)
        .expect("stopped before TimeoutStopSec");
    assert!(status.success(), "{status:?}");
}

/// The shipped logrotate file, run by logrotate itself on a server started as the unit starts
/// it (its paths moved to `scratch`, `systemctl reload` done as systemd does it: the
/// ExecReload signal): the lines written before the rotation stay in the rotated file, and
/// those after go to a new file at the log's path.
#[test]
fn logrotate_rotates_the_audit_log_without_losing_a_line() {
    let scratch = Scratch::new("unit-logrotate");
    let policy = scratch.write("policy.yaml", POLICY);
    let server = Server::start_command(as_the_unit_starts_it(&scratch, &policy, &[]));
    let audit = scratch.0.join("audit.jsonl");
    let before = std::fs::read_to_string(&audit).expect("the audit log");
    assert!(before.contains("\"version\":\"first\""), "{before}");

    let shipped = std::fs::read_to_string(deploy().join("../logrotate/tollgate"))
        .expect("deploy/logrotate/tollgate");
    let reload = "systemctl reload tollgate.service";
    assert!(shipped.contains(INSTALLED_AUDIT_LOG) && shipped.contains(reload));
    let (signal_name, _) = unit_signals();
    let config = shipped
        .replace(INSTALLED_AUDIT_LOG, audit.to_str().expect("a UTF-8 path"))
        .replace(reload, &format!("kill -{signal_name} {}", server.pid()));
    let config = scratch.write("logrotate.conf", &config);
    let state = scratch.0.join("logrotate.state");
    let output = tool(
        "logrotate",
        &[
            "--force",
            "--state",
            state.to_str().expect("a UTF-8 path"),
            config.to_str().expect("a UTF-8 path"),
        ],
        "logrotate",
    );
    assert!(
        output.status.success(),
        "logrotate: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    // delaycompress: the newest rotated file stays as it is, for a server still writing.
    let rotated = std::fs::read_to_string(scratch.0.join("audit.jsonl.1")).expect("rotated");
    assert_eq!(rotated, before);

    // The server opens the file again when the signal reaches it: a new, empty file.
    wait_for("a new audit log after the rotation", || {
        audit.exists().then_some(())
    });
    // A policy change after the rotation is recorded in the new file.
    std::fs::write(&policy, NEXT_POLICY).expect("change the policy");
    wait_for_version(&server, "second");
    let after = std::fs::read_to_string(&audit).expect("a new audit log at its path");
    assert!(after.contains("\"version\":\"second\""), "{after}");
    let rotated = std::fs::read_to_string(scratch.0.join("audit.jsonl.1")).expect("rotated");
    assert!(!rotated.contains("second"), "{rotated}");
}

/// The system calls each `tool` set of `systemd-analyze syscall-filter` names, its nested
/// sets expanded.
fn syscall_sets() -> HashMap<String, Vec<String>> {
    let output = tool("systemd-analyze", &["syscall-filter"], "systemd");
    assert!(output.status.success());
    let mut sets: HashMap<String, Vec<String>> = HashMap::new();
    let mut current = None;
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        if line.starts_with('@') {
            current = Some(line.trim().to_owned());
            continue;
        }
        let entry = line.trim();
        if let Some(set) = &current
            && !entry.is_empty()
            && !entry.starts_with('#')
        {
            sets.entry(set.clone()).or_default().push(entry.to_owned());
        }
    }
    sets
}

fn expand(sets: &HashMap<String, Vec<String>>, name: &str, into: &mut BTreeSet<String>) {
    if !name.starts_with('@') {
        into.insert(name.to_owned());
        return;
    }
    let members = sets
        .get(name)
        .unwrap_or_else(|| panic!("systemd knows no set {name}"));
    for member in members {
        expand(sets, member, into);
    }
}

/// What the unit's `SystemCallFilter=` lines let through: systemd's `@default` (always), the
/// allowed sets, less the denied (`~`) ones, in order.
fn allowed_syscalls() -> BTreeSet<String> {
    let sets = syscall_sets();
    let mut allowed = BTreeSet::new();
    expand(&sets, "@default", &mut allowed);
    for filter in directive(&unit(), "SystemCallFilter") {
        let (deny, names) = match filter.strip_prefix('~') {
            Some(names) => (true, names),
            None => (false, filter.as_str()),
        };
        let mut named = BTreeSet::new();
        for name in names.split_whitespace() {
            expand(&sets, name, &mut named);
        }
        if deny {
            allowed.retain(|call| !named.contains(call));
        } else {
            allowed.extend(named);
        }
    }
    allowed
}

/// The system calls an strace log (`-f`, one call per line, `PID name(args) = result`) holds.
fn syscalls_in(trace: &str) -> BTreeSet<String> {
    trace
        .lines()
        .filter_map(|line| {
            let (_pid, call) = line.split_once(char::is_whitespace)?;
            let call = call.trim_start();
            let name = &call[..call.find('(')?];
            let is_name = !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
            is_name.then(|| name.to_owned())
        })
        .collect()
}

/// The tollgate process strace started, by the children file of strace's main thread.
fn traced_child(strace: u32) -> u32 {
    wait_for("the process strace starts", || {
        let children = std::fs::read_to_string(format!("/proc/{strace}/task/{strace}/children"))
            .unwrap_or_default();
        children.split_whitespace().next()?.parse().ok()
    })
}

/// Kills the traced server if the test ends early: killing strace alone would leave it running.
struct KillOnDrop(u32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        // Gone already when the test got as far as the drain.
        let _ = Command::new("kill")
            .args(["-KILL", &self.0.to_string()])
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// Runs a server as the unit does, under strace, through a working life: HTTP and gRPC
/// decisions, forward-auth, metrics, a policy changed on disk and reloaded, SIGHUP, the drain;
/// then holds every system call it made to the unit's filter.
fn holds_to_the_filter(store: Option<&str>) {
    let allowed = allowed_syscalls();
    assert!(allowed.contains("epoll_wait") && !allowed.contains("reboot"));
    let scratch = Scratch::new("unit-syscalls");
    let policy = scratch.write("policy.yaml", POLICY);
    let trace = scratch.0.join("trace");
    let trace_arg = trace.to_str().expect("a UTF-8 path");
    tool("strace", &["-V"], "strace");
    let mut command =
        as_the_unit_starts_it(&scratch, &policy, &["strace", "-f", "-qq", "-o", trace_arg]);
    if let Some(url) = store {
        // strace stops every thread at every system call, and the test suite runs beside it:
        // a Redis call can take longer than the default 20 ms here, and a check would fail
        // closed (503). What is held to the filter is the calls made, not their speed.
        command
            .env("TOLLGATE_STORE", url)
            .env("TOLLGATE_STORE_TIMEOUT", "2s");
    }
    let server = Server::start_command(command);
    let pid = traced_child(server.pid());
    let _guard = KillOnDrop(pid);

    let check = r#"{"domain":"api","descriptors":[{"user":"u1"}]}"#;
    assert_eq!(post_json(server.http, "/v1/check", check).status, 200);
    assert_eq!(post_json(server.http, "/v1/explain", check).status, 200);
    for path in ["/metrics", "/healthz", "/readyz", "/v1/forward-auth/api"] {
        let answer = request(server.http, "GET", path, &[("x-tollgate-user", "u2")], "");
        assert_eq!(answer.status, 200, "{path}: {}", answer.body);
    }
    let grpc = server.grpc.to_string();
    let http = format!("http://{}", server.http);
    for target in [["--grpc", &grpc], ["--target", &http]] {
        let (status, _, stderr) = run(&["bench", target[0], target[1], "-n", "200", "-c", "4"]);
        assert!(status.success(), "bench {target:?}: {stderr}");
    }
    std::fs::write(&policy, NEXT_POLICY).expect("change the policy");
    wait_for_version(&server, "second");
    let (reload, stop) = unit_signals();
    signal(pid, &reload);
    pause(Duration::from_millis(300));
    assert_eq!(post_json(server.http, "/v1/check", check).status, 200);
    signal(pid, &stop);
    let status = server
        .wait_within(Duration::from_secs(30))
        .expect("drained");
    assert!(status.success(), "{status:?}");

    let made = syscalls_in(&std::fs::read_to_string(&trace).expect("the trace"));
    assert!(
        made.contains("accept4") && made.contains("inotify_add_watch"),
        "{made:?}"
    );
    let refused: Vec<&String> = made.difference(&allowed).collect();
    assert!(
        refused.is_empty(),
        "system calls the unit's SystemCallFilter refuses: {refused:?}"
    );
}

#[test]
fn the_server_on_memory_makes_only_system_calls_the_unit_allows() {
    holds_to_the_filter(None);
}

#[test]
fn the_server_on_redis_makes_only_system_calls_the_unit_allows() {
    let redis = RedisServer::start();
    holds_to_the_filter(Some(&redis.url()));
}
