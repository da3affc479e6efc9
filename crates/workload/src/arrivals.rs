//! Arrival processes: when requests (or chat sessions) arrive.
//!
//! All times are seconds from the start of the run, non-decreasing. The first
//! arrival is at `t = 0` for every process, as in SGLang's and vLLM's bench
//! loops, which send the first request at once and sleep between the rest.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Exp, Gamma};
use serde::{Deserialize, Serialize};

use crate::error::{ensure, Result};
use crate::request::Request;

/// How arrivals are spaced.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ArrivalProcess {
    /// Everything at `t = 0` (SGLang's `--request-rate inf`).
    #[default]
    Instant,
    /// Evenly spaced, `rate` per second.
    Constant {
        /// Arrivals per second.
        rate: f64,
    },
    /// Poisson process: exponential gaps with mean `1 / rate`.
    Poisson {
        /// Arrivals per second (λ).
        rate: f64,
    },
    /// Bursty renewal process: gamma gaps with mean `1 / rate` and
    /// coefficient of variation `cv` (`cv = 1` is Poisson, `cv > 1` burstier).
    Gamma {
        /// Arrivals per second.
        rate: f64,
        /// Standard deviation of a gap over its mean.
        cv: f64,
    },
}

impl ArrivalProcess {
    /// Checks the parameters.
    pub fn validate(&self) -> Result<()> {
        let rate_ok = |r: f64| r.is_finite() && r > 0.0;
        match *self {
            ArrivalProcess::Instant => Ok(()),
            ArrivalProcess::Constant { rate } | ArrivalProcess::Poisson { rate } => {
                ensure(rate_ok(rate), || {
                    format!("arrival rate must be > 0, got {rate}")
                })
            }
            ArrivalProcess::Gamma { rate, cv } => {
                ensure(rate_ok(rate), || {
                    format!("arrival rate must be > 0, got {rate}")
                })?;
                ensure(cv.is_finite() && cv > 0.0, || {
                    format!("gamma cv must be > 0, got {cv}")
                })
            }
        }
    }

    /// The infinite, deterministic sequence of arrival times for `seed`.
    pub fn times(&self, seed: u64) -> Result<ArrivalTimes> {
        self.validate()?;
        let gaps = match *self {
            ArrivalProcess::Instant => Gaps::Fixed(0.0),
            ArrivalProcess::Constant { rate } => Gaps::Fixed(1.0 / rate),
            ArrivalProcess::Poisson { rate } => Gaps::Exp(Exp::new(rate).map_err(bad)?),
            ArrivalProcess::Gamma { rate, cv } => {
                // shape k = 1/cv², scale θ = 1/(λk): mean kθ = 1/λ, cv = 1/√k.
                let shape = 1.0 / (cv * cv);
                Gaps::Gamma(Gamma::new(shape, 1.0 / (rate * shape)).map_err(bad)?)
            }
        };
        Ok(ArrivalTimes {
            gaps,
            rng: ChaCha8Rng::seed_from_u64(seed),
            next: 0,
            now: 0.0,
        })
    }
}

/// Maps a distribution constructor's error into `InvalidSpec`.
fn bad(e: impl std::fmt::Display) -> crate::WorkloadError {
    crate::WorkloadError::InvalidSpec(e.to_string())
}

/// Gap distribution behind an [`ArrivalTimes`].
#[derive(Clone, Debug)]
enum Gaps {
    Fixed(f64),
    Exp(Exp<f64>),
    Gamma(Gamma<f64>),
}

/// Infinite iterator of arrival times; see [`ArrivalProcess::times`].
#[derive(Clone, Debug)]
pub struct ArrivalTimes {
    gaps: Gaps,
    rng: ChaCha8Rng,
    next: u64,
    now: f64,
}

impl Iterator for ArrivalTimes {
    type Item = f64;

    fn next(&mut self) -> Option<f64> {
        let t = match &self.gaps {
            // Multiplying instead of accumulating keeps long constant-rate
            // runs free of rounding drift.
            Gaps::Fixed(gap) => *gap * self.next as f64,
            Gaps::Exp(d) if self.next > 0 => self.now + d.sample(&mut self.rng),
            Gaps::Gamma(d) if self.next > 0 => self.now + d.sample(&mut self.rng),
            _ => 0.0,
        };
        self.next += 1;
        self.now = t;
        Some(t)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (usize::MAX, None)
    }
}

/// Wrapper that replaces each request's arrival time with a process's.
#[derive(Clone, Debug)]
pub struct Retimed<I> {
    inner: I,
    times: ArrivalTimes,
}

impl<I> Retimed<I> {
    /// Retimes `inner` with `process`, seeded by `seed`.
    pub fn new(inner: I, process: &ArrivalProcess, seed: u64) -> Result<Self> {
        Ok(Self {
            inner,
            times: process.times(seed)?,
        })
    }
}

impl<I: Iterator<Item = Request>> Iterator for Retimed<I> {
    type Item = Request;

    fn next(&mut self) -> Option<Request> {
        let mut r = self.inner.next()?;
        // ArrivalTimes never ends; 0.0 is unreachable.
        r.arrival_s = self.times.next().unwrap_or(0.0);
        Some(r)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Mean gap and coefficient of variation of the gaps of `n` arrivals.
    fn stats(p: &ArrivalProcess, seed: u64, n: usize) -> (f64, f64) {
        let t: Vec<f64> = p.times(seed).unwrap().take(n).collect();
        assert_eq!(t[0], 0.0);
        let gaps: Vec<f64> = t.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps.iter().all(|g| *g >= 0.0), "times must not decrease");
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
        (mean, var.sqrt() / mean)
    }

    #[test]
    fn poisson_rate_and_cv() {
        // 200k gaps: the relative standard error of the mean is 1/√n ≈ 0.22%.
        let (mean, cv) = stats(&ArrivalProcess::Poisson { rate: 10.0 }, 1, 200_000);
        assert!((1.0 / mean - 10.0).abs() < 0.2, "rate {}", 1.0 / mean);
        assert!((cv - 1.0).abs() < 0.03, "cv {cv}");
    }

    #[test]
    fn gamma_rate_and_cv() {
        for &(rate, cv_want) in &[(5.0, 0.5), (20.0, 3.0)] {
            let p = ArrivalProcess::Gamma { rate, cv: cv_want };
            let (mean, cv) = stats(&p, 2, 200_000);
            assert!(
                (1.0 / mean - rate).abs() < rate * 0.03,
                "rate {} want {rate}",
                1.0 / mean
            );
            assert!(
                (cv - cv_want).abs() < cv_want * 0.05,
                "cv {cv} want {cv_want}"
            );
        }
    }

    proptest::proptest! {
        // A fixed proptest seed: the cases are random but the same every run,
        // so a 5-sigma tolerance can never flake.
        #![proptest_config(proptest::test_runner::Config {
            cases: 24,
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x5EED),
            ..Default::default()
        })]
        #[test]
        fn empirical_rate_matches(rate in 0.1f64..1000.0, cv in 0.2f64..3.0, seed in 0u64..1000, gamma: bool) {
            let p = if gamma {
                ArrivalProcess::Gamma { rate, cv }
            } else {
                ArrivalProcess::Poisson { rate }
            };
            let want_cv = if gamma { cv } else { 1.0 };
            let n = 50_000;
            let (mean, got_cv) = stats(&p, seed, n);
            // Relative standard error of the mean gap is cv/√n; allow 5σ.
            let tol = 5.0 * want_cv / (n as f64).sqrt();
            proptest::prop_assert!(((1.0 / mean) / rate - 1.0).abs() < tol, "rate {} want {rate}", 1.0 / mean);
            proptest::prop_assert!((got_cv / want_cv - 1.0).abs() < 0.15, "cv {got_cv} want {want_cv}");
        }
    }

    #[test]
    fn constant_and_instant() {
        let t: Vec<f64> = ArrivalProcess::Constant { rate: 4.0 }
            .times(0)
            .unwrap()
            .take(5)
            .collect();
        assert_eq!(t, [0.0, 0.25, 0.5, 0.75, 1.0]);
        assert!(ArrivalProcess::Instant
            .times(0)
            .unwrap()
            .take(10)
            .all(|t| t == 0.0));
    }

    #[test]
    fn deterministic_by_seed() {
        let p = ArrivalProcess::Gamma { rate: 3.0, cv: 2.0 };
        let a: Vec<f64> = p.times(9).unwrap().take(100).collect();
        let b: Vec<f64> = p.times(9).unwrap().take(100).collect();
        let c: Vec<f64> = p.times(10).unwrap().take(100).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn rejects_bad_parameters() {
        assert!(ArrivalProcess::Poisson { rate: 0.0 }.validate().is_err());
        assert!(ArrivalProcess::Poisson { rate: f64::NAN }
            .validate()
            .is_err());
        assert!(ArrivalProcess::Gamma { rate: 1.0, cv: 0.0 }
            .validate()
            .is_err());
        assert!(ArrivalProcess::Constant { rate: -1.0 }.times(0).is_err());
    }

    #[test]
    fn serde_tagged() {
        let p: ArrivalProcess =
            serde_json::from_str(r#"{"kind":"gamma","rate":2,"cv":4}"#).unwrap();
        assert_eq!(p, ArrivalProcess::Gamma { rate: 2.0, cv: 4.0 });
        let i: ArrivalProcess = serde_json::from_str(r#"{"kind":"instant"}"#).unwrap();
        assert_eq!(i, ArrivalProcess::Instant);
    }
}
