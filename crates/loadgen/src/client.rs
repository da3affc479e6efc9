//! One streamed request over HTTP/1.1 and what it measured.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::error::{LoadgenError, Result};
use crate::sse::{SseParser, Usage};

/// The pooled HTTP/1.1 client a run uses.
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A pooled client keeping up to `max_idle` idle connections per host.
pub fn http_client(max_idle: usize, connect_timeout: Duration) -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(connect_timeout));
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(max_idle)
        .pool_idle_timeout(Duration::from_secs(90))
        .build(connector)
}

/// A base URL (`http://host:port[/prefix]`) requests are sent under.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BaseUrl {
    authority: String,
    prefix: String,
}

impl BaseUrl {
    /// Parses `url`; only plain `http` is supported.
    pub fn parse(url: &str) -> Result<Self> {
        let bad = |message: &str| LoadgenError::Url {
            url: url.to_string(),
            message: message.to_string(),
        };
        let uri: hyper::Uri = url
            .parse()
            .map_err(|e: http::uri::InvalidUri| bad(&e.to_string()))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(other) => return Err(bad(&format!("scheme {other} is not supported (use http)"))),
            None => return Err(bad("needs a scheme, e.g. http://127.0.0.1:8000")),
        }
        let authority = uri
            .authority()
            .ok_or_else(|| bad("needs a host"))?
            .to_string();
        if uri.query().is_some() {
            return Err(bad("must not have a query"));
        }
        let prefix = uri.path().trim_end_matches('/').to_string();
        Ok(Self { authority, prefix })
    }

    /// The absolute URI of `path` (which starts with `/`) under this base.
    pub fn uri(&self, path: &str) -> Result<hyper::Uri> {
        let s = format!("http://{}{}{}", self.authority, self.prefix, path);
        s.parse()
            .map_err(|e: http::uri::InvalidUri| LoadgenError::Url {
                url: s,
                message: e.to_string(),
            })
    }
}

/// Why a request failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ErrorKind {
    /// The server answered with this non-2xx status.
    Http(u16),
    /// No connection could be made.
    Connect,
    /// The request did not finish within the timeout.
    Timeout,
    /// The connection broke before the response was complete.
    Io,
    /// The stream carried an error object or data that is not JSON.
    Stream,
}

impl ErrorKind {
    /// The key used in reports: `http_503`, `connect`, `timeout`, `io`, `stream`.
    pub fn key(self) -> String {
        match self {
            ErrorKind::Http(s) => format!("http_{s}"),
            ErrorKind::Connect => "connect".into(),
            ErrorKind::Timeout => "timeout".into(),
            ErrorKind::Io => "io".into(),
            ErrorKind::Stream => "stream".into(),
        }
    }
}

/// What a successful request measured (times from when it was sent).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Success {
    /// Time to the first chunk with generated text; `None` if none came.
    pub ttft: Option<Duration>,
    /// Gaps between consecutive chunks with generated text.
    pub itl: Vec<Duration>,
    /// Time to the end of the stream.
    pub e2e: Duration,
    /// Chunks with generated text.
    pub content_chunks: u64,
    /// The last `usage` the stream carried.
    pub usage: Option<Usage>,
}

/// A failed request.
#[derive(Clone, Debug, PartialEq)]
pub struct Failure {
    /// Its kind.
    pub kind: ErrorKind,
    /// A short description (status line and body head, or the I/O error).
    pub message: String,
}

/// Most bytes of an error body kept in a message.
const ERROR_BODY_BYTES: usize = 300;

/// POSTs `body` to `uri` and reads the streamed answer, within `timeout`.
///
/// `sent` is when the request was handed over; all times are measured from it.
pub async fn send(
    client: &HttpClient,
    uri: hyper::Uri,
    body: Bytes,
    timeout: Duration,
    sent: Instant,
) -> std::result::Result<Success, Failure> {
    match tokio::time::timeout(timeout, exchange(client, uri, body, sent)).await {
        Ok(r) => r,
        Err(_) => Err(Failure {
            kind: ErrorKind::Timeout,
            message: format!("no complete answer within {:.1} s", timeout.as_secs_f64()),
        }),
    }
}

/// Whether the connection closed before any of the answer came (hyper's incomplete message
/// on the request itself): the server did not take the request.
fn closed_before_answer(e: &hyper_util::client::legacy::Error) -> bool {
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<hyper::Error>())
        .is_some_and(hyper::Error::is_incomplete_message)
}

async fn exchange(
    client: &HttpClient,
    uri: hyper::Uri,
    body: Bytes,
    sent: Instant,
) -> std::result::Result<Success, Failure> {
    // A server that closes a kept-alive connection after a streamed answer (llama.cpp does)
    // can close it just as the next request goes out on it: that request was never read, so
    // it is sent again once on a fresh connection (the pool drops the closed one).
    let mut stale_retry = true;
    let response = loop {
        let req = hyper::Request::post(uri.clone())
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(http::header::ACCEPT, "text/event-stream")
            .body(Full::new(body.clone()))
            .map_err(|e| Failure {
                kind: ErrorKind::Io,
                message: format!("building the request: {e}"),
            })?;
        match client.request(req).await {
            Ok(r) => break r,
            Err(e) if stale_retry && closed_before_answer(&e) => stale_retry = false,
            Err(e) => {
                return Err(Failure {
                    kind: if e.is_connect() {
                        ErrorKind::Connect
                    } else {
                        ErrorKind::Io
                    },
                    message: error_chain(&e),
                })
            }
        }
    };
    let status = response.status();
    let mut body = response.into_body();
    if !status.is_success() {
        let mut head = Vec::new();
        while head.len() < ERROR_BODY_BYTES {
            match body.frame().await {
                Some(Ok(f)) => {
                    if let Some(d) = f.data_ref() {
                        head.extend_from_slice(d);
                    }
                }
                _ => break,
            }
        }
        head.truncate(ERROR_BODY_BYTES);
        return Err(Failure {
            kind: ErrorKind::Http(status.as_u16()),
            message: format!("{status}: {}", String::from_utf8_lossy(&head).trim()),
        });
    }
    let mut parser = SseParser::new();
    let mut chunks = Vec::new();
    let mut out = Success::default();
    let mut last_content: Option<Instant> = None;
    let mut ended = false;
    while !ended {
        let frame = match body.frame().await {
            None => {
                parser.finish(&mut chunks);
                ended = true;
                None
            }
            Some(Ok(f)) => Some(f),
            Some(Err(e)) => {
                return Err(Failure {
                    kind: ErrorKind::Io,
                    message: format!("reading the stream: {}", error_chain(&e)),
                })
            }
        };
        let now = Instant::now();
        if let Some(d) = frame.as_ref().and_then(|f| f.data_ref()) {
            parser.push(d, &mut chunks);
        }
        for c in chunks.drain(..) {
            if let Some(message) = c.error {
                return Err(Failure {
                    kind: ErrorKind::Stream,
                    message,
                });
            }
            if c.usage.is_some() {
                out.usage = c.usage;
            }
            if c.content {
                out.content_chunks += 1;
                match last_content {
                    None => out.ttft = Some(now - sent),
                    Some(prev) => out.itl.push(now - prev),
                }
                last_content = Some(now);
            }
            if c.done {
                ended = true;
            }
        }
    }
    out.e2e = sent.elapsed();
    Ok(out)
}

/// An error with its sources, `a: b: c`.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls() {
        let b = BaseUrl::parse("http://127.0.0.1:8000/").unwrap();
        assert_eq!(
            b.uri("/v1/completions").unwrap().to_string(),
            "http://127.0.0.1:8000/v1/completions"
        );
        let b = BaseUrl::parse("http://localhost:1/api").unwrap();
        assert_eq!(
            b.uri("/v1/models").unwrap().to_string(),
            "http://localhost:1/api/v1/models"
        );
        assert!(BaseUrl::parse("https://x:1").is_err());
        assert!(BaseUrl::parse("127.0.0.1:8000").is_err());
        assert!(BaseUrl::parse("http://x:1/?a=b").is_err());
    }

    /// A server whose first connection reads the request and closes without answering (as
    /// llama.cpp may when it closes a kept-alive connection after a stream), and whose later
    /// connections answer a one-chunk stream.
    async fn closes_first_connection() -> (String, std::sync::Arc<std::sync::atomic::AtomicU32>) {
        use std::sync::atomic::{AtomicU32, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = std::sync::Arc::new(AtomicU32::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let n = count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 65536];
                    let _ = s.read(&mut buf).await;
                    if n == 0 {
                        return; // dropped: closed before any answer
                    }
                    let body =
                        "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\ndata: [DONE]\n\n";
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                        body.len()
                    );
                    let _ = s.write_all(head.as_bytes()).await;
                    let _ = s.write_all(body.as_bytes()).await;
                });
            }
        });
        (format!("http://{addr}/v1/chat/completions"), accepted)
    }

    #[tokio::test]
    async fn a_request_the_server_closed_unanswered_is_sent_again_once() {
        let (url, accepted) = closes_first_connection().await;
        let client = http_client(4, Duration::from_secs(2));
        let r = send(
            &client,
            url.parse().unwrap(),
            Bytes::from_static(b"{}"),
            Duration::from_secs(5),
            Instant::now(),
        )
        .await;
        let ok = r.expect("answered on the second connection");
        assert_eq!(ok.content_chunks, 1);
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    #[test]
    fn error_keys() {
        assert_eq!(ErrorKind::Http(503).key(), "http_503");
        assert_eq!(ErrorKind::Connect.key(), "connect");
        assert_eq!(ErrorKind::Timeout.key(), "timeout");
    }
}
