//! Test-only plugin whose `init` crashes the process with a segmentation
//! fault, the way a broken driver can: the host must survive it through its
//! isolated probe. `SDHOST_TESTPLUGIN_SCORE` sets its manifest score (a
//! negative one says "cannot run on this machine": init must then never be
//! called).

fn init() -> Result<*mut std::ffi::c_void, String> {
    // SAFETY: deliberately unsound: writing through a null pointer raises
    // SIGSEGV, which is what this plugin exists to do.
    unsafe { std::ptr::null_mut::<u32>().write_volatile(1) };
    Err("unreachable".into())
}

sdhost_plugin_api::export_plugin! {
    name: "initcrashes",
    family: "initcrashes",
    score: std::env::var("SDHOST_TESTPLUGIN_SCORE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0),
    indexed_devices: true,
    features: ["crash-test"],
    init: init,
}
