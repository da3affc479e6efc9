//! Prefix-cache knowledge: how prompts become block hashes, and which instance holds which.

pub mod hash;
pub mod index;
pub mod survival;

pub use hash::{
    chain_seed, prompt_block_hashes, tapered_depth, tapered_end, tapered_prompt_block_hashes,
    token_block_hashes, LEADING_SPLITS,
};
pub use index::{BlockMatch, PrefixIndex, Slot};
pub use survival::CacheSurvival;
