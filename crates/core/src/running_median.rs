//! A running median that forgets: the fixed part of each instance's first tokens.
//!
//! The part of a TTFT that no term of the estimate explains (the engine's HTTP handling,
//! tokenizing, scheduling, the network) differs by engine: a few milliseconds on a GPU server,
//! 20-40 ms on a llama.cpp server on a shared CPU. Its residuals are skewed (a queue the estimate
//! missed adds a long tail), so the median is tracked, not the mean: each sample moves the
//! estimate towards it by a step that follows the residuals' mean absolute deviation, so it
//! settles in a few tens of samples on any scale and then jitters by a small share of the spread.

use serde::Serialize;

/// An exponentially forgetting median estimate (stochastic approximation).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RunningMedian {
    /// The current estimate.
    pub value: f64,
    /// Samples taken so far.
    pub samples: u32,
    /// Moving mean absolute deviation of the samples from the estimate: the step's scale.
    #[serde(skip)]
    spread: f64,
}

impl RunningMedian {
    /// Starts at `prior`, with steps on the prior's own scale until samples say otherwise.
    pub fn new(prior: f64) -> Self {
        RunningMedian {
            value: prior,
            samples: 0,
            spread: prior.abs(),
        }
    }

    /// Takes one sample with learning rate `rate` (0..=1). Non-finite samples are ignored.
    pub fn update(&mut self, sample: f64, rate: f64) {
        if !sample.is_finite() {
            return;
        }
        let rate = rate.clamp(0.0, 1.0);
        let deviation = sample - self.value;
        // The first sample replaces the prior: a prior off by 10x would take many steps.
        if self.samples == 0 {
            self.value = sample;
            self.spread = deviation.abs();
        } else {
            self.spread += rate * (deviation.abs() - self.spread);
            let step = rate * self.spread;
            // Never past the sample: a step larger than the gap would oscillate around it.
            self.value += deviation.signum() * step.min(deviation.abs());
        }
        self.samples = self.samples.saturating_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn settles_on_the_median_of_a_skewed_stream() {
        // 30 ms fixed part, and a tail (missed queueing) on one sample in four: the mean is
        // far above the median, the tracker must not be.
        let mut rng = SmallRng::seed_from_u64(7);
        let mut m = RunningMedian::new(0.01);
        for _ in 0..2000 {
            let noise: f64 = rng.random_range(-0.002..0.002);
            let tail = if rng.random_range(0..4) == 0 {
                rng.random_range(0.05..0.5)
            } else {
                0.0
            };
            m.update(0.030 + noise + tail, 0.05);
        }
        assert!((m.value - 0.031).abs() < 0.004, "median {}", m.value);
    }

    #[test]
    fn follows_a_shift_and_ignores_bad_samples() {
        let mut m = RunningMedian::new(0.01);
        for _ in 0..500 {
            m.update(0.002, 0.05);
        }
        assert!((m.value - 0.002).abs() < 1e-4, "{}", m.value);
        m.update(f64::NAN, 0.05);
        m.update(f64::INFINITY, 0.05);
        assert!((m.value - 0.002).abs() < 1e-4, "{}", m.value);
        for i in 0..500 {
            // A little jitter keeps the step's scale alive, as real residuals do.
            m.update(0.040 + if i % 2 == 0 { 0.001 } else { -0.001 }, 0.05);
        }
        assert!((m.value - 0.040).abs() < 0.002, "{}", m.value);
        assert_eq!(m.samples, 1000);
    }

    #[test]
    fn the_first_sample_replaces_the_prior() {
        let mut m = RunningMedian::new(0.01);
        m.update(0.3, 0.05);
        assert_eq!(m.value, 0.3);
    }
}
