//! README.md held to the binary: the quick start's curl commands run as written answer what
//! the README shows; the synopsis of "Command line" lists every `serve` flag and no flag a
//! command lacks (by the binary's own `--help`); and every `TOLLGATE_*` name the README, the
//! docs and the systemd files mention is one the binary reads. A flag added without its line
//! in the README, or an answer changed without its example, fails here rather than in a
//! reader's terminal.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use support::{fenced_block, readme, run};

/// The commands the synopsis has a line for, as their `--help` is asked for.
const COMMANDS: [&[&str]; 9] = [
    &["serve"],
    &["validate"],
    &["schema"],
    &["diff"],
    &["check"],
    &["simulate"],
    &["import", "envoy"],
    &["completions"],
    &["bench"],
];

/// `TOLLGATE_*` names that are no `serve` flag: the log filter the binary reads, and where
/// the tests find the tools they drive.
const OTHER_NAMES: [&str; 7] = [
    "TOLLGATE_LOG",
    "TOLLGATE_PROMTOOL",
    "TOLLGATE_KUBERNETES_VALIDATE",
    "TOLLGATE_OPENAPI_SPEC_VALIDATOR",
    "TOLLGATE_NGINX",
    "TOLLGATE_CHROMIUM",
    "TOLLGATE_CHROMEDRIVER",
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|err| panic!("{}: {err}", path.display()))
}

/// The `--long` flags written in `text`.
fn flags_in(text: &str) -> BTreeSet<String> {
    let mut flags = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("--") {
        let tail = &rest[at + 2..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'))
            .unwrap_or(tail.len());
        if tail.starts_with(|c: char| c.is_ascii_lowercase()) {
            flags.insert(format!("--{}", &tail[..end]));
        }
        rest = &tail[end..];
    }
    flags
}

/// The options `tollgate COMMAND --help` lists (its own `--help` left out), each with the
/// environment variable it names, if any.
fn options(command: &[&str]) -> BTreeMap<String, Option<String>> {
    let (status, help, err) = run(&[command, &["--help"]].concat());
    assert!(status.success(), "{command:?} --help: {err}");
    let mut options = BTreeMap::new();
    let mut flag = None;
    for line in help.lines() {
        let trimmed = line.trim_start();
        // An option's first line: `--name <VALUE>` or `-x, --name` (a possible value's line,
        // `- shared: ...`, is not one).
        if trimmed.starts_with("--") || trimmed.get(2..5) == Some(", -") {
            let head: Vec<&str> = trimmed.split_whitespace().take(2).collect();
            flag = flags_in(&head.join(" ")).into_iter().next();
            if let Some(flag) = &flag {
                options.insert(flag.clone(), None);
            }
        }
        if let (Some(flag), Some(at)) = (&flag, trimmed.find("[env: ")) {
            let name = trimmed[at + "[env: ".len()..].split(['=', ']']).next();
            options.insert(flag.clone(), name.map(str::to_owned));
        }
    }
    options.remove("--help");
    options
}

/// The flags `tollgate COMMAND --help` lists (its own `--help` left out).
fn help_flags(command: &[&str]) -> BTreeSet<String> {
    options(command).into_keys().collect()
}

/// The synopsis: the first `sh` block under "### Command line", as (command, its lines).
fn synopsis() -> Vec<(Vec<String>, String)> {
    let block = fenced_block(&readme(), "\n### Command line\n", "sh");
    let mut entries: Vec<(Vec<String>, String)> = Vec::new();
    for line in block.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let named = COMMANDS.iter().find(|command| {
            words.first() == Some(&"tollgate")
                && words.len() > command.len()
                && words[1..=command.len()] == command[..]
        });
        match named {
            Some(command) => entries.push((
                command.iter().map(|word| (*word).to_owned()).collect(),
                line.to_owned(),
            )),
            // A continuation (indented) belongs to the entry above; any other line (`source
            // <(tollgate completions bash)`) names no flag of its own.
            None if line.starts_with(' ') => {
                if let Some((_, text)) = entries.last_mut() {
                    text.push('\n');
                    text.push_str(line);
                }
            }
            None => assert!(flags_in(line).is_empty(), "a line of no command: {line}"),
        }
    }
    entries
}

#[test]
fn the_synopsis_names_only_flags_its_commands_have() {
    let entries = synopsis();
    for command in COMMANDS {
        if command == ["completions"] {
            continue; // its line is `source <(tollgate completions bash)`, with no flag
        }
        assert!(
            entries.iter().any(|(named, _)| named == command),
            "no synopsis line for tollgate {command:?}"
        );
    }
    for (command, text) in &entries {
        let command: Vec<&str> = command.iter().map(String::as_str).collect();
        let real = help_flags(&command);
        let unknown: Vec<_> = flags_in(text).difference(&real).cloned().collect();
        assert!(
            unknown.is_empty(),
            "the README's synopsis of tollgate {command:?} names {unknown:?}, which it does not have"
        );
    }
}

#[test]
fn the_synopsis_lists_every_serve_flag() {
    let entries = synopsis();
    let (_, serve) = entries
        .iter()
        .find(|(command, _)| command == &["serve"])
        .expect("a serve line");
    let missing: Vec<_> = help_flags(&["serve"])
        .difference(&flags_in(serve))
        .cloned()
        .collect();
    assert!(
        missing.is_empty(),
        "serve flags missing from the README's synopsis: {missing:?}"
    );
}

/// The README says every `serve` flag is an environment variable named by a rule; `--help`
/// shows each one's, so the rule is checked on all of them.
#[test]
fn every_serve_flag_is_the_environment_variable_the_rule_names() {
    for (flag, name) in options(&["serve"]) {
        let expected = format!(
            "TOLLGATE_{}",
            flag.trim_start_matches("--")
                .replace('-', "_")
                .to_uppercase()
        );
        assert_eq!(name.as_deref(), Some(expected.as_str()), "{flag}");
    }
    let readme = readme();
    assert!(
        readme.contains("`--store-timeout 50ms` is `TOLLGATE_STORE_TIMEOUT=50ms`"),
        "the README states the rule with its example"
    );
}

/// Every `TOLLGATE_*` name written in the README, the docs and the deploy files is one the
/// binary reads (a `serve` flag's, or the log filter) or one the tests read for their tools.
#[test]
fn every_variable_the_documentation_names_is_real() {
    let serve = options(&["serve"]);
    let real: BTreeSet<&str> = serve
        .values()
        .flatten()
        .map(String::as_str)
        .chain(OTHER_NAMES)
        .collect();
    let mut files = vec![root().join("README.md")];
    for dir in [
        "docs",
        "docs/examples",
        "deploy/systemd",
        "deploy/logrotate",
        "deploy/kubernetes",
    ] {
        for entry in std::fs::read_dir(root().join(dir)).expect("the directory") {
            let path = entry.expect("an entry").path();
            if path.is_file() {
                files.push(path);
            }
        }
    }
    for file in files {
        let text = read(&file);
        for (at, _) in text.match_indices("TOLLGATE_") {
            let tail = &text[at..];
            let name = &tail[..tail
                .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
                .unwrap_or(tail.len())];
            // `TOLLGATE_` alone is the prefix the rule is stated with.
            assert!(
                name == "TOLLGATE_" || real.contains(name),
                "{} names {name}, which nothing reads",
                file.display()
            );
        }
    }
}

/// The README's example of a repeatable flag in its variable: values separated by commas,
/// each mapping taking effect (a limit keyed by both entries applies only when both are read).
#[test]
fn a_repeatable_flag_takes_its_values_from_its_variable_separated_by_commas() {
    let scratch = support::Scratch::new("readme-env");
    let config = scratch.write(
        "policy.yaml",
        "limits: [{name: pair, domain: api, key: [user, tenant], capacity: 1, refill: 1/h}]\n",
    );
    let mut command = std::process::Command::new(support::binary());
    command
        .args([
            "serve",
            "--http",
            "127.0.0.1:0",
            "--grpc",
            "127.0.0.1:0",
            "--config",
        ])
        .arg(&config)
        .env(
            "TOLLGATE_FORWARD_AUTH_HEADER",
            "user=X-User-Id,tenant=X-Tenant",
        );
    let server = support::Server::start_command(command);
    let status = |tenant: &str| {
        let headers = [("X-User-Id", "u1"), ("X-Tenant", tenant)];
        support::request(server.http, "GET", "/v1/forward-auth/api", &headers, "").status
    };
    assert_eq!(status("t1"), 200);
    assert_eq!(status("t1"), 429, "the pair's bucket of one is spent");
    assert_eq!(status("t2"), 200, "another tenant, another bucket");
}

/// Runs a README shell command (its `127.0.0.1:8080` pointed at `server`) and returns what it
/// printed, lines ending in `\n`.
fn shell(command: &str, server: &support::Server) -> String {
    let command = command.replace("127.0.0.1:8080", &server.http.to_string());
    let output = std::process::Command::new("sh")
        .args(["-c", &command])
        .output()
        .expect("sh runs");
    assert!(
        output.status.success(),
        "{command}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).replace("\r\n", "\n")
}

/// The quick start's requests, run as the README writes them (curl, through sh) against the
/// server the first command starts: the answer it shows, line for line, and the leases
/// example's answers, its lease id aside.
#[test]
fn the_quick_start_answers_as_the_readme_shows() {
    let readme = readme();
    let server = support::Server::start(&[]);

    let check = fenced_block(&readme, "Then, from another terminal:", "sh");
    let shown = fenced_block(&readme, "Then, from another terminal:", "text");
    let printed = shell(&check, &server);
    for line in shown.lines().filter(|line| !line.is_empty()) {
        assert!(
            printed.lines().any(|printed| printed == line),
            "the README shows {line:?}; curl printed:\n{printed}"
        );
    }
    // Sent one curl at a time, a request may find a refilled token (one each 200 ms): the
    // burst of 10 passes whole, and a 429 with Retry-After comes once it is spent.
    let mut allowed = 1;
    let rejected = loop {
        let printed = shell(&check, &server);
        if printed.starts_with("HTTP/1.1 200 OK\n") && allowed < 40 {
            allowed += 1;
            continue;
        }
        break printed;
    };
    assert!(
        rejected.starts_with("HTTP/1.1 429 Too Many Requests\n"),
        "{rejected}"
    );
    assert!(allowed >= 10, "{allowed} allowed before the 429");
    assert!(
        rejected
            .lines()
            .any(|line| line.starts_with("retry-after: ")),
        "{rejected}"
    );

    // Each command, then the comment lines after it: what it prints.
    let leases = fenced_block(&readme, "The demo also caps exports", "sh");
    let mut steps: Vec<(String, Vec<String>)> = Vec::new();
    for line in leases.lines() {
        match line.strip_prefix("# ") {
            Some(shown) => steps
                .last_mut()
                .expect("a command before its output")
                .1
                .push(shown.to_owned()),
            None if steps
                .last()
                .is_some_and(|(command, _)| command.ends_with('\\')) =>
            {
                let (command, _) = steps.last_mut().expect("the command");
                command.push('\n');
                command.push_str(line);
            }
            None => steps.push((line.to_owned(), Vec::new())),
        }
    }
    assert_eq!(steps.len(), 2, "take a lease, give it back: {steps:?}");
    let taken = shell(&steps[0].0, &server);
    let taken: serde_json::Value = serde_json::from_str(taken.trim()).expect("JSON");
    let mut shown: serde_json::Value = serde_json::from_str(&steps[0].1[0]).expect("JSON shown");
    let readme_id = shown["lease_id"].as_str().expect("an id shown").to_owned();
    let id = taken["lease_id"].as_str().expect("a lease id");
    shown["lease_id"] = serde_json::Value::String(id.to_owned());
    assert_eq!(taken, shown);
    let given_back = shell(&steps[1].0.replace(&readme_id, id), &server);
    assert_eq!(
        given_back.lines().next(),
        Some(steps[1].1[0].as_str()),
        "{given_back}"
    );
}

/// Every policy the README writes (a whole file, or limits to put under `limits:`) is one
/// `tollgate validate` accepts; the Envoy configurations beside them are Envoy's to judge.
#[test]
fn the_readme_policies_validate() {
    let readme = readme();
    let scratch = support::Scratch::new("readme-policies");
    let mut validated = 0;
    for (n, block) in readme.split("```yaml\n").skip(1).enumerate() {
        let block = &block[..block.find("```").expect("the block's end")];
        let policy = if block.starts_with("# Envoy") {
            continue;
        } else if block.starts_with("  - ") {
            format!("limits:\n{block}")
        } else {
            block.to_owned()
        };
        let file = scratch.write(&format!("policy-{n}.yaml"), &policy);
        let (status, _, stderr) = run(&["validate", support::path_str(&file)]);
        assert!(
            status.success(),
            "the README's policy\n{policy}\nis refused: {stderr}"
        );
        validated += 1;
    }
    assert_eq!(
        validated, 3,
        "the policy file, the path prefix and the block list"
    );
}
