//! Generated shared-prefix groups, after SGLang's `generated-shared-prefix`
//! benchmark dataset.
//!
//! SGLang's `bench_serving.py` (`sample_generated_shared_prefix_requests`,
//! flags `--gsp-num-groups 64 --gsp-prompts-per-group 16
//! --gsp-system-prompt-len 2048 --gsp-question-len 128 --gsp-output-len 256`)
//! makes one random system prompt per group and one random question per
//! request, builds each prompt as `system_prompt + "\n\n" + question`, and
//! shuffles the `num_groups * prompts_per_group` requests. A later option
//! (`--gsp-group-distribution zipf`) instead draws each request's group with
//! probability `1/rank^alpha`, group 0 the hottest.
//!
//! Differences here, all deliberate:
//! - text is 4-byte words (see [`crate::text`]) instead of random token ids,
//!   and there is no `"\n\n"` separator, so lengths are exact under the
//!   project's tokenizer: every prompt is `system_prompt_len + question_len`
//!   tokens;
//! - the request count is free: `num_requests` (default `num_groups *
//!   prompts_per_group`) runs in epochs of `num_groups * prompts_per_group`
//!   requests, each a fresh shuffle with every group `prompts_per_group`
//!   times; every request still gets its own private question;
//! - arrival times come from an [`ArrivalProcess`] (SGLang's default
//!   `--request-rate inf` is [`ArrivalProcess::Instant`]).

use std::sync::Arc;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::arrivals::{ArrivalProcess, ArrivalTimes};
use crate::error::{ensure, Result};
use crate::request::{Prompt, Request};
use crate::sampling::ZipfRanks;
use crate::text::{key, words};
use crate::DEFAULT_MODEL;

/// Domain tags separating the text and random streams of this generator.
const SYSTEM: u64 = 0x5350_5359; // "SPSY"
const QUESTION: u64 = 0x5350_5155; // "SPQU"
const PICK: u64 = 0x5350_5049; // "SPPI"
const ARRIVE: u64 = 0x5350_4152; // "SPAR"

/// How each request picks its group.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum GroupSelection {
    /// SGLang's default: each epoch of `num_groups * prompts_per_group`
    /// requests holds every group `prompts_per_group` times, shuffled.
    #[default]
    Shuffled,
    /// Request `i` goes to group `i % num_groups`.
    RoundRobin,
    /// Group of 0-based rank `r` is drawn with weight `1/(r+1)^exponent`.
    Zipf {
        /// Popularity exponent (SGLang's `--gsp-zipf-alpha`).
        exponent: f64,
    },
}

/// Parameters of a shared-prefix workload; defaults are SGLang's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SharedPrefixSpec {
    /// Number of distinct system prompts.
    pub num_groups: u32,
    /// Requests per group in one epoch.
    pub prompts_per_group: u32,
    /// System prompt length in tokens.
    pub system_prompt_len: u32,
    /// Private question length in tokens.
    pub question_len: u32,
    /// `max_tokens` of every request.
    pub output_len: u32,
    /// Total requests; `None` means one epoch (`num_groups * prompts_per_group`).
    pub num_requests: Option<u64>,
    /// How requests pick a group.
    pub group_selection: GroupSelection,
    /// When requests arrive.
    pub arrivals: ArrivalProcess,
    /// Base model name.
    pub model: String,
}

impl Default for SharedPrefixSpec {
    fn default() -> Self {
        Self {
            num_groups: 64,
            prompts_per_group: 16,
            system_prompt_len: 2048,
            question_len: 128,
            output_len: 256,
            num_requests: None,
            group_selection: GroupSelection::Shuffled,
            arrivals: ArrivalProcess::Instant,
            model: DEFAULT_MODEL.to_string(),
        }
    }
}

impl SharedPrefixSpec {
    /// Requests this spec produces.
    pub fn len(&self) -> u64 {
        self.num_requests
            .unwrap_or(u64::from(self.num_groups) * u64::from(self.prompts_per_group))
    }

    /// Whether this spec produces no request.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The generator for `seed`.
    pub fn build(&self, seed: u64) -> Result<SharedPrefix> {
        SharedPrefix::new(self, seed)
    }
}

/// Group chooser state.
#[derive(Clone, Debug)]
enum Picker {
    Shuffled { epoch: Vec<u32> },
    RoundRobin,
    Zipf(ZipfRanks),
}

/// Iterator over a shared-prefix workload; see the module docs.
#[derive(Clone, Debug)]
pub struct SharedPrefix {
    systems: Vec<Arc<str>>,
    model: Arc<str>,
    question_len: usize,
    output_len: u32,
    per_group: usize,
    total: u64,
    next: u64,
    seed: u64,
    picker: Picker,
    rng: ChaCha8Rng,
    times: ArrivalTimes,
}

impl SharedPrefix {
    /// Builds the generator (makes the `num_groups` system prompts up front).
    pub fn new(spec: &SharedPrefixSpec, seed: u64) -> Result<Self> {
        ensure(spec.num_groups >= 1, || "num_groups must be >= 1".into())?;
        let picker = match &spec.group_selection {
            GroupSelection::Shuffled => {
                ensure(spec.prompts_per_group >= 1, || {
                    "prompts_per_group must be >= 1".into()
                })?;
                Picker::Shuffled { epoch: Vec::new() }
            }
            GroupSelection::RoundRobin => Picker::RoundRobin,
            GroupSelection::Zipf { exponent } => {
                Picker::Zipf(ZipfRanks::new(spec.num_groups as usize, *exponent)?)
            }
        };
        let systems = (0..spec.num_groups)
            .map(|g| {
                Arc::from(words(
                    key(seed, SYSTEM, u64::from(g)),
                    spec.system_prompt_len as usize,
                ))
            })
            .collect();
        Ok(Self {
            systems,
            model: Arc::from(spec.model.as_str()),
            question_len: spec.question_len as usize,
            output_len: spec.output_len,
            per_group: spec.prompts_per_group as usize,
            total: spec.len(),
            next: 0,
            seed,
            rng: ChaCha8Rng::seed_from_u64(key(seed, PICK, 0)),
            times: spec.arrivals.times(key(seed, ARRIVE, 0))?,
            picker,
        })
    }

    /// The shared system prompt of each group (index = group).
    pub fn system_prompts(&self) -> &[Arc<str>] {
        &self.systems
    }

    /// Group of the next request.
    fn pick(&mut self) -> usize {
        let groups = self.systems.len();
        match &mut self.picker {
            Picker::Shuffled { epoch } => {
                if epoch.is_empty() {
                    let per_group = self.per_group;
                    *epoch = (0..groups as u32)
                        .flat_map(|g| std::iter::repeat_n(g, per_group))
                        .collect();
                    epoch.shuffle(&mut self.rng);
                }
                // Just refilled with groups * prompts_per_group >= 1 entries.
                epoch.pop().unwrap_or(0) as usize
            }
            Picker::RoundRobin => (self.next % groups as u64) as usize,
            Picker::Zipf(z) => z.sample(&mut self.rng),
        }
    }
}

impl Iterator for SharedPrefix {
    type Item = Request;

    fn next(&mut self) -> Option<Request> {
        if self.next >= self.total {
            return None;
        }
        let id = self.next;
        let group = self.pick();
        self.next += 1;
        let mut segments = Vec::with_capacity(2);
        if !self.systems[group].is_empty() {
            segments.push(self.systems[group].clone());
        }
        if self.question_len > 0 {
            segments.push(Arc::from(words(
                key(self.seed, QUESTION, id),
                self.question_len,
            )));
        }
        Some(Request {
            id,
            // ArrivalTimes never ends; 0.0 is unreachable.
            arrival_s: self.times.next().unwrap_or(0.0),
            model: self.model.clone(),
            adapter: None,
            prompt: Prompt::Text(segments),
            max_tokens: self.output_len,
            session_id: None,
            cache_salt: None,
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = usize::try_from(self.total - self.next).unwrap_or(usize::MAX);
        (left, Some(left))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn small(selection: GroupSelection) -> SharedPrefixSpec {
        SharedPrefixSpec {
            num_groups: 8,
            prompts_per_group: 4,
            system_prompt_len: 64,
            question_len: 16,
            output_len: 32,
            group_selection: selection,
            ..Default::default()
        }
    }

    /// Index of the group whose system prompt `r` starts with.
    fn group_of(g: &SharedPrefix, r: &Request) -> usize {
        let Prompt::Text(segs) = &r.prompt else {
            panic!("text prompt expected")
        };
        g.system_prompts()
            .iter()
            .position(|s| Arc::ptr_eq(s, &segs[0]))
            .expect("first segment is a shared system prompt")
    }

    #[test]
    fn defaults_are_sglangs() {
        let s = SharedPrefixSpec::default();
        assert_eq!(
            (s.num_groups, s.prompts_per_group, s.system_prompt_len),
            (64, 16, 2048)
        );
        assert_eq!((s.question_len, s.output_len, s.len()), (128, 256, 1024));
    }

    #[test]
    fn prompt_shape_and_sharing() {
        let g = small(GroupSelection::Shuffled).build(1).unwrap();
        let probe = g.clone();
        let reqs: Vec<Request> = g.collect();
        assert_eq!(reqs.len(), 32);
        let mut per_group = [0; 8];
        let mut questions = std::collections::HashSet::new();
        for (i, r) in reqs.iter().enumerate() {
            assert_eq!(r.id, i as u64);
            assert_eq!(r.prompt_tokens(), 64 + 16);
            assert_eq!(r.prompt.render().len(), 4 * (64 + 16));
            assert_eq!(r.max_tokens, 32);
            per_group[group_of(&probe, r)] += 1;
            let Prompt::Text(segs) = &r.prompt else {
                unreachable!()
            };
            assert!(
                questions.insert(segs[1].to_string()),
                "questions are private"
            );
        }
        // One SGLang epoch: every group exactly prompts_per_group times.
        assert_eq!(per_group, [4; 8]);
        // ...but shuffled, not in group order.
        let order: Vec<usize> = reqs.iter().map(|r| group_of(&probe, r)).collect();
        let mut sorted = order.clone();
        sorted.sort();
        assert_ne!(order, sorted);
    }

    #[test]
    fn round_robin_and_epochs() {
        let mut spec = small(GroupSelection::RoundRobin);
        spec.num_requests = Some(20);
        let g = spec.build(0).unwrap();
        let probe = g.clone();
        let groups: Vec<usize> = g.map(|r| group_of(&probe, &r)).collect();
        assert_eq!(groups, (0..20).map(|i| i % 8).collect::<Vec<_>>());

        let mut spec = small(GroupSelection::Shuffled);
        spec.num_requests = Some(3 * 32);
        let g = spec.build(0).unwrap();
        let probe = g.clone();
        let groups: Vec<usize> = g.map(|r| group_of(&probe, &r)).collect();
        for epoch in groups.chunks(32) {
            let mut c = [0; 8];
            epoch.iter().for_each(|&g| c[g] += 1);
            assert_eq!(c, [4; 8]);
        }
    }

    #[test]
    fn zipf_groups_favour_group_zero() {
        let mut spec = small(GroupSelection::Zipf { exponent: 1.2 });
        spec.num_requests = Some(4000);
        let g = spec.build(5).unwrap();
        let probe = g.clone();
        let mut c = [0u32; 8];
        g.for_each(|r| c[group_of(&probe, &r)] += 1);
        assert!(c[1..].iter().all(|&x| x < c[0]), "{c:?}");
        assert!(c[7] > 0, "{c:?}");
    }

    #[test]
    fn exact_size_hint() {
        let mut g = small(GroupSelection::Shuffled).build(1).unwrap();
        assert_eq!(g.size_hint(), (32, Some(32)));
        g.next();
        assert_eq!(g.size_hint(), (31, Some(31)));
    }

    #[test]
    fn rejects_bad_specs() {
        let mut s = small(GroupSelection::Shuffled);
        s.num_groups = 0;
        assert!(s.build(0).is_err());
        let s = small(GroupSelection::Zipf { exponent: -1.0 });
        assert!(s.build(0).is_err());
    }

    proptest! {
        #[test]
        fn deterministic_by_seed(seed in any::<u64>()) {
            let mut spec = small(GroupSelection::Zipf { exponent: 1.0 });
            spec.arrivals = ArrivalProcess::Poisson { rate: 3.0 };
            let a: Vec<Request> = spec.build(seed).unwrap().collect();
            let b: Vec<Request> = spec.build(seed).unwrap().collect();
            prop_assert_eq!(&a, &b);
            let c: Vec<Request> = spec.build(seed ^ 1).unwrap().collect();
            prop_assert_ne!(&a, &c);
        }
    }
}
