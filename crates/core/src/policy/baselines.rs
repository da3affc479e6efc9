//! Load-balancing baselines that ignore the prompt: round-robin, random, least-load, power-of-two.
//!
//! "Load" is the router's own count of requests in flight on an instance, which is what
//! general-purpose proxies (nginx `least_conn`, Envoy `LEAST_REQUEST`) balance on. Each honours
//! the instances' `weight` as those proxies do (a weight-2 instance takes twice the share, or
//! is as loaded at twice the requests); with equal weights they are the plain algorithms.

use rand::rngs::SmallRng;
use rand::Rng;

use super::{pick_then_by_load, Policy, PolicyTraits, ScoringContext, TieBreak};
use crate::decision::Candidate;

/// Each request to the next instance in fleet order (nginx's smooth weighted round robin when
/// weights differ).
#[derive(Default)]
pub struct RoundRobin {
    next: usize,
    /// Smooth weighted round robin's running weight per slot.
    current: rustc_hash::FxHashMap<crate::fleet::Slot, f64>,
}

impl Policy for RoundRobin {
    fn traits(&self) -> &'static PolicyTraits {
        const TRAITS: PolicyTraits = PolicyTraits {
            name: "round-robin",
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
        let n = candidates.len();
        if n == 0 {
            return;
        }
        let weight = |c: &Candidate| ctx.instance(c).spec.weight;
        if candidates.iter().any(|c| weight(c) != 1.0) {
            // Every candidate gains its weight; the one with the most goes and pays the total.
            let total: f64 = candidates.iter().map(weight).sum();
            let mut best = 0;
            let mut best_current = f64::NEG_INFINITY;
            for (i, c) in candidates.iter().enumerate() {
                let current = self.current.entry(c.instance.slot).or_insert(0.0);
                *current += weight(c);
                if *current > best_current {
                    best_current = *current;
                    best = i;
                }
            }
            if let Some(current) = self.current.get_mut(&candidates[best].instance.slot) {
                *current -= total;
            }
            pick_then_by_load(ctx, candidates, best);
            return;
        }
        let start = self.next % n;
        for (i, c) in candidates.iter_mut().enumerate() {
            c.score = ((i + n - start) % n) as f64;
        }
        self.next = self.next.wrapping_add(1);
    }

    fn forget_instance(&mut self, slot: crate::fleet::Slot) {
        self.current.remove(&slot);
    }
}

/// A uniformly random instance.
pub struct Random;

impl Policy for Random {
    fn traits(&self) -> &'static PolicyTraits {
        const TRAITS: PolicyTraits = PolicyTraits {
            name: "random",
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
        rng: &mut SmallRng,
    ) {
        // Efraimidis-Spirakis: the smallest 1 - (1 - u)^(1/w) wins with probability
        // proportional to w (exactly `u` at weight 1).
        for c in candidates.iter_mut() {
            let u = rng.random::<f64>();
            let w = ctx.instance(c).spec.weight;
            c.score = if w == 1.0 {
                u
            } else {
                1.0 - (1.0 - u).powf(1.0 / w)
            };
        }
    }
}

/// The instance with the fewest requests in flight (ties at random).
pub struct LeastLoad;

impl Policy for LeastLoad {
    fn traits(&self) -> &'static PolicyTraits {
        const TRAITS: PolicyTraits = PolicyTraits {
            name: "least-load",
            uses_prefix_index: false,
            tie_break: TieBreak::Exact,
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
        for c in candidates.iter_mut() {
            let instance = ctx.instance(c);
            c.score = f64::from(instance.load.in_flight()) / instance.spec.weight;
        }
    }
}

/// Two instances drawn at random, the less loaded one wins (Mitzenmacher's power of two choices).
pub struct PowerOfTwo;

impl Policy for PowerOfTwo {
    fn traits(&self) -> &'static PolicyTraits {
        const TRAITS: PolicyTraits = PolicyTraits {
            name: "power-of-two",
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
        rng: &mut SmallRng,
    ) {
        let n = candidates.len();
        if n == 0 {
            return;
        }
        let a = rng.random_range(0..n);
        let b = if n > 1 {
            (a + rng.random_range(1..n)) % n
        } else {
            a
        };
        let load = |i: usize| {
            let instance = ctx.instance(&candidates[i]);
            f64::from(instance.load.in_flight()) / instance.spec.weight
        };
        let pick = match load(a).total_cmp(&load(b)) {
            std::cmp::Ordering::Less => a,
            std::cmp::Ordering::Greater => b,
            std::cmp::Ordering::Equal if rng.random::<bool>() => a,
            std::cmp::Ordering::Equal => b,
        };
        pick_then_by_load(ctx, candidates, pick);
    }
}
