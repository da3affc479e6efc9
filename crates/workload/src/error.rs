//! The crate's error type.

use std::path::PathBuf;

/// Anything that can go wrong building or reading a workload.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// A file could not be opened, read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file concerned.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// Writing to or reading from a stream (not a named file) failed.
    #[error("i/o: {0}")]
    Stream(#[from] std::io::Error),
    /// An `.xz` file could not be decompressed.
    #[error("{path}: xz: {message}")]
    Xz {
        /// The file concerned.
        path: PathBuf,
        /// What the decoder said.
        message: String,
    },
    /// A JSON line did not parse.
    #[error("line {line}: {source}")]
    Json {
        /// 1-based line number.
        line: u64,
        /// The parser's error.
        source: serde_json::Error,
    },
    /// A trace row contradicts itself (e.g. `hash_ids` does not cover `input_length`).
    #[error("trace line {line}: {message}")]
    TraceRow {
        /// 1-based line number.
        line: u64,
        /// What is wrong.
        message: String,
    },
    /// A specification has an invalid parameter.
    #[error("invalid workload spec: {0}")]
    InvalidSpec(String),
}

/// Shorthand for results in this crate.
pub type Result<T, E = WorkloadError> = std::result::Result<T, E>;

/// Returns `InvalidSpec(msg)` unless `ok`.
pub(crate) fn ensure(ok: bool, msg: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(WorkloadError::InvalidSpec(msg()))
    }
}
