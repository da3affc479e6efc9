//! The HTTP client to engines: pooled keep-alive connections, plus a pool-less twin for the
//! one retry on a fresh connection that llama.cpp's keep-alive closes call for.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::{Client, Error as ClientError};
use hyper_util::rt::TokioExecutor;

/// Client type used for every upstream call.
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Why an attempt got no response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The backend refused the connection (nothing listens): eject at once.
    Refused,
    /// Could not connect otherwise (timeout, unreachable).
    Connect,
    /// The connection closed or reset before a response (a stale pooled connection, or the
    /// engine died mid-request).
    Closed,
}

impl Failure {
    /// Metric label.
    pub fn label(self) -> &'static str {
        match self {
            Failure::Refused => "refused",
            Failure::Connect => "connect",
            Failure::Closed => "closed",
        }
    }
}

/// Classifies a client error by walking its source chain.
pub fn classify(e: &ClientError) -> Failure {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    let mut refused = false;
    while let Some(err) = source {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::ConnectionRefused {
                refused = true;
            }
        }
        source = err.source();
    }
    if refused {
        Failure::Refused
    } else if e.is_connect() {
        Failure::Connect
    } else {
        Failure::Closed
    }
}

/// The two clients.
#[derive(Clone)]
pub struct Upstream {
    pooled: HttpClient,
    fresh: HttpClient,
}

fn connector(connect_timeout: Duration) -> HttpConnector {
    let mut c = HttpConnector::new();
    c.set_nodelay(true);
    c.set_connect_timeout(Some(connect_timeout));
    c.enforce_http(true);
    c
}

impl Upstream {
    /// Clients with the given connect timeout.
    pub fn new(connect_timeout: Duration) -> Self {
        let pooled = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(1024)
            .build(connector(connect_timeout));
        let fresh = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(0)
            .build(connector(connect_timeout));
        Upstream { pooled, fresh }
    }

    /// Sends a request on a pooled connection, or on a new one when `fresh`.
    pub async fn send(
        &self,
        fresh: bool,
        request: Request<Full<Bytes>>,
    ) -> Result<Response<Incoming>, ClientError> {
        if fresh {
            self.fresh.request(request).await
        } else {
            self.pooled.request(request).await
        }
    }

    /// A GET with a deadline, reading at most `limit` bytes of body (probes and discovery).
    pub async fn get(
        &self,
        uri: Uri,
        timeout: Duration,
        limit: usize,
    ) -> Result<(StatusCode, Bytes), ProbeError> {
        let build = || {
            Request::get(uri.clone())
                .body(Full::new(Bytes::new()))
                .map_err(|e| ProbeError::Other(e.to_string()))
        };
        let probe_error = |e: &ClientError| match classify(e) {
            Failure::Refused => ProbeError::Refused,
            _ => ProbeError::Other(e.to_string()),
        };
        let call = async {
            let response = match self.pooled.request(build()?).await {
                Ok(response) => response,
                // A pooled connection the engine closed after its last answer (llama.cpp does
                // after every stream) says nothing about its health: ask once more on a new one.
                Err(e) if classify(&e) == Failure::Closed => self
                    .fresh
                    .request(build()?)
                    .await
                    .map_err(|e| probe_error(&e))?,
                Err(e) => return Err(probe_error(&e)),
            };
            let status = response.status();
            let body = Limited::new(response.into_body(), limit)
                .collect()
                .await
                .map_err(|e| ProbeError::Other(e.to_string()))?
                .to_bytes();
            Ok((status, body))
        };
        tokio::time::timeout(timeout, call)
            .await
            .map_err(|_| ProbeError::Timeout)?
    }
}

/// Why a probe failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    /// Connection refused.
    #[error("connection refused")]
    Refused,
    /// No answer in time.
    #[error("timed out")]
    Timeout,
    /// Anything else.
    #[error("{0}")]
    Other(String),
}
