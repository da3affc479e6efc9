//! Engine configuration and its validation.

use serde::{Deserialize, Serialize};

use crate::profile::Profile;

/// What an instance does in disaggregated (prefill/decode split) serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Only prefills (`RequestMode::PrefillOnly`) and hands the KV cache off.
    Prefill,
    /// Only decodes requests whose KV cache arrives by transfer (`RequestMode::DecodeAfterTransfer`).
    Decode,
    /// A normal instance: accepts every request mode.
    #[default]
    Both,
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        })
    }
}

/// Everything that defines one engine instance (vLLM-like flags plus a step-time profile).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EngineConfig {
    /// Served model name (reported in metrics labels by drivers).
    pub model_name: String,
    /// Disaggregation role of this instance.
    pub role: Role,
    /// KV cache capacity in blocks.
    pub num_gpu_blocks: u32,
    /// Tokens per KV block (vLLM default 16).
    pub block_size: u32,
    /// Most sequences running at once (vLLM `--max-num-seqs`).
    pub max_num_seqs: u32,
    /// Token budget of one step (vLLM `--max-num-batched-tokens`).
    pub max_num_batched_tokens: u32,
    /// Longest prompt + output accepted (vLLM `--max-model-len`).
    pub max_model_len: u32,
    /// Whether full KV blocks are cached and reused across requests.
    pub enable_prefix_caching: bool,
    /// LoRA adapters resident at once (vLLM `--max-loras`); 0 disables LoRA.
    pub max_loras: u32,
    /// Time to load a non-resident adapter, seconds (blocks the GPU for that long).
    pub lora_load_time_s: f64,
    /// KV cache bytes per token (all layers, K and V), for transfer time.
    pub kv_bytes_per_token: f64,
    /// Bandwidth of the KV transfer link into this instance, bytes/s.
    pub kv_transfer_bandwidth_bytes_per_s: f64,
    /// Emit a `Tokens` event per generated token (the emulator); off in the simulator.
    pub emit_token_events: bool,
    /// Buffer KV cache events for `drain_kv_events`.
    pub emit_kv_events: bool,
    /// Step-time coefficients.
    pub profile: Profile,
    /// Identifier of this engine, reported as `remote_engine_id` in KV transfers.
    pub engine_id: String,
}

impl Default for EngineConfig {
    /// An 8B model on one H100 with vLLM V1's online-serving defaults.
    fn default() -> Self {
        Self {
            model_name: "meta-llama/Llama-3.1-8B-Instruct".to_string(),
            role: Role::Both,
            // ≈ 54 GB of KV at 2 MiB per 16-token block (128 KiB per token).
            num_gpu_blocks: 27_000,
            block_size: 16,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: 32_768,
            enable_prefix_caching: true,
            max_loras: 1,
            lora_load_time_s: 0.1,
            // Llama-3.1-8B: 2 (K,V) × 32 layers × 8 KV heads × 128 dims × 2 bytes.
            kv_bytes_per_token: 131_072.0,
            // ≈ 400 Gb/s RDMA.
            kv_transfer_bandwidth_bytes_per_s: 50e9,
            emit_token_events: false,
            emit_kv_events: false,
            profile: Profile::h100_llama8b(),
            engine_id: String::new(),
        }
    }
}

/// Why an engine configuration was rejected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// A count that must be at least one was zero.
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    /// The step budget cannot hold one token per running sequence.
    #[error("max_num_batched_tokens ({budget}) must be >= max_num_seqs ({seqs})")]
    BudgetBelowSeqs {
        /// The configured step budget.
        budget: u32,
        /// The configured sequence limit.
        seqs: u32,
    },
    /// A maximum-length request would not fit in the KV cache.
    #[error("max_model_len ({max_model_len}) exceeds KV cache capacity ({capacity} tokens)")]
    ModelLenExceedsCache {
        /// The configured maximum length.
        max_model_len: u32,
        /// num_gpu_blocks × block_size.
        capacity: u64,
    },
    /// A float setting is negative, NaN or infinite (or zero where it divides).
    #[error("{name} must be finite and {rule}, got {value}")]
    BadNumber {
        /// Which setting.
        name: &'static str,
        /// What it must be.
        rule: &'static str,
        /// What it was.
        value: f64,
    },
    /// The profile is invalid.
    #[error("invalid profile: {0}")]
    Profile(String),
}

impl EngineConfig {
    /// Check the configuration makes sense (what `Engine::new` enforces).
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (name, v) in [
            ("num_gpu_blocks", self.num_gpu_blocks),
            ("block_size", self.block_size),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_model_len", self.max_model_len),
        ] {
            if v == 0 {
                return Err(ConfigError::Zero(name));
            }
        }
        // vLLM refuses this too: otherwise running sequences could starve.
        if self.max_num_batched_tokens < self.max_num_seqs {
            return Err(ConfigError::BudgetBelowSeqs {
                budget: self.max_num_batched_tokens,
                seqs: self.max_num_seqs,
            });
        }
        let capacity = u64::from(self.num_gpu_blocks) * u64::from(self.block_size);
        if u64::from(self.max_model_len) > capacity {
            return Err(ConfigError::ModelLenExceedsCache {
                max_model_len: self.max_model_len,
                capacity,
            });
        }
        let nonneg = |name, value: f64| {
            if value.is_finite() && value >= 0.0 {
                Ok(())
            } else {
                Err(ConfigError::BadNumber {
                    name,
                    rule: ">= 0",
                    value,
                })
            }
        };
        let pos = |name, value: f64| {
            if value.is_finite() && value > 0.0 {
                Ok(())
            } else {
                Err(ConfigError::BadNumber {
                    name,
                    rule: "> 0",
                    value,
                })
            }
        };
        nonneg("lora_load_time_s", self.lora_load_time_s)?;
        nonneg("kv_bytes_per_token", self.kv_bytes_per_token)?;
        pos(
            "kv_transfer_bandwidth_bytes_per_s",
            self.kv_transfer_bandwidth_bytes_per_s,
        )?;
        self.profile
            .validate()
            .map_err(|e| ConfigError::Profile(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid() {
        EngineConfig::default().validate().unwrap();
    }

    #[test]
    fn rejects_nonsense() {
        let base = EngineConfig::default();
        let cases: Vec<(EngineConfig, &str)> = vec![
            (
                EngineConfig {
                    num_gpu_blocks: 0,
                    ..base.clone()
                },
                "num_gpu_blocks",
            ),
            (
                EngineConfig {
                    block_size: 0,
                    ..base.clone()
                },
                "block_size",
            ),
            (
                EngineConfig {
                    max_num_batched_tokens: 0,
                    ..base.clone()
                },
                "max_num_batched_tokens",
            ),
            (
                EngineConfig {
                    max_num_batched_tokens: 100,
                    max_num_seqs: 200,
                    ..base.clone()
                },
                "max_num_seqs",
            ),
            (
                EngineConfig {
                    num_gpu_blocks: 10,
                    ..base.clone()
                },
                "capacity",
            ),
            (
                EngineConfig {
                    kv_transfer_bandwidth_bytes_per_s: 0.0,
                    ..base.clone()
                },
                "bandwidth",
            ),
            (
                EngineConfig {
                    lora_load_time_s: f64::NAN,
                    ..base.clone()
                },
                "lora_load_time_s",
            ),
            (
                EngineConfig {
                    profile: Profile {
                        step_base_s: 0.0,
                        ..Profile::default()
                    },
                    ..base.clone()
                },
                "step_base_s",
            ),
        ];
        for (cfg, what) in cases {
            let err = cfg.validate().unwrap_err().to_string();
            assert!(err.contains(what), "{err} should mention {what}");
        }
    }

    #[test]
    fn role_serde_is_lowercase() {
        assert_eq!(
            serde_json::to_string(&Role::Prefill).unwrap(),
            "\"prefill\""
        );
        let r: Role = serde_json::from_str("\"decode\"").unwrap();
        assert_eq!(r, Role::Decode);
    }

    #[test]
    fn config_round_trips_json_with_defaults() {
        let c: EngineConfig = serde_json::from_str(r#"{"role":"prefill","max_loras":4}"#).unwrap();
        assert_eq!(c.role, Role::Prefill);
        assert_eq!(c.max_loras, 4);
        assert_eq!(c.block_size, 16);
        let back: EngineConfig = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
    }
}
