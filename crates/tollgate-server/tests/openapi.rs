//! The OpenAPI document (`src/http/openapi.json`, served at `GET /v1/openapi.json`) held to
//! the server. A document that drifts is worse than none: a client generated from it refuses
//! real answers, or a gateway validating against it refuses real requests. So: it is valid
//! OpenAPI 3.1 (`openapi-spec-validator`) and each of its schemas a valid JSON Schema; its paths
//! and methods are exactly the router's; and a script of requests that reaches every operation,
//! on the memory store and on a Redis the test kills, gets only statuses the document lists
//! for that operation, with the headers it says are always there and bodies its schemas take;
//! every request body the server took, the document's request schema takes too.

mod support;

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::process::Command;

use serde_json::{Value, json};
use support::{Answer, Scratch, Server, path_str, request};
use tollgate_redis::test_server::RedisServer;

fn document() -> Value {
    serde_json::from_str(tollgate_server::http::OPENAPI).expect("the document is JSON")
}

/// The document, and the operations the script has reached.
struct Spec {
    doc: Value,
    reached: RefCell<BTreeSet<(String, String)>>,
}

impl Spec {
    fn new() -> Self {
        Self {
            doc: document(),
            reached: RefCell::default(),
        }
    }

    /// The path template of the document that `path` (without its query) falls under for
    /// `method`: the one with the most literal segments, as the router prefers
    /// `/v1/leases/explain` to `/v1/leases/{lease_id}`.
    fn template(&self, method: &str, path: &str) -> Option<String> {
        let path = path.split('?').next().unwrap_or(path);
        let segments: Vec<&str> = path.split('/').collect();
        let paths = self.doc["paths"].as_object()?;
        paths
            .iter()
            .filter(|(_, item)| item.get(method).is_some())
            .filter_map(|(template, _)| {
                let parts: Vec<&str> = template.split('/').collect();
                if parts.len() != segments.len() {
                    return None;
                }
                let mut literal = 0;
                for (part, segment) in parts.iter().zip(&segments) {
                    if part.starts_with('{') && part.ends_with('}') {
                        if segment.is_empty() {
                            return None;
                        }
                    } else if part == segment {
                        literal += 1;
                    } else {
                        return None;
                    }
                }
                Some((literal, template.clone()))
            })
            .max()
            .map(|(_, template)| template)
    }

    /// Follows a `$ref` within the document.
    fn resolve<'a>(&'a self, value: &'a Value) -> &'a Value {
        match value.get("$ref").and_then(Value::as_str) {
            Some(pointer) => {
                let pointer = pointer.strip_prefix('#').expect("a local reference");
                self.resolve(
                    self.doc
                        .pointer(pointer)
                        .unwrap_or_else(|| panic!("{pointer} is not in the document")),
                )
            }
            None => value,
        }
    }

    /// The schema's complaints about `instance`, `$ref`s resolved against the document.
    fn complaints(&self, schema: &Value, instance: &Value) -> Vec<String> {
        let root = json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "components": self.doc["components"],
            "allOf": [schema],
        });
        let validator = jsonschema::draft202012::new(&root)
            .unwrap_or_else(|err| panic!("the schema does not compile: {err}\n{schema}"));
        validator
            .iter_errors(instance)
            .map(|err| format!("{}: {err}", err.instance_path()))
            .collect()
    }

    /// Holds `answer`, to `method path`, to the document: to the operation's own responses,
    /// or, for a path it lacks or a method its path lacks, to the document's `NotFound` and
    /// `MethodNotAllowed` (which no operation can list).
    fn check(&self, method: &str, path: &str, body: &str, answer: &Answer) {
        let method = method.to_ascii_lowercase();
        let Some(template) = self.template(&method, path) else {
            let elsewhere = HTTP_METHODS
                .iter()
                .any(|other| self.template(other, path).is_some());
            let (status, name) = if elsewhere {
                (405, "MethodNotAllowed")
            } else {
                (404, "NotFound")
            };
            assert_eq!(answer.status, status, "{method} {path}: {answer:?}");
            let response = &self.doc["components"]["responses"][name];
            assert!(response.is_object(), "no components.responses.{name}");
            return self.holds(&format!("{method} {path}"), response, answer);
        };
        let operation = &self.doc["paths"][&template][&method];
        let name = format!("{method} {template}");
        self.reached
            .borrow_mut()
            .insert((method.clone(), template.clone()));
        // A gateway that validates requests against the document must let through every
        // request the server takes.
        let schema = operation.pointer("/requestBody/content/application~1json/schema");
        if let Some(schema) = schema.filter(|_| !matches!(answer.status, 400 | 413)) {
            let request: Value = serde_json::from_str(body)
                .unwrap_or_else(|err| panic!("{name}: the server took {body:?} ({err})"));
            let complaints = self.complaints(schema, &request);
            assert!(
                complaints.is_empty(),
                "{name}: the server took {body} ({}), the document's schema says\n{}",
                answer.status,
                complaints.join("\n")
            );
        }
        let responses = &operation["responses"];
        let response = responses
            .get(answer.status.to_string())
            .or_else(|| responses.get("default"))
            .unwrap_or_else(|| {
                panic!(
                    "{name} answered {}, which the document does not list: {}",
                    answer.status, answer.body
                )
            });
        self.holds(&name, response, answer);
    }

    /// Holds `answer` to one of the document's responses: the headers it says are always
    /// there, its media type, and a JSON body to its schema.
    fn holds(&self, name: &str, response: &Value, answer: &Answer) {
        let response = self.resolve(response);
        if let Some(headers) = response.get("headers").and_then(Value::as_object) {
            for (header, spec) in headers {
                let spec = self.resolve(spec);
                if spec["required"] == true {
                    assert!(
                        answer.header(&header.to_ascii_lowercase()).is_some(),
                        "{name} {}: no {header}, which the document says is always there: {answer:?}",
                        answer.status
                    );
                }
            }
        }
        let Some(content) = response.get("content").and_then(Value::as_object) else {
            assert!(
                answer.body.is_empty(),
                "{name} {}: a body the document does not describe: {}",
                answer.status,
                answer.body
            );
            return;
        };
        let media = answer
            .header("content-type")
            .unwrap_or_else(|| panic!("{name} {}: no content type", answer.status));
        let media = media.split(';').next().unwrap_or(media).trim();
        let described = content.get(media).unwrap_or_else(|| {
            panic!(
                "{name} {}: answered {media}, the document lists {:?}",
                answer.status,
                content.keys().collect::<Vec<_>>()
            )
        });
        if media.ends_with("json") {
            let body: Value = serde_json::from_str(&answer.body).unwrap_or_else(|err| {
                panic!(
                    "{name} {}: not JSON ({err}): {}",
                    answer.status, answer.body
                )
            });
            let schema = described
                .get("schema")
                .unwrap_or_else(|| panic!("{name} {}: JSON without a schema", answer.status));
            let complaints = self.complaints(schema, &body);
            assert!(
                complaints.is_empty(),
                "{name} {}: the document's schema says\n{}\nof {}",
                answer.status,
                complaints.join("\n"),
                answer.body
            );
        }
    }

    /// Sends a request and holds its answer to the document.
    fn send(
        &self,
        addr: SocketAddr,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Answer {
        let answer = request(addr, method, path, headers, body);
        self.check(method, path, body, &answer);
        answer
    }

    /// [`send`](Self::send), the answer's status asserted to be `status`: the script reached
    /// the case it meant to.
    fn expect(
        &self,
        addr: SocketAddr,
        (method, path): (&str, &str),
        headers: &[(&str, &str)],
        body: &str,
        status: u16,
    ) -> Answer {
        let answer = self.send(addr, method, path, headers, body);
        assert_eq!(
            answer.status, status,
            "{method} {path} {body}: {}",
            answer.body
        );
        answer
    }

    fn post(&self, addr: SocketAddr, path: &str, body: &str) -> Answer {
        self.send(
            addr,
            "POST",
            path,
            &[("Content-Type", "application/json")],
            body,
        )
    }

    /// Whether the document's request schema for `method path` refuses `body`.
    fn refuses(&self, method: &str, path: &str, body: &str) -> bool {
        let schema = self.doc["paths"][path][method]
            .pointer("/requestBody/content/application~1json/schema")
            .unwrap_or_else(|| panic!("{method} {path} has no JSON request body"));
        let request: Value = serde_json::from_str(body).expect("JSON");
        !self.complaints(schema, &request).is_empty()
    }

    /// Takes a lease with `body` (which must get one) and answers its id.
    fn lease(&self, addr: SocketAddr, body: &str) -> String {
        let taken = self.post(addr, "/v1/leases", body);
        assert_eq!(taken.status, 200, "{}", taken.body);
        let id = taken.json()["lease_id"].as_str().map(str::to_owned);
        id.unwrap_or_else(|| panic!("no lease id: {}", taken.body))
    }

    /// Every operation of the document.
    fn operations(&self) -> BTreeSet<(String, String)> {
        let mut operations = BTreeSet::new();
        for (template, item) in self.doc["paths"].as_object().expect("paths") {
            for method in item.as_object().expect("a path item").keys() {
                if HTTP_METHODS.contains(&method.as_str()) {
                    operations.insert((method.clone(), template.clone()));
                }
            }
        }
        operations
    }
}

const HTTP_METHODS: [&str; 8] = [
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];

#[test]
fn the_document_is_valid_openapi_and_its_schemas_valid_json_schema() {
    let doc = document();
    assert_eq!(doc["openapi"], "3.1.0");
    for (name, schema) in doc["components"]["schemas"]
        .as_object()
        .expect("components.schemas")
    {
        if let Err(err) = jsonschema::draft202012::meta::validate(schema) {
            panic!("components.schemas.{name} is not a JSON Schema: {err}");
        }
    }
    let program = std::env::var("TOLLGATE_OPENAPI_SPEC_VALIDATOR")
        .unwrap_or_else(|_| "openapi-spec-validator".to_owned());
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/http/openapi.json");
    let output = Command::new(&program)
        .arg(&path)
        .output()
        .unwrap_or_else(|err| {
            panic!(
                "cannot run {program} ({err}): install it with `python3 -m pip install \
                 openapi-spec-validator` or name it in TOLLGATE_OPENAPI_SPEC_VALIDATOR \
                 (.ci/run installs it)"
            )
        });
    assert!(
        output.status.success(),
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The router's routes, read from `routes()` in `src/http/mod.rs`: each `.route("PATH",
/// get(..).post(..))` as (method, path).
fn router_routes() -> BTreeSet<(String, String)> {
    let source = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/http/mod.rs"),
    )
    .expect("read src/http/mod.rs");
    let body = source
        .split("fn routes(")
        .nth(1)
        .and_then(|rest| rest.split("\n}\n").next())
        .expect("fn routes in src/http/mod.rs");
    let mut routes = BTreeSet::new();
    for route in body.split(".route(").skip(1) {
        let path = route.split('"').nth(1).expect("a route's path");
        let handlers = route.split("\n        .").next().unwrap_or(route);
        for method in HTTP_METHODS {
            if handlers.contains(&format!("{method}(")) {
                routes.insert((method.to_owned(), path.to_owned()));
            }
        }
    }
    assert!(routes.len() > 10, "{routes:?}");
    routes
}

#[test]
fn the_document_has_exactly_the_routes_the_server_has() {
    let spec = Spec::new();
    assert_eq!(spec.operations(), router_routes());
}

const POLICY: &str = r#"version: "openapi-1"
limits:
  - name: per-user
    domain: api
    key: [user]
    capacity: 2
    refill: 1/h
  - name: tokens
    domain: llm
    key: [user]
    capacity: 4000
    refill: 4000/h
  - name: exports
    domain: api
    when: {route: /export}
    key: [user]
    algorithm: concurrency
    max_in_flight: 1
    lease_timeout: 30s
  - name: blocked
    domain: api
    when: {user: mallory}
    key: [user]
    deny: true
exemptions:
  - limit: per-user
    when: {user: vip}
    owner: ops@example.com
    reason: a test
    expires: 2099-01-01T00:00:00Z
"#;

/// Every operation on the memory store, with every answer the script can provoke there.
fn memory_script(spec: &Spec) {
    let scratch = Scratch::new("openapi");
    let file = scratch.write("policy.yaml", POLICY);
    let server = Server::start(&[
        "--config",
        path_str(&file),
        "--admin-token",
        "secret",
        "--hot-keys",
        "10",
    ]);
    let addr = server.http;
    let admin = [("Authorization", "Bearer secret")];
    let admin_json = [
        ("Authorization", "Bearer secret"),
        ("Content-Type", "application/json"),
    ];

    let served = spec.send(addr, "GET", "/v1/openapi.json", &[], "");
    assert_eq!(served.body, tollgate_server::http::OPENAPI);

    // Checks: allowed, rejected, denied, unmatched, retried, refused.
    let alice = r#"{"domain":"api","descriptors":[{"user":"alice"}]}"#;
    assert_eq!(spec.post(addr, "/v1/check", alice).status, 200);
    let retried = r#"{"domain":"api","descriptors":[{"user":"alice"}],"request_id":"r-1"}"#;
    assert_eq!(spec.post(addr, "/v1/check", retried).status, 200);
    assert_eq!(spec.post(addr, "/v1/check", retried).status, 200);
    let conflict =
        r#"{"domain":"api","descriptors":[{"user":"alice"}],"request_id":"r-1","cost":2}"#;
    assert_eq!(spec.post(addr, "/v1/check", conflict).status, 409);
    assert_eq!(spec.post(addr, "/v1/check", alice).status, 429);
    let mallory = r#"{"domain":"api","descriptors":[{"user":"mallory"}]}"#;
    assert_eq!(spec.post(addr, "/v1/check", mallory).status, 429);
    let vip = r#"{"domain":"api","descriptors":[{"user":"vip"},{"tenant":"t"}]}"#;
    assert_eq!(spec.post(addr, "/v1/check", vip).status, 200);
    let other = r#"{"domain":"other","descriptors":[{"user":"alice"}]}"#;
    assert_eq!(spec.post(addr, "/v1/check", other).status, 200);
    for bad in [
        "{",
        r#"{"domain":"api","descriptors":[{"user":"a"}],"bogus":1}"#,
        r#"{"domain":"api","descriptors":[{"user":"a"}],"cost":0}"#,
        r#"{"domain":"api","descriptors":[{"user":"a"}],"cost":-1}"#,
        r#"{"domain":"api","descriptors":[{"user":"a"}],"cost":3}"#,
        r#"{"domain":"api","descriptors":[]}"#,
        r#"{"descriptors":[{"user":"a"}]}"#,
    ] {
        assert_eq!(spec.post(addr, "/v1/check", bad).status, 400, "{bad}");
        assert_eq!(spec.post(addr, "/v1/explain", bad).status, 400, "{bad}");
    }
    // What is wrong in a body's shape, a gateway validating against the document refuses
    // too (a cost above a capacity needs the policy to see).
    for bad in [
        r#"{"domain":"api","descriptors":[{"user":"a"}],"bogus":1}"#,
        r#"{"domain":"api","descriptors":[{"user":"a"}],"cost":0}"#,
        r#"{"domain":"api","descriptors":[{"user":"a"}],"cost":-1}"#,
        r#"{"domain":"api","descriptors":[{"user":"a"}],"cost":"1"}"#,
        r#"{"domain":"api","descriptors":[]}"#,
        r#"{"domain":"api","descriptors":[{"user":7}]}"#,
        r#"{"descriptors":[{"user":"a"}]}"#,
    ] {
        assert!(spec.refuses("post", "/v1/check", bad), "{bad}");
        assert_eq!(spec.post(addr, "/v1/check", bad).status, 400, "{bad}");
    }
    let huge = format!(
        r#"{{"domain":"api","descriptors":[{{"user":"{}"}}]}}"#,
        "u".repeat(70_000)
    );
    assert_eq!(spec.post(addr, "/v1/check", &huge).status, 413);
    spec.expect(addr, ("GET", "/v1/check"), &[], "", 405);
    assert_eq!(spec.post(addr, "/v1/explain", alice).status, 200);
    assert_eq!(spec.post(addr, "/v1/explain", other).status, 200);

    // Reservations and their settlements.
    let reserve =
        r#"{"domain":"llm","descriptors":[{"user":"u1"}],"cost":4000,"request_id":"job-1"}"#;
    assert_eq!(spec.post(addr, "/v1/check", reserve).status, 200);
    let settle = |used: u64, id: &str| {
        format!(
            r#"{{"domain":"llm","descriptors":[{{"user":"u1"}}],"cost":4000,"request_id":"{id}","used":{used}}}"#
        )
    };
    // Settled, repeated, settled before with another `used`, more than reserved, no charge
    // on record.
    for (used, id, status) in [
        (1234, "job-1", 200),
        (1234, "job-1", 200),
        (5, "job-1", 409),
        (5000, "job-1", 400),
        (1, "job-2", 200),
    ] {
        let answer = spec.post(addr, "/v1/settle", &settle(used, id));
        assert_eq!(
            answer.status, status,
            "used {used} of {id}: {}",
            answer.body
        );
    }
    assert_eq!(spec.post(addr, "/v1/settle", "{").status, 400);

    // Leases.
    let export = r#"{"domain":"api","descriptors":[{"user":"alice","route":"/export"}]}"#;
    let lease = spec.lease(addr, export);
    assert_eq!(spec.post(addr, "/v1/leases", export).status, 429);
    let denied = r#"{"domain":"api","descriptors":[{"user":"mallory","route":"/export"}]}"#;
    assert_eq!(spec.post(addr, "/v1/leases", denied).status, 429);
    let unmatched = r#"{"domain":"api","descriptors":[{"user":"alice"}]}"#;
    assert_eq!(spec.post(addr, "/v1/leases", unmatched).status, 200);
    assert_eq!(spec.post(addr, "/v1/leases", "{").status, 400);
    assert_eq!(spec.post(addr, "/v1/leases/explain", export).status, 200);
    assert_eq!(spec.post(addr, "/v1/leases/explain", "{").status, 400);
    let renew = format!("/v1/leases/{lease}/renew");
    spec.expect(addr, ("POST", &renew), &[], "", 200);
    let release = format!("/v1/leases/{lease}");
    spec.expect(addr, ("DELETE", &release), &[], "", 204);
    spec.expect(addr, ("DELETE", &release), &[], "", 404);
    spec.expect(addr, ("POST", &renew), &[], "", 404);

    // Forward-auth, as nginx and Traefik ask.
    let bob = [("x-tollgate-user", "bob"), ("X-Forwarded-Method", "GET")];
    spec.expect(addr, ("GET", "/v1/forward-auth/api"), &bob, "", 200);
    spec.expect(addr, ("POST", "/v1/forward-auth/api"), &bob, "", 200);
    spec.expect(addr, ("GET", "/v1/forward-auth/api"), &bob, "", 429);
    let costly = [("x-tollgate-user", "carol"), ("x-tollgate-cost", "nope")];
    spec.expect(addr, ("GET", "/v1/forward-auth/api"), &costly, "", 400);

    // The baseline, health, metrics and the page.
    spec.expect(addr, ("GET", "/v1/noop"), &[], "", 200);
    spec.expect(addr, ("POST", "/v1/noop"), &[], "{}", 200);
    spec.expect(addr, ("GET", "/healthz"), &[], "", 200);
    spec.expect(addr, ("GET", "/readyz"), &[], "", 200);
    spec.expect(addr, ("GET", "/readyz?exclude=store"), &[], "", 200);
    spec.expect(addr, ("GET", "/readyz?exclude=etcd"), &[], "", 400);
    spec.expect(addr, ("GET", "/metrics"), &[], "", 200);
    spec.expect(addr, ("GET", "/dashboard"), &[], "", 200);

    // Admin: refused without the token, then each answer with it.
    spec.expect(addr, ("GET", "/v1/policy"), &[], "", 401);
    let wrong = [("Authorization", "Bearer nope")];
    spec.expect(addr, ("GET", "/v1/policy"), &wrong, "", 401);
    spec.expect(addr, ("GET", "/v1/policy"), &admin, "", 200);
    spec.expect(addr, ("GET", "/v1/hot-keys"), &admin, "", 200);
    spec.expect(addr, ("POST", "/v1/policy/rollback"), &admin, "", 409);
    let changed = POLICY
        .replace("openapi-1", "openapi-2")
        .replace("capacity: 2\n", "capacity: 3\n")
        .replace("2099-01-01", "2098-01-01");
    scratch.write("policy.yaml", &changed);
    let reloaded = spec.expect(addr, ("POST", "/v1/policy/reload"), &admin, "", 200);
    let changes = &reloaded.json()["diff"];
    assert_eq!(changes["limits"][0]["buckets"], "carried_over", "{changes}");
    assert_eq!(changes["exemptions"][0]["change"], "changed", "{changes}");
    spec.expect(addr, ("POST", "/v1/policy/rollback"), &admin, "", 200);
    scratch.write("policy.yaml", "limits: [");
    spec.expect(addr, ("POST", "/v1/policy/reload"), &admin, "", 422);
    spec.expect(addr, ("GET", "/v1/policy"), &admin, "", 200);
    let reset = r#"{"domain":"api","descriptors":[{"user":"alice"}]}"#;
    spec.expect(addr, ("POST", "/v1/reset"), &admin_json, reset, 200);
    let unknown = r#"{"domain":"api","descriptors":[{"user":"alice"}],"limits":["nope"]}"#;
    spec.expect(addr, ("POST", "/v1/reset"), &admin_json, unknown, 400);
    spec.expect(addr, ("POST", "/v1/reset"), &[], reset, 401);
    // The switch of every limit to shadow mode: on, then a check its limit would reject passes
    // as shadow, then off; bad bodies refused by the server and the document alike.
    let shadow = "/v1/policy/shadow-all";
    let on = r#"{"on":true,"reason":"INC-42"}"#;
    let switched = spec.expect(addr, ("POST", shadow), &admin_json, on, 200);
    assert_eq!(switched.json()["shadow_all"]["reason"], "INC-42");
    let narrowed = r#"{"on":true,"reason":"INC-43","domains":["llm"],"limits":["per-user"]}"#;
    let switched = spec.expect(addr, ("POST", shadow), &admin_json, narrowed, 200);
    assert_eq!(switched.json()["shadow_all"]["domains"][0], "llm");
    spec.expect(addr, ("POST", shadow), &admin_json, r#"{"on":false}"#, 200);
    spec.expect(addr, ("POST", shadow), &[], on, 401);
    for bad in [
        r#"{"on":true}"#,
        r#"{"on":"yes"}"#,
        r#"{"on":false,"why":1}"#,
        r#"{"on":true,"reason":"INC-43","limits":[]}"#,
        r#"{"on":false,"domains":["api"]}"#,
    ] {
        spec.expect(addr, ("POST", shadow), &admin_json, bad, 400);
        assert!(spec.refuses("post", shadow, bad), "{bad}");
    }
    // Refused by the server alone: what only it checks.
    spec.expect(
        addr,
        ("POST", shadow),
        &admin_json,
        r#"{"on":true,"reason":" "}"#,
        400,
    );
    spec.expect(
        addr,
        ("POST", shadow),
        &admin_json,
        r#"{"on":true,"reason":"INC-43","domains":["nowhere"]}"#,
        400,
    );
    // The fleet's switch needs a store other servers read.
    let fleet = r#"{"on":true,"reason":"INC-42","fleet":true}"#;
    spec.expect(addr, ("POST", shadow), &admin_json, fleet, 409);

    spec.expect(addr, ("GET", "/v1/nowhere"), &[], "", 404);
    assert!(server.terminate().success());

    // Without --hot-keys, the hot keys are not counted.
    let file = scratch.write("policy.yaml", POLICY);
    let plain = Server::start(&["--config", path_str(&file)]);
    spec.expect(plain.http, ("GET", "/v1/hot-keys"), &[], "", 404);
    assert!(plain.terminate().success());
}

const REDIS_POLICY: &str = r#"version: "openapi-redis"
limits:
  - name: per-user
    domain: api
    key: [user]
    capacity: 5
    refill: 1/s
    failure_mode: closed
  - name: exports
    domain: api
    when: {route: /export}
    key: [user]
    algorithm: concurrency
    max_in_flight: 2
    lease_timeout: 30s
    failure_mode: closed
"#;

/// The answers of a store that cannot answer: a Redis the test kills.
fn redis_script(spec: &Spec) {
    let mut redis = RedisServer::start();
    let scratch = Scratch::new("openapi-redis");
    let file = scratch.write("policy.yaml", REDIS_POLICY);
    let server = Server::start(&[
        "--config",
        path_str(&file),
        "--store",
        &redis.url(),
        "--store-timeout",
        "50ms",
    ]);
    let addr = server.http;
    let check = r#"{"domain":"api","descriptors":[{"user":"u1"}],"request_id":"r-1"}"#;
    assert_eq!(spec.post(addr, "/v1/check", check).status, 200);
    let export = r#"{"domain":"api","descriptors":[{"user":"u1","route":"/export"}]}"#;
    let lease = spec.lease(addr, export);
    // The fleet's switch, kept in the store: on and off while it answers.
    let json = [("Content-Type", "application/json")];
    let shadow = "/v1/policy/shadow-all";
    let fleet_on = r#"{"on":true,"reason":"INC-42","fleet":true}"#;
    let switched = spec.expect(addr, ("POST", shadow), &json, fleet_on, 200);
    assert_eq!(switched.json()["shadow_all"]["fleet"], true);
    let fleet_off = r#"{"on":false,"fleet":true}"#;
    spec.expect(addr, ("POST", shadow), &json, fleet_off, 200);
    redis.kill();
    spec.expect(addr, ("POST", shadow), &json, fleet_off, 503);
    assert_eq!(spec.post(addr, "/v1/check", check).status, 503);
    assert_eq!(spec.post(addr, "/v1/explain", check).status, 503);
    let settle = r#"{"domain":"api","descriptors":[{"user":"u1"}],"request_id":"r-1","used":0}"#;
    assert_eq!(spec.post(addr, "/v1/settle", settle).status, 503);
    assert_eq!(spec.post(addr, "/v1/leases", export).status, 503);
    assert_eq!(spec.post(addr, "/v1/leases/explain", export).status, 503);
    let renew = format!("/v1/leases/{lease}/renew");
    spec.expect(addr, ("POST", &renew), &[], "", 503);
    let release = format!("/v1/leases/{lease}");
    spec.expect(addr, ("DELETE", &release), &[], "", 503);
    let fa = [("x-tollgate-user", "u1")];
    spec.expect(addr, ("GET", "/v1/forward-auth/api"), &fa, "", 503);
    spec.expect(addr, ("GET", "/readyz"), &[], "", 503);
    let reset = r#"{"domain":"api","descriptors":[{"user":"u1"}]}"#;
    spec.expect(addr, ("POST", "/v1/reset"), &json, reset, 503);
    assert!(server.terminate().success());
}

#[test]
fn every_answer_of_every_operation_is_as_the_document_says() {
    let spec = Spec::new();
    memory_script(&spec);
    redis_script(&spec);
    let reached = spec.reached.borrow();
    let missed: Vec<_> = spec.operations().difference(&reached).cloned().collect();
    assert!(
        missed.is_empty(),
        "operations the script never reached: {missed:?}"
    );
}
