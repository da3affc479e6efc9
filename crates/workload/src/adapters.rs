//! LoRA adapter mixes layered over any workload.
//!
//! [`AdapterAssigner`] wraps another workload's requests and sets each one's
//! adapter: a fraction goes to the base model, the rest to `N` adapters
//! named `{name_prefix}{k}` (`lora-0`, `lora-1`, …) with Zipf popularity.
//! Initially `lora-0` is the most popular, `lora-1` next, and so on.
//!
//! An optional popularity shift, at a given fraction of the run, replaces the
//! ranking with a deterministic permutation of it in which the most popular
//! adapter is a different one — the "popularity shift halfway through"
//! experiment, where adapter placement tuned to the first half goes stale.
//!
//! Requests of one chat session keep one adapter: their draw comes from a
//! random stream keyed by the session id, not from the shared stream. (A
//! session spanning the shift is re-drawn under the new ranking, which with
//! its own key keeps it on the same rank, so it usually moves adapter.)

use std::sync::Arc;

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::error::{ensure, Result};
use crate::request::Request;
use crate::sampling::ZipfRanks;
use crate::text::{hash_str, key};

/// Domain tags separating this wrapper's random streams.
const DRAW: u64 = 0x4144_4452; // "ADDR"
const SHIFT: u64 = 0x4144_5348; // "ADSH"
const SESSION: u64 = 0x4144_5345; // "ADSE"

/// When the adapter ranking changes.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PopularityShift {
    /// Fraction of the run's requests after which the new ranking applies
    /// (0.5: the second half of the requests uses the permuted ranking).
    pub at_fraction: f64,
}

/// How adapters are spread over requests.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdapterMix {
    /// Number of adapters.
    pub adapters: u32,
    /// Zipf exponent of adapter popularity (0: uniform).
    pub zipf_exponent: f64,
    /// Fraction of requests served by the base model without adapter.
    pub base_fraction: f64,
    /// Adapter names are this prefix followed by the adapter's index.
    pub name_prefix: String,
    /// Optional change of ranking part-way through.
    pub shift: Option<PopularityShift>,
}

impl Default for AdapterMix {
    fn default() -> Self {
        Self {
            adapters: 8,
            zipf_exponent: 1.0,
            base_fraction: 0.0,
            name_prefix: "lora-".to_string(),
            shift: None,
        }
    }
}

impl AdapterMix {
    /// Name of adapter `k`.
    pub fn adapter_name(&self, k: u32) -> String {
        format!("{}{k}", self.name_prefix)
    }

    /// Checks the parameters.
    pub fn validate(&self) -> Result<()> {
        ensure(self.adapters >= 1, || "adapters must be >= 1".into())?;
        ensure((0.0..=1.0).contains(&self.base_fraction), || {
            format!(
                "base_fraction must be in [0, 1], got {}",
                self.base_fraction
            )
        })?;
        if let Some(s) = self.shift {
            ensure((0.0..=1.0).contains(&s.at_fraction), || {
                format!("shift.at_fraction must be in [0, 1], got {}", s.at_fraction)
            })?;
        }
        ZipfRanks::new(self.adapters as usize, self.zipf_exponent).map(|_| ())
    }

    /// The ranking after the shift: adapter index per rank, with the top
    /// adapter guaranteed to change when there are at least two.
    pub fn shifted_ranking(&self, seed: u64) -> Vec<u32> {
        let mut ranking: Vec<u32> = (0..self.adapters).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(key(seed, SHIFT, 0));
        ranking.shuffle(&mut rng);
        if ranking.len() > 1 && ranking[0] == 0 {
            let j = rng.random_range(1..ranking.len());
            ranking.swap(0, j);
        }
        ranking
    }
}

/// Wrapper assigning adapters to another workload's requests.
#[derive(Clone, Debug)]
pub struct AdapterAssigner<I> {
    inner: I,
    names: Vec<Arc<str>>,
    before: Vec<u32>,
    after: Vec<u32>,
    shift_at: Option<u64>,
    zipf: ZipfRanks,
    base_fraction: f64,
    rng: ChaCha8Rng,
    seed: u64,
    seen: u64,
}

impl<I: Iterator<Item = Request>> AdapterAssigner<I> {
    /// Wraps `inner`. With a shift, `inner` must report its exact length
    /// through `size_hint` (every generator in this crate does).
    pub fn new(inner: I, mix: &AdapterMix, seed: u64) -> Result<Self> {
        mix.validate()?;
        let shift_at = match mix.shift {
            None => None,
            Some(s) => {
                let (lo, hi) = inner.size_hint();
                ensure(hi == Some(lo), || {
                    "a popularity shift needs a workload of known length".into()
                })?;
                Some((s.at_fraction * lo as f64).round() as u64)
            }
        };
        Ok(Self {
            names: (0..mix.adapters)
                .map(|k| Arc::from(mix.adapter_name(k)))
                .collect(),
            before: (0..mix.adapters).collect(),
            after: mix.shifted_ranking(seed),
            shift_at,
            zipf: ZipfRanks::new(mix.adapters as usize, mix.zipf_exponent)?,
            base_fraction: mix.base_fraction,
            rng: ChaCha8Rng::seed_from_u64(key(seed, DRAW, 0)),
            inner,
            seed,
            seen: 0,
        })
    }

    /// Index (into the request stream) from which the shifted ranking applies.
    pub fn shift_at(&self) -> Option<u64> {
        self.shift_at
    }
}

/// Draws an adapter index (or `None` for the base model) from `rng`.
fn draw(
    zipf: &ZipfRanks,
    base_fraction: f64,
    ranking: &[u32],
    rng: &mut ChaCha8Rng,
) -> Option<usize> {
    if rng.random::<f64>() < base_fraction {
        return None;
    }
    Some(ranking[zipf.sample(rng)] as usize)
}

impl<I: Iterator<Item = Request>> Iterator for AdapterAssigner<I> {
    type Item = Request;

    fn next(&mut self) -> Option<Request> {
        let mut r = self.inner.next()?;
        let shifted = self.shift_at.is_some_and(|s| self.seen >= s);
        self.seen += 1;
        let ranking = if shifted { &self.after } else { &self.before };
        let pick = match &r.session_id {
            Some(sid) => {
                let mut rng = ChaCha8Rng::seed_from_u64(key(self.seed, SESSION, hash_str(sid)));
                draw(&self.zipf, self.base_fraction, ranking, &mut rng)
            }
            None => draw(&self.zipf, self.base_fraction, ranking, &mut self.rng),
        };
        r.adapter = pick.map(|k| self.names[k].clone());
        Some(r)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::ChatSpec;
    use crate::sampling::Count;
    use crate::shared_prefix::SharedPrefixSpec;
    use std::collections::HashMap;

    fn base(n: u64) -> impl Iterator<Item = Request> {
        SharedPrefixSpec {
            num_groups: 4,
            system_prompt_len: 8,
            question_len: 4,
            num_requests: Some(n),
            ..Default::default()
        }
        .build(0)
        .unwrap()
    }

    fn counts<'a>(reqs: impl Iterator<Item = &'a Request>) -> HashMap<String, u32> {
        let mut c = HashMap::new();
        for r in reqs {
            let k = r.adapter.as_deref().unwrap_or("base").to_string();
            *c.entry(k).or_default() += 1;
        }
        c
    }

    fn top(c: &HashMap<String, u32>) -> String {
        c.iter()
            .filter(|(k, _)| *k != "base")
            .max_by_key(|(_, v)| **v)
            .unwrap()
            .0
            .clone()
    }

    #[test]
    fn zipf_mix_with_base_fraction() {
        let mix = AdapterMix {
            adapters: 5,
            zipf_exponent: 1.0,
            base_fraction: 0.2,
            ..Default::default()
        };
        let reqs: Vec<Request> = AdapterAssigner::new(base(20_000), &mix, 1)
            .unwrap()
            .collect();
        let c = counts(reqs.iter());
        let frac = f64::from(c["base"]) / 20_000.0;
        assert!((frac - 0.2).abs() < 0.02, "{frac}");
        for k in 1..5 {
            assert!(c["lora-0"] > c[&format!("lora-{k}")], "{c:?}");
        }
        assert!(c["lora-1"] > c["lora-4"], "{c:?}");
    }

    #[test]
    fn shift_changes_the_favourite() {
        let mix = AdapterMix {
            adapters: 6,
            zipf_exponent: 1.5,
            shift: Some(PopularityShift { at_fraction: 0.5 }),
            ..Default::default()
        };
        let a = AdapterAssigner::new(base(10_000), &mix, 7).unwrap();
        assert_eq!(a.shift_at(), Some(5_000));
        let reqs: Vec<Request> = a.collect();
        let first = counts(reqs[..5_000].iter());
        let second = counts(reqs[5_000..].iter());
        assert_eq!(top(&first), "lora-0");
        let after = mix.shifted_ranking(7);
        assert_ne!(after[0], 0);
        assert_eq!(top(&second), format!("lora-{}", after[0]));
        let mut sorted = after.clone();
        sorted.sort();
        assert_eq!(sorted, (0..6).collect::<Vec<_>>(), "a permutation");
    }

    #[test]
    fn shift_round_trips_through_json_and_defaults_to_none() {
        let mix = AdapterMix {
            adapters: 32,
            shift: Some(PopularityShift { at_fraction: 0.5 }),
            ..Default::default()
        };
        let json = serde_json::to_string(&mix).unwrap();
        assert_eq!(serde_json::from_str::<AdapterMix>(&json).unwrap(), mix);
        let old: AdapterMix = serde_json::from_str(r#"{"adapters": 32}"#).unwrap();
        assert_eq!(old.shift, None);
        assert!(serde_json::from_str::<AdapterMix>(r#"{"shift": {"at": 0.5}}"#).is_err());
        let bad = AdapterMix {
            shift: Some(PopularityShift { at_fraction: 1.5 }),
            ..Default::default()
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn shift_needs_known_length() {
        let mix = AdapterMix {
            shift: Some(PopularityShift { at_fraction: 0.5 }),
            ..Default::default()
        };
        let unknown = base(10).filter(|_| true);
        assert!(AdapterAssigner::new(unknown, &mix, 0).is_err());
    }

    #[test]
    fn sessions_keep_their_adapter() {
        let chat = ChatSpec {
            sessions: 50,
            turns: Count::Fixed(4),
            user_len: Count::Fixed(4),
            assistant_len: Count::Fixed(4),
            ..Default::default()
        }
        .build(0)
        .unwrap();
        let mix = AdapterMix {
            adapters: 10,
            base_fraction: 0.3,
            ..Default::default()
        };
        let mut by_session: HashMap<String, Option<Arc<str>>> = HashMap::new();
        for r in AdapterAssigner::new(chat, &mix, 3).unwrap() {
            let sid = r.session_id.as_deref().unwrap().to_string();
            let prev = by_session.entry(sid).or_insert_with(|| r.adapter.clone());
            assert_eq!(*prev, r.adapter);
        }
        let distinct: std::collections::HashSet<_> = by_session.values().collect();
        assert!(distinct.len() > 3, "sessions spread over adapters");
    }

    #[test]
    fn rejects_bad_mix() {
        for mix in [
            AdapterMix {
                adapters: 0,
                ..Default::default()
            },
            AdapterMix {
                base_fraction: 1.5,
                ..Default::default()
            },
            AdapterMix {
                zipf_exponent: -1.0,
                ..Default::default()
            },
        ] {
            assert!(AdapterAssigner::new(base(1), &mix, 0).is_err(), "{mix:?}");
        }
    }
}
