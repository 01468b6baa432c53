//! `GET /dashboard` on the real binary: the page is served with its guards, and everything it
//! reads exists under the names it reads them by, so renaming a metric or an endpoint breaks
//! this test rather than the page; and the page's script, run in a headless Chromium against
//! a server under traffic, shows what the server counts (`support::browser`).

mod support;

use support::browser::Browser;
use support::nginx::Nginx;
use support::rlqs::{Envoy, usage};
use support::{Scratch, Server, metric, path_str, post_json, request};
use tollgate_redis::test_server::RedisServer;

/// What the page's script reads, by name: endpoints, and metric series in `/metrics`.
/// Relative to the page, so that a proxy serving the server under a prefix serves them too.
const ENDPOINTS: [&str; 4] = ["metrics", "readyz", "v1/policy", "v1/hot-keys"];
/// The first six are on every server once its decisions have run a limit near its end (the
/// test's do); the others appear once what they count happens (a store error, a rejection
/// answered from memory on Redis, a settlement).
const SERIES: [&str; 9] = [
    "tollgate_decisions_total",
    "tollgate_near_limit_decisions_total",
    "tollgate_decision_duration_seconds_bucket",
    "tollgate_unmatched_requests_total",
    "tollgate_live_buckets",
    "tollgate_live_leases",
    "tollgate_store_errors_total",
    "tollgate_remembered_rejections_total",
    "tollgate_settlements_total",
];

#[test]
fn the_page_is_served_and_what_it_reads_is_there() {
    let server = Server::start(&["--hot-keys", "5"]);
    let page = request(server.http, "GET", "/dashboard", &[], "");
    assert_eq!(page.status, 200, "{}", page.body);
    assert_eq!(
        page.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    assert_eq!(page.header("cache-control"), Some("no-store"));
    let csp = page.header("content-security-policy").unwrap_or_default();
    assert!(
        csp.contains("default-src 'none'") && csp.contains("connect-src 'self'"),
        "{csp}"
    );
    assert!(page.body.starts_with("<!doctype html>"));
    assert!(
        !page.body.contains("http://") && !page.body.contains("https://"),
        "the page loads nothing from elsewhere"
    );

    // A few decisions, rejected ones and an unmatched one among them, so that the series the
    // page reads have samples (a store error series is absent on the memory store: the page
    // sums an absent series as 0).
    let body = r#"{"domain":"api","descriptors":[{"user":"u1"}]}"#;
    for _ in 0..12 {
        assert!(matches!(
            post_json(server.http, "/v1/check", body).status,
            200 | 429
        ));
    }
    let unmatched = r#"{"domain":"elsewhere","descriptors":[{"user":"u1"}]}"#;
    assert_eq!(post_json(server.http, "/v1/check", unmatched).status, 200);
    for path in ENDPOINTS {
        assert!(
            page.body.contains(&format!("\"{path}\"")),
            "the page reads {path}"
        );
        let answer = request(server.http, "GET", &format!("/{path}"), &[], "");
        assert_eq!(answer.status, 200, "{path}: {}", answer.body);
    }
    let metrics = request(server.http, "GET", "/metrics", &[], "").body;
    for series in SERIES {
        assert!(page.body.contains(series), "the page reads {series}");
    }
    // The series of hits given back, and the RLQS and global-limit cards', appear only on
    // servers taking them, with Envoys on RLQS or a global store; read by the names the
    // server records them under.
    use tollgate_server::metrics;
    for series in [
        metrics::GIVEN_BACK,
        metrics::RLQS_STREAMS,
        metrics::RLQS_ANSWERS,
        metrics::RLQS_RENEWED,
        metrics::RLQS_PREPAID,
        metrics::GLOBAL_RESERVOIRS,
        metrics::GLOBAL_HELD,
        metrics::GLOBAL_FETCHED,
        metrics::GLOBAL_GIVEN_BACK,
        metrics::GLOBAL_ROUND_FAILURES,
    ] {
        assert!(
            page.body.contains(&format!("\"{series}\"")),
            "the page reads {series}"
        );
    }
    for series in &SERIES[..6] {
        assert!(
            metrics.lines().any(|line| line.starts_with(series)),
            "{series} is not in /metrics:\n{metrics}"
        );
    }
    // The labels the page splits decisions by.
    let decision = metrics
        .lines()
        .find(|line| line.starts_with("tollgate_decisions_total{") && line.contains("rejected"))
        .unwrap_or_else(|| panic!("no rejected decision in\n{metrics}"));
    for label in [
        "limit=\"per-user\"",
        "result=\"rejected\"",
        "mode=\"enforce\"",
    ] {
        assert!(decision.contains(label), "{decision}");
    }
}

#[test]
fn with_an_admin_token_the_page_is_public_and_its_admin_reads_are_not() {
    let server = Server::start(&["--admin-token", "s3cret"]);
    assert_eq!(
        request(server.http, "GET", "/dashboard", &[], "").status,
        200
    );
    assert_eq!(
        request(server.http, "GET", "/v1/policy", &[], "").status,
        401
    );
    let authorized = request(
        server.http,
        "GET",
        "/v1/policy",
        &[("Authorization", "Bearer s3cret")],
        "",
    );
    assert_eq!(authorized.status, 200, "{}", authorized.body);
}

/// What the page shows, read in one go: the header, the cards, the limits and hot keys tables
/// (their cells' text), whether it asks for a token, a refused policy load, and how many
/// pixels of the chart above its zero line are in the allowed and rejected lines' colours.
const READ_PAGE: &str = r##"
const text = id => document.getElementById(id).textContent;
const rows = id => [...document.querySelectorAll("#" + id + " tr")]
  .map(tr => [...tr.cells].map(td => td.textContent));
const canvas = document.getElementById("chart");
const pixels = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
const near = (i, [r, g, b]) => pixels[i + 3] > 128 &&
  Math.abs(pixels[i] - r) + Math.abs(pixels[i + 1] - g) + Math.abs(pixels[i + 2] - b) < 60;
// Above the zero line (20 px from the bottom, as the page draws it): a line of zeros is drawn too.
const above = (canvas.height - 24) * canvas.width * 4;
let allowed = 0, rejected = 0;
for (let i = 0; i < above; i += 4) {
  if (near(i, [0x25, 0x63, 0xeb])) allowed++;
  if (near(i, [0xd6, 0x27, 0x28])) rejected++;
}
const errorShown = document.getElementById("policy-error").style.display !== "none";
const shadowAllShown = document.getElementById("shadow-all").style.display !== "none";
return {
  version: text("version"), source: text("source"), store: text("store"), updated: text("updated"),
  rate: text("c-rate"), rejected: text("c-rejected"), shadow: text("c-shadow"), p99: text("c-p99"),
  buckets: text("c-buckets"), givenBack: text("c-given-back"), limits: rows("limits"),
  hot: rows("hot"),
  tokenShown: getComputedStyle(document.getElementById("token")).display !== "none",
  token: sessionStorage.getItem("tollgate-token"),
  policyError: errorShown ? text("policy-error-text") : null,
  shadowAll: shadowAllShown ? text("shadow-all-text") : null,
  chart: { allowed, rejected },
  // How far the page is wider than the window: a row of cards or a table's columns
  // pushing the rest out of sight.
  overflow: document.documentElement.scrollWidth - document.documentElement.clientWidth,
  width: document.documentElement.clientWidth,
  rlqs: document.getElementById("rlqs").style.display === "none" ? null : text("q-streams"),
};
"##;

/// A number as the page writes it (`1,234.5`), or `None` for a dash or anything else.
fn shown(value: &serde_json::Value) -> Option<f64> {
    value.as_str()?.replace(',', "").parse().ok()
}

/// The page's last read of `/metrics` went through (a failed one says so where the time of
/// the last read goes) and the store it shows is ready.
fn assert_read_the_server(page: &serde_json::Value) {
    assert!(
        page["updated"]
            .as_str()
            .is_some_and(|text| text.starts_with("updated ")),
        "{page:#}"
    );
    assert_eq!(page["store"], "memory · ready", "{page:#}");
}

/// The row of the limits table for `name`.
fn limit_row<'a>(page: &'a serde_json::Value, name: &str) -> Option<&'a Vec<serde_json::Value>> {
    page["limits"]
        .as_array()?
        .iter()
        .filter_map(serde_json::Value::as_array)
        .find(|row| row.first().and_then(serde_json::Value::as_str) == Some(name))
}

/// Checks sent to a server from a thread of their own until dropped: one user well past its
/// limit, one within it, all of one tenant on a shadow limit.
struct Traffic {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Traffic {
    #[allow(clippy::disallowed_methods)]
    fn start(server: &Server) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let http = server.http;
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            for n in 0u64.. {
                if stopped.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                let user = if n % 4 == 0 { "calm" } else { "busy" };
                let body = format!(
                    r#"{{"domain":"api","descriptors":[{{"tenant":"trial","user":"{user}"}}]}}"#
                );
                let answer = post_json(http, "/v1/check", &body);
                assert!(matches!(answer.status, 200 | 429), "{}", answer.body);
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Traffic {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

const POLICY: &str = "version: dash-1
limits:
  - {name: per-user, domain: api, key: [user], capacity: 10, refill: 5/s}
  - {name: trial-tenants, domain: api, key: [tenant], capacity: 5, refill: 1/s, mode: shadow}
";

/// The page's script run in a real browser against a server under traffic: the cards, the
/// limits table with each limit as configured, the hot keys, the chart's lines, the policy in
/// force, and a refused policy load shown until a good one replaces it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_browser_the_page_shows_the_traffic_and_the_policy() {
    let scratch = Scratch::new("dashboard-browser");
    let config = scratch.write("policy.yaml", POLICY);
    let server = Server::start(&[
        "--config",
        path_str(&config),
        "--hot-keys",
        "5",
        "--hot-keys-window",
        "1s",
    ]);
    let traffic = Traffic::start(&server);
    let browser = Browser::open().await;
    browser.visit(&server.url("/dashboard")).await;

    // Rates need two reads of /metrics, two seconds apart, and the chart one point per read
    // after the first: wait for what a few reads under traffic show.
    let page = browser
        .wait_until(
            "rates, the limits, hot keys and both lines of the chart",
            READ_PAGE,
            |page| {
                shown(&page["rate"]).is_some_and(|rate| rate > 0.0)
                    && shown(&page["rejected"]).is_some_and(|rate| rate > 0.0)
                    && shown(&page["shadow"]).is_some_and(|rate| rate > 0.0)
                    && limit_row(page, "per-user").is_some()
                    && limit_row(page, "trial-tenants").is_some()
                    && page["hot"].as_array().is_some_and(|rows| rows.len() >= 2)
                    && page["chart"]["allowed"].as_u64() > Some(0)
                    && page["chart"]["rejected"].as_u64() > Some(0)
                    && page["version"] == "dash-1"
            },
        )
        .await;
    assert_read_the_server(&page);
    assert!(
        page["source"]
            .as_str()
            .is_some_and(|text| text.contains("policy.yaml")),
        "{page:#}"
    );
    assert!(
        page["p99"]
            .as_str()
            .is_some_and(|text| text.starts_with("≤ ")),
        "{page:#}"
    );
    assert!(
        shown(&page["buckets"]).is_some_and(|buckets| buckets >= 3.0),
        "{page:#}"
    );
    // No RLS call gave hits back: a rate of 0, read like the others.
    assert_eq!(shown(&page["givenBack"]), Some(0.0), "{page:#}");
    assert!(!page["tokenShown"].as_bool().unwrap_or(true), "{page:#}");
    assert_eq!(page["policyError"], serde_json::Value::Null);
    assert_eq!(
        page["overflow"], 0,
        "the page is wider than the window: {page:#}"
    );
    assert_eq!(
        page["rlqs"],
        serde_json::Value::Null,
        "no Envoy on RLQS yet: {page:#}"
    );

    // Each limit as the policy gives it, enforced rejections on the enforced one only, and
    // would-rejects on the shadow one only.
    let enforced = limit_row(&page, "per-user").expect("the row");
    assert_eq!(enforced[1], "token_bucket: 10 burst, 5/s", "{page:#}");
    assert!(
        shown(&enforced[3]).is_some_and(|rate| rate > 0.0),
        "{page:#}"
    );
    assert!(
        enforced[4]
            .as_str()
            .is_some_and(|share| share.ends_with(" %")),
        "{page:#}"
    );
    assert_eq!(enforced[6], "0", "{page:#}");
    let shadow = limit_row(&page, "trial-tenants").expect("the row");
    assert_eq!(shadow[1], "token_bucket: 5 burst, 1/s · shadow", "{page:#}");
    assert_eq!(shadow[3], "0", "{page:#}");
    assert!(shown(&shadow[6]).is_some_and(|rate| rate > 0.0), "{page:#}");
    // The counts since start are the server's own, read before the page's next read can
    // have caught up with it.
    let counted = metric(
        &server,
        r#"tollgate_decisions_total{limit="per-user",result="rejected",mode="enforce",api="http"}"#,
    );
    let rejected_since_start = shown(&enforced[9]).expect("a count");
    assert!(
        rejected_since_start > 0.0 && rejected_since_start <= counted,
        "{rejected_since_start} on the page, {counted} counted"
    );
    let hot: Vec<String> = page["hot"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|row| row.to_string())
        .collect();
    assert!(
        hot.iter()
            .any(|row| row.contains("per-user") && row.contains("busy")),
        "{hot:?}"
    );

    // On a phone's width too: the cards wrap, and a wide table scrolls in its section.
    browser
        .client()
        .set_window_size(390, 844)
        .await
        .expect("a narrow window");
    let narrow = browser.run(READ_PAGE).await;
    assert!(narrow["width"].as_u64() < Some(400), "{narrow:#}");
    assert_eq!(narrow["overflow"], 0, "wider than a phone: {narrow:#}");
    browser
        .client()
        .set_window_size(1280, 900)
        .await
        .expect("the window back");

    // An Envoy on RLQS: its stream shows in cards that were hidden until then.
    let mut envoy = Envoy::connect(&server).await;
    let usage = usage(&[("user", "edge")], 5, 0, std::time::Duration::from_secs(1));
    assert_eq!(envoy.report("api", vec![usage]).await.len(), 1);
    browser
        .wait_until("the RLQS cards", READ_PAGE, |page| page["rlqs"] == "1")
        .await;
    drop(envoy);

    // The incident switch: the page says since when and why while it is on.
    let on = r#"{"on":true,"reason":"INC-42: false rejections"}"#;
    let json = [("Content-Type", "application/json")];
    let switched = request(server.http, "POST", "/v1/policy/shadow-all", &json, on);
    assert_eq!(switched.status, 200, "{}", switched.body);
    browser
        .wait_until("the switch shown", READ_PAGE, |page| {
            page["shadowAll"].as_str().is_some_and(|text| {
                text.starts_with("since ") && text.ends_with(": INC-42: false rejections")
            })
        })
        .await;
    // Narrowed, the page says to what.
    let narrowed = r#"{"on":true,"reason":"INC-43","domains":["api"],"limits":["trial-tenants"]}"#;
    let switched = request(
        server.http,
        "POST",
        "/v1/policy/shadow-all",
        &json,
        narrowed,
    );
    assert_eq!(switched.status, 200, "{}", switched.body);
    browser
        .wait_until("the narrowed switch shown", READ_PAGE, |page| {
            page["shadowAll"].as_str().is_some_and(|text| {
                text.ends_with(": INC-43 (only domain api, limit trial-tenants)")
            })
        })
        .await;
    let off = request(
        server.http,
        "POST",
        "/v1/policy/shadow-all",
        &json,
        r#"{"on":false}"#,
    );
    assert_eq!(off.status, 200, "{}", off.body);
    browser
        .wait_until("the switch gone", READ_PAGE, |page| {
            page["shadowAll"].is_null()
        })
        .await;

    // A policy file that cannot load: the reload is refused, the page says so, and the
    // version in force stays.
    scratch.write("policy.yaml", "version: dash-2\nlimits: [{name: broken}]\n");
    let refused = request(server.http, "POST", "/v1/policy/reload", &[], "");
    assert!(refused.status >= 400, "{}", refused.body);
    let page = browser
        .wait_until("the refused load", READ_PAGE, |page| {
            page["policyError"]
                .as_str()
                .is_some_and(|text| !text.is_empty())
        })
        .await;
    assert_eq!(page["version"], "dash-1", "{page:#}");
    // A good one replaces it, and the page forgets the refusal.
    scratch.write("policy.yaml", &POLICY.replace("dash-1", "dash-2"));
    let loaded = request(server.http, "POST", "/v1/policy/reload", &[], "");
    assert_eq!(loaded.status, 200, "{}", loaded.body);
    browser
        .wait_until("the new version and no refusal", READ_PAGE, |page| {
            page["version"] == "dash-2" && page["policyError"].is_null()
        })
        .await;

    drop(traffic);
    browser.close().await;
}

/// Behind an admin token the page asks for it, keeps asking while the token is wrong, reads
/// the admin endpoints once it is right, and keeps it across a reload of the tab.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_browser_the_page_asks_for_the_admin_token_and_keeps_it() {
    let server = Server::start(&["--admin-token", "s3cret"]);
    let browser = Browser::open().await;
    browser.visit(&server.url("/dashboard")).await;
    let page = browser
        .wait_until("the token form", READ_PAGE, |page| {
            page["tokenShown"] == true
        })
        .await;
    assert_eq!(
        page["version"], "–",
        "no policy without the token: {page:#}"
    );

    let enter = async |token: &str| {
        let input = browser
            .client()
            .find(fantoccini::Locator::Id("token-input"))
            .await
            .expect("the token field");
        input.clear().await.expect("cleared");
        input.send_keys(token).await.expect("typed");
        browser
            .client()
            .find(fantoccini::Locator::Css("#token button"))
            .await
            .expect("the button")
            .click()
            .await
            .expect("clicked");
    };
    enter("wrong").await;
    let page = browser
        .wait_until("the form again after a wrong token", READ_PAGE, |page| {
            page["token"] == "wrong" && page["tokenShown"] == true
        })
        .await;
    assert_eq!(page["version"], "–", "{page:#}");

    enter("s3cret").await;
    browser
        .wait_until("the policy read with the token", READ_PAGE, |page| {
            page["version"] == "demo-1" && page["tokenShown"] == false
        })
        .await;
    // Kept for the tab: a reload reads the policy without asking.
    browser.client().refresh().await.expect("reloaded");
    let page = browser
        .wait_until("the policy after a reload", READ_PAGE, |page| {
            page["version"] == "demo-1"
        })
        .await;
    assert_eq!(page["tokenShown"], false, "{page:#}");
    assert_eq!(page["token"], "s3cret", "{page:#}");
    browser.close().await;
}

/// Served under a prefix by a proxy (nginx here; `kubectl proxy` serves a service's port under
/// a path the same way), the page reads the server through the same prefix: its reads are
/// relative to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_browser_the_page_works_under_a_proxys_path_prefix() {
    let server = Server::start(&[]);
    let _traffic = Traffic::start(&server);
    let nginx = Nginx::start(&format!(
        "server {{\n  listen LISTEN;\n  location /tollgate/ {{ proxy_pass http://{}/; }}\n}}",
        server.http
    ));
    let browser = Browser::open().await;
    browser
        .visit(&format!("http://{}/tollgate/dashboard", nginx.addr))
        .await;
    let page = browser
        .wait_until("the page read through the prefix", READ_PAGE, |page| {
            page["version"] == "demo-1"
                && shown(&page["rate"]).is_some_and(|rate| rate > 0.0)
                && limit_row(page, "per-user").is_some()
        })
        .await;
    assert_read_the_server(&page);
    browser.close().await;
}

/// On its way out (`--shutdown-delay`), the page says the server is not ready because it is
/// shutting down, not because of its store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_browser_the_page_says_when_the_server_is_shutting_down() {
    let server = Server::start(&["--shutdown-delay", "10m"]);
    let browser = Browser::open().await;
    browser.visit(&server.url("/dashboard")).await;
    browser
        .wait_until("the store ready", READ_PAGE, |page| {
            page["store"] == "memory · ready"
        })
        .await;
    server.signal("TERM");
    browser
        .wait_until("the store not ready", READ_PAGE, |page| {
            page["store"] == "memory · not ready (shutting down)"
        })
        .await;
    browser.close().await;
}

/// The fleet's switch, kept in the shared store, is named as such: turning it off here is
/// turning it off for every server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_browser_the_page_names_the_fleets_switch() {
    let redis = RedisServer::start();
    let server = Server::start(&["--store", &redis.url(), "--store-timeout", "2s"]);
    let browser = Browser::open().await;
    browser.visit(&server.url("/dashboard")).await;
    let json = [("Content-Type", "application/json")];
    let on = r#"{"on":true,"reason":"INC-44","fleet":true,"domains":["api"]}"#;
    let switched = request(server.http, "POST", "/v1/policy/shadow-all", &json, on);
    assert_eq!(switched.status, 200, "{}", switched.body);
    browser
        .wait_until("the fleet's switch named", READ_PAGE, |page| {
            page["shadowAll"].as_str().is_some_and(|text| {
                text.ends_with(": INC-44 (only domain api; the fleet's switch)")
            })
        })
        .await;
    browser.close().await;
}
