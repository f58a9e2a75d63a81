//! The one renderer: every command returns a report, and [`print()`] writes
//! it as text (tables built by [`table`]) or as JSON.

use ggml::DeviceType;

/// Something a subcommand returns: its fields are its JSON form (one field
/// list for both outputs), and `text` lays them out for people.
pub trait Report: serde::Serialize {
    /// Human-readable text.
    fn text(&self) -> String;
}

/// Prints a report to stdout. A closed pipe (`sdhost devices | head -1`)
/// ends the output quietly; any other write error (`>/dev/full`) is an
/// error, so that lost output never exits 0.
pub fn print<R: Report>(r: &R, json: bool) -> anyhow::Result<()> {
    use std::io::Write;
    let text = if json {
        serde_json::to_string_pretty(r)? + "\n"
    } else {
        r.text()
    };
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(anyhow::Error::new(e).context("writing to standard output"))
        }
        _ => Ok(()),
    }
}

/// Formats bytes in binary units.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Left-aligned table with a header row. Cells are escaped
/// ([`crate::term::clean`]): descriptions, reasons and paths come from files.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            r.iter()
                .map(|c| crate::term::clean(c).into_owned())
                .collect()
        })
        .collect();
    let rows = &rows[..];
    let mut w: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if i < w.len() {
                w[i] = w[i].max(c.chars().count());
            }
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                s.push_str(&format!("{c:<width$}  ", width = w[i]));
            }
        }
        s.trim_end().to_string() + "\n"
    };
    let mut out = line(header.to_vec());
    for r in rows {
        out.push_str(&line(r.iter().map(String::as_str).collect()));
    }
    out
}

/// The lowercase name of a device type.
pub fn type_name(t: DeviceType) -> &'static str {
    match t {
        DeviceType::Cpu => "cpu",
        DeviceType::Gpu => "gpu",
        DeviceType::IGpu => "igpu",
        DeviceType::Accel => "accel",
        DeviceType::Meta => "meta",
    }
}
