//! The HTTP side of `serve` (axum on a tokio runtime of its own thread):
//! routes, request parsing and validation, responses, authentication and
//! graceful shutdown.
//!
//! Request bodies are parsed by hand from JSON values rather than derived,
//! so every rejection names its field: malformed JSON is 400, a field of the
//! wrong type or out of range, a missing prompt, an unknown sampler or model
//! or an image that does not decode is 422, always with a JSON body
//! `{"error": …, "field": …, "detail": …}`. Unknown fields are ignored, as
//! A1111 clients send many this server has no use for.

use super::queue::{Full, JobError, Running};
use super::worker::{
    GenOutput, GenWork, InitWork, JobQueue, ModelEntry, ModelInfo, Output, ReplicaFit, Work,
};
use crate::image_io::Mask;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use sdhost_models::request::Image;
use sdhost_models::sampling::Scheduler;
use sdhost_models::sampling::{Sampler, SamplerChoice};
use serde_json::{json, Map, Value};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The web page (`/`).
const PAGE: &str = include_str!("page.html");
/// The OpenAPI description (`/openapi.json`).
const OPENAPI: &str = include_str!("openapi.json");

/// Largest image side a request may ask for.
pub const MAX_SIDE: i64 = 2048;
/// Most images one request may ask for.
pub const MAX_IMAGES: i64 = 16;

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    /// The job queue.
    pub queue: Arc<JobQueue>,
    /// The checkpoints that can be loaded.
    pub models: Arc<std::sync::RwLock<Arc<Vec<ModelEntry>>>>,
    /// Where the checkpoints come from (`refresh-checkpoints` scans again).
    pub catalogue: Arc<super::Catalogue>,
    /// The loaded model.
    pub current: Arc<Mutex<Option<ModelInfo>>>,
    /// `--api-key` (trimmed).
    pub api_key: Option<Arc<str>>,
    /// `--api-auth`'s user and password pairs (HTTP Basic).
    pub api_auth: Arc<Vec<(String, String)>>,
    /// The names a request's `Host` (and a state-changing request's
    /// `Origin`) may carry, lowercase, without port: the loopback names,
    /// the bound address and `--allowed-host`; `None` when the server
    /// listens on every address (behind `--api-key`).
    pub allowed_hosts: Option<Arc<Vec<String>>>,
    /// The origins of `--cors-allow-origin` (lowercase, no trailing `/`):
    /// their pages may call the API from a browser.
    pub cors_origins: Arc<Vec<String>>,
    /// Where each replica's modules run, as its last load fitted them.
    pub fits: Arc<Mutex<Vec<ReplicaFit>>>,
    /// Each replica's device (`--replicas`), by replica index.
    pub replicas: Arc<Vec<String>>,
    /// `--lora-dir` and `--follow-symlinks`, for `/sdapi/v1/loras` (read
    /// at each call: a new file is listed without a refresh).
    pub lora_dir: Option<(Arc<std::path::PathBuf>, bool)>,
    /// `--vae-dir` and `--follow-symlinks`, for `/sdapi/v1/sd-vae` and
    /// `sd_vae` (read at each call).
    pub vae_dir: Option<(Arc<std::path::PathBuf>, bool)>,
    /// `--controlnet-dir` and `--follow-symlinks`, for
    /// `/controlnet/model_list` and `alwayson_scripts.controlnet` (read at
    /// each call).
    pub controlnet_dir: Option<(Arc<std::path::PathBuf>, bool)>,
    /// `--upscaler-dir` and `--follow-symlinks`, for `/sdapi/v1/upscalers`
    /// and `hr_upscaler` (read at each call).
    pub upscaler_dir: Option<(Arc<std::path::PathBuf>, bool)>,
    /// The server's `sd_vae` (`POST /sdapi/v1/options`), which the workers
    /// read at each job.
    pub vae_choice: Arc<Mutex<String>>,
    /// Every device's memory, as the workers last sampled it.
    pub device_memory: Arc<Mutex<Vec<super::worker::DeviceMemory>>>,
    /// The command line as `/sdapi/v1/cmd-flags` shows it (secrets hidden).
    pub cmd_flags: Arc<Value>,
    /// What `POST /sdapi/v1/options` set that requests use.
    pub options: Arc<Mutex<ServerOptions>>,
    /// The images OpenAI clients fetch by URL (`response_format: "url"`).
    pub images: Arc<super::store::ImageStore>,
    /// The address the server listens on (for URLs where a request names
    /// no `Host`).
    pub local_addr: std::net::SocketAddr,
}

/// The A1111 options a server keeps (`POST /sdapi/v1/options`): those it
/// honours, and the others as given (echoed by `GET`, listed as ignored).
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// `CLIP_stop_at_last_layers`: a request's CLIP skip unless it gives one.
    pub clip_skip: usize,
    /// `live_previews_enable`.
    pub previews: bool,
    /// `show_progress_every_n_steps` (`--preview-every` at start; 0: none).
    pub preview_every: usize,
    /// Options stored without effect on the images, as given.
    pub ignored: Map<String, Value>,
}

impl ServerOptions {
    /// The options at start: previews every `preview_every` steps.
    pub fn new(preview_every: usize) -> Self {
        ServerOptions {
            clip_skip: 1,
            previews: preview_every > 0,
            preview_every,
            ignored: Map::new(),
        }
    }

    /// Live previews every this many steps (0: none).
    fn previews_every(&self) -> usize {
        if self.previews {
            self.preview_every
        } else {
            0
        }
    }
}

/// A1111 options that change the images and that sdhost cannot honour,
/// with the value it does run with: another value is a 422 naming the
/// option (never a silent `true`).
const FIXED_OPTIONS: &[(&str, &str)] = &[
    ("eta_noise_seed_delta", "0"),
    ("randn_source", "\"GPU\""),
    ("img2img_fix_steps", "false"),
    ("samples_format", "\"png\""),
    ("live_previews_image_format", "\"png\""),
    ("eta_ancestral", "1"),
    ("eta_ddim", "0"),
    ("s_noise", "1"),
    ("s_churn", "0"),
    ("use_old_emphasis_implementation", "false"),
    ("use_old_karras_scheduler_sigmas", "false"),
];

/// A 422 for the first of [`FIXED_OPTIONS`] that `f` sets to another value
/// than sdhost runs with (the field named with `prefix`, e.g.
/// `override_settings.`).
fn fixed_options(f: &Fields<'_>, prefix: &str) -> ApiResult<()> {
    for (key, runs) in FIXED_OPTIONS {
        let Some(v) = f.get(key) else { continue };
        let runs: Value = serde_json::from_str(runs).expect("a JSON literal");
        let same = match (v, &runs) {
            (Value::Number(a), Value::Number(b)) => a.as_f64() == b.as_f64(),
            (a, b) => a == b,
        };
        if !same {
            return Err(ApiError::field(
                &format!("{prefix}{key}"),
                format!("sdhost runs with {runs} only; another value would change the images"),
            ));
        }
    }
    Ok(())
}

/// A request's fields that would change the image and that sdhost cannot
/// honour, each a 422 naming it (A1111 clients send most of them with
/// their defaults, which pass): face restoration, scripts, prompt styles,
/// the SDXL refiner, `s_noise` other than 1, `s_churn` other than 0
/// (`s_tmin`/`s_tmax` act only with it), and [`FIXED_OPTIONS`] in
/// `override_settings`. (`eta` is honoured: the sampler's η.)
fn refuse_unhonoured(f: &Fields<'_>, overrides: &Map<String, Value>) -> ApiResult<()> {
    let named = |k: &str| -> ApiResult<Option<String>> {
        Ok(f.string(k)?
            .filter(|s| !s.trim().is_empty() && !s.trim().eq_ignore_ascii_case("none")))
    };
    if f.boolean("restore_faces")? == Some(true) {
        return Err(ApiError::field(
            "restore_faces",
            "face restoration (GFPGAN, CodeFormer) is not available in sdhost",
        ));
    }
    if let Some(s) = named("script_name")? {
        return Err(ApiError::field(
            "script_name",
            format!(
                "{:?}: scripts are not available in sdhost (GET /sdapi/v1/scripts lists none)",
                crate::term::clean(&s)
            ),
        ));
    }
    match f.get("styles") {
        None => {}
        Some(Value::Array(a)) if a.iter().all(|v| v.as_str().is_some_and(|s| s.trim().is_empty())) => {}
        Some(Value::Array(_)) => {
            return Err(ApiError::field(
                "styles",
                "sdhost keeps no prompt styles (GET /sdapi/v1/prompt-styles lists none): put the style's text in the prompt",
            ))
        }
        Some(_) => return Err(ApiError::field("styles", "expected an array of style names")),
    }
    if let Some(r) = named("refiner_checkpoint")? {
        return Err(ApiError::field(
            "refiner_checkpoint",
            format!(
                "{:?}: a refiner (a second checkpoint for the last steps) is not available in sdhost",
                crate::term::clean(&r)
            ),
        ));
    }
    for (k, runs) in [("s_noise", 1.0), ("s_churn", 0.0)] {
        if f.float(k, -1e9, 1e9)?.is_some_and(|v| v != runs) {
            return Err(ApiError::field(
                k,
                format!("sdhost runs with {runs} only; another value would change the images"),
            ));
        }
    }
    fixed_options(&Fields(overrides), "override_settings.")
}

impl AppState {
    /// The options requests take their defaults from.
    fn options(&self) -> ServerOptions {
        self.options
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The checkpoints that can be loaded, as last scanned.
    fn models(&self) -> Arc<Vec<ModelEntry>> {
        self.models
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn current(&self) -> Option<ModelInfo> {
        self.current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn fits(&self) -> Vec<ReplicaFit> {
        self.fits.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Where each replica's modules run (`te=cpu, …`, replicas joined by
    /// `; `).
    fn placement(&self) -> String {
        super::replicas_text(&self.fits())
    }

    /// What fit chose at each replica's last load: its placement, VAE
    /// tiling and one entry per module (as `plan --json`'s `fit`).
    fn fit_json(&self) -> Value {
        self.fits()
            .iter()
            .enumerate()
            .map(|(i, f)| {
                json!({
                    "replica": i,
                    "device": f.device,
                    "placement": f.placement,
                    "vae_tiling": f.tiling.map(|t| json!({"tile": t.tile, "overlap": t.overlap})),
                    "modules": f.choices,
                    "loaded": f.loaded,
                })
            })
            .collect()
    }
}

/// An error answer: status, machine-readable kind, the field at fault.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    error: &'static str,
    field: Option<String>,
    detail: String,
    retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, error: &'static str, detail: impl Into<String>) -> ApiError {
        ApiError {
            status,
            error,
            field: None,
            detail: detail.into(),
            retry_after: None,
        }
    }

    /// 422 naming `field`.
    fn field(field: &str, detail: impl std::fmt::Display) -> ApiError {
        ApiError {
            field: Some(field.to_string()),
            ..ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_field",
                format!("{field}: {detail}"),
            )
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": self.error, "field": self.field, "detail": self.detail});
        let mut r = (self.status, Json(body)).into_response();
        if let Some(s) = self.retry_after {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        r
    }
}

type ApiResult<T> = Result<T, ApiError>;

/// The routes, with authentication and the body limit.
pub fn router(state: AppState, max_body: usize) -> Router {
    let api = Router::new()
        .route("/sdapi/v1/txt2img", post(txt2img))
        .route("/sdapi/v1/img2img", post(img2img))
        .route("/sdapi/v1/sd-models", get(sd_models))
        .route("/sdapi/v1/samplers", get(samplers))
        .route("/sdapi/v1/schedulers", get(schedulers))
        .route("/sdapi/v1/options", get(get_options).post(set_options))
        .route("/sdapi/v1/progress", get(progress))
        .route("/sdapi/v1/interrupt", post(interrupt))
        .route("/sdapi/v1/skip", post(skip))
        .route("/v1/images/generations", post(openai_generations))
        .route("/v1/images/edits", post(openai_edits))
        .route("/v1/models", get(openai_models))
        .route("/v1/models/{id}", get(openai_model))
        .route("/sdapi/v1/loras", get(loras))
        .route("/sdapi/v1/png-info", post(png_info))
        .route("/sdapi/v1/refresh-checkpoints", post(refresh_checkpoints))
        .route(
            "/sdapi/v1/refresh-loras",
            post(|| async { Json(Value::Null) }),
        )
        .route("/sdapi/v1/upscalers", get(upscalers))
        .route("/sdapi/v1/extra-single-image", post(extra_single_image))
        .route("/sdapi/v1/extra-batch-images", post(extra_batch_images))
        .route(
            "/sdapi/v1/latent-upscale-modes",
            get(|| async {
                Json(json!([{"name": "Latent"}, {"name": "Latent (nearest)"}, {"name": "Latent (nearest-exact)"}]))
            }),
        )
        .route("/sdapi/v1/sd-vae", get(sd_vae))
        .route("/controlnet/model_list", get(controlnet_models))
        .route(
            "/controlnet/module_list",
            get(|| async {
                let mut names: Vec<&str> = crate::control::Preprocess::NAMES.to_vec();
                names.extend(IP_MODULES);
                Json(json!({ "module_list": names }))
            }),
        )
        .route(
            "/controlnet/version",
            get(|| async { Json(json!({"version": 2})) }),
        )
        .route("/sdapi/v1/memory", get(memory))
        .route(
            "/sdapi/v1/cmd-flags",
            get(|State(st): State<AppState>| async move { Json((*st.cmd_flags).clone()) }),
        )
        .route("/sdapi/v1/sd-modules", get(|| async { Json(json!([])) }))
        .route(
            "/sdapi/v1/embeddings",
            get(|| async { Json(json!({"loaded": {}, "skipped": {}})) }),
        )
        .route(
            "/sdapi/v1/scripts",
            get(|| async { Json(json!({"txt2img": [], "img2img": []})) }),
        )
        // What sdhost has none of, as A1111 lists them, so clients that
        // fill menus from them at start-up (webuiapi's helpers, painting
        // plug-ins) start.
        .route("/sdapi/v1/face-restorers", get(|| async { Json(json!([])) }))
        .route("/sdapi/v1/hypernetworks", get(|| async { Json(json!([])) }))
        .route("/sdapi/v1/prompt-styles", get(|| async { Json(json!([])) }))
        .route("/sdapi/v1/realesrgan-models", get(realesrgan_models))
        .route("/sdapi/v1/interrogate", post(interrogate))
        .route("/sdapi/v1/unload-checkpoint", post(unload_checkpoint))
        .route("/sdapi/v1/reload-checkpoint", post(reload_checkpoint))
        .route("/openapi.json", get(openapi))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .route("/", get(|| async { Html(PAGE) }))
        .route("/health", get(health))
        .route("/internal/ping", get(|| async { Json(json!({})) }))
        // Its unguessable name is the key, as OpenAI's image URLs are.
        .route("/v1/images/files/{name}", get(image_file))
        .merge(api)
        .fallback(|| async {
            ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint")
        })
        // CORS inside the Host check: a preflight from a listed origin is
        // answered before authentication (browsers send no key with it),
        // and every answer to that origin carries its CORS headers.
        .layer(cors(&state.cors_origins))
        .layer(axum::middleware::from_fn_with_state(state.clone(), guard))
        .layer(axum::middleware::from_fn(openai_errors))
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(state)
}

/// CORS for the `--cors-allow-origin` origins (none by default: a
/// preflight from any other origin is answered without permission, and the
/// browser stops there): GET and POST with `Content-Type` and
/// `Authorization`, preflights cached 10 minutes.
fn cors(origins: &[String]) -> tower_http::cors::CorsLayer {
    use tower_http::cors::{AllowOrigin, CorsLayer};
    let list: Vec<header::HeaderValue> = origins
        .iter()
        .filter_map(|o| header::HeaderValue::from_str(o).ok())
        .collect();
    CorsLayer::new()
        .allow_origin(AllowOrigin::list(list))
        .allow_methods([Method::GET, Method::POST])
        .allow_headers([header::CONTENT_TYPE, header::AUTHORIZATION])
        .max_age(Duration::from_secs(600))
}

/// Image decodings at once (each may hold up to the decoder's memory
/// limit); more wait without holding an async worker.
static DECODES: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);

/// Runs `f` on a blocking thread (file reads, image and text decoding),
/// never on the async workers that answer /health, /progress and
/// interrupt; a panic in it is a 500 of kind `kind` saying `what` failed.
async fn blocking<T: Send + 'static>(
    kind: &'static str,
    what: &'static str,
    f: impl FnOnce() -> T + Send + 'static,
) -> ApiResult<T> {
    tokio::task::spawn_blocking(f).await.map_err(|_| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            kind,
            format!("{what} failed"),
        )
    })
}

/// Most connections served at once: well under the common 1,024 open-file
/// limit, so that half-open connections cannot take the server offline
/// (one past it is closed at once).
pub const MAX_CONNECTIONS: usize = 512;

/// How long a client may take to send a request's headers (slowloris):
/// the connection is closed after it.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves on `listener` until SIGINT or SIGTERM, then stops accepting,
/// closes the queue and cancels the running job after `grace`.
///
/// The accept loop is sdhost's (hyper's HTTP/1 connection over the axum
/// router, as `axum::serve` does) so that it can bound what one client
/// holds: at most [`MAX_CONNECTIONS`] at once, and [`HEADER_TIMEOUT`] to
/// send a request's headers.
pub fn serve(
    listener: std::net::TcpListener,
    local: std::net::SocketAddr,
    state: AppState,
    max_body: usize,
    grace: Duration,
) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("http-worker")
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let queue = state.queue.clone();
        let app = router(state, max_body);
        let shutdown = async move {
            signal().await;
            crate::term::eprint_line("stopping: no new requests; waiting jobs cancelled");
            queue.close();
            tokio::spawn(async move {
                tokio::time::sleep(grace).await;
                for id in queue.cancel_running() {
                    crate::term::eprint_line(&format!(
                        "job {id}: still running after the grace period; cancelled"
                    ));
                }
            });
        };
        crate::term::eprint_line(&format!("listening on http://{local}"));
        accept_loop(listener, app, shutdown).await;
        anyhow::Ok(())
    })
}

/// Accepts connections until `shutdown`, each served by hyper's HTTP/1
/// with the header-read timeout, at most [`MAX_CONNECTIONS`] at once; then
/// asks every connection to finish its request and waits for them.
async fn accept_loop(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: impl std::future::Future<Output = ()>,
) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut conns = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // Out of file descriptors and the like: wait a moment.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // Reap finished connections as new ones come.
        while conns.try_join_next().is_some() {}
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            drop(stream);
            continue;
        };
        let app = app.clone();
        let mut stop = stop_rx.clone();
        conns.spawn(async move {
            let _slot = slot;
            let service =
                hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let app = app.clone();
                    async move {
                        use tower::ServiceExt as _;
                        app.oneshot(req.map(axum::body::Body::new)).await
                    }
                });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = stop.changed() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
        });
    }
    let _ = stop_tx.send(true);
    while conns.join_next().await.is_some() {}
}

async fn signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).ok();
    let mut int = signal(SignalKind::interrupt()).ok();
    let recv = |s: &mut Option<tokio::signal::unix::Signal>| {
        let s = s.take();
        async move {
            match s {
                Some(mut s) => {
                    s.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        }
    };
    tokio::select! {
        _ = recv(&mut term) => {},
        _ = recv(&mut int) => {},
    }
}

/// What no web page may do (DNS rebinding, cross-site requests), on every
/// route: a `Host` that is not one of the server's names is refused (403),
/// as is a state-changing request whose `Origin` is another site's (403)
/// or whose body is not declared JSON (415: forms and `text/plain`, which
/// a page may send anywhere without asking, never reach a handler).
async fn guard(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let headers = req.headers();
    if let Some(allowed) = &st.allowed_hosts {
        let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
        if let Some(h) = host {
            if !allowed.iter().any(|a| *a == host_name(h)) {
                return ApiError::new(
                    StatusCode::FORBIDDEN,
                    "host_not_allowed",
                    "this server answers only to its own names (loopback, its address, --allowed-host)",
                )
                .into_response();
            }
        }
        let changes = !matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS);
        let origin = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok());
        if let (true, Some(o)) = (changes, origin) {
            let name = o
                .split_once("://")
                .map(|(_, rest)| host_name(rest.split('/').next().unwrap_or("")));
            let listed = st
                .cors_origins
                .iter()
                .any(|c| c.eq_ignore_ascii_case(o.trim_end_matches('/')));
            if !listed && !name.is_some_and(|n| allowed.contains(&n)) {
                return ApiError::new(
                    StatusCode::FORBIDDEN,
                    "origin_not_allowed",
                    "a request from another site's page is refused",
                )
                .into_response();
            }
        }
    }
    if *req.method() == Method::POST {
        let json = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(|v| {
                v.split(';')
                    .next()
                    .unwrap_or("")
                    .trim()
                    .to_ascii_lowercase()
            });
        // Without a length or a transfer coding a request has no body
        // (RFC 9112, 6.3): `curl -X POST …/interrupt` sends neither.
        let has_body = headers.contains_key(header::TRANSFER_ENCODING)
            || headers
                .get(header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|n| n.trim() != "0");
        // OpenAI's edits take a form upload; a page of another site that
        // sends one is stopped by the Origin check above.
        let form = req.uri().path() == "/v1/images/edits";
        match json.as_deref() {
            Some("application/json") => {}
            Some("multipart/form-data") if form => {}
            None if !has_body => {}
            _ => {
                return ApiError::new(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "unsupported_media_type",
                    "send the body as JSON, with `Content-Type: application/json`",
                )
                .into_response()
            }
        }
    }
    next.run(req).await
}

/// A `Host` (or an origin's authority) without its port, lowercase:
/// `localhost`, `127.0.0.1`, `::1` (from `[::1]:7860`).
fn host_name(h: &str) -> String {
    let h = h.trim();
    let name = match h.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => match h.rsplit_once(':') {
            Some((name, port)) if port.chars().all(|c| c.is_ascii_digit()) => name,
            _ => h,
        },
    };
    name.to_ascii_lowercase()
}

/// The key on every API route when `--api-key` is set: `Authorization:
/// Bearer KEY` (OpenAI clients), or HTTP Basic with the key as the password
/// and any user name (what A1111's `--api-auth` clients send: webuiapi, Open
/// WebUI, SillyTavern); the scheme in any case, the key without surrounding
/// blanks.
async fn auth(State(st): State<AppState>, req: Request, next: Next) -> Response {
    if st.api_key.is_some() || !st.api_auth.is_empty() {
        // (user, secret): Bearer has no user.
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .and_then(|v| v.split_once(' '))
            .and_then(|(scheme, cred)| {
                if scheme.eq_ignore_ascii_case("bearer") {
                    Some((None, cred.trim().to_string()))
                } else if scheme.eq_ignore_ascii_case("basic") {
                    let raw = base64::engine::general_purpose::STANDARD
                        .decode(cred.trim())
                        .ok()?;
                    let text = String::from_utf8(raw).ok()?;
                    let (user, pass) = text.split_once(':')?;
                    Some((Some(user.trim().to_string()), pass.trim().to_string()))
                } else {
                    None
                }
            });
        let ok = given.is_some_and(|(user, secret)| {
            let by_key = st
                .api_key
                .as_ref()
                .is_some_and(|k| constant_time_eq(secret.as_bytes(), k.as_bytes()));
            // Every pair compared, so the time says nothing of which matched.
            let by_pair = user.is_some_and(|u| {
                st.api_auth.iter().fold(false, |hit, (au, ap)| {
                    let m = constant_time_eq(u.as_bytes(), au.as_bytes())
                        & constant_time_eq(secret.as_bytes(), ap.as_bytes());
                    hit | m
                })
            });
            by_key | by_pair
        });
        if !ok {
            let mut r = ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "this server needs its key (`Authorization: Bearer KEY`, or HTTP Basic with the key as the password) or a --api-auth user and password (HTTP Basic)",
            )
            .into_response();
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer, Basic realm=\"sdhost\""),
            );
            return r;
        }
    }
    next.run(req).await
}

/// Errors of the OpenAI routes (`/v1/…`) in OpenAI's shape, `{"error":
/// {"message", "type", "param", "code"}}`, so that its SDKs show the
/// message instead of a bare status.
async fn openai_errors(req: Request, next: Next) -> Response {
    let openai = req.uri().path().starts_with("/v1/");
    let resp = next.run(req).await;
    if !openai || resp.status().is_success() {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    let bytes = axum::body::to_bytes(body, 1 << 20)
        .await
        .unwrap_or_default();
    let ours: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let status = parts.status;
    let kind = if status.is_server_error() {
        "server_error"
    } else {
        "invalid_request_error"
    };
    let code = match (status, &ours["error"]) {
        (StatusCode::UNAUTHORIZED, _) => json!("invalid_api_key"),
        (_, Value::String(e)) => json!(e),
        _ => Value::Null,
    };
    let message = match &ours["detail"] {
        Value::String(d) => d.clone(),
        _ => status.canonical_reason().unwrap_or("error").to_string(),
    };
    // OpenAI clients send one `size`; the checks name its two halves.
    let param = match ours.get("field") {
        Some(Value::String(f)) if f == "width" || f == "height" => json!("size"),
        Some(f) => f.clone(),
        None => Value::Null,
    };
    let body = json!({"error": {
        "message": message,
        "type": kind,
        "param": param,
        "code": code,
    }});
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, axum::body::Body::from(body.to_string()))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The body as a JSON object: 413 beyond the limit, 400 if malformed.
fn json_body(body: Result<Bytes, BytesRejection>) -> ApiResult<Map<String, Value>> {
    let bytes = body.map_err(|e| {
        let status = e.status();
        let kind = if status == StatusCode::PAYLOAD_TOO_LARGE {
            "body_too_large"
        } else {
            "bad_body"
        };
        ApiError::new(status, kind, e.body_text())
    })?;
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| ApiError {
        field: Some("body".into()),
        ..ApiError::new(
            StatusCode::BAD_REQUEST,
            "malformed_json",
            format!("body: not valid JSON: {e}"),
        )
    })?;
    match v {
        Value::Object(m) => Ok(m),
        _ => Err(ApiError {
            field: Some("body".into()),
            ..ApiError::new(
                StatusCode::BAD_REQUEST,
                "malformed_json",
                "body: expected a JSON object",
            )
        }),
    }
}

/// Typed, range-checked access to a request's fields (`null` = absent).
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, k: &str) -> Option<&Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }

    fn string(&self, k: &str) -> ApiResult<Option<String>> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(ApiError::field(k, "expected a string")),
        }
    }

    fn int(&self, k: &str, lo: i64, hi: i64) -> ApiResult<Option<i64>> {
        let Some(v) = self.get(k) else {
            return Ok(None);
        };
        let n = v
            .as_i64()
            .or_else(|| {
                v.as_f64()
                    .filter(|f| f.fract() == 0.0 && f.abs() < 9e15)
                    .map(|f| f as i64)
            })
            .ok_or_else(|| ApiError::field(k, "expected a whole number"))?;
        if n < lo || n > hi {
            return Err(ApiError::field(k, format!("{n} is outside {lo}..={hi}")));
        }
        Ok(Some(n))
    }

    fn float(&self, k: &str, lo: f64, hi: f64) -> ApiResult<Option<f64>> {
        let Some(v) = self.get(k) else {
            return Ok(None);
        };
        let f = v
            .as_f64()
            .ok_or_else(|| ApiError::field(k, "expected a number"))?;
        if !f.is_finite() || f < lo || f > hi {
            return Err(ApiError::field(k, format!("{f} is outside [{lo}, {hi}]")));
        }
        Ok(Some(f))
    }

    fn boolean(&self, k: &str) -> ApiResult<Option<bool>> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(Value::Number(n)) if n.as_i64() == Some(0) => Ok(Some(false)),
            Some(Value::Number(n)) if n.as_i64() == Some(1) => Ok(Some(true)),
            Some(_) => Err(ApiError::field(k, "expected true or false")),
        }
    }

    fn prompt(&self) -> ApiResult<String> {
        self.string("prompt")?
            .ok_or_else(|| ApiError::field("prompt", "required"))
    }
}

/// A random A1111-style seed (0..2³²).
fn random_seed() -> u64 {
    use std::hash::{BuildHasher as _, Hasher as _};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish() & 0xffff_ffff
}

fn seed_of(f: &Fields<'_>) -> ApiResult<u64> {
    seed_field(f, "seed")
}

/// A seed field (`seed`, `subseed`): a whole number ≥ 0, or -1 (or none)
/// for a random one.
fn seed_field(f: &Fields<'_>, field: &str) -> ApiResult<u64> {
    match f.get(field) {
        None => Ok(random_seed()),
        Some(v) => {
            if let Some(u) = v.as_u64() {
                return Ok(u);
            }
            match v
                .as_i64()
                // A float is taken only where it is exact (up to 2^53): a
                // larger one (1e20, 2^64) would silently saturate.
                .or_else(|| {
                    v.as_f64()
                        .filter(|x| x.fract() == 0.0 && x.abs() <= 9_007_199_254_740_992.0)
                        .map(|x| x as i64)
                }) {
                Some(-1) => Ok(random_seed()),
                Some(n) if n >= 0 => Ok(n as u64),
                _ => Err(ApiError::field(
                    field,
                    "expected a whole number ≥ 0, or -1 for a random seed",
                )),
            }
        }
    }
}

fn find_model(st: &AppState, field: &str, name: &str) -> ApiResult<ModelEntry> {
    let models = st.models();
    models
        .iter()
        .find(|m| m.matches(name))
        .cloned()
        .ok_or_else(|| {
            let names: Vec<&str> = models.iter().map(|m| m.title.as_str()).collect();
            ApiError::field(
                field,
                format!("unknown model {name:?} (known: {})", names.join(", ")),
            )
        })
}

/// The generation settings shared by txt2img, img2img and OpenAI's API.
fn gen_work(
    f: &Fields<'_>,
    kind: &'static str,
    default_steps: i64,
    opts: &ServerOptions,
) -> ApiResult<GenWork> {
    let prompt = f.prompt()?;
    let negative = f.string("negative_prompt")?.unwrap_or_default();
    let steps = f.int("steps", 1, 1000)?.unwrap_or(default_steps) as usize;
    let cfg_scale = f.float("cfg_scale", -1000.0, 1000.0)?.map(|v| v as f32);
    // FLUX.1 dev's distilled guidance: Forge's name, then sdhost's.
    let guidance = match f.float("distilled_cfg_scale", 0.0, 100.0)? {
        Some(g) => Some(g),
        None => f.float("guidance", 0.0, 100.0)?,
    }
    .map_or(sdhost_models::family::flux::DEFAULT_GUIDANCE, |g| g as f32);
    let width = f.int("width", 8, MAX_SIDE)?.map(|v| v as usize);
    let height = f.int("height", 8, MAX_SIDE)?.map(|v| v as usize);
    let seed = seed_of(f)?;
    let name = match f.string("sampler_name")? {
        Some(s) => Some(("sampler_name", s)),
        None => f.string("sampler_index")?.map(|s| ("sampler_index", s)),
    };
    let choice = match &name {
        Some((field, s)) => SamplerChoice::parse(s).ok_or_else(|| {
            let names: Vec<&str> = Sampler::ALL.iter().map(|s| s.a1111_label()).collect();
            ApiError::field(
                field,
                format!("unknown sampler {s:?} ({})", names.join(", ")),
            )
        })?,
        None => SamplerChoice {
            // The family's own (Euler a for SD, Euler for the flow
            // families), resolved by the worker once the model is known.
            sampler: Sampler::EulerA,
            scheduler: None,
        },
    };
    let sampler = name.as_ref().map(|_| choice.sampler);
    let scheduler = match f.string("scheduler")? {
        None => None,
        Some(s) if s.eq_ignore_ascii_case("automatic") => None,
        Some(s) => Some(Scheduler::parse(&s).ok_or_else(|| {
            let names: Vec<&str> = Scheduler::ALL.iter().map(|s| s.name()).collect();
            ApiError::field(
                "scheduler",
                format!("unknown scheduler {s:?} ({}, automatic)", names.join(", ")),
            )
        })?),
    };
    let scheduler = match (scheduler, choice.scheduler) {
        (Some(a), Some(b)) if a != b => {
            return Err(ApiError::field(
                "scheduler",
                format!("{a} contradicts the sampler name's schedule {b}"),
            ))
        }
        (a, b) => a.or(b),
    };
    let batch = f.int("batch_size", 1, MAX_IMAGES)?.unwrap_or(1);
    let n_iter = f.int("n_iter", 1, MAX_IMAGES)?.unwrap_or(1);
    if batch * n_iter > MAX_IMAGES {
        return Err(ApiError::field(
            "n_iter",
            format!(
                "batch_size × n_iter is {}, more than {MAX_IMAGES}",
                batch * n_iter
            ),
        ));
    }
    let hires = match f.boolean("enable_hr")? {
        Some(true) if kind == "txt2img" => Some(hires_ask(f)?),
        _ => None,
    };
    // Fields that would change the image: honoured, or refused naming them
    // (never a silent 200).
    // A1111's "Resize seed from": both above 0, or neither.
    let seed_resize = match (
        f.int("seed_resize_from_w", -1, MAX_SIDE)?,
        f.int("seed_resize_from_h", -1, MAX_SIDE)?,
    ) {
        (Some(w), Some(h)) if w > 0 && h > 0 => Some((w as usize, h as usize)),
        _ => None,
    };
    let variation = match f.float("subseed_strength", 0.0, 1.0)? {
        Some(s) if s > 0.0 => Some((seed_field(f, "subseed")?, s as f32)),
        _ => None,
    };
    let overrides = match f.get("override_settings") {
        None => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(_) => return Err(ApiError::field("override_settings", "expected an object")),
    };
    refuse_unhonoured(f, &overrides)?;
    let clip_skip = match f.int("clip_skip", 1, 12)? {
        Some(v) => v,
        None => Fields(&overrides)
            .int("CLIP_stop_at_last_layers", 1, 12)
            .map_err(|e| ApiError::field("override_settings.CLIP_stop_at_last_layers", e.detail))?
            .unwrap_or(opts.clip_skip as i64),
    } as usize;
    Ok(GenWork {
        kind,
        prompt,
        negative,
        steps,
        cfg_scale,
        guidance,
        width,
        height,
        seed,
        sampler,
        scheduler,
        clip_skip,
        count: (batch * n_iter) as usize,
        init: None,
        reference: Vec::new(),
        controls: Vec::new(),
        ip: None,
        seed_resize,
        hires,
        edit: false,
        model: None,
        keep_model: false,
        vae: None,
        variation,
        preview_every: Some(opts.previews_every()),
        tiling: f.boolean("tiling")?.unwrap_or(false),
        eta: f.float("eta", 0.0, 1.0)?,
    })
}

/// The autoencoders `sd_vae` may name: `--vae-dir`'s files, by name.
async fn vae_names(st: &AppState) -> ApiResult<Vec<String>> {
    Ok(match &st.vae_dir {
        Some((dir, follow)) => {
            let (dir, follow) = (dir.clone(), *follow);
            blocking("internal", "listing --vae-dir", move || {
                super::folders::vae_files(Some(&dir), follow)
            })
            .await?
            .into_iter()
            .map(|(n, _)| n)
            .collect()
        }
        None => Vec::new(),
    })
}

/// `/sdapi/v1/sd-vae`: the `--vae-dir` autoencoders (names only, no path
/// of the server's disk).
async fn sd_vae(State(st): State<AppState>) -> ApiResult<Json<Value>> {
    let names = vae_names(&st).await?;
    Ok(Json(Value::Array(
        names
            .iter()
            .map(|n| json!({"model_name": n, "filename": n}))
            .collect(),
    )))
}

/// An `sd_vae` value (`field` names where it came from): `Automatic`,
/// `None`, or a `--vae-dir` file name; anything else is a 422 listing them.
async fn vae_choice(st: &AppState, field: &str, v: &Value) -> ApiResult<String> {
    let Value::String(name) = v else {
        return Err(ApiError::field(field, "expected a string"));
    };
    if name == super::worker::VAE_AUTOMATIC || name == super::worker::VAE_NONE {
        return Ok(name.clone());
    }
    let names = vae_names(st).await?;
    if names.iter().any(|n| n == name) {
        return Ok(name.clone());
    }
    let mut known = vec![
        super::worker::VAE_AUTOMATIC.to_string(),
        super::worker::VAE_NONE.to_string(),
    ];
    known.extend(names);
    Err(ApiError::field(
        field,
        format!("unknown VAE {name:?} (known: {})", known.join(", ")),
    ))
}

/// `override_settings.sd_vae`: the autoencoder a request runs with.
async fn vae_override(st: &AppState, f: &Fields<'_>) -> ApiResult<Option<String>> {
    let Some(Value::Object(o)) = f.get("override_settings") else {
        return Ok(None);
    };
    match o.get("sd_vae") {
        None | Some(Value::Null) => Ok(None),
        Some(v) => vae_choice(st, "override_settings.sd_vae", v)
            .await
            .map(Some),
    }
}

/// `override_settings.sd_model_checkpoint`: the model a request runs on.
fn model_override(st: &AppState, f: &Fields<'_>) -> ApiResult<Option<ModelEntry>> {
    let Some(Value::Object(o)) = f.get("override_settings") else {
        return Ok(None);
    };
    match o.get("sd_model_checkpoint") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => {
            find_model(st, "override_settings.sd_model_checkpoint", s).map(Some)
        }
        Some(_) => Err(ApiError::field(
            "override_settings.sd_model_checkpoint",
            "expected a string",
        )),
    }
}

/// Decodes a base64 image (a `data:` URL prefix allowed).
fn decode_b64(field: &str, s: &str) -> ApiResult<Vec<u8>> {
    let s = s.trim();
    let data = match s.strip_prefix("data:") {
        Some(rest) => rest
            .split_once(',')
            .map(|(_, d)| d)
            .ok_or_else(|| ApiError::field(field, "a data URL without a comma"))?,
        None => s,
    };
    let clean: String = data.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    base64::engine::general_purpose::STANDARD
        .decode(clean.trim_end_matches('='))
        .or_else(|_| {
            base64::engine::general_purpose::STANDARD_NO_PAD.decode(clean.trim_end_matches('='))
        })
        .map_err(|e| ApiError::field(field, format!("not base64: {e}")))
}

fn decode_image(field: &str, bytes: &[u8]) -> ApiResult<image::DynamicImage> {
    let mut reader = image::ImageReader::new(std::io::Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| ApiError::field(field, format!("cannot read: {e}")))?;
    if reader.format().is_none() {
        return Err(ApiError::field(field, "not a PNG, JPEG or WebP image"));
    }
    let mut limits = image::Limits::default();
    limits.max_image_width = Some(crate::image_io::MAX_SIDE);
    limits.max_image_height = Some(crate::image_io::MAX_SIDE);
    limits.max_alloc = Some(1 << 30);
    reader.limits(limits);
    let img = reader
        .decode()
        .map_err(|e| ApiError::field(field, format!("not a readable image: {e}")))?;
    if img.width() == 0 || img.height() == 0 {
        return Err(ApiError::field(field, "the image is empty"));
    }
    Ok(img)
}

fn short_hash(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    let d = sha2::Sha256::digest(bytes);
    d.iter().take(6).map(|b| format!("{b:02x}")).collect()
}

/// Decodes a mask as `generate --mask` reads one (white = repaint;
/// transparent = keep); `invert` swaps the two.
fn mask_of(img: image::DynamicImage, invert: bool) -> Mask {
    let has_alpha = img.color().has_alpha();
    let la = img.into_luma_alpha16();
    let values = la
        .pixels()
        .map(|p| {
            let mut v = f32::from(p.0[0]) / 65535.0;
            if has_alpha {
                v *= f32::from(p.0[1]) / 65535.0;
            }
            if invert {
                1.0 - v
            } else {
                v
            }
        })
        .collect();
    Mask {
        width: la.width() as usize,
        height: la.height() as usize,
        values,
    }
}

/// A1111's img2img image fields, with A1111's defaults: `resize_mode` (0),
/// `mask_blur` (4; or `mask_blur_x` and `mask_blur_y`, equal),
/// `inpainting_fill` (0, fill), `inpaint_full_res` (true) and
/// `inpaint_full_res_padding` (0). What sdhost does not offer is a 422
/// naming the field.
fn a1111_inpaint(f: &Fields<'_>) -> ApiResult<crate::inpaint::Options> {
    use crate::inpaint::{Fill, Options, ResizeMode};
    let mode = f.int("resize_mode", 0, 3)?;
    let resize = mode
        .and_then(ResizeMode::from_a1111)
        .unwrap_or(ResizeMode::Stretch);
    let blur = f.float("mask_blur", 0.0, 256.0)?;
    let (bx, by) = (
        f.float("mask_blur_x", 0.0, 256.0)?,
        f.float("mask_blur_y", 0.0, 256.0)?,
    );
    let mask_blur = match (blur, bx, by) {
        (Some(b), _, _) => b,
        (None, Some(x), Some(y)) if x != y => {
            return Err(ApiError::field(
                "mask_blur_y",
                "a vertical blur unlike the horizontal one is not supported by sdhost",
            ))
        }
        (None, x, y) => x.or(y).unwrap_or(4.0),
    };
    // 2 and 3 start the masked area's latent from noise or zeros, from
    // the original image's pixels.
    use sdhost_models::request::LatentFill;
    let (fill, latent) = match f.int("inpainting_fill", 0, 3)? {
        None | Some(0) => (Fill::Surroundings, LatentFill::Image),
        Some(1) => (Fill::Original, LatentFill::Image),
        Some(2) => (Fill::Original, LatentFill::Noise),
        Some(_) => (Fill::Original, LatentFill::Zero),
    };
    Ok(Options {
        resize,
        mask_blur: mask_blur as f32,
        fill,
        full_res: f.boolean("inpaint_full_res")?.unwrap_or(true),
        padding: f.int("inpaint_full_res_padding", 0, MAX_SIDE)?.unwrap_or(0) as usize,
        latent,
        latent_upscale: mode == Some(3),
    })
}

/// A1111's hires fix fields: `hr_scale` (2), or `hr_resize_x` and
/// `hr_resize_y`; `hr_second_pass_steps` (0: the steps);
/// `denoising_strength` (0.7); `hr_upscaler` (`Lanczos`, `None`: the image
/// enlarged; `Latent`, `Latent (nearest)`, `Latent (nearest-exact)`: the
/// latent).
fn hires_ask(f: &Fields<'_>) -> ApiResult<super::worker::HiresAsk> {
    // A name that is no built-in upscaler is an upscaler model's, looked
    // up in --upscaler-dir by the handler.
    let (upscaler, model_name) = match f.string("hr_upscaler")?.as_deref() {
        None => (crate::hires::Upscaler::Lanczos, None),
        Some(name) => match crate::hires::Upscaler::from_a1111(name) {
            Some(u) => (u, None),
            // A1111's other latent upscalers are no model's name.
            None if name.trim().to_ascii_lowercase().starts_with("latent") => {
                return Err(ApiError::field(
                    "hr_upscaler",
                    format!(
                        "{name:?} is not supported; Lanczos, Nearest, None, Latent, Latent (nearest), Latent (nearest-exact) and the models of --upscaler-dir are"
                    ),
                ))
            }
            None => (crate::hires::Upscaler::Model, Some(name.to_string())),
        },
    };
    let scale = f.float("hr_scale", 1.0, 8.0)?.unwrap_or(2.0);
    let x = f.int("hr_resize_x", 0, MAX_SIDE)?.unwrap_or(0) as usize;
    let y = f.int("hr_resize_y", 0, MAX_SIDE)?.unwrap_or(0) as usize;
    let strength = f.float("denoising_strength", 0.0, 1.0)?.unwrap_or(0.7);
    if strength <= 0.0 {
        return Err(ApiError::field("denoising_strength", "must be above 0"));
    }
    // Empty, or A1111's "Use same sampler": the first pass's.
    let sampler = match f.string("hr_sampler_name")? {
        None => None,
        Some(s) if s.trim().is_empty() || s.eq_ignore_ascii_case("use same sampler") => None,
        Some(s) => Some(
            SamplerChoice::parse(&s)
                .ok_or_else(|| {
                    let names: Vec<&str> = Sampler::ALL.iter().map(|s| s.a1111_label()).collect();
                    ApiError::field(
                        "hr_sampler_name",
                        format!("unknown sampler {s:?} ({})", names.join(", ")),
                    )
                })?
                .sampler,
        ),
    };
    let text = |k: &str| -> ApiResult<Option<String>> {
        Ok(f.string(k)?.filter(|t| !t.trim().is_empty()))
    };
    Ok(super::worker::HiresAsk {
        scale,
        resize: (x > 0 && y > 0).then_some((x, y)),
        steps: f.int("hr_second_pass_steps", 0, 1000)?.unwrap_or(0) as usize,
        strength,
        upscaler,
        pass: crate::hires::Pass {
            prompt: text("hr_prompt")?,
            negative: text("hr_negative_prompt")?,
            sampler,
        },
        model_name,
        model: None,
    })
}

/// sdhost's `reference_images` (FLUX.1 Kontext): base64 images the model
/// attends to, decoded off the async workers.
async fn reference_images(f: &Fields<'_>) -> ApiResult<Vec<Image>> {
    let list = match f.get("reference_images") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => Ok((format!("reference_images[{i}]"), s.clone())),
                _ => Err(ApiError::field(
                    &format!("reference_images[{i}]"),
                    "expected a base64 string",
                )),
            })
            .collect::<ApiResult<Vec<_>>>()?,
        Some(_) => {
            return Err(ApiError::field(
                "reference_images",
                "expected an array of base64 images",
            ))
        }
    };
    if list.len() > MAX_REFERENCES {
        return Err(ApiError::field(
            "reference_images",
            format!("at most {MAX_REFERENCES} images"),
        ));
    }
    let _decoding = DECODES
        .acquire()
        .await
        .map_err(|_| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "stopping", "stopping"))?;
    blocking("decoding_failed", "decoding the images", move || {
        list.iter()
            .map(|(field, s)| Ok(rgb_of(decode_image(field, &decode_b64(field, s)?)?)))
            .collect::<ApiResult<Vec<_>>>()
    })
    .await?
}

/// Reference images one request may give.
const MAX_REFERENCES: usize = 4;

/// ControlNet units one request may enable.
const MAX_CONTROL_UNITS: usize = 4;

/// The ControlNet extension's preprocessors for IP-Adapter units (each
/// runs the server's `--clip-vision` encoder).
const IP_MODULES: [&str; 3] = [
    "ip-adapter_clip_sd15",
    "ip-adapter_clip_sdxl",
    "ip-adapter_clip_sdxl_plus_vith",
];

/// The ControlNets of `--controlnet-dir`, by name, on a blocking thread.
async fn controlnet_list(st: &AppState) -> ApiResult<Vec<(String, std::path::PathBuf, bool)>> {
    let Some((dir, follow)) = st.controlnet_dir.clone() else {
        return Ok(Vec::new());
    };
    blocking("internal", "listing --controlnet-dir", move || {
        super::folders::controlnet_files(Some(&dir), follow)
    })
    .await
}

/// `/controlnet/model_list`: the ControlNet extension's shape, names only.
async fn controlnet_models(State(st): State<AppState>) -> ApiResult<Json<Value>> {
    let names: Vec<String> = controlnet_list(&st)
        .await?
        .into_iter()
        .map(|n| n.0)
        .collect();
    Ok(Json(json!({ "model_list": names })))
}

/// A unit field's error named under the unit (`…args[0].weight`).
fn in_unit<T>(r: ApiResult<T>, at: &str) -> ApiResult<T> {
    r.map_err(|e| match e.field {
        Some(f) => {
            let detail = e
                .detail
                .strip_prefix(&format!("{f}: "))
                .unwrap_or(&e.detail);
            ApiError::field(&format!("{at}.{f}"), detail)
        }
        None => e,
    })
}

/// A unit's image: a base64 string, or the older `{"image": …}` object
/// (`input_image` in older clients still); `None` where it has none.
fn unit_image(u: &Fields<'_>, field: &str) -> ApiResult<Option<String>> {
    match u.get("image").or_else(|| u.get("input_image")) {
        None => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(o)) => match o.get("image") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(ApiError::field(field, "expected a base64 image")),
        },
        Some(_) => Err(ApiError::field(field, "expected a base64 image")),
    }
}

/// The ControlNet extension's units (`alwayson_scripts.controlnet.args`,
/// as SillyTavern, Open WebUI and the extension's own API examples send
/// them): enabled units with a model, their images decoded. A unit
/// without an image takes the init image (img2img), as the extension
/// does. What sdhost does not offer (another preprocessor, a control mode
/// other than Balanced) is a 422 naming the field.
async fn control_units(
    st: &AppState,
    f: &Fields<'_>,
) -> ApiResult<(
    Vec<super::worker::ControlWork>,
    Option<super::worker::IpWork>,
)> {
    let Some(scripts) = f.get("alwayson_scripts") else {
        return Ok((Vec::new(), None));
    };
    let Value::Object(scripts) = scripts else {
        return Err(ApiError::field("alwayson_scripts", "expected an object"));
    };
    for name in scripts
        .keys()
        .filter(|k| !k.eq_ignore_ascii_case("controlnet"))
    {
        tracing::info!(
            "alwayson_scripts.{}: sdhost has no such script; ignored",
            crate::term::clean(name)
        );
    }
    let Some(cn) = scripts
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("controlnet"))
        .map(|(_, v)| v)
    else {
        return Ok((Vec::new(), None));
    };
    let units = match cn.get("args") {
        Some(Value::Array(a)) => a,
        None | Some(Value::Null) => return Ok((Vec::new(), None)),
        Some(_) => {
            return Err(ApiError::field(
                "alwayson_scripts.controlnet.args",
                "expected an array of units",
            ))
        }
    };
    let available = controlnet_list(st).await?;
    let mut out: Vec<(String, std::path::PathBuf, String, Option<String>)> = Vec::new();
    // The IP-Adapter unit: its place among the decoded images, and its
    // weight.
    let mut ip: Option<(usize, f32)> = None;
    let mut asks = Vec::new();
    for (i, unit) in units.iter().enumerate() {
        let at = format!("alwayson_scripts.controlnet.args[{i}]");
        let Value::Object(u) = unit else {
            return Err(ApiError::field(&at, "expected an object"));
        };
        let u = Fields(u);
        let field = |k: &str| format!("{at}.{k}");
        if in_unit(u.boolean("enabled"), &at)? == Some(false) {
            continue;
        }
        let model = in_unit(u.string("model"), &at)?.unwrap_or_default();
        // The extension's names carry a hash: `control_v11p_sd15_canny [d14c016b]`.
        let stem = match model.rsplit_once(" [") {
            Some((s, h)) if h.ends_with(']') => s.trim(),
            _ => model.trim(),
        };
        if stem.is_empty() || stem.eq_ignore_ascii_case("none") {
            continue;
        }
        let (name, path, is_ip) = available
            .iter()
            .find(|(n, _, _)| n == stem)
            .or_else(|| {
                available
                    .iter()
                    .find(|(n, _, _)| n.eq_ignore_ascii_case(stem))
            })
            .cloned()
            .ok_or_else(|| {
                let names: Vec<&str> = available.iter().map(|n| n.0.as_str()).collect();
                ApiError::field(
                    &field("model"),
                    match st.controlnet_dir {
                        None => "the server has no ControlNets (start it with --controlnet-dir)"
                            .to_string(),
                        Some(_) => format!(
                            "no ControlNet {:?} in --controlnet-dir ({})",
                            crate::term::clean(stem),
                            names.join(", ")
                        ),
                    },
                )
            })?;
        let low = in_unit(u.float("threshold_a", -1.0, 1000.0), &at)?
            .filter(|v| *v >= 0.0)
            .map(|v| v as f32);
        let high = in_unit(u.float("threshold_b", -1.0, 1000.0), &at)?
            .filter(|v| *v >= 0.0)
            .map(|v| v as f32);
        let module = in_unit(u.string("module"), &at)?.unwrap_or_default();
        if is_ip {
            let m = module.trim().to_ascii_lowercase();
            if !(m.is_empty() || m == "none" || m.starts_with("ip-adapter")) {
                return Err(ApiError::field(
                    &field("module"),
                    format!(
                        "{name} is an IP-Adapter: its unit takes an ip-adapter module ({})",
                        IP_MODULES.join(", ")
                    ),
                ));
            }
            if ip.is_some() {
                return Err(ApiError::field(
                    &field("model"),
                    "one IP-Adapter unit per request",
                ));
            }
            let weight = in_unit(u.float("weight", 0.0, 2.0), &at)?.unwrap_or(1.0) as f32;
            let image = unit_image(&u, &field("image"))?;
            ip = Some((out.len(), weight));
            out.push((name, path, field("image"), image));
            continue;
        }
        let preprocess = crate::control::Preprocess::from_name(&module, low, high).ok_or_else(|| {
            ApiError::field(
                &field("module"),
                format!(
                    "sdhost has no preprocessor {:?} ({}); send a ready control map with module \"none\"",
                    crate::term::clean(&module),
                    crate::control::Preprocess::NAMES.join(", ")
                ),
            )
        })?;
        let resize = match u.get("resize_mode") {
            None => crate::inpaint::ResizeMode::Crop,
            Some(Value::String(s)) => {
                crate::inpaint::ResizeMode::from_name(s).ok_or_else(|| {
                    ApiError::field(
                        &field("resize_mode"),
                        "expected \"Just Resize\", \"Crop and Resize\" or \"Resize and Fill\"",
                    )
                })?
            }
            Some(_) => {
                let n = in_unit(u.int("resize_mode", 0, 2), &at)?.unwrap_or(1);
                crate::inpaint::ResizeMode::from_a1111(n).unwrap_or_default()
            }
        };
        match u.get("control_mode") {
            None => {}
            Some(Value::String(s)) if s.eq_ignore_ascii_case("balanced") => {}
            Some(Value::Number(n)) if n.as_i64() == Some(0) => {}
            Some(_) => {
                return Err(ApiError::field(
                    &field("control_mode"),
                    "sdhost runs the Balanced control mode only",
                ))
            }
        }
        let weight = in_unit(u.float("weight", 0.0, 2.0), &at)?.unwrap_or(1.0) as f32;
        let start = in_unit(u.float("guidance_start", 0.0, 1.0), &at)?.unwrap_or(0.0) as f32;
        let end = in_unit(u.float("guidance_end", 0.0, 1.0), &at)?.unwrap_or(1.0) as f32;
        if start > end {
            return Err(ApiError::field(
                &field("guidance_start"),
                format!("{start} is after guidance_end {end}"),
            ));
        }
        let image = unit_image(&u, &field("image"))?;
        if out.len() - usize::from(ip.is_some()) == MAX_CONTROL_UNITS {
            return Err(ApiError::field(
                "alwayson_scripts.controlnet.args",
                format!("at most {MAX_CONTROL_UNITS} enabled units"),
            ));
        }
        out.push((name, path, field("image"), image));
        asks.push((preprocess, resize, weight, start, end));
    }
    if out.is_empty() {
        return Ok((Vec::new(), None));
    }
    let _decoding = DECODES
        .acquire()
        .await
        .map_err(|_| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "stopping", "stopping"))?;
    let decoded = blocking(
        "decoding_failed",
        "decoding the control images",
        move || {
            out.into_iter()
                .map(|(name, path, field, b64)| {
                    let image = match b64 {
                        Some(s) => Some(rgb_of(decode_image(&field, &decode_b64(&field, &s)?)?)),
                        None => None,
                    };
                    Ok((name, path, image))
                })
                .collect::<ApiResult<Vec<_>>>()
        },
    )
    .await??;
    let empty = || Image {
        width: 0,
        height: 0,
        rgb: Vec::new(),
    };
    let mut controls = Vec::new();
    let mut ip_work = None;
    let mut asks = asks.into_iter();
    for (i, (name, path, image)) in decoded.into_iter().enumerate() {
        if let Some((at, scale)) = ip.filter(|(at, _)| *at == i) {
            let _ = at;
            ip_work = Some(super::worker::IpWork {
                path,
                name,
                image: image.unwrap_or_else(empty),
                scale,
            });
            continue;
        }
        let Some((preprocess, resize, strength, start, end)) = asks.next() else {
            break;
        };
        controls.push(super::worker::ControlWork {
            from_init: image.is_none(),
            ask: crate::control::ControlAsk {
                net: 0,
                image: image.unwrap_or_else(empty),
                preprocess,
                resize,
                strength,
                start,
                end,
            },
            name,
            path,
        });
    }
    Ok((controls, ip_work))
}

fn rgb_of(img: image::DynamicImage) -> Image {
    let img = img.into_rgb8();
    Image {
        width: img.width() as usize,
        height: img.height() as usize,
        rgb: img.into_raw(),
    }
}

/// OpenAI's edit mask: fully transparent pixels are the ones to repaint; a
/// mask without alpha is read as A1111's (white = repaint).
fn openai_mask(img: image::DynamicImage) -> Mask {
    if !img.color().has_alpha() {
        return mask_of(img, false);
    }
    let la = img.into_luma_alpha16();
    Mask {
        width: la.width() as usize,
        height: la.height() as usize,
        values: la
            .pixels()
            .map(|p| 1.0 - f32::from(p.0[1]) / 65535.0)
            .collect(),
    }
}

/// Submits `work` and awaits it; a dropped future cancels the job.
async fn run_job(st: &AppState, work: Work) -> ApiResult<Output> {
    let (ticket, rx) = submit(st, work)?;
    let reply = rx.await;
    ticket.finish();
    output_of(reply)
}

/// A queued job's handle: dropped before its reply, it cancels the job.
type JobTicket = super::queue::Ticket<Work, Output>;
/// Where a queued job's reply arrives.
type JobReply = tokio::sync::oneshot::Receiver<super::queue::Reply<Output>>;

/// Queues `work`: 503 (with Retry-After) when the queue is full.
fn submit(st: &AppState, work: Work) -> ApiResult<(JobTicket, JobReply)> {
    st.queue.submit(work).map_err(|Full| {
        let (running, waiting, _) = st.queue.snapshot();
        // When the first replica is likely to be free.
        let eta = running
            .iter()
            .map(|r| {
                let p = r.fraction().max(0.01);
                r.started.elapsed().as_secs_f64() * (1.0 - p) / p
            })
            .reduce(f64::min)
            .unwrap_or(1.0);
        ApiError {
            retry_after: Some((eta.ceil() as u64).clamp(1, 600)),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "queue_full",
                format!(
                    "the queue is full ({waiting} waiting, at most {}) or the server is stopping",
                    st.queue.bound()
                ),
            )
        }
    })
}

/// A job's reply as the API answers it.
fn output_of(
    reply: Result<super::queue::Reply<Output>, tokio::sync::oneshot::error::RecvError>,
) -> ApiResult<Output> {
    match reply {
        Ok(Ok(out)) => Ok(out),
        Ok(Err(JobError::Cancelled(m))) => Err(ApiError::new(StatusCode::CONFLICT, "cancelled", m)),
        Ok(Err(JobError::Stopping(m))) => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "stopping",
            m,
        )),
        Ok(Err(JobError::Invalid(m))) => {
            let field = m.split_once(':').map(|(f, _)| f.to_string());
            Err(ApiError {
                field,
                ..ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_field", m)
            })
        }
        Ok(Err(JobError::Failed(m))) => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "generation_failed",
            m,
        )),
        Err(_) => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "stopping",
            "the server is stopping",
        )),
    }
}

async fn generate(st: &AppState, work: GenWork) -> ApiResult<GenOutput> {
    match run_job(st, Work::Generate(Box::new(work))).await? {
        Output::Images(o) => Ok(o),
        Output::Loaded(_) | Output::Extras(_) | Output::Unloaded => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "unexpected reply",
        )),
    }
}

fn b64(png: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(png)
}

/// What a response repeats of a generation's settings.
struct Echo {
    prompt: String,
    negative: String,
    steps: usize,
    clip_skip: usize,
    variation: Option<(u64, f32)>,
}

impl Echo {
    fn of(w: &GenWork) -> Echo {
        Echo {
            prompt: w.prompt.clone(),
            negative: w.negative.clone(),
            steps: w.steps,
            clip_skip: w.clip_skip,
            variation: w.variation,
        }
    }
}

/// A1111's `info`: a JSON string describing the images.
fn info_json(w: &Echo, out: &GenOutput, strength: Option<f64>) -> String {
    json!({
        "prompt": w.prompt,
        "all_prompts": vec![&w.prompt; out.images.len()],
        "negative_prompt": w.negative,
        "all_negative_prompts": vec![&w.negative; out.images.len()],
        "seed": out.seeds.first(),
        "all_seeds": out.seeds,
        "subseed": w.variation.map_or(-1, |v| v.0 as i64),
        "all_subseeds": (0..out.images.len() as u64)
            .map(|i| w.variation.map_or(-1, |v| v.0.wrapping_add(i) as i64))
            .collect::<Vec<_>>(),
        "subseed_strength": w.variation.map_or(0.0, |v| v.1),
        "width": out.width,
        "height": out.height,
        "sampler_name": out.sampler.a1111_label(),
        "scheduler": out.scheduler.a1111_label(),
        "cfg_scale": out.cfg_scale,
        "steps": w.steps,
        "batch_size": 1,
        "n_iter": out.images.len(),
        "restore_faces": false,
        "sd_model_name": out.model.name,
        "sd_model_hash": null,
        "seed_resize_from_w": -1,
        "seed_resize_from_h": -1,
        "sdhost_interrupted": out.interrupted,
        "denoising_strength": strength,
        "clip_skip": w.clip_skip,
        "infotexts": out.infotexts,
        "styles": [],
        "index_of_first_image": 0,
        "is_using_inpainting_conditioning": false,
        "version": concat!("sdhost ", env!("CARGO_PKG_VERSION")),
    })
    .to_string()
}

/// The request echoed with the values used filled in.
fn parameters(body: &Map<String, Value>, w: &Echo, out: &GenOutput) -> Value {
    let mut p = body.clone();
    for k in ["init_images", "mask"] {
        if p.contains_key(k) {
            p.insert(k.into(), Value::Null);
        }
    }
    p.insert("prompt".into(), json!(w.prompt));
    p.insert("negative_prompt".into(), json!(w.negative));
    p.insert("seed".into(), json!(out.seeds.first()));
    p.insert("steps".into(), json!(w.steps));
    p.insert("cfg_scale".into(), json!(out.cfg_scale));
    p.insert("width".into(), json!(out.width));
    p.insert("height".into(), json!(out.height));
    p.insert("sampler_name".into(), json!(out.sampler.a1111_label()));
    p.insert("scheduler".into(), json!(out.scheduler.a1111_label()));
    Value::Object(p)
}

async fn txt2img(
    State(st): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Json<Value>> {
    let body = json_body(body)?;
    let f = Fields(&body);
    let mut work = gen_work(&f, "txt2img", 50, &st.options())?;
    hires_model(&st, &mut work).await?;
    work.model = model_override(&st, &f)?;
    work.vae = vae_override(&st, &f).await?;
    work.keep_model = f.boolean("override_settings_restore_afterwards")? == Some(false);
    work.reference = reference_images(&f).await?;
    (work.controls, work.ip) = control_units(&st, &f).await?;
    if work.ip.as_ref().is_some_and(|ip| ip.image.rgb.is_empty()) {
        return Err(ApiError::field(
            "alwayson_scripts.controlnet.args",
            "the IP-Adapter unit needs an image for txt2img",
        ));
    }
    if let Some(i) = work.controls.iter().position(|c| c.from_init) {
        return Err(ApiError::field(
            &format!("alwayson_scripts.controlnet.args[{i}].image"),
            "required for txt2img (img2img uses the init image where a unit has none)",
        ));
    }
    let echo = Echo::of(&work);
    let out = generate(&st, work).await?;
    Ok(Json(json!({
        "images": out.images.iter().map(|p| b64(p)).collect::<Vec<_>>(),
        "parameters": parameters(&body, &echo, &out),
        "info": info_json(&echo, &out, None),
    })))
}

async fn img2img(
    State(st): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Json<Value>> {
    let body = json_body(body)?;
    let f = Fields(&body);
    let mut work = gen_work(&f, "img2img", 50, &st.options())?;
    work.model = model_override(&st, &f)?;
    work.vae = vae_override(&st, &f).await?;
    work.keep_model = f.boolean("override_settings_restore_afterwards")? == Some(false);
    work.reference = reference_images(&f).await?;
    (work.controls, work.ip) = control_units(&st, &f).await?;
    let first = match f.get("init_images") {
        Some(Value::Array(a)) if !a.is_empty() => match &a[0] {
            Value::String(s) => s.clone(),
            _ => {
                return Err(ApiError::field(
                    "init_images[0]",
                    "expected a base64 string",
                ))
            }
        },
        Some(Value::Array(_)) | None => {
            return Err(ApiError::field("init_images", "required: one base64 image"))
        }
        Some(_) => return Err(ApiError::field("init_images", "expected an array")),
    };
    let strength = f.float("denoising_strength", 0.0, 1.0)?.unwrap_or(0.75);
    if strength <= 0.0 {
        return Err(ApiError::field("denoising_strength", "must be above 0"));
    }
    let invert = match f.get("inpainting_mask_invert") {
        None => false,
        Some(_) => f.boolean("inpainting_mask_invert")?.unwrap_or(false),
    };
    let mask_b64 = f.string("mask")?.filter(|m| !m.is_empty());
    let options = a1111_inpaint(&f)?;
    // Decoding (a crafted PNG may take seconds) runs on the blocking
    // threads, two at a time, never on the async workers that answer
    // /health, /progress and interrupt.
    let _decoding = DECODES
        .acquire()
        .await
        .map_err(|_| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "stopping", "stopping"))?;
    let decoded = blocking(
        "decoding_failed",
        "decoding the images",
        move || -> ApiResult<_> {
            let bytes = decode_b64("init_images[0]", &first)?;
            let img = decode_image("init_images[0]", &bytes)?.into_rgb8();
            let image = sdhost_models::request::Image {
                width: img.width() as usize,
                height: img.height() as usize,
                rgb: img.into_raw(),
            };
            let (mask, mask_hash) = match mask_b64 {
                Some(m) => {
                    let mb = decode_b64("mask", &m)?;
                    (
                        Some(mask_of(decode_image("mask", &mb)?, invert)),
                        Some(short_hash(&mb)),
                    )
                }
                None => (None, None),
            };
            Ok((image, short_hash(&bytes), mask, mask_hash))
        },
    )
    .await?;
    let (image, hash, mask, mask_hash) = decoded?;
    work.init = Some(InitWork {
        image,
        mask,
        strength,
        hash,
        mask_hash,
        options,
    });
    let echo = Echo::of(&work);
    let out = generate(&st, work).await?;
    let mut params = parameters(&body, &echo, &out);
    params["denoising_strength"] = json!(strength);
    Ok(Json(json!({
        "images": out.images.iter().map(|p| b64(p)).collect::<Vec<_>>(),
        "parameters": params,
        "info": info_json(&echo, &out, Some(strength)),
    })))
}

async fn sd_models(State(st): State<AppState>) -> Json<Value> {
    Json(Value::Array(
        st.models()
            .iter()
            .map(|m| {
                json!({
                    "title": m.title,
                    "model_name": m.name,
                    "hash": null,
                    "sha256": null,
                    "filename": m.path.display().to_string(),
                    "config": null,
                })
            })
            .collect(),
    ))
}

async fn samplers() -> Json<Value> {
    Json(Value::Array(
        Sampler::ALL
            .iter()
            .map(|s| json!({"name": s.a1111_label(), "aliases": [s.name()], "options": {}}))
            .collect(),
    ))
}

async fn schedulers() -> Json<Value> {
    Json(Value::Array(
        Scheduler::ALL
            .iter()
            .map(|s| json!({"name": s.name(), "label": s.a1111_label(), "aliases": null}))
            .collect(),
    ))
}

async fn get_options(State(st): State<AppState>) -> Json<Value> {
    let cur = st.current();
    let opts = st.options();
    let mut answer = json!({
        "sd_model_checkpoint": cur.as_ref().map(|c| c.entry.title.clone()),
        "sd_checkpoint_hash": null,
        "sd_vae": st.vae_choice.lock().unwrap_or_else(|e| e.into_inner()).clone(),
        "CLIP_stop_at_last_layers": opts.clip_skip,
        "live_previews_enable": opts.previews,
        "show_progress_every_n_steps": opts.preview_every,
        "samples_format": "png",
        "sdhost_placement": st.placement(),
        "sdhost_fit": st.fit_json(),
        "sdhost_model_family": cur.as_ref().map(|c| c.family.clone()),
        "sdhost_size_multiple": cur.as_ref().map(|c| c.size_multiple),
        "sdhost_default_size": cur.as_ref().map(|c| c.default_size),
        "sdhost_default_steps": cur.as_ref().map(|c| c.defaults.steps),
        "sdhost_default_cfg_scale": cur.as_ref().map(|c| c.defaults.cfg_scale),
        "sdhost_default_sampler": cur.as_ref().map(|c| c.defaults.sampler.a1111_label()),
        "sdhost_takes_guidance": cur.as_ref().map(|c| c.takes_guidance),
        "sdhost_ignored_options": opts.ignored.keys().collect::<Vec<_>>(),
    });
    // What a client set without effect reads back as it set it.
    if let Value::Object(a) = &mut answer {
        for (k, v) in &opts.ignored {
            a.entry(k.clone()).or_insert_with(|| v.clone());
        }
    }
    Json(answer)
}

async fn set_options(
    State(st): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Json<Value>> {
    let body = json_body(body)?;
    let f = Fields(&body);
    // Everything is checked before anything changes.
    fixed_options(&f, "")?;
    let clip_skip = f.int("CLIP_stop_at_last_layers", 1, 12)?;
    let previews = f.boolean("live_previews_enable")?;
    // A1111: -1 shows only the end (no live previews here).
    let every = f.int("show_progress_every_n_steps", -1, 100_000)?;
    const HONOURED: [&str; 5] = [
        "sd_model_checkpoint",
        "sd_vae",
        "CLIP_stop_at_last_layers",
        "live_previews_enable",
        "show_progress_every_n_steps",
    ];
    let ignored: Vec<(String, Value)> = body
        .iter()
        .filter(|(k, _)| !HONOURED.contains(&k.as_str()))
        .filter(|(k, _)| !FIXED_OPTIONS.iter().any(|(f, _)| f == k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    // What is kept without effect stays small: at most 1024 options of at
    // most 4 KiB each.
    if let Some((k, _)) = ignored.iter().find(|(_, v)| v.to_string().len() > 4096) {
        return Err(ApiError::field(k, "an option's value is at most 4 KiB"));
    }
    let kept = st.options().ignored;
    let new = ignored
        .iter()
        .filter(|(k, _)| !kept.contains_key(k))
        .count();
    if kept.len() + new > 1024 {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "too_many_options",
            "the server keeps at most 1024 options it does not use",
        ));
    }
    // `sd_vae` takes effect at the next job (which reloads the model with
    // it where it differs).
    if let Some(v) = f.get("sd_vae") {
        let choice = vae_choice(&st, "sd_vae", v).await?;
        *st.vae_choice.lock().unwrap_or_else(|e| e.into_inner()) = choice;
    }
    if let Some(name) = f.string("sd_model_checkpoint")? {
        let entry = find_model(&st, "sd_model_checkpoint", &name)?;
        let loaded = st.current().map(|c| c.entry);
        if loaded.as_ref() != Some(&entry) {
            run_job(&st, Work::Load(entry)).await?;
        }
    }
    let mut opts = st.options.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = clip_skip {
        opts.clip_skip = c as usize;
    }
    if let Some(p) = previews {
        opts.previews = p;
    }
    if let Some(n) = every {
        opts.preview_every = n.max(0) as usize;
    }
    if !ignored.is_empty() {
        let names: Vec<&str> = ignored.iter().map(|(k, _)| k.as_str()).collect();
        tracing::info!(
            "options stored without effect on the images: {}",
            crate::term::clean(&names.join(", "))
        );
    }
    opts.ignored.extend(ignored);
    Ok(Json(Value::Bool(true)))
}

/// Seconds a running job probably still needs, from its pace so far.
fn eta_of(r: &Running) -> f64 {
    let p = r.fraction();
    if p > 0.0 {
        r.started.elapsed().as_secs_f64() * (1.0 - p) / p
    } else {
        0.0
    }
}

/// `/sdapi/v1/progress`'s query: A1111's `skip_current_image`.
#[derive(serde::Deserialize, Default)]
struct ProgressQuery {
    #[serde(default)]
    skip_current_image: bool,
}

/// A1111's progress fields describe one job: the oldest running one.
/// `state.sdhost_running` lists every running job (one per busy replica)
/// with the device it runs on.
async fn progress(State(st): State<AppState>, Query(q): Query<ProgressQuery>) -> Json<Value> {
    let skip_image = q.skip_current_image;
    let (running, waiting, counters) = st.queue.snapshot();
    // The first running job's latest preview (A1111 shows one job).
    let current_image = running
        .first()
        .and_then(|r| r.preview.clone())
        .filter(|_| !skip_image);
    let (p, eta, step, steps, job, ts, id) = match running.first() {
        Some(r) => (
            r.fraction(),
            eta_of(r),
            r.step,
            r.steps,
            r.kind,
            r.timestamp.to_string(),
            Some(r.id),
        ),
        None => (0.0, 0.0, 0, 0, "", String::new(), None),
    };
    let job_count = waiting + running.len();
    let jobs: Vec<Value> = running
        .iter()
        .map(|r| {
            json!({
                "id": r.id,
                "job": r.kind,
                "replica": r.replica,
                "device": st.replicas.get(r.replica),
                "progress": r.fraction(),
                "eta_relative": eta_of(r),
                "sampling_step": r.step,
                "sampling_steps": r.steps,
                "job_no": r.images_done,
                "job_images": r.images,
                "has_preview": r.preview.is_some(),
            })
        })
        .collect();
    Json(json!({
        "progress": p,
        "eta_relative": eta,
        "state": {
            "skipped": false,
            "interrupted": false,
            "stopping_generation": false,
            "job": job,
            "job_count": job_count,
            "job_timestamp": ts,
            "job_no": running.first().map_or(0, |r| r.images_done),
            "sampling_step": step,
            "sampling_steps": steps,
            "sdhost_job_id": id,
            "sdhost_running": jobs,
            "sdhost_waiting": waiting,
            "sdhost_jobs": counters,
        },
        "current_image": current_image.as_deref(),
        "textinfo": null,
    }))
}

/// A1111's `/sdapi/v1/memory`: the host's memory (`ram`, from
/// /proc/meminfo: available counts as free), A1111's `cuda.system` for the
/// first CUDA device, and every device (`sdhost_devices`, sampled after each
/// job).
async fn memory(State(st): State<AppState>) -> Json<Value> {
    let devices = st
        .device_memory
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let ram = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            let kib = |key: &str| {
                m.lines()
                    .find_map(|l| l.strip_prefix(key))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                    .map(|k| k * 1024)
            };
            let (total, free) = (kib("MemTotal:")?, kib("MemAvailable:")?);
            Some(json!({"free": free, "used": total.saturating_sub(free), "total": total}))
        })
        .unwrap_or_else(|| json!({"error": "the host's memory cannot be read here"}));
    let cuda = match devices.iter().find(|d| d.name.starts_with("cuda")) {
        Some(d) => json!({"system": {
            "free": d.free, "used": d.total.saturating_sub(d.free), "total": d.total,
        }}),
        None => json!({"error": "no CUDA device; every device is in sdhost_devices"}),
    };
    Json(json!({"ram": ram, "cuda": cuda, "sdhost_devices": devices}))
}

/// The command line as A1111's `/sdapi/v1/cmd-flags` shows its flags:
/// `--name value` and `--name=value` as `name: value`, a bare `--name` as
/// `true`, the model and other values as given; keys, passwords and the
/// API's credentials as `"<hidden>"`.
pub fn cmd_flags(args: impl Iterator<Item = String>) -> Value {
    const SECRET: [&str; 3] = ["api_key", "api_auth", "rpc_key"];
    let mut flags = Map::new();
    let mut args = args.peekable();
    while let Some(a) = args.next() {
        let Some(name) = a.strip_prefix("--") else {
            let shown = match std::path::Path::new(&a).file_name() {
                Some(n) if a.contains('/') => n.to_string_lossy().into_owned(),
                _ => a,
            };
            if let Value::Array(v) = flags.entry("sdhost_args").or_insert_with(|| json!([])) {
                v.push(json!(shown));
            }
            continue;
        };
        let (name, value) = match name.split_once('=') {
            Some((n, v)) => (n.replace('-', "_"), json!(v)),
            None => {
                let n = name.replace('-', "_");
                match args.peek() {
                    Some(v) if !v.starts_with("--") => (n, json!(args.next())),
                    _ => (n, json!(true)),
                }
            }
        };
        let value = match value {
            _ if SECRET.contains(&name.as_str()) => json!("<hidden>"),
            // No path of the server's disk: a file or folder by its name.
            Value::String(v) if v.contains('/') => json!(std::path::Path::new(&v)
                .file_name()
                .map_or(String::new(), |n| n.to_string_lossy().into_owned())),
            v => v,
        };
        flags.insert(name, value);
    }
    Value::Object(flags)
}

/// A1111's interrupt: each running job (one per busy replica) finishes
/// after its current step and answers 200 with what it made.
async fn interrupt(State(st): State<AppState>) -> Json<Value> {
    let ids = st.queue.interrupt();
    Json(json!({"interrupted": ids.first(), "sdhost_interrupted": ids}))
}

/// A1111's skip: each running job finishes its current image after the
/// current step and goes on with the next of its batch.
async fn skip(State(st): State<AppState>) -> Json<Value> {
    let ids = st.queue.skip();
    Json(json!({"skipped": ids.first(), "sdhost_skipped": ids}))
}

async fn health(State(st): State<AppState>) -> Json<Value> {
    let (running, waiting, counters) = st.queue.snapshot();
    Json(json!({
        "status": "ok",
        "model": st.current().map(|c| c.entry.title),
        "placement": st.placement(),
        "fit": st.fit_json(),
        "queue": {"running": running.len(), "waiting": waiting, "bound": st.queue.bound()},
        "replicas": *st.replicas,
        "jobs": counters,
        "version": env!("CARGO_PKG_VERSION"),
    }))
}

async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

/// One model of `/v1/models`, by its id.
async fn openai_model(
    State(st): State<AppState>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> ApiResult<Json<Value>> {
    st.models()
        .iter()
        .find(|m| m.title == id)
        .map(|m| {
            Json(json!({"id": m.title, "object": "model", "created": 0, "owned_by": "sdhost"}))
        })
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "model_not_found",
                format!("no model {id:?}"),
            )
        })
}

/// The LoRAs a prompt may name with `<lora:NAME:WEIGHT>` (`--lora-dir`):
/// names only, no path of the server's disk.
async fn loras(State(st): State<AppState>) -> ApiResult<Json<Value>> {
    let names = match &st.lora_dir {
        Some((dir, follow)) => {
            let (dir, follow) = (dir.clone(), *follow);
            blocking("internal", "listing --lora-dir", move || {
                super::folders::lora_names(Some(&dir), follow)
            })
            .await?
        }
        None => Vec::new(),
    };
    Ok(Json(Value::Array(
        names
            .iter()
            .map(|n| json!({"name": n, "alias": n, "path": format!("{n}.safetensors"), "metadata": {}}))
            .collect(),
    )))
}

/// Scans `--models-dir` again (checkpoints added or removed since start),
/// on a blocking thread; answers `null` as A1111 does.
async fn refresh_checkpoints(State(st): State<AppState>) -> ApiResult<Json<Value>> {
    let cat = st.catalogue.clone();
    let (list, _) = blocking("internal", "scanning --models-dir", move || cat.scan())
        .await?
        .map_err(|e| {
            // The line names the server's folders: logged, not answered.
            tracing::warn!("refresh-checkpoints: {}", crate::term::error_line(&e));
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "refresh_failed",
                "cannot scan the models folder again (the server's log says why)",
            )
        })?;
    *st.models.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(list);
    Ok(Json(Value::Null))
}

/// A1111's PNG Info: a PNG's `parameters` text (`info`), its other text
/// chunks (`items`) and that text parsed into fields (`parameters`); the
/// chunks are read without decoding a pixel, on a blocking thread.
async fn png_info(body: Result<Bytes, BytesRejection>) -> ApiResult<Json<Value>> {
    let body = json_body(body)?;
    let f = Fields(&body);
    let Some(image) = f.string("image")? else {
        return Err(ApiError::field("image", "required"));
    };
    let chunks = blocking("internal", "reading the PNG", move || {
        let bytes = decode_b64("image", &image)?;
        crate::png::text_chunks(&bytes)
            .map_err(|e| ApiError::field("image", crate::term::error_line(&e)))
    })
    .await??;
    let mut info = String::new();
    let mut items = serde_json::Map::new();
    for (k, v) in chunks {
        if k == "parameters" && info.is_empty() {
            info = v;
        } else {
            items.insert(k, Value::String(v));
        }
    }
    let parameters = if info.is_empty() {
        serde_json::Map::new()
    } else {
        crate::png::parse_parameters(&info)
    };
    Ok(Json(
        json!({"info": info, "items": items, "parameters": parameters}),
    ))
}

/// The upscalers a request may pick (`hr_upscaler`, the extras'
/// `upscaler_1`/`_2`), as A1111 lists them: `None`, its plain resizes
/// `Lanczos` and `Nearest`, then the models of `--upscaler-dir`.
async fn upscalers(State(st): State<AppState>) -> ApiResult<Json<Value>> {
    let mut list: Vec<Value> = ["None", "Lanczos", "Nearest"]
        .iter()
        .map(|n| json!({"name": n, "model_name": null, "model_path": null, "model_url": null, "scale": 4}))
        .collect();
    list.extend(upscaler_list(&st).await?.into_iter().map(|(name, _)| {
        json!({"name": name, "model_name": "ESRGAN", "model_path": format!("{name}"), "model_url": null, "scale": 4})
    }));
    Ok(Json(Value::Array(list)))
}

/// The most images one `extra-batch-images` request enlarges.
const MAX_EXTRAS_IMAGES: usize = MAX_IMAGES as usize;

/// A1111's extras fields, the images aside: `resize_mode` 0
/// (`upscaling_resize`, 2) or 1 (`upscaling_resize_w`/`_h`, 512, and
/// `upscaling_crop`, true); `upscaler_1` and `upscaler_2` (`None`,
/// `Lanczos`, `Nearest` or a model of `--upscaler-dir` by name) and
/// `extras_upscaler_2_visibility`. Face restoration (`gfpgan_visibility`,
/// `codeformer_visibility` above 0) is refused: sdhost has none.
async fn extras_ask(
    st: &AppState,
    f: &Fields<'_>,
) -> ApiResult<(
    crate::extras::Ask,
    Vec<(&'static str, String, std::path::PathBuf)>,
)> {
    use crate::extras::{Target, Upscaler};
    for k in ["gfpgan_visibility", "codeformer_visibility"] {
        if f.float(k, 0.0, 1.0)?.unwrap_or(0.0) > 0.0 {
            return Err(ApiError::field(
                k,
                "face restoration (GFPGAN, CodeFormer) is not available in sdhost; send 0",
            ));
        }
    }
    // Accepted without effect (no face restoration, nothing shown).
    f.float("codeformer_weight", 0.0, 1.0)?;
    f.boolean("upscale_first")?;
    f.boolean("show_extras_results")?;
    let side = crate::extras::MAX_SIDE as i64;
    let target = match f.int("resize_mode", 0, 1)?.unwrap_or(0) {
        0 => Target::By(f.float("upscaling_resize", 1.0, 8.0)?.unwrap_or(2.0)),
        _ => Target::To {
            width: f.int("upscaling_resize_w", 1, side)?.unwrap_or(512) as usize,
            height: f.int("upscaling_resize_h", 1, side)?.unwrap_or(512) as usize,
            crop: f.boolean("upscaling_crop")?.unwrap_or(true),
        },
    };
    let list = upscaler_list(st).await?;
    let mut models = Vec::new();
    let mut pick = |field: &'static str| -> ApiResult<Option<Upscaler>> {
        let name = f.string(field)?.unwrap_or_else(|| "None".into());
        if let Some(builtin) = Upscaler::builtin(&name) {
            return Ok(builtin);
        }
        let (n, p) = find_upscaler(
            &list,
            field,
            &name,
            "is not an upscaler here; None, Lanczos, Nearest",
        )?;
        models.push((field, n.clone(), p.clone()));
        Ok(Some(Upscaler::Model(n)))
    };
    let first = pick("upscaler_1")?;
    let second = pick("upscaler_2")?;
    let visibility = f
        .float("extras_upscaler_2_visibility", 0.0, 1.0)?
        .unwrap_or(0.0) as f32;
    let ask = crate::extras::Ask {
        target,
        first,
        second: second.filter(|_| visibility > 0.0).map(|u| (u, visibility)),
    };
    // A second model only blended at 0 is not loaded.
    models.retain(|(field, name, _)| {
        *field == "upscaler_1" || ask.second.as_ref().is_some_and(|(u, _)| u.name() == name)
    });
    Ok((ask, models))
}

/// Decodes extras images (base64 PNG, JPEG or WebP, `(field, data)` each) on the
/// blocking threads, keeping each PNG's `parameters` text; each image's
/// result must fit [`crate::extras::MAX_SIDE`].
async fn extras_images(
    ask: &crate::extras::Ask,
    images: Vec<(String, String)>,
) -> ApiResult<Vec<(Image, Option<String>)>> {
    let _decoding = DECODES
        .acquire()
        .await
        .map_err(|_| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "stopping", "stopping"))?;
    let ask = ask.clone();
    blocking("decoding_failed", "decoding the images", move || {
        images
            .into_iter()
            .map(|(field, data)| {
                let bytes = decode_b64(&field, &data)?;
                let image = rgb_of(decode_image(&field, &bytes)?);
                ask.out_size(image.width, image.height)
                    .map_err(|e| ApiError::field(&field, e))?;
                let parameters = crate::png::text_chunks(&bytes)
                    .ok()
                    .and_then(|t| t.into_iter().find(|(k, _)| k == "parameters"))
                    .map(|(_, v)| v);
                Ok((image, parameters))
            })
            .collect::<ApiResult<Vec<_>>>()
    })
    .await?
}

/// Runs an extras job.
async fn extras(
    st: &AppState,
    f: &Fields<'_>,
    images: Vec<(String, String)>,
) -> ApiResult<super::worker::ExtrasOutput> {
    let (ask, models) = extras_ask(st, f).await?;
    let images = extras_images(&ask, images).await?;
    let work = super::worker::ExtrasWork {
        images,
        ask,
        models,
    };
    match run_job(st, Work::Extras(Box::new(work))).await? {
        Output::Extras(o) => Ok(o),
        _ => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "unexpected reply",
        )),
    }
}

/// A1111's `html_info`: the infotext as one HTML paragraph.
fn html_info(text: &str) -> String {
    let escaped = text
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&#x27;");
    format!("<p>{escaped}</p>")
}

/// A1111's `POST /sdapi/v1/extra-single-image`: `image` (base64) enlarged
/// as the Extras tab does ([`extras_ask`]'s fields): `{image, html_info}`.
async fn extra_single_image(
    State(st): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Json<Value>> {
    let body = json_body(body)?;
    let f = Fields(&body);
    let image = f
        .string("image")?
        .filter(|s| !s.trim().is_empty())
        .ok_or_else(|| ApiError::field("image", "required: a base64 image"))?;
    let out = extras(&st, &f, vec![("image".into(), image)]).await?;
    let png = out.images.first().ok_or_else(|| {
        ApiError::new(
            StatusCode::CONFLICT,
            "cancelled",
            "interrupted before the image",
        )
    })?;
    Ok(Json(
        json!({"html_info": html_info(&out.info), "image": b64(png)}),
    ))
}

/// A1111's `POST /sdapi/v1/extra-batch-images`: `imageList` (`[{data,
/// name}]`, base64 each, at most 16) enlarged alike: `{images, html_info}`;
/// an interrupt answers the images done.
async fn extra_batch_images(
    State(st): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Json<Value>> {
    let body = json_body(body)?;
    let f = Fields(&body);
    let list = match f.get("imageList") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) | None => {
            return Err(ApiError::field("imageList", "required: one image or more"))
        }
        Some(_) => return Err(ApiError::field("imageList", "expected an array")),
    };
    if list.len() > MAX_EXTRAS_IMAGES {
        return Err(ApiError::field(
            "imageList",
            format!("{} images; at most {MAX_EXTRAS_IMAGES}", list.len()),
        ));
    }
    let images = list
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let field = format!("imageList[{i}].data");
            match item.get("data") {
                Some(Value::String(d)) if !d.trim().is_empty() => Ok((field, d.clone())),
                _ => Err(ApiError::field(&field, "required: a base64 image")),
            }
        })
        .collect::<ApiResult<Vec<_>>>()?;
    let out = extras(&st, &f, images).await?;
    let images: Vec<String> = out.images.iter().map(|p| b64(p)).collect();
    Ok(Json(json!({
        "html_info": html_info(&out.info),
        "images": images,
        "sdhost_interrupted": out.interrupted,
    })))
}

/// A1111's Real-ESRGAN list: the models of `--upscaler-dir` (ESRGAN and
/// Real-ESRGAN files alike), by name, as `upscaler_1` takes them.
async fn realesrgan_models(State(st): State<AppState>) -> ApiResult<Json<Value>> {
    let list = upscaler_list(&st).await?;
    Ok(Json(Value::Array(
        list.into_iter()
            .map(|(name, _)| json!({"name": name, "path": null, "scale": 4}))
            .collect(),
    )))
}

/// A1111's interrogate (an image's caption by CLIP or DeepBooru): sdhost
/// has neither captioning model, so a 422 naming `model` that says so,
/// after the body is checked like every other.
async fn interrogate(body: Result<Bytes, BytesRejection>) -> ApiResult<Json<Value>> {
    let body = json_body(body)?;
    let f = Fields(&body);
    let model = f.string("model")?.unwrap_or_else(|| "clip".into());
    Err(ApiError::field(
        "model",
        format!(
            "{:?}: interrogation (CLIP, DeepBooru) is not available in sdhost",
            crate::term::clean(&model)
        ),
    ))
}

/// Runs one job per replica, each on its own replica (behind the jobs
/// waiting), and waits for all of them.
async fn on_every_replica(st: &AppState, work: impl Fn() -> Work) -> ApiResult<()> {
    let mut waits = Vec::new();
    for r in 0..st.queue.replicas() {
        waits.push(st.queue.submit_to(work(), Some(r)).map_err(|Full| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "queue_full",
                "the queue is full or the server is stopping",
            )
        })?);
    }
    for (ticket, rx) in waits {
        let reply = rx.await;
        ticket.finish();
        output_of(reply)?;
    }
    Ok(())
}

/// A1111's `unload-checkpoint`: every replica drops its checkpoint (after
/// the jobs already waiting), freeing its weights' memory for other
/// programs; the next generation loads it again, as A1111 does. `{}`.
async fn unload_checkpoint(State(st): State<AppState>) -> ApiResult<Json<Value>> {
    on_every_replica(&st, || Work::Unload).await?;
    Ok(Json(json!({})))
}

/// A1111's `reload-checkpoint`: every replica loads the server's
/// checkpoint now (nothing where it is loaded). `{}`.
async fn reload_checkpoint(State(st): State<AppState>) -> ApiResult<Json<Value>> {
    let first = || {
        let models = st.models.read().unwrap_or_else(|e| e.into_inner()).clone();
        models.first().cloned()
    };
    let entry = st
        .current()
        .map(|c| c.entry)
        .or_else(first)
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "no_model",
                "no checkpoint to load",
            )
        })?;
    on_every_replica(&st, || Work::Load(entry.clone())).await?;
    Ok(Json(json!({})))
}

/// The upscaler models of `--upscaler-dir`, by name, on a blocking thread.
async fn upscaler_list(st: &AppState) -> ApiResult<Vec<(String, std::path::PathBuf)>> {
    let Some((dir, follow)) = st.upscaler_dir.clone() else {
        return Ok(Vec::new());
    };
    blocking("internal", "listing --upscaler-dir", move || {
        super::folders::upscaler_files(Some(&dir), follow)
    })
    .await
}

/// Resolves a hires fix's `hr_upscaler` that names no built-in upscaler
/// against `--upscaler-dir` (a 422 listing what there is).
async fn hires_model(st: &AppState, work: &mut GenWork) -> ApiResult<()> {
    let Some(name) = work.hires.as_ref().and_then(|h| h.model_name.clone()) else {
        return Ok(());
    };
    let list = upscaler_list(st).await?;
    let found = find_upscaler(
        &list,
        "hr_upscaler",
        &name,
        "is not supported; Lanczos, Nearest, None, Latent, Latent (nearest), Latent (nearest-exact)",
    )?;
    if let Some(h) = work.hires.as_mut() {
        h.model = Some(found);
    }
    Ok(())
}

/// The model of `list` (`--upscaler-dir`) named `name` (exactly, else in
/// any case), or a 422 naming `field`: `"NAME" {what}`, then the folder's
/// names.
fn find_upscaler(
    list: &[(String, std::path::PathBuf)],
    field: &str,
    name: &str,
    what: &str,
) -> ApiResult<(String, std::path::PathBuf)> {
    let found = list
        .iter()
        .find(|(n, _)| n == name)
        .or_else(|| list.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)));
    found.cloned().ok_or_else(|| {
        let names: Vec<&str> = list.iter().map(|n| n.0.as_str()).collect();
        ApiError::field(
            field,
            format!(
                "{:?} {what}{}{} are",
                crate::term::clean(name),
                if names.is_empty() {
                    ""
                } else {
                    " and --upscaler-dir's "
                },
                names.join(", ")
            ),
        )
    })
}

async fn openai_models(State(st): State<AppState>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": st.models().iter().map(|m| json!({
            "id": m.title, "object": "model", "created": 0, "owned_by": "sdhost"
        })).collect::<Vec<_>>(),
    }))
}

async fn openai_generations(
    State(st): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Response> {
    let body = json_body(body)?;
    let f = Fields(&body);
    let mut work = gen_work(&f, "txt2img", 20, &st.options())?;
    if f.get("batch_size").is_some() || f.get("n_iter").is_some() {
        return Err(ApiError::field("n", "give the number of images as n"));
    }
    let url = openai_fields(&st, &f, &mut work)?;
    match openai_streaming(&f)? {
        Some(_) if url => Err(url_and_stream()),
        Some(partial) => openai_stream(&st, work, partial, "image_generation"),
        None => Ok(
            openai_images(&st, work, url.then(|| base_url(&st, &headers)))
                .await?
                .into_response(),
        ),
    }
}

/// A stream's events carry the images themselves (`b64_json`), as
/// OpenAI's do.
fn url_and_stream() -> ApiError {
    ApiError::field(
        "response_format",
        "\"url\" cannot be streamed: a stream's events carry b64_json",
    )
}

/// This server's URL as the request reached it: `X-Forwarded-Proto` and
/// `X-Forwarded-Host` (behind a proxy), else `http` and `Host`, else the
/// address it listens on. A header with characters no host name has is
/// not used.
fn base_url(st: &AppState, headers: &HeaderMap) -> String {
    let value = |h: &str| {
        headers
            .get(h)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.split(',').next().unwrap_or("").trim().to_string())
    };
    let host_like = |v: &String| {
        !v.is_empty()
            && v.chars()
                .all(|c| c.is_ascii_alphanumeric() || ".-:[]_".contains(c))
    };
    let scheme = value("x-forwarded-proto")
        .filter(|p| p == "https" || p == "http")
        .unwrap_or_else(|| "http".into());
    let host = value("x-forwarded-host")
        .filter(host_like)
        .or_else(|| value("host").filter(host_like))
        .unwrap_or_else(|| st.local_addr.to_string());
    format!("{scheme}://{host}")
}

/// `GET /v1/images/files/NAME`: an image an OpenAI answer gave by URL,
/// while it is kept (an hour, the newest 64).
async fn image_file(
    State(st): State<AppState>,
    axum::extract::Path(name): axum::extract::Path<String>,
) -> ApiResult<Response> {
    let png = st.images.get(&name).ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "image_not_found",
            "no such image: its URL was never given, or it expired (an hour, the newest 64 are kept)",
        )
    })?;
    Ok((
        [
            (header::CONTENT_TYPE, "image/png"),
            (header::CACHE_CONTROL, "private, max-age=3600"),
        ],
        png.as_ref().clone(),
    )
        .into_response())
}

/// OpenAI's `stream` and `partial_images` (0–3): `Some(partial images)`
/// when the answer is to be streamed.
fn openai_streaming(f: &Fields<'_>) -> ApiResult<Option<usize>> {
    let stream = match f.get("stream") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Bool(true)) => true,
        // A form upload's fields are text.
        Some(Value::String(s)) if s == "true" || s == "false" => s == "true",
        Some(_) => return Err(ApiError::field("stream", "must be true or false")),
    };
    let partial = f.int("partial_images", 0, 3)?;
    match (stream, partial) {
        (false, Some(p)) if p > 0 => Err(ApiError::field(
            "partial_images",
            "partial images are streamed: set stream to true",
        )),
        (false, _) => Ok(None),
        (true, p) => Ok(Some(p.unwrap_or(0) as usize)),
    }
}

/// OpenAI's image streaming: server-sent events, up to `partial` live
/// previews (`{kind}.partial_image`, one pixel per latent cell, spread over
/// the steps) while the job runs, then one `{kind}.completed` per image, or
/// an `error` event. A client that goes away cancels the job.
fn openai_stream(
    st: &AppState,
    mut work: GenWork,
    partial: usize,
    kind: &'static str,
) -> ApiResult<Response> {
    use axum::response::sse::{Event, Sse};
    work.preview_every = Some(match partial {
        0 => 0,
        p => (work.steps / (p + 1)).max(1),
    });
    let size = match (work.width, work.height) {
        (Some(w), Some(h)) => format!("{w}x{h}"),
        _ => "auto".to_string(),
    };
    let prompt = work.prompt.clone();
    let (ticket, rx) = submit(st, Work::Generate(Box::new(work)))?;
    let queue = st.queue.clone();
    let (tx, events) = tokio::sync::mpsc::channel::<Event>(4);
    let event = |name: String, data: Value| Event::default().event(name).data(data.to_string());
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    };
    tokio::spawn(async move {
        let id = ticket.id();
        let mut rx = rx;
        let mut tick = tokio::time::interval(std::time::Duration::from_millis(20));
        let (mut sent, mut last) = (0, None::<Arc<str>>);
        let reply = loop {
            tokio::select! {
                r = &mut rx => break r,
                // The client went away: dropping the ticket cancels the job.
                _ = tx.closed() => return,
                _ = tick.tick() => {
                    let Some((png, _)) = queue.preview_of(id).filter(|_| sent < partial) else {
                        continue;
                    };
                    if last.as_deref() == Some(&*png) {
                        continue;
                    }
                    let name = format!("{kind}.partial_image");
                    let data = json!({
                        "type": name, "b64_json": &*png, "created_at": now(), "size": size,
                        "quality": "auto", "background": "opaque", "output_format": "png",
                        "partial_image_index": sent,
                    });
                    if tx.send(event(name, data)).await.is_err() {
                        return;
                    }
                    sent += 1;
                    last = Some(png);
                }
            }
        };
        ticket.finish();
        match output_of(reply) {
            Ok(Output::Images(out)) => {
                let name = format!("{kind}.completed");
                for png in &out.images {
                    let data = json!({
                        "type": name, "b64_json": b64(png), "created_at": now(),
                        "size": format!("{}x{}", out.width, out.height), "quality": "auto",
                        "background": "opaque", "output_format": "png", "revised_prompt": prompt,
                        "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
                                  "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}},
                    });
                    if tx.send(event(name.clone(), data)).await.is_err() {
                        return;
                    }
                }
            }
            Ok(Output::Loaded(_) | Output::Extras(_) | Output::Unloaded) => {}
            Err(e) => {
                let kind = if e.status.is_server_error() {
                    "server_error"
                } else {
                    "invalid_request_error"
                };
                let data = json!({"type": "error", "error": {
                    "message": e.detail, "type": kind, "param": e.field, "code": e.error,
                }});
                let _ = tx.send(event("error".into(), data)).await;
            }
        }
    });
    let stream = futures_util::stream::unfold(events, |mut rx| async move {
        rx.recv()
            .await
            .map(|e| (Ok::<_, std::convert::Infallible>(e), rx))
    });
    Ok(Sse::new(stream).into_response())
}

/// OpenAI's `/v1/images/edits` (a form upload: `image` or `image[]`,
/// repeatable; `prompt`; `mask`; `model`, `n`, `size`, `response_format`,
/// and sdhost's `steps`, `seed`, `cfg_scale`, `guidance`, `strength`): a
/// FLUX model edits with the images as references (Kontext); another family
/// runs img2img from the first image (strength 0.75 unless given), and
/// inpainting where a mask is given (transparent = repaint).
async fn openai_edits(
    State(st): State<AppState>,
    headers: HeaderMap,
    form: Result<axum::extract::Multipart, axum::extract::multipart::MultipartRejection>,
) -> ApiResult<Response> {
    let mut form = form.map_err(|e| ApiError::new(e.status(), "bad_body", e.body_text()))?;
    let bad = |e: axum::extract::multipart::MultipartError| {
        let status = e.status();
        let kind = if status == StatusCode::PAYLOAD_TOO_LARGE {
            "body_too_large"
        } else {
            "bad_body"
        };
        ApiError::new(status, kind, e.body_text())
    };
    let mut fields = Map::new();
    let (mut images, mut mask) = (Vec::new(), None);
    while let Some(part) = form.next_field().await.map_err(bad)? {
        let name = part.name().unwrap_or("").to_string();
        match name.as_str() {
            "image" | "image[]" => images.push(part.bytes().await.map_err(bad)?),
            "mask" => mask = Some(part.bytes().await.map_err(bad)?),
            "prompt" | "model" | "size" | "response_format" | "n" | "steps" | "seed"
            | "cfg_scale" | "guidance" | "strength" | "negative_prompt" | "quality" | "user"
            | "background" | "input_fidelity" | "output_format" | "stream" | "partial_images" => {
                let text = part.text().await.map_err(bad)?;
                // Numbers as numbers, so the JSON endpoints' checks apply.
                let value = match name.as_str() {
                    "n" | "steps" | "seed" | "cfg_scale" | "guidance" | "strength"
                    | "partial_images" => text
                        .trim()
                        .parse::<serde_json::Number>()
                        .map_or(Value::String(text), Value::Number),
                    _ => Value::String(text),
                };
                fields.insert(name, value);
            }
            other => return Err(ApiError::field(other, "not a field of /v1/images/edits")),
        }
    }
    if images.is_empty() {
        return Err(ApiError::field("image", "required: the image to edit"));
    }
    if images.len() > MAX_REFERENCES {
        return Err(ApiError::field(
            "image",
            format!("at most {MAX_REFERENCES} images"),
        ));
    }
    if let Some(g) = fields.remove("guidance") {
        fields.insert("distilled_cfg_scale".into(), g);
    }
    let f = Fields(&fields);
    let mut work = gen_work(&f, "img2img", 20, &st.options())?;
    let url = openai_fields(&st, &f, &mut work)?;
    let streaming = openai_streaming(&f)?;
    if url && streaming.is_some() {
        return Err(url_and_stream());
    }
    let strength = f.float("strength", 0.0, 1.0)?.unwrap_or(0.75);
    if strength <= 0.0 {
        return Err(ApiError::field("strength", "must be above 0"));
    }
    let _decoding = DECODES
        .acquire()
        .await
        .map_err(|_| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "stopping", "stopping"))?;
    let decoded = blocking("decoding_failed", "decoding the images", move || {
        let refs = images
            .iter()
            .enumerate()
            .map(|(i, b)| Ok(rgb_of(decode_image(&format!("image[{i}]"), b)?)))
            .collect::<ApiResult<Vec<_>>>()?;
        let mask = match &mask {
            Some(b) => Some((openai_mask(decode_image("mask", b)?), short_hash(b))),
            None => None,
        };
        Ok::<_, ApiError>((refs, short_hash(&images[0]), mask))
    })
    .await?;
    let (refs, hash, mask) = decoded?;
    let (mask, mask_hash) = mask.map_or((None, None), |(m, h)| (Some(m), Some(h)));
    work.init = Some(InitWork {
        image: refs[0].clone(),
        mask,
        strength,
        hash,
        mask_hash,
        // OpenAI's edit: the image as given, the transparent area repainted.
        options: crate::inpaint::Options::plain(),
    });
    work.reference = refs;
    work.edit = true;
    match streaming {
        Some(partial) => openai_stream(&st, work, partial, "image_edit"),
        None => Ok(
            openai_images(&st, work, url.then(|| base_url(&st, &headers)))
                .await?
                .into_response(),
        ),
    }
}

/// The fields OpenAI's image endpoints share: `n`, `size`,
/// `response_format` (`b64_json`, or `url`: whether the answer gives
/// URLs, returned) and `model` (OpenAI clients often send their own model
/// names: only a name this server knows switches the model).
fn openai_fields(st: &AppState, f: &Fields<'_>, work: &mut GenWork) -> ApiResult<bool> {
    work.count = f.int("n", 1, MAX_IMAGES)?.unwrap_or(1) as usize;
    if let Some(size) = f.string("size")? {
        (work.width, work.height) = openai_size(&size)?;
    }
    let url = match f.string("response_format")?.as_deref() {
        None | Some("b64_json") => false,
        Some("url") => true,
        Some(other) => {
            return Err(ApiError::field(
                "response_format",
                format!(
                    "{:?} is not supported; use b64_json or url",
                    crate::term::clean(other)
                ),
            ))
        }
    };
    if let Some(m) = f.string("model")? {
        work.model = st.models().iter().find(|e| e.matches(&m)).cloned();
    }
    Ok(url)
}

/// Runs `work` and answers as OpenAI's image endpoints do: each image as
/// `b64_json`, or, given this server's base URL, as a `url` under
/// `/v1/images/files/` (kept an hour, [`super::store`]).
async fn openai_images(
    st: &AppState,
    work: GenWork,
    url_base: Option<String>,
) -> ApiResult<Json<Value>> {
    let prompt = work.prompt.clone();
    let out = generate(st, work).await?;
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut data = Vec::new();
    for png in out.images {
        let item = match &url_base {
            None => json!({"b64_json": b64(&png), "revised_prompt": prompt}),
            Some(base) => {
                let name = st.images.put(png).ok_or_else(|| {
                    ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "image_not_kept",
                        "the image could not be kept for its URL; ask for b64_json",
                    )
                })?;
                json!({"url": format!("{base}/v1/images/files/{name}"), "revised_prompt": prompt})
            }
        };
        data.push(item);
    }
    Ok(Json(json!({
        "created": created,
        "data": data,
        "output_format": "png",
    })))
}

/// OpenAI's `size`: `WIDTHxHEIGHT`, or `auto` (the image's or the family's).
fn openai_size(size: &str) -> ApiResult<(Option<usize>, Option<usize>)> {
    if size == "auto" {
        return Ok((None, None));
    }
    let parsed = size
        .split_once(['x', 'X'])
        .and_then(|(w, h)| Some((w.trim().parse::<i64>().ok()?, h.trim().parse::<i64>().ok()?)))
        .filter(|&(w, h)| (8..=MAX_SIDE).contains(&w) && (8..=MAX_SIDE).contains(&h));
    let (w, h) = parsed.ok_or_else(|| {
        ApiError::field(
            "size",
            format!("{size:?} is not WIDTHxHEIGHT with sides 8..={MAX_SIDE}"),
        )
    })?;
    Ok((Some(w as usize), Some(h as usize)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => panic!(),
        }
    }

    /// Every route of [`router`] is described in `/openapi.json` (the
    /// routes read from this file's source, so a new one cannot be left
    /// out), and nothing else is.
    #[test]
    fn openapi_describes_every_route() {
        let spec: Value = serde_json::from_str(OPENAPI).unwrap();
        let described: std::collections::BTreeSet<&str> = spec["paths"]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        let source = include_str!("api.rs");
        let code = &source[..source.find("#[cfg(test)]").unwrap()];
        let routes: std::collections::BTreeSet<&str> = code
            .split(".route(")
            .skip(1)
            .filter_map(|rest| rest.trim_start().strip_prefix('"')?.split('"').next())
            .collect();
        assert!(routes.len() > 30, "{routes:?}");
        assert_eq!(routes, described);
    }

    #[test]
    fn seeds_are_exact_or_refused() {
        let seed = |v: Value| seed_of(&Fields(&fields(json!({ "seed": v })))).ok();
        assert_eq!(seed(json!(18446744073709551615u64)), Some(u64::MAX));
        assert_eq!(seed(json!(42.0)), Some(42));
        assert_eq!(seed(json!(9007199254740992.0)), Some(1 << 53));
        assert_eq!(seed(json!(1e20)), None);
        assert_eq!(seed(json!(1.5)), None);
    }

    #[test]
    fn bad_fields_are_named() {
        let cases = [
            (json!({}), "prompt"),
            (json!({"prompt": 3}), "prompt"),
            (json!({"prompt": "x", "steps": "20"}), "steps"),
            (json!({"prompt": "x", "steps": 0}), "steps"),
            (json!({"prompt": "x", "steps": 2.5}), "steps"),
            (json!({"prompt": "x", "width": 100000}), "width"),
            (json!({"prompt": "x", "cfg_scale": "high"}), "cfg_scale"),
            (json!({"prompt": "x", "seed": -2}), "seed"),
            (json!({"prompt": "x", "seed": 1e20}), "seed"),
            (
                json!({"prompt": "x", "seed": 18446744073709551616.0}),
                "seed",
            ),
            (
                json!({"prompt": "x", "sampler_name": "nope"}),
                "sampler_name",
            ),
            (json!({"prompt": "x", "scheduler": "ays"}), "scheduler"),
            (
                json!({"prompt": "x", "batch_size": 8, "n_iter": 8}),
                "n_iter",
            ),
            (
                json!({"prompt": "x", "enable_hr": true, "hr_upscaler": "Latent (bicubic)"}),
                "hr_upscaler",
            ),
        ];
        for (body, field) in cases {
            let m = fields(body.clone());
            let Err(e) = gen_work(&Fields(&m), "txt2img", 20, &ServerOptions::new(5)) else {
                panic!("{body} was accepted")
            };
            assert_eq!(e.field.as_deref(), Some(field), "{body}: {e:?}");
            assert_eq!(e.status, StatusCode::UNPROCESSABLE_ENTITY);
        }
    }

    #[test]
    fn a1111_defaults_and_names() {
        let m = fields(
            json!({"prompt": "p", "sampler_name": "DPM++ 2M Karras", "seed": -1,
            "override_settings": {"CLIP_stop_at_last_layers": 2}, "steps": 20.0}),
        );
        let w = gen_work(&Fields(&m), "txt2img", 50, &ServerOptions::new(5)).unwrap();
        assert_eq!(w.sampler, Some(Sampler::DpmPp2m));
        assert_eq!(w.scheduler, Some(Scheduler::Karras));
        assert_eq!((w.steps, w.clip_skip, w.count), (20, 2, 1));
        assert!(w.seed < 1 << 32);
        let m = fields(json!({"prompt": "p"}));
        let w = gen_work(&Fields(&m), "txt2img", 50, &ServerOptions::new(5)).unwrap();
        assert_eq!((w.steps, w.cfg_scale), (50, None));
        // No sampler or schedule: the family's, once the model is known.
        assert_eq!((w.sampler, w.scheduler, w.width), (None, None, None));
    }

    #[test]
    fn base64_and_data_urls() {
        assert_eq!(decode_b64("f", "aGk=").unwrap(), b"hi");
        assert_eq!(decode_b64("f", "data:image/png;base64,aGk").unwrap(), b"hi");
        assert_eq!(
            decode_b64("f", "***").unwrap_err().field.as_deref(),
            Some("f")
        );
        let e = decode_image("init_images[0]", b"not an image").unwrap_err();
        assert_eq!(e.field.as_deref(), Some("init_images[0]"));
    }
}
