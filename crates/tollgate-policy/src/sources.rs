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
        read_directory(path, |_| {}).map(Sources::Directory)
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

/// Kubernetes' link, inside a mounted ConfigMap, to the directory holding its current contents.
const CONFIGMAP_DATA: &str = "..data";

/// How many times a directory is read again when a ConfigMap update removed what was being read.
const CONFIGMAP_READS: usize = 3;

/// Reads the policy files of `dir`, by name, calling `after_each` with each path read (the tests
/// change the directory there).
///
/// A mounted ConfigMap's files are links through `..data`, which an update swaps to a new
/// directory before deleting the old one. Reading file after file through the links could
/// take some from the version before a swap and some from the version after, a mix nobody
/// wrote; so a ConfigMap is read from the one directory `..data` led to when reading began,
/// and read again if an update deleted that directory meanwhile.
fn read_directory(
    dir: &Path,
    mut after_each: impl FnMut(&Path),
) -> Result<Vec<(String, String)>, Error> {
    let mut tries = 0;
    loop {
        let snapshot = configmap_snapshot(dir)?;
        let root = snapshot.as_deref().unwrap_or(dir);
        match read_files(root, &mut after_each) {
            Err(err) if snapshot.is_some() && tries + 1 < CONFIGMAP_READS => {
                // Only a swap since excuses the error: anything else is the directory's own.
                if configmap_snapshot(dir).ok().flatten() == snapshot {
                    return Err(err);
                }
                tries += 1;
            }
            read => return read,
        }
    }
}

fn read_files(
    dir: &Path,
    after_each: &mut impl FnMut(&Path),
) -> Result<Vec<(String, String)>, Error> {
    let mut files = Vec::new();
    for file in policy_files_in(dir)? {
        let name = file
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        files.push((name, read_text(&file)?));
        after_each(&file);
    }
    Ok(files)
}

/// The directory a mounted ConfigMap's `..data` leads to, when `dir` is one: `..data` links to a
/// directory and every policy file is Kubernetes' link `NAME -> ..data/NAME`. A directory that
/// merely holds a `..data` is read as it is.
fn configmap_snapshot(dir: &Path) -> Result<Option<PathBuf>, Error> {
    let Ok(target) = std::fs::read_link(dir.join(CONFIGMAP_DATA)) else {
        return Ok(None);
    };
    let snapshot = dir.join(target);
    if !snapshot.is_dir() {
        return Ok(None);
    }
    for file in policy_files_in(dir)? {
        let through_data = file.file_name().is_some_and(|name| {
            std::fs::read_link(&file).is_ok_and(|link| link == Path::new(CONFIGMAP_DATA).join(name))
        });
        if !through_data {
            return Ok(None);
        }
    }
    Ok(Some(snapshot))
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

    /// A ConfigMap mounted as Kubernetes mounts one: `..data` links to `stamp`'s directory,
    /// each file is a link through it.
    #[cfg(unix)]
    fn configmap(dir: &Path, versions: &[(&str, &[(&str, &str)])]) {
        for (stamp, files) in versions {
            std::fs::create_dir(dir.join(stamp)).unwrap_or_else(|e| panic!("{e}"));
            for (name, text) in *files {
                std::fs::write(dir.join(stamp).join(name), text).unwrap_or_else(|e| panic!("{e}"));
            }
        }
        std::os::unix::fs::symlink(versions[0].0, dir.join("..data"))
            .unwrap_or_else(|e| panic!("{e}"));
        for (name, _) in versions[0].1 {
            std::os::unix::fs::symlink(format!("..data/{name}"), dir.join(name))
                .unwrap_or_else(|e| panic!("{e}"));
        }
    }

    /// Kubernetes' update: a new `..data` link renamed over the old one.
    #[cfg(unix)]
    fn swap(dir: &Path, stamp: &str) {
        std::os::unix::fs::symlink(stamp, dir.join("..data_tmp")).unwrap_or_else(|e| panic!("{e}"));
        std::fs::rename(dir.join("..data_tmp"), dir.join("..data"))
            .unwrap_or_else(|e| panic!("{e}"));
    }

    const TWO_VERSIONS: &[(&str, &[(&str, &str)])] = &[
        ("..2026_12_07_1", &[("a.yaml", "a1"), ("b.yaml", "b1")]),
        ("..2026_12_07_2", &[("a.yaml", "a2"), ("b.yaml", "b2")]),
    ];

    fn read_with(dir: &Path, mut once: impl FnMut()) -> Vec<(String, String)> {
        let mut done = false;
        read_directory(dir, |_| {
            if !std::mem::replace(&mut done, true) {
                once();
            }
        })
        .unwrap_or_else(|e| panic!("{e}"))
    }

    fn texts(files: &[(&str, &str)]) -> Vec<(String, String)> {
        files
            .iter()
            .map(|(n, t)| ((*n).to_owned(), (*t).to_owned()))
            .collect()
    }

    /// An update landing between two files' reads does not mix the versions: the read stays
    /// on the version it began with.
    #[cfg(unix)]
    #[test]
    fn a_configmap_swapped_mid_read_is_read_as_one_version() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        configmap(dir.path(), TWO_VERSIONS);
        let read = read_with(dir.path(), || swap(dir.path(), "..2026_12_07_2"));
        assert_eq!(read, texts(TWO_VERSIONS[0].1));
        // The next read is all of the new version.
        assert_eq!(read_with(dir.path(), || {}), texts(TWO_VERSIONS[1].1));
    }

    /// An update that also deleted the version being read has the directory read again, whole,
    /// at the new version; without `..data` moving, a missing file is the directory's error.
    #[cfg(unix)]
    #[test]
    fn a_configmap_version_deleted_mid_read_is_read_again() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        configmap(dir.path(), TWO_VERSIONS);
        let read = read_with(dir.path(), || {
            swap(dir.path(), "..2026_12_07_2");
            std::fs::remove_dir_all(dir.path().join("..2026_12_07_1"))
                .unwrap_or_else(|e| panic!("{e}"));
        });
        assert_eq!(read, texts(TWO_VERSIONS[1].1));

        let mut once = true;
        let refused = read_directory(dir.path(), |_| {
            if std::mem::replace(&mut once, false) {
                std::fs::remove_file(dir.path().join("..2026_12_07_2/b.yaml"))
                    .unwrap_or_else(|e| panic!("{e}"));
            }
        });
        assert!(matches!(refused, Err(Error::Io { .. })), "{refused:?}");
    }

    /// A ConfigMap updated during every read is given up on after three reads, not read for
    /// ever: the reload is refused, and the update's own event reloads it again.
    #[cfg(unix)]
    #[test]
    fn a_configmap_updated_during_every_read_is_given_up_on() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        configmap(dir.path(), &TWO_VERSIONS[..1]);
        let mut current = TWO_VERSIONS[0].0.to_owned();
        let mut reads = 0;
        let refused = read_directory(dir.path(), |file| {
            if file.file_name().is_some_and(|name| name == "a.yaml") && reads < 10 {
                reads += 1;
                let next = format!("..2026_12_07_next_{reads}");
                std::fs::create_dir(dir.path().join(&next)).unwrap_or_else(|e| panic!("{e}"));
                for name in ["a.yaml", "b.yaml"] {
                    std::fs::write(dir.path().join(&next).join(name), "x")
                        .unwrap_or_else(|e| panic!("{e}"));
                }
                swap(dir.path(), &next);
                std::fs::remove_dir_all(dir.path().join(&current))
                    .unwrap_or_else(|e| panic!("{e}"));
                current = next;
            }
        });
        assert!(matches!(refused, Err(Error::Io { .. })), "{refused:?}");
        assert_eq!(reads, CONFIGMAP_READS);
    }

    /// A directory that merely holds a `..data`, its policy files its own, is read as it is.
    #[cfg(unix)]
    #[test]
    fn only_a_configmap_s_own_links_are_read_through_data() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        configmap(dir.path(), TWO_VERSIONS);
        std::fs::remove_file(dir.path().join("b.yaml")).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(dir.path().join("b.yaml"), "own").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            read_with(dir.path(), || {}),
            texts(&[("a.yaml", "a1"), ("b.yaml", "own")])
        );
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
