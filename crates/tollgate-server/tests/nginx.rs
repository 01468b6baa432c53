//! The README's nginx configuration, run by a real nginx in front of a real `tollgate serve`
//! started with the flags its first line names: a snippet users copy has to work as copied.
//! The test reads the snippet out of README.md, so the two cannot drift apart.
//!
//! nginx runs as one process (`master_process off`) in a scratch directory of its own, so
//! killing it on drop leaves nothing behind; the application behind it is a second server in
//! the same nginx, on a Unix socket.

mod support;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use support::{Scratch, Server, path_str, request};

/// What to install when nginx is missing.
const SETUP: &str = "these tests need nginx with its auth_request module (Debian: apt-get \
                     install nginx, or extract usr/sbin/nginx from `apt-get download nginx` as \
                     .ci/run does), on the PATH or in TOLLGATE_NGINX";

/// The README's nginx block: the `tollgate serve` flags its first line names, and the rest.
fn readme_snippet() -> (Vec<String>, String) {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md"))
            .expect("README.md");
    let start = readme
        .find("```nginx\n")
        .expect("an nginx block in README.md")
        + "```nginx\n".len();
    let end = start + readme[start..].find("```").expect("the block's end");
    let block = &readme[start..end];
    let (first, rest) = block.split_once('\n').expect("more than one line");
    let flags = first
        .strip_prefix("# tollgate serve ")
        .expect("the block opens with the tollgate serve command it expects")
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    (flags, rest.to_owned())
}

/// An nginx process serving `config` (an `http` block's servers), killed on drop.
struct Nginx {
    child: Child,
    addr: SocketAddr,
    _dir: Scratch,
}

impl Nginx {
    /// Starts nginx with `servers` in its `http` block, the front one listening on a free
    /// loopback port put where `servers` says `LISTEN`; another port is tried when that one
    /// was taken in between.
    #[allow(clippy::disallowed_methods)]
    fn start(servers: &str) -> Self {
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

/// Requests through nginx, as the README configures it in front of the demo policy: a user's
/// requests pass to the application until `per-user` is spent, then the client gets 429 with
/// `Retry-After` and the rate-limit headers; a POST is checked as a write too (its method
/// passed on, its body not); a request without the user header is not limited; and with
/// tollgate gone, nginx answers 500 rather than let requests through unchecked.
#[test]
fn the_readme_nginx_configuration_limits_requests_through_nginx() {
    let (flags, snippet) = readme_snippet();
    let args: Vec<&str> = flags.iter().map(String::as_str).collect();
    let server = Server::start(&args);
    let front = snippet.replace("127.0.0.1:8080", &server.http.to_string());
    let nginx = Nginx::start(&format!(
        "  upstream app {{ server unix:ROOT/app.sock; }}\n\
         server {{ listen unix:ROOT/app.sock; location / {{ return 200 \"app\\n\"; }} }}\n\
         server {{\n  listen LISTEN;\n{front}\n}}"
    ));
    let get = |user: &str| {
        let headers: Vec<(&str, &str)> = if user.is_empty() {
            Vec::new()
        } else {
            vec![("X-User-Id", user)]
        };
        request(nginx.addr, "GET", "/orders?page=2", &headers, "")
    };

    // The demo's per-user: a burst of 10.
    for n in 0..10 {
        let answer = get("u1");
        assert_eq!(answer.status, 200, "request {n}: {answer:?}");
        assert_eq!(answer.body, "app\n");
        let remaining = format!("\"per-user\";r={}", 9 - n);
        assert!(
            answer
                .header("ratelimit")
                .is_some_and(|value| value.starts_with(&remaining)),
            "request {n}: {answer:?}"
        );
        assert!(answer.header("ratelimit-policy").is_some(), "{answer:?}");
    }
    let rejected = get("u1");
    assert_eq!(rejected.status, 429, "{rejected:?}");
    assert!(
        !rejected.body.contains("app"),
        "the application saw nothing: {rejected:?}"
    );
    let retry: u64 = rejected
        .header("retry-after")
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("a Retry-After in whole seconds: {rejected:?}"));
    assert!(retry >= 1, "{rejected:?}");
    assert!(
        rejected
            .header("ratelimit")
            .is_some_and(|value| value.contains(";r=0")),
        "{rejected:?}"
    );

    // Writes: three a second per user, on top of per-user; the body stays with nginx.
    let post = || {
        request(
            nginx.addr,
            "POST",
            "/orders",
            &[("X-User-Id", "u2"), ("Content-Type", "application/json")],
            r#"{"item":"x"}"#,
        )
    };
    for n in 0..3 {
        assert_eq!(post().status, 200, "write {n}");
    }
    let answer = post();
    assert_eq!(answer.status, 429, "the fourth write: {answer:?}");
    assert_eq!(get("u2").status, 200, "reads are not writes");

    // No user: no limit applies to the request.
    for _ in 0..12 {
        assert_eq!(get("").status, 200);
    }

    // tollgate gone: nginx cannot ask, and refuses rather than pass requests unchecked.
    drop(server);
    let answer = get("u3");
    assert_eq!(answer.status, 500, "{answer:?}");
}
