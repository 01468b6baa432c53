//! `deploy/kubernetes/tollgate.yaml` and the `Dockerfile` held to the binary. No cluster and no
//! image builder run here, so what they would check is checked piece by piece: the manifest
//! against the Kubernetes API's own schema (`kubernetes-validate`, strict: a misspelt field
//! fails), its objects naming each other (labels, ports, the ConfigMap, the Secret its header
//! tells you to create), and the container started as the Deployment starts it (its arguments,
//! its environment from that Secret, on a Redis of the test's own, its policy from the
//! ConfigMap): its probes answered, requests served, and on SIGTERM out of rotation while still
//! serving, then gone within the grace period. The Dockerfile builds the binary the tests run,
//! puts it where the entry point looks, and its default command starts.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use support::{Scratch, Server, binary, path_str, post_json, request, seconds, wait_for};
use tollgate_redis::test_server::RedisServer;

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn manifest_path() -> PathBuf {
    repository().join("deploy/kubernetes/tollgate.yaml")
}

fn manifest_text() -> String {
    std::fs::read_to_string(manifest_path()).expect("read deploy/kubernetes/tollgate.yaml")
}

/// The manifest's objects, in order (its leading comment is no object).
fn objects() -> Vec<Value> {
    manifest_text()
        .split("\n---\n")
        .filter(|part| {
            part.lines()
                .any(|line| !line.trim().is_empty() && !line.starts_with('#'))
        })
        .map(|part| serde_saphyr::from_str(part).expect("a YAML object"))
        .collect()
}

fn object(objects: &[Value], kind: &str) -> Value {
    let mut found = objects.iter().filter(|o| o["kind"] == kind);
    let first = found.next().unwrap_or_else(|| panic!("no {kind}"));
    assert!(found.next().is_none(), "more than one {kind}");
    first.clone()
}

fn text(value: &Value) -> &str {
    value
        .as_str()
        .unwrap_or_else(|| panic!("not a string: {value}"))
}

fn number(value: &Value) -> u64 {
    value
        .as_u64()
        .unwrap_or_else(|| panic!("not a number: {value}"))
}

/// The Deployment's one container.
fn container(deployment: &Value) -> Value {
    let containers = deployment["spec"]["template"]["spec"]["containers"]
        .as_array()
        .expect("containers");
    assert_eq!(containers.len(), 1, "one container");
    containers[0].clone()
}

fn args(container: &Value) -> Vec<String> {
    container["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|arg| text(arg).to_owned())
        .collect()
}

/// The value given to `flag` in `args`.
fn flag<'a>(args: &'a [String], flag: &str) -> &'a str {
    let at = args
        .iter()
        .position(|arg| arg == flag)
        .unwrap_or_else(|| panic!("no {flag} in {args:?}"));
    args.get(at + 1).expect("a value after the flag")
}

/// The container's ports by name.
fn ports(container: &Value) -> BTreeMap<String, u64> {
    container["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .map(|port| {
            (
                text(&port["name"]).to_owned(),
                number(&port["containerPort"]),
            )
        })
        .collect()
}

/// The port number a flag's `HOST:PORT` value listens on, checked to be every interface's.
fn listening_port(value: &str) -> u64 {
    let (host, port) = value.rsplit_once(':').expect("HOST:PORT");
    assert_eq!(
        host, "0.0.0.0",
        "a pod must listen beyond loopback: {value}"
    );
    port.parse().expect("a port")
}

#[test]
fn the_manifest_passes_the_kubernetes_schema() {
    let program = std::env::var("TOLLGATE_KUBERNETES_VALIDATE")
        .unwrap_or_else(|_| "kubernetes-validate".to_owned());
    // The oldest Kubernetes still commonly run, and the newest the validator knows.
    for version in ["1.28.0", "1.37.0"] {
        let output = Command::new(&program)
            .args(["--strict", "--quiet", "-k", version])
            .arg(manifest_path())
            .output()
            .unwrap_or_else(|err| {
                panic!(
                    "cannot run {program} ({err}): install it with `python3 -m pip install \
                     kubernetes-validate` or name it in TOLLGATE_KUBERNETES_VALIDATE \
                     (.ci/run installs it)"
                )
            });
        assert!(
            output.status.success(),
            "Kubernetes {version}: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

#[test]
fn the_manifests_objects_name_each_other() {
    let objects = objects();
    let deployment = object(&objects, "Deployment");
    let services: Vec<&Value> = objects.iter().filter(|o| o["kind"] == "Service").collect();
    let budget = object(&objects, "PodDisruptionBudget");
    let config_map = object(&objects, "ConfigMap");
    let pod = &deployment["spec"]["template"];
    let labels = pod["metadata"]["labels"].as_object().expect("pod labels");
    let selects_the_pods = |selector: &Value, what: &str| {
        let selector = selector.as_object().expect("a selector");
        assert!(!selector.is_empty(), "{what} selects everything");
        for (name, value) in selector {
            assert_eq!(
                labels.get(name),
                Some(value),
                "{what} selects {name}={value}"
            );
        }
    };
    selects_the_pods(
        &deployment["spec"]["selector"]["matchLabels"],
        "the Deployment",
    );
    for service in &services {
        selects_the_pods(&service["spec"]["selector"], "a Service");
    }
    selects_the_pods(&budget["spec"]["selector"]["matchLabels"], "the budget");
    // A budget that allows no disruption would block every node drain.
    assert!(number(&budget["spec"]["minAvailable"]) < number(&deployment["spec"]["replicas"]));

    let container = container(&deployment);
    let ports = ports(&container);
    for port in services
        .iter()
        .flat_map(|service| service["spec"]["ports"].as_array().expect("service ports"))
    {
        let target = text(&port["targetPort"]);
        assert!(
            ports.contains_key(target),
            "a Service targets {target}, no port of the pod's"
        );
        assert_eq!(
            number(&port["port"]),
            ports[target],
            "a Service's {target} port"
        );
    }
    // One Service with an address for both ports, one with the pods' own for Envoy's DNS.
    let headless = |service: &&&Value| service["spec"]["clusterIP"] == "None";
    assert_eq!(services.iter().filter(headless).count(), 1);
    assert_eq!(services.len(), 2);
    let args = args(&container);
    assert_eq!(listening_port(flag(&args, "--http")), ports["http"]);
    assert_eq!(listening_port(flag(&args, "--grpc")), ports["grpc"]);
    let annotations = &pod["metadata"]["annotations"];
    assert_eq!(
        text(&annotations["prometheus.io/port"]),
        ports["http"].to_string()
    );
    assert_eq!(text(&annotations["prometheus.io/path"]), "/metrics");

    // The policy file is the ConfigMap's, where the volume puts it.
    let mounts = container["volumeMounts"].as_array().expect("mounts");
    let [mount] = &mounts[..] else {
        panic!("one mount: {mounts:?}")
    };
    let volumes = pod["spec"]["volumes"].as_array().expect("volumes");
    let volume = volumes
        .iter()
        .find(|volume| volume["name"] == mount["name"])
        .expect("the mount's volume");
    assert_eq!(volume["configMap"]["name"], config_map["metadata"]["name"]);
    let config = flag(&args, "--config");
    let key = config
        .strip_prefix(&format!("{}/", text(&mount["mountPath"])))
        .expect("--config under the mount");
    assert!(
        config_map["data"][key].is_string(),
        "the ConfigMap has no {key}"
    );

    // The Secret the header says to create holds every key the container reads.
    let header = manifest_text();
    let created: Vec<&str> = header
        .split("--from-literal=")
        .skip(1)
        .filter_map(|rest| rest.split_once('=').map(|(key, _)| key))
        .collect();
    assert!(
        header.contains("kubectl create secret generic tollgate "),
        "{header}"
    );
    for env in container["env"].as_array().expect("env") {
        if let Some(secret) = env["valueFrom"].get("secretKeyRef") {
            assert_eq!(secret["name"], "tollgate");
            let key = text(&secret["key"]);
            assert!(
                created.contains(&key),
                "the header's secret lacks {key}: {created:?}"
            );
        }
    }
    // And the image is the one it says to build.
    let image = text(&container["image"]);
    assert!(
        header.contains(&format!("docker build -t {image} .")),
        "{image}"
    );
}

/// What the kubelet would put in `env`'s variables, with the Secret's values given here (a
/// variable whose optional key the Secret lacks is left out, as the kubelet leaves it).
fn environment(container: &Value, secret: &BTreeMap<&str, String>) -> Vec<(String, String)> {
    container["env"]
        .as_array()
        .expect("env")
        .iter()
        .filter_map(|env| {
            let name = text(&env["name"]).to_owned();
            if let Some(value) = env.get("value") {
                return Some((name, text(value).to_owned()));
            }
            let from = &env["valueFrom"];
            if let Some(reference) = from.get("secretKeyRef") {
                let key = text(&reference["key"]);
                let optional = reference["optional"].as_bool() == Some(true);
                return match secret.get(key) {
                    Some(value) => Some((name, value.clone())),
                    None if optional => None,
                    None => panic!("the secret lacks {key}, which {name} needs"),
                };
            }
            let field = &from["resourceFieldRef"];
            let resource = text(&field["resource"]);
            let (section, what) = resource.split_once('.').expect("requests.cpu or the like");
            assert_eq!(what, "cpu", "{resource}");
            assert_eq!(text(&field["divisor"]), "1");
            // Whole CPUs, rounded up, as the kubelet gives them.
            let quantity = text(&container["resources"][section][what]);
            let cpus = match quantity.strip_suffix('m') {
                Some(milli) => milli.parse::<u64>().expect("millicores").div_ceil(1000),
                None => quantity.parse().expect("whole CPUs"),
            };
            Some((name, cpus.to_string()))
        })
        .collect()
}

#[test]
fn the_container_started_as_the_deployment_starts_it_serves_and_stops_within_its_grace() {
    let objects = objects();
    let deployment = object(&objects, "Deployment");
    let config_map = object(&objects, "ConfigMap");
    let container = container(&deployment);
    let pod = &deployment["spec"]["template"]["spec"];
    let args = args(&container);
    let ports = ports(&container);

    let scratch = Scratch::new("kubernetes");
    let redis = RedisServer::start();
    let token = "from-the-secret";
    // A collector's address where nothing listens (taken, then let go): spans go nowhere,
    // the way there is still taken.
    let collector = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port");
    let secret = BTreeMap::from([
        ("store", redis.url()),
        ("admin-token", token.to_owned()),
        ("trace-endpoint", format!("http://{collector}")),
    ]);
    let config = flag(&args, "--config").to_owned();
    let key = config.rsplit('/').next().expect("a file name");
    let file = text(&config_map["data"][key]);
    let policy = mount_config_map(&scratch, key, file);
    let mut command = Command::new(binary());
    let mut given = args.iter();
    while let Some(arg) = given.next() {
        command.arg(arg);
        if matches!(arg.as_str(), "--http" | "--grpc" | "--config") {
            given.next();
            command.arg(match arg.as_str() {
                "--config" => path_str(&policy),
                _ => "127.0.0.1:0",
            });
        }
    }
    command.envs(environment(&container, &secret));
    let server = Server::start_command(command);
    assert!(server.banner.contains("store redis"), "{}", server.banner);

    // The probes, on the port they name.
    let on_port = |port: &Value| {
        let port = port
            .as_str()
            .map_or_else(|| number(port), |name| ports[name]);
        assert_eq!(port, ports["http"], "probes go to the HTTP port");
        server.http
    };
    for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
        let Some(get) = container.get(probe).map(|probe| &probe["httpGet"]) else {
            continue;
        };
        let answer = request(on_port(&get["port"]), "GET", text(&get["path"]), &[], "");
        assert_eq!(answer.status, 200, "{probe}: {}", answer.body);
    }
    let check = r#"{"domain":"api","descriptors":[{"user":"u1","tenant":"t1"}]}"#;
    let answer = post_json(server.http, "/v1/check", check);
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.json()["limits"].as_array().map(Vec::len), Some(2));
    // The policy in force, read with the Secret's admin token: (status, version).
    let authorization = format!("Bearer {token}");
    let policy_in_force = || {
        let headers = [("authorization", authorization.as_str())];
        let answer = request(server.http, "GET", "/v1/policy", &headers, "");
        let version = serde_json::from_str::<Value>(&answer.body)
            .ok()
            .and_then(|policy| policy["version"].as_str().map(str::to_owned));
        (answer.status, version)
    };
    assert_eq!(
        policy_in_force(),
        (200, Some("1".to_owned())),
        "the Secret's admin token"
    );

    // A change of the ConfigMap, as the kubelet makes it: taken without a restart.
    let changed = file.replacen("version: \"1\"", "version: \"2\"", 1);
    assert_ne!(changed, file, "the ConfigMap's policy names its version");
    update_config_map(&scratch, key, &changed);
    wait_for("the changed ConfigMap in force", || {
        (policy_in_force().1.as_deref() == Some("2")).then_some(())
    });

    // The way out: the readiness probe fails before the server stops accepting (the Service
    // must see it in time), and all of it fits the grace period.
    let readiness = &container["readinessProbe"];
    let noticed = number(&readiness["periodSeconds"]) * number(&readiness["failureThreshold"]);
    let delay = seconds(flag(&args, "--shutdown-delay"));
    let drain = seconds(flag(&args, "--drain-timeout"));
    let grace = number(&pod["terminationGracePeriodSeconds"]);
    assert!(
        noticed < delay,
        "probe failures noticed after {noticed} s, delay {delay} s"
    );
    assert!(
        delay + drain < grace,
        "delay {delay} s + drain {drain} s, grace {grace} s"
    );
    let ready_path = text(&readiness["httpGet"]["path"]);
    server.signal("TERM");
    wait_for("the readiness probe to fail", || {
        (request(server.http, "GET", ready_path, &[], "").status == 503).then_some(())
    });
    let answer = post_json(server.http, "/v1/check", check);
    assert_eq!(answer.status, 200, "still serving: {}", answer.body);
    let status = server.wait_within(Duration::from_secs(grace));
    let status = status.unwrap_or_else(|| panic!("still running {grace} s after SIGTERM"));
    assert!(status.success(), "{status:?}");
}

/// Writes `text` as `key` of a ConfigMap mounted in `scratch` the way the kubelet lays it out
/// (the file a link into `..data`, itself a link to a timestamped directory); returns the path
/// the container reads.
fn mount_config_map(scratch: &Scratch, key: &str, text: &str) -> PathBuf {
    let first = scratch.0.join("..2026_12_04_00_00_00.1");
    std::fs::create_dir(&first).expect("a data directory");
    std::fs::write(first.join(key), text).expect("the file");
    std::os::unix::fs::symlink("..2026_12_04_00_00_00.1", scratch.0.join("..data"))
        .expect("..data");
    let path = scratch.0.join(key);
    std::os::unix::fs::symlink(format!("..data/{key}"), &path).expect("the file's link");
    path
}

/// Changes the mounted ConfigMap as the kubelet does: a new timestamped directory, `..data`
/// swapped to it by a rename, the old one removed.
fn update_config_map(scratch: &Scratch, key: &str, text: &str) {
    let second = scratch.0.join("..2026_12_04_00_01_00.2");
    std::fs::create_dir(&second).expect("a data directory");
    std::fs::write(second.join(key), text).expect("the file");
    let swap = scratch.0.join("..data_tmp");
    std::os::unix::fs::symlink("..2026_12_04_00_01_00.2", &swap).expect("..data_tmp");
    std::fs::rename(&swap, scratch.0.join("..data")).expect("..data swapped");
    std::fs::remove_dir_all(scratch.0.join("..2026_12_04_00_00_00.1")).expect("the old data");
}

/// The Dockerfile's instructions: (keyword, the rest), continuation lines joined.
fn dockerfile() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(repository().join("Dockerfile")).expect("read Dockerfile");
    let mut instructions = Vec::new();
    let mut pending = String::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(part) => pending.push_str(part),
            None => {
                pending.push_str(line);
                let (keyword, rest) = pending.split_once(' ').expect("KEYWORD arguments");
                instructions.push((keyword.to_owned(), rest.trim().to_owned()));
                pending.clear();
            }
        }
    }
    instructions
}

/// The words of an exec-form instruction, `["a", "b"]`.
fn exec_form(rest: &str) -> Vec<String> {
    serde_json::from_str(rest).unwrap_or_else(|err| panic!("not exec form ({err}): {rest}"))
}

#[test]
fn the_dockerfile_builds_the_binary_and_runs_it_as_the_manifest_expects() {
    let instructions = dockerfile();
    let all = |keyword: &str| -> Vec<&str> {
        instructions
            .iter()
            .filter(|(k, _)| k == keyword)
            .map(|(_, rest)| rest.as_str())
            .collect()
    };
    let [build_from, run_from] = all("FROM")[..] else {
        panic!("a build stage and a runtime stage")
    };
    let (build_image, stage) = build_from.split_once(" AS ").expect("FROM image AS name");
    // The toolchain is at least the workspace's rust-version.
    let workspace = std::fs::read_to_string(repository().join("Cargo.toml")).expect("Cargo.toml");
    let needed = workspace
        .lines()
        .find_map(|line| line.strip_prefix("rust-version = "))
        .expect("rust-version")
        .trim_matches('"');
    let version = build_image
        .split_once(":")
        .and_then(|(_, tag)| tag.split('-').next())
        .expect("rust:VERSION-...");
    let parse =
        |v: &str| -> Vec<u32> { v.split('.').map(|n| n.parse().expect("a number")).collect() };
    assert!(parse(version) >= parse(needed), "rust {version} < {needed}");
    let workdir = all("WORKDIR")[0];
    assert!(
        all("RUN").contains(&"cargo build --release --locked -p tollgate-server"),
        "{instructions:?}"
    );
    let copy = all("COPY")
        .into_iter()
        .find_map(|rest| rest.strip_prefix(&format!("--from={stage} ")))
        .expect("a COPY from the build stage");
    let (from, to) = copy.split_once(' ').expect("COPY FROM TO");
    assert_eq!(from, format!("{workdir}/target/release/tollgate"));
    let entry = exec_form(all("ENTRYPOINT")[0]);
    assert_eq!(entry, [to]);
    assert!(
        run_from.contains("distroless/cc"),
        "glibc and CA certificates: {run_from}"
    );

    // As the Deployment runs it: its user, its ports.
    let objects = objects();
    let deployment = object(&objects, "Deployment");
    let container = container(&deployment);
    let security = &deployment["spec"]["template"]["spec"]["securityContext"];
    let user = format!("{}:{}", security["runAsUser"], security["runAsGroup"]);
    assert_eq!(all("USER"), [user.as_str()]);
    let exposed: Vec<u64> = all("EXPOSE")
        .iter()
        .flat_map(|ports| ports.split_whitespace())
        .map(|port| port.parse().expect("a port"))
        .collect();
    let mut ports: Vec<u64> = ports(&container).into_values().collect();
    ports.sort_unstable();
    assert_eq!(exposed, ports);
    let ignored =
        std::fs::read_to_string(repository().join(".dockerignore")).expect(".dockerignore");
    assert!(
        ignored.lines().any(|line| line == "target"),
        "the build context would hold target/"
    );

    // Its default command starts a server (on loopback here).
    let command_words = exec_form(all("CMD")[0]);
    let mut command = Command::new(binary());
    for word in &command_words {
        command.arg(match word.strip_prefix("0.0.0.0:") {
            Some(port) => {
                let port: u64 = port.parse().expect("a port");
                assert!(
                    exposed.contains(&port),
                    "CMD listens on {port}, not exposed"
                );
                "127.0.0.1:0"
            }
            None => word,
        });
    }
    let server = Server::start_command(command);
    assert_eq!(request(server.http, "GET", "/healthz", &[], "").status, 200);
}
