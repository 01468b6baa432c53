//! Where a policy is read from: one file, or a directory of files merged into one policy.
//!
//! A directory lets each team keep its limits in a file of its own, reviewed by its owners and
//! mounted from its own ConfigMap, while one process enforces them all as one version: a bad
//! file refuses the whole reload, since enforcing the other files without it would silently drop
//! its limits. Only `.yaml` and `.yml` files directly in the directory count, in name order;
//! hidden ones are left out, which covers editors' and deploy tools' temporary files and the
//! `..data` links Kubernetes swaps inside a mounted ConfigMap.

use std::path::{Path, PathBuf};

use crate::compile::{compile, compile_directory, files_hash};
use crate::error::Error;
use crate::key::stable_hash;
use crate::policy::Policy;

/// The policy files of directory `dir`: its `.yaml` and `.yml` files that are not hidden,
/// following symbolic links, in name order. What `--config DIR` merges, and what `tollgate
/// import envoy DIR` reads.
///
/// # Errors
///
/// [`Error::Io`] when the directory cannot be listed.
pub fn policy_files_in(dir: &Path) -> Result<Vec<PathBuf>, Error> {
    let io = |source| Error::Io {
        path: dir.to_owned(),
        source,
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        let Some(name) = path.file_name() else {
            continue;
        };
        let hidden = name.as_encoded_bytes().starts_with(b".");
        let yaml = path
            .extension()
            .is_some_and(|ext| ext == "yaml" || ext == "yml");
        if yaml && !hidden && path.is_file() {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// The text of a policy as read, before it is compiled.
#[derive(Debug)]
pub(crate) enum Sources {
    /// One file's text.
    File(String),
    /// A directory's files, by name, in name order.
    Directory(Vec<(String, String)>),
}

impl Sources {
    /// Reads the file or directory at `path`.
    pub(crate) fn read(path: &Path) -> Result<Self, Error> {
        if !path.is_dir() {
            return read_text(path).map(Sources::File);
        }
        let mut files = Vec::new();
        for file in policy_files_in(path)? {
            let name = file
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            files.push((name, read_text(&file)?));
        }
        Ok(Sources::Directory(files))
    }

    /// A hash of what was read, to recognise an unchanged file or directory: a file's text, or
    /// a directory's names and contents (a renamed file changes whose limits are whose).
    pub(crate) fn hash(&self) -> u64 {
        match self {
            Sources::File(text) => stable_hash(text.as_bytes()),
            Sources::Directory(files) => {
                files_hash(files.iter().map(|(n, t)| (n.as_str(), t.as_str())))
            }
        }
    }

    /// Compiles what was read from `source`.
    pub(crate) fn compile(&self, source: &str) -> Result<Policy, Error> {
        match self {
            Sources::File(text) => compile(source, text),
            Sources::Directory(files) => {
                let named: Vec<(&str, &str)> = files
                    .iter()
                    .map(|(n, t)| (n.as_str(), t.as_str()))
                    .collect();
                compile_directory(source, &named)
            }
        }
    }
}

fn read_text(path: &Path) -> Result<String, Error> {
    std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only visible `.yaml` and `.yml` files count, through links, in name order: a README,
    /// an editor's backup, a hidden temporary file or a subdirectory is not a policy.
    #[test]
    fn a_directory_holds_its_visible_yaml_files_in_name_order() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let write = |name: &str| {
            std::fs::write(dir.path().join(name), "limits: []\n").unwrap_or_else(|e| panic!("{e}"))
        };
        for name in [
            "b.yml",
            "a.yaml",
            "c.yaml~",
            ".d.yaml",
            "README.md",
            "e.YAML",
        ] {
            write(name);
        }
        std::fs::create_dir(dir.path().join("f.yaml")).unwrap_or_else(|e| panic!("{e}"));
        std::fs::create_dir(dir.path().join("..data")).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(dir.path().join("..data/g.yaml"), "limits: []\n")
            .unwrap_or_else(|e| panic!("{e}"));
        #[cfg(unix)]
        std::os::unix::fs::symlink("..data/g.yaml", dir.path().join("g.yaml"))
            .unwrap_or_else(|e| panic!("{e}"));
        let names: Vec<String> = policy_files_in(dir.path())
            .unwrap_or_else(|e| panic!("{e}"))
            .iter()
            .filter_map(|p| p.file_name()?.to_str().map(str::to_owned))
            .collect();
        #[cfg(unix)]
        assert_eq!(names, ["a.yaml", "b.yml", "g.yaml"]);
        #[cfg(not(unix))]
        assert_eq!(names, ["a.yaml", "b.yml"]);
    }

    /// The hash tells a renamed file from an unchanged directory, and a directory from its
    /// single file's text.
    #[test]
    fn the_hash_covers_names_and_contents() {
        let dir = |files: &[(&str, &str)]| {
            Sources::Directory(
                files
                    .iter()
                    .map(|(n, t)| ((*n).to_owned(), (*t).to_owned()))
                    .collect(),
            )
            .hash()
        };
        let one = dir(&[("a.yaml", "x"), ("b.yaml", "y")]);
        assert_eq!(one, dir(&[("a.yaml", "x"), ("b.yaml", "y")]));
        assert_ne!(one, dir(&[("a.yaml", "x"), ("c.yaml", "y")]));
        assert_ne!(one, dir(&[("a.yaml", "xy"), ("b.yaml", "")]));
        assert_ne!(one, dir(&[("a.yaml", "x")]));
        assert_ne!(
            Sources::File("x".into()).hash(),
            dir(&[("a.yaml", "x")]),
            "a file and a directory are different sources"
        );
    }
}
