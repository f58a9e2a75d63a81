//! Test-only plugin whose `init` crashes the process with a segmentation
//! fault, the way a broken driver can: the host must survive it through its
//! isolated probe.

fn init() -> Result<*mut std::ffi::c_void, String> {
    // SAFETY: deliberately unsound: writing through a null pointer raises
    // SIGSEGV, which is what this plugin exists to do.
    unsafe { std::ptr::null_mut::<u32>().write_volatile(1) };
    Err("unreachable".into())
}

sdhost_plugin_api::export_plugin! {
    name: "initcrashes",
    family: "initcrashes",
    score: 0,
    indexed_devices: true,
    features: [],
    init: init,
}
