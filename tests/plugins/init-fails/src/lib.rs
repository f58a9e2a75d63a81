//! Test-only plugin whose identity matches but whose `init` fails, the way a
//! GPU backend fails on a machine without the driver.

fn init() -> Result<*mut std::ffi::c_void, String> {
    Err("no device driver present (test plugin)".into())
}

sdhost_plugin_api::export_plugin! {
    name: "initfails",
    family: "initfails",
    score: 0,
    indexed_devices: true,
    features: [],
    init: init,
}
