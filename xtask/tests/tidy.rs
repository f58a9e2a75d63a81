//! Structural invariants of docs/ARCHITECTURE.md, checked against the source
//! tree (as rust-analyzer keeps its architecture document honest with tidy
//! tests): a change that breaks one fails the build with the file and the
//! import at fault.
//!
//! Imports are read as text: every `crate::a::b` path (and `super::`,
//! `self::` and a child module named at the start of a `use`) outside
//! comments and outside the file's `#[cfg(test)]` part is an edge from the
//! file's module to the longest module of the crate that path names. That
//! is the granularity the invariants are stated at: one file, one module.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The workspace root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// One crate's modules (by path, `""` for the root) and the modules each
/// imports.
struct Crate {
    name: &'static str,
    files: BTreeMap<String, PathBuf>,
    edges: BTreeMap<String, BTreeSet<String>>,
}

impl Crate {
    fn read(name: &'static str, src: &str) -> Crate {
        let src = root().join(src);
        let mut files = BTreeMap::new();
        collect(&src, &src, &mut files);
        let modules: BTreeSet<String> = files.keys().cloned().collect();
        let mut edges = BTreeMap::new();
        for (module, path) in &files {
            let text = std::fs::read_to_string(path).expect("readable source");
            let children: BTreeSet<&str> = modules
                .iter()
                .filter_map(|m| m.strip_prefix(module.as_str()))
                .filter_map(|rest| {
                    let rest = if module.is_empty() {
                        rest
                    } else {
                        rest.strip_prefix("::")?
                    };
                    (!rest.is_empty() && !rest.contains("::")).then_some(rest)
                })
                .collect();
            let mut out = BTreeSet::new();
            for path in imported_paths(&code_of(&text), module, &children) {
                if let Some(target) = longest_module(&modules, &path) {
                    // A module and its submodules are one unit here: its
                    // own children (which it declares and re-exports) are
                    // not imports that could close a circle.
                    let own_child =
                        !module.is_empty() && target.starts_with(&format!("{module}::"));
                    if &target != module && !target.is_empty() && !own_child {
                        out.insert(target);
                    }
                }
            }
            edges.insert(module.clone(), out);
        }
        Crate { name, files, edges }
    }

    /// Modules under `prefix` (itself included).
    fn under<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = &'a String> + 'a {
        self.files
            .keys()
            .filter(move |m| *m == prefix || m.starts_with(&format!("{prefix}::")))
    }

    /// `(importer, imported)` for every edge from a module under one of
    /// `from` to a module under one of `to`.
    fn imports(&self, from: &[&str], to: &[&str]) -> Vec<String> {
        let is_under = |m: &str, p: &str| m == p || m.starts_with(&format!("{p}::"));
        let mut bad = Vec::new();
        for (m, targets) in &self.edges {
            if !from.iter().any(|p| is_under(m, p)) {
                continue;
            }
            for t in targets {
                if to.iter().any(|p| is_under(t, p)) {
                    let file = self.files[m].strip_prefix(root()).unwrap_or(&self.files[m]);
                    bad.push(format!("{}: {m} imports {t}", file.display()));
                }
            }
        }
        bad
    }

    /// Every import circle (strongly connected set of two or more modules).
    fn circles(&self) -> Vec<Vec<String>> {
        // Tarjan's algorithm, iteratively small enough to recurse here.
        struct State<'a> {
            edges: &'a BTreeMap<String, BTreeSet<String>>,
            index: BTreeMap<&'a str, usize>,
            low: BTreeMap<&'a str, usize>,
            stack: Vec<&'a str>,
            on_stack: BTreeSet<&'a str>,
            next: usize,
            out: Vec<Vec<String>>,
        }
        fn visit<'a>(s: &mut State<'a>, v: &'a str) {
            s.index.insert(v, s.next);
            s.low.insert(v, s.next);
            s.next += 1;
            s.stack.push(v);
            s.on_stack.insert(v);
            let targets: Vec<&'a str> = s
                .edges
                .get(v)
                .map(|t| t.iter().map(String::as_str).collect())
                .unwrap_or_default();
            for w in targets {
                if !s.index.contains_key(w) {
                    visit(s, w);
                    let lw = s.low[w];
                    let lv = s.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(lw);
                } else if s.on_stack.contains(w) {
                    let iw = s.index[w];
                    let lv = s.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(iw);
                }
            }
            if s.low[v] == s.index[v] {
                let mut scc = Vec::new();
                while let Some(w) = s.stack.pop() {
                    s.on_stack.remove(w);
                    scc.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if scc.len() > 1 {
                    scc.sort();
                    s.out.push(scc);
                }
            }
        }
        let mut s = State {
            edges: &self.edges,
            index: BTreeMap::new(),
            low: BTreeMap::new(),
            stack: Vec::new(),
            on_stack: BTreeSet::new(),
            next: 0,
            out: Vec::new(),
        };
        for v in self.edges.keys() {
            if !s.index.contains_key(v.as_str()) {
                visit(&mut s, v);
            }
        }
        s.out
    }
}

/// Every `.rs` file under `dir` by its module path.
fn collect(src: &Path, dir: &Path, out: &mut BTreeMap<String, PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("readable folder")
        .flatten()
        .map(|e| e.path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            collect(src, &p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            let rel = p.strip_prefix(src).expect("under src");
            let mut parts: Vec<String> = rel
                .with_extension("")
                .iter()
                .map(|c| c.to_string_lossy().into_owned())
                .collect();
            if matches!(
                parts.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                parts.pop();
            }
            // A binary's main.rs and the library's lib.rs are both roots;
            // keep the library's.
            let module = parts.join("::");
            if out.contains_key(&module) && rel.ends_with("main.rs") {
                continue;
            }
            out.insert(module, p);
        }
    }
}

/// The file's code without comments, string contents and its inline test
/// module (`#[cfg(test)] mod tests { … }`, which comes last; a
/// `#[cfg(test)] mod tests;` declaration is kept reading past).
fn code_of(text: &str) -> String {
    let inline_tests = text
        .match_indices("#[cfg(test)]")
        .map(|(i, _)| i)
        .find(|&i| {
            let rest = text[i + "#[cfg(test)]".len()..].trim_start();
            rest.starts_with("mod ")
                && rest
                    .find(['{', ';'])
                    .is_some_and(|j| rest.as_bytes()[j] == b'{')
        });
    let text = match inline_tests {
        Some(i) => &text[..i],
        None => text,
    };
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let line = match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        };
        // String literals hold paths in messages ("crate::…" in docs and
        // errors): blank them.
        let mut in_str = false;
        let mut prev = ' ';
        for c in line.chars() {
            if c == '"' && prev != '\\' {
                in_str = !in_str;
                out.push(' ');
            } else {
                out.push(if in_str { ' ' } else { c });
            }
            prev = c;
        }
        out.push('\n');
    }
    out
}

/// Absolute module paths (`a::b::c`) the code names.
fn imported_paths(code: &str, module: &str, children: &BTreeSet<&str>) -> Vec<String> {
    let parent = module.rsplit_once("::").map_or("", |(p, _)| p);
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    for (anchor, base) in [
        ("crate::", String::new()),
        ("super::", parent.to_string()),
        ("self::", module.to_string()),
    ] {
        let mut from = 0;
        while let Some(i) = code[from..].find(anchor) {
            let start = from + i;
            from = start + anchor.len();
            if start > 0 && ident(bytes[start - 1]) {
                continue;
            }
            out.push(join(&base, &path_at(&code[from..])));
        }
    }
    // `use child::…` and `child::item` at the start of a `use` tree.
    for line in code.lines() {
        let t = line.trim_start();
        let Some(rest) = t
            .strip_prefix("use ")
            .or_else(|| t.strip_prefix("pub use "))
        else {
            continue;
        };
        let first = rest.split("::").next().unwrap_or("");
        if children.contains(first) {
            out.push(join(module, &path_at(rest)));
        }
    }
    out
}

fn join(base: &str, rest: &str) -> String {
    match (base.is_empty(), rest.is_empty()) {
        (true, _) => rest.to_string(),
        (_, true) => base.to_string(),
        _ => format!("{base}::{rest}"),
    }
}

/// The `a::b::c` path at the start of `s` (identifiers joined by `::`).
fn path_at(s: &str) -> String {
    let mut parts = Vec::new();
    let mut rest = s;
    loop {
        let len = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        if len == 0 {
            break;
        }
        parts.push(&rest[..len]);
        match rest[len..].strip_prefix("::") {
            Some(r) => rest = r,
            None => break,
        }
    }
    parts.join("::")
}

/// The longest module of `modules` that is `path` or a prefix of it.
fn longest_module(modules: &BTreeSet<String>, path: &str) -> Option<String> {
    let mut p = path.to_string();
    loop {
        if modules.contains(&p) {
            return Some(p);
        }
        match p.rsplit_once("::") {
            Some((head, _)) => p = head.to_string(),
            None => return modules.contains("").then(String::new),
        }
    }
}

fn assert_none(what: &str, bad: Vec<String>) {
    assert!(bad.is_empty(), "{what}:\n  {}", bad.join("\n  "));
}

#[test]
fn no_import_circles() {
    for c in [
        Crate::read("sdhost", "host/src"),
        Crate::read("sdhost-models", "models/src"),
        Crate::read("ggml", "ggml/src"),
    ] {
        let circles = c.circles();
        assert!(
            circles.is_empty(),
            "{}: import circles (docs/ARCHITECTURE.md, \"No import circles\"):\n  {}",
            c.name,
            circles
                .iter()
                .map(|s| s.join(" <-> "))
                .collect::<Vec<_>>()
                .join("\n  ")
        );
    }
}

#[test]
fn host_layers() {
    let host = Crate::read("sdhost", "host/src");
    // The command line is read at the top: below `commands`, modules take
    // resolved settings, never clap types.
    let below_commands: Vec<&str> = host
        .files
        .keys()
        .filter(|m| {
            !m.is_empty()
                && !["app", "cli", "commands"]
                    .iter()
                    .any(|t| m == t || m.starts_with(&format!("{t}::")))
        })
        .map(String::as_str)
        .collect();
    assert_none(
        "modules below commands/ import the command line (cli)",
        host.imports(&below_commands, &["cli"]),
    );
    assert_none(
        "modules below commands/ import a command",
        host.imports(&below_commands, &["commands", "app"]),
    );
    // Every subcommand lives under commands/.
    let cli = std::fs::read_to_string(root().join("host/src/app.rs")).expect("app.rs");
    for line in cli
        .lines()
        .filter(|l| l.contains("Command::") && l.contains("=>"))
    {
        assert!(
            line.contains("commands::"),
            "host/src/app.rs: a subcommand not run from commands/: {}",
            line.trim()
        );
    }
    assert!(host.under("commands").count() > 5);
}

#[test]
fn models_layers() {
    let models = Crate::read("sdhost-models", "models/src");
    let networks = [
        "nn",
        "encoders",
        "denoisers",
        "autoencoders",
        "tokenizers",
        "upscale",
    ];
    // A network knows its config, a family knows its networks, and the
    // sampling knows neither.
    assert_none(
        "networks import a family, the pipeline, LoRA matching or sampling",
        models.imports(&networks, &["family", "pipeline", "lora", "sampling"]),
    );
    assert_none(
        "sampling imports something outside sampling/",
        models.imports(
            &["sampling"],
            &[
                "nn",
                "encoders",
                "denoisers",
                "autoencoders",
                "tokenizers",
                "upscale",
                "family",
                "pipeline",
                "lora",
                "runtime",
                "checkpoint",
            ],
        ),
    );
    assert_none(
        "the runtime imports a network, a family, sampling or the pipeline",
        models.imports(
            &["runtime"],
            &[
                "nn",
                "encoders",
                "denoisers",
                "autoencoders",
                "tokenizers",
                "upscale",
                "family",
                "pipeline",
                "sampling",
            ],
        ),
    );
    assert_none(
        "checkpoint formats import a network, a family or the pipeline",
        models.imports(
            &[
                "checkpoint::gguf",
                "checkpoint::safetensors",
                "checkpoint::pth",
                "checkpoint::dtype",
            ],
            &[
                "nn",
                "encoders",
                "denoisers",
                "autoencoders",
                "family",
                "pipeline",
                "sampling",
            ],
        ),
    );
}

/// No `Family::Variant` outside `models/src/family/`: which family a file
/// is decides things only there.
#[test]
fn families_are_named_only_in_family() {
    let mut bad = Vec::new();
    for (dir, skip) in [
        ("models/src", Some("models/src/family")),
        ("host/src", None),
    ] {
        let mut files = BTreeMap::new();
        collect(&root().join(dir), &root().join(dir), &mut files);
        for path in files.values() {
            let rel = path.strip_prefix(root()).expect("in the workspace");
            if skip.is_some_and(|s| rel.starts_with(s)) {
                continue;
            }
            let code = code_of(&std::fs::read_to_string(path).expect("readable"));
            for v in ["Family::Sd1", "Family::Sd2", "Family::Sdxl"] {
                if code.contains(v) {
                    bad.push(format!("{}: {v}", rel.display()));
                }
            }
        }
    }
    assert_none("a family named outside models/src/family", bad);
}

/// Crate dependencies point one way: plugins → plugin-api → ggml;
/// host → plugin-api, models, ggml; models → ggml; the test support
/// (plugin-api, models, ggml) is a dev-dependency of the host and the
/// models only.
#[test]
fn crate_dependencies_point_one_way() {
    let deps = |manifest: &str| -> BTreeSet<String> {
        let text = std::fs::read_to_string(root().join(manifest)).expect("manifest");
        let doc: toml::Table = text.parse().expect("valid toml");
        ["dependencies", "build-dependencies"]
            .iter()
            .filter_map(|k| doc.get(*k).and_then(|d| d.as_table()))
            .flat_map(|t| t.keys().cloned())
            .collect()
    };
    let models = deps("models/Cargo.toml");
    for forbidden in ["sdhost", "sdhost-plugin-api", "libloading", "abi_stable"] {
        assert!(
            !models.contains(forbidden),
            "models/Cargo.toml depends on {forbidden}: models never loads a plugin"
        );
    }
    let host = deps("host/Cargo.toml");
    assert!(
        !host
            .iter()
            .any(|d| d.starts_with("sdhost-plugin-") && d != "sdhost-plugin-api"),
        "host/Cargo.toml depends on a plugin crate: {host:?}"
    );
    let api = deps("plugin-api/Cargo.toml");
    assert!(
        !api.contains("sdhost") && !api.contains("sdhost-models"),
        "plugin-api depends on the host or the models"
    );
    // The test support opens plugins for the models' own tests: a
    // dev-dependency only, and those tests never need the host.
    let dev = |manifest: &str| -> BTreeSet<String> {
        let text = std::fs::read_to_string(root().join(manifest)).expect("manifest");
        let doc: toml::Table = text.parse().expect("valid toml");
        doc.get("dev-dependencies")
            .and_then(|d| d.as_table())
            .map(|t| t.keys().cloned().collect())
            .unwrap_or_default()
    };
    assert!(
        !dev("models/Cargo.toml").contains("sdhost"),
        "models' tests depend on the host"
    );
    let support = deps("tests/support/Cargo.toml");
    assert!(
        !support.contains("sdhost"),
        "the test support depends on the host: {support:?}"
    );
    for manifest in [
        "ggml/Cargo.toml",
        "plugin-api/Cargo.toml",
        "models/Cargo.toml",
        "host/Cargo.toml",
    ] {
        assert!(
            !deps(manifest).contains("sdhost-test-support"),
            "{manifest}: the test support is a dev-dependency only"
        );
    }
    for lib in [
        "host/src/lib.rs",
        "models/src/lib.rs",
        "tests/support/src/lib.rs",
    ] {
        let text = std::fs::read_to_string(root().join(lib)).expect("lib.rs");
        assert!(
            text.contains("#![forbid(unsafe_code)]"),
            "{lib}: unsafe code lives in ggml/ and at the plugin boundary only"
        );
    }
}

/// The environment is read in the host only: ggml and the models take
/// what the host passes down (`ggml::Knobs`), so a variable means the same
/// in every command and test.
#[test]
fn no_environment_below_the_host() {
    let mut bad = Vec::new();
    for dir in ["ggml/src", "models/src"] {
        let mut files = BTreeMap::new();
        collect(&root().join(dir), &root().join(dir), &mut files);
        for path in files.values() {
            let code = code_of(&std::fs::read_to_string(path).expect("readable"));
            if code.contains("env::var") {
                let rel = path.strip_prefix(root()).expect("in the workspace");
                bad.push(rel.display().to_string());
            }
        }
    }
    assert_none("environment read below the host", bad);
}

/// The tidy reader itself: it finds the edges and circles it should.
#[test]
fn reader_sees_imports() {
    let kids = BTreeSet::from(["queue"]);
    let code = code_of(
        "use crate::a::b::{C, D};\nuse super::x::Y; // crate::z\n#[cfg(test)]\nmod t;\nuse queue::Q;\nlet s = \"crate::q\";\n#[cfg(test)]\nmod tests {\nuse crate::t;\n}",
    );
    let paths = imported_paths(&code, "m::n", &kids);
    assert_eq!(paths, ["a::b", "m::x::Y", "m::n::queue::Q"]);
    let modules = BTreeSet::from(["a".to_string(), "m::x".to_string(), String::new()]);
    assert_eq!(longest_module(&modules, "a::b"), Some("a".into()));
    assert_eq!(longest_module(&modules, "m::x::Y"), Some("m::x".into()));
}
