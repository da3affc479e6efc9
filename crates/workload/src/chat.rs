//! Multi-turn chat sessions.
//!
//! Each session is a conversation of several turns. Turn `t`'s prompt is the
//! whole conversation so far — an optional system prompt shared by every
//! session, then the earlier user and assistant messages, then the new user
//! message — and asks for an assistant answer of a given length, which joins
//! the history of turn `t + 1`. Earlier messages are the same `Arc`s from turn
//! to turn, so a session of `T` turns stores each message once.
//!
//! Timing is open-loop: sessions start at the times of an
//! [`ArrivalProcess`], and turn `t + 1` arrives a think time after turn `t`
//! *arrived*. A real user waits for the answer first, but a pre-computed
//! workload cannot know the answer's latency, so the think time is counted
//! from the previous arrival; choose it to cover the expected response time.
//!
//! Requests come out in arrival order across all sessions (ties broken by
//! session index). Only sessions in progress are held in memory.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;
use std::sync::Arc;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::arrivals::{ArrivalProcess, ArrivalTimes};
use crate::error::Result;
use crate::request::{ChatMessage, Prompt, Request, Role};
use crate::sampling::{Count, Delay};
use crate::text::{key, words};
use crate::DEFAULT_MODEL;

/// Domain tags separating the text and random streams of this generator.
const SYSTEM: u64 = 0x4348_5359; // "CHSY"
const USER: u64 = 0x4348_5553; // "CHUS"
const ASSISTANT: u64 = 0x4348_4153; // "CHAS"
const SESSION: u64 = 0x4348_5345; // "CHSE"
const MESSAGES: u64 = 0x4348_4D53; // "CHMS"
const ARRIVE: u64 = 0x4348_4152; // "CHAR"

/// Parameters of a chat workload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ChatSpec {
    /// Number of sessions.
    pub sessions: u64,
    /// Turns per session.
    pub turns: Count,
    /// Tokens of a system prompt shared by all sessions (0: none).
    pub system_prompt_len: u32,
    /// Tokens of each user message.
    pub user_len: Count,
    /// Tokens of each assistant answer (the turn's `max_tokens`).
    pub assistant_len: Count,
    /// Delay from one turn's arrival to the next turn's.
    pub think_time: Delay,
    /// When sessions start.
    pub arrivals: ArrivalProcess,
    /// Base model name.
    pub model: String,
}

impl Default for ChatSpec {
    fn default() -> Self {
        Self {
            sessions: 100,
            turns: Count::Fixed(5),
            system_prompt_len: 0,
            user_len: Count::Fixed(128),
            assistant_len: Count::Fixed(256),
            think_time: Delay::Exponential { mean_s: 10.0 },
            arrivals: ArrivalProcess::Instant,
            model: DEFAULT_MODEL.to_string(),
        }
    }
}

impl ChatSpec {
    /// Checks the parameters.
    pub fn validate(&self) -> Result<()> {
        self.turns.validate("turns")?;
        self.user_len.validate("user_len")?;
        self.assistant_len.validate("assistant_len")?;
        self.think_time.validate()?;
        self.arrivals.validate()
    }

    /// The generator for `seed`.
    pub fn build(&self, seed: u64) -> Result<ChatSessions> {
        ChatSessions::new(self, seed)
    }
}

/// One conversation in progress.
#[derive(Debug)]
struct Session {
    index: u64,
    id: Arc<str>,
    rng: ChaCha8Rng,
    history: Vec<ChatMessage>,
    turn: u32,
    turns: u32,
    arrival: f64,
}

impl Session {
    /// A session's private random stream: its turn count is its first draw,
    /// which lets [`ChatSessions::new`] count requests without generating.
    fn rng(seed: u64, index: u64) -> ChaCha8Rng {
        ChaCha8Rng::seed_from_u64(key(seed, SESSION, index))
    }
}

/// Heap entry ordering sessions by next arrival, then by index.
#[derive(Debug)]
struct Pending(Box<Session>);

impl Ord for Pending {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0
            .arrival
            .total_cmp(&other.0.arrival)
            .then(self.0.index.cmp(&other.0.index))
    }
}

impl PartialOrd for Pending {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Pending {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Pending {}

/// Iterator over a chat workload; see the module docs.
#[derive(Debug)]
pub struct ChatSessions {
    spec: ChatSpec,
    seed: u64,
    model: Arc<str>,
    system: Option<ChatMessage>,
    starts: ArrivalTimes,
    next_start: Option<f64>,
    started: u64,
    active: BinaryHeap<Reverse<Pending>>,
    emitted: u64,
    total: u64,
}

impl ChatSessions {
    /// Builds the generator; counts its requests up front (O(sessions)).
    pub fn new(spec: &ChatSpec, seed: u64) -> Result<Self> {
        spec.validate()?;
        let total = match spec.turns {
            Count::Fixed(t) => spec.sessions * u64::from(t),
            turns => (0..spec.sessions)
                .map(|i| u64::from(turns.sample(&mut Session::rng(seed, i))))
                .sum(),
        };
        let system = (spec.system_prompt_len > 0).then(|| ChatMessage {
            role: Role::System,
            content: Arc::from(words(key(seed, SYSTEM, 0), spec.system_prompt_len as usize)),
        });
        let mut starts = spec.arrivals.times(key(seed, ARRIVE, 0))?;
        let next_start = if spec.sessions > 0 {
            starts.next()
        } else {
            None
        };
        Ok(Self {
            spec: spec.clone(),
            seed,
            model: Arc::from(spec.model.as_str()),
            system,
            starts,
            next_start,
            started: 0,
            active: BinaryHeap::new(),
            emitted: 0,
            total,
        })
    }

    /// Starts the next session at `at`; it may have zero turns.
    fn start(&mut self, at: f64) {
        let index = self.started;
        self.started += 1;
        self.next_start = if self.started < self.spec.sessions {
            self.starts.next()
        } else {
            None
        };
        let mut rng = Session::rng(self.seed, index);
        let turns = self.spec.turns.sample(&mut rng);
        if turns == 0 {
            return;
        }
        self.active.push(Reverse(Pending(Box::new(Session {
            index,
            id: Arc::from(format!("session-{index}")),
            rng,
            history: self.system.iter().cloned().collect(),
            turn: 0,
            turns,
            arrival: at,
        }))));
    }

    /// Emits the current turn of `s` and re-queues it if turns remain.
    fn turn(&mut self, mut s: Box<Session>) -> Request {
        let user_len = self.spec.user_len.sample(&mut s.rng);
        let answer_len = self.spec.assistant_len.sample(&mut s.rng);
        // Keys nest session then turn, so no two messages share a stream.
        let session_key = key(self.seed, MESSAGES, s.index);
        let turn = u64::from(s.turn);
        s.history.push(ChatMessage {
            role: Role::User,
            content: Arc::from(words(key(session_key, USER, turn), user_len as usize)),
        });
        let req = Request {
            id: self.emitted,
            arrival_s: s.arrival,
            model: self.model.clone(),
            adapter: None,
            prompt: Prompt::Chat(s.history.clone()),
            max_tokens: answer_len,
            session_id: Some(s.id.clone()),
            cache_salt: None,
        };
        self.emitted += 1;
        s.turn += 1;
        if s.turn < s.turns {
            // The answer is only made when a later turn will quote it.
            s.history.push(ChatMessage {
                role: Role::Assistant,
                content: Arc::from(words(
                    key(session_key, ASSISTANT, turn),
                    answer_len as usize,
                )),
            });
            s.arrival += self.spec.think_time.sample(&mut s.rng);
            self.active.push(Reverse(Pending(s)));
        }
        req
    }
}

impl Iterator for ChatSessions {
    type Item = Request;

    fn next(&mut self) -> Option<Request> {
        // Start every session due no later than the earliest pending turn, so
        // that output stays in arrival order.
        while let Some(at) = self.next_start {
            match self.active.peek() {
                Some(Reverse(p)) if p.0.arrival < at => break,
                _ => self.start(at),
            }
        }
        let Reverse(Pending(s)) = self.active.pop()?;
        Some(self.turn(s))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = usize::try_from(self.total - self.emitted).unwrap_or(usize::MAX);
        (left, Some(left))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn spec() -> ChatSpec {
        ChatSpec {
            sessions: 6,
            turns: Count::Fixed(4),
            system_prompt_len: 32,
            user_len: Count::Fixed(10),
            assistant_len: Count::Fixed(20),
            think_time: Delay::Fixed { seconds: 5.0 },
            arrivals: ArrivalProcess::Constant { rate: 1.0 },
            ..Default::default()
        }
    }

    #[test]
    fn conversations_grow_and_share() {
        let reqs: Vec<Request> = spec().build(3).unwrap().collect();
        assert_eq!(reqs.len(), 24);
        let s0: Vec<&Request> = reqs
            .iter()
            .filter(|r| r.session_id.as_deref() == Some("session-0"))
            .collect();
        assert_eq!(s0.len(), 4);
        for (t, r) in s0.iter().enumerate() {
            // system + t (user, assistant) pairs + the new user message.
            assert_eq!(r.prompt_tokens(), 32 + t * 30 + 10);
            assert_eq!(r.max_tokens, 20);
            assert_eq!(r.arrival_s, 5.0 * t as f64);
            let m = r.prompt.messages().unwrap();
            assert_eq!(m.len(), 2 + 2 * t);
            assert_eq!(m[0].role, Role::System);
            assert_eq!(m.last().unwrap().role, Role::User);
        }
        // Turn 3 quotes turn 1's messages by the same allocation.
        let (m1, m3) = (
            s0[1].prompt.messages().unwrap(),
            s0[3].prompt.messages().unwrap(),
        );
        for i in 0..m1.len() {
            assert!(Arc::ptr_eq(&m1[i].content, &m3[i].content));
        }
        // Every session shares the system prompt.
        let sys = &reqs[0].prompt.messages().unwrap()[0].content;
        assert!(reqs
            .iter()
            .all(|r| Arc::ptr_eq(&r.prompt.messages().unwrap()[0].content, sys)));
        // Different sessions say different things.
        let s1 = reqs
            .iter()
            .find(|r| r.session_id.as_deref() == Some("session-1"))
            .unwrap();
        assert_ne!(
            s0[0].prompt.messages().unwrap()[1],
            s1.prompt.messages().unwrap()[1]
        );
    }

    #[test]
    fn arrival_order_and_ids() {
        let mut s = spec();
        s.think_time = Delay::Exponential { mean_s: 3.0 };
        s.turns = Count::Uniform { min: 0, max: 6 };
        let g = s.build(11).unwrap();
        let want = g.size_hint().0;
        let reqs: Vec<Request> = g.collect();
        assert_eq!(reqs.len(), want);
        for (i, w) in reqs.windows(2).enumerate() {
            assert!(w[0].arrival_s <= w[1].arrival_s, "out of order at {i}");
            assert_eq!(w[1].id, w[0].id + 1);
        }
    }

    #[test]
    fn no_system_prompt_by_default() {
        let r = ChatSpec::default().build(0).unwrap().next().unwrap();
        let m = r.prompt.messages().unwrap();
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].role, Role::User);
        assert_eq!(r.prompt_tokens(), 128);
    }

    #[test]
    fn rejects_bad_specs() {
        let mut s = spec();
        s.turns = Count::Uniform { min: 3, max: 1 };
        assert!(s.build(0).is_err());
        let mut s = spec();
        s.think_time = Delay::Fixed { seconds: f64::NAN };
        assert!(s.build(0).is_err());
    }

    proptest! {
        #[test]
        fn deterministic_by_seed(seed in any::<u64>()) {
            let mut s = spec();
            s.user_len = Count::Uniform { min: 1, max: 30 };
            s.arrivals = ArrivalProcess::Poisson { rate: 2.0 };
            s.think_time = Delay::Exponential { mean_s: 1.0 };
            let a: Vec<Request> = s.build(seed).unwrap().collect();
            let b: Vec<Request> = s.build(seed).unwrap().collect();
            prop_assert_eq!(&a, &b);
            let c: Vec<Request> = s.build(seed.wrapping_add(1)).unwrap().collect();
            prop_assert_ne!(&a, &c);
        }
    }
}
