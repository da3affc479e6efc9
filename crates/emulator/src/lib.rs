//! The engine emulator: the `switchyard_engine` model behind an HTTP server
//! that speaks vLLM's OpenAI-compatible API (and the SGLang endpoints
//! sglang-router needs) in scaled real time, so gateways and other routers
//! can run against it unchanged.
//!
//! * Time: one thread owns the engine ([`runner`]); virtual time runs
//!   `speed` times faster than the wall clock. Every time in `/metrics` is
//!   virtual. `--instant` bypasses the engine's timing entirely.
//! * Endpoints: `POST /v1/completions`, `POST /v1/chat/completions`
//!   ([`generate`]); `GET /v1/models`, `GET /health`, `GET /metrics`,
//!   `POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`,
//!   `POST /tokenize`, `POST /detokenize`, `POST /v1/completions/render`,
//!   `POST /v1/chat/completions/render` ([`info`]); `GET /health_generate`,
//!   `/get_server_info`, `/server_info`, `/get_model_info`, `/get_load`
//!   ([`sglang`]).
//! * Chat prompts are rendered by the fixed template in [`chat_template`]
//!   and tokenized with `switchyard_engine::tokenizer`.
//! * Disaggregation (vLLM NixlConnector params, SGLang bootstrap fields):
//!   [`pd`]. KV events over ZeroMQ in vLLM's format: [`kv_events`].
//! * Errors: vLLM's `{"error": {...}}` shape ([`error`]).
//! * [`fidelity`] measures the emulator through HTTP against the model.
#![warn(missing_docs)]

pub mod chat_template;
pub mod error;
pub mod fidelity;
pub mod generate;
pub mod info;
pub mod kv_events;
pub mod metrics;
pub mod openai;
pub mod pd;
pub mod runner;
pub mod server;
pub mod sglang;
pub mod sse;
pub mod state;
pub mod tokenizer_json;

pub use server::{start, EmulatorConfig, RunningServer, ServerError};

/// The engine model crate, re-exported so drivers need one dependency.
pub use switchyard_engine as engine;

/// Run `fut` to completion on a fresh multi-threaded tokio runtime.
pub fn block_on<F: std::future::Future>(fut: F) -> std::io::Result<F::Output> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    Ok(rt.block_on(fut))
}

/// Install SIGINT (Ctrl-C) and SIGTERM handlers now and return a future that
/// resolves when either arrives.
///
/// Registration happens before this returns, so a signal sent right after
/// (e.g. by a test that just read the address line) is not lost to the
/// default handler. Must be called inside a tokio runtime.
pub fn shutdown_signal() -> std::io::Result<impl std::future::Future<Output = ()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut int = signal(SignalKind::interrupt())?;
        let mut term = signal(SignalKind::terminate())?;
        Ok(async move {
            tokio::select! {
                _ = int.recv() => {},
                _ = term.recv() => {},
            }
        })
    }
    #[cfg(not(unix))]
    {
        Ok(async {
            let _ = tokio::signal::ctrl_c().await;
        })
    }
}
