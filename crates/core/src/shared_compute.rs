//! Whether an instance shares its compute with the others, learned from finished answers.
//!
//! Engines on separate accelerators do not slow each other down; engines that share a host's
//! CPU cores (llama.cpp servers on one machine) do: while the others are busy, each step here
//! takes longer. A prefill the router could have avoided (a conversation moved off the instance
//! holding its cache) then costs every other busy instance time too, which the request's own
//! estimate does not see. Each finished answer gives one sample: its time per output token
//! against the other instances busy meanwhile, with the two things that slow an answer on its
//! own instance beside it (the batch it decoded in and the prompts prefilled there), so that
//! load that merely comes at the same time as the others' is not read as sharing. The fit's
//! coefficient of the busy neighbours, over the time per token without any, is the share of
//! its speed the instance loses per busy neighbour; trusted only once it stands out of the
//! scatter, so that on separate devices it stays at zero.
//!
//! First tokens cannot tell this: requests arrive in bursts, so nearly every first token is
//! timed with the whole fleet busy; an answer outlasts the burst that started it, so the
//! number of busy neighbours varies over answers (docs/results.md, twenty-sixth session).

use serde::Serialize;

/// Finished answers a share needs before it is used.
const MIN_SAMPLES: u32 = 16;

/// The neighbours' coefficient must exceed this many standard errors: noise must not price
/// anything, and on separate devices the fit is noise around zero.
const TRUST_STANDARD_ERRORS: f64 = 3.0;

/// Regressors and the response: 1, batch, prefill per token, busy neighbours, time per token.
const DIM: usize = 5;

/// An exponentially weighted least-squares fit of an answer's time per output token against
/// its batch, the prompt tokens prefilled beside it per output token, and the other instances
/// busy meanwhile.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct SharedCompute {
    /// Samples seen (saturating).
    pub samples: u32,
    /// The trusted share of its speed the instance loses per other busy instance (0..=1; 0
    /// until trusted).
    pub share_per_neighbour: f64,
    /// Weighted sums of the products of [1, batch, prefill per token, neighbours, time].
    #[serde(skip)]
    sums: [[f64; DIM]; DIM],
}

impl SharedCompute {
    /// Adds one finished answer: `batch` sequences decoding on average beside it (itself
    /// included), `prefill_per_token` prompt tokens prefilled on its instance per output token,
    /// `neighbours_busy` other instances busy on average, `time_per_token_s` its time per
    /// output token. Older samples fade by `1 - rate` per sample.
    pub fn observe(
        &mut self,
        batch: f64,
        prefill_per_token: f64,
        neighbours_busy: f64,
        time_per_token_s: f64,
        rate: f64,
    ) {
        let values = [
            1.0,
            batch,
            prefill_per_token,
            neighbours_busy,
            time_per_token_s,
        ];
        if values.iter().any(|v| !v.is_finite() || *v < 0.0) {
            return;
        }
        let keep = 1.0 - rate.clamp(1e-6, 1.0);
        for (row, a) in self.sums.iter_mut().zip(values) {
            for (sum, b) in row.iter_mut().zip(values) {
                *sum = *sum * keep + a * b;
            }
        }
        self.samples = self.samples.saturating_add(1);
        self.share_per_neighbour = self.trusted_share().unwrap_or(0.0);
    }

    /// The neighbours' coefficient over the time per token with none busy, when the
    /// coefficient stands `TRUST_STANDARD_ERRORS` above zero.
    fn trusted_share(&self) -> Option<f64> {
        if self.samples < MIN_SAMPLES {
            return None;
        }
        let w = self.sums[0][0];
        if w <= 0.0 {
            return None;
        }
        let mean = |i: usize| self.sums[0][i] / w;
        let cov = |i: usize, j: usize| self.sums[i][j] / w - mean(i) * mean(j);
        // Regressors with spread; the neighbours' (3) must be one of them.
        let used: Vec<usize> = (1..4).filter(|&i| cov(i, i) > 1e-12).collect();
        let u = used.iter().position(|&i| i == 3)?;
        let k = used.len();
        let mut a = vec![vec![0.0; k]; k];
        let mut b = vec![0.0; k];
        for (r, &i) in used.iter().enumerate() {
            for (c, &j) in used.iter().enumerate() {
                a[r][c] = cov(i, j);
            }
            b[r] = cov(i, 4);
        }
        let coefficients = solve(a.clone(), b.clone())?;
        // The neighbours' diagonal element of the inverse: solve against its unit vector.
        let mut unit = vec![0.0; k];
        unit[u] = 1.0;
        let inverse_uu = solve(a, unit)?[u];
        let explained: f64 = coefficients.iter().zip(&b).map(|(c, v)| c * v).sum();
        let residual = (cov(4, 4) - explained).max(0.0);
        // The weights' effective sample count (about 2 / rate - 1), bounded by the samples.
        let effective = f64::from(self.samples).min(w * 2.0);
        let dof = effective - k as f64 - 1.0;
        if dof < 2.0 || inverse_uu <= 0.0 {
            return None;
        }
        let slope = coefficients[u];
        let se = (residual * inverse_uu / dof).sqrt();
        if slope <= TRUST_STANDARD_ERRORS * se {
            return None;
        }
        // Time per token with no neighbour busy, at the mean batch and prefill.
        let alone = mean(4) - slope * mean(3);
        Some(if alone > 0.0 {
            (slope / alone).min(1.0)
        } else {
            1.0
        })
    }
}

/// How many instances have requests in flight, integrated over time: the difference of two
/// readings over the time between them is the mean number busy meanwhile.
#[derive(Debug, Clone, Default)]
pub struct BusyInstances {
    /// Per fleet slot, whether it had requests in flight at the last update.
    busy: Vec<bool>,
    /// Slots busy now.
    count: u32,
    /// Instance-seconds busy up to `at`.
    area_s: f64,
    /// Router clock of the last update, s.
    at: f64,
}

impl BusyInstances {
    /// Records whether `slot` has requests in flight from `now` on.
    pub fn set(&mut self, slot: usize, busy: bool, now: f64) {
        if self.busy.len() <= slot {
            self.busy.resize(slot + 1, false);
        }
        if self.busy[slot] == busy {
            return;
        }
        self.area_s = self.area_at(now);
        self.at = self.at.max(now);
        self.busy[slot] = busy;
        if busy {
            self.count += 1;
        } else {
            self.count -= 1;
        }
    }

    /// Instance-seconds busy up to `now`.
    pub fn area_at(&self, now: f64) -> f64 {
        self.area_s + f64::from(self.count) * (now - self.at).max(0.0)
    }
}

/// Solves `a x = b` by Gaussian elimination with partial pivoting (a small dense system);
/// `None` when `a` is singular.
fn solve(mut a: Vec<Vec<f64>>, mut b: Vec<f64>) -> Option<Vec<f64>> {
    let n = b.len();
    let scale = a
        .iter()
        .flatten()
        .fold(0.0f64, |m, v| m.max(v.abs()))
        .max(f64::MIN_POSITIVE);
    for col in 0..n {
        let pivot = (col..n).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() <= 1e-12 * scale {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        let (upper, lower) = a.split_at_mut(col + 1);
        let pivot_row = &upper[col];
        for (offset, row) in lower.iter_mut().enumerate() {
            let f = row[col] / pivot_row[col];
            for (value, p) in row[col..].iter_mut().zip(&pivot_row[col..]) {
                *value -= f * p;
            }
            b[col + 1 + offset] -= f * b[col];
        }
    }
    let mut x = vec![0.0; n];
    for row in (0..n).rev() {
        let rest: f64 = (row + 1..n).map(|c| a[row][c] * x[c]).sum();
        x[row] = (b[row] - rest) / a[row][row];
    }
    Some(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic spread of regressors: batch 1-6, prefill 0-100, neighbours 0-3.
    fn sample(i: u32) -> (f64, f64, f64) {
        (
            f64::from(1 + i % 6),
            f64::from((i * 7) % 11) * 10.0,
            f64::from((i * 5) % 4),
        )
    }

    #[test]
    fn engines_that_share_cores_learn_the_share_they_lose_per_busy_neighbour() {
        let mut fit = SharedCompute::default();
        for i in 0..300 {
            let (batch, prefill, neighbours) = sample(i);
            let alone = 0.004 + 0.001 * batch + 0.00002 * prefill;
            let jitter = if i % 2 == 0 { 0.0001 } else { -0.0001 };
            // Each busy neighbour takes half of a core's time from this instance's steps.
            fit.observe(
                batch,
                prefill,
                neighbours,
                alone * (1.0 + 0.5 * neighbours) + jitter,
                0.05,
            );
        }
        // The multiplicative slowdown, read against the mean time alone: about half.
        assert!((0.35..=0.65).contains(&fit.share_per_neighbour), "{fit:?}");
    }

    #[test]
    fn load_that_only_comes_with_busy_neighbours_is_not_read_as_sharing() {
        let mut fit = SharedCompute::default();
        for i in 0..300 {
            let (_, _, neighbours) = sample(i);
            // Busy neighbours come with a bigger batch and more prefill here (the same bursts
            // load every instance), and those alone slow the answer.
            let batch = 1.0 + 1.5 * neighbours + f64::from(i % 2);
            let prefill = 20.0 * neighbours + f64::from((i * 7) % 5) * 10.0;
            let noise = f64::from((i * 7919) % 13) * 0.00005;
            fit.observe(
                batch,
                prefill,
                neighbours,
                0.004 + 0.001 * batch + 0.00003 * prefill + noise,
                0.05,
            );
        }
        assert_eq!(fit.share_per_neighbour, 0.0, "{fit:?}");
    }

    #[test]
    fn separate_devices_price_nothing() {
        let mut fit = SharedCompute::default();
        for i in 0..300 {
            let (batch, prefill, neighbours) = sample(i);
            let noise = f64::from((i * 7919) % 13) * 0.0001;
            fit.observe(batch, prefill, neighbours, 0.01 + noise, 0.05);
        }
        assert_eq!(fit.share_per_neighbour, 0.0, "{fit:?}");
    }

    #[test]
    fn too_few_or_bad_samples_price_nothing() {
        let mut fit = SharedCompute::default();
        for i in 0..MIN_SAMPLES - 1 {
            let (batch, prefill, neighbours) = sample(i);
            fit.observe(batch, prefill, neighbours, 0.01 * (1.0 + neighbours), 0.05);
        }
        assert_eq!(fit.share_per_neighbour, 0.0);
        let before = fit.samples;
        fit.observe(f64::NAN, 0.0, 1.0, 0.01, 0.05);
        fit.observe(1.0, 0.0, -1.0, 0.01, 0.05);
        fit.observe(1.0, 0.0, 1.0, f64::INFINITY, 0.05);
        assert_eq!(fit.samples, before);
    }

    #[test]
    fn the_busy_area_counts_instance_seconds() {
        let mut busy = BusyInstances::default();
        busy.set(0, true, 1.0);
        busy.set(3, true, 2.0);
        busy.set(3, true, 2.5);
        busy.set(0, false, 4.0);
        // Slot 0 busy 1-4 (3 s), slot 3 busy from 2 (3 s by 5).
        assert!((busy.area_at(5.0) - 6.0).abs() < 1e-12);
        busy.set(3, false, 5.0);
        assert!((busy.area_at(9.0) - 6.0).abs() < 1e-12);
    }

    #[test]
    fn the_solver_solves_and_refuses_singular_systems() {
        let x = solve(vec![vec![2.0, 1.0], vec![1.0, 3.0]], vec![3.0, 5.0]).unwrap();
        assert!(
            (x[0] - 0.8).abs() < 1e-12 && (x[1] - 1.4).abs() < 1e-12,
            "{x:?}"
        );
        assert!(solve(vec![vec![1.0, 2.0], vec![2.0, 4.0]], vec![1.0, 2.0]).is_none());
    }
}
