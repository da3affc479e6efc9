//! The lower-bound row: each request's TTFT on an idle instance that already holds every
//! prefix seen before it.
//!
//! Computed analytically from the profile: the prompt is cut into KV blocks, hashed as a chain
//! (as the engine's prefix cache does, salted by adapter and cache salt); the leading blocks
//! that any earlier request's prompt contained count as cached (capped like the engine, which
//! always computes at least the last token), and the rest is prefilled alone, in chunks of the
//! step budget. No routing, queueing or eviction can beat that.

use rustc_hash::FxHashSet;
use serde::Serialize;
use switchyard_engine::{EngineConfig, Role};
use switchyard_workload::Request;
use xxhash_rust::xxh3::xxh3_64;

use crate::metrics::Dist;
use crate::prompt::encode_request;

/// The lower-bound row of the table.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LowerBound {
    /// Requests considered.
    pub requests: u64,
    /// TTFT lower bound, seconds.
    pub ttft: Dist,
    /// Share of prompt tokens that an ideal cache would serve.
    pub cache_share: f64,
}

/// Chained hash of one block of token ids: a multiply-xorshift over pairs of tokens, finished
/// with splitmix64. Only equality matters here (a 64-bit collision among a few million blocks is
/// vanishingly unlikely), and this is several times cheaper than hashing the block's bytes.
fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = parent ^ 0x9E37_79B9_7F4A_7C15;
    for pair in tokens.chunks(2) {
        let word = u64::from(pair[0]) | u64::from(pair.get(1).copied().unwrap_or(0)) << 32;
        h = (h ^ word).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        h ^= h >> 31;
    }
    h = (h ^ (h >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    h ^ (h >> 31)
}

/// The fastest prefill-capable configuration (the bound assumes the best instance).
fn reference_engines(engines: &[EngineConfig]) -> Vec<&EngineConfig> {
    let mut out: Vec<&EngineConfig> = Vec::new();
    for e in engines.iter().filter(|e| e.role != Role::Decode) {
        // Identical configurations give identical times: keep one of each.
        if !out.iter().any(|o| {
            o.profile == e.profile
                && o.block_size == e.block_size
                && o.max_num_batched_tokens == e.max_num_batched_tokens
        }) {
            out.push(e);
        }
    }
    out
}

/// Computes the bound over `requests` (in arrival order) for a fleet of `engines`.
pub fn lower_bound(
    requests: impl Iterator<Item = Request>,
    engines: &[EngineConfig],
) -> LowerBound {
    let refs = reference_engines(engines);
    let mut seen: FxHashSet<u64> = FxHashSet::default();
    let mut ttfts = Vec::new();
    let (mut prompt_total, mut cached_total) = (0u64, 0u64);
    let mut block_sizes: Vec<u32> = refs.iter().map(|e| e.block_size).collect();
    block_sizes.sort_unstable();
    block_sizes.dedup();
    for request in requests {
        let tokens = encode_request(&request);
        let prompt = tokens.len() as u64;
        if prompt == 0 {
            continue;
        }
        let salt = xxh3_64(request.adapter.as_deref().unwrap_or("").as_bytes())
            ^ xxh3_64(request.cache_salt.as_deref().unwrap_or("").as_bytes()).rotate_left(1);
        let mut best = f64::INFINITY;
        let mut best_cached = 0;
        for &bs in &block_sizes {
            // Each block size has its own chain (the seed tells them apart).
            let mut parent = salt ^ u64::from(bs);
            let mut matched = 0u64;
            let mut prefix = true;
            for chunk in tokens.chunks_exact(bs as usize) {
                parent = block_hash(parent, chunk);
                if !seen.insert(parent) && prefix {
                    matched += 1;
                } else {
                    prefix = false;
                }
            }
            let max_blocks = (prompt - 1) / u64::from(bs);
            let cached = matched.min(max_blocks) * u64::from(bs);
            for e in refs.iter().filter(|e| e.block_size == bs) {
                let t = e.profile.isolated_prefill_time(
                    prompt,
                    cached,
                    u64::from(e.max_num_batched_tokens),
                );
                if t < best {
                    best = t;
                    best_cached = cached;
                }
            }
        }
        ttfts.push(best);
        prompt_total += prompt;
        cached_total += best_cached;
    }
    ttfts.sort_by(f64::total_cmp);
    LowerBound {
        requests: ttfts.len() as u64,
        ttft: Dist::of_sorted(&ttfts),
        cache_share: if prompt_total > 0 {
            cached_total as f64 / prompt_total as f64
        } else {
            0.0
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use switchyard_workload::Prompt;

    fn req(text: &str) -> Request {
        Request {
            id: 0,
            arrival_s: 0.0,
            model: Arc::from("m"),
            adapter: None,
            prompt: Prompt::Text(vec![Arc::from(text)]),
            max_tokens: 4,
            session_id: None,
            cache_salt: None,
        }
    }

    #[test]
    fn a_repeated_prefix_is_only_prefilled_once() {
        let engine = crate::config::default_engine();
        let shared = "abcd".repeat(64); // 64 tokens: 4 blocks of 16
        let first = req(&format!("{shared}{}", "wxyz".repeat(16)));
        let second = req(&format!("{shared}{}", "qrst".repeat(16)));
        let lb = lower_bound([first, second].into_iter(), std::slice::from_ref(&engine));
        let p = &engine.profile;
        let budget = u64::from(engine.max_num_batched_tokens);
        let cold = p.isolated_prefill_time(80, 0, budget);
        let warm = p.isolated_prefill_time(80, 64, budget);
        assert!((lb.ttft.mean - (cold + warm) / 2.0).abs() < 1e-12);
        assert!((lb.cache_share - 64.0 / 160.0).abs() < 1e-12);
    }

    #[test]
    fn adapters_do_not_share_cache_with_the_base_model() {
        let engine = crate::config::default_engine();
        let text = "abcd".repeat(64);
        let mut with = req(&text);
        with.adapter = Some(Arc::from("lora-1"));
        let lb = lower_bound([req(&text), with].into_iter(), &[engine]);
        assert_eq!(lb.cache_share, 0.0);
    }
}
