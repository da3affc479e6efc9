//! Router settings: every knob has a documented default and is checked by [`RouterConfig::validate`].

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The values the `policy` setting accepts (`policy::by_name` builds each), the default first.
pub const POLICY_NAMES: &[&str] = &[
    "cost",
    "round-robin",
    "random",
    "least-load",
    "power-of-two",
    "sglang-cache-aware",
    "dynamo-kv",
    "gie",
    "gie-lora",
    "kubeai-chwbl",
];

/// A setting out of its range.
#[derive(Debug, Error, PartialEq)]
#[error("invalid router setting `{key}`: {reason}")]
pub struct ConfigError {
    /// Dotted key of the setting.
    pub key: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

/// All router settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouterConfig {
    /// Policy name (one of [`POLICY_NAMES`]).
    pub policy: String,
    /// Seed of the router's random choices (tie-breaks, sampling baselines).
    pub seed: u64,
    /// How many eligible candidates a decision ranks in order (the retry list).
    pub ranked_candidates: usize,
    /// In-flight requests not heard of for this long are forgotten (bounds memory if a caller
    /// never reports an end), in seconds.
    pub in_flight_ttl_s: f64,
    /// Approximate prefix index.
    pub index: IndexConfig,
    /// Priors and learning of speeds.
    pub estimates: EstimateConfig,
    /// The `cost` policy.
    pub cost: CostConfig,
    /// The `sglang-cache-aware` baseline.
    pub sglang: SglangConfig,
    /// The `dynamo-kv` baseline.
    pub dynamo: DynamoConfig,
    /// The `gie` baseline.
    pub gie: GieConfig,
    /// The `kubeai-chwbl` baseline.
    pub kubeai: KubeAiConfig,
    /// Dynamic LoRA adapter placement (the gateway's `--dynamic-lora-placement`).
    pub placement: PlacementConfig,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            policy: "cost".into(),
            seed: 0x5157_17c4,
            ranked_candidates: 8,
            in_flight_ttl_s: 3600.0,
            index: IndexConfig::default(),
            estimates: EstimateConfig::default(),
            cost: CostConfig::default(),
            sglang: SglangConfig::default(),
            dynamo: DynamoConfig::default(),
            gie: GieConfig::default(),
            kubeai: KubeAiConfig::default(),
            placement: PlacementConfig::default(),
        }
    }
}

/// Approximate prefix index settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IndexConfig {
    /// Bytes of rendered prompt per index block (256 ≈ 64 tokens).
    pub block_bytes: usize,
    /// Blocks an instance may hold when its KV capacity is unknown.
    pub default_capacity_blocks: u32,
    /// Ignore engine-reported cached tokens (no feedback correction).
    pub disable_feedback: bool,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            block_bytes: 256,
            default_capacity_blocks: 8192,
            disable_feedback: false,
        }
    }
}

/// Priors for learned quantities and how fast they are learned.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EstimateConfig {
    /// Prior prefill throughput in tokens/s (an 8B model on one H100 does about 45k at best;
    /// the effective rate with batching and queueing is lower).
    pub prefill_tokens_per_s: f64,
    /// Prior bytes of prompt text per token.
    pub bytes_per_token: f64,
    /// Prior request service time in seconds.
    pub service_time_s: f64,
    /// Weight of a new sample in the moving averages (0..1].
    pub learning_rate: f64,
    /// Fixed part of every TTFT (scheduling, one step) in seconds, removed before learning
    /// speed; also the price of a prefill/decode hand-off's second engine.
    pub ttft_overhead_s: f64,
    /// Engine metrics older than this are unknown, in seconds.
    pub metrics_stale_after_s: f64,
    /// Work in tokens below which a TTFT sample says too little about speed to learn from.
    pub min_sample_tokens: u64,
    /// Time window over which an instance's share of time with every sequence slot taken is
    /// averaged, in seconds.
    pub slot_pressure_window_s: f64,
}

impl Default for EstimateConfig {
    fn default() -> Self {
        EstimateConfig {
            prefill_tokens_per_s: 20_000.0,
            bytes_per_token: 4.0,
            service_time_s: 10.0,
            learning_rate: 0.1,
            ttft_overhead_s: 0.01,
            metrics_stale_after_s: 5.0,
            min_sample_tokens: 512,
            slot_pressure_window_s: 30.0,
        }
    }
}

/// The `cost` policy: estimated TTFT plus guards.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CostConfig {
    /// Candidates within this fraction of the best cost are tied and picked at random.
    pub tie_relative: f64,
    /// Candidates within this many seconds of the best cost are tied and picked at random.
    pub tie_absolute_s: f64,
    /// Weight of the delay a prefill inflicts on each sequence decoding on the same instance
    /// (a decode instance running a prompt whole is charged in full, whatever this says).
    pub decode_interference_weight: f64,
    /// KV usage above which a new request risks preemption.
    pub kv_high_watermark: f64,
    /// Cost in seconds of projecting the KV cache to 100 % full.
    pub kv_pressure_s: f64,
    /// Time to load an adapter that is not resident, in seconds.
    pub adapter_load_s: f64,
    /// Seconds charged for evicting a resident adapter to make room (it may be needed again).
    pub adapter_eviction_s: f64,
    /// Extra seconds an adapter swap must save over an instance already holding the adapter.
    pub adapter_switch_margin_s: f64,
    /// After the router caused an adapter load on an instance, no other swap there for this long.
    pub adapter_cooldown_s: f64,
    /// Per token, seconds to move KV from a prefill to a decode instance.
    pub kv_transfer_s_per_token: f64,
    /// Selective disaggregation: a request whose uncached prompt on a decode instance is at most
    /// this many tokens may run whole there when that is cheaper than the hand-off (0: always
    /// hand off).
    pub local_prefill_max_tokens: u32,
    /// Pools larger than twice this are scored on a shortlist: the instances holding a prefix of
    /// the prompt plus this many least loaded of each role (0: score every instance).
    pub shortlist_len: usize,
    /// Weight of the delay a prefill inflicts on each request queued on the same instance
    /// beyond the first (work added to a backlog delays everyone who joins it).
    pub queue_interference_weight: f64,
    /// Weight of the cache room a candidate would spend storing again a prefix another
    /// candidate already holds, priced by the instance's learned hit share (0: not priced).
    pub cache_room_weight: f64,
    /// The same weight where the copy would be of one conversation's own history (a prefix no
    /// other prompt continues): raise it where placement hardly changes first tokens (a small
    /// model on shared CPUs) to keep conversations with their caches; shared prefixes still
    /// spread at `cache_room_weight`.
    pub history_room_weight: f64,
    /// Price the prefill a candidate adds beyond the cheapest candidate's (what a cache hit
    /// saves) at what an estimated second of prefill has been worth in observed first tokens,
    /// learned ([`crate::calibration`]); false (the default): at face value.
    pub calibrate_prefill: bool,
    /// Engine-reported waiting requests at or above which an instance is saturated (none: never).
    pub max_waiting: Option<u32>,
    /// Router-side in-flight requests at or above which an instance is saturated (none: never).
    pub max_in_flight: Option<u32>,
}

impl Default for CostConfig {
    fn default() -> Self {
        CostConfig {
            tie_relative: 0.02,
            tie_absolute_s: 0.002,
            // 0.03, not 0.01: under decode-bound load a cache miss stalls the whole running
            // batch, and at 0.01 that barely registered (see docs/results.md, simulator runs).
            decode_interference_weight: 0.03,
            kv_high_watermark: 0.92,
            kv_pressure_s: 2.0,
            adapter_load_s: 0.5,
            adapter_eviction_s: 0.25,
            adapter_switch_margin_s: 0.25,
            adapter_cooldown_s: 10.0,
            // 128 KiB of KV per token (Llama-3-8B in fp16) over about 25 GB/s.
            kv_transfer_s_per_token: 5.2e-6,
            // Swept on the Mooncake trace over 4p4d (docs/results.md): 8192 gave the best TTFT
            // with decode ITL unchanged; 16384 started to hurt ITL.
            local_prefill_max_tokens: 8192,
            shortlist_len: 64,
            queue_interference_weight: 1.0,
            cache_room_weight: 1.0,
            history_room_weight: 1.0,
            calibrate_prefill: false,
            max_waiting: None,
            max_in_flight: None,
        }
    }
}

/// SGLang router `cache_aware` defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SglangConfig {
    /// Minimum matched share of the prompt to follow the cache.
    pub cache_threshold: f64,
    /// Load difference (requests) above which the fleet may be imbalanced.
    pub balance_abs_threshold: u32,
    /// Load ratio above which the fleet may be imbalanced.
    pub balance_rel_threshold: f64,
    /// Characters of routed prompts remembered per worker (its tree size limit).
    pub max_tree_chars: u64,
    /// Granularity of the approximate tree in characters.
    pub block_chars: usize,
}

impl Default for SglangConfig {
    fn default() -> Self {
        SglangConfig {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            max_tree_chars: 1 << 24,
            block_chars: 16,
        }
    }
}

/// Dynamo KV router defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DynamoConfig {
    /// Weight of prefill blocks against decode blocks.
    pub overlap_score_weight: f64,
    /// KV block size in tokens.
    pub block_tokens: u32,
}

impl Default for DynamoConfig {
    fn default() -> Self {
        DynamoConfig {
            overlap_score_weight: 1.0,
            block_tokens: 16,
        }
    }
}

/// Gateway API Inference Extension default scorer weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GieConfig {
    /// Weight of the queue scorer.
    pub queue_weight: f64,
    /// Weight of the KV-cache utilisation scorer.
    pub kv_cache_weight: f64,
    /// Weight of the prefix-cache scorer.
    pub prefix_weight: f64,
    /// Prefix block size in characters.
    pub block_chars: usize,
    /// Prefix blocks remembered per server.
    pub lru_capacity_per_server: u32,
    /// Weight of the LoRA affinity scorer (`gie-lora` only).
    pub lora_affinity_weight: f64,
}

impl Default for GieConfig {
    fn default() -> Self {
        GieConfig {
            queue_weight: 2.0,
            kv_cache_weight: 2.0,
            prefix_weight: 3.0,
            block_chars: 64,
            lru_capacity_per_server: 31_250,
            lora_affinity_weight: 1.0,
        }
    }
}

/// KubeAI prefix-hash (consistent hashing with bounded loads) defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KubeAiConfig {
    /// Characters of the prompt that form the hash key.
    pub prefix_chars: usize,
    /// Load bound as a multiple of the mean load.
    pub load_factor: f64,
    /// Virtual nodes per instance on the ring.
    pub replicas: u32,
}

impl Default for KubeAiConfig {
    fn default() -> Self {
        KubeAiConfig {
            prefix_chars: 100,
            load_factor: 1.25,
            replicas: 256,
        }
    }
}

/// Dynamic LoRA adapter placement (the `placement` module): when a hot adapter gets another
/// instance and a cold copy is unloaded, with hysteresis and per-instance cooldowns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PlacementConfig {
    /// Whether the gateway plans and executes placements.
    pub enabled: bool,
    /// Seconds between two plans.
    pub interval_s: f64,
    /// Half-life in seconds of the decayed per-adapter request rate (the demand).
    pub half_life_s: f64,
    /// Demand per holding instance (requests/s) above which an adapter gets one more instance.
    pub scale_up_rps: f64,
    /// Demand per holding instance, counted with one holder fewer, below which a copy is
    /// unloaded; below `scale_up_rps` (the hysteresis band).
    pub scale_down_rps: f64,
    /// Seconds after a load or unload on an instance before it is changed again.
    pub cooldown_s: f64,
    /// Seconds an adapter stays on an instance before that copy may be unloaded.
    pub min_residency_s: f64,
    /// Most load/unload actions in one plan.
    pub max_actions: u32,
    /// A copy is evicted to make room only if its demand per holder is at most this many times
    /// smaller than the newcomer's.
    pub eviction_ratio: f64,
}

impl Default for PlacementConfig {
    fn default() -> Self {
        PlacementConfig {
            enabled: false,
            interval_s: 1.0,
            half_life_s: 60.0,
            scale_up_rps: 4.0,
            scale_down_rps: 1.0,
            cooldown_s: 120.0,
            min_residency_s: 300.0,
            max_actions: 2,
            eviction_ratio: 4.0,
        }
    }
}

impl PlacementConfig {
    /// Checks the placement settings' ranges.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let finite_pos = |x: f64| x.is_finite() && x > 0.0;
        let finite_nonneg = |x: f64| x.is_finite() && x >= 0.0;
        check(
            finite_pos(self.interval_s),
            "placement.interval_s",
            "must be > 0",
        )?;
        check(
            finite_pos(self.half_life_s),
            "placement.half_life_s",
            "must be > 0",
        )?;
        check(
            finite_pos(self.scale_up_rps),
            "placement.scale_up_rps",
            "must be > 0",
        )?;
        check(
            finite_nonneg(self.scale_down_rps) && self.scale_down_rps < self.scale_up_rps,
            "placement.scale_down_rps",
            "must be >= 0 and below placement.scale_up_rps",
        )?;
        check(
            finite_nonneg(self.cooldown_s),
            "placement.cooldown_s",
            "must be >= 0",
        )?;
        check(
            finite_nonneg(self.min_residency_s),
            "placement.min_residency_s",
            "must be >= 0",
        )?;
        check(
            self.max_actions >= 1,
            "placement.max_actions",
            "must be at least 1",
        )?;
        check(
            self.eviction_ratio.is_finite() && self.eviction_ratio >= 1.0,
            "placement.eviction_ratio",
            "must be >= 1",
        )
    }
}

fn check(ok: bool, key: &'static str, reason: &str) -> Result<(), ConfigError> {
    if ok {
        Ok(())
    } else {
        Err(ConfigError {
            key,
            reason: reason.to_string(),
        })
    }
}

impl RouterConfig {
    /// Checks every setting's range; the router refuses a config that fails.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let finite_pos = |x: f64| x.is_finite() && x > 0.0;
        let finite_nonneg = |x: f64| x.is_finite() && x >= 0.0;
        check(
            POLICY_NAMES.contains(&self.policy.as_str()),
            "policy",
            &format!("unknown policy; choose one of {}", POLICY_NAMES.join(", ")),
        )?;
        check(
            self.ranked_candidates >= 1,
            "ranked_candidates",
            "must be at least 1",
        )?;
        check(
            finite_pos(self.in_flight_ttl_s),
            "in_flight_ttl_s",
            "must be > 0",
        )?;
        check(
            (1..=crate::prefix::hash::MAX_BLOCK_BYTES).contains(&self.index.block_bytes),
            "index.block_bytes",
            "must be 1..=4096",
        )?;
        let e = &self.estimates;
        check(
            finite_pos(e.prefill_tokens_per_s),
            "estimates.prefill_tokens_per_s",
            "must be > 0",
        )?;
        check(
            finite_pos(e.bytes_per_token),
            "estimates.bytes_per_token",
            "must be > 0",
        )?;
        check(
            finite_pos(e.service_time_s),
            "estimates.service_time_s",
            "must be > 0",
        )?;
        check(
            finite_pos(e.slot_pressure_window_s),
            "estimates.slot_pressure_window_s",
            "must be > 0",
        )?;
        check(
            e.learning_rate > 0.0 && e.learning_rate <= 1.0,
            "estimates.learning_rate",
            "must be in (0, 1]",
        )?;
        check(
            finite_nonneg(e.ttft_overhead_s),
            "estimates.ttft_overhead_s",
            "must be >= 0",
        )?;
        check(
            finite_pos(e.metrics_stale_after_s),
            "estimates.metrics_stale_after_s",
            "must be > 0",
        )?;
        let c = &self.cost;
        check(
            finite_nonneg(c.tie_relative),
            "cost.tie_relative",
            "must be >= 0",
        )?;
        check(
            finite_nonneg(c.tie_absolute_s),
            "cost.tie_absolute_s",
            "must be >= 0",
        )?;
        check(
            finite_nonneg(c.decode_interference_weight),
            "cost.decode_interference_weight",
            "must be >= 0",
        )?;
        check(
            finite_nonneg(c.queue_interference_weight),
            "cost.queue_interference_weight",
            "must be >= 0",
        )?;
        check(
            finite_nonneg(c.cache_room_weight),
            "cost.cache_room_weight",
            "must be >= 0",
        )?;
        check(
            finite_nonneg(c.history_room_weight),
            "cost.history_room_weight",
            "must be >= 0",
        )?;
        check(
            c.kv_high_watermark > 0.0 && c.kv_high_watermark < 1.0,
            "cost.kv_high_watermark",
            "must be in (0, 1)",
        )?;
        check(
            finite_nonneg(c.kv_pressure_s),
            "cost.kv_pressure_s",
            "must be >= 0",
        )?;
        check(
            finite_nonneg(c.adapter_load_s),
            "cost.adapter_load_s",
            "must be >= 0",
        )?;
        check(
            finite_nonneg(c.adapter_eviction_s),
            "cost.adapter_eviction_s",
            "must be >= 0",
        )?;
        check(
            finite_nonneg(c.adapter_switch_margin_s),
            "cost.adapter_switch_margin_s",
            "must be >= 0",
        )?;
        check(
            finite_nonneg(c.adapter_cooldown_s),
            "cost.adapter_cooldown_s",
            "must be >= 0",
        )?;
        check(
            finite_nonneg(c.kv_transfer_s_per_token),
            "cost.kv_transfer_s_per_token",
            "must be >= 0",
        )?;
        check(
            (0.0..=1.0).contains(&self.sglang.cache_threshold),
            "sglang.cache_threshold",
            "must be in [0, 1]",
        )?;
        check(
            finite_nonneg(self.sglang.balance_rel_threshold),
            "sglang.balance_rel_threshold",
            "must be >= 0",
        )?;
        check(
            (1..=crate::prefix::hash::MAX_BLOCK_BYTES).contains(&self.sglang.block_chars),
            "sglang.block_chars",
            "must be 1..=4096",
        )?;
        check(
            self.dynamo.block_tokens >= 1,
            "dynamo.block_tokens",
            "must be at least 1",
        )?;
        check(
            finite_nonneg(self.dynamo.overlap_score_weight),
            "dynamo.overlap_score_weight",
            "must be >= 0",
        )?;
        check(
            (1..=crate::prefix::hash::MAX_BLOCK_BYTES).contains(&self.gie.block_chars),
            "gie.block_chars",
            "must be 1..=4096",
        )?;
        check(
            finite_nonneg(self.gie.lora_affinity_weight),
            "gie.lora_affinity_weight",
            "must be >= 0",
        )?;
        check(
            self.kubeai.replicas >= 1,
            "kubeai.replicas",
            "must be at least 1",
        )?;
        check(
            self.kubeai.load_factor >= 1.0,
            "kubeai.load_factor",
            "must be >= 1",
        )?;
        self.placement.validate()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_round_trip_through_json() {
        let config = RouterConfig::default();
        config.validate().unwrap();
        let json = serde_json::to_string(&config).unwrap();
        let back: RouterConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(back, config);
    }

    #[test]
    fn unknown_keys_and_bad_values_are_refused() {
        assert!(serde_json::from_str::<RouterConfig>(r#"{"polcy": "cost"}"#).is_err());
        let mut config = RouterConfig {
            policy: "nope".into(),
            ..Default::default()
        };
        assert_eq!(config.validate().unwrap_err().key, "policy");
        config.policy = "cost".into();
        config.estimates.learning_rate = 0.0;
        assert_eq!(
            config.validate().unwrap_err().key,
            "estimates.learning_rate"
        );
        config.estimates.learning_rate = 0.1;
        config.cost.kv_high_watermark = 1.0;
        assert_eq!(config.validate().unwrap_err().key, "cost.kv_high_watermark");
    }

    /// Every key of the default config, dotted (`cost.adapter_load_s`).
    fn keys(value: &serde_json::Value, prefix: &str, out: &mut Vec<String>) {
        if let serde_json::Value::Object(map) = value {
            for (k, v) in map {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                if v.is_object() {
                    keys(v, &key, out);
                } else {
                    out.push(key);
                }
            }
        }
    }

    #[test]
    fn every_config_key_is_documented() {
        let doc = include_str!("../../../docs/core.md");
        let mut all = Vec::new();
        keys(
            &serde_json::to_value(RouterConfig::default()).unwrap(),
            "",
            &mut all,
        );
        assert!(all.len() > 30);
        for key in all {
            assert!(
                doc.contains(&format!("| `{key}` |")),
                "docs/core.md does not document `{key}`"
            );
        }
    }

    #[test]
    fn partial_json_keeps_defaults_for_the_rest() {
        let config: RouterConfig =
            serde_json::from_str(r#"{"policy": "round-robin", "cost": {"adapter_load_s": 1.5}}"#)
                .unwrap();
        assert_eq!(config.policy, "round-robin");
        assert_eq!(config.cost.adapter_load_s, 1.5);
        assert_eq!(config.cost.tie_relative, CostConfig::default().tie_relative);
    }
}
