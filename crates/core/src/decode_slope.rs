//! What one more decoding sequence costs the others on an instance, learned from finished
//! requests.
//!
//! A GPU engine's decode step barely grows with its batch until the batch is large; a CPU
//! engine's (llama.cpp's slots) grows by about a millisecond per sequence on a small model.
//! No constant prices both. Each finished request gives one sample: its time per output token
//! against the mean number of sequences that decoded beside it. The slope of a weighted
//! least-squares line through those samples is the instance's marginal step time per
//! sequence; it is trusted only once the samples span enough different batch sizes for the
//! slope to stand out of their scatter.

use serde::Serialize;

/// Finished requests a slope needs before it is used.
const MIN_SAMPLES: u32 = 8;

/// The slope must exceed this many standard errors to be trusted: on an engine whose batch
/// is free (a GPU at small batch) the fit is noise around zero, and noise must not price
/// anything.
const TRUST_STANDARD_ERRORS: f64 = 2.0;

/// Exponentially weighted sums behind a least-squares plane y = a + b·x + c·z: w, x, z, y, x²,
/// z², xz, xy, zy, y² (shared by the fits of the decode slope and of the TTFT estimate).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct PlaneSums([f64; 10]);

/// The weighted total and (co)variances of a [`PlaneSums`], unclamped.
pub(crate) struct PlaneMoments {
    pub w: f64,
    pub vxx: f64,
    pub vzz: f64,
    pub vxz: f64,
    pub vxy: f64,
    pub vzy: f64,
    pub vyy: f64,
}

impl PlaneSums {
    /// Adds one sample after fading the earlier ones by `keep`.
    pub(crate) fn add(&mut self, x: f64, z: f64, y: f64, keep: f64) {
        let values = [1.0, x, z, y, x * x, z * z, x * z, x * y, z * y, y * y];
        for (sum, value) in self.0.iter_mut().zip(values) {
            *sum = *sum * keep + value;
        }
    }

    /// The weighted total, variances and covariances.
    pub(crate) fn moments(&self) -> PlaneMoments {
        let [w, sx, sz, sy, sxx, szz, sxz, sxy, szy, syy] = self.0;
        let (mx, mz, my) = (sx / w, sz / w, sy / w);
        PlaneMoments {
            w,
            vxx: sxx / w - mx * mx,
            vzz: szz / w - mz * mz,
            vxz: sxz / w - mx * mz,
            vxy: sxy / w - mx * my,
            vzy: szy / w - mz * my,
            vyy: syy / w - my * my,
        }
    }
}

/// An exponentially weighted least-squares fit of time per output token against sequences
/// decoding at once and prefill tokens computed per output token beside it (so that the
/// stalls of long prompts prefilled among the answers, which grow with the load too, are not
/// read as the batch's cost).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct DecodeSlope {
    /// Samples seen (saturating).
    pub samples: u32,
    /// The trusted marginal step time per decoding sequence, s (0 until trusted).
    pub per_sequence_s: f64,
    /// x: batch, z: prefill tokens per output token, y: time per output token.
    #[serde(skip)]
    sums: PlaneSums,
}

impl DecodeSlope {
    /// Adds one finished request: `batch` sequences decoding on average during its answer
    /// (itself included), `prefill_per_token` prompt tokens the instance prefilled per output
    /// token meanwhile, `time_per_token_s` its decode time per output token. Older samples fade
    /// by `1 - rate` per sample.
    pub fn observe(
        &mut self,
        batch: f64,
        prefill_per_token: f64,
        time_per_token_s: f64,
        rate: f64,
    ) {
        let finite =
            batch.is_finite() && prefill_per_token.is_finite() && time_per_token_s.is_finite();
        if !finite || batch < 0.0 || prefill_per_token < 0.0 {
            return;
        }
        let keep = 1.0 - rate.clamp(1e-6, 1.0);
        self.sums
            .add(batch, prefill_per_token, time_per_token_s, keep);
        self.samples = self.samples.saturating_add(1);
        self.per_sequence_s = self.trusted_slope().unwrap_or(0.0);
    }

    /// The batch coefficient of the fit when it stands `TRUST_STANDARD_ERRORS` above zero.
    fn trusted_slope(&self) -> Option<f64> {
        if self.samples < MIN_SAMPLES {
            return None;
        }
        let PlaneMoments {
            w,
            vxx,
            vzz,
            vxz,
            vxy,
            vzy,
            vyy,
        } = self.sums.moments();
        let (vzz, vyy) = (vzz.max(0.0), vyy.max(0.0));
        if vxx <= 1e-9 {
            return None;
        }
        // Without spread in the prefill regressor, the one-variable fit.
        let (slope, explained, vx_given_z) = if vzz <= 1e-12 {
            (vxy / vxx, vxy * vxy / vxx, vxx)
        } else {
            let det = vxx * vzz - vxz * vxz;
            if det <= 1e-12 * vxx * vzz {
                return None;
            }
            let b = (vxy * vzz - vzy * vxz) / det;
            let c = (vzy * vxx - vxy * vxz) / det;
            (b, b * vxy + c * vzy, det / vzz)
        };
        // Residual variance, and the slope's standard error with the weights' effective
        // sample count (Kish: about 2 / rate - 1; bounded by the samples seen).
        let residual = (vyy - explained).max(0.0);
        let effective = f64::from(self.samples).min(w * 2.0).max(4.0);
        let se = (residual / (vx_given_z * (effective - 3.0))).sqrt();
        (slope > TRUST_STANDARD_ERRORS * se).then_some(slope)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_that_costs_a_millisecond_per_sequence_is_learned() {
        let mut slope = DecodeSlope::default();
        for i in 0..200 {
            let batch = f64::from(1 + i % 6);
            let jitter = if i % 2 == 0 { 0.0002 } else { -0.0002 };
            slope.observe(batch, 0.0, 0.002 + 0.001 * batch + jitter, 0.1);
        }
        assert!((slope.per_sequence_s - 0.001).abs() < 0.0001, "{slope:?}");
    }

    #[test]
    fn prefill_stalls_that_grow_with_the_load_are_not_read_as_the_batchs_cost() {
        let mut slope = DecodeSlope::default();
        for i in 0..400u32 {
            let batch = f64::from(1 + i % 6);
            // More load brings more prompts to prefill; each prompt token stalls the answers
            // 30 µs, each sequence beside them costs 1 ms a step.
            let prefill = batch * 20.0 + f64::from((i * 7) % 11) * 10.0;
            slope.observe(
                batch,
                prefill,
                0.002 + 0.001 * batch + 0.00003 * prefill,
                0.1,
            );
        }
        assert!((slope.per_sequence_s - 0.001).abs() < 0.0001, "{slope:?}");
    }

    #[test]
    fn a_free_batch_prices_nothing() {
        let mut slope = DecodeSlope::default();
        for i in 0..200 {
            let batch = f64::from(1 + i % 6);
            // Scatter that does not follow the batch size.
            let noise = f64::from((i * 7919) % 13) * 0.0001;
            slope.observe(batch, 0.0, 0.01 + noise, 0.1);
        }
        assert!(slope.per_sequence_s < 0.0002, "{slope:?}");
    }

    #[test]
    fn one_batch_size_teaches_no_slope() {
        let mut slope = DecodeSlope::default();
        for i in 0..100 {
            slope.observe(2.0, 0.0, 0.002 + f64::from(i % 3) * 0.001, 0.1);
        }
        assert_eq!(slope.per_sequence_s, 0.0);
    }

    #[test]
    fn too_few_samples_price_nothing() {
        let mut slope = DecodeSlope::default();
        for batch in 1..MIN_SAMPLES {
            slope.observe(f64::from(batch), 0.0, 0.001 * f64::from(batch), 0.1);
        }
        assert_eq!(slope.per_sequence_s, 0.0);
        slope.observe(9.0, 0.0, 0.009, 0.1);
        assert!(slope.per_sequence_s > 0.0);
    }

    #[test]
    fn bad_samples_are_ignored() {
        let mut slope = DecodeSlope::default();
        slope.observe(f64::NAN, 0.0, 0.01, 0.1);
        slope.observe(1.0, 0.0, f64::INFINITY, 0.1);
        slope.observe(-1.0, 0.0, 0.01, 0.1);
        slope.observe(1.0, -1.0, 0.01, 0.1);
        assert_eq!(slope.samples, 0);
    }
}
