//! Shared gateway state: the router and the backend table behind one lock, the clients, the
//! metrics and the clock.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use http::HeaderValue;
use parking_lot::Mutex;
use switchyard_core::{
    Decision, ExactChain, InstanceId, Observation, Prediction, PreparedPrompt, RequestId,
    RequestKind, RouteRequest, Router,
};

use crate::admission::Admission;
use crate::backends::{Backend, BackendSpec};
use crate::config::Settings;
use crate::metrics::Metrics;
use crate::parse::ParsedRequest;
use crate::upstream::Upstream;
use switchyard_core::models::{resolve, FallbackLog, ModelError, Resolution, Via};

/// What lives behind the lock: the router and the backends it knows, indexed by slot.
pub struct Registry {
    /// The routing core.
    pub router: Router,
    /// Backends by the router's slot.
    slots: Vec<Option<Arc<Backend>>>,
    /// Backends by name.
    pub by_name: BTreeMap<String, Arc<Backend>>,
    /// Backends waiting for model discovery, by name.
    pub pending: BTreeMap<String, BackendSpec>,
    /// Backends leaving (draining before removal), by name.
    pub leaving: HashSet<String>,
    /// Names the fleet file (or Kubernetes discovery) listed at its last load.
    pub from_file: HashSet<String>,
    /// Dynamic adapter placement (`--dynamic-lora-placement`): the demand and the plan.
    pub placement: Option<switchyard_core::placement::Planner>,
    /// Model aliases (flags and fleet file merged): alias -> target.
    aliases: HashMap<String, String>,
    /// `--strict-models`: no single-model fallback.
    strict_models: bool,
    /// Names the single-model fallback has logged.
    fallback_log: FallbackLog,
}

impl Registry {
    /// An empty fleet around `router`.
    pub fn new(router: Router) -> Self {
        Registry {
            router,
            slots: Vec::new(),
            by_name: BTreeMap::new(),
            pending: BTreeMap::new(),
            leaving: HashSet::new(),
            from_file: HashSet::new(),
            placement: None,
            aliases: HashMap::new(),
            strict_models: false,
            fallback_log: FallbackLog::default(),
        }
    }

    /// Replaces the model aliases (already merged and checked, see [`switchyard_core::models::merge_aliases`]).
    pub fn set_aliases(&mut self, aliases: HashMap<String, String>) {
        self.aliases = aliases;
    }

    /// Turns the single-model fallback off (`--strict-models`) or on.
    pub fn set_strict_models(&mut self, strict: bool) {
        self.strict_models = strict;
    }

    /// The backend behind a router handle, if it is still current.
    pub fn backend(&self, id: InstanceId) -> Option<&Arc<Backend>> {
        self.slots
            .get(id.slot as usize)?
            .as_ref()
            .filter(|b| b.id == id)
    }

    /// Records a backend the router just added.
    pub fn insert(&mut self, backend: Arc<Backend>) {
        let slot = backend.id.slot as usize;
        if self.slots.len() <= slot {
            self.slots.resize(slot + 1, None);
        }
        self.slots[slot] = Some(backend.clone());
        self.by_name.insert(backend.spec.name.clone(), backend);
    }

    /// Forgets a backend (the caller removes it from the router).
    pub fn take(&mut self, name: &str) -> Option<Arc<Backend>> {
        let backend = self.by_name.remove(name)?;
        if let Some(slot) = self.slots.get_mut(backend.id.slot as usize) {
            if slot.as_ref().is_some_and(|b| Arc::ptr_eq(b, &backend)) {
                *slot = None;
            }
        }
        self.leaving.remove(name);
        Some(backend)
    }

    /// Resolves a requested model name (alias, base model, adapter, single-model fallback; see
    /// [`crate::models`]).
    pub fn resolve<'a>(&'a self, requested: &'a str) -> Result<Resolution<'a>, ModelError> {
        resolve(
            self.router.fleet(),
            &self.aliases,
            self.strict_models,
            requested,
        )
    }

    /// Resolves a request's model name into what routing needs, owned (so the prompt can be
    /// prepared without the lock); logs the single-model fallback once per name.
    pub fn target(&mut self, requested: &str) -> Result<Target, ModelError> {
        // Fields, not `self.resolve`: the fallback log is written while the resolution lives.
        let resolution = resolve(
            self.router.fleet(),
            &self.aliases,
            self.strict_models,
            requested,
        )?;
        if resolution.via == Via::Fallback {
            note_fallback(&mut self.fallback_log, requested, &resolution.model);
        }
        Ok(Target {
            upstream_model: resolution.upstream_model().map(str::to_string),
            model: resolution.model.into_owned(),
            adapter: resolution.adapter.map(str::to_string),
        })
    }

    /// Routes a parsed request to `target` with its prepared prompt
    /// ([`Target::prepare`]).
    pub fn route(
        &mut self,
        parsed: &ParsedRequest<'_>,
        target: &Target,
        prepared: &PreparedPrompt,
        kind: RequestKind,
        now: f64,
    ) -> Result<Decision, ModelError> {
        let router = &mut self.router;
        // The client's token ids, if any, were parsed into the prepared prompt (not here,
        // under the lock).
        parsed
            .with_route_request_without_ids(&target.model, target.adapter.as_deref(), |r| {
                router.route_prepared(&target.request(r, kind), prepared, now)
            })
            .map_err(|_| ModelError::Unknown(parsed.model.to_string()))
    }

    /// Every served name: base models (no parent) and adapters (with their base model).
    pub fn catalog(&self) -> BTreeMap<String, Option<String>> {
        let fleet = self.router.fleet();
        let mut out: BTreeMap<String, Option<String>> =
            fleet.models().map(|m| (m.to_string(), None)).collect();
        for (a, base) in fleet.adapters() {
            out.entry(a.to_string())
                .or_insert_with(|| Some(base.to_string()));
        }
        out
    }

    /// What `/v1/models` lists: id -> (root, parent). The catalog (root = the name itself), then
    /// every alias whose target resolves (root = the target, parent = the target's base model
    /// when the target is an adapter); an alias shadows a served name, as in routing.
    pub fn listing(&self) -> BTreeMap<String, (String, Option<String>)> {
        let catalog = self.catalog();
        let mut out: BTreeMap<String, (String, Option<String>)> = catalog
            .iter()
            .map(|(name, parent)| (name.clone(), (name.clone(), parent.clone())))
            .collect();
        for (alias, target) in &self.aliases {
            match catalog.get(target) {
                Some(parent) => {
                    out.insert(alias.clone(), (target.clone(), parent.clone()));
                }
                // The target is not served: requests for the alias get 404, so it is not listed.
                None => {
                    out.remove(alias);
                }
            }
        }
        out
    }

    /// Applies an observation; errors (an instance or request the router no longer knows,
    /// after a removal) are expected and only logged.
    pub fn observe(&mut self, observation: Observation, now: f64) {
        if let (Some(p), Observation::Routed { plan, .. }) = (self.placement.as_mut(), &observation)
        {
            if let (Some(adapter), false) = (plan.adapter(), plan.is_decode_only()) {
                p.record(adapter, now);
            }
        }
        if let Err(e) = self.router.observe(observation, now) {
            tracing::debug!("observation not applied: {e}");
        }
    }
}

/// A requested model name resolved for routing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// Base model to route on.
    pub model: String,
    /// Adapter asked for, if any.
    pub adapter: Option<String>,
    /// The `model` to put in the body sent upstream, when an alias or the single-model
    /// fallback applied (else the body's own is right).
    pub upstream_model: Option<String>,
}

impl Target {
    /// The core's request for `kind`: an embedding generates nothing, so no decode budget.
    fn request<'a>(&self, r: &RouteRequest<'a>, kind: RequestKind) -> RouteRequest<'a> {
        let max_tokens = match kind {
            RequestKind::Generate => r.max_tokens,
            RequestKind::Embed => 0,
        };
        RouteRequest {
            kind,
            max_tokens,
            ..*r
        }
    }

    /// Hashes the request's prompt for routing, without the router (outside its lock).
    pub fn prepare(
        &self,
        parsed: &ParsedRequest<'_>,
        kind: RequestKind,
        block_bytes: usize,
    ) -> PreparedPrompt {
        parsed.with_route_request(&self.model, self.adapter.as_deref(), |r| {
            let prepared = switchyard_core::prepare(&self.request(r, kind), block_bytes);
            match r.token_ids {
                // The client's own ids, parsed once here for every route of the request.
                Some(ids) => prepared.with_token_ids(ids.to_vec()),
                None => prepared,
            }
        })
    }
}

/// Logs, once per name (see [`FallbackLog`]), that an unknown name went to the only model.
fn note_fallback(log: &mut FallbackLog, requested: &str, model: &str) {
    if log.first_time(requested, model) {
        tracing::info!(
            requested,
            model,
            "unknown model name sent to the fleet's only model (--strict-models refuses it)"
        );
    }
}

/// A chat request kept until its answer ends, so that the answer can be tokenized into the
/// piece cache for the conversation's next turn ([`Gateway::answer_warm`]).
#[derive(Debug)]
pub struct AnswerWarm {
    /// The base model whose tokenizer renders and tokenizes it.
    model: String,
    /// The request's prompt: its messages (role, content) or its text.
    prompt: crate::tokenize::Input<String>,
    /// Whether the last question is warmed too (and a prompt of one piece at all).
    with_question: bool,
}

/// Answers (with their question) of fewer bytes are warmed on an async worker: a few
/// microseconds, less than a hop to the blocking pool.
const WARM_ON_WORKER_BYTES: usize = 1 << 10;

/// Prompts with this many bytes of text or more are tokenized on the blocking pool (about 4k
/// tokens: a few milliseconds when the text is new).
pub const TOKENIZE_ON_POOL_BYTES: usize = 16 << 10;

/// The gateway: everything handlers and background tasks share.
pub struct Gateway {
    /// Router and backends; held only for route/observe, never across an await.
    pub registry: Mutex<Registry>,
    /// Settings in force.
    pub settings: Settings,
    /// Clients to the engines.
    pub upstream: Upstream,
    /// Prometheus metrics.
    pub metrics: Metrics,
    /// Requests waiting for capacity.
    pub admission: Admission,
    /// The router's index block size, for preparing prompts outside the lock.
    pub block_bytes: usize,
    /// Tokenizers by model (`--tokenizer`), run in the prepare step, outside the lock.
    pub tokenizers: crate::tokenize::Tokenizers,
    /// Long prompts tokenized on the blocking pool at once: one per CPU.
    tokenize_permits: Arc<tokio::sync::Semaphore>,
    /// Request-body bytes held at once over all requests (`--max-body-memory`).
    pub body_budget: crate::body_budget::BodyBudget,
    /// What the dashboard shows beyond the router and the metrics (bounded rings).
    pub live: crate::live::Live,
    /// Replicas this one shares its decisions with (`--peer`).
    pub peers: Option<crate::peers::Peers>,
    /// Wakes what waits for shutdown (the dashboard's event streams) when it begins.
    shutdown: tokio::sync::Notify,
    started: Instant,
    started_unix: u64,
    next_request: AtomicU64,
    id_prefix: u32,
    shutting_down: AtomicBool,
}

impl Gateway {
    /// A gateway with an empty fleet.
    pub fn new(settings: Settings, router: Router) -> Arc<Self> {
        Self::with_tokenizers(settings, router, Default::default())
    }

    /// A gateway with an empty fleet and these tokenizers (loaded from `settings.tokenizers`
    /// by the caller, which reports a file that does not load).
    pub fn with_tokenizers(
        settings: Settings,
        router: Router,
        tokenizers: crate::tokenize::Tokenizers,
    ) -> Arc<Self> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos() ^ (d.as_secs() as u32))
            .unwrap_or(0);
        let mut registry = Registry::new(router);
        // The flags' aliases; `start` merges in the fleet file's and checks them together.
        registry.set_aliases(
            settings
                .model_aliases
                .iter()
                .map(|(a, t)| (a.clone(), t.clone()))
                .collect(),
        );
        registry.set_strict_models(settings.strict_models);
        if settings.router.placement.enabled {
            registry.placement = Some(switchyard_core::placement::Planner::new(
                settings.router.placement.clone(),
            ));
        }
        let block_bytes = registry.router.block_bytes();
        let id_prefix = nanos ^ std::process::id().rotate_left(16);
        let sync =
            !settings.peers.is_empty() || settings.peer_discovery || settings.peer_dns.is_some();
        let peers = sync.then(|| {
            // A replica's name for its peers: random per process, so a restarted replica's
            // requests are never confused with its earlier life's.
            let origin = (u64::from(id_prefix) << 32)
                ^ u64::from(std::process::id())
                ^ u64::from(nanos).rotate_left(17);
            crate::peers::Peers::new(&settings.peers, origin)
        });
        Arc::new(Gateway {
            peers,
            block_bytes,
            tokenizers,
            tokenize_permits: Arc::new(tokio::sync::Semaphore::new(
                std::thread::available_parallelism().map_or(1, |n| n.get()),
            )),
            body_budget: crate::body_budget::BodyBudget::new(settings.max_body_memory),
            live: crate::live::Live::default(),
            shutdown: tokio::sync::Notify::new(),
            registry: Mutex::new(registry),
            upstream: Upstream::new(settings.connect_timeout),
            metrics: Metrics::new(),
            admission: Admission::default(),
            settings,
            started: Instant::now(),
            started_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            next_request: AtomicU64::new(1),
            id_prefix,
            shutting_down: AtomicBool::new(false),
        })
    }

    /// Adds the prompt's token ids to `prompt` when a tokenizer is configured for the target
    /// model and the prompt is chat messages or one text (`/v1/completions`); runs without the
    /// lock, on this thread.
    pub fn tokenize(
        &self,
        target: &Target,
        parsed: &ParsedRequest<'_>,
        kind: RequestKind,
        prompt: PreparedPrompt,
    ) -> PreparedPrompt {
        let Some(input) = self.tokenizer_input(parsed, kind) else {
            return prompt;
        };
        let (needed, chain) = self.tokenize_as_needed(target, parsed, &input, &prompt, usize::MAX);
        self.with_needed(prompt, needed, chain)
    }

    /// Tokenizes `input` as far as the router's exact match could use its ids
    /// ([`switchyard_core::Router::exact_horizon`], each call a short hold of the lock), at most
    /// `budget` bytes of new text, hashing the ids in the exact index's blocks on the way so
    /// that neither the horizon nor the route hashes them under the lock.
    fn tokenize_as_needed<S: AsRef<str>>(
        &self,
        target: &Target,
        parsed: &ParsedRequest<'_>,
        input: &crate::tokenize::Input<S>,
        prompt: &PreparedPrompt,
        budget: usize,
    ) -> (
        Result<crate::tokenize::Needed, crate::tokenize::Miss>,
        Option<ExactChain>,
    ) {
        let adapter = target.adapter.as_deref();
        let salt = parsed.cache_salt.as_deref();
        // One hold of the lock for what every prompt needs first (a prompt nothing publishes
        // for stops at the horizon of no ids: 0).
        let (held_bytes, block_tokens, first_horizon) = {
            let router = &mut self.registry.lock().router;
            (
                router.approx_held_bytes(prompt),
                router.exact_block_tokens(&target.model),
                router.exact_horizon(&target.model, adapter, salt, &[], None),
            )
        };
        let mut chain = block_tokens.map(|size| ExactChain::new(size, adapter));
        let mut horizon = |ids: &[u32]| {
            if ids.is_empty() {
                return first_horizon;
            }
            if let Some(chain) = chain.as_mut() {
                chain.extend(ids);
            }
            self.registry.lock().router.exact_horizon(
                &target.model,
                adapter,
                salt,
                ids,
                chain.as_ref(),
            )
        };
        let mut fresh_bytes = 0;
        let needed = self.tokenizers.ids_as_needed(
            &target.model,
            input,
            &mut horizon,
            held_bytes,
            budget,
            &mut fresh_bytes,
        );
        self.metrics.tokenizer_new_bytes("request", fresh_bytes);
        (needed, chain)
    }

    /// `prompt` with the ids the tokenizer gave as far as they were needed, counted by
    /// outcome. The part of a chat prompt left untokenized is not tokenized later either: if
    /// the conversation goes on, an instance then holds it and its next turn tokenizes it
    /// (once: the pieces' ids are cached), as that turn's new text would have been.
    fn with_needed(
        &self,
        prompt: PreparedPrompt,
        needed: Result<crate::tokenize::Needed, crate::tokenize::Miss>,
        chain: Option<ExactChain>,
    ) -> PreparedPrompt {
        use crate::tokenize::Needed;
        let hashed = |prompt: PreparedPrompt, ids: &[u32]| match chain {
            Some(mut chain) => {
                chain.extend(ids);
                prompt.with_exact_chain(chain)
            }
            None => prompt,
        };
        match needed {
            Ok(Needed::Whole(ids)) => {
                let prompt = hashed(prompt, &ids);
                self.with_ids(prompt, Ok(ids))
            }
            Ok(Needed::Prefix(ids, _)) if ids.is_empty() => {
                self.metrics.tokenized("not_needed");
                prompt
            }
            Ok(Needed::Prefix(ids, rest)) => {
                self.metrics.tokenized("prefix");
                hashed(prompt, &ids).with_token_prefix(ids, rest)
            }
            // Only the callers with a budget get this, and they tokenize whole instead.
            Ok(Needed::OverBudget) => prompt,
            Err(miss) => self.with_ids(prompt, Err(miss)),
        }
    }

    /// `prompt` with the tokenizer's ids, counted by outcome (a model without a tokenizer is
    /// not counted: with several models only some may have one).
    fn with_ids(
        &self,
        prompt: PreparedPrompt,
        ids: Result<Vec<u32>, crate::tokenize::Miss>,
    ) -> PreparedPrompt {
        match ids {
            Ok(ids) => {
                self.metrics.tokenized("ids");
                prompt.with_token_ids(ids)
            }
            Err(crate::tokenize::Miss::NoTokenizer) => prompt,
            Err(miss) => {
                self.metrics.tokenized(miss.label());
                prompt
            }
        }
    }

    /// As [`Gateway::tokenize`], but a prompt of [`TOKENIZE_ON_POOL_BYTES`] or more is
    /// tokenized on the blocking thread pool, at most one per CPU at once: tokenizing new text
    /// takes about a microsecond a token, and milliseconds on an async worker would stall every
    /// other connection it serves (their streamed tokens included).
    pub async fn tokenize_off_worker(
        &self,
        target: &Target,
        parsed: &ParsedRequest<'_>,
        kind: RequestKind,
        prompt: PreparedPrompt,
    ) -> PreparedPrompt {
        let Some(input) = self.tokenizer_input(parsed, kind) else {
            return self.hash_client_ids(target, prompt);
        };
        // On this worker as far as the match needs, up to the budget of new text; a prompt
        // that needs more goes whole to the pool.
        let (needed, chain) =
            self.tokenize_as_needed(target, parsed, &input, &prompt, TOKENIZE_ON_POOL_BYTES);
        if let Ok(crate::tokenize::Needed::OverBudget) = needed {
            let ids = self
                .tokenize_on_pool(&target.model, input.to_owned_input())
                .await;
            return self.with_ids(prompt, ids);
        }
        self.with_needed(prompt, needed, chain)
    }

    /// `prompt` with the client's token ids (a `/v1/completions` prompt of ids) hashed in the
    /// exact index's blocks, here rather than under the router's lock.
    fn hash_client_ids(&self, target: &Target, prompt: PreparedPrompt) -> PreparedPrompt {
        let Some(ids) = prompt.token_ids() else {
            return prompt;
        };
        let Some(size) = self
            .registry
            .lock()
            .router
            .exact_block_tokens(&target.model)
        else {
            return prompt;
        };
        let mut chain = ExactChain::new(size, target.adapter.as_deref());
        chain.extend(ids);
        prompt.with_exact_chain(chain)
    }

    /// What the tokenizer would take of a request; none without tokenizers or a prompt to
    /// tokenize.
    fn tokenizer_input<'p>(
        &self,
        parsed: &'p ParsedRequest<'_>,
        kind: RequestKind,
    ) -> Option<crate::tokenize::Input<&'p str>> {
        if self.tokenizers.is_empty() || kind != RequestKind::Generate {
            return None;
        }
        match (&parsed.messages, &parsed.prompt) {
            (Some(messages), _) => Some(crate::tokenize::Input::Chat(
                messages
                    .iter()
                    .map(|m| (m.role.as_ref(), m.content.as_ref()))
                    .collect(),
            )),
            (None, crate::parse::PromptText::Text(t)) => {
                Some(crate::tokenize::Input::Text(t.as_ref()))
            }
            _ => None,
        }
    }

    async fn tokenize_on_pool(
        &self,
        model: &str,
        input: crate::tokenize::Input<String>,
    ) -> Result<Vec<u32>, crate::tokenize::Miss> {
        // The semaphore is never closed; a request whose future is dropped while waiting
        // simply leaves the line.
        let Ok(permit) = self.tokenize_permits.clone().acquire_owned().await else {
            return Err(crate::tokenize::Miss::Unknown);
        };
        let tokenizers = self.tokenizers.clone();
        let model = model.to_string();
        let (ids, fresh_bytes) = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let mut fresh_bytes = 0;
            (
                tokenizers.ids_counted(&model, &input, &mut fresh_bytes),
                fresh_bytes,
            )
        })
        .await
        .unwrap_or((Err(crate::tokenize::Miss::Unknown), 0));
        self.metrics.tokenizer_new_bytes("request", fresh_bytes);
        ids
    }

    /// What to keep of a request so that its answer can be warmed ([`Gateway::warm_answer`]):
    /// only where its prompt was tokenized (an instance of the model publishes trusted KV
    /// events, so the next turn will be tokenized too) and the model's tokenizer has a piece
    /// cache. The question is warmed along with the answer only in a conversation that has
    /// gone on before (an assistant message in it) or names its session (`x-session-id`), so
    /// one-off prompts do not pay to tokenize text no next turn may send; a text prompt
    /// (`/v1/completions`), which shows no turns, only with a session.
    pub fn answer_warm(
        &self,
        target: &Target,
        parsed: &ParsedRequest<'_>,
        prompt: &PreparedPrompt,
    ) -> Option<Arc<AnswerWarm>> {
        if !self.settings.answer_warmup || prompt.token_ids().is_none() {
            return None;
        }
        let session = parsed.session_id.is_some();
        let (chat, with_question) = match (&parsed.messages, &parsed.prompt) {
            (Some(messages), _) => (
                true,
                session || messages.iter().any(|m| m.role == "assistant"),
            ),
            (None, crate::parse::PromptText::Text(_)) if session => (false, true),
            _ => return None,
        };
        // Checked before anything is copied: most prompts of a one-piece tokenizer are not
        // warmed at all.
        if !self.tokenizers.can_warm(&target.model, chat, with_question) {
            return None;
        }
        let prompt = match (&parsed.messages, &parsed.prompt) {
            (Some(messages), _) => crate::tokenize::Input::Chat(
                messages
                    .iter()
                    .map(|m| (m.role.to_string(), m.content.to_string()))
                    .collect(),
            ),
            (None, crate::parse::PromptText::Text(t)) => {
                crate::tokenize::Input::Text(t.to_string())
            }
            _ => return None,
        };
        Some(Arc::new(AnswerWarm {
            model: target.model.clone(),
            prompt,
            with_question,
        }))
    }

    /// Tokenizes a finished answer (and, per [`AnswerWarm`], its question) into the
    /// tokenizer's caches, off every request's path: a short answer alone as a task on the
    /// runtime, anything longer on the blocking pool when a tokenizing thread is free (else
    /// not at all: the next turn then tokenizes it as before). Not on an async worker: its
    /// requests would wait.
    pub fn warm_answer(self: &Arc<Self>, warm: Arc<AnswerWarm>, answer: String) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let long = warm.with_question || answer.len() >= WARM_ON_WORKER_BYTES;
        let permit = if long {
            match self.tokenize_permits.clone().try_acquire_owned() {
                Ok(permit) => Some(permit),
                Err(_) => {
                    self.metrics.tokenizer_warmup("busy");
                    return;
                }
            }
        } else {
            None
        };
        let gw = self.clone();
        let work = move || {
            let _permit = permit;
            let (model, with_question) = (&warm.model, warm.with_question);
            let warmed = match &warm.prompt {
                crate::tokenize::Input::Chat(messages) => {
                    let mut messages: Vec<(&str, &str)> = messages
                        .iter()
                        .map(|(role, content)| (role.as_str(), content.as_str()))
                        .collect();
                    messages.push(("assistant", answer.as_str()));
                    let continued = crate::tokenize::Input::Chat(messages);
                    gw.tokenizers.warm(model, &continued, with_question)
                }
                crate::tokenize::Input::Text(prompt) => {
                    let continued = crate::tokenize::Input::Text(format!("{prompt}{answer}"));
                    gw.tokenizers.warm(model, &continued, with_question)
                }
            };
            match warmed {
                Some(0) => gw.metrics.tokenizer_warmup("cached"),
                Some(fresh) => {
                    gw.metrics.tokenizer_warmup("warmed");
                    gw.metrics.tokenizer_new_bytes("warmup", fresh);
                }
                None => gw.metrics.tokenizer_warmup("skipped"),
            }
        };
        if long {
            runtime.spawn_blocking(work);
        } else {
            runtime.spawn(async move { work() });
        }
    }

    /// Seconds since the gateway started: the router's clock.
    pub fn now(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// The router's clock at `at`.
    pub fn seconds_at(&self, at: Instant) -> f64 {
        at.saturating_duration_since(self.started).as_secs_f64()
    }

    /// Unix time the gateway started (`created` in `/v1/models`).
    pub fn started_unix(&self) -> u64 {
        self.started_unix
    }

    /// A fresh router request id and its printable form (for `x-request-id` when the client
    /// sent none).
    pub fn next_request(&self) -> RequestId {
        RequestId(self.next_request.fetch_add(1, Ordering::Relaxed))
    }

    /// The generated `x-request-id` for `id`.
    pub fn request_id_header(&self, id: RequestId) -> HeaderValue {
        // `sy-{prefix:08x}-{id:x}`, written by hand: `format!` was a visible cost per request.
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut buf = [0u8; 3 + 8 + 1 + 16];
        buf[..3].copy_from_slice(b"sy-");
        for (k, b) in buf[3..11].iter_mut().enumerate() {
            *b = HEX[((self.id_prefix >> (28 - 4 * k)) & 0xf) as usize];
        }
        buf[11] = b'-';
        let digits = (64 - id.0.leading_zeros()).div_ceil(4).max(1) as usize;
        for k in 0..digits {
            buf[12 + k] = HEX[((id.0 >> (4 * (digits - 1 - k))) & 0xf) as usize];
        }
        // Hex digits and dashes are always a valid header value.
        HeaderValue::from_bytes(&buf[..12 + digits]).unwrap_or(HeaderValue::from_static("sy"))
    }

    /// Applies one observation under the lock; the router's predictions against outcomes go
    /// to the metrics outside it.
    pub fn observe(&self, observation: Observation) {
        let now = self.now();
        let mut predictions = Vec::new();
        if let Some(peers) = &self.peers {
            peers.observed(&self.metrics, &observation);
        }
        {
            let mut registry = self.registry.lock();
            registry.observe(observation, now);
            registry.router.take_predictions(&mut predictions);
        }
        for p in predictions {
            match p {
                Prediction::Ttft {
                    estimated_s,
                    observed_s,
                } if estimated_s > 0.0 => {
                    self.metrics
                        .ttft_prediction_ratio
                        .observe(observed_s / estimated_s);
                    self.live.predicted(now, estimated_s, observed_s);
                }
                Prediction::Ttft { .. } => {}
                Prediction::Cached { .. } => self
                    .metrics
                    .cached_prediction_error
                    .observe(p.relative_error()),
            }
        }
    }

    /// Tells the router the health a backend should have, if it changed.
    pub fn sync_health(&self, backend: &Backend) {
        let want = backend.core_health();
        let now = self.now();
        let mut registry = self.registry.lock();
        let current = registry.router.fleet().get(backend.id).map(|i| i.health);
        if current.is_some() && current != Some(want) {
            registry.observe(Observation::HealthChanged(backend.id, want), now);
        }
        drop(registry);
        // A readmitted backend may clear saturation.
        self.admission.wake();
    }

    /// Starts refusing new requests (graceful shutdown).
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::Release);
        self.admission.wake();
        self.shutdown.notify_waiters();
    }

    /// Resolves once shutdown has begun (at once if it has).
    pub async fn shutdown_begun(&self) {
        loop {
            // Registered before the check: a `begin_shutdown` in between still wakes it.
            let notified = self.shutdown.notified();
            if self.is_shutting_down() {
                return;
            }
            notified.await;
        }
    }

    /// Whether shutdown has begun.
    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::BackendMetrics;

    fn registry(backends: &[(&str, &str, &[&str])]) -> Registry {
        let mut registry = Registry::new(Router::new(Default::default()).unwrap());
        for (name, model, adapters) in backends {
            let spec = BackendSpec {
                name: name.to_string(),
                address: format!("http://127.0.0.1:1/{name}"),
                models: vec![model.to_string()],
                adapters: adapters.iter().map(|a| a.to_string()).collect(),
                ..BackendSpec::default()
            };
            let id = registry.router.add_instance(spec.instance_spec()).unwrap();
            let b = Backend::new(spec.clone(), spec, id, BackendMetrics::detached()).unwrap();
            registry.insert(Arc::new(b));
        }
        registry
    }

    fn aliases(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(a, t)| (a.to_string(), t.to_string()))
            .collect()
    }

    fn route(registry: &mut Registry, model: &str) -> Result<Option<String>, ModelError> {
        let body = format!(r#"{{"model":"{model}","prompt":"hi"}}"#);
        let parsed = crate::parse::parse(body.as_bytes(), None).unwrap();
        let target = registry.target(&parsed.model)?;
        let prompt = target.prepare(
            &parsed,
            RequestKind::Generate,
            registry.router.block_bytes(),
        );
        registry.route(&parsed, &target, &prompt, RequestKind::Generate, 0.0)?;
        Ok(target.upstream_model)
    }

    #[test]
    fn routing_reports_the_model_to_send_upstream() {
        let mut b = registry(&[("a", "llama", &["sql-lora"]), ("b", "qwen", &[])]);
        b.set_aliases(aliases(&[("gpt-4o", "qwen"), ("sql", "sql-lora")]));
        assert_eq!(route(&mut b, "qwen"), Ok(None));
        assert_eq!(route(&mut b, "sql-lora"), Ok(None));
        assert_eq!(route(&mut b, "gpt-4o"), Ok(Some("qwen".into())));
        assert_eq!(route(&mut b, "sql"), Ok(Some("sql-lora".into())));
        assert_eq!(
            route(&mut b, "other"),
            Err(ModelError::Unknown("other".into()))
        );
        // Embeddings resolve the same way, through the same router.
        let parsed = crate::parse::parse(br#"{"model":"gpt-4o","input":"x"}"#, None).unwrap();
        let target = b.target(&parsed.model).unwrap();
        let prompt = target.prepare(&parsed, RequestKind::Embed, b.router.block_bytes());
        let decision = b
            .route(&parsed, &target, &prompt, RequestKind::Embed, 0.0)
            .unwrap();
        let upstream = target.upstream_model.as_deref();
        assert_eq!((decision.eligible, upstream), (1, Some("qwen")));
        // Placed by load: no prefix looked up, nothing to decode.
        let best = decision.eligible_candidates()[0].instance;
        let plan = decision.plan_for(best);
        assert_eq!(plan.indexed_blocks(), 0);
        assert_eq!(plan.max_tokens(), 0);
    }

    #[test]
    fn a_single_model_brain_falls_back_and_remembers_the_name() {
        let mut b = registry(&[("a", "llama", &[]), ("b", "llama", &[])]);
        assert_eq!(route(&mut b, "gpt-4o"), Ok(Some("llama".into())));
        assert_eq!(route(&mut b, "gpt-4o"), Ok(Some("llama".into())));
        assert_eq!(b.fallback_log.len(), 1);
        b.set_strict_models(true);
        assert_eq!(
            route(&mut b, "gpt-4o"),
            Err(ModelError::Unknown("gpt-4o".into()))
        );
    }

    #[test]
    fn the_listing_shows_aliases_whose_target_is_served() {
        let mut b = registry(&[("a", "llama", &["sql-lora"]), ("b", "qwen", &[])]);
        b.set_aliases(aliases(&[
            ("gpt-4o", "qwen"),
            ("sql", "sql-lora"),
            ("broken", "nowhere"),
            ("llama", "qwen"),
        ]));
        let l = b.listing();
        let entry = |id: &str| l.get(id).map(|(r, p)| (r.as_str(), p.as_deref()));
        assert_eq!(entry("gpt-4o"), Some(("qwen", None)));
        assert_eq!(entry("sql"), Some(("sql-lora", Some("llama"))));
        assert_eq!(entry("sql-lora"), Some(("sql-lora", Some("llama"))));
        assert_eq!(entry("qwen"), Some(("qwen", None)));
        // An alias shadows the served name, as in routing.
        assert_eq!(entry("llama"), Some(("qwen", None)));
        assert_eq!(entry("broken"), None);
        assert_eq!(l.len(), 5);
    }

    #[test]
    fn generated_request_ids_read_as_before() {
        let gw = Gateway::new(
            Settings::default(),
            Router::new(Default::default()).unwrap(),
        );
        for id in [0u64, 1, 15, 16, 255, 0xdead_beef, u64::MAX] {
            let want = format!("sy-{:08x}-{:x}", gw.id_prefix, id);
            assert_eq!(gw.request_id_header(RequestId(id)).to_str().unwrap(), want);
        }
    }
}
