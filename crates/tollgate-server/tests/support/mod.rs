//! The real `tollgate` binary, started by the tests on free loopback ports and killed when
//! dropped, and a minimal blocking HTTP/1.1 client to talk to it.

#![allow(dead_code, unreachable_pub)]

pub mod browser;
pub mod http2;
pub mod nginx;
pub mod rlqs;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// A `tollgate serve` process.
pub struct Server {
    child: Option<Child>,
    pub http: SocketAddr,
    pub grpc: SocketAddr,
    /// The server's `listening ...` line.
    pub listening: String,
    /// Everything it printed before that line: the demo policy, the addresses, the example.
    pub banner: String,
}

/// A scratch directory removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    /// A directory of its own, even for tests of one binary that run at once under one
    /// name: one test's drop must not remove another's policy file while its server starts.
    pub fn new(name: &str) -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("tollgate-e2e-{}-{n}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create a scratch directory");
        Self(dir)
    }

    pub fn write(&self, file: &str, text: &str) -> PathBuf {
        let path = self.0.join(file);
        std::fs::write(&path, text).expect("write a scratch file");
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn binary() -> &'static str {
    env!("CARGO_BIN_EXE_tollgate")
}

impl Server {
    /// Starts `tollgate serve ARGS --http 127.0.0.1:0 --grpc 127.0.0.1:0` and waits for its
    /// `listening` line.
    pub fn start(args: &[&str]) -> Self {
        Self::start_on("127.0.0.1:0", args)
    }

    /// As [`Server::start`], with HTTP on `http` (such as `[::]:0`, dual-stack).
    pub fn start_on(http: &str, args: &[&str]) -> Self {
        let mut command = Command::new(binary());
        command
            .arg("serve")
            .args(["--http", http, "--grpc", "127.0.0.1:0"])
            .args(args);
        Self::spawn(command, None)
    }

    /// As [`Server::start`], from a shell that first runs `setup` (such as `ulimit -Sn 256`),
    /// then execs the server in its own place (same process id).
    pub fn start_after(setup: &str, args: &[&str]) -> Self {
        Self::spawn(Self::after(setup, args), None)
    }

    /// As [`Server::start_after`], logging at `filter` to a pipe the caller reads.
    pub fn start_after_logging(setup: &str, args: &[&str], filter: &str) -> (Self, ChildStderr) {
        Self::spawn(Self::after(setup, args), Some(filter)).with_logs()
    }

    /// `tollgate serve ARGS` from a shell that first runs `setup`.
    fn after(setup: &str, args: &[&str]) -> Command {
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(format!("{setup} && exec \"$0\" \"$@\""))
            .arg(binary())
            .args(["serve", "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"])
            .args(args);
        command
    }

    /// As [`Server::start`], logging at `filter` (`TOLLGATE_LOG`) to a pipe the caller reads.
    pub fn start_logging(args: &[&str], filter: &str) -> (Self, ChildStderr) {
        let mut command = Command::new(binary());
        command
            .arg("serve")
            .args(["--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"])
            .args(args);
        Self::spawn(command, Some(filter)).with_logs()
    }

    /// This server, and the pipe its logs go to.
    fn with_logs(mut self) -> (Self, ChildStderr) {
        let stderr = self
            .child
            .as_mut()
            .and_then(|child| child.stderr.take())
            .expect("piped stderr");
        (self, stderr)
    }

    /// Runs `command`, a `tollgate serve` with addresses of its own (or a program that runs
    /// one, as strace does), and waits for its `listening` line.
    pub fn start_command(command: Command) -> Self {
        Self::spawn(command, None)
    }

    /// Runs `command` (a `tollgate serve`) and waits for its `listening` line. Its logs go to
    /// the tests' stderr at `warn`, or to a pipe at `log` when given.
    fn spawn(mut command: Command, log: Option<&str>) -> Self {
        let mut child = command
            .env("TOLLGATE_LOG", log.unwrap_or("warn"))
            .stdout(Stdio::piped())
            .stderr(if log.is_some() {
                Stdio::piped()
            } else {
                Stdio::inherit()
            })
            .spawn()
            .expect("start the tollgate binary");
        let stdout = child.stdout.take().expect("piped stdout");
        let (http, grpc, listening, banner) = match wait_for_listening(stdout) {
            Some(addresses) => addresses,
            None => {
                let _ = child.kill();
                let status = child.wait().ok();
                panic!("tollgate serve did not start (exit {status:?})");
            }
        };
        Self {
            child: Some(child),
            http,
            grpc,
            listening,
            banner,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Sends it `signal` (`TERM`, `HUP`...) without waiting for anything.
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &self.pid().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal}");
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn terminate(mut self) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        let status = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
        child.wait().expect("wait for tollgate")
    }

    /// Stops a server started with [`start_logging`](Self::start_logging) by SIGTERM, asserts
    /// that it exited cleanly, and returns all it logged.
    pub fn terminate_and_read(self, mut logs: ChildStderr) -> String {
        let status = self.terminate();
        assert!(status.success(), "{status:?}");
        let mut text = String::new();
        logs.read_to_string(&mut text).expect("read the logs");
        text
    }

    /// Sends SIGTERM and waits up to `limit` for the exit status; `None` (and the process
    /// killed) if it did not stop by then.
    pub fn terminate_within(self, limit: std::time::Duration) -> Option<ExitStatus> {
        let status = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
        self.wait_within(limit)
    }

    /// Waits up to `limit` for the process to exit of itself; `None` (and the process killed)
    /// if it did not by then.
    pub fn wait_within(mut self, limit: std::time::Duration) -> Option<ExitStatus> {
        let mut child = self.child.take().expect("running");
        let pid = child.id().to_string();
        let (exited, exit) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn(move || {
            let _ = exited.send(child.wait().expect("wait for tollgate"));
        });
        let status = exit.recv_timeout(limit).ok();
        if status.is_none() {
            let _ = Command::new("kill").args(["-KILL", &pid]).status();
        }
        let _ = waiter.join();
        status
    }

    /// A gRPC channel to the server's gRPC port, connected.
    pub async fn grpc_channel(&self) -> tonic::transport::Channel {
        tonic::transport::Endpoint::from_shared(format!("http://{}", self.grpc))
            .expect("a valid URI")
            .connect()
            .await
            .expect("connect to the gRPC port")
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.http)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Reads stdout on a thread (it must keep being drained) until the `listening` line.
/// Reads the server's stdout until its `listening` line: (HTTP address, gRPC address, that
/// line, the lines before it).
fn wait_for_listening(stdout: ChildStdout) -> Option<(SocketAddr, SocketAddr, String, String)> {
    let (found, wait) = mpsc::channel();
    std::thread::spawn(move || {
        let mut sent = false;
        let mut banner = String::new();
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if !sent && !line.starts_with("listening ") {
                banner.push_str(&line);
                banner.push('\n');
            }
            if !sent && let Some(rest) = line.strip_prefix("listening ") {
                let mut http = None;
                let mut grpc = None;
                for part in rest.split_whitespace() {
                    if let Some(addr) = part.strip_prefix("http=") {
                        http = addr.parse().ok();
                    }
                    if let Some(addr) = part.strip_prefix("grpc=") {
                        grpc = addr.parse().ok();
                    }
                }
                let banner = std::mem::take(&mut banner);
                let _ = found.send(
                    http.zip(grpc)
                        .map(|(http, grpc)| (http, grpc, line.clone(), banner)),
                );
                sent = true;
            }
        }
        if !sent {
            let _ = found.send(None);
        }
    });
    wait.recv_timeout(Duration::from_secs(30)).ok().flatten()
}

/// Asserts that `tollgate serve FLAG VALUE` refuses to start, naming the flag and `reason`,
/// for each `(flag, value, reason)`.
pub fn assert_serve_flags_refused(cases: &[(&str, &str, &str)]) {
    for &(flag, value, reason) in cases {
        let (status, _, stderr) = run(&["serve", flag, value]);
        assert!(!status.success(), "{flag} {value} accepted");
        assert!(
            stderr.contains(flag) && stderr.contains(reason),
            "{flag} {value}: {stderr}"
        );
    }
}

/// Runs `tollgate ARGS` to completion: (status, stdout, stderr).
pub fn run(args: &[&str]) -> (ExitStatus, String, String) {
    let output = Command::new(binary())
        .args(args)
        .env("TOLLGATE_LOG", "warn")
        .output()
        .expect("run the tollgate binary");
    (
        output.status,
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Runs `tollgate serve ARGS` on free ports, expecting it to refuse to start as a start-up
/// error should: a non-zero exit and one line on stderr, which is returned. A server that
/// starts instead is killed after 10 s and fails the test, rather than hanging it.
pub fn serve_refused(args: &[&str]) -> String {
    serve_refused_with_env(args, &[])
}

/// As [`serve_refused`], with environment variables `env` set.
pub fn serve_refused_with_env(args: &[&str], env: &[(&str, &str)]) -> String {
    let child = Command::new(binary())
        .args(["serve", "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"])
        .args(args)
        .env("TOLLGATE_LOG", "warn")
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the tollgate binary");
    let pid = child.id();
    let (done, outcome) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(child.wait_with_output());
    });
    let Ok(output) = outcome.recv_timeout(Duration::from_secs(10)) else {
        let _ = Command::new("kill").arg(pid.to_string()).status();
        panic!("tollgate serve {args:?} started instead of refusing to");
    };
    let output = output.expect("wait for the tollgate binary");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!output.status.success(), "tollgate serve {args:?} exited 0");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    stderr
}

/// An HTTP answer.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: HashMap<String, String>,
    pub body: String,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|err| panic!("not JSON ({err}): {}", self.body))
    }
}

/// One HTTP/1.1 request on a fresh connection.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Answer {
    let stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    exchange(stream, &addr.to_string(), method, path, headers, body).expect("an answer")
}

/// One HTTP/1.1 request over `stream` (a connection of its own, closed after the answer):
/// the answer, or the error that ended the exchange.
pub fn exchange(
    mut stream: impl Read + Write,
    host: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> std::io::Result<Answer> {
    let mut text = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
    for (name, value) in headers {
        text.push_str(&format!("{name}: {value}\r\n"));
    }
    text.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    stream.write_all(text.as_bytes())?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let cut_short = || std::io::Error::new(std::io::ErrorKind::UnexpectedEof, raw.clone());
    let (head, body) = raw.split_once("\r\n\r\n").ok_or_else(cut_short)?;
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|code| code.parse().ok())
        .ok_or_else(cut_short)?;
    let headers = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(name, value)| (name.trim().to_ascii_lowercase(), value.trim().to_owned()))
        .collect();
    Ok(Answer {
        status,
        headers,
        body: body.to_owned(),
    })
}

/// `POST path` with a JSON body.
pub fn post_json(addr: SocketAddr, path: &str, body: &str) -> Answer {
    request(
        addr,
        "POST",
        path,
        &[("Content-Type", "application/json")],
        body,
    )
}

pub fn path_str(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// A policy whose limit applies the limits Envoy sends with a descriptor
/// (`request_limit: apply`): domain `edge`, a bucket per `route`, 100 a minute otherwise.
pub const REQUEST_LIMITS: &str = r#"
version: "rl"
limits:
  - name: per-route
    domain: edge
    key: [route]
    capacity: 100
    refill: 100/m
    request_limit: apply
"#;

/// An RLS request for `route=search` in domain `edge`, carrying `requests_per_unit` a `unit`
/// (Envoy's `RateLimitUnit`: 2 is a minute, 6 a year) when given, as Envoy's `limit` action
/// sends one.
pub fn asking_for(
    limit: Option<(u32, i32)>,
) -> envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
    let mut sent = descriptor(&[("route", "search")]);
    sent.limit = limit.map(|(requests_per_unit, unit)| RateLimitOverride {
        requests_per_unit,
        unit,
    });
    envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest {
        domain: "edge".to_owned(),
        descriptors: vec![sent],
        hits_addend: 1,
    }
}

/// One `ShouldRateLimit` call, as Envoy makes it, on a connection of its own.
pub async fn should_rate_limit(
    server: &Server,
    request: envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest,
) -> Result<envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse, tonic::Status> {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    let mut client = RateLimitServiceClient::connect(format!("http://{}", server.grpc))
        .await
        .expect("connect to the gRPC port");
    client
        .should_rate_limit(request)
        .await
        .map(tonic::Response::into_inner)
}

/// Each descriptor status of an RLS answer as `(code, limit_remaining)`.
pub fn statuses(
    response: &envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse,
) -> Vec<(i32, u32)> {
    response
        .statuses
        .iter()
        .map(|s| (s.code, s.limit_remaining))
        .collect()
}

/// An Envoy RLS descriptor of `entries`, as Envoy's rate-limit filter builds one.
pub fn descriptor(
    entries: &[(&str, &str)],
) -> envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(key, value)| Entry {
                key: (*key).to_owned(),
                value: (*value).to_owned(),
            })
            .collect(),
        ..RateLimitDescriptor::default()
    }
}

/// The value of the metric line of `server`'s `/metrics` that starts with `series` (its name
/// and labels), 0 when there is none.
pub fn metric(server: &Server, series: &str) -> f64 {
    let text = request(server.http, "GET", "/metrics", &[], "").body;
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// The sum of `server`'s `/metrics` lines of the family `name` that carry `label` (say
/// `failure_mode="open"`) whatever their other labels: 0 when there is none.
pub fn metric_sum(server: &Server, name: &str, label: &str) -> f64 {
    let text = request(server.http, "GET", "/metrics", &[], "").body;
    text.lines()
        .filter_map(|line| line.strip_prefix(name)?.strip_prefix('{'))
        .filter_map(|rest| rest.split_once("} "))
        .filter(|(labels, _)| labels.split(',').any(|pair| pair == label))
        .filter_map(|(_, value)| value.trim().parse::<f64>().ok())
        .sum()
}

/// Runs Prometheus' promtool (from `TOLLGATE_PROMTOOL`, else the `PATH`) with `args` in `dir`,
/// failing the test with its output when it fails, or with what to install when it is missing.
pub fn run_promtool(dir: &Path, args: &[&str]) {
    let promtool = std::env::var_os("TOLLGATE_PROMTOOL").unwrap_or_else(|| "promtool".into());
    let output = Command::new(&promtool)
        .args(args)
        .current_dir(dir)
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
        "promtool {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The `tollgate_*` names a text mentions, in order of appearance.
pub fn series_named(text: &str) -> Vec<&str> {
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

/// The project's README.md, which some tests hold to the binary.
pub fn readme() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md");
    std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("{}: {err}", path.display()))
}

/// The first fenced block of `kind` (`sh`, `nginx`, ...) after `after` in `text`, without its
/// fences.
pub fn fenced_block(text: &str, after: &str, kind: &str) -> String {
    let from = text
        .find(after)
        .unwrap_or_else(|| panic!("{after:?} is not in the text"))
        + after.len();
    let fence = format!("```{kind}\n");
    let start = from
        + text[from..]
            .find(&fence)
            .unwrap_or_else(|| panic!("no {kind} block after {after:?}"))
        + fence.len();
    let end = start + text[start..].find("```").expect("the block's end");
    text[start..end].to_owned()
}

/// Asks `found` every 50 ms, for up to 10 s, and returns its first answer; panics saying what
/// never came otherwise. The server acts on its own time (a signal, the file watcher): a test
/// waits for the effect rather than sleeping for a guess.
#[allow(clippy::disallowed_methods)]
pub fn wait_for<T>(what: &str, mut found: impl FnMut() -> Option<T>) -> T {
    for _ in 0..200 {
        if let Some(answer) = found() {
            return answer;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{what} never came within 10 s");
}

/// Whole seconds of `10s`, `30s`, `1min`, `2m`: the forms the deploy files give durations in.
pub fn seconds(text: &str) -> u64 {
    let (digits, unit) = text.split_at(
        text.find(|c: char| !c.is_ascii_digit())
            .unwrap_or(text.len()),
    );
    let n: u64 = digits
        .parse()
        .unwrap_or_else(|_| panic!("a duration: {text}"));
    match unit {
        "" | "s" => n,
        "m" | "min" => n * 60,
        other => panic!("unexpected duration unit {other} in {text}"),
    }
}
