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
        // Regressors with spread, the neighbours' (3) last: this runs at every finished
        // answer, so fixed arrays, no allocation.
        let mut used = [0usize; 3];
        let mut k = 0;
        for i in (1..3).filter(|&i| cov(i, i) > 1e-12) {
            used[k] = i;
            k += 1;
        }
        if cov(3, 3) <= 1e-12 {
            return None;
        }
        used[k] = 3;
        k += 1;
        let u = k - 1;
        let mut a = [[0.0; 3]; 3];
        let mut b = [0.0; 3];
        for r in 0..k {
            for c in 0..k {
                a[r][c] = cov(used[r], used[c]);
            }
            b[r] = cov(used[r], 4);
        }
        let inverse = invert(a, k)?;
        let coefficients: [f64; 3] =
            std::array::from_fn(|r| (0..k).map(|c| inverse[r][c] * b[c]).sum());
        let inverse_uu = inverse[u][u];
        let explained: f64 = (0..k).map(|r| coefficients[r] * b[r]).sum();
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

/// The inverse of the top-left `n` x `n` block of `a` (Gauss-Jordan with partial pivoting);
/// `None` when it is singular. The coefficients and the neighbours' standard error both come
/// from it.
fn invert(mut a: [[f64; 3]; 3], n: usize) -> Option<[[f64; 3]; 3]> {
    let mut inverse = [[0.0; 3]; 3];
    for (i, row) in inverse.iter_mut().enumerate().take(n) {
        row[i] = 1.0;
    }
    let scale = a[..n]
        .iter()
        .flat_map(|row| &row[..n])
        .fold(0.0f64, |m, v| m.max(v.abs()))
        .max(f64::MIN_POSITIVE);
    for col in 0..n {
        let pivot = (col..n).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() <= 1e-12 * scale {
            return None;
        }
        a.swap(col, pivot);
        inverse.swap(col, pivot);
        let p = a[col][col];
        for c in 0..n {
            a[col][c] /= p;
            inverse[col][c] /= p;
        }
        for row in 0..n {
            if row == col {
                continue;
            }
            let f = a[row][col];
            for c in 0..n {
                a[row][c] -= f * a[col][c];
                inverse[row][c] -= f * inverse[col][c];
            }
        }
    }
    Some(inverse)
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

    /// Solves the top-left `n` x `n` system `a x = b` through [`invert`].
    fn solve(a: [[f64; 3]; 3], b: [f64; 3], n: usize) -> Option<Vec<f64>> {
        let inverse = invert(a, n)?;
        Some(
            (0..n)
                .map(|r| (0..n).map(|c| inverse[r][c] * b[c]).sum())
                .collect(),
        )
    }

    #[test]
    fn the_solver_solves_and_refuses_singular_systems() {
        let a = [[2.0, 1.0, 9.0], [1.0, 3.0, 9.0], [9.0, 9.0, 9.0]];
        let x = solve(a, [3.0, 5.0, 9.0], 2).unwrap();
        assert!(
            (x[0] - 0.8).abs() < 1e-12 && (x[1] - 1.4).abs() < 1e-12,
            "{x:?}"
        );
        let singular = [[1.0, 2.0, 0.0], [2.0, 4.0, 0.0], [0.0, 0.0, 0.0]];
        assert!(solve(singular, [1.0, 2.0, 0.0], 2).is_none());
    }
}
