//! A metrics snapshot with vLLM V1 semantics.

use serde::{Deserialize, Serialize};

/// Engine state and counters at one moment, as vLLM exposes on `/metrics`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct EngineMetrics {
    /// Requests in the running batch (`vllm:num_requests_running`).
    pub num_requests_running: u32,
    /// Requests queued, including those waiting for an adapter or a KV transfer (`vllm:num_requests_waiting`).
    pub num_requests_waiting: u32,
    /// Fraction of KV blocks held by requests; cached-but-free blocks count as free (`vllm:kv_cache_usage_perc`).
    pub kv_cache_usage: f64,
    /// Prompt tokens looked up in the prefix cache (`vllm:prefix_cache_queries`).
    pub prefix_cache_queries: u64,
    /// Of those, tokens found cached (`vllm:prefix_cache_hits`).
    pub prefix_cache_hits: u64,
    /// Preemptions so far (`vllm:num_preemptions`).
    pub num_preemptions: u64,
    /// Prompt tokens of requests that got their first token (`vllm:prompt_tokens`).
    pub prompt_tokens_total: u64,
    /// Output tokens sampled (`vllm:generation_tokens`).
    pub generation_tokens_total: u64,
    /// Adapters used by running requests (sorted).
    pub running_lora_adapters: Vec<String>,
    /// Adapters wanted by waiting requests (sorted).
    pub waiting_lora_adapters: Vec<String>,
    /// Adapters currently loaded in a slot (sorted).
    pub resident_lora_adapters: Vec<String>,
    /// Adapter slots.
    pub max_loras: u32,
    /// KV cache capacity in blocks.
    pub num_gpu_blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
}
