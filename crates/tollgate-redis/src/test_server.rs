//! Throwaway Redis servers for tests and benchmarks: started on free loopback ports, never
//! persisted, killed when dropped, so nothing ever touches a Redis someone else started.
//! Public under the `test-server` feature.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Waiting for an external process to come up is the one place tests must wait on real time.
#[allow(clippy::disallowed_methods)]
fn pause_briefly() {
    std::thread::sleep(Duration::from_millis(20));
}

#[allow(clippy::disallowed_methods)]
fn deadline(after: Duration) -> Instant {
    Instant::now() + after
}

#[allow(clippy::disallowed_methods)]
fn passed(deadline: Instant) -> bool {
    Instant::now() > deadline
}

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a free loopback port");
    listener.local_addr().expect("local address").port()
}

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tollgate-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create a scratch directory");
    dir
}

/// Reads a figure from `INFO` text: `field=value` inside the line starting with `line_prefix`
/// (`cmdstat_evalsha:calls=3,usec=40,...`), or that line's own `field:value`
/// (`used_cpu_user:0.12`). 0 when absent.
pub fn info_field(info: &str, line_prefix: &str, field: &str) -> f64 {
    info.lines()
        .find(|line| line.starts_with(line_prefix))
        .and_then(|line| {
            line.split([',', ':'])
                .find_map(|part| part.strip_prefix(&format!("{field}=")))
                .or_else(|| line.strip_prefix(&format!("{field}:")))
        })
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Sends one command over a fresh connection and returns the raw reply's first line or bulk.
pub fn command(port: u16, args: &[&str]) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let mut request = format!("*{}\r\n", args.len());
    for arg in args {
        request.push_str(&format!("${}\r\n{arg}\r\n", arg.len()));
    }
    stream.write_all(request.as_bytes()).ok()?;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    if let Some(len) = line.strip_prefix('$') {
        let len: usize = len.trim().parse().ok()?;
        let mut body = vec![0; len + 2];
        std::io::Read::read_exact(&mut reader, &mut body).ok()?;
        return String::from_utf8(body).ok();
    }
    Some(line)
}

/// One `redis-server` process.
pub struct RedisServer {
    child: Option<Child>,
    /// The loopback port it listens on.
    pub port: u16,
    dir: PathBuf,
    extra: Vec<String>,
}

impl RedisServer {
    /// Starts a server on a free port and waits until it answers.
    ///
    /// # Panics
    ///
    /// When `redis-server` is missing or does not come up: a setup error, never a skip.
    pub fn start() -> Self {
        Self::start_with(free_port(), Vec::new())
    }

    fn start_with(port: u16, extra: Vec<String>) -> Self {
        let dir = scratch_dir(&port.to_string());
        let mut server = Self {
            child: None,
            port,
            dir,
            extra,
        };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|err| {
                panic!(
                    "cannot start redis-server ({err}): the Redis tests need it on PATH \
                     (Debian: apt-get install -y redis-server redis-tools)"
                )
            });
        self.child = Some(child);
        let until = deadline(Duration::from_secs(10));
        while command(self.port, &["PING"]).as_deref() != Some("+PONG\r\n") {
            assert!(
                !passed(until),
                "redis-server on port {} did not start",
                self.port
            );
            pause_briefly();
        }
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the server at once (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port, empty.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Freezes the process (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws it (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        if let Some(child) = &self.child {
            let status = Command::new("kill")
                .args([signal, &child.id().to_string()])
                .status()
                .expect("run kill");
            assert!(status.success(), "kill {signal} failed");
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // A stopped process still dies of SIGKILL.
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A three-master Redis Cluster made with `redis-cli --cluster create`.
pub struct RedisCluster {
    /// The three masters.
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts three servers and joins them into a cluster, waiting until it is ready.
    ///
    /// # Panics
    ///
    /// When `redis-server` or `redis-cli` is missing, or the cluster does not form.
    pub fn start() -> Self {
        let nodes: Vec<RedisServer> = (0..3)
            .map(|_| {
                let port = free_port();
                RedisServer::start_with(
                    port,
                    vec![
                        "--cluster-enabled".into(),
                        "yes".into(),
                        "--cluster-config-file".into(),
                        format!("nodes-{port}.conf"),
                        "--cluster-node-timeout".into(),
                        "2000".into(),
                    ],
                )
            })
            .collect();
        let addresses: Vec<String> = nodes
            .iter()
            .map(|node| format!("127.0.0.1:{}", node.port))
            .collect();
        let output = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .unwrap_or_else(|err| {
                panic!(
                    "cannot run redis-cli ({err}): the cluster tests need it on PATH \
                     (Debian: apt-get install -y redis-tools)"
                )
            });
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed: {}",
            String::from_utf8_lossy(&output.stdout)
        );
        let until = deadline(Duration::from_secs(20));
        for node in &nodes {
            while !command(node.port, &["CLUSTER", "INFO"])
                .is_some_and(|info| info.contains("cluster_state:ok"))
            {
                assert!(!passed(until), "cluster did not become ready");
                pause_briefly();
            }
        }
        Self { nodes }
    }

    /// `redis+cluster://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3`.
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|node| format!("127.0.0.1:{}", node.port))
            .collect();
        format!("redis+cluster://{}", nodes.join(","))
    }
}
