//! Whether one engine's KV event stream can be trusted: a pure state machine (time passed in,
//! no I/O), so every rule is unit-tested without sockets.
//!
//! A stream is untrusted when it starts (the engine's cache before the subscription is unknown)
//! and after any trouble: a sequence gap (messages lost), a batch that cannot be decoded, a batch
//! published more than `silence` ago (lag), silence while the engine reports prompt work that
//! must have stored blocks, or a lost connection. It becomes trusted again once it has run
//! `probation` without trouble and delivered at least one batch.

/// Tokens per block assumed before the engine's first `BlockStored` says (vLLM's default).
const DEFAULT_BLOCK_SIZE: u64 = 16;

/// Blocks of reported uncached prompt work without an event that make the engine suspect
/// (more than one, so a request whose events race its response is not a false alarm).
const SILENT_BLOCKS: u64 = 4;

/// What went wrong with a stream.
#[derive(Debug, Clone, PartialEq)]
pub enum Trouble {
    /// Sequence numbers were skipped (or went back: the engine restarted).
    Gap {
        /// The sequence number expected.
        expected: u64,
        /// The one received.
        got: u64,
    },
    /// A message could not be decoded.
    Undecodable(String),
    /// A batch arrived this many seconds after it was published.
    Lagging(f64),
    /// The engine reported this many uncached prompt tokens with no event for `silence`.
    Silent(u64),
    /// The connection to the publisher was lost.
    Disconnected(String),
}

impl Trouble {
    /// Whether a fresh subscription may cure it (a broken or silent connection); gaps and bad
    /// batches happen on a working one.
    pub fn resubscribe(&self) -> bool {
        matches!(self, Trouble::Silent(_) | Trouble::Disconnected(_))
    }
}

impl std::fmt::Display for Trouble {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Trouble::Gap { expected, got } => {
                write!(f, "sequence gap: expected {expected}, got {got}")
            }
            Trouble::Undecodable(e) => write!(f, "undecodable batch: {e}"),
            Trouble::Lagging(s) => write!(f, "batch arrived {s:.1} s after it was published"),
            Trouble::Silent(t) => {
                write!(
                    f,
                    "no events while the engine reported {t} uncached prompt tokens"
                )
            }
            Trouble::Disconnected(e) => write!(f, "disconnected: {e}"),
        }
    }
}

/// The trust state of one stream.
#[derive(Debug, Clone)]
pub struct StreamHealth {
    silence_s: f64,
    probation_s: f64,
    /// The next sequence number expected (none right after subscribing).
    next_seq: Option<u64>,
    trusted: bool,
    /// Since when the stream has run without trouble.
    clean_since: f64,
    /// Batches received since `clean_since`.
    batches_since_clean: u64,
    block_size: u64,
    /// Uncached prompt tokens reported since the last batch, and when the first of them was.
    work_tokens: u64,
    work_since: Option<f64>,
}

impl StreamHealth {
    /// A new, untrusted stream subscribed at `now`.
    pub fn new(silence_s: f64, probation_s: f64, now: f64) -> Self {
        StreamHealth {
            silence_s,
            probation_s,
            next_seq: None,
            trusted: false,
            clean_since: now,
            batches_since_clean: 0,
            block_size: DEFAULT_BLOCK_SIZE,
            work_tokens: 0,
            work_since: None,
        }
    }

    /// Whether the router may match exactly on the stream's view.
    pub fn is_trusted(&self) -> bool {
        self.trusted
    }

    /// The sequence number expected next (none right after subscribing or trouble).
    pub fn expected(&self) -> Option<u64> {
        self.next_seq
    }

    /// The stream is untrusted from `now` (trouble, or a new subscription): sequence numbers
    /// start over and probation with them. Returns whether it was trusted (a new episode).
    pub fn distrust(&mut self, now: f64) -> bool {
        let was = self.trusted;
        self.trusted = false;
        self.next_seq = None;
        self.clean_since = now;
        self.batches_since_clean = 0;
        self.work_tokens = 0;
        self.work_since = None;
        was
    }

    /// A decoded batch: its sequence number, its publication time as Unix seconds, the
    /// block size its events used, and the wall clock now (`unix_now`) and the monotonic one.
    pub fn on_batch(
        &mut self,
        seq: u64,
        published: Option<f64>,
        block_size: Option<u32>,
        unix_now: f64,
    ) -> Result<(), Trouble> {
        if let Some(size) = block_size {
            self.block_size = u64::from(size.max(1));
        }
        let expected = self.next_seq;
        self.next_seq = Some(seq.wrapping_add(1));
        self.work_tokens = 0;
        self.work_since = None;
        if let Some(expected) = expected.filter(|&e| e != seq) {
            return Err(Trouble::Gap { expected, got: seq });
        }
        if let Some(lag) = published.map(|ts| unix_now - ts) {
            if lag > self.silence_s {
                return Err(Trouble::Lagging(lag));
            }
        }
        self.batches_since_clean += 1;
        Ok(())
    }

    /// The engine reported `tokens` more uncached prompt tokens (finished requests' usage).
    pub fn on_work(&mut self, tokens: u64, now: f64) {
        if tokens > 0 {
            self.work_tokens = self.work_tokens.saturating_add(tokens);
            self.work_since.get_or_insert(now);
        }
    }

    /// Periodic check: silence is trouble; a clean probation earns trust. Returns `Ok(true)`
    /// when the stream just became trusted.
    pub fn check(&mut self, now: f64) -> Result<bool, Trouble> {
        if let Some(since) = self.work_since {
            if self.work_tokens >= SILENT_BLOCKS * self.block_size && now - since > self.silence_s {
                return Err(Trouble::Silent(self.work_tokens));
            }
        }
        if !self.trusted
            && self.batches_since_clean > 0
            && now - self.clean_since >= self.probation_s
        {
            self.trusted = true;
            return Ok(true);
        }
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn healthy(now: f64) -> StreamHealth {
        let mut h = StreamHealth::new(10.0, 5.0, 0.0);
        h.on_batch(41, Some(100.0), Some(16), 100.0).unwrap();
        assert_eq!(h.check(now), Ok(true));
        h
    }

    #[test]
    fn trust_needs_a_clean_probation_with_events() {
        let mut h = StreamHealth::new(10.0, 5.0, 0.0);
        assert_eq!(h.check(6.0), Ok(false), "no batch yet");
        h.on_batch(7, None, None, 0.0).unwrap();
        assert_eq!(h.check(4.9), Ok(false), "probation not over");
        assert_eq!(h.check(5.0), Ok(true));
        assert!(h.is_trusted());
        assert_eq!(h.check(6.0), Ok(false), "already trusted");
    }

    #[test]
    fn a_gap_or_a_restart_is_trouble_and_probation_starts_over() {
        let mut h = healthy(5.0);
        h.on_batch(42, None, None, 0.0).unwrap();
        assert_eq!(
            h.on_batch(44, None, None, 0.0),
            Err(Trouble::Gap {
                expected: 43,
                got: 44
            })
        );
        assert!(h.distrust(6.0), "a new episode");
        assert!(!h.distrust(6.5), "the same episode");
        // After distrust any sequence number starts the count (a resubscription).
        h.on_batch(0, None, None, 0.0).unwrap();
        assert_eq!(h.check(11.0), Ok(false));
        assert_eq!(h.check(11.5), Ok(true));
        h.on_batch(1, None, None, 0.0).unwrap();
        assert!(matches!(
            h.on_batch(0, None, None, 0.0),
            Err(Trouble::Gap { .. })
        ));
    }

    #[test]
    fn late_batches_are_trouble() {
        let mut h = healthy(5.0);
        assert_eq!(h.on_batch(42, Some(100.0), None, 109.0), Ok(()));
        assert!(matches!(
            h.on_batch(43, Some(100.0), None, 111.0),
            Err(Trouble::Lagging(l)) if l > 10.0
        ));
    }

    #[test]
    fn silence_while_the_engine_works_is_trouble_and_an_event_clears_it() {
        let mut h = healthy(5.0);
        // Less than four blocks of work: a race with the events, not silence.
        h.on_work(63, 10.0);
        assert_eq!(h.check(30.0), Ok(false));
        h.on_work(1, 31.0);
        assert_eq!(h.check(20.0), Ok(false), "not silent for long enough");
        h.on_batch(42, None, None, 0.0).unwrap();
        assert_eq!(h.check(40.0), Ok(false), "the event cleared it");
        h.on_work(64, 40.0);
        assert_eq!(h.check(50.1), Err(Trouble::Silent(64)));
        assert!(Trouble::Silent(64).resubscribe());
        assert!(!Trouble::Lagging(1.0).resubscribe());
        // Bigger blocks need more work to count.
        let mut h = healthy(5.0);
        h.on_batch(42, None, Some(256), 0.0).unwrap();
        h.on_work(1000, 40.0);
        assert_eq!(h.check(60.0), Ok(false));
    }
}
