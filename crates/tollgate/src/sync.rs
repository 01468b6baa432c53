//! The lock the memory store shards use, swapped for loom's under `--cfg loom` so the loom
//! model in `tests/loom.rs` explores every interleaving of the real store code.

#[cfg(not(loom))]
pub(crate) use parking_lot::{Mutex, MutexGuard};

#[cfg(loom)]
pub(crate) use loom::sync::{Mutex, MutexGuard};

/// Locks `mutex`. parking_lot locks cannot be poisoned; loom's can only be if a model thread
/// panicked, and then the model has failed anyway.
#[cfg(not(loom))]
#[inline]
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock()
}

#[cfg(loom)]
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
