//! Reload the policy when its file changes.
//!
//! The watcher watches the file's **directory**, not the file: editors and deploy tools replace
//! a file by writing a new one and renaming it over the old (the old inode, which a file watch
//! would follow, never changes), and Kubernetes updates a mounted ConfigMap by swapping a
//! `..data` symlink inside the directory. Any change in the directory triggers a reload after a
//! debounce; the engine skips bytes it has already read (so an unrelated file does not undo a
//! rollback or retry a refused file), refuses a bad file and keeps the last good version, so a
//! spurious event costs one read. A policy directory is watched itself: a file added, changed,
//! renamed or removed in it, or a ConfigMap swap inside it, reloads the whole.
//!
//! Links are followed to where the bytes live, and followed again when they move. A policy
//! file linked from elsewhere (`/etc/tollgate/policy.yaml -> /srv/policies/prod.yaml`) is
//! watched in both directories, so an edit of the target is seen; a policy directory reached
//! through a link (`current -> releases/7`) is watched where the link lives too, so a deploy
//! that swaps the link is seen, and from then on the watch is on the new release, so an edit
//! made inside it is seen as well.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::Duration;

use notify_debouncer_full::notify::{EventKind, RecommendedWatcher, RecursiveMode};
use notify_debouncer_full::{DebounceEventResult, Debouncer, RecommendedCache, new_debouncer};
use parking_lot::Mutex;

use crate::engine::PolicyEngine;
use crate::error::Error;
use crate::policy::Policy;
use crate::sources::policy_files_in;

/// The result of one reload the watcher triggered.
pub type ReloadResult = Result<Arc<Policy>, Error>;

type Watching = Debouncer<RecommendedWatcher, RecommendedCache>;

/// The debouncer and the directories it watches.
struct Watches {
    debouncer: Watching,
    dirs: BTreeSet<PathBuf>,
}

/// Reloads a [`PolicyEngine`] from its file on every change, until dropped.
pub struct PolicyWatcher {
    // Shared with the event handler, which moves the watches when a link moves: it holds only
    // a weak reference, so dropping the watcher stops it.
    _watches: Arc<Mutex<Option<Watches>>>,
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
        let Some(file) = engine.path().map(Path::to_owned) else {
            return Err(Error::Watch {
                path: PathBuf::new(),
                source: notify_debouncer_full::notify::Error::generic(
                    "the engine was not started from a file",
                ),
            });
        };
        let dir = directory_of(&file);
        let shared = Arc::new(Mutex::new(None));
        let weak: Weak<Mutex<Option<Watches>>> = Arc::downgrade(&shared);
        let behind = file.clone();
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
            if !relevant {
                return;
            }
            // Before reading, so that an edit made after the read is seen in its new place.
            if let Some(shared) = weak.upgrade()
                && let Some(watches) = shared.lock().as_mut()
            {
                watches.follow(directories_behind(&behind));
            }
            // Any file in the directory triggers this, so only bytes that changed since the
            // last read are loaded: an unrelated file must not undo a rollback.
            on_reload(engine.reload_if_changed());
        };
        let watch_error = |source| Error::Watch {
            path: dir.clone(),
            source,
        };
        let mut debouncer = new_debouncer(debounce, None, handler).map_err(watch_error)?;
        // The directory the policy is named in must be watched; the others behind links are
        // watched when they can be, and tried again on each event when they cannot.
        let main = real_path(&dir);
        debouncer
            .watch(&main, RecursiveMode::NonRecursive)
            .map_err(watch_error)?;
        let mut watches = Watches {
            debouncer,
            dirs: BTreeSet::from([main]),
        };
        watches.follow(directories_behind(&file));
        *shared.lock() = Some(watches);
        Ok(Self {
            _watches: shared,
            dir,
        })
    }

    /// The directory watched.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Watches {
    /// Moves the watches to directories `now`: one that could not be watched is left out, to
    /// be tried again on the next event.
    fn follow(&mut self, now: BTreeSet<PathBuf>) {
        if now == self.dirs {
            return;
        }
        for gone in self.dirs.difference(&now) {
            // A release deleted since took its watch with it; there is nothing else to undo.
            let _ = self.debouncer.unwatch(gone);
        }
        let before = std::mem::take(&mut self.dirs);
        for dir in now {
            if before.contains(&dir)
                || self
                    .debouncer
                    .watch(&dir, RecursiveMode::NonRecursive)
                    .is_ok()
            {
                self.dirs.insert(dir);
            }
        }
    }
}

/// The directories in which a change can change what `path` reads, as real paths: where its
/// name is (a file renamed over it, a ConfigMap's `..data` swapped beside it), where a link
/// to a directory is (the link swapped), and where linked files really are (edits made there).
fn directories_behind(path: &Path) -> BTreeSet<PathBuf> {
    let mut dirs = BTreeSet::new();
    let mut add = |dir: &Path| {
        dirs.insert(real_path(dir));
    };
    let (dir, files) = if path.is_dir() {
        (path.to_owned(), policy_files_in(path).unwrap_or_default())
    } else {
        (parent_of(path), vec![path.to_owned()])
    };
    add(&dir);
    if is_link(&dir) {
        add(&parent_of(&dir));
    }
    for file in files {
        // A file that is not there now (an editor between writing and renaming) adds nothing;
        // its next event puts it back.
        if let Ok(real) = file.canonicalize() {
            add(&parent_of(&real));
        }
    }
    dirs
}

/// `path` with every link followed, or as given when it cannot be (it is not there now).
fn real_path(path: &Path) -> PathBuf {
    path.canonicalize().unwrap_or_else(|_| path.to_owned())
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

/// Whether `path` is itself a link.
fn is_link(path: &Path) -> bool {
    path.symlink_metadata()
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

    /// A linked file is watched where its name is and where it really is; a linked directory
    /// where it really is and where its link is; a plain file in its directory alone.
    #[cfg(unix)]
    #[test]
    fn links_are_watched_at_both_ends() {
        use std::os::unix::fs::symlink;
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let root = tmp.path().canonicalize().unwrap_or_else(|e| panic!("{e}"));
        for dir in ["etc", "srv", "releases/7"] {
            std::fs::create_dir_all(root.join(dir)).unwrap_or_else(|e| panic!("{e}"));
        }
        for file in ["srv/prod.yaml", "etc/plain.yaml", "releases/7/a.yaml"] {
            std::fs::write(root.join(file), "limits: []\n").unwrap_or_else(|e| panic!("{e}"));
        }
        symlink(root.join("srv/prod.yaml"), root.join("etc/policy.yaml"))
            .unwrap_or_else(|e| panic!("{e}"));
        symlink("releases/7", root.join("current")).unwrap_or_else(|e| panic!("{e}"));
        let set =
            |paths: &[&str]| -> BTreeSet<PathBuf> { paths.iter().map(|p| root.join(p)).collect() };
        assert_eq!(
            directories_behind(&root.join("etc/policy.yaml")),
            set(&["etc", "srv"])
        );
        assert_eq!(
            directories_behind(&root.join("etc/plain.yaml")),
            set(&["etc"])
        );
        assert_eq!(
            directories_behind(&root.join("current")),
            set(&["", "releases/7"])
        );
    }
}
