//! What reaches the terminal: text that came from a file (tensor names,
//! plugin descriptions, paths, reasons) is escaped so that it cannot move
//! the cursor, rewrite a line or change colours, and writes to stderr never
//! panic (`2>/dev/full` must not turn a finished run into a crash).
//!
//! Hand-written because it is a few lines: tracing-subscriber escapes ESC,
//! BEL and C1 codes in log messages but leaves a bare CR, and nothing
//! escapes what `main` and the tables print.

use std::borrow::Cow;
use std::io::Write;

/// Folds a possibly multi-line error into one line of bounded length.
pub fn one_line(s: &str) -> String {
    let joined = s
        .split('\n')
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ");
    if joined.chars().count() > 300 {
        let cut: String = joined.chars().take(297).collect();
        format!("{cut}...")
    } else {
        joined
    }
}

/// `s` with every control character (C0 but tab, DEL, C1) written as a
/// visible escape (`\r`, `\n`, `\x1b`, `\u{9b}`).
pub fn clean(s: &str) -> Cow<'_, str> {
    if !s.chars().any(is_control) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if (c as u32) < 0x80 && is_control(c) => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c if is_control(c) => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

fn is_control(c: char) -> bool {
    c != '\t' && c.is_control()
}

/// Writes one line to stderr; a failing stderr is ignored (there is nowhere
/// left to report it).
pub fn eprint_line(line: &str) {
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(line.as_bytes());
    let _ = err.write_all(b"\n");
}

/// The writer `tracing` logs through: stderr, with every C0 control byte
/// other than newline and tab escaped (ESC too, unless `ansi` says the
/// subscriber's own colour codes are wanted; messages' own ESC bytes were
/// already escaped by tracing-subscriber), and write errors ignored.
pub struct LogWriter {
    /// Keep ESC bytes (colours on a terminal).
    pub ansi: bool,
}

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut out = Vec::with_capacity(buf.len());
        for &b in buf {
            match b {
                b'\n' | b'\t' => out.push(b),
                0x1b if self.ansi => out.push(b),
                b'\r' => out.extend_from_slice(b"\\r"),
                0..=0x1f | 0x7f => out.extend_from_slice(format!("\\x{b:02x}").as_bytes()),
                _ => out.push(b),
            }
        }
        let _ = std::io::stderr().lock().write_all(&out);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let _ = std::io::stderr().flush();
        Ok(())
    }
}

/// An error and its causes as one escaped line: `outer: cause: root`, a
/// cause left out when the text before it already says it (`reading x: No
/// such file or directory (os error 2)` is not followed by the same OS text
/// again), folded onto one line and bounded.
pub fn error_line(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if parts.last().is_some_and(|last| last.contains(&text)) {
            continue;
        }
        parts.push(text);
    }
    clean(&one_line(&parts.join(": "))).into_owned()
}

/// Whether `e` is a cancellation (Ctrl-C, SIGTERM) rather than a failure.
pub fn is_cancelled(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        matches!(
            c.downcast_ref::<sdhost_models::ModelError>(),
            Some(sdhost_models::ModelError::Cancelled)
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_folds_and_bounds() {
        assert_eq!(one_line("a\n  b\n\nc"), "a; b; c");
        let long = "x".repeat(400);
        let s = one_line(&long);
        assert_eq!(s.chars().count(), 300);
        assert!(s.ends_with("..."));
    }

    #[test]
    fn error_lines_say_each_cause_once_and_escaped() {
        let io = std::io::Error::from(std::io::ErrorKind::NotFound);
        let e = anyhow::Error::new(io)
            .context(format!(
                "x.png: {}",
                std::io::Error::from(std::io::ErrorKind::NotFound)
            ))
            .context("reading \x1b[31mx");
        assert_eq!(
            error_line(&e),
            "reading \\x1b[31mx: x.png: entity not found"
        );
        let c = anyhow::Error::new(sdhost_models::ModelError::Cancelled).context("model");
        assert!(is_cancelled(&c));
        assert!(!is_cancelled(&anyhow::anyhow!("cancelled")));
    }

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(clean("plain tab\tok"), "plain tab\tok");
        assert_eq!(
            clean("a\x1b[2Jb\rc\nd\x07\u{9b}e\u{7f}"),
            "a\\x1b[2Jb\\rc\\nd\\x07\\u{9b}e\\x7f"
        );
        assert!(matches!(clean("é ü 猫"), Cow::Borrowed(_)));
    }
}
