//! Arbitrary requests against the HTTP API, in this process: bodies built near the real shape
//! (right and wrong field names, values of every JSON type, numbers past every bound, keys
//! empty or too long), then some of them cut short or with a byte changed, and headers for
//! forward-auth. Whatever arrives, the server answers: on the memory store, which cannot fail,
//! never a 5xx; every refusal is a 4xx with `{"error":{"code","message"}}`; and neither a
//! refused nor a rejected (429) request charges anything, held by reading every bucket the
//! requests could reach before and after each one.
//!
//! The unit tests hold each refusal by name; this holds the handlers together against inputs
//! nobody thought to list.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::{Map, Value, json};
use tollgate_policy::{EngineOptions, PolicyEngine, compile};
use tollgate_server::http::MAX_BODY_BYTES;
use tollgate_server::{AppState, Backend, Decider, HttpOptions};
use tower_service::Service;

/// Rate limits that refill a token a day (so nothing refills during the test, and a charge
/// shows as a lower `remaining`) and a concurrency limit. Addresses and workers run out
/// during the run, so requests are rejected too, some for one limit while the other has room.
const POLICY: &str = r#"
version: arbitrary
limits:
  - name: per-user
    domain: api
    key: [user]
    capacity: 10000
    refill: 1/d
  - name: per-address
    domain: api
    key: [ip]
    capacity: 20
    refill: 1/d
  - name: workers
    domain: jobs
    key: [user]
    algorithm: concurrency
    max_in_flight: 20
    lease_timeout: 1h
"#;

/// The values requests draw their users and addresses from, so that they hit the buckets the
/// probes read; the last two are not probed: an empty one (a bucket of its own) and one too
/// long (refused).
fn values() -> Vec<String> {
    vec![
        "u1".into(),
        "u2".into(),
        "ü/ß".into(),
        "10.0.0.1".into(),
        String::new(),
        "k".repeat(5_000),
    ]
}

/// The buckets a request can charge: (endpoint, body) of each probe.
fn probes() -> Vec<(&'static str, String)> {
    let mut probes = Vec::new();
    for value in &values()[..4] {
        for (domain, entry) in [("api", "user"), ("api", "ip")] {
            probes.push((
                "/v1/explain",
                json!({"domain": domain, "descriptors": [{entry: value}]}).to_string(),
            ));
        }
        probes.push((
            "/v1/leases/explain",
            json!({"domain": "jobs", "descriptors": [{"user": value}]}).to_string(),
        ));
    }
    probes
}

struct Api {
    router: axum::Router,
}

impl Api {
    fn new() -> Self {
        let policy = compile("arbitrary.yaml", POLICY).expect("the policy compiles");
        let engine = Arc::new(PolicyEngine::new(policy, EngineOptions::default()));
        let decider = Arc::new(Decider::new(engine, Backend::Memory));
        let options = HttpOptions {
            admin_token: None,
            forward_auth_headers: Vec::new(),
            forward_auth_deny: StatusCode::TOO_MANY_REQUESTS,
            forward_auth_address: None,
            rate_limit_headers: tollgate_tower::HeaderStyle::Ietf,
            negative_hits: tollgate_server::http::NegativeHits::Refuse,
        };
        let state = Arc::new(AppState::new(decider, None, options));
        Self {
            router: tollgate_server::http::router(state),
        }
    }

    async fn send(&mut self, request: &Sent) -> (StatusCode, Vec<u8>) {
        let mut builder = Request::builder()
            .method(request.method.clone())
            .uri(&request.path);
        for (name, value) in &request.headers {
            builder = builder.header(name.as_str(), value.as_slice());
        }
        let mut http = builder
            .body(Body::from(request.body.clone()))
            .expect("a request the generator builds is valid HTTP");
        let peer: SocketAddr = ([127, 0, 0, 1], 40_000).into();
        http.extensions_mut().insert(ConnectInfo(peer));
        let answer = match self.router.call(http).await {
            Ok(answer) => answer,
            Err(never) => match never {},
        };
        let status = answer.status();
        let body = answer
            .into_body()
            .collect()
            .await
            .expect("an answer's body is read")
            .to_bytes()
            .to_vec();
        (status, body)
    }

    /// What every probe reads: the `remaining` of each limit it names.
    async fn balances(&mut self) -> Vec<u64> {
        let mut all = Vec::new();
        for (path, body) in probes() {
            let sent = Sent::post(path, body.into_bytes());
            let (status, answer) = self.send(&sent).await;
            assert_eq!(
                status,
                StatusCode::OK,
                "{}",
                String::from_utf8_lossy(&answer)
            );
            let answer: Value = serde_json::from_slice(&answer).expect("a probe answers JSON");
            let limits = answer["limits"].as_array().expect("limits");
            assert_eq!(limits.len(), 1, "{answer}");
            all.push(limits[0]["remaining"].as_u64().expect("remaining"));
        }
        all
    }
}

/// A request as generated.
#[derive(Clone)]
struct Sent {
    method: Method,
    path: String,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
}

/// Bodies and header values as text, where a failure is read.
impl std::fmt::Debug for Sent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let headers: Vec<_> = self
            .headers
            .iter()
            .map(|(name, value)| (name, String::from_utf8_lossy(value)))
            .collect();
        f.debug_struct("Sent")
            .field("method", &self.method)
            .field("path", &self.path)
            .field("headers", &headers)
            .field("body", &String::from_utf8_lossy(&self.body))
            .finish()
    }
}

impl Sent {
    fn post(path: &str, body: Vec<u8>) -> Self {
        Self {
            method: Method::POST,
            path: path.to_owned(),
            headers: Vec::new(),
            body,
        }
    }
}

/// A JSON value of any type, with strings from the buckets' values and arbitrary text.
fn any_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (-1e20f64..1e20).prop_map(Value::from),
        prop::sample::select(values()).prop_map(Value::String),
        "\\PC{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec((field_name(), inner), 0..4)
                .prop_map(|fields| Value::Object(fields.into_iter().collect())),
        ]
    })
}

/// Field and entry names: those the API reads, and others.
fn field_name() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "domain",
            "descriptors",
            "cost",
            "request_id",
            "used",
            "limits",
            "user",
            "ip",
            "hits_addend",
        ])
        .prop_map(str::to_owned),
        "\\PC{0,8}",
        Just("n".repeat(300)),
    ]
}

/// A cost: mostly valid, else each kind of wrong one.
fn cost() -> impl Strategy<Value = Value> {
    prop_oneof![
        8 => (1u64..8).prop_map(Value::from),
        1 => prop::sample::select(vec![
            json!(0),
            json!(10_000),
            json!(10_001),
            json!(u64::MAX),
            json!(-1),
            json!(1.5),
            json!("2"),
            Value::Null,
        ]),
    ]
}

/// `right` mostly, else `wrong`.
fn mostly<T: std::fmt::Debug + Clone + 'static>(
    right: impl Strategy<Value = T> + 'static,
    wrong: impl Strategy<Value = T> + 'static,
) -> BoxedStrategy<T> {
    prop_oneof![12 => right, 1 => wrong].boxed()
}

/// A body of the real shape for `path`, each part sometimes wrong.
fn shaped_body(path: &'static str) -> impl Strategy<Value = Value> {
    let domain = if path.starts_with("/v1/leases") {
        "jobs"
    } else {
        "api"
    };
    let right_entry = (
        prop::sample::select(vec!["user", "ip"]),
        prop::sample::select(values()[..4].to_vec()).prop_map(Value::String),
    )
        .prop_map(|(k, v)| (k.to_owned(), v));
    let wrong_entry = (
        prop_oneof![field_name(), Just(String::new())],
        prop_oneof![
            prop::sample::select(values()).prop_map(Value::String),
            any_value()
        ],
    );
    let entries = |n| prop::collection::vec(mostly(right_entry.clone(), wrong_entry.clone()), n);
    let object = |entries: Vec<(String, Value)>| Value::Object(entries.into_iter().collect());
    let descriptor = mostly(entries(1..3), entries(0..1))
        .prop_map(object)
        .boxed();
    let descriptors = mostly(
        prop::collection::vec(descriptor.clone(), 1..3).prop_map(Value::Array),
        prop_oneof![
            prop::collection::vec(descriptor, 0..1).prop_map(Value::Array),
            Just(Value::Array(vec![json!({"user": "u1"}); 40])),
            any_value(),
        ],
    );
    let request_id = mostly(
        prop::option::of("[a-z0-9]{1,6}".prop_map(Value::String)),
        prop::option::of(prop_oneof![
            Just(Value::String(String::new())),
            Just(Value::String("r".repeat(2_000))),
            any_value(),
        ]),
    );
    // The fields each endpoint takes beside the domain and descriptors; any other is refused.
    let (costs, ids, settles, names_limits) = match path {
        "/v1/check" | "/v1/explain" => (true, true, false, false),
        "/v1/settle" => (true, true, true, false),
        "/v1/reset" => (false, false, false, true),
        // Leases: one request in flight each, no cost.
        _ => (false, true, false, false),
    };
    (
        mostly(Just(domain), prop::sample::select(vec!["elsewhere", ""])),
        descriptors,
        prop::option::of(cost()),
        request_id,
        cost(),
        mostly(
            prop::sample::subsequence(vec!["per-user", "per-address", "workers"], 0..3)
                .prop_map(|names| json!(names)),
            any_value(),
        ),
        mostly(Just(None), prop::option::of((field_name(), any_value()))),
    )
        .prop_map(
            move |(domain, descriptors, cost, id, used, limits, extra)| {
                let mut body = Map::new();
                body.insert("domain".into(), Value::String(domain.into()));
                body.insert("descriptors".into(), descriptors);
                if let Some(cost) = cost.filter(|_| costs) {
                    body.insert("cost".into(), cost);
                }
                // A settlement names its reservation; it is optional elsewhere.
                let id = match id {
                    None if settles => Some(json!("r1")),
                    id => id,
                };
                if let Some(id) = id.filter(|_| ids) {
                    body.insert("request_id".into(), id);
                }
                if settles {
                    body.insert("used".into(), used);
                }
                if names_limits {
                    body.insert("limits".into(), limits);
                }
                if let Some((name, value)) = extra {
                    body.insert(name, value);
                }
                Value::Object(body)
            },
        )
}

/// Raw bytes for `path`: a body as JSON, then now and then cut short, a byte changed, or
/// grown past the bound.
fn body_bytes(path: &'static str) -> impl Strategy<Value = Vec<u8>> {
    let json = prop_oneof![6 => shaped_body(path), 1 => any_value()]
        .prop_map(|value| value.to_string().into_bytes());
    (json, 0u8..20, any::<prop::sample::Index>(), any::<u8>()).prop_map(
        |(mut bytes, how, at, byte)| {
            match how {
                0 if !bytes.is_empty() => bytes.truncate(at.index(bytes.len())),
                1 if !bytes.is_empty() => {
                    let i = at.index(bytes.len());
                    bytes[i] = byte;
                }
                2 => bytes.resize(MAX_BODY_BYTES + 1, b' '),
                _ => {}
            }
            bytes
        },
    )
}

/// Headers for forward-auth: entries, a cost, and others, with values of any bytes.
fn forward_auth_headers() -> impl Strategy<Value = Vec<(String, Vec<u8>)>> {
    let name = prop::sample::select(vec![
        "x-tollgate-user",
        "x-tollgate-ip",
        "x-tollgate-cost",
        "x-tollgate-",
        "x-forwarded-uri",
        "x-forwarded-method",
        "x-original-uri",
    ]);
    let value = prop_oneof![
        prop::sample::select(values()).prop_map(String::into_bytes),
        prop::sample::select(vec!["0", "1", "3", "-1", "99999999999999999999", "1.5"])
            .prop_map(|v| v.as_bytes().to_vec()),
        // Any bytes a header may carry: no control characters but tab.
        prop::collection::vec(prop_oneof![Just(b'\t'), 0x20u8..0x7f, 0x80u8..=0xff], 0..16),
    ];
    let entry = (
        prop::sample::select(vec!["x-tollgate-user", "x-tollgate-ip"]),
        prop::sample::select(values()[..4].to_vec()),
    )
        .prop_map(|(name, value)| vec![(name.to_owned(), value.into_bytes())]);
    (
        mostly(entry, Just(Vec::new())),
        prop::collection::vec((name.prop_map(str::to_owned), value), 0..3),
    )
        .prop_map(|(mut headers, more)| {
            headers.extend(more);
            headers
        })
}

fn any_request() -> impl Strategy<Value = Sent> {
    let posted = prop_oneof![
        3 => Just("/v1/check"),
        2 => Just("/v1/leases"),
        1 => Just("/v1/explain"),
        1 => Just("/v1/settle"),
        1 => Just("/v1/leases/explain"),
        1 => Just("/v1/reset"),
    ]
    .prop_flat_map(|path| {
        let method = mostly(
            Just(Method::POST),
            prop::sample::select(vec![
                Method::GET,
                Method::PUT,
                Method::DELETE,
                Method::PATCH,
            ]),
        );
        (method, body_bytes(path)).prop_map(move |(method, body)| Sent {
            method,
            ..Sent::post(path, body)
        })
    });
    // Paths no route serves, and routes' paths gone wrong.
    let elsewhere = (
        prop::sample::select(vec![
            "/",
            "/v1",
            "/v1/check/",
            "//v1/check",
            "/v1/forward-auth/",
            "/v1/forward-auth/api/more",
            "/v1/leases//renew",
            "/v1/%ZZ",
        ]),
        body_bytes("/v1/check"),
    )
        .prop_map(|(path, body)| Sent::post(path, body));
    let forward_auth = (
        prop::sample::select(vec!["api", "jobs", "elsewhere", "%00", "a%2Fb", "%A0"]),
        forward_auth_headers(),
    )
        .prop_map(|(domain, headers)| Sent {
            method: Method::GET,
            path: format!("/v1/forward-auth/{domain}"),
            headers,
            body: Vec::new(),
        });
    let lease = (
        prop::sample::select(vec![Method::DELETE, Method::POST]),
        "[a-zA-Z0-9_%-]{0,40}",
    )
        .prop_map(|(method, id)| Sent {
            path: if method == Method::POST {
                format!("/v1/leases/{id}/renew")
            } else {
                format!("/v1/leases/{id}")
            },
            method,
            headers: Vec::new(),
            body: Vec::new(),
        });
    prop_oneof![12 => posted, 4 => forward_auth, 2 => lease, 1 => elsewhere]
}

/// What the run saw, to show that it reached charges, rejections and refusals.
#[derive(Debug, Default)]
struct Seen {
    /// Answered with a decision that charged a bucket the probes read.
    charged: usize,
    /// Rejected: 429, or a lease refused.
    rejected: usize,
    /// Answered otherwise (an explanation, nothing matched, a settlement).
    answered: usize,
    /// Refused with a 4xx.
    refused: usize,
}

fn one(
    runtime: &tokio::runtime::Runtime,
    api: &mut Api,
    seen: &mut Seen,
    sent: &Sent,
) -> Result<(), TestCaseError> {
    runtime.block_on(async {
        let before = api.balances().await;
        let (status, body) = api.send(sent).await;
        let after = api.balances().await;
        let text = String::from_utf8_lossy(&body);
        prop_assert!(!status.is_server_error(), "{status} for {sent:?}: {text}");
        // The probes whose balance fell (refill, a token a day, only raises them).
        let charged: Vec<String> = probes()
            .into_iter()
            .zip(before.iter().zip(&after))
            .filter(|(_, (was, is))| is < was)
            .map(|((_, probe), _)| probe)
            .collect();
        if status == StatusCode::TOO_MANY_REQUESTS {
            // A rejected request charges nothing either, on any of its limits.
            seen.rejected += 1;
            prop_assert!(charged.is_empty(), "429 for {sent:?} charged {charged:?}");
        } else if status.is_client_error() {
            seen.refused += 1;
            let error: Value = serde_json::from_slice(&body).map_err(|err| {
                TestCaseError::fail(format!("{status}, not JSON ({err}): {text}"))
            })?;
            prop_assert!(error["error"]["code"].is_string(), "{status}: {text}");
            prop_assert!(error["error"]["message"].is_string(), "{status}: {text}");
            prop_assert!(
                charged.is_empty(),
                "{status} for {sent:?} charged {charged:?}"
            );
        } else if charged.is_empty() {
            seen.answered += 1;
        } else {
            seen.charged += 1;
        }
        Ok(())
    })
}

#[test]
fn any_request_is_answered_and_a_refused_one_charges_nothing() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    // The runner takes a shared closure; one case runs at a time.
    let api = RefCell::new(Api::new());
    let seen = RefCell::new(Seen::default());
    let mut runner = TestRunner::new(Config {
        cases: 3_000,
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&any_request(), |sent| {
        one(
            &runtime,
            &mut api.borrow_mut(),
            &mut seen.borrow_mut(),
            &sent,
        )
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
    // Charges and refusals, in numbers, or the generator has drifted away from the API.
    let seen = seen.into_inner();
    assert!(
        seen.charged >= 150 && seen.rejected >= 30 && seen.refused >= 300,
        "{seen:?}"
    );
}
