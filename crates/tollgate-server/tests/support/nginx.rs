//! A real nginx in front of the server, for what only a proxy shows: the README's
//! `auth_request` block run as written, and pages served under a path prefix.
//!
//! nginx runs as one process (`master_process off`) in a scratch directory of its own, so
//! killing it on drop leaves nothing behind.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{Scratch, path_str};

/// What to install when nginx is missing.
const SETUP: &str = "these tests need nginx with its auth_request module (Debian: apt-get \
                     install nginx, or extract usr/sbin/nginx from `apt-get download nginx` as \
                     .ci/run does), on the PATH or in TOLLGATE_NGINX";

/// An nginx process serving an `http` block's servers, killed on drop.
pub struct Nginx {
    child: Child,
    pub addr: SocketAddr,
    _dir: Scratch,
}

impl Nginx {
    /// Starts nginx with `servers` in its `http` block, the front one listening on a free
    /// loopback port put where `servers` says `LISTEN` (and its scratch directory where it
    /// says `ROOT`, for Unix sockets); another port is tried when that one was taken in
    /// between.
    #[allow(clippy::disallowed_methods)]
    pub fn start(servers: &str) -> Self {
        let binary = std::env::var_os("TOLLGATE_NGINX").unwrap_or_else(|| "nginx".into());
        for _ in 0..5 {
            let dir = Scratch::new("nginx");
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|listener| listener.local_addr())
                .expect("a free port")
                .port();
            let root = path_str(&dir.0).to_owned();
            let config = format!(
                "daemon off;\nmaster_process off;\npid {root}/nginx.pid;\nerror_log {root}/error.log;\n\
                 events {{}}\nhttp {{\n  access_log off;\n  client_body_temp_path {root}/body;\n  \
                 proxy_temp_path {root}/proxy;\n  fastcgi_temp_path {root}/fastcgi;\n  \
                 uwsgi_temp_path {root}/uwsgi;\n  scgi_temp_path {root}/scgi;\n{}\n}}\n",
                servers
                    .replace("LISTEN", &format!("127.0.0.1:{port}"))
                    .replace("ROOT", &root)
            );
            let config_path = dir.write("nginx.conf", &config);
            let mut child = Command::new(&binary)
                .args(["-p", &root, "-e", &format!("{root}/error.log"), "-c"])
                .arg(&config_path)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|err| panic!("cannot run {binary:?} ({err}): {SETUP}"));
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            for _ in 0..100 {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                if TcpStream::connect(addr).is_ok() {
                    return Self {
                        child,
                        addr,
                        _dir: dir,
                    };
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
            let log = std::fs::read_to_string(dir.0.join("error.log")).unwrap_or_default();
            if !log.contains("Address already in use") {
                panic!("nginx did not start:\n{config}\n{log}");
            }
        }
        panic!("nginx found no free port in five tries");
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
