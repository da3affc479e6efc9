//! Closing a client connection when the gateway shuts down, without dropping a request.
//!
//! HTTP/1.1 has no way to tell a client that a kept-alive connection is about to close except
//! `Connection: close` on a response. So during the drain every response carries it, and a
//! connection is closed only when the client cannot have a request on its way: at once when
//! it is idle at the signal, else when its responses are over and the client had [`LINGER`]
//! to send the next request on it (which is answered 503 `shutting_down`, not met with a
//! closed socket). A response streamed since before the signal went out without the header;
//! the linger is what lets its client's next request get a clear answer.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderValue};
use axum::response::Response;
use bytes::Bytes;
use http_body::{Frame, SizeHint};
use tokio::sync::Notify;

/// How long a connection stays open for the client's next request once its last response is
/// over, during the drain.
pub const LINGER: Duration = Duration::from_secs(1);

/// Requests of one connection whose response has not been fully sent.
#[derive(Debug, Default)]
pub struct Activity {
    active: AtomicUsize,
    changed: Notify,
}

impl Activity {
    /// Counts a request as active until the returned guard (moved into its response body)
    /// is dropped.
    pub fn begin(self: &Arc<Self>) -> ActiveGuard {
        self.active.fetch_add(1, Ordering::AcqRel);
        self.changed.notify_waiters();
        ActiveGuard(self.clone())
    }

    /// Whether a response is still being produced or sent.
    pub fn is_busy(&self) -> bool {
        self.active.load(Ordering::Acquire) > 0
    }

    /// Waits until the connection can be closed without dropping a request: no response in
    /// progress and none started within [`LINGER`] of the last one ending.
    pub async fn quiet(&self) {
        loop {
            let changed = self.changed.notified();
            if self.is_busy() {
                changed.await;
                continue;
            }
            tokio::select! {
                _ = changed => {}
                _ = tokio::time::sleep(LINGER) => {
                    if !self.is_busy() {
                        return;
                    }
                }
            }
        }
    }
}

/// One active request; dropping it (with the response body) ends it.
#[derive(Debug)]
pub struct ActiveGuard(Arc<Activity>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::AcqRel);
        self.0.changed.notify_waiters();
    }
}

/// A response body that keeps its request counted as active until it is sent or dropped.
struct Tracked {
    inner: Body,
    _guard: ActiveGuard,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Ties `response` to its connection's activity; during the drain it also asks the client to
/// close the connection after it.
pub fn track(mut response: Response, guard: ActiveGuard, draining: bool) -> Response {
    if draining {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response.map(|inner| {
        Body::new(Tracked {
            inner,
            _guard: guard,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn quiet_waits_for_the_last_response_and_the_linger() {
        let activity = Arc::new(Activity::default());
        let guard = activity.begin();
        let start = tokio::time::Instant::now();
        let waiter = {
            let activity = activity.clone();
            tokio::spawn(async move { activity.quiet().await })
        };
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(
            !waiter.is_finished(),
            "quiet while a response is in progress"
        );
        drop(guard);
        // A request within the linger restarts the wait.
        tokio::time::sleep(LINGER / 2).await;
        let second = activity.begin();
        tokio::time::sleep(LINGER * 2).await;
        assert!(
            !waiter.is_finished(),
            "quiet while the second response is in progress"
        );
        drop(second);
        waiter.await.unwrap();
        let waited = start.elapsed();
        assert!(
            waited >= Duration::from_secs(5) + LINGER * 5 / 2 + LINGER,
            "{waited:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_is_quiet_after_the_linger() {
        let activity = Arc::new(Activity::default());
        let start = tokio::time::Instant::now();
        activity.quiet().await;
        assert_eq!(start.elapsed(), LINGER);
    }
}
