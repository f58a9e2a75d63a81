//! Test-only plugin whose manifest carries a build identity other than the
//! host's: the host must reject it without calling `init`.

fn init() -> Result<*mut std::ffi::c_void, String> {
    // Reaching this would be a host bug; return a distinctive error.
    Err("bad-identity test plugin: init must never be called".into())
}

sdhost_plugin_api::export_plugin! {
    name: "badid",
    family: "badid",
    score: 0,
    indexed_devices: true,
    features: [],
    init: init,
    identity: "ggml-0.0.0+h0000000000000000+api0+l0.0.0.0.0.0",
}
