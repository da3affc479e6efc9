//! Disaggregated serving: when the router splits a request into a prefill and a decode, the
//! gateway hands it from one instance to the other in one of two wire styles.
//!
//! * [`nixl`] — vLLM's NixlConnector: the prefill leg first (non-streamed, one token,
//!   `kv_transfer_params.do_remote_decode`), then the decode leg with the `kv_transfer_params`
//!   the prefill answered.
//! * [`sglang`] — SGLang: both legs at once, the same body with `bootstrap_host`,
//!   `bootstrap_port` and a fresh `bootstrap_room` pairing them.
//!
//! Which style a request uses is configuration ([`PdStyle`]): `--pd-style` for the whole
//! gateway, and a prefill backend configured with a `bootstrap_port` is SGLang-style whatever
//! that says. A request takes the style of its best prefill candidate and retries only on
//! prefill candidates of the same style. [`leg`] sends one leg to its ranked candidates, each
//! leg recorded in the router as its own request.

pub mod body;
mod leg;
pub mod nixl;
pub mod sglang;

use std::sync::Arc;
use std::time::Instant;

use axum::response::Response;
use http::request::Parts;
use http::{HeaderName, HeaderValue};
use switchyard_core::Observation;

use crate::backends::{Backend, BackendSpec};
use crate::error::ApiError;
use crate::forward::{reject, Routed};
use crate::state::Gateway;

/// Debug header naming the prefill backend of a disaggregated request.
pub static PREFILL: HeaderName = HeaderName::from_static("x-switchyard-prefill");

/// SGLang's default disaggregation bootstrap port (`--disaggregation-bootstrap-port`).
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

pub use crate::backends::PdStyle;

/// The style of a prefill backend: SGLang when it has a bootstrap port, else the default.
pub fn style_of(spec: &BackendSpec, default: PdStyle) -> PdStyle {
    if spec.bootstrap_port.is_some() {
        PdStyle::Sglang
    } else {
        default
    }
}

/// Serves a disaggregated request in the style of its best prefill candidate.
pub(crate) async fn serve(
    gw: &Arc<Gateway>,
    mut routed: Routed,
    parts: &Parts,
    body: &[u8],
    request_id: &HeaderValue,
    inject_usage: bool,
    started: Instant,
) -> Response {
    let original = match body::RawObject::parse(body) {
        Some(o) => o,
        None => {
            unsent(gw, &routed);
            let e = ApiError::malformed("expected a JSON object");
            return reject(gw, e, request_id);
        }
    };
    let default = gw.settings.pd_style;
    let Some(style) = routed
        .candidates
        .first()
        .map(|b| style_of(&b.spec, default))
    else {
        unsent(gw, &routed);
        return reject(gw, ApiError::no_backend(&model_of(&original)), request_id);
    };
    routed
        .candidates
        .retain(|b| style_of(&b.spec, default) == style);
    let decode = decode_candidates(gw, &routed);
    if decode.candidates.is_empty() {
        // Nothing could take the decode: do not run the prefill for nothing.
        unsent(gw, &routed);
        let e = leg::exhausted("decode", &model_of(&original), &[], true);
        return reject(gw, e, request_id);
    }
    // With `--peer`, the decode leg's pick is shared when it is sent (the prefill leg's, the
    // router's own pick, was shared by the proxy).
    let shared = gw.peers.as_ref().map(|_| {
        let chat = parts.uri.path().ends_with("/chat/completions");
        Arc::new(SharedLeg {
            endpoint: if chat {
                crate::peers::WireEndpoint::Chat
            } else {
                crate::peers::WireEndpoint::Completions
            },
            session: parts
                .headers
                .get(&crate::parse::SESSION_ID)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string),
            body: bytes::Bytes::copy_from_slice(body),
        })
    });
    let request = Request {
        parts,
        request_id,
        started,
        strip_usage: inject_usage
            && original.bool("stream") == Some(true)
            && !original.contains("stream_options"),
        original,
        shared,
    };
    match style {
        PdStyle::Nixl => nixl::serve(gw, routed, decode, request).await,
        PdStyle::Sglang => sglang::serve(gw, routed, decode, request).await,
    }
}

/// What both styles need to know about the client's request.
pub(crate) struct Request<'a> {
    /// The client's request head (method, path, headers).
    pub(crate) parts: &'a Parts,
    /// The request id sent upstream and back.
    pub(crate) request_id: &'a HeaderValue,
    /// When the request arrived.
    pub(crate) started: Instant,
    /// The client streams without `stream_options`: ask for usage and strip it again.
    pub(crate) strip_usage: bool,
    /// The client's body, as its top-level members.
    pub(crate) original: body::RawObject<'a>,
    /// With `--peer`: what the peers need to commit the decode leg's pick.
    pub(crate) shared: Option<Arc<SharedLeg>>,
}

/// What a peer replica needs to commit a leg's pick as its own request (`--peer`): the client's
/// endpoint, session and body (the leg bodies are rewritten for the engines).
pub struct SharedLeg {
    /// The client's endpoint.
    pub endpoint: crate::peers::WireEndpoint,
    /// The client's `x-session-id`.
    pub session: Option<String>,
    /// The client's body.
    pub body: bytes::Bytes,
}

/// The decode leg as its own request in the router: a new id over the eligible decode
/// candidates (at most `max_retries + 1`), with the decision and its explanation.
fn decode_candidates(gw: &Gateway, prefill: &Routed) -> Routed {
    let max = gw.settings.max_retries as usize + 1;
    let candidates: Vec<Arc<Backend>> = match &prefill.decision {
        Some(d) => {
            let registry = gw.registry.lock();
            d.decode[..d.decode_eligible]
                .iter()
                .take(max)
                .filter_map(|c| registry.backend(c.instance).cloned())
                .collect()
        }
        None => Vec::new(),
    };
    Routed {
        rid: gw.next_request(),
        decision: prefill.decision.clone(),
        candidates,
        prompt_tokens: prefill.prompt_tokens,
        explain: prefill.explain.clone(),
        upstream_model: None,
        warm: None,
    }
}

/// Settles a request the router recorded as `Routed` (its first candidate) but that is never
/// sent, so the router does not count it in flight forever.
fn unsent(gw: &Gateway, routed: &Routed) {
    gw.observe(Observation::Failed(routed.rid));
    gw.admission.wake();
}

/// The `model` of a request body (for error messages).
fn model_of(body: &body::RawObject<'_>) -> String {
    body.string("model").unwrap_or_default()
}

/// Adds the prefill backend's name to a response, when debug headers are on.
fn name_prefill(gw: &Gateway, response: &mut Response, prefill: &Backend) {
    if gw.settings.debug_header {
        if let Ok(v) = HeaderValue::from_str(prefill.name()) {
            response.headers_mut().insert(PREFILL.clone(), v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn styles_parse_and_print() {
        assert_eq!("nixl".parse::<PdStyle>(), Ok(PdStyle::Nixl));
        assert_eq!("vllm".parse::<PdStyle>(), Ok(PdStyle::Nixl));
        assert_eq!("sglang".parse::<PdStyle>(), Ok(PdStyle::Sglang));
        assert!("mooncake".parse::<PdStyle>().is_err());
        assert_eq!(PdStyle::Sglang.to_string(), "sglang");
        assert_eq!(PdStyle::default(), PdStyle::Nixl);
    }

    #[test]
    fn a_bootstrap_port_makes_a_backend_sglang_style() {
        let plain = BackendSpec::parse_flag("h:1,role=prefill").unwrap();
        let sglang = BackendSpec::parse_flag("h:2,role=prefill,bootstrap_port=9000").unwrap();
        assert_eq!(style_of(&plain, PdStyle::Nixl), PdStyle::Nixl);
        assert_eq!(style_of(&plain, PdStyle::Sglang), PdStyle::Sglang);
        assert_eq!(style_of(&sglang, PdStyle::Nixl), PdStyle::Sglang);
    }
}
