//! Errors of the load generator (setting up a run; request failures are
//! counted, not raised).

use std::path::PathBuf;

/// Result with a [`LoadgenError`].
pub type Result<T, E = LoadgenError> = std::result::Result<T, E>;

/// Why a run could not be set up or its output written.
#[derive(Debug, thiserror::Error)]
pub enum LoadgenError {
    /// The workload could not be built.
    #[error("workload: {0}")]
    Workload(#[from] switchyard_workload::WorkloadError),
    /// A base URL that is not `http://host:port[/prefix]`.
    #[error("bad url `{url}`: {message}")]
    Url {
        /// The URL given.
        url: String,
        /// What is wrong with it.
        message: String,
    },
    /// An option out of range.
    #[error("invalid option: {0}")]
    Invalid(String),
    /// The model list could not be read from the server.
    #[error("discovering the model from {url}: {message}")]
    Discovery {
        /// The `/v1/models` URL asked.
        url: String,
        /// What went wrong.
        message: String,
    },
    /// Reading or writing a file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The pacing timer could not be set up or armed.
    #[error("pacing timer: {0}")]
    Pacer(std::io::Error),
    /// The fixed-rate mode's preflight request failed.
    #[error("preflight request failed: {0}")]
    Preflight(String),
    /// Serialising JSON output.
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
}

impl LoadgenError {
    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        LoadgenError::Io {
            path: path.into(),
            source,
        }
    }
}
