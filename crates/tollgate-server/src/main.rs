//! The `tollgate` command: parse the arguments and hand over to [`tollgate_server::cli`].

use std::process::ExitCode;

/// Every request allocates a little (parsed descriptors, the outcome, the response body) and
/// frees it on another worker thread soon after; glibc's allocator spent about an eighth of the
/// server's time on that under load. mimalloc's thread-local free lists make it cheap;
/// [`tollgate_alloc`] says why it is not reached through the `mimalloc` crate.
#[global_allocator]
static ALLOCATOR: tollgate_alloc::Allocator = tollgate_alloc::Allocator;

fn main() -> ExitCode {
    tollgate_server::cli::main()
}
