//! Reload the policy when its file changes.
//!
//! The watcher watches the file's **directory**, not the file: editors and deploy tools replace
//! a file by writing a new one and renaming it over the old (the old inode, which a file watch
//! would follow, never changes), and Kubernetes updates a mounted ConfigMap by swapping a
//! `..data` symlink inside the directory. Any change in the directory triggers a reload after a
//! debounce; the engine skips bytes it has already read (so an unrelated file does not undo a
//! rollback or retry a refused file), refuses a bad file and keeps the last good version, so a
//! spurious event costs one read. A policy directory is watched itself: a file added, changed,
//! renamed or removed in it, or a ConfigMap swap inside it, reloads the whole. One reached
//! through a link (`current -> releases/7`) is also seen when the link is swapped to another
//! release; the watch inside stays on the release it started on, so a release is changed by
//! swapping to a new one (or by a reload on request), not edited in place.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify_debouncer_full::notify::{EventKind, RecommendedWatcher, RecursiveMode};
use notify_debouncer_full::{DebounceEventResult, Debouncer, RecommendedCache, new_debouncer};

use crate::engine::PolicyEngine;
use crate::error::Error;
use crate::policy::Policy;

/// The result of one reload the watcher triggered.
pub type ReloadResult = Result<Arc<Policy>, Error>;

/// Reloads a [`PolicyEngine`] from its file on every change, until dropped.
pub struct PolicyWatcher {
    _debouncer: Debouncer<RecommendedWatcher, RecommendedCache>,
    dir: PathBuf,
}

impl std::fmt::Debug for PolicyWatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyWatcher")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl PolicyWatcher {
    /// Watches the directory of `engine`'s file (or its policy directory), reloading `debounce`
    /// after the last change.
    ///
    /// # Errors
    ///
    /// [`Error::Watch`] when the engine has no file or the directory cannot be watched.
    pub fn start(engine: Arc<PolicyEngine>, debounce: Duration) -> Result<Self, Error> {
        Self::start_with(engine, debounce, |_| {})
    }

    /// Like [`start`](Self::start), and calls `on_reload` with each reload's result (for
    /// metrics and tests); an event that left the file's bytes as last read gives the policy in
    /// force ([`PolicyEngine::reload_if_changed`]). It runs on the watcher's thread.
    ///
    /// # Errors
    ///
    /// As for `start`.
    pub fn start_with(
        engine: Arc<PolicyEngine>,
        debounce: Duration,
        mut on_reload: impl FnMut(ReloadResult) + Send + 'static,
    ) -> Result<Self, Error> {
        let Some(file) = engine.path() else {
            return Err(Error::Watch {
                path: PathBuf::new(),
                source: notify_debouncer_full::notify::Error::generic(
                    "the engine was not started from a file",
                ),
            });
        };
        let dir = directory_of(file);
        // A policy directory reached through a link (`current -> releases/7`) is replaced by
        // swapping the link, which only the link's own directory sees: the watch on `dir`
        // follows the link to the release it pointed at when it started.
        let link_parent = is_linked_directory(file).then(|| parent_of(file));
        let handler = move |result: DebounceEventResult| {
            let relevant = match &result {
                // Reading the file ourselves produces access events: reacting to them would
                // reload forever.
                Ok(events) => events
                    .iter()
                    .any(|e| !matches!(e.event.kind, EventKind::Access(_))),
                // Lost events (a queue overflow) may hide a change: reload to be sure.
                Err(_) => true,
            };
            if relevant {
                // Any file in the directory triggers this, so only bytes that changed since the
                // last read are loaded: an unrelated file must not undo a rollback.
                on_reload(engine.reload_if_changed());
            }
        };
        let watch_error = |source| Error::Watch {
            path: dir.clone(),
            source,
        };
        let mut debouncer = new_debouncer(debounce, None, handler).map_err(watch_error)?;
        debouncer
            .watch(&dir, RecursiveMode::NonRecursive)
            .map_err(watch_error)?;
        if let Some(parent) = &link_parent {
            debouncer
                .watch(parent, RecursiveMode::NonRecursive)
                .map_err(|source| Error::Watch {
                    path: parent.clone(),
                    source,
                })?;
        }
        Ok(Self {
            _debouncer: debouncer,
            dir,
        })
    }

    /// The directory watched.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

fn directory_of(file: &Path) -> PathBuf {
    if file.is_dir() {
        return file.to_owned();
    }
    parent_of(file)
}

/// The directory `path` is named in.
fn parent_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_owned(),
        _ => PathBuf::from("."),
    }
}

/// Whether `path` is a link to a directory.
fn is_linked_directory(path: &Path) -> bool {
    path.is_dir()
        && path
            .symlink_metadata()
            .is_ok_and(|meta| meta.file_type().is_symlink())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file named without a directory lives in the working one: watching the empty path
    /// would fail.
    #[test]
    fn a_bare_file_name_is_watched_in_the_working_directory() {
        assert_eq!(directory_of(Path::new("policy.yaml")), Path::new("."));
        assert_eq!(directory_of(Path::new("etc/p.yaml")), Path::new("etc"));
        assert_eq!(directory_of(Path::new("/p.yaml")), Path::new("/"));
    }
}
