//! Modelled on KubeAI's `PrefixHash` load balancing (kubeai.org, "Load Balancing": consistent
//! hashing with bounded loads, CHWBL): the key is the model/adapter plus the first
//! `prefix_chars` characters of the prompt; each endpoint has `replicas` points on a hash ring;
//! the request goes to the first endpoint clockwise from the key whose load stays within
//! `load_factor` × the mean load (Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with
//! Bounded Loads"). Load is the router's count of requests in flight.

use rand::rngs::SmallRng;
use rustc_hash::FxHashMap;
use xxhash_rust::xxh3::xxh3_64;

use super::{pick_then_by_load, Policy, PolicyTraits, ScoringContext, TieBreak};
use crate::config::KubeAiConfig;
use crate::decision::Candidate;
use crate::fleet::Slot;

/// The CHWBL policy; the ring is rebuilt when the candidate set changes.
pub struct KubeAiChwbl {
    config: KubeAiConfig,
    ring: Vec<(u64, Slot)>,
    ring_members: Vec<(Slot, u32)>,
}

impl KubeAiChwbl {
    /// With the given ring settings.
    pub fn new(config: KubeAiConfig) -> Self {
        KubeAiChwbl {
            config,
            ring: Vec::new(),
            ring_members: Vec::new(),
        }
    }

    fn rebuild_if_needed(&mut self, ctx: &ScoringContext<'_>, candidates: &[Candidate]) {
        let members: Vec<(Slot, u32)> = candidates
            .iter()
            .map(|c| (c.instance.slot, c.instance.generation))
            .collect();
        if members == self.ring_members {
            return;
        }
        self.ring.clear();
        for c in candidates {
            let name = &ctx.instance(c).spec.name;
            for replica in 0..self.config.replicas {
                let point = xxh3_64(format!("{name}#{replica}").as_bytes());
                self.ring.push((point, c.instance.slot));
            }
        }
        self.ring.sort_unstable();
        self.ring_members = members;
    }
}

impl Policy for KubeAiChwbl {
    fn traits(&self) -> &'static PolicyTraits {
        const TRAITS: PolicyTraits = PolicyTraits {
            name: "kubeai-chwbl",
            uses_prefix_index: false,
            tie_break: TieBreak::First,
            prices_local_prefill: false,
            scores_shortlist: false,
        };
        &TRAITS
    }

    fn score(
        &mut self,
        ctx: &ScoringContext<'_>,
        candidates: &mut [Candidate],
        _rng: &mut SmallRng,
    ) {
        if candidates.is_empty() {
            return;
        }
        self.rebuild_if_needed(ctx, candidates);
        let mut key_bytes = Vec::with_capacity(self.config.prefix_chars + 64);
        key_bytes.extend_from_slice(ctx.request.model.as_bytes());
        key_bytes.push(0);
        key_bytes.extend_from_slice(ctx.request.adapter.unwrap_or("").as_bytes());
        key_bytes.push(0);
        let limit = key_bytes.len() + self.config.prefix_chars;
        ctx.request.prompt.for_each_piece(|piece| {
            let room = limit.saturating_sub(key_bytes.len());
            key_bytes.extend_from_slice(&piece[..piece.len().min(room)]);
        });
        let key = xxh3_64(&key_bytes);
        let index_of: FxHashMap<Slot, usize> = candidates
            .iter()
            .enumerate()
            .map(|(i, c)| (c.instance.slot, i))
            .collect();
        let loads: Vec<u32> = candidates
            .iter()
            .map(|c| ctx.instance(c).load.in_flight())
            .collect();
        let total: u64 = loads.iter().map(|&l| u64::from(l)).sum();
        let bound = (self.config.load_factor * (total + 1) as f64 / candidates.len() as f64).ceil();
        let start = self.ring.partition_point(|(point, _)| *point < key);
        let mut pick = None;
        for k in 0..self.ring.len() {
            let (_, slot) = self.ring[(start + k) % self.ring.len()];
            let i = index_of[&slot];
            if f64::from(loads[i]) + 1.0 <= bound {
                pick = Some(i);
                break;
            }
        }
        // The bound always admits the least-loaded endpoint; fall back to it for safety.
        let least = loads
            .iter()
            .enumerate()
            .min_by_key(|(_, l)| **l)
            .map_or(0, |(i, _)| i);
        pick_then_by_load(ctx, candidates, pick.unwrap_or(least));
    }
}
