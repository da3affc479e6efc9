//! What to simulate: the fleet, the router replicas, the observation model.

use serde::{Deserialize, Serialize};
use switchyard_core::RouterConfig;
use switchyard_engine::{EngineConfig, Role};

use crate::error::{Result, SimError};

/// Longest prompt + output the simulator's engines accept by default: the trace has prompts of
/// over 100k tokens, and Llama-3.1-8B serves 128k.
pub const DEFAULT_MAX_MODEL_LEN: u32 = 131_072;

/// How requests are divided among router replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Split {
    /// Request `i` goes to replica `i mod R` (a round-robin L4 balancer in front).
    #[default]
    RoundRobin,
    /// Each request goes to a replica drawn uniformly at random (seeded).
    Random,
}

impl std::str::FromStr for Split {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "round-robin" | "rr" => Ok(Split::RoundRobin),
            "random" => Ok(Split::Random),
            _ => Err(format!("unknown split `{s}` (round-robin or random)")),
        }
    }
}

/// `count` identical instances.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InstanceGroup {
    /// How many instances of this kind.
    pub count: u32,
    /// Their engine configuration (role, profile, KV blocks, slots...); missing fields default.
    #[serde(default)]
    pub engine: EngineConfig,
}

/// A fleet file: groups of instances, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetFile {
    /// The groups; instance names are `e0`, `e1`, ... in this order.
    pub groups: Vec<InstanceGroup>,
}

impl FleetFile {
    /// Parses a fleet file from JSON text.
    pub fn from_json_str(text: &str) -> Result<FleetFile> {
        serde_json::from_str(text).map_err(|e| SimError::Fleet(e.to_string()))
    }
}

/// The engine configuration the simulator uses unless told otherwise: the engine model's
/// defaults with a 128k context limit.
pub fn default_engine() -> EngineConfig {
    EngineConfig {
        max_model_len: DEFAULT_MAX_MODEL_LEN,
        ..EngineConfig::default()
    }
}

/// Parses a role split such as `4p4d` (4 prefill, 4 decode) or `2p6d2b` (b: both roles).
pub fn parse_roles(text: &str) -> Result<Vec<(u32, Role)>> {
    let bad = || SimError::Setting {
        key: "roles",
        reason: format!("`{text}` is not like 4p4d (counts followed by p, d or b)"),
    };
    let mut out = Vec::new();
    let mut digits = String::new();
    for c in text.chars() {
        if c.is_ascii_digit() {
            digits.push(c);
            continue;
        }
        let role = match c {
            'p' | 'P' => Role::Prefill,
            'd' | 'D' => Role::Decode,
            'b' | 'B' => Role::Both,
            _ => return Err(bad()),
        };
        let count: u32 = digits.parse().map_err(|_| bad())?;
        digits.clear();
        if count > 0 {
            out.push((count, role));
        }
    }
    if !digits.is_empty() || out.is_empty() {
        return Err(bad());
    }
    Ok(out)
}

/// Groups for a role split over one engine template.
pub fn groups_for_roles(roles: &[(u32, Role)], template: &EngineConfig) -> Vec<InstanceGroup> {
    roles
        .iter()
        .map(|&(count, role)| InstanceGroup {
            count,
            engine: EngineConfig {
                role,
                ..template.clone()
            },
        })
        .collect()
}

/// Engines publish KV-cache events (vLLM's `BlockStored` / `BlockRemoved`) to every router
/// replica, which then matches token prompts exactly (`switchyard_core::exact`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvEventsSim {
    /// Seconds from the step that stored or evicted blocks to a replica applying its batch.
    pub delay_s: f64,
    /// Share of batches lost on the way to each replica (each replica independently).
    pub loss: f64,
    /// A replica that sees a sequence gap falls back to the approximate index for that engine
    /// until its stream has run `probation_s` without one (what the gateway does); off: it
    /// applies what arrives and routes on a view it does not know is broken.
    pub fallback: bool,
    /// Seconds without trouble before a fallen-back stream is trusted again.
    pub probation_s: f64,
}

impl Default for KvEventsSim {
    fn default() -> Self {
        KvEventsSim {
            delay_s: 0.005,
            loss: 0.0,
            fallback: true,
            probation_s: 5.0,
        }
    }
}

/// Everything about a simulation except the workload and the policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SimConfig {
    /// The instances.
    pub fleet: Vec<InstanceGroup>,
    /// Router settings; `policy` is replaced by each policy simulated.
    pub router: RouterConfig,
    /// Router replicas, each its own `Router` seeing only its share of the traffic.
    pub replicas: u32,
    /// How requests are divided among replicas.
    pub split: Split,
    /// Replicas tell each other every decision and its outcome at once (first token, end): each
    /// then counts the others' in-flight requests as its own. The upper bound of what sharing
    /// decisions between replicas recovers (`serve --peer` is that channel, with a network's
    /// delay: model it with `replica_sync_delay_s`).
    pub replica_sync: bool,
    /// With `replica_sync`: seconds from a replica's decision (or outcome) to the others
    /// applying it.
    pub replica_sync_delay_s: f64,
    /// Seconds between metrics scrapes of an instance (each instance has its own phase).
    pub scrape_interval_s: f64,
    /// Seed of the workload, the replica split and the routers.
    pub seed: u64,
    /// TTFT service-level objective for goodput, seconds.
    pub ttft_slo_s: f64,
    /// Give the router each instance's prefill speed from its profile as the prior (what an
    /// operator who benchmarked the hardware would configure) instead of the router-wide prior.
    pub prior_from_profile: bool,
    /// Instances whose queue is recorded over time (the first ones), for the queue chart.
    pub queue_chart_instances: usize,
    /// Compute the lower-bound row.
    pub lower_bound: bool,
    /// Model name the fleet serves; `None`: the model of the workload's first request.
    pub model: Option<String>,
    /// Engines publish KV events to the routers (`None`: they do not).
    pub kv_events: Option<KvEventsSim>,
    /// The `max_tokens` the routers are told for every request, while the engines still
    /// generate the workload's answer lengths: clients that send one generous limit (or none,
    /// and the gateway assumes its default) and models that stop by themselves. `None`: the
    /// routers are told each answer's exact length, which no real client knows.
    pub client_max_tokens: Option<u32>,
    /// The engines share this many cores (`None`: each has a device of its own). While more
    /// engines than that have requests, each step takes busy engines ÷ cores times its profile
    /// time: several llama.cpp servers on one machine slow each other down, so an idle
    /// instance is not as fast as it is alone.
    pub shared_cores: Option<f64>,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            fleet: vec![InstanceGroup {
                count: 8,
                engine: default_engine(),
            }],
            router: RouterConfig::default(),
            replicas: 1,
            split: Split::RoundRobin,
            replica_sync: false,
            replica_sync_delay_s: 0.0,
            scrape_interval_s: 1.0,
            seed: 1,
            ttft_slo_s: 2.0,
            prior_from_profile: false,
            queue_chart_instances: 16,
            lower_bound: true,
            model: None,
            kv_events: None,
            client_max_tokens: None,
            shared_cores: None,
        }
    }
}

impl SimConfig {
    /// Number of instances.
    pub fn instances(&self) -> usize {
        self.fleet.iter().map(|g| g.count as usize).sum()
    }

    /// Checks the settings the simulator itself owns.
    pub fn validate(&self) -> Result<()> {
        let setting = |key, reason: &str| SimError::Setting {
            key,
            reason: reason.to_string(),
        };
        if self.instances() == 0 {
            return Err(setting("fleet", "needs at least one instance"));
        }
        if self.replicas == 0 {
            return Err(setting("replicas", "must be at least 1"));
        }
        if !(self.scrape_interval_s.is_finite() && self.scrape_interval_s > 0.0) {
            return Err(setting("scrape_interval_s", "must be > 0"));
        }
        if !(self.replica_sync_delay_s.is_finite() && self.replica_sync_delay_s >= 0.0) {
            return Err(setting("replica_sync_delay_s", "must be >= 0"));
        }
        if !(self.ttft_slo_s.is_finite() && self.ttft_slo_s > 0.0) {
            return Err(setting("ttft_slo_s", "must be > 0"));
        }
        if self
            .shared_cores
            .is_some_and(|c| !(c.is_finite() && c > 0.0))
        {
            return Err(setting("shared_cores", "must be > 0"));
        }
        let prefills = self
            .fleet
            .iter()
            .any(|g| g.count > 0 && g.engine.role != Role::Decode);
        if !prefills {
            return Err(setting("fleet", "no instance can prefill"));
        }
        if let Some(k) = &self.kv_events {
            if !(k.delay_s.is_finite() && k.delay_s >= 0.0) {
                return Err(setting("kv_events.delay_s", "must be >= 0"));
            }
            if !(0.0..=1.0).contains(&k.loss) {
                return Err(setting("kv_events.loss", "must be within 0..=1"));
            }
            if !(k.probation_s.is_finite() && k.probation_s >= 0.0) {
                return Err(setting("kv_events.probation_s", "must be >= 0"));
            }
        }
        self.router.validate()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn role_splits_parse() {
        assert_eq!(
            parse_roles("4p4d").unwrap(),
            vec![(4, Role::Prefill), (4, Role::Decode)]
        );
        assert_eq!(
            parse_roles("1p2d3b").unwrap(),
            vec![(1, Role::Prefill), (2, Role::Decode), (3, Role::Both)]
        );
        for bad in ["", "4", "p4", "4x", "4p4"] {
            assert!(parse_roles(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn fleet_files_take_partial_engine_configs() {
        let f = FleetFile::from_json_str(
            r#"{"groups": [{"count": 2, "engine": {"role": "prefill", "num_gpu_blocks": 5000}},
                           {"count": 3}]}"#,
        )
        .unwrap();
        assert_eq!(f.groups[0].engine.role, Role::Prefill);
        assert_eq!(f.groups[0].engine.num_gpu_blocks, 5000);
        assert_eq!(f.groups[1].engine.block_size, 16);
        assert!(FleetFile::from_json_str(r#"{"groups": [{"cnt": 1}]}"#).is_err());
    }

    #[test]
    fn the_shipped_mixed_fleet_has_two_kinds_of_engine() {
        let f =
            FleetFile::from_json_str(include_str!("../../../bench/fleets/mixed-h100-a100.json"))
                .unwrap();
        let counts: Vec<u32> = f.groups.iter().map(|g| g.count).collect();
        assert_eq!(counts, [4, 4]);
        let (fast, slow) = (&f.groups[0].engine.profile, &f.groups[1].engine.profile);
        assert!(slow.step_base_s > 2.0 * fast.step_base_s);
        assert!(slow.prefill_s_per_token > 2.0 * fast.prefill_s_per_token);
    }

    #[test]
    fn defaults_validate_and_bad_values_are_refused() {
        SimConfig::default().validate().unwrap();
        let c = SimConfig {
            replicas: 0,
            ..SimConfig::default()
        };
        assert!(c.validate().is_err());
        let c = SimConfig {
            fleet: groups_for_roles(&[(2, Role::Decode)], &default_engine()),
            ..SimConfig::default()
        };
        assert!(c.validate().is_err());
    }
}
