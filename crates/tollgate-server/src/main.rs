//! The `tollgate` command: parse the arguments and hand over to [`tollgate_server::cli`].

use std::process::ExitCode;

/// Every request allocates a little (parsed descriptors, the outcome, the response body) and
/// frees it on another worker thread soon after; glibc's allocator spent about an eighth of the
/// server's time on that under load. mimalloc's thread-local free lists make it cheap.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    tollgate_server::cli::main()
}
