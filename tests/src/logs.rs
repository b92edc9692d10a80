//! Reading the logs of the processes the harness starts, as plain text. The harness starts them
//! with `NO_COLOR=1` (tracing-subscriber then writes no colours), and strips any ANSI escape that
//! is still there, so that a check like `log.contains("node=node-1 desired=")` compares the text a
//! reader sees: with colours, field names are wrapped in escapes (`\x1b[3mnode\x1b[0m\x1b[2m=`) and
//! such a check could never match (and its negation could never fail).

use std::path::Path;

/// The environment variable (and value) that turns colours off in the binaries' logs.
pub const NO_COLOR: (&str, &str) = ("NO_COLOR", "1");

/// `text` without ANSI escape sequences (CSI `ESC [ ... final`, and two-byte `ESC x`).
pub fn without_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\u{1b}' {
            out.push(c);
            continue;
        }
        // CSI (`ESC [`): parameter and intermediate bytes up to a final byte in 0x40..=0x7e.
        // Any other escape is two characters long.
        if chars.next() == Some('[') {
            for c in chars.by_ref() {
                if ('\u{40}'..='\u{7e}').contains(&c) {
                    break;
                }
            }
        }
    }
    out
}

/// The log file at `path` as plain text; a log not written yet reads as empty.
pub fn read(path: &Path) -> String {
    std::fs::read(path)
        .map(|bytes| without_ansi(&String::from_utf8_lossy(&bytes)))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colours_are_removed_and_text_is_kept() {
        // A line as tracing-subscriber writes it with colours.
        let coloured = "\u{1b}[2m2026-01-01T00:00:00Z\u{1b}[0m \u{1b}[32m INFO\u{1b}[0m \
             \u{1b}[2mswitchyard_operator::controller\u{1b}[0m\u{1b}[2m:\u{1b}[0m applied NodeProxy spec \
             \u{1b}[3mnode\u{1b}[0m\u{1b}[2m=\u{1b}[0mnode-3 \u{1b}[3mdesired\u{1b}[0m\u{1b}[2m=\u{1b}[0mSome(Nftables)";
        assert!(!coloured.contains("node=node-3 desired="));
        let plain = without_ansi(coloured);
        assert_eq!(
            plain,
            "2026-01-01T00:00:00Z  INFO switchyard_operator::controller: applied NodeProxy spec \
             node=node-3 desired=Some(Nftables)"
        );
        assert_eq!(without_ansi("plain ä text\n"), "plain ä text\n");
        assert_eq!(without_ansi("cut \u{1b}["), "cut ");
    }
}
