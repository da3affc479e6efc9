//! The SGLang endpoints sglang-router uses to accept and watch a worker.
//!
//! sglang-router (sgl-project/sglang, sgl-router/src/core/workflow/steps/
//! worker_registration.rs) probes `GET /health`, then reads
//! `GET /get_server_info` into a struct with optional `model_id`/`model`,
//! `model_path`, `dp_size`, `version`, `max_batch_size`, `max_total_tokens`,
//! `max_prefill_tokens`, `max_running_requests`, `max_num_reqs`; the load
//! monitor polls `GET /get_load`. All fields below are filled from the
//! engine configuration and a live metrics snapshot.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use switchyard_engine::Role;

use crate::error::ApiError;
use crate::state::SharedState;

/// `GET /health_generate`: SGLang runs a one-token generation; the emulator's
/// engine task answering a metrics query is the equivalent liveness proof.
pub async fn health_generate(State(state): State<SharedState>) -> Response {
    match state.engine.metrics().await {
        Ok(_) => StatusCode::OK.into_response(),
        Err(_) => ApiError::unavailable("The engine is shutting down.").into_response(),
    }
}

fn disaggregation_mode(role: Role) -> &'static str {
    match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
        Role::Both => "null",
    }
}

/// `GET /get_server_info` and `/server_info`.
pub async fn server_info(State(state): State<SharedState>) -> Response {
    let c = &state.engine_cfg;
    let max_total_tokens = u64::from(c.num_gpu_blocks) * u64::from(c.block_size);
    axum::Json(json!({
        "model_path": state.model,
        "model": state.model,
        "served_model_name": state.model,
        "tokenizer_path": state.model,
        "dp_size": 1,
        "tp_size": 1,
        "version": concat!("switchyard-emulator-", env!("CARGO_PKG_VERSION")),
        "max_total_num_tokens": max_total_tokens,
        "max_total_tokens": max_total_tokens,
        "max_prefill_tokens": c.max_num_batched_tokens,
        "chunked_prefill_size": c.max_num_batched_tokens,
        "max_running_requests": c.max_num_seqs,
        "max_batch_size": c.max_num_seqs,
        "max_num_reqs": c.max_num_seqs,
        "context_length": c.max_model_len,
        "page_size": c.block_size,
        "disaggregation_mode": disaggregation_mode(c.role),
        "enable_lora": c.max_loras > 0,
        "max_loras_per_batch": c.max_loras,
        "internal_states": [{
            "last_gen_throughput": 0.0,
        }],
    }))
    .into_response()
}

/// `GET /get_model_info` and `/model_info`.
pub async fn model_info(State(state): State<SharedState>) -> Response {
    axum::Json(json!({
        "model_path": state.model,
        "tokenizer_path": state.model,
        "is_generation": true,
        "preferred_sampling_params": null,
        "weight_version": "default",
        "has_image_understanding": false,
        "has_audio_understanding": false,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
    }))
    .into_response()
}

/// `GET /get_load`: the current load. `load` (running + waiting requests)
/// is what older sglang-router versions read; the per-rank fields match
/// SGLang's `GetLoadReqOutput`.
pub async fn get_load(State(state): State<SharedState>) -> Response {
    match state.engine.metrics().await {
        Ok(m) => {
            let used_tokens =
                (m.kv_cache_usage * f64::from(m.num_gpu_blocks) * f64::from(m.block_size)) as u64;
            axum::Json(json!({
                "load": m.num_requests_running + m.num_requests_waiting,
                "dp_rank": 0,
                "num_reqs": m.num_requests_running + m.num_requests_waiting,
                "num_running_reqs": m.num_requests_running,
                "num_waiting_reqs": m.num_requests_waiting,
                "num_tokens": used_tokens,
            }))
            .into_response()
        }
        Err(_) => ApiError::unavailable("The engine is shutting down.").into_response(),
    }
}
