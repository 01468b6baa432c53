//! Throwaway Redis servers for tests and benchmarks: started on free loopback ports, never
//! persisted, killed when dropped, so nothing ever touches a Redis someone else started.
//! Public under the `test-server` feature.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Waiting for an external process to come up is the one place tests must wait on real time.
#[allow(clippy::disallowed_methods)]
fn pause_briefly() {
    std::thread::sleep(Duration::from_millis(20));
}

/// The proxy's stand-in for a slow network.
#[allow(clippy::disallowed_methods)]
fn hold(delay: Duration) {
    std::thread::sleep(delay);
}

#[allow(clippy::disallowed_methods)]
fn deadline(after: Duration) -> Instant {
    Instant::now() + after
}

#[allow(clippy::disallowed_methods)]
fn passed(deadline: Instant) -> bool {
    Instant::now() > deadline
}

/// A loopback port nothing listens on as of now: for a server to start on, or for a client to
/// find nobody at.
pub fn free_port() -> u16 {
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

/// `args` as one command in Redis' protocol.
fn encode(args: &[&str]) -> String {
    let mut request = format!("*{}\r\n", args.len());
    for arg in args {
        request.push_str(&format!("${}\r\n{arg}\r\n", arg.len()));
    }
    request
}

/// Sends one command over a fresh connection and returns the raw reply's first line or bulk.
pub fn command(port: u16, args: &[&str]) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    stream.write_all(encode(args).as_bytes()).ok()?;
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

/// Waits until `replicas` replicas of the server on `port` hold every write it has taken so
/// far, for at most `timeout`, and returns how many did. `WAIT` alone waits only for the writes
/// of its own connection, and a fresh one has made none: so a write of its own, to
/// `barrier_key` (on a cluster, a key of the server's own slots), goes first, and the server's
/// replication offset after it covers every earlier write, whoever made it.
pub fn wait_for_replicas(
    port: u16,
    barrier_key: &str,
    replicas: usize,
    timeout: Duration,
) -> Option<u64> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(timeout + Duration::from_secs(2)))
        .ok()?;
    let (replicas, millis) = (replicas.to_string(), timeout.as_millis().to_string());
    let request = encode(&["SET", barrier_key, "1"]) + &encode(&["WAIT", &replicas, &millis]);
    stream.write_all(request.as_bytes()).ok()?;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    if line != "+OK\r\n" {
        return None;
    }
    line.clear();
    reader.read_line(&mut line).ok()?;
    line.trim().strip_prefix(':')?.parse().ok()
}

/// Tries at fresh ports before a server start gives up.
const ATTEMPTS: usize = 5;

/// Why a `redis-server` did not come up as ours.
#[derive(Debug)]
enum Spawn {
    /// It exited at start: its port was taken in the meantime, most likely.
    Exited(std::process::ExitStatus),
    /// It did not answer within 10 s.
    Silent,
    /// Another process answered on its port: it would be that one the test talked to.
    Foreign(u32),
}

impl std::fmt::Display for Spawn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Spawn::Exited(status) => write!(f, "exited at start ({status}); port taken?"),
            Spawn::Silent => f.write_str("did not start within 10 s"),
            Spawn::Foreign(pid) => write!(f, "another process (pid {pid}) answers on its port"),
        }
    }
}

/// One `redis-server` process.
pub struct RedisServer {
    child: Option<Child>,
    /// The loopback port it listens on.
    pub port: u16,
    /// The loopback port it speaks TLS on, if started with [`RedisServer::start_tls`].
    pub tls_port: Option<u16>,
    dir: PathBuf,
    extra: Vec<String>,
    /// A Redis Sentinel's configuration file: the process runs in sentinel mode.
    sentinel_config: Option<PathBuf>,
}

impl RedisServer {
    /// Starts a server on a free port and waits until it answers.
    ///
    /// # Panics
    ///
    /// When `redis-server` is missing or does not come up: a setup error, never a skip.
    pub fn start() -> Self {
        Self::start_fresh(|| Self::unstarted(free_port(), Vec::new()))
    }

    /// Starts a server with `args` added to its command line (`--rename-command`, say: what
    /// only a configuration file or the command line can set).
    ///
    /// # Panics
    ///
    /// As [`RedisServer::start`].
    pub fn start_with_args(args: &[&str]) -> Self {
        let args: Vec<String> = args.iter().map(|arg| (*arg).to_owned()).collect();
        Self::start_fresh(|| Self::unstarted(free_port(), args.clone()))
    }

    /// Starts a server that also speaks TLS, with `certificates`' server certificate, on
    /// [`RedisServer::tls_port`]; with `require_client_cert` it refuses TLS clients without a
    /// certificate of that authority (Redis' default). The plain port stays open for the
    /// tests' own commands.
    pub fn start_tls(certificates: &TestCertificates, require_client_cert: bool) -> Self {
        Self::start_fresh(|| {
            let tls_port = free_port();
            let mut server = Self::unstarted(
                free_port(),
                tls_args(certificates, tls_port, require_client_cert),
            );
            server.tls_port = Some(tls_port);
            server
        })
    }

    /// Starts the server `unstarted` describes, asking it for another (on other free ports)
    /// when one exits at start.
    ///
    /// A free port is only free until someone binds it: another test's client can take it as
    /// its own end of a connection before redis-server binds it, and a server needs up to three
    /// (clients, TLS, cluster bus). Then it exits at once, and other ports will do.
    fn start_fresh(mut unstarted: impl FnMut() -> Self) -> Self {
        for _ in 1..ATTEMPTS {
            let mut server = unstarted();
            match server.try_spawn() {
                Ok(()) => return server,
                Err(Spawn::Exited(_)) => continue,
                Err(err) => panic!("redis-server on port {}: {err}", server.port),
            }
        }
        let mut server = unstarted();
        server.spawn();
        server
    }

    fn unstarted(port: u16, extra: Vec<String>) -> Self {
        Self {
            child: None,
            port,
            tls_port: None,
            dir: scratch_dir(&port.to_string()),
            extra,
            sentinel_config: None,
        }
    }

    fn spawn(&mut self) {
        if let Err(err) = self.try_spawn() {
            panic!("redis-server on port {}: {err}", self.port);
        }
    }

    /// Starts the process and waits until it answers, and checks that the answer is its own.
    fn try_spawn(&mut self) -> Result<(), Spawn> {
        let mut server = Command::new("redis-server");
        match &self.sentinel_config {
            // The file first; a sentinel rewrites it, and keeps no data to persist.
            Some(config) => server.arg(config).arg("--sentinel"),
            None => server.args(["--save", "", "--appendonly", "no"]),
        };
        let child = server
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
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
        let pid = child.id();
        let child = self.child.insert(child);
        let until = deadline(Duration::from_secs(10));
        while command(self.port, &["PING"]).as_deref() != Some("+PONG\r\n") {
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Err(Spawn::Exited(status));
            }
            if passed(until) {
                return Err(Spawn::Silent);
            }
            pause_briefly();
        }
        let info = loop {
            match command(self.port, &["INFO", "server"]) {
                Some(info) => break info,
                None if passed(until) => return Err(Spawn::Silent),
                None => pause_briefly(),
            }
        };
        match info_field(&info, "process_id", "process_id") as u32 {
            answering if answering == pid => Ok(()),
            answering => Err(Spawn::Foreign(answering)),
        }
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// `rediss://127.0.0.1:TLS_PORT`.
    ///
    /// # Panics
    ///
    /// When the server was not started with TLS.
    pub fn tls_url(&self) -> String {
        let port = self.tls_port.expect("a server started with start_tls");
        format!("rediss://127.0.0.1:{port}")
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

/// The service name the sentinels of [`RedisSentinel`] watch.
pub const SENTINEL_SERVICE: &str = "tollgate-test";

/// A master, its replica and a Redis Sentinel watching them (one sentinel, quorum 1: enough to
/// fail over, one second after the master stops answering).
pub struct RedisSentinel {
    /// The master at the start.
    pub master: RedisServer,
    /// Its replica, which a failover promotes.
    pub replica: RedisServer,
    /// The sentinel process.
    pub sentinel: RedisServer,
    password: Option<String>,
}

/// The sentinel's `INFO sentinel`, after `AUTH` when it asks for a password.
fn sentinel_info(port: u16, password: Option<&str>) -> Option<String> {
    match password {
        None => command(port, &["INFO", "sentinel"]),
        Some(password) => {
            let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
            stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
            let request = encode(&["AUTH", password]) + &encode(&["INFO", "sentinel"]);
            stream.write_all(request.as_bytes()).ok()?;
            let mut reply = String::new();
            let mut buffer = [0; 4096];
            // `+OK`, then the INFO bulk: read until its end.
            while !reply.contains("status=") || !reply.ends_with("\r\n") {
                let read = stream.read(&mut buffer).ok()?;
                if read == 0 {
                    break;
                }
                reply.push_str(&String::from_utf8_lossy(&buffer[..read]));
            }
            Some(reply)
        }
    }
}

impl RedisSentinel {
    /// Starts the three and waits until the sentinel knows the replica.
    ///
    /// # Panics
    ///
    /// When a process does not come up, or the sentinel does not find the replica within 20 s.
    pub fn start() -> Self {
        Self::start_with(None)
    }

    /// As [`RedisSentinel::start`], the sentinel asking its clients for `password` when given
    /// (as `requirepass` would).
    ///
    /// # Panics
    ///
    /// As [`RedisSentinel::start`].
    pub fn start_with(password: Option<&str>) -> Self {
        Self::launch(password, None)
    }

    /// As [`RedisSentinel::start`], the three speaking TLS with `certificates`' server
    /// certificate on their [`RedisServer::tls_port`]s, to each other too (replication and
    /// the sentinel's checks), and to clients that trust `certificates.ca`; plain ports stay
    /// open for the tests' own commands.
    ///
    /// # Panics
    ///
    /// As [`RedisSentinel::start`].
    pub fn start_tls(certificates: &TestCertificates) -> Self {
        Self::launch(None, Some(certificates))
    }

    fn launch(password: Option<&str>, certificates: Option<&TestCertificates>) -> Self {
        // Each server's TLS port and arguments, when the three speak TLS.
        let tls = || {
            certificates.map(|certificates| {
                let tls_port = free_port();
                let mut args = tls_args(certificates, tls_port, false);
                args.extend(["--tls-replication".into(), "yes".into()]);
                (tls_port, args)
            })
        };
        let unstarted = |mut extra: Vec<String>| {
            let (tls_port, tls_args) = tls().unzip();
            extra.extend(tls_args.unwrap_or_default());
            let mut server = RedisServer::unstarted(free_port(), extra);
            server.tls_port = tls_port;
            server
        };
        let master = RedisServer::start_fresh(|| unstarted(Vec::new()));
        // Replicas, and the sentinel, reach the master on its TLS port when it has one.
        let master_port = master.tls_port.unwrap_or(master.port);
        let replica = RedisServer::start_fresh(|| {
            unstarted(vec![
                "--replicaof".into(),
                "127.0.0.1".into(),
                master_port.to_string(),
            ])
        });
        let mut sentinel = unstarted(Vec::new());
        let config = sentinel.dir.join("sentinel.conf");
        std::fs::write(
            &config,
            format!(
                "sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {} 1\n\
                 sentinel down-after-milliseconds {SENTINEL_SERVICE} 1000\n\
                 sentinel failover-timeout {SENTINEL_SERVICE} 5000\n",
                master_port
            ),
        )
        .expect("write the sentinel's configuration");
        sentinel.sentinel_config = Some(config);
        sentinel.spawn();
        let until = deadline(Duration::from_secs(20));
        while !sentinel_info(sentinel.port, None)
            .is_some_and(|info| info.contains("status=ok") && info.contains("slaves=1"))
            || !command(replica.port, &["INFO", "replication"])
                .is_some_and(|info| info.contains("master_link_status:up"))
        {
            assert!(!passed(until), "the sentinel did not find the replica");
            pause_briefly();
        }
        // Set once the sentinel is up: this module's checks that a server started, and is
        // ours, ask it without a password.
        if let Some(password) = password {
            let reply = command(
                sentinel.port,
                &[
                    "ACL",
                    "SETUSER",
                    "default",
                    "resetpass",
                    &format!(">{password}"),
                ],
            );
            assert_eq!(reply.as_deref(), Some("+OK\r\n"), "the sentinel's password");
        }
        Self {
            master,
            replica,
            sentinel,
            password: password.map(str::to_owned),
        }
    }

    /// `redis+sentinel://127.0.0.1:PORT/SERVICE`.
    pub fn url(&self) -> String {
        format!(
            "redis+sentinel://127.0.0.1:{}/{SENTINEL_SERVICE}",
            self.sentinel.port
        )
    }

    /// `rediss+sentinel://127.0.0.1:TLS_PORT/SERVICE`.
    ///
    /// # Panics
    ///
    /// When the sentinel was not started with [`RedisSentinel::start_tls`].
    pub fn tls_url(&self) -> String {
        let port = self
            .sentinel
            .tls_port
            .expect("a sentinel started with start_tls");
        format!("rediss+sentinel://127.0.0.1:{port}/{SENTINEL_SERVICE}")
    }

    /// Waits until the sentinel names the server on `port` (its TLS port, with TLS) as the
    /// master.
    ///
    /// # Panics
    ///
    /// When it does not within 30 s.
    pub fn wait_for_master(&self, port: u16) {
        let until = deadline(Duration::from_secs(30));
        let address = format!("address=127.0.0.1:{port},");
        while !sentinel_info(self.sentinel.port, self.password.as_deref())
            .is_some_and(|info| info.contains(&address))
        {
            assert!(
                !passed(until),
                "the sentinel did not name {port} the master"
            );
            pause_briefly();
        }
    }
}

/// A three-master Redis Cluster made with `redis-cli --cluster create`.
pub struct RedisCluster {
    /// The three masters.
    pub nodes: Vec<RedisServer>,
    /// Replicas added with [`RedisCluster::add_replica`].
    pub replicas: Vec<RedisServer>,
}

/// `redis-cli --cluster add-node` of the node on `port` to the cluster `member` belongs to,
/// with `options`.
fn add_node(port: u16, member: u16, options: &[&str]) {
    let output = Command::new("redis-cli")
        .args(["--cluster", "add-node"])
        .arg(format!("127.0.0.1:{port}"))
        .arg(format!("127.0.0.1:{member}"))
        .args(options)
        .output()
        .expect("run redis-cli");
    assert!(
        output.status.success(),
        "redis-cli --cluster add-node failed: {}",
        String::from_utf8_lossy(&output.stdout)
    );
}

/// One cluster-enabled `redis-server` on a free port, not yet part of a cluster.
fn cluster_node(certificates: Option<&TestCertificates>) -> RedisServer {
    RedisServer::start_fresh(|| {
        let port = free_port();
        // The bus port is named: Redis' default, the port + 10000, may be another process's,
        // and past 55535 it does not exist.
        let mut args: Vec<String> = vec![
            "--cluster-enabled".into(),
            "yes".into(),
            "--cluster-port".into(),
            free_port().to_string(),
            "--cluster-config-file".into(),
            format!("nodes-{port}.conf"),
            "--cluster-node-timeout".into(),
            "2000".into(),
        ];
        let tls_port = certificates.map(|certificates| {
            let tls_port = free_port();
            args.extend(tls_args(certificates, tls_port, false));
            args.extend(["--tls-cluster".into(), "yes".into()]);
            tls_port
        });
        let mut node = RedisServer::unstarted(port, args);
        node.tls_port = tls_port;
        node
    })
}

impl RedisCluster {
    /// Starts three servers and joins them into a cluster, waiting until it is ready.
    ///
    /// # Panics
    ///
    /// When `redis-server` or `redis-cli` is missing, or the cluster does not form.
    pub fn start() -> Self {
        Self::start_with(None)
    }

    /// Starts a cluster whose nodes also speak TLS with `certificates` (clients need no
    /// certificate of their own), to each other too. The cluster tells a TLS client the
    /// nodes' TLS ports.
    pub fn start_tls(certificates: &TestCertificates) -> Self {
        Self::start_with(Some(certificates))
    }

    fn start_with(certificates: Option<&TestCertificates>) -> Self {
        let nodes: Vec<RedisServer> = (0..3).map(|_| cluster_node(certificates)).collect();
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
        let cluster = Self {
            nodes,
            replicas: Vec::new(),
        };
        cluster.wait_until_ready();
        cluster
    }

    /// Starts a replica of master `master` (an index into `nodes`) and waits until it has
    /// caught up with it, so that a failover has something to promote.
    ///
    /// # Panics
    ///
    /// When the node cannot be added or does not catch up within 20 s.
    pub fn add_replica(&mut self, master: usize) -> &RedisServer {
        let replica = cluster_node(None);
        let master_port = self.nodes[master].port;
        let master_id = self.node_id(master);
        add_node(
            replica.port,
            master_port,
            &["--cluster-slave", "--cluster-master-id", &master_id],
        );
        let until = deadline(Duration::from_secs(20));
        while !command(replica.port, &["INFO", "replication"])
            .is_some_and(|info| info.contains("master_link_status:up"))
            || !command(replica.port, &["CLUSTER", "INFO"])
                .is_some_and(|info| info.contains("cluster_state:ok"))
        {
            assert!(!passed(until), "the replica did not catch up");
            pause_briefly();
        }
        self.replicas.push(replica);
        self.replicas.last().expect("just pushed")
    }

    /// Starts a master that owns no slots yet and joins it to the cluster (as a cluster
    /// grows, before slots are moved to it), speaking TLS too with `certificates` like the
    /// rest of a cluster made with [`RedisCluster::start_tls`]. Returns its index in `nodes`.
    ///
    /// # Panics
    ///
    /// When the node cannot be added or the cluster does not settle within 20 s.
    pub fn add_master(&mut self, certificates: Option<&TestCertificates>) -> usize {
        let node = cluster_node(certificates);
        add_node(node.port, self.nodes[0].port, &[]);
        let known = self.nodes.len() + self.replicas.len() + 1;
        let until = deadline(Duration::from_secs(20));
        for port in self.nodes.iter().map(|node| node.port).chain([node.port]) {
            while !command(port, &["CLUSTER", "INFO"]).is_some_and(|info| {
                info.contains("cluster_state:ok")
                    && info.contains(&format!("cluster_known_nodes:{known}"))
            }) {
                assert!(!passed(until), "the cluster did not take the new master in");
                pause_briefly();
            }
        }
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    /// The cluster's id of master `index`.
    ///
    /// # Panics
    ///
    /// When the node does not answer.
    pub fn node_id(&self, index: usize) -> String {
        command(self.nodes[index].port, &["CLUSTER", "MYID"])
            .map(|id| id.trim().to_owned())
            .expect("CLUSTER MYID")
    }

    /// Waits until every node reports `cluster_state:ok`.
    ///
    /// # Panics
    ///
    /// After 20 s.
    pub fn wait_until_ready(&self) {
        let until = deadline(Duration::from_secs(20));
        for node in &self.nodes {
            while !command(node.port, &["CLUSTER", "INFO"])
                .is_some_and(|info| info.contains("cluster_state:ok"))
            {
                assert!(!passed(until), "cluster did not become ready");
                pause_briefly();
            }
        }
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

    /// `rediss+cluster://127.0.0.1:T1,127.0.0.1:T2,127.0.0.1:T3`, the TLS ports.
    ///
    /// # Panics
    ///
    /// When the cluster was not started with TLS.
    pub fn tls_url(&self) -> String {
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|node| {
                let port = node.tls_port.expect("a cluster started with start_tls");
                format!("127.0.0.1:{port}")
            })
            .collect();
        format!("rediss+cluster://{}", nodes.join(","))
    }
}

/// A loopback TCP proxy in front of a Redis server, for the one failure a paused or killed
/// server cannot show: a peer that vanishes without closing its connections (a Redis replaced
/// behind the same name, a firewall that forgot the flow). After [`Proxy::black_hole`], every
/// connection open at that moment swallows what it is sent and answers nothing, yet stays
/// open; connections made afterwards are forwarded as before.
pub struct Proxy {
    /// The loopback port clients connect to.
    pub port: u16,
    shared: Arc<ProxyShared>,
    acceptor: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct ProxyShared {
    /// Bumped by `black_hole`: a connection accepted in an older epoch forwards nothing.
    epoch: AtomicU64,
    accepted: AtomicU64,
    /// Connections the client has closed.
    ended: AtomicU64,
    /// Milliseconds a new connection holds its client's first bytes before passing them on.
    first_delay_ms: AtomicU64,
    closed: AtomicBool,
    /// Where new connections go (see `Proxy::retarget`).
    upstream: AtomicU64,
    /// Both ends of every connection, to unblock their pumps on drop.
    streams: Mutex<Vec<TcpStream>>,
    pumps: Mutex<Vec<JoinHandle<()>>>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards each connection to `127.0.0.1:upstream`.
    ///
    /// # Panics
    ///
    /// When no loopback port can be bound.
    pub fn start(upstream: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a free loopback port");
        let port = listener.local_addr().expect("local address").port();
        let shared = Arc::new(ProxyShared::default());
        shared.upstream.store(u64::from(upstream), Ordering::SeqCst);
        let acceptor = {
            let shared = Arc::clone(&shared);
            std::thread::spawn(move || {
                for client in listener.incoming() {
                    if shared.closed.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(client) = client else { continue };
                    let upstream =
                        u16::try_from(shared.upstream.load(Ordering::SeqCst)).unwrap_or(upstream);
                    let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                        continue;
                    };
                    // Bytes go on as they come, as Redis and its clients send them: with
                    // Nagle's algorithm, a request forwarded in several reads (a script's
                    // source) could wait out the peer's delayed acknowledgement, 40 ms.
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    shared.accepted.fetch_add(1, Ordering::SeqCst);
                    let epoch = shared.epoch.load(Ordering::SeqCst);
                    let delay = Duration::from_millis(shared.first_delay_ms.load(Ordering::SeqCst));
                    let (Ok(client_end), Ok(server_end)) = (client.try_clone(), server.try_clone())
                    else {
                        continue;
                    };
                    lock(&shared.streams).extend([client_end, server_end]);
                    let pumps = [
                        (client.try_clone(), server.try_clone(), true),
                        (Ok(server), Ok(client), false),
                    ]
                    .into_iter()
                    .filter_map(|(from, to, outbound)| Some((from.ok()?, to.ok()?, outbound)))
                    .map(|(from, to, outbound)| {
                        let shared = Arc::clone(&shared);
                        let delay = if outbound { delay } else { Duration::ZERO };
                        std::thread::spawn(move || pump(&shared, epoch, delay, from, to, outbound))
                    })
                    .collect::<Vec<_>>();
                    lock(&shared.pumps).extend(pumps);
                }
            })
        };
        Self {
            port,
            shared,
            acceptor: Some(acceptor),
        }
    }

    /// `redis://127.0.0.1:PORT` of the proxy.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Sends the connections made from now on to `127.0.0.1:upstream`; open ones stay where
    /// they were, as when a name (a managed Redis' endpoint, a Kubernetes Service) moves to a
    /// new primary.
    pub fn retarget(&self, upstream: u16) {
        self.shared
            .upstream
            .store(u64::from(upstream), Ordering::SeqCst);
    }

    /// Makes every connection open now go silent, for good.
    pub fn black_hole(&self) {
        self.shared.epoch.fetch_add(1, Ordering::SeqCst);
    }

    /// Makes connections accepted from now on hold their client's first bytes for `delay`
    /// before passing them on, as a server far away, or slow to finish a handshake, would.
    pub fn delay_new_connections(&self, delay: Duration) {
        let millis = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.shared.first_delay_ms.store(millis, Ordering::SeqCst);
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Connections accepted and not yet closed by the client.
    pub fn open_connections(&self) -> u64 {
        self.connections() - self.shared.ended.load(Ordering::SeqCst)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Copies `from` to `to` until either end closes, the first bytes after `delay`; once the
/// connection's epoch has passed, reads and drops everything instead. `outbound`: `from` is the
/// client.
fn pump(
    shared: &ProxyShared,
    epoch: u64,
    mut delay: Duration,
    mut from: TcpStream,
    mut to: TcpStream,
    outbound: bool,
) {
    let mut buffer = [0; 16 * 1024];
    loop {
        let read = match from.read(&mut buffer) {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        if !delay.is_zero() {
            hold(delay);
            delay = Duration::ZERO;
        }
        if shared.epoch.load(Ordering::SeqCst) != epoch {
            continue;
        }
        if to.write_all(&buffer[..read]).is_err() {
            break;
        }
    }
    if outbound {
        shared.ended.fetch_add(1, Ordering::SeqCst);
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        // Wakes the acceptor, which sees `closed` and stops.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
        for stream in lock(&self.shared.streams).drain(..) {
            let _ = stream.shutdown(Shutdown::Both);
        }
        for pump in lock(&self.shared.pumps).drain(..) {
            let _ = pump.join();
        }
    }
}

/// A throwaway certificate authority, a server certificate for `127.0.0.1` and `localhost`,
/// and a client certificate, all signed by it and written as PEM files into a scratch
/// directory that goes when this is dropped.
pub struct TestCertificates {
    dir: PathBuf,
    /// The authority's certificate.
    pub ca: PathBuf,
    /// The server's certificate and key.
    pub server_cert: PathBuf,
    /// See [`TestCertificates::server_cert`].
    pub server_key: PathBuf,
    /// A client certificate and key.
    pub client_cert: PathBuf,
    /// See [`TestCertificates::client_cert`].
    pub client_key: PathBuf,
}

impl TestCertificates {
    /// Generates a new authority and its certificates; `name` keeps the directories of
    /// several sets apart.
    ///
    /// # Panics
    ///
    /// When a key cannot be generated or a file written.
    pub fn generate(name: &str) -> Self {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

        let dir = scratch_dir(&format!("tls-{name}"));
        let write = |file: &str, pem: String| {
            let path = dir.join(file);
            std::fs::write(&path, pem).expect("write a PEM file");
            path
        };
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, format!("tollgate test CA {name}"));
        let ca_key = KeyPair::generate().expect("a CA key");
        let ca_cert = ca_params.self_signed(&ca_key).expect("the CA certificate");
        let issuer = Issuer::new(ca_params, ca_key);
        let leaf = |names: Vec<String>, common_name: &str| {
            let mut params = CertificateParams::new(names).expect("certificate parameters");
            params
                .distinguished_name
                .push(DnType::CommonName, common_name);
            let key = KeyPair::generate().expect("a key");
            let cert = params
                .signed_by(&key, &issuer)
                .expect("a signed certificate");
            (cert.pem(), key.serialize_pem())
        };
        let (server_cert, server_key) = leaf(
            vec!["127.0.0.1".to_owned(), "localhost".to_owned()],
            "tollgate test redis",
        );
        let (client_cert, client_key) = leaf(Vec::new(), "tollgate test client");
        Self {
            ca: write("ca.pem", ca_cert.pem()),
            server_cert: write("server.pem", server_cert),
            server_key: write("server.key", server_key),
            client_cert: write("client.pem", client_cert),
            client_key: write("client.key", client_key),
            dir,
        }
    }
}

impl Drop for TestCertificates {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `redis-server` arguments for TLS on `tls_port` with `certificates`.
fn tls_args(
    certificates: &TestCertificates,
    tls_port: u16,
    require_client_cert: bool,
) -> Vec<String> {
    let path = |path: &PathBuf| path.display().to_string();
    vec![
        "--tls-port".into(),
        tls_port.to_string(),
        "--tls-cert-file".into(),
        path(&certificates.server_cert),
        "--tls-key-file".into(),
        path(&certificates.server_key),
        "--tls-ca-cert-file".into(),
        path(&certificates.ca),
        "--tls-auth-clients".into(),
        if require_client_cert { "yes" } else { "no" }.into(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A port whose server is already running is not this new server's: without the process
    /// check, a test would talk to the other one and never know.
    #[test]
    fn a_port_answered_by_another_server_is_refused() {
        let running = RedisServer::start();
        let mut second = RedisServer::unstarted(running.port, Vec::new());
        match second.try_spawn() {
            Err(Spawn::Foreign(pid)) => {
                assert_eq!(Some(pid), running.child.as_ref().map(Child::id));
            }
            other => panic!("expected another process on the port, got {other:?}"),
        }
    }

    /// A server whose port was taken before it bound exits at start, and says so.
    #[test]
    fn a_taken_port_is_reported_as_an_exit() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        // Nothing reads from the listener, so a PING to it gets no answer.
        let mut server = RedisServer::unstarted(port, Vec::new());
        assert!(matches!(server.try_spawn(), Err(Spawn::Exited(_))));
    }

    /// A start whose port is taken tries again on the ports it is given next.
    #[test]
    fn a_start_on_a_taken_port_moves_on() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let taken_port = taken.local_addr().unwrap().port();
        let mut ports = vec![free_port(), taken_port, taken_port];
        let server = RedisServer::start_fresh(|| {
            RedisServer::unstarted(ports.pop().expect("a port per try"), Vec::new())
        });
        assert_ne!(server.port, taken_port);
        assert!(ports.is_empty(), "two tries failed before the third");
    }
}
