//! Prefill speed learned from observed TTFTs as `ttft = fixed + work / speed`.
//!
//! A TTFT has a fixed part (HTTP, tokenisation, scheduling, one engine step) and a part that grows
//! with the prefill work ahead of the first token. Dividing work by TTFT mixes the two: an
//! instance whose prompts mostly hit its cache does little work per request, so its TTFTs are
//! mostly the fixed part and it looks slow, and the router sends its conversations elsewhere
//! (seen on llama.cpp: identical engines learned 8k to 25k tokens/s, the slowest-looking ones
//! those with the most cache hits). A least-squares line through (work, TTFT) with exponential
//! forgetting separates the fixed part from the slope; until the samples spread enough to fit a
//! line, the slope is taken through the configured fixed part.

use serde::Serialize;

/// Work of the pseudo-sample at the prior that the first real sample is mixed with.
const PRIOR_WORK: f64 = 1000.0;

/// Moving moments of (work tokens, TTFT seconds) samples.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TtftFit {
    /// Weight of the samples so far (1 − (1 − rate)^n), so early fits know they are thin.
    weight: f64,
    mean_work: f64,
    mean_ttft: f64,
    mean_work2: f64,
    mean_work_ttft: f64,
}

impl Default for TtftFit {
    fn default() -> Self {
        TtftFit {
            weight: 0.0,
            mean_work: 0.0,
            mean_ttft: 0.0,
            mean_work2: 0.0,
            mean_work_ttft: 0.0,
        }
    }
}

/// What a fit says.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fitted {
    /// Prefill throughput, tokens/s.
    pub tokens_per_s: f64,
    /// Fixed part of a TTFT, seconds.
    pub fixed_s: f64,
}

impl TtftFit {
    /// Adds a sample with weight `rate` (the moving average's rate). The first sample is mixed
    /// with one at the prior (`PRIOR_WORK` tokens at the prior speed and fixed part), so that one
    /// odd first TTFT does not set the speed alone.
    pub fn add(&mut self, work_tokens: f64, ttft_s: f64, rate: f64, prior: (f64, f64)) {
        if self.weight == 0.0 {
            let (speed, fixed) = prior;
            let ttft = fixed + PRIOR_WORK / speed;
            self.mean_work = PRIOR_WORK;
            self.mean_ttft = ttft;
            self.mean_work2 = PRIOR_WORK * PRIOR_WORK;
            self.mean_work_ttft = PRIOR_WORK * ttft;
        }
        let mix = |m: &mut f64, v: f64| *m += rate * (v - *m);
        mix(&mut self.mean_work, work_tokens);
        mix(&mut self.mean_ttft, ttft_s);
        mix(&mut self.mean_work2, work_tokens * work_tokens);
        mix(&mut self.mean_work_ttft, work_tokens * ttft_s);
        self.weight += rate * (1.0 - self.weight);
    }

    /// The line through the samples, given the prior speed and fixed part; the speed stays within
    /// 1/16 and 16 times the prior (one odd sample must not make an instance look free or dead).
    pub fn fitted(&self, prior_tokens_per_s: f64, prior_fixed_s: f64) -> Fitted {
        let (lo, hi) = (prior_tokens_per_s / 16.0, prior_tokens_per_s * 16.0);
        if self.weight == 0.0 {
            return Fitted {
                tokens_per_s: prior_tokens_per_s,
                fixed_s: prior_fixed_s,
            };
        }
        let var = self.mean_work2 - self.mean_work * self.mean_work;
        let cov = self.mean_work_ttft - self.mean_work * self.mean_ttft;
        // A line needs the work to vary: a spread of at least a fifth of the mean work.
        let spread = var > 0.0 && var.sqrt() > 0.2 * self.mean_work && self.weight > 0.3;
        if spread && cov > 0.0 {
            let slope = cov / var;
            let fixed = self.mean_ttft - slope * self.mean_work;
            if fixed >= 0.0 {
                return Fitted {
                    tokens_per_s: (1.0 / slope).clamp(lo, hi),
                    fixed_s: fixed,
                };
            }
        }
        // Through the prior fixed part.
        let net = self.mean_ttft - prior_fixed_s;
        let tokens_per_s = if net > 0.0 && self.mean_work > 0.0 {
            (self.mean_work / net).clamp(lo, hi)
        } else if self.mean_work > 0.0 {
            hi
        } else {
            prior_tokens_per_s
        };
        Fitted {
            tokens_per_s,
            fixed_s: prior_fixed_s.min(self.mean_ttft.max(0.0)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fixed_part_does_not_pass_for_slowness() {
        // 20 ms fixed, 50k tokens/s: small prefills (cache hits) and large ones mixed.
        let mut fit = TtftFit::default();
        for i in 0..400 {
            let work = if i % 3 == 0 { 2000.0 } else { 100.0 };
            fit.add(work, 0.020 + work / 50_000.0, 0.05, (20_000.0, 0.01));
        }
        let f = fit.fitted(20_000.0, 0.01);
        assert!((f.tokens_per_s - 50_000.0).abs() < 500.0, "{f:?}");
        assert!((f.fixed_s - 0.020).abs() < 0.001, "{f:?}");
        // Work over TTFT would have said less than half the speed.
        let naive = fit.mean_work / fit.mean_ttft;
        assert!(naive < 25_000.0, "{naive}");
    }

    #[test]
    fn without_spread_the_slope_goes_through_the_prior_fixed_part() {
        let mut fit = TtftFit::default();
        for _ in 0..50 {
            fit.add(1000.0, 0.01 + 1000.0 / 40_000.0, 0.1, (20_000.0, 0.01));
        }
        let f = fit.fitted(20_000.0, 0.01);
        assert!((f.tokens_per_s - 40_000.0).abs() < 500.0, "{f:?}");
    }

    #[test]
    fn no_samples_is_the_prior_and_the_speed_stays_bounded() {
        assert_eq!(
            TtftFit::default().fitted(20_000.0, 0.01),
            Fitted {
                tokens_per_s: 20_000.0,
                fixed_s: 0.01
            }
        );
        let mut fit = TtftFit::default();
        for _ in 0..100 {
            fit.add(5000.0, 0.0, 0.1, (20_000.0, 0.01)); // first tokens before any time passed
        }
        assert_eq!(fit.fitted(20_000.0, 0.01).tokens_per_s, 320_000.0);
        let mut slow = TtftFit::default();
        for _ in 0..100 {
            slow.add(10.0, 100.0, 0.1, (20_000.0, 0.01));
        }
        assert_eq!(slow.fitted(20_000.0, 0.01).tokens_per_s, 1250.0);
        // One odd first sample moves the prior a step, not all the way.
        let mut one = TtftFit::default();
        one.add(9000.0, 0.03, 0.1, (20_000.0, 0.01));
        let speed = one.fitted(20_000.0, 0.01).tokens_per_s;
        assert!(speed > 20_000.0 && speed < 100_000.0, "{speed}");
    }
}
