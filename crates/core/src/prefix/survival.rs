//! How likely an instance still holds a block the index says it was given, by the block's age.
//!
//! Engines evict differently: vLLM frees paged blocks LRU, SGLang trims a radix tree, llama.cpp
//! keeps a few slots plus an LRU of whole prompt states in host RAM. None of them tells the
//! router what it evicted (without KV events), but every answer reports how many prompt tokens
//! came from cache. Each report says, for the blocks the index matched, which survived and
//! where the first miss was; ages are counted in blocks the instance was given since (the
//! lane's touch sequence). This curve turns those reports into P(held | age), so a block is
//! never simply trusted or forgotten: an old entry still counts for a little, which keeps a
//! conversation near its last instance when its cache may well be there.

use serde::Serialize;

/// Log2 age buckets: bucket `b` holds ages in `[2^b - 1, 2^(b+1) - 1)`.
const BUCKETS: usize = 32;

/// Per-bucket counts are halved past this, so the curve follows an engine whose behaviour
/// changes (load, configuration) instead of averaging over its whole life.
const MAX_COUNT: u32 = 256;

/// Survival counts by age bucket, learned per instance from cached-token reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct CacheSurvival {
    /// Blocks found held, by age bucket.
    held: [u32; BUCKETS],
    /// Blocks found evicted, by age bucket.
    evicted: [u32; BUCKETS],
}

fn bucket(age: u64) -> usize {
    ((u64::BITS - (age + 1).leading_zeros() - 1) as usize).min(BUCKETS - 1)
}

impl CacheSurvival {
    /// Probability that a block of this age is still held: the share held in its bucket (one
    /// held observation as the prior, so an instance never seen evicting is trusted), never
    /// above the estimate for younger blocks (caches keep the more recent first).
    pub fn p_held(&self, age: u64) -> f64 {
        let last = bucket(age);
        let mut p: f64 = 1.0;
        for b in 0..=last {
            let (h, e) = (f64::from(self.held[b]), f64::from(self.evicted[b]));
            p = p.min((h + 1.0) / (h + e + 1.0));
        }
        p
    }

    /// Records a block of `age` found held.
    pub fn record_held(&mut self, age: u64) {
        let b = bucket(age);
        self.held[b] += 1;
        self.decay(b);
    }

    /// Records a block of `age` found evicted.
    pub fn record_evicted(&mut self, age: u64) {
        let b = bucket(age);
        self.evicted[b] += 1;
        self.decay(b);
    }

    fn decay(&mut self, b: usize) {
        if self.held[b] + self.evicted[b] > MAX_COUNT {
            self.held[b] /= 2;
            self.evicted[b] /= 2;
        }
    }

    /// Observations recorded (after decay).
    pub fn observations(&self) -> u32 {
        self.held.iter().chain(&self.evicted).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_log2_of_age() {
        assert_eq!(bucket(0), 0);
        assert_eq!(bucket(1), 1);
        assert_eq!(bucket(2), 1);
        assert_eq!(bucket(3), 2);
        assert_eq!(bucket(6), 2);
        assert_eq!(bucket(7), 3);
        assert_eq!(bucket(u64::MAX - 1), BUCKETS - 1);
    }

    #[test]
    fn an_unseen_instance_is_trusted() {
        let s = CacheSurvival::default();
        assert_eq!(s.p_held(0), 1.0);
        assert_eq!(s.p_held(1 << 20), 1.0);
    }

    #[test]
    fn evictions_lower_the_curve_from_their_age_on() {
        let mut s = CacheSurvival::default();
        for _ in 0..9 {
            s.record_held(10);
            s.record_evicted(1000);
        }
        assert!(s.p_held(10) > 0.99);
        assert!(s.p_held(1000) < 0.11);
        // Older than an eviction is never likelier to be held.
        assert!(s.p_held(100_000) <= s.p_held(1000));
    }

    #[test]
    fn counts_decay_so_the_curve_follows_change() {
        let mut s = CacheSurvival::default();
        for _ in 0..1000 {
            s.record_evicted(50);
        }
        assert!(s.p_held(50) < 0.01);
        for _ in 0..600 {
            s.record_held(50);
        }
        assert!(s.p_held(50) > 0.9, "{}", s.p_held(50));
        assert!(s.observations() <= 2 * MAX_COUNT);
    }
}
