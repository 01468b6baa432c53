//! The README's nginx configuration, run by a real nginx (`support::nginx`) in front of a real
//! `tollgate serve` started with the flags its first line names: a snippet users copy has to
//! work as copied. The test reads the snippet out of README.md, so the two cannot drift apart;
//! the application behind nginx is a second server in the same nginx, on a Unix socket.

mod support;

use support::nginx::Nginx;
use support::{Server, fenced_block, readme, request};

/// The README's nginx block: the `tollgate serve` flags its first line names, and the rest.
fn readme_snippet() -> (Vec<String>, String) {
    let block = fenced_block(&readme(), "### Forward-auth (nginx, Traefik)", "nginx");
    let (first, rest) = block.split_once('\n').expect("more than one line");
    let flags = first
        .strip_prefix("# tollgate serve ")
        .expect("the block opens with the tollgate serve command it expects")
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    (flags, rest.to_owned())
}

/// Requests through nginx, as the README configures it in front of the demo policy: a user's
/// requests pass to the application until `per-user` is spent, then the client gets 429 with
/// `Retry-After` and the rate-limit headers; a POST is checked as a write too (its method
/// passed on, its body not); headers the client adds to choose another user, path or method
/// change nothing; a request without the user header is not limited; and with
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
    // What the client writes cannot choose its entries: headers naming another user, path or
    // method reach tollgate no more than its body does.
    for forged in [
        ("X-Tollgate-User", "someone-else"),
        ("X-Forwarded-Uri", "/elsewhere"),
        ("X-Tollgate-Path", "/elsewhere"),
    ] {
        let answer = request(
            nginx.addr,
            "GET",
            "/orders",
            &[("X-User-Id", "u1"), forged],
            "",
        );
        assert_eq!(answer.status, 429, "{forged:?}: {answer:?}");
    }

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
    for forged in [("X-Tollgate-Method", "GET"), ("X-Forwarded-Method", "GET")] {
        let answer = request(
            nginx.addr,
            "POST",
            "/orders",
            &[("X-User-Id", "u2"), forged],
            "",
        );
        assert_eq!(answer.status, 429, "a write, {forged:?}: {answer:?}");
    }
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

/// A limit on a path holds for every spelling of it nginx routes to the same place: nginx
/// passes the path on as the client wrote it (`$request_uri`), and tollgate reads it
/// normalised, so doubled slashes, escaped letters and dot segments do not open new buckets.
#[test]
fn a_limit_on_a_path_holds_for_every_spelling_of_it() {
    let (flags, snippet) = readme_snippet();
    let scratch = support::Scratch::new("nginx-paths");
    let config = scratch.write(
        "policy.yaml",
        "limits:\n  - name: orders\n    domain: api\n    when: {path: /orders}\n    key: [user]\n    capacity: 2\n    refill: 1/h\n",
    );
    let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
    args.extend(["--config", support::path_str(&config)]);
    let server = Server::start(&args);
    let front = snippet.replace("127.0.0.1:8080", &server.http.to_string());
    let nginx = Nginx::start(&format!(
        "  upstream app {{ server unix:ROOT/app.sock; }}\n\
         server {{ listen unix:ROOT/app.sock; location / {{ return 200 \"app $uri\\n\"; }} }}\n\
         server {{\n  listen LISTEN;\n{front}\n}}"
    ));
    let get = |path: &str| request(nginx.addr, "GET", path, &[("X-User-Id", "u1")], "");
    for path in ["/orders", "//orders?page=2"] {
        let answer = get(path);
        assert_eq!(answer.status, 200, "{path}: {answer:?}");
        assert_eq!(answer.body, "app /orders\n", "{path}");
    }
    // The bucket is spent, however the path is written.
    for path in [
        "/orders",
        "//orders",
        "/%6Frders",
        "/x/../orders",
        "/./orders",
        "/%2Forders",
        "/x%2F..%2Forders",
    ] {
        let answer = get(path);
        assert_eq!(answer.status, 429, "{path}: {answer:?}");
    }
    // Another path is another matter.
    assert_eq!(get("/other").status, 200);
}

/// The README's block with tollgate's HTTP listener over TLS asking for client certificates,
/// nginx reaching it as the README's "TLS on the listeners" says (`proxy_pass https://`,
/// `proxy_ssl_trusted_certificate`, a client certificate): limited as over plain HTTP, and an
/// nginx without the client certificate refused, which `auth_request` answers 500.
#[test]
fn nginx_reaches_a_tls_forward_auth_port_with_its_client_certificate() {
    use support::path_str;
    use tollgate_redis::test_server::TestCertificates;

    let certificates = TestCertificates::generate("nginx");
    let (flags, snippet) = readme_snippet();
    let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
    args.extend([
        "--http-tls-cert",
        path_str(&certificates.server_cert),
        "--http-tls-key",
        path_str(&certificates.server_key),
        "--http-tls-client-ca",
        path_str(&certificates.ca),
    ]);
    let server = Server::start(&args);
    let over_tls = |client_certificate: bool| {
        let mut tls = format!(
            "proxy_ssl_verify on;\n    proxy_ssl_trusted_certificate {};\n    \
             proxy_ssl_name localhost;\n",
            path_str(&certificates.ca)
        );
        if client_certificate {
            tls.push_str(&format!(
                "    proxy_ssl_certificate {};\n    proxy_ssl_certificate_key {};\n",
                path_str(&certificates.client_cert),
                path_str(&certificates.client_key)
            ));
        }
        let front = snippet.replace(
            "proxy_pass http://127.0.0.1:8080/v1/forward-auth/api;\n",
            &format!(
                "proxy_pass https://{}/v1/forward-auth/api;\n    {tls}",
                server.http
            ),
        );
        assert_ne!(
            front, snippet,
            "the snippet's proxy_pass to tollgate is where it was"
        );
        Nginx::start(&format!(
            "  upstream app {{ server unix:ROOT/app.sock; }}\n\
             server {{ listen unix:ROOT/app.sock; location / {{ return 200 \"app\\n\"; }} }}\n\
             server {{\n  listen LISTEN;\n{front}\n}}"
        ))
    };

    let nginx = over_tls(true);
    let get = |nginx: &Nginx| request(nginx.addr, "GET", "/orders", &[("X-User-Id", "u1")], "");
    for n in 0..10 {
        let answer = get(&nginx);
        assert_eq!(answer.status, 200, "request {n}: {answer:?}");
        assert!(answer.header("ratelimit").is_some(), "{answer:?}");
    }
    assert_eq!(
        get(&nginx).status,
        429,
        "the demo's per-user burst is spent"
    );

    let anonymous = over_tls(false);
    let answer = get(&anonymous);
    assert_eq!(
        answer.status, 500,
        "refused without a certificate: {answer:?}"
    );
}
