//! `tollgate bench` flags, and the checked [`Plan`] they turn into.
//!
//! Everything a user can get wrong is caught here, before a connection is opened, so a run
//! either starts with sane settings or stops with one line saying which flag to fix.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};

use super::tls::TlsClient;

/// The most distinct keys: the skewed distribution keeps one `f64` per key.
pub(crate) const MAX_KEYS: u64 = 10_000_000;
/// The most concurrent workers (each holds one connection).
pub(crate) const MAX_CONCURRENCY: usize = 10_000;

/// `tollgate bench` flags: load a tollgate deployment to see what it sustains before a limit
/// is raised.
#[derive(Debug, Clone, Parser)]
pub struct BenchArgs {
    /// HTTP target, as `http://HOST:PORT` or `https://HOST:PORT`; requests go to
    /// `POST /v1/check` (see --path).
    #[arg(
        long,
        value_name = "URL",
        conflicts_with = "grpc",
        required_unless_present = "grpc"
    )]
    pub target: Option<String>,
    /// gRPC target, as `HOST:PORT` (or `https://HOST:PORT` for TLS): Envoy RLS v3
    /// `ShouldRateLimit`.
    #[arg(long, value_name = "HOST:PORT")]
    pub grpc: Option<String>,
    /// TLS: trust the authorities of this PEM file instead of the system's.
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// TLS: present this PEM client certificate, to a server that requires one; needs
    /// --tls-key.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// TLS: the client certificate's PEM private key.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// TLS: the name the server's certificate must carry (default: the target's host).
    #[arg(long, value_name = "NAME")]
    pub tls_server_name: Option<String>,
    /// HTTP only: send forward-auth subrequests, as nginx `auth_request` and Traefik
    /// ForwardAuth do (`GET /v1/forward-auth/{domain}`, each entry as an `x-tollgate-<entry>`
    /// header, the cost as `x-tollgate-cost`); 429 and 403 count as rejections.
    #[arg(long, conflicts_with_all = ["grpc", "path"])]
    pub forward_auth: bool,
    /// HTTP path to send the check body to; `/v1/noop` measures the stack without deciding.
    #[arg(long, default_value = "/v1/check")]
    pub path: String,
    /// HTTP only: speak HTTP/2 (with prior knowledge to an `http://` target, by ALPN to an
    /// `https://` one) instead of HTTP/1.1, as proxies and service meshes that keep HTTP/2
    /// connections to their upstreams do; with --connections, workers share connections.
    #[arg(long, conflicts_with = "grpc")]
    pub http2: bool,
    /// Concurrent workers, each with one request in flight. Over HTTP/1.1 each has its own
    /// keep-alive connection; over gRPC and HTTP/2 they share --connections.
    #[arg(long, short = 'c', default_value_t = 16)]
    pub concurrency: usize,
    /// gRPC and --http2 only: HTTP/2 connections the workers' requests are multiplexed over
    /// (default: one per worker). Envoy sends its rate-limit calls as streams over a few
    /// connections per worker thread; fewer connections measure that, and let each read and
    /// write carry several requests.
    #[arg(long, value_name = "N")]
    pub connections: Option<usize>,
    /// How long to run, as `500ms`, `10s` or `2m` (ignored with --requests).
    #[arg(long, short = 'd', default_value = "10s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Send exactly this many requests instead of running for --duration.
    #[arg(long, short = 'n')]
    pub requests: Option<u64>,
    /// The descriptor domain.
    #[arg(long, default_value = "api")]
    pub domain: String,
    /// The descriptor entry that carries the varying key (`user` → `{"user":"bench-42"}`).
    #[arg(long, default_value = "user")]
    pub key_entry: String,
    /// A fixed descriptor entry added to every request, as `entry=value` (repeatable).
    #[arg(long = "entry", value_name = "ENTRY=VALUE", value_parser = parse_entry)]
    pub entries: Vec<(String, String)>,
    /// Distinct key values (`bench-0` … `bench-{N-1}`).
    #[arg(long, default_value_t = 10_000)]
    pub keys: u64,
    /// How keys are drawn: `uniform`, or `zipf` (exponent 1.1: a few hot keys, a long tail).
    #[arg(long, value_enum, default_value_t = Distribution::Uniform)]
    pub distribution: Distribution,
    /// A header sent with every request, as `NAME: VALUE` (repeatable; gRPC metadata over
    /// gRPC): a gateway's credentials in front of the deployment, or a trace context
    /// (`traceparent: 00-…-01`) to follow the load in the traces.
    #[arg(long = "header", short = 'H', value_name = "NAME: VALUE", value_parser = parse_header)]
    pub headers: Vec<(http::HeaderName, http::HeaderValue)>,
    /// Tokens per request (`cost` over HTTP, `hits_addend` over gRPC).
    #[arg(long, default_value_t = 1)]
    pub cost: u32,
    /// Open loop: send this many requests per second in total, on schedule, and measure
    /// latency from when each request was due (so a stalled server cannot hide its queue).
    #[arg(long, value_name = "PER_SECOND")]
    pub rate: Option<f64>,
    /// Give up on a request after this long and count an error.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Print one JSON object instead of the text summary (and no progress bar).
    #[arg(long)]
    pub json: bool,
    /// Seed of the key sequence, for runs that repeat exactly.
    #[arg(long, default_value_t = 0x7011_6a7e)]
    pub seed: u64,
    /// Threads driving the load (default: one per core). On the machine the server runs on,
    /// fewer threads leave it more of the cores and measure its latency with less interference.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub threads: Option<u16>,
}

/// How keys are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Distribution {
    /// Every key equally often.
    Uniform,
    /// Zipf with exponent 1.1: key `k` drawn in proportion to `1 / (k+1)^1.1`.
    Zipf,
}

/// Where the load goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Target {
    /// `host:port` and the path, over HTTP/1.1 or HTTP/2 ([`Plan::http2`]).
    Http { authority: String, path: String },
    /// `host:port`, over gRPC.
    Grpc { authority: String },
    /// `host:port` and the forward-auth path of the domain, as [`Target::Http`].
    ForwardAuth { authority: String, path: String },
}

/// When a run stops.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Stop {
    After(Duration),
    Count(u64),
}

/// Checked settings of one run.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub(crate) target: Target,
    pub(crate) concurrency: usize,
    /// HTTP targets: over HTTP/2 rather than HTTP/1.1.
    pub(crate) http2: bool,
    /// Connections the workers share: `concurrency` over HTTP/1.1, `--connections` over
    /// gRPC and HTTP/2.
    pub(crate) connections: usize,
    pub(crate) stop: Stop,
    pub(crate) domain: String,
    pub(crate) key_entry: String,
    pub(crate) entries: Vec<(String, String)>,
    /// `--header`s, sent with every request.
    pub(crate) headers: http::HeaderMap,
    pub(crate) keys: u64,
    pub(crate) distribution: Distribution,
    pub(crate) cost: u32,
    /// The interval between two requests, in open loop (whichever worker sends them).
    pub(crate) interval: Option<Duration>,
    pub(crate) timeout: Duration,
    pub(crate) seed: u64,
    /// TLS to the target, for an `https://` one.
    pub(crate) tls: Option<TlsClient>,
}

impl BenchArgs {
    /// Checks the flags together.
    pub(crate) fn plan(&self) -> Result<Plan, String> {
        let (target, secure) = match (&self.target, &self.grpc) {
            (Some(url), None) => {
                let (authority, secure) = http_authority(url)?;
                let target = if self.forward_auth {
                    Target::ForwardAuth {
                        authority,
                        path: forward_auth_path(&self.domain, &self.key_entry, &self.entries)?,
                    }
                } else {
                    Target::Http {
                        authority,
                        path: check_path(&self.path)?,
                    }
                };
                (target, secure)
            }
            (None, Some(address)) => {
                let (address, secure) = match address.strip_prefix("https://") {
                    Some(rest) => (rest, true),
                    None => (address.strip_prefix("http://").unwrap_or(address), false),
                };
                let address = address.strip_suffix('/').unwrap_or(address);
                let target = Target::Grpc {
                    authority: check_authority(address, "--grpc")?,
                };
                (target, secure)
            }
            _ => return Err("give one of --target http://HOST:PORT or --grpc HOST:PORT".into()),
        };
        let tls = match &target {
            _ if !secure => {
                if self.tls_ca.is_some()
                    || self.tls_cert.is_some()
                    || self.tls_server_name.is_some()
                {
                    return Err(
                        "--tls-ca, --tls-cert and --tls-server-name are for an https:// \
                                target (--target https://HOST:PORT or --grpc https://HOST:PORT)"
                            .into(),
                    );
                }
                None
            }
            Target::Grpc { authority } => Some(TlsClient::from_args(self, host(authority), b"h2")?),
            Target::Http { authority, .. } | Target::ForwardAuth { authority, .. } => {
                let alpn: &[u8] = if self.http2 { b"h2" } else { b"http/1.1" };
                Some(TlsClient::from_args(self, host(authority), alpn)?)
            }
        };
        if self.concurrency == 0 || self.concurrency > MAX_CONCURRENCY {
            return Err(format!(
                "--concurrency must be 1 to {MAX_CONCURRENCY}, not {}",
                self.concurrency
            ));
        }
        let multiplexed = self.http2 || matches!(target, Target::Grpc { .. });
        let connections = match self.connections {
            None => self.concurrency,
            Some(_) if !multiplexed => {
                return Err(
                    "--connections is for --grpc and --http2: HTTP/1.1 carries one request \
                            at a time per connection, so --concurrency sets the connections"
                        .into(),
                );
            }
            Some(n) if n == 0 || n > self.concurrency => {
                return Err(format!(
                    "--connections must be 1 to --concurrency ({}), not {n}",
                    self.concurrency
                ));
            }
            Some(n) => n,
        };
        let stop = match self.requests {
            Some(0) => return Err("--requests must be at least 1".into()),
            Some(count) => Stop::Count(count),
            None if self.duration.is_zero() => return Err("--duration must be above 0".into()),
            None => Stop::After(self.duration),
        };
        if self.keys == 0 || self.keys > MAX_KEYS {
            return Err(format!("--keys must be 1 to {MAX_KEYS}, not {}", self.keys));
        }
        if self.domain.is_empty() || self.key_entry.is_empty() {
            return Err("--domain and --key-entry must not be empty".into());
        }
        if self.cost == 0 {
            return Err("--cost must be at least 1".into());
        }
        if self.timeout.is_zero() {
            return Err("--timeout must be above 0".into());
        }
        let interval = match self.rate {
            None => None,
            Some(rate) if rate.is_finite() && rate > 0.0 => {
                let interval = Duration::try_from_secs_f64(1.0 / rate)
                    .map_err(|_| format!("--rate {rate} is too low"))?;
                if interval.is_zero() {
                    return Err(format!("--rate {rate} is too high"));
                }
                Some(interval)
            }
            Some(rate) => return Err(format!("--rate must be above 0, not {rate}")),
        };
        Ok(Plan {
            target,
            concurrency: self.concurrency,
            http2: self.http2,
            connections,
            stop,
            domain: self.domain.clone(),
            key_entry: self.key_entry.clone(),
            entries: self.entries.clone(),
            headers: self.headers.iter().cloned().collect(),
            keys: self.keys,
            distribution: self.distribution,
            cost: self.cost,
            interval,
            timeout: self.timeout,
            seed: self.seed,
            tls,
        })
    }
}

/// `http://host:port[/]` → `host:port`, and whether it is `https://`.
fn http_authority(url: &str) -> Result<(String, bool), String> {
    let (rest, secure) = match (url.strip_prefix("http://"), url.strip_prefix("https://")) {
        (Some(rest), _) => (rest, false),
        (_, Some(rest)) => (rest, true),
        _ => {
            return Err(format!(
                "--target must start with http:// or https://, not {url}"
            ));
        }
    };
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.contains('/') {
        return Err(format!(
            "--target is http://HOST:PORT without a path (use --path), not {url}"
        ));
    }
    Ok((check_authority(authority, "--target")?, secure))
}

/// The host of a checked `host:port`.
fn host(authority: &str) -> &str {
    authority
        .rsplit_once(':')
        .map_or(authority, |(host, _)| host)
}

fn check_authority(authority: &str, flag: &str) -> Result<String, String> {
    match authority.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
            Ok(authority.to_owned())
        }
        _ => Err(format!("{flag} needs HOST:PORT, not {authority}")),
    }
}

/// `/v1/forward-auth/{domain}`, once the domain is a path segment as it is and every entry
/// makes a header name.
fn forward_auth_path(
    domain: &str,
    key_entry: &str,
    entries: &[(String, String)],
) -> Result<String, String> {
    let plain = |b: u8| b.is_ascii_alphanumeric() || b"-._~".contains(&b);
    if !domain.bytes().all(plain) {
        return Err(format!(
            "--forward-auth puts the domain in the path: letters, digits and -._~ only, not {domain}"
        ));
    }
    let names = std::iter::once(key_entry).chain(entries.iter().map(|(entry, _)| entry.as_str()));
    for entry in names {
        let name = format!("{}{entry}", super::http::ENTRY_HEADER_PREFIX);
        if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
            return Err(format!(
                "--forward-auth sends entry {entry} as the header {name}, which is no header name"
            ));
        }
    }
    for (entry, value) in entries {
        if http::HeaderValue::from_str(value).is_err() {
            return Err(format!(
                "--forward-auth sends entry {entry} as a header, and {value:?} is no header value"
            ));
        }
    }
    Ok(format!("/v1/forward-auth/{domain}"))
}

fn check_path(path: &str) -> Result<String, String> {
    if path.starts_with('/') && path.bytes().all(|b| b.is_ascii_graphic()) {
        Ok(path.to_owned())
    } else {
        Err(format!(
            "--path must start with / and hold no spaces, not {path}"
        ))
    }
}

/// `500ms`, `10s`, `2m`, `1h`, `1d`.
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or("a unit is needed: ms, s, m, h or d, as in 10s")?;
    let (count, unit) = text.split_at(split);
    let count: u64 = count
        .parse()
        .map_err(|_| format!("not a duration: {text}"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(count)),
        "s" => Ok(Duration::from_secs(count)),
        "m" => Ok(Duration::from_secs(count.saturating_mul(60))),
        "h" => Ok(Duration::from_secs(count.saturating_mul(3_600))),
        "d" => Ok(Duration::from_secs(count.saturating_mul(86_400))),
        _ => Err(format!("unknown unit in {text}: use ms, s, m, h or d")),
    }
}

fn parse_entry(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .filter(|(entry, _)| !entry.is_empty())
        .map(|(entry, value)| (entry.to_owned(), value.to_owned()))
        .ok_or_else(|| format!("expected ENTRY=VALUE, as in method=GET, not {text}"))
}

/// Headers the generator writes itself, or that would change what a request is: refused in
/// `--header`.
const OWN_HEADERS: [&str; 8] = [
    "host",
    "content-type",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "upgrade",
    "te",
];

/// `NAME: VALUE`, as a header to send.
fn parse_header(text: &str) -> Result<(http::HeaderName, http::HeaderValue), String> {
    let (name, value) = text.split_once(':').ok_or_else(|| {
        format!("expected NAME: VALUE, as in authorization: Bearer T, not {text}")
    })?;
    let name = http::HeaderName::from_bytes(name.trim().as_bytes())
        .map_err(|_| format!("{:?} is not a header name", name.trim()))?;
    if OWN_HEADERS.contains(&name.as_str()) {
        return Err(format!("the generator sets {name} itself"));
    }
    let value = http::HeaderValue::from_str(value.trim())
        .map_err(|_| format!("{:?} is not a header value", value.trim()))?;
    Ok((name, value))
}

/// `tollgate bench ARGS`, parsed: for the tests of the generator's parts.
#[cfg(test)]
pub(crate) fn parse(args: &[&str]) -> Result<BenchArgs, String> {
    BenchArgs::try_parse_from(std::iter::once("bench").chain(args.iter().copied()))
        .map_err(|err| err.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(args: &[&str]) -> Result<Plan, String> {
        parse(args)?.plan()
    }

    #[test]
    fn forward_auth_sends_the_domain_in_the_path_and_entries_as_headers() {
        let forward = plan(&[
            "--target",
            "http://127.0.0.1:8080",
            "--forward-auth",
            "--domain",
            "edge",
            "--entry",
            "method=GET",
        ])
        .map(|p| p.target);
        assert_eq!(
            forward,
            Ok(Target::ForwardAuth {
                authority: "127.0.0.1:8080".into(),
                path: "/v1/forward-auth/edge".into()
            })
        );
        let base = ["--target", "http://127.0.0.1:8080", "--forward-auth"];
        for (extra, expected) in [
            (&["--domain", "a/b"][..], "letters, digits"),
            (&["--key-entry", "us er"][..], "no header name"),
            (&["--entry", "tier=a\nb"][..], "no header value"),
            (&["--path", "/v1/noop"][..], "cannot be used with"),
        ] {
            let args: Vec<&str> = base.iter().chain(extra).copied().collect();
            let err = plan(&args).err().unwrap_or_default();
            assert!(err.contains(expected), "{extra:?}: {err}");
        }
        let err = plan(&["--grpc", "127.0.0.1:8081", "--forward-auth"])
            .err()
            .unwrap_or_default();
        assert!(err.contains("cannot be used with"), "{err}");
    }

    #[test]
    fn targets_parse() {
        let http = plan(&["--target", "http://127.0.0.1:8080/"]).map(|p| p.target);
        assert_eq!(
            http,
            Ok(Target::Http {
                authority: "127.0.0.1:8080".into(),
                path: "/v1/check".into()
            })
        );
        let grpc = plan(&["--grpc", "localhost:8081"]).map(|p| p.target);
        assert_eq!(
            grpc,
            Ok(Target::Grpc {
                authority: "localhost:8081".into()
            })
        );
    }

    #[test]
    fn bad_flags_are_one_line_errors() {
        for args in [
            &["--target", "ftp://x:1"][..],
            &["--target", "http://x:1/v1/check"],
            &["--target", "http://x"],
            &["--grpc", "x:port"],
            &["--target", "http://x:1", "--concurrency", "0"],
            &["--target", "http://x:1", "--requests", "0"],
            &["--target", "http://x:1", "--keys", "0"],
            &["--target", "http://x:1", "--rate=-3"],
            &["--target", "http://x:1", "--cost", "0"],
            &["--target", "http://x:1", "--path", "v1"],
            &["--target", "http://x:1", "--connections", "1"],
            &["--grpc", "x:1", "-c", "4", "--connections", "0"],
            &["--grpc", "x:1", "-c", "4", "--connections", "5"],
            &[
                "--target",
                "http://x:1",
                "--http2",
                "-c",
                "4",
                "--connections",
                "5",
            ],
            &["--grpc", "x:1", "--http2"],
        ] {
            let err = plan(args).err();
            assert!(err.is_some(), "{args:?} was accepted");
        }
        assert!(plan(&[]).is_err());
        assert!(plan(&["--target", "http://x:1", "--grpc", "x:2"]).is_err());
    }

    #[test]
    fn https_targets_speak_tls_and_tls_flags_need_one() {
        let http = plan(&["--target", "https://127.0.0.1:8443/"]).expect("an https target");
        assert_eq!(
            http.target,
            Target::Http {
                authority: "127.0.0.1:8443".into(),
                path: "/v1/check".into()
            }
        );
        assert!(http.tls.is_some());
        let grpc = plan(&["--grpc", "https://localhost:8081"]).expect("a gRPC TLS target");
        assert_eq!(
            grpc.target,
            Target::Grpc {
                authority: "localhost:8081".into()
            }
        );
        assert!(grpc.tls.is_some());
        for plain in [
            &["--target", "http://x:1"][..],
            &["--grpc", "http://x:1"],
            &["--grpc", "x:1"],
        ] {
            assert!(
                plan(plain).expect("a plain target").tls.is_none(),
                "{plain:?}"
            );
            let err = plan(&[plain, &["--tls-server-name", "x"][..]].concat())
                .err()
                .unwrap_or_default();
            assert!(
                err.contains("are for an https:// target"),
                "{plain:?}: {err}"
            );
        }
        let err = plan(&["--grpc", "https://x:1", "--tls-ca", "/nonexistent/ca.pem"])
            .err()
            .unwrap_or_default();
        assert!(err.contains("--tls-ca /nonexistent/ca.pem"), "{err}");
        let err = plan(&[
            "--grpc",
            "https://[::1]:1",
            "--tls-server-name",
            "not a name!",
        ])
        .err()
        .unwrap_or_default();
        assert!(err.contains("no TLS server name"), "{err}");
        assert!(
            plan(&["--grpc", "https://[::1]:1"]).is_ok(),
            "an IPv6 address names the server"
        );
    }

    #[test]
    fn http2_workers_share_connections_only_when_asked() {
        let connections =
            |args: &[&str]| plan(args).map(|p| (p.http2, p.concurrency, p.connections));
        assert_eq!(
            connections(&["--grpc", "x:1", "-c", "8"]),
            Ok((false, 8, 8))
        );
        assert_eq!(
            connections(&["--grpc", "x:1", "-c", "8", "--connections", "2"]),
            Ok((false, 8, 2))
        );
        assert_eq!(
            connections(&["--target", "http://x:1", "-c", "8"]),
            Ok((false, 8, 8))
        );
        assert_eq!(
            connections(&["--target", "http://x:1", "--http2", "-c", "8"]),
            Ok((true, 8, 8))
        );
        assert_eq!(
            connections(&[
                "--target",
                "http://x:1",
                "--http2",
                "-c",
                "8",
                "--connections",
                "1"
            ]),
            Ok((true, 8, 1))
        );
        assert_eq!(
            connections(&[
                "--target",
                "http://x:1",
                "--http2",
                "--forward-auth",
                "-c",
                "2"
            ]),
            Ok((true, 2, 2))
        );
    }

    #[test]
    fn open_loop_spaces_requests_by_the_rate() {
        let plan = plan(&["--target", "http://x:1", "-c", "4", "--rate", "1000"]);
        assert_eq!(plan.map(|p| p.interval), Ok(Some(Duration::from_millis(1))));
    }

    #[test]
    fn headers_are_name_colon_value_and_not_the_generators_own() {
        let headers = |args: &[&str]| plan(args).map(|p| p.headers);
        let given = headers(&[
            "--target",
            "http://x:1",
            "-H",
            "Authorization: Bearer t0k",
            "--header",
            "traceparent:00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ])
        .expect("headers");
        assert_eq!(given["authorization"], "Bearer t0k");
        assert_eq!(
            given["traceparent"],
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        );
        for (bad, reason) in [
            ("no colon", "expected NAME: VALUE"),
            ("bad name: x", "not a header name"),
            ("x-ok: line\nbreak", "not a header value"),
            ("Content-Type: text/plain", "sets content-type itself"),
            ("host: elsewhere", "sets host itself"),
        ] {
            let err = headers(&["--grpc", "x:1", "-H", bad])
                .err()
                .unwrap_or_default();
            assert!(err.contains(reason), "{bad:?}: {err}");
        }
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("10").is_err());
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3_600)));
        assert_eq!(parse_duration("2d"), Ok(Duration::from_secs(172_800)));
        assert!(parse_duration("1w").is_err());
        assert!(parse_duration("ms").is_err());
    }

    #[test]
    fn counts_and_times_are_held_to_their_bounds() {
        let http = |extra: &[&str]| plan(&[&["--target", "http://x:1"][..], extra].concat());
        let bound = |extra: &[&str], expected: &str| {
            let err = http(extra).err().unwrap_or_default();
            assert!(err.contains(expected), "{extra:?}: {err:?}");
        };
        assert_eq!(http(&["-c", "10000"]).map(|p| p.concurrency), Ok(10_000));
        bound(&["-c", "10001"], "--concurrency must be 1 to 10000");
        assert_eq!(
            plan(&["--grpc", "x:1", "-c", "4", "--connections", "4"]).map(|p| p.connections),
            Ok(4)
        );
        assert_eq!(
            http(&["--keys", "10000000"]).map(|p| p.keys),
            Ok(10_000_000)
        );
        bound(&["--keys", "10000001"], "--keys must be 1 to 10000000");
        // A run stops after its requests or its duration; a zero duration is refused only
        // where it would be the one that counts.
        bound(&["-d", "0s"], "--duration must be above 0");
        assert_eq!(
            http(&["-d", "0s", "-n", "5"]).map(|p| p.stop),
            Ok(Stop::Count(5))
        );
        assert_eq!(
            http(&["-d", "3s"]).map(|p| p.stop),
            Ok(Stop::After(Duration::from_secs(3)))
        );
        bound(&["--domain", ""], "must not be empty");
        bound(&["--key-entry", ""], "must not be empty");
        bound(&["--timeout", "0s"], "--timeout must be above 0");
        for rate in ["--rate=0", "--rate=-1", "--rate=inf", "--rate=NaN"] {
            bound(&[rate], "--rate must be above 0");
        }
        bound(&["--rate", "1e-300"], "is too low");
        bound(&["--rate", "1e300"], "is too high");
        assert_eq!(
            http(&["--rate", "0.5"]).map(|p| p.interval),
            Ok(Some(Duration::from_secs(2)))
        );
    }
}
