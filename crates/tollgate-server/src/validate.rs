//! `tollgate validate PATH`: the check a policy repository's CI runs on every change.
//!
//! A person reads a line per problem; a CI system wants the problems where the change is
//! reviewed. `--format github` writes GitHub Actions' workflow commands, which put each error
//! and warning on its file (and line) in the pull request; `--format json` writes one document
//! for any other system. In a policy directory each warning names the file of the limit or
//! exemption it is about, so it reaches the team that owns that file. The exit status is the
//! same in every format: 1 when the policy is refused, or has warnings under `--strict`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Result, anyhow, bail};
use serde_json::json;
use tollgate_policy::{Error, Policy, SystemWallClock, WallClock, Warning};

/// How `tollgate validate` reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub(crate) enum Format {
    /// Lines for people: warnings on stderr, a summary on stdout.
    #[default]
    Text,
    /// GitHub Actions workflow commands (`::error file=...,line=...::...`) on stdout, which
    /// annotate the pull request, and the summary.
    Github,
    /// One JSON document on stdout: the summary, the warnings with their files, the error.
    Json,
}

/// Validates the policy file or directory at `path` and reports in `format`.
pub(crate) fn run(path: &Path, strict: bool, format: Format) -> Result<()> {
    let policy = match tollgate_policy::validate(path) {
        Ok(policy) => policy,
        Err(err) => {
            match format {
                Format::Text => {}
                Format::Github => println!("{}", github_error(path, &err)),
                Format::Json => println!("{:#}", json_refused(path, &err)),
            }
            return Err(anyhow!("{err}"));
        }
    };
    let warnings: Vec<(PathBuf, Warning)> =
        tollgate_policy::lint_by_file(&policy, SystemWallClock.now())
            .into_iter()
            // In a policy directory, the file of the team to tell.
            .map(|(file, w)| (file.map_or_else(|| path.to_owned(), |f| path.join(f)), w))
            .collect();
    match format {
        Format::Text => {
            for (file, warning) in &warnings {
                eprintln!("warning: {}: {warning}", file.display());
            }
            println!("{}", summary(path, &policy, warnings.len()));
        }
        Format::Github => {
            for (file, warning) in &warnings {
                println!(
                    "::warning file={},title=tollgate validate::{}",
                    property(&file.display().to_string()),
                    data(&warning.to_string())
                );
            }
            println!("{}", summary(path, &policy, warnings.len()));
        }
        Format::Json => println!("{:#}", json_valid(path, &policy, &warnings, strict)),
    }
    if strict && !warnings.is_empty() {
        bail!(
            "{}: {} with --strict",
            path.display(),
            counted(warnings.len(), "warning")
        );
    }
    Ok(())
}

/// `policy.yaml: valid, version 7, 2 files, 3 limits, 0 exemptions, 1 warning`.
fn summary(path: &Path, policy: &Policy, warnings: usize) -> String {
    let mut line = format!("{}: valid, version {}, ", path.display(), policy.version());
    if !policy.files().is_empty() {
        let _ = write!(line, "{}, ", counted(policy.files().len(), "file"));
    }
    let _ = write!(
        line,
        "{}, {}, {}",
        counted(policy.limits().len(), "limit"),
        counted(policy.exemptions().len(), "exemption"),
        counted(warnings, "warning")
    );
    line
}

/// `1 limit`, `2 limits`: a summary line read by people.
pub(crate) fn counted(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// The error as a workflow command: on its file, line and column when it has them.
fn github_error(path: &Path, err: &Error) -> String {
    match err.diagnostic() {
        Some(d) => {
            let mut place = format!("file={}", property(&d.file));
            if d.line > 0 {
                let _ = write!(place, ",line={}", d.line);
                if d.column > 0 {
                    let _ = write!(place, ",col={}", d.column);
                }
            }
            let message = if d.path.is_empty() {
                d.message.clone()
            } else {
                format!("{}: {}", d.path, d.message)
            };
            format!(
                "::error {place},title=tollgate validate::{}",
                data(&message)
            )
        }
        None => format!(
            "::error file={},title=tollgate validate::{}",
            property(&path.display().to_string()),
            data(&err.to_string())
        ),
    }
}

fn json_refused(path: &Path, err: &Error) -> serde_json::Value {
    let error = match err.diagnostic() {
        Some(d) => json!({
            "file": d.file,
            "line": d.line,
            "column": d.column,
            "path": d.path,
            "message": d.message,
        }),
        None => json!({"file": path.display().to_string(), "message": err.to_string()}),
    };
    json!({"path": path.display().to_string(), "valid": false, "error": error})
}

fn json_valid(
    path: &Path,
    policy: &Policy,
    warnings: &[(PathBuf, Warning)],
    strict: bool,
) -> serde_json::Value {
    let warnings: Vec<_> = warnings
        .iter()
        .map(|(file, w)| json!({"file": file.display().to_string(), "message": w.to_string()}))
        .collect();
    json!({
        "path": path.display().to_string(),
        // Under --strict a warning fails the check as an error does.
        "valid": !strict || warnings.is_empty(),
        "version": policy.version(),
        "files": policy.files().iter().map(|f| f.name()).collect::<Vec<_>>(),
        "limits": policy.limits().len(),
        "exemptions": policy.exemptions().len(),
        "warnings": warnings,
        "error": null,
    })
}

/// A workflow command's message: `%`, CR and LF escaped, as the runner reads them back.
fn data(text: &str) -> String {
    text.replace('%', "%25")
        .replace('\r', "%0D")
        .replace('\n', "%0A")
}

/// A workflow command's property value: also `:` and `,`, which end a value.
fn property(text: &str) -> String {
    data(text).replace(':', "%3A").replace(',', "%2C")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_read_as_english() {
        assert_eq!(counted(0, "limit"), "0 limits");
        assert_eq!(counted(1, "limit"), "1 limit");
        assert_eq!(counted(2, "exemption"), "2 exemptions");
    }

    /// A message or a file name cannot end a workflow command early, nor break it over lines.
    #[test]
    fn workflow_commands_escape_what_would_end_them() {
        assert_eq!(data("50% of a\r\nb"), "50%25 of a%0D%0Ab");
        assert_eq!(property("C:\\a,b.yaml"), "C%3A\\a%2Cb.yaml");
        let err = tollgate_policy::compile("dir/a,b.yaml", "limits:\n  - {name: x}\n")
            .err()
            .unwrap_or_else(|| panic!("refused"));
        let line = github_error(Path::new("dir"), &err);
        assert!(
            line == "::error file=dir/a%2Cb.yaml,line=2,col=6,title=tollgate validate::limits[0]: \
                     missing field `domain`",
            "{line}"
        );
    }
}
