//! SVG charts: TTFT CDF per policy, and per-instance queue length over time for one policy.

use std::path::Path;

use plotters::prelude::*;

use crate::driver::QueueTrace;
use crate::error::{Result, SimError};

/// Points kept per CDF line: enough for a smooth curve, small enough for a light SVG.
const CDF_POINTS: usize = 400;
/// Points kept per queue line (bucket maxima, so spikes survive).
const QUEUE_POINTS: usize = 800;

fn chart_err(path: &Path, e: impl std::fmt::Display) -> SimError {
    SimError::Chart {
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}

/// (x, share ≤ x) points of an ascending sample, thinned to about [`CDF_POINTS`].
pub fn cdf_points(sorted: &[f64]) -> Vec<(f64, f64)> {
    let n = sorted.len();
    if n == 0 {
        return Vec::new();
    }
    let step = n.div_ceil(CDF_POINTS).max(1);
    let mut out: Vec<(f64, f64)> = (0..n)
        .step_by(step)
        .map(|i| (sorted[i], (i + 1) as f64 / n as f64))
        .collect();
    out.push((sorted[n - 1], 1.0));
    out
}

/// Draws the TTFT CDF of each policy (sorted TTFTs in seconds) on a log time axis.
pub fn ttft_cdf(path: &Path, series: &[(String, Vec<f64>)]) -> Result<()> {
    let all = series.iter().flat_map(|(_, v)| v.iter().copied());
    let (lo, hi) = all.fold((f64::INFINITY, 0.0f64), |(lo, hi), x| {
        (lo.min(x), hi.max(x))
    });
    let lo = if lo.is_finite() && lo > 0.0 {
        lo / 1.2
    } else {
        1e-3
    };
    let hi = (hi * 1.2).max(lo * 10.0);
    let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| chart_err(path, e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Time to first token, CDF", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d((lo..hi).log_scale(), 0.0..1.0)
        .map_err(|e| chart_err(path, e))?;
    chart
        .configure_mesh()
        .x_desc("TTFT (s, log scale)")
        .y_desc("share of requests")
        .draw()
        .map_err(|e| chart_err(path, e))?;
    for (k, (name, sorted)) in series.iter().enumerate() {
        let color = Palette99::pick(k).to_rgba();
        chart
            .draw_series(LineSeries::new(cdf_points(sorted), color.stroke_width(2)))
            .map_err(|e| chart_err(path, e))?
            .label(name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| chart_err(path, e))?;
    root.present().map_err(|e| chart_err(path, e))
}

/// Bucket maxima of a time series, about [`QUEUE_POINTS`] points.
fn thin_max(times: &[f64], values: &[u32]) -> Vec<(f64, f64)> {
    let n = times.len().min(values.len());
    let step = n.div_ceil(QUEUE_POINTS).max(1);
    (0..n)
        .step_by(step)
        .map(|i| {
            let end = (i + step).min(n);
            let max = values[i..end].iter().copied().max().unwrap_or(0);
            (times[i], f64::from(max))
        })
        .collect()
}

/// Draws the waiting queue of each recorded instance over time for `policy`.
pub fn queue_over_time(path: &Path, policy: &str, trace: &QueueTrace) -> Result<()> {
    let t_max = trace
        .times
        .iter()
        .filter_map(|t| t.last().copied())
        .fold(1.0f64, f64::max);
    let q_max = trace
        .waiting
        .iter()
        .flat_map(|w| w.iter().copied())
        .max()
        .unwrap_or(0)
        .max(1);
    let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| chart_err(path, e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("Waiting requests per instance over time ({policy})"),
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d(0.0..t_max, 0.0..f64::from(q_max) * 1.05)
        .map_err(|e| chart_err(path, e))?;
    chart
        .configure_mesh()
        .x_desc("virtual time (s)")
        .y_desc("waiting requests (at scrapes)")
        .draw()
        .map_err(|e| chart_err(path, e))?;
    for (k, (times, waiting)) in trace.times.iter().zip(&trace.waiting).enumerate() {
        let color = Palette99::pick(k).to_rgba();
        chart
            .draw_series(LineSeries::new(
                thin_max(times, waiting),
                color.stroke_width(1),
            ))
            .map_err(|e| chart_err(path, e))?
            .label(format!("e{k}"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| chart_err(path, e))?;
    root.present().map_err(|e| chart_err(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdf_points_end_at_one_and_are_thinned() {
        let v: Vec<f64> = (1..=10_000).map(f64::from).collect();
        let p = cdf_points(&v);
        assert!(p.len() <= CDF_POINTS + 1);
        assert_eq!(*p.last().unwrap(), (10_000.0, 1.0));
        assert!(p.windows(2).all(|w| w[0].1 <= w[1].1));
    }

    #[test]
    fn charts_are_written_as_svg() {
        let dir = std::env::temp_dir().join(format!("sy-sim-charts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cdf = dir.join("cdf.svg");
        ttft_cdf(
            &cdf,
            &[("a".into(), vec![0.1, 0.2, 0.5]), ("b".into(), vec![0.3])],
        )
        .unwrap();
        let trace = QueueTrace {
            times: vec![vec![0.0, 1.0, 2.0]],
            waiting: vec![vec![0, 3, 1]],
            running: vec![vec![1, 2, 2]],
        };
        let q = dir.join("q.svg");
        queue_over_time(&q, "cost", &trace).unwrap();
        for f in [cdf, q] {
            let text = std::fs::read_to_string(&f).unwrap();
            assert!(text.starts_with("<svg"), "{}", &text[..40.min(text.len())]);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
