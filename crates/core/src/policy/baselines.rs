//! Load-balancing baselines that ignore the prompt: round-robin, random, least-load, power-of-two.
//!
//! "Load" is the router's own count of requests in flight on an instance, which is what
//! general-purpose proxies (nginx `least_conn`, Envoy `LEAST_REQUEST`) balance on.

use rand::rngs::SmallRng;
use rand::Rng;

use super::{pick_then_by_load, Policy, PolicyTraits, ScoringContext, TieBreak};
use crate::decision::Candidate;

/// Each request to the next instance in fleet order.
#[derive(Default)]
pub struct RoundRobin {
    next: usize,
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
        _ctx: &ScoringContext<'_>,
        candidates: &mut [Candidate],
        _rng: &mut SmallRng,
    ) {
        let n = candidates.len();
        if n == 0 {
            return;
        }
        let start = self.next % n;
        for (i, c) in candidates.iter_mut().enumerate() {
            c.score = ((i + n - start) % n) as f64;
        }
        self.next = self.next.wrapping_add(1);
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
        _ctx: &ScoringContext<'_>,
        candidates: &mut [Candidate],
        rng: &mut SmallRng,
    ) {
        for c in candidates.iter_mut() {
            c.score = rng.random::<f64>();
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
            c.score = f64::from(ctx.instance(c).load.in_flight());
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
        let load = |i: usize| ctx.instance(&candidates[i]).load.in_flight();
        let pick = match load(a).cmp(&load(b)) {
            std::cmp::Ordering::Less => a,
            std::cmp::Ordering::Greater => b,
            std::cmp::Ordering::Equal if rng.random::<bool>() => a,
            std::cmp::Ordering::Equal => b,
        };
        pick_then_by_load(ctx, candidates, pick);
    }
}
