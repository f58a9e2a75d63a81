//! Test-only plugin whose `init` never returns, the way a driver can hang
//! waiting for a device: the host must give up on it after its probe
//! timeout, and its isolated probe must not outlive the host.

fn init() -> Result<*mut std::ffi::c_void, String> {
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}

sdhost_plugin_api::export_plugin! {
    name: "inithangs",
    family: "inithangs",
    score: 0,
    indexed_devices: true,
    features: [],
    init: init,
}
