//! The HTTP client to engines: HTTP/1.1 keep-alive connections pooled per engine address, plus
//! the one retry on a fresh connection that llama.cpp's keep-alive closes call for.
//!
//! A small pool over hyper's connection API rather than hyper-util's general-purpose client:
//! that one spawned a task per request (to put the connection back once its response was
//! read), formatted the `Host` header, cloned URIs and keyed its pool by scheme and authority
//! on every request. Here a connection goes back to its engine's idle list the moment the
//! response body ends ([`UpstreamBody`]), and is taken again by the next request (last in,
//! first out). Connections are not shared while busy (HTTP/1: one request at a time each), idle
//! ones are dropped after [`IDLE_TIMEOUT`] or when the engine closed them, and a request that
//! never started on a reused connection (closed under it) goes on a new connection at once, as
//! hyper-util's client did.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::HOST;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderValue, Request, Response, StatusCode, Uri};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use tokio::net::TcpStream;

/// An idle connection older than this is closed instead of reused.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Idle connections kept per engine address.
const MAX_IDLE_PER_HOST: usize = 1024;

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

/// A request that got no response.
#[derive(Debug)]
pub struct ClientError {
    connect: bool,
    source: Box<dyn std::error::Error + Send + Sync>,
}

impl ClientError {
    fn connect(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        ClientError {
            connect: true,
            source: source.into(),
        }
    }

    fn request(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        ClientError {
            connect: false,
            source: source.into(),
        }
    }

    /// No connection could be made (the request was never sent).
    pub fn is_connect(&self) -> bool {
        self.connect
    }
}

impl std::fmt::Display for ClientError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.connect {
            write!(f, "cannot connect: {}", self.source)
        } else {
            write!(f, "request failed: {}", self.source)
        }
    }
}

impl std::error::Error for ClientError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
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

type Sender = SendRequest<Full<Bytes>>;

/// Idle connections to one engine address.
#[derive(Default)]
struct Host {
    idle: Mutex<Vec<Idle>>,
}

struct Idle {
    sender: Sender,
    since: Instant,
}

impl Host {
    /// The most recently used idle connection that is still open and not too old.
    fn take(&self) -> Option<Sender> {
        let mut idle = self.idle.lock();
        while let Some(c) = idle.pop() {
            if !c.sender.is_closed() && c.since.elapsed() < IDLE_TIMEOUT {
                return Some(c.sender);
            }
        }
        None
    }

    fn give_back(&self, sender: Sender) {
        if sender.is_closed() {
            return;
        }
        let mut idle = self.idle.lock();
        if idle.len() < MAX_IDLE_PER_HOST {
            idle.push(Idle {
                sender,
                since: Instant::now(),
            });
        }
    }
}

/// A connection lent to one request, given back to its host's idle list when the response
/// has been read to the end (dropped, and so closed, otherwise).
struct Lease {
    host: Arc<Host>,
    sender: Sender,
}

/// An engine's response body: hyper's, plus the connection to give back at its end.
pub struct UpstreamBody {
    inner: Incoming,
    lease: Option<Lease>,
}

impl UpstreamBody {
    fn new(inner: Incoming, lease: Option<Lease>) -> Self {
        let mut body = UpstreamBody { inner, lease };
        body.release_if_done();
        body
    }

    fn release_if_done(&mut self) {
        if self.inner.is_end_stream() {
            if let Some(lease) = self.lease.take() {
                lease.host.give_back(lease.sender);
            }
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(_))) => this.release_if_done(),
            Poll::Ready(None) => {
                if let Some(lease) = this.lease.take() {
                    lease.host.give_back(lease.sender);
                }
            }
            // A failed body leaves the connection unusable.
            Poll::Ready(Some(Err(_))) => this.lease = None,
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// FNV-1a: engine addresses are short and trusted, and SipHash over `Authority` (byte by
/// byte, lower-cased) was a visible cost per request.
#[derive(Default)]
struct Fnv(u64);

impl Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut h = if self.0 == 0 {
            0xcbf2_9ce4_8422_2325
        } else {
            self.0
        };
        for &b in bytes {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        self.0 = h;
    }
}

/// Idle connections by engine address (`host:port` as written).
type Hosts = HashMap<Box<str>, Arc<Host>, BuildHasherDefault<Fnv>>;

/// The client (cheap to clone: the pool is shared).
#[derive(Clone)]
pub struct Upstream {
    hosts: Arc<Mutex<Hosts>>,
    connect_timeout: Duration,
}

impl Upstream {
    /// A client with the given connect timeout.
    pub fn new(connect_timeout: Duration) -> Self {
        Upstream {
            hosts: Arc::default(),
            connect_timeout,
        }
    }

    fn host(&self, authority: &Authority) -> Arc<Host> {
        let mut hosts = self.hosts.lock();
        if let Some(h) = hosts.get(authority.as_str()) {
            return h.clone();
        }
        hosts.entry(authority.as_str().into()).or_default().clone()
    }

    /// Sends a request (absolute `http://` URI) on a pooled connection, or on a new one when
    /// `fresh` (not pooled afterwards either).
    pub async fn send(
        &self,
        fresh: bool,
        mut request: Request<Full<Bytes>>,
    ) -> Result<Response<UpstreamBody>, ClientError> {
        let authority = match (request.uri().scheme(), request.uri().authority()) {
            (Some(s), Some(a)) if *s == Scheme::HTTP => a.clone(),
            _ => {
                return Err(ClientError::connect(format!(
                    "not an http:// URL: {}",
                    request.uri()
                )))
            }
        };
        if !request.headers().contains_key(HOST) {
            let value = match authority.port_u16() {
                Some(80) => HeaderValue::from_str(authority.host()),
                _ => HeaderValue::from_str(authority.as_str()),
            };
            if let Ok(v) = value {
                request.headers_mut().insert(HOST, v);
            }
        }
        let origin = request
            .uri()
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        *request.uri_mut() = Uri::from(origin);
        self.send_to(fresh, &authority, request).await
    }

    /// Sends a request already in origin form (`/path?query`, with its `Host` header) to the
    /// engine at `authority`: on a pooled connection, or on a new one when `fresh` (not pooled
    /// afterwards either).
    pub async fn send_to(
        &self,
        fresh: bool,
        authority: &Authority,
        mut request: Request<Full<Bytes>>,
    ) -> Result<Response<UpstreamBody>, ClientError> {
        let host = (!fresh).then(|| self.host(authority));
        loop {
            let idle = host.as_ref().and_then(|h| h.take());
            let reused = idle.is_some();
            let mut sender = match idle {
                Some(mut s) => match s.ready().await {
                    Ok(()) => s,
                    // Closed while idle: try the next one.
                    Err(_) => continue,
                },
                // Boxed: connecting is rare and its future is large.
                None => Box::pin(self.connect(authority)).await?,
            };
            match sender.try_send_request(request).await {
                Ok(response) => {
                    let lease = host.map(|host| Lease { host, sender });
                    return Ok(response.map(|body| UpstreamBody::new(body, lease)));
                }
                Err(mut e) => match e.take_message() {
                    // Never sent (the reused connection closed under it): again, on another.
                    Some(r) if reused => request = r,
                    _ => return Err(ClientError::request(e.into_error())),
                },
            }
        }
    }

    /// A new connection to `authority`: each address in turn (sharing the connect timeout), no
    /// Nagle, HTTP/1.1.
    async fn connect(&self, authority: &Authority) -> Result<Sender, ClientError> {
        let port = authority.port_u16().unwrap_or(80);
        let name = authority.host();
        let bare = name.trim_start_matches('[').trim_end_matches(']');
        let addrs: Vec<SocketAddr> = match bare.parse::<IpAddr>() {
            Ok(ip) => vec![SocketAddr::new(ip, port)],
            Err(_) => tokio::net::lookup_host((bare, port))
                .await
                .map_err(ClientError::connect)?
                .collect(),
        };
        let each = self
            .connect_timeout
            .checked_div(addrs.len().max(1) as u32)
            .unwrap_or(self.connect_timeout);
        let mut last = std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("no address for {name}"),
        );
        for addr in addrs {
            let stream = match tokio::time::timeout(each, TcpStream::connect(addr)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    last = e;
                    continue;
                }
                Err(_) => {
                    last = std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("connect to {addr} timed out"),
                    );
                    continue;
                }
            };
            if let Err(e) = stream.set_nodelay(true) {
                tracing::debug!("set_nodelay: {e}");
            }
            let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .map_err(ClientError::connect)?;
            tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::debug!("upstream connection: {e}");
                }
            });
            return Ok(sender);
        }
        Err(ClientError::connect(last))
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
            let response = match self.send(false, build()?).await {
                Ok(response) => response,
                // A pooled connection the engine closed after its last answer (llama.cpp does
                // after every stream) says nothing about its health: ask once more on a new one.
                Err(e) if classify(&e) == Failure::Closed => self
                    .send(true, build()?)
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
