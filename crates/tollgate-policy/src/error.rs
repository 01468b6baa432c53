//! The one error type of the policy crate.
//!
//! Policy errors are read by operators at a terminal or on a status endpoint, so the ones about a
//! file carry everything needed to fix it without guessing: the file, the line and column, the
//! field path (`limits[2].refill`) and what is wrong.

use std::fmt;
use std::path::PathBuf;

/// Where in a policy file a problem is, and what it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    /// The file (or `<input>` for text that came from no file).
    pub file: String,
    /// 1-based line; 0 when the position is unknown (an empty file, an I/O error).
    pub line: u64,
    /// 1-based column; 0 when unknown.
    pub column: u64,
    /// The field path, such as `limits[2].overrides[0].capacity`; empty for the whole document.
    pub path: String,
    /// What is wrong and, where it helps, what to write instead.
    pub message: String,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}: ", self.file, self.line, self.column)?;
        if !self.path.is_empty() {
            write!(f, "{}: ", self.path)?;
        }
        f.write_str(&self.message)
    }
}

/// Everything that can go wrong in the policy crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A policy (or an import source) that does not parse or does not validate.
    #[error("{0}")]
    Invalid(Box<Diagnostic>),
    /// A file that cannot be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A policy directory with no policy file in it: refused rather than read as a policy
    /// without limits, since a directory caught mid-deploy may be empty for a moment.
    #[error(
        "{} holds no policy file: a policy directory holds .yaml or .yml files, merged into one \
         policy",
        path.display()
    )]
    EmptyDirectory {
        /// The directory.
        path: PathBuf,
    },
    /// A limit named that the policy in force does not have.
    #[error("the policy has no limit named {name:?}")]
    UnknownLimit {
        /// The name given.
        name: String,
    },
    /// A rollback with no earlier version kept.
    #[error("no earlier policy version is kept to roll back to")]
    NothingToRollBack,
    /// The core refused a check (a cost of zero or above a limit's capacity).
    #[error("{}", check_message(.limit, .source))]
    Check {
        /// The limit that refused it; empty when the request was refused before any limit was
        /// looked at (a cost of 0 is invalid whatever applies).
        limit: String,
        /// The core's reason.
        source: tollgate::Error,
    },
    /// A version with a rate limit the store in use cannot keep exactly (see
    /// [`crate::EngineOptions::limit_check`]): refused like an invalid file, since every
    /// decision on that limit would fail.
    #[error("limit {limit}: {source}")]
    Unsupported {
        /// The limit refused.
        limit: String,
        /// The store's reason.
        source: tollgate::Error,
    },
    /// The file watcher could not be started.
    #[error("cannot watch {}: {source}", path.display())]
    Watch {
        /// The directory watched.
        path: PathBuf,
        /// The watcher's reason.
        source: notify_debouncer_full::notify::Error,
    },
}

/// The text of [`Error::Check`]: a cost of 0 refused before matching has no limit, and no
/// capacity to quote.
fn check_message(limit: &str, source: &tollgate::Error) -> String {
    match source {
        tollgate::Error::InvalidCost { cost: 0, .. } if limit.is_empty() => {
            "cost 0 is invalid: it must be at least 1".to_owned()
        }
        _ if limit.is_empty() => source.to_string(),
        _ => format!("limit {limit}: {source}"),
    }
}

impl Error {
    /// The diagnostic, when the error is about a position in a file.
    pub fn diagnostic(&self) -> Option<&Diagnostic> {
        match self {
            Error::Invalid(diagnostic) => Some(diagnostic),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(limit: &str, cost: u64) -> String {
        let source = tollgate::Error::InvalidCost { cost, capacity: 10 };
        Error::Check {
            limit: limit.to_owned(),
            source,
        }
        .to_string()
    }

    /// A cost refused before any limit was looked at names no limit and no capacity; once a
    /// limit refused it, the message names the limit and keeps the core's reason.
    #[test]
    fn a_refused_cost_names_its_limit_only_when_there_is_one() {
        let core = |cost| tollgate::Error::InvalidCost { cost, capacity: 10 }.to_string();
        assert_eq!(check("", 0), "cost 0 is invalid: it must be at least 1");
        assert_eq!(check("", 11), core(11));
        assert_eq!(check("api", 0), format!("limit api: {}", core(0)));
        assert_eq!(check("api", 11), format!("limit api: {}", core(11)));
    }
}
