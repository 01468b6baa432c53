//! The `tollgate` binary's global allocator: mimalloc, asked for an alignment only when a block
//! needs more than mimalloc gives every block anyway.
//!
//! Why this crate exists: `mimalloc::MiMalloc` passes every allocation to `mi_malloc_aligned`.
//! That call serves a block at once only when the thread's page of the right size has a free
//! block at hand; when it has none, which is often in the server, where a request's blocks are
//! freed by another worker thread and come back to the page only once collected, it falls back
//! to a generic path that, unless the size is a power of two, over-allocates `size + align - 1`
//! bytes from a larger size class. Under load 6 of the 33 allocations of an HTTP check went that
//! way, each block from a size class too large. Plain `mi_malloc` has no such fallback (an
//! empty page is refilled from its thread-free list): taking it took 0.7k–1.0k instructions
//! off every request of the server (BENCHMARKS.md, seventy-second session).
//!
//! Every block mimalloc hands out is aligned to a machine word (its block sizes are whole
//! words) and, from 16 bytes up, to 16 (`MI_MAX_ALIGN_SIZE`, the alignment of C's
//! `max_align_t`, which any `malloc` must honour). So a layout asking for at most 16 goes to
//! `mi_malloc`, as the standard library's `System` allocator sends such layouts to `malloc`.
//! The address is still checked: a block less aligned than the layout asks goes back and is
//! asked for again through `mi_malloc_aligned`, so a wrong belief about how mimalloc was built
//! costs an allocation, never soundness.
//!
//! ```
//! #[global_allocator]
//! static ALLOCATOR: tollgate_alloc::Allocator = tollgate_alloc::Allocator;
//!
//! fn main() {
//!     let words: Vec<u64> = (0..1000).collect();
//!     assert_eq!(words.iter().sum::<u64>(), 499_500);
//! }
//! ```

#![cfg_attr(not(test), no_std)]
// The one crate of the workspace with `unsafe`: a `GlobalAlloc` is an unsafe trait, and
// mimalloc is reached through its C functions.
#![allow(unsafe_code)]

use core::alloc::{GlobalAlloc, Layout};
use core::ffi::c_void;

use libmimalloc_sys as ffi;

/// The alignment every block of 16 bytes or more from plain `mi_malloc` has
/// (`MI_MAX_ALIGN_SIZE`); smaller blocks have at least a word's, which is all a layout of
/// fewer than 16 bytes can need unless it asks for more than its size.
const PLAIN_ALIGN: usize = 16;

/// The largest alignment plain `mi_realloc` keeps: a word's, as mimalloc's own
/// `mi_realloc_aligned` assumes when it hands such alignments to `mi_realloc`.
const WORD_ALIGN: usize = core::mem::size_of::<usize>();

/// mimalloc as the global allocator, with plain allocations for ordinary alignments.
///
/// Freed blocks go back to the thread that allocated them through mimalloc's thread-free
/// lists, which is what makes it cheap when a request's memory is freed by another worker.
#[derive(Clone, Copy, Debug, Default)]
pub struct Allocator;

/// Whether `ptr` (null included: a failed allocation is passed on as such) satisfies `layout`.
#[inline]
fn fits(ptr: *mut c_void, layout: Layout) -> bool {
    (ptr as usize) & (layout.align() - 1) == 0
}

/// A block for `layout` from `plain` (`mi_malloc` or `mi_zalloc`) when its alignment allows
/// and the block turns out aligned, else from `aligned`, the same call with an alignment.
#[inline]
fn allocate(
    layout: Layout,
    plain: unsafe extern "C" fn(usize) -> *mut c_void,
    aligned: unsafe extern "C" fn(usize, usize) -> *mut c_void,
) -> *mut u8 {
    if layout.align() <= PLAIN_ALIGN {
        // SAFETY: mi_malloc and mi_zalloc take any size.
        let ptr = unsafe { plain(layout.size()) };
        if fits(ptr, layout) {
            return ptr.cast();
        }
        // SAFETY: `ptr` came from mimalloc just now and nothing else holds it.
        unsafe { ffi::mi_free(ptr) };
    }
    // SAFETY: a layout's alignment is a nonzero power of two, as the aligned calls need.
    unsafe { aligned(layout.size(), layout.align()) }.cast()
}

// SAFETY: every block comes from mimalloc, whose `mi_malloc*` functions return blocks of at
// least the size asked for (or null), aligned as checked or as `*_aligned` guarantees, and
// `mi_free` / `mi_realloc*` accept any block any of them returned. Nothing here unwinds.
unsafe impl GlobalAlloc for Allocator {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        allocate(layout, ffi::mi_malloc, ffi::mi_malloc_aligned)
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        allocate(layout, ffi::mi_zalloc, ffi::mi_zalloc_aligned)
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: the caller passes a block this allocator returned, which mimalloc allocated.
        unsafe { ffi::mi_free(ptr.cast()) };
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // Unlike a fresh block, a moved one cannot be given back for another try (the old one
        // is gone), so only the alignment every block has goes through plain mi_realloc.
        if layout.align() <= WORD_ALIGN {
            // SAFETY: `ptr` is a live block of this allocator, hence of mimalloc.
            unsafe { ffi::mi_realloc(ptr.cast(), new_size) }.cast()
        } else {
            // SAFETY: as above; the alignment is a power of two.
            unsafe { ffi::mi_realloc_aligned(ptr.cast(), new_size, layout.align()) }.cast()
        }
    }
}

#[cfg(test)]
mod tests {
    use core::alloc::{GlobalAlloc, Layout};

    use super::Allocator;

    const ALIGNS: [usize; 11] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096];

    fn sizes() -> impl Iterator<Item = usize> {
        (1..=300).chain([511, 512, 513, 1000, 1024, 1025, 4095, 8192, 70_000, 1 << 21])
    }

    #[test]
    fn every_block_is_aligned_as_asked_and_holds_its_size() {
        // Many blocks of each layout live at once, so that pages fill and new ones are taken.
        for align in ALIGNS {
            for size in sizes() {
                let layout = Layout::from_size_align(size, align).unwrap();
                let count = if size > 10_000 { 2 } else { 24 };
                let mut blocks = [core::ptr::null_mut::<u8>(); 24];
                for (index, slot) in blocks.iter_mut().take(count).enumerate() {
                    // SAFETY: the layout has a nonzero size.
                    let ptr = unsafe { Allocator.alloc(layout) };
                    assert!(!ptr.is_null(), "size {size} align {align}");
                    assert_eq!(ptr as usize % align, 0, "size {size} align {align}");
                    // SAFETY: the block holds `size` bytes.
                    unsafe { ptr.write_bytes(index as u8, size) };
                    *slot = ptr;
                }
                for (index, ptr) in blocks.iter().take(count).enumerate() {
                    // SAFETY: written above, `size` bytes long.
                    let bytes = unsafe { core::slice::from_raw_parts(*ptr, size) };
                    assert!(bytes.iter().all(|&b| b == index as u8), "size {size}");
                    // SAFETY: allocated above with this layout, freed once.
                    unsafe { Allocator.dealloc(*ptr, layout) };
                }
            }
        }
    }

    #[test]
    fn zeroed_blocks_are_zero_even_where_freed_ones_were_written() {
        for align in ALIGNS {
            for size in sizes().step_by(7) {
                let layout = Layout::from_size_align(size, align).unwrap();
                // SAFETY: nonzero size; the block is filled then freed, leaving dirty memory.
                unsafe {
                    let dirty = Allocator.alloc(layout);
                    dirty.write_bytes(0xAB, size);
                    Allocator.dealloc(dirty, layout);
                }
                // SAFETY: nonzero size; read within the block, then freed once.
                unsafe {
                    let ptr = Allocator.alloc_zeroed(layout);
                    assert_eq!(ptr as usize % align, 0, "size {size} align {align}");
                    let bytes = core::slice::from_raw_parts(ptr, size);
                    assert!(bytes.iter().all(|&b| b == 0), "size {size} align {align}");
                    Allocator.dealloc(ptr, layout);
                }
            }
        }
    }

    #[test]
    fn a_reallocated_block_keeps_its_contents_and_alignment() {
        for align in ALIGNS {
            let mut size = 3;
            let layout = Layout::from_size_align(size, align).unwrap();
            // SAFETY: nonzero size.
            let mut ptr = unsafe { Allocator.alloc(layout) };
            // SAFETY: the block holds `size` bytes.
            unsafe { ptr.write_bytes(7, size) };
            // Grow past several size classes and a page, then shrink.
            for next in [5, 17, 100, 1000, 5000, 100_000, 40, 9] {
                let old = Layout::from_size_align(size, align).unwrap();
                // SAFETY: `ptr` is live with layout `old`; `next` is nonzero.
                ptr = unsafe { Allocator.realloc(ptr, old, next) };
                assert!(!ptr.is_null());
                assert_eq!(ptr as usize % align, 0, "{size} -> {next}, align {align}");
                let kept = size.min(next);
                // SAFETY: the block holds `next` >= `kept` bytes.
                let bytes = unsafe { core::slice::from_raw_parts(ptr, kept) };
                assert!(
                    bytes.iter().all(|&b| b == 7),
                    "{size} -> {next}, align {align}"
                );
                // SAFETY: as above.
                unsafe { ptr.write_bytes(7, next) };
                size = next;
            }
            let last = Layout::from_size_align(size, align).unwrap();
            // SAFETY: live with that layout, freed once.
            unsafe { Allocator.dealloc(ptr, last) };
        }
    }
}
