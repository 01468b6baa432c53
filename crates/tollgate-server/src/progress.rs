//! Whether a long-running command (`tollgate bench`, `tollgate simulate`) draws a progress bar.
//!
//! Both print their summary on stdout, as text or, with `--json`, for a program to read. The
//! bar goes to stderr, and only when someone watches it there. indicatif draws nothing off a
//! terminal on its own, but a bar beside a JSON summary must be hidden by the command.

use std::io::IsTerminal;

/// Whether to draw a progress bar on stderr for a command whose summary is JSON when `json`.
pub(crate) fn shown(json: bool) -> bool {
    shows(json, std::io::stderr().is_terminal())
}

/// Only for someone watching stderr, and never beside a JSON summary: stderr may be a
/// terminal while stdout is piped to a program.
fn shows(json: bool, terminal: bool) -> bool {
    !json && terminal
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bar_is_drawn_only_on_a_terminal_and_never_with_json() {
        let shown = [(false, false), (false, true), (true, false), (true, true)]
            .map(|(json, terminal)| shows(json, terminal));
        assert_eq!(shown, [false, true, false, false]);
        assert!(!super::shown(true));
        assert_eq!(super::shown(false), std::io::stderr().is_terminal());
    }
}
