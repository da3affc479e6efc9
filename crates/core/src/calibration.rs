//! How the `cost` estimate's wait and prefill turn into observed first tokens, learned.
//!
//! The estimate adds a queue wait and a prefill time, each from its own model (work queued ahead
//! at the learned speed, slots and batches; uncached tokens at the learned speed). Either can be
//! off by a factor the other is not: on real llama.cpp a prefill took about 1.3x its estimate
//! (attention grows with the prompt, the other slot's decode shares the batch) while a wait took
//! 0.8x; in the simulator's conversation workloads prefill 1.6-1.9x and wait 0.8-1.0x. Routing
//! trades one against the other (a cache hit saves prefill, a move saves wait), so a bias in
//! their ratio moves every such trade. Each first token gives one sample: observed TTFT against
//! the raw wait and prefill estimates of the chosen instance. A weighted least-squares plane
//! through them (with an intercept, the part neither explains) gives what each estimated second
//! is worth in observed seconds; the `cost` policy prices its terms at those factors once the
//! fit stands clear of its noise.

use serde::Serialize;

use crate::decode_slope::{PlaneMoments, PlaneSums};

/// First tokens a fit needs before it is used.
const MIN_SAMPLES: u32 = 64;

/// Samples fade by `1 - 1/WINDOW` each: one fit for the whole fleet, so a window of a few hundred
/// first tokens spans many instances' and loads' samples while still following a change of
/// workload.
const WINDOW: f64 = 512.0;

/// A factor is used only when its standard error is below this share of it: a coefficient that
/// noise can halve must not reprice every trade.
const MAX_RELATIVE_ERROR: f64 = 0.2;

/// Factors are kept within this ratio of 1 either way: the estimate's own models are not
/// thrown away on a fit that a burst of outliers bent.
const MAX_FACTOR: f64 = 4.0;

/// What an estimated second of wait and of prefill are worth in observed seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TtftScale {
    /// Observed seconds per estimated second of wait.
    pub wait: f64,
    /// Observed seconds per estimated second of prefill.
    pub prefill: f64,
}

impl Default for TtftScale {
    fn default() -> Self {
        Self {
            wait: 1.0,
            prefill: 1.0,
        }
    }
}

/// The exponentially weighted fit of observed TTFT against estimated wait and prefill.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct TtftCalibration {
    /// First tokens seen (saturating).
    pub samples: u32,
    /// The factors in use (1 until trusted).
    pub scale: TtftScale,
    /// x: wait, z: prefill, y: observed TTFT.
    #[serde(skip)]
    sums: PlaneSums,
}

impl TtftCalibration {
    /// Adds one first token: the raw (uncalibrated) `wait_s` and `prefill_s` the router
    /// estimated for the instance it chose, and the `observed_s` time to first token.
    pub fn observe(&mut self, wait_s: f64, prefill_s: f64, observed_s: f64) {
        let finite = wait_s.is_finite() && prefill_s.is_finite() && observed_s.is_finite();
        if !finite || wait_s < 0.0 || prefill_s < 0.0 || observed_s < 0.0 {
            return;
        }
        self.sums
            .add(wait_s, prefill_s, observed_s, 1.0 - 1.0 / WINDOW);
        self.samples = self.samples.saturating_add(1);
        if let Some(scale) = self.trusted_fit() {
            self.scale = scale;
        }
    }

    /// The two coefficients, each clamped to [1 / MAX_FACTOR, MAX_FACTOR], when both are known
    /// to `MAX_RELATIVE_ERROR`; `None` keeps the factors in use.
    fn trusted_fit(&self) -> Option<TtftScale> {
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
        let vyy = vyy.max(0.0);
        let det = vxx * vzz - vxz * vxz;
        // Both regressors must vary, and not together: a fleet that never queues says nothing
        // of what a wait is worth.
        if vxx <= 1e-12 || vzz <= 1e-12 || det <= 1e-6 * vxx * vzz {
            return None;
        }
        let b = (vxy * vzz - vzy * vxz) / det;
        let c = (vzy * vxx - vxy * vxz) / det;
        let residual = (vyy - b * vxy - c * vzy).max(0.0);
        // The weights' effective sample count, bounded by the samples seen.
        let effective = f64::from(self.samples).min(w * 2.0) - 3.0;
        let se_b = (residual * vzz / (det * effective)).sqrt();
        let se_c = (residual * vxx / (det * effective)).sqrt();
        let known = |coef: f64, se: f64| coef > 0.0 && se <= MAX_RELATIVE_ERROR * coef;
        if !known(b, se_b) || !known(c, se_c) {
            return None;
        }
        let bound = |coef: f64| coef.clamp(1.0 / MAX_FACTOR, MAX_FACTOR);
        Some(TtftScale {
            wait: bound(b),
            prefill: bound(c),
        })
    }
}

/// Samples fade by `1 - 1/ERROR_WINDOW` in [`PredictionChoice`]'s running errors.
const ERROR_WINDOW: f64 = 256.0;

/// Which TTFT prediction the router reports: at face value, or with the wait and prefill at
/// their learned worth. The calibrated one is far better where queues dominate (the suite's
/// overload rows: median relative error 0.78 -> 0.07 on zipf) and worse where one fleet-wide
/// fit mixes kinds of first tokens (a PD fleet's hand-offs and whole runs: 0.21 -> 0.43), so
/// each prediction's recent error is kept and the one that has predicted better is reported.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct PredictionChoice {
    /// Running mean relative error of the face-value prediction.
    pub face_value_error: f64,
    /// Running mean relative error of the calibrated prediction.
    pub calibrated_error: f64,
    /// First tokens behind the two means (saturating).
    pub samples: u32,
}

impl PredictionChoice {
    /// Whether the calibrated prediction is the one to report (face value until it has
    /// predicted better over the samples seen).
    pub fn calibrated(&self) -> bool {
        self.samples >= MIN_SAMPLES && self.calibrated_error < self.face_value_error
    }

    /// Adds one first token's relative errors of both predictions.
    pub fn observe(&mut self, face_value_error: f64, calibrated_error: f64) {
        if !(face_value_error.is_finite() && calibrated_error.is_finite()) {
            return;
        }
        self.samples = self.samples.saturating_add(1);
        // The plain mean until the window is full, so the first samples are not a prior's.
        let rate = (1.0 / f64::from(self.samples)).max(1.0 / ERROR_WINDOW);
        self.face_value_error += rate * (face_value_error - self.face_value_error);
        self.calibrated_error += rate * (calibrated_error - self.calibrated_error);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic spread of (wait, prefill) pairs that vary independently.
    fn spread(i: u32) -> (f64, f64) {
        let wait = f64::from(i % 7) * 0.02;
        let prefill = f64::from((i * 3) % 11) * 0.01;
        (wait, prefill)
    }

    #[test]
    fn a_prefill_slower_than_estimated_is_learned_apart_from_the_wait() {
        let mut calibration = TtftCalibration::default();
        for i in 0..2000 {
            let (wait, prefill) = spread(i);
            let jitter = if i % 2 == 0 { 0.002 } else { -0.002 };
            calibration.observe(wait, prefill, 0.02 + 0.8 * wait + 1.3 * prefill + jitter);
        }
        let scale = calibration.scale;
        assert!((scale.wait - 0.8).abs() < 0.02, "{scale:?}");
        assert!((scale.prefill - 1.3).abs() < 0.02, "{scale:?}");
    }

    #[test]
    fn nothing_is_repriced_before_the_fit_stands_out_of_its_noise() {
        let mut calibration = TtftCalibration::default();
        for i in 0..MIN_SAMPLES - 1 {
            let (wait, prefill) = spread(i);
            calibration.observe(wait, prefill, 2.0 * (wait + prefill));
        }
        assert_eq!(calibration.scale, TtftScale::default());
        // Observed times that the estimates do not explain at all.
        let mut noise = TtftCalibration::default();
        for i in 0..2000u32 {
            let (wait, prefill) = spread(i);
            let observed = f64::from((i * 7919) % 101) * 0.01;
            noise.observe(wait, prefill, observed);
        }
        assert_eq!(noise.scale, TtftScale::default());
    }

    #[test]
    fn a_fleet_that_never_queues_keeps_the_wait_unpriced_by_the_fit() {
        let mut calibration = TtftCalibration::default();
        for i in 0..2000 {
            let (_, prefill) = spread(i);
            calibration.observe(0.0, prefill, 0.01 + 2.0 * prefill);
        }
        assert_eq!(calibration.scale, TtftScale::default());
    }

    #[test]
    fn the_prediction_that_has_predicted_better_is_reported() {
        let mut choice = PredictionChoice::default();
        for _ in 0..MIN_SAMPLES - 1 {
            choice.observe(0.5, 0.1);
        }
        assert!(!choice.calibrated(), "too few samples: {choice:?}");
        choice.observe(0.5, 0.1);
        assert!(choice.calibrated(), "{choice:?}");
        for _ in 0..2000 {
            choice.observe(0.1, 0.4);
        }
        assert!(!choice.calibrated(), "{choice:?}");
        choice.observe(f64::NAN, 0.0);
        assert!(!choice.calibrated(), "{choice:?}");
    }

    #[test]
    fn factors_stay_within_bounds_and_bad_samples_are_ignored() {
        let mut calibration = TtftCalibration::default();
        calibration.observe(f64::NAN, 0.1, 0.1);
        calibration.observe(0.1, -1.0, 0.1);
        assert_eq!(calibration.samples, 0);
        for i in 0..2000 {
            let (wait, prefill) = spread(i);
            calibration.observe(wait, prefill, 40.0 * wait + 0.01 * prefill + 0.5);
        }
        let scale = calibration.scale;
        assert!(
            scale.wait <= MAX_FACTOR && scale.wait >= 1.0 / MAX_FACTOR,
            "{scale:?}"
        );
    }
}
