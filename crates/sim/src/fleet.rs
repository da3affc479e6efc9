//! Building the engines and the router's view of them from the fleet groups.

use switchyard_core::{InstanceSpec, Role as CoreRole};
use switchyard_engine::{Engine, EngineConfig, Profile, Role};

use crate::config::SimConfig;
use crate::error::{Result, SimError};

/// One simulated instance: its engine and how the router is told about it.
pub struct Member {
    /// The engine model.
    pub engine: Engine,
    /// The router-side description.
    pub spec: InstanceSpec,
}

/// The router's role for an engine role.
pub fn core_role(role: Role) -> CoreRole {
    match role {
        Role::Prefill => CoreRole::Prefill,
        Role::Decode => CoreRole::Decode,
        Role::Both => CoreRole::Both,
    }
}

/// Prefill speed of a profile on a typical prompt (2k tokens, nothing cached), tokens/s.
pub fn profile_prefill_speed(profile: &Profile, budget: u32) -> f64 {
    const TOKENS: u64 = 2048;
    TOKENS as f64 / profile.isolated_prefill_time(TOKENS, 0, u64::from(budget))
}

/// The engine configurations of every instance, in order, named `e0`, `e1`, ...
pub fn engine_configs(config: &SimConfig) -> Vec<EngineConfig> {
    let mut out = Vec::with_capacity(config.instances());
    for group in &config.fleet {
        for _ in 0..group.count {
            let mut engine = group.engine.clone();
            engine.engine_id = format!("e{}", out.len());
            // The simulator reads events, never per-token streams.
            engine.emit_token_events = false;
            engine.emit_kv_events = config.kv_events.is_some();
            out.push(engine);
        }
    }
    out
}

/// Builds every instance for a fleet serving `model`.
pub fn build(config: &SimConfig, model: &str) -> Result<Vec<Member>> {
    engine_configs(config)
        .into_iter()
        .enumerate()
        .map(|(i, engine)| {
            let spec = InstanceSpec {
                role: core_role(engine.role),
                // Adapters are registered on the engine when first sent there.
                runtime_adapter_loading: engine.max_loras > 0,
                adapter_slots: engine.max_loras.max(1),
                kv_capacity_tokens: Some(
                    u64::from(engine.num_gpu_blocks) * u64::from(engine.block_size),
                ),
                max_running: Some(engine.max_num_seqs),
                prefill_tokens_per_s: config
                    .prior_from_profile
                    .then(|| profile_prefill_speed(&engine.profile, engine.max_num_batched_tokens)),
                ..InstanceSpec::new(engine.engine_id.clone(), model)
            };
            let engine = Engine::new(engine).map_err(|source| SimError::Engine {
                instance: i,
                source,
            })?;
            Ok(Member { engine, spec })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{default_engine, groups_for_roles, parse_roles};

    #[test]
    fn roles_and_names_follow_the_groups() {
        let config = SimConfig {
            fleet: groups_for_roles(&parse_roles("2p1d").unwrap(), &default_engine()),
            ..SimConfig::default()
        };
        let members = build(&config, "m").unwrap();
        let roles: Vec<_> = members.iter().map(|m| m.spec.role).collect();
        assert_eq!(
            roles,
            [CoreRole::Prefill, CoreRole::Prefill, CoreRole::Decode]
        );
        assert_eq!(members[2].spec.name, "e2");
        assert_eq!(members[0].spec.models, ["m"]);
    }

    #[test]
    fn the_default_profile_prefills_tens_of_thousands_of_tokens_a_second() {
        let s = profile_prefill_speed(&Profile::h100_llama8b(), 8192);
        assert!((30_000.0..45_000.0).contains(&s), "{s}");
    }
}
