//! Global limits end to end: `tollgate serve` processes in two "regions", each on its own
//! memory store, sharing `scope: global` limits through one test Redis (`--global-store`).

mod support;

use std::path::Path;
use std::time::Duration;

use support::{Scratch, Server, assert_serve_flags_refused, metric, path_str, post_json, request};
use tollgate::{Clock, MonotonicClock};
use tollgate_redis::test_server::RedisServer;

const POLICY: &str = r#"
version: "global"
limits:
  - name: tenant-worldwide
    domain: api
    key: [tenant]
    capacity: 40
    refill: 20/s
    scope: global
    failure_mode: closed
  - name: tenant-lenient
    domain: lenient
    key: [tenant]
    capacity: 40
    refill: 20/s
    scope: global
    failure_mode: open
    emergency: 2/h
  - name: per-user
    domain: api
    key: [user]
    capacity: 5
    refill: 1/h
"#;

/// What the tests read of the logs: the global limits' background rounds alone.
const GLOBAL_LOGS: &str = "tollgate_server::global=info";

fn in_region(config: &Path, redis: &RedisServer, region: &str) -> Server {
    in_region_with(config, redis, region, Server::start)
}

/// A region's server, started by `start` (with its logs or without).
fn in_region_with<T>(
    config: &Path,
    redis: &RedisServer,
    region: &str,
    start: impl FnOnce(&[&str]) -> T,
) -> T {
    start(&[
        "--config",
        path_str(config),
        "--global-store",
        &redis.url(),
        "--global-store-timeout",
        "2s",
        "--region",
        region,
        "--rebalance-interval",
        "100ms",
    ])
}

fn check(server: &Server, domain: &str, tenant: &str, user: &str) -> u16 {
    let body = format!(
        r#"{{"domain":"{domain}","descriptors":[{{"tenant":"{tenant}","user":"{user}"}}]}}"#
    );
    let answer = post_json(server.http, "/v1/check", &body);
    assert!(matches!(answer.status, 200 | 429 | 503), "{}", answer.body);
    answer.status
}

/// Two regions hammer one tenant's global limit for two seconds: together they admit no more
/// than its bucket allows over the run (40 + 20 a second), both get a fair part of it, and the
/// reservoirs were topped up in the background.
#[test]
fn two_regions_share_a_global_limit_without_over_admitting() {
    let redis = RedisServer::start();
    let scratch = Scratch::new("global-shared");
    let config = scratch.write("policy.yaml", POLICY);
    let (eu, eu_logs) = in_region_with(&config, &redis, "eu", |args| {
        Server::start_logging(args, GLOBAL_LOGS)
    });
    let regions = [eu, in_region(&config, &redis, "us")];
    // Two of the three limits are global: the banner says so, and where they are kept.
    let global = format!(
        "  global limits  2 on {} (region us, rebalanced every 100ms)",
        redis.url()
    );
    assert!(
        regions[1].banner.lines().any(|line| line == global),
        "{}",
        regions[1].banner
    );
    let clock = MonotonicClock::new();
    let start = clock.now();
    let run = Duration::from_secs(2);
    let admitted: Vec<usize> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..6)
            .map(|worker| {
                let server = &regions[worker % 2];
                let clock = &clock;
                scope.spawn(move || {
                    let mut admitted = 0;
                    let mut n = 0u32;
                    while clock.now().saturating_duration_since(start) < run && n < 20_000 {
                        // Each request its own user, so only the global limit can reject.
                        let user = format!("w{worker}-{n}");
                        admitted += usize::from(check(server, "api", "acme", &user) == 200);
                        n += 1;
                    }
                    admitted
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let elapsed = clock.now().saturating_duration_since(start);
    let eu: usize = admitted.iter().step_by(2).sum();
    let us: usize = admitted.iter().skip(1).step_by(2).sum();
    let bound = 40 + (20 * elapsed.as_millis()).div_ceil(1_000) as usize;
    assert!(
        eu + us <= bound,
        "admitted {eu} + {us} > {bound} in {elapsed:?}"
    );
    // Both ran flat out the whole time: each gets a fair part, and together most of it.
    assert!(
        eu >= bound / 5 && us >= bound / 5,
        "eu {eu}, us {us} of {bound}"
    );
    // What sits unspent in the reservoirs at the end is all that is lost (79 of 81 here).
    assert!(eu + us >= bound * 3 / 4, "admitted {eu} + {us} of {bound}");
    let policy = request(regions[0].http, "GET", "/v1/policy", &[], "").json();
    assert_eq!(policy["limits"][0]["scope"], "global");
    for region in &regions {
        assert!(metric(region, "tollgate_global_fetched_tokens_total") > 0.0);
        assert_eq!(metric(region, "tollgate_global_reservoirs"), 1.0);
    }
    // A regional limit still decides here alone: user pat has 5 in each region.
    let regional: Vec<usize> = regions
        .iter()
        .map(|r| {
            (0..8)
                .filter(|_| check(r, "api", "other", "pat") == 200)
                .count()
        })
        .collect();
    assert_eq!(regional, [5, 5]);
    // Explaining a global limit no reservoir holds yet reads the global bucket, charging
    // nothing (the limit 40 + 20/s, one more request leaving 39).
    let fresh = r#"{"domain":"api","descriptors":[{"tenant":"fresh","user":"f"}]}"#;
    for _ in 0..2 {
        let explain = post_json(regions[0].http, "/v1/explain", fresh);
        assert_eq!(explain.status, 200, "{}", explain.body);
        let worldwide = &explain.json()["limits"][0];
        assert_eq!(worldwide["name"], "tenant-worldwide", "{}", explain.body);
        assert_eq!(worldwide["remaining"], 39, "{}", explain.body);
    }
    let [eu, us] = regions;
    // On the way out each region gives back what its reservoirs still hold, and says so.
    let logs = eu.terminate_and_read(eu_logs);
    assert!(
        logs.contains("gave back the global limits' unspent reservoirs"),
        "{logs}"
    );
    assert!(!logs.contains("did not answer"), "{logs}");
    assert!(us.terminate().success());
}

/// The global store dies: each region goes on spending what its reservoir holds, then a
/// closed global limit answers 503 and an open one its emergency budget, as for any store.
#[test]
fn with_the_global_store_killed_a_region_spends_what_it_holds_then_fails_as_configured() {
    let mut redis = RedisServer::start();
    let scratch = Scratch::new("global-killed");
    let config = scratch.write("policy.yaml", POLICY);
    let (server, logs) = in_region_with(&config, &redis, "eu", |args| {
        Server::start_logging(args, GLOBAL_LOGS)
    });
    // Fill both reservoirs with a few requests and a round or two.
    for n in 0..5 {
        assert_eq!(check(&server, "api", "acme", &format!("u{n}")), 200);
        assert_eq!(check(&server, "lenient", "acme", &format!("u{n}")), 200);
    }
    redis.kill();
    let clock = MonotonicClock::new();
    let start = clock.now();
    let (mut closed, mut open) = (Vec::new(), Vec::new());
    let mut n = 0;
    while clock.now().saturating_duration_since(start) < Duration::from_secs(5) {
        closed.push(check(&server, "api", "acme", &format!("k{n}")));
        let body =
            format!(r#"{{"domain":"lenient","descriptors":[{{"tenant":"acme","user":"k{n}"}}]}}"#);
        let answer = post_json(server.http, "/v1/check", &body);
        open.push((answer.status, answer.json()["degraded"] == true));
        n += 1;
        if closed.ends_with(&[503; 3]) && open.iter().filter(|(_, degraded)| *degraded).count() >= 3
        {
            break;
        }
    }
    assert!(closed.ends_with(&[503; 3]), "{closed:?}");
    // What was held is spent before the failure mode applies; nothing after it is admitted.
    let first_down = closed.iter().position(|&s| s == 503).unwrap();
    assert!(closed[first_down..].iter().all(|&s| s == 503), "{closed:?}");
    let degraded: Vec<u16> = open.iter().filter(|(_, d)| *d).map(|(s, _)| *s).collect();
    assert!(degraded.len() >= 3, "{open:?}");
    assert!(
        degraded.iter().filter(|&&s| s == 200).count() <= 2,
        "the emergency budget, never unlimited: {open:?}"
    );
    // Rounds fail too (each may wait out the 2 s timeout first).
    let waited = MonotonicClock::new();
    let since = waited.now();
    while metric(&server, "tollgate_global_round_failures_total") == 0.0 {
        assert!(
            waited.now().saturating_duration_since(since) < Duration::from_secs(10),
            "no round failed"
        );
        std::thread::yield_now();
    }
    // Failed rounds are logged; nothing is given back to a store that is gone.
    let logs = server.terminate_and_read(logs);
    assert!(
        logs.contains("the global store did not answer part of a rebalancing round"),
        "{logs}"
    );
    assert!(!logs.contains("gave back"), "{logs}");
}

#[test]
fn global_flags_refuse_what_cannot_work() {
    assert_serve_flags_refused(&[
        ("--region", "eu west", "is not a region name"),
        ("--rebalance-interval", "1ms", "is shorter than 10ms"),
        ("--rebalance-interval", "2m", "is longer than 1m"),
    ]);
    let refused = support::serve_refused(&["--global-store", "http://127.0.0.1:1"]);
    assert!(refused.contains("cannot use the global store"), "{refused}");
    // A global limit Redis cannot keep exactly (9 tokens every 7 ns) is refused before the
    // global store is reached; the regional limits beside it stay on the memory store, which
    // keeps any.
    let scratch = Scratch::new("global-unkeepable");
    let odd = POLICY.replacen("refill: 20/s", "refill: 9/7ns", 1);
    let config = scratch.write("policy.yaml", &odd);
    let refused = support::serve_refused(&[
        "--config",
        path_str(&config),
        "--global-store",
        "redis://127.0.0.1:1",
    ]);
    assert!(
        refused.contains("global limit tenant-worldwide cannot be kept in Redis"),
        "{refused}"
    );
}

/// `--global-store` with a policy that has no global limit is not an error (a reload may bring
/// one), but likely a mistake: it is said at start.
#[test]
fn a_global_store_without_global_limits_is_warned_of() {
    let redis = RedisServer::start();
    let scratch = Scratch::new("global-none");
    let regional = POLICY.replace("    scope: global\n", "");
    let config = scratch.write("policy.yaml", &regional);
    let (server, logs) = in_region_with(&config, &redis, "eu", |args| {
        Server::start_logging(args, "tollgate_server=warn")
    });
    assert!(
        server.banner.contains("global limits  0 on"),
        "{}",
        server.banner
    );
    let logs = server.terminate_and_read(logs);
    assert!(
        logs.contains("--global-store is set but no limit of the policy is `scope: global`"),
        "{logs}"
    );
}

/// `--global-max-keys` bounds the reservoirs a process holds (a key past it is fetched for its
/// request alone), and `--global-abandon-after` gives a quiet one back.
#[test]
fn reservoirs_are_bounded_and_quiet_ones_given_back() {
    let redis = RedisServer::start();
    let scratch = Scratch::new("global-bounds");
    let config = scratch.write("policy.yaml", POLICY);
    let bounds = ["--global-max-keys", "1", "--global-abandon-after", "1s"];
    let server = in_region_with(&config, &redis, "eu", |args| {
        Server::start(&[args, &bounds[..]].concat())
    });
    let reservoirs = || metric(&server, "tollgate_global_reservoirs");
    // One tenant busy for a second and a half, another asking once: the first holds the one
    // reservoir there is, through rounds every 100 ms.
    assert_eq!(check(&server, "api", "busy", "u0"), 200);
    assert_eq!(check(&server, "api", "once", "u0"), 200);
    let clock = MonotonicClock::new();
    let start = clock.now();
    let mut most = 0.0_f64;
    let mut n = 1;
    while clock.now().saturating_duration_since(start) < Duration::from_millis(1_500) {
        check(&server, "api", "busy", &format!("u{n}"));
        most = most.max(reservoirs());
        n += 1;
    }
    assert_eq!(most, 1.0, "reservoirs held at most");
    // Quiet for a second, it is given back.
    support::wait_for("the quiet reservoir given back", || {
        (reservoirs() == 0.0).then_some(())
    });
    assert!(metric(&server, "tollgate_global_given_back_tokens_total") > 0.0);
}

/// A rebalancing round runs every `--rebalance-interval`, timed in a histogram whose count is
/// the rounds run: over the same two seconds, a process asked for rounds every 100 ms runs
/// about twenty, one asked for a round a second at most three.
#[test]
fn rounds_run_every_rebalance_interval_and_are_timed() {
    let redis = RedisServer::start();
    let scratch = Scratch::new("global-rounds");
    let config = scratch.write("policy.yaml", POLICY);
    let often = in_region(&config, &redis, "eu");
    let seldom = Server::start(&[
        "--config",
        path_str(&config),
        "--global-store",
        &redis.url(),
        "--region",
        "us",
        "--rebalance-interval",
        "1s",
    ]);
    let rounds = |server: &Server| metric(server, "tollgate_global_round_duration_seconds_count");
    // Traffic on both, so that the rounds have reservoirs to top up.
    assert_eq!(check(&often, "api", "t1", "u1"), 200);
    assert_eq!(check(&seldom, "api", "t1", "u2"), 200);
    let before = [rounds(&often), rounds(&seldom)];
    let clock = MonotonicClock::new();
    let start = clock.now();
    #[allow(clippy::disallowed_methods)]
    std::thread::sleep(Duration::from_secs(2));
    let after = [rounds(&often), rounds(&seldom)];
    let elapsed = clock.now().saturating_duration_since(start);
    let ran = [after[0] - before[0], after[1] - before[1]];
    // The scrapes bracket the sleep, so at most a round more than the whole seconds elapsed.
    let most_seldom = elapsed.as_secs_f64().ceil() + 1.0;
    assert!(
        ran[0] >= 10.0,
        "every 100 ms: {ran:?} rounds in {elapsed:?}"
    );
    assert!(
        (1.0..=most_seldom).contains(&ran[1]),
        "every second: {ran:?} rounds in {elapsed:?}"
    );
    // A histogram with the rounds' buckets, not a summary; every round here took under 10 s.
    let text = request(often.http, "GET", "/metrics", &[], "").body;
    let series = |name: &str| -> f64 {
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in\n{text}"))
    };
    assert!(
        text.contains("# TYPE tollgate_global_round_duration_seconds histogram"),
        "{text}"
    );
    let count = series("tollgate_global_round_duration_seconds_count");
    assert!(count >= after[0], "{text}");
    assert_eq!(
        series("tollgate_global_round_duration_seconds_bucket{le=\"10\"}"),
        count
    );
}
