//! Replay of Mooncake-format traces.
//!
//! A trace is JSONL, one request a line:
//! `{"timestamp": <ms>, "input_length": <tokens>, "output_length": <tokens>,
//! "hash_ids": [<int>, ...]}`. Each hash id stands for one 512-token block of
//! the prompt, prefix-chained: the same id at the same position means the
//! same block after the same prefix. Replay gives every id its own
//! deterministic block of text (words keyed by the id and the seed), so equal
//! id prefixes are byte-identical prompt prefixes, and cuts the last block so
//! the prompt is exactly `input_length` tokens.
//!
//! Blocks are `Arc<str>` held in a bounded cache and shared by every request
//! that uses them while they stay cached; a block evicted and needed again is
//! rebuilt byte-identical. Rows are parsed up front (ids only, ~8 bytes a
//! block), text is made lazily as requests are drawn.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::arrivals::{ArrivalProcess, Retimed};
use crate::cache::GenCache;
use crate::error::{ensure, Result, WorkloadError};
use crate::request::{Prompt, Request};
use crate::source::open_lines;
use crate::text::{key, words};
use crate::DEFAULT_MODEL;

/// Tokens per hash-id block in Mooncake traces.
pub const MOONCAKE_BLOCK_TOKENS: u32 = 512;

/// Domain tag of block text.
const BLOCK: u64 = 0x5452_424C; // "TRBL"

/// Path of the Mooncake conversation trace shipped in `data/traces/`.
///
/// Resolved from this crate's source directory at compile time, so it is
/// meant for tests, benches and tools run from the workspace checkout.
pub fn shipped_mooncake_trace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../data/traces/mooncake_conversation_trace.jsonl.xz")
}

/// One trace row.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceRow {
    /// Arrival in milliseconds from the trace's origin.
    pub timestamp: f64,
    /// Prompt tokens.
    pub input_length: u32,
    /// Generated tokens.
    pub output_length: u32,
    /// One id per block of the prompt, prefix-chained.
    pub hash_ids: Vec<u64>,
}

/// Reads and checks a trace (`.jsonl` or `.jsonl.xz`), sorted by timestamp.
///
/// Every row must satisfy `hash_ids.len() == ceil(input_length / block_tokens)`.
pub fn read_trace(path: &Path, block_tokens: u32) -> Result<Vec<TraceRow>> {
    ensure(block_tokens > 0, || "block_tokens must be > 0".into())?;
    let mut rows = Vec::new();
    for (i, text) in open_lines(path)?.lines().enumerate() {
        let line = i as u64 + 1;
        let text = text.map_err(|source| WorkloadError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        if text.trim().is_empty() {
            continue;
        }
        let row: TraceRow =
            serde_json::from_str(&text).map_err(|source| WorkloadError::Json { line, source })?;
        let want = row.input_length.div_ceil(block_tokens) as usize;
        if row.hash_ids.len() != want {
            return Err(WorkloadError::TraceRow {
                line,
                message: format!(
                    "{} hash_ids for input_length {} (want {want} blocks of {block_tokens})",
                    row.hash_ids.len(),
                    row.input_length
                ),
            });
        }
        if !row.timestamp.is_finite() {
            return Err(WorkloadError::TraceRow {
                line,
                message: "timestamp is not finite".into(),
            });
        }
        rows.push(row);
    }
    // Stable, so rows at the same millisecond keep file order.
    rows.sort_by(|a, b| a.timestamp.total_cmp(&b.timestamp));
    Ok(rows)
}

/// Parameters of a trace replay.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TraceSpec {
    /// Trace file (`.jsonl` or `.jsonl.xz`); empty means the shipped Mooncake trace.
    pub path: PathBuf,
    /// Arrival speed-up: trace time is divided by this (2.0 = twice the rate).
    pub rate_scale: f64,
    /// Keep only rows at or after this trace time (seconds).
    pub start_s: Option<f64>,
    /// Keep only rows before this trace time (seconds).
    pub end_s: Option<f64>,
    /// Keep at most this many rows (after the time window).
    pub max_requests: Option<u64>,
    /// Replace the trace's timestamps with this arrival process.
    pub arrivals: Option<ArrivalProcess>,
    /// Tokens per hash-id block.
    pub block_tokens: u32,
    /// Most blocks kept for sharing (2 KiB each at 512 tokens).
    pub block_cache: usize,
    /// Base model name.
    pub model: String,
}

impl Default for TraceSpec {
    fn default() -> Self {
        Self {
            path: PathBuf::new(),
            rate_scale: 1.0,
            start_s: None,
            end_s: None,
            max_requests: None,
            arrivals: None,
            block_tokens: MOONCAKE_BLOCK_TOKENS,
            block_cache: 32_768,
            model: DEFAULT_MODEL.to_string(),
        }
    }
}

impl TraceSpec {
    /// The trace file this spec reads.
    pub fn resolved_path(&self) -> PathBuf {
        if self.path.as_os_str().is_empty() {
            shipped_mooncake_trace()
        } else {
            self.path.clone()
        }
    }

    /// Reads the trace and builds the replay for `seed` (the seed picks the
    /// block text and, with `arrivals`, the arrival times).
    pub fn build(&self, seed: u64) -> Result<Box<dyn Iterator<Item = Request> + Send>> {
        let rows = read_trace(&self.resolved_path(), self.block_tokens)?;
        let replay = TraceReplay::new(rows, self, seed)?;
        Ok(match &self.arrivals {
            None => Box::new(replay),
            Some(p) => Box::new(Retimed::new(replay, p, key(seed, BLOCK, 1))?),
        })
    }
}

/// Iterator replaying trace rows; see the module docs.
#[derive(Debug)]
pub struct TraceReplay {
    rows: std::vec::IntoIter<TraceRow>,
    origin_s: f64,
    rate_scale: f64,
    block_tokens: u32,
    blocks: GenCache<(u64, u32), Arc<str>>,
    model: Arc<str>,
    seed: u64,
    next_id: u64,
}

impl TraceReplay {
    /// Replays `rows` (sorted by timestamp) through the window, count limit
    /// and rate scale of `spec`; `spec.path` and `spec.arrivals` are ignored.
    pub fn new(rows: Vec<TraceRow>, spec: &TraceSpec, seed: u64) -> Result<Self> {
        ensure(spec.rate_scale.is_finite() && spec.rate_scale > 0.0, || {
            format!("rate_scale must be > 0, got {}", spec.rate_scale)
        })?;
        ensure(spec.block_tokens > 0, || "block_tokens must be > 0".into())?;
        let in_window = |r: &TraceRow| {
            let t = r.timestamp / 1000.0;
            spec.start_s.is_none_or(|s| t >= s) && spec.end_s.is_none_or(|e| t < e)
        };
        let limit = spec
            .max_requests
            .map_or(usize::MAX, |m| usize::try_from(m).unwrap_or(usize::MAX));
        let rows: Vec<TraceRow> = rows.into_iter().filter(in_window).take(limit).collect();
        // Time zero is the window start, or the first row's time, so a trace
        // stamped with epoch milliseconds does not start with a long idle gap.
        let origin_s = spec
            .start_s
            .or_else(|| rows.first().map(|r| r.timestamp / 1000.0))
            .unwrap_or(0.0);
        Ok(Self {
            rows: rows.into_iter(),
            origin_s,
            rate_scale: spec.rate_scale,
            block_tokens: spec.block_tokens,
            blocks: GenCache::new(spec.block_cache.max(2)),
            model: Arc::from(spec.model.as_str()),
            seed,
            next_id: 0,
        })
    }

    /// The text of block `id` cut to `tokens` tokens, shared while cached.
    pub fn block(&mut self, id: u64, tokens: u32) -> Arc<str> {
        let seed = self.seed;
        self.blocks.get_or_insert_with(&(id, tokens), || {
            // A cut block is the head of the full one (see `text::words`).
            let text = words(key(seed, BLOCK, id), tokens as usize);
            ((id, tokens), Arc::from(text))
        })
    }
}

impl Iterator for TraceReplay {
    type Item = Request;

    fn next(&mut self) -> Option<Request> {
        let row = self.rows.next()?;
        let bt = self.block_tokens;
        let n = row.hash_ids.len() as u32;
        let segments = row
            .hash_ids
            .iter()
            .enumerate()
            .map(|(i, &id)| {
                // read_trace checked len == ceil(input/bt), so only the last
                // block is partial and its size is in 1..=bt.
                let tokens = if i as u32 + 1 == n {
                    row.input_length - bt * (n - 1)
                } else {
                    bt
                };
                self.block(id, tokens)
            })
            .collect();
        let id = self.next_id;
        self.next_id += 1;
        Some(Request {
            id,
            arrival_s: (row.timestamp / 1000.0 - self.origin_s) / self.rate_scale,
            model: self.model.clone(),
            adapter: None,
            prompt: Prompt::Text(segments),
            max_tokens: row.output_length,
            session_id: None,
            cache_salt: None,
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.rows.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn row(ts: f64, input: u32, ids: &[u64]) -> TraceRow {
        TraceRow {
            timestamp: ts,
            input_length: input,
            output_length: 10,
            hash_ids: ids.to_vec(),
        }
    }

    fn replay(rows: Vec<TraceRow>, spec: &TraceSpec) -> Vec<Request> {
        TraceReplay::new(rows, spec, 42).unwrap().collect()
    }

    fn segs(r: &Request) -> &[Arc<str>] {
        match &r.prompt {
            Prompt::Text(s) => s,
            Prompt::Chat(_) => panic!("text expected"),
        }
    }

    #[test]
    fn lengths_and_timing() {
        let spec = TraceSpec {
            rate_scale: 2.0,
            ..Default::default()
        };
        let rows = vec![row(0.0, 1000, &[0, 1]), row(3000.0, 512, &[0])];
        let reqs = replay(rows, &spec);
        assert_eq!(reqs[0].prompt_tokens(), 1000);
        assert_eq!(segs(&reqs[0])[1].len(), 4 * (1000 - 512));
        assert_eq!(reqs[1].prompt_tokens(), 512);
        assert_eq!(reqs[1].arrival_s, 1.5);
        assert_eq!(reqs[1].max_tokens, 10);
        assert_eq!((reqs[0].id, reqs[1].id), (0, 1));
        // Block 0 is one shared allocation.
        assert!(Arc::ptr_eq(&segs(&reqs[0])[0], &segs(&reqs[1])[0]));
    }

    #[test]
    fn window_and_limit() {
        let rows: Vec<TraceRow> = (0..10).map(|i| row(1000.0 * i as f64, 4, &[i])).collect();
        let spec = TraceSpec {
            start_s: Some(2.0),
            end_s: Some(8.0),
            max_requests: Some(4),
            ..Default::default()
        };
        let reqs = replay(rows, &spec);
        let t: Vec<f64> = reqs.iter().map(|r| r.arrival_s).collect();
        assert_eq!(t, [0.0, 1.0, 2.0, 3.0]);
    }

    #[test]
    fn read_rejects_inconsistent_rows() {
        let dir = std::env::temp_dir().join(format!("sy-wl-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.jsonl");
        std::fs::write(
            &p,
            "{\"timestamp\": 5, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [1, 2]}\n\
             {\"timestamp\": 1, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [1]}\n",
        )
        .unwrap();
        let err = read_trace(&p, 512).unwrap_err();
        assert!(
            matches!(err, WorkloadError::TraceRow { line: 2, .. }),
            "{err}"
        );
        std::fs::write(
            &p,
            "{\"timestamp\": 5, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [1, 2]}\n\n\
             {\"timestamp\": 1, \"input_length\": 6, \"output_length\": 1, \"hash_ids\": [3]}\n",
        )
        .unwrap();
        let rows = read_trace(&p, 512).unwrap();
        assert_eq!(rows[0].timestamp, 1.0, "sorted by time");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_spec() {
        let spec = TraceSpec {
            rate_scale: 0.0,
            ..Default::default()
        };
        assert!(TraceReplay::new(vec![], &spec, 0).is_err());
    }

    proptest! {
        #[test]
        fn shared_ids_share_prefixes(
            common in proptest::collection::vec(0u64..50, 0..4),
            tail_a in proptest::collection::vec(100u64..150, 1..4),
            tail_b in proptest::collection::vec(200u64..250, 1..4),
            cut in 1u32..=512,
        ) {
            let ids_a: Vec<u64> = common.iter().chain(&tail_a).copied().collect();
            let ids_b: Vec<u64> = common.iter().chain(&tail_b).copied().collect();
            let len = |n: usize| 512 * (n as u32 - 1) + cut;
            let rows = vec![row(0.0, len(ids_a.len()), &ids_a), row(1.0, len(ids_b.len()), &ids_b)];
            let reqs = replay(rows, &TraceSpec { block_cache: 2, ..Default::default() });
            let (a, b) = (reqs[0].prompt.render(), reqs[1].prompt.render());
            prop_assert_eq!(reqs[0].prompt_tokens(), len(ids_a.len()) as usize);
            prop_assert_eq!(a.len(), 4 * len(ids_a.len()) as usize);
            let shared = 4 * 512 * common.len();
            // Byte-identical over the shared ids, even with a tiny cache...
            prop_assert_eq!(&a[..shared], &b[..shared]);
            // ...and different right after (different ids, different words).
            let next = 4 * cut.min(64) as usize;
            prop_assert_ne!(&a[shared..shared + next], &b[shared..shared + next]);
        }

        #[test]
        fn cut_block_is_head_of_full_block(id in any::<u64>(), cut in 1u32..512) {
            let mut r = TraceReplay::new(vec![], &TraceSpec::default(), 7).unwrap();
            let full = r.block(id, 512);
            prop_assert!(full.starts_with(&*r.block(id, cut)));
        }
    }
}
