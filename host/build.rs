//! RPATH for the host binary and its test executables: `libggml-base` is found
//! beside the executable (cargo's target dir), one folder up (test binaries in
//! `deps/`), or in `../lib/sdhost` (the installed layout, `PREFIX/bin/sdhost`).
fn main() {
    println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN:$ORIGIN/..:$ORIGIN/../lib/sdhost");
    println!("cargo:rerun-if-changed=build.rs");
}
