//! Step-time model: how long one forward pass of a batch takes.
//!
//! A step's time is the sum of its parts:
//!
//! ```text
//! step = step_base_s                                        (once per non-empty step)
//!      + Σ prefill chunks:  n · prefill_s_per_token
//!                         + prefill_attn_s_per_token_per_1k_ctx · Σ_{q in chunk} (q+1)/1000
//!      + Σ decode tokens:   decode_s_per_seq + decode_s_per_1k_ctx · ctx/1000
//! ```
//!
//! where `q` is a token's position and `ctx` the sequence's context length
//! after the step. A one-token chunk is costed as a decode token (it is
//! memory-bound like one), whatever phase the sequence is in.

use serde::{Deserialize, Serialize};

/// Why a profile text could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// The JSON text did not parse into a profile.
    #[error("invalid profile JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// The TOML text did not parse into a profile.
    #[error("invalid profile TOML: {0}")]
    Toml(#[from] toml::de::Error),
    /// A coefficient is negative, not finite, or the step base is not positive.
    #[error("invalid profile value: {0}")]
    Invalid(String),
}

/// Performance coefficients of one model on one accelerator.
///
/// Missing fields in JSON/TOML take the values of [`Profile::h100_llama8b`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Profile {
    /// Human-readable name of the profile.
    pub name: String,
    /// Fixed cost of any non-empty step (launch, sampling, scheduling), seconds.
    pub step_base_s: f64,
    /// Linear cost of one prefill token, seconds.
    pub prefill_s_per_token: f64,
    /// Attention cost of one prefill token per 1k tokens of context it attends to, seconds.
    pub prefill_attn_s_per_token_per_1k_ctx: f64,
    /// Cost of one decoding sequence in a step, seconds.
    pub decode_s_per_seq: f64,
    /// Cost per 1k context tokens of the decoding sequences in a step, seconds.
    pub decode_s_per_1k_ctx: f64,
}

impl Default for Profile {
    fn default() -> Self {
        Self::h100_llama8b()
    }
}

impl Profile {
    /// An 8B dense model (Llama-3.1-8B class) in bf16 on one H100.
    ///
    /// Prefill ≈ 45k tokens/s for short contexts, attention adding ~3 % per
    /// 1k tokens of context (4·layers·d_model FLOPs per context token against
    /// ~2·params per token); decode step ≈ 5.5 ms + 0.015 ms per sequence +
    /// 0.044 ms per 1k context tokens in the batch.
    pub fn h100_llama8b() -> Self {
        Self {
            name: "h100-llama8b".to_string(),
            step_base_s: 5.5e-3,
            prefill_s_per_token: 1.0 / 45_000.0,
            prefill_attn_s_per_token_per_1k_ctx: 0.7e-6,
            decode_s_per_seq: 0.015e-3,
            decode_s_per_1k_ctx: 0.044e-3,
        }
    }

    /// Parse a profile from JSON text (missing fields take the default).
    pub fn from_json_str(text: &str) -> Result<Self, ProfileError> {
        let p: Self = serde_json::from_str(text)?;
        p.validate()?;
        Ok(p)
    }

    /// Parse a profile from TOML text (missing fields take the default).
    pub fn from_toml_str(text: &str) -> Result<Self, ProfileError> {
        let p: Self = toml::from_str(text)?;
        p.validate()?;
        Ok(p)
    }

    /// Check every coefficient is finite and non-negative and the step base positive.
    ///
    /// A positive base guarantees every step takes time, so virtual time
    /// always moves forward.
    pub fn validate(&self) -> Result<(), ProfileError> {
        let fields = [
            ("step_base_s", self.step_base_s),
            ("prefill_s_per_token", self.prefill_s_per_token),
            (
                "prefill_attn_s_per_token_per_1k_ctx",
                self.prefill_attn_s_per_token_per_1k_ctx,
            ),
            ("decode_s_per_seq", self.decode_s_per_seq),
            ("decode_s_per_1k_ctx", self.decode_s_per_1k_ctx),
        ];
        for (name, v) in fields {
            if !v.is_finite() || v < 0.0 {
                return Err(ProfileError::Invalid(format!(
                    "{name} must be finite and >= 0, got {v}"
                )));
            }
        }
        if self.step_base_s <= 0.0 {
            return Err(ProfileError::Invalid("step_base_s must be > 0".into()));
        }
        Ok(())
    }

    /// Cost of computing `len` tokens at positions `start..start+len` (without the step base).
    pub fn chunk_time(&self, start: u64, len: u64) -> f64 {
        match len {
            0 => 0.0,
            1 => self.decode_token_time(start + 1),
            _ => {
                // Σ_{q=start}^{start+len-1} (q+1) = len·start + len(len+1)/2
                let attended = len as f64 * start as f64 + (len * (len + 1)) as f64 / 2.0;
                len as f64 * self.prefill_s_per_token
                    + self.prefill_attn_s_per_token_per_1k_ctx * attended / 1000.0
            }
        }
    }

    /// Cost of one decode token for a sequence whose context is `ctx` tokens after the step.
    pub fn decode_token_time(&self, ctx: u64) -> f64 {
        self.decode_s_per_seq + self.decode_s_per_1k_ctx * ctx as f64 / 1000.0
    }

    /// Time of a pure decode step of `num_seqs` sequences whose contexts sum to `total_ctx` after it.
    pub fn decode_step_time(&self, num_seqs: u64, total_ctx: u64) -> f64 {
        if num_seqs == 0 {
            return 0.0;
        }
        self.step_base_s
            + num_seqs as f64 * self.decode_s_per_seq
            + self.decode_s_per_1k_ctx * total_ctx as f64 / 1000.0
    }

    /// Time to prefill `prompt_len` tokens of which `cached` are already cached,
    /// alone on the engine, in chunks of at most `budget` tokens (one step per chunk).
    ///
    /// This is the time to first token of an isolated request; routers can use
    /// it as a prior for prefill speed.
    pub fn isolated_prefill_time(&self, prompt_len: u64, cached: u64, budget: u64) -> f64 {
        let budget = budget.max(1);
        let mut pos = cached.min(prompt_len.saturating_sub(1));
        let mut t = 0.0;
        while pos < prompt_len {
            let n = (prompt_len - pos).min(budget);
            t += self.step_base_s + self.chunk_time(pos, n);
            pos += n;
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_prefill_rate_is_about_45k_per_s() {
        let p = Profile::h100_llama8b();
        let t = p.chunk_time(0, 512);
        let rate = 512.0 / t;
        assert!((40_000.0..46_000.0).contains(&rate), "{rate}");
    }

    #[test]
    fn default_decode_step_matches_spec() {
        let p = Profile::h100_llama8b();
        // One sequence at 1k context: 5.5 + 0.015 + 0.044 ms.
        let t = p.decode_step_time(1, 1000);
        assert!((t - 5.559e-3).abs() < 1e-9, "{t}");
        // Context cost is linear in total context.
        let d = p.decode_step_time(10, 20_000) - p.decode_step_time(10, 10_000);
        assert!((d - 0.44e-3).abs() < 1e-9);
    }

    #[test]
    fn long_context_prefill_is_slower_per_token() {
        let p = Profile::h100_llama8b();
        assert!(p.chunk_time(16_000, 1000) > p.chunk_time(0, 1000) * 1.3);
    }

    #[test]
    fn parses_partial_json_and_toml() {
        let p = Profile::from_json_str(r#"{"name":"x","step_base_s":0.01}"#).unwrap();
        assert_eq!(p.step_base_s, 0.01);
        assert_eq!(
            p.prefill_s_per_token,
            Profile::h100_llama8b().prefill_s_per_token
        );
        let t = Profile::from_toml_str("decode_s_per_seq = 0.0001\n").unwrap();
        assert_eq!(t.decode_s_per_seq, 0.0001);
        assert_eq!(t.name, "h100-llama8b");
    }

    #[test]
    fn rejects_bad_values_and_unknown_fields() {
        assert!(Profile::from_json_str(r#"{"step_base_s":0}"#).is_err());
        assert!(Profile::from_json_str(r#"{"decode_s_per_seq":-1}"#).is_err());
        assert!(Profile::from_json_str(r#"{"bogus":1}"#).is_err());
        assert!(Profile::from_toml_str("step_base_s = nan\n").is_err());
        assert!(Profile::from_json_str("not json").is_err());
    }

    #[test]
    fn isolated_prefill_sums_chunks() {
        let p = Profile::h100_llama8b();
        let one = p.isolated_prefill_time(1000, 0, 8192);
        assert!((one - (p.step_base_s + p.chunk_time(0, 1000))).abs() < 1e-12);
        let two = p.isolated_prefill_time(1000, 0, 600);
        let want = 2.0 * p.step_base_s + p.chunk_time(0, 600) + p.chunk_time(600, 400);
        assert!((two - want).abs() < 1e-12);
        // Fully cached still computes the last token.
        let cached = p.isolated_prefill_time(1000, 1000, 8192);
        assert!((cached - (p.step_base_s + p.chunk_time(999, 1))).abs() < 1e-12);
    }
}
