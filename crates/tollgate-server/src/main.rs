//! The `tollgate` command: parse the arguments and hand over to [`tollgate_server::cli`].

use std::process::ExitCode;

fn main() -> ExitCode {
    tollgate_server::cli::main()
}
