//! `tollgate completions SHELL`: the bash script, sourced in a real bash, completes commands,
//! flags and flag values; every shell's script names the commands and flags.

mod support;

use std::process::Command;

use support::{binary, run};

/// What bash's completion offers for `line` (the words typed so far, the last one being
/// completed), with tollgate's script sourced.
fn bash_completes(line: &[&str]) -> Vec<String> {
    let words = line
        .iter()
        .map(|word| format!("'{word}'"))
        .collect::<Vec<_>>()
        .join(" ");
    // A completion function is called with the command, the word being completed and the one
    // before it, with COMP_WORDS and COMP_CWORD set, as bash does at the tab key.
    let script = format!(
        "source <(\"$0\" completions bash) || exit 3\n\
         COMP_WORDS=({words}); COMP_CWORD=$((${{#COMP_WORDS[@]}} - 1))\n\
         _tollgate tollgate \"${{COMP_WORDS[COMP_CWORD]}}\" \"${{COMP_WORDS[COMP_CWORD-1]}}\"\n\
         printf '%s\\n' \"${{COMPREPLY[@]}}\""
    );
    bash(&["-c", &script, binary()])
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Runs bash with `args`, asserts it succeeded, and returns what it printed.
fn bash(args: &[&str]) -> String {
    let output = Command::new("bash").args(args).output().expect("run bash");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
fn bash_completes_commands_flags_and_values() {
    assert_eq!(bash_completes(&["tollgate", "se"]), ["serve"]);
    let store_flags = bash_completes(&["tollgate", "serve", "--store-t"]);
    assert_eq!(
        store_flags,
        [
            "--store-tls-ca",
            "--store-tls-cert",
            "--store-tls-key",
            "--store-timeout"
        ]
    );
    assert_eq!(
        bash_completes(&["tollgate", "serve", "--runtime", ""]),
        ["shared", "per-core"]
    );
    assert_eq!(
        bash_completes(&["tollgate", "import", ""]),
        ["-h", "--help", "envoy", "help"]
    );
}

#[test]
fn the_bash_script_is_valid_bash() {
    let (status, script, _) = run(&["completions", "bash"]);
    assert!(status.success());
    bash(&["-n", "-c", &script]);
}

#[test]
fn every_shells_script_names_the_commands_and_flags() {
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let (status, script, stderr) = run(&["completions", shell]);
        assert!(status.success(), "{shell}: {stderr}");
        for word in [
            "serve",
            "simulate",
            "store",
            "forward-auth-deny-status",
            "completions",
        ] {
            assert!(script.contains(word), "{shell}: no {word}");
        }
    }
}

#[test]
fn an_unknown_shell_is_refused_with_the_known_ones() {
    let (status, script, stderr) = run(&["completions", "tcsh"]);
    assert!(!status.success());
    assert!(script.is_empty(), "{script}");
    assert!(
        stderr.contains("bash") && stderr.contains("zsh"),
        "{stderr}"
    );
}
