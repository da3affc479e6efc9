//! Hyper answers a request it cannot parse by itself (400, 414, 431 with an empty body, then
//! closes) before any handler runs. This connection wrapper rewrites exactly those answers into
//! the OpenAI error shape every other error has, so a client's error handling sees one format.
//!
//! Hyper's own answers are recognised by their exact form: the status line, `connection: close`
//! and `content-length: 0`, a `date`, and nothing else in the write. The gateway's own responses
//! always have a body, so none of them matches.

use std::io::IoSlice;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use hyper::rt::{Read, ReadBufCursor, Write};

use crate::error::ApiError;

/// A client connection whose hyper-made error answers carry an OpenAI error body.
pub struct ShapedErrors<T> {
    inner: T,
    /// A replacement being written: its bytes, how many are written, and the length of the
    /// write it stands for (reported to hyper once all of it is out).
    pending: Option<(Vec<u8>, usize, usize)>,
}

impl<T> ShapedErrors<T> {
    /// Wraps a connection.
    pub fn new(inner: T) -> Self {
        ShapedErrors {
            inner,
            pending: None,
        }
    }
}

/// The OpenAI-shaped answer for one of hyper's own error answers, if `write` is one.
fn reshape(write: &[u8]) -> Option<Vec<u8>> {
    const TAIL: &[u8] = b"\r\nconnection: close\r\ncontent-length: 0\r\ndate: ";
    // A status line, the fixed headers, a 29-byte date and the blank line: well under 128.
    if write.len() > 128 || !write.ends_with(b" GMT\r\n\r\n") {
        return None;
    }
    let (status, error) = if write.starts_with(b"HTTP/1.1 400 Bad Request") {
        ("400 Bad Request", ApiError::invalid_http())
    } else if write.starts_with(b"HTTP/1.1 414 URI Too Long") {
        ("414 URI Too Long", ApiError::uri_too_long())
    } else if write.starts_with(b"HTTP/1.1 431 Request Header Fields Too Large") {
        (
            "431 Request Header Fields Too Large",
            ApiError::header_fields_too_large(),
        )
    } else {
        return None;
    };
    let after_status = &write[b"HTTP/1.1 ".len() + status.len()..];
    if !after_status.starts_with(TAIL) {
        return None;
    }
    let body = error.body();
    let mut out = format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    Some(out)
}

impl<T: Write + Unpin> ShapedErrors<T> {
    /// Writes the pending replacement; `Ready(Ok(n))` reports the replaced write's length.
    fn drain(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<usize>> {
        while let Some((bytes, written, stands_for)) = &mut self.pending {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &bytes[*written..]))?;
            if n == 0 {
                self.pending = None;
                return Poll::Ready(Ok(0));
            }
            *written += n;
            if *written == bytes.len() {
                let stands_for = *stands_for;
                self.pending = None;
                return Poll::Ready(Ok(stands_for));
            }
        }
        Poll::Ready(Ok(0))
    }
}

impl<T: Read + Unpin> Read for ShapedErrors<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: Write + Unpin> Write for ShapedErrors<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.pending.is_none() {
            match reshape(buf) {
                Some(bytes) => self.pending = Some((bytes, 0, buf.len())),
                None => return Pin::new(&mut self.inner).poll_write(cx, buf),
            }
        }
        self.drain(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        if self.pending.is_none() {
            // Hyper's error answer is a head alone: one non-empty slice.
            let mut filled = bufs.iter().filter(|b| !b.is_empty());
            let reshaped = match (filled.next(), filled.next()) {
                (Some(only), None) => reshape(only).map(|bytes| (bytes, only.len())),
                _ => None,
            };
            match reshaped {
                Some((bytes, len)) => self.pending = Some((bytes, 0, len)),
                None => return Pin::new(&mut self.inner).poll_write_vectored(cx, bufs),
            }
        }
        self.drain(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DATE: &str = "date: Fri, 04 Dec 2026 07:59:21 GMT\r\n\r\n";

    #[test]
    fn hyper_answers_get_an_openai_body() {
        for (status, code) in [
            ("400 Bad Request", "invalid_http"),
            ("414 URI Too Long", "uri_too_long"),
            ("431 Request Header Fields Too Large", "headers_too_large"),
        ] {
            let hyper =
                format!("HTTP/1.1 {status}\r\nconnection: close\r\ncontent-length: 0\r\n{DATE}");
            let out = String::from_utf8(reshape(hyper.as_bytes()).unwrap()).unwrap();
            let (head, body) = out.split_once("\r\n\r\n").unwrap();
            assert!(
                head.starts_with(&format!("HTTP/1.1 {status}\r\n")),
                "{head}"
            );
            assert!(head.contains(&format!("content-length: {}", body.len())));
            let v: serde_json::Value = serde_json::from_str(body).unwrap();
            assert_eq!(v["error"]["code"], code);
        }
    }

    #[test]
    fn other_writes_pass_untouched() {
        for write in [
            // The gateway's own errors have a body.
            format!("HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 2\r\n{DATE}{{}}"),
            // Another status, or another header order.
            format!("HTTP/1.1 404 Not Found\r\nconnection: close\r\ncontent-length: 0\r\n{DATE}"),
            format!("HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n{DATE}"),
            // A body chunk.
            "data: {\"choices\":[]}\n\n".to_string(),
        ] {
            assert!(reshape(write.as_bytes()).is_none(), "{write}");
        }
    }
}
