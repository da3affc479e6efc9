//! Small distributions shared by the generators.

use rand::Rng;
use rand_distr::{Distribution, Exp, LogNormal, Zipf};
use serde::{Deserialize, Serialize};

use crate::error::{ensure, Result};
use crate::WorkloadError;

/// A whole number: fixed, uniform over `[min, max]` (inclusive), or long-tailed (log-normal,
/// clamped to `[min, max]`).
///
/// In JSON a plain number means fixed: `128`, `{"min": 64, "max": 256}` or
/// `{"median": 1024, "sigma": 1.0, "min": 64, "max": 32768}`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Count {
    /// Always this value.
    Fixed(u32),
    /// Log-normal: `exp(N(ln median, sigma²))`, rounded and clamped to `[min, max]`
    /// (listed before `Uniform` so that its extra fields decide the untagged parse).
    LogNormal {
        /// Median of the unclamped distribution.
        median: u32,
        /// Standard deviation of the logarithm (1.0: the 90th percentile is 3.6× the median).
        sigma: f64,
        /// Smallest value.
        min: u32,
        /// Largest value.
        max: u32,
    },
    /// Uniform over `min..=max`.
    Uniform {
        /// Smallest value.
        min: u32,
        /// Largest value.
        max: u32,
    },
}

impl Count {
    /// Checks `min <= max`.
    pub fn validate(&self, what: &str) -> Result<()> {
        match *self {
            Count::Fixed(_) => Ok(()),
            Count::Uniform { min, max } => {
                ensure(min <= max, || format!("{what}: min {min} > max {max}"))
            }
            Count::LogNormal {
                median,
                sigma,
                min,
                max,
            } => {
                ensure(min <= max, || format!("{what}: min {min} > max {max}"))?;
                ensure(median >= 1, || format!("{what}: median must be >= 1"))?;
                ensure(sigma.is_finite() && sigma >= 0.0, || {
                    format!("{what}: sigma must be finite and >= 0, got {sigma}")
                })
            }
        }
    }

    /// Draws a value (a fixed count draws nothing from `rng`).
    pub fn sample(&self, rng: &mut impl Rng) -> u32 {
        match *self {
            Count::Fixed(n) => n,
            Count::Uniform { min, max } => rng.random_range(min..=max),
            Count::LogNormal {
                median,
                sigma,
                min,
                max,
            } => match LogNormal::new(f64::from(median.max(1)).ln(), sigma) {
                Ok(d) => (d.sample(rng).round().clamp(f64::from(min), f64::from(max))) as u32,
                // Unreachable after validate: sigma is finite and non-negative.
                Err(_) => median.clamp(min, max),
            },
        }
    }

    /// The smallest value this can produce.
    pub fn min(&self) -> u32 {
        match *self {
            Count::Fixed(n) => n,
            Count::Uniform { min, .. } | Count::LogNormal { min, .. } => min,
        }
    }
}

/// A delay in seconds: fixed or exponential.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Delay {
    /// Always this many seconds.
    Fixed {
        /// Seconds.
        seconds: f64,
    },
    /// Exponential with this mean.
    Exponential {
        /// Mean seconds.
        mean_s: f64,
    },
}

impl Delay {
    /// Checks the delay is finite and non-negative.
    pub fn validate(&self) -> Result<()> {
        let (Delay::Fixed { seconds: v } | Delay::Exponential { mean_s: v }) = *self;
        ensure(v.is_finite() && v >= 0.0, || {
            format!("delay must be finite and >= 0, got {v}")
        })
    }

    /// Draws a delay; `validate` must have passed.
    pub fn sample(&self, rng: &mut impl Rng) -> f64 {
        match *self {
            Delay::Fixed { seconds } => seconds,
            Delay::Exponential { mean_s } if mean_s > 0.0 => match Exp::new(1.0 / mean_s) {
                Ok(d) => d.sample(rng),
                // Unreachable after validate: 1/mean is finite and positive.
                Err(_) => mean_s,
            },
            Delay::Exponential { .. } => 0.0,
        }
    }
}

/// Zipf popularity over `n` ranks: rank `r` (0-based) has weight `1/(r+1)^s`.
#[derive(Clone, Copy, Debug)]
pub struct ZipfRanks {
    dist: Zipf<f64>,
    n: usize,
}

impl ZipfRanks {
    /// Popularity over `n >= 1` ranks with exponent `s >= 0` (0 is uniform).
    pub fn new(n: usize, s: f64) -> Result<Self> {
        ensure(n >= 1, || "Zipf needs at least one rank".into())?;
        ensure(s.is_finite() && s >= 0.0, || {
            format!("Zipf exponent must be finite and >= 0, got {s}")
        })?;
        let dist = Zipf::new(n as f64, s).map_err(|e| WorkloadError::InvalidSpec(e.to_string()))?;
        Ok(Self { dist, n })
    }

    /// Draws a 0-based rank; rank 0 is the most popular.
    pub fn sample(&self, rng: &mut impl Rng) -> usize {
        // The distribution yields integral floats in [1, n]; clamp guards
        // against a float edge case rather than trusting it blindly.
        (self.dist.sample(rng) as usize).clamp(1, self.n) - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn count_serde_and_sample() {
        let f: Count = serde_json::from_str("7").unwrap();
        assert_eq!(f, Count::Fixed(7));
        let u: Count = serde_json::from_str(r#"{"min":2,"max":4}"#).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let mut seen = [false; 5];
        for _ in 0..200 {
            let v = u.sample(&mut rng);
            assert!((2..=4).contains(&v));
            seen[v as usize] = true;
        }
        assert_eq!(seen, [false, false, true, true, true]);
        assert!(Count::Uniform { min: 3, max: 2 }.validate("x").is_err());
    }

    #[test]
    fn log_normal_counts_are_long_tailed_and_clamped() {
        let c: Count =
            serde_json::from_str(r#"{"median": 1000, "sigma": 1.0, "min": 50, "max": 20000}"#)
                .unwrap();
        assert!(matches!(c, Count::LogNormal { median: 1000, .. }));
        assert_eq!(
            serde_json::from_str::<Count>(&serde_json::to_string(&c).unwrap()).unwrap(),
            c
        );
        c.validate("x").unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let mut v: Vec<u32> = (0..20_000).map(|_| c.sample(&mut rng)).collect();
        v.sort_unstable();
        assert!(v.iter().all(|&x| (50..=20_000).contains(&x)));
        let median = v[v.len() / 2];
        assert!((900..1100).contains(&median), "{median}");
        // exp(1.2816) = 3.6: the 90th percentile is about 3.6× the median.
        let p90 = v[v.len() * 9 / 10];
        assert!((3200..4000).contains(&p90), "{p90}");
        let bad = Count::LogNormal {
            median: 10,
            sigma: -1.0,
            min: 1,
            max: 5,
        };
        assert!(bad.validate("x").is_err());
        // A plain range still parses as uniform.
        let u: Count = serde_json::from_str(r#"{"min":2,"max":4}"#).unwrap();
        assert_eq!(u, Count::Uniform { min: 2, max: 4 });
    }

    #[test]
    fn delay_mean() {
        let d = Delay::Exponential { mean_s: 2.0 };
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let n = 100_000;
        let mean = (0..n).map(|_| d.sample(&mut rng)).sum::<f64>() / n as f64;
        assert!((mean - 2.0).abs() < 0.05, "{mean}");
        assert!(Delay::Fixed { seconds: -1.0 }.validate().is_err());
    }

    #[test]
    fn zipf_exponent_zero_is_uniform() {
        let z = ZipfRanks::new(4, 0.0).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let mut counts = [0u32; 4];
        for _ in 0..40_000 {
            counts[z.sample(&mut rng)] += 1;
        }
        for c in counts {
            assert!((9_000..11_000).contains(&c), "{counts:?}");
        }
    }

    proptest! {
        #[test]
        fn zipf_rank_one_most_frequent(n in 2usize..50, s in 0.5f64..2.5, seed in any::<u64>()) {
            let z = ZipfRanks::new(n, s).unwrap();
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let mut counts = vec![0u32; n];
            for _ in 0..20_000 {
                counts[z.sample(&mut rng)] += 1;
            }
            let top = counts[0];
            // Rank 1 beats rank 2 by a factor 2^s >= 1.41, far beyond noise.
            prop_assert!(counts[1..].iter().all(|&c| c < top), "{:?}", counts);
        }
    }
}
